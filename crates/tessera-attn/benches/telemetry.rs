//! Cost of gated telemetry (docs/semantics.md#telemetry) on the CPU forward at 8K tokens, H = 8, D = 64, B = 1, f32,
//! causal within ~1K-token documents (the `causal_documents` mask of the `attention` bench),
//! default 128x128 tiles:
//! - `plain`: `Backend::forward_into`, the production kernel (telemetry compiled out: the
//!   `NoTelemetry` copy);
//! - `off_step`: `forward_logged_into` on a step that does not log (should equal `plain`);
//! - `log_step`: `forward_logged_into` on a logging step, both streams (sink-stream kernel variant
//!   plus the outlier pass over O), including the flush of the record.
//!
//! Every variant runs on the same prepared plan (`Backend::prepare`, once) into the same
//! preallocated outputs with one reused `CpuWorkspace` (`Par::Current`), so the timings are the
//! kernels' and the telemetry's, not plan preprocessing or allocation.
//!
//! The `telemetry/bf16/causal_documents` group runs the same variants on bf16 inputs (on CPUs
//! with AVX512-BF16, the `vdpbf16ps` forward kernel).
//!
//! Criterion measures each variant in its own time window, so slow drift of the machine (other
//! jobs, clocks) shows up as a difference between them. After the criterion groups a `paired`
//! run per dtype interleaves the three variants (rotating their order every round) and prints
//! per-variant medians and the median of the per-round ratios to `plain`, the robust overhead
//! figure.
//!
//! Run: `cargo bench -p tessera-attn --bench telemetry` (only the paired runs:
//! `cargo bench -p tessera-attn --bench telemetry -- paired`; one dtype: `-- paired-f32` or
//! `-- paired-bf16`).
// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, Criterion};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_attn::{
    check_inputs, forward_logged_into, AttnInputs, AttnOptions, Backend, CpuBackend, CpuPlan,
    CpuWorkspace, Dims, ForwardBufs, LogContext, Par, TelemetryInput,
};
use tessera_core::{DType, Tensor};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};
use tessera_telemetry::{
    document_kv_segments, sink_key_flags, Streams, Telemetry, TelemetryConfig, TelemetrySink,
};

const L: usize = 8192;
const H: usize = 8;
const D: usize = 64;

fn documents() -> Mask {
    // Documents of 512..1536 tokens (mean ~1K), seeded (as in the `attention` bench).
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

fn tensor(rng: &mut ChaCha8Rng, dtype: DType) -> Tensor {
    let v: Vec<f32> = (0..H * L * D)
        .map(|_| rng.gen_range(-1.7f32..1.7))
        .collect();
    if dtype == DType::BF16 {
        let v = v.into_iter().map(bf16::from_f32).collect();
        Tensor::from_bf16(vec![1, H, L, D], v).expect("tensor")
    } else {
        Tensor::from_f32(vec![1, H, L, D], v).expect("tensor")
    }
}

/// The problem and the three ways to run its forward.
struct Setup {
    mask: Mask,
    prepared: CpuPlan,
    dims: Dims,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: CpuBackend,
    opts: AttnOptions,
    log_step: Telemetry,
    off_step: Telemetry,
}

impl Setup {
    fn new(dtype: DType) -> Self {
        let mask = documents();
        let plan = Arc::new(
            build_plan(
                &mask,
                PlanShape::new(1, H, L, L).expect("shape"),
                TileShape::default(),
            )
            .expect("plan"),
        );
        let backend = CpuBackend::new();
        let prepared = backend.prepare(&plan).expect("prepare");
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (q, k, v) = (
            tensor(&mut rng, dtype),
            tensor(&mut rng, dtype),
            tensor(&mut rng, dtype),
        );
        let log_step = Telemetry::new(TelemetryConfig::every(2)).expect("telemetry");
        let mut off_step = log_step.clone();
        off_step.advance();
        assert!(log_step.should_log() && !off_step.should_log());
        let opts = AttnOptions::default();
        let dims = check_inputs(
            &AttnInputs::contiguous(q.view(), k.view(), v.view()).expect("inputs"),
            &opts,
        )
        .expect("inputs");
        Setup {
            mask,
            prepared,
            dims,
            q,
            k,
            v,
            backend,
            opts,
            log_step,
            off_step,
        }
    }

    fn inputs(&self) -> AttnInputs<'_> {
        AttnInputs::contiguous(self.q.view(), self.k.view(), self.v.view()).expect("inputs")
    }

    /// Output buffers and a workspace, allocated once and reused by every call.
    fn scratch(&self) -> Scratch {
        Scratch {
            out: ForwardBufs::new(&self.dims),
            ws: CpuWorkspace::default(),
        }
    }

    fn plain(&self, s: &mut Scratch) {
        self.backend
            .forward_into(
                &self.prepared,
                &self.inputs(),
                &self.opts,
                s.out.out(),
                &mut s.ws,
                Par::Current,
            )
            .expect("forward");
    }

    /// `forward_logged_into` at `tel`'s step; flushes the sink (the logging boundary).
    fn logged(&self, tel: &Telemetry, sink: &mut TelemetrySink, s: &mut Scratch) {
        forward_logged_into(
            &self.backend,
            &self.prepared,
            &self.inputs(),
            &self.opts,
            s.out.out(),
            &mut s.ws,
            Par::Current,
            LogContext {
                tel,
                mask: &self.mask,
                layer: 0,
                sink,
            },
        )
        .expect("forward");
        sink.flush();
    }
}

