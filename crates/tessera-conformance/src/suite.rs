//! The backend-agnostic conformance suite (docs/ARCHITECTURE.md, docs/semantics.md#attention): every [`Backend`] must pass
//! [`standard_cases`] (and the [`dispatch_cases`]) through [`run_case`].
//!
//! Contract of [`run_case`]: plan the case's mask, prepare it once, draw fresh seeded random
//! inputs (uniform in ±√3, never zero; bf16 cases round them to bf16 and the reference uses the
//! rounded values), run the backend's `forward_into` and `backward_into` **twice** — contiguous
//! inputs, then the same values in the `[B, L, H, D]` layout as strided views, reusing the
//! workspace — and require bit-identical results, then compare with the float64
//! [`reference`](mod@crate::reference):
//! - every output element whose reference value is finite must be finite (outputs are filled
//!   with NaN before each call, so this catches elements never written);
//! - O, dQ, dK, dV: `‖x − ref‖ / ‖ref‖` ≤ 1e-5 for f32 storage, ≤ 1e-2 for bf16 (for dQ and dK
//!   `‖ref‖` is floored at [`MAG_FLOOR`] times the norm of the gradient's term magnitudes, so an
//!   analytically vanishing gradient is judged against the size of its terms);
//! - LSE: absolute error ≤ 1e-4, and `-inf` exactly where the reference is `-inf`;
//! - max_logit: absolute error ≤ 1e-4·max(1, |ref|), `-inf` matched exactly;
//! - dsinks: relative norm error ≤ 1e-4 (f32) or 1e-2 (bf16).
//!
//! Backend errors are returned as `Err`; accuracy failures are listed in the
//! [`CaseReport`] (see [`CaseReport::ensure`]).

use crate::reference;
use crate::workloads::{
    packed_segments, random_band, random_blocks, random_dense, random_values, rng,
};
use half::bf16;
use rand::Rng;
use std::sync::Arc;
use std::time::Instant;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, BackwardOutput, ForwardBufs, ForwardOutput,
    GradBufs, GradInputs, Par, StridedView,
};
use tessera_core::{DType, Error, Result, Tensor, TensorData};
use tessera_mask::{BandFeatures, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};

/// One conformance case: a mask, a problem shape, a tile shape, a dtype and options.
#[derive(Debug, Clone)]
pub struct Case {
    /// `group/name`.
    pub name: String,
    pub mask: Mask,
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub d_qk: usize,
    pub d_v: usize,
    pub tile: TileShape,
    pub dtype: DType,
    pub scale: Option<f32>,
    pub softcap: Option<f32>,
    /// Draw one random sink logit per query head.
    pub sinks: bool,
    /// Also check the backward pass.
    pub backward: bool,
    pub seed: u64,
}

impl Case {
    /// Defaults: B=1, Hq=Hkv=2, Lq=Lkv=64, D=32, tile 16x16, f32, forward and backward.
    pub fn new(name: impl Into<String>, mask: Mask) -> Self {
        let name = name.into();
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        Case {
            name,
            mask,
            batch: 1,
            heads_q: 2,
            heads_kv: 2,
            q_len: 64,
            kv_len: 64,
            d_qk: 32,
            d_v: 32,
            tile: TileShape { q: 16, kv: 16 },
            dtype: DType::F32,
            scale: None,
            softcap: None,
            sinks: false,
            backward: true,
            seed,
        }
    }
    pub fn lens(mut self, q_len: usize, kv_len: usize) -> Self {
        self.q_len = q_len;
        self.kv_len = kv_len;
        self
    }
    pub fn heads(mut self, batch: usize, heads_q: usize, heads_kv: usize) -> Self {
        self.batch = batch;
        self.heads_q = heads_q;
        self.heads_kv = heads_kv;
        self
    }
    pub fn dims(mut self, d_qk: usize, d_v: usize) -> Self {
        self.d_qk = d_qk;
        self.d_v = d_v;
        self
    }
    /// Tile sides must be valid [`TileShape`]s (checked when the case runs).
    pub fn tile(mut self, q: usize, kv: usize) -> Self {
        self.tile = TileShape { q, kv };
        self
    }
    pub fn bf16(mut self) -> Self {
        self.dtype = DType::BF16;
        self
    }
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    pub fn scale(mut self, s: f32) -> Self {
        self.scale = Some(s);
        self
    }
    pub fn sinks(mut self) -> Self {
        self.sinks = true;
        self
    }
    pub fn forward_only(mut self) -> Self {
        self.backward = false;
        self
    }
    /// The group part of the name (before the first `/`).
    pub fn group(&self) -> &str {
        self.name.split('/').next().unwrap_or("")
    }
}

