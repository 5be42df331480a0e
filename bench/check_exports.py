#!/usr/bin/env python3
"""Checks Tessera's Splash and Flex exports against the engines' own mask preprocessing.

Not part of the build or the tests. Needs `pip install jax torch numpy` (CPU wheels suffice):

    cargo run --release -p tessera-export --example export_cases -- /tmp/tessera-cases
    python3 bench/check_exports.py /tmp/tessera-cases [--kernels]

For every case written by the example (`cases.json`), with the dense token mask
`NAME.dense.npy` (bool [B', H, Lq, Lkv]):

* Splash: for each batch row, `process_mask` and `process_mask_dkv` of
  `MultiHeadMask([NumpyMask(mask_h padded with False to whole blocks)])` with the case's
  block shape, head_shards, q_seq_shards, shrink_grid and downcast options; every field of both
  `MaskInfo`s must equal the exported array (presence, dtype, shape, every entry).
* Flex: `create_block_mask(mask_mod reading the dense mask, B', H', Lq, Lkv, device="cpu",
  BLOCK_SIZE=(tq, tk))`; all eight tensors must equal the export (dtype, shape, every entry,
  unused index slots included), and `BlockMask.from_kv_blocks` on the exported kv tensors must
  rebuild the same q tensors.

`--kernels` additionally runs attention with the exported arrays (Splash kernel in Pallas
interpret mode on CPU, FlexAttention eager on CPU) against a dense softmax reference.
"""

import argparse
import json
import os
import sys

import numpy as np


def load_npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def compare(tag, want, got, problems):
    """want: reference array or None; got: exported array or None."""
    if want is None or got is None:
        if (want is None) != (got is None):
            problems.append(f"{tag}: reference {'None' if want is None else 'present'}, "
                            f"export {'None' if got is None else 'present'}")
        return
    want = np.asarray(want)
    got = np.asarray(got)
    if want.dtype != got.dtype:
        problems.append(f"{tag}: dtype {got.dtype} != reference {want.dtype}")
    if want.shape != got.shape:
        problems.append(f"{tag}: shape {got.shape} != reference {want.shape}")
        return
    if not np.array_equal(want, got):
        bad = np.argwhere(want != got)
        problems.append(f"{tag}: {len(bad)} entries differ, first at {tuple(bad[0])}: "
                        f"{got[tuple(bad[0])]} != reference {want[tuple(bad[0])]}")


def check_splash(case, dense, z, problems):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
        splash_attention_mask_info as mi,
    )

    tq, tk = case["tile"]
    lq, lkv = case["Lq"], case["Lkv"]
    pq, pk = -(-lq // tq) * tq, -(-lkv // tk) * tk
    compare("meta_padded_lengths", np.array([pq, pk]), z["meta_padded_lengths"], problems)
    nb = dense.shape[0]
    kw = dict(
        downcast_smem_data=case["downcast"],
        head_shards=case["head_shards"],
        q_seq_shards=case["q_seq_shards"],
    )
    for b in range(nb):
        padded = np.zeros((dense.shape[1], pq, pk), dtype=np.bool_)
        padded[:, :lq, :lkv] = dense[b]
        mhm = mask_lib.MultiHeadMask([mask_lib.NumpyMask(padded[h]) for h in range(padded.shape[0])])
        sfx = f"_b{b}" if nb > 1 else ""
        for kind, fn, shrink in (
            ("", mi.process_mask, case["shrink_grid"]),
            ("_dkv", mi.process_mask_dkv, case["shrink_grid_dkv"]),
        ):
            ref, fun = fn(mhm, (tq, tk), shrink_grid=shrink, **kw)
            if fun is not None or ref.q_sequence is not None:
                problems.append(f"splash{kind}{sfx}: reference uses a mask function")
            for field in ("data_next", "mask_next", "block_mask", "partial_mask_blocks"):
                compare(f"splash {field}{kind}{sfx}", getattr(ref, field), z.get(f"{field}{kind}{sfx}"), problems)


def flex_mask_mod(z):
    """The mask_mod of docs/export.md, built from the file alone."""
    import torch

    tq, tk = (int(x) for x in z["block_size"])
    states = torch.from_numpy(z["mask_tile_states"])
    ids = torch.from_numpy(z["mask_block_ids"])
    blocks = torch.from_numpy(z["mask_blocks"])
    bg, hg = states.shape[:2]

    def mask_mod(b, h, q_idx, kv_idx):
        b = b if bg > 1 else b * 0  # a B' or H' of 1 broadcasts
        h = h if hg > 1 else h * 0
        qb, kb = q_idx // tq, kv_idx // tk
        st = states[b, h, qb, kb]
        inside = blocks[ids[b, h, qb, kb].clamp(min=0), q_idx % tq, kv_idx % tk]
        return (st == 2) | ((st == 1) & inside)

    return mask_mod


def check_flex(case, dense, z, problems):
    import torch
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    tq, tk = case["tile"]
    lq, lkv = case["Lq"], case["Lkv"]
    bg, hg = case["batch_groups"], case["head_groups"]
    dt = torch.from_numpy(np.ascontiguousarray(dense[:, :hg]))

    def mask_mod(b, h, q, kv):
        return dt[b, h, q, kv]

    ref = create_block_mask(mask_mod, bg, hg, lq, lkv, device="cpu", BLOCK_SIZE=(tq, tk))
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for n in names:
        compare(f"flex {n}", getattr(ref, n).numpy(), z.get(n), problems)
    compare("flex block_size", np.array(ref.BLOCK_SIZE), z["block_size"], problems)
    compare("flex seq_lengths", np.array(ref.seq_lengths), z["seq_lengths"], problems)
    t = {n: torch.from_numpy(z[n]) for n in names}
    file_mod = flex_mask_mod(z)
    rebuilt = BlockMask.from_kv_blocks(
        t["kv_num_blocks"], t["kv_indices"], t["full_kv_num_blocks"], t["full_kv_indices"],
        BLOCK_SIZE=tuple(int(x) for x in z["block_size"]),
        mask_mod=file_mod, seq_lengths=tuple(int(x) for x in z["seq_lengths"]))
    # The file's own mask_mod reproduces the token mask.
    from torch.nn.attention.flex_attention import create_mask
    compare("flex file mask_mod", dense[:, :hg], create_mask(file_mod, bg, hg, lq, lkv, device="cpu").numpy(), problems)
    for n in names[4:]:
        compare(f"flex from_kv_blocks {n}", getattr(rebuilt, n).numpy(), z[n], problems)
    compare("flex to_dense", ref.to_dense().numpy(), rebuilt.to_dense().numpy(), problems)
    return rebuilt


def reference_attention(q, k, v, allowed):
    """float64 softmax attention; rows without an allowed key give 0."""
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(allowed, np.exp(s - m), 0.0)
    z = p.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v) / np.where(z > 0, z, 1.0)


