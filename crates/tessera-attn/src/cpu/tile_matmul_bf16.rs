//! The one bf16 matrix product the `vdpbf16ps` kernels are built from (x86-64 only):
//! `C[m×n] (+)= A·B` with f32 accumulation, where the contraction runs over *pairs*: element
//! `(r, p)` of A is a `u32` holding two bf16 (`[2p, 2p+1]` of the contraction dimension) at
//! `a[r·ars + p·aps]`, row `p` of B is `n` such pairs at `b[p·ldb..]`, and C is f32 row-major
//! with leading dimension `ldc`.
//!
//! Contract: `m` is a multiple of [`RB`], `n` a multiple of 16, `n <= ldb`, `n <= ldc`; slices are
//! checked against the extents up front, then the register-blocked micro-kernel (`RB` rows × 64
//! columns of f32 accumulators; a last 16, 32 or 48 columns in blocks of up to 16, 8 or 8 rows,
//! so that enough independent accumulators cover the `vdpbf16ps` latency; one broadcast pair of
//! A per row, contiguous B rows) runs without bounds checks. Each element's sum runs in the same
//! order whatever its block. With `MAX`, `cm[x] = max(cm[x], max_r C[r][x])` is fused into the
//! store (NaN ignored); [`dot_gemm_masked_max`] takes the max over the rows a bitmask allows (a
//! partial score tile's). Products of bf16 values are exact in f32, so the result differs from
//! an f32 product of the same (bf16) inputs only by summation order.
//! The caller must run on a CPU with AVX-512F/BW/VL, FMA and AVX512-BF16.

use super::amx;
use super::load_tile::transpose_words;
use super::tile_matmul::{round_up, RB};
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
unsafe fn micro<const ACC: bool, const MAX: bool, const R: usize, const NV: usize>(
    np: usize,
    a: *const u32,
    ars: usize,
    aps: usize,
    b: *const u32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cm: *mut f32,
    (mb, ms): (*const u8, usize),
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        if ACC {
            for r in 0..R {
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
            for r in 0..R {
                let ab = as_bh(_mm512_set1_epi32(*a.add(r * ars + p * aps) as i32));
                for x in 0..NV {
                    acc[r][x] = _mm512_dpbf16_ps(acc[r][x], ab, as_bh(bv[x]));
                }
            }
        }
        for r in 0..R {
            for x in 0..NV {
                _mm512_storeu_ps(c.add(r * ldc + 16 * x), acc[r][x]);
            }
        }
        if MAX {
            for x in 0..NV {
                let mut mx = _mm512_loadu_ps(cm.add(16 * x));
                for r in 0..R {
                    mx = if mb.is_null() {
                        _mm512_max_ps(acc[r][x], mx)
                    } else {
                        let k = mb.add(r * ms + 2 * x).cast::<u16>().read_unaligned();
                        _mm512_mask_max_ps(mx, k, acc[r][x], mx)
                    };
                }
                _mm512_storeu_ps(cm.add(16 * x), mx);
            }
        }
    }
}

/// The extents the unchecked loops rely on (module docs): `m` a multiple of [`RB`], `n` of 16,
/// `n <= ldb`, `n <= ldc`; A holds rows `< m` over pairs `< np`, B rows `< np` of `n` columns, C
/// rows `< m` of `n` columns.
fn check(
    (m, n, np): (usize, usize, usize),
    (a, ars, aps): (&[u32], usize, usize),
    (b, ldb): (&[u32], usize),
    (c, ldc): (&[f32], usize),
) {
    assert!(
        m.is_multiple_of(RB) && n.is_multiple_of(16) && n <= ldb && n <= ldc,
        "dot_gemm: m={m} n={n} ldb={ldb} ldc={ldc}"
    );
    if m == 0 || n == 0 {
        return;
    }
    assert!(c.len() >= (m - 1) * ldc + n, "dot_gemm: C too short");
    assert!(
        np == 0 || a.len() > (m - 1) * ars + (np - 1) * aps,
        "dot_gemm: A too short"
    );
    assert!(
        np == 0 || b.len() >= (np - 1) * ldb + n,
        "dot_gemm: B too short"
    );
}

