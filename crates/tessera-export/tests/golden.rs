//! Golden values from the engines themselves (JAX 0.10.2, torch 2.15.0, CPU), so that the
//! exact-equality checks of `bench/check_exports.py` also hold without Python. Generated with:
//!
//! ```python
//! # splash: dense numpy masks padded with False to whole blocks
//! mhm = MultiHeadMask([NumpyMask(pad(m_h)) for m_h in masks])
//! info, _ = process_mask(mhm, (tq, tk), **kw); info_dkv, _ = process_mask_dkv(mhm, (tq, tk), **kw)
//! # partial_mask_blocks are summarized by the number of True entries per block ("pmb_sum")
//! # flex
//! bm = create_block_mask(lambda b, h, q, kv: dense[b, h, q, kv], 1, 1, Lq, Lkv, device="cpu",
//!                        BLOCK_SIZE=(tq, tk))
//! ```

use tessera_export::{flex, splash, SplashOptions};
use tessera_mask::Mask;
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

type Golden = [(&'static str, &'static str, &'static [usize], &'static [i64])];

const SPLASH_HEADS: &[(&str, &str, &[usize], &[i64])] = &[
    // data_next: int8 [3, 4, 4]
    (
        "data_next",
        "int8",
        &[3, 4, 4],
        &[
            0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2,
            2, 2, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 2, 0, 0, 1, 2, 3,
        ],
    ),
    // mask_next: int8 [3, 4, 4]
    (
        "mask_next",
        "int8",
        &[3, 4, 4],
        &[
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 1, 2, 2, 2, 2, 1, 2, 2,
            2, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ],
    ),
    // block_mask: int8 [3, 4, 4]
    (
        "block_mask",
        "int8",
        &[3, 4, 4],
        &[
            1, 0, 0, 0, 2, 1, 0, 0, 2, 2, 1, 0, 2, 2, 2, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0,
            0, 1, 1, 1, 0, 0, 0, 2, 1, 0, 0, 2, 2, 1, 0, 2, 2, 2, 1,
        ],
    ),
    // partial_mask_blocks: [3, 64, 64]
    // pmb_sum: int64 [3]
    ("pmb_sum", "int64", &[3], &[2080, 1804, 820]),
    // data_next_dkv: int8 [3, 4, 4]
    (
        "data_next_dkv",
        "int8",
        &[3, 4, 4],
        &[
            0, 1, 2, 3, 1, 1, 2, 3, 2, 2, 2, 3, 3, 3, 3, 3, 0, 1, 2, 3, 1, 1, 2, 3, 0, 2, 2, 3, 0,
            1, 3, 3, 0, 1, 2, 3, 1, 1, 2, 3, 2, 2, 2, 3, 3, 3, 3, 3,
        ],
    ),
    // mask_next_dkv: int8 [3, 4, 4]
    (
        "mask_next_dkv",
        "int8",
        &[3, 4, 4],
        &[
            0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 2, 1, 1, 1, 0, 2, 1, 1, 0,
            0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ],
    ),
    // block_mask_dkv: int8 [3, 4, 4]
    (
        "block_mask_dkv",
        "int8",
        &[3, 4, 4],
        &[
            1, 0, 0, 0, 2, 1, 0, 0, 2, 2, 1, 0, 2, 2, 2, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0,
            0, 1, 1, 1, 0, 0, 0, 2, 1, 0, 0, 2, 2, 1, 0, 2, 2, 2, 1,
        ],
    ),
    // partial_mask_blocks_dkv: [3, 64, 64]
    // pmb_sum_dkv: int64 [3]
    ("pmb_sum_dkv", "int64", &[3], &[2080, 1804, 820]),
];

