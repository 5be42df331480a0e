"""Plans (docs/semantics.md#plans) as Python objects: :class:`Plan`, :func:`plan`, :func:`plan_from_blocks`, the plan
cache's counters, and the process-wide handle registry through which compiled steps name a plan
as data (a handle), never as a constant."""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from .. import _tessera
from .._tessera import Mask
from .args import _block_pair, _kv_tiles


# -- key-side documents for other engines -------------------------------------------------------
#
# FlexAttention's telemetry (tessera.engines.flex) needs, on the device, which keys are sink keys (the
# first tokens of each key's document, docs/semantics.md#telemetry): the positions below, from the kv segment ids of
# the plan's `document` leaf (`Plan.kv_segments()`, the ids the Tessera kernel's telemetry uses).


def _runs(kv: np.ndarray) -> tuple:
    """``(rows, length, row, start, value)`` of every run of equal ids of ``kv`` ``[L]`` or
    ``[B, L]`` (each row starts a run)."""
    a = np.atleast_2d(kv)
    rows, length = a.shape
    change = np.ones(a.shape, dtype=bool)
    change[:, 1:] = a[:, 1:] != a[:, :-1]
    r, s = np.nonzero(change)
    return rows, length, r, s, a[r, s].copy()


def _kv_positions(runs: tuple) -> np.ndarray:
    """``int32 [rows, L]``: each key's position in its document (``-1`` for padding keys)."""
    rows, length, r, s, val = runs
    flat = r * length + s
    lengths = np.diff(np.append(flat, rows * length))
    pos = np.arange(rows * length, dtype=np.int64) - np.repeat(flat, lengths)
    pos[np.repeat(val, lengths) < 0] = -1
    return pos.reshape(rows, length).astype(np.int32)



def sink_positions(plan: "Plan") -> np.ndarray:
    """``int32 [B' or 1, Lkv]``: each key's position in its document (``-1`` for padding keys), or
    in the row when the mask has no ``document`` leaf: the sink keys are those below
    ``sink_tokens`` (docs/semantics.md#telemetry)."""
    kv = plan.kv_segments()
    if kv is None:
        return np.arange(plan.shape[3], dtype=np.int32)[None]
    return _kv_positions(_runs(kv))


_handles = itertools.count(1)


class _Native:
    """What a plan's handle names: the native plan alone. The handle tensor holds it, and the
    :class:`Plan` holds the tensor, so nothing refers back to the ``Plan`` and a plan is freed
    as soon as its last reference goes (a cycle would leave every plan to the garbage
    collector, with its tables, until the next collection)."""

    __slots__ = ("_p", "__weakref__")

    def __init__(self, native: "_tessera.Plan") -> None:
        self._p = native


_registry: "weakref.WeakValueDictionary[int, _Native]" = weakref.WeakValueDictionary()


_registry_lock = threading.Lock()


