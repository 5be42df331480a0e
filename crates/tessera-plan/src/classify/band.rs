//! `band` leaves: query `i` attends key `j` when `lo <= f[i] - g[j] <= hi` over per-token i64
//! features.
//!
//! Contract: stage 1 ([`BandLeaf::state`], `q_reach`) is sound from per-tile (min, max)
//! summaries of both features (computed once, O(L)), and exact for Full; stage 2
//! ([`BandLeaf::write`]) writes exactly the tile's allowed pairs into a zeroed `out`. All
//! differences are exact (i128 or bounds clamped to the tile's range), so no value near the
//! ends of i64 wraps. Stage 2 per key tile: sorted runs are galloped, tiles of repeated shape
//! are copied from a memo, and scattered keys are compared a row at a time in SIMD
//! ([`super::simd`]), as u32 offsets from the tile's minimum where its range fits.

use super::geom::{hash_iter, set_range, Geom};
use super::simd;
use crate::plan::TileState;
use rustc_hash::FxHashMap;

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
    pub(super) q_reach: Vec<Option<(usize, usize)>>,
    /// Tiles whose features are equal up to a shift (every q tile of a canvas row, every kv
    /// tile of a frame) have the same bitmask at the same offset between them: stage 2 computes
    /// it once per (q shape, kv shape, offset) and copies it afterwards. The kv shapes also
    /// say where a kv tile's runs of non-decreasing features start (positions and sorted ids
    /// are one run; a frame boundary or a canvas row inside the tile adds one), up to
    /// `BAND_RUNS`: a row's allowed keys in a run are found by binary search. Empty: more runs
    /// (shuffled, tile-ordered, residue features); each key is compared, in SIMD.
    q_shape: TileShapes,
    kv_shape: TileShapes,
    memo: std::cell::RefCell<TileMemo>,
    /// Whether tiles may repeat (some shape serves two tiles on both sides): else the memo is
    /// never hit and not kept.
    memoize: bool,
    /// Per kv tile compared key by key (more than `BAND_RUNS` runs) whose range fits u32:
    /// its features minus the tile's minimum, at the tile's columns of `narrow` (others 0).
    narrow: Vec<u32>,
    narrowed: Vec<bool>,
    scratch: std::cell::RefCell<Scratch>,
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

/// Band tile bitmasks computed so far, by (q shape, kv shape, kv first - q first): mask `n`
/// of `words` words each lies in chunk `n / MEMO_CHUNK_TILES` (chunks never move, so keeping
/// a mask never copies the earlier ones).
#[derive(Default)]
struct TileMemo {
    at: FxHashMap<(u32, u32, i128), usize>,
    chunks: Vec<Vec<u64>>,
    tiles: usize,
}

/// Masks per memo chunk (512 KiB at 128 x 128 tiles).
const MEMO_CHUNK_TILES: usize = 256;

impl TileMemo {
    /// Mask `n` (of `words` words).
    fn get(&self, n: usize, words: usize) -> &[u64] {
        let at = (n % MEMO_CHUNK_TILES) * words;
        &self.chunks[n / MEMO_CHUNK_TILES][at..at + words]
    }

    /// Keeps `mask` under `key`.
    fn keep(&mut self, key: (u32, u32, i128), mask: &[u64]) {
        if self.tiles.is_multiple_of(MEMO_CHUNK_TILES) {
            self.chunks
                .push(Vec::with_capacity(MEMO_CHUNK_TILES * mask.len()));
        }
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.extend_from_slice(mask);
            self.at.insert(key, self.tiles);
            self.tiles += 1;
        }
    }
}

/// Words of bitmasks a band leaf keeps (64 MiB at most; past it tiles are computed every time).
const MEMO_WORDS: usize = 8 << 20;

impl<'a> BandLeaf<'a> {
    pub(super) fn new(g: &Geom, q: &'a [i64], kv: &'a [i64], lo: i64, hi: i64) -> Self {
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
        let memoize = q_shape.span.len() < q_sum.len() && kv_shape.span.len() < kv_sum.len();
        // Scattered key tiles narrowed to u32 offsets: 16 lanes per AVX-512 compare, not 8.
        let narrowed: Vec<bool> = (0..kv_sum.len())
            .map(|t| {
                let (ka, kb) = kv_sum[t];
                kv_shape.runs[kv_shape.id[t] as usize].is_empty()
                    && kb as i128 - ka as i128 <= u32::MAX as i128
            })
            .collect();
        let mut narrow = Vec::new();
        if narrowed.iter().any(|&x| x) {
            narrow = vec![0u32; kv.len()];
            for (t, chunk) in narrow.chunks_mut(g.tk).enumerate() {
                if narrowed[t] {
                    let base = kv_sum[t].0;
                    let src = &kv[t * g.tk..t * g.tk + chunk.len()];
                    // Exact: every value lies in [base, base + u32::MAX].
                    for (o, &v) in chunk.iter_mut().zip(src) {
                        *o = v.wrapping_sub(base) as u32;
                    }
                }
            }
        }
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
            memoize,
            narrow,
            narrowed,
            scratch: Default::default(),
        }
    }
}

