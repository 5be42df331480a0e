"""The Splash route of ``tessera.jax.attention`` (docs/semantics.md#attention, docs/semantics.md#engines-and-devices): argument checks, padding to whole
tiles, and the ``custom_vjp`` around the Splash engine's forward and backward kernels
(:mod:`tessera.engines.splash`, whose docstring states the contract). ``splash_attention`` takes
a :class:`~tessera.core.splash_tables.SplashInfo` (``splash_info(plan)``) directly."""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from ..core.args import scale_softcap
from ..core import splash_tables
from ..core.plans import Plan, check_plan
from ..core.splash_tables import SplashInfo
from ..engines.vma import _like
from ..engines.splash import _MISSING, _Cfg, _block_sizes, _check, backward, forward

__all__ = ["SplashInfo", "splash_info", "splash_attention"]


@functools.wraps(splash_tables.splash_info)
def splash_info(plan: Plan, *, max_partial_blocks: Optional[int] = None) -> SplashInfo:
    return splash_tables.splash_info(check_plan(plan), max_partial_blocks=max_partial_blocks)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    info: SplashInfo,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[jax.Array] = None,
    return_lse: bool = False,
    interpret: Optional[bool] = None,
    block_sizes: Any = None,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    """The attention (docs/semantics.md#attention) of ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``,
    ``v [B, Hkv, Lkv, Dv]`` (float32 or bfloat16) over the plan behind ``info``, run by Splash.

    ``scale`` defaults to ``1/sqrt(Dqk)``; ``softcap`` ``c`` gives ``c·tanh(s/c)``; ``sinks``
    ``[Hq]`` are learned sink logits (denominator only). Returns ``O [B, Hq, Lq, Dv]`` in q's
    dtype, and with ``return_lse`` also ``LSE [B, Hq, Lq]`` float32 (natural log; ``-inf`` on
    rows with no allowed key and no sink). Differentiable (reverse mode) in q, k, v, sinks and
    through the LSE. ``interpret=None`` picks by the platform the step is lowered for: the
    Mosaic kernels for TPU (also when exported or compiled for TPU on another host), Pallas
    interpret mode for any other platform; True/False force one."""
    if _MISSING:
        raise NotImplementedError(
            f"this JAX ({jax.__version__}) Splash lacks {', '.join(_MISSING)}, which the exact "
            "LSE gradient needs")
    _check(q, k, v, info, sinks)
    scale, softcap = scale_softcap(q.shape[-1], scale, softcap)
    tq, tk = info.meta.block
    cfg = _Cfg(_block_sizes(block_sizes, tq, tk), softcap, None if interpret is None else bool(interpret), sinks is not None,
               info.meta.groups[0] > 1)

    b, hq, lq, _ = q.shape
    lkv = k.shape[2]
    lq_p, lkv_p = -(-lq // tq) * tq, -(-lkv // tk) * tk
    # Splash does not scale q; one rounding in q's dtype, as any scaled-q implementation
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)

    def pad(x: jax.Array, n: int) -> jax.Array:
        return x if x.shape[2] == n else jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)))

    arrays = info.tree_flatten()[0]
    if not cfg.batched:  # one group for every batch row: vmap leaves it unbatched
        arrays = tuple(a[0] for a in arrays)
    o, lse = _core(cfg, pad(qs, lq_p), pad(k, lkv_p), pad(v, lkv_p), sinks, *arrays)
    o, lse = o[:, :, :lq], lse[:, :, :lq]
    return (o, lse) if return_lse else o


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, sinks, *arrays):
    o, lse, _, _ = forward(cfg, q, k, v, sinks, arrays)
    return o, lse


def _core_fwd(cfg, q, k, v, sinks, *arrays):
    o, lse_out, _, lse = forward(cfg, q, k, v, sinks, arrays)
    # Δ is taken from the returned O (exactly 0 on empty rows; Splash's own O may be NaN there)
    return (o, lse_out), (q, k, v, sinks, o, lse, arrays)


def _core_bwd(cfg, res, cts):
    q, k, v, sinks, o, lse, arrays = res
    do, dlse = cts
    dq, dk, dv, dsinks = backward(cfg, q, k, v, sinks, o, lse, arrays, do, dlse)
    # typed like the primals under shard_map (a replicated input's gradient summed over devices)
    dsinks = None if sinks is None else _like(dsinks, sinks)
    return (_like(dq, q), _like(dk, k), _like(dv, v), dsinks) + (None,) * len(arrays)


_core.defvjp(_core_fwd, _core_bwd)
