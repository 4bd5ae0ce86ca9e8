#!/usr/bin/env bash
# Every SmolLM2 table of BENCHMARKS.md ("The SmolLM2 pair"), one thread, into OUT (default
# bench/results/smollm2, ignored by git). About 30 minutes on an idle 2-core machine.
#   bash bench/smollm2.sh [OUT]
# LIMIT (questions per set, default 4) and NEW (new tokens, default 96) shorten or lengthen it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-bench/results/smollm2}
LIMIT=${LIMIT:-4}
NEW=${NEW:-96}
mkdir -p "$OUT"
run() { echo "== $*" >&2; "$@"; }

# 1. The matmuls a SmolLM2 step runs: F.linear against the skinny kernel, bf16, 1 thread.
run python bench/bench_skinny_linear.py --shapes smollm2 --dtype bfloat16 --threads 1 \
  --rows 1,2,4,8,16,32,64 --quick | tee "$OUT/skinny_linear.md"

# 2. What a tree costs: the measured profile (target forwards of n nodes, draft levels,
#    verification) and the break-even tau of some trees, at T = 0 and T = 1.
for T in 0 1; do
  run python -m rheo_engine.generate --pair smollm2 --prompt "Say hi." --max-new-tokens 8 \
    --temperature "$T" --threads 1 --cost-profile "$OUT/profile_T$T.json" > /dev/null
  run python -m rheo_engine.runtime.tree_policy "$OUT/profile_T$T.json" | tee "$OUT/break_even_T$T.md"
done

# 3. The goals: default options (auto tree), MT-bench + HumanEval + GSM8K, ar vs the drafters.
for T in 0 1; do
  run python bench/e2e.py --pair smollm2 --chat --sets mt_bench humaneval gsm8k --limit "$LIMIT" \
    --seeds 1 --temperature "$T" --methods ar topk rheo --tree auto --max-new-tokens "$NEW" \
    --threads 1 --out "$OUT/e2e_auto_T$T.json" --md "$OUT/e2e_auto_T$T.md"
done

# 4. The paper's fixed tree (60 nodes, depth 8, topk 10): tau at T = 0 and T = 1.
for T in 0 1; do
  run python bench/e2e.py --pair smollm2 --chat --sets mt_bench humaneval --limit "$LIMIT" \
    --seeds 1 --temperature "$T" --methods topk rheo --tree fixed --max-new-tokens "$NEW" \
    --threads 1 --out "$OUT/e2e_paper_T$T.json" --md "$OUT/e2e_paper_T$T.md"
done

# 5. Against llama.cpp on the same GGUF file and transformers on the same weights.
run python bench/peers.py --pair smollm2 --sets mt_bench humaneval gsm8k --limit 2 \
  --max-new-tokens "$NEW" --temperatures 0 1 --threads 1 \
  --systems llama.cpp "llama.cpp pld" hf ar rheo "rheo fixed" \
  --out "$OUT/peers.json" --md "$OUT/peers.md"
