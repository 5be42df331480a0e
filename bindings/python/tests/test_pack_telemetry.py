"""Document packing (docs/semantics.md#packing) and gated attention telemetry (docs/semantics.md#telemetry) from Python: packing
invariants under both strategies, equality with the CLI's packer; telemetry cadence, every field
against values computed densely in float64, bit-identical outputs on logging steps, JSON lines the
CLI reads."""

import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest

import tessera
from conftest import causal, document, packed_ids, ref_attention, ref_probs, window

CLI = shutil.which("tessera") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../target/release/tessera")
)
HAVE_CLI = os.path.exists(CLI)

# -- packing -------------------------------------------------------------------------------------


def _docs(rng, n, max_len, empty=True):
    """Documents with globally unique token values (document i's tokens are i·10⁴ + k), so each
    packed piece can be traced back to its document and offset."""
    out = []
    for i in range(n):
        length = int(rng.integers(0 if empty else 1, max_len + 1))
        out.append([1000 + i * 10_000 + k for k in range(length)])
    return out


def check_packed(out, docs, seq_len, bos, strategy):
    tok, seg, pos = out["tokens"], out["segment_ids"], out["positions"]
    assert tok.dtype == seg.dtype == pos.dtype == np.int32
    assert tok.shape == seg.shape == pos.shape and tok.shape[1] == seq_len
    rows = tok.shape[0]
    pieces = []  # (row, tokens of the piece without BOS), in row-major order
    for r in range(rows):
        s, t, p = seg[r], tok[r], pos[r]
        valid = s >= 0
        assert (s[~valid] == -1).all()
        assert (t[~valid] == 0).all() and (p[~valid] == 0).all()
        assert valid[0], "a row starts with a document"
        # segments are contiguous runs; every run starts with BOS at position 0 and counts up
        starts = np.nonzero(valid & np.r_[True, s[1:] != s[:-1]])[0]
        assert len(set(s[starts].tolist())) == len(starts), "a segment id is used by one run per row"
        for a in starts:
            end = a
            while end < seq_len and s[end] == s[a]:
                end += 1
            assert t[a] == bos
            assert (p[a:end] == np.arange(end - a)).all()
            assert end - a >= 2, "a piece holds BOS and at least one token"
            pieces.append(t[a + 1 : end].tolist())
        # padding only at the end of a row
        if (~valid).any():
            first_pad = int(np.argmax(~valid))
            assert (~valid[first_pad:]).all()
    nonempty = [d for d in docs if d]
    # every document is there: its pieces, in order, concatenate back to it
    by_doc = {}
    for pc in pieces:
        d = (pc[0] - 1000) // 10_000
        assert all((x - 1000) // 10_000 == d for x in pc), "a piece mixes documents"
        by_doc.setdefault(d, []).append(pc)
    assert len(by_doc) == len(nonempty)
    split = 0
    for d, pcs in by_doc.items():
        pcs.sort(key=lambda pc: pc[0])
        assert sum(pcs, []) == docs[d]
        assert all(len(pc) == seq_len - 1 for pc in pcs[:-1]), "only the last piece is short"
        split += len(pcs) > 1
    if strategy == "greedy":  # in input order
        order = [(pc[0] - 1000) // 10_000 for pc in pieces]
        assert order == sorted(order)
    st = out["stats"]
    assert st["rows"] == rows and st["seq_len"] == seq_len
    assert st["documents"] == len(nonempty) and st["pieces"] == len(pieces)
    assert st["tokens"] == sum(len(d) for d in docs)
    assert st["padding_tokens"] == int((seg < 0).sum())
    assert st["padding_pct"] == pytest.approx(100.0 * (seg < 0).sum() / max(seg.size, 1))
    assert st["split_documents"] == split
    assert st["empty_documents_skipped"] == len(docs) - len(nonempty)
    assert isinstance(st["summary"], str) and str(rows) in st["summary"]


@pytest.mark.parametrize("strategy", ["best-fit", "greedy"])
@pytest.mark.parametrize("seq_len, max_len", [(64, 90), (16, 15), (2, 5), (128, 400)])
def test_pack_invariants(strategy, seq_len, max_len, rng):
    docs = _docs(rng, 60, max_len)
    docs.append([])
    docs.append([1000 + len(docs) * 10_000 + k for k in range(seq_len - 1)])  # exactly one full row
    bos = int(rng.integers(0, 1000))
    out = tessera.pack(docs, seq_len, strategy=strategy, bos=bos)
    check_packed(out, docs, seq_len, bos, strategy)


def test_best_fit_packs_no_worse_than_greedy_on_a_typical_corpus(rng):
    docs = _docs(rng, 200, 300, empty=False)
    bf = tessera.pack(docs, 256)["stats"]["rows"]
    gr = tessera.pack(docs, 256, strategy="greedy")["stats"]["rows"]
    assert bf <= gr


def test_pack_accepts_numpy_and_torch_documents():
    torch = pytest.importorskip("torch")
    docs = [[3, 4, 5], np.array([6, 7], dtype=np.int16), torch.tensor([8, 9, 10, 11]), (12,)]
    out = tessera.pack(docs, 8, strategy="greedy")
    ref = tessera.pack([[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]], 8, strategy="greedy")
    for key in ("tokens", "segment_ids", "positions"):
        assert np.array_equal(out[key], ref[key])


def test_packed_segments_feed_document_masks():
    out = tessera.pack([[1, 2, 3], [4, 5], [6] * 20], 8, strategy="greedy")
    seg = out["segment_ids"]
    m = tessera.causal() & tessera.document(seg)
    p = tessera.plan(m, q_len=8, block=16)
    assert p.shape[0] == seg.shape[0]
    want = (causal() & document(seg)).dense(seg.shape[0], 1, 8, 8)
    assert p.stats["allowed_pairs"] == int(want.sum())


def _pack_param(name, call, exc, needle, bug=None):
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(call, exc, needle, id=name, marks=marks)


@pytest.mark.parametrize(
    "call, exc, needle",
    [
        _pack_param("seq_len_1", lambda: tessera.pack([[1]], 1), ValueError, "seq_len"),
        _pack_param("seq_len_0", lambda: tessera.pack([[1]], 0), ValueError, "seq_len"),
        _pack_param("negative_token", lambda: tessera.pack([[1], [-3]], 8), ValueError, "docs[1]"),
        _pack_param("huge_token", lambda: tessera.pack([[2**31]], 8), ValueError, "docs[0]"),
        _pack_param("float_token", lambda: tessera.pack([[0.5]], 8), TypeError, "docs[0]"),
        _pack_param("nested_doc", lambda: tessera.pack([[1], [[1, 2]]], 8), TypeError, "docs[1]"),
        _pack_param("strategy", lambda: tessera.pack([[1]], 8, strategy="random"), ValueError, "strategy"),
        _pack_param("seq_len_negative", lambda: tessera.pack([[1]], -3), ValueError, "seq_len"),
        _pack_param("bos_negative", lambda: tessera.pack([[1]], 8, bos=-1), ValueError, "bos"),
        _pack_param("seq_len_fraction", lambda: tessera.pack([[1]], 8.5), TypeError, "seq_len"),
    ],
)
def test_pack_rejects_bad_input(call, exc, needle):
    with pytest.raises(exc) as e:
        call()
    assert needle in str(e.value), str(e.value)


def _read_safetensors(path):
    st = pytest.importorskip("safetensors.numpy")
    return st.load_file(str(path))


@pytest.mark.skipif(not HAVE_CLI, reason="the tessera CLI is not built (target/release/tessera)")
@pytest.mark.parametrize("strategy", ["best-fit", "greedy"])
def test_pack_equals_the_cli_packer(strategy, tmp_path, rng):
    docs = _docs(rng, 80, 150)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"tokens": d}) + "\n" for d in docs))
    out_file = tmp_path / "rows.safetensors"
    r = subprocess.run([CLI, "pack", "--input", str(src), "--seq-len", "64", "--strategy", strategy,
                        "--bos", "7", "--out", str(out_file), "--json", "--no-cache"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cli = _read_safetensors(out_file)
    py = tessera.pack(docs, 64, strategy=strategy, bos=7)
    for key in ("tokens", "segment_ids", "positions"):
        assert cli[key].dtype == py[key].dtype and np.array_equal(cli[key], py[key]), key
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("rows", "documents", "pieces", "tokens", "padding_tokens", "split_documents"):
        assert stats[key] == py["stats"][key], key
    v = subprocess.run([CLI, "pack", "--verify", str(out_file), "--bos", "7", "--no-cache"],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stderr


# -- telemetry -----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
import tessera.torch as tt  # noqa: E402
from tessera.core.telemetry import TelemetryWarning  # noqa: E402

FIELDS = ("step", "layer", "sink_mass", "sink_rate", "learned_sink_mass", "max_logit", "entropy",
          "out_abs_max", "out_rms", "out_outliers")


def sink_flags(kv_ids, b, lkv, sink_tokens):
    """docs/semantics.md#telemetry: the first ``sink_tokens`` keys of each key's document (a maximal run of one id;
    padding keys never), or of the sequence without documents; bool [B, Lkv]."""
    out = np.zeros((b, lkv), dtype=bool)
    if kv_ids is None:
        out[:, :sink_tokens] = True
        return out
    ids = np.broadcast_to(np.atleast_2d(kv_ids), (b, lkv))
    for r in range(b):
        start = 0
        for j in range(lkv):
            if j > 0 and ids[r, j] != ids[r, j - 1]:
                start = j
            out[r, j] = ids[r, j] >= 0 and j - start < sink_tokens
    return out


def dense_telemetry(q, k, o, allowed, flags, scale=None, softcap=None, sinks=None, ratio=6.0, eps=0.3):
    """Every docs/semantics.md#telemetry field computed densely in float64 (per query head, over all batch rows)."""
    p, p_sink, raw, lse = ref_probs(q, k, allowed, scale=scale, softcap=softcap, sinks=sinks)
    b, h, lq, _ = p.shape
    valid = torch.from_numpy(np.broadcast_to(allowed, p.shape).any(-1))  # [B, H, Lq]
    fl = torch.from_numpy(flags)[:, None, None, :]  # [B, 1, 1, Lkv]
    mass = (p * fl).sum(-1)
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p)).sum(-1)
    ent = -plogp - torch.where(p_sink > 0, p_sink * torch.log(p_sink.clamp_min(1e-300)), torch.zeros_like(p_sink))
    n = valid.sum((0, 2)).double()
    mean = lambda x: torch.where(valid, x, 0).sum((0, 2)) / n  # noqa: E731
    sink_mass = mean(mass)
    od = o.double()
    rms_slice = od.square().mean((-1, -2)).sqrt()  # [B, H]
    outliers = (od.abs() > ratio * rms_slice[..., None, None]).sum((0, 2, 3))
    return {
        "sink_mass": sink_mass.numpy(),
        "sink_rate": float((sink_mass > eps).double().mean()),
        "learned_sink_mass": None if sinks is None else mean(p_sink).numpy(),
        "max_logit": raw.amax((0, 2, 3)).numpy(),
        "entropy": mean(ent).numpy(),
        "valid_rows": n.numpy(),
        "out_abs_max": od.abs().amax((0, 2, 3)).numpy(),
        "out_rms": od.square().mean((0, 2, 3)).sqrt().numpy(),
        "out_outliers": outliers.numpy(),
    }


def _telemetry_case(seed, b, hq, hkv, l, d, sinks, softcap, sink_tokens=1, with_docs=True):
    g = torch.Generator().manual_seed(seed)
    r = np.random.default_rng(seed)
    ids = packed_ids(r, b, l, l // 3, pad_inside=True) if with_docs else None
    m = (causal() & document(ids)) if with_docs else (causal() | window(5, 5))
    plan = tessera.plan(m.t, q_len=l, heads=hq, batch=b, block=32)
    q = torch.randn(b, hq, l, d, generator=g) * 1.5
    k, v = torch.randn(b, hkv, l, d, generator=g), torch.randn(b, hkv, l, d, generator=g)
    v[..., 0] *= 20  # a few large outputs so that outlier counts are not all zero
    s = torch.randn(hq, generator=g) if sinks else None
    return plan, m, ids, (q, k, v), s


@pytest.mark.parametrize(
    "b, hq, hkv, sinks, softcap, sink_tokens, with_docs, ratio",
    [
        pytest.param(1, 2, 2, False, None, 1, True, 6.0, id="docs"),
        pytest.param(2, 4, 2, True, 5.0, 1, True, 2.0, id="rows_gqa_sinks_softcap"),
        pytest.param(2, 2, 1, True, None, 3, True, 3.0, id="sink_tokens_3"),
        pytest.param(1, 3, 3, False, 2.0, 2, False, 1.5, id="no_documents"),
    ],
)
def test_telemetry_values_match_dense_float64(b, hq, hkv, sinks, softcap, sink_tokens, with_docs, ratio):
    l, d = 96, 16
    plan, m, ids, (q, k, v), s = _telemetry_case(3, b, hq, hkv, l, d, sinks, softcap, sink_tokens, with_docs)
    tel = tessera.Telemetry(every=1, sink_tokens=sink_tokens, outlier_ratio=ratio)
    o = tt.attention(q, k, v, plan, softcap=softcap, sinks=s, telemetry=tel, layer=3)
    (rec,) = tel.read()
    assert rec["step"] == 0 and rec["layer"] == 3
    for f in FIELDS:
        assert f in rec, f
    allowed = m.dense(b, hq, l, l)
    flags = sink_flags(ids, b, l, sink_tokens)
    want = dense_telemetry(q, k, o, allowed, flags, softcap=softcap, sinks=s, ratio=ratio)
    ro, _ = ref_attention(q, k, v, allowed, softcap=softcap, sinks=s)
    assert np.allclose(rec["sink_mass"], want["sink_mass"], atol=1e-5)
    assert np.allclose(rec["entropy"], want["entropy"], atol=1e-4)
    assert np.allclose(rec["max_logit"], want["max_logit"], atol=1e-4)
    assert rec["valid_rows"] == [int(x) for x in want["valid_rows"]]
    assert rec["sink_rate"] == pytest.approx(float(np.mean(np.asarray(rec["sink_mass"]) > 0.3)))
    assert rec["sink_rate"] == pytest.approx(want["sink_rate"])
    if sinks:
        assert np.allclose(rec["learned_sink_mass"], want["learned_sink_mass"], atol=1e-5)
    else:
        assert rec["learned_sink_mass"] is None
    # outlier stream: over the kernel's own O (exact) and close to the float64 O
    assert np.allclose(rec["out_abs_max"], want["out_abs_max"], rtol=1e-6)
    assert np.allclose(rec["out_rms"], want["out_rms"], rtol=1e-6)
    assert rec["out_outliers"] == [int(x) for x in want["out_outliers"]]
    assert sum(rec["out_outliers"]) > 0
    assert np.allclose(rec["out_abs_max"], ro.abs().amax((0, 2, 3)).numpy(), rtol=1e-4)
    assert np.allclose(rec["out_rms"], ro.square().mean((0, 2, 3)).sqrt().numpy(), rtol=1e-4)
    for f in ("sink_mass", "max_logit", "entropy", "out_abs_max", "out_rms", "out_outliers"):
        assert len(rec[f]) == hq, f


def test_telemetry_of_cross_attention_uses_the_key_documents():
    g = torch.Generator().manual_seed(8)
    r = np.random.default_rng(8)
    ids_q, ids_kv = packed_ids(r, 2, 50, 20), packed_ids(r, 2, 120, 30, pad_inside=True)
    m = document(ids_q, ids_kv)
    plan = tessera.plan(m.t, q_len=50, kv_len=120, heads=2, block=32)
    q = torch.randn(2, 2, 50, 16, generator=g)
    k, v = torch.randn(2, 1, 120, 16, generator=g), torch.randn(2, 1, 120, 16, generator=g)
    tel = tessera.Telemetry(every=1, sink_tokens=2)
    o = tt.attention(q, k, v, plan, telemetry=tel)
    (rec,) = tel.read()
    want = dense_telemetry(q, k, o, m.dense(2, 2, 50, 120), sink_flags(ids_kv, 2, 120, 2))
    assert np.allclose(rec["sink_mass"], want["sink_mass"], atol=1e-5)
    assert np.allclose(rec["entropy"], want["entropy"], atol=1e-4)
    assert rec["valid_rows"] == [int(x) for x in want["valid_rows"]]


def test_calls_of_one_step_and_layer_merge_into_one_record():
    # micro-batches of one step (gradient accumulation) reduce into the record of the whole batch
    ids = packed_ids(np.random.default_rng(9), 4, 80, 30, pad_inside=True)
    plan_all = tessera.plan(tessera.causal() & tessera.document(ids), q_len=80, heads=2, block=32)
    plans = [tessera.plan(tessera.causal() & tessera.document(ids[i : i + 2]), q_len=80, heads=2, block=32)
             for i in (0, 2)]
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(4, 2, 80, 8, generator=g) for _ in range(3)]
    whole, parts = tessera.Telemetry(every=1), tessera.Telemetry(every=1)
    tt.attention(*xs, plan_all, telemetry=whole)
    # the same layer twice in one step is also what a forgotten advance() looks like: said once,
    # in a category to filter where micro-batches are meant
    with pytest.warns(TelemetryWarning, match="micro-batches of one step"):
        for i, p in zip((0, 2), plans):
            tt.attention(*(x[i : i + 2] for x in xs), p, telemetry=parts)
    (a,), (b,) = whole.read(), parts.read()
    assert (a["step"], a["layer"]) == (b["step"], b["layer"]) == (0, 0)
    for f in ("valid_rows", "out_outliers", "max_logit", "out_abs_max"):
        assert a[f] == b[f], f
    for f in ("sink_mass", "entropy", "out_rms"):
        assert np.allclose(a[f], b[f], rtol=1e-12, atol=0), f
    assert a["sink_rate"] == b["sink_rate"]


def test_telemetry_logs_every_n_steps_without_changing_any_output_bit():
    b, hq, hkv, l, d = 2, 4, 2, 128, 16
    plan, m, ids, _, _ = _telemetry_case(5, b, hq, hkv, l, d, False, None)
    tel = tessera.Telemetry(every=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(b, h, l, d, generator=g) for h in (hq, hkv, hkv)] for _ in range(4)]
    for step in range(4):
        assert tel.should_log() == (step % 2 == 0)
        for layer in range(2):
            leaves_a = [x.clone().requires_grad_() for x in xs[step]]
            leaves_b = [x.clone().requires_grad_() for x in xs[step]]
            sk = sinks if layer else None
            oa, la = tt.attention(*leaves_a, plan, sinks=sk, softcap=7.0, telemetry=tel, layer=layer, return_lse=True)
            ob, lb = tt.attention(*leaves_b, plan, sinks=sk, softcap=7.0, return_lse=True)
            assert torch.equal(oa, ob) and torch.equal(la, lb)  # a logging step changes no output bit
            do = torch.randn(oa.shape, generator=g)
            oa.backward(do)
            ob.backward(do)
            for x, y in zip(leaves_a, leaves_b):
                assert torch.equal(x.grad, y.grad)
        tel.advance()
    assert tel.step == 4
    recs = tel.read()
    assert [(r["step"], r["layer"]) for r in recs] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert tel.read() == []  # read once
    assert recs[0]["learned_sink_mass"] is None and len(recs[1]["learned_sink_mass"]) == hq
    # the values of step 2, layer 1 (learned sinks on) against the dense reference
    q, k, v = xs[2]
    allowed = m.dense(b, hq, l, l)
    o = tt.attention(q, k, v, plan, sinks=sinks, softcap=7.0)
    want = dense_telemetry(q, k, o, allowed, sink_flags(ids, b, l, 1), softcap=7.0, sinks=sinks)
    r = recs[3]
    assert np.allclose(r["sink_mass"], want["sink_mass"], atol=1e-5)
    assert np.allclose(r["learned_sink_mass"], want["learned_sink_mass"], atol=1e-5)
    assert np.allclose(r["entropy"], want["entropy"], atol=1e-4)
    assert np.allclose(r["max_logit"], want["max_logit"], atol=1e-4)


