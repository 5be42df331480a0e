//! Reading inputs into tiles: [`Src`] is a validated f32 or bf16 input `[B, H, L, D]` with its
//! strides (unit stride in D, any batch, head and row strides); [`rows`] borrows or converts a run
//! of rows as an f32 matrix, [`load_transposed`] packs rows transposed.
//!
//! Contract: offsets come from [`Src::row`] and rows are [`Src::ld`] apart, so every kernel
//! reads strided (PyTorch `[B, L, H, D]` transposed) inputs in place; the bounds of every
//! addressed element were checked when the view was made.

use super::simd;
use super::tile_matmul;
use crate::views::StridedView;
use half::bf16;
use rayon::prelude::*;
use tessera_core::tensor::ViewData;
use tessera_core::{Error, Result};

/// The storage of a validated f32 or bf16 input.
#[derive(Clone, Copy)]
pub(crate) enum SrcData<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

/// A validated f32 or bf16 input `[B, H, L, D]` with its strides, read row by row into f32
/// tiles. Row `i` of head `h` in batch `b` starts at [`Src::row`]; consecutive rows are
/// [`Src::ld`] elements apart (`D` when contiguous); a row's D elements are contiguous.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub(crate) data: SrcData<'a>,
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a> Src<'a> {
    pub(crate) fn new(v: &StridedView<'a>) -> Result<Self> {
        let data = match v.data {
            ViewData::F32(x) => SrcData::F32(x),
            ViewData::BF16(x) => SrcData::BF16(x),
            _ => return Err(Error::Internal(format!("unvalidated dtype {}", v.dtype()))),
        };
        Ok(Src {
            data,
            shape: v.shape,
            strides: v.strides,
        })
    }

    /// Element offset of row `i` of head `h` in batch `b`.
    #[inline(always)]
    pub(crate) fn row(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.strides[0] + h * self.strides[1] + i * self.strides[2]
    }

    /// Elements between consecutive rows.
    #[inline(always)]
    pub(crate) fn ld(&self) -> usize {
        self.strides[2]
    }

    /// Elements per row (the head dim).
    #[inline(always)]
    pub(crate) fn dim(&self) -> usize {
        self.shape[3]
    }

    /// Whether every row starts at an even element offset (all strides even), so rows of a
    /// 2-byte dtype start on 4-byte words relative to the storage.
    pub(crate) fn strides_even(&self) -> bool {
        self.strides[..3].iter().all(|s| s.is_multiple_of(2))
    }

    /// The bf16 storage, if that is the dtype.
    pub(crate) fn bf16(&self) -> Option<&'a [bf16]> {
        match self.data {
            SrcData::BF16(x) => Some(x),
            SrcData::F32(_) => None,
        }
    }

    /// `dst[i] = self[off + i] * scale` for `i < dst.len()`.
    #[inline(always)]
    pub(crate) fn load(self, off: usize, dst: &mut [f32], scale: f32) {
        let n = dst.len();
        match self.data {
            SrcData::F32(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = s * scale;
                }
            }
            SrcData::BF16(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = simd::bf16_to_f32(s) * scale;
                }
            }
        }
    }

    /// `(b, h)` slabs as `(offset of row 0, rows, whether the rows are back to back)`.
    fn slabs(&self) -> impl Iterator<Item = (usize, usize, bool)> + '_ {
        let [nb, nh, nl, nd] = self.shape;
        let dense = self.strides[2] == nd;
        (0..nb * nh).map(move |bh| (self.row(bh / nh, bh % nh, 0), nl, dense))
    }

    /// Every `(b, h, i)` row's D elements, as `(offset, len)` runs (whole slabs when dense).
    fn runs(&self) -> Vec<(usize, usize)> {
        let nd = self.shape[3];
        let mut out = Vec::new();
        for (off, nl, dense) in self.slabs() {
            if dense {
                out.push((off, nl * nd));
            } else {
                out.extend((0..nl).map(|i| (off + i * self.ld(), nd)));
            }
        }
        out
    }

    /// Whether every element of the view is finite.
    pub(crate) fn all_finite(self) -> bool {
        // Branch-free folds over the exponent bits (vectorize; an early exit per element
        // does not): a value is non-finite when its exponent field is all ones.
        let runs = self.runs();
        runs.par_iter().all(|&(off, n)| match self.data {
            SrcData::F32(x) => x[off..off + n].chunks(1 << 16).all(|c| {
                c.iter().fold(0u32, |a, v| {
                    a | u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
                }) == 0
            }),
            SrcData::BF16(x) => x[off..off + n].chunks(1 << 16).all(|c| {
                c.iter()
                    .fold(0u16, |a, v| a | u16::from(v.to_bits() & 0x7F80 == 0x7F80))
                    == 0
            }),
        })
    }
}

