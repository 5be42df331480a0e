//! Gated attention-sink and outlier telemetry summaries (docs/semantics.md#telemetry).
//!
//! # Gating
//! A [`Telemetry`] (a [`TelemetryConfig`] plus a step counter) is attached once. Before each
//! forward the caller reads [`Telemetry::should_log`] (`every > 0 && step % every == 0`, and a
//! stream on) and picks the kernel variant up front: on a non-logging step the production kernel
//! runs and no telemetry code runs at all. After the step, [`Telemetry::advance`].
//!
//! # Definitions (per query head h; b = batch row, i = query, j = key)
//! - A row `(b, h, i)` is **valid** when it has at least one allowed key. Only valid rows are
//!   counted; a row whose only outcome is the learned sink is not valid.
//! - `s_ij` is the post-softcap scaled logit; `LSE_i = ln(e^{σ_h} + Σ_{j allowed} e^{s_ij})`
//!   (the σ term only with learned sinks); `p_ij = e^{s_ij − LSE_i}`, `p_sink_i = e^{σ_h − LSE_i}`.
//! - **Sink keys** ([`sink_key_flags`]): key j of batch row b is a sink key when its position in
//!   its document is `< sink_tokens` (document = the maximal run of equal kv segment id holding
//!   j, position = j − run start; padding keys, id < 0, never are); without documents, `j <
//!   sink_tokens`.
//! - **sink mass** of a row: `Σ_{j allowed, sink key} p_ij`. **learned sink mass**: `p_sink_i`.
//! - **entropy** of a row (nats): `−Σ_j p_ij ln p_ij − p_sink ln p_sink` (the learned sink is one
//!   outcome of the softmax) `= LSE_i − Σ_j p_ij s_ij − p_sink σ_h`.
//! - **max_logit**: max over allowed pairs of the *pre*-softcap scaled logit (docs/semantics.md#attention).
//! - **Outliers of O** `[B, Hq, Lq, Dv]`: per head, `max |o|`, `Σ o²`, the element count, and the
//!   number of elements with `|o| > ratio × RMS(O[b, h])`, the RMS taken over the element's own
//!   `(b, h)` slice. Because the threshold depends on one slice only, counts from batch shards
//!   merge exactly into the counts of the whole batch (a split along Lq or Dv would not).
//!   [`outlier_summary`] gives the same statistics for any activation tensor `[B, G, ...]`.
//!
//! # Accumulation and merging
//! A [`HeadAccum`] holds **sums**, not means: valid-row count, Σ sink mass, Σ learned sink mass,
//! Σ entropy (each an [`ExactSum`], an exact superaccumulator), the max logit (a NaN-propagating,
//! sign-deterministic max) and the [`OutlierStats`]. Merging is therefore exact, commutative and
//! associative *bit for bit*: shards, threads, replicas and ranks may reduce in any order.
//!
//! # Kernel plug-in (sink stream)
//! Per query row, alongside the usual running max `m` and `l = Σ e^{s−m}`, the telemetry
//! variant keeps `sink_l = Σ_{sink keys} e^{s−m}` and `es = Σ e^{s−m}(s−m)` (equivalently
//! `Σ p̃ ln p̃` for `p̃ = e^{s−m}`, 0 for `p̃ = 0`); when the max moves and the kernel rescales
//! `l ← α l`, it also does `sink_l ← α sink_l` and `es ← α es + α ln(α) l_old` (skip when
//! `α ∈ {0, 1}`). [`RowSums`] is the scalar model of exactly this. When the row is final it calls
//! [`finish_row`]`(&mut head_accum, &RowSums { m, l, sink_l, es }, sigma)` (rows with `l = 0` are
//! skipped). After the forward: [`AttnSummary::absorb_max_logit`] with the `[B, Hq]` max_logit
//! output, and for the outlier stream [`AttnSummary::add_output`] with O.
//!
//! # Readout and JSON lines
//! Summaries are submitted to a [`TelemetrySink`] (merged per (step, layer)) and turned into
//! [`TelemetryRecord`]s only at the logging boundary ([`TelemetrySink::flush`]);
//! [`JsonlWriter`] appends one record per line. Schema of one line (H = query heads):
//!
//! | field | type | meaning |
//! | --- | --- | --- |
//! | `step` | integer | training step |
//! | `layer` | integer | layer index |
//! | `sink_mass` | \[H\] number\|null, or null | Σ sink mass / valid rows (all batch rows) |
//! | `sink_rate` | number\|null | fraction of heads (with a defined mean) whose `sink_mass > ε` |
//! | `learned_sink_mass` | \[H\] number\|null, or null | mean `p_sink`; null without learned sinks |
//! | `max_logit` | \[H\] number\|null | max pre-softcap logit; null if no allowed pair |
//! | `entropy` | \[H\] number\|null, or null | mean row entropy (nats) |
//! | `valid_rows` | \[H\] integer, or null | valid rows counted |
//! | `out_abs_max` | \[H\] number\|null, or null | max \|O\| |
//! | `out_rms` | \[H\] number\|null, or null | `sqrt(Σ o² / count)` |
//! | `out_outliers` | \[H\] integer, or null | elements above `ratio × RMS(O[b, h])` |
//!
//! A whole field is null when its stream was off (sink stream: `sink_mass`, `sink_rate`,
//! `learned_sink_mass`, `entropy`, `valid_rows`; outlier stream: `out_*`). An entry is null when
//! undefined (no valid row / no element) or not finite (JSON has no NaN or infinity).
//!
//! # Reference
//! [`reference_summary`] computes O, LSE, max_logit and the whole summary from the dense
//! probability matrix in f64.
//!
//! ```
//! use tessera_telemetry::{finish_row, RowSums, Telemetry, TelemetryConfig, TelemetrySink};
//!
//! let mut tel = Telemetry::new(TelemetryConfig::every(2))?;
//! let mut sink = TelemetrySink::new(tel.config.clone());
//! for _step in 0..3 {
//!     if tel.should_log() {
//!         // What the kernel's telemetry variant does: one query row over two keys with equal
//!         // logits, the first one a sink key.
//!         let mut summary = tel.summary(0, 1, false);
//!         let mut row = RowSums::EMPTY;
//!         row.push_logit(1.0, true);
//!         row.push_logit(1.0, false);
//!         finish_row(&mut summary.heads[0], &row, None);
//!         sink.submit(summary)?;
//!     }
//!     tel.advance();
//! }
//! let records = sink.flush(); // steps 0 and 2 logged
//! assert_eq!(records.iter().map(|r| r.step).collect::<Vec<_>>(), [0, 2]);
//! assert_eq!(records[0].sink_mass, Some(vec![Some(0.5)]));
//! # Ok::<(), tessera_core::Error>(())
//! ```

mod config;
mod exact;
mod outlier;
mod record;
mod reference;
mod sinks;
mod summary;

pub use config::{
    Streams, Telemetry, TelemetryConfig, DEFAULT_EPSILON, DEFAULT_OUTLIER_RATIO,
    DEFAULT_SINK_TOKENS,
};
pub use exact::{det_max, ExactSum};
pub use outlier::{outlier_summary, outlier_summary_f64, OutlierStats};
pub use record::{parse_jsonl, read_jsonl, JsonlWriter, TelemetryRecord, TelemetrySink};
pub use reference::{reference_summary, ReferenceInput, ReferenceOutput};
pub use sinks::{document_kv_segments, sink_key_flags};
pub use summary::{finish_row, AttnSummary, HeadAccum, RowStats, RowSums};
