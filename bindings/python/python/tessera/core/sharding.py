"""Context-parallel shardings (docs/semantics.md#many-ranks), framework-free: which rank owns which query tiles of a
planned row, what each rank's rows cost, which K/V tiles it needs, and the cp-sim cost model.

:func:`shard` is a deterministic function of the plan, so every rank computes the same sharding
without a message. The torch frontend (:mod:`tessera.cp`) adds the ``torch.distributed`` helpers
(``scatter`` of tensors, ``gather``, ``index``); the JAX frontend reads the same object."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from .. import _tessera
from .args import _int_arg
from .plans import Plan


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

    # -- layout helpers (numpy; tessera.cp.Sharding adds torch tensors and the process's rank) --
    def scatter(self, x: Any, rank: int, dim: int = 1) -> Any:
        """``rank``'s slice of a whole-row array ``x`` (``[B, L, ...]`` with ``L`` at ``dim``)."""
        r = self._rank(rank)
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x: expected a numpy array, got {type(x).__name__}")
        _check_len("x", x.shape, dim, self.plan.shape[2])
        return np.take(x, self.positions(r), axis=dim)


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def _check_len(name: str, shape: Tuple[int, ...], dim: int, want: int, arg: str = "dim") -> None:
    """``shape[dim] == want`` (the row's tokens), else a ``ValueError`` that names ``x`` in the
    caller's terms (what is passed is q, k, v, labels, ...) and the axis that has ``want``."""
    if -len(shape) <= dim < len(shape) and shape[dim] == want:
        return
    found = f"length {shape[dim]}" if -len(shape) <= dim < len(shape) else "no such axis"
    fits = [i for i, n in enumerate(shape) if n == want]
    fix = (f"; axis {fits[0]} has {want}: pass {arg}={fits[0]}" if len(fits) == 1 else
           f"; pass {arg}= the axis of length {want}")
    raise ValueError(
        f"{name} (q, k, v or another whole-row array): expected length {want} (the row's "
        f"tokens) at {arg}={dim}, found {found} in shape {tuple(shape)}{fix} (q, k, v: {arg}=2 "
        f"for [B, H, L, D], {arg}=1 for [B, L, H, D])"
    )


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
    ``balance_cap`` times the mean (the best balance it finds when nothing is). Needs
    self-attention with square tiles and ``L`` a multiple of ``world_size · block``
    (``2 · world_size · block`` for zigzag): a ``ValueError`` says how far to pad otherwise."""
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


# -- balance and traffic model ---------------------------------------------------------------------


def doc_mix(
    length: int, seed: int = 0, *, median: float = 1000.0, sigma: float = 1.3,
    long_fraction: float = 0.3, long_docs: float = 0.0,
) -> np.ndarray:
    """Segment ids of one packed row of ``length`` tokens from the cp-sim mix: a lognormal body
    (``median`` tokens, ``sigma``, 64..32K−1) plus 32K–128K documents (capped at the row):
    ``long_fraction`` of the tokens first, then each further document long with probability
    ``long_docs`` (``long_fraction=0, long_docs=0.01``: the packed web-document mix);
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
