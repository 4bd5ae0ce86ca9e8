"""The cost model that picks each step's tree (rheo_engine.runtime.tree_policy) and tree="auto" in
the engine. Losslessness of a history-dependent tree is proven in test_lossless.py (2b)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rheo_engine import Engine
from rheo_engine.config import TreeConfig
from rheo_engine.runtime.tree_policy import (
    AcceptanceStats,
    AutoTree,
    CostProfile,
    TreeUsage,
    profile_key,
)
from rheo_engine.spec.draft import pool_kind
from rheo_engine.spec.verify import Outcome

BOUND = TreeConfig("rheo", topk=4, depth=4, total_tokens=16)


def profile(target_s: dict[int, float], level_s: float = 0.0) -> CostProfile:
    levels = {k: level_s for k in (2, 4, 10)}
    return CostProfile("toy", target_s, 0.0, levels, {n: 0.0 for n in target_s})


def test_replay_fills_every_smaller_tree():
    """One step with nodes (in rank order) at depths 1,1,2,2,3 of which the path 1->3->5 was
    accepted: a depth-2 tree of 4 nodes would have accepted nodes 1 and 3."""
    stats = AcceptanceStats(max_depth=3, sizes=(2, 3, 4, 5, 6), decay=1.0)
    depths = np.array([1, 1, 2, 2, 3])
    accepted = np.array([1.0, 0.0, 1.0, 0.0, 1.0])
    stats.add(depths, accepted, grown=3)
    # depth 1: nodes 1, 2 exist -> sizes 2 and 3 covered (1 accepted), larger not covered
    assert stats.counts[0].tolist() == [1, 1, 0, 0, 0]
    assert stats.sums[0].tolist() == [1, 1, 0, 0, 0]
    # depth 2: nodes 1..4 -> sizes up to 5; the first 3 of them hold 2 accepted
    assert stats.sums[1].tolist() == [1, 1, 2, 2, 0]
    assert stats.counts[1].tolist() == [1, 1, 1, 1, 0]
    # depth 3: all five nodes
    assert stats.sums[2].tolist() == [1, 1, 2, 2, 3]
    est = stats.expected()
    assert (np.diff(est, axis=0) >= 0).all() and (np.diff(est, axis=1) >= 0).all()


def test_deeper_than_grown_is_not_evidence():
    stats = AcceptanceStats(max_depth=3, sizes=(2, 3), decay=1.0)
    stats.add(np.array([1, 2]), np.array([1.0, 1.0]), grown=2)
    assert stats.counts[2].tolist() == [0, 0]  # a depth-3 tree was never grown


DEPTHS = [0] + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 3  # 16 nodes in rank order, 4 per depth
GROWN = TreeConfig("rheo", topk=4, depth=4, total_tokens=16)


def outcome(path: list[int]) -> Outcome:
    """A step of the GROWN tree that accepted ``path`` (node indices), as read on the host."""
    accept_path = [0, *path] + [-1] * (16 - 1 - len(path))
    return Outcome([1 + len(path)], [0], [accept_path], [[0] * 16], [DEPTHS], 0)


def trained(prof: CostProfile, path: list[int], steps: int = 10) -> AutoTree:
    """A policy that has seen ``steps`` topk-4 trees accept ``path`` (node indices)."""
    policy = AutoTree(BOUND, prof)
    for _ in range(steps):
        policy.observe(GROWN, outcome(path), 1.0)
    return policy


def test_plain_step_when_trees_cost_too_much():
    costly = profile({1: 1.0, 2: 3.0, 16: 40.0})
    assert trained(costly, [1, 5, 9, 13]).choose(room=100, wanted=100).method == "ar"
    cheap = profile({1: 1.0, 2: 1.0, 16: 1.1})
    assert trained(cheap, [1, 5, 9, 13]).choose(room=100, wanted=100).method == "rheo"


def test_a_cold_start_drafts_only_probes():
    """No evidence yet: plain steps, and the eighth step probes the best optimistic tree."""
    policy = AutoTree(BOUND, profile({1: 1.0, 2: 1.0, 16: 1.1}))
    methods = [policy.choose(100, 100).method for _ in range(8)]
    assert methods == ["ar"] * 7 + ["rheo"]


def test_choice_respects_room_and_wanted():
    policy = trained(profile({1: 1.0, 16: 1.0}), [1, 5, 9, 13])
    assert policy.choose(room=5, wanted=100).total_tokens <= 5
    assert policy.choose(room=100, wanted=2).depth == 1
    assert policy.choose(room=100, wanted=1).method == "ar"


def test_acceptance_moves_the_choice():
    """A tree that accepts everything grows the choice; one that accepts nothing ends in plain
    steps; once the evidence has faded only probes draft, and a probe comes within 8 steps."""
    prof = profile({1: 1.0, 2: 1.3, 4: 1.5, 8: 1.9, 16: 3.0}, level_s=0.05)
    policy = trained(prof, [1, 5, 9, 13])
    big = policy.choose(100, 100)
    assert big.method == "rheo" and big.depth >= 3
    for _ in range(30):
        policy.observe(GROWN, outcome([]), 1.0)
    assert policy.choose(100, 100).method == "ar"
    for _ in range(200):
        policy.observe(TreeConfig("ar"), None, 1.0)  # plain steps: evidence fades
    assert "rheo" in [policy.choose(100, 100).method for _ in range(policy.probe_every)]


def test_profile_round_trip_and_bad_file(tmp_path):
    prof = CostProfile("k", {1: 0.1, 8: 0.2}, 0.01, {4: 0.02, 10: 0.03}, {1: 0.0, 8: 0.001}, 1.5)
    prof.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == prof
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cost profile .*bad.json: cannot read it.*delete it"):
        CostProfile.load(tmp_path / "bad.json")


def test_step_time_extrapolates_past_the_measured_sizes():
    prof = profile({1: 1.0, 2: 2.0, 4: 3.0})
    assert prof.target(3) == pytest.approx(2.5)
    assert prof.target(8) == pytest.approx(5.0)  # slope of the last two points


def test_histogram_names_plain_steps_and_trees():
    usage = TreeUsage()
    usage.add(TreeConfig("ar"), None, 0.1)
    usage.add(TreeConfig("rheo", 10, 3, 8), 0.2, 0.3)
    usage.add(TreeConfig("rheo", 10, 3, 8), 0.2, 0.3)
    assert usage.histogram() == "N=1x1 N=8/d3x2"
    assert usage.predicted_s == pytest.approx(0.4)


# --- tree="auto" in the engine ---------------------------------------------------------------

PROMPT = [1, 450, 1200, 33, 901, 7]


def cheap_profile(engine, method: str, temperature: float) -> CostProfile:
    """A profile for this engine under which trees look almost free, so auto drafts them."""
    pool = pool_kind(method, temperature)
    key = profile_key(
        engine.target.cfg, engine.head.cfg, engine.target.device, engine.target.dtype, pool, 10
    )
    return CostProfile(key, {1: 1.0, 60: 1.2}, 0.0, {10: 0.01}, {1: 0.0, 60: 0.0})


@pytest.fixture(scope="module")
def fp32_default():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(dtype=torch.float32)
    torch.set_num_threads(threads)


def test_auto_tree_greedy_equals_ar_in_fp32(fp32_default):
    """Whatever trees the cost model picks, T = 0 in fp32 is the target's greedy decoding."""
    engine = fp32_default
    prompt = "def quicksort(xs):"
    want = engine.generate(prompt, 40, method="ar", temperature=0).token_ids
    for method in ("topk", "rrsw", "rheo"):
        prof = cheap_profile(engine, method, 0.0)
        gen = engine.generate(prompt, 40, method=method, temperature=0, cost_profile=prof)
        assert gen.token_ids == want
        assert gen.tree == "auto" and sum(gen.trees.shapes.values()) == gen.steps
        assert any(n > 1 for _, n in gen.trees.shapes), gen.trees.histogram()
        assert gen.mean_accept_length > 1.5
        measured = engine.generate(prompt, 40, method=method, temperature=0)  # own profile
        assert measured.token_ids == want and measured.trees.predicted_s > 0


