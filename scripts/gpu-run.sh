#!/usr/bin/env bash
# Runner packed into gpu-bundle/ by scripts/gpu-bundle.sh; runs on the GPU machine:
#   bash gpu-bundle/run.sh [REPORT_DIR [SECTIONS]]
# SECTIONS: a comma-separated subset of tests,sanitizer,train,bench,stalls,profile,precision,v100 (default: all of
# them; a run that cannot fit them all in its time splits them over two runs with two report
# directories).
# Unpacks the binaries, finds the CUDA 13 libraries, and checks and records in one call: the
# CUDA tests (kernels against the CPU twin and f64, CPU–CUDA parity of one training step of
# every model), compute-sanitizer's memcheck and racecheck over a scan and a tree test, short
# `myo train --device cuda` runs of every model on generated ListOps and synthetic digits with
# the same runs' steps/s on the CPU, and the kernel benchmarks. Writes REPORT_DIR/report.md,
# REPORT_DIR/bench.jsonl and raw logs (default: ./gpu-report).
#
# To fit a GPU lent for minutes (run-within.sh uses these): MYO_GPU_WORK=DIR unpacks the bundle into DIR
# once and keeps it, so that several runners can share it; MYO_GPU_DEADLINE=SECONDS (since the
# epoch) skips every run that would start after it, with a line in the report, so that the report
# is always written; MYO_GPU_PROFILES and MYO_GPU_TRAIN (extended regular expressions) keep the
# profile rows whose "model|size" and the training rows whose "model|task" they match, and
# MYO_GPU_BENCH (e.g. 'copy|heads|step') the benchmarks of the ops it names; MYO_GPU_QUICK=1
# runs each benchmark once, without its plain-candle reference and bench.jsonl's copy;
# MYO_GPU_CPU (a regular expression on "model|size") the profile rows that also time the CPU.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
report=$(mkdir -p "${1:-gpu-report}" && cd "${1:-gpu-report}" && pwd)
sections=${2:-tests,sanitizer,train,bench,stalls,profile,precision,v100}
want() { [[ ",$sections," == *",$1,"* ]]; }
work=${MYO_GPU_WORK:-$(mktemp -d)}
mkdir -p "$work"
# Unpacked once per folder; the marker is written last, so a runner never reads a half-unpacked one.
if [ ! -e "$work/.unpacked" ]; then
  tar -C "$work" -xJf "$here/bundle.tar.xz" && touch "$work/.unpacked"
fi
bin=$work/bin
# MYO: another myo binary for the train, bench and profile sections (an earlier build, to
# compare).
myo=${MYO:-$bin/myo}

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
} >"$report/report.md"

status=0
# False, with a line in the report, once MYO_GPU_DEADLINE has passed: $1 names what is skipped.
in_time() {
  [ -z "${MYO_GPU_DEADLINE:-}" ] || [ "$(date +%s)" -lt "$MYO_GPU_DEADLINE" ] && return 0
  echo "- skipped, out of time: $1" >>"$report/report.md"
  return 1
}
# Runs the test binaries in $1 (MYO_GPU_TESTS: a glob of them, default all, test-cuda_*;
# MYO_GPU_TEST_FILTER: test-name filters passed to each), logs named with the prefix $2.
run_tests() {
for t in "$1"/test-${MYO_GPU_TESTS:-*}; do
  name=$(basename "$t")
  in_time "$2$name" || continue
  # The NCCL test needs the machine's libnccl (the bundle does not carry it).
  if [ "$name" = test-cuda_nccl ] && ldd "$t" | grep -q 'libnccl.* not found'; then
    nccl=$(find /usr/lib /usr/local /opt /usr/lib64 -name 'libnccl.so.2*' -print -quit 2>/dev/null)
    if [ -z "$nccl" ]; then
      echo "- $name: skipped: no libnccl.so.2 on this machine" >>"$report/report.md"
      continue
    fi
    export LD_LIBRARY_PATH="$(dirname "$nccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  # shellcheck disable=SC2086
  "$t" ${MYO_GPU_TEST_FILTER:-} --test-threads=1 --nocapture >"$report/$2$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "- $name: exit $rc; $(grep -E '^test result' "$report/$2$name.log" | tail -1)" >>"$report/report.md"
  grep -h "SKIPPED" "$report/$2$name.log" | sed 's/^/  - /' >>"$report/report.md"
done
}
want tests && printf '\n## Tests\n\n' >>"$report/report.md" && run_tests "$bin" ""

