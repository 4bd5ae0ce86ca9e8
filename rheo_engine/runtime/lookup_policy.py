"""How many lookup nodes a step drafts (docs/lookup.md): the measured cost of a target step of
n rows against the acceptance the sequence's own evidence predicts.

A step over the best N - 1 lookup candidates (spec.lookup) yields 1 + E[accepted] tokens, where
E[accepted] is the sum of the kept nodes' estimated acceptances (LookupStats), and costs
``StepCosts.step_s(N)``: a target forward over N rows plus verification, measured on the
running machine. The policy takes the N with the most tokens per second, and a plain step
(N = 1) when no tree beats it by ``MARGIN`` or nothing matches. Everything it reads is known
before the step (the history, past steps' evidence, the measured costs), so the tree is fixed
before the step's coins: lossless (DESIGN §2.4).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from rheo_engine.machine import kept_file, read_kept, write_kept
from rheo_engine.runtime.tree_policy import extrapolated, running_max
from rheo_engine.spec.lookup import MAX_N, Candidates, LookupStats

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
MARGIN = 1.05  # a tree must beat a plain step's tokens per second by 5%


@dataclass
class StepCosts:
    """Seconds of a target step (forward and verification) over n rows, measured on this
    machine: non-decreasing in n (a monotone fit of the medians), with the spread of the
    repeated, interleaved measurements (max / min of the repeats at each n, worst n)."""

    key: str
    step_s: dict[int, float]
    spread: float = 0.0
    measure_s: float = 0.0
    pinned: bool = False  # from a request's cost_profile=: no step time corrects it
    # the most rows a step may have and be priced by these costs (0: any; CostProfile's)
    trusted: int = 0

    def cost(self, n: int) -> float:
        """Seconds at n rows: linear between measured sizes, past the last by its slope
        (each n computed once: the policy reads a few dozen every step)."""
        table = self.__dict__.setdefault("_at", {})
        at = table.get(n)
        if at is None:
            at = table[n] = extrapolated(self.step_s, n)
        return at


@dataclass
class LocalCosts:
    """One sequence's step costs: the machine's (StepCosts) corrected by what its own steps
    took. A long context makes every row dearer (attention reads the whole prefix), which a
    profile measured at another length cannot know (DESIGN §2.7: a measured cost is evidence).
    cost(n) = plain * (cost(1) + (cost(n) - cost(1)) * rows): ``plain`` from its plain steps
    (the machine's load now: it slows a tree's rows as it slows a plain step's), ``rows`` (the
    marginal row's factor beyond that) from its tree steps, each a decayed mean. (With the rows
    unscaled by the load, a host running 2.6x slow priced a 4-node lookup tree of the default
    pair at 1.15 plain steps; it took 2.1.)"""

    costs: StepCosts
    plain: float = 1.0
    rows: float = 1.0
    KEEP = 0.7  # weight of the past in each mean

    @property
    def trusted(self) -> int:
        return self.costs.trusted

    def cost(self, n: int) -> float:
        one = self.costs.cost(1)
        return self.plain * (one + (self.costs.cost(n) - one) * self.rows)

    def observe(self, n: int, seconds: float) -> None:
        one = self.costs.cost(1)
        if n == 1:
            self.plain = self.KEEP * self.plain + (1 - self.KEEP) * seconds / one
            return
        extra = self.costs.cost(n) - one
        if extra > 0:
            rows = max(0.25, (seconds / self.plain - one) / extra)
            self.rows = self.KEEP * self.rows + (1 - self.KEEP) * rows


def monotone(values: dict[int, float]) -> dict[int, float]:
    """The running maximum in n: a step over more rows never costs less than one over fewer
    (a measurement that says so saw noise, DESIGN §2.7)."""
    return running_max(values)


def measure_costs(key: str, run_step, max_nodes: int, repeats: int = 5,
                  budget_s: float = 4.0, sizes: tuple[int, ...] = SIZES) -> StepCosts:  # fmt: skip
    """Time ``run_step(n)`` (one target forward over n rows plus its verification, nothing
    committed) at ``sizes`` <= max_nodes: rounds over all sizes, interleaved, until ``repeats``
    rounds or ``budget_s`` seconds (at least min(2, repeats) rounds; a warm-up first when
    more than one), then the fastest per size, fit monotone; ``spread`` is the worst median /
    fastest. One round at two sizes is the CPU's estimate, which each sequence's own steps
    then correct (LocalCosts)."""
    start = time.perf_counter()
    sizes = [n for n in sizes if n <= max(1, max_nodes)]
    if repeats > 1:
        run_step(sizes[-1])  # warm-up: allocations, caches
    times: dict[int, list[float]] = {n: [] for n in sizes}
    rounds = 0
    while rounds < repeats and (rounds < min(2, repeats)
                                or time.perf_counter() - start < budget_s):  # fmt: skip
        for n in sizes:
            t0 = time.perf_counter()
            run_step(n)
            times[n].append(time.perf_counter() - t0)
        rounds += 1
    # The fastest repeat: a neighbour's load only ever adds time, and it adds it unevenly
    # across sizes (a loaded repeat at n = 1 made every tree look cheap, DESIGN §2.7).
    fastest = {n: min(ts) for n, ts in times.items()}
    spread = max(statistics.median(ts) / min(ts) for ts in times.values())
    return StepCosts(key, monotone(fastest), spread, time.perf_counter() - start)


def costs_from_profile(profile, pinned: bool = True) -> StepCosts:
    """The step costs a head's CostProfile (tree_policy) implies: a target forward over n rows
    plus a verification of n nodes, and where the profile learned real steps (lookup_s, from
    tree_policy.CostLearner) their seconds, elsewhere the sum plus what real steps took beyond
    it (a plain step's excess at n = 1; a lookup tree's, the median over the sizes that ran,
    at n > 1: building the tree, its verification's bookkeeping), and a tree at least a plain
    step plus its forward's and verification's growth. ``pinned`` for a request's
    own profile (which then reproduces its trees), not for the one the decoder learns (which
    each sequence's steps correct further: LocalCosts)."""
    sizes = sorted(set(SIZES) | set(profile.target_s))
    verify = running_max(profile.verify_s) if profile.verify_s else None

    def parts(n: int) -> float:
        return profile.target(n) + (extrapolated(verify, n) if verify else 0.0)

    seen = getattr(profile, "lookup_s", {})
    plain = seen[1] - parts(1) if 1 in seen else 0.0
    trees = [seen[n] - parts(n) for n in seen if n > 1]
    tree = statistics.median(trees) if trees else plain
    at = {n: parts(n) for n in sizes}
    one = seen.get(1, at[1] + plain)
    # A tree does a plain step's work and its rows': never cheaper than that (a plain step's
    # median of 5 that one slow step raised had priced 2-node trees at a plain step's cost,
    # and at T = 1 trees promising 0.1 tokens ran; 2026-12-07)
    steps = {n: one if n == 1 else max(seen.get(n, at[n] + tree), one + at[n] - at[1])
             for n in sizes}  # fmt: skip
    return StepCosts(f"from {profile.key}", monotone(steps), pinned=pinned,
                     trusted=getattr(profile, "trusted_rows", 0))  # fmt: skip


def cached_costs(key: str) -> StepCosts | None:
    raw = read_kept(kept_file("lookup-costs", key))
    try:
        costs = StepCosts(str(raw["key"]), {int(k): float(v) for k, v in raw["step_s"].items()},
                          float(raw["spread"]), float(raw["measure_s"]))  # fmt: skip
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    if costs.key != key or not costs.step_s:
        return None
    costs.step_s = monotone(costs.step_s)
    return costs


def keep_costs(costs: StepCosts) -> None:
    write_kept(kept_file("lookup-costs", costs.key), asdict(costs))


def costs_key(target_cfg, device: torch.device, dtype: torch.dtype, tensor_parallel: int,
              weights: str = "") -> str:  # fmt: skip
    """What lookup step costs were measured for (``weights``: as tree_policy.profile_key)."""
    t = target_cfg
    parallel = f", tensor parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    held = f", weights {weights}" if weights else ""
    return (
        f"lookup steps: target {t.num_hidden_layers}x{t.hidden_size}/{t.intermediate_size} "
        f"V{t.vocab_size}, {device.type}, {str(dtype).replace('torch.', '')}, "
        f"{torch.get_num_threads()} threads{parallel}{held}"
    )


def choose_nodes(cands: Candidates, costs: StepCosts | LocalCosts | None, room: int, wanted: int,
                 max_nodes: int, scale: float = 1.0) -> tuple[int, int]:  # fmt: skip
    """(N, depth) of the step: the N <= min(room, max_nodes) maximising (1 + E[accepted]) /
    cost(N) over the candidates no deeper than wanted - 1, each candidate's estimate times
    ``scale`` (the sequence's LookupStats.calibration); (1, 0), a plain step, when no tree
    beats a plain step by MARGIN. ``costs`` None (tree="fixed"): every usable candidate, up to
    that bound."""
    depth_cap = wanted - 1
    usable = [i for i in cands.ranked() if cands.depth[i] <= depth_cap]
    limit = min(room, max_nodes, len(usable) + 1)
    if costs is not None and costs.trusted:
        limit = min(limit, costs.trusted)
    if limit < 2:
        return 1, 0
    if costs is None:
        return limit, max(cands.depth[i] for i in usable[: limit - 1])
    plain = 1.0 / costs.cost(1)
    best_rate, best_n, gained = plain * MARGIN, 1, 0.0
    for n in range(2, limit + 1):
        node = scale * math.exp(cands.scores[usable[n - 2]])
        # No larger tree can win: each further node adds at most this one's estimate (they
        # are ranked) and costs no less than n rows (the costs are monotone). An exact cut.
        cost = costs.cost(n)
        if (1.0 + gained + (limit - n + 1) * node) / cost <= best_rate:
            break
        gained += node
        rate = (1.0 + gained) / cost
        if rate > best_rate:
            best_rate, best_n = rate, n
    if best_n == 1:
        return 1, 0
    depth = max(cands.depth[i] for i in usable[: best_n - 1])
    return best_n, depth


def accepted_bound(stats: LookupStats, depth: int, lengths) -> float:
    """An upper bound on E[accepted] of every lookup tree no deeper than ``depth`` that
    ``stats`` scores from matches of the lengths n in ``lengths`` (each node keeps the length of
    the match that made it): a node's estimate is the product of the continuation rates and
    shares down its path (spec.lookup.candidates), the shares of one parent's children sum to
    at most 1, so the estimates of a depth's nodes sum to at most the depth above's times the
    best rate of that depth."""
    total = 0.0
    for total in _masses(stats, depth, lengths):
        pass
    return total


def _masses(stats: LookupStats, depth: int, lengths):
    """accepted_bound at depths 1, 2, ... ``depth`` in turn (none without lengths)."""
    total, along = 0.0, 1.0
    for d in range(1, depth + 1 if lengths else 1):  # (past DEPTHS the last cell: LookupStats)
        along *= max(stats.rate(n, d) for n in lengths)
        total += along
        yield total


def no_tree_pays(stats: LookupStats, costs: StepCosts | LocalCosts, room: int, wanted: int,
                 max_nodes: int, max_depth: int, lengths, scale: float = 1.0) -> bool:  # fmt: skip
    """Whether choose_nodes must return a plain step for any trie of matches of ``lengths``: a
    tree that reaches depth D holds at least D + 1 rows (a chain) and accepts at most
    accepted_bound(stats, D, lengths) (its nodes no deeper than D), so for no D does even that
    mass at that chain's cost (costs are monotone in n) beat a plain step by MARGIN; or no tree
    fits. Exact: the decoder then skips building the trie (a plain step's evidence needs its
    first depth only). Until 2026-12-07 every depth's mass was priced at a 2-node tree's cost:
    at T = 1 the prior (0.5) of the deeper cells, which only trees try, then kept the bound
    above a plain step's rate in 39% of the default pair's steps, and each of them planned."""
    deepest = min(max_depth, wanted - 1, min(room, max_nodes) - 1)
    plain = MARGIN / costs.cost(1)
    for d, mass in enumerate(_masses(stats, deepest, lengths), start=1):
        if (1.0 + scale * mass * (1.0 + 1e-9)) / costs.cost(d + 1) > plain:
            return False
    return True


def promised(cands: Candidates, n: int, wanted: int) -> float:
    """What the evidence alone expects a lookup tree of ``n`` nodes (choose_nodes') to accept."""
    usable = [i for i in cands.ranked() if cands.depth[i] <= wanted - 1]
    return sum(math.exp(cands.scores[i]) for i in usable[: n - 1])


def extra_nodes(cands: Candidates, costs: StepCosts | None, base_nodes: int, base_tokens: float,
                base_s: float, room: int, wanted: int, max_nodes: int,
                scale: float = 1.0) -> int:  # fmt: skip
    """How many lookup nodes to add to a head tree of ``base_nodes`` nodes that yields
    ``base_tokens`` tokens a step (the sequence's record) in ``base_s`` seconds: the count
    maximising (base_tokens + E[accepted lookup]) / (base_s + cost(base + n) - cost(base)),
    each estimate times ``scale`` (as choose_nodes), 0 when none beats the head tree alone by
    MARGIN. ``costs`` None (tree="fixed"): every usable candidate up to max_nodes."""
    usable = [i for i in cands.ranked() if cands.depth[i] <= wanted - 1]
    limit = min(room - base_nodes, max_nodes, len(usable))
    if costs is not None and costs.trusted:
        limit = min(limit, costs.trusted - base_nodes)
    if limit < 1:
        return 0
    if costs is None:
        return limit
    best_rate, best_n, gained = base_tokens / base_s * MARGIN, 0, 0.0
    for n in range(1, limit + 1):
        gained += scale * math.exp(cands.scores[usable[n - 1]])
        extra_s = costs.cost(base_nodes + n) - costs.cost(base_nodes)
        rate = (base_tokens + gained) / (base_s + extra_s)
        if rate > best_rate:
            best_rate, best_n = rate, n
    return best_n