/// Accuracy bounds of one storage dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Relative norm error of O, dQ, dK, dV.
    pub rel: f64,
    pub lse_abs: f64,
    pub max_logit_abs: f64,
    pub dsinks_rel: f64,
}

impl Tolerances {
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F32 => Tolerances {
                rel: 1e-5,
                lse_abs: 1e-4,
                max_logit_abs: 1e-4,
                dsinks_rel: 1e-4,
            },
            _ => Tolerances {
                rel: 1e-2,
                lse_abs: 1e-4,
                max_logit_abs: 1e-4,
                dsinks_rel: 1e-2,
            },
        }
    }
}

/// One measured error and its bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub name: &'static str,
    pub value: f64,
    pub tolerance: f64,
}

/// What [`run_case`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseReport {
    pub case: String,
    pub backend: String,
    pub allowed_pairs: u64,
    pub metrics: Vec<Metric>,
    /// Human-readable failed checks (empty when the case passed).
    pub failures: Vec<String>,
    pub forward_ms: f64,
    pub backward_ms: f64,
}

impl CaseReport {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// `Err` listing the failures, if any.
    pub fn ensure(&self) -> Result<()> {
        if self.passed() {
            Ok(())
        } else {
            Err(Error::Internal(format!(
                "conformance case {} on backend {} failed: {}",
                self.case,
                self.backend,
                self.failures.join("; ")
            )))
        }
    }
}

impl std::fmt::Display for CaseReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} [{}] {} pairs, fwd {:.2} ms, bwd {:.2} ms:",
            self.case, self.backend, self.allowed_pairs, self.forward_ms, self.backward_ms
        )?;
        for m in &self.metrics {
            write!(f, " {}={:.2e}", m.name, m.value)?;
        }
        if !self.passed() {
            write!(f, " FAILED: {}", self.failures.join("; "))?;
        }
        Ok(())
    }
}

fn make_tensor(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> Result<Tensor> {
    match dtype {
        DType::BF16 => Tensor::from_bf16(shape, v.into_iter().map(bf16::from_f32).collect()),
        _ => Tensor::from_f32(shape, v),
    }
}

/// The tensor's values stored in `[B, L, H, D]` order (its shape stays `[B, H, L, D]`).
fn blhd(t: &Tensor) -> Result<Tensor> {
    let [_, nh, nl, nd] = *t.shape() else {
        return Err(Error::Internal(format!(
            "rank-4 tensor expected, got {:?}",
            t.shape()
        )));
    };
    let perm = |i: usize| {
        // Destination index i of [B, L, H, D] -> source index of [B, H, L, D].
        let (x, rest) = (i % nd, i / nd);
        let (h, rest) = (rest % nh, rest / nh);
        let (l, b) = (rest % nl, rest / nl);
        ((b * nh + h) * nl + l) * nd + x
    };
    let n = t.numel();
    match t.data() {
        TensorData::F32(v) => {
            Tensor::from_f32(t.shape().to_vec(), (0..n).map(|i| v[perm(i)]).collect())
        }
        TensorData::BF16(v) => {
            Tensor::from_bf16(t.shape().to_vec(), (0..n).map(|i| v[perm(i)]).collect())
        }
        _ => Err(Error::Internal("float tensor expected".into())),
    }
}

/// The `[B, H, L, D]` view of a tensor stored by [`blhd`].
fn blhd_view<'a>(t: &'a Tensor, shape: &[usize]) -> Result<StridedView<'a>> {
    let [_, nh, nl, nd] = *shape else {
        return Err(Error::Internal(format!(
            "rank-4 shape expected, got {shape:?}"
        )));
    };
    StridedView::new(
        "input",
        t.view().data,
        [shape[0], nh, nl, nd],
        [nl * nh * nd, nd, nh * nd, 1],
    )
}

fn bits(t: &Tensor) -> Vec<u32> {
    match t.data() {
        TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        _ => Vec::new(),
    }
}

/// Fraction of the magnitude norm (see [`RefBackward::dq_mag`](crate::reference::RefBackward))
/// used as the floor of dQ's and dK's reference norm. In non-degenerate cases `‖ref‖/‖mag‖` is
/// 0.04 or more; where the gradient vanishes analytically (one allowed key per row: `dS = 0`) the
/// floor keeps f32 rounding noise from counting as a large relative error.
pub const MAG_FLOOR: f64 = 0.03;

