//! Stages 1 and 2 of the planner on a prepared mask tree.
//!
//! A [`Node`] is one (batch row, head) specialization of a mask with per-tile data summaries
//! precomputed. Stage 1: [`Node::reach`] bounds, per q-tile row, the kv tiles that can hold an
//! allowed pair, and [`Node::classify`] gives a sound Empty/Partial/Full verdict per tile by
//! interval arithmetic. Stage 2: [`Node::eval`] writes a tile's exact token bitmask.
//!
//! Which kv tiles of a q-tile row are visited at all is [`Node::candidates`]: the reach range,
//! or, where a `blocks` leaf bounds the row, the explicit sorted list of tiles its selection
//! touches (intersected through `&`, united through `|`), so that planning a block selection
//! costs O(selected tiles), not O(tiles in the reach hull).

use crate::plan::TileState;
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use tessera_mask::{BlockSelection, DenseMask, Mask};

/// Sizes shared by every node of one plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    pub lq: usize,
    pub lkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub nq: usize,
    pub nk: usize,
    pub wpr: usize,
}

impl Geom {
    /// Inclusive token range of q-tile `qt`.
    fn qr(&self, qt: usize) -> (i64, i64) {
        let s = qt * self.tq;
        (s as i64, ((s + self.tq).min(self.lq) - 1) as i64)
    }
    /// Inclusive token range of kv-tile `kt`.
    fn kr(&self, kt: usize) -> (i64, i64) {
        let s = kt * self.tk;
        (s as i64, ((s + self.tk).min(self.lkv) - 1) as i64)
    }
    /// Token range [lo, hi] (inclusive) to kv tiles, clipped; None when empty.
    fn kv_tiles(&self, lo: i64, hi: i64) -> Option<(usize, usize)> {
        let lo = lo.max(0);
        let hi = hi.min(self.lkv as i64 - 1);
        (lo <= hi).then(|| (lo as usize / self.tk, hi as usize / self.tk))
    }
}

/// Segment-id summary of one tile side: range of valid ids and whether padding is present.
#[derive(Clone, Copy, Debug)]
struct SegSummary {
    min: i64,
    max: i64,
    any_valid: bool,
    any_pad: bool,
}

fn summarize(ids: &[i64], tile: usize) -> Vec<SegSummary> {
    ids.chunks(tile)
        .map(|c| {
            let mut s = SegSummary {
                min: i64::MAX,
                max: i64::MIN,
                any_valid: false,
                any_pad: false,
            };
            for &v in c {
                if v < 0 {
                    s.any_pad = true;
                } else {
                    s.any_valid = true;
                    s.min = s.min.min(v);
                    s.max = s.max.max(v);
                }
            }
            s
        })
        .collect()
}

/// A `document` leaf for one batch row.
pub(crate) struct DocLeaf {
    q_sum: Vec<SegSummary>,
    kv_sum: Vec<SegSummary>,
    /// Runs of equal valid ids per tile, (start, end exclusive, id) within the tile:
    /// `q_runs[q_run_off[qt]..q_run_off[qt + 1]]`, and the same for kv tiles. Stage 2 works
    /// run by run, so a tile costs its runs, not its rows.
    q_runs: Vec<(u32, u32, i64)>,
    q_run_off: Vec<u32>,
    kv_runs: Vec<(u32, u32, i64)>,
    kv_run_off: Vec<u32>,
    /// Per q tile: the hull of kv tiles holding any of its ids.
    q_reach: Vec<Option<(usize, usize)>>,
}

/// Runs of equal valid (non-negative) ids of every `tile`-sized chunk of `ids`, and the offset
/// of each chunk's first run (one more offset at the end).
fn tile_runs(ids: &[i64], tile: usize) -> (Vec<(u32, u32, i64)>, Vec<u32>) {
    let mut runs = Vec::new();
    let mut off = Vec::with_capacity(ids.len().div_ceil(tile) + 1);
    for chunk in ids.chunks(tile) {
        off.push(runs.len() as u32);
        let mut s = 0;
        while s < chunk.len() {
            let id = chunk[s];
            let mut e = s + 1;
            while e < chunk.len() && chunk[e] == id {
                e += 1;
            }
            if id >= 0 {
                runs.push((s as u32, e as u32, id));
            }
            s = e;
        }
    }
    off.push(runs.len() as u32);
    (runs, off)
}

impl DocLeaf {
    fn new(g: &Geom, q: &[i64], kv: &[i64]) -> Self {
        let (q_runs, q_run_off) = tile_runs(q, g.tq);
        let (kv_runs, kv_run_off) = tile_runs(kv, g.tk);
        // First and last kv tile of every id: bounds the kv tiles a q tile can reach.
        let mut span: HashMap<i64, (usize, usize)> = HashMap::new();
        for kt in 0..g.nk {
            for &(_, _, id) in &kv_runs[kv_run_off[kt] as usize..kv_run_off[kt + 1] as usize] {
                span.entry(id).and_modify(|x| x.1 = kt).or_insert((kt, kt));
            }
        }
        let q_reach = (0..g.nq)
            .map(|qt| {
                let runs = &q_runs[q_run_off[qt] as usize..q_run_off[qt + 1] as usize];
                runs.iter()
                    .filter_map(|&(_, _, id)| span.get(&id).copied())
                    .reduce(|(x, y), (a, b)| (x.min(a), y.max(b)))
            })
            .collect();
        DocLeaf {
            q_sum: summarize(q, g.tq),
            kv_sum: summarize(kv, g.tk),
            q_runs,
            q_run_off,
            kv_runs,
            kv_run_off,
            q_reach,
        }
    }
}

