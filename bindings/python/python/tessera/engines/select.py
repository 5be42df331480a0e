"""Engine selection for ``tessera.torch.attention`` (the pattern of xFormers' ``fmha/dispatch.py``):
each engine states, for given inputs, the reasons it cannot run them exactly; ``auto`` walks a
fixed priority list and takes the first engine with none. The choice and every skipped engine's
reasons are kept as a readable record (:func:`last_dispatch`).

For XLA tensors (torch_xla): ``splash`` (JAX Splash through ``call_jax``: Mosaic on TPU, Pallas
interpret mode on PJRT CPU; :mod:`tessera.engines.xla_splash`). Priority for tensors on a GPU: ``flex_flash`` (FlexAttention's FlashAttention-4 backend), then
``flex`` (FlexAttention's Triton kernel over the plan's BlockMask, with the analytic
``mask_mod``). ``varlen`` (``torch.nn.attention.varlen.varlen_attn``: packed causal documents
from ``cu_seqlens``, no mask) runs when named: measured on an H200 (torch 2.11, doc-causal,
H = 16, D = 128, bf16, fwd+bwd), it took 1.17-1.30x the flex engine's time at 8K tokens and 1.21x at
32K (BENCHMARKS.md, 2026-11-28, commit a8c6176), so ``auto`` does not pick it. For CPU tensors: ``tessera``
(Tessera's CPU kernels). Every engine keeps the semantics of docs/semantics.md#attention exactly or declines.

Capability probes (``tessera.core.probes``) are called through this module's names
(:func:`flash_importable`, :func:`varlen_importable`, :func:`device_capability`), so tests fake a
device by replacing them here. Everything selection reads inside a compiled step is kept eagerly
first (the probes: ``plan.to_flex_block_mask`` reads them; for a named ``varlen``, the plan's
document verdict and sequence boundaries: ``PlanPrefetcher`` or one eager call keeps them), and
is a small value, so that new plans of the same kind reuse the graph.
"""

from __future__ import annotations

from typing import Any, Dict, List

from ..core.flex_mask import causal_documents, kept_cu_seqlens
from ..core.probes import device_capability, flash_importable, varlen_importable, varlen_params, warm  # noqa: F401

ENGINES = ("auto", "tessera", "flex", "flex_flash", "varlen", "splash")
GPU_PRIORITY = ("flex_flash", "flex")
CPU_PRIORITY = ("tessera",)
XLA_PRIORITY = ("splash",)

_LAST: Dict[str, Any] = {}


# -- inputs and reasons ---------------------------------------------------------------------------


class Inputs:
    """What selection looks at: the tensors, the plan and the options of one call."""

    __slots__ = ("q", "k", "v", "plan", "sinks", "softcap", "return_lse", "logging", "grad", "scale")

    def __init__(self, q, k, v, plan, sinks, softcap, return_lse, logging, scale=None):
        import math

        import torch

        self.q, self.k, self.v, self.plan = q, k, v, plan
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        self.sinks, self.softcap, self.return_lse, self.logging = sinks, softcap, return_lse, logging
        ts = [t for t in (q, k, v, sinks) if isinstance(t, torch.Tensor)]
        self.grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _tessera_reasons(i: Inputs) -> List[str]:
    import torch

    r = []
    if i.q.device.type != "cpu":
        r.append(f"Tessera's kernels run on CPU tensors; q is on {i.q.device}")
    if i.q.dtype not in (torch.float32, torch.bfloat16):
        r.append(f"Tessera's kernels take float32 or bfloat16, not {i.q.dtype}")
    return r


def _flex_reasons(i: Inputs) -> List[str]:
    from . import flex

    r = []
    if i.q.device.type == "cpu" and i.grad and flex._KERNEL is None:
        r.append("FlexAttention has no CPU backward")
    return r


def _flash_reasons(i: Inputs) -> List[str]:
    import torch

    r = []
    ok, why = flash_importable()
    if not ok:
        r.append(why)
    cap = device_capability(i.q.device)
    if cap is None:
        r.append(f"the FLASH backend runs on CUDA GPUs; q is on {i.q.device}")
    elif cap[0] not in (9, 10, 11):
        r.append(f"the FLASH backend needs Hopper (sm90) or Blackwell (sm100+); this GPU is sm{cap[0]}{cap[1]}")
    elif cap[0] == 9 and tuple(i.plan.block) != (128, 128):
        r.append(f"on Hopper the FLASH backend needs 128x128 blocks; the plan has {tuple(i.plan.block)} "
                 "(plan with block=128)")
    if i.q.dtype not in (torch.bfloat16, torch.float16):
        r.append(f"FlashAttention-4 takes bfloat16 or float16, not {i.q.dtype}")
    dqk, dv = i.q.shape[-1], i.v.shape[-1]
    if dqk != dv or dqk % 16 or not 16 <= dqk <= 128:
        r.append(f"head dims q/k {dqk}, v {dv}: this engine takes equal head dims, multiples of 16 up to 128")
    if i.q.shape[2] < 128:
        r.append("fewer than 128 queries (FlexAttention's decoding kernel)")
    if i.logging:
        r.append("telemetry's extra passes need max scores and captured LSE buffers (the Triton kernel)")
    return r