/// `‖x − r‖ / max(‖r‖, floor)` over the elements where `r` is finite (`‖x − r‖` when both are 0).
pub fn rel_error(x: &[f32], r: &[f64], floor: f64) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in x.iter().zip(r) {
        if b.is_finite() {
            num += (a as f64 - b).powi(2);
            den += b * b;
        }
    }
    let den = den.sqrt().max(floor);
    if den == 0.0 {
        num.sqrt()
    } else {
        num.sqrt() / den
    }
}

fn norm(v: &[f64]) -> f64 {
    v.iter()
        .filter(|x| x.is_finite())
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
}

struct Checker {
    metrics: Vec<Metric>,
    failures: Vec<String>,
}

impl Checker {
    fn finite(&mut self, name: &str, x: &[f32], r: &[f64]) {
        if x.len() != r.len() {
            self.failures.push(format!(
                "{name}: {} elements, expected {}",
                x.len(),
                r.len()
            ));
            return;
        }
        let bad = x
            .iter()
            .zip(r)
            .filter(|(a, b)| b.is_finite() && !a.is_finite())
            .count();
        if bad > 0 {
            let first = x
                .iter()
                .zip(r)
                .position(|(a, b)| b.is_finite() && !a.is_finite())
                .unwrap_or(0);
            self.failures.push(format!(
                "{name}: {bad} non-finite elements where the reference is finite (first at flat index {first}: {})",
                x[first]
            ));
        }
    }

    fn rel(&mut self, name: &'static str, x: &[f32], r: &[f64], floor: f64, tol: f64) {
        self.finite(name, x, r);
        let e = rel_error(x, r, floor);
        self.metrics.push(Metric {
            name,
            value: e,
            tolerance: tol,
        });
        if e.is_nan() || e > tol {
            self.failures
                .push(format!("{name}: relative error {e:.3e} > {tol:.0e}"));
        }
    }

    /// Absolute error, with -inf required exactly where the reference is -inf.
    fn abs(&mut self, name: &'static str, x: &[f32], r: &[f64], tol: f64, relative_scale: bool) {
        self.finite(name, x, r);
        let mut worst = 0f64;
        for (idx, (&a, &b)) in x.iter().zip(r).enumerate() {
            if b == f64::NEG_INFINITY {
                if a != f32::NEG_INFINITY {
                    self.failures
                        .push(format!("{name}[{idx}]: {a}, expected -inf"));
                    return;
                }
                continue;
            }
            let bound = if relative_scale {
                b.abs().max(1.0)
            } else {
                1.0
            };
            let e = (a as f64 - b).abs() / bound;
            if e.is_nan() {
                worst = f64::INFINITY;
            } else if e > worst {
                worst = e;
            }
        }
        self.metrics.push(Metric {
            name,
            value: worst,
            tolerance: tol,
        });
        if worst > tol {
            self.failures
                .push(format!("{name}: absolute error {worst:.3e} > {tol:.0e}"));
        }
    }
}

