"""JAX integration: ``tessera.jax.attention``, one op on every device JAX runs on (SPEC §12).

On CPU the op runs Tessera's kernels through XLA FFI custom calls (forward, backward and the
telemetry forward), zero-copy on XLA's buffers; on TPU it runs Splash with the plan's
``MaskInfo`` (see :mod:`tessera._splash`). Example::

    import jax, jax.numpy as jnp, numpy as np, tessera, tessera.jax as tj
    ids = np.repeat(np.arange(4), 256)                           # 4 documents in 1024 tokens
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, heads=8)

    @jax.jit
    def loss(q, k, v, plan):                                     # the plan is an argument
        return tj.attention(q, k, v, plan, softcap=30.0).square().mean()

    q = jnp.ones((2, 8, 1024, 64)); k = v = jnp.ones((2, 2, 1024, 64))   # GQA: 2 kv heads
    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, plan)

Plans reach compiled code as data. A :class:`tessera.Plan` is a JAX pytree whose only leaf is
its handle (``int32 [2]``, 62 random bits: JAX has no int64 arrays without x64) and whose static
part is its shapes, so calling a jitted step with another plan of the same shapes neither
retraces nor recompiles, and no plan constant is baked into the executable (the persistent
compilation cache hits across processes). Pass plans as arguments: a plan *closed over* by a
jitted function becomes a constant of that trace.

The handle registry holds a plan while its :class:`tessera.Plan` object lives, and after that
until every computation whose outputs are still held has finished (JAX dispatches
asynchronously: ``step(x, tessera.plan(...))`` works). A handle whose plan is gone, or a made-up
one, is an error raised by the custom call, never a read of freed memory.

Layouts: ``layout="bhld"`` (default) takes ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``,
``v [B, Hkv, Lkv, Dv]`` like ``tessera.torch``; ``layout="blhd"`` takes ``[B, L, H, D]``, the
``[B, T, N, H]`` of ``jax.nn.dot_product_attention``, read in place through strides. Outputs come
in the same layout as the inputs.
"""

from __future__ import annotations

import atexit
import functools
import queue
import sys
import threading
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import Plan, _int_arg, _tessera
from ._jaxargs import check_qkv, layout_name, scale_softcap

__all__ = [
    "attention",
    "plan_ref",
    "PlanRef",
    "Telemetry",
    "cp_attention",
    "cp_plan",
    "CPPlan",
    "reduce_summary",
    "SUMMARY_COLUMNS",
    "scatter",
    "gather",
    "mask_info",
    "LAYOUTS",
    "BACKENDS",
]

LAYOUTS = ("bhld", "blhd")
BACKENDS = ("auto", "ffi", "splash")

_TARGET_FWD = "tessera_attention_fwd"
_TARGET_FWD_LOGGED = "tessera_attention_fwd_logged"
_TARGET_BWD = "tessera_attention_bwd"
_STAT_COLUMNS = _tessera.TELEMETRY_COLUMNS
# A summary's columns: the kernel's stats, then the query rows summarised and the devices reduced
# into it (the records' `tokens` and `ranks`).
SUMMARY_COLUMNS = _STAT_COLUMNS + 2

# -- registration -----------------------------------------------------------------------------

_lock = threading.Lock()
_targets_registered = False


def _register_targets() -> None:
    """Registers the FFI handlers with XLA's CPU platform (once per process)."""
    global _targets_registered
    if _targets_registered:
        return
    import jax

    with _lock:
        if not _targets_registered:
            for name, capsule in _tessera.ffi_targets().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            _targets_registered = True


_handles: "weakref.WeakKeyDictionary[Plan, np.ndarray]" = weakref.WeakKeyDictionary()


def _split(h: int) -> np.ndarray:
    return np.array([h >> 31, h & (2**31 - 1)], dtype=np.int32)


def _join(words: np.ndarray) -> int:
    """The handle of :func:`_split`'s words."""
    return int(words[0]) << 31 | int(words[1])


_released: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
_reaper: Optional[threading.Thread] = None


def _reap() -> None:
    """Releases the handles of collected plans once every computation whose outputs are still
    held has finished: JAX dispatches asynchronously, so a step that got a plan as an argument
    may run after the Plan object is gone (``step(x, tessera.plan(...))``, or a loop rebinding
    ``plan``). A computation whose outputs nobody holds is not waited for: if it ran after the
    release, its custom call would fail cleanly ("names no live plan"), unobserved."""
    import jax

    stop = False
    while not stop:
        handles = [_released.get()]
        while not _released.empty():
            handles.append(_released.get())
        stop = None in handles  # the exit sentinel: finish this round, then end
        for a in jax.live_arrays():
            try:
                a.block_until_ready()
            except Exception:  # deleted meanwhile, or a failed computation: nothing to wait for
                pass
        for h in handles:
            if h is not None:
                _tessera.ffi_release(h)


