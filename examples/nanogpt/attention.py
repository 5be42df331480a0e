"""The attention call nanoGPT's `model.py` makes, through Tessera: `causal` planned once per
sequence length and run by `tessera.torch.attention` (Tessera's kernels on CPU tensors, Splash
through torch_xla on XLA tensors, FlexAttention on CUDA). The plan is kept, so its tables reach
the device once and every later step reuses the same graph."""

from __future__ import annotations

import functools

import tessera
import tessera.torch


@functools.lru_cache(maxsize=None)
def causal_plan(length: int) -> tessera.Plan:
    return tessera.plan(tessera.causal(), q_len=length)


def attention(q, k, v, dropout_p: float = 0.0):
    """`scaled_dot_product_attention(q, k, v, is_causal=True)` for `q, k, v [B, H, T, D]`."""
    if dropout_p:
        raise ValueError(f"dropout_p: Tessera has no attention dropout (got {dropout_p}); "
                         "train with dropout=0.0")
    return tessera.torch.attention(q, k, v, causal_plan(q.shape[2]))