/// Runs one case on `backend` (see the module docs for what is checked).
pub fn run_case<B: Backend>(backend: &B, case: &Case) -> Result<CaseReport> {
    let tile = TileShape::new(case.tile.q, case.tile.kv)?;
    let shape = PlanShape::new(case.batch, case.heads_q, case.q_len, case.kv_len)?;
    let plan = build_plan(&case.mask, shape, tile)?;
    let mut rng = rng(case.seed);
    let (b, hq, hkv) = (case.batch, case.heads_q, case.heads_kv);
    let (lq, lkv, dqk, dv) = (case.q_len, case.kv_len, case.d_qk, case.d_v);
    let dt = case.dtype;
    let q = make_tensor(
        dt,
        vec![b, hq, lq, dqk],
        random_values(&mut rng, b * hq * lq * dqk),
    )?;
    let k = make_tensor(
        dt,
        vec![b, hkv, lkv, dqk],
        random_values(&mut rng, b * hkv * lkv * dqk),
    )?;
    let v = make_tensor(
        dt,
        vec![b, hkv, lkv, dv],
        random_values(&mut rng, b * hkv * lkv * dv),
    )?;
    let d_o = make_tensor(
        dt,
        vec![b, hq, lq, dv],
        random_values(&mut rng, b * hq * lq * dv),
    )?;
    let sinks = case
        .sinks
        .then(|| (0..hq).map(|_| rng.gen_range(-1.0f32..2.5)).collect());
    let opts = AttnOptions {
        scale: case.scale,
        softcap: case.softcap,
        sinks,
    };
    let tol = Tolerances::for_dtype(dt);
    let mut ck = Checker {
        metrics: Vec::new(),
        failures: Vec::new(),
    };

    let plan = Arc::new(plan);
    let prepared = backend.prepare(&plan)?;
    let mut ws = B::Workspace::default();
    // Second runs read the inputs in the `[B, L, H, D]` layout (strided views, as PyTorch hands
    // them over) and reuse the workspace: both must give the same bits as the first run.
    let (qs, ks, vs, dos) = (blhd(&q)?, blhd(&k)?, blhd(&v)?, blhd(&d_o)?);
    let contiguous = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
    let strided = AttnInputs {
        q: blhd_view(&qs, q.shape())?,
        k: blhd_view(&ks, k.shape())?,
        v: blhd_view(&vs, v.shape())?,
    };
    let dims = check_inputs(&contiguous, &opts)?;
    let forward = |inputs: &AttnInputs<'_>, ws: &mut B::Workspace| -> Result<ForwardOutput> {
        let mut bufs = ForwardBufs::new(&dims);
        let mut out = bufs.out();
        // Poisoned outputs: an element the kernel never writes stays NaN and fails below.
        out.o.poison();
        out.lse.fill(f32::NAN);
        out.max_logit.fill(f32::NAN);
        backend.forward_into(&prepared, inputs, &opts, out, ws, Par::Current)?;
        bufs.finish(&dims)
    };
    let t0 = Instant::now();
    let f1 = forward(&contiguous, &mut ws)?;
    let forward_ms = t0.elapsed().as_secs_f64() * 1e3;
    let f2 = forward(&strided, &mut ws)?;
    for (name, a, c) in [
        ("o", &f1.o, &f2.o),
        ("lse", &f1.lse, &f2.lse),
        ("max_logit", &f1.max_logit, &f2.max_logit),
    ] {
        if bits(a) != bits(c) {
            ck.failures.push(format!(
                "{name}: a second forward (strided inputs, reused workspace) is not bit-identical"
            ));
        }
    }
    for (name, t, want) in [
        ("o", &f1.o, vec![b, hq, lq, dv]),
        ("lse", &f1.lse, vec![b, hq, lq]),
        ("max_logit", &f1.max_logit, vec![b, hq]),
    ] {
        if t.shape() != want.as_slice() {
            ck.failures
                .push(format!("{name}: shape {:?}, expected {want:?}", t.shape()));
        }
    }
    if f1.o.dtype() != dt {
        ck.failures
            .push(format!("o: dtype {}, expected {dt}", f1.o.dtype()));
    }
    let rf = reference::forward(q.view(), k.view(), v.view(), &case.mask, &opts)?;
    ck.rel("o", &f1.o.to_f32_vec()?, &rf.o, 0.0, tol.rel);
    ck.abs("lse", &f1.lse.to_f32_vec()?, &rf.lse, tol.lse_abs, false);
    ck.abs(
        "max_logit",
        &f1.max_logit.to_f32_vec()?,
        &rf.max_logit,
        tol.max_logit_abs,
        true,
    );

    let mut backward_ms = 0.0;
    if case.backward {
        let os = blhd(&f1.o)?;
        let grads = [
            GradInputs::contiguous(contiguous, f1.o.view(), f1.lse.view(), d_o.view())?,
            GradInputs {
                q: strided.q,
                k: strided.k,
                v: strided.v,
                o: blhd_view(&os, f1.o.shape())?,
                lse: f1.lse.view(),
                d_o: blhd_view(&dos, d_o.shape())?,
                d_lse: None,
            },
        ];
        let mut run = |inputs: &GradInputs<'_>| -> Result<BackwardOutput> {
            let mut bufs = GradBufs::new(&dims, opts.sinks.is_some());
            let mut out = bufs.out();
            out.dq.poison();
            out.dk.poison();
            out.dv.poison();
            if let Some(s) = out.dsinks.as_deref_mut() {
                s.fill(f32::NAN);
            }
            backend.backward_into(&prepared, inputs, &opts, out, &mut ws, Par::Current)?;
            bufs.finish(&dims)
        };
        let t0 = Instant::now();
        let g1 = run(&grads[0])?;
        backward_ms = t0.elapsed().as_secs_f64() * 1e3;
        let g2 = run(&grads[1])?;
        for (name, a, c) in [
            ("dq", &g1.dq, &g2.dq),
            ("dk", &g1.dk, &g2.dk),
            ("dv", &g1.dv, &g2.dv),
        ] {
            if bits(a) != bits(c) {
                ck.failures.push(format!(
                    "{name}: a second backward (strided inputs, reused workspace) is not \
                     bit-identical"
                ));
            }
            if a.dtype() != dt {
                ck.failures
                    .push(format!("{name}: dtype {}, expected {dt}", a.dtype()));
            }
        }
        let rb = reference::backward(q.view(), k.view(), v.view(), d_o.view(), &case.mask, &opts)?;
        let (fq, fk) = (MAG_FLOOR * norm(&rb.dq_mag), MAG_FLOOR * norm(&rb.dk_mag));
        ck.rel("dq", &g1.dq.to_f32_vec()?, &rb.dq, fq, tol.rel);
        ck.rel("dk", &g1.dk.to_f32_vec()?, &rb.dk, fk, tol.rel);
        ck.rel("dv", &g1.dv.to_f32_vec()?, &rb.dv, 0.0, tol.rel);
        match (&g1.dsinks, &g2.dsinks, &rb.dsinks) {
            (Some(a), Some(c), Some(r)) => {
                if bits(a) != bits(c) {
                    ck.failures
                        .push("dsinks: two backward runs are not bit-identical".into());
                }
                ck.rel("dsinks", &a.to_f32_vec()?, r, 0.0, tol.dsinks_rel);
            }
            (None, None, None) => {}
            _ => ck
                .failures
                .push("dsinks: present/absent does not match the sinks option".into()),
        }
    }
    Ok(CaseReport {
        case: case.name.clone(),
        backend: backend.name().to_string(),
        allowed_pairs: plan.stats.allowed_pairs,
        metrics: ck.metrics,
        failures: ck.failures,
        forward_ms,
        backward_ms,
    })
}

