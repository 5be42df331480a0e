"""``tessera.jax.attention``: the JAX frontend's op. Checks the arguments, picks the route (the XLA
FFI engine on CPU, Splash on TPU), owns the ``custom_vjp`` of the FFI route and gates telemetry on
the traced step."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .. import _tessera
from ..core.args import _int_arg, check_qkv, scale_softcap
from ..engines.native_xla import _backward_call, _Cfg, _forward_call, _join
from .plans import PlanRef, _as_ref, _register_pytrees
from .telemetry import SUMMARY_COLUMNS, Telemetry
from ..engines.vma import _like, _varying


LAYOUTS = ("bhld", "blhd")


BACKENDS = ("auto", "ffi", "splash")


def _coverage(q, layout: str, has_sinks: bool) -> np.ndarray:
    """A logging step's three coverage columns per head, as (hi, lo) pairs: the query rows
    summarised (``B·Lq`` of this call), the devices reduced (1) and the devices whose call had
    learned sinks (1 or 0: ``learned_sink_mass`` is null without, as in the torch op's records)."""
    b, hq, lq = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhld" else (q.shape[0], q.shape[2], q.shape[1])
    rows = b * lq
    hi = float(np.float32(rows))  # exact below 2**24; the lo word carries any remainder
    cols = [[hi, rows - hi], [1.0, 0.0], [float(has_sinks), 0.0]]
    return np.broadcast_to(np.array(cols, np.float32), (hq, 3, 2))


def _on_logging_steps(every: int, step: Any, logged, plain, args):
    """``logged(args)`` on the steps that log (``step % every == 0``), else ``plain(args)``: a
    ``lax.cond`` on the traced step, so one compilation serves both and a quiet step runs only
    ``plain``; ``every == 0`` never logs. Both routes' telemetry goes through here."""
    import jax
    import jax.numpy as jnp

    if every == 0:
        return plain(args)
    is_logging = (jnp.asarray(step, jnp.int32) % every) == 0
    return jax.lax.cond(is_logging, logged, plain, args)


def _core_impl(q, k, v, handle, sinks, step, cfg: _Cfg):
    """O, LSE and the telemetry summary (``[0]`` without telemetry) of one call."""
    import jax.numpy as jnp

    if cfg.tel is None:
        o, lse, _ = _forward_call(q, k, v, handle, sinks, cfg, False)
        return o, lse, jnp.zeros((0,), np.float32)
    cov = _coverage(q, cfg.layout, sinks.shape[0] > 0)  # no sinks: an empty array (static)

    def logged(args):
        o, lse, _, stats = _forward_call(*args, cfg, True)
        (c,) = _varying([jnp.asarray(cov)], args)
        return o, lse, jnp.concatenate([stats, c], axis=1)

    def plain(args):
        o, lse, _ = _forward_call(*args, cfg, False)
        (zeros,) = _varying([jnp.zeros((cov.shape[0], SUMMARY_COLUMNS, 2), np.float32)], args)
        return o, lse, zeros

    return _on_logging_steps(cfg.tel.every, step, logged, plain, (q, k, v, handle, sinks))


@functools.lru_cache(maxsize=None)
def _core():
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def core(q, k, v, handle, sinks, step, cfg):
        return _core_impl(q, k, v, handle, sinks, step, cfg)

    def fwd(q, k, v, handle, sinks, step, cfg):
        o, lse, stats = _core_impl(q, k, v, handle, sinks, step, cfg)
        return (o, lse, stats), (q, k, v, handle, sinks, o, lse)

    def bwd(cfg, res, cts):
        q, k, v, handle, sinks, o, lse = res
        d_o, d_lse, _ = cts
        if not cfg.return_lse:
            d_lse = jnp.zeros((0,), np.float32)
        dq, dk, dv, dsinks = _backward_call(
            q, k, v, o, lse, d_o.astype(q.dtype), d_lse.astype(np.float32), handle, sinks, cfg
        )
        return _like(dq, q), _like(dk, k), _like(dv, v), None, _like(dsinks, sinks), None

    core.defvjp(fwd, bwd)
    return core


# -- checks -----------------------------------------------------------------------------------


def _platform_of(x: Any) -> Optional[str]:
    """The platform of a concrete array (None for tracers and host values)."""
    devices = getattr(x, "devices", None)
    if devices is None:
        return None
    try:
        ds = devices()
    except Exception:  # a tracer: no devices
        return None
    return next(iter(ds)).platform if ds else None


def _check(q, k, v, ref: PlanRef, layout: str, sinks: Any) -> None:
    check_qkv(q, k, v, ref.meta.shape, ref.meta.groups, layout, sinks)


def _backend(backend: str, arrays: Sequence[Any]) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    platforms = {p for p in map(_platform_of, arrays) if p is not None}
    if len(platforms) != 1:
        # Traced (inside jit, or exported): the platform is the lowering's, known only then.
        return "by_platform" if backend == "auto" else backend
    platform = platforms.pop()
    if platform not in ("cpu", "tpu"):
        raise ValueError(f"q: arrays on a {platform} device; {_PLATFORMS}")
    if backend == "auto":
        return "splash" if platform == "tpu" else "ffi"
    if backend == "ffi" and platform != "cpu":
        raise ValueError(f"backend: 'ffi' runs Tessera's CPU kernels; the arrays are on {platform}")
    return backend


_PLATFORMS = (
    "tessera.jax.attention runs on CPU (Tessera's kernels through XLA FFI) and TPU (Splash). On "
    "a GPU, use tessera.torch.attention (FlexAttention) or plan.to_splash_mask_info() with your "
    "own kernel"
)


# -- the op -----------------------------------------------------------------------------------


def attention(
    q: Any,
    k: Any,
    v: Any,
    plan: Any,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Any = None,
    return_lse: bool = False,
    telemetry: Optional[Telemetry] = None,
    layer: int = 0,
    layout: str = "bhld",
    backend: str = "auto",
) -> Any:
    """Exact attention over ``plan`` (docs/semantics.md#attention): ``softmax(scale·QKᵀ, masked)·V`` with optional
    softcap ``c·tanh(s/c)`` and learned per-head sink logits (denominator only).

    ``q``, ``k``, ``v`` in ``layout`` (``"bhld"``: ``[B, H, L, D]``; ``"blhd"``: ``[B, L, H, D]``),
    float32 or bfloat16, ``Hkv`` dividing ``Hq`` (GQA), ``Dqk`` and ``Dv`` may differ. ``plan`` is a
    :class:`tessera.Plan` or, inside ``jit``, what it becomes (:class:`PlanRef`). Returns ``O`` in
    q's layout and dtype, and with ``return_lse`` the natural-log ``LSE`` (``[B, Hq, Lq]`` or
    ``[B, Lq, Hq]``, float32); gradients flow to q, k, v, sinks and through the LSE. Rows with no
    allowed key give ``O = 0`` (``LSE = -inf``). With ``telemetry`` (a :class:`Telemetry` at a
    step) the result gains the step's summary (``float32 [Hq, 12, 2]``, zeros on non-logging
    steps) as its last element. ``backend``: ``"auto"`` (FFI on CPU, Splash on TPU), ``"ffi"``
    or ``"splash"`` (Pallas interpret mode off TPU). The choice is the platform's the step is
    lowered for, not the default device's: ``jax.export(..., platforms=["tpu"])`` or an AOT
    compile for TPU on a CPU host gets the Splash (Mosaic) kernels, which need
    ``plan_ref(plan, splash=True)`` among the step's arguments.
    """
    _register_pytrees()
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    ref = _as_ref(plan)
    _check(q, k, v, ref, layout, sinks)
    dqk = q.shape[3]
    scale, softcap = scale_softcap(dqk, scale, softcap)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if telemetry is not None:
        if not isinstance(telemetry, Telemetry):
            raise TypeError(f"telemetry: expected a tessera.jax.Telemetry, got {type(telemetry).__name__}")
        layer = _int_arg("attention", "layer", layer, 0, 2**32)
        if not ref.meta.telemetry:
            raise ValueError(
                "telemetry: not available for a rank's local plan of a sharding; "
                "use tessera.jax.cp_attention(..., telemetry=...)"
            )
    which = _backend(backend, (q, k, v))
    args = (q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout)
    if which == "splash":
        return _splash_attention(*args)
    if which == "ffi":
        return _ffi_attention(*args)
    return _by_platform(*args)


def _by_platform(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout):
    """``backend="auto"`` under a trace: the FFI route where the step is lowered for CPU, Splash
    where it is lowered for TPU, a clear lowering error elsewhere (docs/semantics.md#engines-and-devices: the kernel a step runs
    is chosen by the platform it is lowered for). The TPU branch needs the plan's Splash
    ``MaskInfo`` in the step (``plan_ref(plan, splash=True)``) and kv tiles Splash can run; without
    them it lowers to that error, and the CPU branch is unaffected."""
    import jax

    from ..engines.lowering import unsupported
    from ..engines.splash import tile_problem

    args = (q, k, v, ref, sinks, telemetry)

    def cpu(q, k, v, ref, sinks, telemetry):
        return _ffi_attention(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout)

    out_shapes = jax.eval_shape(cpu, *args)
    flat, tree = jax.tree_util.tree_flatten(out_shapes)

    def fail(message):
        def branch(q, k, v, ref, sinks, telemetry):
            outs = _varying(unsupported(message, flat, q), (q, k, v))
            return jax.tree_util.tree_unflatten(tree, outs)

        return branch

    problem = tile_problem(*ref.meta.block)
    if problem is not None:
        tpu = fail(f"{problem} (lowering tessera.jax.attention for TPU)")
    elif ref.splash is None:
        tpu = fail(
            "plan: lowering tessera.jax.attention for TPU needs the plan's Splash MaskInfo in the "
            "step: pass tessera.jax.plan_ref(plan, splash=True) to the jitted function")
    elif telemetry is not None and ref.sink_pos is None:
        tpu = fail(
            "telemetry: lowering tessera.jax.attention for TPU with telemetry needs the keys' "
            "document positions: pass tessera.jax.plan_ref(plan, splash=True) (a plan with a mask)")
    else:
        def tpu(q, k, v, ref, sinks, telemetry):
            return _splash_attention(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout)

    return jax.lax.platform_dependent(*args, cpu=cpu, tpu=tpu, default=fail(f"q: {_PLATFORMS}"))


def _ffi_attention(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout):
    import jax.numpy as jnp

    handle = ref.handle
    if isinstance(handle, np.ndarray) and not _tessera.ffi_registered(_join(handle)):
        raise ValueError("plan: this handle names no live plan (freed, or not made by tessera.jax)")
    sinks32 = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks).astype(jnp.float32)
    cfg = _Cfg(scale, softcap, layout, return_lse, None if telemetry is None else telemetry.config)
    step = 0 if telemetry is None else telemetry.step
    o, lse, stats = _core()(q, k, v, jnp.asarray(handle, jnp.int32), sinks32, step, cfg)
    out: Tuple[Any, ...] = (o, lse) if return_lse else (o,)
    if telemetry is not None:
        import jax

        out = out + (jax.lax.stop_gradient(stats),)
    return out[0] if len(out) == 1 else out


