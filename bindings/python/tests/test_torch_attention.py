"""`tessera.torch.attention` against the float64 torch reference of docs/semantics.md#attention: outputs, LSE and
gradients (dq, dk, dv, dsinks, with a loss on LSE too) over masks, GQA/MQA, Dqk != Dv, ragged and
cross lengths, softcap, sinks, fully masked rows, strided layouts and bf16; the autograd machinery
(gradcheck, opcheck, torch.compile(fullgraph=True)); bad inputs; NaN propagation; determinism and
threads."""

import gc
import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from tessera.engines.native_torch import _handle  # noqa: E402
from conftest import (  # noqa: E402
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

F32_TOL = 1e-5  # docs/semantics.md#attention: ‖x − ref‖/‖ref‖ for O, dQ, dK, dV (f32 storage)
LSE_TOL = 1e-4  # docs/semantics.md#attention: LSE absolute error
BF16_TOL = 1e-2


def _make(shape, g, dtype, layout, scale=1.0):
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    if layout == "blhd":  # stored [B, L, H, D], viewed as [B, H, L, D]
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
        assert not x.is_contiguous()
    return x.requires_grad_()


def check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, *, softcap=None, sinks=False, scale=None,
               lse_loss=False, layout="contiguous", dtype=torch.float32, seed=0, q_scale=1.0):
    """Runs forward + backward through tessera and through the float64 reference and checks
    the docs/semantics.md#attention accuracy bar on every output and gradient."""
    g = torch.Generator().manual_seed(seed)
    q = _make((b, hq, lq, dqk), g, dtype, layout, q_scale)
    k = _make((b, hkv, lkv, dqk), g, dtype, layout)
    v = _make((b, hkv, lkv, dv), g, dtype, layout)
    s = (torch.randn(hq, generator=g, dtype=torch.float64) * 2).float().requires_grad_() if sinks else None
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)
    allowed = m.dense(b, hq, lq, lkv)

    o, lse = tt.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=s, return_lse=True)
    assert o.shape == (b, hq, lq, dv) and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (b, hq, lq) and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()

    w = torch.randn(o.shape, generator=g, dtype=torch.float64)
    wl = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss_of(o_, lse_):
        loss = (o_.double() * w).sum()
        if lse_loss:
            loss = loss + (torch.where(torch.isfinite(lse_), lse_, 0).double() * wl).sum()
        return loss

    loss_of(o, lse).backward()
    leaves = [q, k, v] + ([s] if sinks else [])
    got = [x.grad for x in leaves]
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rs = s.detach().double().requires_grad_() if sinks else None
    ro, rlse = ref_attention(rq, rk, rv, allowed, scale=scale, softcap=softcap, sinks=rs)
    loss_of(ro, rlse).backward()
    want = [rq.grad, rk.grad, rv.grad] + ([rs.grad] if sinks else [])

    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel(o, ro) <= tol, ("o", rel(o, ro))
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[~fin] == -math.inf).all()
    if fin.any():
        err = (lse[fin].double() - rlse[fin]).abs().max().item()
        assert err <= (LSE_TOL if dtype == torch.float32 else 5e-2), ("lse", err)
    # rows with no allowed key: O exactly 0
    empty = torch.from_numpy(~np.broadcast_to(allowed, (b, hq, lq, lkv)).any(-1))
    assert (o[empty] == 0).all()
    if sinks:
        lse_empty = lse[empty]
        sink_b = s.detach().expand(b, lq, hq).permute(0, 2, 1)[empty]
        assert torch.allclose(lse_empty, sink_b)  # LSE of an empty row with a sink is the sink
    for name, a, r in zip(["dq", "dk", "dv", "dsinks"], got, want):
        assert a is not None and a.shape == r.shape, name
        assert a.dtype == (dtype if name != "dsinks" else torch.float32), name
        assert not torch.isnan(a).any(), name
        # bf16: dsinks sums O·dO over every row with cancelling signs, from the bf16-rounded O the
        # forward stored, so its relative error is a few times the storage precision
        t = 5e-2 if (name == "dsinks" and dtype != torch.float32) else tol
        assert rel(a, r) <= t, (name, rel(a, r))
    return plan, (q, k, v, s), (o, lse)


