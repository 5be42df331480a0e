//! Exact semantics beyond tolerance checks: fully masked rows, NaN propagation, determinism
//! across thread counts, kernel copies (ISA fallbacks), metrics; and Backend API v2: strided and
//! expanded (head stride 0) inputs, every `Par`, and workspaces reused across problems.

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tessera_attn::cpu::Isa;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, BackwardOutput, CpuBackend, CpuPlan,
    CpuWorkspace, ForwardBufs, ForwardOutput, GradBufs, GradInputs, Par, StridedView,
};
use tessera_conformance::cpu_backend_or_skip;
use tessera_conformance::workloads::packed_segments;
use tessera_conformance::{reference, run_case, standard_cases};
use tessera_core::{DType, Tensor, TensorData};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

fn rand_t(rng: &mut ChaCha8Rng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        (0..n).map(|_| rng.gen_range(-1.5f32..1.5)).collect(),
    )
    .unwrap()
}

fn plan(mask: &Mask, b: usize, h: usize, lq: usize, lkv: usize, tile: usize) -> Arc<Plan> {
    Arc::new(
        build_plan(
            mask,
            PlanShape::new(b, h, lq, lkv).unwrap(),
            TileShape::new(tile, tile).unwrap(),
        )
        .unwrap(),
    )
}

/// Contiguous attention inputs.
fn inp<'a>(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> AttnInputs<'a> {
    AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap()
}

/// Contiguous backward inputs.
fn grad_inp<'a>(
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    o: &'a Tensor,
    lse: &'a Tensor,
    d_o: &'a Tensor,
) -> GradInputs<'a> {
    GradInputs::contiguous(inp(q, k, v), o.view(), lse.view(), d_o.view()).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

#[test]
fn backend_is_object_safe_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CpuBackend>();
    let b: Box<dyn Backend<Prepared = CpuPlan, Workspace = CpuWorkspace>> =
        Box::new(CpuBackend::new());
    assert_eq!(b.name(), "cpu");
}

#[test]
fn fully_masked_rows_are_exact() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (b, h, l, d) = (2, 2, 40, 16);
    let q = rand_t(&mut rng, &[b, h, l, d]);
    let k = rand_t(&mut rng, &[b, h, l, d]);
    let v = rand_t(&mut rng, &[b, h, l, d]);
    // Row 1 of the batch pads its first 8 and last 10 tokens.
    let mut ids = vec![0i64; l];
    ids.extend((0..l).map(|i| {
        if !(8..30).contains(&i) {
            -1
        } else {
            (i / 9) as i64
        }
    }));
    let mask = Mask::causal()
        & Mask::document(Segments::shared(
            SegmentIds::new(2, l, ids.clone()).unwrap(),
        ));
    let p = plan(&mask, b, h, l, l, 16);
    let be = CpuBackend::new();
    for sinks in [None, Some(vec![0.75f32, -1.25])] {
        let opts = AttnOptions {
            sinks: sinks.clone(),
            ..Default::default()
        };
        let f = be.forward(&inp(&q, &k, &v), &p, &opts).unwrap();
        let (o, lse) = (f32s(&f.o), f32s(&f.lse));
        for hh in 0..h {
            for i in 0..l {
                let padded = ids[l + i] < 0;
                let row = ((h + hh) * l + i) * d;
                let lse_v = lse[(h + hh) * l + i];
                if padded {
                    assert!(o[row..row + d].iter().all(|&x| x == 0.0), "O row must be 0");
                    match &sinks {
                        None => assert_eq!(lse_v, f32::NEG_INFINITY),
                        Some(s) => assert_eq!(lse_v, s[hh]),
                    }
                } else {
                    assert!(lse_v.is_finite());
                    assert!(o[row..row + d].iter().all(|x| x.is_finite()));
                }
            }
        }
        // Backward: padded rows get zero dQ; nothing is NaN.
        let d_o = rand_t(&mut rng, &[b, h, l, d]);
        let g = be
            .backward(&grad_inp(&q, &k, &v, &f.o, &f.lse, &d_o), &p, &opts)
            .unwrap();
        let dq = f32s(&g.dq);
        for hh in 0..h {
            for i in (0..l).filter(|&i| ids[l + i] < 0) {
                let row = ((h + hh) * l + i) * d;
                assert!(dq[row..row + d].iter().all(|&x| x == 0.0));
            }
        }
        for t in [&g.dq, &g.dk, &g.dv] {
            assert!(f32s(t).iter().all(|x| x.is_finite()));
        }
    }
    // A mask allowing nothing at all.
    let none = Mask::full() & !Mask::full();
    let p = plan(&none, b, h, l, l, 16);
    let f = be
        .forward(&inp(&q, &k, &v), &p, &AttnOptions::default())
        .unwrap();
    assert!(f32s(&f.o).iter().all(|&x| x == 0.0));
    assert!(f32s(&f.lse).iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(f32s(&f.max_logit).iter().all(|&x| x == f32::NEG_INFINITY));
}

