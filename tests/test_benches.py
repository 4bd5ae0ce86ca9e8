"""The end-to-end benches (bench/e2e.py, table4.py, ablations.py, bench_engine.py).

They run on a fresh clone: the main checks use the embedded default pair (weights/default) and a
tiny question folder in EAGLE's layout written to tmp_path; the stories260K checks (needing
../shared) are extras that skip with their reason.
- e2e: JSON and markdown hold every method, tau next to the tokens emitted, tokens/s and a
  speedup column; configurations rotate per question; long prompts are cut to the context read
  from the target's config (and the output says how many); bad options fail before any work.
- inputs: --data (missing folder, missing set, malformed question.jsonl lines named by file and
  line), missing pairs say how to make them, and every bench script ends bad input in one line
  on stderr with a non-zero exit and no traceback.
- tau: produced() never counts a drafted token past a stop; summarize's arithmetic by hand.
- table4: the head's per-position draft logits equal Eagle3Drafter.root_logits; the exact
  depth-1 acceptance of every method is <= the per-node bound, rheo's equals Theorem 3, and
  every method's first-token law equals p (synthetic nodes, a smaller draft vocabulary, and
  real contexts).
- ablations: JSON and markdown (and PNG when matplotlib is installed) per ablation.
- bench_logit_controls: its quick run (the kernel equals the reference, one row per size).
- the kernel benches' harness (common.Timer, check_equal, max_abs_diff): warm-up and timed
  calls counted, paired calls interleaved, a failed check is one line naming what differs.
(gpu_check.sh and bench_kernels_gpu.py: tests/test_gpu_check.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import ablations  # noqa: E402
import common  # noqa: E402
import e2e  # noqa: E402
import inputs  # noqa: E402
import table4  # noqa: E402

from rheo_engine import Engine  # noqa: E402
from rheo_engine.models.eagle3_drafter import Eagle3Drafter  # noqa: E402

SMALL_TREE = ["--topk", "4", "--depth", "3", "--total-tokens", "10"]
DEFAULT = ROOT / "weights" / "default"
QUESTIONS = ["def add(a, b):", "Complete the code I provided.\n\nclass Stack:\n    def push(self"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def context() -> int:
    """The default target's context, read from its config (it changes when it is retrained)."""
    config = DEFAULT / "target" / "config.json"
    if not config.is_file() or not (DEFAULT / "draft" / "config.json").is_file():
        pytest.skip(f"the default pair is not in {DEFAULT}")
    return json.loads(config.read_text())["max_position_embeddings"]


def write_set(root: Path, name: str, lines: list[str]) -> Path:
    (root / name).mkdir(parents=True, exist_ok=True)
    path = root / name / "question.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def question(i: int, text: str) -> str:
    return json.dumps({"question_id": i, "category": "code", "turns": [text, "and again"]})


@pytest.fixture(scope="module")
def data(tmp_path_factory, context: int) -> Path:
    """EAGLE's layout: humaneval (two short questions), sum (one longer than the context)."""
    root = tmp_path_factory.mktemp("eagle_bench")
    write_set(root, "humaneval", [question(i, q) for i, q in enumerate(QUESTIONS)])
    write_set(root, "sum", [question(0, "Summarize: " + "x = y + 1\n" * context)])
    return root


@pytest.fixture(scope="module")
def engine(context: int) -> Engine:
    return Engine.from_pretrained(DEFAULT / "target", DEFAULT / "draft")


# --- e2e on the default pair ------------------------------------------------------------------


