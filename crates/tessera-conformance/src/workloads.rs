//! The seeded workloads every consumer shares (conformance cases, tests, the CLI's `bench` and
//! `demo`, the criterion benches): one RNG ([`rng`], ChaCha8), random attention inputs, packed
//! document segment ids, band features and the benchmark suite's named masks.
//!
//! Contract: every function is a pure function of its arguments and seed, identical on every
//! machine and run.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_core::{DType, Error, Result, Tensor};
use tessera_mask::{BandFeatures, BlockSelection, DenseMask, Mask, SegmentIds, Segments};

/// The one seeded generator of the workloads.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in ±√3 (unit variance), never exactly zero.
pub fn random_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let a = 3f32.sqrt();
    (0..n)
        .map(|_| {
            let x: f32 = rng.gen_range(-a..a);
            if x == 0.0 {
                0.5
            } else {
                x
            }
        })
        .collect()
}

/// Packed documents with lengths uniform in [512, 1536] tokens (mean ~1K), seeded.
pub fn doc_segments(len: usize, seed: u64) -> Vec<i64> {
    let mut rng = rng(seed);
    let mut ids = Vec::with_capacity(len);
    let mut doc = 0;
    while ids.len() < len {
        let n = rng.gen_range(512..=1536).min(len - ids.len());
        ids.extend(std::iter::repeat_n(doc, n));
        doc += 1;
    }
    ids
}

/// The benchmark suite's masks by name, for sequence length `len`.
pub const MASK_NAMES: [&str; 6] = ["full", "causal", "documents", "window", "prefix", "chunked"];

/// The suite's mask `name` at length `len`, with its display label.
pub fn named_mask(name: &str, len: usize) -> Result<(String, Mask)> {
    Ok(match name {
        "full" => ("full".into(), Mask::full()),
        "causal" => ("causal".into(), Mask::causal()),
        "documents" => {
            let segs = SegmentIds::shared(doc_segments(len, 7))?;
            (
                "causal & document (~1K docs)".into(),
                Mask::causal() & Mask::document(Segments::shared(segs)),
            )
        }
        "window" => (
            "window(1024) & causal".into(),
            Mask::window(1024, 0) & Mask::causal(),
        ),
        "prefix" => (
            "causal | prefix(1024)".into(),
            Mask::causal() | Mask::prefix(1024),
        ),
        "chunked" => (
            "chunk(1024) & causal".into(),
            Mask::chunk(1024) & Mask::causal(),
        ),
        other => {
            return Err(Error::invalid(
                "--masks",
                format!("names among {}", MASK_NAMES.join(", ")),
                other,
            ))
        }
    })
}