def _release_later(h: int) -> None:
    global _reaper
    if _exiting or sys.is_finalizing():
        # No computation starts any more: release now (the reaper must not call into JAX
        # while the interpreter is torn down).
        _tessera.ffi_release(h)
        return
    _released.put(h)
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="tessera-jax-release", daemon=True)
            _reaper.start()


_reaper_lock = threading.Lock()
_exiting = False


@atexit.register
def _stop_reaper() -> None:
    """Ends the reaper before the interpreter's teardown (a daemon thread inside JAX's C++ at
    that point aborts the process)."""
    global _exiting
    _exiting = True
    with _reaper_lock:
        reaper = _reaper
    if reaper is not None:
        _released.put(None)
        reaper.join(timeout=10)


def _handle_of(plan: Plan) -> np.ndarray:
    """The plan's FFI handle words, registering the plan on first use; the registry entry goes
    after the Plan object is collected (see :func:`_reap`)."""
    with _lock:
        words = _handles.get(plan)
        if words is None:
            h = _tessera.ffi_register(plan._p)
            weakref.finalize(plan, _release_later, h)
            words = _split(h)
            words.setflags(write=False)
            _handles[plan] = words
    return words


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
    shapes, and optionally the plan's stable-shape Splash ``MaskInfo`` (``splash``, a pytree)."""

    __slots__ = ("handle", "meta", "splash", "plan")

    def __init__(self, handle: Any, meta: _Meta, splash: Any = None, plan: Optional[Plan] = None):
        self.handle = handle
        self.meta = meta
        self.splash = splash
        self.plan = plan  # the Plan itself when concrete (keeps it alive), else None

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return self.meta.shape

    def __repr__(self) -> str:
        b, h, lq, lkv = self.meta.shape
        return f"tessera.jax.PlanRef(B={b}, H={h}, Lq={lq}, Lkv={lkv}, block={self.meta.block})"


def _flatten_ref(r: PlanRef):
    return (r.handle, r.splash), r.meta


def _unflatten_ref(meta: _Meta, children) -> PlanRef:
    handle, splash = children
    return PlanRef(handle, meta, splash)


def _flatten_plan(p: Plan):
    return _flatten_ref(p._traced if p._p is None else plan_ref(p))


