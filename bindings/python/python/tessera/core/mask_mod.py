"""Plans from FlexAttention ``mask_mod`` functions (docs/python.md#from-a-flexattention-mask_mod).

Contract: :func:`from_mask_mod` evaluates ``mask_mod(b, h, q_idx, kv_idx)`` on every pair of
``[B', H', Lq, Lkv]`` (``B'``/``H'`` are 1 when ``batch``/``heads`` is None, as
``create_block_mask`` with ``B=None``/``H=None``) and returns a :class:`~tessera.Plan` of the
``dense`` mask of exactly those values: its tile states and partial-tile bitmasks are what the
``mask_mod`` allows, pair for pair, so ``plan.to_flex_block_mask()`` has the block tables of
``create_block_mask(mask_mod, B', H', Lq, Lkv, BLOCK_SIZE=block)``. The evaluation broadcasts
(``q_idx`` a column ``[R, 1]`` of a chunk of rows, ``kv_idx`` a row ``[1, Lkv]``; ``b``, ``h``
0-d int64 tensors), falling back to ``torch.vmap`` (as ``create_block_mask`` evaluates) for a
``mask_mod`` that does not broadcast; each chunk is packed to bits at once, so memory is the
packed mask, ``B'·H'·Lq·ceil(Lkv/64)·8`` bytes (an eighth of a byte per pair: 32 MiB at 16K x
16K), plus a chunk of about ``2**20`` pairs per torch thread (the chunks run on as many Python
threads, torch's own thread count set to 1 meanwhile). torch is imported on call only.

When the evaluated mask is, exactly, one of the masks Tessera plans analytically (full, causal,
sliding window, prefix-LM, documents, causal documents; checked row by row on the evaluated
bits, never guessed), a :class:`MaskModHint` warning names the expression: planning it costs
milliseconds and no pass over the pairs.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from .. import _tessera
from .._tessera import Mask
from .args import _block_pair
from .plans import Plan, _plan

# Pairs per evaluated chunk: the mask_mod's int64 temporaries (8 MiB) stay near the caches
# (2**20 pairs measured faster than 2**18 and 2**21 on one thread).
CHUNK_PAIRS = 1 << 20


class MaskModHint(UserWarning):
    """:func:`from_mask_mod`'s mask is exactly ``expression`` (``mask``, a :class:`tessera.Mask`,
    plans it without evaluating the ``mask_mod``)."""

    def __init__(self, message: str, expression: str, mask: Mask) -> None:
        super().__init__(message)
        self.expression = expression
        self.mask = mask


def _length(name: str, value: Any, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return int(value)


def _check_result(out: Any, rows: int, lkv: int) -> Any:
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"mask_mod: expected it to return a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod: expected a bool tensor, got {out.dtype}")
    # 0-d (a constant) or 2-d broadcasting to [rows, lkv]; a 1-d result would broadcast along
    # the keys only, whichever index it came from, so it is refused.
    if out.dim() == 0 or (out.dim() == 2 and out.shape[0] in (1, rows) and out.shape[1] in (1, lkv)):
        return out.expand(rows, lkv)
    raise ValueError(
        f"mask_mod: returned shape {tuple(out.shape)} for q_idx [{rows}, 1] and kv_idx [1, {lkv}];"
        f" expected a 0-d or 2-d result that broadcasts to [{rows}, {lkv}]"
    )


def _vmapped(mask_mod: Callable) -> Callable:
    """``mask_mod`` over a column of queries and a row of keys through ``torch.vmap``, as
    ``create_block_mask`` evaluates it (tensor indexing allowed inside)."""
    import torch

    inner = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    outer = torch.vmap(inner, in_dims=(None, None, 0, None))

    def run(b, h, q, kv):
        try:
            from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        except ImportError:  # older torch: plain vmap
            return outer(b, h, q, kv)
        with TransformGetItemToIndex():
            return outer(b, h, q, kv)

    return run


def _evaluate(mask_mod: Callable, shape: Tuple[int, int, int, int], device: Any) -> np.ndarray:
    """Packed rows ``uint64 [B', H', Lq, ceil(Lkv / 64)]`` of ``mask_mod`` (bit ``j % 64`` of
    word ``j // 64`` is key ``j``), evaluated in chunks of about :data:`CHUNK_PAIRS` pairs.

    On the CPU with ``n > 1`` torch threads the chunks run on ``n`` Python threads, each op on
    one torch thread (torch's thread count is 1 during the call, restored after): every op of a
    chunk would otherwise be a parallel region, and their forks and joins cost more than the ops
    (4-10x on a busy 2-core machine, measured); torch ops release the GIL."""
    import torch

    bb, hh, lq, lkv = shape
    rows = max(1, CHUNK_PAIRS // lkv)
    out = np.zeros((bb, hh, lq, -(-lkv // 64) * 8), dtype=np.uint8)
    kv_idx = torch.arange(lkv, device=device)
    kv_row = kv_idx[None, :]
    fn = [None]  # None: broadcasting; else the vmapped form, once broadcasting failed

    def chunk(b: int, h: int, r0: int) -> None:
        bt, ht = torch.tensor(b, device=device), torch.tensor(h, device=device)
        r1 = min(lq, r0 + rows)
        q_idx = torch.arange(r0, r1, device=device)
        if fn[0] is None:
            try:
                got = mask_mod(bt, ht, q_idx[:, None], kv_row)
            except (TypeError, ValueError):
                raise
            except Exception as e:  # noqa: BLE001 (python control flow on tensors, ...)
                fn[0] = _vmapped(mask_mod)
                try:
                    got = fn[0](bt, ht, q_idx, kv_idx)
                except Exception:  # noqa: BLE001
                    raise e from None
        else:
            got = fn[0](bt, ht, q_idx, kv_idx)
        got = _check_result(got, r1 - r0, lkv)
        # 8 bits a byte, little-endian: the bytes of the row's words, as DenseMask keeps them
        out[b, h, r0:r1, : -(-lkv // 8)] = np.packbits(got.cpu().numpy(), axis=-1, bitorder="little")

    work = [(b, h, r0) for b in range(bb) for h in range(hh) for r0 in range(0, lq, rows)]
    # The first chunk alone decides broadcasting or vmap (and raises a bad result's error).
    chunk(*work[0])
    threads = torch.get_num_threads()
    if threads == 1 or len(work) == 1 or torch.device(device).type != "cpu":
        for w in work[1:]:
            chunk(*w)
        return out.view(np.uint64)
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(work) - 1)) as pool:
            for f in [pool.submit(chunk, *w) for w in work[1:]]:
                f.result()
    finally:
        torch.set_num_threads(threads)
    return out.view(np.uint64)


def from_mask_mod(
    mask_mod: Callable,
    q_len: int,
    kv_len: Optional[int] = None,
    heads: Optional[int] = None,
    batch: Optional[int] = None,
    *,
    block: Union[int, Tuple[int, int]] = 128,
    hint: bool = True,
    cache: bool = False,
    device: Any = "cpu",
) -> Plan:
    """The exact plan of a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for
    ``[batch, heads, q_len, kv_len]`` at tile ``block``: every pair is evaluated, so tile states
    and partial bitmasks are what ``mask_mod`` allows, and ``plan.to_flex_block_mask()`` has the
    tables of ``create_block_mask(mask_mod, batch, heads, q_len, kv_len, BLOCK_SIZE=block)``.

    ``heads=None`` / ``batch=None``: the mask does not depend on ``h`` / ``b`` (evaluated at 0,
    as ``create_block_mask`` with ``H=None`` / ``B=None``); the plan then has one head / row and
    broadcasts. Heads (rows) that evaluate alike are kept once, so ``plan.groups`` is 1 along
    a dimension the ``mask_mod`` ignores. ``kv_len`` defaults to ``q_len``. The ``mask_mod``
    is called on chunks of query rows with ``q_idx`` ``[R, 1]`` and ``kv_idx`` ``[1, kv_len]``
    (int64, on ``device``) and 0-d ``b``, ``h``, so it must be elementwise in them (as
    ``torch.vmap`` requires too); one that cannot broadcast (Python control flow on its
    arguments) is evaluated through ``torch.vmap`` as ``create_block_mask`` does. Memory: the
    packed mask,
    ``B·H·q_len·ceil(kv_len/64)·8`` bytes (32 MiB at 16K x 16K per (b, h)), plus a chunk of
    about 1M pairs per torch thread (on the CPU the chunks run on that many Python threads,
    torch's thread count set to 1 during the call and restored after); time: one pass over
    every pair.

    With ``hint`` (the default), a mask that equals one of Tessera's analytic expressions
    (full, causal, sliding window, prefix-LM, documents, causal documents), verified row by row
    on the evaluated bits, raises a :class:`MaskModHint` warning naming it (its ``mask``
    attribute is the expression): ``tessera.plan`` of it needs no evaluation at all.
    ``cache=True`` looks the plan up in (and stores it to) the plan cache, keyed by the
    evaluated bits' digest.

    Errors: ``TypeError`` for a non-callable ``mask_mod``, a result that is not a bool tensor,
    or a non-int length; ``ValueError`` for lengths below 1 or a result that does not broadcast
    to ``[R, kv_len]``, each naming the argument."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod: expected a callable mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    lq = _length("q_len", q_len)
    lkv = lq if kv_len is None else _length("kv_len", kv_len)
    hh = _length("heads", heads, optional=True)
    bb = _length("batch", batch, optional=True)
    _block_pair("block", block)  # checked before the evaluation; the planner checks the sizes
    shape = (bb or 1, hh or 1, lq, lkv)
    packed = _evaluate(mask_mod, shape, device)
    # Rows or heads that all evaluated alike collapse to one (the dense leaf broadcasts), so a
    # mask_mod that ignores b or h plans as one group, as a mask expression would.
    if all(np.array_equal(packed[:, k], packed[:, 0]) for k in range(1, packed.shape[1])):
        packed = packed[:, :1]
    if all(np.array_equal(packed[k], packed[0]) for k in range(1, packed.shape[0])):
        packed = packed[:1]
    if packed.shape[0] == 1:
        packed = packed[0, 0] if packed.shape[1] == 1 else packed[0]
    mask = _tessera.dense_words(np.ascontiguousarray(packed), lkv)
    plan = _plan(mask, lq, lkv, hh, bb, block, cache, masks=False)
    if hint and plan.groups == (1, 1):
        found = _equivalent(packed.reshape(lq, packed.shape[-1]), lq, lkv)
        if found is not None:
            text, m = found
            note = ""
            if "document" in text:
                counts = np.bincount(_document_ids(m))
                more = ", ..." if len(counts) > 4 else ""
                note = f" (ids: {len(counts)} documents of {', '.join(map(str, counts[:4]))}{more} tokens)"
            warnings.warn(
                MaskModHint(
                    f"from_mask_mod: this mask_mod is exactly {text}{note} on [{lq}, {lkv}], checked "
                    f"on every row; tessera.plan({text}, ...) plans it without evaluating any pair "
                    "(the warning's .mask is that expression)",
                    text,
                    m,
                ),
                stacklevel=2,
            )
    return plan


# -- exact equivalents ---------------------------------------------------------------------------


def _document_ids(m: Mask) -> np.ndarray:
    """The query-side ids of the (one) ``document`` leaf of a hint's mask."""
    stack = [m._tree()]
    while stack:
        node = stack.pop()
        if node[0] == "document":
            return np.asarray(node[1][0])
        if node[0] in ("and", "or", "heads"):
            stack.extend(node[1])
    raise ValueError("mask: no document leaf")


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits needed for each uint64 (0 for 0), exactly (float64 holds every 32-bit half)."""
    hi, lo = (x >> np.uint64(32)).astype(np.float64), (x & np.uint64(0xFFFFFFFF)).astype(np.float64)
    return np.where(hi > 0, 32 + np.frexp(hi)[1], np.frexp(lo)[1]).astype(np.int64)


def _row_intervals(words: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """``(first, last)`` allowed key of every row of ``words`` ``[Lq, W]`` when every row's
    allowed keys form one interval (``first > last`` for an empty row), else None."""
    w = words.shape[1]
    nz = words != 0
    any_row = nz.any(axis=1)
    fw = np.argmax(nz, axis=1)
    lw = w - 1 - np.argmax(nz[:, ::-1], axis=1)
    rows = np.arange(words.shape[0])
    fv, lv = words[rows, fw], words[rows, lw]
    first = fw * 64 + _bit_length(fv & (~fv + np.uint64(1))) - 1
    last = lw * 64 + _bit_length(lv) - 1
    count = np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    first, last = np.where(any_row, first, 0), np.where(any_row, last, -1)
    if not np.array_equal(count, last - first + 1):
        return None
    return first, last


def _candidates(first: np.ndarray, last: np.ndarray, lq: int, lkv: int) -> List[Tuple[str, Any]]:
    """Expressions whose rows might be ``[first, last]``, with their parameters read off the
    rows; each is verified by :func:`_equivalent`, so a wrong guess costs nothing."""
    i = np.arange(lq)
    out: List[Tuple[str, Any]] = [("tessera.full()", ("full",))]
    open_row = last < lkv - 1  # rows whose end is not clamped by the key range
    if open_row.any():
        k = int(np.argmax(open_row))
        off = int(last[k] - k)
        out.append(("tessera.causal()" if off == 0 else f"tessera.causal({off})", ("causal", off)))
        right = off
        clamped_left = first > 0
        left = int(i[clamped_left][0] - first[clamped_left][0]) if clamped_left.any() else lq + lkv
        out.append((f"tessera.window({left})" if right == 0 else f"tessera.window({left}, {right})",
                    ("window", left, right)))
        late = int(np.nonzero(open_row)[0][-1])
        off2, n = int(last[late] - late), int(last[0] + 1)
        if n > 0:
            causal = "tessera.causal()" if off2 == 0 else f"tessera.causal({off2})"
            out.append((f"{causal} | tessera.prefix({n})", ("prefix_lm", off2, n)))
    if lq == lkv and (first <= last).all():
        # documents: runs of rows sharing their first key, each run starting at its own row
        starts = first == i
        ids = np.cumsum(starts) - 1
        if starts[0] and (first == i[starts][ids]).all():
            causal = bool((last == i).all())
            name = "tessera.causal() & tessera.document(ids)" if causal else "tessera.document(ids)"
            out.append((name, ("document", ids, causal)))
    return out


def _intervals_of(spec: Any, lq: int, lkv: int) -> Tuple[np.ndarray, np.ndarray, Mask]:
    """Rows ``(first, last)`` of a candidate (``first > last``: empty) and its mask."""
    i = np.arange(lq, dtype=np.int64)
    kind = spec[0]
    if kind == "full":
        return np.zeros(lq, np.int64), np.full(lq, lkv - 1), _tessera.full()
    if kind == "causal":
        return np.zeros(lq, np.int64), np.minimum(i + spec[1], lkv - 1), _tessera.causal(spec[1])
    if kind == "window":
        _, left, right = spec
        return np.maximum(i - left, 0), np.minimum(i + right, lkv - 1), _tessera.window(left, right)
    if kind == "prefix_lm":
        _, off, n = spec
        last = np.minimum(np.maximum(i + off, n - 1), lkv - 1)
        return np.zeros(lq, np.int64), last, _tessera.causal(off) | _tessera.prefix(n)
    _, ids, causal = spec
    starts = np.searchsorted(ids, ids, side="left")
    ends = np.searchsorted(ids, ids, side="right") - 1
    m = _tessera.document(np.ascontiguousarray(ids, dtype=np.int64), None)
    if causal:
        return starts, i, _tessera.causal(0) & m
    return starts, ends, m


def _equivalent(words: np.ndarray, lq: int, lkv: int) -> Optional[Tuple[str, Mask]]:
    """The first analytic expression equal to the packed mask ``words`` ``[Lq, W]`` on every
    pair, or None. Exact: every row of ``words`` is checked to be one interval of keys (its
    popcount equals its span), and a candidate is kept only when its interval equals that one
    on every row (empty rows included)."""
    rows = _row_intervals(words)
    if rows is None:
        return None
    first, last = rows
    empty = first > last
    for text, spec in _candidates(first, last, lq, lkv):
        f, e, m = _intervals_of(spec, lq, lkv)
        c_empty = f > e
        if np.array_equal(empty, c_empty) and np.array_equal(first[~empty], f[~c_empty]) and np.array_equal(
            last[~empty], e[~c_empty]
        ):
            return text, m
    return None
