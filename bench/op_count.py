"""Operators per plain decode step of a target, fused layer operators against the torch path
(LlamaModel.fused), and torch.compile against the fused eager path.

    python bench/op_count.py                     # smollm2 (Q4_1, bf16) and default: tables, ms
    python bench/op_count.py --pair smollm2 --compile --rows 1,4,16
    python bench/op_count.py --head-q8 --rows 1,2,4,8,16   # a draft level, Q8_0 head vs bf16

Counts come from torch.profiler over one decode step (one new token after a 32-token prefill):
the top-level operators (those no other operator called), by name, with their count and total
time; rheo's own kernels (rheo_engine._C, invisible to the profiler) are wrapped in
record_function("rheo::<name>") so they are counted too, each with the output allocation its
wrapper makes. Times are interleaved paired medians (fused, torch, fused, torch, ...) of a whole
step in the same process; the machine may be loaded, so only their ratio means anything.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from contextlib import contextmanager

import torch

from rheo_engine.io.gguf import read_gguf
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.runtime.pairs import smollm2_gguf
from rheo_engine.spec import kernels

WRAPPED = ("skinny_linear", "quant_linear", "tree_attention", "add_rms_norm", "rope_qk",
           "silu_mul")  # fmt: skip
PREFIX = 32


def load(pair: str) -> LlamaModel:
    """smollm2: the Q4_1 file as loaded by default (kept quantized); smollm2-bf16: dequantized
    to bf16 weights; default: the embedded pair's bf16 target."""
    if pair.startswith("smollm2"):
        return LlamaModel.from_gguf(read_gguf(smollm2_gguf()), dtype=torch.bfloat16,
                                    quantized=pair == "smollm2")  # fmt: skip
    return LlamaModel.from_pretrained(DEFAULT_PAIR / "target")


@contextmanager
def visible_kernels():
    """rheo's kernels wrapped in record_function while profiling (then restored)."""
    saved = {name: getattr(kernels, name) for name in WRAPPED if hasattr(kernels, name)}

    def wrap(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"rheo::{name}"):
                return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(kernels, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


class Step:
    """One decode step (rows new tokens at the same positions each call, never committed).
    ``slot``: in a slot of a KV pool as the engine decodes (its layers then run in one C++ call,
    LlamaModel._one_call); else in a KVCache (the layers' loop in Python, its operators seen)."""

    def __init__(self, model: LlamaModel, rows: int = 1, slot: bool = False) -> None:
        self.model = model
        self.cache = model.new_pool(PREFIX + 64, 1).batch([0]) if slot else \
            model.new_cache(PREFIX + 64)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            prompt = torch.randint(0, model.cfg.vocab_size, (1, PREFIX), generator=g)
            model.forward(prompt, torch.arange(PREFIX).view(1, -1), self.cache)
        self.cache.advance(PREFIX)
        self.tokens = torch.randint(0, model.cfg.vocab_size, (1, rows), generator=g)
        self.positions = torch.arange(PREFIX, PREFIX + rows).view(1, -1)

    def __call__(self, forward=None) -> torch.Tensor:
        with torch.no_grad():
            fn = forward or self.model.forward
            return fn(self.tokens, self.positions, self.cache)[0]


def op_table(step: Step) -> list[tuple[str, int, float]]:
    """(name, count, total ms) of the top-level operators of one step, most frequent first."""
    step()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with visible_kernels(), torch.profiler.profile(activities=cpu) as prof:
        step()
    count, ms = collections.Counter(), collections.Counter()
    for evt in prof.events():
        if evt.cpu_parent is None:
            count[evt.name] += 1
            ms[evt.name] += evt.cpu_time_total / 1e3
    return [(name, c, ms[name]) for name, c in count.most_common()]


def paired_ms(step: Step, a, b, repeats: int) -> tuple[float, float, float]:
    """Median ms of a, of b, and the median of the paired ratios b/a, interleaved."""
    ta, tb = [], []
    for i in range(repeats + 2):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1e3)
    ratios = [y / x for x, y in zip(ta, tb, strict=True)]
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


def count_section(pair: str, repeats: int) -> None:
    model = load(pair)
    step = Step(model)
    tables = {}
    for fused in (False, True):
        model.fused = fused
        tables[fused] = op_table(step)
    print(f"\n## {pair}: top-level operators of one decode step (1 row, prefix {PREFIX})")
    print(f"{'operator':28s} {'torch path':>16s} {'fused':>16s}")
    names = dict.fromkeys([n for n, _, _ in tables[False]] + [n for n, _, _ in tables[True]])
    rows = {f: {n: (c, t) for n, c, t in tables[f]} for f in (False, True)}
    for name in names:
        cells = [rows[f].get(name, (0, 0.0)) for f in (False, True)]
        print(f"{name:28s}" + "".join(f" {c:6d} {t:7.2f} ms" for c, t in cells))
    totals = [sum(c for _, c, _ in tables[f]) for f in (False, True)]
    print(f"{'total':28s} {totals[0]:6d} {'':10s} {totals[1]:6d}")

    def run(fused: bool):
        def go():
            model.fused = fused
            step()

        return go

    torch_ms, fused_ms, ratio = paired_ms(step, run(False), run(True), repeats)
    print(f"step ms (median of {repeats} interleaved pairs): torch path {torch_ms:.2f}, fused "
          f"{fused_ms:.2f}, fused/torch {ratio:.3f}")  # fmt: skip


