"""Telemetry configuration shared by the torch and JAX frontends (docs/semantics.md#telemetry): the checked
``every``/streams/thresholds of a telemetry object and its static (hashable) form. numpy only."""

from __future__ import annotations

import warnings
from typing import Any, Dict, NamedTuple, Sequence, Set, Tuple

from .args import _int_arg


class TelemetryWarning(UserWarning):
    """Telemetry use that is most likely a mistake (docs/python.md#telemetry); filter this
    category where it is intended (micro-batches of one step recorded on purpose)."""


def warn_folded(warned: Set[str], step: int, layer: int, how: str, stacklevel: int) -> None:
    """Warns, once per telemetry object (``warned`` holds the kinds already said), that ``layer``
    was recorded twice at ``step``: its record merges the calls, which folds training steps into
    one when the step was not moved on (``how`` says how to move it). ``stacklevel`` counts from
    the caller of this function to the user's line."""
    if "folded" in warned:
        return
    warned.add("folded")
    warnings.warn(
        f"telemetry: layer {layer} was recorded twice at step {step}; records are per (step, "
        f"layer), so the record of step {step} merges both calls (or, read in between, two "
        f"records share step {step}): training steps are folded into one. {how} If the calls "
        "are micro-batches of one step (gradient accumulation), merging them is intended: "
        "filter tessera.core.telemetry.TelemetryWarning. (Said once per telemetry object.)",
        TelemetryWarning,
        stacklevel=stacklevel + 1,
    )


def checked_config(
    every: Any, sink_tokens: Any, epsilon: Any, outlier_ratio: Any, streams: Sequence[str]
) -> Tuple[int, Dict[str, Any]]:
    """``every`` and the summary options (docs/semantics.md#telemetry), checked (shared with ``tessera.jax``)."""
    every = _int_arg("Telemetry", "every", every, 0)
    sink_tokens = _int_arg("Telemetry", "sink_tokens", sink_tokens, 0)
    bad = [s for s in streams if s not in ("sink", "outlier")]
    if bad:
        raise ValueError(f"streams: unknown stream(s) {bad}; expected 'sink' and/or 'outlier'")
    if not (0.0 <= float(epsilon) <= 1.0):
        raise ValueError(f"epsilon: expected a value in [0, 1], got {epsilon}")
    if not (float(outlier_ratio) >= 0.0 and float(outlier_ratio) != float("inf")):
        raise ValueError(f"outlier_ratio: expected a finite value >= 0, got {outlier_ratio}")
    return every, {
        "sink_tokens": int(sink_tokens),
        "epsilon": float(epsilon),
        "outlier_ratio": float(outlier_ratio),
        "sink_stream": "sink" in streams,
        "outlier_stream": "outlier" in streams,
    }


class _TelConfig(NamedTuple):
    every: int
    sink_tokens: int
    epsilon: float
    outlier_ratio: float
    sink_stream: bool
    outlier_stream: bool