/// The positions of NaN in `x` equal those in the reference `r`, and everything else is finite.
fn same_nan_pattern(name: &str, x: &[f32], r: &[f64]) {
    same_nan_pattern_opt(name, x, r, true)
}

fn same_nan_pattern_opt(name: &str, x: &[f32], r: &[f64], expect_nan: bool) {
    assert_eq!(x.len(), r.len());
    let mut nans = 0;
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        assert_eq!(
            a.is_nan(),
            b.is_nan(),
            "{name}[{i}]: kernel {a}, reference {b}"
        );
        if !b.is_nan() {
            assert!(!a.is_nan(), "{name}[{i}]");
        }
        nans += b.is_nan() as usize;
    }
    assert!(
        !expect_nan || nans > 0,
        "{name}: the test should poison something"
    );
}

fn poison(t: &Tensor, at: usize) -> Tensor {
    let mut v = f32s(t);
    v[at] = f32::NAN;
    Tensor::from_f32(t.shape().to_vec(), v).unwrap()
}

#[test]
fn nan_propagates_to_affected_outputs_only() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (b, h, l, d) = (1, 2, 50, 16);
    let q = rand_t(&mut rng, &[b, h, l, d]);
    let k = rand_t(&mut rng, &[b, h, l, d]);
    let v = rand_t(&mut rng, &[b, h, l, d]);
    let d_o = rand_t(&mut rng, &[b, h, l, d]);
    // Documents of 7 tokens: poison stays inside its document even within a shared tile.
    let seg = SegmentIds::shared((0..l as i64).map(|i| i / 7).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg));
    let p = plan(&mask, b, h, l, l, 16);
    let be = CpuBackend::new();
    let opts = AttnOptions::default();
    let clean = be.forward(&inp(&q, &k, &v), &p, &opts).unwrap();
    let row = |hh: usize, i: usize| (hh * l + i) * d + 3;
    for (which, qq, kk, vv) in [
        ("q", poison(&q, row(0, 20)), k.clone(), v.clone()),
        ("k", q.clone(), poison(&k, row(1, 22)), v.clone()),
        ("v", q.clone(), k.clone(), poison(&v, row(0, 23))),
    ] {
        let f: ForwardOutput = be.forward(&inp(&qq, &kk, &vv), &p, &opts).unwrap();
        let r = reference::forward(qq.view(), kk.view(), vv.view(), &mask, &opts).unwrap();
        same_nan_pattern(&format!("{which}: o"), &f32s(&f.o), &r.o);
        // Unaffected outputs are exactly those of the clean inputs.
        for (name, got, want) in [("o", &f.o, &clean.o), ("lse", &f.lse, &clean.lse)] {
            for (i, (a, b)) in f32s(got).iter().zip(f32s(want)).enumerate() {
                assert!(
                    a.is_nan() || *a == b,
                    "{which}: {name}[{i}] {a} != clean {b}"
                );
            }
        }
        if which != "v" {
            same_nan_pattern(&format!("{which}: lse"), &f32s(&f.lse), &r.lse);
        } else {
            assert!(f32s(&f.lse).iter().all(|x| x.is_finite()));
        }
        let ml = f32s(&f.max_logit);
        for (a, b) in ml.iter().zip(&r.max_logit) {
            assert_eq!(a.is_nan(), b.is_nan(), "{which}: max_logit");
        }
        let g = be
            .backward(&grad_inp(&qq, &kk, &vv, &f.o, &f.lse, &d_o), &p, &opts)
            .unwrap();
        let rb =
            reference::backward(qq.view(), kk.view(), vv.view(), d_o.view(), &mask, &opts).unwrap();
        same_nan_pattern(&format!("{which}: dq"), &f32s(&g.dq), &rb.dq);
        same_nan_pattern(&format!("{which}: dk"), &f32s(&g.dk), &rb.dk);
        // dV does not depend on V: poisoning V leaves it finite.
        same_nan_pattern_opt(&format!("{which}: dv"), &f32s(&g.dv), &rb.dv, which != "v");
    }
    // NaN in dO poisons only the gradients that depend on that row.
    let f = be.forward(&inp(&q, &k, &v), &p, &opts).unwrap();
    let dop = poison(&d_o, row(1, 30));
    let g = be
        .backward(&grad_inp(&q, &k, &v, &f.o, &f.lse, &dop), &p, &opts)
        .unwrap();
    let rb = reference::backward(q.view(), k.view(), v.view(), dop.view(), &mask, &opts).unwrap();
    same_nan_pattern("d_o: dq", &f32s(&g.dq), &rb.dq);
    same_nan_pattern("d_o: dk", &f32s(&g.dk), &rb.dk);
    same_nan_pattern("d_o: dv", &f32s(&g.dv), &rb.dv);
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (b, hq, hkv, l, d) = (2, 4, 2, 150, 32);
    let q = rand_t(&mut rng, &[b, hq, l, d]);
    let k = rand_t(&mut rng, &[b, hkv, l, d]);
    let v = rand_t(&mut rng, &[b, hkv, l, d]);
    let d_o = rand_t(&mut rng, &[b, hq, l, d]);
    let mask = Mask::causal() & Mask::window(60, 0);
    let p = plan(&mask, b, hq, l, l, 32);
    let opts = AttnOptions {
        sinks: Some(vec![0.1, 0.2, 0.3, 0.4]),
        softcap: Some(10.0),
        ..Default::default()
    };
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let be = CpuBackend::new();
            let f = be.forward(&inp(&q, &k, &v), &p, &opts).unwrap();
            let g = be
                .backward(&grad_inp(&q, &k, &v, &f.o, &f.lse, &d_o), &p, &opts)
                .unwrap();
            (f, g)
        })
    };
    let (f1, g1) = run(1);
    for threads in [2, 3] {
        let (f, g) = run(threads);
        assert_eq!(f, f1, "forward with {threads} threads");
        assert_eq!(g, g1, "backward with {threads} threads");
    }
}

