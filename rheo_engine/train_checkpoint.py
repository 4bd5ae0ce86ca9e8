"""Resumable checkpoints of train_target.py, without pickle.

``ckpt.safetensors`` holds the model (``model.*``), AdamW's moments and step counts
(``opt.{i}.*``, i = the parameter's index in the optimizer's groups) and the data sampler's RNG
state (``rng``); ``ckpt.json`` holds the training config and the progress counters. With all
three restored, a resumed run continues bit for bit as if it had never stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rheo_engine.weights import load_safetensors, save_safetensors


def save_checkpoint(
    work: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
    config: dict,
    progress: dict,
) -> None:
    """Write ``work``/ckpt.safetensors and ckpt.json, each replaced atomically."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, value in opt.state.get(p, {}).items():
            tensors[f"opt.{i}.{key}"] = value.reshape(-1) if key == "step" else value
    tensors["rng"] = gen.get_state()
    save_safetensors(tensors, work / "ckpt.safetensors.tmp")
    (work / "ckpt.json.tmp").write_text(json.dumps({"config": config, **progress}, indent=1))
    # Tensors first, JSON last: a ckpt.json always describes a complete ckpt.safetensors.
    os.replace(work / "ckpt.safetensors.tmp", work / "ckpt.safetensors")
    os.replace(work / "ckpt.json.tmp", work / "ckpt.json")


def load_checkpoint(
    work: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
    config: dict,
) -> dict:
    """Restore model, optimizer and RNG in place; returns the progress counters.

    Raises ValueError naming every setting that differs from ``config`` (the run's settings).
    """
    meta = json.loads((work / "ckpt.json").read_text())
    saved = meta.pop("config")
    diff = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
    if diff:
        raise ValueError(
            f"--resume: the checkpoint in {work} was trained with other settings "
            f"{{name: (checkpoint, now)}} = {diff}; pass the checkpoint's values or start afresh"
        )
    tensors = load_safetensors(work / "ckpt.safetensors")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        keys = [k for k in tensors if k.startswith(f"opt.{i}.")]
        if keys:
            # AdamW keeps its step count as a 0-d tensor; safetensors stored it as [1].
            opt.state[p] = {
                k.split(".", 2)[2]: tensors[k].reshape(()) if k.endswith(".step") else tensors[k]
                for k in keys
            }
    gen.set_state(tensors["rng"])
    return meta
