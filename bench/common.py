"""Shared pieces of the benches: the end-to-end ones (e2e.py, table4.py, ablations.py) and the
kernel ones (bench_*.py).

The conditions line (commit, hardware, versions), the kernel benches' timer and their checks
against a reference, an interleaved runner that gives every configuration the same questions in
rotating order (so machine drift hits all alike), the tau / tokens / tokens-per-second / speedup
summary, and JSON / markdown output. What the benches read (flags, pairs, question sets) and its
checks are in inputs.py.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from inputs import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

from rheo_engine import Engine
from rheo_engine.machine import isa_line
from rheo_engine.runtime.engine import Generation
from rheo_engine.spec import kernels

METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside ``with`` (a kernel launch each on a GPU) and
    the host reads: every point where the host would wait for a GPU's stream if the tensors
    lived there, also on a CPU run. A host read is an operator of ``host_read_op`` (item(),
    int(), bool() of a tensor, torch.equal, nonzero, boolean masks, unique, device-to-host
    copies) or a call of Tensor.tolist / .numpy / .cpu (np.asarray goes through .numpy), each
    counted once even when it dispatches a scalar read inside. ``reads`` says where each came
    from (the innermost rheo_engine frame), for the message of a failing test. ``.to(device)``
    is not counted: on a CPU run a copy to the model's device cannot be told from one to the
    host (the engine moves results to the host only with .tolist()). ``uploads`` counts the
    tensors made from host data (torch.tensor(list)): on a GPU each is a blocking host-to-device
    copy, which waits for the stream too."""

    aten = torch.ops.aten
    # Operators that hand the host a value computed on the device (item(), int(), bool(),
    # `if t.any()`, torch.equal / allclose) ...
    SCALAR_READS = {aten._local_scalar_dense, aten.equal, aten.allclose, aten.is_nonzero}
    # ... or whose output shape depends on the data, which the host must read before it can
    # allocate (torch.where(cond) with one argument, unique, bincount; boolean masks below).
    DATA_SHAPED = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
                   aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
                   aten.bincount}  # fmt: skip
    INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
    # Tensor methods that copy a tensor to host memory. On a GPU tensor each is a device-to-host
    # copy; on a CPU tensor none dispatches an operator that says so, so the counter patches
    # them while it is active.
    HOST_METHODS = ("tolist", "numpy", "cpu")

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.host_reads = self.uploads = 0
        self.reads: list[str] = []
        self._quiet = 0  # > 0 inside a patched method: its own reads are already counted
        self._saved: dict[str, object] = {}

    @classmethod
    def host_read_op(cls, func, args, kwargs) -> bool:
        """Whether the aten call would force a device-to-host read on GPU tensors."""
        aten, packet = cls.aten, func.overloadpacket
        if packet in cls.SCALAR_READS or packet in cls.DATA_SHAPED:
            return True
        if packet in cls.INDEXING:  # a boolean mask index is a nonzero() in disguise
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices or ()
            )
        if packet is aten.repeat_interleave:  # tensor repeats: the output length is their sum
            repeats = args[0] if func is aten.repeat_interleave.Tensor else args[1]
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if packet in (aten._to_copy, aten.copy_):  # a real device-to-host copy (a GPU run)
            src = args[1] if packet is aten.copy_ else args[0]
            dst = args[0].device if packet is aten.copy_ else kwargs.get("device")
            return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
        return False

    def _read(self, what: str) -> None:
        self.host_reads += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "rheo_engine" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        self.reads.append(f"{what} at {where}")

    def _patched(self, name: str, method):
        def read(tensor, *args, **kwargs):
            if self._quiet == 0:
                self._read(f"Tensor.{name}()")
            self._quiet += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._quiet -= 1

        return read

    def __enter__(self):
        for name in self.HOST_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._patched(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            if method is None:
                delattr(torch.Tensor, name)  # it was inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, method)
        self._saved = {}
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if self._quiet == 0 and self.host_read_op(func, args, kwargs):
            self._read(str(func))
        self.uploads += func.overloadpacket is self.aten.lift_fresh
        return func(*args, **kwargs)


# --- conditions -----------------------------------------------------------------------------


def commit_id() -> str:
    """Short HEAD hash, '+dirty' when the tree has changes; 'unknown' outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(["git", "diff", "--quiet"], cwd=ROOT).returncode != 0
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware(device: str) -> str:
    """The GPU name for cuda, else the CPU model and the vector extensions that decide which
    code runs (AVX2 / AVX-512 / AVX-512-BF16 / AMX): numbers move a lot between those. A list
    ("cpu,cuda", a bench that runs on both) names each, joined by " + "."""
    if "," in device:
        return " + ".join(hardware(d) for d in device.split(","))
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return isa_line()


def conditions(bench: str, device: str, **settings: Any) -> dict[str, Any]:
    """Everything a number depends on, as a dict (goes into the JSON and the first line)."""
    return {
        "bench": bench,
        **settings,
        "device": device,
        "hardware": hardware(device),
        "torch_threads": torch.get_num_threads(),
        "build": kernels.build_info(),
        "torch": torch.__version__,
        "commit": commit_id(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def conditions_line(cond: dict[str, Any]) -> str:
    return "# " + " ".join(f"{k}={_short(v)}" for k, v in cond.items())


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v).replace(" ", "_")


# --- kernel benches: the timer and the checks ------------------------------------------------


class Timer:
    """Median µs of callables on one device, the clock of every kernel bench.

    Each timed call starts on an idle device (CUDA: synchronized first) and is measured by CUDA
    events on a GPU, so that the launch latency counts as it does in a decode step, or by
    perf_counter on the CPU. With ``flush``, a buffer is touched before each call so that no
    call finds the last one's data in cache: on a GPU twice its L2, written; on the CPU 2 MiB,
    read (it evicts each core's L2, 512 KiB on Zen 3, but leaves most of L3, as a model's weights
    would share it between steps; read, not written, so the timed call has no dirty lines to
    write back). ``median_us`` times one callable after a warm-up; ``pair`` times two,
    interleaved, for about ``budget_s`` seconds (a pilot pair sizes the repeats, 5 to
    ``max_pairs``).
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        flush: bool = False,
        budget_s: float = 1.0,
        max_pairs: int = 200,
    ) -> None:
        self.device, self.budget_s, self.max_pairs = torch.device(device), budget_s, max_pairs
        self.cuda = self.device.type == "cuda"
        self.flush_buf: torch.Tensor | None = None
        if flush and self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            l2 = getattr(props, "L2_cache_size", 0) or 2**26
            self.flush_buf = torch.empty(2 * l2 // 4, dtype=torch.float32, device=self.device)
        elif flush:
            self.flush_buf = torch.zeros(2 * 2**20 // 4)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once_us(self, fn: Callable[[], object]) -> float:
        """One call of ``fn``, in µs (after the flush, when the timer has one)."""
        if self.flush_buf is not None:
            if self.cuda:
                self.flush_buf.zero_()
            else:
                self.flush_buf.sum()
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def median_us(self, fn: Callable[[], object], reps: int, warmup: int | None = None) -> float:
        """Median µs of ``reps`` calls after ``warmup`` untimed ones (default max(3, reps // 10):
        first-call allocations, lazy module loads, the thread pool's start)."""
        for _ in range(max(3, reps // 10) if warmup is None else warmup):
            fn()
        return statistics.median(self.once_us(fn) for _ in range(reps))

    def pair(self, ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float]:
        """Median µs of ``ours`` and of ``theirs``, interleaved (ours, theirs, theirs, ours, ...)
        so that drift and the order of the calls hit both alike."""
        for _ in range(3):  # warm-up: allocations, cuBLAS/SDPA heuristics, lazy module loads
            ours(), theirs()
        self.sync()
        t0 = time.perf_counter()
        self.once_us(ours), self.once_us(theirs)  # a pilot pair sizes the repeats
        pilot_s = max(time.perf_counter() - t0, 1e-6)
        pairs = int(min(self.max_pairs, max(5, self.budget_s / pilot_s)))
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(pairs):
            order = ((ours, times[0]), (theirs, times[1]))
            for fn, out in order if i % 2 == 0 else order[::-1]:
                out.append(self.once_us(fn))
        return statistics.median(times[0]), statistics.median(times[1])


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A kernel's exact output against its reference, before any timing: SystemExit naming
    ``what`` unless the two have the same shape and values (torch.equal, on the CPU)."""
    if not torch.equal(got.cpu(), want.cpu()):
        raise SystemExit(f"{what} differ")


def max_abs_diff(got: torch.Tensor, want: torch.Tensor, limit: float, what: str) -> float:
    """max |got - want| in float32, checked before any timing: SystemExit naming ``what`` when
    it is over ``limit`` (or NaN). Returns it, for the bench's check column."""
    err = (got.float() - want.float()).abs().max().item()
    if not err <= limit:
        raise SystemExit(f"{what} differ by {err:.3g} (max abs), over {limit:g}")
    return err


# --- the interleaved runner -----------------------------------------------------------------


def produced(gen: Generation) -> int:
    """Tokens a generation produced: sum(accept_lengths), but no drafted token after an EOS or
    beyond max_new_tokens (the walk accepts them; nobody gets them).

    Until the engine's fix of Generation.accept_lengths lands, a step's length counts the whole
    accepted path, stop or not (topk showed tau 3.00 over 0 tokens); the min with the tokens
    returned (+1 for the EOS, which the target did produce) keeps tau true with either engine,
    and is a no-op once the fix is in.
    """
    return min(sum(gen.accept_lengths), len(gen.token_ids) + (gen.stop_reason == "eos"))


@dataclass
class Record:
    """One generation: what the summary needs, and the phase times."""

    label: str  # the configuration (a method, or e.g. "rheo m=2")
    set: str
    question: int
    seed: int
    new_tokens: int  # tokens returned (a stop token is not one)
    emitted: int  # tokens the target produced: produced(gen), tau's numerator
    steps: int  # target forwards after the prefill, tau's denominator
    wall_s: float
    draft_s: float
    head_s: float
    target_s: float
    trees: dict[str, int] = field(default_factory=dict)  # "N/depth" -> steps ("1/0": plain)
    predicted_s: float = 0.0  # the auto tree's predicted step times, summed (0 when fixed)
    prefill_s: float = 0.0


def run_interleaved(
    engine: Engine,
    prompts: dict[str, list[list[int]]],
    configs: dict[str, dict[str, Any]],
    seeds: list[int],
    max_new_tokens: int,
    progress: bool = True,
    around: Callable[[str], AbstractContextManager] | None = None,
) -> list[Record]:
    """Every configuration on every prompt and seed; per prompt all configurations run back to
    back, in an order rotated by one each prompt (drift and warm caches hit all alike).

    ``around(label)``, when given, is entered around each generation of that configuration
    (ablations.py records the draft distributions with it).
    """
    around = around or (lambda label: nullcontext())
    labels = list(configs)
    total = len(seeds) * sum(len(v) for v in prompts.values())
    records: list[Record] = []
    start, done = time.perf_counter(), 0
    for label in labels:  # warm-up: first calls allocate and fault in weights
        engine.generate(next(iter(prompts.values()))[0], 4, seed=0, **configs[label])
    for seed in seeds:
        for set_index, (name, ids_list) in enumerate(prompts.items()):
            for q, ids in enumerate(ids_list):
                shift = done % len(labels)
                taus = {}
                for label in labels[shift:] + labels[:shift]:
                    gen_seed = seed * 1_000_003 + set_index * 1000 + q
                    with around(label):
                        gen = engine.generate(ids, max_new_tokens, seed=gen_seed, **configs[label])
                    t = gen.times
                    records.append(
                        Record(
                            label,
                            name,
                            q,
                            seed,
                            len(gen.token_ids),
                            produced(gen),
                            gen.steps,
                            # the one-time cost measurement is reported apart (measure_s)
                            gen.wall_s - gen.measure_s,
                            t.draft_s,
                            t.head_s,
                            t.target_s,
                            {f"{n}/{d}": c for (d, n), c in gen.trees.shapes.items()},
                            gen.trees.predicted_s,
                            gen.prefill_s,
                        )
                    )
                    taus[label] = produced(gen) / max(1, gen.steps)
                done += 1
                if progress:
                    _progress(done, total, start, f"{name} q{q} seed {seed}", taus)
    if progress:
        print(file=sys.stderr)
    return records


def _progress(done: int, total: int, start: float, where: str, taus: dict[str, float]) -> None:
    elapsed = time.perf_counter() - start
    eta = elapsed / done * (total - done)
    tau = " ".join(f"{k}={v:.2f}" for k, v in taus.items())
    end = "\r" if sys.stderr.isatty() else "\n"
    print(
        f"[{done}/{total}] {where}: tau {tau} | {elapsed:.0f}s, eta {eta:.0f}s",
        end=end,
        file=sys.stderr,
        flush=True,
    )


# --- summary --------------------------------------------------------------------------------


def tree_histogram(records: list[Record], label: str, top: int = 3) -> str:
    """The ``top`` most used trees of a configuration, e.g. 'N=1 71%, N=8/d3 20%, ...'."""
    counts: dict[str, int] = {}
    for r in records:
        if r.label == label:
            for shape, c in r.trees.items():
                counts[shape] = counts.get(shape, 0) + c
    total = sum(counts.values()) or 1
    parts = []
    for shape, c in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
        n, d = shape.split("/")
        parts.append(f"N={n}{'' if n == '1' else '/d' + d} {100 * c / total:.0f}%")
    return ", ".join(parts)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _totals(records: list[Record]) -> tuple[float, float]:
    """(tau, tokens per second) of a group of generations: ratios of sums (a short generation
    weighs less than a long one, as it costs fewer target forwards)."""
    steps = sum(r.steps for r in records)
    wall = sum(r.wall_s for r in records)
    tau = sum(r.emitted for r in records) / steps if steps else math.nan
    return tau, sum(r.new_tokens for r in records) / wall if wall > 0 else math.nan


def summarize(records: list[Record], baseline: str | None = "ar") -> dict[str, dict[str, dict]]:
    """{label: {set or "average": stats}}: tau mean/std over seeds, the tokens emitted (all
    seeds) that tau is measured over, tokens/s, and speedup over ``baseline`` measured per seed
    in the same run (absent when the baseline was not run).

    tau of one seed and set = tokens produced / target forwards over its questions; "average"
    takes the mean of the per-set tau (as Table 2) and the tokens/s over all sets.
    """
    labels = list(dict.fromkeys(r.label for r in records))
    sets = list(dict.fromkeys(r.set for r in records))
    seeds = sorted({r.seed for r in records})
    group: dict[tuple[str, str, int], list[Record]] = {}
    for r in records:
        group.setdefault((r.label, r.set, r.seed), []).append(r)

    def stats(label: str, names: list[str]) -> dict[str, float]:
        taus, tps, speedups = [], [], []
        for seed in seeds:
            taus.append(statistics.fmean(_totals(group[(label, s, seed)])[0] for s in names))
            speed = _totals([r for s in names for r in group[(label, s, seed)]])[1]
            tps.append(speed)
            if baseline in labels:
                base = _totals([r for s in names for r in group[(baseline, s, seed)]])[1]
                speedups.append(speed / base)
        out = dict(zip(("tau_mean", "tau_std"), mean_std(taus), strict=True))
        out["tokens"] = sum(
            r.new_tokens for s in names for seed in seeds for r in group[(label, s, seed)]
        )
        out.update(zip(("tokens_per_s", "tokens_per_s_std"), mean_std(tps), strict=True))
        if speedups:
            out.update(zip(("speedup", "speedup_std"), mean_std(speedups), strict=True))
        return out

    return {
        label: {**{s: stats(label, [s]) for s in sets}, "average": stats(label, sets)}
        for label in labels
    }


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out: str | None, md: str | None, payload: dict, table: str) -> None:
    """JSON to ``out`` and the markdown table (conditions first) to ``md``, when given."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(conditions_line(payload["conditions"]) + "\n\n" + table)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Record):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
