"""Tessera: block-sparse attention planned at tile granularity.

Quick start::

    import numpy as np, torch, tessera, tessera.torch
    ids = np.repeat(np.arange(4), 512)                  # four 512-token documents in one row
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=2048, heads=8)
    print(plan)                                         # a small picture of the tile states
    q, k, v = (torch.randn(1, 8, 2048, 64, requires_grad=True) for _ in range(3))
    out = tessera.torch.attention(q, k, v, plan)        # exact, skips empty tiles
    out.sum().backward()                                # gradients for q, k, v
    bm = plan.to_flex_block_mask()                      # the same plan as a torch BlockMask

Masks use the same algebra and spelling as the Rust API and the ``tessera`` CLI: leaves
``full()``, ``causal(offset)``, ``window(left, right)``, ``chunk(size)``, ``prefix(n)``,
``document(ids)``, ``band(q_feature, kv_feature, lo, hi)``, ``dense(array)``,
``blocks(kv_tiles, block)``, ``heads([...])`` combined with ``&``, ``|`` and ``~``, or the text form
``tessera.mask("causal & document", segments=ids)``. :func:`plan_from_blocks` plans a per-step
block selection (a MoBA / NSA gate's top-k) intersected with a mask; :func:`from_mask_mod` plans a
FlexAttention ``mask_mod`` exactly, pair by pair. Layout helpers build the
masks of common token layouts from a few of those leaves (``tessera.layouts``): ``neighborhood``
(NATTEN), ``tiled_neighborhood`` (Sliding Tile Attention), ``tile_order``, ``dilated_window``,
``global_tokens``; docs/mask-cookbook.md writes the masks published for FlexAttention with them.
``torch`` and ``jax`` are optional: ``import tessera`` needs numpy only.
"""

from __future__ import annotations

from typing import Any

from . import _tessera
from ._tessera import Mask
from .core.layouts import dilated_window, global_tokens, neighborhood, tile_order, tiled_neighborhood
from .core.mask_mod import MaskModHint, from_mask_mod
from .core.masks import band, blocks, causal, chunk, dense, document, full, heads, mask, prefix, window
from .core.pack import pack
from .core.plans import Plan, cache_stats, plan, plan_from_blocks

__all__ = [
    "Mask",
    "Plan",
    "full",
    "causal",
    "window",
    "chunk",
    "prefix",
    "document",
    "band",
    "dense",
    "heads",
    "blocks",
    "mask",
    "neighborhood",
    "tiled_neighborhood",
    "tile_order",
    "dilated_window",
    "global_tokens",
    "plan",
    "plan_from_blocks",
    "from_mask_mod",
    "MaskModHint",
    "pack",
    "cache_stats",
    "Telemetry",
    "__version__",
]

__version__: str = _tessera.__version__


def __getattr__(name: str) -> Any:
    # Telemetry lives with the torch integration (its summaries are tensors); imported lazily
    # so that `import tessera` needs numpy only.
    if name == "Telemetry":
        from .torch.telemetry import Telemetry

        return Telemetry
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
