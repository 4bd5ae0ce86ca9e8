"""The auto tree never loses to plain decoding with a weak head (issue 26, part 2).

A recorded acceptance trace of a weak head is replayed against two cost profiles measured on a
2-core Xeon with SmolLM2-135M (tests/data, copied from ../shared/fixtures/profiles): one
measured under load (absurd: a 16-node tree predicted cheaper than a plain step) and a sane one.
The policy's predicted tokens per second must not fall below a plain step's by more than 5%.

The trace is generated here, deterministically (numpy seed 26), from per-depth acceptance
rates; nothing under tests/data holds it. Each step of the trace is the path the target took
through the head's candidates: at depth d (given the path reached depth d - 1) the target's
token is the head's rank-r candidate with probability ``TOP1[d] * s * RHO**r`` (r < 10), else
the path ends. TOP1 is the head's held-out top-1 agreement per unroll step (0.46, 0.43, 0.42,
0.40, then falling), ``s`` a per-prompt strength: on the unseen chat prompts of the issue the
head gave τ 1.2-1.7 with 16-60-node trees, and these strengths give τ 1.2-1.6 there
(test_the_trace_is_as_weak_as_the_issue_reports). Replaying a tree accepts the longest
prefix of the step's path whose nodes are in the tree.

A tree of width k, depth D and N nodes is grown as the drafter grows it: each level expands the
k best nodes of the level above (k children each), and the N - 1 best of all candidates are
kept, best first (the prune rank order the policy's replay relies on); a node's score is the
product of its path's acceptance probabilities.

What a step costs (the referee) comes from the profile's own measurements, made monotone here
independently of the code under test: a tree costs at least what any smaller tree of its
depth and width costs, and at least a plain step.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from rheo_engine.config import TreeConfig
from rheo_engine.runtime.tree_policy import AutoTree, CostProfile
from rheo_engine.spec.verify import Outcome

DATA = Path(__file__).parent / "data"
PROFILES = ("smollm2-rheo-xeon-measured-under-load.json", "smollm2-topk-xeon.json")
BOUND = TreeConfig("rheo", topk=10, depth=8, total_tokens=60)  # the default (paper) tree

TOP1 = (0.46, 0.43, 0.42, 0.40, 0.38, 0.36, 0.34, 0.32)  # held-out top-1 per unroll step
RHO = 0.35  # rank r's share relative to rank 0
STRENGTHS = (0.3, 0.5, 0.25, 0.6, 0.35, 0.45, 0.55, 0.4)  # one per prompt
TOKENS = 128  # per prompt, as in the issue's benchmark


def accept_prob(depth: int, rank: int, strength: float) -> float:
    return TOP1[depth - 1] * strength * RHO**rank


def trace(strength: float, steps: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Per step, the target's path as the head's candidate ranks, depth 1 first."""
    out = []
    for _ in range(steps):
        path: list[int] = []
        for depth in range(1, len(TOP1) + 1):
            u, cum = rng.random(), 0.0
            for rank in range(10):
                cum += accept_prob(depth, rank, strength)
                if u < cum:
                    path.append(rank)
                    break
            else:
                break
        out.append(tuple(path))
    return out


@lru_cache(maxsize=None)
def grown(topk: int, depth: int, n: int) -> tuple[tuple[tuple[int, ...], ...], dict]:
    """Nodes 1..n-1 of a (topk, depth, n) tree in rank order (as rank paths) and node -> index."""
    score = {(): 1.0}  # scores of the unit-strength head order trees as any strength does
    cands, frontier = [], [()]
    for d in range(1, depth + 1):
        level = [p + (r,) for p in frontier for r in range(topk)]
        for p in level:
            score[p] = score[p[:-1]] * accept_prob(d, p[-1], 1.0)
        cands += level
        frontier = sorted(level, key=lambda p: (-score[p], p))[:topk]
    nodes = tuple(sorted(cands, key=lambda p: (-score[p], len(p), p))[: n - 1])
    return nodes, {p: i + 1 for i, p in enumerate(nodes)}


