//! Vectorizable scalar math for the CPU kernels: exp, tanh, row reductions, bf16 widening.
//!
//! Contract: every function here is `#[inline(always)]` plain arithmetic (no libm calls, no
//! branches that block vectorization) so that, inlined into a `#[target_feature]` kernel copy,
//! LLVM turns the row loops into AVX-512 (or AVX2) code. NaN inputs give NaN outputs; `exp(-inf)`
//! is exactly 0. Reductions use 16 independent lanes and a fixed combination order, so results
//! are deterministic.

use half::bf16;

/// Instruction-set flavour a kernel copy is compiled for.
pub(crate) trait Simd: Copy + Send + Sync + 'static {
    /// Whether fused multiply-add is available (then `mul_add` is one instruction).
    const FMA: bool;
    /// Whether 32 wide vector registers are available: the GEMM micro-kernel then uses
    /// 4×64 accumulator blocks (16 zmm), else 4×16 (8 ymm) so nothing spills.
    const WIDE: bool;
    /// Whether this is the x86-64 AVX2 + FMA copy: the GEMM then runs its explicit ymm block.
    const YMM: bool = false;

    /// `a * b + c`, fused when the target has FMA (a libm call otherwise, so never used then).
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        if Self::FMA {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
}

/// AVX-512F/BW/VL + FMA copy (x86-64 only).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx512;
impl Simd for Avx512 {
    const FMA: bool = true;
    const WIDE: bool = true;
}

/// AVX2 + FMA copy (x86-64 only).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Avx2;
impl Simd for Avx2 {
    const FMA: bool = true;
    const WIDE: bool = false;
    const YMM: bool = cfg!(target_arch = "x86_64");
}

/// Portable copy (baseline target features, no FMA).
#[derive(Clone, Copy)]
pub(crate) struct Portable;
impl Simd for Portable {
    const FMA: bool = false;
    const WIDE: bool = false;
}

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// 1.5·2^23: adding it rounds a float of magnitude < 2^22 to an integer held in the low mantissa.
const MAGIC: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Above this `e^x` overflows f32 (the f32 backward gives +inf); [`exp_le88`] is valid up to it.
pub(crate) const EXP_HI: f32 = 88.3;
const EXP_LO: f32 = -87.3;

/// `bits(2^n) = (bits(t) << 23) + POW2_BIAS` modulo 2^32 for `t = MAGIC + n` (`|n| < 2^22`, result
/// in the normal range): bits(t) = bits(MAGIC) + n, and the exponent field is `(n + 127) << 23`.
const POW2_BIAS: u32 = 127u32.wrapping_sub(MAGIC.to_bits()) << 23;

