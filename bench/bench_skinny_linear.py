"""Benchmark the skinny linear layer: kernels.skinny_linear against F.linear, 1 to 64 rows.

Checks the kernel against x.float() @ w.float().T first, then times each case with
common.Timer.pair: a warm-up, then paired repeats interleaved (kernel, F.linear, F.linear,
kernel, ...) with L2 flushed before every call, median of each. Prints one markdown row per
case: both times, the speedup (F.linear / kernel), the kernel's t(n)/t(1), the GB/s of W it
read and the memory floor: the bytes of W over the read bandwidth measured at the start (a
1-thread sum over 512 MiB). Shapes: a Llama-3.2-1B layer (fused qkv, o, fused gate/up, down),
the default pair's target (weights/default/target/config.json) and SmolLM2-135M's, n rows of x.

``--target smollm2|default|DIR`` (DIR: a pair's folder holding target/, e.g. a widened pair)
instead times the target's forward over n tree rows after a 300-token context
(LlamaModel.forward, bf16, the kernel for every linear against RHEO_LINEAR=torch, interleaved)
and prints t(n)/t(1) for each: what a tree costs.

    python bench/bench_skinny_linear.py [--quick] [--rows 1,2,4,8,16,32,64] [--threads 1,2]
                                        [--dtype bfloat16,float32] [--shapes llama1b,default]
    python bench/bench_skinny_linear.py --shapes smollm2 --dtype bfloat16 --threads 1
    python bench/bench_skinny_linear.py --target smollm2 --rows 1,4,16 --threads 1
    python bench/bench_skinny_linear.py --target /work/wide1b --rows 1,4,16,64 --threads 2
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Timer, commit_id
from inputs import ArgumentParser

from rheo_engine.machine import isa_line
from rheo_engine.spec import kernels

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# name -> (matrix, [out, in]) of a Llama-3.2-1B layer: hidden 2048, intermediate 8192.
LLAMA_1B = [("qkv", (4096, 2048)), ("o", (2048, 2048)), ("gate_up", (16384, 2048)),
            ("down", (2048, 8192))]  # fmt: skip


# SmolLM2-135M (the smollm2 pair's target): hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64.
SMOLLM2 = [("smollm2 qkv", (960, 576)), ("smollm2 o", (576, 576)),
           ("smollm2 gate_up", (3072, 576)), ("smollm2 down", (576, 1536)),
           ("smollm2 lm_head", (49152, 576))]  # fmt: skip


def default_pair_shapes() -> list[tuple[str, tuple[int, int]]]:
    """The default target's matmuls, read from its config (they change when it is retrained)."""
    config = ROOT / "weights" / "default" / "target" / "config.json"
    if not config.is_file():
        raise SystemExit(f"{config} not found; run with --shapes llama1b")
    c = json.loads(config.read_text())
    hidden, inter, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    return [
        ("default qkv", ((H + 2 * Hkv) * D, hidden)),
        ("default o", (hidden, H * D)),
        ("default gate_up", (2 * inter, hidden)),
        ("default down", (hidden, inter)),
        ("default lm_head", (c["vocab_size"], hidden)),
    ]


def check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """The kernel against fp32 sums rounded once: within 1 ulp of the dtype plus the fp32 bound."""
    y = kernels.skinny_linear(x, w).double()
    ref = (x.float() @ w.float().T).to(x.dtype).double()
    ulp = ref.abs() * (2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-23)
    bound = (x.shape[-1] + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    if not ((y - ref).abs() <= ulp + 2 * bound + 1e-30).all():
        raise SystemExit(f"skinny_linear disagrees with x.float() @ w.float().T for {what}")


def read_bandwidth_gb_s() -> float:
    """GB/s of one thread summing 512 MiB of float32 (median of 5): the floor's bandwidth."""
    buf = torch.ones(128 * 2**20)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times[1:]) / 1e9


def set_linear(mode: str) -> None:
    """RHEO_LINEAR for ``mode``: "default" unsets it (what a user gets), else sets it."""
    if mode == "default":
        os.environ.pop("RHEO_LINEAR", None)
    else:
        os.environ["RHEO_LINEAR"] = mode


