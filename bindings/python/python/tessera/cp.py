"""Context parallelism: a planned row sharded over the ranks of ``torch.distributed`` (SPEC §11).

Example (every rank runs the same code)::

    import torch, torch.distributed as dist, tessera, tessera.cp
    dist.init_process_group("gloo")                       # NCCL when the tensors are on CUDA
    ids = ...                                             # segment ids of the packed row [L]
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H)
    sh = tessera.cp.shard(plan, dist.get_world_size())    # the same on every rank, no messages
    tokens, labels, pos = (sh.scatter(x) for x in (tokens, labels, pos))   # [B, L] -> [B, L/R]
    ...                                                   # embeddings, q/k/v projections
    out = tessera.cp.attention(q, k, v, sh)               # q [B, Hq, L/R, D] of this rank
    loss = ...; loss.backward()                           # dK/dV go back to their owners

A :class:`Sharding` gives every rank ``L / R`` tokens (whole tiles); :func:`attention` runs the
rank's rows of the plan against K/V gathered from all ranks (``mode="allgather"``) or only the
K/V tiles its rows touch (``mode="needed"``, one ``all_to_all_single``), and equals
single-process attention up to float summation order. The rows need ``L`` a multiple of
``R · block`` (``2R · block`` for zigzag): pad with ``-1`` segment ids (padding attends nowhere)
and mask the padded labels.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import Plan, _int_arg, _tessera

__all__ = ["Sharding", "shard", "attention", "simulate", "doc_mix", "SCHEMES", "MODES"]

SCHEMES = ("contiguous", "zigzag", "perdoc_zigzag", "balanced")
MODES = ("allgather", "needed")


class Sharding:
    """Which tokens each rank owns, what its rows cost, which K/V tiles it needs from whom.

    Made by :func:`shard`; a deterministic function of the plan, so every rank computes the same
    one. Rank ``r`` owns ``tokens_per_rank`` positions, ``positions(r)``, in ascending order."""

    def __init__(self, native: Any, plan: Plan) -> None:
        self._s = native
        self.plan = plan
        self._local: Dict[Tuple[int, str], Plan] = {}
        self._routes: Dict[Tuple[int, str], Any] = {}
        self._sink_flags: Dict[Tuple[int, str, int, int], Any] = {}
        # ids of the groups whose ranks were checked to hold the same sharding (None: world)
        self._verified: set = set()

    # -- what it is ------------------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return self._s.scheme

    @property
    def world_size(self) -> int:
        return self._s.world_size

    @property
    def block(self) -> int:
        """Tile side in tokens (tokens move between ranks in whole tiles)."""
        return self._s.tile

    @property
    def tokens_per_rank(self) -> int:
        return self._s.tokens_per_rank

    @property
    def fingerprint(self) -> str:
        """Hex digest of the plan contract, scheme, world size and assignment."""
        return self._s.fingerprint

    @property
    def costs(self) -> List[Dict[str, Any]]:
        """Per rank: ``pairs``, ``full_tiles``, ``partial_tiles``, ``forward_cost``,
        ``backward_cost`` (one full tile = 1), ``kv_tiles_needed``, ``kv_tiles_remote``,
        ``kv_remote_fraction`` (remote tiles over an all-gather's)."""
        return self._s.costs

    def imbalance(self) -> float:
        """Largest over mean per-rank modelled cost (1.0 is perfect balance)."""
        return self._s.imbalance()

    def kv_fraction(self) -> float:
        """The busiest receiver's K/V in ``needed`` mode over an all-gather's (0 for one rank)."""
        return self._s.kv_fraction()

    def owned(self, rank: int) -> np.ndarray:
        """The q tiles ``rank`` owns (global tile ids, ascending)."""
        return self._s.owned(self._rank(rank))

    def positions(self, rank: int) -> np.ndarray:
        """``rank``'s token positions in its local order (int64 ``[tokens_per_rank]``)."""
        return self._s.positions(self._rank(rank))

    def permutation(self) -> np.ndarray:
        """Every rank's positions, rank after rank (``x[..., perm]`` is the sharded order)."""
        return self._s.permutation()

    def needed(self, rank: int) -> List[np.ndarray]:
        """``needed(rank)[src]``: the K/V tiles ``rank``'s rows touch that ``src`` owns."""
        return self._s.needed(self._rank(rank))

    def clusters(self) -> np.ndarray:
        """``int64 [n, 2]`` tile ranges whose rows reach only each other (documents)."""
        return self._s.clusters()

    def local_plan(self, rank: int, mode: str = "allgather") -> Plan:
        """``rank``'s plan: its rows of the global plan against its local K/V in ``mode`` (all
        tiles in sharded order, or only the needed ones). Cached."""
        _mode(mode)
        key = (self._rank(rank), mode)
        p = self._local.get(key)
        if p is None:
            p = Plan(self._s.local_plan(key[0], mode))
            self._local[key] = p
        return p

    def local_kv_tiles(self, rank: int, mode: str = "allgather") -> np.ndarray:
        """The global K/V tiles of ``rank``'s local K/V in ``mode``, in local order."""
        return self._s.local_kv_tiles(self._rank(rank), _mode(mode))

    def __repr__(self) -> str:
        return (
            f"tessera.cp.Sharding(scheme={self.scheme!r}, world_size={self.world_size}, "
            f"tokens_per_rank={self.tokens_per_rank}, imbalance={self.imbalance():.3f}, "
            f"kv_fraction={self.kv_fraction():.3f})"
        )

    def _rank(self, rank: int) -> int:
        return _int_arg("Sharding", "rank", rank, 0, self.world_size)

    # -- layout helpers --------------------------------------------------------------------------
    def index(self, rank: Optional[int] = None, device: Any = None):
        """``rank``'s positions as an int64 torch tensor (default: this process's rank)."""
        import torch

        r = _this_rank(self, rank)
        return torch.as_tensor(self.positions(r), dtype=torch.int64, device=device)

    def scatter(self, x: Any, rank: Optional[int] = None, dim: int = 1) -> Any:
        """``rank``'s slice of a whole-row tensor ``x`` (``[B, L, ...]`` with ``L`` at ``dim``):
        inputs, labels, position ids, in the rank's local order. numpy arrays give numpy."""
        r = _this_rank(self, rank)
        idx = self.positions(r)
        length = self.plan.shape[2]
        if isinstance(x, np.ndarray):
            _check_len("x", x.shape, dim, length)
            return np.take(x, idx, axis=dim)
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor or numpy array, got {type(x).__name__}")
        _check_len("x", tuple(x.shape), dim, length)
        return x.index_select(dim, torch.as_tensor(idx, device=x.device))

    def gather(self, x: Any, group: Any = None, dim: int = 1) -> Any:
        """The whole row back from per-rank pieces: ``x`` is this rank's ``[B, L/R, ...]`` piece
        (all-gathered over ``group``; not differentiable) or a list of every rank's pieces."""
        import torch

        if isinstance(x, (list, tuple)):
            if len(x) != self.world_size:
                raise ValueError(f"x: expected {self.world_size} pieces, got {len(x)}")
            pieces = list(x)
        else:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"x: expected a torch.Tensor or a list, got {type(x).__name__}")
            import torch.distributed as dist

            _check_group(self, group)
            pieces = [torch.empty_like(x) for _ in range(self.world_size)]
            _collective("gather", lambda: dist.all_gather(pieces, x.contiguous(), group=group), group)
        for i, p in enumerate(pieces):
            _check_len(f"x[{i}]", tuple(p.shape), dim, self.tokens_per_rank)
        cat = torch.cat([torch.as_tensor(p) for p in pieces], dim=dim)
        inv = np.empty(self.plan.shape[2], dtype=np.int64)
        inv[self.permutation()] = np.arange(self.plan.shape[2])
        return cat.index_select(dim, torch.as_tensor(inv, device=cat.device))


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def _check_len(name: str, shape: Tuple[int, ...], dim: int, want: int) -> None:
    if not -len(shape) <= dim < len(shape) or shape[dim] != want:
        raise ValueError(f"{name}: expected length {want} at dim {dim}, got shape {shape}")


