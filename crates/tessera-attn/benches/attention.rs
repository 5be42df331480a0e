//! Forward and backward of the CPU backend at 8K tokens, H = 8, D = 64, B = 1, default 128x128
//! tiles, for three masks of the shared workloads (causal, causal within ~1K-token documents,
//! window(1024) & causal; `tessera_conformance::workloads`, the masks `tessera bench` runs) in
//! f32 and bf16. Throughput is reported as effective FLOP/s over allowed pairs
//! (`Plan::forward_flops` / `Plan::backward_flops`), printed by criterion as "elem/s".
//!
//! Timing covers the kernels only: the plan is prepared once (`Backend::prepare`), and every
//! iteration runs `forward_into` / `backward_into` on it into preallocated output buffers with
//! one reused `CpuWorkspace`, on the current rayon pool (`Par::Current`).
//!
//! Run one: `cargo bench -p tessera-attn --bench attention -- 'forward/f32/causal$'`.
// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::Arc;
use std::time::Duration;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs,
    GradBufs, GradInputs, Par,
};
use tessera_conformance::workloads::{named_mask, random_tensor};
use tessera_core::{DType, Tensor};
use tessera_mask::Mask;
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

const L: usize = 8192;
const H: usize = 8;
const D: usize = 64;

/// The suite's masks from the shared seeded workloads (the same ones `tessera bench` runs).
fn masks() -> Vec<(&'static str, Mask)> {
    ["causal", "documents", "window"]
        .into_iter()
        .map(|name| (name, named_mask(name, L).expect("mask").1))
        .collect()
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
    let t = |seed| random_tensor(vec![1, H, L, D], dtype, seed).expect("tensor");
    Inputs {
        plan,
        q: t(1),
        k: t(2),
        v: t(3),
        d_o: t(4),
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
