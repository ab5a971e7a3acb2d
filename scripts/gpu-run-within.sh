#!/usr/bin/env bash
# Runs the bundle's checks within a time limit on the GPU machine, for a GPU lent for minutes:
#   bash gpu-bundle/run-within.sh SECONDS REPORT_DIR
# First the checks of correctness side by side (their timings are not reported): the CUDA tests
# of the sm_90 build in three groups, the V100 build's section, and compute-sanitizer over the
# head solve and the tree solve's large trees, and (diagnostic, beside them) Nsight Compute on
# the tree kernels' first launches at their target shapes; then, one at a time on an otherwise idle GPU, the
# timed sections: the kernel benchmarks (copy, the tree solve's layouts side by side, the
# layer's head solve; each once, without its plain-candle reference), the training-step profile
# (default size and the sMNIST, ListOps, sCIFAR and Path-X presets, then S5 at the pendulum's
# and Retrieval's if time is left: the timed discretisation and the frames' gather; the
# embedding's gradient over 2 × 4,000 tokens per sample), and the
# step benchmark. Each runner skips what would start past its share of the time
# (MYO_GPU_DEADLINE) and every running check is stopped at it, so REPORT_DIR/report.md, the
# reports joined, is written in time. Knobs: see run.sh.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
limit=${1:?usage: run-within.sh SECONDS REPORT_DIR}
report=$(mkdir -p "${2:?usage: run-within.sh SECONDS REPORT_DIR}" && cd "$2" && pwd)
start=$(date +%s)
# The time $2 percent of the way from $1 (seconds since the epoch) to the end of the limit.
at() { echo $(($1 + (start + limit - 5 - $1) * $2 / 100)); }
export MYO_GPU_WORK=${MYO_GPU_WORK:-$(mktemp -d)}
# Unpacks the bundle and checks the GPU and driver (no section).
bash "$here/run.sh" "$report/unpack" none >/dev/null || { cat "$report/unpack/run.log"; exit 2; }

# Runs run.sh REPORT SECTIONS until the deadline $1 (seconds since the epoch); the environment
# of the call passes through.
part() {
  local end=$1 left
  left=$((end - $(date +%s) + 5))
  [ "$left" -gt 0 ] || left=1
  MYO_GPU_DEADLINE=$end timeout $left bash "$here/run.sh" "$report/$2" "$3" >/dev/null 2>&1
}
sanitize() {
  local s rc log t left end=$1
  s=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f -print -quit 2>/dev/null)
  mkdir -p "$report/sanitizer"
  for t in "cuda_head_solve cuda_head_solve" "cuda_tree_solve cuda_large_trees"; do
    # shellcheck disable=SC2086
    set -- $t
    for tool in memcheck racecheck; do
      if [ -z "$s" ]; then echo "- compute-sanitizer: not found" && return; fi
      left=$((end - $(date +%s)))
      [ "$left" -gt 0 ] || { echo "- $tool, test-$1 $2: skipped (out of time)"; continue; }
      log=$report/sanitizer/$tool-$1.log
      timeout $left "$s" --tool $tool --error-exitcode 9 "$MYO_GPU_WORK/bin/test-$1" \
        "$2" --test-threads=1 >"$log" 2>&1
      rc=$?
      echo "- $tool, test-$1 $2: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$log" | tr '\n' ' ')"
    done
  done >"$report/sanitizer/report.md"
}
# The correctness checks take at most 40% of the limit; the timed parts share what is left,
# 9 : 8 : 3.
end=$(at "$start" 40)
MYO_GPU_TESTS='cuda_tree*' part "$end" tests-tree tests &
MYO_GPU_TESTS='cuda_parity*' part "$end" tests-parity tests &
MYO_GPU_TESTS='cuda_[fghs]*' part "$end" tests-rest tests &
part "$end" v100 v100 &
part "$end" stalls stalls &
sanitize "$end" &
wait
timed=$(date +%s)
MYO_GPU_QUICK=1 MYO_GPU_BENCH='copy|tree|heads' part "$(at "$timed" 45)" bench bench
# The CPU's 16 shards timed at the default size alone: the presets' take the GPU's time.
MYO_GPU_CPU='default' MYO_GPU_PROFILES='default|smnist|scifar|pathx|listops|s5.pendulum|s5.retrieval' part "$(at "$timed" 85)" profile profile
MYO_GPU_QUICK=1 MYO_GPU_BENCH='step' part "$(at "$timed" 100)" step bench

for r in tests-tree tests-parity tests-rest sanitizer v100 stalls bench profile step; do
  echo
  echo "# $r"
  # The header of each part (commit, device) once, at the top.
  if [ "$r" = tests-tree ]; then cat "$report/$r/report.md"; else sed '/^# GPU report/,/^- date/d' "$report/$r/report.md"; fi
done 2>&1 >"$report/report.md"
echo "took $(($(date +%s) - start)) s of $limit" >>"$report/report.md"
cat "$report/report.md"
