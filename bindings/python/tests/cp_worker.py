"""A rank of the context-parallel tests (spawned by test_cp.py; not collected by pytest).

Each rank joins a gloo group on loopback, runs every case of the case file (shard, scatter, the
distributed op forward and backward), and saves its local outputs and gradients, plus what the
failure cases raised, for the parent to compare with single-process attention.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta


def run(rank: int, world: int, port: int, case_file: str, out_dir: str) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import tessera
    import tessera.cp

    torch.set_num_threads(1)
    results = {"cases": [], "errors": {}}
    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        spec = torch.load(case_file, weights_only=False)
        for case in spec["cases"]:
            plan = tessera.plan(
                tessera.causal() & tessera.document(case["ids"]) if case["mask"] == "doc" else
                tessera.mask(case["mask"], segments=case.get("ids"), blocks=case.get("blocks")),
                q_len=case["L"], heads=case["H"], batch=case["B"], block=case["block"],
            )
            sh = tessera.cp.shard(plan, world, case["scheme"])
            # [B, H, L, D] inputs: scatter along the token dim (2) from the shared full tensors.
            q, k, v, d_o = (sh.scatter(case[n], dim=2).clone().requires_grad_(n != "d_o")
                            for n in ("q", "k", "v", "d_o"))
            sinks = case["sinks"].clone().requires_grad_() if case["sinks"] is not None else None
            o, lse = tessera.cp.attention(
                q, k, v, sh, mode=case["mode"], softcap=case["softcap"], sinks=sinks,
                return_lse=True,
            )
            (o * d_o).sum().backward()
            # gather() puts the row back together through an all-gather: checks it too.
            full_o = sh.gather(o.detach(), dim=2)
            results["cases"].append({
                "o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "dsinks": None if sinks is None else sinks.grad, "positions": sh.positions(rank),
                "full_o": full_o,
            })
        # A rank that sharded a different plan: every rank raises a clear error.
        ids = spec["mismatch_ids"]
        L = len(ids)
        mask = tessera.causal() & tessera.document(ids if rank != world - 1 else ids[::-1].copy())
        sh = tessera.cp.shard(tessera.plan(mask, q_len=L, block=16), world, "balanced")
        x = torch.randn(1, 1, L // world, 8)
        try:
            tessera.cp.attention(x, x, x, sh)
            results["errors"]["mismatch"] = None
        except ValueError as e:
            results["errors"]["mismatch"] = str(e)
        # A rank that dies: the others raise within the group's timeout, never hang.
        if spec.get("die"):
            plan = tessera.plan(tessera.causal(), q_len=L, block=16)
            sh = tessera.cp.shard(plan, world, "zigzag")
            torch.save(results, out)
            if rank == world - 1:
                os._exit(3)
            t0 = time.monotonic()
            try:
                tessera.cp.attention(x, x, x, sh)
                results["errors"]["dead"] = None
            except RuntimeError as e:
                results["errors"]["dead"] = str(e)
            results["errors"]["dead_s"] = time.monotonic() - t0
        torch.save(results, out)
    except BaseException:
        results["crash"] = traceback.format_exc()
        torch.save(results, out)
        raise
    finally:
        # A group with a dead member cannot be shut down cleanly; the process exits anyway.
        if not spec_die_pending(results):
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spec_die_pending(results) -> bool:
    return "dead" in results.get("errors", {})
