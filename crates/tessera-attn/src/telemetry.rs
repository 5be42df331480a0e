//! Gated attention telemetry on the forward pass (SPEC §6): [`TelemetryInput`] for
//! [`Backend::forward_with_telemetry_into`], and [`forward_logged_into`], the one call a training
//! loop makes per attention layer.
//!
//! Contract:
//! - The kernel variant is picked once per call, before any work: on a non-logging step
//!   [`forward_logged_into`] is exactly [`Backend::forward_into`] (the production kernel, no telemetry code
//!   at all); on a logging step it runs [`Backend::forward_with_telemetry`], whose O, LSE and
//!   max_logit are bit-identical to the plain forward's, and submits the summary to the sink.
//! - Definitions, merging and the JSON-lines readout are `tessera_telemetry`'s (crate doc there).

use crate::{
    check_inputs, AttnInputs, AttnOptions, Backend, ForwardBufs, ForwardOut, ForwardOutput, Par,
};
use std::sync::Arc;
use tessera_core::{Error, Result};
use tessera_mask::Mask;
use tessera_plan::Plan;
use tessera_telemetry::{
    document_kv_segments, sink_key_flags, Streams, Telemetry, TelemetryConfig, TelemetrySink,
};

/// What a logging forward needs besides the attention inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TelemetryInput<'a> {
    /// Sink-key flags `[B, Lkv]`, row-major (see `tessera_telemetry::sink_key_flags`).
    pub sink_flags: &'a [bool],
    /// Step the summary is for.
    pub step: u64,
    /// Layer the summary is for.
    pub layer: u32,
    /// Sink stream: the telemetry kernel variant fills sink mass, learned-sink mass, entropy and
    /// valid rows. Outlier stream: a read-only pass over O. `max_logit` is always filled (the
    /// kernel produces it anyway).
    pub streams: Streams,
    /// Outlier threshold as a multiple of the RMS of each (b, h) slice of O.
    pub outlier_ratio: f64,
}

impl<'a> TelemetryInput<'a> {
    /// The input for `config`'s streams and threshold.
    pub fn new(sink_flags: &'a [bool], step: u64, layer: u32, config: &TelemetryConfig) -> Self {
        TelemetryInput {
            sink_flags,
            step,
            layer,
            streams: config.streams,
            outlier_ratio: config.outlier_ratio,
        }
    }

    /// Checks the flags length (`batch · kv_len`) and the outlier ratio.
    pub fn check(&self, batch: usize, kv_len: usize) -> Result<()> {
        if self.sink_flags.len() != batch * kv_len {
            return Err(Error::invalid(
                "sink flags",
                format!("{} flags [B={batch}, Lkv={kv_len}]", batch * kv_len),
                self.sink_flags.len(),
            ));
        }
        if !(self.outlier_ratio.is_finite() && self.outlier_ratio >= 0.0) {
            return Err(Error::invalid(
                "outlier ratio",
                "a finite number >= 0",
                self.outlier_ratio,
            ));
        }
        Ok(())
    }
}

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
