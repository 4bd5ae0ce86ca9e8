"""train.default chains the four stages of the default pair's recipe (weights/README.md): each
stage gets the folder of the one before it, and a finished stage is reused, not retrained."""

from __future__ import annotations

import json
from pathlib import Path

from rheo_engine.train import default


def fake_stage(calls: list[tuple[str, list[str]]], name: str):
    """Records argv and writes the --out folder's config.json, as a finished stage would."""

    def run(argv: list[str]) -> dict:
        calls.append((name, argv))
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"stage": len(calls)}))
        return {}

    return run


def test_stages_in_order_each_from_the_last(monkeypatch, tmp_path: Path):
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(default.train_target, "main", fake_stage(calls, "target"))
    monkeypatch.setattr(default.train_head, "main", fake_stage(calls, "head"))
    out, work = tmp_path / "pair", tmp_path / "work"
    default.main(["--out", str(out), "--work", str(work), "--threads", "1"])
    assert [name for name, _ in calls] == ["target", "head", "target", "head"]
    flag = lambda argv, f: argv[argv.index(f) + 1] if f in argv else None
    (_, t1), (_, h1), (_, t2), (_, h2) = calls
    assert flag(h1, "--target") == flag(t1, "--out")
    assert flag(t2, "--init-from") == flag(t1, "--out") and flag(t2, "--seq") == "1024"
    assert flag(h2, "--target") == flag(t2, "--out") == str(out / "target")
    assert flag(h2, "--init-from") == flag(h1, "--out") and flag(h2, "--out") == str(out / "draft")
    assert all(flag(argv, "--threads") == "1" and flag(argv, "--seed") == "0" for _, argv in calls)


def test_finished_stages_are_reused(monkeypatch, tmp_path: Path):
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(default.train_target, "main", fake_stage(calls, "target"))
    monkeypatch.setattr(default.train_head, "main", fake_stage(calls, "head"))
    work = tmp_path / "work"
    for done in ("target-256", "draft-256"):
        (work / done).mkdir(parents=True)
        (work / done / "config.json").write_text("{}")
    default.main(["--out", str(tmp_path / "pair"), "--work", str(work)])
    assert [name for name, _ in calls] == ["target", "head"]
    assert "--init-from" in calls[0][1] and "--init-from" in calls[1][1]
