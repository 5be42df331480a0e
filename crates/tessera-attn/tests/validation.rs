//! Bad input (docs/semantics.md#errors): every class gives a specific `InvalidArgument` naming the argument.

use half::bf16;
use std::sync::Arc;
use tessera_attn::{
    AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardOut, GradInputs, GradOut,
    OutData, Par, StridedView, TensorView, ViewData,
};
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

fn plan(b: usize, h: usize, lq: usize, lkv: usize) -> Arc<Plan> {
    Arc::new(
        build_plan(
            &Mask::causal(),
            PlanShape::new(b, h, lq, lkv).unwrap(),
            TileShape::new(16, 16).unwrap(),
        )
        .unwrap(),
    )
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
    plan: Arc<Plan>,
}

fn fx() -> Fx {
    Fx {
        q: t(&[2, 4, 20, 8]),
        k: t(&[2, 2, 24, 8]),
        v: t(&[2, 2, 24, 6]),
        plan: plan(2, 4, 20, 24),
    }
}

/// A forward through the allocating convenience and, once q, k and v are accepted as views, the
/// same call through `prepare` + `forward_into` (outputs sized from q and v): both must give the
/// same result.
fn fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &Arc<Plan>,
    o: &AttnOptions,
) -> tessera_core::Result<()> {
    let be = CpuBackend::new();
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
    let r = be.forward(&inputs, p, o).map(|_| ());
    let prepared = be.prepare(p)?;
    let rows: usize = q.shape()[..3].iter().product();
    let mut ob = vec![0f32; rows * v.shape()[3]];
    let mut lse = vec![0f32; rows];
    let mut ml = vec![0f32; q.shape()[0] * q.shape()[1]];
    let out = ForwardOut {
        o: OutData::F32(&mut ob),
        lse: &mut lse,
        max_logit: &mut ml,
    };
    let r2 = be.forward_into(
        &prepared,
        &inputs,
        o,
        out,
        &mut CpuWorkspace::default(),
        Par::Current,
    );
    assert_eq!(
        format!("{r:?}"),
        format!("{r2:?}"),
        "forward and prepare + forward_into disagree"
    );
    r
}

#[test]
fn good_input_is_accepted() {
    let f = fx();
    fwd(&f.q, &f.k, &f.v, &f.plan, &AttnOptions::default()).unwrap();
}