def test_telemetry_inside_a_compiled_step():
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(4), 16)), q_len=64, heads=2,
                        block=32)
    tel_c, tel_e = tessera.Telemetry(every=2), tessera.Telemetry(every=2)

    def step(q, k, v, tel):
        return tt.attention(q, k, v, plan, telemetry=tel, layer=1).square().sum()

    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(12)
    for _ in range(4):
        xs = [torch.randn(1, 2, 64, 8, generator=g, requires_grad=True) for _ in range(3)]
        ys = [x.detach().clone().requires_grad_() for x in xs]
        compiled(*xs, tel_c).backward()
        step(*ys, tel_e).backward()
        for x, y in zip(xs, ys):
            assert torch.allclose(x.grad, y.grad, rtol=1e-6, atol=1e-7)
        tel_c.advance()
        tel_e.advance()
    rc, re_ = tel_c.read(), tel_e.read()
    assert [(r["step"], r["layer"]) for r in rc] == [(0, 1), (2, 1)]
    assert rc == re_


def test_telemetry_streams_and_never_logging():
    plan = tessera.plan(tessera.causal(), q_len=64, heads=2, block=32)
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    never = tessera.Telemetry(every=0)
    tt.attention(q, k, v, plan, telemetry=never)
    never.advance()
    tt.attention(q, k, v, plan, telemetry=never)
    assert not never.should_log() and never.read() == []
    sink_only = tessera.Telemetry(every=1, streams=("sink",))
    tt.attention(q, k, v, plan, telemetry=sink_only)
    (r,) = sink_only.read()
    assert r["out_abs_max"] is None and r["out_rms"] is None and r["out_outliers"] is None
    assert len(r["sink_mass"]) == 2 and len(r["max_logit"]) == 2
    out_only = tessera.Telemetry(every=1, streams=("outlier",))
    tt.attention(q, k, v, plan, telemetry=out_only)
    (r,) = out_only.read()
    assert r["sink_mass"] is None and r["sink_rate"] is None and r["entropy"] is None
    assert len(r["out_rms"]) == 2 and len(r["max_logit"]) == 2
    # epsilon decides the sink rate
    for eps, want in ((0.0, 1.0), (1.0, 0.0)):
        t = tessera.Telemetry(every=1, epsilon=eps)
        tt.attention(q, k, v, plan, telemetry=t)
        assert t.read()[0]["sink_rate"] == want


