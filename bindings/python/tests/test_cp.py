"""Context parallelism (tessera.cp): shardings from Python, local plans run by the kernel against
single-process attention, and real 2- and 4-rank gloo groups on loopback (spawned processes,
bounded in time): every scheme and both K/V exchange modes equal single-process outputs and
gradients; a rank with a different plan and a rank that dies make every other rank raise."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tessera
import tessera.cp
import tessera.torch
from conftest import launch_ranks, packed_ids, rel

SCHEMES = tessera.cp.SCHEMES
MODES = tessera.cp.MODES


def _ids(rng, L, long_doc):
    """Ragged documents, padding runs and a tail, plus one document longer than a rank's share."""
    ids = packed_ids(rng, 1, L, 40, pad_tail=True, pad_inside=True)[0]
    ids[20 : 20 + long_doc] = 1000
    return ids


# -- in one process ----------------------------------------------------------------------------


def test_shard_deals_equal_whole_tiles_and_is_deterministic(rng):
    L = 512
    plan = tessera.plan(tessera.causal() & tessera.document(_ids(rng, L, 200)), q_len=L, block=16)
    for R in (1, 2, 4, 8):
        for scheme in SCHEMES:
            sh = tessera.cp.shard(plan, R, scheme)
            perm = sh.permutation()
            assert sorted(perm.tolist()) == list(range(L))
            assert sh.tokens_per_rank == L // R
            for r in range(R):
                pos = sh.positions(r)
                assert len(pos) == L // R and np.all(np.diff(pos) > 0)
                assert np.array_equal(pos.reshape(-1, 16)[:, 0] // 16, sh.owned(r))
            again = tessera.cp.shard(plan, R, scheme)
            assert again.fingerprint == sh.fingerprint
            pairs = sum(c["pairs"] for c in sh.costs)
            assert pairs == plan.stats["allowed_pairs"]
    z = tessera.cp.shard(tessera.plan(tessera.causal(), q_len=L, block=16), 4, "zigzag")
    assert z.owned(0).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert z.fingerprint != tessera.cp.shard(plan, 4, "zigzag").fingerprint


def test_bad_arguments_are_clear_errors():
    plan = tessera.plan(tessera.causal(), q_len=512, block=16)  # 32 tiles
    with pytest.raises(ValueError, match="pad the row to 528"):
        tessera.cp.shard(plan, 3)
    with pytest.raises(ValueError, match="64 chunks"):
        tessera.cp.shard(plan, 32, "zigzag")
    with pytest.raises(ValueError, match="scheme"):
        tessera.cp.shard(plan, 2, "ring")
    with pytest.raises(TypeError, match="world_size"):
        tessera.cp.shard(plan, 2.0)
    with pytest.raises(ValueError, match="world_size"):
        tessera.cp.shard(plan, 0)
    with pytest.raises(TypeError, match="plan"):
        tessera.cp.shard("causal", 2)
    with pytest.raises(ValueError, match="q_len == kv_len"):
        tessera.cp.shard(tessera.plan(tessera.causal(), q_len=256, kv_len=512, block=16), 2)
    with pytest.raises(ValueError, match="partial_overhead"):
        tessera.cp.shard(plan, 2, partial_overhead=1.5)
    sh = tessera.cp.shard(plan, 2)
    with pytest.raises(ValueError, match="rank"):
        sh.positions(2)
    with pytest.raises(ValueError, match="mode"):
        sh.local_plan(0, "ring")
    with pytest.raises(ValueError, match="length 512"):
        sh.scatter(torch.zeros(1, 500), rank=0)
    with pytest.raises(ValueError, match="not initialized"):
        sh.scatter(torch.zeros(1, 512))
    with pytest.raises(ValueError, match="expected 2 pieces"):
        sh.gather([torch.zeros(1, 256)])
    with pytest.raises(ValueError, match="not initialized"):
        x = torch.zeros(1, 1, 256, 8)
        tessera.cp.attention(x, x, x, sh)


def test_scatter_gather_round_trip(rng):
    L = 256
    plan = tessera.plan(tessera.causal() & tessera.document(_ids(rng, L, 90)), q_len=L, block=16)
    sh = tessera.cp.shard(plan, 4, "balanced")
    x = torch.randn(3, L, 5)
    pos = torch.arange(L).expand(3, L)
    pieces = [sh.scatter(x, rank=r) for r in range(4)]
    assert torch.equal(sh.gather(pieces), x)
    for r in range(4):
        assert torch.equal(sh.scatter(pos, rank=r)[0], sh.index(r))
        assert np.array_equal(sh.scatter(x.numpy(), rank=r), pieces[r].numpy())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", MODES)
def test_local_plans_run_by_the_kernel_equal_whole_row_attention(rng, scheme, mode):
    """Each rank's local problem, run in this process on the K/V its mode receives, gives the
    rank's rows of single-process attention (the exchange itself is tested with processes)."""
    L, R, B, H, D = 256, 4, 2, 2, 8
    ids = np.stack([_ids(rng, L, 100), _ids(rng, L, 30)])
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=16)
    sh = tessera.cp.shard(plan, R, scheme)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    ref, ref_lse = tessera.torch.attention(q, k, v, plan, return_lse=True, softcap=5.0)
    for r in range(R):
        pos = torch.as_tensor(sh.positions(r))
        kv_tiles = sh.local_kv_tiles(r, mode)
        kv_pos = torch.as_tensor((kv_tiles[:, None] * 16 + np.arange(16)).reshape(-1))
        lp = sh.local_plan(r, mode)
        assert lp.source == "sharded" and lp.mask is None
        o, lse = tessera.torch.attention(
            q[:, :, pos], k[:, :, kv_pos], v[:, :, kv_pos], lp, return_lse=True, softcap=5.0
        )
        assert rel(o, ref[:, :, pos]) <= 1e-5
        finite = torch.isfinite(ref_lse[:, :, pos])
        assert torch.equal(finite, torch.isfinite(lse))
        assert (lse[finite] - ref_lse[:, :, pos][finite]).abs().max() <= 1e-4