#[test]
fn wrong_rank() {
    let f = fx();
    // The rank is checked where a tensor becomes a [B, H, L, D] view (`AttnInputs::contiguous`);
    // the message names the expected rank and shows the rank-3 / rank-5 shape found.
    let q3 = t(&[2, 4, 160]);
    expect_invalid(
        fwd(&q3, &f.k, &f.v, &f.plan, &AttnOptions::default()),
        "q",
        &["rank-4", "[2, 4, 160]"],
    );
    let v5 = t(&[2, 2, 24, 6, 1]);
    expect_invalid(
        fwd(&f.q, &f.k, &v5, &f.plan, &AttnOptions::default()),
        "v",
        &["rank-4", "[2, 2, 24, 6, 1]"],
    );
    let k2 = t(&[2, 2 * 24 * 8]);
    expect_invalid(
        fwd(&f.q, &k2, &f.v, &f.plan, &AttnOptions::default()),
        "k",
        &["rank-4", "[2, 384]"],
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
    // A plan for one row (head) of a mask that does not vary along rows (heads) serves any
    // batch size (head count); any other mismatch is an error.
    assert!(fwd(&f.q, &f.k, &f.v, &plan(1, 4, 20, 24), &o).is_ok());
    assert!(fwd(&f.q, &f.k, &f.v, &plan(1, 1, 20, 24), &o).is_ok());
    for p in [
        plan(3, 4, 20, 24),
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
    let mut p = (*f.plan).clone();
    p.head_plans[0].fwd_offsets.pop();
    expect_invalid(
        fwd(&f.q, &f.k, &f.v, &Arc::new(p), &o),
        "plan",
        &["consistent"],
    );
    let mut p = (*f.plan).clone();
    if let Some(e) = p.head_plans[0].fwd.first_mut() {
        e.tile = 99;
    }
    expect_invalid(
        fwd(&f.q, &f.k, &f.v, &Arc::new(p), &o),
        "plan",
        &["consistent"],
    );
}

#[test]
fn empty_and_inconsistent_views() {
    let f = fx();
    let o = AttnOptions::default();
    let q0 = Tensor::from_f32(vec![2, 4, 0, 8], vec![]).unwrap();
    expect_invalid(fwd(&q0, &f.k, &f.v, &f.plan, &o), "q", &["non-empty"]);
    // 15 elements behind a [1, 1, 4, 4] view: rejected when the view is made (its strides
    // address an element outside the storage), naming the argument.
    let data = vec![0f32; 15];
    let bad = TensorView {
        shape: &[1, 1, 4, 4],
        data: ViewData::F32(&data),
    };
    let k = t(&[1, 1, 4, 4]);
    let r = AttnInputs::contiguous(bad, k.view(), k.view())
        .and_then(|x| CpuBackend::new().forward(&x, &plan(1, 1, 4, 4), &o));
    expect_invalid(r, "q", &["15 elements", "[1, 1, 4, 4]"]);
    let r = AttnInputs::contiguous(k.view(), k.view(), bad)
        .and_then(|x| CpuBackend::new().forward(&x, &plan(1, 1, 4, 4), &o));
    expect_invalid(r, "v", &["15 elements", "[1, 1, 4, 4]"]);
    // The same through explicit strides: contiguous strides over too little storage, a row stride
    // reaching past the end, a non-unit D stride.
    expect_invalid(
        StridedView::new("k", ViewData::F32(&data), [1, 1, 4, 4], [16, 16, 4, 1]),
        "k",
        &["15 elements", "[1, 1, 4, 4]"],
    );
    let data16 = vec![0f32; 16];
    expect_invalid(
        StridedView::new("q", ViewData::F32(&data16), [1, 1, 4, 4], [16, 16, 5, 1]),
        "q",
        &["16 elements", "[1, 1, 4, 4]"],
    );
    expect_invalid(
        StridedView::new("v", ViewData::F32(&data16), [1, 1, 4, 2], [16, 16, 4, 2]),
        "v",
        &["unit stride"],
    );
    // Strides whose extent overflows usize are an error too, not a panic.
    expect_invalid(
        StridedView::new(
            "q",
            ViewData::F32(&data16),
            [1, 2, 4, 4],
            [0, usize::MAX, 4, 1],
        ),
        "q",
        &["16 elements"],
    );
    // An empty strided view reaches the kernel's check (any strides): still "non-empty".
    let empty = StridedView::new("k", ViewData::F32(&[]), [2, 2, 0, 8], [0, 0, 0, 1]).unwrap();
    let x = AttnInputs {
        k: empty,
        ..AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap()
    };
    expect_invalid(
        CpuBackend::new().forward(&x, &f.plan, &o),
        "k",
        &["non-empty"],
    );
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
    let x = AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap();
    let out = be.forward(&x, &f.plan, &opts).unwrap();
    let d_o = t(&[2, 4, 20, 6]);
    let bwd = |o: &Tensor, lse: &Tensor, d_o: &Tensor| {
        let g = GradInputs::contiguous(x, o.view(), lse.view(), d_o.view())?;
        be.backward(&g, &f.plan, &opts).map(|_| ())
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
    // d_lse (gradient of a loss on the LSE), when given, is checked like lse.
    let bwd_dlse = |d_lse: &Tensor| {
        let mut g = GradInputs::contiguous(x, out.o.view(), out.lse.view(), d_o.view())?;
        g.d_lse = Some(d_lse.view());
        be.backward(&g, &f.plan, &opts).map(|_| ())
    };
    bwd_dlse(&t(&[2, 4, 20])).unwrap();
    expect_invalid(bwd_dlse(&t(&[2, 4, 19])), "d_lse", &["[2, 4, 20]"]);
    expect_invalid(bwd_dlse(&t(&[2, 4, 20, 1])), "d_lse", &["rank 3"]);
    expect_invalid(bwd_dlse(&tb(&[2, 4, 20])), "d_lse", &["f32"]);
    // o and d_o must be rank 4 (checked when they become views).
    expect_invalid(bwd(&t(&[2, 4, 120]), &out.lse, &d_o), "o", &["rank-4"]);
    expect_invalid(bwd(&out.o, &out.lse, &t(&[8, 20, 6])), "d_o", &["rank-4"]);
}

#[test]
fn reference_validates_too() {
    let f = fx();
    let seg = SegmentIds::shared(vec![0; 19]).unwrap();
    let m = Mask::document(Segments::shared(seg));
    let r = tessera_conformance::reference::forward(
        f.q.view(),
        f.k.view(),
        f.v.view(),
        &m,
        &AttnOptions::default(),
    );
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = tessera_conformance::reference::forward(
        f.q.view(),
        t(&[2, 3, 24, 8]).view(),
        f.v.view(),
        &Mask::causal(),
        &AttnOptions::default(),
    );
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}

// ---------------------------------------------------------------------------------------------
// Caller-owned outputs (Backend API v2): wrong lengths, wrong dtypes and a dsinks buffer that
// does not match the sinks option are InvalidArgument errors naming the output, and nothing is
// written.

const SENTINEL: f32 = 12.5;

/// An output buffer of `n` sentinel elements in f32 or bf16.
enum Buf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

impl Buf {
    fn f32(n: usize) -> Self {
        Buf::F32(vec![SENTINEL; n])
    }
    fn bf16(n: usize) -> Self {
        Buf::BF16(vec![bf16::from_f32(SENTINEL); n])
    }
    fn data(&mut self) -> OutData<'_> {
        match self {
            Buf::F32(v) => OutData::F32(v),
            Buf::BF16(v) => OutData::BF16(v),
        }
    }
    fn untouched(&self) -> bool {
        match self {
            Buf::F32(v) => v.iter().all(|&x| x == SENTINEL),
            Buf::BF16(v) => v.iter().all(|&x| x.to_f32() == SENTINEL),
        }
    }
}

/// Forward outputs of the fixture: O [2, 4, 20, 6], LSE [2, 4, 20], max_logit [2, 4].
struct FwdBufs {
    o: Buf,
    lse: Vec<f32>,
    ml: Vec<f32>,
}

impl FwdBufs {
    fn good() -> Self {
        FwdBufs {
            o: Buf::f32(2 * 4 * 20 * 6),
            lse: vec![SENTINEL; 2 * 4 * 20],
            ml: vec![SENTINEL; 2 * 4],
        }
    }
    fn out(&mut self) -> ForwardOut<'_> {
        ForwardOut {
            o: self.o.data(),
            lse: &mut self.lse,
            max_logit: &mut self.ml,
        }
    }
    fn untouched(&self) -> bool {
        self.o.untouched()
            && self.lse.iter().all(|&x| x == SENTINEL)
            && self.ml.iter().all(|&x| x == SENTINEL)
    }
}

/// Backward outputs of the fixture: dQ [2, 4, 20, 8], dK [2, 2, 24, 8], dV [2, 2, 24, 6].
struct GradBufsT {
    dq: Buf,
    dk: Buf,
    dv: Buf,
    dsinks: Option<Vec<f32>>,
}

impl GradBufsT {
    fn good(sinks: bool) -> Self {
        GradBufsT {
            dq: Buf::f32(2 * 4 * 20 * 8),
            dk: Buf::f32(2 * 2 * 24 * 8),
            dv: Buf::f32(2 * 2 * 24 * 6),
            dsinks: sinks.then(|| vec![SENTINEL; 4]),
        }
    }
    fn out(&mut self) -> GradOut<'_> {
        GradOut {
            dq: self.dq.data(),
            dk: self.dk.data(),
            dv: self.dv.data(),
            dsinks: self.dsinks.as_deref_mut(),
        }
    }
    fn untouched(&self) -> bool {
        self.dq.untouched()
            && self.dk.untouched()
            && self.dv.untouched()
            && self
                .dsinks
                .as_ref()
                .is_none_or(|s| s.iter().all(|&x| x == SENTINEL))
    }
}