# compute-sanitizer, where the toolkit has it: memory errors and shared-memory races.
sanitizer=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f -print -quit 2>/dev/null)
want sanitizer && {
  echo
  echo "## compute-sanitizer"
  echo
  if [ -z "$sanitizer" ]; then
    echo "- not found on this machine"
  fi
} >>"$report/report.md"
if want sanitizer && [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    # The tests with small inputs (the others spend minutes in the CPU's dense f64 solves):
    # every kernel forward and backward, the tree solve in shared memory (staged), and in the
    # global workspace (Path-X's tree), d = 1 and d = 3, and the fused AdamW step.
    for t in "test-cuda_scan cuda_half_precision" "test-cuda_fused" \
      "test-cuda_tree_solve cuda_public_backward cuda_singular_pivot cuda_large_trees" \
      "test-cuda_head_solve cuda_head_solve" "test-cuda_parity cuda_optimizer"; do
      # shellcheck disable=SC2086
      set -- $t
      log="$report/sanitizer-$tool-$1.log"
      timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 9 "$bin/$1" "${@:2}" --test-threads=1 >"$log" 2>&1
      rc=$?
      [ $rc -eq 0 ] || status=1
      echo "- $tool, $*: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$log" | tr '\n' ' ')" >>"$report/report.md"
    done
  done
fi