def test_telemetry_with_bf16_inputs_and_empty_heads():
    # head 1 has no allowed pair at all: its per-head values are undefined (null), not NaN
    plan = tessera.plan(tessera.heads([tessera.causal(), ~tessera.full()]), q_len=64, block=32)
    q, k, v = (torch.randn(1, 2, 64, 16).bfloat16() for _ in range(3))
    tel = tessera.Telemetry(every=1)
    o = tt.attention(q, k, v, plan, telemetry=tel)
    assert torch.equal(o, tt.attention(q, k, v, plan))
    (r,) = tel.read()
    assert r["sink_mass"][1] is None and r["entropy"][1] is None and r["max_logit"][1] is None
    assert r["valid_rows"] == [64, 0]
    assert r["sink_mass"][0] is not None and 0 < r["sink_mass"][0] <= 1
    assert r["out_abs_max"][1] == 0.0 and r["out_outliers"][1] == 0
    json.dumps(r, allow_nan=False)  # strict JSON


def _tel_param(name, kwargs, exc, needle, bug=None):
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(kwargs, exc, needle, id=name, marks=marks)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        _tel_param("every_negative", dict(every=-1), ValueError, "every"),
        _tel_param("unknown_stream", dict(streams=("sinks",)), ValueError, "streams"),
        _tel_param("epsilon_above_1", dict(epsilon=2.0), ValueError, "epsilon"),
        _tel_param("epsilon_negative", dict(epsilon=-0.1), ValueError, "epsilon"),
        _tel_param("ratio_inf", dict(outlier_ratio=float("inf")), ValueError, "outlier_ratio"),
        _tel_param("ratio_negative", dict(outlier_ratio=-1.0), ValueError, "outlier_ratio"),
        _tel_param("sink_tokens_negative", dict(sink_tokens=-1), ValueError, "sink_tokens"),
        _tel_param("every_fraction", dict(every=2.5), TypeError, "every"),
        _tel_param("sink_tokens_fraction", dict(sink_tokens=1.5), TypeError, "sink_tokens"),
    ],
)
def test_bad_telemetry_config(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        tessera.Telemetry(**kwargs)


def test_a_bad_layer_is_rejected_at_the_call_and_does_not_poison_the_telemetry():
    plan = tessera.plan(tessera.causal(), q_len=32, block=16)
    q, k, v = (torch.randn(1, 1, 32, 8) for _ in range(3))
    tel = tessera.Telemetry(every=1)
    tt.attention(q, k, v, plan, telemetry=tel, layer=0)
    with pytest.raises((ValueError, TypeError), match="layer"):
        tt.attention(q, k, v, plan, telemetry=tel, layer=-1)
    assert [r["layer"] for r in tel.read()] == [0]


def test_telemetry_jsonl_is_readable_by_the_cli(tmp_path):
    plan = tessera.plan(tessera.causal() & tessera.document(np.repeat(np.arange(4), 16)), q_len=64, heads=3,
                        block=32)
    tel = tessera.Telemetry(every=1)
    path = tmp_path / "tel.jsonl"
    for step in range(4):
        for layer in range(2):
            tt.attention(*(torch.randn(1, 3, 64, 8) for _ in range(3)), plan, telemetry=tel, layer=layer,
                         sinks=torch.randn(3))
        if step == 1:
            assert tel.write_jsonl(path) == 4  # appends in pieces
        tel.advance()
    assert tel.write_jsonl(str(path)) == 4
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["step"], x["layer"]) for x in lines] == [(s, l) for s in range(4) for l in range(2)]
    for x in lines:
        assert all(f in x for f in FIELDS)
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in x["sink_mass"])
    if not HAVE_CLI:
        pytest.skip("the tessera CLI is not built (target/release/tessera)")
    png = tmp_path / "tel.png"
    r = subprocess.run([CLI, "telemetry", "plot", "--in", str(path), "--out", str(png), "--layer", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # two layers in the file and no --layer: the overview of both layers in one picture
    r = subprocess.run([CLI, "telemetry", "plot", "--in", str(path), "--out", str(tmp_path / "x.png"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"] == [0, 1]
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a layer the file does not hold: a clear usage error (exit 2), not a crash
    r = subprocess.run([CLI, "telemetry", "plot", "--in", str(path), "--out", str(tmp_path / "y.png"), "--layer", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--layer" in r.stderr
