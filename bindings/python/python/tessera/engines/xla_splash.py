"""The torch_xla engine of ``tessera.torch.attention`` (``engine="splash"``): a Tessera plan run by
JAX Splash on XLA tensors (torch_xla on PJRT: Mosaic kernels on TPU, Pallas interpret mode on the
PJRT CPU client), through ``torch_xla.core.xla_builder.call_jax``.

Contract (docs/torch-xla.md, docs/semantics.md#engines-and-devices):

* Semantics are :mod:`tessera.engines.splash`'s (the JAX Splash route): the same forward and
  backward kernels, scale, softcap, learned sinks, GQA, ``Dqk != Dv``, empty rows ``O = 0`` and
  ``LSE = -inf``; float32 and bfloat16. Autograd is a ``torch.autograd.Function`` whose forward
  and backward each lower one JAX function (Splash's forward; Splash's backward kernels from the
  saved O and LSE, no recomputed forward), so gradients reach q, k, v, sinks and the LSE.
* **Plans are data.** A plan enters the graph as ONE ``uint8`` device tensor (every Splash
  ``MaskInfo`` array, the rows with a key and the keys' document positions, packed; the JAX
  function slices and bit-casts it back), moved once per (plan, device, bound) and kept on the
  plan. Its shape and the static layout depend only on the plan's shapes and the partial-block
  bound (``max_partial_blocks``, default the next power of two of the plan's count), never on
  its data: plans of equal shapes lower to identical HLO and reuse the compiled graph.
* **Telemetry** (logging steps only; a host-side step counter decides, nothing is read): the
  same JAX function also returns the per-head summary (:mod:`tessera.engines.splash_telemetry`)
  as a fixed-shape ``float32 [Hq, TELEMETRY_COLUMNS]`` device tensor; a non-logging step lowers
  the function without it (no telemetry work, nothing leaves the device).
* **SPMD.** Under torch_xla SPMD with a global mesh (``xs.set_global_mesh``) whose first axis
  shards the batch, the Splash kernels run under JAX ``shard_map`` over that axis (manual
  sharding around the custom call, as torch_xla's own Splash wrapper does); everything around
  them, telemetry included, is ordinary XLA that the partitioner shards and reduces on device.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, List, Optional, Tuple

import numpy as np

# -- availability ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def importable() -> Tuple[bool, str]:
    """Whether torch_xla's ``call_jax`` and JAX's Splash kernels import here (and why not)."""
    try:
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_builder as xb
    except Exception as e:  # not installed, or a broken install
        return False, f"torch_xla does not import ({type(e).__name__}: {e})"
    if not hasattr(xb, "call_jax"):
        return False, "this torch_xla has no call_jax (torch_xla >= 2.7 needed)"
    try:
        import jax  # noqa: F401
        import torchax  # noqa: F401  (call_jax converts tensors through it)
    except Exception as e:
        return False, (f"call_jax needs jax and torchax ({type(e).__name__}: {e}); "
                       "pip install 'torch_xla[pallas]' torchax")
    try:
        from .splash import _MISSING
    except Exception as e:
        return False, f"JAX's Splash kernels do not import ({type(e).__name__}: {e})"
    if _MISSING:
        return False, f"this JAX's Splash lacks {', '.join(_MISSING)}"
    return True, ""


def reasons(q: Any, plan: Any) -> List[str]:
    """Why this engine cannot run a call on ``q`` with ``plan`` (empty: it can)."""
    import torch

    r = []
    if q.device.type != "xla":
        r.append(f"Splash through torch_xla runs on XLA tensors; q is on {q.device}")
        return r
    ok, why = importable()
    if not ok:
        r.append(why)
    if q.dtype not in (torch.float32, torch.bfloat16):
        r.append(f"Splash takes float32 or bfloat16, not {q.dtype}")
    from .splash import tile_problem

    problem = tile_problem(*plan.block)
    if problem:
        r.append(problem)
    return r


# -- the plan as one device tensor ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: part of call_jax's cache key)."""

    cfg: Any  # tessera.engines.splash._Cfg
    layout: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (dtype, shape, byte offset) per array
    block: Tuple[int, int]
    scale: float
    lq: int
    lkv: int
    tel: Any  # the telemetry config on a logging step, else None
    spmd: Any  # (mesh, batch axis) under SPMD (the kernels see per-device shapes), else None


