"""Subprocess half of test_jax_cp.py (not collected by pytest): what needs a fresh JAX process.

``python jax_worker.py cp R OUT``: JAX with R host devices; for every sharding scheme and K/V
mode, ``tessera.jax.cp_attention`` under ``shard_map`` against the single-device op (outputs,
LSE, gradients of q, k, v and sinks, telemetry records); writes the largest relative errors as
JSON to OUT.

``python jax_worker.py cache DIR SEED OUT``: JAX's persistent compilation cache in DIR; one jitted
training step (forward + backward through ``tessera.jax.attention``) on a plan made from SEED's
documents; writes the cache hits, misses and backend compilations of that step to OUT.
"""

from __future__ import annotations

import json
import os
import sys


def _rel(a, b) -> float:
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


def _records_err(a: dict, b: dict) -> float:
    """Largest relative difference over the numeric fields of two telemetry records."""
    import numpy as np

    worst = 0.0
    for key, x in b.items():
        if key in ("step", "layer", "ranks"):  # ranks: how many devices, checked by the caller
            continue
        y = a.get(key)
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        x = np.atleast_1d(np.asarray(x, np.float64))
        y = np.atleast_1d(np.asarray(y, np.float64))
        if x.shape != y.shape:
            return float("inf")
        with np.errstate(invalid="ignore", divide="ignore"):
            err = np.where(x == y, 0.0, np.abs(x - y) / np.maximum(np.abs(x), 1e-30))
        worst = max(worst, float(err.max(initial=0.0)))
    return worst


def cp(world: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import tessera
    import tessera.cp
    import tessera.jax as tj

    rng = np.random.default_rng(7 + world)
    L, block, B, H, HKV = 512, 32, 2, 4, 2
    ids = np.sort(rng.integers(0, 7, L))
    ids[100:130] = -1  # padding inside the row: fully masked query rows
    ids[-20:] = -1
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=block)
    q = jnp.asarray(rng.standard_normal((B, H, L, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, HKV, L, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, HKV, L, 16)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    w_o = jnp.asarray(rng.standard_normal((B, H, L, 16)), jnp.float32)
    w_l = jnp.asarray(rng.standard_normal((B, H, L)), jnp.float32)
    opts = dict(softcap=20.0, return_lse=True)

    def loss_of(o, lse):
        # LSE of fully masked rows is -inf: weight only the finite ones.
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_l, 0.0))

    def single(q, k, v, s):
        o, lse = tj.attention(q, k, v, plan, sinks=s, **opts)
        return loss_of(o, lse), (o, lse)

    (_, (o1, lse1)), g1 = jax.value_and_grad(single, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    tel = tj.Telemetry(every=1)
    _, _, s1 = tj.attention(q, k, v, plan, sinks=sinks, telemetry=tel.at(0), **opts)
    tel.collect(0, {0: s1}, learned_sinks=True)
    rec1 = tel.read()[0]

    mesh = Mesh(np.array(jax.devices()[:world]), ("cp",))
    spec = P(None, None, "cp")
    results = []
    for scheme in tessera.cp.SCHEMES:
        sh = tessera.cp.shard(plan, world, scheme)
        for mode in tessera.cp.MODES:
            cpp = tj.cp_plan(sh, mode)
            w_os, w_ls = tj.scatter(w_o, sh, axis=2), tj.scatter(w_l, sh, axis=2)

            def body(q, k, v, s, cpp, t, w_o, w_l):
                o, lse, summary = tj.cp_attention(q, k, v, cpp, "cp", mode=mode, sinks=s, telemetry=t, **opts)
                part = jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_l, 0.0))
                return jax.lax.psum(part, "cp"), (o, lse, summary)

            f = jax.shard_map(
                body, mesh=mesh, in_specs=(spec, spec, spec, P(), P(), P(), spec, P(None, None, "cp")),
                out_specs=(P(), (spec, P(None, None, "cp"), P())),
            )
            step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
            qs, ks, vs = (tj.scatter(x, sh, axis=2) for x in (q, k, v))
            (_, (o2, lse2, s2)), g2 = step(qs, ks, vs, sinks, cpp, tel.at(0), w_os, w_ls)
            o2, lse2 = tj.gather(o2, sh, axis=2), tj.gather(lse2, sh, axis=2)
            g2 = [tj.gather(g, sh, axis=2) for g in g2[:3]] + [g2[3]]
            tel.collect(0, {0: s2}, learned_sinks=True)
            rec2 = tel.read()[0]
            fin = np.isfinite(np.asarray(lse1))
            results.append(dict(
                scheme=scheme, mode=mode,
                o=_rel(o2, o1),
                lse=float(np.max(np.abs(np.asarray(lse2)[fin] - np.asarray(lse1)[fin]))),
                lse_masked=bool(np.all(np.asarray(lse2)[~fin] == -np.inf)),
                grads=[_rel(a, b) for a, b in zip(g2, g1)],
                telemetry=_records_err(rec2, rec1),
                ranks=(rec1.get("ranks"), rec2.get("ranks")),
                compiles=step._cache_size(),
            ))
    with open(out, "w") as f:
        json.dump(results, f)


def cache(cache_dir: str, seed: int, out: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import jax.numpy as jnp
    import numpy as np
    from jax._src import monitoring

    import tessera
    import tessera.jax as tj

    # requests: executables the step asked the persistent cache for; each is a hit (loaded,
    # not compiled) or a miss (compiled by XLA, then written).
    counts = {"requests": 0, "hits": 0, "misses": 0}
    names = {
        "/jax/compilation_cache/compile_requests_use_cache": "requests",
        "/jax/compilation_cache/cache_hits": "hits",
        "/jax/compilation_cache/cache_misses": "misses",
    }

    def on_event(name, **_):
        if name in names:
            counts[names[name]] += 1

    monitoring.register_event_listener(on_event)

    rng = np.random.default_rng(seed)
    L, H = 256, 2
    ids = np.sort(rng.integers(0, 5, L))  # another batch: other documents, same shapes
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=64)
    x = jnp.asarray(rng.standard_normal((1, L, H * 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((H * 16, 3 * H * 16)), jnp.float32) * 0.2

    @jax.jit
    def train_step(w, x, plan):
        def loss(w):
            q, k, v = jnp.split((x @ w).reshape(1, L, 3 * H, 16), 3, axis=2)
            o = tj.attention(q, k, v, plan, layout="blhd")
            return jnp.mean(o * o)

        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * grad

    before = dict(counts)
    value, _ = train_step(w, x, plan)
    value = float(value)
    step = {key: counts[key] - before[key] for key in counts}
    with open(out, "w") as f:
        json.dump(dict(step=step, loss=value), f)


if __name__ == "__main__":
    if sys.argv[1] == "cp":
        cp(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "cache":
        cache(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
