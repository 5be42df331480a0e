"""Errors and telemetry in the caller's terms (docs/python.md, docs/jax.md): a layout mix-up names
the fix instead of blaming the plan, wrong-length document ids name the argument the caller
passed, plan statistics and pictures say their units, and telemetry misuse is not silent (a
layer recorded twice in a step warns; `learned_sink_mass` is null without sinks on both
frontends). Real torch and jax, no mocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import tessera
import tessera.cp
from tessera.core.telemetry import TelemetryWarning

torch = pytest.importorskip("torch")
import tessera.torch as tt  # noqa: E402


B, H, L, D = 1, 4, 256, 16


@pytest.fixture(scope="module")
def doc_plan():
    ids = np.repeat(np.arange(4), L // 4)
    return tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=32)


def _blhd(seed=0, b=B, h=H, n=L, d=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g) for _ in range(3)]


# -- 1. layout mix-ups name the fix ------------------------------------------------------------


def test_torch_blhd_tensors_get_told_to_transpose_not_that_the_plan_is_wrong(doc_plan):
    q, k, v = _blhd()
    want = (r"q: shape \(1, 256, 4, 16\) is \[B, L, H, D\] for this plan \(B=1, H=4, L=256\), but "
            r"tessera\.torch\.attention reads \[B, H, L, D\]: pass q\.transpose\(1, 2\)")
    with pytest.raises(ValueError, match=want):
        tt.attention(q, k, v, doc_plan)
    # the advice is right: the transposed views run
    out = tt.attention(*(x.transpose(1, 2) for x in (q, k, v)), doc_plan)
    assert out.shape == (B, H, L, D)
    # a real mismatch still blames the plan, with both shapes
    with pytest.raises(ValueError, match=r"plan: built for B=1 H=4 Lq=256 Lkv=256, but q/k give B=1 H=4 Lq=128"):
        tt.attention(*(torch.zeros(1, H, 128, D) for _ in range(3)), doc_plan)


def test_torch_layout_hint_holds_for_a_plan_that_serves_any_batch():
    plan = tessera.plan(tessera.causal(), q_len=L, heads=H, block=32)  # uniform: any B
    q, k, v = _blhd(b=3)
    with pytest.raises(ValueError, match=r"is \[B, L, H, D\] for this plan.*q\.transpose\(1, 2\)"):
        tt.attention(q, k, v, plan)


jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import tessera.jax as tj  # noqa: E402


def test_jax_blhd_arrays_get_told_to_pass_layout_blhd_eagerly_and_under_jit(doc_plan):
    q, k, v = (jnp.asarray(x.numpy()) for x in _blhd())
    want = (r'q: shape \(1, 256, 4, 16\) is \[B, L, H, D\] for this plan \(B=1, H=4, L=256\), but '
            r'layout="bhld" reads it as \[B, H, L, D\]: pass layout="blhd"')
    with pytest.raises(ValueError, match=want):
        tj.attention(q, k, v, doc_plan)
    with pytest.raises(ValueError, match=want):
        jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p))(q, k, v, doc_plan)
    o = tj.attention(q, k, v, doc_plan, layout="blhd")  # the advice runs
    assert o.shape == q.shape
    # and the other way round
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    with pytest.raises(ValueError, match=r'layout="blhd" reads it as \[B, L, H, D\]: pass layout="bhld"'):
        tj.attention(qt, kt, vt, doc_plan, layout="blhd")


def test_jax_cp_attention_and_scatter_name_q_k_v_and_the_axis_to_pass(doc_plan):
    sh = tessera.cp.shard(doc_plan, 2)
    cpp = tj.cp_plan(sh, "allgather")
    q, k, v = (jnp.asarray(x.numpy()) for x in _blhd())
    # docs/jax.md's CP snippet with the first example's [B, L, H, D] row and axis=2
    with pytest.raises(ValueError, match=(r"x \(q, k, v or another whole-row array\): expected length 256 "
                                          r"\(the row's tokens\) at axis=2, found length 4 in shape "
                                          r"\(1, 256, 4, 16\); axis 1 has 256: pass axis=1")):
        tj.scatter(q, sh, axis=2)
    with pytest.raises(ValueError, match=r"x \(q, k, v.*pass axis=1"):
        tj.gather(q, sh, axis=2)
    # this device's tokens in [B, L/R, H, D] under the default layout
    local = q[:, : L // 2]
    with pytest.raises(ValueError, match=r'q: expected this device\'s \[B, H, L, D\] with L = 128.*pass layout="blhd"'):
        tj.cp_attention(local, local, local, cpp, "cp")


def test_torch_cp_attention_names_the_transpose(tmp_path):
    # One rank of a real gloo group (a subprocess: this process keeps torch.distributed unset).
    script = textwrap.dedent(f"""
        import numpy as np, torch, torch.distributed as dist, tessera, tessera.cp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        plan = tessera.plan(tessera.causal(), q_len=256, heads=4, block=32)
        sh = tessera.cp.shard(plan, 1)
        q = torch.zeros(1, 256, 4, 16)
        try:
            tessera.cp.attention(q, q, q, sh)
        except ValueError as e:
            print(e)
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "q: expected this rank's [B, H, 256, D], got shape (1, 256, 4, 16)" in r.stdout, r.stdout
    assert "it looks [B, L, H, D]: pass q.transpose(1, 2)" in r.stdout, r.stdout


