#!/usr/bin/env python3
"""The small GPT of train_gpt.py trained in plain JAX through `tessera.jax.attention` (CPU).

The same model on the same packed corpus as the PyTorch example (`examples/train_gpt.py`, whose
data pipeline this script imports: tokenizer, train/validation split, `tessera.pack` rows with
segment ids and per-document positions, fixed batches): a decoder-only transformer with RMSNorm,
RoPE on the packer's positions, GQA, learned per-head attention sinks and an attention-logit
softcap, written in plain JAX (parameters are a dict of arrays, AdamW written out). Attention is
`causal & document` through `tessera.jax.attention` in the `[B, L, H, D]` layout of JAX models
(`layout="blhd"`). Each batch gets its plan, `tessera.plan(causal() & document(ids), ...)`, from
Tessera's plan cache, and the plan is an ARGUMENT of the one jitted train step: a Plan is a JAX
pytree whose leaf is its handle, so a new plan per batch neither retraces nor recompiles (the run
prints how many times the step was traced and compiled: once).

    python examples/train_gpt_jax.py                        # train (default config, a few minutes)
    python examples/train_gpt_jax.py --compare dense        # tessera vs dense reference, 20 steps
    python examples/train_gpt_jax.py --compare dense --softcap 0 --no-sinks
                                                            # ... vs jax.nn.dot_product_attention
    python examples/train_gpt_jax.py --steps 50 --json      # a JSON summary on stdout

`--compare dense` trains two copies from the same initial parameters on the same batches in
lockstep, one through Tessera and one through a dense reference with the explicit boolean
`[B, 1, L, L]` causal-within-document mask: `jax.nn.dot_product_attention` when there is neither
softcap nor sinks (it has neither), otherwise the same function written in jnp ops (scores,
softcap, mask, the sink logit as one extra softmax column that is then dropped). It prints both
losses per step and the largest |difference|, and exits 1 when that exceeds 1e-4.

Telemetry (`--telemetry-every N`, 0 = off): `tessera.jax.Telemetry(every=N)` goes into the jitted
step as `tel.at(step)`; on logging steps the attention calls run the kernel's logging variant and
return per-head summaries, kept on the device and read once every `--eval-every` steps into
OUT_DIR/telemetry.jsonl (the schema of the PyTorch example; `tessera telemetry plot` draws it).

A training run exits 1 if its train step was compiled more than once (a plan or another per-step
value baked into the trace instead of passed as an argument).

`tokenizers` missing: the byte-level fallback of train_gpt.py (vocabulary 257).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

import jax
import jax.numpy as jnp

import tessera
import tessera.jax as tj

HERE = Path(__file__).resolve().parent
ENGINES = ("tessera", "dense")
COMPARE_TOL = 1e-4


def _torch_example():
    """examples/train_gpt.py as a module (its Config and data pipeline are reused here)."""
    name = "train_gpt"
    mod = sys.modules.get(name)
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == HERE / "train_gpt.py":
        return mod
    spec = importlib.util.spec_from_file_location(name, HERE / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


tg = _torch_example()
Config = tg.Config
lr_at = tg.lr_at
batch_order = tg.batch_order

DEFAULTS = dict(out_dir="out/train_gpt_jax", telemetry_every=10)


def default_config(**over: Any) -> "tg.Config":
    """train_gpt.py's Config with this example's defaults (out dir, telemetry cadence)."""
    return Config(**{**DEFAULTS, **over})


# ---------------------------------------------------------------------------------------------
# data: train_gpt.py's batches as numpy arrays
# ---------------------------------------------------------------------------------------------


@dataclass
class JBatch:
    tokens: np.ndarray      # int32 [B, L]
    targets: np.ndarray     # int32 [B, L], -100 where there is no next token in the document
    positions: np.ndarray   # int32 [B, L], reset to 0 at each document (piece) start
    segments: np.ndarray    # int64 [B, L], -1 = padding
    n_targets: int
    n_tokens: int


def jax_batches(batches: Sequence[Any]) -> List[JBatch]:
    return [
        JBatch(
            b.tokens.numpy().astype(np.int32),
            b.targets.numpy().astype(np.int32),
            b.positions.numpy().astype(np.int32),
            b.segments,
            b.n_targets,
            int((b.segments >= 0).sum()),
        )
        for b in batches
    ]


@dataclass
class Data:
    tok: Any
    train: List[JBatch]
    val: List[JBatch]
    stats: Dict[str, Any]


def load_data(cfg: "tg.Config", tokenizer_path: Optional[Path] = None) -> Data:
    d = tg.load_data(cfg, tokenizer_path)
    return Data(d.tok, jax_batches(d.train), jax_batches(d.val), d.stats)


# ---------------------------------------------------------------------------------------------
# attention: tessera (a plan per batch) or the dense reference (a boolean mask per batch)
# ---------------------------------------------------------------------------------------------


def make_plan(segments: np.ndarray, cfg: "tg.Config") -> "tessera.Plan":
    """The plan of ``causal & document`` for one batch of segment ids (from the plan cache when
    the batch comes round again)."""
    mask = tessera.causal() & tessera.document(segments)
    return tessera.plan(mask, q_len=segments.shape[1], heads=cfg.heads, cache=True)


def doc_causal_mask(segments: np.ndarray) -> np.ndarray:
    """The explicit boolean ``[B, 1, L, L]`` mask of ``causal & document``."""
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
    length = segments.shape[1]
    return (same & np.tri(length, dtype=bool))[:, None]


def attention_arg(kind: str, segments: np.ndarray, cfg: "tg.Config") -> Any:
    """What the jitted step takes for this batch's attention: a plan, or the dense mask."""
    if kind == "tessera":
        return make_plan(segments, cfg)
    if kind == "dense":
        return jnp.asarray(doc_causal_mask(segments))
    raise ValueError(f"attention: expected one of {ENGINES}, got {kind!r}")


