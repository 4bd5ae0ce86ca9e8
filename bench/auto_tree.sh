#!/usr/bin/env bash
# The auto tree's benchmarks, as BENCHMARKS.md reports them; results and logs go to
# OUT (default bench/results/auto_tree, ignored by git). Needs ../shared/data (or DATA=DIR) and
# makes the widened pair in .cache/widened if it is missing. About 1.5 hours on two cores (the
# widened HumanEval runs take 25 minutes each). Run nothing else meanwhile: ratios are timed.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-results/auto_tree}
DATA=${DATA:+--data $DATA}
mkdir -p "$OUT" plots
python -c "from rheo_engine.io.widen import ensure_widened; ensure_widened('../weights/default')"
e2e() {  # name, then e2e.py arguments
  local name=$1; shift
  python e2e.py $DATA --seeds 1 --tree auto --quiet --out "$OUT/$name.json" --md "$OUT/$name.md" "$@" \
    2>&1 | tee "$OUT/$name.log"
}
for T in 0 1; do
  e2e widened_humaneval_T$T --pair widened --threads 2 --sets humaneval --limit 20 --temperature $T
done
for threads in 1 2; do
  for T in 0 1; do
    e2e default_humaneval_T${T}_threads$threads --pair default --threads $threads --sets humaneval \
      --limit 20 --temperature $T
  done
done
e2e default_six_sets_T1 --pair default --threads 1 --limit 4 --temperature 1
python tree_curve.py $DATA --pair default --threads 1 --limit 4 --max-new-tokens 64 --quiet \
  --png plots/curve_default.png --out "$OUT/curve_default.json" 2>&1 | tee "$OUT/curve_default.log"
for tree in fixed auto; do
  python bench_engine.py --pair default --runs 2 --tree $tree 2>&1 | tee "$OUT/bench_engine_$tree.log"
done
e2e widened_six_sets_T1 --pair widened --threads 2 --limit 4 --temperature 1 --max-new-tokens 64 \
  --methods ar rheo
python tree_curve.py $DATA --pair widened --threads 2 --limit 2 --max-new-tokens 32 --quiet \
  --png plots/curve_widened.png --out "$OUT/curve_widened.json" 2>&1 | tee "$OUT/curve_widened.log"
cd ..
# The cost profiles behind the tables, and the tau each tree needs to break even under them.
python -m rheo_engine.generate --prompt "def quicksort(xs):" --max-new-tokens 8 --temperature 0 \
  --cost-profile "bench/$OUT/profile_default_1thread.json" >/dev/null 2>&1
python -m rheo_engine.runtime.tree_policy "bench/$OUT/profile_default_1thread.json" \
  | tee "bench/$OUT/break_even_default.md"
python -m rheo_engine.generate --target .cache/widened/target --draft .cache/widened/draft \
  --threads 2 --prompt "def quicksort(xs):" --max-new-tokens 8 --temperature 0 \
  --cost-profile "bench/$OUT/profile_widened_2threads.json" >/dev/null 2>&1
python -m rheo_engine.runtime.tree_policy "bench/$OUT/profile_widened_2threads.json" \
  | tee "bench/$OUT/break_even_widened.md"
