#!/usr/bin/env python3
"""`tessera.from_mask_mod` against `create_block_mask` on the CPU, in one process, same mask_mod.

    .venv/bin/python bench/from_mask_mod.py [--sizes 4096 16384] [--reps 5] [--compiled] [--threads N]

Per size and mask (causal, sliding window of 1024, causal within 1K-3K-token documents), the
median of `--reps` timed calls (after one untimed call each) of

- `create_block_mask(mask_mod, None, None, L, L, device="cpu")` (eager, its default),
- with `--compiled`, `torch.compile(create_block_mask)` called warm (its compilation excluded),
- `tessera.from_mask_mod(mask_mod, L)` (every pair evaluated; the analytic-equivalent check
  included, its warning silenced) followed by `plan.to_flex_block_mask()`, so both sides end
  with a BlockMask; the eight tables are checked equal once per row.

Prints the CPU model, torch's threads (`--threads` sets them for both sides: on a loaded machine
torch's two-thread elementwise ops can run ten times slower than one thread) and a markdown table
(ms).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

import tessera
from bench_common import TABLES, cpu_model


def doc_ids(length: int, seed: int = 0) -> torch.Tensor:
    """Document ids of 1K-3K-token documents filling one row."""
    g = np.random.default_rng(seed)
    out, d, i = np.empty(length, np.int64), 0, 0
    while i < length:
        n = int(g.integers(1024, 3073))
        out[i : i + n] = d
        i, d = i + n, d + 1
    return torch.from_numpy(out)


def masks(length: int):
    ids = doc_ids(length)

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= 1024)

    def doc_causal(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv)

    return [("causal", causal), ("sliding window 1024", sliding), ("document causal", doc_causal)]


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def ours(mask_mod, length):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tessera.MaskModHint)
        return tessera.from_mask_mod(mask_mod, length).to_flex_block_mask()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile(create_block_mask)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both sides")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__} with {torch.get_num_threads()} threads; "
          f"tessera {tessera.__version__}")
    head = "| mask | L | create_block_mask ms |"
    head += " compiled ms |" if args.compiled else ""
    head += " from_mask_mod + BlockMask ms | speedup vs eager |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    compiled = torch.compile(create_block_mask) if args.compiled else None
    for length in args.sizes:
        for name, mm in masks(length):
            ref = create_block_mask(mm, None, None, length, length, device="cpu")
            bm = ours(mm, length)
            for t in TABLES:
                assert torch.equal(getattr(bm, t), getattr(ref, t)), (name, length, t)
            del ref, bm
            eager = median_ms(lambda: create_block_mask(mm, None, None, length, length, device="cpu"), args.reps)
            row = f"| {name} | {length} | {eager:.1f} |"
            if compiled is not None:
                c = median_ms(lambda: compiled(mm, None, None, length, length, device="cpu"), args.reps)
                row += f" {c:.1f} |"
            t = median_ms(lambda: ours(mm, length), args.reps)
            row += f" {t:.1f} | {eager / t:.1f}x |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