def _unflatten_plan(meta: _Meta, children) -> Plan:
    """A Plan stand-in around the (traced) handle: unflattening a Plan gives a Plan again, so
    tree round trips and ahead-of-time compiled steps see the same pytree."""
    p = Plan.__new__(Plan)
    p._p = None
    p._handle = None
    p._handle_tensor = None
    p._flex = {}
    p._traced = _unflatten_ref(meta, children)
    return p


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
    shapes share one compiled Splash step."""
    if isinstance(plan, PlanRef):
        return plan
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    if plan._p is None:
        return plan._traced
    info = None
    if splash if splash is not None else _default_splash():
        from . import _splash

        info = _splash.splash_info(plan, max_partial_blocks=max_partial_blocks)
    return PlanRef(_handle_of(plan), _meta(plan), info, plan)


def _as_ref(plan: Any) -> PlanRef:
    if isinstance(plan, PlanRef):
        return plan
    if isinstance(plan, Plan):
        return plan._traced if plan._p is None else plan_ref(plan, splash=False)
    raise TypeError(f"plan: expected a tessera.Plan (or the PlanRef it becomes under jit), got {type(plan).__name__}")


# -- telemetry --------------------------------------------------------------------------------


class Telemetry:
    """Gated telemetry for ``tessera.jax.attention`` (SPEC §6), device side first.

    ``Telemetry(every=N)`` is a pytree whose leaf is the step (pass ``tel.at(step)`` into the
    jitted step; a traced step is fine). With ``telemetry=tel`` the op also returns the step's
    per-head summary, ``float32 [Hq, 11, 2]``: a ``lax.cond`` on the traced step runs the
    telemetry kernel on logging steps and the plain kernel (zeros for the summary) otherwise, so
    no Python branch looks at a live value. Under ``shard_map``, :func:`reduce_summary` (done by
    :func:`cp_attention`) combines summaries across devices with ``psum``/``pmax`` before they
    leave them. On the host, :meth:`collect` keeps the device arrays of a step (no read) and
    :meth:`read` reads them once and returns the records of SPEC §6 (the JSON-lines schema of
    ``tessera telemetry plot``)."""

    def __init__(
        self,
        every: int = 100,
        *,
        sink_tokens: int = 1,
        epsilon: float = 0.3,
        outlier_ratio: float = 6.0,
        streams: Sequence[str] = ("sink", "outlier"),
        step: Any = 0,
    ) -> None:
        from ._telemetry import checked_config

        every, c = checked_config(every, sink_tokens, epsilon, outlier_ratio, streams)
        self.config = _TelConfig(
            every, c["sink_tokens"], c["epsilon"], c["outlier_ratio"], c["sink_stream"],
            c["outlier_stream"],
        )
        self.step = step
        self._pending: List[Tuple[int, int, bool, Any]] = []

    @property
    def every(self) -> int:
        return self.config.every

    def at(self, step: Any) -> "Telemetry":
        """This telemetry at ``step`` (an int or a traced integer scalar)."""
        t = Telemetry.__new__(Telemetry)
        t.config = self.config
        t.step = step
        t._pending = self._pending
        return t

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a logging step (host side, for :meth:`collect`)."""
        return self.config.every > 0 and int(step) % self.config.every == 0

    def collect(self, step: int, summaries: Dict[int, Any], learned_sinks: bool = False) -> None:
        """Keeps ``{layer: summary}`` of ``step`` (device arrays, not read) when it is a logging
        step; ``learned_sinks`` says whether the layers used sink logits."""
        step = _int_arg("collect", "step", step, 0)
        if not self.should_log(step):
            return
        for layer, s in sorted(summaries.items()):
            layer = _int_arg("collect", "layer", layer, 0, 2**32)
            self._pending.append((step, layer, bool(learned_sinks), s))

    def read(self) -> List[Dict[str, Any]]:
        """The records of every collected (step, layer) since the last read: the one host read."""
        import json

        if not self._pending:
            return []
        full = np.stack([_stats64(np.asarray(s)) for *_, s in self._pending])
        c = self.config
        lines = _tessera.telemetry_records(
            np.ascontiguousarray(full[:, :, :_STAT_COLUMNS]),
            [p[0] for p in self._pending],
            [p[1] for p in self._pending],
            [p[2] for p in self._pending],
            max(c.every, 1),
            c.sink_tokens,
            c.epsilon,
            c.outlier_ratio,
            c.sink_stream,
            c.outlier_stream,
            [max(1, int(x)) for x in full[:, 0, _STAT_COLUMNS + 1]],
            [int(x) for x in full[:, 0, _STAT_COLUMNS]],
        )
        self._pending.clear()
        return [json.loads(x) for x in lines]

    def write_jsonl(self, path: Any) -> int:
        """Appends the records of :meth:`read` to ``path`` (JSON lines); returns how many."""
        import json

        records = self.read()
        with open(path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return len(records)


class _TelConfig(NamedTuple):
    every: int
    sink_tokens: int
    epsilon: float
    outlier_ratio: float
    sink_stream: bool
    outlier_stream: bool


def _flatten_tel(t: Telemetry):
    return (t.step,), t.config


def _unflatten_tel(config: _TelConfig, children) -> Telemetry:
    t = Telemetry.__new__(Telemetry)
    t.config = config
    (t.step,) = children
    t._pending = []
    return t


def _stats64(s: np.ndarray) -> np.ndarray:
    """``float64 [Hq, 11]`` from the op's ``float32 [Hq, 11, 2]`` (hi, lo) pairs."""
    s = np.asarray(s)
    if s.ndim != 3 or s.shape[1:] != (SUMMARY_COLUMNS, 2):
        raise ValueError(f"summary: expected float32 [Hq, {SUMMARY_COLUMNS}, 2], got shape {s.shape}")
    hi = s[..., 0].astype(np.float64)
    lo = s[..., 1].astype(np.float64)
    return np.where(np.isfinite(hi), hi + lo, hi)


# Which columns of a summary combine by max (max logit, max |O|); the others are sums.
_MAX_COLUMNS = (4, 5)


def reduce_summary(summary: Any, axis_name: Any) -> Any:
    """Combines per-device summaries over the named mesh axes inside ``shard_map`` (sums of
    numerators and denominators, maxima of maxima): the result is what one device attending to
    every device's rows would report."""
    import jax
    import jax.numpy as jnp

    is_max = np.zeros((SUMMARY_COLUMNS, 2), dtype=bool)
    is_max[list(_MAX_COLUMNS), :] = True
    summed = jax.lax.psum(jnp.where(is_max, 0.0, summary), axis_name)
    # lo words of max columns are 0 (the maxima are float32 values)
    maxed = jax.lax.pmax(jnp.where(is_max, summary, -jnp.inf), axis_name)
    return jnp.where(is_max, maxed, summed)


# -- the custom calls -------------------------------------------------------------------------


class _Cfg(NamedTuple):
    """Static options of one op call (hashable: part of the trace)."""

    scale: float
    softcap: Optional[float]
    layout: str
    return_lse: bool
    tel: Optional[_TelConfig]


_BHLD_OF_BLHD = (0, 2, 1, 3)  # major-to-minor: [B, L, H, D] arrays stored as [B, H, L, D]
_BHL_OF_BLH = (0, 2, 1)


def _attrs(cfg: _Cfg) -> Dict[str, Any]:
    return dict(
        scale=np.float32(cfg.scale),
        softcap=np.float32(cfg.softcap or 0.0),
        layout=np.int64(0 if cfg.layout == "bhld" else 1),
    )


def _forward_call(q, k, v, handle, sinks, cfg: _Cfg, logged: bool):
    import jax

    _register_targets()
    if cfg.layout == "bhld":
        b, hq, lq, _ = q.shape
        o_shape, lse_shape = (b, hq, lq, v.shape[3]), (b, hq, lq)
        layouts = None
    else:
        b, lq, hq, _ = q.shape
        o_shape, lse_shape = (b, lq, hq, v.shape[3]), (b, lq, hq)
        layouts = [_BHLD_OF_BLHD, _BHL_OF_BLH, None]
    outs = [
        jax.ShapeDtypeStruct(o_shape, q.dtype),
        jax.ShapeDtypeStruct(lse_shape, np.float32),
        jax.ShapeDtypeStruct((b, hq), np.float32),
    ]
    attrs = _attrs(cfg)
    target = _TARGET_FWD
    if logged:
        t = cfg.tel
        outs.append(jax.ShapeDtypeStruct((hq, _STAT_COLUMNS, 2), np.float32))
        if layouts is not None:
            layouts.append(None)
        attrs.update(
            sink_tokens=np.int64(t.sink_tokens),
            outlier_ratio=np.float64(t.outlier_ratio),
            sink_stream=np.int64(t.sink_stream),
            outlier_stream=np.int64(t.outlier_stream),
        )
        target = _TARGET_FWD_LOGGED
    call = jax.ffi.ffi_call(target, outs, output_layouts=layouts, vmap_method="sequential")
    return _varying(call(q, k, v, handle, sinks, **attrs), (q, k, v, handle, sinks))


def _backward_call(q, k, v, o, lse, d_o, d_lse, handle, sinks, cfg: _Cfg):
    import jax

    _register_targets()
    dt = q.dtype
    outs = [
        jax.ShapeDtypeStruct(q.shape, dt),
        jax.ShapeDtypeStruct(k.shape, dt),
        jax.ShapeDtypeStruct(v.shape, dt),
        jax.ShapeDtypeStruct(sinks.shape, np.float32),
    ]
    in_layouts = out_layouts = None
    if cfg.layout == "blhd":
        in_layouts = [
            None, None, None, _BHLD_OF_BLHD, _BHL_OF_BLH, None,
            _BHL_OF_BLH if d_lse.ndim == 3 else None, None, None,
        ]
        out_layouts = [_BHLD_OF_BLHD, _BHLD_OF_BLHD, _BHLD_OF_BLHD, None]
    call = jax.ffi.ffi_call(
        _TARGET_BWD, outs, input_layouts=in_layouts, output_layouts=out_layouts,
        vmap_method="sequential",
    )
    args = (q, k, v, o, lse, d_o, d_lse, handle, sinks)
    return _varying(call(*args, **_attrs(cfg)), args)


def _coverage(q, cfg: _Cfg) -> np.ndarray:
    """A logging step's two coverage columns per head, as (hi, lo) pairs: the query rows
    summarised (``B·Lq`` of this call) and the devices reduced (1)."""
    b, hq, lq = (q.shape[0], q.shape[1], q.shape[2]) if cfg.layout == "bhld" else (q.shape[0], q.shape[2], q.shape[1])
    rows = b * lq
    hi = float(np.float32(rows))  # exact below 2**24; the lo word carries any remainder
    return np.broadcast_to(np.array([[hi, rows - hi], [1.0, 0.0]], np.float32), (hq, 2, 2))


def _core_impl(q, k, v, handle, sinks, step, cfg: _Cfg):
    """O, LSE and the telemetry summary (``[0]`` without telemetry) of one call."""
    import jax
    import jax.numpy as jnp

    if cfg.tel is None:
        o, lse, _ = _forward_call(q, k, v, handle, sinks, cfg, False)
        return o, lse, jnp.zeros((0,), np.float32)
    every = max(cfg.tel.every, 1)

    cov = _coverage(q, cfg)

    def logged(args):
        o, lse, _, stats = _forward_call(*args, cfg, True)
        (c,) = _varying([jnp.asarray(cov)], args)
        return o, lse, jnp.concatenate([stats, c], axis=1)

    def plain(args):
        o, lse, _ = _forward_call(*args, cfg, False)
        (zeros,) = _varying([jnp.zeros((cov.shape[0], SUMMARY_COLUMNS, 2), np.float32)], args)
        return o, lse, zeros

    if cfg.tel.every == 0:
        return plain((q, k, v, handle, sinks))
    is_logging = (jnp.asarray(step, jnp.int32) % every) == 0
    return jax.lax.cond(is_logging, logged, plain, (q, k, v, handle, sinks))


def _vma(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    import jax

    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _like(g: Any, x: Any) -> Any:
    """The gradient ``g`` typed like its primal ``x`` under ``shard_map``: summed over the axes
    ``x`` is replicated on (every device's contribution to a shared input, e.g. the sinks), cast
    to varying where ``x`` varies and the custom call's result does not say so."""
    import jax

    gv, xv = _vma(g), _vma(x)
    if gv - xv:
        g = jax.lax.psum(g, tuple(sorted(gv - xv, key=str)))
    if xv - gv:
        g = jax.lax.pcast(g, tuple(sorted(xv - gv, key=str)), to="varying")
    return g


def _varying(outs: Sequence[Any], args: Sequence[Any]) -> List[Any]:
    """The custom call's results typed as varying over every mesh axis an operand varies over
    (inside ``shard_map`` a custom call's result types do not say so by themselves)."""
    import jax

    axes = frozenset().union(*map(_vma, args))
    out = []
    for x in outs:
        missing = axes - _vma(x)
        if missing:
            x = jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")
        out.append(x)
    return out


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
    import jax

    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    platforms = {p for p in map(_platform_of, arrays) if p is not None}
    platform = next(iter(platforms)) if len(platforms) == 1 else jax.default_backend()
    if platform not in ("cpu", "tpu"):
        raise ValueError(
            f"q: arrays on a {platform} device; tessera.jax.attention runs on CPU (Tessera's "
            "kernels through XLA FFI) and TPU (Splash). On a GPU, use tessera.torch.attention "
            "(FlexAttention) or plan.to_splash_mask_info() with your own kernel"
        )
    if backend == "auto":
        return "splash" if platform == "tpu" else "ffi"
    if backend == "ffi" and platform != "cpu":
        raise ValueError(f"backend: 'ffi' runs Tessera's CPU kernels; the arrays are on {platform}")
    return backend


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
    """Exact attention over ``plan`` (SPEC §4): ``softmax(scale·QKᵀ, masked)·V`` with optional
    softcap ``c·tanh(s/c)`` and learned per-head sink logits (denominator only).

    ``q``, ``k``, ``v`` in ``layout`` (``"bhld"``: ``[B, H, L, D]``; ``"blhd"``: ``[B, L, H, D]``),
    float32 or bfloat16, ``Hkv`` dividing ``Hq`` (GQA), ``Dqk`` and ``Dv`` may differ. ``plan`` is a
    :class:`tessera.Plan` or, inside ``jit``, what it becomes (:class:`PlanRef`). Returns ``O`` in
    q's layout and dtype, and with ``return_lse`` the natural-log ``LSE`` (``[B, Hq, Lq]`` or
    ``[B, Lq, Hq]``, float32); gradients flow to q, k, v, sinks and through the LSE. Rows with no
    allowed key give ``O = 0`` (``LSE = -inf``). With ``telemetry`` (a :class:`Telemetry` at a
    step) the result gains the step's summary (``float32 [Hq, 11, 2]``, zeros on non-logging
    steps) as its last element. ``backend``: ``"auto"`` (FFI on CPU, Splash on TPU), ``"ffi"``
    or ``"splash"`` (Pallas interpret mode off TPU).
    """
    import jax.numpy as jnp

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
    if which == "splash":
        return _splash_attention(q, k, v, ref, scale, softcap, sinks, return_lse, telemetry, layout)
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
    from . import _splash

    if telemetry is not None:
        raise NotImplementedError(
            "telemetry: the Splash route has no telemetry kernel yet; log telemetry from the "
            "CPU (FFI) route"
        )
    info = ref.splash
    if info is None:
        if ref.plan is None:
            raise ValueError(
                "plan: the Splash route needs the plan's MaskInfo inside jit; pass "
                "tessera.jax.plan_ref(plan, splash=True) to the jitted function"
            )
        info = _splash.splash_info(ref.plan)
    if layout == "blhd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    out = _splash.splash_attention(
        q, k, v, info, scale=scale, softcap=softcap, sinks=sinks, return_lse=return_lse
    )
    if layout == "blhd":
        if return_lse:
            o, lse = out
            return o.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)
        return out.transpose(0, 2, 1, 3)
    return out