#[test]
fn every_kernel_copy_passes_a_sample_of_the_suite() {
    let names = [
        "mask/and_causal_document",
        "mask/dense_random",
        "len/33x17",
        "gqa/8to2_softcap_sinks",
        "dims/40x24",
        "tile/32x64",
        "masked/padding_rows_sinks",
        "bf16/batch_document",
    ];
    let cases: Vec<_> = standard_cases()
        .into_iter()
        .filter(|c| names.contains(&c.name.as_str()))
        .collect();
    assert_eq!(cases.len(), names.len());
    for isa in Isa::ALL {
        let Some(be) = cpu_backend_or_skip(isa) else {
            continue;
        };
        for c in &cases {
            let r = run_case(&be, c).unwrap();
            assert!(r.passed(), "{isa:?}: {r}");
        }
    }
}

#[test]
fn kernel_calls_are_recorded() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let q = rand_t(&mut rng, &[1, 1, 20, 8]);
    let p = plan(&Mask::causal(), 1, 1, 20, 20, 16);
    let before = tessera_core::metrics::snapshot();
    let be = CpuBackend::new();
    let f = be
        .forward(&inp(&q, &q, &q), &p, &AttnOptions::default())
        .unwrap();
    be.backward(
        &grad_inp(&q, &q, &q, &f.o, &f.lse, &q),
        &p,
        &AttnOptions::default(),
    )
    .unwrap();
    let after = tessera_core::metrics::snapshot();
    let calls =
        |m: &tessera_core::metrics::MetricsReport, k: &str| m.kernels.get(k).map_or(0, |s| s.calls);
    assert!(calls(&after, "cpu.forward.f32") > calls(&before, "cpu.forward.f32"));
    assert!(calls(&after, "cpu.backward.f32") > calls(&before, "cpu.backward.f32"));
}

#[test]
fn max_logit_is_taken_before_softcap() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let q = rand_t(&mut rng, &[1, 1, 30, 16]);
    let k = rand_t(&mut rng, &[1, 1, 30, 16]);
    let p = plan(&Mask::full(), 1, 1, 30, 30, 16);
    let opts = AttnOptions {
        scale: Some(2.0),
        softcap: Some(1.0),
        sinks: None,
    };
    let f = CpuBackend::new()
        .forward(&inp(&q, &k, &k), &p, &opts)
        .unwrap();
    let r = reference::forward(q.view(), k.view(), k.view(), &Mask::full(), &opts).unwrap();
    let m = f32s(&f.max_logit)[0];
    assert!(m > 1.0, "max_logit {m} must exceed the softcap");
    assert!((m as f64 - r.max_logit[0]).abs() < 1e-4 * r.max_logit[0].abs());
}

