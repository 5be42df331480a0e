"""The Splash engine (TPU; Pallas interpret mode elsewhere): a Tessera plan run by JAX Splash
attention. This module holds the kernels' side (:func:`forward`, :func:`backward`, the block
sizes and checks); the route of ``tessera.jax.attention`` that wraps them in a ``custom_vjp`` is
:mod:`tessera.jax.splash`, and the stable-shape ``MaskInfo`` is :mod:`tessera.core.splash_tables`.

Contract (docs/semantics.md#attention, docs/semantics.md#engines-and-devices):

* ``splash_info`` turns a plan into a :class:`SplashInfo`, a JAX pytree of Splash ``MaskInfo``
  arrays (forward and dKV) for every batch group of the plan. Its arrays have **stable shapes
  and dtypes**: the full, unshrunk grid (``[G, H', Tq, Tk]``, ``G`` = 1 or B, ``H'`` = 1 or H as
  ``plan.groups``), partial mask blocks padded to a bound (``max_partial_blocks``, by default the
  next power of two at or above the plan's count), integer dtypes picked from the shapes and the
  bound only, never from the data. Plans of equal shapes (and equal bound) therefore give
  SplashInfos with equal tree structure and equal array types: a jitted step that takes the
  info as an argument compiles once for all of them, and the plan reaches the step as data. The
  number of active blocks is data too: empty blocks stay marked empty (``block_mask == 0``) and
  Splash skips them.
* ``splash_attention`` computes the attention of docs/semantics.md#attention with Splash's Pallas kernels: ``scale``
  applied to q (Splash does not scale), softcap through Splash's ``attn_logits_soft_cap``, learned
  sinks through Splash's ``sinks`` (the same semantics: ``Z = exp(σ_h) + Σ exp(s)``), rows with no
  allowed key fixed to ``O = 0``, ``LSE = -inf`` (Splash leaves NaN or an average of V there;
  which rows are empty is read from the mask, not guessed from values). Gradients for q, k, v,
  sinks and through the returned LSE come from one ``jax.custom_vjp`` around Splash's own
  forward and backward kernels: the backward kernels take ``di`` as an input, and
  ``dS = P (dP - Δ + dLSE)`` is exactly those kernels run with ``di = Δ - dLSE`` (softcap
  included, since the kernel applies the tanh derivative after forming ``dS``).
* GQA runs on Splash's multi-head kernels, which map query head ``h`` to kv head
  ``h // (Hq / Hkv)`` themselves: K and V are never repeated. ``Dqk != Dv`` is supported.
  Lengths that are not multiples of the tiles are padded inside (the padding is masked by the
  plan's MaskInfo and sliced off).
* Block sizes follow the plan's tiles (the MaskInfo is built at them). Splash needs kv tiles that
  are multiples of 128; on TPU use 128, 256 or 512 for both tiles (v6e prefers 256 or 512).
  The backward uses Splash's fused dKV+dQ kernel by default (it writes one partial dQ per kv
  tile, ``[Tk, Hq, Lq, Dqk]``, then sums); pass
  ``block_sizes=BlockSizes(..., use_fused_bwd_kernel=False)`` for the separate dQ kernel (less
  memory at long lengths).
* Batch: Splash has no batch axis, so the kernels run under ``vmap``. A mask that does not vary
  along batch rows (``G = 1``) batches as an extra grid axis; per-row infos (``G = B``) make
  Pallas loop over the rows (it does not batch prefetched scalar tables). Memory of an info:
  about ``2 · G · max_partial_blocks · tq · tk`` bytes of partial blocks plus small tables.
* First-order reverse-mode AD only (Splash's kernels have no JVP); forward-mode raises JAX's
  custom_vjp error. Off TPU the kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from ..core.splash_tables import SplashInfo
from .vma import _varying, _vma
from jax._src import config as _jax_config  # the vma check's switch (no public one yet)

from ..core.args import check_qkv


# Splash's private kernel entry points: the public kernel object hides `di` (needed for exact
# gradients through the LSE), so the forward and backward pallas calls are used directly.
_REQUIRED = ("_splash_attention_forward", "_splash_attention_bwd_dkv", "_splash_attention_bwd_dq")


_MISSING = [n for n in _REQUIRED if not hasattr(_sk, n)]


_MASK_VALUE = _sk.DEFAULT_MASK_VALUE


_LANES = 128  # Splash computes kv blocks in multiples of the TPU lane count


# -- attention -----------------------------------------------------------------------------------


class _Cfg(NamedTuple):
    """Static kernel configuration (a custom_vjp nondiff argument)."""

    block_sizes: Any
    softcap: Optional[float]
    interpret: Optional[bool]  # None: Mosaic when lowered for TPU, interpret mode elsewhere
    has_sinks: bool
    batched: bool  # the info arrays carry one group per batch row


def _block_sizes(bs: Any, tq: int, tk: int) -> Any:
    """Splash block sizes at the plan's tiles (``block_sizes`` may only choose the compute
    sub-blocks, the layouts and the fused or separate backward)."""
    if bs is None:
        return _sk.BlockSizes(block_q=tq, block_kv=tk, block_kv_compute=tk, block_q_dkv=tq,
                              block_kv_dkv=tk, block_kv_dkv_compute=tk, use_fused_bwd_kernel=True)
    if not isinstance(bs, _sk.BlockSizes):
        raise TypeError(f"block_sizes: expected a Splash BlockSizes or None, got {type(bs).__name__}")
    want = {"block_q": tq, "block_kv": tk, "block_q_dkv": tq, "block_kv_dkv": tk}
    if not bs.use_fused_bwd_kernel:
        want.update(block_q_dq=tq, block_kv_dq=tk)
    fix = {}
    for name, w in want.items():
        got = getattr(bs, name)
        if got is None and name not in ("block_q", "block_kv"):
            fix[name] = w
        elif got != w:
            raise ValueError(
                f"block_sizes: {name}={got} must equal the plan's tile {w} (the MaskInfo is built "
                f"at the plan's tiles {(tq, tk)}; re-plan with block=... to change them)")
    if fix:
        if "block_kv_dkv" in fix and bs.block_kv_dkv_compute is None:
            fix["block_kv_dkv_compute"] = tk
        bs = dataclasses.replace(bs, **fix)
    return bs


def _check(q: Any, k: Any, v: Any, info: Any, sinks: Any) -> None:
    if not isinstance(info, SplashInfo):
        raise TypeError(f"info: expected a tessera SplashInfo (tessera.jax splash_info(plan)), "
                        f"got {type(info).__name__}")
    check_qkv(q, k, v, info.meta.shape, info.meta.groups, "bhld", sinks, plan_arg="info")
    problem = tile_problem(*info.meta.block)
    if problem:
        raise ValueError(f"info: the plan behind it cannot run on Splash: {problem}")


def tile_problem(tq: int, tk: int) -> Optional[str]:
    """Why Splash cannot run a plan with ``(tq, tk)`` tiles, or None. Splash's kernels compute kv
    blocks in multiples of the TPU's 128 lanes (its interpret mode follows the same code)."""
    if tk % _LANES:
        return (f"block: Splash needs kv tiles that are multiples of {_LANES}; "
                f"the plan's tiles are {(tq, tk)}: plan with block=(tq, tk), tk in 128, 256 or "
                "512 (256 or 512 on v6e's 256x256 MXU; 128 on v4/v5e; see docs/jax.md)")
    return None


