"""The FlexAttention engine of `tessera.torch.attention` (`engine="flex"`, docs/semantics.md#engines-and-devices) on CPU.

FlexAttention runs its CPU path here (forward only), so the engine's forward is checked with
FlexAttention itself, and everything around FlexAttention's backward (softcap, sinks from the
LSE, the LSE's gradient, GQA) with `_flex.reference_kernel` standing in for its GPU kernels,
chosen explicitly with `_flex.use_kernel`: the conformance cases of test_torch_attention.py
against the float64 reference and against `engine="tessera"`; engine selection and errors; the
BlockMask kept per (plan, device); five plans through one `torch.compile(fullgraph=True)` step
with one compilation (FlexAttention's compiled CPU kernel); no graph break with sinks, LSE and
telemetry; telemetry equal to the Tessera kernel's on packed documents with learned sinks; the
training example on the flex engine."""

import contextlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

import tessera  # noqa: E402
import tessera.cp  # noqa: E402
import tessera.torch as tt  # noqa: E402
from tessera.core.plans import _kv_positions, _runs  # noqa: E402
from tessera.engines import flex as _flex  # noqa: E402
from conftest import causal, document, packed_ids, prefix, ref_attention, rel, window  # noqa: E402
from test_torch_attention import _cases as attention_cases  # noqa: E402
from test_torch_attention import _make  # noqa: E402

F32_TOL = 1e-5
LSE_TOL = 1e-4
BF16_TOL = 1e-2


def _loss(o, lse, w, wl, lse_loss):
    loss = (o.double() * w).sum()
    if lse_loss:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * wl).sum()
    return loss


def flex_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, *, softcap=None, sinks=False, scale=None,
              lse_loss=False, layout="contiguous", dtype=torch.float32, seed=0, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = _make((b, hq, lq, dqk), g, dtype, layout, q_scale).detach()
    k = _make((b, hkv, lkv, dqk), g, dtype, layout).detach()
    v = _make((b, hkv, lkv, dv), g, dtype, layout).detach()
    s = (torch.randn(hq, generator=g, dtype=torch.float64) * 2).float() if sinks else None
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)
    allowed = m.dense(b, hq, lq, lkv)
    kw = dict(scale=scale, softcap=softcap, sinks=s, return_lse=True)
    ro, rlse = ref_attention(q, k, v, allowed, scale=scale, softcap=softcap, sinks=s)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL

    # FlexAttention itself (its CPU path), forward
    with torch.no_grad():
        o, lse = tt.attention(q, k, v, plan, engine="flex", **kw)
        ot, _ = tt.attention(q, k, v, plan, engine="tessera", **kw)
    assert o.shape == (b, hq, lq, dv) and o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, ro) <= tol, ("o", rel(o, ro))
    assert rel(o, ot) <= (tol if dtype == torch.float32 else 2 * tol), ("o vs tessera", rel(o, ot))
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin].double() - rlse[fin]).abs().max() <= (LSE_TOL if dtype == torch.float32 else 5e-2)
    empty = torch.from_numpy(~np.broadcast_to(allowed, (b, hq, lq, lkv)).any(-1))
    assert (o[empty] == 0).all()  # docs/semantics.md#attention: a row with no allowed key gives O = 0
    if sinks:
        assert torch.allclose(lse[empty], s.expand(b, lq, hq).permute(0, 2, 1)[empty])
    else:
        assert (lse[empty] == -math.inf).all()

    # the code around FlexAttention's backward, with its dense math standing in for its kernels
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([s.clone().requires_grad_()] if sinks else [])
    with _flex.use_kernel(_flex.reference_kernel):
        o2, l2 = tt.attention(*leaves[:3], plan, engine="flex", **dict(kw, sinks=leaves[3] if sinks else None))
    w = torch.randn(o2.shape, generator=g, dtype=torch.float64)
    wl = torch.randn(l2.shape, generator=g, dtype=torch.float64)
    _loss(o2, l2, w, wl, lse_loss).backward()
    refs = [x.double().requires_grad_() for x in (q, k, v)] + ([s.double().requires_grad_()] if sinks else [])
    ro2, rl2 = ref_attention(*refs[:3], allowed, scale=scale, softcap=softcap, sinks=refs[3] if sinks else None)
    _loss(ro2, rl2, w, wl, lse_loss).backward()
    assert rel(o2, ro) <= tol
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), leaves, refs):
        assert a.grad is not None and not torch.isnan(a.grad).any(), name
        t = 5e-2 if (name == "dsinks" and dtype != torch.float32) else tol
        assert rel(a.grad, r.grad) <= t, (name, rel(a.grad, r.grad))
    return plan


