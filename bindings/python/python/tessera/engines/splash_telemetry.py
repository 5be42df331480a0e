"""Telemetry on the Splash route (docs/semantics.md#telemetry): the Tessera kernel's per-head summary row computed
in JAX from Splash's outputs plus one block-sparse pass over the plan's active tiles.

From Splash's returned O and LSE (the LSE including the learned sink): learned-sink mass
``exp(σ − LSE)``, max |O|, Σ O², element and outlier counts. One pass over the tiles the plan
marks non-empty (a ``fori_loop`` over q-tile rows, a ``fori_loop`` over the row's kv tiles, each
tile computed only when some (batch group, head) has it non-empty: ``lax.cond``, so memory is one
``[B, Hq, tq, tk]`` tile and the work is the active tiles') recomputes the scores and adds, per
query row, the mass on the sink keys ``Σ_j p_j [j is a sink key]``, ``Σ_j p_j (LSE − s_j)`` (the
entropy over the keys) and the largest pre-softcap logit. The learned sink's share of the entropy
is ``p_σ (LSE − σ)``. Rows with no allowed key count nowhere (``valid``), as in the kernel.

Sums are float32 (pairwise, XLA's reduction), written as the kernel's (hi, lo) float32 pairs with
``lo = 0``; the records they give equal the FFI route's to about 1e-7 relative.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from .. import _tessera




def summary(
    q: Any, k: Any, o: Any, lse: Any, sinks: Optional[Any], arrays: Sequence[Any], kv_pos: Any, *,
    block: Sequence[int], batched: bool, scale: float, softcap: Optional[float], tel: Any,
) -> Any:
    """The per-head stats ``float32 [Hq, TELEMETRY_COLUMNS, 2]`` ((hi, lo) pairs: valid rows, Σ sink
    mass, Σ learned-sink mass, Σ entropy, max logit, max |O|, Σ O², O elements, outliers).

    ``q [B, Hq, Lq, D]`` unscaled, ``k [B, Hkv, Lkv, D]``, ``o`` and ``lse`` the route's results
    (``lse`` with the sink), ``arrays`` the SplashInfo leaves with their group axis (``[G, ...]``;
    ``batched``: G is B), ``kv_pos`` ``[B' or 1, Lkv]`` (``tessera.core.plans.sink_positions``)."""
    f32 = jnp.float32
    b, hq, lq, d = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    tq, tk = block
    nq, nk = -(-lq // tq), -(-lkv // tk)
    _, mnext, bmask, pblocks = arrays[:4]  # the forward MaskInfo
    valid = _by_batch_head(arrays[8][..., :lq], b, hq, batched)  # [B, Hq, Lq]
    lse_v = jnp.where(valid, lse, 0.0)
    # the tile pass: the max logit always, the sink stream's sums when it is on
    qp = _pad(q.astype(f32), nq * tq)
    kp = _pad(k.astype(f32), nk * tk)
    lse_p = _pad(lse_v[..., None], nq * tq)[..., 0]
    pos = jnp.broadcast_to(kv_pos, (b if kv_pos.shape[0] > 1 else 1, lkv))
    flags = _pad_last((pos >= 0) & (pos < tel.sink_tokens), nk * tk)  # [B or 1, Lkv_p]
    rows_in = jnp.arange(nq * tq) < lq
    cols_in = jnp.arange(nk * tk) < lkv

    def tile(i, j, acc):
        sink_sum, ent_sum, mx = acc
        qi = jax.lax.dynamic_slice_in_dim(qp, i * tq, tq, axis=2)
        kj = jax.lax.dynamic_slice_in_dim(kp, j * tk, tk, axis=2)
        # GQA: query head h reads kv head h // (Hq / Hkv) (K is never repeated)
        qg = qi.reshape(b, hkv, hq // hkv, tq, d)
        raw = jnp.einsum("bkgqd,bktd->bkgqt", qg, kj, precision="highest").reshape(b, hq, tq, tk) * scale
        s = raw if softcap is None else softcap * jnp.tanh(raw / softcap)
        state = _by_batch_head(bmask[:, :, i, j], b, hq, batched)[..., None, None]  # [B, Hq, 1, 1]
        bits = pblocks[jnp.arange(pblocks.shape[0])[:, None], mnext[:, :, i, j]]  # [G, H', tq, tk]
        bits = _by_batch_head(bits, b, hq, batched)
        inside = (jax.lax.dynamic_slice_in_dim(rows_in, i * tq, tq)[:, None]
                  & jax.lax.dynamic_slice_in_dim(cols_in, j * tk, tk)[None, :])
        allowed = ((state == 2) | ((state == 1) & bits)) & inside
        li = jax.lax.dynamic_slice_in_dim(lse_p, i * tq, tq, axis=2)[..., None]
        p = jnp.where(allowed, jnp.exp(s - li), 0.0)
        fj = jax.lax.dynamic_slice_in_dim(flags, j * tk, tk, axis=1)[:, None, None, :]
        sink_sum = sink_sum + jnp.sum(jnp.where(fj, p, 0.0), axis=-1)
        ent_sum = ent_sum + jnp.sum(p * (li - s), axis=-1)
        mx = jnp.maximum(mx, jnp.max(jnp.where(allowed, raw, -jnp.inf), axis=-1))
        return sink_sum, ent_sum, mx

    def row(i, out):
        zero = jnp.zeros((b, hq, tq), f32)
        acc = (zero, zero, jnp.full((b, hq, tq), -jnp.inf, f32))

        def step(j, acc):
            active = jnp.any(bmask[:, :, i, j] > 0)
            return jax.lax.cond(active, lambda a: tile(i, j, a), lambda a: a, acc)

        acc = jax.lax.fori_loop(0, nk, step, acc)
        return tuple(jax.lax.dynamic_update_slice_in_dim(o_, a, i * tq, axis=2) for o_, a in zip(out, acc))

    init = (jnp.zeros((b, hq, nq * tq), f32),) * 2 + (jnp.full((b, hq, nq * tq), -jnp.inf, f32),)
    sink_sum, ent_sum, mx = (x[..., :lq] for x in jax.lax.fori_loop(0, nq, row, init))
    if tel.sink_stream:
        if sinks is not None:
            sig = sinks.astype(f32)[None, :, None]
            p_sink = jnp.where(valid, jnp.exp(sig - lse_v), 0.0)
            ent_sum = ent_sum + p_sink * (lse_v - sig)
        else:
            p_sink = jnp.zeros_like(lse_v)
        stats = [jnp.sum(valid, axis=(0, 2), dtype=f32)]
        stats += [jnp.sum(jnp.where(valid, x, 0.0), axis=(0, 2)) for x in (sink_sum, p_sink, ent_sum)]
    else:  # as the kernel: the sink stream's columns stay zero
        stats = [jnp.zeros((hq,), f32)] * 4
    stats.append(jnp.max(jnp.where(valid, mx, -jnp.inf), axis=(0, 2)))

    if tel.outlier_stream:
        o32 = o.astype(f32)
        sq = jnp.sum(o32 * o32, axis=(2, 3))  # [B, Hq]
        n = o32.shape[2] * o32.shape[3]
        thr = tel.outlier_ratio * jnp.sqrt(sq / n)
        stats += [
            jnp.max(jnp.abs(o32), axis=(0, 2, 3)),
            jnp.sum(sq, axis=0),
            jnp.full((hq,), float(b * n), f32),
            jnp.sum(jnp.abs(o32) > thr[..., None, None], axis=(0, 2, 3), dtype=f32),
        ]
    else:
        stats += [jnp.zeros((hq,), f32)] * 4
    assert len(stats) == _tessera.TELEMETRY_COLUMNS
    hi = jnp.stack(stats, axis=1)
    return jnp.stack([hi, jnp.zeros_like(hi)], axis=-1)


def _by_batch_head(x: Any, b: int, hq: int, batched: bool) -> Any:
    """``x`` ``[G, H', ...]`` (G = B when ``batched``, else 1; H' = Hq or 1) as ``[B, Hq, ...]``."""
    x = x if batched else jnp.broadcast_to(x, (1,) + x.shape[1:])
    return jnp.broadcast_to(x, (b, hq) + x.shape[2:])


def _pad(x: Any, n: int) -> Any:
    """``x`` padded with zeros along axis 2 to ``n``."""
    return x if x.shape[2] == n else jnp.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2])] + [(0, 0)] * (x.ndim - 3))


def _pad_last(x: Any, n: int) -> Any:
    return x if x.shape[-1] == n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
