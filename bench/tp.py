"""Tensor parallelism: TP = 1 against TP = N measured on this machine, and on paper for
Llama-3.1-8B and -70B on 1, 2, 4 and 8 H200s.

    python bench/tp.py                                   # default pair, TP 1 vs 2, 5 runs
    python bench/tp.py --runs 5 --max-new-tokens 128 --json bench/results/tp/default.json
    python bench/tp.py --target DIR --draft DIR --tp 4 --threads 4 --ar-latency-us 5

Measured (this machine, gloo on a CPU; torch.distributed is initialized once per process, so
each run of a TP size is its own process: ``--child N``, which prints JSON). Runs alternate
between the sizes (1, N, N, 1, ...); each run generates ``--max-new-tokens`` tokens after each of
two prompts (EOS ignored, same seeds for both sizes) for ``ar`` and ``rheo`` at T = 0 and T = 1,
fixed tree by default (``--tree auto`` lets the cost model, measured on rank 0, pick each step's
tree, which then differs between the sizes). Per configuration: tokens/s (tokens over the
generation's wall time, prefill included) and the median of the paired per-run ratios TP=N /
TP=1; per decode step (every step but a generation's first, so the prefill is left out), rank
0's time inside the compute collectives (TPGroup.stats.seconds: on gloo the collectives are
synchronous, so this includes waiting for the slower rank), in the control message that tells
the other ranks the step (timed by wrapping TPGroup.send), and the rest (rank 0's own compute,
drafting, verification, Python); the collectives' count and payload per step.

Projected (computed, not measured): per-rank floors of one decode step with the counts measured
here (all-reduces per layer, gathers per forward) on the H200 limits of bench/roofline.py
(HBM 4.8 TB/s, bf16 990 TFLOP/s) and NVLink 4 at 450 GB/s per direction per GPU (900 GB/s
bidirectional): weights and KV read, matmul and attention FLOPs, ring all-reduces
2 (N - 1) / N * bytes / bandwidth + a latency per call, a ring all-gather of the logits, and the
EAGLE-3 head's drafting (replicated: the same on every TP size). Launches, kernels' own
inefficiencies and any overlap of communication with compute are left out: floors, not
forecasts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import conditions, conditions_line, markdown_table, produced
from inputs import (
    DTYPES,
    ROOT,
    ArgumentParser,
    BadInput,
    add_model_args,
    add_tree_args,
    at_least,
    check_output,
    checking,
    cli,
    resolve_pair,
    tree_options,
)
from roofline import HBM_BW, TENSOR_FLOPS, VISITED

from rheo_engine import Engine
from rheo_engine.models.llama import resident_weight_bytes
from rheo_engine.runtime.tp import check_shardable, read_config

PROMPTS = ("def quicksort(xs):", "import os\n\ndef walk(path):")  # in the default pair's domain
METHODS = (("ar", 0.0), ("ar", 1.0), ("rheo", 0.0), ("rheo", 1.0))

# The projection's assumptions (bench/roofline.py has the HBM and tensor-core figures).
NVLINK_BW = 450e9  # B/s per direction per GPU: NVLink 4, 18 links, 900 GB/s bidirectional
AR_LATENCY_US = 10.0  # per collective call, NCCL on NVLink, small messages (8-15 µs)
HBM_BYTES = 143771 * 2**20  # an H200's 141 "GB" as nvidia-smi reports them: 140.4 GiB
CONTEXT = 1024  # KV rows already in the cache when the step runs (read by attention)
TOPK, DEPTH = 10, 8  # the engine's default tree: the head drafts DEPTH levels of TOPK rows
TREE_ROWS = (16, 32, 60)  # tree steps projected (the engine's default total_tokens is 60)
TP_SIZES = (1, 2, 4, 8)
SHARE_FLAG = 0.25  # flag a step whose collectives take more than this share of it
PAYS = 1.2  # a doubling of the GPUs that shortens the step by less than this does not pay


# --- measured: one process per TP size ------------------------------------------------------


def label(method: str, temperature: float) -> str:
    return f"{method} T={temperature:g}"


def digest(ids: list[int]) -> str:
    """A short hash of a generation's tokens: equal tokens across TP sizes, equal digests."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def timed_control(group) -> list[float]:
    """Wrap ``group.send`` (rank 0's control message) to add its seconds to the list's one
    number, which is returned."""
    spent = [0.0]
    send = group.send

    def timed(message: dict) -> None:
        start = time.perf_counter()
        send(message)
        spent[0] += time.perf_counter() - start

    group.send = timed
    return spent


