"""Checkpoint tensors in and out, with safetensors only (no pickle: a checkpoint cannot run code).

An HF checkpoint directory holds either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _shard_files(d: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files of a checkpoint directory, checked to exist before anything is read, and the
    index's weight_map (tensor name -> shard file name) for a sharded one."""
    if (d / _SINGLE).is_file():
        return [d / _SINGLE], None
    index = d / _INDEX
    if not index.is_file():
        found = sorted(p.name for p in d.glob("*.safetensors")) + sorted(
            p.name for p in d.glob("*.bin")
        )
        pickles = any(name.startswith("pytorch_model") for name in found)
        fix = (
            "the engine loads no pickles: re-save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
            if pickles
            else "save the model with safetensors (save_pretrained(..., safe_serialization=True)) "
            "or convert a llama2.c checkpoint with `python -m rheo_engine.io.convert llama2c`"
        )
        raise FileNotFoundError(
            f"{d} has neither {_SINGLE} nor {_INDEX} (found {found or 'no weight files'}); {fix}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{index} is not a safetensors index (needs a 'weight_map' object): {e!r}; "
            "re-download or regenerate it"
        ) from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"{index}: 'weight_map' must map tensor names to shard file names; "
            "re-download or regenerate it"
        )
    files = [d / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(
            f"{index} lists shards missing from {d}: {absent}; download the missing shards"
        )
    return files, weight_map


def _check_shards(index: Path, weight_map: dict[str, str], held: dict[str, list[str]]) -> None:
    """Each tensor is in exactly the shard the index names: a tensor in two shards, in a shard
    the index does not name, or absent from its shard means the shards are from different
    saves, and loading would keep one copy silently."""
    twice = sorted(k for k, files in held.items() if len(files) > 1)
    if twice:
        raise ValueError(
            f"{index.parent}: tensor {twice[0]} is in {held[twice[0]]} ({len(twice)} tensors in "
            "more than one shard); the shards come from different saves: re-download them"
        )
    unlisted = sorted(k for k, files in held.items() if weight_map.get(k) != files[0])
    absent = sorted(k for k in weight_map if k not in held)
    if unlisted or absent:
        k = (unlisted or absent)[0]
        where = held[k][0] if k in held else "no shard"
        raise ValueError(
            f"{index} says {k} is in {weight_map.get(k, 'no shard')} but it is in {where} "
            f"({len(unlisted) + len(absent)} such tensors); the index and the shards disagree: "
            "re-download or regenerate them"
        )


_UNREADABLE = (SafetensorError, OSError, ValueError)  # what safetensors raises on bad bytes


def _unreadable(path: Path, e: BaseException) -> ValueError:
    return ValueError(
        f"{path} is not a readable safetensors file ({e}); it is truncated or corrupt: "
        "re-download or re-save it"
    )


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except _UNREADABLE as e:
        raise _unreadable(path, e) from e


def _checkpoint_files(path_or_dir: str | os.PathLike) -> tuple[Path, list[Path], dict | None]:
    """(the path, its files, the index's weight_map or None) of a ``.safetensors`` file or a
    checkpoint directory (single or sharded), every file checked to exist."""
    p = Path(path_or_dir)
    if p.is_dir():
        return (p, *_shard_files(p))
    if p.is_file():
        return p, [p], None
    raise FileNotFoundError(f"weights {p} not found; pass a .safetensors file or a model dir")


def load_safetensors(path_or_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file, or of a checkpoint directory (single or sharded)."""
    p, files, weight_map = _checkpoint_files(path_or_dir)
    tensors: dict[str, torch.Tensor] = {}
    held: dict[str, list[str]] = {}  # tensor name -> the files holding it
    for f in files:
        for name, t in _load_file(f).items():
            tensors[name] = t
            held.setdefault(name, []).append(f.name)
    if weight_map is not None:
        _check_shards(p / _INDEX, weight_map, held)
    return tensors


# safetensors' dtype names (its header) -> torch dtypes.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class LazyTensor:
    """A tensor of a safetensors file, not read yet: its shape and dtype from the header, its
    bytes (all, or one slice along a dimension) read on demand."""

    def __init__(self, path: Path, name: str, shape: list[int], dtype: str, owner: LazyWeights):
        self.path, self.name, self.owner = path, name, owner
        self.shape = torch.Size(shape)
        self.dtype = _ST_DTYPES.get(dtype, torch.uint8)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def dim(self) -> int:
        return len(self.shape)

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0]) if self.shape else self.owner.read(self)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.owner.read(self, dim, start, length)


class LazyWeights(dict):
    """Tensor name -> LazyTensor over a checkpoint's files (one, or the shards an index lists).
    ``read`` opens one file at a time; ``bytes_read`` and ``files_opened`` say what was read."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0
        self.files_opened: list[str] = []
        self._open: tuple[Path, object] | None = None

    def read(self, t: LazyTensor, dim: int = 0, start: int = 0, length: int | None = None):
        if self._open is None or self._open[0] != t.path:
            self.close()
            self._open = (t.path, safe_open(str(t.path), framework="pt"))
            self.files_opened.append(t.path.name)
        handle = self._open[1]
        try:
            if not t.shape:
                part = handle.get_tensor(t.name)
            else:
                length = t.shape[dim] if length is None else length
                index = [slice(None)] * len(t.shape)
                index[dim] = slice(start, start + length)
                part = handle.get_slice(t.name)[tuple(index)]
        except _UNREADABLE as e:
            raise ValueError(
                f"{t.path}: tensor {t.name} cannot be read ({e}); the file is truncated or "
                "corrupt: re-download or re-save it"
            ) from e
        self.bytes_read += part.numel() * part.element_size()
        return part

    def close(self) -> None:
        self._open = None


def open_safetensors(path_or_dir: str | os.PathLike) -> LazyWeights:
    """The tensors of a ``.safetensors`` file or checkpoint directory (single or sharded), as
    LazyTensors: headers read and checked as load_safetensors checks them, no tensor data read.
    A tensor-parallel rank reads only its parts (models.llama.rank_parts) through them."""
    p, files, weight_map = _checkpoint_files(path_or_dir)
    lazy = LazyWeights()
    held: dict[str, list[str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    lazy[name] = LazyTensor(f, name, piece.get_shape(), piece.get_dtype(), lazy)
                    held.setdefault(name, []).append(f.name)
        except _UNREADABLE as e:
            raise _unreadable(f, e) from e
    if weight_map is not None:
        _check_shards(p / _INDEX, weight_map, held)
    return lazy


def tensor_part(t, part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """A tensor, or a LazyTensor read, cut to ``part`` ((dim, start, length); None: whole)."""
    if part is None:
        return t.load() if isinstance(t, LazyTensor) else t
    return t.narrow(*part)


def read_parts(
    weights: dict, parts: dict[str, tuple[int, int, int] | None]
) -> dict[str, torch.Tensor]:
    """``weights[name]`` cut to ``parts[name]`` ((dim, start, length), or None: whole) for every
    name of ``parts``. LazyTensors are read file by file, in the files' order, each file once."""
    order = sorted(parts, key=lambda n: str(getattr(weights[n], "path", "")))
    out = {name: tensor_part(weights[name], parts[name]) for name in order}
    if isinstance(weights, LazyWeights):
        weights.close()
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``tensors`` (contiguous, unshared copies) to ``path`` with HF's metadata."""
    out = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    save_file(out, str(path), metadata={"format": "pt"})
