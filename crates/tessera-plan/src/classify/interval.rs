//! Bands that share their query feature, fused: `lo_k <= f[i] - g_k[j] <= hi_k` for every k is
//! `L[j] <= f[i] <= R[j]` with one interval per key (`L = max(g_k + lo_k)`, `R = min(g_k +
//! hi_k)`). A tree-causal mask (`pre[j] <= pre[i] < end[j]`) is such a pair, and so is every
//! band intersected with another over the same query feature.
//!
//! Contract: the leaf allows exactly the pairs all its bands allow. The query rows are ranked
//! once by value ([`Ranked`]: a counting sort where the values span a few times the row count,
//! else a sort), so each key's interval is a *run* of consecutive ranks: the rows it allows.
//! Stage 1 lists, per q tile, the kv tiles some run reaches (tiles no interval reaches are never
//! visited, however the features scatter): a column whose runs are short in all is walked once,
//! counting its pairs per q tile; a longer one has its runs merged and each merged run tested
//! against the q tiles. Full is proved from per-tile interval bounds. Stage 2 takes, per
//! kv-tile column, the cheaper of two exact paths: walking the runs of the column's keys again
//! (work proportional to the pairs they allow: the sparse tiles of a tree), recorded per partial
//! tile as bit positions (a plan without masks keeps the first walk's counts instead); or
//! comparing each row's value against the tile's intervals in SIMD
//! ([`super::simd::tile_in_intervals32`]) as u32 offsets where the tile's span fits, else one
//! key at a time. Everything is exact in i64: an interval end past i64 stands for no bound or
//! for an empty interval (never a wrapped value), so features near the ends of i64 do not wrap.

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
    /// Per kv tile: max l / min r over the tile (its intervals' common part), for Full.
    kv_full: Vec<(i64, i64)>,
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
    /// The same tiles as a bitmap over `qt * nk + kt` (stage 1's O(1) test).
    reached: Vec<u64>,
    nk: usize,
    /// Per entry of `list` that is a partial tile of a column refined by run walks, its
    /// allowed pairs and its place in `by_col`, `walked[entry]` (`(0, NOT_WALKED)` for every
    /// other entry).
    walked: Vec<(u32, u32)>,
    /// The walked partial tiles column by column, q tiles ascending: (qt, pairs) of column
    /// `kt` at `by_col[col_off[kt]..col_off[kt + 1]]`.
    by_col: Vec<(u32, u32)>,
    col_off: Vec<u32>,
    /// Per key its run of ranks, and the rows by rank: what a walked column's bit positions
    /// are listed from, per column on first need ([`IntervalLeaf::listed`]): a plan that keeps
    /// few masks, or none, never walks most columns twice.
    runs: Vec<(u32, u32)>,
    order: Vec<u32>,
    positions: Vec<std::cell::OnceCell<Positions>>,
    pub(super) q_reach: Vec<Option<(usize, usize)>>,
    /// Stage 2's rows to compare: (row, value - base).
    scratch: std::cell::RefCell<Vec<(u32, u32)>>,
}

/// The allowed pairs of a walked column's partial tiles as bit positions in their tile (`row *
/// 64 * wpr + column`): those of its `k`-th partial tile (in `by_col` order) at
/// `pos[start[k]..start[k + 1]]`.
struct Positions {
    start: Vec<u32>,
    pos: Vec<u32>,
}

/// The place in `by_col` of a list entry that is not a walked partial tile.
const NOT_WALKED: u32 = u32::MAX;

/// Tile grids up to which the list of reached tiles is built (a bitmap of nq x nk bits: 32 MiB).
const MAX_GRID: usize = 1 << 28;

/// How many 16-key SIMD compares one step of a run walk is counted as (a step is a dependent
/// load, a lookup and a store; a compare one vector op of a row's loop). On Zen 4 the 4K tree
/// planned as fast with 1 as with 4 (within noise); 4 keeps walks off columns whose keys' runs
/// mostly land in Full tiles (BENCHMARKS.md, 2026-11-28, commit 5ba8a91).
const RUN_STEP_COST: u64 = 4;

/// Which stage-2 path the leaf takes per kv-tile column (tests force each one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage2 {
    /// The cheaper one per column.
    Cheaper,
    /// Run walks wherever a column has partial tiles.
    #[cfg(test)]
    Runs,
    /// Row compares everywhere.
    #[cfg(test)]
    Rows,
}

