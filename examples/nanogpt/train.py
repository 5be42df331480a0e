#!/usr/bin/env python3
"""nanoGPT's model (`model.py`, unchanged but for its attention call) trained through Tessera on
CPU or on an XLA device (torch_xla on PJRT: TPU, or the CPU client), on the bytes of the shipped
corpus. See README.md beside this file.

    python examples/nanogpt/train.py --device cpu --steps 20
    PJRT_DEVICE=CPU python examples/nanogpt/train.py --device xla --steps 20   # in .venv-xla
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model import GPT, GPTConfig  # noqa: E402  (nanoGPT's model, beside this file)

CORPUS = HERE.parent.parent / "data" / "corpus" / "licenses.jsonl"


def batches(steps: int, batch: int, length: int, seed: int) -> List[torch.Tensor]:
    """``steps`` random windows of ``length + 1`` bytes of the corpus (inputs and shifted
    targets), the same for every device."""
    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, data.size - length - 1, size=batch)
        out.append(torch.from_numpy(np.stack([data[s : s + length + 1] for s in starts])))
    return out


def model_config(**kw) -> GPTConfig:
    cfg = dict(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False)
    cfg.update(kw)
    return GPTConfig(**cfg)


def train(device: str, steps: int = 8, batch: int = 4, length: int = 128, seed: int = 0, lr: float = 1e-3,
          step_hook=None) -> List[float]:
    """The loss of every step of ``steps`` AdamW steps on ``device`` ("cpu" or "xla"), from the
    same initial weights and batches for every device. ``step_hook(i)`` runs after each step
    (on XLA after its graph is cut, ``torch_xla.sync()``)."""
    torch.manual_seed(seed)
    model = GPT(model_config(block_size=length))
    on_xla = device == "xla"
    if on_xla:
        import torch_xla

        dev = torch_xla.device()
    else:
        dev = torch.device(device)
    model.to(dev)
    # Module.to on an XLA device unties nanoGPT's tied embedding and output weights (each becomes its
    # own device tensor): tie them again, as model.py does, before the optimizer sees them.
    model.transformer.wte.weight = model.lm_head.weight
    # capturable=True on XLA: AdamW's step counter stays a device tensor (no .item() per step, so
    # no new constant in the graph and no recompilation).
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, capturable=on_xla)
    losses = []
    for i, xy in enumerate(batches(steps, batch, length, seed)):
        xy = xy.to(dev)
        _, loss = model(xy[:, :-1].contiguous(), xy[:, 1:].contiguous())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if on_xla:
            torch_xla.sync()
        if step_hook is not None:
            step_hook(i)
    # one host read at the end (on XLA: after the last step)
    return [float(x) for x in torch.stack(losses).cpu()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    if args.device == "xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla.debug.metrics as met

    compiles = []

    def hook(i):
        if args.device == "xla":
            d = met.metric_data("CompileTime")
            compiles.append(int(d[0]) if d else 0)

    losses = train(args.device, args.steps, args.batch, args.seq_len, step_hook=hook)
    for i, loss in enumerate(losses):
        extra = f"  compilations so far {compiles[i]}" if compiles else ""
        print(f"step {i:3d}  loss {loss:.4f}{extra}")
    if compiles and len(compiles) > 3:
        print(f"compilations after step 3: {compiles[-1] - compiles[2]}")


if __name__ == "__main__":
    main()
