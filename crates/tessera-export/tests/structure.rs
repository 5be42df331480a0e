//! Structural properties of both exports for random masks: decoding an export back to tile
//! states reproduces the plan's states (in the engines' padded-block convention, and exactly
//! once ragged-edge partial blocks are reclassified), partial blocks reproduce the token mask,
//! index lists follow torch's ordering, and the npz files round-trip.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tessera_export::{engine_states, flex, splash, FlexArrays, SplashArrays, SplashOptions};
use tessera_mask::{DenseMask, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

struct Gen<'a> {
    rng: &'a mut ChaCha8Rng,
    b: usize,
    h: usize,
    lq: usize,
    lkv: usize,
}

fn segments(rng: &mut ChaCha8Rng, rows: usize, len: usize) -> Vec<i64> {
    let mut v = Vec::with_capacity(rows * len);
    for _ in 0..rows {
        let mut id = 0i64;
        let mut left = 0usize;
        for _ in 0..len {
            if left == 0 {
                left = rng.gen_range(1..=len.clamp(1, 120));
                id += 1;
            }
            left -= 1;
            v.push(if rng.gen_bool(0.05) { -1 } else { id });
        }
    }
    v
}

impl Gen<'_> {
    fn leaf(&mut self) -> Mask {
        let lmax = self.lq.max(self.lkv) as i64;
        match self.rng.gen_range(0..8) {
            0 => Mask::causal_offset(self.rng.gen_range(-lmax / 4..=lmax / 4)),
            1 => Mask::causal(),
            2 => Mask::window(
                self.rng.gen_range(0..=lmax / 2),
                self.rng.gen_range(0..=lmax / 8),
            ),
            3 => Mask::chunk(self.rng.gen_range(1..=lmax as u64)),
            4 => Mask::prefix(self.rng.gen_range(0..=self.lkv as u64)),
            5 | 6 => {
                let rows = if self.b > 1 && self.rng.gen_bool(0.5) {
                    self.b
                } else {
                    1
                };
                let q = SegmentIds::new(rows, self.lq, segments(self.rng, rows, self.lq)).unwrap();
                if self.lq == self.lkv && self.rng.gen_bool(0.7) {
                    Mask::document(Segments::shared(q))
                } else {
                    let kv = SegmentIds::new(rows, self.lkv, segments(self.rng, rows, self.lkv))
                        .unwrap();
                    Mask::document(Segments::cross(q, kv).unwrap())
                }
            }
            _ => {
                let shape = match self.rng.gen_range(0..3) {
                    0 => vec![self.lq, self.lkv],
                    1 => vec![self.h, self.lq, self.lkv],
                    _ => vec![self.b, self.h, self.lq, self.lkv],
                };
                let n: usize = shape.iter().product();
                let p = self.rng.gen_range(0.0..1.0);
                // Blocky content so that full and empty tiles occur too.
                let blk = 1usize << self.rng.gen_range(3..7);
                let seeds: Vec<f64> = (0..n.div_ceil(blk * blk) + self.lq + self.lkv)
                    .map(|_| self.rng.gen_range(0.0..1.0))
                    .collect();
                let lkv = self.lkv;
                let vals: Vec<bool> = (0..n)
                    .map(|k| {
                        let (i, j) = ((k / lkv) % self.lq, k % lkv);
                        let s =
                            seeds[(i / blk * 7 + j / blk * 13 + k / (self.lq * lkv)) % seeds.len()];
                        if s < 0.3 {
                            false
                        } else if s < 0.6 {
                            true
                        } else {
                            self.rng.gen_bool(p)
                        }
                    })
                    .collect();
                Mask::dense(DenseMask::new(&shape, &vals, "rand").unwrap())
            }
        }
    }

    fn tree(&mut self, depth: usize) -> Mask {
        if depth == 0 || self.rng.gen_bool(0.35) {
            return self.leaf();
        }
        match self.rng.gen_range(0..5) {
            0 | 1 => self.tree(depth - 1) & self.tree(depth - 1),
            2 | 3 => self.tree(depth - 1) | self.tree(depth - 1),
            _ => !self.tree(depth - 1),
        }
    }

    fn mask(&mut self) -> Mask {
        if self.h > 1 && self.rng.gen_bool(0.25) {
            let mut v: Vec<Mask> = (0..self.h).map(|_| self.tree(2)).collect();
            if self.rng.gen_bool(0.5) {
                v[self.h - 1] = v[0].clone();
            }
            Mask::heads(v)
        } else {
            self.tree(3)
        }
    }
}

