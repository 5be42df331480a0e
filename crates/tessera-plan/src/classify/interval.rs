//! Bands that share their query feature, fused: `lo_k <= f[i] - g_k[j] <= hi_k` for every k is
//! `L[j] <= f[i] <= R[j]` with one interval per key (`L = max(g_k + lo_k)`, `R = min(g_k +
//! hi_k)`). A tree-causal mask (`pre[j] <= pre[i] < end[j]`) is such a pair, and so is every
//! band intersected with another over the same query feature.
//!
//! Contract: the leaf allows exactly the pairs all its bands allow. Stage 1 lists, per q tile,
//! the kv tiles holding a key whose interval contains one of the tile's query values, found
//! from the keys' side over the query values sorted once (O(L log L), then per key the matching
//! query tiles), so tiles no interval reaches are never visited even when the features scatter
//! (the per-band ranges alone leave them partial); Full is proved from per-tile interval
//! bounds. Stage 2 compares each row's value against the tile's intervals in SIMD
//! ([`super::simd::tile_in_intervals32`]) as u32 offsets where the tile's span fits, else one
//! key at a time. Everything is exact in i128 or clamped to i64 values, so features near the
//! ends of i64 do not wrap.

use super::geom::Geom;
use super::simd;
use crate::plan::TileState;

/// The fused bands of one batch row.
pub(crate) struct IntervalLeaf<'a> {
    q: &'a [i64],
    /// Per key: its interval [l, r] clamped to i64 (empty when l > r).
    l: Vec<i64>,
    r: Vec<i64>,
    /// Per q tile: (min, max) of its values.
    q_sum: Vec<(i64, i64)>,
    /// Per kv tile: whether every interval is non-empty, and max l / min r over the tile (its
    /// intervals' common part), for Full.
    kv_full: Vec<(bool, i64, i64)>,
    /// Per kv tile: (base, top, whether narrowed), the span [base, top] of its non-empty
    /// intervals (base > top when none); keys' `l - base` and `r - l`
    /// (u32) at the tile's columns; an empty interval is `(u32::MAX, 0)`, which no value
    /// reaches (narrowed tiles span less than u32::MAX).
    narrow: Vec<(i64, i64, bool)>,
    l32: Vec<u32>,
    w32: Vec<u32>,
    /// Per q tile `qt`: the kv tiles some interval of which holds a value of the tile, sorted,
    /// at `list[off[qt]..off[qt + 1]]`.
    off: Vec<u32>,
    list: Vec<u32>,
    pub(super) q_reach: Vec<Option<(usize, usize)>>,
    /// Stage 2's rows to compare: (row, value - base).
    scratch: std::cell::RefCell<Vec<(u32, u32)>>,
}

/// Tile grids up to which the list of reached tiles is built (a bitmap of nq x nk bits: 32 MiB).
const MAX_GRID: usize = 1 << 28;