/// Runs every case; `Err` naming every failed case if any failed.
pub fn run_suite<B: Backend>(backend: &B, cases: &[Case]) -> Result<Vec<CaseReport>> {
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for c in cases {
        let r =
            run_case(backend, c).map_err(|e| Error::Internal(format!("case {}: {e}", c.name)))?;
        if !r.passed() {
            failed.push(r.to_string());
        }
        reports.push(r);
    }
    if failed.is_empty() {
        Ok(reports)
    } else {
        Err(Error::Internal(format!(
            "{} of {} conformance cases failed:\n{}",
            failed.len(),
            cases.len(),
            failed.join("\n")
        )))
    }
}

/// The standard cases every backend must pass, grouped by name prefix: `mask/` (every leaf and
/// combinations), `len/` (lengths 1, 17, tile, tile+1, 1000 on both sides), `batch/` (B = 3 with
/// different padded segments per row), `gqa/` (GQA 8:2, MQA 4:1), `dims/` (D 32..256, Dqk != Dv,
/// dims not a multiple of 16), `tile/` (square, rectangular, small and default tiles), `feat/`
/// (softcap, sinks, scale), `masked/` (fully masked rows with and without sinks), `bf16/` and
/// `large/` (L up to 1000 with the default 128-wide tiles).
pub fn standard_cases() -> Vec<Case> {
    // The data leaves are seeded and small; building them cannot fail.
    cases().unwrap_or_default()
}

