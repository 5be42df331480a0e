"""Context parallelism: a planned row sharded over the ranks of ``torch.distributed`` (docs/semantics.md#many-ranks).

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

import functools
import contextlib
from typing import Any, Optional

import numpy as np
import torch

from . import _tessera
from .core import sharding as _core
from .core.args import _int_arg, layout_hint
from .core.plans import Plan
from .core.sharding import MODES, SCHEMES, _check_len, _mode, doc_mix, simulate
from .engines import flex as _flex
from .engines.native_torch import _handle, _np
from .engines.torch_dist import (
    _check_group,
    _collective,
    _exchange_kv,
    _local_sink_flags,
    _return_grads,
    _verify,
    comm_device,
)
from .torch.op import _check, _scale_softcap
from .torch.telemetry import Telemetry, _CPPart


__all__ = ["Sharding", "shard", "attention", "simulate", "doc_mix", "SCHEMES", "MODES"]


class Sharding(_core.Sharding):
    """Which tokens each rank owns, what its rows cost, which K/V tiles it needs from whom
    (:class:`tessera.core.sharding.Sharding`), with the helpers that move torch tensors between
    whole rows and ranks (``index``, ``scatter``, ``gather`` over ``torch.distributed``).

    Made by :func:`shard`; a deterministic function of the plan, so every rank computes the same
    one. Rank ``r`` owns ``tokens_per_rank`` positions, ``positions(r)``, in ascending order."""

    # -- layout helpers (torch) --------------------------------------------------------------------------
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




@functools.wraps(_core.shard)
def shard(plan: Plan, world_size: int, scheme: str = "balanced", **model: Any) -> Sharding:
    sh = _core.shard(plan, world_size, scheme, **model)
    return Sharding(sh._s, sh.plan)


def _this_rank(sh: Sharding, rank: Optional[int]) -> int:
    if rank is not None:
        return sh._rank(rank)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("rank: torch.distributed is not initialized; pass rank= explicitly")
    return sh._rank(dist.get_rank())


def _logged_forward(sh, q, kl, vl, h, scale, softcap, sinks, rank, mode, group, tel, layer):
    """A logging step's local forward (the telemetry kernel, outputs bit-identical) and this
    rank's partial summary handed to ``tel``: the sink keys are the global row's, and the outlier
    count is left to the reduction (the threshold is the RMS of the whole ``(b, h)`` slice, which
    spans the ranks), which gets this rank's Σ o² per slice and its candidates."""
    import torch


    cfg = tel.config
    b = q.shape[0]
    flags = _local_sink_flags(sh, rank, mode, b, cfg["sink_tokens"])
    o, lse, _, stats = torch.ops.tessera.attention_fwd_logged(
        q, kl, vl, h, scale, softcap, sinks, cfg["sink_tokens"], cfg["outlier_ratio"],
        cfg["sink_stream"], cfg["outlier_stream"], flags,
    )
    part = None
    if cfg["outlier_stream"] and tel._groups:

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
    """Exact attention over a sharded row (docs/semantics.md#attention, docs/semantics.md#many-ranks): this rank's ``q [B, Hq, L/R, Dqk]``,
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
                + layout_hint(name, tuple(t.shape), sharding.tokens_per_rank, None)
            )
    lp = sharding.local_plan(rank, mode)
    kshape = (k.shape[0], k.shape[1], lp.shape[3], k.shape[3])
    # The shapes the local kernel will see, checked before any message is sent.
    _check(q, k.new_empty(1).expand(kshape), v.new_empty(1).expand(kshape[:3] + (v.shape[3],)), lp, sinks,
           flex=eng == "flex")
    scale, softcap = _scale_softcap(q, scale, softcap)
    if telemetry is not None:

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
    _verify(sharding, group, comm_device(q.device, group) if eng == "flex" else q.device)
    if eng == "flex":
        o, lse = _flex_cp_attention(q, k, v, sinks, sharding, group, rank, mode, scale, softcap)
        return (o, lse) if return_lse else o
    if _FN is None:
        _FN = _make_function()
    o, lse = _FN.apply(q, k, v, sinks, sharding, group, rank, mode, scale, softcap, telemetry, layer)
    return (o, lse) if return_lse else o


def _make_cp_function():

    class _CPFlex(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, sh, group, rank, mode, scale, softcap, grad):
            lp = sh.local_plan(rank, mode)
            dev = q.device
            via = comm_device(dev, group)
            kl, vl = _exchange_kv(sh, k.detach().to(via), v.detach().to(via), group, rank, mode)
            kl, vl = kl.to(dev), vl.to(dev)
            bm = _flex.block_mask(lp, dev)
            leaves = None
            with torch.enable_grad() if grad else contextlib.nullcontext():
                if grad:
                    leaves = [q.detach().requires_grad_(), kl.detach().requires_grad_(),
                              vl.detach().requires_grad_()]
                    if sinks is not None:
                        leaves.append(sinks.detach().requires_grad_())
                    qa, ka, va = leaves[:3]
                    sa = leaves[3] if sinks is not None else None
                else:
                    qa, ka, va, sa = q.detach(), kl, vl, None if sinks is None else sinks.detach()
                o, lse, _ = _flex.forward(qa, ka, va, bm, scale, softcap, sa, True)
            ctx.graph = (o, lse, leaves)
            ctx.meta = (sh, group, rank, mode, k.shape[2], sinks is not None)
            return o.detach(), lse.detach()

        @staticmethod
        def backward(ctx, d_o, d_lse):
            import torch.distributed as dist

            o, lse, leaves = ctx.graph
            sh, group, rank, mode, local_len, has_sinks = ctx.meta
            ctx.graph = None
            outs, grads = [o], [torch.zeros_like(o) if d_o is None else d_o]
            if d_lse is not None:
                outs.append(lse)
                grads.append(d_lse)
            g = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
            g = [torch.zeros_like(x) if gx is None else gx for gx, x in zip(g, leaves)]
            dq, dkl, dvl = g[:3]
            dev = dq.device
            via = comm_device(dev, group)
            dk, dv = _return_grads(sh, dkl.to(via), dvl.to(via), group, rank, mode, local_len)
            d_sinks = None
            if has_sinks:
                ds = g[3].to(via)
                # Every rank's rows add to the sink logits' gradient: the full sum on every rank.
                _collective("the dsinks all-reduce", lambda: dist.all_reduce(ds, group=group), group)
                d_sinks = ds.to(dev)
            return dq, dk.to(dev), dv.to(dev), d_sinks, None, None, None, None, None, None, None

    return _CPFlex


_CP: Any = None


def _flex_cp_attention(q, k, v, sinks, sh, group, rank, mode, scale, softcap):
    """``tessera.cp.attention`` with FlexAttention as the local kernel: the local plan's
    BlockMask over the exchanged K/V layout; dK/dV summed on their owners, dσ all-reduced."""
    global _CP
    _flex.check_grad(q, k, v, "tessera.cp.attention")
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, sinks)
    )
    if _CP is None:
        _CP = _make_cp_function()
    return _CP.apply(q, k, v, sinks, sh, group, rank, mode, scale, softcap, grad)
