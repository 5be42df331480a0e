"""Plans as JAX pytrees: a :class:`tessera.Plan` (or the :class:`PlanRef` it becomes under ``jit``)
whose only leaf is its handle and whose static part is its shapes, so a new plan of equal shapes
neither retraces nor recompiles; with the Splash route it also carries stable-shape ``MaskInfo``."""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple, Optional, Tuple

from ..core import splash_tables
from ..core.plans import Plan, check_plan
from ..engines.native_xla import _handle_of


# -- plans as pytrees -------------------------------------------------------------------------


class _Meta(NamedTuple):
    """The static part of a plan: what a compiled step is specialised on."""

    shape: Tuple[int, int, int, int]  # (B, H, Lq, Lkv)
    block: Tuple[int, int]
    groups: Tuple[int, int]  # (B', H'): 1 where the mask does not vary
    telemetry: bool  # whether the sink keys are known (a mask; not a CP local plan)


def _meta(plan: Plan) -> _Meta:
    return _Meta(tuple(plan.shape), tuple(plan.block), tuple(plan.groups), plan._p.mask is not None)


class PlanRef:
    """A plan as JAX sees it: the handle words (concrete, or traced inside ``jit``), the static
    shapes, and optionally the plan's stable-shape Splash ``MaskInfo`` (``splash``, a pytree) with
    each key's position in its document (``sink_pos`` ``int32 [B' or 1, Lkv]``, where the Splash
    route's telemetry finds the sink keys)."""

    __slots__ = ("handle", "meta", "splash", "plan", "sink_pos")

    def __init__(self, handle: Any, meta: _Meta, splash: Any = None, plan: Optional[Plan] = None,
                 sink_pos: Any = None):
        self.handle = handle
        self.meta = meta
        self.splash = splash
        self.plan = plan  # the Plan itself when concrete (keeps it alive), else None
        self.sink_pos = sink_pos

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return self.meta.shape

    def __repr__(self) -> str:
        b, h, lq, lkv = self.meta.shape
        return f"tessera.jax.PlanRef(B={b}, H={h}, Lq={lq}, Lkv={lkv}, block={self.meta.block})"


def _flatten_ref(r: PlanRef):
    return (r.handle, r.splash, r.sink_pos), r.meta


def _unflatten_ref(meta: _Meta, children) -> PlanRef:
    handle, splash, sink_pos = children
    return PlanRef(handle, meta, splash, None, sink_pos)


def _flatten_plan(p: Plan):
    return _flatten_ref(p._traced if p._p is None else plan_ref(p))


def _unflatten_plan(meta: _Meta, children) -> Plan:
    """A Plan stand-in around the (traced) handle: unflattening a Plan gives a Plan again, so
    tree round trips and ahead-of-time compiled steps see the same pytree."""
    p = Plan.__new__(Plan)
    p._p = None
    p._native = None
    p._handle = None
    p._handle_tensor = None
    p._flex = {}
    p._traced = _unflatten_ref(meta, children)
    return p


_lock = threading.Lock()
_pytrees_registered = False


def _register_pytrees() -> None:
    global _pytrees_registered
    if _pytrees_registered:
        return
    import jax

    with _lock:
        if not _pytrees_registered:
            jax.tree_util.register_pytree_node(PlanRef, _flatten_ref, _unflatten_ref)
            jax.tree_util.register_pytree_node(Plan, _flatten_plan, _unflatten_plan)
            _pytrees_registered = True


def _default_splash() -> bool:
    import jax

    return jax.default_backend() == "tpu"


def plan_ref(plan: Plan, *, splash: Optional[bool] = None, max_partial_blocks: Optional[int] = None) -> PlanRef:
    """``plan`` as the pytree a jitted step takes. With ``splash=True`` (the default on TPU) it
    also carries the plan's Splash ``MaskInfo`` in stable shapes (full grid, partial blocks
    padded to ``max_partial_blocks``, default the next power of two), so that plans of equal
    shapes share one compiled Splash step; a plan whose kv tile is not a multiple of 128 raises
    ``ValueError`` naming ``block`` then. A step exported or compiled for TPU needs this form."""
    if isinstance(plan, PlanRef):
        return plan
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    if plan._p is None:
        return plan._traced
    info = pos = None
    if splash if splash is not None else _default_splash():
        from ..core.splash_tables import splash_info
        from ..engines.splash import check_tiles

        check_tiles(*plan.block)  # Splash (and so a TPU lowering) runs kv tiles of 128·n only
        info = splash_info(plan, max_partial_blocks=max_partial_blocks)
        if plan._p.mask is not None:
            from ..core.plans import sink_positions

            pos = sink_positions(plan)
    return PlanRef(_handle_of(plan), _meta(plan), info, plan, pos)


def _as_ref(plan: Any) -> PlanRef:
    if isinstance(plan, PlanRef):
        return plan
    if isinstance(plan, Plan):
        return plan._traced if plan._p is None else plan_ref(plan, splash=False)
    raise TypeError(f"plan: expected a tessera.Plan (or the PlanRef it becomes under jit), got {type(plan).__name__}")


@functools.wraps(splash_tables.mask_info)
def mask_info(plan: Plan, **options: Any) -> Tuple[Any, Any]:
    return splash_tables.mask_info(check_plan(plan), **options)
