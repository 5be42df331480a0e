"""``tessera.torch.attention``: the torch frontend's op. Picks the engine (Tessera's CPU kernels or
FlexAttention), checks the arguments, owns autograd of the native custom ops and records
telemetry on logging steps."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.args import _int_arg, check_plan_fit
from ..core import flex_tables
from ..core.plans import Plan, check_plan
from ..engines import flex as _flex
from ..engines import select as _select
from ..engines.native_torch import _attention_fwd, _attention_fwd_logged, _handle
from .telemetry import Telemetry


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
    # No layout argument here: [B, L, H, D] tensors get an error that says to transpose.
    check_plan_fit(q.shape, k.shape, plan.shape, plan.groups, layout=None)
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


def _autocast(q: Any, k: Any, v: Any) -> Tuple[Any, Any, Any]:
    """q, k, v in the autocast dtype of q's device while autocast is on there (else unchanged)."""
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return q, k, v
    dev = q.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except RuntimeError:  # a device type without autocast (meta)
        return q, k, v
    if not on:
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return q.to(dt), k.to(dt), v.to(dt)


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
    max_partial_blocks: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact attention over ``plan`` (docs/semantics.md#attention): ``softmax(scale·QKᵀ, masked)·V`` with optional
    softcap ``c·tanh(s/c)`` and learned per-head sink logits (denominator only).

    ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``, ``v [B, Hkv, Lkv, Dv]`` on CPU, float32 or
    bfloat16 (the same for all three), ``Hkv`` dividing ``Hq``. Returns ``O [B, Hq, Lq, Dv]`` (and
    the natural-log ``LSE [B, Hq, Lq]`` float32 with ``return_lse``; both differentiable).
    Gradients flow to q, k, v and sinks. Rows with no allowed key give ``O = 0`` (``LSE = -inf``).
    With ``telemetry``, logging steps also record per-head sink mass, entropy, max logit and
    outlier counts for ``layer`` (see :class:`Telemetry`).

    ``engine``: ``"auto"`` runs Tessera's kernels on CPU tensors; on a GPU the first engine of
    ``flex_flash`` (FlexAttention's FlashAttention-4 backend: ``flash_attn.cute`` importable,
    Hopper or Blackwell, 128x128 plan tiles on Hopper, bf16/fp16, no telemetry step) and ``flex``
    (FlexAttention's Triton kernel over the plan's BlockMask, see ``tessera.engines.flex``) that
    can run the call exactly. Each name forces that engine: ``"varlen"`` (``varlen_attn``: the
    plan is exactly causal documents, contiguous and unpadded; no softcap, no telemetry step;
    sinks or a differentiable LSE only without gradients; slower than ``flex`` on an H200, so
    ``auto`` leaves it), ``"flex"`` on CPU tensors is forward only (FlexAttention has no CPU
    backward), ``"tessera"`` runs Tessera's CPU kernels, and ``"flex_flash"`` / ``"varlen"``
    raise ``RuntimeError`` with the reasons when they cannot run the call. :func:`last_dispatch`
    says which engine ran and why the others were skipped. On the GPU engines float16 is
    accepted too; sink values are not checked (that would read them on the host).

    On XLA tensors (torch_xla on PJRT: TPU, or the CPU client) ``auto`` runs ``splash``: JAX
    Splash over the plan's ``MaskInfo`` through ``call_jax`` (Mosaic on TPU, Pallas interpret mode
    elsewhere; kv tiles must be multiples of 128), forward and backward, with telemetry on logging
    steps; see docs/torch-xla.md. The plan enters the graph as one device tensor whose shape
    depends on the plan's shapes and ``max_partial_blocks`` only (the bound its unique partial
    blocks are padded to; default the next power of two of the plan's count): fix it to keep one
    compiled graph for plans whose partial-block counts differ. Other engines ignore it.

    Under ``torch.autocast`` q, k and v are cast to the autocast dtype of their device first (as
    ``scaled_dot_product_attention`` is), so mixed inputs (float32 rotary q/k beside a bfloat16
    v) run in that dtype.
    """
    if not isinstance(engine, str) or engine not in _select.ENGINES:
        raise ValueError(f"engine: expected one of {_select.ENGINES}, got {engine!r}")
    on_cpu = not isinstance(q, Tensor) or q.device.type == "cpu"
    q, k, v = _autocast(q, k, v)
    _check(q, k, v, plan, sinks, flex=engine != "tessera" and (engine != "auto" or not on_cpu))
    if telemetry is not None:
        layer = _int_arg("attention", "layer", layer, 0, 2**32)
    scale, softcap = _scale_softcap(q, scale, softcap)
    logging = telemetry is not None and telemetry.should_log()
    eng = _select.select(engine, _select.Inputs(q, k, v, plan, sinks, softcap, return_lse, logging, scale))
    if eng == "splash":
        from ..engines import xla_splash as _xla

        return _xla.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=sinks,
                              return_lse=return_lse, telemetry=telemetry, layer=layer,
                              max_partial_blocks=max_partial_blocks)
    if eng == "varlen":
        from ..engines import varlen as _varlen

        return _varlen.attention(q, k, v, plan, scale=scale, sinks=sinks, return_lse=return_lse)
    if eng in ("flex", "flex_flash"):
        return _flex.attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=sinks,
                               return_lse=return_lse, telemetry=telemetry, layer=layer,
                               backend="FLASH" if eng == "flex_flash" else None)
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


def to_flex_block_mask(plan: Plan, device: Any = "cpu", mask_mod: str = "auto"):
    """``plan`` as a ``torch.nn.attention.flex_attention.BlockMask`` on ``device``, built once per
    (plan, device, ``mask_mod``) and kept on the plan (the flex engine of :func:`attention` uses the
    ``"auto"`` one). The eight tables equal ``create_block_mask``'s and are expanded on ``device``
    from the plan's non-empty tiles; ``mask_mod`` is ``"analytic"`` (generated from the mask
    expression), ``"bits"`` (the plan's bit table) or ``"auto"`` (analytic unless a ``dense`` /
    ``blocks`` leaf needs the bits); see ``tessera.core.flex_tables.to_flex_block_mask``. On a GPU it
    also reads ahead what engine selection asks (probes, documents, sequence boundaries), so that
    a compiled step only reads them.
    """
    return flex_tables.to_flex_block_mask(check_plan(plan), device, mask_mod)