/// The range reduction of the exponentials: `(t, r)` with `t = MAGIC + n`, `n = round(x·log2 e)`
/// in its low mantissa bits and `r = x − n·ln 2`, in one step (the exact product inside an FMA)
/// or, on the copy without FMA, in two.
#[inline(always)]
fn exp_reduce<S: Simd>(x: f32) -> (f32, f32) {
    let t = S::madd(x, LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = if S::FMA {
        S::madd(n, -LN2, x)
    } else {
        S::madd(n, -LN2_LO, S::madd(n, -LN2_HI, x))
    };
    (t, r)
}

/// `e^x = p·2^n` from `p = e^r` and `t` of [`exp_reduce`], 0 for `x < EXP_LO` (and -inf).
#[inline(always)]
fn exp_finish(x: f32, t: f32, p: f32) -> f32 {
    if x < EXP_LO {
        0.0
    } else {
        p * f32::from_bits((t.to_bits() << 23).wrapping_add(POW2_BIAS))
    }
}

/// `e^x` for the softmax's arguments, `x <= 88.3` (a logit minus its row's running max is <= 0),
/// to 4.5e-7 relative error (3 ulp): one Cody-Waite step and a degree-5 polynomial, 8 multiplies
/// or FMAs instead of the 11 of a degree-7 one with two reduction steps and no clamps, since the
/// exponentials are the largest non-product work of every forward tile. `exp_le88(-inf) = 0` and
/// `x < -87.3` gives 0 (the one select also catches -inf, whose reduction is NaN); NaN gives
/// NaN. Larger `x` are outside the contract.
#[inline(always)]
pub(crate) fn exp_le88<S: Simd>(x: f32) -> f32 {
    let (t, r) = exp_reduce::<S>(x);
    let mut y = S::madd(E5, r, E4);
    y = S::madd(y, r, E3);
    y = S::madd(y, r, E2);
    y = S::madd(y, r, 1.0);
    exp_finish(x, t, S::madd(y, r, 1.0))
}

/// `ln 2` rounded to f32: the one reduction step of [`exp_le88`] and [`exp_le88_coarse`]
/// (|n| <= 126 keeps the error of `r` below 2.5e-7).
const LN2: f32 = std::f32::consts::LN_2;
/// `e^r ≈ 1 + r·(1 + r·(E2 + r·(E3 + r·(E4 + r·E5))))` on |r| <= ln2/2: relative error 1.05e-7
/// in exact arithmetic (minimax by iterative reweighting).
const E2: f32 = 0.499_992_3;
const E3: f32 = 0.166_671_14;
const E4: f32 = 4.189_01e-2;
const E5: f32 = 8.312_511e-3;
/// `e^r ≈ 1 + r·(1 + r·(C2 + r·(C3 + r·C4)))` on |r| <= ln2/2: relative error 5.3e-6 in exact
/// arithmetic (minimax by iterative reweighting).
const C2: f32 = 0.500_051_14;
const C3: f32 = 0.167_534_98;
const C4: f32 = 4.127_76e-2;

/// `e^x` for probabilities that are rounded to bf16 next (2⁻⁹ relative): [`exp_le88`]'s contract
/// (`x <= 88`, 0 below -87.3 and at -inf, NaN at NaN) to 1.2e-5 relative error, with 7 multiplies
/// or FMAs instead of 11 (one Cody-Waite step, a degree-4 polynomial), since the exponentials
/// are the largest non-product cost of the `vdpbf16ps` kernels.
#[inline(always)]
pub(crate) fn exp_le88_coarse<S: Simd>(x: f32) -> f32 {
    let (t, r) = exp_reduce::<S>(x);
    let mut y = S::madd(C4, r, C3);
    y = S::madd(y, r, C2);
    y = S::madd(y, r, 1.0);
    exp_finish(x, t, S::madd(y, r, 1.0))
}

/// `2^f ≈ 1 + f·(G1 + f·(G2 + f·(G3 + f·(G4 + f·G5))))` on |f| <= 1/2: relative error 6.8e-8 in
/// exact arithmetic, 2.2e-7 evaluated in f32 (minimax by linear programming).
const G1: f32 = 0.693_146_6;
const G2: f32 = 0.240_221_66;
const G3: f32 = 5.551_047e-2;
const G4: f32 = 9.674_952e-3;
const G5: f32 = 1.320_298_2e-3;
/// `2^f ≈ 1 + f·(H1 + f·(H2 + f·(H3 + f·H4)))` on |f| <= 1/2: relative error 2.8e-6 in exact
/// arithmetic, 2.9e-6 evaluated in f32.
const H1: f32 = 0.693_124_1;
const H2: f32 = 0.240_241_07;
const H3: f32 = 5.590_683e-2;
const H4: f32 = 9.582_576e-3;

/// The softmax exponentials of the copies with FMA, in base 2: the caller folds `log2 e` into
/// the argument's one FMA (`d = x·(sc·log2 e) − c` with `c = u·log2 e` rounded once, the same
/// `c` for every path of a row, see `online_softmax`), so that `2^d` needs no Cody-Waite step:
/// `n = round(d)`, `f = d − n` exactly, `2^d = 2^f·2^n`. The vector forms
/// ([`x512::exp2_fine_in`]) take `f` from `vreduceps` and scale by `vscalefps`, both off the FMA
/// ports (measured on Zen 4: FMA, `vmulps` and `vcmpps` into a mask share the two FMA pipes;
/// `vreduceps`, `vscalefps`, adds and shuffles do not): 7 FMA-port operations per 16 lanes with
/// the argument's FMA instead of 10; the AVX2 form ([`x256::exp2_fine`]) rounds by adding
/// `MAGIC` (8 instead of 10). This scalar form is the vector one bit for bit on its
/// contract `d <= 127`: `2^n` from the bits of `n + MAGIC`, exact since `y·2^n` stays normal
/// (`y >= 1` when `n = -126`); `d < -126` (and `-inf`) gives exactly 0; NaN stays NaN.
#[inline(always)]
fn exp2_with<S: Simd>(d: f32, poly: impl Fn(f32) -> f32) -> f32 {
    let n = d.round_ties_even();
    let y = poly(d - n);
    let p = y * f32::from_bits(((n + MAGIC).to_bits() << 23).wrapping_add(POW2_BIAS));
    if d < EXP2_LO {
        0.0
    } else {
        p
    }
}

/// Below this `2^d` is 0 (the smallest normal power: the results stay normal).
const EXP2_LO: f32 = -126.0;

/// `2^d` to 2.5e-7 relative error for the f32 kernels' probabilities (see [`exp2_with`]).
#[inline(always)]
pub(crate) fn exp2_fine<S: Simd>(d: f32) -> f32 {
    exp2_with::<S>(d, |f| {
        let mut y = S::madd(G5, f, G4);
        y = S::madd(y, f, G3);
        y = S::madd(y, f, G2);
        y = S::madd(y, f, G1);
        S::madd(y, f, 1.0)
    })
}

/// `2^d` to 3e-6 relative error for probabilities rounded to bf16 next (2⁻⁹ relative).
#[inline(always)]
pub(crate) fn exp2_coarse<S: Simd>(d: f32) -> f32 {
    exp2_with::<S>(d, |f| {
        let mut y = S::madd(H4, f, H3);
        y = S::madd(y, f, H2);
        y = S::madd(y, f, H1);
        S::madd(y, f, 1.0)
    })
}

/// Whether copy `S` runs the softmax exponentials in base 2: the copies with FMA (AVX-512 and
/// AVX2; the argument is one fused `x·(sc·log2 e) − c`); the portable copy stays natural.
#[inline(always)]
pub(crate) const fn base2<S: Simd>() -> bool {
    S::FMA
}

/// The base of the softmax exponentials' arguments on copy `S`: `log2 e` where they run in
/// base 2 ([`base2`]), else 1. Every path of a copy forms its arguments as
/// `madd(x, sc·B, −(u·B))` so that they agree bit for bit.
#[inline(always)]
pub(crate) const fn exp_base<S: Simd>() -> f32 {
    if base2::<S>() {
        LOG2E
    } else {
        1.0
    }
}

/// `e^x` of the f32 softmax on copy `S`, from the argument `x·B` (`B` = [`exp_base`]):
/// [`exp2_fine`] in base 2, [`exp_le88`] on the portable copy.
#[inline(always)]
pub(crate) fn softmax_exp<S: Simd>(y: f32) -> f32 {
    if base2::<S>() {
        exp2_fine::<S>(y)
    } else {
        exp_le88::<S>(y)
    }
}

/// `e^x` of the forward softmax from the argument `x·B` on copy `S`: [`softmax_exp`], or with
/// `coarse` the cheaper forms whose 3e-6 (base 2) and 1.2e-5 (portable) relative errors vanish
/// under a bf16 output's rounding (2⁻⁹): [`exp2_coarse`] in base 2, [`exp_le88_coarse`] on the
/// portable copy. The widened bf16 forward takes them: one FMA-port operation fewer per
/// exponential than the f32 forward runs on the same kernels.
#[inline(always)]
pub(crate) fn softmax_exp_with<S: Simd>(y: f32, coarse: bool) -> f32 {
    match (coarse, base2::<S>()) {
        (false, _) => softmax_exp::<S>(y),
        (true, true) => exp2_coarse::<S>(y),
        (true, false) => exp_le88_coarse::<S>(y),
    }
}

/// `tanh(x)` by a 13/6 rational approximation on `[-7.9, 7.9]` (the clamp gives ±1 outside);
/// a few ulp of error, NaN in gives NaN out.
#[inline(always)]
pub(crate) fn tanh<S: Simd>(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    let xc = x.clamp(-CLAMP, CLAMP);
    let x2 = xc * xc;
    let mut p = S::madd(x2, -2.760_768_5e-16, 2.000_188e-13);
    p = S::madd(x2, p, -8.604_672e-11);
    p = S::madd(x2, p, 5.122_297e-8);
    p = S::madd(x2, p, 1.485_722_4e-5);
    p = S::madd(x2, p, 6.372_619_3e-4);
    p = S::madd(x2, p, 4.893_524_6e-3);
    p *= xc;
    let mut q = S::madd(x2, 1.198_258_4e-6, 1.185_347e-4);
    q = S::madd(x2, q, 2.268_434_6e-3);
    q = S::madd(x2, q, 4.893_525e-3);
    p / q
}

/// Maximum of a row, ignoring NaN (NaN is caught later through the exponentials); -inf if empty.
#[inline(always)]
pub(crate) fn max_row(s: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = s.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, &x) in chunks.remainder().iter().enumerate() {
        acc[l] = if x > acc[l] { x } else { acc[l] };
    }
    let mut m = f32::NEG_INFINITY;
    for a in acc {
        m = if a > m { a } else { m };
    }
    m
}

