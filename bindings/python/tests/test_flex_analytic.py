"""The plan's BlockMask on any device: the analytic ``mask_mod``
generated from the mask tree agrees with the plan's bit table and with the token mask on every
element of every tile (partial tiles included, evaluated by broadcasting index tensors and through
``create_mask``'s vmap), for the conformance-style cases, random masks over every leaf and the
cookbook recipes; and the tables expanded on the device from the compact arrays equal the host
export's and ``create_block_mask``'s (also on the ``meta`` device: no host read)."""

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import mask_cookbook as cb  # noqa: E402
import tessera  # noqa: E402
from conftest import (  # noqa: E402
    TABLES,
    band,
    brute_states,
    causal,
    chunk,
    dense,
    document,
    packed_ids,
    prefix,
    random_mask,
    window,
)
from tessera.core import flex_mask, flex_tables  # noqa: E402
from test_flex import _cases  # noqa: E402
from test_torch_attention import _cases as attention_cases  # noqa: E402


def grid_eval(mask_mod, b, h, lq, lkv):
    """``mask_mod`` on every ``(b, h, q, kv)`` at once (int32 index tensors, as FlexAttention)."""
    i32 = torch.int32
    out = mask_mod(
        torch.arange(b, dtype=i32).view(b, 1, 1, 1),
        torch.arange(h, dtype=i32).view(1, h, 1, 1),
        torch.arange(lq, dtype=i32).view(1, 1, lq, 1),
        torch.arange(lkv, dtype=i32).view(1, 1, 1, lkv),
    )
    return out.expand(b, h, lq, lkv)


def partial_elements(allowed, block):
    """bool ``[B, H, Lq, Lkv]``: the elements of the tiles FlexAttention calls partial."""
    tq, tk = block
    b, h, lq, lkv = allowed.shape
    st = brute_states(allowed, tq, tk)
    # ragged edge tiles count as partial (FlexAttention pads with False)
    nq, nk = st.shape[-2:]
    part = st == 1
    if lq % tq:
        part[..., -1, :] |= st[..., -1, :] == 2
    if lkv % tk:
        part[..., :, -1] |= st[..., :, -1] == 2
    return np.repeat(np.repeat(part, tq, axis=-2), tk, axis=-1)[..., :lq, :lkv]


def check_plan_mask_mods(m, b, h, lq, lkv, block, expect_analytic=None):
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block, cache=False)
    allowed = np.broadcast_to(m.dense(b, h, lq, lkv), (b, h, lq, lkv))
    want = torch.from_numpy(np.array(allowed))
    prog, _ = flex_mask.program(plan.mask, lq, lkv)
    analytic = not isinstance(prog, str)
    if expect_analytic is not None:
        assert analytic == expect_analytic, (str(m.t), prog)
    kinds = ["bits", "auto"] + (["analytic"] if analytic else [])
    part = torch.from_numpy(partial_elements(allowed, block))
    for kind in kinds:
        bm = plan.to_flex_block_mask(mask_mod=kind)
        got = grid_eval(bm.mask_mod, b, h, lq, lkv)
        assert got.dtype == torch.bool
        assert torch.equal(got[part], want[part]), (kind, str(m.t))  # every partial-tile element
        assert torch.equal(got, want), (kind, str(m.t))  # and every other one
        assert torch.equal(flex.create_mask(bm.mask_mod, b, h, lq, lkv, device="cpu"), want), kind
    if not analytic:
        with pytest.raises(ValueError, match="mask_mod='analytic'"):
            plan.to_flex_block_mask(mask_mod="analytic")
    return plan, analytic


@pytest.mark.parametrize("m, b, h, lq, lkv, block", _cases())
def test_analytic_mask_mod_equals_the_bit_table_on_the_conformance_cases(m, b, h, lq, lkv, block):
    has_dense = "dense" in str(m.t)
    check_plan_mask_mods(m, b, h, lq, lkv, block, expect_analytic=not has_dense)


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", attention_cases())
def test_analytic_mask_mod_on_the_attention_conformance_cases(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    block = (block, block) if isinstance(block, int) else block
    check_plan_mask_mods(m, b, hq, lq, lkv, block, expect_analytic="dense" not in str(m.t))


@pytest.mark.parametrize("seed", range(6))
def test_analytic_mask_mod_on_random_masks_over_every_leaf(seed):
    r = np.random.default_rng(3800 + seed)
    n_analytic = 0
    for _ in range(8):
        lq = int(r.integers(1, 180))
        lkv = lq if r.random() < 0.5 else int(r.integers(1, 180))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 4))
        block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
        m = random_mask(r, lq, lkv, b, h, depth=3)
        _, analytic = check_plan_mask_mods(m, b, h, lq, lkv, block)
        n_analytic += analytic
    assert n_analytic >= 2  # the analytic path ran on most of them (dense leaves excepted)


