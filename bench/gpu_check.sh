#!/usr/bin/env bash
# GPU check, one run of at most 8 minutes on a fresh NVIDIA machine (nothing downloaded): build
# with CUDA, run every CUDA test, time every kernel against its torch-native composition at the
# paper's sizes, and run ar against rheo end to end on the widened default pair at T = 1 and
# T = 0; one summary table last, ready to paste into BENCHMARKS.md.
#
#     bash bench/gpu_check.sh LOGDIR
#
# Steps (cap in seconds; what they took is in the table):
#   preflight      60  python modules, torch's CUDA, nvcc and ninja (what a fresh machine lacks)
#   build         300  FORCE_CUDA=1 pip install --no-build-isolation --no-deps --no-index -e .
#   has_cuda       30  rheo_engine.entrypoints.info; the extension holds the CUDA kernels, torch sees the GPU
#   widen          90  weights/default -> WIDENED (a ~1B-parameter Llama-3.2-1B-shaped pair with
#                      the default pair's outputs; reused when complete), in the background
#                      while the CUDA tests run (it needs the built extension, not the GPU)
#   cuda_tests    150  pytest -k cuda over the six kernel test files and every tests/test_*.py
#                      with a test named for cuda (bench/pytest_no_crash.py: a test that
#                      crashes the process is reported and the rest still run); a CUDA test
#                      skipped or crashed, or a kernel test file with no CUDA test passed, fails
#   bench_kernels 120  bench/bench_kernels_gpu.py --device cuda: every kernel vs torch, paper sizes
#   e2e_T1, e2e_T0  110 each  bench/e2e.py --methods ar rheo --device cuda --dtype bfloat16 on
#                      the widened pair, E2E_PROMPTS prompts x E2E_SEEDS seeds, 128 new tokens,
#                      the paper's fixed 60/8/10 tree; rheo's speed over ar's timed interleaved
#   profile        90  bench/step_profile.py --device cuda on the same pair: per method (ar, rheo
#                      with the paper tree, T = 1), eager and captured (runtime/graphs.py), ms a
#                      step, kernel launches and host reads a step, the GPU's busy share
#   tp2            90  bench/tp.py --tp 2 --device cuda on the same pair (NCCL), when nvidia-smi
#                      lists two GPUs; skipped with the reason otherwise
# Every step runs under `timeout`, and the steps share one deadline (BUDGET_S, default 470 s) so
# the whole check ends within 8 minutes; a step that no longer fits is "skipped (time)". Full
# logs: LOGDIR/<step>.log; the table: LOGDIR/summary.md. Exit status: 0 when every step passed,
# 1 otherwise, 2 at once without a GPU (nvidia-smi missing or listing none).
#
# Environment: PYTHON (default python), BUDGET_S, MAX_JOBS (default 16), WIDENED (default
# .cache/widened), E2E_TARGET / E2E_DRAFT (another pair instead of the widened one: no widen
# step), E2E_DATA (a folder with humaneval/question.jsonl, EAGLE's layout; default
# $RHEO_SHARED/data/eagle_bench (RHEO_SHARED default ../shared) when it has one, else six
# Python prompts written to LOGDIR/work),
# E2E_PROMPTS (6), E2E_SEEDS (2), E2E_TREE (fixed; or auto), GPU_CHECK_DRY=1 (write each step's
# command to its log instead of running it, with or without a GPU: tests the script itself).
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash bench/gpu_check.sh LOGDIR" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" && LOGDIR=$(cd "$1" && pwd)
cd "$ROOT"
PY=${PYTHON:-python}
BUDGET_S=${BUDGET_S:-470}
DRY=${GPU_CHECK_DRY:-0}
START=$SECONDS

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$LOGDIR/nvidia-smi.log" 2>&1; then
    if [ "$DRY" != 1 ]; then
        echo "gpu_check: FAILED: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no" \
             "device; see $LOGDIR/nvidia-smi.log). Run this check on a machine with a GPU." >&2
        exit 2
    fi
    echo "no GPU (dry run)" >"$LOGDIR/nvidia-smi.log"