def dense_attention(q, k, v, allowed, scale, softcap, sinks):
    """The exact function written out in jnp ops, ``[B, L, H, D]`` (f32): scores, softcap, mask,
    the sink logit as one extra softmax column (then dropped). Rows with no allowed key (and no
    sink) give 0."""
    b, length, hq, _ = q.shape
    group = hq // k.shape[2]
    if group > 1:
        k = jnp.repeat(k, group, axis=2)
        v = jnp.repeat(v, group, axis=2)
    s = jnp.einsum("blhd,bmhd->bhlm", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        col = jnp.broadcast_to(sinks.astype(s.dtype)[None, :, None, None], (b, hq, length, 1))
        s = jnp.concatenate([s, col], axis=-1)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    z = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(p.dtype).tiny)
    return jnp.einsum("bhlm,bmhd->blhd", p[..., :length] / z, v)


def make_attend(kind: str, arg: Any, cfg: "tg.Config", tel: Optional[tj.Telemetry]) -> Callable:
    """``attend(q, k, v, sinks, layer) -> (o, summary or None)`` with q/k/v ``[B, L, H, D]``."""
    scale = 1.0 / math.sqrt(cfg.head_dim)
    softcap = cfg.softcap if cfg.softcap > 0 else None

    if kind == "tessera":
        def attend(q, k, v, sinks, layer):
            out = tj.attention(q, k, v, arg, scale=scale, softcap=softcap, sinks=sinks,
                               telemetry=tel, layer=layer, layout="blhd")
            return out if tel is not None else (out, None)

    elif kind == "dense":
        def attend(q, k, v, sinks, layer):
            if softcap is None and sinks is None:
                # no softcap, no sinks: JAX's own op with the explicit mask (GQA built in)
                return jax.nn.dot_product_attention(q, k, v, mask=arg, scale=scale), None
            return dense_attention(q, k, v, arg, scale, softcap, sinks), None

    else:
        raise ValueError(f"attention: expected one of {ENGINES}, got {kind!r}")
    return attend


# ---------------------------------------------------------------------------------------------
# model: a dict of arrays
# ---------------------------------------------------------------------------------------------


def init_params(cfg: "tg.Config", vocab_size: int, seed: Optional[int] = None) -> Dict[str, Any]:
    """N(0, 0.02) weights (residual projections 0.02/sqrt(2·layers), GPT-2), RMSNorm weights 1,
    sink logits 0; the embedding is tied to the output layer."""
    d, h, hkv, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
    key = jax.random.PRNGKey(cfg.seed if seed is None else seed)
    keys = jax.random.split(key, cfg.layers + 1)
    std, res_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)

    def normal(k, shape, s):
        return s * jax.random.normal(k, shape, jnp.float32)

    blocks = []
    for i in range(cfg.layers):
        k = jax.random.split(keys[i + 1], 5)
        blk = {
            "n1": jnp.ones((d,), jnp.float32),
            "wq": normal(k[0], (d, h * hd), std),
            "wkv": normal(k[1], (d, 2 * hkv * hd), std),
            "wo": normal(k[2], (h * hd, d), res_std),
            "n2": jnp.ones((d,), jnp.float32),
            "fc": normal(k[3], (d, 4 * d), std),
            "proj": normal(k[4], (4 * d, d), res_std),
        }
        if cfg.sinks:
            blk["sinks"] = jnp.zeros((h,), jnp.float32)
        blocks.append(blk)
    return {"emb": normal(keys[0], (vocab_size, d), std), "blocks": blocks, "norm": jnp.ones((d,), jnp.float32)}


