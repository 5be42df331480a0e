"""The runtime contract on torch_xla, read off ``torch_xla.debug.metrics``: :func:`receipt` runs a
few training steps and reports what a steady step costs the runtime (compilations after warm-up,
host transfers per step, persistent-cache hits, misses and deserialize failures), and which of
those are Tessera's doing. See docs/torch-xla.md."""

from __future__ import annotations

from typing import Any, Callable, Dict, List


def _metrics() -> Dict[str, int]:
    import torch_xla.debug.metrics as met

    def metric(name: str) -> int:
        d = met.metric_data(name)
        return int(d[0]) if d else 0

    def counter(name: str) -> int:
        v = met.counter_value(name)
        return int(v) if v is not None else 0

    return {
        "compiles": metric("CompileTime"),
        "to_device": metric("TransferToDeviceTime"),
        "from_device": metric("TransferFromDeviceTime"),
        "cache_hits": counter("PersistentCacheHit"),
        "cache_misses": counter("PersistentCacheMiss"),
        "cache_deserialize_failures": counter("PersistentCacheDeserializeFailure"),
    }


def _ours() -> Dict[str, int]:
    from ..engines import xla_splash

    return {"plan_uploads": xla_splash.counters["plan_uploads"],
            "host_reads": xla_splash.counters["host_reads"],
            "graphs": xla_splash.specializations()}


def receipt(step: Callable[[], Any], *, steps: int = 6, warmup: int = 3) -> Dict[str, Any]:
    """Runs ``step()`` ``steps`` times, each followed by ``torch_xla.sync()``, and reports the
    runtime's counters over the steps after the first ``warmup``:

    - ``compiles_after_warmup``: XLA compilations (``CompileTime``) in those steps (0 for a stable
      step); ``tessera_graphs_after_warmup``: new graphs Tessera lowered in them (0: a new plan of
      the same shapes is data, never a new graph);
    - ``to_device_per_step`` / ``from_device_per_step``: host transfers per step; of them
      ``tessera_uploads_per_step`` (plan tables moved, one per new plan) and
      ``tessera_reads_per_step`` (always 0: Tessera reads nothing in a step);
    - ``persistent_cache``: hits, misses and deserialize failures over the whole run (``xr.
      initialize_cache`` must be called first for these to count);
    - ``verdict``: one line saying what, if anything, is not Tessera's doing.
    """
    import torch_xla

    if not callable(step):
        raise TypeError(f"step: expected a callable, got {type(step).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
        raise ValueError(f"warmup: expected an int in [0, steps), got {warmup!r}")
    start = _metrics()
    snaps: List[Dict[str, int]] = []
    for _ in range(steps):
        step()
        torch_xla.sync()
        snaps.append({**_metrics(), **_ours()})
    base = snaps[warmup - 1] if warmup else {**start, **_ours()}
    last = snaps[-1]
    n = steps - warmup
    d = {k: last[k] - base[k] for k in last}
    out: Dict[str, Any] = {
        "steps": steps,
        "warmup": warmup,
        "compiles_after_warmup": d["compiles"],
        "tessera_graphs_after_warmup": d["graphs"] if base["graphs"] >= 0 else None,
        "to_device_per_step": d["to_device"] / n,
        "from_device_per_step": d["from_device"] / n,
        "tessera_uploads_per_step": d["plan_uploads"] / n,
        "tessera_reads_per_step": d["host_reads"] / n,
        "persistent_cache": {
            "hits": last["cache_hits"] - start["cache_hits"],
            "misses": last["cache_misses"] - start["cache_misses"],
            "deserialize_failures": last["cache_deserialize_failures"] - start["cache_deserialize_failures"],
        },
    }
    notes = []
    if d["compiles"]:
        who = ("Tessera lowered new graphs" if d["graphs"] > 0 else
               "not Tessera's doing: it lowered no new graph (look for .item(), Python scalars or "
               "changing shapes in the step)")
        notes.append(f"{d['compiles']} compilation(s) after warm-up: {who}")
    if d["from_device"] > d["host_reads"]:
        notes.append(f"{d['from_device'] - d['host_reads']} device-to-host transfer(s) after warm-up, none "
                     "Tessera's (a host read in the step: .item(), bool(tensor), printing)")
    extra = d["to_device"] - d["plan_uploads"]
    if extra > 0:
        notes.append(f"{extra} host-to-device transfer(s) after warm-up beyond Tessera's plan uploads "
                     f"({d['plan_uploads']})")
    pc = out["persistent_cache"]
    if pc["deserialize_failures"]:
        notes.append(f"{pc['deserialize_failures']} persistent-cache deserialize failure(s): the runtime's "
                     "(torch_xla's cache cannot load its own entries here), not Tessera's: its graphs are "
                     "identical across processes")
    out["verdict"] = "; ".join(notes) if notes else "stable: no compilation, no host read, only Tessera's plan uploads"
    return out