fi
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
case $GPU in
    *,*) GPU="${GPU%%,*} (driver${GPU#*,})" ;;
    *) GPU=$(head -n 1 "$LOGDIR/nvidia-smi.log") ;;
esac
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
# No result of an earlier run in the same LOGDIR may pass for this one's.
rm -f "$LOGDIR"/kernels.md "$LOGDIR"/e2e_T*.json "$LOGDIR"/e2e_T*.md "$LOGDIR"/summary.md

NAMES=() STATUS=() SECS=() FIGS=()
FAILED=0

limit_for() {  # limit_for SECONDS: the cap, or what is left of the shared deadline
    local left=$((BUDGET_S - (SECONDS - START)))
    if [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}

# What a step printed (line 1 of its log is the command), and its last line, fit for a table
# cell: the figures of a step that failed.
log_of() { tail -n +2 "$LOGDIR/$1.log" 2>/dev/null; }
last_line() { log_of "$1" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c 1-160 | tr '|' '/'; }

record() {  # record NAME RC LIMIT T0: the row of a step that ran (rc of timeout)
    local status
    case $2 in
        0) status=ok ;;
        124 | 137) status="TIMEOUT (${3}s)"; FAILED=1 ;;
        *) status="FAIL (rc $2)"; FAILED=1 ;;
    esac
    NAMES+=("$1") STATUS+=("$status") SECS+=($((SECONDS - $4)))
    if [ "$status" = ok ]; then FIGS+=(""); else FIGS+=("$(last_line "$1")"); fi
    [ "$status" = ok ]
}

# step NAME SECONDS CMD...: run CMD under timeout (capped by the shared deadline), log to
# LOGDIR/NAME.log, record ok / FAIL (rc) / TIMEOUT / skipped.
step() {
    local name=$1 limit t0=$SECONDS rc
    limit=$(limit_for "$2")
    shift 2
    if [ "$limit" -lt 5 ]; then
        NAMES+=("$name") STATUS+=("skipped (time)") SECS+=(0) FIGS+=("")
        FAILED=1
        return 1
    elif [ "$DRY" = 1 ]; then
        echo "dry run: timeout $limit $*" >"$LOGDIR/$name.log"
        rc=0
    else
        echo "== $name (timeout ${limit}s)" >&2
        echo "\$ timeout $limit $*" >"$LOGDIR/$name.log"
        timeout --kill-after=10 "$limit" "$@" >>"$LOGDIR/$name.log" 2>&1
        rc=$?
    fi
    record "$name" "$rc" "$limit" "$t0"
}

# bg_start NAME SECONDS CMD...: step, but in the background (one at a time); bg_wait records it.
BG_NAME="" BG_PID="" BG_LIMIT=0 BG_T0=0
bg_start() {
    BG_NAME=$1 BG_T0=$SECONDS BG_PID=""
    BG_LIMIT=$(limit_for "$2")
    shift 2
    if [ "$BG_LIMIT" -lt 5 ]; then
        return
    elif [ "$DRY" = 1 ]; then
        echo "dry run (background): timeout $BG_LIMIT $*" >"$LOGDIR/$BG_NAME.log"
    else
        echo "== $BG_NAME (in the background, timeout ${BG_LIMIT}s)" >&2
        echo "\$ timeout $BG_LIMIT $*" >"$LOGDIR/$BG_NAME.log"
        timeout --kill-after=10 "$BG_LIMIT" "$@" >>"$LOGDIR/$BG_NAME.log" 2>&1 &
        BG_PID=$!
    fi
}

bg_wait() {
    local rc=0
    if [ "$BG_LIMIT" -lt 5 ]; then
        NAMES+=("$BG_NAME") STATUS+=("skipped (time)") SECS+=(0) FIGS+=("")
        FAILED=1
        return 1
    fi
    [ -n "$BG_PID" ] && { wait "$BG_PID"; rc=$?; }
    record "$BG_NAME" "$rc" "$BG_LIMIT" "$BG_T0"
}

