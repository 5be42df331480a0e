//! Property tests: plan states equal a brute-force token-level classification for random mask
//! trees (every leaf, `band` over random features included, under `&`, `|`, `!`, `heads`), every
//! partial bitmask reproduces the token mask, the backward list is exactly the transpose of
//! the forward list, and the plan of tile states only (no bitmasks) has the same lists and counts.

use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tessera_mask::{
    BandFeatures, BlockSelection, DenseMask, Mask, SegmentIds, Segments, MAX_TREE_DEPTH,
};
use tessera_plan::{
    build_plan, build_plan_within, build_tile_states, Plan, PlanShape, TileShape, TileState,
};

#[path = "common/tree.rs"]
mod tree;

/// Proptest cases: `PROPTEST_CASES` when set (e.g. 1500 for a release run), else `default`
/// (kept small for CI).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Random segment ids for `rows` rows: runs of documents, sometimes padding runs (-1, -3), and
/// sometimes unsorted/reused ids.
fn random_segments(rng: &mut impl Rng, rows: usize, len: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(rows * len);
    for _ in 0..rows {
        let mut id = 0i64;
        let mut i = 0;
        while i < len {
            let run = rng.gen_range(1..=(len / 2).max(2)).min(len - i);
            let v = match rng.gen_range(0..10) {
                0 => -1,
                1 => -3,
                2 => rng.gen_range(0..4),
                _ => {
                    id += 1;
                    id
                }
            };
            out.extend(std::iter::repeat_n(v, run));
            i += run;
        }
    }
    out
}

/// Random integer features for `rows` rows: positions (shifted, strided), sorted small values,
/// shuffled small values, document-like runs, or (rarely) values at the ends of i64.
fn random_feature(rng: &mut impl Rng, rows: usize, len: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(rows * len);
    for _ in 0..rows {
        let row: Vec<i64> = match rng.gen_range(0..6) {
            0 | 1 => {
                let (shift, step) = (rng.gen_range(-4..=4), rng.gen_range(1..=3));
                (0..len as i64).map(|i| shift + step * i).collect()
            }
            2 => {
                let mut v = rng.gen_range(-3..3);
                (0..len)
                    .map(|_| {
                        v += rng.gen_range(0..3);
                        v
                    })
                    .collect()
            }
            3 => {
                let mut v: Vec<i64> = (0..len).map(|_| rng.gen_range(-4..8)).collect();
                v.shuffle(rng);
                v
            }
            4 => random_segments(rng, 1, len),
            _ => (0..len)
                .map(|_| match rng.gen_range(0..4) {
                    0 => i64::MIN,
                    1 => i64::MAX,
                    _ => rng.gen_range(-2..3),
                })
                .collect(),
        };
        out.extend(row);
    }
    out
}

/// Band bounds: small (the usual case), one-sided wide, or at the ends of i64.
fn random_bounds(rng: &mut impl Rng, l: i64) -> (i64, i64) {
    fn pick(rng: &mut impl Rng, l: i64) -> i64 {
        match rng.gen_range(0..8) {
            0 => i64::MIN,
            1 => i64::MAX,
            2 => rng.gen_range(-l..=l),
            _ => rng.gen_range(-6..=6),
        }
    }
    let (a, b) = (pick(rng, l), pick(rng, l));
    (a.min(b), a.max(b))
}

/// A random block selection for `[b, h, lq, lkv]` in blocks of `qb` x `kb`: `[B or 1, H or 1,
/// Tq, k]` with duplicates, `-1` padding and some rows of `-1` only.
fn random_blocks(
    rng: &mut impl Rng,
    b: usize,
    h: usize,
    lq: usize,
    lkv: usize,
    qb: usize,
    kb: usize,
) -> Mask {
    let (bb, hh) = (
        if rng.gen_bool(0.5) { 1 } else { b },
        if rng.gen_bool(0.5) { 1 } else { h },
    );
    let (tq, tk) = (lq.div_ceil(qb), lkv.div_ceil(kb));
    let k = rng.gen_range(0..=tk + 2);
    let mut entries = Vec::with_capacity(bb * hh * tq * k);
    for _ in 0..bb * hh * tq {
        let none = rng.gen_bool(0.15);
        for _ in 0..k {
            entries.push(if none || rng.gen_bool(0.2) {
                -1
            } else {
                rng.gen_range(0..tk as i64)
            });
        }
    }
    let shape: Vec<usize> = if bb == 1 && rng.gen_bool(0.5) {
        if hh == 1 {
            vec![tq, k]
        } else {
            vec![hh, tq, k]
        }
    } else {
        vec![bb, hh, tq, k]
    };
    Mask::blocks(BlockSelection::new(&shape, &entries, qb, kb, "sel").unwrap())
}