# Training end to end: every model a few hundred steps on CUDA, then the same configuration
# for 20 steps on the CPU; steps/s from each run's own clock (metrics.jsonl: steps and
# seconds at the last training record, evaluation included).
data=$work/data
{ want train || want precision; } && "$myo" data strokes --out "$data/strokes" --train 3200 --test 500 >/dev/null
last_train() { grep '"split":"train"' "$1/metrics.jsonl" | tail -1; }
# The training and validation losses of a run, one per line.
losses() { grep '"split":"\(train\|val\)"' "$1/metrics.jsonl" 2>/dev/null | sed 's/.*"loss":\([^,]*\).*/\1/'; }
field() { sed -n "s/.*\"$2\":\([^,}]*\).*/\1/p" <<<"$1"; }
want train && {
  echo
  echo "## Training (myo train: 2 epochs of 3,200 samples, batch 32 = 200 steps on CUDA, with the steps captured as CUDA graphs and without; 20 steps on the CPU)"
  echo
  echo "| model | task | CUDA: loss epoch 1 → 2, val acc | CUDA steps/s captured | its fastest 50 steps | eager (its losses) | CPU steps/s | CUDA samples/s captured |"
  echo "|---|---|---|---|---|---|---|---|"
} >>"$report/report.md"
runs=(
  "s5|listops|--model s5"
  "myo d=1|listops|--model myo"
  "myo d=2|listops|--model myo --block-size 2"
  "mingru|listops|--model mingru"
  "s5|smnist (strokes)|--model s5 --task smnist --data-dir $data/strokes"
  "myo d=1|zmnist (strokes)|--model myo --task zmnist --data-dir $data/strokes"
  "myo d=2|zmnist (strokes)|--model myo --block-size 2 --task zmnist --data-dir $data/strokes"
  "mingru|smnist (strokes)|--model mingru --task smnist --data-dir $data/strokes"
  "ssm2d|smnist (strokes)|--model ssm2d --task smnist --data-dir $data/strokes"
)
want train && for r in "${runs[@]}"; do
  IFS='|' read -r model task flags <<<"$r"
  [[ "$model|$task" =~ ${MYO_GPU_TRAIN:-.} ]] || continue
  in_time "train $model $task" || continue
  tag=$(echo "$model-$task" | tr -c 'a-z0-9=\n' '_')
  out=$work/runs/$tag
  # shellcheck disable=SC2086
  timeout 100 "$myo" train $flags --device cuda --epochs 2 --max-train-samples 3200 \
    --max-eval-samples 500 --out "$out" --overwrite >"$report/train-$tag.log" 2>&1
  rc=$?
  # The same run with every step eager: its speed, and whether its losses are the captured run's.
  # shellcheck disable=SC2086
  timeout 100 "$myo" train $flags --device cuda --epochs 2 --max-train-samples 3200 \
    --max-eval-samples 500 --out "$out-eager" --overwrite --cuda-graph false >"$report/train-$tag-eager.log" 2>&1
  # shellcheck disable=SC2086
  timeout 60 "$myo" train $flags --device cpu --epochs 1 --max-train-samples 640 \
    --max-eval-samples 32 --out "$out-cpu" --overwrite >"$report/train-$tag-cpu.log" 2>&1
  if [ $rc -ne 0 ] || [ ! -f "$out/metrics.jsonl" ]; then
    status=1
    echo "| $model | $task | failed (exit $rc): $(tail -1 "$report/train-$tag.log") | | | | | |" >>"$report/report.md"
    continue
  fi
  cp "$out/metrics.jsonl" "$report/metrics-$tag.jsonl"
  l1=$(field "$(grep '"split":"train"' "$out/metrics.jsonl" | head -1)" loss)
  t=$(last_train "$out")
  l2=$(field "$t" loss)
  acc=$(field "$(grep '"split":"val"' "$out/metrics.jsonl" | tail -1)" accuracy)
  gpu_sps=$(awk -v s="$(field "$t" step)" -v t="$(field "$t" seconds)" 'BEGIN { printf "%.1f", s / t }')
  gpu_xps=$(awk -v s="$(field "$t" step)" -v t="$(field "$t" seconds)" 'BEGIN { printf "%.0f", 32 * s / t }')
  # The run's clock includes its start, the evaluations and the captures; the step records
  # (every 50 steps) time their stretch alone: the fastest is the steady rate.
  fastest=$(grep '"split":"step"' "$out/metrics.jsonl" | sed -n 's/.*"samples_per_s":\([^,}]*\).*/\1/p' |
    sort -g | tail -1 | awk '{ if ($1 != "") printf "%.1f", $1 / 32 }')
  e=$(last_train "$out-eager" 2>/dev/null)
  eager_sps=$( [ -n "$e" ] && awk -v s="$(field "$e" step)" -v t="$(field "$e" seconds)" 'BEGIN { printf "%.1f", s / t }')
  if [ -z "$e" ]; then
    same="failed"
  elif [ "$(losses "$out")" = "$(losses "$out-eager")" ]; then
    same="the same"
  else
    same="DIFFERENT"
    status=1
  fi
  c=$(last_train "$out-cpu" 2>/dev/null)
  cpu_sps=$( [ -n "$c" ] && awk -v s="$(field "$c" step)" -v t="$(field "$c" seconds)" 'BEGIN { printf "%.2f", s / t }')
  falling=$(awk -v a="$l1" -v b="$l2" 'BEGIN { print (b < a) ? "falling" : "NOT FALLING" }')
  [ "$falling" = falling ] || status=1
  echo "| $model | $task | $l1 → $l2 ($falling), $acc | $gpu_sps | ${fastest:--} | ${eager_sps:-failed} ($same) | ${cpu_sps:-failed} | $gpu_xps |" >>"$report/report.md"
done

