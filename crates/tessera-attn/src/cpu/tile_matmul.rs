//! The one small matrix product the kernels are built from: `C[m×n] (+)= A[m×k]·B[k×n]`, f32
//! with explicit leading dimensions; B and C row-major, A row-major (`AT = false`, element
//! `(r, kk)` at `r·lda + kk`) or stored transposed (`AT = true`, at `kk·lda + r`).
//!
//! Contract: `m` is a multiple of [`RB`] and `n` a multiple of 16 (callers pad their tiles);
//! slices are checked against the extents up front, then the register-blocked micro-kernel
//! (`RB` rows × up to 64 columns of accumulators, broadcast A, contiguous B rows) runs without
//! bounds checks (`RB × 16` blocks on copies without 32 vector registers). Written generically so that, inlined into a `#[target_feature]` copy, LLVM keeps
//! the accumulators in vector registers. [`gemm_skip_zero`] is the exact variant for non-finite
//! inputs: an A element equal to 0 contributes nothing even when its B row holds NaN or inf.

use super::simd::Simd;

/// Rows per micro-kernel block.
pub(crate) const RB: usize = 4;

/// Rounds `x` up to a multiple of `m`.
#[inline(always)]
pub(crate) fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn check<const AT: bool>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &[f32],
    ldc: usize,
) {
    assert!(
        m.is_multiple_of(RB) && n.is_multiple_of(16),
        "gemm: m={m} n={n} not padded"
    );
    assert!(n <= ldb && n <= ldc, "gemm: leading dimensions");
    if AT {
        assert!(m <= lda, "gemm: lda");
        assert!(
            m == 0 || k == 0 || a.len() >= (k - 1) * lda + m,
            "gemm: A too short"
        );
    } else {
        assert!(k <= lda, "gemm: lda");
        assert!(
            m == 0 || k == 0 || a.len() >= (m - 1) * lda + k,
            "gemm: A too short"
        );
    }
    assert!(
        k == 0 || n == 0 || b.len() >= (k - 1) * ldb + n,
        "gemm: B too short"
    );
    assert!(
        m == 0 || n == 0 || c.len() >= (m - 1) * ldc + n,
        "gemm: C too short"
    );
}

/// `C = A·B` (`ACC = false`) or `C += A·B` (`ACC = true`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn gemm<S: Simd, const ACC: bool, const AT: bool>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    gemm_impl::<S, ACC, AT, false>(m, n, k, a, lda, b, ldb, c, ldc, std::ptr::null_mut())
}

/// `C = A·B` and, fused into the store, `cm[x] = max(cm[x], max_r C[r][x])` for `x < n`
/// (NaN ignored, like the separate column-max pass it replaces).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn gemm_colmax<S: Simd>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    cm: &mut [f32],
) {
    assert!(cm.len() >= n, "gemm: column max too short");
    gemm_impl::<S, false, false, true>(m, n, k, a, lda, b, ldb, c, ldc, cm.as_mut_ptr())
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gemm_impl<S: Simd, const ACC: bool, const AT: bool, const MAX: bool>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    cm: *mut f32,
) {
    check::<AT>(m, n, k, a, lda, b, ldb, c, ldc);
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if S::YMM {
        // SAFETY: `check` bounds every access; `S::YMM` copies only run with AVX2 and FMA.
        unsafe { ymm::gemm::<ACC, AT, MAX>(m, n, k, ap, lda, bp, ldb, cp, ldc, cm) };
        return;
    }
    let mut i = 0;
    while i < m {
        let mut j = 0;
        let a_off = if AT { i } else { i * lda };
        // SAFETY: `check` proved every (row < m, col < n, kk < k) access below is in bounds.
        unsafe {
            let a0 = ap.add(a_off);
            if S::WIDE {
                while j + 64 <= n {
                    micro::<S, ACC, AT, MAX, 64>(
                        k,
                        a0,
                        lda,
                        bp.add(j),
                        ldb,
                        cp.add(i * ldc + j),
                        ldc,
                        cm.wrapping_add(j),
                    );
                    j += 64;
                }
                let (b0, c0, m0) = (bp.add(j), cp.add(i * ldc + j), cm.wrapping_add(j));
                match n - j {
                    48 => micro::<S, ACC, AT, MAX, 48>(k, a0, lda, b0, ldb, c0, ldc, m0),
                    32 => micro::<S, ACC, AT, MAX, 32>(k, a0, lda, b0, ldb, c0, ldc, m0),
                    16 => micro::<S, ACC, AT, MAX, 16>(k, a0, lda, b0, ldb, c0, ldc, m0),
                    _ => {}
                }
            } else {
                while j < n {
                    micro::<S, ACC, AT, MAX, 16>(
                        k,
                        a0,
                        lda,
                        bp.add(j),
                        ldb,
                        cp.add(i * ldc + j),
                        ldc,
                        cm.wrapping_add(j),
                    );
                    j += 16;
                }
            }
        }
        i += RB;
    }
}