struct Gen<'a, R: Rng> {
    rng: &'a mut R,
    b: usize,
    h: usize,
    lq: usize,
    lkv: usize,
}

impl<R: Rng> Gen<'_, R> {
    fn leaf(&mut self) -> Mask {
        let l = self.lq.max(self.lkv) as i64;
        match self.rng.gen_range(0..12) {
            0 => Mask::full(),
            1 => Mask::causal(),
            2 => Mask::causal_offset(self.rng.gen_range(-l..=l)),
            3 => Mask::window(
                self.rng.gen_range(-5..=l / 2),
                self.rng.gen_range(-5..=l / 2),
            ),
            4 => Mask::chunk(self.rng.gen_range(1..=l as u64)),
            5 => Mask::prefix(self.rng.gen_range(0..=l as u64 + 2)),
            6 | 7 => {
                let rows = if self.rng.gen_bool(0.5) { 1 } else { self.b };
                let cross = self.lq != self.lkv || self.rng.gen_bool(0.3);
                let q = SegmentIds::new(rows, self.lq, random_segments(self.rng, rows, self.lq));
                let segs = if cross {
                    let kv =
                        SegmentIds::new(rows, self.lkv, random_segments(self.rng, rows, self.lkv));
                    Segments::cross(q.unwrap(), kv.unwrap()).unwrap()
                } else {
                    Segments::shared(q.unwrap())
                };
                Mask::document(segs)
            }
            8 => {
                let qb = self.rng.gen_range(1..=self.lq.min(70));
                let kb = self.rng.gen_range(1..=self.lkv.min(70));
                random_blocks(self.rng, self.b, self.h, self.lq, self.lkv, qb, kb)
            }
            9 | 10 => self.band(),
            _ => {
                let shape: Vec<usize> = match self.rng.gen_range(0..3) {
                    0 => vec![self.lq, self.lkv],
                    1 => vec![self.h, self.lq, self.lkv],
                    _ => vec![self.b, self.h, self.lq, self.lkv],
                };
                let n: usize = shape.iter().product();
                let p: f64 = [0.0, 0.05, 0.5, 0.95, 1.0][self.rng.gen_range(0..5)];
                let vals: Vec<bool> = (0..n).map(|_| self.rng.gen_bool(p)).collect();
                Mask::dense(DenseMask::new(&shape, &vals, "rand").unwrap())
            }
        }
    }

    /// A band over random features, each side shared (1 row) or per batch row.
    fn band(&mut self) -> Mask {
        let (qr, kr) = (
            if self.rng.gen_bool(0.5) { 1 } else { self.b },
            if self.rng.gen_bool(0.5) { 1 } else { self.b },
        );
        let q = SegmentIds::new(qr, self.lq, random_feature(self.rng, qr, self.lq)).unwrap();
        let kv = SegmentIds::new(kr, self.lkv, random_feature(self.rng, kr, self.lkv)).unwrap();
        let (lo, hi) = random_bounds(self.rng, self.lq.max(self.lkv) as i64);
        Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
    }

    fn tree(&mut self, depth: usize) -> Mask {
        if depth == 0 || self.rng.gen_bool(0.3) {
            return self.leaf();
        }
        match self.rng.gen_range(0..4) {
            0 => self.tree(depth - 1) & self.tree(depth - 1),
            1 => self.tree(depth - 1) | self.tree(depth - 1),
            2 => !self.tree(depth - 1),
            _ => {
                let v = (0..self.h).map(|_| self.tree(depth - 1)).collect();
                Mask::heads(v)
            }
        }
    }
}

impl<R: Rng> Gen<'_, R> {
    /// A tree exactly `depth` levels deep: a random small tree wrapped, one level at a time, in
    /// `heads(...)` with `m` at a random head and random small trees for the others.
    fn one_head_of(&mut self, m: Mask) -> Mask {
        let at = self.rng.gen_range(0..self.h);
        let mut v: Vec<Mask> = (0..self.h - 1).map(|_| self.tree(1)).collect();
        v.insert(at, m);
        Mask::heads(v)
    }

    /// `!`, `&` or `|` with a leaf, or `heads(...)` with leaves for the other heads (explicit
    /// nodes: the operators would flatten same-kind chains).
    fn deep(&mut self, depth: usize) -> Mask {
        let mut m = self.tree(2);
        while m.depth() < depth {
            m = match self.rng.gen_range(0..4) {
                0 => Mask::Not(Box::new(m)),
                1 => Mask::And(vec![self.leaf(), m]),
                2 => Mask::Or(vec![m, self.leaf()]),
                _ => {
                    let at = self.rng.gen_range(0..self.h);
                    let mut v: Vec<Mask> = (0..self.h - 1).map(|_| self.leaf()).collect();
                    v.insert(at, m);
                    Mask::Heads(v)
                }
            };
        }
        m
    }
}

