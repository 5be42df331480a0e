//! Live sub-block ranges of the plan's partial masks, computed once per plan.
//!
//! A partial tile usually has large fully masked regions (the upper triangle of a diagonal tile,
//! the rows or columns on the far side of a document boundary). For each deduplicated partial
//! mask this records, at 16 × 16 sub-block granularity:
//! - per 16-key block `jb`: the query-column range `[c0, c1)` (multiples of 16) covering every
//!   16 × 16 sub-block of that key block holding an allowed pair; the same per group of [`RB`]
//!   keys (one row block of the products);
//! - per 16-query block `ib`: the exact key range `[r0, r1)` from the first to the last allowed key
//!   of any query in the block;
//! - the same per group of [`RB`] queries (one row block of the products);
//! - per 16-query block `ib`: the dense key range, the longest run of keys allowed for every
//!   query of the block, over which the exponentials need no lane masks.
//!
//! Kernels compute `Sᵀ` only over the column range of each key group (or 16-key block: the AVX2
//! copy, whose 3-row product blocks do not fit groups of 4; [`LiveBlocks::cols_of`]), exponentiate
//! per 16-query block over its key range only, then run `P·V` per query group (block) over its
//! key range only. Masked pairs inside the ranges are still excluded exactly by the bitmask, and
//! anything outside a range is never read.

use super::tile_matmul::RB;
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
    /// Key groups of `RB` per tile.
    kg: usize,
    /// `[masks][kg]` query-column ranges.
    group_cols: Vec<(u32, u32)>,
    /// `[masks][qb]` key ranges.
    keys: Vec<(u32, u32)>,
    /// Query groups of `RB` per tile.
    qg: usize,
    /// `[masks][qg]` key ranges.
    group_keys: Vec<(u32, u32)>,
    /// `[masks][qb]` dense key ranges.
    dense: Vec<(u32, u32)>,
}

/// The longest run of keys `< tk` set in every row of `rows` (empty `(0, 0)` if none).
fn dense_run<'a>(rows: impl Iterator<Item = &'a [u64]>, tk: usize) -> (u32, u32) {
    let mut all = vec![u64::MAX; tk.div_ceil(64)];
    for row in rows {
        for (a, &w) in all.iter_mut().zip(row) {
            *a &= w;
        }
    }
    let (mut best, mut start) = ((0, 0), None);
    for k in 0..=tk {
        let set = k < tk && all[k / 64] >> (k % 64) & 1 == 1;
        match (set, start) {
            (true, None) => start = Some(k),
            (false, Some(a)) => {
                if k - a > best.1 - best.0 {
                    best = (a, k);
                }
                start = None;
            }
            _ => {}
        }
    }
    (best.0 as u32, best.1 as u32)
}

/// Entry `i` of mask `id` in a `[masks][per]` range table.
#[inline(always)]
fn at(table: &[(u32, u32)], per: usize, id: u32, i: usize) -> (usize, usize) {
    let (a, b) = table[id as usize * per + i];
    (a as usize, b as usize)
}

