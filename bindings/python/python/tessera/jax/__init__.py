"""JAX integration: ``tessera.jax.attention``, one op on every device JAX runs on (docs/semantics.md#engines-and-devices).

On CPU the op runs Tessera's kernels through XLA FFI custom calls (forward, backward and the
telemetry forward), zero-copy on XLA's buffers; on TPU it runs Splash with the plan's
``MaskInfo`` (see :mod:`tessera.jax.splash`). Example::

    import jax, jax.numpy as jnp, numpy as np, tessera, tessera.jax as tj
    ids = np.repeat(np.arange(4), 256)                           # 4 documents in 1024 tokens
    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=1024, heads=8)

    @jax.jit
    def loss(q, k, v, plan):                                     # the plan is an argument
        return tj.attention(q, k, v, plan, softcap=30.0).square().mean()

    q = jnp.ones((2, 8, 1024, 64)); k = v = jnp.ones((2, 2, 1024, 64))   # GQA: 2 kv heads
    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, plan)

Plans reach compiled code as data. A :class:`tessera.Plan` is a JAX pytree whose only leaf is
its handle (``int32 [2]``, 62 random bits: JAX has no int64 arrays without x64) and whose static
part is its shapes, so calling a jitted step with another plan of the same shapes neither
retraces nor recompiles, and no plan constant is baked into the executable (the persistent
compilation cache hits across processes). Pass plans as arguments: a plan *closed over* by a
jitted function becomes a constant of that trace.

The handle registry holds a plan while its :class:`tessera.Plan` object lives, and after that
until every computation whose outputs are still held has finished (JAX dispatches
asynchronously: ``step(x, tessera.plan(...))`` works). A handle whose plan is gone, or a made-up
one, is an error raised by the custom call, never a read of freed memory.

Layouts: ``layout="bhld"`` (default) takes ``q [B, Hq, Lq, Dqk]``, ``k [B, Hkv, Lkv, Dqk]``,
``v [B, Hkv, Lkv, Dv]`` like ``tessera.torch``; ``layout="blhd"`` takes ``[B, L, H, D]``, the
``[B, T, N, H]`` of ``jax.nn.dot_product_attention``, read in place through strides. Outputs come
in the same layout as the inputs.
"""

from __future__ import annotations

from .cp import CPPlan, cp_attention, cp_plan, gather, scatter
from .op import BACKENDS, LAYOUTS, attention
from .plans import PlanRef, mask_info, plan_ref
from .telemetry import SUMMARY_COLUMNS, Telemetry, reduce_summary
from . import serialize as _serialize  # noqa: F401,E402  (registers the export serializations)


__all__ = [
    "attention",
    "plan_ref",
    "PlanRef",
    "Telemetry",
    "cp_attention",
    "cp_plan",
    "CPPlan",
    "reduce_summary",
    "SUMMARY_COLUMNS",
    "scatter",
    "gather",
    "mask_info",
    "LAYOUTS",
    "BACKENDS",
]
