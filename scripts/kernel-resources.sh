#!/usr/bin/env bash
# Compiles kernels/*.cu for the GPUs we target and prints ptxas's resources per kernel
# (registers, spill stores and loads, stack, static shared memory) and, from the compute_70 PTX,
# its generic memory accesses (loads, stores and atomics through a pointer whose space, global
# or shared, the compiler could not tell: slower than either, and ordered with every access
# they might alias); fails when a kernel spills or makes a generic access.
#
#   scripts/kernel-resources.sh [sm_70] [sm_90]      (default: both)
#
# With MYO_KERNEL_BOUNDS=FILE the sm_70 pass also writes FILE: each kernel's most threads per
# block, from the PTX, which the host harness (tests/kernels_on_cpu) then holds every launch to.
# sm_90 (Hopper): nvcc from scripts/cuda-toolchain.sh (CUDA 13), as build.rs compiles.
# sm_70 (V100): CUDA 13 no longer targets it, and PyPI has no CUDA 12 nvcc front end, so the
# CUDA 12.6 wheels of NVRTC (C++ to PTX for compute_70), ptxas and the runtime headers are
# installed into a cache (~45 MB) and the kernels compiled with NVRTC, then ptxas.
# Cache: $MYO_CUDA12_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/myosotis/cuda-12.6.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(sm_70 sm_90)
# The flags of build.rs.
flags=(-std=c++17)

# ptxas -v output on stdin -> a table; exit 1 when a kernel spills.
report_py=$(cat <<'PY'
import re, sys
rows, cur, generic = {}, None, {}
for line in sys.stdin:
    m = re.match(r"generic-access (\w+) (\d+)$", line.strip())
    if m:
        generic[m.group(1)] = generic.get(m.group(1), 0) + int(m.group(2))
        continue
    m = re.search(r"Compiling entry function .(\w+). for .(\w+).", line)
    if m:
        cur = m.group(1)
        rows[cur] = dict(regs=0, st=0, ld=0, stack=0, smem=0)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and cur:
        rows[cur].update(stack=int(m.group(1)), st=int(m.group(2)), ld=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", line)
    if m and cur:
        s = re.search(r"(\d+) bytes smem", line)
        rows[cur].update(regs=int(m.group(1)), smem=int(s.group(1)) if s else 0)
if not rows:
    sys.exit("no ptxas report read")
print(f"{'kernel':18} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>6} "
      f"{'generic':>7}")
for k in sorted(rows):
    r = rows[k]
    print(f"{k:18} {r['regs']:5} {r['st']:9} {r['ld']:9} {r['stack']:6} {r['smem']:6} "
          f"{generic.get(k, 0):7}")
bad = [k for k, r in rows.items() if max(r["st"], r["ld"]) > 0]
if bad:
    sys.exit("spills: " + ", ".join(sorted(bad)))
slow = [k for k, n in generic.items() if n > 0]
if slow:
    sys.exit("generic memory accesses: " + ", ".join(f"{k} ({generic[k]})" for k in sorted(slow)))
print(f"{len(rows)} kernels, no spills" + (", no generic memory accesses" if generic else ""))
PY
)
report() { python3 -c "$report_py"; }

# A PTX file -> "generic-access KERNEL N" per function: its ld, st, atom and red instructions
# that name no state space.
generic_py=$(cat <<'PY'
import re, sys
counts, cur = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"\s*(?:\.visible\s+)?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)", line)
    if m:
        cur = m.group(1)
        counts.setdefault(cur, 0)
        continue
    m = re.match(r"\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red)\.([\w.]+)", line)
    if m and cur and not set(m.group(1).split(".")) & {"global", "shared", "local", "param", "const"}:
        counts[cur] += 1
for k, n in counts.items():
    print(f"generic-access {k} {n}")
PY
)
generic_accesses() { python3 -c "$generic_py" "$1"; }

