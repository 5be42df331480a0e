#!/usr/bin/env python3
"""`tessera.torch.attention` next to PyTorch's CPU attention, in one process on one CPU.

Cases (B = 1, H = 8, D = 64, f32 unless `--dtype bf16`):
- causal at L (default 8192): Tessera vs `scaled_dot_product_attention(is_causal=True)`, forward
  alone and forward + backward (autograd on a fresh graph per call);
- causal within documents (mean length ~2K, seeded): Tessera forward vs compiled
  `flex_attention` with `create_block_mask` (FlexAttention has no CPU backward) and Tessera
  forward + backward vs SDPA with the dense boolean document mask;
- the op's overhead: the torch custom op (`tessera.torch.attention`, which allocates its outputs)
  against the native kernel alone (`tessera._tessera.attention_forward` into preallocated
  arrays), same plan and inputs.

Times are medians of `--reps` calls after two warm-up calls; GFLOP/s count allowed pairs only
(4·D FLOPs per pair per head forward, 10·D backward... as `tessera bench`).

Usage: .venv/bin/python bench/torch_attention.py [--len 8192] [--reps 5] [--dtype f32|bf16] [--json]
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tessera
import tessera.torch

from bench_common import cpu_model, doc_ids  # noqa: E402 (bench/ is the script's directory)


def timed(fn, reps):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    L, H, D = args.len, args.heads, args.dim
    dt = torch.float32 if args.dtype == "f32" else torch.bfloat16
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, H, L, D, dtype=dt) for _ in range(4))
    rows = []

    def row(case, system, pass_, seconds, pairs):
        flops = (4 if pass_ == "fwd" else 14) * D * pairs * H
        rows.append(
            dict(case=case, system=system, pass_=pass_, ms=seconds * 1e3, gflops=flops / seconds / 1e9)
        )

    def fwd_bwd(fn):
        def run():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = fn(qq, kk, vv)
            torch.autograd.grad(out, (qq, kk, vv), do)

        return run

    # -- causal ---------------------------------------------------------------------------------
    causal_plan = tessera.plan(tessera.causal(), q_len=L, heads=H)
    pairs = causal_plan.stats["allowed_pairs"] // H
    t = timed(lambda: tessera.torch.attention(q, k, v, causal_plan), args.reps)
    row("causal", "tessera", "fwd", t, pairs)
    t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.reps)
    row("causal", "sdpa", "fwd", t, pairs)
    t = timed(fwd_bwd(lambda a, b, c: tessera.torch.attention(a, b, c, causal_plan)), args.reps)
    row("causal", "tessera", "fwd+bwd", t, pairs)
    t = timed(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)), args.reps)
    row("causal", "sdpa", "fwd+bwd", t, pairs)

    # -- op overhead: the custom op against the native kernel alone ---------------------------
    o = torch.empty(1, H, L, D, dtype=dt)
    lse = torch.empty(1, H, L)
    ml = torch.empty(1, H)
    np_args = [tessera.torch._np(x) for x in (q, k, v, o, lse, ml)]
    scale = 1.0 / D**0.5
    t_kernel = timed(
        lambda: tessera._tessera.attention_forward(causal_plan._p, *np_args, scale, None, None), args.reps
    )
    row("causal", "tessera kernel alone", "fwd", t_kernel, pairs)

    # -- causal within documents ----------------------------------------------------------------
    ids = doc_ids(L)
    doc_plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H)
    dpairs = doc_plan.stats["allowed_pairs"] // H
    tids = torch.from_numpy(ids)

    def documents(b, h, qi, ki):
        return (qi >= ki) & (tids[qi] == tids[ki])

    bm = torch.compile(create_block_mask)(documents, None, None, L, L, device="cpu")
    flex = torch.compile(flex_attention)
    t = timed(lambda: tessera.torch.attention(q, k, v, doc_plan), args.reps)
    row("doc-causal", "tessera", "fwd", t, dpairs)
    t = timed(lambda: flex(q, k, v, block_mask=bm), args.reps)
    row("doc-causal", "flex (compiled)", "fwd", t, dpairs)
    dense = (torch.arange(L)[:, None] >= torch.arange(L)[None, :]) & (tids[:, None] == tids[None, :])
    t = timed(fwd_bwd(lambda a, b, c: tessera.torch.attention(a, b, c, doc_plan)), args.reps)
    row("doc-causal", "tessera", "fwd+bwd", t, dpairs)
    t = timed(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense)), args.reps)
    row("doc-causal", "sdpa (dense mask)", "fwd+bwd", t, dpairs)

    info = dict(
        cpu=cpu_model(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        tessera=tessera.__version__,
        isa=tessera._tessera.isa,
        L=L,
        H=H,
        D=D,
        dtype=args.dtype,
    )
    if args.json:
        print(json.dumps(dict(info=info, rows=rows), indent=1))
        return
    print(f"# {info}")
    print(f"{'case':12s} {'system':22s} {'pass':8s} {'ms':>10s} {'GFLOP/s':>9s}")
    for r in rows:
        print(f"{r['case']:12s} {r['system']:22s} {r['pass_']:8s} {r['ms']:10.2f} {r['gflops']:9.1f}")
    by = {(r["case"], r["system"], r["pass_"]): r["ms"] for r in rows}
    print("\nratios (> 1: tessera faster)")
    print(f"  causal fwd vs SDPA:              {by[('causal', 'sdpa', 'fwd')] / by[('causal', 'tessera', 'fwd')]:.2f}x")
    print(f"  causal fwd+bwd vs SDPA:          {by[('causal', 'sdpa', 'fwd+bwd')] / by[('causal', 'tessera', 'fwd+bwd')]:.2f}x")
    print(f"  doc-causal fwd vs compiled flex: {by[('doc-causal', 'flex (compiled)', 'fwd')] / by[('doc-causal', 'tessera', 'fwd')]:.2f}x")
    print(f"  doc-causal fwd+bwd vs SDPA:      {by[('doc-causal', 'sdpa (dense mask)', 'fwd+bwd')] / by[('doc-causal', 'tessera', 'fwd+bwd')]:.2f}x")
    print(
        f"  op overhead over the kernel alone: "
        f"{100 * (by[('causal', 'tessera', 'fwd')] / by[('causal', 'tessera kernel alone', 'fwd')] - 1):+.1f}%"
    )


if __name__ == "__main__":
    main()
