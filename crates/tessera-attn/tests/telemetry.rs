//! The telemetry kernel variant (docs/semantics.md#telemetry) against the float64 dense reference of
//! `tessera-telemetry`, analytic cases, merging of batch shards, determinism, and the gating of
//! `forward_logged` (the non-logging path is the plain forward; the logging path's outputs are
//! bit-identical to it).

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tessera_attn::cpu::Isa;
use tessera_attn::{
    check_inputs, forward_logged, forward_logged_into, AttnInputs, AttnOptions, AttnSummary,
    Backend, CpuBackend, CpuPlan, CpuWorkspace, ForwardBufs, ForwardOut, ForwardOutput, GradInputs,
    GradOut, LogContext, Par, TelemetryInput,
};
use tessera_conformance::cpu_backend_or_skip;
use tessera_conformance::workloads::{packed_segments, random_dense};
use tessera_core::{DType, Error, Result, Tensor};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};
use tessera_telemetry::{
    document_kv_segments, outlier_summary, reference_summary, sink_key_flags, ReferenceInput,
    Streams, Telemetry, TelemetryConfig, TelemetrySink,
};

const RATIO: f64 = 2.0;

/// One attention problem with its telemetry settings.
#[derive(Clone)]
struct Prob {
    name: &'static str,
    mask: Mask,
    b: usize,
    hq: usize,
    hkv: usize,
    lq: usize,
    lkv: usize,
    dqk: usize,
    dv: usize,
    tile: (usize, usize),
    dtype: DType,
    softcap: Option<f32>,
    sinks: bool,
    sink_tokens: usize,
    seed: u64,
}

impl Prob {
    fn new(name: &'static str, mask: Mask) -> Self {
        Prob {
            name,
            mask,
            b: 1,
            hq: 2,
            hkv: 2,
            lq: 70,
            lkv: 70,
            dqk: 32,
            dv: 32,
            tile: (16, 16),
            dtype: DType::F32,
            softcap: None,
            sinks: false,
            sink_tokens: 1,
            seed: name.len() as u64 * 7919 + 13,
        }
    }
    fn heads(mut self, b: usize, hq: usize, hkv: usize) -> Self {
        (self.b, self.hq, self.hkv) = (b, hq, hkv);
        self
    }
    fn lens(mut self, lq: usize, lkv: usize) -> Self {
        (self.lq, self.lkv) = (lq, lkv);
        self
    }
    fn dims(mut self, dqk: usize, dv: usize) -> Self {
        (self.dqk, self.dv) = (dqk, dv);
        self
    }
    fn tile(mut self, q: usize, kv: usize) -> Self {
        self.tile = (q, kv);
        self
    }
    fn plan(&self) -> Arc<Plan> {
        Arc::new(
            build_plan(
                &self.mask,
                PlanShape::new(self.b, self.hq, self.lq, self.lkv).unwrap(),
                TileShape::new(self.tile.0, self.tile.1).unwrap(),
            )
            .unwrap(),
        )
    }
    fn flags(&self) -> Vec<bool> {
        sink_key_flags(
            document_kv_segments(&self.mask),
            self.b,
            self.lkv,
            self.sink_tokens,
        )
        .unwrap()
    }
}

/// Q, K, V as tensors in the problem's dtype, and the same values in f64.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qf: Vec<f64>,
    kf: Vec<f64>,
    vf: Vec<f64>,
    opts: AttnOptions,
}

impl Inputs {
    /// Q, K, V as contiguous attention inputs.
    fn attn(&self) -> AttnInputs<'_> {
        AttnInputs::contiguous(self.q.view(), self.k.view(), self.v.view()).unwrap()
    }
}

fn tensor(shape: Vec<usize>, vals: Vec<f32>, dtype: DType) -> (Tensor, Vec<f64>) {
    if dtype == DType::BF16 {
        let b: Vec<bf16> = vals.into_iter().map(bf16::from_f32).collect();
        let f = b.iter().map(|x| x.to_f64()).collect();
        (Tensor::from_bf16(shape, b).unwrap(), f)
    } else {
        let f = vals.iter().map(|&x| x as f64).collect();
        (Tensor::from_f32(shape, vals).unwrap(), f)
    }
}