# Run by default (each new shape costs FlexAttention's CPU path a trace): between them softcap,
# sinks, a loss on the LSE, GQA/MQA, Dqk != Dv, ragged and cross lengths, fully masked rows, per-head
# and dense masks, strided views, bf16. The rest of the conformance cases run with -m slow.
DEFAULT_CASES = {
    "doc_padding_gqa8to2_softcap_sinks_lse",
    "window_mqa_dqk_ne_dv_ragged",
    "prefix_or_causal_cross",
    "heads_gqa",
    "dense_batch_heads_cross",
    "doc_cross_attention",
    "empty_rows_sinks",
    "large_logits_softcap",
    "doc_strided_bf16_softcap",
}


def _conformance(default: bool):
    out = []
    for p in attention_cases():
        if (p.id in DEFAULT_CASES) == default:
            out.append(p if default else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", _conformance(True) + _conformance(False))
def test_conformance_cases_match_float64_and_the_tessera_engine(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    flex_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


def test_float16_runs_on_the_flex_engine_only():
    ids = packed_ids(np.random.default_rng(2), 1, 96, 40)
    m = causal() & document(ids)
    plan = tessera.plan(m.t, q_len=96, heads=2, block=32)
    q, k, v = (torch.randn(1, 2, 96, 16).half() for _ in range(3))
    s = torch.randn(2)
    with torch.no_grad():
        o, lse = tt.attention(q, k, v, plan, engine="flex", sinks=s, softcap=4.0, return_lse=True)
    ro, rlse = ref_attention(q, k, v, m.dense(1, 2, 96, 96), sinks=s, softcap=4.0)
    assert o.dtype == torch.float16 and rel(o, ro) <= 5e-3
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tt.attention(q, k, v, plan, engine="tessera")


@pytest.mark.slow
@pytest.mark.parametrize("m, b, hq, hkv, lq, lkv, dqk, dv, block, kw", attention_cases())
def test_conformance_cases_through_compiled_flex_on_cpu(m, b, hq, hkv, lq, lkv, dqk, dv, block, kw):
    """FlexAttention's compiled CPU kernel (inside torch.compile(fullgraph=True)) on every
    conformance mask; it returns no LSE, so the cases run without sinks (O only)."""
    dtype = kw.get("dtype", torch.float32)
    g = torch.Generator().manual_seed(kw.get("seed", 0))
    q = _make((b, hq, lq, dqk), g, dtype, kw.get("layout", "contiguous"), kw.get("q_scale", 1.0)).detach()
    k = _make((b, hkv, lkv, dqk), g, dtype, kw.get("layout", "contiguous")).detach()
    v = _make((b, hkv, lkv, dv), g, dtype, kw.get("layout", "contiguous")).detach()
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=hq, batch=b, block=block)
    plan.to_flex_block_mask()
    opts = dict(scale=kw.get("scale"), softcap=kw.get("softcap"))

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan, engine="flex", **opts)

    torch._dynamo.reset()
    with torch.no_grad():
        o = torch.compile(step, fullgraph=True, dynamic=False)(q, k, v, plan)
        ot = tt.attention(q, k, v, plan, engine="tessera", **opts)
    ro, _ = ref_attention(q, k, v, m.dense(b, hq, lq, lkv), **opts)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel(o, ro) <= tol and rel(o, ot) <= (tol if dtype == torch.float32 else 2 * tol)
    assert not torch.isnan(o).any()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_masks_on_the_flex_engine(seed):
    from conftest import random_mask

    r = np.random.default_rng(700 + seed)
    lq = int(r.integers(1, 140))
    lkv = lq if seed % 2 else int(r.integers(1, 140))
    b, hkv = int(r.integers(1, 3)), int(r.integers(1, 3))
    hq = hkv * int(r.integers(1, 3))
    m = random_mask(r, lq, lkv, b, hq, depth=2)
    block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
    flex_case(m, b, hq, hkv, lq, lkv, int(r.choice([8, 16, 40])), int(r.choice([8, 24])), block,
              softcap=[None, 4.0][seed % 2], sinks=seed % 3 == 0, lse_loss=seed % 2 == 0, seed=seed)


# -- engines, errors, the kept BlockMask --------------------------------------------------------------


