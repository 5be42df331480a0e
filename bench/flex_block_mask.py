#!/usr/bin/env python3
"""A FlexAttention `BlockMask` for causal-within-documents attention: Tessera's
`plan(...).to_flex_block_mask()` against warm `torch.compile(create_block_mask)`, in one process.

Documents have lengths uniform in [1K, 3K] (mean ~2K, seeded) packed into one row of N tokens.
Tessera builds the plan without its cache (`cache=False`: every call plans from scratch) and
hands its work lists to `BlockMask`; `create_block_mask` is compiled once and timed warm (its
first call, the compilation, is excluded; Tessera gets one untimed warm-up call too). Both results
are checked equal (all eight tables).
Times are medians of `--reps` calls.

Usage: .venv/bin/python bench/flex_block_mask.py [--lens 32768,131072] [--reps 3] [--json]
"""

import argparse
import json

import torch
from torch.nn.attention.flex_attention import create_block_mask

import tessera
import tessera.torch
from bench_common import TABLES, doc_ids, median_time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="32768,131072")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    compiled = torch.compile(create_block_mask)
    for n in [int(x) for x in args.lens.split(",")]:
        ids = doc_ids(n, mean=2048, seed=11)
        tids = torch.from_numpy(ids)

        def documents(b, h, q, k):
            return (q >= k) & (tids[q] == tids[k])

        mask = tessera.causal() & tessera.document(ids)
        tessera.plan(mask, q_len=n, cache=False).to_flex_block_mask()  # warm-up (not timed)
        t_tessera, bm = median_time(
            lambda: tessera.plan(mask, q_len=n, cache=False).to_flex_block_mask(), args.reps
        )
        compiled(documents, None, None, n, n, device="cpu")  # compile (not timed)
        t_torch, ref = median_time(lambda: compiled(documents, None, None, n, n, device="cpu"), args.reps)
        equal = all(torch.equal(getattr(bm, name), getattr(ref, name)) for name in TABLES)
        results.append(
            dict(
                tokens=n,
                tessera_ms=t_tessera * 1e3,
                create_block_mask_ms=t_torch * 1e3,
                speedup=t_torch / t_tessera,
                tables_equal=equal,
            )
        )
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'tokens':>8s} {'tessera ms':>11s} {'compiled create_block_mask ms':>30s} {'speedup':>8s} equal")
    for r in results:
        print(
            f"{r['tokens']:8d} {r['tessera_ms']:11.2f} {r['create_block_mask_ms']:30.1f} "
            f"{r['speedup']:7.0f}x {r['tables_equal']}"
        )


if __name__ == "__main__":
    main()