def check_tiles(tq: int, tk: int) -> None:
    problem = tile_problem(tq, tk)
    if problem:
        raise ValueError(problem)


def _infos(arrays: Tuple[Any, ...]) -> Tuple[MaskInfo, MaskInfo]:
    return (MaskInfo(*arrays[0:4], q_sequence=None), MaskInfo(*arrays[4:8], q_sequence=None))


def _rows(cfg: _Cfg, valid: jax.Array, shape: Tuple[int, int, int]) -> jax.Array:
    """``valid`` (``[G, H', Lp]`` or ``[H', Lp]`` when unbatched) as ``[B, Hq, Lp]``."""
    return jnp.broadcast_to(valid if cfg.batched else valid[None], shape)


def _on_platform(cfg: _Cfg, kernels, *args):
    """``kernels(interpret, *args)`` with the Pallas mode chosen by the platform the computation is
    lowered for, not by the process's default device: the Mosaic kernels (``interpret=False``)
    in a TPU lowering, interpret mode in any other (both are traced; a lowering keeps only its
    platform's branch, so a step exported for TPU from a CPU host carries the Mosaic kernels and
    a CPU run never lowers them). ``cfg.interpret`` set to a bool forces one mode."""
    kernels = _typed_like_operands(kernels)
    if cfg.interpret is not None:
        return kernels(cfg.interpret, *args)
    return jax.lax.platform_dependent(
        *args, tpu=functools.partial(kernels, False), default=functools.partial(kernels, True))


def _typed_like_operands(kernels):
    """``kernels`` usable inside ``shard_map(check_vma=True)``: Splash's ``pallas_call`` gives its
    outputs no mesh-axis (vma) types, which that check refuses, so the call is traced with the
    check off and its results are then typed varying over every axis an operand varies over (as
    the FFI route types its custom calls' results). Outside ``shard_map`` nothing changes."""

    def wrapped(interpret, *args):
        operands = [x for x in jax.tree_util.tree_leaves(args) if hasattr(x, "dtype")]
        if not any(_vma(x) for x in operands):
            return kernels(interpret, *args)
        with _jax_config._check_vma(False):
            outs = kernels(interpret, *args)
        flat, tree = jax.tree_util.tree_flatten(outs)
        return jax.tree_util.tree_unflatten(tree, _varying(flat, operands))

    return wrapped


