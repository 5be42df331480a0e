#!/usr/bin/env python3
"""Measured context-parallel step on CPU ranks: `tessera.cp.attention` forward + backward over a
gloo group on loopback, per scheme and K/V exchange mode.

One packed doc-causal row of `--len` tokens (the cp-sim body mix: lognormal lengths, median 1000
tokens, seeded; plus one `--long`-token document), B = 1, H = Hkv = `--heads`, D = `--dim`, f32,
tile 128. `--ranks` processes, one kernel thread each (RAYON_NUM_THREADS=1,
torch.set_num_threads(1)). A step is barrier → forward + backward → barrier, timed on every
rank; the step time is the slowest rank's, median of `--reps` steps after one warm-up step.
Also prints each scheme's modelled max/mean cost, the busiest receiver's K/V tiles in needed mode
and that as a fraction of an all-gather. `--web` draws the row from the packed web-document mix
instead (1 % of documents 32K-128K tokens, no extra long document); `--balance-cap` is the balanced
scheme's cap on max/mean cost. `--model-only` prints the sharding numbers without running ranks.

Usage: .venv/bin/python bench/cp_step.py [--ranks 4] [--len 32768] [--reps 3] [--web] [--json]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta


def row_ids(length, long_doc, seed, web=False):
    import numpy as np
    import tessera.cp

    if web:
        return tessera.cp.doc_mix(length, seed=seed, long_fraction=0.0, long_docs=0.01)
    ids = tessera.cp.doc_mix(length, seed=seed, long_fraction=0.0)
    if long_doc:
        ids = ids.copy()
        start = length // 3
        ids[start : start + long_doc] = ids.max() + 1
    # documents are contiguous runs: renumber runs so the long one does not merge neighbours
    runs = np.concatenate([[0], np.cumsum(ids[1:] != ids[:-1])])
    return runs


def model_numbers(sh):
    return dict(
        imbalance=sh.imbalance(),
        kv_tiles_remote_max=max(c["kv_tiles_remote"] for c in sh.costs),
        kv_tiles_allgather=(sh.world_size - 1) * sh.tokens_per_rank // sh.block,
        kv_fraction=sh.kv_fraction(),
    )


def model_only(args):
    """The sharding numbers of every scheme, no ranks run."""
    import tessera
    import tessera.cp

    ids = row_ids(args.len, args.long, args.seed, args.web)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=args.len, heads=1)
    res = {}
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        sh = tessera.cp.shard(plan, args.ranks, scheme, balance_cap=args.balance_cap)
        res[scheme] = dict(shard_ms=(time.perf_counter() - t0) * 1e3, **model_numbers(sh))
    return res


def worker(rank, world, port, args, out):
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import tessera
    import tessera.cp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    ids = row_ids(args.len, args.long, args.seed, args.web)
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=args.len, heads=args.heads)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.heads, args.len, args.dim, generator=g) for _ in range(4)]
    res = {}
    for scheme in args.schemes.split(","):
        sh = tessera.cp.shard(plan, world, scheme, balance_cap=args.balance_cap)
        q, k, v, d_o = (sh.scatter(x, dim=2).contiguous() for x in full)
        for mode in args.modes.split(","):
            times = []
            for it in range(args.reps + 1):
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                dist.barrier()
                t0 = time.perf_counter()
                o = tessera.cp.attention(qq, kk, vv, sh, mode=mode)
                o.backward(d_o)
                dist.barrier()
                if it:
                    times.append(time.perf_counter() - t0)
            res[f"{scheme}/{mode}"] = dict(
                step_s=statistics.median(times),
                **model_numbers(sh),
            )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def table(res, label, cell):
    """One row per result: scheme (and mode), `label`, modelled max/mean, the busiest receiver's
    K/V tiles in needed mode (all-gather's in parentheses) and their ratio."""
    print(f"| scheme | {label} | modelled max/mean | K/V tiles in, max rank (all-gather) | "
          "max needed / all-gather |")
    print("|---|---|---|---|---|")
    for key, r in res.items():
        print(f"| {key} | {cell(r)} | {r['imbalance']:.3f} | {r['kv_tiles_remote_max']} "
              f"({r['kv_tiles_allgather']}) | {r['kv_fraction']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--long", type=int, default=8192, help="tokens of the one long document")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", default="contiguous,zigzag,perdoc_zigzag,balanced")
    ap.add_argument("--modes", default="allgather,needed")
    ap.add_argument("--web", action="store_true", help="the packed web-document mix")
    ap.add_argument("--balance-cap", type=float, default=1.02)
    ap.add_argument("--model-only", action="store_true", help="sharding numbers only, no ranks")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mix = "web mix" if args.web else "body mix + one long document"
    if args.model_only:
        report(args, model_only(args), f"{args.ranks} ranks, {args.len}-token doc-causal row "
               f"({mix}, seed {args.seed})", "shard ms", lambda r: f"{r['shard_ms']:.1f}")
        return
    report(args, run_ranks(args), f"{args.ranks} CPU ranks (gloo, loopback), {args.len}-token "
           f"doc-causal row ({mix}, seed {args.seed}), H={args.heads} D={args.dim} f32, "
           f"forward+backward, median of {args.reps}", "step s", lambda r: f"{r['step_s']:.3f}")


def report(args, res, title, label, cell):
    if args.json:
        print(json.dumps(dict(args=vars(args), results=res)))
        return
    print(title)
    table(res, label, cell)


def run_ranks(args):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        mp.start_processes(worker, args=(args.ranks, port, args, out), nprocs=args.ranks,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
