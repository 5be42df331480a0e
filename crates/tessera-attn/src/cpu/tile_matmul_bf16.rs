//! The one bf16 matrix product the `vdpbf16ps` kernels are built from (x86-64 only):
//! `C[m×n] (+)= A·B` with f32 accumulation, where the contraction runs over *pairs*: element
//! `(r, p)` of A is a `u32` holding two bf16 (`[2p, 2p+1]` of the contraction dimension) at
//! `a[r·ars + p·aps]`, row `p` of B is `n` such pairs at `b[p·ldb..]`, and C is f32 row-major
//! with leading dimension `ldc`.
//!
//! Contract: `m` is a multiple of [`RB`], `n` a multiple of 16, `n <= ldb`, `n <= ldc`; slices are
//! checked against the extents up front, then the register-blocked micro-kernel (`RB` rows × up
//! to 64 columns of f32 accumulators, one broadcast pair of A per row, contiguous B rows) runs
//! without bounds checks. With `MAX`, `cm[x] = max(cm[x], max_r C[r][x])` is fused into the store
//! (finite inputs only). Products of bf16 values are exact in f32, so the result differs from an
//! f32 product of the same (bf16) inputs only by summation order.
//! The caller must run on a CPU with AVX-512F/BW/VL, FMA and AVX512-BF16.

use super::tile_matmul::RB;
use std::arch::x86_64::*;

/// Two bf16 bit patterns as one `u32` (`lo` in the low half).
#[inline(always)]
pub(crate) fn pair(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Round-to-nearest-even bf16 bits of a finite f32, as `vcvtne2ps2bf16` gives them: a
/// subnormal input counts as a zero of its sign (the instruction's fixed DAZ behaviour; the
/// base-2 exponentials can return subnormal probabilities).
#[inline(always)]
pub(crate) fn round_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x7F80_0000 == 0 {
        return b >> 16 & 0x8000;
    }
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) >> 16
}

/// The 32 bf16 lanes of a 512-bit integer vector.
#[inline(always)]
fn as_bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain vector types; every bit pattern is valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
unsafe fn micro<const ACC: bool, const MAX: bool, const NV: usize>(
    np: usize,
    a: *const u32,
    ars: usize,
    aps: usize,
    b: *const u32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cm: *mut f32,
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; RB];
        if ACC {
            for r in 0..RB {
                for x in 0..NV {
                    acc[r][x] = _mm512_loadu_ps(c.add(r * ldc + 16 * x));
                }
            }
        }
        for p in 0..np {
            let mut bv = [_mm512_setzero_si512(); NV];
            for x in 0..NV {
                bv[x] = _mm512_loadu_si512(b.add(p * ldb + 16 * x).cast());
            }
            for r in 0..RB {
                let ab = as_bh(_mm512_set1_epi32(*a.add(r * ars + p * aps) as i32));
                for x in 0..NV {
                    acc[r][x] = _mm512_dpbf16_ps(acc[r][x], ab, as_bh(bv[x]));
                }
            }
        }
        for r in 0..RB {
            for x in 0..NV {
                _mm512_storeu_ps(c.add(r * ldc + 16 * x), acc[r][x]);
            }
        }
        if MAX {
            for x in 0..NV {
                let mut mx = _mm512_loadu_ps(cm.add(16 * x));
                for r in 0..RB {
                    mx = _mm512_max_ps(acc[r][x], mx);
                }
                _mm512_storeu_ps(cm.add(16 * x), mx);
            }
        }
    }
}

/// `C = A·B` (`ACC = false`) or `C += A·B` (`ACC = true`) over `np` pairs; see the module docs.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, FMA and AVX512-BF16. (Extents are checked.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_gemm<const ACC: bool, const MAX: bool>(
    m: usize,
    n: usize,
    np: usize,
    a: &[u32],
    ars: usize,
    aps: usize,
    b: &[u32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    cm: &mut [f32],
) {
    assert!(
        m.is_multiple_of(RB) && n.is_multiple_of(16) && n <= ldb && n <= ldc,
        "dot_gemm: m={m} n={n} ldb={ldb} ldc={ldc}"
    );
    if m == 0 || n == 0 || (ACC && np == 0) {
        return;
    }
    assert!(
        np == 0 || a.len() > (m - 1) * ars + (np - 1) * aps,
        "dot_gemm: A too short"
    );
    assert!(
        np == 0 || b.len() >= (np - 1) * ldb + n,
        "dot_gemm: B too short"
    );
    assert!(c.len() >= (m - 1) * ldc + n, "dot_gemm: C too short");
    assert!(!MAX || cm.len() >= n, "dot_gemm: column max too short");
    let (ap, bp, cp, mp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), cm.as_mut_ptr());
    let mut r = 0;
    while r < m {
        let mut x = 0;
        // SAFETY: the asserts above bound every (row < m, column < n, pair < np) access.
        unsafe {
            let ar = ap.add(r * ars);
            let cr = cp.add(r * ldc);
            while x + 64 <= n {
                let (b0, c0, m0) = (bp.add(x), cr.add(x), mp.wrapping_add(x));
                micro::<ACC, MAX, 4>(np, ar, ars, aps, b0, ldb, c0, ldc, m0);
                x += 64;
            }
            let (b0, c0, m0) = (bp.add(x), cr.add(x), mp.wrapping_add(x));
            match n - x {
                48 => micro::<ACC, MAX, 3>(np, ar, ars, aps, b0, ldb, c0, ldc, m0),
                32 => micro::<ACC, MAX, 2>(np, ar, ars, aps, b0, ldb, c0, ldc, m0),
                16 => micro::<ACC, MAX, 1>(np, ar, ars, aps, b0, ldb, c0, ldc, m0),
                _ => {}
            }
        }
        r += RB;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_bits_is_the_conversion_instruction() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
            println!("skipped: no AVX512-BF16 on this CPU");
            return;
        }
        let mut xs: Vec<f32> = (0..4000)
            .map(|i| f32::from_bits(0x3F80_0000 + i * 977))
            .collect();
        xs.extend((0..2000).map(|i| f32::from_bits(1 + i * 4099))); // subnormals
        xs.extend((0..2000).map(|i| -f32::from_bits(0x0070_0000 + i * 4099))); // both sides of 2^-126
        xs.extend([
            0.0,
            -0.0,
            1.0,
            f32::MIN_POSITIVE,
            3.4e38,
            -2.5e-39,
            1.000_000_1,
        ]);
        while !xs.len().is_multiple_of(32) {
            xs.push(0.5);
        }
        for c in xs.chunks_exact(32) {
            let mut out = [0u16; 32];
            // SAFETY: AVX-512F and AVX512-BF16 were detected above.
            unsafe {
                let v = _mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(c[16..].as_ptr()),
                    _mm512_loadu_ps(c.as_ptr()),
                );
                _mm512_storeu_si512(
                    out.as_mut_ptr().cast(),
                    std::mem::transmute::<__m512bh, __m512i>(v),
                );
            }
            for (&x, &o) in c.iter().zip(&out) {
                assert_eq!(round_bits(x), o as u32, "{x:e}");
            }
        }
    }
}
