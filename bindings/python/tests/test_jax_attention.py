"""`tessera.jax.attention` on CPU (the XLA FFI route, docs/semantics.md#attention, docs/semantics.md#telemetry, docs/semantics.md#engines-and-devices), against real JAX:

- exactness: forward O and LSE and the gradients of q, k, v, sinks (and of a loss on the LSE)
  under `jax.jit(jax.value_and_grad(...))` / `jax.jit(jax.grad(...))` against the float64 dense
  reference of conftest, over the conformance masks, ragged and cross lengths, GQA/MQA,
  Dqk != Dv, softcap, sinks, fully masked rows and bf16; both layouts ("bhld" and "blhd") bit
  for bit, and the torch op (`tessera.torch.attention`) on the same inputs;
- one graph: the jitted step holds the FFI custom calls and no host callback, and plans of equal
  shapes go through ONE trace and ONE compilation, each giving its own plan's result;
- telemetry: `tj.Telemetry` in a jitted step (summary on logging steps, zeros otherwise, one
  compilation), records equal to the torch op's telemetry;
- bad input: each argument error is a TypeError/ValueError naming the argument, at trace time
  (eagerly and inside jit); stale and forged plan handles are errors, never a crash;
- GPU: skipped unless JAX sees a GPU."""

import gc
import json
import math
import re
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")

import tessera  # noqa: E402
import tessera.jax as tj  # noqa: E402
import tessera.torch as tt  # noqa: E402
from tessera import _tessera  # noqa: E402
from conftest import (  # noqa: E402
    unregister_duration_listener,
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
BLHD = (0, 2, 1, 3)  # [B, H, L, D] <-> [B, L, H, D]



def _np(x):
    """float64 numpy of a jax or numpy array (bf16 widened exactly; no JAX computation, so no
    compilation)."""
    return np.asarray(x).astype(np.float64)


def _t(x):
    """A float64 torch tensor of a jax/numpy array."""
    return torch.from_numpy(_np(x))


def _to_blhd(x):
    """[B, H, L, D] <-> [B, L, H, D] (and [B, H, L] <-> [B, L, H]) in numpy."""
    x = np.asarray(x)
    return np.ascontiguousarray(np.transpose(x, BLHD if x.ndim == 4 else (0, 2, 1)))


def _inputs(g, b, hq, hkv, lq, lkv, dqk, dv, dtype, q_scale=1.0, sinks=False):
    """Random non-zero q, k, v (and sinks) as numpy arrays of ``dtype``: jitted functions take
    them directly (an eager ``jnp.asarray`` would compile a staging program per shape)."""
    dt = np.dtype(dtype)
    q = (g.standard_normal((b, hq, lq, dqk)) * q_scale).astype(dt)
    k = g.standard_normal((b, hkv, lkv, dqk)).astype(dt)
    v = g.standard_normal((b, hkv, lkv, dv)).astype(dt)
    s = (g.standard_normal(hq) * 2).astype(np.float32) if sinks else None
    return q, k, v, s


def _jax_step(*, scale, softcap, layout, lse_loss, sinks, wo, wl):
    """jit(value_and_grad) of sum(O·wo) (+ sum(LSE·wl) over finite rows); aux (O, LSE)."""

    def loss(q, k, v, s, plan):
        o, lse = tj.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=s,
                              return_lse=True, layout=layout)
        val = jnp.sum(o.astype(jnp.float32) * wo)
        if lse_loss:
            val = val + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return val, (o, lse)

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, *, softcap=None, sinks=False, scale=None,
               lse_loss=False, dtype=jnp.float32, seed=0, q_scale=1.0, plan_batch=None, with_torch=True):
    """Forward + backward through tessera.jax in both layouts against the float64 reference
    (docs/semantics.md#attention accuracy), the two layouts bit for bit, and the torch op on the same inputs."""
    g = np.random.default_rng(seed)
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=plan_batch, block=block)
    q, k, v, s = _inputs(g, b, hq, hkv, lq, lkv, dqk, dv, dtype, q_scale, sinks)
    wo = g.standard_normal((b, hq, lq, dv)).astype(np.float32)
    wl = g.standard_normal((b, hq, lq)).astype(np.float32)
    kw = dict(scale=scale, softcap=softcap, lse_loss=lse_loss, sinks=sinks)

    step = _jax_step(layout="bhld", wo=wo, wl=wl, **kw)
    (_, (o, lse)), grads = step(q, k, v, s, plan)
    assert o.shape == (b, hq, lq, dv) and o.dtype == dtype
    assert lse.shape == (b, hq, lq) and lse.dtype == jnp.float32
    assert len(grads) == (4 if sinks else 3)

    # the same inputs stored [B, L, H, D]: the same bits, in that layout
    step_t = _jax_step(layout="blhd", wo=np.transpose(wo, BLHD), wl=np.transpose(wl, (0, 2, 1)), **kw)
    (_, (o_t, lse_t)), grads_t = step_t(_to_blhd(q), _to_blhd(k), _to_blhd(v), s, tj.plan_ref(plan))
    assert o_t.shape == (b, lq, hq, dv) and o_t.dtype == dtype and lse_t.shape == (b, lq, hq)
    assert np.array_equal(_to_blhd(o_t), np.asarray(o)), "blhd O"
    assert np.array_equal(_to_blhd(lse_t), np.asarray(lse)), "blhd LSE"
    for name, a, bb in zip(("dq", "dk", "dv", "dsinks"), grads, grads_t):
        bb = np.asarray(bb) if name == "dsinks" else _to_blhd(bb)
        assert a.shape == bb.shape and np.array_equal(np.asarray(a), bb), ("blhd", name)

    # float64 reference
    allowed = m.dense(b, hq, lq, lkv)
    rq, rk, rv = (_t(x).requires_grad_() for x in (q, k, v))
    rs = _t(s).requires_grad_() if sinks else None
    ro, rlse = ref_attention(rq, rk, rv, allowed, scale=scale, softcap=softcap, sinks=rs)
    rloss = (ro * _t(wo)).sum()
    if lse_loss:
        rloss = rloss + (torch.where(torch.isfinite(rlse), rlse, 0) * _t(wl)).sum()
    rloss.backward()

    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    o64, lse64 = _np(o), np.asarray(lse, np.float64)
    assert not np.isnan(o64).any() and not np.isnan(lse64).any()
    assert rel(torch.from_numpy(o64), ro.detach()) <= tol, ("o", rel(torch.from_numpy(o64), ro.detach()))
    rlse = rlse.detach().numpy()
    fin = np.isfinite(rlse)
    assert np.array_equal(np.isfinite(lse64), fin)
    assert (lse64[~fin] == -np.inf).all()
    if fin.any():
        err = np.abs(lse64[fin] - rlse[fin]).max()
        assert err <= (LSE_TOL if dtype == jnp.float32 else 5e-2), ("lse", err)
    empty = np.broadcast_to(~allowed.any(-1), (b, hq, lq))  # rows with no allowed key
    assert (o64[empty] == 0).all()
    if sinks:  # LSE of an empty row with a sink is the sink logit
        sink_rows = np.broadcast_to(np.asarray(s)[None, :, None], (b, hq, lq))
        assert np.array_equal(lse64[empty], sink_rows[empty].astype(np.float64))
    want = [rq.grad, rk.grad, rv.grad] + ([rs.grad] if sinks else [])
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert a.dtype == (dtype if name != "dsinks" else jnp.float32), name
        a64 = _np(a)
        assert np.isfinite(a64).all(), name
        if name == "dq":  # a query with no allowed key gets no gradient
            assert (a64[empty] == 0).all()
        t = 5e-2 if (name == "dsinks" and dtype != jnp.float32) else tol
        err = rel(torch.from_numpy(a64), r)
        assert err <= t, (name, err)

    if with_torch:
        _check_against_torch(plan, (q, k, v, s), (o, lse), grads, wo, wl, scale, softcap, lse_loss, dtype)
    return plan, (q, k, v, s), (o, lse), grads


