"""Gated attention telemetry from Python (SPEC §6).

``Telemetry(every=N)`` decides per step whether attention calls log. On a logging step
``tessera.torch.attention(..., telemetry=tel, layer=i)`` runs the kernel's telemetry variant
(outputs bit-identical to the plain kernel) and keeps the step's per-head summary as a small
fixed-shape tensor; nothing is read on the host inside the step. ``tel.read()`` does the one
deferred read and returns the records (sink mass, sink rate, learned-sink mass, entropy, max
logit, output max/RMS/outlier counts per head); ``tel.write_jsonl(path)`` appends them in the
JSON-lines schema ``tessera telemetry plot`` reads. Call ``tel.advance()`` once per step.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

from . import _tessera


class Telemetry:
    """Attach once, log every ``every`` steps (``every=0``: never)."""

    def __init__(
        self,
        every: int = 100,
        *,
        sink_tokens: int = 1,
        epsilon: float = 0.3,
        outlier_ratio: float = 6.0,
        streams: Sequence[str] = ("sink", "outlier"),
    ) -> None:
        from . import _int_arg

        every = _int_arg("Telemetry", "every", every, 0)
        sink_tokens = _int_arg("Telemetry", "sink_tokens", sink_tokens, 0)
        bad = [s for s in streams if s not in ("sink", "outlier")]
        if bad:
            raise ValueError(f"streams: unknown stream(s) {bad}; expected 'sink' and/or 'outlier'")
        if not (0.0 <= float(epsilon) <= 1.0):
            raise ValueError(f"epsilon: expected a value in [0, 1], got {epsilon}")
        if not (float(outlier_ratio) >= 0.0 and float(outlier_ratio) != float("inf")):
            raise ValueError(f"outlier_ratio: expected a finite value >= 0, got {outlier_ratio}")
        self.every = int(every)
        self.step = 0
        self.config: Dict[str, Any] = {
            "sink_tokens": int(sink_tokens),
            "epsilon": float(epsilon),
            "outlier_ratio": float(outlier_ratio),
            "sink_stream": "sink" in streams,
            "outlier_stream": "outlier" in streams,
        }
        self._pending: List[tuple] = []

    def should_log(self) -> bool:
        """Whether attention calls of the current step log."""
        return self.every > 0 and self.step % self.every == 0

    def advance(self) -> None:
        """Moves to the next step (call once per training step)."""
        self.step += 1

    def _record(self, layer: int, learned_sinks: bool, stats: Any) -> None:
        self._pending.append((self.step, int(layer), bool(learned_sinks), stats))

    def read(self) -> List[Dict[str, Any]]:
        """The records of every logged (step, layer) since the last read: the one host read."""
        if not self._pending:
            return []
        import numpy as np

        stats = np.stack([np.asarray(s.detach().cpu().numpy(), dtype=np.float64) for *_, s in self._pending])
        lines = _tessera.telemetry_records(
            stats,
            [p[0] for p in self._pending],
            [p[1] for p in self._pending],
            [p[2] for p in self._pending],
            max(self.every, 1),
            self.config["sink_tokens"],
            self.config["epsilon"],
            self.config["outlier_ratio"],
            self.config["sink_stream"],
            self.config["outlier_stream"],
        )
        self._pending.clear()
        return [json.loads(x) for x in lines]

    def write_jsonl(self, path: "str | os.PathLike[str]") -> int:
        """Appends the records of :meth:`read` to ``path`` (JSON lines); returns how many."""
        records = self.read()
        with open(path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return len(records)
