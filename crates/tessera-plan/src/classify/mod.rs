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

mod band;
mod blocks;
mod dense;
mod doc;
mod geom;
mod interval;
pub(crate) mod simd;

use crate::plan::TileState;
use band::BandLeaf;
use blocks::BlocksLeaf;
use dense::DenseLeaf;
use doc::DocLeaf;
use geom::set_range;
pub(crate) use geom::Geom;
use interval::IntervalLeaf;
use tessera_mask::Mask;

/// The kv tiles of one q-tile row that planning visits: a range, or an explicit sorted list.
pub(crate) enum Candidates {
    /// Every tile in `lo..=hi`.
    Range(usize, usize),
    /// These tiles (sorted, distinct).
    List(Vec<u32>),
}

impl Candidates {
    /// The tiles of sorted distinct `v`: a range when they are consecutive (a long prompt's
    /// rows: no list to walk), else the list (`v` copied only then).
    fn of<V: AsRef<[u32]> + Into<Vec<u32>>>(v: V) -> Candidates {
        let s = v.as_ref();
        let run = match (s.first(), s.last()) {
            (Some(&a), Some(&b)) if (b - a) as usize + 1 == s.len() => Some((a, b)),
            _ => None,
        };
        match run {
            Some((a, b)) => Candidates::Range(a as usize, b as usize),
            None => Candidates::List(v.into()),
        }
    }

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

/// Bands of an `&` searched for a shared query feature.
const MAX_FUSED: usize = 8;

/// A `band` operand of an `&`: its position, features (one batch row) and bounds.
struct BandOperand<'a> {
    at: usize,
    q: &'a [i64],
    kv: &'a [i64],
    lo: i64,
    hi: i64,
}

