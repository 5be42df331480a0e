//! The online softmax of the forward kernels: running row maxima and rescale factors per kv
//! tile ([`update_max`]), the column maxima of a score tile ([`column_max`]), and the final
//! normalisation of a row with the optional sink logit ([`finish_row`]).
//!
//! Contract (SPEC §4): a row with nothing allowed yet keeps `-inf` as its max but exponentiates
//! against 0, so masked logits give exactly 0 and NaN logits stay NaN; a finished row with no
//! allowed key gets `O = 0` and `LSE = σ` (or `-inf` without a sink), never NaN.

use super::simd::{self, Simd};

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Online-softmax step shared by the forward kernels: folds this tile's column maxima `col` into
/// the running maxima `m`, and gives the exponent base `m_use` and the rescale factor `alpha` of
/// the previous sums for every row.
#[inline(always)]
pub(crate) fn update_max<S: Simd>(
    col: &[f32],
    m: &mut [f32],
    m_use: &mut [f32],
    alpha: &mut [f32],
) {
    for i in 0..col.len() {
        let m_old = m[i];
        let m_new = if col[i] > m_old { col[i] } else { m_old };
        // A row with nothing allowed yet keeps -inf as its max but exponentiates against 0,
        // so masked logits give exactly 0 and NaN logits stay NaN.
        let u = if m_new == NEG_INF { 0.0 } else { m_new };
        m_use[i] = u;
        // The sums so far were taken against `m_old·B`, the new terms against `u·B`, each
        // rounded once in the copy's base `B` (see `simd::exp_base`): the rescale is exactly
        // the shift between those two references (exact when they are within a factor 2).
        let b = simd::exp_base::<S>();
        alpha[i] = if m_old == u {
            1.0
        } else {
            simd::softmax_exp::<S>(m_old * b - u * b)
        };
        m[i] = m_new;
    }
}

/// Normalization of one finished row of copy `S` from its running max `m` and sum `l`: returns
/// the factor that turns the accumulated `orow` into O, and the row's LSE (the sink joins the
/// denominator). The sum was taken against the reference `m·B` rounded once in the copy's base
/// `B`, so the LSE adds that reference back exactly (`fl(m·B)/B` in f64; `m` when `B = 1`), not
/// `m`: the rounding of the reference cancels. A row with no allowed key gets O = 0 (`orow` is
/// zeroed) and LSE = σ, or -inf without a sink.
#[inline]
pub(crate) fn finish_row<S: Simd>(
    l: f32,
    m: f32,
    sink: Option<f64>,
    orow: &mut [f32],
) -> (f64, f64) {
    let b = simd::exp_base::<S>();
    let (li, mi) = (l as f64, (m * b) as f64 / b as f64);
    if li == 0.0 {
        orow.fill(0.0);
        return (0.0, sink.unwrap_or(f64::NEG_INFINITY));
    }
    let a = mi + li.ln();
    match sink {
        None => (1.0 / li, a),
        Some(sg) => {
            let hi = a.max(sg);
            let lse = hi + ((a - hi).exp() + (sg - hi).exp()).ln();
            ((mi - lse).exp(), lse)
        }
    }
}

/// `col[i] = max(col[i], s[i])` for `start <= i < s.len()` (NaN ignored).
#[inline(always)]
pub(crate) fn column_max(s: &[f32], col: &mut [f32], start: usize) {
    for (c, &x) in col[start..].iter_mut().zip(&s[start..]) {
        *c = if x > *c { x } else { *c };
    }
}
