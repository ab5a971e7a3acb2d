#!/usr/bin/env python3
"""Kernels per training step and the GPU-busy fraction, from a trace of scripts/cupti-trace.c.

`myo bench step --profile-steps K` ends with four windows of GPU work, each after an idle
pause of 200 ms: K whole training steps back to back, then one forward pass, one backward pass
and one optimiser step, each alone. On CUDA with the step captured (`--cuda-graph true`), a
fifth window comes before them: K replays of the captured step. This script splits the trace
at pauses longer than --gap-ms and reads the last four windows, or five with --replays:

    cupti-summary.py TRACE --steps K [--step-ms T] [--replays [--replay-ms T]] [--top N]

With --by-kernel instead (any program's trace, e.g. a kernel benchmark's), the last window
alone: per kernel name its launches, median and shortest GPU time, and share of the kernel
time, and busy = kernel time over the window's span (below 100%: the GPU waited on the host
between kernels):

    cupti-summary.py TRACE --by-kernel [--top N]

Per window: kernels (and memcpy/memset) per step, the sum of their GPU times per step, and
busy = that sum over the window's span (first start to last end). With --step-ms (the bench's
median step time without the tracer; --replay-ms for the captured step) busy is also given
against it. --top lists the kernels that take the most GPU time in the K eager steps, then
those that launch most often.
"""
import argparse
import collections
import sys


def read(path):
    events = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(",", 3)
            if len(parts) == 4 and parts[0] in "KMS":
                events.append((int(parts[1]), int(parts[2]), parts[0], parts[3]))
    events.sort()
    return events


def windows(events, gap_ns):
    out, cur, last_end = [], [], 0
    for e in events:
        if cur and e[0] - last_end > gap_ns:
            out.append(cur)
            cur = []
        last_end = max(last_end, e[1]) if cur else e[1]
        cur.append(e)
    if cur:
        out.append(cur)
    return out


def by_kernel(trace, ws, top):
    kernels = [e for e in ws[-1] if e[2] == "K"] if ws else []
    if not kernels:
        sys.exit(f"cupti-summary: {trace} has no kernels")
    times = collections.defaultdict(list)
    for e in kernels:
        times[e[3]].append(e[1] - e[0])
    busy_ns = sum(sum(t) for t in times.values())
    span_ns = max(e[1] for e in ws[-1]) - ws[-1][0][0]
    print(
        f"{len(kernels)} kernels in {span_ns / 1e6:.3f} ms, kernel time "
        f"{busy_ns / 1e6:.3f} ms, busy {100 * busy_ns / max(span_ns, 1):5.1f}%"
    )
    print("  median µs   min µs  launches  share  kernel")
    ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    for name, t in ranked[: top or len(ranked)]:
        t = sorted(t)
        print(
            f"  {t[len(t) // 2] / 1e3:9.2f} {t[0] / 1e3:8.2f}  {len(t):8d} "
            f"{100 * sum(t) / busy_ns:5.1f}%  {name[:100]}"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int)
    p.add_argument("--by-kernel", action="store_true")
    p.add_argument("--step-ms", type=float)
    p.add_argument("--replays", action="store_true")
    p.add_argument("--replay-ms", type=float)
    p.add_argument("--gap-ms", type=float, default=100.0)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    events = read(a.trace)
    ws = windows(events, a.gap_ms * 1e6)
    if a.by_kernel:
        return by_kernel(a.trace, ws, a.top)
    if a.steps is None:
        p.error("--steps is required without --by-kernel")
    labels = ["steps", "forward", "backward", "optimiser"]
    steps = [a.steps, 1, 1, 1]
    timed = {"steps": a.step_ms}
    if a.replays:
        labels.insert(0, "replays")
        steps.insert(0, a.steps)
        timed["replays"] = a.replay_ms
    if len(ws) < len(labels):
        sys.exit(
            f"cupti-summary: {a.trace} has {len(ws)} windows of GPU work, "
            f"expected {len(labels)} at its end"
        )
    for label, w, n in zip(labels, ws[-len(labels):], steps):
        kernels = [e for e in w if e[2] == "K"]
        copies = [e for e in w if e[2] != "K"]
        busy_ns = sum(e[1] - e[0] for e in kernels)
        span_ns = max(e[1] for e in w) - w[0][0]
        line = (
            f"{label:9s} kernels/step {len(kernels) / n:7.1f}  memcpy+memset/step "
            f"{len(copies) / n:5.1f}  kernel time/step {busy_ns / n / 1e6:8.3f} ms  "
            f"span/step {span_ns / n / 1e6:8.3f} ms  busy {100 * busy_ns / max(span_ns, 1):5.1f}%"
        )
        if timed.get(label):
            line += f"  busy of the timed step {100 * busy_ns / n / 1e6 / timed[label]:5.1f}%"
        print(line)
    counts = collections.Counter(e[3] for e in ws[-4] if e[2] == "K")
    times = collections.Counter()
    for e in ws[-4]:
        if e[2] == "K":
            times[e[3]] += e[1] - e[0]
    total = max(sum(times.values()), 1)
    if a.top:
        print(f"kernels by GPU time per step (of {len(times)} kinds): µs/step, share, launches/step")
        for name, t in times.most_common(a.top):
            print(
                f"  {t / a.steps / 1e3:9.1f}  {100 * t / total:5.1f}%  {counts[name] / a.steps:6.1f}"
                f"  {name[:100]}"
            )
        print(f"most launched kernels per step (of {len(counts)} kinds):")
        for name, c in counts.most_common(a.top):
            print(f"  {c / a.steps:7.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