fn inputs_from(p: &Prob, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>, sinks: Option<Vec<f32>>) -> Inputs {
    let (q, qf) = tensor(vec![p.b, p.hq, p.lq, p.dqk], q, p.dtype);
    let (k, kf) = tensor(vec![p.b, p.hkv, p.lkv, p.dqk], k, p.dtype);
    let (v, vf) = tensor(vec![p.b, p.hkv, p.lkv, p.dv], v, p.dtype);
    Inputs {
        q,
        k,
        v,
        qf,
        kf,
        vf,
        opts: AttnOptions {
            scale: None,
            softcap: p.softcap,
            sinks,
        },
    }
}

fn random_inputs(p: &Prob) -> Inputs {
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let a = 3f32.sqrt();
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-a..a)).collect() };
    let q = draw(p.b * p.hq * p.lq * p.dqk);
    let k = draw(p.b * p.hkv * p.lkv * p.dqk);
    let v = draw(p.b * p.hkv * p.lkv * p.dv);
    let sinks = p
        .sinks
        .then(|| (0..p.hq).map(|_| rng.gen_range(-1.0f32..2.5)).collect());
    inputs_from(p, q, k, v, sinks)
}

fn reference(p: &Prob, x: &Inputs, flags: &[bool]) -> tessera_telemetry::ReferenceOutput {
    let sinks: Option<Vec<f64>> = x
        .opts
        .sinks
        .as_ref()
        .map(|s| s.iter().map(|&v| v as f64).collect());
    reference_summary(
        &ReferenceInput {
            q: &x.qf,
            k: &x.kf,
            v: &x.vf,
            batch: p.b,
            heads_q: p.hq,
            heads_kv: p.hkv,
            q_len: p.lq,
            kv_len: p.lkv,
            d_qk: p.dqk,
            d_v: p.dv,
            mask: &p.mask,
            scale: x.opts.scale_for(p.dqk) as f64,
            softcap: x.opts.softcap.map(|c| c as f64),
            sinks: sinks.as_deref(),
            sink_flags: flags,
            outlier_ratio: RATIO,
        },
        0,
        0,
    )
    .unwrap()
}

fn input<'a>(flags: &'a [bool], step: u64) -> TelemetryInput<'a> {
    TelemetryInput {
        sink_flags: flags,
        step,
        layer: 0,
        streams: Streams::default(),
        outlier_ratio: RATIO,
    }
}

fn logged(p: &Prob, x: &Inputs, plan: &Arc<Plan>, flags: &[bool]) -> (ForwardOutput, AttnSummary) {
    logged_on(&CpuBackend::new(), p, x, plan, flags)
}

