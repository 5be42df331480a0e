#!/usr/bin/env python3
"""A small GPT trained on packed documents through Tessera (CPU, minutes on 2 cores).

The shipped license corpus (data/corpus/licenses.jsonl) is tokenized with a byte-level BPE trained
on its training split (`tokenizers`; raw bytes when that package is missing), packed with
`tessera.pack` into rows of `--seq-len` tokens (segment ids, positions reset per document), and a
decoder-only transformer (RMSNorm, RoPE on the packer's positions, GQA, learned per-head attention
sinks, attention-logit softcap) is trained with `causal & document` attention through
`tessera.torch.attention`. One plan per batch of segment ids, taken from Tessera's plan cache when
the batch repeats (every epoch after the first).

    python examples/train_gpt.py                         # train (default config, a few minutes)
    python examples/train_gpt.py --compare dense         # tessera vs dense reference, 20 steps
    python examples/train_gpt.py --compare sdpa --softcap 0   # ... vs torch SDPA (no softcap)
    python examples/train_gpt.py --attention flex        # checkpoint's val loss: flex vs tessera
    python examples/train_gpt.py --device cuda           # on a GPU: FlexAttention under the op

`--device cuda` trains the same model on a GPU: `tessera.torch.attention` then runs the fastest
GPU engine that is exact for the call (FlexAttention's FLASH or Triton kernel over each plan's
BlockMask; `varlen_attn` with `--torch-engine varlen`; docs/semantics.md#engines-and-devices), with the same plans, softcap,
sinks, telemetry and checkpoints; `tessera.torch.PlanPrefetcher` plans the next batches and
builds their BlockMasks on a background thread while a step runs. `--device cpu` (default) runs Tessera's CPU kernels.

`--attention` picks the attention engine of a run:
  tessera  tessera.torch.attention with the plan of `causal & document` (default);
  dense    the same function written out in PyTorch ops (scores, softcap, boolean [B,1,L,L]
           causal-within-document mask, the sink logit as one extra softmax column that is then
           dropped): the exact reference;
  sdpa     torch.nn.functional.scaled_dot_product_attention with the explicit boolean mask; SDPA
           has no softcap, so it needs `--softcap 0`; sinks are exact through one extra key
           (q gains a coordinate σ_h/scale, a key [0,…,0,1] with value 0 joins every row);
  flex     evaluation only (FlexAttention has no CPU backward): the checkpoint's validation loss
           through `plan.to_flex_block_mask()` and compiled `flex_attention` (softcap as a
           `score_mod`; CPU flex returns no LSE, so each learned sink joins as one extra key whose
           score the `score_mod` sets to σ_h, planned by tessera as
           `(causal(offset=128) & document(ids, [-1]*128 + ids)) | prefix(1)` over 128 + L keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import tessera
import tessera.torch

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "corpus" / "licenses.jsonl"
ENGINES = ("tessera", "dense", "sdpa", "flex")


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    # data
    corpus: str = str(CORPUS)
    vocab_size: int = 2048          # BPE vocabulary (bytes: 257)
    tokenizer: str = "bpe"          # "bpe" (tokenizers) or "bytes"
    seq_len: int = 512
    batch_size: int = 8
    val_every_nth_doc: int = 10     # documents 5, 15, 25, ... are held out
    max_docs: int = 0               # use only the first N documents (0 = all; for quick tests)
    # model
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    kv_heads: int = 2
    rope_base: float = 10000.0
    softcap: float = 20.0           # attention-logit softcap c·tanh(s/c); 0 = off
    sinks: bool = True              # learned per-head sink logits
    # optimization
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    # run
    attention: str = "tessera"
    telemetry_every: int = 10       # 0 = off
    eval_every: int = 25
    ckpt_every: int = 50
    threads: int = 0                # torch intra-op threads; 0 = leave the default
    out_dir: str = "out/train_gpt"
    progress: bool = True
    device: str = "cpu"             # "cuda": tessera.torch.attention runs FlexAttention
    torch_engine: str = "auto"      # tessera.torch.attention's engine ("flex" forces FlexAttention)
    amp: str = "off"                # "bf16": the forward under torch.autocast(bfloat16) (GPU runs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


# ---------------------------------------------------------------------------------------------
# data: tokenizer, split, packing, batches
# ---------------------------------------------------------------------------------------------


def read_corpus(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def split_docs(docs: Sequence[str], every: int) -> tuple:
    """Held-out documents: every ``every``-th one (starting at every//2), the rest train."""
    val = [d for i, d in enumerate(docs) if i % every == every // 2]
    train = [d for i, d in enumerate(docs) if i % every != every // 2]
    return train, val


class Tok:
    """A byte-level BPE (`tokenizers`) or plain bytes; ``bos`` is the document-start id."""

    def __init__(self, kind: str, vocab_size: int, train_docs: Sequence[str], path: Optional[Path]):
        self.kind = kind
        if kind == "bpe":
            try:
                from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
            except ImportError:
                print("tokenizers is not installed: falling back to byte-level tokens", file=sys.stderr)
                kind = self.kind = "bytes"
        if kind == "bytes":
            self.vocab_size, self.bos, self._tok = 257, 256, None
            return
        if kind != "bpe":
            raise ValueError(f"tokenizer: expected 'bpe' or 'bytes', got {kind!r}")
        if path is not None and path.exists():
            tok = Tokenizer.from_file(str(path))
        else:
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=vocab_size,
                special_tokens=["<|bos|>"],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            tok.train_from_iterator(list(train_docs), trainer)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tok.save(str(path))
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.bos = tok.token_to_id("<|bos|>")

    def encode(self, docs: Sequence[str]) -> List[List[int]]:
        if self._tok is None:
            return [list(d.encode("utf-8")) for d in docs]
        return [e.ids for e in self._tok.encode_batch(list(docs))]

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        return self._tok.decode(list(ids))


@dataclass
class Batch:
    tokens: torch.Tensor      # int64 [B, L]
    targets: torch.Tensor     # int64 [B, L], -100 where there is no next token in the document
    positions: torch.Tensor   # int64 [B, L], reset to 0 at each document (piece) start
    segments: np.ndarray      # int64 [B, L], -1 = padding
    n_targets: int


def make_batches(packed: Dict[str, Any], batch_size: int) -> List[Batch]:
    """Fixed groups of ``batch_size`` packed rows (the last group padded with empty rows), so that
    a batch's segment ids, and hence its plan, repeat every epoch."""
    tokens = packed["tokens"].astype(np.int64)
    seg = packed["segment_ids"].astype(np.int64)
    pos = packed["positions"].astype(np.int64)
    rows, length = tokens.shape
    pad = (-rows) % batch_size
    if pad:
        tokens = np.concatenate([tokens, np.zeros((pad, length), np.int64)])
        seg = np.concatenate([seg, np.full((pad, length), -1, np.int64)])
        pos = np.concatenate([pos, np.zeros((pad, length), np.int64)])
    # next-token targets inside the same document piece only; padding and document ends ignored
    tgt = np.full_like(tokens, -100)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)
    tgt[:, :-1] = np.where(same, tokens[:, 1:], -100)
    out = []
    for i in range(0, tokens.shape[0], batch_size):
        s = slice(i, i + batch_size)
        out.append(
            Batch(
                torch.from_numpy(tokens[s].copy()),
                torch.from_numpy(tgt[s].copy()),
                torch.from_numpy(pos[s].copy()),
                np.ascontiguousarray(seg[s]),
                int((tgt[s] >= 0).sum()),
            )
        )
    return out


@dataclass
class Data:
    tok: Tok
    train: List[Batch]
    val: List[Batch]
    stats: Dict[str, Any]


def load_data(cfg: Config, tokenizer_path: Optional[Path] = None) -> Data:
    docs = read_corpus(cfg.corpus)
    if cfg.max_docs:
        docs = docs[: cfg.max_docs]
    train_docs, val_docs = split_docs(docs, cfg.val_every_nth_doc)
    tok = Tok(cfg.tokenizer, cfg.vocab_size, train_docs, tokenizer_path)
    packed_train = tessera.pack(tok.encode(train_docs), cfg.seq_len, bos=tok.bos)
    packed_val = tessera.pack(tok.encode(val_docs), cfg.seq_len, bos=tok.bos)
    stats = {
        "documents": [len(train_docs), len(val_docs)],
        "train_pack": packed_train["stats"]["summary"],
        "val_pack": packed_val["stats"]["summary"],
        "train_tokens": int(packed_train["stats"]["tokens"]),
        "val_tokens": int(packed_val["stats"]["tokens"]),
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.kind,
    }
    return Data(tok, make_batches(packed_train, cfg.batch_size), make_batches(packed_val, cfg.batch_size), stats)


# ---------------------------------------------------------------------------------------------
# attention engines: one object per batch of segment ids
# ---------------------------------------------------------------------------------------------


def doc_causal_mask(segments: np.ndarray) -> torch.Tensor:
    """The explicit boolean ``[B, 1, L, L]`` mask of ``causal & document`` (docs/semantics.md#masks)."""
    s = torch.from_numpy(segments)
    length = s.shape[1]
    same = (s[:, :, None] == s[:, None, :]) & (s[:, :, None] >= 0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (same & causal)[:, None]


def dense_attention(q, k, v, allowed, scale, softcap, sinks):
    """The exact function of docs/semantics.md#attention written out in PyTorch ops (f32, no float64): scores,
    softcap, mask, the sink logit as one extra softmax column (then dropped). Rows with no
    allowed key (and no sink) give 0."""
    b, hq, length, _ = q.shape
    group = hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, hq, 1, 1).expand(b, hq, length, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    z = p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.matmul(p[..., :length] / z, v)


class Engine:
    """Attention of one batch: ``engine(q, k, v, sinks, layer)`` with q/k/v ``[B, H, L, D]``."""

    def __init__(self, kind: str, segments: np.ndarray, cfg: Config, telemetry=None, plan=None):
        self.kind, self.cfg, self.telemetry = kind, cfg, telemetry
        dev = torch.device(cfg.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.softcap = cfg.softcap if cfg.softcap > 0 else None
        length = segments.shape[1]
        if kind == "tessera":
            # Built once per batch of segment ids (or ahead, by tessera.torch.PlanPrefetcher on a
            # GPU); the plan cache returns it when ids repeat.
            self.plan = plan if plan is not None else batch_plan(segments)
        elif kind == "dense":
            self.allowed = doc_causal_mask(segments).to(dev)
        elif kind == "sdpa":
            if self.softcap is not None:
                raise ValueError("--attention sdpa: SDPA has no softcap; run both sides with --softcap 0")
            allowed = doc_causal_mask(segments)
            if cfg.sinks:
                # one extra key column (the sink), allowed for every row
                extra = torch.ones(allowed.shape[:3] + (1,), dtype=torch.bool)
                allowed = torch.cat([allowed, extra], dim=-1)
            else:
                # a padding row allows nothing; SDPA would give NaN there, so such rows attend to
                # themselves: this changes only padding rows, which the loss ignores and no real
                # row reads (their segment id never matches)
                pad = torch.from_numpy(segments < 0)[:, None, :, None] & torch.eye(length, dtype=torch.bool)
                allowed = allowed | pad
            self.allowed = allowed.to(dev)
        elif kind == "flex":
            self.plan = flex_plan(segments, cfg.sinks)
            self.block_mask = self.plan.to_flex_block_mask()
        else:
            raise ValueError(f"attention: expected one of {ENGINES}, got {kind!r}")

    def __call__(self, q, k, v, sinks, layer: int):
        if self.kind == "tessera":
            return tessera.torch.attention(
                q, k, v, self.plan, scale=self.scale, softcap=self.softcap, sinks=sinks,
                telemetry=self.telemetry, layer=layer, engine=self.cfg.torch_engine,
            )
        if self.kind == "dense":
            return dense_attention(q, k, v, self.allowed, self.scale, self.softcap, sinks)
        if self.kind == "sdpa":
            if sinks is not None:
                b, hq, length, d = q.shape
                hkv = k.shape[1]
                # q·k' over D+1 coordinates: real keys get 0 in the extra one, the sink key is
                # [0, ..., 0, 1] with value 0, and q's extra coordinate is σ_h / scale, so the
                # sink's score is exactly σ_h and it joins the denominator only.
                qx = torch.cat([q, (sinks / self.scale).view(1, hq, 1, 1).expand(b, hq, length, 1)], -1)
                kx = torch.cat([k, k.new_zeros(b, hkv, length, 1)], -1)
                sink_k = k.new_zeros(b, hkv, 1, d + 1)
                sink_k[..., -1] = 1.0
                kx = torch.cat([kx, sink_k], dim=2)
                vx = torch.cat([v, v.new_zeros(b, hkv, 1, v.shape[-1])], dim=2)
                q, k, v = qx, kx, vx
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=self.allowed, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        if self.kind == "flex":
            return flex_attention_op(q, k, v, self.block_mask, self.scale, self.softcap, sinks)
        raise AssertionError(self.kind)


_flex_compiled: Dict[Any, Callable] = {}

# Sinks under flex: CPU FlexAttention has no backward and cannot return the LSE, so the sink joins
# as a real key. The keys are prefixed with SINK_PAD slots (one kv tile, so the real keys stay
# tile-aligned): slot 0 is the sink (k = 0, v = 0, score set to σ_h by the score_mod, never
# softcapped), slots 1.. are dead (segment id -1). The mask over [L, SINK_PAD + L] is
# (causal(offset=SINK_PAD) & document(ids, [-1]*SINK_PAD + ids)) | prefix(1): exactly the
# tessera mask on the real keys plus the sink for every row, so Z = exp(σ_h) + Σ_allowed exp(s).
SINK_PAD = 128


def batch_plan(segments: np.ndarray) -> "tessera.Plan":
    """The plan of one batch of segment ids: causal attention within documents."""
    mask = tessera.causal() & tessera.document(segments)
    return tessera.plan(mask, q_len=segments.shape[1], cache=True)


def flex_plan(segments: np.ndarray, sinks: bool) -> "tessera.Plan":
    length = segments.shape[1]
    if not sinks:
        return tessera.plan(tessera.causal() & tessera.document(segments), q_len=length, cache=True)
    kv_ids = np.concatenate([np.full((segments.shape[0], SINK_PAD), -1, np.int64), segments], axis=1)
    mask = (tessera.causal(offset=SINK_PAD) & tessera.document(segments, kv_ids)) | tessera.prefix(1)
    return tessera.plan(mask, q_len=length, kv_len=SINK_PAD + length, cache=True)


def flex_attention_op(q, k, v, block_mask, scale, softcap, sinks):
    """Compiled ``flex_attention`` over the plan's BlockMask (inference: no CPU backward).
    Softcap is a ``score_mod``; with sinks, ``k``/``v`` gain the SINK_PAD prefix slots above and
    the ``score_mod`` gives slot 0 the score σ_h."""
    from torch.nn.attention.flex_attention import flex_attention

    key = (softcap, scale, sinks is not None)
    fn = _flex_compiled.get(key)
    if fn is None:
        c = float(softcap) if softcap else None

        def run(q, k, v, block_mask, sinks):
            def score_mod(score, b, h, q_idx, kv_idx):
                s = c * torch.tanh(score / c) if c is not None else score
                if sinks is not None:
                    s = torch.where(kv_idx == 0, sinks[h], s)
                return s

            return flex_attention(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )

        fn = _flex_compiled[key] = torch.compile(run, dynamic=False)
    if sinks is not None:
        b, hkv, _, _ = k.shape
        k = torch.cat([k.new_zeros(b, hkv, SINK_PAD, k.shape[-1]), k], dim=2)
        v = torch.cat([v.new_zeros(b, hkv, SINK_PAD, v.shape[-1]), v], dim=2)
    return fn(q, k, v, block_mask, sinks)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


def rope_tables(positions: torch.Tensor, dim: int, base: float):
    """cos/sin ``[B, L, 1, dim/2]`` at the packer's per-document positions."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    ang = positions.to(torch.float32)[..., None] * inv
    return torch.cos(ang)[:, :, None, :], torch.sin(ang)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.h, self.hkv, self.d = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, self.h * self.d, bias=False)
        self.wkv = nn.Linear(cfg.d_model, 2 * self.hkv * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, cfg.d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.h)) if cfg.sinks else None

    def forward(self, x, cos, sin, engine: Engine, layer: int):
        b, length, _ = x.shape
        q = apply_rope(self.wq(x).view(b, length, self.h, self.d), cos, sin)
        k, v = self.wkv(x).view(b, length, 2, self.hkv, self.d).unbind(2)
        k = apply_rope(k, cos, sin)
        # [B, L, H, D] storage viewed as [B, H, L, D]: tessera reads the strided views in place
        o = engine(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.sinks, layer)
        return self.wo(o.transpose(1, 2).reshape(b, length, self.h * self.d))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.n2 = nn.RMSNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, engine, layer):
        x = x + self.attn(self.n1(x), cos, sin, engine, layer)
        return x + self.proj(F.gelu(self.fc(self.n2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: Config, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.apply(self._init)
        for blk in self.blocks:  # scaled init of the residual projections (GPT-2)
            nn.init.normal_(blk.attn.wo.weight, std=0.02 / math.sqrt(2 * cfg.layers))
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, batch: Batch, engine: Engine) -> torch.Tensor:
        """Mean next-token loss over the batch's real targets (padding and document ends ignored)."""
        dev = self.emb.weight.device
        x = self.emb(batch.tokens.to(dev))
        cos, sin = rope_tables(batch.positions.to(dev), self.cfg.head_dim, self.cfg.rope_base)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, engine, i)
        logits = F.linear(self.norm(x), self.emb.weight)  # tied embeddings
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), batch.targets.to(dev).view(-1), ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# optimization, evaluation, checkpoints
# ---------------------------------------------------------------------------------------------


def make_optimizer(model: GPT, cfg: Config) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    keep = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms and sinks
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from lr to min_lr over the remaining steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def batch_order(n_batches: int, epoch: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_batches)


@torch.no_grad()
def evaluate(model: GPT, batches: Sequence[Batch], cfg: Config, kind: str) -> Dict[str, float]:
    """Validation loss (mean over every held-out target token) and tokens/s of the forwards."""
    model.eval()
    total, count, seconds = 0.0, 0, 0.0
    for batch in batches:
        t = time.perf_counter()
        loss = model(batch, Engine(kind, batch.segments, cfg))
        seconds += time.perf_counter() - t
        total += float(loss) * batch.n_targets
        count += batch.n_targets
    model.train()
    tokens = sum(int((b.segments >= 0).sum()) for b in batches)
    return {"loss": total / max(count, 1), "tokens_per_s": tokens / max(seconds, 1e-9), "seconds": seconds}


def save_checkpoint(path: Path, model: GPT, opt: torch.optim.Optimizer, step: int, cfg: Config, tok_kind: str):
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, val in opt.state.get(p, {}).items():
                val = val if torch.is_tensor(val) else torch.tensor(val)
                tensors[f"optim.{names[id(p)]}.{key}"] = val.detach().cpu().contiguous()
    meta = {"step": str(step), "config": json.dumps(dataclasses.asdict(cfg)), "tokenizer": tok_kind}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: GPT, opt: Optional[torch.optim.Optimizer]) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    if opt is not None:
        params = dict(model.named_parameters())
        for name, p in params.items():
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                t = tensors.get(f"optim.{name}.{key}")
                if t is not None:
                    # AdamW keeps `step` on the host and the moments with the parameter
                    state[key] = t.clone() if key == "step" else t.to(p.device, copy=True)
            if state:
                opt.state[p] = state
    return int(meta["step"])


def checkpoint_config(path: Path) -> Dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["config"])


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    losses: List[float] = field(default_factory=list)             # train loss per step
    step_seconds: List[float] = field(default_factory=list)       # wall time per step
    logged: List[bool] = field(default_factory=list)              # telemetry logging step?
    val: List[tuple] = field(default_factory=list)                # (step, val loss)
    train_tokens: int = 0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    telemetry_records: int = 0
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.train_tokens / max(self.train_seconds, 1e-9)