/// A `band` leaf for one batch row: `lo <= q[i] - kv[j] <= hi`, with the range of each feature
/// over every tile. All differences are taken in i128, so no feature value or bound wraps.
pub(crate) struct BandLeaf<'a> {
    q: &'a [i64],
    kv: &'a [i64],
    lo: i128,
    hi: i128,
    /// (min, max) of the q feature per q tile and of the kv feature per kv tile.
    q_sum: Vec<(i64, i64)>,
    kv_sum: Vec<(i64, i64)>,
    /// Per q tile: the hull of kv tiles whose range meets [qmin - hi, qmax - lo].
    q_reach: Vec<Option<(usize, usize)>>,
    /// Tiles whose features are equal up to a shift (every q tile of a canvas row, every kv
    /// tile of a frame) have the same bitmask at the same offset between them: stage 2 computes
    /// it once per (q shape, kv shape, offset) and copies it afterwards. The kv shapes also
    /// say where a kv tile's runs of non-decreasing features start (positions and sorted ids
    /// are one run; a frame boundary or a canvas row inside the tile adds one), up to
    /// `BAND_RUNS`: a row's allowed keys in a run are found by binary search. Empty: more runs
    /// (shuffled, tile-ordered, residue features); each key is compared.
    q_shape: TileShapes,
    kv_shape: TileShapes,
    memo: std::cell::RefCell<TileMemo>,
}

/// The tiles of one feature numbered by shape: `id[t]` is equal for two tiles exactly when
/// their lengths and their values minus their first value (`first[t]`) are equal. What depends
/// only on the shape (the range of the values, where their non-decreasing runs start) is
/// computed once per shape.
#[derive(Clone)]
struct TileShapes {
    id: Vec<u32>,
    first: Vec<i64>,
    /// Per shape: (min - first, max - first) of its values.
    span: Vec<(i128, i128)>,
    /// Per shape (when asked for): where its runs of non-decreasing values start, up to
    /// `BAND_RUNS` of them; empty when there are more.
    runs: Vec<Vec<u16>>,
}

/// Whether `a` and `b` have the same shape: equal lengths and `a[i] - a[0] == b[i] - b[0]`
/// exactly, that is `a[i] - b[i] == a[0] - b[0]` for every `i`.
fn same_shape(a: &[i64], b: &[i64]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let Some(d) = a[0].checked_sub(b[0]) else {
        let rel = |c: &[i64], i: usize| c[i] as i128 - c[0] as i128;
        return (0..a.len()).all(|i| rel(a, i) == rel(b, i));
    };
    // x - y == d exactly: the wrapped difference is d and did not overflow (x and y of
    // different signs with the difference's sign unlike x's). Branch-free, so it vectorizes.
    let bad = a.iter().zip(b).fold(0i64, |bad, (&x, &y)| {
        let r = x.wrapping_sub(y);
        bad | (r ^ d) | ((x ^ y) & (x ^ r) & i64::MIN)
    });
    bad == 0
}

