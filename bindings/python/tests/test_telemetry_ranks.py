"""Telemetry across ranks (docs/semantics.md#telemetry, docs/semantics.md#many-ranks, docs/semantics.md#engines-and-devices): real 2- and 4-rank gloo groups on loopback (spawned
processes, bounded in time, no mocks). Records reduced over the group equal single-process records
over the whole row (context parallelism: every scheme, both K/V modes) or the concatenated batch
(data parallelism), and CP x DP; a read is one all-reduce per reduction kind; non-logging steps
and reads issue no collective; a per-rank read is refused; a rank that skips the read makes the
others raise within the group's timeout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tessera
import tessera.cp
import tessera.torch as tt
from tessera.engines.native_torch import _np
from conftest import launch_ranks, packed_ids

SCHEMES = tessera.cp.SCHEMES
MODES = tessera.cp.MODES
CONFIG = dict(sink_tokens=2, outlier_ratio=2.5, epsilon=0.3)
SKIP_TIMEOUT = 2.0


def _ids(rng, L, long_doc):
    ids = packed_ids(rng, 1, L, 40, pad_tail=True, pad_inside=True)[0]
    ids[20 : 20 + long_doc] = 1000
    return ids


def _tensors(g, B, H, HKV, L, D):
    q = torch.randn(B, H, L, D, generator=g) * 1.5
    k = torch.randn(B, HKV, L, D, generator=g)
    v = torch.randn(B, HKV, L, D, generator=g)
    v[..., 0] *= 8  # a column of large outputs: outlier counts are not all zero
    return q, k, v


def _spec(world: int, seed: int):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    L, B, H, HKV, D = 256, 2, 2, 1, 8
    ids = np.stack([_ids(rng, L, 100 + 20 * world), _ids(rng, L, 40)])
    cases = []
    for i, (scheme, mode) in enumerate((s, m) for s in SCHEMES for m in MODES):
        cases.append(dict(mask="doc", ids=ids, scheme=scheme, mode=mode,
                          softcap=4.0 if i % 3 == 0 else None,
                          sinks=torch.randn(H, generator=g) if i % 2 == 0 else None))
    cases.append(dict(mask="window(40) | prefix(8)", ids=None, scheme="balanced", mode="needed",
                      softcap=None, sinks=None))
    for c in cases:
        c.update(L=L, B=B, H=H, block=16)
        c["q"], c["k"], c["v"] = _tensors(g, B, H, HKV, L, D)
    # CP x DP: two CP pairs, each on its own batch row of the same cases
    cpdp = [c for c in cases if c["mask"] == "doc" and c["scheme"] in ("zigzag", "balanced")]
    rows = 2
    dp_ids = packed_ids(rng, rows * world, 128, 50, pad_inside=True)
    dp = dict(rows=rows, L=128, H=4, ids=dp_ids, sinks=torch.randn(4, generator=g),
              q=[], k=[], v=[])
    for _ in range(2):
        for n in ("q", "k", "v"):
            dp[n].append([])
        for _ in range(2):
            q, k, v = _tensors(g, rows * world, 4, 2, 128, 16)
            dp["q"][-1].append(q)
            dp["k"][-1].append(k)
            dp["v"][-1].append(v)
    return dict(cases=cases, cpdp_cases=cpdp, dp=dp, config=CONFIG, skip_timeout=SKIP_TIMEOUT)


def _launch(world: int, spec, timeout_s: float = 240.0):
    import tel_worker

    def dp_lines(d):
        f = os.path.join(d, "dp.jsonl")
        return open(f).read().splitlines() if os.path.exists(f) else []

    out, _, lines = launch_ranks(tel_worker.run, world, spec, "tessera-tel-", timeout_s, dp_lines)
    return out, lines


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    world = request.param
    spec = _spec(world, seed=300 + world)
    out, dp_lines = _launch(world, spec)
    return world, spec, out, dp_lines


def _close(got, want, what, rtol=1e-6):
    """Every field of a reduced record against the single-process one: integers and nulls
    exactly, numbers within ``rtol`` relative."""
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for f, w in want.items():
        if f in ("ranks",):
            continue
        g = got[f]
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w), (what, f, g, w)
            pairs = list(zip(g, w))
        else:
            pairs = [(g, w)]
        for a, b in pairs:
            if b is None or isinstance(b, bool) or (isinstance(b, int) and f not in ("sink_rate",)):
                assert a == b, (what, f, got[f], w)
            else:
                assert a is not None and abs(a - b) <= rtol * abs(b) + 1e-12, (what, f, got[f], w)


def _reference(c, rows=slice(None), layer=0):
    """One process over the whole row (and the whole batch): the record of ``c``."""
    ids = None if c["ids"] is None else c["ids"][rows]
    mask = (tessera.causal() & tessera.document(ids)) if c["mask"] == "doc" else tessera.mask(c["mask"])
    plan = tessera.plan(mask, q_len=c["L"], heads=c["H"], batch=len(ids) if ids is not None else c["B"],
                        block=c["block"])
    tel = tessera.Telemetry(every=1, **CONFIG)
    tt.attention(c["q"][rows], c["k"][rows], c["v"][rows], plan, softcap=c["softcap"], sinks=c["sinks"],
                 telemetry=tel, layer=layer)
    (rec,) = tel.read()
    return rec


def test_context_parallel_records_equal_one_process_over_the_whole_row(ranks):
    world, spec, out, _ = ranks
    recs = out[0]["cp"]
    assert [r["layer"] for r in recs] == list(range(len(spec["cases"])))
    for r in range(1, world):
        assert out[r]["cp"] == recs  # every rank reads the same reduced records
    outliers = 0
    for i, c in enumerate(spec["cases"]):
        want = _reference(c, layer=i)
        what = f"case {i} ({c['mask']}, {c['scheme']}, {c['mode']}, R={world})"
        _close(recs[i], want, what)
        assert recs[i]["ranks"] == world and want["ranks"] == 1, what
        assert recs[i]["tokens"] == c["B"] * c["L"] == want["tokens"], what
        assert (recs[i]["learned_sink_mass"] is None) == (c["sinks"] is None), what
        outliers += sum(want["out_outliers"])
    assert outliers > 0  # the outlier counts were exercised


def test_a_read_is_one_all_reduce_per_kind_and_quiet_steps_send_nothing(ranks):
    world, _, out, _ = ranks
    for r in range(world):
        res = out[r]
        assert res["cp_read_calls"] == [("all_reduce", "MAX"), ("all_reduce", "SUM")], res["cp_read_calls"]
        assert res["dp_read_calls"] == [("all_reduce", "MAX"), ("all_reduce", "SUM")], res["dp_read_calls"]
        # A non-logging step with telemetry attached sends exactly what the step without it does
        # (the K/V exchange), and a read after it sends nothing.
        assert res["cp_quiet_step_calls"] == res["cp_plain_step_calls"]
        assert all(name != "all_reduce" or op is None for name, op in res["cp_quiet_step_calls"])
        assert res["cp_quiet_read"] == [] and res["cp_quiet_read_calls"] == []


def test_data_parallel_records_equal_one_process_over_the_concatenated_batch(ranks):
    world, spec, out, dp_lines = ranks
    dp = spec["dp"]
    plan = tessera.plan(tessera.causal() & tessera.document(dp["ids"]), q_len=dp["L"], heads=dp["H"],
                        block=16)
    ref = tessera.Telemetry(every=1, **CONFIG)
    for step in range(2):
        for layer in range(2):
            tt.attention(dp["q"][step][layer], dp["k"][step][layer], dp["v"][step][layer], plan,
                         telemetry=ref, layer=layer, sinks=dp["sinks"] if layer else None)
        ref.advance()
    want = ref.read()
    # rank 0 wrote the file, once; every rank returned the count
    got = [json.loads(x) for x in dp_lines]
    assert [(r["step"], r["layer"]) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(out[r]["dp_written"] == 4 for r in range(world))
    assert all(out[r]["dp_again"] == [] for r in range(world))
    for g, w in zip(got, want):
        _close(g, w, f"DP step {w['step']} layer {w['layer']} R={world}")
        assert g["ranks"] == world and g["tokens"] == dp["rows"] * world * dp["L"]
    assert sum(sum(w["out_outliers"]) for w in want) > 0


def test_cp_times_dp_records_equal_one_process(ranks):
    world, spec, out, _ = ranks
    if world != 4:
        pytest.skip("CP x DP needs 4 ranks")
    recs = out[0]["cpdp"]
    for r in range(1, world):
        assert out[r]["cpdp"] == recs
        assert out[r]["cpdp_read_calls"] == [("all_reduce", "MAX"), ("all_reduce", "SUM")]
    for i, c in enumerate(spec["cpdp_cases"]):
        want = _reference(c, layer=i)  # both batch rows, whole rows
        _close(recs[i], want, f"CPxDP case {i} ({c['scheme']}, {c['mode']})")
        assert recs[i]["ranks"] == 4 and recs[i]["tokens"] == 2 * c["L"]


def test_a_per_rank_read_is_refused(ranks):
    world, _, out, _ = ranks
    for r in range(world):
        e = out[r]["errors"]
        assert e["per_rank_read"] is not None and "group" in e["per_rank_read"], e["per_rank_read"]
        assert e["per_rank_cp"] is not None and "group" in e["per_rank_cp"], e["per_rank_cp"]
        # No public accessor of partial summaries: the public surface is the gate and the read.
        assert out[r]["public"] == ["advance", "config", "every", "group", "read", "should_log", "step",
                                    "write_jsonl"]


def test_a_rank_that_skips_the_read_makes_the_others_raise_within_the_timeout(ranks):
    world, _, out, _ = ranks
    for r in range(world - 1):
        msg = out[r]["errors"]["skipped"]
        assert msg is not None and "telemetry reduction" in msg and "collective" in msg, (r, msg)
        assert out[r]["errors"]["skipped_s"] < SKIP_TIMEOUT + 3.0, out[r]["errors"]["skipped_s"]


def test_naive_per_rank_outlier_counts_would_be_wrong(ranks):
    """The CP records' outlier counts are the single-process ones, while summing each rank's
    counts against its own part's RMS (what a per-rank kernel count gives) is not: the check
    above is sensitive to the threshold being the whole slice's."""
    world, spec, out, _ = ranks
    differs = 0
    for i, c in enumerate(spec["cases"]):
        plan = tessera.plan(tessera.causal() & tessera.document(c["ids"]) if c["mask"] == "doc"
                            else tessera.mask(c["mask"]), q_len=c["L"], heads=c["H"], batch=c["B"],
                            block=c["block"])
        o = tt.attention(c["q"], c["k"], c["v"], plan, softcap=c["softcap"], sinks=c["sinks"]).double()
        sh = tessera.cp.shard(plan, world, c["scheme"])
        naive = torch.zeros(c["H"], dtype=torch.int64)
        for r in range(world):
            part = o[:, :, torch.as_tensor(sh.positions(r))]
            rms = part.square().mean((2, 3)).sqrt()[..., None, None]
            naive += (part.abs() > CONFIG["outlier_ratio"] * rms).sum((0, 2, 3))
        differs += naive.tolist() != out[0]["cp"][i]["out_outliers"]
    assert differs > 0