def _check_against_torch(plan, xs, outs, grads, wo, wl, scale, softcap, lse_loss, dtype):
    """The torch op on the same inputs and cotangents: the same kernels, so the same values
    (bit for bit is expected; 1e-6 relative is the bar)."""
    tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    q, k, v, s = xs
    tq, tk, tv = (_t(x).to(tdt).requires_grad_() for x in (q, k, v))
    ts = torch.from_numpy(s.copy()).requires_grad_() if s is not None else None
    to, tlse = tt.attention(tq, tk, tv, plan, scale=scale, softcap=softcap, sinks=ts, return_lse=True)
    d_lse = torch.where(torch.isfinite(tlse), torch.from_numpy(wl), 0) if lse_loss else torch.zeros_like(tlse)
    torch.autograd.backward([to, tlse], [torch.from_numpy(wo).to(tdt), d_lse])
    o, lse = outs
    pairs = [("o", o, to), ("lse", lse, tlse), ("dq", grads[0], tq.grad), ("dk", grads[1], tk.grad),
             ("dv", grads[2], tv.grad)]
    if s is not None:
        pairs.append(("dsinks", grads[3], ts.grad))
    for name, a, b in pairs:
        a = _np(a)
        b = b.detach().double().numpy()
        assert a.shape == b.shape, name
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin) and np.array_equal(a[~fin], b[~fin]), name
        assert rel(torch.from_numpy(np.where(fin, a, 0)), torch.from_numpy(np.where(fin, b, 0))) <= 1e-6, name


def _cases():
    g = np.random.default_rng(42)
    ids = packed_ids(g, 2, 200, 60, pad_inside=True)  # per-row documents with -1 padding
    ids_q = packed_ids(g, 2, 90, 30)
    ids_kv = packed_ids(g, 2, 150, 50)
    ids_kv[:, :90] = np.where(ids_q >= 0, ids_q, ids_kv[:, :90])  # overlapping documents
    dm = g.random((2, 3, 150, 170)) < 0.4
    dm2 = g.random((100, 100)) < 0.3
    P = pytest.param
    return [
        # mask, b, hq, hkv, lq, lkv, dqk, dv, block, kwargs
        P(causal(), 1, 2, 2, 96, 96, 32, 32, 32, {}, id="causal"),
        P(causal(), 2, 3, 3, 200, 200, 64, 64, 128, dict(lse_loss=True), id="causal_default_tile_ragged"),
        P(window(17, 3), 1, 4, 1, 133, 133, 40, 24, 64, {}, id="window_mqa_dqk_ne_dv_ragged"),
        P(causal() & document(ids), 2, 4, 2, 200, 200, 24, 24, (32, 64),
          dict(softcap=5.0, sinks=True, lse_loss=True), id="doc_rows_padding_gqa4to2_softcap_sinks_lse"),
        P(causal() & document(ids), 2, 8, 2, 200, 200, 32, 16, 64, dict(scale=0.3), id="doc_rows_gqa8to2_dv"),
        P(causal(3) | prefix(7), 1, 2, 2, 77, 121, 16, 16, 32, dict(scale=0.37), id="prefix_or_causal_cross"),
        P(prefix(40), 1, 2, 1, 70, 70, 16, 16, 32, {}, id="prefix"),
        P(chunk(19) & causal(), 1, 2, 1, 150, 150, 32, 32, 64, dict(lse_loss=True, sinks=True),
          id="chunk_and_causal_sinks_lse"),
        P(chunk(23), 1, 2, 2, 100, 100, 16, 16, 32, {}, id="chunk"),
        P(dense(dm2), 1, 2, 2, 100, 100, 16, 16, 32, dict(lse_loss=True), id="dense_2d"),
        P(dense(dm), 2, 3, 3, 150, 170, 16, 8, 64, dict(lse_loss=True), id="dense_batch_heads_cross"),
        P(heads([~window(5), causal(), full(), chunk(9) & causal()]), 1, 4, 2, 70, 70, 16, 8, 16, {},
          id="heads_gqa"),
        P(document(ids_q, ids_kv), 2, 4, 2, 90, 150, 32, 16, 32, dict(sinks=True), id="doc_cross_attention"),
        P(causal(40), 1, 2, 1, 60, 100, 16, 16, 32, dict(lse_loss=True), id="cross_causal_offset"),
        P(causal(-20), 1, 2, 1, 100, 100, 16, 16, 32, dict(lse_loss=True), id="empty_first_rows"),
        P(causal(-20), 1, 2, 1, 100, 100, 16, 16, 32, dict(lse_loss=True, sinks=True), id="empty_rows_sinks"),
        P(full(), 1, 2, 2, 64, 64, 16, 16, 32, dict(q_scale=12.0, softcap=3.0), id="large_logits_softcap"),
        P(causal(299), 1, 4, 1, 1, 300, 64, 64, 64, dict(sinks=True), id="decode_single_query"),
        P(causal() & document(ids[0]), 2, 4, 2, 200, 200, 32, 32, (64, 128),
          dict(plan_batch=1, sinks=True, softcap=4.0), id="one_row_plan_for_two_rows"),
        P(causal() & document(ids), 2, 4, 2, 200, 200, 32, 32, 64,
          dict(dtype=jnp.bfloat16, softcap=8.0, lse_loss=True), id="doc_bf16_softcap_lse"),
        P(chunk(33) | prefix(5), 1, 4, 2, 120, 120, 32, 32, 32,
          dict(dtype=jnp.bfloat16, sinks=True, lse_loss=True), id="bf16_sinks_lse"),
    ]


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", _cases())
def test_outputs_and_gradients_match_float64(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_random_masks_match_float64(seed):
    r = np.random.default_rng(700 + seed)
    lq = int(r.integers(1, 140))
    lkv = lq if seed % 2 else int(r.integers(1, 140))
    b, hkv = int(r.integers(1, 3)), int(r.integers(1, 3))
    hq = hkv * int(r.integers(1, 3))
    m = random_mask(r, lq, lkv, b, hq, depth=2)
    block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
    check_case(m, b, hq, hkv, lq, lkv, int(r.choice([8, 16, 40])), int(r.choice([8, 24])), block,
               softcap=[None, 4.0][seed % 2], sinks=seed % 3 == 0, lse_loss=seed % 2 == 0, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 24))
