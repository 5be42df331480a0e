//! `Plan::check_consistent` refuses what a forged or corrupted plan can get wrong (the plan
//! cache runs it on every decoded entry, the kernels on every plan).

use tessera_mask::Mask;
use tessera_plan::{build_plan, Plan, PlanShape, TileEntry, TileShape};

fn plan() -> Plan {
    // Ragged on both sides (100 = 3·32 + 4, 90 = 64 + 26), with partial edge tiles.
    let mask = Mask::causal() & Mask::window(40, 3);
    build_plan(
        &mask,
        PlanShape::new(1, 1, 100, 90).unwrap(),
        TileShape::new(32, 64).unwrap(),
    )
    .unwrap()
}

#[test]
fn built_plans_are_consistent() {
    plan().check_consistent().unwrap();
}

/// Found by fuzzing the cache decoder: bits set outside a ragged edge tile's in-range pairs
/// made the CPU kernel read past the keys ("gemm: B too short").
#[test]
fn bits_outside_a_ragged_tile_are_refused() {
    let p = plan();
    let hp = &p.head_plans[0];
    let last = p.q_tiles - 1;
    let e = hp
        .row(last)
        .iter()
        .find(|e| !e.is_full())
        .copied()
        .expect("a partial edge tile");
    let mut bad = p.clone();
    let w = bad.partials.words_per_row;
    let base = e.mask as usize * bad.partials.mask_words();
    bad.partials.data[base + (bad.tile.q - 1) * w] |= 1; // a row past Lq
    let err = bad.check_consistent().unwrap_err().to_string();
    assert!(err.contains("bits outside"), "{err}");
    // Bits past the tile's own columns in the last word.
    let mut t16 = build_plan(
        &Mask::causal(),
        PlanShape::new(1, 1, 64, 64).unwrap(),
        TileShape::new(16, 16).unwrap(),
    )
    .unwrap();
    t16.partials.data[0] |= 1 << 40;
    assert!(t16.check_consistent().is_err());
}

#[test]
fn lists_that_disagree_are_refused() {
    let p = plan();
    let mut bad = p.clone();
    bad.head_plans[0].bwd.reverse();
    assert!(bad.check_consistent().is_err());
    let mut bad = p.clone();
    bad.head_plans[0].full_tiles += 1;
    assert!(bad.check_consistent().is_err());
    let mut bad = p.clone();
    bad.head_plans[0].fwd[0] = TileEntry {
        tile: 0,
        mask: 9999,
    };
    assert!(bad.check_consistent().is_err());
    let mut bad = p;
    bad.tile = TileShape { q: 0, kv: 64 };
    assert!(bad.check_consistent().is_err());
}