# -- context parallelism under shard_map ---------------------------------------------------------


def _bucket(n: int, cap: int) -> int:
    """``n`` rounded up to a power of two, at most ``cap``: plans whose needs differ a little
    share one compiled step."""
    return min(cap, 1 << max(0, (max(n, 1) - 1).bit_length()))


class CPPlan:
    """A sharding's local plans for one SPMD program (``shard_map``), as a pytree.

    Leaves (replicated: pass them with ``PartitionSpec()``; each device picks its row by
    ``lax.axis_index``): ``handles`` ``int32 [R, 2]`` (rank r's local plan), and for
    ``mode="needed"`` ``send`` ``int32 [R, R·M]`` (the local tiles each rank sends to every
    rank, padded to ``M`` per pair) and ``recv`` ``int32 [R, N]`` (where each of a rank's ``N``
    needed tiles lands in what it receives). Static: the local plans' shapes, the mode, ``M`` and
    ``N`` (powers of two, so new plans rarely change them), the tile and the world size."""

    __slots__ = ("handles", "send", "recv", "aux", "_keep")

    def __init__(self, handles: Any, send: Any, recv: Any, aux: "_CPAux", keep: Any = None):
        self.handles, self.send, self.recv, self.aux = handles, send, recv, aux
        self._keep = keep  # the local Plans (alive while this object is)

    def __repr__(self) -> str:
        a = self.aux
        return f"tessera.jax.CPPlan(mode={a.mode!r}, world_size={a.world_size}, M={a.per_pair}, N={a.needed})"


