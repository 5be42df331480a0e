"""A rank of the multi-rank telemetry tests (spawned by test_telemetry_ranks.py; not collected).

Each rank joins a gloo group on loopback and runs, with real collectives:
- context parallelism: every case of the case file (every scheme and K/V mode) through
  ``tessera.cp.attention(..., telemetry=tel, layer=i)`` on a logging step, forward and backward,
  then one ``tel.read()``; and a non-logging step of the same calls;
- data parallelism: its own batch rows through ``tessera.torch.attention(..., telemetry=tel)``;
- with 4 ranks, CP x DP: two CP pairs, each on its own batch, ``Telemetry(group=(cp, dp))``;
- the refusals: a Telemetry without a group in a job of several ranks;
- a rank that never calls ``read()`` (the last), while the others do.

Every collective of ``torch.distributed`` is counted (the real functions run, wrapped by a
counter), so the parent can check how many collectives a read and a non-logging step issue.
Results go to ``rank{r}.pt``.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

_COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast",
            "reduce_scatter", "reduce_scatter_tensor", "barrier", "all_gather_object", "gather",
            "scatter", "reduce", "send", "recv", "isend", "irecv")


def _count_collectives(dist):
    """Wraps every collective of ``dist`` with a counter; returns the list of calls (name, op)."""
    calls = []
    for name in _COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*a, __fn=fn, __name=name, **kw):
            op = kw.get("op")
            calls.append((__name, None if op is None else str(op).split(".")[-1]))
            return __fn(*a, **kw)

        setattr(dist, name, wrapped)
    return calls


def _plan(tessera, ids, c):
    mask = (tessera.causal() & tessera.document(ids)) if c["mask"] == "doc" else tessera.mask(c["mask"])
    return tessera.plan(mask, q_len=c["L"], heads=c["H"], batch=len(ids) if ids is not None else c["B"],
                        block=c["block"])


def _cp_step(tessera, torch, spec, world, tel, group=None, rows=slice(None)):
    """Every CP case once (forward + backward), each as layer i of ``tel``."""
    for i, c in enumerate(spec["cases"]):
        ids = None if c["ids"] is None else c["ids"][rows]
        plan = _plan(tessera, ids, c)
        sh = tessera.cp.shard(plan, world, c["scheme"])
        me = torch.distributed.get_rank(group)  # this rank within the CP group
        q, k, v = (sh.scatter(c[n][rows], rank=me, dim=2).clone().requires_grad_() for n in ("q", "k", "v"))
        sinks = None if c["sinks"] is None else c["sinks"].clone().requires_grad_()
        o = tessera.cp.attention(q, k, v, sh, group, mode=c["mode"], softcap=c["softcap"], sinks=sinks,
                                 telemetry=tel, layer=i)
        o.square().sum().backward()


def run(rank: int, world: int, port: int, case_file: str, out_dir: str) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import tessera
    import tessera.cp
    import tessera.torch as tt

    torch.set_num_threads(1)
    res = {"errors": {}}
    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        calls = _count_collectives(dist)
        spec = torch.load(case_file, weights_only=False)
        cfg = spec["config"]

        # -- context parallelism: a logging step, one read, then a non-logging step -------------
        tel = tessera.Telemetry(every=2, group=dist.group.WORLD, **cfg)
        _cp_step(tessera, torch, spec, world, tel)
        n0 = len(calls)
        res["cp"] = tel.read()
        res["cp_read_calls"] = calls[n0:]
        tel.advance()
        n0 = len(calls)
        _cp_step(tessera, torch, spec, world, tel)
        res["cp_quiet_step_calls"] = calls[n0:]
        n0 = len(calls)
        _cp_step(tessera, torch, spec, world, None)
        res["cp_plain_step_calls"] = calls[n0:]
        n0 = len(calls)
        res["cp_quiet_read"] = tel.read()
        res["cp_quiet_read_calls"] = calls[n0:]

        # -- data parallelism: this rank's own batch rows, two layers, two logged steps ---------
        dp = spec["dp"]
        mine = slice(rank * dp["rows"], (rank + 1) * dp["rows"])
        tel = tessera.Telemetry(every=1, group=dist.group.WORLD, **cfg)
        plan = tessera.plan(tessera.causal() & tessera.document(dp["ids"][mine]), q_len=dp["L"],
                            heads=dp["H"], block=16)
        for step in range(2):
            for layer in range(2):
                q, k, v = (dp[n][step][layer][mine] for n in ("q", "k", "v"))
                tt.attention(q, k, v, plan, telemetry=tel, layer=layer,
                             sinks=dp["sinks"] if layer else None)
            tel.advance()
        n0 = len(calls)
        path = os.path.join(out_dir, "dp.jsonl")
        res["dp_written"] = tel.write_jsonl(path)
        res["dp_read_calls"] = calls[n0:]
        res["dp_again"] = tel.read()  # a logging step read twice: reduces nothing, returns []

        # -- CP x DP (4 ranks): CP pairs {0,1}, {2,3}; DP pairs {0,2}, {1,3} ---------------------
        if world == 4:
            cps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            cp_g, dp_g = cps[rank // 2], dps[rank % 2]
            tel = tessera.Telemetry(every=1, group=(cp_g, dp_g), **cfg)
            rows = slice((rank // 2) * 1, (rank // 2) * 1 + 1)  # each CP pair its own batch row
            cpdp = dict(spec, cases=spec["cpdp_cases"])
            _cp_step(tessera, torch, cpdp, 2, tel, group=cp_g, rows=rows)
            n0 = len(calls)
            res["cpdp"] = tel.read()
            res["cpdp_read_calls"] = calls[n0:]

        # -- refusals: no per-rank read ------------------------------------------------------------
        c = spec["cases"][0]
        plan = _plan(tessera, c["ids"], c)
        alone = tessera.Telemetry(every=1)
        tt.attention(c["q"], c["k"], c["v"], plan, telemetry=alone)
        try:
            alone.read()
            res["errors"]["per_rank_read"] = None
        except ValueError as e:
            res["errors"]["per_rank_read"] = str(e)
        sh = tessera.cp.shard(plan, world, "balanced")
        try:
            tessera.cp.attention(*(sh.scatter(c[n], dim=2) for n in ("q", "k", "v")), sh, telemetry=alone)
            res["errors"]["per_rank_cp"] = None
        except ValueError as e:
            res["errors"]["per_rank_cp"] = str(e)
        res["public"] = sorted(n for n in dir(alone) if not n.startswith("_"))

        # -- a rank that never calls read(): the others raise within the group's timeout --------
        short = dist.new_group(list(range(world)), timeout=timedelta(seconds=spec["skip_timeout"]))
        tel = tessera.Telemetry(every=1, group=short, **cfg)
        tt.attention(c["q"], c["k"], c["v"], plan, telemetry=tel)
        torch.save(res, out)
        if rank == world - 1:
            time.sleep(spec["skip_timeout"] + 1.5)  # never reads; exits after the others raised
            torch.save(res, out)
            os._exit(0)
        t0 = time.monotonic()
        try:
            tel.read()
            res["errors"]["skipped"] = None
        except RuntimeError as e:
            res["errors"]["skipped"] = str(e)
        res["errors"]["skipped_s"] = time.monotonic() - t0
        torch.save(res, out)
        os._exit(0)  # the group has a rank that left mid-collective: no clean shutdown
    except BaseException:
        res["crash"] = traceback.format_exc()
        torch.save(res, out)
        raise
