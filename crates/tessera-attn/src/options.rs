//! Options of one attention call (docs/semantics.md#attention): logit scale, softcap, learned sinks.
//!
//! Contract: plain data with no behaviour beyond [`AttnOptions::scale_for`]; their values are
//! checked by `validate` with the rest of a call's inputs.

/// Options of one attention call (docs/semantics.md#attention).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnOptions {
    /// Logit scale; default `1/sqrt(Dqk)`. Must be finite and positive.
    pub scale: Option<f32>,
    /// Softcap `c`: logits become `c·tanh(s/c)`. Must be finite and positive.
    pub softcap: Option<f32>,
    /// Learned sink logit per query head (`Hq` finite values), joining the softmax denominator only.
    pub sinks: Option<Vec<f32>>,
}

impl AttnOptions {
    /// The effective scale for head dimension `d_qk`.
    pub fn scale_for(&self, d_qk: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (d_qk as f32).sqrt())
    }
}
