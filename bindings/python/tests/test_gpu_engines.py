"""The GPU engines (`pytest -m gpu`; every test skips without CUDA): each engine that
this GPU and torch can run against the float64 reference, forward and backward; `auto`'s choice
as documented and recorded; the plan's BlockMask built on the GPU from the compact arrays equal
to `create_block_mask`'s, with no host sync; the prefetcher's BlockMasks on the GPU. An engine
that cannot run here is skipped with its reasons (pytest -rs prints them)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import TABLES, causal, document, ref_attention, rel  # noqa: E402
from tessera.engines import select as sel  # noqa: E402

BF16_TOL = 1.5e-2


def contiguous_docs(rng, rows, L):
    out = np.empty((rows, L), dtype=np.int64)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, L), size=5, replace=False))
        out[r] = np.searchsorted(cuts, np.arange(L), side="right")
    return out


def _qkv(b, hq, hkv, L, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, L, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, hkv, L, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, hkv, L, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("engine,hkv", [("flex", 2), ("flex_flash", 2), ("varlen", 2), ("varlen", 4)])
def test_each_engine_against_float64_forward_and_backward(engine, hkv, rng):
    ids = contiguous_docs(rng, 2, 1024)
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=1024, heads=4, block=128)
    q, k, v = _qkv(2, 4, hkv, 1024, 64)
    why = sel.REASONS[engine](sel.Inputs(q, k, v, plan, None, None, False, False))
    if why:
        pytest.skip(f"engine={engine!r} not available here: " + "; ".join(why))
    o = tt.attention(q, k, v, plan, engine=engine)
    assert tt.last_dispatch()["engine"] == engine
    w = torch.randn_like(o.float())
    (o.float() * w).sum().backward()
    # the float64 reference on the host, from the same bf16 inputs
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ro, _ = ref_attention(qd, kd, vd, m.dense(2, 1, 1024, 1024))
    assert rel(o.detach().cpu(), ro.detach()) <= BF16_TOL
    (ro * w.double().cpu()).sum().backward()
    for t, r in ((q, qd), (k, kd), (v, vd)):
        assert rel(t.grad.cpu(), r.grad) <= 3 * BF16_TOL


def test_sinks_through_the_chosen_engine_forward(rng):
    ids = contiguous_docs(rng, 1, 512)
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=512, heads=2, block=128)
    q, k, v = _qkv(1, 2, 2, 512, 64)
    sinks = torch.randn(2, device="cuda")
    with torch.no_grad():
        o, lse = tt.attention(q, k, v, plan, sinks=sinks, return_lse=True)
    ro, rlse = ref_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), m.dense(1, 1, 512, 512),
                             sinks=sinks.cpu())
    assert rel(o.cpu(), ro) <= BF16_TOL
    assert (lse.double().cpu() - rlse).abs().max() <= 0.05
    rec = tt.last_dispatch()
    assert rec["engine"] in ("flex_flash", "varlen", "flex"), rec


def test_auto_records_its_choice_and_the_reasons(rng):
    ids = contiguous_docs(rng, 1, 512)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=2, block=128)
    q, k, v = _qkv(1, 2, 2, 512, 64)
    want = None
    for name in sel.GPU_PRIORITY:
        if not sel.REASONS[name](sel.Inputs(q, k, v, plan, None, None, False, False)):
            want = name
            break
    with torch.no_grad():
        tt.attention(q, k, v, plan)
    rec = tt.last_dispatch()
    assert rec["engine"] == want and set(rec["skipped"]) == set(sel.GPU_PRIORITY[: sel.GPU_PRIORITY.index(want)])
    print("auto on this GPU:", rec)


@pytest.mark.parametrize("mask_mod", ["analytic", "bits"])
def test_device_block_mask_from_compact_arrays_equals_create_block_mask(mask_mod, rng):
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    ids = np.sort(rng.integers(-1, 9, 2000))
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=2000, block=128, cache=False)
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the build raises
    try:
        bm = plan.to_flex_block_mask(device="cuda", mask_mod=mask_mod)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    allowed = torch.from_numpy(m.dense(1, 1, 2000, 2000)).cuda()
    ref = create_block_mask(lambda b, h, q, kv: allowed[0, 0, q, kv], 1, 1, 2000, 2000, device="cuda", BLOCK_SIZE=128)
    for t in TABLES:
        assert torch.equal(getattr(bm, t), getattr(ref, t)), t
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, 2000, 2000, device="cuda"), allowed[:, :])


def test_prefetched_block_masks_on_the_gpu(rng):
    batches = [contiguous_docs(rng, 2, 1024) for _ in range(4)]

    def make(ids):
        return tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, block=128)

    for ids, plan in tt.PlanPrefetcher(batches, make, device="cuda"):
        key = str(torch.device("cuda", torch.cuda.current_device()))
        bm = plan._flex["bm"][key]
        host = tessera.plan((causal() & document(ids)).t, q_len=1024, block=128, cache=False).to_flex_block_mask()
        for t in TABLES:
            assert torch.equal(getattr(bm, t).cpu(), getattr(host, t)), t


def test_five_document_plans_through_one_compiled_step_with_auto(rng):
    """``auto`` inside ``torch.compile(fullgraph=True)``: what selection reads is kept on the plan
    by ``to_flex_block_mask`` (small values), so five plans of the same shapes and kind share one
    graph, with the engine auto picks here; gradients equal the eager step's."""
    from torch._dynamo.utils import counters

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan).float().square().mean()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    graphs, engines = 0, set()
    for trial in range(5):
        ids = contiguous_docs(rng, 1, 1024)
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, heads=2, block=128)
        plan.to_flex_block_mask(device="cuda")
        xs = list(_qkv(1, 2, 2, 1024, 64, seed=trial))
        before = counters["stats"]["unique_graphs"]
        compiled(*xs, plan).backward()
        graphs += counters["stats"]["unique_graphs"] - before
        engines.add(tt.last_dispatch()["engine"])
        got = [x.grad.clone() for x in xs]
        for x in xs:
            x.grad = None
        step(*xs, plan).backward()
        for a, x in zip(got, xs):
            assert rel(a.float(), x.grad.float()) <= 2e-2
    print("engines inside the compiled step:", engines)
    assert graphs == 1, dict(counters["stats"])