fn logged_on(
    be: &CpuBackend,
    p: &Prob,
    x: &Inputs,
    plan: &Arc<Plan>,
    flags: &[bool],
) -> (ForwardOutput, AttnSummary) {
    be.forward_with_telemetry(&x.attn(), plan, &x.opts, &input(flags, 0))
        .unwrap_or_else(|e| panic!("{}: {e}", p.name))
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn assert_same_outputs(a: &ForwardOutput, b: &ForwardOutput, what: &str) {
    assert_eq!(a.o.dtype(), b.o.dtype(), "{what}: O dtype");
    assert_eq!(bits(&a.o), bits(&b.o), "{what}: O not bit-identical");
    assert_eq!(bits(&a.lse), bits(&b.lse), "{what}: LSE not bit-identical");
    assert_eq!(
        bits(&a.max_logit),
        bits(&b.max_logit),
        "{what}: max_logit not bit-identical"
    );
}

/// Kernel summary vs the f64 reference: the sink stream and max_logit within `rtol`; the outlier
/// stream exactly against the statistics of the kernel's own O, and loosely (max |O| and Σ o²)
/// against the reference O.
fn check_against_reference(p: &Prob) {
    check_on(&CpuBackend::new(), p)
}

fn check_on(be: &CpuBackend, p: &Prob) {
    let plan = p.plan();
    let flags = p.flags();
    let x = random_inputs(p);
    let (out, summary) = logged_on(be, p, &x, &plan, &flags);

    let plain = be.forward(&x.attn(), &plan, &x.opts).unwrap();
    assert_same_outputs(&out, &plain, p.name);

    let r = reference(p, &x, &flags);
    let (rtol, o_tol) = if p.dtype == DType::BF16 {
        (1e-4, 2e-2)
    } else {
        (1e-5, 1e-4)
    };
    let mut expected = r.summary.clone();
    // The outlier stream is exactly `outlier_summary` of the kernel's O.
    let own = outlier_summary(&out.o.view(), RATIO).unwrap();
    for (h, (acc, st)) in expected.heads.iter_mut().zip(own).enumerate() {
        assert_eq!(
            summary.heads[h].out, st,
            "{} head {h}: outlier stats",
            p.name
        );
        acc.out = st;
    }
    summary
        .check_close(&expected, rtol, 1e-9)
        .unwrap_or_else(|e| panic!("{}: {e}", p.name));
    for (h, (a, rf)) in summary.heads.iter().zip(&r.summary.heads).enumerate() {
        let (x, y) = (a.out.abs_max, rf.out.abs_max);
        assert!(
            (x - y).abs() <= o_tol * y.abs(),
            "{} head {h} abs_max {x} vs {y}",
            p.name
        );
        let (x, y) = (a.out.sq_sum.value(), rf.out.sq_sum.value());
        assert!(
            (x - y).abs() <= 2.0 * o_tol * y.abs(),
            "{} head {h} sq_sum {x} vs {y}",
            p.name
        );
        assert_eq!(a.out.count, rf.out.count);
    }
    // Something was actually measured.
    let valid: u64 = summary.heads.iter().map(|a| a.valid_rows).sum();
    assert!(valid > 0, "{}: no valid rows", p.name);
    // Deterministic.
    let (out2, summary2) = logged_on(be, p, &x, &plan, &flags);
    assert_same_outputs(&out, &out2, p.name);
    assert_eq!(summary, summary2, "{}: summary not deterministic", p.name);
}

fn docs(rows: usize, len: usize, max_doc: usize, seed: u64) -> Mask {
    let seg = packed_segments(rows, len, max_doc, seed).unwrap();
    Mask::causal() & Mask::document(Segments::shared(seg))
}

#[test]
fn causal_no_documents_matches_reference() {
    check_against_reference(
        &Prob::new("causal", Mask::causal())
            .heads(2, 4, 2)
            .lens(100, 100),
    );
    let mut p = Prob::new("causal3", Mask::causal()).lens(77, 77);
    p.sink_tokens = 3;
    check_against_reference(&p);
}

#[test]
fn documents_match_reference_with_one_and_three_sink_tokens() {
    for st in [1, 3] {
        let mut p = Prob::new("documents", docs(2, 150, 40, 5))
            .heads(2, 2, 2)
            .lens(150, 150);
        p.sink_tokens = st;
        p.seed += st as u64;
        check_against_reference(&p);
    }
}

#[test]
fn learned_sinks_and_softcap_match_reference() {
    let mut p = Prob::new("sinks", docs(1, 120, 50, 9)).lens(120, 120);
    p.sinks = true;
    check_against_reference(&p);
    let mut p = Prob::new("softcap", Mask::causal()).lens(90, 90);
    p.softcap = Some(2.0);
    check_against_reference(&p);
    let mut p = Prob::new("softcap+sinks+docs", docs(2, 96, 30, 11))
        .heads(2, 4, 1)
        .lens(96, 96);
    p.softcap = Some(5.0);
    p.sinks = true;
    p.sink_tokens = 3;
    check_against_reference(&p);
}

#[test]
fn gqa_ragged_lengths_and_tiles_match_reference() {
    check_against_reference(&Prob::new("gqa", Mask::causal()).heads(1, 8, 2).lens(64, 64));
    check_against_reference(
        &Prob::new("cross-ragged", Mask::window(20, 5))
            .heads(2, 3, 1)
            .lens(37, 91)
            .dims(24, 40)
            .tile(32, 16),
    );
    check_against_reference(
        &Prob::new("default-tiles", Mask::causal() | Mask::prefix(10))
            .lens(300, 300)
            .tile(128, 128),
    );
    check_against_reference(
        &Prob::new("tiny-tiles", Mask::full())
            .lens(33, 47)
            .tile(16, 16),
    );
    // A dense random mask: partial tiles everywhere and some rows with no allowed key.
    let mut p = Prob::new("dense", random_dense(&[2, 2, 60, 60], 0.05, 3).unwrap())
        .heads(2, 2, 2)
        .lens(60, 60);
    p.sinks = true;
    check_against_reference(&p);
}

#[test]
fn bf16_matches_reference() {
    let mut p = Prob::new("bf16", docs(2, 130, 60, 21))
        .heads(2, 4, 2)
        .lens(130, 130);
    p.dtype = DType::BF16;
    p.sinks = true;
    check_against_reference(&p);
    let mut p = Prob::new("bf16-default-tiles", Mask::causal())
        .lens(260, 260)
        .tile(128, 128);
    p.dtype = DType::BF16;
    check_against_reference(&p);
}

/// Mean of a per-head sum over the head's valid rows.
fn mean(s: &tessera_telemetry::ExactSum, n: u64) -> f64 {
    s.value() / n as f64
}

#[test]
fn a_dominant_first_key_takes_all_the_mass() {
    // q > 0 everywhere, key 0 = 10·(1, ..., 1): its logit is >= 0.25·16·0.5·10 = 20, every other
    // logit is O(0.1); causal, so every row sees key 0.
    let mut p = Prob::new("dominant", Mask::causal())
        .heads(2, 4, 2)
        .lens(200, 200)
        .dims(16, 16);
    p.tile = (32, 32);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let q: Vec<f32> = (0..p.b * p.hq * p.lq * p.dqk)
        .map(|_| rng.gen_range(0.5..1.5))
        .collect();
    let mut k: Vec<f32> = (0..p.b * p.hkv * p.lkv * p.dqk)
        .map(|_| rng.gen_range(-0.1..0.1))
        .collect();
    for bh in 0..p.b * p.hkv {
        k[bh * p.lkv * p.dqk..][..p.dqk].fill(10.0);
    }
    let v: Vec<f32> = (0..p.b * p.hkv * p.lkv * p.dv)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let x = inputs_from(&p, q, k, v, None);
    let (_, s) = logged(&p, &x, &p.plan(), &p.flags());
    let rec = s.record(&TelemetryConfig::every(1));
    for (h, a) in s.heads.iter().enumerate() {
        assert_eq!(a.valid_rows, (p.b * p.lq) as u64);
        let m = mean(&a.sink_mass_sum, a.valid_rows);
        assert!(m > 1.0 - 1e-6, "head {h}: sink mass {m}");
        assert!(a.max_logit >= 20.0);
    }
    assert_eq!(rec.sink_rate, Some(1.0));
}

#[test]
fn equal_logits_give_log_of_the_allowed_keys() {
    // q = 0: every allowed logit is 0, so each row is uniform over its allowed keys.
    let mask = docs(2, 140, 45, 17) & Mask::window(30, 0);
    for sinks in [false, true] {
        let mut p = Prob::new("uniform", mask.clone())
            .heads(2, 2, 1)
            .lens(140, 140);
        p.sinks = sinks;
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let q = vec![0.0f32; p.b * p.hq * p.lq * p.dqk];
        let k: Vec<f32> = (0..p.b * p.hkv * p.lkv * p.dqk)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..p.b * p.hkv * p.lkv * p.dv)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        // A zero sink logit is one more outcome with the same weight.
        let sink_logits = sinks.then(|| vec![0.0f32; p.hq]);
        let x = inputs_from(&p, q, k, v, sink_logits);
        let (_, s) = logged(&p, &x, &p.plan(), &p.flags());
        for (h, a) in s.heads.iter().enumerate() {
            let (mut rows, mut ent, mut psink) = (0u64, 0f64, 0f64);
            for b in 0..p.b {
                for i in 0..p.lq {
                    let n = (0..p.lkv).filter(|&j| p.mask.allowed(b, h, i, j)).count();
                    if n > 0 {
                        let outcomes = n + sinks as usize;
                        rows += 1;
                        ent += (outcomes as f64).ln();
                        psink += if sinks { 1.0 / outcomes as f64 } else { 0.0 };
                    }
                }
            }
            assert_eq!(a.valid_rows, rows, "head {h}");
            let got = a.entropy_sum.value();
            assert!(
                (got - ent).abs() <= 1e-6 * ent,
                "head {h}: entropy {got} vs {ent}"
            );
            let got = a.learned_sink_mass_sum.value();
            assert!(
                (got - psink).abs() <= 1e-6 * psink.max(1e-30),
                "head {h}: p_sink {got}"
            );
        }
    }
}

