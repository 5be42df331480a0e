//! Context-parallel sharding: every scheme deals each tile once in equal counts, the local plans
//! are exactly the global mask on the rank's rows and K/V layout, the needed lists are what the
//! rows touch, balanced beats zigzag on packed documents, and bad inputs are clear errors.

use proptest::prelude::*;
use std::time::Instant;
use tessera_mask::{DenseMask, Mask, SegmentIds, Segments};
use tessera_plan::cp_sim::{doc_causal_plan, doc_mix, simulate_plan, DocMix, SimModel};
use tessera_plan::{build_plan, shard, CostModel, KvLayout, Plan, PlanShape, Scheme, TileShape};

fn docs(len: usize, lens: &[usize]) -> Mask {
    let mut ids = Vec::new();
    for (d, &n) in lens.iter().cycle().enumerate() {
        if ids.len() >= len {
            break;
        }
        ids.extend(std::iter::repeat_n(d as i64, n.min(len - ids.len())));
    }
    // a padding tail
    for x in ids.iter_mut().skip(len - len / 10) {
        *x = -1;
    }
    Mask::document(Segments::shared(SegmentIds::shared(ids).unwrap()))
}

fn plan(mask: &Mask, b: usize, h: usize, len: usize, tile: usize) -> Plan {
    build_plan(
        mask,
        PlanShape::new(b, h, len, len).unwrap(),
        TileShape::new(tile, tile).unwrap(),
    )
    .unwrap()
}

fn masks() -> Vec<(Mask, usize, usize)> {
    let len = 512;
    let mut dense = vec![false; 2 * len * len];
    let mut x = 12345u64;
    for v in dense.iter_mut() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *v = (x >> 60) < 3;
    }
    let dense = Mask::dense(DenseMask::new(&[2, len, len], &dense, "d").unwrap());
    vec![
        (Mask::causal(), 1, 1),
        (Mask::causal() & docs(len, &[37, 200, 5, 90, 300]), 1, 1),
        (Mask::window(70, 3) | Mask::prefix(20), 1, 1),
        (dense, 1, 2),
        (
            Mask::Heads(vec![Mask::causal(), Mask::causal() & docs(len, &[64, 100])]),
            2,
            2,
        ),
    ]
}

