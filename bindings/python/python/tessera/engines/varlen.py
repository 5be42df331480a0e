"""``torch.nn.attention.varlen.varlen_attn`` behind ``tessera.torch.attention`` (``engine="varlen"``,
chosen by ``auto`` on a GPU when :func:`tessera.core.flex_mask.causal_documents` accepts the
plan): packed causal documents as FlashAttention sequences (``cu_seqlens``), no mask at all.

Exact for what it accepts: the plan's mask is exactly ``causal & document`` over contiguous,
unpadded documents shared by queries and keys, so attention inside each document with the
bottom-right causal diagonal (equal lengths) is the plan's mask. Learned sinks come from the LSE
as in the flex engine, forward only: ``varlen_attn``'s backward ignores the LSE's gradient, so
selection declines sinks and a differentiable LSE when gradients are needed. The sequence
boundaries are built on the host from the plan's ids once per (plan, device, batch) and kept
(:func:`prepare`; ``plan.to_flex_block_mask(device)`` and ``PlanPrefetcher`` do it ahead, and a
compiled step declines varlen for a plan not prepared).
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np
import torch

from ..core.flex_tables import _key
from . import flex as _flex
from ..core.flex_mask import causal_documents


def _key_of(device: torch.device, batch: int) -> str:
    return f"{_key(device)}|{batch}"


def prepared(plan: Any, batch: int, device: torch.device) -> bool:
    """Whether the sequence boundaries for ``batch`` rows on ``device`` are kept on the plan."""
    return _key_of(device, batch) in plan._flex.get("varlen", {})


def prepare(plan: Any, batch: int, device: Any) -> None:
    """Builds and keeps ``(cu_seqlens int32 [docs + 1] on device, longest document)`` for
    ``batch`` rows packed, when the plan is causal documents (else nothing): eagerly, so that a
    compiled step only reads it."""
    device = torch.device(device)
    key = _key_of(device, batch)
    kept = plan._flex.setdefault("varlen", {})
    if key in kept or (plan._p is not None and plan._p.mask is None):
        return
    ids, _ = causal_documents(plan)
    if ids is None:
        return
    L = ids.shape[1]
    starts, longest = [], 0
    for b in range(batch):
        row = ids[b if ids.shape[0] > 1 else 0]
        first = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        longest = max(longest, int(np.diff(np.r_[first, L]).max()))
        starts.append(first + b * L)
    cu = np.r_[np.concatenate(starts), batch * L].astype(np.int32)
    cu_t = torch.from_numpy(cu)
    if device.type == "cuda":  # pinned, so the copy does not wait for the device
        cu_t = cu_t.pin_memory()
    kept[key] = (cu_t.to(device, non_blocking=True), longest)


def attention(q, k, v, plan, *, scale, sinks, return_lse):
    """``tessera.torch.attention`` on ``varlen_attn`` (arguments checked, engine selected)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    b, hq, L, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    prepare(plan, b, q.device)
    cu, longest = plan._flex["varlen"][_key_of(q.device, b)]
    # Inside a compiled step the longest document is not a constant of the graph (it would
    # recompile per batch): the row length bounds it (FlashAttention sizes its grid by it; the
    # extra blocks of short documents exit at once).
    bound = L if torch.compiler.is_compiling() else longest

    def packed(t):  # [B, H, L, D] -> [B·L, H, D]
        return t.transpose(1, 2).reshape(b * L, t.shape[1], t.shape[3])

    need = return_lse or sinks is not None
    out = varlen_attn(packed(q), packed(k), packed(v), cu, cu, bound, bound,
                      return_aux=AuxRequest(lse=True) if need else None, scale=scale,
                      window_size=(-1, 0), enable_gqa=hq != hkv)
    o, lse = out if need else (out, None)
    o = o.view(b, L, hq, dv).transpose(1, 2)
    if lse is not None:
        lse = lse.view(hq, b, L).transpose(0, 1)
        if sinks is not None:
            o, lse = _flex._with_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o