# -- 2. telemetry misuse is not silent ----------------------------------------------------------


def test_torch_forgotten_advance_warns_once_and_advance_keeps_quiet(doc_plan):
    q, k, v = (x.transpose(1, 2) for x in _blhd())
    tel = tessera.Telemetry(every=1)
    with pytest.warns(TelemetryWarning, match=r"layer 0 was recorded twice at step 0.*tel\.advance\(\)") as got:
        for _ in range(3):  # three training steps without advance(): folded into one record
            for layer in (0, 1):
                tt.attention(q, k, v, doc_plan, telemetry=tel, layer=layer)
    assert len([w for w in got if issubclass(w.category, TelemetryWarning)]) == 1  # once
    recs = tel.read()
    assert [(r["step"], r["layer"]) for r in recs] == [(0, 0), (0, 1)]
    assert recs[0]["tokens"] == 3 * B * L  # the three steps' rows in one record
    ok = tessera.Telemetry(every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)
        for _ in range(3):
            for layer in (0, 1):
                tt.attention(q, k, v, doc_plan, telemetry=ok, layer=layer)
            ok.advance()
        assert [(r["step"], r["layer"]) for r in ok.read()] == [(s, l) for s in range(3) for l in (0, 1)]


def test_torch_read_and_write_jsonl_drain(doc_plan, tmp_path):
    q, k, v = (x.transpose(1, 2) for x in _blhd())
    tel = tessera.Telemetry(every=1)
    tt.attention(q, k, v, doc_plan, telemetry=tel)
    assert tel.write_jsonl(tmp_path / "t.jsonl") == 1
    assert tel.read() == []  # what write_jsonl wrote is gone, as docs/python.md says


def _jax_summary(q, k, v, plan, tel, sinks=None):
    return tj.attention(q, k, v, plan, sinks=sinks, telemetry=tel)[1]


@pytest.mark.parametrize("claimed", [None, True], ids=["no_flag", "flag_says_sinks"])
def test_jax_learned_sink_mass_is_null_without_sinks_as_in_torch(doc_plan, claimed):
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in _blhd(3))
    q, k, v = (jnp.asarray(x.numpy()) for x in (qt, kt, vt))
    tel = tj.Telemetry(every=1)
    tel.collect(0, {0: _jax_summary(q, k, v, doc_plan, tel.at(0))},
                **({} if claimed is None else {"learned_sinks": claimed}))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        (rec,) = tel.read()
    assert rec["learned_sink_mass"] is None
    said = [w for w in got if issubclass(w.category, TelemetryWarning)]
    assert len(said) == (0 if claimed is None else 1)
    if said:
        assert "learned_sinks=True" in str(said[0].message) and "null" in str(said[0].message)
    ttel = tessera.Telemetry(every=1)
    tt.attention(qt, kt, vt, doc_plan, telemetry=ttel)
    (trec,) = ttel.read()
    assert trec["learned_sink_mass"] is None
    ttel.advance()
    # with sinks both give values, and the JAX summary says so itself
    s = np.linspace(-1.0, 1.0, H).astype(np.float32)
    tel.collect(1, {0: _jax_summary(q, k, v, doc_plan, tel.at(1), sinks=jnp.asarray(s))})
    (rec,) = tel.read()
    tt.attention(qt, kt, vt, doc_plan, sinks=torch.from_numpy(s), telemetry=ttel)
    (trec,) = ttel.read()
    assert np.allclose(rec["learned_sink_mass"], trec["learned_sink_mass"], rtol=1e-5)