#[test]
fn forward_outputs_are_checked() {
    let f = fx();
    let be = CpuBackend::new();
    let prepared = be.prepare(&f.plan).unwrap();
    let x = AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap();
    let opts = AttnOptions::default();
    let mut ws = CpuWorkspace::default();
    let mut run = |mut b: FwdBufs, arg: &str, needles: &[&str]| {
        let r = be.forward_into(&prepared, &x, &opts, b.out(), &mut ws, Par::Current);
        expect_invalid(r, arg, needles);
        assert!(b.untouched(), "{arg}: outputs written on an error");
    };
    let n_o = 2 * 4 * 20 * 6;
    for n in [n_o - 1, n_o + 1, 0] {
        let mut b = FwdBufs::good();
        b.o = Buf::f32(n);
        run(b, "o", &["960 elements", &format!("{n} elements")]);
    }
    let mut b = FwdBufs::good();
    b.o = Buf::bf16(n_o);
    run(b, "o", &["f32", "bf16"]);
    for n in [159, 161] {
        let mut b = FwdBufs::good();
        b.lse = vec![SENTINEL; n];
        run(b, "lse", &["160 elements", &format!("{n} elements")]);
    }
    for n in [7, 9, 160] {
        let mut b = FwdBufs::good();
        b.ml = vec![SENTINEL; n];
        run(b, "max_logit", &["8 elements", &format!("{n} elements")]);
    }
    // The good buffers are accepted and every element is written.
    let mut b = FwdBufs::good();
    be.forward_into(&prepared, &x, &opts, b.out(), &mut ws, Par::Current)
        .unwrap();
    let Buf::F32(o) = &b.o else { unreachable!() };
    assert!(!o.contains(&SENTINEL) && !b.lse.contains(&SENTINEL) && !b.ml.contains(&SENTINEL));

    // bf16 inputs want a bf16 O.
    let (qb, kb, vb) = (tb(&[2, 4, 20, 8]), tb(&[2, 2, 24, 8]), tb(&[2, 2, 24, 6]));
    let xb = AttnInputs::contiguous(qb.view(), kb.view(), vb.view()).unwrap();
    let mut b = FwdBufs::good();
    let r = be.forward_into(&prepared, &xb, &opts, b.out(), &mut ws, Par::Current);
    expect_invalid(r, "o", &["bf16", "f32"]);
    assert!(b.untouched());
    let mut b = FwdBufs::good();
    b.o = Buf::bf16(n_o);
    be.forward_into(&prepared, &xb, &opts, b.out(), &mut ws, Par::Current)
        .unwrap();

    // The telemetry forward checks its outputs the same way.
    let flags = vec![false; 2 * 24];
    let tel = tessera_attn::TelemetryInput {
        sink_flags: &flags,
        step: 0,
        layer: 0,
        streams: Default::default(),
        outlier_ratio: 2.0,
    };
    let mut b = FwdBufs::good();
    b.o = Buf::f32(n_o - 6);
    let r = be.forward_with_telemetry_into(&prepared, &x, &opts, &tel, b.out(), &mut ws, Par::Seq);
    expect_invalid(r, "o", &["960 elements", "954 elements"]);
    assert!(b.untouched());
    let mut b = FwdBufs::good();
    b.lse = vec![SENTINEL; 3];
    let r = be.forward_with_telemetry_into(&prepared, &x, &opts, &tel, b.out(), &mut ws, Par::Seq);
    expect_invalid(r, "lse", &["160 elements"]);
    assert!(b.untouched());
}

