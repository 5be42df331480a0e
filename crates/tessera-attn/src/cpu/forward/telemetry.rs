//! The telemetry variant of the forward kernel (docs/semantics.md#telemetry, sink stream).
//!
//! The item kernel the plain forward would run (`forward::item_with`, or `forward::bf16::item` where
//! `forward::select` picks the AVX512-BF16 bf16 kernel), instantiated with [`TelObserver`]
//! instead of `NoTelemetry`, so a logging step runs one kernel and its O, LSE and max_logit are
//! bit-identical to the plain forward. Per query row the observer keeps, relative to the kernel's
//! running max `m`, the online sums of `tessera_telemetry::RowSums`:
//! - `l = Σ e^{s−m}`, `sink_l = Σ_{sink keys} e^{s−m}`, `es = Σ e^{s−m}·(s−m)`.
//!
//! Per key row of a kv tile the kernel runs its fused exponential loop (`entropy_terms`), which
//! also accumulates `p·(s − m_use)` (the `p ln p` of the entropy without a logarithm, with the
//! `s − m` already at hand) into a per-tile f32 column sum; for sink keys only, `after_exp` adds
//! `p` into another. At the end of the tile (`on_tile`, vectorized over the rows) the f64 row sums
//! are moved to the tile's max (`l ← α l`, `sink_l ← α sink_l`, `es ← α es + α ln(α) l`, with the
//! kernel's α and `ln α = m_old − m_new`; the copies with FMA exponentiate in base 2 against
//! `m·log2 e` rounded once, which moves each row's reference by at most `|m|·2⁻²⁴`, far inside
//! the telemetry's tolerances) and the column sums (the kernel's `Σ p` among them) added. When a row is final (`on_row`) its sink mass,
//! learned-sink mass and entropy follow as in `RowSums::finish` (what `finish_row` adds), with
//! the kernel's f64 LSE of the row in place of a recomputed one (no logarithm per row). They are
//! summed in f64 in row order over the item's rows; each item then adds its three sums and its
//! valid-row count to the `HeadAccum` of its (b, h), and those merge per query head. `HeadAccum`
//! additions are exact, so their order never matters: the summary is bit-identical run to run and
//! for any thread count, and the summaries of batch shards (same tiles) merge into the whole
//! batch's bit for bit. The outlier stream is `AttnSummary::add_output` with the (b, h) slices on
//! the rayon pool (the same statistics, bit for bit).
//!
//! `forward::bf16` rounds P to bf16 for `P·V`; its hooks see the f32 P (the values summed into `l`),
//! which its observed copy writes over each key's logits, one extra pass per key pair that the
//! production copy skips (`TileObserver::OBSERVES`).

use crate::args::{AttnInputs, ForwardOut, TelemetryInput};
#[cfg(target_arch = "x86_64")]
use crate::cpu::forward::bf16;
use crate::cpu::forward::select;
use crate::cpu::forward::{self, FwdCtx, FwdItem, FwdWs, TileObserver};
use crate::cpu::isa::{isa_entry, runs_bf16_kernel, Isa};
use crate::cpu::prepare::Prep;
use crate::cpu::schedule::Geometry;
use crate::cpu::simd::Simd;
#[cfg(target_arch = "x86_64")]
use crate::cpu::workspace::Bufs;
use crate::cpu::workspace::{Rest, WsPool};
use crate::options::AttnOptions;
use crate::validate::Dims;
use crate::views::OutData;
use rayon::prelude::*;
use std::sync::Mutex;
use std::time::Instant;
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{metrics, Result};
use tessera_plan::Plan;
use tessera_telemetry::{AttnSummary, HeadAccum, OutlierStats};

/// Per-worker scratch of the observer, `tq` entries each.
pub(crate) struct TelWs {
    /// Column sums of the current kv tile: `Σ p·(s − m_use)`, `Σ_{sink keys} p` (`Σ p` is the
    /// kernel's own).
    es_col: Vec<f32>,
    sink_col: Vec<f32>,
    /// The item's row sums (the fields of `tessera_telemetry::RowSums`, one array each so the
    /// tile update vectorizes).
    m: Vec<f64>,
    l: Vec<f64>,
    sink_l: Vec<f64>,
    es: Vec<f64>,
}

