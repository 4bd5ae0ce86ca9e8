"""bench/gpu_check.sh and bench/bench_kernels_gpu.py, checked on a machine without a GPU.

- gpu_check.sh exits 2 at once without a GPU; in dry-run mode (GPU_CHECK_DRY=1, GPU or not) it
  lists every step in order with the command it would run: a CUDA build, the CUDA tests of
  every file that has them, the kernel bench on cuda, the widened pair, ar against rheo at
  T = 1 and T = 0 on cuda in bf16.
- Its real path with stand-ins for python, pip, pytest and the benches (a fake ``python``):
  the figures and the tables of the summary, a skipped CUDA test failing the check, and the
  shared deadline cutting a step that runs long and skipping the rest.
- bench_kernels_gpu.py --device cpu --quick: a row per kernel with numbers, the same table in
  --md; --device cuda without a GPU is a one-line error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPT = BENCH / "gpu_check.sh"
STEPS = ["preflight", "build", "has_cuda", "cuda_tests", "widen", "bench_kernels", "e2e_T1",
         "e2e_T0", "profile", "tp2"]  # fmt: skip
KERNEL_TESTS = ["test_pool_sampler.py", "test_proxy_rerank.py", "test_tree_attention.py",
                "test_verification.py", "test_skinny_linear.py",
                "test_logit_controls.py"]  # fmt: skip
KERNELS = ["tree_attention", "pool_sampler", "verification", "skinny_linear", "select_expand",
           "build_tree"]  # fmt: skip


def _gpu_present() -> bool:
    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


def _rows(summary: str) -> dict[str, list[str]]:
    """The step table of a summary: {step: [status, seconds, figures]}."""
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in STEPS:
            rows[cells[0]] = cells[1:]
    return rows


def _fake_bin(tmp_path: Path) -> Path:
    """A folder with an nvidia-smi that lists one fake H200."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu*) echo "Fake H200, 555.42" ;;\n'
        "*) echo 'GPU 0: Fake H200 (UUID: x)' ;; esac\n"
    )
    (fake / "nvidia-smi").chmod(0o755)
    return fake


def _gpu_check(tmp_path: Path, gpu: bool = True, rc: int = 0, **env: str):
    path = f"{_fake_bin(tmp_path)}:{os.environ['PATH']}" if gpu else os.environ["PATH"]
    env = {**os.environ, "PATH": path, "WIDENED": str(tmp_path / "widened"), **env}
    logs = tmp_path / "logs"
    run = subprocess.run(["bash", str(SCRIPT), str(logs)], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)  # fmt: skip
    assert run.returncode == rc, run.stdout + run.stderr
    return run, logs


def _log(logs: Path, step: str) -> str:
    return (logs / f"{step}.log").read_text()


@pytest.mark.skipif(_gpu_present(), reason="this machine has a GPU: the no-GPU path cannot run")
def test_fails_clearly_without_a_gpu(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "logs")], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert run.returncode == 2 and "no NVIDIA GPU" in run.stderr
    assert not (tmp_path / "logs" / "summary.md").exists()


def test_dry_run_lists_every_step_in_order(tmp_path):
    run, logs = _gpu_check(tmp_path, GPU_CHECK_DRY="1")
    summary = (logs / "summary.md").read_text()
    assert summary == run.stdout and "DRY RUN" in summary
    assert "Fake H200 (driver 555.42)" in summary.splitlines()[0]
    rows = _rows(summary)
    assert list(rows) == STEPS and all(r[0] == "ok" for r in rows.values()), summary
    build = _log(logs, "build")
    assert "FORCE_CUDA=1" in build and "--no-build-isolation" in build and "-e ." in build
    tests = _log(logs, "cuda_tests")
    assert "-k cuda" in tests and "-rsp" in tests  # p: the passed tests, per kernel file
    assert "bench/pytest_no_crash.py" in tests  # a crashing test does not end the run
    for name in KERNEL_TESTS + ["test_host_reads.py"]:  # test_host_reads has CUDA tests too
        assert f"tests/{name}" in tests
    assert "test_cuda_emu.py" not in tests  # the CPU emulator: no GPU test there
    assert "--device cuda" in _log(logs, "bench_kernels")
    tp2 = _log(logs, "tp2")
    assert "bench/tp.py" in tp2 and "--tp 2" in tp2 and "--device cuda" in tp2
    assert "ensure_widened('weights/default'" in _log(logs, "widen")
    for T in (1, 0):
        e2e = _log(logs, f"e2e_T{T}")
        for flag in ("--device cuda", "--dtype bfloat16", "--methods ar rheo",
                     f"--temperature {T}", "--max-new-tokens 128", "--tree fixed"):  # fmt: skip
            assert flag in e2e
        assert f"--target {tmp_path / 'widened' / 'target'}" in e2e
    profile = _log(logs, "profile")
    for flag in ("bench/step_profile.py", "--device cuda", "--graphs 0 1", "--methods ar rheo"):
        assert flag in profile


