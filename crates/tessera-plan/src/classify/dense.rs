//! `dense` leaves: an explicit bit-packed [Lq, Lkv] mask for one (batch, head) slice.
//!
//! Contract: stage 1 ([`DenseLeaf::state`], `q_reach`) is exact from per-tile allowed counts
//! (computed once: the data is O(Lq·Lkv) by nature); stage 2 ([`DenseLeaf::write`]) copies the
//! tile's rows as whole 64-bit words (a shift and an OR per word, no per-pair work), exactly.

use super::geom::Geom;
use crate::plan::TileState;
use tessera_mask::DenseMask;

/// A `dense` leaf for one (batch, head) slice, with per-tile allowed counts.
pub(crate) struct DenseLeaf<'a> {
    mask: &'a DenseMask,
    slice: usize,
    counts: Vec<u32>,
    pub(super) q_reach: Vec<Option<(usize, usize)>>,
}

impl<'a> DenseLeaf<'a> {
    pub(super) fn new(g: &Geom, mask: &'a DenseMask, slice: usize) -> Self {
        // Dense data is O(Lq·Lkv) by nature; summarizing it once is the unavoidable cost.
        let mut counts = vec![0u32; g.nq * g.nk];
        for i in 0..g.lq {
            let row = mask.row_bits(slice, i);
            let base = (i / g.tq) * g.nk;
            for kt in 0..g.nk {
                let (j0, j1) = g.kr(kt);
                counts[base + kt] += count_bits(row, j0 as usize, j1 as usize + 1);
            }
        }
        let q_reach = (0..g.nq)
            .map(|qt| {
                let row = &counts[qt * g.nk..(qt + 1) * g.nk];
                let first = row.iter().position(|&c| c > 0)?;
                let last = row.iter().rposition(|&c| c > 0)?;
                Some((first, last))
            })
            .collect();
        DenseLeaf {
            mask,
            slice,
            counts,
            q_reach,
        }
    }
}

/// Number of set bits of `bits` in [lo, hi).
fn count_bits(bits: &[u64], lo: usize, hi: usize) -> u32 {
    let mut n = 0;
    let mut j = lo;
    while j < hi {
        let w = j / 64;
        let b = j % 64;
        let take = (64 - b).min(hi - j);
        let m = if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << b
        };
        n += (bits[w] & m).count_ones();
        j += take;
    }
    n
}

/// Reads `n <= 64` bits of `bits` starting at bit `at`.
fn read_bits(bits: &[u64], at: usize, n: usize) -> u64 {
    let (w, b) = (at / 64, at % 64);
    let mut v = bits[w] >> b;
    if b > 0 && w + 1 < bits.len() {
        v |= bits[w + 1] << (64 - b);
    }
    if n < 64 {
        v &= (1u64 << n) - 1;
    }
    v
}

impl DenseLeaf<'_> {
    /// Stage 1 of tile (`qt`, `kt`), exact.
    pub(super) fn state(&self, g: &Geom, qt: usize, kt: usize) -> TileState {
        let ((i0, i1), (j0, j1)) = (g.qr(qt), g.kr(kt));
        let c = self.counts[qt * g.nk + kt] as i64;
        if c == 0 {
            TileState::Empty
        } else if c == (i1 - i0 + 1) * (j1 - j0 + 1) {
            TileState::Full
        } else {
            TileState::Partial
        }
    }

    /// Stage 2: writes the tile's rows into `out` (word by word).
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let ((i0, i1), (j0, j1)) = (g.qr(qt), g.kr(kt));
        let (rows, ncols, wpr) = ((i1 - i0 + 1) as usize, (j1 - j0 + 1) as usize, g.wpr);
        for r in 0..rows {
            let bits = self.mask.row_bits(self.slice, i0 as usize + r);
            let row = &mut out[r * wpr..(r + 1) * wpr];
            for (w, word) in row.iter_mut().enumerate() {
                let at = w * 64;
                if at < ncols {
                    *word = read_bits(bits, j0 as usize + at, (ncols - at).min(64));
                }
            }
        }
    }
}
