"""Plans from per-step block selections (docs/semantics.md#masks): ``tessera.plan_from_blocks`` equals
the token mask "selected tile and mask" by brute force (numpy model written here from the spec),
attention over such plans equals the float64 reference (forward and backward), the FlexAttention
``BlockMask`` equals torch's own for the same selection, a compiled step takes three selections
with one compilation, context-parallel sharding of such a plan runs, and bad selections raise
clear errors naming ``kv_tiles``. The Splash ``MaskInfo`` of such a plan equals Splash's own
preprocessing."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from conftest import brute_states, causal, document, full, packed_ids, ref_attention, rel, window

torch = pytest.importorskip("torch")


def selection(rng, b, h, tq, tk, k, causal_rows=False):
    """Random kv tiles ``[b, h, tq, k]``: duplicates, ``-1`` padding, some rows of ``-1`` only;
    with ``causal_rows`` each row also keeps its diagonal tile and only tiles up to it."""
    out = np.full((b, h, tq, k), -1, dtype=np.int64)
    for idx in np.ndindex(b, h, tq):
        r = idx[2]
        if rng.random() < 0.15 or k == 0:
            continue  # a row that selects nothing
        hi = min(r, tk - 1) + 1 if causal_rows else tk
        row = rng.integers(0, hi, k)
        row[rng.random(k) < 0.2] = -1
        if causal_rows:
            row[0] = min(r, tk - 1)
        if k > 1 and rng.random() < 0.5:
            row[-1] = row[0]  # a duplicate
        out[idx] = row
    return out


def selected(kv_tiles, b, h, lq, lkv, qb, kb):
    """Token mask of a selection: query i of (b, h) may attend key j iff j // kb is among
    ``kv_tiles[b, h, i // qb]`` (B or H of 1 broadcast)."""
    a = np.asarray(kv_tiles)
    while a.ndim < 4:
        a = a[None]
    out = np.zeros((b, h, lq, lkv), dtype=bool)
    for bi in range(b):
        for hi in range(h):
            s = a[bi if a.shape[0] > 1 else 0, hi if a.shape[1] > 1 else 0]
            for r in range(s.shape[0]):
                for t in s[r]:
                    if t >= 0:
                        out[bi, hi, r * qb : (r + 1) * qb, t * kb : (t + 1) * kb] = True
    return out


def plan_tokens(p):
    """The plan's token mask ``bool [B', H', Lq, Lkv]`` from its tile states and partial bitmasks."""
    a = p._p._flex_arrays()
    st, ids, blocks = a["mask_tile_states"], a["mask_block_ids"], a["mask_blocks"]
    tq, tk = a["block_size"]
    lq, lkv = a["seq_lengths"]
    gb, gh, nq, nk = st.shape
    out = np.zeros((gb, gh, nq * tq, nk * tk), dtype=bool)
    for b, h, i, j in np.argwhere(st == 2):
        out[b, h, i * tq : (i + 1) * tq, j * tk : (j + 1) * tk] = True
    for b, h, i, j in np.argwhere(st == 1):
        out[b, h, i * tq : (i + 1) * tq, j * tk : (j + 1) * tk] = blocks[ids[b, h, i, j]]
    return out[:, :, :lq, :lkv]


def check_plan(p, want):
    """``p``'s states and token mask equal the dense ``want [B, H, Lq, Lkv]``."""
    b, h, lq, lkv = want.shape
    assert p.shape == (b, h, lq, lkv)
    gb, gh = p.groups
    grp = want[:gb, :gh]
    assert (np.broadcast_to(grp, want.shape) == want).all()
    assert (p.states() == brute_states(grp, *p.block)).all()
    assert (plan_tokens(p) == grp).all()
    assert p.stats["allowed_pairs"] == int(want.sum())


def _mask_cases(rng, lq, lkv, b):
    ids = packed_ids(rng, b, max(lq, lkv), 50, pad_inside=True)
    doc = document(ids[:, :lq]) if lq == lkv else document(ids[:, :lq], ids[:, :lkv])
    return [("full", full()), ("causal", causal()), ("causal_document", causal() & doc),
            ("window", window(40, 3)), ("not_window_or_causal", ~window(30) | causal(-9))]


@pytest.mark.parametrize("seed", range(6))
def test_plan_from_blocks_equals_selected_tiles_and_mask_by_brute_force(seed):
    r = np.random.default_rng(500 + seed)
    for _ in range(5):
        lq = int(r.integers(1, 260))
        lkv = lq if r.random() < 0.6 else int(r.integers(1, 260))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 4))
        block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
        # the selection's blocks: the plan's tile, or others (smaller, larger, unaligned)
        sb = block if r.random() < 0.5 else tuple(int(x) for x in r.choice([8, 16, 24, 40, 64, 100], 2))
        tq, tk = -(-lq // sb[0]), -(-lkv // sb[1])
        sel = selection(r, b if r.random() < 0.6 else 1, h if r.random() < 0.6 else 1, tq, tk,
                        int(r.integers(0, tk + 3)))
        if sel.shape[0] == 1 and r.random() < 0.5:
            sel = sel[0] if sel.shape[1] > 1 else sel[0, 0]  # [H, Tq, k] / [Tq, k]
        for name, m in _mask_cases(r, lq, lkv, b):
            p = tessera.plan_from_blocks(m.t, sel, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block,
                                         selection_block=sb)
            assert p.source == "built" and p.block == block, name
            want = selected(sel, b, h, lq, lkv, *sb) & np.broadcast_to(m.dense(b, h, lq, lkv), (b, h, lq, lkv))
            check_plan(p, want)


def test_selection_dims_set_the_plan_groups_and_defaults():
    r = np.random.default_rng(3)
    sel = selection(r, 2, 3, 4, 4, 3)
    p = tessera.plan_from_blocks(tessera.causal(), sel, q_len=100, block=32)
    assert p.shape == (2, 3, 100, 100) and p.groups == (2, 3)
    p = tessera.plan_from_blocks(tessera.causal(), sel[:1, :1], q_len=100, heads=5, batch=7, block=32)
    assert p.shape == (7, 5, 100, 100) and p.groups == (1, 1)
    # numpy, torch (int32 and int64) and lists give the same plan; the mask prints its data
    a = tessera.plan_from_blocks(tessera.causal(), sel, q_len=100, block=32)
    for same in (torch.from_numpy(sel), torch.from_numpy(sel).int(), sel.tolist(), sel.astype(np.int16)):
        assert tessera.plan_from_blocks(tessera.causal(), same, q_len=100, block=32).contract == a.contract
    assert "blocks#" in a.mask.canonical()
    # order and repetition within a row do not matter; another selection is another contract
    shuffled = np.concatenate([sel[..., ::-1], sel[..., :1], np.full(sel.shape[:-1] + (1,), -1)], -1)
    assert tessera.plan_from_blocks(tessera.causal(), shuffled, q_len=100, block=32).contract == a.contract
    other = sel.copy()
    other[0, 0, 3] = [0, -1, -1] if set(sel[0, 0, 3]) != {0, -1} else [1, -1, -1]
    assert tessera.plan_from_blocks(tessera.causal(), other, q_len=100, block=32).contract != a.contract


def test_text_form_and_typed_leaf_agree():
    r = np.random.default_rng(4)
    sel = selection(r, 1, 2, 5, 5, 4)
    ids = np.repeat(np.arange(4), 40)
    typed = tessera.causal() & tessera.document(ids) & tessera.blocks(sel, 32)
    text = tessera.mask("causal & document & blocks(32, 32, sel)", segments=ids, blocks={"sel": sel})
    assert typed.canonical() == text.canonical() and typed == text
    assert tessera.mask(str(typed), **typed.data()) == typed  # the text form names sel by content
    p = tessera.plan(text, q_len=160, block=32)
    assert p.contract == tessera.plan_from_blocks(tessera.causal() & tessera.document(ids), sel,
                                                  q_len=160, block=32).contract
    with pytest.raises(ValueError, match=r"blocks\(32, 32, nope\)"):
        tessera.mask("blocks(32, 32, nope)", blocks={"sel": sel})
    with pytest.raises(ValueError, match="column 8"):
        tessera.mask("blocks(0, 32, sel)", blocks={"sel": sel})
    with pytest.raises(TypeError, match=r"blocks\['sel'\]"):
        tessera.mask("blocks(32, 32, sel)", blocks={"sel": sel.astype(float)})


@pytest.mark.parametrize(
    "kv_tiles, kwargs, exc, match",
    [
        (np.zeros((1, 1, 4, 2)), {}, TypeError, "kv_tiles: expected an integer array"),
        (np.zeros((1, 1, 4, 2), dtype=bool), {}, TypeError, "kv_tiles"),
        (np.zeros((4,), dtype=np.int64), {}, ValueError, r"kv_tiles: expected shape \[B, H, Tq, k\]"),
        (np.zeros((1, 1, 1, 4, 2), dtype=np.int64), {}, ValueError, "kv_tiles: expected shape"),
        (np.zeros((1, 1, 3, 2), dtype=np.int64), {}, ValueError, "kv_tiles: expected 4 query blocks"),
        (np.full((1, 1, 4, 2), 4), {}, ValueError, r"kv_tiles: expected entries in \[-1, 4\)"),
        (np.full((1, 1, 4, 2), -2), {}, ValueError, r"kv_tiles: expected key-block indices >= 0 \(or -1"),
        (np.zeros((1, 3, 4, 2), dtype=np.int64), {"heads": 2}, ValueError, "kv_tiles: expected 1 or 2 heads"),
        (np.zeros((3, 1, 4, 2), dtype=np.int64), {"batch": 2}, ValueError, "kv_tiles: expected 1 or 2 batch"),
        (np.full((1, 1, 4, 2), 2**40, dtype=np.uint64), {}, ValueError, "kv_tiles: expected kv tile indices"),
        (np.zeros((1, 1, 4, 2), dtype=np.int64), {"selection_block": 0}, ValueError, "block"),
    ],
)
def test_bad_selections_raise_naming_kv_tiles(kv_tiles, kwargs, exc, match):
    before = tessera.cache_stats()["plans_built"]
    with pytest.raises(exc, match=match):
        tessera.plan_from_blocks(tessera.causal(), kv_tiles, q_len=128, block=32, **kwargs)
    assert tessera.cache_stats()["plans_built"] == before  # nothing planned


def test_bad_other_arguments():
    sel = np.zeros((1, 1, 4, 2), dtype=np.int64)
    with pytest.raises(TypeError, match="mask"):
        tessera.plan_from_blocks("causal", sel, q_len=128, block=32)
    with pytest.raises(TypeError, match="q_len"):
        tessera.plan_from_blocks(tessera.causal(), sel, q_len=128.0, block=32)
    with pytest.raises(ValueError, match="block"):
        tessera.plan_from_blocks(tessera.causal(), sel, q_len=128, block=24)
    with pytest.raises(TypeError, match="selection_block"):
        tessera.plan_from_blocks(tessera.causal(), sel, q_len=128, block=32, selection_block="32")


def test_the_plan_cache_is_skipped_unless_asked():
    r = np.random.default_rng(8)
    sel = selection(r, 1, 2, 8, 8, 3, causal_rows=True)
    s0 = tessera.cache_stats()
    tessera.plan_from_blocks(tessera.causal(), sel, q_len=256, block=32)
    s1 = tessera.cache_stats()
    assert (s1["misses"], s1["memory_hits"], s1["bytes_written"]) == (s0["misses"], s0["memory_hits"],
                                                                      s0["bytes_written"])
    a = tessera.plan_from_blocks(tessera.causal(), sel, q_len=256, block=32, cache=True)
    b = tessera.plan_from_blocks(tessera.causal(), sel, q_len=256, block=32, cache=True)
    assert (a.source, b.source) == ("built", "memory")


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("same_blocks", [True, False])
def test_torch_attention_over_a_selection_plan_equals_the_float64_reference(sinks, same_blocks):
    import tessera.torch as tt

    r = np.random.default_rng(11 + sinks + 2 * same_blocks)
    B, H, HKV, L, D, blk = 2, 4, 2, 300, 32, 32
    sb = blk if same_blocks else 48
    t = -(-L // sb)
    ids = packed_ids(r, B, L, 90, pad_inside=True)
    m = causal() & document(ids)
    sel = selection(r, B, H, t, t, 4, causal_rows=True)
    plan = tessera.plan_from_blocks(m.t, sel, q_len=L, block=blk, selection_block=sb)
    allowed = selected(sel, B, H, L, L, sb, sb) & m.dense(B, H, L, L)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, HKV, L, D, generator=g, requires_grad=True) for _ in range(2))
    s = torch.randn(H, generator=g, requires_grad=True) if sinks else None
    o, lse = tt.attention(q, k, v, plan, sinks=s, return_lse=True)
    w = torch.randn(o.shape, generator=g, dtype=torch.float64)
    (o.double() * w).sum().backward()
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rs = s.detach().double().requires_grad_() if sinks else None
    ro, rlse = ref_attention(rq, rk, rv, allowed, sinks=rs)
    (ro * w).sum().backward()
    assert rel(o, ro) <= 1e-5
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin) and fin.any() and (~fin).any() != sinks
    assert (lse[fin].double() - rlse[fin]).abs().max() <= 1e-4
    for name, a, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (rq.grad, rk.grad, rv.grad)):
        assert rel(a, want) <= 1e-5, name
    if sinks:
        assert rel(s.grad, rs.grad) <= 1e-4


