"""The mask algebra (docs/semantics.md#masks): leaf constructors and the text form, over the native ``Mask``."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

from .. import _tessera
from .._tessera import Mask
from .args import _block_pair, _bool_array, _int_arg, _int_ids, _kv_tiles


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
    if k is not None:
        _cross_rows("ids", q, "kv_ids", k)
    return _tessera.document(q, k)


def _cross_rows(q_name: str, q: Any, kv_name: str, k: Any) -> None:
    """Cross attention's ids agree on rows (1 broadcasts), checked here so that the error names
    the caller's arguments (the planner's own check names the CLI's flags)."""
    rq, rk = (a.shape[0] if a.ndim == 2 else 1 for a in (q, k))
    if rq != rk and 1 not in (rq, rk):
        raise ValueError(f"{kv_name}: expected 1 or {rq} rows (as {q_name}), found {rk}")


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
    """A block selection (docs/semantics.md#masks): query ``i`` may attend key ``j`` of batch row ``b``, head ``h``
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
    documents: Optional[Dict[str, Any]] = None,
) -> Mask:
    """Parses a mask expression in the CLI's language, e.g. ``"causal & document"`` with
    ``segments=ids``, ``"causal & document(a) | document(b, c)"`` with ``documents={"a": ids,
    ...}`` (``document(NAME)``: the same ids for queries and keys, ``document(Q, KV)``: cross
    attention), ``"window(4K) | prefix(64)"``, ``"heads(causal, full)"``,
    ``"dense(m) & causal"`` with ``dense={"m": array}``, ``"band(t, t, 0, 64)"`` with
    ``features={"t": ints}`` (integer arrays ``[L]`` or ``[B, L]``), or
    ``"causal & blocks(128, 128, sel)"`` with ``blocks={"sel": kv_tiles}`` (``blocks(QB, KVB,
    NAME)``: see :func:`blocks`).

    Round trip: ``mask(str(m), **m.data())`` equals ``m`` (``==``, hence the same plans) for
    every mask ``m``; ``m.data()`` holds the arrays under the names ``str(m)`` uses (the typed
    constructors name data by content: ``ids_<hex>``, ``f_<hex>``, ``dense_<hex>``,
    ``sel_<hex>``)."""
    if not isinstance(expr, str):
        raise TypeError(f"expr: expected a str, got {type(expr).__name__}")
    seg = None if segments is None else _int_ids("segments", segments)
    qs = None if q_segments is None else _int_ids("q_segments", q_segments)
    ks = None if kv_segments is None else _int_ids("kv_segments", kv_segments)
    if qs is not None and ks is not None:
        _cross_rows("q_segments", qs, "kv_segments", ks)
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
    docs = None
    if documents is not None:
        if not isinstance(documents, dict):
            raise TypeError("documents: expected a dict of name -> integer array")
        docs = {str(k): _int_ids(f"documents['{k}']", v) for k, v in documents.items()}
    sel = None
    if blocks is not None:
        if not isinstance(blocks, dict):
            raise TypeError("blocks: expected a dict of name -> integer array")
        sel = {str(k): _kv_tiles(f"blocks['{k}']", v) for k, v in blocks.items()}
    return _tessera.mask(expr, seg, qs, ks, table, feats, sel, docs)