pub(crate) enum Node<'a> {
    Full,
    Causal(i64),
    Window(i64, i64),
    Chunk(i64),
    Prefix(i64),
    Doc(DocLeaf<'a>),
    Band(Box<BandLeaf<'a>>),
    Interval(Box<IntervalLeaf<'a>>),
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
            Mask::Document(s) => {
                // Self-attention rows (equal digests, hence equal ids) summarize one side once.
                let shared = s.q.row_digest(b) == s.kv.row_digest(b);
                Node::Doc(DocLeaf::new(g, s.q.row(b), s.kv.row(b), shared))
            }
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
            Mask::And(v) => Node::and(v, g, b, h),
            Mask::Or(v) => Node::Or(OrNode::new(
                v.iter().map(|m| Node::prepare(m, g, b, h)).collect(),
                g,
            )),
            Mask::Not(m) => Node::Not(Box::new(Node::prepare(m, g, b, h))),
            Mask::Heads(v) => Node::prepare(&v[h], g, b, h),
        }
    }

    /// `&` of `v`: bands over one query feature (two or more) are fused into an interval leaf
    /// (see [`interval`]), the other operands prepared as they are.
    fn and(v: &'a [Mask], g: &Geom, b: usize, h: usize) -> Node<'a> {
        let bands: Vec<BandOperand<'a>> = v
            .iter()
            .enumerate()
            .filter_map(|(at, m)| match m {
                Mask::Band { features, lo, hi } => Some(BandOperand {
                    at,
                    q: features.q.row(b),
                    kv: features.kv.row(b),
                    lo: *lo,
                    hi: *hi,
                }),
                _ => None,
            })
            .collect();
        // The bands sharing the first query feature that two of them share (among the first
        // few bands: the features are compared by content).
        let group: Vec<&BandOperand> = bands
            .iter()
            .take(MAX_FUSED)
            .map(|x| bands.iter().filter(|o| o.q == x.q).collect::<Vec<_>>())
            .find(|same| same.len() > 1)
            .unwrap_or_default();
        let fused = group.first().and_then(|first| {
            let parts: Vec<(&[i64], i64, i64)> = group.iter().map(|o| (o.kv, o.lo, o.hi)).collect();
            IntervalLeaf::new(g, first.q, &parts)
        });
        let Some(leaf) = fused else {
            return Node::And(v.iter().map(|m| Node::prepare(m, g, b, h)).collect());
        };
        let mut kids: Vec<Node<'a>> = v
            .iter()
            .enumerate()
            .filter(|(k, _)| group.iter().all(|o| o.at != *k))
            .map(|(_, m)| Node::prepare(m, g, b, h))
            .collect();
        if kids.is_empty() {
            return Node::Interval(Box::new(leaf));
        }
        kids.push(Node::Interval(Box::new(leaf)));
        Node::And(kids)
    }

    /// Stage 1: the kv tiles of q-tile `qt` worth classifying: a superset of those holding an
    /// allowed pair, within [`Node::reach`].
    pub fn candidates(&self, g: &Geom, qt: usize) -> Candidates {
        if let Node::Interval(d) = self {
            return Candidates::of(d.candidates(qt));
        }
        match self.list(g, qt) {
            Some(v) => Candidates::of(v),
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
        if !self.listed() {
            return None; // no operand lists (nothing allocated per row)
        }
        match self {
            Node::Blocks(s) => Some(s.candidates(g, qt)),
            Node::Interval(d) => Some(d.candidates(qt).to_vec()),
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

    /// Whether [`Node::list`] can give a list: a `blocks` or fused interval leaf in the subtree.
    fn listed(&self) -> bool {
        match self {
            Node::Blocks(_) | Node::Interval(_) => true,
            Node::And(v) => v.iter().any(Node::listed),
            Node::Or(o) => o.kids.iter().any(Node::listed),
            _ => false,
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
            Node::Interval(d) => d.q_reach[qt],
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

    /// [`Node::classify`] of every tile of `cands` (q-tile `qt`'s candidates) into `out`.
    pub fn classify_row(&self, g: &Geom, qt: usize, cands: &Candidates, out: &mut Vec<TileState>) {
        out.clear();
        match self {
            // The leaf's own state, inlined: no dispatch per tile.
            Node::Interval(d) => out.extend(cands.iter().map(|kt| d.state(qt, kt))),
            // The first operand's row at once, then each other operand on the tiles still
            // possible (an Empty tile stays Empty, a Partial operand makes the tile Partial).
            Node::And(v) if !v.is_empty() => {
                v[0].classify_row(g, qt, cands, out);
                for n in &v[1..] {
                    match n {
                        Node::Doc(d) => and_row(out, cands, |kt| d.state(qt, kt)),
                        Node::Causal(off) => {
                            and_row(out, cands, |kt| causal_state(g, qt, kt, *off))
                        }
                        _ => and_row(out, cands, |kt| n.classify(g, qt, kt)),
                    }
                }
            }
            Node::Doc(d) => out.extend(cands.iter().map(|kt| d.state(qt, kt))),
            Node::Causal(off) => out.extend(cands.iter().map(|kt| causal_state(g, qt, kt, *off))),
            _ => out.extend(cands.iter().map(|kt| self.classify(g, qt, kt))),
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
            Node::Causal(off) => causal_state(g, qt, kt, *off),
            Node::Window(l, r) => {
                let nl = l.saturating_neg();
                verdict(dmin >= nl && dmax <= *r, dmax < nl || dmin > *r)
            }
            Node::Chunk(c) => {
                let (qa, qb, ka, kb) = (i0 / c, i1 / c, j0 / c, j1 / c);
                verdict(qa == qb && ka == kb && qa == ka, qb < ka || kb < qa)
            }
            Node::Prefix(n) => verdict(j1 < *n, j0 >= *n),
            Node::Doc(d) => d.state(qt, kt),
            Node::Band(d) => d.state(qt, kt),
            Node::Interval(d) => d.state(qt, kt),
            Node::Dense(d) => d.state(g, qt, kt),
            Node::Blocks(s) => s.state(g, qt, kt),
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

    /// The allowed pairs of Partial tile (`qt`, `kt`) when stage 1 counted them (a lone
    /// interval leaf whose column was walked): stage 2 without masks needs no evaluation. `at`:
    /// the tile's place among [`Node::candidates`] of row `qt`, when the caller knows it.
    pub fn pairs(&self, qt: usize, kt: usize, at: Option<usize>) -> Option<u64> {
        match self {
            Node::Interval(d) => d.pairs(qt, kt, at),
            _ => None,
        }
    }

    /// Appends to `key` values that, with the tile's row and column counts, determine this
    /// node's bitmask on tile (`qt`, `kt`) (so two tiles of equal keys have equal bitmasks and
    /// stage 2 runs once for both); `false` where no such key is cheap (documents of many runs
    /// in the tile, dense data, block selections, wide unions). Keys of one prepared node are
    /// comparable with each other only: band leaves number their tile shapes per node.
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
                d.tile_key(qt, kt, key);
                true
            }
            Node::Doc(d) => d.tile_key(qt, kt, key),
            Node::Dense(_) | Node::Blocks(_) | Node::Interval(_) => false,
            // An operand Full on the tile leaves the `&` unchanged there: a marker instead of
            // its key (a document's interior under a causal diagonal is keyed by the diagonal).
            Node::And(v) => v.iter().all(|n| {
                if n.classify(g, qt, kt) == TileState::Full {
                    key.push(i128::MIN);
                    return true;
                }
                key.push(i128::MAX);
                n.tile_key(g, qt, kt, key)
            }),
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
            Node::Doc(d) => d.write(g, qt, kt, out),
            Node::Band(d) => d.write(g, qt, kt, out),
            Node::Interval(d) => d.write(g, qt, kt, out),
            Node::Dense(d) => d.write(g, qt, kt, out),
            Node::Blocks(s) => s.write(g, qt, kt, out),
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

/// A `causal(off)` leaf's state on tile (`qt`, `kt`): Full when every pair has `j - i <= off`,
/// Empty when none has.
#[inline]
fn causal_state(g: &Geom, qt: usize, kt: usize, off: i64) -> TileState {
    let (i0, i1) = g.qr(qt);
    let (j0, j1) = g.kr(kt);
    if j0 - i1 > off {
        TileState::Empty
    } else if j1 - i0 <= off {
        TileState::Full
    } else {
        TileState::Partial
    }
}

/// `&` of the row states `out` with one more operand's (`state` of each candidate tile), read
/// only where the tile is not Empty yet.
#[inline]
fn and_row(out: &mut [TileState], cands: &Candidates, state: impl Fn(usize) -> TileState) {
    for (s, kt) in out.iter_mut().zip(cands.iter()) {
        if *s != TileState::Empty {
            match state(kt) {
                TileState::Full => {}
                other => *s = other,
            }
        }
    }
}

/// Operands up to which a union's tile key is the concatenation of theirs (past it a tile
/// costs its active operands only, and keying all would cost more than it saves).
const MAX_KEYED_OPERANDS: usize = 8;