def test_flex_block_mask_equals_torch_for_the_same_selection():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    r = np.random.default_rng(12)
    B, H, L, blk = 2, 3, 250, 32
    t = -(-L // blk)
    ids = packed_ids(r, B, L, 70, pad_inside=True)
    m = causal() & document(ids)
    sel = selection(r, B, H, t, t, 5, causal_rows=True)
    plan = tessera.plan_from_blocks(m.t, sel, q_len=L, block=blk)
    bm = plan.to_flex_block_mask()
    table = torch.zeros(B, H, t, t, dtype=torch.bool)
    for b, h, i, k in np.ndindex(B, H, t, sel.shape[-1]):
        if sel[b, h, i, k] >= 0:
            table[b, h, i, sel[b, h, i, k]] = True
    dense_mask = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(m.dense(B, H, L, L), (B, H, L, L))))

    def mask_mod(b, h, q_idx, kv_idx):  # the selection looked up, and the mask
        return table[b, h, q_idx // blk, kv_idx // blk] & dense_mask[b, h, q_idx, kv_idx]

    ref = flex.create_block_mask(mask_mod, B, H, L, L, device="cpu", BLOCK_SIZE=blk)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    want = torch.from_numpy(selected(sel, B, H, L, L, blk, blk)) & dense_mask
    assert torch.equal(flex.create_mask(bm.mask_mod, B, H, L, L, device="cpu"), want)
    # with no other mask, the plan's blocks are exactly BlockMask.from_kv_blocks' on the indices
    plain = tessera.plan_from_blocks(tessera.full(), sel, q_len=L, block=blk)
    srt = torch.sort(torch.from_numpy(sel), dim=-1, descending=True).values
    num = (srt >= 0).sum(-1).int()
    fkb = flex.BlockMask.from_kv_blocks(num, srt.clamp(min=0).int(), BLOCK_SIZE=blk, seq_lengths=(L, L))
    pb = plain.to_flex_block_mask()

    def visited(num, idx, i):  # the kv blocks of row i of each (b, h)
        return [set(idx[b, h, i, : num[b, h, i]].tolist()) for b, h in np.ndindex(B, H)]

    for i in range(t):
        ours = [a | c for a, c in zip(visited(pb.kv_num_blocks, pb.kv_indices, i),
                                      visited(pb.full_kv_num_blocks, pb.full_kv_indices, i))]
        assert ours == visited(fkb.kv_num_blocks, fkb.kv_indices, i), i
    assert torch.equal(pb.q_num_blocks + pb.full_q_num_blocks, fkb.q_num_blocks)
    q, k, v = (torch.randn(B, H, L, 16) for _ in range(3))
    with torch.no_grad():
        o = flex.flex_attention(q, k, v, block_mask=bm)
    assert rel(o, ref_attention(q, k, v, want.numpy())[0]) <= 1e-5


def test_splash_mask_info_equals_process_mask_for_a_selection():
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info")
    import tessera.jax as tj
    from test_splash import _equal_infos, _process

    r = np.random.default_rng(15)
    B, H, L, blk = 2, 2, 200, 32
    t = -(-L // blk)
    m = causal() & document(packed_ids(r, B, L, 60, pad_inside=True))
    sel = selection(r, B, H, t, t, 3, causal_rows=True)
    plan = tessera.plan_from_blocks(m.t, sel, q_len=L, block=blk)
    allowed = selected(sel, B, H, L, L, blk, blk) & m.dense(B, H, L, L)
    for row in range(B):
        want_f, want_d = _process(allowed[row], (blk, blk), {}, L, L)
        got_f, got_d = tj.mask_info(plan, batch_row=row, as_numpy=True)
        _equal_infos(got_f, want_f, f"fwd row {row}")
        _equal_infos(got_d, want_d, f"dkv row {row}")


def test_a_compiled_step_takes_three_selections_with_one_compilation():
    import tessera.torch as tt
    from torch._dynamo.utils import counters

    def step(q, k, v, plan):
        o = tt.attention(q, k, v, plan)
        return o, o.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    r = np.random.default_rng(13)
    ids = np.repeat(np.arange(4), 32)
    for _ in range(3):
        sel = selection(r, 1, 2, 4, 4, 2, causal_rows=True)  # a new selection every step
        plan = tessera.plan_from_blocks(tessera.causal() & tessera.document(ids), sel, q_len=128, block=32)
        xs = [torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3)]
        oc, lc = compiled(*xs, plan)
        lc.backward()
        got = [x.grad.clone() for x in xs]
        for x in xs:
            x.grad = None
        oe, le = step(*xs, plan)
        le.backward()
        assert torch.equal(oc, oe)
        for a, x in zip(got, xs):
            assert torch.allclose(a, x.grad, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("mode", ["allgather", "needed"])
def test_context_parallel_local_plans_of_a_selection_plan_equal_whole_row_attention(mode):
    """Each rank's local plan, run in this process on the K/V its mode receives, gives its rows
    of single-process attention over the selection plan (ranks in processes: test_cp.py)."""
    import tessera.cp
    import tessera.torch as tt

    r = np.random.default_rng(14)
    L, R, B, H, D, blk = 256, 4, 2, 2, 8, 16
    ids = packed_ids(r, B, L, 60, pad_inside=True)
    sel = selection(r, B, H, L // blk, L // blk, 4, causal_rows=True)
    plan = tessera.plan_from_blocks(tessera.causal() & tessera.document(ids), sel, q_len=L, block=blk)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    ref, ref_lse = tt.attention(q, k, v, plan, return_lse=True)
    for scheme in tessera.cp.SCHEMES:
        sh = tessera.cp.shard(plan, R, scheme)
        assert sum(c["pairs"] for c in sh.costs) == plan.stats["allowed_pairs"]
        for rank in range(R):
            pos = torch.as_tensor(sh.positions(rank))
            kv_tiles = sh.local_kv_tiles(rank, mode)
            kv_pos = torch.as_tensor((kv_tiles[:, None] * blk + np.arange(blk)).reshape(-1))
            o, lse = tt.attention(q[:, :, pos], k[:, :, kv_pos], v[:, :, kv_pos], sh.local_plan(rank, mode),
                                  return_lse=True)
            assert rel(o, ref[:, :, pos]) <= 1e-5, (scheme, rank)
            fin = torch.isfinite(ref_lse[:, :, pos])
            assert torch.equal(fin, torch.isfinite(lse))
            assert (lse[fin] - ref_lse[:, :, pos][fin]).abs().max() <= 1e-4