/// `RB × NB` register block: accumulators in a fixed-size array LLVM keeps in registers.
///
/// # Safety
/// `a` must be readable at `r*lda + kk` (`kk*lda + r` when `AT`), `b` at `kk*ldb + x`, `c` at `r*ldc + x` for
/// `r < RB`, `kk < k`, `x < NB`; with `MAX`, `cm` readable and writable at `x < NB`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<S: Simd, const ACC: bool, const AT: bool, const MAX: bool, const NB: usize>(
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cm: *mut f32,
) {
    let mut acc = [[0f32; NB]; RB];
    if ACC {
        for (r, row) in acc.iter_mut().enumerate() {
            for (x, v) in row.iter_mut().enumerate() {
                *v = *c.add(r * ldc + x);
            }
        }
    }
    for kk in 0..k {
        let brow = b.add(kk * ldb);
        let mut bv = [0f32; NB];
        for (x, v) in bv.iter_mut().enumerate() {
            *v = *brow.add(x);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av = if AT {
                *a.add(kk * lda + r)
            } else {
                *a.add(r * lda + kk)
            };
            for x in 0..NB {
                row[x] = S::madd(av, bv[x], row[x]);
            }
        }
    }
    if MAX {
        for x in 0..NB {
            let mut mx = *cm.add(x);
            for row in acc.iter() {
                mx = if row[x] > mx { row[x] } else { mx };
            }
            *cm.add(x) = mx;
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (x, v) in row.iter().enumerate() {
            *c.add(r * ldc + x) = *v;
        }
    }
}

/// The AVX2 copy's register blocking in explicit intrinsics: 3 rows × 32 columns of
/// accumulators (12 ymm registers, plus the 3 row broadcasts and 1 B vector: 16 of 16), each k
/// step 7 loads for 12 FMAs with one broadcast per 4 FMAs; a last 16 columns use 6 × 16 blocks
/// (12 accumulators, 2 B vectors, 1 broadcast; one broadcast per 2 FMAs, measured 2.5% slower
/// as the main block). 12 independent FMA chains cover two FMA pipes' latency. LLVM does not
/// find such allocations itself: a generic `4 × 24` block spilled an accumulator every k step.
#[cfg(target_arch = "x86_64")]
mod ymm {
    use std::arch::x86_64::*;

    /// [`super::gemm_impl`] on the AVX2 copy: 32 columns at a time in row blocks of 3 (four
    /// rows as 2 + 2, else a last 2 or 1), a last 16 columns (`n` is a multiple of 16) in row blocks of 6 (then 4 or 2: `m` is
    /// a multiple of 4). The FMAs per element and their order are those of the generic block,
    /// so results are bit-identical to it.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; the extents must have passed [`super::check`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm<const ACC: bool, const AT: bool, const MAX: bool>(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        cm: *mut f32,
    ) {
        if k <= KB {
            return panels::<ACC, AT, MAX>(m, n, k, a, lda, b, ldb, c, ldc, cm);
        }
        // Long products in chunks of `KB` k-steps, each continuing from the C the previous one
        // stored (the same FMAs in the same order: bit-identical), so B's rows of one chunk
        // stay in L1 across the row blocks; the fused column max only on the final values.
        let mut k0 = 0;
        while k0 < k {
            let kc = (k - k0).min(KB);
            let (a0, b0) = (
                if AT { a.add(k0 * lda) } else { a.add(k0) },
                b.add(k0 * ldb),
            );
            match (k0 == 0, k0 + kc == k) {
                (true, _) => panels::<ACC, AT, false>(m, n, kc, a0, lda, b0, ldb, c, ldc, cm),
                (false, false) => panels::<true, AT, false>(m, n, kc, a0, lda, b0, ldb, c, ldc, cm),
                (false, true) => panels::<true, AT, MAX>(m, n, kc, a0, lda, b0, ldb, c, ldc, cm),
            }
            k0 += kc;
        }
    }

    /// k-steps per chunk of [`gemm`]: B's rows of a chunk (16 KiB at 128 columns) stay in L1
    /// while every row block passes over them. Measured on Zen 4, one core, GFLOP/s against one
    /// pass (peak 116.5): P·V at D = 128 (64 × 128 × 128, A transposed) 111.7 against 78.8, at
    /// D = 64 (128 × 64 × 128) 111.4 against 104.4, `S = K·Qᵀ` at D = 64 (128 × 128 × 64)
    /// 112.7 against 109.7; chunks of 64 or 16 were slower than 32 on every shape.
    const KB: usize = 32;

    /// [`gemm`] over `k <= KB` (or any `k`) in one pass.
    ///
    /// # Safety
    /// As [`gemm`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn panels<const ACC: bool, const AT: bool, const MAX: bool>(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        cm: *mut f32,
    ) {
        // Columns in 32s: 3 × 32 blocks (four rows as 2 + 2, else a last 2 or 1).
        let n32 = n / 32 * 32;
        let mut i = 0;
        while i < m && n32 > 0 {
            // Four rows left (the partial tiles' row groups are 4): two 2-row blocks, not a
            // 3-row block and a latency-bound single row (4 accumulator chains).
            let rows = if m - i == 4 { 2 } else { (m - i).min(3) };
            let a0 = if AT { a.add(i) } else { a.add(i * lda) };
            for j in (0..n32).step_by(32) {
                let (b0, c0, m0) = (b.add(j), c.add(i * ldc + j), cm.wrapping_add(j));
                match rows {
                    3 => micro::<ACC, AT, MAX, 3, 4>(k, a0, lda, b0, ldb, c0, ldc, m0),
                    2 => micro::<ACC, AT, MAX, 2, 4>(k, a0, lda, b0, ldb, c0, ldc, m0),
                    _ => micro::<ACC, AT, MAX, 1, 4>(k, a0, lda, b0, ldb, c0, ldc, m0),
                }
            }
            i += rows;
        }
        // A last 16 columns: 6 × 16 blocks (then 4 or 2 rows).
        let mut i = 0;
        while i < m && n32 < n {
            let rows = (m - i).min(6);
            let a0 = if AT { a.add(i) } else { a.add(i * lda) };
            let (b0, c0, m0) = (b.add(n32), c.add(i * ldc + n32), cm.wrapping_add(n32));
            match rows {
                6 => micro::<ACC, AT, MAX, 6, 2>(k, a0, lda, b0, ldb, c0, ldc, m0),
                4 => micro::<ACC, AT, MAX, 4, 2>(k, a0, lda, b0, ldb, c0, ldc, m0),
                _ => micro::<ACC, AT, MAX, 2, 2>(k, a0, lda, b0, ldb, c0, ldc, m0),
            }
            i += rows;
        }
    }

    /// `R × 8V` block (`V` = 2 or 4 ymm per row); see [`super::micro`] for the pointer contract.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn micro<
        const ACC: bool,
        const AT: bool,
        const MAX: bool,
        const R: usize,
        const V: usize,
    >(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        cm: *mut f32,
    ) {
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            if ACC {
                for r in 0..R {
                    for x in 0..V {
                        acc[r][x] = _mm256_loadu_ps(c.add(r * ldc + 8 * x));
                    }
                }
            }
            let a_at = |kk: usize, r: usize| {
                if AT {
                    a.add(kk * lda + r)
                } else {
                    a.add(r * lda + kk)
                }
            };
            for kk in 0..k {
                if V == 2 {
                    // 6 × 16: both B vectors held, one broadcast at a time (12 + 2 + 1 ymm).
                    let bv = [
                        _mm256_loadu_ps(b.add(kk * ldb)),
                        _mm256_loadu_ps(b.add(kk * ldb + 8)),
                    ];
                    for r in 0..R {
                        let av = _mm256_broadcast_ss(&*a_at(kk, r));
                        for x in 0..V {
                            acc[r][x] = _mm256_fmadd_ps(av, bv[x], acc[r][x]);
                        }
                    }
                } else {
                    // 3 × 32: the broadcasts held, one B vector at a time (12 + 3 + 1 ymm): a
                    // broadcast per 4 FMAs instead of per 2.
                    let mut av = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        av[r] = _mm256_broadcast_ss(&*a_at(kk, r));
                    }
                    for x in 0..V {
                        let bv = _mm256_loadu_ps(b.add(kk * ldb + 8 * x));
                        for r in 0..R {
                            acc[r][x] = _mm256_fmadd_ps(av[r], bv, acc[r][x]);
                        }
                    }
                }
            }
            if MAX {
                for x in 0..V {
                    // max(row, mx) keeps mx when row is NaN, like the generic block.
                    let mut mx = _mm256_loadu_ps(cm.add(8 * x));
                    for r in 0..R {
                        mx = _mm256_max_ps(acc[r][x], mx);
                    }
                    _mm256_storeu_ps(cm.add(8 * x), mx);
                }
            }
            for r in 0..R {
                for x in 0..V {
                    _mm256_storeu_ps(c.add(r * ldc + 8 * x), acc[r][x]);
                }
            }
        }
    }
}