struct Case {
    mask: Mask,
    plan: Plan,
}

fn random_case(seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let b = rng.gen_range(1..=2);
    let h = rng.gen_range(1..=3);
    let tq = 16 << rng.gen_range(0..3);
    let tk = 16 << rng.gen_range(0..3);
    // A third of the lengths are whole multiples of the tile (no ragged edge).
    let lq = if rng.gen_bool(0.33) {
        tq * rng.gen_range(1..=6)
    } else {
        rng.gen_range(1..=260)
    };
    let lkv = if rng.gen_bool(0.5) {
        lq
    } else if rng.gen_bool(0.33) {
        tk * rng.gen_range(1..=6)
    } else {
        rng.gen_range(1..=260)
    };
    let mask = Gen {
        rng: &mut rng,
        b,
        h,
        lq,
        lkv,
    }
    .mask();
    let plan = build_plan(
        &mask,
        PlanShape::new(b, h, lq, lkv).unwrap(),
        TileShape::new(tq, tk).unwrap(),
    )
    .unwrap();
    Case { mask, plan }
}

/// Engine states `[B', H', nq, nk]` broadcast over heads to `[B', H, nq, nk]`.
fn engine_states_per_head(plan: &Plan) -> Vec<i8> {
    let ([bg, hg, nq, nk], s) = engine_states(plan);
    let h = plan.shape.heads;
    let mut out = Vec::with_capacity(bg * h * nq * nk);
    for b in 0..bg {
        for hh in 0..h {
            let g = b * hg + if hg == 1 { 0 } else { hh };
            out.extend_from_slice(&s[g * nq * nk..(g + 1) * nq * nk]);
        }
    }
    out
}

fn check_engine_states(plan: &Plan) {
    let (shape, exact) = plan.states();
    let (shape2, eng) = engine_states(plan);
    assert_eq!(shape, shape2);
    let [_, _, nq, nk] = shape;
    let rq = plan.shape.q_len % plan.tile.q != 0;
    let rk = plan.shape.kv_len % plan.tile.kv != 0;
    for (k, (&a, &e)) in exact.iter().zip(&eng).enumerate() {
        let (qt, kt) = ((k / nk) % nq, k % nk);
        let edge = (rq && qt == nq - 1) || (rk && kt == nk - 1);
        if a == e {
            continue;
        }
        assert!(
            edge && a == 2 && e == 1,
            "engine state {e} vs plan {a} at tile ({qt}, {kt})"
        );
    }
}

