#!/usr/bin/env python3
"""Forward attention on the CPU: PyTorch (SDPA, compiled FlexAttention) next to `tessera bench`.

Cases: L = 8192, H = 8, D = 64, B = 1; causal, causal within ~1K-token documents (lengths uniform
in 512..1536, seeded), window(1024) & causal; f32 and bf16; forward only. Throughput is effective
GFLOP/s over allowed pairs only (4·D FLOPs per allowed pair per head), the same count
`tessera bench` uses.

- SDPA: `scaled_dot_product_attention` with `is_causal=True` for causal, a dense boolean
  `attn_mask` otherwise.
- Flex: `torch.compile(flex_attention)` with the equivalent `create_block_mask` (BLOCK_SIZE 128).
- Tessera: `<--tessera> bench --quick --no-cache --no-peak --passes fwd --json` (its documents
  mask draws its own ~1K-token documents from the same length distribution; GFLOP/s are over
  each system's own allowed pairs).

Usage: python bench/compare_torch.py --tessera target/release/tessera [--reps 3] [--skip-sdpa-masked]
"""

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

L, H, D = 8192, 8, 64
WINDOW = 1024


def doc_ids(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    ids, doc = [], 0
    while len(ids) < n:
        k = min(int(torch.randint(512, 1537, (1,), generator=g)), n - len(ids))
        ids += [doc] * k
        doc += 1
    return torch.tensor(ids)


DOCS = doc_ids(L)


def causal(b, h, q, k):
    return q >= k


def documents(b, h, q, k):
    return (q >= k) & (DOCS[q] == DOCS[k])


def window(b, h, q, k):
    return (q >= k) & (q - k < WINDOW)


DT = {torch.float32: "f32", torch.bfloat16: "bf16"}
MASKS = {"causal": causal, "documents": documents, "window": window}


def dense(mod):
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    return mod(None, None, q, k)


def timed(fn, reps):
    fn()  # warm-up (and compilation)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", required=True, help="path of the built tessera binary")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-sdpa-masked", action="store_true",
                    help="run SDPA on causal only (dense-mask SDPA is slow)")
    args = ap.parse_args()
    torch.manual_seed(0)
    flex = torch.compile(flex_attention)
    rows = []  # (system, mask, dtype, ms, gflops)
    for name, mod in MASKS.items():
        allowed = int(dense(mod).sum())
        flops = 4.0 * D * allowed * H
        bm = create_block_mask(mod, None, None, L, L, device="cpu", BLOCK_SIZE=128)
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.rand(1, H, L, D, dtype=dt) * 2 - 1 for _ in range(3))
            if name == "causal":
                t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.reps)
                rows.append(("sdpa", name, DT[dt], t * 1e3, flops / t / 1e9))
            elif not args.skip_sdpa_masked:
                m = dense(mod)
                t = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m), args.reps)
                rows.append(("sdpa", name, DT[dt], t * 1e3, flops / t / 1e9))
            with torch.no_grad():
                t = timed(lambda: flex(q, k, v, block_mask=bm), args.reps)
            rows.append(("flex (compiled)", name, DT[dt], t * 1e3, flops / t / 1e9))
    out = subprocess.run(
        [args.tessera, "bench", "--quick", "--no-cache", "--no-peak", "--passes", "fwd",
         "--reps", str(args.reps), "--json"],
        check=True, capture_output=True, text=True).stdout
    rep = json.loads(out)
    label = {"causal": "causal", "causal & document (~1K docs)": "documents",
             "window(1024) & causal": "window"}
    for r in rep["rows"]:
        rows.append((f"tessera {rep['backend']}", label.get(r["mask"], r["mask"]), r["dtype"],
                     r["median_ms"], r["gflops"]))
    print(f"L={L} H={H} D={D} B=1, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "forward, median ms / effective GFLOP/s over allowed pairs")
    systems = []
    for r in rows:
        if r[0] not in systems:
            systems.append(r[0])
    cell = {(s, m, d): (ms, gf) for s, m, d, ms, gf in rows}
    print("| mask | dtype | " + " | ".join(systems) + " |")
    print("| --- | --- |" + " --- |" * len(systems))
    for m in MASKS:
        for d in ("f32", "bf16"):
            cols = []
            for s in systems:
                v = cell.get((s, m, d))
                cols.append("-" if v is None else f"{v[0]:.1f} ms / {v[1]:.0f}")
            print(f"| {m} | {d} | " + " | ".join(cols) + " |")

if __name__ == "__main__":
    main()