if want bench; then
# Each bench command (its arguments), unless MYO_GPU_BENCH leaves its op out or the deadline has
# passed; the kernels' rows also go to bench.jsonl.
bench() {
  [[ "$1" =~ ^(${MYO_GPU_BENCH:-.*})$ ]] || return 0
  in_time "bench $*" || return 0
  if [ "${MYO_GPU_QUICK:-0}" = 1 ]; then
    case $1 in copy | step) ;; *) set -- "$@" --no-reference ;; esac
    "$myo" bench "$@" --device cuda >>"$report/report.md" 2>&1 || status=1
    return 0
  fi
  "$myo" bench "$@" --device cuda >>"$report/report.md" 2>&1 || status=1
  case $1 in scan | tree | heads)
    "$myo" bench "$@" --device cuda --json --no-reference >>"$report/bench.jsonl" 2>/dev/null ;;
  esac
}
{
  echo
  echo "## Benchmarks (median; GB/s = bytes that must move / time)"
  echo
  echo '```'
} >>"$report/report.md"
bench copy --mega-elems 256
shapes=(
  "--batch 8 --channels 1536 --len 4096"
  "--batch 8 --channels 1536 --len 4096 --backward"
  "--batch 8 --channels 1536 --len 4096 --shared-a"
  "--batch 8 --channels 1536 --len 4096 --shared-a --backward"
  "--batch 8 --channels 768 --len 4096 --complex --shared-a"
  "--batch 8 --channels 768 --len 4096 --complex --shared-a --backward"
  "--batch 8 --channels 1536 --len 4096 --dtype bf16"
)
# The CUDA layouts side by side: a block per tree, trees across lanes, and (coefficients shared
# by the batch) the sweep; Path-X's trees and 4 x 4 blocks on 1,024 leaves, which the lanes do
# not hold, only the first and the last. The shapes of the tree solve's targets come first.
lane_shapes=(
  "--batch 16 --heads 256 --leaves 1024 --arity 4"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --backward"
  "--batch 16 --heads 64 --leaves 16384 --arity 2"
  "--batch 16 --heads 64 --leaves 16384 --arity 2 --backward"
  "--batch 16 --heads 64 --leaves 1024 --arity 4 --block 2"
  "--batch 16 --heads 64 --leaves 1024 --arity 4 --block 2 --backward"
  "--batch 16 --heads 16 --leaves 1024 --arity 4 --block 4"
  "--batch 16 --heads 16 --leaves 1024 --arity 4 --block 4 --backward"
  "--batch 16 --heads 64 --leaves 1024 --arity 4"
  "--batch 16 --heads 64 --leaves 1024 --arity 4 --backward"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --complex"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --complex --backward"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --per-sample"
  "--batch 16 --heads 256 --leaves 1024 --arity 4 --per-sample --backward"
  "--batch 16 --heads 16 --leaves 256 --arity 4 --block 4"
  "--batch 16 --heads 16 --leaves 256 --arity 4 --block 4 --backward"
)
tree_shapes=()
for s in "${lane_shapes[@]}"; do
  tree_shapes+=("$s --layout tree")
  case "$s" in *"--leaves 16384"* | *"--leaves 1024 --arity 4 --block 4"*) ;; *) tree_shapes+=("$s --layout lanes") ;; esac
  case "$s" in *--per-sample*) ;; *) tree_shapes+=("$s --layout sweep") ;; esac