/// Rows `n` rows from element `off` of an input (at its row stride) as an f32 matrix with at least `m >= n`
/// readable rows and at least `round_up(dim, 16)` readable columns: borrowed when the input is f32,
/// `dim` is a multiple of 16 and enough rows follow, else converted into `buf` (leading dimension
/// `round_up(dim, 16)`, rows `n..m` zeroed; `buf`'s padding columns must already be zero).
/// Returns the matrix and its leading dimension.
#[inline(always)]
pub(crate) fn rows<'s>(
    src: Src<'s>,
    off: usize,
    n: usize,
    m: usize,
    dim: usize,
    buf: &'s mut [f32],
) -> (&'s [f32], usize) {
    let sl = src.ld();
    if let (true, SrcData::F32(x)) = (in_place(src, off, m, dim), src.data) {
        return (&x[off..off + (m - 1) * sl + dim], sl);
    }
    let ld = tile_matmul::round_up(dim, 16);
    for r in 0..n {
        src.load(off + r * sl, &mut buf[r * ld..r * ld + dim], 1.0);
    }
    buf[n * ld..m * ld].fill(0.0);
    (&buf[..m * ld], ld)
}

/// Whether [`rows`] reads its `m` rows from `off` in place (else it converts them): f32 rows
/// whose `dim` is a multiple of 16 (the products read exactly `dim` columns of each row), at
/// their own stride, all inside the storage.
#[inline(always)]
pub(crate) fn in_place(src: Src<'_>, off: usize, m: usize, dim: usize) -> bool {
    let sl = src.ld();
    match src.data {
        SrcData::F32(x) => {
            dim.is_multiple_of(16) && sl >= dim && m > 0 && off + (m - 1) * sl + dim <= x.len()
        }
        SrcData::BF16(_) => false,
    }
}

