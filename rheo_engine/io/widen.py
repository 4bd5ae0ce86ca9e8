"""Widen a target + EAGLE-3 head pair to bigger sizes whose outputs equal the small pair's.

    python -m rheo_engine.io.convert widen SRC OUT --hidden 2048 --intermediate 8192 --layers 16

A stand-in with the compute of a ~1B-parameter Llama (the default sizes, for the default pair's
head_dim 32: 64 heads, 32 KV heads) that drafts and generates what the small pair does, so a
benchmark can time large-model steps on the trained pair's acceptance. Every weight of the small
pair sits in the top-left corner of its bigger tensor; everything else is zero:

* hidden h -> H: the residual stream's extra channels stay zero, because every matrix writing it
  (embedding, o_proj, down_proj, the head's fc) has zero rows there and every matrix reading it
  has zero columns there.
* RMSNorm over zero-padded x: ms_H = (h / H) ms_h. With eps' = eps h / H and w' = w sqrt(h / H),
  x / sqrt(ms_H + eps') * w' = x / (sqrt(h / H) sqrt(ms_h + eps)) * sqrt(h / H) w, the small
  norm exactly. Norm vectors are stored in float32 (sqrt(h / H) is not exact in bf16; they are
  a few KB); every other tensor keeps the source dtype.
* heads: head_dim D stays (RoPE is per head); H / D query heads and the KV heads scaled by the
  same factor, so the GQA group is unchanged and real query head i still reads KV head
  i // group. Extra heads have zero q/k/v rows and zero o_proj columns; extra MLP channels
  zero gate/up rows and zero down_proj columns.
* layers: the real layers come first and the extras are appended. An extra layer is all zeros
  (its o_proj and down_proj make it the identity on the residual stream), so the head's
  feature layer ids, the residuals entering real layers, keep their numbers; the widened head
  config states them explicitly, since EAGLE's default (2, N//2, N-3) depends on N.
* the head gets the target's new sizes: fc [H, k H] holds each of its k feature blocks at the
  start of the matching block, q/k/v [., 2 H] their [embedding, hidden] halves likewise;
  lm_head, its own embed_tokens (if any), d2t and t2d keep the vocabulary; a tied target stays
  tied.

In fp32 the logits agree to rounding (tests/test_widen.py: 1e-4); in bf16 each pair rounds its
own way. The widened pair is never committed: its place is .cache/widened/ (ensure_widened).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rheo_engine.config import ModelConfig, read_json_object
from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.eagle3 import IGNORED_SUFFIXES, REQUIRED_KEYS, HeadConfig, head_shapes
from rheo_engine.models.llama import check_weights, expected_shapes

DEFAULT_SIZES = {"hidden": 2048, "intermediate": 8192, "layers": 16}
WIDENED_DIR = Path(__file__).resolve().parents[2] / ".cache" / "widened"  # git-ignored
RECORD = "widen.json"  # in OUT: what it was made from; written first, marked complete last
_VERSION = 1  # bump when the widening changes, so ensure_widened rebuilds old outputs
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "original/tokenizer.model")  # fmt: skip
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The widened configs, and what the weights need: the source sizes they are padded from."""

    target: dict[str, Any]  # the widened target's config.json
    head: dict[str, Any]  # the widened head's config.json
    src_target: ModelConfig
    src_head: HeadConfig

    @property
    def target_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.target, "widened target config")

    @property
    def head_config(self) -> HeadConfig:
        return HeadConfig.from_dict(self.head, self.target_config, "widened head config")


def _check_src(src: Path) -> None:
    for part in ("target", "draft"):
        if not (src / part / "config.json").is_file():
            raise ValueError(
                f"SRC {src} lacks {part}/config.json: a pair directory holds target/ (an HF "
                "Llama) and draft/ (its EAGLE-3 head), as weights/default does; pass one"
            )


def _heads(H: int, cfg: ModelConfig | HeadConfig, who: str) -> tuple[int, int]:
    """(query heads, KV heads) of a width-H model at the source's head_dim D and GQA group."""
    D, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    if H % D:
        raise ValueError(
            f"hidden={H} is not a multiple of {who}head_dim={D} (heads keep their width, so the "
            f"widened model has hidden / head_dim heads); pass a multiple of {D}, e.g. "
            f"{-(-H // D) * D}"
        )
    group = heads // kv_heads
    if H // D < heads or (H // D) % group:
        raise ValueError(
            f"hidden={H} gives {H // D} query heads of {who}head_dim {D}, but the heads must be at "
            f"least the source's {heads} and a multiple of its GQA group {group} "
            f"(num_attention_heads / num_key_value_heads); pass a multiple of {D * group} "
            f"that is >= {heads * D}"
        )
    return H // D, H // D // group