class _DevicePlan:
    __slots__ = ("buf", "layout", "meta")

    def __init__(self, buf: Any, layout: tuple, meta: Any) -> None:
        self.buf, self.layout, self.meta = buf, layout, meta


_on_device: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

# What this engine did to the runtime, for the receipt (tessera.torch.xla): plan tables moved to a
# device (host-to-device transfers), and host reads of device values (none: nothing here reads).
counters = {"plan_uploads": 0, "host_reads": 0}


def _pack(arrays: List[np.ndarray], rows: int) -> Tuple[np.ndarray, tuple]:
    """``arrays`` (each with a leading axis of 1 or ``rows``) as one ``uint8 [rows, N]`` buffer
    (bool as 0/1 bytes), each array at a 4-byte aligned offset of every row, and the static
    layout (dtype, per-row shape, offset) that finds them again."""
    layout, parts, off = [], [], 0
    for a in arrays:
        a = np.ascontiguousarray(np.broadcast_to(a, (rows,) + a.shape[1:]))
        name = "bool" if a.dtype == np.bool_ else a.dtype.name
        if name == "bool":
            a = a.astype(np.uint8)
        raw = a.reshape(rows, -1).view(np.uint8)
        pad = (-off) % 4
        if pad:
            parts.append(np.zeros((rows, pad), np.uint8))
            off += pad
        layout.append((name, tuple(int(x) for x in a.shape[1:]), off))
        parts.append(raw)
        off += raw.shape[1]
    return np.ascontiguousarray(np.concatenate(parts, axis=1)), tuple(layout)


def _unpack(buf: Any, layout: tuple) -> List[Any]:
    """The arrays :func:`_pack` packed (``[rows, ...]``), sliced and bit-cast from ``buf`` inside
    the JAX function (``buf`` may hold fewer rows than packed: a device's batch shard)."""
    import jax
    import jax.numpy as jnp

    rows = buf.shape[0]
    out = []
    for name, shape, off in layout:
        dt = np.dtype(np.uint8 if name == "bool" else name)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = jax.lax.slice_in_dim(buf, off, off + n, axis=1)
        if name == "bool":
            a = raw != 0
        elif dt.itemsize == 1:
            a = jax.lax.bitcast_convert_type(raw, dt)
        else:
            a = jax.lax.bitcast_convert_type(raw.reshape(rows, -1, dt.itemsize), dt)
        out.append(jnp.reshape(a, (rows,) + shape))
    return out


def device_plan(plan: Any, device: Any, max_partial_blocks: Optional[int]) -> _DevicePlan:
    """``plan``'s Splash tables and sink positions as one ``uint8 [R, N]`` tensor on ``device``
    (``R`` = 1 when the mask and its documents do not vary along batch rows, else B): built and
    moved once per (plan, device, bound), then kept on the plan (one host-to-device transfer; no
    host read)."""
    import torch

    from ..core import splash_tables
    from ..core.plans import sink_positions

    key = (str(device), max_partial_blocks)
    hit = _on_device.get(plan, {}).get(key)
    if hit is not None:
        return hit
    info = splash_tables.splash_info(plan, max_partial_blocks=max_partial_blocks)
    arrays = [np.asarray(a) for a in info.tree_flatten()[0]]
    arrays.append(np.asarray(sink_positions(plan), dtype=np.int32))
    rows = 1 if all(a.shape[0] == 1 for a in arrays) else plan.shape[0]
    buf, layout = _pack(arrays, rows)
    dp = _DevicePlan(torch.from_numpy(buf).to(device), layout, info.meta)
    counters["plan_uploads"] += 1
    _on_device.setdefault(plan, {})[key] = dp
    return dp