/// Exact product for non-finite inputs: like [`gemm`], but an `A` element equal to zero is
/// skipped, so `0 · NaN` never reaches `C`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn gemm_skip_zero<S: Simd, const ACC: bool, const AT: bool>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    check::<AT>(m, n, k, a, lda, b, ldb, c, ldc);
    for i in 0..m {
        let crow = &mut c[i * ldc..i * ldc + n];
        if !ACC {
            crow.fill(0.0);
        }
        for kk in 0..k {
            let av = if AT { a[kk * lda + i] } else { a[i * lda + kk] };
            if av == 0.0 {
                continue;
            }
            let brow = &b[kk * ldb..kk * ldb + n];
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv = S::madd(av, bv, *cv);
            }
        }
    }
}

/// Dispatches between [`gemm`] and [`gemm_skip_zero`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn product<S: Simd, const ACC: bool, const AT: bool>(
    exact: bool,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    if exact {
        gemm_skip_zero::<S, ACC, AT>(m, n, k, a, lda, b, ldb, c, ldc)
    } else {
        gemm::<S, ACC, AT>(m, n, k, a, lda, b, ldb, c, ldc)
    }
}

#[cfg(test)]
mod tests {
    use super::super::simd::Portable;
    use super::*;
    use tessera_core::cpu_features::{has, Feature};

