//! Live sub-block ranges of the plan's partial masks, computed once per plan.
//!
//! A partial tile usually has large fully masked regions (the upper triangle of a diagonal tile,
//! the rows or columns on the far side of a document boundary). For each deduplicated partial
//! mask this records, at 16 × 16 sub-block granularity:
//! - per 16-key block `jb`: the query-column range `[c0, c1)` (multiples of 16) covering every
//!   16 × 16 sub-block of that key block holding an allowed pair;
//! - per 16-query block `ib`: the exact key range `[r0, r1)` from the first to the last allowed key
//!   of any query in the block.
//!
//! Kernels compute `Sᵀ` only over the column range of each key block, exponentiate only there and
//! zero the rest of the tile's `Pᵀ`, then run `P·V` per query block over its key range only.
//! Masked pairs inside the ranges are still excluded exactly by the bitmask.

use rayon::prelude::*;
use tessera_plan::Plan;

/// Sub-block side.
pub(crate) const SB: usize = 16;

/// Half-open `(start, end)` ranges.
type Ranges = Vec<(u32, u32)>;

pub(crate) struct LiveBlocks {
    kb: usize,
    qb: usize,
    /// `[masks][kb]` query-column ranges.
    cols: Vec<(u32, u32)>,
    /// `[masks][qb]` key ranges.
    keys: Vec<(u32, u32)>,
}

impl LiveBlocks {
    pub(crate) fn new(plan: &Plan) -> Self {
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let (qb, kb) = (tq.div_ceil(SB), tk.div_ceil(SB));
        let p = &plan.partials;
        let n = p.len();
        let per: Vec<(Ranges, Ranges)> = (0..n)
            .into_par_iter()
            .map(|id| {
                // occ[jb][ib]: sub-block (key block jb, query block ib) holds an allowed pair.
                let mut occ = vec![vec![false; qb]; kb];
                let mut keys = vec![(0u32, 0u32); qb];
                for ib in 0..qb {
                    let (mut lo, mut hi) = (usize::MAX, 0usize);
                    for r in ib * SB..((ib + 1) * SB).min(tq) {
                        for (w, &word) in p.row(id as u32, r).iter().enumerate() {
                            if word == 0 {
                                continue;
                            }
                            let first = w * 64 + word.trailing_zeros() as usize;
                            let last = w * 64 + 63 - word.leading_zeros() as usize;
                            lo = lo.min(first);
                            hi = hi.max(last + 1);
                            let mut bits = word;
                            while bits != 0 {
                                let c = w * 64 + bits.trailing_zeros() as usize;
                                // Clear the whole 16-bit group of c: one hit per sub-block.
                                let g = (c % 64) / SB;
                                bits &= !(0xFFFFu64 << (g * SB));
                                if c < tk {
                                    occ[c / SB][ib] = true;
                                }
                            }
                        }
                    }
                    if lo < hi {
                        keys[ib] = (lo as u32, hi.min(tk) as u32);
                    }
                }
                let cols = occ
                    .iter()
                    .map(
                        |row| match (row.iter().position(|&x| x), row.iter().rposition(|&x| x)) {
                            (Some(a), Some(b)) => ((a * SB) as u32, ((b + 1) * SB) as u32),
                            _ => (0, 0),
                        },
                    )
                    .collect();
                (cols, keys)
            })
            .collect();
        let mut cols = Vec::with_capacity(n * kb);
        let mut keys = Vec::with_capacity(n * qb);
        for (c, k) in per {
            cols.extend(c);
            keys.extend(k);
        }
        LiveBlocks { kb, qb, cols, keys }
    }

    /// Query-column range `[c0, c1)` of key block `jb` of partial mask `id` (multiples of 16).
    #[inline(always)]
    pub(crate) fn cols(&self, id: u32, jb: usize) -> (usize, usize) {
        let (a, b) = self.cols[id as usize * self.kb + jb];
        (a as usize, b as usize)
    }

    /// Live query span `[a, b)` of key row `j` of a tile with `nq` real queries: all of them in a
    /// full tile, else the column range of `j`'s 16-key block of partial mask `id` clipped to
    /// `nq` (every query outside it is masked for that key).
    #[inline(always)]
    pub(crate) fn row_span(&self, full: bool, id: u32, j: usize, nq: usize) -> (usize, usize) {
        if full {
            (0, nq)
        } else {
            let (a, b) = self.cols(id, j / SB);
            let b = b.min(nq);
            (a.min(b), b)
        }
    }

    /// Key range `[r0, r1)` of query block `ib` of partial mask `id`.
    #[inline(always)]
    pub(crate) fn keys(&self, id: u32, ib: usize) -> (usize, usize) {
        let (a, b) = self.keys[id as usize * self.qb + ib];
        (a as usize, b as usize)
    }
}