def snapshot(request, group, control: list[float]) -> dict[str, float]:
    """The clock, the request's steps so far and rank 0's collective counters."""
    s = group.stats if group is not None else None
    return dict(
        time=time.perf_counter(), steps=len(request.accept_lengths),
        all_reduce_calls=s.all_reduce_calls if s else 0,
        all_reduce_bytes=s.all_reduce_bytes if s else 0,
        gather_calls=s.gather_calls if s else 0, gather_bytes=s.gather_bytes if s else 0,
        collective_s=s.seconds if s else 0.0, control_messages=s.control_messages if s else 0,
        control_s=control[0],
    )  # fmt: skip


def generate(engine: Engine, ids: list[int], max_new: int, seed: int, options: dict,
             control: list[float]) -> dict:  # fmt: skip
    """One generation, EOS ignored: its totals, and what its decode steps after the first did
    (the window from the end of step 1 to the end of the last step: no prefill in it)."""
    request = engine.request(ids, max_new, seed=seed, ignore_eos=True, **options)
    marks = [snapshot(request, engine.tp, control) for _ in request]
    gen = request.result
    window = {k: marks[-1][k] - marks[0][k] for k in marks[0]}
    window["seconds"] = window.pop("time")
    return dict(tokens=len(gen.token_ids), emitted=produced(gen), steps=gen.steps,
                wall_s=gen.wall_s - gen.measure_s, digest=digest(gen.token_ids),
                window=window)  # fmt: skip


def child(args: argparse.Namespace) -> dict:
    """A run of one TP size (this process is its rank 0): every configuration on every prompt,
    in an order rotated per prompt, after one warm-up generation each."""
    n = args.child
    with checking():
        target, draft = resolve_pair(args.pair, args.target, args.draft)
        engine = Engine.from_pretrained(
            target, draft, device=args.device, dtype=DTYPES.get(args.dtype), threads=args.threads,
            tensor_parallel=n,
        )  # fmt: skip
    control = timed_control(engine.tp) if engine.tp is not None else [0.0]
    tree = tree_options(args)
    configs = {label(m, t): dict(method=m, temperature=t, **tree) for m, t in METHODS}
    prompts = [engine.tokenizer.encode(p, bos=True) for p in PROMPTS]
    for options in configs.values():
        engine.generate(prompts[0], 8, seed=0, **options)
    labels = list(configs)
    samples: dict[str, list[dict]] = {k: [] for k in labels}
    for i, ids in enumerate(prompts):
        for key in labels[i % len(labels) :] + labels[: i % len(labels)]:
            seed = 1000 * args.round + i
            samples[key].append(generate(engine, ids, args.max_new_tokens, seed, configs[key],
                                         control))  # fmt: skip
    cfg = engine.target.cfg
    out = dict(
        tp=n, threads_per_rank=torch.get_num_threads(), dtype=str(engine.target.dtype),
        element_bytes=engine.target.embed_tokens.element_size(), layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size, vocab=cfg.vocab_size, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads, rank0_weight_bytes=resident_weight_bytes(engine.target),
        samples=samples,
    )  # fmt: skip
    engine.close()
    return out


