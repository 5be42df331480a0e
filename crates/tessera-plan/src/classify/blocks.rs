//! `blocks` leaves: an explicit block selection (per query block, the selected key blocks).
//!
//! Contract: [`BlocksLeaf::candidates`] lists exactly the kv tiles a q-tile row's selection
//! touches (so planning costs O(selected tiles)); stage 1 ([`BlocksLeaf::state`]) is exact
//! from block coverage; stage 2 ([`BlocksLeaf::write`]) sets the selected blocks' ranges in a
//! zeroed `out`, one range per selected block and query block.

use super::geom::{set_range, Geom};
use crate::plan::TileState;
use tessera_mask::BlockSelection;

/// A `blocks` leaf for one (batch, head) slice of its selection.
pub(crate) struct BlocksLeaf<'a> {
    pub(super) sel: &'a BlockSelection,
    pub(super) slice: usize,
}

impl BlocksLeaf<'_> {
    /// Query blocks (inclusive) holding the rows of q-tile `qt`.
    fn q_blocks(&self, g: &Geom, qt: usize) -> std::ops::RangeInclusive<usize> {
        let (i0, i1) = g.qr(qt);
        let qb = self.sel.q_block();
        i0 as usize / qb..=i1 as usize / qb
    }

    /// Kv tiles (inclusive) overlapped by key block `t` (in range: `check` bounds `t`).
    fn tiles_of(&self, g: &Geom, t: u32) -> (usize, usize) {
        let kb = self.sel.kv_block();
        let j0 = t as usize * kb;
        let j1 = (j0 + kb).min(g.lkv) - 1;
        (j0 / g.tk, j1 / g.tk)
    }

    /// The sorted distinct kv tiles that hold a selected pair of q-tile `qt`.
    pub(super) fn candidates(&self, g: &Geom, qt: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for r in self.q_blocks(g, qt) {
            for &t in self.sel.row(self.slice, r) {
                let (a, b) = self.tiles_of(g, t);
                out.extend(a as u32..=b as u32);
            }
        }
        if !out.windows(2).all(|w| w[0] < w[1]) {
            out.sort_unstable();
            out.dedup();
        }
        out
    }

    /// Hull of [`BlocksLeaf::candidates`] (the rows are sorted: their ends suffice).
    pub(super) fn reach(&self, g: &Geom, qt: usize) -> Option<(usize, usize)> {
        self.q_blocks(g, qt)
            .filter_map(|r| {
                let row = self.sel.row(self.slice, r);
                Some((
                    self.tiles_of(g, *row.first()?).0,
                    self.tiles_of(g, *row.last()?).1,
                ))
            })
            .reduce(|(a, b), (x, y)| (a.min(x), b.max(y)))
    }

    /// (any, all): whether some / every query block of the tile selects some / every key
    /// block overlapping the tile.
    fn cover(&self, g: &Geom, qt: usize, kt: usize) -> (bool, bool) {
        let (j0, j1) = g.kr(kt);
        let kb = self.sel.kv_block();
        let (ka, kz) = ((j0 as usize / kb) as u32, (j1 as usize / kb) as u32);
        let (mut any, mut all) = (false, true);
        for r in self.q_blocks(g, qt) {
            let row = self.sel.row(self.slice, r);
            let lo = row.partition_point(|&t| t < ka);
            let n = row[lo..].partition_point(|&t| t <= kz);
            any |= n > 0;
            all &= n == (kz - ka + 1) as usize;
            if any && !all {
                break;
            }
        }
        (any, all)
    }
}

impl BlocksLeaf<'_> {
    /// Stage 1 of tile (`qt`, `kt`), exact.
    pub(super) fn state(&self, g: &Geom, qt: usize, kt: usize) -> TileState {
        match self.cover(g, qt, kt) {
            (false, _) => TileState::Empty,
            (true, true) => TileState::Full,
            (true, false) => TileState::Partial,
        }
    }

    /// Stage 2: ORs the selected blocks of the tile into `out`.
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let ((i0, i1), (j0, j1)) = (g.qr(qt), g.kr(kt));
        let (rows, ncols, wpr) = ((i1 - i0 + 1) as usize, (j1 - j0 + 1) as usize, g.wpr);
        let kb = self.sel.kv_block() as i64;
        let (ka, kz) = ((j0 / kb) as u32, (j1 / kb) as u32);
        let mut prev = None;
        for r in 0..rows {
            let qb = (i0 as usize + r) / self.sel.q_block();
            if let Some(p) = prev.filter(|&(b, _)| b == qb) {
                // Same query block as row `p`: the same bits.
                let p: usize = p.1;
                out.copy_within(p * wpr..(p + 1) * wpr, r * wpr);
                continue;
            }
            prev = Some((qb, r));
            let row = self.sel.row(self.slice, qb);
            let lo = row.partition_point(|&t| t < ka);
            for &t in row[lo..].iter().take_while(|&&t| t <= kz) {
                let a = t as i64 * kb - j0;
                set_range(&mut out[r * wpr..(r + 1) * wpr], a, a + kb, ncols);
            }
        }
    }
}
