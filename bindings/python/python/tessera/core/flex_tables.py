"""A plan as a torch FlexAttention ``BlockMask`` (the plan exporter for torch; imports torch).

The BlockMask is built once per (plan, device) and kept on the plan, so the flex engine and
``plan.to_flex_block_mask(device)`` return the same object. Callers pass a :class:`Plan` (the
public entry, ``tessera.torch.to_flex_block_mask``, checks the argument's type)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # the type only: Plan's own methods call this module
    from .plans import Plan


# -- per (plan, device) state -------------------------------------------------------------------


def _key(device: Any) -> str:
    """``"cuda:0"`` for ``"cuda"`` (the current device) and for ``q.device`` alike."""
    dev = torch.device(device)
    if dev.index is None and dev.type not in ("cpu", "meta"):
        mod = getattr(torch, dev.type, None)
        if mod is not None and hasattr(mod, "current_device"):
            dev = torch.device(dev.type, mod.current_device())
    return str(dev)


# -- FlexAttention ------------------------------------------------------------------------------


def to_flex_block_mask(plan: "Plan", device: Any = "cpu"):
    """``plan`` as a ``torch.nn.attention.flex_attention.BlockMask`` on ``device``, built once per
    (plan, device) and kept on the plan (the flex engine of :func:`attention` uses the same one).

    The eight block tables come straight from the plan's work lists (int32, contiguous) and equal
    what ``create_block_mask(mask_mod, B', H', Lq, Lkv, BLOCK_SIZE=plan.block)`` builds (``B'``,
    ``H'`` = ``plan.groups``: 1 where the mask does not vary). Its ``mask_mod`` is exact for every
    ``(b, h, q, kv)``: each block's code selects a packed bit block (all clear for empty
    blocks, all set for full ones, the plan's deduplicated bitmask for partial ones), captured
    padded to a power-of-two block count, at least twice the q or kv tile count per (batch,
    head) group, so that plans of the same shapes share one compiled kernel.
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev = torch.device(device)
    key = _key(dev)
    kept = plan._flex.setdefault("bm", {})
    if key in kept:
        return kept[key]
    # Capacity of the captured bit blocks from the shapes alone for the usual masks (2 per q or
    # kv tile and (batch, head) group, at most 2^14 blocks: 32 MiB at 128-token tiles; then the
    # next power of two), so that plans of the same shapes whose partial counts differ a little
    # share one compiled kernel.
    arrays, bits, (bg, hg, nq, nk, tq, tk, lq, lkv) = plan._p._flex_tables(2, 1 << 14)
    shapes = ((bg, hg, nq), (bg, hg, nq, nk)) * 2 + ((bg, hg, nk), (bg, hg, nk, nq)) * 2
    shapes += ((bg, hg, nq, nk),)
    if dev.type == "cpu":
        tables = [torch.from_numpy(a.reshape(s)) for a, s in zip(arrays, shapes)]
        bits = torch.from_numpy(bits)
    else:
        # one copy of the tables to the device, then views
        flat = torch.from_numpy(np.concatenate(arrays)).to(dev)
        parts = torch.split(flat, [a.size for a in arrays])
        tables = [p.view(s) for p, s in zip(parts, shapes)]
        bits = torch.from_numpy(bits).to(dev)
    codes = tables.pop()

    def mask_mod(b, h, q_idx, kv_idx):
        # The tile's code picks its bit block (0 empty, 1 full, else its partial block); bit
        # kv % 64 of int64 word kv // 64 of row q.
        bb = b if bg > 1 else b * 0
        hh = h if hg > 1 else h * 0
        kr = kv_idx % tk
        word = bits[codes[bb, hh, q_idx // tq, kv_idx // tk], q_idx % tq, kr // 64]
        return ((word >> (kr % 64)) & 1) == 1

    bm = BlockMask((lq, lkv), *tables, BLOCK_SIZE=(tq, tk), mask_mod=mask_mod)
    kept[key] = bm
    return bm
