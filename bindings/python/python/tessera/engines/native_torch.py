"""Tessera's CPU kernels as torch custom ops (``torch.ops.tessera.*``): outputs allocated by torch
and written by the kernels in place, the GIL released while they run, fake (meta) kernels for
``torch.compile``. Autograd is registered by the frontend (:mod:`tessera.torch`)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .. import _tessera
from ..core.plans import Plan, _handle_tensor, _native_of


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
    plan = _native_of(int(handle))
    b, hq, lq, _ = q.shape
    dv = v.shape[-1]
    o = torch.empty((b, hq, lq, dv), dtype=q.dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32)
    max_logit = torch.empty((b, hq), dtype=torch.float32)
    q, k, v = _in_layout(q), _in_layout(k), _in_layout(v)
    _tessera.attention_forward(
        plan,
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
    plan = _native_of(int(handle))
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.empty(k.shape, dtype=q.dtype)
    dv = torch.empty(v.shape, dtype=q.dtype)
    hq = q.shape[1]
    dsinks = torch.empty((hq if sinks is not None else 0,), dtype=torch.float32)
    q, k, v, o, d_o = (_in_layout(x) for x in (q, k, v, o, d_o))
    _tessera.attention_backward(
        plan,
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
    plan = _native_of(int(handle))
    b, hq, lq, _ = q.shape
    o = torch.empty((b, hq, lq, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32)
    max_logit = torch.empty((b, hq), dtype=torch.float32)
    stats = torch.empty((hq, _tessera.TELEMETRY_COLUMNS), dtype=torch.float64)
    q, k, v = _in_layout(q), _in_layout(k), _in_layout(v)
    _tessera.attention_forward_logged(
        plan,
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