def test_document_forms_bounds_when_keys_are_contiguous_else_ids():
    g = np.random.default_rng(5)
    ids = packed_ids(g, 2, 300, 70, pad_inside=True)  # padding runs between documents
    plan = tessera.plan((causal() & document(ids)).t, q_len=300, block=32, cache=False)
    c = flex_tables.compact(plan)
    assert c.kind == "analytic" and "docb" in repr(c.prog) and c.reason is None
    # an id in two runs (interleaved documents): the id comparison
    split = ids.copy()
    split[0] = np.arange(300) // 7 % 3 - (np.arange(300) % 50 == 0)  # ids 0..2 interleaved, some -1
    for m, form in ((document(split), "docid"), (document(ids[:, :190], ids[:, :260]), "docb")):
        lq, lkv = (300, 300) if form == "docid" else (190, 260)
        p = tessera.plan(m.t, q_len=lq, kv_len=lkv, block=32, cache=False)
        assert form in repr(flex_tables.compact(p).prog)
        check_plan_mask_mods(m, 2, 1, lq, lkv, (32, 32), expect_analytic=True)
    # cross attention where the q ids are scattered but the kv ids contiguous: bounds still exact
    q_ids = g.permutation(np.repeat(np.arange(-1, 5), 30))[None]
    kv_ids = np.repeat(np.arange(6), 40)[None]
    check_plan_mask_mods(document(q_ids, kv_ids), 1, 1, 180, 240, (32, 64), expect_analytic=True)


def test_extreme_parameters_fold_and_extreme_band_features_fall_back():
    big = 2**62 - 1
    for m in (causal(big), causal(-big), window(big, -big), window(-big, big), chunk(10**12),
              prefix(10**12), ~causal(big) | prefix(0)):
        check_plan_mask_mods(m, 1, 1, 70, 90, (16, 32), expect_analytic=True)
    f = np.arange(100, dtype=np.int64)
    check_plan_mask_mods(band(f, f, -3, 40), 1, 1, 100, 100, (32, 32), expect_analytic=True)
    ext = f.copy()
    ext[7] = np.iinfo(np.int64).max
    _, _ = check_plan_mask_mods(band(ext, f, -3, 40), 1, 1, 100, 100, (32, 32), expect_analytic=False)
    plan = tessera.plan(band(ext, f, -3, 40).t, q_len=100, block=32, cache=False)
    assert "2^62" in flex_tables.compact(plan).reason


def test_tree_accessor_shapes_and_depth_limit():
    ids = np.arange(12).reshape(2, 6) // 3
    t = (tessera.causal(3) & tessera.document(ids) | ~tessera.window(2, 1)).__and__(
        tessera.heads([tessera.full(), tessera.prefix(4)]))._tree()
    assert t[0] == "and" and t[1][1][0] == "heads"
    inner = t[1][0]
    assert inner[0] == "or" and inner[1][0][0] == "and"
    doc = inner[1][0][1][1]
    assert doc[0] == "document" and doc[1].shape == (2, 6) and doc[1].dtype == np.int64
    deep = tessera.causal()
    for _ in range(2000):
        deep = ~deep
    with pytest.raises(ValueError, match="depth"):
        deep._tree()


def _captured_bits(bm):
    """Whether ``bm``'s mask_mod captured a bit table (a 3-D int64 tensor)."""
    cells = [c.cell_contents for c in bm.mask_mod.__closure__ or ()]
    return any(isinstance(t, torch.Tensor) and t.dim() == 3 for t in cells)


