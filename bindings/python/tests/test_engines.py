"""Engine selection of `tessera.torch.attention` on CPU: each engine's reasons
for given inputs, `auto`'s priority list on a faked GPU (the capability probes replaced, never
the kernels), named engines that cannot run raising with the reasons, the readable record
(`tessera.torch.last_dispatch`), and the engines that run on CPU against float64."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import causal, document, packed_ids, ref_attention, rel, window  # noqa: E402
from tessera.engines import flex as _flex  # noqa: E402
from tessera.engines import select as sel  # noqa: E402


def contiguous_docs(rng, rows, L):
    """Documents covering every token (no padding), each id one run."""
    out = np.empty((rows, L), dtype=np.int64)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, L), size=int(rng.integers(1, 6)), replace=False))
        out[r] = np.searchsorted(cuts, np.arange(L), side="right")
    return out


@pytest.fixture
def gpu(monkeypatch):
    """A faked GPU for selection only: meta tensors stand for device tensors, the probes say
    what the test sets (``gpu["cap"]``, ``gpu["flash"]``, ``gpu["varlen"]``)."""
    state = {"cap": (9, 0), "flash": True, "varlen": True,
             "params": frozenset({"return_aux", "scale", "window_size", "enable_gqa"})}
    monkeypatch.setattr(sel, "device_capability", lambda d: state["cap"] if d.type == "meta" else None)
    monkeypatch.setattr(sel, "flash_importable", lambda: (state["flash"], "" if state["flash"] else "flash_attn.cute is not importable"))
    monkeypatch.setattr(sel, "varlen_importable", lambda: (state["varlen"], "" if state["varlen"] else "no varlen_attn"))
    monkeypatch.setattr(sel, "varlen_params", lambda: state["params"])
    return state


def inputs(plan, dtype=torch.bfloat16, L=None, sinks=None, softcap=None, return_lse=False, logging=False,
           grad=False, hkv=None, scale=None):
    b, h, lq, lkv = plan.shape
    hkv = hkv or h
    q = torch.empty(b, h, lq, 64, dtype=dtype, device="meta", requires_grad=grad)
    k = torch.empty(b, hkv, lkv, 64, dtype=dtype, device="meta")
    v = torch.empty(b, hkv, lkv, 64, dtype=dtype, device="meta")
    return sel.Inputs(q, k, v, plan, sinks, softcap, return_lse, logging, scale)


def test_auto_priority_on_a_faked_gpu(gpu, rng):
    ids = contiguous_docs(rng, 2, 512)
    doc = tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=2, block=128)
    doc64 = tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=2, block=64)
    win = tessera.plan(tessera.window(100), q_len=512, heads=2, block=64)
    # Hopper, flash importable, 128x128 tiles: the FLASH backend
    assert sel.select("auto", inputs(doc)) == "flex_flash"
    rec = tt.last_dispatch()
    assert rec["engine"] == "flex_flash" and rec["skipped"] == {} and rec["requested"] == "auto"
    # 64x64 tiles on Hopper: FLASH declines, the Triton kernel runs (varlen, slower on an H200,
    # is not on auto's list even for causal documents it could run)
    assert sel.select("auto", inputs(doc64)) == "flex"
    assert list(tt.last_dispatch()["skipped"]) == ["flex_flash"]
    assert "128x128" in " ".join(tt.last_dispatch()["skipped"]["flex_flash"])
    assert sel.select("auto", inputs(win)) == "flex"
    # Blackwell takes any tile; Ampere none; no flash_attn.cute: said so
    gpu["cap"] = (10, 0)
    assert sel.select("auto", inputs(doc64)) == "flex_flash"
    gpu["cap"] = (8, 0)
    assert sel.select("auto", inputs(doc)) == "flex"
    assert "sm80" in " ".join(tt.last_dispatch()["skipped"]["flex_flash"])
    gpu["cap"], gpu["flash"] = (9, 0), False
    assert sel.select("auto", inputs(doc)) == "flex"
    assert "not importable" in " ".join(tt.last_dispatch()["skipped"]["flex_flash"])
    # varlen by name: chosen when it can run, recorded as requested
    assert sel.select("varlen", inputs(doc)) == "varlen"
    assert tt.last_dispatch()["requested"] == "varlen"
    gpu["varlen"] = False
    with pytest.raises(RuntimeError, match="engine='varlen'.*no varlen_attn"):
        sel.select("varlen", inputs(doc))


def _varlen_why(i) -> str:
    """varlen's reasons for ``i``, checked to be what naming it raises with."""
    why = sel.REASONS["varlen"](i)
    if why:
        with pytest.raises(RuntimeError, match="engine='varlen' cannot run"):
            sel.select("varlen", i)
    else:
        assert sel.select("varlen", i) == "varlen"
    return " ".join(why)


