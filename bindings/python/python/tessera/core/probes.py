"""What this process can run attention with, probed once per process (imports torch lazily): whether
``flash_attn.cute`` (FlashAttention-4, FlexAttention's FLASH backend) imports, whether torch has
``varlen_attn``, a CUDA device's compute capability.

Engine selection (``tessera.engines.select``) reads these inside compiled steps too, where probing
is not traceable: the results are kept in one dict, filled eagerly (:func:`warm`, called when a
plan's BlockMask is built for a device); inside a compiled step, an unprobed question answers
"not available" with the reason. Tests fake a device by replacing the functions in
``tessera.engines.select``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, Optional, Tuple

_PROBED: Dict[str, Any] = {}

UNPROBED = "not probed outside a compiled step (run one call eagerly, or build the plan's BlockMask, first)"


def _probe(key: str, fn, default):
    """``fn()`` once per process; inside a compiled step, before any eager probe, ``default``."""
    if key not in _PROBED:
        import torch

        if torch.compiler.is_compiling():
            return default
        _PROBED[key] = fn()
    return _PROBED[key]


def _find_flash() -> Tuple[bool, str]:
    try:
        fa = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False, "this torch has no FlexAttention"
    if "BACKEND" not in getattr(getattr(fa, "FlexKernelOptions", None), "__annotations__", {}):
        return False, "this torch's FlexAttention has no BACKEND kernel option (torch >= 2.11)"
    try:
        ok = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        ok = False
    return ok, "" if ok else "flash_attn.cute is not importable (pip install flash-attn-4)"


def _find_varlen() -> Tuple[bool, str]:
    try:
        mod = importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return False, "this torch has no torch.nn.attention.varlen (torch >= 2.10)"
    ok = hasattr(mod, "varlen_attn")
    return ok, "" if ok else "torch.nn.attention.varlen has no varlen_attn"


def flash_importable() -> Tuple[bool, str]:
    """Whether ``flash_attn.cute`` can be imported, and if not why."""
    return _probe("flash", _find_flash, (False, UNPROBED))


def varlen_importable() -> Tuple[bool, str]:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn``, and if not why."""
    return _probe("varlen", _find_varlen, (False, UNPROBED))


def _varlen_params() -> frozenset:
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn

        return frozenset(inspect.signature(varlen_attn).parameters)
    except (ImportError, TypeError, ValueError):
        return frozenset()


def varlen_params() -> frozenset:
    """The parameter names of this torch's ``varlen_attn`` (they grew: ``is_causal`` in 2.10, then
    ``scale`` / ``window_size``, then ``enable_gqa``)."""
    return _probe("varlen_params", _varlen_params, frozenset())


def device_capability(device: Any) -> Optional[Tuple[int, int]]:
    """The CUDA compute capability of ``device`` (``None`` for other devices)."""
    import torch

    if device.type != "cuda":
        return None
    return _probe(f"cap:{device}", lambda: tuple(torch.cuda.get_device_capability(device)), None)


def warm(device: Any) -> None:
    """Probes everything selection asks about ``device`` now (outside any compiled step)."""
    import torch

    flash_importable()
    varlen_importable()
    varlen_params()
    device_capability(torch.device(device))


def _key(device: Any) -> str:
    """``"cuda:0"`` for ``"cuda"`` (the current device) and for ``q.device`` alike: the key of
    what is kept per device on a plan."""
    import torch

    dev = torch.device(device)
    if dev.index is None and dev.type not in ("cpu", "meta"):
        mod = getattr(torch, dev.type, None)
        if mod is not None and hasattr(mod, "current_device"):
            dev = torch.device(dev.type, mod.current_device())
    return str(dev)