impl TelWs {
    fn new(tq: usize) -> Self {
        TelWs {
            es_col: vec![0.0; tq],
            sink_col: vec![0.0; tq],
            m: vec![f64::NEG_INFINITY; tq],
            l: vec![0.0; tq],
            sink_l: vec![0.0; tq],
            es: vec![0.0; tq],
        }
    }
}

/// The sink-stream observer of one work item.
pub(crate) struct TelObserver<'w> {
    /// Sink-key flags of the item's batch row (`Lkv` entries).
    flags: &'w [bool],
    /// The head's learned sink logit.
    sigma: Option<f64>,
    ws: &'w mut TelWs,
    /// The item's valid rows and their f64 sums (in row order) of sink mass, learned-sink mass
    /// and entropy; added to the (b, h) accumulator once per item.
    valid: u64,
    sums: [f64; 3],
}

impl<'w> TelObserver<'w> {
    fn new(flags: &'w [bool], sigma: Option<f64>, ws: &'w mut TelWs) -> Self {
        ws.es_col.fill(0.0);
        ws.sink_col.fill(0.0);
        ws.m.fill(f64::NEG_INFINITY);
        ws.l.fill(0.0);
        ws.sink_l.fill(0.0);
        ws.es.fill(0.0);
        TelObserver {
            flags,
            sigma,
            ws,
            valid: 0,
            sums: [0.0; 3],
        }
    }

    /// Adds the item's rows to `acc`.
    fn add_to(&self, acc: &mut HeadAccum) {
        acc.valid_rows += self.valid;
        acc.sink_mass_sum.add(self.sums[0]);
        acc.learned_sink_mass_sum.add(self.sums[1]);
        acc.entropy_sum.add(self.sums[2]);
    }
}

impl TileObserver for TelObserver<'_> {
    #[inline(always)]
    fn entropy_terms(&mut self, a: usize, b: usize) -> Option<&mut [f32]> {
        Some(&mut self.ws.es_col[a..b])
    }

    #[inline(always)]
    fn after_exp(&mut self, key: usize, a: usize, p: &[f32]) {
        if self.flags[key] {
            for (c, &p) in self.ws.sink_col[a..a + p.len()].iter_mut().zip(p) {
                *c += p;
            }
        }
    }

    #[inline(always)]
    fn on_tile(&mut self, col: &[f32], m_use: &[f32], alpha: &[f32]) {
        let ws = &mut *self.ws;
        let n = col.len();
        let (m_use, alpha) = (&m_use[..n], &alpha[..n]);
        let (sink_col, es_col) = (&ws.sink_col[..n], &ws.es_col[..n]);
        let (m, l) = (&mut ws.m[..n], &mut ws.l[..n]);
        let (sink_l, es) = (&mut ws.sink_l[..n], &mut ws.es[..n]);
        // Branch-free, so it vectorizes: rows whose max moved (and that hold something) are
        // rescaled by the kernel's α = e^{m − u} (f32, a few ulp and the base-2 reference's
        // rounding; m is the kernel's old max, finite since l > 0), with ln α = m − u; `es`
        // gains the α·ln(α)·l term.
        for i in 0..n {
            let u = m_use[i] as f64;
            let rescale = u != m[i] && l[i] != 0.0;
            let a = if rescale { alpha[i] as f64 } else { 1.0 };
            let ln_a = if rescale { m[i] - u } else { 0.0 };
            es[i] = a * es[i] + a * ln_a * l[i] + es_col[i] as f64;
            l[i] = a * l[i] + col[i] as f64;
            sink_l[i] = a * sink_l[i] + sink_col[i] as f64;
            m[i] = u;
        }
        ws.es_col[..n].fill(0.0);
        ws.sink_col[..n].fill(0.0);
    }

    #[inline(always)]
    fn on_row(&mut self, i: usize, lse: f64) {
        let ws = &*self.ws;
        let (m, l) = (ws.m[i], ws.l[i]);
        if l == 0.0 {
            return; // not a valid row
        }
        // `RowSums::finish` (what `finish_row` adds) with the kernel's LSE of the row, the same
        // quantity, instead of recomputing it (no logarithm per row): with `w = e^{m − LSE}`
        // (`1/l` without a learned sink), sink mass `w·sink_l`, `p_sink = e^{σ − LSE}`, entropy
        // `−w·es + w·l·(LSE − m) + p_sink·(LSE − σ)`. The item's rows are summed in f64 (row
        // order) and added exactly once per item.
        let (w, p_sink, sigma_term) = match self.sigma {
            None => (1.0 / l, 0.0, 0.0),
            Some(sg) => {
                let p = (sg - lse).exp();
                let term = if p > 0.0 { p * (lse - sg) } else { 0.0 };
                ((m - lse).exp(), p, term)
            }
        };
        let keys = w * l;
        let key_term = if keys > 0.0 { keys * (lse - m) } else { 0.0 };
        self.valid += 1;
        self.sums[0] += w * ws.sink_l[i];
        self.sums[1] += p_sink;
        self.sums[2] += -w * ws.es[i] + key_term + sigma_term;
    }
}