/// Plans `mask` for `[b, h, lq, lkv]` in `tile` and checks it by brute force.
fn plan_and_check(
    mask: &Mask,
    (b, h, lq, lkv): (usize, usize, usize, usize),
    tile: TileShape,
) -> Result<(), TestCaseError> {
    let plan = build_plan(mask, PlanShape::new(b, h, lq, lkv).unwrap(), tile).unwrap();
    check(mask, &plan)
}

/// Brute-force checks of every tile of every (b, h) against `Mask::allowed`.
fn check(mask: &Mask, plan: &Plan) -> Result<(), TestCaseError> {
    let s = plan.shape;
    let t = plan.tile;
    for b in 0..s.batch {
        for h in 0..s.heads {
            let hp = plan.head_plan(b, h);
            for qt in 0..plan.q_tiles {
                let (i0, i1) = plan.q_range(qt);
                for kt in 0..plan.kv_tiles {
                    let (j0, j1) = plan.kv_range(kt);
                    let mut n = 0;
                    for i in i0..i1 {
                        for j in j0..j1 {
                            n += mask.allowed(b, h, i, j) as usize;
                        }
                    }
                    let want = if n == 0 {
                        TileState::Empty
                    } else if n == (i1 - i0) * (j1 - j0) {
                        TileState::Full
                    } else {
                        TileState::Partial
                    };
                    prop_assert_eq!(
                        hp.state(qt, kt),
                        want,
                        "b={} h={} tile ({}, {})",
                        b,
                        h,
                        qt,
                        kt
                    );
                    if want == TileState::Partial {
                        let row = hp.row(qt);
                        let e = row[row.binary_search_by_key(&(kt as u32), |e| e.tile).unwrap()];
                        for r in 0..t.q {
                            for c in 0..t.kv {
                                let (i, j) = (i0 + r, j0 + c);
                                let want = i < i1 && j < j1 && mask.allowed(b, h, i, j);
                                prop_assert_eq!(plan.partials.allowed(e.mask, r, c), want);
                            }
                        }
                    }
                }
            }
            // Backward list is the exact transpose of the forward list.
            let mut fwd: Vec<(u32, u32, u32)> = Vec::new();
            for qt in 0..plan.q_tiles {
                fwd.extend(hp.row(qt).iter().map(|e| (qt as u32, e.tile, e.mask)));
            }
            let mut bwd: Vec<(u32, u32, u32)> = Vec::new();
            for kt in 0..plan.kv_tiles {
                let col = hp.col(kt);
                prop_assert!(col.windows(2).all(|w| w[0].tile < w[1].tile));
                bwd.extend(col.iter().map(|e| (e.tile, kt as u32, e.mask)));
            }
            fwd.sort_unstable();
            bwd.sort_unstable();
            prop_assert_eq!(fwd, bwd);
        }
    }
    // Partial masks are deduplicated by content.
    let n = plan.partials.len();
    let mut seen = std::collections::HashSet::new();
    for id in 0..n {
        prop_assert!(
            seen.insert(plan.partials.get(id as u32).to_vec()),
            "duplicate partial mask"
        );
    }
    check_tile_states(mask, plan)
}

