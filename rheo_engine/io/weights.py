"""Checkpoint tensors in and out, with safetensors only (no pickle: a checkpoint cannot run code).

An HF checkpoint directory holds either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _shard_files(d: Path) -> list[Path]:
    """The files of a checkpoint directory, checked to exist before anything is read."""
    if (d / _SINGLE).is_file():
        return [d / _SINGLE]
    index = d / _INDEX
    if not index.is_file():
        found = sorted(p.name for p in d.glob("*.safetensors")) + sorted(
            p.name for p in d.glob("*.bin")
        )
        raise FileNotFoundError(
            f"{d} has neither {_SINGLE} nor {_INDEX} (found {found or 'no weight files'}); "
            "save the model with safetensors (save_pretrained(..., safe_serialization=True)) or "
            "convert a llama2.c checkpoint with `python -m rheo_engine.io.convert llama2c`"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{index} is not a safetensors index (needs a 'weight_map' object): {e!r}; "
            "re-download or regenerate it"
        ) from e
    files = [d / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(
            f"{index} lists shards missing from {d}: {absent}; download the missing shards"
        )
    return files


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}); it is truncated or corrupt: "
            "re-download or re-save it"
        ) from e


def load_safetensors(path_or_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file, or of a checkpoint directory (single or sharded)."""
    p = Path(path_or_dir)
    if p.is_dir():
        files = _shard_files(p)
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"weights {p} not found; pass a .safetensors file or a model dir")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(_load_file(f))
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``tensors`` (contiguous, unshared copies) to ``path`` with HF's metadata."""
    out = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    save_file(out, str(path), metadata={"format": "pt"})