/// `C = A·B` over `m` rows (`A` row-major, pairs along its rows) with its whole 16-row blocks on
/// the AMX tile unit `unit` (over `kp` pairs: `np` padded to a multiple of 16 with pairs that are
/// zero in `A` or in `B`) and a last 4, 8 or 12 rows on `vdpbf16ps` (over `np` pairs).
///
/// # Safety
/// As [`dot_gemm`]; `unit` must come from [`amx::unit`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
pub(crate) unsafe fn dot_gemm_tiles(
    unit: amx::Kind,
    (m, n, np, kp): (usize, usize, usize, usize),
    (a, lda): (&[u32], usize),
    (b, ldb): (&[u32], usize),
    (c, ldc): (&mut [f32], usize),
) {
    let m16 = m / amx::TW * amx::TW;
    // SAFETY: `unit` came from `amx::unit` (caller); extents are checked inside.
    unsafe { amx::gemm_on(unit, (m16, n, kp), (a, lda), (b, ldb), (c, ldc), false) };
    if m16 < m {
        let (a, c) = (&a[m16 * lda..], &mut c[m16 * ldc..]);
        // SAFETY: the caller's CPU features.
        unsafe { dot_gemm::<false, false>(m - m16, n, np, a, lda, 1, b, ldb, c, ldc, &mut []) };
    }
}

/// `C += Aᵀ·B` on the AMX tile unit `unit`, `A` given as `[np × m]` pair rows (`src`, `sl`
/// apart: the layout the softmax writes P and dS in): its rows `np..` up to a multiple of 16 are
/// zeroed (B's there must be finite), then it is transposed into `scratch` (`m` rows of the
/// padded pair count) for the tile loads, which read A by rows. `m`, `n` multiples of 16.
///
/// # Safety
/// AVX-512F must be available; `unit` must come from [`amx::unit`].
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tiles_acc_transposed(
    unit: amx::Kind,
    (m, n, np): (usize, usize, usize),
    (src, sl): (&mut [u32], usize),
    scratch: &mut [u32],
    (b, ldb): (&[u32], usize),
    (c, ldc): (&mut [f32], usize),
) {
    let np16 = round_up(np, amx::TW);
    src[np * sl..np16 * sl].fill(0);
    // SAFETY: AVX-512F (caller); extents are checked inside both.
    unsafe {
        transpose_words((src, sl), (scratch, np16), np16, m);
        amx::gemm_on(
            unit,
            (m, n, np16),
            (scratch, np16),
            (b, ldb),
            (c, ldc),
            true,
        );
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
    let none = (std::ptr::null(), 0);
    // SAFETY: the caller's contract; no mask.
    unsafe { drive::<ACC, MAX>(m, n, np, a, ars, aps, b, ldb, c, ldc, cm, none) }
}

/// `C = A·B` with the column max of the *allowed* entries fused into the store:
/// `cm[x] = max(cm[x], max { C[r][x] : bit x % 16 of the 16-bit word at byte r·stride + 2·⌊x/16⌋
/// of `bits` }` (NaN ignored), the masked column max of a partial score tile read from its
/// transposed bitmask while the products are still in registers.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, FMA and AVX512-BF16. (Extents are checked.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_gemm_masked_max(
    m: usize,
    n: usize,
    np: usize,
    (a, ars): (&[u32], usize),
    (b, ldb): (&[u32], usize),
    (c, ldc): (&mut [f32], usize),
    cm: &mut [f32],
    (bits, stride): (&[u8], usize),
) {
    assert!(
        m == 0 || n == 0 || bits.len() >= (m - 1) * stride + n / 8,
        "dot_gemm: mask too short"
    );
    // SAFETY: the caller's contract; the mask's extent is checked above.
    unsafe {
        drive::<false, true>(
            m,
            n,
            np,
            a,
            ars,
            1,
            b,
            ldb,
            c,
            ldc,
            cm,
            (bits.as_ptr(), stride),
        )
    }
}

