//! Planner speed on scattered features, single thread: the masks whose band features jump
//! inside tiles, so stage 2 does most of the work. Tree-causal (ancestors in a random tree stored
//! parent-before-child after a prompt chain, `band(pre, pre, 0, MAX) & band(pre, end, MIN, -1)`:
//! a tree of 3/4 of the tokens up to 4,096 nodes, and a tree of all but 64 tokens), two bands over
//! different shuffled features (stage 2 compares every pair of every tile, twice)
//! and a video temporal head with frames shorter than a tile or not a multiple of it
//! (`global | band(pos, pos, -(w-1), w-1)`, `pos = (i - p) % F`), at 4K, 16K and 64K tokens.
//!
//! Besides criterion's times it prints, per mask, stage 1's census (tiles visited, proved empty or
//! full, left partial), the final partial tiles, and the nanoseconds per token pair of the tiles
//! stage 2 refines (fastest plan time / (stage-1 partial tiles x tile area)): stage 2's rate.
//! Each mask is timed twice: the whole plan (`build_plan`) and its tile states alone
//! (`build_tile_states`, `<case>_states`: what a computed `mask_mod` needs).
//! `SCATTER_SIZES=4096,65536` picks the sizes, `SCATTER_CASES=tree_causal,temporal_f100` the
//! masks (default: all).
//! `TESSERA_PLAN_SIMD=avx2` (or `scalar`) forces a narrower row-compare path.
//! Run: `cargo bench -p tessera-plan --bench scatter`.
// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::SeedableRng;
use std::time::Instant;
use tessera_mask::{BandFeatures, Mask, SegmentIds};
use tessera_plan::{build_plan, build_tile_states, stage1_census, PlanShape, TileShape};

// The allocator the Python package uses (glibc's malloc re-faults a plan's freed pages on every
// build, which made these times vary by half between runs).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../tests/common/tree.rs"]
mod tree;

fn band(f: Vec<i64>, g: Vec<i64>, lo: i64, hi: i64) -> Mask {
    let q = SegmentIds::shared(f).unwrap();
    let kv = SegmentIds::shared(g).unwrap();
    Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
}

/// Tree-causal over `n` tokens: a tree of `nodes` tokens after a prompt chain of the rest.
pub fn tree_causal(n: usize, nodes: usize) -> Mask {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (pre, end) = tree::tree_features(&mut rng, n, n - nodes.min(n));
    band(pre.clone(), pre.clone(), 0, i64::MAX) & band(pre, end, i64::MIN, -1)
}

pub fn temporal(n: usize, per_frame: usize) -> Mask {
    let p = 256usize;
    let frames = (n - p) / per_frame;
    let w = (2 * per_frame / frames.max(1)).max(2) as i64;
    let pos: Vec<i64> = (0..n as i64)
        .map(|i| (i - p as i64).rem_euclid(per_frame as i64))
        .collect();
    let flag: Vec<i64> = (0..n).map(|i| (i < p) as i64).collect();
    let neg: Vec<i64> = flag.iter().map(|&x| -x).collect();
    band(flag, neg, 1, 2) | band(pos.clone(), pos, -(w - 1), w - 1)
}

/// This thread's CPU time in seconds (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Two bands over different shuffled features (no shared query feature, so not fused, and every
/// tile's ranges span the whole feature: stage 1 leaves every tile partial): the stage-2 rate of
/// two-band masks whose features scatter.
pub fn two_bands_scattered(n: usize) -> Mask {
    use rand::seq::SliceRandom;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut perm = |scale: i64| {
        let mut v: Vec<i64> = (0..n as i64).map(|i| i * scale).collect();
        v.shuffle(&mut rng);
        v
    };
    let (f, g) = (perm(1), perm(3));
    band(f.clone(), f, -600, 600) & band(g.clone(), g, -1500, 1500)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("scatter");
    g.sample_size(10);
    let tile = TileShape::default();
    let sizes: Vec<usize> = std::env::var("SCATTER_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![4096, 16384, 65536]);
    let only: Option<Vec<String>> = std::env::var("SCATTER_CASES")
        .ok()
        .map(|v| v.split(',').map(str::to_string).collect());
    for &n in &sizes {
        let cases = [
            (
                "tree_causal".to_string(),
                tree_causal(n, (3 * n / 4).min(4096)),
            ),
            ("tree_causal_whole".to_string(), tree_causal(n, n - 64)),
            ("two_bands_scattered".to_string(), two_bands_scattered(n)),
            ("temporal_f100".to_string(), temporal(n, 100)),
            ("temporal_f300".to_string(), temporal(n, 300)),
        ];
        for (name, mask) in cases {
            if only.as_ref().is_some_and(|o| !o.contains(&name)) {
                continue;
            }
            let shape = PlanShape::new(1, 1, n, n).unwrap();
            let plan = build_plan(&mask, shape, tile).unwrap();
            let [empty, refined, full, tiles] = stage1_census(&mask, shape, tile).unwrap();
            let area = (tile.q * tile.kv) as f64;
            let pairs = plan.stats.partial_tiles as f64 * area;
            // The median of 9 builds in this thread's CPU time (on a shared machine the wall
            // clock counts other processes' turns), and the fastest wall-clock build.
            let (mut cpu, mut wall) = (Vec::new(), f64::INFINITY);
            for _ in 0..9 {
                let (t, c) = (Instant::now(), thread_cpu());
                build_plan(&mask, shape, tile).unwrap();
                cpu.push(thread_cpu() - c);
                wall = wall.min(t.elapsed().as_secs_f64());
            }
            cpu.sort_by(f64::total_cmp);
            let s = cpu[cpu.len() / 2];
            eprintln!(
                "{name} n={n}: {tiles} tiles, stage 1 visits {} (empty {empty}, full {full}, \
                 partial {refined}), {} partial after stage 2; {:.3} ms, {:.3} ns per pair of \
                 the tiles stage 2 refines, {:.3} ns per pair of the final partial tiles \
                 (CPU time; fastest wall clock {:.3} ms)",
                empty + refined + full,
                plan.stats.partial_tiles,
                s * 1e3,
                s * 1e9 / (refined as f64 * area).max(1.0),
                s * 1e9 / pairs.max(1.0),
                wall * 1e3
            );
            g.bench_with_input(BenchmarkId::new(name.as_str(), n), &n, |b, _| {
                b.iter(|| build_plan(&mask, shape, tile).unwrap())
            });
            g.bench_with_input(BenchmarkId::new(format!("{name}_states"), n), &n, |b, _| {
                b.iter(|| build_tile_states(&mask, shape, tile).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