def test_dry_run_needs_no_gpu_and_writes_prompts_on_a_fresh_clone(tmp_path):
    run, logs = _gpu_check(tmp_path, gpu=False, GPU_CHECK_DRY="1", RHEO_SHARED="/nonexistent")
    assert list(_rows(run.stdout)) == STEPS
    data = logs / "work" / "prompts"
    assert f"--data {data} --sets humaneval --limit 6" in _log(logs, "e2e_T1")
    sys.path.insert(0, str(BENCH))
    try:
        import inputs
    finally:
        sys.path.remove(str(BENCH))
    questions = inputs.load_questions(data, "humaneval")
    assert len(questions) == 6 and all(q.strip() for q in questions)


def test_dry_run_with_another_pair_has_no_widen_step(tmp_path):
    target, draft = tmp_path / "t", tmp_path / "d"
    run, logs = _gpu_check(tmp_path, GPU_CHECK_DRY="1", E2E_TARGET=str(target),
                           E2E_DRAFT=str(draft), E2E_PROMPTS="3", E2E_SEEDS="1")  # fmt: skip
    assert list(_rows(run.stdout)) == [s for s in STEPS if s != "widen"]
    e2e = _log(logs, "e2e_T0")
    assert f"--target {target} --draft {draft}" in e2e and "--limit 3 --seeds 1" in e2e


# --- the real path, with stand-ins ----------------------------------------------------------

