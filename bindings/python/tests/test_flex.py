"""`plan.to_flex_block_mask()` against torch's own `create_block_mask` (docs/semantics.md#many-ranks): every block
table equal, an exact `mask_mod`, and FlexAttention outputs with the Tessera BlockMask equal to
those with torch's BlockMask and to `tessera.torch.attention`."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import (  # noqa: E402
    TABLES,
    brute_states,
    causal,
    chunk,
    dense,
    document,
    full,
    heads,
    packed_ids,
    prefix,
    random_mask,
    ref_attention,
    rel,
    window,
)


def _cases():
    g = np.random.default_rng(21)
    ids = np.sort(g.integers(-1, 7, 300))  # leading padding run, then documents
    ids_rows = packed_ids(g, 2, 300, 90, pad_inside=True)
    ids_q, ids_kv = packed_ids(g, 2, 190, 60), packed_ids(g, 2, 260, 80)
    P = pytest.param
    return [
        P(full(), 1, 1, 200, 200, (64, 64), id="full_ragged"),
        P(causal(), 1, 1, 256, 256, (64, 64), id="causal"),
        P(causal(), 1, 1, 250, 250, (32, 64), id="causal_rect_32x64"),
        P(causal(), 1, 1, 250, 250, (64, 32), id="causal_rect_64x32"),
        P(causal(-37), 1, 1, 199, 199, (64, 64), id="causal_negative_offset"),
        P(causal(60), 1, 1, 130, 300, (32, 64), id="causal_offset_cross"),
        P(window(45, 7), 1, 1, 250, 250, (32, 32), id="window"),
        P(chunk(50), 1, 1, 230, 230, (32, 32), id="chunk_unaligned"),
        P(prefix(70), 1, 1, 150, 220, (32, 64), id="prefix_cross"),
        P(document(ids), 1, 1, 300, 300, (32, 64), id="document_padding"),
        P(causal() & document(ids), 1, 1, 300, 300, (32, 64), id="doc_causal_padding"),
        P(causal() & document(ids_rows), 2, 2, 300, 300, (64, 32), id="doc_per_row"),
        P(document(ids_q, ids_kv), 2, 1, 190, 260, (32, 32), id="doc_cross_lengths"),
        P(window(45, 7) | prefix(20), 1, 2, 250, 250, (32, 32), id="window_or_prefix"),
        P(~chunk(50) & causal(-3), 1, 1, 199, 199, (64, 64), id="not_chunk_and_causal"),
        P(chunk(64) & causal(), 1, 1, 256, 256, (32, 32), id="chunked_causal"),
        P(~window(30), 1, 1, 160, 160, (16, 32), id="not_window"),
        P(heads([causal(), window(30)]), 1, 2, 160, 160, (32, 32), id="heads"),
        P(heads([causal(), window(30), full(), prefix(3)]) & document(ids_rows[:, :160]), 2, 4, 160, 160,
          (32, 16), id="heads_and_doc_rows"),
        P(dense(g.random((2, 200, 260)) < 0.3), 1, 2, 200, 260, (64, 128), id="dense_heads_cross"),
        P(dense(g.random((2, 1, 90, 90)) < 0.05) | causal(), 2, 1, 90, 90, (16, 16), id="dense_batch"),
        P(~full(), 1, 1, 100, 100, (32, 32), id="nothing_allowed"),
        P(causal(), 1, 1, 1, 333, (16, 128), id="single_query"),
    ]


def _ref_block_mask(allowed_t, plan):
    gb, gh = plan.groups
    _, _, lq, lkv = plan.shape

    def mask_mod(b, h, q, kv):
        return allowed_t[b, h, q, kv]

    return flex.create_block_mask(mask_mod, gb, gh, lq, lkv, device="cpu", BLOCK_SIZE=plan.block)


def _check_tables(bm, ref, plan):
    for t in TABLES:
        a, r = getattr(bm, t), getattr(ref, t)
        assert a.dtype == r.dtype == torch.int32, t
        assert a.shape == r.shape and torch.equal(a, r), t
        assert a.is_contiguous() and a.device.type == "cpu", t
    for t in ("dq_write_order", "dq_write_order_full", "dq_kv_order"):  # torch >= 2.12 has them
        assert (getattr(bm, t, None) is None) == (getattr(ref, t, None) is None), t
    assert tuple(bm.seq_lengths) == tuple(ref.seq_lengths) == tuple(plan.shape[2:])
    assert tuple(bm.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE) == tuple(plan.block)
    assert tuple(bm.shape) == tuple(ref.shape)
    assert bm.sparsity() == pytest.approx(ref.sparsity())


@pytest.mark.parametrize("m, b, h, lq, lkv, block", _cases())
def test_block_mask_equals_create_block_mask_and_flex_outputs(m, b, h, lq, lkv, block):
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block)
    allowed = m.dense(b, h, lq, lkv)
    allowed_t = torch.from_numpy(allowed)
    bm = plan.to_flex_block_mask()
    ref = _ref_block_mask(allowed_t, plan)
    _check_tables(bm, ref, plan)
    # the blocks FlexAttention visits are the plan's non-empty tiles (FlexAttention calls a
    # ragged edge tile partial where the plan calls it full: only its in-range pairs count)
    gb, gh = plan.groups
    st = torch.from_numpy(brute_states(allowed[:gb, :gh], *block).astype(np.int64))
    assert torch.equal(bm.to_dense().bool(), st > 0)
    assert torch.equal((bm.kv_num_blocks + bm.full_kv_num_blocks).long(), (st > 0).sum(-1))
    assert ((bm.full_kv_num_blocks.long() <= (st == 2).sum(-1))).all()
    # the mask_mod is exact for every pair, not only inside partial blocks
    got = flex.create_mask(bm.mask_mod, b, h, lq, lkv, device="cpu")
    assert got.dtype == torch.bool and torch.equal(got, allowed_t)
    # flex_attention (eager, float32) with our BlockMask = with torch's = tessera = reference
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, 16, generator=g)
    k, v = torch.randn(b, h, lkv, 16, generator=g), torch.randn(b, h, lkv, 16, generator=g)
    aux = flex.AuxRequest(lse=True)
    with torch.no_grad():
        o_t, aux_t = flex.flex_attention(q, k, v, block_mask=bm, return_aux=aux)
        o_r, aux_r = flex.flex_attention(q, k, v, block_mask=ref, return_aux=aux)
        o_x, lse_x = tt.attention(q, k, v, plan, return_lse=True)
    ro, rlse = ref_attention(q, k, v, allowed)
    assert torch.equal(o_t, o_r) and torch.equal(aux_t.lse, aux_r.lse)
    assert not torch.isnan(o_t).any()
    assert rel(o_t, ro) <= 1e-5 and rel(o_x, ro) <= 1e-5
    assert rel(o_x, o_t) <= 1e-5
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(aux_t.lse), fin) and torch.equal(torch.isfinite(lse_x), fin)
    if fin.any():
        assert (aux_t.lse[fin].double() - rlse[fin]).abs().max() <= 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_random_masks_block_masks_equal_create_block_mask(seed):
    r = np.random.default_rng(900 + seed)
    for _ in range(3):
        lq = int(r.integers(1, 200))
        lkv = lq if r.random() < 0.5 else int(r.integers(1, 200))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 3))
        block = tuple(int(x) for x in r.choice([16, 32, 64, 128], 2))
        m = random_mask(r, lq, lkv, b, h, depth=3)
        plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block, cache=False)
        allowed_t = torch.from_numpy(m.dense(b, h, lq, lkv))
        bm = plan.to_flex_block_mask()
        _check_tables(bm, _ref_block_mask(allowed_t, plan), plan)
        assert torch.equal(flex.create_mask(bm.mask_mod, b, h, lq, lkv, device="cpu"), allowed_t), str(m.t)


def test_many_partial_blocks_and_kv_rebuilt_q_tables():
    # a random dense mask makes every tile partial with distinct contents: the captured
    # bitmask table is large and padded; the mask_mod must still index it exactly
    g = np.random.default_rng(4)
    m = dense(g.random((3, 300, 280)) < 0.5)
    plan = tessera.plan(m.t, q_len=300, kv_len=280, heads=3, block=(16, 32))
    assert plan.stats["unique_partial_masks"] == plan.stats["partial_tiles"]
    bm = plan.to_flex_block_mask()
    allowed_t = torch.from_numpy(m.dense(1, 3, 300, 280))
    assert torch.equal(flex.create_mask(bm.mask_mod, 1, 3, 300, 280, device="cpu"), allowed_t)
    # BlockMask.from_kv_blocks on the kv tables rebuilds the same q tables
    again = flex.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                          bm.full_kv_indices, BLOCK_SIZE=plan.block, mask_mod=bm.mask_mod,
                                          seq_lengths=(300, 280))
    for t in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(again, t), getattr(bm, t)), t


def test_a_uniform_plan_broadcasts_over_batch_and_heads_in_flex():
    plan = tessera.plan(tessera.window(40) | tessera.prefix(8), q_len=200, block=64)
    assert plan.groups == (1, 1)
    bm = plan.to_flex_block_mask()
    assert bm.kv_num_blocks.shape[:2] == (1, 1)
    q, k, v = (torch.randn(2, 4, 200, 16) for _ in range(3))
    with torch.no_grad():
        o = flex.flex_attention(q, k, v, block_mask=bm)
    ro, _ = ref_attention(q, k, v, (window(40) | prefix(8)).dense(1, 1, 200, 200))
    assert rel(o, ro) <= 1e-5


def test_block_mask_on_the_meta_device_and_bad_arguments():
    plan = tessera.plan(tessera.causal(), q_len=100, block=32)
    bm = plan.to_flex_block_mask(device="meta")
    assert bm.kv_num_blocks.device.type == "meta" and bm.kv_indices.device.type == "meta"
    with pytest.raises(TypeError, match="plan"):
        tt.to_flex_block_mask("causal")


def test_compiled_flex_attention_with_the_block_mask():
    ids = np.repeat(np.arange(5), 60)
    ids[:7] = -1
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=300, heads=2, block=64)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    with torch.no_grad():
        o = torch.compile(flex.flex_attention)(q, k, v, block_mask=plan.to_flex_block_mask())
    ro, _ = ref_attention(q, k, v, m.dense(1, 1, 300, 300))
    assert rel(o, ro) <= 1e-5 and not torch.isnan(o).any()