def forward(cfg: _Cfg, q, k, v, sinks, arrays):
    """Splash's forward over the info's ``arrays``: ``(O, LSE)`` with rows that have no allowed key
    fixed (``O = 0``, ``LSE = -inf`` without a sink), and Splash's own ``(O, LSE)`` (residuals)."""
    fwd, _ = _infos(arrays)
    bs = cfg.block_sizes

    def kernels(interpret, fwd, q, k, v, sinks):
        def row(info, q, k, v):
            o, (lse,) = _sk._splash_attention_forward(
                info, q, k, v, None, sinks, mask_value=_MASK_VALUE, is_mqa=False, block_sizes=bs,
                residual_checkpoint_name=None, save_residuals=True, mask_function=None,
                attn_logits_soft_cap=cfg.softcap, interpret=interpret)
            return o, lse

        return jax.vmap(row, in_axes=(0 if cfg.batched else None, 0, 0, 0))(fwd, q, k, v)

    o, lse = _on_platform(cfg, kernels, fwd, q, k, v, sinks)
    valid = _rows(cfg, arrays[8], lse.shape)
    # Splash on a row with no allowed key: NaN (no block visited) or a mean of V (only masked
    # entries visited). With a sink it is already exact (O = 0, LSE = σ).
    o_out = jnp.where(valid[..., None], o, jnp.zeros((), o.dtype))
    lse_out = lse if cfg.has_sinks else jnp.where(valid, lse, -jnp.inf)
    return o_out, lse_out, o, lse


def backward(cfg: _Cfg, q, k, v, sinks, o, lse, arrays, do, dlse):
    """dQ, dK, dV, dσ of :func:`forward`'s call from Splash's backward kernels, given dO and the
    LSE's cotangent (``o`` is the returned O, ``lse`` Splash's own)."""
    fwd, dkv = _infos(arrays)
    bs = cfg.block_sizes
    valid = _rows(cfg, arrays[8], lse.shape)
    f32 = jnp.float32
    # O is the constant 0 on rows with no allowed key, so nothing flows from them: their dO and
    # di are zeroed (Splash's LSE there is ~mask_value, which makes P = 1 on their masked
    # entries; with dO = di = 0 those contribute exactly 0)
    do = jnp.where(valid[..., None], do, 0).astype(q.dtype)
    delta = jnp.einsum("bhsd,bhsd->bhs", o.astype(f32), do.astype(f32))
    # dS = P (dP - Δ + dLSE): the kernels' `di` input carries Δ - dLSE (exact under softcap: the
    # kernels apply the tanh derivative to the whole dS)
    di_all = delta - dlse.astype(f32)
    di = jnp.where(valid, di_all, 0.0)

    def row(interpret, dkv_info, fwd_info, q, k, v, lse, do, di):
        dq, dk, dv = _sk._splash_attention_bwd_dkv(
            q, k, v, None, None, lse, do, di, bq=bs.block_q_dkv, bkv=bs.block_kv_dkv,
            bkv_compute=bs.block_kv_dkv_compute, is_mqa=False, mask_info=dkv_info,
            mask_value=_MASK_VALUE, attn_logits_soft_cap=cfg.softcap,
            use_fused_bwd_kernel=bs.use_fused_bwd_kernel, q_layout=bs.q_layout,
            k_layout=bs.k_layout, v_layout=bs.v_layout, mask_function=None,
            interpret=interpret)
        if not bs.use_fused_bwd_kernel:
            # the full-grid forward MaskInfo is the dQ MaskInfo at the same tiles
            dq = _sk._splash_attention_bwd_dq(
                q, k, v, None, None, lse, do, di, bq=bs.block_q_dq, bkv=bs.block_kv_dq,
                is_mqa=False, mask_info=fwd_info, mask_value=_MASK_VALUE,
                attn_logits_soft_cap=cfg.softcap, q_layout=bs.q_layout, k_layout=bs.k_layout,
                v_layout=bs.v_layout, mask_function=None, interpret=interpret)
        return dq, dk, dv

    def kernels(interpret, *args):
        ax = 0 if cfg.batched else None
        return jax.vmap(functools.partial(row, interpret), in_axes=(ax, ax, 0, 0, 0, 0, 0, 0))(*args)

    dq, dk, dv = _on_platform(cfg, kernels, dkv, fwd, q, k, v, lse, do, di)
    dsinks = None
    if cfg.has_sinks:
        # dσ_h = Σ_rows p_sink (dLSE - Δ), p_sink = exp(σ_h - LSE); an empty row has LSE = σ
        p_sink = jnp.exp(sinks.astype(f32)[None, :, None] - lse)
        dsinks = -jnp.sum(p_sink * di_all, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dsinks