class Plan:
    """A plan: which tiles of ``[B, H, Lq, Lkv]`` are empty, full or partial, with the work
    lists the kernels walk. Made by :func:`plan`; reused across layers and steps."""

    __slots__ = ("_p", "_native", "_handle", "_handle_tensor", "_traced", "_flex", "__weakref__")

    def __init__(self, native: "_tessera.Plan") -> None:
        self._p = native
        # Set only on the stand-in JAX rebuilds inside a traced function (a `tessera.jax.PlanRef`
        # holding the traced handle); see tessera.jax.
        self._traced = None
        self._native = _Native(native)
        with _registry_lock:
            self._handle = next(_handles)
            _registry[self._handle] = self._native
        # The op passes the plan as a 0-d int64 tensor (a tensor, so compiled graphs are not
        # specialized on it); made now when torch is loaded, else on first use.
        torch = sys.modules.get("torch")
        self._handle_tensor = None
        if torch is not None:
            self._handle_tensor = _handle_tensor(torch, self)
        # FlexAttention engine state (tessera.engines.flex): per device, the BlockMask and sink-key
        # positions, built once and kept with the plan.
        self._flex: Dict[str, Any] = {}

    # -- what the plan is --------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """``(B, H, Lq, Lkv)``."""
        return self._traced.meta.shape if self._p is None else self._p.shape

    @property
    def block(self) -> Tuple[int, int]:
        """``(q, kv)`` tile sides."""
        return self._traced.meta.block if self._p is None else self._p.block

    @property
    def groups(self) -> Tuple[int, int]:
        """``(B', H')``: 1 where the mask does not vary along batch rows / heads."""
        return self._traced.meta.groups if self._p is None else self._p.groups

    @property
    def mask(self) -> Mask:
        """The planned mask."""
        return self._p.mask

    @property
    def source(self) -> str:
        """Where the plan came from: ``"memory"`` or ``"disk"`` (plan-cache hits) or ``"built"``."""
        return self._p.source

    @property
    def contract(self) -> str:
        """The contract key the plan cache uses (hex)."""
        return self._p.contract

    @property
    def stats(self) -> Dict[str, Any]:
        """Tiles by state, unique partial masks, allowed pairs, density, grid width, bytes. Tile
        counts are of the ``[B', H', Tq, Tk]`` grid in ``"tile_grid"`` (one grid serves every
        head and batch row along which the mask does not vary); ``allowed_pairs`` and
        ``density`` count pairs of the whole ``[B, H, Lq, Lkv]``; ``"units"`` says so per key."""
        return self._p.stats

    def kv_segments(self) -> Optional[np.ndarray]:
        """The key-side segment ids of the mask's (first) ``document`` leaf, ``int64 [B', Lkv]``,
        or ``None`` without one: where telemetry finds the sink keys (the first tokens of each
        key's document). A rank's local plan of a sharding has no mask: ``ValueError``."""
        return self._p.kv_segments()

    def states(self) -> np.ndarray:
        """Tile states ``uint8 [B', H', Tq, Tk]``: 0 empty, 1 partial, 2 full."""
        return self._p.states()

    def flops(self, d_qk: int, d_v: Optional[int] = None, backward: bool = False) -> float:
        """FLOPs over allowed pairs of one forward (or backward) pass."""
        return self._p.flops(d_qk, d_v, backward)

    def __repr__(self) -> str:
        if self._p is None:
            return f"tessera.Plan(traced, shape={self.shape}, block={self.block})"
        return repr(self._p)

    # -- other engines ------------------------------------------------------------------
    def to_flex_block_mask(self, device: Any = "cpu", mask_mod: str = "auto"):
        """This plan as a ``torch.nn.attention.flex_attention.BlockMask`` (tables equal to what
        ``create_block_mask`` builds for the same mask, with an exact ``mask_mod``)."""
        from .flex_tables import to_flex_block_mask

        return to_flex_block_mask(self, device=device, mask_mod=mask_mod)

    def to_splash_mask_info(self, **kwargs: Any):
        """This plan as JAX Splash ``MaskInfo`` objects (see :func:`tessera.jax.mask_info`)."""
        from .splash_tables import mask_info

        return mask_info(self, **kwargs)

    def save_png(self, path: str, batch: int = 0, head: int = 0, title: Optional[str] = None) -> None:
        """Writes a PNG picture of the tile states of one batch row and head (the CLI's
        ``tessera plan --png``)."""
        self._p.save_png(str(path), batch, head, title)


def _handle_tensor(torch: Any, plan: "Plan") -> Any:
    """The plan's 0-d int64 handle tensor. It holds the native plan as an attribute, so an
    autograd graph (which saves the handle) keeps what the backward needs alive until it ran,
    even when the caller dropped the plan (``attention(q, k, v, tessera.plan(...))``)."""
    h = torch.tensor(plan._handle, dtype=torch.int64)
    h._tessera_plan = plan._native
    return h


def check_plan(plan: Any, name: str = "plan") -> "Plan":
    """``plan`` itself when it is a :class:`Plan`, else a ``TypeError`` naming ``name``."""
    if not isinstance(plan, Plan):
        raise TypeError(f"{name}: expected a tessera.Plan, got {type(plan).__name__}")
    return plan


def _native_of(handle: int) -> "_tessera.Plan":
    """The native plan a handle names, while its :class:`Plan` or handle tensor lives."""
    p = _registry.get(int(handle))
    if p is None:
        raise ValueError("plan: this plan no longer exists (keep the Plan object alive while using it)")
    return p._p


