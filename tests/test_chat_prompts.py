"""chat_prompts: deterministic, every category present, none from bench/data (held out);
smollm2_data: a shard's layout, determinism and resume, on the default pair (fast)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rheo_engine.train import chat_prompts as cp
from rheo_engine.train import smollm2_data as sd

BENCH = Path(__file__).resolve().parents[1] / "bench" / "data"


def strings(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def bench_texts() -> set[str]:
    """Every string of every JSON / JSONL file under bench/data, whitespace-normalised."""
    found = set()
    for f in BENCH.rglob("*"):
        if f.suffix == ".jsonl":
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        elif f.suffix == ".json":
            rows = [json.loads(f.read_text())]
        else:
            continue
        found.update(" ".join(s.split()) for r in rows for s in strings(r) if len(s) > 20)
    return found


def test_deterministic_and_seeded() -> None:
    a, b = cp.sample_prompts(3, 200), cp.sample_prompts(3, 200)
    assert a == b
    assert a != cp.sample_prompts(4, 200)
    assert cp.sample_prompts(3, 50) == a[:50]  # a prefix of a longer sample


def test_every_category_and_shape() -> None:
    prompts = cp.sample_prompts(0, 1500)
    assert {p.category for p in prompts} == set(cp.CATEGORIES)
    assert abs(sum(cp.WEIGHTS) - 1) < 1e-9 and len(cp.WEIGHTS) == len(cp.CATEGORIES)
    for p in prompts:
        assert p.turns and all(t.strip() for t in p.turns)
        assert not any(re.search(r"\{(t|u|r|s|h|c|p|code|lang)\}", t) for t in p.turns)
        assert (len(p.turns) == 2) == (p.category == "multi_turn")
        assert p.self_instruct == (p.category == "self_instruct")
    maths = [p.turns[0] for p in prompts if p.category == "math"]
    assert len(set(maths)) > 0.9 * len(maths)  # numbers drawn, not a fixed list
    assert all(re.search(r"\d", m) for m in maths)


def test_no_prompt_from_bench_data() -> None:
    held_out = bench_texts()
    assert len(held_out) > 100  # the sets are there to compare with
    for p in cp.sample_prompts(0, 3000):
        for turn in p.turns:
            assert " ".join(turn.split()) not in held_out, turn


def test_passages_come_from_the_stdlib_training_split() -> None:
    ps = cp.passages()
    assert len(ps) > 500 and all(200 <= len(p) <= 1200 for p in ps)
    assert len(cp.code_spans()) > 500


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        ('"What makes honeybees dance?"', "What makes honeybees dance?"),
        ("Question: Why is the sky blue?\n\nIt is because...", "Why is the sky blue?"),
        ("ok", None),
        ("", None),
    ],
)
def test_clean_request(reply: str, want: str | None) -> None:
    assert cp.clean_request(reply) == want


def test_shards_resume_and_reproduce(tmp_path: Path) -> None:
    """Two tiny shards on the default pair: the layout is consistent, T = 0 and T = 1 shards
    share their prompts, a rerun skips them, and a remade shard is identical."""
    kw = dict(shards=2, seed=1, prompts_per_shard=4, max_new_tokens=8, batch=4, max_len=1024,
              dtype="float32", threads=1, pair="default")  # fmt: skip
    m = sd.run(tmp_path / "d", **kw)
    assert sorted(m["shards"]) == ["00000", "00001"]
    assert [m["shards"][k]["temperature"] for k in ("00000", "00001")] == [0.0, 1.0]
    assert m["shards"]["00000"]["weights"] == "float32 x50"  # what made the shard (formats)
    tokens, index = sd.load_shard(sd.shard_path(tmp_path / "d", 0))
    assert tokens.dtype == np.uint16 and index.shape[1] == 5
    assert (index[1:, 0] == index[:-1, 0] + index[:-1, 2]).all()  # packed back to back
    assert index[-1, 0] + index[-1, 2] == len(tokens)
    assert (index[:, 2] > index[:, 1]).all()  # every sequence has a reply
    assert m["shards"]["00000"]["positions"] == int((index[:, 2] - index[:, 1]).sum())
    p0 = [tokens[o : o + p].tolist() for o, p, *_ in index if _[2] == 0]
    t1, i1 = sd.load_shard(sd.shard_path(tmp_path / "d", 1))
    assert p0 == [t1[o : o + p].tolist() for o, p, *_ in i1 if _[2] == 0]  # same prompts
    before = sd.shard_path(tmp_path / "d", 1).stat().st_mtime_ns
    sd.run(tmp_path / "d", **kw)  # all there: nothing is made
    assert sd.shard_path(tmp_path / "d", 1).stat().st_mtime_ns == before
    sd.run(tmp_path / "e", **kw)
    for i in (0, 1):  # seeded: T = 1 reproduces too
        a, b = sd.load_shard(sd.shard_path(tmp_path / "d", i)), sd.load_shard(
            sd.shard_path(tmp_path / "e", i))
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    with pytest.raises(ValueError, match="same settings"):
        sd.run(tmp_path / "d", **{**kw, "shards": 3, "max_new_tokens": 9})


def test_head_trains_and_evaluates_from_shards(tmp_path: Path) -> None:
    """head_shards on four tiny shards of the default pair: features recomputed by prefill,
    unroll 7 over the draft vocabulary, a checkpoint, a resumed run on the same schedule, an
    exported head; --evaluate scores an existing head on the same held-out windows."""
    from rheo_engine.runtime.engine import DEFAULT_PAIR
    from rheo_engine.train import head_shards as hs

    data = tmp_path / "d"
    sd.run(data, shards=4, seed=2, prompts_per_shard=3, max_new_tokens=8, batch=4, max_len=1024,
           dtype="float32", threads=1, pair="default")  # fmt: skip
    seqs = hs.read_sequences(data, [0, 1])
    assert seqs and all(len(ids) > p for ids, p in seqs)
    common = ["--data", str(data), "--target", str(DEFAULT_PAIR / "target"), "--dtype",
              "float32", "--positions", str(2 * (hs.CONTEXT + 9)), "--minutes", "1.5",
              "--feature-layers", "2,4,5", "--draft-vocab", "512"]  # fmt: skip
    work = tmp_path / "w"
    r1 = hs.main([*common, "--work", str(work), "--max-steps", "3"])
    assert len(r1["acc"]) == 7 and all(0 <= x <= 1 for x in r1["acc"])
    assert json.loads((work / "ckpt.json").read_text())["step"] == 3
    hs.main([*common, "--work", str(work), "--resume", "--max-steps", "5", "--out",
             str(tmp_path / "head")])  # fmt: skip
    assert json.loads((work / "ckpt.json").read_text())["step"] == 5
    assert (tmp_path / "head" / "model.safetensors").is_file()
    ev = hs.main([*common[:-4], "--evaluate", str(DEFAULT_PAIR / "draft"), "--unroll", "2"])
    assert len(ev["acc"]) == 2 and ev["positions"][0] > 0
    hs.main([*common, "--init-from", str(tmp_path / "head"), "--max-steps", "1"])