def target_rows(pair: str, rows: list[int], context: int = 300, repeats: int = 15) -> None:
    """t(n)/t(1) of the target's forward over n tree rows after ``context`` tokens, and the
    prefill of those tokens, bf16: the default linear (the kernel for every call) and
    RHEO_LINEAR=torch, all interleaved; medians. Run from an older checkout (PYTHONPATH), it
    times that checkout's default."""
    from rheo_engine.runtime.engine import Engine

    options = {"pair": "smollm2", "quantized": False} if pair == "smollm2" else {}
    if Path(pair).is_dir():  # a pair's folder (its target is timed)
        options = {"target": str(Path(pair) / "target"), "draft": str(Path(pair) / "draft")}
    try:
        model = Engine.from_pretrained(dtype=torch.bfloat16, **options).target
    except TypeError:  # a checkout from before quantized GGUF loading: dequantized anyway
        options.pop("quantized", None)
        model = Engine.from_pretrained(dtype=torch.bfloat16, **options).target
    cache = model.new_cache(context + max(rows) + 1)
    prompt = torch.arange(5, 5 + context)[None] % model.cfg.vocab_size
    cases = {}
    for n in rows:  # a chain of n rows (causal mask): the cost of n tree nodes
        cases[n] = (torch.arange(7, 7 + n)[None], torch.arange(context, context + n)[None])
    prefill: dict[str, list[float]] = {"default": [], "torch": []}
    times: dict[tuple[str, int], list[float]] = {}
    before = os.environ.get("RHEO_LINEAR")
    try:
        for i in range(4):  # the prefill, last row's logits only, as the engine runs it
            for mode in prefill:
                set_linear(mode)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.forward(prompt, torch.arange(context)[None], cache, last_logits_only=True)
                if i:
                    prefill[mode].append(time.perf_counter() - t0)
        cache.advance(context)
        for i in range(repeats + 2):
            for mode in ("default", "torch"):
                set_linear(mode)
                for n, (tokens, positions) in cases.items():
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        model.forward(tokens, positions, cache)
                    if i >= 2:
                        times.setdefault((mode, n), []).append(time.perf_counter() - t0)
    finally:
        set_linear("default" if before is None else before)
    print(f"# target forward over n rows after {context} tokens: {pair}, bf16, "
          f"threads={torch.get_num_threads()}, cpu={isa_line()}, commit={commit_id()}")  # fmt: skip
    print("| linear | " + " | ".join(f"n = {n}" for n in rows) + f" | prefill {context} |")
    print("|---|" + "---|" * (len(rows) + 1))
    for mode in ("default", "torch"):
        t1 = statistics.median(times[(mode, rows[0])])
        cells = [f"{t1 * 1e3:.1f} ms"]
        for n in rows[1:]:
            tn = statistics.median(times[(mode, n)])
            cells.append(f"{tn / t1:.2f} ({tn * 1e3:.1f} ms)")
        cells += [f"{statistics.median(prefill[mode]) * 1e3:.0f} ms"]
        print(f"| {'default' if mode == 'default' else 'RHEO_LINEAR=torch'} | "
              + " | ".join(cells) + " |")  # fmt: skip


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 0.1 s per case, not 1 s")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="n values, comma-separated")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--dtype", default="bfloat16,float32", help="bfloat16 and/or float32")
    parser.add_argument("--shapes", default="llama1b,default",
                        help="llama1b, default and/or smollm2")  # fmt: skip
    parser.add_argument("--target", help="smollm2, default or a pair's folder (holding target/): "
                        "time the target's forward over n tree rows instead")  # fmt: skip
    args = parser.parse_args()
    try:
        rows = [int(v) for v in args.rows.split(",")]
        threads = [int(v) for v in args.threads.split(",")]
    except ValueError:
        parser.error(f"--rows and --threads take integers, got {args.rows!r}, {args.threads!r}")
    if min(rows) < 1 or min(threads) < 1:
        parser.error("--rows and --threads must be >= 1")
    if args.target:
        if args.target not in ("smollm2", "default") and not Path(args.target, "target").is_dir():
            parser.error(f"--target takes smollm2, default or a folder holding target/, got "
                         f"{args.target!r}")  # fmt: skip
        torch.set_num_threads(threads[0])
        return target_rows(args.target, rows)
    dtypes = args.dtype.split(",")
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtype takes {sorted(DTYPES)}, got {args.dtype!r}")
    shapes = []
    for name in args.shapes.split(","):
        if name not in ("llama1b", "default", "smollm2"):
            parser.error(f"--shapes takes llama1b, default and/or smollm2, got {name!r}")
        shapes += {"llama1b": LLAMA_1B, "smollm2": SMOLLM2}.get(name) or default_pair_shapes()
    timer = Timer("cpu", flush=True, budget_s=0.1 if args.quick else 1.0)
    bandwidth = read_bandwidth_gb_s()
    print(
        f"# skinny_linear bench: cpu={isa_line()} capability="
        f"{torch.backends.cpu.get_cpu_capability()} torch={torch.__version__} "
        f"build={kernels.build_info()} bf16 dot={kernels.skinny_linear_bf16_dot()} "
        f"commit={commit_id()}; L2 flushed before each call; read bandwidth "
        f"{bandwidth:.1f} GB/s (1 thread)"
    )
    columns = ["dtype", "matrix", "W [out, in]", "n", "threads", "F.linear ms", "skinny ms"]
    columns += ["speedup", "skinny t(n)/t(1)", "skinny GB/s", "floor ms", "skinny / floor"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    gen = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for name, (out, in_) in shapes:
            w = (torch.randn(out, in_, generator=gen) * in_**-0.5).to(dtype)
            x_all = torch.randn(max(rows), in_, generator=gen).to(dtype)
            check(x_all, w, f"{dtype_name} W [{out}, {in_}], n={max(rows)}")
            floor_ms = w.numel() * w.element_size() / (bandwidth * 1e9) * 1e3
            for t in threads:
                torch.set_num_threads(t)
                one_ms = None
                for n in rows:
                    x = x_all[:n]
                    skinny_us, torch_us = timer.pair(
                        lambda: kernels.skinny_linear(x, w), lambda: F.linear(x, w)
                    )
                    torch_ms, skinny_ms = torch_us / 1e3, skinny_us / 1e3
                    one_ms = one_ms or skinny_ms  # rows[0]'s time (n = 1 by default)
                    gb_per_s = w.numel() * w.element_size() / (skinny_ms * 1e-3) / 1e9
                    print(
                        f"| {dtype_name} | {name} | [{out}, {in_}] | {n} | {t} | {torch_ms:.3f} "
                        f"| {skinny_ms:.3f} | {torch_ms / skinny_ms:.2f} | "
                        f"{skinny_ms / one_ms:.2f} | {gb_per_s:.1f} | {floor_ms:.3f} | "
                        f"{skinny_ms / floor_ms:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