const SPLASH_RAGGED_CAUSAL: &[(&str, &str, &[usize], &[i64])] = &[
    // data_next: int8 [1, 5, 10]
    (
        "data_next",
        "int8",
        &[1, 5, 10],
        &[
            0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0,
            0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
        ],
    ),
    // mask_next: int8 [1, 5, 10]
    (
        "mask_next",
        "int8",
        &[1, 5, 10],
        &[
            0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 3, 4,
        ],
    ),
    // block_mask: int8 [1, 5, 10]
    (
        "block_mask",
        "int8",
        &[1, 5, 10],
        &[
            1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 1, 1, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 0, 0, 0,
            0, 2, 2, 2, 2, 2, 2, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
        ],
    ),
    // partial_mask_blocks: [5, 128, 64]
    // pmb_sum: int64 [5]
    ("pmb_sum", "int64", &[5], &[6176, 2080, 5632, 3616, 300]),
    // data_next_dkv: int8 [1, 5, 10]
    (
        "data_next_dkv",
        "int8",
        &[1, 5, 10],
        &[
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 0, 0, 0,
            0, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        ],
    ),
    // mask_next_dkv: int8 [1, 5, 10]
    (
        "mask_next_dkv",
        "int8",
        &[1, 5, 10],
        &[
            0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 0, 1, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 0, 1, 0, 0, 0,
            0, 2, 2, 2, 2, 2, 2, 0, 1, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 3, 4,
        ],
    ),
    // block_mask_dkv: int8 [1, 5, 10]
    (
        "block_mask_dkv",
        "int8",
        &[1, 5, 10],
        &[
            1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 1, 1, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 0, 0, 0,
            0, 2, 2, 2, 2, 2, 2, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
        ],
    ),
    // partial_mask_blocks_dkv: [5, 64, 128]
    // pmb_sum_dkv: int64 [5]
    ("pmb_sum_dkv", "int64", &[5], &[6176, 2080, 5632, 3616, 300]),
];

const SPLASH_WINDOW_SHARDED: &[(&str, &str, &[usize], &[i64])] = &[
    // data_next: int8 [2, 8, 4]
    (
        "data_next",
        "int8",
        &[2, 8, 4],
        &[
            0, 1, 0, 0, 0, 1, 2, 0, 0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6, 4, 5, 6, 7, 5,
            6, 7, 0, 0, 1, 0, 0, 0, 1, 2, 0, 0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6, 4, 5,
            6, 7, 5, 6, 7, 0,
        ],
    ),
    // mask_next: int8 [2, 8, 4]
    (
        "mask_next",
        "int8",
        &[2, 8, 4],
        &[
            0, 1, 0, 0, 2, 0, 1, 0, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 3,
            2, 0, 0, 0, 1, 0, 0, 2, 0, 1, 0, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 3, 2,
            0, 1, 3, 2, 0, 0,
        ],
    ),
    // block_mask: int8 [2, 8, 4]
    (
        "block_mask",
        "int8",
        &[2, 8, 4],
        &[
            1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
            1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
            1, 1, 1, 1, 1, 0,
        ],
    ),
    // partial_mask_blocks: [4, 64, 64]
    // pmb_sum: int64 [4]
    ("pmb_sum", "int64", &[4], &[3535, 465, 3718, 666]),
    // data_next_dkv: int8 [2, 8, 8]
    (
        "data_next_dkv",
        "int8",
        &[2, 8, 8],
        &[
            0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 2, 2, 2, 0, 0, 0, 0, 2, 3, 3, 3, 3,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 2, 2, 2, 0, 0,
            0, 1, 2, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 2, 2, 2, 0, 0, 0,
            0, 2, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0,
            1, 2, 2, 2, 0, 0, 0, 1, 2, 3, 3, 3,
        ],
    ),
    // mask_next_dkv: int8 [2, 8, 8]
    (
        "mask_next_dkv",
        "int8",
        &[2, 8, 8],
        &[
            0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 2, 2, 0, 1, 0, 0, 0, 0, 3, 3, 2, 0, 1,
            0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 2, 2, 2, 0, 1, 0, 0,
            3, 3, 3, 3, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 2, 2, 0, 1, 0, 0, 0,
            0, 3, 3, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 2,
            2, 2, 0, 1, 0, 0, 3, 3, 3, 3, 2, 0,
        ],
    ),
    // block_mask_dkv: int8 [2, 8, 8]
    (
        "block_mask_dkv",
        "int8",
        &[2, 8, 8],
        &[
            0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1,
            0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0,
            1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0,
            0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1,
            1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1,
        ],
    ),
    // partial_mask_blocks_dkv: [4, 64, 64]
    // pmb_sum_dkv: int64 [4]
    ("pmb_sum_dkv", "int64", &[4], &[3535, 465, 3718, 666]),
];

