//! Built-in, seeded workloads shared by `bench` and `demo`: named masks and random tensors.

use rand::{Rng, SeedableRng};
use tessera_core::{DType, Error, Result, Tensor};
use tessera_mask::{Mask, SegmentIds, Segments};

/// Packed documents with lengths uniform in [512, 1536] tokens (mean ~1K), seeded.
pub fn doc_segments(len: usize, seed: u64) -> Vec<i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
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
pub fn random_tensor(shape: Vec<usize>, dtype: DType, seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    match dtype {
        DType::F32 => Tensor::from_f32(shape, v),
        DType::BF16 => Tensor::from_bf16(shape, v.into_iter().map(half::bf16::from_f32).collect()),
        other => Err(Error::invalid("dtype", "f32 or bf16", other)),
    }
}
