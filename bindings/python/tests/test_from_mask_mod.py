"""`tessera.from_mask_mod` (docs/python.md#from-a-flexattention-mask_mod): the plan of a FlexAttention
`mask_mod` is exact pair for pair, so its BlockMask tables equal `create_block_mask`'s and
attention through it equals SDPA with the dense boolean mask; the hint names an analytic
expression only when it is verified equal; bad arguments raise errors naming them."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import TABLES, brute_states, packed_ids  # noqa: E402
from tessera.core import mask_mod as mm  # noqa: E402


def _dense(mask_mod, b, h, lq, lkv):
    """The mask_mod on every pair, ``bool [b, h, lq, lkv]``, by torch's own evaluator."""
    return flex.create_mask(mask_mod, b, h, lq, lkv, device="cpu")


def _plan(mask_mod, lq, lkv, h, b, block):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tessera.MaskModHint)
        return tessera.from_mask_mod(mask_mod, lq, lkv, heads=h, batch=b, block=block)


def _check(mask_mod, lq, lkv, h=None, b=None, block=128):
    """Plan tables equal create_block_mask's (same B, H), tile states equal the brute-force ones
    of the dense mask, and the BlockMask's mask_mod is exact."""
    plan = _plan(mask_mod, lq, lkv, h, b, block)
    bb, hh = b or 1, h or 1
    assert plan.shape == (bb, hh, lq, lkv)
    allowed = _dense(mask_mod, bb, hh, lq, lkv)
    gb, gh = plan.groups
    assert gb in (1, bb) and gh in (1, hh)
    ref = flex.create_block_mask(mask_mod, b, h, lq, lkv, device="cpu", BLOCK_SIZE=block)
    bm = plan.to_flex_block_mask()
    for t in TABLES:
        want = getattr(ref, t)
        got = getattr(bm, t).expand(want.shape[:2] + getattr(bm, t).shape[2:])
        assert torch.equal(got, want), t
    blk = (block, block) if isinstance(block, int) else block
    st = brute_states(allowed.numpy(), *blk)
    assert np.array_equal(np.broadcast_to(plan.states(), st.shape), st)
    got = flex.create_mask(bm.mask_mod, bb, hh, lq, lkv, device="cpu")
    assert torch.equal(got, allowed)
    return plan, allowed


def causal(b, h, q, kv):
    return q >= kv


def test_shapes_lengths_and_blocks_match_create_block_mask():
    window = lambda b, h, q, kv: (q - kv <= 100) & (q - kv >= -7)  # noqa: E731
    for lq, lkv, block in [(256, 256, 128), (300, 300, 128), (200, 520, 128), (517, 130, 64),
                           (1, 333, (16, 128)), (129, 1, 32), (250, 250, (32, 64))]:
        _check(causal, lq, lkv, block=block)
        _check(window, lq, lkv, block=block)