def plan(
    mask: Mask,
    q_len: int,
    kv_len: Optional[int] = None,
    heads: Optional[int] = None,
    batch: Optional[int] = None,
    block: Union[int, Tuple[int, int]] = 128,
    cache: bool = True,
) -> Plan:
    """Plans ``mask`` for ``[batch, heads, q_len, kv_len]`` at tile ``block`` (an int or a
    ``(q, kv)`` pair). ``batch``/``heads`` default to what the mask's data implies (segment id
    rows, dense mask dims, ``heads(...)`` count), else 1. Plans come from the plan cache (memory,
    then disk) unless ``cache=False``; planning releases the GIL.

    With ``cache=False`` the plan keeps its partial tiles' bitmasks while they are few (up to
    128 KiB); past that it is built as its tile states (work lists, counts, exact states) and
    the bitmasks are built on first need (the CPU kernels, Splash ``MaskInfo``, sharding,
    ``stats``, a bit-table ``mask_mod``), so a FlexAttention ``BlockMask`` with a computed
    ``mask_mod`` never pays for them."""
    return _plan(mask, q_len, kv_len, heads, batch, block, cache, masks=False)


def _plan(mask, q_len, kv_len, heads, batch, block, cache, masks) -> Plan:
    """:func:`plan`, with the bitmasks built now (``masks``) or on first need when uncached."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a tessera.Mask, got {type(mask).__name__}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("heads", heads), ("batch", batch)):
        if value is None and name != "q_len":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    return Plan(_tessera.plan(mask, int(q_len), kv_len, heads, batch, block, cache, masks))


def plan_from_blocks(
    mask: Mask,
    kv_tiles: Any,
    q_len: int,
    kv_len: Optional[int] = None,
    heads: Optional[int] = None,
    batch: Optional[int] = None,
    block: Union[int, Tuple[int, int]] = 128,
    selection_block: Union[int, Tuple[int, int], None] = None,
    cache: bool = False,
) -> Plan:
    """The plan of ``mask & blocks(kv_tiles, selection_block)`` (docs/semantics.md#masks): a pair is allowed
    when its (query block, key block) tile is selected and ``mask`` allows it. ``kv_tiles`` is an
    integer array ``[B, H, Tq, k]`` of the key blocks each query block keeps (what a MoBA / NSA
    gate's top-k gives; numpy or torch, a CUDA tensor is copied to the host once; ``-1`` = none,
    duplicates count once; B or H of 1, or ``[H, Tq, k]`` / ``[Tq, k]``, broadcast), with
    ``Tq == ceil(q_len / q_block)`` and entries below ``ceil(kv_len / kv_block)``.

    ``block`` is the plan's tile (an int or ``(q, kv)``), as in :func:`plan`;
    ``selection_block`` the selection's block in tokens, by default ``block``: then a selected
    tile needs no token work beyond ``mask``'s own. Planning visits the selected tiles only (time
    proportional to them, not to the mask's reach). ``batch``/``heads`` default to what the
    data implies (the selection's B and H, segment id rows, ...).

    The result is an ordinary :class:`Plan` (torch op, FlexAttention ``BlockMask``, Splash
    ``MaskInfo``, context-parallel sharding); a compiled step takes it as a handle, so a new
    selection each step does not recompile. ``cache=False`` (the default) skips the plan cache:
    a selection is new every step, so storing its plan only costs time and evicts plans that are
    reused; pass ``cache=True`` to look it up and store it like :func:`plan`. Wrong shapes or
    out-of-range entries raise ``ValueError`` naming ``kv_tiles``, a float or bool array
    ``TypeError``; nothing is planned then."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a tessera.Mask, got {type(mask).__name__}")
    sb = _block_pair(*(("block", block) if selection_block is None else ("selection_block", selection_block)))
    sel = _tessera.blocks(_kv_tiles("kv_tiles", kv_tiles), *sb)
    # Whole at once: a selection's plan is run straight away (the CPU kernels read the masks).
    return _plan(mask & sel, q_len, kv_len, heads, batch, block, cache, masks=True)


def cache_stats() -> Dict[str, Any]:
    """Counters of this process's plan cache: memory/disk hits, misses, rejects, plans built,
    bytes read/written, directory and warnings."""
    return _tessera.cache_stats()