def n_params(params: Any) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


def rms_norm(x, w):
    eps = jnp.finfo(x.dtype).eps  # torch.nn.RMSNorm's default
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(positions, dim: int, base: float):
    """cos/sin ``[B, L, 1, dim/2]`` at the packer's per-document positions."""
    inv = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    ang = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x, cos, sin):
    """RoPE on interleaved pairs of ``x`` ``[B, L, H, D]`` (the layout the op reads)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def forward_loss(params, tokens, targets, positions, attend: Callable, cfg: "tg.Config"):
    """Mean next-token loss over the batch's real targets (padding and document ends ignored),
    and the attention summaries ``{layer: summary}`` (empty without telemetry)."""
    b, length = tokens.shape
    h, hkv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    x = params["emb"][tokens]
    cos, sin = rope_tables(positions, hd, cfg.rope_base)
    summaries = {}
    for i, blk in enumerate(params["blocks"]):
        y = rms_norm(x, blk["n1"])
        q = apply_rope((y @ blk["wq"]).reshape(b, length, h, hd), cos, sin)
        kv = (y @ blk["wkv"]).reshape(b, length, 2, hkv, hd)
        k, v = apply_rope(kv[:, :, 0], cos, sin), kv[:, :, 1]
        o, summary = attend(q, k, v, blk.get("sinks"), i)  # [B, L, H, D] in and out
        if summary is not None:
            summaries[i] = summary
        x = x + o.reshape(b, length, h * hd) @ blk["wo"]
        y = rms_norm(x, blk["n2"])
        x = x + jax.nn.gelu(y @ blk["fc"], approximate=False) @ blk["proj"]
    logits = rms_norm(x, params["norm"]) @ params["emb"].T  # tied embeddings
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = targets >= 0
    nll = -jnp.take_along_axis(logp, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    loss = jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    return loss, summaries


# ---------------------------------------------------------------------------------------------
# AdamW (torch.optim.AdamW's update), global-norm clipping
# ---------------------------------------------------------------------------------------------


BETAS = (0.9, 0.95)
EPS = 1e-8


def adamw_init(params) -> Dict[str, Any]:
    zeros = lambda p: jnp.zeros_like(p)  # noqa: E731
    return {"t": jnp.zeros((), jnp.int32), "m": jax.tree_util.tree_map(zeros, params),
            "v": jax.tree_util.tree_map(zeros, params)}


def adamw_update(params, grads, state, lr, cfg: "tg.Config"):
    """Clips the gradient to global norm ``cfg.clip`` (as clip_grad_norm_), then one AdamW step:
    decoupled weight decay on matrices only (norms and sinks are not decayed)."""
    leaves = jax.tree_util.tree_leaves(grads)
    gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))
    coef = jnp.minimum(1.0, cfg.clip / (gnorm + 1e-6))
    b1, b2 = BETAS
    t = state["t"] + 1
    bc1 = 1.0 - b1 ** t.astype(jnp.float32)
    bc2 = 1.0 - b2 ** t.astype(jnp.float32)
    p_l, treedef = jax.tree_util.tree_flatten(params)
    g_l = treedef.flatten_up_to(grads)
    m_l = treedef.flatten_up_to(state["m"])
    v_l = treedef.flatten_up_to(state["v"])
    new_p, new_m, new_v = [], [], []
    for p, g, m, v in zip(p_l, g_l, m_l, v_l):
        g = g * coef
        if p.ndim >= 2 and cfg.weight_decay:
            p = p * (1.0 - lr * cfg.weight_decay)
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        p = p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + EPS)
        new_p.append(p)
        new_m.append(m)
        new_v.append(v)
    unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)  # noqa: E731
    return unflat(new_p), {"t": t, "m": unflat(new_m), "v": unflat(new_v)}, gnorm


# ---------------------------------------------------------------------------------------------
# the jitted steps
# ---------------------------------------------------------------------------------------------


class Step:
    """One jitted function and how often JAX traced it (a Python side effect runs only while
    tracing) and compiled it (the jit's executable cache)."""

    def __init__(self, fn: Callable):
        self.traces = 0

        def counted(*args):
            self.traces += 1
            return fn(*args)

        self.jitted = jax.jit(counted)

    def __call__(self, *args):
        return self.jitted(*args)

    @property
    def compiles(self) -> int:
        size = getattr(self.jitted, "_cache_size", None)
        return int(size()) if size is not None else self.traces


def make_train_step(cfg: "tg.Config", kind: str) -> Step:
    """``step(params, opt, tokens, targets, positions, attn, lr, tel) -> (params, opt, loss,
    summaries, grad_norm)``: forward, backward (``jax.value_and_grad``), clipping and AdamW in one
    compiled program. ``attn`` is the batch's plan (tessera) or mask (dense), ``lr`` and the
    telemetry step are traced scalars: nothing that changes per step is a constant of the trace."""

    def step(params, opt, tokens, targets, positions, attn, lr, tel):
        def loss_fn(p):
            return forward_loss(p, tokens, targets, positions, make_attend(kind, attn, cfg, tel), cfg)

        (loss, summaries), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params, opt, gnorm = adamw_update(params, grads, opt, lr, cfg)
        return params, opt, loss, summaries, gnorm

    return Step(step)


def make_eval_step(cfg: "tg.Config", kind: str) -> Step:
    def loss(params, tokens, targets, positions, attn):
        return forward_loss(params, tokens, targets, positions, make_attend(kind, attn, cfg, None), cfg)[0]

    return Step(loss)


def evaluate(params, batches: Sequence[JBatch], cfg: "tg.Config", kind: str, step: Step) -> Dict[str, float]:
    """Validation loss (mean over every held-out target token) and tokens/s of the forwards."""
    total, count, seconds = 0.0, 0, 0.0
    for b in batches:
        t = time.perf_counter()
        arg = attention_arg(kind, b.segments, cfg)
        loss = float(step(params, b.tokens, b.targets, b.positions, arg))  # waits: plan outlives use
        seconds += time.perf_counter() - t
        total += loss * b.n_targets
        count += b.n_targets
    tokens = sum(b.n_tokens for b in batches)
    return {"loss": total / max(count, 1), "tokens_per_s": tokens / max(seconds, 1e-9), "seconds": seconds}


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    losses: List[float] = field(default_factory=list)        # train loss per step
    step_seconds: List[float] = field(default_factory=list)  # wall time per step (step 0 compiles)
    step_tokens: List[int] = field(default_factory=list)     # real (non-padding) tokens per step
    val: List[tuple] = field(default_factory=list)           # (step, val loss)
    train_tokens: int = 0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    telemetry_records: int = 0
    step_traces: int = 0
    step_compiles: int = 0
    eval_traces: int = 0
    eval_compiles: int = 0
    distinct_batches: int = 0
    distinct_masks: int = 0                                  # distinct segment-id batches (plans)
    params: Any = None
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Training tokens/s after the first (compiling) step."""
        return sum(self.step_tokens[1:]) / max(sum(self.step_seconds[1:]), 1e-9)


def train(
    cfg: "tg.Config",
    data: Optional[Data] = None,
    *,
    save: bool = True,
    evaluate_val: bool = True,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Trains ``cfg.steps`` steps through ``cfg.attention`` (tessera or dense) and returns the
    run's history; with ``save``, history.json and telemetry.jsonl land in ``cfg.out_dir``."""
    out = Path(cfg.out_dir)
    if save:
        out.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = load_data(cfg, out / "tokenizer.json" if save and cfg.tokenizer == "bpe" else None)
    kind = cfg.attention
    params = init_params(cfg, data.tok.vocab_size)
    opt = adamw_init(params)
    train_step, eval_step = make_train_step(cfg, kind), make_eval_step(cfg, kind)
    tel = None
    tel_path = out / "telemetry.jsonl"
    if cfg.telemetry_every > 0 and kind == "tessera":
        tel = tj.Telemetry(every=cfg.telemetry_every)
        if save and tel_path.exists():
            tel_path.unlink()
    res = RunResult()
    n = len(data.train)
    used, masks = set(), set()
    if evaluate_val:
        v = evaluate(params, data.val, cfg, kind, eval_step)
        res.val.append((0, v["loss"]))
        log(f"step 0: val loss {v['loss']:.4f}")
    wall = time.perf_counter()
    for step in range(cfg.steps):
        bi = int(batch_order(n, step // n, cfg.seed)[step % n])
        b = data.train[bi]
        used.add(bi)
        masks.add(b.segments.tobytes())
        t = time.perf_counter()
        arg = attention_arg(kind, b.segments, cfg)  # one plan per batch (plan cache on repeats)
        params, opt, loss, summaries, _ = train_step(
            params, opt, b.tokens, b.targets, b.positions, arg,
            np.float32(lr_at(step, cfg)), None if tel is None else tel.at(np.int32(step)),
        )
        lv = float(loss)  # waits for the step: the plan stays alive until its outputs are ready
        dt = time.perf_counter() - t
        if tel is not None:
            tel.collect(step, summaries, learned_sinks=cfg.sinks)  # device arrays, not read
        res.losses.append(lv)
        res.step_seconds.append(dt)
        res.step_tokens.append(b.n_tokens)
        res.train_tokens += b.n_tokens
        res.train_seconds += dt
        done = step + 1
        if step == 0:
            log(f"step 1: train loss {lv:.4f} ({dt:.1f} s: trace and compile)")
        last = done == cfg.steps
        if evaluate_val and (done % cfg.eval_every == 0 or last):
            v = evaluate(params, data.val, cfg, kind, eval_step)
            res.val.append((done, v["loss"]))
            log(f"step {done}: train loss {lv:.4f}, val loss {v['loss']:.4f}, "
                f"lr {lr_at(step, cfg):.1e}, {res.tokens_per_s:,.0f} tok/s")
        elif done % cfg.eval_every == 0:
            log(f"step {done}: train loss {lv:.4f}")
        if tel is not None and save and (done % cfg.eval_every == 0 or last):
            res.telemetry_records += tel.write_jsonl(tel_path)  # the one deferred host read
    res.wall_seconds = time.perf_counter() - wall
    res.step_traces, res.step_compiles = train_step.traces, train_step.compiles
    res.eval_traces, res.eval_compiles = eval_step.traces, eval_step.compiles
    res.distinct_batches, res.distinct_masks = len(used), len(masks)
    res.params = params
    res.cache = {k: v for k, v in tessera.cache_stats().items() if isinstance(v, (int, float))}
    if save:
        hist = {
            "train": [[i + 1, x] for i, x in enumerate(res.losses)],
            "val": [list(x) for x in res.val],
            "data": data.stats,
            "config": dataclasses.asdict(cfg),
        }
        (out / "history.json").write_text(json.dumps(hist))
    return res


def lockstep(cfg: "tg.Config", engines: Sequence[str], steps: int, data: Data) -> Dict[str, Dict[str, Any]]:
    """Trains one copy per engine from the SAME initial parameters on the same batches and
    schedule, step by step in lockstep (the order rotating each step), no telemetry."""
    params0 = init_params(cfg, data.tok.vocab_size)
    runs = {
        e: {"params": params0, "opt": adamw_init(params0), "step": make_train_step(cfg, e), "losses": [], "times": []}
        for e in engines
    }
    n = len(data.train)
    tokens = 0
    for step in range(steps):
        b = data.train[int(batch_order(n, step // n, cfg.seed)[step % n])]
        lr = np.float32(lr_at(step, cfg))
        k = step % len(engines)
        for e in list(engines[k:]) + list(engines[:k]):
            r = runs[e]
            t = time.perf_counter()
            arg = attention_arg(e, b.segments, cfg)
            r["params"], r["opt"], loss, _, _ = r["step"](
                r["params"], r["opt"], b.tokens, b.targets, b.positions, arg, lr, None
            )
            r["losses"].append(float(loss))
            r["times"].append(time.perf_counter() - t)
        if step > 0:
            tokens += b.n_tokens
    for r in runs.values():
        r["tokens_per_s"] = tokens / max(sum(r["times"][1:]), 1e-9)  # after the compiling step
        r["compiles"] = r["step"].compiles
    first, *rest = engines
    for e in rest:  # the largest parameter difference between the copies after the last step
        runs[e]["max_param_diff"] = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree_util.tree_leaves(runs[first]["params"]),
                            jax.tree_util.tree_leaves(runs[e]["params"]))
        )
    for r in runs.values():
        del r["params"], r["opt"], r["step"]
    return runs


def compare(cfg: "tg.Config", steps: int, data: Optional[Data] = None, log=print) -> Dict[str, Any]:
    """Tessera against the dense reference in lockstep: both loss series and their largest
    difference."""
    if data is None:
        data = load_data(cfg)
    runs = lockstep(cfg, ["tessera", "dense"], steps, data)
    a, b = runs["tessera"]["losses"], runs["dense"]["losses"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    ref = ("jax.nn.dot_product_attention" if cfg.softcap <= 0 and not cfg.sinks
           else "dense jnp reference (softcap/sinks)")
    log(f"tessera vs {ref}, explicit boolean [B,1,L,L] mask; same initial params and batches")
    log(f"{'step':>4} {'tessera':>12} {'dense':>12} {'|diff|':>10}")
    for i, (x, y, d) in enumerate(zip(a, b, diffs)):
        log(f"{i + 1:>4} {x:>12.7f} {y:>12.7f} {d:>10.2e}")
    rep = {
        "steps": steps,
        "reference": ref,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "softcap": cfg.softcap,
        "sinks": cfg.sinks,
        "tessera": a,
        "dense": b,
        "max_abs_diff": max(diffs),
        "max_param_diff": runs["dense"]["max_param_diff"],
        "tolerance": COMPARE_TOL,
        "tokens_per_s": {k: r["tokens_per_s"] for k, r in runs.items()},
        "compiles": {k: r["compiles"] for k, r in runs.items()},
    }
    log(
        f"max |loss diff| over {steps} steps: {rep['max_abs_diff']:.2e} (tolerance {COMPARE_TOL:.0e}); "
        f"max |parameter diff| after them {rep['max_param_diff']:.2e}; "
        f"training tokens/s (lockstep, after step 1) tessera {rep['tokens_per_s']['tessera']:,.0f} vs "
        f"dense {rep['tokens_per_s']['dense']:,.0f}"
    )
    return rep


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    d = default_config()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  python examples/train_gpt_jax.py\n  python examples/train_gpt_jax.py --compare dense",
    )
    a = p.add_argument
    a("--attention", choices=ENGINES, default=d.attention, help="attention engine of the training run")
    a("--steps", type=int, default=d.steps)
    a("--batch-size", type=int, default=d.batch_size)
    a("--seq-len", type=int, default=d.seq_len)
    a("--layers", type=int, default=d.layers)
    a("--d-model", type=int, default=d.d_model)
    a("--heads", type=int, default=d.heads)
    a("--kv-heads", type=int, default=d.kv_heads)
    a("--vocab-size", type=int, default=d.vocab_size)
    a("--tokenizer", choices=("bpe", "bytes"), default=d.tokenizer)
    a("--max-docs", type=int, default=d.max_docs, help="use only the first N documents (0 = all)")
    a("--softcap", type=float, default=d.softcap, help="attention-logit softcap (0 = off)")
    a("--sinks", action=argparse.BooleanOptionalAction, default=d.sinks, help="learned per-head sink logits")
    a("--lr", type=float, default=d.lr)
    a("--min-lr", type=float, default=d.min_lr)
    a("--warmup", type=int, default=d.warmup)
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--clip", type=float, default=d.clip)
    a("--seed", type=int, default=d.seed)
    a("--telemetry-every", type=int, default=d.telemetry_every, help="telemetry cadence in steps (0 = off)")
    a("--eval-every", type=int, default=d.eval_every)
    a("--out-dir", default=d.out_dir)
    a("--compare", choices=("dense",),
      help="train --compare-steps steps through tessera and the dense reference in lockstep")
    a("--compare-steps", type=int, default=20)
    a("--json", action="store_true", help="print a JSON summary on stdout (progress goes to stderr)")
    a("--no-plots", action="store_true")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> "tg.Config":
    return default_config(
        vocab_size=args.vocab_size, tokenizer=args.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
        max_docs=args.max_docs, layers=args.layers, d_model=args.d_model, heads=args.heads,
        kv_heads=args.kv_heads, softcap=args.softcap, sinks=args.sinks, steps=args.steps, lr=args.lr,
        min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, seed=args.seed,
        attention=args.attention, telemetry_every=args.telemetry_every, eval_every=args.eval_every,
        out_dir=args.out_dir, progress=False,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    out = Path(cfg.out_dir)
    log: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print
    if cfg.d_model % cfg.heads or cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        print("--d-model/--heads must give an even head dim, and --kv-heads must divide --heads", file=sys.stderr)
        return 2
    log(f"tessera {tessera.__version__}, jax {jax.__version__} on {jax.default_backend()} "
        f"({jax.device_count()} device(s))")
    t0 = time.perf_counter()
    data = load_data(cfg, out / "tokenizer.json" if cfg.tokenizer == "bpe" else None)
    log(f"data: {data.stats['tokenizer']} vocab {data.stats['vocab_size']}; train {data.stats['train_pack']}; "
        f"val {data.stats['val_pack']}")

    if args.compare:
        out.mkdir(parents=True, exist_ok=True)
        rep = compare(cfg, args.compare_steps, data, log=log)
        path = out / f"compare_{args.compare}.json"
        path.write_text(json.dumps(rep, indent=1))
        log(f"wrote {path}")
        if args.json:
            print(json.dumps(rep))
        ok = rep["max_abs_diff"] <= COMPARE_TOL
        if not ok:
            log(f"FAILED: max |loss diff| {rep['max_abs_diff']:.2e} > {COMPARE_TOL:.0e}")
        return 0 if ok else 1

    n_par = n_params(init_params(cfg, data.tok.vocab_size))
    log(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads / {cfg.kv_heads} kv heads, "
        f"softcap {cfg.softcap or 'off'}, sinks {'on' if cfg.sinks else 'off'}, {n_par / 1e6:.2f} M parameters; "
        f"attention {cfg.attention} (layout blhd); {len(data.train)} train batches of {cfg.batch_size}x{cfg.seq_len}")
    res = train(cfg, data, log=log)
    total = time.perf_counter() - t0
    c = res.cache
    log(f"done: {len(res.losses)} steps in {res.wall_seconds:.1f} s with their evaluations ({total:.1f} s with the "
        f"data and the first evaluation), {res.tokens_per_s:,.0f} train tok/s after the compiling step")
    log(f"train loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}"
        + (f"; val loss {res.val[0][1]:.4f} -> {res.val[-1][1]:.4f}" if res.val else ""))
    log(f"train step: traced {res.step_traces}x, compiled {res.step_compiles}x for {len(res.losses)} steps over "
        f"{res.distinct_batches} batches with {res.distinct_masks} distinct masks (a plan per step, passed as an "
        f"argument); "
        f"eval step: traced {res.eval_traces}x, compiled {res.eval_compiles}x")
    if cfg.attention == "tessera":
        log(f"plan cache: built {c.get('plans_built')}, memory hits {c.get('memory_hits')}, "
            f"disk hits {c.get('disk_hits')}, misses {c.get('misses')}")
    if res.telemetry_records:
        log(f"telemetry: {res.telemetry_records} records in {out / 'telemetry.jsonl'}")
    summary = {
        "steps": len(res.losses),
        "config": dataclasses.asdict(cfg),
        "parameters": n_par,
        "data": data.stats,
        "wall_seconds": res.wall_seconds,
        "total_seconds": total,
        "first_step_seconds": res.step_seconds[0] if res.step_seconds else None,
        "median_step_seconds": float(np.median(res.step_seconds[1:])) if len(res.step_seconds) > 1 else None,
        "train_tokens_per_s": res.tokens_per_s,
        "train_loss_first": res.losses[0] if res.losses else None,
        "train_loss_last": res.losses[-1] if res.losses else None,
        "val": res.val,
        "step_traces": res.step_traces,
        "step_compiles": res.step_compiles,
        "eval_compiles": res.eval_compiles,
        "distinct_batches": res.distinct_batches,
        "distinct_masks": res.distinct_masks,
        "telemetry_every": cfg.telemetry_every,
        "telemetry_records": res.telemetry_records,
        "plan_cache": c,
    }
    (out / f"summary_{cfg.attention}.json").write_text(json.dumps(summary, indent=1))
    if not args.no_plots:
        try:
            tg.plot_loss(out / "history.json", out / "loss.png")
            log(f"loss curve: {out / 'loss.png'}")
        except ImportError:
            log("matplotlib is not installed: no loss picture (history.json has the numbers)")
        if res.telemetry_records:
            tg.plot_telemetry(out / "telemetry.jsonl", out, cfg.layers, log=log)
    if args.json:
        print(json.dumps(summary))
    return 0 if res.step_compiles == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
