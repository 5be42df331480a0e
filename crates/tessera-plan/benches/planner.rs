//! Planner speed, single thread: causal-within-documents (documents ~1K tokens, tile 128) at
//! 32K, 128K and 1M tokens, plus plain causal, and at 32K a block selection (H = 8, 16 random
//! causal-valid blocks of 128 per row, diagonal included) intersected with causal-within-documents.
//! Run: `cargo bench -p tessera-plan --bench planner`.
// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tessera_mask::{BlockSelection, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};

/// Packed documents with lengths uniform in [512, 1536] (mean ~1K tokens), seeded.
pub fn doc_segments(len: usize, seed: u64) -> Vec<i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = Vec::with_capacity(len);
    let mut doc = 0;
    while ids.len() < len {
        let n = rng.gen_range(512..=1536).min(len - ids.len());
        ids.extend(std::iter::repeat_n(doc, n));
        doc += 1;
    }
    ids
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    g.sample_size(10);
    for &len in &[32 * 1024usize, 128 * 1024, 1024 * 1024] {
        let segs = Segments::shared(SegmentIds::shared(doc_segments(len, 7)).unwrap());
        let mask = Mask::causal() & Mask::document(segs);
        let shape = PlanShape::new(1, 1, len, len).unwrap();
        g.bench_with_input(BenchmarkId::new("causal_documents", len), &len, |b, _| {
            b.iter(|| build_plan(&mask, shape, TileShape::default()).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("causal", len), &len, |b, _| {
            b.iter(|| build_plan(&Mask::causal(), shape, TileShape::default()).unwrap())
        });
    }
    // A per-step selection: [1, 8, 256, 16], each row its diagonal and 15 earlier blocks.
    let (len, heads, k, t) = (32 * 1024usize, 8usize, 16usize, 128usize);
    let tq = len / t;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut entries = Vec::with_capacity(heads * tq * k);
    for _ in 0..heads {
        for r in 0..tq as i64 {
            let mut earlier: Vec<i64> = (0..r).collect();
            earlier.shuffle(&mut rng);
            let mut row = vec![r];
            row.extend(earlier.into_iter().take(k - 1));
            row.resize(k, -1);
            entries.extend(row);
        }
    }
    let segs = Segments::shared(SegmentIds::shared(doc_segments(len, 7)).unwrap());
    let shape = PlanShape::new(1, heads, len, len).unwrap();
    g.bench_function(
        BenchmarkId::new("blocks_causal_documents_h8_k16", len),
        |b| {
            b.iter(|| {
                let sel =
                    BlockSelection::new(&[1, heads, tq, k], &entries, t, t, "kv_tiles").unwrap();
                let mask = Mask::blocks(sel) & Mask::causal() & Mask::document(segs.clone());
                build_plan(&mask, shape, TileShape::default()).unwrap()
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