def test_host_auto_builds_the_analytic_mask_mod_for_a_large_bit_table(monkeypatch):
    """On the CPU, "auto" for a plan whose bitmasks are built keeps the bit table while it is
    small and builds the analytic mask_mod once the partial blocks pass ``HOST_BITS_LIMIT`` (no
    block copied then); a mask without an analytic form keeps the bits at any size. Both exact on
    every element."""
    g = np.random.default_rng(41)
    f = g.permutation(300).astype(np.int64)
    lq = 300
    scattered = band(f, f, -40, 25)  # every tile partial
    no_form = scattered & dense(g.random((lq, lq)) < 0.9)  # a dense leaf: no analytic form
    for m, analytic in ((scattered, True), (no_form, False)):
        want = torch.from_numpy(np.array(np.broadcast_to(m.dense(1, 1, lq, lq), (1, 1, lq, lq))))
        plan = tessera.plan(m.t, q_len=lq, block=32, cache=False)
        assert plan.stats["unique_partial_masks"] > 0  # reading them builds the bitmasks
        assert _captured_bits(plan.to_flex_block_mask())  # small: the bits
        monkeypatch.setattr(flex_tables, "HOST_BITS_LIMIT", 0)
        plan = tessera.plan(m.t, q_len=lq, block=32, cache=False)
        plan.stats
        bm = plan.to_flex_block_mask()
        assert _captured_bits(bm) != analytic, str(m.t)
        assert torch.equal(grid_eval(bm.mask_mod, 1, 1, lq, lq), want), str(m.t)
        monkeypatch.undo()


def test_a_plan_of_tile_states_builds_its_bitmasks_on_first_need():
    """``cache=False`` keeps a small table of partial masks (the bit-table mask_mod then), but
    plans only tile states once the masks pass ``KEEP_MASK_BYTES`` (128 KiB): the BlockMask
    with the analytic mask_mod needs no bitmasks (none are built), a mask without an analytic
    form builds them for the bit table, and so do the CPU kernels and ``stats``; every result
    equals the whole plan's."""
    g = np.random.default_rng(43)
    small = tessera.plan(causal(-3).t & window(40, 0).t, q_len=333, block=32, cache=False)
    assert small._p.has_masks and _captured_bits(small.to_flex_block_mask())
    lq, block = 1500, 64  # 576 tiles of 512 B masks, most partial and distinct: > 128 KiB
    pre = g.permutation(lq).astype(np.int64)
    scattered = band(pre, pre, -300, 170) | causal(-1200)
    no_form = scattered & dense(g.random((lq, lq)) < 0.8)
    for m, analytic in ((scattered, True), (no_form, False)):
        want = torch.from_numpy(np.array(np.broadcast_to(m.dense(1, 1, lq, lq), (1, 1, lq, lq))))
        whole = tessera.plan(m.t, q_len=lq, block=block, cache=False)
        assert whole.stats["unique_partial_masks"] * block * 8 > 128 << 10
        plan = tessera.plan(m.t, q_len=lq, block=block, cache=False)
        assert not plan._p.has_masks
        np.testing.assert_array_equal(plan.states(), whole.states())
        assert plan.flops(64) == whole.flops(64)
        bm = plan.to_flex_block_mask()
        assert _captured_bits(bm) != analytic
        assert plan._p.has_masks != analytic  # the bit table needed them; the analytic form not
        assert torch.equal(grid_eval(bm.mask_mod, 1, 1, lq, lq), want), str(m.t)
        ref = whole.to_flex_block_mask(mask_mod="bits")
        for t in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(bm, t), getattr(ref, t)), t
        q, k, v = (torch.randn(1, 1, lq, 16) for _ in range(3))
        out = tessera.torch.attention(q, k, v, plan)  # the CPU kernel builds the bitmasks
        assert plan._p.has_masks
        assert plan.stats == {**whole.stats, "build_ms": plan.stats["build_ms"]}
        torch.testing.assert_close(out, tessera.torch.attention(q, k, v, whole))


@pytest.mark.parametrize("recipe", ["causal_lm", "sliding_window", "prefix_lm", "document_causal",
                                    "shared_prefix", "block_diffusion", "dilated_sliding_window",
                                    "global_window"])
