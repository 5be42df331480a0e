"""A rank of the flex-engine context-parallel tests (spawned by test_cp_flex.py; not collected).

Each rank joins a group (gloo on loopback, or the backend the case file names) and runs every
case through `tessera.cp.attention(engine="flex")`: on CPU the forward on FlexAttention itself (its
CPU path has no backward), then forward and backward with `_flex.reference_kernel` standing in for
FlexAttention's GPU kernels (on GPUs FlexAttention's own backward). `cases` run over the whole
world; `sub_cases` over two-rank subgroups ({0, 1}, {2, 3}, ...: `group=`). It saves its outputs
and gradients for the parent to compare with single-process attention, and what a CPU backward
request raised.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta


def run(rank: int, world: int, port: int, case_file: str, out_dir: str) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import tessera
    import tessera.cp
    from tessera.engines import flex as _flex

    torch.set_num_threads(1)
    results = {"cases": [], "errors": {}}
    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        spec = torch.load(case_file, weights_only=False)
        backend = spec.get("backend", "gloo")
        device = torch.device(spec.get("device", "cpu"))
        if device.type == "cuda" and spec.get("device_per_rank"):
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        standin = device.type == "cpu"  # FlexAttention has a backward on GPUs
        subgroups = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)] if spec.get("sub_cases") else []
        work = [(c, None, world, "cases") for c in spec["cases"]]
        if subgroups and rank < 2 * len(subgroups):
            work += [(c, subgroups[rank // 2], 2, "sub_cases") for c in spec["sub_cases"]]
        results["sub_cases"] = []
        for case, group, size, where in work:
            plan = tessera.plan(
                tessera.causal() & tessera.document(case["ids"]) if case["mask"] == "doc" else
                tessera.mask(case["mask"]),
                q_len=case["L"], heads=case["H"], batch=case["B"], block=case["block"],
            )
            sh = tessera.cp.shard(plan, size, case["scheme"])
            me = dist.get_rank(group)
            q, k, v, d_o = (sh.scatter(case[n], rank=me, dim=2).to(device) for n in ("q", "k", "v", "d_o"))
            d_lse = sh.scatter(case["d_lse"], rank=me, dim=2).to(device)
            sinks = None if case["sinks"] is None else case["sinks"].to(device)
            kw = dict(group=group, mode=case["mode"], softcap=case["softcap"], return_lse=True, engine="flex")
            with torch.no_grad():
                o, lse = tessera.cp.attention(q, k, v, sh, sinks=sinks, **kw)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            s = None if sinks is None else sinks.clone().requires_grad_()
            with _flex.use_kernel(_flex.reference_kernel) if standin else _nothing():
                o2, lse2 = tessera.cp.attention(*leaves, sh, sinks=s, **kw)
                loss = (o2 * d_o).sum() + (torch.where(torch.isfinite(lse2), lse2, 0) * d_lse).sum()
                loss.backward()
            results[where].append({
                "o": o.cpu(), "lse": lse.cpu(), "o2": o2.detach().cpu(), "lse2": lse2.detach().cpu(),
                "dq": leaves[0].grad.cpu(), "dk": leaves[1].grad.cpu(), "dv": leaves[2].grad.cpu(),
                "dsinks": None if s is None else s.grad.cpu(), "positions": sh.positions(me),
            })
        if device.type == "cpu":
            # FlexAttention has no CPU backward: a clear error on every rank
            case = spec["cases"][0]
            plan = tessera.plan(tessera.causal() & tessera.document(case["ids"]), q_len=case["L"],
                                heads=case["H"], batch=case["B"], block=case["block"])
            sh = tessera.cp.shard(plan, world, "balanced")
            q = sh.scatter(case["q"], dim=2).requires_grad_()
            k, v = (sh.scatter(case[n], dim=2) for n in ("k", "v"))
            try:
                tessera.cp.attention(q, k, v, sh, engine="flex")
                results["errors"]["cpu_backward"] = None
            except NotImplementedError as e:
                results["errors"]["cpu_backward"] = str(e)
        torch.save(results, out)
    except BaseException:
        results["crash"] = traceback.format_exc()
        torch.save(results, out)
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
