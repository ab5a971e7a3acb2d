#!/usr/bin/env bash
# Runs the randomised tests over seeds FIRST..FIRST+N-1 (MYO_TEST_SEED, which every seeded test
# reads in place of its own default) to hunt for bounds that hold only for some inputs; prints
# each failing seed with its failing tests, and exits 1 if any failed.
#
#   scripts/test-seeds.sh [N=10] [FIRST=1] [cargo test arguments, e.g. --test tree_solve]
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
first=${2:-1}
shift $(( $# < 2 ? $# : 2 ))
cargo test --release --no-run "$@" >/dev/null 2>&1 || { echo "test-seeds: the tests do not build" >&2; exit 2; }
failed=0
for ((s = first; s < first + n; s++)); do
  if out=$(MYO_TEST_SEED=$s cargo test --release "$@" 2>&1); then
    echo "seed $s: ok"
  else
    failed=1
    echo "seed $s: FAILED"
    grep -E "^test .* FAILED|panicked at" <<<"$out" | sed 's/^/  /'
  fi
done
exit $failed