class _CPAux(NamedTuple):
    meta: _Meta
    mode: str
    world_size: int
    block: int
    per_pair: int
    needed: int
    tokens_per_rank: int


def _flatten_cp(c: CPPlan):
    return (c.handles, c.send, c.recv), c.aux


def _unflatten_cp(aux: _CPAux, children) -> CPPlan:
    return CPPlan(*children, aux)


def cp_plan(sharding: Any, mode: str = "allgather") -> CPPlan:
    """The :class:`CPPlan` of a ``tessera.cp`` sharding: every rank's local plan registered for
    the FFI (with its keys' global positions, so telemetry finds the sink keys), and for
    ``mode="needed"`` the tile routes of the padded ``all_to_all``. Pass it as an argument of
    the jitted step: plans of equal shapes then share one compiled program."""
    from . import cp as _cp

    if not isinstance(sharding, _cp.Sharding):
        raise TypeError(f"sharding: expected a tessera.cp.Sharding, got {type(sharding).__name__}")
    mode = _cp._mode(mode)
    key = ("jax", mode)
    cached = sharding._local.get(key)
    if cached is not None:
        return cached
    r_n, t = sharding.world_size, sharding.block
    glob = sharding.plan
    total_tiles = glob.shape[2] // t
    send = recv = None
    per_pair = needed = 0
    if mode == "allgather":
        layouts = [sharding.permutation()] * r_n
        pad = 0
    else:
        owner = np.empty(total_tiles, dtype=np.int64)
        local_of = np.empty(total_tiles, dtype=np.int64)
        for s in range(r_n):
            o = sharding.owned(s)
            owner[o] = s
            local_of[o] = np.arange(len(o))
        tiles = [np.asarray(sharding.local_kv_tiles(r, "needed"), dtype=np.int64) for r in range(r_n)]
        pairs = [[tl[owner[tl] == s] for s in range(r_n)] for tl in tiles]
        per_pair = _bucket(max(len(p) for row in pairs for p in row), total_tiles // r_n)
        needed = _bucket(max(len(tl) for tl in tiles), total_tiles)
        send = np.zeros((r_n, r_n * per_pair), dtype=np.int32)
        recv = np.zeros((r_n, needed), dtype=np.int32)
        layouts = []
        for r in range(r_n):
            # Rust's needed layout is grouped by owner in rank order: slot s·M + i holds the
            # i-th tile rank r needs from s.
            slots = np.concatenate([s * per_pair + np.arange(len(pairs[r][s])) for s in range(r_n)])
            recv[r, : len(slots)] = slots
            for s in range(r_n):
                send[s, r * per_pair : r * per_pair + len(pairs[r][s])] = local_of[pairs[r][s]]
            pos = (tiles[r][:, None] * t + np.arange(t)[None, :]).reshape(-1)
            layouts.append(np.concatenate([pos, -np.ones((needed - len(tiles[r])) * t, dtype=np.int64)]))
        pad = needed
    local = [Plan(sharding._s.local_plan(r, mode, pad)) for r in range(r_n)]
    metas = {_meta(p)._replace(telemetry=True) for p in local}
    if len(metas) != 1:
        raise ValueError(f"sharding: the ranks' local plans differ in shape ({sorted(metas)}); cannot run one SPMD program")
    handles = np.stack([
        _split(_tessera.ffi_register_local(p._p, glob._p, [int(x) for x in lay]))
        for p, lay in zip(local, layouts)
    ])
    for p, words in zip(local, handles):
        weakref.finalize(p, _release_later, _join(words))
    aux = _CPAux(metas.pop(), mode, r_n, t, per_pair, needed, sharding.tokens_per_rank)
    out = CPPlan(handles, send, recv, aux, local)
    sharding._local[key] = out
    return out


def _my_row(x: Any, aux: _CPAux, axis_name: Any) -> Any:
    """This device's row of a per-rank table (replicated ``[R, ...]`` or sharded ``[1, ...]``)."""
    import jax

    if x.shape[0] == 1 and aux.world_size > 1:
        return x[0]
    return x[jax.lax.axis_index(axis_name)]


def _exchange(x: Any, cpp: CPPlan, axis_name: Any, seq_axis: int) -> Any:
    """K or V of this rank's local layout: all-gathered, or the needed tiles only."""
    import jax
    import jax.numpy as jnp

    a = cpp.aux
    if a.mode == "allgather":
        return jax.lax.all_gather(x, axis_name, axis=seq_axis, tiled=True)
    t = a.block
    shape = list(x.shape)
    tiles = shape[seq_axis] // t
    xt = x.reshape(shape[:seq_axis] + [tiles, t] + shape[seq_axis + 1 :])
    out = jnp.take(xt, _my_row(cpp.send, a, axis_name), axis=seq_axis)  # [.., R·M, t, ..]
    out = jax.lax.all_to_all(out, axis_name, seq_axis, seq_axis, tiled=True)
    out = jnp.take(out, _my_row(cpp.recv, a, axis_name), axis=seq_axis)  # [.., N, t, ..]
    return out.reshape(shape[:seq_axis] + [a.needed * t] + shape[seq_axis + 1 :])


def _cp_outliers(o: Any, ratio: float, layout: str, axis_name: Any) -> Any:
    """Outlier counts per query head against each (batch row, head) slice's RMS over the whole
    row (every device's rows): the count one device holding the row would make."""
    import jax
    import jax.numpy as jnp

    x = o.astype(jnp.float32)
    if layout == "blhd":
        x = x.transpose(0, 2, 1, 3)
    sq = jax.lax.psum(jnp.sum(x * x, axis=(2, 3)), axis_name)  # [B, H]
    n = jax.lax.psum(x.shape[2] * x.shape[3], axis_name)
    thr = ratio * jnp.sqrt(sq / n)
    cnt = jnp.sum(jnp.abs(x) > thr[:, :, None, None], axis=(0, 2, 3), dtype=jnp.int32)
    cnt = jax.lax.psum(cnt, axis_name)
    hi = cnt.astype(jnp.float32)
    return jnp.stack([hi, (cnt - hi.astype(jnp.int32)).astype(jnp.float32)], axis=-1)


def cp_attention(
    q: Any,
    k: Any,
    v: Any,
    sharding: Any,
    axis_name: Any,
    *,
    mode: str = "allgather",
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Any = None,
    return_lse: bool = False,
    telemetry: Optional[Telemetry] = None,
    layer: int = 0,
    layout: str = "bhld",
) -> Any:
    """Exact attention over a row sharded by ``tessera.cp.shard``, inside ``shard_map`` over
    ``axis_name`` (SPEC §11): this device's ``q``, ``k``, ``v`` hold its tokens (the row put in
    sharded order by :func:`scatter`, then split evenly along L). ``sharding`` is a
    :class:`CPPlan` (:func:`cp_plan`, passed into the program: no recompile for new plans) or a
    ``tessera.cp.Sharding`` (its handles become constants of the trace). ``mode="allgather"``
    all-gathers K/V; ``mode="needed"`` moves only the tiles each rank's rows touch (one padded
    ``all_to_all``). Gradients: dQ stays local, dK/dV return to their owners (the transposes of
    the exchange), the sinks' gradient is summed over the devices. With ``telemetry`` the
    summary returned is already reduced over ``axis_name`` (``psum``/``pmax``; outliers counted
    against each slice's RMS over the whole row): every device holds the whole row's summary."""
    import jax.numpy as jnp

    if isinstance(sharding, CPPlan):
        cpp = sharding
        if cpp.aux.mode != mode:
            raise ValueError(f"mode: {mode!r}, but the CPPlan was made for {cpp.aux.mode!r}")
    else:
        cpp = cp_plan(sharding, mode)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    seq_axis = 2 if layout == "bhld" else 1
    a = cpp.aux
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(getattr(t, "shape", ())) != 4 or t.shape[seq_axis] != a.tokens_per_rank:
            raise ValueError(
                f"{name}: expected this device's {layout_name(layout)} with L = "
                f"{a.tokens_per_rank} (tokens per rank), got shape {tuple(getattr(t, 'shape', ()))}"
            )
    kx = _exchange(k, cpp, axis_name, seq_axis)
    vx = _exchange(v, cpp, axis_name, seq_axis)
    ref = PlanRef(_my_row(jnp.asarray(cpp.handles), a, axis_name), a.meta)
    out = attention(
        q, kx, vx, ref, scale=scale, softcap=softcap, sinks=sinks, return_lse=return_lse,
        telemetry=telemetry, layer=layer, layout=layout, backend="ffi",
    )
    if telemetry is None:
        return out
    import jax

    *main, summary = out
    summary = reduce_summary(jax.lax.stop_gradient(summary), axis_name)
    if telemetry.config.outlier_stream:
        o = jax.lax.stop_gradient(main[0])
        counts = _cp_outliers(o, telemetry.config.outlier_ratio, layout, axis_name)
        logging = summary[0, _STAT_COLUMNS + 1, 0] > 0  # devices reduced: 0 on quiet steps
        summary = summary.at[:, 8, :].set(jnp.where(logging, counts, 0.0))
    return tuple(main) + (summary,)


def _permutation(x: Any, sharding: Any, axis: int) -> np.ndarray:
    """The sharded order of ``sharding``, checked against ``x``'s length at ``axis``."""
    from . import cp as _cp

    if not isinstance(sharding, _cp.Sharding):
        raise TypeError(f"sharding: expected a tessera.cp.Sharding, got {type(sharding).__name__}")
    perm = sharding.permutation()
    if not -x.ndim <= axis < x.ndim or x.shape[axis] != len(perm):
        raise ValueError(f"x: expected length {len(perm)} at axis {axis}, got shape {tuple(x.shape)}")
    return perm


def scatter(x: Any, sharding: Any, axis: int = 1) -> Any:
    """The whole row ``x`` (L at ``axis``) in sharded order: rank r's tokens are the r-th
    ``L / R`` block, so splitting ``axis`` evenly over the mesh gives each device its tokens."""
    import jax.numpy as jnp

    return jnp.take(x, jnp.asarray(_permutation(x, sharding, axis), jnp.int32), axis=axis)


def gather(x: Any, sharding: Any, axis: int = 1) -> Any:
    """The inverse of :func:`scatter`: a row in sharded order back in token order."""
    import jax.numpy as jnp

    perm = _permutation(x, sharding, axis)
    inv = np.empty(len(perm), dtype=np.int32)
    inv[perm] = np.arange(len(perm), dtype=np.int32)
    return jnp.take(x, jnp.asarray(inv), axis=axis)


def mask_info(
    plan: Plan,
    *,
    batch_row: int = 0,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
    shrink_grid_dkv: bool = True,
    downcast_smem_data: bool = True,
    as_numpy: bool = False,
) -> Tuple[Any, Any]:
    """The forward (and dQ) and the dKV Splash ``MaskInfo`` of ``plan`` for one batch row, equal
    to ``process_mask(MultiHeadMask(...), plan.block, ...)`` and ``process_mask_dkv(...)`` with
    the same options (``shrink_grid_dkv=False`` for the fused backward kernel). Splash has no
    batch dimension: a plan whose mask differs per batch row gives each row's infos with
    ``batch_row=``. Arrays are jax arrays (numpy with ``as_numpy=True``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import (
        MaskInfo,
    )

    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    head_shards = _int_arg("mask_info", "head_shards", head_shards, 1)
    q_seq_shards = _int_arg("mask_info", "q_seq_shards", q_seq_shards, 1)
    batch_row = _int_arg("mask_info", "batch_row", batch_row, 0)
    rows = plan._p._splash_arrays(
        head_shards, q_seq_shards, shrink_grid, shrink_grid_dkv, downcast_smem_data
    )
    if not 0 <= batch_row < plan.shape[0]:
        raise ValueError(f"batch_row: expected 0 <= batch_row < {plan.shape[0]}, got {batch_row}")
    fwd, dkv = rows[batch_row if len(rows) > 1 else 0]
    if as_numpy:
        conv = lambda x: x  # noqa: E731
    else:
        import jax.numpy as jnp

        conv = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731

    def info(d: dict) -> Any:
        return MaskInfo(
            data_next=conv(d["data_next"]),
            mask_next=conv(d["mask_next"]),
            block_mask=conv(d["block_mask"]),
            partial_mask_blocks=conv(d["partial_mask_blocks"]),
            q_sequence=None,
        )

    return info(fwd), info(dkv)


def _on_import() -> None:
    import jax

    jax.tree_util.register_pytree_node(Telemetry, _flatten_tel, _unflatten_tel)
    jax.tree_util.register_pytree_node(CPPlan, _flatten_cp, _unflatten_cp)
    _register_pytrees()


_on_import()
