//! Gated attention telemetry on the forward pass (docs/semantics.md#telemetry): [`forward_logged_into`], the one call
//! a training loop makes per attention layer (its kernel input, [`TelemetryInput`], is an argument
//! struct of [`Backend::forward_with_telemetry_into`] in `args`), and [`effective_gflops`], the
//! throughput figure reports give.
//!
//! Contract:
//! - The kernel variant is picked once per call, before any work: on a non-logging step
//!   [`forward_logged_into`] is exactly [`Backend::forward_into`] (the production kernel, no telemetry code
//!   at all); on a logging step it runs [`Backend::forward_with_telemetry`], whose O, LSE and
//!   max_logit are bit-identical to the plain forward's, and submits the summary to the sink.
//! - Definitions, merging and the JSON-lines readout are `tessera_telemetry`'s (crate doc there).

use crate::args::{AttnInputs, ForwardOut, ForwardOutput, TelemetryInput};
use crate::backend::{Backend, ForwardBufs};
use crate::options::AttnOptions;
use crate::par::Par;
use crate::validate::check_inputs;
use std::sync::Arc;
use tessera_core::Result;
use tessera_mask::Mask;
use tessera_plan::Plan;
use tessera_telemetry::{document_kv_segments, sink_key_flags, Telemetry, TelemetrySink};

/// The telemetry side of one logged forward: the step gate, the mask the plan was built from
/// (for the sink keys), the layer and where the summary goes.
pub struct LogContext<'a> {
    /// Step counter and configuration (the caller advances it once per step).
    pub tel: &'a Telemetry,
    /// The mask the plan was built from.
    pub mask: &'a Mask,
    /// Layer the summary is for.
    pub layer: u32,
    /// Where summaries are submitted (merged per (step, layer)).
    pub sink: &'a mut TelemetrySink,
}

/// One attention forward under gated telemetry, into caller-owned outputs.
///
/// When `log.tel.should_log()` is false this is [`Backend::forward_into`] and nothing else.
/// Otherwise it derives the sink-key flags from `log.mask` (the kv segment ids of its first
/// `document` leaf, or the sequence start; `tel.config.sink_tokens` keys each), runs
/// [`Backend::forward_with_telemetry_into`] for step `tel.step` and `log.layer`, and submits the
/// summary to `log.sink` (merged per (step, layer); records are produced at
/// [`TelemetrySink::flush`]). The step counter is the caller's: call this for every layer of a
/// step, then [`Telemetry::advance`] once.
#[allow(clippy::too_many_arguments)]
pub fn forward_logged_into<B: Backend + ?Sized>(
    backend: &B,
    prepared: &B::Prepared,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    out: ForwardOut<'_>,
    ws: &mut B::Workspace,
    par: Par<'_>,
    log: LogContext<'_>,
) -> Result<()> {
    let tel = log.tel;
    if !tel.should_log() {
        return backend.forward_into(prepared, inputs, options, out, ws, par);
    }
    // The inputs' batch size: a batch-invariant plan built for one row serves any batch.
    let d = check_inputs(inputs, options)?;
    let flags = sink_key_flags(
        document_kv_segments(log.mask),
        d.batch,
        d.kv_len,
        tel.config.sink_tokens,
    )?;
    let input = TelemetryInput::new(&flags, tel.step, log.layer, &tel.config);
    let summary =
        backend.forward_with_telemetry_into(prepared, inputs, options, &input, out, ws, par)?;
    log.sink.submit(summary)
}

/// [`forward_logged_into`] with freshly prepared plan, allocated outputs and workspace.
pub fn forward_logged<B: Backend + ?Sized>(
    backend: &B,
    inputs: &AttnInputs<'_>,
    plan: &Arc<Plan>,
    options: &AttnOptions,
    log: LogContext<'_>,
) -> Result<ForwardOutput> {
    let prepared = backend.prepare(plan)?;
    let d = check_inputs(inputs, options)?;
    let mut bufs = ForwardBufs::new(&d);
    forward_logged_into(
        backend,
        &prepared,
        inputs,
        options,
        bufs.out(),
        &mut B::Workspace::default(),
        Par::Current,
        log,
    )?;
    bufs.finish(&d)
}

/// Effective GFLOP/s: `flops` (for example [`Plan::forward_flops`](tessera_plan::Plan::forward_flops), counted over allowed pairs
/// only) done in `seconds`. Zero when `seconds` is not positive.
pub fn effective_gflops(flops: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        flops / seconds / 1e9
    } else {
        0.0
    }
}
