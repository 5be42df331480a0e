//! Gating: the telemetry configuration and the step counter that decides, before each forward,
//! whether this step logs (and therefore which kernel variant runs).

use serde::{Deserialize, Serialize};
use tessera_core::{Error, Result};

/// Which summaries a logging step fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Streams {
    /// Sink stream, filled by the kernel's telemetry variant: sink mass, learned-sink mass,
    /// entropy, valid rows, and `max_logit` (from the kernel's `[B, Hq]` output).
    pub sink: bool,
    /// Outlier stream, a read-only pass over O after the forward: max |O|, RMS, outlier counts.
    pub outlier: bool,
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            sink: true,
            outlier: true,
        }
    }
}

/// Default number of sink tokens at the start of each document (or sequence).
pub const DEFAULT_SINK_TOKENS: usize = 1;
/// Default sink-rate threshold ε on a head's mean sink mass (Gu et al.).
pub const DEFAULT_EPSILON: f64 = 0.3;
/// Default outlier ratio: an element is an outlier when `|o| > 6 × RMS` of its (b, h) slice
/// (6σ for a Gaussian: about 2 in 10⁹ elements, so any count is a signal).
pub const DEFAULT_OUTLIER_RATIO: f64 = 6.0;

/// Telemetry configuration: cadence, streams and thresholds. `Default` never logs (`every = 0`)
/// with both streams on and the default thresholds; see [`TelemetryConfig::every`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TelemetryConfig {
    /// Log on steps where `step % every == 0`; 0 = never.
    pub every: u64,
    /// Which summaries a logging step fills.
    pub streams: Streams,
    /// Sink keys per document (or sequence): key positions `< sink_tokens`. 0 = no sink keys.
    pub sink_tokens: usize,
    /// Sink-rate threshold on a head's mean sink mass, in `[0, 1]`.
    pub epsilon: f64,
    /// Outlier threshold as a multiple of the RMS of each (b, h) slice; finite, `>= 0`.
    pub outlier_ratio: f64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            every: 0,
            streams: Streams::default(),
            sink_tokens: DEFAULT_SINK_TOKENS,
            epsilon: DEFAULT_EPSILON,
            outlier_ratio: DEFAULT_OUTLIER_RATIO,
        }
    }
}

impl TelemetryConfig {
    /// Both streams, default thresholds, logging every `n` steps.
    pub fn every(n: u64) -> Self {
        TelemetryConfig {
            every: n,
            ..Self::default()
        }
    }

    /// Checks the thresholds.
    pub fn validate(&self) -> Result<()> {
        if !(self.epsilon.is_finite() && (0.0..=1.0).contains(&self.epsilon)) {
            return Err(Error::invalid(
                "telemetry epsilon",
                "a number in [0, 1]",
                self.epsilon,
            ));
        }
        check_ratio(self.outlier_ratio)
    }
}

pub(crate) fn check_ratio(ratio: f64) -> Result<()> {
    if ratio.is_finite() && ratio >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            "outlier ratio",
            "a finite number >= 0",
            ratio,
        ))
    }
}

/// Attached once per model: the configuration plus the step counter.
///
/// Per training step: read [`Telemetry::should_log`] (or the per-stream
/// [`Telemetry::sink_stream`] / [`Telemetry::outlier_stream`]) *before* the forward to pick the
/// kernel variant, run the forward, then [`Telemetry::advance`].
#[derive(Debug, Clone, PartialEq)]
pub struct Telemetry {
    /// Cadence, streams and thresholds.
    pub config: TelemetryConfig,
    /// The current step (0 after [`Telemetry::new`]).
    pub step: u64,
}

impl Telemetry {
    /// Starts at step 0. Fails on invalid thresholds.
    pub fn new(config: TelemetryConfig) -> Result<Self> {
        config.validate()?;
        Ok(Telemetry { config, step: 0 })
    }

    /// True when the current step logs: `every > 0`, `step % every == 0` and a stream is on.
    pub fn should_log(&self) -> bool {
        let s = self.config.streams;
        self.config.every != 0
            && self.step.is_multiple_of(self.config.every)
            && (s.sink || s.outlier)
    }

    /// Run the telemetry kernel variant this step.
    pub fn sink_stream(&self) -> bool {
        self.should_log() && self.config.streams.sink
    }

    /// Run the outlier pass over O this step.
    pub fn outlier_stream(&self) -> bool {
        self.should_log() && self.config.streams.outlier
    }

    /// Moves to the next step.
    pub fn advance(&mut self) {
        self.step = self.step.saturating_add(1);
    }
}
