#!/usr/bin/env bash
# Installs a CUDA 13.0 *build* toolchain from PyPI wheels (nvcc, nvvm, headers, CCCL, cudart)
# into a cache folder, adds link stubs for the libraries a binary only needs at link time (the
# driver, cuBLAS, cuBLASLt, cuRAND, NVRTC: the real ones are loaded on the GPU machine), and
# prints the environment to build the `cuda` feature with:
#
#     eval "$(scripts/cuda-toolchain.sh)"
#     cargo build --release --features cuda
#
# Idempotent: a second run only prints the environment. Needs python3 (with pip), gcc, cargo.
# Cache: $MYO_CUDA_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/myosotis/cuda-13.0.
# CUDA_COMPUTE_CAP defaults to 90 (H100/H200); set it first for another GPU (80 for A100).
# CUDA 13 cannot target sm_70 (V100): V100 builds need a CUDA 12.x toolkit (see README).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${MYO_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/myosotis/cuda-13.0}
root=$cache/nvidia/cu13
stamp=$cache/.complete-v1
wheels=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-nvvm==13.0.88
)
# library  soname  cudarc module whose bindings list its functions
stubs=(
  "cuda libcuda.so.1 driver"
  "nvrtc libnvrtc.so.13 nvrtc"
  "curand libcurand.so.10 curand"
  "cublas libcublas.so.13 cublas"
  "cublasLt libcublasLt.so.13 cublaslt"
)

log() { echo "cuda-toolchain: $*" >&2; }

install() {
  mkdir -p "$cache/wheels"
  log "downloading ${#wheels[@]} wheels into $cache/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
    -d "$cache/wheels" "${wheels[@]}" >&2
  for w in "$cache"/wheels/*.whl; do
    python3 -m zipfile -e "$w" "$cache"
  done
  chmod +x "$root"/bin/* "$root"/nvvm/bin/*
  ln -sf libcudart.so.13 "$root/lib/libcudart.so"

  # Link stubs: one empty function per name that cudarc's bindings load from each library.
  local cudarc
  cudarc=$(cd "$repo" && cargo metadata --format-version 1 --features cuda 2>/dev/null |
    python3 -c 'import json,sys,os; m=json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="cudarc"))')
  mkdir -p "$root/lib/stubs"
  local entry lib soname module
  for entry in "${stubs[@]}"; do
    read -r lib soname module <<<"$entry"
    python3 - "$cudarc/src/$module/sys" >"$cache/stub_$lib.c" <<'PY'
import pathlib, re, sys
names = set()
for f in pathlib.Path(sys.argv[1]).glob("*.rs"):
    names.update(re.findall(r'load::<_F>\("(\w+)"\)', f.read_text()))
if not names:
    sys.exit(f"no function names found under {sys.argv[1]}")
print("".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
PY
    gcc -shared -fPIC -Wl,-soname,"$soname" -o "$root/lib/stubs/lib$lib.so" "$cache/stub_$lib.c"
  done
  "$root/bin/nvcc" --version >&2
  touch "$stamp"
  log "installed into $root"
}

[ -f "$stamp" ] || install

cat <<EOF
export CUDA_ROOT="$root"
export CUDA_HOME="$root"
export CUDA_PATH="$root"
export PATH="$root/bin:\$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
EOF