def test_auto_tree_with_a_saved_profile_reproduces_a_seed(tiny, tmp_path):
    path = tmp_path / "profile.json"
    first = tiny.generate(PROMPT, 24, temperature=1.0, seed=7, cost_profile=path)
    assert path.is_file()
    again = tiny.generate(PROMPT, 24, temperature=1.0, seed=7, cost_profile=path)
    assert again.token_ids == first.token_ids
    assert again.trees.shapes == first.trees.shapes


def test_measured_profile_is_kept_per_machine_and_reused_by_a_new_engine(
    tiny, tmp_path, monkeypatch
):
    """A seeded auto-tree run reproduces in a fresh engine (a new process on this machine):
    the profile measured by the first is kept on disk and read by the second, so the trees and
    the coins are the same. RHEO_CACHE_DIR=off keeps profiles in memory only."""
    from rheo_engine.runtime.engine import Engine

    SMALL = dict(topk=4, depth=3, total_tokens=8)  # a tree the tiny target's context measures

    def new_engine() -> Engine:  # what a new process would hold: no profile in memory
        return Engine(tiny.target, tiny.head, tiny.tokenizer, tiny.generation_config)

    monkeypatch.setenv("RHEO_CACHE_DIR", str(tmp_path / "cache"))
    measured = new_engine()
    first = measured.generate(PROMPT, 24, temperature=1.0, seed=11, **SMALL)
    kept = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["key"] in measured.cost_profiles
    fresh = new_engine()
    again = fresh.generate(PROMPT, 24, temperature=1.0, seed=11, **SMALL)
    assert again.token_ids == first.token_ids and again.trees.shapes == first.trees.shapes
    assert fresh.cost_profiles == measured.cost_profiles  # read, not measured again
    # The one-time measurement is reported apart and left out of tokens/s; the second engine
    # read the kept profile and measured nothing.
    assert first.measure_s > 0 and again.measure_s == 0
    assert first.tokens_per_s == pytest.approx(
        len(first.token_ids) / (first.wall_s - first.measure_s)
    )
    monkeypatch.setenv("RHEO_CACHE_DIR", "off")
    new_engine().generate(PROMPT, 4, temperature=0.0, seed=11, **SMALL)
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 1