def draft_level(heads, k: int, seen: int, g: torch.Generator):
    """One draft level on random inputs (k nodes over `seen` visible pairs), the same for each
    of ``heads`` (one config and dtype): a function per head returning its draft logits."""
    c, dtype = heads[0].cfg, heads[0].dtype
    h = torch.randn(1, k, c.hidden_size, generator=g).to(dtype)
    tokens = torch.randint(0, c.vocab_size, (1, k), generator=g)
    positions = torch.full((1, k), seen, dtype=torch.long)
    past = torch.randn(1, seen, c.num_key_value_heads, c.head_dim, generator=g).to(dtype)
    mask = torch.ones(1, k, seen + k, dtype=torch.bool)

    def level(head):
        def go():
            with torch.no_grad():
                return head.logits(head.layer(h, tokens, positions, past, past, mask)[0])

        return go

    return [level(head) for head in heads]


def head_section(repeats: int, k: int = 10, seen: int = 64) -> None:
    """One draft level of the smollm2 head (k nodes over `seen` visible pairs), fused vs torch,
    beside a plain step of its bf16 target."""
    from rheo_engine.models.eagle3 import Eagle3Head

    target = load("smollm2-bf16")
    head = Eagle3Head.from_pretrained(DEFAULT_PAIR.parent / "smollm2" / "head", target)
    [level] = draft_level([head], k, seen, torch.Generator().manual_seed(1))
    counts = {}
    for fused in (False, True):
        head.fused = fused
        level()
        with visible_kernels(), torch.profiler.profile() as prof:
            level()
        counts[fused] = sum(1 for e in prof.events() if e.cpu_parent is None)

    def run(fused: bool):
        def go():
            head.fused = fused
            level()

        return go

    torch_ms, fused_ms, ratio = paired_ms(None, run(False), run(True), repeats)
    step = Step(target)
    target.fused = True
    plain_ms = statistics.median(paired_ms(step, step, step, max(5, repeats // 3))[:2])
    print(f"\n## smollm2 head: one draft level, {k} nodes over {seen} pairs")
    print(f"top-level operators: torch path {counts[False]}, fused {counts[True]}")
    print(f"level ms: torch path {torch_ms:.2f}, fused {fused_ms:.2f}, fused/torch {ratio:.3f}; "
          f"a fused plain step of the bf16 target {plain_ms:.2f} ms (level = "
          f"{100 * fused_ms / plain_ms:.1f}%)")  # fmt: skip


class DrafterLevel:
    """A level as the engine drafts it: Eagle3Drafter.expand(1, ...) of k nodes after root_logits
    over ``seen`` committed pairs (random features); each call times the expand alone."""

    def __init__(self, head, k: int, seen: int, g: torch.Generator) -> None:
        from rheo_engine.models.eagle3_drafter import Eagle3Drafter

        c = head.cfg
        self.drafter = Eagle3Drafter(head, max_len=seen + 16)
        features = torch.randn(1, seen, len(head.feature_layers) * c.target_hidden_size,
                               generator=g)  # fmt: skip
        self.drafter.prefill(features, torch.randint(0, c.vocab_size, (1, seen), generator=g))
        self.ranks = torch.zeros(1, k, dtype=torch.long)
        self.tokens = torch.randint(0, c.vocab_size, (1, k), generator=g)

    def __call__(self) -> tuple[float, torch.Tensor]:
        """(ms of the level, its logits)."""
        self.drafter.root_logits()
        t0 = time.perf_counter()
        logits = self.drafter.expand(1, self.ranks, self.tokens)
        return (time.perf_counter() - t0) * 1e3, logits


def head_q8_section(rows_list: list[int], repeats: int, seen: int = 200) -> None:
    """One draft level of the smollm2 head (fused path, through Eagle3Drafter.expand as the
    engine drafts) with its matrices in Q8_0 (Eagle3Head.quantize, what the engine runs beside
    the Q4_1 target) against bf16, at each row count, beside a plain step of the Q4_1 target;
    and how often the two argmaxes agree. The Q8_0 level is also timed where the engine runs
    one: right after a target step (the target's 94 MB have evicted the head's ~10 MB), and as
    a tree's later levels run, right after another level (its weights in cache)."""
    from rheo_engine.models.eagle3 import Eagle3Head

    target = load("smollm2")
    where = DEFAULT_PAIR.parent / "smollm2" / "head"
    dense, quant = (Eagle3Head.from_pretrained(where, target) for _ in range(2))
    quant.quantize("q8_0")
    g = torch.Generator().manual_seed(1)
    step = Step(target, slot=True)  # as the engine decodes
    plain_ms = statistics.median(paired_ms(step, step, step, max(5, repeats // 3))[:2])
    print(f"\n## smollm2 head: one draft level over {seen} pairs, Q8_0 against bf16 "
          f"(plain Q4_1 step {plain_ms:.2f} ms, in a KV slot as the engine runs it)")  # fmt: skip
    print("| rows | bf16 ms | Q8_0 ms | Q8_0 / bf16 (paired) | Q8_0 level / plain step | "
          "Q8_0 after a target step | Q8_0 in a tree (after a level) | argmax agreement |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for k in rows_list:
        state = g.get_state()
        bf16 = DrafterLevel(dense, k, seen, g)
        g.set_state(state)
        q8 = DrafterLevel(quant, k, seen, g)
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(repeats + 2):
            for level, out in ((bf16, times[0]), (q8, times[1])):
                ms, _ = level()
                if i >= 2:
                    out.append(ms)
        bf16_ms, q8_ms = statistics.median(times[0]), statistics.median(times[1])
        ratio = statistics.median(y / x for x, y in zip(*times, strict=True))
        agree = (bf16()[1].argmax(-1) == q8()[1].argmax(-1)).float().mean().item()
        # Where a level runs: right after the target's step (its weights evicted by the
        # target's), or as a tree's levels run, after the head's flush and the previous level
        # (its weights in cache)
        cold, warm = [], []
        for _ in range(max(5, repeats // 2)):
            step()
            cold.append(q8()[0])
            warm.append(q8()[0])
        cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
        print(f"| {k} | {bf16_ms:.2f} | {q8_ms:.2f} | {ratio:.3f} | {100 * q8_ms / plain_ms:.0f}%"
              f" | {cold_ms:.2f} ms ({100 * cold_ms / plain_ms:.1f}%) | {warm_ms:.2f} ms "
              f"({100 * warm_ms / plain_ms:.1f}%) | {agree:.2f} |")  # fmt: skip


def compile_section(rows_list: list[int], repeats: int) -> None:
    """torch.compile (Inductor) of the fused forward's torch path vs the fused eager path."""
    model = load("smollm2-bf16")  # Inductor cannot trace rheo's packed Q4_1 weights either
    print("\n## torch.compile (inductor, dynamic=False) vs fused eager, smollm2 bf16 decode step")
    for rows in rows_list:
        step = Step(model, rows)
        model.fused = False  # Inductor fuses the torch ops itself; rheo's kernels are opaque
        # Each rheo kernel (pybind) is a graph break, and the layers' frames differ only in their
        # weights: allow one compiled frame per layer instead of falling back to eager after 8.
        torch._dynamo.config.recompile_limit = 4 * model.cfg.num_hidden_layers
        torch._dynamo.config.accumulated_recompile_limit = 64 * model.cfg.num_hidden_layers
        compiled = torch.compile(model.forward, dynamic=False)
        t0 = time.perf_counter()
        step(compiled)
        compile_s = time.perf_counter() - t0
        step(compiled)

        def eager():
            model.fused = True
            step()

        def comp():
            model.fused = False
            step(compiled)

        eager_ms, comp_ms, ratio = paired_ms(step, eager, comp, repeats)
        print(f"rows {rows:3d}: compile {compile_s:6.1f} s; step ms fused eager {eager_ms:.2f}, "
              f"compiled {comp_ms:.2f}, compiled/eager {ratio:.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", choices=["smollm2", "smollm2-bf16", "default", "all"], default="all")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--rows", default="1,4,16", help="row counts for --compile")
    p.add_argument("--no-count", action="store_true", help="only the --compile section")
    p.add_argument("--head-q8", action="store_true",
                   help="only a draft level in Q8_0 against bf16, at --rows")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, rheo ISA "
          f"{kernels.cpu_isa()}, 1 thread")  # fmt: skip
    if args.head_q8:
        head_q8_section([int(r) for r in args.rows.split(",")], args.repeats)
        return
    if not args.no_count:
        everything = ["smollm2", "smollm2-bf16", "default"]
        for pair in everything if args.pair == "all" else [args.pair]:
            count_section(pair, args.repeats)
        if args.pair in ("all", "smollm2", "smollm2-bf16"):
            head_section(args.repeats)
    if args.compile:
        compile_section([int(r) for r in args.rows.split(",")], max(10, args.repeats // 3))


if __name__ == "__main__":
    main()