#[test]
fn batch_shards_merge_into_the_whole_batch_summary() {
    let (b, h, l, d) = (3, 2, 120, 32);
    let seg = packed_segments(b, l, 50, 31).unwrap();
    let whole = Prob::new(
        "shards",
        Mask::causal() & Mask::document(Segments::shared(seg.clone())),
    )
    .heads(b, h, h)
    .lens(l, l)
    .dims(d, d);
    let mut whole = whole;
    whole.sinks = true;
    whole.sink_tokens = 2;
    let x = random_inputs(&whole);
    let (out, summary) = logged(&whole, &x, &whole.plan(), &whole.flags());

    let mut merged: Option<AttnSummary> = None;
    for r in 0..b {
        let row = SegmentIds::shared(seg.row(r).to_vec()).unwrap();
        let mut part = whole.clone();
        part.mask = Mask::causal() & Mask::document(Segments::shared(row));
        part.b = 1;
        let slice = |t: &Tensor| -> Tensor {
            let per = t.numel() / b;
            let v = t.to_f32_vec().unwrap()[r * per..(r + 1) * per].to_vec();
            let mut shape = t.shape().to_vec();
            shape[0] = 1;
            Tensor::from_f32(shape, v).unwrap()
        };
        let (q, k, v) = (slice(&x.q), slice(&x.k), slice(&x.v));
        let (o_r, s_r) = CpuBackend::new()
            .forward_with_telemetry(
                &AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap(),
                &part.plan(),
                &x.opts,
                &input(&part.flags(), 0),
            )
            .unwrap();
        assert_eq!(bits(&o_r.o), bits(&slice(&out.o)), "row {r}: O");
        match &mut merged {
            None => merged = Some(s_r),
            Some(m) => m.merge(&s_r).unwrap(),
        }
    }
    assert_eq!(merged.unwrap(), summary);
}