def _this_rank(sh: Sharding, rank: Optional[int]) -> int:
    if rank is not None:
        return sh._rank(rank)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("rank: torch.distributed is not initialized; pass rank= explicitly")
    return sh._rank(dist.get_rank())


def shard(
    plan: Plan,
    world_size: int,
    scheme: str = "balanced",
    *,
    partial_overhead: float = 0.3,
    backward: float = 2.5,
    balance_cap: float = 1.02,
) -> Sharding:
    """Shards ``plan``'s row over ``world_size`` ranks with ``scheme`` (``contiguous``,
    ``zigzag``, ``perdoc_zigzag`` or ``balanced``). ``partial_overhead`` and ``backward`` are the
    cost model (a partial tile costs ``partial_overhead + (1 - partial_overhead) · allowed
    fraction`` of a full one; backward ``backward`` times forward). ``balanced`` gives the busiest
    rank's ``needed``-mode K/V the fewest tiles it can while the busiest rank's cost stays within
    ``balance_cap`` times the mean (the best balance it finds when nothing is). Needs self-attention with square
    tiles and ``L`` a multiple of ``world_size · block`` (``2 · world_size · block`` for zigzag):
    a ``ValueError`` says how far to pad otherwise."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    world_size = _int_arg("shard", "world_size", world_size, 1, 2**20)
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: expected a str, got {type(scheme).__name__}")
    for name, v in (("partial_overhead", partial_overhead), ("backward", backward),
                    ("balance_cap", balance_cap)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    return Sharding(
        _tessera.shard(plan._p, world_size, scheme, float(partial_overhead), float(backward),
                       float(balance_cap)),
        plan,
    )


# -- distributed attention --------------------------------------------------------------------------


def _collective(what: str, fn: Any, group: Any) -> Any:
    """Runs a collective, turning a failure (a dead peer, a timeout) into one clear error."""
    import torch.distributed as dist

    try:
        return fn()
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on peer loss
        rank = dist.get_rank(group) if dist.is_initialized() else -1
        raise RuntimeError(
            f"tessera.cp: {what} failed on rank {rank}: a peer rank died, timed out "
            f"(the process group's timeout) or called a different collective: {e}"
        ) from e


def _check_group(sh: Sharding, group: Any) -> Tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialized (init_process_group first)")
    ws = dist.get_world_size(group)
    if ws != sh.world_size:
        raise ValueError(f"sharding: made for world_size {sh.world_size}, but the group has {ws} ranks")
    return dist.get_rank(group), ws


def _verify(sh: Sharding, group: Any, device: Any) -> None:
    """Every rank compares fingerprints once per (sharding, group): a rank that sharded a different
    plan (or scheme) raises on every rank, before any exchange could hang or mix data."""
    import torch
    import torch.distributed as dist

    key = None if group is None else id(group)
    if key in sh._verified:
        return
    words = np.frombuffer(bytes.fromhex(sh.fingerprint), dtype=np.int64).copy()
    mine = torch.as_tensor(words, device=device)
    got = [torch.empty_like(mine) for _ in range(sh.world_size)]
    _collective("the sharding fingerprint exchange", lambda: dist.all_gather(got, mine, group=group), group)
    bad = [r for r, g in enumerate(got) if not torch.equal(g.cpu(), mine.cpu())]
    if bad:
        raise ValueError(
            f"sharding: ranks {bad} sharded a different plan, scheme or world size than rank "
            f"{dist.get_rank(group)} (fingerprint {sh.fingerprint[:16]}...): every rank must "
            "shard the same plan"
        )
    sh._verified.add(key)


def _routes(sh: Sharding, rank: int, mode: str):
    """For ``needed`` mode: the local rows this rank sends to each rank (in the receivers' order)
    and the row counts sent / received per rank."""
    import torch

    key = (rank, mode)
    r = sh._routes.get(key)
    if r is not None:
        return r
    t = sh.block
    owner = np.empty(sh.plan.shape[2] // t, dtype=np.int64)
    local_of = np.empty_like(owner)
    for s in range(sh.world_size):
        o = sh.owned(s)
        owner[o] = s
        local_of[o] = np.arange(len(o))
    send_rows, send_counts, recv_counts = [], [], []
    mine = sh.local_kv_tiles(rank, mode)
    for s in range(sh.world_size):
        theirs = sh.local_kv_tiles(s, mode)
        to_s = theirs[owner[theirs] == rank]  # tiles rank s wants from me, in its order
        send_rows.append((local_of[to_s][:, None] * t + np.arange(t)[None, :]).reshape(-1))
        send_counts.append(len(to_s) * t)
        recv_counts.append(int((owner[mine] == s).sum()) * t)
    idx = torch.as_tensor(np.concatenate(send_rows), dtype=torch.int64)
    r = (idx, send_counts, recv_counts)
    sh._routes[key] = r
    return r


def _pack(k, v):
    """K and V ``[B, H, Lr, D]`` as one ``[Lr, B·H·(Dk + Dv)]`` buffer (one message for both)."""
    import torch

    lr = k.shape[2]
    return torch.cat([k.permute(2, 0, 1, 3).reshape(lr, -1), v.permute(2, 0, 1, 3).reshape(lr, -1)], 1)


def _unpack(buf, kshape, vshape):
    """Views ``[B, H, L, D]`` of K and V in a packed buffer (unit stride in D: read in place)."""
    b, h, _, dk = kshape
    dv = vshape[3]
    n = buf.shape[0]
    nk = b * h * dk
    k = buf[:, :nk].reshape(n, b, h, dk).permute(1, 2, 0, 3)
    v = buf[:, nk:].reshape(n, b, h, dv).permute(1, 2, 0, 3)
    return k, v


def _exchange_kv(sh: Sharding, k, v, group, rank: int, mode: str):
    import torch
    import torch.distributed as dist

    buf = _pack(k, v)
    if mode == "allgather":
        parts = [torch.empty_like(buf) for _ in range(sh.world_size)]
        _collective("the K/V all-gather", lambda: dist.all_gather(parts, buf, group=group), group)
        full = torch.cat(parts, 0)
    else:
        idx, send, recv = _routes(sh, rank, mode)
        out = buf.new_empty((sum(recv), buf.shape[1]))
        src = buf.index_select(0, idx.to(buf.device))
        _collective(
            "the K/V all-to-all",
            lambda: dist.all_to_all_single(out, src, recv, send, group=group),
            group,
        )
        full = out
    return _unpack(full, k.shape, v.shape)


def _return_grads(sh: Sharding, dk, dv, group, rank: int, mode: str, local_len: int):
    """dK/dV of the local K/V layout back to the owners, summed there (a reduce-scatter)."""
    import torch
    import torch.distributed as dist

    buf = _pack(dk, dv)
    width = buf.shape[1]
    if mode == "allgather":
        out = buf.new_empty((sh.world_size * local_len, width))
        _collective(
            "the dK/dV reduce-scatter",
            lambda: dist.all_to_all_single(out, buf.contiguous(), group=group),
            group,
        )
        total = out.view(sh.world_size, local_len, width).sum(0)
    else:
        idx, send, recv = _routes(sh, rank, mode)
        out = buf.new_empty((sum(send), width))
        _collective(
            "the dK/dV all-to-all",
            lambda: dist.all_to_all_single(out, buf.contiguous(), send, recv, group=group),
            group,
        )
        total = buf.new_zeros((local_len, width)).index_add_(0, idx.to(buf.device), out)
    return _unpack(total, dk.shape[:2] + (local_len,) + dk.shape[3:], dv.shape[:2] + (local_len,) + dv.shape[3:])


def _local_sink_flags(sh: Sharding, rank: int, mode: str, batch: int, sink_tokens: int):
    """Sink-key flags ``bool [B, Lkv_local]`` of ``rank``'s local K/V in ``mode``: the flags of the
    global row (SPEC §6: the first ``sink_tokens`` keys of each document, or of the row) at the
    global positions of the local keys. Cached per (rank, mode, batch, sink_tokens)."""
    import torch

    key = (rank, mode, batch, sink_tokens)
    f = sh._sink_flags.get(key)
    if f is None:
        flags = _tessera.telemetry_sink_flags(sh.plan._p, batch, sink_tokens)  # [B, L]
        t = sh.block
        tiles = sh.local_kv_tiles(rank, mode)
        pos = (tiles[:, None] * t + np.arange(t)[None, :]).reshape(-1)
        f = torch.from_numpy(np.ascontiguousarray(flags[:, pos]))
        sh._sink_flags[key] = f
    return f


def _logged_forward(sh, q, kl, vl, h, scale, softcap, sinks, rank, mode, group, tel, layer):
    """A logging step's local forward (the telemetry kernel, outputs bit-identical) and this
    rank's partial summary handed to ``tel``: the sink keys are the global row's, and the outlier
    count is left to the reduction (the threshold is the RMS of the whole ``(b, h)`` slice, which
    spans the ranks), which gets this rank's Σ o² per slice and its candidates."""
    import torch

    from ._telemetry import _CPPart

    cfg = tel.config
    b = q.shape[0]
    flags = _local_sink_flags(sh, rank, mode, b, cfg["sink_tokens"])
    o, lse, _, stats = torch.ops.tessera.attention_fwd_logged(
        q, kl, vl, h, scale, softcap, sinks, cfg["sink_tokens"], cfg["outlier_ratio"],
        cfg["sink_stream"], cfg["outlier_stream"], flags,
    )
    part = None
    if cfg["outlier_stream"] and tel._groups:
        from .torch import _np

        slice_len = sh.plan.shape[2] * o.shape[3]
        sq, counts, cand = _tessera.outlier_candidates(_np(o), slice_len, cfg["outlier_ratio"])
        part = _CPPart(
            torch.from_numpy(sq), torch.from_numpy(counts), torch.from_numpy(cand), slice_len,
            tel._cp_members(group),
        )
    tel._record(layer, sinks is not None, stats, b * q.shape[2], part)
    return o, lse


def _make_function():
    import torch

    from .torch import _handle

    class _CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, sh, group, rank, mode, scale, softcap, tel, layer):
            lp = sh.local_plan(rank, mode)
            kl, vl = _exchange_kv(sh, k.detach(), v.detach(), group, rank, mode)
            h = _handle(lp)
            if tel is not None and tel.should_log():
                o, lse = _logged_forward(
                    sh, q.detach(), kl, vl, h, scale, softcap, sinks, rank, mode, group, tel, layer
                )
            else:
                o, lse, _ = torch.ops.tessera.attention_fwd(q.detach(), kl, vl, h, scale, softcap, sinks)
            ctx.save_for_backward(q, kl, vl, o, lse, sinks)
            ctx.meta = (sh, group, rank, mode, scale, softcap, lp, k.shape[2])
            return o, lse

        @staticmethod
        def backward(ctx, d_o, d_lse):
            import torch.distributed as dist

            q, kl, vl, o, lse, sinks = ctx.saved_tensors
            sh, group, rank, mode, scale, softcap, lp, local_len = ctx.meta
            if d_o is None:
                d_o = torch.zeros_like(o)
            dq, dkl, dvl, dsinks = torch.ops.tessera.attention_bwd(
                q.detach(), kl, vl, o, lse, d_o.contiguous(), d_lse, _handle(lp), scale, softcap, sinks
            )
            dk, dv = _return_grads(sh, dkl, dvl, group, rank, mode, local_len)
            d_sinks = None
            if sinks is not None:
                # Every rank's rows add to the sink logits' gradient: the full sum on every rank.
                _collective("the dsinks all-reduce", lambda: dist.all_reduce(dsinks, group=group), group)
                d_sinks = dsinks.to(sinks.dtype)
            return dq, dk.to(q.dtype), dv.to(q.dtype), d_sinks, None, None, None, None, None, None, None, None

    return _CPAttention


