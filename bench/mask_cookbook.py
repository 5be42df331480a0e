#!/usr/bin/env python3
"""The mask cookbook (docs/mask-cookbook.md): masks published for FlexAttention, each written in
Tessera (at most three leaves or one `tessera.layouts` helper, never a dense array) next to its
reference `mask_mod`, and timed: `tessera.plan(..., cache=False)` + `to_flex_block_mask()`
against warm `torch.compile(create_block_mask)` in the same process.

The reference mask_mods are written here from the published definitions (attention-gym's
`attn_gym/masks`, NATTEN's FlexAttention mask, FastVideo's STA reference, Sparse VideoGen,
BD3-LM, FlashMask, the FlexAttention blog), independently of the formulas in
`tessera.layouts`; `bindings/python/tests/test_mask_cookbook.py` checks every recipe's
BlockMask tables and token mask against them at many small shapes.

Each family is a builder with explicit parameters (`RECIPES[name](**params)` -> `Recipe`) and a
sizing (`SIZES[name](n)` -> params for about `n` tokens). Timing: `--warmup` untimed calls each
(for `create_block_mask` the first is the compilation), then the median of `--reps` calls; the
eight tables are checked equal.

Usage: .venv/bin/python bench/mask_cookbook.py [--sizes 4096,65536] [--only a,b] [--reps 3] [--warmup 1]
       [--doc-causal 32768] [--json] [--png DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

import tessera

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import TABLES, cpu_model, doc_ids, median_time  # noqa: E402

@dataclass
class Recipe:
    """One cookbook mask at one size: the Tessera expression (``text`` is how the docs write it),
    the reference ``mask_mod``, the shapes to plan, and ``(batch, heads)``, the rows and heads the
    mask varies over (what ``create_block_mask`` is given and ``plan.groups`` must be)."""

    family: str
    text: str
    mask: tessera.Mask
    mask_mod: Callable
    q_len: int
    kv_len: int
    batch: int = 1
    heads: int = 1
    helper: bool = False


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a))


# -- coordinates of a flattened canvas (torch, inside mask_mods) -------------------------------


def _row_major(grid: Sequence[int]) -> Callable:
    def crd(idx):
        out = []
        for a in range(len(grid)):
            inner = math.prod(grid[a + 1 :])
            out.append((idx // inner) % grid[a])
        return out

    return crd


def _tiled(grid: Sequence[int], tile: Sequence[int]) -> Callable:
    """attention-gym's `generate_tiled_natten` layout (N-D): tiles row-major, tokens row-major
    inside a tile."""
    tiles = [g // t for g, t in zip(grid, tile)]
    per_tile = math.prod(tile)
    tile_crd, in_crd = _row_major(tiles), _row_major(tile)

    def crd(idx):
        tc, ic = tile_crd(idx // per_tile), in_crd(idx % per_tile)
        return [c * t + i for c, t, i in zip(tc, tile, ic)]

    return crd


def _deinterleave(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


def _morton(idx):
    """(row, col) of Morton code ``idx``: the column in the even bits (attention-gym's
    `generate_morton_natten`)."""
    return [_deinterleave(idx >> 1), _deinterleave(idx)]


def _natten_mod(grid, kernel, dilation, stride, causal, crd) -> Callable:
    """NATTEN's neighborhood (its FlexAttention mask, natten/backends/flex.py): per axis the
    window centre is the stride-group leader clamped ``k // 2`` from the edges of the query's
    dilation group; ``k // 2`` positions before the centre, ``k - 1 - k // 2`` after; causal
    axes end the window at the query."""

    def mod(b, h, q_idx, kv_idx):
        qc, kc = crd(q_idx), crd(kv_idx)
        ok = None
        for a, n in enumerate(grid):
            k, d, s = kernel[a], dilation[a], stride[a]
            x, y = qc[a], kc[a]
            xd, yd = x // d, y // d
            lg = torch.where(x % d < n % d, n // d + 1, n // d)
            if causal[a]:
                lead = torch.minimum((xd // s) * s + s - 1, lg - 1)
                m = (yd <= xd) & (lead - yd < k)
            else:
                left, right = k // 2, k // 2 + (k % 2 - 1)
                lead = torch.minimum((xd // s) * s + s // 2, lg - 1)
                centre = torch.minimum(torch.clamp(lead, min=left), lg - 1 - right)
                m = (centre - left <= yd) & (yd <= centre + right)
            m = m & (x % d == y % d)
            ok = m if ok is None else ok & m
        return ok

    return mod


def _axes(v, nd):
    return (v,) * nd if isinstance(v, int) else tuple(v)


def _morton_order(side: int) -> np.ndarray:
    """Row-major cell of each Morton-ordered token of a ``side × side`` canvas."""
    r, c = _morton(np.arange(side * side))
    return r * side + c


# -- the recipes --------------------------------------------------------------------------------


def causal_lm(n: int) -> Recipe:
    return Recipe("causal", "tessera.causal()", tessera.causal(), lambda b, h, q, kv: q >= kv, n, n)


def sliding_window(n: int, w: int) -> Recipe:
    """attention-gym `generate_sliding_window(w)`: causal, at most ``w`` keys back."""
    return Recipe(
        "sliding window",
        f"tessera.window({w})",
        tessera.window(w),
        lambda b, h, q, kv: (q - kv <= w) & (q >= kv),
        n,
        n,
    )


def prefix_lm(n: int, p: int) -> Recipe:
    """attention-gym `generate_prefix_lm_mask(p)`: ``kv < p`` or causal."""
    return Recipe(
        "prefix LM",
        f"tessera.causal() | tessera.prefix({p})",
        tessera.causal() | tessera.prefix(p),
        lambda b, h, q, kv: (kv < p) | (q >= kv),
        n,
        n,
    )


def document_causal(ids: np.ndarray) -> Recipe:
    """attention-gym `generate_doc_mask_mod(causal_mask, offsets)`: causal inside each packed
    document; ``ids`` ``[L]`` or ``[B, L]`` (``-1`` = padding)."""
    ids = np.asarray(ids, dtype=np.int64)
    t = _t(np.atleast_2d(ids))
    rows = t.shape[0] if ids.ndim == 2 else 1

    def mod(b, h, q, kv):
        bb = b if rows > 1 else 0
        return (q >= kv) & (t[bb, q] == t[bb, kv]) & (t[bb, q] >= 0)

    return Recipe(
        "document causal",
        "tessera.causal() & tessera.document(ids)",
        tessera.causal() & tessera.document(ids),
        mod,
        ids.shape[-1],
        ids.shape[-1],
        batch=rows,
    )


def shared_prefix(prompts: Sequence[int], answers: Sequence[Sequence[int]]) -> Recipe:
    """FlashMask's "shared question" mask (DPO / reward-model packing): each group is a prompt
    followed by several answers; an answer attends causally to its own prompt and itself, never
    to a sibling answer; groups are packed one after another."""
    part, group, is_prompt = [], [], []
    pid = 0
    for g, (p, ans) in enumerate(zip(prompts, answers)):
        for length, prm in [(p, True)] + [(a, False) for a in ans]:
            part += [pid] * length
            group += [g] * length
            is_prompt += [prm] * length
            pid += 1
    part_a, group_a, prm_a = (np.asarray(x, dtype=np.int64) for x in (part, group, is_prompt))
    tp, tg, tpr = _t(part_a), _t(group_a), _t(prm_a.astype(bool))
    n = len(part)

    def mod(b, h, q, kv):
        return (q >= kv) & (tg[q] == tg[kv]) & ((tp[q] == tp[kv]) | tpr[kv])

    m = tessera.causal() & (
        tessera.document(part_a) | tessera.document(group_a, np.where(prm_a == 1, group_a, -1))
    )
    return Recipe(
        "shared prefix",
        "tessera.causal() & (tessera.document(part) | tessera.document(group, prompt_group))",
        m,
        mod,
        n,
        n,
    )


def block_diffusion(n: int, block: int) -> Recipe:
    """BD3-LM's training mask (Arriola et al. 2025, `block_diff_mask`) over ``[x_t, x_0]`` of
    ``2n`` tokens: noisy blocks attend themselves (block diagonal), noisy blocks attend clean
    blocks strictly before them (offset block-causal), clean blocks attend clean blocks up to
    their own (block-causal). ``n`` a multiple of ``block``."""

    def mod(b, h, q, kv):
        xq, xk = q >= n, kv >= n
        bq = torch.where(xq, (q - n) // block, q // block)
        bk = torch.where(xk, (kv - n) // block, kv // block)
        diag = (bq == bk) & (xq == xk)
        offset = (bq > bk) & xk & ~xq
        causal = (bq >= bk) & xk & xq
        return diag | offset | causal

    i = np.arange(2 * n)
    blk, clean = (i % n) // block, i >= n
    # Keys of x_0 in block c carry c + 1 (noisy keys: out of reach); a query in block b carries
    # b + 1 on x_0, b on x_t: f - g >= 0 is "key block <= query block" resp. "<".
    f = blk + clean
    g = np.where(clean, blk + 1, n // block + 2)
    m = (tessera.chunk(block) & tessera.prefix(n)) | tessera.band(f, g, 0, n // block)
    return Recipe(
        "block diffusion",
        "(tessera.chunk(block) & tessera.prefix(n)) | tessera.band(f, g, 0, n // block)",
        m,
        mod,
        2 * n,
        2 * n,
    )


def dilated_sliding_window(n: int, w: int, d: int) -> Recipe:
    """attention-gym `generate_dilated_sliding_window(w, d)`: ``|q - kv| <= w`` and
    ``|q - kv| % d == 0``."""

    def mod(b, h, q, kv):
        diff = (q - kv).abs()
        return (diff <= w) & (diff % d == 0)

    return Recipe(
        "dilated sliding window",
        f"tessera.dilated_window({w}, {w}, {d}, q_len=L)",
        tessera.dilated_window(w, w, d, n),
        mod,
        n,
        n,
        helper=True,
    )


def global_window(flags: np.ndarray, w: int) -> Recipe:
    """Longformer / BigBird local + global attention: a symmetric window of ``w`` and global
    tokens (flagged rows attend all, flagged columns are attended by all); flags ``[L]`` or
    ``[B, L]``."""
    flags = np.asarray(flags, dtype=bool)
    t = _t(np.atleast_2d(flags))
    rows = t.shape[0] if flags.ndim == 2 else 1

    def mod(b, h, q, kv):
        bb = b if rows > 1 else 0
        return ((q - kv).abs() <= w) | t[bb, q] | t[bb, kv]

    return Recipe(
        "global tokens + window",
        f"tessera.window({w}, {w}) | tessera.global_tokens(is_global)",
        tessera.window(w, w) | tessera.global_tokens(flags),
        mod,
        flags.shape[-1],
        flags.shape[-1],
        batch=rows,
        helper=True,
    )


def natten(
    grid: Sequence[int],
    kernel,
    dilation=1,
    stride=1,
    causal=False,
    layout: str = "row-major",
    tile: Optional[Sequence[int]] = None,
) -> Recipe:
    """NATTEN neighborhood attention on a 1-3-D canvas (NATTEN's own FlexAttention mask);
    ``layout`` "tiled" stores the canvas tile by tile (attention-gym `generate_tiled_natten`),
    "morton" along a Morton curve (attention-gym `generate_morton_natten`, square power-of-two
    canvas)."""
    grid = tuple(grid)
    nd = len(grid)
    k, d, s = _axes(kernel, nd), _axes(dilation, nd), _axes(stride, nd)
    c = (causal,) * nd if isinstance(causal, bool) else tuple(causal)
    order, crd = None, _row_major(grid)
    args = [f"{grid}", f"{kernel}"]
    if dilation != 1:
        args.append(f"dilation={dilation}")
    if stride != 1:
        args.append(f"stride={stride}")
    if causal is not False:
        args.append(f"causal={causal}")
    if layout == "tiled":
        order, crd = tessera.tile_order(grid, tile), _tiled(grid, tile)
        args.append(f"order=tessera.tile_order({grid}, {tuple(tile)})")
    elif layout == "morton":
        order, crd = _morton_order(grid[0]), _morton
        args.append("order=morton")
    name = {1: "NATTEN 1D", 2: "NATTEN 2D", 3: "NATTEN 3D"}[nd]
    if layout != "row-major":
        name += f" ({layout})"
    elif max(d) > 1:
        name += " dilated"
    elif any(c):
        name += " causal"
    n = math.prod(grid)
    return Recipe(
        name,
        f"tessera.neighborhood({', '.join(args)})",
        tessera.neighborhood(grid, k, d, stride=s, causal=c, order=order),
        _natten_mod(grid, k, d, s, c, crd),
        n,
        n,
        helper=True,
    )


def sta(grid: Sequence[int], tile: Sequence[int], kernel: Sequence[int], text: int = 0, pad: int = 0) -> Recipe:
    """Sliding Tile Attention (attention-gym `generate_sta_mask_mod_2d/3d`): windows of whole
    tiles on a tile-by-tile canvas, then ``text`` text tokens and ``pad`` padding tokens."""
    grid, tile, kernel = tuple(grid), tuple(tile), tuple(kernel)
    tiles = [g // t for g, t in zip(grid, tile)]
    kt = [k // t for k, t in zip(kernel, tile)]
    per_tile, v = math.prod(tile), math.prod(grid)
    tile_crd = _row_major(tiles)

    def mod(b, h, q, kv):
        qt, kvt = tile_crd(q // per_tile), tile_crd(kv // per_tile)
        win = None
        for a in range(len(grid)):
            lb, rb = kt[a] // 2, kt[a] // 2 + (kt[a] % 2 - 1)
            centre = torch.minimum(torch.clamp(qt[a], min=lb), torch.full_like(qt[a], tiles[a] - 1 - rb))
            m = (kvt[a] >= centre - lb) & (kvt[a] <= centre + rb)
            win = m if win is None else win & m
        vision = (q < v) & (kv < v)
        to_text = (q < v) & (kv >= v) & (kv < v + text)
        text_all = (q >= v) & (kv < v + text)
        return (vision & win) | to_text | text_all

    n = v + text + pad
    return Recipe(
        f"STA {len(grid)}D" + (" + text" if text else ""),
        f"tessera.tiled_neighborhood({grid}, {tile}, {kernel}"
        + (f", text_len={text}, seq_len={n})" if n > v else ")"),
        tessera.tiled_neighborhood(grid, tile, kernel, text_len=text, seq_len=n),
        mod,
        n,
        n,
        helper=True,
    )


def sasa(h: int, w: int, r: int) -> Recipe:
    """Stand-alone self-attention (the FlexAttention blog's `sasa_mask`): a (2r+1)² window cut
    at the borders of an ``h × w`` canvas."""

    def mod(b, hh, q, kv):
        return ((q // w - kv // w).abs() <= r) & ((q % w - kv % w).abs() <= r)

    rows, cols = np.divmod(np.arange(h * w), w)
    return Recipe(
        "2D window (SASA)",
        f"tessera.band(row, row, -{r}, {r}) & tessera.band(col, col, -{r}, {r})",
        tessera.band(rows, rows, -r, r) & tessera.band(cols, cols, -r, r),
        mod,
        h * w,
        h * w,
    )


def svg_spatial(
    prompt: int, frames: int, per_frame: int, width: int = 2, sink: bool = False, round_width: int = 128
) -> Recipe:
    """Sparse VideoGen's spatial head (attention-gym `generate_spatial_head_mask_mod`): prompt
    rows and columns global (with ``sink``, the first frame's columns too), and a band of
    ``|q - kv| < floor(width·per_frame / round_width)·round_width``."""
    n = prompt + frames * per_frame
    mw = (width * per_frame) // round_width * round_width
    cols = prompt + per_frame if sink else prompt

    def mod(b, h, q, kv):
        return (kv < cols) | (q < prompt) | ((q - kv).abs() < mw)

    i = np.arange(n)
    return Recipe(
        "video spatial head",
        f"tessera.global_tokens(i < {prompt}, i < {cols}) | tessera.window({mw - 1}, {mw - 1})",
        tessera.global_tokens(i < prompt, i < cols) | tessera.window(mw - 1, mw - 1),
        mod,
        n,
        n,
        helper=True,
    )


def svg_temporal(prompt: int, frames: int, per_frame: int, width: int = 2) -> Recipe:
    """Sparse VideoGen's temporal head (attention-gym `generate_temporal_head_mask_mod`):
    prompt rows and columns global, and tokens at nearby positions of any frame:
    ``|(q - prompt) % per_frame - (kv - prompt) % per_frame| < width·per_frame // frames``."""
    n = prompt + frames * per_frame
    mw = (width * per_frame) // frames

    def mod(b, h, q, kv):
        tq, tk = (q - prompt) % per_frame, (kv - prompt) % per_frame
        return (kv < prompt) | (q < prompt) | ((tq - tk).abs() < mw)

    i = np.arange(n)
    pos = (i - prompt) % per_frame
    return Recipe(
        "video temporal head",
        f"tessera.global_tokens(i < {prompt}) | tessera.band(pos, pos, -{mw - 1}, {mw - 1})",
        tessera.global_tokens(i < prompt) | tessera.band(pos, pos, -(mw - 1), mw - 1),
        mod,
        n,
        n,
        helper=True,
    )


def video_heads(prompt: int, frames: int, per_frame: int, width: int = 2) -> Recipe:
    """Sparse VideoGen's two head kinds side by side: head 0 spatial, head 1 temporal."""
    sp = svg_spatial(prompt, frames, per_frame, width)
    tm = svg_temporal(prompt, frames, per_frame, width)

    def mod(b, h, q, kv):
        return torch.where(h == 0, sp.mask_mod(b, h, q, kv), tm.mask_mod(b, h, q, kv))

    return Recipe(
        "video spatial + temporal heads",
        "tessera.heads([spatial, temporal])",
        tessera.heads([sp.mask, tm.mask]),
        mod,
        sp.q_len,
        sp.kv_len,
        heads=2,
        helper=True,
    )


def image_cross_attention(q_len: int, intervals: np.ndarray, image_tokens: int) -> Recipe:
    """Flamingo's vision cross-attention (attention-gym `generate_vision_cross_attention_mask_mod`):
    text query ``q`` attends the ``image_tokens`` keys of image ``m`` when
    ``intervals[m, 0] <= q < intervals[m, 1]``."""
    intervals = np.asarray(intervals, dtype=np.int64)
    iv = _t(intervals)
    kv_len = len(intervals) * image_tokens

    def mod(b, h, q, kv):
        m = kv // image_tokens
        return (q >= iv[m, 0]) & (q < iv[m, 1])

    img = np.arange(kv_len) // image_tokens
    pos = np.arange(q_len)
    m = tessera.band(pos, intervals[img, 0], 0, q_len) & tessera.band(pos, intervals[img, 1], -q_len, -1)
    return Recipe(
        "image cross-attention",
        "tessera.band(i, start[image(j)], 0, Lq) & tessera.band(i, end[image(j)], -Lq, -1)",
        m,
        mod,
        q_len,
        kv_len,
    )


def _intervals(rng, q_len, images):
    """Random (possibly overlapping) text intervals, one per image."""
    s = np.sort(rng.integers(0, q_len, images))
    e = np.minimum(q_len, s + rng.integers(1, max(2, q_len // 2), images))
    return np.stack([s, e], 1)


def tree_features(n: int, prefix: int, seed: int = 0):
    """A random tree of ``n`` tokens stored parent-before-child: a chain of ``prefix`` tokens
    (the shared prompt), then nodes whose parent is a uniformly random earlier node at or after
    the chain's end (a speculative-decoding token tree). Returns ``(parent, pre, end)``: the
    parent of each token (-1 for the first), its pre-order number and the end of its subtree
    (``end = pre + subtree size``), so ``j`` is an ancestor-or-self of ``i`` exactly when
    ``pre[j] <= pre[i] < end[j]``."""
    rng = np.random.default_rng(seed)
    parent = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        parent[i] = i - 1 if i <= prefix else int(rng.integers(max(prefix - 1, 0), i))
    size = np.ones(n, dtype=np.int64)
    for i in range(n - 1, 0, -1):
        size[parent[i]] += size[i]
    # Pre-order: a child's number is its parent's plus one plus the sizes of earlier siblings.
    pre = np.zeros(n, dtype=np.int64)
    next_child = np.ones(n, dtype=np.int64)  # offset of the next child below each node
    for i in range(1, n):
        p = parent[i]
        pre[i] = pre[p] + next_child[p]
        next_child[p] += size[i]
    return parent, pre, pre + size


def tree_causal(n: int, prefix: int, seed: int = 0) -> Recipe:
    """Tree attention for speculative decoding (SpecInfer, Medusa, EAGLE token trees): a token
    attends its ancestors and itself in a random tree stored parent-before-child after a prompt
    chain of ``prefix`` tokens, written as two bands over pre-order numbers and subtree ends (the
    planner fuses them into one interval per key). The bench's sizing: a tree of 3/4 of the
    tokens up to 4,096 nodes after the prompt; "whole sequence": all but 64 tokens a tree. The reference
    mask_mod is the same test a FlexAttention user writes (``pre[kv] <= pre[q] < end[kv]``);
    the test suite also checks it against walking the parent links."""
    _, pre, end = tree_features(n, prefix, seed)
    tp, te = _t(pre), _t(end)

    def mod(b, h, q, kv):
        return (tp[kv] <= tp[q]) & (tp[q] < te[kv])

    return Recipe(
        "tree-causal",
        "tessera.band(pre, pre, 0, MAX) & tessera.band(pre, end, MIN, -1)",
        tessera.band(pre, pre, 0, 2**63 - 1) & tessera.band(pre, end, -(2**63), -1),
        mod,
        n,
        n,
    )


def _renamed(r: Recipe, family: str) -> Recipe:
    r.family = family
    return r


def temporal_short_frames(n: int, per_frame: int, prompt: int = 256, window: int = 8) -> Recipe:
    """Sparse VideoGen's temporal head (`svg_temporal`) at about ``n`` tokens with frames of
    ``per_frame`` tokens (shorter than a tile, or not a multiple of it), the width chosen so
    that the window ``|tq - tk| < mw`` stays about ``window`` positions wide at any length."""
    frames = max(1, (n - prompt) // per_frame)
    width = max(1, -(-window * frames // per_frame))
    return _renamed(svg_temporal(prompt, frames, per_frame, width), f"video temporal head ({per_frame}-token frames)")


# -- sizings: the parameters of each family at about n tokens -----------------------------------


def _side(n, nd):
    return int(round(n ** (1 / nd)))


SIZES: Dict[str, Callable[[int], Recipe]] = {
    "causal": lambda n: causal_lm(n),
    "sliding window": lambda n: sliding_window(n, 512),
    "prefix LM": lambda n: prefix_lm(n, n // 4),
    "document causal": lambda n: document_causal(doc_ids(n, mean=1024)),
    "shared prefix": lambda n: shared_prefix(
        [n // 16] * 4, [[n // 16 - 7, n // 16 + 7, n // 16]] * 4
    ),
    "block diffusion": lambda n: block_diffusion(n // 2, 64),
    "dilated sliding window": lambda n: dilated_sliding_window(n, 512, 4),
    "global tokens + window": lambda n: global_window(np.isin(np.arange(n), np.r_[0:8, n // 3, n // 2]), 256),
    "NATTEN 1D dilated": lambda n: natten((n,), 255, dilation=8),
    "NATTEN 2D": lambda n: natten((_side(n, 2),) * 2, 13),
    "NATTEN 2D dilated": lambda n: natten((_side(n, 2),) * 2, 7, dilation=2),
    "NATTEN 2D (tiled)": lambda n: natten((_side(n, 2),) * 2, 13, layout="tiled", tile=(8, 8)),
    "NATTEN 2D (morton)": lambda n: natten((_side(n, 2),) * 2, 13, layout="morton"),
    "NATTEN 3D": lambda n: natten((16, _side(n // 16, 2), _side(n // 16, 2)), (3, 7, 7)),
    "NATTEN 3D causal": lambda n: natten(
        (16, _side(n // 16, 2), _side(n // 16, 2)), (3, 7, 7), causal=(True, False, False)
    ),
    "STA 3D + text": lambda n: sta(
        (16, _side(n // 16, 2), _side(n // 16, 2)), (4, 4, 4), (12, 12, 12), text=200, pad=56
    ),
    "2D window (SASA)": lambda n: sasa(_side(n, 2), _side(n, 2), 8),
    "video spatial head": lambda n: svg_spatial(256, 16, (n - 256) // 16, sink=True),
    "video temporal head": lambda n: svg_temporal(256, 16, (n - 256) // 16),
    "video spatial + temporal heads": lambda n: video_heads(256, 16, (n - 256) // 16),
    "image cross-attention": lambda n: image_cross_attention(
        n, _intervals(np.random.default_rng(5), n, 16), n // 16
    ),
    "tree-causal": lambda n: tree_causal(n, prefix=n - min(3 * n // 4, 4096), seed=7),
    "tree-causal (whole sequence)": lambda n: _renamed(
        tree_causal(n, prefix=64, seed=7), "tree-causal (whole sequence)"
    ),
    "video temporal head (100-token frames)": lambda n: temporal_short_frames(n, 100),
    "video temporal head (300-token frames)": lambda n: temporal_short_frames(n, 300),
}


# -- timing -------------------------------------------------------------------------------------


def tessera_block_mask(r: Recipe):
    return tessera.plan(
        r.mask, q_len=r.q_len, kv_len=r.kv_len, heads=r.heads, batch=r.batch, cache=False
    ).to_flex_block_mask()


def time_recipe(r: Recipe, reps: int, warmup: int = 1, min_seconds: float = 0.0) -> dict:
    for _ in range(max(1, warmup)):
        tessera_block_mask(r)  # warm-up (not timed)
    t_tessera, bm = median_time(lambda: tessera_block_mask(r), reps, min_seconds)
    # A fresh compilation per recipe: dynamo's per-function recompile limit (8 mask_mods) would
    # otherwise send later recipes to the eager path, which materializes [Lq, Lkv].
    torch._dynamo.reset()
    compiled = torch.compile(create_block_mask)
    call = lambda: compiled(r.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu")  # noqa: E731
    for _ in range(max(1, warmup)):
        call()  # compilation, then warm-up (not timed)
    t_torch, ref = median_time(call, reps, min_seconds)
    equal = all(torch.equal(getattr(bm, t), getattr(ref, t)) for t in TABLES)
    return dict(
        family=r.family,
        tokens=r.q_len,
        kv_tokens=r.kv_len,
        tessera_ms=t_tessera * 1e3,
        create_block_mask_ms=t_torch * 1e3,
        speedup=t_torch / t_tessera,
        tables_equal=equal,
    )


def pictures(out_dir: str) -> List[str]:
    """Small PNGs of every family (tile 16 or 32) for docs/img/cookbook/ (the two-head video
    recipe is its two single-head pictures)."""
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(3)
    small = {
        "causal": (causal_lm(1024), 32),
        "sliding window": (sliding_window(1024, 200), 32),
        "prefix LM": (prefix_lm(1024, 300), 32),
        "document causal": (document_causal(doc_ids(1024, mean=256, seed=3)), 32),
        "shared prefix": (shared_prefix([160, 120], [[90, 150, 60], [120, 130]]), 32),
        "block diffusion": (block_diffusion(512, 64), 32),
        "dilated sliding window": (dilated_sliding_window(1024, 128, 4), 16),
        "global tokens + window": (
            global_window(np.isin(np.arange(1024), np.r_[0:16, 500:516]), 96),
            32,
        ),
        "NATTEN 1D dilated": (natten((1024,), 33, dilation=4), 16),
        "NATTEN 2D": (natten((32, 32), 7), 16),
        "NATTEN 2D dilated": (natten((32, 32), 5, dilation=2), 16),
        "NATTEN 2D (tiled)": (natten((32, 32), 7, layout="tiled", tile=(4, 4)), 16),
        "NATTEN 2D (morton)": (natten((32, 32), 7, layout="morton"), 16),
        "NATTEN 3D": (natten((8, 12, 12), (3, 5, 5)), 16),
        "NATTEN 3D causal": (natten((8, 12, 12), (3, 5, 5), causal=(True, False, False)), 16),
        "STA 3D + text": (sta((8, 12, 12), (2, 4, 4), (4, 8, 8), text=100, pad=28), 16),
        "2D window (SASA)": (sasa(32, 32, 4), 16),
        "video spatial head": (svg_spatial(64, 8, 120, sink=True, round_width=32), 16),
        "video temporal head": (svg_temporal(64, 8, 120), 16),
        "image cross-attention": (image_cross_attention(1024, _intervals(rng, 1024, 8), 96), 32),
    }
    written = []
    for name, (r, tile) in small.items():
        p = tessera.plan(r.mask, q_len=r.q_len, kv_len=r.kv_len, heads=r.heads, batch=r.batch, block=tile)
        path = os.path.join(out_dir, _slug(name) + ".png")
        p.save_png(path, title=name)
        written.append(path)
    return written


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def bar(r: dict) -> int:
    """The target speedup for a result: 10x at 4K tokens, 100x at 64K, 200x for 32K doc-causal."""
    if r["family"].startswith("doc-causal"):
        return 200
    return 100 if r["tokens"] >= 60000 else 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536")
    ap.add_argument("--only", default="", help="comma-separated family names (default: all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing, each side")
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=0.3,
        help="each side's timed calls continue past --reps until they took this long in all (the "
        "same window for both sides: this guest's slow spells last tens of ms)",
    )
    ap.add_argument("--doc-causal", type=int, default=32768, help="the doc-causal row length (0: skip)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png", default="", help="write the docs' pictures into this directory and exit")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads for create_block_mask (0: torch's default; 1 is steadier on a "
        "shared machine, where idle OpenMP threads spin against other processes)",
    )
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.png:
        for p in pictures(args.png):
            print(p)
        return
    names = [x for x in args.only.split(",") if x] or list(SIZES)
    unknown = [x for x in names if x not in SIZES]
    if unknown:
        print(f"--only: unknown families {unknown}; known: {list(SIZES)}", file=sys.stderr)
        sys.exit(2)
    todo = [SIZES[name] for name in names]
    results = []

    def run(r):
        results.append(time_recipe(r, args.reps, args.warmup, args.min_seconds))
        if not args.json:
            print(_line(results[-1]), file=sys.stderr, flush=True)  # progress

    for n in [int(x) for x in args.sizes.split(",") if x]:
        for make in todo:
            run(make(n))
    if args.doc_causal:
        r = document_causal(doc_ids(args.doc_causal, mean=2048, seed=11))
        r.family = "doc-causal (bench/flex_block_mask.py ids)"
        run(r)
    if args.json:
        meta = dict(cpu=cpu_model(), threads=torch.get_num_threads(), load=os.getloadavg())
        print(json.dumps(dict(meta, results=results), indent=1))
        return
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"medians of at least {args.reps} calls and {args.min_seconds} s after {max(1, args.warmup)} warm-up "
        f"calls each; load average at the end {load}"
    )
    print("| family | tokens | tessera plan + BlockMask ms | compiled create_block_mask ms | speedup | bar | tables equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        ok = "met" if r["speedup"] >= bar(r) else "**missed**"
        print(
            f"| {r['family']} | {r['tokens']:,} | {r['tessera_ms']:.3f} | {r['create_block_mask_ms']:.1f} | "
            f"{r['speedup']:.0f}x | {bar(r)}x {ok} | {r['tables_equal']} |"
        )


def _line(r):
    return (
        f"{r['family']:>34s} {r['tokens']:>7d} tessera {r['tessera_ms']:9.3f} ms   "
        f"create_block_mask {r['create_block_mask_ms']:10.1f} ms   {r['speedup']:8.1f}x   "
        f"equal={r['tables_equal']}"
    )


if __name__ == "__main__":
    main()