#[test]
fn summary_does_not_depend_on_the_thread_count() {
    let mut p = Prob::new("threads", docs(2, 200, 70, 41))
        .heads(2, 4, 2)
        .lens(200, 200);
    p.sinks = true;
    let x = random_inputs(&p);
    let plan = p.plan();
    let flags = p.flags();
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| logged(&p, &x, &plan, &flags))
    };
    let (o1, s1) = run(1);
    let (o3, s3) = run(3);
    assert_same_outputs(&o1, &o3, "threads");
    assert_eq!(s1, s3);
}

#[test]
fn forward_logged_runs_the_plain_forward_off_cadence_and_logs_on_it() {
    let p = Prob::new("logged", docs(2, 100, 30, 51))
        .heads(2, 4, 2)
        .lens(100, 100);
    let x = random_inputs(&p);
    let plan = p.plan();
    let be = CpuBackend::new();
    let plain = be.forward(&x.attn(), &plan, &x.opts).unwrap();
    let mut tel = Telemetry::new(TelemetryConfig::every(2)).unwrap();
    let mut sink = TelemetrySink::new(tel.config.clone());
    for step in 0..4u64 {
        for layer in 0..2u32 {
            let out = forward_logged(
                &be,
                &x.attn(),
                &plan,
                &x.opts,
                LogContext {
                    tel: &tel,
                    mask: &p.mask,
                    layer,
                    sink: &mut sink,
                },
            )
            .unwrap();
            assert_same_outputs(&out, &plain, &format!("step {step} layer {layer}"));
        }
        let expect_pending = if step % 2 == 0 { 2 } else { 0 };
        assert_eq!(sink.pending(), expect_pending, "step {step}");
        let records = sink.flush();
        assert_eq!(records.len(), expect_pending, "step {step}");
        for r in &records {
            assert_eq!(r.step, step);
            assert_eq!(r.heads(), p.hq);
            assert!(r.sink_mass.as_ref().unwrap().iter().all(|m| m.is_some()));
            assert!(r.out_rms.is_some() && r.entropy.is_some());
            assert!(r.learned_sink_mass.is_none());
        }
        tel.advance();
    }
    // Through `&dyn Backend` too, and the summary equals the direct call's. `forward_logged` is
    // generic over a sized `B: Backend`, so the trait object goes through `ViaDyn`, which
    // forwards every trait method through the `&dyn Backend` (dynamic dispatch).
    let dynbe: &DynCpu = &be;
    let tel = Telemetry::new(TelemetryConfig::every(1)).unwrap();
    let logged_dyn = forward_logged(
        &ViaDyn(dynbe),
        &x.attn(),
        &plan,
        &x.opts,
        LogContext {
            tel: &tel,
            mask: &p.mask,
            layer: 0,
            sink: &mut sink,
        },
    )
    .unwrap();
    assert_same_outputs(&logged_dyn, &plain, "through &dyn Backend");
    let flags = p.flags();
    let (_, direct) = be
        .forward_with_telemetry(
            &x.attn(),
            &plan,
            &x.opts,
            &TelemetryInput::new(&flags, 0, 0, &tel.config),
        )
        .unwrap();
    assert_eq!(sink.flush(), vec![direct.record(&tel.config)]);
    // The trait object's own allocating telemetry forward gives the same summary.
    let (o_dyn, s_dyn) = dynbe
        .forward_with_telemetry(
            &x.attn(),
            &plan,
            &x.opts,
            &TelemetryInput::new(&flags, 0, 0, &tel.config),
        )
        .unwrap();
    assert_same_outputs(&o_dyn, &plain, "dyn forward_with_telemetry");
    assert_eq!(s_dyn, direct);

    // The prepared-plan path: `forward_logged_into` with one prepared plan, workspace and set of
    // output buffers, off and on cadence, gives the same outputs and records.
    let prepared = be.prepare(&plan).unwrap();
    let d = check_inputs(&x.attn(), &x.opts).unwrap();
    let mut bufs = ForwardBufs::new(&d);
    let mut ws = CpuWorkspace::default();
    let mut tel = Telemetry::new(TelemetryConfig::every(2)).unwrap();
    for step in 0..3u64 {
        let mut out = bufs.out();
        out.o.poison();
        out.lse.fill(f32::NAN);
        out.max_logit.fill(f32::NAN);
        forward_logged_into(
            &be,
            &prepared,
            &x.attn(),
            &x.opts,
            out,
            &mut ws,
            Par::Current,
            LogContext {
                tel: &tel,
                mask: &p.mask,
                layer: 1,
                sink: &mut sink,
            },
        )
        .unwrap();
        let records = sink.flush();
        assert_eq!(records.len(), (step % 2 == 0) as usize, "into, step {step}");
        for r in &records {
            assert_eq!((r.step, r.layer), (step, 1));
        }
        tel.advance();
    }
    let out = bufs.finish(&d).unwrap();
    assert_same_outputs(&out, &plain, "forward_logged_into");
}