def test_many_random_masks_match_float64(seed):
    test_random_masks_match_float64(seed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "m, b, hq, hkv, l, d, block, kw",
    [
        pytest.param(causal(), 1, 8, 2, 1024, 64, 128, dict(sinks=True, softcap=30.0), id="causal_1k_gqa"),
        pytest.param(causal() & document(packed_ids(np.random.default_rng(1), 2, 1000, 300, pad_inside=True)),
                     2, 8, 1, 1000, 96, (128, 64), dict(sinks=True, lse_loss=True), id="doc_1k_mqa"),
        pytest.param(window(200, 10) | prefix(64), 2, 4, 4, 777, 64, (64, 128),
                     dict(lse_loss=True, dtype=jnp.bfloat16), id="window_777_bf16"),
    ],
)
def test_larger_problems_match_float64(m, b, hq, hkv, l, d, block, kw):
    check_case(m, b, hq, hkv, l, l, d, d, block, **kw)


# -- fully masked rows, LSE-only losses, jit(grad) ---------------------------------------------


def test_padding_rows_give_zero_output_minus_inf_lse_and_zero_finite_gradients():
    ids = np.array([[-1] * 20 + [0] * 30 + [-1] * 6 + [1] * 8 + [-1] * 10])
    L = ids.shape[1]
    pad = ids[0] < 0
    plan = tessera.plan(tessera.document(ids) & tessera.causal(), q_len=L, block=16)
    g = np.random.default_rng(17)
    q, k, v, _ = _inputs(g, 1, 2, 2, L, L, 16, 16, np.float32)
    sinks = g.standard_normal(2).astype(np.float32)

    def loss(q, k, v, s, plan):
        o, lse = tj.attention(q, k, v, plan, return_lse=True)
        o2, lse2 = tj.attention(q, k, v, plan, sinks=s, softcap=2.0, return_lse=True)
        val = o.sum() + jnp.square(o2).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum() + lse2.sum()
        return val, (o, lse, o2, lse2)

    (val, (o, lse, o2, lse2)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks, plan)
    o, lse, o2, lse2 = map(np.asarray, (o, lse, o2, lse2))
    assert np.isfinite(float(val))
    assert (o[:, :, pad] == 0).all() and (lse[:, :, pad] == -np.inf).all()
    assert np.isfinite(lse[:, :, ~pad]).all() and np.isfinite(o).all() and not np.isnan(lse).any()
    assert (o2[:, :, pad] == 0).all()
    assert np.array_equal(lse2[0][:, pad], np.broadcast_to(np.asarray(sinks)[:, None], (2, int(pad.sum()))))
    for x in grads:
        assert np.isfinite(np.asarray(x)).all()
    dq, dk, dv, ds = map(np.asarray, grads)
    # padding queries and keys get no gradient
    assert (dq[:, :, pad] == 0).all() and (dk[:, :, pad] == 0).all() and (dv[:, :, pad] == 0).all()
    # and the rest is the reference's
    allowed = (causal() & document(ids)).dense(1, 2, L, L)
    rq, rk, rv, rs = (_t(x).requires_grad_() for x in (q, k, v, sinks))
    ro, rlse = ref_attention(rq, rk, rv, allowed)
    ro2, rlse2 = ref_attention(rq, rk, rv, allowed, sinks=rs, softcap=2.0)
    (ro.sum() + ro2.square().sum() + torch.where(torch.isfinite(rlse), rlse, 0).sum() + rlse2.sum()).backward()
    for a, r in zip((dq, dk, dv, ds), (rq.grad, rk.grad, rv.grad, rs.grad)):
        assert rel(torch.from_numpy(a.astype(np.float64)), r) <= F32_TOL


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_a_plan_where_nothing_is_allowed(layout):
    plan = tessera.plan(~tessera.full(), q_len=50, kv_len=70, heads=2, block=32)
    g = np.random.default_rng(2)
    q, k, v, _ = _inputs(g, 1, 2, 2, 50, 70, 8, 8, np.float32)
    if layout == "blhd":
        q, k, v = map(_to_blhd, (q, k, v))

    def f(q, k, v, plan):
        o, lse = tj.attention(q, k, v, plan, return_lse=True, layout=layout)
        return o.sum(), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v, plan)
    assert (np.asarray(o) == 0).all() and (np.asarray(lse) == -np.inf).all()
    assert all((np.asarray(x) == 0).all() for x in grads)


def test_jit_grad_of_a_loss_on_the_lse_alone():
    m = causal() & document(np.repeat(np.arange(3), 30))
    plan = tessera.plan(m.t, q_len=90, heads=4, block=32)
    g = np.random.default_rng(6)
    q, k, v, s = _inputs(g, 1, 4, 2, 90, 90, 16, 16, jnp.float32, sinks=True)
    wl = g.standard_normal((1, 4, 90)).astype(np.float32)

    def loss(q, k, v, s, plan):
        _, lse = tj.attention(q, k, v, plan, sinks=s, return_lse=True)  # O unused
        return jnp.sum(lse * wl)

    dq, dk, dv, ds = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, s, plan)
    rq, rk, rv, rs = (_t(x).requires_grad_() for x in (q, k, v, s))
    _, rlse = ref_attention(rq, rk, rv, m.dense(1, 4, 90, 90), sinks=rs)
    (rlse * _t(wl)).sum().backward()
    for name, a, r in (("dq", dq, rq.grad), ("dk", dk, rk.grad), ("ds", ds, rs.grad)):
        assert rel(_t(a), r) <= F32_TOL, name
    assert (np.asarray(dv) == 0).all()  # the LSE does not depend on V
    # grad of q only, the op called without return_lse
    g_only = jax.jit(jax.grad(lambda q, plan: jnp.sum(jnp.square(tj.attention(q, k, v, plan)))))(q, plan)
    rq2 = _t(q).requires_grad_()
    ro, _ = ref_attention(rq2, _t(k), _t(v), m.dense(1, 4, 90, 90))
    ro.square().sum().backward()
    assert rel(_t(g_only), rq2.grad) <= F32_TOL


def test_eager_calls_equal_jitted_calls_and_the_one_row_plan_serves_any_batch_and_heads():
    plan = tessera.plan(tessera.causal(), q_len=64, block=32)  # B = 1, H = 1
    g = np.random.default_rng(4)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p, softcap=3.0, return_lse=True))
    for b, h, hkv in ((3, 4, 2), (1, 2, 1), (2, 1, 1)):
        q, k, v, _ = _inputs(g, b, h, hkv, 64, 64, 16, 16, jnp.float32)
        full_plan = tessera.plan(tessera.causal(), q_len=64, heads=h, batch=b, block=32)
        o1, l1 = tj.attention(q, k, v, plan, softcap=3.0, return_lse=True)  # eager, concrete plan
        o2, l2 = f(q, k, v, full_plan)
        o3 = tj.attention(q, k, v, tj.plan_ref(plan), softcap=3.0)  # eager PlanRef, O alone
        assert isinstance(o3, jax.Array)
        assert np.array_equal(np.asarray(o1), np.asarray(o2)) and np.array_equal(np.asarray(l1), np.asarray(l2))
        assert np.array_equal(np.asarray(o1), np.asarray(o3))
        ro, _ = ref_attention(_t(q), _t(k), _t(v), causal().dense(1, 1, 64, 64), softcap=3.0)
        assert rel(_t(o1), ro) <= F32_TOL


