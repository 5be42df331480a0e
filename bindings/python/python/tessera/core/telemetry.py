"""Telemetry configuration shared by the torch and JAX frontends (docs/semantics.md#telemetry): the checked
``every``/streams/thresholds of a telemetry object and its static (hashable) form. numpy only."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Sequence, Tuple

from .args import _int_arg


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
