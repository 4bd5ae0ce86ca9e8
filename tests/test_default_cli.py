"""The CLI contract on the default pair (weights/default, no model flags): --json prints one
object with the documented fields, streaming prints the text the API generates and one stats
line on stderr, and bad input exits 2 with one line on stderr and no traceback.

The CLI's own flags, files and spelling of errors are tests/test_cli.py's; this file pins what
the README promises a user of the embedded pair, through rheo_engine.entrypoints.generate.main.
"""

from __future__ import annotations

import io
import json
import re

import pytest

from rheo_engine import Engine
from rheo_engine.entrypoints.generate import main as generate_main

PROMPT = "def quicksort(xs):"
JSON_FIELDS = {"text", "token_ids", "method", "steps", "mean_accept_length", "tokens_per_s",
               "wall_s", "stop_reason", "draft_s", "head_s", "target_s", "verify_s", "commit_s",
               "tree", "trees", "step_measured_s", "step_predicted_s", "steps_priced"}  # fmt: skip


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m rheo_engine.generate ARGS``."""
    try:
        code = generate_main(["--threads", "1", *args])
    except SystemExit as exit_:  # argparse's way out, should main let it through
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_has_the_documented_fields(engine, capsys):
    code, out, err = cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature",
                         "0", "--json", "--tree", "fixed")  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1, "--json prints exactly one object per prompt"
    got = json.loads(lines[0])
    assert JSON_FIELDS <= set(got), JSON_FIELDS - set(got)
    assert got["method"] == "rheo" and got["stop_reason"] == "max_new_tokens"
    # The CLI is the API: the same defaults (rheo, the default tree), the same tokens.
    want = engine.generate(PROMPT, 12, temperature=0, tree="fixed")
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["steps"] == want.steps and got["mean_accept_length"] > 1
    assert "tau" in err and "tokens/s" in err
    assert got["tree"] == "fixed" and sum(got["trees"].values()) == got["steps"]


def test_auto_tree_reports_its_trees(capsys, tmp_path):
    """The default tree is auto: the stats line names the trees used and the predicted and
    measured step times; --cost-profile writes the measured profile."""
    profile = tmp_path / "profile.json"
    code, out, err = cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature",
                         "0", "--json", "--cost-profile", str(profile))  # fmt: skip
    assert code == 0 and profile.is_file()
    got = json.loads(out)
    assert got["tree"] == "auto" and sum(got["trees"].values()) == got["steps"]
    assert got["step_predicted_s"] > 0 and got["step_measured_s"] > 0
    assert 0 < got["steps_priced"] <= got["steps"]
    code, out, err = cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature",
                         "0", "--cost-profile", str(profile))  # fmt: skip
    assert "auto trees N=" in err and "ms predicted" in err


def test_streams_the_text_then_one_stats_line(engine, capsys):
    code, out, err = cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "12", "--seed", "1",
                         "--method", "topk", "--tree", "fixed")  # fmt: skip
    assert code == 0
    gen = engine.generate(PROMPT, 12, method="topk", seed=1, tree="fixed")
    assert out == gen.text + "\n"
    (stats,) = err.splitlines()
    assert stats.startswith("[topk] 12 tokens in") and "tau" in stats and "tokens/s" in stats


def test_reads_prompts_from_stdin(engine, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):\nimport os\n"))
    code, out, err = cli(capsys, "--max-new-tokens", "4", "--temperature", "0", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["token_ids"] for r in rows] == [
        engine.generate(p, 4, temperature=0).token_ids for p in ("def f(x):", "import os")
    ]
    assert len(err.splitlines()) == 2  # a stats line per prompt


@pytest.mark.parametrize(
    "args, names",
    [
        (["--top-p", "2"], "top.p"),
        (["--temperature", "-1"], "temperature"),
        (["--total-tokens", "100000"], "total.tokens"),
        (["--max-new-tokens", "0"], "max.new.tokens"),
        (["--threads", "0"], "threads"),
        (["--method", "beam"], "method"),
        (["--target", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, names):
    code, out, err = cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "4", *args)
    assert code == 2, (args, code, err)
    assert out == ""
    (line,) = err.splitlines()  # one line, no traceback
    assert line.startswith("error: ") and "Traceback" not in err
    assert re.search(names, line), line