/// The plan of tile states only equals `plan` but for its masks: the same work lists (partial
/// entries with id 0), counts and allowed pairs, no table, and refused by the consistency check
/// (what every bitmask reader runs) exactly when it has partial tiles.
fn check_tile_states(mask: &Mask, plan: &Plan) -> Result<(), TestCaseError> {
    let states = build_tile_states(mask, plan.shape, plan.tile).unwrap();
    let unmasked = |l: &[tessera_plan::TileEntry]| -> Vec<(u32, bool)> {
        l.iter().map(|e| (e.tile, e.is_full())).collect()
    };
    prop_assert_eq!(states.head_plans.len(), plan.head_plans.len());
    prop_assert_eq!(&states.group_plan, &plan.group_plan);
    for (a, b) in states.head_plans.iter().zip(&plan.head_plans) {
        prop_assert_eq!(&a.fwd_offsets, &b.fwd_offsets);
        prop_assert_eq!(&a.bwd_offsets, &b.bwd_offsets);
        prop_assert_eq!(unmasked(&a.fwd), unmasked(&b.fwd));
        prop_assert_eq!(unmasked(&a.bwd), unmasked(&b.bwd));
        prop_assert!(a
            .fwd
            .iter()
            .chain(&a.bwd)
            .all(|e| e.is_full() || e.mask == 0));
        prop_assert_eq!(
            (a.full_tiles, a.partial_tiles, a.allowed_pairs),
            (b.full_tiles, b.partial_tiles, b.allowed_pairs)
        );
    }
    prop_assert!(states.partials.is_empty());
    prop_assert_eq!(states.stats.allowed_pairs, plan.stats.allowed_pairs);
    let partial = plan.stats.partial_tiles > 0;
    prop_assert_eq!(states.has_masks(), !partial);
    prop_assert_eq!(states.check_consistent().is_err(), partial);
    // Within a budget: the whole plan exactly when its table fits, else the tile states.
    let table = plan.partials.data.len() * 8;
    for limit in [0, table / 2, table.saturating_sub(1), table, 1 << 40] {
        let w = build_plan_within(mask, plan.shape, plan.tile, limit).unwrap();
        let want = if table <= limit { plan } else { &states };
        prop_assert_eq!(&w.head_plans, &want.head_plans, "within {}", limit);
        prop_assert_eq!(&w.partials, &want.partials, "within {}", limit);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(160), ..ProptestConfig::default() })]

    #[test]
    fn plan_matches_brute_force(
        seed in any::<u64>(),
        lq in 1usize..600,
        lkv_same in any::<bool>(),
        lkv in 1usize..600,
        tq in 4u32..8,
        tk in 4u32..8,
        b in 1usize..4,
        h in 1usize..4,
        depth in 0usize..4,
    ) {
        let lkv = if lkv_same { lq } else { lkv };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mask = Gen { rng: &mut rng, b, h, lq, lkv }.tree(depth);
        plan_and_check(&mask, (b, h, lq, lkv), TileShape::new(1 << tq, 1 << tk).unwrap())?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(160), ..ProptestConfig::default() })]

    /// A band leaf in every position: alone, under `&`, `|` and `!` with random trees of the
    /// other leaves, and as one head of `heads(...)`.
    #[test]
    fn band_in_combinations_matches_brute_force(
        seed in any::<u64>(),
        lq in 1usize..400,
        lkv_same in any::<bool>(),
        lkv in 1usize..400,
        tq in 4u32..7,
        tk in 4u32..7,
        b in 1usize..3,
        h in 1usize..3,
        how in 0usize..6,
    ) {
        let lkv = if lkv_same { lq } else { lkv };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut g = Gen { rng: &mut rng, b, h, lq, lkv };
        let band = g.band();
        let mask = match how {
            0 => band,
            1 => band & g.tree(2),
            2 => g.tree(2) | band,
            3 => !band & g.tree(1),
            4 => !(band | g.tree(1)),
            _ => {
                let m = band & g.leaf();
                g.one_head_of(m)
            }
        };
        plan_and_check(&mask, (b, h, lq, lkv), TileShape::new(1 << tq, 1 << tk).unwrap())?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    /// Sound and complete on trees near the depth limit; one level more is refused.
    #[test]
    fn deep_trees_plan_like_brute_force(
        seed in any::<u64>(),
        lq in 1usize..90,
        lkv in 1usize..90,
        b in 1usize..3,
        h in 1usize..3,
        below in 0usize..8,
    ) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut g = Gen { rng: &mut rng, b, h, lq, lkv };
        let mask = g.deep(MAX_TREE_DEPTH - below);
        prop_assert!(mask.depth() <= MAX_TREE_DEPTH);
        let shape = PlanShape::new(b, h, lq, lkv).unwrap();
        let tile = TileShape::new(16, 32).unwrap();
        let plan = build_plan(&mask, shape, tile).unwrap();
        check(&mask, &plan)?;
        let too_deep = Mask::Not(Box::new(g.deep(MAX_TREE_DEPTH)));
        let e = build_plan(&too_deep, shape, tile).unwrap_err();
        prop_assert!(e.to_string().contains(&MAX_TREE_DEPTH.to_string()), "{}", e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(96), ..ProptestConfig::default() })]

    /// Block selections (duplicates, `-1` padding, rows of `-1` only) alone and intersected
    /// with causal / document / window, with the plan's tile equal to the blocks or not
    /// (smaller, larger, unaligned): states and partial bitmasks equal brute force.
    #[test]
    fn block_selections_plan_like_brute_force(
        seed in any::<u64>(),
        lq in 1usize..400,
        lkv_same in any::<bool>(),
        lkv in 1usize..400,
        tq in 4u32..7,
        tk in 4u32..7,
        b in 1usize..3,
        h in 1usize..4,
        blocks_are_tiles in any::<bool>(),
        with in 0usize..6,
    ) {
        let lkv = if lkv_same { lq } else { lkv };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let tile = TileShape::new(1 << tq, 1 << tk).unwrap();
        let (qb, kb) = if blocks_are_tiles {
            (tile.q, tile.kv)
        } else {
            let sizes = [8, 16, 24, 32, 48, 64, 100];
            (sizes[rng.gen_range(0..sizes.len())], sizes[rng.gen_range(0..sizes.len())])
        };
        let sel = random_blocks(&mut rng, b, h, lq, lkv, qb, kb);
        let other = match with {
            0 => Mask::full(),
            1 => Mask::causal(),
            2 => {
                let q = SegmentIds::new(1, lq, random_segments(&mut rng, 1, lq)).unwrap();
                let kv = SegmentIds::new(1, lkv, random_segments(&mut rng, 1, lkv)).unwrap();
                Mask::causal() & Mask::document(Segments::cross(q, kv).unwrap())
            }
            3 => Mask::window(rng.gen_range(0..80), rng.gen_range(0..10)),
            4 => Mask::causal() | random_blocks(&mut rng, b, h, lq, lkv, qb, kb),
            _ => !Mask::prefix(rng.gen_range(0..lkv as u64)),
        };
        let mask = sel & other;
        let plan = build_plan(&mask, PlanShape::new(b, h, lq, lkv).unwrap(), tile).unwrap();
        check(&mask, &plan)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(64), ..ProptestConfig::default() })]

    /// Unions of many operands (planned through the per-row index of their reaches): narrow
    /// document runs, every other leaf and small trees, alone and under `&`, `!` and `heads`.
    #[test]
    fn wide_unions_match_brute_force(
        seed in any::<u64>(),
        lq in 1usize..500,
        lkv_same in any::<bool>(),
        lkv in 1usize..500,
        tq in 4u32..7,
        tk in 4u32..7,
        b in 1usize..3,
        h in 1usize..3,
        n in 8usize..40,
        how in 0usize..4,
    ) {
        let lkv = if lkv_same { lq } else { lkv };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut g = Gen { rng: &mut rng, b, h, lq, lkv };
        let kids: Vec<Mask> = (0..n)
            .map(|_| match g.rng.gen_range(0..4) {
                // a run of one id on each side: a narrow document leaf
                0 => {
                    let (qa, ka) = (g.rng.gen_range(0..lq), g.rng.gen_range(0..lkv));
                    let (ql, kl) = (g.rng.gen_range(1..=24), g.rng.gen_range(1..=24));
                    let q: Vec<i64> = (0..lq).map(|i| if (qa..qa + ql).contains(&i) { 0 } else { -1 }).collect();
                    let kv: Vec<i64> = (0..lkv).map(|j| if (ka..ka + kl).contains(&j) { 0 } else { -1 }).collect();
                    let (q, kv) = (SegmentIds::shared(q).unwrap(), SegmentIds::shared(kv).unwrap());
                    Mask::document(Segments::cross(q, kv).unwrap())
                }
                1 => g.tree(1),
                _ => g.leaf(),
            })
            .collect();
        let union = Mask::Or(kids);
        let mask = match how {
            0 => union,
            1 => union & g.tree(1),
            2 => !union | g.leaf(),
            _ => {
                let m = union;
                g.one_head_of(m)
            }
        };
        plan_and_check(&mask, (b, h, lq, lkv), TileShape::new(1 << tq, 1 << tk).unwrap())?;
    }
}