/// Writes `n` rows from element `off` of an input (at its row stride), times `scale`, transposed into
/// `dst[x * ld + r]` (`x < dim`, `r < n`), zeroing columns `n..round_up(n, 16)`.
///
/// The AVX-512 copy (`S::WIDE`) moves f32 inputs whose `dim` is a multiple of 16 in 16 × 16
/// register blocks ([`transpose16`]); the other rows and copies go element by element. Both
/// write the same values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_transposed<S: simd::Simd>(
    src: Src<'_>,
    off: usize,
    n: usize,
    dim: usize,
    scale: f32,
    tmp: &mut [f32],
    dst: &mut [f32],
    ld: usize,
) {
    let tmp = &mut tmp[..dim];
    assert!(n <= ld && (dim == 0 || dst.len() >= (dim - 1) * ld + n));
    let sl = src.ld();
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let (true, SrcData::F32(x)) = (S::WIDE, src.data) {
        let blocks = n / 16 * 16;
        if blocks > 0 && dim.is_multiple_of(16) && off + (blocks - 1) * sl + dim <= x.len() {
            for r in (0..blocks).step_by(16) {
                for c in (0..dim).step_by(16) {
                    // SAFETY: the WIDE copy runs only where AVX-512F was detected; rows
                    // r..r + 16 <= n of columns c..c + 16 <= dim are inside `x` (checked above)
                    // and their transposed places inside `dst` (asserted above).
                    unsafe {
                        transpose16(
                            x.as_ptr().add(off + r * sl + c),
                            sl,
                            scale,
                            dst.as_mut_ptr().add(c * ld + r),
                            ld,
                        )
                    }
                }
            }
            done = blocks;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if S::YMM {
        let blocks = n / 8 * 8;
        let len = match src.data {
            SrcData::F32(x) => x.len(),
            SrcData::BF16(x) => x.len(),
        };
        if blocks > 0 && dim.is_multiple_of(8) && off + (blocks - 1) * sl + dim <= len {
            for r in (0..blocks).step_by(8) {
                for c in (0..dim).step_by(8) {
                    // SAFETY: the YMM copy runs only where AVX2 and FMA were detected; rows
                    // r..r + 8 <= n of columns c..c + 8 <= dim are inside the storage (checked
                    // above) and their transposed places inside `dst` (asserted above).
                    unsafe {
                        transpose8(
                            src,
                            off + r * sl + c,
                            scale,
                            dst.as_mut_ptr().add(c * ld + r),
                            ld,
                        )
                    }
                }
            }
            done = blocks;
        }
    }
    for r in done..n {
        src.load(off + r * sl, tmp, scale);
        // A strided iterator: no bounds check per element (an indexed loop reloaded the base
        // and checked every store).
        for (d, &val) in dst[r..].iter_mut().step_by(ld).zip(tmp.iter()) {
            *d = val;
        }
    }
    let np = tile_matmul::round_up(n, 16);
    if np > n {
        for x in 0..dim {
            dst[x * ld + n..x * ld + np].fill(0.0);
        }
    }
}

/// `dst[x * ld + r] = src[off + r * sl + x] * scale` for `r, x < 8` (bf16 widened exactly
/// first, so the values are the scalar path's): the AVX2 copy's 8 × 8 transpose in registers
/// (unpack pairs, pairs of pairs, then 128-bit halves) instead of 64 strided scalar stores,
/// which were ~3 % of a forced-AVX2 doc-causal forward (perf).
///
/// # Safety
/// AVX2 must be available; `src` readable at `off + r * sl + x` and `dst` writable at
/// `x * ld + r` for `r, x < 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(src: Src<'_>, off: usize, scale: f32, dst: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    let (sl, s) = (src.ld(), _mm256_set1_ps(scale));
    let rows: [__m256; 8] = std::array::from_fn(|r| {
        let at = off + r * sl;
        // SAFETY: the caller's contract.
        let v = unsafe {
            match src.data {
                SrcData::F32(x) => _mm256_loadu_ps(x.as_ptr().add(at)),
                SrcData::BF16(x) => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(x.as_ptr().add(at).cast())),
                )),
            }
        };
        _mm256_mul_ps(v, s)
    });
    let t: [__m256; 8] = std::array::from_fn(|k| {
        let (a, b) = (rows[k & !1], rows[k | 1]);
        if k % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4h + e]: column e (low half) and e + 4 (high half) of rows 4h..4h + 4.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (h, e) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + e / 2], t[4 * h + 2 + e / 2]);
        if e % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    for e in 0..4 {
        // SAFETY: the caller's contract.
        unsafe {
            _mm256_storeu_ps(
                dst.add(e * ld),
                _mm256_permute2f128_ps::<0x20>(u[e], u[4 + e]),
            );
            _mm256_storeu_ps(
                dst.add((e + 4) * ld),
                _mm256_permute2f128_ps::<0x31>(u[e], u[4 + e]),
            );
        }
    }
}

/// `dst[x * ld + r] = src[r * sl + x] * scale` for `r, x < 16`: a 16 × 16 transpose in
/// registers ([`transpose16_regs`]) instead of 256 strided scalar stores.
///
/// # Safety
/// AVX-512F must be available; `src` readable at `r * sl + x` and `dst` writable at
/// `x * ld + r` for `r, x < 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(src: *const f32, sl: usize, scale: f32, dst: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps(scale);
    let rows: [__m512; 16] =
        std::array::from_fn(|r| _mm512_mul_ps(_mm512_loadu_ps(src.add(r * sl)), s));
    for (x, c) in transpose16_regs(rows).into_iter().enumerate() {
        _mm512_storeu_ps(dst.add(x * ld), c);
    }
}