#[test]
fn streams_select_the_work() {
    let p = Prob::new("streams", Mask::causal()).lens(50, 50);
    let x = random_inputs(&p);
    let plan = p.plan();
    let flags = p.flags();
    let be = CpuBackend::new();
    let run = |sink: bool, outlier: bool| {
        let mut t = input(&flags, 3);
        t.streams = Streams { sink, outlier };
        be.forward_with_telemetry(&x.attn(), &plan, &x.opts, &t)
            .unwrap()
    };
    let (_, both) = run(true, true);
    let (_, sink_only) = run(true, false);
    let (_, out_only) = run(false, true);
    for h in 0..p.hq {
        assert_eq!(sink_only.heads[h].valid_rows, both.heads[h].valid_rows);
        assert_eq!(sink_only.heads[h].out.count, 0);
        assert_eq!(out_only.heads[h].valid_rows, 0);
        assert_eq!(out_only.heads[h].out, both.heads[h].out);
        // max_logit is filled either way.
        assert_eq!(out_only.heads[h].max_logit, both.heads[h].max_logit);
        assert!(both.heads[h].max_logit.is_finite());
    }
    assert_eq!(both.step, 3);
}

#[test]
fn bad_telemetry_input_is_an_error() {
    let p = Prob::new("bad", Mask::causal()).lens(40, 40);
    let x = random_inputs(&p);
    let plan = p.plan();
    let flags = vec![false; 39];
    let be = CpuBackend::new();
    let err = be
        .forward_with_telemetry(&x.attn(), &plan, &x.opts, &input(&flags, 0))
        .unwrap_err();
    assert!(err.to_string().contains("sink flags"), "{err}");
    let flags = p.flags();
    let mut t = input(&flags, 0);
    t.outlier_ratio = f64::NAN;
    let err = be
        .forward_with_telemetry(&x.attn(), &plan, &x.opts, &t)
        .unwrap_err();
    assert!(err.to_string().contains("outlier ratio"), "{err}");
}

/// A backend that only implements the required methods (delegating to the CPU backend).
struct Minimal(CpuBackend);

impl Backend for Minimal {
    type Prepared = CpuPlan;
    type Workspace = CpuWorkspace;

    fn name(&self) -> &str {
        "minimal"
    }
    fn prepare(&self, plan: &Arc<Plan>) -> Result<CpuPlan> {
        self.0.prepare(plan)
    }
    fn forward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        self.0.forward_workspace_size(prepared, inputs, par)
    }
    fn backward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        self.0.backward_workspace_size(prepared, inputs, par)
    }
    fn forward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.0.forward_into(prepared, inputs, options, out, ws, par)
    }
    fn backward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        options: &AttnOptions,
        out: GradOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.0
            .backward_into(prepared, inputs, options, out, ws, par)
    }
}