done
# shellcheck disable=SC2086
for s in "${shapes[@]}"; do bench scan $s; done
# Where a call's time goes, kernel by kernel, first: the same benchmark under the CUPTI tracer
# at the tree and head solves' target shapes (the layout Auto takes), each kernel's median time and
# launches beside the call's, and how busy the GPU was between them.
breakdown() {
  local op=$1 flags=$2 trace=$work/trace-bench.csv
  [[ "$op" =~ ^(${MYO_GPU_BENCH:-.*})$ ]] && [ -e "$work/lib/libcupti-trace.so" ] || return 0
  in_time "kernel breakdown $op $flags" || return 0
  echo "kernels of: myo bench $op $flags"
  # shellcheck disable=SC2086
  CUDA_INJECTION64_PATH=$work/lib/libcupti-trace.so MYO_CUPTI_TRACE=$trace LD_LIBRARY_PATH=$work/lib:$LD_LIBRARY_PATH \
    timeout 120 "$myo" bench $op $flags --device cuda --warmup 1 --repeats 1 --no-reference 2>&1 | grep median || status=1
  python3 "$bin/cupti-summary.py" "$trace" --by-kernel --top 6 2>&1
  rm -f "$trace"
}
{
  for s in "${lane_shapes[@]:0:3}" "${lane_shapes[10]}" "${lane_shapes[4]}"; do breakdown tree "$s"; done
  for s in "--batch 64 --heads 256" "--batch 64 --heads 256 --backward"; do breakdown heads "$s"; done
} >>"$report/report.md"
# shellcheck disable=SC2086
for s in "${tree_shapes[@]}"; do bench tree $s; done
# The Myo layer's own solve at zMNIST's shape, and at a larger batch and head count.
# shellcheck disable=SC2086
for s in "" "--backward" "--batch 64 --heads 256" "--batch 64 --heads 256 --backward"; do bench heads $s; done
# A training step of the models `myo train` builds by default, at two batch sizes: a time that
# hardly grows with the batch is launch-bound.
# shellcheck disable=SC2086
for s in "--model s5" "--model myo" "--model s5 --batch-size 256" "--model myo --batch-size 256"; do bench step $s; done
echo '```' >>"$report/report.md"
fi
# Where the tree kernels' time goes: Nsight Compute, where the machine has it and it reads the
# counters, on the first launches of the tree solve's kernels at its target shapes (the layout
# Auto takes): duration, occupancy, cycles per issued instruction and ncu's notes on the warp
# stall reasons, the whole output in stalls-*.txt. Diagnostic only: it may run beside other
# checks (time-sliced with their kernels, whose durations it then does not report alone).
if want stalls; then
  printf '\n## Tree kernels under Nsight Compute (first launches; clocks not locked)\n\n' >>"$report/report.md"
  ncu=$(command -v ncu || find /usr/local /opt -name ncu -type f -print -quit 2>/dev/null)
  [ -n "$ncu" ] || echo "- ncu: not found on this machine" >>"$report/report.md"
  stall_shapes=(
    "fwd|^tree_|tree|--batch 16 --heads 256 --leaves 1024 --arity 4"
    "bwd|bwd|tree|--batch 16 --heads 256 --leaves 1024 --arity 4 --backward"
    "pathx-fwd|^tree_|tree|--batch 16 --heads 64 --leaves 16384 --arity 2"
    "complex-fwd|^tree_|tree|--batch 16 --heads 256 --leaves 1024 --arity 4 --complex"
    "d2-fwd|^tree_|tree|--batch 16 --heads 64 --leaves 1024 --arity 4 --block 2"
    "heads-fwd|^head_|heads|--batch 64 --heads 256"
  )
  for r in "${stall_shapes[@]}"; do
    [ -n "$ncu" ] || break
    IFS='|' read -r tag kernels op flags <<<"$r"
    in_time "stalls $tag" || continue
    out=$report/stalls-$tag.txt
    # shellcheck disable=SC2086
    timeout 150 "$ncu" --clock-control none --kernel-name "regex:$kernels" --launch-count 2 \
      --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SpeedOfLight --section SourceCounters "$myo" bench $op $flags --device cuda --warmup 1 --repeats 2 \
      --no-reference >"$out" 2>&1
    echo "- $tag ($op $flags): exit $?" >>"$report/report.md"
    grep -E '^  [a-z_0-9]+_(f32|f64)|Duration  |Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Block Limit|Memory Throughput|stalled|Registers Per' "$out" |
      sed 's/^ */  - /' | cut -c1-400 >>"$report/report.md"
  done
