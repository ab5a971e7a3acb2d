#!/usr/bin/env bash
# An nvcc for *checking* the `cuda` feature (cargo clippy/check), as CI does: the build scripts of
# candle-kernels and of this crate compile CUDA kernels that a check never reads (it only
# type-checks the `include_str!` of each PTX file; candle's static MoE/MMQ library is read only
# by a link), and on two cores candle's kernels alone take most of twenty minutes. This stand-in
# writes those outputs empty and passes every other call (`--version`, architecture queries) to
# the real nvcc, $CUDA_ROOT/bin/nvcc. The kernels are compiled for real elsewhere: ours by
# scripts/kernel-resources.sh (CI), all of them by scripts/gpu-bundle.sh.
#
#     eval "$(scripts/cuda-toolchain.sh)"
#     NVCC=$PWD/scripts/nvcc-check.sh cargo clippy --features cuda --target-dir target/cuda-check
#
# Give it a target folder of its own: a binary built there would load empty kernels.
set -euo pipefail

args=("$@")
mode="" out="" dir="." src=""
while [ $# -gt 0 ]; do
  case $1 in
    --ptx) mode=ptx ;;
    -c) mode=obj ;;
    --lib) mode=lib ;;
    -o) out=$2; shift ;;
    --output-directory) dir=$2; shift ;;
    *.cu) src=$1 ;;
  esac
  shift
done

case $mode in
  ptx) : >"${out:-$dir/$(basename "$src" .cu).ptx}" ;;
  obj) : >"$out" ;;
  lib) printf '!<arch>\n' >"$out" ;; # an empty ar archive
  *) exec "${CUDA_ROOT:?set by scripts/cuda-toolchain.sh}/bin/nvcc" "${args[@]}" ;;
esac