def _varlen_reasons(i: Inputs) -> List[str]:
    import math

    import torch

    r = []
    ok, why = varlen_importable()
    if not ok:
        r.append(why)
    if device_capability(i.q.device) is None:
        r.append(f"varlen_attn runs FlashAttention on CUDA GPUs; q is on {i.q.device}")
    if i.q.dtype not in (torch.bfloat16, torch.float16):
        r.append(f"varlen_attn takes bfloat16 or float16, not {i.q.dtype}")
    if i.softcap is not None:
        r.append("varlen_attn has no softcap")
    if i.logging:
        r.append("telemetry's extra passes need FlexAttention")
    if i.grad and (i.sinks is not None or i.return_lse):
        r.append("varlen_attn's backward drops the LSE gradient (exact sinks and a differentiable LSE need it)")
    if i.q.shape[2] != i.k.shape[2]:
        r.append("query and key lengths differ")
    if i.q.shape[-1] != i.v.shape[-1]:
        r.append("varlen_attn needs equal q/k and v head dims")
    params = varlen_params()
    if ok and not ({"window_size", "is_causal"} & params):
        r.append("this torch's varlen_attn has neither window_size nor is_causal")
    if ok and "scale" not in params and i.scale != 1.0 / math.sqrt(i.q.shape[-1]):
        r.append("this torch's varlen_attn has no scale argument (only 1/sqrt(D))")
    if ok and "enable_gqa" not in params and i.q.shape[1] != i.k.shape[1]:
        r.append("this torch's varlen_attn has no enable_gqa (GQA needs torch >= 2.12)")
    if ok and (i.return_lse or i.sinks is not None) and "return_aux" not in params:
        r.append("this torch's varlen_attn returns no LSE")
    verdict = i.plan._flex.get("docs")
    if verdict is None:
        if torch.compiler.is_compiling():
            verdict = ("the plan's documents were not read before the compiled step "
                       "(make the plan through PlanPrefetcher, or run one eager call with engine='varlen')")
        else:
            verdict = causal_documents(i.plan)[1]
    if verdict:
        r.append(verdict)
    elif torch.compiler.is_compiling() and not kept_cu_seqlens(i.plan, i.q.shape[0], i.q.device):
        r.append("the plan's sequence boundaries were not built before the compiled step "
                 "(make the plan through PlanPrefetcher, or run one eager call with engine='varlen')")
    return r


def _splash_reasons(i: Inputs) -> List[str]:
    from . import xla_splash

    return xla_splash.reasons(i.q, i.plan)


REASONS = {
    "splash": _splash_reasons,
    "tessera": _tessera_reasons,
    "flex": _flex_reasons,
    "flex_flash": _flash_reasons,
    "varlen": _varlen_reasons,
}


def select(engine: Any, i: Inputs) -> str:
    """The engine to run: ``engine`` itself when named (``RuntimeError`` with its reasons when it
    cannot run these inputs; ``tessera`` and ``flex`` keep their own argument checks), else the
    first of the priority list with no reason. Records the choice for :func:`last_dispatch`."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    skipped: Dict[str, List[str]] = {}
    if engine != "auto":
        if engine in ("flex_flash", "varlen", "splash"):
            why = REASONS[engine](i)
            if why:
                raise RuntimeError(f"engine={engine!r} cannot run these inputs: " + "; ".join(why))
        chosen = engine
    else:
        dev = i.q.device.type
        order = CPU_PRIORITY if dev == "cpu" else XLA_PRIORITY if dev == "xla" else GPU_PRIORITY
        chosen = order[-1]
        for name in order:
            why = REASONS[name](i)
            if not why:
                chosen = name
                break
            skipped[name] = why
    global _LAST
    _LAST = {"requested": engine, "engine": chosen, "skipped": skipped, "device": str(i.q.device)}
    return chosen


def last_dispatch() -> Dict[str, Any]:
    """The last selection: ``{"requested", "engine", "device", "skipped": {name: [reasons]}}``
    (inside ``torch.compile``, the selection made while tracing)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in _LAST.items()}
