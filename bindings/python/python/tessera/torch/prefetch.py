"""``tessera.torch.PlanPrefetcher``: plans the next batches while the current step runs.

Wraps any iterable of batches (a ``DataLoader`` with worker processes included). For each batch
it calls ``make_plan(batch)`` on a background thread ``depth`` batches ahead: planning and the
BlockMask export release the GIL, so they overlap the training step's Python and kernels. The
thread also builds the plan's BlockMask arrays (``CompactMask``: the tables themselves for small
grids, else the non-empty tiles) in pinned memory when CUDA is available. When the batch is
handed out, the arrays go to the device with ``non_blocking=True`` (at most two copies; a large
grid's tables are expanded there, ``block_mask_from_compact``), then kept on the plan: the
step's ``tessera.torch.attention`` finds its BlockMask built, without a host sync.

Plans are made in this process, not in the loader's workers: a plan is a native object (with its
mask) that does not pickle, and a thread gives the same overlap since the planner holds no GIL.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

import torch

from ..core import flex_tables
from ..core import probes
from ..core.flex_mask import causal_documents
from ..core.plans import check_plan


class PlanPrefetcher:
    """``for batch, plan in PlanPrefetcher(loader, make_plan, device="cuda"): ...``

    ``make_plan(batch) -> tessera.Plan`` runs on a background thread ``depth`` batches ahead
    (exceptions surface when that batch is reached). On a non-CPU ``device`` each plan's
    FlexAttention BlockMask (``mask_mod`` as in :func:`tessera.torch.to_flex_block_mask`) is
    built from pinned host arrays moved with ``non_blocking=True`` and kept on the plan; on
    CPU nothing more is done (Tessera's kernels read the plan itself) unless ``block_masks=True``
    (the flex engine on CPU tensors)."""

    def __init__(
        self,
        batches: Iterable[Any],
        make_plan: Callable[[Any], Any],
        device: Any = "cpu",
        depth: int = 2,
        mask_mod: str = "auto",
        block_masks: Optional[bool] = None,
    ) -> None:
        if not callable(make_plan):
            raise TypeError(f"make_plan: expected a callable, got {type(make_plan).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
        if mask_mod not in flex_tables.MASK_MODS:
            raise ValueError(f"mask_mod: expected one of {flex_tables.MASK_MODS}, got {mask_mod!r}")
        self.batches, self.make_plan = batches, make_plan
        self.device, self.depth, self.mask_mod = torch.device(device), depth, mask_mod
        probes.warm(self.device)
        self.block_masks = self.device.type != "cpu" if block_masks is None else bool(block_masks)

    def _prepare(self, batch: Any) -> Tuple[Any, Any, Any]:
        plan = check_plan(self.make_plan(batch), "make_plan(batch)")
        if not self.block_masks:
            return batch, plan, None
        if plan._p.mask is not None:
            causal_documents(plan)  # what engine selection asks, read on this thread
        return batch, plan, flex_tables.compact(plan, self.mask_mod, pin=self.device.type == "cuda")

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        pending: collections.deque = collections.deque()
        it = iter(self.batches)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-plan") as pool:
            done = False
            while True:
                while not done and len(pending) < self.depth:
                    try:
                        pending.append(pool.submit(self._prepare, next(it)))
                    except StopIteration:
                        done = True
                if not pending:
                    return
                batch, plan, c = pending.popleft().result()
                if c is not None:
                    key = flex_tables._key(self.device)
                    if self.mask_mod != "auto":
                        key = f"{key}|{self.mask_mod}"
                    kept = plan._flex.setdefault("bm", {})
                    if key not in kept:
                        kept[key] = flex_tables.block_mask_from_compact(c, self.device, non_blocking=True)
                    flex_tables.prepare(plan, self.device, sequences=True)
                yield batch, plan
