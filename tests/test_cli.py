"""`python -m rheo_engine.generate` (and the converters' CLI) at the edges: seeds, devices,
prompts from stdin and files, the thread default, and bad input, which always ends in one line
on stderr in the CLI's own spelling (--max-new-tokens, not max_new_tokens=), never a traceback.

In-process through main([...]) with capsys on the default pair (it loads in milliseconds);
a closed pipe and Ctrl-C with real subprocesses.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rheo_engine.entrypoints.generate import API_OPTIONS, cli_spelling, flag, main, parser
from rheo_engine.io.convert import main as convert_main
from rheo_engine.machine import ONE_THREAD_BELOW_PARAMS, default_threads
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine, Request

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft"
PROMPT = "def quicksort(xs):"
FEW = ["--max-new-tokens", "4"]
# What the Python API would say: name=value for one of its options (the CLI must not).
API_SPELLING = re.compile(rf"(?<![\w-])({'|'.join(API_OPTIONS)})=")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The single line of a bad-input exit, with no API spelling and no traceback in it."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not API_SPELLING.search(err), err
    return lines[0]


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


# --- seeds -----------------------------------------------------------------------------------


def test_seed_minus_one_is_fresh_reported_and_reproduces_the_run(capsys):
    code, out, err = run(capsys, "--prompt", PROMPT, *FEW, "--seed", "-1", "--json")
    first = json_lines(out)[0]
    assert code == 0 and 0 <= first["seed"] < 2**64
    assert f"seed {first['seed']}," in err  # the stats line says it too
    code, out, _ = run(capsys, "--prompt", PROMPT, *FEW, "--seed", str(first["seed"]), "--json")
    again = json_lines(out)[0]
    assert code == 0 and again["seed"] == first["seed"]
    assert again["token_ids"] == first["token_ids"]
    _, out, _ = run(capsys, "--prompt", PROMPT, *FEW, "--json")  # the default is -1
    assert json_lines(out)[0]["seed"] != first["seed"]  # 1 in 2**64 to collide


@pytest.mark.parametrize("seed", ["-2", str(2**64), str(-(2**70))])
def test_seeds_outside_the_range_are_one_line_errors(capsys, seed):
    code, out, err = run(capsys, "--prompt", PROMPT, "--seed", seed)
    assert code == 2 and not out
    assert f"error: --seed {seed} is outside [0, 2**64)" in one_error_line(err)


# --- every error path speaks the CLI's spelling --------------------------------------------


def test_every_api_option_is_a_flag():
    """API_OPTIONS (what cli_spelling translates) are exactly the options of the API calls the
    CLI makes, and each is a flag of the parser under the same name."""
    request = set(inspect.signature(Request.__init__).parameters) - {"self", "ctx", "prompt", "run"}
    loading = set(inspect.signature(Engine.from_pretrained).parameters) - {"cls"}
    assert set(API_OPTIONS) == request | loading
    flags = {s for action in parser()._actions for s in action.option_strings}
    assert {flag(name) for name in API_OPTIONS} <= flags


@pytest.mark.parametrize(
    "api, cli",
    [
        ("method='ar'", "--method ar"),
        ("with draft=DIR or use method='ar'", "with --draft DIR or use --method ar"),
        ("draft= was given without target=; pass", "--draft was given without --target; pass"),
        ("max_new_tokens=0 must be >= 1", "--max-new-tokens 0 must be >= 1"),
        ("max_new_tokens must be an int", "--max-new-tokens must be an int"),
        ("support=8 < topk=10: raise support=", "--support 8 < --topk 10: raise --support"),
        ("seed=-5 is outside", "--seed -5 is outside"),
        ("such as seed=0.", "such as --seed 0."),
        ("device='cuda:1' is not available", "--device cuda:1 is not available"),
        ("device='a b'", "--device 'a b'"),
        ("chat=True needs a template", "--chat needs a template"),
        ("pick one (or pass dtype= when loading)", "pick one (or pass --dtype when loading)"),
        # Not options: config fields, words inside paths, a formula.
        ("torch_dtype='int8' in /top_p/config.json", "torch_dtype='int8' in /top_p/config.json"),
        ("head target_hidden_size=16 != 32", "head target_hidden_size=16 != 32"),
        ("1 + topk + (depth - 1) * topk^2", "1 + topk + (depth - 1) * topk^2"),
        ("line one\nline two", "line one line two"),
        # The chat templates' prose (io/tokenizer.py); a JSON file's field stays as it is.
        ("D has no chat template (no chat_template in tokenizer_config.json, no "
         "chat_template.jinja) and no built-in fits its vocabulary; pass template= one of "
         "vicuna_v1.1, llama-3, or use encode",
         "D has no chat template (no chat_template in tokenizer_config.json, no "
         "chat_template.jinja) and no built-in fits its vocabulary; pass --chat-template with one "
         "of vicuna_v1.1, llama-3, or drop --chat"),
        ("chat template 'llama-3' needs a tiktoken tokenizer, but T is sentencepiece; use "
         "'vicuna_v1.1'", "--chat-template llama-3 needs a tiktoken tokenizer, but T is "
                          "sentencepiece; use --chat-template vicuna_v1.1"),
        # Alternatives: both flags, the slash kept.
        ("pass pair= or target=/draft=, not both", "pass --pair or --target/--draft, not both"),
    ],
)  # fmt: skip
def test_cli_spelling(api, cli):
    assert cli_spelling(api) == cli


@pytest.fixture(scope="module")
def other_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer target with the default pair's tokenizer: the default head is not for it."""
    from rheo_engine.config import ModelConfig
    from rheo_engine.io.weights import save_safetensors
    from rheo_engine.models.llama import expected_shapes

    d = tmp_path_factory.mktemp("four_layers")
    config = json.loads((TARGET / "config.json").read_text()) | {"num_hidden_layers": 4}
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer.model").write_bytes((TARGET / "tokenizer.model").read_bytes())
    g = torch.Generator().manual_seed(0)
    shapes = expected_shapes(ModelConfig.from_dict(config))
    weights = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    save_safetensors(weights, d / "model.safetensors")
    return d