# A PTX file -> "KERNEL THREADS" per kernel: the most threads per block it is compiled for (its
# .maxntid, from __launch_bounds__; else CUDA's 1,024).
bounds_py=$(cat <<'PY'
import re, sys
cur = None
for line in open(sys.argv[1]):
    m = re.match(r"\s*(?:\.visible\s+)?\.entry\s+(\w+)", line)
    if m:
        cur, most = m.group(1), 1024
        continue
    m = re.match(r"\s*\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", line)
    if m and cur:
        most = int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    if line.strip().startswith("{") and cur:
        print(cur, most)
        cur = None
PY
)

sm_90() {
  if ! command -v nvcc >/dev/null; then
    eval "$("$repo/scripts/cuda-toolchain.sh")"
  fi
  echo "== sm_90: $(nvcc --version | tail -1)"
  for cu in "$repo"/kernels/*.cu; do
    nvcc -arch=sm_90 -cubin "${flags[@]}" -O3 -Xptxas -v "$cu" -o /dev/null 2>&1
  done | report
}

sm_70() {
  local cache=${MYO_CUDA12_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/myosotis/cuda-12.6}
  if [ ! -f "$cache/.complete-v1" ]; then
    mkdir -p "$cache/wheels"
    echo "kernel-resources: downloading the CUDA 12.6 NVRTC, ptxas and headers into $cache" >&2
    python3 -m pip download -q --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_12_x86_64 --platform manylinux_2_5_x86_64 -d "$cache/wheels" \
      nvidia-cuda-nvrtc-cu12==12.6.85 nvidia-cuda-nvcc-cu12==12.6.85 \
      nvidia-cuda-runtime-cu12==12.6.77 >&2
    for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache"; done
    chmod +x "$cache"/nvidia/cuda_nvcc/bin/ptxas
    touch "$cache/.complete-v1"
  fi
  local nv=$cache/nvidia ptx
  ptx=$(mktemp -d)
  echo "== sm_70: NVRTC and $("$nv"/cuda_nvcc/bin/ptxas --version | tail -1)"
  [ -z "${MYO_KERNEL_BOUNDS:-}" ] || : >"$MYO_KERNEL_BOUNDS"
  for cu in "$repo"/kernels/*.cu; do
    python3 - "$nv/cuda_nvrtc/lib/libnvrtc.so.12" "$cu" "$ptx/$(basename "$cu").ptx" \
      --gpu-architecture=compute_70 "${flags[@]}" -I"$repo/kernels" \
      -I"$nv/cuda_runtime/include" <<'PY'
import ctypes, sys
nvrtc = ctypes.CDLL(sys.argv[1])
src, out, opts = sys.argv[2], sys.argv[3], [o.encode() for o in sys.argv[4:]]
prog = ctypes.c_void_p()
assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(), src.encode(), 0, None, None) == 0
rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
n = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
nvrtc.nvrtcGetProgramLog(prog, log)
# NVRTC 12.6 warns that sm_70 is deprecated; anything else is shown.
text = "\n".join(l for l in log.value.decode().splitlines() if "deprecated" not in l).strip()
if text:
    print(text, file=sys.stderr)
if rc != 0:
    sys.exit(f"NVRTC could not compile {src}")
nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
nvrtc.nvrtcGetPTX(prog, ptx)
open(out, "wb").write(ptx.value)
PY
    generic_accesses "$ptx/$(basename "$cu").ptx"
    [ -z "${MYO_KERNEL_BOUNDS:-}" ] ||
      python3 -c "$bounds_py" "$ptx/$(basename "$cu").ptx" >>"$MYO_KERNEL_BOUNDS"
    "$nv"/cuda_nvcc/bin/ptxas -v --gpu-name sm_70 "$ptx/$(basename "$cu").ptx" -o /dev/null 2>&1
  done | report
  rm -rf "$ptx"
}

for a in "${archs[@]}"; do
  case $a in
    sm_70) sm_70 ;;
    sm_90) sm_90 ;;
    *) echo "kernel-resources: unknown target $a (sm_70 or sm_90)" >&2; exit 2 ;;
  esac
done