class Counting:
    """A stand-in kernel that counts its calls."""

    def __init__(self, inner=_flex.reference_kernel):
        self.inner, self.calls = inner, 0
        self.has_max_scores = getattr(inner, "has_max_scores", False)

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.inner(*a, **kw)


def test_engine_selection_and_errors():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    counting = Counting()
    with _flex.use_kernel(counting):
        auto = tt.attention(q, k, v, plan)  # CPU tensors: Tessera's kernels
        assert counting.calls == 0
        assert torch.equal(auto, tt.attention(q, k, v, plan, engine="tessera"))
        flex = tt.attention(q, k, v, plan, engine="flex")
        assert counting.calls == 1 and rel(flex, auto) <= 1e-5
    assert _flex.engine_for("auto", q) == "tessera"
    assert _flex.engine_for("auto", q.to("meta")) == "flex"
    with pytest.raises(ValueError, match="engine"):
        tt.attention(q, k, v, plan, engine="triton")
    # FlexAttention has no CPU backward: a clear error, never a silent fallback
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="no CPU backward"):
        tt.attention(qg, k, v, plan, engine="flex")
    with torch.no_grad():
        tt.attention(qg, k, v, plan, engine="flex")
    # sink logits alone may require grad: their gradient needs only O and the LSE
    s = torch.randn(2, requires_grad=True)
    tt.attention(q, k, v, plan, engine="flex", sinks=s).sum().backward()
    s2 = s.detach().clone().requires_grad_()
    tt.attention(q, k, v, plan, engine="tessera", sinks=s2).sum().backward()
    assert rel(s.grad, s2.grad) <= 1e-5
    # the same argument checks as the Tessera engine
    with pytest.raises(ValueError, match="share a device"):
        tt.attention(q, k.to("meta"), v, plan, engine="flex")
    with pytest.raises(ValueError, match="sinks"):
        tt.attention(q, k, v, plan, engine="flex", sinks=torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="sinks"):
        tt.attention(q, k, v, plan, engine="flex", sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="plan"):
        tt.attention(q[:, :, :32], k, v, plan, engine="flex")
    with pytest.raises(ValueError, match="softcap"):
        tt.attention(q, k, v, plan, engine="flex", softcap=0.0)
    with pytest.raises(TypeError, match="k, v"):
        tt.attention(q, k.bfloat16(), v, plan, engine="flex")
    with pytest.raises(ValueError, match="GQA"):
        tt.attention(torch.randn(1, 3, 64, 16), k, v,
                     tessera.plan(tessera.causal(), q_len=64, heads=3, block=32), engine="flex")


def test_the_block_mask_is_built_once_per_plan_and_device():
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(3), 40)), q_len=120, block=32)
    bm = plan.to_flex_block_mask()
    assert plan.to_flex_block_mask("cpu") is bm and _flex.block_mask(plan, torch.device("cpu")) is bm
    meta = plan.to_flex_block_mask(device="meta")
    assert meta is not bm and meta.kv_num_blocks.device.type == "meta"
    q, k, v = (torch.randn(1, 1, 120, 16) for _ in range(3))
    with torch.no_grad():
        tt.attention(q, k, v, plan, engine="flex")
    assert plan.to_flex_block_mask() is bm
    # a fresh plan object builds its own
    again = tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(3), 40)), q_len=120, block=32)
    assert again.to_flex_block_mask() is not bm
    assert torch.equal(again.to_flex_block_mask().kv_indices, bm.kv_indices)


def _doc_plan(seed, L=256, H=4, block=64):
    ids = np.sort(np.random.default_rng(seed).integers(-1, 6, L))  # padding, then documents
    m = causal() & document(ids)
    return m, tessera.plan(m.t, q_len=L, heads=H, block=block)


@pytest.mark.parametrize("case", ["heads_gqa", "single_key", "dense_batch_heads_cross"])
def test_head_dims_below_the_gpu_kernels_minimum_are_padded_exactly(case, monkeypatch):
    """FlexAttention's GPU kernels refuse head dims below 16; the engine zero-pads them there. The
    padding runs here on CPU (the minimum forced to 16) through FlexAttention's CPU forward and,
    with its dense math standing in, the backward: both still equal the float64 reference."""
    monkeypatch.setattr(_flex, "_min_head_dim", lambda device: 16)
    (p,) = [p for p in attention_cases() if p.id == case]
    m, b, hq, hkv, lq, lkv, dqk, dv, block, kw = p.values
    assert min(dqk, dv) < 16
    flex_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)