def _cases():
    g = np.random.default_rng(42)
    ids = packed_ids(g, 2, 200, 60, pad_inside=True)
    ids_q = packed_ids(g, 2, 90, 30)
    ids_kv = packed_ids(g, 2, 150, 50)
    ids_kv[:, :90] = np.where(ids_q >= 0, ids_q, ids_kv[:, :90])  # overlapping documents
    dm = g.random((2, 3, 150, 170)) < 0.4
    P = pytest.param
    return [
        # mask, b, hq, hkv, lq, lkv, dqk, dv, block, kwargs
        P(causal(), 1, 2, 2, 96, 96, 32, 32, 32, {}, id="causal"),
        P(causal(), 2, 3, 3, 200, 200, 64, 64, 128, dict(lse_loss=True), id="causal_default_tile_ragged"),
        P(causal() & document(ids), 2, 8, 2, 200, 200, 24, 24, (32, 64),
          dict(softcap=5.0, sinks=True, lse_loss=True), id="doc_padding_gqa8to2_softcap_sinks_lse"),
        P(causal() & document(ids), 2, 4, 4, 200, 200, 32, 32, 64, {}, id="doc_padding_plain"),
        P(window(17, 3), 1, 4, 1, 133, 133, 40, 24, 64, {}, id="window_mqa_dqk_ne_dv_ragged"),
        P(causal(3) | prefix(7), 1, 2, 2, 77, 121, 16, 16, 32, dict(scale=0.37), id="prefix_or_causal_cross"),
        P(chunk(19) & causal(), 1, 2, 1, 150, 150, 32, 32, 64, dict(lse_loss=True, sinks=True),
          id="chunk_and_causal_sinks_lse"),
        P(~window(5), 1, 3, 3, 70, 70, 16, 16, 16, dict(layout="blhd"), id="not_window_strided"),
        P(heads([~window(5), causal(), full(), chunk(9) & causal()]), 1, 4, 2, 70, 70, 16, 8, 16, {},
          id="heads_gqa"),
        P(dense(dm), 2, 3, 3, 150, 170, 16, 8, 64, dict(lse_loss=True), id="dense_batch_heads_cross"),
        P(document(ids_q, ids_kv), 2, 4, 2, 90, 150, 32, 16, 32, dict(sinks=True), id="doc_cross_attention"),
        P(causal(-20), 1, 2, 1, 100, 100, 16, 16, 32, dict(lse_loss=True), id="empty_first_rows"),
        P(causal(-20), 1, 2, 1, 100, 100, 16, 16, 32, dict(lse_loss=True, sinks=True), id="empty_rows_sinks"),
        P(full(), 1, 2, 2, 64, 64, 16, 16, 32, dict(q_scale=12.0), id="peaky_large_logits"),
        P(full(), 1, 2, 2, 64, 64, 16, 16, 32, dict(q_scale=12.0, softcap=3.0), id="large_logits_softcap"),
        P(causal(299), 1, 4, 1, 1, 300, 64, 64, 64, dict(sinks=True), id="decode_single_query"),
        P(full(), 1, 1, 1, 3, 1, 8, 8, 16, {}, id="single_key"),
        P(window(100, 100), 1, 2, 2, 128, 128, 128, 128, 64, dict(softcap=20.0), id="wide_head_dim"),
        P(causal() & document(ids), 2, 4, 2, 200, 200, 32, 32, 64,
          dict(layout="blhd", dtype=torch.bfloat16, softcap=8.0), id="doc_strided_bf16_softcap"),
        P(chunk(33) | prefix(5), 1, 4, 2, 120, 120, 32, 32, 32, dict(dtype=torch.bfloat16, sinks=True, lse_loss=True),
          id="bf16_sinks_lse"),
    ]


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", _cases())
def test_outputs_and_gradients_match_float64(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


@pytest.mark.parametrize("seed", range(12))
def test_random_masks_match_float64(seed):
    r = np.random.default_rng(500 + seed)
    lq = int(r.integers(1, 140))
    lkv = lq if seed % 2 else int(r.integers(1, 140))
    b, hkv = int(r.integers(1, 3)), int(r.integers(1, 3))
    hq = hkv * int(r.integers(1, 3))
    m = random_mask(r, lq, lkv, b, hq, depth=2)
    block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
    check_case(m, b, hq, hkv, lq, lkv, int(r.choice([8, 16, 40])), int(r.choice([8, 24])), block,
               softcap=[None, 4.0][seed % 2], sinks=seed % 3 == 0, lse_loss=seed % 2 == 0, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "m, b, hq, hkv, l, d, block, kw",
    [
        pytest.param(causal(), 1, 8, 2, 1024, 64, 128, dict(sinks=True, softcap=30.0), id="causal_1k_gqa"),
        pytest.param(window(200, 10) | prefix(64), 2, 4, 4, 777, 64, (64, 128), dict(lse_loss=True), id="window_777"),
        pytest.param(causal() & document(packed_ids(np.random.default_rng(1), 2, 1000, 300, pad_inside=True)),
                     2, 8, 1, 1000, 96, (128, 64), dict(sinks=True, lse_loss=True), id="doc_1k_mqa"),
    ],
)
def test_larger_problems_match_float64(m, b, hq, hkv, l, d, block, kw):
    check_case(m, b, hq, hkv, l, l, d, d, block, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 40))
