"""The GPU suite (`pytest -m gpu`; every test skips without CUDA): `tessera.torch.attention` and
`tessera.cp.attention` on CUDA tensors run FlexAttention over the plan's BlockMask (docs/semantics.md#engines-and-devices).

- the conformance cases of test_torch_attention.py (masks, GQA, Dqk != Dv, softcap, sinks, a loss
  on the LSE, fully masked rows, bf16) through the flex engine against the float64 reference,
  forward and backward (FlexAttention's own GPU backward), at FlexAttention's 128-token tiles;
- the BlockMask on the GPU equals `create_block_mask`'s there;
- no host synchronization in a step (CUDA sync debug mode), five plans through one compiled
  training step with one compilation;
- block selections: plan_from_blocks on a CUDA top-k, three selections through one compiled step,
  gradients equal to the float64 reference;
- telemetry on the GPU equals the Tessera CPU kernel's;
- context parallelism: NCCL with two or more GPUs, else two ranks on one GPU exchanging over gloo;
- the training example on the GPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import packed_ids, ref_attention, rel  # noqa: E402

F32_TOL = 1e-5
BF16_TOL = 1e-2
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _ieee_f32():
    # docs/semantics.md#attention's f32 bar is for f32 arithmetic: no TF32 in FlexAttention's or the reference's matmuls
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _gpu_cases():
    from test_torch_attention import _cases

    return [pytest.param(*p.values[:8], 128, p.values[9], id=p.id) for p in _cases()]


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", _gpu_cases())
def test_conformance_cases_on_cuda_match_float64(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    dtype = kw.get("dtype", torch.float32)
    g = torch.Generator().manual_seed(kw.get("seed", 0))
    q = (torch.randn(b, hq, lq, dqk, generator=g, dtype=torch.float64) * kw.get("q_scale", 1.0)).to(dtype)
    k = torch.randn(b, hkv, lkv, dqk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lkv, dv, generator=g, dtype=torch.float64).to(dtype)
    if kw.get("layout") == "blhd":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    s = (torch.randn(hq, generator=g, dtype=torch.float64) * 2).float() if kw.get("sinks") else None
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)
    allowed = m.dense(b, hq, lq, lkv)
    leaves = [x.to(CUDA).requires_grad_() for x in (q, k, v)] + ([s.to(CUDA).requires_grad_()] if s is not None else [])
    opts = dict(scale=kw.get("scale"), softcap=kw.get("softcap"))
    o, lse = tt.attention(*leaves[:3], plan, sinks=leaves[3] if s is not None else None, return_lse=True, **opts)
    assert o.device.type == "cuda" and o.dtype == dtype and lse.dtype == torch.float32
    w = torch.randn(o.shape, generator=g, dtype=torch.float64)
    wl = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss_of(o_, l_):
        loss = (o_.double() * w.to(o_.device)).sum()
        if kw.get("lse_loss"):
            loss = loss + (torch.where(torch.isfinite(l_), l_, 0).double() * wl.to(l_.device)).sum()
        return loss

    loss_of(o, lse).backward()
    refs = [x.double().requires_grad_() for x in (q, k, v)] + ([s.double().requires_grad_()] if s is not None else [])
    ro, rlse = ref_attention(*refs[:3], allowed, sinks=refs[3] if s is not None else None, **opts)
    loss_of(ro, rlse).backward()
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel(o.cpu(), ro) <= tol, rel(o.cpu(), ro)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if fin.any():
        assert (lse.cpu()[fin].double() - rlse[fin]).abs().max() <= (1e-4 if dtype == torch.float32 else 5e-2)
    empty = torch.from_numpy(~np.broadcast_to(allowed, (b, hq, lq, lkv)).any(-1))
    assert (o.cpu()[empty] == 0).all()
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), leaves, refs):
        assert not torch.isnan(a.grad).any(), name
        t = 5e-2 if (name == "dsinks" and dtype != torch.float32) else tol
        assert rel(a.grad.cpu(), r.grad) <= t, (name, rel(a.grad.cpu(), r.grad))


def test_the_block_mask_on_the_gpu_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    ids = packed_ids(np.random.default_rng(1), 2, 1000, 300, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1000, heads=2, block=128)
    seg = torch.from_numpy(ids).to(CUDA)

    def mod(b, h, q, kv):
        return (q >= kv) & (seg[b, q] == seg[b, kv]) & (seg[b, q] >= 0)

    bm = plan.to_flex_block_mask(device=CUDA)
    ref = create_block_mask(mod, 2, 1, 1000, 1000, device=CUDA, BLOCK_SIZE=128)
    for t in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
              "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert getattr(bm, t).device.type == "cuda" and torch.equal(getattr(bm, t), getattr(ref, t)), t
    assert plan.to_flex_block_mask(device=torch.device(CUDA, torch.cuda.current_device())) is bm


def _doc_problem(seed, L=1024, B=2, H=4, HKV=2, D=64):
    ids = packed_ids(np.random.default_rng(seed), B, L, 400, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=128)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, h, L, D, generator=g).to(CUDA) for h in (H, HKV, HKV)]
    return plan, xs


def test_a_step_does_not_synchronize_with_the_host():
    plan, (q, k, v) = _doc_problem(3)
    sinks = torch.zeros(4, device=CUDA, requires_grad=True)
    tel = tessera.Telemetry(every=1)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        o, lse = tt.attention(*leaves, plan, softcap=20.0, sinks=sinks, return_lse=True, telemetry=tel)
        (o.square().mean() + torch.where(torch.isfinite(lse), lse, 0).mean()).backward()

    step()  # compiles, builds the BlockMask and sink positions (host work, once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(tel.read()) == 1  # the deferred read (two steps of layer 0 merged per step)


def test_five_plans_through_one_compiled_training_step_compile_once():
    from torch._dynamo.utils import counters

    def step(q, k, v, s, plan):
        o, lse = tt.attention(q, k, v, plan, softcap=20.0, sinks=s, return_lse=True)
        return o.square().mean() + torch.where(torch.isfinite(lse), lse, 0).mean()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    graphs = 0  # of the compiled step only (the eager comparison compiles FlexAttention itself once)
    for trial in range(5):
        plan, xs = _doc_problem(20 + trial)
        plan.to_flex_block_mask(device=CUDA)  # built before the compiled step, kept on the plan
        xs = [x.requires_grad_() for x in xs]
        s = torch.randn(4, device=CUDA, requires_grad=True)
        before = counters["stats"]["unique_graphs"]
        compiled(*xs, s, plan).backward()
        graphs += counters["stats"]["unique_graphs"] - before
        got = [x.grad.clone() for x in xs + [s]]
        for x in xs + [s]:
            x.grad = None
        step(*xs, s, plan).backward()
        for a, x in zip(got, xs + [s]):
            assert rel(a, x.grad) <= 1e-5
    assert graphs == 1, dict(counters["stats"])


def test_block_selections_from_cuda_top_k_through_one_compiled_step():
    """plan_from_blocks on a CUDA top-k (copied to the host once), three selections through one
    compiled step, each step's output and gradients equal to the float64 reference."""
    from torch._dynamo.utils import counters

    from test_plan_from_blocks import selected

    B, H, L, D, BLK, K = 1, 4, 1024, 64, 128, 3
    nb = L // BLK
    ids = np.repeat(np.arange(4), L // 4)
    mask = tessera.causal() & tessera.document(ids)

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan).square().mean()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator(device=CUDA).manual_seed(3)
    future = torch.ones(nb, nb, dtype=torch.bool, device=CUDA).triu(1)
    for _ in range(3):
        scores = torch.randn(B, H, nb, nb, generator=g, device=CUDA).masked_fill(future, float("-inf"))
        scores.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
        top = scores.topk(K, dim=-1)
        kv_tiles = torch.where(top.values > float("-inf"), top.indices, -1)
        plan = tessera.plan_from_blocks(mask, kv_tiles, q_len=L, block=BLK)
        plan.to_flex_block_mask(device=CUDA)
        xs = [torch.randn(B, H, L, D, generator=g, device=CUDA, requires_grad=True) for _ in range(3)]
        compiled(*xs, plan).backward()
        allowed = selected(kv_tiles.cpu().numpy(), B, H, L, L, BLK, BLK) & (
            (np.arange(L)[:, None] >= np.arange(L)[None]) & (ids[:, None] == ids[None]))
        refs = [x.detach().cpu().double().requires_grad_() for x in xs]
        ro, _ = ref_attention(*refs, allowed)
        ro.square().mean().backward()
        for x, r in zip(xs, refs):
            assert rel(x.grad.cpu(), r.grad) <= F32_TOL
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_telemetry_on_the_gpu_equals_the_cpu_kernels():
    ids = packed_ids(np.random.default_rng(5), 2, 512, 150, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=4, block=128)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 512, 32, generator=g) * 2
    k, v = (torch.randn(2, 2, 512, 32, generator=g) for _ in range(2))
    s = torch.randn(4, generator=g)
    tel_c, tel_g = tessera.Telemetry(every=1, sink_tokens=2), tessera.Telemetry(every=1, sink_tokens=2)
    with torch.no_grad():
        tt.attention(q, k, v, plan, softcap=5.0, sinks=s, telemetry=tel_c, layer=3)
        tt.attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), plan, softcap=5.0, sinks=s.to(CUDA), telemetry=tel_g,
                     layer=3)
    (rc,), (rg,) = tel_c.read(), tel_g.read()
    for f in ("sink_mass", "learned_sink_mass", "max_logit", "entropy", "valid_rows", "out_abs_max", "out_rms"):
        a, b = np.asarray(rc[f], dtype=float), np.asarray(rg[f], dtype=float)
        assert np.allclose(a, b, rtol=1e-5, atol=0), (f, a, b)
    assert rc["sink_rate"] == rg["sink_rate"]