/// With the plan's tile equal to the blocks, a selected tile is Full or empty under the block
/// leaf alone: only the other operands' partial tiles reach stage 2, and the plan visits the
/// selected tiles only (an unselected tile of the causal reach is never classified: its
/// state is Empty, and the plan's tile count equals the selected tiles under causal).
#[test]
fn block_selection_of_tiles_plans_the_selected_tiles() {
    let (lq, t) = (1000, 64);
    let tq = lq / t + 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut entries = Vec::new();
    let mut selected = 0;
    for r in 0..tq as i64 {
        let mut row: Vec<i64> = (0..=r).filter(|_| rng.gen_bool(0.3)).collect();
        row.push(r);
        row.dedup();
        selected += row.len();
        row.resize(tq + 1, -1);
        entries.extend(row);
    }
    let sel = BlockSelection::new(&[tq, tq + 1], &entries, t, t, "sel").unwrap();
    let mask = Mask::blocks(sel) & Mask::causal();
    let plan = build_plan(
        &mask,
        PlanShape::new(1, 1, lq, lq).unwrap(),
        TileShape::new(t, t).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (plan.stats.full_tiles + plan.stats.partial_tiles) as usize,
        selected
    );
    assert_eq!(plan.stats.partial_tiles as usize, tq);
    check(&mask, &plan).unwrap();
}

