//! `band` plans: `causal`, `window` and `document` are special cases of `band` (their plans equal
//! the band's, state for state and bit for bit), a band over positions stays O(active tiles) at
//! a million tokens, and bad bounds are refused before anything is planned.

use rand::{Rng, SeedableRng};
use tessera_mask::{BandFeatures, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

fn band(q: Vec<i64>, kv: Vec<i64>, rows: usize, lo: i64, hi: i64) -> Mask {
    let (lq, lkv) = (q.len() / rows, kv.len() / rows);
    let q = SegmentIds::new(rows, lq, q).unwrap();
    let kv = SegmentIds::new(rows, lkv, kv).unwrap();
    Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
}

fn positions(len: usize) -> Vec<i64> {
    (0..len as i64).collect()
}

/// Two plans of the same problem allow the same pairs with the same tile states and the same
/// number of distinct partial bitmasks.
fn same_plan(a: &Plan, b: &Plan, what: &str) {
    assert_eq!(a.states(), b.states(), "{what}: tile states");
    assert_eq!(a.stats.allowed_pairs, b.stats.allowed_pairs, "{what}");
    assert_eq!(
        a.stats.unique_partial_masks, b.stats.unique_partial_masks,
        "{what}"
    );
    let s = a.shape;
    for bb in 0..s.batch {
        for i in 0..s.q_len {
            for j in 0..s.kv_len {
                assert_eq!(
                    a.allowed(bb, 0, i, j),
                    b.allowed(bb, 0, i, j),
                    "{what}: ({i}, {j})"
                );
            }
        }
    }
}

const SHAPES: &[(usize, usize, usize, usize)] = &[
    (300, 300, 32, 32),
    (257, 300, 64, 16),
    (300, 190, 16, 128),
    (1, 77, 16, 16),
    (128, 128, 128, 128),
];

#[test]
fn causal_is_band_over_positions_from_zero_up() {
    for &(lq, lkv, tq, tk) in SHAPES {
        let shape = PlanShape::new(1, 1, lq, lkv).unwrap();
        let tile = TileShape::new(tq, tk).unwrap();
        for off in [0i64, 5, -17, 400, -400] {
            let c = build_plan(&Mask::causal_offset(off), shape, tile).unwrap();
            // Any hi >= the largest i - j (Lq - 1) gives causal.
            for hi in [i64::MAX, 1 << 40, (lq as i64 - 1).max(-off)] {
                let b = band(positions(lq), positions(lkv), 1, -off, hi);
                let p = build_plan(&b, shape, tile).unwrap();
                same_plan(&c, &p, &format!("causal({off}) {lq}x{lkv} hi={hi}"));
            }
        }
    }
}

#[test]
fn window_is_band_over_positions() {
    for &(lq, lkv, tq, tk) in SHAPES {
        let shape = PlanShape::new(1, 1, lq, lkv).unwrap();
        let tile = TileShape::new(tq, tk).unwrap();
        for (l, r) in [(0, 0), (10, 0), (40, 7), (3, 90), (-5, 20), (1000, 1000)] {
            let w = build_plan(&Mask::window(l, r), shape, tile).unwrap();
            let b = band(positions(lq), positions(lkv), 1, -r, l);
            let p = build_plan(&b, shape, tile).unwrap();
            same_plan(&w, &p, &format!("window({l}, {r}) {lq}x{lkv}"));
        }
    }
}

#[test]
fn document_is_band_zero_zero_on_non_negative_ids() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for &(lq, lkv, tq, tk) in SHAPES {
        let rows = 2;
        let mut ids = |len: usize| -> Vec<i64> {
            (0..rows)
                .flat_map(|_| {
                    let mut v = Vec::with_capacity(len);
                    let mut id = rng.gen_range(0..3);
                    while v.len() < len {
                        let run = rng.gen_range(1..=40).min(len - v.len());
                        v.extend(std::iter::repeat_n(id, run));
                        id += rng.gen_range(1..3);
                    }
                    v
                })
                .collect()
        };
        let (q, kv) = (ids(lq), ids(lkv));
        let doc = Mask::document(
            Segments::cross(
                SegmentIds::new(rows, lq, q.clone()).unwrap(),
                SegmentIds::new(rows, lkv, kv.clone()).unwrap(),
            )
            .unwrap(),
        );
        let shape = PlanShape::new(rows, 1, lq, lkv).unwrap();
        let tile = TileShape::new(tq, tk).unwrap();
        let d = build_plan(&doc, shape, tile).unwrap();
        let p = build_plan(&band(q, kv, rows, 0, 0), shape, tile).unwrap();
        same_plan(&d, &p, &format!("document {lq}x{lkv}"));
        assert_eq!(p.batch_groups, 2);
    }
}

#[test]
fn a_band_over_a_million_positions_plans_only_its_active_tiles() {
    let l = 1 << 20;
    let pos = positions(l);
    let mask = band(pos.clone(), pos, 1, 0, 4000);
    let shape = PlanShape::new(1, 1, l, l).unwrap();
    let t = std::time::Instant::now();
    let plan = build_plan(&mask, shape, TileShape::default()).unwrap();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let w = build_plan(&Mask::window(4000, 0), shape, TileShape::default()).unwrap();
    assert_eq!(plan.states(), w.states());
    assert!(plan.stats.plan_bytes < 8 << 20, "{}", plan.stats.plan_bytes);
    assert!(plan.stats.tile_density < 0.01);
    println!(
        "band over 2^20 positions: {ms:.1} ms (window: {:.1} ms)",
        w.stats.build_ms
    );
}

#[test]
fn bad_bounds_and_lengths_are_refused_before_planning() {
    let t = TileShape::new(16, 16).unwrap();
    let shape = PlanShape::new(1, 1, 10, 10).unwrap();
    let e = build_plan(&band(positions(10), positions(10), 1, 3, 2), shape, t).unwrap_err();
    assert!(e.to_string().starts_with("lo of band(f, g, 3, 2)"), "{e}");
    let e = build_plan(&band(positions(9), positions(10), 1, 0, 2), shape, t).unwrap_err();
    assert!(e.to_string().starts_with("q_feature of band"), "{e}");
    let e = build_plan(&band(positions(10), positions(11), 1, 0, 2), shape, t).unwrap_err();
    assert!(e.to_string().starts_with("kv_feature of band"), "{e}");
}