/// Softcap in place: `s <- c·tanh(s/c)`, keeping -inf (masked) as -inf.
#[inline(always)]
pub(crate) fn softcap_row<S: Simd>(s: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for x in s.iter_mut() {
        let y = cap * tanh::<S>(*x * inv);
        *x = if *x == f32::NEG_INFINITY { *x } else { y };
    }
}

/// `dst[i] *= a`.
#[inline(always)]
pub(crate) fn scale_row(dst: &mut [f32], a: f32) {
    for x in dst.iter_mut() {
        *x *= a;
    }
}

/// Widens bf16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Explicit AVX-512 forms of the base-2 exponentials, for the column softmax and the hand-written
/// `vdpbf16ps` kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x512 {
    use super::{EXP2_LO, G1, G2, G3, G4, G5, H1, H2, H3, H4};
    use std::arch::x86_64::*;

    /// `(n, f)` of [`super::exp2_with`]: `f = d − round(d)` by `vreduceps` (exact), `n = d − f`,
    /// and the lanes of `live` to keep: `d >= EXP2_LO` or NaN.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn split2(live: __mmask16, d: __m512) -> (__m512, __m512, __mmask16) {
        // Round to nearest even, no precision exception; ±inf give f = 0, n = ±inf.
        let f = _mm512_reduce_ps::<0x08>(d);
        let keep = _mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(live, d, _mm512_set1_ps(EXP2_LO));
        (_mm512_sub_ps(d, f), f, keep)
    }

    /// [`super::exp2_fine`] on the lanes of `live` (`+0` in the others), bit for bit.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/DQ and FMA.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(crate) fn exp2_fine_in(live: __mmask16, d: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let (n, f, keep) = split2(live, d);
        let mut y = _mm512_fmadd_ps(c(G5), f, c(G4));
        y = _mm512_fmadd_ps(y, f, c(G3));
        y = _mm512_fmadd_ps(y, f, c(G2));
        y = _mm512_fmadd_ps(y, f, c(G1));
        _mm512_maskz_scalef_ps(keep, _mm512_fmadd_ps(y, f, c(1.0)), n)
    }

    /// [`super::exp2_coarse`] on the lanes of `live` (`+0` in the others), bit for bit.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/DQ and FMA.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(crate) fn exp2_coarse_in(live: __mmask16, d: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let (n, f, keep) = split2(live, d);
        let mut y = _mm512_fmadd_ps(c(H4), f, c(H3));
        y = _mm512_fmadd_ps(y, f, c(H2));
        y = _mm512_fmadd_ps(y, f, c(H1));
        _mm512_maskz_scalef_ps(keep, _mm512_fmadd_ps(y, f, c(1.0)), n)
    }
}

