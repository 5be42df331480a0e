//! Calls on a prepared plan do no plan preprocessing: `prepare` derives everything once (counted
//! as kernel variant `cpu.prepare` in `tessera_core::metrics`), and `forward_into`,
//! `forward_with_telemetry_into` and `backward_into` on the prepared plan add nothing to it.
//!
//! The metrics are process-wide, so this file holds exactly one test (its own test binary): no
//! other test can prepare a plan while it counts.

use half::bf16;
use std::sync::Arc;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs,
    GradBufs, GradInputs, Par, TelemetryInput,
};
use tessera_core::metrics::{snapshot, MetricsReport};
use tessera_core::Tensor;
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};
use tessera_telemetry::Streams;

fn calls(m: &MetricsReport, variant: &str) -> u64 {
    m.kernels.get(variant).map_or(0, |s| s.calls)
}

fn t(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        (0..n)
            .map(|i| ((i * 7 + seed * 13) % 23) as f32 * 0.1 - 1.1)
            .collect(),
    )
    .unwrap()
}

fn tb(t: &Tensor) -> Tensor {
    let v = t.to_f32_vec().unwrap();
    Tensor::from_bf16(
        t.shape().to_vec(),
        v.into_iter().map(bf16::from_f32).collect(),
    )
    .unwrap()
}

#[test]
fn calls_on_a_prepared_plan_do_no_preprocessing() {
    let (b, hq, hkv, l, d) = (2, 4, 2, 100, 32);
    // Partial tiles (documents) so the derived data is not trivial.
    let seg = SegmentIds::shared((0..l as i64).map(|i| i / 13).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg));
    let plan = Arc::new(
        build_plan(
            &mask,
            PlanShape::new(b, hq, l, l).unwrap(),
            TileShape::new(32, 32).unwrap(),
        )
        .unwrap(),
    );
    assert!(!plan.partials.is_empty());
    let (q, k, v, d_o) = (
        t(&[b, hq, l, d], 1),
        t(&[b, hkv, l, d], 2),
        t(&[b, hkv, l, d], 3),
        t(&[b, hq, l, d], 4),
    );
    let (qb, kb, vb) = (tb(&q), tb(&k), tb(&v));
    let opts = AttnOptions {
        sinks: Some(vec![0.5, -0.5, 0.0, 1.0]),
        ..Default::default()
    };
    let x = AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap();
    let xb = AttnInputs::contiguous(qb.view(), kb.view(), vb.view()).unwrap();
    let dims = check_inputs(&x, &opts).unwrap();
    let dims_b = check_inputs(&xb, &opts).unwrap();
    let be = CpuBackend::new();

    let m0 = snapshot();
    let prepared = be.prepare(&plan).unwrap();
    let m1 = snapshot();
    assert_eq!(
        calls(&m1, "cpu.prepare"),
        calls(&m0, "cpu.prepare") + 1,
        "prepare counts exactly one preprocessing"
    );

    let mut ws = CpuWorkspace::default();
    let mut fb = ForwardBufs::new(&dims);
    be.forward_into(&prepared, &x, &opts, fb.out(), &mut ws, Par::Current)
        .unwrap();
    be.forward_into(&prepared, &x, &opts, fb.out(), &mut ws, Par::Seq)
        .unwrap();
    let f = fb.finish(&dims).unwrap();
    let g = GradInputs::contiguous(x, f.o.view(), f.lse.view(), d_o.view()).unwrap();
    let mut gb = GradBufs::new(&dims, true);
    be.backward_into(&prepared, &g, &opts, gb.out(), &mut ws, Par::Current)
        .unwrap();
    let m2 = snapshot();
    assert_eq!(
        calls(&m2, "cpu.prepare"),
        calls(&m1, "cpu.prepare"),
        "two forward_into and one backward_into on a prepared plan preprocessed it again"
    );
    // The calls did run (and were counted as kernel calls).
    assert_eq!(
        calls(&m2, "cpu.forward.f32"),
        calls(&m1, "cpu.forward.f32") + 2
    );
    assert_eq!(
        calls(&m2, "cpu.backward.f32"),
        calls(&m1, "cpu.backward.f32") + 1
    );

    // The same prepared plan serves bf16 inputs, the workspace-size queries and the telemetry
    // forward without preprocessing either.
    let mut fbb = ForwardBufs::new(&dims_b);
    be.forward_into(&prepared, &xb, &opts, fbb.out(), &mut ws, Par::Current)
        .unwrap();
    be.forward_workspace_size(&prepared, &x, Par::Current)
        .unwrap();
    be.backward_workspace_size(&prepared, &g, Par::Rayon(2))
        .unwrap();
    let flags = vec![false; b * l];
    let tel = TelemetryInput {
        sink_flags: &flags,
        step: 0,
        layer: 0,
        streams: Streams::default(),
        outlier_ratio: 2.0,
    };
    let mut fb = ForwardBufs::new(&dims);
    be.forward_with_telemetry_into(&prepared, &x, &opts, &tel, fb.out(), &mut ws, Par::Current)
        .unwrap();
    let m3 = snapshot();
    assert_eq!(calls(&m3, "cpu.prepare"), calls(&m1, "cpu.prepare"));
    assert_eq!(
        calls(&m3, "cpu.forward.bf16"),
        calls(&m2, "cpu.forward.bf16") + 1
    );

    // The allocating conveniences prepare once per call (they have no prepared plan to reuse).
    be.forward(&x, &plan, &opts).unwrap();
    let m4 = snapshot();
    assert_eq!(calls(&m4, "cpu.prepare"), calls(&m3, "cpu.prepare") + 1);
}