def child_argv(args: argparse.Namespace, n: int, round_index: int) -> list[str]:
    """The command of one run: this script with the model and tree flags, as ``--child n``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(n), "--round",
            str(round_index), "--pair", args.pair, "--device", args.device, "--threads",
            str(args.threads), "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
    for flag, value in (("--target", args.target), ("--draft", args.draft),
                        ("--dtype", args.dtype)):  # fmt: skip
        if value is not None:
            argv += [flag, value]
    for key, value in tree_options(args).items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def run_child(args: argparse.Namespace, n: int, round_index: int) -> dict:
    """One run in its own process; its JSON (the last line of its stdout)."""
    run = subprocess.run(child_argv(args, n, round_index), capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    if run.returncode == 2:  # bad input, said in one line
        raise BadInput(run.stderr.strip().splitlines()[-1].split("error: ", 1)[-1])
    if run.returncode != 0:
        raise RuntimeError(f"TP={n} run {round_index} failed (exit {run.returncode}):\n"
                           f"{run.stderr[-3000:]}")  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


def per_round(runs: list[dict], key: str, fn) -> list[float]:
    """``fn`` of one configuration's samples (all prompts of a run), for each run."""
    return [fn(run["samples"][key]) for run in runs]


def tokens_per_s(samples: list[dict]) -> float:
    return sum(s["tokens"] for s in samples) / sum(s["wall_s"] for s in samples)


def per_step(field: str):
    """A run's ``field`` summed over its decode-step windows, per decode step."""

    def fn(samples: list[dict]) -> float:
        steps = sum(s["window"]["steps"] for s in samples)
        return sum(s["window"][field] for s in samples) / steps if steps else math.nan

    return fn


def summarize(runs: dict[int, list[dict]], n: int) -> dict[str, dict]:
    """Per configuration and TP size: medians over the runs, paired ratios, pooled counts."""
    out: dict[str, dict] = {}
    for method, temperature in METHODS:
        key = label(method, temperature)
        speed = {size: per_round(rs, key, tokens_per_s) for size, rs in runs.items()}
        same = sum(
            a["digest"] == b["digest"]
            for r1, rn in zip(runs[1], runs[n], strict=True)
            for a, b in zip(r1["samples"][key], rn["samples"][key], strict=True)
        )
        total = sum(len(r["samples"][key]) for r in runs[1])  # fmt: skip
        out[key] = dict(same_tokens=f"{same}/{total}", ratios=[
            b / a for a, b in zip(speed[1], speed[n], strict=True)])  # fmt: skip
        out[key]["ratio"] = statistics.median(out[key]["ratios"])
        for size, rs in runs.items():
            samples = [s for r in rs for s in r["samples"][key]]
            step_s = per_round(rs, key, per_step("seconds"))
            collective_s = per_round(rs, key, per_step("collective_s"))
            control_s = per_round(rs, key, per_step("control_s"))
            rest_s = [a - b - c for a, b, c in zip(step_s, collective_s, control_s, strict=True)]
            pooled = {f: per_step(f)(samples) for f in ("all_reduce_calls", "all_reduce_bytes",
                      "gather_calls", "gather_bytes", "control_messages")}  # fmt: skip
            out[key][size] = dict(
                tokens_per_s=statistics.median(speed[size]), tokens_per_s_runs=speed[size],
                tau=sum(s["emitted"] for s in samples) / sum(s["steps"] for s in samples),
                step_ms=1e3 * statistics.median(step_s),
                collective_ms=1e3 * statistics.median(collective_s),
                control_ms=1e3 * statistics.median(control_s),
                rest_ms=1e3 * statistics.median(rest_s),
                collective_share=statistics.median(
                    c / s for c, s in zip(collective_s, step_s, strict=True)),
                **pooled,
            )  # fmt: skip
    return out


@dataclass(frozen=True)
class Counts:
    """What one target forward does, as measured on TP = N: the projection's inputs."""

    all_reduces_per_layer: float
    gathers_per_forward: float
    all_reduce_row_bytes: float  # per row of the forward's tokens: hidden x element bytes

    @classmethod
    def measured(cls, summary: dict, shape: dict, n: int) -> Counts:
        """From the ar T=0 decode steps (one row each, one target forward each)."""
        ar = summary[label("ar", 0.0)][n]
        return cls(ar["all_reduce_calls"] / shape["layers"], ar["gather_calls"],
                   ar["all_reduce_bytes"] / ar["all_reduce_calls"])  # fmt: skip