def kernel_checks(case, dense, zs, zf, rebuilt, problems):
    """Runs attention with the exported arrays; compares rows that have an allowed key."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    tq, tk = case["tile"]
    lq, lkv = case["Lq"], case["Lkv"]
    bg, hg, h = case["batch_groups"], case["head_groups"], case["H"]
    d = 32
    rng = np.random.default_rng(0)
    q = rng.standard_normal((bg, h, lq, d))
    k = rng.standard_normal((bg, h, lkv, d))
    v = rng.standard_normal((bg, h, lkv, d))
    ref = reference_attention(q, k, v, dense)
    live = dense.any(-1)

    # FlexAttention compiled on CPU (the eager path ignores the block lists; the compiled
    # kernel visits only the listed blocks, masking partial ones with mask_mod).
    torch._dynamo.reset()  # a fresh static-shape compile per case (dynamic shapes hit codegen bugs)
    flex = torch.compile(flex_attention, dynamic=False)
    # `rebuilt` carries the mask_mod built from the file (flex_mask_mod), as in docs/export.md.
    f32 = lambda x: torch.from_numpy(x.astype(np.float32))
    out = flex(f32(q), f32(k), f32(v), block_mask=rebuilt).numpy()
    err = np.abs(out - ref)[live].max(initial=0.0)
    if err > 1e-4:
        problems.append(f"flex_attention (compiled, CPU) output differs from reference by {err}")

    # Splash kernel, Pallas interpret mode, with the exported MaskInfo.
    if zs is None or case["head_shards"] != 1 or case["q_seq_shards"] != 1 or tk % 128 != 0:
        return  # the kernel needs block_kv % 128 == 0; sharded infos need a mesh
    case["splash_kernel_checked"] = True
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask_info as mi,
    )

    pq, pk = [int(x) for x in zs["meta_padded_lengths"]]
    nb = dense.shape[0]
    for b in range(nb):
        sfx = f"_b{b}" if nb > 1 else ""

        def info(kind):
            g = lambda n: (jnp.asarray(zs[f"{n}{kind}{sfx}"]) if f"{n}{kind}{sfx}" in zs else None)
            return mi.MaskInfo(data_next=g("data_next"), mask_next=g("mask_next"),
                               block_mask=g("block_mask"),
                               partial_mask_blocks=g("partial_mask_blocks"), q_sequence=None)

        # As in docs/export.md: forward info also serves dQ; dKV info for dK/dV.
        bs = sk.BlockSizes(block_q=tq, block_kv=tk, block_q_dkv=tq, block_kv_dkv=tk,
                           block_q_dq=tq, block_kv_dq=tk)
        kern = sk.SplashAttentionKernel(info(""), info(""), info("_dkv"), block_sizes=bs,
                                        is_mqa=False, save_residuals=False,
                                        mask_value=sk.DEFAULT_MASK_VALUE,
                                        attn_logits_soft_cap=None, residual_checkpoint_name=None,
                                        mask_function=None, interpret=True)
        qp = np.zeros((h, pq, d), np.float32)
        kp = np.zeros((h, pk, d), np.float32)
        vp = np.zeros((h, pk, d), np.float32)
        qp[:, :lq] = q[b] / np.sqrt(d)
        kp[:, :lkv] = k[b]
        vp[:, :lkv] = v[b]
        out = np.asarray(jax.jit(kern)(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(vp)))[:, :lq]
        err = np.abs(out - ref[b])[live[b]].max(initial=0.0)
        if err > 1e-4:
            problems.append(f"splash kernel (interpret) output differs from reference by {err} (row {b})")

        # Backward through the dQ and dKV infos. The cotangent is zero on rows without any
        # allowed key (and on padding), whose Splash output is not defined.
        allowed = np.zeros((h, pq, pk), bool)
        allowed[:, :lq, :lkv] = dense[b]
        cot = np.zeros((h, pq, d), np.float32)
        cot[:, :lq] = rng.standard_normal((h, lq, d)) * live[b][..., None]
        am, ct = jnp.asarray(allowed), jnp.asarray(cot)

        def dense_attn(qq, kk, vv):
            s_ = jnp.einsum("hid,hjd->hij", qq, kk)
            s_ = jnp.where(am, s_, -1e30)
            p_ = jax.nn.softmax(s_, axis=-1) * am
            return jnp.einsum("hij,hjd->hid", p_, vv)

        args = (jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(vp))
        g_ref = jax.grad(lambda *a: jnp.sum(dense_attn(*a) * ct), argnums=(0, 1, 2))(*args)
        g_spl = jax.jit(jax.grad(lambda *a: jnp.sum(kern(*a) * ct), argnums=(0, 1, 2)))(*args)
        for name, gr, gs, n in zip(("dq", "dk", "dv"), g_ref, g_spl, (lq, lkv, lkv)):
            gr, gs = np.asarray(gr)[:, :n], np.asarray(gs)[:, :n]
            rel = np.linalg.norm(gs - gr) / max(np.linalg.norm(gr), 1e-30)
            if rel > 1e-4:
                problems.append(f"splash kernel (interpret) {name} differs from reference: rel {rel:.2e} (row {b})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--kernels", action="store_true", help="also run attention with the exports")
    ap.add_argument("--only", default=None, help="substring filter on case names")
    args = ap.parse_args()
    with open(os.path.join(args.dir, "cases.json")) as f:
        cases = json.load(f)
    failed = 0
    passed = 0
    for case in cases:
        if args.only and args.only not in case["name"]:
            continue
        name = case["name"]
        dense = np.load(os.path.join(args.dir, f"{name}.dense.npy"))
        zf = load_npz(os.path.join(args.dir, f"{name}.flex.npz"))
        problems = []
        zs = None
        if case.get("splash_error"):
            # Tessera refused (a q shard without active blocks under shrink_grid): so must JAX.
            try:
                check_splash(case, dense, {"meta_padded_lengths": np.array([
                    -(-case["Lq"] // case["tile"][0]) * case["tile"][0],
                    -(-case["Lkv"] // case["tile"][1]) * case["tile"][1]])}, [])
                problems.append("Tessera refused the splash export but process_mask succeeded")
            except AssertionError:
                pass
        else:
            zs = load_npz(os.path.join(args.dir, f"{name}.splash.npz"))
            try:
                check_splash(case, dense, zs, problems)
            except Exception as e:  # noqa: BLE001 - report and go on
                problems.append(f"splash check raised {type(e).__name__}: {e}")
        rebuilt = None
        try:
            rebuilt = check_flex(case, dense, zf, problems)
        except Exception as e:  # noqa: BLE001
            problems.append(f"flex check raised {type(e).__name__}: {e}")
        if args.kernels and rebuilt is not None:
            try:
                kernel_checks(case, dense, zs, zf, rebuilt, problems)
            except Exception as e:  # noqa: BLE001
                problems.append(f"kernel check raised {type(e).__name__}: {e}")
        status = "PASS" if not problems else "FAIL"
        if case.get("splash_error"):
            status += " (splash refused by both)"
        if case.get("splash_kernel_checked"):
            status += " (+flex and splash kernels)"
        elif args.kernels:
            status += " (+flex kernel)"
        print(f"{status} {name} [{case['mask']}] B={case['B']} H={case['H']} "
              f"Lq={case['Lq']} Lkv={case['Lkv']} tile={case['tile'][0]}x{case['tile'][1]} "
              f"shards=({case['head_shards']},{case['q_seq_shards']})")
        for p in problems:
            print(f"    {p}")
        if problems:
            failed += 1
        else:
            passed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