impl TileShapes {
    /// Shapes of the `tile`-sized chunks of `feature`; with `runs`, their run starts too.
    fn new(feature: &[i64], tile: usize, runs: bool) -> Self {
        let chunks: Vec<&[i64]> = feature.chunks(tile).collect();
        // Shapes by hash of the shifted values; collisions are resolved by comparing them.
        let mut by_hash: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
        // The first tile of each shape.
        let mut rep: Vec<&[i64]> = Vec::new();
        let (mut span, mut starts) = (Vec::new(), Vec::new());
        // Shapes repeat along a feature (every tile of a canvas row pair, of a frame): the
        // last few distinct shapes are compared first, without hashing.
        let mut recent: Vec<u32> = Vec::with_capacity(RECENT_SHAPES);
        let id = chunks
            .iter()
            .map(|&c| {
                if let Some(&s) = recent.iter().find(|&&s| same_shape(rep[s as usize], c)) {
                    return s;
                }
                let h = hash_iter(c.len(), c.iter().map(|&v| v.wrapping_sub(c[0]) as u64));
                let ids = by_hash.entry(h).or_default();
                let s = match ids.iter().find(|&&s| same_shape(rep[s as usize], c)) {
                    Some(&s) => s,
                    None => {
                        let (lo, hi) = c
                            .iter()
                            .fold((i64::MAX, i64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                        span.push((lo as i128 - c[0] as i128, hi as i128 - c[0] as i128));
                        if runs {
                            // Columns fit u16: tiles are at most MAX_TILE (4096) wide.
                            let at: Vec<u16> = std::iter::once(0)
                                .chain((1..c.len()).filter(|&i| c[i] < c[i - 1]).map(|i| i as u16))
                                .take(BAND_RUNS + 1)
                                .collect();
                            starts.push(if at.len() > BAND_RUNS { Vec::new() } else { at });
                        }
                        rep.push(c);
                        ids.push(rep.len() as u32 - 1);
                        rep.len() as u32 - 1
                    }
                };
                if recent.len() == RECENT_SHAPES {
                    recent.pop();
                }
                recent.insert(0, s);
                s
            })
            .collect();
        let first = chunks.iter().map(|c| c[0]).collect();
        TileShapes {
            id,
            first,
            span,
            runs: starts,
        }
    }

    /// (min, max) of tile `t`'s values.
    fn range(&self, t: usize) -> (i64, i64) {
        let (lo, hi) = self.span[self.id[t] as usize];
        let f = self.first[t] as i128;
        // Both are values of the tile, so they fit an i64.
        ((f + lo) as i64, (f + hi) as i64)
    }
}

/// Distinct tile shapes compared before hashing (see [`TileShapes::new`]).
const RECENT_SHAPES: usize = 4;

/// Band tile bitmasks computed so far, by (q shape, kv shape, kv first - q first).
#[derive(Default)]
struct TileMemo {
    at: HashMap<(u32, u32, i128), usize>,
    words: Vec<u64>,
}

/// Words of bitmasks a band leaf keeps (64 MiB at most; past it tiles are computed every time).
const MEMO_WORDS: usize = 8 << 20;

impl<'a> BandLeaf<'a> {
    fn new(g: &Geom, q: &'a [i64], kv: &'a [i64], lo: i64, hi: i64) -> Self {
        let kv_shape = TileShapes::new(kv, g.tk, true);
        // One feature on both sides (dilation groups, positions): one pass.
        let q_shape = if std::ptr::eq(q, kv) && g.tq == g.tk {
            kv_shape.clone()
        } else {
            TileShapes::new(q, g.tq, false)
        };
        let q_sum: Vec<(i64, i64)> = (0..q_shape.id.len()).map(|t| q_shape.range(t)).collect();
        let kv_sum: Vec<(i64, i64)> = (0..kv_shape.id.len()).map(|t| kv_shape.range(t)).collect();
        let (lo, hi) = (lo as i128, hi as i128);
        // When the tile ranges never go down along the keys (positions, sorted ids), the tiles
        // a query tile meets are one run found by binary search; otherwise every tile is scanned.
        let monotone = kv_sum
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1);
        // A key feature v partners some query of the tile only if qmin - hi <= v <= qmax - lo.
        let q_reach = q_sum
            .iter()
            .map(|&(qa, qb)| {
                let (want_lo, want_hi) = (qa as i128 - hi, qb as i128 - lo);
                let meets = |&(ka, kb): &(i64, i64)| kb as i128 >= want_lo && ka as i128 <= want_hi;
                if monotone {
                    let first = kv_sum.partition_point(|&(_, kb)| (kb as i128) < want_lo);
                    let end = kv_sum.partition_point(|&(ka, _)| ka as i128 <= want_hi);
                    return (first < end).then(|| (first, end - 1));
                }
                let first = kv_sum.iter().position(meets)?;
                let last = kv_sum.iter().rposition(meets)?;
                Some((first, last))
            })
            .collect();
        BandLeaf {
            q,
            kv,
            lo,
            hi,
            q_sum,
            kv_sum,
            q_reach,
            q_shape,
            kv_shape,
            memo: Default::default(),
        }
    }
}

impl BandLeaf<'_> {
    /// Stage 2 of tile (`qt`, `kt`) into `out` (zeroed, `tq` rows of `wpr` words).
    fn eval(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let (i0, i1) = g.qr(qt);
        let (j0, j1) = g.kr(kt);
        let (rows, ncols, wpr) = ((i1 - i0 + 1) as usize, (j1 - j0 + 1) as usize, g.wpr);
        let set = |out: &mut [u64], r: usize, lo: i64, hi: i64| {
            set_range(&mut out[r * wpr..(r + 1) * wpr], lo, hi, ncols);
        };
        let keys = &self.kv[j0 as usize..=j1 as usize];
        let n = keys.len();
        // Row i allows the keys whose feature lies in [f - hi, f - lo]. Rows repeat few feature
        // values (tile coordinates, clamped window starts, dilation groups): a row whose value
        // is among the last ones computed is a copy. In each sorted run of the key tile the
        // keys are a range [a, b), galloped from the row before when the value grows
        // (positions), else searched; a tile of more runs builds each row word by word, one
        // compare per key.
        let runs = &self.kv_shape.runs[self.kv_shape.id[kt] as usize];
        let mut recent = [(0i64, 0usize); BAND_MEMO];
        let mut computed = 0usize;
        // The largest value computed: a larger one (growing features) is not remembered.
        let mut top = i64::MIN;
        // Per run: its allowed range [a, b) for the last row computed.
        let mut bounds = [(0usize, 0usize); BAND_RUNS];
        for r in 0..rows {
            let fv = self.q[i0 as usize + r];
            if computed > 0 && fv <= top {
                let known = recent[..computed.min(BAND_MEMO)].iter().find(|e| e.0 == fv);
                if let Some(&(_, src)) = known {
                    out.copy_within(src * wpr..(src + 1) * wpr, r * wpr);
                    continue;
                }
            }
            top = top.max(fv);
            let f = fv as i128;
            let (want_lo, want_hi) = (f - self.hi, f - self.lo);
            if !runs.is_empty() {
                let forward = computed > 0 && recent[(computed - 1) % BAND_MEMO].0 < fv;
                for (k, &start) in runs.iter().enumerate() {
                    let (s0, s1) = (start as usize, runs.get(k + 1).map_or(n, |&e| e as usize));
                    let value = |i: usize| keys[s0 + i] as i128;
                    let (a, b) = bounds[k];
                    let (x, y) = if forward {
                        let x = gallop(a, s1 - s0, |i| value(i) < want_lo);
                        (x, gallop(b.max(x), s1 - s0, |i| value(i) <= want_hi))
                    } else {
                        let x = partition(s1 - s0, |i| value(i) < want_lo);
                        (x, x.max(partition(s1 - s0, |i| value(i) <= want_hi)))
                    };
                    set(out, r, (s0 + x) as i64, (s0 + y) as i64);
                    bounds[k] = (x, y);
                }
            } else if want_lo <= i64::MAX as i128 && want_hi >= i64::MIN as i128 {
                // Clamped to i64 the bounds select the same keys; v lies in [lo, hi] iff
                // v - lo <= hi - lo as unsigned (wrapping), one compare per key.
                let lo = want_lo.max(i64::MIN as i128) as i64;
                let span = (want_hi.min(i64::MAX as i128) as i64).wrapping_sub(lo) as u64;
                let row = &mut out[r * wpr..(r + 1) * wpr];
                for (word, chunk) in row.iter_mut().zip(keys.chunks(64)) {
                    *word = chunk.iter().enumerate().fold(0u64, |w, (c, &v)| {
                        w | (((v.wrapping_sub(lo) as u64) <= span) as u64) << c
                    });
                }
            }
            recent[computed % BAND_MEMO] = (fv, r);
            computed += 1;
        }
    }
}