@pytest.mark.parametrize("sink_dtype", [jnp.bfloat16, jnp.float32])
def test_sinks_of_other_dtypes_get_gradients_of_their_dtype(sink_dtype):
    plan = tessera.plan(tessera.causal(), q_len=40, heads=2, block=16)
    g = np.random.default_rng(8)
    q, k, v, _ = _inputs(g, 1, 2, 2, 40, 40, 8, 8, jnp.float32)
    s = g.standard_normal(2).astype(sink_dtype)

    def f(s, plan):
        return tj.attention(q, k, v, plan, sinks=s).sum()

    ds = jax.jit(jax.grad(f))(s, plan)
    ds32 = jax.jit(jax.grad(f))(s.astype(np.float32), plan)
    assert ds.dtype == sink_dtype
    assert np.allclose(_np(ds), _np(ds32), rtol=1e-2 if sink_dtype == jnp.bfloat16 else 1e-6)


def test_results_are_deterministic_run_to_run():
    ids = packed_ids(np.random.default_rng(8), 2, 300, 80, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=300, heads=4, block=64)
    g = np.random.default_rng(1)
    q, k, v, s = _inputs(g, 2, 4, 2, 300, 300, 32, 32, jnp.float32, sinks=True)
    wo = g.standard_normal((2, 4, 300, 32)).astype(np.float32)
    step = _jax_step(scale=None, softcap=10.0, layout="bhld", lse_loss=False, sinks=True, wo=wo, wl=None)
    runs = [jax.tree_util.tree_map(np.asarray, step(q, k, v, s, plan)) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(runs[0]), jax.tree_util.tree_leaves(r)):
            assert np.array_equal(a, b)


def test_nan_inputs_only_affect_the_rows_that_read_them():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    q, k, v, _ = _inputs(np.random.default_rng(13), 1, 2, 2, 64, 64, 16, 16, np.float32)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p, layout="bhld"))
    base = np.asarray(f(q, k, v, plan))
    for which in ("k", "v"):
        x = (k if which == "k" else v).copy()
        x[0, 0, 40, 3] = np.nan
        o = np.asarray(f(q, x if which == "k" else k, x if which == "v" else v, plan))
        bad = np.isnan(o).any(-1)
        assert bad[0, 0, 40:].all() and not bad[0, 0, :40].any(), which  # rows i >= 40 read key 40
        assert np.array_equal(o[0, 0, :40], base[0, 0, :40]) and np.array_equal(o[0, 1], base[0, 1]), which
    q2 = q.copy()
    q2[0, 1, 10, 0] = np.nan
    o = np.asarray(f(q2, k, v, plan))
    bad = np.isnan(o).any(-1)
    assert bad[0, 1, 10] and bad.sum() == 1
    assert np.array_equal(o[0, 0], base[0, 0])


# -- one graph ---------------------------------------------------------------------------------