def _splash_attention(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout):
    from . import splash as _splash

    info = ref.splash
    if info is None:
        if ref.plan is None:
            raise ValueError(
                "plan: the Splash route needs the plan's MaskInfo inside jit; pass "
                "tessera.jax.plan_ref(plan, splash=True) to the jitted function"
            )
        info = _splash.splash_info(ref.plan)
    pos = ref.sink_pos
    if telemetry is not None and pos is None:
        if ref.plan is None:
            raise ValueError(
                "telemetry: the Splash route finds the sink keys from the plan's documents; pass "
                "tessera.jax.plan_ref(plan, splash=True) to the jitted function")
        from ..core.plans import sink_positions

        pos = sink_positions(ref.plan)
    if layout == "blhd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    o, lse = _splash.splash_attention(q, k, v, info, scale=scale, softcap=softcap, sinks=sinks, return_lse=True)
    summary = None
    if telemetry is not None:
        summary = _splash_summary(q, k, o, lse, sinks, info, pos, scale, softcap, telemetry)
    if layout == "blhd":
        o, lse = o.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)
    out: Tuple[Any, ...] = (o, lse) if return_lse else (o,)
    if summary is not None:
        out += (summary,)
    return out[0] if len(out) == 1 else out


def _splash_summary(q, k, o, lse, sinks, info, pos, scale, softcap, telemetry):
    """The Splash route's telemetry summary ``[Hq, SUMMARY_COLUMNS, 2]`` on logging steps (a
    ``lax.cond`` on the traced step: a non-logging step runs only the zeros branch), from
    :func:`tessera.engines.splash_telemetry.summary`; no gradient flows through it."""
    import jax
    import jax.numpy as jnp

    from ..engines.splash_telemetry import summary

    cfg = telemetry.config
    cov = _coverage(q, "bhld", sinks is not None)
    sg = jax.lax.stop_gradient
    args = (sg(q), sg(k), sg(o), sg(lse), None if sinks is None else sg(jnp.asarray(sinks)))
    arrays = info.tree_flatten()[0]
    batched = info.meta.groups[0] > 1

    def logged(args):
        stats = summary(*args, arrays, pos, block=info.meta.block, batched=batched, scale=scale,
                        softcap=softcap, tel=cfg)
        (c,) = _varying([jnp.asarray(cov)], args[:4])
        return jnp.concatenate([stats, c], axis=1)

    def plain(args):
        (zeros,) = _varying([jnp.zeros((cov.shape[0], SUMMARY_COLUMNS, 2), np.float32)], args[:4])
        return zeros

    return _on_logging_steps(cfg.every, telemetry.step, logged, plain, args)