fn cases() -> Result<Vec<Case>> {
    let mut v = Vec::new();
    let causal = Mask::causal;

    // mask/: every leaf and combinations at L = 75 (ragged for 16x16 tiles).
    let l = 75;
    let docs = Mask::document(Segments::shared(packed_segments(1, l, 20, 11)?));
    let dense = random_dense(&[l, l], 0.5, 12)?;
    let stamps = random_band(1, (l, l), (0, 12), true, 13)?;
    // Block selections (docs/semantics.md#masks) per head: in the plan's 16x16 tiles, and in 24x10 blocks.
    let sel16 = random_blocks([1, 2, 5, 3], 5, 16, 16, 14)?;
    let sel24 = random_blocks([1, 2, 4, 4], 8, 24, 10, 15)?;
    let masks: Vec<(&str, Mask)> = vec![
        ("full", Mask::full()),
        ("causal", causal()),
        ("causal_offset_pos", Mask::causal_offset(9)),
        ("causal_offset_neg", Mask::causal_offset(-9)),
        ("window_left", Mask::window(10, 0)),
        ("window_left_right", Mask::window(8, 5)),
        ("chunk", Mask::chunk(20)),
        ("prefix", Mask::prefix(13)),
        ("document_padded", docs.clone()),
        ("dense_random", dense.clone()),
        ("band_stamps", stamps.clone()),
        ("band_shuffled", random_band(1, (l, l), (-3, 3), false, 14)?),
        (
            "band_document_causal",
            stamps.clone() & docs.clone() & causal(),
        ),
        ("not_band_or_prefix", !stamps | Mask::prefix(5)),
        ("heads", Mask::heads(vec![causal(), Mask::window(4, 4)])),
        ("and_causal_document", causal() & docs.clone()),
        ("or_prefix_lm", causal() | Mask::prefix(10)),
        ("not_causal", !causal()),
        ("not_chunk_and_causal", !Mask::chunk(16) & causal()),
        (
            "window_and_causal_or_prefix",
            (Mask::window(8, 0) & causal()) | Mask::prefix(4),
        ),
        ("dense_and_window", dense & Mask::window(20, 20)),
        ("not_full", !Mask::full()),
        ("blocks_causal_document", sel16 & causal() & docs.clone()),
        ("blocks_24x10_window", sel24 & Mask::window(30, 2)),
        (
            "heads_combo",
            Mask::heads(vec![!Mask::full(), causal() & Mask::chunk(32) & docs]),
        ),
    ];
    for (name, m) in masks {
        v.push(Case::new(format!("mask/{name}"), m).lens(l, l));
    }

    // len/: every pair of {1, 17, tile, tile + 1, 1000} with 32x32 tiles.
    let lens = [1, 17, 32, 33, 1000];
    for &a in &lens {
        for &b in &lens {
            let c = Case::new(format!("len/{a}x{b}"), causal())
                .lens(a, b)
                .heads(1, 1, 1)
                .tile(32, 32);
            v.push(c);
        }
    }
    v.push(
        Case::new(
            "len/1000x1000_window_document",
            Mask::window(100, 20)
                & Mask::document(Segments::shared(packed_segments(1, 1000, 300, 13)?)),
        )
        .lens(1000, 1000)
        .heads(1, 1, 1)
        .dims(64, 64)
        .tile(128, 128),
    );

    // batch/: B = 3, different segments per row including padding.
    let seg3 = Segments::shared(packed_segments(3, 100, 30, 21)?);
    v.push(
        Case::new(
            "batch/causal_document",
            causal() & Mask::document(seg3.clone()),
        )
        .lens(100, 100)
        .heads(3, 2, 2)
        .tile(32, 16),
    );
    v.push(
        Case::new("batch/document_sinks", Mask::document(seg3.clone()))
            .lens(100, 100)
            .heads(3, 2, 1)
            .tile(16, 32)
            .sinks(),
    );
    let cross = Segments::cross(
        packed_segments(3, 60, 20, 22)?,
        packed_segments(3, 100, 30, 23)?,
    )?;
    v.push(
        Case::new("batch/cross_document", Mask::document(cross))
            .lens(60, 100)
            .heads(3, 2, 2),
    );
    v.push(
        Case::new(
            "batch/band_cross_sinks",
            random_band(3, (60, 100), (-4, 6), true, 24)? & Mask::causal_offset(40),
        )
        .lens(60, 100)
        .heads(3, 2, 1)
        .tile(16, 32)
        .sinks(),
    );

    v.push(
        Case::new(
            "batch/blocks_per_row_and_head",
            random_blocks([3, 2, 4, 6], 4, 32, 32, 24)? & causal() & Mask::document(seg3.clone()),
        )
        .lens(100, 100)
        .heads(3, 2, 1)
        .tile(32, 16)
        .sinks(),
    );

    // gqa/
    v.push(
        Case::new("gqa/8to2_causal", causal())
            .lens(70, 70)
            .heads(1, 8, 2),
    );
    v.push(
        Case::new("gqa/4to1_mqa_window", Mask::window(12, 3))
            .lens(70, 90)
            .heads(2, 4, 1),
    );
    let per_head: Vec<Mask> = (0..8)
        .map(|h| match h % 4 {
            0 => causal(),
            1 => Mask::window(5, 0),
            2 => Mask::full(),
            _ => !Mask::full(),
        })
        .collect();
    v.push(
        Case::new("gqa/8to2_heads", Mask::heads(per_head))
            .lens(50, 50)
            .heads(1, 8, 2),
    );
    v.push(
        Case::new("gqa/8to2_softcap_sinks", causal())
            .lens(40, 40)
            .heads(1, 8, 2)
            .softcap(4.0)
            .sinks(),
    );

    // dims/
    for d in [32, 64, 128, 256] {
        v.push(
            Case::new(format!("dims/{d}"), causal())
                .lens(60, 60)
                .heads(1, 1, 1)
                .dims(d, d),
        );
    }
    v.push(
        Case::new("dims/192x128", causal())
            .lens(60, 60)
            .heads(1, 1, 1)
            .dims(192, 128),
    );
    v.push(
        Case::new("dims/40x24", causal())
            .lens(60, 60)
            .heads(1, 2, 1)
            .dims(40, 24),
    );
    v.push(
        Case::new("dims/8x72", Mask::window(9, 9))
            .lens(45, 45)
            .heads(1, 1, 1)
            .dims(8, 72),
    );

    // tile/
    let doc150 = Mask::document(Segments::shared(packed_segments(1, 150, 50, 31)?));
    for (tq, tk) in [
        (16, 16),
        (32, 64),
        (64, 32),
        (16, 128),
        (128, 16),
        (64, 64),
        (128, 128),
    ] {
        v.push(
            Case::new(format!("tile/{tq}x{tk}"), causal() & doc150.clone())
                .lens(150, 150)
                .tile(tq, tk),
        );
    }

    // feat/
    v.push(Case::new("feat/softcap", causal()).softcap(5.0));
    v.push(
        Case::new("feat/softcap_tight", Mask::window(10, 10))
            .softcap(1.0)
            .scale(1.0),
    );
    v.push(Case::new("feat/sinks", causal()).sinks());
    v.push(
        Case::new("feat/sinks_softcap", causal() & Mask::chunk(24))
            .sinks()
            .softcap(3.0),
    );
    v.push(Case::new("feat/scale", causal()).scale(0.5));
    v.push(
        Case::new("feat/large_logits", Mask::full())
            .scale(3.0)
            .lens(48, 80),
    );

    // masked/: rows with no allowed key.
    v.push(Case::new("masked/none", !Mask::full()));
    v.push(Case::new("masked/none_sinks", !Mask::full()).sinks());
    let seg_pad = Segments::shared(packed_segments(2, 64, 16, 41)?);
    v.push(
        Case::new(
            "masked/padding_rows",
            causal() & Mask::document(seg_pad.clone()),
        )
        .heads(2, 2, 2),
    );
    v.push(
        Case::new(
            "masked/padding_rows_sinks",
            causal() & Mask::document(seg_pad),
        )
        .heads(2, 2, 2)
        .sinks(),
    );
    v.push(Case::new(
        "masked/negative_offset",
        Mask::causal_offset(-20),
    ));
    v.push(Case::new("masked/negative_offset_sinks", Mask::causal_offset(-20)).sinks());
    // The first 20 queries' feature is beyond every key's: their rows allow nothing.
    let unmatched = {
        let f: Vec<i64> = (0..64).map(|i| if i < 20 { 1 << 40 } else { i }).collect();
        let g: Vec<i64> = (0..64).collect();
        let features = BandFeatures::new("f", SegmentIds::shared(f)?, "g", SegmentIds::shared(g)?);
        Mask::band(features, 0, 9)
    };
    v.push(Case::new("masked/band_rows", unmatched.clone()));
    v.push(Case::new("masked/band_rows_sinks", unmatched).sinks());

    // bf16/
    v.push(Case::new("bf16/causal", causal()).bf16().lens(75, 75));
    v.push(
        Case::new("bf16/batch_document", causal() & Mask::document(seg3))
            .lens(100, 100)
            .heads(3, 2, 2)
            .tile(32, 64)
            .bf16(),
    );
    v.push(
        Case::new("bf16/gqa", Mask::window(16, 0))
            .heads(1, 8, 2)
            .lens(70, 70)
            .bf16(),
    );
    v.push(
        Case::new("bf16/softcap_sinks", causal())
            .softcap(4.0)
            .sinks()
            .bf16(),
    );
    v.push(
        Case::new("bf16/masked_sinks", Mask::causal_offset(-20))
            .sinks()
            .bf16(),
    );
    v.push(
        Case::new("bf16/dims_128", causal())
            .dims(128, 128)
            .heads(1, 1, 1)
            .bf16(),
    );
    v.push(Case::new("bf16/dims_40x24", causal()).dims(40, 24).bf16());
    v.push(
        Case::new(
            "bf16/band_shuffled_gqa",
            random_band(1, (70, 70), (-2, 2), false, 42)?,
        )
        .heads(1, 4, 2)
        .lens(70, 70)
        .bf16(),
    );
    v.push(
        Case::new("bf16/cross_gqa_odd_dims", Mask::causal_offset(40))
            .lens(90, 130)
            .heads(1, 4, 2)
            .dims(33, 17)
            .tile(32, 64)
            .softcap(6.0)
            .sinks()
            .bf16(),
    );

    // large/: default-size tiles (many full and partial 128-wide tiles), L up to 1000.
    let seg2 = Segments::shared(packed_segments(2, 1000, 400, 51)?);
    v.push(
        Case::new(
            "large/causal_document_gqa_sinks_softcap",
            causal() & Mask::document(seg2.clone()),
        )
        .lens(1000, 1000)
        .heads(2, 4, 2)
        .dims(64, 64)
        .tile(128, 128)
        .sinks()
        .softcap(20.0),
    );
    v.push(
        Case::new(
            "large/causal_document_gqa_sinks_softcap_bf16",
            causal() & Mask::document(seg2),
        )
        .lens(1000, 1000)
        .heads(2, 4, 2)
        .dims(64, 64)
        .tile(128, 128)
        .sinks()
        .softcap(20.0)
        .bf16(),
    );
    v.push(
        Case::new(
            "large/window_or_prefix_bf16",
            (Mask::window(256, 0) & causal()) | Mask::prefix(64),
        )
        .lens(1000, 1000)
        .heads(1, 2, 2)
        .dims(64, 64)
        .tile(64, 128)
        .bf16(),
    );
    v.push(
        Case::new("large/dense", random_dense(&[2, 500, 500], 0.3, 52)?)
            .lens(500, 500)
            .heads(1, 2, 1)
            .dims(64, 64)
            .tile(128, 128),
    );
    let cross = Segments::cross(
        packed_segments(1, 1000, 250, 53)?,
        packed_segments(1, 700, 200, 54)?,
    )?;
    v.push(
        Case::new("large/cross_document", Mask::document(cross))
            .lens(1000, 700)
            .heads(1, 2, 2)
            .dims(128, 64)
            .tile(128, 64),
    );
    v.push(
        Case::new(
            "large/band_document_causal",
            random_band(2, (1000, 1000), (0, 40), true, 55)?
                & Mask::document(Segments::shared(packed_segments(2, 1000, 400, 56)?))
                & causal(),
        )
        .lens(1000, 1000)
        .heads(2, 2, 1)
        .dims(64, 64)
        .tile(128, 128)
        .sinks(),
    );
    v.push(
        Case::new("large/dims_256", causal())
            .lens(600, 600)
            .heads(1, 1, 1)
            .dims(256, 256)
            .tile(128, 128),
    );
    Ok(v)
}

