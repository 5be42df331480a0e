"""Tessera: block-sparse attention planned at tile granularity.

Quick start::

    import numpy as np, torch, tessera, tessera.torch
    ids = np.repeat(np.arange(4), 512)                  # four 512-token documents in one row
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=2048, heads=8)
    print(plan)                                         # a small picture of the tile states
    q, k, v = (torch.randn(1, 8, 2048, 64, requires_grad=True) for _ in range(3))
    out = tessera.torch.attention(q, k, v, plan)        # exact, skips empty tiles
    out.sum().backward()                                # gradients for q, k, v
    bm = plan.to_flex_block_mask()                      # the same plan as a torch BlockMask

Masks use the same algebra and spelling as the Rust API and the ``tessera`` CLI: leaves
``full()``, ``causal(offset)``, ``window(left, right)``, ``chunk(size)``, ``prefix(n)``,
``document(ids)``, ``band(q_feature, kv_feature, lo, hi)``, ``dense(array)``,
``blocks(kv_tiles, block)``, ``heads([...])`` combined with ``&``, ``|`` and ``~``, or the text form
``tessera.mask("causal & document", segments=ids)``. :func:`plan_from_blocks` plans a per-step
block selection (a MoBA / NSA gate's top-k) intersected with a mask. Layout helpers build the
masks of common token layouts from a few of those leaves (``tessera.layouts``): ``neighborhood``
(NATTEN), ``tiled_neighborhood`` (Sliding Tile Attention), ``tile_order``, ``dilated_window``,
``global_tokens``; docs/mask-cookbook.md writes the masks published for FlexAttention with them.
``torch`` and ``jax`` are optional: ``import tessera`` needs numpy only.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _tessera
from ._tessera import Mask

__all__ = [
    "Mask",
    "Plan",
    "full",
    "causal",
    "window",
    "chunk",
    "prefix",
    "document",
    "band",
    "dense",
    "heads",
    "blocks",
    "mask",
    "neighborhood",
    "tiled_neighborhood",
    "tile_order",
    "dilated_window",
    "global_tokens",
    "plan",
    "plan_from_blocks",
    "pack",
    "cache_stats",
    "Telemetry",
    "__version__",
]

__version__: str = _tessera.__version__


def _int_ids(name: str, ids: Any, what: str = "segment ids") -> np.ndarray:
    """Segment ids (or another per-token integer array, ``what``) as a contiguous int64 array
    ``[L]`` or ``[B, L]`` (numpy, torch, lists); values outside int64 are refused, not wrapped."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch tensor, on any device
        ids = ids.detach().cpu().numpy()
    a = np.asarray(ids)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array of {what}, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise ValueError(f"{name}: expected {what} of shape [L] or [B, L], got {a.shape}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: {what} must fit in int64, got {int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _bool_array(name: str, values: Any) -> np.ndarray:
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.dtype != np.bool_:
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected a bool (or 0/1 integer) array, got dtype {a.dtype}")
        if a.size and (a.min() < 0 or a.max() > 1):
            raise ValueError(f"{name}: expected only 0 and 1 in an integer mask array")
        a = a.astype(np.bool_)
    return np.ascontiguousarray(a)


def _kv_tiles(name: str, kv_tiles: Any) -> np.ndarray:
    """A block selection as a contiguous int64 array ``[B, H, Tq, k]`` (or ``[H, Tq, k]``,
    ``[Tq, k]``) from numpy, torch (a CUDA tensor is copied to the host once) or lists."""
    if hasattr(kv_tiles, "detach") and hasattr(kv_tiles, "cpu"):
        kv_tiles = kv_tiles.detach().cpu().numpy()
    a = np.asarray(kv_tiles)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array of kv tile indices (-1 = none), got dtype {a.dtype}")
    if a.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected shape [B, H, Tq, k] (or [H, Tq, k], [Tq, k]), got {tuple(a.shape)}")
    if a.dtype.kind == "u" and a.size and int(a.max()) >= 2**31:
        raise ValueError(f"{name}: expected kv tile indices below 2**31, found {int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _block_pair(name: str, block: Any, lo: int = 1) -> Tuple[int, int]:
    """``block`` as a ``(q, kv)`` pair of ints (an int means a square block)."""
    pair = (block, block) if isinstance(block, (int, np.integer)) and not isinstance(block, bool) else block
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected an int or a (q, kv) pair of ints, got {block!r}")
    return (_int_arg(name, "q", pair[0], lo), _int_arg(name, "kv", pair[1], lo))


def _int_arg(fn: str, name: str, value: Any, lo: int, hi: int = 2**62) -> int:
    """An exact integer argument in ``[lo, hi)``: bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v < hi:
        raise ValueError(f"{fn}: {name} must be in [{lo}, {hi}), got {v}")
    return v


def full() -> Mask:
    """Every pair allowed."""
    return _tessera.full()


def causal(offset: int = 0) -> Mask:
    """``i + offset >= j`` (top-left aligned, as FlexAttention and Splash)."""
    return _tessera.causal(_int_arg("causal", "offset", offset, -(2**62)))


def window(left: int, right: int = 0) -> Mask:
    """``i - left <= j <= i + right`` (negative sides are allowed, as in the text form)."""
    return _tessera.window(
        _int_arg("window", "left", left, -(2**62)), _int_arg("window", "right", right, -(2**62))
    )


def chunk(size: int) -> Mask:
    """``i // size == j // size`` (combine with ``causal()`` for chunked-causal attention)."""
    return _tessera.chunk(_int_arg("chunk", "size", size, 1))


def prefix(n: int) -> Mask:
    """``j < n``: a bidirectional prefix (prefix-LM is ``causal() | prefix(n)``)."""
    return _tessera.prefix(_int_arg("prefix", "n", n, 0))


def document(ids: Any, kv_ids: Any = None) -> Mask:
    """Same segment id, both ``>= 0`` (-1 = padding, never matches). ``ids`` is ``[L]`` (every
    batch row) or ``[B, L]``; pass ``kv_ids`` for cross attention."""
    q = _int_ids("ids", ids)
    k = None if kv_ids is None else _int_ids("kv_ids", kv_ids)
    return _tessera.document(q, k)


def band(q_feature: Any, kv_feature: Any, lo: int, hi: int) -> Mask:
    """``lo <= q_feature[b, i] - kv_feature[b, j] <= hi``, in exact integer arithmetic, for
    per-token integer features ``[L]`` (every batch row) or ``[B, L]`` (numpy, torch, lists):
    ``q_feature`` over the queries (``Lq`` long), ``kv_feature`` over the keys (``Lkv`` long).
    ``causal()`` is ``band(pos, pos, 0, 2**63 - 1)`` over positions ``pos = arange(L)``,
    ``window(l, r)`` is ``band(pos, pos, -r, l)``, and ``document(ids)`` on ids ``>= 0`` is
    ``band(ids, ids, 0, 0)`` (those leaves keep their own faster planning). A float or bool
    feature is a ``TypeError``, ``lo > hi`` a ``ValueError``; a feature of the wrong length is a
    ``ValueError`` naming it when the mask is planned."""
    q = _int_ids("q_feature", q_feature, "a feature")
    k = _int_ids("kv_feature", kv_feature, "a feature")
    bound = (-(2**63), 2**63)
    return _tessera.band(q, k, _int_arg("band", "lo", lo, *bound), _int_arg("band", "hi", hi, *bound))


def dense(values: Any) -> Mask:
    """A boolean array ``[Lq, Lkv]``, ``[H, Lq, Lkv]`` or ``[B, H, Lq, Lkv]``."""
    return _tessera.dense(_bool_array("dense", values))


def blocks(kv_tiles: Any, block: Union[int, Tuple[int, int]] = 128) -> Mask:
    """A block selection (SPEC §13): query ``i`` may attend key ``j`` of batch row ``b``, head ``h``
    iff key block ``j // kv_block`` is among ``kv_tiles[b, h, i // q_block]``. ``kv_tiles`` is an
    integer array ``[B, H, Tq, k]`` (numpy or torch; a CUDA tensor is copied to the host once;
    ``[H, Tq, k]`` and ``[Tq, k]`` broadcast, as do B or H of 1), ``-1`` meaning none, duplicates
    counting once; ``block`` is ``(q_block, kv_block)`` in tokens (an int: square). Planning checks
    ``Tq == ceil(Lq / q_block)`` and that every entry is below ``ceil(Lkv / kv_block)``. Usually
    reached through :func:`plan_from_blocks`."""
    q, kv = _block_pair("block", block)
    return _tessera.blocks(_kv_tiles("kv_tiles", kv_tiles), q, kv)


def heads(masks: Sequence[Mask]) -> Mask:
    """Head ``h`` uses ``masks[h]``."""
    masks = list(masks)
    for i, m in enumerate(masks):
        if not isinstance(m, Mask):
            raise TypeError(f"heads: element {i} is {type(m).__name__}, expected tessera.Mask")
    return _tessera.heads(masks)


def mask(
    expr: str,
    segments: Any = None,
    *,
    q_segments: Any = None,
    kv_segments: Any = None,
    dense: Optional[Dict[str, Any]] = None,
    features: Optional[Dict[str, Any]] = None,
    blocks: Optional[Dict[str, Any]] = None,
) -> Mask:
    """Parses a mask expression in the CLI's language, e.g. ``"causal & document"`` with
    ``segments=ids``, ``"window(4K) | prefix(64)"``, ``"heads(causal, full)"``,
    ``"dense(m) & causal"`` with ``dense={"m": array}``, ``"band(t, t, 0, 64)"`` with
    ``features={"t": ints}`` (integer arrays ``[L]`` or ``[B, L]``), or
    ``"causal & blocks(128, 128, sel)"`` with ``blocks={"sel": kv_tiles}`` (``blocks(QB, KVB,
    NAME)``: see :func:`blocks`)."""
    if not isinstance(expr, str):
        raise TypeError(f"expr: expected a str, got {type(expr).__name__}")
    seg = None if segments is None else _int_ids("segments", segments)
    qs = None if q_segments is None else _int_ids("q_segments", q_segments)
    ks = None if kv_segments is None else _int_ids("kv_segments", kv_segments)
    table = None
    if dense is not None:
        if not isinstance(dense, dict):
            raise TypeError("dense: expected a dict of name -> bool array")
        table = {str(k): _bool_array(f"dense['{k}']", v) for k, v in dense.items()}
    feats = None
    if features is not None:
        if not isinstance(features, dict):
            raise TypeError("features: expected a dict of name -> integer array")
        feats = {str(k): _int_ids(f"features['{k}']", v, "a feature") for k, v in features.items()}
    sel = None
    if blocks is not None:
        if not isinstance(blocks, dict):
            raise TypeError("blocks: expected a dict of name -> integer array")
        sel = {str(k): _kv_tiles(f"blocks['{k}']", v) for k, v in blocks.items()}
    return _tessera.mask(expr, seg, qs, ks, table, feats, sel)


# -- key-side documents for other engines -------------------------------------------------------
#
# FlexAttention's telemetry (tessera._flex) needs, on the device, which keys are sink keys (the
# first tokens of each key's document, SPEC §6): the positions below, from the kv segment ids of
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


_handles = itertools.count(1)
_registry: "weakref.WeakValueDictionary[int, Plan]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


class Plan:
    """A plan: which tiles of ``[B, H, Lq, Lkv]`` are empty, full or partial, with the work
    lists the kernels walk. Made by :func:`plan`; reused across layers and steps."""

    __slots__ = ("_p", "_handle", "_handle_tensor", "_traced", "_flex", "__weakref__")

    def __init__(self, native: "_tessera.Plan") -> None:
        self._p = native
        # Set only on the stand-in JAX rebuilds inside a traced function (a `tessera.jax.PlanRef`
        # holding the traced handle); see tessera.jax.
        self._traced = None
        with _registry_lock:
            self._handle = next(_handles)
            _registry[self._handle] = self
        # The op passes the plan as a 0-d int64 tensor (a tensor, so compiled graphs are not
        # specialized on it); made now when torch is loaded, else on first use.
        torch = sys.modules.get("torch")
        self._handle_tensor = None
        if torch is not None:
            self._handle_tensor = _handle_tensor(torch, self)
        # FlexAttention engine state (tessera._flex): per device, the BlockMask and sink-key
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
        """Tiles by state, unique partial masks, allowed pairs, density, grid width, bytes."""
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
    def to_flex_block_mask(self, device: Any = "cpu"):
        """This plan as a ``torch.nn.attention.flex_attention.BlockMask`` (tables equal to what
        ``create_block_mask`` builds for the same mask, with an exact ``mask_mod``)."""
        from . import torch as _t

        return _t.to_flex_block_mask(self, device=device)

    def to_splash_mask_info(self, **kwargs: Any):
        """This plan as JAX Splash ``MaskInfo`` objects (see :func:`tessera.jax.mask_info`)."""
        from . import jax as _j

        return _j.mask_info(self, **kwargs)

    def save_png(self, path: str, batch: int = 0, head: int = 0, title: Optional[str] = None) -> None:
        """Writes a PNG picture of the tile states of one batch row and head (the CLI's
        ``tessera plan --png``)."""
        self._p.save_png(str(path), batch, head, title)


def __getattr__(name: str) -> Any:
    # Telemetry lives with the torch integration (its summaries are tensors); imported lazily
    # so that `import tessera` needs numpy only.
    if name == "Telemetry":
        from ._telemetry import Telemetry

        return Telemetry
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")


def _handle_tensor(torch: Any, plan: "Plan") -> Any:
    """The plan's 0-d int64 handle tensor. It holds the plan as an attribute, so an autograd graph
    (which saves the handle) keeps the plan alive until its backward ran, even when the caller
    dropped it (``attention(q, k, v, tessera.plan(...))``)."""
    h = torch.tensor(plan._handle, dtype=torch.int64)
    h._tessera_plan = plan
    return h


def _plan_of(handle: int) -> Plan:
    p = _registry.get(int(handle))
    if p is None:
        raise ValueError("plan: this plan no longer exists (keep the Plan object alive while using it)")
    return p


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
    then disk) unless ``cache=False``; planning releases the GIL."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a tessera.Mask, got {type(mask).__name__}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("heads", heads), ("batch", batch)):
        if value is None and name != "q_len":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    return Plan(_tessera.plan(mask, int(q_len), kv_len, heads, batch, block, cache))


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
    """The plan of ``mask & blocks(kv_tiles, selection_block)`` (SPEC §13): a pair is allowed
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
    return plan(mask & sel, q_len, kv_len, heads, batch, block, cache)


def cache_stats() -> Dict[str, Any]:
    """Counters of this process's plan cache: memory/disk hits, misses, rejects, plans built,
    bytes read/written, directory and warnings."""
    return _tessera.cache_stats()


def pack(
    docs: Sequence[Any], seq_len: int, strategy: str = "best-fit", bos: int = 256
) -> Dict[str, Any]:
    """Packs tokenized documents into rows of ``seq_len`` (SPEC §8): every document starts with
    ``bos``; longer documents are split. Returns ``tokens``, ``segment_ids`` (-1 = padding) and
    ``positions`` (int32 ``[rows, seq_len]``) and ``stats``; the result is verified."""
    seq_len = _int_arg("pack", "seq_len", seq_len, 2, 2**31)
    bos = _int_arg("pack", "bos", bos, 0, 2**31)
    if not isinstance(strategy, str):
        raise TypeError(f"pack: strategy must be a str, got {type(strategy).__name__}")
    lists = []
    for i, d in enumerate(docs):
        if hasattr(d, "detach") and hasattr(d, "cpu"):
            d = d.detach().cpu().numpy()
        a = np.asarray(d)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"docs[{i}]: expected a 1-d sequence of integer token ids")
        lists.append(a.astype(np.int64).tolist())
    for i, d in enumerate(lists):
        if any(t < 0 or t > 2**31 - 1 for t in d):
            raise ValueError(f"docs[{i}]: token ids must be in 0..2**31-1")
    return _tessera.pack(lists, seq_len, strategy, bos)


# The layout helpers build on the leaves above (imported last: they use them).
from .layouts import (  # noqa: E402
    dilated_window,
    global_tokens,
    neighborhood,
    tile_order,
    tiled_neighborhood,
)