def measured_markdown(summary: dict, shape: dict, n: int) -> str:
    """The tokens/s and step-split table, and the collectives-per-step table."""
    rows = []
    for key in (label(m, t) for m, t in METHODS):
        for size in (1, n):
            r = summary[key][size]
            ratio = "1.00x" if size == 1 else f"{summary[key]['ratio']:.2f}x"
            rows.append([*key.split(" "), str(size), f"{r['tokens_per_s']:.1f}", ratio,
                         f"{r['tau']:.2f}", f"{r['step_ms']:.2f}", f"{r['collective_ms']:.2f}",
                         f"{r['control_ms']:.2f}", f"{r['rest_ms']:.2f}",
                         f"{100 * r['collective_share']:.0f}%"])  # fmt: skip
    speed = markdown_table(
        ["method", "T", "TP", "tokens/s", f"TP={n} / TP=1", "τ", "step ms", "in collectives ms",
         "control msg ms", "rest ms", "collectives share"], rows,
    )  # fmt: skip
    e = shape["element_bytes"]
    rows = []
    for key in (label(m, t) for m, t in METHODS):
        r = summary[key][n]
        per_call = r["collective_ms"] * 1e3 / (r["all_reduce_calls"] + r["gather_calls"])
        rows_per_forward = r["all_reduce_bytes"] / r["all_reduce_calls"] / (shape["hidden"] * e)
        rows.append([*key.split(" "), f"{rows_per_forward:.1f}", f"{r['all_reduce_calls']:.2f}",
                     f"{r['all_reduce_bytes'] / 1024:.1f}", f"{r['gather_calls']:.2f}",
                     f"{r['gather_bytes'] / 1024:.1f}", f"{r['control_messages']:.2f}",
                     f"{per_call:.0f}", summary[key]["same_tokens"]])  # fmt: skip
    counts = markdown_table(
        ["method", "T", "rows / forward", "all-reduces / step", "all-reduce KiB / step",
         "gathers / step", "gather KiB / step", "control msgs / step", "µs per collective",
         "same tokens as TP=1"], rows,
    )  # fmt: skip
    expect = (
        f"Expected per target forward on TP={n}: 2 x {shape['layers']} layers = "
        f"{2 * shape['layers']} all-reduces of [1, rows, {shape['hidden']}] "
        f"({shape['hidden'] * e} B a row) and 1 all-gather of [1, rows, "
        f"{-(-shape['vocab'] // n)}] logits ({-(-shape['vocab'] // n) * e} B a row, each rank's "
        'part); one control message per step. "Same tokens": paired generations (same prompt '
        "and seed) whose tokens equal TP=1's; \"µs per collective\": rank 0's time in them over "
        "their count (waiting for the other rank included)."
    )
    title = f"Collectives per decode step, TP={n} (rank 0's counters):"
    return f"{speed}\n{title}\n\n{counts}\n{expect}\n"


# --- projected: Llama-3.1 on H200s --------------------------------------------------------


