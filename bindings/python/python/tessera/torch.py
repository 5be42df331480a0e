"""PyTorch integration: exact CPU attention as a custom op with autograd, and plans as
FlexAttention ``BlockMask`` objects.

Example::

    import torch, tessera, tessera.torch
    ids = torch.repeat_interleave(torch.arange(4), 256)          # 4 documents in 1024 tokens
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, heads=8)
    q = torch.randn(2, 1024, 8, 64).transpose(1, 2).requires_grad_()   # [B, H, L, D] view
    k = torch.randn(2, 1024, 2, 64).transpose(1, 2).requires_grad_()   # GQA: 2 kv heads
    v = torch.randn(2, 1024, 2, 64).transpose(1, 2).requires_grad_()
    out = tessera.torch.attention(q, k, v, plan, softcap=30.0)
    out.square().mean().backward()

    block_mask = plan.to_flex_block_mask()                          # for flex_attention on GPU

``attention`` is registered as ``torch.ops.tessera.attention_fwd`` / ``attention_bwd``
(``torch.library.custom_op`` with ``register_fake`` and ``register_autograd``), so it works in
eager mode and under ``torch.compile(fullgraph=True)``. It runs on CPU tensors (float32 or
bfloat16, ``[B, H, L, D]``, any batch/head/row strides with a unit stride in D): outputs are
allocated by torch and written in place by the kernel, the GIL is released while it runs. On other
devices (``engine="auto"``) the same call runs FlexAttention over the plan's BlockMask, with the
same semantics (``tessera._flex``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from . import Plan, _flex, _handle_tensor, _plan_of, _tessera
from ._telemetry import Telemetry

__all__ = ["attention", "to_flex_block_mask", "Telemetry"]


# -- zero-copy numpy views ----------------------------------------------------------------------


def _np(t: Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (bf16 as its int16 bit pattern)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _handle(plan: Plan) -> Tensor:
    h = plan._handle_tensor
    if h is None:
        h = _handle_tensor(torch, plan)
        plan._handle_tensor = h
    return h


def _in_layout(t: Tensor) -> Tensor:
    """``t`` itself when the kernels can read it in place (unit stride in D, non-negative
    strides), else a contiguous copy (only layouts no kernel can read are copied)."""
    if t.stride(-1) == 1 and all(s >= 0 for s in t.stride()):
        return t
    return t.contiguous()


# -- the custom ops -----------------------------------------------------------------------------


@torch.library.custom_op("tessera::attention_fwd", mutates_args=(), device_types="cpu")
def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    handle: Tensor,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    plan = _plan_of(int(handle))
    b, hq, lq, _ = q.shape
    dv = v.shape[-1]
    o = torch.empty((b, hq, lq, dv), dtype=q.dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32)
    max_logit = torch.empty((b, hq), dtype=torch.float32)
    q, k, v = _in_layout(q), _in_layout(k), _in_layout(v)
    _tessera.attention_forward(
        plan._p,
        _np(q),
        _np(k),
        _np(v),
        _np(o),
        _np(lse),
        _np(max_logit),
        scale,
        softcap,
        None if sinks is None else sinks.detach().float().tolist(),
    )
    return o, lse, max_logit


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, handle, scale, softcap, sinks):
    b, hq, lq, _ = q.shape
    o = q.new_empty((b, hq, lq, v.shape[-1]))
    lse = q.new_empty((b, hq, lq), dtype=torch.float32)
    return o, lse, q.new_empty((b, hq), dtype=torch.float32)


@torch.library.custom_op("tessera::attention_bwd", mutates_args=(), device_types="cpu")
def _attention_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    d_o: Tensor,
    d_lse: Optional[Tensor],
    handle: Tensor,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    plan = _plan_of(int(handle))
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.empty(k.shape, dtype=q.dtype)
    dv = torch.empty(v.shape, dtype=q.dtype)
    hq = q.shape[1]
    dsinks = torch.empty((hq if sinks is not None else 0,), dtype=torch.float32)
    q, k, v, o, d_o = (_in_layout(x) for x in (q, k, v, o, d_o))
    _tessera.attention_backward(
        plan._p,
        _np(q),
        _np(k),
        _np(v),
        _np(o),
        _np(lse.contiguous()),
        _np(d_o.to(q.dtype)),
        _np(dq),
        _np(dk),
        _np(dv),
        None if d_lse is None else _np(d_lse.contiguous().float()),
        None if sinks is None else _np(dsinks),
        scale,
        softcap,
        None if sinks is None else sinks.detach().float().tolist(),
    )
    return dq, dk, dv, dsinks


@_attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, lse, d_o, d_lse, handle, scale, softcap, sinks):
    hq = q.shape[1]
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape, dtype=q.dtype),
        v.new_empty(v.shape, dtype=q.dtype),
        q.new_empty((hq if sinks is not None else 0,), dtype=torch.float32),
    )


@torch.library.custom_op("tessera::attention_fwd_logged", mutates_args=(), device_types="cpu")
def _attention_fwd_logged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    handle: Tensor,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[Tensor],
    sink_tokens: int,
    outlier_ratio: float,
    sink_stream: bool,
    outlier_stream: bool,
    sink_flags: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    plan = _plan_of(int(handle))
    b, hq, lq, _ = q.shape
    o = torch.empty((b, hq, lq, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32)
    max_logit = torch.empty((b, hq), dtype=torch.float32)
    stats = torch.empty((hq, _tessera.TELEMETRY_COLUMNS), dtype=torch.float64)
    q, k, v = _in_layout(q), _in_layout(k), _in_layout(v)
    _tessera.attention_forward_logged(
        plan._p,
        _np(q),
        _np(k),
        _np(v),
        _np(o),
        _np(lse),
        _np(max_logit),
        _np(stats),
        scale,
        softcap,
        None if sinks is None else sinks.detach().float().tolist(),
        sink_tokens,
        outlier_ratio,
        sink_stream,
        outlier_stream,
        None if sink_flags is None else _np(sink_flags.contiguous()),
    )
    return o, lse, max_logit, stats


@_attention_fwd_logged.register_fake
def _attention_fwd_logged_fake(q, k, v, handle, scale, softcap, sinks, *_):
    o, lse, max_logit = _attention_fwd_fake(q, k, v, handle, scale, softcap, sinks)
    stats = q.new_empty((q.shape[1], _tessera.TELEMETRY_COLUMNS), dtype=torch.float64)
    return o, lse, max_logit, stats


def _setup_context(ctx, inputs, output):
    q, k, v, handle, scale, softcap, sinks = inputs[:7]
    o, lse, max_logit = output[:3]
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, o, lse, handle, sinks)
    ctx.scale = scale
    ctx.softcap = softcap


def _backward(ctx, d_o, d_lse, d_max_logit):
    q, k, v, o, lse, handle, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.tessera.attention_bwd(
        q, k, v, o, lse, d_o, d_lse, handle, ctx.scale, ctx.softcap, sinks
    )
    d_sinks = None if sinks is None else dsinks.to(sinks.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, d_sinks


def _backward_logged(ctx, d_o, d_lse, d_max_logit, d_stats):
    grads = _backward(ctx, d_o, d_lse, d_max_logit)
    return grads + (None, None, None, None, None)


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_attention_fwd_logged.register_autograd(_backward_logged, setup_context=_setup_context)


# -- the user-facing function --------------------------------------------------------------------


def _check(q: Tensor, k: Tensor, v: Tensor, plan: Any, sinks: Optional[Tensor], flex: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if flex and t.device != q.device:
            raise ValueError(f"{name}: tensor on {t.device}, but q is on {q.device}: q, k, v must share a device")
        if not flex and t.device.type != "cpu":
            raise ValueError(
                f"{name}: tensor on {t.device}; engine='tessera' runs Tessera's CPU kernels. "
                "Use engine='auto' or 'flex' (FlexAttention over plan.to_flex_block_mask()) for "
                "tensors on other devices"
            )
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, H, L, D], got shape {tuple(t.shape)}")
        if 0 in t.shape:
            raise ValueError(f"{name}: expected a non-empty tensor [B, H, L, D], got shape {tuple(t.shape)}")
        if t.dtype not in ((torch.float32, torch.bfloat16, torch.float16) if flex else (torch.float32, torch.bfloat16)):
            kinds = "float32, bfloat16 or float16" if flex else "float32 or bfloat16"
            raise TypeError(f"{name}: expected dtype {kinds}, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got {k.dtype} and {v.dtype}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    b, hq, lq, dqk = q.shape
    pb, ph, plq, plkv = plan.shape
    gb, gh = plan.groups
    # A plan built for one row (head) of a mask that does not vary along rows (heads) serves any
    # batch size (head count).
    batch_ok = pb == b or (pb == 1 and gb == 1)
    heads_ok = ph == hq or (ph == 1 and gh == 1)
    if not (batch_ok and heads_ok) or (plq, plkv) != (lq, k.shape[2]):
        raise ValueError(
            f"plan: built for B={pb} H={ph} Lq={plq} Lkv={plkv}, but q/k give "
            f"B={b} H={hq} Lq={lq} Lkv={k.shape[2]}"
        )
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k, v: expected [B, Hkv, Lkv, D] with B={b} and matching Hkv, Lkv; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[3] != dqk:
        raise ValueError(f"k: expected head dim {dqk} (as q), got {k.shape[3]}")
    if hq % k.shape[1] != 0:
        raise ValueError(f"k: kv heads {k.shape[1]} must divide the query heads {hq} (GQA)")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.shape != (hq,):
            raise ValueError(f"sinks: expected a tensor of shape [{hq}] (one logit per query head)")
        if sinks.device != (q.device if flex else torch.device("cpu")):
            raise ValueError(f"sinks: tensor on {sinks.device}; expected one on {q.device if flex else 'cpu'}")


def _scale_softcap(q: Tensor, scale: Any, softcap: Any) -> Tuple[float, Optional[float]]:
    """The checked scale (default ``1/sqrt(Dqk)``) and softcap: finite and positive."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite positive number, got {scale}")
    if softcap is not None:
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap: expected a finite positive number, got {softcap}")
    return scale, softcap


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    telemetry: Optional[Telemetry] = None,
    layer: int = 0,
    engine: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact attention over ``plan`` (SPEC §4): ``softmax(scale·QKᵀ, masked)·V`` with optional
    softcap ``c·tanh(s/c)`` and learned per-head sink logits (denominator only).

    ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``, ``v [B, Hkv, Lkv, Dv]`` on CPU, float32 or
    bfloat16 (the same for all three), ``Hkv`` dividing ``Hq``. Returns ``O [B, Hq, Lq, Dv]`` (and
    the natural-log ``LSE [B, Hq, Lq]`` float32 with ``return_lse``; both differentiable).
    Gradients flow to q, k, v and sinks. Rows with no allowed key give ``O = 0`` (``LSE = -inf``).
    With ``telemetry``, logging steps also record per-head sink mass, entropy, max logit and
    outlier counts for ``layer`` (see :class:`Telemetry`).

    ``engine``: ``"auto"`` runs Tessera's kernels on CPU tensors and FlexAttention (over the
    plan's BlockMask, see ``tessera._flex``) on any other device; ``"flex"`` forces FlexAttention
    (on CPU tensors forward only: FlexAttention has no CPU backward); ``"tessera"`` forces
    Tessera's CPU kernels. On the flex path float16 is accepted too; sink values are not checked
    (that would read them on the host).
    """
    eng = _flex.engine_for(engine, q)
    _check(q, k, v, plan, sinks, flex=eng == "flex")
    if telemetry is not None:
        from . import _int_arg

        layer = _int_arg("attention", "layer", layer, 0, 2**32)
    scale, softcap = _scale_softcap(q, scale, softcap)
    if eng == "flex":
        return _flex.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=sinks,
                               return_lse=return_lse, telemetry=telemetry, layer=layer)
    h = _handle(plan)
    if telemetry is not None and telemetry.should_log():
        # A logging step runs the hooked kernel instead of the plain one (same outputs, bit for
        # bit) and keeps the per-head summary as a tensor: no host read in the step.
        cfg = telemetry.config
        o, lse, _, stats = torch.ops.tessera.attention_fwd_logged(
            q, k, v, h, scale, softcap, sinks, cfg["sink_tokens"], cfg["outlier_ratio"],
            cfg["sink_stream"], cfg["outlier_stream"],
        )
        telemetry._record(layer, sinks is not None, stats, q.shape[0] * q.shape[2])
    else:
        o, lse, _ = torch.ops.tessera.attention_fwd(q, k, v, h, scale, softcap, sinks)
    return (o, lse) if return_lse else o


# -- FlexAttention ------------------------------------------------------------------------------


def to_flex_block_mask(plan: Plan, device: Any = "cpu"):
    """``plan`` as a ``torch.nn.attention.flex_attention.BlockMask`` on ``device``, built once per
    (plan, device) and kept on the plan (the flex engine of :func:`attention` uses the same one).

    The eight block tables come straight from the plan's work lists (int32, contiguous) and equal
    what ``create_block_mask(mask_mod, B', H', Lq, Lkv, BLOCK_SIZE=plan.block)`` builds (``B'``,
    ``H'`` = ``plan.groups``: 1 where the mask does not vary). Its ``mask_mod`` is exact for every
    ``(b, h, q, kv)``: each block's code selects a packed bit block (all clear for empty
    blocks, all set for full ones, the plan's deduplicated bitmask for partial ones), captured
    padded to a power-of-two block count, at least twice the q or kv tile count per (batch,
    head) group, so that plans of the same shapes share one compiled kernel.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    dev = torch.device(device)
    key = _flex._key(dev)
    kept = plan._flex.setdefault("bm", {})
    if key in kept:
        return kept[key]
    # Capacity of the captured bit blocks from the shapes alone for the usual masks (2 per q or
    # kv tile and (batch, head) group, at most 2^14 blocks: 32 MiB at 128-token tiles; then the
    # next power of two), so that plans of the same shapes whose partial counts differ a little
    # share one compiled kernel.
    arrays, bits, (bg, hg, nq, nk, tq, tk, lq, lkv) = plan._p._flex_tables(2, 1 << 14)
    shapes = ((bg, hg, nq), (bg, hg, nq, nk)) * 2 + ((bg, hg, nk), (bg, hg, nk, nq)) * 2
    shapes += ((bg, hg, nq, nk),)
    if dev.type == "cpu":
        tables = [torch.from_numpy(a.reshape(s)) for a, s in zip(arrays, shapes)]
        bits = torch.from_numpy(bits)
    else:
        # one copy of the tables to the device, then views
        flat = torch.from_numpy(np.concatenate(arrays)).to(dev)
        parts = torch.split(flat, [a.size for a in arrays])
        tables = [p.view(s) for p, s in zip(parts, shapes)]
        bits = torch.from_numpy(bits).to(dev)
    codes = tables.pop()

    def mask_mod(b, h, q_idx, kv_idx):
        # The tile's code picks its bit block (0 empty, 1 full, else its partial block); bit
        # kv % 64 of int64 word kv // 64 of row q.
        bb = b if bg > 1 else b * 0
        hh = h if hg > 1 else h * 0
        kr = kv_idx % tk
        word = bits[codes[bb, hh, q_idx // tq, kv_idx // tk], q_idx % tq, kr // 64]
        return ((word >> (kr % 64)) & 1) == 1

    bm = BlockMask((lq, lkv), *tables, BLOCK_SIZE=(tq, tk), mask_mod=mask_mod)
    kept[key] = bm
    return bm

