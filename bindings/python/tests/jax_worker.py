"""Subprocess half of test_jax_cp.py (not collected by pytest): what needs a fresh JAX process.

``python jax_worker.py cp R OUT``: JAX with R host devices; for every sharding scheme and K/V
mode, ``tessera.jax.cp_attention`` under ``shard_map`` against the single-device op (outputs,
LSE, gradients of q, k, v and sinks, telemetry records); writes the largest relative errors as
JSON to OUT.

``python jax_worker.py cp_splash R OUT``: the same with ``backend="splash"`` (Pallas interpret
mode) against the single-device FFI op (telemetry records included), and one compiled step over
five plans.

``python jax_worker.py export_cp R OUT``: the ``shard_map`` context-parallel step exported for a
TPU mesh of R devices from this host (Mosaic kernels, no FFI call or callback, identical bytes
over five plans).

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


def _inputs(rng, b: int, h: int, hkv: int, length: int):
    """Fresh float32 ``q [B, H, L, 32]``, ``k``/``v`` (``[B, Hkv, L, 32]``/``[.., 16]``, GQA and
    Dqk != Dv), sink logits ``[H]`` and the loss weights of O and the LSE."""
    import jax.numpy as jnp

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return (draw(b, h, length, 32), draw(b, hkv, length, 32), draw(b, hkv, length, 16), draw(h),
            draw(b, h, length, 16), draw(b, h, length))


def _loss_of(o, lse, w_o, w_l):
    """A loss over O and the LSE; the LSE of fully masked rows is -inf: only finite ones count."""
    import jax.numpy as jnp

    return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_l, 0.0))


def cp(world: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    import jax
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
    q, k, v, sinks, w_o, w_l = _inputs(rng, B, H, HKV, L)
    opts = dict(softcap=20.0, return_lse=True)

    def loss_of(o, lse):
        return _loss_of(o, lse, w_o, w_l)

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
                part = _loss_of(o, lse, w_o, w_l)
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


def cp_splash(world: int, out: str) -> None:
    """``cp_attention(backend="splash")`` (Pallas interpret mode) under ``shard_map`` on ``world``
    host devices against the single-device FFI op, every scheme and mode (outputs, LSE, gradients
    of q, k, v, sinks; softcap, sinks, GQA, Dqk != Dv, padding rows), then one compiled step over
    five plans of other documents (allgather, one partial-block bound). Writes JSON to OUT."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import tessera
    import tessera.cp
    import tessera.jax as tj

    rng = np.random.default_rng(11 + world)
    block, B, H, HKV = 128, 1, 2, 1
    L = 2 * world * block  # whole tiles, a multiple of 2R for zigzag

    def docs(seed):
        r = np.random.default_rng(seed)
        ids = np.sort(r.integers(0, 5, L))
        ids[L // 2 - 40: L // 2 - 10] = -1  # padding inside the row: fully masked query rows
        return ids

    q, k, v, sinks, w_o, w_l = _inputs(rng, B, H, HKV, L)
    opts = dict(softcap=20.0, return_lse=True)

    loss_of = _loss_of

    mesh = Mesh(np.array(jax.devices()[:world]), ("cp",))
    spec = P(None, None, "cp")

    tel = tj.Telemetry(every=1, sink_tokens=2)

    def make_step(mode):
        def body(q, k, v, s, cpp, t, w_o, w_l):
            o, lse, summary = tj.cp_attention(q, k, v, cpp, "cp", mode=mode, sinks=s, telemetry=t,
                                              backend="splash", **opts)
            return jax.lax.psum(loss_of(o, lse, w_o, w_l), "cp"), (o, lse, summary)

        # check_vma=False: Pallas's interpret mode re-traces the kernel when lowering, where JAX's
        # vma check refuses it (a JAX limitation off TPU; the TPU lowering takes either)
        f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P(), P(), P(), spec, spec),
                          out_specs=(P(), (spec, spec, P())), check_vma=False)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    def reference(plan):
        def single(q, k, v, s):
            o, lse = tj.attention(q, k, v, plan, sinks=s, backend="ffi", **opts)
            return loss_of(o, lse, w_o, w_l), (o, lse)

        out = jax.value_and_grad(single, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
        _, _, s1 = tj.attention(q, k, v, plan, sinks=sinks, telemetry=tel.at(0), backend="ffi", **opts)
        tel.collect(0, {0: s1}, learned_sinks=True)
        return out, tel.read()[0]

    def run(step, plan, sh, mode, bound=None):
        cpp = tj.cp_plan(sh, mode, splash=True, max_partial_blocks=bound)
        qs, ks, vs, wo, wl = (tj.scatter(x, sh, axis=2) for x in (q, k, v, w_o, w_l))
        (_, (o2, lse2, s2)), g2 = step(qs, ks, vs, sinks, cpp, tel.at(0), wo, wl)
        ((_, (o1, lse1)), g1), rec1 = reference(plan)
        tel.collect(0, {0: s2}, learned_sinks=True)
        rec2 = tel.read()[0]
        o2, lse2 = tj.gather(o2, sh, axis=2), tj.gather(lse2, sh, axis=2)
        g2 = [tj.gather(g, sh, axis=2) for g in g2[:3]] + [g2[3]]
        fin = np.isfinite(np.asarray(lse1))
        return dict(
            o=_rel(o2, o1),
            lse=float(np.max(np.abs(np.asarray(lse2)[fin] - np.asarray(lse1)[fin]))),
            lse_masked=bool(np.all(np.asarray(lse2)[~fin] == np.asarray(lse1)[~fin])),
            grads=[_rel(a, b) for a, b in zip(g2, g1)],
            telemetry=_records_err(rec2, rec1),
            ranks=(rec1.get("ranks"), rec2.get("ranks")),
        )

    plan = tessera.plan(tessera.causal() & tessera.document(docs(0)), q_len=L, heads=H, block=block)
    results = []
    for scheme in tessera.cp.SCHEMES:
        sh = tessera.cp.shard(plan, world, scheme)
        for mode in tessera.cp.MODES:
            step = make_step(mode)
            r = run(step, plan, sh, mode)
            results.append(dict(r, scheme=scheme, mode=mode, compiles=step._cache_size()))
    # five plans of other documents, one compiled step
    step = make_step("allgather")
    five = []
    for seed in range(1, 6):
        p = tessera.plan(tessera.causal() & tessera.document(docs(seed)), q_len=L, heads=H, block=block)
        five.append(run(step, p, tessera.cp.shard(p, world, "balanced"), "allgather", bound=32))
    with open(out, "w") as f:
        json.dump(dict(cases=results, five=five, five_compiles=step._cache_size()), f)


def export_cp(world: int, out: str) -> None:
    """The ``shard_map`` context-parallel training step exported for a TPU mesh of ``world``
    devices from this CPU host (``backend="auto"``, ``cp_plan(..., splash=True)``): which Splash
    kernels it carries, whether any FFI call or host callback is left, and whether five plans of
    other documents give the same serialized bytes. Writes JSON to OUT."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import tessera
    import tessera.cp
    import tessera.jax as tj

    L, block, H, HKV, D = 2 * world * 128, 128, 4, 2, 128
    mesh = Mesh(np.array(jax.devices()[:world]), ("cp",))
    spec = P(None, None, "cp")

    def body(q, k, v, s, cpp):
        o = tj.cp_attention(q, k, v, cpp, "cp", mode="allgather", softcap=30.0, sinks=s)
        return jax.lax.psum(jnp.sum(jnp.square(o.astype(jnp.float32))), "cp")

    f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P(), P()), out_specs=P())
    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))
    blobs, text = set(), ""
    for seed in range(5):
        ids = np.sort(np.random.default_rng(seed).integers(0, 6, L))
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=block)
        cpp = tj.cp_plan(tessera.cp.shard(plan, world, "balanced"), "allgather", splash=True,
                         max_partial_blocks=32)
        args = (jax.ShapeDtypeStruct((1, H, L, D), jnp.bfloat16),
                *[jax.ShapeDtypeStruct((1, HKV, L, D), jnp.bfloat16)] * 2,
                jax.ShapeDtypeStruct((H,), jnp.float32),
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), cpp))
        exp = jax.export.export(step, platforms=["tpu"])(*args)
        text = exp.mlir_module()
        blobs.add(bytes(exp.serialize()))
    with open(out, "w") as fh:
        json.dump(dict(kernels=sorted(set(re.findall(r"splash_mha_[a-z_]+", text))),
                       devices=exp.nr_devices, ffi="tessera_attention" in text,
                       callback="callback" in text, identical=len(blobs) == 1), fh)


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
    elif sys.argv[1] == "cp_splash":
        cp_splash(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "export_cp":
        export_cp(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "cache":
        cache(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
