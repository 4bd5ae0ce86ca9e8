"""The end-to-end benches (bench/e2e.py, table4.py, ablations.py, gpu_check.sh) on stories260K.

- e2e: JSON and markdown hold every method, tau, tokens/s and a speedup column; configurations
  rotate per question; long prompts are cut to the context; bad options fail before any work;
  the summary's tau/speedup arithmetic on hand-made records.
- table4: the head's per-position draft logits equal Eagle3Drafter.root_logits; the exact
  depth-1 acceptance of every method is <= the per-node bound, rheo's equals Theorem 3, and
  every method's first-token law equals p (synthetic nodes with q close to p, a draft vocabulary
  smaller than the target's, and real contexts).
- ablations: JSON and markdown (and PNG when matplotlib is installed) per ablation.
- gpu_check.sh fails clearly without a GPU; its step bookkeeping runs in dry-run mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import ablations  # noqa: E402
import common  # noqa: E402
import e2e  # noqa: E402
import table4  # noqa: E402

from rheo_engine import Engine  # noqa: E402
from rheo_engine.models.eagle3_drafter import Eagle3Drafter  # noqa: E402

SMALL_TREE = ["--topk", "4", "--depth", "3", "--total-tokens", "10"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(stories_dir: Path, stories_head_dir: Path) -> list[str]:
    return ["--target", str(stories_dir), "--draft", str(stories_head_dir)]


# --- e2e -------------------------------------------------------------------------------------


def test_e2e_outputs_every_method_with_speedup(pair, tmp_path, capsys):
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    e2e.main(
        [
            *pair,
            "--prompts",
            "stories",
            "--limit",
            "1",
            "--seeds",
            "2",
            "--max-new-tokens",
            "6",
            *SMALL_TREE,
            "--out",
            str(out),
            "--md",
            str(md),
            "--quiet",
        ]
    )
    data = json.loads(out.read_text())
    assert data["conditions"]["bench"] == "e2e" and data["conditions"]["seeds"] == 2
    assert list(data["summary"]) == list(common.METHODS)
    for per_set in data["summary"].values():
        assert set(per_set) == {"stories", "average"}
        avg = per_set["average"]
        assert avg["tau_mean"] >= 1.0 and avg["tokens_per_s"] > 0 and avg["speedup"] > 0
    assert data["summary"]["ar"]["average"]["speedup"] == pytest.approx(1.0)
    assert data["summary"]["ar"]["average"]["tau_mean"] == pytest.approx(1.0)
    # 2 seeds x 1 question x 4 methods; the order rotates by one per question.
    labels = [r["label"] for r in data["records"]]
    assert labels == ["ar", "topk", "rrsw", "rheo", "topk", "rrsw", "rheo", "ar"]
    assert all(r["new_tokens"] <= 6 and r["steps"] >= 1 for r in data["records"])
    text = md.read_text()
    assert (
        text.startswith("# bench=e2e ")
        and "| method | stories τ | avg τ | tokens/s | speedup |" in text
    )
    assert all(f"| {m} |" in text for m in common.METHODS)
    assert "speedup" in capsys.readouterr().out  # the table is printed too


def test_e2e_question_sets_cut_long_prompts(pair, shared_dir, tmp_path):
    out = tmp_path / "q.json"
    data = e2e.main(
        [
            *pair,
            "--prompts",
            "questions",
            "--sets",
            "sum",
            "qa",
            "--limit",
            "1",
            "--methods",
            "ar",
            "rheo",
            "--seeds",
            "1",
            "--max-new-tokens",
            "4",
            *SMALL_TREE,
            "--out",
            str(out),
            "--quiet",
        ]
    )
    cond = data["conditions"]
    assert cond["sets"] == ["sum", "qa"] and cond["questions_per_set"] == [1, 1]
    assert cond["prompts_cut"] == 1  # the CNN article is longer than stories260K's context
    assert cond["prompts_cut_to"] == 512 - 4 - 10
    assert set(json.loads(out.read_text())["summary"]["rheo"]) == {"sum", "qa", "average"}


def test_prompt_cut_keeps_bos_and_tail(stories_dir):
    engine = Engine.from_pretrained(stories_dir)
    full = engine.tokenizer.encode("Once upon a time there was a dog. " * 20)
    ids, cut = common.prompt_ids(engine, "Once upon a time there was a dog. " * 20, False, 30)
    assert cut and len(ids) == 30 and ids[0] == full[0] and ids[1:] == full[-29:]
    assert common.prompt_ids(engine, "Once", False, 30) == (engine.tokenizer.encode("Once"), False)


@pytest.mark.parametrize(
    "extra, error",
    [
        (["--sets", "nope"], ValueError),
        (["--limit", "0"], ValueError),
        (["--support", "2"], ValueError),  # support < topk
        (["--max-new-tokens", "500"], ValueError),  # no room left in the 512-token context
        (["--draft", "/nonexistent/head"], FileNotFoundError),
    ],
)
def test_e2e_rejects_bad_options_before_work(pair, extra, error, capsys):
    with pytest.raises(error):
        e2e.main([*pair, "--prompts", "questions", "--seeds", "1", "--quiet", *extra])
    assert "bench=e2e" not in capsys.readouterr().out  # nothing ran


def test_summarize_arithmetic():
    def rec(label, seed, tokens, emitted, steps, wall):
        return common.Record(label, "s", 0, seed, tokens, emitted, steps, wall, 0.0, 0.0, 0.0)

    records = [
        rec("ar", 0, 10, 10, 10, 1.0),
        rec("rheo", 0, 10, 12, 4, 0.5),
        rec("ar", 1, 10, 10, 10, 2.0),
        rec("rheo", 1, 10, 10, 5, 0.5),
    ]
    s = common.summarize(records, "ar")
    assert s["rheo"]["s"]["tau_mean"] == pytest.approx((3.0 + 2.0) / 2)
    assert s["rheo"]["s"]["tau_std"] == pytest.approx(0.7071067811865476)
    assert s["rheo"]["average"]["speedup"] == pytest.approx((2.0 + 4.0) / 2)
    assert s["rheo"]["average"]["tokens_per_s"] == pytest.approx(20.0)
    assert "speedup" not in common.summarize(records, None)["rheo"]["average"]


# --- table4 ----------------------------------------------------------------------------------


def test_draft_logits_along_a_sequence_match_the_drafter(stories_dir, stories_head_dir):
    engine = Engine.from_pretrained(stories_dir, stories_head_dir)
    ids = [1, 403, 407, 261, 378, 432, 383, 286]
    p_all, q_all = table4.sequence_logits(engine, ids)
    for L in (3, len(ids)):  # the engine's state after a prompt of L tokens
        drafter = Eagle3Drafter(engine.head, 16)
        cache = engine.target.new_cache(16)
        body = torch.tensor([ids[: L - 1]])
        logits, feats = engine.target.forward(
            body, torch.arange(L - 1).unsqueeze(0), cache, None, engine.head.feature_layers
        )
        drafter.prefill(feats, torch.tensor([ids[1:L]]))
        torch.testing.assert_close(
            q_all[L - 1], drafter.root_logits()[0].double(), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(p_all[L - 2], logits[0, -1].double(), atol=1e-5, rtol=1e-5)


def _check_node(node: table4.Node) -> None:
    for method in table4.VERIFY_METHODS:
        assert 0.0 <= node.acceptance[method] <= node.bound + 1e-9, method
        assert node.law_error[method] < 1e-9, method  # lossless: first token ~ p
    assert node.acceptance["rheo"] == pytest.approx(node.theorem3, abs=1e-9)


@pytest.mark.parametrize(
    "leads, T, support", [(1, 1.0, 64), (0, 0.7, 16), (2, 1.3, 64), (1, 1.0, 8)]
)
def test_depth1_exact_acceptance_on_synthetic_nodes(leads, T, support):
    g = torch.Generator().manual_seed(leads * 10 + support)
    V = 64
    for _ in range(4):
        p_logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
        q_logits = p_logits + torch.randn(V, generator=g, dtype=torch.float64) * 0.7
        node = table4.node_numbers(p_logits, q_logits, T, leads, support, None, 5)
        _check_node(node)
        top3 = q_logits.topk(3).indices  # topk accepts exactly p(top-3 of q)
        assert node.acceptance["topk"] == pytest.approx(
            float(torch.softmax(p_logits / T, 0)[top3].sum())
        )
        assert node.acceptance["rheo"] > node.acceptance["topk"]  # q ~ p: the sampled slot helps


def test_depth1_with_a_smaller_draft_vocabulary():
    g = torch.Generator().manual_seed(7)
    V, Vd = 48, 20
    d2t = torch.randperm(V, generator=g)[:Vd]  # draft id -> target id
    p_logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
    q_logits = p_logits[d2t] + torch.randn(Vd, generator=g, dtype=torch.float64) * 0.5
    _check_node(table4.node_numbers(p_logits, q_logits, 1.0, 1, 16, d2t, 3))


def test_table4_on_real_contexts(pair, tmp_path):
    out, md = tmp_path / "t4.json", tmp_path / "t4.md"
    data = table4.main(
        [
            *pair,
            "--prompts",
            "stories",
            "--limit",
            "1",
            "--max-new-tokens",
            "5",
            "--out",
            str(out),
            "--md",
            str(md),
        ]
    )
    assert json.loads(out.read_text())["summary"] == data["summary"]
    assert len(data["nodes"]) == 6  # the last prompt token and the 5 generated ones
    for n in data["nodes"]:
        _check_node(table4.Node(n["acceptance"], n["law_error"], n["bound"], n["theorem3"]))
    s = data["summary"]
    assert all(s["acceptance"][m] <= s["bound"] + 1e-9 for m in table4.VERIFY_METHODS)
    text = md.read_text()
    assert all(f"| {m} |" in text for m in table4.VERIFY_METHODS) and "upper bound" in text


def test_table4_rejects_greedy(pair):
    with pytest.raises(ValueError, match="temperature"):
        table4.main([*pair, "--prompts", "stories", "--temperature", "0"])


# --- ablations -------------------------------------------------------------------------------


def test_ablations_write_their_files(pair, tmp_path):
    payloads = ablations.main(
        [
            *pair,
            "--prompts",
            "stories",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            *SMALL_TREE,
            "--leads-list",
            "0",
            "1",
            "--temperatures",
            "0",
            "1",
            "--supports",
            "16",
            "--out-dir",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert ablations.engine_module.Eagle3Drafter is Eagle3Drafter  # the recording hook is undone
    try:
        import matplotlib  # noqa: F401

        has_plots = True
    except ImportError:
        has_plots = False
    for which in ablations.ABLATIONS:
        stem = tmp_path / f"ablation_{which}"
        data = json.loads(stem.with_suffix(".json").read_text())
        assert data["conditions"]["bench"] == f"ablation_{which}"
        assert stem.with_suffix(".md").read_text().startswith(f"# bench=ablation_{which} ")
        assert stem.with_suffix(".png").is_file() == has_plots
        assert payloads[which]["results"] == data["results"]
    m, T, S = (payloads[w]["results"] for w in ("m", "T", "S"))
    assert m["m"] == [0, 1] and len(m["rheo_tau"]) == 2 and m["topk_tau"] >= 1
    assert T["T"] == [0.0, 1.0] and T["topk_tau"][0] == T["rheo_tau"][0]  # T = 0: all greedy
    assert S["S"] == ["16", "full"] and S["support"] == [16, 512]
    assert 0 < S["coverage"][0] < 1 and S["coverage"][1] == pytest.approx(1.0)
    assert all(ms > 0 for ms in S["draft_ms_per_step"])


# --- gpu_check.sh ----------------------------------------------------------------------------


def _gpu_present() -> bool:
    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(_gpu_present(), reason="this machine has a GPU: the no-GPU path cannot run")
def test_gpu_check_fails_clearly_without_gpu(tmp_path):
    run = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and "no NVIDIA GPU" in run.stderr


def test_gpu_check_dry_run_lists_every_step(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: x)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "GPU_CHECK_DRY": "1",
        "STORIES_HEAD": str(tmp_path / "no-head"),
    }
    logs = tmp_path / "logs"
    run = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), str(logs)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    summary = (logs / "summary.md").read_text()
    assert "DRY RUN" in summary and summary == run.stdout
    for name in (
        "build",
        "cuda_tests",
        "bench_tree_attention",
        "bench_verification",
        "train_head",
        "e2e",
    ):
        assert f"| {name} | ok |" in summary
    assert "FORCE_CUDA=1" in (logs / "build.log").read_text()
    assert "--device cuda" in (logs / "bench_tree_attention.log").read_text()
    assert "--device cuda" not in (logs / "bench_verification.log").read_text()
    assert "-k cuda" in (logs / "cuda_tests.log").read_text()
