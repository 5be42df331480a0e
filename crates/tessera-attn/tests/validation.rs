//! Bad input (SPEC §10): every class gives a specific `InvalidArgument` naming the argument.

use half::bf16;
use tessera_attn::{AttnOptions, Backend, CpuBackend, TensorView, ViewData};
use tessera_core::{Error, Tensor};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

fn t(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        (0..n).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect(),
    )
    .unwrap()
}

fn tb(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_bf16(shape.to_vec(), vec![bf16::from_f32(0.25); n]).unwrap()
}

fn plan(b: usize, h: usize, lq: usize, lkv: usize) -> Plan {
    build_plan(
        &Mask::causal(),
        PlanShape::new(b, h, lq, lkv).unwrap(),
        TileShape::new(16, 16).unwrap(),
    )
    .unwrap()
}

/// Asserts an InvalidArgument naming `arg` whose message contains every `needles`.
fn expect_invalid<T: std::fmt::Debug>(r: tessera_core::Result<T>, arg: &str, needles: &[&str]) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("{arg}: expected ")),
                "{msg:?} should name {arg}"
            );
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
            }
        }
        other => panic!("expected InvalidArgument for {arg}, got {other:?}"),
    }
}

struct Fx {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
}

fn fx() -> Fx {
    Fx {
        q: t(&[2, 4, 20, 8]),
        k: t(&[2, 2, 24, 8]),
        v: t(&[2, 2, 24, 6]),
        plan: plan(2, 4, 20, 24),
    }
}

fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, p: &Plan, o: &AttnOptions) -> tessera_core::Result<()> {
    CpuBackend::new()
        .forward(q.view(), k.view(), v.view(), p, o)
        .map(|_| ())
}

#[test]
fn good_input_is_accepted() {
    let f = fx();
    fwd(&f.q, &f.k, &f.v, &f.plan, &AttnOptions::default()).unwrap();
}

#[test]
fn wrong_rank() {
    let f = fx();
    let q3 = t(&[2, 4, 160]);
    expect_invalid(
        fwd(&q3, &f.k, &f.v, &f.plan, &AttnOptions::default()),
        "q",
        &["rank 4", "rank 3"],
    );
    let v5 = t(&[2, 2, 24, 6, 1]);
    expect_invalid(
        fwd(&f.q, &f.k, &v5, &f.plan, &AttnOptions::default()),
        "v",
        &["rank 4", "rank 5"],
    );
}

#[test]
fn inconsistent_shapes() {
    let f = fx();
    let o = AttnOptions::default();
    // Dqk of k differs from q.
    expect_invalid(
        fwd(&f.q, &t(&[2, 2, 24, 9]), &f.v, &f.plan, &o),
        "k",
        &["Dqk", "8", "9"],
    );
    // Batch of k differs.
    expect_invalid(
        fwd(&f.q, &t(&[1, 2, 24, 8]), &f.v, &f.plan, &o),
        "k",
        &["batch"],
    );
    // Batch of v differs.
    expect_invalid(
        fwd(&f.q, &f.k, &t(&[1, 2, 24, 6]), &f.plan, &o),
        "v",
        &["batch"],
    );
    // Hkv of v differs from k.
    expect_invalid(
        fwd(&f.q, &f.k, &t(&[2, 1, 24, 6]), &f.plan, &o),
        "v",
        &["Hkv"],
    );
    // Lkv of v differs from k.
    expect_invalid(
        fwd(&f.q, &f.k, &t(&[2, 2, 23, 6]), &f.plan, &o),
        "v",
        &["Lkv", "24", "23"],
    );
}

#[test]
fn gqa_ratio() {
    let q = t(&[1, 3, 16, 8]);
    let k = t(&[1, 2, 16, 8]);
    let v = t(&[1, 2, 16, 8]);
    expect_invalid(
        fwd(&q, &k, &v, &plan(1, 3, 16, 16), &AttnOptions::default()),
        "k",
        &["Hkv", "Hq = 3", "Hkv = 2"],
    );
}

#[test]
fn dtype_mismatch_and_unsupported() {
    let f = fx();
    let o = AttnOptions::default();
    expect_invalid(
        fwd(&f.q, &tb(&[2, 2, 24, 8]), &f.v, &f.plan, &o),
        "k",
        &["f32", "bf16"],
    );
    expect_invalid(
        fwd(&f.q, &f.k, &tb(&[2, 2, 24, 6]), &f.plan, &o),
        "v",
        &["f32", "bf16"],
    );
    let qi = Tensor::new(
        vec![2, 4, 20, 8],
        tessera_core::TensorData::I32(vec![1; 2 * 4 * 20 * 8]),
    )
    .unwrap();
    expect_invalid(
        fwd(&qi, &f.k, &f.v, &f.plan, &o),
        "q",
        &["f32 or bf16", "i32"],
    );
}