def _check_sizes(
    hidden: int, intermediate: int, layers: int, t: ModelConfig, d: HeadConfig
) -> None:
    for name, value in (("hidden", hidden), ("intermediate", intermediate), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an int; pass a whole number")
    for name, value, src, who in (
        ("hidden", hidden, t.hidden_size, "the target's hidden_size"),
        ("hidden", hidden, d.hidden_size, "the head's hidden_size"),
        ("intermediate", intermediate, t.intermediate_size, "the target's intermediate_size"),
        ("intermediate", intermediate, d.intermediate_size, "the head's intermediate_size"),
        ("layers", layers, t.num_hidden_layers, "the target's num_hidden_layers"),
    ):
        if value < src:
            raise ValueError(
                f"{name}={value} < {who}={src}: widening only adds channels, heads and layers, "
                f"it never drops them; pass --{name} >= {src}"
            )


def plan(src: str | Path, hidden: int, intermediate: int, layers: int) -> Plan:
    """The widened configs of the pair in ``src`` (configs only: no weight is read)."""
    src = Path(src)
    _check_src(src)
    t = ModelConfig.from_hf_dir(src / "target")
    head_dict = read_json_object(src / "draft" / "config.json")
    d = HeadConfig.from_dict(head_dict, t, f"head config {src / 'draft' / 'config.json'}")
    _check_sizes(hidden, intermediate, layers, t, d)
    H = hidden
    heads, kv_heads = _heads(H, t, "")
    target = read_json_object(src / "target" / "config.json") | {
        "hidden_size": H, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps * t.hidden_size / H,
    }  # fmt: skip
    heads, kv_heads = _heads(H, d, "the head's ")
    head = head_dict | {
        "hidden_size": H, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": d.head_dim,
        "rms_norm_eps": d.rms_norm_eps * d.hidden_size / H, "rope_theta": d.rope_theta,
        # Real layers come first, so the ids are unchanged; stated, as N changed.
        "eagle_aux_hidden_state_layer_ids": list(d.feature_layers),
    }  # fmt: skip
    if "target_hidden_size" in head:
        head["target_hidden_size"] = H
    return Plan(target, head, t, d)


# --- the weights ------------------------------------------------------------------------------


def _embed(t: torch.Tensor, shape: tuple[int, ...], col_blocks: int = 1) -> torch.Tensor:
    """``t`` in the top-left corner of zeros(shape); with ``col_blocks`` = k, each of t's k equal
    column blocks at the start of the matching block of the result (fc's k features, the head
    attention's [embedding, hidden] halves)."""
    out = torch.zeros(shape, dtype=t.dtype)
    if t.dim() == 1:
        out[: len(t)] = t
        return out
    rows, cols = t.shape
    w, W = cols // col_blocks, shape[1] // col_blocks
    for j in range(col_blocks):
        out[:rows, j * W : j * W + w] = t[:, j * w : (j + 1) * w]
    return out


def _norm(t: torch.Tensor, H: int) -> torch.Tensor:
    """A norm weight [h] -> [H] float32 times sqrt(h / H) (the module docstring's algebra)."""
    return _embed(t.float() * math.sqrt(len(t) / H), (H,))


Entry = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]


def _target_entries(p: Plan, src: dict[str, torch.Tensor]) -> list[Entry]:
    """(name, shape, dtype, make) of every widened target tensor, in HF order."""
    L, H = p.src_target.num_hidden_layers, p.target["hidden_size"]
    entries: list[Entry] = []
    for name, shape in expected_shapes(p.target_config).items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m and int(m.group(1)) >= L:  # an appended layer: zeros, the identity
            first = f"model.layers.0.{m.group(2)}"
            dtype = torch.float32 if name.endswith("norm.weight") else src[first].dtype
            entries.append((name, shape, dtype, lambda s=shape, dt=dtype: torch.zeros(s, dtype=dt)))
        elif name.endswith("norm.weight"):
            entries.append((name, shape, torch.float32, lambda t=src[name]: _norm(t, H)))
        else:
            t = src[name]
            entries.append((name, shape, t.dtype, lambda t=t, s=shape: _embed(t, s)))
    return entries


def _head_entries(p: Plan, src: dict[str, torch.Tensor]) -> list[Entry]:
    """(name, shape, dtype, make) of every widened head tensor the source head holds."""
    shapes = head_shapes(p.head_config)
    unknown = [k for k in src if k not in shapes and not k.endswith(IGNORED_SUFFIXES)]
    missing = [k for k in REQUIRED_KEYS if k not in src]
    if unknown or missing:
        raise ValueError(
            f"the source head holds {unknown[:3]} and lacks {missing[:3]}: it is not an "
            "EAGLE-3 head in the engine's layout; convert it first (convert eagle3)"
        )
    H, k = p.head["hidden_size"], len(p.src_head.feature_layers)
    entries: list[Entry] = []
    for name, shape in shapes.items():
        if name not in src:
            continue
        t = src[name]
        if name in ("d2t", "t2d"):
            entries.append((name, shape, t.dtype, lambda t=t: t))
        elif name.endswith("norm.weight"):
            entries.append((name, shape, torch.float32, lambda t=t: _norm(t, H)))
        else:
            blocks = k if name == "fc.weight" else 2 if name.endswith(("q_proj.weight",
                     "k_proj.weight", "v_proj.weight")) else 1  # fmt: skip
            entries.append((name, shape, t.dtype, lambda t=t, s=shape, b=blocks: _embed(t, s, b)))
    return entries


