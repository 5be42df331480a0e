#!/usr/bin/env python3
"""Tessera on a GPU through FlexAttention (issue 30), in one process on one CUDA device.

1. BlockMask: causal within documents of 1K-3K tokens (mean ~2K, seeded), one row, BLOCK_SIZE 128.
   Tessera plans from scratch (`cache=False`) and builds the device BlockMask from its work lists
   (`plan.to_flex_block_mask(device="cuda")`: tables built on the host, copied once); torch runs
   `torch.compile(create_block_mask)` on the GPU with the same mask_mod over device segment ids
   (its first call, the compilation, excluded; Tessera gets one untimed call too). Both give the
   same eight tables (checked). Times are medians of `--reps`, each ended by a device sync.
2. The training example (`examples/train_gpt.py --device cuda`, bytes tokenizer, the default
   model) at `--seq-len` tokens: median train-step time of `tessera.torch.attention` (FlexAttention
   over Tessera's BlockMask, built per batch from the batch's plan) against the same step with the
   BlockMask from `create_block_mask` (built per batch on the GPU, swapped into the plan), in
   lockstep on the same batches after `--warmup` untimed steps (compilation).

Usage: .venv/bin/python bench/flex_gpu.py [--lens 32768,131072] [--reps 9] [--seq-len 8192]
       [--batch-size 1] [--steps 20] [--warmup 3] [--json out.json]
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

REPO = Path(__file__).resolve().parent.parent
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
          "q_indices", "full_q_num_blocks", "full_q_indices")


def doc_ids(n: int, seed: int = 11) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids, doc = [], 0
    while len(ids) < n:
        k = int(min(rng.integers(1024, 3073), n - len(ids)))
        ids += [doc] * k
        doc += 1
    return np.asarray(ids, dtype=np.int64)


def timed(fn, reps: int):
    ts, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def doc_causal_mod(seg: torch.Tensor):
    """``causal & document`` over device segment ids ``[B, L]`` as a FlexAttention mask_mod."""

    def mod(b, h, q, kv):
        return (q >= kv) & (seg[b, q] == seg[b, kv]) & (seg[b, q] >= 0)

    return mod


def block_masks(lens, reps):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = torch.compile(create_block_mask)
    rows = []
    for n in lens:
        ids = doc_ids(n)
        mask = tessera.causal() & tessera.document(ids)
        seg = torch.from_numpy(ids)[None].cuda()
        mod = doc_causal_mod(seg)

        def ours():
            return tessera.plan(mask, q_len=n, cache=False).to_flex_block_mask(device="cuda")

        def theirs():
            return compiled(mod, 1, None, n, n, device="cuda", BLOCK_SIZE=128)

        ours()
        theirs()  # compiles
        t_ours, bm = timed(ours, reps)
        t_theirs, ref = timed(theirs, reps)
        equal = all(torch.equal(getattr(bm, t), getattr(ref, t)) for t in TABLES)
        rows.append({"tokens": n, "tessera_ms": t_ours * 1e3, "create_block_mask_ms": t_theirs * 1e3,
                     "speedup": t_theirs / t_ours, "tables_equal": equal})
        print(f"{n:>8} tokens: tessera {t_ours * 1e3:8.2f} ms   create_block_mask {t_theirs * 1e3:9.2f} ms   "
              f"{t_theirs / t_ours:6.1f}x   tables equal: {equal}")
    return rows


def example_steps(seq_len, batch_size, steps, warmup):
    from torch.nn.attention.flex_attention import create_block_mask

    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "train_gpt.py")
    tg = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = tg
    spec.loader.exec_module(tg)
    cfg = tg.Config(tokenizer="bytes", seq_len=seq_len, batch_size=batch_size, device="cuda", telemetry_every=0,
                    progress=False, out_dir="/tmp/tessera-flex-bench")
    data = tg.load_data(cfg)
    cbm = torch.compile(create_block_mask)

    class TorchMaskEngine(tg.Engine):
        """The same attention, with the BlockMask from create_block_mask (built on the GPU per batch)
        instead of the plan's."""

        def __init__(self, kind, segments, cfg, telemetry=None):
            super().__init__(kind, segments, cfg, telemetry)
            seg = torch.from_numpy(segments).cuda()
            bm = cbm(doc_causal_mod(seg), seg.shape[0], None, seq_len, seq_len, device="cuda", BLOCK_SIZE=128)
            dev = torch.device("cuda", torch.cuda.current_device())
            self.plan._flex.setdefault("bm", {})[str(dev)] = bm

    runs = {}
    for name in ("tessera", "create_block_mask"):
        model, opt = tg.build(cfg, data)
        runs[name] = {"model": model, "opt": opt, "times": [], "losses": []}
    n = len(data.train)
    base_engine = tg.Engine
    for step in range(warmup + steps):
        batch = data.train[tg.batch_order(n, step // n, cfg.seed)[step % n]]
        names = list(runs) if step % 2 == 0 else list(runs)[::-1]
        for name in names:
            r = runs[name]
            tg.Engine = base_engine if name == "tessera" else TorchMaskEngine
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = tg.train_step(r["model"], r["opt"], batch, cfg, step, "tessera")
            torch.cuda.synchronize()
            if step >= warmup:
                r["times"].append(time.perf_counter() - t)
                r["losses"].append(loss)
    tg.Engine = base_engine
    out = {"seq_len": seq_len, "batch_size": batch_size, "steps": steps, "warmup": warmup}
    for name, r in runs.items():
        out[name] = {"median_step_ms": statistics.median(r["times"]) * 1e3, "losses": r["losses"]}
        print(f"train step at {seq_len} tokens x {batch_size}: {name:>17} median {out[name]['median_step_ms']:.1f} ms")
    out["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(runs["tessera"]["losses"],
                                                              runs["create_block_mask"]["losses"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="32768,131072")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/flex_gpu.py: no CUDA device", file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tessera": tessera.__version__,
           "block_masks": block_masks([int(x) for x in args.lens.split(",")], args.reps),
           "example": example_steps(args.seq_len, args.batch_size, args.steps, args.warmup)}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
