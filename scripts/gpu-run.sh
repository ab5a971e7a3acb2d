#!/usr/bin/env bash
# Runner packed into gpu-bundle/ by scripts/gpu-bundle.sh; runs on the GPU machine:
#   bash gpu-bundle/run.sh [REPORT_DIR]
# Unpacks the binaries, finds the CUDA 13 libraries, runs the CUDA tests and the kernel
# benchmarks, and writes REPORT_DIR/report.md plus raw logs (default: ./gpu-report).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
report=$(mkdir -p "${1:-gpu-report}" && cd "${1:-gpu-report}" && pwd)
work=$(mktemp -d)
tar -C "$work" -xJf "$here/bundle.tar.xz"
bin=$work/bin

# The libraries the binaries link: driver, cuBLAS(Lt), cuRAND, NVRTC, cudart.
libdirs=()
for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
  if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
    f=$(find /usr/local /usr/lib /usr/lib64 /opt -name "$lib" -print -quit 2>/dev/null)
    if [ -n "$f" ]; then
      libdirs+=("$(dirname "$f")")
    else
      echo "warning: $lib not found" | tee -a "$report/run.log"
    fi
  fi
done
found=$(IFS=:; echo "${libdirs[*]:-}")
export LD_LIBRARY_PATH=$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# What this bundle supports: PTX built with CUDA 13.0 (a driver for CUDA 13.0 or newer) for
# compute capability $built. From 9.0 on, cudaforge (like candle's own kernels) builds the
# arch-specific variant (sm_90a), which runs on that compute capability only; older targets
# are plain PTX, which newer GPUs compile at load time.
built=$(cat "$work/COMPUTE_CAP")
gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -1)
have=$(echo "$gpu" | sed -n 's/.*, *\([0-9]*\)\.\([0-9]*\)$/\1\2/p')
driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\.[0-9]*\).*/\1/p' | head -1)
cc() { echo "$(($1 / 10)).$(($1 % 10))"; }
if [ "$built" -ge 90 ]; then
  supports="GPUs of compute capability $(cc "$built") (sm_${built}a)"
else
  supports="GPUs of compute capability $(cc "$built") or newer"
fi
supports="This bundle runs on $supports with a driver for CUDA 13.0 or newer."
if [ -z "$have" ]; then
  echo "gpu-run: no GPU found (nvidia-smi answered: ${gpu:-nothing}). $supports" | tee -a "$report/run.log" >&2
  exit 2
fi
if [ "$have" -lt "$built" ] || { [ "$built" -ge 90 ] && [ "$have" -ne "$built" ]; }; then
  echo "gpu-run: the GPU is $gpu (compute capability $(cc "$have")). $supports Rebuild it with CUDA_COMPUTE_CAP=$have scripts/gpu-bundle.sh (sm_70 needs a CUDA 12 toolkit)." | tee -a "$report/run.log" >&2
  exit 2
fi
if [ -z "$driver_cuda" ] || [ "${driver_cuda%%.*}" -lt 13 ]; then
  echo "gpu-run: the driver supports CUDA ${driver_cuda:-unknown}. $supports" | tee -a "$report/run.log" >&2
  exit 2
fi

{
  echo "# GPU report"
  echo
  echo "- commit: $(cat "$work/COMMIT"), built for sm_$(cat "$work/COMPUTE_CAP")"
  echo "- device: $(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo unknown), driver for CUDA $driver_cuda"
  echo "- date: $(date -u +%F)"
  echo
  echo "## Tests"
} >"$report/report.md"

status=0
for t in "$bin"/test-*; do
  name=$(basename "$t")
  "$t" --test-threads=1 --nocapture >"$report/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "- $name: exit $rc; $(grep -E '^test result' "$report/$name.log" | tail -1)" >>"$report/report.md"
  grep -h "SKIPPED" "$report/$name.log" | sed 's/^/  - /' >>"$report/report.md"
done

{
  echo
  echo "## Benchmarks (median; GB/s = bytes that must move / time)"
  echo
  echo '```'
  "$bin/myo" bench copy --device cuda --mega-elems 256 2>&1
} >>"$report/report.md"
shapes=(
  "--batch 8 --channels 1536 --len 4096"
  "--batch 8 --channels 1536 --len 4096 --backward"
  "--batch 8 --channels 1536 --len 4096 --shared-a"
  "--batch 8 --channels 1536 --len 4096 --shared-a --backward"
  "--batch 8 --channels 768 --len 4096 --complex --shared-a"
  "--batch 8 --channels 768 --len 4096 --complex --shared-a --backward"
  "--batch 8 --channels 1536 --len 4096 --dtype bf16"
)
tree_shapes=(
  "--batch 16 --heads 256 --leaves 1024 --arity 4"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --backward"
  "--batch 16 --heads 64 --leaves 16384 --arity 2"
  "--batch 16 --heads 64 --leaves 16384 --arity 2 --backward"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --complex"
)
for s in "${shapes[@]}"; do
  # shellcheck disable=SC2086
  "$bin/myo" bench scan --device cuda $s >>"$report/report.md" 2>&1 || status=1
  # shellcheck disable=SC2086
  "$bin/myo" bench scan --device cuda $s --json --no-reference >>"$report/bench.jsonl" 2>/dev/null
done
for s in "${tree_shapes[@]}"; do
  # shellcheck disable=SC2086
  "$bin/myo" bench tree --device cuda $s >>"$report/report.md" 2>&1 || status=1
  # shellcheck disable=SC2086
  "$bin/myo" bench tree --device cuda $s --json --no-reference >>"$report/bench.jsonl" 2>/dev/null
done
echo '```' >>"$report/report.md"
cat "$report/report.md"
rm -rf "$work"
exit $status
