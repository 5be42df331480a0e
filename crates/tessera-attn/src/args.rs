//! The argument structs of backend calls: what a forward or backward takes ([`AttnInputs`],
//! [`GradInputs`], a logging forward's [`TelemetryInput`]) and gives ([`ForwardOut`],
//! [`GradOut`] into caller-owned buffers, [`ForwardOutput`], [`BackwardOutput`] allocated).
//!
//! Contract: plain data, below validation and the [`Backend`](crate::Backend) trait so that
//! both (and the kernels) can name them; shapes and dtypes are checked by `validate`, the
//! telemetry input's own fields by [`TelemetryInput::check`].

use crate::views::{OutData, StridedView};
use tessera_core::tensor::TensorView;
use tessera_core::{Error, Result, Tensor};
use tessera_telemetry::{Streams, TelemetryConfig};

/// The inputs of a forward call: Q `[B, Hq, Lq, Dqk]`, K `[B, Hkv, Lkv, Dqk]`, V `[B, Hkv, Lkv, Dv]`.
#[derive(Debug, Clone, Copy)]
pub struct AttnInputs<'a> {
    /// Queries.
    pub q: StridedView<'a>,
    /// Keys.
    pub k: StridedView<'a>,
    /// Values.
    pub v: StridedView<'a>,
}

impl<'a> AttnInputs<'a> {
    /// Inputs from contiguous rank-4 tensors.
    pub fn contiguous(q: TensorView<'a>, k: TensorView<'a>, v: TensorView<'a>) -> Result<Self> {
        Ok(AttnInputs {
            q: StridedView::contiguous("q", q)?,
            k: StridedView::contiguous("k", k)?,
            v: StridedView::contiguous("v", v)?,
        })
    }
}

/// The inputs of a backward call: the forward's inputs, its O `[B, Hq, Lq, Dv]` and LSE
/// `[B, Hq, Lq]` (f32, contiguous), the output gradient dO `[B, Hq, Lq, Dv]` and, when the loss
/// also depends on the LSE, its gradient dLSE `[B, Hq, Lq]` (f32, contiguous; `None` = zero).
#[derive(Debug, Clone, Copy)]
pub struct GradInputs<'a> {
    /// Queries.
    pub q: StridedView<'a>,
    /// Keys.
    pub k: StridedView<'a>,
    /// Values.
    pub v: StridedView<'a>,
    /// The forward output.
    pub o: StridedView<'a>,
    /// The forward's log-sum-exp, contiguous `[B, Hq, Lq]` f32.
    pub lse: TensorView<'a>,
    /// Gradient of the loss with respect to O.
    pub d_o: StridedView<'a>,
    /// Gradient of the loss with respect to LSE (`None`: the loss does not depend on it).
    pub d_lse: Option<TensorView<'a>>,
}

impl<'a> GradInputs<'a> {
    /// Inputs from contiguous tensors.
    pub fn contiguous(
        fwd: AttnInputs<'a>,
        o: TensorView<'a>,
        lse: TensorView<'a>,
        d_o: TensorView<'a>,
    ) -> Result<Self> {
        Ok(GradInputs {
            q: fwd.q,
            k: fwd.k,
            v: fwd.v,
            o: StridedView::contiguous("o", o)?,
            lse,
            d_o: StridedView::contiguous("d_o", d_o)?,
            d_lse: None,
        })
    }

    /// The forward part.
    pub fn forward(&self) -> AttnInputs<'a> {
        AttnInputs {
            q: self.q,
            k: self.k,
            v: self.v,
        }
    }
}

/// Caller-owned forward outputs, contiguous: O `[B, Hq, Lq, Dv]` in q's dtype, LSE
/// `[B, Hq, Lq]` and max_logit `[B, Hq]` in f32.
#[derive(Debug)]
pub struct ForwardOut<'a> {
    /// Attention output.
    pub o: OutData<'a>,
    /// Natural log of the softmax denominator (sink included).
    pub lse: &'a mut [f32],
    /// Max over allowed pairs of the scaled logit before softcap (-inf if none).
    pub max_logit: &'a mut [f32],
}

/// Caller-owned backward outputs, contiguous, in q's dtype: dQ `[B, Hq, Lq, Dqk]`, dK
/// `[B, Hkv, Lkv, Dqk]`, dV `[B, Hkv, Lkv, Dv]`; dsinks `[Hq]` f32 when sinks are given.
#[derive(Debug)]
pub struct GradOut<'a> {
    /// Gradient for Q.
    pub dq: OutData<'a>,
    /// Gradient for K.
    pub dk: OutData<'a>,
    /// Gradient for V.
    pub dv: OutData<'a>,
    /// Gradient for the sink logits (required exactly when the options have sinks).
    pub dsinks: Option<&'a mut [f32]>,
}

/// Forward results of the allocating convenience.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// `[B, Hq, Lq, Dv]` in q's storage dtype.
    pub o: Tensor,
    /// `[B, Hq, Lq]` f32, natural log of the softmax denominator (sink included).
    pub lse: Tensor,
    /// `[B, Hq]` f32: max over allowed pairs of the scaled logit before softcap (-inf if none).
    pub max_logit: Tensor,
}

/// Backward results of the allocating convenience.
#[derive(Debug, Clone, PartialEq)]
pub struct BackwardOutput {
    /// `[B, Hq, Lq, Dqk]` in q's storage dtype.
    pub dq: Tensor,
    /// `[B, Hkv, Lkv, Dqk]` in q's storage dtype.
    pub dk: Tensor,
    /// `[B, Hkv, Lkv, Dv]` in q's storage dtype.
    pub dv: Tensor,
    /// `[Hq]` f32 gradient of the sink logits; present when sinks were given.
    pub dsinks: Option<Tensor>,
}

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