#[test]
fn block_selections_are_checked_against_the_shape() {
    let shape = PlanShape::new(2, 3, 100, 200).unwrap();
    let t = TileShape::new(32, 64).unwrap();
    let plan = |sel: BlockSelection| build_plan(&(Mask::blocks(sel) & Mask::causal()), shape, t);
    // Tq = ceil(100 / 32) = 4 query blocks, ceil(200 / 64) = 4 key blocks.
    let ok = BlockSelection::new(
        &[2, 1, 4, 2],
        &[0, 3, -1, -1, 1, 1, 2, -1, 0, 0, 0, 0, 3, 2, 1, 0],
        32,
        64,
        "kv_tiles",
    );
    assert!(plan(ok.unwrap()).is_ok());
    let e = plan(BlockSelection::new(&[1, 1, 4, 1], &[0, 4, 1, 2], 32, 64, "kv_tiles").unwrap())
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("kv_tiles: expected entries in [-1, 4)"),
        "{e}"
    );
    let e = plan(BlockSelection::new(&[1, 1, 3, 1], &[0, 1, 2], 32, 64, "kv_tiles").unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("4 query blocks"), "{e}");
    let e =
        plan(BlockSelection::new(&[1, 2, 4, 1], &[0; 8], 32, 64, "kv_tiles").unwrap()).unwrap_err();
    assert!(e.to_string().contains("1 or 3 heads"), "{e}");
    let e = plan(BlockSelection::new(&[3, 1, 4, 1], &[0; 12], 32, 64, "kv_tiles").unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("1 or 2 batch rows"), "{e}");
    for (shape, entries) in [
        (&[4, 1][..], &[0, -2, 0, 0][..]),
        (&[4, 2], &[0; 7]),
        (&[4][..], &[0; 4]),
    ] {
        let e = BlockSelection::new(shape, entries, 32, 64, "kv_tiles").unwrap_err();
        assert!(e.to_string().starts_with("kv_tiles: "), "{e}");
    }
    let e = BlockSelection::new(&[4, 1], &[0; 4], 0, 64, "kv_tiles").unwrap_err();
    assert!(e.to_string().contains("block sizes"), "{e}");
    // Order and repetition within a row do not change the selection or its contract.
    let a = BlockSelection::new(
        &[4, 3],
        &[2, 0, -1, 1, 1, 1, -1, -1, -1, 3, 0, 3],
        32,
        64,
        "a",
    )
    .unwrap();
    let b = BlockSelection::new(&[4, 2], &[0, 2, 1, -1, -1, -1, 0, 3], 32, 64, "b").unwrap();
    assert_eq!(a.digest(), b.digest());
    assert_eq!(Mask::blocks(a).canonical(), Mask::blocks(b).canonical());
}

#[test]
fn causal_has_one_unique_diagonal_tile() {
    let shape = PlanShape::new(1, 1, 4096, 4096).unwrap();
    let plan = build_plan(&Mask::causal(), shape, TileShape::default()).unwrap();
    assert_eq!(plan.partials.len(), 1);
    assert_eq!(plan.stats.partial_tiles, 32);
    assert_eq!(plan.stats.full_tiles, 32 * 31 / 2);
    assert_eq!(plan.stats.allowed_pairs, 4096 * 4097 / 2);
}

#[test]
fn identical_heads_share_a_plan_and_rows_differ_by_segments() {
    let ids: Vec<i64> = (0..3)
        .flat_map(|b| (0..300).map(move |i| (i / (50 + 20 * b)) as i64))
        .collect();
    let segs = Segments::shared(SegmentIds::new(3, 300, ids).unwrap());
    let mask = Mask::heads(vec![Mask::causal(), Mask::causal(), Mask::window(8, 0)])
        & Mask::document(segs);
    let plan = build_plan(
        &mask,
        PlanShape::new(3, 3, 300, 300).unwrap(),
        TileShape::new(32, 32).unwrap(),
    )
    .unwrap();
    assert_eq!((plan.batch_groups, plan.head_groups), (3, 3));
    assert_eq!(plan.head_plans.len(), 6);
    assert_eq!(plan.head_plan_index(1, 0), plan.head_plan_index(1, 1));
    assert_ne!(plan.head_plan_index(0, 0), plan.head_plan_index(1, 0));
    check(&mask, &plan).unwrap();
}

