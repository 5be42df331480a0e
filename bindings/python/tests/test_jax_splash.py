"""The Splash route of `tessera.jax.attention` (`tessera.jax.splash`, docs/semantics.md#attention, docs/semantics.md#engines-and-devices), with the Splash
kernels in Pallas interpret mode on CPU:

- forward O and LSE, and the gradients of q, k, v, sinks and of a loss that uses the LSE, under
  `jax.jit(jax.value_and_grad(...))`, against the float64 dense reference of conftest (torch);
- the stable contract: plans with different documents and equal shapes go through one compiled
  step (compilations counted by JAX's compile events), as data: each SplashInfo marks exactly its
  plan's active blocks, and Splash skips the empty ones (NaN placed in an empty block stays out);
- the partial-block bound and the argument errors."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")

import tessera  # noqa: E402
from tessera.jax.splash import SplashInfo, splash_attention, splash_info  # noqa: E402
from conftest import (  # noqa: E402
    unregister_duration_listener,
    brute_states,
    causal,
    document,
    full,
    heads,
    packed_ids,
    prefix,
    ref_attention,
    rel,
    window,
)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # noqa: E402

F32_TOL, BF16_TOL, LSE_TOL = 1e-5, 1e-2, 1e-4



def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, *, softcap=None, sinks=False, lse_loss=True,
               dtype=jnp.float32, scale=None, block_sizes=None, plan_batch=None, seed=0):
    """Runs Splash under jit(value_and_grad) and compares O, LSE and every gradient with the
    float64 reference; returns the plan, the outputs and the mask."""
    g = np.random.default_rng(seed)
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=plan_batch, block=block)
    info = splash_info(plan)
    q = jnp.asarray(g.standard_normal((b, hq, lq, dqk)), dtype)
    k = jnp.asarray(g.standard_normal((b, hkv, lkv, dqk)), dtype)
    v = jnp.asarray(g.standard_normal((b, hkv, lkv, dv)), dtype)
    s = jnp.asarray(g.standard_normal(hq) * 2, jnp.float32) if sinks else None
    wo = g.standard_normal((b, hq, lq, dv))
    wl = g.standard_normal((b, hq, lq)) if lse_loss else np.zeros((b, hq, lq))

    def loss(q, k, v, s, info):
        o, lse = splash_attention(q, k, v, info, scale=scale, softcap=softcap, sinks=s,
                                  return_lse=True, block_sizes=block_sizes)
        val = jnp.sum(o.astype(jnp.float32) * wo)
        if lse_loss:
            val = val + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return val, (o, lse)

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
    (_, (o, lse)), grads = step(q, k, v, s, info)
    assert o.shape == (b, hq, lq, dv) and o.dtype == dtype
    assert lse.shape == (b, hq, lq) and lse.dtype == jnp.float32
    o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(o).any() and not np.isnan(lse).any()

    allowed = m.dense(b, hq, lq, lkv)
    rq, rk, rv = (_t(np.asarray(x.astype(jnp.float32))).requires_grad_() for x in (q, k, v))
    rs = _t(np.asarray(s)).requires_grad_() if sinks else None
    ro, rlse = ref_attention(rq, rk, rv, allowed, scale=scale, softcap=softcap, sinks=rs)
    rloss = (ro * _t(wo)).sum()
    if lse_loss:
        rloss = rloss + (torch.where(torch.isfinite(rlse), rlse, 0) * _t(wl)).sum()
    rloss.backward()

    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert rel(torch.from_numpy(o), ro.detach()) <= tol, "O"
    rlse = rlse.detach().numpy()
    fin = np.isfinite(rlse)
    assert np.array_equal(np.isfinite(lse), fin)
    assert (lse[~fin] == -np.inf).all()
    if fin.any():
        assert np.abs(lse[fin] - rlse[fin]).max() <= (LSE_TOL if dtype == jnp.float32 else 5e-2), "LSE"
    empty = ~allowed.any(-1)  # [b, hq, lq] rows with no key: O = 0 exactly
    assert (o[np.broadcast_to(empty, o.shape[:3])] == 0).all()
    want = [rq.grad, rk.grad, rv.grad] + ([rs.grad] if sinks else [])
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert a.dtype == (dtype if name != "dsinks" else jnp.float32), name
        a = np.asarray(a.astype(jnp.float32), np.float64)
        assert np.isfinite(a).all(), name
        t = 5e-2 if (name == "dsinks" and dtype != jnp.float32) else tol
        err = rel(torch.from_numpy(a), r)
        assert err <= t, (name, err)
    return plan, info, allowed


def _cases():
    g = np.random.default_rng(5)
    ids_pad = np.sort(g.integers(-1, 5, 200))  # one row of ids, -1 padding first
    ids_rows = packed_ids(g, 2, 200, 60, pad_inside=True)
    P = pytest.param
    return [
        P(causal(), 1, 2, 2, 256, 256, 32, 32, (128, 128), {}, id="causal"),
        P(causal() & document(ids_pad), 2, 4, 2, 200, 200, 32, 16, (64, 128),
          dict(softcap=5.0, sinks=True, plan_batch=1), id="doc_padding_uniform_batch_gqa_dv_softcap_sinks"),
        P(causal() & document(ids_rows), 2, 2, 1, 200, 200, 16, 32, (64, 128), dict(scale=0.3),
          id="doc_per_row_mqa_scale"),
        P(window(40) | prefix(8), 1, 2, 2, 256, 256, 32, 16, (64, 128),
          dict(softcap=3.0, block_sizes=sk.BlockSizes(block_q=64, block_kv=128, use_fused_bwd_kernel=False)),
          id="window_prefix_softcap_dv_separate_dq_kernel"),
        P(heads([causal(), window(30), full(), ~causal()]), 1, 4, 2, 192, 192, 16, 16, (64, 128), {},
          id="heads_with_an_empty_row"),
        P(causal(-20), 1, 2, 1, 130, 300, 16, 16, (64, 128), {}, id="empty_first_rows_cross_ragged"),
        P(causal(-20), 1, 2, 1, 130, 300, 16, 16, (64, 128), dict(sinks=True), id="empty_first_rows_sinks"),
    ]


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", _cases())
def test_splash_matches_float64_reference(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


def test_splash_bf16():
    ids = packed_ids(np.random.default_rng(9), 1, 256, 90)[0]
    check_case(causal() & document(ids), 1, 4, 2, 256, 256, 32, 32, (64, 128), dtype=jnp.bfloat16,
               sinks=True, softcap=6.0)


def test_a_sink_is_the_lse_of_an_empty_row():
    # rows 0..19 of causal(-20) see no key: with sinks O = 0 and LSE = σ_h exactly
    plan = tessera.plan(tessera.causal(-20), q_len=130, kv_len=300, heads=2, block=(64, 128))
    g = np.random.default_rng(1)
    q = jnp.asarray(g.standard_normal((1, 2, 130, 16)), jnp.float32)
    k = jnp.asarray(g.standard_normal((1, 1, 300, 16)), jnp.float32)
    v = jnp.asarray(g.standard_normal((1, 1, 300, 16)), jnp.float32)
    s = jnp.asarray([0.5, -1.25], jnp.float32)
    o, lse = splash_attention(q, k, v, splash_info(plan), sinks=s, return_lse=True)
    assert (np.asarray(o)[:, :, :20] == 0).all()
    assert np.array_equal(np.asarray(lse)[0, :, :20], np.broadcast_to(np.asarray(s)[:, None], (2, 20)))
    o2, lse2 = splash_attention(q, k, v, splash_info(plan), return_lse=True)
    assert (np.asarray(o2)[:, :, :20] == 0).all() and (np.asarray(lse2)[:, :, :20] == -np.inf).all()
    assert np.isfinite(np.asarray(lse2)[:, :, 20:]).all()


# -- the stable contract --------------------------------------------------------------------------


def _padded(allowed, tq, tk):
    *lead, lq, lkv = allowed.shape
    out = np.zeros(tuple(lead) + (-(-lq // tq) * tq, -(-lkv // tk) * tk), dtype=bool)
    out[..., :lq, :lkv] = allowed
    return out


def _check_info_marks_the_plan(info, plan, allowed):
    """Every field of the SplashInfo against the brute-force tile classification."""
    tq, tk = plan.block
    padded = _padded(allowed, tq, tk)  # Splash sees whole blocks, padding masked
    want = brute_states(padded, tq, tk)  # [B, H, nq, nk]
    states = plan.states()  # tessera's own, unpadded
    fwd, dkv = info.fwd, info.dkv
    bm = np.asarray(fwd.block_mask)
    g_count, hh = info.groups
    for gi in range(g_count):
        for h in range(hh):
            w = want[gi, h]
            assert np.array_equal(bm[gi, h], w)
            assert np.array_equal(np.asarray(dkv.block_mask)[gi, h], w)
            # the empty tiles are the plan's (padding never makes a tile non-empty)
            assert np.array_equal(bm[gi, h] == 0, states[min(gi, states.shape[0] - 1),
                                                           min(h, states.shape[1] - 1)] == 0)
            nz = np.nonzero(w)
            # full grid: a non-empty block fetches itself
            assert np.array_equal(np.asarray(fwd.data_next)[gi, h][nz], nz[1])
            assert np.array_equal(np.asarray(dkv.data_next)[gi, h][nz], nz[0])
            for i, j in zip(*np.nonzero(w == 1)):
                tile = padded[gi, h, i * tq:(i + 1) * tq, j * tk:(j + 1) * tk]
                mf = int(np.asarray(fwd.mask_next)[gi, h, i, j])
                md = int(np.asarray(dkv.mask_next)[gi, h, i, j])
                assert np.array_equal(np.asarray(fwd.partial_mask_blocks)[gi, mf], tile)
                assert np.array_equal(np.asarray(dkv.partial_mask_blocks)[gi, md], tile.T)
            rows_ok = padded[gi, h].any(-1)
            assert np.array_equal(np.asarray(info.row_valid)[gi, h], rows_ok)


def test_plans_with_different_documents_share_one_compiled_step():
    from jax import monitoring

    b, h, lq, d, block = 2, 2, 512, 16, (64, 128)
    rng = np.random.default_rng(11)
    plans, infos, masks = [], [], []
    for _ in range(5):
        ids = packed_ids(rng, b, lq, 150, pad_inside=True)
        m = causal() & document(ids)
        p = tessera.plan(m.t, q_len=lq, heads=h, block=block)
        plans.append(p)
        masks.append(m)
        infos.append(splash_info(p, max_partial_blocks=32))
    counts = {int(np.asarray(i.fwd.partial_mask_blocks).any(axis=(-1, -2)).sum()) for i in infos}
    assert len({np.asarray(i.fwd.block_mask).tobytes() for i in infos}) == 5  # different data
    assert len(counts) > 1  # and different partial-block counts
    # one tree structure and one set of array types for all five
    assert len({jax.tree_util.tree_structure(i) for i in infos}) == 1
    assert len({tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(i)) for i in infos}) == 1

    g = np.random.default_rng(3)
    q = jnp.asarray(g.standard_normal((b, h, lq, d)), jnp.float32)
    k = np.asarray(g.standard_normal((b, 1, lq, d)), np.float32)
    v = np.asarray(g.standard_normal((b, 1, lq, d)), np.float32)
    j0 = 1  # NaN in kv tile j0 of batch row 1: only the q tiles that visit it may see NaN
    k1, v1 = k.copy(), v.copy()
    k1[1, :, j0 * 128:(j0 + 1) * 128] = np.nan
    v1[1, :, j0 * 128:(j0 + 1) * 128] = np.nan
    k1, v1 = jnp.asarray(k1), jnp.asarray(v1)
    traces = []

    def loss(q, k, v, info):
        traces.append(1)
        o = splash_attention(q, k, v, info)
        return jnp.sum(o[0] ** 2), o

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        outs = [step(q, k1, v1, info) for info in infos]
        jax.block_until_ready(outs)
    finally:
        unregister_duration_listener(listener)
    assert len(traces) == 1 and step._cache_size() == 1
    assert len(compiles) == 1, compiles

    seen = set()
    for p, m, info, ((_, o), (dq, dk, dv)) in zip(plans, masks, infos, outs):
        allowed = m.dense(b, h, lq, lq)
        _check_info_marks_the_plan(info, p, allowed)
        o = np.array(o)
        # batch row 0 is exact against the reference (the step used this plan's data)
        rq, rk, rv = (_t(x[:1]).requires_grad_() for x in (np.asarray(q), k, v))
        ro, _ = ref_attention(rq, rk, rv, allowed[:1])
        (ro ** 2).sum().backward()
        assert rel(torch.from_numpy(o[:1]), ro.detach()) <= F32_TOL
        for a, r in ((dq, rq.grad), (dk, rk.grad), (dv, rv.grad)):
            assert rel(torch.from_numpy(np.asarray(a)[:1].astype(np.float64)), r) <= F32_TOL
        # batch row 1: a q tile reads the NaN tile iff its block (i, j0) is not empty
        bm = np.asarray(info.fwd.block_mask)[1, 0]
        valid = np.asarray(info.row_valid)[1, 0]
        for i in range(bm.shape[0]):
            rows = np.arange(i * 64, (i + 1) * 64)
            rows = rows[valid[rows]]
            if rows.size == 0:
                continue
            visited = bool(bm[i, j0] != 0)
            assert np.isnan(o[1, :, rows]).any() == visited, (i, bm[:, j0])
            seen.add(visited)
    assert seen == {True, False}  # both outcomes were checked


def test_info_marks_the_plan_for_every_group():
    # per-row documents, heads(...) masks and ragged lengths
    rng = np.random.default_rng(4)
    ids = packed_ids(rng, 2, 300, 80, pad_inside=True)
    cases = [
        (causal() & document(ids), 2, 300, 300, (64, 128)),
        (heads([causal(), window(30), full(), ~causal()]), 4, 200, 260, (32, 128)),
        (window(45, 7) | prefix(20), 2, 250, 250, (128, 128)),
    ]
    for m, h, lq, lkv, block in cases:
        p = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, block=block)
        info = splash_info(p)
        allowed = m.dense(p.shape[0], h, lq, lkv)
        _check_info_marks_the_plan(info, p, allowed)
        assert info.groups == (p.shape[0] if p.groups[0] > 1 else 1, h if p.groups[1] > 1 else 1)


def test_partial_block_bound():
    ids = np.repeat(np.arange(5), [40, 70, 33, 90, 23])
    p = tessera.plan(tessera.causal() & tessera.document(ids), q_len=256, block=(32, 128))
    fwd, _ = p.to_splash_mask_info(shrink_grid=False, shrink_grid_dkv=False, as_numpy=True)
    count = fwd.partial_mask_blocks.shape[0]
    assert count & (count - 1)  # not a power of two: the default bound rounds up
    info = splash_info(p)
    assert info.max_partial_blocks == 1 << (count - 1).bit_length()
    assert info.fwd.partial_mask_blocks.shape == (1, info.max_partial_blocks, 32, 128)
    assert info.dkv.partial_mask_blocks.shape == (1, info.max_partial_blocks, 128, 32)
    assert not np.asarray(info.fwd.partial_mask_blocks)[0, count:].any()
    assert splash_info(p) is info  # cached on the plan
    exact = splash_info(p, max_partial_blocks=count)
    assert exact is not info and exact.max_partial_blocks == count
    with pytest.raises(ValueError, match="max_partial_blocks"):
        splash_info(p, max_partial_blocks=count - 1)
    with pytest.raises(ValueError, match="max_partial_blocks"):
        splash_info(p, max_partial_blocks=0)
    with pytest.raises(TypeError, match="max_partial_blocks"):
        splash_info(p, max_partial_blocks=4.0)
    with pytest.raises(TypeError, match="plan"):
        splash_info("causal")
    # the dtypes come from the shapes, never from the data
    dts = [x.dtype for x in jax.tree_util.tree_leaves(info)]
    full_p = tessera.plan(tessera.full(), q_len=256, block=(32, 128))
    assert [x.dtype for x in jax.tree_util.tree_leaves(splash_info(full_p, max_partial_blocks=count + 1))] == dts


def test_bad_arguments():
    plan = tessera.plan(tessera.causal(), q_len=128, heads=2, block=(64, 128))
    info = splash_info(plan)
    q = jnp.zeros((1, 2, 128, 16), jnp.float32)
    k = v = jnp.zeros((1, 1, 128, 16), jnp.float32)
    cases = [
        (TypeError, "q", dict(q=q.astype(jnp.float16))),
        (TypeError, "k, v", dict(k=k.astype(jnp.bfloat16))),
        (ValueError, "q", dict(q=q[0])),
        (ValueError, "info", dict(q=jnp.zeros((1, 3, 128, 16)))),
        (ValueError, "info", dict(q=jnp.zeros((1, 2, 64, 16)))),
        (ValueError, "info", dict(q=jnp.zeros((2, 2, 128, 16)), k=jnp.zeros((2, 1, 128, 16)),
                                  v=jnp.zeros((2, 1, 128, 16)), info=splash_info(tessera.plan(
                                      tessera.document(np.zeros((3, 128), int)), q_len=128, block=(64, 128)))),),
        (ValueError, "k", dict(k=jnp.zeros((1, 1, 128, 8)))),
        (ValueError, "k", dict(q=jnp.zeros((1, 3, 128, 16)), k=jnp.zeros((1, 2, 128, 16)),
                               v=jnp.zeros((1, 2, 128, 16)),
                               info=splash_info(tessera.plan(tessera.causal(), q_len=128, block=(64, 128))))),
        (TypeError, "info", dict(info=plan)),
        (ValueError, "sinks", dict(sinks=jnp.zeros(3))),
        (TypeError, "sinks", dict(sinks=jnp.zeros(2, jnp.int32))),
        (ValueError, "scale", dict(scale=-1.0)),
        (ValueError, "softcap", dict(softcap=math.inf)),
        (TypeError, "scale", dict(scale=jnp.float32(0.5))),
        (ValueError, "block_sizes", dict(block_sizes=sk.BlockSizes(block_q=128, block_kv=128))),
        (TypeError, "block_sizes", dict(block_sizes=(64, 128))),
        (ValueError, "info", dict(info=splash_info(tessera.plan(tessera.causal(), q_len=128, heads=2, block=64)))),
    ]
    for exc, name, kw in cases:
        args = dict(q=q, k=k, v=v, info=info)
        args.update(kw)
        q_, k_, v_, i_ = (args.pop(n) for n in ("q", "k", "v", "info"))
        with pytest.raises(exc, match=name):
            splash_attention(q_, k_, v_, i_, **args)


def test_splash_info_is_a_pytree():
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat([0, 1], 64)), q_len=128, block=(64, 128))
    info = splash_info(plan)
    leaves, tree = jax.tree_util.tree_flatten(info)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(back, SplashInfo) and back.meta == info.meta and back.shape == (1, 1, 128, 128)
    assert all(isinstance(x, jax.Array) for x in leaves) and len(leaves) == 9
    assert "SplashInfo" in repr(info)


# -- telemetry on the Splash route (docs/semantics.md#telemetry) -----------------------------------------------------

import tessera.jax as tj  # noqa: E402
from jax_worker import _records_err  # noqa: E402  (the telemetry record comparison)




def _telemetry_cases():
    g = np.random.default_rng(5)
    ids = np.sort(g.integers(0, 4, 300))
    ids[50:70] = -1  # padding: rows with no key
    rows = np.stack([np.sort(g.integers(0, 3, 256)), np.sort(g.integers(0, 5, 256))])
    P = pytest.param
    return [
        P(tessera.causal() & tessera.document(ids), 1, 4, 2, 300, 300, 32, 16, (64, 128),
          dict(softcap=20.0, sinks=True), {}, id="doc_causal_gqa_softcap_sinks_ragged"),
        P(tessera.causal() & tessera.document(rows), 2, 2, 2, 256, 256, 32, 32, (128, 128),
          dict(sinks=False), dict(sink_tokens=2), id="per_row_documents"),
        P(tessera.window(40) | tessera.prefix(8), 1, 2, 1, 256, 384, 16, 16, (64, 128),
          dict(sinks=True, layout="blhd"), dict(sink_tokens=3), id="window_prefix_cross_blhd"),
        P(tessera.heads([tessera.causal(), tessera.window(30), tessera.full(), ~tessera.causal()]),
          1, 4, 2, 192, 256, 16, 16, (64, 128), dict(sinks=True), dict(streams=("sink",)), id="per_head_sink_stream"),
        P(tessera.causal(-20), 1, 2, 1, 130, 300, 16, 16, (64, 128), dict(sinks=True),
          dict(streams=("outlier",)), id="empty_rows_outlier_stream"),
    ]


@pytest.mark.parametrize("mask, b, hq, hkv, lq, lkv, d, dv, block, kw, tkw", _telemetry_cases())
def test_splash_route_telemetry_equals_the_ffi_route(mask, b, hq, hkv, lq, lkv, d, dv, block, kw, tkw):
    g = np.random.default_rng(1)
    layout = kw.get("layout", "bhld")
    plan = tessera.plan(mask, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)

    def arr(h, n, dd):
        shape = (b, h, n, dd) if layout == "bhld" else (b, n, h, dd)
        return jnp.asarray(g.standard_normal(shape), jnp.float32)

    q, k, v = arr(hq, lq, d), arr(hkv, lkv, d), arr(hkv, lkv, dv)
    s = jnp.asarray(g.standard_normal(hq), jnp.float32) if kw.get("sinks") else None
    ref = tj.plan_ref(plan, splash=True)
    records, outs = [], []
    for backend in ("ffi", "splash"):
        tel = tj.Telemetry(every=2, **tkw)
        f = jax.jit(lambda q, k, v, s, ref, t: tj.attention(
            q, k, v, ref, sinks=s, softcap=kw.get("softcap"), telemetry=t, layout=layout, backend=backend))
        o, summary = f(q, k, v, s, ref, tel.at(0))
        _, quiet = f(q, k, v, s, ref, tel.at(1))
        assert float(jnp.abs(quiet).max()) == 0.0  # a non-logging step: zeros
        tel.collect(0, {0: summary}, learned_sinks=s is not None)
        records.append(tel.read()[0])
        outs.append(o)
    a, b_ = np.asarray(outs[1], np.float64), np.asarray(outs[0], np.float64)
    assert np.linalg.norm(a - b_) / np.linalg.norm(b_) < F32_TOL
    assert _records_err(records[1], records[0]) < 1e-6
    assert records[1]["ranks"] == records[0]["ranks"]  # (the shared comparison leaves ranks out)


def _conds(jaxpr):
    """Every ``cond`` equation of a jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(eqn)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    out += _conds(inner)
                elif hasattr(sub, "eqns"):
                    out += _conds(sub)
    return out


