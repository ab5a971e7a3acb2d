#!/usr/bin/env python3
"""The tree solve of the Myosotis paper's Listing 1 (Appendix A) in JAX, on the CPU: the peer
that `myo bench tree` is compared with (docs/performance.md).

Scalar blocks (d = 1), real, coefficients shared by the batch, one right-hand side, over a k-ary
tree numbered as myosotis numbers it (leaves first, each level's nodes grouped by k in order,
the root last). Per level, as the listing: the children's B̂ = -B / Â and û = ũ / Â, their
messages C B̂ and C û summed into the parents (each level padded to whole groups of k and
summed over them: no scatter), then the root's solve and the
levels back down, x_c = û_c + B̂_c x_parent. The forward is one jitted function; the backward
is JAX's gradient of Σ w ⊙ x with respect to A, B, C and u, jitted with it.

    python3 scripts/jax-tree-peer.py [--batch 16 --heads 64 --leaves 1024 --arity 4]
                                     [--backward] [--repeats 15] [--warmup 3]

Needs `pip install jax` (CPU). Prints the median time in milliseconds, as JSON with --json.
"""
import argparse
import json
import statistics
import time


def levels(leaves, arity):
    """Sizes of the levels, leaves first, of the k-ary tree over `leaves` leaves."""
    sizes = [leaves]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // arity))
    return sizes


def build(sizes, arity):
    import jax
    import jax.numpy as jnp

    starts = [sum(sizes[:k]) for k in range(len(sizes))]

    def to_parents(m, k):
        """Σ over each parent's children of a level's messages: the level padded with zeros
        to whole groups of `arity`, reshaped and summed (the listing's split and sum)."""
        pad = sizes[k + 1] * arity - sizes[k]
        m = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, pad)])
        return m.reshape(m.shape[:-1] + (sizes[k + 1], arity)).sum(-1)

    def solve(a, b, c, u):
        lv = lambda t, k: t[..., starts[k]:starts[k] + sizes[k]]
        ahat, uhat = lv(a, 0), lv(u, 0)
        down = []
        for k in range(len(sizes) - 1):
            bhat = -lv(b, k) / ahat
            uk = uhat / ahat
            ck = lv(c, k)
            ahat = lv(a, k + 1) + to_parents(ck * bhat, k)
            uhat = lv(u, k + 1) - to_parents(ck * uk, k)
            down.append((uk, bhat, k))
        x = uhat / ahat
        xs = [x]
        for uk, bhat, k in reversed(down):
            # Each child reads its parent: the parents repeated `arity` times, cut to the level.
            x = uk + bhat * jnp.repeat(x, arity, axis=-1)[..., :sizes[k]]
            xs.append(x)
        return jnp.concatenate(xs[::-1], axis=-1)

    return solve


def check(arity):
    """Listing 1 against numpy's dense solve of T_G (unit diagonal, B at (v, parent), C at
    (parent, v)) on a ragged tree of 23 leaves, in f64 arithmetic on f32 inputs."""
    import numpy as np

    sizes = levels(23, arity)
    n, starts = sum(sizes), [sum(sizes[:k]) for k in range(len(sizes))]
    rng = np.random.default_rng(0)
    a = 1 + rng.uniform(0, 1, (1, n)).astype(np.float32)
    b, c = (rng.uniform(-0.2, 0.2, (1, n)).astype(np.float32) for _ in range(2))
    u = rng.uniform(-1, 1, (2, 1, n)).astype(np.float32)
    t = np.diag(a[0].astype(np.float64))
    for k in range(len(sizes) - 1):
        for j in range(sizes[k]):
            v, p = starts[k] + j, starts[k + 1] + j // arity
            t[v, p], t[p, v] = b[0, v], c[0, v]
    want = np.linalg.solve(t, u[:, 0].T.astype(np.float64)).T
    got = np.asarray(build(sizes, arity)(a, b, c, u))[:, 0]
    err = np.abs(got - want).max() / np.abs(want).max()
    if not err < 1e-5:
        raise SystemExit(f"Listing 1 disagrees with the dense solve: relative error {err:.2e}")
    print(f"check: Listing 1 = dense solve to {err:.1e} (ragged {arity}-ary tree of 23 leaves)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--leaves", type=int, default=1024)
    p.add_argument("--arity", type=int, default=4)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="first compare one small solve with a dense solve of the assembled T_G")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    if args.check:
        check(args.arity)
    sizes = levels(args.leaves, args.arity)
    n = sum(sizes)
    solve = build(sizes, args.arity)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    h, bt = args.heads, args.batch
    # Diagonally dominant: A = 1, |B|, |C| < 1 / (1 + k).
    s = 0.9 / (1 + args.arity)
    a = jnp.ones((h, n), jnp.float32)
    b = jax.random.uniform(keys[0], (h, n), jnp.float32, -s, s)
    c = jax.random.uniform(keys[1], (h, n), jnp.float32, -s, s)
    u = jax.random.uniform(keys[2], (bt, h, n), jnp.float32, -1, 1)
    w = jax.random.uniform(keys[3], (bt, h, n), jnp.float32, -1, 1)
    if args.backward:
        loss = lambda a, b, c, u: jnp.sum(w * solve(a, b, c, u))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    else:
        step = jax.jit(solve)
    for _ in range(args.warmup):
        jax.block_until_ready(step(a, b, c, u))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(a, b, c, u))
        times.append((time.perf_counter() - t0) * 1e3)
    what = "forward+backward" if args.backward else "forward"
    med = statistics.median(times)
    if args.json:
        print(json.dumps(dict(vars(args), unit=what, nodes=n, median_ms=med, min_ms=min(times),
                              jax=jax.__version__, device=str(jax.devices()[0]))))
    else:
        print(f"jax Listing 1 {what}  (batch {bt}, heads {h}, {args.leaves} leaves, "
              f"{args.arity}-ary, {n} nodes, d 1, r 1) f32 real, coefficients shared, "
              f"jax {jax.__version__} on {jax.devices()[0]}")
        print(f"  median {med:.3g} ms  (min {min(times):.3g}, {args.repeats} samples)")


if __name__ == "__main__":
    main()
