#!/usr/bin/env bash
# Builds the CUDA test binaries (tests/cuda_*.rs) and `myo` in release and packs them, with a runner,
# into gpu-bundle/ (git-ignored, well under 64 MiB), to carry to a GPU machine that has the CUDA
# libraries but no Rust toolchain. There:   bash gpu-bundle/run.sh [REPORT_DIR]
#
# The same binaries are built again for V100-class GPUs (compute capability 7.0) with
# scripts/cuda-v100-toolchain.sh (CUDA 11.8's nvcc for the kernels) and packed under v100/:
# the runner's v100 section runs them on the GPU at hand, whose driver compiles their PTX.
# MYO_BUNDLE_V100=0 leaves them out.
#
# Uses nvcc from PATH if present, else scripts/cuda-toolchain.sh. CUDA_COMPUTE_CAP defaults to
# 90 (H100/H200).
#
# The NCCL smoke test (tests/cuda_nccl.rs, `--features nccl`) is built too when a libnccl can be
# linked: NCCL_LIB=DIR (a folder with libnccl.so.2, e.g. nvidia/nccl/lib of pip's
# nvidia-nccl-cu13 wheel) or one the linker finds. libnccl itself (~330 MB) is not packed: the
# GPU machine's own is used, and the runner says when it has none.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if ! command -v nvcc >/dev/null; then
  eval "$(scripts/cuda-toolchain.sh)"
fi
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
target=target/cuda

# Builds `myo` and the GPU tests in the target folder $1; prints each test's name and binary.
build() {
  cargo build --release --features cuda --target-dir "$1" --bin myo >&2
  # Only the GPU tests' binaries (the rest of the suite runs in CI on the CPU).
  cargo test --release --features cuda --target-dir "$1" --test 'cuda_*' --no-run \
    --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    # cuda_nccl has tests only with the nccl feature, built below.
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t["kind"] == ["test"] \
            and t["name"] != "cuda_nccl":
        print(t["name"], m["executable"])'
}
tests=$(build "$target")
[ -n "$tests" ] || { echo "gpu-bundle: no test binaries were built" >&2; exit 1; }
v100_target=target/cuda-sm70
v100_tests=
if [ "${MYO_BUNDLE_V100:-1}" != 0 ]; then
  v100_env=$(scripts/cuda-v100-toolchain.sh)
  v100_tests=$(eval "$v100_env" && build "$v100_target")
  [ -n "$v100_tests" ] || { echo "gpu-bundle: no V100 test binaries were built" >&2; exit 1; }
fi

# NCCL: its own target folder (the nccl feature changes cudarc and so rebuilds candle).
nccl_test=
linker_dir=$(mktemp -d)
if [ -n "${NCCL_LIB:-}" ] && [ -e "$NCCL_LIB/libnccl.so.2" ]; then
  ln -s "$NCCL_LIB/libnccl.so.2" "$linker_dir/libnccl.so"
fi
if [ -e "$linker_dir/libnccl.so" ] || ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_test=$(LIBRARY_PATH="$linker_dir${LIBRARY_PATH:+:$LIBRARY_PATH}" cargo test --release \
    --features cuda,nccl --target-dir "$target-nccl" --test cuda_nccl --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])')
fi
rm -rf "$linker_dir"
[ -n "$nccl_test" ] || echo "gpu-bundle: no libnccl to link (set NCCL_LIB=DIR): the NCCL smoke test is left out" >&2

out=$repo/gpu-bundle
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin"
cp "$target/release/myo" "$stage/bin/myo"
while read -r name exe; do cp "$exe" "$stage/bin/test-$name"; done <<<"$tests"
[ -z "$nccl_test" ] || cp "$nccl_test" "$stage/bin/test-cuda_nccl"
if [ -n "$v100_tests" ]; then
  mkdir -p "$stage/v100/bin"
  cp "$v100_target/release/myo" "$stage/v100/bin/myo"
  while read -r name exe; do cp "$exe" "$stage/v100/bin/test-$name"; done <<<"$v100_tests"
  echo 70 >"$stage/v100/COMPUTE_CAP"
  strip "$stage"/v100/bin/*
fi
strip "$stage"/bin/*

# The CUPTI tracer of the profile section (kernels per step, GPU-busy fraction), built against
# the CUPTI of the CUDA 13.0 wheels; its libcupti.so.13 travels with it.
cupti=${MYO_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/myosotis}/cupti-13.0
if [ ! -e "$cupti/nvidia/cu13/lib/libcupti.so.13" ]; then
  mkdir -p "$cupti"
  python3 -m pip download -q --no-deps -d "$cupti" nvidia-cuda-cupti==13.0.85
  unzip -qo "$cupti"/nvidia_cuda_cupti-*.whl -d "$cupti"
fi
mkdir -p "$stage/lib"
gcc -O2 -shared -fPIC -Wall -I "$cupti/nvidia/cu13/include" -I "$(dirname "$(command -v nvcc)")/../include" \
  scripts/cupti-trace.c -o "$stage/lib/libcupti-trace.so" -L "$cupti/nvidia/cu13/lib" -l:libcupti.so.13
cp "$cupti/nvidia/cu13/lib/libcupti.so.13" "$stage/lib/"
cp scripts/cupti-summary.py "$stage/bin/"
git describe --always --dirty >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"
echo "$CUDA_COMPUTE_CAP" >"$stage/COMPUTE_CAP"

rm -rf "$out"
mkdir -p "$out"
# Every binary embeds the same ~33 MB CUDA fatbin (candle-kernels' MoE kernels, linked in
# with candle-nn): a 256 MiB window lets xz store it once (984 MB → 16 MB, not 117 MB; about
# 7 minutes on 2 cores; 256 MiB of memory to unpack).
tar -C "$stage" -cf - . | xz -T1 --lzma2=preset=6,dict=256MiB >"$out/bundle.tar.xz"
size=$(stat -c %s "$out/bundle.tar.xz")
if [ "$size" -gt $((64 << 20)) ]; then
  echo "gpu-bundle: $out/bundle.tar.xz is $((size >> 20)) MiB, over the 64 MiB a device run can carry" >&2
  exit 1
fi
cp scripts/gpu-run.sh "$out/run.sh"
cp scripts/gpu-run-within.sh "$out/run-within.sh"
chmod +x "$out/run.sh" "$out/run-within.sh"
du -h "$out"/* >&2
echo "gpu-bundle: ready in $out (commit $(cat "$stage/COMMIT"), sm_$CUDA_COMPUTE_CAP): see" \
  "the first lines of its run.sh for the GPUs and drivers it supports" >&2
