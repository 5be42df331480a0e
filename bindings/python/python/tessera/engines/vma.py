"""JAX under ``shard_map``: the mesh axes an array varies over, custom-call results typed as varying
where their operands are, gradients typed like their primals (shared by the JAX engines and the
JAX frontend)."""

from __future__ import annotations

from typing import Any, List, Sequence


def _vma(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    import jax

    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _like(g: Any, x: Any) -> Any:
    """The gradient ``g`` typed like its primal ``x`` under ``shard_map``: summed over the axes
    ``x`` is replicated on (every device's contribution to a shared input, e.g. the sinks), cast
    to varying where ``x`` varies and the custom call's result does not say so."""
    import jax

    gv, xv = _vma(g), _vma(x)
    if gv - xv:
        g = jax.lax.psum(g, tuple(sorted(gv - xv, key=str)))
    if xv - gv:
        g = jax.lax.pcast(g, tuple(sorted(xv - gv, key=str)), to="varying")
    return g


def _varying(outs: Sequence[Any], args: Sequence[Any]) -> List[Any]:
    """The custom call's results typed as varying over every mesh axis an operand varies over
    (inside ``shard_map`` a custom call's result types do not say so by themselves)."""
    import jax

    axes = frozenset().union(*map(_vma, args))
    out = []
    for x in outs:
        missing = axes - _vma(x)
        if missing:
            x = jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")
        out.append(x)
    return out
