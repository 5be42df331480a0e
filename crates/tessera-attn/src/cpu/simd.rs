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

const LOG2E: f32 = std::f32::consts::LOG2_E;
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

/// Explicit AVX-512 forms of the math above, for the hand-written `vdpbf16ps` kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x512 {
    use super::{C2, C3, C4, E2, E3, E4, E5, EXP_LO, LN2, LOG2E, MAGIC};
    use std::arch::x86_64::*;

    /// `super::exp_reduce` (one step) on 16 lanes: `(n, r)`, `n` as a float.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    fn reduce(x: __m512) -> (__m512, __m512) {
        let t = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(MAGIC));
        let n = _mm512_sub_ps(t, _mm512_set1_ps(MAGIC));
        (n, _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2), x))
    }

    /// `super::exp_finish` on 16 lanes, and 0 outside `live`: `p·2^n` by one `vscalefps` (the
    /// exact scaling the scalar multiply by the power of two does, rounded the same way when the
    /// result is subnormal) with the zeroing of `x < EXP_LO` (and `-inf`; NaN is kept) and of
    /// the dead lanes in its mask, instead of a shift, an add, a multiply and two masked moves.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finish(live: __mmask16, x: __m512, n: __m512, p: __m512) -> __m512 {
        let keep = _mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(live, x, _mm512_set1_ps(EXP_LO));
        _mm512_maskz_scalef_ps(keep, p, n)
    }

    /// [`super::exp_le88`] on 16 lanes, bit for bit: the same operations in the same order
    /// (the scalar version's `mul_add`s are these FMAs).
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA.
    #[cfg(test)]
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn exp_le88(x: __m512) -> __m512 {
        exp_le88_in(0xFFFF, x)
    }

    /// [`exp_le88`] in the lanes of `live`, `+0` in the others.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn exp_le88_in(live: __mmask16, x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let (n, r) = reduce(x);
        let mut y = _mm512_fmadd_ps(c(E5), r, c(E4));
        y = _mm512_fmadd_ps(y, r, c(E3));
        y = _mm512_fmadd_ps(y, r, c(E2));
        y = _mm512_fmadd_ps(y, r, c(1.0));
        finish(live, x, n, _mm512_fmadd_ps(y, r, c(1.0)))
    }

    /// [`super::exp_le88_coarse`] on 16 lanes, bit for bit.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn exp_le88_coarse(x: __m512) -> __m512 {
        exp_le88_coarse_in(0xFFFF, x)
    }

    /// [`exp_le88_coarse`] in the lanes of `live`, `+0` in the others.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) fn exp_le88_coarse_in(live: __mmask16, x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let (n, r) = reduce(x);
        let mut y = _mm512_fmadd_ps(c(C4), r, c(C3));
        y = _mm512_fmadd_ps(y, r, c(C2));
        y = _mm512_fmadd_ps(y, r, c(1.0));
        finish(live, x, n, _mm512_fmadd_ps(y, r, c(1.0)))
    }
}

/// Explicit AVX2 forms of the math above, for the column softmax of the AVX2 copy.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x256 {
    use super::{E2, E3, E4, E5, EXP_LO, LN2, LOG2E, MAGIC, POW2_BIAS};
    use std::arch::x86_64::*;

    /// [`super::exp_le88`] on 8 lanes, bit for bit (the operations of `super::x512::exp_le88`).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp_le88(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let t = _mm256_fmadd_ps(x, c(LOG2E), c(MAGIC));
        let n = _mm256_sub_ps(t, c(MAGIC));
        let r = _mm256_fmadd_ps(n, c(-LN2), x);
        let mut y = _mm256_fmadd_ps(c(E5), r, c(E4));
        y = _mm256_fmadd_ps(y, r, c(E3));
        y = _mm256_fmadd_ps(y, r, c(E2));
        y = _mm256_fmadd_ps(y, r, c(1.0));
        let p = _mm256_fmadd_ps(y, r, c(1.0));
        let e = _mm256_add_epi32(
            _mm256_slli_epi32::<23>(_mm256_castps_si256(t)),
            _mm256_set1_epi32(POW2_BIAS as i32),
        );
        let res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, c(EXP_LO));
        _mm256_andnot_ps(under, res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Arguments for the vector-against-scalar exponential tests: a dense sweep over and past
    /// the domain, the edges, -inf and NaN.
    #[cfg(target_arch = "x86_64")]
    fn exp_inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..40_000).map(|i| -95.0 + i as f32 * 0.002_41).collect();
        xs.extend([
            0.0,
            -0.0,
            -87.3,
            -87.31,
            f32::NEG_INFINITY,
            f32::NAN,
            -1e30,
            f32::MIN,
        ]);
        xs
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exps_are_the_scalar_ones_bit_for_bit() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")) {
            println!("skipped: no AVX-512F on this CPU");
            return;
        }
        use std::arch::x86_64::*;
        let mut xs = exp_inputs();
        while !xs.len().is_multiple_of(16) {
            xs.push(-1.0);
        }
        for c in xs.chunks_exact(16) {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F and FMA were detected above.
            unsafe {
                _mm512_storeu_ps(
                    out.as_mut_ptr(),
                    x512::exp_le88(_mm512_loadu_ps(c.as_ptr())),
                )
            };
            let mut coarse = [0f32; 16];
            // SAFETY: as above.
            unsafe {
                _mm512_storeu_ps(
                    coarse.as_mut_ptr(),
                    x512::exp_le88_coarse(_mm512_loadu_ps(c.as_ptr())),
                )
            };
            for ((&x, &y), &z) in c.iter().zip(&out).zip(&coarse) {
                if x.is_nan() {
                    assert!(y.is_nan() && z.is_nan());
                } else {
                    assert_eq!(y.to_bits(), exp_le88::<Avx512>(x).to_bits(), "{x}");
                    assert_eq!(z.to_bits(), exp_le88_coarse::<Avx512>(x).to_bits(), "{x}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ymm_exp_le88_is_the_scalar_one_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("skipped: no AVX2+FMA on this CPU");
            return;
        }
        use std::arch::x86_64::*;
        let xs = exp_inputs();
        for c in xs.chunks(8) {
            let mut lanes = [-1f32; 8];
            lanes[..c.len()].copy_from_slice(c);
            let mut out = [0f32; 8];
            // SAFETY: AVX2 and FMA were detected above.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    x256::exp_le88(_mm256_loadu_ps(lanes.as_ptr())),
                )
            };
            for (&x, &y) in lanes.iter().zip(&out) {
                if x.is_nan() {
                    assert!(y.is_nan());
                } else {
                    assert_eq!(y.to_bits(), exp_le88::<Avx2>(x).to_bits(), "{x}");
                }
            }
        }
    }
}