#[test]
fn plan_mismatch() {
    let f = fx();
    let o = AttnOptions::default();
    for p in [
        plan(1, 4, 20, 24),
        plan(2, 2, 20, 24),
        plan(2, 4, 21, 24),
        plan(2, 4, 20, 20),
    ] {
        expect_invalid(
            fwd(&f.q, &f.k, &f.v, &p, &o),
            "plan",
            &["B=2 Hq=4 Lq=20 Lkv=24"],
        );
    }
    // A corrupt plan is an error, not a panic.
    let mut p = f.plan.clone();
    p.head_plans[0].fwd_offsets.pop();
    expect_invalid(fwd(&f.q, &f.k, &f.v, &p, &o), "plan", &["consistent"]);
    let mut p = f.plan.clone();
    if let Some(e) = p.head_plans[0].fwd.first_mut() {
        e.tile = 99;
    }
    expect_invalid(fwd(&f.q, &f.k, &f.v, &p, &o), "plan", &["consistent"]);
}

#[test]
fn empty_and_inconsistent_views() {
    let f = fx();
    let o = AttnOptions::default();
    let q0 = Tensor::from_f32(vec![2, 4, 0, 8], vec![]).unwrap();
    expect_invalid(fwd(&q0, &f.k, &f.v, &f.plan, &o), "q", &["non-empty"]);
    let data = vec![0f32; 15];
    let bad = TensorView {
        shape: &[1, 1, 4, 4],
        data: ViewData::F32(&data),
    };
    let k = t(&[1, 1, 4, 4]);
    let r = CpuBackend::new().forward(bad, k.view(), k.view(), &plan(1, 1, 4, 4), &o);
    expect_invalid(r, "q", &["16 elements", "15 elements"]);
}

#[test]
fn bad_scale_softcap_sinks() {
    let f = fx();
    for bad in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
        let o = AttnOptions {
            scale: Some(bad),
            ..Default::default()
        };
        expect_invalid(
            fwd(&f.q, &f.k, &f.v, &f.plan, &o),
            "scale",
            &["finite positive"],
        );
        let o = AttnOptions {
            softcap: Some(bad),
            ..Default::default()
        };
        expect_invalid(
            fwd(&f.q, &f.k, &f.v, &f.plan, &o),
            "softcap",
            &["finite positive"],
        );
    }
    let o = AttnOptions {
        sinks: Some(vec![0.0; 3]),
        ..Default::default()
    };
    expect_invalid(
        fwd(&f.q, &f.k, &f.v, &f.plan, &o),
        "sinks",
        &["4 values", "3 values"],
    );
    let o = AttnOptions {
        sinks: Some(vec![0.0, 1.0, f32::NAN, 0.0]),
        ..Default::default()
    };
    expect_invalid(
        fwd(&f.q, &f.k, &f.v, &f.plan, &o),
        "sinks",
        &["finite", "head 2"],
    );
}

#[test]
fn backward_inputs() {
    let f = fx();
    let be = CpuBackend::new();
    let opts = AttnOptions::default();
    let out = be
        .forward(f.q.view(), f.k.view(), f.v.view(), &f.plan, &opts)
        .unwrap();
    let d_o = t(&[2, 4, 20, 6]);
    let bwd = |o: &Tensor, lse: &Tensor, d_o: &Tensor| {
        be.backward(
            f.q.view(),
            f.k.view(),
            f.v.view(),
            o.view(),
            lse.view(),
            d_o.view(),
            &f.plan,
            &opts,
        )
        .map(|_| ())
    };
    bwd(&out.o, &out.lse, &d_o).unwrap();
    expect_invalid(
        bwd(&t(&[2, 4, 20, 7]), &out.lse, &d_o),
        "o",
        &["[2, 4, 20, 6]"],
    );
    expect_invalid(
        bwd(&out.o, &out.lse, &t(&[2, 4, 19, 6])),
        "d_o",
        &["[2, 4, 20, 6]"],
    );
    expect_invalid(
        bwd(&out.o, &out.lse, &tb(&[2, 4, 20, 6])),
        "d_o",
        &["f32", "bf16"],
    );
    expect_invalid(
        bwd(&tb(&[2, 4, 20, 6]), &out.lse, &d_o),
        "o",
        &["f32", "bf16"],
    );
    expect_invalid(bwd(&out.o, &t(&[2, 4, 21]), &d_o), "lse", &["[2, 4, 20]"]);
    expect_invalid(bwd(&out.o, &t(&[2, 4, 20, 1]), &d_o), "lse", &["rank 3"]);
    expect_invalid(bwd(&out.o, &tb(&[2, 4, 20]), &d_o), "lse", &["f32"]);
}

#[test]
fn reference_validates_too() {
    let f = fx();
    let seg = SegmentIds::shared(vec![0; 19]).unwrap();
    let m = Mask::document(Segments::shared(seg));
    let r = tessera_attn::reference::forward(
        f.q.view(),
        f.k.view(),
        f.v.view(),
        &m,
        &AttnOptions::default(),
    );
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = tessera_attn::reference::forward(
        f.q.view(),
        t(&[2, 3, 24, 8]).view(),
        f.v.view(),
        &Mask::causal(),
        &AttnOptions::default(),
    );
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}