_FN: Any = None


def attention(
    q: Any,
    k: Any,
    v: Any,
    sharding: Sharding,
    group: Any = None,
    *,
    mode: str = "allgather",
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Any = None,
    return_lse: bool = False,
    telemetry: Any = None,
    layer: int = 0,
    engine: str = "auto",
) -> Any:
    """Exact attention over a sharded row (SPEC §4, §11): this rank's ``q [B, Hq, L/R, Dqk]``,
    ``k [B, Hkv, L/R, Dqk]``, ``v [B, Hkv, L/R, Dv]`` (its tokens, :meth:`Sharding.scatter` order),
    with the options of :func:`tessera.torch.attention`. Returns this rank's ``O`` (and ``LSE``).

    ``mode="allgather"`` all-gathers K/V; ``mode="needed"`` receives only the K/V tiles this
    rank's rows touch (``all_to_all_single``). Backward: dQ stays local, dK/dV are summed back on
    their owners, the sinks gradient is all-reduced (every rank holds the full gradient). The
    first call per (sharding, group) checks that every rank sharded the same plan. Collectives use
    the group's backend (gloo for CPU tensors, NCCL for CUDA ones). ``engine`` as in
    :func:`tessera.torch.attention`: the local kernel is Tessera's CPU kernel for CPU tensors and
    FlexAttention over the local plan's BlockMask on other devices (``"flex"`` forces it; on CPU
    forward only); CUDA tensors over a gloo group are exchanged through the host.

    ``telemetry`` (a :class:`tessera.Telemetry` whose ``group`` holds ``group``, with the DP group
    if any) and ``layer``: on a logging step this rank's rows contribute their partial summary
    (sink keys of the global row, the outlier count against the whole ``(b, h)`` slice's RMS), and
    the records ``telemetry.read()`` reduces equal those of one process attending over the whole
    row. Non-logging steps run the plain kernel and add no work or message. (Telemetry on the
    FlexAttention engine across ranks is not wired yet: a clear ``NotImplementedError``.)"""
    global _FN
    import torch

    from . import _flex
    from .torch import _check, _scale_softcap

    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding: expected a tessera.cp.Sharding, got {type(sharding).__name__}")
    _mode(mode)
    eng = _flex.engine_for(engine, q)
    rank, _ = _check_group(sharding, group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[2] != sharding.tokens_per_rank:
            raise ValueError(
                f"{name}: expected this rank's [B, H, {sharding.tokens_per_rank}, D], "
                f"got shape {tuple(t.shape)}"
            )
    lp = sharding.local_plan(rank, mode)
    kshape = (k.shape[0], k.shape[1], lp.shape[3], k.shape[3])
    # The shapes the local kernel will see, checked before any message is sent.
    _check(q, k.new_empty(1).expand(kshape), v.new_empty(1).expand(kshape[:3] + (v.shape[3],)), lp, sinks,
           flex=eng == "flex")
    scale, softcap = _scale_softcap(q, scale, softcap)
    if telemetry is not None:
        from ._telemetry import Telemetry

        if not isinstance(telemetry, Telemetry):
            raise TypeError(f"telemetry: expected a tessera.Telemetry, got {type(telemetry).__name__}")
        layer = _int_arg("attention", "layer", layer, 0, 2**32)
        if telemetry._groups:
            telemetry._cp_members(group)  # the CP group must lie within the telemetry's
        elif sharding.world_size > 1:
            raise ValueError(
                "telemetry: a Telemetry without group= would read this rank's rows as if they "
                "were the whole row; pass Telemetry(group=...) with the CP group (and the DP "
                "group, if any)"
            )
        if eng == "flex":
            raise NotImplementedError(
                "telemetry: tessera.cp.attention on the FlexAttention engine does not log "
                "telemetry across ranks yet; log from the Tessera engine (CPU tensors)"
            )
    _verify(sharding, group, _flex.comm_device(q.device, group) if eng == "flex" else q.device)
    if eng == "flex":
        o, lse = _flex.cp_attention(q, k, v, sinks, sharding, group, rank, mode, scale, softcap)
        return (o, lse) if return_lse else o
    if _FN is None:
        _FN = _make_function()
    o, lse = _FN.apply(q, k, v, sinks, sharding, group, rank, mode, scale, softcap, telemetry, layer)
    return (o, lse) if return_lse else o


# -- balance and traffic model ---------------------------------------------------------------------


def doc_mix(
    length: int, seed: int = 0, *, median: float = 1000.0, sigma: float = 1.3,
    long_fraction: float = 0.3, long_docs: float = 0.0,
) -> np.ndarray:
    """Segment ids of one packed row of ``length`` tokens from the cp-sim mix: a lognormal body
    (``median`` tokens, ``sigma``, 64..32K−1) plus 32K–128K documents (capped at the row):
    ``long_fraction`` of the tokens first, then each further document long with probability
    ``long_docs`` (``long_fraction=0, long_docs=0.01``: issue 41's packed web documents);
    shuffled; seeded."""
    length = _int_arg("doc_mix", "length", length, 1, 2**40)
    seed = _int_arg("doc_mix", "seed", seed, 0, 2**64)
    for name, v in (("median", median), ("sigma", sigma), ("long_fraction", long_fraction),
                    ("long_docs", long_docs)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    return _tessera.doc_mix(length, seed, float(median), float(sigma), float(long_fraction),
                            float(long_docs))


def simulate(
    lengths: Sequence[int] = (128 * 1024, 512 * 1024, 1024 * 1024),
    ranks: Sequence[int] = (2, 4, 8, 16, 32),
    *,
    seed: int = 0,
    flops: float = 400e12,
    link_gbps: float = 50.0,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block: int = 128,
    mix: str = "tokens",
    balance_cap: float = 1.02,
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The ``tessera cp-sim`` model: for the doc-causal row of each length (:func:`doc_mix`), every
    scheme at every world size: max/mean per-rank cost, pairs and tiles, extra tile work, K/V bytes
    received per rank (all-gather; needed max and mean; ``needed_fraction_max``: the busiest
    receiver's over an all-gather's), modelled step times. ``mix``: ``"tokens"`` (30 % of the
    tokens in long documents) or ``"web"`` (1 % of documents long). Returns
    ``(rows, assumptions)``."""
    ls = [_int_arg("simulate", "lengths", n, 1, 2**40) for n in lengths]
    rs = [_int_arg("simulate", "ranks", r, 1, 2**20) for r in ranks]
    return _tessera.simulate(ls, rs, seed, float(flops), float(link_gbps), heads, kv_heads, head_dim,
                             block, mix, float(balance_cap))