def test_block_mask_on_another_device_holds_the_same_tables():
    """The non-CPU build (one copy of the tables, then views) gives the CPU build's tables; the
    meta device runs that branch without a GPU (values are checked on GPUs by test_gpu.py)."""
    ids = packed_ids(np.random.default_rng(7), 2, 1000, 300, pad_inside=True)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1000, kv_len=1000, heads=3,
                        block=(64, 128))
    cpu, meta = plan.to_flex_block_mask(), plan.to_flex_block_mask(device="meta")
    assert meta is plan.to_flex_block_mask(device="meta") and meta is not cpu
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(cpu, name), getattr(meta, name)
        assert b.device.type == "meta" and b.is_contiguous(), name
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
    cells = [c.cell_contents for c in meta.mask_mod.__closure__]
    assert all(t.device.type == "meta" for t in cells if isinstance(t, torch.Tensor))


def test_plans_of_equal_shapes_capture_equal_partial_tables():
    """The mask_mod's captured partial-block table has a capacity set by the shapes for the usual
    masks, so a compiled step does not recompile when a new plan has a few more or fewer partial
    blocks (five packed-document plans whose partial counts straddle a power of two; on an H200
    with the old capacity they compiled four graphs)."""
    shapes, counts = set(), set()
    for seed in range(20, 25):
        ids = packed_ids(np.random.default_rng(seed), 2, 1024, 400, pad_inside=True)
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, heads=4, block=128)
        counts.add(plan._p._flex_arrays(packed=True)["mask_bits"].shape[0])
        cells = [c.cell_contents for c in plan.to_flex_block_mask().mask_mod.__closure__]
        shapes.add(tuple(tuple(t.shape) for t in cells if isinstance(t, torch.Tensor)))
    assert len(counts) > 1 and min(counts) <= 16 < max(counts)  # the old capacity differed here
    assert len(shapes) == 1, shapes


def test_five_plans_through_one_compiled_step_compile_once():
    """FlexAttention's compiled CPU kernel inside the caller's torch.compile(fullgraph=True): the
    plan's BlockMask reaches the graph as data (tensors kept on the plan), so new plans of the
    same shapes reuse the graph. The compiled CPU kernel returns no LSE: no sinks here."""
    from torch._dynamo.utils import counters

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan, engine="flex", softcap=4.0)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        m, plan = _doc_plan(50 + trial)
        plan.to_flex_block_mask()  # built on the host before the compiled step (kept on the plan)
        q = torch.randn(2, 4, 256, 32, generator=g)
        k = torch.randn(2, 2, 256, 32, generator=g)
        v = torch.randn(2, 2, 256, 16, generator=g)
        with torch.no_grad():
            o = compiled(q, k, v, plan)
            ot = tt.attention(q, k, v, plan, engine="tessera", softcap=4.0)
        ro, _ = ref_attention(q, k, v, m.dense(1, 1, 256, 256), softcap=4.0)
        assert rel(o, ro) <= F32_TOL and rel(o, ot) <= F32_TOL, trial
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # a plan whose BlockMask was never built cannot be built inside the compiled step: the error
    # says what to do
    _, cold = _doc_plan(99)
    with pytest.raises(Exception, match="to_flex_block_mask"):
        with torch.no_grad():
            compiled(q, k, v, cold)


def test_sinks_lse_and_telemetry_trace_without_graph_breaks():
    """No host read in the step: sinks stay tensors, and the whole flex path (sinks from the LSE,
    the returned LSE, a logging step's telemetry) traces into one graph."""
    m, plan = _doc_plan(7, L=128, block=32)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 128, 16, generator=g)
    k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(2))
    s = torch.randn(4, generator=g)
    tel_e, tel_c = tessera.Telemetry(every=1), tessera.Telemetry(every=1)

    def step(q, k, v, s, plan, tel):
        o, lse = tt.attention(q, k, v, plan, engine="flex", softcap=3.0, sinks=s, return_lse=True,
                              telemetry=tel, layer=2)
        return o, lse

    with torch.no_grad():
        oe, le = step(q, k, v, s, plan, tel_e)  # eager: builds the BlockMask and sink positions
        torch._dynamo.reset()
        oc, lc = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, s, plan, tel_c)
    assert rel(oc, oe) <= 1e-6 and torch.allclose(lc, le, rtol=1e-6, atol=1e-6)
    (re,), (rc,) = tel_e.read(), tel_c.read()
    for f in ("sink_mass", "learned_sink_mass", "entropy", "max_logit", "out_rms"):
        assert np.allclose(re[f], rc[f], rtol=1e-6), f