def test_bad_tree_and_mismatched_profile(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"tree='big' is not one of \['auto', 'fixed'\]"):
        tiny.generate(PROMPT, 4, tree="big")
    wrong = tmp_path / "wrong.json"
    CostProfile("another machine", {1: 1.0}, 0.0, {10: 0.0}, {1: 0.0}).save(wrong)
    with pytest.raises(ValueError, match=r"cost profile measured for 'another machine'"):
        tiny.generate(PROMPT, 4, cost_profile=wrong)


def test_fixed_tree_keeps_the_configured_shape(tiny):
    gen = tiny.generate(PROMPT, 12, temperature=0, tree="fixed", topk=4, depth=3, total_tokens=8)
    assert (3, 8) in gen.trees.shapes and gen.trees.predicted_s == 0


def test_plain_steps_probe_speculation_now_and_then():
    """Under a prior that never pays, a tree is still drafted after 8 plain steps, then after
    16, 32, ... (each failed probe doubles the wait, up to 256)."""
    prof = profile({1: 1.0, 2: 1.6, 16: 4.0}, level_s=0.1)
    policy = AutoTree(BOUND, prof)
    drafted = []
    for step in range(130):
        cfg = policy.choose(100, 100)
        if cfg.method != "ar":
            drafted.append(step)
        policy.observe(TreeConfig("ar"), None, 1.0)  # (the probe's outcome is not fed)
    assert drafted[:4] == [7, 23, 55, 119]


