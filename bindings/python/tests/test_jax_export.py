"""TPU without a TPU (docs/semantics.md#engines-and-devices): steps calling ``tessera.jax`` exported with
``jax.export(..., platforms=["tpu"])`` on this CPU host carry Splash's Mosaic kernels, no host
callback, no FFI call and no mask constant; five plans of equal shapes give byte-identical
serialized modules; plans Splash cannot run raise ``ValueError`` naming ``block`` when lowered
for TPU; the same step lowered for CPU still runs Tessera's FFI kernels.

The contract of an exported step is its ``in_avals``: the step's arrays, then the plan's leaves
(``int32 [2]`` handle words and the Splash ``MaskInfo`` arrays of ``plan_ref(plan, splash=True)``:
``data_next``, ``mask_next``, ``block_mask`` ``[G, H', Tq, Tk]`` and ``partial_mask_blocks``
``[G, bound, tq, tk]`` for the forward and the dKV pass, then ``row_valid`` ``[G, H', Lq]`` and the
keys' positions in their documents ``int32 [B' or 1, Lkv]``, where telemetry finds the sink keys)."""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flatbuffers")  # jax.export serialization

import jax.numpy as jnp  # noqa: E402

import tessera  # noqa: E402
import tessera.jax as tj  # noqa: E402
from test_jax_cp import _run  # noqa: E402

L, H, HKV, D, BLOCK, BOUND = 1024, 4, 2, 128, 128, 32
MOSAIC = {"splash_mha_fwd_residuals", "splash_mha_dkv_no_residuals"}


def _plan(seed: int, block=BLOCK):
    ids = np.sort(np.random.default_rng(seed).integers(0, 6, L))
    return tessera.plan(tessera.causal() & tessera.document(ids), q_len=L, heads=H, block=block)


def _loss(q, k, v, sinks, plan, backend):
    o, lse = tj.attention(q, k, v, plan, softcap=30.0, sinks=sinks, return_lse=True, backend=backend)
    return jnp.mean(jnp.square(o.astype(jnp.float32))) + 1e-3 * jnp.mean(jnp.where(jnp.isfinite(lse), lse, 0.0))


def _step(backend):
    return jax.jit(jax.value_and_grad(lambda *a: _loss(*a, backend), argnums=(0, 1, 2, 3)))


def _specs(ref):
    q = jax.ShapeDtypeStruct((1, H, L, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, HKV, L, D), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((H,), jnp.float32)
    r = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), ref)
    return q, kv, kv, s, r


def _export(backend, ref, platform="tpu"):
    return jax.export.export(_step(backend), platforms=[platform])(*_specs(ref))


def _cpu_text(backend, ref) -> str:
    """The step lowered for CPU (lowered, not exported: jax.export refuses custom calls without
    its compatibility guarantee, which Tessera's FFI targets, built with the package, do not need)."""
    return _step(backend).trace(*_specs(ref)).lower(lowering_platforms=("cpu",)).as_text()


def _large_constants(text: str, limit: int = 4096) -> list:
    """Dense constants in the module whose payload is over ``limit`` bytes (hex blobs)."""
    return [m for m in re.findall(r'dense<"0x([0-9A-Fa-f]+)">', text) if len(m) // 2 > limit]


@pytest.mark.parametrize("backend", ["auto", "splash"])
def test_a_training_step_exports_for_tpu_with_the_mosaic_kernels(backend):
    exp = _export(backend, tj.plan_ref(_plan(0), splash=True, max_partial_blocks=BOUND))
    text = exp.mlir_module()
    assert exp.platforms == ("tpu",)
    assert "tpu_custom_call" in text
    assert MOSAIC <= set(re.findall(r"splash_mha_[a-z_]+", text))  # forward and backward
    assert "callback" not in text  # no host callback (interpret mode would need none either)
    assert "tessera_attention" not in text  # the FFI route is the CPU lowering's, not TPU's
    assert not _large_constants(text)
    # the contract: the step's arrays, then the plan's handle and MaskInfo leaves
    avals = [(tuple(a.shape), str(a.dtype)) for a in exp.in_avals]
    assert avals[:5] == [((1, H, L, D), "bfloat16"), ((1, HKV, L, D), "bfloat16"),
                         ((1, HKV, L, D), "bfloat16"), ((H,), "float32"), ((2,), "int32")]
    tiles = L // BLOCK
    assert ((1, 1, tiles, tiles), "int8") in avals[5:]
    assert ((1, BOUND, BLOCK, BLOCK), "bool") in avals[5:]


def test_five_plans_of_equal_shapes_serialize_to_identical_bytes():
    blobs = {bytes(_export("auto", tj.plan_ref(_plan(seed), splash=True, max_partial_blocks=BOUND)).serialize())
             for seed in range(5)}
    assert len(blobs) == 1
    # and the serialization round-trips (Tessera's pytrees are registered for jax.export)
    back = jax.export.deserialize(bytearray(blobs.pop()))
    # the step's 4 arrays, then the handle, 8 MaskInfo arrays, row_valid, the keys' positions
    assert back.platforms == ("tpu",) and len(back.in_avals) == 4 + 11


def test_the_same_step_lowered_for_cpu_runs_the_ffi_kernels_and_equals_the_plain_call():
    plan = _plan(3)
    ref = tj.plan_ref(plan, splash=True, max_partial_blocks=BOUND)
    text = _cpu_text("auto", ref)
    assert "tessera_attention_fwd" in text and "tpu_custom_call" not in text
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, H, L, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, HKV, L, D)), jnp.bfloat16) for _ in range(2))
    s = jnp.asarray(rng.standard_normal(H), jnp.float32)
    (l1, g1), (l2, g2) = _step("auto")(q, k, v, s, ref), _step("ffi")(q, k, v, s, plan)
    assert float(l1) == float(l2)
    for a, b in zip(g1, g2):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_plan_splash_cannot_run_raises_naming_block_when_lowered_for_tpu():
    ref = tj.plan_ref(_plan(0, block=64), splash=False)
    with pytest.raises(ValueError, match="block"):
        _export("auto", ref)
    # ... while the CPU lowering of the same step is unaffected
    assert "tessera_attention_fwd" in _cpu_text("auto", ref)
    with pytest.raises(ValueError, match="block"):
        tj.plan_ref(_plan(0, block=(128, 64)), splash=True)


def test_a_tpu_lowering_without_the_plans_mask_info_raises_naming_plan():
    with pytest.raises(ValueError, match="plan_ref"):
        _export("auto", _plan(1))
    with pytest.raises(ValueError, match="GPU"):
        _export("auto", tj.plan_ref(_plan(1), splash=True), platform="cuda")


def test_the_shard_map_context_parallel_step_exports_for_a_tpu_mesh(tmp_path):
    out = tmp_path / "export.json"
    _run(["export_cp", 2, out], tmp_path)
    import json

    r = json.loads(out.read_text())
    assert set(r["kernels"]) >= MOSAIC
    assert r["devices"] == 2 and not r["ffi"] and not r["callback"] and r["identical"]