#[test]
fn backward_outputs_are_checked() {
    let f = fx();
    let be = CpuBackend::new();
    let prepared = be.prepare(&f.plan).unwrap();
    let x = AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap();
    let d_o = t(&[2, 4, 20, 6]);
    let mut ws = CpuWorkspace::default();
    for sinks in [false, true] {
        let opts = AttnOptions {
            sinks: sinks.then(|| vec![0.5, -0.5, 1.0, 0.0]),
            ..Default::default()
        };
        let fo = be.forward(&x, &f.plan, &opts).unwrap();
        let g = GradInputs::contiguous(x, fo.o.view(), fo.lse.view(), d_o.view()).unwrap();
        let mut run = |mut b: GradBufsT, arg: &str, needles: &[&str]| {
            let r = be.backward_into(&prepared, &g, &opts, b.out(), &mut ws, Par::Current);
            expect_invalid(r, arg, needles);
            assert!(
                b.untouched(),
                "{arg} (sinks {sinks}): outputs written on an error"
            );
        };
        for n in [1279, 1281] {
            let mut b = GradBufsT::good(sinks);
            b.dq = Buf::f32(n);
            run(b, "dq", &["1280 elements", &format!("{n} elements")]);
        }
        let mut b = GradBufsT::good(sinks);
        b.dk = Buf::f32(2 * 2 * 24 * 6);
        run(b, "dk", &["768 elements", "576 elements"]);
        let mut b = GradBufsT::good(sinks);
        b.dv = Buf::f32(2 * 2 * 24 * 8);
        run(b, "dv", &["576 elements", "768 elements"]);
        let mut b = GradBufsT::good(sinks);
        b.dq = Buf::bf16(2 * 4 * 20 * 8);
        run(b, "dq", &["f32", "bf16"]);
        let mut b = GradBufsT::good(sinks);
        b.dk = Buf::bf16(2 * 2 * 24 * 8);
        run(b, "dk", &["f32", "bf16"]);
        let mut b = GradBufsT::good(sinks);
        b.dv = Buf::bf16(2 * 2 * 24 * 6);
        run(b, "dv", &["f32", "bf16"]);
        // dsinks exactly when the options have sinks, of [Hq] elements.
        let mut b = GradBufsT::good(sinks);
        b.dsinks = (!sinks).then(|| vec![SENTINEL; 4]);
        if sinks {
            run(b, "dsinks", &["sinks were given", "none"]);
        } else {
            run(b, "dsinks", &["no sinks were given", "a buffer"]);
        }
        if sinks {
            for n in [3, 5] {
                let mut b = GradBufsT::good(true);
                b.dsinks = Some(vec![SENTINEL; n]);
                run(b, "dsinks", &["4 elements", &format!("{n} elements")]);
            }
        }
        // The good buffers are accepted and every element is written.
        let mut b = GradBufsT::good(sinks);
        be.backward_into(&prepared, &g, &opts, b.out(), &mut ws, Par::Current)
            .unwrap();
        for buf in [&b.dq, &b.dk, &b.dv] {
            let Buf::F32(v) = buf else { unreachable!() };
            assert!(
                !v.contains(&SENTINEL),
                "sinks {sinks}: output element not written"
            );
        }
        if let Some(s) = &b.dsinks {
            assert!(!s.contains(&SENTINEL));
        }
    }
}