/// `C += A·B` block by block: rows `RB·g..RB·g + RB` of C (`g < groups`) take the pairs
/// `pairs(g) = (p0, p1)` only (empty: the block is left alone), the `P·V` of a partial tile whose
/// query groups each have their own key range, in one call (a call per group measured 0.2-0.7k
/// ticks more per partial tile). `n` a multiple of 16, `n <= ldb`, `n <= ldc`; every
/// range ends at or before `np`.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, FMA and AVX512-BF16. (Extents are checked.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_gemm_acc_groups(
    (groups, n, np): (usize, usize, usize),
    pairs: impl Fn(usize) -> (usize, usize),
    (a, ars, aps): (&[u32], usize, usize),
    (b, ldb): (&[u32], usize),
    (c, ldc): (&mut [f32], usize),
) {
    let m = groups * RB;
    check((m, n, np), (a, ars, aps), (b, ldb), (c, ldc));
    if m == 0 || n == 0 || np == 0 {
        return;
    }
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let (none, wide) = ((std::ptr::null(), 0), n / 64 * 64);
    let nul = std::ptr::null_mut();
    for g in 0..groups {
        let (p0, p1) = pairs(g);
        if p0 >= p1 {
            continue;
        }
        assert!(p1 <= np, "dot_gemm: pairs of group {g}");
        let r = g * RB;
        // SAFETY: rows `r..r + RB <= m`, pairs `p0..p1 <= np` and columns `< n` are inside the
        // slices (checked above).
        unsafe {
            let (ar, br, cr) = (
                ap.add(r * ars + p0 * aps),
                bp.add(p0 * ldb),
                cp.add(r * ldc),
            );
            let k = p1 - p0;
            for x in (0..wide).step_by(64) {
                micro::<true, false, RB, 4>(
                    k,
                    ar,
                    ars,
                    aps,
                    br.add(x),
                    ldb,
                    cr.add(x),
                    ldc,
                    nul,
                    none,
                );
            }
            let (bx, cx) = (br.add(wide), cr.add(wide));
            match n - wide {
                16 => micro::<true, false, RB, 1>(k, ar, ars, aps, bx, ldb, cx, ldc, nul, none),
                32 => micro::<true, false, RB, 2>(k, ar, ars, aps, bx, ldb, cx, ldc, nul, none),
                48 => micro::<true, false, RB, 3>(k, ar, ars, aps, bx, ldb, cx, ldc, nul, none),
                _ => {}
            }
        }
    }
}