def test_e2e_default_pair_on_a_tiny_data_dir(context, data, tmp_path, capsys):
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    flags = ["--pair", "default", "--data", str(data), "--sets", "humaneval", "sum"]
    e2e.main([*flags, "--seeds", "1", "--max-new-tokens", "6", *SMALL_TREE, "--out", str(out),
              "--md", str(md), "--quiet"])  # fmt: skip
    data_out = json.loads(out.read_text())
    cond, records = data_out["conditions"], data_out["records"]
    assert cond["sets"] == ["humaneval", "sum"] and cond["questions_per_set"] == [2, 1]
    assert cond["context"] == context and cond["prompts_cut_to"] == context - 6 - 10
    assert cond["prompts_cut"] == 1  # the sum question is longer than the whole context
    printed = capsys.readouterr().out
    assert f"# prompts: 1 of 3 cut on the left (BOS kept) to {context - 16} tokens" in printed
    # 3 questions x 4 methods; the order rotates by one per question.
    labels = [r["label"] for r in records]
    assert labels == ["ar", "topk", "rrsw", "rheo", "topk", "rrsw", "rheo", "ar",
                      "rrsw", "rheo", "ar", "topk"]  # fmt: skip
    assert list(data_out["summary"]) == list(common.METHODS)
    for label, per_set in data_out["summary"].items():
        mine = [r for r in records if r["label"] == label]
        assert per_set["average"]["tokens"] == sum(r["new_tokens"] for r in mine)
        for name in ("humaneval", "sum"):
            group = [r for r in mine if r["set"] == name]
            tau = sum(r["emitted"] for r in group) / sum(r["steps"] for r in group)
            assert per_set[name]["tau_mean"] == pytest.approx(tau)
    for r in records:  # tau counts only tokens produced: at most the tokens returned + an EOS
        assert r["new_tokens"] <= r["emitted"] <= r["new_tokens"] + 1 and r["steps"] >= 1
    assert data_out["summary"]["ar"]["average"]["tau_mean"] == pytest.approx(1.0)
    assert data_out["summary"]["ar"]["average"]["speedup"] == pytest.approx(1.0)
    text = md.read_text()
    assert text.startswith("# bench=e2e ")
    assert "| method | humaneval τ | sum τ | avg τ | tokens | tokens/s | speedup |" in text


def test_e2e_without_the_shipped_sets_says_to_pass_data(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(inputs, "DEFAULT_DATA", tmp_path / "bench" / "data" / "eagle_bench")
    with pytest.raises(inputs.BadInput, match="pass --data DIR"):
        e2e.main(["--pair", "default", "--sets", "humaneval", "--quiet"])
    assert "bench=e2e" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--sets", "nope"], r"nope/question.jsonl not found; the sets in .* are \['humaneval'"),
        (["--sets", "humaneval", "humaneval"], "more than once"),
        (["--support", "2"], "support=2 < topk=10"),
        (["--max-new-tokens", "CONTEXT"], "lower --max-new-tokens"),  # no room in the context
        (["--draft", "/nonexistent/head"], "--draft /nonexistent/head has no config.json"),
        (["--prompts", "stories", "--sets", "humaneval"], "drop --sets"),
        (["--out", "DATA"], "is a directory"),
    ],
)
def test_e2e_rejects_bad_options_before_work(context, data, extra, match, capsys):
    extra = [{"CONTEXT": str(context), "DATA": str(data)}.get(x, x) for x in extra]
    with pytest.raises(inputs.BadInput, match=match):
        e2e.main(["--pair", "default", "--data", str(data), "--sets", "humaneval", "--seeds", "1",
                  "--quiet", *extra])  # fmt: skip
    assert "bench=e2e" not in capsys.readouterr().out  # nothing ran


def test_prompt_room_reads_the_context():
    def fake(context: int):
        return SimpleNamespace(target=SimpleNamespace(cfg=SimpleNamespace(
            max_position_embeddings=context)))  # fmt: skip

    assert inputs.prompt_room(fake(256), 128, 60) == 68
    assert inputs.prompt_room(fake(1024), 128, 60) == 836
    assert inputs.prompt_room(fake(1024), 128, 1) == 895  # ar: a tree of one token
    with pytest.raises(inputs.BadInput, match="leave 0 prompt tokens .* context of 188"):
        inputs.prompt_room(fake(188), 128, 60)