// ---------------------------------------------------------------------------------------------
// Backend API v2: strided inputs, explicit parallelism, workspace reuse.

/// `vals` as a tensor of `dtype` (bf16 rounds them).
fn mk(dtype: DType, shape: &[usize], vals: Vec<f32>) -> Tensor {
    match dtype {
        DType::BF16 => Tensor::from_bf16(
            shape.to_vec(),
            vals.into_iter().map(bf16::from_f32).collect(),
        ),
        _ => Tensor::from_f32(shape.to_vec(), vals),
    }
    .unwrap()
}

fn rand_mk(rng: &mut ChaCha8Rng, dtype: DType, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    mk(
        dtype,
        shape,
        (0..n).map(|_| rng.gen_range(-1.5f32..1.5)).collect(),
    )
}

/// Raw bits of an f32 or bf16 tensor (bit-identity, not value equality: -0.0 and NaN count).
fn bits(t: &Tensor) -> Vec<u32> {
    match t.data() {
        TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        _ => panic!("float tensor expected"),
    }
}

/// `t` (f32 or bf16) with element `at` set to NaN.
fn poison_any(t: &Tensor, at: usize) -> Tensor {
    let mut v = f32s(t);
    v[at] = f32::NAN;
    mk(t.dtype(), t.shape(), v)
}

/// A `[B, H, L, D]` tensor's values stored in `[B, L, H, D]` order (shape `[B, L, H, D]`).
fn to_blhd(t: &Tensor) -> Tensor {
    let [nb, nh, nl, nd] = *t.shape() else {
        panic!("rank 4 expected")
    };
    let src = |i: usize| {
        // Index i of [B, L, H, D] -> index of [B, H, L, D].
        let (x, r) = (i % nd, i / nd);
        let (h, r) = (r % nh, r / nh);
        let (l, b) = (r % nl, r / nl);
        ((b * nh + h) * nl + l) * nd + x
    };
    let n = t.numel();
    let shape = vec![nb, nl, nh, nd];
    match t.data() {
        TensorData::F32(v) => Tensor::from_f32(shape, (0..n).map(|i| v[src(i)]).collect()),
        TensorData::BF16(v) => Tensor::from_bf16(shape, (0..n).map(|i| v[src(i)]).collect()),
        _ => panic!("float tensor expected"),
    }
    .unwrap()
}

/// The `[B, H, L, D]` view of a tensor stored `[B, L, H, D]`: strides `[L·H·D, D, H·D, 1]`.
fn blhd_view<'a>(name: &str, t: &'a Tensor) -> StridedView<'a> {
    let [b, l, h, d] = *t.shape() else {
        panic!("rank 4 expected")
    };
    StridedView::new(name, t.view().data, [b, h, l, d], [l * h * d, d, h * d, 1]).unwrap()
}

/// A `[B, 1, L, D]` (or `[1, 1, L, D]`) tensor viewed as `[batch, heads, L, D]` with head
/// stride 0 (expanded, MQA) and, for a single stored batch row, batch stride 0 too.
fn expanded_view<'a>(name: &str, t: &'a Tensor, batch: usize, heads: usize) -> StridedView<'a> {
    let [tb, 1, l, d] = *t.shape() else {
        panic!("[B, 1, L, D] expected")
    };
    let sb = if tb == 1 { 0 } else { l * d };
    StridedView::new(name, t.view().data, [batch, heads, l, d], [sb, 0, d, 1]).unwrap()
}

/// The contiguous copy of `t` (`[B, 1, L, D]` or `[1, 1, L, D]`) repeated over `batch` rows and
/// `heads` heads.
fn repeat_heads(t: &Tensor, batch: usize, heads: usize) -> Tensor {
    let [tb, 1, l, d] = *t.shape() else {
        panic!("[B, 1, L, D] expected")
    };
    let per = l * d;
    let shape = vec![batch, heads, l, d];
    let idx = |i: usize| {
        let b = i / (heads * per);
        (if tb == 1 { 0 } else { b }) * per + i % per
    };
    let n = batch * heads * per;
    match t.data() {
        TensorData::F32(v) => Tensor::from_f32(shape, (0..n).map(|i| v[idx(i)]).collect()),
        TensorData::BF16(v) => Tensor::from_bf16(shape, (0..n).map(|i| v[idx(i)]).collect()),
        _ => panic!("float tensor expected"),
    }
    .unwrap()
}