/// Caller-owned outputs and workspace of the timed calls.
struct Scratch {
    out: ForwardBufs,
    ws: CpuWorkspace,
}

fn bench(c: &mut Criterion) {
    group(c, DType::F32);
    group(c, DType::BF16);
}

fn group(c: &mut Criterion, dtype: DType) {
    let x = Setup::new(dtype);
    let mut sink = TelemetrySink::new(x.log_step.config.clone());
    let mut s = x.scratch();
    let mut g = c.benchmark_group(format!("telemetry/{dtype}/causal_documents"));
    g.bench_function("plain", |b| b.iter(|| x.plain(&mut s)));
    g.bench_function("off_step", |b| {
        b.iter(|| x.logged(&x.off_step, &mut sink, &mut s))
    });
    g.bench_function("log_step", |b| {
        b.iter(|| x.logged(&x.log_step, &mut sink, &mut s))
    });
    // The two streams alone (breakdown of `log_step`).
    let flags = sink_key_flags(document_kv_segments(&x.mask), 1, L, 1).expect("flags");
    for (name, sink, outlier) in [
        ("sink_stream", true, false),
        ("outlier_stream", false, true),
    ] {
        let mut input = TelemetryInput::new(&flags, 0, 0, &x.log_step.config);
        input.streams = Streams { sink, outlier };
        g.bench_function(name, |b| {
            b.iter(|| {
                x.backend
                    .forward_with_telemetry_into(
                        &x.prepared,
                        &x.inputs(),
                        &x.opts,
                        &input,
                        s.out.out(),
                        &mut s.ws,
                        Par::Current,
                    )
                    .expect("forward")
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    targets = bench
}

/// Interleaved timing of the three variants; prints medians and per-round ratios.
fn paired(dtype: DType) {
    const ROUNDS: usize = 30;
    let x = Setup::new(dtype);
    let mut sink = TelemetrySink::new(x.log_step.config.clone());
    let mut s = x.scratch();
    let names = ["plain", "off_step", "log_step"];
    let mut ms: Vec<Vec<f64>> = (0..3).map(|_| Vec::with_capacity(ROUNDS)).collect();
    for round in 0..ROUNDS + 2 {
        for slot in 0..3 {
            let which = (slot + round) % 3;
            let t = Instant::now();
            match which {
                0 => x.plain(&mut s),
                1 => x.logged(&x.off_step, &mut sink, &mut s),
                _ => x.logged(&x.log_step, &mut sink, &mut s),
            }
            std::hint::black_box(&mut s.out);
            if round >= 2 {
                ms[which].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("telemetry/{dtype}/causal_documents/paired ({ROUNDS} interleaved rounds)");
    for (i, name) in names.iter().enumerate() {
        let ratio: Vec<f64> = ms[i].iter().zip(&ms[0]).map(|(a, p)| a / p).collect();
        println!(
            "  {name:<9} median {:7.2} ms   vs plain (median of per-round ratios) {:+6.2}%",
            median(&ms[i]),
            100.0 * (median(&ratio) - 1.0)
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filter = args
        .iter()
        .find(|a| !a.starts_with('-'))
        .map(String::as_str);
    let paired_only = matches!(filter, Some("paired" | "paired-f32" | "paired-bf16"));
    if !paired_only {
        benches();
    }
    // Only under `cargo bench` (`--bench`), not when `cargo test` smoke-runs the benches.
    if args.iter().any(|a| a == "--bench") && (filter.is_none() || paired_only) {
        if filter != Some("paired-bf16") {
            paired(DType::F32);
        }
        if filter != Some("paired-f32") {
            paired(DType::BF16);
        }
    }
    Criterion::default().configure_from_args().final_summary();
}
