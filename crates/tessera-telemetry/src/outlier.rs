//! The outlier stream: max |x|, sum of squares, element count and the count of elements above
//! `ratio × RMS` of their slice, for O or any activation tensor a caller hands in.

use crate::config::check_ratio;
use crate::exact::{det_max, ExactSum};
use serde::{Deserialize, Serialize};
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{Error, Result};

/// Outlier statistics of one group (a query head for O). Merges exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutlierStats {
    /// Max |x| (NaN if any element was NaN; 0 when `count == 0`).
    pub abs_max: f64,
    /// Σ x² (each slice's sum is taken in f64 in the fixed order of [`OutlierStats::of_f64`],
    /// then added exactly).
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
    /// the outlier scale: the same as [`OutlierStats::of_f64`] on the values.
    pub fn of_slice(n: usize, get: impl Fn(usize) -> f64, ratio: f64) -> OutlierStats {
        let vals: Vec<f64> = (0..n).map(get).collect();
        Self::of_f64(&vals, ratio)
    }

    /// Statistics of one slice of f64 values with the slice's own RMS as the outlier scale.
    ///
    /// Two passes. `Σ x²` is taken in f64 in a fixed order: element `i` goes to lane `i mod 8`,
    /// the lanes are added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`. NaN elements
    /// are counted, never outliers, and make `abs_max` and the sums NaN.
    pub fn of_f64(x: &[f64], ratio: f64) -> OutlierStats {
        let mut sq = [0f64; LANES];
        let mut mx = [0f64; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                sq[l] += c[l] * c[l];
                let a = c[l].abs();
                mx[l] = if a > mx[l] { a } else { mx[l] };
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            sq[l] += v * v;
            let a = v.abs();
            mx[l] = if a > mx[l] { a } else { mx[l] };
        }
        let (mut out, threshold) = finish_pass(x.len(), &sq, &mx, ratio);
        if !x.is_empty() {
            out.outliers = x.iter().filter(|v| v.abs() > threshold).count() as u64;
        }
        out
    }

    /// [`OutlierStats::of_f64`] of the values of an f32 slice (bit for bit the same statistics;
    /// the max and the outlier test run in f32, exactly). Runs a copy compiled for AVX-512 or
    /// AVX2 where the CPU has it: the same operations in the same order, so the same bits.
    pub fn of_f32(x: &[f32], ratio: f64) -> OutlierStats {
        #[cfg(target_arch = "x86_64")]
        {
            use tessera_core::cpu_features::{has, Feature};
            if has(Feature::Avx512f) {
                // SAFETY: the CPU has the features the copy is compiled for.
                return unsafe { of_f32_avx512(x, ratio) };
            }
            if has(Feature::Avx2) {
                // SAFETY: as above.
                return unsafe { of_f32_avx2(x, ratio) };
            }
        }
        of_f32_body(x, ratio)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn of_f32_avx512(x: &[f32], ratio: f64) -> OutlierStats {
    of_f32_body(x, ratio)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn of_f32_avx2(x: &[f32], ratio: f64) -> OutlierStats {
    of_f32_body(x, ratio)
}

/// The body of [`OutlierStats::of_f32`]: `v·v` of an f32 `v` is exact in f64 and no float
/// operation is reassociated or fused, so every compiled copy gives the same bits.
#[inline(always)]
fn of_f32_body(x: &[f32], ratio: f64) -> OutlierStats {
    let mut sq = [0f64; LANES];
    let mut mx = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            let v = c[l] as f64;
            sq[l] += v * v;
            let a = c[l].abs();
            mx[l] = if a > mx[l] { a } else { mx[l] };
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        sq[l] += v as f64 * v as f64;
        let a = v.abs();
        mx[l] = if a > mx[l] { a } else { mx[l] };
    }
    let (mut out, threshold) = finish_pass(x.len(), &sq, &mx.map(|m| m as f64), ratio);
    if !x.is_empty() {
        // For an f32 a: a > t (real numbers) iff a > the largest f32 <= t.
        let mut t = threshold as f32;
        if (t as f64) > threshold {
            t = f32::from_bits(t.to_bits() - 1);
        }
        out.outliers = x.iter().filter(|v| v.abs() > t).count() as u64;
    }
    out
}

/// Lanes of the fixed-order sums of squares.
const LANES: usize = 8;

/// The first pass's result (abs_max, Σ x², count) and the outlier threshold `ratio × RMS`.
fn finish_pass(n: usize, sq: &[f64; LANES], mx: &[f64; LANES], ratio: f64) -> (OutlierStats, f64) {
    let total = ((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]));
    // Any NaN element makes its lane's sum, hence the total, NaN (squares are never -inf).
    let abs_max = if total.is_nan() {
        f64::NAN
    } else {
        mx.iter().fold(0f64, |a, &m| det_max(a, m))
    };
    let mut out = OutlierStats {
        abs_max,
        sq_sum: ExactSum::new(),
        count: n as u64,
        outliers: 0,
    };
    if n == 0 {
        return (out, f64::NAN);
    }
    out.sq_sum.add(total);
    (out, ratio * (total / n as f64).sqrt())
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
        ViewData::F32(v) => Ok(grouped(t.shape, |off, n| {
            OutlierStats::of_f32(&v[off..off + n], ratio)
        })),
        ViewData::BF16(v) => Ok(grouped(t.shape, |off, n| {
            let x: Vec<f32> = v[off..off + n].iter().map(|x| x.to_f32()).collect();
            OutlierStats::of_f32(&x, ratio)
        })),
        ViewData::F16(v) => Ok(grouped(t.shape, |off, n| {
            let x: Vec<f32> = v[off..off + n].iter().map(|x| x.to_f32()).collect();
            OutlierStats::of_f32(&x, ratio)
        })),
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
    Ok(grouped(shape, |off, n| {
        OutlierStats::of_f64(&data[off..off + n], ratio)
    }))
}

/// The slices `[B, G, rest]` of a tensor, as `(group, offset, len)` in batch-major order.
fn slices(shape: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> {
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
    (0..batch * groups).map(move |bg| (bg % groups, bg * slice, slice))
}

/// Per-group statistics: every slice through `stats`, merged per group in batch order.
fn grouped(shape: &[usize], stats: impl Fn(usize, usize) -> OutlierStats) -> Vec<OutlierStats> {
    let groups = if shape.len() >= 2 { shape[1] } else { 1 };
    let mut out = vec![OutlierStats::default(); groups];
    for (g, off, len) in slices(shape) {
        out[g].merge(&stats(off, len));
    }
    out
}