fi

# The training step at the default size and at the presets: time (myo bench step), tensor ops
# and our launches per step (the bench's own count), and from a CUPTI trace of 10 more steps
# (scripts/cupti-trace.c) the kernels per step and the GPU-busy fraction: the kernels' GPU
# time per step over the untraced step's median time; where the step captures, the same for
# 10 replays of its graph.
if want profile; then
{
  echo
  echo "## Training step profile (forward, loss, backward, AdamW; CUPTI kernel trace)"
  echo
  echo "| model | size | CUDA ms/step | steps/s | samples/s | tensor ops/step | our launches | kernels/step (CUPTI) | GPU busy: eager, captured | memory MiB: held + step peak | CPU bench, 16 threads (shards, as myo train): steps/s | captured ms/step (graph kernels; vs eager; graph memory asked / used / reserved MiB) |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
} >>"$report/report.md"
profiles=(
  "s5|default|--model s5|cpu"
  "myo|default|--model myo|cpu"
  "s5|smnist preset|--model s5 --task smnist --preset smnist|cpu"
  "myo|smnist preset|--model myo --task smnist --preset smnist|cpu"
  "s5|listops preset|--model s5 --task listops --preset listops|"
  "myo|listops preset|--model myo --task listops --preset listops|"
  "s5|scifar preset|--model s5 --task scifar --preset scifar|"
  "myo|scifar preset|--model myo --task scifar --preset scifar|"
  "s5|pathx preset|--model s5 --task pathx --preset pathx|"
  "myo|pathx preset|--model myo --task pathx --preset pathx|"
  "s5|pendulum preset|--model s5 --task pendulum --preset pendulum|cpu"
  "s5|retrieval preset|--model s5 --task retrieval --preset retrieval|"
  "myo|retrieval preset|--model myo --task retrieval --preset retrieval|"
)
for r in "${profiles[@]}"; do
  IFS='|' read -r model size flags cpu <<<"$r"
  [[ "$model|$size" =~ ${MYO_GPU_PROFILES:-.} ]] || continue
  in_time "profile $model $size" || continue
  tag=$(echo "$model-$size" | tr -c 'a-z0-9=\n' '_')
  json=$report/step-$tag.json
  # shellcheck disable=SC2086
  if ! timeout 240 "$myo" bench step $flags --device cuda --json >"$json" 2>"$report/step-$tag.log"; then
    status=1
    echo "| $model | $size | failed: $(tail -1 "$report/step-$tag.log") | | | | | | | | | |" >>"$report/report.md"
    continue
  fi
  read -r ms ops ours mem < <(python3 -c '
import json, sys
r = json.load(open(sys.argv[1])); o = r["ops"]; m = r.get("memory")
print(r["step"]["median_ms"], sum(o[k]["tensors"] for k in ("forward", "backward", "optimiser")),
      sum(o[k]["our_launches"] or 0 for k in ("forward", "backward", "optimiser")),
      "-" if m is None else "%.0f+%.0f" % (m["held_mib"], m["peak_mib"]))' "$json")
  # The captured step (CUDA graph): its time, kernels, and whether its replays matched eager steps.
  captured=$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1])).get("captured")
if c is None: print("-")
elif "Err" in c: print("not captured: " + c["Err"].replace("|", "/").replace("\n", " "))
else:
    c = c["Ok"]; d = c["max_difference"]; n = c["nodes"]; g = c["memory"]; mib = 2.0 ** 20
    print("%.2f (%d kernels; %s; %.0f / %.0f / %.0f)" % (c["step"]["median_ms"], n["kernels"],
          "= eager" if d == 0 else "differs by %.1e" % d, n["allocated_bytes"] / mib,
          g["used_high"] / mib, g["reserved_high"] / mib))' "$json")
  batch=$(sed -n 's/.*batch \([0-9]*\).*/\1/p' <<<"$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["shape"])' "$json")")
  # The captured step's median time where it captured: then the trace also holds 10 replays.
  cms=$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1])).get("captured") or {}