/// `forward_into` on a prepared plan into NaN-poisoned buffers.
fn fwd_into(
    be: &CpuBackend,
    prepared: &CpuPlan,
    x: &AttnInputs<'_>,
    opts: &AttnOptions,
    ws: &mut CpuWorkspace,
    par: Par<'_>,
) -> ForwardOutput {
    let d = check_inputs(x, opts).unwrap();
    let mut bufs = ForwardBufs::new(&d);
    let mut out = bufs.out();
    out.o.poison();
    out.lse.fill(f32::NAN);
    out.max_logit.fill(f32::NAN);
    be.forward_into(prepared, x, opts, out, ws, par).unwrap();
    bufs.finish(&d).unwrap()
}

/// `backward_into` on a prepared plan into NaN-poisoned buffers.
fn bwd_into(
    be: &CpuBackend,
    prepared: &CpuPlan,
    x: &GradInputs<'_>,
    opts: &AttnOptions,
    ws: &mut CpuWorkspace,
    par: Par<'_>,
) -> BackwardOutput {
    let d = check_inputs(&x.forward(), opts).unwrap();
    let mut bufs = GradBufs::new(&d, opts.sinks.is_some());
    let mut out = bufs.out();
    out.dq.poison();
    out.dk.poison();
    out.dv.poison();
    if let Some(s) = out.dsinks.as_deref_mut() {
        s.fill(f32::NAN);
    }
    be.backward_into(prepared, x, opts, out, ws, par).unwrap();
    bufs.finish(&d).unwrap()
}

fn assert_same_fwd(a: &ForwardOutput, b: &ForwardOutput, what: &str) {
    assert_eq!(a.o.dtype(), b.o.dtype(), "{what}: O dtype");
    assert_eq!(a.o.shape(), b.o.shape(), "{what}: O shape");
    assert_eq!(bits(&a.o), bits(&b.o), "{what}: O not bit-identical");
    assert_eq!(bits(&a.lse), bits(&b.lse), "{what}: LSE not bit-identical");
    assert_eq!(
        bits(&a.max_logit),
        bits(&b.max_logit),
        "{what}: max_logit not bit-identical"
    );
}

fn assert_same_bwd(a: &BackwardOutput, b: &BackwardOutput, what: &str) {
    for (name, x, y) in [
        ("dq", &a.dq, &b.dq),
        ("dk", &a.dk, &b.dk),
        ("dv", &a.dv, &b.dv),
    ] {
        assert_eq!(x.dtype(), y.dtype(), "{what}: {name} dtype");
        assert_eq!(x.shape(), y.shape(), "{what}: {name} shape");
        assert_eq!(bits(x), bits(y), "{what}: {name} not bit-identical");
    }
    match (&a.dsinks, &b.dsinks) {
        (Some(x), Some(y)) => assert_eq!(bits(x), bits(y), "{what}: dsinks not bit-identical"),
        (None, None) => {}
        _ => panic!("{what}: dsinks present in one run only"),
    }
}

/// One problem of the API tests below.
#[derive(Clone)]
struct Prob {
    name: &'static str,
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    dqk: usize,
    dv: usize,
    tile: (usize, usize),
    dtype: DType,
    softcap: Option<f32>,
    sinks: bool,
}

impl Prob {
    fn mask(&self) -> Mask {
        let seg = packed_segments(self.b, self.l, self.l / 3, self.l as u64).unwrap();
        Mask::causal() & Mask::document(Segments::shared(seg))
    }
    fn plan(&self) -> Arc<Plan> {
        Arc::new(
            build_plan(
                &self.mask(),
                PlanShape::new(self.b, self.hq, self.l, self.l).unwrap(),
                TileShape::new(self.tile.0, self.tile.1).unwrap(),
            )
            .unwrap(),
        )
    }
    fn opts(&self) -> AttnOptions {
        AttnOptions {
            scale: None,
            softcap: self.softcap,
            sinks: self
                .sinks
                .then(|| (0..self.hq).map(|h| 0.3 * h as f32 - 0.5).collect()),
        }
    }
    fn with_dtype(&self, dtype: DType) -> Self {
        Prob {
            dtype,
            ..self.clone()
        }
    }
    /// Seeded q `[B, Hq, L, Dqk]`, k `[B, Hkv, L, Dqk]`, v `[B, Hkv, L, Dv]`, dO `[B, Hq, L, Dv]`.
    fn tensors(&self, seed: u64) -> [Tensor; 4] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (b, l, dt) = (self.b, self.l, self.dtype);
        [
            rand_mk(&mut rng, dt, &[b, self.hq, l, self.dqk]),
            rand_mk(&mut rng, dt, &[b, self.hkv, l, self.dqk]),
            rand_mk(&mut rng, dt, &[b, self.hkv, l, self.dv]),
            rand_mk(&mut rng, dt, &[b, self.hq, l, self.dv]),
        ]
    }
}

