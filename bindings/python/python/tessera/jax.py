"""JAX integration: plans as Splash attention ``MaskInfo``.

Splash (``jax.experimental.pallas.ops.tpu.splash_attention``) turns a dense mask into
``MaskInfo`` by evaluating it block by block (``process_mask``, lru-cached). Tessera builds the
same arrays from its plan directly, at any length, without a dense ``[Lq, Lkv]`` mask::

    import jax.numpy as jnp, tessera, tessera.jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H,
                        block=(512, 512))
    fwd, dkv = tessera.jax.mask_info(plan)             # equal to process_mask / _dkv's
    kernel = sk.SplashAttentionKernel(
        fwd, None, dkv, mask_value=sk.DEFAULT_MASK_VALUE, is_mqa=False,
        block_sizes=sk.BlockSizes.get_default(), residual_checkpoint_name=None,
        save_residuals=False, mask_function=None, attn_logits_soft_cap=None,
        interpret=True,                                  # on CPU; omit on TPU
    )
    out = kernel(q * (1 / d ** 0.5), k, v)              # q [H, L, D]: Splash does not scale q

``mask_info`` returns Splash's own ``MaskInfo`` type (a NamedTuple) whose arrays are jax arrays
(numpy with ``as_numpy=True``), with the integer dtypes Splash's downcast picks. Splash has no
batch dimension (one kernel per row, usually under ``vmap``): a plan whose mask differs per batch
row gives each row's infos with ``batch_row=``.
"""

from __future__ import annotations

from typing import Any, Tuple

from . import Plan, _int_arg

__all__ = ["mask_info"]


def mask_info(
    plan: Plan,
    *,
    batch_row: int = 0,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
    shrink_grid_dkv: bool = True,
    downcast_smem_data: bool = True,
    as_numpy: bool = False,
) -> Tuple[Any, Any]:
    """The forward (and dQ) and the dKV ``MaskInfo`` of ``plan`` for one batch row, equal to
    ``process_mask(MultiHeadMask(...), plan.block, ...)`` and ``process_mask_dkv(...)`` with the
    same options. The options mean what they mean in Splash (``shrink_grid_dkv=False`` for the
    fused backward kernel)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import (
        MaskInfo,
    )

    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a tessera.Plan, got {type(plan).__name__}")
    head_shards = _int_arg("mask_info", "head_shards", head_shards, 1)
    q_seq_shards = _int_arg("mask_info", "q_seq_shards", q_seq_shards, 1)
    batch_row = _int_arg("mask_info", "batch_row", batch_row, 0)
    rows = plan._p._splash_arrays(
        head_shards, q_seq_shards, shrink_grid, shrink_grid_dkv, downcast_smem_data
    )
    if not 0 <= batch_row < plan.shape[0]:
        raise ValueError(f"batch_row: expected 0 <= batch_row < {plan.shape[0]}, got {batch_row}")
    fwd, dkv = rows[batch_row if len(rows) > 1 else 0]
    if as_numpy:
        conv = lambda x: x  # noqa: E731
    else:
        import jax.numpy as jnp

        conv = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731

    def info(d: dict) -> Any:
        return MaskInfo(
            data_next=conv(d["data_next"]),
            mask_next=conv(d["mask_next"]),
            block_mask=conv(d["block_mask"]),
            partial_mask_blocks=conv(d["partial_mask_blocks"]),
            q_sequence=None,
        )

    return info(fwd), info(dkv)