# -- the JAX side (module-level functions: call_jax caches by their identity) ------------------------


def _padded(x: Any, n: int) -> Any:
    import jax.numpy as jnp

    return x if x.shape[2] == n else jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2])) + ((0, 0),) * (x.ndim - 3))


def _operands(q: Any, k: Any, v: Any, buf: Any, st: _Static):
    """Scaled, padded q, k, v and the unpacked tables (with and without their group axis)."""
    import jax.numpy as jnp

    tables = _unpack(buf, st.layout)
    arrays, pos = tuple(tables[:9]), tables[9]
    kernel_arrays = arrays if st.cfg.batched else tuple(a[0] for a in arrays)
    tq, tk = st.block
    lq_p, lkv_p = -(-st.lq // tq) * tq, -(-st.lkv // tk) * tk
    # Splash does not scale q; one rounding in q's dtype, as the JAX route
    qs = (q.astype(jnp.float32) * st.scale).astype(q.dtype)
    return _padded(qs, lq_p), _padded(k, lkv_p), _padded(v, lkv_p), arrays, kernel_arrays, pos, lq_p


# call_jax keeps one output tree per function (the last traced), so each function returns the same
# structure in every specialization: the logged forward is its own function, and the backward
# always returns a dσ (zeros without sinks).


def _forward_core(q, k, v, sinks, buf, st: _Static):
    from . import splash as _splash

    qp, kp, vp, arrays, kernel_arrays, pos, _ = _operands(q, k, v, buf, st)
    o, lse_out, _, lse_raw = _splash.forward(st.cfg, qp, kp, vp, sinks, kernel_arrays)
    return o[:, :, : st.lq], lse_out[:, :, : st.lq], lse_raw, arrays, pos


def _jax_forward(q, k, v, sinks, buf, st: _Static):
    """O, the LSE (empty rows fixed) and Splash's own padded LSE (the backward's residual)."""
    return _forward_core(q, k, v, sinks, buf, st)[:3]


def _jax_forward_logged(q, k, v, sinks, buf, st: _Static):
    """:func:`_jax_forward`'s outputs and the per-head telemetry summary
    ``float32 [Hq, TELEMETRY_COLUMNS]`` of a logging step."""
    import jax

    from .splash_telemetry import summary

    o, lse_out, lse_raw, arrays, pos = _forward_core(q, k, v, sinks, buf, st)
    sg = jax.lax.stop_gradient
    stats = summary(sg(q), sg(k), sg(o), sg(lse_out), None if sinks is None else sg(sinks), arrays, pos,
                    block=st.block, batched=st.cfg.batched, scale=st.scale, softcap=st.cfg.softcap,
                    tel=st.tel)
    return o, lse_out, lse_raw, stats[..., 0] + stats[..., 1]


def _jax_backward(q, k, v, sinks, buf, o, lse_raw, do, dlse, st: _Static):
    """dQ, dK, dV (and dσ) from Splash's backward kernels, given the saved O and Splash's LSE."""
    import jax.numpy as jnp

    from . import splash as _splash

    qp, kp, vp, _, kernel_arrays, _, lq_p = _operands(q, k, v, buf, st)
    op, dop, dlsep = _padded(o, lq_p), _padded(do.astype(q.dtype), lq_p), _padded(dlse.astype(jnp.float32), lq_p)
    dq, dk, dv, dsinks = _splash.backward(st.cfg, qp, kp, vp, sinks, op, lse_raw, kernel_arrays, dop, dlsep)
    dq = (dq[:, :, : st.lq].astype(jnp.float32) * st.scale).astype(q.dtype)
    dk, dv = dk[:, :, : st.lkv].astype(k.dtype), dv[:, :, : st.lkv].astype(v.dtype)
    if dsinks is None:
        dsinks = jnp.zeros((q.shape[1],), jnp.float32)
    return dq, dk, dv, dsinks


# -- torch autograd ----------------------------------------------------------------------------------


def specializations() -> int:
    """How many graphs call_jax has lowered for this engine's functions in this process (a new
    one after warm-up would be a recompilation of Tessera's doing)."""
    try:
        import torch_xla.core.xla_builder as xb

        ours = {id(f) for f in (_jax_forward, _jax_forward_logged, _jax_backward)}
        return sum(len(c._cache) for (key, _), c in xb._JAX_TO_XLA_COMPUTATION_CACHE.items() if key in ours)
    except Exception:  # a torch_xla whose cache is laid out otherwise: unknown
        return -1


def _call_jax(fn, args: tuple, name: str):
    import torch_xla.core.xla_builder as xb

    return xb.call_jax(fn, args, {}, name)


class _Manual:
    """Manual SPMD sharding around the kernels (torch_xla SPMD with a global mesh): batch-major
    tensors are split over the mesh's first axis (``batch_axis``; replicated when the batch does
    not divide over it), everything else replicated; per-device partial sums (dσ, telemetry)
    come back stacked on a new leading axis and are reduced by ordinary, partitioned XLA ops."""

    def __init__(self, mesh: Any, batch: int) -> None:
        self.mesh = mesh
        n = int(mesh.mesh_shape[0])
        self.axis = (mesh.axis_names[0] if mesh.axis_names else 0) if batch % n == 0 else None
        self.parts = n if self.axis is not None else 1

    def _spec(self, t: Any, batch_major: bool) -> tuple:
        return ((self.axis if batch_major else None),) + (None,) * (t.dim() - 1)

    def enter(self, t: Any, batch_major: bool) -> Any:
        import torch_xla.distributed.spmd as xs

        if t is None:
            return None
        return xs.enable_manual_sharding(t, self._spec(t, batch_major), mesh=self.mesh).global_tensor

    def leave(self, t: Any, full_shape: Any) -> Any:
        import torch_xla.distributed.spmd as xs

        return xs.disable_manual_sharding(t, self._spec(t, True), full_shape, mesh=self.mesh).global_tensor

    def leave_partials(self, t: Any) -> Any:
        """A per-device partial ``[...]`` as ``[parts, ...]`` (one slice per batch shard)."""
        import torch_xla.distributed.spmd as xs

        t = t.unsqueeze(0)
        spec = (self.axis,) + (None,) * (t.dim() - 1)
        full = (self.parts,) + tuple(t.shape[1:])
        return xs.disable_manual_sharding(t, spec, full, mesh=self.mesh).global_tensor


def _reduce_stats(stacked: Any) -> Any:
    """Per-shard telemetry summaries ``[parts, Hq, C]`` merged exactly: sums of numerators and
    denominators, maxima of the two max columns (max logit, max |O|)."""
    import torch

    total = stacked.sum(0)
    mx = stacked.amax(0)
    col = torch.arange(stacked.shape[-1], device=stacked.device)
    is_max = (col == 4) | (col == 5)
    return torch.where(is_max, mx, total)


def _autograd():
    import torch

    class SplashXla(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, buf, st, manual):
            fn = _jax_forward if st.tel is None else _jax_forward_logged
            ins = (q, k, v, sinks, buf)
            if manual is not None:
                # the plan's tables are batch-major when they hold one row per batch row
                ins = tuple(manual.enter(t, i < 3 or (i == 4 and st.cfg.batched)) for i, t in enumerate(ins))
            outs = list(_call_jax(fn, ins + (st,), "tessera_splash_fwd"))
            # saved in the kernels' (per-device) shapes: the backward runs on the same shards
            ctx.save_for_backward(*ins, outs[0], outs[2])
            ctx.st, ctx.manual, ctx.has_sinks = st, manual, sinks is not None
            if manual is not None:
                outs[0] = manual.leave(outs[0], q.shape[:3] + v.shape[3:])
                outs[1] = manual.leave(outs[1], q.shape[:3])
                outs[2] = torch.zeros((), device=q.device)  # the residual stays inside
                if len(outs) > 3:
                    outs[3] = _reduce_stats(manual.leave_partials(outs[3]))
            ctx.mark_non_differentiable(*outs[2:])
            return tuple(outs)

        @staticmethod
        def backward(ctx, do, dlse, *_):
            q, k, v, sinks, buf, o, lse_raw = ctx.saved_tensors
            manual = ctx.manual
            if manual is not None:
                do = manual.enter(do, True)
                dlse = None if dlse is None else manual.enter(dlse, True)
            if dlse is None:
                dlse = torch.zeros(o.shape[:3], dtype=torch.float32, device=o.device)
            dq, dk, dv, dsinks = _call_jax(
                _jax_backward, (q, k, v, sinks, buf, o, lse_raw, do, dlse, ctx.st), "tessera_splash_bwd")
            if manual is not None:
                # the per-device shapes are known here only through the saved inputs
                dq = manual.leave(dq, (dq.shape[0] * manual.parts,) + tuple(dq.shape[1:]))
                dk = manual.leave(dk, (dk.shape[0] * manual.parts,) + tuple(dk.shape[1:]))
                dv = manual.leave(dv, (dv.shape[0] * manual.parts,) + tuple(dv.shape[1:]))
                dsinks = manual.leave_partials(dsinks).sum(0)
            return dq, dk, dv, (dsinks if ctx.has_sinks else None), None, None, None

    return SplashXla


_Fn = None


def _manual(q: Any) -> Optional[_Manual]:
    """The manual sharding to run the kernels under: under torch_xla SPMD with a global mesh
    (``xs.set_global_mesh``), else None (one device, or replicas of their own)."""
    try:
        import torch_xla.runtime as xr
        import torch_xla.distributed.spmd as xs
    except Exception:
        return None
    if not xr.is_spmd():
        return None
    mesh = xs.get_global_mesh()
    if mesh is None:
        return None
    return _Manual(mesh, int(q.shape[0]))


def attention(q, k, v, plan, *, scale: float, softcap: Optional[float], sinks: Any, return_lse: bool,
              telemetry: Any, layer: int, max_partial_blocks: Optional[int] = None):
    """``tessera.torch.attention`` on XLA tensors (``q [B, Hq, Lq, Dqk]`` ...), checked by the
    caller; raises ``ValueError`` naming the argument Splash cannot take."""
    global _Fn
    import torch

    problem = reasons(q, plan)
    if problem:
        name = "block" if any(p.startswith("block:") for p in problem) else "q"
        raise ValueError(f"{name}: engine='splash' cannot run this call: " + "; ".join(
            p[len("block: "):] if p.startswith("block: ") else p for p in problem))
    if sinks is not None and sinks.dtype not in (torch.float32, q.dtype):
        sinks = sinks.to(torch.float32)  # the logits' precision: float32 even beside bf16 q
    from .splash import _Cfg, _block_sizes

    dp = device_plan(plan, q.device, max_partial_blocks)
    tq, tk = dp.meta.block
    logging = telemetry is not None and telemetry.should_log()
    manual = _manual(q)
    cfg = _Cfg(_block_sizes(None, tq, tk), softcap, None, sinks is not None, dp.buf.shape[0] > 1)
    tel = None
    if logging:
        from ..core.telemetry import _TelConfig

        tel = _TelConfig(telemetry.every, **telemetry.config)
    spmd = None if manual is None else (str(manual.mesh), manual.axis)
    st = _Static(cfg, dp.layout, (tq, tk), float(scale), int(q.shape[2]), int(k.shape[2]), tel, spmd)
    if _Fn is None:
        _Fn = _autograd()
    outs = _Fn.apply(q, k, v, sinks, dp.buf, st, manual)
    o, lse = outs[0], outs[1]
    if logging:
        telemetry._record(layer, sinks is not None, outs[3], q.shape[0] * q.shape[2])
    return (o, lse) if return_lse else o
