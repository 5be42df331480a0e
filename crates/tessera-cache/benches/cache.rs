//! Warm load (disk entry, fresh cache instance as in a new process) vs plan build, and the
//! memory hit, for two contracts:
//! (a) causal within documents of ~1K tokens at 128K (tile 128),
//! (b) a 16K × 16K dense random mask (tile 128).
//!
//! Run: `cargo bench -p tessera-cache --bench cache`.
// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::sync::Arc;
use tessera_cache::{CacheConfig, PlanCache};
use tessera_mask::{DenseMask, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};

fn doc_causal(len: usize) -> Mask {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut ids = Vec::with_capacity(len);
    let mut doc = 0i64;
    while ids.len() < len {
        let n: usize = rng.gen_range(512..=1536);
        ids.extend(std::iter::repeat_n(doc, n.min(len - ids.len())));
        doc += 1;
    }
    let seg = Segments::shared(SegmentIds::shared(ids).expect("segments"));
    Mask::causal() & Mask::document(seg)
}

fn dense_random(len: usize) -> Mask {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let bools: Vec<bool> = (0..len * len).map(|_| rng.gen_bool(0.5)).collect();
    Mask::dense(DenseMask::new(&[len, len], &bools, "rand").expect("dense"))
}

fn bench_case(c: &mut Criterion, name: &str, mask: Mask, len: usize) {
    let shape = PlanShape::new(1, 1, len, len).expect("shape");
    let tile = TileShape::new(128, 128).expect("tile");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = CacheConfig {
        dir: Some(dir.path().to_path_buf()),
        ..CacheConfig::default()
    };
    // Populate the disk entry once.
    let plan = PlanCache::new(config.clone())
        .get_or_build(&mask, shape, tile)
        .expect("plan")
        .plan;
    let entry = std::fs::metadata(
        PlanCache::new(config.clone())
            .entry_path(&plan.contract)
            .expect("path"),
    )
    .expect("entry")
    .len();
    eprintln!(
        "{name}: {} active tiles, {} unique partial masks, entry {} bytes",
        plan.stats.partial_tiles + plan.stats.full_tiles,
        plan.stats.unique_partial_masks,
        entry
    );

    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    g.bench_function(BenchmarkId::new("build", len), |b| {
        b.iter(|| black_box(build_plan(&mask, shape, tile).expect("build")))
    });
    g.bench_function(BenchmarkId::new("disk_load", len), |b| {
        b.iter(|| {
            let cache = PlanCache::new(config.clone());
            let p = cache.get_or_build(&mask, shape, tile).expect("load").plan;
            assert_eq!(cache.counters().disk_hits, 1);
            black_box(p)
        })
    });
    let warm = PlanCache::new(config.clone());
    let _: Arc<_> = warm.get_or_build(&mask, shape, tile).expect("warm").plan;
    g.bench_function(BenchmarkId::new("memory_hit", len), |b| {
        b.iter(|| black_box(warm.get_or_build(&mask, shape, tile).expect("hit").plan))
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_case(c, "doc_causal_128k", doc_causal(128 * 1024), 128 * 1024);
    bench_case(c, "dense_random_16k", dense_random(16 * 1024), 16 * 1024);
}

criterion_group!(cache, benches);
criterion_main!(cache);