def _all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its parameters (jit, cond, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in _sub_jaxprs(p):
                yield from _all_eqns(sub)


def _sub_jaxprs(p):
    if hasattr(p, "eqns"):
        yield p
    elif hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
        yield p.jaxpr
    elif isinstance(p, (tuple, list)):
        for x in p:
            yield from _sub_jaxprs(x)


class _Compiles:
    """Counts XLA backend compilations (JAX's compile-duration monitoring event)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.names = []

    def _listener(self, event, duration, **kw):
        if event == self.EVENT:
            self.names.append(kw.get("fun_name"))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        unregister_duration_listener(self._listener)


def test_the_jitted_grad_step_is_one_graph_with_the_ffi_custom_calls_and_no_host_callback():
    ids = packed_ids(np.random.default_rng(3), 1, 128, 40)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=128, heads=2, block=32)
    g = np.random.default_rng(3)
    q, k, v, s = _inputs(g, 1, 2, 1, 128, 128, 16, 16, jnp.float32, sinks=True)
    tel = tj.Telemetry(every=2)

    def loss(q, k, v, s, plan, tel):
        o, lse, summary = tj.attention(q, k, v, plan, sinks=s, softcap=4.0, return_lse=True, telemetry=tel)
        return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), summary

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    jaxpr = jax.make_jaxpr(step)(q, k, v, s, plan, tel.at(0))
    eqns = list(_all_eqns(jaxpr.jaxpr))
    prims = {e.primitive.name for e in eqns}
    targets = {e.params.get("target_name") for e in eqns if e.primitive.name == "ffi_call"}
    assert "ffi_call" in prims
    assert {"tessera_attention_fwd", "tessera_attention_fwd_logged", "tessera_attention_bwd"} <= targets
    assert not [p for p in prims if "callback" in p], prims
    # no plan constant in the graph: the handle is an operand (an input of the outer jaxpr)
    (outer,) = [e for e in jaxpr.jaxpr.eqns]
    assert outer.primitive.name in ("jit", "pjit")
    assert any(getattr(x.aval, "shape", None) == (2,) and x.aval.dtype == jnp.int32 for x in jaxpr.jaxpr.invars)
    words = tj.plan_ref(plan).handle
    assert not any(np.shape(c) == (2,) and np.array_equal(np.asarray(c), words) for c in jaxpr.consts)
    # the lowered and compiled modules say the same
    lowered = step.lower(q, k, v, s, tj.plan_ref(plan), tel.at(0))
    assert str(int(words[0])) not in lowered.as_text() and str(int(words[1])) not in lowered.as_text()
    want = {"tessera_attention_fwd", "tessera_attention_fwd_logged", "tessera_attention_bwd"}
    assert set(re.findall(r"stablehlo\.custom_call @(\w+)", lowered.as_text())) == want
    assert set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text())) == want
    # and the plain (telemetry-free) jaxpr has exactly one forward and one backward call
    plain = jax.make_jaxpr(jax.jit(jax.grad(lambda q, plan: tj.attention(q, k, v, plan).sum())))(q, plan)
    calls = [e.params["target_name"] for e in _all_eqns(plain.jaxpr) if e.primitive.name == "ffi_call"]
    assert sorted(calls) == ["tessera_attention_bwd", "tessera_attention_fwd"]


def test_plans_with_different_documents_share_one_trace_and_one_compilation():
    b, h, hkv, L, d, block = 2, 4, 2, 256, 16, (32, 64)
    r = np.random.default_rng(11)
    plans, masks = [], []
    for _ in range(5):
        ids = packed_ids(r, b, L, 90, pad_inside=True)
        m = causal() & document(ids)
        plans.append(tessera.plan(m.t, q_len=L, heads=h, block=block))
        masks.append(m)
    metas = {tj.plan_ref(p).meta for p in plans}
    assert len(metas) == 1  # equal shapes: one static part
    assert len({p.states().tobytes() for p in plans}) == 5  # different tile data
    g = np.random.default_rng(12)
    q, k, v, s = _inputs(g, b, h, hkv, L, L, d, d, jnp.float32, sinks=True)
    wo = g.standard_normal((b, h, L, d)).astype(np.float32)
    traces = []

    def loss(q, k, v, s, plan):
        traces.append(1)  # runs once per trace
        o, lse = tj.attention(q, k, v, plan, sinks=s, softcap=6.0, return_lse=True)
        return jnp.sum(o * wo) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), o

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    with _Compiles() as compiles:
        outs = [step(q, k, v, s, p) for p in plans]  # Plans are pytrees: the handle is the leaf
        jax.block_until_ready(outs)
    assert len(traces) == 1, len(traces)
    assert step._cache_size() == 1
    assert len(compiles.names) == 1, compiles.names

    for m, ((_, o), grads) in zip(masks, outs):
        allowed = m.dense(b, h, L, L)
        rq, rk, rv, rs = (_t(x).requires_grad_() for x in (q, k, v, s))
        ro, rlse = ref_attention(rq, rk, rv, allowed, sinks=rs, softcap=6.0)
        ((ro * _t(wo)).sum() + torch.where(torch.isfinite(rlse), rlse, 0).sum()).backward()
        assert rel(_t(o), ro.detach()) <= F32_TOL
        for name, a, rg in zip(("dq", "dk", "dv", "ds"), grads, (rq.grad, rk.grad, rv.grad, rs.grad)):
            assert rel(_t(a), rg) <= F32_TOL, name
    # different outputs for different plans (each call used its own plan's data)
    assert len({np.asarray(o).tobytes() for (_, o), _ in outs}) == 5

    # another shape is another trace (the counters do count)
    p2 = tessera.plan(tessera.causal(), q_len=L, heads=h, batch=b, block=(64, 64))
    step(q, k, v, s, p2)
    assert len(traces) == 2 and step._cache_size() == 2


def test_a_plan_ref_serves_ahead_of_time_compiled_steps():
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat([0, 1], 32)), q_len=64, heads=2, block=32)
    q, k, v, _ = _inputs(np.random.default_rng(31), 1, 2, 1, 64, 64, 8, 8, np.float32)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p))
    want = np.asarray(f(q, k, v, plan))
    ref = tj.plan_ref(plan)
    leaves, tree = jax.tree_util.tree_flatten(ref)
    assert len(leaves) == 1 and leaves[0].dtype == np.int32 and leaves[0].shape == (2,)
    assert jax.tree_util.tree_structure(jax.tree_util.tree_unflatten(tree, leaves)) == tree
    compiled = f.lower(q, k, v, ref).compile()
    assert np.array_equal(np.asarray(compiled(q, k, v, ref)), want)
    other = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)  # another plan, same executable
    ro, _ = ref_attention(_t(q), _t(k), _t(v), causal().dense(1, 2, 64, 64))
    assert rel(_t(compiled(q, k, v, tj.plan_ref(other))), ro) <= F32_TOL


def test_a_plan_round_trips_as_a_pytree_and_serves_ahead_of_time_compiled_steps():
    # The module docstring: "A tessera.Plan is a JAX pytree whose only leaf is its handle".
    # A pytree node must unflatten to something that flattens to the same tree; JAX's AOT path
    # (jit(f).lower(..., plan).compile()(..., plan)) rebuilds the input tree that way and
    # compares it with the caller's.
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat([0, 1], 32)), q_len=64, heads=2, block=32)
    q, k, v, _ = _inputs(np.random.default_rng(32), 1, 2, 1, 64, 64, 8, 8, np.float32)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p))
    want = np.asarray(f(q, k, v, plan))
    compiled = f.lower(q, k, v, plan).compile()
    assert np.array_equal(np.asarray(compiled(q, k, v, plan)), want)
    leaves, tree = jax.tree_util.tree_flatten(plan)
    assert jax.tree_util.tree_structure(jax.tree_util.tree_unflatten(tree, leaves)) == tree


# -- telemetry ---------------------------------------------------------------------------------

TEL_FIELDS = ("sink_mass", "sink_rate", "learned_sink_mass", "max_logit", "entropy", "out_abs_max",
              "out_rms", "out_outliers")


def _assert_record_close(a, b, rtol=1e-6):
    assert (a["step"], a["layer"]) == (b["step"], b["layer"])
    for f in TEL_FIELDS + ("valid_rows",):
        if f not in b:
            continue
        x, y = a[f], b[f]
        if y is None:
            assert x is None, f
            continue
        x, y = np.atleast_1d(np.asarray(x, dtype=object)), np.atleast_1d(np.asarray(y, dtype=object))
        assert x.shape == y.shape, f
        assert np.array_equal(x == None, y == None), (f, x, y)  # noqa: E711 (undefined per-head values)
        x, y = (np.where(z == None, 0.0, z).astype(np.float64) for z in (x, y))  # noqa: E711
        assert np.allclose(x, y, rtol=rtol, atol=0), (f, x, y)


@pytest.mark.parametrize("traced_step", [False, True], ids=["int_step", "array_step"])
def test_telemetry_in_a_jitted_step_matches_the_torch_op(traced_step):
    b, hq, hkv, L, d = 2, 4, 2, 128, 16
    r = np.random.default_rng(21)
    ids = packed_ids(r, b, L, 40, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=hq, block=32)
    steps = 4
    data = []
    for _ in range(steps):
        q, k, v, s = _inputs(r, b, hq, hkv, L, L, d, d, jnp.float32, q_scale=1.5, sinks=True)
        v[..., 0] *= 20.0  # a few large outputs: outlier counts not all zero
        data.append((q, k, v, s))
    tel = tj.Telemetry(every=2)

    def loss(q, k, v, s, plan, tel):
        o, summary = tj.attention(q, k, v, plan, sinks=s, softcap=7.0, telemetry=tel, layer=3)
        return jnp.sum(o ** 2), (o, summary)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    plain = jax.jit(jax.value_and_grad(
        lambda q, k, v, s, plan: jnp.sum(tj.attention(q, k, v, plan, sinks=s, softcap=7.0) ** 2),
        argnums=(0, 1, 2, 3)))
    base = [jax.block_until_ready(plain(*x, plan)) for x in data]
    step_args = [np.int32(i) if traced_step else i for i in range(steps)]
    with _Compiles() as compiles:
        outs = [step(*data[i], plan, tel.at(step_args[i])) for i in range(steps)]
        jax.block_until_ready(outs)
    assert len(compiles.names) == 1, compiles.names  # logging and non-logging steps: one executable
    assert step._cache_size() == 1
    for i, ((val, (o, summary)), grads) in enumerate(outs):
        assert summary.shape == (hq, tj.SUMMARY_COLUMNS, 2) and summary.dtype == jnp.float32
        if i % 2:
            assert (np.asarray(summary) == 0).all(), i
        else:
            assert np.asarray(summary).any(), i
        # a logging step changes no output or gradient bit
        bval, bgrads = base[i]
        assert np.asarray(val) == np.asarray(bval)
        for a, bb in zip(grads, bgrads):
            assert np.array_equal(np.asarray(a), np.asarray(bb))
        tel.collect(i, {3: summary}, learned_sinks=True)  # non-logging steps are ignored
    recs = tel.read()
    assert [(x["step"], x["layer"]) for x in recs] == [(0, 3), (2, 3)]
    assert tel.read() == []

    # the torch op's telemetry on the same inputs
    ttel = tessera.Telemetry(every=2)
    for i in range(steps):
        q, k, v, s = (torch.from_numpy(np.asarray(x)) for x in data[i])
        tt.attention(q, k, v, plan, sinks=s, softcap=7.0, telemetry=ttel, layer=3)
        ttel.advance()
    trecs = ttel.read()
    assert len(trecs) == len(recs) == 2
    for a, bb in zip(recs, trecs):
        assert a["learned_sink_mass"] is not None and len(a["learned_sink_mass"]) == hq
        assert sum(a["out_outliers"]) > 0
        _assert_record_close(a, bb)
        for f in TEL_FIELDS:
            assert f in a, f


def test_telemetry_summary_is_the_same_in_both_layouts_and_without_sinks():
    b, hq, hkv, L, d = 1, 2, 1, 96, 16
    r = np.random.default_rng(5)
    ids = packed_ids(r, b, L, 30)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=hq, block=32)
    q, k, v, _ = _inputs(r, b, hq, hkv, L, L, d, d, jnp.float32)
    tel = tj.Telemetry(every=1, sink_tokens=2, outlier_ratio=2.0)
    f = jax.jit(lambda q, k, v, plan, tel, layout: tj.attention(q, k, v, plan, telemetry=tel, layout=layout),
                static_argnums=(5,))
    o, summ = f(q, k, v, plan, tel.at(0), "bhld")
    o_t, summ_t = f(_to_blhd(q), _to_blhd(k), _to_blhd(v), plan, tel.at(0), "blhd")
    assert np.array_equal(_to_blhd(o_t), np.asarray(o))
    assert np.array_equal(np.asarray(summ), np.asarray(summ_t))
    tel.collect(0, {0: summ, 1: summ_t})
    recs = tel.read()
    ttel = tessera.Telemetry(every=1, sink_tokens=2, outlier_ratio=2.0)
    for layer in (0, 1):
        tt.attention(*(torch.from_numpy(np.asarray(x)) for x in (q, k, v)), plan, telemetry=ttel, layer=layer)
    for a, bb in zip(recs, ttel.read()):
        assert a["learned_sink_mass"] is None
        _assert_record_close(a, bb)


def _tel_configs():
    r = np.random.default_rng(41)
    ids = packed_ids(r, 1, 96, 30)[0]
    doc = tessera.causal() & tessera.document(ids)  # one id row, two batch rows
    P = pytest.param
    return [
        P(doc, 2, 2, 1, 96, 96, np.float32, {}, dict(streams=("sink",)), id="sink_stream_only"),
        P(doc, 2, 2, 1, 96, 96, np.float32, {}, dict(streams=("outlier",), outlier_ratio=1.0), id="outlier_only"),
        P(doc, 2, 2, 1, 96, 96, np.float32, dict(softcap=3.0), dict(sink_tokens=3, epsilon=0.05),
          id="sink_tokens_3_epsilon"),
        P(tessera.causal(), 1, 2, 2, 96, 96, np.float32, {}, dict(sink_tokens=2), id="no_documents"),
        P(tessera.heads([tessera.causal(), ~tessera.full()]), 1, 2, 2, 96, 96, np.float32, {}, {},
          id="an_empty_head"),
        P(doc, 2, 2, 1, 96, 96, jnp.bfloat16, {}, {}, id="bf16"),
        P(tessera.document(packed_ids(r, 2, 50, 20), packed_ids(r, 2, 96, 30)), 2, 2, 1, 50, 96, np.float32,
          {}, dict(sink_tokens=2), id="cross_attention_key_documents"),
    ]


@pytest.mark.parametrize("mask, b, hq, hkv, lq, lkv, dtype, kw, tkw", _tel_configs())
def test_telemetry_configurations_match_the_torch_op(mask, b, hq, hkv, lq, lkv, dtype, kw, tkw):
    plan = tessera.plan(mask, q_len=lq, kv_len=lkv, heads=hq, block=32)
    q, k, v, _ = _inputs(np.random.default_rng(42), b, hq, hkv, lq, lkv, 16, 16, dtype)
    tel = tj.Telemetry(every=1, **tkw)
    f = jax.jit(lambda q, k, v, plan, tel: tj.attention(q, k, v, plan, telemetry=tel, layer=2, **kw))
    _, summ = f(q, k, v, plan, tel.at(5))
    tel.collect(5, {2: summ})
    (rec,) = tel.read()
    ttel = tessera.Telemetry(every=1, **tkw)
    for _ in range(5):
        ttel.advance()
    tdt = torch.float32 if dtype == np.float32 else torch.bfloat16
    tt.attention(*(_t(x).to(tdt) for x in (q, k, v)), plan, telemetry=ttel, layer=2, **kw)
    (trec,) = ttel.read()
    assert (rec["step"], rec["layer"]) == (5, 2)
    assert set(trec) <= set(rec)
    _assert_record_close(rec, trec)
    json.dumps(rec, allow_nan=False)  # strict JSON (undefined per-head values are null)


def test_telemetry_every_zero_never_logs():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    q, k, v, _ = _inputs(np.random.default_rng(0), 1, 2, 2, 64, 64, 8, 8, jnp.float32)
    never = tj.Telemetry(every=0)
    f = jax.jit(lambda q, k, v, plan, tel: tj.attention(q, k, v, plan, telemetry=tel))
    for i in range(2):
        _, summ = f(q, k, v, plan, never.at(i))
        assert not np.asarray(summ).any()
        never.collect(i, {0: summ})
        assert not never.should_log(i)
    assert never.read() == []


# -- bad input ---------------------------------------------------------------------------------


def _bad_cases():
    plan = tessera.plan(tessera.causal(), q_len=32, heads=2, block=16)
    doc_plan = tessera.plan(tessera.document(np.arange(64).reshape(2, 32) % 3), q_len=32, heads=2, block=16)
    head_plan = tessera.plan(tessera.heads([tessera.causal(), tessera.full()]), q_len=32, block=16)
    gqa_plan = tessera.plan(tessera.causal(), q_len=32, heads=3, block=16)
    z = lambda *s: np.ones(s, np.float32)  # noqa: E731
    q, k, v = z(1, 2, 32, 8), z(1, 2, 32, 8), z(1, 2, 32, 8)
    # name, (q, k, v), plan, kwargs, exception, needle
    return [
        ("int", (q.astype(np.int32), k.astype(np.int32), v.astype(np.int32)), plan, {}, TypeError, "q"),
        ("float16", (q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)), plan, {}, TypeError,
         "q"),
        ("float16_k", (q, k.astype(np.float16), v), plan, {}, TypeError, "k"),
        ("mixed_k", (q, k.astype(jnp.bfloat16), v), plan, {}, TypeError, "k, v"),
        ("mixed_v", (q, k, v.astype(jnp.bfloat16)), plan, {}, TypeError, "k, v"),
        ("rank_q", (q[0], k, v), plan, {}, ValueError, "q"),
        ("rank_k", (q, k[0], v), plan, {}, ValueError, "k"),
        ("rank_v_5", (q, k, v[None]), plan, {}, ValueError, "v"),
        ("plan_length", (z(1, 2, 33, 8), z(1, 2, 33, 8), z(1, 2, 33, 8)), plan, {}, ValueError, "plan"),
        ("plan_kv_length", (q, z(1, 2, 40, 8), z(1, 2, 40, 8)), plan, {}, ValueError, "plan"),
        ("plan_batch", (z(3, 2, 32, 8), z(3, 2, 32, 8), z(3, 2, 32, 8)), doc_plan, {}, ValueError, "plan"),
        ("plan_heads", (z(1, 4, 32, 8), z(1, 4, 32, 8), z(1, 4, 32, 8)), head_plan, {}, ValueError, "plan"),
        ("plan_heads_blhd", (q, k, v), plan, dict(layout="blhd"), ValueError, "plan"),
        ("kv_heads_not_dividing", (z(1, 3, 32, 8), z(1, 2, 32, 8), z(1, 2, 32, 8)), gqa_plan, {}, ValueError, "k"),
        ("dqk_mismatch", (q, z(1, 2, 32, 4), v), plan, {}, ValueError, "k"),
        ("kv_length_mismatch", (q, k, z(1, 2, 31, 8)), plan, {}, ValueError, "k, v"),
        ("kv_heads_mismatch", (q, k, z(1, 1, 32, 8)), plan, {}, ValueError, "k, v"),
        ("kv_batch", (q, z(2, 2, 32, 8), z(2, 2, 32, 8)), plan, {}, ValueError, "k, v"),
        ("empty_head_dim", (z(1, 2, 32, 0), z(1, 2, 32, 0), z(1, 2, 32, 0)), plan, {}, ValueError, "q"),
        ("empty_v_dim", (q, k, z(1, 2, 32, 0)), plan, {}, ValueError, "v"),
        ("sinks_shape", (q, k, v), plan, dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks"),
        ("sinks_2d", (q, k, v), plan, dict(sinks=np.zeros((1, 2), np.float32)), ValueError, "sinks"),
        ("sinks_list", (q, k, v), plan, dict(sinks=[0.0, 0.0]), ValueError, "sinks"),
        ("sinks_int", (q, k, v), plan, dict(sinks=np.zeros(2, np.int32)), TypeError, "sinks"),
        ("scale_zero", (q, k, v), plan, dict(scale=0.0), ValueError, "scale"),
        ("scale_negative", (q, k, v), plan, dict(scale=-0.5), ValueError, "scale"),
        ("scale_nan", (q, k, v), plan, dict(scale=math.nan), ValueError, "scale"),
        ("scale_inf", (q, k, v), plan, dict(scale=math.inf), ValueError, "scale"),
        ("scale_str", (q, k, v), plan, dict(scale="0.5"), TypeError, "scale"),
        ("softcap_zero", (q, k, v), plan, dict(softcap=0.0), ValueError, "softcap"),
        ("softcap_negative", (q, k, v), plan, dict(softcap=-1.0), ValueError, "softcap"),
        ("softcap_nan", (q, k, v), plan, dict(softcap=math.nan), ValueError, "softcap"),
        ("softcap_inf", (q, k, v), plan, dict(softcap=math.inf), ValueError, "softcap"),
        ("layout", (q, k, v), plan, dict(layout="bhdl"), ValueError, "layout"),
        ("backend", (q, k, v), plan, dict(backend="cuda"), ValueError, "backend"),
        ("return_lse", (q, k, v), plan, dict(return_lse=1), TypeError, "return_lse"),
        ("telemetry_type", (q, k, v), plan, dict(telemetry=tessera.Telemetry(every=1)), TypeError, "telemetry"),
        ("layer_negative", (q, k, v), plan, dict(telemetry=tj.Telemetry(every=1), layer=-1), (ValueError, TypeError),
         "layer"),
        ("plan_str", (q, k, v), "causal", {}, TypeError, "plan"),
        ("plan_none", (q, k, v), None, {}, TypeError, "plan"),
        ("plan_mask", (q, k, v), tessera.causal(), {}, TypeError, "plan"),
    ]


def _bad_params():
    out = []
    for name, arrays, plan, kw, exc, needle, *bug in _bad_cases():
        marks = [pytest.mark.xfail(strict=True, reason=bug[0])] if bug else []
        out.append(pytest.param(arrays, plan, kw, exc, needle, id=name, marks=marks))
    return out


@pytest.mark.parametrize("arrays, plan, kw, exc, needle", _bad_params())
def test_bad_inputs_raise_naming_the_argument_eagerly_and_inside_jit(arrays, plan, kw, exc, needle):
    q, k, v = arrays
    with pytest.raises(exc) as e:
        tj.attention(q, k, v, plan, **kw)
    assert needle in str(e.value), str(e.value)
    # inside jit: raised while tracing (arrays traced; a real plan passed as the pytree it is)
    traced_plan = isinstance(plan, tessera.Plan)
    array_kw = {n: x for n, x in kw.items() if isinstance(x, np.ndarray)}
    static_kw = {n: x for n, x in kw.items() if n not in array_kw}
    runs = []

    def f(q, k, v, p, akw):
        runs.append(1)
        return tj.attention(q, k, v, p if traced_plan else plan, **akw, **static_kw)

    with pytest.raises(exc) as e:
        jax.jit(f)(q, k, v, plan if traced_plan else 0, array_kw)
    assert needle in str(e.value), str(e.value)
    assert runs == [1]  # it was the trace that raised


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_sink_values_are_an_error_naming_sinks(bad):
    # values, not shapes: known only when the kernel runs (the torch op checks them eagerly)
    plan = tessera.plan(tessera.causal(), q_len=32, heads=2, block=16)
    q, k, v, _ = _inputs(np.random.default_rng(3), 1, 2, 2, 32, 32, 8, 8, np.float32)
    s = np.array([0.0, bad], np.float32)
    f = jax.jit(lambda q, k, v, s, p: tj.attention(q, k, v, p, sinks=s))
    with pytest.raises(jax.errors.JaxRuntimeError, match="sinks"):
        jax.block_until_ready(f(q, k, v, s, plan))
    ok = np.asarray(f(q, k, v, np.zeros(2, np.float32), plan))  # the step still runs afterwards
    assert np.isfinite(ok).all()


def test_numpy_float64_inputs_are_rejected():
    plan = tessera.plan(tessera.causal(), q_len=32, heads=2, block=16)
    x = np.ones((1, 2, 32, 8))
    with pytest.raises(TypeError, match="q"):
        tj.attention(x, x, x, plan)
    with pytest.raises(TypeError, match="q"):
        tj.attention([[1.0]], x, x, plan)


def test_plan_ref_rejects_what_is_not_a_plan():
    with pytest.raises(TypeError, match="plan"):
        tj.plan_ref("causal")
    with pytest.raises(TypeError, match="plan"):
        tj.plan_ref(tessera.causal())
    plan = tessera.plan(tessera.causal(), q_len=32, block=16)
    ref = tj.plan_ref(plan)
    assert tj.plan_ref(ref) is ref and ref.shape == (1, 1, 32, 32) and "PlanRef" in repr(ref)
    assert ref.handle.dtype == np.int32 and ref.handle.shape == (2,)


def _handle_int(words):
    return int(words[0]) << 31 | int(words[1])


def _wait_released(handles, timeout=10.0):
    """Collects garbage until none of ``handles`` names a live plan (a release may be deferred
    until the work already dispatched has run); False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if not any(_tessera.ffi_registered(h) for h in handles):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _stale_handle_setup():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32, cache=False)
    ref = tj.plan_ref(plan)
    words, meta = np.array(ref.handle), ref.meta
    h = _handle_int(words)
    assert _tessera.ffi_registered(h)
    del ref, plan
    assert _wait_released([h])  # released with the Plan
    return words, meta


