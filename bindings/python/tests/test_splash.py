"""`tessera.jax.mask_info(plan)` against JAX Splash's own preprocessing (docs/semantics.md#many-ranks): every field of
the forward and dKV `MaskInfo` equal to `process_mask` / `process_mask_dkv` of
`MultiHeadMask([NumpyMask(...)])` under every option, and the Splash kernel (Pallas interpret
mode on CPU) run with Tessera's `MaskInfo` against the float64 reference."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
sm = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask")
mi = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info")

import tessera  # noqa: E402
import tessera.jax as tj  # noqa: E402
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
    window,
)


def _cases():
    g = np.random.default_rng(21)
    ids = np.sort(g.integers(-1, 7, 300))
    ids_rows = packed_ids(g, 2, 256, 70, pad_inside=True)
    P = pytest.param
    return [
        P(causal(), 1, 2, 256, 256, (64, 64), id="causal"),
        P(causal() & document(ids), 1, 2, 300, 300, (32, 64), id="doc_padding_ragged"),
        P(causal() & document(ids_rows), 2, 2, 256, 256, (64, 32), id="doc_per_row"),
        P(window(45, 7) | prefix(20), 1, 4, 250, 250, (32, 32), id="window_or_prefix"),
        P(~chunk(50) & causal(-3), 1, 2, 199, 199, (64, 64), id="not_chunk"),
        P(chunk(64) & causal(), 1, 2, 256, 256, (32, 32), id="chunked_causal"),
        P(heads([causal(), window(30), full(), ~causal()]), 1, 4, 160, 160, (32, 32), id="heads"),
        P(dense(g.random((2, 200, 260)) < 0.3), 1, 2, 200, 260, (64, 128), id="dense_cross"),
        P(causal(40), 1, 2, 130, 300, (32, 64), id="causal_offset_cross"),
        P(heads([causal(), ~full()]), 1, 2, 128, 128, (32, 32), id="heads_with_an_empty_head"),
    ]


OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param(dict(head_shards=2), id="head_shards"),
    pytest.param(dict(q_seq_shards=2), id="q_seq_shards"),
    pytest.param(dict(head_shards=2, q_seq_shards=2), id="both_shards"),
    pytest.param(dict(shrink_grid=False, shrink_grid_dkv=False), id="no_shrink"),
    pytest.param(dict(shrink_grid=True, shrink_grid_dkv=False), id="fused_bwd"),
    pytest.param(dict(downcast_smem_data=False), id="no_downcast"),
]


def _process(allowed_row, block, opts, lq, lkv):
    """Splash's own MaskInfos for one batch row ``allowed_row`` bool [H, Lq, Lkv] (padded with
    False to whole blocks, as Splash requires)."""
    h = allowed_row.shape[0]
    nq, nk = -(-lq // block[0]), -(-lkv // block[1])
    padded = np.zeros((h, nq * block[0], nk * block[1]), dtype=bool)
    padded[:, :lq, :lkv] = allowed_row
    mh = sm.MultiHeadMask([sm.NumpyMask(padded[i]) for i in range(h)])
    kw = dict(head_shards=opts.get("head_shards", 1), q_seq_shards=opts.get("q_seq_shards", 1),
              downcast_smem_data=opts.get("downcast_smem_data", True))
    fwd, _ = mi.process_mask(mh, block, shrink_grid=opts.get("shrink_grid", True), **kw)
    dkv, _ = mi.process_mask_dkv(mh, block, shrink_grid=opts.get("shrink_grid_dkv", True), **kw)
    return fwd, dkv


def _equal_infos(got, want, tag):
    assert type(got) is type(want), tag
    for field in want._fields:
        a, r = getattr(got, field), getattr(want, field)
        if r is None or isinstance(r, (bool, int)):
            assert a == r, (tag, field, a, r)
            continue
        a, r = np.asarray(a), np.asarray(r)
        assert a.dtype == r.dtype, (tag, field, a.dtype, r.dtype)
        assert a.shape == r.shape, (tag, field, a.shape, r.shape)
        assert np.array_equal(a, r), (tag, field)


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("m, b, h, lq, lkv, block", _cases())
def test_mask_info_equals_process_mask(m, b, h, lq, lkv, block, opts):
    nq = -(-lq // block[0])
    if h % opts.get("head_shards", 1) or nq % opts.get("q_seq_shards", 1):
        pytest.skip("Splash needs the shards to divide the heads and the q blocks")
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block)
    allowed = m.dense(b, h, lq, lkv)
    for row in range(b):
        want_f, want_d = _process(allowed[row], block, opts, lq, lkv)
        got_f, got_d = tj.mask_info(plan, batch_row=row, as_numpy=True, **opts)
        _equal_infos(got_f, want_f, f"fwd row {row}")
        _equal_infos(got_d, want_d, f"dkv row {row}")
        for field in ("data_next", "mask_next", "block_mask", "partial_mask_blocks"):
            x = getattr(got_f, field)
            assert x is None or isinstance(x, np.ndarray), field
    # the default form holds jax arrays with the same contents
    jf, jd = plan.to_splash_mask_info(batch_row=b - 1, **opts)
    nf, nd = tj.mask_info(plan, batch_row=b - 1, as_numpy=True, **opts)
    for a_info, n_info in ((jf, nf), (jd, nd)):
        for field in ("data_next", "mask_next", "block_mask", "partial_mask_blocks"):
            a, n = getattr(a_info, field), getattr(n_info, field)
            assert (a is None) == (n is None), field
            if a is not None:
                assert isinstance(a, jax.Array) and a.dtype == n.dtype and np.array_equal(np.asarray(a), n)


@pytest.mark.parametrize("seed", range(3))
def test_random_masks_mask_info_equals_process_mask(seed):
    r = np.random.default_rng(700 + seed)
    for _ in range(2):
        lq = int(r.integers(1, 160))
        lkv = lq if r.random() < 0.5 else int(r.integers(1, 160))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 3))
        block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
        m = random_mask(r, lq, lkv, b, h, depth=2)
        plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block, cache=False)
        allowed = m.dense(b, h, lq, lkv)
        for row in range(b):
            want_f, want_d = _process(allowed[row], block, {}, lq, lkv)
            got_f, got_d = tj.mask_info(plan, batch_row=row, as_numpy=True)
            _equal_infos(got_f, want_f, f"fwd {m.t}")
            _equal_infos(got_d, want_d, f"dkv {m.t}")


def test_a_mask_with_no_active_block():
    # Splash's process_mask asserts (AssertionError) on such a mask with shrink_grid; Tessera says
    # why instead, and without shrinking both give the same all-empty infos
    plan = tessera.plan(~tessera.full(), q_len=64, heads=2, block=32)
    with pytest.raises((NotImplementedError, ValueError), match="shrink_grid"):
        tj.mask_info(plan, as_numpy=True)
    opts = dict(shrink_grid=False, shrink_grid_dkv=False)
    want_f, want_d = _process(np.zeros((2, 64, 64), bool), (32, 32), opts, 64, 64)
    got_f, got_d = tj.mask_info(plan, as_numpy=True, **opts)
    _equal_infos(got_f, want_f, "fwd")
    _equal_infos(got_d, want_d, "dkv")
    # the same for one q shard without an active block (padding at the tail)
    ids = np.r_[np.zeros(64, dtype=int), -np.ones(64, dtype=int)]
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=128, block=32)
    with pytest.raises((NotImplementedError, ValueError), match="shrink_grid"):
        tj.mask_info(plan, q_seq_shards=2)
    allowed = (causal() & document(ids)).dense(1, 1, 128, 128)[0]
    opts = dict(q_seq_shards=2, shrink_grid=False, shrink_grid_dkv=False)
    want_f, want_d = _process(allowed, (32, 32), opts, 128, 128)
    got_f, got_d = tj.mask_info(plan, as_numpy=True, **opts)
    _equal_infos(got_f, want_f, "fwd sharded")
    _equal_infos(got_d, want_d, "dkv sharded")


def test_a_uniform_plan_gives_every_batch_row_the_same_infos():
    plan = tessera.plan(tessera.window(40) | tessera.prefix(5), q_len=200, heads=2, batch=3, block=(32, 64))
    assert plan.groups == (1, 1)
    want_f, want_d = _process((window(40) | prefix(5)).dense(1, 2, 200, 200)[0], (32, 64), {}, 200, 200)
    for row in range(3):
        got_f, got_d = tj.mask_info(plan, batch_row=row, as_numpy=True)
        _equal_infos(got_f, want_f, f"fwd row {row}")
        _equal_infos(got_d, want_d, f"dkv row {row}")


def test_mask_info_bad_arguments():
    plan = tessera.plan(tessera.causal() & tessera.document(np.zeros((2, 64), dtype=int)), q_len=64, block=32)
    with pytest.raises(ValueError, match="batch_row"):
        tj.mask_info(plan, batch_row=2)
    with pytest.raises(ValueError, match="batch_row"):
        tj.mask_info(plan, batch_row=-1)
    with pytest.raises(TypeError, match="plan"):
        tj.mask_info("causal")
    three = tessera.plan(tessera.causal(), q_len=64, heads=3, block=32)
    with pytest.raises(ValueError, match="head_shards"):
        tj.mask_info(three, head_shards=2)
    with pytest.raises(ValueError, match="head_shards"):
        tj.mask_info(three, head_shards=0)
    with pytest.raises(ValueError, match="q_seq_shards"):
        tj.mask_info(three, q_seq_shards=3)


def test_mask_info_negative_shards_name_the_argument():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    with pytest.raises(ValueError, match="head_shards"):
        tj.mask_info(plan, head_shards=-1)


def _splash_kernel(fwd, dq, dkv, block):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    tq, tk = block
    bs = sk.BlockSizes(block_q=tq, block_kv=tk, block_kv_compute=tk, block_q_dkv=tq, block_kv_dkv=tk,
                       block_kv_dkv_compute=tk, block_q_dq=tq, block_kv_dq=tk)
    return sk.SplashAttentionKernel(
        fwd, dq, dkv, mask_value=sk.DEFAULT_MASK_VALUE, is_mqa=False, block_sizes=bs,
        residual_checkpoint_name=None, save_residuals=False, mask_function=None,
        attn_logits_soft_cap=None, interpret=True,
    )


def test_splash_kernel_runs_with_tessera_mask_info_forward_and_backward():
    import jax.numpy as jnp

    torch = pytest.importorskip("torch")
    from conftest import ref_attention

    ids = np.repeat(np.arange(4), 64)
    ids[200:] = 3
    m = causal() & document(ids) | (prefix(3) & causal())
    h, lq, d, block = 2, 256, 32, (128, 128)
    plan = tessera.plan(m.t, q_len=lq, heads=h, block=block)
    fwd, dkv = tj.mask_info(plan)
    g = np.random.default_rng(0)
    q, k, v = (g.standard_normal((h, lq, d)).astype(np.float32) for _ in range(3))
    ct = g.standard_normal((h, lq, d)).astype(np.float32)
    try:
        kernel = _splash_kernel(fwd, fwd, dkv, block)
        args = (jnp.asarray(q) / np.sqrt(d), jnp.asarray(k), jnp.asarray(v))
        out = np.asarray(kernel(*args))
        grads = jax.grad(lambda *a: jnp.sum(kernel(*a) * ct), argnums=(0, 1, 2))(*args)
    except (TypeError, NotImplementedError, ValueError, jax.errors.JaxRuntimeError) as e:
        pytest.skip(f"the Splash kernel API does not run here in interpret mode on CPU: {e!r}")
    tq, tk, tv = (torch.from_numpy(x)[None].double().requires_grad_() for x in (q, k, v))
    ro, _ = ref_attention(tq, tk, tv, m.dense(1, h, lq, lq))
    ro.backward(torch.from_numpy(ct)[None].double())
    err = np.linalg.norm(out - ro[0].detach().numpy()) / np.linalg.norm(ro[0].detach().numpy())
    assert err <= 1e-4, err
    want = (tq.grad[0] * np.sqrt(d), tk.grad[0], tv.grad[0])  # q was pre-scaled for Splash
    for name, a, r in zip(("dq", "dk", "dv"), grads, want):
        a, r = np.asarray(a), r.numpy()
        assert np.linalg.norm(a - r) / np.linalg.norm(r) <= 1e-4, name


@pytest.mark.parametrize("mode", ["allgather", "needed"])
def test_a_ranks_local_plan_gives_splash_the_permuted_mask(mode):
    """Context parallelism under shard_map: rank r's local plan (its rows against the K/V it
    receives, in sharded order) as MaskInfo equals Splash's own preprocessing of that permuted
    dense mask, with Splash's sequence and head sharding on top."""
    import tessera.cp

    rng = np.random.default_rng(7)
    L, H, block = 512, 2, (64, 64)
    ids = packed_ids(rng, 1, L, 150)[0]
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=L, heads=H, block=block)
    sh = tessera.cp.shard(plan, 2, "balanced")
    allowed = m.dense(1, H, L, L)[0]
    for rank in range(2):
        lp = sh.local_plan(rank, mode)
        rows = sh.positions(rank)
        cols = (sh.local_kv_tiles(rank, mode)[:, None] * 64 + np.arange(64)).reshape(-1)
        local = np.broadcast_to(allowed, (H, L, L))[:, rows][:, :, cols]
        opts = dict(q_seq_shards=2, head_shards=2)
        want_f, want_d = _process(local, block, opts, len(rows), len(cols))
        got_f, got_d = tj.mask_info(lp, as_numpy=True, **opts)
        _equal_infos(got_f, want_f, f"fwd rank {rank}")
        _equal_infos(got_d, want_d, f"dkv rank {rank}")