def test_many_random_masks_match_float64(seed):
    test_random_masks_match_float64(seed)


# -- fully masked rows ---------------------------------------------------------------------------


def test_padding_rows_give_zero_output_minus_inf_lse_and_finite_gradients():
    ids = np.array([[-1] * 20 + [0] * 30 + [-1] * 6 + [1] * 8 + [-1] * 10])
    L = ids.shape[1]
    pad = ids[0] < 0
    m = tessera.document(ids) & tessera.causal()
    plan = tessera.plan(m, q_len=L, block=16)
    q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    o, lse = tt.attention(q, k, v, plan, return_lse=True)
    assert (o[:, :, pad] == 0).all() and (lse[:, :, pad] == -math.inf).all()
    assert torch.isfinite(lse[:, :, ~pad]).all() and torch.isfinite(o).all()
    o2, lse2 = tt.attention(q, k, v, plan, sinks=sinks, softcap=2.0, return_lse=True)
    assert (o2[:, :, pad] == 0).all()
    assert torch.allclose(lse2[0, :, pad], sinks.detach()[:, None].expand(2, int(pad.sum())))
    loss = o.sum() + o2.square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum() + lse2.sum()
    loss.backward()
    for x in (q, k, v, sinks):
        assert torch.isfinite(x.grad).all()
    # padding queries and keys get no gradient from attention
    assert (q.grad[:, :, pad] == 0).all() and (k.grad[:, :, pad] == 0).all() and (v.grad[:, :, pad] == 0).all()


def test_a_plan_where_nothing_is_allowed():
    plan = tessera.plan(~tessera.full(), q_len=50, kv_len=70, heads=2, block=32)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (50, 70, 70))
    o, lse = tt.attention(q, k, v, plan, return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    o.sum().backward()
    assert all((x.grad == 0).all() for x in (q, k, v))


def test_a_loss_on_lse_alone_and_partial_requires_grad():
    m = causal() & document(np.repeat(np.arange(3), 30))
    plan = tessera.plan(m.t, q_len=90, heads=4, block=32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 90, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 90, 16, generator=g, requires_grad=True) for _ in range(2))
    _, lse = tt.attention(q, k, v, plan, return_lse=True)
    wl = torch.randn(lse.shape, generator=g)
    (lse * wl).sum().backward()  # O unused: its gradient is absent
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    _, rlse = ref_attention(rq, rk, rv, m.dense(1, 4, 90, 90))
    (rlse * wl.double()).sum().backward()
    assert rel(q.grad, rq.grad) <= F32_TOL and rel(k.grad, rk.grad) <= F32_TOL
    assert v.grad is None or (v.grad == 0).all()
    # only q requires grad
    q2 = q.detach().requires_grad_()
    o = tt.attention(q2, k.detach(), v.detach(), plan)
    assert o.requires_grad
    o.square().sum().backward()
    rq2 = q.detach().double().requires_grad_()
    ro, _ = ref_attention(rq2, k.detach(), v.detach(), m.dense(1, 4, 90, 90))
    ro.square().sum().backward()
    assert rel(q2.grad, rq2.grad) <= F32_TOL