# -- in one process ------------------------------------------------------------------------------


def test_outlier_candidates_hold_every_possible_outlier_and_few_others(rng):
    from tessera import _tessera

    b, h, lr, d, ratio = 2, 3, 40, 16, 2.5
    o = torch.randn(b, h, lr, d, dtype=torch.float64)
    o[..., 0] *= 6
    o = o.float()
    n = 4 * lr * d  # the whole slice has 4x this rank's part
    sq, counts, cand = _tessera.outlier_candidates(o.numpy(), n, ratio)
    of = o.double()
    assert np.allclose(sq, of.square().sum((2, 3)).numpy(), rtol=1e-12)
    bound = ratio * np.sqrt(sq / n)
    want = [np.sort(of[i, j].abs().flatten().numpy()[of[i, j].abs().flatten().numpy() > bound[i, j]])
            for i in range(b) for j in range(h)]
    assert counts.flatten().tolist() == [len(w) for w in want]
    got = np.split(cand.astype(np.float64), np.cumsum(counts.flatten())[:-1])
    for g, w in zip(got, want):
        assert np.array_equal(np.sort(g), w)
    assert (counts < n / ratio**2).all()  # the bound on what a rank keeps
    # bf16 (as its int16 pattern): the candidates of the same values in f32
    ob = o.bfloat16()
    sqb, cb, candb = _tessera.outlier_candidates(ob.view(torch.int16).numpy(), n, ratio)
    sqf, cf, candf = _tessera.outlier_candidates(ob.float().numpy(), n, ratio)
    assert np.array_equal(sqb, sqf) and np.array_equal(cb, cf) and np.array_equal(candb, candf)
    # with the whole slice on this rank and the kernel's ratio, the count is the kernel's
    plan = tessera.plan(tessera.causal(), q_len=lr, heads=h, block=16)
    q, k, v = (torch.randn(b, h, lr, d) for _ in range(3))
    v[..., 0] *= 8
    tel = tessera.Telemetry(every=1, outlier_ratio=ratio)
    out = tt.attention(q, k, v, plan, telemetry=tel)
    (rec,) = tel.read()
    sq, counts, cand = _tessera.outlier_candidates(out.numpy(), lr * d, ratio)
    thr = ratio * np.sqrt(sq / (lr * d))
    sid = np.repeat(np.arange(b * h), counts.flatten())
    per_head = np.bincount((sid[cand > thr.flatten()[sid]]) % h, minlength=h)
    assert per_head.tolist() == rec["out_outliers"]
    assert rec["ranks"] == 1 and rec["tokens"] == b * lr
    for kwargs, exc, needle in [
        (dict(o=o.numpy(), slice_len=lr * d - 1, ratio=1.0), ValueError, "slice_len"),
        (dict(o=o.numpy(), slice_len=n, ratio=-1.0), ValueError, "ratio"),
        (dict(o=o.double().numpy(), slice_len=n, ratio=1.0), TypeError, "o"),
        (dict(o=o[0].numpy(), slice_len=n, ratio=1.0), ValueError, "o"),
    ]:
        with pytest.raises(exc, match=needle):
            _tessera.outlier_candidates(**kwargs)