def replay(cfg: TreeConfig, path: tuple[int, ...]) -> Outcome:
    """The step's verdict as the host reads it, for a tree cfg and the target's path."""
    nodes, index = grown(cfg.topk, cfg.depth, cfg.total_tokens)
    accepted = [0]
    for d in range(1, len(path) + 1):
        node = index.get(path[:d])
        if node is None:
            break
        accepted.append(node)
    n = cfg.total_tokens
    return Outcome(
        accept_len=[len(accepted)], bonus_token=[0],
        accept_path=[accepted + [-1] * (n - len(accepted))], path_tokens=[[0] * n],
        depth=[[0] + [len(p) for p in nodes]], status=0,
    )  # fmt: skip


def tau(cfg: TreeConfig, strength: float) -> float:
    """1 + the expected accepted drafts of a tree (exact, from the rates)."""
    nodes, _ = grown(cfg.topk, cfg.depth, cfg.total_tokens)
    return 1.0 + sum(
        np.prod([accept_prob(d + 1, r, strength) for d, r in enumerate(p)]) for p in nodes
    )


class Referee:
    """Step seconds from a profile file's raw measurements, made monotone (module docstring)."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw

    def _table(self, name: str, n: float) -> float:
        table = {int(k): v for k, v in self.raw[name].items()}
        sizes = sorted(table)
        if n <= sizes[-1]:
            return float(np.interp(n, sizes, [table[s] for s in sizes]))
        a, b = sizes[-2], sizes[-1]
        return table[b] + (table[b] - table[a]) / (b - a) * (n - b)

    def plain(self) -> float:
        return (self._table("target_s", 1) + self._table("verify_s", 1)) * self._table(
            "step_scale", 1
        )

    def _tree(self, depth: int, n: int, topk: int) -> float:
        drafting = self.raw["draft_base_s"] + self.raw["level_s"][str(topk)] * depth
        parts = drafting + self._table("verify_s", n) + self._table("target_s", n)
        return parts * self._table("step_scale", n)

    def step(self, cfg: TreeConfig) -> float:
        if cfg.method == "ar" or cfg.total_tokens == 1:
            return self.plain()
        smaller = (self._tree(cfg.depth, m, cfg.topk) for m in range(2, cfg.total_tokens + 1))
        return max(self.plain(), *smaller)


def run(name: str) -> dict:
    """Replay every prompt of the trace with a fresh policy; tokens/s against plain's."""
    raw = json.loads((DATA / name).read_text())
    referee, profile = Referee(raw), CostProfile.load(DATA / name)
    rng = np.random.default_rng(26)
    tokens, seconds, big_s, steps = 0, 0.0, 0.0, 0
    for strength in STRENGTHS:
        policy = AutoTree(BOUND, profile)
        emitted = 0
        for path in trace(strength, 4 * TOKENS, rng):
            if emitted >= TOKENS:
                break
            cfg = policy.choose(room=2048, wanted=TOKENS - emitted)
            if cfg.method == "ar":
                outcome, n = None, 1
            else:
                outcome = replay(cfg, path)
                n = outcome.accept_len[0]
            cost = referee.step(cfg)
            policy.observe(cfg, outcome, cost)
            emitted += n
            tokens, seconds, steps = tokens + n, seconds + cost, steps + 1
            if cfg.method != "ar" and cfg.total_tokens > 16:
                big_s += cost
    rate = tokens / seconds
    return {"ratio": rate * referee.plain(), "tau": tokens / steps, "big_share": big_s / seconds}


def test_the_trace_is_as_weak_as_the_issue_reports():
    """τ 1.2-1.7 at 16-60 nodes (the issue's histograms: N=16/d4, N=24/d7, N=60/d8)."""
    shapes = [TreeConfig("rheo", 4, 4, 16), TreeConfig("rheo", 6, 7, 24), BOUND]
    taus = [tau(cfg, s) for cfg in shapes for s in STRENGTHS]
    assert 1.15 <= min(taus) and max(taus) <= 1.75, taus
    # the sampled trace agrees with the exact expectation
    rng = np.random.default_rng(1)
    paths = trace(0.6, 4000, rng)
    sampled = np.mean([replay(BOUND, p).accept_len[0] for p in paths])
    assert sampled == pytest.approx(tau(BOUND, 0.6), abs=0.03)


@pytest.mark.parametrize("name", PROFILES)
def test_a_weak_head_never_loses_to_plain_steps(name):
    result = run(name)
    print(f"{name}: {result}")
    assert result["ratio"] >= 0.95, result