def test_prompt_cut_keeps_bos_and_tail(engine):
    text = "def f(x):\n    return x + 1\n" * 20
    full = engine.tokenizer.encode(text, bos=True)
    ids, cut = inputs.prompt_ids(engine, text, False, 30)
    assert cut and len(ids) == 30 and ids[0] == full[0] and ids[1:] == full[-29:]
    short = engine.tokenizer.encode("def", bos=True)
    assert inputs.prompt_ids(engine, "def", False, 30) == (short, False)


# --- question sets and pairs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, match",
    [
        ([question(0, "a"), "{not json", question(2, "c")], "question.jsonl line 2: not JSON"),
        ([question(0, "a"), "", '{"question_id": 3}'], "question.jsonl line 3: needs a 'turns'"),
        (['{"turns": []}'], "line 1: needs a 'turns' list"),
        (["[1, 2]"], "line 1: needs a 'turns' list"),
        (['{"turns": [""]}'], "line 1: needs a 'turns' list starting with the question text"),
        (["", "  "], "holds no questions"),
    ],
)
def test_load_questions_names_the_file_and_line(tmp_path, lines, match):
    path = write_set(tmp_path, "mt_bench", lines)
    with pytest.raises(inputs.BadInput, match=match) as info:
        inputs.load_questions(tmp_path, "mt_bench")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_load_questions_reads_the_first_turn_up_to_the_limit(tmp_path):
    write_set(tmp_path, "qa", [question(i, f"q{i}") for i in range(5)])
    assert inputs.load_questions(tmp_path, "qa") == [f"q{i}" for i in range(5)]
    assert inputs.load_questions(tmp_path, "qa", 2) == ["q0", "q1"]
    (tmp_path / "bad" / "question.jsonl").parent.mkdir()
    (tmp_path / "bad" / "question.jsonl").write_bytes(b'{"turns": ["\xff"]}\n')
    with pytest.raises(inputs.BadInput, match="is not UTF-8"):
        inputs.load_questions(tmp_path, "bad")
    with pytest.raises(inputs.BadInput, match=r"--data .*missing is not a directory"):
        inputs.data_dir(str(tmp_path / "missing"))


def test_missing_pair_says_how_to_make_it(monkeypatch, tmp_path):
    cache = inputs.ROOT / ".cache" / "nowhere"
    monkeypatch.setitem(inputs.PAIRS, "stories", (cache / "target", cache / "head"))
    with pytest.raises(inputs.BadInput, match=r"io.convert llama2c .*or use --pair default"):
        inputs.resolve_pair("stories", None, None)
    monkeypatch.setitem(inputs.PAIRS, "stories", (DEFAULT / "target", cache / "head"))
    with pytest.raises(inputs.BadInput, match=r"\.cache/nowhere/head.*rheo_engine.train.head"):
        inputs.resolve_pair("stories", None, None)


def test_bad_input_is_one_line_on_stderr(context, data, tmp_path, capsys):
    bad = tmp_path / "bad"
    write_set(bad, "humaneval", [question(0, "a"), '{"turns": ["b"]', question(2, "c")])
    d = ["--data", str(data), "--sets", "humaneval"]
    cases = [
        (e2e, ["--data", str(tmp_path / "none")], "--data"),
        (e2e, ["--data", str(data), "--sets", "nope"], "--sets nope"),
        (e2e, ["--data", str(bad), "--sets", "humaneval"], "humaneval/question.jsonl line 2"),
        (e2e, [*d, "--target", str(tmp_path)], "has no config.json"),
        (e2e, [*d, "--limit", "0"], "--limit: got 0"),
        (e2e, [*d, "--seeds", "0"], "--seeds: got 0"),
        (e2e, [*d, "--temperature", "-1"], "--temperature: got -1"),
        (e2e, [*d, "--pair", "nope"], "invalid choice: 'nope'"),
        (table4, [*d, "--temperature", "0"], "needs T > 0"),
        (table4, [*d, "--max-new-tokens", str(context)], "lower --max-new-tokens"),
        (ablations, [*d, "--leads-list", "-1"], "--leads-list: got -1"),
        (ablations, [*d, "--support", "2", "--out-dir", str(tmp_path / "abl")], "support=2 <"),
    ]
    for module, argv, needle in cases:
        with pytest.raises(SystemExit) as info:
            inputs.cli(module.main, argv)
        out, err = capsys.readouterr()
        assert info.value.code == 2, (module.__name__, argv)
        assert len(err.strip().splitlines()) == 1 and needle in err, (module.__name__, argv, err)
        assert "bench=" not in out, argv  # it failed before any work
    assert not (tmp_path / "abl").exists()  # ... and made no output folder