def test_a_freed_plans_handle_is_an_error_never_a_crash():
    words, meta = _stale_handle_setup()
    g = np.random.default_rng(0)
    q, k, v, _ = _inputs(g, 1, 2, 1, 64, 64, 16, 16, jnp.float32)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p))
    grad = jax.jit(jax.grad(lambda q, k, v, p: tj.attention(q, k, v, p).sum()))
    for call in (lambda: f(q, k, v, tj.PlanRef(words, meta)).block_until_ready(),
                 lambda: f(q, k, v, tj.PlanRef(jnp.asarray(words), meta)).block_until_ready(),
                 lambda: grad(q, k, v, tj.PlanRef(words, meta)).block_until_ready()):
        with pytest.raises(jax.errors.JaxRuntimeError) as e:
            call()
        msg = str(e.value)
        assert "plan" in msg and "names no live plan" in msg, msg
    # eagerly, a stale concrete handle is a ValueError before any kernel runs
    with pytest.raises(ValueError, match="plan.*no live plan"):
        tj.attention(q, k, v, tj.PlanRef(words, meta))
    # the same compiled function still works with a live plan afterwards
    live = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    o = f(q, k, v, live)
    ro, _ = ref_attention(_t(q), _t(k), _t(v), causal().dense(1, 2, 64, 64))
    assert rel(_t(o), ro) <= F32_TOL