def test_no_grad_and_inference_mode_give_the_same_output():
    plan = tessera.plan(tessera.window(10, 2), q_len=70, heads=2, block=16)
    q, k, v = (torch.randn(1, 2, 70, 8, requires_grad=True) for _ in range(3))
    o = tt.attention(q, k, v, plan)
    with torch.no_grad():
        o1 = tt.attention(q, k, v, plan)
    with torch.inference_mode():
        o2 = tt.attention(q.detach(), k.detach(), v.detach(), plan)
    assert not o1.requires_grad and torch.equal(o.detach(), o1) and torch.equal(o1, o2)
    o3 = tt.attention(q, k, v, plan, return_lse=False)
    assert isinstance(o3, torch.Tensor) and torch.equal(o3, o)


@pytest.mark.parametrize("sink_dtype", [torch.float64, torch.bfloat16])
def test_sinks_of_other_dtypes_get_gradients_of_their_dtype(sink_dtype):
    plan = tessera.plan(tessera.causal(), q_len=40, heads=2, block=16)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    s = torch.randn(2).to(sink_dtype).requires_grad_()
    s32 = s.detach().float().requires_grad_()
    o = tt.attention(q, k, v, plan, sinks=s)
    o.sum().backward()
    tt.attention(q, k, v, plan, sinks=s32).sum().backward()
    assert s.grad.dtype == sink_dtype
    assert torch.allclose(s.grad.float(), s32.grad, rtol=1e-2 if sink_dtype == torch.bfloat16 else 1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_run_on_flex_attention_and_tessera_engine_refuses_them():
    plan = tessera.plan(tessera.causal(), q_len=64, block=32)
    q, k, v = (torch.randn(1, 1, 64, 16, device="cuda") for _ in range(3))
    with pytest.raises(ValueError, match="engine='tessera'"):
        tt.attention(q, k, v, plan, engine="tessera")
    o = tt.attention(q, k, v, plan)
    ro, _ = ref_attention(q.cpu(), k.cpu(), v.cpu(), causal().dense(1, 1, 64, 64))
    assert o.device == q.device and rel(o.cpu(), ro) <= 1e-4


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_strided_views_are_bit_identical_to_contiguous_copies(dtype):
    g = np.random.default_rng(3)
    ids = packed_ids(g, 2, 160, 50)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=160, heads=4, block=32)
    sinks = torch.randn(4)
    base = [torch.randn(2, 160, h, 32).to(dtype) for h in (4, 2, 2)]  # [B, L, H, D] storage
    views = [x.transpose(1, 2).requires_grad_() for x in base]
    copies = [x.transpose(1, 2).contiguous().requires_grad_() for x in base]
    assert not any(x.is_contiguous() for x in views)
    do = torch.randn(2, 4, 160, 32).to(dtype)
    oa, la = tt.attention(*views, plan, softcap=6.0, sinks=sinks, return_lse=True)
    ob, lb = tt.attention(*copies, plan, softcap=6.0, sinks=sinks, return_lse=True)
    assert torch.equal(oa, ob) and torch.equal(la, lb)
    oa.backward(do)
    ob.backward(do)
    for a, b in zip(views, copies):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("kind", ["row_stride", "expanded_kv", "d_not_unit", "d_padded", "sliced_heads"])
def test_other_layouts_match_contiguous_inputs(kind):
    g = torch.Generator().manual_seed(11)
    m = window(20) | prefix(3)
    plan = tessera.plan(m.t, q_len=64, heads=4, block=16)
    q = torch.randn(2, 4, 64, 16, generator=g)
    k = torch.randn(2, 2, 64, 16, generator=g)
    v = torch.randn(2, 2, 64, 16, generator=g)
    if kind == "row_stride":  # every other row of a longer buffer: row stride 2·D
        big = [torch.randn(x.shape[0], x.shape[1], 128, 16, generator=g) for x in (q, k, v)]
        q, k, v = (x[:, :, ::2] for x in big)
    elif kind == "expanded_kv":  # one kv head broadcast to two (stride 0 along heads)
        k = torch.randn(2, 1, 64, 16, generator=g).expand(2, 2, 64, 16)
        v = torch.randn(2, 1, 64, 16, generator=g).expand(2, 2, 64, 16)
    elif kind == "d_not_unit":  # unit stride along L instead of D
        q, k, v = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v))
    elif kind == "d_padded":  # rows padded in memory: row stride 24 for D = 16
        q, k, v = (torch.randn(*x.shape[:3], 24, generator=g)[..., 4:20] for x in (q, k, v))
    elif kind == "sliced_heads":  # a head slice of a wider tensor
        q = torch.randn(2, 8, 64, 16, generator=g)[:, 2:6]
        k = torch.randn(2, 5, 64, 16, generator=g)[:, 1:3]
        v = torch.randn(2, 5, 64, 16, generator=g)[:, 3:]
        v = v[:, :2]
    xs = [x.requires_grad_() if x.is_leaf else x.detach().requires_grad_() for x in (q, k, v)]
    ys = [x.detach().contiguous().requires_grad_() for x in xs]
    do = torch.randn(2, 4, 64, 16, generator=g)
    oa = tt.attention(*xs, plan)
    ob = tt.attention(*ys, plan)
    assert torch.equal(oa, ob)
    oa.backward(do)
    ob.backward(do)
    for a, b in zip(xs, ys):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    # and against the reference
    ro, _ = ref_attention(*ys, m.dense(1, 1, 64, 64))
    assert rel(oa, ro) <= F32_TOL


