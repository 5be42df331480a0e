//! Gated attention telemetry on the forward pass (SPEC §6): [`TelemetryInput`] for
//! [`Backend::forward_with_telemetry`], and [`forward_logged`], the one call a training loop makes
//! per attention layer.
//!
//! Contract:
//! - The kernel variant is picked once per call, before any work: on a non-logging step
//!   [`forward_logged`] is exactly [`Backend::forward`] (the production kernel, no telemetry code
//!   at all); on a logging step it runs [`Backend::forward_with_telemetry`], whose O, LSE and
//!   max_logit are bit-identical to the plain forward's, and submits the summary to the sink.
//! - Definitions, merging and the JSON-lines readout are `tessera_telemetry`'s (crate doc there).

use crate::{AttnOptions, Backend, ForwardOutput};
use tessera_core::tensor::TensorView;
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
    /// Step and layer the summary is for.
    pub step: u64,
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

/// One attention forward under gated telemetry.
///
/// When `tel.should_log()` is false this is [`Backend::forward`] and nothing else. Otherwise it
/// derives the sink-key flags from `mask` (the kv segment ids of its first `document` leaf, or
/// the sequence start; `tel.config.sink_tokens` keys each), runs
/// [`Backend::forward_with_telemetry`] for step `tel.step` and `layer`, and submits the summary
/// to `sink` (merged per (step, layer); records are produced at [`TelemetrySink::flush`]).
///
/// `mask` must be the mask `plan` was built from. The step counter is the caller's: call this
/// for every layer of a step, then [`Telemetry::advance`] once.
#[allow(clippy::too_many_arguments)]
pub fn forward_logged<B: Backend + ?Sized>(
    backend: &B,
    q: TensorView<'_>,
    k: TensorView<'_>,
    v: TensorView<'_>,
    plan: &Plan,
    options: &AttnOptions,
    tel: &Telemetry,
    mask: &Mask,
    layer: u32,
    sink: &mut TelemetrySink,
) -> Result<ForwardOutput> {
    if !tel.should_log() {
        return backend.forward(q, k, v, plan, options);
    }
    let shape = plan.shape;
    let flags = sink_key_flags(
        document_kv_segments(mask),
        shape.batch,
        shape.kv_len,
        tel.config.sink_tokens,
    )?;
    let input = TelemetryInput::new(&flags, tel.step, layer, &tel.config);
    let (out, summary) = backend.forward_with_telemetry(q, k, v, plan, options, &input)?;
    sink.submit(summary)?;
    Ok(out)
}
