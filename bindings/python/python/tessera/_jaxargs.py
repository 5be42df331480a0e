"""Argument checks shared by the JAX routes (``tessera.jax`` and ``tessera._splash``): every
problem is a ``TypeError``/``ValueError`` naming the argument, raised while tracing (shapes and
dtypes are static), never inside XLA."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np


def layout_name(layout: str) -> str:
    return "[B, H, L, D]" if layout == "bhld" else "[B, L, H, D]"


def check_qkv(
    q: Any,
    k: Any,
    v: Any,
    shape: Sequence[int],
    groups: Sequence[int],
    layout: str,
    sinks: Any,
    plan_arg: str = "plan",
) -> None:
    """q, k, v (jax arrays in ``layout``) against each other and a plan of ``shape`` ``(B, H, Lq,
    Lkv)`` and ``groups`` ``(B', H')``; ``sinks`` ``[Hq]`` floating when given."""
    import jax.numpy as jnp

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"{name}: expected a jax array, got {type(t).__name__}")
        if len(t.shape) != 4:
            raise ValueError(f"{name}: expected a 4-D array {layout_name(layout)}, got shape {tuple(t.shape)}")
        if 0 in t.shape:
            raise ValueError(f"{name}: expected a non-empty array, got shape {tuple(t.shape)}")
        if t.dtype not in (jnp.float32, jnp.bfloat16):
            raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got {k.dtype} and {v.dtype}")

    def bhld(t):
        return tuple(t.shape) if layout == "bhld" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])

    (b, hq, lq, dqk), kb, vb = bhld(q), bhld(k), bhld(v)
    pb, ph, plq, plkv = shape
    gb, gh = groups
    # As tessera.torch: a plan of one row (head) of a uniform mask serves any batch (head count).
    batch_ok = pb == b or (pb == 1 and gb == 1)
    heads_ok = ph == hq or (ph == 1 and gh == 1)
    if not (batch_ok and heads_ok) or (plq, plkv) != (lq, kb[2]):
        raise ValueError(
            f"{plan_arg}: built for B={pb} H={ph} Lq={plq} Lkv={plkv}, but q/k give "
            f"B={b} H={hq} Lq={lq} Lkv={kb[2]}"
        )
    if kb[0] != b or vb[0] != b or kb[1] != vb[1] or kb[2] != vb[2]:
        raise ValueError(
            f"k, v: expected {layout_name(layout)} with B={b} and matching Hkv, Lkv; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if kb[3] != dqk:
        raise ValueError(f"k: expected head dim {dqk} (as q), got {kb[3]}")
    if hq % kb[1] != 0:
        raise ValueError(f"k: kv heads {kb[1]} must divide the query heads {hq} (GQA)")
    if sinks is not None:
        # ValueError for anything that is not an [Hq] array, as tessera.torch.attention.
        if tuple(getattr(sinks, "shape", ())) != (hq,) or not hasattr(sinks, "dtype"):
            raise ValueError(
                f"sinks: expected an array of shape [{hq}] (one logit per query head), got "
                f"{type(sinks).__name__} {tuple(getattr(sinks, 'shape', ()))}"
            )
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks: expected a floating dtype, got {sinks.dtype}")


def positive(name: str, x: Any) -> float:
    """A static (Python or numpy) finite positive number."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a Python number (static under jit), got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}: expected a finite positive number, got {x}")
    return x


def scale_softcap(dqk: int, scale: Any, softcap: Any) -> Tuple[float, Optional[float]]:
    """``scale`` (default ``1/sqrt(Dqk)``) and ``softcap`` (None: off), checked."""
    scale = 1.0 / math.sqrt(dqk) if scale is None else positive("scale", scale)
    return scale, None if softcap is None else positive("softcap", softcap)