def test_varlen_declines_what_it_cannot_do_exactly(gpu, rng):
    gpu["flash"] = False
    ids = contiguous_docs(rng, 1, 300)
    doc = tessera.plan(tessera.causal() & tessera.document(ids), q_len=300, heads=2, block=64)
    assert _varlen_why(inputs(doc)) == ""
    cases = {
        "softcap": inputs(doc, softcap=30.0),
        "telemetry": inputs(doc, logging=True),
        "LSE gradient": inputs(doc, sinks=torch.zeros(2, device="meta"), grad=True),
        "bfloat16 or float16": inputs(doc, dtype=torch.float32),
    }
    for word, i in cases.items():
        assert word in _varlen_why(i), word
    # sinks without gradients are exact from the LSE: accepted
    assert _varlen_why(inputs(doc, sinks=torch.zeros(2, device="meta"))) == ""
    assert _varlen_why(inputs(doc, hkv=1, scale=0.3)) == ""
    # torch 2.10's varlen_attn (is_causal, return_aux; no scale, no enable_gqa): only what it can do
    gpu["params"] = frozenset({"is_causal", "return_aux"})
    assert _varlen_why(inputs(doc)) == ""
    for i, word in ((inputs(doc, hkv=1), "enable_gqa"), (inputs(doc, scale=0.3), "no scale")):
        assert word in _varlen_why(i), word
    gpu["params"] = frozenset({"scale"})
    assert "neither window_size nor is_causal" in _varlen_why(inputs(doc))
    gpu["params"] = frozenset({"return_aux", "scale", "window_size", "enable_gqa"})
    padded = ids.copy()
    padded[:, -20:] = -1  # padding at the tail
    for mask, word in (
        (tessera.causal() & tessera.document(padded), "padding"),
        (tessera.document(ids), "not exactly causal & document"),
        (tessera.causal(5) & tessera.document(ids), "not exactly causal & document"),
        (tessera.causal() & tessera.document(np.where(np.arange(300) < 150, 0, 1) * (np.arange(300) % 2)),
         "two runs"),
    ):
        p = tessera.plan(mask, q_len=300, block=64)
        assert word in _varlen_why(inputs(p)), word
        assert sel.select("auto", inputs(p)) == "flex"


def test_named_engines_and_bad_names(rng):
    plan = tessera.plan(tessera.causal() & tessera.document(contiguous_docs(rng, 1, 128)), q_len=128,
                        heads=2, block=64)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    for bad in ("triton", "FLASH", None, 3):
        with pytest.raises(ValueError, match="engine"):
            tt.attention(q, k, v, plan, engine=bad)
    # the GPU engines on CPU tensors: an error that says why, never a silent fallback
    with pytest.raises(RuntimeError, match="engine='varlen'.*CUDA"):
        tt.attention(q, k, v, plan, engine="varlen")
    with pytest.raises(RuntimeError, match="engine='flex_flash'.*(flash_attn|CUDA)"):
        tt.attention(q, k, v, plan, engine="flex_flash")
    # auto on CPU tensors: Tessera's kernels, recorded
    o = tt.attention(q, k, v, plan)
    rec = tt.last_dispatch()
    assert rec == {"requested": "auto", "engine": "tessera", "skipped": {}, "device": "cpu"}
    with torch.no_grad():
        of = tt.attention(q, k, v, plan, engine="flex")
    assert tt.last_dispatch()["engine"] == "flex" and rel(of, o) <= 1e-5


def test_cpu_engines_against_float64(rng):
    """The engines that run on CPU tensors (Tessera's kernels; FlexAttention's CPU forward with the
    analytic and the bit-table mask_mod) equal the float64 reference on packed documents with
    GQA, softcap and sinks."""
    ids = packed_ids(rng, 2, 300, 90, pad_inside=True)
    m = causal() & document(ids) | (window(3) & causal())
    plan = tessera.plan(m.t, q_len=300, heads=4, block=64, cache=False)
    q = torch.randn(2, 4, 300, 32, dtype=torch.float64).float()
    k, v = torch.randn(2, 2, 300, 32).float(), torch.randn(2, 2, 300, 16).float()
    sinks = torch.randn(4)
    ro, rlse = ref_attention(q, k, v, m.dense(2, 4, 300, 300), softcap=5.0, sinks=sinks)
    with torch.no_grad():
        ot = tt.attention(q, k, v, plan, softcap=5.0, sinks=sinks, engine="tessera")
        assert rel(ot, ro) <= 1e-5
        of = tt.attention(q, k, v, plan, softcap=5.0, sinks=sinks, engine="flex")
        assert rel(of, ro) <= 1e-5
        # the bit-table mask_mod through the same engine
        plan._flex["bm"]["cpu"] = plan.to_flex_block_mask(mask_mod="bits")
        ob = tt.attention(q, k, v, plan, softcap=5.0, sinks=sinks, engine="flex")
        assert rel(ob, ro) <= 1e-5


def test_flash_backend_reaches_flex_attention_kernel_options(monkeypatch):
    """``flex_flash`` is FlexAttention with ``kernel_options={"BACKEND": "FLASH"}``: the option
    reaches the kernel call (checked on CPU with a recording stand-in, not run)."""
    seen = []

    def fake_flex_attention(q, k, v, **kw):
        seen.append(kw.get("kernel_options"))
        raise RuntimeError("stop")

    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "flex_attention", fake_flex_attention)
    plan = tessera.plan(tessera.causal(), q_len=128, block=64)
    q = torch.randn(1, 1, 128, 16)
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad():
        _flex.attention(q, q, q, plan, scale=0.25, softcap=None, sinks=None, return_lse=False,
                        telemetry=None, layer=0, backend="FLASH")
    assert seen == [{"BACKEND": "FLASH"}] and _flex._BACKEND is None


def test_autocast_runs_mixed_inputs_in_its_dtype():
    """Under torch.autocast the op casts q, k, v to the autocast dtype (as SDPA does): float32
    rotary q/k beside a bfloat16 v run in bfloat16, equal to casting them by hand; outside
    autocast mixed dtypes are refused naming the arguments."""
    plan = tessera.plan(tessera.causal(), q_len=128, heads=2, block=64)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 128, 16, generator=g).bfloat16()
    with pytest.raises(TypeError, match="k, v"):
        tt.attention(q, k, v, plan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = tt.attention(q, k, v, plan)
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, tt.attention(q.bfloat16(), k.bfloat16(), v, plan))

    def step(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tt.attention(q, k, v, plan)

    assert torch.equal(torch.compile(step, fullgraph=True)(q, k, v), o)