fn check_splash(case: &Case, arrays: &SplashArrays) {
    let plan = &case.plan;
    let (nq, nk) = (plan.q_tiles, plan.kv_tiles);
    let (tq, tk) = (plan.tile.q, plan.tile.kv);
    let (pq, pk) = arrays.padded_lengths;
    assert_eq!((pq, pk), (nq * tq, nk * tk));
    let want = engine_states_per_head(plan);
    let (exact_shape, exact) = plan.states();
    for dkv in [false, true] {
        let grid = arrays.decode(dkv).unwrap();
        assert_eq!(grid.shape, [plan.batch_groups, plan.shape.heads, nq, nk]);
        assert_eq!(
            grid.states, want,
            "splash decode (dkv={dkv}) != engine states"
        );
        for b in 0..plan.batch_groups {
            for h in 0..plan.shape.heads {
                // Token level over the padded sequences: padding never attends or is attended.
                for i in 0..pq {
                    for j in 0..pk {
                        let truth = i < plan.shape.q_len
                            && j < plan.shape.kv_len
                            && case.mask.allowed(b, h, i, j);
                        assert_eq!(
                            arrays.allowed(&grid, dkv, b, h, i, j),
                            truth,
                            "splash token ({i}, {j}) b={b} h={h} dkv={dkv}"
                        );
                    }
                }
                // Exact states: a partial block whose in-range pairs are all allowed is Full.
                let hg = if exact_shape[1] == 1 { 0 } else { h };
                for qt in 0..nq {
                    for kt in 0..nk {
                        let cell = ((b * plan.shape.heads + h) * nq + qt) * nk + kt;
                        let mut s = grid.states[cell];
                        if s == 1 {
                            let (q0, q1) = plan.q_range(qt);
                            let (k0, k1) = plan.kv_range(kt);
                            let all = (q0..q1)
                                .all(|i| (k0..k1).all(|j| arrays.allowed(&grid, dkv, b, h, i, j)));
                            if all {
                                s = 2;
                            }
                        }
                        let g = b * exact_shape[1] + hg;
                        assert_eq!(
                            s,
                            exact[(g * nq + qt) * nk + kt],
                            "exact state ({qt}, {kt})"
                        );
                    }
                }
            }
        }
    }
    for row in &arrays.rows {
        for info in [&row.fwd, &row.dkv] {
            let n = info.partial_mask_blocks.as_ref().map_or(0, |p| p.shape[0]);
            assert_eq!(info.mask_next.is_some(), n > 0);
            // Partial blocks are unique.
            if let Some(p) = &info.partial_mask_blocks {
                let sz = p.shape[1] * p.shape[2];
                let mut seen = std::collections::HashSet::new();
                for k in 0..n {
                    assert!(
                        seen.insert(&p.data[k * sz..(k + 1) * sz]),
                        "duplicate partial block"
                    );
                }
            }
        }
    }
}

fn check_flex(case: &Case, a: &FlexArrays) {
    let plan = &case.plan;
    let (shape, want) = engine_states(plan);
    let [bg, hg, nq, nk] = shape;
    assert_eq!(a.groups, (bg, hg));
    assert_eq!(a.blocks, (nq, nk));
    assert_eq!(a.decode_states(false).unwrap(), want, "flex kv-side decode");
    assert_eq!(a.decode_states(true).unwrap(), want, "flex q-side decode");
    // torch ordering: listed blocks ascending, then all other blocks ascending.
    let rows = [
        (&a.kv_num_blocks, &a.kv_indices, nk),
        (&a.full_kv_num_blocks, &a.full_kv_indices, nk),
        (&a.q_num_blocks, &a.q_indices, nq),
        (&a.full_q_num_blocks, &a.full_q_indices, nq),
    ];
    for (num, idx, w) in rows {
        for (r, &n) in num.iter().enumerate() {
            let row = &idx[r * w..(r + 1) * w];
            let n = n as usize;
            assert!(row[..n].windows(2).all(|p| p[0] < p[1]));
            assert!(row[n..].windows(2).all(|p| p[0] < p[1]));
            let mut sorted = row.to_vec();
            sorted.sort_unstable();
            assert!(
                sorted.iter().enumerate().all(|(k, &v)| v == k as i32),
                "row is not a permutation"
            );
        }
    }
    // The mask_* additions reproduce the token mask (what the documented mask_mod returns).
    assert_eq!(a.mask_tile_states, want);
    let (tq, tk) = a.block_size;
    for b in 0..bg {
        for h in 0..hg {
            for i in 0..nq * tq {
                for j in 0..nk * tk {
                    let truth = i < plan.shape.q_len
                        && j < plan.shape.kv_len
                        && case.mask.allowed(b, h, i, j);
                    assert_eq!(
                        a.allowed(b, h, i, j),
                        truth,
                        "flex mask_mod token ({i}, {j}) b={b} h={h}"
                    );
                }
            }
        }
    }
    let sz = tq * tk;
    let blocks: std::collections::HashSet<&[bool]> = a.mask_blocks.chunks(sz).collect();
    assert_eq!(blocks.len(), a.num_mask_blocks(), "duplicate mask block");
}