/// [`dot_gemm`] with an optional lane mask for the fused max (`mask.0` null: none).
///
/// # Safety
/// As [`dot_gemm`]; a non-null mask must cover `m` rows of `n / 8` bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn drive<const ACC: bool, const MAX: bool>(
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
    (mb, ms): (*const u8, usize),
) {
    check((m, n, np), (a, ars, aps), (b, ldb), (c, ldc));
    if m == 0 || n == 0 || (ACC && np == 0) {
        return;
    }
    assert!(!MAX || cm.len() >= n, "dot_gemm: column max too short");
    let (ap, bp, cp, mp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), cm.as_mut_ptr());
    let wide = n / 64 * 64;
    // SAFETY (all blocks below): the asserts above bound every (row < m, column < n,
    // pair < np) access.
    let block = |r: usize, x: usize| unsafe {
        (
            ap.add(r * ars),
            bp.add(x),
            cp.add(r * ldc + x),
            mp.wrapping_add(x),
            // A null mask (no masked max) stays null.
            (
                if mb.is_null() {
                    mb
                } else {
                    mb.wrapping_add(r * ms + x / 8)
                },
                ms,
            ),
        )
    };
    let mut r = 0;
    while r < m {
        for x in (0..wide).step_by(64) {
            let (ar, b0, c0, m0, k0) = block(r, x);
            // SAFETY: see `block`.
            unsafe { micro::<ACC, MAX, RB, 4>(np, ar, ars, aps, b0, ldb, c0, ldc, m0, k0) };
        }
        r += RB;
    }
    // The last 16, 32 or 48 columns keep 16, 16 or 24 accumulators in flight with blocks of 16,
    // 8 or 8 rows (as many as `m` allows): `RB` rows of one or two vectors are 4 or 8
    // dependent chains, fewer than the two pipes' `vdpbf16ps` latency needs. Every element's
    // sum runs in the same order whatever the block, so results do not depend on it.
    let (x, mut r) = (wide, 0);
    macro_rules! rows {
        ($rows:literal, $nv:literal) => {
            while r + $rows <= m {
                let (ar, b0, c0, m0, k0) = block(r, x);
                // SAFETY: see `block`.
                unsafe {
                    micro::<ACC, MAX, $rows, $nv>(np, ar, ars, aps, b0, ldb, c0, ldc, m0, k0)
                };
                r += $rows;
            }
        };
    }
    match n - wide {
        16 => {
            rows!(16, 1);
            rows!(8, 1);
            rows!(4, 1);
        }
        32 => {
            rows!(8, 2);
            rows!(4, 2);
        }
        48 => {
            rows!(8, 3);
            rows!(4, 3);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::cpu_features::{has, Feature};

    #[test]
    fn round_bits_is_the_conversion_instruction() {
        if !(has(Feature::Avx512f) && has(Feature::Avx512bf16)) {
            println!("skipped: needs AVX512-BF16, hidden or absent");
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

    /// `x` as bf16 bits (exact for the small values used here).
    fn bits(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    #[test]
    fn row_blocks_do_not_change_the_bits_and_integer_sums_are_exact() {
        if !(has(Feature::Avx512f)
            && has(Feature::Avx512bw)
            && has(Feature::Avx512vl)
            && has(Feature::Avx512dq)
            && has(Feature::Avx512bf16)
            && has(Feature::Fma))
        {
            println!("skipped: needs AVX512-BF16, hidden or absent");
            return;
        }
        // Last 16 / 32 / 48 columns in blocks of 16, 8, 4 rows (m = 28: 16 + 8 + 4).
        for &(m, n, np) in &[
            (4, 16, 5),
            (28, 16, 32),
            (12, 80, 7),
            (24, 96, 32),
            (20, 112, 3),
            (8, 48, 32),
            (16, 128, 9),
        ] {
            let (ars, ldb, ldc) = (np + 1, n + 16, n + 5);
            for integers in [true, false] {
                let val = |i: usize, mul: usize, md: usize| {
                    let v = ((i * mul) % md) as f32 - (md / 2) as f32;
                    if integers {
                        v
                    } else {
                        v * 0.37 + 0.11
                    }
                };
                let word = |i: usize, mul: usize, md: usize| {
                    pair(bits(val(2 * i, mul, md)), bits(val(2 * i + 1, mul, md)))
                };
                let a: Vec<u32> = (0..m * ars).map(|i| word(i, 7, 9)).collect();
                let b: Vec<u32> = (0..np * ldb).map(|i| word(i, 5, 11)).collect();
                let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32).collect();
                let f =
                    |w: u32, hi: bool| f32::from_bits(if hi { w & 0xFFFF_0000 } else { w << 16 });
                for acc in [false, true] {
                    let (mut whole, mut blocks) = (c0.clone(), c0.clone());
                    let mut cm = vec![f32::NEG_INFINITY; n];
                    // SAFETY: the features were detected above; extents are checked inside.
                    unsafe {
                        match acc {
                            false => dot_gemm::<false, true>(
                                m, n, np, &a, ars, 1, &b, ldb, &mut whole, ldc, &mut cm,
                            ),
                            true => dot_gemm::<true, false>(
                                m,
                                n,
                                np,
                                &a,
                                ars,
                                1,
                                &b,
                                ldb,
                                &mut whole,
                                ldc,
                                &mut [],
                            ),
                        }
                        for r in (0..m).step_by(RB) {
                            let (a_r, c_r) = (&a[r * ars..], &mut blocks[r * ldc..]);
                            match acc {
                                false => dot_gemm::<false, false>(
                                    RB,
                                    n,
                                    np,
                                    a_r,
                                    ars,
                                    1,
                                    &b,
                                    ldb,
                                    c_r,
                                    ldc,
                                    &mut [],
                                ),
                                true => dot_gemm::<true, false>(
                                    RB,
                                    n,
                                    np,
                                    a_r,
                                    ars,
                                    1,
                                    &b,
                                    ldb,
                                    c_r,
                                    ldc,
                                    &mut [],
                                ),
                            }
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&whole), bits(&blocks), "m={m} n={n} np={np} acc={acc}");
                    for r in 0..m {
                        for x in 0..n {
                            let got = whole[r * ldc + x];
                            if integers {
                                let mut want = if acc { c0[r * ldc + x] as f64 } else { 0.0 };
                                for p in 0..np {
                                    let (aw, bw) = (a[r * ars + p], b[p * ldb + x]);
                                    want += f(aw, false) as f64 * f(bw, false) as f64
                                        + f(aw, true) as f64 * f(bw, true) as f64;
                                }
                                assert_eq!(got as f64, want, "m={m} n={n} ({r},{x})");
                            }
                        }
                        for x in n..ldc {
                            assert_eq!(whole[r * ldc + x], c0[r * ldc + x], "wrote outside n");
                        }
                    }
                    if !acc {
                        for (x, &g) in cm.iter().enumerate() {
                            let want = (0..m)
                                .map(|r| whole[r * ldc + x])
                                .fold(f32::NEG_INFINITY, f32::max);
                            assert_eq!(g, want, "column max {x}");
                        }
                        // The masked max: a pseudo-random mask with a stride wider than a row.
                        let stride = n / 8 + 3;
                        let mask: Vec<u8> = (0..m * stride)
                            .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 7) as u8)
                            .collect();
                        let live =
                            |r: usize, x: usize| mask[r * stride + x / 8] >> (x % 8) & 1 == 1;
                        let mut cm = vec![f32::NEG_INFINITY; n];
                        cm[0] = 1e30;
                        let mut c = c0.clone();
                        // SAFETY: the features were detected above.
                        unsafe {
                            dot_gemm_masked_max(
                                m,
                                n,
                                np,
                                (&a, ars),
                                (&b, ldb),
                                (&mut c, ldc),
                                &mut cm,
                                (&mask, stride),
                            )
                        };
                        assert_eq!(bits(&c), bits(&whole), "masked max: products");
                        for (x, &g) in cm.iter().enumerate() {
                            let want = (0..m)
                                .filter(|&r| live(r, x))
                                .map(|r| whole[r * ldc + x])
                                .fold(if x == 0 { 1e30 } else { f32::NEG_INFINITY }, f32::max);
                            assert_eq!(g, want, "masked column max {x}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn groups_over_their_own_pairs_equal_one_call_per_group() {
        if !(has(Feature::Avx512bf16) && has(Feature::Avx512bw)) {
            println!("skipped: needs AVX512-BF16, hidden or absent");
            return;
        }
        // A as P·V reads it: element (row r, pair p) at a[r + p·aps]; n = 64 and a 48 tail.
        for &(groups, n, np) in &[(8usize, 64usize, 40usize), (5, 112, 17)] {
            let (m, aps, ldb, ldc) = (groups * RB, groups * RB + 3, n + 16, n + 5);
            let word = |i: usize, k: u32| {
                pair(
                    bits(((i as u32 * k) % 13) as f32 * 0.37 - 2.0),
                    bits(((i as u32 * (k + 2)) % 11) as f32 * 0.29 - 1.5),
                )
            };
            let a: Vec<u32> = (0..np * aps).map(|i| word(i, 7)).collect();
            let b: Vec<u32> = (0..np * ldb).map(|i| word(i, 5)).collect();
            let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 9) as f32 * 0.5).collect();
            // Ragged ranges, one empty group.
            let pairs = |g: usize| if g == 2 { (3, 3) } else { (g % 3, np - g % 4) };
            let (mut got, mut want) = (c0.clone(), c0.clone());
            // SAFETY: the features were detected above; extents are checked inside.
            unsafe {
                dot_gemm_acc_groups(
                    (groups, n, np),
                    pairs,
                    (&a, 1, aps),
                    (&b, ldb),
                    (&mut got, ldc),
                );
                for g in 0..groups {
                    let ((p0, p1), r) = (pairs(g), g * RB);
                    let (a_g, b_g, c_g) =
                        (&a[r + p0 * aps..], &b[p0 * ldb..], &mut want[r * ldc..]);
                    dot_gemm::<true, false>(
                        RB,
                        n,
                        p1 - p0,
                        a_g,
                        1,
                        aps,
                        b_g,
                        ldb,
                        c_g,
                        ldc,
                        &mut [],
                    );
                }
            }
            let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits32(&got), bits32(&want), "groups={groups} n={n}");
            assert_ne!(got, c0, "nothing accumulated");
        }
    }
}