def build(cfg: Config, data: Data):
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, data.tok.vocab_size).to(cfg.device)
    return model, make_optimizer(model, cfg)


def train_step(model: GPT, opt, batch: Batch, cfg: Config, step: int, kind: str, tel=None, plan=None) -> float:
    """One optimizer step: the plan (or mask) of the batch (``plan``: made ahead), forward,
    backward, clip, AdamW."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    engine = Engine(kind, batch.segments, cfg, telemetry=tel, plan=plan)
    dev_type = torch.device(cfg.device).type
    with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
        loss = model(batch, engine)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    if tel is not None:
        tel.advance()
    return float(loss.detach())


def train(
    cfg: Config,
    data: Optional[Data] = None,
    *,
    resume: Optional[Path] = None,
    save: bool = True,
    evaluate_val: bool = True,
    until: Optional[int] = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Trains to step ``cfg.steps`` (continuing from ``resume``; stopping early after step
    ``until``, as an interrupted run would) and returns the run's history."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    if save:
        out.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = load_data(cfg, out / "tokenizer.json" if save and cfg.tokenizer == "bpe" else None)
    if cfg.attention == "flex":
        raise ValueError("--attention flex evaluates a checkpoint (FlexAttention has no CPU backward)")
    model, opt = build(cfg, data)
    start = 0
    if resume is not None:
        start = load_checkpoint(resume, model, opt)
        log(f"resumed from {resume} at step {start}")
    tel = None
    tel_path = out / "telemetry.jsonl"
    if cfg.telemetry_every > 0 and cfg.attention == "tessera":
        tel = tessera.Telemetry(every=cfg.telemetry_every)
        tel.step = start
        if save and start == 0 and tel_path.exists():
            tel_path.unlink()
    res = RunResult()
    n = len(data.train)
    if evaluate_val and start == 0:
        v = evaluate(model, data.val, cfg, cfg.attention)
        res.val.append((0, v["loss"]))
        log(f"step 0: val loss {v['loss']:.4f}")
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)
    wall = time.perf_counter()
    stop = cfg.steps if until is None else min(until, cfg.steps)
    order = ((step, data.train[batch_order(n, step // n, cfg.seed)[step % n]]) for step in range(start, stop))
    if cfg.device != "cpu" and cfg.attention == "tessera":
        # On a GPU the next batches' plans and BlockMasks are made while this step runs.
        steps = iter(tessera.torch.PlanPrefetcher(order, lambda sb: batch_plan(sb[1].segments), device=cfg.device))
    else:
        steps = (((step, batch), None) for step, batch in order)
    for (step, batch), plan in steps:
        logged = tel is not None and tel.should_log()
        t = time.perf_counter()
        lv = train_step(model, opt, batch, cfg, step, cfg.attention, tel, plan=plan)
        dt = time.perf_counter() - t
        res.losses.append(lv)
        res.step_seconds.append(dt)
        res.logged.append(logged)
        res.train_tokens += int((batch.segments >= 0).sum())
        res.train_seconds += dt
        if bar is not None:
            bar.set_postfix(loss=f"{lv:.3f}", lr=f"{lr_at(step, cfg):.1e}", tok_s=f"{res.tokens_per_s:,.0f}")
            bar.update(1)
        done = step + 1
        if evaluate_val and (done % cfg.eval_every == 0 or done == cfg.steps):
            v = evaluate(model, data.val, cfg, cfg.attention)
            res.val.append((done, v["loss"]))
            msg = f"step {done}: train loss {lv:.4f}, val loss {v['loss']:.4f}, {res.tokens_per_s:,.0f} tok/s"
            (bar.write if bar is not None else log)(msg)
        if tel is not None and save and (done % cfg.eval_every == 0 or done == cfg.steps or done == until):
            res.telemetry_records += tel.write_jsonl(tel_path)  # the one deferred host read
        if save and (done % cfg.ckpt_every == 0 or done == cfg.steps or done == until):
            save_checkpoint(out / "ckpt.safetensors", model, opt, done, cfg, data.tok.kind)
    if bar is not None:
        bar.close()
    res.wall_seconds = time.perf_counter() - wall
    res.cache = {k: v for k, v in tessera.cache_stats().items() if isinstance(v, (int, float))}
    if save:
        hist = out / "history.json"
        prev = json.loads(hist.read_text()) if resume is not None and hist.exists() else {"train": [], "val": []}
        prev["train"] += [[start + i + 1, x] for i, x in enumerate(res.losses)]
        prev["val"] += [list(x) for x in res.val]
        prev["data"] = data.stats
        prev["config"] = dataclasses.asdict(cfg)
        hist.write_text(json.dumps(prev))
    return res


# ---------------------------------------------------------------------------------------------
# reports: agreement, flex evaluation, pictures
# ---------------------------------------------------------------------------------------------


def lockstep(cfg: Config, engines: Sequence[str], steps: int, data: Data) -> Dict[str, Dict[str, Any]]:
    """Trains one copy of the model per engine (same seed, same batches, same schedule) in
    lockstep: every step runs once per engine, in an order that rotates each step, so all engines
    see the same machine load and their times compare fairly. ``"tessera+tel"`` is tessera with
    telemetry at ``cfg.telemetry_every`` (records written every ``cfg.eval_every`` steps, inside
    the timed region). Before step 0 each copy runs one untimed forward/backward (no update) to
    warm up threads and lazy initialization."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tel_path = Path(cfg.out_dir) / "bench_telemetry.jsonl"
    if any(name.endswith("+tel") for name in engines):
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        if tel_path.exists():
            tel_path.unlink()
    n = len(data.train)
    runs: Dict[str, Dict[str, Any]] = {}
    for name in engines:
        kind = name.split("+")[0]
        model, opt = build(cfg, data)
        tel = tessera.Telemetry(every=cfg.telemetry_every) if name.endswith("+tel") else None
        b0 = data.train[batch_order(n, 0, cfg.seed)[0]]
        engine = Engine(kind, b0.segments, cfg)  # keeps the plan alive through backward
        model(b0, engine).backward()
        opt.zero_grad(set_to_none=True)
        runs[name] = {"kind": kind, "model": model, "opt": opt, "tel": tel, "losses": [], "times": []}
    tokens = 0
    for step in range(steps):
        batch = data.train[batch_order(n, step // n, cfg.seed)[step % n]]
        k = step % len(engines)
        for name in list(engines[k:]) + list(engines[:k]):
            r = runs[name]
            t = time.perf_counter()
            r["losses"].append(train_step(r["model"], r["opt"], batch, cfg, step, r["kind"], r["tel"]))
            if r["tel"] is not None and (step + 1) % cfg.eval_every == 0:
                r["tel"].write_jsonl(tel_path)
            r["times"].append(time.perf_counter() - t)
        tokens += int((batch.segments >= 0).sum())
    for r in runs.values():
        r["tokens_per_s"] = tokens / sum(r["times"])
        del r["model"], r["opt"], r["tel"]
    return runs


def compare(cfg: Config, other: str, steps: int, data: Optional[Data] = None, log=print) -> Dict[str, Any]:
    """Trains ``steps`` steps from the same seed with tessera and with ``other`` (dense or
    sdpa), in lockstep, and returns both loss series, their largest difference and tokens/s."""
    if data is None:
        data = load_data(cfg)
    runs = lockstep(cfg, ["tessera", other], steps, data)
    a, b = runs["tessera"]["losses"], runs[other]["losses"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    log(f"{'step':>4} {'tessera':>12} {other:>12} {'|diff|':>10}")
    for i, (x, y, d) in enumerate(zip(a, b, diffs)):
        log(f"{i + 1:>4} {x:>12.7f} {y:>12.7f} {d:>10.2e}")
    rep = {
        "steps": steps,
        "other": other,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "softcap": cfg.softcap,
        "sinks": cfg.sinks,
        "tessera": a,
        other: b,
        "max_abs_diff": max(diffs),
        "tokens_per_s": {k: r["tokens_per_s"] for k, r in runs.items()},
    }
    log(
        f"max |loss diff| over {steps} steps: {rep['max_abs_diff']:.2e}; training tokens/s (lockstep) "
        f"tessera {rep['tokens_per_s']['tessera']:,.0f} vs {other} {rep['tokens_per_s'][other]:,.0f}"
    )
    return rep


def bench(cfg: Config, engines: Sequence[str], steps: int, data: Optional[Data] = None, log=print) -> Dict[str, Any]:
    """Training tokens/s of several engines in lockstep (see :func:`lockstep`); with both
    ``tessera`` and ``tessera+tel``, the telemetry overhead (their wall-time ratio - 1)."""
    if data is None:
        data = load_data(cfg)
    runs = lockstep(cfg, engines, steps, data)
    rep: Dict[str, Any] = {"steps": steps, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
                           "softcap": cfg.softcap, "sinks": cfg.sinks, "telemetry_every": cfg.telemetry_every,
                           "threads": torch.get_num_threads(), "tokens_per_s": {}, "seconds": {},
                           "median_step_s": {}}
    for name, r in runs.items():
        times = r["times"]
        rep["seconds"][name] = sum(times)
        rep["tokens_per_s"][name] = r["tokens_per_s"]
        rep["median_step_s"][name] = float(np.median(times))
        log(f"{name:>12}: {r['tokens_per_s']:>8,.0f} train tok/s  ({sum(times):.1f} s for {steps} steps, "
            f"median step {np.median(times) * 1e3:.0f} ms)")
    if "tessera+tel" in runs and "tessera" in runs:
        on, off = runs["tessera+tel"]["times"], runs["tessera"]["times"]
        rep["telemetry_overhead"] = sum(on) / sum(off) - 1
        # Two model copies differ in speed by a few % on a busy 2-core machine even when they run
        # the same code (measured with --telemetry-every 0), so the raw wall ratio mixes that bias
        # into the overhead. Only logging steps run different code: the bias is the median
        # per-step ratio on plain steps, the cost of a logging step its median ratio over that,
        # and the wall-time overhead that cost times the fraction of steps that log.
        every = cfg.telemetry_every
        ratio = [a / b for a, b in zip(on, off)]
        logged = [r for i, r in enumerate(ratio) if every > 0 and i % every == 0]
        plain = [r for i, r in enumerate(ratio) if not (every > 0 and i % every == 0)]
        bias = float(np.median(plain)) if plain else 1.0
        rep["copy_bias"] = bias - 1
        if logged:
            rep["logging_step_cost"] = float(np.median(logged)) / bias - 1
            rep["telemetry_overhead_corrected"] = rep["logging_step_cost"] * len(logged) / len(ratio)
        log(f"telemetry every {every}: raw wall time {100 * rep['telemetry_overhead']:+.2f}%; "
            f"copy bias on plain steps {100 * rep['copy_bias']:+.2f}%"
            + (f"; a logging step costs {100 * rep['logging_step_cost']:+.2f}%, so the wall-time "
               f"overhead is {100 * rep['telemetry_overhead_corrected']:+.2f}%" if logged else ""))
    return rep


def flex_eval(ckpt: Path, cfg_over: Dict[str, Any], rounds: int = 3, log=print) -> Dict[str, Any]:
    """Validation loss of a checkpoint through flex_attention (compiled, over the plan's
    BlockMask) and through tessera, with eval tokens/s of both (after one warm-up pass)."""
    base = checkpoint_config(ckpt)
    base.update(cfg_over)
    cfg = Config(**base)
    tok_path = ckpt.parent / "tokenizer.json"
    data = load_data(cfg, tok_path if cfg.tokenizer == "bpe" and tok_path.exists() else None)
    model, _ = build(cfg, data)
    step = load_checkpoint(ckpt, model, None)
    res: Dict[str, Any] = {"step": step}
    kinds = ("flex", "tessera", "dense")
    for kind in kinds:
        t = time.perf_counter()
        evaluate(model, data.val, cfg, kind)  # warm-up: one pass (flex compiles per mask bucket)
        res[f"{kind}_warmup_s"] = time.perf_counter() - t
    runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(rounds):  # alternate, so all see the same machine load
        for kind in kinds:
            runs[kind].append(evaluate(model, data.val, cfg, kind))
    for kind, rs in runs.items():
        r = dict(rs[0])  # the loss is the same every round; times are medians over rounds
        r["tokens_per_s"] = float(np.median([x["tokens_per_s"] for x in rs]))
        r["seconds"] = float(np.median([x["seconds"] for x in rs]))
        res[kind] = r
        log(f"{kind:>8}: val loss {r['loss']:.6f}  {r['tokens_per_s']:,.0f} tok/s (median of {rounds}; "
            f"warm-up {res[kind + '_warmup_s']:.1f} s)")
    res["abs_diff"] = abs(res["flex"]["loss"] - res["tessera"]["loss"])
    log(f"|flex - tessera| = {res['abs_diff']:.2e} (checkpoint step {step})")
    return res


def plot_loss(history: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = json.loads(history.read_text())
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    tr = np.array(h["train"], dtype=float)
    if len(tr):
        ax.plot(tr[:, 0], tr[:, 1], lw=0.8, alpha=0.6, label="train (per step)")
    va = np.array(h["val"], dtype=float)
    if len(va):
        ax.plot(va[:, 0], va[:, 1], "o-", lw=1.5, label="validation (held-out docs)")
    c = h.get("config", {})
    ax.set_title(
        f"GPT {c.get('layers')}L d{c.get('d_model')} on packed licenses, "
        f"causal & document via tessera", fontsize=9
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def find_cli() -> Optional[str]:
    local = REPO / "target" / "release" / "tessera"
    if local.exists():
        return str(local)
    return shutil.which("tessera")


def plot_telemetry(jsonl: Path, out_dir: Path, layers: int, log=print) -> List[Path]:
    """`tessera telemetry plot`: every layer in one picture (sink mass per layer and head over
    steps, the largest max_logit per layer), then one picture per layer (max_logit per head)."""
    cli = find_cli()
    if cli is None:
        log("tessera CLI not found (cargo build --release): skipping the telemetry pictures")
        return []
    pngs = []
    for layer in ["all"] + [str(i) for i in range(layers)]:
        png = out_dir / ("telemetry.png" if layer == "all" else f"telemetry_layer{layer}.png")
        cmd = [cli, "telemetry", "plot", "--in", str(jsonl), "--out", str(png), "--layer", layer]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
            continue
        pngs.append(png)
    if pngs:
        log("telemetry pictures: " + ", ".join(str(p) for p in pngs))
    return pngs


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    d = Config()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  python examples/train_gpt.py\n  python examples/train_gpt.py --compare dense\n"
        "  python examples/train_gpt.py --attention flex",
    )
    a = p.add_argument
    a("--attention", choices=ENGINES, default=d.attention, help="attention engine (see the module docstring)")
    a("--steps", type=int, default=d.steps)
    a("--batch-size", type=int, default=d.batch_size)
    a("--seq-len", type=int, default=d.seq_len)
    a("--layers", type=int, default=d.layers)
    a("--d-model", type=int, default=d.d_model)
    a("--heads", type=int, default=d.heads)
    a("--kv-heads", type=int, default=d.kv_heads)
    a("--vocab-size", type=int, default=d.vocab_size)
    a("--tokenizer", choices=("bpe", "bytes"), default=d.tokenizer)
    a("--softcap", type=float, default=d.softcap, help="attention-logit softcap (0 = off)")
    a("--no-sinks", action="store_true", help="no learned sink logits")
    a("--lr", type=float, default=d.lr)
    a("--min-lr", type=float, default=d.min_lr)
    a("--warmup", type=int, default=d.warmup)
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--clip", type=float, default=d.clip)
    a("--seed", type=int, default=d.seed)
    a("--telemetry-every", type=int, default=d.telemetry_every, help="telemetry cadence in steps (0 = off)")
    a("--eval-every", type=int, default=d.eval_every)
    a("--ckpt-every", type=int, default=d.ckpt_every)
    a("--threads", type=int, default=d.threads, help="torch threads (0 = default)")
    a("--device", default=d.device, help="cpu (Tessera's kernels) or cuda (FlexAttention under tessera.torch.attention)")
    a("--torch-engine", default=d.torch_engine, help="tessera.torch.attention's engine: auto, flex, flex_flash, varlen, tessera")
    a("--amp", choices=("off", "bf16"), default=d.amp, help="bf16: the forward under torch.autocast(bfloat16)")
    a("--out-dir", default=d.out_dir)
    a("--resume", nargs="?", const="", default=None, metavar="CKPT",
      help="continue from a checkpoint (default OUT_DIR/ckpt.safetensors)")
    a("--compare", choices=("dense", "sdpa"), help="train --compare-steps steps with tessera and with this engine; print both losses")
    a("--compare-steps", type=int, default=20)
    a("--bench", metavar="ENGINES", help="comma list of engines (tessera, tessera+tel, dense, sdpa) to time in lockstep for --bench-steps training steps")
    a("--bench-steps", type=int, default=30)
    a("--no-progress", action="store_true")
    a("--no-plots", action="store_true")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        vocab_size=args.vocab_size, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
        layers=args.layers, d_model=args.d_model, heads=args.heads, kv_heads=args.kv_heads,
        softcap=args.softcap, sinks=not args.no_sinks, steps=args.steps, lr=args.lr, min_lr=args.min_lr,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, seed=args.seed,
        attention=args.attention, telemetry_every=args.telemetry_every, eval_every=args.eval_every,
        ckpt_every=args.ckpt_every, threads=args.threads, out_dir=args.out_dir, progress=not args.no_progress,
        device=args.device, torch_engine=args.torch_engine, amp=args.amp,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        print(f"--device {cfg.device}: torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(cfg.out_dir)
    ckpt = Path(args.resume) if args.resume else out / "ckpt.safetensors"

    if args.compare:
        out.mkdir(parents=True, exist_ok=True)
        rep = compare(cfg, args.compare, args.compare_steps)
        path = out / f"compare_{args.compare}.json"
        path.write_text(json.dumps(rep, indent=1))
        print(f"wrote {path}")
        return 0 if rep["max_abs_diff"] <= 1e-4 else 1

    if args.bench:
        engines = [e.strip() for e in args.bench.split(",") if e.strip()]
        bad = [e for e in engines if e not in ("tessera", "tessera+tel", "dense", "sdpa")]
        if bad:
            print(f"--bench: unknown engine(s) {bad}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        rep = bench(cfg, engines, args.bench_steps)
        path = out / f"bench_{'_'.join(e.replace('+', '-') for e in engines)}.json"
        path.write_text(json.dumps(rep, indent=1))
        print(f"wrote {path}")
        return 0

    if cfg.attention == "flex":
        if not ckpt.exists():
            print(f"--attention flex evaluates a checkpoint; {ckpt} does not exist (train first)", file=sys.stderr)
            return 2
        res = flex_eval(ckpt, {"out_dir": cfg.out_dir, "progress": False})
        (out / "flex_eval.json").write_text(json.dumps(res, indent=1))
        return 0 if res["abs_diff"] <= 1e-4 else 1

    print(f"tessera {tessera.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {cfg.device}")
    resume = ckpt if args.resume is not None else None
    if resume is not None and not resume.exists():
        print(f"--resume: {resume} does not exist", file=sys.stderr)
        return 2
    data = load_data(cfg, out / "tokenizer.json" if cfg.tokenizer == "bpe" else None)
    print(f"data: {data.stats['tokenizer']} vocab {data.stats['vocab_size']}; train {data.stats['train_pack']}; "
          f"val {data.stats['val_pack']}")
    print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads / {cfg.kv_heads} kv heads, "
          f"softcap {cfg.softcap or 'off'}, sinks {'on' if cfg.sinks else 'off'}; attention {cfg.attention}; "
          f"{len(data.train)} train batches of {cfg.batch_size}x{cfg.seq_len}")
    res = train(cfg, data, resume=resume)
    c = res.cache
    if res.val:
        print(f"done: {len(res.losses)} steps in {res.wall_seconds:.1f} s, {res.tokens_per_s:,.0f} train tok/s; "
              f"val loss {res.val[0][1]:.4f} -> {res.val[-1][1]:.4f}")
    print(
        f"plan cache: built {c.get('plans_built')}, memory hits {c.get('memory_hits')}, "
        f"disk hits {c.get('disk_hits')}, misses {c.get('misses')}"
    )
    logged = [s for s, l in zip(res.step_seconds, res.logged) if l]
    plain = [s for s, l in zip(res.step_seconds, res.logged) if not l]
    summary = {
        "steps": len(res.losses),
        "wall_seconds": res.wall_seconds,
        "train_seconds": res.train_seconds,
        "train_tokens_per_s": res.tokens_per_s,
        "val": res.val,
        "telemetry_every": cfg.telemetry_every,
        "telemetry_records": res.telemetry_records,
        "median_step_s_logged": float(np.median(logged)) if logged else None,
        "median_step_s_plain": float(np.median(plain)) if plain else None,
        "plan_cache": c,
    }
    (out / f"summary_{cfg.attention}_tel{cfg.telemetry_every}.json").write_text(json.dumps(summary, indent=1))
    if not args.no_plots:
        plot_loss(out / "history.json", out / "loss.png")
        print(f"loss curve: {out / 'loss.png'}")
        if res.telemetry_records:
            plot_telemetry(out / "telemetry.jsonl", out, cfg.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