/// `dst[x * ld + r] = src[r * sl + x]` for `r, x < 16`, moving 32-bit words unchanged (the bf16
/// kernels' packed pairs).
///
/// # Safety
/// AVX-512F must be available; `src` readable at `r * sl + x` and `dst` writable at
/// `x * ld + r` for `r, x < 16` (no alignment needed).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16_words(src: *const u32, sl: usize, dst: *mut u32, ld: usize) {
    use std::arch::x86_64::*;
    // Shuffles and unaligned moves only: every bit pattern (NaN payloads too) is kept.
    let rows: [__m512; 16] = std::array::from_fn(|r| _mm512_loadu_ps(src.add(r * sl).cast()));
    for (x, c) in transpose16_regs(rows).into_iter().enumerate() {
        _mm512_storeu_ps(dst.add(x * ld).cast(), c);
    }
}

/// `dst[x·ld + r] = src[r·sl + x]` for rows `r < rows` and columns `x < cols` (both multiples
/// of 16), by [`transpose16_words`] blocks; the extents are checked against the slices.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_words(
    (src, sl): (&[u32], usize),
    (dst, ld): (&mut [u32], usize),
    rows: usize,
    cols: usize,
) {
    assert!(rows.is_multiple_of(16) && cols.is_multiple_of(16) && cols <= sl && rows <= ld);
    assert!(
        rows == 0
            || cols == 0
            || (src.len() >= (rows - 1) * sl + cols && dst.len() >= (cols - 1) * ld + rows),
        "transpose_words: extents"
    );
    for r0 in (0..rows).step_by(16) {
        for x0 in (0..cols).step_by(16) {
            // SAFETY: rows `r0..r0 + 16 <= rows`, columns `x0..x0 + 16 <= cols` of `src` and
            // their transposed places in `dst` are inside (asserted); AVX-512F (caller).
            unsafe {
                transpose16_words(
                    src.as_ptr().add(r0 * sl + x0),
                    sl,
                    dst.as_mut_ptr().add(x0 * ld + r0),
                    ld,
                )
            }
        }
    }
}

/// The 16 × 16 transpose of 32-bit lanes held in 16 registers (unpack pairs, then pairs of
/// pairs, then 128-bit lanes twice): column `x` of the rows comes back as register `x`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16_regs(rows: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved (elements 0,1 | 2,3 of each 128-bit lane).
    let mut t = [_mm512_setzero_ps(); 16];
    for k in 0..8 {
        let (a, b) = (rows[2 * k], rows[2 * k + 1]);
        t[2 * k] = _mm512_unpacklo_ps(a, b);
        t[2 * k + 1] = _mm512_unpackhi_ps(a, b);
    }
    // u[4g + e]: element e (and e + 4, + 8, + 12) of rows 4g..4g + 4, one per 128-bit lane.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let (lo, hi) = (_mm512_castps_pd(t[4 * g]), _mm512_castps_pd(t[4 * g + 2]));
        let (lo2, hi2) = (
            _mm512_castps_pd(t[4 * g + 1]),
            _mm512_castps_pd(t[4 * g + 3]),
        );
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo2, hi2));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo2, hi2));
    }
    // Lanes: v[e] = rows 0..8 of columns e, e + 8; v[e + 4] = of columns e + 4, e + 12 (and
    // v[8..] the same for rows 8..16).
    let mut v = [_mm512_setzero_ps(); 16];
    for h in 0..2 {
        for e in 0..4 {
            let (a, b) = (u[8 * h + e], u[8 * h + 4 + e]);
            v[8 * h + e] = _mm512_shuffle_f32x4::<0x88>(a, b);
            v[8 * h + 4 + e] = _mm512_shuffle_f32x4::<0xdd>(a, b);
        }
    }
    // Columns e and e + 8, rows 0..16.
    let mut out = [_mm512_setzero_ps(); 16];
    for e in 0..8 {
        let (a, b) = (v[e], v[8 + e]);
        out[e] = _mm512_shuffle_f32x4::<0x88>(a, b);
        out[e + 8] = _mm512_shuffle_f32x4::<0xdd>(a, b);
    }
    out
}