def test_cookbook_masks_analytic(recipe, rng):
    n = int(rng.integers(120, 400))
    args = {
        "causal_lm": (n,), "sliding_window": (n, int(rng.integers(1, n))), "prefix_lm": (n, 37),
        "document_causal": (packed_ids(rng, 2, n, 60, pad_inside=True),),
        "shared_prefix": ([30, 50], [[20, 11], [40]]), "block_diffusion": (16 * (n // 16), 16),
        "dilated_sliding_window": (n, int(rng.integers(0, n)), 3),
        "global_window": (rng.random(n) < 0.03, 20),
    }[recipe]
    r = getattr(cb, recipe)(*args)
    block = (32, 64)
    plan = tessera.plan(r.mask, q_len=r.q_len, kv_len=r.kv_len, heads=r.heads, batch=r.batch, block=block,
                        cache=False)
    assert flex_tables.compact(plan).kind == "analytic", recipe
    want = flex.create_mask(r.mask_mod, r.batch, r.heads, r.q_len, r.kv_len, device="cpu")
    for kind in ("analytic", "bits"):
        bm = plan.to_flex_block_mask(mask_mod=kind)
        got = grid_eval(bm.mask_mod, r.batch, r.heads, r.q_len, r.kv_len)
        assert torch.equal(got, want), (recipe, kind)


# -- item 2: tables expanded on the device -------------------------------------------------------


def host_tables(plan):
    return [torch.from_numpy(a) for a in flex_tables._host_tables(plan, False)[0]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dense", [False, True])
def test_device_built_tables_equal_the_host_export_and_create_block_mask(seed, dense):
    """Both device uploads (the non-empty tiles expanded by tensor ops, or the host's tables
    copied as they are) give create_block_mask's tables and an exact mask_mod, analytic and bits."""
    r = np.random.default_rng(3900 + seed)
    for _ in range(6):
        lq = int(r.integers(1, 260))
        lkv = lq if r.random() < 0.5 else int(r.integers(1, 260))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 3))
        block = tuple(int(x) for x in r.choice([16, 32, 64, 128], 2))
        m = random_mask(r, lq, lkv, b, h, depth=3)
        plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block, cache=False)
        gb, gh = plan.groups
        allowed_t = torch.from_numpy(np.array(np.broadcast_to(m.dense(b, h, lq, lkv), (b, h, lq, lkv))))
        ref = flex.create_block_mask(lambda bb, hh, q, kv: allowed_t[bb, hh, q, kv], gb, gh, lq, lkv,
                                     device="cpu", BLOCK_SIZE=block)
        states = plan.states()
        for mask_mod in ("auto", "bits"):
            c = flex_tables.compact(plan, mask_mod, dense=dense)
            assert c.dense == dense
            if not dense:  # O(active tiles): one cell and one code per non-empty tile
                assert c.parts[0][2] == c.parts[1][2] == (int((states != 0).sum()),)
            bm = flex_tables.block_mask_from_compact(c, "cpu")
            for name, host in zip(TABLES, host_tables(plan)):
                t = getattr(bm, name)
                assert t.dtype == torch.int32 and t.is_contiguous(), name
                assert torch.equal(t, host) and torch.equal(t, getattr(ref, name)), (name, str(m.t))
            got = flex.create_mask(bm.mask_mod, b, h, lq, lkv, device="cpu")
            assert torch.equal(got, allowed_t), (mask_mod, str(m.t))


def test_device_build_on_meta_reads_nothing_and_compact_pickles():
    g = np.random.default_rng(8)
    ids = packed_ids(g, 2, 1000, 200)
    plan = tessera.plan((causal() & document(ids)).t, q_len=1000, block=64, cache=False)
    c = flex_tables.compact(plan, dense=False)
    # meta tensors have no data: any host read (a sync on a GPU) would raise
    bm = flex_tables.block_mask_from_compact(c, "meta")
    for name, host in zip(TABLES, host_tables(plan)):
        t = getattr(bm, name)
        assert t.device.type == "meta" and t.shape == host.shape and t.dtype == torch.int32, name
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.dims == c.dims and torch.equal(c2.i32, c.i32) and c2.prog == c.prog
    assert c.pin_memory().i32.data_ptr() != 0
    # the int32 buffer holds the cells, the codes and the document bounds; no bits in analytic mode
    assert c.i64.numel() == 0
    nq = nk = -(-1000 // 64)
    assert c.i32.numel() < 2 * 2 * nq * nk + 2 * 2 * 1000 + 1
    with pytest.raises(ValueError, match="mask_mod"):
        flex_tables.compact(plan, "fast")


def test_device_upload_is_the_tables_up_to_the_grid_limit_then_the_tiles():
    """Grids of up to DEVICE_DENSE_CELLS blocks travel as the host's eight tables (no device
    work but the copy), larger ones as their non-empty tiles (O(active tiles))."""
    limit = flex_tables.DEVICE_DENSE_CELLS
    side = int(limit ** 0.5)  # a square grid of exactly the limit
    at = tessera.plan(tessera.causal(), q_len=side * 128, block=128, cache=False)
    past = tessera.plan(tessera.causal(), q_len=(side + 1) * 128, block=128, cache=False)
    c_at, c_past = flex_tables.compact(at), flex_tables.compact(past)
    assert c_at.dense and c_at.parts[1][2] == (1, 1, side, side)
    assert not c_past.dense and c_past.parts[0][2] == (int((past.states() != 0).sum()),)