def _run_script(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)  # fmt: skip


def test_scripts_end_bad_input_without_a_traceback(tmp_path):
    cases = [
        (["bench/e2e.py", "--data", str(tmp_path / "none"), "--quiet"], "--data"),
        (["bench/bench_engine.py", "--pair", "default", "--runs", "0"], "--runs: got 0"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(_run_script, [argv for argv, _ in cases]))
    for (argv, needle), run in zip(cases, runs, strict=True):
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and "Traceback" not in run.stderr, (argv, run.stderr)
        assert len(lines) == 1 and needle in lines[0] and "error" in lines[0], (argv, run.stderr)
        assert run.stdout == "", argv  # it failed before any work


def test_bench_logit_controls_quick():
    run = _run_script(["bench/bench_logit_controls.py", "--quick"])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[1] == "kernel,dtype,N,V,H,us_controls,us_verification,controls_share", lines
    rows = [line.split(",") for line in lines[2:]]
    assert [(r[2], r[4]) for r in rows] == [
        (N, H) for H in ("100", "2000") for N in ("1", "8", "60")
    ]
    assert all(float(r[5]) > 0 and 0 < float(r[7]) < 1 for r in rows), rows


def test_kernel_bench_harness():
    timer, calls = common.Timer("cpu"), []
    assert timer.median_us(lambda: calls.append("f"), 30) >= 0
    assert len(calls) == 3 + 30  # warm-up max(3, reps // 10), then the timed calls
    calls.clear()
    timer.median_us(lambda: calls.append("f"), 5, warmup=1)
    assert len(calls) == 6
    calls.clear()
    flushed = common.Timer("cpu", flush=True, budget_s=0.0)
    ours, theirs = flushed.pair(lambda: calls.append("a"), lambda: calls.append("b"))
    assert ours > 0 and theirs > 0
    timed = calls[8:]  # after 3 warm-up pairs and the pilot pair: 5 pairs (the minimum), ABBA
    assert timed == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    x = torch.tensor([1.0, 2.0])
    common.check_equal(x, x.clone(), "same")
    assert common.max_abs_diff(x, x + 0.25, 0.5, "close") == 0.25
    with pytest.raises(SystemExit, match="^kernel and reference differ$"):
        common.check_equal(x, x + 1, "kernel and reference")
    with pytest.raises(SystemExit, match="kernel and SDPA differ by 1 .max abs., over 0.5"):
        common.max_abs_diff(x, x + 1, 0.5, "kernel and SDPA")
    with pytest.raises(SystemExit, match="differ by nan"):
        common.max_abs_diff(x, torch.tensor([1.0, float("nan")]), 0.5, "kernel and SDPA")


# --- tau --------------------------------------------------------------------------------------


def _generation(accept_lengths: list[int], tokens: int, stop: str) -> SimpleNamespace:
    """What produced() reads of a Generation."""
    return SimpleNamespace(token_ids=list(range(3, 3 + tokens)), accept_lengths=accept_lengths,
                           stop_reason=stop)  # fmt: skip


def test_produced_counts_no_token_past_a_stop():
    # An EOS first of a step whose path accepted 3: one token produced (the EOS), none returned.
    assert common.produced(_generation([3], 0, "eos")) == 1
    assert common.produced(_generation([1], 0, "eos")) == 1  # an engine that counts it right
    assert common.produced(_generation([0], 0, "eos")) == 0  # ... or leaves the EOS out
    assert common.produced(_generation([4, 4], 6, "max_new_tokens")) == 6  # cut at the limit
    assert common.produced(_generation([3, 2], 5, "context")) == 5


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
    assert s["rheo"]["average"]["tokens"] == 20 and s["ar"]["s"]["tokens"] == 20
    assert "speedup" not in common.summarize(records, None)["rheo"]["average"]


# --- table4 ----------------------------------------------------------------------------------


def test_draft_logits_along_a_sequence_match_the_drafter(engine, monkeypatch):
    # One matmul kernel for every row count: the sequence's rows and the drafter's prefixes
    # would otherwise run kernels chosen per row count, which round bf16 differently.
    monkeypatch.setenv("RHEO_LINEAR", "torch")
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


def _check_table4(data: dict, md: Path) -> None:
    for n in data["nodes"]:
        _check_node(table4.Node(n["acceptance"], n["law_error"], n["bound"], n["theorem3"]))
    s = data["summary"]
    assert s["nodes"] == len(data["nodes"])
    assert all(s["acceptance"][m] <= s["bound"] + 1e-9 for m in table4.VERIFY_METHODS)
    text = md.read_text()
    assert all(f"| {m} |" in text for m in table4.VERIFY_METHODS) and "upper bound" in text


def test_table4_default_pair_on_a_tiny_data_dir(context, data, tmp_path, capsys):
    out, md = tmp_path / "t4.json", tmp_path / "t4.md"
    result = table4.main(["--pair", "default", "--data", str(data), "--sets", "humaneval",
                          "--limit", "1", "--max-new-tokens", "3", "--out", str(out),
                          "--md", str(md)])  # fmt: skip
    assert json.loads(out.read_text())["summary"] == result["summary"]
    # The last prompt token and each generated one (the sequence may end early at an EOS).
    assert 1 <= len(result["nodes"]) <= 4
    assert result["conditions"]["prompts_cut_to"] == context - 3 - 1
    assert "# prompts: 0 of 1 cut" in capsys.readouterr().out
    _check_table4(result, md)


# --- ablations -------------------------------------------------------------------------------


def _run_ablations(flags: list[str], out_dir: Path) -> dict:
    grid = ["--leads-list", "0", "1", "--temperatures", "0", "1", "--supports", "16"]
    payloads = ablations.main([*flags, "--limit", "1", "--max-new-tokens", "4", *SMALL_TREE,
                               *grid, "--out-dir", str(out_dir), "--quiet"])  # fmt: skip
    assert ablations.decoder_module.Eagle3Drafter is Eagle3Drafter  # the recording hook is undone
    try:
        import matplotlib  # noqa: F401

        has_plots = True
    except ImportError:
        has_plots = False
    for which in ablations.ABLATIONS:
        stem = out_dir / f"ablation_{which}"
        data = json.loads(stem.with_suffix(".json").read_text())
        assert data["conditions"]["bench"] == f"ablation_{which}"
        assert stem.with_suffix(".md").read_text().startswith(f"# bench=ablation_{which} ")
        assert "tokens)" in stem.with_suffix(".md").read_text()  # tau beside its token count
        assert stem.with_suffix(".png").is_file() == has_plots
        assert payloads[which]["results"] == data["results"]
    m, T, S = (payloads[w]["results"] for w in ("m", "T", "S"))
    assert m["m"] == [0, 1] and len(m["rheo_tau"]) == 2 and len(m["rheo_tokens"]) == 2
    assert T["T"] == [0.0, 1.0] and T["topk_tau"][0] == T["rheo_tau"][0]  # T = 0: all greedy
    assert S["S"] == ["16", "full"]
    assert 0 < S["coverage"][0] < 1 and S["coverage"][1] == pytest.approx(1.0)
    assert all(ms > 0 for ms in S["draft_ms_per_step"])
    return payloads


def test_ablations_default_pair_on_a_tiny_data_dir(context, data, tmp_path):
    flags = ["--pair", "default", "--data", str(data), "--sets", "humaneval"]
    payloads = _run_ablations(flags, tmp_path)
    vocab = json.loads((DEFAULT / "draft" / "config.json").read_text())["draft_vocab_size"]
    assert payloads["S"]["results"]["support"] == [16, vocab]


# --- stories260K (extra checks: need ../shared) -----------------------------------------------


@pytest.fixture(scope="module")
def pair(stories_dir: Path, stories_head_dir: Path) -> list[str]:
    return ["--target", str(stories_dir), "--draft", str(stories_head_dir)]


def _e2e_stories_outputs_every_method_with_speedup(pair, tmp_path, capsys):
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    e2e.main([*pair, "--prompts", "stories", "--limit", "1", "--seeds", "2",
              "--max-new-tokens", "6", *SMALL_TREE, "--out", str(out), "--md", str(md),
              "--quiet"])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["conditions"]["bench"] == "e2e" and data["conditions"]["seeds"] == 2
    assert list(data["summary"]) == list(common.METHODS)
    for per_set in data["summary"].values():
        assert set(per_set) == {"stories", "average"}
        avg = per_set["average"]
        assert avg["tau_mean"] >= 1.0 and avg["tokens_per_s"] > 0 and avg["speedup"] > 0
    assert data["summary"]["ar"]["average"]["speedup"] == pytest.approx(1.0)
    # 2 seeds x 1 question x 4 methods; the order rotates by one per question.
    labels = [r["label"] for r in data["records"]]
    assert labels == ["ar", "topk", "rrsw", "rheo", "topk", "rrsw", "rheo", "ar"]
    assert all(r["new_tokens"] <= 6 and r["steps"] >= 1 for r in data["records"])
    assert "| method | stories τ | avg τ | tokens | tokens/s | speedup |" in md.read_text()
    assert "speedup" in capsys.readouterr().out  # the table is printed too


def _e2e_stories_question_sets_cut_long_prompts(pair, stories_dir):
    data = e2e.main([*pair, "--prompts", "questions", "--sets", "sum", "qa", "--limit", "1",
                     "--methods", "ar", "rheo", "--seeds", "1", "--max-new-tokens", "4",
                     *SMALL_TREE, "--quiet"])  # fmt: skip
    cond = data["conditions"]
    context = json.loads((stories_dir / "config.json").read_text())["max_position_embeddings"]
    assert cond["sets"] == ["sum", "qa"] and cond["questions_per_set"] == [1, 1]
    assert cond["prompts_cut"] == 1  # the CNN article is longer than stories260K's context
    assert cond["prompts_cut_to"] == context - 4 - 10
    assert set(data["summary"]["rheo"]) == {"sum", "qa", "average"}


def _table4_stories_on_real_contexts(pair, tmp_path):
    out, md = tmp_path / "t4.json", tmp_path / "t4.md"
    data = table4.main([*pair, "--prompts", "stories", "--limit", "1", "--max-new-tokens", "5",
                        "--out", str(out), "--md", str(md)])  # fmt: skip
    assert len(data["nodes"]) == 6  # the last prompt token and the 5 generated ones
    _check_table4(data, md)


def _ablations_stories_write_their_files(pair, tmp_path):
    payloads = _run_ablations([*pair, "--prompts", "stories"], tmp_path)
    assert payloads["S"]["results"]["support"] == [16, 512]


def test_benches_on_stories260K(pair, stories_dir, tmp_path, capsys):
    """One test for the four stories260K variants, so a clone without ../shared skips once:
    e2e on story openings and on question sets (a prompt cut to the context), table4 and the
    ablations on real contexts."""
    for sub in ("e2e", "t4"):
        (tmp_path / sub).mkdir()
    _e2e_stories_outputs_every_method_with_speedup(pair, tmp_path / "e2e", capsys)
    _e2e_stories_question_sets_cut_long_prompts(pair, stories_dir)
    _table4_stories_on_real_contexts(pair, tmp_path / "t4")
    _ablations_stories_write_their_files(pair, tmp_path / "ablations")


def test_throughput_and_batch_ops_quick():
    """bench/throughput.py and bench/batch_ops.py on the default pair, tiny settings."""
    run = _run_script(["bench/throughput.py", "--concurrency", "1,2", "--max-new-tokens", "4",
                       "--rounds", "1", "--prompt-tokens", "4"])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| rheo | 2 |" in run.stdout and "rheo / ar at concurrency 2:" in run.stdout
    run = _run_script(["bench/batch_ops.py", "--batches", "1,2", "--max-new-tokens", "6"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| ar | 2 |" in run.stdout and "| rheo | 1 |" in run.stdout
    bad = _run_script(["bench/throughput.py", "--concurrency", "0,2"])
    assert bad.returncode == 2 and "--concurrency" in bad.stderr and "Traceback" not in bad.stderr


def test_step_profile_counts_what_a_gpu_launches(tmp_path):
    """bench/step_profile.py on the default pair: a row per (method, static buffers); the
    static buffers launch fewer operators a step (the target's forward, the draft loop and the
    head's commit are a replay each), every
    step reads the host once (the verdict) beside the prefill's, and the markdown is written."""
    md = tmp_path / "profile.md"
    run = _run_script(["bench/step_profile.py", *SMALL_TREE, "--prompts", "2",
                       "--max-new-tokens", "12", "--md", str(md)])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("| ar |", "| rheo |"))]
    rows = {(r[0][2:], r[1]): r for r in (line.split(" | ") for line in lines)}
    assert set(rows) == {(m, g) for m in ("ar", "rheo") for g in ("off", "on")}, run.stdout
    ops = {k: float(r[4]) for k, r in rows.items()}
    reads = {k: float(r[5]) for k, r in rows.items()}
    for m in ("ar", "rheo"):
        assert ops[m, "on"] < ops[m, "off"] / 1.3, ops  # the forward's operators: one launch
        assert 1.0 <= reads[m, "on"] <= 2.0 and reads[m, "on"] == reads[m, "off"], reads
    # the draft loop and the head's commit are replays too: a rheo step launches a fraction
    assert ops["rheo", "on"] < 0.4 * ops["rheo", "off"], ops
    calls = {k: float(r[6]) for k, r in rows.items()}
    assert all(c > 50 for c in calls.values()), calls  # a step's own calls at least
    assert rows["ar", "off"][-1].startswith("1.00x")
    assert md.read_text().startswith("# bench=step_profile") and "| rheo | on |" in md.read_text()
    bad = _run_script(["bench/step_profile.py", "--graphs", "2"])
    assert bad.returncode == 2 and "--graphs" in bad.stderr and "Traceback" not in bad.stderr


def test_load_memory_measures_a_fresh_process():
    """bench/load_memory.py on the default pair: the RSS rows (loaded, after the tokens, the
    peak while loading, the peak) with their ratios to the weight files; bad input in one
    line."""
    run = _run_script(["bench/load_memory.py", "--pair", "default", "--tokens", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("# bench=load_memory")
    rows = [line.split(" | ") for line in run.stdout.splitlines()
            if line.startswith(("| loaded", "| after 2 tokens", "| peak"))]  # fmt: skip
    assert len(rows) == 4 and all(r[-1].endswith("x |") for r in rows), run.stdout
    loaded, _, loading, peak = (float(r[1]) for r in rows)
    assert loaded > 0 and peak >= loading >= loaded  # the peaks are peaks
    bad = _run_script(["bench/load_memory.py", "--tokens", "0"])
    assert bad.returncode == 2 and "--tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_policy_trace_files_every_step():
    """bench/policy_trace.py on the default pair at T = 0: the kinds' table and the run's line
    against plain steps; every counted step is plain or filed under a kind; bad input in one
    line."""
    run = _run_script(["bench/policy_trace.py", "--prompts", "2", "--max-new-tokens", "16",
                       "--temperature", "0"])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.startswith("# bench=policy_trace") and "| kind | nodes |" in out, out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| lookup")
            or line.startswith("| head") or line.startswith("| probe")]  # fmt: skip
    counts = next(line for line in out.splitlines() if line.startswith("steps "))
    steps, plain = int(counts.split()[1].rstrip(",")), int(counts.split()[3].rstrip(":"))
    assert plain + sum(int(r[3]) for r in rows) == steps, out
    assert "x** a run of plain steps" in out
    bad = _run_script(["bench/policy_trace.py", "--rounds", "1"])
    assert bad.returncode == 2 and "--rounds=1" in bad.stderr and "Traceback" not in bad.stderr


def test_first_answer_times_a_fresh_cache():
    """bench/first_answer.py on the default pair: the first call measures (its measure_s and
    parts > 0), the second reads what it measured (nothing measured); bad input in one line."""
    run = _run_script(["bench/first_answer.py", "--tokens", "4"])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| 1 ")
            or line.startswith("| 2 ")]  # fmt: skip
    assert len(rows) == 2, run.stdout
    first, second = ([float(v) for v in r[1:-1]] + [float(r[-1].rstrip(" |"))] for r in rows)
    assert first[1] > 0 and sum(first[2:]) > 0, run.stdout  # measured on the first call
    assert second[1] == 0 and sum(second[2:]) == 0, run.stdout  # and only then
    assert "first / second call: **" in run.stdout
    bad = _run_script(["bench/first_answer.py", "--calls", "1"])
    assert bad.returncode == 2 and "--calls=1" in bad.stderr and "Traceback" not in bad.stderr


def test_tp_quick(context, tmp_path):
    """bench/tp.py on the default pair, TP 1 vs 2, one run of 8 tokens: the tables print, the
    collectives per step are 2 all-reduces a layer and 1 logits gather, and the projection's
    draft head is bench/roofline.py's."""
    import roofline

    out = tmp_path / "tp.json"
    run = _run_script(["bench/tp.py", "--runs", "1", "--max-new-tokens", "8", "--json", str(out)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| rheo | T=1 | 2 |" in run.stdout and "### Llama-3.1-70B" in run.stdout
    data = json.loads(out.read_text())
    layers = json.loads((DEFAULT / "target" / "config.json").read_text())["num_hidden_layers"]
    ar = data["summary"]["ar T=0"]["2"]
    assert ar["all_reduce_calls"] == 2 * layers and ar["gather_calls"] == 1
    assert data["summary"]["ar T=0"]["1"]["all_reduce_calls"] == 0
    assert (
        data["counts"]["all_reduces_per_layer"] == 2 and data["counts"]["gathers_per_forward"] == 1
    )
    tree = [p for p in data["projection"]["Llama-3.1-8B"] if p["rows"] == 60 and p["n"] == 8]
    assert tree[0]["head_s"] == pytest.approx(roofline.head_floor(1, 1024))


# --- bench/lookup.py: the per-category table of prompt lookup --------------------------------


def test_lookup_bench_table_on_the_default_pair(tmp_path, capsys):
    import lookup

    out, md = tmp_path / "lookup.json", tmp_path / "lookup.md"
    payload = lookup.main(["--pair", "default", "--categories", "extraction", "coding",
                           "--limit", "1", "--max-new-tokens", "8", "--configs", "ar", "lookup",
                           "both", "--out", str(out), "--md", str(md)])  # fmt: skip
    summary = payload["summary"]
    assert set(summary) == {"extraction", "coding", "all"}
    for cat in summary.values():
        assert cat["ar_tokens_per_s"] > 0
        assert cat["lookup"]["tau"] >= 1.0 and cat["lookup"]["speed"] > 0
    table = md.read_text()
    assert table.startswith("# bench=lookup ") and "| **all** |" in table
    assert "lookup speed" in table and "both τ" in table
    with pytest.raises(SystemExit):
        lookup.main(["--configs", "lookup"])  # no baseline: one line, exit 2
    assert "--configs must include ar" in capsys.readouterr().err