/// Cache hints for rows `off + r·ld` (`r < n`, `dim` elements each) of `src`: every 64-byte line
/// is requested into L2 (`prefetcht1`). A hint only: results never depend on it; rows outside
/// the storage are skipped; no-op off x86-64.
pub(crate) fn prefetch_rows(src: Src<'_>, off: usize, n: usize, dim: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (base, len, size) = match src.data {
            SrcData::F32(x) => (x.as_ptr().cast::<u8>(), x.len(), 4),
            SrcData::BF16(x) => (x.as_ptr().cast::<u8>(), x.len(), 2),
        };
        let ld = src.ld();
        for r in 0..n {
            let start = off + r * ld;
            if start + dim > len {
                break;
            }
            for byte in (start * size..(start + dim) * size).step_by(64) {
                // SAFETY: `byte` lies inside the storage (checked above); a prefetch never
                // faults or changes memory.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        base.add(byte).cast(),
                    )
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, off, n, dim);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::{Avx512, Portable};
    use tessera_core::cpu_features::{has, Feature};
    use tessera_core::tensor::ViewData;

    /// Copy `S`'s `load_transposed` writes exactly what the element-by-element path writes, for
    /// f32 (and, with `bf16`, bf16) rows at a padded stride (`[B, L, H, D]` storage viewed as
    /// `[B, H, L, D]`), ragged row counts (blocks plus a scalar tail) and offsets into a batch.
    fn check_block_transpose<S: crate::cpu::simd::Simd>(d: usize, bf16: bool) {
        let (b, h, l) = (2, 3, 70);
        let sl = h * d + 8;
        let data: Vec<f32> = (0..b * l * sl)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.37 - 150.0)
            .collect();
        let halves: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let (shape, strides) = ([b, h, l, d], [l * sl, d, sl, 1]);
        let mut views = vec![StridedView::new("x", ViewData::F32(&data), shape, strides)];
        if bf16 {
            views.push(StridedView::new(
                "x",
                ViewData::BF16(&halves),
                shape,
                strides,
            ));
        }
        for view in views {
            let src = Src::new(&view.expect("a valid strided view")).expect("source");
            for (bb, hh, r0, n) in [(0, 0, 0, 64), (1, 2, 3, 67), (1, 1, 50, 20), (0, 2, 0, 7)] {
                let ld = 88;
                let mut want = vec![f32::NAN; d * ld];
                let mut got = vec![f32::NAN; d * ld];
                let mut tmp = vec![0.0; d];
                let off = src.row(bb, hh, r0);
                load_transposed::<Portable>(src, off, n, d, 0.125, &mut tmp, &mut want, ld);
                load_transposed::<S>(src, off, n, d, 0.125, &mut tmp, &mut got, ld);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "b={bb} h={hh} r0={r0} n={n} bf16={bf16}");
            }
        }
    }

    /// The AVX-512 16 × 16 blocks (f32 rows).
    #[test]
    fn block_transpose_equals_scalar() {
        if !(has(Feature::Avx512f)) {
            eprintln!("skipped: needs AVX-512F, hidden or absent");
            return;
        }
        // AVX-512F was detected above (the WIDE copy's blocks need it).
        check_block_transpose::<Avx512>(64, false);
    }

    /// The AVX2 8 × 8 blocks (f32 and bf16 rows).
    #[test]
    fn ymm_block_transpose_equals_scalar() {
        if !(has(Feature::Avx2) && has(Feature::Fma)) {
            eprintln!("skipped: needs AVX2+FMA, hidden or absent");
            return;
        }
        // AVX2 and FMA were detected above (the YMM copy's blocks need them).
        check_block_transpose::<crate::cpu::simd::Avx2>(24, true);
    }

    /// The 32-bit word transpose moves every word (NaN bit patterns included) to its place.
    #[test]
    fn word_transpose_moves_words_unchanged() {
        if !(has(Feature::Avx512f)) {
            eprintln!("skipped: needs AVX-512F, hidden or absent");
            return;
        }
        let (sl, ld) = (37, 21);
        let src: Vec<u32> = (0..16 * sl as u32)
            .map(|i| i.wrapping_mul(0x9E37_79B9) | 0x7F80_0001)
            .collect();
        let mut dst = vec![0u32; 16 * ld];
        // SAFETY: AVX-512F was detected; 16 rows of `sl` and 16 columns of `ld` fit the buffers.
        unsafe { transpose16_words(src.as_ptr().add(3), sl, dst.as_mut_ptr().add(2), ld) };
        for r in 0..16 {
            for x in 0..16 {
                assert_eq!(dst[2 + x * ld + r], src[3 + r * sl + x], "r={r} x={x}");
            }
        }
    }
}
