"""`tessera.cp.attention(engine="flex")`: context parallelism with FlexAttention as the local
kernel (the local plan's BlockMask over the exchanged K/V layout), on real gloo groups of CPU
processes: four ranks, and two-rank subgroups of the same processes (`group=`). Every scheme
and mode: the forward on FlexAttention itself equals
single-process attention; forward and backward (dQ; dK/dV summed on their owners; dσ all-reduced;
a loss on the LSE too) with `_flex.reference_kernel` standing in for FlexAttention's GPU kernels
equal single-process gradients; a CPU backward request raises on every rank."""

from __future__ import annotations


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
    ids = packed_ids(rng, 1, L, 40, pad_tail=True, pad_inside=True)[0]
    ids[20 : 20 + long_doc] = 1000
    return ids


def cases(world: int, seed: int, L: int = 256, block: int = 16, D: int = 8):
    """Every scheme × mode on two rows of ragged documents (one longer than a rank's share),
    GQA 2→1, softcap and sinks on some; a window/prefix mask in both modes."""
    rng = np.random.default_rng(seed)
    B, H, HKV = 2, 2, 1
    ids = np.stack([_ids(rng, L, L // 4 + 20 * world), _ids(rng, L, 40)])
    out = []
    for i, (scheme, mode) in enumerate((s, m) for s in SCHEMES for m in MODES):
        out.append(dict(mask="doc", ids=ids, scheme=scheme, mode=mode, softcap=4.0 if i % 3 == 0 else None,
                        sinks=torch.randn(H) if i % 2 == 0 else None))
    for mode in MODES:
        out.append(dict(mask="window(40) | prefix(8)", ids=None, scheme="balanced", mode=mode, softcap=None,
                        sinks=torch.randn(H)))
    g = torch.Generator().manual_seed(seed)
    for c in out:
        c.update(L=L, B=B, H=H, block=block)
        c["q"] = torch.randn(B, H, L, D, generator=g)
        c["k"] = torch.randn(B, HKV, L, D, generator=g)
        c["v"] = torch.randn(B, HKV, L, D, generator=g)
        c["d_o"] = torch.randn(B, H, L, D, generator=g)
        c["d_lse"] = torch.randn(B, H, L, generator=g)
    return out


def launch(world: int, spec, timeout_s: float = 240.0):
    import cp_flex_worker

    return launch_ranks(cp_flex_worker.run, world, spec, "tessera-cp-flex-", timeout_s)[0]


def check(world: int, spec, out, grad_tol: float = 1e-5, fwd_tol: float = 1e-5, key: str = "cases",
          ranks=None) -> None:
    """The outputs and gradients of ``ranks`` (default: every rank; their rank in the group is their
    index in ``ranks``) for ``spec[key]`` against single-process attention (Tessera's CPU kernels on
    the whole row)."""
    ranks = list(range(world)) if ranks is None else ranks
    for i, c in enumerate(spec[key]):
        mask = (tessera.causal() & tessera.document(c["ids"]) if c["mask"] == "doc" else tessera.mask(c["mask"]))
        plan = tessera.plan(mask, q_len=c["L"], heads=c["H"], batch=c["B"], block=c["block"])
        q, k, v = (c[n].clone().requires_grad_() for n in ("q", "k", "v"))
        sinks = None if c["sinks"] is None else c["sinks"].clone().requires_grad_()
        o, lse = tessera.torch.attention(q, k, v, plan, softcap=c["softcap"], sinks=sinks, return_lse=True,
                                         engine="tessera")
        ((o * c["d_o"]).sum() + (torch.where(torch.isfinite(lse), lse, 0) * c["d_lse"]).sum()).backward()
        what = f"case {i} ({c['mask']}, {c['scheme']}, {c['mode']}, R={world})"
        for r in ranks:
            res = out[r][key][i]
            pos = torch.as_tensor(res["positions"])
            ref_lse = lse.detach()[:, :, pos]
            fin = torch.isfinite(ref_lse)
            for o_name, l_name in (("o", "lse"), ("o2", "lse2")):
                assert rel(res[o_name], o.detach()[:, :, pos]) <= fwd_tol, (what, o_name)
                assert torch.equal(fin, torch.isfinite(res[l_name])), (what, l_name)
                assert (res[l_name][fin] - ref_lse[fin]).abs().max() <= 1e-4, (what, l_name)
            assert rel(res["dq"], q.grad[:, :, pos]) <= grad_tol, (what, "dq")
            assert rel(res["dk"], k.grad[:, :, pos]) <= grad_tol, (what, "dk")
            assert rel(res["dv"], v.grad[:, :, pos]) <= grad_tol, (what, "dv")
            if sinks is not None:
                assert rel(res["dsinks"], sinks.grad) <= grad_tol, (what, "dsinks")


def test_flex_on_4_ranks_and_2_rank_subgroups_equals_single_process():
    spec = dict(cases=cases(4, seed=304), sub_cases=cases(2, seed=302))
    out = launch(4, spec)
    check(4, spec, out)
    check(2, spec, out, key="sub_cases", ranks=[0, 1])
    check(2, spec, out, key="sub_cases", ranks=[2, 3])
    for r in range(4):
        msg = out[r]["errors"]["cpu_backward"]
        assert msg is not None and "no CPU backward" in msg, (r, msg)