/// Problems with partial and full tiles, ragged last tiles, GQA, head dims that are and are not
/// multiples of 16 (f32 rows are read in place at their own stride only in the first case),
/// softcap and sinks.
fn api_probs() -> Vec<Prob> {
    let base = Prob {
        name: "gqa_sinks",
        b: 2,
        hq: 4,
        hkv: 2,
        l: 75,
        dqk: 32,
        dv: 32,
        tile: (16, 16),
        dtype: DType::F32,
        softcap: None,
        sinks: true,
    };
    vec![
        base.clone(),
        Prob {
            name: "odd_dims_softcap",
            b: 1,
            hq: 2,
            hkv: 1,
            l: 90,
            dqk: 40,
            dv: 24,
            tile: (32, 64),
            softcap: Some(5.0),
            sinks: false,
            ..base.clone()
        },
        Prob {
            name: "default_tiles",
            b: 1,
            hq: 2,
            hkv: 2,
            l: 300,
            dqk: 64,
            dv: 64,
            tile: (128, 128),
            softcap: Some(20.0),
            ..base
        },
    ]
}

/// Q, K, V, dO (and O) read through `[B, L, H, D]`-strided views, and K/V shared by every query
/// head through a head stride of 0, give exactly the bits of the contiguous copies: forward and
/// backward, f32 and bf16, every kernel copy this CPU runs.
#[test]
fn strided_and_expanded_inputs_match_contiguous_copies_bit_for_bit() {
    for isa in Isa::ALL {
        let Some(be) = cpu_backend_or_skip(isa) else {
            continue;
        };
        for dtype in [DType::F32, DType::BF16] {
            for p in api_probs() {
                let p = p.with_dtype(dtype);
                let what = format!("{isa:?} {dtype} {}", p.name);
                let (plan, opts) = (p.plan(), p.opts());
                let prepared = be.prepare(&plan).unwrap();
                let mut ws = CpuWorkspace::default();
                let [q, k, v, d_o] = p.tensors(17);

                // [B, L, H, D] storage, [B, H, L, D] views.
                let contiguous = inp(&q, &k, &v);
                let f1 = fwd_into(&be, &prepared, &contiguous, &opts, &mut ws, Par::Current);
                let (qs, ks, vs, dos) = (to_blhd(&q), to_blhd(&k), to_blhd(&v), to_blhd(&d_o));
                let strided = AttnInputs {
                    q: blhd_view("q", &qs),
                    k: blhd_view("k", &ks),
                    v: blhd_view("v", &vs),
                };
                assert!(!strided.q.is_contiguous() || p.hq == 1);
                let f2 = fwd_into(&be, &prepared, &strided, &opts, &mut ws, Par::Current);
                assert_same_fwd(&f1, &f2, &format!("{what}: strided forward"));
                let g1 = bwd_into(
                    &be,
                    &prepared,
                    &GradInputs::contiguous(contiguous, f1.o.view(), f1.lse.view(), d_o.view())
                        .unwrap(),
                    &opts,
                    &mut ws,
                    Par::Current,
                );
                let os = to_blhd(&f1.o);
                let g2 = bwd_into(
                    &be,
                    &prepared,
                    &GradInputs {
                        q: strided.q,
                        k: strided.k,
                        v: strided.v,
                        o: blhd_view("o", &os),
                        lse: f1.lse.view(),
                        d_o: blhd_view("d_o", &dos),
                        d_lse: None,
                    },
                    &opts,
                    &mut ws,
                    Par::Current,
                );
                assert_same_bwd(&g1, &g2, &format!("{what}: strided backward"));

                // A NaN in K (the non-finite input path) reads the same through the strides.
                let kn = poison_any(&k, k.numel() / 2 + 3);
                let kns = to_blhd(&kn);
                let f1 = fwd_into(&be, &prepared, &inp(&q, &kn, &v), &opts, &mut ws, Par::Seq);
                let f2 = fwd_into(
                    &be,
                    &prepared,
                    &AttnInputs {
                        k: blhd_view("k", &kns),
                        ..strided
                    },
                    &opts,
                    &mut ws,
                    Par::Seq,
                );
                assert!(f32s(&f1.o).iter().any(|x| x.is_nan()), "{what}: no NaN");
                assert_same_fwd(&f1, &f2, &format!("{what}: strided forward, NaN in K"));

                // One K/V head expanded to every query head with head stride 0 (and one K/V
                // batch row shared by every batch row with batch stride 0 as well).
                let mut rng = ChaCha8Rng::seed_from_u64(23);
                for (kv_rows, q_view, layout) in [
                    (
                        p.b,
                        StridedView::contiguous("q", q.view()).unwrap(),
                        "head stride 0, contiguous q",
                    ),
                    (p.b, blhd_view("q", &qs), "head stride 0, strided q"),
                    (1, blhd_view("q", &qs), "batch and head stride 0, strided q"),
                ] {
                    let k1 = rand_mk(&mut rng, dtype, &[kv_rows, 1, p.l, p.dqk]);
                    let v1 = rand_mk(&mut rng, dtype, &[kv_rows, 1, p.l, p.dv]);
                    let (kr, vr) = (repeat_heads(&k1, p.b, p.hq), repeat_heads(&v1, p.b, p.hq));
                    let copied = inp(&q, &kr, &vr);
                    let f1 = fwd_into(&be, &prepared, &copied, &opts, &mut ws, Par::Current);
                    let expanded = AttnInputs {
                        q: q_view,
                        k: expanded_view("k", &k1, p.b, p.hq),
                        v: expanded_view("v", &v1, p.b, p.hq),
                    };
                    let w = format!("{what}: expanded K/V, {layout}");
                    let f2 = fwd_into(&be, &prepared, &expanded, &opts, &mut ws, Par::Current);
                    assert_same_fwd(&f1, &f2, &w);
                    let g1 = bwd_into(
                        &be,
                        &prepared,
                        &GradInputs::contiguous(copied, f1.o.view(), f1.lse.view(), d_o.view())
                            .unwrap(),
                        &opts,
                        &mut ws,
                        Par::Current,
                    );
                    let g2 = bwd_into(
                        &be,
                        &prepared,
                        &GradInputs::contiguous(expanded, f1.o.view(), f1.lse.view(), d_o.view())
                            .unwrap(),
                        &opts,
                        &mut ws,
                        Par::Current,
                    );
                    assert_same_bwd(&g1, &g2, &w);
                }
            }
        }
    }
}