impl<'a> IntervalLeaf<'a> {
    /// The leaf of bands `(g_k, lo_k, hi_k)` over the query feature `q` (`bands` non-empty, every
    /// `g_k` as long as the kv side). `None` when the tile grid is too large for its lists.
    pub(super) fn new(g: &Geom, q: &'a [i64], bands: &[(&[i64], i64, i64)]) -> Option<Self> {
        if g.nq.checked_mul(g.nk)? > MAX_GRID {
            return None;
        }
        // In i128 (no wrap), then clamped to i64: an interval wholly above or below the i64
        // values is empty (clamping its nearer end would make it hold MAX or MIN).
        let (mut li, mut ri) = (vec![i128::MIN; g.lkv], vec![i128::MAX; g.lkv]);
        for &(feat, lo, hi) in bands {
            for (j, &v) in feat.iter().enumerate() {
                li[j] = li[j].max(v as i128 + lo as i128);
                ri[j] = ri[j].min(v as i128 + hi as i128);
            }
        }
        let (min, max) = (i64::MIN as i128, i64::MAX as i128);
        let (l, r): (Vec<i64>, Vec<i64>) = li
            .iter()
            .zip(&ri)
            .map(|(&a, &b)| {
                if a > b || a > max || b < min {
                    (i64::MAX, i64::MIN)
                } else {
                    (a.max(min) as i64, b.min(max) as i64)
                }
            })
            .unzip();
        let q_sum: Vec<(i64, i64)> = q
            .chunks(g.tq)
            .map(|c| {
                c.iter()
                    .fold((i64::MAX, i64::MIN), |(a, b), &v| (a.min(v), b.max(v)))
            })
            .collect();
        let mut kv_full = Vec::with_capacity(g.nk);
        let mut narrow = Vec::with_capacity(g.nk);
        let (mut l32, mut w32) = (vec![0u32; g.lkv], vec![0u32; g.lkv]);
        for kt in 0..g.nk {
            let (j0, j1) = (kt * g.tk, ((kt + 1) * g.tk).min(g.lkv));
            let (ls, rs) = (&l[j0..j1], &r[j0..j1]);
            let all = ls.iter().zip(rs).all(|(a, b)| a <= b);
            let maxl = ls.iter().copied().max().unwrap_or(i64::MAX);
            let minr = rs.iter().copied().min().unwrap_or(i64::MIN);
            kv_full.push((all, maxl, minr));
            // The span of the non-empty intervals: narrowed when it is below u32::MAX.
            let (lo, hi) = ls
                .iter()
                .zip(rs)
                .filter(|(a, b)| a <= b)
                .fold((i64::MAX, i64::MIN), |(x, y), (&a, &b)| {
                    (x.min(a), y.max(b))
                });
            let ok = lo > hi || (hi as i128 - lo as i128) < u32::MAX as i128;
            narrow.push((lo, hi, ok));
            if ok {
                for j in j0..j1 {
                    (l32[j], w32[j]) = if l[j] <= r[j] {
                        // Both lie in [lo, lo + u32::MAX).
                        ((l[j] - lo) as u32, (r[j] - l[j]) as u32)
                    } else {
                        (u32::MAX, 0)
                    };
                }
            }
        }
        let (off, list) = reached(g, q, &q_sum, &l, &r);
        let q_reach = (0..g.nq)
            .map(|qt| {
                let row = &list[off[qt] as usize..off[qt + 1] as usize];
                Some((*row.first()? as usize, *row.last()? as usize))
            })
            .collect();
        Some(IntervalLeaf {
            q,
            l,
            r,
            q_sum,
            kv_full,
            narrow,
            l32,
            w32,
            off,
            list,
            q_reach,
            scratch: Default::default(),
        })
    }

    /// The kv tiles q-tile `qt` reaches (sorted).
    pub(super) fn candidates(&self, qt: usize) -> &[u32] {
        &self.list[self.off[qt] as usize..self.off[qt + 1] as usize]
    }

    /// Stage 1 of tile (`qt`, `kt`): Empty off the list, Full when every interval of the kv
    /// tile holds the q tile's whole range.
    pub(super) fn state(&self, qt: usize, kt: usize) -> TileState {
        if self.candidates(qt).binary_search(&(kt as u32)).is_err() {
            return TileState::Empty;
        }
        let (qa, qb) = self.q_sum[qt];
        let (all, maxl, minr) = self.kv_full[kt];
        if all && maxl <= qa && qb <= minr {
            TileState::Full
        } else {
            TileState::Partial
        }
    }

