#!/usr/bin/env python3
"""Cross-check `tessera attend` against an independent PyTorch float64 implementation.

Not a test dependency: run by hand with torch and numpy installed,
    python3 bench/check_attend_torch.py --tessera target/release/tessera
It draws random Q/K/V (GQA, Dqk != Dv, ragged length), packed segments with padding, a learned
sink per head and a softcap, runs `tessera attend` with gradients for several masks, and compares
O, LSE, max_logit, dQ, dK, dV and dsinks with torch autograd on a dense float64 formulation.
"""
import argparse, os, subprocess, tempfile
import numpy as np
import torch

def dense_mask(name, seg, L):
    i = np.arange(L)[:, None]; j = np.arange(L)[None, :]
    doc = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    causal = (i >= j)[None]
    return {
        "causal": np.broadcast_to(causal, doc.shape),
        "causal & document": causal & doc,
        "window(16) & causal": np.broadcast_to(causal & (i - 16 <= j), doc.shape),
        "causal | prefix(20)": np.broadcast_to(causal | (j < 20), doc.shape),
        "chunk(32) & !causal(offset=-3)": np.broadcast_to((i // 32 == j // 32) & ~(i - 3 >= j), doc.shape),
    }[name]

def torch_ref(q, k, v, do, allowed, scale, cap, sinks):
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    sk = torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    B, Hq, L, _ = q.shape; G = Hq // k.shape[1]
    kk = k.repeat_interleave(G, dim=1); vv = v.repeat_interleave(G, dim=1)
    raw = scale * q @ kk.transpose(-1, -2)
    s = cap * torch.tanh(raw / cap)
    m = torch.tensor(allowed)[:, None, :, :].expand_as(s)
    s = s.masked_fill(~m, float("-inf"))
    sink = sk[None, :, None, None].expand(B, Hq, L, 1)
    z = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(s - lse[..., None])
    o = p @ vv
    o.backward(torch.tensor(do, dtype=torch.float64))
    ml = raw.masked_fill(~m, float("-inf")).amax(dim=(-1, -2))
    return dict(o=o.detach().numpy(), lse=lse.detach().numpy(), ml=ml.detach().numpy(),
                dq=q.grad.numpy(), dk=k.grad.numpy(), dv=v.grad.numpy(), ds=sk.grad.numpy())

def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--tessera", default="target/release/tessera")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    B, Hq, Hkv, L, Dqk, Dv = 2, 4, 2, 99, 24, 16
    scale, cap = 0.3, 4.0
    q = rng.standard_normal((B, Hq, L, Dqk)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, L, Dqk)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, L, Dv)).astype(np.float32)
    do = rng.standard_normal((B, Hq, L, Dv)).astype(np.float32)
    sinks = rng.standard_normal(Hq).astype(np.float32)
    seg = np.stack([np.minimum(np.arange(L) // n, 99) for n in (17, 40)]).astype(np.int64)
    seg[:, 90:] = -1
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        for n, x in dict(q=q, k=k, v=v, do=do, sinks=sinks, seg=seg).items():
            np.save(os.path.join(d, n + ".npy"), x)
        for name in ["causal", "causal & document", "window(16) & causal", "causal | prefix(20)", "chunk(32) & !causal(offset=-3)"]:
            args = [a.tessera, "attend", "--no-cache", "--tile", "32x16", "--mask", name, "--segments", f"{d}/seg.npy",
                    "--q", f"{d}/q.npy", "--k", f"{d}/k.npy", "--v", f"{d}/v.npy", f"--scale={scale}", f"--softcap={cap}",
                    "--sinks", f"{d}/sinks.npy", "--out", f"{d}/o_out.npy", "--lse", f"{d}/lse_out.npy",
                    "--max-logit", f"{d}/ml_out.npy", "--grad-out", f"{d}/do.npy", "--dq", f"{d}/dq_out.npy",
                    "--dk", f"{d}/dk_out.npy", "--dv", f"{d}/dv_out.npy", "--dsinks", f"{d}/ds_out.npy"]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            ref = torch_ref(q, k, v, do, dense_mask(name, seg, L), scale, cap, sinks)
            errs = {}
            for key in ["o", "lse", "ml", "dq", "dk", "dv", "ds"]:
                got = np.load(f"{d}/{key}_out.npy").astype(np.float64); r = ref[key]
                fin = np.isfinite(r)
                assert (np.isfinite(got) == fin).all(), (name, key)
                errs[key] = np.linalg.norm(got[fin] - r[fin]) / max(np.linalg.norm(r[fin]), 1e-30)
            tol = dict(o=1e-5, lse=1e-5, ml=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, ds=1e-4)
            ok = all(errs[k] <= tol[k] for k in errs)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:<34} " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    print(f"{5 - failures} passed, {failures} failed")
    raise SystemExit(1 if failures else 0)

main()