impl Stage2 {
    /// Whether a column is walked, given whether walking it is the cheaper path.
    fn walks(self, cheaper: bool) -> bool {
        match self {
            Stage2::Cheaper => cheaper,
            #[cfg(test)]
            Stage2::Runs => true,
            #[cfg(test)]
            Stage2::Rows => false,
        }
    }
}

/// Bit `at` of a bitmap.
fn bit(words: &[u64], at: usize) -> bool {
    words[at / 64] >> (at % 64) & 1 == 1
}

/// Sets bit `at` of a bitmap.
fn set_bit(words: &mut [u64], at: usize) {
    words[at / 64] |= 1 << (at % 64);
}

/// The query values ranked: `order` lists the rows by value (ties by row), and [`Ranked::lt`]
/// counts the values below a bound.
struct Ranked {
    order: Vec<u32>,
    min: i64,
    max: i64,
    below: Below,
}

enum Below {
    /// `counts[x]` = how many values are below `min + x`, for x in `0..=max - min + 1`.
    Dense(Vec<u32>),
    /// The values, sorted.
    Sorted(Vec<i64>),
}

impl Ranked {
    /// Counting sort when the values span at most a few times their number, else a sort.
    fn new(q: &[i64]) -> Ranked {
        let (min, max) = q
            .iter()
            .fold((i64::MAX, i64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let span = max as i128 - min as i128;
        if q.is_empty() {
            return Ranked {
                order: Vec::new(),
                min,
                max,
                below: Below::Sorted(Vec::new()),
            };
        }
        if span <= 4 * q.len() as i128 + 64 {
            let span = span as usize;
            let mut counts = vec![0u32; span + 2];
            for &v in q {
                counts[v.wrapping_sub(min) as u64 as usize + 1] += 1;
            }
            for x in 1..counts.len() {
                counts[x] += counts[x - 1];
            }
            let mut next = counts[..span + 1].to_vec();
            let mut order = vec![0u32; q.len()];
            for (i, &v) in q.iter().enumerate() {
                let b = v.wrapping_sub(min) as u64 as usize;
                order[next[b] as usize] = i as u32;
                next[b] += 1;
            }
            return Ranked {
                order,
                min,
                max,
                below: Below::Dense(counts),
            };
        }
        let (order, values): (Vec<u32>, Vec<i64>) = if span < 1 << 32 {
            // One u64 per row (offset above min, then row): a single-word sort.
            let mut keys: Vec<u64> = q
                .iter()
                .enumerate()
                .map(|(i, &v)| (v.wrapping_sub(min) as u64) << 32 | i as u64)
                .collect();
            keys.sort_unstable();
            keys.iter()
                .map(|&k| (k as u32, min.wrapping_add((k >> 32) as i64)))
                .unzip()
        } else {
            let mut pairs: Vec<(i64, u32)> =
                q.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
            pairs.sort_unstable();
            pairs.iter().map(|&(v, i)| (i, v)).unzip()
        };
        Ranked {
            order,
            min,
            max,
            below: Below::Sorted(values),
        }
    }

    /// Per key, the ranks of the values in its interval `[l, r]` ((0, 0) when empty).
    fn runs(&self, l: &[i64], r: &[i64]) -> Vec<(u32, u32)> {
        match &self.below {
            // min < x <= max, so x - min is within the span.
            Below::Dense(c) => self.runs_by(l, r, |x| c[x.wrapping_sub(self.min) as u64 as usize]),
            Below::Sorted(v) => self.runs_by(l, r, |x| v.partition_point(|&y| y < x) as u32),
        }
    }

    /// [`Ranked::runs`] given how many values are below each `x` in `(min, max]`.
    fn runs_by(&self, l: &[i64], r: &[i64], within: impl Fn(i64) -> u32) -> Vec<(u32, u32)> {
        let (min, max, n) = (self.min, self.max, self.order.len() as u32);
        let lt = |x: i64| {
            if x <= min {
                0
            } else if x > max {
                n
            } else {
                within(x)
            }
        };
        l.iter()
            .zip(r)
            .map(|(&a, &b)| {
                if a > b {
                    return (0, 0);
                }
                let end = if b == i64::MAX { n } else { lt(b + 1) };
                (lt(a), end)
            })
            .collect()
    }
}

impl<'a> IntervalLeaf<'a> {
    /// The leaf of bands `(g_k, lo_k, hi_k)` over the query feature `q` (`bands` non-empty, every
    /// `g_k` as long as the kv side). `None` when the tile grid is too large for its lists.
    pub(super) fn new(g: &Geom, q: &'a [i64], bands: &[(&[i64], i64, i64)]) -> Option<Self> {
        Self::with_stage2(g, q, bands, Stage2::Cheaper)
    }

    pub(super) fn with_stage2(
        g: &Geom,
        q: &'a [i64],
        bands: &[(&[i64], i64, i64)],
        how: Stage2,
    ) -> Option<Self> {
        if g.nq.checked_mul(g.nk)? > MAX_GRID {
            return None;
        }
        debug_assert!(g.tq.is_power_of_two(), "q tiles are a power of two");
        let (l, r) = intervals(g.level, g.lkv, bands);
        let q_sum: Vec<(i64, i64)> = q.chunks(g.tq).map(min_max).collect();
        let (mut kv_full, mut narrow) = (Vec::with_capacity(g.nk), Vec::with_capacity(g.nk));
        let (mut l32, mut w32) = (vec![0u32; g.lkv], vec![0u32; g.lkv]);
        for kt in 0..g.nk {
            let (j0, j1) = (kt * g.tk, ((kt + 1) * g.tk).min(g.lkv));
            // An empty interval is (MAX, MIN): it makes max l MAX and min r MIN (never Full)
            // and leaves the span of the others alone.
            let (ls, rs) = (&l[j0..j1], &r[j0..j1]);
            let (lo, maxl) = min_max(ls);
            let (minr, hi) = min_max(rs);
            kv_full.push((maxl, minr));
            let ok = lo > hi || (hi as i128 - lo as i128) < u32::MAX as i128;
            narrow.push((lo, hi, ok));
            if ok {
                let (ds, ws) = (&mut l32[j0..j1], &mut w32[j0..j1]);
                simd::vectorized(
                    g.level,
                    #[inline(always)]
                    move || {
                        for (((&a, &b), d), w) in ls.iter().zip(rs).zip(ds).zip(ws) {
                            // Non-empty intervals lie in [lo, lo + u32::MAX).
                            let empty = a > b;
                            *d = if empty {
                                u32::MAX
                            } else {
                                a.wrapping_sub(lo) as u32
                            };
                            *w = if empty { 0 } else { b.wrapping_sub(a) as u32 };
                        }
                    },
                );
            }
        }
        let ranked = Ranked::new(q);
        let runs = ranked.runs(&l, &r);
        let positions = (0..g.nk).map(|_| Default::default()).collect();
        let mut leaf = IntervalLeaf {
            q,
            l,
            r,
            q_sum,
            kv_full,
            narrow,
            l32,
            w32,
            off: Vec::new(),
            list: Vec::new(),
            reached: Vec::new(),
            nk: g.nk,
            walked: Vec::new(),
            by_col: Vec::new(),
            col_off: Vec::new(),
            runs: Vec::new(),
            order: Vec::new(),
            positions,
            q_reach: Vec::new(),
            scratch: Default::default(),
        };
        let walk = Walk::new(g, &ranked.order);
        leaf.stage1(g, &walk, &runs, how);
        leaf.runs = runs;
        leaf.order = ranked.order;
        Some(leaf)
    }

    /// The kv tiles q-tile `qt` reaches (sorted).
    pub(super) fn candidates(&self, qt: usize) -> &[u32] {
        &self.list[self.off[qt] as usize..self.off[qt + 1] as usize]
    }

    /// Full when every interval of kv tile `kt` holds the whole value range of q tile `qt`.
    fn full(&self, qt: usize, kt: usize) -> bool {
        let (qa, qb) = self.q_sum[qt];
        let (maxl, minr) = self.kv_full[kt];
        maxl <= qa && qb <= minr
    }

    /// Stage 1 of tile (`qt`, `kt`): Empty off the list, Full when every interval of the kv
    /// tile holds the q tile's whole range.
    #[inline]
    pub(super) fn state(&self, qt: usize, kt: usize) -> TileState {
        if !bit(&self.reached, qt * self.nk + kt) {
            return TileState::Empty;
        }
        if self.full(qt, kt) {
            TileState::Full
        } else {
            TileState::Partial
        }
    }

    /// The reached tiles (the bitmap, then per q tile the sorted list) and which columns stage 2
    /// walks. A column whose keys allow few pairs (walking them all costs less than comparing
    /// every row of every tile of the column) is walked once to count its pairs per q tile,
    /// which marks the tiles it reaches; where its partial tiles then cost fewer walk steps
    /// than row compares (or always, forced; or always in a plan without masks, which needs
    /// the counts alone) it is refined by runs: the counts kept, the bit positions listed on
    /// first need. Any other column marks its tiles from its merged runs ([`mark_merged`]) and
    /// is compared by rows in stage 2.
    fn stage1(&mut self, g: &Geom, walk: &Walk, runs: &[(u32, u32)], how: Stage2) {
        let mut marked = vec![0u64; (g.nq * g.nk).div_ceil(64)];
        let compare_cost = (g.tq * g.tk.div_ceil(16)) as u64;
        let mut count = vec![0u32; g.nq];
        let mut partial: Vec<u32> = Vec::with_capacity(g.nq);
        // (qt, pairs) of every walked partial tile, in column order.
        let (mut by_col, mut col_off) = (Vec::new(), Vec::with_capacity(g.nk + 1));
        let mut segs: Vec<u64> = Vec::with_capacity(g.tk);
        for kt in 0..g.nk {
            col_off.push(by_col.len() as u32);
            let (j0, j1) = (kt * g.tk, ((kt + 1) * g.tk).min(g.lkv));
            let col = &runs[j0..j1];
            let steps: u64 = col.iter().map(|&(s, e)| (e - s) as u64).sum();
            let walkable = how.walks(steps * RUN_STEP_COST < g.nq as u64 * compare_cost);
            if !walkable {
                mark_merged(g, walk, col, kt, &mut segs, &mut marked);
                continue;
            }
            walk.count(col, &mut count);
            partial.clear();
            // The reached q tiles, 16 counts at a time: a mask of the non-zero ones (built
            // without branches), then its set bits.
            for (c, chunk) in count.chunks(16).enumerate() {
                let mut hit = chunk
                    .iter()
                    .enumerate()
                    .fold(0u32, |m, (k, &n)| m | ((n != 0) as u32) << k);
                while hit != 0 {
                    let qt = c * 16 + hit.trailing_zeros() as usize;
                    hit &= hit - 1;
                    set_bit(&mut marked, qt * g.nk + kt);
                    if !self.full(qt, kt) {
                        partial.push(qt as u32);
                    }
                }
            }
            let take = how.walks(steps * RUN_STEP_COST < partial.len() as u64 * compare_cost);
            if take || !g.masks {
                by_col.extend(partial.iter().map(|&qt| (qt, count[qt as usize])));
            }
            count.fill(0);
        }
        col_off.push(by_col.len() as u32);
        // Per q tile, its reached kv tiles from the bitmap, a word at a time.
        let mut off = Vec::with_capacity(g.nq + 1);
        let mut list = Vec::new();
        for qt in 0..g.nq {
            off.push(list.len() as u32);
            let (start, end) = (qt * g.nk, (qt + 1) * g.nk);
            let mut at = start;
            while at < end {
                let (w, b) = (at / 64, at % 64);
                let take = (64 - b).min(end - at);
                let mut bits = marked[w] >> b;
                if take < 64 {
                    bits &= (1u64 << take) - 1;
                }
                while bits != 0 {
                    list.push((at - start) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                }
                at += take;
            }
        }
        off.push(list.len() as u32);
        // `by_col` is in column order, so each row's entries come with ascending kv tiles, as
        // in the row: one cursor per row finds them all in a pass.
        self.walked = vec![(0, NOT_WALKED); list.len()];
        let mut cursor: Vec<u32> = off[..g.nq].to_vec();
        for kt in 0..g.nk {
            let (a, b) = (col_off[kt] as usize, col_off[kt + 1] as usize);
            for (k, &(qt, n)) in by_col[a..b].iter().enumerate() {
                let (c, end) = (&mut cursor[qt as usize], off[qt as usize + 1]);
                while *c < end && list[*c as usize] < kt as u32 {
                    *c += 1;
                }
                if *c < end && list[*c as usize] == kt as u32 {
                    self.walked[*c as usize] = (n, k as u32);
                }
            }
        }
        self.by_col = by_col;
        self.col_off = col_off;
        self.q_reach = (0..g.nq)
            .map(|qt| {
                let row = &list[off[qt] as usize..off[qt + 1] as usize];
                Some((*row.first()? as usize, *row.last()? as usize))
            })
            .collect();
        self.reached = marked;
        self.off = off;
        self.list = list;
    }

    /// The allowed pairs of tile (`qt`, `kt`) when it is a partial tile of a walked column.
    /// `at`: its place among the row's [`candidates`](Self::candidates) if known (checked),
    /// else searched.
    fn walked(&self, qt: usize, kt: usize, at: Option<usize>) -> Option<(u32, u32)> {
        let row = self.candidates(qt);
        let at = match at {
            Some(a) if row.get(a) == Some(&(kt as u32)) => a,
            _ => row.binary_search(&(kt as u32)).ok()?,
        };
        let e = self.walked[self.off[qt] as usize + at];
        (e.1 != NOT_WALKED).then_some(e)
    }

    /// The allowed pairs of tile (`qt`, `kt`) as bit positions (`row * 64 * wpr + column`, each
    /// once) when stage 1 listed them (a partial tile of a walked column, in a plan with masks).
    pub(super) fn listed(&self, g: &Geom, qt: usize, kt: usize) -> Option<&[u32]> {
        let (_, k) = self.walked(qt, kt, None).filter(|_| g.masks)?;
        let p = self.positions[kt].get_or_init(|| self.column_positions(g, kt));
        let k = k as usize;
        Some(&p.pos[p.start[k] as usize..p.start[k + 1] as usize])
    }

    /// The bit positions of walked column `kt`'s partial tiles: its runs walked again, each
    /// pair placed by the counts stage 1 kept.
    fn column_positions(&self, g: &Geom, kt: usize) -> Positions {
        let walk = Walk::new(g, &self.order);
        let (j0, j1) = (kt * g.tk, ((kt + 1) * g.tk).min(g.lkv));
        let col = &self.runs[j0..j1];
        let tiles = &self.by_col[self.col_off[kt] as usize..self.col_off[kt + 1] as usize];
        // Per q tile, where its next pair goes (u32::MAX: not a partial tile).
        let mut slot = vec![u32::MAX; g.nq];
        let mut start = Vec::with_capacity(tiles.len() + 1);
        let mut at = 0u32;
        for &(qt, n) in tiles {
            start.push(at);
            slot[qt as usize] = at;
            at += n;
        }
        start.push(at);
        let mut pos = vec![0u32; at as usize];
        let row_bits = 64 * g.wpr as u32;
        for (c, &(s, e)) in col.iter().enumerate() {
            for &i in &walk.order[s as usize..e as usize] {
                let p = &mut slot[(i >> walk.shift) as usize];
                if *p != u32::MAX {
                    pos[*p as usize] = (i & walk.mask) * row_bits + c as u32;
                    *p += 1;
                }
            }
        }
        Positions { start, pos }
    }

    /// How many pairs of tile (`qt`, `kt`) are allowed when stage 1 counted them (a partial tile
    /// of a walked column; `at` as in [`IntervalLeaf::walked`]).
    pub(super) fn pairs(&self, qt: usize, kt: usize, at: Option<usize>) -> Option<u64> {
        self.walked(qt, kt, at).map(|(n, _)| u64::from(n))
    }

    /// Stage 2: writes the tile's allowed pairs into a zeroed `out`.
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        // A partial tile of a walked column has its pairs listed; any other tile (Full, or off
        // the list) is compared below.
        if let Some(pos) = self.listed(g, qt, kt) {
            for &p in pos {
                out[p as usize / 64] |= 1 << (p % 64);
            }
            return;
        }
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

/// (min, max) of `v` ((MAX, MIN) when empty).
fn min_max(v: &[i64]) -> (i64, i64) {
    v.iter()
        .fold((i64::MAX, i64::MIN), |(a, b), &x| (a.min(x), b.max(x)))
}

/// Per key, the fused interval `[max(g_k + lo_k), min(g_k + hi_k)]` clamped to i64, `(i64::MAX,
/// i64::MIN)` when empty. Exact in i64: a lower end below i64::MIN bounds nothing (MIN), an
/// upper end above i64::MAX neither (MAX), and a lower end above MAX or an upper end below MIN
/// empties the interval (clamping its nearer end would make it hold MAX or MIN).
fn intervals(level: simd::Level, lkv: usize, bands: &[(&[i64], i64, i64)]) -> (Vec<i64>, Vec<i64>) {
    let (mut l, mut r) = (vec![i64::MIN; lkv], vec![i64::MAX; lkv]);
    for &(feat, lo, hi) in bands {
        // `v + lo` is exact for v in [la, lb] and clamps to the end it would pass: past MIN it
        // bounds nothing, past MAX (lo > 0, v > lb) the band is empty; likewise `v + hi`.
        let (la, lb) = (i64::MIN - lo.min(0), i64::MAX - lo.max(0));
        let (ha, hb) = (i64::MIN - hi.min(0), i64::MAX - hi.max(0));
        let (l, r) = (&mut l[..], &mut r[..]);
        simd::vectorized(
            level,
            #[inline(always)]
            move || {
                for ((a, b), &v) in l.iter_mut().zip(r.iter_mut()).zip(feat) {
                    let empty = (lo > 0 && v > lb) | (hi < 0 && v < ha);
                    let x = v.max(la).min(lb).wrapping_add(lo);
                    let y = v.max(ha).min(hb).wrapping_add(hi);
                    *a = (*a).max(if empty { i64::MAX } else { x });
                    *b = (*b).min(if empty { i64::MIN } else { y });
                }
            },
        );
    }
    simd::vectorized(
        level,
        #[inline(always)]
        || {
            for (a, b) in l.iter_mut().zip(r.iter_mut()) {
                let empty = *a > *b;
                *a = if empty { i64::MAX } else { *a };
                *b = if empty { i64::MIN } else { *b };
            }
        },
    );
    (l, r)
}

/// The ranked rows as a run walk reads them: per rank the row (`order`), whose q tile is
/// `row >> shift` and place in it `row & mask`; for the merged-run marking, per q tile the
/// ranks of its rows (ascending) and their least and greatest, built on first use.
struct Walk<'r> {
    order: &'r [u32],
    shift: u32,
    mask: u32,
    tq: usize,
    ranks: std::cell::OnceCell<TileRanks>,
}

/// Per q tile `qt`, the ranks of its rows ascending (at `ranks[qt * tq..]`) and the least and
/// greatest of them.
struct TileRanks {
    ranks: Vec<u32>,
    span: Vec<(u32, u32)>,
}

impl<'r> Walk<'r> {
    fn new(g: &Geom, order: &'r [u32]) -> Walk<'r> {
        Walk {
            order,
            shift: g.tq.trailing_zeros(),
            mask: g.tq as u32 - 1,
            tq: g.tq,
            ranks: std::cell::OnceCell::new(),
        }
    }

    /// Adds to `count[qt]` the rows of q tile `qt` in the runs `col`.
    fn count(&self, col: &[(u32, u32)], count: &mut [u32]) {
        for &(s, e) in col {
            for &i in &self.order[s as usize..e as usize] {
                count[(i >> self.shift) as usize] += 1;
            }
        }
    }

    /// Per q tile, its rows' ranks ascending and their least and greatest.
    fn tile_ranks(&self) -> &TileRanks {
        self.ranks.get_or_init(|| {
            let n = self.order.len();
            let nq = n.div_ceil(self.tq);
            let mut ranks = vec![0u32; n];
            let mut fill: Vec<u32> = (0..nq).map(|qt| (qt * self.tq) as u32).collect();
            for (k, &i) in self.order.iter().enumerate() {
                let f = &mut fill[(i >> self.shift) as usize];
                ranks[*f as usize] = k as u32;
                *f += 1;
            }
            let span = (0..nq)
                .map(|qt| {
                    let s = &ranks[qt * self.tq..((qt + 1) * self.tq).min(n)];
                    (s[0], s[s.len() - 1])
                })
                .collect();
            TileRanks { ranks, span }
        })
    }
}

/// Marks in `marked` (over `qt * nk + kt`) the q tiles holding a row of one of the runs `col`
/// of kv tile `kt`. The runs are merged into disjoint segments; a short segment marks its rows'
/// tiles one by one, a long one tests each q tile by its least and greatest rank, then (only
/// where they straddle an end) by binary search in its ranks. A segment so costs the smaller
/// of its length and `nq`, and the nested intervals of a long prompt chain merge into one.
fn mark_merged(
    g: &Geom,
    walk: &Walk,
    col: &[(u32, u32)],
    kt: usize,
    segs: &mut Vec<u64>,
    marked: &mut [u64],
) {
    let mut mark = |qt: usize| set_bit(marked, qt * g.nk + kt);
    let long = 2 * g.nq;
    segs.clear();
    segs.extend(
        col.iter()
            .filter(|(s, e)| s < e)
            .map(|&(s, e)| (s as u64) << 32 | e as u64),
    );
    segs.sort_unstable();
    let mut cover = |(s, e): (usize, usize)| {
        if e - s <= long {
            for &i in &walk.order[s..e] {
                mark((i >> walk.shift) as usize);
            }
            return;
        }
        let TileRanks { ranks, span } = walk.tile_ranks();
        for (qt, &(a, b)) in span.iter().enumerate() {
            let (a, b) = (a as usize, b as usize);
            if b < s || a >= e {
                continue;
            }
            let hit = (s <= a && b < e) || {
                let c = &ranks[qt * g.tq..((qt + 1) * g.tq).min(g.lq)];
                let x = c.partition_point(|&k| (k as usize) < s);
                x < c.len() && (c[x] as usize) < e
            };
            if hit {
                mark(qt);
            }
        }
    };
    let mut merged: Option<(usize, usize)> = None;
    for &k in segs.iter() {
        let (s, e) = ((k >> 32) as usize, k as u32 as usize);
        merged = match merged {
            Some((a, b)) if s <= b => Some((a, b.max(e))),
            Some(m) => {
                cover(m);
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    if let Some(m) = merged {
        cover(m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The leaf's bitmask of every tile, both stage-2 paths, equals brute force, and so do its
    /// states' claims (Empty: no pair; Full: every pair).
    fn check(
        lq: usize,
        lkv: usize,
        tq: usize,
        tk: usize,
        q: &[i64],
        bands: &[(Vec<i64>, i64, i64)],
    ) {
        let g = Geom {
            masks: true,
            level: simd::Level::detect(),
            lq,
            lkv,
            tq,
            tk,
            nq: lq.div_ceil(tq),
            nk: lkv.div_ceil(tk),
            wpr: tk.div_ceil(64),
        };
        // Without masks: the same states, every tile still written exactly (by row compares),
        // and the counts of the walked tiles are their pairs.
        let counted = Geom { masks: false, ..g };
        let parts: Vec<(&[i64], i64, i64)> =
            bands.iter().map(|(f, lo, hi)| (&f[..], *lo, *hi)).collect();
        let allowed = |i: usize, j: usize| {
            bands.iter().all(|(f, lo, hi)| {
                let d = q[i] as i128 - f[j] as i128;
                *lo as i128 <= d && d <= *hi as i128
            })
        };
        for (g, how) in [
            (g, Stage2::Cheaper),
            (g, Stage2::Runs),
            (g, Stage2::Rows),
            (counted, Stage2::Cheaper),
        ] {
            let leaf = IntervalLeaf::with_stage2(&g, q, &parts, how).unwrap();
            for qt in 0..g.nq {
                for kt in 0..g.nk {
                    let mut out = vec![0u64; tq * g.wpr];
                    leaf.write(&g, qt, kt, &mut out);
                    let state = leaf.state(qt, kt);
                    let ones: u64 = out.iter().map(|w| w.count_ones() as u64).sum();
                    // A known place in the row reads the same count; a wrong one is searched.
                    let at = leaf.candidates(qt).iter().position(|&k| k as usize == kt);
                    assert_eq!(leaf.pairs(qt, kt, at), leaf.pairs(qt, kt, None));
                    assert_eq!(leaf.pairs(qt, kt, Some(0)), leaf.pairs(qt, kt, None));
                    if let Some(n) = leaf.pairs(qt, kt, None) {
                        assert_eq!(n, ones, "{how:?} tile ({qt}, {kt}): counted pairs");
                        assert_eq!(state, TileState::Partial);
                    }
                    let (mut any, mut all) = (false, true);
                    for r in 0..tq {
                        for c in 0..g.wpr * 64 {
                            let (i, j) = (qt * tq + r, kt * tk + c);
                            let want = c < tk && i < lq && j < lkv && allowed(i, j);
                            let got = out[r * g.wpr + c / 64] >> (c % 64) & 1 == 1;
                            assert_eq!(got, want, "{how:?} tile ({qt}, {kt}) row {r} col {c}");
                            if i < lq && j < lkv && c < tk {
                                any |= want;
                                all &= want;
                            }
                        }
                    }
                    match state {
                        TileState::Empty => assert!(!any, "{how:?} ({qt}, {kt}) not empty"),
                        TileState::Full => assert!(all, "{how:?} ({qt}, {kt}) not full"),
                        TileState::Partial => {}
                    }
                }
            }
        }
    }

    fn feature(kind: u8, vals: Vec<i64>) -> Vec<i64> {
        match kind {
            0 => vals.iter().map(|v| v.rem_euclid(50)).collect(),
            1 => vals
                .iter()
                .map(|v| v.wrapping_mul(0x9E37_79B9_7F4A_7C15u64 as i64))
                .collect(),
            2 => vals.iter().map(|v| i64::MAX - v.rem_euclid(8)).collect(),
            3 => vals.iter().map(|v| i64::MIN + v.rem_euclid(8)).collect(),
            _ => vals.iter().map(|v| v.rem_euclid(3000) - 1500).collect(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
            ..ProptestConfig::default()
        })]

        /// Random fused bands (values dense, scattered, near either end of i64) at ragged
        /// tiles: both stage-2 paths and the automatic choice equal brute force.
        #[test]
        fn both_paths_equal_brute_force(
            lq in 1usize..150,
            lkv in 1usize..150,
            (tq, tk) in prop_oneof![Just((16usize, 16usize)), Just((32, 64)), Just((8, 128))],
            kinds in proptest::collection::vec(0u8..5, 3),
            seed in proptest::collection::vec(any::<i64>(), 300),
            bounds in proptest::collection::vec(
                prop_oneof![(-60i64..60).prop_map(|x| x), Just(i64::MIN), Just(i64::MAX)], 4),
        ) {
            let q = feature(kinds[0], seed[..lq].to_vec());
            let bands: Vec<(Vec<i64>, i64, i64)> = (0..2)
                .map(|k| {
                    let f = feature(kinds[k + 1], seed[150..150 + lkv].iter().map(|v| v.rotate_left(k as u32 * 7)).collect());
                    let (a, b) = (bounds[2 * k], bounds[2 * k + 1]);
                    (f, a.min(b), a.max(b))
                })
                .collect();
            check(lq, lkv, tq, tk, &q, &bands);
        }
    }

    /// Tree-causal over a random tree after a prompt chain: the sparse tiles the run walks are
    /// for, at lengths not a multiple of the tile.
    #[test]
    fn tree_causal_equals_brute_force() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (n, prefix) in [(200usize, 40usize), (333, 0), (257, 256)] {
            let mut parent = vec![0usize; n];
            for (i, p) in parent.iter_mut().enumerate().skip(1) {
                *p = if i <= prefix {
                    i - 1
                } else {
                    rng.gen_range(prefix.saturating_sub(1)..i)
                };
            }
            let mut size = vec![1i64; n];
            for i in (1..n).rev() {
                size[parent[i]] += size[i];
            }
            let (mut pre, mut next) = (vec![0i64; n], vec![1i64; n]);
            for i in 1..n {
                let p = parent[i];
                pre[i] = pre[p] + next[p];
                next[p] += size[i];
            }
            let end: Vec<i64> = pre.iter().zip(&size).map(|(a, b)| a + b).collect();
            let bands = vec![(pre.clone(), 0, i64::MAX), (end, i64::MIN, -1)];
            check(n, n, 32, 32, &pre, &bands);
            check(n, n, 16, 64, &pre, &bands);
        }
    }
}
