"""Gated attention telemetry from Python (docs/semantics.md#telemetry), on one process or reduced across ranks.

``Telemetry(every=N)`` decides per step whether attention calls log. On a logging step
``tessera.torch.attention(..., telemetry=tel, layer=i)`` (or ``tessera.cp.attention``) runs the
kernel's telemetry variant (outputs bit-identical to the plain kernel) and keeps the step's
per-head summary as a small fixed-shape tensor; nothing is read on the host inside the step.
``tel.read()`` does the one deferred read and returns the records (sink mass, sink rate,
learned-sink mass, entropy, max logit, output max/RMS/outlier counts per head, and ``ranks`` and
``tokens``: how many ranks and query rows the record covers); ``tel.write_jsonl(path)`` appends
them in the JSON-lines schema ``tessera telemetry plot`` reads. Both drain: what one returns or
writes, the next does not. Call ``tel.advance()`` once per step, after its attention calls: one
record per (step, layer), merging that layer's calls of the step (a layer recorded twice in a
step warns once, ``TelemetryWarning``: a forgotten ``advance()`` folds steps).

Across ranks (``group=``, docs/semantics.md#many-ranks, docs/semantics.md#engines-and-devices): the per-rank partials never reach the host. ``read()`` is
collective: the partials of every logged layer are packed into one buffer per reduction kind and
reduced on the tensors' device over the group(s) -- one all-reduce MAX (max logit, max |O|, the
per-(b, h) Σ O² of context-parallel calls), then one all-reduce SUM (row counts, Σ sink mass,
Σ learned-sink mass, Σ entropy, Σ O², element and outlier counts, tokens, ranks) -- and only the
reduced buffers are read. Means, rates, entropy and RMS are made from the summed numerators and
denominators, never from per-rank averages; context-parallel outliers are counted against the
RMS of the whole ``(b, h)`` slice (see ``docs/telemetry.md``, "Across ranks").
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _tessera
from ..core.telemetry import checked_config, warn_folded


# Columns of the SUM buffer per head: the stats row's sums plus two NaN flags.
#   0 valid rows, 1 Σ sink mass, 2 Σ learned-sink mass, 3 Σ entropy, 4 Σ O², 5 O elements,
#   6 outliers, 7 NaN max-logit flags, 8 NaN max|O| flags
_SUM_COLS = 9


class _Entry:
    """One logged attention call's partial summary (private: never read on the host unreduced).
    Made at the read from the tuple the call appended (a tuple keeps ``_record`` traceable by
    ``torch.compile``)."""

    __slots__ = ("step", "layer", "learned_sinks", "stats", "tokens", "cp")

    def __init__(self, t: tuple) -> None:
        self.step, self.layer, self.learned_sinks, self.stats, self.tokens, self.cp = t


class _CPPart:
    """What a context-parallel call keeps for its exact outlier count: this rank's Σ o² per
    (b, h) slice ``[B, Hq]``, the ``|o|`` above this rank's lower bound of the slice's threshold
    (``cand``, ``counts [B, Hq]`` per slice), the whole slice's element count, and the union-group
    ranks of the call's CP group (whose Σ o² add up to the slice's)."""

    __slots__ = ("sq", "counts", "cand", "slice_len", "members")

    def __init__(self, sq: Any, counts: Any, cand: Any, slice_len: int, members: Tuple[int, ...]):
        self.sq = sq
        self.counts = counts
        self.cand = cand
        self.slice_len = slice_len
        self.members = members


def _as_groups(group: Any) -> Tuple[Any, ...]:
    if group is None:
        return ()
    if isinstance(group, (list, tuple)):
        groups = tuple(group)
        if not groups:
            raise ValueError("group: expected a process group or a non-empty sequence of them")
    else:
        groups = (group,)
    try:
        from torch.distributed import ProcessGroup
    except Exception as e:  # pragma: no cover - torch without distributed
        raise ValueError(f"group: torch.distributed is not available ({e})") from e
    for i, g in enumerate(groups):
        if not isinstance(g, ProcessGroup):
            raise TypeError(
                f"group: expected a torch.distributed ProcessGroup (or several), got "
                f"{type(g).__name__}" + (f" at index {i}" if len(groups) > 1 else "")
            )
    return groups


def _group_timeout(g: Any) -> timedelta:
    """The timeout ``g`` was created with (the default process-group timeout if unknown)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    try:
        dev = "cuda" if "nccl" in str(dist.get_backend(g)).lower() else "cpu"
        t = g._get_backend(torch.device(dev)).options._timeout
        if isinstance(t, timedelta):
            return t
    except Exception:
        pass
    return c10d.default_pg_timeout