def test_one_row_plan_serves_any_batch_and_head_count():
    plan = tessera.plan(tessera.causal(), q_len=64, block=32)  # B = 1, H = 1, groups (1, 1)
    for b, h, hkv in ((3, 4, 2), (1, 2, 1), (2, 1, 1)):
        q, k = torch.randn(b, h, 64, 16), torch.randn(b, hkv, 64, 16)
        v = torch.randn(b, hkv, 64, 16)
        full_plan = tessera.plan(tessera.causal(), q_len=64, heads=h, batch=b, block=32)
        assert torch.equal(tt.attention(q, k, v, plan), tt.attention(q, k, v, full_plan))


def test_results_are_deterministic_run_to_run():
    ids = packed_ids(np.random.default_rng(8), 2, 300, 80, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=300, heads=4, block=64)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, h, 300, 32, generator=g) for h in (4, 2, 2)]
    s = torch.randn(4, generator=g)
    do = torch.randn(2, 4, 300, 32, generator=g)
    runs = []
    for _ in range(3):
        leaves = [x.clone().requires_grad_() for x in xs]
        sl = s.clone().requires_grad_()
        o = tt.attention(*leaves, plan, sinks=sl, softcap=10.0)
        o.backward(do)
        runs.append([o.detach()] + [x.grad for x in leaves] + [sl.grad])
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


# -- NaN propagation -----------------------------------------------------------------------------


def test_nan_inputs_only_affect_the_rows_that_read_them():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    base = tt.attention(q, k, v, plan)
    for which in ("k", "v"):
        x = {"k": k, "v": v}[which].clone()
        x[0, 0, 40, 3] = float("nan")
        o = tt.attention(q, x if which == "k" else k, x if which == "v" else v, plan)
        bad = torch.isnan(o).any(-1)
        assert bad[0, 0, 40:].all() and not bad[0, 0, :40].any(), which  # rows i >= 40 read key 40
        assert torch.equal(o[0, 0, :40], base[0, 0, :40]) and torch.equal(o[0, 1], base[0, 1]), which
    q2 = q.clone()
    q2[0, 1, 10, 0] = float("nan")
    o = tt.attention(q2, k, v, plan)
    bad = torch.isnan(o).any(-1)
    assert bad[0, 1, 10] and bad.sum() == 1
    assert torch.equal(o[0, 0], base[0, 0])


# -- autograd machinery --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
@pytest.mark.parametrize("softcap, use_sinks", [(None, False), (3.0, True)])
def test_gradcheck_small_case(softcap, use_sinks):
    ids = [0, 0, 0, 1, 1, 1, 1, -1, 2, 2]
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=10, block=16)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=g, requires_grad=True) for _ in range(3))
    s = torch.randn(2, generator=g, requires_grad=True) if use_sinks else None

    def f(q, k, v, *s):
        o, lse = tt.attention(q, k, v, plan, softcap=softcap, sinks=s[0] if s else None, return_lse=True)
        return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    inputs = (q, k, v) + ((s,) if use_sinks else ())
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=1e-3, rtol=1e-2, nondet_tol=0.0)


