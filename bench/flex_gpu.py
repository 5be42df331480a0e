#!/usr/bin/env python3
"""Tessera on a GPU against FlexAttention with `create_block_mask`, one process, one GPU.

Masks: causal within documents (lognormal document lengths, seeded) and a sliding window, one row,
at `--lens` tokens (default 8K, 32K, 128K), H = 16, D = 128, bf16, BLOCK_SIZE 128.

1. BlockMask: Tessera plans from scratch (`cache=False`) and builds the device BlockMask
   (`plan.to_flex_block_mask(device)`: one or two copies; the tables written by the host for grids
   up to 2^16 blocks, else expanded on the device from the non-empty tiles; `mask_mod` generated
   from the expression), and separately: the plan alone, the host arrays alone, the device build
   alone from a made plan, and the device build through each upload (`from tiles`, `from
   tables`) at every size, to place the threshold; torch runs `torch.compile(create_block_mask)` on the GPU with the same mask's
   mask_mod (its compilation excluded). Tables checked equal. Medians of `--reps`, each ended by
   a device sync.
2. Attention forward + backward per engine (`tessera.torch.attention(engine=...)`: auto, flex_flash,
   varlen, flex) against compiled `flex_attention` with `create_block_mask`'s BlockMask (the
   Triton kernel). An engine that cannot run the inputs prints "not available: <reason>" (never a
   silent fallback); outputs are checked against the baseline (bf16 tolerance).
3. The training example (`examples/train_gpt.py --device cuda --amp bf16`, bytes tokenizer, default
   model) at `--seq-len`: median step with `tessera.torch.attention` (plans and BlockMasks made ahead by
   `tessera.torch.PlanPrefetcher`) against the same step with `create_block_mask`'s BlockMask
   (built per batch on the GPU), in lockstep on the same batches after `--warmup` steps.

`--device cpu` is a smoke run at tiny sizes (float32, forward only: FlexAttention has no CPU
backward; no example step) that checks everything but the GPU timings.

Usage: python bench/flex_gpu.py [--lens 8192,32768,131072] [--reps 7] [--seq-len 8192]
       [--steps 12] [--warmup 3] [--device cuda|cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tessera
import tessera.torch
from tessera.core import flex_tables
from tessera.engines import select as sel

REPO = Path(__file__).resolve().parent.parent
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
          "q_indices", "full_q_num_blocks", "full_q_indices")
ENGINES = ("auto", "flex_flash", "varlen", "flex")


def lognormal_docs(n: int, mean: int, seed: int) -> np.ndarray:
    """Document ids ``[n]``: lognormal lengths (median ``mean``, sigma 1), every token in one."""
    rng = np.random.default_rng(seed)
    ids, doc = [], 0
    while len(ids) < n:
        k = int(min(max(1, rng.lognormal(np.log(mean), 1.0)), n - len(ids)))
        ids += [doc] * k
        doc += 1
    return np.asarray(ids, dtype=np.int64)


def masks(n: int, window: int):
    """``[(name, tessera mask, mask_mod over device data)]`` for ``n`` tokens."""
    ids = lognormal_docs(n, max(64, n // 16), seed=n)
    return [("doc_causal", ids, tessera.causal() & tessera.document(ids)),
            ("sliding_window", None, tessera.window(window) & tessera.causal())]


def mask_mod(name: str, ids, window: int, device):
    if name == "doc_causal":
        seg = torch.from_numpy(ids).to(device)

        def doc(b, h, q, kv):
            return (q >= kv) & (seg[q] == seg[kv])

        return doc

    def win(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)

    return win


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, dev):
    ts, out = [], None
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def block_masks(lens, reps, dev, window, block):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = torch.compile(create_block_mask)
    rows = []
    for n in lens:
        for name, ids, mask in masks(n, window):
            mod = mask_mod(name, ids, window, dev)
            made = tessera.plan(mask, q_len=n, block=block)

            def ours():
                return tessera.plan(mask, q_len=n, block=block, cache=False).to_flex_block_mask(device=dev)

            def build_only():
                made._flex.pop("bm", None)
                return made.to_flex_block_mask(device=dev)

            def theirs():
                return compiled(mod, None, None, n, n, device=dev, BLOCK_SIZE=block)

            def plan_only():
                return tessera.plan(mask, q_len=n, block=block, cache=False)

            def compact_only():
                return flex_tables.compact(made, "auto")

            def upload(dense):  # the device build through one upload or the other
                def go():
                    c = flex_tables.compact(made, "auto", dense=dense, pin=dev.type == "cuda")
                    return flex_tables.block_mask_from_compact(c, dev, non_blocking=True)
                return go

            ours(), build_only(), theirs()  # compiles
            t_ours, bm = timed(ours, reps, dev)
            t_build, _ = timed(build_only, reps, dev)
            t_theirs, ref = timed(theirs, reps, dev)
            t_plan, _ = timed(plan_only, reps, dev)
            t_compact, _ = timed(compact_only, reps, dev)
            t_tiles, _ = timed(upload(False), reps, dev)
            t_dense, _ = timed(upload(True), reps, dev)
            equal = all(torch.equal(getattr(bm, t), getattr(ref, t)) for t in TABLES)
            rows.append({"mask": name, "tokens": n, "tessera_ms": t_ours * 1e3, "device_build_ms": t_build * 1e3,
                         "plan_ms": t_plan * 1e3, "compact_ms": t_compact * 1e3,
                         "build_from_tiles_ms": t_tiles * 1e3, "build_from_tables_ms": t_dense * 1e3,
                         "create_block_mask_ms": t_theirs * 1e3, "speedup": t_theirs / t_ours,
                         "tables_equal": equal})
            print(f"{name:>15} {n:>7} tokens: plan+BlockMask {t_ours * 1e3:8.2f} ms (plan {t_plan * 1e3:6.2f}, host "
                  f"arrays {t_compact * 1e3:6.2f}, device build {t_build * 1e3:6.2f}: from tiles {t_tiles * 1e3:6.2f}, "
                  f"from tables {t_dense * 1e3:6.2f})  create_block_mask "
                  f"{t_theirs * 1e3:9.2f} ms  {t_theirs / t_ours:6.1f}x  tables equal: {equal}")
    return rows


def attention(lens, reps, dev, window, block, heads, dim, dtype, only=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    grad = dev.type != "cpu"  # FlexAttention has no CPU backward
    cbm = torch.compile(create_block_mask)
    # on CPU (the smoke run) FlexAttention's unfused path, as the engine's own CPU path
    # Static shapes, as the flex engine compiles: with dynamo's default, the second length
    # recompiles into a dynamic-shape kernel (the H200 run of 2026-11-28: 32K's baseline ran one, ~1.4x slower).
    cflex = flex_attention if dev.type == "cpu" else torch.compile(flex_attention, dynamic=False)
    rows = []
    for n in lens:
        for name, ids, mask in masks(n, window):
            if only and name not in only:
                continue
            plan = tessera.plan(mask, q_len=n, heads=1, block=block)
            plan.to_flex_block_mask(device=dev)
            ref_bm = cbm(mask_mod(name, ids, window, dev), None, None, n, n, device=dev, BLOCK_SIZE=block)
            g = torch.Generator(device=dev).manual_seed(n)
            q, k, v = (torch.randn(1, heads, n, dim, device=dev, dtype=dtype, generator=g).requires_grad_(grad)
                       for _ in range(3))
            do = torch.randn(1, heads, n, dim, device=dev, dtype=dtype, generator=g)

            def run(fn):
                def step():
                    if not grad:
                        with torch.no_grad():
                            return fn()
                    o = fn()
                    o.backward(do)
                    return o
                return step

            base = run(lambda: cflex(q, k, v, block_mask=ref_bm))
            base()
            t_base, o_ref = timed(base, reps, dev)
            row = {"mask": name, "tokens": n, "flex_create_block_mask_ms": t_base * 1e3, "engines": {}}
            print(f"{name:>15} {n:>7} tokens: flex + create_block_mask {'fwd+bwd' if grad else 'fwd'} {t_base * 1e3:8.2f} ms")
            # The same compiled flex_attention over Tessera's BlockMask (analytic mask_mod), called
            # directly: the kernel's share of the flex engine's time, apart from its wrapper.
            direct = run(lambda: cflex(q, k, v, block_mask=plan.to_flex_block_mask(device=dev)))
            direct()
            t_direct, o_direct = timed(direct, reps, dev)
            row["flex_tessera_block_mask_ms"] = t_direct * 1e3
            print(f"{'':>24}flex + Tessera's BlockMask (direct) {t_direct * 1e3:8.2f} ms  {t_direct / t_base:5.2f}x")
            for eng in ENGINES + (("tessera",) if dev.type == "cpu" else ()):
                inp = sel.Inputs(q, k, v, plan, None, None, False, False)
                why = sel.REASONS[eng](inp) if eng != "auto" else []
                if why:
                    row["engines"][eng] = {"available": False, "reason": "; ".join(why)}
                    print(f"{'':>24}{eng:>11}: not available: {'; '.join(why)}")
                    continue
                fn = run(lambda: tessera.torch.attention(q, k, v, plan, engine=eng))
                try:
                    fn()
                except Exception as e:  # report, never fall back silently
                    row["engines"][eng] = {"available": False, "reason": f"{type(e).__name__}: {e}"[:300]}
                    print(f"{'':>24}{eng:>11}: failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                ran = tessera.torch.last_dispatch()["engine"]
                t, o = timed(fn, reps, dev)
                err = float((o.detach().float() - o_ref.detach().float()).abs().max())
                row["engines"][eng] = {"available": True, "ran": ran, "ms": t * 1e3, "ratio": t / t_base,
                                       "max_abs_diff": err}
                print(f"{'':>24}{eng:>11}: {t * 1e3:8.2f} ms  {t / t_base:5.2f}x of flex  (ran {ran}, max |diff| {err:.2e})")
            rows.append(row)
    return rows


def example_steps(seq_len, batch_size, steps, warmup, engines=("auto",), amp="bf16"):
    from torch.nn.attention.flex_attention import create_block_mask

    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "train_gpt.py")
    tg = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = tg
    spec.loader.exec_module(tg)
    cfg = tg.Config(tokenizer="bytes", seq_len=seq_len, batch_size=batch_size, device="cuda", telemetry_every=0,
                    progress=False, out_dir="/tmp/tessera-flex-bench", amp=amp)
    data = tg.load_data(cfg)
    cbm = torch.compile(create_block_mask)

    def doc_mod(seg):
        def mod(b, h, q, kv):
            return (q >= kv) & (seg[b, q] == seg[b, kv]) & (seg[b, q] >= 0)
        return mod

    class TorchMaskEngine(tg.Engine):
        """The same attention, with the BlockMask from create_block_mask (built on the GPU per batch)."""

        def __init__(self, kind, segments, cfg, telemetry=None, plan=None):
            super().__init__(kind, segments, cfg, telemetry)
            seg = torch.from_numpy(segments).cuda()
            bm = cbm(doc_mod(seg), seg.shape[0], None, seq_len, seq_len, device="cuda", BLOCK_SIZE=128)
            dev = torch.device("cuda", torch.cuda.current_device())
            self.plan._flex.setdefault("bm", {})[str(dev)] = bm

    import dataclasses

    runs = {}
    for name in [f"tessera:{e}" for e in engines] + ["create_block_mask"]:
        model, opt = tg.build(cfg, data)
        eng = name.split(":")[1] if ":" in name else "flex"
        runs[name] = {"model": model, "opt": opt, "times": [], "losses": [], "engines": set(),
                      "cfg": dataclasses.replace(cfg, torch_engine=eng)}
    n = len(data.train)
    order = [data.train[tg.batch_order(n, s // n, cfg.seed)[s % n]] for s in range(warmup + steps)]
    ahead = iter(tessera.torch.PlanPrefetcher(order, lambda b: tg.batch_plan(b.segments), device="cuda"))
    base_engine = tg.Engine
    for step in range(warmup + steps):
        batch, plan = next(ahead)
        names = list(runs) if step % 2 == 0 else list(runs)[::-1]
        for name in names:
            r = runs[name]
            ours = name != "create_block_mask"
            tg.Engine = base_engine if ours else TorchMaskEngine
            sync(torch.device("cuda"))
            t = time.perf_counter()
            loss = tg.train_step(r["model"], r["opt"], batch, r["cfg"], step, "tessera", plan=plan if ours else None)
            sync(torch.device("cuda"))
            r["engines"].add(tessera.torch.last_dispatch()["engine"])
            if step >= warmup:
                r["times"].append(time.perf_counter() - t)
                r["losses"].append(loss)
    tg.Engine = base_engine
    out = {"seq_len": seq_len, "batch_size": batch_size, "steps": steps, "warmup": warmup}
    base = runs["create_block_mask"]
    c = statistics.median(base["times"]) * 1e3
    for name, r in runs.items():
        ms = statistics.median(r["times"]) * 1e3
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        out[name] = {"median_step_ms": ms, "losses": r["losses"], "ratio": ms / c, "max_abs_loss_diff": diff,
                     "engines_ran": sorted(r["engines"])}
        print(f"train step at {seq_len} tokens x {batch_size}: {name:>17} median {ms:7.1f} ms  {ms / c:5.3f}x  "
              f"(engines {sorted(r['engines'])}, max |loss diff| vs create_block_mask {diff:.2e})")
    return out


def environment(dev):
    flash, why_f = sel.flash_importable()
    varlen, why_v = sel.varlen_importable()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "tessera": tessera.__version__,
           "flash_attn.cute": flash or why_f, "varlen_attn": varlen or why_v}
    if dev.type == "cuda":
        env["device"] = torch.cuda.get_device_name(dev)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    print("environment:", json.dumps(env))
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default=None, help="token counts (default 8192,32768,131072; cpu: 512,1024)")
    ap.add_argument("--attn-lens", default=None, help="token counts of the attention section (default: --lens)")
    ap.add_argument("--attn-masks", default="doc_causal,sliding_window")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--example-engines", default="auto", help="tessera engines of the example's step (comma list)")
    ap.add_argument("--example-amp", default="bf16", choices=("off", "bf16"), help="the example's forward precision")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--skip", default="", help="comma list of sections to skip: block_masks,attention,example")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench/flex_gpu.py: no CUDA device (--device cpu runs the smoke test)", file=sys.stderr)
        return 2
    cpu = dev.type == "cpu"
    lens = [int(x) for x in (args.lens or ("512,1024" if cpu else "8192,32768,131072")).split(",")]
    heads, dim, dtype = (2, 16, torch.float32) if cpu else (16, 128, torch.bfloat16)
    window = 128 if cpu else 1024
    reps = 1 if cpu else args.reps
    skip = set(filter(None, args.skip.split(",")))
    attn_lens = [int(x) for x in args.attn_lens.split(",")] if args.attn_lens else lens
    res = {"environment": environment(dev)}

    def save():  # after every section, so that a time limit still leaves the finished ones
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    save()
    if "block_masks" not in skip:
        res["block_masks"] = block_masks(lens, reps, dev, window, 128)
        save()
    if "attention" not in skip:
        res["attention"] = attention(attn_lens, reps, dev, window, 128, heads, dim, dtype,
                                     set(args.attn_masks.split(",")))
        save()
    if "example" not in skip and not cpu:
        res["example"] = example_steps(args.seq_len, args.batch_size, args.steps, args.warmup,
                                       tuple(args.example_engines.split(",")), args.example_amp)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
