#!/usr/bin/env python3
"""Forward attention on the CPU: PyTorch (SDPA, compiled FlexAttention) next to `tessera bench`.

Cases: L = 8192, H = 8, D = 64, B = 1; causal, causal within ~1K-token documents (lengths uniform
in 512..1536, seeded), window(1024) & causal; f32 and bf16; forward, and with `--bwd` also the
backward (dQ, dK, dV from a fixed dO, timed alone: `torch.autograd.grad` on a retained graph).
Throughput is effective GFLOP/s over allowed pairs only (4·D FLOPs per allowed pair per head
forward, 10·D backward), the same count `tessera bench` uses.

- SDPA: `scaled_dot_product_attention` with `is_causal=True` for causal, a dense boolean
  `attn_mask` otherwise.
- Flex: `torch.compile(flex_attention)` with the equivalent `create_block_mask` (BLOCK_SIZE 128).
- Tessera: `<--tessera> bench --quick --no-cache --passes fwd --json` (its documents mask draws
  its own ~1K-token documents from the same length distribution; GFLOP/s are over each system's
  own allowed pairs). Its peak probe runs too, so each Tessera row carries its kernel path and
  the percentage of that path's measured peak.

Prints the side-by-side table of every system, then a markdown table headed by the CPU model
(from the bench manifest), one row per case: Tessera's kernel path, GFLOP/s and % of that path's
peak, the best PyTorch system (SDPA or compiled Flex) and its GFLOP/s, and Tessera / PyTorch.
Paste it into BENCHMARKS.md as that CPU model's table.

Usage: python bench/compare_torch.py --tessera target/release/tessera [--reps 3] [--skip-sdpa-masked]
       [--bwd]
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
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def flex_backward_supported():
    """Whether FlexAttention has a backward on this device (it raises on CPU in torch 2.x). Probed
    eagerly on a tiny input, so a failure does not pollute the compiled function's cache (a failed
    call with grad-requiring inputs made later compiled calls fall back to a ~100x slower path)."""
    x = torch.rand(1, 1, 128, 16, requires_grad=True)
    try:
        flex_attention(x, x, x).sum().backward()
        return True
    except NotImplementedError as e:
        print(f"FlexAttention backward: {e}")
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", required=True, help="path of the built tessera binary")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-sdpa-masked", action="store_true",
                    help="run SDPA on causal only (dense-mask SDPA is slow)")
    ap.add_argument("--bwd", action="store_true", help="also time the backward pass")
    args = ap.parse_args()
    torch.manual_seed(0)
    flex = torch.compile(flex_attention)
    flex_bwd = args.bwd and flex_backward_supported()
    passes = ("fwd", "bwd") if args.bwd else ("fwd",)
    rows = []  # (system, mask, dtype, pass, ms, gflops)
    for name, mod in MASKS.items():
        allowed = int(dense(mod).sum())
        bm = create_block_mask(mod, None, None, L, L, device="cpu", BLOCK_SIZE=128)
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.rand(1, H, L, D, dtype=dt) * 2 - 1 for _ in range(3))
            d_o = torch.rand(1, H, L, D, dtype=dt) * 2 - 1
            runs = {}
            if name == "causal":
                runs["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif not args.skip_sdpa_masked:
                m = dense(mod)
                runs["sdpa"] = lambda q, k, v, m=m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            runs["flex (compiled)"] = lambda q, k, v: flex(q, k, v, block_mask=bm)
            for system, f in runs.items():
                with torch.no_grad():
                    t = timed(lambda: f(q, k, v), args.reps)
                rows.append((system, name, DT[dt], "fwd", t * 1e3, 4.0 * D * allowed * H / t / 1e9))
                if args.bwd:
                    if system.startswith("flex") and not flex_bwd:
                        rows.append((system, name, DT[dt], "bwd", None, None))
                        continue
                    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                    out = f(qg, kg, vg)
                    t = timed(lambda: torch.autograd.grad(out, (qg, kg, vg), d_o, retain_graph=True),
                              args.reps)
                    rows.append((system, name, DT[dt], "bwd", t * 1e3, 10.0 * D * allowed * H / t / 1e9))
    out = subprocess.run(
        [args.tessera, "bench", "--quick", "--no-cache", "--passes", ",".join(passes),
         "--reps", str(args.reps), "--json"],
        check=True, capture_output=True, text=True).stdout
    rep = json.loads(out)
    label = {"causal": "causal", "causal & document (~1K docs)": "documents",
             "window(1024) & causal": "window"}
    tessera_rows = {}  # (mask, dtype, pass) -> bench row
    for r in rep["rows"]:
        case = (label.get(r["mask"], r["mask"]), r["dtype"], r["pass"])
        tessera_rows[case] = r
        rows.append(("tessera", *case, r["median_ms"], r["gflops"]))
    print(f"L={L} H={H} D={D} B=1, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "median ms / effective GFLOP/s over allowed pairs")
    systems = []
    for r in rows:
        if r[0] not in systems:
            systems.append(r[0])
    cell = {(s, m, d, p): (ms, gf) for s, m, d, p, ms, gf in rows}
    print("| mask | dtype | pass | " + " | ".join(systems) + " |")
    print("| --- | --- | --- |" + " --- |" * len(systems))
    for m in MASKS:
        for d in ("f32", "bf16"):
            for p in passes:
                cols = []
                for s in systems:
                    v = cell.get((s, m, d, p))
                    if v is None:
                        cols.append("-")
                    elif v[0] is None:
                        cols.append("unsupported")
                    else:
                        cols.append(f"{v[0]:.1f} ms / {v[1]:.0f}")
                print(f"| {m} | {d} | {p} | " + " | ".join(cols) + " |")
    print()
    print(per_cpu_table(rep, tessera_rows, cell, systems, passes))


def per_cpu_table(rep, tessera_rows, cell, systems, passes):
    """The markdown table of one CPU model: per case, Tessera's path, GFLOP/s and % of that
    path's peak beside the best PyTorch system."""
    man = rep["manifest"]
    peaks = rep.get("peaks") or {}
    names = {"avx512": "avx512 f32 FMA", "avx2": "avx2 f32 FMA", "bf16_dot": "vdpbf16ps"}
    measured = ", ".join(f"{names[k]} {peaks[k]:.0f}" for k in names if peaks.get(k) is not None)
    raised = peaks.get("raised") or []
    lines = [
        f"### {man['cpu_model']}",
        "",
        f"{man['threads']} threads, torch {torch.__version__}, tessera {man['version']} "
        f"({man['git_revision']}), L={L} H={H} D={D} B=1; effective GFLOP/s over allowed pairs. "
        f"Peaks (GFLOP/s): {measured or 'not measured'}"
        + (f"; raised to an observed rate: {', '.join(raised)}" if raised else "")
        + ".",
        "",
        "| case | dtype | pass | Tessera path | Tessera GFLOP/s | % of path peak "
        "| PyTorch best | PyTorch GFLOP/s | Tessera / PyTorch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in MASKS:
        for d in ("f32", "bf16"):
            for p in passes:
                t = tessera_rows.get((m, d, p))
                torch_best = max(
                    ((s, cell[(s, m, d, p)][1]) for s in systems
                     if s != "tessera" and cell.get((s, m, d, p), (None, None))[1] is not None),
                    key=lambda x: x[1], default=None)
                if t is None:
                    continue
                pct = "-" if t["pct_peak"] is None else f"{t['pct_peak']:.1f}"
                best = ("-", "-", "-") if torch_best is None else (
                    torch_best[0], f"{torch_best[1]:.0f}", f"{t['gflops'] / torch_best[1]:.2f}x")
                lines.append(f"| {m} | {d} | {p} | {t['path']} | {t['gflops']:.0f} | {pct} | "
                             f"{best[0]} | {best[1]} | {best[2]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