#[test]
fn random_masks_roundtrip_both_exports() {
    let dir = tempfile::tempdir().unwrap();
    let mut shards_tested = 0;
    // Coverage counters: partial tiles, ragged edges, per-row plans, several head masks.
    let (mut partial, mut ragged, mut per_row, mut per_head) = (0, 0, 0, 0);
    for seed in 0..120u64 {
        let case = random_case(seed);
        let plan = &case.plan;
        check_engine_states(plan);
        partial += (plan.stats.partial_tiles > 0) as usize;
        ragged +=
            (plan.shape.q_len % plan.tile.q != 0 || plan.shape.kv_len % plan.tile.kv != 0) as usize;
        per_row += (plan.batch_groups > 1) as usize;
        per_head += (plan.head_plans.len() > plan.batch_groups) as usize;

        let s = match splash::export(plan) {
            Ok(s) => s,
            Err(e) => {
                // Only a mask without any allowed pair cannot be shrunk (JAX asserts too).
                assert_eq!(plan.stats.allowed_pairs, 0, "seed {seed}: {e}");
                let o = SplashOptions {
                    shrink_grid: false,
                    shrink_grid_dkv: false,
                    ..SplashOptions::default()
                };
                splash::export_with(plan, &o).unwrap()
            }
        };
        check_splash(&case, &s);
        let path = dir.path().join(format!("s{seed}.npz"));
        s.write_npz(&path).unwrap();
        assert_eq!(
            SplashArrays::read_npz(&path).unwrap(),
            s,
            "splash npz round trip"
        );

        // Non-default process_mask options where they apply.
        let hs = if plan.shape.heads % 2 == 0 { 2 } else { 1 };
        let qs = if plan.q_tiles % 2 == 0 { 2 } else { 1 };
        let o = SplashOptions {
            head_shards: hs,
            q_seq_shards: qs,
            shrink_grid: seed % 3 != 0,
            shrink_grid_dkv: seed % 2 == 0,
            downcast_smem_data: seed % 5 != 0,
        };
        match splash::export_with(plan, &o) {
            Ok(s2) => {
                check_splash(&case, &s2);
                shards_tested += 1;
            }
            // Shrinking a q shard without any active block is an error in JAX too.
            Err(e) => assert!(
                e.to_string().contains("no active block"),
                "seed {seed}: {e}"
            ),
        }

        let f = flex::export(plan).unwrap();
        check_flex(&case, &f);
        let path = dir.path().join(format!("f{seed}.npz"));
        f.write_npz(&path).unwrap();
        assert_eq!(
            FlexArrays::read_npz(&path).unwrap(),
            f,
            "flex npz round trip"
        );
    }
    eprintln!("coverage: shards {shards_tested} partial {partial} ragged {ragged} per_row {per_row} per_head {per_head}");
    assert!(shards_tested > 60, "{shards_tested}");
    assert!(
        partial > 60 && ragged > 40 && ragged < 110 && per_row > 10 && per_head > 10,
        "coverage {partial} {ragged} {per_row} {per_head}"
    );
}

#[test]
fn export_npz_writes_both_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let ids = SegmentIds::shared((0..300).map(|i| i / 70).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(ids));
    let plan = build_plan(
        &mask,
        PlanShape::new(1, 2, 300, 300).unwrap(),
        TileShape::new(64, 64).unwrap(),
    )
    .unwrap();
    for kind in ["splash", "flex"] {
        let path = dir.path().join(format!("{kind}.npz"));
        tessera_export::export_npz(&plan, kind.parse().unwrap(), &path).unwrap();
        let names: Vec<String> = tessera_export::npz::read_npz(&path)
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(names.contains(&if kind == "splash" {
            "block_mask_dkv".into()
        } else {
            "full_q_indices".to_string()
        }));
    }
    // Only the target exists afterwards: no temporary files are left behind.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!("tpu".parse::<tessera_export::ExportKind>().is_err());
}