# -- telemetry ----------------------------------------------------------------------------------------

FIELDS = ("sink_mass", "learned_sink_mass", "max_logit", "entropy", "valid_rows", "out_abs_max", "out_rms",
          "out_outliers")


def _close(a, b, f, tol=1e-5):
    if a is None or b is None:
        assert a is None and b is None, f
        return
    if isinstance(a, list):
        assert len(a) == len(b), f
        for x, y in zip(a, b):
            _close(x, y, f, tol)
        return
    assert abs(a - b) <= tol * max(abs(a), abs(b), 1e-30), (f, a, b)


def _records(tel):
    (r,) = tel.read()
    return r


@pytest.mark.parametrize("kernel, variant", [
    ("flex", "docs_sinks_softcap"),
    ("stand-in", "docs_sinks_softcap"),
    pytest.param("flex", "docs_plain", marks=pytest.mark.slow),
    pytest.param("stand-in", "docs_plain", marks=pytest.mark.slow),
    ("stand-in", "window_no_docs"),
    pytest.param("flex", "window_no_docs", marks=pytest.mark.slow),
])
def test_flex_telemetry_equals_the_tessera_kernels(kernel, variant):
    """"flex": FlexAttention's CPU path (the max logit from the LSE of the scores × 2^24);
    "stand-in": its dense math, with ``max_scores`` as on GPUs."""
    g = np.random.default_rng(5)
    L, B, HQ, HKV = 192, 2, 4, 2
    if variant == "window_no_docs":
        m = window(40) | prefix(3)
        plan = tessera.plan(m.t, q_len=L, heads=HQ, batch=B, block=32)
    else:
        ids = packed_ids(g, B, L, 60, pad_inside=True)  # packed documents, padding runs
        plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=HQ, block=32)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, HQ, L, 16, generator=gen) * 2
    k, v = (torch.randn(B, HKV, L, 16, generator=gen) for _ in range(2))
    v[0, 1, 17, 3] = 40.0  # an outlier in O
    sinks = torch.randn(HQ, generator=gen) if variant == "docs_sinks_softcap" else None
    softcap = 5.0 if variant == "docs_sinks_softcap" else None
    st = 2 if variant != "docs_plain" else 1
    tel_t = tessera.Telemetry(every=1, sink_tokens=st, outlier_ratio=3.0)
    tel_f = tessera.Telemetry(every=1, sink_tokens=st, outlier_ratio=3.0)
    with torch.no_grad():
        ot = tt.attention(q, k, v, plan, sinks=sinks, softcap=softcap, telemetry=tel_t, layer=1, engine="tessera")
        ctx = _flex.use_kernel(_flex.reference_kernel) if kernel == "stand-in" else contextlib.nullcontext()
        with ctx:
            of = tt.attention(q, k, v, plan, sinks=sinks, softcap=softcap, telemetry=tel_f, layer=1, engine="flex")
    assert rel(of, ot) <= 1e-5
    rt, rf = _records(tel_t), _records(tel_f)
    assert (rt["step"], rt["layer"]) == (rf["step"], rf["layer"]) == (0, 1)
    for f in FIELDS:
        _close(rt[f], rf[f], f)
    assert rt["sink_rate"] == rf["sink_rate"]
    assert (rf["learned_sink_mass"] is None) == (sinks is None)
    assert sum(rf["out_outliers"]) > 0


def test_streams_and_the_plain_path_on_non_logging_steps():
    _, plan = _doc_plan(8, L=128, block=32)
    q, k, v = (torch.randn(1, 4, 128, 16) for _ in range(3))
    s = torch.randn(4)
    counting = Counting()
    tel = tessera.Telemetry(every=2)
    with _flex.use_kernel(counting), torch.no_grad():
        plain = tt.attention(q, k, v, plan, engine="flex", sinks=s)
        assert counting.calls == 1
        counting.calls = 0
        logged = tt.attention(q, k, v, plan, engine="flex", sinks=s, telemetry=tel)  # step 0 logs
        assert counting.calls == 4  # the step, sink keys, entropy, max logit
        tel.advance()
        counting.calls = 0
        quiet = tt.attention(q, k, v, plan, engine="flex", sinks=s, telemetry=tel)  # step 1: plain path
        assert counting.calls == 1
    assert torch.equal(plain, logged) and torch.equal(plain, quiet)
    assert len(tel.read()) == 1
    for streams, none in ((("sink",), "out_rms"), (("outlier",), "entropy")):
        t = tessera.Telemetry(every=1, streams=streams)
        with _flex.use_kernel(_flex.reference_kernel), torch.no_grad():
            tt.attention(q, k, v, plan, engine="flex", telemetry=t)
        r = _records(t)
        assert r[none] is None and r["max_logit"] is not None


