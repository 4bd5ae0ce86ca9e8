"""What a head learns from, per shard of token ids: features, final states, target argmax.

A shard of smollm2_data holds token ids only. ``shard_features`` prefills each sequence once
with the target and keeps, for the window of ``CONTEXT`` prompt tokens then the reply, each
position's fused features (the residuals entering the feature layers), the target's final normed
state (its logits are recomputed over the draft vocabulary in the loss: H numbers a position
instead of V) and the target's argmax over the full vocabulary (a position whose argmax lies
outside the draft vocabulary is masked, as EAGLE-3 does with t2d). The windows are packed back
to back (no padding), and written once per shard to ``<cache>/shard_NNNNN.safetensors`` with
the settings that made them, so a resumed run, or a second process, reads them instead of
prefilling again (prefill is ~400 positions/s a core on SmolLM2-135M, 2-5x the cost of a
training pass over the same positions).

``Packed`` holds many shards' windows; ``batch`` gathers windows of similar length into a
padded [B, T] batch (windows sorted by length, a random run of neighbours), so a batch pays for
little padding: replies run from a few tokens to 320.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from rheo_engine.io.weights import save_safetensors
from rheo_engine.models.linear import linear
from rheo_engine.models.llama import LlamaModel

CONTEXT = 16  # prompt tokens kept before each reply in a window
FORMAT = "rheo-head-features-v1"


@dataclass
class Packed:
    """Windows back to back: window k is positions offsets[k]:offsets[k + 1]."""

    tokens: torch.Tensor  # [P] int64
    features: torch.Tensor  # [P, F] bf16/fp32
    hidden: torch.Tensor  # [P, H] bf16/fp32, final normed state
    argmax: torch.Tensor  # [P] int64, the target's argmax over the full vocabulary
    offsets: torch.Tensor  # [n + 1] int64

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @staticmethod
    def cat(parts: list[Packed]) -> Packed:
        shift = torch.tensor([0] + [int(p.offsets[-1]) for p in parts]).cumsum(0)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s
                                                      for p, s in zip(parts, shift, strict=False)])
        return Packed(torch.cat([p.tokens for p in parts]), torch.cat([p.features for p in parts]),
                      torch.cat([p.hidden for p in parts]), torch.cat([p.argmax for p in parts]),
                      offsets)  # fmt: skip

    def batch(self, windows: torch.Tensor,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:  # fmt: skip
        """(tokens [B, T], features [B, T, F] fp32, hidden [B, T, H], lengths [B], argmax [B, T])
        of the given windows, zero-padded to the longest of them, on ``device``."""
        lengths = self.lengths[windows]
        B, T = len(windows), int(lengths.max())
        pos = self.offsets[windows].unsqueeze(1) + torch.arange(T)  # [B, T]
        valid = torch.arange(T) < lengths.unsqueeze(1)
        pos = torch.where(valid, pos, 0)
        mask = valid.unsqueeze(-1)
        out = (torch.where(valid, self.tokens[pos], 0),
               torch.where(mask, self.features[pos].float(), 0.0),
               torch.where(mask, self.hidden[pos], 0), lengths,
               torch.where(valid, self.argmax[pos], 0))  # fmt: skip
        return tuple(t.to(device) for t in out)


class LengthBatches:
    """Batches of windows of similar length: the windows sorted by length, a batch a run of
    neighbours from a random start, drawn with ``gen``."""

    def __init__(self, data: Packed, positions: int) -> None:
        self.data, self.positions = data, positions
        self.order = torch.sort(data.lengths, stable=True).indices

    def draw(self, gen: torch.Generator) -> torch.Tensor:
        """A run from a random start: as many neighbours as fit ``positions`` when padded to
        the run's longest (at least one)."""
        n, lengths = len(self.order), self.data.lengths
        start = int(torch.randint(n, (1,), generator=gen))
        B = min(n - start, max(1, self.positions // int(lengths[self.order[start]])))
        while B > 1 and B * int(lengths[self.order[start + B - 1]]) > self.positions:
            B -= 1
        return self.order[start : start + B]


def settings_of(target_file: Path, feature_layers: tuple[int, ...], dtype: torch.dtype) -> dict:
    st = target_file.stat()
    return {"format": FORMAT, "target": str(target_file), "target_bytes": st.st_size,
            "feature_layers": list(feature_layers), "dtype": str(dtype).split(".")[-1],
            "context": CONTEXT}  # fmt: skip


@torch.no_grad()
def shard_features(target: LlamaModel, seqs: list[tuple[np.ndarray, int]],
                   feature_layers: tuple[int, ...], store: torch.dtype) -> Packed:  # fmt: skip
    """Prefill each sequence whole; keep its window [prompt_len - CONTEXT, length)."""
    tokens, features, hidden, argmax, lengths = [], [], [], [], [0]
    lm = target.lm_head
    for ids, prompt_len in seqs:
        L = len(ids)
        x = torch.from_numpy(ids).unsqueeze(0).to(target.device)
        cache = target.new_cache(L, 1)
        h, f = target.forward(x, torch.arange(L, device=target.device).unsqueeze(0), cache,
                              None, feature_layers, output_hidden=True)  # fmt: skip
        a = max(0, prompt_len - CONTEXT)
        hw = h[0, a:]
        tokens.append(x[0, a:].cpu())
        features.append(f[0, a:].to("cpu", store))
        hidden.append(hw.to("cpu", store))
        # The engine's matmul (kernels.skinny_linear): torch's bf16 GEMM on a CPU without bf16
        # instructions (AVX2) took ~10x the prefill itself for this [L, 576] x [576, 49152].
        argmax.append(linear(hw, lm.to(hw.dtype)).argmax(-1).cpu())
        lengths.append(L - a)
    return Packed(torch.cat(tokens), torch.cat(features), torch.cat(hidden), torch.cat(argmax),
                  torch.tensor(lengths).cumsum(0))  # fmt: skip


def save_packed(p: Packed, path: Path, settings: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tensors = {"tokens": p.tokens, "features": p.features, "hidden": p.hidden,
               "argmax": p.argmax, "offsets": p.offsets}  # fmt: skip
    save_safetensors(tensors, tmp)
    path.with_suffix(".json").write_text(json.dumps(settings))
    tmp.replace(path)


def load_packed(path: Path, settings: dict) -> Packed | None:
    """The cached windows of ``path`` when they were made with ``settings``, else None."""
    if not is_cached(path, settings):
        return None
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    return Packed(t["tokens"], t["features"], t["hidden"], t["argmax"], t["offsets"])


def is_cached(path: Path, settings: dict) -> bool:
    """Whether ``path`` holds windows made with ``settings`` (``load_packed`` would read them)."""
    meta = path.with_suffix(".json")
    return path.is_file() and meta.is_file() and json.loads(meta.read_text()) == settings


def load_packed_many(paths: list[Path], spill: Path | None = None) -> Packed:
    """The cached windows of every path, back to back, as ``Packed.cat`` of each would give.

    The tensors are allocated once, from the files' headers, and each file is read into its
    place in turn: the peak is the total plus one file, not twice the total (two million
    positions of SmolLM2's features are ~9 GB; the parts and their concatenation together did
    not fit beside anything else on a 24 GB machine). ``spill``: a folder where the features
    and final states are held in file mappings (shared, the files unlinked at once, so they go
    with the process) rather than in anonymous memory: page cache, which the kernel writes back
    and evicts under pressure instead of killing the process (2.86M positions of SmolLM2 took
    13 GB beside ~4 GB of training, and an OOM kill took a run on a 24 GB machine)."""
    names = ("tokens", "features", "hidden", "argmax")
    rows, windows, like = 0, 0, {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            rows += f.get_slice("tokens").get_shape()[0]
            windows += f.get_slice("offsets").get_shape()[0] - 1
            if not like:
                like = {k: f.get_slice(k)[:0] for k in names}  # dtype and trailing shape
    out = {k: _allocated(k, (rows, *t.shape[1:]), t.dtype, spill if k in ("features", "hidden")
                         else None) for k, t in like.items()}  # fmt: skip
    offsets = torch.zeros(windows + 1, dtype=torch.int64)
    r, w = 0, 0
    for path in paths:
        with safe_open(str(path), "pt") as f:
            off = f.get_tensor("offsets")
            n = int(off[-1] - off[0])
            for k in names:
                t = f.get_tensor(k)
                if t.shape[0] != n or t.shape[1:] != out[k].shape[1:] or t.dtype != out[k].dtype:
                    raise ValueError(f"{path}: {k} {tuple(t.shape)} {t.dtype} does not match the "
                                     f"other files' {tuple(out[k].shape[1:])} {out[k].dtype}; "
                                     "delete it to compute it again")  # fmt: skip
                out[k][r : r + n] = t
                del t
        offsets[w + 1 : w + len(off)] = off[1:] - off[0] + r
        r, w = r + n, w + len(off) - 1
    return Packed(out["tokens"], out["features"], out["hidden"], out["argmax"], offsets)


def _allocated(name: str, shape: tuple[int, ...], dtype: torch.dtype,
               spill: Path | None) -> torch.Tensor:  # fmt: skip
    """An uninitialised tensor; with ``spill``, a shared mapping of a file there, unlinked at
    once (its blocks are freed when the last mapping goes)."""
    n = int(np.prod(shape))
    if spill is None or n == 0:
        return torch.empty(shape, dtype=dtype)
    spill.mkdir(parents=True, exist_ok=True)
    path = spill / f"{name}.{os.getpid()}.spill"
    path.unlink(missing_ok=True)
    try:
        return torch.from_file(str(path), shared=True, size=n, dtype=dtype).view(shape)
    finally:
        path.unlink(missing_ok=True)


def spill_folder(paths: list[Path], folder: Path, share: float = 0.5) -> Path | None:
    """``folder`` when the features and final states of ``paths`` (their files' bytes, about)
    exceed ``share`` of the memory available now (Linux /proc/meminfo) and the folder's disk
    has room for them (a write to a mapping of a full disk would kill the process), else
    None."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None
    available = info.get("MemAvailable")
    total = sum(p.stat().st_size for p in paths)
    if available is None or total <= share * available:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return folder if shutil.disk_usage(folder).free > 1.2 * total else None


def cached_features(cache: Path | None, name: str, make, settings: dict) -> tuple[Packed, bool]:
    """(windows, computed now?): read ``cache/name.safetensors`` or make and keep them."""
    path = None if cache is None else cache / f"{name}.safetensors"
    if path is not None and (got := load_packed(path, settings)) is not None:
        return got, False
    t0 = time.perf_counter()
    p = make()
    if path is not None:
        cache.mkdir(parents=True, exist_ok=True)
        save_packed(p, path, settings)
    rate = int(p.offsets[-1]) / max(time.perf_counter() - t0, 1e-9)
    print(f"[{time.strftime('%H:%M:%S')}] features of {name}: {len(p)} windows, "
          f"{int(p.offsets[-1])} positions, {rate:.0f} positions/s", flush=True)  # fmt: skip
    return p, True