const FLEX_RAGGED_CAUSAL: &[(&str, &str, &[usize], &[i64])] = &[
    // kv_num_blocks: int32 [1, 1, 4]
    ("kv_num_blocks", "int32", &[1, 1, 4], &[2, 2, 2, 7]),
    // kv_indices: int32 [1, 1, 4, 7]
    (
        "kv_indices",
        "int32",
        &[1, 1, 4, 7],
        &[
            0, 1, 2, 3, 4, 5, 6, 2, 3, 0, 1, 4, 5, 6, 4, 5, 0, 1, 2, 3, 6, 0, 1, 2, 3, 4, 5, 6,
        ],
    ),
    // full_kv_num_blocks: int32 [1, 1, 4]
    ("full_kv_num_blocks", "int32", &[1, 1, 4], &[0, 2, 4, 0]),
    // full_kv_indices: int32 [1, 1, 4, 7]
    (
        "full_kv_indices",
        "int32",
        &[1, 1, 4, 7],
        &[
            0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6,
        ],
    ),
    // q_num_blocks: int32 [1, 1, 7]
    ("q_num_blocks", "int32", &[1, 1, 7], &[2, 2, 2, 2, 2, 2, 1]),
    // q_indices: int32 [1, 1, 7, 4]
    (
        "q_indices",
        "int32",
        &[1, 1, 7, 4],
        &[
            0, 3, 1, 2, 0, 3, 1, 2, 1, 3, 0, 2, 1, 3, 0, 2, 2, 3, 0, 1, 2, 3, 0, 1, 3, 0, 1, 2,
        ],
    ),
    // full_q_num_blocks: int32 [1, 1, 7]
    (
        "full_q_num_blocks",
        "int32",
        &[1, 1, 7],
        &[2, 2, 1, 1, 0, 0, 0],
    ),
    // full_q_indices: int32 [1, 1, 7, 4]
    (
        "full_q_indices",
        "int32",
        &[1, 1, 7, 4],
        &[
            1, 2, 0, 3, 1, 2, 0, 3, 2, 0, 1, 3, 2, 0, 1, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
        ],
    ),
];

const FLEX_WINDOW_CROSS: &[(&str, &str, &[usize], &[i64])] = &[
    // kv_num_blocks: int32 [1, 1, 5]
    ("kv_num_blocks", "int32", &[1, 1, 5], &[1, 2, 2, 3, 2]),
    // kv_indices: int32 [1, 1, 5, 4]
    (
        "kv_indices",
        "int32",
        &[1, 1, 5, 4],
        &[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 0, 3],
    ),
    // full_kv_num_blocks: int32 [1, 1, 5]
    ("full_kv_num_blocks", "int32", &[1, 1, 5], &[0, 0, 0, 0, 0]),
    // full_kv_indices: int32 [1, 1, 5, 4]
    (
        "full_kv_indices",
        "int32",
        &[1, 1, 5, 4],
        &[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3],
    ),
    // q_num_blocks: int32 [1, 1, 4]
    ("q_num_blocks", "int32", &[1, 1, 4], &[4, 4, 2, 0]),
    // q_indices: int32 [1, 1, 4, 5]
    (
        "q_indices",
        "int32",
        &[1, 1, 4, 5],
        &[0, 1, 2, 3, 4, 1, 2, 3, 4, 0, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4],
    ),
    // full_q_num_blocks: int32 [1, 1, 4]
    ("full_q_num_blocks", "int32", &[1, 1, 4], &[0, 0, 0, 0]),
    // full_q_indices: int32 [1, 1, 4, 5]
    (
        "full_q_indices",
        "int32",
        &[1, 1, 4, 5],
        &[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4],
    ),
];

fn plan(mask: Mask, h: usize, lq: usize, lkv: usize, tq: usize, tk: usize) -> Plan {
    build_plan(
        &mask,
        PlanShape::new(1, h, lq, lkv).unwrap(),
        TileShape::new(tq, tk).unwrap(),
    )
    .unwrap()
}