isa_entry!(entry, item, (cx: &FwdCtx<'_>, ws: &mut FwdWs, it: FwdItem<'_>, obs: &mut TelObserver<'_>));

#[inline(always)]
fn item<S: Simd>(cx: &FwdCtx<'_>, ws: &mut FwdWs, mut it: FwdItem<'_>, obs: &mut TelObserver<'_>) {
    // V was scanned (`FwdCtx::new(.., true)`): the hooks see each item once.
    forward::item_with::<S, TelObserver<'_>>(cx, ws, &mut it, obs, cx.exact);
}

/// The hooked forward: the kernel the plain forward would run (`forward::select::run`),
/// instantiated with [`TelObserver`]; writes the outputs and returns one sink-stream accumulator
/// per query head. `sink_flags` is `[B, Lkv]` (checked by the caller).
#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    sink_flags: &[bool],
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<Vec<HeadAccum>> {
    let Rest { items, bufs } = rest;
    #[cfg(target_arch = "x86_64")]
    if runs_bf16_kernel(isa, d.dtype) {
        let Bufs {
            kpack,
            vpack,
            maxes,
            ..
        } = bufs;
        let cx = bf16::Ctx::new(isa, prep, d, inputs, options, kpack, vpack)?;
        return observed(
            prep.plan,
            d,
            options,
            sink_flags,
            out,
            items,
            maxes,
            || cx.workspace(),
            |ws, it, obs| {
                // SAFETY: `Isa::Avx512Bf16` and `Isa::Avx512Amx` are only handed out when the CPU has
                // AVX-512F/BW/VL, FMA and AVX512-BF16.
                unsafe { bf16::item(&cx, ws, it, obs) }
            },
        );
    }
    let cx = FwdCtx::new(prep, d, inputs, options, true)?;
    observed(
        prep.plan,
        d,
        options,
        sink_flags,
        out,
        items,
        &mut bufs.maxes,
        || cx.workspace(),
        |ws, it, obs| entry(isa, &cx, ws, it, obs),
    )
}

/// Runs `kernel` on every work item with the item's [`TelObserver`] (its workspace from
/// `make_ws`) and collects the observers' sums per query head.
#[allow(clippy::too_many_arguments)]
fn observed<W: std::any::Any + Send>(
    plan: &Plan,
    d: &Dims,
    options: &AttnOptions,
    sink_flags: &[bool],
    out: ForwardOut<'_>,
    pool: &WsPool,
    maxes: &mut Vec<f32>,
    make_ws: impl Fn() -> W + Sync,
    kernel: impl Fn(&mut W, FwdItem<'_>, &mut TelObserver<'_>) + Sync,
) -> Result<Vec<HeadAccum>> {
    let tq = Geometry::new(plan, d).tq;
    let (hq, lkv) = (d.heads_q, d.kv_len);
    // One accumulator per (b, h); each item adds its sums (exact additions, so order-free).
    let slots: Vec<Mutex<HeadAccum>> = (0..d.batch * hq)
        .map(|_| Mutex::new(HeadAccum::default()))
        .collect();
    let sinks = options.sinks.as_deref();
    forward::schedule(
        plan,
        d,
        out,
        pool,
        maxes,
        || (make_ws(), TelWs::new(tq)),
        |(ws, tws): &mut (W, TelWs), it| {
            let (b, h) = (it.b, it.h);
            let flags = &sink_flags[b * lkv..(b + 1) * lkv];
            let mut obs = TelObserver::new(flags, sinks.map(|s| s[h] as f64), tws);
            kernel(ws, it, &mut obs);
            let mut slot = slots[b * hq + h]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            obs.add_to(&mut slot);
        },
        |_| {},
    )?;
    let mut heads = vec![HeadAccum::default(); hq];
    for (idx, slot) in slots.into_iter().enumerate() {
        let acc = slot
            .into_inner()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        heads[idx % hq].merge(&acc);
    }
    Ok(heads)
}

/// [`Backend::forward_with_telemetry_into`](crate::Backend::forward_with_telemetry_into) of the
/// CPU backend on kernel copy `isa` (inputs, outputs and `tel` already checked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    tel: &TelemetryInput<'_>,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<AttnSummary> {
    let mut summary = AttnSummary::new(tel.step, tel.layer, d.heads_q, options.sinks.is_some());
    let ForwardOut {
        mut o,
        lse,
        max_logit,
    } = out;
    let out = ForwardOut {
        o: o.reborrow(),
        lse,
        max_logit: &mut *max_logit,
    };
    if tel.streams.sink {
        let start = Instant::now();
        let heads = run(isa, prep, d, inputs, options, tel.sink_flags, out, rest)?;
        metrics::record_kernel(
            &format!("cpu.forward.telemetry.{}", d.dtype),
            start.elapsed(),
        );
        for (acc, h) in summary.heads.iter_mut().zip(&heads) {
            acc.merge(h);
        }
    } else {
        select::run(isa, prep, d, inputs, options, out, rest)?;
    }
    let shape = [d.batch, d.heads_q];
    summary.absorb_max_logit(&TensorView::new(&shape, ViewData::F32(max_logit))?)?;
    if tel.streams.outlier {
        add_output(&mut summary, &o, d, tel.outlier_ratio)?;
    }
    Ok(summary)
}

/// [`AttnSummary::add_output`] with the (b, h) slices of O on the rayon pool: the same
/// per-slice statistics ([`OutlierStats::of_f32`]) merged exactly, so the same result bit for bit.
fn add_output(summary: &mut AttnSummary, o: &OutData<'_>, d: &Dims, ratio: f64) -> Result<()> {
    let (hq, slice) = (d.heads_q, d.q_len * d.d_v);
    let shape = [d.batch, hq, d.q_len, d.d_v];
    if ratio.is_nan() || ratio < 0.0 || ratio.is_infinite() || hq != summary.heads.len() {
        // Let the sequential path produce the error.
        let view = match o {
            OutData::F32(x) => TensorView::new(&shape, ViewData::F32(x))?,
            OutData::BF16(x) => TensorView::new(&shape, ViewData::BF16(x))?,
        };
        return summary.add_output(&view, ratio);
    }
    let stats: Vec<OutlierStats> = match o {
        OutData::F32(x) => x
            .par_chunks(slice)
            .map(|c| OutlierStats::of_f32(c, ratio))
            .collect(),
        OutData::BF16(x) => x
            .par_chunks(slice)
            .map(|c| {
                let c: Vec<f32> = c.iter().map(|v| v.to_f32()).collect();
                OutlierStats::of_f32(&c, ratio)
            })
            .collect(),
    };
    for (idx, st) in stats.iter().enumerate() {
        summary.heads[idx % hq].out.merge(st);
    }
    Ok(())
}
