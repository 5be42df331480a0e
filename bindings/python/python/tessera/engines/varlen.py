"""``torch.nn.attention.varlen.varlen_attn`` behind ``tessera.torch.attention`` (``engine="varlen"``,
chosen by ``auto`` on a GPU when :func:`tessera.core.flex_mask.causal_documents` accepts the
plan): packed causal documents as FlashAttention sequences (``cu_seqlens``), no mask at all.

Exact for what it accepts: the plan's mask is exactly ``causal & document`` over contiguous,
unpadded documents shared by queries and keys, so attention inside each document with the
bottom-right causal diagonal (equal lengths) is the plan's mask. Learned sinks come from the LSE
as in the flex engine, forward only: ``varlen_attn``'s backward ignores the LSE's gradient, so
selection declines sinks and a differentiable LSE when gradients are needed. The sequence
boundaries are built on the host from the plan's ids once per (plan, device, batch) and kept
(``tessera.core.flex_mask.cu_seqlens``; ``plan.to_flex_block_mask(device)`` and
``PlanPrefetcher`` do it ahead, and a compiled step declines varlen for a plan without them).
"""

from __future__ import annotations

import torch

from . import flex as _flex
from ..core.flex_mask import _cu_key, cu_seqlens
from ..core.probes import varlen_params


def attention(q, k, v, plan, *, scale, sinks, return_lse):
    """``tessera.torch.attention`` on ``varlen_attn`` (arguments checked, engine selected)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    b, hq, L, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    if torch.compiler.is_compiling():
        # Kept before the step (selection checked). The longest document would be a constant of
        # the graph (a recompilation per batch): the row length bounds it instead (FlashAttention
        # sizes its grid by it; the extra blocks of short documents exit at once).
        cu, bound = plan._flex["cu"][_cu_key(q.device, b)], L
    else:
        cu, bound = cu_seqlens(plan, b, q.device)

    def packed(t):  # [B, H, L, D] -> [B·L, H, D]
        return t.transpose(1, 2).reshape(b * L, t.shape[1], t.shape[3])

    need = return_lse or sinks is not None
    params = varlen_params()  # this torch's arguments (selection checked what the call needs)
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kw["scale"] = scale
    if hq != hkv:
        kw["enable_gqa"] = True
    if need:
        kw["return_aux"] = AuxRequest(lse=True)
    out = varlen_attn(packed(q), packed(k), packed(v), cu, cu, bound, bound, **kw)
    o, lse = out if need else (out, None)
    o = o.view(b, L, hq, dv).transpose(1, 2)
    if lse is not None:
        lse = lse.view(hq, b, L).transpose(0, 1)
        if sinks is not None:
            o, lse = _flex._with_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o
