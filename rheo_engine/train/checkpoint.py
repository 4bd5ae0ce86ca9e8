"""What both trainers share: resumable checkpoints without pickle, the wall-clock budget, and
the atomic write of an output folder.

``ckpt.safetensors`` holds the model (``model.*``), AdamW's moments and step counts
(``opt.{i}.*``, i = the parameter's index in the optimizer's groups) and the data sampler's RNG
state (``rng``); ``ckpt.json`` holds the training config and the progress counters. With all
three restored, a resumed run continues bit for bit as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rheo_engine.io.weights import load_safetensors, save_safetensors


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


@dataclass
class Budget:
    """The wall-clock limit, counted from the start of the command."""

    start: float
    seconds: float

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A fresh OUT.tmp-<pid> to write into, renamed to ``out`` only when the block completes;
    on any error it is removed, so no half-written model folder is ever left behind."""
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            raise FileExistsError(f"--out {out} appeared while training; nothing was written")
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