print(c["Ok"]["step"]["median_ms"] if "Ok" in c else "")' "$json")
  graph=(--cuda-graph false) replays=()
  [ -n "$cms" ] && graph=() replays=(--replays --replay-ms "$cms")
  trace=$work/trace-$tag.csv
  # shellcheck disable=SC2086
  CUDA_INJECTION64_PATH=$work/lib/libcupti-trace.so MYO_CUPTI_TRACE=$trace LD_LIBRARY_PATH=$work/lib:$LD_LIBRARY_PATH \
    timeout 240 "$myo" bench step $flags --device cuda --warmup 1 --repeats 1 --profile-steps 10 "${graph[@]}" >/dev/null 2>>"$report/step-$tag.log"
  python3 "$bin/cupti-summary.py" "$trace" --steps 10 --step-ms "$ms" "${replays[@]}" --top 25 >"$report/profile-$tag.txt" 2>&1
  gzip -c "$trace" >"$report/trace-$tag.csv.gz" 2>/dev/null || true
  kernels=$(awk '/^steps /{print $3}' "$report/profile-$tag.txt")
  busy=$(sed -n 's/^steps .*busy of the timed step *\([0-9.]*\)%.*/\1%/p' "$report/profile-$tag.txt")
  busy="${busy:-?}, $(sed -n 's/^replays .*busy of the timed step *\([0-9.]*\)%.*/\1%/p' "$report/profile-$tag.txt")"
  busy=${busy%, }
  cpu_sps=
  if [ -n "$cpu" ] && [[ "$model|$size" =~ ${MYO_GPU_CPU:-.} ]]; then
    # shellcheck disable=SC2086
    cpu_ms=$(timeout 300 "$myo" bench step $flags --device cpu --threads 16 --warmup 1 --repeats 3 --json 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["step"]["median_ms"])' 2>/dev/null)
    cpu_sps=$( [ -n "$cpu_ms" ] && awk -v t="$cpu_ms" 'BEGIN { printf "%.1f", 1000 / t }')
  fi
  awk -v m="$model" -v s="$size" -v t="$ms" -v b="$batch" -v o="$ops" -v u="$ours" -v k="${kernels:-?}" -v y="${busy:-?}" -v r="$mem" -v c="${cpu_sps:--}" -v g="$captured" \
    'BEGIN { printf "| %s | %s | %.2f | %.1f | %.0f | %s | %s | %s | %s | %s | %s | %s |\n", m, s, t, 1000 / t, b * 1000 / t, o, u, k, y, r, c, g }' >>"$report/report.md"
done
fi

