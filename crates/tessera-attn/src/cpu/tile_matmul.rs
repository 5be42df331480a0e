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
}
