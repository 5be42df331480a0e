"""Argument checks shared by every frontend: each problem is a ``TypeError``/``ValueError``
naming the argument, what was expected and what was found, raised before any kernel runs (for
JAX: while tracing, shapes and dtypes being static). numpy only at import time."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np


def _int_ids(name: str, ids: Any, what: str = "segment ids") -> np.ndarray:
    """Segment ids (or another per-token integer array, ``what``) as a contiguous int64 array
    ``[L]`` or ``[B, L]`` (numpy, torch, lists); values outside int64 are refused, not wrapped."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch tensor, on any device
        ids = ids.detach().cpu().numpy()
    a = np.asarray(ids)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array of {what}, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise ValueError(f"{name}: expected {what} of shape [L] or [B, L], got {a.shape}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: {what} must fit in int64, got {int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _bool_array(name: str, values: Any) -> np.ndarray:
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.dtype != np.bool_:
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected a bool (or 0/1 integer) array, got dtype {a.dtype}")
        if a.size and (a.min() < 0 or a.max() > 1):
            raise ValueError(f"{name}: expected only 0 and 1 in an integer mask array")
        a = a.astype(np.bool_)
    return np.ascontiguousarray(a)


def _kv_tiles(name: str, kv_tiles: Any) -> np.ndarray:
    """A block selection as a contiguous int64 array ``[B, H, Tq, k]`` (or ``[H, Tq, k]``,
    ``[Tq, k]``) from numpy, torch (a CUDA tensor is copied to the host once) or lists."""
    if hasattr(kv_tiles, "detach") and hasattr(kv_tiles, "cpu"):
        kv_tiles = kv_tiles.detach().cpu().numpy()
    a = np.asarray(kv_tiles)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array of kv tile indices (-1 = none), got dtype {a.dtype}")
    if a.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected shape [B, H, Tq, k] (or [H, Tq, k], [Tq, k]), got {tuple(a.shape)}")
    if a.dtype.kind == "u" and a.size and int(a.max()) >= 2**31:
        raise ValueError(f"{name}: expected kv tile indices below 2**31, found {int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _block_pair(name: str, block: Any, lo: int = 1) -> Tuple[int, int]:
    """``block`` as a ``(q, kv)`` pair of ints (an int means a square block)."""
    pair = (block, block) if isinstance(block, (int, np.integer)) and not isinstance(block, bool) else block
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected an int or a (q, kv) pair of ints, got {block!r}")
    return (_int_arg(name, "q", pair[0], lo), _int_arg(name, "kv", pair[1], lo))


def _int_arg(fn: str, name: str, value: Any, lo: int, hi: int = 2**62) -> int:
    """An exact integer argument in ``[lo, hi)``: bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v < hi:
        raise ValueError(f"{fn}: {name} must be in [{lo}, {hi}), got {v}")
    return v


def layout_name(layout: str) -> str:
    return "[B, H, L, D]" if layout == "bhld" else "[B, L, H, D]"


def _as_bhld(shape: Sequence[int], layout: str) -> Tuple[int, ...]:
    s = tuple(int(x) for x in shape)
    return s if layout == "bhld" else (s[0], s[2], s[1], s[3])


def _fits(q: Tuple[int, ...], lkv: int, shape: Sequence[int], groups: Sequence[int]) -> bool:
    """Whether ``q`` ``(B, Hq, Lq, D)`` and ``Lkv`` are what a plan of ``shape`` and ``groups``
    serves. A plan of one row (head) of a mask that does not vary along rows (heads) serves any
    batch size (head count)."""
    pb, ph, plq, plkv = shape
    gb, gh = groups
    batch_ok = pb == q[0] or (pb == 1 and gb == 1)
    heads_ok = ph == q[1] or (ph == 1 and gh == 1)
    return batch_ok and heads_ok and (plq, plkv) == (q[2], lkv)


def layout_hint(name: str, shape: Sequence[int], seq_len: int, layout: Optional[str]) -> str:
    """``""``, or, when 4-D ``shape`` has ``seq_len`` on the L axis of the other layout and not on
    ``layout``'s (``None``: ``[B, H, L, D]`` only, no ``layout`` argument), the fix to append to an
    error about ``name``'s length."""
    read_as = layout or "bhld"
    other = "blhd" if read_as == "bhld" else "bhld"
    axis, other_axis = (2, 1) if read_as == "bhld" else (1, 2)
    if len(shape) != 4 or shape[axis] == seq_len or shape[other_axis] != seq_len:
        return ""
    if layout is None:
        return f"; it looks {layout_name(other)}: pass {name}.transpose(1, 2) (a view, no copy)"
    return f'; it looks {layout_name(other)}: pass layout="{other}"'


def check_plan_fit(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    shape: Sequence[int],
    groups: Sequence[int],
    layout: Optional[str] = "bhld",
    plan_arg: str = "plan",
) -> None:
    """A ``ValueError`` unless 4-D ``q`` and ``k`` (in ``layout``) fit a plan of ``shape`` ``(B,
    H, Lq, Lkv)`` and ``groups``. Shared by every frontend. ``layout`` ``None``: the frontend
    reads ``[B, H, L, D]`` only (``tessera.torch``: no ``layout`` argument).

    ``[B, L, H, D]`` tensors given as ``[B, H, L, D]`` (JAX's own attention and most model code
    use ``[B, T, N, H]``) would otherwise read as H=L and L=H and blame the plan: when the shapes
    fit the plan with axes 1 and 2 swapped, the error says so and names the fix."""
    read_as = layout or "bhld"
    q, k = _as_bhld(q_shape, read_as), _as_bhld(k_shape, read_as)
    if _fits(q, k[2], shape, groups):
        return
    other = "blhd" if read_as == "bhld" else "bhld"
    q2, k2 = _as_bhld(q_shape, other), _as_bhld(k_shape, other)
    if _fits(q2, k2[2], shape, groups):
        pb, ph, plq, plkv = shape
        lens = f"L={plq}" if plq == plkv else f"Lq={plq}, Lkv={plkv}"
        if layout is None:
            fix = (f"tessera.torch.attention reads {layout_name(read_as)}: pass q.transpose(1, 2), "
                   "k.transpose(1, 2), v.transpose(1, 2) (views, no copy)")
        else:
            fix = f'layout="{read_as}" reads it as {layout_name(read_as)}: pass layout="{other}"'
        raise ValueError(
            f"q: shape {tuple(int(x) for x in q_shape)} is {layout_name(other)} for this plan "
            f"(B={pb}, H={ph}, {lens}), but {fix}"
        )
    pb, ph, plq, plkv = shape
    raise ValueError(
        f"{plan_arg}: built for B={pb} H={ph} Lq={plq} Lkv={plkv}, but q/k give "
        f"B={q[0]} H={q[1]} Lq={q[2]} Lkv={k[2]}"
    )


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

    (b, hq, lq, dqk), kb, vb = (_as_bhld(t.shape, layout) for t in (q, k, v))
    check_plan_fit(q.shape, k.shape, shape, groups, layout, plan_arg)
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