def test_a_forged_handle_is_an_error_never_a_crash():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    meta = tj.plan_ref(plan).meta
    g = np.random.default_rng(99)
    q, k, v, _ = _inputs(g, 1, 2, 2, 64, 64, 8, 8, jnp.float32)
    f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p, return_lse=True))
    for _ in range(3):
        words = g.integers(0, 2**31, 2).astype(np.int32)
        if _tessera.ffi_registered(int(words[0]) << 31 | int(words[1])):  # pragma: no cover
            continue
        with pytest.raises(jax.errors.JaxRuntimeError, match="names no live plan"):
            jax.block_until_ready(f(q, k, v, tj.PlanRef(words, meta)))
        with pytest.raises(ValueError, match="plan"):
            tj.attention(q, k, v, tj.PlanRef(words, meta))
    for words in (np.zeros(2, np.int32), np.array([-1, -1], np.int32)):
        with pytest.raises(jax.errors.JaxRuntimeError, match="names no live plan"):
            jax.block_until_ready(f(q, k, v, tj.PlanRef(words, meta)))


def test_plans_leave_the_registry_when_collected():
    plans = [tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(i + 1), 16)), q_len=16 * (i + 1),
                          block=16) for i in range(3)]
    g = np.random.default_rng(1)
    f = jax.jit(lambda q, p: tj.attention(q, q, q, p))
    for p in plans:
        f(g.standard_normal((1, 1, p.shape[2], 8)).astype(np.float32), p).block_until_ready()
    # One handle per plan, however often it is used (earlier tests' plans may still be leaving
    # the registry meanwhile, so the handles are compared, not the registry's size).
    refs = [tj.plan_ref(p) for p in plans]
    handles = [_handle_int(r.handle) for r in refs]
    again = [_handle_int(tj.plan_ref(p).handle) for p in plans]
    assert handles == again and len(set(handles)) == 3
    assert all(_tessera.ffi_registered(h) for h in handles)
    del refs, p
    size = _tessera.ffi_registry_size()
    plans.pop()
    assert _wait_released(handles[2:])
    assert all(_tessera.ffi_registered(h) for h in handles[:2])  # the others stay
    assert _tessera.ffi_registry_size() < size
    del plans
    assert _wait_released(handles)