    #[test]
    fn fused_column_max_matches_a_separate_pass() {
        for &(m, n, k) in &[(8, 112, 37), (12, 64, 64), (4, 16, 3)] {
            let (lda, ldc) = (k + 1, n + 3);
            let a: Vec<f32> = (0..m * lda).map(|i| ((i * 7 % 13) as f32) - 6.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32) - 5.0).collect();
            let mut c = vec![0f32; m * ldc];
            let mut cm = vec![f32::NEG_INFINITY; n];
            cm[0] = 1e30;
            gemm_colmax::<Portable>(m, n, k, &a, lda, &b, n, &mut c, ldc, &mut cm);
            let mut want = vec![0f32; m * ldc];
            gemm::<Portable, false, false>(m, n, k, &a, lda, &b, n, &mut want, ldc);
            assert_eq!(c, want);
            for (x, &got) in cm.iter().enumerate() {
                let col = (0..m)
                    .map(|r| want[r * ldc + x])
                    .fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(got, if x == 0 { 1e30 } else { col }, "column {x}");
            }
        }
    }

    #[test]
    fn gemm_matches_naive() {
        for &(m, n, k) in &[
            (4, 16, 1),
            (8, 112, 37),
            (12, 64, 64),
            (4, 48, 5),
            (0, 16, 3),
        ] {
            let (lda, ldb, ldc) = (k + 3, n + 16, n + 5);
            let a: Vec<f32> = (0..m * lda).map(|i| ((i * 7 % 13) as f32) - 6.0).collect();
            // The same A stored transposed: at[kk * ldat + i] = a[i * lda + kk].
            let ldat = m + 4;
            let mut at = vec![0f32; k.max(1) * ldat];
            for i in 0..m {
                for kk in 0..k {
                    at[kk * ldat + i] = a[i * lda + kk];
                }
            }
            let b: Vec<f32> = (0..k.max(1) * ldb)
                .map(|i| ((i * 5 % 11) as f32) * 0.5)
                .collect();
            let c0: Vec<f32> = (0..m * ldc).map(|i| i as f32).collect();
            for acc in [false, true] {
                let mut c = c0.clone();
                let mut c2 = c0.clone();
                let mut c3 = c0.clone();
                let mut c4 = c0.clone();
                if acc {
                    gemm::<Portable, true, false>(m, n, k, &a, lda, &b, ldb, &mut c, ldc);
                    gemm_skip_zero::<Portable, true, false>(
                        m, n, k, &a, lda, &b, ldb, &mut c2, ldc,
                    );
                    gemm::<Portable, true, true>(m, n, k, &at, ldat, &b, ldb, &mut c3, ldc);
                    gemm_skip_zero::<Portable, true, true>(
                        m, n, k, &at, ldat, &b, ldb, &mut c4, ldc,
                    );
                } else {
                    gemm::<Portable, false, false>(m, n, k, &a, lda, &b, ldb, &mut c, ldc);
                    gemm_skip_zero::<Portable, false, false>(
                        m, n, k, &a, lda, &b, ldb, &mut c2, ldc,
                    );
                    gemm::<Portable, false, true>(m, n, k, &at, ldat, &b, ldb, &mut c3, ldc);
                    gemm_skip_zero::<Portable, false, true>(
                        m, n, k, &at, ldat, &b, ldb, &mut c4, ldc,
                    );
                }
                for i in 0..m {
                    for j in 0..n {
                        let mut want = if acc { c0[i * ldc + j] } else { 0.0 };
                        for kk in 0..k {
                            want += a[i * lda + kk] * b[kk * ldb + j];
                        }
                        assert_eq!(c[i * ldc + j], want, "m={m} n={n} k={k} ({i},{j})");
                        assert_eq!(c2[i * ldc + j], want);
                        assert_eq!(c3[i * ldc + j], want);
                        assert_eq!(c4[i * ldc + j], want);
                    }
                    for j in n..ldc {
                        assert_eq!(c[i * ldc + j], c0[i * ldc + j], "wrote outside n");
                    }
                }
            }
        }
    }

    /// One copy's `gemm` (`cm: None`) or `gemm_colmax` (`Some`), as the check below calls it.
    #[cfg(target_arch = "x86_64")]
    type Run<'a> = &'a dyn Fn(
        (bool, bool),
        (usize, usize, usize),
        &[f32],
        usize,
        &[f32],
        &mut [f32],
        usize,
        Option<&mut [f32]>,
    );

    /// `run` against sequential FMAs in each element's k order, bit for bit, with and without
    /// accumulation and transposed A, and its fused column max with a NaN row ignored.
    #[cfg(target_arch = "x86_64")]
    fn check_sequential_fmas(cases: &[(usize, usize, usize)], run: Run<'_>) {
        for &(m, n, k) in cases {
            let (lda, ldc) = (m.max(k) + 1, n + 3);
            let a: Vec<f32> = (0..k.max(m) * lda)
                .map(|i| ((i * 7 % 13) as f32) * 0.37 - 2.1)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32) * 0.61 - 3.0)
                .collect();
            let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 5) as f32 * 0.25).collect();
            for (acc, at) in [(false, false), (true, true), (false, true), (true, false)] {
                let mut want = c0.clone();
                for r in 0..m {
                    for x in 0..n {
                        let mut v = if acc { c0[r * ldc + x] } else { 0.0 };
                        for kk in 0..k {
                            let av = if at { a[kk * lda + r] } else { a[r * lda + kk] };
                            v = av.mul_add(b[kk * n + x], v);
                        }
                        want[r * ldc + x] = v;
                    }
                }
                let mut got = c0.clone();
                run((acc, at), (m, n, k), &a, lda, &b, &mut got, ldc, None);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "m={m} n={n} k={k} acc={acc} at={at}"
                );
            }
            let mut a_nan = a.clone();
            a_nan[0] = f32::NAN;
            let mut got = c0.clone();
            let mut cm = vec![f32::NEG_INFINITY; n];
            run(
                (false, false),
                (m, n, k),
                &a_nan,
                lda,
                &b,
                &mut got,
                ldc,
                Some(&mut cm),
            );
            for (x, &g) in cm.iter().enumerate() {
                let want = (0..m)
                    .map(|r| got[r * ldc + x])
                    .filter(|v| !v.is_nan())
                    .fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(g.to_bits(), want.to_bits(), "column {x}");
            }
        }
    }

    /// A [`Run`] over copy `$isa`, compiled with `$features`.
    #[cfg(target_arch = "x86_64")]
    macro_rules! copy_run {
        ($isa:ty, $features:literal) => {{
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            fn run(
                (acc, at): (bool, bool),
                (m, n, k): (usize, usize, usize),
                a: &[f32],
                lda: usize,
                b: &[f32],
                c: &mut [f32],
                ldc: usize,
                cm: Option<&mut [f32]>,
            ) {
                match (cm, acc, at) {
                    (Some(cm), ..) => gemm_colmax::<$isa>(m, n, k, a, lda, b, n, c, ldc, cm),
                    (None, false, false) => {
                        gemm::<$isa, false, false>(m, n, k, a, lda, b, n, c, ldc)
                    }
                    (None, true, true) => gemm::<$isa, true, true>(m, n, k, a, lda, b, n, c, ldc),
                    (None, false, true) => gemm::<$isa, false, true>(m, n, k, a, lda, b, n, c, ldc),
                    (None, true, false) => gemm::<$isa, true, false>(m, n, k, a, lda, b, n, c, ldc),
                }
            }
            // SAFETY: callers run this only after detecting the features.
            move |f: (bool, bool),
                  d: (usize, usize, usize),
                  a: &[f32],
                  lda: usize,
                  b: &[f32],
                  c: &mut [f32],
                  ldc: usize,
                  cm: Option<&mut [f32]>| unsafe { run(f, d, a, lda, b, c, ldc, cm) }
        }};
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_register_block_is_bit_identical_to_sequential_fmas() {
        use super::super::simd::Avx2;
        if !(has(Feature::Avx2) && has(Feature::Fma)) {
            println!("skipped: needs AVX2+FMA, hidden or absent");
            return;
        }
        // Rows 8, 12, 16 and 20 end their 6-row blocks with 2, 0, 4 and 2 rows; k above 32
        // runs in chunks of 32 (37: 32 + 5, 130: four chunks and 2).
        let cases = [
            (4, 32, 9),
            (8, 16, 37),
            (12, 48, 64),
            (16, 32, 5),
            (20, 128, 64),
            (8, 48, 130),
        ];
        check_sequential_fmas(&cases, &copy_run!(Avx2, "avx2,fma"));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_row_blocks_are_bit_identical_to_sequential_fmas() {
        use super::super::simd::Avx512;
        if !(has(Feature::Avx512f) && has(Feature::Fma)) {
            println!("skipped: needs AVX-512F+FMA, hidden or absent");
            return;
        }
        // Every column tail after whole 64-column blocks (16, 32, 48, none).
        let cases = [
            (4, 16, 9),
            (12, 16, 37),
            (28, 80, 13),
            (8, 96, 64),
            (16, 112, 5),
            (20, 128, 64),
        ];
        check_sequential_fmas(&cases, &copy_run!(Avx512, "avx512f,avx512bw,avx512vl,fma"));
    }
}
