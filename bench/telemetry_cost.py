#!/usr/bin/env python3
"""What telemetry across ranks costs: a training step of `--layers` context-parallel attention
layers on gloo ranks, with telemetry off, attached on a non-logging step, and on a logging step
with its reduction and read.

One packed doc-causal row of `--len` tokens (the cp-sim body mix: lognormal lengths, median 1000
tokens, seeded), B = 1, H = Hkv = `--heads`, D = `--dim`, f32, tile 128, `--ranks` processes
(one kernel thread each), `tessera.cp.attention` (scheme `--scheme`, mode `--mode`) for every
layer, forward + backward. Variants, interleaved round by round:

- off:     `telemetry=None`;
- quiet:   `telemetry=tel` with `tel.should_log()` false (a non-logging step), and `tel.read()`
  (a no-op: no logging step since the last read);
- logging: `telemetry=tel` on a logging step, then `tel.read()` (the packed all-reduces of every
  layer's partials and the one host read) inside the timed step.

A step is barrier -> layers forward + backward (+ read) -> barrier, timed on every rank in wall
time (the round's: the slowest rank's) and in process CPU time (the round's: the largest rank's;
time blocked on a peer is not CPU time, and on a shared machine CPU time is far less disturbed by
other jobs than wall time); the order of the three variants rotates from round to round.
Reported: medians of the step times and of the per-round ratios quiet/off and logging/quiet.
Targets, judged on CPU time: quiet/off <= 1.01, logging/quiet <= 1.10.

`--parallel dp`: data parallelism instead (every rank its own `--len` row through
`tessera.torch.attention`, the same variants).

Usage: .venv/bin/python bench/telemetry_cost.py [--ranks 2] [--len 8192] [--rounds 15] [--json]
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


def row_ids(length, seed):
    import numpy as np
    import tessera.cp

    ids = tessera.cp.doc_mix(length, seed=seed, long_fraction=0.0)
    return np.concatenate([[0], np.cumsum(ids[1:] != ids[:-1])])


def worker(rank, world, port, args, out):
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import torch
    import torch.distributed as dist

    import tessera
    import tessera.cp
    import tessera.torch as tt

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    ids = row_ids(args.len, args.seed + (rank if args.parallel == "dp" else 0))
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=args.len, heads=args.heads)
    g = torch.Generator().manual_seed(rank if args.parallel == "dp" else 0)
    H, L, D = args.heads, args.len, args.dim
    layers = []
    sh = None
    if args.parallel == "cp":
        sh = tessera.cp.shard(plan, world, args.scheme)
    for _ in range(args.layers):
        full = [torch.randn(1, H, L, D, generator=g) for _ in range(4)]
        if sh is not None:
            full = [sh.scatter(x, dim=2).contiguous() for x in full]
        layers.append(full)

    tel = tessera.Telemetry(every=1, group=dist.group.WORLD)  # logging steps
    quiet = tessera.Telemetry(every=1 << 30, group=dist.group.WORLD)
    quiet.advance()  # step 1 of a huge cadence: never logs

    read_s = []

    def step(t):
        for i, (q, k, v, d_o) in enumerate(layers):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            if sh is not None:
                o = tessera.cp.attention(qq, kk, vv, sh, mode=args.mode, telemetry=t, layer=i)
            else:
                o = tt.attention(qq, kk, vv, plan, telemetry=t, layer=i)
            o.backward(d_o)
        if t is not None:
            t0 = time.perf_counter()
            t.read()  # the logging step's reduction and read; a no-op without a message otherwise
            if t is tel:
                read_s.append(time.perf_counter() - t0)
            t.advance()

    variants = [("off", None), ("quiet", quiet), ("logging", tel)]
    times = {k: [] for k, _ in variants}
    cpu = {k: [] for k, _ in variants}
    for rnd in range(args.rounds + 1):
        # the order rotates round by round, so no variant always follows the same one
        for name, t in variants[rnd % 3 :] + variants[: rnd % 3]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(t)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            dist.barrier()
            slowest = torch.tensor([dt, dc], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rnd:  # round 0 warms up
                times[name].append(float(slowest[0]))
                cpu[name].append(float(slowest[1]))
    times["read"] = read_s[1:]
    # What an attached telemetry adds to a non-logging step, timed directly: per layer the checks
    # of `attention(..., telemetry=)` (type, layer, CP group cached) and the gate, per step the
    # no-op read and the advance.
    import timeit

    from tessera import _int_arg
    from tessera.torch.telemetry import Telemetry

    def quiet_extra():
        for i in range(len(layers)):
            isinstance(quiet, Telemetry)
            _int_arg("attention", "layer", i, 0, 2**32)
            if sh is not None:
                quiet._cp_members(None)
            quiet.should_log()
        quiet.read()
        quiet.should_log()

    n = 20000
    times["quiet_extra"] = [timeit.timeit(quiet_extra, number=n) / n]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(wall=times, cpu=cpu), f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", choices=("cp", "dp"), default="cp")
    ap.add_argument("--scheme", default="balanced")
    ap.add_argument("--mode", default="allgather")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        mp.start_processes(worker, args=(args.ranks, port, args, out), nprocs=args.ranks,
                           start_method="spawn")
        with open(out) as f:
            got = json.load(f)
    times, cpu = got["wall"], got["cpu"]

    def ratios(t):
        return (statistics.median(q / o for q, o in zip(t["quiet"], t["off"])),
                statistics.median(lg / q for lg, q in zip(t["logging"], t["quiet"])))

    med = {k: statistics.median(v) for k, v in times.items() if v}
    cmed = {k: statistics.median(v) for k, v in cpu.items() if v}
    quiet_off, log_quiet = ratios(times)
    cquiet_off, clog_quiet = ratios(cpu)
    res = dict(step_s=med, cpu_s=cmed, quiet_extra_s=times["quiet_extra"][0], quiet_over_off=quiet_off, logging_over_quiet=log_quiet,
               cpu_quiet_over_off=cquiet_off, cpu_logging_over_quiet=clog_quiet, rounds=args.rounds,
               bar_quiet=cquiet_off <= 1.01, bar_logging=clog_quiet <= 1.10)
    if args.json:
        print(json.dumps(dict(args=vars(args), results=res, wall=times, cpu=cpu)))
        return
    what = (f"{args.parallel.upper()} over {args.ranks} gloo ranks, {args.len}-token doc-causal row"
            f"{' per rank' if args.parallel == 'dp' else ''}, H={args.heads} D={args.dim} f32, "
            f"{args.layers} layers forward+backward, {args.threads} thread(s) per rank, "
            f"{args.rounds} interleaved rounds")
    print(what)
    print("| variant | wall s, slowest rank | ratio (wall) | CPU s, largest rank | ratio (CPU) | bar (CPU) |")
    print("|---|---|---|---|---|---|")
    print(f"| telemetry off | {med['off']:.3f} | — | {cmed['off']:.3f} | — | — |")
    print(f"| attached, non-logging step | {med['quiet']:.3f} | {100 * (quiet_off - 1):+.2f} % vs off "
          f"| {cmed['quiet']:.3f} | {100 * (cquiet_off - 1):+.2f} % vs off "
          f"| ≤ +1 %: {'met' if res['bar_quiet'] else 'NOT met'} |")
    print(f"| logging step + reduction + read | {med['logging']:.3f} | {100 * (log_quiet - 1):+.2f} % vs "
          f"non-logging | {cmed['logging']:.3f} | {100 * (clog_quiet - 1):+.2f} % vs non-logging "
          f"| ≤ +10 %: {'met' if res['bar_logging'] else 'NOT met'} |")
    print(f"read() of the logging step (both all-reduces, records; rank 0, wall): {1e3 * med['read']:.2f} ms")
    extra = times["quiet_extra"][0]
    print(f"what telemetry adds to a non-logging step, timed directly (rank 0): {1e6 * extra:.1f} µs "
          f"= {100 * extra / med['off']:.4f} % of the step")


if __name__ == "__main__":
    sys.exit(main())