FAKE_PYTHON = r"""#!/usr/bin/env bash
# python for gpu_check.sh's real path: pip, pytest and the benches faked, the summary's own
# small scripts (python - ...) run by the real python.
arg_after() {  # arg_after FLAG ARGS...: the value after FLAG
    local want=$1; shift
    while [ $# -gt 1 ]; do [ "$1" = "$want" ] && echo "$2"; shift; done
}
# bench/pytest_no_crash.py ARGS runs pytest ARGS (its own test: test_pytest_no_crash_*)
[ "${1:-}" = bench/pytest_no_crash.py ] && set -- -m pytest "${@:2}"
case "$1" in
    -) exec "$REAL_PYTHON" "$@" ;;
    -m)
        case "$2" in
            pip) echo "rheo_engine._C: cpu + cuda sm_90 (FORCE_CUDA=1)"; exit 0 ;;
            pytest)
                [ -n "${FAKE_PYTEST_SLEEP:-}" ] && exec sleep "$FAKE_PYTEST_SLEEP"
                [ -n "${FAKE_PYTEST_SKIP:-}" ] && echo "SKIPPED [9]" \
                    "tests/test_verification.py:387: needs a CUDA GPU and a CUDA build"
                for f in "$@"; do  # -rp: a passed CUDA test per file (but FAKE_PYTEST_NONE's)
                    case $f in
                        *"${FAKE_PYTEST_NONE:-none}"*) ;;
                        tests/*.py) echo "PASSED $f::test_cuda_fake" ;;
                    esac
                done
                echo "${FAKE_PYTEST_LINE:-==== 60 passed in 1.00s ====}"; exit 0 ;;
        esac ;;
    -c)
        case "$2" in
            *ensure_widened*)
                mkdir -p "$WIDENED/target" "$WIDENED/draft"
                echo '{}' >"$WIDENED/target/config.json"; echo '{}' >"$WIDENED/draft/config.json"
                echo "wrote $WIDENED"; exit 0 ;;
            *info_lines*)
                printf '%s\n' "rheo_engine._C: cpu + cuda sm_90" "torch 2.13.0 (CUDA 12.8)" \
                    "cuda:0 Fake H200 sm_90"
                exit 0 ;;
            *) echo "figures: torch 2.13.0+cu128 (CUDA 12.8), 1 GPU(s), nvcc 12.8, ninja 1.11"
               exit 0 ;;
        esac ;;
    bench/bench_kernels_gpu.py)
        md=$(arg_after --md "$@")
        printf '%s\n' "# kernels vs torch-native: device=Fake H200" "" \
            "| kernel | case | ours µs | torch µs | speedup (torch/ours) | torch-native | check |" \
            "|---|---|---|---|---|---|---|" \
            "| tree_attention | prefix=1024 | 20.0 | 60.0 | 3.00 | SDPA | ok |" \
            "| select_expand | M=100 | 10.0 | 5.0 | 0.50 | torch.topk | ok |" >"$md"
        cat "$md"; exit 0 ;;
    bench/step_profile.py)
        md=$(arg_after --md "$@")
        printf '%s\n' "# bench=step_profile device=cuda" "" \
            "| method | static buffers | ms / step | tokens / step | kernel launches / step | host reads / step | GPU busy | speed vs ar (off) |" \
            "| --- | --- | --- | --- | --- | --- | --- | --- |" \
            "| ar | off | 6.80 | 1.00 | 250 | 1.0 | 20% | 1.00x |" \
            "| ar | on | 2.10 | 1.00 | 40 | 1.0 | 70% | 3.20x |" >"$md"
        cat "$md"; exit 0 ;;
    bench/e2e.py)
        out=$(arg_after --out "$@") T=$(arg_after --temperature "$@")
        rheo=$([ "$T" = 1 ] && echo 150.0 || echo 200.0)
        ratio=$([ "$T" = 1 ] && echo 1.5 || echo 2.0)
        ar='"ar": {"average": {"tokens_per_s": 100.0, "tau_mean": 1.0, "tokens": 768,'
        ar+=' "speedup": 1.0, "speedup_std": 0.0}}'
        rh='"rheo": {"average": {"tokens_per_s": '$rheo', "tau_mean": 3.25, "tokens": 768,'
        rh+=' "speedup": '$ratio', "speedup_std": 0.05}}'
        echo "{\"summary\": {$ar, $rh}}" >"$out"
        exit 0 ;;
esac
echo "fake python: unexpected arguments: $*" >&2
exit 99
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return {"PYTHON": str(path), "REAL_PYTHON": sys.executable}


def test_real_path_summary_holds_every_figure(tmp_path, fake_python):
    run, logs = _gpu_check(tmp_path, **fake_python)
    summary = run.stdout
    rows = _rows(summary)
    assert list(rows) == STEPS, summary
    assert all(r[0] == "ok" for step, r in rows.items() if step != "tp2"), summary
    # One GPU: tensor parallelism is skipped with its reason, which fails nothing.
    assert rows["tp2"][0] == "skipped (1 GPU: tensor parallelism needs two)"
    assert "DRY RUN" not in summary and "Fake H200 (driver 555.42)" in summary.splitlines()[0]
    assert rows["preflight"][2].startswith("torch 2.13.0+cu128 (CUDA 12.8)")
    assert rows["build"][2] == "rheo_engine._C: cpu + cuda sm_90 (FORCE_CUDA=1)"
    assert rows["has_cuda"][2] == "rheo_engine._C: cpu + cuda sm_90 on cuda:0 Fake H200 sm_90"
    assert re.fullmatch(r"60 passed in 1\.00s \(-k cuda over \d+ files\)", rows["cuda_tests"][2])
    assert rows["bench_kernels"][2] == "2 cases, speedup (torch/ours) 0.50-3.00x: table below"
    assert rows["e2e_T1"][2] == "ar 100.0 tok/s, rheo 150.0 tok/s, rheo/ar 1.50x ± 0.05, τ 3.25"
    assert "| tree_attention | prefix=1024 | 20.0 | 60.0 | 3.00 |" in summary  # the kernel table
    assert "| 1 | 100.0 | 150.0 | **1.50x** ± 0.05 | 3.25 | 1.00 | 768 |" in summary
    assert "| 0 | 100.0 | 200.0 | **2.00x** ± 0.05 | 3.25 | 1.00 | 768 |" in summary
    assert rows["profile"][2] == ("ar off: 6.80 ms, 250 launches, 20% busy; "
                                  "ar on: 2.10 ms, 40 launches, 70% busy")  # fmt: skip
    assert "| ar | on | 2.10 | 1.00 | 40 | 1.0 | 70% | 3.20x |" in summary  # the profile table
    assert (tmp_path / "widened" / "target" / "config.json").is_file()
    assert rows["widen"][2].endswith(f"in {tmp_path / 'widened'}, made beside cuda_tests")
    assert _log(logs, "build").startswith("$ timeout 300 env FORCE_CUDA=1")  # the command first


# No test here is named for cuda (nor a parameter id): gpu_check's -k cuda must not pick them.
@pytest.mark.parametrize(
    "env, status",
    [
        ({"FAKE_PYTEST_SKIP": "1"}, "FAIL (CUDA tests skipped: see the log's SKIPPED lines)"),
        ({"FAKE_PYTEST_LINE": "57 skipped, 3 deselected in 1.0s"}, "FAIL (no CUDA test ran)"),
        ({"FAKE_PYTEST_NONE": "test_logit_controls.py"},
         "FAIL (no CUDA test of tests/test_logit_controls.py passed)"),
    ],
    ids=["one skipped", "none passed", "a kernel untested"],
)
def test_gpu_tests_that_skip_fail_the_check(tmp_path, fake_python, env, status):
    run, _ = _gpu_check(tmp_path, rc=1, **fake_python, **env)
    rows = _rows(run.stdout)
    assert rows["cuda_tests"][0] == status
    assert rows["e2e_T0"][0] == "ok"  # the other steps still run
    assert "gpu_check: FAILED" in run.stderr


def test_the_shared_deadline_cuts_a_long_step_and_skips_the_rest(tmp_path, fake_python):
    start = time.monotonic()
    run, logs = _gpu_check(tmp_path, rc=1, BUDGET_S="8", FAKE_PYTEST_SLEEP="60", **fake_python)
    assert time.monotonic() - start < 30
    rows = _rows(run.stdout)
    assert rows["cuda_tests"][0].startswith("TIMEOUT ("), run.stdout
    for name in ("bench_kernels", "e2e_T1", "e2e_T0"):
        assert rows[name][0] == "skipped (time)"
    assert (logs / "summary.md").read_text() == run.stdout


# --- bench_kernels_gpu.py -------------------------------------------------------------------


def test_bench_kernels_runs_on_the_cpu(tmp_path):
    md = tmp_path / "kernels.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(BENCH / "bench_kernels_gpu.py"), "--device", "cpu", "--quick",
         "--md", str(md)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("# kernels vs torch-native: device=") and "sizes=quick" in lines[0]
    assert lines[1] == (
        "| kernel | case | ours µs | torch µs | speedup (torch/ours) | torch-native | check |"
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    assert {r[0] for r in rows} == set(KERNELS)
    for r in rows:
        ours, theirs, speedup = (float(v) for v in r[2:5])
        assert ours > 0 and theirs > 0
        assert speedup == pytest.approx(theirs / ours, rel=0.05, abs=0.01)
        assert r[5] and r[6]
    assert md.read_text() == lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_bench_kernels_on_a_machine_without_a_gpu_is_a_one_line_error():
    run = subprocess.run(
        [sys.executable, str(BENCH / "bench_kernels_gpu.py"), "--device", "cuda"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--device cuda" in run.stderr


# --- bench/pytest_no_crash.py -------------------------------------------------------------------

CRASHING_TESTS = """
import ctypes, os