def _write_safetensors(path: Path, entries: list[Entry]) -> None:
    """A safetensors file written one tensor at a time (safetensors.torch.save_file needs them
    all in memory, and a bytes copy of each). The format: an 8-byte little-endian header length,
    the JSON header (name -> dtype, shape, data_offsets), spaces to an 8-byte boundary, then the
    tensors' bytes back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, make in entries:
            t = make()
            assert tuple(t.shape) == shape and t.dtype == dtype, name  # the header's promise
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy())
    partial.replace(path)


# --- the pair on disk ---------------------------------------------------------------------------


def _source_hashes(src: Path) -> dict[str, str]:
    """sha256 of the source's configs and safetensors files, by path relative to ``src``."""
    files = sorted((src / "target").glob("*.safetensors")) + sorted(
        (src / "draft").glob("*.safetensors")
    )
    files += [src / "target" / "config.json", src / "draft" / "config.json"]
    hashes = {}
    for f in files:
        digest = hashlib.sha256()
        with f.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        hashes[str(f.relative_to(src))] = digest.hexdigest()
    return hashes


def _record(src: Path, sizes: dict[str, int]) -> dict[str, Any]:
    return {"version": _VERSION, "sizes": sizes, "source": str(src.resolve()),
            "sha256": _source_hashes(src)}  # fmt: skip


def _same_build(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same widening of the same bytes (where the source lies does not matter)."""
    same = all(a.get(k) == b.get(k) for k in ("version", "sizes", "sha256"))
    return same and a.get("complete") is True


def _check_out(src: Path, out: Path, force: bool) -> None:
    if out.resolve() == src.resolve():
        raise ValueError(f"OUT {out} is SRC; pick another directory (e.g. .cache/widened)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {out} is a file; pick a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(
            f"OUT {out} exists and is not empty; pick a new or empty directory, or pass "
            "--force (force=True) to replace its target/ and draft/"
        )


def widen(
    src: str | Path,
    out: str | Path,
    hidden: int = DEFAULT_SIZES["hidden"],
    intermediate: int = DEFAULT_SIZES["intermediate"],
    layers: int = DEFAULT_SIZES["layers"],
    force: bool = False,
) -> Path:
    """Write the widened pair of ``src`` (target/ + draft/) to ``out``; returns ``out``.

    One widened tensor is in memory at a time, besides the small source pair."""
    src, out = Path(src), Path(out)
    p = plan(src, hidden, intermediate, layers)
    _check_out(src, out, force)
    src_target = load_safetensors(src / "target")
    check_weights(p.src_target, src_target)
    src_head = load_safetensors(src / "draft")
    target_entries, head_entries = _target_entries(p, src_target), _head_entries(p, src_head)
    record = _record(src, {"hidden": hidden, "intermediate": intermediate, "layers": layers})
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD).write_text(json.dumps(record | {"complete": False}, indent=1) + "\n")
    for part, config, entries in (("target", p.target, target_entries),
                                  ("draft", p.head, head_entries)):  # fmt: skip
        shutil.rmtree(out / part, ignore_errors=True)
        (out / part).mkdir()
        (out / part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _TOKENIZER_FILES:
            if (src / part / name).is_file():
                (out / part / name).parent.mkdir(exist_ok=True)
                shutil.copyfile(src / part / name, out / part / name)
        _write_safetensors(out / part / "model.safetensors", entries)
    (out / RECORD).write_text(json.dumps(record | {"complete": True}, indent=1) + "\n")
    return out


def ensure_widened(src: str | Path, out: str | Path = WIDENED_DIR, **sizes: int) -> Path:
    """``out`` holding the widened pair of ``src`` at ``sizes`` (hidden, intermediate, layers;
    DEFAULT_SIZES for those not given), made only when it lacks it, is incomplete, or was made
    from other source bytes or sizes (its widen.json says). A non-empty ``out`` that widen did
    not make is refused, not replaced."""
    unknown = sorted(set(sizes) - set(DEFAULT_SIZES))
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; pass some of {sorted(DEFAULT_SIZES)}")
    sizes = DEFAULT_SIZES | sizes
    src, out = Path(src), Path(out)
    _check_src(src)
    done = out / RECORD
    if out.is_dir() and any(out.iterdir()) and not done.is_file():
        raise ValueError(
            f"{out} is not empty and has no {RECORD}, so widen did not make it; ensure_widened "
            "replaces only its own output: pass another out, or empty this one"
        )
    if done.is_file():
        try:
            if _same_build(json.loads(done.read_text()), _record(src, sizes)):
                return out
        except json.JSONDecodeError:
            pass  # a torn record: rebuild
    return widen(src, out, **sizes, force=done.is_file())