/// Explicit AVX2 forms of the math above, for the column softmax of the AVX2 copy.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x256 {
    use super::{EXP2_LO, G1, G2, G3, G4, G5, H1, H2, H3, H4, MAGIC, POW2_BIAS};
    use std::arch::x86_64::*;

    /// [`super::exp2_fine`] on 8 lanes, bit for bit: `n = round(d)` by adding and subtracting
    /// `MAGIC` (the scalar `round_ties_even` on the contract's range; `d + MAGIC` holds `n` in
    /// its low mantissa bits, so `2^n` is a shift and an add), the zero below `EXP2_LO` by a
    /// compare. FMA-port operations per 8 lanes: the polynomial's 5, the multiply by `2^n` and
    /// the compare, against the natural form's 9 (its two reduction FMAs).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp2_fine(d: __m256) -> __m256 {
        exp2::<false>(d)
    }

    /// [`super::exp2_coarse`] on 8 lanes, bit for bit: [`exp2_fine`]'s frame with the degree-4
    /// polynomial (7 FMA-port operations per 8 lanes instead of 8).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp2_coarse(d: __m256) -> __m256 {
        exp2::<true>(d)
    }

    /// `2^d = poly(f)·2^n` on 8 lanes (`n = round(d)`, `f = d − n`), `poly` degree 4
    /// (`COARSE`) or 5.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp2<const COARSE: bool>(d: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let t = _mm256_add_ps(d, c(MAGIC));
        let f = _mm256_sub_ps(d, _mm256_sub_ps(t, c(MAGIC)));
        let p = if COARSE {
            let mut y = _mm256_fmadd_ps(c(H4), f, c(H3));
            y = _mm256_fmadd_ps(y, f, c(H2));
            y = _mm256_fmadd_ps(y, f, c(H1));
            _mm256_fmadd_ps(y, f, c(1.0))
        } else {
            let mut y = _mm256_fmadd_ps(c(G5), f, c(G4));
            y = _mm256_fmadd_ps(y, f, c(G3));
            y = _mm256_fmadd_ps(y, f, c(G2));
            y = _mm256_fmadd_ps(y, f, c(G1));
            _mm256_fmadd_ps(y, f, c(1.0))
        };
        let e = _mm256_add_epi32(
            _mm256_slli_epi32::<23>(_mm256_castps_si256(t)),
            _mm256_set1_epi32(POW2_BIAS as i32),
        );
        let res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(d, c(EXP2_LO));
        _mm256_andnot_ps(under, res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::cpu_features::{has, Feature};

    #[test]
    fn exp_le88_is_accurate_on_its_domain_and_exact_at_edges() {
        // Within 4.5e-7 of e^x over [-87, 88.3] on every kernel copy's flavour (Portable has no
        // FMA), 0 below -87.3 and at -inf, NaN at NaN, exactly 1 at 0.
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.3 {
            let want = (x as f64).exp();
            for v in [
                exp_le88::<Portable>(x),
                exp_le88::<Avx2>(x),
                exp_le88::<Avx512>(x),
            ] {
                worst = worst.max(((v as f64 - want) / want).abs());
            }
            x += 0.00917;
        }
        assert!(worst < 4.5e-7, "exp_le88 rel err {worst}");
        for v in [-87.31f32, -1e30, f32::MIN, f32::NEG_INFINITY] {
            assert_eq!(exp_le88::<Portable>(v), 0.0, "{v}");
            assert_eq!(exp_le88::<Avx512>(v), 0.0, "{v}");
        }
        assert_eq!(exp_le88::<Avx512>(0.0), 1.0);
        assert_eq!(exp_le88::<Avx512>(-0.0), 1.0);
        assert!(exp_le88::<Portable>(f32::NAN).is_nan());
    }

    #[test]
    fn coarse_exp_is_within_its_bound_and_exact_at_edges() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            for v in [exp_le88_coarse::<Avx512>(x), exp_le88_coarse::<Portable>(x)] {
                let want = (x as f64).exp();
                worst = worst.max(((v as f64 - want) / want).abs());
            }
            x += 0.00731;
        }
        assert!(worst < 1.2e-5, "coarse exp rel err {worst}");
        assert_eq!(exp_le88_coarse::<Avx512>(0.0), 1.0);
        assert_eq!(exp_le88_coarse::<Avx512>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_le88_coarse::<Avx512>(-87.31), 0.0);
        assert_eq!(exp_le88_coarse::<Avx512>(f32::MIN), 0.0);
        assert!(exp_le88_coarse::<Avx512>(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_is_accurate() {
        let mut worst = 0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let got = tanh::<Portable>(x) as f64;
            let want = (x as f64).tanh();
            worst = worst.max((got - want).abs() / want.abs().max(1e-30));
            x += 0.00731;
        }
        assert!(worst < 1e-6, "tanh rel err {worst}");
        assert!(tanh::<Portable>(f32::NAN).is_nan());
        assert_eq!(tanh::<Portable>(f32::INFINITY), tanh::<Portable>(100.0));
        assert!((tanh::<Portable>(1e-6) - 1e-6).abs() < 1e-12);
    }

    #[test]
    fn reductions() {
        let v: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let m = max_row(&v);
        assert_eq!(m, v.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        assert_eq!(max_row(&[]), f32::NEG_INFINITY);
    }

    /// Base-2 arguments for the `exp2` tests: a sweep over the contract `d <= 127` from far
    /// below the zero threshold, ties of the rounding, the edges and the special values.
    fn exp2_inputs() -> Vec<f32> {
        let mut ds: Vec<f32> = (0..40_000).map(|i| -300.0 + i as f32 * 0.010_67).collect();
        ds.extend([
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            2.5,
            -2.5,
            -125.5,
            -126.0,
            -126.000_01,
            -126.5,
            -149.0,
            126.5,
            127.0,
            -1e-40,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN,
        ]);
        ds
    }

    #[test]
    fn base2_exps_are_accurate_and_exact_at_edges() {
        // Relative error over the probabilities' domain (natural [-87.3, 88]), per copy.
        let mut worst = [0f64; 4];
        let mut d = -125.9f32;
        while d <= 127.0 {
            let want = (d as f64).exp2();
            let got = [
                exp2_fine::<Avx2>(d),
                exp2_fine::<Portable>(d),
                exp2_coarse::<Avx2>(d),
                exp2_coarse::<Portable>(d),
            ];
            for (w, g) in worst.iter_mut().zip(got) {
                *w = w.max(((g as f64 - want) / want).abs());
            }
            d += 0.003_71;
        }
        assert!(
            worst[0] < 2.5e-7 && worst[1] < 4e-7,
            "exp2_fine rel err {worst:?}"
        );
        assert!(
            worst[2] < 3.2e-6 && worst[3] < 3.5e-6,
            "exp2_coarse rel err {worst:?}"
        );
        for e in [
            exp2_fine::<Avx512>,
            exp2_coarse::<Avx512>,
            exp2_fine::<Portable>,
        ] {
            assert_eq!(e(0.0), 1.0);
            assert_eq!(e(-0.0), 1.0);
            assert_eq!(e(1.0), 2.0);
            assert_eq!(e(-3.0), 0.125);
            assert_eq!(e(-126.0), f32::MIN_POSITIVE);
            assert!(e(-125.6) >= f32::MIN_POSITIVE);
            assert_eq!(e(127.0), 2f32.powi(127));
            for zero in [-126.000_01, -126.4, -140.0, f32::MIN, f32::NEG_INFINITY] {
                assert_eq!(e(zero).to_bits(), 0, "{zero}");
            }
            assert!(e(f32::NAN).is_nan());
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_base2_exps_are_the_scalar_ones_bit_for_bit() {
        if !(has(Feature::Avx512f) && has(Feature::Avx512dq) && has(Feature::Fma)) {
            println!("skipped: needs AVX-512F/DQ, hidden or absent");
            return;
        }
        use std::arch::x86_64::*;
        let mut ds = exp2_inputs();
        while !ds.len().is_multiple_of(16) {
            ds.push(-1.0);
        }
        for (i, c) in ds.chunks_exact(16).enumerate() {
            // Every 7th block runs with half its lanes dead: those must be +0.
            let live: u16 = if i % 7 == 3 { 0x5A5A } else { 0xFFFF };
            let (mut fine, mut coarse) = ([0f32; 16], [0f32; 16]);
            // SAFETY: AVX-512F/DQ and FMA were detected above.
            unsafe {
                let v = _mm512_loadu_ps(c.as_ptr());
                _mm512_storeu_ps(fine.as_mut_ptr(), x512::exp2_fine_in(live, v));
                _mm512_storeu_ps(coarse.as_mut_ptr(), x512::exp2_coarse_in(live, v));
            }
            for (l, (&d, (&y, &z))) in c.iter().zip(fine.iter().zip(&coarse)).enumerate() {
                if live & (1 << l) == 0 {
                    assert_eq!((y.to_bits(), z.to_bits()), (0, 0));
                } else if d.is_nan() {
                    assert!(y.is_nan() && z.is_nan());
                } else {
                    assert_eq!(y.to_bits(), exp2_fine::<Avx512>(d).to_bits(), "{d}");
                    assert_eq!(z.to_bits(), exp2_coarse::<Avx512>(d).to_bits(), "{d}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ymm_exp2_is_the_scalar_one_bit_for_bit() {
        if !(has(Feature::Avx2) && has(Feature::Fma)) {
            println!("skipped: needs AVX2+FMA, hidden or absent");
            return;
        }
        use std::arch::x86_64::*;
        // (vector form, its scalar contract), each with AVX2 and FMA (detected above).
        type Forms = [(unsafe fn(__m256) -> __m256, fn(f32) -> f32); 2];
        let forms: Forms = [
            (x256::exp2_fine, exp2_fine::<Avx2>),
            (x256::exp2_coarse, exp2_coarse::<Avx2>),
        ];
        for (vector, scalar) in forms {
            for c in exp2_inputs().chunks(8) {
                let mut lanes = [-1f32; 8];
                lanes[..c.len()].copy_from_slice(c);
                let mut out = [0f32; 8];
                // SAFETY: AVX2 and FMA were detected above.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr(), vector(_mm256_loadu_ps(lanes.as_ptr())))
                };
                for (&d, &y) in lanes.iter().zip(&out) {
                    if d.is_nan() {
                        assert!(y.is_nan());
                    } else {
                        assert_eq!(y.to_bits(), scalar(d).to_bits(), "{d}");
                    }
                }
            }
        }
    }
}