def test_flex_telemetry_needs_to_know_the_sink_keys():
    ids = np.repeat(np.arange(4), 64)
    sh = tessera.cp.shard(tessera.plan(tessera.causal() & tessera.document(ids), q_len=256, block=32), 2)
    lp = sh.local_plan(0)
    q, k, v = (torch.randn(1, 1, n, 8) for n in (128, 256, 256))
    with torch.no_grad(), pytest.raises(ValueError, match="sink keys of a plan without a mask"):
        tt.attention(q, k, v, lp, engine="flex", telemetry=tessera.Telemetry(every=1))
    # two different key-side documents: the sink keys follow the first document leaf, the rule
    # of the Tessera kernel's telemetry, so both engines report the same sink mass
    other = (ids[::-1] + 10).copy()
    plan = tessera.plan(tessera.document(ids) | tessera.document(other), q_len=256, block=32)
    assert np.array_equal(plan.kv_segments()[0], ids)
    x = [torch.randn(1, 1, 256, 8) for _ in range(3)]
    recs = []
    for engine in ("flex", "tessera"):
        tel = tessera.Telemetry(every=1)
        with torch.no_grad():
            tt.attention(*x, plan, engine=engine, telemetry=tel)
        recs.append(tel.read()[0])
    assert np.allclose(recs[0]["sink_mass"], recs[1]["sink_mass"], rtol=1e-5)


def test_key_side_documents_survive_with_the_plan():
    ids = packed_ids(np.random.default_rng(9), 2, 100, 30, pad_inside=True)
    plan = tessera.plan(tessera.mask("causal & document", segments=ids), q_len=100, block=32)
    for i in range(300):  # other masks made meanwhile change nothing: the ids live in the plan
        tessera.document(np.full(10, i))
    pos = _kv_positions(_runs(plan.kv_segments()))
    want = np.full(ids.shape, -1)
    for b in range(2):
        start = 0
        for j in range(100):
            if j and ids[b, j] != ids[b, j - 1]:
                start = j
            if ids[b, j] >= 0:
                want[b, j] = j - start
    assert np.array_equal(pos, want)
    # a plan from the plan cache knows its ids as well (nothing is kept outside the plan)
    late = tessera.plan(tessera.causal() & tessera.document(ids), q_len=100, block=32)
    assert np.array_equal(late.kv_segments(), ids)


# -- the training example on the flex engine -----------------------------------------------------------


def test_the_training_example_trains_through_the_flex_engine(tmp_path):
    """`examples/train_gpt.py --device cuda` runs tessera.torch.attention on the flex engine; here
    the same code on CPU with the engine forced and the stand-in kernel: the losses equal the
    Tessera engine's, step for step."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_flex", path)
    tg = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt_flex"] = tg
    spec.loader.exec_module(tg)
    cfg = tg.Config(tokenizer="bytes", max_docs=16, seq_len=64, batch_size=2, layers=1, d_model=32, heads=4,
                    kv_heads=2, softcap=20.0, sinks=True, steps=3, warmup=1, telemetry_every=2, eval_every=3,
                    ckpt_every=3, progress=False, out_dir=str(tmp_path / "t"))
    data = tg.load_data(cfg)
    a = tg.train(cfg, data, save=False, evaluate_val=False, log=lambda *_: None)
    with _flex.use_kernel(_flex.reference_kernel):
        cf = tg.Config(**{**cfg.__dict__, "torch_engine": "flex", "out_dir": str(tmp_path / "f")})
        b = tg.train(cf, data, save=True, evaluate_val=True, log=lambda *_: None)
    assert max(abs(x - y) for x, y in zip(a.losses, b.losses)) <= 1e-5, (a.losses, b.losses)
    assert (tmp_path / "f" / "telemetry.jsonl").read_text().count("\n") == 2 * cfg.layers