skip() {  # skip NAME WHY: a step that cannot run because an earlier one failed
    NAMES+=("$1") STATUS+=("skipped ($2)") SECS+=(0) FIGS+=("")
    FAILED=1
}

absent() {  # absent NAME WHY: a step this machine has no means for (not a failure)
    NAMES+=("$1") STATUS+=("skipped ($2)") SECS+=(0) FIGS+=("")
}

fig() {  # fig TEXT: the figures of the last step recorded
    FIGS[$((${#NAMES[@]} - 1))]=$1
}

# A passing pytest that ran nothing, or skipped a test that needs CUDA, is a failure here.
check_ran() {
    local i=$((${#NAMES[@]} - 1)) skipped
    if [ "$DRY" = 1 ] || [ "${STATUS[$i]}" != ok ]; then return; fi
    skipped=$(grep -c "^SKIPPED.*needs a CUDA" "$LOGDIR/$1.log")
    if ! grep -Eq "[0-9]+ passed" "$LOGDIR/$1.log"; then
        STATUS[$i]="FAIL (no CUDA test ran)"
        FAILED=1
    elif [ "$skipped" != 0 ]; then
        STATUS[$i]="FAIL (CUDA tests skipped: see the log's SKIPPED lines)"
        FAILED=1
    else  # every CUDA kernel has a test that passed (-rp lists them)
        local f
        for f in "${KERNEL_TESTS[@]}"; do
            if ! grep -q "^PASSED $f::" "$LOGDIR/$1.log"; then
                STATUS[$i]="FAIL (no CUDA test of $f passed)"
                FAILED=1
                return
            fi
        done
    fi
}

# 0. what a fresh machine may lack
step preflight 60 "$PY" -c "
import importlib, shutil, subprocess, sys
missing = []
for name in ('torch', 'numpy', 'safetensors', 'sentencepiece', 'tiktoken', 'pytest',
             'setuptools'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '(no version)'))
    except ImportError:
        missing.append(name)
import torch
tools = {}
for tool in ('nvcc', 'ninja'):
    path = shutil.which(tool)
    out = subprocess.run([tool, '--version'], capture_output=True, text=True).stdout if path else ''
    lines = out.strip().splitlines() or ['-']
    tools[tool] = next((l for l in lines if 'release' in l), lines[-1]).split('release')[-1]
    print(tool, path, tools[tool])
    missing += [] if path else [tool]
if torch.version.cuda is None:
    missing.append('a CUDA build of torch')
nvcc, ninja = tools['nvcc'].strip(), tools['ninja']
print(f'figures: torch {torch.__version__} (CUDA {torch.version.cuda}),',
      f'{torch.cuda.device_count()} GPU(s), nvcc {nvcc}, ninja {ninja}')
if missing:
    sys.exit('missing: ' + ', '.join(missing))
"
[ "$DRY" = 1 ] || [ "${STATUS[0]}" != ok ] || fig "$(log_of preflight | sed -n 's/^figures: //p')"

# 1. build with CUDA
if step build 300 env FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .; then
    [ "$DRY" = 1 ] || fig "$(log_of build | grep -m 1 -o 'rheo_engine._C: .*')"
    step has_cuda 30 "$PY" -c "import torch; from rheo_engine.spec import kernels; \
from rheo_engine.entrypoints.info import info_lines; print('\n'.join(info_lines())); \
assert kernels.has_cuda(), 'extension built without CUDA: ' + kernels.build_info(); \
assert torch.cuda.is_available(), 'torch sees no GPU'"
    BUILT=$?
    [ "$DRY" = 1 ] || [ "$BUILT" != 0 ] ||
        fig "$(log_of has_cuda | head -n 1) on $(log_of has_cuda | grep -m 1 '^cuda:0')"
else
    skip has_cuda build
    BUILT=1
fi

# 4a. the model pair, widened in the background while the CUDA tests run
WIDENED=${WIDENED:-.cache/widened}
if [ -n "${E2E_TARGET:-}" ] || [ -n "${E2E_DRAFT:-}" ]; then
    TARGET=${E2E_TARGET:?E2E_DRAFT needs E2E_TARGET too}
    DRAFT=${E2E_DRAFT:?E2E_TARGET needs E2E_DRAFT too}
    PAIR="$TARGET + $DRAFT"
    WIDEN=0
else
    TARGET=$WIDENED/target DRAFT=$WIDENED/draft
    PAIR="the widened default pair ($WIDENED)"
    WIDEN=1
fi
if [ "$BUILT" = 0 ] && [ "$WIDEN" = 1 ]; then
    bg_start widen 90 "$PY" -c "from rheo_engine.io.widen import ensure_widened; \
print('wrote', ensure_widened('weights/default', '$WIDENED'))"
fi

# 2. every CUDA test, 3. the kernels against torch on the GPU
KERNEL_TESTS=(tests/test_pool_sampler.py tests/test_proxy_rerank.py tests/test_tree_attention.py
              tests/test_verification.py tests/test_skinny_linear.py tests/test_logit_controls.py)
# ... and every file that defines a test named for cuda (test_cuda_emu.py's CPU emulator tests
# are not GPU tests: no test of theirs is named so).
mapfile -t CUDA_TESTS < <(printf '%s\n' "${KERNEL_TESTS[@]}" \
    $(grep -l -E 'def test_[A-Za-z0-9_]*cuda' tests/test_*.py) | sort -u)
if [ "$BUILT" = 0 ]; then
    # bench/pytest_no_crash.py: a test that crashes the process is reported (CRASHED nodeid)
    # and deselected, and the other tests run again: one crash no longer hides the rest.
    step cuda_tests 150 "$PY" bench/pytest_no_crash.py -rsp -p no:cacheprovider -k cuda \
        "${CUDA_TESTS[@]}"
    check_ran cuda_tests
    counts=$(log_of cuda_tests | grep -E '[0-9]+ (passed|failed)' | tail -n 1 | tr -d '=' |
        sed 's/^ *//; s/ *$//')
    [ -z "$counts" ] || fig "$counts (-k cuda over ${#CUDA_TESTS[@]} files)"
    if [ "$WIDEN" = 1 ] && bg_wait && [ "$DRY" != 1 ]; then
        fig "$(du -sh "$WIDENED" 2>/dev/null | cut -f 1) in $WIDENED, made beside cuda_tests"
    fi
    step bench_kernels 120 "$PY" bench/bench_kernels_gpu.py --device cuda \
        --md "$LOGDIR/kernels.md"
    [ "$DRY" = 1 ] || [ ! -f "$LOGDIR/kernels.md" ] || fig "$(awk -F' [|] ' '
        /^[|] [a-z_]+ [|] / && $3 ~ /^[0-9.]+$/ {
            n++; x = $5 + 0; if (n == 1 || x < lo) lo = x; if (n == 1 || x > hi) hi = x }
        END { printf "%d cases, speedup (torch/ours) %.2f-%.2fx: table below", n, lo, hi }' \
        "$LOGDIR/kernels.md")"
else
    for s in cuda_tests widen bench_kernels; do
        [ "$s" = widen ] && [ "$WIDEN" = 0 ] && continue
        skip "$s" "no CUDA build"
    done
fi

# 4b. ar against rheo end to end, T = 1 then T = 0
SHARED_DATA=${RHEO_SHARED:-../shared}/data/eagle_bench
if [ -n "${E2E_DATA:-}" ]; then
    DATA=$E2E_DATA PROMPTS="HumanEval from $E2E_DATA"
elif [ -f "$SHARED_DATA/humaneval/question.jsonl" ]; then
    DATA=$SHARED_DATA PROMPTS="HumanEval ($SHARED_DATA)"
else
    DATA=$LOGDIR/work/prompts PROMPTS="six Python prompts of this script"
    mkdir -p "$DATA/humaneval"
    "$PY" - "$DATA/humaneval/question.jsonl" <<'EOF'
import json, sys
prompts = [
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(text: str) -> bool:\n    """True when text reads the same backwards."""\n',
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    'import os\n\n\ndef python_files(root):\n    """Yield the .py files under root."""\n',
    'def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description="Copy.")\n',
]
with open(sys.argv[1], "w") as f:
    for i, text in enumerate(prompts):
        f.write(json.dumps({"question_id": i, "turns": [text]}) + "\n")
EOF
fi
N_PROMPTS=${E2E_PROMPTS:-6} SEEDS=${E2E_SEEDS:-2} TREE=${E2E_TREE:-fixed} NEW=128
shape() {  # shape CONFIG: ", a Llama of N parameters (hidden ...)" from a target's config.json
    "$PY" - "$1" <<'EOF' 2>/dev/null
import json, sys
c = json.load(open(sys.argv[1]))
h, L, H, Hkv, V = (c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size"))
D, inter = c.get("head_dim", h // H), c["intermediate_size"]
params = V * h * (1 if c.get("tie_word_embeddings") else 2)
params += L * (h * (H + 2 * Hkv) * D + H * D * h + 3 * h * inter)
print(f", a Llama of {params / 1e9:.2f}B parameters (hidden {h}, MLP {inter}, {L} layers, {H} "
      f"heads and {Hkv} KV heads of {D}, vocab {V}, context {c['max_position_embeddings']})")
EOF
}
e2e_fig() {  # e2e_fig JSON: the figures of one e2e run
    "$PY" - "$1" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
ar, rheo = s["ar"]["average"], s["rheo"]["average"]
print(f"ar {ar['tokens_per_s']:.1f} tok/s, rheo {rheo['tokens_per_s']:.1f} tok/s, "
      f"rheo/ar {rheo['speedup']:.2f}x ± {rheo['speedup_std']:.2f}, τ {rheo['tau_mean']:.2f}")
EOF
}
for T in 1 0; do
    if [ "$BUILT" != 0 ]; then
        skip "e2e_T$T" "no CUDA build"
    elif [ "$DRY" != 1 ] && ! { [ -f "$TARGET/config.json" ] && [ -f "$DRAFT/config.json" ]; }; then
        skip "e2e_T$T" "no model pair at $TARGET, $DRAFT"
    else
        step "e2e_T$T" 110 "$PY" bench/e2e.py --target "$TARGET" --draft "$DRAFT" \
            --device cuda --dtype bfloat16 --methods ar rheo --temperature "$T" \
            --prompts questions --data "$DATA" --sets humaneval --limit "$N_PROMPTS" \
            --seeds "$SEEDS" --max-new-tokens "$NEW" --tree "$TREE" --quiet \
            --out "$LOGDIR/e2e_T$T.json" --md "$LOGDIR/e2e_T$T.md" &&
            [ "$DRY" != 1 ] && fig "$(e2e_fig "$LOGDIR/e2e_T$T.json" 2>&1)"
    fi
done

# 4c. The profile line per method: ms a step, kernel launches a step, host reads a step and the
# GPU's busy share, ar and rheo (the paper tree, T = 1), eager and captured (runtime/graphs.py).
if [ "$BUILT" != 0 ]; then
    skip profile "no CUDA build"
elif [ "$DRY" != 1 ] && ! { [ -f "$TARGET/config.json" ] && [ -f "$DRAFT/config.json" ]; }; then
    skip profile "no model pair at $TARGET, $DRAFT"
else
    step profile 90 "$PY" bench/step_profile.py --target "$TARGET" --draft "$DRAFT" \
        --device cuda --dtype bfloat16 --methods ar rheo --graphs 0 1 --temperature 1 \
        --prompts 3 --max-new-tokens 64 --tree fixed --md "$LOGDIR/profile.md" &&
        [ "$DRY" != 1 ] && fig "$("$PY" - "$LOGDIR/profile.md" <<'EOF' 2>&1
import sys
rows = [l.split(" | ") for l in open(sys.argv[1]) if l.startswith("| ar |") or l.startswith("| rheo |")]
print("; ".join(f"{r[0][2:]} {r[1]}: {r[2]} ms, {r[4]} launches, {r[6]} busy" for r in rows))
EOF
)"
fi

# 4d. Tensor parallel over two GPUs (NCCL), when the machine has two: TP = 1 against TP = 2 on
# the same pair, the collectives' count, bytes and share of a step (bench/tp.py).
N_GPUS=$(grep -c '^GPU' "$LOGDIR/nvidia-smi.log" 2>/dev/null || true)
if [ "$BUILT" != 0 ]; then
    skip tp2 "no CUDA build"
elif [ "$DRY" != 1 ] && [ "${N_GPUS:-0}" -lt 2 ]; then
    absent tp2 "${N_GPUS:-0} GPU: tensor parallelism needs two"
elif [ "$DRY" != 1 ] && ! { [ -f "$TARGET/config.json" ] && [ -f "$DRAFT/config.json" ]; }; then
    skip tp2 "no model pair at $TARGET, $DRAFT"
else
    step tp2 90 "$PY" bench/tp.py --target "$TARGET" --draft "$DRAFT" --device cuda \
        --dtype bfloat16 --tp 2 --runs 2 --max-new-tokens 64 --json "$LOGDIR/tp2.json"
fi

# Summary, last.
{
    commit=$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null ||
        echo '+dirty')
    echo "### gpu_check on $GPU, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit"
    echo
    echo "\`bash bench/gpu_check.sh LOGDIR\`: $((SECONDS - START)) s in all (budget" \
         "${BUDGET_S} s)$([ "$DRY" = 1 ] && echo ". DRY RUN: commands written to the logs," \
         "nothing run")"
    echo
    echo "| step | status | seconds | figures |"
    echo "| --- | --- | --- | --- |"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | ${FIGS[$i]:-–} |"
    done
    if [ -f "$LOGDIR/kernels.md" ]; then
        echo
        echo "Kernels vs torch-native (bench/bench_kernels_gpu.py; µs per call, median):"
        echo
        sed '1s/^# //' "$LOGDIR/kernels.md"  # its conditions line: a paragraph, not a heading
    fi
    if [ -f "$LOGDIR/e2e_T1.json" ] || [ -f "$LOGDIR/e2e_T0.json" ]; then
        echo
        echo "End to end (bench/e2e.py): $PAIR$(shape "$TARGET/config.json"), bf16 on cuda," \
             "$PROMPTS x $N_PROMPTS, $SEEDS seeds, $NEW new tokens, tree $TREE (topk 10, depth" \
             "8, N 60), m = 1, S = 128; rheo/ar: tokens/s over ar's, interleaved in the same" \
             "run (mean ± std over seeds):"
        echo
        "$PY" - "$LOGDIR" <<'EOF'
import json, sys
from pathlib import Path
print("| T | ar tokens/s | rheo tokens/s | rheo/ar | τ rheo | τ ar | tokens per method |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for T in (1, 0):
    path = Path(sys.argv[1]) / f"e2e_T{T}.json"
    if path.is_file():
        s = json.loads(path.read_text())["summary"]
        ar, rheo = s["ar"]["average"], s["rheo"]["average"]
        print(f"| {T} | {ar['tokens_per_s']:.1f} | {rheo['tokens_per_s']:.1f} | "
              f"**{rheo['speedup']:.2f}x** ± {rheo['speedup_std']:.2f} | {rheo['tau_mean']:.2f} "
              f"| {ar['tau_mean']:.2f} | {rheo['tokens']} |")
EOF
    fi
    if [ -f "$LOGDIR/profile.md" ]; then
        echo
        echo "A step, eager and captured (bench/step_profile.py; ms: median over prompts):"
        echo
        sed '1s/^# //' "$LOGDIR/profile.md"
    fi
    echo
    echo "Logs: $LOGDIR/<step>.log (bash bench/gpu_check.sh)."
} | tee "$LOGDIR/summary.md"
if [ "$FAILED" != 0 ]; then
    echo "gpu_check: FAILED (see the table above and $LOGDIR)" >&2
    exit 1
fi
echo "gpu_check: all steps passed" >&2