# Each error path the CLI can reach, with what its one line must say.
BAD_INPUT = [
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--temperature", "-1"], "--temperature -1.0 must be"),
    (["--top-p", "2"], "--top-p 2.0 must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k -2 must be >= 0"),
    (["--topk", "0"], "--topk 0 must be >= 1"),
    (["--depth", "0"], "--depth 0 must be >= 1"),
    (["--total-tokens", "0"], "--total-tokens 0 must be >= 1"),
    (["--total-tokens", "5000"], "lower --total-tokens to at most 711, or raise --depth or --topk"),
    (["--leads", "10"], "--leads 10 must be in [0, --topk 10)"),
    (["--support", "2"], "--support 2 < --topk 10"),
    (["--seed", "-3"], "--seed -3 is outside"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
    (["--device", "bogus"], "--device bogus is not a device name torch knows; available: cpu"),
    (["--device", "cuda:7"], "--device cuda:7 is not available"),
    (["--draft", str(DRAFT)], "--draft was given without --target"),
    (["--target", str(TARGET), "--drafts", "head"], "--drafts head needs a draft head and none "
                                                    "is loaded; load one with --draft DIR, or "
                                                    "draft from the context with --drafts lookup"),
    (["--drafts", "trie"], "argument --drafts: invalid choice: 'trie'"),
    (["--target", "/nowhere"], "model directory /nowhere not found"),
    (["--target", str(TARGET / "config.json")], "is a file, not a directory"),
    (["--target", str(DRAFT)], "is an EAGLE-3 head's (architectures=['LlamaForCausalLMEagle3']), "
                               "not a Llama target's; pass the head as --draft DIR and its target "
                               "as --target DIR"),
    (["--target", str(TARGET), "--draft", "/nowhere"], "head directory /nowhere not found; pass "
                                                       "the head's directory as --draft DIR"),
    (["--method", "beam"], "argument --method: invalid choice: 'beam'"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--prompt-file", "x.txt"], "--prompt and --prompt-file were both given"),
]  # fmt: skip


@pytest.mark.parametrize("argv, says", BAD_INPUT, ids=[" ".join(a[:2]) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_in_cli_spelling(capsys, argv, says):
    code, out, err = run(capsys, "--prompt", PROMPT, *FEW, *argv)
    assert code == 2 and not out
    assert says in one_error_line(err)


def test_a_head_for_another_target_in_cli_spelling(capsys, other_target):
    code, _, err = run(capsys, "--target", str(other_target), "--draft", str(DRAFT), "--prompt",
                       "x")  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "for a target with num_hidden_layers=4 (" in line
    assert "): the head belongs to another target" in line
    assert "(--draft DIR) or load the head's own target (--target DIR)" in line


def test_a_prompt_longer_than_the_context(capsys, tmp_path):
    from rheo_engine.io.tokenizer import Tokenizer

    context = json.loads((TARGET / "config.json").read_text())["max_position_embeddings"]
    text = "import os\n" * context
    assert len(Tokenizer.from_dir(TARGET).encode(text, bos=True)) > context
    (tmp_path / "long.py").write_text(text)
    code, out, err = run(capsys, "--prompt-file", str(tmp_path / "long.py"), *FEW)
    assert code == 2 and not out
    assert f"the target's context is {context}; shorten the prompt" in one_error_line(err)


def test_broken_config_in_cli_spelling(capsys, tmp_path):
    (tmp_path / "config.json").write_text(
        (TARGET / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 8', '"num_hidden_layers": "eight"')  # fmt: skip
    )
    code, _, err = run(capsys, "--target", str(tmp_path), "--method", "ar", "--prompt", "x")
    assert code == 2
    assert '"num_hidden_layers": "eight" is a string but must be an integer' in one_error_line(err)


def test_help_and_the_total_tokens_1_promise(capsys, monkeypatch):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "1 = the root alone: a plain autoregressive run" in " ".join(out.split())
    assert "with no draft-head forwards" in " ".join(out.split())

    def no_head(*args, **kwargs):
        raise AssertionError("--total-tokens 1 ran a draft-head forward")

    monkeypatch.setattr(Eagle3Head, "layer", no_head)
    monkeypatch.setattr(Eagle3Head, "layer_in_pool", no_head)
    monkeypatch.setattr(Eagle3Head, "fuse", no_head)
    code, out, _ = run(capsys, "--prompt", PROMPT, *FEW, "--total-tokens", "1", "--json")
    gen = json_lines(out)[0]
    assert code == 0 and gen["method"] == "rheo" and gen["mean_accept_length"] == 1.0


# --- prompts: stdin lines and --prompt-file -------------------------------------------------


def test_stdin_answers_every_line_blank_ones_too(capsys, monkeypatch):
    lines = ["def f(x):", "", "import os", ""]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, err = run(capsys, "--method", "ar", *FEW, "--json", "--seed", "3")
    results = json_lines(out)
    assert code == 0 and [r["prompt"] for r in results] == lines
    assert all(r["token_ids"] and r["seed"] == 3 for r in results)
    assert results[1]["token_ids"] == results[3]["token_ids"]  # BOS alone, same seed
    assert len(err.splitlines()) == len(lines)  # a stats line each
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\n\nb"))  # no final newline
    code, out, err = run(capsys, "--method", "ar", *FEW)
    assert code == 0 and len(err.splitlines()) == 3


def test_prompt_file_is_the_whole_file(capsys, tmp_path):
    text = 'def add(a, b):\n    """Return a + b."""\n    return'
    f = tmp_path / "prompt.py"
    f.write_text(text, encoding="utf-8")
    code, out, _ = run(capsys, "--prompt-file", str(f), *FEW, "--json", "--method", "ar")
    assert code == 0 and json_lines(out)[0]["prompt"] == text


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "not found; pass the path of a UTF-8 text file"),
        ("dir", "is a directory"),
        (b"caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8"),
        (b"\x7fELF\x00\x01", "holds a NUL character at offset 4: it is a binary file"),
    ],
)
def test_bad_prompt_files(capsys, tmp_path, content, says):
    f = tmp_path / "p"
    if content == "dir":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content)
    code, out, err = run(capsys, "--prompt-file", str(f), *FEW)
    assert code == 2 and not out and says in one_error_line(err)


def test_stdin_that_is_not_utf8(capsys, monkeypatch):
    raw = io.TextIOWrapper(io.BytesIO(b"fine\n\xff\xfe\n"), "utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", raw)
    code, out, err = run(capsys, "--method", "ar", *FEW, "--json")
    assert code == 2 and len(out.splitlines()) == 1  # the good first line was answered
    assert "stdin line 2 is not UTF-8 text" in one_error_line(err.splitlines()[-1])


# --- threads ---------------------------------------------------------------------------------


def test_thread_default_and_report(capsys):
    torch.set_num_threads(2)  # as torch's default on a 2-core machine
    assert default_threads(6_852_864) == 1  # the default target's size
    assert default_threads(ONE_THREAD_BELOW_PARAMS) == 2
    code, out, _ = run(capsys, "--prompt", PROMPT, *FEW, "--json")
    assert code == 0 and json_lines(out)[0]["threads"] == 1
    assert torch.get_num_threads() == 2  # main() puts the caller's setting back
    code, _, err = run(capsys, "--prompt", PROMPT, *FEW, "--threads", "2", "--method", "ar")
    assert code == 0 and ", threads 2 (" in err


def test_the_python_api_chooses_threads_and_leaves_the_callers():
    """Engine.from_pretrained chooses CPU threads as the CLI does (one below 1B target
    parameters: at torch's default a shared 2-core machine ran the README snippet 30x slower)
    and says so in engine.threads and repr; threads=N chooses. The engine computes on them
    and leaves the caller's torch.set_num_threads as it was (issue 28: it used to set it
    process-wide at load)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on a 2-core machine, or a caller's choice
        engine = Engine.from_pretrained()
        assert engine.threads == 1 and torch.get_num_threads() == 2
        assert repr(engine) == ("Engine(pair='default', dtype=bfloat16, device='cpu', "
                                "threads=1, head=True, context=1024)")  # fmt: skip
        engine.generate(PROMPT, 4, temperature=0)  # the auto tree measures this machine
        assert torch.get_num_threads() == 2
        keys = list(engine.cost_profiles)  # each names the threads it was measured on
        assert keys and all(" 1 threads" in key for key in keys), keys
        for _ in engine.stream(PROMPT, 2):
            assert torch.get_num_threads() == 2  # between steps, the caller's count
        two = Engine.from_pretrained(DEFAULT_PAIR / "target", threads=2, dtype=torch.float32)
        assert two.threads == 2 and torch.get_num_threads() == 2
        assert repr(two) == ("Engine(pair='default', dtype=float32, device='cpu', threads=2, "
                             "head=False, context=1024)")  # fmt: skip
        with pytest.raises(ValueError, match=r"threads=0 must be an int >= 1"):
            Engine.from_pretrained(threads=0)
    finally:
        torch.set_num_threads(before)


# --- a closed pipe and Ctrl-C: real processes ------------------------------------------------


def _generate(*argv: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "rheo_engine.entrypoints.generate", "--method", "ar", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, **popen)


def _no_traceback(err: str) -> None:
    for sign in ("Traceback", "Exception ignored", "BrokenPipeError", "KeyboardInterrupt"):
        assert sign not in err, err


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_output_into_head_ends_quietly(tmp_path, mode):
    """`... | head -n 2`: head exits after two lines while prompts remain, so the next write
    hits a closed pipe (EPIPE); the CLI ends with 141 and says nothing about it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f():\n" * 200)
    with prompts.open() as stdin:
        gen = _generate("--max-new-tokens", "8", *mode, stdin=stdin, stdout=subprocess.PIPE)
        head = subprocess.Popen(["head", "-n", "2"], stdin=gen.stdout, stdout=subprocess.PIPE)
        gen.stdout.close()  # head alone holds the read end now
        out, _ = head.communicate(timeout=120)
        err = gen.stderr.read().decode()
        assert gen.wait(timeout=120) == 141, err
    assert len(out.splitlines()) == 2
    _no_traceback(err)
    assert len(err.splitlines()) < 200  # it stopped early


def test_ctrl_c_prints_the_stats_so_far(tmp_path):
    """SIGINT once the first text is out: exit 130 with the interrupted request's stats line.
    The greedy continuation of a function header is its body, 64 tokens of it, so the first
    request is still generating when the signal lands."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n" * 200)
    with prompts.open() as stdin:
        gen = _generate("--max-new-tokens", "64", "--temperature", "0", "--seed", "7",
                        stdin=stdin, stdout=subprocess.PIPE)  # fmt: skip
        first = os.read(gen.stdout.fileno(), 1)
        gen.send_signal(signal.SIGINT)
        out, err = gen.communicate(timeout=120)
    err = err.decode()
    assert first and gen.returncode == 130, err
    _no_traceback(err)
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"\[ar\] interrupted: \d+ tokens in \d+ steps, tau 1\.00, [\d.]+ tokens/s, seed 7, "
        r"threads 1",
        last,
    ), last


def test_ctrl_c_while_starting_or_before_any_token_is_one_line(tmp_path):
    """SIGINT while torch imports (the first second) and while the CLI waits for its first
    prompt on stdin: exit 130 and one line on stderr, no traceback."""
    gen = _generate("--prompt", "hi", stdout=subprocess.PIPE)
    # Past the interpreter's own start (site, .pth files: ~0.1-0.2 s here, where a SIGINT is
    # Python's, not ours) and inside torch's import (~1-1.5 s).
    time.sleep(0.5)
    gen.send_signal(signal.SIGINT)
    _, err = gen.communicate(timeout=60)
    assert gen.returncode == 130 and err.decode().strip() == "interrupted while starting", err
    read_fd, write_fd = os.pipe()  # a prompt that never comes: the CLI waits on stdin
    gen = _generate(stdin=read_fd, stdout=subprocess.PIPE)
    os.close(read_fd)
    try:
        time.sleep(6)  # past the imports (usually) and the load, into the wait on stdin
        gen.send_signal(signal.SIGINT)
        _, err = gen.communicate(timeout=60)
    finally:
        os.close(write_fd)
    err = err.decode()
    assert gen.returncode == 130, err
    _no_traceback(err)
    assert err.strip().splitlines()[-1] in (
        "interrupted before any token was generated",
        "interrupted while starting",
    )


# --- the converters' CLI ---------------------------------------------------------------------


def test_converter_errors_are_one_line(capsys, tmp_path):
    (tmp_path / "keep").write_text("an OUT_DIR that is in use")
    cases = [
        (convert_main, ["llama2c", str(tmp_path / "no.bin"), "tok.model", str(tmp_path / "o")],
         "llama2.c checkpoint .*no.bin not found"),
        (convert_main, ["llama2c", str(tmp_path), "tok.model", str(tmp_path / "o")],
         "is a directory"),
        (convert_main, ["eagle3", str(tmp_path / "none"), str(tmp_path / "o")],
         "EAGLE-3 head directory not found"),
        (convert_main, ["bogus"], "invalid choice: 'bogus'"),
        (convert_main, ["llama2c"], "the following arguments are required"),
        (convert_main, ["eagle3", str(DRAFT), str(tmp_path)], "exists and is not empty"),
        (convert_main, ["eagle3"], "the following arguments are required"),
    ]  # fmt: skip
    for cli, argv, says in cases:
        assert cli(argv) == 2
        out, err = capsys.readouterr()
        assert not out and re.search(says, one_error_line(err)), (argv, err)


def test_converter_as_a_process_has_no_traceback(tmp_path):
    cmd = [sys.executable, "-m", "rheo_engine.io.convert", "llama2c", "no.bin", "t.model", "o"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: llama2.c checkpoint no.bin")
    _no_traceback(done.stderr)


# --- sampling controls, stop strings, logprobs --------------------------------------------------


def test_stop_string_is_held_back_and_cut(capsys):
    code, out, _ = run(capsys, "--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "0",
                       "--json")  # fmt: skip
    full = json_lines(out)[0]["text"]
    stop = full[6:9]
    code, out, err = run(capsys, "--prompt", PROMPT, "--max-new-tokens", "24", "--temperature",
                         "0", "--stop", "never there", "--stop", stop)  # fmt: skip
    assert code == 0 and out == full[: full.index(stop)] + "\n"
    assert "stop: stop)" in err
    code, out, _ = run(capsys, "--prompt", PROMPT, "--max-new-tokens", "24", "--temperature",
                       "0", "--stop", stop, "--json")  # fmt: skip
    got = json_lines(out)[0]
    assert got["text"] == full[: full.index(stop)] and got["stop_string"] == stop


def test_json_logprobs_and_sampling_sources(capsys):
    code, out, err = run(capsys, "--prompt", PROMPT, *FEW, "--seed", "3", "--json", "--logprobs",
                         "--top-logprobs", "2", "--repetition-penalty", "1.2", "--min-p",
                         "0.05")  # fmt: skip
    got = json_lines(out)[0]
    assert code == 0 and len(got["logprobs"]) == len(got["token_ids"]) == 4
    assert [lp["token"] for lp in got["logprobs"]] == got["token_ids"]
    for lp in got["logprobs"]:  # min-p may leave fewer than 2 tokens possible: only those listed
        tops = [t["logprob"] for t in lp["top_logprobs"]]
        assert 1 <= len(tops) <= 2 and tops == sorted(tops, reverse=True)
        assert lp["logprob"] <= tops[0] <= 0
    assert got["sampling"]["repetition_penalty"] == 1.2 and got["sampling"]["min_p"] == 0.05
    assert got["sampling_sources"]["repetition_penalty"] == "request"
    assert got["sampling_sources"]["temperature"] == "default"  # no generation_config.json
    assert "T 1 (default)" in err and "repetition_penalty 1.2" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--min-p", "1"], "--min-p 1.0 must be in [0, 1)"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0.0 must be > 0"),
        (["--presence-penalty", "nan"], "--presence-penalty nan must be a finite number"),
        (
            ["--stop", ""],
            '--stop "" would match before any text; omit --stop for no stop '
            "strings, or give it non-empty text",
        ),
        (["--stop", "a", "--stop", ""], '--stop "" would match before any text'),
        (["--min-new-tokens", "9"], "--min-new-tokens 9 exceeds --max-new-tokens 4"),
        (["--top-logprobs", "2", "--json"], "--top-logprobs 2 needs --logprobs"),
        (["--logprobs"], "--logprobs is reported in the JSON output only; add --json"),
    ],
)
def test_bad_controls_in_cli_spelling(capsys, argv, says):
    code, out, err = run(capsys, "--prompt", PROMPT, *FEW, *argv)
    assert code == 2 and not out
    assert says in one_error_line(err)


# --- every flag that mirrors an API option is named as typed --------------------------------

# (argv, what the one line says): the flag as the user typed it, never the Python keyword
# (max_new_tokens=), a Python value (None, True) or an API-only remedy (use encode).
FLAGS_AS_TYPED = [
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--max-new-tokens", "-1"], "--max-new-tokens -1 must be >= 1"),
    (["--min-new-tokens", "-1"], "--min-new-tokens -1 must be >= 0"),
    (["--top-k", "-1"], "--top-k -1 must be >= 0; use 0 to disable"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--min-p", "-1"], "--min-p -1.0 must be in [0, 1)"),
    (["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0 (0 = greedy)"),
    (["--temperature", "nan"], "--temperature nan must be a finite number"),
    (["--frequency-penalty", "inf"], "--frequency-penalty inf must be a finite number"),
    (["--repetition-penalty", "-1"], "--repetition-penalty -1.0 must be > 0"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--seed", "-2"], "--seed -2 is outside [0, 2**64)"),
    (["--top-k", "1.5"], "argument --top-k: invalid int value: '1.5'"),
    (["--top-logprobs", "21", "--logprobs", "--json"], "--top-logprobs 21 must be <= 20"),
    (["--topk", "-1"], "--topk -1 must be >= 1"),
    (["--topk", "300"], "--support 128 < --topk 300"),
    (["--leads", "-1"], "--leads -1 must be in [0, --topk 10)"),
    (["--stop", ""], '--stop "" would match before any text; omit --stop'),
    (["--no-chat", "--chat-template", "bogus"], "--chat-template bogus is for chat prompts; "
                                                "pass --chat"),
    (["--chat", "--chat-template", "bogus"], "--chat-template bogus is unknown; known: "
                                             "vicuna_v1.1, llama-3 (base models take raw text: "
                                             "drop --chat)"),
    (["--chat", "--chat-template", "llama-3"], "--chat-template llama-3 needs a tiktoken "
                                               "tokenizer, but "),
    (["--chat", "--chat-template", "llama-3"], "; use --chat-template vicuna_v1.1"),
    (["--cost-profile", "/"], "--cost-profile / is a directory; pass the path of a JSON file"),
    (["--cost-profile", "/nowhere/profile.json"], "--cost-profile /nowhere/profile.json: "
                                                  "folder /nowhere not found"),
    (["--cost-profile", str(TARGET / "config.json")], f"--cost-profile {TARGET}/config.json: "
                                                      "cannot read it"),
    (["--pair", "default", "--target", str(TARGET)], "--pair default names a target and a "
                                                     "head; pass --pair or --target/--draft, "
                                                     "not both"),
    (["--device", "cuda:7"], "--device cuda:7 is not available"),
]  # fmt: skip
_PYTHON_SPELLING = re.compile(
    rf"(?<![\w-])({'|'.join(n for n in API_OPTIONS if '_' in n)})(?![\w-])|\bNone\b|\bTrue\b"
    r"|use encode|template="
)


@pytest.mark.parametrize("argv, says", FLAGS_AS_TYPED, ids=[" ".join(a) for a, _ in FLAGS_AS_TYPED])
def test_flags_are_named_as_typed(capsys, argv, says):
    code, out, err = run(capsys, "--prompt", PROMPT, *FEW, *argv)
    line = one_error_line(err)
    assert code == 2 and not out and says in line, line
    assert not _PYTHON_SPELLING.search(line), line


def test_chat_follows_the_model_and_a_named_template(capsys):
    """Engine.request's rule (runtime/engine.py, default_chat) in the CLI: a base target (the
    default pair) takes raw text, --chat-template alone makes a chat (it was an error without
    --chat), --no-chat opts out."""
    engine = Engine.from_pretrained(TARGET)
    options = dict(temperature=0, method="ar")
    raw = engine.generate(PROMPT, 4, chat=False, **options).token_ids
    chat = engine.generate(PROMPT, 4, chat=True, chat_template="vicuna_v1.1", **options).token_ids
    assert raw != chat and engine.generate(PROMPT, 4, **options).token_ids == raw
    cases = [([], raw), (["--chat-template", "vicuna_v1.1"], chat), (["--no-chat"], raw),
             (["--chat"], chat)]  # fmt: skip
    for argv, want in cases:
        code, out, err = run(capsys, "--target", str(TARGET), "--prompt", PROMPT, *FEW,
                             "--temperature", "0", "--method", "ar", "--json", *argv)  # fmt: skip
        assert code == 0, err
        assert json.loads(out.splitlines()[0])["token_ids"] == want, argv


# --- issue 28: flags checked before the model loads, limits said, progress, --quiet ---------


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
    (["--top-p", "2"], "--top-p 2.0 must be in (0, 1]"),
    (["--seed", "-5"], "--seed -5 is outside [0, 2**64)"),
    (["--topk", "0"], "--topk 0 must be >= 1"),
    (["--depth", "100"], "--depth 100 cannot be reached: a tree of --total-tokens 60 holds at "
                         "most 59 levels"),
])  # fmt: skip
def test_flags_checked_before_the_model_loads(capsys, monkeypatch, flags, says):
    def no_load(*_, **__):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    assert main(["--prompt", PROMPT, *flags]) == 2
    assert says in one_error_line(capsys.readouterr().err)


def test_max_new_tokens_over_the_context(capsys):
    context = json.loads((TARGET / "config.json").read_text())["max_position_embeddings"]
    assert main(["--prompt", PROMPT, "--max-new-tokens", "100000"]) == 2
    assert (f"--max-new-tokens 100000 does not fit the target's context of {context} tokens"
            in one_error_line(capsys.readouterr().err))  # fmt: skip
    assert main(["--prompt", PROMPT, "--max-new-tokens", str(context - 1), "--method", "ar",
                 "--stop", "\n"]) == 0  # fmt: skip


def test_progress_after_a_second_and_quiet(capsys, monkeypatch):
    import sys as system
    import time as clock

    from rheo_engine.entrypoints.generate import shown

    with shown("loading a slow model"):  # stderr is not a terminal here: nothing shown
        clock.sleep(1.5)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(system.stderr, "isatty", lambda: True, raising=False)
    with shown("loading a slow model"):
        clock.sleep(1.5)
    assert "loading a slow model: 00:01" in capsys.readouterr().err
    with shown("loading a quick model"):
        clock.sleep(0.2)
    with shown("loading a slow model", quiet=True):
        clock.sleep(1.5)
    assert capsys.readouterr().err == ""


def test_measurements_are_shown(monkeypatch, tmp_path):
    """The engine's first-use measurements (tree costs, lookup costs) go through the progress
    hook, which the CLI shows unless --quiet."""
    from rheo_engine.entrypoints.generate import progress_shown
    from rheo_engine.runtime import decoder, progress

    monkeypatch.setattr(decoder, "cached_costs", lambda key: None)
    monkeypatch.setattr(decoder, "cached_profile", lambda key: None)
    seen = []

    def spy(what):
        seen.append(what)
        return contextlib.nullcontext()

    progress.set_display(spy)
    try:
        engine = Engine.from_pretrained(TARGET, DRAFT, threads=1)
        engine.generate("def f(x):", 4, temperature=0, drafts="both")  # (lookup: from its costs)
        engine.generate("def f(x):", 4, temperature=0, drafts="lookup")
    finally:
        progress.set_display(None)
    assert any("step costs" in w for w in seen) and any("lookup" in w for w in seen), seen
    with progress_shown(quiet=True):
        assert progress._display is None
    with progress_shown(quiet=False):
        assert progress._display is not None


def test_smollm2_ships_its_sampling_defaults(tmp_path):
    """The head's generation_config.json fills what a target lacks (a GGUF file: no sampling
    values), and the stats line says generation_config.json."""
    from rheo_engine.io.generation_config import GenerationDefaults
    from rheo_engine.runtime.engine import _head_defaults
    from rheo_engine.runtime.pairs import PAIRS

    head = PAIRS["smollm2"].draft()
    shipped = GenerationDefaults.from_dir(head)
    assert (shipped.temperature, shipped.top_p) == (0.2, 0.9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7, "top_p": 0.5}')
    target = GenerationDefaults.from_dir(tmp_path)
    got = _head_defaults(target, head)
    assert (got.temperature, got.top_p, got.eos_token_ids) == (0.2, 0.5, (7,))
    assert _head_defaults(None, head) == shipped and _head_defaults(target, None) == target


def test_demo_prints_no_timings():
    """`bash rheo.sh demo`: tau and target calls per method; no steps/s, which on a toy target
    read as 'rheo is 60x slower'."""
    out = subprocess.run([sys.executable, "-m", "rheo_engine.entrypoints.demo", "--batch", "2",
                          "--new-tokens", "8", "--temperatures", "0"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout  # fmt: skip
    assert "steps/s" not in out and "calls" in out
    ar = next(line.split() for line in out.splitlines() if line.split()[1:2] == ["ar"])
    assert float(ar[2]) == 1.0 and float(ar[3]) == 8.0  # one call per token
