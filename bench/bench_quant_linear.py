"""Benchmark the quantized linear layer: kernels.quant_linear (Q8_0, Q4_1) against the bf16
skinny kernel and torch's bf16 F.linear, 1 to 32 rows, on SmolLM2-135M's matrices.

Checks the kernel against x @ dequantized(W)^T first (within the error of quantizing x to Q8),
then times each kernel paired with F.linear (common.Timer.pair: interleaved, L2 flushed before
each call, medians). Prints one markdown row per (matrix, rows): the µs of each, each one's
speed-up over F.linear, the Q4_1 kernel's t(n)/t(1) and the GB/s of W it read.

``--target`` instead times SmolLM2's target forward (LlamaModel.forward in a KV slot, as the
engine runs it: its layers in one C++ call) over n tree rows after a
300-token context and the prefill of that context, the Q4_1 file kept quantized against the same
file dequantized to bf16 (interleaved, medians): t(n)/t(1) and prefill tokens/s of each.

``--against SO`` (with the kernel table or ``--target``) times this build's Q4_1 kernel against
the one in another build's extension (e.g. a checkout of an older commit built in /tmp: its
rheo_engine/_C*.so, loaded beside this one), paired and interleaved in one process, after checking
that both give the same bits.

``--e2e`` instead runs SmolLM2's `ar` decoding on the Q4_1 file kept quantized against the same
file dequantized to bf16 (two engines, generations interleaved, median tokens/s of each).

    python bench/bench_quant_linear.py [--rows 1,2,4,8,16,32] [--threads 1]
    python bench/bench_quant_linear.py --target [--rows 1,4,16] [--repeats 15]
    python bench/bench_quant_linear.py --against OLD.so [--qtype q8_0] [--rows 1,4,16,64]
    python bench/bench_quant_linear.py --target --against OLD.so --rows 1,4,16
    python bench/bench_quant_linear.py --e2e [--tokens 64] [--pairs 5]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from common import Timer, commit_id
from inputs import ArgumentParser

from rheo_engine.machine import isa_line
from rheo_engine.models.quant import quantize_q8_0
from rheo_engine.spec import kernels

# SmolLM2-135M (the smollm2 pair's target): hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64.
SMOLLM2 = [("qkv", (960, 576)), ("o", (576, 576)), ("gate_up", (3072, 576)),
           ("down", (576, 1536)), ("lm_head", (49152, 576))]  # fmt: skip


def q4_1_of(w: torch.Tensor):
    """A Q4_1 QuantWeight of w, by llama.cpp's quantize_row_q4_1 rule (min and 15 steps)."""
    from rheo_engine.models.quant import QuantWeight

    out, in_ = w.shape
    x = w.float().reshape(out, in_ // 32, 32)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = ((x - lo) * inv + 0.5).floor().clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    head = torch.cat([d, lo], -1).to(torch.float16).view(torch.uint8)
    return QuantWeight.from_blocks("q4_1", torch.cat([head, qs], -1), (out, in_))


def load_extension(path: str):
    """Another build's rheo_engine._C, loaded beside this one (pybind11: no registry clash)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rheo_engine_before._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quant_linear_with(ext, x: torch.Tensor, w, qtype_id: int = 2) -> torch.Tensor:
    """``kernels.quant_linear`` (Q4_1 by default) run by the extension ``ext``."""
    y = x.new_empty((*x.shape[:-1], w.shape[0]))
    ext.quant_linear(x, w.packed, qtype_id, w.shape[0], y)
    return y


def against_bench(rows: list[int], path: str, qtype: str) -> None:
    """``qtype`` (q4_1 or q8_0) µs of this build against ``path``'s, per SmolLM2 matrix and
    row count."""
    old = load_extension(path)
    torch.set_num_threads(1)
    timer = Timer("cpu", flush=True, budget_s=0.6)
    print(f"# {qtype}, {isa_line()}, AMX tiles {kernels.quant_linear_amx()}, 1 thread, "
          f"commit {commit_id()} against {path}")
    print("| matrix | n | before µs | after µs | speed-up | before t(n)/t(1) | "
          "after t(n)/t(1) | after µs per row |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (out, in_) in SMOLLM2:
        w = (torch.randn(out, in_) * 0.05).to(torch.bfloat16)
        q4 = q4_1_of(w) if qtype == "q4_1" else quantize_q8_0(w)
        qid = 2 if qtype == "q4_1" else 0
        t1 = None
        for n in rows:
            x = torch.randn(n, in_).to(torch.bfloat16)
            a, b = q4.matmul(x), quant_linear_with(old, x, q4, qid)
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                raise SystemExit(f"{name} n={n}: this build and {path} differ")
            tnew, told = timer.pair(lambda: q4.matmul(x),
                                    lambda: quant_linear_with(old, x, q4, qid))  # fmt: skip
            t1 = (told, tnew) if t1 is None else t1
            print(f"| {name} {out}x{in_} | {n} | {told:.1f} | {tnew:.1f} | {told / tnew:.2f} | "
                  f"{told / t1[0]:.2f} | {tnew / t1[1]:.2f} | {tnew / n:.1f} |")  # fmt: skip


def kernels_bench(rows: list[int], threads: int) -> None:
    torch.set_num_threads(threads)
    timer = Timer("cpu", flush=True, budget_s=0.6)
    print(f"# {isa_line()}, AMX tiles {kernels.quant_linear_amx()}, {threads} thread(s), "
          f"commit {commit_id()}")
    print("| matrix | n | torch bf16 µs | skinny bf16 µs | Q8_0 µs | Q4_1 µs | skinny x | "
          "Q8_0 x | Q4_1 x | Q4_1 t(n)/t(1) | Q4_1 GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (out, in_) in SMOLLM2:
        w = (torch.randn(out, in_) * 0.05).to(torch.bfloat16)
        q8, q4 = quantize_q8_0(w), q4_1_of(w)
        t1 = None
        for n in rows:
            x = torch.randn(n, in_).to(torch.bfloat16)
            ref = F.linear(x.float(), q4.dequantize())
            got = q4.matmul(x).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if not err < 0.03:
                raise SystemExit(f"{name} n={n}: Q4_1 kernel off by {err:.3g} of max |y|")
            th, tq4 = timer.pair(lambda: F.linear(x, w), lambda: q4.matmul(x))
            th2, tq8 = timer.pair(lambda: F.linear(x, w), lambda: q8.matmul(x))
            th3, tsk = timer.pair(lambda: F.linear(x, w), lambda: kernels.skinny_linear(x, w))
            torch_us = statistics.median([th, th2, th3])
            t1 = tq4 if t1 is None else t1
            gbs = q4.nbytes / (tq4 * 1e-6) / 1e9
            print(f"| {name} {out}x{in_} | {n} | {torch_us:.1f} | {tsk:.1f} | {tq8:.1f} | "
                  f"{tq4:.1f} | {th3 / tsk:.2f} | {th2 / tq8:.2f} | {th / tq4:.2f} | "
                  f"{tq4 / t1:.2f} | {gbs:.1f} |")  # fmt: skip


def target_bench(rows: list[int], repeats: int, against: str | None, context: int = 300) -> None:
    """Each model's forward as the engine runs it: in a slot of a KV pool (SlotBatch), so the
    layers run in one C++ call where they can (LlamaModel._one_call). With ``against``, every
    kernel the Q4_1 model calls switches between this build ("after") and ``against``'s
    ("before") around each forward, its one-call layers (built once per build) included, all
    interleaved. (Until 2026-12-06 this timed the forward on a KVCache, which never takes the
    one-call path, and swapped quant_linear alone.)"""
    from rheo_engine.runtime.engine import Engine

    torch.set_num_threads(1)
    q4 = Engine.from_pretrained(pair="smollm2", threads=1).target
    models = {"Q4_1 kept": q4}
    exts = {"Q4_1 kept": kernels._C}
    if against:
        models = {"Q4_1 kept, before": q4, "Q4_1 kept, after": q4}
        exts = {"Q4_1 kept, before": load_extension(against),
                "Q4_1 kept, after": kernels._C}  # fmt: skip
    models["bf16 dequantized"] = Engine.from_pretrained(pair="smollm2", threads=1,
                                                        quantized=False).target  # fmt: skip
    exts["bf16 dequantized"] = kernels._C
    prompt = torch.arange(5, 5 + context)[None] % q4.cfg.vocab_size
    caches = {k: m.new_pool(context + max(rows) + 1, 1).batch([0]) for k, m in models.items()}
    layers: dict[str, object] = {}  # each build's one-call layers

    def use(k: str) -> None:
        kernels._C = exts[k]
        models[k].__dict__.pop("_decoder_layers", None)  # built anew by this build's kernels
        if k in layers:
            models[k]._decoder_layers = layers[k]

    prefill: dict[str, list[float]] = {k: [] for k in models}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.no_grad():
        for i in range(4):  # the prefill, last row's logits only, as the engine runs it
            for k, m in models.items():
                use(k)
                t0 = time.perf_counter()
                m.forward(prompt, torch.arange(context)[None], caches[k], last_logits_only=True)
                if i:
                    prefill[k].append(time.perf_counter() - t0)
                layers[k] = m.__dict__.get("_decoder_layers")
        for c in caches.values():
            c.advance(context)
        for i in range(repeats + 2):
            for k, m in models.items():
                use(k)
                for n in rows:  # a chain of n rows (causal mask): the cost of n tree nodes
                    tokens = torch.arange(7, 7 + n)[None]
                    positions = torch.arange(context, context + n)[None]
                    t0 = time.perf_counter()
                    m.forward(tokens, positions, caches[k])
                    if i >= 2:
                        times.setdefault((k, n), []).append(time.perf_counter() - t0)
    kernels._C = exts["bf16 dequantized"]
    print(f"# SmolLM2-135M-Instruct target forward over n rows after {context} tokens, 1 thread, "
          f"{isa_line()}, commit {commit_id()}")  # fmt: skip
    print("| weights | " + " | ".join(f"n = {n}" for n in rows) + f" | prefill {context} |")
    print("|---|" + "---|" * (len(rows) + 1))
    for k in models:
        t1 = statistics.median(times[(k, rows[0])])
        cells = [f"{t1 * 1e3:.1f} ms"]
        for n in rows[1:]:
            tn = statistics.median(times[(k, n)])
            cells.append(f"{tn / t1:.2f} ({tn * 1e3:.1f} ms)")
        cells.append(f"{context / statistics.median(prefill[k]):.0f} tokens/s")
        print(f"| {k} | " + " | ".join(cells) + " |")


def e2e_bench(tokens: int, pairs: int) -> None:
    from rheo_engine.runtime.engine import Engine

    torch.set_num_threads(1)
    kept = Engine.from_pretrained(pair="smollm2", threads=1)
    dense = Engine.from_pretrained(pair="smollm2", threads=1, quantized=False)
    prompt = "Write a short story about a robot who learns to paint."
    rates: dict[str, list[float]] = {"Q4_1 kept": [], "bf16 dequantized": []}
    for i in range(pairs + 1):  # the first pair warms up (first-use measurements)
        order = [("Q4_1 kept", kept), ("bf16 dequantized", dense)]
        for label, engine in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            gen = engine.generate(prompt, tokens, method="ar", temperature=0, chat=True,
                                  ignore_eos=True)  # fmt: skip
            dt = time.perf_counter() - t0
            if i > 0:
                rates[label].append(len(gen.token_ids) / dt)
    print(f"# SmolLM2-135M-Instruct Q4_1, ar, T=0, {tokens} tokens, 1 thread, {isa_line()}, "
          f"commit {commit_id()}")  # fmt: skip
    a, b = (statistics.median(v) for v in rates.values())
    print(f"| Q4_1 kept quantized | {a:.1f} tokens/s |\n| bf16 dequantized | {b:.1f} tokens/s |")
    print(f"| ratio | {a / b:.2f}x |")


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--e2e", action="store_true")
    p.add_argument("--target", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--against", help="another build's rheo_engine/_C*.so: before / after")
    p.add_argument("--qtype", choices=["q4_1", "q8_0"], default="q4_1", help="with --against")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    p_rows = [int(r) for r in args.rows.split(",")]
    if args.target:
        target_bench(p_rows, args.repeats, args.against)
    elif args.against:
        against_bench(p_rows, args.against, args.qtype)
    elif args.e2e:
        e2e_bench(args.tokens, args.pairs)
    else:
        kernels_bench([int(r) for r in args.rows.split(",")], args.threads)


if __name__ == "__main__":
    main()