impl BandLeaf<'_> {
    /// Stage 1 of tile (`qt`, `kt`): the differences `f - g` over the tile cover
    /// [qmin - kmax, qmax - kmin] (both ends attained, so Full is exact and Empty sound).
    pub(super) fn state(&self, qt: usize, kt: usize) -> TileState {
        let ((qa, qb), (ka, kb)) = (self.q_sum[qt], self.kv_sum[kt]);
        let (dmin, dmax) = (qa as i128 - kb as i128, qb as i128 - ka as i128);
        if dmax < self.lo || dmin > self.hi {
            TileState::Empty
        } else if dmin >= self.lo && dmax <= self.hi {
            TileState::Full
        } else {
            TileState::Partial
        }
    }

    /// The tile key (see `Node::tile_key`): q shape, kv shape and the shift between them.
    #[inline]
    pub(super) fn tile_key(&self, qt: usize, kt: usize, key: &mut Vec<i128>) {
        key.push(self.q_shape.id[qt] as i128);
        key.push(self.kv_shape.id[kt] as i128);
        key.push(self.kv_shape.first[kt] as i128 - self.q_shape.first[qt] as i128);
    }

    /// Stage 2 of tile (`qt`, `kt`) into `out` (zeroed), through the memo of repeated tiles.
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        if !self.memoize {
            return self.eval(g, qt, kt, out);
        }
        let shift = self.kv_shape.first[kt] as i128 - self.q_shape.first[qt] as i128;
        let key = (self.q_shape.id[qt], self.kv_shape.id[kt], shift);
        {
            let memo = self.memo.borrow();
            if let Some(&n) = memo.at.get(&key) {
                out.copy_from_slice(memo.get(n, out.len()));
                return;
            }
        }
        self.eval(g, qt, kt, out);
        let mut memo = self.memo.borrow_mut();
        if (memo.tiles + 1) * out.len() <= MEMO_WORDS {
            memo.keep(key, out);
        }
    }

    /// Stage 2 of tile (`qt`, `kt`) into `out` (zeroed, `tq` rows of `wpr` words): sorted key
    /// tiles by galloping, the others by SIMD row compares.
    fn eval(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        if self.kv_shape.runs[self.kv_shape.id[kt] as usize].is_empty() {
            self.eval_compared(g, qt, kt, out)
        } else {
            self.eval_sorted(g, qt, kt, out)
        }
    }

    /// Stage 2 of a key tile of non-decreasing features: each row's keys are one range.
    fn eval_sorted(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
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
        // (positions), else searched.
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
            {
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
            }
            recent[computed % BAND_MEMO] = (fv, r);
            computed += 1;
        }
    }

    /// Stage 2 of a key tile of scattered features: each row's bounds, clamped to the tile's
    /// range (so exact in i64, and in u32 offsets where the tile is narrowed), are compared
    /// against every key in SIMD, all rows in one call; empty and full rows need no compare,
    /// and a row repeating a recent value (residues, frames) is a copy.
    fn eval_compared(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let (i0, i1) = g.qr(qt);
        let (j0, j1) = g.kr(kt);
        let (ncols, wpr) = ((j1 - j0 + 1) as usize, g.wpr);
        let (ka, kb) = self.kv_sum[kt];
        let (ka, kb) = (ka as i128, kb as i128);
        let narrowed = self.narrowed[kt];
        let mut s = self.scratch.borrow_mut();
        let Scratch {
            rows32,
            rows64,
            copies,
        } = &mut *s;
        rows32.clear();
        rows64.clear();
        copies.clear();
        let (lo, hi) = (self.lo, self.hi);
        let mut recent = [(0i64, 0u32); BAND_MEMO];
        // Rows computed, and whether to look values up: not after 2 * BAND_MEMO rows without
        // a repeat (scattered values rarely repeat; the lookup would cost more than it saves).
        let (mut seen, mut lookup) = (0usize, true);
        for (r, &fv) in self.q[i0 as usize..=i1 as usize].iter().enumerate() {
            let r = r as u32;
            if lookup {
                let hit = recent[..seen.min(BAND_MEMO)].iter().find(|e| e.0 == fv);
                if let Some(&(_, src)) = hit {
                    copies.push((r, src));
                    continue;
                }
                recent[seen % BAND_MEMO] = (fv, r);
                lookup = !copies.is_empty() || seen < 2 * BAND_MEMO;
            }
            seen += 1;
            let f = fv as i128;
            let (a, b) = ((f - hi).max(ka), (f - lo).min(kb));
            if a > b {
                // No key: the row stays zero.
            } else if a == ka && b == kb {
                let at = r as usize * wpr;
                set_range(&mut out[at..at + wpr], 0, ncols as i64, ncols);
            } else if narrowed {
                // Offsets from ka: a - ka and b - a lie in [0, kb - ka], within u32.
                let (lo, span) = ((a - ka) as u32, (b - a) as u32);
                rows32.push(simd::RowBounds { row: r, lo, span });
            } else {
                // a and b are values in the tile's range, so i64; b - a fits u64.
                let (lo, span) = (a as i64, (b - a) as u64 as i64);
                rows64.push(simd::RowBounds { row: r, lo, span });
            }
        }
        let (c0, c1) = (j0 as usize, j1 as usize + 1);
        if !rows32.is_empty() {
            simd::tile_in_range32(g.level, &self.narrow[c0..c1], rows32, wpr, out);
        }
        if !rows64.is_empty() {
            simd::tile_in_range(g.level, &self.kv[c0..c1], rows64, wpr, out);
        }
        for &(dst, src) in copies.iter() {
            let (dst, src) = (dst as usize * wpr, src as usize * wpr);
            out.copy_within(src..src + wpr, dst);
        }
    }
}

/// Per-tile scratch of [`BandLeaf::eval_compared`]: the rows to compare (u32 or i64 keys)
/// and the rows copied from an earlier one, (destination, source).
#[derive(Default)]
struct Scratch {
    rows32: Vec<simd::RowBounds<u32>>,
    rows64: Vec<simd::RowBounds<i64>>,
    copies: Vec<(u32, u32)>,
}

/// Sorted runs up to which a band key tile is searched run by run rather than compared key by
/// key: one (several runs are compared in SIMD faster than searched).
const BAND_RUNS: usize = 1;

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