# Mixed precision: S5 and Myo at the sMNIST preset in f32, bf16 and f16 — the training step
# (myo bench step: time, device memory in use, captured where it can be) and one epoch of
# 3,200 synthetic digits (steps/s from the run's clock, the loss, the steps f16 skipped).
if want precision; then
{
  echo
  echo "## Mixed precision (sMNIST preset; myo bench step, and myo train 1 epoch of 3,200 synthetic digits)"
  echo
  echo "| model | precision | step ms | memory MiB | tensor ops/step | captured ms/step | train steps/s | train loss | skipped steps |"
  echo "|---|---|---|---|---|---|---|---|---|"
} >>"$report/report.md"
for model in s5 myo; do
  for p in f32 bf16 f16; do
    tag=$model-$p
    in_time "precision $model $p" || continue
    json=$report/precision-$tag.json
    flags="--model $model --task smnist --preset smnist --precision $p"
    # shellcheck disable=SC2086
    if ! timeout 240 "$myo" bench step $flags --device cuda --json >"$json" 2>"$report/precision-$tag.log"; then
      status=1
      echo "| $model | $p | failed: $(tail -1 "$report/precision-$tag.log") | | | | | | |" >>"$report/report.md"
      continue
    fi
    read -r ms mem ops captured < <(python3 -c '
import json, sys
r = json.load(open(sys.argv[1])); o = r["ops"]; c = r.get("captured")
cap = "-" if c is None else ("no" if "Err" in c else "%.2f%s" % (c["Ok"]["step"]["median_ms"],
      "" if c["Ok"]["max_difference"] == 0 else "(differs)"))
print("%.2f" % r["step"]["median_ms"], "%.0f" % ((r["memory"] or {}).get("peak_mib", 0)),
      sum(o[k]["tensors"] for k in ("forward", "backward", "optimiser")), cap)' "$json")
    out=$work/runs/precision-$tag
    # shellcheck disable=SC2086
    timeout 200 "$myo" train $flags --data-dir "$data/strokes" --device cuda --epochs 1 \
      --max-train-samples 3200 --max-eval-samples 500 --out "$out" --overwrite >"$report/train-precision-$tag.log" 2>&1
    t=$(last_train "$out" 2>/dev/null)
    if [ -z "$t" ]; then
      status=1
      echo "| $model | $p | $ms | $mem | $ops | $captured | failed: $(tail -1 "$report/train-precision-$tag.log") | | |" >>"$report/report.md"
      continue
    fi
    sps=$(awk -v s="$(field "$t" step)" -v t="$(field "$t" seconds)" 'BEGIN { printf "%.1f", s / t }')
    skipped=$(field "$t" skipped_steps)
    echo "| $model | $p | $ms | $mem | $ops | $captured | $sps | $(field "$t" loss) | ${skipped:--} |" >>"$report/report.md"
  done
done
fi

# The V100 build (compute capability 7.0; CUDA 11.8's PTX, which this GPU's driver compiles at
# load time): the CUDA tests, and each model trained briefly in f32 and in f16 (bf16 is
# refused by a build for compute 7.0). It proves the V100 code path, not its timing.
if want v100; then
  {
    echo
    echo "## V100 build (compute capability 7.0 PTX, JIT-compiled by this GPU's driver)"
    echo
  } >>"$report/report.md"
  if [ ! -d "$work/v100/bin" ]; then
    echo "- not in this bundle (built with MYO_BUNDLE_V100=0)" >>"$report/report.md"
  else
    run_tests "$work/v100/bin" v100-
    echo >>"$report/report.md"
    echo "| model | precision | loss epoch 1 → 2 | steps/s |" >>"$report/report.md"
    echo "|---|---|---|---|" >>"$report/report.md"
    for model in "--model s5" "--model myo" "--model myo --block-size 2" "--model mingru"; do
      for p in f32 f16; do
        in_time "v100 train $model $p" || continue
        tag=v100-$(echo "$model-$p" | tr -c 'a-z0-9=\n' '_')
        out=$work/runs/$tag
        # shellcheck disable=SC2086
        timeout 200 "$work/v100/bin/myo" train $model --precision $p --device cuda --epochs 2 \
          --max-train-samples 1600 --max-eval-samples 200 --out "$out" --overwrite >"$report/train-$tag.log" 2>&1
        rc=$?
        if [ $rc -ne 0 ] || [ ! -f "$out/metrics.jsonl" ]; then
          status=1
          echo "| $model | $p | failed (exit $rc): $(tail -1 "$report/train-$tag.log") | |" >>"$report/report.md"
          continue
        fi
        l1=$(field "$(grep '"split":"train"' "$out/metrics.jsonl" | head -1)" loss)
        t=$(last_train "$out")
        sps=$(awk -v s="$(field "$t" step)" -v t="$(field "$t" seconds)" 'BEGIN { printf "%.1f", s / t }')
        echo "| $model | $p | $l1 → $(field "$t" loss) | $sps |" >>"$report/report.md"
      done
    done
  fi
fi

cat "$report/report.md"
[ -n "${MYO_GPU_WORK:-}" ] || rm -rf "$work"
exit $status