/// Cases long enough for full tiles next to partial ones, so every tile path of every kernel
/// copy runs (fused column max on full tiles, live spans on partial ones) with softcap, sinks and
/// odd sizes; run by [`backend_conformance_tests!`](crate::backend_conformance_tests) next to
/// the standard cases.
pub fn dispatch_cases() -> Vec<Case> {
    let causal = Mask::causal;
    vec![
        Case::new("dispatch/causal_softcap_sinks_bf16", causal())
            .lens(300, 300)
            .dims(64, 64)
            .tile(64, 64)
            .softcap(5.0)
            .sinks()
            .bf16(),
        Case::new(
            "dispatch/window_odd_dims_bf16",
            Mask::window(70, 0) & causal(),
        )
        .lens(333, 333)
        .heads(1, 4, 2)
        .dims(37, 19)
        .tile(32, 64)
        .bf16(),
        Case::new("dispatch/causal_softcap_f32", causal())
            .lens(300, 300)
            .dims(64, 64)
            .tile(64, 64)
            .softcap(5.0)
            .sinks(),
    ]
}

/// Runs every case of `group` (`mask`, `len`, ..., or `dispatch`) on the backend `make` returns;
/// a backend this machine cannot run (`make` fails) is skipped with a printed reason. Panics
/// listing every failed case.
pub fn run_group_or_skip<B: Backend, E: std::fmt::Display>(
    make: impl FnOnce() -> std::result::Result<B, E>,
    group: &str,
) {
    if let Err(e) = tessera_core::cpu_features::check_hide_env() {
        panic!("{e}");
    }
    let backend = match make() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipping conformance group {group}: {e}");
            return;
        }
    };
    let cases: Vec<Case> = standard_cases()
        .into_iter()
        .chain(dispatch_cases())
        .filter(|c| c.group() == group)
        .collect();
    assert!(!cases.is_empty(), "no cases in group {group}");
    let mut failed = Vec::new();
    for c in &cases {
        let r = run_case(&backend, c).unwrap_or_else(|e| panic!("case {}: {e}", c.name));
        println!("{r}");
        if !r.passed() {
            failed.push(r.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} on {}: {} failed:\n{}",
        group,
        backend.name(),
        failed.len(),
        failed.join("\n")
    );
}
