"""Masks for the token layouts people use, each a few leaves of the mask algebra (docs/semantics.md#masks).

Contract: every helper returns a plain :class:`tessera.Mask` built from ``band``, ``window``
and ``prefix`` leaves whose per-token integer features are computed here in numpy
(O(L) memory, never an ``[Lq, Lkv]`` array), so a plan of it is exact and cheap like any other
mask and combines with ``&``, ``|``, ``~`` and ``heads``. Canvases are flattened row-major (the
last axis varies fastest) unless an ``order`` says where each token sits.

- :func:`neighborhood`: NATTEN neighborhood attention on 1-D, 2-D and 3-D canvases (windows
  clamped at the borders, dilation, stride, per-axis causal): one band per axis, plus one
  ``document`` leaf when dilation groups or tokens off the canvas need it.
- :func:`tiled_neighborhood`: Sliding Tile Attention (a canvas stored tile by tile, windows of
  whole tiles, optional text tokens after the canvas).
- :func:`tile_order`: the cell each token of a tile-by-tile canvas holds (for ``order=``).
- :func:`dilated_window`: a 1-D window keeping every ``dilation``-th key.
- :func:`global_tokens`: flagged rows attend everything, flagged columns are attended by every
  row (one band; ``|`` it with another mask).

Arguments are checked here: a wrong type raises ``TypeError``, a wrong value ``ValueError``,
each naming the function and the argument.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._tessera import Mask
from .args import _bool_array, _int_arg
from .masks import band, prefix, window

__all__ = ["neighborhood", "tiled_neighborhood", "tile_order", "dilated_window", "global_tokens"]

IntOrTuple = Union[int, Sequence[int]]

# Canvases larger than this are refused before any feature array is allocated.
_MAX_TOKENS = 2**31 - 1


# -- argument checks ----------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _grid(fn: str, grid: Any) -> Tuple[int, ...]:
    """A canvas shape: 1 to 3 positive ints (an int is a 1-D canvas)."""
    if _is_int(grid):
        grid = (grid,)
    if not isinstance(grid, (tuple, list)) or not all(_is_int(x) for x in grid):
        raise TypeError(f"{fn}: grid must be a tuple of 1 to 3 ints, got {grid!r}")
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{fn}: grid must have 1 to 3 axes, got {len(grid)}")
    g = tuple(int(x) for x in grid)
    if min(g) < 1:
        raise ValueError(f"{fn}: grid sides must be >= 1, got {g}")
    if math.prod(g) > _MAX_TOKENS:
        raise ValueError(f"{fn}: grid {g} has {math.prod(g)} tokens, more than {_MAX_TOKENS}")
    return g


def _per_axis(fn: str, name: str, value: Any, ndim: int, lo: int) -> Tuple[int, ...]:
    """An int (every axis) or one int per axis, each ``>= lo``."""
    vals = (value,) * ndim if _is_int(value) else value
    if not isinstance(vals, (tuple, list)) or not all(_is_int(x) for x in vals):
        raise TypeError(f"{fn}: {name} must be an int or a tuple of {ndim} ints, got {value!r}")
    if len(vals) != ndim:
        raise ValueError(f"{fn}: {name} must have one entry per grid axis ({ndim}), got {len(vals)}")
    out = tuple(int(x) for x in vals)
    if min(out) < lo:
        raise ValueError(f"{fn}: {name} entries must be >= {lo}, got {out}")
    return out


def _flags(fn: str, name: str, value: Any, ndim: int) -> Tuple[bool, ...]:
    """A bool (every axis) or one bool per axis."""
    vals = (value,) * ndim if isinstance(value, (bool, np.bool_)) else value
    if not isinstance(vals, (tuple, list)) or not all(isinstance(x, (bool, np.bool_)) for x in vals):
        raise TypeError(f"{fn}: {name} must be a bool or a tuple of {ndim} bools, got {value!r}")
    if len(vals) != ndim:
        raise ValueError(f"{fn}: {name} must have one entry per grid axis ({ndim}), got {len(vals)}")
    return tuple(bool(x) for x in vals)


def _order(fn: str, order: Any, cells: int) -> np.ndarray:
    """Token -> row-major canvas cell (``-1``: the token is not on the canvas), int64 ``[L]``."""
    if hasattr(order, "detach") and hasattr(order, "cpu"):
        order = order.detach().cpu().numpy()
    a = np.asarray(order)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{fn}: order must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{fn}: order must be a non-empty 1-d array [L], got shape {a.shape}")
    if a.min() < -1 or a.max() >= cells:
        raise ValueError(
            f"{fn}: order entries must be canvas cells in [0, {cells}) or -1, "
            f"got values in [{a.min()}, {a.max()}]"
        )
    return a.astype(np.int64)


# -- features ---------------------------------------------------------------------------------


def _axis_bands(
    x: np.ndarray, n: int, k: int, d: int, s: int, causal: bool
) -> List[Tuple[np.ndarray, np.ndarray, int, int]]:
    """NATTEN's window along one axis as ``(q_feature, kv_feature, lo, hi)`` bands over the
    tokens' coordinates ``x`` (in ``[0, n)``); the dilation group ``x % d`` is matched apart.

    Inside a dilation group (every ``d``-th position, ``lg`` of them) a query at group position
    ``xd`` has a stride-group leader; a non-causal window is the ``k`` positions from
    ``clamp(leader - k // 2, 0, lg - k)``, a causal one the positions ``p <= xd`` with
    ``leader - p < k``."""
    xd = x // d
    lg = n // d + (x % d < n % d)  # positions in this token's dilation group
    if causal:
        if s == 1:  # the leader is the query itself: one band
            return [(xd, xd, 0, k - 1)]
        leader = np.minimum((xd // s) * s + s - 1, lg - 1)
        return [(xd, xd, 0, n), (leader, xd, -n, k - 1)]
    leader = np.minimum((xd // s) * s + s // 2, lg - 1)
    start = np.clip(leader - k // 2, 0, lg - k)
    return [(start, xd, -(k - 1), 0)]


def _join(terms: List[Mask]) -> Mask:
    m = terms[0]
    for t in terms[1:]:
        m = m & t
    return m


def neighborhood(
    grid: IntOrTuple,
    kernel: IntOrTuple,
    dilation: IntOrTuple = 1,
    *,
    stride: IntOrTuple = 1,
    causal: Union[bool, Sequence[bool]] = False,
    order: Any = None,
) -> Mask:
    """Neighborhood attention (NATTEN) over a canvas of shape ``grid`` = ``(L,)``, ``(H, W)``
    or ``(T, H, W)``, self-attention, tokens flattened row-major (``i = (t·H + r)·W + c``).

    Query ``i`` may attend key ``j`` when, along every axis with canvas size ``n``, kernel ``k``,
    dilation ``d``, stride ``s`` (each an int for every axis or one per axis), and the two
    tokens' coordinates ``x`` and ``y`` on that axis:

    - both are in the same dilation group, ``x % d == y % d``; inside the group (its
      ``lg = ceil((n - x % d) / d)`` positions) the query is at ``p = x // d``, the key at
      ``u = y // d``;
    - non-causal axis: with the stride-group leader ``c = min(p // s·s + s // 2, lg - 1)``
      (``c = p`` when ``s = 1``), ``u`` lies in the ``k`` positions starting at
      ``clamp(c - k // 2, 0, lg - k)``: the window is centred on the leader (``k // 2`` before,
      ``k - 1 - k // 2`` after) and shifted inwards at the borders, so every query sees exactly
      ``k`` positions per axis;
    - causal axis: ``u <= p`` and ``min(p // s·s + s - 1, lg - 1) - u < k`` (with ``s = 1``:
      the ``k`` positions ending at the query, fewer near the start).

    This is NATTEN's definition (Hassani et al., "Neighborhood Attention Transformer", CVPR 2023;
    dilation: "Dilated Neighborhood Attention Transformer", 2022; stride and per-axis causal:
    "Generalized Neighborhood Attention", 2025; the reference is NATTEN's own FlexAttention mask
    in ``natten/backends/flex.py``). With odd kernels, ``d = s = 1`` and a non-causal canvas it
    equals attention-gym's ``generate_natten`` (whose rectangle case mixes up the axes).
    NATTEN's constraints apply: ``k·d <= n`` and ``s <= k`` per axis.

    ``order`` (optional, int ``[L]``): token ``t`` sits at row-major canvas cell ``order[t]``
    (``-1``: not on the canvas, e.g. a text or register token; it attends and is attended by
    nothing here, so ``|`` another mask for it). Use it for tile-by-tile storage
    (:func:`tile_order`: attention-gym's ``generate_tiled_natten``), a Morton curve, or extra
    tokens around the canvas. Without it ``L = prod(grid)`` and token ``t`` is cell ``t``.

    Leaves: one ``band`` per axis (two on a causal axis with stride > 1), plus one ``band``
    matching the dilation groups (difference 0) when some ``d > 1`` or some token is off the
    canvas.
    """
    fn = "neighborhood"
    g = _grid(fn, grid)
    nd = len(g)
    ks = _per_axis(fn, "kernel", kernel, nd, 1)
    ds = _per_axis(fn, "dilation", dilation, nd, 1)
    ss = _per_axis(fn, "stride", stride, nd, 1)
    cs = _flags(fn, "causal", causal, nd)
    for a in range(nd):
        if ks[a] * ds[a] > g[a]:
            raise ValueError(
                f"{fn}: kernel·dilation must fit the canvas on axis {a}: "
                f"{ks[a]}·{ds[a]} > {g[a]}"
            )
        if ss[a] > ks[a]:
            raise ValueError(f"{fn}: stride must be <= kernel on axis {a}, got {ss[a]} > {ks[a]}")
    cells = math.prod(g)
    if order is None:
        cell = np.arange(cells, dtype=np.int64)
    else:
        cell = _order(fn, order, cells)
    on = cell >= 0
    coords = np.unravel_index(np.where(on, cell, 0), g)
    terms: List[Mask] = []
    group = np.zeros(cell.shape, dtype=np.int64)
    for a in range(nd):
        x = coords[a].astype(np.int64)
        for f, h, lo, hi in _axis_bands(x, g[a], ks[a], ds[a], ss[a], cs[a]):
            terms.append(band(f, h, lo, hi))
        group = group * ds[a] + x % ds[a]
    if max(ds) > 1 or not on.all():
        # Same dilation group, both on the canvas: off-canvas queries carry -1 and keys -2,
        # which no difference of 0 pairs with anything.
        terms.append(band(np.where(on, group, -1), np.where(on, group, -2), 0, 0))
    return _join(terms)


def tile_order(grid: IntOrTuple, tile: IntOrTuple) -> np.ndarray:
    """The row-major canvas cell held by each token of a canvas stored tile by tile: tiles in
    row-major order over the tile grid, tokens in row-major order inside a tile (the layout of
    Sliding Tile Attention and of attention-gym's ``generate_tiled_natten``). ``grid`` must be a
    multiple of ``tile`` on every axis. Returns int64 ``[prod(grid)]``, a permutation: permute a
    row-major tensor with ``x[..., tile_order(grid, tile), :]`` to store it tile by tile."""
    fn = "tile_order"
    g = _grid(fn, grid)
    ts = _per_axis(fn, "tile", tile, len(g), 1)
    return _tile_cells(fn, g, ts)


def _tile_cells(fn: str, g: Tuple[int, ...], ts: Tuple[int, ...]) -> np.ndarray:
    for a in range(len(g)):
        if g[a] % ts[a]:
            raise ValueError(f"{fn}: grid must be a multiple of tile on axis {a}: {g[a]} % {ts[a]} != 0")
    nt = tuple(n // t for n, t in zip(g, ts))
    tok = np.arange(math.prod(g), dtype=np.int64)
    tile_c = np.unravel_index(tok // math.prod(ts), nt)
    in_c = np.unravel_index(tok % math.prod(ts), ts)
    return np.ravel_multi_index(tuple(tc * t + ic for tc, t, ic in zip(tile_c, ts, in_c)), g)


def tiled_neighborhood(
    grid: IntOrTuple,
    tile: IntOrTuple,
    kernel: IntOrTuple,
    *,
    text_len: int = 0,
    seq_len: Optional[int] = None,
) -> Mask:
    """Sliding Tile Attention (STA: Zhang et al., "Fast Video Generation with Sliding Tile
    Attention", 2025) over a canvas ``grid`` = ``(H, W)`` or ``(T, H, W)`` (1-D allowed) stored
    tile by tile (:func:`tile_order`: tiles of shape ``tile`` in row-major order, tokens
    row-major inside a tile), ``V = prod(grid)`` canvas tokens first.

    Windows are made of whole tiles: per axis, with ``n = grid / tile`` tiles and
    ``k = kernel / tile`` tiles in the window (``kernel`` in tokens, a multiple of ``tile``, at
    most ``grid``), a query in tile ``p`` attends the keys whose tile ``q`` lies in the ``k``
    tiles starting at ``clamp(p - k // 2, 0, n - k)`` (centred, shifted inwards at the borders;
    the same window for every token of a tile). This is attention-gym's
    ``generate_sta_mask_mod_2d`` / ``_3d`` (FastVideo's ``flex_sta_ref.py`` agrees for odd
    ``k``; for even ``k`` it takes ``k + 1`` tiles).

    Text tokens, as in those references: tokens ``V .. V + text_len - 1`` follow the canvas and
    ``seq_len`` (default ``V + text_len``) counts them and any padding after them. Canvas
    queries also attend every text key; every query at or past ``V`` attends every key before
    ``V + text_len``; keys at or past ``V + text_len`` are attended by nobody.

    Leaves: one ``band`` per axis; with ``seq_len > V``, ``(bands | band) & prefix``.
    """
    fn = "tiled_neighborhood"
    g = _grid(fn, grid)
    nd = len(g)
    ts = _per_axis(fn, "tile", tile, nd, 1)
    ks = _per_axis(fn, "kernel", kernel, nd, 1)
    v = math.prod(g)
    text = _int_arg(fn, "text_len", text_len, 0, _MAX_TOKENS)
    total = v + text if seq_len is None else _int_arg(fn, "seq_len", seq_len, 1, _MAX_TOKENS)
    if total < v + text:
        raise ValueError(f"{fn}: seq_len must be >= prod(grid) + text_len = {v + text}, got {total}")
    for a in range(nd):
        if ks[a] % ts[a] or ks[a] > g[a]:
            raise ValueError(
                f"{fn}: kernel must be a multiple of tile and at most grid on axis {a}, "
                f"got kernel {ks[a]}, tile {ts[a]}, grid {g[a]}"
            )
    _tile_cells(fn, g, ts)  # checks grid % tile
    nt = tuple(n // t for n, t in zip(g, ts))
    tok = np.arange(total, dtype=np.int64)
    # Tile coordinates of canvas tokens; tokens past the canvas get tile 0: their pairs are
    # decided by the text terms below (the rows they head attend everything before V + text,
    # the keys past V are attended by every row or, past V + text, by none).
    tc = np.unravel_index(np.where(tok < v, tok, 0) // math.prod(ts), nt)
    terms: List[Mask] = []
    for a in range(nd):
        x = tc[a].astype(np.int64)
        for f, h, lo, hi in _axis_bands(x, nt[a], ks[a] // ts[a], 1, 1, False):
            terms.append(band(f, h, lo, hi))
    m = _join(terms)
    if total > v:
        m = (m | global_tokens(tok >= v, (tok >= v) & (tok < v + text))) & prefix(v + text)
    return m


def dilated_window(
    left: int, right: int, dilation: int, q_len: int, kv_len: Optional[int] = None
) -> Mask:
    """A dilated sliding window: query ``i`` may attend key ``j`` when
    ``i - left <= j <= i + right`` and ``(i - j) % dilation == 0`` (every ``dilation``-th key;
    attention-gym's ``generate_dilated_sliding_window(w, d)`` is ``left = right = w``; Longformer's
    dilated window of ``w`` steps is ``left = right = w·d``). ``q_len`` (and ``kv_len``, default
    ``q_len``) are the lengths it will be planned for: the residue classes are segment ids.
    For NATTEN's 1-D dilated windows (clamped at the borders) use ``neighborhood((L,), k, d)``.

    Leaves: ``window(left, right)``, plus ``band(i % dilation, j % dilation, 0, 0)`` when
    ``dilation > 1``."""
    fn = "dilated_window"
    d = _int_arg(fn, "dilation", dilation, 1, _MAX_TOKENS)
    lq = _int_arg(fn, "q_len", q_len, 1, _MAX_TOKENS)
    lk = lq if kv_len is None else _int_arg(fn, "kv_len", kv_len, 1, _MAX_TOKENS)
    w = window(_int_arg(fn, "left", left, -(2**62)), _int_arg(fn, "right", right, -(2**62)))
    if d == 1:
        return w
    return w & band(np.arange(lq) % d, np.arange(lk) % d, 0, 0)


def global_tokens(is_global_q: Any, is_global_kv: Any = None) -> Mask:
    """Global tokens (Longformer, BigBird, ETC): query ``i`` may attend key ``j`` when
    ``is_global_q[i]`` (a flagged row attends every key) or ``is_global_kv[j]`` (a flagged
    column is attended by every query). Flags are bool (or 0/1) arrays ``[L]`` or ``[B, L]``;
    ``is_global_kv`` defaults to ``is_global_q`` (self-attention). Combine with a local mask
    by ``|``: ``tessera.window(256, 256) | tessera.global_tokens(flags)``.

    Leaves: one ``band`` (``band(g_q, -g_kv, 1, 2)`` over the 0/1 flags)."""
    gq = _bool_array("global_tokens: is_global_q", is_global_q)
    gk = gq if is_global_kv is None else _bool_array("global_tokens: is_global_kv", is_global_kv)
    for name, a in (("is_global_q", gq), ("is_global_kv", gk)):
        if a.ndim not in (1, 2) or a.shape[-1] == 0:
            raise ValueError(f"global_tokens: {name} must have shape [L] or [B, L], got {a.shape}")
    return band(gq.astype(np.int64), -gk.astype(np.int64), 1, 2)