/// A tensor of seeded values uniform in [-1, 1) (never all zeros) in `dtype` (f32 or bf16).
/// Shapes come from flags (`bench --dims`, `demo --seq-len`): the element count is checked for
/// overflow and the memory budget before anything is allocated.
pub fn random_tensor(shape: Vec<usize>, dtype: DType, seed: u64) -> Result<Tensor> {
    let n128 = shape
        .iter()
        .fold(1u128, |a, &d| a.saturating_mul(d as u128));
    // The f32 values plus the tensor built from them.
    tessera_core::budget::check(|| format!("a {shape:?} {dtype} workload tensor"), 8 * n128)?;
    let n = usize::try_from(n128).map_err(|_| {
        Error::invalid(
            "tensor shape",
            "a size that fits in memory",
            format!("{shape:?}"),
        )
    })?;
    let mut rng = rng(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    match dtype {
        DType::F32 => Tensor::from_f32(shape, v),
        DType::BF16 => Tensor::from_bf16(shape, v.into_iter().map(half::bf16::from_f32).collect()),
        other => Err(Error::invalid("dtype", "f32 or bf16", other)),
    }
}

/// Seeded packed-document segment ids, `rows` rows of `len`: documents of 1..=`max_doc` tokens,
/// a padding tail (-1) of up to a quarter of the row (different per row), and in odd rows a
/// padding gap in the middle too.
pub fn packed_segments(rows: usize, len: usize, max_doc: usize, seed: u64) -> Result<SegmentIds> {
    let mut rng = rng(seed);
    let mut ids = Vec::with_capacity(rows * len);
    for r in 0..rows {
        let pad = rng.gen_range(0..=len / 4);
        let mut row = Vec::with_capacity(len);
        let mut doc = 0i64;
        while row.len() < len - pad {
            let n = rng.gen_range(1..=max_doc.max(1)).min(len - pad - row.len());
            row.extend(std::iter::repeat_n(doc, n));
            doc += 1;
        }
        row.resize(len, -1);
        if r % 2 == 1 && len >= 8 {
            let at = len / 3;
            for x in &mut row[at..at + len / 8] {
                *x = -1;
            }
        }
        ids.extend(row);
    }
    SegmentIds::new(rows, len, ids)
}

/// A seeded random dense mask of the given shape (`[Lq, Lkv]`, `[H, Lq, Lkv]` or
/// `[B, H, Lq, Lkv]`), each pair allowed with probability `p`.
pub fn random_dense(shape: &[usize], p: f64, seed: u64) -> Result<Mask> {
    let mut rng = rng(seed);
    let n: usize = shape.iter().product();
    let vals: Vec<bool> = (0..n).map(|_| rng.gen_bool(p)).collect();
    Ok(Mask::dense(DenseMask::new(shape, &vals, "random")?))
}

/// A seeded `band(f, g, lo, hi)` over `rows` rows of features: with `sorted`, "time stamps" that
/// advance by 0, 1 or 2 per token (queries and keys drawn separately); otherwise values uniform in
/// `[0, L / 4]` in any order.
pub fn random_band(
    rows: usize,
    (q_len, kv_len): (usize, usize),
    (lo, hi): (i64, i64),
    sorted: bool,
    seed: u64,
) -> Result<Mask> {
    let mut rng = rng(seed);
    let mut feature = |len: usize| -> Vec<i64> {
        let mut t = 0i64;
        (0..rows * len)
            .map(|_| {
                if sorted {
                    t += rng.gen_range(0..=2);
                    t
                } else {
                    rng.gen_range(0..=(len / 4) as i64)
                }
            })
            .collect()
    };
    let (f, g) = (feature(q_len), feature(kv_len));
    let q = SegmentIds::named("q_feature", rows, q_len, f)?;
    let kv = SegmentIds::named("kv_feature", rows, kv_len, g)?;
    Ok(Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi))
}

/// A seeded random block selection (docs/semantics.md#masks) `shape = [B, H, Tq, k]` of kv blocks below `tk`
/// for blocks of `q_block` x `kv_block` tokens: each row keeps its diagonal block (clipped to
/// `tk`) and `k - 1` earlier-or-equal blocks, some entries `-1`, duplicates allowed, and one row
/// in seven selects nothing.
pub fn random_blocks(
    shape: [usize; 4],
    tk: usize,
    q_block: usize,
    kv_block: usize,
    seed: u64,
) -> Result<Mask> {
    let mut rng = rng(seed);
    let [b, h, tq, k] = shape;
    let mut entries = Vec::with_capacity(b * h * tq * k);
    for r in 0..b * h * tq {
        let diag = (r % tq).min(tk.saturating_sub(1)) as i64;
        let none = rng.gen_range(0..7) == 0;
        for c in 0..k {
            entries.push(match (none, c) {
                (true, _) => -1,
                (false, 0) => diag,
                _ if rng.gen_bool(0.25) => -1,
                _ => rng.gen_range(0..=diag),
            });
        }
    }
    Ok(Mask::blocks(BlockSelection::new(
        &shape, &entries, q_block, kv_block, "kv_tiles",
    )?))
}
