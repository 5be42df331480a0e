"""A plan as JAX Splash ``MaskInfo`` (the plan exporter for JAX; imports jax).

:func:`splash_info` gives the stable-shape pytree the Splash route takes inside a jitted step;
:func:`mask_info` the two ``MaskInfo`` objects Splash's own preprocessing builds. Callers pass a
:class:`Plan`; the public entries (``tessera.jax.mask_info``, ``tessera.jax.splash.splash_info``)
check the argument's type."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from .args import _int_arg

if TYPE_CHECKING:  # the type only: Plan's own methods call this module
    from .plans import Plan


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


def splash_info(plan: "Plan", *, max_partial_blocks: Optional[int] = None) -> SplashInfo:
    """The :class:`SplashInfo` of ``plan`` (cached on the plan per ``max_partial_blocks``).

    ``max_partial_blocks`` bounds the unique partial mask blocks of any batch row (the padded
    length of ``partial_mask_blocks``); by default the next power of two at or above the plan's
    count, so that most batches of one shape share a compiled step. A ValueError names it when
    the plan needs more."""
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


def _build(plan: "Plan", bound: Optional[int]) -> SplashInfo:
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


def mask_info(
    plan: "Plan",
    *,
    batch_row: int = 0,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
    shrink_grid_dkv: bool = True,
    downcast_smem_data: bool = True,
    as_numpy: bool = False,
) -> Tuple[Any, Any]:
    """The forward (and dQ) and the dKV Splash ``MaskInfo`` of ``plan`` for one batch row, equal
    to ``process_mask(MultiHeadMask(...), plan.block, ...)`` and ``process_mask_dkv(...)`` with
    the same options (``shrink_grid_dkv=False`` for the fused backward kernel). Splash has no
    batch dimension: a plan whose mask differs per batch row gives each row's infos with
    ``batch_row=``. Arrays are jax arrays (numpy with ``as_numpy=True``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import (
        MaskInfo,
    )

    head_shards = _int_arg("mask_info", "head_shards", head_shards, 1)
    q_seq_shards = _int_arg("mask_info", "q_seq_shards", q_seq_shards, 1)
    batch_row = _int_arg("mask_info", "batch_row", batch_row, 0)
    rows = plan._p._splash_arrays(
        head_shards, q_seq_shards, shrink_grid, shrink_grid_dkv, downcast_smem_data
    )
    if not 0 <= batch_row < plan.shape[0]:
        raise ValueError(f"batch_row: expected 0 <= batch_row < {plan.shape[0]}, got {batch_row}")
    fwd, dkv = rows[batch_row if len(rows) > 1 else 0]
    if as_numpy:
        conv = lambda x: x  # noqa: E731
    else:
        import jax.numpy as jnp

        conv = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731

    def info(d: dict) -> Any:
        return MaskInfo(
            data_next=conv(d["data_next"]),
            mask_next=conv(d["mask_next"]),
            block_mask=conv(d["block_mask"]),
            partial_mask_blocks=conv(d["partial_mask_blocks"]),
            q_sequence=None,
        )

    return info(fwd), info(dkv)
