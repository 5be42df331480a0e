"""A plan as a torch FlexAttention ``BlockMask`` (the plan exporter for torch; imports torch).

The BlockMask is built once per (plan, device) and kept on the plan, so the flex engine and
``plan.to_flex_block_mask(device)`` return the same object. Callers pass a :class:`Plan` (the
public entry, ``tessera.torch.to_flex_block_mask``, checks the argument's type)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .probes import _key  # noqa: F401  (the flex engine's device keys too)

if TYPE_CHECKING:  # the type only: Plan's own methods call this module
    from .plans import Plan


# -- FlexAttention ------------------------------------------------------------------------------

MASK_MODS = ("auto", "analytic", "bits")


class CompactMask:
    """A plan's ``BlockMask`` as host arrays for a device, in two flat buffers (int32, int64), so
    the device gets them in at most two copies: either O(active tiles) (the flat index and code
    of each non-empty tile, expanded into the tables on the device by
    :func:`block_mask_from_compact`) or, for small grids (``dense``), the eight tables themselves
    (no device work but the copy); plus the ``mask_mod``'s data (the analytic one's per-token
    arrays, or the packed bit blocks and tile codes of the bit-table one). Picklable;
    ``pin_memory()`` pins both buffers (a ``DataLoader`` with ``pin_memory=True`` calls it)."""

    __slots__ = ("dims", "i32", "i64", "parts", "prog", "kind", "reason", "dense")

    def __init__(self, dims, i32, i64, parts, prog, kind, reason, dense=False):
        self.dims, self.i32, self.i64, self.parts = dims, i32, i64, parts
        self.prog, self.kind, self.reason, self.dense = prog, kind, reason, dense

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, st):
        for k, v in st.items():
            setattr(self, k, v)

    def pin_memory(self) -> "CompactMask":
        def pin(t):
            return t if not torch.cuda.is_available() or t.is_pinned() else t.pin_memory()

        return CompactMask(self.dims, pin(self.i32), pin(self.i64), self.parts, self.prog, self.kind,
                           self.reason, self.dense)


# Grids of at most this many blocks (B' * H' * nq * nk: 32K tokens at 128-token blocks) go to a
# device as their eight tables, written by the host (1 MiB of tables at the limit; doc-causal
# 32K: 0.19 ms on a Zen 4 against 0.09 ms for the tiles), rather than as the non-empty tiles
# expanded there: on an H200 the expansion's ~17 launches took 0.6-0.9 ms whatever the size
# (BENCHMARKS.md, 2026-11-28, commit a8c6176), one copy of the tables should take ~0.1 ms
# (predicted, not yet measured on a GPU). Larger grids keep the O(active tiles) upload: the
# tables grow with the square of the length.
DEVICE_DENSE_CELLS = 1 << 16


def compact(plan: "Plan", mask_mod: str = "auto", dense: Any = None, pin: bool = False) -> CompactMask:
    """The plan's :class:`CompactMask`. ``mask_mod``: ``"analytic"`` (generated from the mask
    tree; ``ValueError`` with the reason when a leaf has none), ``"bits"`` (the plan's bit table)
    or ``"auto"`` (analytic where possible). ``dense``: the tables themselves (True), the
    non-empty tiles (False) or by size (None: up to ``DEVICE_DENSE_CELLS`` blocks). ``pin``: the
    buffers written straight into pinned memory (needs CUDA)."""
    prog, bufs, reason = _analytic(plan, mask_mod)
    _, _, lq, lkv = plan.shape
    gb, gh = plan.groups
    tq, tk = plan.block
    if dense is None:
        dense = gb * gh * -(-lq // tq) * -(-lkv // tk) <= DEVICE_DENSE_CELLS
    if dense:  # the eight tables (and the bit table's tile codes)
        head, bits, dims = _host_tables(plan, prog is None)
    else:
        cells, codes, bits, dims = plan._p._flex_compact(*BIT_CAPACITY, prog is None)
        head = [cells, codes]
    if prog is not None:
        bits = None
    # (buffer, offset, shape) of the head arrays, the bits (or None), then each buf
    parts, off, groups = [], {32: 0, 64: 0}, {32: [], 64: []}
    for a in head + [bits] + bufs:
        if a is None:
            parts.append(None)
            continue
        kind = 32 if a.dtype == np.int32 else 64
        parts.append((kind, off[kind], a.shape))
        off[kind] += a.size
        groups[kind].append(a)

    def flat(arrs, dt, n):
        if len(arrs) == 1 and not pin:  # one array (the bit table alone): wrapped, not copied
            return torch.from_numpy(np.ascontiguousarray(arrs[0]).ravel())
        out = torch.empty(n, dtype=torch.int32 if dt == np.int32 else torch.int64, pin_memory=pin and n > 0)
        if arrs:
            np.concatenate([a.ravel() for a in arrs], out=out.numpy())
        return out

    kind = "analytic" if prog is not None else "bits"
    return CompactMask(dims, flat(groups[32], np.int32, off[32]), flat(groups[64], np.int64, off[64]), parts,
                       prog, kind, reason, dense)


# Capacity of the captured bit blocks from the shapes alone for the usual masks (2 per q or kv
# tile and (batch, head) group, at most 2^14 blocks: 32 MiB at 128-token tiles; then the next
# power of two), so that plans of the same shapes whose partial counts differ a little share one
# compiled kernel.
BIT_CAPACITY = (2, 1 << 14)


def _host_tables(plan: "Plan", bits: bool):
    """``(arrays, bit blocks or None, dims)``: the plan's eight tables as numpy arrays of their
    ``BlockMask`` shapes (wrapping the native export, no copy), then with ``bits`` the
    ``[B', H', nq, nk]`` tile codes; ``dims`` as ``_flex_tables`` gives them."""
    arrays, blocks, dims = plan._p._flex_tables(*BIT_CAPACITY, bits)
    bg, hg, nq, nk = dims[:4]
    shapes = ((bg, hg, nq), (bg, hg, nq, nk)) * 2 + ((bg, hg, nk), (bg, hg, nk, nq)) * 2
    if bits:
        shapes += ((bg, hg, nq, nk),)
    return [a.reshape(sh) for a, sh in zip(arrays, shapes)], blocks, dims


def _analytic(plan: "Plan", mask_mod: str):
    """``(program, per-token arrays, reason)`` of the analytic ``mask_mod`` for ``mask_mod``:
    ``(None, [], reason or None)`` where the bit table serves (``"bits"``, or ``"auto"`` without
    an analytic form); ``"analytic"`` without one raises ``ValueError`` with the reason."""
    from . import flex_mask

    if mask_mod not in MASK_MODS:
        raise ValueError(f"mask_mod: expected one of {MASK_MODS}, got {mask_mod!r}")
    if mask_mod == "bits":
        return None, [], None
    _, _, lq, lkv = plan.shape
    prog, bufs, reason = None, [], None
    native_mask = plan._p.mask
    if native_mask is None:
        reason = "a rank's local plan of a sharding has no mask expression"
    else:
        prog, bufs = flex_mask.program(native_mask, lq, lkv)
        if isinstance(prog, str):
            reason, prog, bufs = prog, None, []
    if reason is not None and mask_mod == "analytic":
        raise ValueError(f"mask_mod='analytic': no analytic mask_mod for this plan: {reason}")
    return prog, bufs, reason


def _tables(grid):
    """The eight ``BlockMask`` tables of the tile-code grid ``[B', H', nq, nk]`` (0 empty, 1 full,
    2+ partial) in a few device ops: the partial and full levels (and, for the q side, their
    transposes) stacked into one tensor and ordered at once by :func:`_ordered`. On a GPU the
    launches, not the data, cost at these sizes: ordering each table apart took ~50 of them,
    1.0-1.4 ms on an H200."""
    lv = torch.stack((grid >= 2, grid == 1))  # [2, B', H', nq, nk]: partial, full
    sides = (lv, lv.transpose(-1, -2))
    if lv.shape[-1] == lv.shape[-2]:  # square: the kv and q sides in one tensor
        sides = (torch.cat(sides),)
    out = []
    for m in sides:
        num, idx = _ordered(m)
        out += [t for i in range(m.shape[0]) for t in (num[i], idx[i])]
    return out


def _ordered(m):
    """``(count, indices)`` of the true entries along the last dim of bool ``m``, as
    ``argsort(m, descending=True, stable=True)`` orders them (true ascending, then the rest
    ascending), with a cumulative sum and one scatter: no sort, no host sync."""
    n = m.shape[-1]
    c = m.to(torch.int32).cumsum(-1, dtype=torch.int32)
    num = c[..., -1]
    ar = torch.arange(n, dtype=torch.int32, device=m.device)
    pos = torch.where(m, c - 1, (num.unsqueeze(-1) - c) + ar)
    idx = torch.empty(m.shape, dtype=torch.int32, device=m.device)
    idx.scatter_(-1, pos.long(), ar.expand(m.shape))
    return num.contiguous(), idx


def block_mask_from_compact(c: CompactMask, device: Any = "cpu", non_blocking: bool = False):
    """The ``BlockMask`` of ``c`` on ``device``: at most two host-to-device copies (``non_blocking``
    from pinned memory), then every table expanded by device ops (a scatter of the tile codes
    into the ``[B', H', nq, nk]`` grid, then :func:`_tables`)."""
    from torch.nn.attention.flex_attention import BlockMask

    from . import flex_mask

    dev = torch.device(device)
    bg, hg, nq, nk, tq, tk, lq, lkv = c.dims
    views = _views(c, dev, non_blocking)
    if c.dense:  # the tables themselves (and the bit table's code grid)
        head = 8 if c.prog is not None else 9
        tables, grid = views[:8], views[8] if head == 9 else None
    else:
        head = 2
        cells, codes = views[:2]
        grid = torch.zeros(bg * hg * nq * nk, dtype=torch.int32, device=dev)
        grid.scatter_(0, cells.long(), codes)
        grid = grid.view(bg, hg, nq, nk)
        tables = _tables(grid)
    bits, bufs = views[head], views[head + 1:]
    if c.prog is not None:
        mask_mod = flex_mask.make_mask_mod(c.prog, bufs)
    else:
        mask_mod = _bits_mask_mod(grid, bits, bg, hg, tq, tk)
    return BlockMask((lq, lkv), *tables, BLOCK_SIZE=(tq, tk), mask_mod=mask_mod)


def _views(c: CompactMask, dev: Any, non_blocking: bool = False):
    """The arrays of ``c.parts`` on ``dev`` (``None`` where a part is absent): the two flat
    buffers copied once (not at all on the host), the rest views of them."""
    i32 = c.i32.to(dev, non_blocking=non_blocking)
    i64 = c.i64.to(dev, non_blocking=non_blocking) if c.i64.numel() else None
    views = []
    for p in c.parts:
        if p is None:
            views.append(None)
            continue
        kind, off, shape = p
        src = i32 if kind == 32 else i64
        views.append(src[off:off + int(np.prod(shape))].view(shape))
    return views


# Bytes of partial blocks from which "auto" on the host builds the analytic mask_mod rather than
# the bit table. Measured (4K tokens, 128-token blocks, Zen 4): below ~450 blocks the table is
# cheaper (tree-causal, 301 blocks: 0.054 ms against 0.071; a temporal head, 314: 0.09 against
# 0.10; documents, whose bounds are built per row, 0.025 against 0.115), above it copying and
# padding the blocks costs more (a whole-sequence tree, 527: 0.086 against 0.072; a temporal
# head with 100-token frames, 676: 0.14 against 0.13; a 16K tree of sparse tiles: 15 MiB).
HOST_BITS_LIMIT = 1 << 20


def _host_auto(plan: "Plan") -> str:
    """What ``"auto"`` is on the host for ``plan``: ``"bits"`` for a small bit table, else
    ``"auto"`` (analytic where the mask has the form, the bits otherwise); ``"auto"`` too while
    the plan's bitmasks are not built (building them costs more than the analytic data)."""
    if not plan._p.has_masks:
        return "auto"
    tq, tk = plan.block
    block_bytes = tq * ((tk + 63) // 64) * 8
    big = plan.stats["unique_partial_masks"] * block_bytes > HOST_BITS_LIMIT
    return "auto" if big else "bits"


def host_block_mask(plan: "Plan", mask_mod: str):
    """The ``BlockMask`` on the host: the eight tables straight from the plan's work lists (the
    native export's arrays, wrapped without a copy) and the ``mask_mod`` asked for. On the CPU
    this beats expanding the compact arrays with tensor ops, whose per-op dispatch costs more than
    the whole export at these sizes (4K causal: 0.03 ms against 0.35 ms)."""
    from torch.nn.attention.flex_attention import BlockMask

    from . import flex_mask

    prog, bufs, _ = _analytic(plan, mask_mod)
    # The analytic mask_mod reads no bits: neither the blocks nor the tile codes are exported.
    arrays, bits, (bg, hg, nq, nk, tq, tk, lq, lkv) = _host_tables(plan, prog is None)
    tables = [torch.from_numpy(a) for a in arrays]
    if prog is not None:
        fn = flex_mask.make_mask_mod(prog, _host_tensors(bufs))
    else:
        fn = _bits_mask_mod(tables.pop(), torch.from_numpy(bits), bg, hg, tq, tk)
    return BlockMask((lq, lkv), *tables, BLOCK_SIZE=(tq, tk), mask_mod=fn)


# Whether torch's one-time warning about tensors of read-only arrays has been spent (silenced).
_READ_ONLY_SILENCED = False


def _host_tensors(bufs):
    """The analytic ``mask_mod``'s buffers as host tensors sharing their memory: a band's
    features are read-only views of the mask's own data, which the ``mask_mod`` only reads.
    torch warns about such a tensor once per process: that first time is silenced (a
    ``catch_warnings`` block on every BlockMask cost ~15 us, so later calls skip it)."""
    global _READ_ONLY_SILENCED
    if _READ_ONLY_SILENCED or all(b.flags.writeable for b in bufs):
        return [torch.from_numpy(b) for b in bufs]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        out = [torch.from_numpy(b) for b in bufs]
    _READ_ONLY_SILENCED = True
    return out


def _bits_mask_mod(codes, bits, bg, hg, tq, tk):
    def mask_mod(b, h, q_idx, kv_idx):
        # The tile's code picks its bit block (0 empty, 1 full, else its partial block); bit
        # kv % 64 of int64 word kv // 64 of row q.
        bb = b if bg > 1 else b * 0
        hh = h if hg > 1 else h * 0
        kr = kv_idx % tk
        word = bits[codes[bb, hh, q_idx // tq, kv_idx // tk], q_idx % tq, kr // 64]
        return ((word >> (kr % 64)) & 1) == 1

    return mask_mod


def to_flex_block_mask(plan: "Plan", device: Any = "cpu", mask_mod: str = "auto"):
    """``plan`` as a ``torch.nn.attention.flex_attention.BlockMask`` on ``device``, built once per
    (plan, device, ``mask_mod``) and kept on the plan (the flex engine of :func:`attention` uses
    the ``"auto"`` one).

    The eight block tables equal what ``create_block_mask(mask_mod, B', H', Lq, Lkv,
    BLOCK_SIZE=plan.block)`` builds (``B'``, ``H'`` = ``plan.groups``: 1 where the mask does not
    vary); on a device they are expanded there from the plan's non-empty tiles (:func:`compact`,
    :func:`block_mask_from_compact`), on the CPU taken from the plan's export without a copy
    (:func:`host_block_mask`). Its ``mask_mod`` is exact for every ``(b, h, q, kv)``:
    ``"analytic"`` is generated from the mask expression (index comparisons, q-indexed document
    bounds; see ``tessera.core.flex_mask``), ``"bits"`` selects per block a packed bit block (all
    clear for empty blocks, all set for full ones, the plan's deduplicated bitmask for partial
    ones), captured padded to a power-of-two block count, at least twice the q or kv tile count
    per (batch, head) group, so that plans of the same shapes share one compiled kernel;
    ``"auto"`` is analytic on a GPU (or any non-CPU device) unless a ``dense``/``blocks`` leaf (or
    a band over features beyond ±2^62) needs the bits; on the CPU it is the bits while their
    table is small (below ``HOST_BITS_LIMIT`` bytes of partial blocks, where building the analytic
    data costs more than it saves), then analytic where the mask has the form.
    """
    dev = torch.device(device)
    key = _key(dev) if mask_mod == "auto" else f"{_key(dev)}|{mask_mod}"
    kept = plan._flex.setdefault("bm", {})
    if key in kept:
        return kept[key]
    if dev.type == "cpu":
        bm = host_block_mask(plan, _host_auto(plan) if mask_mod == "auto" else mask_mod)
    elif dev.type == "cuda":  # pinned: the copies do not wait for the device (no host sync)
        bm = block_mask_from_compact(compact(plan, mask_mod, pin=True), dev, non_blocking=True)
    else:
        bm = block_mask_from_compact(compact(plan, mask_mod), dev)
    kept[key] = bm
    prepare(plan, dev)
    return bm


def prepare(plan: "Plan", device: Any, sequences: bool = False) -> None:
    """What engine selection asks about ``plan`` on ``device``, read now (outside any compiled
    step): the capability probes, and with ``sequences`` whether the plan is plain causal
    documents and then its sequence boundaries on the device (what the ``varlen`` engine reads;
    ``auto`` does not pick it, so the BlockMask build skips this)."""
    from . import flex_mask, probes

    dev = torch.device(device)
    if dev.type == "cpu" or plan._p is None or plan._p.mask is None:
        return
    probes.warm(dev)
    if sequences and flex_mask.causal_documents(plan)[0] is not None:
        flex_mask.cu_seqlens(plan, plan.shape[0], dev)