/// A `dense` leaf for one (batch, head) slice, with per-tile allowed counts.
pub(crate) struct DenseLeaf<'a> {
    mask: &'a DenseMask,
    slice: usize,
    counts: Vec<u32>,
    q_reach: Vec<Option<(usize, usize)>>,
}

impl<'a> DenseLeaf<'a> {
    fn new(g: &Geom, mask: &'a DenseMask, slice: usize) -> Self {
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

/// A `blocks` leaf for one (batch, head) slice of its selection.
pub(crate) struct BlocksLeaf<'a> {
    sel: &'a BlockSelection,
    slice: usize,
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
    fn candidates(&self, g: &Geom, qt: usize) -> Vec<u32> {
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
    fn reach(&self, g: &Geom, qt: usize) -> Option<(usize, usize)> {
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

/// The kv tiles of one q-tile row that planning visits: a range, or an explicit sorted list.
pub(crate) enum Candidates {
    /// Every tile in `lo..=hi`.
    Range(usize, usize),
    /// These tiles (sorted, distinct).
    List(Vec<u32>),
}

impl Candidates {
    /// How many tiles are visited.
    pub fn len(&self) -> usize {
        match self {
            Candidates::Range(lo, hi) => hi - lo + 1,
            Candidates::List(v) => v.len(),
        }
    }

    /// The tiles, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let (range, list) = match self {
            Candidates::Range(lo, hi) => (*lo..*hi + 1, &[][..]),
            Candidates::List(v) => (0..0, &v[..]),
        };
        range.chain(list.iter().map(|&t| t as usize))
    }
}

/// Sorted intersection of two sorted distinct lists.
fn intersect(a: &[u32], b: &[u32]) -> Vec<u32> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// A mask specialized to one (batch row, head), ready for planning.
/// A union's operands, with (for unions of many operands) a per-q-tile index of the operands
/// that can allow a pair in that row and the kv tiles each reaches: stage 1 and stage 2 of a tile
/// visit only those, so a union of many narrow leaves (a neighbourhood or a video head written as
/// hundreds of `document` leaves) is planned in one pass over the tiles instead of one pass per
/// operand.
pub(crate) struct OrNode<'a> {
    kids: Vec<Node<'a>>,
    rows: Option<RowIndex>,
}

/// Per q tile `qt`: `(operand, first kv tile, last kv tile)` of every operand whose reach in that
/// row is non-empty, at `entries[off[qt]..off[qt + 1]]`.
struct RowIndex {
    off: Vec<u32>,
    entries: Vec<(u32, u32, u32)>,
}

/// Unions with at least this many operands get a [`RowIndex`]...
const ROW_INDEX_MIN_KIDS: usize = 8;
/// ...when it holds at most this many entries (operands times q tiles): 48 MiB.
const ROW_INDEX_MAX_ENTRIES: usize = 1 << 22;

impl<'a> OrNode<'a> {
    fn new(kids: Vec<Node<'a>>, g: &Geom) -> Self {
        let indexed = kids.len() >= ROW_INDEX_MIN_KIDS
            && kids.len().saturating_mul(g.nq) <= ROW_INDEX_MAX_ENTRIES;
        let rows = indexed.then(|| {
            let mut off = Vec::with_capacity(g.nq + 1);
            let mut entries = Vec::new();
            for qt in 0..g.nq {
                off.push(entries.len() as u32);
                for (i, k) in kids.iter().enumerate() {
                    if let Some((lo, hi)) = k.reach(g, qt) {
                        entries.push((i as u32, lo as u32, hi as u32));
                    }
                }
            }
            off.push(entries.len() as u32);
            RowIndex { off, entries }
        });
        OrNode { kids, rows }
    }

