//! Forward and backward of the CPU backend at 8K tokens, H = 8, D = 64, B = 1, default 128x128
//! tiles, for three masks (causal, causal within ~1K-token documents, window(1024) & causal) in
//! f32 and bf16. Throughput is reported as effective FLOP/s over allowed pairs
//! (`Plan::forward_flops` / `Plan::backward_flops`), printed by criterion as "elem/s".
//!
//! Timing covers the kernels only: the plan is prepared once (`Backend::prepare`), and every
//! iteration runs `forward_into` / `backward_into` on it into preallocated output buffers with
//! one reused `CpuWorkspace`, on the current rayon pool (`Par::Current`).
//!
//! Run one: `cargo bench -p tessera-attn --bench attention -- 'forward/f32/causal$'`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::Duration;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs,
    GradBufs, GradInputs, Par,
};
use tessera_core::{DType, Tensor};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

const L: usize = 8192;
const H: usize = 8;
const D: usize = 64;

fn documents() -> Mask {
    // Documents of 512..1536 tokens (mean ~1K), seeded.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut ids = Vec::with_capacity(L);
    let mut doc = 0i64;
    while ids.len() < L {
        let n = rng.gen_range(512..=1536).min(L - ids.len());
        ids.extend(std::iter::repeat_n(doc, n));
        doc += 1;
    }
    let seg = SegmentIds::shared(ids).expect("segments");
    Mask::causal() & Mask::document(Segments::shared(seg))
}

fn masks() -> Vec<(&'static str, Mask)> {
    vec![
        ("causal", Mask::causal()),
        ("causal_documents", documents()),
        ("window1024_causal", Mask::window(1024, 0) & Mask::causal()),
    ]
}

fn tensor(rng: &mut ChaCha8Rng, dtype: DType, n: usize) -> Tensor {
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.7f32..1.7)).collect();
    match dtype {
        DType::BF16 => Tensor::from_bf16(
            vec![1, H, L, D],
            v.into_iter().map(bf16::from_f32).collect(),
        ),
        _ => Tensor::from_f32(vec![1, H, L, D], v),
    }
    .expect("tensor")
}

struct Inputs {
    plan: Arc<Plan>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

fn inputs(mask: &Mask, dtype: DType) -> Inputs {
    let plan = Arc::new(
        build_plan(
            mask,
            PlanShape::new(1, H, L, L).expect("shape"),
            TileShape::default(),
        )
        .expect("plan"),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let n = H * L * D;
    Inputs {
        plan,
        q: tensor(&mut rng, dtype, n),
        k: tensor(&mut rng, dtype, n),
        v: tensor(&mut rng, dtype, n),
        d_o: tensor(&mut rng, dtype, n),
    }
}

fn bench(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let opts = AttnOptions::default();
    for dtype in [DType::F32, DType::BF16] {
        for (name, mask) in masks() {
            let x = inputs(&mask, dtype);
            let prepared = backend.prepare(&x.plan).expect("prepare");
            let fwd_in =
                AttnInputs::contiguous(x.q.view(), x.k.view(), x.v.view()).expect("inputs");
            let dims = check_inputs(&fwd_in, &opts).expect("inputs");
            let mut ws = CpuWorkspace::default();
            let mut fwd_out = ForwardBufs::new(&dims);
            let mut g = c.benchmark_group(format!("forward/{dtype}"));
            g.throughput(Throughput::Elements(x.plan.forward_flops(D, D) as u64));
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    backend
                        .forward_into(
                            &prepared,
                            &fwd_in,
                            &opts,
                            fwd_out.out(),
                            &mut ws,
                            Par::Current,
                        )
                        .expect("forward")
                })
            });
            g.finish();

            // The backward's O and LSE (computed here: the forward group may be filtered out).
            backend
                .forward_into(
                    &prepared,
                    &fwd_in,
                    &opts,
                    fwd_out.out(),
                    &mut ws,
                    Par::Current,
                )
                .expect("forward");
            let f = fwd_out.finish(&dims).expect("forward");
            let bwd_in = GradInputs::contiguous(fwd_in, f.o.view(), f.lse.view(), x.d_o.view())
                .expect("inputs");
            let mut bwd_out = GradBufs::new(&dims, opts.sinks.is_some());
            let mut g = c.benchmark_group(format!("backward/{dtype}"));
            g.throughput(Throughput::Elements(x.plan.backward_flops(D, D) as u64));
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    backend
                        .backward_into(
                            &prepared,
                            &bwd_in,
                            &opts,
                            bwd_out.out(),
                            &mut ws,
                            Par::Current,
                        )
                        .expect("backward")
                })
            });
            g.finish();
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    targets = bench
}
criterion_main!(benches);
