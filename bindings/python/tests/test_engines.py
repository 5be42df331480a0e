"""Plans handed to other engines (FlexAttention BlockMask, JAX Splash MaskInfo) and gated
telemetry from Python."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import tessera
from _reference import dense_mask, doc_causal, ref_attention

TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def engine_cases():
    g = np.random.default_rng(21)
    ids = np.sort(g.integers(-1, 7, 300))
    ids2 = np.stack([np.sort(g.integers(0, 4, 300)), np.sort(g.integers(-1, 9, 300))])
    dense = g.random((2, 200, 260)) < 0.3
    return [
        ("causal", tessera.causal(), 1, 1, 256, 256, (64, 64)),
        ("doc_padding", tessera.causal() & tessera.document(ids), 1, 1, 300, 300, (32, 64)),
        ("doc_per_row", tessera.causal() & tessera.document(ids2), 2, 2, 300, 300, (64, 32)),
        ("window_or_prefix", tessera.window(45, 7) | tessera.prefix(20), 1, 2, 250, 250, (32, 32)),
        ("not_chunk", ~tessera.chunk(50) & tessera.causal(-3), 1, 1, 199, 199, (64, 64)),
        ("heads", tessera.heads([tessera.causal(), tessera.window(30)]), 1, 2, 160, 160, (32, 32)),
        ("dense_cross", tessera.dense(dense), 1, 2, 200, 260, (64, 128)),
    ]


# -- FlexAttention ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", engine_cases(), ids=lambda c: c[0])
def test_flex_block_mask_equals_create_block_mask_and_flex_output(case):
    torch = pytest.importorskip("torch")
    import tessera.torch as tt
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    name, m, b, h, lq, lkv, block = case
    plan = tessera.plan(m, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block)
    bm = plan.to_flex_block_mask()
    allowed = torch.from_numpy(dense_mask(m, b, h, lq, lkv))

    def mask_mod(bi, hi, qi, ki):
        return allowed[bi, hi, qi, ki]

    gb, gh = plan.groups
    ref = create_block_mask(mask_mod, gb, gh, lq, lkv, device="cpu", BLOCK_SIZE=block)
    for t in TABLES:
        a, r = getattr(bm, t), getattr(ref, t)
        assert a.dtype == r.dtype and a.shape == r.shape and torch.equal(a, r), t
        assert a.is_contiguous()
    # The generated mask_mod is right for every pair, not only inside partial blocks.
    assert torch.equal(create_mask(bm.mask_mod, b, h, lq, lkv, device="cpu"), allowed)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, 16, generator=g)
    k, v = torch.randn(b, h, lkv, 16, generator=g), torch.randn(b, h, lkv, 16, generator=g)
    with torch.no_grad():
        o_t = flex_attention(q, k, v, block_mask=bm)
        o_r = flex_attention(q, k, v, block_mask=ref)
        o_x = tt.attention(q, k, v, plan)
    rows = allowed.any(-1, keepdim=True)  # flex leaves rows with no key undefined-ish; compare the rest
    assert torch.allclose(o_t, o_r, atol=1e-6)
    assert torch.allclose(torch.where(rows, o_t, 0), torch.where(rows, o_x, 0), atol=2e-5)


def test_compiled_flex_attention_with_the_block_mask():
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import flex_attention

    ids = np.repeat(np.arange(5), 60)
    m = tessera.causal() & tessera.document(ids)
    plan = tessera.plan(m, q_len=300, heads=2, block=64)
    q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    o = torch.compile(flex_attention)(q, k, v, block_mask=plan.to_flex_block_mask())
    ro, _ = ref_attention(q, k, v, doc_causal(ids))
    assert torch.allclose(o.double(), ro, atol=1e-5)


# -- JAX Splash ------------------------------------------------------------------------------


def _splash_modules():
    pytest.importorskip("jax")
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    return sm, mi


@pytest.mark.parametrize("case", engine_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(head_shards=2, q_seq_shards=2), dict(shrink_grid=False, shrink_grid_dkv=False),
     dict(downcast_smem_data=False)],
    ids=["default", "sharded", "no_shrink", "no_downcast"],
)
def test_splash_mask_info_equals_process_mask(case, opts):
    sm, mi = _splash_modules()
    name, m, b, h, lq, lkv, block = case
    plan = tessera.plan(m, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block)
    nq, nk = -(-lq // block[0]), -(-lkv // block[1])
    if h % opts.get("head_shards", 1) or nq % opts.get("q_seq_shards", 1):
        pytest.skip("shards must divide the heads and q blocks")
    allowed = dense_mask(m, b, h, lq, lkv)
    for row in range(b):
        padded = np.zeros((h, nq * block[0], nk * block[1]), dtype=bool)
        padded[:, :lq, :lkv] = allowed[row]
        mh = sm.MultiHeadMask([sm.NumpyMask(padded[i]) for i in range(h)])
        kw = dict(head_shards=opts.get("head_shards", 1), q_seq_shards=opts.get("q_seq_shards", 1),
                  downcast_smem_data=opts.get("downcast_smem_data", True))
        want_f, _ = mi.process_mask(mh, block, shrink_grid=opts.get("shrink_grid", True), **kw)
        want_d, _ = mi.process_mask_dkv(mh, block, shrink_grid=opts.get("shrink_grid_dkv", True), **kw)
        got_f, got_d = tessera.jax.mask_info(plan, batch_row=row, as_numpy=True, **opts)
        for want, got in ((want_f, got_f), (want_d, got_d)):
            for field in ("data_next", "mask_next", "block_mask", "partial_mask_blocks", "q_sequence"):
                a, r = getattr(got, field), getattr(want, field)
                if r is None:
                    assert a is None, field
                else:
                    assert a.dtype == r.dtype and a.shape == r.shape and (a == r).all(), field


import tessera.jax  # noqa: E402  (after importorskip users above; jax is a test dependency)


def test_splash_kernel_runs_with_the_mask_info():
    sm, mi = _splash_modules()
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    ids = np.repeat(np.arange(4), 64)
    m = tessera.causal() & tessera.document(ids)
    h, lq, d = 2, 256, 64
    plan = tessera.plan(m, q_len=lq, heads=h, block=(128, 128))
    fwd, dkv = tessera.jax.mask_info(plan)
    try:
        kernel = sk.SplashAttentionKernel(
            fwd, None, None, mask_value=sk.DEFAULT_MASK_VALUE, is_mqa=False,
            block_sizes=sk.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128),
            residual_checkpoint_name=None, save_residuals=False, mask_function=None,
            attn_logits_soft_cap=None, interpret=True,
        )
        g = np.random.default_rng(0)
        q, k, v = (g.standard_normal((h, lq, d)).astype(np.float32) for _ in range(3))
        out = np.asarray(kernel(jnp.asarray(q) / np.sqrt(d), jnp.asarray(k), jnp.asarray(v)))
    except (TypeError, NotImplementedError, jax.errors.JaxRuntimeError) as e:  # API drift
        pytest.skip(f"the Splash kernel does not run here in interpret mode: {e}")
    torch = pytest.importorskip("torch")
    ro, _ = ref_attention(*(torch.from_numpy(x)[None] for x in (q, k, v)), doc_causal(ids))
    assert np.allclose(out, ro[0].numpy(), atol=2e-3)


# -- telemetry -------------------------------------------------------------------------------


def test_telemetry_gates_steps_matches_dense_values_and_keeps_outputs():
    torch = pytest.importorskip("torch")
    import tessera.torch as tt

    ids = np.repeat(np.arange(4), 32)
    m = tessera.causal() & tessera.document(ids)
    plan = tessera.plan(m, q_len=128, heads=2, block=32)
    tel = tessera.Telemetry(every=2)
    sinks = torch.tensor([0.5, -1.0])
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(1, 2, 128, 16, generator=g) for _ in range(3)] for _ in range(4)]
    for step in range(4):
        for layer in range(2):
            q, k, v = xs[step]
            logged = tt.attention(q, k, v, plan, sinks=sinks if layer else None, telemetry=tel, layer=layer)
            plain = tt.attention(q, k, v, plan, sinks=sinks if layer else None)
            assert torch.equal(logged, plain)  # a logging step changes no output bit
        tel.advance()
    recs = tel.read()
    assert [(r["step"], r["layer"]) for r in recs] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert tel.read() == []
    # Dense float64 values of step 2, layer 1 (learned sinks on).
    q, k, v = xs[2]
    allowed = doc_causal(ids)
    ro, lse = ref_attention(q, k, v, allowed, sinks=sinks)
    s = (q.double() @ k.double().transpose(-1, -2)) * 16**-0.5
    p = torch.exp(s.masked_fill(~torch.from_numpy(allowed), float("-inf")) - lse[..., None])
    sink_key = torch.from_numpy(np.r_[True, ids[1:] != ids[:-1]])  # first key of each document
    sink_mass = p[..., sink_key].sum(-1).mean(-1)[0]
    # The learned sink is one more outcome of the row's distribution (SPEC §6, telemetry docs).
    p_sink = torch.exp(sinks.double()[:, None] - lse[0])
    entropy = (-(p * torch.log(p.clamp_min(1e-300))).sum(-1))[0] - p_sink * torch.log(p_sink)
    entropy = entropy.mean(-1)
    learned = p_sink.mean(-1)
    r = recs[3]
    assert np.allclose(r["sink_mass"], sink_mass.numpy(), atol=1e-5)
    assert np.allclose(r["entropy"], entropy.numpy(), atol=1e-4)
    assert np.allclose(r["learned_sink_mass"], learned.numpy(), atol=1e-5)
    assert np.allclose(r["max_logit"], s.masked_fill(~torch.from_numpy(allowed), -np.inf).amax((-1, -2))[0].numpy(), atol=1e-4)
    assert np.allclose(r["out_abs_max"], ro.abs().amax((-1, -2))[0].numpy(), atol=1e-5)
    assert np.allclose(r["out_rms"], ro.square().mean((-1, -2)).sqrt()[0].numpy(), atol=1e-5)
    assert r["sink_rate"] == float(np.mean(np.asarray(r["sink_mass"]) > 0.3))
    assert recs[2]["learned_sink_mass"] is None


def test_telemetry_jsonl_is_readable_by_the_cli(tmp_path):
    torch = pytest.importorskip("torch")
    import tessera.torch as tt

    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    tel = tessera.Telemetry(every=1)
    for _ in range(3):
        tt.attention(*(torch.randn(1, 2, 64, 8) for _ in range(3)), plan, telemetry=tel)
        tel.advance()
    path = tmp_path / "tel.jsonl"
    assert tel.write_jsonl(path) == 3
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    cli = shutil.which("tessera") or os.path.join(os.path.dirname(__file__), "../../../target/release/tessera")
    if not os.path.exists(cli):
        pytest.skip("the tessera CLI is not built here")
    png = tmp_path / "tel.png"
    subprocess.run([cli, "telemetry", "plot", "--in", str(path), "--out", str(png), "--layer", "0"],
                   check=True, capture_output=True)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(every=-1), "every"), (dict(streams=("sinks",)), "streams"), (dict(epsilon=2.0), "epsilon"),
     (dict(outlier_ratio=float("inf")), "outlier_ratio"), (dict(sink_tokens=-1), "sink_tokens")],
)
def test_bad_telemetry_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tessera.Telemetry(**kwargs)
