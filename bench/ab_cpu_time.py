#!/usr/bin/env python3
"""Interleaved A/B of `tessera bench` forward CPU time on a shared, loaded host, where wall time
is not usable: one worker thread (RAYON_NUM_THREADS=1), the kernel paths pinned by
TESSERA_CPU_PATHS (no dispatch measurement), `perf stat -e task-clock` of a process at LO = 1
and HI reps; per rep = (min t(HI) - min t(LO)) / (HI - LO) over the rounds (the least-disturbed
runs), and the median of the per-round slopes. Binaries alternate order each round.

Usage: HI=6 MASKS=causal,documents,window DTYPES=f32,bf16 HEADS=2 \
       python3 bench/ab_cpu_time.py ROUNDS PATHS BIN_A BIN_B...
       (PATHS e.g. f32=avx2,bf16=widen-avx2; L = 8192, D = 64.)
"""
import json, os, statistics, subprocess, sys
rounds, paths, bins = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
masks = os.environ.get("MASKS", "causal,documents,window").split(",")
dtypes = os.environ.get("DTYPES", "f32,bf16").split(",")
heads = os.environ.get("HEADS", "2")
lo, hi = 1, int(os.environ.get("HI", "6"))
def run(b, m, dt, reps):
    env = dict(os.environ, RAYON_NUM_THREADS="1", TESSERA_CPU_PATHS=paths)
    cmd = ["perf", "stat", "-x,", "-e", "task-clock", b, "--json", "bench", "--masks", m,
           "--lens", "8192", "--dims", "64", "--dtypes", dt, "--passes", "fwd", "--heads", heads,
           "--reps", str(reps), "--no-peak", "--no-cache"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    ms = float([l for l in p.stderr.splitlines() if "task-clock" in l][0].split(",")[0])
    r = json.loads(p.stdout)["rows"][0]
    return ms, r["gflops"] * r["median_ms"] * 1e6
res = {}
for k in range(rounds):
    for m in masks:
        for dt in dtypes:
            for b in (bins if k % 2 == 0 else bins[::-1]):
                t1, fl = run(b, m, dt, lo)
                t2, _ = run(b, m, dt, hi)
                res.setdefault((m, dt, b), []).append((t1, t2, fl))
    print(f"round {k+1} done", file=sys.stderr, flush=True)
print(f"paths {paths}; CPU ms per forward (1 thread, H={heads}, L=8192, D=64), {rounds} rounds, reps {lo} vs {hi}")
print("mask       dtype binary                           min-slope ms  GFLOP/s/core  median-slope ms")
for m in masks:
    for dt in dtypes:
        mins = []
        for b in bins:
            v = res[(m, dt, b)]
            ms = (min(x[1] for x in v) - min(x[0] for x in v)) / (hi - lo)
            med = statistics.median((x[1] - x[0]) / (hi - lo) for x in v)
            mins.append((ms, med))
            print(f"{m[:10]:10s} {dt:5s} {b:32s} {ms:9.2f}  {v[0][2] / (ms * 1e6):8.1f}  {med:9.2f}")
        print(f"{'':17s} ratio vs first: min " + " ".join(f"{x[0]/mins[0][0]:.3f}" for x in mins[1:])
              + " | median " + " ".join(f"{x[1]/mins[0][1]:.3f}" for x in mins[1:]))