/// The CPU backend as a trait object.
type DynCpu = dyn Backend<Prepared = CpuPlan, Workspace = CpuWorkspace>;

/// A sized backend forwarding every method (the provided ones included) to a trait object.
struct ViaDyn<'a>(&'a DynCpu);

impl Backend for ViaDyn<'_> {
    type Prepared = CpuPlan;
    type Workspace = CpuWorkspace;

    fn name(&self) -> &str {
        self.0.name()
    }
    fn prepare(&self, plan: &Arc<Plan>) -> Result<CpuPlan> {
        self.0.prepare(plan)
    }
    fn forward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        self.0.forward_workspace_size(prepared, inputs, par)
    }
    fn backward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        self.0.backward_workspace_size(prepared, inputs, par)
    }
    fn forward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.0.forward_into(prepared, inputs, options, out, ws, par)
    }
    fn forward_with_telemetry_into(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        tel: &TelemetryInput<'_>,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<AttnSummary> {
        self.0
            .forward_with_telemetry_into(prepared, inputs, options, tel, out, ws, par)
    }
    fn backward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        options: &AttnOptions,
        out: GradOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.0
            .backward_into(prepared, inputs, options, out, ws, par)
    }
}

#[test]
fn backends_without_telemetry_say_so_on_logging_steps_only() {
    let p = Prob::new("minimal", Mask::causal()).lens(30, 30);
    let x = random_inputs(&p);
    let plan = p.plan();
    let be = Minimal(CpuBackend::new());
    let mut tel = Telemetry::new(TelemetryConfig::every(2)).unwrap();
    let mut sink = TelemetrySink::new(tel.config.clone());
    let mut call = |tel: &Telemetry| {
        forward_logged(
            &be,
            &x.attn(),
            &plan,
            &x.opts,
            LogContext {
                tel,
                mask: &p.mask,
                layer: 0,
                sink: &mut sink,
            },
        )
    };
    let err = call(&tel).unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    tel.advance();
    call(&tel).unwrap();

    // The provided `forward_with_telemetry_into` (and the allocating `forward_with_telemetry`
    // built on it) return `Unsupported`; `forward_logged_into` on a prepared plan says so on a
    // logging step only.
    let flags = p.flags();
    let prepared = be.prepare(&plan).unwrap();
    let d = check_inputs(&x.attn(), &x.opts).unwrap();
    let mut bufs = ForwardBufs::new(&d);
    let mut ws = CpuWorkspace::default();
    let err = be
        .forward_with_telemetry_into(
            &prepared,
            &x.attn(),
            &x.opts,
            &input(&flags, 0),
            bufs.out(),
            &mut ws,
            Par::Current,
        )
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    assert!(err.to_string().contains("minimal"), "{err}");
    let err = be
        .forward_with_telemetry(&x.attn(), &plan, &x.opts, &input(&flags, 0))
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    let mut tel = Telemetry::new(TelemetryConfig::every(2)).unwrap();
    for step in 0..2 {
        let r = forward_logged_into(
            &be,
            &prepared,
            &x.attn(),
            &x.opts,
            bufs.out(),
            &mut ws,
            Par::Current,
            LogContext {
                tel: &tel,
                mask: &p.mask,
                layer: 0,
                sink: &mut sink,
            },
        );
        match step {
            0 => assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}"),
            _ => r.unwrap(),
        }
        tel.advance();
    }
    assert_eq!(sink.pending(), 0);

    // The provided allocating `forward`/`backward` (the CPU backend overrides them) give the CPU
    // backend's results.
    let cpu = CpuBackend::new();
    let f = be.forward(&x.attn(), &plan, &x.opts).unwrap();
    let want = cpu.forward(&x.attn(), &plan, &x.opts).unwrap();
    assert_same_outputs(&f, &want, "Minimal::forward");
    assert_same_outputs(
        &bufs.finish(&d).unwrap(),
        &want,
        "Minimal forward_logged_into",
    );
    let d_o = x.q.clone();
    let g_in = GradInputs::contiguous(x.attn(), f.o.view(), f.lse.view(), d_o.view()).unwrap();
    let g = be.backward(&g_in, &plan, &x.opts).unwrap();
    let want = cpu.backward(&g_in, &plan, &x.opts).unwrap();
    assert_eq!(g, want, "Minimal::backward");
}