@dataclass(frozen=True)
class Llama:
    """A Llama-3.1 target (bf16) and the shape of its EAGLE-3 head (one decoder layer of the
    target's sizes on [embedding, feature] = 2 x hidden inputs, a draft_vocab lm_head, and the
    fc that folds three layers' features)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int = 128256
    draft_vocab: int = 32000
    element_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """q, k, v, o and the MLP of one decoder layer (column- and row-parallel: all split)."""
        h, D = self.hidden, self.head_dim
        return (self.heads + 2 * self.kv_heads) * D * h + self.heads * D * h + 3 * self.inter * h

    @property
    def params(self) -> int:
        """Every weight: layers, norms, the embedding and an untied lm_head."""
        norms = 2 * self.layers * self.hidden + self.hidden
        return self.layers * self.layer_params + norms + 2 * self.vocab * self.hidden

    @property
    def head_level_params(self) -> int:
        """What one draft level of the EAGLE-3 head streams (as bench/roofline.py's HEAD_LAYER
        plus its lm_head)."""
        h, D = self.hidden, self.head_dim
        return (h * 2 * h + 2 * self.kv_heads * D * 2 * h + h * self.heads * D
                + 3 * self.inter * h + self.draft_vocab * h)  # fmt: skip

    @property
    def head_params(self) -> int:
        return self.head_level_params + 3 * self.hidden * self.hidden  # + the fc


LLAMA_8B = Llama("Llama-3.1-8B", 32, 4096, 32, 8, 14336)
LLAMA_70B = Llama("Llama-3.1-70B", 80, 8192, 64, 8, 28672)


def matmul_s(params: float, rows: int, bytes_per: int = 2) -> float:
    """One matmul-shaped pass over ``params`` weights for ``rows`` rows: read or FLOP bound."""
    return max(params * bytes_per / HBM_BW, 2 * params * rows / TENSOR_FLOPS)


def head_s(m: Llama, context: int = CONTEXT) -> float:
    """The EAGLE-3 head's drafting floor of one tree step, on every rank alike: DEPTH levels
    (1 row, then TOPK), each streaming the head's layer and lm_head and its KV, then the fc
    over the accepted tokens (bench/roofline.py's head_floor, for any Llama)."""
    kv = context * m.kv_heads * m.head_dim * 2 * m.element_bytes / HBM_BW
    levels = [1] + [TOPK] * (DEPTH - 1)
    fc = matmul_s(3 * m.hidden * m.hidden, VISITED, m.element_bytes)
    return sum(matmul_s(m.head_level_params, r, m.element_bytes) + kv for r in levels) + fc


@dataclass(frozen=True)
class Projection:
    """One decode step of ``rows`` tokens on TP = ``n``, per rank (seconds, bytes)."""

    model: str
    rows: int
    n: int
    memory_bytes: float  # weights + replicated embedding and head + KV at CONTEXT, per rank
    read_s: float
    compute_s: float
    all_reduce_s: float
    all_reduce_calls: float
    gather_s: float
    head_s: float  # 0 for a plain step

    @property
    def target_s(self) -> float:
        return max(self.read_s, self.compute_s) + self.all_reduce_s + self.gather_s

    @property
    def step_s(self) -> float:
        return self.target_s + self.head_s

    @property
    def collective_share(self) -> float:
        return (self.all_reduce_s + self.gather_s) / self.step_s

    @property
    def free_bytes(self) -> float:
        return HBM_BYTES - self.memory_bytes


def project(m: Llama, rows: int, n: int, counts: Counts, latency_s: float,
            context: int = CONTEXT) -> Projection:  # fmt: skip
    """The floors of one step of ``rows`` tree tokens (1: a plain ar step, no drafting) on
    ``n`` GPUs, with the measured collectives per layer and per forward."""
    e, h, L = m.element_bytes, m.hidden, m.layers
    vocab_part = -(-m.vocab // n)
    kv_row = L * 2 * (m.kv_heads // n) * m.head_dim * e  # K and V of one token, all layers
    split = L * m.layer_params / n + vocab_part * h  # column/row-parallel layers, lm_head rows
    replicated = L * 2 * h + h  # the norms (the embedding is only looked up: rows x hidden)
    read = (split + replicated + rows * h) * e + kv_row * (context + rows)
    attention = 4 * rows * (context + rows) * (m.heads // n) * m.head_dim * L  # q.k and p.v
    flops = 2 * rows * split + attention
    calls = counts.all_reduces_per_layer * L if n > 1 else 0
    ar_bytes = rows * h * e
    ar = calls * (latency_s + 2 * (n - 1) / n * ar_bytes / NVLINK_BW)
    gathers = counts.gathers_per_forward if n > 1 else 0
    gather = gathers * (latency_s + (n - 1) * rows * vocab_part * e / NVLINK_BW)
    memory = (split + replicated + m.vocab * h + m.head_params) * e + kv_row * context
    return Projection(m.name, rows, n, memory, read / HBM_BW, flops / TENSOR_FLOPS, ar, calls,
                      gather, head_s(m, context) if rows > 1 else 0.0)  # fmt: skip


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def flags(p: Projection, half: Projection | None) -> str:
    """Where the collectives take a large share of the step, where doubling the GPUs (from
    ``half``, TP = n / 2) stops paying, and where memory is tight."""
    out = []
    if p.collective_share > SHARE_FLAG:
        out.append(f"collectives > {100 * SHARE_FLAG:.0f}%")
    if half is not None and half.free_bytes >= 0 and half.step_s / p.step_s < PAYS:
        out.append(f"stops paying: {half.step_s / p.step_s:.2f}x over TP={half.n}")
    if p.free_bytes < 0.1 * HBM_BYTES:
        out.append(f"tight: {p.free_bytes / 1e9:.1f} GB left for KV and activations")
    return "; ".join(out)


def projected_markdown(m: Llama, counts: Counts, latency_s: float) -> str:
    """One table: every step size on every TP size, with its flags."""
    rows = []
    for size in (1, *TREE_ROWS):
        by_n = {n: project(m, size, n, counts, latency_s) for n in TP_SIZES}
        base = by_n[1] if by_n[1].free_bytes >= 0 else None
        for n, p in by_n.items():
            what = "ar, 1 row" if size == 1 else f"tree, {size} rows"
            if p.free_bytes < 0:
                rows.append([what, str(n), f"{p.memory_bytes / 1e9:.1f}", *["—"] * 9,
                             f"does not fit: {p.memory_bytes / 1e9:.0f} GB > "
                             f"{HBM_BYTES / 1e9:.0f} GB"])  # fmt: skip
                continue
            rows.append([what, str(n), f"{p.memory_bytes / 1e9:.1f}", us(p.read_s),
                         us(p.compute_s), f"{us(p.all_reduce_s)} ({p.all_reduce_calls:.0f})",
                         us(p.gather_s), us(p.target_s), f"{100 * p.collective_share:.0f}%",
                         us(p.head_s), f"**{us(p.step_s)}**",
                         "—" if base is None else f"{base.step_s / p.step_s:.2f}x",
                         flags(p, by_n.get(n // 2) if n > 1 else None)])  # fmt: skip
    return markdown_table(
        ["step", "TP", "GB / GPU", "weights + KV read µs", "compute µs", "all-reduce µs (calls)",
         "gather µs", "target µs", "collectives %", "draft head µs", "step floor µs", "vs TP=1",
         "flags"], rows,
    )  # fmt: skip


def assumptions_markdown(counts: Counts, latency_s: float) -> str:
    """What the projection assumes, and which of it was measured here."""
    link, lat = f"{NVLINK_BW / 1e9:.0f} GB/s", f"{latency_s * 1e6:g} µs"
    lines = [
        "Projected, not measured: one decode step per GPU (batch 1), Llama-3.1 in bf16 on H200 "
        "SXM.",
        "",
        f"- Measured in this run: {counts.all_reduces_per_layer:g} all-reduces per layer (of "
        f"[1, rows, hidden] in the model's dtype: {counts.all_reduce_row_bytes:g} B a row here) "
        f"and {counts.gathers_per_forward:g} all-gather of the vocabulary-parallel logits per "
        "target forward; the embedding, the norms and the EAGLE-3 head whole on every rank.",
        f"- HBM {HBM_BW / 1e12:.1f} TB/s and {HBM_BYTES / 1e9:.1f} GB (143771 MiB: the data "
        f"sheet's 141 GB); bf16 dense {TENSOR_FLOPS / 1e12:.0f} TFLOP/s (bench/roofline.py).",
        f"- NVLink 4: {link} per direction per GPU (900 GB/s bidirectional). A ring all-reduce "
        f"of S bytes on N GPUs: 2 (N - 1) / N * S / {link} + {lat}; a ring all-gather of S "
        f"bytes a rank: (N - 1) * S / {link} + {lat} (NCCL's small-message latency on NVLink "
        "is ~8-15 µs; --ar-latency-us sets it).",
        f"- Per rank: the weights read once (layers / N, lm_head rows / N, the norms; the "
        f"embedding only looked up) and the KV of {CONTEXT} cached tokens + the step's rows "
        "(Hkv / N heads); FLOPs 2 x rows x weights + 4 x rows x (context + rows) x H / N x D "
        "per layer (attention). Target = max(read, compute) + all-reduces + gather (no overlap).",
        f"- A tree step also drafts: the head's {DEPTH} levels (1 row, then topk {TOPK}) and its "
        "fc (bench/roofline.py's head_floor), the same on every TP size (the head is "
        "replicated); an ar step does not draft. GB / GPU: the rank's part of the target, the "
        f"whole embedding and head, the KV of {CONTEXT} tokens.",
        f'- Flags: collectives over {100 * SHARE_FLAG:.0f}% of the step floor; "stops paying" '
        f'where twice the GPUs shorten the step by less than {PAYS:g}x; "tight" under 10% of '
        "HBM left. Launches, kernel efficiency and overlap are left out: floors, not forecasts.",
        "",
    ]
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--tp", type=at_least(2), default=2, help="the TP size compared with 1")
    p.add_argument("--max-new-tokens", type=at_least(2), default=64,
                   help="tokens per generation (EOS ignored)")  # fmt: skip
    p.add_argument("--runs", type=at_least(1), default=5,
                   help="runs per TP size, alternating (1, N, N, 1, ...)")  # fmt: skip
    p.add_argument(
        "--ar-latency-us",
        type=at_least(0.0, float),
        default=AR_LATENCY_US,
        help=f"projection: latency per collective call (default {AR_LATENCY_US:g})",
    )
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one run of this TP size
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    add_tree_args(p, tree="fixed")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict | None:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return None
    n = args.tp
    torch.set_num_threads(args.threads)  # the conditions' torch_threads: the ranks' total
    with checking():
        check_output(args.json, "--json")
        target, _ = resolve_pair(args.pair, args.target, args.draft)
        check_shardable(read_config(target), n, torch.device(args.device))
    shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
    cond = conditions("tp", args.device, pair=args.pair, target=str(shown), tp=[1, n],
                      runs=args.runs, max_new_tokens=args.max_new_tokens, prompts=len(PROMPTS),
                      threads=args.threads, **tree_options(args))  # fmt: skip
    print(conditions_line(cond))
    runs: dict[int, list[dict]] = {1: [], n: []}
    for r in range(args.runs):
        for size in (1, n) if r % 2 == 0 else (n, 1):
            start = time.perf_counter()
            runs[size].append(run_child(args, size, r))
            print(f"run {r + 1}/{args.runs} TP={size}: {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)  # fmt: skip
    shape = {k: v for k, v in runs[n][0].items() if k != "samples"}
    summary = summarize(runs, n)
    counts = Counts.measured(summary, shape, n)
    latency = args.ar_latency_us * 1e-6
    threads = {size: rs[0]["threads_per_rank"] for size, rs in runs.items()}
    print(
        f"\n## Measured on this machine: TP=1 vs TP={n} ({shape['dtype']}, "
        f"{shape['layers']} layers, hidden {shape['hidden']}; torch threads per rank: "
        f"{threads[1]} at TP=1, {threads[n]} at TP={n}; rank 0 holds "
        f"{runs[1][0]['rank0_weight_bytes'] / 1e6:.1f} MB of target weights at TP=1, "
        f"{shape['rank0_weight_bytes'] / 1e6:.1f} MB at TP={n})\n"
    )
    print(measured_markdown(summary, shape, n))
    print("## Projected for H200s (computed, not measured)\n")
    print(assumptions_markdown(counts, latency))
    tables = {}
    for m in (LLAMA_8B, LLAMA_70B):
        tables[m.name] = [asdict(project(m, size, k, counts, latency))
                          for size in (1, *TREE_ROWS) for k in TP_SIZES]  # fmt: skip
        print(f"### {m.name} ({m.params / 1e9:.2f} B parameters, "
              f"{m.params * m.element_bytes / 1e9:.1f} GB in bf16; its EAGLE-3 head "
              f"{m.head_params / 1e9:.2f} B)\n")  # fmt: skip
        print(projected_markdown(m, counts, latency))
    payload = dict(conditions=cond, shape=shape, summary=summary, counts=asdict(counts),
                   projection=tables, runs=runs)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return payload


if __name__ == "__main__":
    cli(main, sys.argv[1:])