def test_masks_depending_on_batch_and_heads_and_closures_over_tensors():
    g = np.random.default_rng(3)
    ids = torch.from_numpy(packed_ids(g, 3, 300, 90, pad_inside=True))
    table = torch.from_numpy(g.random((2, 3, 300, 300)) < 0.3)

    def docs(b, h, q, kv):
        return (ids[b, q] == ids[b, kv]) & (ids[b, q] >= 0) & (q >= kv)

    def per_head(b, h, q, kv):
        return (q - kv <= 16 * (h + 1)) & (q >= kv) | table[b, h, q, kv]

    def head_only(b, h, q, kv):
        return torch.where(h == 0, q >= kv, (q // 50) == (kv // 50))

    plan, _ = _check(docs, 300, 300, b=3, block=64)
    assert plan.groups == (3, 1)
    plan, _ = _check(per_head, 300, 300, h=3, b=2, block=(64, 32))
    assert plan.groups == (2, 3)
    plan, _ = _check(head_only, 300, 300, h=2, block=64)
    assert plan.groups == (1, 2)
    # a mask that ignores h and b: one group however many heads and rows were asked for
    plan, _ = _check(causal, 300, 300, h=4, b=2, block=64)
    assert plan.groups == (1, 1)


@pytest.mark.parametrize("seed", range(6))
def test_random_dense_tables_and_random_closures(seed):
    g = np.random.default_rng(100 + seed)
    lq, lkv = int(g.integers(1, 400)), int(g.integers(1, 400))
    b, h = [None, 1, 2][int(g.integers(0, 3))], [None, 1, 3][int(g.integers(0, 3))]
    table = torch.from_numpy(g.random((b or 1, h or 1, lq, lkv)) < g.uniform(0.01, 0.99))
    feat_q = torch.from_numpy(g.integers(0, 9, lq))
    feat_k = torch.from_numpy(g.integers(0, 9, lkv))
    lo = int(g.integers(-3, 3))
    kind = seed % 3

    def mask_mod(b_, h_, q, kv):
        if kind == 0:
            return table[b_, h_, q, kv]
        if kind == 1:
            return ((feat_q[q] - feat_k[kv]) >= lo) & table[b_, h_, q, kv] | (q == kv)
        return ~table[b_, h_, q, kv] & (kv < lkv // 2)

    block = [16, 32, 64, 128, (32, 64)][int(g.integers(0, 5))]
    _check(mask_mod, lq, lkv, h=h, b=b, block=block)


def test_python_control_flow_falls_back_to_vmap_like_create_block_mask():
    ids = torch.tensor([0] * 70 + [1] * 90 + [2] * 40)

    def doc(b, h, q, kv):  # tensor indexing by 0-d tensors: vmap-only in spirit, broadcasts too
        return ids[q] == ids[kv]

    def scalar_only(b, h, q, kv):
        # .item()-free but refuses broadcasting: torch.stack over a python list of q's rows
        assert q.dim() == 0, "called per pair"
        return q >= kv

    _check(doc, 200, 200, block=32)
    _check(scalar_only, 100, 90, block=32)


def test_attention_with_the_plan_equals_sdpa_with_the_dense_mask():
    ids = torch.from_numpy(np.repeat(np.arange(5), 40)[:190])

    def mask_mod(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv) | ((h == 1) & (kv < 8))

    lq = 190
    plan = _plan(mask_mod, lq, lq, 2, None, 64)
    allowed = _dense(mask_mod, 1, 2, lq, lq)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, lq, 32, generator=g) for _ in range(3))
    out = tt.attention(q, k, v, plan)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert (out - ref).abs().max().item() <= 1e-5


def test_hints_name_verified_equivalents_only():
    def expect(mask_mod, lq, lkv, want):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            plan = tessera.from_mask_mod(mask_mod, lq, lkv, block=64)
        hints = [x.message for x in w if isinstance(x.message, tessera.MaskModHint)]
        if want is None:
            assert hints == [], [str(h) for h in hints]
            return
        assert len(hints) == 1, [str(x.message) for x in w]
        assert hints[0].expression.startswith(want), hints[0].expression
        # the named expression plans to the same tiles
        p = tessera.plan(hints[0].mask, q_len=lq, kv_len=lkv, block=64)
        same = {k: v for k, v in p.stats.items() if k != "build_ms"}
        assert np.array_equal(p.states(), plan.states())
        assert same == {k: v for k, v in plan.stats.items() if k != "build_ms"}

    L = 1000
    ids = torch.from_numpy(np.repeat(np.arange(8), 125))
    expect(causal, L, L, "tessera.causal()")
    expect(lambda b, h, q, kv: q + 5 >= kv, L, 700, "tessera.causal(5)")
    expect(lambda b, h, q, kv: (q >= kv) & (q - kv <= 255), L, L, "tessera.window(255)")
    expect(lambda b, h, q, kv: (q - kv <= 30) & (kv - q <= 9), L, L, "tessera.window(30, 9)")
    expect(lambda b, h, q, kv: (kv < 100) | (q >= kv), L, L, "tessera.causal() | tessera.prefix(100)")
    expect(lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv), L, L, "tessera.causal() & tessera.document(ids)")
    expect(lambda b, h, q, kv: ids[q] == ids[kv], L, L, "tessera.document(ids)")
    expect(lambda b, h, q, kv: q >= -1, 300, 200, "tessera.full()")
    # near misses: one pair off, a gap inside a row, a mask varying with the head
    expect(lambda b, h, q, kv: (q >= kv) & ~((q == 500) & (kv == 3)), L, L, None)
    expect(lambda b, h, q, kv: (q >= kv) & (kv != 17), L, L, None)
    expect(lambda b, h, q, kv: (q - kv <= 255) & (q >= kv) | ((q == 999) & (kv == 0)), L, L, None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tessera.from_mask_mod(lambda b, h, q, kv: (q >= kv) & (h == 0), 256, heads=2)
        tessera.from_mask_mod(causal, 256, hint=False)
    assert not any(isinstance(x.message, tessera.MaskModHint) for x in w)


def test_row_intervals_are_exact_on_word_boundaries():
    g = np.random.default_rng(7)
    for lkv in (1, 63, 64, 65, 128, 200):
        lo = g.integers(0, lkv, 50)
        hi = np.minimum(lo + g.integers(-2, lkv, 50), lkv - 1)
        j = np.arange(lkv)
        rows = (j[None] >= lo[:, None]) & (j[None] <= hi[:, None])
        words = np.zeros((50, -(-lkv // 64) * 8), np.uint8)
        words[:, : -(-lkv // 8)] = np.packbits(rows, axis=-1, bitorder="little")
        first, last = mm._row_intervals(words.view(np.uint64))
        empty = lo > hi
        assert np.array_equal(first[~empty], lo[~empty]) and np.array_equal(last[~empty], hi[~empty])
        assert (first[empty] > last[empty]).all()
        rows[0, :] = False
        rows[0, [0, lkv - 1]] = True
        words[:, : -(-lkv // 8)] = np.packbits(rows, axis=-1, bitorder="little")
        assert (mm._row_intervals(words.view(np.uint64)) is None) == (lkv > 2)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="mask_mod"):
        tessera.from_mask_mod("causal", 128)
    with pytest.raises(TypeError, match="mask_mod.*bool"):
        tessera.from_mask_mod(lambda b, h, q, kv: q - kv, 128)
    with pytest.raises(TypeError, match="mask_mod.*Tensor"):
        tessera.from_mask_mod(lambda b, h, q, kv: True, 128)
    with pytest.raises(ValueError, match="mask_mod.*shape"):
        tessera.from_mask_mod(lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool), 128)
    for kw, name in [(dict(q_len=0), "q_len"), (dict(q_len=8, kv_len=-1), "kv_len"),
                     (dict(q_len=8, heads=0), "heads"), (dict(q_len=8, batch=0), "batch")]:
        with pytest.raises(ValueError, match=name):
            tessera.from_mask_mod(causal, **kw)
    with pytest.raises(TypeError, match="q_len"):
        tessera.from_mask_mod(causal, 8.0)
    with pytest.raises(TypeError, match="heads"):
        tessera.from_mask_mod(causal, 8, heads=True)
    with pytest.raises((TypeError, ValueError), match="block"):
        tessera.from_mask_mod(causal, 8, block=0)


def test_a_one_dimensional_result_is_refused_not_broadcast():
    # [R] would broadcast along the keys whatever it was computed from
    with pytest.raises(ValueError, match="mask_mod.*0-d or 2-d"):
        tessera.from_mask_mod(lambda b, h, q, kv: (q >= 0).reshape(-1), 64)
    # a constant and a [1, L] row broadcast
    _check(lambda b, h, q, kv: torch.tensor(True), 70, 90, block=32)
    _check(lambda b, h, q, kv: kv < 33, 70, 90, block=32)


def test_chunks_on_python_threads_restore_torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # 3000 x 700: three chunks, the last two on the pool
        _check(lambda b, h, q, kv: (q // 7 + kv) % 5 != 0, 3000, 700, block=64)
        assert torch.get_num_threads() == 2

        def bad(b, h, q, kv):  # a later chunk returns integers: its error reaches the caller
            return (q >= kv) if q[0, 0] < 2000 else q - kv

        with pytest.raises(TypeError, match="mask_mod.*bool"):
            tessera.from_mask_mod(bad, 3000, 700)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
