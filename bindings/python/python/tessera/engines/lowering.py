"""A JAX computation's choices by the platform it is *lowered* for, not the process's default device.

``jax.lax.platform_dependent`` traces one branch per platform and a lowering keeps only the
branch of its platform, so a step exported or compiled for TPU on a CPU host gets the TPU
kernels. Where a platform has no branch that can run, :func:`unsupported` stands in for the
outputs: it traces to a placeholder of the right shapes and raises ``ValueError(message)`` when
(and only when) that branch is lowered — a clear error at ``jit``/``jax.export`` time for that
platform, never a silent fallback, and no effect on the platforms that can run.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_unsupported_p = Primitive("tessera_unsupported_on_this_platform")


def _abstract(x: Any, *, message: str) -> Any:
    return x


def _impl(x: Any, *, message: str) -> Any:
    raise ValueError(message)


def _lower(ctx: Any, x: Any, *, message: str) -> Any:
    raise ValueError(message)


_unsupported_p.def_abstract_eval(_abstract)
_unsupported_p.def_impl(_impl)
mlir.register_lowering(_unsupported_p, _lower)
ad.defjvp(_unsupported_p, lambda g, x, *, message: g)  # the placeholder is linear in its input
batching.primitive_batchers[_unsupported_p] = lambda args, dims, *, message: (
    _unsupported_p.bind(*args, message=message), dims[0])


def unsupported(message: str, like: Sequence[Any], anchor: Any) -> list:
    """Placeholders shaped and typed like ``like`` (arrays or ``ShapeDtypeStruct``s) whose lowering
    raises ``ValueError(message)``. ``anchor`` (any array of the branch's inputs) ties them to the
    computation, so that AD, ``vmap`` and ``shard_map`` see ordinary values."""
    seed = _unsupported_p.bind(jnp.zeros((), jnp.float32) + 0 * jnp.asarray(anchor, jnp.float32).ravel()[0],
                               message=message)
    return [jnp.zeros(x.shape, x.dtype) + seed.astype(x.dtype) for x in like]

