#!/usr/bin/env python3
"""Plans from per-step block selections (docs/block-selections.md, docs/semantics.md#masks): `tessera.plan_from_blocks` against
FlexAttention's `BlockMask.from_kv_blocks` on the same indices, in one process, on the CPU.

Problem: one row of `--len` tokens (default 32K) of documents (mean 2K tokens, seeded), H=8 heads,
query and key blocks of 128 (Tq = 256), and per (head, query block) k=16 distinct random
causal-valid key blocks including the diagonal (fewer in the first 15 rows, where fewer exist;
`-1` pads). Each repetition uses a new selection (as a training step does); every method sees the
same selections. Times are medians over `--reps`.

What is timed:
- `tessera plan_from_blocks`: `plan_from_blocks(causal & document, kv_tiles, cache=False)`, the
  whole plan of "selected tile and mask": exact tile states (full / partial / empty under the
  mask), deduplicated partial bitmasks, forward and backward work lists. `+ to_flex_block_mask`
  adds turning it into a torch `BlockMask` (what the flex engine uses), and `cache=True` the plan
  cache (a miss every step: key, build, memory insert and an atomic disk write).
- `torch from_kv_blocks`: `BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=128,
  mask_mod=causal & document, seq_lengths=(L, L))`: block tables only. Every selected block is
  marked partial (the mask_mod runs on all of it), none is full, and blocks the document mask
  empties stay in the tables: less than the plan holds, so this is the cheapest
  baseline.
- `torch from_kv_blocks ∩ mask's BlockMask`: the fair equivalent in torch of what the plan holds
  at block level: the selection's dense block table AND the mask's block states (from
  `create_block_mask(causal & document)`, built once per batch and not counted here; its time is
  printed separately), split into partial and full tables and handed to `from_kv_blocks`. Its
  partial blocks still lack exact contents (the mask_mod decides per element at run time).

The plan's non-empty blocks equal the fair torch tables' (checked once).

Usage: .venv/bin/python bench/plan_from_blocks.py [--len 32768] [--heads 8] [--k 16] [--reps 7]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The plan cache of this process lives in a scratch directory (the cache=True row writes to it).
os.environ["TESSERA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tessera-bench-blocks-")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import _dense_to_ordered  # noqa: E402

import tessera  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_model, doc_ids  # noqa: E402

BLOCK = 128


def selections(rng, heads: int, tq: int, k: int, n: int) -> list:
    """``n`` selections ``int64 [1, heads, tq, k]``: the diagonal and k-1 distinct earlier blocks
    per row, in random order, ``-1`` where a row has fewer than ``k`` causal-valid blocks."""
    out = []
    for _ in range(n):
        sel = np.full((1, heads, tq, k), -1, dtype=np.int64)
        for h in range(heads):
            for r in range(tq):
                row = np.concatenate([[r], rng.permutation(r)[: k - 1]])
                sel[0, h, r, : len(row)] = rng.permutation(row)
        out.append(sel)
    return out


def torch_tables(sel: np.ndarray):
    """``kv_num_blocks [1, H, Tq]`` and ``kv_indices [1, H, Tq, k]`` (valid first) of a selection."""
    t = torch.from_numpy(sel)
    srt = torch.sort(t, dim=-1, descending=True).values
    return (srt >= 0).sum(-1).to(torch.int32), srt.clamp(min=0).to(torch.int32).contiguous()


def median_ms(fn, args_list) -> tuple:
    ts, outs = [], []
    for a in args_list:
        t = time.perf_counter()
        outs.append(fn(a))
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=str, default=None)
    a = ap.parse_args()
    L, H, k = a.len, a.heads, a.k
    tq = L // BLOCK
    ids = doc_ids(L)
    mask = tessera.causal() & tessera.document(ids)
    ids_t = torch.from_numpy(ids)

    def causal_doc(b, h, q, kv):
        return (q >= kv) & (ids_t[q] == ids_t[kv])

    rng = np.random.default_rng(1)
    sels = selections(rng, H, tq, k, a.reps + 1)
    warm, sels = sels[0], sels[1:]

    # warm-up: one call of each (library loading, first allocations)
    tessera.plan_from_blocks(mask, warm, q_len=L)
    BlockMask.from_kv_blocks(*torch_tables(warm), BLOCK_SIZE=BLOCK, mask_mod=causal_doc, seq_lengths=(L, L))

    rows = {}
    rows["tessera plan_from_blocks"], plans = median_ms(lambda s: tessera.plan_from_blocks(mask, s, q_len=L), sels)
    rows["tessera plan_from_blocks + to_flex_block_mask"], _ = median_ms(
        lambda s: tessera.plan_from_blocks(mask, s, q_len=L).to_flex_block_mask(), sels)
    rows["tessera plan_from_blocks cache=True (miss, stored)"], _ = median_ms(
        lambda s: tessera.plan_from_blocks(mask, s, q_len=L, cache=True), sels)
    tables = [torch_tables(s) for s in sels]
    rows["torch from_kv_blocks"], _ = median_ms(
        lambda t: BlockMask.from_kv_blocks(*t, BLOCK_SIZE=BLOCK, mask_mod=causal_doc, seq_lengths=(L, L)), tables)

    t0 = time.perf_counter()
    mask_bm = create_block_mask(causal_doc, 1, 1, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    create_ms = (time.perf_counter() - t0) * 1e3
    # the mask's block states: 2 full, 1 partial, 0 empty
    m_any = mask_bm.to_dense().bool()
    full_bm = BlockMask.from_kv_blocks(mask_bm.full_kv_num_blocks, mask_bm.full_kv_indices, BLOCK_SIZE=BLOCK,
                                       seq_lengths=(L, L), compute_q_blocks=False)
    m_full = full_bm.to_dense().bool()

    def fair(t):
        num, idx = t
        sel = torch.zeros(1, H, tq, tq + 1, dtype=torch.bool)
        valid = torch.arange(idx.shape[-1]) < num[..., None]
        sel.scatter_(-1, torch.where(valid, idx, tq).long(), True)
        sel = sel[..., :tq]
        part_num, part_idx = _dense_to_ordered(sel & m_any & ~m_full)
        full_num, full_idx = _dense_to_ordered(sel & m_full)
        return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                        mask_mod=causal_doc, seq_lengths=(L, L))

    rows["torch from_kv_blocks ∩ mask's BlockMask"], fair_bms = median_ms(fair, tables)

    # the plan's non-empty blocks are the fair torch tables' (checked on the first selection)
    bm0 = plans[0].to_flex_block_mask()
    ours = (bm0.kv_num_blocks + bm0.full_kv_num_blocks).long()
    theirs = (fair_bms[0].kv_num_blocks + fair_bms[0].full_kv_num_blocks).long()
    assert torch.equal(ours, theirs), "non-empty block counts differ"
    assert torch.equal(bm0.full_kv_num_blocks, fair_bms[0].full_kv_num_blocks), "full block counts differ"

    st = plans[0].stats
    info = {
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tessera": tessera.__version__,
        "len": L,
        "heads": H,
        "k": k,
        "block": BLOCK,
        "reps": a.reps,
        "plan": {n: st[n] for n in ("full_tiles", "partial_tiles", "unique_partial_masks", "build_ms")},
        "create_block_mask_ms (mask only, once per batch)": round(create_ms, 1),
        "median_ms": {n: round(v, 3) for n, v in rows.items()},
    }
    print(f"CPU: {info['cpu']} (torch threads {info['torch_threads']}, torch {torch.__version__})")
    print(f"L={L} H={H} Tq={tq} k={k} block={BLOCK}: causal & document (mean 2K-token docs), "
          f"{a.reps} selections")
    for n, v in rows.items():
        print(f"  {n:52s} {v:9.2f} ms")
    print(f"  (torch create_block_mask of the mask alone, once per batch: {create_ms:.0f} ms)")
    print(f"  plan: {st['full_tiles']} full, {st['partial_tiles']} partial tiles, "
          f"{st['unique_partial_masks']} unique partial masks")
    if a.json:
        Path(a.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