/// `Par::Seq`, `Par::Rayon(1)`, `Par::Rayon(2)`, `Par::Pool` and `Par::Current` give the same
/// bits, with fresh workspaces and with one workspace cycled through all of them.
#[test]
fn every_par_gives_the_same_bits() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let pars = [
        ("Seq", Par::Seq),
        ("Rayon(1)", Par::Rayon(1)),
        ("Rayon(2)", Par::Rayon(2)),
        ("Pool(3)", Par::Pool(&pool)),
        ("Current", Par::Current),
        ("Rayon(0)", Par::Rayon(0)),
    ];
    let be = CpuBackend::new();
    for dtype in [DType::F32, DType::BF16] {
        for p in api_probs() {
            let p = p.with_dtype(dtype);
            let (plan, opts) = (p.plan(), p.opts());
            let prepared = be.prepare(&plan).unwrap();
            let [q, k, v, d_o] = p.tensors(29);
            let x = inp(&q, &k, &v);
            let run = |par: Par<'_>, ws: &mut CpuWorkspace| {
                let f = fwd_into(&be, &prepared, &x, &opts, ws, par);
                let gx = GradInputs::contiguous(x, f.o.view(), f.lse.view(), d_o.view()).unwrap();
                let g = bwd_into(&be, &prepared, &gx, &opts, ws, par);
                (f, g)
            };
            let (f0, g0) = run(Par::Seq, &mut CpuWorkspace::default());
            let mut shared = CpuWorkspace::default();
            for (name, par) in pars {
                let what = format!("{dtype} {}: Par::{name}", p.name);
                let (f, g) = run(par, &mut CpuWorkspace::default());
                assert_same_fwd(&f0, &f, &what);
                assert_same_bwd(&g0, &g, &what);
                let (f, g) = run(par, &mut shared);
                assert_same_fwd(&f0, &f, &format!("{what} (shared workspace)"));
                assert_same_bwd(&g0, &g, &format!("{what} (shared workspace)"));
            }
        }
    }
}