def test_simulate_reports_every_scheme_and_the_bar():
    rows, assumptions = tessera.cp.simulate([128 * 1024], [2, 8])
    assert len(rows) == 2 * len(SCHEMES) and len(assumptions) == 3
    by = {(r["ranks"], r["scheme"]): r for r in rows}
    for R in (2, 8):
        b = by[(R, "balanced")]
        assert b["cost_max_over_mean"] <= by[(R, "zigzag")]["cost_max_over_mean"]
        assert b["needed_bytes_max"] < b["allgather_bytes"]
        assert all(r["extra_tiles"] == 0 for r in rows)
    ids = tessera.cp.doc_mix(65536, seed=3)
    assert np.array_equal(ids, tessera.cp.doc_mix(65536, seed=3)) and ids.shape == (65536,)


# -- real ranks --------------------------------------------------------------------------------


def _cases(world: int, seed: int):
    rng = np.random.default_rng(seed)
    L, B, H, HKV, D = 256, 2, 2, 1, 8
    # rows of different documents; one document (100+ tokens) longer than a rank's share at R=4
    ids = np.stack([_ids(rng, L, 100 + 20 * world), _ids(rng, L, 40)])
    cases = []
    for i, (scheme, mode) in enumerate((s, m) for s in SCHEMES for m in MODES):
        sinks = torch.randn(H) if i % 2 == 0 else None
        cases.append(dict(mask="doc", ids=ids, scheme=scheme, mode=mode,
                          softcap=4.0 if i % 3 == 0 else None, sinks=sinks))
    for mode in MODES:  # not a document mask: windows and a prefix, every kv tile has an owner
        cases.append(dict(mask="window(40) | prefix(8)", ids=None, scheme="balanced", mode=mode,
                          softcap=None, sinks=None))
    # a per-step block selection (docs/semantics.md#masks): per (row, head) 3 kv tiles of 16 (-1 = none)
    sel = np.where(rng.random((B, H, L // 16, 3)) < 0.2, -1, rng.integers(0, L // 16, (B, H, L // 16, 3)))
    for mode in MODES:
        cases.append(dict(mask="causal & document & blocks(16, 16, sel)", ids=ids, blocks={"sel": sel},
                          scheme="zigzag" if mode == "needed" else "balanced", mode=mode, softcap=None,
                          sinks=None))
    g = torch.Generator().manual_seed(seed)
    for c in cases:
        c.update(L=L, B=B, H=H, block=16)
        c["q"] = torch.randn(B, H, L, D, generator=g)
        c["k"] = torch.randn(B, HKV, L, D, generator=g)
        c["v"] = torch.randn(B, HKV, L, D, generator=g)
        c["d_o"] = torch.randn(B, H, L, D, generator=g)
    return dict(cases=cases, mismatch_ids=np.repeat(np.arange(8), 32), die=True)


def _launch(world: int, spec, timeout_s: float = 240.0):
    import cp_worker

    out, codes, _ = launch_ranks(cp_worker.run, world, spec, "tessera-cp-", timeout_s)
    return out, codes


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    world = request.param
    spec = _cases(world, seed=100 + world)
    out, codes = _launch(world, spec)
    return world, spec, out, codes


def test_ranks_equal_single_process_outputs_and_gradients(ranks):
    world, spec, out, _ = ranks
    for i, c in enumerate(spec["cases"]):
        mask = (tessera.causal() & tessera.document(c["ids"]) if c["mask"] == "doc"
                else tessera.mask(c["mask"], segments=c["ids"], blocks=c.get("blocks")))
        plan = tessera.plan(mask, q_len=c["L"], heads=c["H"], batch=c["B"], block=c["block"])
        q, k, v = (c[n].clone().requires_grad_() for n in ("q", "k", "v"))
        sinks = None if c["sinks"] is None else c["sinks"].clone().requires_grad_()
        o, lse = tessera.torch.attention(q, k, v, plan, softcap=c["softcap"], sinks=sinks,
                                         return_lse=True)
        (o * c["d_o"]).sum().backward()
        what = f"case {i} ({c['mask']}, {c['scheme']}, {c['mode']}, R={world})"
        for r in range(world):
            res = out[r]["cases"][i]
            pos = torch.as_tensor(res["positions"])
            assert rel(res["o"], o.detach()[:, :, pos]) <= 1e-5, what
            ref_lse = lse.detach()[:, :, pos]
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(res["lse"])), what
            assert (res["lse"][fin] - ref_lse[fin]).abs().max() <= 1e-4, what
            assert rel(res["dq"], q.grad[:, :, pos]) <= 1e-5, what
            assert rel(res["dk"], k.grad[:, :, pos]) <= 1e-5, what
            assert rel(res["dv"], v.grad[:, :, pos]) <= 1e-5, what
            if sinks is not None:
                assert rel(res["dsinks"], sinks.grad) <= 1e-5, what
            assert rel(res["full_o"], o.detach()) <= 1e-5, what


def test_a_rank_with_a_different_plan_makes_every_rank_raise(ranks):
    world, _, out, _ = ranks
    for r in range(world):
        msg = out[r]["errors"]["mismatch"]
        assert msg is not None and "sharded a different plan" in msg, (r, msg)
        assert str(world - 1) in msg.split("ranks")[1] if r != world - 1 else True


def test_a_rank_that_dies_makes_the_others_raise_in_bounded_time(ranks):
    world, _, out, codes = ranks
    assert codes[world - 1] == 3
    for r in range(world - 1):
        msg = out[r]["errors"]["dead"]
        assert msg is not None and "peer rank died" in msg, (r, msg)
        assert out[r]["errors"]["dead_s"] < 35.0