fn check_splash(golden: &Golden, s: &splash::SplashArrays) {
    assert_eq!(s.rows.len(), 1);
    let row = &s.rows[0];
    for &(name, dtype, shape, values) in golden {
        let (base, info) = match name.strip_suffix("_dkv") {
            Some(b) => (b, &row.dkv),
            None => (name, &row.fwd),
        };
        if base == "pmb_sum" {
            let p = info.partial_mask_blocks.as_ref().expect("partial blocks");
            let sz = p.shape[1] * p.shape[2];
            let sums: Vec<i64> = (0..p.shape[0])
                .map(|k| p.data[k * sz..(k + 1) * sz].iter().filter(|&&x| x).count() as i64)
                .collect();
            assert_eq!(sums, values, "{name}");
            continue;
        }
        let a = match base {
            "data_next" => &info.data_next,
            "mask_next" => info.mask_next.as_ref().expect("mask_next"),
            "block_mask" => &info.block_mask,
            _ => unreachable!("{name}"),
        };
        assert_eq!(a.dtype.name(), dtype, "{name} dtype");
        assert_eq!(&a.shape[..], shape, "{name} shape");
        let got: Vec<i64> = a.data.iter().map(|&v| v as i64).collect();
        assert_eq!(got, values, "{name}");
    }
}

fn check_flex(golden: &Golden, f: &flex::FlexArrays) {
    let (nq, nk) = f.blocks;
    for &(name, dtype, shape, values) in golden {
        assert_eq!(dtype, "int32");
        let (v, want_shape) = match name {
            "kv_num_blocks" => (&f.kv_num_blocks, vec![1, 1, nq]),
            "kv_indices" => (&f.kv_indices, vec![1, 1, nq, nk]),
            "full_kv_num_blocks" => (&f.full_kv_num_blocks, vec![1, 1, nq]),
            "full_kv_indices" => (&f.full_kv_indices, vec![1, 1, nq, nk]),
            "q_num_blocks" => (&f.q_num_blocks, vec![1, 1, nk]),
            "q_indices" => (&f.q_indices, vec![1, 1, nk, nq]),
            "full_q_num_blocks" => (&f.full_q_num_blocks, vec![1, 1, nk]),
            "full_q_indices" => (&f.full_q_indices, vec![1, 1, nk, nq]),
            _ => unreachable!("{name}"),
        };
        assert_eq!(shape, &want_shape[..], "{name} shape");
        let got: Vec<i64> = v.iter().map(|&x| x as i64).collect();
        assert_eq!(got, values, "{name}");
    }
}

#[test]
fn splash_matches_jax_heads_without_shrinking() {
    let m = Mask::heads(vec![Mask::causal(), Mask::window(40, 0), Mask::causal()]);
    check_splash(
        SPLASH_HEADS,
        &splash::export(&plan(m, 3, 256, 256, 64, 64)).unwrap(),
    );
}

#[test]
fn splash_matches_jax_ragged_causal_shrunk() {
    check_splash(
        SPLASH_RAGGED_CAUSAL,
        &splash::export(&plan(Mask::causal(), 1, 600, 600, 128, 64)).unwrap(),
    );
}

#[test]
fn splash_matches_jax_sharded_window() {
    let o = SplashOptions {
        head_shards: 2,
        q_seq_shards: 2,
        ..SplashOptions::default()
    };
    let p = plan(Mask::window(100, 30), 2, 512, 512, 64, 64);
    check_splash(SPLASH_WINDOW_SHARDED, &splash::export_with(&p, &o).unwrap());
}

#[test]
fn flex_matches_torch_ragged_causal() {
    check_flex(
        FLEX_RAGGED_CAUSAL,
        &flex::export(&plan(Mask::causal(), 1, 200, 200, 64, 32)).unwrap(),
    );
}

#[test]
fn flex_matches_torch_window_cross() {
    check_flex(
        FLEX_WINDOW_CROSS,
        &flex::export(&plan(Mask::window(50, 10), 1, 160, 224, 32, 64)).unwrap(),
    );
}
