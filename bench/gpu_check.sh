#!/usr/bin/env bash
# GPU check: build with CUDA, run the CUDA kernel tests, the kernel benches on the GPU and a
# short end-to-end run of every method on the stories260K pair (the embedded default pair when
# neither .cache/stories260K nor the llama2c fixture is there, as on a fresh clone); summary last.
#
#     bash bench/gpu_check.sh LOGDIR
#
# Needs an NVIDIA GPU (exits 2 at once without one) and nvcc. Every step runs under `timeout`, and the steps share one
# deadline (BUDGET_S, default 470 s) so the whole check ends within 8 minutes; a step that no
# longer fits is marked "skipped (time)". Full logs: LOGDIR/<step>.log; table: LOGDIR/summary.md.
# Exit status: 0 when every step passed, 1 otherwise.
#
# Environment: PYTHON (default python), BUDGET_S, STORIES_TARGET / STORIES_HEAD (default
# .cache/stories260K/{target,head}; a missing target is converted from LLAMA2C (default
# ../shared/fixtures/llama2c), a missing head is trained for HEAD_MINUTES=0.5 on the GPU),
# GPU_CHECK_DRY=1 (print each step's command instead of running it: tests the script itself).
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
    echo "gpu_check: FAILED: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no" \
         "device; see $LOGDIR/nvidia-smi.log). Run this check on a machine with a GPU." >&2
    exit 2
fi
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"

NAMES=() STATUS=() SECS=()
FAILED=0

# step NAME SECONDS CMD...: run CMD under timeout (capped by the shared deadline), log to
# LOGDIR/NAME.log, record ok / FAIL (rc) / TIMEOUT / skipped.
step() {
    local name=$1 limit=$2 status t0 rc left
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    [ "$limit" -gt "$left" ] && limit=$left
    t0=$SECONDS
    if [ "$limit" -lt 5 ]; then
        status="skipped (time)"
        FAILED=1
    elif [ "$DRY" = 1 ]; then
        echo "dry run: timeout $limit $*" >"$LOGDIR/$name.log"
        status=ok
    else
        echo "== $name: $* (timeout ${limit}s)" >&2
        timeout --kill-after=10 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
        rc=$?
        case $rc in
            0) status=ok ;;
            124 | 137) status="TIMEOUT (${limit}s)"; FAILED=1 ;;
            *) status="FAIL (rc $rc)"; FAILED=1 ;;
        esac
    fi
    NAMES+=("$name") STATUS+=("$status") SECS+=($((SECONDS - t0)))
    [ "$status" = ok ]
}

skip() {  # skip NAME WHY: a step that cannot run because an earlier one failed
    NAMES+=("$1") STATUS+=("skipped ($2)") SECS+=(0)
    FAILED=1
}

# A passing pytest that ran nothing (CUDA tests all skipped) is a failure here.
check_ran() {
    local i=$((${#NAMES[@]} - 1))
    if [ "$DRY" != 1 ] && [ "${STATUS[$i]}" = ok ] && ! grep -Eq "[0-9]+ passed" "$LOGDIR/$1.log"; then
        STATUS[$i]="FAIL (no CUDA test ran)"
        FAILED=1
    fi
}

# 1. build with CUDA
if step build 300 env FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PY" -m pip install \
        --no-build-isolation -e .; then
    step info 30 "$PY" -m rheo_engine.info
    step has_cuda 30 "$PY" -c "import torch; from rheo_engine import kernels; \
assert kernels.has_cuda(), 'extension built without CUDA: ' + kernels.build_info(); \
assert torch.cuda.is_available(), 'torch sees no GPU'; print(kernels.build_info())"
    BUILT=$?
else
    skip info build; skip has_cuda build
    BUILT=1
fi

# 2. CUDA tests of the kernels, 3. kernel benches on the GPU
KERNEL_TESTS=(tests/test_pool_sampler.py tests/test_proxy_rerank.py tests/test_tree_attention.py
              tests/test_verification.py tests/test_skinny_linear.py)
if [ "$BUILT" = 0 ]; then
    step cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider -k cuda "${KERNEL_TESTS[@]}"
    check_ran cuda_tests
    for bench in pool_sampler proxy_rerank tree_attention verification; do
        flags=(--quick)
        grep -q -- '"--device"' "bench/bench_$bench.py" && flags+=(--device cuda)
        step "bench_$bench" 60 "$PY" "bench/bench_$bench.py" "${flags[@]}"
    done
else
    for s in cuda_tests bench_pool_sampler bench_proxy_rerank bench_tree_attention \
             bench_verification; do skip "$s" "no CUDA build"; done
fi

# 4. a short e2e run of each method on the stories260K pair (on the GPU)
TARGET=${STORIES_TARGET:-.cache/stories260K/target}
HEAD=${STORIES_HEAD:-.cache/stories260K/head}
LLAMA2C=${LLAMA2C:-../shared/fixtures/llama2c}
PAIR=stories260K
READY=0
if [ ! -f "$TARGET/config.json" ] && [ ! -f "$LLAMA2C/stories260K.bin" ]; then
    # Nothing to make stories260K from (a fresh clone has no ../shared): the embedded pair.
    TARGET=weights/default/target HEAD=weights/default/draft PAIR="default pair"
elif [ ! -f "$TARGET/config.json" ]; then
    TARGET=$LOGDIR/work/stories260K
    rm -rf "$TARGET"
    step convert 60 "$PY" -m rheo_engine.io.convert llama2c "$LLAMA2C/stories260K.bin" \
        "$LLAMA2C/tok512.model" "$TARGET" || READY=1
fi
if [ "$READY" = 0 ] && [ ! -f "$HEAD/config.json" ]; then
    HEAD=$LOGDIR/work/head
    rm -rf "$HEAD"
    step train_head 120 "$PY" -m rheo_engine.train.head --target "$TARGET" --out "$HEAD" \
        --feature-layers 1,2,3 --minutes "${HEAD_MINUTES:-0.5}" --device cuda || READY=1
fi
if [ "$READY" = 0 ] && [ "$BUILT" = 0 ]; then
    step e2e 120 "$PY" bench/e2e.py --target "$TARGET" --draft "$HEAD" --prompts stories \
        --device cuda --limit 2 --seeds 1 --max-new-tokens 32 --quiet \
        --out "$LOGDIR/e2e.json" --md "$LOGDIR/e2e.md"
else
    skip e2e "no model pair or no CUDA build"
fi

# Summary, last.
{
    echo "# gpu_check $(date '+%Y-%m-%d %H:%M:%S') commit $(git rev-parse --short HEAD 2>/dev/null)" \
         "on $(head -n 1 "$LOGDIR/nvidia-smi.log"); $((SECONDS - START)) s in all" \
         "$([ "$DRY" = 1 ] && echo "(DRY RUN: commands printed, nothing run)")"
    echo
    echo "| step | status | seconds | log |"
    echo "| --- | --- | --- | --- |"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | ${NAMES[$i]}.log |"
    done
    if [ -f "$LOGDIR/e2e.md" ]; then
        echo
        echo "e2e ($PAIR, story openings, --limit 2, 32 new tokens, cuda):"
        echo
        cat "$LOGDIR/e2e.md"
    fi
} | tee "$LOGDIR/summary.md"
if [ "$FAILED" != 0 ]; then
    echo "gpu_check: FAILED (see the table above and $LOGDIR)" >&2
    exit 1
fi
echo "gpu_check: all steps passed" >&2