def test_narrower_trees_are_chosen_when_levels_cost_by_row():
    """When a level of 4 rows costs far less than one of 10, the first probe drafts topk 2 or 4."""
    prof = CostProfile("toy", {1: 1.0, 16: 1.1}, 0.0, {2: 0.2, 4: 0.2, 10: 2.0}, {1: 0.0})
    bound = TreeConfig("rheo", topk=10, depth=4, total_tokens=16)
    policy = AutoTree(bound, prof)
    cfg = [policy.choose(100, 100) for _ in range(8)][-1]
    assert cfg.topk in (2, 4) and cfg.depth >= 2


def test_break_even_table_from_a_saved_profile(tmp_path, capsys):
    from rheo_engine.runtime.tree_policy import main

    prof = CostProfile("toy", {1: 0.1, 2: 0.11, 60: 1.0}, 0.001, {2: 0.01, 10: 0.02}, {1: 0.0})
    prof.save(tmp_path / "p.json")
    assert main([str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    # depth 1, N = 2, topk 2: 1 + 10 + 110 ms = 121 ms, 1.21 plain steps
    assert "plain step: 100.00 ms (toy)" in out and "| 1 | 2 | 2 | 121.0 | 1.21 |" in out
    assert main([str(tmp_path / "missing.json")]) == 2


def test_plain_steps_after_a_search_do_not_search_again():
    """When no tree beats a plain step, the next RECHECK - 1 plain steps reuse that answer
    (plain steps bring no evidence, they only fade it); a drafted step makes the next search."""
    policy = trained(profile({1: 1.0, 2: 3.0, 16: 40.0}), [1, 5, 9, 13])  # trees never pay
    searches = []
    real = policy._best

    def counted(room, wanted, optimistic):
        searches.append(optimistic)
        return real(room, wanted, optimistic)

    policy._best = counted
    plain = TreeConfig("ar")
    for _ in range(2 * AutoTree.RECHECK):
        assert policy.choose(100, 100).method == "ar"
        policy.observe(plain, None, 1.0)
    assert searches.count(False) == 2, searches
    policy.observe(GROWN, outcome([1]), 1.0)
    policy.choose(100, 100)
    assert searches.count(False) == 3, searches


def test_calibration_scales_each_size_by_its_real_steps():
    """calibrate_profile times real steps of a few shapes and keeps, per size, measured /
    the parts' sum: trees whose real steps cost twice their parts are predicted at twice,
    plain steps that cost their parts as measured stay as they were."""
    from rheo_engine.runtime.tree_policy import calibrate_profile

    prof = profile({1: 1.0, 2: 1.2, 16: 2.0, 60: 4.0}, level_s=0.1)
    ran = []

    def run_step(depth: int, n: int) -> float:
        ran.append((depth, n))
        return prof.parts_s(depth, n, 4) * (1.0 if n == 1 else 2.0)

    before = prof.step_s(3, 16, 4)
    calibrate_profile(prof, run_step, topk=4, max_nodes=16, max_depth=4)
    assert sorted(set(ran)) == [(0, 1), (1, 2), (1, 4), (2, 8), (3, 16)]  # capped at 16
    assert prof.step_s(3, 16, 4) == pytest.approx(2 * before)
    assert prof.plain_step_s() == pytest.approx(prof.parts_s(0, 1, 4))


def test_calibrated_profile_is_what_the_engine_keeps(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RHEO_CACHE_DIR", str(tmp_path / "cache"))
    engine = Engine(tiny.target, tiny.head, tiny.tokenizer, tiny.generation_config)
    engine.generate(PROMPT, 8, temperature=1.0, seed=1, topk=4, depth=3, total_tokens=8)
    (kept,) = (tmp_path / "cache" / "profiles").glob("*.json")
    scale = json.loads(kept.read_text())["step_scale"]
    assert set(scale) >= {"1", "2", "4", "8"} and all(v > 0 for v in scale.values())
    assert CostProfile.load(kept).step_scale == {int(k): v for k, v in scale.items()}
