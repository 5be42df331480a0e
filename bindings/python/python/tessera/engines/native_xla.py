"""Tessera's CPU kernels as XLA FFI custom calls (the FFI route of :mod:`tessera.jax`): target
registration with XLA's CPU platform, the plan-handle registry (a plan stays registered while its
object lives and until every computation that may read it has finished), and the forward,
logged-forward and backward calls, zero-copy on XLA's buffers. The frontend owns the
``custom_vjp`` around them."""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref
from typing import Any, Dict, NamedTuple, Optional

import numpy as np

from .. import _tessera
from ..core.plans import Plan
from ..core.telemetry import _TelConfig
from .vma import _varying


_TARGET_FWD = "tessera_attention_fwd"


_TARGET_FWD_LOGGED = "tessera_attention_fwd_logged"


_TARGET_BWD = "tessera_attention_bwd"


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
        outs.append(jax.ShapeDtypeStruct((hq, _tessera.TELEMETRY_COLUMNS, 2), np.float32))
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