def test_jax_collecting_one_step_twice_warns_once(doc_plan):
    q, k, v = (jnp.asarray(x.transpose(1, 2).contiguous().numpy()) for x in _blhd(4))
    tel = tj.Telemetry(every=1)
    with pytest.warns(TelemetryWarning, match=r"layer 2 was recorded twice at step 0.*tel\.at\(step\)") as got:
        for _ in range(3):  # every step passed as step 0
            tel.collect(0, {2: _jax_summary(q, k, v, doc_plan, tel.at(0))})
    assert len([w for w in got if issubclass(w.category, TelemetryWarning)]) == 1
    (rec,) = tel.read()
    assert rec["tokens"] == 3 * B * L


# -- 3. names the caller wrote ------------------------------------------------------------------


def test_wrong_length_document_ids_name_ids_and_kv_ids_with_both_lengths():
    ids = np.repeat(np.arange(4), 32)  # 128 ids
    with pytest.raises(ValueError, match=r"^ids \(the document ids; segments= of tessera\.mask\): expected "
                                         r"length 256 \(the plan's q_len\), found length 128$"):
        tessera.plan(tessera.causal() & tessera.document(ids), q_len=256)
    with pytest.raises(ValueError, match=r"^ids \(the document ids.*expected length 256 \(the plan's "
                                         r"kv_len: the same ids serve the keys; pass kv_ids"):
        tessera.plan(tessera.document(ids), q_len=128, kv_len=256)
    with pytest.raises(ValueError, match=r"^kv_ids \(the key-side document ids; kv_segments= of "
                                         r"tessera\.mask\): expected length 256 \(the plan's kv_len\), "
                                         r"found length 100$"):
        tessera.plan(tessera.document(ids, np.zeros(100, np.int64)), q_len=128, kv_len=256)
    with pytest.raises(ValueError, match=r"^ids \(the query-side document ids; q_segments= .*found length 128$"):
        tessera.plan(tessera.document(ids, np.zeros(256, np.int64)), q_len=200, kv_len=256)
    with pytest.raises(ValueError, match=r"segments= of tessera\.mask\): expected length 64"):
        tessera.plan(tessera.mask("causal & document", segments=ids), q_len=64)
    with pytest.raises(ValueError, match=r"^ids .*expected 1 or 3 rows \(the batch size\), found 2 rows$"):
        tessera.plan(tessera.document(np.stack([ids, ids])), q_len=128, batch=3)


def test_cross_attention_ids_with_other_row_counts_name_kv_ids():
    q2, k3 = np.zeros((2, 8), np.int64), np.zeros((3, 8), np.int64)
    with pytest.raises(ValueError, match=r"^kv_ids: expected 1 or 2 rows \(as ids\), found 3$"):
        tessera.document(q2, k3)
    with pytest.raises(ValueError, match=r"^kv_segments: expected 1 or 2 rows \(as q_segments\), found 3$"):
        tessera.mask("document", q_segments=q2, kv_segments=k3)
    assert tessera.document(q2, k3[:1]) is not None  # one row broadcasts


def test_plan_stats_and_picture_say_their_units():
    p = tessera.plan(tessera.causal(), q_len=64 * 16, heads=8, block=16)  # 64 x 64 tiles, one grid
    s = p.stats
    assert s["tile_grid"] == (1, 1, 64, 64)
    assert s["tiles"] == 64 * 64 and s["allowed_pairs"] == 8 * 1024 * 1025 // 2
    assert "[B', H', Tq, Tk] = [1, 1, 64, 64]" in s["units"]["tiles"]
    assert "[B, H, Lq, Lkv] = [1, 8, 1024, 1024]" in s["units"]["allowed_pairs"]
    head, *rest = str(p).rstrip("\n").split("\n")
    assert "density=0.5005 of B*H*Lq*Lkv pairs" in head
    assert f"tiles of the [B'=1, H'=1, Tq=64, Tk=64] grid: {s['full_tiles']} full" in head
    assert len(rest) == 32 + 1
    assert rest[-1] == ("  (shrunk: 32 of 64 tile rows, 32 of 64 tile columns; each cell covers 2 x 2 "
                        "tiles: ██ all full, ░░ some allowed, blank all empty)")
    odd = tessera.plan(tessera.causal(), q_len=50 * 16, kv_len=20 * 16, block=16)
    assert "(shrunk: 32 of 50 tile rows, 20 of 20 tile columns; each cell covers 1-2 x 1 tiles" in str(odd)
    small = tessera.plan(tessera.causal(), q_len=64, block=16)
    assert "shrunk" not in str(small)