    /// Calls `f` on every operand that can allow a pair in tile (`qt`, `kt`) (every operand when
    /// the union has no index; the others are Empty there, their reach being sound) until `f`
    /// returns false.
    fn each_active(&self, qt: usize, kt: usize, mut f: impl FnMut(&Node<'a>) -> bool) {
        match &self.rows {
            Some(r) => {
                for &(i, lo, hi) in &r.entries[r.off[qt] as usize..r.off[qt + 1] as usize] {
                    if lo as usize <= kt && kt <= hi as usize && !f(&self.kids[i as usize]) {
                        return;
                    }
                }
            }
            None => {
                for k in &self.kids {
                    if !f(k) {
                        return;
                    }
                }
            }
        }
    }

    fn reach(&self, g: &Geom, qt: usize) -> Option<(usize, usize)> {
        let hull = |(a, b): (usize, usize), (x, y): (usize, usize)| (a.min(x), b.max(y));
        match &self.rows {
            Some(r) => r.entries[r.off[qt] as usize..r.off[qt + 1] as usize]
                .iter()
                .map(|&(_, lo, hi)| (lo as usize, hi as usize))
                .reduce(hull),
            None => self.kids.iter().filter_map(|n| n.reach(g, qt)).reduce(hull),
        }
    }
}

pub(crate) enum Node<'a> {
    Full,
    Causal(i64),
    Window(i64, i64),
    Chunk(i64),
    Prefix(i64),
    Doc(DocLeaf),
    Band(Box<BandLeaf<'a>>),
    Dense(DenseLeaf<'a>),
    Blocks(BlocksLeaf<'a>),
    And(Vec<Node<'a>>),
    Or(OrNode<'a>),
    Not(Box<Node<'a>>),
}

impl<'a> Node<'a> {
    /// Specializes `mask` to batch row `b` and head `h` (the mask must be validated).
    pub fn prepare(mask: &'a Mask, g: &Geom, b: usize, h: usize) -> Node<'a> {
        match mask {
            Mask::Full => Node::Full,
            Mask::Causal { offset } => Node::Causal(*offset),
            Mask::Window { left, right } => Node::Window(*left, *right),
            Mask::Chunk { size } => Node::Chunk((*size).min(i64::MAX as u64) as i64),
            Mask::Prefix { len } => Node::Prefix((*len).min(i64::MAX as u64) as i64),
            Mask::Document(s) => Node::Doc(DocLeaf::new(g, s.q.row(b), s.kv.row(b))),
            Mask::Band { features, lo, hi } => Node::Band(Box::new(BandLeaf::new(
                g,
                features.q.row(b),
                features.kv.row(b),
                *lo,
                *hi,
            ))),
            Mask::Dense(d) => Node::Dense(DenseLeaf::new(g, d, d.slice_index(b, h))),
            Mask::Blocks(s) => Node::Blocks(BlocksLeaf {
                sel: s,
                slice: s.slice_index(b, h),
            }),
            Mask::And(v) => Node::And(v.iter().map(|m| Node::prepare(m, g, b, h)).collect()),
            Mask::Or(v) => Node::Or(OrNode::new(
                v.iter().map(|m| Node::prepare(m, g, b, h)).collect(),
                g,
            )),
            Mask::Not(m) => Node::Not(Box::new(Node::prepare(m, g, b, h))),
            Mask::Heads(v) => Node::prepare(&v[h], g, b, h),
        }
    }

    /// Stage 1: the kv tiles of q-tile `qt` worth classifying: a superset of those holding an
    /// allowed pair, within [`Node::reach`].
    pub fn candidates(&self, g: &Geom, qt: usize) -> Candidates {
        match self.list(g, qt) {
            Some(v) => Candidates::List(v),
            None => match self.reach(g, qt) {
                Some((lo, hi)) => Candidates::Range(lo, hi),
                None => Candidates::List(Vec::new()),
            },
        }
    }

    /// The explicit candidate list of q-tile `qt` where a `blocks` leaf bounds it (sorted,
    /// distinct), `None` where only a range is known. `&`: the lists of its list operands
    /// intersected and clipped to the other operands' reach; `|`: the union of its operands
    /// (ranges expanded) when one of them has a list. Each subtree is walked once for its
    /// list and at most once for its reach.
    fn list(&self, g: &Geom, qt: usize) -> Option<Vec<u32>> {
        match self {
            Node::Blocks(s) => Some(s.candidates(g, qt)),
            Node::And(v) => {
                let lists: Vec<Option<Vec<u32>>> = v.iter().map(|n| n.list(g, qt)).collect();
                let mut acc: Option<Vec<u32>> = None;
                for l in lists.iter().flatten() {
                    acc = Some(match acc {
                        None => l.clone(),
                        Some(a) => intersect(&a, l),
                    });
                }
                let mut acc = acc?;
                for (n, l) in v.iter().zip(&lists) {
                    if l.is_none() {
                        match n.reach(g, qt) {
                            Some((lo, hi)) => acc.retain(|&t| lo <= t as usize && t as usize <= hi),
                            None => acc.clear(),
                        }
                    }
                }
                Some(acc)
            }
            Node::Or(o) => {
                let v = &o.kids;
                let lists: Vec<Option<Vec<u32>>> = v.iter().map(|n| n.list(g, qt)).collect();
                if lists.iter().all(Option::is_none) {
                    return None;
                }
                let mut out = Vec::new();
                for (n, l) in v.iter().zip(lists) {
                    match l {
                        Some(l) => out.extend(l),
                        None => {
                            if let Some((lo, hi)) = n.reach(g, qt) {
                                out.extend(lo as u32..=hi as u32);
                            }
                        }
                    }
                }
                out.sort_unstable();
                out.dedup();
                Some(out)
            }
            _ => None,
        }
    }

    /// Stage 1: kv tiles (inclusive range) that may hold an allowed pair for q-tile `qt`.
    pub fn reach(&self, g: &Geom, qt: usize) -> Option<(usize, usize)> {
        let (i0, i1) = g.qr(qt);
        match self {
            Node::Full | Node::Not(_) => Some((0, g.nk - 1)),
            Node::Causal(off) => g.kv_tiles(0, i1.saturating_add(*off)),
            Node::Window(l, r) => g.kv_tiles(i0.saturating_sub(*l), i1.saturating_add(*r)),
            Node::Chunk(c) => g.kv_tiles(i0 / c * c, (i1 / c + 1).saturating_mul(*c) - 1),
            Node::Prefix(n) => g.kv_tiles(0, n - 1),
            Node::Doc(d) => d.q_reach[qt],
            Node::Band(d) => d.q_reach[qt],
            Node::Dense(d) => d.q_reach[qt],
            Node::Blocks(s) => s.reach(g, qt),
            Node::And(v) => v.iter().try_fold((0, g.nk - 1), |(a, b), n| {
                let (x, y) = n.reach(g, qt)?;
                let (lo, hi) = (a.max(x), b.min(y));
                (lo <= hi).then_some((lo, hi))
            }),
            Node::Or(o) => o.reach(g, qt),
        }
    }

    /// Stage 1: sound state of tile (`qt`, `kt`): Empty and Full are certain, Partial may be
    /// either until refined.
    pub fn classify(&self, g: &Geom, qt: usize, kt: usize) -> TileState {
        use TileState::*;
        let (i0, i1) = g.qr(qt);
        let (j0, j1) = g.kr(kt);
        // Differences j - i over the tile cover exactly [dmin, dmax].
        let (dmin, dmax) = (j0 - i1, j1 - i0);
        let verdict = |full: bool, empty: bool| {
            if empty {
                Empty
            } else if full {
                Full
            } else {
                Partial
            }
        };
        match self {
            Node::Full => Full,
            Node::Causal(off) => verdict(dmax <= *off, dmin > *off),
            Node::Window(l, r) => {
                let nl = l.saturating_neg();
                verdict(dmin >= nl && dmax <= *r, dmax < nl || dmin > *r)
            }
            Node::Chunk(c) => {
                let (qa, qb, ka, kb) = (i0 / c, i1 / c, j0 / c, j1 / c);
                verdict(qa == qb && ka == kb && qa == ka, qb < ka || kb < qa)
            }
            Node::Prefix(n) => verdict(j1 < *n, j0 >= *n),
            Node::Doc(d) => {
                let (q, k) = (d.q_sum[qt], d.kv_sum[kt]);
                let empty = !q.any_valid || !k.any_valid || q.max < k.min || k.max < q.min;
                let full =
                    !q.any_pad && !k.any_pad && q.min == q.max && k.min == k.max && q.min == k.min;
                verdict(full, empty)
            }
            Node::Band(d) => {
                // Differences f - g over the tile cover [qmin - kmax, qmax - kmin] (both ends
                // attained, so Full is exact and Empty sound).
                let ((qa, qb), (ka, kb)) = (d.q_sum[qt], d.kv_sum[kt]);
                let (dmin, dmax) = (qa as i128 - kb as i128, qb as i128 - ka as i128);
                verdict(dmin >= d.lo && dmax <= d.hi, dmax < d.lo || dmin > d.hi)
            }
            Node::Dense(d) => {
                let c = d.counts[qt * g.nk + kt] as i64;
                verdict(c == (i1 - i0 + 1) * (j1 - j0 + 1), c == 0)
            }
            Node::Blocks(s) => {
                let (any, all) = s.cover(g, qt, kt);
                verdict(all, !any)
            }
            Node::And(v) => {
                let mut all_full = true;
                for n in v {
                    match n.classify(g, qt, kt) {
                        Empty => return Empty,
                        Partial => all_full = false,
                        Full => {}
                    }
                }
                if all_full {
                    Full
                } else {
                    Partial
                }
            }
            Node::Or(o) => {
                let mut state = Empty;
                o.each_active(qt, kt, |n| match n.classify(g, qt, kt) {
                    Full => {
                        state = Full;
                        false
                    }
                    Partial => {
                        state = Partial;
                        true
                    }
                    Empty => true,
                });
                state
            }
            Node::Not(n) => match n.classify(g, qt, kt) {
                Empty => Full,
                Full => Empty,
                Partial => Partial,
            },
        }
    }

    /// Appends to `key` values that, with the tile's row and column counts, determine this
    /// node's bitmask on tile (`qt`, `kt`) (so two tiles of equal keys have equal bitmasks and
    /// stage 2 runs once for both); `false` where no such key is cheap (documents, dense data,
    /// block selections, wide unions). Keys of one prepared node are comparable with each other
    /// only: band leaves number their tile shapes per node.
    pub fn tile_key(&self, g: &Geom, qt: usize, kt: usize, key: &mut Vec<i128>) -> bool {
        let (i0, j0) = (g.qr(qt).0 as i128, g.kr(kt).0 as i128);
        // Row r allows columns from/below `d + r` (a difference of tile origins): every value
        // at or past one column beyond either side of the tile behaves the same.
        let clamp = |d: i128| d.clamp(-(g.tq as i128) - 1, g.tk as i128 + 1);
        match self {
            Node::Full => true,
            Node::Causal(off) => {
                key.push(clamp(i0 + *off as i128 - j0));
                true
            }
            Node::Window(l, r) => {
                key.push(clamp(i0 - *l as i128 - j0));
                key.push(clamp(i0 + *r as i128 - j0));
                true
            }
            Node::Chunk(c) => {
                // Same chunk: (s + r) / c == (s + (j0 - i0) + col) / c with s = i0 mod c.
                key.push(i0 % *c as i128);
                key.push(j0 - i0);
                true
            }
            Node::Prefix(n) => {
                key.push((*n as i128 - j0).clamp(-1, g.tk as i128 + 1));
                true
            }
            Node::Band(d) => {
                key.push(d.q_shape.id[qt] as i128);
                key.push(d.kv_shape.id[kt] as i128);
                key.push(d.kv_shape.first[kt] as i128 - d.q_shape.first[qt] as i128);
                true
            }
            Node::Doc(_) | Node::Dense(_) | Node::Blocks(_) => false,
            Node::And(v) => v.iter().all(|n| n.tile_key(g, qt, kt, key)),
            Node::Or(o) => {
                o.kids.len() <= MAX_KEYED_OPERANDS
                    && o.kids.iter().all(|n| n.tile_key(g, qt, kt, key))
            }
            Node::Not(n) => n.tile_key(g, qt, kt, key),
        }
    }

    /// Stage 2: writes the exact bitmask of tile (`qt`, `kt`) into `out` (`tq` rows of `wpr`
    /// words); bits of out-of-range rows and columns are 0. `pool` supplies scratch buffers.
    pub fn eval(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64], pool: &mut Vec<Vec<u64>>) {
        out.fill(0);
        self.write(g, qt, kt, out, pool);
    }

    /// ORs the tile's bitmask into `out`: in place for the leaves whose stage 2 only sets bits,
    /// through a scratch buffer for the others. A union is thus refined in one pass over the
    /// tile, each operand touching only what it allows.
    fn or_into(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64], pool: &mut Vec<Vec<u64>>) {
        let sets_bits = matches!(
            self,
            Node::Full
                | Node::Causal(_)
                | Node::Window(..)
                | Node::Chunk(_)
                | Node::Prefix(_)
                | Node::Doc(_)
        );
        if sets_bits {
            self.write(g, qt, kt, out, pool);
        } else {
            let mut tmp = pool.pop().unwrap_or_default();
            tmp.resize(out.len(), 0);
            self.eval(g, qt, kt, &mut tmp, pool);
            out.iter_mut().zip(&tmp).for_each(|(o, s)| *o |= s);
            pool.push(tmp);
        }
    }

    /// Stage 2 into a zeroed `out` (the bit-setting leaves also OR into a non-zero one).
    fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64], pool: &mut Vec<Vec<u64>>) {
        let (i0, i1) = g.qr(qt);
        let (j0, j1) = g.kr(kt);
        let ncols = (j1 - j0 + 1) as usize;
        let rows = (i1 - i0 + 1) as usize;
        let wpr = g.wpr;
        // Sets columns [lo, hi) of tile row r (clipped to the in-range columns).
        let set = |out: &mut [u64], r: usize, lo: i64, hi: i64| {
            set_range(&mut out[r * wpr..(r + 1) * wpr], lo, hi, ncols);
        };
        match self {
            Node::Full => (0..rows).for_each(|r| set(out, r, 0, ncols as i64)),
            Node::Causal(off) => {
                for r in 0..rows {
                    let i = i0 + r as i64;
                    set(
                        out,
                        r,
                        0,
                        i.saturating_add(*off).saturating_sub(j0).saturating_add(1),
                    );
                }
            }
            Node::Window(l, rr) => {
                for r in 0..rows {
                    let i = i0 + r as i64;
                    set(
                        out,
                        r,
                        i.saturating_sub(*l).saturating_sub(j0),
                        i.saturating_add(*rr).saturating_sub(j0).saturating_add(1),
                    );
                }
            }
            Node::Chunk(c) => {
                for r in 0..rows {
                    let s = (i0 + r as i64) / c * c;
                    set(out, r, s - j0, s.saturating_add(*c) - j0);
                }
            }
            Node::Prefix(n) => (0..rows).for_each(|r| set(out, r, 0, n.saturating_sub(j0))),
            Node::Doc(d) => {
                let kv = &d.kv_runs[d.kv_run_off[kt] as usize..d.kv_run_off[kt + 1] as usize];
                let q = &d.q_runs[d.q_run_off[qt] as usize..d.q_run_off[qt + 1] as usize];
                for &(a, b, id) in q {
                    for &(c, e, _) in kv.iter().filter(|run| run.2 == id) {
                        (a..b).for_each(|r| set(out, r as usize, c as i64, e as i64));
                    }
                }
            }
            Node::Band(d) => {
                let shift = d.kv_shape.first[kt] as i128 - d.q_shape.first[qt] as i128;
                let key = (d.q_shape.id[qt], d.kv_shape.id[kt], shift);
                if let Some(&at) = d.memo.borrow().at.get(&key) {
                    out.copy_from_slice(&d.memo.borrow().words[at..at + out.len()]);
                    return;
                }
                d.eval(g, qt, kt, out);
                let mut memo = d.memo.borrow_mut();
                if memo.words.len() + out.len() <= MEMO_WORDS {
                    let at = memo.words.len();
                    memo.words.extend_from_slice(out);
                    memo.at.insert(key, at);
                }
            }
            Node::Dense(d) => {
                for r in 0..rows {
                    let bits = d.mask.row_bits(d.slice, i0 as usize + r);
                    let row = &mut out[r * wpr..(r + 1) * wpr];
                    for (w, word) in row.iter_mut().enumerate() {
                        let at = w * 64;
                        if at < ncols {
                            *word = read_bits(bits, j0 as usize + at, (ncols - at).min(64));
                        }
                    }
                }
            }
            Node::Blocks(s) => {
                let kb = s.sel.kv_block() as i64;
                let (ka, kz) = ((j0 / kb) as u32, (j1 / kb) as u32);
                let mut prev = None;
                for r in 0..rows {
                    let qb = (i0 as usize + r) / s.sel.q_block();
                    if let Some(p) = prev.filter(|&(b, _)| b == qb) {
                        // Same query block as row `p`: the same bits.
                        let p: usize = p.1;
                        out.copy_within(p * wpr..(p + 1) * wpr, r * wpr);
                        continue;
                    }
                    prev = Some((qb, r));
                    let row = s.sel.row(s.slice, qb);
                    let lo = row.partition_point(|&t| t < ka);
                    for &t in row[lo..].iter().take_while(|&&t| t <= kz) {
                        let a = t as i64 * kb - j0;
                        set(out, r, a, a + kb);
                    }
                }
            }
            Node::And(v) => {
                let mut first = true;
                let mut tmp = pool.pop().unwrap_or_default();
                tmp.resize(out.len(), 0);
                for n in v {
                    // Operands Full on this tile need no token work; an Empty one empties it.
                    match n.classify(g, qt, kt) {
                        TileState::Full => continue,
                        TileState::Empty => {
                            out.fill(0);
                            pool.push(tmp);
                            return;
                        }
                        TileState::Partial => {}
                    }
                    if first {
                        n.eval(g, qt, kt, out, pool);
                        first = false;
                    } else {
                        n.eval(g, qt, kt, &mut tmp, pool);
                        out.iter_mut().zip(&tmp).for_each(|(o, s)| *o &= s);
                    }
                }
                if first {
                    // Every operand was Full on this tile.
                    Node::Full.write(g, qt, kt, out, pool);
                }
                pool.push(tmp);
            }
            Node::Or(o) => {
                // One pass: `out` is zeroed; each partial operand ORs in what it allows.
                let mut full = false;
                o.each_active(qt, kt, |n| match n.classify(g, qt, kt) {
                    TileState::Empty => true,
                    TileState::Full => {
                        full = true;
                        false
                    }
                    TileState::Partial => {
                        n.or_into(g, qt, kt, out, pool);
                        true
                    }
                });
                if full {
                    out.fill(0);
                    Node::Full.write(g, qt, kt, out, pool);
                }
            }
            Node::Not(n) => {
                n.eval(g, qt, kt, out, pool);
                let mut all = vec![0u64; wpr];
                set_range(&mut all, 0, ncols as i64, ncols);
                for r in 0..g.tq {
                    let row = &mut out[r * wpr..(r + 1) * wpr];
                    for (o, m) in row.iter_mut().zip(&all) {
                        *o = if r < rows { !*o & m } else { 0 };
                    }
                }
            }
        }
    }
}

/// A 64-bit hash of `words` (the length included) for content-addressed tables, whose
/// collisions are resolved by comparing contents: four independent multiply-rotate lanes, so
/// hashing a partial bitmask is not one long dependency chain.
pub(crate) fn hash_words(words: &[u64]) -> u64 {
    hash_iter(words.len(), words.iter().copied())
}

/// [`hash_words`] of the `len` words `words` yields, without collecting them.
pub(crate) fn hash_iter(len: usize, words: impl Iterator<Item = u64>) -> u64 {
    const P: u64 = 0x0100_0000_01b3;
    let step = |a: u64, w: u64| (a ^ w).wrapping_mul(P).rotate_left(29);
    let mut lanes = [
        0xcbf2_9ce4_8422_2325u64,
        0x9e37_79b9_7f4a_7c15,
        0x6c62_272e_07bb_0142,
        0x2545_f491_4f6c_dd1d,
    ];
    for (i, w) in words.enumerate() {
        lanes[i % 4] = step(lanes[i % 4], w);
    }
    lanes.iter().fold(len as u64, |a, &l| step(a, l))
}

/// Operands up to which a union's tile key is the concatenation of theirs (past it a tile
/// costs its active operands only, and keying all would cost more than it saves).
const MAX_KEYED_OPERANDS: usize = 8;

/// Sorted runs up to which a band key tile is searched run by run rather than compared key by key.
const BAND_RUNS: usize = 4;

/// Distinct feature values a band tile remembers its computed rows by (a period-8 dilation or
/// residue feature costs 8 row evaluations per tile, the other rows are copies).
const BAND_MEMO: usize = 8;

/// The first index in [from, n) where `below` turns false (`below` true on a prefix that
/// covers [0, from)), found by doubling steps from `from` then bisection: O(log distance).
fn gallop(from: usize, n: usize, below: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi, mut step) = (from, from, 1);
    while hi < n && below(hi) {
        lo = hi + 1;
        hi = (hi + step).min(n);
        step *= 2;
    }
    lo + partition(hi - lo, |i| below(lo + i))
}

/// The first index in [0, n) where `below` turns false (`below` true on a prefix).
fn partition(n: usize, below: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Sets bits [lo, hi) of `row`, clipped to [0, ncols).
fn set_range(row: &mut [u64], lo: i64, hi: i64, ncols: usize) {
    let lo = lo.max(0) as usize;
    let hi = hi.clamp(0, ncols as i64) as usize;
    let mut j = lo;
    while j < hi {
        let (w, b) = (j / 64, j % 64);
        let take = (64 - b).min(hi - j);
        row[w] |= if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << b
        };
        j += take;
    }
}

#[cfg(test)]
mod tests {
    use super::{same_shape, TileShapes};
    use proptest::prelude::*;

    /// The definition: equal lengths and equal differences to the first value, in i128.
    fn reference(a: &[i64], b: &[i64]) -> bool {
        let rel = |c: &[i64], i: usize| c[i] as i128 - c[0] as i128;
        a.len() == b.len() && (0..a.len()).all(|i| rel(a, i) == rel(b, i))
    }

    /// Values near zero and near both ends of i64, where wrapped differences collide.
    fn value() -> impl Strategy<Value = i64> {
        prop_oneof![
            -4i64..4,
            (i64::MIN..i64::MIN + 4),
            (i64::MAX - 4..=i64::MAX),
            Just(i64::MIN / 2),
            Just(i64::MAX / 2 + 1),
            any::<i64>(),
        ]
    }

    proptest! {
        #[test]
        fn same_shape_is_exact_difference_equality(
            a in proptest::collection::vec(value(), 1..6),
            shift in value(),
            flip in proptest::collection::vec(any::<bool>(), 6),
            other in proptest::collection::vec(value(), 1..6),
        ) {
            // `b` is `a` shifted (wrapping: sometimes the same shape, sometimes not), with
            // some values replaced.
            let b: Vec<i64> = a
                .iter()
                .zip(&flip)
                .zip(other.iter().cycle())
                .map(|((&x, &f), &o)| if f { o } else { x.wrapping_add(shift) })
                .collect();
            prop_assert_eq!(same_shape(&a, &b), reference(&a, &b));
            prop_assert_eq!(same_shape(&b, &a), reference(&b, &a));
            prop_assert!(same_shape(&a, &a));
        }

        #[test]
        fn tile_shapes_number_tiles_by_shape_with_their_ranges(
            feature in proptest::collection::vec(value(), 1..40),
            tile in 1usize..6,
        ) {
            let s = TileShapes::new(&feature, tile, true);
            let chunks: Vec<&[i64]> = feature.chunks(tile).collect();
            for (t, c) in chunks.iter().enumerate() {
                for (u, d) in chunks.iter().enumerate() {
                    prop_assert_eq!(s.id[t] == s.id[u], reference(c, d));
                }
                let lo = *c.iter().min().unwrap();
                let hi = *c.iter().max().unwrap();
                prop_assert_eq!(s.range(t), (lo, hi));
            }
        }
    }
}