#[test]
fn bad_options_and_empty_masks() {
    let plan = build_plan(
        &Mask::causal(),
        PlanShape::new(1, 3, 256, 256).unwrap(),
        TileShape::new(64, 64).unwrap(),
    )
    .unwrap();
    let o = |hs, qs| SplashOptions {
        head_shards: hs,
        q_seq_shards: qs,
        ..SplashOptions::default()
    };
    assert!(splash::export_with(&plan, &o(2, 1))
        .unwrap_err()
        .to_string()
        .contains("head_shards"));
    assert!(splash::export_with(&plan, &o(1, 3))
        .unwrap_err()
        .to_string()
        .contains("q_seq_shards"));
    assert!(splash::export_with(&plan, &o(3, 4)).is_ok());

    // A mask with no allowed pair: process_mask's shrunk grid would be empty (AssertionError
    // in JAX); without shrinking it is all zeros.
    let empty = Mask::prefix(0);
    let plan = build_plan(
        &empty,
        PlanShape::new(1, 1, 100, 100).unwrap(),
        TileShape::new(32, 32).unwrap(),
    )
    .unwrap();
    assert!(splash::export(&plan).is_err());
    let s = splash::export_with(
        &plan,
        &SplashOptions {
            shrink_grid: false,
            shrink_grid_dkv: false,
            ..SplashOptions::default()
        },
    )
    .unwrap();
    assert!(s.rows[0].fwd.block_mask.data.iter().all(|&v| v == 0));
    assert!(s.rows[0].fwd.mask_next.is_none() && s.rows[0].fwd.partial_mask_blocks.is_none());
    let f = flex::export(&plan).unwrap();
    assert!(f
        .kv_num_blocks
        .iter()
        .chain(&f.full_kv_num_blocks)
        .all(|&n| n == 0));
    assert_eq!(&f.kv_indices[..4], &[0, 1, 2, 3]);
}

#[test]
fn shared_document_segments_arc() {
    // Segments shared by Arc across two leaves still export identically to one leaf.
    let ids = Arc::new(SegmentIds::shared((0..200).map(|i| i / 50).collect()).unwrap());
    let seg = Segments::shared((*ids).clone());
    let a = Mask::document(seg.clone()) & Mask::causal();
    let b = Mask::document(seg.clone()) & Mask::causal() & Mask::document(seg);
    let shape = PlanShape::new(1, 1, 200, 200).unwrap();
    let tile = TileShape::new(32, 32).unwrap();
    let pa = build_plan(&a, shape, tile).unwrap();
    let pb = build_plan(&b, shape, tile).unwrap();
    assert_eq!(splash::export(&pa).unwrap(), splash::export(&pb).unwrap());
    assert_eq!(flex::export(&pa).unwrap(), flex::export(&pb).unwrap());
}

/// The compact export lists exactly the non-empty tiles of the packed export, with the same
/// codes (1 full, 2 + block id) and the same bit blocks, in ascending cell order.
#[test]
fn compact_export_matches_the_packed_tables() {
    for seed in 0..120u64 {
        let case = random_case(seed);
        let (a, bits) = flex::export_packed(&case.plan).unwrap();
        let (c, cbits) = flex::export_compact(&case.plan).unwrap();
        assert_eq!(bits, cbits, "seed {seed}");
        assert_eq!(
            (c.groups, c.blocks, c.block_size, c.shape),
            (a.groups, a.blocks, a.block_size, a.shape)
        );
        let mut cells = Vec::new();
        let mut codes = Vec::new();
        for (i, (&st, &id)) in a.mask_tile_states.iter().zip(&a.mask_block_ids).enumerate() {
            if st != 0 {
                cells.push(i as i32);
                codes.push(if st == 2 { 1 } else { id + 2 });
            }
        }
        assert_eq!(c.cells, cells, "seed {seed}");
        assert_eq!(c.codes, codes, "seed {seed}");
    }
}