def test_telemetry_group_argument_errors():
    with pytest.raises(TypeError, match="group"):
        tessera.Telemetry(every=1, group="world")
    with pytest.raises(TypeError, match="group"):
        tessera.Telemetry(every=1, group=[object()])
    with pytest.raises(ValueError, match="group"):
        tessera.Telemetry(every=1, group=())


def test_sink_flags_of_a_local_plan_must_be_given():
    from tessera import _tessera

    L = 128
    ids = np.repeat(np.arange(4), 32)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, block=16)
    flags = _tessera.telemetry_sink_flags(plan._p, 2, 2)
    want = np.zeros((2, L), dtype=bool)
    want[:, [0, 1, 32, 33, 64, 65, 96, 97]] = True
    assert flags.dtype == bool and np.array_equal(flags, want)
    sh = tessera.cp.shard(plan, 2, "zigzag")
    lp = sh.local_plan(0)
    with pytest.raises(ValueError, match="plan"):
        _tessera.telemetry_sink_flags(lp._p, 1, 1)
    q = torch.randn(1, 1, L // 2, 8)
    kv = torch.randn(1, 1, L, 8)
    args = [_np(x) for x in (q, kv, kv)]
    o, lse, ml = np.zeros((1, 1, L // 2, 8), np.float32), np.zeros((1, 1, L // 2), np.float32), np.zeros((1, 1), np.float32)
    stats = np.zeros((1, _tessera.TELEMETRY_COLUMNS))
    with pytest.raises(ValueError, match="sink_flags"):
        _tessera.attention_forward_logged(lp._p, *args, o, lse, ml, stats)
    with pytest.raises(ValueError, match="sink_flags"):
        _tessera.attention_forward_logged(lp._p, *args, o, lse, ml, stats, sink_flags=np.zeros((1, 5), bool))