def test_opcheck_forward_backward_and_logged_ops():
    plan = tessera.plan(tessera.causal() & tessera.document([0] * 20 + [1] * 20), q_len=40, heads=2, block=16)
    h = _handle(plan)
    assert h.dtype == torch.int64 and h.dim() == 0
    q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    fwd = torch.ops.tessera.attention_fwd.default
    torch.library.opcheck(fwd, (q, k, v, h, 0.3, 2.0, sinks))
    torch.library.opcheck(fwd, (q, k, v, h, 0.3, None, None))
    bq, bk, bv = (torch.randn(1, 2, 40, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(fwd, (bq, bk, bv, h, 0.3, None, sinks))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse, _ = torch.ops.tessera.attention_fwd(qd, kd, vd, h, 0.3, 2.0, sinks.detach())
    bwd = torch.ops.tessera.attention_bwd.default
    torch.library.opcheck(bwd, (qd, kd, vd, o, lse, torch.randn_like(o), None, h, 0.3, 2.0, sinks.detach()))
    torch.library.opcheck(bwd, (qd, kd, vd, o, lse, torch.randn_like(o), torch.randn_like(lse), h, 0.3, 2.0,
                                sinks.detach()))
    o, lse, _ = torch.ops.tessera.attention_fwd(qd, kd, vd, h, 0.3, None, None)
    torch.library.opcheck(bwd, (qd, kd, vd, o, lse, torch.randn_like(o), None, h, 0.3, None, None))
    logged = torch.ops.tessera.attention_fwd_logged.default
    torch.library.opcheck(logged, (q, k, v, h, 0.3, None, sinks, 1, 6.0, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_torch_compile_fullgraph_matches_eager_and_reuses_the_graph_across_plans():
    from torch._dynamo.utils import counters

    def step(q, k, v, s, plan):
        o, lse = tt.attention(q, k, v, plan, softcap=4.0, sinks=s, return_lse=True)
        return o, (o.square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum())

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    g = np.random.default_rng(9)
    for trial in range(3):
        ids = np.sort(g.integers(-1, 5, 128))  # different documents (and padding) every time
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=128, heads=2, block=32)
        xs = [torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3)]
        s = torch.randn(2, requires_grad=True)
        oc, lc = compiled(*xs, s, plan)
        lc.backward()
        got = [x.grad.clone() for x in xs + [s]]
        for x in xs + [s]:
            x.grad = None
        oe, le = step(*xs, s, plan)
        le.backward()
        assert torch.equal(oc, oe)
        assert torch.allclose(lc, le, rtol=1e-6)
        for a, x in zip(got, xs + [s]):
            assert torch.allclose(a, x.grad, rtol=1e-5, atol=1e-6)
    # New plans of the same shapes reuse the compiled graph (the plan is passed as a tensor).
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # another length is a new graph, and still right
    plan = tessera.plan(tessera.causal(), q_len=48, heads=2, block=16)
    xs = [torch.randn(1, 2, 48, 16) for _ in range(3)]
    assert torch.equal(compiled(*xs, None, plan)[0], step(*xs, None, plan)[0])


def test_backward_works_when_the_plan_object_is_gone():
    # a plan made inline is dropped by the caller right after the forward; the autograd graph
    # must keep what the backward needs
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    o = tt.attention(q, k, v, tessera.plan(tessera.causal(), q_len=64, block=16, cache=False))
    gc.collect()
    o.sum().backward()
    plan = tessera.plan(tessera.causal(), q_len=64, block=16)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    tt.attention(q2, k2, v2, plan).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(a.grad, b.grad)


def test_a_plan_is_freed_with_its_last_reference():
    # No reference cycle between a Plan and its handle tensor: a dropped plan (and its tables)
    # is freed at once, not at the next garbage collection; one kept alive by an autograd graph
    # is freed with the graph.
    import weakref

    gc.disable()
    try:
        plan = tessera.plan(tessera.causal(), q_len=64, block=16, cache=False)
        plan.to_flex_block_mask()
        assert plan._handle_tensor is not None
        ref, native = weakref.ref(plan), weakref.ref(plan._native)
        del plan
        assert ref() is None and native() is None
        q, k, v = (torch.randn(1, 1, 64, 16, requires_grad=True) for _ in range(3))
        plan = tessera.plan(tessera.causal(), q_len=64, block=16, cache=False)
        native = weakref.ref(plan._native)
        o = tt.attention(q, k, v, plan)
        del plan
        assert native() is not None  # the graph keeps the native plan for the backward
        o.sum().backward()
        del o
        assert native() is None
    finally:
        gc.enable()


# -- bad inputs ----------------------------------------------------------------------------------


def _bad_cases():
    plan = tessera.plan(tessera.causal(), q_len=32, heads=2, block=16)
    doc_plan = tessera.plan(tessera.document(np.zeros((2, 32), dtype=int)), q_len=32, heads=2, block=16)
    head_plan = tessera.plan(tessera.heads([tessera.causal(), tessera.full()]), q_len=32, block=16)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    r = torch.randn
    return [
        ("meta_q", lambda: tt.attention(q.to("meta"), k, v, plan), ValueError, "share a device"),
        ("meta_q_tessera", lambda: tt.attention(q.to("meta"), k, v, plan, engine="tessera"), ValueError,
         "engine='tessera'"),
        ("engine_name", lambda: tt.attention(q, k, v, plan, engine="cuda"), ValueError, "engine"),
        ("meta_k", lambda: tt.attention(q, k.to("meta"), v, plan), ValueError, "to_flex_block_mask"),
        ("meta_v", lambda: tt.attention(q, k, v.to("meta"), plan), ValueError, "to_flex_block_mask"),
        ("meta_sinks", lambda: tt.attention(q, k, v, plan, sinks=torch.zeros(2, device="meta")), ValueError, "sinks"),
        ("float64", lambda: tt.attention(q.double(), k.double(), v.double(), plan), TypeError, "q"),
        ("float16_k", lambda: tt.attention(q, k.half(), v, plan), TypeError, "k"),
        ("int", lambda: tt.attention(q.long(), k.long(), v.long(), plan), TypeError, "q"),
        ("mixed_k", lambda: tt.attention(q, k.bfloat16(), v, plan), TypeError, "k, v"),
        ("mixed_v", lambda: tt.attention(q, k, v.bfloat16(), plan), TypeError, "k, v"),
        ("numpy_q", lambda: tt.attention(q.numpy(), k, v, plan), TypeError, "q"),
        ("plan_length", lambda: tt.attention(r(1, 2, 33, 8), r(1, 2, 33, 8), r(1, 2, 33, 8), plan), ValueError, "plan"),
        ("plan_kv_length", lambda: tt.attention(q, r(1, 2, 40, 8), r(1, 2, 40, 8), plan), ValueError, "plan"),
        ("plan_batch", lambda: tt.attention(r(3, 2, 32, 8), r(3, 2, 32, 8), r(3, 2, 32, 8), doc_plan), ValueError,
         "plan"),
        ("plan_heads", lambda: tt.attention(r(1, 4, 32, 8), r(1, 4, 32, 8), r(1, 4, 32, 8), head_plan), ValueError,
         "plan"),
        ("plan_type", lambda: tt.attention(q, k, v, "causal"), TypeError, "plan"),
        ("rank_q", lambda: tt.attention(q[0], k, v, plan), ValueError, "q"),
        ("rank_k", lambda: tt.attention(q, k[0], v, plan), ValueError, "k"),
        ("head_dim_k", lambda: tt.attention(q, r(1, 2, 32, 4), v, plan), ValueError, "k"),
        ("kv_length_mismatch", lambda: tt.attention(q, k, r(1, 2, 31, 8), plan), ValueError, "k, v"),
        ("kv_heads_mismatch", lambda: tt.attention(q, k, r(1, 1, 32, 8), plan), ValueError, "k, v"),
        ("kv_batch", lambda: tt.attention(q, r(2, 2, 32, 8), r(2, 2, 32, 8), plan), ValueError, "k, v"),
        ("gqa_ratio", lambda: tt.attention(r(1, 3, 32, 8), r(1, 2, 32, 8), r(1, 2, 32, 8),
                                           tessera.plan(tessera.causal(), q_len=32, heads=3, block=16)),
         ValueError, "k"),
        ("sinks_shape", lambda: tt.attention(q, k, v, plan, sinks=torch.zeros(3)), ValueError, "sinks"),
        ("sinks_2d", lambda: tt.attention(q, k, v, plan, sinks=torch.zeros(1, 2)), ValueError, "sinks"),
        ("sinks_list", lambda: tt.attention(q, k, v, plan, sinks=[0.0, 0.0]), ValueError, "sinks"),
        ("scale_zero", lambda: tt.attention(q, k, v, plan, scale=0.0), ValueError, "scale"),
        ("scale_negative", lambda: tt.attention(q, k, v, plan, scale=-0.5), ValueError, "scale"),
        ("scale_nan", lambda: tt.attention(q, k, v, plan, scale=float("nan")), ValueError, "scale"),
        ("scale_inf", lambda: tt.attention(q, k, v, plan, scale=float("inf")), ValueError, "scale"),
        ("softcap_zero", lambda: tt.attention(q, k, v, plan, softcap=0.0), ValueError, "softcap"),
        ("softcap_negative", lambda: tt.attention(q, k, v, plan, softcap=-1.0), ValueError, "softcap"),
        ("softcap_nan", lambda: tt.attention(q, k, v, plan, softcap=float("nan")), ValueError, "softcap"),
        ("softcap_inf", lambda: tt.attention(q, k, v, plan, softcap=float("inf")), ValueError, "softcap"),
        ("sinks_nan", lambda: tt.attention(q, k, v, plan, sinks=torch.tensor([float("nan"), 0.0])), ValueError,
         "sinks"),
        ("sinks_inf", lambda: tt.attention(q, k, v, plan, sinks=torch.tensor([0.0, float("inf")])), ValueError,
         "sinks"),
        ("empty_head_dim_scaled", lambda: tt.attention(r(1, 2, 32, 0), r(1, 2, 32, 0), r(1, 2, 32, 0), plan,
                                                       scale=0.5), ValueError, "q"),
        ("empty_batch", lambda: tt.attention(r(0, 2, 32, 8), r(0, 2, 32, 8), r(0, 2, 32, 8), plan), ValueError, "q"),
        ("empty_v_dim", lambda: tt.attention(q, k, r(1, 2, 32, 0), plan), ValueError, "v"),
        ("empty_head_dim", lambda: tt.attention(r(1, 2, 32, 0), r(1, 2, 32, 0), r(1, 2, 32, 0), plan), ValueError,
         "q"),
    ]


def _bad_params():
    out = []
    for name, call, exc, needle, *bug in _bad_cases():
        marks = [pytest.mark.xfail(strict=True, reason=bug[0])] if bug else []
        out.append(pytest.param(call, exc, needle, id=name, marks=marks))
    return out


@pytest.mark.parametrize("call, exc, name", _bad_params())
def test_bad_inputs_raise_naming_the_argument(call, exc, name):
    with pytest.raises(exc) as e:
        call()
    assert name in str(e.value), str(e.value)


# -- threads -------------------------------------------------------------------------------------


def test_threads_sharing_a_fresh_plan_prepare_it_once_and_agree():
    # the plan's kernel preparation happens on first use: here, in several threads at once
    ids = np.sort(np.random.default_rng(6).integers(-1, 9, 700))
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(1, h, 700, 16, generator=gen) for h in (4, 1, 1)]
    want = tt.attention(*xs, tessera.plan(tessera.causal() & tessera.document(ids), q_len=700, heads=4,
                                          block=64, cache=False))
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=700, heads=4, block=64, cache=False)
    out, errors = [None] * 4, []
    barrier = threading.Barrier(4)

    def work(i):
        try:
            barrier.wait()
            out[i] = tt.attention(*xs, plan)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for o in out:
        assert torch.equal(o, want)


def test_two_threads_at_once_match_sequential_calls():
    g = np.random.default_rng(4)
    plan = tessera.plan(tessera.causal() & tessera.document(np.sort(g.integers(0, 6, 512))), q_len=512,
                        heads=4, block=64)
    gen = torch.Generator().manual_seed(4)
    inputs = [[torch.randn(1, h, 512, 32, generator=gen) for h in (4, 2, 2)] for _ in range(2)]
    dos = [torch.randn(1, 4, 512, 32, generator=gen) for _ in range(2)]

    def fwd_bwd(i):
        xs = [x.clone().requires_grad_() for x in inputs[i]]
        o = tt.attention(*xs, plan, softcap=5.0)
        o.backward(dos[i])
        return [o.detach()] + [x.grad for x in xs]

    seq = [fwd_bwd(0), fwd_bwd(1)]
    out = [[None] * 3, [None] * 3]
    errors = []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait()
            for r in range(3):
                out[i][r] = fwd_bwd(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for i in range(2):
        for r in range(3):
            for a, b in zip(out[i][r], seq[i]):
                assert torch.equal(a, b)
