//! The outlier stream: max |x|, sum of squares, element count and the count of elements above
//! `ratio × RMS` of their slice, for O or any activation tensor a caller hands in.

use crate::config::check_ratio;
use crate::exact::ExactSum;
use crate::summary::det_max;
use serde::{Deserialize, Serialize};
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{Error, Result};

/// Outlier statistics of one group (a query head for O). Merges exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutlierStats {
    /// Max |x| (NaN if any element was NaN; 0 when `count == 0`).
    pub abs_max: f64,
    /// Σ x² (each slice's sum is taken in f64 in element order, then added exactly).
    pub sq_sum: ExactSum,
    /// Number of elements.
    pub count: u64,
    /// Elements with `|x| > ratio × RMS(slice)`, RMS of the element's own slice.
    pub outliers: u64,
}

impl Default for OutlierStats {
    fn default() -> Self {
        OutlierStats {
            abs_max: 0.0,
            sq_sum: ExactSum::new(),
            count: 0,
            outliers: 0,
        }
    }
}

impl OutlierStats {
    /// Adds everything `other` holds.
    pub fn merge(&mut self, other: &OutlierStats) {
        self.abs_max = det_max(self.abs_max, other.abs_max);
        self.sq_sum.merge(&other.sq_sum);
        self.count += other.count;
        self.outliers += other.outliers;
    }

    /// `sqrt(sq_sum / count)`; NaN when `count == 0`.
    pub fn rms(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else {
            (self.sq_sum.value() / self.count as f64).sqrt()
        }
    }

    /// Statistics of one slice of `n` elements read through `get`, with the slice's own RMS as
    /// the outlier scale. Two passes; NaN elements are counted, never outliers, and make
    /// `abs_max` and the sums NaN.
    pub fn of_slice(n: usize, get: impl Fn(usize) -> f64, ratio: f64) -> OutlierStats {
        let mut sq = 0f64;
        let mut abs_max = 0f64;
        for i in 0..n {
            let x = get(i);
            sq += x * x;
            abs_max = det_max(abs_max, x.abs());
        }
        let mut out = OutlierStats {
            abs_max,
            sq_sum: ExactSum::new(),
            count: n as u64,
            outliers: 0,
        };
        if n == 0 {
            return out;
        }
        out.sq_sum.add(sq);
        let threshold = ratio * (sq / n as f64).sqrt();
        out.outliers = (0..n).filter(|&i| get(i).abs() > threshold).count() as u64;
        out
    }
}

/// Outlier statistics of an activation tensor (f32, bf16 or f16), one [`OutlierStats`] per group:
///
/// - rank ≥ 2, shape `[B, G, ...]`: G groups; slice `(b, g)` is the contiguous block
///   `x[b, g, ...]` (`prod(shape[2..])` elements; a rank-2 tensor has one-element slices);
///   group `g` merges its B slices. For O `[B, Hq, Lq, Dv]` the groups are the query heads.
/// - rank 1: one group of one slice (the whole tensor).
///
/// The outlier threshold is `ratio × RMS` of each slice, so statistics of batch shards merge
/// exactly into those of the whole batch. Empty tensors, rank 0 and non-float dtypes are errors.
pub fn outlier_summary(t: &TensorView<'_>, ratio: f64) -> Result<Vec<OutlierStats>> {
    check_ratio(ratio)?;
    let numel: usize = t.shape.iter().product();
    if t.shape.is_empty() || numel == 0 || t.len() != numel {
        return Err(Error::invalid(
            "activation tensor",
            "a non-empty tensor of rank >= 1",
            format!("shape {:?} with {} elements", t.shape, t.len()),
        ));
    }
    match t.data {
        ViewData::F32(v) => Ok(grouped(t.shape, ratio, |i| v[i] as f64)),
        ViewData::BF16(v) => Ok(grouped(t.shape, ratio, |i| v[i].to_f64())),
        ViewData::F16(v) => Ok(grouped(t.shape, ratio, |i| v[i].to_f64())),
        _ => Err(Error::invalid(
            "activation tensor",
            "a floating dtype (f32, bf16, f16)",
            t.dtype(),
        )),
    }
}

/// [`outlier_summary`] over f64 values shaped `shape` (used by the dense reference).
pub fn outlier_summary_f64(shape: &[usize], data: &[f64], ratio: f64) -> Result<Vec<OutlierStats>> {
    check_ratio(ratio)?;
    let numel: usize = shape.iter().product();
    if shape.is_empty() || numel == 0 || data.len() != numel {
        return Err(Error::invalid(
            "activation tensor",
            "a non-empty tensor of rank >= 1",
            format!("shape {shape:?} with {} elements", data.len()),
        ));
    }
    Ok(grouped(shape, ratio, |i| data[i]))
}

fn grouped(shape: &[usize], ratio: f64, get: impl Fn(usize) -> f64) -> Vec<OutlierStats> {
    let (batch, groups) = if shape.len() >= 2 {
        (shape[0], shape[1])
    } else {
        (1, 1)
    };
    let slice: usize = if shape.len() >= 2 {
        shape[2..].iter().product()
    } else {
        shape[0]
    };
    let mut out = vec![OutlierStats::default(); groups];
    for b in 0..batch {
        for (g, acc) in out.iter_mut().enumerate() {
            let base = (b * groups + g) * slice;
            acc.merge(&OutlierStats::of_slice(slice, |i| get(base + i), ratio));
        }
    }
    out
}