#[test]
fn workspace_sizes_validate_their_inputs() {
    let f = fx();
    let be = CpuBackend::new();
    let prepared = be.prepare(&f.plan).unwrap();
    let x = AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap();
    let n1 = be.forward_workspace_size(&prepared, &x, Par::Seq).unwrap();
    let n2 = be
        .forward_workspace_size(&prepared, &x, Par::Rayon(2))
        .unwrap();
    assert!(n1 > 0 && n2 >= n1, "{n1} {n2}");
    let other = be.prepare(&plan(2, 4, 20, 20)).unwrap();
    expect_invalid(
        be.forward_workspace_size(&other, &x, Par::Seq),
        "plan",
        &["B=2 Hq=4 Lq=20 Lkv=24"],
    );
    let out = be.forward(&x, &f.plan, &AttnOptions::default()).unwrap();
    let d_o = t(&[2, 4, 20, 6]);
    let g = GradInputs::contiguous(x, out.o.view(), out.lse.view(), d_o.view()).unwrap();
    assert!(be.backward_workspace_size(&prepared, &g, Par::Seq).unwrap() > 0);
    let bad_lse = t(&[2, 4, 21]);
    let g = GradInputs {
        lse: bad_lse.view(),
        ..g
    };
    expect_invalid(
        be.backward_workspace_size(&prepared, &g, Par::Seq),
        "lse",
        &["[2, 4, 20]"],
    );
}

/// A corrupt plan (partial-mask table not matching the plan's tile) is an `InvalidArgument`, not
/// a panic, on every entry point (docs/semantics.md#errors): `prepare` and the allocating calls check the plan's
/// consistency before deriving anything from it.
#[test]
fn corrupt_plan_tile_is_an_error_not_a_panic() {
    let f = fx();
    let o = AttnOptions::default();
    let mut p = (*f.plan).clone();
    p.tile = TileShape::new(32, 16).unwrap();
    let p = Arc::new(p);
    let be = CpuBackend::new();
    let x = AttnInputs::contiguous(f.q.view(), f.k.view(), f.v.view()).unwrap();
    let out = be.forward(&x, &f.plan, &o).unwrap();
    let d_o = t(&[2, 4, 20, 6]);
    let g = GradInputs::contiguous(x, out.o.view(), out.lse.view(), d_o.view()).unwrap();
    let calls: [(&str, &dyn Fn() -> tessera_core::Result<()>); 3] = [
        ("prepare", &|| be.prepare(&p).map(|_| ())),
        ("forward", &|| be.forward(&x, &p, &o).map(|_| ())),
        ("backward", &|| be.backward(&g, &p, &o).map(|_| ())),
    ];
    let mut panicked = Vec::new();
    for (name, call) in calls {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
            Ok(Ok(())) if name == "prepare" => {}
            Ok(r) => expect_invalid(r, "plan", &["consistent"]),
            Err(_) => panicked.push(name),
        }
    }
    assert!(
        panicked.is_empty(),
        "panicked on a corrupt plan: {panicked:?}"
    );
}
