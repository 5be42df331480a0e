"""Float64 references for the tests: the dense mask of SPEC §3 evaluated in numpy, and the
attention of SPEC §4 in torch float64 (GQA, softcap, sinks, fully masked rows)."""

import numpy as np
import torch


def dense_mask(mask, b, h, lq, lkv):
    """bool [b, h, lq, lkv] from the native ``Mask.allowed`` (the Rust semantics, pair by pair)."""
    out = np.zeros((b, h, lq, lkv), dtype=bool)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                for j in range(lkv):
                    out[bi, hi, i, j] = mask.allowed(i, j, bi, hi)
    return out


def doc_causal(ids_q, ids_kv=None):
    """bool [B, 1, Lq, Lkv]: causal within documents (ids [B, L] or [L], -1 = padding)."""
    iq = np.atleast_2d(np.asarray(ids_q))
    ik = iq if ids_kv is None else np.atleast_2d(np.asarray(ids_kv))
    lq, lkv = iq.shape[1], ik.shape[1]
    i = np.arange(lq)[:, None]
    j = np.arange(lkv)[None, :]
    same = (iq[:, :, None] == ik[:, None, :]) & (iq[:, :, None] >= 0) & (ik[:, None, :] >= 0)
    return (same & (i >= j))[:, None]


def ref_attention(q, k, v, allowed, scale=None, softcap=None, sinks=None):
    """O [B, Hq, Lq, Dv] and LSE [B, Hq, Lq] in float64 (autograd-able)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.as_tensor(np.asarray(allowed))
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(s.shape[0], hq, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, col], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    # Rows with nothing allowed: exp(-inf - 0) = 0 gives O = 0 without NaN (values or grads).
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])
    return p @ v, lse


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
