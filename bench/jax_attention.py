#!/usr/bin/env python3
"""`tessera.jax.attention` (XLA FFI custom calls into Tessera's CPU kernels) next to
`jax.nn.dot_product_attention` with the dense boolean mask, in one process on one CPU.

Case (defaults): B = 1, L = 8192, H = 8, D = 64, float32, causal within documents of ~1K tokens
(seeded), `[B, L, H, D]` layout for both. Timed: the jitted forward, and `jit(grad)` of
`sum(O * W)` with respect to q, k, v. Both sides are jitted functions taking the plan / the mask
as arguments (nothing rebuilt per call); times are medians of `--reps` calls after warm-up
(compilation excluded), each call blocked until its outputs are ready.

Usage: .venv/bin/python bench/jax_attention.py [--len 8192] [--heads 8] [--dim 64] [--doc 1024]
       [--reps 5] [--json]
"""

import argparse
import json
import statistics
import time

import numpy as np

from bench_common import cpu_model, doc_ids  # noqa: E402 (bench/ is the script's directory)


def timed(fn, reps):
    import jax

    jax.block_until_ready(fn())  # compile + warm up
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--doc", type=int, default=1024, help="mean document length")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    import jax
    import jax.numpy as jnp

    import tessera
    import tessera.jax as tj

    L, H, D = a.len, a.heads, a.dim
    ids = doc_ids(L, a.doc)
    t = time.perf_counter()
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, cache=False)
    plan_ms = (time.perf_counter() - t) * 1e3
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, L, H, D)), jnp.float32) for _ in range(4))
    i = np.arange(L)
    mask = jnp.asarray(((i[:, None] >= i[None, :]) & (ids[:, None] == ids[None, :]))[None, None])

    def tess(q, k, v, plan):
        return tj.attention(q, k, v, plan, layout="blhd")

    def dense(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask)

    fwd_t = jax.jit(tess)
    fwd_d = jax.jit(dense)
    grad_t = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(tess(q, k, v, p) * w), argnums=(0, 1, 2)))
    grad_d = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(dense(q, k, v, m) * w), argnums=(0, 1, 2)))

    # Same numbers first (f32: within the documented tolerance of each other, docs/semantics.md#attention).
    o_t, o_d = fwd_t(q, k, v, plan), fwd_d(q, k, v, mask)
    rel = float(jnp.linalg.norm(o_t - o_d) / jnp.linalg.norm(o_d))

    res = {
        "cpu": cpu_model(),
        "jax": jax.__version__,
        "case": dict(B=1, L=L, H=H, D=D, mean_doc=a.doc, dtype="f32", layout="blhd"),
        "density": plan.stats["density"],
        "plan_ms": plan_ms,
        "fwd_rel_diff": rel,
        "fwd_tessera_ms": timed(lambda: fwd_t(q, k, v, plan), a.reps) * 1e3,
        "fwd_dense_ms": timed(lambda: fwd_d(q, k, v, mask), a.reps) * 1e3,
        "grad_tessera_ms": timed(lambda: grad_t(q, k, v, plan), a.reps) * 1e3,
        "grad_dense_ms": timed(lambda: grad_d(q, k, v, mask), a.reps) * 1e3,
    }
    res["fwd_speedup"] = res["fwd_dense_ms"] / res["fwd_tessera_ms"]
    res["grad_speedup"] = res["grad_dense_ms"] / res["grad_tessera_ms"]
    if a.json:
        print(json.dumps(res))
        return
    print(f"CPU: {res['cpu']}  jax {res['jax']}")
    print(f"B=1 L={L} H={H} D={D} f32, causal within ~{a.doc}-token documents "
          f"(density {res['density']:.4f}), plan {plan_ms:.1f} ms; |O_t - O_dense|/|O_dense| = {rel:.2e}")
    print(f"{'':10} {'tessera':>10} {'dense XLA':>10} {'speedup':>8}")
    print(f"{'forward':10} {res['fwd_tessera_ms']:9.1f}ms {res['fwd_dense_ms']:9.1f}ms {res['fwd_speedup']:7.1f}x")
    print(f"{'jit(grad)':10} {res['grad_tessera_ms']:9.1f}ms {res['grad_dense_ms']:9.1f}ms {res['grad_speedup']:7.1f}x")


if __name__ == "__main__":
    main()
