"""Convert an official EAGLE-3 head (config.json + pytorch_model.bin) to config.json +
model.safetensors, the only weight format the engine loads (docs/eagle3_format.md §1).

    python -m rheo_engine.io.convert eagle3 SRC_DIR OUT_DIR

The official training saves with DeepSpeed ``save_16bit_model``: a flat state dict pickled by
torch. This is the project's one pickle load, restricted to tensors (``weights_only=True``).
Tensors are written unchanged: names, dtypes (d2t int64, t2d bool) and values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.eagle3 import REQUIRED_KEYS


def _load_source(src: Path) -> dict[str, torch.Tensor]:
    """The head's state dict: pytorch_model.bin first (as EAGLE's loader), else safetensors."""
    bin_file, st_file = src / "pytorch_model.bin", src / "model.safetensors"
    if bin_file.is_file():
        try:
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a corrupt or unsafe pickle
            raise ValueError(
                f"cannot read {bin_file} as a tensors-only state dict ({err}); re-download the head"
            ) from err
    elif st_file.is_file():
        state = load_safetensors(st_file)
    else:
        raise FileNotFoundError(
            f"no head weights in {src}: expected pytorch_model.bin or model.safetensors"
        )
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{src}: the weights are not a flat {{name: tensor}} state dict")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"{src} is not an EAGLE-3 head: its weights lack {missing}; expected the official "
            "key names (fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d)"
        )
    return state


def convert_eagle3(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir``/config.json (copied byte for byte) and ``out_dir``/model.safetensors.

    Refuses an existing non-empty ``out_dir`` so a conversion never mixes with other files.
    """
    src, out = Path(src_dir), Path(out_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"EAGLE-3 head directory not found: {src}")
    config = src / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} not found; an EAGLE-3 head ships config.json")
    try:
        json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config} is not valid JSON ({err}); re-download the head") from err
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out_dir {out} exists and is not empty; pass a new or empty directory")
    state = _load_source(src)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, out / "config.json")
    save_safetensors(state, out / "model.safetensors")
    return out