def _primitives(jaxpr) -> set:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def test_a_non_logging_step_runs_no_telemetry_work_on_the_splash_route():
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(4), 64)), q_len=256, heads=2, block=128)
    ref = tj.plan_ref(plan, splash=True)
    q = jnp.zeros((1, 2, 256, 16), jnp.float32)
    tel = tj.Telemetry(every=4)
    jaxpr = jax.make_jaxpr(lambda q, ref, t: tj.attention(q, q, q, ref, telemetry=t, backend="splash"))(q, ref, tel.at(3))
    summary_shape = (2, tj.SUMMARY_COLUMNS, 2)  # the cond that gates the summary on the step
    telemetry_conds = [e for e in _conds(jaxpr.jaxpr)
                       if [tuple(v.aval.shape) for v in e.outvars] == [summary_shape]]
    assert len(telemetry_conds) == 1
    plain, logged = telemetry_conds[0].params["branches"]  # index 0: the step is not a logging one
    work = {"dot_general", "exp", "tanh", "while", "scan", "reduce_sum", "reduce_max"}
    assert not (_primitives(plain.jaxpr) & work), _primitives(plain.jaxpr)
    logged_prims = _primitives(logged.jaxpr)
    assert {"dot_general", "exp"} <= logged_prims and logged_prims & {"while", "scan"}
