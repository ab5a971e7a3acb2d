#!/usr/bin/env bash
# Prints the environment of a build for V100-class GPUs (compute capability 7.0), which CUDA 13
# cannot target:
#
#     eval "$(scripts/cuda-v100-toolchain.sh)"
#     cargo build --release --features cuda --target-dir target/cuda-sm70
#
# Everything that links comes from scripts/cuda-toolchain.sh's CUDA 13.0 (cudarc's bindings,
# the link stubs; the GPU machine's CUDA 13 libraries at run time). The kernels — candle's and
# ours — are compiled by CUDA 11.8's nvcc for compute_70: Debian bookworm's non-free
# `nvidia-cuda-toolkit` packages, downloaded with apt and unpacked into a cache folder, not
# installed. Their PTX (ISA 7.8) runs on a V100, and newer GPUs' drivers JIT-compile it, which
# is how a GPU machine without a V100 runs this build (scripts/gpu-run.sh, section v100).
# Needs Debian bookworm's apt (root, to install g++-11: CUDA 11.8's newest host compiler).
# Cache: $MYO_CUDA_CACHE_11, else ${XDG_CACHE_HOME:-~/.cache}/myosotis/cuda-11.8.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${MYO_CUDA_CACHE_11:-${XDG_CACHE_HOME:-$HOME/.cache}/myosotis/cuda-11.8}
root=$cache/root
bin=$root/usr/lib/nvidia-cuda-toolkit/bin
stamp=$cache/.complete-v1
packages=(nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 libcu++-dev libcub-dev libthrust-dev)

log() { echo "cuda-v100-toolchain: $*" >&2; }

install() {
  if ! command -v g++-11 >/dev/null; then
    log "installing g++-11"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++-11 >&2
  fi
  # A private apt state with bookworm main and non-free: the system's sources stay as they are.
  mkdir -p "$cache/apt/lists/partial" "$cache/debs"
  cat >"$cache/apt/sources.list" <<SOURCES
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main non-free
SOURCES
  local apt=(-o "Dir::Etc::SourceList=$cache/apt/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$cache/apt/lists" -o "Dir::Cache::Archives=$cache/debs" -q)
  apt-get "${apt[@]}" update >&2
  (cd "$cache/debs" && apt-get "${apt[@]}" download "${packages[@]}" >&2)
  rm -rf "$root"
  mkdir -p "$root"
  for deb in "$cache"/debs/*.deb; do
    dpkg-deb -x "$deb" "$root"
  done
  rm -f "$cache"/debs/*.deb
  # The static libraries (2.7 GB) are for linking with nvcc, which this build does not do.
  find "$root/usr/lib" -name '*.a' -delete
  # nvcc reads nvcc.profile beside it; the package's points at /usr.
  rm -f "$bin/nvcc.profile"
  cat >"$bin/nvcc.profile" <<'PROFILE'
TOP                = $(_HERE_)/../../../..
NVVMIR_LIBRARY_DIR = $(_HERE_)/../libdevice
PATH              += $(_HERE_):$(TOP)/usr/bin:
INCLUDES          += "-I$(TOP)/usr/include" $(_SPACE_)
LIBRARIES         =+ $(_SPACE_) "-L$(TOP)/usr/lib/x86_64-linux-gnu"
PROFILE
  "$bin/nvcc" --version >&2
  touch "$stamp"
  log "unpacked into $root"
}

[ -f "$stamp" ] || install

CUDA_COMPUTE_CAP=70 "$repo/scripts/cuda-toolchain.sh"
cat <<ENV
export NVCC="$bin/nvcc"
export NVCC_CCBIN=g++-11
export CUDARC_CUDA_VERSION=13000
ENV