_INLINE_PLAN_SCRIPT = r"""
import gc, json
import numpy as np, jax, jax.numpy as jnp, tessera, tessera.jax as tj
L = 128
g = np.random.default_rng(51)
q = g.standard_normal((1, 2, L, 16)).astype(np.float32)
k, v = (g.standard_normal((1, 1, L, 16)).astype(np.float32) for _ in range(2))
step = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(tj.attention(q, k, v, p) ** 2)))
ids = [np.repeat(np.arange(n), L // n + 1)[:L] for n in (2, 3, 5, 7)]
mk = lambda i: tessera.plan(tessera.causal() & tessera.document(ids[i]), q_len=L, heads=2, block=32)
def kept(i):  # the same step with the plan held until its result is read
    p = mk(i)
    return np.asarray(step(q, k, v, p))
errors = []
def check(name, i, out):
    try:
        ok = np.array_equal(np.asarray(out), kept(i))
        errors.append(None if ok else f"{name}: wrong values")
    except Exception as e:
        errors.append(f"{name}: {type(e).__name__}: {e}")
# inline: the Plan is garbage as soon as the call returns
check("inline", 0, step(q, k, v, mk(0)))
# a training loop: `plan` is rebound while the previous step may still be queued
outs = []
for i in range(1, 4):
    plan = mk(i)
    outs.append(step(q, k, v, plan))
del plan
gc.collect()
for i, out in zip(range(1, 4), outs):
    check(f"loop step {i}", i, out)
print(json.dumps(errors))
"""


def test_a_plan_made_inline_for_a_jitted_step_stays_alive_until_the_step_has_run():
    # docs/semantics.md#engines-and-devices: a plan reaches a compiled step as data, and the natural calls are
    # step(..., tessera.plan(...)) or a loop rebinding `plan = tessera.plan(...)` per batch
    # (the torch op supports both: test_backward_works_when_the_plan_object_is_gone). JAX
    # dispatches asynchronously: the call returns before the kernels run, so the registry must
    # not drop a plan that dispatched work still names. Run without torch in the process: with
    # torch loaded a Plan sits in a reference cycle (its handle tensor) and dies only at the next
    # garbage collection, which hides the race.
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _INLINE_PLAN_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert errors == [None] * 4, errors


# -- GPU ---------------------------------------------------------------------------------------


def _jax_gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.skipif(not _jax_gpus(), reason="JAX sees no GPU")
def test_gpu_arrays_are_a_clear_error_pointing_elsewhere():  # pragma: no cover - needs a GPU
    plan = tessera.plan(tessera.causal(), q_len=64, block=32)
    dev = _jax_gpus()[0]
    q, k, v = (jax.device_put(jnp.ones((1, 1, 64, 16)), dev) for _ in range(3))
    for backend in ("auto", "ffi"):
        with pytest.raises(ValueError, match="tessera.torch|backend"):
            tj.attention(q, k, v, plan, backend=backend)
