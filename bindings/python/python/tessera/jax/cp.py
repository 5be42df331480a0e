"""Context parallelism under ``shard_map`` (docs/semantics.md#many-ranks): a sharding's local plans as one pytree
(:class:`CPPlan`), the K/V exchange inside the SPMD program, dK/dV back to their owners, and
``scatter``/``gather`` of whole rows."""

from __future__ import annotations

import weakref
from typing import Any, List, NamedTuple, Optional

import numpy as np

from .. import _tessera
from ..core.args import layout_hint, layout_name
from ..core.plans import Plan
from ..core.sharding import Sharding, _check_len, _mode
from ..engines.native_xla import _join, _release_later, _split
from .op import LAYOUTS, attention
from .plans import PlanRef, _Meta, _meta, _register_pytrees
from .splash import splash_info
from .telemetry import Telemetry, reduce_summary


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
    needed tiles lands in what it receives); with ``splash=True`` also ``splash``, every rank's
    local plan as Splash ``MaskInfo`` stacked on a leading ``[R]`` axis (one stable shape: the
    partial blocks padded to a bound shared by the ranks) and its local keys' positions in their
    documents (``int32 [R, B' or 1, Lkv_local]``, for telemetry's sink keys), as a pair. Static:
    the local plans' shapes, the mode, ``M`` and ``N`` (powers of two, so new plans rarely
    change them), the tile and the world size. Any leaf may instead be passed sharded over the
    mesh axis (``[1, ...]`` per device)."""

    __slots__ = ("handles", "send", "recv", "splash", "aux", "_keep")

    def __init__(self, handles: Any, send: Any, recv: Any, splash: Any, aux: "_CPAux", keep: Any = None):
        self.handles, self.send, self.recv, self.splash, self.aux = handles, send, recv, splash, aux
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
    return (c.handles, c.send, c.recv, c.splash), c.aux


def _unflatten_cp(aux: _CPAux, children) -> CPPlan:
    return CPPlan(*children, aux)


def cp_plan(
    sharding: Any, mode: str = "allgather", *, splash: bool = False,
    max_partial_blocks: Optional[int] = None,
) -> CPPlan:
    """The :class:`CPPlan` of a ``tessera.cp`` sharding: every rank's local plan registered for
    the FFI (with its keys' global positions, so telemetry finds the sink keys), and for
    ``mode="needed"`` the tile routes of the padded ``all_to_all``. With ``splash=True`` it also
    carries every rank's local plan as Splash ``MaskInfo`` (what the Splash route, and so a step
    lowered for TPU, runs; ``max_partial_blocks`` bounds the partial blocks of every rank, by
    default the next power of two at or above the largest rank's count). Pass it as an argument
    of the jitted step: plans of equal shapes then share one compiled program."""
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding: expected a tessera.cp.Sharding, got {type(sharding).__name__}")
    mode = _mode(mode)
    if not isinstance(splash, bool):
        raise TypeError(f"splash: expected a bool, got {type(splash).__name__}")
    key = ("jax", mode, splash, max_partial_blocks)
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
    infos = None
    if splash:
        infos = (_stacked_splash_infos(local, max_partial_blocks), _local_sink_positions(glob, layouts))
    out = CPPlan(handles, send, recv, infos, aux, local)
    sharding._local[key] = out
    return out


def _stacked_splash_infos(local: List[Plan], bound: Optional[int]) -> Any:
    """The ranks' SplashInfos with one bound on partial blocks, stacked on a leading rank axis."""
    import jax

    from ..engines.splash import check_tiles

    check_tiles(*local[0].block)
    if bound is None:
        bound = max(splash_info(p).meta.max_partial_blocks for p in local)
    infos = [splash_info(p, max_partial_blocks=bound) for p in local]
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *infos)


def _local_sink_positions(glob: Plan, layouts: List[np.ndarray]) -> np.ndarray:
    """Each rank's local keys' positions in their documents (``-1`` for padding keys and for the
    padded slots of the needed layout), from the global row's: ``[R, B' or 1, Lkv_local]``."""
    from ..core.plans import sink_positions

    pos = sink_positions(glob)
    out = []
    for lay in layouts:
        lay = np.asarray(lay, dtype=np.int64)
        out.append(np.where(lay[None, :] >= 0, pos[:, np.maximum(lay, 0)], -1).astype(np.int32))
    return np.stack(out)


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
    backend: str = "auto",
) -> Any:
    """Exact attention over a row sharded by ``tessera.cp.shard``, inside ``shard_map`` over
    ``axis_name`` (docs/semantics.md#many-ranks): this device's ``q``, ``k``, ``v`` hold its tokens (the row put in
    sharded order by :func:`scatter`, then split evenly along L). ``sharding`` is a
    :class:`CPPlan` (:func:`cp_plan`, passed into the program: no recompile for new plans) or a
    ``tessera.cp.Sharding`` (its handles become constants of the trace). ``mode="allgather"``
    all-gathers K/V; ``mode="needed"`` moves only the tiles each rank's rows touch (one padded
    ``all_to_all``). Gradients: dQ stays local, dK/dV return to their owners (the transposes of
    the exchange), the sinks' gradient is summed over the devices. ``backend`` as
    :func:`attention`: ``"auto"`` runs the FFI route where the step is lowered for CPU and Splash
    where it is lowered for TPU (which needs ``cp_plan(..., splash=True)``); ``"ffi"`` or
    ``"splash"`` force one (Splash runs Pallas interpret mode off TPU). With ``telemetry`` the
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
                + layout_hint(name, tuple(getattr(t, "shape", ())), a.tokens_per_rank, layout)
            )
    kx = _exchange(k, cpp, axis_name, seq_axis)
    vx = _exchange(v, cpp, axis_name, seq_axis)
    info = pos = None
    if cpp.splash is not None:
        import jax

        info, pos = jax.tree_util.tree_map(lambda x: _my_row(jnp.asarray(x), a, axis_name), cpp.splash)
    elif backend == "splash":
        raise ValueError(
            "sharding: the Splash route needs the ranks' MaskInfo: tessera.jax.cp_plan(sh, mode, splash=True)")
    ref = PlanRef(_my_row(jnp.asarray(cpp.handles), a, axis_name), a.meta, info, None, pos)
    out = attention(
        q, kx, vx, ref, scale=scale, softcap=softcap, sinks=sinks, return_lse=return_lse,
        telemetry=telemetry, layer=layer, layout=layout, backend=backend,
    )
    if telemetry is None:
        return out
    import jax

    *main, summary = out
    summary = reduce_summary(jax.lax.stop_gradient(summary), axis_name)
    if telemetry.config.outlier_stream:
        o = jax.lax.stop_gradient(main[0])
        counts = _cp_outliers(o, telemetry.config.outlier_ratio, layout, axis_name)
        logging = summary[0, _tessera.TELEMETRY_COLUMNS + 1, 0] > 0  # devices reduced: 0 on quiet steps
        summary = summary.at[:, 8, :].set(jnp.where(logging, counts, 0.0))
    return tuple(main) + (summary,)


def _permutation(x: Any, sharding: Any, axis: int) -> np.ndarray:
    """The sharded order of ``sharding``, checked against ``x``'s length at ``axis``."""
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding: expected a tessera.cp.Sharding, got {type(sharding).__name__}")
    perm = sharding.permutation()
    _check_len("x", tuple(x.shape), axis, len(perm), arg="axis")
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


def _on_import() -> None:
    import jax

    jax.tree_util.register_pytree_node(CPPlan, _flatten_cp, _unflatten_cp)
    _register_pytrees()


_on_import()
