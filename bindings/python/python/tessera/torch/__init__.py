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
same semantics (``tessera.engines.flex``).
"""

from __future__ import annotations

from ..engines.select import last_dispatch
from .op import attention, to_flex_block_mask
from .prefetch import PlanPrefetcher
from .telemetry import Telemetry


__all__ = ["attention", "to_flex_block_mask", "last_dispatch", "PlanPrefetcher", "Telemetry"]