def test_before():
    pass

def test_crashes():
    ctypes.string_at(0)  # a segmentation fault, as a bad device read gives

def test_aborts():
    os.abort()

def test_after():
    pass

def test_fails():
    assert False
"""


def test_pytest_no_crash_reports_crashed_tests_and_runs_the_rest(tmp_path):
    (tmp_path / "test_crashing.py").write_text(CRASHING_TESTS)
    run = subprocess.run([sys.executable, str(BENCH / "pytest_no_crash.py"), "-rsp",
                          "-p", "no:cacheprovider", "test_crashing.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "CRASHED test_crashing.py::test_crashes (killed by SIGSEGV)" in out
    assert "CRASHED test_crashing.py::test_aborts (killed by SIGABRT)" in out
    assert re.search(r"1 failed, 2 passed, 2 deselected", out), out[-2000:]
    assert out.rstrip().endswith(
        "2 crashed: test_crashing.py::test_crashes test_crashing.py::test_aborts")
    assert "PASSED test_crashing.py::test_after" in out  # -rp: the tests after the crash ran


def test_pytest_no_crash_passes_pytest_status_through(tmp_path):
    (tmp_path / "test_fine.py").write_text("def test_ok():\n    pass\n")
    run = subprocess.run([sys.executable, str(BENCH / "pytest_no_crash.py"), "-p",
                          "no:cacheprovider", "test_fine.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "1 passed" in run.stdout and "crashed" not in run.stdout