#[test]
fn every_kernel_copy_logs_the_same_summary() {
    let mut p = Prob::new("isa", docs(2, 100, 35, 61))
        .heads(2, 4, 2)
        .lens(100, 100)
        .dims(24, 24);
    p.sinks = true;
    p.softcap = Some(4.0);
    let mut bf = Prob::new("isa-bf16", Mask::causal()).lens(80, 80);
    bf.dtype = DType::BF16;
    for isa in Isa::ALL {
        let Some(be) = cpu_backend_or_skip(isa) else {
            continue;
        };
        check_on(&be, &p);
        check_on(&be, &bf);
    }
}

/// The backends of the hooked `vdpbf16ps` kernel this CPU runs: AVX512-BF16, and with AMX
/// (or its model, `TESSERA_AMX_MODEL=1`) the same kernel with its products on tiles; those it
/// lacks are skipped with a note.
fn bf16_kernel_backends() -> Vec<CpuBackend> {
    [Isa::Avx512Bf16, Isa::Avx512Amx]
        .into_iter()
        .filter_map(cpu_backend_or_skip)
        .collect()
}

/// bf16 problems for the hooked `vdpbf16ps` kernel: partial tiles (documents, windows, a dense
/// random mask with empty rows), odd key counts in the last kv tile (a key pair with one key),
/// odd head dims, GQA, learned sinks and softcap.
fn bf16_probs() -> Vec<Prob> {
    let bf = |mut p: Prob| {
        p.dtype = DType::BF16;
        p
    };
    let mut v = Vec::new();
    let mut p = bf(Prob::new("bf16dot-docs", docs(2, 150, 40, 71))
        .heads(2, 4, 2)
        .lens(150, 150));
    p.sinks = true;
    p.softcap = Some(5.0);
    p.sink_tokens = 3;
    v.push(p);
    let mut p = bf(Prob::new("bf16dot-ragged", Mask::window(20, 5))
        .heads(2, 3, 1)
        .lens(37, 91)
        .dims(25, 40)
        .tile(32, 16));
    p.softcap = Some(2.0);
    v.push(p);
    let mut p = bf(Prob::new(
        "bf16dot-dense",
        random_dense(&[2, 2, 61, 61], 0.05, 5).unwrap(),
    )
    .heads(2, 2, 2)
    .lens(61, 61));
    p.sinks = true;
    v.push(p);
    v.push(bf(Prob::new("bf16dot-odd-tail", Mask::causal())
        .lens(77, 77)
        .dims(33, 17)));
    let mut p = bf(Prob::new("bf16dot-default-tiles", docs(1, 300, 120, 73))
        .lens(300, 300)
        .tile(128, 128));
    p.sinks = true;
    p.softcap = Some(4.0);
    v.push(p);
    v
}

#[test]
fn bf16_on_avx512_bf16_matches_reference() {
    for be in bf16_kernel_backends() {
        for p in bf16_probs() {
            check_on(&be, &p);
        }
    }
}

#[test]
fn bf16_logging_step_outputs_are_bit_identical_on_avx512_bf16() {
    // Every backend below runs on AVX-512 too, so without it there is nothing to compare.
    let Some(f32_math) = cpu_backend_or_skip(Isa::Avx512) else {
        return;
    };
    for (be, p) in bf16_kernel_backends()
        .into_iter()
        .flat_map(|be| bf16_probs().into_iter().map(move |p| (be, p)))
    {
        let (plan, flags) = (p.plan(), p.flags());
        let mut x = random_inputs(&p);
        for nonfinite_v in [false, true] {
            if nonfinite_v {
                // Non-finite V entries (the kernel's fix-up path).
                let mut v: Vec<bf16> = match x.v.data() {
                    tessera_core::TensorData::BF16(v) => v.clone(),
                    _ => unreachable!(),
                };
                let n = v.len();
                v[3] = bf16::NAN;
                v[n / 2] = bf16::INFINITY;
                x.v = Tensor::from_bf16(x.v.shape().to_vec(), v).unwrap();
            }
            let what = format!("{} (non-finite V: {nonfinite_v})", p.name);
            let plain = be.forward(&x.attn(), &plan, &x.opts).unwrap();
            let (out, _) = logged_on(&be, &p, &x, &plan, &flags);
            assert_same_outputs(&out, &plain, &what);
            // The plain forward ran the `vdpbf16ps` kernel (P rounded to bf16), not the f32 math
            // of `Isa::Avx512`: the bit-identity above is that kernel's.
            let generic = f32_math.forward(&x.attn(), &plan, &x.opts).unwrap();
            assert_ne!(
                bits(&generic.o),
                bits(&plain.o),
                "{what}: same O as f32 math"
            );
        }
    }
}