#[test]
fn structured_masks_do_not_allocate_quadratic_memory() {
    let l = 1 << 20;
    let ids: Vec<i64> = (0..l as i64).map(|i| i / 1000).collect();
    let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(ids).unwrap()));
    let plan = build_plan(
        &mask,
        PlanShape::new(1, 1, l, l).unwrap(),
        TileShape::default(),
    )
    .unwrap();
    // Active tiles are a thin band: the plan must be a few MB, not nq·nk.
    assert!(plan.stats.plan_bytes < 8 << 20, "{}", plan.stats.plan_bytes);
    assert!(plan.stats.tile_density < 0.01);
}

#[test]
fn mask_text_and_typed_forms_plan_identically() {
    let text =
        tessera_mask::parse("(causal & window(64)) | prefix(10)", &tessera_mask::NoData).unwrap();
    let typed = (Mask::causal() & Mask::window(64, 0)) | Mask::prefix(10);
    let shape = PlanShape::new(1, 1, 500, 500).unwrap();
    let a = build_plan(&text, shape, TileShape::new(32, 64).unwrap()).unwrap();
    let b = build_plan(&typed, shape, TileShape::new(32, 64).unwrap()).unwrap();
    assert_eq!(a.contract, b.contract);
    assert_eq!(a.states(), b.states());
}

#[test]
fn invalid_inputs_are_errors() {
    let t = TileShape::default();
    assert!(build_plan(
        &Mask::causal(),
        PlanShape {
            batch: 1,
            heads: 1,
            q_len: 0,
            kv_len: 4
        },
        t
    )
    .is_err());
    assert!(TileShape::new(24, 16).is_err());
    assert!(TileShape::new(8, 16).is_err());
    assert!(TileShape::parse("128x").is_err());
    assert!(build_plan(&Mask::chunk(0), PlanShape::new(1, 1, 4, 4).unwrap(), t).is_err());
    let segs = Segments::shared(SegmentIds::shared(vec![0; 10]).unwrap());
    let e = build_plan(
        &Mask::document(segs),
        PlanShape::new(1, 1, 12, 12).unwrap(),
        t,
    )
    .unwrap_err();
    assert!(e.to_string().contains("length 12"), "{e}");
    let d = DenseMask::new(&[4, 5], &[true; 20], "x.npy").unwrap();
    assert!(build_plan(&Mask::dense(d), PlanShape::new(1, 1, 4, 4).unwrap(), t).is_err());
    let e = build_plan(
        &Mask::heads(vec![Mask::causal()]),
        PlanShape::new(1, 2, 4, 4).unwrap(),
        t,
    )
    .unwrap_err();
    assert!(e.to_string().contains("2 expressions"), "{e}");
}

/// A feature that scatters inside tiles (stage 2 compares it key by key, in SIMD): shuffled small
/// values (narrowed to u32 per tile), shuffled values anywhere in i64 (not narrowed), clusters at
/// one or both ends of i64, short residues and frames (rows repeat values), or a random tree's
/// pre-order numbers.
fn scattered_feature(rng: &mut impl Rng, len: usize) -> Vec<i64> {
    let mut v: Vec<i64> = match rng.gen_range(0..7) {
        0 => (0..len).map(|_| rng.gen_range(-20..20)).collect(),
        1 => (0..len).map(|_| rng.gen()).collect(),
        2 => {
            let base = if rng.gen_bool(0.5) {
                i64::MIN
            } else {
                i64::MAX - 60
            };
            (0..len).map(|_| base + rng.gen_range(0..=60)).collect()
        }
        3 => (0..len)
            .map(|_| match rng.gen_range(0..3) {
                0 => i64::MIN + rng.gen_range(0..4),
                1 => i64::MAX - rng.gen_range(0..4),
                _ => rng.gen_range(-3..3),
            })
            .collect(),
        4 => {
            let d = rng.gen_range(2..12);
            (0..len as i64).map(|i| i % d).collect()
        }
        5 => {
            let (p, f) = (rng.gen_range(0..40), rng.gen_range(3..150));
            (0..len as i64).map(|i| (i - p).rem_euclid(f)).collect()
        }
        _ => {
            let prefix = rng.gen_range(0..=len.min(20));
            return tree::tree_features(rng, len, prefix).0;
        }
    };
    if rng.gen_bool(0.7) {
        v.shuffle(rng);
    }
    v
}

