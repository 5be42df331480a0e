"""The mask cookbook (docs/mask-cookbook.md): masks published for FlexAttention, written in
Tessera with at most three leaves or one `tessera.layouts` helper and no dense array, plan to a
BlockMask whose eight tables equal `create_block_mask(mask_mod)`'s on CPU, and the plan's token
mask (its BlockMask's exact mask_mod) equals the reference mask_mod evaluated densely.

The recipes (Tessera expression + reference mask_mod) are `bench/mask_cookbook.py`'s, the ones
the bench times and the docs draw; the mask_mods there are written from the published
definitions, independently of `tessera.layouts`. Shapes are drawn fresh per test (seeded by the
test's name): lengths that are not multiples of the tile, small canvases, kernels as wide as the
canvas, dilation, stride, causal axes, tiles from 16 to 128 and rectangular.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import mask_cookbook as cb  # noqa: E402  (bench/, on the path from conftest)
import tessera  # noqa: E402
from conftest import TABLES, packed_ids  # noqa: E402
from tessera.core import flex_tables  # noqa: E402

BLOCKS = [(16, 16), (32, 32), (64, 64), (128, 128), (32, 64), (64, 16)]
LEAF = re.compile(r"\b(full|causal|window|chunk|prefix|document|dense|band)\b")


def leaves(mask):
    """The leaf names of a mask, from its canonical text."""
    return LEAF.findall(str(mask))


def check(r, block):
    """Tables equal create_block_mask's, token masks equal, the recipe small and dense-free."""
    names = leaves(r.mask)
    assert "dense" not in names, str(r.mask)
    assert r.helper or len(names) <= 3, (r.family, names)
    plan = tessera.plan(
        r.mask, q_len=r.q_len, kv_len=r.kv_len, heads=r.heads, batch=r.batch, block=block, cache=False
    )
    assert plan.groups == (r.batch, r.heads)
    bm = plan.to_flex_block_mask()
    ref = flex.create_block_mask(
        r.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu", BLOCK_SIZE=block
    )
    for t in TABLES:
        a, b = getattr(bm, t), getattr(ref, t)
        assert a.shape == b.shape and torch.equal(a, b), (r.family, t, block)
    want = flex.create_mask(r.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu")
    got = flex.create_mask(bm.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu")
    assert want.any(), r.family  # a case that allows nothing proves little
    assert torch.equal(got, want), (r.family, block)
    # no dense leaf: the default mask_mod is the one generated from the expression; the bit-table
    # one agrees too
    assert flex_tables.compact(plan).kind == "analytic", r.family
    bits = plan.to_flex_block_mask(mask_mod="bits")
    got = flex.create_mask(bits.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu")
    assert torch.equal(got, want), (r.family, block, "bits")
    return plan


def pick(rng, seq):
    return seq[int(rng.integers(0, len(seq)))]


# -- families written with the leaves of docs/semantics.md#masks ----------------------------------------------


def test_causal_sliding_window_prefix_lm(rng):
    for _ in range(3):
        n = int(rng.integers(100, 900))
        check(cb.causal_lm(n), pick(rng, BLOCKS))
        check(cb.sliding_window(n, int(rng.integers(1, n))), pick(rng, BLOCKS))
        check(cb.prefix_lm(n, int(rng.integers(1, n))), pick(rng, BLOCKS))


def test_document_causal(rng):
    for rows in (1, 2):
        n = int(rng.integers(150, 700))
        ids = packed_ids(rng, rows, n, int(rng.integers(20, 200)), pad_inside=True)
        check(cb.document_causal(ids[0] if rows == 1 else ids), pick(rng, BLOCKS))


def test_shared_prefix(rng):
    for _ in range(3):
        groups = int(rng.integers(1, 4))
        prompts = [int(x) for x in rng.integers(1, 120, groups)]
        answers = [[int(x) for x in rng.integers(1, 90, int(rng.integers(1, 4)))] for _ in range(groups)]
        check(cb.shared_prefix(prompts, answers), pick(rng, BLOCKS))


# -- families that need band features -----------------------------------------------------------


def test_block_diffusion(rng):
    for _ in range(3):
        block = int(pick(rng, [1, 4, 16, 24, 64]))
        n = block * int(rng.integers(1, max(2, 400 // block)))
        check(cb.block_diffusion(n, block), pick(rng, BLOCKS))


def test_dilated_sliding_window(rng):
    for _ in range(3):
        n = int(rng.integers(60, 700))
        check(cb.dilated_sliding_window(n, int(rng.integers(0, n)), int(rng.integers(1, 9))), pick(rng, BLOCKS))


def test_global_tokens_with_window(rng):
    for rows in (1, 1, 2):
        n = int(rng.integers(80, 700))
        flags = rng.random((rows, n)) < rng.uniform(0.005, 0.05)
        flags[:, 0] = True
        check(cb.global_window(flags[0] if rows == 1 else flags, int(rng.integers(0, 64))), pick(rng, BLOCKS))


def _natten_case(rng, nd, force):
    """A random NATTEN configuration; ``force`` makes one axis dilated, causal or strided."""
    grid = tuple(int(rng.integers(2, {1: 600, 2: 30, 3: 10}[nd])) for _ in range(nd))
    dil = [int(rng.integers(1, 4)) if rng.random() < 0.3 else 1 for _ in grid]
    causal = [bool(rng.random() < 0.2) for _ in grid]
    a = int(rng.integers(0, nd))
    if force == "dilation":
        dil[a] = int(rng.integers(2, 4))
    elif force == "causal":
        causal[a] = True
    dil = tuple(min(d, n) for d, n in zip(dil, grid))
    # kernels up to the whole (dilated) axis: windows pinned at both borders
    kernel = tuple(int(rng.integers(1, n // d + 1)) for n, d in zip(grid, dil))
    stride = [int(rng.integers(1, k + 1)) if rng.random() < 0.25 else 1 for k in kernel]
    if force == "stride" and kernel[a] > 1:
        stride[a] = int(rng.integers(2, kernel[a] + 1))
    return grid, kernel, dil, tuple(stride), tuple(causal)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_natten(rng, nd):
    for force in ("dilation", "causal", "stride", None):
        grid, kernel, dil, stride, causal = _natten_case(rng, nd, force)
        check(cb.natten(grid, kernel, dil, stride, causal), pick(rng, BLOCKS))


def test_natten_attention_gym_layouts(rng):
    # attention-gym's own square cases (odd kernels), tiled and Morton-ordered canvases
    for side in (int(rng.integers(5, 30)), 24):
        check(cb.natten((side, side), int(pick(rng, [1, 3, 5, 7]))), pick(rng, BLOCKS))
    for (h, w, th, tw) in [(16, 24, 4, 8), (18, 12, 3, 4)]:
        k = (int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1)))
        check(cb.natten((h, w), k, layout="tiled", tile=(th, tw)), pick(rng, BLOCKS))
    for side in (8, 16, 32):
        check(cb.natten((side, side), int(rng.integers(1, side + 1)), layout="morton"), pick(rng, BLOCKS))


def test_sliding_tile_attention(rng):
    for grid, tile in [((12, 20), (4, 4)), ((6, 8, 8), (2, 4, 4)), ((4, 9, 6), (2, 3, 3))]:
        kernel = tuple(t * int(rng.integers(1, g // t + 1)) for g, t in zip(grid, tile))
        check(cb.sta(grid, tile, kernel), pick(rng, BLOCKS))
        check(cb.sta(grid, tile, kernel, text=int(rng.integers(1, 80)), pad=int(rng.integers(0, 40))), pick(rng, BLOCKS))


def test_sasa_2d_window(rng):
    for _ in range(2):
        h, w = int(rng.integers(3, 40)), int(rng.integers(3, 40))
        check(cb.sasa(h, w, int(rng.integers(0, 6))), pick(rng, BLOCKS))


def test_video_heads(rng):
    for _ in range(2):
        prompt, frames, per = int(rng.integers(1, 50)), int(rng.integers(2, 9)), int(rng.integers(16, 90))
        check(cb.svg_spatial(prompt, frames, per, sink=bool(rng.random() < 0.5), round_width=8), pick(rng, BLOCKS))
        check(cb.svg_temporal(prompt, frames, per, width=int(rng.integers(1, 4))), pick(rng, BLOCKS))
    check(cb.video_heads(int(rng.integers(1, 50)), 6, int(rng.integers(30, 60))), pick(rng, BLOCKS))


def test_tree_causal(rng):
    for _ in range(3):
        n = int(rng.integers(40, 700))
        prefix = int(rng.integers(0, n // 4))
        r = cb.tree_causal(n, prefix, seed=int(rng.integers(0, 1 << 30)))
        check(r, pick(rng, BLOCKS))
        # The two bands are the ancestor relation: walk every token's parent links.
        parent, pre, end = cb.tree_features(n, prefix, seed=int(rng.integers(0, 1 << 30)))
        want = np.zeros((n, n), dtype=bool)
        for i in range(n):
            a = i
            while a >= 0:
                want[i, a] = True
                a = parent[a]
        got = (pre[None, :] <= pre[:, None]) & (pre[:, None] < end[None, :])
        assert np.array_equal(got, want)


def test_temporal_short_frames(rng):
    for per in (7, 20, 50, 100):
        n = int(rng.integers(300, 900))
        check(cb.temporal_short_frames(n, per, prompt=int(rng.integers(0, 64))), pick(rng, BLOCKS))


def test_image_cross_attention(rng):
    for _ in range(3):
        lq, images, per = int(rng.integers(20, 500)), int(rng.integers(1, 9)), int(rng.integers(1, 70))
        check(cb.image_cross_attention(lq, cb._intervals(rng, lq, images), per), pick(rng, BLOCKS))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cb.SIZES))
def test_bench_sizes_at_4k(name):
    # the bench's own recipes at 4K tokens, tile 128
    check(cb.SIZES[name](4096), (128, 128))


# -- the helpers: leaves and argument checks ----------------------------------------------------


def test_helpers_are_a_few_leaves():
    assert leaves(tessera.neighborhood((9, 7), 3)) == ["band", "band"]
    assert leaves(tessera.neighborhood((9, 7, 5), (3, 3, 1), dilation=(1, 2, 1))) == ["band"] * 4
    assert leaves(tessera.neighborhood((9, 7), 3, order=np.r_[0:63, -1, -1])) == ["band"] * 3
    assert leaves(tessera.neighborhood((40,), 5, stride=2, causal=True)) == ["band", "band"]
    assert leaves(tessera.global_tokens(np.arange(9) % 4 == 0)) == ["band"]
    assert sorted(leaves(tessera.dilated_window(8, 8, 3, 100))) == ["band", "window"]
    assert leaves(tessera.dilated_window(8, 8, 1, 100)) == ["window"]
    assert leaves(tessera.tiled_neighborhood((8, 8), (4, 4), (8, 4))) == ["band", "band"]


def test_tile_order_is_a_permutation_matching_the_tiles(rng):
    grid = (6, 8, 4)
    order = tessera.tile_order(grid, (3, 4, 2))
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(192))
    # the first tile's tokens are the cells of the box [0,3) x [0,4) x [0,2), row-major
    t, r, c = np.unravel_index(order[:24], grid)
    assert (t < 3).all() and (r < 4).all() and (c < 2).all()
    assert np.array_equal(order[:24], np.sort(order[:24]))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: tessera.neighborhood((8, 8), 9), ValueError, "kernel·dilation"),
        (lambda: tessera.neighborhood((8, 8), 3, dilation=3), ValueError, "kernel·dilation"),
        (lambda: tessera.neighborhood((8, 8), (3, 3, 3)), ValueError, "kernel"),
        (lambda: tessera.neighborhood((8, 8), 3.0), TypeError, "kernel"),
        (lambda: tessera.neighborhood((8, 8), 0), ValueError, "kernel"),
        (lambda: tessera.neighborhood((8, 8), 3, stride=4), ValueError, "stride"),
        (lambda: tessera.neighborhood((8, 8), 3, causal=(True,)), ValueError, "causal"),
        (lambda: tessera.neighborhood((8, 8), 3, causal=1), TypeError, "causal"),
        (lambda: tessera.neighborhood((), 3), ValueError, "grid"),
        (lambda: tessera.neighborhood((2, 2, 2, 2), 1), ValueError, "grid"),
        (lambda: tessera.neighborhood((8, 0), 1), ValueError, "grid"),
        (lambda: tessera.neighborhood("8x8", 1), TypeError, "grid"),
        (lambda: tessera.neighborhood((8, 8), 3, order=np.arange(65)), ValueError, "order"),
        (lambda: tessera.neighborhood((8, 8), 3, order=np.arange(64) - 2), ValueError, "order"),
        (lambda: tessera.neighborhood((8, 8), 3, order=np.ones(64)), TypeError, "order"),
        (lambda: tessera.tiled_neighborhood((8, 8), (3, 4), (6, 8)), ValueError, "tile"),
        (lambda: tessera.tiled_neighborhood((8, 8), (4, 4), (6, 8)), ValueError, "kernel"),
        (lambda: tessera.tiled_neighborhood((8, 8), (4, 4), (8, 8), text_len=-1), ValueError, "text_len"),
        (lambda: tessera.tiled_neighborhood((8, 8), (4, 4), (8, 8), text_len=4, seq_len=66), ValueError, "seq_len"),
        (lambda: tessera.tile_order((8, 9), (4, 4)), ValueError, "tile"),
        (lambda: tessera.dilated_window(4, 4, 0, 100), ValueError, "dilation"),
        (lambda: tessera.dilated_window(4, 4, 2, 0), ValueError, "q_len"),
        (lambda: tessera.dilated_window(4.5, 4, 2, 10), TypeError, "left"),
        (lambda: tessera.global_tokens(np.zeros((2, 2, 2), bool)), ValueError, "is_global_q"),
        (lambda: tessera.global_tokens(np.arange(5) * 1.0), TypeError, "is_global_q"),
        (lambda: tessera.global_tokens(np.ones(5, bool), np.full(5, 2)), ValueError, "is_global_kv"),
    ],
)
def test_helpers_refuse_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