#[test]
fn every_scheme_deals_each_tile_once_in_equal_counts() {
    for (m, b, h) in masks() {
        let p = plan(&m, b, h, 512, 16);
        for r in [1, 2, 4, 8] {
            for scheme in Scheme::ALL {
                let s = shard(&p, r, scheme, CostModel::default()).unwrap();
                let mut seen = vec![0; p.q_tiles];
                for o in &s.owned {
                    assert_eq!(o.len(), p.q_tiles / r, "{scheme} R={r}");
                    assert!(o.windows(2).all(|w| w[0] < w[1]));
                    for &t in o {
                        seen[t as usize] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{scheme} R={r}");
                let mut perm = s.permutation();
                perm.sort_unstable();
                assert_eq!(perm, (0..512).collect::<Vec<_>>());
                // Deterministic: the same plan gives the same sharding.
                assert_eq!(s, shard(&p, r, scheme, CostModel::default()).unwrap());
                // Sharding adds no tile work.
                let tiles: u64 = s.costs.iter().map(|c| c.full_tiles + c.partial_tiles).sum();
                let want = p.stats.full_tiles + p.stats.partial_tiles;
                if p.batch_groups * p.head_groups == b * h {
                    assert_eq!(tiles, want, "{scheme} R={r}");
                }
                let pairs: u64 = s.costs.iter().map(|c| c.pairs).sum();
                assert_eq!(pairs, p.stats.allowed_pairs, "{scheme} R={r}");
            }
        }
    }
}

#[test]
fn zigzag_and_contiguous_follow_their_definitions() {
    let p = plan(&Mask::causal(), 1, 1, 512, 16); // 32 tiles
    let z = shard(&p, 4, Scheme::Zigzag, CostModel::default()).unwrap();
    assert_eq!(z.owned[0], vec![0, 1, 2, 3, 28, 29, 30, 31]);
    assert_eq!(z.owned[3], vec![12, 13, 14, 15, 16, 17, 18, 19]);
    let c = shard(&p, 4, Scheme::Contiguous, CostModel::default()).unwrap();
    assert_eq!(c.owned[1], (8..16).collect::<Vec<u32>>());
    // causal: contiguous's last rank does ~2R-1 times the first rank's work; zigzag evens it.
    assert!(c.imbalance() > 1.5);
    assert!(z.imbalance() < 1.05);
}

#[test]
fn padded_local_plans_add_only_empty_kv_tiles() {
    for (m, b, h) in masks() {
        let p = plan(&m, b, h, 512, 16);
        let s = shard(&p, 4, Scheme::Balanced, CostModel::default()).unwrap();
        for rank in 0..4 {
            let lp = s.local_plan(&p, rank, KvLayout::Needed).unwrap();
            let padded = s
                .local_plan_padded(&p, rank, KvLayout::Needed, p.kv_tiles)
                .unwrap();
            assert_eq!(padded.kv_tiles, p.kv_tiles);
            assert_eq!(padded.shape.kv_len, p.kv_tiles * 16);
            // Padding is part of the contract (nothing to pad: the same plan).
            assert_eq!(padded.contract == lp.contract, lp.kv_tiles == p.kv_tiles);
            for bb in 0..b {
                for hh in 0..h {
                    for i in 0..lp.shape.q_len {
                        for j in 0..padded.shape.kv_len {
                            let want = j < lp.shape.kv_len && lp.allowed(bb, hh, i, j);
                            assert_eq!(padded.allowed(bb, hh, i, j), want);
                        }
                    }
                }
            }
            for (a, c) in lp.head_plans.iter().zip(&padded.head_plans) {
                assert_eq!(a.fwd, c.fwd);
                assert_eq!(c.bwd_offsets.len(), p.kv_tiles + 1);
            }
        }
        // More tiles than the row has is refused.
        assert!(s
            .local_plan_padded(&p, 0, KvLayout::Needed, p.kv_tiles + 1)
            .is_err());
    }
}

#[test]
fn local_plans_are_the_global_mask_on_the_rank_layout() {
    for (m, b, h) in masks() {
        let p = plan(&m, b, h, 512, 16);
        for r in [2, 4] {
            for scheme in Scheme::ALL {
                let s = shard(&p, r, scheme, CostModel::default()).unwrap();
                for rank in 0..r {
                    let rows = s.positions(rank).unwrap();
                    for layout in [KvLayout::AllGather, KvLayout::Needed] {
                        let kv_tiles = s.local_kv_tiles(rank, layout).unwrap();
                        let cols: Vec<usize> = kv_tiles
                            .iter()
                            .flat_map(|&t| t as usize * 16..(t as usize + 1) * 16)
                            .collect();
                        let lp = s.local_plan(&p, rank, layout).unwrap();
                        assert_eq!(lp.shape.q_len, rows.len());
                        assert_eq!(lp.shape.kv_len, cols.len());
                        for bb in 0..b {
                            for hh in 0..h {
                                let mut local_pairs = 0u64;
                                for (i, &gi) in rows.iter().enumerate() {
                                    for (j, &gj) in cols.iter().enumerate() {
                                        let a = lp.allowed(bb, hh, i, j);
                                        assert_eq!(a, p.allowed(bb, hh, gi, gj));
                                        local_pairs += a as u64;
                                    }
                                }
                                // Needed layout loses no allowed pair of the rank's rows.
                                let global: u64 = rows
                                    .iter()
                                    .map(|&gi| {
                                        (0..512).filter(|&j| p.allowed(bb, hh, gi, j)).count()
                                            as u64
                                    })
                                    .sum();
                                assert_eq!(
                                    local_pairs, global,
                                    "{scheme} R={r} rank {rank} {layout:?}"
                                );
                            }
                        }
                        // Work lists stay ascending; backward is the transpose.
                        for hp in &lp.head_plans {
                            for q in 0..lp.q_tiles {
                                assert!(hp.row(q).windows(2).all(|w| w[0].tile < w[1].tile));
                            }
                            assert_eq!(hp.bwd.len(), hp.fwd.len());
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn needed_lists_are_exactly_the_touched_tiles() {
    let p = plan(
        &(Mask::causal() & docs(1024, &[40, 300, 17, 128])),
        1,
        1,
        1024,
        32,
    );
    let s = shard(&p, 4, Scheme::Balanced, CostModel::default()).unwrap();
    for rank in 0..4 {
        let mut touched = vec![false; p.kv_tiles];
        for &t in &s.owned[rank] {
            for e in p.head_plans[0].row(t as usize) {
                touched[e.tile as usize] = true;
            }
        }
        for src in 0..4 {
            let want: Vec<u32> = s.owned[src]
                .iter()
                .copied()
                .filter(|&t| touched[t as usize])
                .collect();
            assert_eq!(s.needed[rank][src], want);
        }
        let remote: usize = (0..4)
            .filter(|&x| x != rank)
            .map(|x| s.needed[rank][x].len())
            .sum();
        assert_eq!(s.costs[rank].kv_tiles_remote, remote as u64);
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let p = plan(&Mask::causal(), 1, 1, 512, 16); // 32 tiles
    let e = shard(&p, 3, Scheme::Balanced, CostModel::default()).unwrap_err();
    assert!(e.to_string().contains("pad the row to 528 tokens"), "{e}");
    let e = shard(&p, 32, Scheme::Zigzag, CostModel::default()).unwrap_err();
    assert!(e.to_string().contains("64 chunks"), "{e}");
    assert!(shard(&p, 0, Scheme::Balanced, CostModel::default()).is_err());
    let ragged = plan(&Mask::causal(), 1, 1, 500, 16);
    assert!(shard(&ragged, 2, Scheme::Contiguous, CostModel::default()).is_err());
    let cross = build_plan(
        &Mask::causal(),
        PlanShape::new(1, 1, 256, 512).unwrap(),
        TileShape::new(16, 16).unwrap(),
    )
    .unwrap();
    assert!(shard(&cross, 2, Scheme::Balanced, CostModel::default()).is_err());
    let bad_model = CostModel {
        partial_overhead: 2.0,
        backward: 1.0,
        ..CostModel::default()
    };
    assert!(shard(&p, 2, Scheme::Balanced, bad_model).is_err());
    for cap in [0.99, f64::NAN, f64::INFINITY] {
        let m = CostModel {
            balance_cap: cap,
            ..CostModel::default()
        };
        let e = shard(&p, 2, Scheme::Balanced, m).unwrap_err();
        assert!(e.to_string().contains("balance_cap"), "{e}");
    }
    assert!(Scheme::parse("ring").is_err());
    assert_eq!(
        Scheme::parse("perdoc_zigzag").unwrap(),
        Scheme::PerDocZigzag
    );
    let s = shard(&p, 2, Scheme::Balanced, CostModel::default()).unwrap();
    assert!(s.positions(2).is_err());
    let other = plan(&Mask::full(), 1, 1, 512, 16);
    assert!(s.local_plan(&other, 0, KvLayout::Needed).is_err());
}

#[test]
fn doc_mix_is_seeded_and_has_long_documents() {
    let mix = DocMix::default();
    let a = doc_mix(256 * 1024, &mix).unwrap();
    assert_eq!(a, doc_mix(256 * 1024, &mix).unwrap());
    assert_ne!(a, doc_mix(256 * 1024, &DocMix { seed: 1, ..mix }).unwrap());
    let mut lens = std::collections::BTreeMap::new();
    for &d in &a {
        *lens.entry(d).or_insert(0usize) += 1;
    }
    let long: usize = lens.values().filter(|&&n| n >= 32 * 1024).sum();
    assert!(long as f64 >= 0.25 * a.len() as f64, "{long}");
    assert!(lens.len() > 30, "{} documents", lens.len());
    // The web mix: about 1 % of documents long, none of the rest.
    let (mut docs, mut long) = (0usize, 0usize);
    for seed in 0..40 {
        let ids = doc_mix(512 * 1024, &DocMix::web(seed)).unwrap();
        let mut runs = vec![1usize];
        for w in ids.windows(2) {
            if w[0] == w[1] {
                *runs.last_mut().unwrap() += 1;
            } else {
                runs.push(1);
            }
        }
        // The document drawn last is cut at the row's end (then shuffled); every other one is
        // in the body's or the long range.
        let outside = runs
            .iter()
            .filter(|&&n| !(64..=128 * 1024).contains(&n))
            .count();
        assert!(
            outside <= 1,
            "seed {seed}: {outside} documents out of range"
        );
        docs += runs.len();
        long += runs.iter().filter(|&&n| n >= 32 * 1024).count();
    }
    let share = long as f64 / docs as f64;
    assert!(
        (0.005..0.02).contains(&share),
        "{long} of {docs} documents long"
    );
    let bad = DocMix {
        long_docs: 1.5,
        ..DocMix::web(0)
    };
    assert!(doc_mix(1024, &bad).is_err());
}

/// The bar at N = 512K, R = 8 on the doc-causal mix.
#[test]
fn balanced_meets_the_bar_at_512k_8_ranks() {
    let p = doc_causal_plan(512 * 1024, &DocMix::default(), 128).unwrap();
    let rows = simulate_plan(&p, &[8], &SimModel::default()).unwrap();
    let get = |s: Scheme| rows.iter().find(|r| r.scheme == s).unwrap();
    let (b, z) = (get(Scheme::Balanced), get(Scheme::Zigzag));
    assert!(b.cost_max_over_mean <= 1.05, "{b:?}");
    assert!(b.cost_max_over_mean <= z.cost_max_over_mean, "{b:?} {z:?}");
    assert!(b.needed_bytes_max < b.allgather_bytes, "{b:?}");
    assert!(rows.iter().all(|r| r.extra_tiles == 0));
}

/// Per scheme on a web mix: (max/mean cost, busiest receiver's K/V over an all-gather, ms).
fn web_row(len: usize, r: usize, seed: u64, tile: usize) -> Vec<(Scheme, f64, f64, f64)> {
    let p = doc_causal_plan(len, &DocMix::web(seed), tile).unwrap();
    Scheme::ALL
        .iter()
        .map(|&scheme| {
            let t0 = Instant::now();
            let s = shard(&p, r, scheme, CostModel::default()).unwrap();
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            // The fraction is the exact needed lists' (not the solver's estimate).
            let ag = (s.tiles - s.tiles_per_rank()) as f64;
            let max_remote = s.needed.iter().enumerate().map(|(k, row)| {
                row.iter()
                    .enumerate()
                    .filter(|&(src, _)| src != k)
                    .map(|(_, v)| v.len())
                    .sum::<usize>()
            });
            let frac = max_remote.max().unwrap() as f64 / ag;
            assert!((frac - s.kv_fraction()).abs() < 1e-12);
            for c in &s.costs {
                assert!((c.kv_remote_fraction - c.kv_tiles_remote as f64 / ag).abs() < 1e-12);
            }
            (scheme, s.imbalance(), frac, ms)
        })
        .collect()
}

fn print_rows(label: &str, rows: &[(Scheme, f64, f64, f64)]) {
    let cells: Vec<String> = rows
        .iter()
        .map(|(s, b, f, ms)| format!("{s} {b:.3} / {f:.3} ({ms:.0} ms)"))
        .collect();
    println!("| {label} | {} |", cells.join(" | "));
}

/// The bar for packed web documents (lognormal lengths, 1 % of documents 32K–128K tokens),
/// 512K tokens over 8 ranks at tile 128: balanced keeps the busiest rank within 1.05× the mean
/// cost (its cap is 1.02) and the busiest receiver's K/V within 0.35 of an all-gather, on every
/// seed. Seeds 6 and 13 are where the balance-only solver needed 0.48 and 0.15 (the 0.42
/// and 0.15); 8, 19, 21 and 38 have two or more long documents (the hardest found in 0..40).
#[test]
fn balanced_meets_the_traffic_bar_on_web_mixes() {
    for seed in [0, 1, 2, 5, 6, 8, 11, 13, 19, 21, 38] {
        let rows = web_row(512 * 1024, 8, seed, 128);
        print_rows(&format!("seed {seed}"), &rows);
        let &(_, bal, frac, _) = rows.iter().find(|r| r.0 == Scheme::Balanced).unwrap();
        assert!(bal <= 1.02 + 1e-9, "seed {seed}: max/mean {bal}");
        assert!(frac <= 0.35, "seed {seed}: needed {frac} of an all-gather");
    }
}

/// The bar on 64 seeds, and at other world sizes and tiles (same mix, 512K and 1M tokens):
/// `cargo test -p tessera-plan --release --test shard -- --ignored --nocapture web`.
#[test]
#[ignore]
fn balanced_meets_the_traffic_bar_on_64_web_seeds() {
    let mut worst = (0.0f64, 0.0f64);
    for seed in 0..64 {
        let rows = web_row(512 * 1024, 8, seed, 128);
        print_rows(&format!("512K R=8 t=128 seed {seed}"), &rows);
        let &(_, bal, frac, _) = rows.iter().find(|r| r.0 == Scheme::Balanced).unwrap();
        worst = (worst.0.max(bal), worst.1.max(frac));
        assert!(
            bal <= 1.02 + 1e-9 && frac <= 0.35,
            "seed {seed}: {bal} {frac}"
        );
    }
    println!(
        "worst over 64 seeds: max/mean {:.3}, needed {:.3}",
        worst.0, worst.1
    );
    // Elsewhere: within the cap, and never more traffic than an all-gather's worth.
    for (len, r, tile) in [
        (512 * 1024, 4, 128),
        (512 * 1024, 16, 128),
        (512 * 1024, 8, 64),
        (1024 * 1024, 32, 128),
    ] {
        for seed in 0..4 {
            let rows = web_row(len, r, seed, tile);
            print_rows(&format!("{}K R={r} t={tile} seed {seed}", len >> 10), &rows);
            let &(_, bal, _, _) = rows.iter().find(|x| x.0 == Scheme::Balanced).unwrap();
            assert!(bal <= 1.02 + 1e-9, "{len} {r} {tile} {seed}: {bal}");
        }
    }
}

/// Sharding time, median of 5 (release build): 1M tokens over 32 ranks (the cp-sim token mix)
/// and the web mix's 512K over 8 ranks (web mix, seeds 0 and 19, tile 128 — the default — and 64),
/// each scheme at most 1 s:
/// `cargo test -p tessera-plan --release --test shard -- --ignored --nocapture takes`.
#[test]
#[ignore]
fn sharding_1m_tokens_for_32_ranks_takes_under_1s() {
    let cases = [
        (
            "1M R=32 t=128 tokens mix",
            1024 * 1024,
            32,
            DocMix::default(),
            128,
        ),
        (
            "512K R=8 t=128 web seed 0",
            512 * 1024,
            8,
            DocMix::web(0),
            128,
        ),
        (
            "512K R=8 t=128 web seed 19",
            512 * 1024,
            8,
            DocMix::web(19),
            128,
        ),
        (
            "512K R=8 t=64 web seed 0",
            512 * 1024,
            8,
            DocMix::web(0),
            64,
        ),
    ];
    for (label, len, r, mix, tile) in cases {
        let p = doc_causal_plan(len, &mix, tile).unwrap();
        for scheme in Scheme::ALL {
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let t0 = Instant::now();
                    shard(&p, r, scheme, CostModel::default()).unwrap();
                    t0.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let s = shard(&p, r, scheme, CostModel::default()).unwrap();
            let t1 = Instant::now();
            s.local_plan(&p, r - 1, KvLayout::Needed).unwrap();
            let local_ms = t1.elapsed().as_secs_f64() * 1e3;
            let ms = times[2];
            println!(
                "{label}: {scheme}: shard {ms:.1} ms (median of 5), one local plan {local_ms:.1} ms, \
                 max/mean {:.3}, needed {:.3}",
                s.imbalance(),
                s.kv_fraction()
            );
            assert!(ms <= 1000.0, "{label} {scheme}: {ms:.1} ms");
        }
    }
}

/// Segment ids of a 2048-token row: a padding run, then documents of `lens` tokens (cycled),
/// the rest padding.
fn packed(lens: &[usize], pad: usize) -> Vec<i64> {
    let len = 2048;
    let mut ids = vec![-1i64; pad.min(len)];
    for (d, &n) in lens.iter().cycle().enumerate() {
        if ids.len() >= len {
            break;
        }
        ids.extend(std::iter::repeat_n(d as i64, n.min(len - ids.len())));
    }
    ids
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// Random packed doc-causal rows (documents from one token to past a rank's share, padding),
    /// world sizes and caps: balanced deals every tile once in equal counts, deterministically,
    /// loses no pair, reports each rank's received K/V exactly, is within its cap whenever some
    /// fixed scheme is, and then has the busiest receiver get no more K/V than any such scheme.
    #[test]
    fn balanced_is_exact_and_beats_the_fixed_schemes_within_its_cap(
        lens in prop::collection::vec(1usize..700, 1..30),
        pad in 0usize..300,
        r_log in 0u32..4,
        cap in 1.0f64..1.1,
    ) {
        let r = 1usize << r_log;
        let ids = packed(&lens, pad);
        let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(ids).unwrap()));
        let p = plan(&mask, 1, 1, 2048, 16);
        let model = CostModel { balance_cap: cap, ..CostModel::default() };
        let s = shard(&p, r, Scheme::Balanced, model).unwrap();
        prop_assert_eq!(&s, &shard(&p, r, Scheme::Balanced, model).unwrap());
        let mut seen = vec![0u8; p.q_tiles];
        for o in &s.owned {
            prop_assert_eq!(o.len(), p.q_tiles / r);
            for &t in o {
                seen[t as usize] += 1;
            }
        }
        prop_assert!(seen.iter().all(|&c| c == 1));
        prop_assert_eq!(s.costs.iter().map(|c| c.pairs).sum::<u64>(), p.stats.allowed_pairs);
        for (k, o) in s.owned.iter().enumerate() {
            let mut touched = vec![false; p.kv_tiles];
            for &t in o {
                for e in p.head_plans[0].row(t as usize) {
                    touched[e.tile as usize] = true;
                }
            }
            let remote = (0..p.kv_tiles)
                .filter(|&t| touched[t] && !o.contains(&(t as u32)))
                .count() as u64;
            prop_assert_eq!(s.costs[k].kv_tiles_remote, remote);
        }
        for other in [Scheme::Contiguous, Scheme::Zigzag, Scheme::PerDocZigzag] {
            let o = shard(&p, r, other, model).unwrap();
            if o.imbalance() <= cap {
                prop_assert!(s.imbalance() <= cap * (1.0 + 1e-9), "{} {}", other, o.imbalance());
                prop_assert!(s.kv_fraction() <= o.kv_fraction() + 1e-12, "{} {} {}", other, s.kv_fraction(), o.kv_fraction());
            }
        }
    }
}
