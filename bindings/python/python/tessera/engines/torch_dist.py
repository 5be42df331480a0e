"""Context-parallel transport over ``torch.distributed`` (docs/semantics.md#many-ranks): the K/V exchange a rank's
rows need (all-gather, or one all-to-all of the needed tiles), dK/dV back to their owners, the
group checks, and collectives whose failures say which step failed. Shared by the context-
parallel paths of the torch engines; the sharding itself is :mod:`tessera.core.sharding`."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np
import torch

from .. import _tessera
from ..core.sharding import Sharding


# -- context parallelism ---------------------------------------------------------------------------


def comm_device(device: torch.device, group: Any) -> torch.device:
    """Where a collective's tensors live: gloo exchanges host tensors (a CUDA tensor over gloo is
    staged through the host), other backends the tensors' own device."""
    import torch.distributed as dist

    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device


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
    global row (docs/semantics.md#telemetry: the first ``sink_tokens`` keys of each document, or of the row) at the
    global positions of the local keys. Cached per (rank, mode, batch, sink_tokens)."""
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
