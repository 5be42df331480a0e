"""Telemetry for ``tessera.jax`` (docs/semantics.md#telemetry): the gate (a pytree with a traced step), the fixed-shape
per-head summary, its reduction across devices (:func:`reduce_summary`) and the one host read."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _tessera
from ..core.args import _int_arg
from ..core.telemetry import TelemetryWarning, _TelConfig, checked_config, warn_folded


_STAT_COLUMNS = _tessera.TELEMETRY_COLUMNS


# A summary's columns: the kernel's stats, then the query rows summarised and the devices reduced
# into it (the records' `tokens` and `ranks`), then the devices whose call had learned sinks: the
# summary itself says whether `learned_sink_mass` is a value or null (docs/semantics.md#telemetry),
# as the torch op's records do, instead of a flag the caller must repeat.
SUMMARY_COLUMNS = _STAT_COLUMNS + 3


# -- telemetry --------------------------------------------------------------------------------


class Telemetry:
    """Gated telemetry for ``tessera.jax.attention`` (docs/semantics.md#telemetry), device side first.

    ``Telemetry(every=N)`` is a pytree whose leaf is the step (pass ``tel.at(step)`` into the
    jitted step; a traced step is fine). With ``telemetry=tel`` the op also returns the step's
    per-head summary, ``float32 [Hq, 12, 2]``: a ``lax.cond`` on the traced step runs the
    telemetry kernel on logging steps and the plain kernel (zeros for the summary) otherwise, so
    no Python branch looks at a live value. Under ``shard_map``, :func:`reduce_summary` (done by
    :func:`cp_attention`) combines summaries across devices with ``psum``/``pmax`` before they
    leave them. On the host, :meth:`collect` keeps the device arrays of a step (no read) and
    :meth:`read` reads them once and returns the records of docs/semantics.md#telemetry (the JSON-lines schema of
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
        every, c = checked_config(every, sink_tokens, epsilon, outlier_ratio, streams)
        self.config = _TelConfig(
            every, c["sink_tokens"], c["epsilon"], c["outlier_ratio"], c["sink_stream"],
            c["outlier_stream"],
        )
        self.step = step
        self._pending: List[Tuple[int, int, Optional[bool], Any]] = []
        self._warned: set = set()  # warning kinds already said (shared with at()'s copies)

    @property
    def every(self) -> int:
        return self.config.every

    def at(self, step: Any) -> "Telemetry":
        """This telemetry at ``step`` (an int or a traced integer scalar)."""
        t = Telemetry.__new__(Telemetry)
        t.config = self.config
        t.step = step
        t._pending = self._pending
        t._warned = self._warned
        return t

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a logging step (host side, for :meth:`collect`)."""
        return self.config.every > 0 and int(step) % self.config.every == 0

    def collect(self, step: int, summaries: Dict[int, Any], learned_sinks: Optional[bool] = None) -> None:
        """Keeps ``{layer: summary}`` of ``step`` (device arrays, not read) when it is a logging
        step. Each summary says whether its call had learned sinks (``learned_sink_mass`` is null
        without, as in ``tessera.torch`` records); ``learned_sinks`` is not needed, and a value
        that the summary contradicts warns once at the read. A layer collected twice for one
        ``step`` before a read merges into one record and warns once (``TelemetryWarning``): pass
        each step's own number to ``tel.at(step)`` and ``collect(step, ...)``."""
        step = _int_arg("collect", "step", step, 0)
        if not self.should_log(step):
            return
        claimed = None if learned_sinks is None else bool(learned_sinks)
        seen = {(p[0], p[1]) for p in self._pending}
        for layer, s in sorted(summaries.items()):
            layer = _int_arg("collect", "layer", layer, 0, 2**32)
            if (step, layer) in seen:
                warn_folded(self._warned, step, layer,
                            "Pass each step's own number to tel.at(step) and tel.collect(step, ...).", 2)
            self._pending.append((step, layer, claimed, s))

    def read(self) -> List[Dict[str, Any]]:
        """The records of every collected (step, layer) since the last read: the one host read.
        It drains: a second ``read()`` (or ``write_jsonl`` after it) returns only what was
        collected since."""
        import json

        if not self._pending:
            return []
        full = np.stack([_stats64(np.asarray(s)) for *_, s in self._pending])
        learned = [bool(x > 0) for x in full[:, 0, _STAT_COLUMNS + 2]]
        for p, has in zip(self._pending, learned):
            if p[2] is not None and p[2] != has and "learned_sinks" not in self._warned:
                import warnings

                self._warned.add("learned_sinks")
                warnings.warn(
                    f"collect: learned_sinks={p[2]}, but layer {p[1]}'s summary of step {p[0]} was "
                    f"made {'with' if has else 'without'} sinks: its learned_sink_mass is "
                    f"{'a value' if has else 'null'}, as the summary says (learned_sinks is not "
                    "needed). (Said once per telemetry object.)",
                    TelemetryWarning,
                    stacklevel=2,
                )
        c = self.config
        lines = _tessera.telemetry_records(
            np.ascontiguousarray(full[:, :, :_STAT_COLUMNS]),
            [p[0] for p in self._pending],
            [p[1] for p in self._pending],
            learned,
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
        """Appends the records of :meth:`read` to ``path`` (JSON lines); returns how many. It
        drains as :meth:`read` does: keep the records with ``read()`` *or* write them, not both."""
        import json

        records = self.read()
        with open(path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return len(records)


def _flatten_tel(t: Telemetry):
    return (t.step,), t.config


def _unflatten_tel(config: _TelConfig, children) -> Telemetry:
    t = Telemetry.__new__(Telemetry)
    t.config = config
    (t.step,) = children
    t._pending = []
    t._warned = set()
    return t


def _stats64(s: np.ndarray) -> np.ndarray:
    """``float64 [Hq, 12]`` from the op's ``float32 [Hq, 12, 2]`` (hi, lo) pairs."""
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


def _on_import() -> None:
    import jax

    jax.tree_util.register_pytree_node(Telemetry, _flatten_tel, _unflatten_tel)


_on_import()