    /// Stage 2: writes the tile's allowed pairs into a zeroed `out`.
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let (i0, i1) = g.qr(qt);
        let (j0, j1) = g.kr(kt);
        let (c0, c1) = (j0 as usize, j1 as usize + 1);
        let wpr = g.wpr;
        let rows = &self.q[i0 as usize..=i1 as usize];
        let (base, top, narrowed) = self.narrow[kt];
        if !narrowed {
            let (ls, rs) = (&self.l[c0..c1], &self.r[c0..c1]);
            for (i, &f) in rows.iter().enumerate() {
                let row = &mut out[i * wpr..(i + 1) * wpr];
                for (c, (&a, &b)) in ls.iter().zip(rs).enumerate() {
                    row[c / 64] |= ((a <= f && f <= b) as u64) << (c % 64);
                }
            }
            return;
        }
        let mut todo = self.scratch.borrow_mut();
        todo.clear();
        for (i, &f) in rows.iter().enumerate() {
            // Values outside the span of the tile's intervals allow nothing; inside it,
            // f - base fits u32.
            if base <= f && f <= top {
                todo.push((i as u32, (f - base) as u32));
            }
        }
        simd::tile_in_intervals32(
            g.level,
            &self.l32[c0..c1],
            &self.w32[c0..c1],
            &todo,
            wpr,
            out,
        );
    }
}

/// Per q tile, the sorted kv tiles holding a key whose interval contains one of its values:
/// CSR offsets and tiles. Per kv tile its intervals are merged into disjoint segments; the
/// values a segment holds are a run of the values sorted once: a short run marks its rows'
/// tiles one by one, a long one tests each q tile by its range, then (only where the range
/// straddles an end) by binary search in its sorted values. A segment so costs the smaller of
/// its matches and `nq`, and the nested intervals of a long prompt chain merge into one.
fn reached(
    g: &Geom,
    q: &[i64],
    q_sum: &[(i64, i64)],
    l: &[i64],
    r: &[i64],
) -> (Vec<u32>, Vec<u32>) {
    let mut by_value: Vec<(i64, u32)> = q
        .iter()
        .enumerate()
        .map(|(i, &v)| (v, (i / g.tq) as u32))
        .collect();
    by_value.sort_unstable();
    let mut tile_sorted: Vec<i64> = q.to_vec();
    for c in tile_sorted.chunks_mut(g.tq) {
        c.sort_unstable();
    }
    let mut marked = vec![0u64; (g.nq * g.nk).div_ceil(64)];
    let mut mark = |qt: usize, kt: usize| {
        let at = qt * g.nk + kt;
        marked[at / 64] |= 1 << (at % 64);
    };
    let long = 2 * g.nq;
    let mut segs: Vec<(i64, i64)> = Vec::with_capacity(g.tk);
    for kt in 0..g.nk {
        let (j0, j1) = (kt * g.tk, ((kt + 1) * g.tk).min(g.lkv));
        segs.clear();
        segs.extend(
            l[j0..j1]
                .iter()
                .zip(&r[j0..j1])
                .filter(|(a, b)| a <= b)
                .map(|(&a, &b)| (a, b)),
        );
        segs.sort_unstable();
        let mut merged: Vec<(i64, i64)> = Vec::with_capacity(segs.len());
        for &(a, b) in segs.iter() {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (a, b) in merged {
            let s = by_value.partition_point(|&(v, _)| v < a);
            let e = s + by_value[s..].partition_point(|&(v, _)| v <= b);
            if e - s <= long {
                by_value[s..e]
                    .iter()
                    .for_each(|&(_, qt)| mark(qt as usize, kt));
                continue;
            }
            for (qt, &(qa, qb)) in q_sum.iter().enumerate() {
                if qb < a || qa > b {
                    continue;
                }
                let hit = (a <= qa && qb <= b) || {
                    let c = &tile_sorted[qt * g.tq..((qt + 1) * g.tq).min(g.lq)];
                    let x = c.partition_point(|&v| v < a);
                    x < c.len() && c[x] <= b
                };
                if hit {
                    mark(qt, kt);
                }
            }
        }
    }
    let mut off = Vec::with_capacity(g.nq + 1);
    let mut list = Vec::new();
    for qt in 0..g.nq {
        off.push(list.len() as u32);
        let base = qt * g.nk;
        for kt in 0..g.nk {
            let at = base + kt;
            if marked[at / 64] >> (at % 64) & 1 == 1 {
                list.push(kt as u32);
            }
        }
    }
    off.push(list.len() as u32);
    (off, list)
}
