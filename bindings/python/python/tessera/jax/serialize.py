"""Tessera's pytrees in ``jax.export`` serializations: a step exported with a plan, a
``PlanRef`` (with or without Splash ``MaskInfo``), a telemetry gate or a ``CPPlan`` among its
arguments serializes and deserializes (``Exported.serialize()`` / ``jax.export.deserialize``).

Only the static part of each pytree is written: its shapes and options (small named tuples of
ints, floats, bools and strings, as JSON); the leaves (handles, MaskInfo arrays, the step) are
the exported function's arguments, never constants. Registered once, when ``tessera.jax`` is
imported."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

from ..core import splash_tables
from ..core.plans import Plan
from ..core.telemetry import _TelConfig
from .cp import CPPlan, _CPAux
from .plans import PlanRef, _Meta
from .telemetry import Telemetry

# The static records that may appear in an aux, by a stable name (what the JSON stores).
_RECORDS: Dict[str, Any] = {
    "plan_meta": _Meta,
    "splash_meta": splash_tables._Meta,
    "telemetry_config": _TelConfig,
    "cp_aux": _CPAux,
}
_NAME_OF = {cls: name for name, cls in _RECORDS.items()}


def _encode(x: Any) -> Any:
    if type(x) in _NAME_OF:
        if dataclasses.is_dataclass(x):
            fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        else:
            fields = x._asdict()
        return {"record": _NAME_OF[type(x)], "fields": {k: _encode(v) for k, v in fields.items()}}
    if isinstance(x, (tuple, list)):
        return {"tuple": [_encode(v) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"tessera.jax export serialization: cannot write a {type(x).__name__} in a pytree's static part")


def _decode(x: Any) -> Any:
    if isinstance(x, dict) and "record" in x:
        cls = _RECORDS.get(x["record"])
        if cls is None:
            raise ValueError(f"tessera.jax export serialization: unknown record {x['record']!r}")
        return cls(**{k: _decode(v) for k, v in x["fields"].items()})
    if isinstance(x, dict) and "tuple" in x:
        return tuple(_decode(v) for v in x["tuple"])
    return x


def _dumps(aux: Any) -> bytes:
    return json.dumps(_encode(aux), sort_keys=True).encode()


def _loads(data: bytes) -> Any:
    return _decode(json.loads(bytes(data).decode()))


def _register() -> None:
    import jax
    import jax.export  # a submodule: not an attribute of jax until imported (jax < 0.8)

    reg = jax.export.register_pytree_node_serialization
    reg(PlanRef, serialized_name="tessera.jax.PlanRef", serialize_auxdata=_dumps,
        deserialize_auxdata=_loads)
    reg(Plan, serialized_name="tessera.Plan", serialize_auxdata=_dumps, deserialize_auxdata=_loads)
    reg(splash_tables.SplashInfo, serialized_name="tessera.SplashInfo", serialize_auxdata=_dumps,
        deserialize_auxdata=_loads)
    reg(Telemetry, serialized_name="tessera.jax.Telemetry", serialize_auxdata=_dumps,
        deserialize_auxdata=_loads)
    reg(CPPlan, serialized_name="tessera.jax.CPPlan", serialize_auxdata=_dumps,
        deserialize_auxdata=_loads)

_register()