/// One workspace carried through a sequence of problems of different shapes, tiles, head dims and
/// dtypes (and back) gives exactly the results of a fresh workspace per call, on every kernel
/// copy.
#[test]
fn a_workspace_reused_across_problems_matches_fresh_ones() {
    let probs = api_probs();
    let mut seq: Vec<Prob> = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        seq.extend(probs.iter().map(|p| p.with_dtype(dtype)));
    }
    // seq[i] and seq[i + 3] share shape, tile and head dims and differ in dtype. The order grows
    // and shrinks the problem, changes the geometry, and switches dtype with the geometry kept
    // (0 -> 3 -> 0, 4 -> 1, 2 -> 5 -> 2).
    let order: Vec<usize> = vec![0, 3, 0, 4, 1, 2, 5, 2, 5, 4, 1, 3, 0];
    // One workspace per kernel copy, and one shared by all of them.
    let mut shared = CpuWorkspace::default();
    for isa in Isa::ALL {
        let Some(be) = cpu_backend_or_skip(isa) else {
            continue;
        };
        let mut own = CpuWorkspace::default();
        for (step, &i) in order.iter().enumerate() {
            let p = &seq[i];
            let what = format!("{isa:?} step {step}: {} {}", p.dtype, p.name);
            let (plan, opts) = (p.plan(), p.opts());
            let prepared = be.prepare(&plan).unwrap();
            let [q, k, v, d_o] = p.tensors(31 + i as u64);
            let x = inp(&q, &k, &v);
            let fresh_f = fwd_into(
                &be,
                &prepared,
                &x,
                &opts,
                &mut CpuWorkspace::default(),
                Par::Current,
            );
            let gx = GradInputs::contiguous(x, fresh_f.o.view(), fresh_f.lse.view(), d_o.view())
                .unwrap();
            let fresh_g = bwd_into(
                &be,
                &prepared,
                &gx,
                &opts,
                &mut CpuWorkspace::default(),
                Par::Current,
            );
            for (which, ws) in [("own", &mut own), ("shared", &mut shared)] {
                let what = format!("{what} ({which} workspace)");
                let f = fwd_into(&be, &prepared, &x, &opts, ws, Par::Current);
                assert_same_fwd(&fresh_f, &f, &what);
                let g = bwd_into(&be, &prepared, &gx, &opts, ws, Par::Current);
                assert_same_bwd(&fresh_g, &g, &what);
                // The reused workspace serves Seq calls of the same problem as well.
                let f = fwd_into(&be, &prepared, &x, &opts, ws, Par::Seq);
                assert_same_fwd(&fresh_f, &f, &format!("{what}, Seq"));
                let g = bwd_into(&be, &prepared, &gx, &opts, ws, Par::Seq);
                assert_same_bwd(&fresh_g, &g, &format!("{what}, Seq"));
            }
        }
    }
}

/// Logits up to ~100 (the scale raised, maxima rising from tile to tile along causal rows):
/// every copy keeps the f32 tolerances. On the AVX-512 copies the exponentials run in base 2
/// against a per-row reference rounded once; a rescale or an LSE taken in the wrong base or
/// against another reference fails here (measured: 2e-2 relative on O).
#[test]
fn large_logits_keep_f32_accuracy_on_every_copy() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let (h, l, d) = (2, 200, 64);
    let shape = [1, h, l, d];
    let (q, k, v) = (
        rand_t(&mut rng, &shape),
        rand_t(&mut rng, &shape),
        rand_t(&mut rng, &shape),
    );
    let mask = Mask::causal();
    let p = plan(&mask, 1, h, l, l, 32);
    for scale in [0.125f32, 1.0, 4.0] {
        let opts = AttnOptions {
            scale: Some(scale),
            ..Default::default()
        };
        let r = reference::forward(q.view(), k.view(), v.view(), &mask, &opts).unwrap();
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            let Some(be) = cpu_backend_or_skip(isa) else {
                continue;
            };
            let f = be.forward(&inp(&q, &k, &v), &p, &opts).unwrap();
            let (o, lse) = (f32s(&f.o), f32s(&f.lse));
            let sq = |x: f64| x * x;
            let num: f64 = o.iter().zip(&r.o).map(|(a, b)| sq(*a as f64 - b)).sum();
            let den: f64 = r.o.iter().map(|b| b * b).sum();
            let rel = (num / den).sqrt();
            let lse_err = lse
                .iter()
                .zip(&r.lse)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                rel <= 1e-5 && lse_err <= 1e-4,
                "{isa:?} scale {scale}: O {rel:.2e}, LSE {lse_err:.2e}"
            );
        }
    }
}
