//! Reading inputs into tiles: [`Src`] is a validated f32 or bf16 input `[B, H, L, D]` with its
//! strides (unit stride in D, any batch, head and row strides); [`rows`] borrows or converts a run
//! of rows as an f32 matrix, [`load_transposed`] packs rows transposed.
//!
//! Contract: offsets come from [`Src::row`] and rows are [`Src::ld`] apart, so every kernel
//! reads strided (PyTorch `[B, L, H, D]` transposed) inputs in place; the bounds of every
//! addressed element were checked when the view was made.

use super::simd;
use super::tile_matmul;
use crate::StridedView;
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
    if let SrcData::F32(x) = src.data {
        // `dim` a multiple of 16: the products read exactly `dim` columns of each row, so the
        // rows are used in place at their own stride.
        if dim.is_multiple_of(16) && sl >= dim && off + (m - 1) * sl + dim <= x.len() {
            return (&x[off..off + (m - 1) * sl + dim], sl);
        }
    }
    let ld = tile_matmul::round_up(dim, 16);
    for r in 0..n {
        src.load(off + r * sl, &mut buf[r * ld..r * ld + dim], 1.0);
    }
    buf[n * ld..m * ld].fill(0.0);
    (&buf[..m * ld], ld)
}

/// Writes `n` rows from element `off` of an input (at its row stride), times `scale`, transposed into
/// `dst[x * ld + r]` (`x < dim`, `r < n`), zeroing columns `n..round_up(n, 16)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_transposed(
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
    for r in 0..n {
        src.load(off + r * src.ld(), tmp, scale);
        for (x, &val) in tmp.iter().enumerate() {
            dst[x * ld + r] = val;
        }
    }
    let np = tile_matmul::round_up(n, 16);
    if np > n {
        for x in 0..dim {
            dst[x * ld + n..x * ld + np].fill(0.0);
        }
    }
}
