"""`tessera.torch.attention` against a float64 torch reference: outputs and gradients, layouts,
dtypes, autograd machinery (gradcheck, opcheck, torch.compile), bad inputs and threads."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from _reference import dense_mask, doc_causal, ref_attention, rel  # noqa: E402

F32_TOL = 1e-5


def ids_with_padding(g, rows, length, max_doc):
    out = np.full((rows, length), -1, dtype=np.int64)
    for b in range(rows):
        end = length - int(g.integers(0, length // 4))
        i, d = 0, 0
        while i < end:
            n = int(min(g.integers(1, max_doc + 1), end - i))
            out[b, i : i + n] = d
            i, d = i + n, d + 1
    return out


def check_case(mask, allowed, b, hq, hkv, lq, lkv, dqk, dv, block, *, softcap=None, sinks=False,
               scale=None, lse_loss=False, layout="contiguous", seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def make(shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
        if layout == "blhd":  # stored [B, L, H, D], viewed as [B, H, L, D]
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x.requires_grad_()

    q, k, v = make((b, hq, lq, dqk)), make((b, hkv, lkv, dqk)), make((b, hkv, lkv, dv))
    s = (torch.randn(hq, generator=g, dtype=torch.float64) * 1.5).float().requires_grad_() if sinks else None
    plan = tessera.plan(mask, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)
    o, lse = tt.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=s, return_lse=True)
    assert o.shape == (b, hq, lq, dv) and o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any()
    w = torch.randn(o.shape, generator=g, dtype=torch.float64)
    wl = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (o.double() * w).sum() + ((torch.where(torch.isfinite(lse), lse, 0).double() * wl).sum() if lse_loss else 0)
    loss.backward()
    leaves = [q, k, v] + ([s] if sinks else [])
    got = [x.grad.clone() for x in leaves]
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rs = s.detach().double().requires_grad_() if sinks else None
    ro, rlse = ref_attention(rq, rk, rv, allowed, scale=scale, softcap=softcap, sinks=rs)
    rloss = (ro * w).sum() + ((torch.where(torch.isfinite(rlse), rlse, 0) * wl).sum() if lse_loss else 0)
    rloss.backward()
    want = [rq.grad, rk.grad, rv.grad] + ([rs.grad] if sinks else [])
    tol = F32_TOL if dtype == torch.float32 else 1e-2
    assert rel(o, ro) <= tol, rel(o, ro)
    fin = torch.isfinite(rlse)
    assert (torch.isfinite(lse) == fin).all()
    assert (lse[fin].double() - rlse[fin]).abs().max() <= (1e-4 if dtype == torch.float32 else 2e-2)
    for name, a, r in zip(["dq", "dk", "dv", "dsinks"], got, want):
        assert not torch.isnan(a).any(), name
        assert rel(a, r) <= tol, (name, rel(a, r))
    return plan


def _cases():
    g = np.random.default_rng(42)
    ids = ids_with_padding(g, 2, 200, 60)
    dense = g.random((2, 3, 150, 170)) < 0.4
    return [
        # (name, mask, allowed, b, hq, hkv, lq, lkv, dqk, dv, block, kwargs)
        ("causal", tessera.causal(), None, 1, 2, 2, 96, 96, 32, 32, 32, {}),
        ("doc_padding_gqa_softcap_sinks", tessera.causal() & tessera.document(ids), doc_causal(ids),
         2, 4, 2, 200, 200, 24, 24, (32, 64), dict(softcap=5.0, sinks=True)),
        ("window_mqa_dqk_ne_dv_ragged", tessera.window(17, 3), None, 1, 4, 1, 133, 133, 40, 24, 64, {}),
        ("prefix_or_causal_cross", tessera.causal(3) | tessera.prefix(7), None, 1, 2, 2, 77, 121, 16, 16, 32,
         dict(scale=0.37)),
        ("chunk_and_causal_lse_loss", tessera.chunk(19) & tessera.causal(), None, 1, 2, 1, 150, 150, 32, 32, 64,
         dict(lse_loss=True, sinks=True)),
        ("not_window_heads", tessera.heads([~tessera.window(5), tessera.causal(), tessera.full()]), None,
         1, 3, 3, 70, 70, 16, 16, 16, dict(layout="blhd")),
        ("dense_batch_heads", tessera.dense(dense), dense, 2, 3, 3, 150, 170, 16, 8, 64, dict(lse_loss=True)),
        ("doc_strided_bf16", tessera.causal() & tessera.document(ids), doc_causal(ids), 2, 4, 2, 200, 200,
         32, 32, 64, dict(layout="blhd", dtype=torch.bfloat16, softcap=8.0)),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_outputs_and_gradients_match_float64(case):
    name, mask, allowed, b, hq, hkv, lq, lkv, dqk, dv, block, kw = case
    if allowed is None:
        allowed = dense_mask(mask, b, hq, lq, lkv)
    check_case(mask, allowed, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    ids = np.array([[-1] * 20 + [0] * 30 + [-1] * 14])
    m = tessera.document(ids) & tessera.causal()
    plan = tessera.plan(m, q_len=64, block=16)
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    o, lse = tt.attention(q, k, v, plan, return_lse=True)
    assert (o[:, :, :20] == 0).all() and torch.isinf(lse[:, :, :20]).all() and (lse[:, :, :20] < 0).all()
    o2, lse2 = tt.attention(q, k, v, plan, sinks=sinks, return_lse=True)
    assert (o2[:, :, :20] == 0).all() and torch.allclose(lse2[0, :, 0], sinks.detach())
    (o.sum() + o2.sum()).backward()
    for x in (q, k, v, sinks):
        assert torch.isfinite(x.grad).all()


def test_strided_inputs_are_bit_identical_to_contiguous_copies():
    g = np.random.default_rng(3)
    ids = ids_with_padding(g, 2, 160, 50)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=160, heads=4, block=32)
    base = [torch.randn(2, 160, h, 32) for h in (4, 2, 2)]  # [B, L, H, D]
    views = [x.transpose(1, 2).requires_grad_() for x in base]
    copies = [x.transpose(1, 2).contiguous().requires_grad_() for x in base]
    do = torch.randn(2, 4, 160, 32)
    oa = tt.attention(*views, plan, softcap=6.0)
    ob = tt.attention(*copies, plan, softcap=6.0)
    assert torch.equal(oa, ob)
    oa.backward(do)
    ob.backward(do)
    for a, b in zip(views, copies):
        assert torch.equal(a.grad, b.grad)


def test_one_row_plan_serves_a_batch():
    plan = tessera.plan(tessera.causal(), q_len=64, block=32)  # B = 1, H = 1
    q, k, v = (torch.randn(3, 4, 64, 16) for _ in range(3))
    full = tessera.plan(tessera.causal(), q_len=64, heads=4, batch=3, block=32)
    assert torch.equal(tt.attention(q, k, v, plan), tt.attention(q, k, v, full))


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_small_case():
    plan = tessera.plan(tessera.causal() & tessera.document([0, 0, 0, 1, 1, 1, 1, -1]), q_len=8, block=16)
    q, k, v = (torch.randn(1, 1, 8, 4, requires_grad=True) for _ in range(3))
    s = torch.randn(1, requires_grad=True)

    def f(q, k, v, s):
        o, lse = tt.attention(q, k, v, plan, softcap=3.0, sinks=s, return_lse=True)
        return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    # f32 kernels: finite differences at f32 precision.
    assert torch.autograd.gradcheck(f, (q, k, v, s), eps=1e-2, atol=2e-3, rtol=2e-2, nondet_tol=0.0)


def test_opcheck_forward_and_backward_ops():
    plan = tessera.plan(tessera.causal(), q_len=40, heads=2, block=16)
    h = tt._handle(plan)
    q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    torch.library.opcheck(torch.ops.tessera.attention_fwd.default, (q, k, v, h, 0.3, 2.0, sinks))
    torch.library.opcheck(torch.ops.tessera.attention_fwd.default, (q, k, v, h, 0.3, None, None))
    o, lse, _ = torch.ops.tessera.attention_fwd(q.detach(), k.detach(), v.detach(), h, 0.3, None, None)
    torch.library.opcheck(
        torch.ops.tessera.attention_bwd.default,
        (q.detach(), k.detach(), v.detach(), o, lse, torch.randn_like(o), None, h, 0.3, None, None),
    )


def test_torch_compile_fullgraph_matches_eager_without_recompiling_per_plan():
    from torch._dynamo.utils import counters

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan, softcap=4.0).square().sum()

    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    g = np.random.default_rng(9)
    for trial in range(3):
        ids = np.sort(g.integers(0, 5, 128))
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=128, heads=2, block=32)
        q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
        compiled(q, k, v, plan).backward()
        got = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        step(q, k, v, plan).backward()
        for a, x in zip(got, (q, k, v)):
            assert torch.allclose(a, x.grad, rtol=1e-5, atol=1e-6)
    # New plans of the same shapes reuse the compiled graph (the plan is a tensor handle).
    assert counters["stats"]["unique_graphs"] == 1


def test_bad_inputs_raise_naming_the_argument():
    plan = tessera.plan(tessera.causal(), q_len=32, heads=2, block=16)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    with pytest.raises(ValueError, match="to_flex_block_mask"):
        tt.attention(q.to("meta"), k, v, plan)
    with pytest.raises(TypeError, match="q"):
        tt.attention(q.double(), k.double(), v.double(), plan)
    with pytest.raises(TypeError, match="k, v"):
        tt.attention(q, k.bfloat16(), v, plan)
    with pytest.raises(ValueError, match="plan"):
        tt.attention(torch.randn(1, 2, 33, 8), torch.randn(1, 2, 33, 8), torch.randn(1, 2, 33, 8), plan)
    with pytest.raises(ValueError, match="q"):
        tt.attention(q[0], k, v, plan)
    with pytest.raises(ValueError, match="k"):
        tt.attention(q, torch.randn(1, 2, 32, 4), v, plan)
    with pytest.raises(ValueError, match="sinks"):
        tt.attention(q, k, v, plan, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="scale"):
        tt.attention(q, k, v, plan, scale=0.0)
    with pytest.raises(ValueError, match="softcap"):
        tt.attention(q, k, v, plan, softcap=float("nan"))
    with pytest.raises(TypeError, match="plan"):
        tt.attention(q, k, v, "causal")
    with pytest.raises(ValueError, match="sinks"):
        tt.attention(q, k, v, plan, sinks=torch.tensor([0.0, float("inf")]))


def test_two_threads_at_once_match_sequential_calls():
    g = np.random.default_rng(4)
    plan = tessera.plan(tessera.causal() & tessera.document(np.sort(g.integers(0, 6, 512))), q_len=512,
                        heads=4, block=64)
    inputs = [[torch.randn(1, 4, 512, 32) for _ in range(3)] for _ in range(2)]
    seq = [tt.attention(*x, plan) for x in inputs]
    out = [None, None]

    def work(i):
        for _ in range(3):
            out[i] = tt.attention(*inputs[i], plan)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert torch.equal(out[0], seq[0]) and torch.equal(out[1], seq[1])