def test_context_parallel_on_gpus():
    """NCCL over two or more GPUs; with one GPU, two ranks on it exchanging over gloo."""
    import test_cp_flex as cpf

    n = torch.cuda.device_count()
    world = 2
    spec = dict(cases=cpf.cases(world, seed=500, L=1024, block=128, D=16), device=CUDA,
                backend="nccl" if n >= 2 else "gloo", device_per_rank=n >= 2)
    out = cpf.launch(world, spec, timeout_s=600)
    cpf.check(world, spec, out)


def test_the_training_example_on_the_gpu(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_gpu", path)
    tg = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt_gpu"] = tg
    spec.loader.exec_module(tg)
    cfg = tg.Config(tokenizer="bytes", max_docs=40, seq_len=256, batch_size=4, layers=2, d_model=64, heads=4,
                    kv_heads=2, softcap=20.0, sinks=True, steps=6, warmup=2, telemetry_every=2, eval_every=3,
                    ckpt_every=3, progress=False, out_dir=str(tmp_path / "cpu"))
    data = tg.load_data(cfg)
    on_cpu = tg.train(cfg, data, save=False, evaluate_val=False, log=lambda *_: None)
    gcfg = tg.Config(**{**cfg.__dict__, "device": CUDA, "out_dir": str(tmp_path / "gpu")})
    on_gpu = tg.train(gcfg, data, save=True, evaluate_val=True, log=lambda *_: None)
    assert max(abs(a - b) for a, b in zip(on_cpu.losses, on_gpu.losses)) <= 1e-3, (on_cpu.losses, on_gpu.losses)
    assert (tmp_path / "gpu" / "telemetry.jsonl").exists()
    # resume from the GPU checkpoint continues the same run
    tg.train(gcfg, data, save=True, evaluate_val=False, until=3, log=lambda *_: None)
    rest = tg.train(gcfg, data, resume=tmp_path / "gpu" / "ckpt.safetensors", save=True, evaluate_val=False,
                    log=lambda *_: None)
    assert np.allclose(rest.losses, on_gpu.losses[3:], rtol=1e-4, atol=1e-6)
