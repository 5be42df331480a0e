//! The online softmax of the forward kernels: running row maxima and rescale factors per kv
//! tile ([`update_max`]), the column maxima of a score tile ([`column_max`]), and the final
//! normalisation of a row with the optional sink logit ([`finish_row`]).
//!
//! Contract (docs/semantics.md#attention): a row with nothing allowed yet keeps `-inf` as its max but exponentiates
//! against 0, so masked logits give exactly 0 and NaN logits stay NaN; a finished row with no
//! allowed key gets `O = 0` and `LSE = σ` (or `-inf` without a sink), never NaN.

use super::simd::{self, Simd};

const NEG_INF: f32 = f32::NEG_INFINITY;

/// How far a row's running max may rise above its exponent reference before the reference
/// follows it, in the copy's base (`simd::exp_base`): the probabilities then reach at most 2^8
/// (e^8 on the portable copy), harmless in f32 and in bf16, and most tiles need no rescale of
/// the running sums and of O (the conditional rescaling of FlashAttention-4).
const LAZY: f32 = 8.0;

/// Online-softmax step shared by the forward kernels: folds this tile's column maxima `col` into
/// the running maxima `m`, and gives every row its exponent reference `m_use` (`u`: the
/// exponentials are `exp(s − u)`) and the factor `alpha` that moves the previous sums to it.
/// The reference stays where it was while the new max is within [`LAZY`] of it (`alpha = 1`);
/// otherwise it becomes the new max. A row with nothing allowed yet keeps `-inf` as its max but
/// exponentiates against 0, so masked logits give exactly 0 and NaN logits stay NaN.
#[inline(always)]
pub(crate) fn update_max<S: Simd>(
    col: &[f32],
    m: &mut [f32],
    m_use: &mut [f32],
    alpha: &mut [f32],
) {
    let b = simd::exp_base::<S>();
    for i in 0..col.len() {
        let m_old = m[i];
        let m_new = if col[i] > m_old { col[i] } else { m_old };
        // `m_use` holds the previous reference only once the row has a max.
        let keep = m_old != NEG_INF && m_new * b - m_use[i] * b <= LAZY;
        let u = if keep {
            m_use[i]
        } else if m_new == NEG_INF {
            0.0
        } else {
            m_new
        };
        // The sums so far were taken against the old reference `·B`, the new terms against
        // `u·B`, each rounded once in the copy's base `B`: the rescale is exactly the shift
        // between the two (exact when they are within a factor 2). Nothing was summed yet
        // while the max was -inf.
        alpha[i] = if keep {
            1.0
        } else if m_old == NEG_INF {
            0.0
        } else {
            simd::softmax_exp::<S>(m_use[i] * b - u * b)
        };
        m_use[i] = u;
        m[i] = m_new;
    }
}

/// Normalization of one finished row of copy `S` from its exponent reference `m` (`m_use` of
/// [`update_max`]) and sum `l`: returns the factor that turns the accumulated `orow` into O, and
/// the row's LSE (the sink joins the denominator). The sum was taken against `m·B` rounded once
/// in the copy's base `B`, so the LSE adds that reference back exactly (`fl(m·B)/B` in f64; `m`
/// when `B = 1`): the rounding of the reference cancels. A row with no allowed key gets O = 0
/// (`orow` is zeroed) and LSE = σ, or -inf without a sink.
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