impl LiveBlocks {
    pub(crate) fn new(plan: &Plan) -> Self {
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let (qb, kb) = (tq.div_ceil(SB), tk.div_ceil(SB));
        let (qg, kg) = (tq.div_ceil(RB), tk.div_ceil(RB));
        let p = &plan.partials;
        let n = p.len();
        let per: Vec<[Ranges; 5]> = (0..n)
            .into_par_iter()
            .map(|id| {
                // occ[jg][ib]: key group jg holds an allowed pair with a query of block ib.
                let mut occ = vec![vec![false; qb]; kg];
                let mut keys = vec![(0u32, 0u32); qb];
                let mut group = vec![(usize::MAX, 0usize); qg];
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
                            let g = &mut group[r / RB];
                            *g = (g.0.min(first), g.1.max(last + 1));
                            let mut bits = word;
                            while bits != 0 {
                                let c = w * 64 + bits.trailing_zeros() as usize;
                                // Clear the whole key group of c: one hit per group.
                                let g = (c % 64) / RB;
                                bits &= !((1u64 << RB) - 1) << (g * RB);
                                if c < tk {
                                    occ[c / RB][ib] = true;
                                }
                            }
                        }
                    }
                    if lo < hi {
                        keys[ib] = (lo as u32, hi.min(tk) as u32);
                    }
                }
                // Query-block span of a set of key groups, as a column range.
                let span = |rows: &[Vec<bool>]| {
                    let live = |ib: usize| rows.iter().any(|r| r[ib]);
                    match ((0..qb).position(live), (0..qb).rposition(live)) {
                        (Some(a), Some(b)) => ((a * SB) as u32, ((b + 1) * SB) as u32),
                        _ => (0, 0),
                    }
                };
                let cols = occ.chunks(SB / RB).map(span).collect();
                let group_cols = occ.chunks(1).map(span).collect();
                let dense = (0..qb)
                    .map(|ib| {
                        let rows = (ib * SB..((ib + 1) * SB).min(tq)).map(|r| p.row(id as u32, r));
                        dense_run(rows, tk)
                    })
                    .collect();
                let group = group
                    .into_iter()
                    .map(|(lo, hi)| {
                        if lo < hi {
                            (lo as u32, hi.min(tk) as u32)
                        } else {
                            (0, 0)
                        }
                    })
                    .collect();
                [cols, keys, group, group_cols, dense]
            })
            .collect();
        let mut cols = Vec::with_capacity(n * kb);
        let mut keys = Vec::with_capacity(n * qb);
        let mut group_keys = Vec::with_capacity(n * qg);
        let mut group_cols = Vec::with_capacity(n * kg);
        let mut dense = Vec::with_capacity(n * qb);
        for [c, k, g, gc, d] in per {
            cols.extend(c);
            keys.extend(k);
            group_keys.extend(g);
            group_cols.extend(gc);
            dense.extend(d);
        }
        LiveBlocks {
            kb,
            qb,
            cols,
            kg,
            group_cols,
            keys,
            qg,
            group_keys,
            dense,
        }
    }

    /// Query-column range `[c0, c1)` of key block `jb` of partial mask `id` (multiples of 16).
    #[inline(always)]
    pub(crate) fn cols(&self, id: u32, jb: usize) -> (usize, usize) {
        at(&self.cols, self.kb, id, jb)
    }

    /// Query-column range `[c0, c1)` (multiples of 16) of the key group `g` (keys
    /// `g·RB..(g + 1)·RB`) of partial mask `id`.
    #[inline(always)]
    pub(crate) fn group_cols(&self, id: u32, g: usize) -> (usize, usize) {
        at(&self.group_cols, self.kg, id, g)
    }

    /// The column range of key rows `j0..j0 + step`: [`Self::group_cols`] for `step` = [`RB`],
    /// [`Self::cols`] for `step` = [`SB`] (`j0` a multiple of `step`).
    #[inline(always)]
    pub(crate) fn cols_of(&self, id: u32, j0: usize, step: usize) -> (usize, usize) {
        if step == SB {
            self.cols(id, j0 / SB)
        } else {
            self.group_cols(id, j0 / RB)
        }
    }

    /// Key rows `0..mk` in maximal runs of consecutive `step`-row blocks ([`RB`] or [`SB`]) that
    /// share one column range ([`Self::cols_of`]), as `(r0, r1, c0, c1)`; runs with an empty
    /// range are left out. One product per run gives the product room to block rows: a narrow
    /// column range needs many rows to keep enough independent accumulators in flight.
    pub(crate) fn col_runs(
        &self,
        id: u32,
        mk: usize,
        step: usize,
    ) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let mut r0 = 0;
        std::iter::from_fn(move || {
            while r0 < mk {
                let cols = self.cols_of(id, r0, step);
                let mut r1 = (r0 + step).min(mk);
                while r1 < mk && self.cols_of(id, r1, step) == cols {
                    r1 = (r1 + step).min(mk);
                }
                let start = r0;
                r0 = r1;
                if cols.0 < cols.1 {
                    return Some((start, r1, cols.0, cols.1));
                }
            }
            None
        })
    }

    /// The key range of query rows `i0..i0 + step`: [`Self::group_keys`] for `step` = [`RB`],
    /// [`Self::keys`] for `step` = [`SB`] (`i0` a multiple of `step`).
    #[inline(always)]
    pub(crate) fn keys_of(&self, id: u32, i0: usize, step: usize) -> (usize, usize) {
        if step == SB {
            self.keys(id, i0 / SB)
        } else {
            self.group_keys(id, i0 / RB)
        }
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
        at(&self.keys, self.qb, id, ib)
    }

    /// The longest run of keys `[d0, d1)` allowed for every query (row `< tq`) of block `ib` of
    /// partial mask `id` (`d0 = d1` if none): inside it the exponentials need no lane mask.
    #[inline(always)]
    pub(crate) fn dense(&self, id: u32, ib: usize) -> (usize, usize) {
        at(&self.dense, self.qb, id, ib)
    }

    /// Key range `[r0, r1)` of the query group `g` (queries `g·RB..(g + 1)·RB`) of partial
    /// mask `id`: tighter than its block's on a diagonal or a document boundary, where it cuts
    /// the `P·V` work to ~1 % above the allowed pairs (from ~3 % per block).
    #[inline(always)]
    pub(crate) fn group_keys(&self, id: u32, g: usize) -> (usize, usize) {
        at(&self.group_keys, self.qg, id, g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tessera_mask::{Mask, SegmentIds, Segments};
    use tessera_plan::{build_plan, PlanShape, TileShape};

    /// Every range against brute force over the bitmasks: it covers every allowed pair and is
    /// tight (its ends hold allowed pairs, at their granularity).
    #[test]
    fn ranges_cover_every_allowed_pair_and_are_tight() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for (len, tq, tk) in [
            (333, 64, 64),
            (1000, 128, 128),
            (517, 64, 128),
            (700, 32, 128),
            (300, 16, 64),
        ] {
            let mut ids = Vec::new();
            while ids.len() < len {
                let n = rng.gen_range(1..=200).min(len - ids.len());
                ids.extend(std::iter::repeat_n(ids.len() as i64, n));
            }
            let seg = Segments::shared(SegmentIds::shared(ids).unwrap());
            let masks = [
                Mask::causal() & Mask::document(seg.clone()),
                Mask::window(rng.gen_range(1..300), 0) & Mask::causal(),
                Mask::document(seg) | Mask::window(5, 70),
            ];
            for mask in masks {
                let shape = PlanShape::new(1, 1, len, len).unwrap();
                let plan = build_plan(&mask, shape, TileShape { q: tq, kv: tk }).unwrap();
                let live = LiveBlocks::new(&plan);
                for id in 0..plan.partials.len() as u32 {
                    let bit =
                        |q: usize, k: usize| plan.partials.row(id, q)[k / 64] >> (k % 64) & 1 == 1;
                    // Allowed pairs per (query range, key range).
                    let any = |qs: std::ops::Range<usize>, ks: std::ops::Range<usize>| {
                        qs.clone().any(|q| ks.clone().any(|k| bit(q, k)))
                    };
                    let keys_of = |qs: std::ops::Range<usize>| {
                        let ks: Vec<usize> =
                            (0..tk).filter(|&k| any(qs.clone(), k..k + 1)).collect();
                        ks.first().map_or((0, 0), |&a| (a, ks[ks.len() - 1] + 1))
                    };
                    let cols_of = |ks: std::ops::Range<usize>| {
                        let bs: Vec<usize> = (0..tq.div_ceil(SB))
                            .filter(|&b| any(b * SB..(b * SB + SB).min(tq), ks.clone()))
                            .collect();
                        bs.first()
                            .map_or((0, 0), |&a| (a * SB, (bs[bs.len() - 1] + 1) * SB))
                    };
                    for ib in 0..tq.div_ceil(SB) {
                        let want = keys_of(ib * SB..(ib * SB + SB).min(tq));
                        assert_eq!(live.keys(id, ib), want, "keys of block {ib}");
                    }
                    for g in 0..tq.div_ceil(RB) {
                        let want = keys_of(g * RB..(g * RB + RB).min(tq));
                        assert_eq!(live.group_keys(id, g), want, "keys of group {g}");
                    }
                    for jb in 0..tk.div_ceil(SB) {
                        let want = cols_of(jb * SB..(jb * SB + SB).min(tk));
                        assert_eq!(live.cols(id, jb), want, "columns of block {jb}");
                    }
                    for g in 0..tk.div_ceil(RB) {
                        let want = cols_of(g * RB..(g * RB + RB).min(tk));
                        assert_eq!(live.group_cols(id, g), want, "columns of group {g}");
                    }
                    // Column runs: consecutive, maximal, and every block with a nonempty range
                    // inside exactly one run of that range.
                    let mk = tk.div_ceil(RB) * RB;
                    for step in [RB, SB] {
                        let runs: Vec<_> = live.col_runs(id, mk, step).collect();
                        let mut covered = vec![false; mk.div_ceil(step)];
                        for (i, &(r0, r1, c0, c1)) in runs.iter().enumerate() {
                            assert!(r0 < r1 && r1 <= mk && c0 < c1, "run {i}");
                            assert!(r0 % step == 0 && (r1 % step == 0 || r1 == mk), "run {i}");
                            for r in (r0..r1).step_by(step) {
                                assert_eq!(live.cols_of(id, r, step), (c0, c1), "run {i}");
                                covered[r / step] = true;
                            }
                            if let Some(&(_, p1, p0c, p1c)) = i.checked_sub(1).map(|p| &runs[p]) {
                                assert!(p1 <= r0, "runs in order");
                                assert!(p1 < r0 || (p0c, p1c) != (c0, c1), "run {i} is maximal");
                            }
                        }
                        for (b, &c) in covered.iter().enumerate() {
                            let (c0, c1) = live.cols_of(id, b * step, step);
                            assert_eq!(c, c0 < c1, "block {b} of {step}");
                        }
                    }
                    // Dense runs: every key inside allowed for every row of the block, and no
                    // longer run exists.
                    for ib in 0..tq.div_ceil(SB) {
                        let qs = ib * SB..(ib * SB + SB).min(tq);
                        let full = |k: usize| qs.clone().all(|q| bit(q, k));
                        let (d0, d1) = live.dense(id, ib);
                        assert!((d0..d1).all(full) && d1 <= tk, "dense run of block {ib}");
                        let (mut run, mut longest) = (0, 0);
                        for k in 0..tk {
                            run = if full(k) { run + 1 } else { 0 };
                            longest = longest.max(run);
                        }
                        assert_eq!(d1 - d0, longest, "dense run of block {ib} is the longest");
                    }
                }
            }
        }
    }
}
