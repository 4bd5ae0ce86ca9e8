"""Which tree each step drafts (docs/tree_policy.md): a fixed tree, or the measured cost model.

A policy answers ``choose(room, wanted)`` before a step and ``observe(cfg, outcome, seconds)``
after it (``outcome``: the step's verdict as read on the host, verify.Outcome). ``FixedTree`` is
the paper's tree cut to the context (step.fit_tree).
``AutoTree`` (``tree="auto"``, the default) maximises predicted tokens per second:

    rate(D, N) = (1 + E[accepted | D, N]) / (step(D, N))      and     rate(plain) = 1 / plain

over depths D <= the configured depth and sizes N <= total_tokens (topk stays the configured
one: a level's cost is nearly flat in its rows on the pairs measured, see BENCHMARKS.md), and
takes a plain step when no tree beats it.

- Costs: a ``CostProfile`` made once per (model, device, dtype, threads, method family) on
  the running machine: target forwards of n tree nodes, draft levels, verification. On one
  CPU process each part is timed once (estimate_profile) and the real steps refine it
  (CostLearner) until it is final; elsewhere (measure_profile) in interleaved rounds until
  their spread is small, then real steps of a few shapes calibrate it. Cached by the engine
  for the process and on disk per machine (rheo_engine.machine), savable and loadable as
  JSON. Predictions read it physically consistent (non-decreasing in the tree size, no tree
  below a plain step); a profile in doubt (calibration factors that disagree, a tree measured
  below a plain step) is never kept, and a kept one that the first real steps contradict is
  made again. Otherwise it is frozen while requests run, so a request's trees depend on its
  profile, its seed and its prompt only.
- Acceptance: every tree's nodes 1..N-1 are in prune rank order (proxy_rerank.h), so a past
  step also says what any smaller tree would have accepted: the top-(N'-1) nodes of depth
  <= D' are its first N'-1 nodes of depth <= D' (levels are grown identically and pruning keeps
  a prefix of the rank order), and a node's acceptance does not depend on lower-ranked nodes
  (exactly so at T = 0; approximately when sampling). ``AcceptanceStats`` replays each step
  into every (D', N') cell it covers, as exponential moving sums over the steps that cover it.
  Trees are chosen from that evidence alone; an optimistic prior only picks the probes, whose
  predicted loss against plain steps is held to a small share of the time.

Lossless (docs/tree_policy.md §7): choose() reads only the profile and what previous steps returned
(their trees and verdicts) and the room/wanted counts known before the step; it never sees
this step's coins, its sampled tokens or the target's logits. Every tree shape is lossless
when fixed in advance, and a shape chosen from the past is fixed in advance of the step, so
the law of each step given the past is the target's (tests/test_lossless.py enumerates a
two-step run whose second tree depends on the first step's outcome; a control that picks the
tree after seeing this step's sampled token fails).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import torch

from rheo_engine.config import PLAIN, TreeConfig
from rheo_engine.machine import kept_file, write_kept
from rheo_engine.spec.step import fit_tree, max_tree_size
from rheo_engine.spec.verify import Outcome

# Tree sizes the cost model considers (clipped to total_tokens) and where it times forwards.
SIZES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60)
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 60)


class TreePolicy(Protocol):
    def choose(self, room: int, wanted: int) -> TreeConfig:
        """The tree of the next step: ``room`` free context rows, ``wanted`` tokens still due."""
        ...

    def observe(self, cfg: TreeConfig, outcome: Outcome, seconds: float) -> None:
        """What the step drafted and accepted (host values: the step's one read), its time."""
        ...


@dataclass
class TreeUsage:
    """What a request's steps drafted: for Generation and the stats line."""

    shapes: Counter = field(default_factory=Counter)  # (depth, total_tokens) -> steps; (0, 1) plain
    predicted_s: float = 0.0  # sum of the cost model's step times (0 for a fixed tree)
    measured_s: float = 0.0  # sum of the measured step times
    # The steps the cost model predicted (a `both` request's lookup-only steps have none):
    # their count and measured time, what predicted_s compares with.
    predicted_steps: int = 0
    predicted_measured_s: float = 0.0

    def histogram(self) -> str:
        """'N=1x12 N=8/d3x30 ...': steps per tree, plain steps as N=1."""
        parts = []
        for (d, n), count in sorted(self.shapes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            parts.append(f"N={n}x{count}" if n == 1 else f"N={n}/d{d}x{count}")
        return " ".join(parts)

    def add(self, cfg: TreeConfig, predicted_s: float | None, measured_s: float) -> None:
        self.shapes[tree_shape(cfg)] += 1
        self.measured_s += measured_s
        if predicted_s:
            self.predicted_s += predicted_s
            self.predicted_steps += 1
            self.predicted_measured_s += measured_s


def tree_shape(cfg: TreeConfig) -> tuple[int, int]:
    """(depth, total_tokens) of a step's tree; (0, 1) for a plain step."""
    return (0, 1) if cfg.method == "ar" or cfg.total_tokens == 1 else (cfg.depth, cfg.total_tokens)


class FixedTree:
    """The configured tree every step, cut to what is left of the context and of the request."""

    predicted_s = None  # no cost model

    def __init__(self, cfg: TreeConfig) -> None:
        self.cfg = cfg

    def choose(self, room: int, wanted: int) -> TreeConfig:
        return fit_tree(self.cfg, room, wanted)

    def observe(self, cfg, outcome, seconds) -> None:
        pass


# --- costs ------------------------------------------------------------------------------------

# A profile is not kept (and a kept one not used) when its calibration factors differ by more
# than this ratio across sizes (the Xeon's quiet profile: 1.01-1.13; measured under load:
# 0.46-2.02), or when a tree's real steps measured below 0.95 plain steps. The timings' spread
# is reported, not a reason: on a shared machine a quiet profile can spread widely too.
MAX_SCALE_RATIO = 2.5
# Nor when a verification or a draft level is priced over this many times a target forward of
# as many rows (the head is one layer, verification reads the logits the forward made): profiles
# kept on a noisy host had grown to 1e22 s of verification, each contradiction scaling a part
# that real steps never re-learned (CostLearner now learns it), 2026-12-07.
MAX_PART_RATIO = 10.0


@dataclass
class CostProfile:
    """Measured seconds of the parts of a step on one machine, for one (model, settings) key.

    The tables hold what was measured; every prediction reads them physically consistent
    (docs/tree_policy.md §4): target and verification times non-decreasing in the size (their
    running maximum), a step non-decreasing in the size at a given depth and width, and no
    tree cheaper than a plain step."""

    key: str  # what it was measured for: model shapes, device, dtype, threads, pool kind
    target_s: dict[int, float]  # tree size n -> one target forward over n nodes
    draft_base_s: float  # drafting a depth-1 tree (root logits, pool, build_tree)
    level_s: dict[int, float]  # topk -> each further draft level (head over topk rows + pools)
    verify_s: dict[int, float]  # tree size n -> one verification
    measure_s: float = 0.0  # how long measuring took
    # Tree size n -> measured seconds of real steps / the parts' sum (n = 1: plain steps).
    # Parts timed alone, back to back, ran 30-100% faster than inside real steps (whose
    # target and head forwards evict each other's weights, and whose head also runs the
    # accepted pairs); real steps of a few shapes fix the bias per size (calibrate_profile).
    step_scale: dict[int, float] = field(default_factory=dict)
    # What was timed -> the worst relative spread (interquartile range / median) of its
    # repeated, interleaved timings: "target" (forwards per size), "calibration" (real steps).
    spread: dict[str, float] = field(default_factory=dict)
    # Learned from real steps (CostLearner): seconds of a plain step (n = 1) and of a step of
    # n prompt-lookup nodes alone, for lookup_policy.costs_from_profile.
    lookup_s: dict[int, float] = field(default_factory=dict)
    # The most rows (batch x nodes) a step's forward may have and be priced by this profile (0:
    # any): an estimate timed forwards at 1 and 4 rows and its slope past them priced a 60-node
    # forward of the default pair at ~2 plain steps, which took 25 (a first probe); twice the
    # most rows timed, and as the real steps run larger forwards (CostLearner) twice theirs.
    trusted_rows: int = 0
    # The head's acceptance on the requests this profile learned from, by "topk,depth,nodes"
    # -> ACCEPTANCE_FIELDS over those requests' own evidence (AcceptanceStats.own: decayed
    # sums of the drafts such a tree would have accepted, of their squares and of the steps
    # that covered it): each request's auto tree starts from it (AcceptanceStats.seed, as many
    # steps as the requests' spread says it is worth) rather than from nothing. Gathered while
    # the profile learns (CostLearner.gather), fixed with it once final (docs/tree_policy.md §5).
    acceptance: dict[str, list[float]] = field(default_factory=dict)

    def scaled(self, ratio: float) -> CostProfile:
        """This profile with every time (forwards, drafting, verification, lookup steps) times
        ``ratio``, its calibration kept: what a contradicted profile becomes before real steps
        refine it again (BatchDecoder._policy), where the machine's load moved every step."""
        def times(table: dict) -> dict:
            return {k: v * ratio for k, v in table.items()}

        return dataclasses.replace(
            self, target_s=times(self.target_s), draft_base_s=self.draft_base_s * ratio,
            level_s=times(self.level_s), verify_s=times(self.verify_s), measure_s=0.0,
            lookup_s=times(self.lookup_s),
        )  # fmt: skip

    def scale(self, n):
        """The calibration factor at n nodes (1 where there is none): linear between the sizes
        calibrated, the nearest one's beyond them (a learned profile calibrates the sizes its
        steps ran: CostLearner)."""
        if not self.step_scale:
            return 1.0
        sizes = sorted(self.step_scale)
        out = np.interp(n, sizes, [self.step_scale[k] for k in sizes])
        return float(out) if np.ndim(out) == 0 else out

    def target(self, n):
        """Target forward seconds at n nodes: piecewise linear in the measured sizes, made
        non-decreasing (a bigger forward never costs less than a smaller one did)."""
        return extrapolated(running_max(self.target_s), n)

    def plain_step_s(self, batch: int = 1) -> float:
        return self.parts_s(0, 1, 0, batch) * self.scale(1)

    def step_s(self, depth: int, n: int, topk: int, batch: int = 1) -> float:
        """Predicted seconds of a step drafting ``depth`` levels of ``topk`` rows and keeping
        ``n`` nodes; the head's commit of the accepted pairs costs about one level.

        A step over ``batch`` sequences (rheo_engine.runtime.decoder) is priced from the same
        one-sequence measurements: the target forward at batch * n rows (what it runs: one forward
        over all trees), and drafting and verification ``batch`` times (each sequence's pool
        sampler and verification run on their own; the head's level forward over all rows is
        counted ``batch`` times too, an upper bound where its cost is per-operator overhead).
        Monotone: at least any smaller tree of this depth and width, and a plain step."""
        if n == 1:
            return self.plain_step_s(batch)
        return max(self.plain_step_s(batch), float(self.calibrated(depth, topk, batch, n).max()))

    def calibrated(self, depth: int, topk: int, batch: int, n_max: int) -> np.ndarray:
        """[n_max - 1] the parts' sum times the calibration factor at n = 2 .. n_max nodes (as
        measured: not yet monotone)."""
        n = np.arange(2, n_max + 1)
        return self._parts(depth, n, topk, batch) * self.scale(n)

    def parts_s(self, depth: int, n: int, topk: int, batch: int = 1) -> float:
        """step_s before calibration: the sum of the parts as measured alone."""
        return float(self._parts(depth, n, topk, batch))

    def _parts(self, depth, n, topk, batch):
        if np.ndim(n) == 0 and n == 1:
            return self.target(batch) + batch * extrapolated(running_max(self.verify_s), 1)
        drafting = self.draft_base_s + extrapolated(self.level_s, topk) * depth
        verify = extrapolated(running_max(self.verify_s), n)
        return batch * (drafting + verify) + self.target(batch * n)

    def waiting_s(self, rows: int) -> float:
        """The head's pass over ``rows`` pairs that waited for it (one per plain step since it
        last drafted) beyond the one level step_s prices a tree's commit at: a level over that
        many rows less one over the fewest measured (0 up to those). A level's pools are
        counted too: an upper bound."""
        if rows <= 1 or not self.level_s:
            return 0.0
        return max(0.0, extrapolated(self.level_s, rows) - extrapolated(self.level_s, 1))

    def doubts(self) -> list[str]:
        """Why this profile should be measured again rather than kept (empty: none)."""
        out = []
        scales = list(self.step_scale.values())
        if scales and max(scales) > MAX_SCALE_RATIO * min(scales):
            out.append(f"calibration factors {min(scales):.2f}-{max(scales):.2f} disagree "
                       f"(x{max(scales) / min(scales):.1f} > x{MAX_SCALE_RATIO})")  # fmt: skip
        parts = [("a verification of", n, v) for n, v in sorted(self.verify_s.items())]
        parts += [("a draft level over", k, v) for k, v in sorted(self.level_s.items())]
        for name, n, seconds in parts:
            forward = self.target(n)
            if forward > 0 and seconds > MAX_PART_RATIO * forward:
                out.append(f"{name} {n} rows priced at {1e3 * seconds:.3g} ms, over "
                           f"x{MAX_PART_RATIO:g} the target forward's {1e3 * forward:.3g} ms")
        plain, topk = self.plain_step_s(), min(self.level_s, default=1)
        for n, s in sorted(self.step_scale.items()):
            real = s * self.parts_s(1, n, topk)  # at least: the cheapest drafting
            if n > 1 and real < 0.95 * plain:
                out.append(f"real {n}-node steps measured below a plain step "
                           f"({1e3 * real:.1f} < {1e3 * plain:.1f} ms)")  # fmt: skip
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            raw = json.loads(Path(path).read_text())

            def table(name: str) -> dict[int, float]:
                return {int(k): float(v) for k, v in raw[name].items()}

            return cls(
                key=str(raw["key"]),
                target_s=table("target_s"),
                draft_base_s=float(raw["draft_base_s"]),
                level_s=table("level_s"),
                verify_s=table("verify_s"),
                measure_s=float(raw.get("measure_s", 0.0)),
                step_scale=table("step_scale") if "step_scale" in raw else {},
                spread={str(k): float(v) for k, v in raw.get("spread", {}).items()},
                lookup_s=table("lookup_s") if "lookup_s" in raw else {},
                trusted_rows=int(raw.get("trusted_rows", 0)),
                acceptance=_acceptance_table(raw.get("acceptance", {})),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"cost profile {path}: cannot read it ({type(err).__name__}: {err}); pass a file "
                "written by the engine (CostProfile.save / --cost-profile), or delete it to "
                "measure again"
            ) from None


# A cell of CostProfile.acceptance, summed over requests r with own evidence there (s_r, c_r,
# q_r: AcceptanceStats.own): sum s_r, count c_r, squares q_r, between s_r^2 / c_r, count_sq
# c_r^2, requests 1
ACCEPTANCE_FIELDS = ("sum", "count", "squares", "between", "count_sq", "requests")
WITHIN_PRIOR = 2.0  # steps of a binomial's variance in prior_weight's within variance


def cell_key(topk: int, depth: int, nodes: int) -> str:
    """The key of an acceptance cell (CostProfile.acceptance, AcceptanceStats.own)."""
    return f"{topk},{depth},{nodes}"


def parse_cell(key: str) -> tuple[int, int, int]:
    """(topk, depth, nodes) of an acceptance cell's key "topk,depth,nodes"."""
    parts = str(key).split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"acceptance cell {key!r} is not \"topk,depth,nodes\" (three "
                         "integers); delete the profile file to learn it again")
    k, d, n = (int(p) for p in parts)
    return k, d, n


def _acceptance_table(raw: dict) -> dict[str, list[float]]:
    """A profile file's ``acceptance``, checked: each cell "topk,depth,nodes" (ints >= 1, nodes
    >= 2; a depth past nodes - 1 is the tree of nodes - 1 levels, as AcceptanceStats keeps
    it) holds the ACCEPTANCE_FIELDS, finite, count and requests > 0, the sum at most
    count * (nodes - 1), none negative."""
    table = {}
    for cell, values in raw.items():
        k, d, n = parse_cell(cell)
        row = [float(v) for v in values]
        total, count, *_, requests = row
        if not (k >= 1 and d >= 1 and n >= 2 and len(row) == len(ACCEPTANCE_FIELDS)
                and all(0 <= v < math.inf for v in row) and count > 0 and requests > 0
                and total <= count * (n - 1) * (1 + 1e-9)):  # fmt: skip
            raise ValueError(f"acceptance cell {cell!r}: {values!r} is no "
                             f"[{', '.join(ACCEPTANCE_FIELDS)}] of a tree of that size")
        table[cell_key(k, d, n)] = row
    return table


def prior_weight(row: list[float], nodes: int, most: float) -> float:
    """How many of a request's own steps a cell's earlier evidence is worth (empirical Bayes,
    one-way random effects): the within-request variance of a step's accepted count over the
    variance of the requests' true means, at most ``most`` and the steps it holds. Requests
    alike (the between variance no more than the within noise explains): ``most``; one request
    alone says nothing of the spread: one step. The within variance is pooled from the
    requests' repeated steps and WITHIN_PRIOR steps of a binomial's m (1 - m / (nodes - 1))
    (a request seen once says nothing of it: each request's first steps were often its only)."""
    total, count, squares, between, count_sq, requests = row
    if requests < 2:
        return min(1.0, count)
    mean = total / count
    binomial = mean * max(0.0, 1.0 - mean / (nodes - 1))
    within = (max(squares - between, 0.0) + WITHIN_PRIOR * binomial) / (
        max(count - requests, 0.0) + WITHIN_PRIOR)
    spread = between - total * total / count  # sum of c_r (m_r - m)^2
    tau2 = (spread - (requests - 1) * within) / max(count - count_sq / count, 1e-9)
    weight = most if tau2 <= 0 else min(most, within / tau2)
    return min(weight, count)


# --- measured profiles kept between processes (rheo_engine.machine) ------------------------------


def cached_profile(key: str) -> CostProfile | None:
    """The profile measured for ``key`` on this machine by an earlier process, if kept; a file
    that does not read, holds another key or is in doubt (CostProfile.doubts) is measured
    again and overwritten."""
    path = kept_file("profiles", key)
    if path is None or not path.is_file():
        return None
    try:
        profile = CostProfile.load(path)
    except ValueError:
        return None
    return profile if profile.key == key and not profile.doubts() else None


def keep_profile(profile: CostProfile) -> bool:
    """Keep ``profile`` for later processes on this machine (machine.kept_file), unless it is
    in doubt (CostProfile.doubts). Returns whether it was kept."""
    if profile.doubts():
        return False
    write_kept(kept_file("profiles", profile.key), dataclasses.asdict(profile))
    return True


def running_max(table: dict[int, float]) -> dict[int, float]:
    """table made non-decreasing in its key: each value the largest at or below its key."""
    sizes = sorted(table)
    return dict(zip(sizes, np.maximum.accumulate([table[s] for s in sizes]).tolist()))


def extrapolated(table: dict[int, float], n):
    """table at n (a number or an array): piecewise linear between measured points, the last
    slope beyond them."""
    sizes = sorted(table)
    if isinstance(n, (int, float)):  # the policies' per-step calls: no numpy (~20x faster)
        return _extrapolated_at(table, sizes, n)
    values = [table[s] for s in sizes]
    out = np.interp(n, sizes, values)
    if len(sizes) >= 2:
        a, b = sizes[-2], sizes[-1]
        slope = (table[b] - table[a]) / (b - a)
        out = np.where(np.asarray(n) > b, table[b] + slope * (np.asarray(n) - b), out)
    return float(out) if np.ndim(out) == 0 else out


def _extrapolated_at(table: dict[int, float], sizes: list[int], n: float) -> float:
    """extrapolated at one number, np.interp's arithmetic: the first value at or below the
    first size, linear between sizes, the last slope beyond the last."""
    if len(sizes) == 1 or n <= sizes[0]:
        return float(table[sizes[0]])
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        a, b = sizes[-2], sizes[-1]
        return float(table[b] + (table[b] - table[a]) / (b - a) * (n - b))
    a, b = sizes[i - 1], sizes[i]
    if n == b:
        return float(table[b])
    return float(table[a] + (table[b] - table[a]) / (b - a) * (n - a))


def _spread(samples: list[float]) -> float:
    """Interquartile range / median."""
    q1, mid, q3 = np.percentile(samples, (25, 50, 75))
    return float((q3 - q1) / mid) if mid > 0 else 0.0


def _interleaved(jobs: dict, watched: list, min_rounds: int, max_rounds: int,
                 spread_ok: float, bound: float) -> tuple[dict, float]:  # fmt: skip
    """Run every job once per round, in turn (A B C A B C: a load that comes and goes hits
    them all alike), until ``min_rounds`` are done and the watched jobs' worst spread is at
    most ``spread_ok``, or the rounds have taken ``bound`` times the first min_rounds, or
    ``max_rounds``. Each job returns its seconds. Returns the medians and that spread."""
    samples = {name: [] for name in jobs}
    start, first, worst = time.perf_counter(), 0.0, 0.0
    for done in range(1, max_rounds + 1):
        for name, job in jobs.items():
            samples[name].append(job())
        if done < min_rounds:
            continue
        elapsed = time.perf_counter() - start
        first = first or elapsed
        worst = max((_spread(samples[name]) for name in watched), default=0.0)
        if worst <= spread_ok or elapsed >= bound * first:
            break
    return {name: float(np.median(s)) for name, s in samples.items()}, worst


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def topk_choices(bound: TreeConfig) -> tuple[int, ...]:
    """The expansion widths auto tries: the configured topk and narrower ones (2, 4) that the
    pool still fits (topk > leads, topk <= support)."""
    ks = {bound.topk} | {k for k in (2, 4) if k < bound.topk}
    return tuple(sorted(k for k in ks if bound.leads < k <= bound.support))


# Timings are repeated in interleaved rounds: at least MIN_ROUNDS, at most MAX_ROUNDS, until
# their spread is at most SPREAD_OK or they took TIME_BOUND times the first MIN_ROUNDS rounds.
MIN_ROUNDS, MAX_ROUNDS, SPREAD_OK, TIME_BOUND = 3, 9, 0.1, 3.0


def measure_profile(key: str, forward_tree, draft, verify, max_nodes: int, max_depth: int,
                    topks: tuple[int, ...], fixed_rounds: bool = False) -> CostProfile:  # fmt: skip
    """Time the parts of a step: ``draft(depth, n, topk)`` -> DraftTree, ``forward_tree(tree)``
    -> logits, ``verify(logits, draft_tree)``. Nothing is committed, so the request's state is
    untouched. Every part is timed once per round, rounds repeat until the target forwards'
    spread is small (_interleaved); sizes stop at ``max_nodes``. ``fixed_rounds``: exactly
    MIN_ROUNDS, whatever the times say (tensor-parallel ranks each time their own forwards, and
    every rank must run the same ones: their collectives pair up)."""
    start = time.perf_counter()
    sizes = [n for n in PROBE_SIZES if n <= max_nodes]
    if sizes[-1] != max_nodes and max_nodes > 1:
        sizes.append(max_nodes)
    widest = max(topks)
    trees = {n: draft(min(max_depth, max(1, n - 1)), n, widest) for n in sizes}
    logits = {n: forward_tree(trees[n].tree) for n in sizes}  # warm-up, and what verify reads
    jobs = {}
    for n in sizes:
        jobs["target", n] = lambda n=n: _timed(lambda: forward_tree(trees[n].tree))
        jobs["verify", n] = lambda n=n: _timed(lambda: verify(logits[n], trees[n]))
    small = min(max_nodes, 8)
    deep = min(max_depth, small - 1, 3)
    if max_nodes > 1:
        jobs["draft", 1, widest] = lambda: _timed(lambda: draft(1, small, widest))
        for k in topks if deep > 1 else ():
            jobs["draft", deep, k] = lambda k=k: _timed(lambda: draft(deep, small, k))
    watched = [("target", n) for n in sizes]
    most = MIN_ROUNDS if fixed_rounds else MAX_ROUNDS
    times, spread = _interleaved(jobs, watched, MIN_ROUNDS, most, SPREAD_OK, TIME_BOUND)
    draft_base = times.get(("draft", 1, widest), 0.0)
    level_s = {k: 0.0 for k in topks}
    for k in topks if max_nodes > 1 and deep > 1 else ():
        level_s[k] = max(0.0, (times["draft", deep, k] - draft_base) / (deep - 1))
    return CostProfile(
        key, {n: times["target", n] for n in sizes}, draft_base, level_s,
        {n: times["verify", n] for n in sizes}, time.perf_counter() - start,
        spread={"target": spread},
    )  # fmt: skip


# The estimate's second size and its draft's depth (estimate_profile; the decoder's first tree
# step, BatchDecoder._first_plain, has this shape where it fits)
ESTIMATE_NODES, ESTIMATE_DEPTH = 4, 3


def estimate_profile(key: str, forward_tree, draft, verify, max_nodes: int, max_depth: int,
                     topks: tuple[int, ...], plain: tuple[float, float] | None = None,
                     tree: tuple[int, float, float] | None = None) -> CostProfile:  # fmt: skip
    """A first profile in a few forwards, for CostLearner to refine from the real steps
    (docs/tree_policy.md §4): each part timed once, at two sizes: a target forward and a
    verification over 1 node and over ``small`` (ESTIMATE_NODES, or max_nodes when fewer), a
    depth-1 draft and one depth-``deep`` draft per width, after one untimed draft (it runs the
    head over the pairs that wait for it, the prompt's where no tree ran yet, and warms its
    expansion). Larger trees cost what the slope between the two sizes says; nothing is
    calibrated. ``plain``: the target forward's and the verification's seconds of a real plain
    step just taken (the decoder's first step under this profile), which then stand for the
    one-node pair; ``tree``: (nodes, forward, verification) of a real tree step (its second),
    which then stand for the ``small`` pair, ``small`` being its nodes."""
    start = time.perf_counter()
    widest = max(topks)
    small = min(max_nodes, ESTIMATE_NODES) if tree is None else tree[0]
    deep = min(max_depth, small - 1, ESTIMATE_DEPTH)
    sizes = sorted({1, small})
    draft_s: dict[tuple[int, int], float] = {}

    def timed_draft(depth: int, k: int):
        begun = time.perf_counter()
        tree = draft(depth, small, k)
        draft_s[depth, k] = time.perf_counter() - begun
        return tree

    trees = {} if plain is not None else {1: draft(1, 1, widest)}
    if small > 1:
        # Untimed: the head's pass over the prompt's pairs (which the first tree would run) and
        # a first expansion (weights stacked on first use).
        draft(min(2, max(1, deep)), small, widest)
        trees[small] = timed_draft(max(1, deep), widest)
        timed_draft(1, widest)
        for k in topks if deep > 1 else ():
            if k != widest:
                timed_draft(deep, k)
    target_s, verify_s, logits = {}, {}, {}
    if plain is not None:
        target_s[1], verify_s[1] = plain
    if tree is not None:
        target_s[small], verify_s[small] = tree[1:]
    timed = [n for n in sizes if n not in target_s]
    for n in timed:
        begun = time.perf_counter()
        logits[n] = forward_tree(trees[n].tree)
        target_s[n] = time.perf_counter() - begun
    for n in timed:
        verify_s[n] = _timed(lambda n=n: verify(logits[n], trees[n]))
    draft_base = draft_s.get((1, widest), 0.0)
    level_s = {k: 0.0 for k in topks}
    for k in topks if small > 1 and deep > 1 else ():
        level_s[k] = max(0.0, (draft_s[deep, k] - draft_base) / (deep - 1))
    return CostProfile(key, target_s, draft_base, level_s, verify_s,
                       time.perf_counter() - start, trusted_rows=2 * max(sizes))  # fmt: skip


class CostLearner:
    """A profile refined by the real steps that follow it (docs/tree_policy.md §4): the CPU's
    first profile is an estimate (estimate_profile), and each real step says what its target
    forward over its rows took (StepTimes.target_s: exact on a CPU, whose operators run
    synchronously) and what the whole step took. Each figure below is the median of its last
    KEEP samples, and a row count or lookup tree size counts once it has MIN_SAMPLES.

    - Target forwards: at a row count that ran, its median; elsewhere the estimate's curve
      times the measured / estimated ratio of the counts that ran (linear between them, the
      nearest one's beyond), written out at PROBE_SIZES past the largest count that ran (so
      the slope beyond it is the estimate's, not that of two neighbouring counts' noise).
    - Verification (verify_s), per sequence at the node counts that ran: as the forwards.
    - Drafting (draft_base_s, level_s): the estimate's, times the median over the head's tree
      shapes that ran alone (no lookup nodes merged) of measured / estimated; until one ran,
      times the forwards' median measured / estimated (the same core's work under the same
      load). So no part keeps a contradicted profile's scaling (CostProfile.scaled) once real
      steps ran: scaled again by each later contradiction, kept profiles had compounded it.
    - Calibration (CostProfile.step_scale): per tree size that ran (plain steps and the head's
      trees alone), measured / predicted against the refined forwards and drafting.
    - Prompt lookup's steps (CostProfile.lookup_s): a plain step's seconds, and those of each
      lookup tree size that ran alone (lookup_policy.costs_from_profile reads them).
    - A dormant step (the decoder's `ar` step that keeps no features: docs/tree_policy.md §3)
      gives its forward and verification only: as a whole it is cheaper than the plain step
      the profile prices, which the plain steps around the stretches calibrate.

    A refined profile is made at the first two observations, then every EVERY, every
    seen / 4 from the 16th on, every 4 * EVERY from the 64th (a refresh reprices every tree,
    ~1 ms, not to be paid every plain step of a while that learns slowly). Its costs are final
    (``costs_done``: the decoder keeps them for later processes, keep_profile) after STEPS
    steps of which TREES were the head's trees, or after MAX_STEPS steps (where the head's
    trees seldom pay, e.g. at T = 1: the drafting cost stays estimated). The requests that
    learn it also gather their acceptance evidence (``gather``, ``acceptance``: the
    profile's CostProfile.acceptance, where later requests start from); it is final
    (``done``: kept again with it, and then this process's later requests decide as later
    processes do) once REQUESTS requests were gathered or MAX_STEPS steps ran."""

    KEEP, MIN_SAMPLES, EVERY, STEPS, TREES, MAX_STEPS = 5, 2, 4, 32, 4, 256
    KINDS = ("plain", "head", "lookup", "merged", "dormant")
    # The requests whose acceptance evidence a final profile carries, at least (or MAX_STEPS
    # steps); the most steps a cell of it counts (older ones scaled down: a relearned
    # profile's earlier evidence fades as new requests add theirs)
    REQUESTS, ACCEPTANCE_STEPS = 4, 64.0

    def __init__(self, estimate: CostProfile) -> None:
        self.estimate = self.profile = estimate
        self.forwards: dict[int, list[float]] = {}  # rows -> forward seconds
        self.drafts: dict[tuple[int, int], list[float]] = {}  # (depth, topk) -> measured / est.
        self.steps_s: dict[tuple[int, int, int, int], list[float]] = {}  # shape -> step seconds
        self.lookups: dict[int, list[float]] = {}  # nodes -> a lookup (1: plain) step's seconds
        self.verifies: dict[int, list[float]] = {}  # nodes -> a sequence's verification seconds
        self.seen = self.pending = 0
        self.gathered = dict(estimate.acceptance)  # the finished requests' acceptance (gather)
        self.requests = 0  # requests gathered

    @property
    def costs_done(self) -> bool:
        """Whether the costs are final (then no step refines them: only the acceptance of
        REQUESTS requests may still be gathered)."""
        trees = sum(len(s) for s in self.drafts.values())
        return self.seen >= self.MAX_STEPS or (self.seen >= self.STEPS and trees >= self.TREES)

    @property
    def done(self) -> bool:
        """Whether the profile is final: its costs, and the acceptance of REQUESTS requests or
        of MAX_STEPS steps."""
        return self.costs_done and (self.requests >= self.REQUESTS or self.seen >= self.MAX_STEPS)

    def gather(self, evidence: dict[str, list[float]]) -> None:
        """A request's own acceptance evidence (AutoTree.evidence: [sum, count, squares] per
        cell), added to what the profile will carry (acceptance, ACCEPTANCE_FIELDS); a cell
        over ACCEPTANCE_STEPS steps is scaled down to them, every field alike."""
        for cell, (total, count, squares) in evidence.items():
            mine = [total, count, squares, total * total / count, count * count, 1.0]
            row = [a + b for a, b in zip(self.gathered.get(cell, [0.0] * 6), mine)]
            if row[1] > self.ACCEPTANCE_STEPS:
                row = [v * self.ACCEPTANCE_STEPS / row[1] for v in row]
            nodes = parse_cell(cell)[2]
            row[0] = min(row[0], row[1] * (nodes - 1))
            self.gathered[cell] = row
        self.requests += 1

    def acceptance(self) -> dict[str, list[float]]:
        """What the learned profile carries as CostProfile.acceptance (a copy)."""
        return {cell: list(v) for cell, v in self.gathered.items()}

    def observe(self, kind: str, rows: int, forward_s: float, seconds: float,
                shape: tuple[int, int, int, int] = (0, 1, 0, 1), drafting_s: float = 0.0,
                verify_s: float | None = None) -> CostProfile | None:  # fmt: skip
        """A real step of ``kind``: "plain", "head" (the head's tree of ``shape``, (depth,
        nodes, topk, batch), alone), "lookup" (a lookup tree alone), "merged" (the head's
        tree with lookup nodes) or "dormant" (a plain step of a dormant stretch: its forward
        and verification only). Its target forward over ``rows`` rows took ``forward_s``, the
        step ``seconds``, a head tree's drafting ``drafting_s`` (per sequence), its
        verifications ``verify_s`` (the batch's, over rows / batch nodes each). Returns the
        refined profile when one is made."""
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r} is not one of {self.KINDS}")
        if self.costs_done:  # final costs (the acceptance still gathered): counted only
            self.count()
            return None
        self._add(self.forwards, rows, forward_s)
        if verify_s is not None:
            self._add(self.verifies, max(1, rows // shape[3]), verify_s / shape[3])
        if kind == "plain":
            shape = (0, 1, 0, shape[3])
        if kind in ("plain", "head"):
            self._add(self.steps_s, shape, seconds)
        if kind == "lookup" or (kind == "plain" and shape[3] == 1):
            self._add(self.lookups, rows, seconds)
        depth, _, topk, _ = shape
        est = self.estimate
        if kind == "head" and drafting_s > 0:
            priced = est.draft_base_s + depth * extrapolated(est.level_s, topk)
            if priced > 0:
                self._add(self.drafts, (depth, topk), drafting_s / priced)
        self.seen += 1
        self.pending += 1
        every = min(4 * self.EVERY, max(self.EVERY, self.seen // 4))  # 4 steps, later 16
        if self.pending < every and self.seen > 2 and not self.costs_done:
            return None
        self.pending = 0
        self.profile = self._refined()
        return self.profile

    def count(self) -> None:
        """A step once the costs are final: counted (towards MAX_STEPS), nothing refined."""
        self.seen += 1

    def _add(self, table: dict, key, value: float) -> None:
        """The last KEEP values of ``key``."""
        samples = table.setdefault(key, [])
        samples.append(value)
        del samples[:-self.KEEP]

    def _medians(self, table: dict) -> dict:
        """Per key with MIN_SAMPLES, the median of its samples, the lower middle of an even count
        (a load only adds time: of two, the faster; their mean had priced a 3-row forward at a
        slow one's half, 2.1 against 0.9 ms, and the profile kept it)."""
        return {k: statistics.median_low(s) for k, s in table.items()
                if len(s) >= self.MIN_SAMPLES}  # fmt: skip

    def _refined(self) -> CostProfile:
        est = self.estimate
        target_s, moved = _learned_curve(est.target_s, self._medians(self.forwards))
        verify_s, _ = _learned_curve(est.verify_s, self._medians(self.verifies))
        profile = dataclasses.replace(est, target_s=target_s, verify_s=verify_s, step_scale={},
                                      spread={}, lookup_s=self._medians(self.lookups),
                                      acceptance=self.acceptance())  # fmt: skip
        if est.trusted_rows and self.forwards:  # the largest forward that ran, doubled
            profile.trusted_rows = max(est.trusted_rows, 2 * max(self.forwards))
        drafts = self._medians(self.drafts)
        ratio = statistics.median(drafts.values()) if drafts else moved
        profile.draft_base_s = est.draft_base_s * ratio
        profile.level_s = {k: v * ratio for k, v in est.level_s.items()}
        scales: dict[int, list[float]] = {}
        for (depth, n, topk, batch), seconds in self._medians(self.steps_s).items():
            scales.setdefault(n, []).append(seconds / profile.parts_s(depth, n, topk, batch))
        profile.step_scale = {n: statistics.median(v) for n, v in scales.items()}
        return profile


def _learned_curve(curve_s: dict[int, float], measured: dict[int, float],
                   ) -> tuple[dict[int, float], float]:  # fmt: skip
    """An estimate's seconds by size where real steps measured some sizes (CostLearner): their
    medians there; elsewhere the estimate (made non-decreasing) times the measured / estimated
    ratio, linear between the sizes that ran and the nearest one's beyond, written out at
    PROBE_SIZES past the largest (so the slope beyond it is the estimate's, not that of two
    neighbouring sizes' noise). Also the median ratio (1.0 where none ran or none compares)."""
    curve = running_max(curve_s)
    at = [n for n in sorted(measured) if extrapolated(curve, n) > 0]
    if not at:
        return {**curve_s, **measured}, 1.0
    ratios = [measured[n] / extrapolated(curve, n) for n in at]
    beyond = [n for n in PROBE_SIZES if n > at[-1]]
    sizes = sorted({*curve_s, *measured, *beyond})
    scaled = np.interp(sizes, at, ratios).tolist()
    learned = {n: measured.get(n, extrapolated(curve, n) * r)
               for n, r in zip(sizes, scaled, strict=True)}  # fmt: skip
    return learned, statistics.median(ratios)


# Real steps timed to calibrate a profile: (depth, nodes) from a plain step to the largest tree,
# in interleaved rounds (at least CALIBRATION_REPEATS, see _interleaved).
CALIBRATION_SHAPES = ((0, 1), (1, 2), (1, 4), (2, 8), (3, 16), (4, 32), (8, 60))
CALIBRATION_REPEATS = 3


def calibrate_profile(profile: CostProfile, run_step, topk: int, max_nodes: int,
                      max_depth: int, fixed_rounds: bool = False) -> None:  # fmt: skip
    """Time real decode steps of a few shapes (``run_step(depth, n)`` runs one, committed, on a
    scratch copy of the request, and returns its seconds) and set ``profile.step_scale``: per
    size, the median of measured / predicted (the parts' sum), and ``profile.spread
    ["calibration"]``. Sizes stop at ``max_nodes``. ``fixed_rounds``: exactly
    CALIBRATION_REPEATS rounds (tensor parallelism, as in measure_profile)."""
    shapes: list[tuple[int, int]] = []
    for depth, n in CALIBRATION_SHAPES:
        n = min(n, max_nodes)
        depth = min(depth, max_depth, n - 1)
        if all(n != m for _, m in shapes) and (n == 1 or depth >= 1):
            shapes.append((depth, n))
    jobs = {(d, n): lambda d=d, n=n: run_step(d, n) / profile.parts_s(d, n, topk)
            for d, n in shapes}  # fmt: skip
    most = CALIBRATION_REPEATS if fixed_rounds else 3 * CALIBRATION_REPEATS
    ratios, spread = _interleaved(jobs, list(jobs), CALIBRATION_REPEATS, most, SPREAD_OK,
                                  TIME_BOUND)  # fmt: skip
    profile.step_scale = {n: ratios[d, n] for d, n in shapes}
    profile.spread = {**profile.spread, "calibration": spread}


# --- acceptance ----------------------------------------------------------------------------


class AcceptanceStats:
    """Expected accepted drafts of every (depth D, size N) tree, replayed from past steps.

    ``sums[D - 1, j]`` / ``counts[D - 1, j]`` are decayed sums of the accepted count a tree of
    depth D and size SIZES[j] would have had, over the past steps that cover that tree. Only a
    step that covers a cell moves it (a decayed window of that cell's last ~10 observations):
    plain steps and other widths bring no evidence, so they neither fade it nor let a prior
    come back (docs/tree_policy.md §5).
    """

    SHRINK = 1.0  # steps of pseudo-evidence that accepted nothing, in every cell (§5)
    # The most steps of the earlier requests' evidence (CostProfile.acceptance) a request starts
    # from, per cell (as many as prior_weight finds it worth; decay 0.9 fades it)
    PRIOR_STEPS = 8.0

    def __init__(self, max_depth: int, sizes: tuple[int, ...], decay: float = 0.9) -> None:
        self.max_depth, self.sizes, self.decay = max_depth, np.array(sizes), decay
        self.sums = np.zeros((max_depth, len(sizes)))
        self.counts = np.zeros((max_depth, len(sizes)))
        # What of sums and counts is the earlier requests' (seed), decayed as they are: the
        # request's own evidence is the rest (own)
        self.seed_sums = np.zeros((max_depth, len(sizes)))
        self.seed_counts = np.zeros((max_depth, len(sizes)))
        self.squares = np.zeros((max_depth, len(sizes)))  # own steps' accepted counts squared
        # SHRINK steps of pseudo-evidence per cell, less the seed's share: a mean over the
        # earlier requests' PRIOR_STEPS steps or more is no winner of one request's window
        self.shrink = np.full((max_depth, len(sizes)), self.SHRINK)
        self.optimistic_prior = _optimistic_prior(max_depth, tuple(sizes))
        self.prior_weight = 1.0  # of the optimistic prior, in steps
        # The seed as it came (restart goes back to it) and the request's own evidence of the
        # windows before its restarts (own gives it back with the current window's)
        self.seed_at_start = (self.seed_sums.copy(), self.seed_counts.copy())
        self.seed_expected = np.zeros((max_depth, len(sizes)))
        self.past = np.zeros((3, max_depth, len(sizes)))  # sums, counts, squares

    def seed(self, acceptance: dict[str, list[float]], topk: int) -> None:
        """Start from the earlier requests' evidence of this width (CostProfile.acceptance):
        each cell they covered holds their mean accepted count, as many steps as prior_weight
        finds it worth (at most PRIOR_STEPS)."""
        column = {n: j for j, n in enumerate(self.sizes.tolist())}
        for cell, row in acceptance.items():
            k, d, n = parse_cell(cell)
            j = column.get(n)
            if k != topk or j is None or d > self.max_depth:
                continue
            total, count = row[0], row[1]
            weight = prior_weight(row, n, self.PRIOR_STEPS)
            self.seed_sums[d - 1, j] = self.sums[d - 1, j] = total / count * weight
            self.seed_counts[d - 1, j] = self.counts[d - 1, j] = weight
            self.shrink[d - 1, j] = self.SHRINK * (1.0 - weight / self.PRIOR_STEPS)
        self.seed_at_start = (self.seed_sums.copy(), self.seed_counts.copy())
        self.seed_expected = self.expected()  # what a restart's search reads

    def restart(self) -> None:
        """Back to the seed as it came: the request's own evidence so far no longer counts in
        its choices (own still gives it back to the profile), the seed weighs as at the start
        (AutoTree.RESTART_STEPS, docs/tree_policy.md §5)."""
        self.past += np.stack([self.sums - self.seed_sums, self.counts - self.seed_counts,
                               self.squares])  # fmt: skip
        self.seed_sums, self.seed_counts = (a.copy() for a in self.seed_at_start)
        self.sums, self.counts = self.seed_sums.copy(), self.seed_counts.copy()
        self.squares = np.zeros_like(self.squares)

    def own(self, topk: int) -> dict[str, list[float]]:
        """This request's own evidence (the seed taken out) of the cells its steps covered: by
        "topk,depth,nodes", [sum, count, squares] (CostLearner.gather)."""
        past_sums, past_counts, past_squares = self.past
        sums = self.sums - self.seed_sums + past_sums
        counts = self.counts - self.seed_counts + past_counts
        squares = self.squares + past_squares
        out = {}
        for d, j in zip(*np.nonzero(counts > 1e-9)):
            out[cell_key(topk, d + 1, int(self.sizes[j]))] = [
                max(0.0, float(sums[d, j])), float(counts[d, j]), float(squares[d, j])]
        return out

    def add(self, depths: np.ndarray, accepted: np.ndarray, grown: int) -> None:
        """A step's nodes 1..N-1 in rank order: their depths and whether each was accepted."""
        for d in range(1, min(grown, self.max_depth) + 1):
            keep = accepted[depths <= d]
            covered = self.sizes - 1 <= len(keep)
            if not covered.any():
                continue
            cum = np.concatenate(([0.0], np.cumsum(keep)))
            need = np.minimum(self.sizes - 1, len(keep))
            self.sums[d - 1] = np.where(covered, self.decay * self.sums[d - 1] + cum[need],
                                        self.sums[d - 1])  # fmt: skip
            self.counts[d - 1] = np.where(covered, self.decay * self.counts[d - 1] + 1.0,
                                          self.counts[d - 1])  # fmt: skip
            self.squares[d - 1] = np.where(covered, self.decay * self.squares[d - 1]
                                           + cum[need] ** 2, self.squares[d - 1])  # fmt: skip
            fade = np.where(covered, self.decay, 1.0)
            self.seed_sums[d - 1] *= fade
            self.seed_counts[d - 1] *= fade

    def expected(self, optimistic: bool = False) -> np.ndarray:
        """[max_depth, len(sizes)] expected accepted drafts, nondecreasing in D and N.

        Evidence only, each cell's mean shrunk by SHRINK steps that accepted nothing: a tree no
        step covered is credited with what the biggest trees below it accepted, no more (all
        zeros before any evidence: only a probe drafts then). Probes (``optimistic``) read the
        evidence shrunk towards an optimistic prior instead, which alone rates the trees no step
        covered, capped by the covered trees at least as deep and as big (they hold its
        best-ranked nodes)."""
        seen = self.counts > 0
        if not optimistic:
            est = np.where(seen, self.sums / np.maximum(self.counts + self.shrink, 1e-12), 0.0)
        else:
            w = self.prior_weight
            est = (w * self.optimistic_prior + self.sums) / (w + self.counts)
            bounded = np.where(seen, est, np.inf)
            cap = np.minimum.accumulate(np.minimum.accumulate(bounded[::-1, ::-1], 0), 1)
            est = np.where(seen, est, np.minimum(est, cap[::-1, ::-1]))
        return np.maximum.accumulate(np.maximum.accumulate(est, axis=0), axis=1)


@functools.lru_cache(maxsize=64)
def _optimistic_prior(max_depth: int, sizes: tuple[int, ...]) -> np.ndarray:
    """_prior(D, N, 0.6) of every (depth, size), read-only: computed once per shape, not per
    request (360 cells of Python took ~0.5 ms of each request's first step)."""
    prior = np.array([[_prior(d, n, 0.6) for n in sizes] for d in range(1, max_depth + 1)])
    prior.setflags(write=False)
    return prior


def _prior(depth: int, n: int, per_node: float = 0.3) -> float:
    """An optimistic prior: n - 1 nodes spread evenly over the depths, each accepted with
    probability ``per_node`` given its parent was; a level extends the path if any of its
    nodes does."""
    per_level = (n - 1) / depth
    reach, total = 1.0, 0.0
    for _ in range(depth):
        reach *= 1.0 - (1.0 - per_node) ** per_level
        total += reach
    return total


@functools.lru_cache(maxsize=64)
def _feasible(topks: tuple[int, ...], max_depth: int, sizes: tuple[int, ...]) -> np.ndarray:
    """[topks, depth, sizes] whether a tree of that width, depth and size can be drafted
    (read-only; once per shape)."""
    depths = range(1, max_depth + 1)
    feasible = np.array(
        [[[d <= n - 1 and n <= max_tree_size(k, d) for n in sizes] for d in depths]
         for k in topks]
    )  # fmt: skip
    feasible.setflags(write=False)
    return feasible


_PRICED: dict[tuple, tuple[CostProfile, np.ndarray, float]] = {}


def _priced(profile: CostProfile, topks: tuple[int, ...], max_depth: int,
            sizes: tuple[int, ...], batch: int) -> tuple[np.ndarray, float]:  # fmt: skip
    """step_s of every (topk, depth, size) [topks, depth, sizes] and the plain step, for
    ``batch`` sequences: computed once per profile and shape bound, read by every request's
    policy after that. Monotone as step_s is: the running maximum over n of the calibrated
    parts, and at least a plain step."""
    key = (id(profile), topks, max_depth, sizes, batch)
    hit = _PRICED.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1], hit[2]
    plain = profile.plain_step_s(batch)
    at = np.maximum(np.array(sizes) - 2, 0)  # index of n in calibrated(..., n_max)
    n = np.arange(2, max(2, max(sizes)) + 1)
    # calibrated(d, k, batch, n_max) for every (k, d), its depth-free parts computed once
    # (the same operations in the same order: the same bits).
    verify = extrapolated(running_max(profile.verify_s), n)
    target, scale = profile.target(batch * n), profile.scale(n)
    # Every depth of a width at once ([depth, n]): the same operations per element, so the
    # same bits as one depth at a time (a refresh repriced 24 rows one numpy call each)
    depths = np.arange(1, max_depth + 1)
    grid = np.array(
        [np.maximum.accumulate(
            (batch * ((profile.draft_base_s + extrapolated(profile.level_s, k) * depths)[:, None]
                      + verify) + target) * scale, axis=1)[:, at]
         for k in topks]
    )  # fmt: skip
    grid = np.maximum(grid, plain)
    grid[..., np.array(sizes) == 1] = plain
    if len(_PRICED) > 64:  # profiles come and go (tests, files): keep the table small
        _PRICED.clear()
    _PRICED[key] = (profile, grid, plain)
    return grid, plain


@dataclass
class Calibration:
    """What chosen trees accepted against what their evidence promised them, as decayed sums
    (DECAY: about the last 20 trees; ``prior`` drafts of pseudo-evidence on both sides, so 1 at
    the start: PRIOR unless the owner says). ``factor``, at most 1, scales the evidence of the
    next choices: a policy picks the tree whose evidence ran luckiest. On the widened 1B pair at
    T = 1 (Zen 4 EPYC, 2 threads) head trees chosen for 1.9 accepted drafts accepted 0.6, and
    4-node lookup trees chosen for 1.63 tokens a step yielded 1.21 (docs/tree_policy.md §5,
    docs/lookup.md §6). The auto tree (AutoTree.CALIBRATION_PRIOR) and each sequence's prompt
    lookup keep one each, per request."""

    DECAY: ClassVar[float] = 0.95
    PRIOR: ClassVar[float] = 2.0
    accepted: float = 0.0
    promised: float = 0.0
    pending: float | None = None  # a promise awaiting its step's outcome (settle)
    prior: float = PRIOR

    @property
    def factor(self) -> float:
        return min(1.0, (self.accepted + self.prior) / (self.promised + self.prior))

    def add(self, accepted: float, promised: float) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.promised = self.DECAY * self.promised + promised

    def settle(self, accepted: float) -> None:
        """The step of the pending promise accepted ``accepted`` drafts (nothing pending: no
        change)."""
        if self.pending is not None:
            self.add(accepted, self.pending)
            self.pending = None


class AutoTree:
    """The cost model's choice of tree per step (see the module docstring).

    Shapes: topk in topk_choices(bound) (each with its own acceptance replay: the candidates
    differ), depth <= bound.depth, size in SIZES <= bound.total_tokens. A tree is drafted when
    the evidence says it beats a plain step by MARGIN; otherwise the step is plain. A probe
    drafts the best tree under an optimistic prior instead: the first at step PROBE_FIRST, then
    at most every ``probe_gap`` steps (PROBE_GAP, doubled after each probe that did not pay for
    itself, up to PROBE_GAP_MAX, back to PROBE_GAP after one that did), and only while what
    probes lost against plain steps (a probe's measured time, the head's pass over the pairs
    waiting for it included, less a plain step per token it emitted; its predicted cost until
    it is observed) stays within PROBE_SHARE of all predicted time, plus one probe's worth
    (docs/tree_policy.md §6).

    ``check=True`` (a profile kept by an earlier process): the first real steps' measured
    seconds are compared with the predictions; when their median ratio is off by more than
    CONTRADICTION either way, ``contradicted`` is set and the decoder measures again
    (use_profile).
    """

    # A tree must beat a plain step by MARGIN to be chosen without probing. In real decoding
    # (default pair, 2-core EPYC, T = 1, measured profile) trees of 8-56 nodes took 10-50%
    # longer than predicted, and accepted less than expected, so a 5% margin let trees run at
    # 0.6-0.9x plain decoding: the margin covers what the model misses (BENCHMARKS.md, "The
    # auto tree on prompts it never saw"). It was 1.3 until the costs were learned from real
    # steps, the evidence shrunk and calibrated, and requests started from the earlier ones'
    # acceptance (§5): then 1.3 kept the widened 1B pair at T = 1 off the one tree that pays
    # there (1.23x predicted, 1.25-1.31x when fixed), 1.04x `ar` against 1.11x at 1.15, the
    # default pair and SmolLM2 no slower (BENCHMARKS.md, "Issue 40, twentieth session").
    # A probe costs at most PROBE_COST plain steps.
    # PROBE_SHARE was 0.02: on the default pair at T = 1 (2-core EPYC, AVX2) probes, whose
    # real steps also ran the head over the pairs that waited, lost 2% of the time of requests
    # whose trees never paid (BENCHMARKS.md, "A plain step and a probe at T = 1").
    PROBE_FIRST, PROBE_GAP, PROBE_SHARE, PROBE_COST, MARGIN = 4, 16, 0.01, 2.0, 1.15
    # A probe that did not pay for itself (tokens per second below a plain step's, as
    # predicted) doubles the gap to the next, up to PROBE_GAP_MAX: on the default pair at
    # T = 1 (2-core EPYC, AVX2) requests of 128 tokens ran ~4 probes each, every one a loss
    # (BENCHMARKS.md, "Issue 39: probes and lookup evidence at T = 1").
    PROBE_GAP_MAX = 256
    # After a search found that no tree beats a plain step, later steps do not search again
    # while nothing that could change the answer moved (plain_known): no new evidence, no new
    # prices, and the room, the tokens wanted and the head's backlog no more favourable than at
    # that search. A search (~0.1 ms) was ~3% of a plain step of the default pair, and a
    # search every 8 steps (and a probe's every 4 while none was affordable) ~2%.
    CHECK_STEPS, CONTRADICTION = 8, 1.5  # steps 2..9 of a kept profile; measured / predicted
    # The calibration's pseudo-evidence, in drafts a side (§5): a step's accepted count is as
    # noisy as its mean, so one step may move the factor only a little. At 2 (lookup's), one
    # step at T = 1 that accepted nothing of 1.9 promised took the factor to 0.51 (widened 1B
    # pair, Zen 4 EPYC), and as only drafted trees move it, the request stayed plain to its end
    # (33-83% plain steps where the best fixed tree read 1.29x `ar`): 1.07x `ar` with it,
    # 1.13x at 16 with probes left out (_tree), 1.15x with no calibration (medians of fresh
    # processes: BENCHMARKS.md, "Issue 40, twenty-first session").
    CALIBRATION_PRIOR = 16.0
    # After RESTART_STEPS plain answers in a row, a seeded request's acceptance evidence and
    # calibration start again from the seed, as a new request's would (§5): nothing else ends
    # a plain stretch before a probe, and on the widened 1B pair at T = 1 requests whose own
    # evidence dipped below the margin stayed plain to their end where the seed's trees pay.
    # Long enough for a dormant stretch (decoder: DORMANT_LEAD + DORMANT_MIN) to run before it.
    RESTART_STEPS = 16

    def __init__(self, bound: TreeConfig, profile: CostProfile, check: bool = False,
                 prior: dict[str, list[float]] | None = None) -> None:  # fmt: skip
        self.bound = bound
        sizes = tuple(n for n in SIZES if n <= bound.total_tokens) or (bound.total_tokens,)
        if bound.total_tokens not in sizes:
            sizes = tuple(sorted({*sizes, bound.total_tokens}))
        self.sizes, self.topks = sizes, topk_choices(bound)
        self.stats = {k: AcceptanceStats(bound.depth, sizes) for k in self.topks}
        # Each width starts from the earlier requests' evidence: the profile's (final), or
        # ``prior``, what a learning profile gathered so far (CostLearner.acceptance)
        for k, stats in self.stats.items():
            stats.seed(profile.acceptance if prior is None else prior, k)
        self.feasible = _feasible(self.topks, bound.depth, sizes)
        self.use_profile(profile)
        self.predicted_s = 0.0  # the chosen tree's predicted step time
        # (room, wanted, waiting_s) of the last search that found no tree paying, or None: while
        # room and wanted are no larger and waiting_s no smaller, every tree's rate is no
        # higher (_best), so the answer holds until observe / set_batch clear it
        self.plain_known: tuple[int, int, float] | None = None
        self.steps, self.since_probe, self.probes = 0, 0, 0
        self.plain_run = 0  # plain answers since the last tree or restart (RESTART_STEPS)
        # whether a restart would change anything: the request was seeded, a drafted step
        # moved its evidence or calibration since the seed came or the last restart, and the
        # last search that found no tree paying found one under the seed alone
        self.seeded = any(bool(st.seed_counts.any()) for st in self.stats.values())
        self.moved = False
        self.total_s = 0.0  # predicted seconds of every step chosen
        self.probe_loss_s = 0.0  # predicted seconds probes lost against plain steps
        self.probe_step, self.probe_risk = -1, 0.0  # the last probe and what it may still lose
        self.probe_gap = self.PROBE_GAP  # steps from a probe to the next (doubles on a loss)
        # a profile the request brought: probes are charged their price, not their time
        self.pinned = False
        self.probe_cost, self.probe_tokens = 0.0, []  # the last probe's price, tokens per sequence
        self.checks: list[float] | None = [] if check else None  # measured / predicted
        self.contradicted = False
        self.measured_ratio = 1.0  # the check's median measured / predicted seconds
        self.waiting_s = 0.0  # this step's price of the pairs waiting for the head
        self.promised: dict[TreeConfig, float] = {}  # a chosen tree's drafts, by the evidence
        # of the trees chosen by their evidence (a batch observes each per row)
        self.calibration = Calibration(prior=self.CALIBRATION_PRIOR)
        self.learns = False  # repriced as its profile learns from real steps (CostLearner)

    def evidence(self) -> dict[str, list[float]]:
        """This request's own acceptance evidence, every width, as CostProfile.acceptance
        holds it (CostLearner.gather)."""
        out: dict[str, list[float]] = {}
        for k, stats in self.stats.items():
            out.update(stats.own(k))
        return out

    def reprice(self, profile: CostProfile) -> None:
        """Price trees with ``profile``, the same costs refined by real steps (CostLearner):
        evidence, batch and probes kept."""
        batch, self.profile, self.batch = self.batch, profile, 0
        self.set_batch(batch)

    def use_profile(self, profile: CostProfile) -> None:
        """Price trees with ``profile`` (a fresh one after a contradiction); evidence is kept and
        the profile is not checked again."""
        self.profile, self.batch = profile, 0
        self.checks, self.contradicted = None, False
        self.set_batch(1)

    def set_batch(self, batch: int) -> None:
        """Price every tree for steps over ``batch`` sequences (CostProfile.step_s): the batch
        scheduler calls it when its batch grows or shrinks; acceptance evidence is kept."""
        if batch == self.batch:
            return
        self.plain_known = None
        self.batch = batch
        self.step_s, self.plain_s = _priced(self.profile, self.topks, self.bound.depth,
                                            self.sizes, batch)  # fmt: skip
        # The cheapest tree a probe may draft: when it and the backlog exceed _probe_limit,
        # no probe is affordable and _best(optimistic) need not run.
        # The trees this profile prices: feasible, and within its trusted rows (0: any)
        trusted = self.profile.trusted_rows or np.inf
        self.usable = self.feasible & (np.array(self.sizes)[None, None, :] * batch <= trusted)
        probes = self.step_s[self.usable & (self.step_s <= self.PROBE_COST * self.plain_s)]
        self.cheapest_probe_s = float(probes.min()) if probes.size else float("inf")

    @property
    def probe_share(self) -> float:
        """What probes lost against plain steps / all predicted time so far."""
        return self.probe_loss_s / self.total_s if self.total_s > 0 else 0.0

    def _best(self, room: int, wanted: int, optimistic: bool,
              seed: bool = False) -> tuple[float, int, int, int]:  # fmt: skip
        """(rate, topk index, depth index, size index) of the best feasible tree; a probe
        (optimistic) only among trees predicted to cost at most PROBE_COST plain steps; ``seed``:
        as a restart would rate them (the seed alone, the calibration at its prior)."""
        if seed:
            est = np.stack([st.seed_expected for st in self.stats.values()])
        else:
            est = np.stack([st.expected(optimistic) for st in self.stats.values()])
        if not optimistic and not seed:
            est = est * self.calibration.factor
        emitted = np.minimum(1.0 + est, wanted)
        depths = np.arange(1, self.bound.depth + 1)[None, :, None]
        sizes = np.array(self.sizes)[None, None, :]
        ok = self.usable & (sizes <= room) & (depths <= wanted - 1)
        if optimistic:  # a tree of at most PROBE_COST plain steps that the budget affords
            # with the head's pass over the pairs waiting (which the probe runs), rated without
            # them (they cost every tree the same)
            ok &= self.step_s <= self.PROBE_COST * self.plain_s
            ok &= self.step_s + self.waiting_s <= self._probe_limit()
            rate = np.where(ok, emitted / self.step_s, -1.0)
        else:
            rate = np.where(ok, emitted / (self.step_s + self.waiting_s), -1.0)
        i, d, j = np.unravel_index(int(np.argmax(rate)), rate.shape)
        return float(rate[i, d, j]), int(i), int(d), int(j)

    def choose(self, room: int, wanted: int, waiting: int = 0) -> TreeConfig:
        """The step's tree (plain: TreeConfig("ar")). ``waiting``: the most pairs any sequence
        of the batch has waiting for the head (plain steps since it last drafted), which a tree
        step runs first; a batch's pass over them is padded to the longest."""
        self.waiting_s = self.profile.waiting_s(waiting * self.batch)
        self._settle_probe()
        if self._restart_due():
            self._restart()
        self.steps += 1
        self.since_probe += 1
        cfg = self._choose(room, wanted)
        self.total_s += self.predicted_s
        self.plain_run = self.plain_run + 1 if cfg.method == "ar" else 0
        return cfg

    def rest(self, room: int, wanted: int, waiting: int, batch: int) -> bool:
        """choose(room, wanted, waiting) for a batch of ``batch`` where it would answer plain
        without searching or probing: the last search found no tree paying and nothing that
        could change that moved (plain_known: the room and the tokens wanted no larger, the
        head's backlog no cheaper), no probe that the budget affords is due at this step (one
        it cannot afford is skipped as _choose skips it: the gap counted from here), none waits
        to be settled. A kept profile's check (observe) reads the same predicted plain time
        after either. Returns True with choose's state after a plain answer, or False having
        changed nothing (then choose). The decoder asks it before it plans a step: a plain
        step's plan, made cheap (the decoder never asks a contradicted policy)."""
        known = self.plain_known
        if known is None or batch != self.batch or self.probe_tokens:
            return False
        waiting_s = self.profile.waiting_s(waiting * batch)
        if room > known[0] or wanted > known[1] or waiting_s < known[2] or self._restart_due():
            return False
        due = self._due(wanted)
        if due and self.cheapest_probe_s + waiting_s <= self._probe_limit():
            return False  # a probe may run: choose's search decides
        self.waiting_s = waiting_s
        self._rested(due)
        return True

    def quiet_steps(self, wanted: int) -> int:
        """Right after a rest that answered plain: how many of the next steps rest surely
        answers plain again while the batch stays, the room and the tokens wanted (``wanted``
        now) do not grow and the head's backlog does not move (the decoder's dormant stretch
        queues no pair): the steps before the first where a probe is due and affordable
        (rest's own test, one step early at the boundary; 2**30 where none ever is) or where a
        seeded request's evidence restarts (RESTART_STEPS: its step searches); 0 while a
        probe waits to be settled or a kept profile is checked (observe must see its steps as
        they are: a dormant step is cheaper than the plain step its profile prices)."""
        if self.checks is not None or self.probe_tokens or self.plain_known is None:
            return 0
        due = self.seeded and self.moved  # a restart would change something
        restart = max(0, self.RESTART_STEPS - self.plain_run) if due else 1 << 30
        if wanted < 2 or self.bound.method == "ar" or not math.isfinite(self.cheapest_probe_s):
            return restart
        # Step j = 1, 2, ... from the next: due at first, first + gap, ... (a due step that no
        # probe runs at starts the gap again), affordable once the budget that grows by
        # PROBE_SHARE of each plain step covers the cheapest probe and the backlog (_probe_limit)
        first, gap, share = max(1, self._gap - self.since_probe), self._gap, self.PROBE_SHARE
        need = ((self.cheapest_probe_s + self.waiting_s) * (1.0 - share) + self.probe_loss_s
                - self.PROBE_COST * self.plain_s - share * self.total_s) / (share * self.plain_s)
        afford = max(1, math.ceil(need))
        if afford <= first:
            return min(first - 1, restart)
        return min(first + gap * -(-(afford - first) // gap) - 1, restart)

    def rested(self, wanted: int) -> None:
        """One of the steps quiet_steps promised: rest's state after its plain answer (the gap
        started again at a due step that no probe can afford)."""
        self._rested(self._due(wanted))

    def _due(self, wanted: int) -> bool:
        """Whether a probe is due at this step (_choose answers plain before its probe when
        fewer than 2 tokens are wanted)."""
        return wanted >= 2 and self.bound.method != "ar" and self.since_probe + 1 >= self._gap

    def _rested(self, due: bool) -> None:
        """A plain answer given without a search (rest, rested): the step counted, the gap to
        the next probe started again at a due step."""
        self.steps += 1
        self.since_probe = 0 if due else self.since_probe + 1
        self.predicted_s = self.plain_s
        self.total_s += self.plain_s
        self.plain_run += 1

    def _restart_due(self) -> bool:
        return self.plain_run >= self.RESTART_STEPS and self.seeded and self.moved

    def _restart(self) -> None:
        """RESTART_STEPS plain answers in a row: every width's evidence back to its seed as it
        came, the calibration to its prior, a search at this step (§5)."""
        for stats in self.stats.values():
            stats.restart()
        self.calibration.accepted = self.calibration.promised = 0.0
        self.plain_known = None
        self.plain_run, self.moved = 0, False

    def _choose(self, room: int, wanted: int) -> TreeConfig:
        plain_s = self.plain_s
        self.predicted_s = plain_s
        if wanted < 2 or self.bound.method == "ar":
            return PLAIN
        known = self.plain_known
        if known is not None and room <= known[0] and wanted <= known[1] and \
                self.waiting_s >= known[2]:  # fmt: skip
            rate, i, d, j = -1.0, 0, 0, 0
        else:
            rate, i, d, j = self._best(room, wanted, optimistic=False)
            paid = rate > self.MARGIN / plain_s
            self.plain_known = None if paid else (room, wanted, self.waiting_s)
            if not paid and self.seeded and self.moved:  # would a restart find a tree paying?
                # (plain steps only shrink the room and the tokens wanted: if not now, not then)
                self.moved = self._best(room, wanted, False, seed=True)[0] > self.MARGIN / plain_s
        if self.since_probe >= self._gap:
            self.since_probe = 0
            affordable = self.cheapest_probe_s + self.waiting_s <= self._probe_limit()
            probe = self._best(room, wanted, optimistic=True) if affordable else (-1.0, 0, 0, 0)
            if probe[0] > 0:  # one the budget affords, the pairs waiting included (_best)
                rate, i, d, j = probe
                cost = float(self.step_s[i, d, j]) + self.waiting_s
                self.probes += 1
                self.probe_step, self.probe_cost, self.probe_tokens = self.steps, cost, []
                self.probe_risk = cost - plain_s
                self.probe_loss_s += self.probe_risk  # refunded per token it emits (observe)
                return self._tree(i, d, j, promise=False)
        if rate > self.MARGIN / plain_s:
            return self._tree(i, d, j)
        return PLAIN

    @property
    def _gap(self) -> int:
        """Steps from the last probe (or the start) to the next: PROBE_FIRST before any."""
        return self.probe_gap if self.probes else self.PROBE_FIRST

    def _probe_limit(self) -> float:
        """The most a probe may cost (its tree and the head's pass over the pairs waiting)
        and keep what probes lose within budget: probe_loss_s + cost - plain <= PROBE_SHARE *
        (total_s + cost) + (PROBE_COST - 1) * plain. A head whose trees never pay runs that
        pass for nothing, so it is the probe's to pay."""
        room = self.PROBE_SHARE * self.total_s + self.PROBE_COST * self.plain_s
        return (room - self.probe_loss_s) / (1.0 - self.PROBE_SHARE)

    def _settle_probe(self) -> None:
        """After a probe's step (observed once per sequence of its batch): the gap to the next
        probe doubles when it did not pay for itself (its tokens per sequence fewer than the
        plain steps its predicted price would have bought), else it is PROBE_GAP again."""
        if not self.probe_tokens:
            return
        tokens = sum(self.probe_tokens) / len(self.probe_tokens)
        paid = tokens * self.plain_s >= self.probe_cost
        self.probe_gap = self.PROBE_GAP if paid else min(2 * self.probe_gap, self.PROBE_GAP_MAX)
        self.probe_tokens = []

    def _tree(self, i: int, d: int, j: int, promise: bool = True) -> TreeConfig:
        """The tree of width topks[i], depth d + 1 and size sizes[j]; ``promise``: what its
        evidence promises it is recorded for the calibration (not a probe's: the optimistic
        prior chose it, not its evidence's luck, which the calibration corrects)."""
        self.predicted_s = float(self.step_s[i, d, j]) + self.waiting_s
        cfg = dataclasses.replace(
            self.bound, topk=self.topks[i], depth=d + 1, total_tokens=self.sizes[j]
        )
        stats = self.stats[self.topks[i]]  # what the evidence alone promises this tree
        if promise and stats.counts[d, j] > 0:
            self.promised[cfg] = float(stats.expected()[d, j])
        else:
            self.promised.pop(cfg, None)
        return cfg

    def observe(self, cfg, outcome, seconds) -> None:
        self._check(seconds)
        if tree_shape(cfg) == (0, 1):
            return  # a plain step says nothing about acceptance
        self.plain_known = None  # new evidence: search at the next step
        self.moved = True
        # Host lists from the step's one read: the policy never reads the device.
        depths = np.array(outcome.depth[0][1:])
        accepted = np.zeros(len(depths))
        n = outcome.accept_len[0]
        path = np.array(outcome.accept_path[0][1:n], dtype=np.int64)  # nodes past the root
        accepted[path - 1] = 1.0
        if self.probe_step == self.steps:  # each token the probe emitted saves a plain step
            if not self.probe_tokens and not self.pinned:  # its batch's first sequence: the
                # step's measured time replaces its price (probes' first steps ran ~30% over
                # it: the head's pass over the waiting pairs, a level's cold weights), so the
                # budget holds what probes really lost; under a profile the request pinned the
                # price stays, so its trees follow from the profile alone (they reproduce)
                risk = max(0.0, self.probe_risk + seconds - self.probe_cost)
                self.probe_loss_s += risk - self.probe_risk
                self.probe_risk, self.probe_cost = risk, seconds
            self.probe_tokens.append(n)
            refund = min(self.probe_risk, (n - 1) * self.plain_s / self.batch)
            self.probe_risk -= refund
            self.probe_loss_s -= refund
        promised = self.promised.get(cfg)
        if promised is not None:
            self.calibration.add(n - 1, promised)
        if cfg.topk in self.stats:
            self.stats[cfg.topk].add(depths, accepted, cfg.depth)

    def _check(self, seconds: float) -> None:
        """A kept profile's first steps (the very first is left out: warm-up) against their
        predictions; a batch calls observe once per sequence, counted once."""
        checks = self.checks
        if checks is None or self.steps < 2 or len(checks) >= self.steps - 1:
            return
        checks.append(seconds / self.predicted_s if self.predicted_s > 0 else 1.0)
        if len(checks) == self.CHECK_STEPS:
            ratio = statistics.median(checks)  # (np.median imports numpy.ma at first use: 75 ms)
            self.contradicted = not 1 / self.CONTRADICTION <= ratio <= self.CONTRADICTION
            self.measured_ratio = ratio
            self.checks = None


def profile_key(target_cfg, head_cfg, device: torch.device, dtype: torch.dtype, pool: str,
                topk: int, tensor_parallel: int = 1, weights: str = "",
                head_weights: str = "") -> str:  # fmt: skip
    """What a profile was measured for; a loaded profile must match the running engine's.
    ``weights`` is the target's LlamaModel.quantized_kinds() ("q4_1+q8_0", "" for float): a
    quantized target's steps cost another curve than the same file dequantized; likewise
    ``head_weights`` (Eagle3Head.quantized_kinds()) for a draft level."""
    t, h = target_cfg, head_cfg
    shapes = f"target {t.num_hidden_layers}x{t.hidden_size}/{t.intermediate_size} V{t.vocab_size}"
    if h is not None:
        shapes += f", head {h.hidden_size} Vd{h.draft_vocab_size}"
        shapes += f" {head_weights}" if head_weights else ""
    parallel = f", tensor parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    held = f", weights {weights}" if weights else ""
    return (
        f"{shapes}, {device.type}, {str(dtype).replace('torch.', '')}, "
        f"{torch.get_num_threads()} threads, {pool} pool, topk {topk}{parallel}{held}"
    )


def break_even_table(profile: CostProfile, shapes=((1, 2, 2), (2, 4, 4), (3, 8, 4), (4, 16, 4),
                                                   (3, 8, 10), (8, 60, 10))) -> str:  # fmt: skip
    """Markdown: each (depth, N, topk) tree's predicted step time and the tau it needs to
    match a plain step (step time / plain step time)."""
    plain = profile.plain_step_s()
    spread = ", ".join(f"{what} {value:.0%}" for what, value in profile.spread.items())
    doubts = "".join(f"in doubt: {d}\n" for d in profile.doubts())
    lines = [
        f"plain step: {1e3 * plain:.2f} ms ({profile.key})",
        *([f"timings' spread (interquartile range / median): {spread}"] if spread else []),
        *([doubts.rstrip()] if doubts else []),
        "| depth | N | topk | step ms | break-even τ |",
        "| --- | --- | --- | --- | --- |",
    ]
    for depth, n, topk in shapes:
        step = profile.step_s(depth, n, topk)
        lines.append(f"| {depth} | {n} | {topk} | {1e3 * step:.1f} | {step / plain:.2f} |")
    if profile.acceptance:  # what a request starts from (AcceptanceStats.seed), smallest first
        lines += ["", "acceptance carried (docs/tree_policy.md §5):",
                  "| topk | depth | N | τ = 1 + drafts accepted | steps | requests "
                  "| worth steps |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        cells = sorted(((*parse_cell(c), row) for c, row in profile.acceptance.items()),
                       key=lambda c: (c[2], c[1], c[0]))  # fmt: skip
        for k, d, n, row in cells:
            weight = prior_weight(row, n, AcceptanceStats.PRIOR_STEPS)
            lines.append(f"| {k} | {d} | {n} | {1 + row[0] / row[1]:.2f} | {row[1]:.1f} | "
                         f"{row[5]:.1f} | {weight:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m rheo_engine.runtime.tree_policy PROFILE.json`: the break-even tau of some
    trees."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rheo_engine.runtime.tree_policy PROFILE.json (from --cost-profile)")
        return 2
    try:
        print(break_even_table(CostProfile.load(args[0])), end="")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
