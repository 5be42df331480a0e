"""The Splash (TPU) route of ``tessera.jax.attention``: a Tessera plan run by JAX Splash attention.

Contract (SPEC §4, §12):

* :func:`splash_info` turns a plan into a :class:`SplashInfo`, a JAX pytree of Splash ``MaskInfo``
  arrays (forward and dKV) for every batch group of the plan. Its arrays have **stable shapes
  and dtypes**: the full, unshrunk grid (``[G, H', Tq, Tk]``, ``G`` = 1 or B, ``H'`` = 1 or H as
  ``plan.groups``), partial mask blocks padded to a bound (``max_partial_blocks``, by default the
  next power of two at or above the plan's count), integer dtypes picked from the shapes and the
  bound only, never from the data. Plans of equal shapes (and equal bound) therefore give
  SplashInfos with equal tree structure and equal array types: a jitted step that takes the
  info as an argument compiles once for all of them, and the plan reaches the step as data. The
  number of active blocks is data too: empty blocks stay marked empty (``block_mask == 0``) and
  Splash skips them.
* :func:`splash_attention` computes SPEC §4 attention with Splash's Pallas kernels: ``scale``
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
import threading
import weakref
from typing import Any, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from . import Plan
from ._jaxargs import check_qkv, scale_softcap

__all__ = ["SplashInfo", "splash_info", "splash_attention"]

# Splash's private kernel entry points: the public kernel object hides `di` (needed for exact
# gradients through the LSE), so the forward and backward pallas calls are used directly.
_REQUIRED = ("_splash_attention_forward", "_splash_attention_bwd_dkv", "_splash_attention_bwd_dq")
_MISSING = [n for n in _REQUIRED if not hasattr(_sk, n)]
_MASK_VALUE = _sk.DEFAULT_MASK_VALUE
_LANES = 128  # Splash computes kv blocks in multiples of the TPU lane count


# -- the stable-shape MaskInfo pytree ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Meta:
    """Static (hashable) description of a SplashInfo: equal for plans of equal shapes."""

    shape: Tuple[int, int, int, int]  # the plan's (B, H, Lq, Lkv)
    block: Tuple[int, int]  # (tq, tk)
    groups: Tuple[int, int]  # array groups (G, H'): G in {1, B}, H' in {1, H}
    max_partial_blocks: int


_FIELDS = ("data_next", "mask_next", "block_mask", "partial_mask_blocks")


@jax.tree_util.register_pytree_node_class
class SplashInfo:
    """Splash ``MaskInfo`` arrays of a plan for every batch group, with stable shapes.

    ``fwd`` and ``dkv`` are Splash ``MaskInfo`` tuples whose arrays carry a leading group axis
    ``G`` (1 when the mask does not vary along batch rows, else B): ``data_next``,
    ``mask_next``, ``block_mask`` ``[G, H', Tq, Tk]`` and ``partial_mask_blocks``
    ``[G, max_partial_blocks, tq, tk]`` (``[..., tk, tq]`` for dkv). ``row_valid``
    ``bool [G, H', Tq*tq]`` says which (padded) query rows have at least one allowed key.
    Build it with :func:`splash_info`; pass it to jitted functions as an argument."""

    __slots__ = ("fwd", "dkv", "row_valid", "meta")

    def __init__(self, fwd: MaskInfo, dkv: MaskInfo, row_valid: Any, meta: _Meta) -> None:
        # no checks here: tree_unflatten rebuilds infos from tracers or placeholders
        self.fwd, self.dkv, self.row_valid, self.meta = fwd, dkv, row_valid, meta

    def tree_flatten(self):
        children = tuple(getattr(self.fwd, f) for f in _FIELDS)
        children += tuple(getattr(self.dkv, f) for f in _FIELDS)
        return children + (self.row_valid,), self.meta

    @classmethod
    def tree_unflatten(cls, meta: _Meta, children):
        fwd = MaskInfo(*children[0:4], q_sequence=None)
        dkv = MaskInfo(*children[4:8], q_sequence=None)
        return cls(fwd, dkv, children[8], meta)

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """The plan's ``(B, H, Lq, Lkv)``."""
        return self.meta.shape

    @property
    def block(self) -> Tuple[int, int]:
        """The plan's ``(q, kv)`` tiles (the Splash block sizes)."""
        return self.meta.block

    @property
    def groups(self) -> Tuple[int, int]:
        """``(G, H')``: the batch groups and head rows the arrays hold."""
        return self.meta.groups

    @property
    def max_partial_blocks(self) -> int:
        """The bound the partial mask blocks are padded to."""
        return self.meta.max_partial_blocks

    def __repr__(self) -> str:
        m = self.meta
        return (f"SplashInfo(shape={m.shape}, block={m.block}, groups={m.groups}, "
                f"max_partial_blocks={m.max_partial_blocks})")


def _index_dtype(max_value: int) -> np.dtype:
    """The smallest of int8/int16/int32 holding ``max_value``: from shapes only, so that the
    dtype is the same for every plan of the same shapes (Splash's own downcast reads data)."""
    for dt in (np.int8, np.int16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"plan: a block index of {max_value} does not fit Splash's int32 tables")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_cache: "weakref.WeakKeyDictionary[Plan, dict]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def splash_info(plan: Plan, *, max_partial_blocks: Optional[int] = None) -> SplashInfo:
    """The :class:`SplashInfo` of ``plan`` (cached on the plan per ``max_partial_blocks``).

    ``max_partial_blocks`` bounds the unique partial mask blocks of any batch row (the padded
    length of ``partial_mask_blocks``); by default the next power of two at or above the plan's
    count, so that most batches of one shape share a compiled step. A ValueError names it when
    the plan needs more."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    if max_partial_blocks is not None:
        if isinstance(max_partial_blocks, bool) or not isinstance(max_partial_blocks, (int, np.integer)):
            raise TypeError(
                f"max_partial_blocks: expected an int or None, got {type(max_partial_blocks).__name__}")
        max_partial_blocks = int(max_partial_blocks)
        if max_partial_blocks < 1:
            raise ValueError(f"max_partial_blocks: expected a positive int, got {max_partial_blocks}")
    with _cache_lock:
        hit = _cache.get(plan, {}).get(max_partial_blocks)
    if hit is not None:
        return hit
    info = _build(plan, max_partial_blocks)
    with _cache_lock:
        _cache.setdefault(plan, {})[max_partial_blocks] = info
    return info


def _build(plan: Plan, bound: Optional[int]) -> SplashInfo:
    b, h, lq, lkv = plan.shape
    tq, tk = plan.block
    nq, nk = -(-lq // tq), -(-lkv // tk)
    gb, gh = plan.groups
    g = 1 if gb == 1 else b
    hh = 1 if gh == 1 else h  # Splash indexes these by query head: 1 or every head
    # the full grid (no shrinking) and int32 tables: shapes must not depend on the data
    rows = plan._p._splash_arrays(1, 1, False, False, False)
    rows = [rows[i if len(rows) > 1 else 0] for i in range(g)]
    count = max(
        (0 if d["partial_mask_blocks"] is None else d["partial_mask_blocks"].shape[0])
        for row in rows for d in row
    )
    if bound is None:
        bound = _next_pow2(max(count, 1))
    elif count > bound:
        raise ValueError(
            f"max_partial_blocks: the plan has {count} unique partial mask blocks in a batch row, "
            f"more than max_partial_blocks={bound}")
    bm_dt, mn_dt = np.dtype(np.int8), _index_dtype(bound - 1)

    def pack(d: dict, is_dkv: bool) -> Tuple[np.ndarray, ...]:
        shape = (hh, nq, nk)
        dn = np.broadcast_to(d["data_next"], shape).astype(_index_dtype((nq if is_dkv else nk) - 1))
        bm = np.broadcast_to(d["block_mask"], shape).astype(bm_dt)
        blk = (tk, tq) if is_dkv else (tq, tk)
        pm = np.zeros((bound,) + blk, dtype=bool)
        if d["partial_mask_blocks"] is None:
            mn = np.zeros(shape, dtype=mn_dt)  # no partial block: block_mask is never 1
        else:
            mn = np.broadcast_to(d["mask_next"], shape).astype(mn_dt)
            pm[: d["partial_mask_blocks"].shape[0]] = d["partial_mask_blocks"]
        return dn, mn, bm, pm

    fwd = [pack(f, False) for f, _ in rows]
    dkv = [pack(d, True) for _, d in rows]
    valid = np.stack([_rows_with_a_key(dn_mn_bm_pm, tq) for dn_mn_bm_pm in fwd])
    stack = lambda parts, i: jnp.asarray(np.stack([p[i] for p in parts]))  # noqa: E731
    return SplashInfo(
        MaskInfo(*(stack(fwd, i) for i in range(4)), q_sequence=None),
        MaskInfo(*(stack(dkv, i) for i in range(4)), q_sequence=None),
        jnp.asarray(valid),
        _Meta((b, h, lq, lkv), (tq, tk), (g, hh), bound),
    )


def _rows_with_a_key(fwd: Tuple[np.ndarray, ...], tq: int) -> np.ndarray:
    """``bool [H', Tq*tq]``: query rows with an allowed key (a full block, or a partial block
    with a True in that row). Splash gives such empty rows NaN or a mean of V; this is what
    fixes them, decided by the mask rather than by the values."""
    _, mn, bm, pm = fwd
    row_any = pm.any(axis=-1)  # [bound, tq]
    full = (bm == 2).any(axis=-1)  # [H', Tq]
    part = ((bm == 1)[..., None] & row_any[mn.astype(np.int64)]).any(axis=2)  # [H', Tq, tq]
    return (full[..., None] | part).reshape(bm.shape[0], -1)


# -- attention -----------------------------------------------------------------------------------


class _Cfg(NamedTuple):
    """Static kernel configuration (a custom_vjp nondiff argument)."""

    block_sizes: Any
    softcap: Optional[float]
    interpret: bool
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
    tq, tk = info.meta.block
    if tk % _LANES:
        raise ValueError(f"info: Splash needs kv tiles that are multiples of {_LANES}; the plan's "
                         f"tiles are {(tq, tk)} (plan with block=(tq, 128 or 256 or 512))")


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
    """SPEC §4 attention of ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``,
    ``v [B, Hkv, Lkv, Dv]`` (float32 or bfloat16) over the plan behind ``info``, run by Splash.

    ``scale`` defaults to ``1/sqrt(Dqk)``; ``softcap`` ``c`` gives ``c·tanh(s/c)``; ``sinks``
    ``[Hq]`` are learned sink logits (denominator only). Returns ``O [B, Hq, Lq, Dv]`` in q's
    dtype, and with ``return_lse`` also ``LSE [B, Hq, Lq]`` float32 (natural log; ``-inf`` on
    rows with no allowed key and no sink). Differentiable (reverse mode) in q, k, v, sinks and
    through the LSE. ``interpret=None`` runs Pallas interpret mode off TPU."""
    if _MISSING:
        raise NotImplementedError(
            f"this JAX ({jax.__version__}) Splash lacks {', '.join(_MISSING)}, which the exact "
            "LSE gradient needs")
    _check(q, k, v, info, sinks)
    scale, softcap = scale_softcap(q.shape[-1], scale, softcap)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    tq, tk = info.meta.block
    cfg = _Cfg(_block_sizes(block_sizes, tq, tk), softcap, bool(interpret), sinks is not None,
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


def _infos(arrays: Tuple[Any, ...]) -> Tuple[MaskInfo, MaskInfo]:
    return (MaskInfo(*arrays[0:4], q_sequence=None), MaskInfo(*arrays[4:8], q_sequence=None))


def _rows(cfg: _Cfg, valid: jax.Array, shape: Tuple[int, int, int]) -> jax.Array:
    """``valid`` (``[G, H', Lp]`` or ``[H', Lp]`` when unbatched) as ``[B, Hq, Lp]``."""
    return jnp.broadcast_to(valid if cfg.batched else valid[None], shape)


def _forward(cfg: _Cfg, q, k, v, sinks, arrays):
    fwd, _ = _infos(arrays)
    bs = cfg.block_sizes

    def row(info, q, k, v):
        o, (lse,) = _sk._splash_attention_forward(
            info, q, k, v, None, sinks, mask_value=_MASK_VALUE, is_mqa=False, block_sizes=bs,
            residual_checkpoint_name=None, save_residuals=True, mask_function=None,
            attn_logits_soft_cap=cfg.softcap, interpret=cfg.interpret)
        return o, lse

    o, lse = jax.vmap(row, in_axes=(0 if cfg.batched else None, 0, 0, 0))(fwd, q, k, v)
    valid = _rows(cfg, arrays[8], lse.shape)
    # Splash on a row with no allowed key: NaN (no block visited) or a mean of V (only masked
    # entries visited). With a sink it is already exact (O = 0, LSE = σ).
    o_out = jnp.where(valid[..., None], o, jnp.zeros((), o.dtype))
    lse_out = lse if cfg.has_sinks else jnp.where(valid, lse, -jnp.inf)
    return o_out, lse_out, o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, sinks, *arrays):
    o, lse, _, _ = _forward(cfg, q, k, v, sinks, arrays)
    return o, lse


def _core_fwd(cfg, q, k, v, sinks, *arrays):
    o, lse_out, _, lse = _forward(cfg, q, k, v, sinks, arrays)
    # Δ is taken from the returned O (exactly 0 on empty rows; Splash's own O may be NaN there)
    return (o, lse_out), (q, k, v, sinks, o, lse, arrays)


def _core_bwd(cfg, res, cts):
    q, k, v, sinks, o, lse, arrays = res
    do, dlse = cts
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

    def row(dkv_info, fwd_info, q, k, v, lse, do, di):
        dq, dk, dv = _sk._splash_attention_bwd_dkv(
            q, k, v, None, None, lse, do, di, bq=bs.block_q_dkv, bkv=bs.block_kv_dkv,
            bkv_compute=bs.block_kv_dkv_compute, is_mqa=False, mask_info=dkv_info,
            mask_value=_MASK_VALUE, attn_logits_soft_cap=cfg.softcap,
            use_fused_bwd_kernel=bs.use_fused_bwd_kernel, q_layout=bs.q_layout,
            k_layout=bs.k_layout, v_layout=bs.v_layout, mask_function=None,
            interpret=cfg.interpret)
        if not bs.use_fused_bwd_kernel:
            # the full-grid forward MaskInfo is the dQ MaskInfo at the same tiles
            dq = _sk._splash_attention_bwd_dq(
                q, k, v, None, None, lse, do, di, bq=bs.block_q_dq, bkv=bs.block_kv_dq,
                is_mqa=False, mask_info=fwd_info, mask_value=_MASK_VALUE,
                attn_logits_soft_cap=cfg.softcap, q_layout=bs.q_layout, k_layout=bs.k_layout,
                v_layout=bs.v_layout, mask_function=None, interpret=cfg.interpret)
        return dq, dk, dv

    ax = 0 if cfg.batched else None
    dq, dk, dv = jax.vmap(row, in_axes=(ax, ax, 0, 0, 0, 0, 0, 0))(dkv, fwd, q, k, v, lse, do, di)
    dsinks = None
    if cfg.has_sinks:
        # dσ_h = Σ_rows p_sink (dLSE - Δ), p_sink = exp(σ_h - LSE); an empty row has LSE = σ
        p_sink = jnp.exp(sinks.astype(f32)[None, :, None] - lse)
        dsinks = -jnp.sum(p_sink * di_all, axis=(0, 2)).astype(sinks.dtype)
    return (dq, dk, dv, dsinks) + (None,) * len(arrays)


_core.defvjp(_core_fwd, _core_bwd)