class Telemetry:
    """Attach once, log every ``every`` steps (``every=0``: never).

    ``group``: ``None`` (one process), or a ``torch.distributed`` process group, or several (for
    example this rank's CP group and its DP group): the records then cover every rank the groups
    connect (the whole CP x DP grid), reduced on device before the one host read, and
    :meth:`read` / :meth:`write_jsonl` are collective. Every one of those ranks constructs its
    ``Telemetry`` with its own groups at the same point (the constructor makes the telemetry's own
    process group over them, with the given groups' timeout: a collective of those ranks), logs
    the same layers at the same steps, and calls ``read`` / ``write_jsonl`` at the same cadence;
    the ranks must hold distinct rows (CP: each its own query rows; DP: its own batch)."""

    def __init__(
        self,
        every: int = 100,
        *,
        group: Any = None,
        sink_tokens: int = 1,
        epsilon: float = 0.3,
        outlier_ratio: float = 6.0,
        streams: Sequence[str] = ("sink", "outlier"),
    ) -> None:
        every, self.config = checked_config(every, sink_tokens, epsilon, outlier_ratio, streams)
        groups = _as_groups(group)
        self.every = every
        self.step = 0
        self._pending: List[tuple] = []
        # (step, layer) recorded since the last advance(); a repeat means calls were folded into
        # one record, said once (warnings are raised outside compiled code: see _warn_folded).
        self._recorded: set = set()
        self._folded: Optional[Tuple[int, int]] = None
        self._warned: set = set()
        # Steps are the same on every rank (lockstep): whether a logging step happened since the
        # last read (at step `_read_at`) decides, identically on every rank, whether a read
        # reduces at all.
        self._read_at = -1
        self._groups = groups
        self._pg: Any = None
        self._ranks: Tuple[int, ...] = ()
        self._timeout: Optional[timedelta] = None
        self._members: Dict[int, Tuple[int, ...]] = {}
        if groups:
            self._make_group()

    # -- the group ---------------------------------------------------------------------------------
    @property
    def group(self) -> Any:
        """The process group(s) the records are reduced over (``None`` on one process)."""
        if not self._groups:
            return None
        return self._groups[0] if len(self._groups) == 1 else self._groups

    def _make_group(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group: torch.distributed is not initialized (init_process_group first)")
        me = dist.get_rank()
        span: set = set()
        for i, g in enumerate(self._groups):
            ranks = dist.get_process_group_ranks(g)
            if me not in ranks:
                raise ValueError(f"group: this rank ({me}) is not a member of group {i} (ranks {ranks})")
            span.update(ranks)
        if len(self._groups) > 1:
            # Several groups (CP and DP, ...): the records cover every rank they connect (the
            # whole CP x DP grid), not only this rank's own groups. One pass of exchanges over
            # each group spans a grid; a second checks that every rank found the same ranks.
            for g in self._groups:
                got: List[Any] = [None] * dist.get_world_size(g)
                dist.all_gather_object(got, sorted(span), group=g)
                for x in got:
                    span.update(x)
            for i, g in enumerate(self._groups):
                got = [None] * dist.get_world_size(g)
                dist.all_gather_object(got, sorted(span), group=g)
                if any(set(x) != span for x in got):
                    raise ValueError(
                        f"group: the groups do not span one grid of ranks (ranks of group {i} "
                        f"found different spans: {sorted(map(tuple, got))}); pass groups that "
                        "together cover each rank's CP x DP grid"
                    )
        self._ranks = tuple(sorted(span))
        self._timeout = min(_group_timeout(g) for g in self._groups)
        # The telemetry's own group over those ranks: its collectives never interleave with the
        # training step's (a rank that skips a read cannot be matched with another collective),
        # and it carries the given groups' timeout. Only those ranks take part.
        self._pg = dist.new_group(
            list(self._ranks), timeout=self._timeout, use_local_synchronization=True
        )

    def _cp_members(self, cp_group: Any) -> Tuple[int, ...]:
        """The ranks (in the telemetry group) of a context-parallel call's group, which must lie
        within the telemetry's groups."""
        import torch.distributed as dist

        key = id(cp_group)
        got = self._members.get(key)
        if got is None:
            ranks = dist.get_process_group_ranks(cp_group if cp_group is not None else dist.group.WORLD)
            outside = [r for r in ranks if r not in self._ranks]
            if outside:
                raise ValueError(
                    f"telemetry: the context-parallel group (ranks {ranks}) is not within the "
                    f"telemetry's group (ranks {list(self._ranks)}): pass the CP group to "
                    "Telemetry(group=...), with the DP group if there is one"
                )
            got = tuple(self._ranks.index(r) for r in ranks)
            self._members[key] = got
        return got

    # -- gating ------------------------------------------------------------------------------------
    def should_log(self) -> bool:
        """Whether attention calls of the current step log."""
        return self.every > 0 and self.step % self.every == 0

    def advance(self) -> None:
        """Moves to the next step: call it once per training step, after the step's attention
        calls. Records are per (step, layer): calls of one layer between two ``advance()`` are
        merged into one record (a ``TelemetryWarning`` says so once)."""
        self._warn_folded()
        self._recorded.clear()
        self.step += 1

    def _record(self, layer: int, learned_sinks: bool, stats: Any, tokens: int = 0, cp: Any = None) -> None:
        key = (self.step, int(layer))
        if key in self._recorded:
            self._folded = key
            # warnings.warn breaks a torch.compile(fullgraph=True) trace: a compiled step only
            # notes the repeat, and advance() or read() (eager) say it.
            import torch

            if not torch.compiler.is_compiling():
                self._warn_folded(3)  # the user's attention(...) call
        self._recorded.add(key)
        self._pending.append((self.step, int(layer), bool(learned_sinks), stats, int(tokens), cp))

    def _warn_folded(self, stacklevel: int = 2) -> None:
        if self._folded is not None:
            warn_folded(self._warned, *self._folded,
                        "Call tel.advance() once per training step, after its attention calls.",
                        stacklevel + 1)

    def _check_not_per_rank(self) -> None:
        """A Telemetry without a group in a job of several ranks would read one rank's slice as if
        it were the whole: refused."""
        if self._groups:
            return
        try:
            import torch.distributed as dist

            n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        except Exception:
            n = 1
        if n > 1:
            raise ValueError(
                f"group: this process is one of {n} ranks (torch.distributed is initialized), and "
                "a Telemetry without group= would read this rank's partial summaries as if they "
                "covered the whole batch and row; pass Telemetry(group=...) (the DP and/or CP "
                "group) so that read() reduces across the ranks first"
            )

    # -- the read ----------------------------------------------------------------------------------
    def read(self) -> List[Dict[str, Any]]:
        """The records of every logged (step, layer) since the last read: the one host read.
        It drains: the records it returns are gone (a second ``read()``, or a ``write_jsonl``
        after it, returns or writes only what was logged since).

        With a group, collective: every rank of the group calls it at the same cadence and gets
        the reduced records. It reduces on a logging step or when one passed since the last read
        (a function of the step counter, alike on every rank); otherwise it sends nothing and
        returns ``[]``. A rank that does not call it makes the others raise within the group's
        timeout."""
        self._check_not_per_rank()
        self._warn_folded()
        if not self._groups:
            return self._read_local()
        # Reduce on a logging step, or when one passed since the last read: a function of the
        # step counter, the same on every rank, so every rank takes part or none does.
        last_logged = (self.step // self.every) * self.every if self.every > 0 else -1
        logged = self.should_log() or last_logged > self._read_at
        self._read_at = self.step
        if not logged:
            return []
        return self._read_reduced()

    def _read_local(self) -> List[Dict[str, Any]]:
        if not self._pending:
            return []
        import numpy as np

        pend = [_Entry(t) for t in self._pending]
        parts = [e.stats.detach() for e in pend]
        if len({(t.device, t.dtype, tuple(t.shape)) for t in parts}) == 1:
            import torch

            # one device-to-host transfer for the whole read (one per record on an XLA device
            # otherwise)
            stats = np.asarray(torch.stack(parts).cpu().numpy(), dtype=np.float64)
        else:
            stats = np.stack([np.asarray(t.cpu().numpy(), dtype=np.float64) for t in parts])
        lines = _tessera.telemetry_records(
            stats,
            [e.step for e in pend],
            [e.layer for e in pend],
            [e.learned_sinks for e in pend],
            max(self.every, 1),
            self.config["sink_tokens"],
            self.config["epsilon"],
            self.config["outlier_ratio"],
            self.config["sink_stream"],
            self.config["outlier_stream"],
            [1] * len(pend),
            [e.tokens for e in pend],
        )
        self._pending = []
        return [json.loads(x) for x in lines]

    def _collective(self, what: str, buf: Any, op: Any) -> None:
        import torch.distributed as dist

        try:
            dist.all_reduce(buf, op=op, group=self._pg)
        except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError)
            secs = self._timeout.total_seconds() if self._timeout is not None else float("nan")
            raise RuntimeError(
                f"tessera.Telemetry.read: the telemetry reduction ({what}, {buf.numel()} values "
                f"over ranks {list(self._ranks)}) failed on rank {dist.get_rank()} (group timeout "
                f"{secs:g} s): read() and write_jsonl() are collective, and a rank that did not "
                f"call them at this cadence, died, or logged different layers makes the others "
                f"fail here: {e}"
            ) from e

    def _read_reduced(self) -> List[Dict[str, Any]]:
        import numpy as np
        import torch
        import torch.distributed as dist

        pend = [_Entry(t) for t in self._pending]
        self._pending = []
        cfg = self.config
        keys = sorted({(e.step, e.layer) for e in pend})
        idx = {k: i for i, k in enumerate(keys)}
        heads: List[int] = [0] * len(keys)
        learned: List[Optional[bool]] = [None] * len(keys)
        for e in pend:
            i = idx[(e.step, e.layer)]
            h = int(e.stats.shape[0])
            if heads[i] and heads[i] != h:
                raise ValueError(f"telemetry: step {e.step} layer {e.layer} logged with {heads[i]} and {h} heads")
            if learned[i] is not None and learned[i] != e.learned_sinks:
                raise ValueError(
                    f"telemetry: step {e.step} layer {e.layer} logged with and without learned sinks"
                )
            heads[i], learned[i] = h, e.learned_sinks
        off = np.concatenate([[0], np.cumsum(heads)]).astype(np.int64)
        total_h = int(off[-1])
        n_ranks = len(self._ranks)
        me = self._ranks.index(dist.get_rank())
        cps = [e for e in pend if e.cp is not None]
        cp_sizes = [int(e.cp.sq.numel()) for e in cps]
        cp_off = np.concatenate([[0], np.cumsum(cp_sizes)]).astype(np.int64) if cps else np.zeros(1, np.int64)
        n_sq = int(cp_off[-1])
        dev = pend[0].stats.device if pend else torch.device("cpu")
        f64 = torch.float64

        # The layout every rank must share (host metadata only, never a partial's value).
        layout = repr((
            keys, heads, learned, [(e.step, e.layer, tuple(e.cp.sq.shape), e.cp.slice_len) for e in cps],
            sorted(cfg.items()), n_ranks,
        ))
        fp = float(int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=8).digest(), "little") >> 12)

        # -- MAX: [fingerprint, -fingerprint] + per head (max logit, max |O|) + every rank's
        #    per-(b, h) Σ O² of the context-parallel calls (own row; zeros elsewhere).
        mx = torch.zeros(2 + 2 * total_h + n_ranks * n_sq, dtype=f64, device=dev)
        mx[0], mx[1] = fp, -fp
        heads_max = mx[2 : 2 + 2 * total_h].view(total_h, 2)
        heads_max[:, 0] = float("-inf")
        # (+1: the ranks taking part, so that the buffer is never empty)
        sums = torch.zeros(total_h * _SUM_COLS + 2 * len(keys) + 1, dtype=f64, device=dev)
        sums[-1] = 1.0
        per_head = sums[: total_h * _SUM_COLS].view(total_h, _SUM_COLS)
        per_rec = sums[total_h * _SUM_COLS : -1].view(len(keys), 2)
        per_rec[:, 1] = 1.0  # this rank contributes to every record
        for e in pend:
            i = idx[(e.step, e.layer)]
            rows = slice(int(off[i]), int(off[i + 1]))
            s = e.stats.to(device=dev, dtype=f64)
            ml, am = s[:, 4], s[:, 5]
            heads_max[rows, 0] = torch.maximum(heads_max[rows, 0], torch.nan_to_num(ml, nan=float("-inf")))
            heads_max[rows, 1] = torch.maximum(heads_max[rows, 1], torch.nan_to_num(am, nan=0.0))
            per_head[rows, 0:4] += s[:, 0:4]
            per_head[rows, 4:6] += s[:, 6:8]
            if e.cp is None:
                per_head[rows, 6] += s[:, 8]  # whole (b, h) slices: the kernel's count is exact
            per_head[rows, 7] += torch.isnan(ml).to(f64)
            per_head[rows, 8] += torch.isnan(am).to(f64)
            per_rec[i, 0] += e.tokens
        if n_sq:
            sq_all = mx[2 + 2 * total_h :].view(n_ranks, n_sq)
            for j, e in enumerate(cps):
                sq = e.cp.sq.to(device=dev, dtype=f64).reshape(-1)
                # NaN (a NaN element) as +inf: the max keeps it, the slice's threshold stays
                # undefined (no outlier), as on one process.
                sq_all[me, int(cp_off[j]) : int(cp_off[j + 1])] = torch.nan_to_num(sq, nan=float("inf"))
        self._collective("all-reduce MAX", mx, dist.ReduceOp.MAX)
        if not (float(mx[0]) == fp and float(mx[1]) == -fp):
            # Every rank sees the same reduced values, so every rank raises here (no hang).
            raise ValueError(
                "telemetry: the ranks of the group logged different layers, steps, shapes or "
                "configurations since the last read (every rank must log the same (step, layer) "
                "calls); nothing was reduced"
            )

        # Context-parallel outliers, counted against the whole slice's RMS: Σ o² over the call's
        # CP ranks (from the reduced MAX buffer), then this rank's candidates above the threshold.
        if n_sq:
            sq_all = mx[2 + 2 * total_h :].view(n_ranks, n_sq)
            ratio = cfg["outlier_ratio"]
            for j, e in enumerate(cps):
                part = e.cp
                i = idx[(e.step, e.layer)]
                b, hq = part.sq.shape
                seg = sq_all[list(part.members), int(cp_off[j]) : int(cp_off[j + 1])].sum(0)
                thr = ratio * torch.sqrt(seg / part.slice_len)  # [B·Hq]
                counts = part.counts.to(dev).reshape(-1)
                if int(part.cand.numel()):
                    sid = torch.repeat_interleave(torch.arange(b * hq, device=dev), counts)
                    hit = part.cand.to(device=dev, dtype=f64) > thr[sid]
                    per = torch.bincount(sid[hit] % hq, minlength=hq).to(f64)
                    per_head[int(off[i]) : int(off[i + 1]), 6] += per

        # -- SUM: every numerator and denominator, the outlier counts, tokens and ranks.
        self._collective("all-reduce SUM", sums, dist.ReduceOp.SUM)

        # The one host read, of reduced values only.
        mx_h = mx[: 2 + 2 * total_h].cpu().numpy()
        sums_h = sums.cpu().numpy()
        hm = mx_h[2:].reshape(total_h, 2)
        ph = sums_h[: total_h * _SUM_COLS].reshape(total_h, _SUM_COLS)
        pr = sums_h[total_h * _SUM_COLS : -1].reshape(len(keys), 2)
        stats = np.zeros((total_h, _tessera.TELEMETRY_COLUMNS), dtype=np.float64)
        stats[:, 0:4] = ph[:, 0:4]
        stats[:, 4] = np.where(ph[:, 7] > 0, np.nan, hm[:, 0])
        stats[:, 5] = np.where(ph[:, 8] > 0, np.nan, hm[:, 1])
        stats[:, 6:9] = ph[:, 4:7]
        out: List[Dict[str, Any]] = []
        for i, (step, layer) in enumerate(keys):
            (line,) = _tessera.telemetry_records(
                stats[int(off[i]) : int(off[i + 1])][None],
                [step],
                [layer],
                [bool(learned[i])],
                max(self.every, 1),
                cfg["sink_tokens"],
                cfg["epsilon"],
                cfg["outlier_ratio"],
                cfg["sink_stream"],
                cfg["outlier_stream"],
                [int(round(pr[i, 1]))],
                [int(round(pr[i, 0]))],
            )
            out.append(json.loads(line))
        return out

    def write_jsonl(self, path: "str | os.PathLike[str]", *, all_ranks: bool = False) -> int:
        """Appends the records of :meth:`read` to ``path`` (JSON lines); returns how many. It
        drains as :meth:`read` does: keep the records with ``read()`` *or* write them, not both.

        With a group, collective like :meth:`read`: rank 0 of the group writes (every rank with
        ``all_ranks=True``; give each its own path then); every rank returns the count."""
        records = self.read()
        write = True
        if self._groups and not all_ranks:
            import torch.distributed as dist

            write = dist.get_rank() == self._ranks[0]
        if write:
            with open(path, "a", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
        return len(records)