/// A leaf whose stage 2 works row by row: a band over scattered features (or a tree-causal
/// pair of bands), a document of scattered ids, or dense data.
fn scattered_leaf(rng: &mut impl Rng, lq: usize, lkv: usize) -> Mask {
    let band = |f: Vec<i64>, g: Vec<i64>, lo: i64, hi: i64| {
        let q = SegmentIds::new(1, f.len(), f).unwrap();
        let kv = SegmentIds::new(1, g.len(), g).unwrap();
        Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
    };
    match rng.gen_range(0..8) {
        6 | 7 => {
            // Bands sharing their query feature (fused into one interval per key), two or three,
            // with another operand sometimes.
            let f = scattered_feature(rng, lq);
            let mut m = Mask::full();
            for k in 0..rng.gen_range(2..4) {
                let (lo, hi) = random_bounds(rng, 40);
                let b = band(f.clone(), scattered_feature(rng, lkv), lo, hi);
                m = if k == 0 { b } else { m & b };
            }
            if rng.gen_bool(0.3) {
                m = m & Gen {
                    rng,
                    b: 1,
                    h: 1,
                    lq,
                    lkv,
                }
                .leaf();
            }
            m
        }
        0 | 1 => {
            let (f, g) = (scattered_feature(rng, lq), scattered_feature(rng, lkv));
            let (lo, hi) = if rng.gen_bool(0.6) {
                random_bounds(rng, 40)
            } else {
                // Bounds near the differences of extreme features.
                let pick = |rng: &mut _| -> i64 {
                    let r: &mut rand::rngs::StdRng = rng;
                    [i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX - 1, i64::MAX][r.gen_range(0..7)]
                };
                let mut r = rand::rngs::StdRng::seed_from_u64(rng.gen());
                let (a, b) = (pick(&mut r), pick(&mut r));
                (a.min(b), a.max(b))
            };
            band(f, g, lo, hi)
        }
        2 if lq == lkv => {
            let prefix = rng.gen_range(0..=lq.min(20));
            let (pre, end) = tree::tree_features(rng, lq, prefix);
            band(pre.clone(), pre.clone(), 0, i64::MAX) & band(pre, end, i64::MIN, -1)
        }
        2 | 3 => {
            let ids = |rng: &mut _, n: usize| -> Vec<i64> {
                let r: &mut rand::rngs::StdRng = rng;
                let k = r.gen_range(1..6);
                (0..n).map(|_| r.gen_range(-1..k)).collect()
            };
            let mut r = rand::rngs::StdRng::seed_from_u64(rng.gen());
            let q = SegmentIds::new(1, lq, ids(&mut r, lq)).unwrap();
            let kv = SegmentIds::new(1, lkv, ids(&mut r, lkv)).unwrap();
            Mask::document(Segments::cross(q, kv).unwrap())
        }
        _ => {
            let p: f64 = [0.05, 0.5, 0.95][rng.gen_range(0..3)];
            let vals: Vec<bool> = (0..lq * lkv).map(|_| rng.gen_bool(p)).collect();
            Mask::dense(DenseMask::new(&[lq, lkv], &vals, "rand").unwrap())
        }
    }
}

/// A tree of scattered leaves (and sometimes plain ones) under `&`, `|` and `!`.
fn scattered_tree(rng: &mut rand::rngs::StdRng, depth: usize, lq: usize, lkv: usize) -> Mask {
    if depth == 0 || rng.gen_bool(0.25) {
        return if rng.gen_bool(0.8) {
            scattered_leaf(rng, lq, lkv)
        } else {
            Gen {
                rng,
                b: 1,
                h: 1,
                lq,
                lkv,
            }
            .leaf()
        };
    }
    match rng.gen_range(0..3) {
        0 => scattered_tree(rng, depth - 1, lq, lkv) & scattered_tree(rng, depth - 1, lq, lkv),
        1 => scattered_tree(rng, depth - 1, lq, lkv) | scattered_tree(rng, depth - 1, lq, lkv),
        _ => !scattered_tree(rng, depth - 1, lq, lkv),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(64), ..ProptestConfig::default() })]

    /// Stage 2 by rows (SIMD row compares of scattered bands, documents of scattered ids, dense
    /// rows, features at the ends of i64, tree-causal band pairs) alone and under `&`, `|`, `!`,
    /// in tiles whose kv side spans one to four 64-bit words and ragged edges: states and
    /// partial bitmasks equal brute force. `TESSERA_PLAN_SIMD=avx2|scalar` runs the narrower
    /// paths.
    #[test]
    fn scattered_stage2_matches_brute_force(
        seed in any::<u64>(),
        lq in 1usize..520,
        lkv_same in any::<bool>(),
        lkv in 1usize..520,
        tq in 4u32..8,
        tk in 4u32..9,
        depth in 0usize..3,
    ) {
        let lkv = if lkv_same { lq } else { lkv };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mask = scattered_tree(&mut rng, depth, lq, lkv);
        plan_and_check(&mask, (1, 1, lq, lkv), TileShape::new(1 << tq, 1 << tk).unwrap())?;
    }
}
