//! Per-head accumulators ([`HeadAccum`]), the per-(step, layer) summary ([`AttnSummary`]), and
//! the per-row finalize step the kernel calls ([`RowSums`], [`finish_row`]).

use crate::config::Telemetry;
use crate::exact::{det_max, ExactSum};
use crate::outlier::{outlier_summary, OutlierStats};
use serde::{Deserialize, Serialize};
use tessera_core::tensor::TensorView;
use tessera_core::{Error, Result};

/// Sums for one query head, over every valid row of every batch row seen. All fields merge
/// exactly (integer counts, [`ExactSum`]s, [`det_max`]), so any split of the work, merged in
/// any order, gives bit-identical state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadAccum {
    /// Rows `(b, i)` with at least one allowed key.
    pub valid_rows: u64,
    /// Σ over valid rows of the row's sink mass.
    pub sink_mass_sum: ExactSum,
    /// Σ over valid rows of `p_sink` (0 without learned sinks).
    pub learned_sink_mass_sum: ExactSum,
    /// Σ over valid rows of the row's attention entropy (nats).
    pub entropy_sum: ExactSum,
    /// Max over allowed pairs of the pre-softcap scaled logit; `-inf` when none was seen.
    pub max_logit: f64,
    /// Outlier stream over this head's O slices.
    pub out: OutlierStats,
}

impl Default for HeadAccum {
    fn default() -> Self {
        HeadAccum {
            valid_rows: 0,
            sink_mass_sum: ExactSum::new(),
            learned_sink_mass_sum: ExactSum::new(),
            entropy_sum: ExactSum::new(),
            max_logit: f64::NEG_INFINITY,
            out: OutlierStats::default(),
        }
    }
}

impl HeadAccum {
    /// Adds one valid row's final quantities (what [`finish_row`] and the dense reference call).
    #[inline]
    pub fn add_row(&mut self, row: &RowStats) {
        self.valid_rows += 1;
        self.sink_mass_sum.add(row.sink_mass);
        self.learned_sink_mass_sum.add(row.learned_sink_mass);
        self.entropy_sum.add(row.entropy);
    }

    /// Folds a pre-softcap max logit (of one row, or of one `(b, h)`) into `max_logit`.
    #[inline]
    pub fn observe_max_logit(&mut self, x: f64) {
        self.max_logit = det_max(self.max_logit, x);
    }

    /// Adds everything `other` holds.
    pub fn merge(&mut self, other: &HeadAccum) {
        self.valid_rows += other.valid_rows;
        self.sink_mass_sum.merge(&other.sink_mass_sum);
        self.learned_sink_mass_sum
            .merge(&other.learned_sink_mass_sum);
        self.entropy_sum.merge(&other.entropy_sum);
        self.max_logit = det_max(self.max_logit, other.max_logit);
        self.out.merge(&other.out);
    }
}

/// The final quantities of one valid row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// `Σ_{j allowed, sink key} p_ij`.
    pub sink_mass: f64,
    /// `p_sink_i` (0 without a learned sink).
    pub learned_sink_mass: f64,
    /// `−Σ_j p_ij ln p_ij − p_sink ln p_sink` (nats).
    pub entropy: f64,
    /// `LSE_i` (the learned sink included).
    pub lse: f64,
}

/// One query row's online sums, all relative to a reference `m` (the kernel's running max of
/// the post-softcap logits `s_ij` over the row's allowed keys so far):
///
/// - `l      = Σ_{j allowed}           e^{s_ij − m}`   (the kernel's usual denominator),
/// - `sink_l = Σ_{j allowed, sink key} e^{s_ij − m}`,
/// - `es     = Σ_{j allowed}           e^{s_ij − m}·(s_ij − m)`  `= Σ p̃ ln p̃` with `p̃ = e^{s−m}`
///   (so it can be computed from the exponentials alone; `0·ln 0 = 0`).
///
/// When the reference moves from `m` to `m' >= m` with `α = e^{m − m'}`, the sums become
/// `l ← α·l`, `sink_l ← α·sink_l`, `es ← α·es + α·ln(α)·l_old` ([`RowSums::rescale`]); the extra
/// `α·ln α·l` term (0 when `α` is 1 or 0) is what keeps `es` relative to the new max.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSums {
    /// Reference `m` (running max of the post-softcap logits).
    pub m: f64,
    /// `l = Σ e^{s − m}` over allowed keys.
    pub l: f64,
    /// `sink_l = Σ e^{s − m}` over allowed sink keys.
    pub sink_l: f64,
    /// `es = Σ e^{s − m}·(s − m)` over allowed keys.
    pub es: f64,
}

impl Default for RowSums {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl RowSums {
    /// Nothing accumulated: `m = -inf`, sums 0.
    pub const EMPTY: RowSums = RowSums {
        m: f64::NEG_INFINITY,
        l: 0.0,
        sink_l: 0.0,
        es: 0.0,
    };

    /// Rescales the sums by `alpha = e^{m_old − m_new}` (the caller then sets `m = m_new`).
    #[inline]
    pub fn rescale(&mut self, alpha: f64) {
        if alpha == 1.0 {
            return;
        }
        let shift = if alpha > 0.0 {
            alpha * alpha.ln() * self.l
        } else {
            0.0
        };
        self.es = alpha * self.es + shift;
        self.l *= alpha;
        self.sink_l *= alpha;
    }

    /// Adds one allowed key with `p = e^{s − m}` (relative to the current `m`).
    #[inline]
    pub fn add(&mut self, p: f64, is_sink: bool) {
        self.l += p;
        if p > 0.0 {
            self.es += p * p.ln();
        } else if p.is_nan() {
            self.es = f64::NAN;
        }
        if is_sink {
            self.sink_l += p;
        }
    }

    /// Moves the reference to `max(m, s)` and adds the key with post-softcap logit `s`
    /// (a scalar model of the kernel's online update, used by tests and references).
    pub fn push_logit(&mut self, s: f64, is_sink: bool) {
        if s > self.m {
            let alpha = if self.l == 0.0 {
                0.0
            } else {
                (self.m - s).exp()
            };
            self.rescale(alpha);
            self.m = s;
        }
        if s.is_nan() {
            self.m = f64::NAN;
        }
        self.add((s - self.m).exp(), is_sink);
    }

    /// The row's final quantities, or `None` when the row is not valid (`l == 0`: no allowed
    /// key). `sigma` is the head's learned sink logit when sinks are on.
    pub fn finish(&self, sigma: Option<f64>) -> Option<RowStats> {
        if self.l == 0.0 {
            return None;
        }
        let (m, l) = (self.m, self.l);
        let (lse, w, p_sink, sigma_term) = match sigma {
            None => (m + l.ln(), 1.0 / l, 0.0, 0.0),
            Some(sg) => {
                let hi = if m > sg { m } else { sg };
                let lse = hi + (l * (m - hi).exp() + (sg - hi).exp()).ln();
                let p_sink = (sg - lse).exp();
                let term = if p_sink > 0.0 {
                    p_sink * (lse - sg)
                } else {
                    0.0
                };
                (lse, (m - lse).exp(), p_sink, term)
            }
        };
        // −Σ p ln p over keys = −w·es + (w·l)·(lse − m); every term is >= 0 (no cancellation).
        let keys = w * l;
        let key_term = if keys > 0.0 { keys * (lse - m) } else { 0.0 };
        Some(RowStats {
            sink_mass: w * self.sink_l,
            learned_sink_mass: p_sink,
            entropy: -w * self.es + key_term + sigma_term,
            lse,
        })
    }
}

/// Turns one row's online sums into contributions to `acc` (the kernel's per-row hook).
/// Rows with no allowed key (`row.l == 0`) are skipped, so it may be called for every row.
#[inline]
pub fn finish_row(acc: &mut HeadAccum, row: &RowSums, sigma: Option<f64>) {
    if let Some(stats) = row.finish(sigma) {
        acc.add_row(&stats);
    }
}

impl Telemetry {
    /// An empty summary for this step and `layer` with `heads` query heads.
    pub fn summary(&self, layer: u32, heads: usize, has_learned_sinks: bool) -> AttnSummary {
        AttnSummary::new(self.step, layer, heads, has_learned_sinks)
    }
}

/// The telemetry of one (step, layer): one [`HeadAccum`] per query head.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttnSummary {
    /// Training step.
    pub step: u64,
    /// Layer index.
    pub layer: u32,
    /// One accumulator per query head.
    pub heads: Vec<HeadAccum>,
    /// Whether learned sinks were on (the learned-sink mass is then reported).
    pub has_learned_sinks: bool,
}

impl AttnSummary {
    /// An empty summary with `heads` query heads.
    pub fn new(step: u64, layer: u32, heads: usize, has_learned_sinks: bool) -> Self {
        AttnSummary {
            step,
            layer,
            heads: vec![HeadAccum::default(); heads],
            has_learned_sinks,
        }
    }

    /// Adds `other` (another batch shard, replica or rank of the same step and layer).
    /// Exact, commutative and associative.
    pub fn merge(&mut self, other: &AttnSummary) -> Result<()> {
        if other.heads.len() != self.heads.len() {
            return Err(Error::invalid(
                "telemetry summary",
                format!("{} heads (as the summary merged into)", self.heads.len()),
                other.heads.len(),
            ));
        }
        if (other.step, other.layer) != (self.step, self.layer) {
            return Err(Error::invalid(
                "telemetry summary",
                format!("step {} layer {}", self.step, self.layer),
                format!("step {} layer {}", other.step, other.layer),
            ));
        }
        if other.has_learned_sinks != self.has_learned_sinks {
            return Err(Error::invalid(
                "telemetry summary",
                format!("has_learned_sinks = {}", self.has_learned_sinks),
                other.has_learned_sinks,
            ));
        }
        for (a, b) in self.heads.iter_mut().zip(&other.heads) {
            a.merge(b);
        }
        Ok(())
    }

    /// Checks that `t` has rank `rank` and this summary's head count in dimension 1; returns
    /// the head count. `rest` spells the dimensions after the heads in the error.
    fn check_heads(&self, arg: &str, t: &TensorView<'_>, rank: usize, rest: &str) -> Result<usize> {
        let h = self.heads.len();
        if t.shape.len() != rank || t.shape[1] != h {
            let expected = format!("shape [B, {h}{rest}]");
            return Err(Error::invalid(arg, expected, format!("{:?}", t.shape)));
        }
        Ok(h)
    }

    /// Folds the kernel's `max_logit` output `[B, Hq]` (pre-softcap, `-inf` where a `(b, h)`
    /// has no allowed pair) into every head's `max_logit`.
    pub fn absorb_max_logit(&mut self, max_logit: &TensorView<'_>) -> Result<()> {
        let h = self.check_heads("max_logit", max_logit, 2, "")?;
        let vals = max_logit.to_f32_vec()?;
        for (idx, &x) in vals.iter().enumerate() {
            self.heads[idx % h].observe_max_logit(x as f64);
        }
        Ok(())
    }

    /// The outlier stream: adds the statistics of O `[B, Hq, Lq, Dv]` (f32, bf16 or f16), with
    /// the threshold `ratio × RMS` taken per `(b, h)` slice.
    pub fn add_output(&mut self, o: &TensorView<'_>, ratio: f64) -> Result<()> {
        self.check_heads("o", o, 4, ", Lq, Dv")?;
        let stats = outlier_summary(o, ratio)?;
        for (acc, s) in self.heads.iter_mut().zip(&stats) {
            acc.out.merge(s);
        }
        Ok(())
    }

    /// Compares with `reference` (a dense float64 summary): counts exactly, floats within
    /// `|a − b| <= atol + rtol·|b|` (NaN matches NaN, equal infinities match). The error names
    /// the first mismatch.
    pub fn check_close(
        &self,
        reference: &AttnSummary,
        rtol: f64,
        atol: f64,
    ) -> std::result::Result<(), String> {
        if self.heads.len() != reference.heads.len() {
            return Err(format!(
                "heads: {} vs reference {}",
                self.heads.len(),
                reference.heads.len()
            ));
        }
        let close = |a: f64, b: f64| {
            (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= atol + rtol * b.abs()
        };
        for (h, (a, r)) in self.heads.iter().zip(&reference.heads).enumerate() {
            let counts = [
                ("valid_rows", a.valid_rows, r.valid_rows),
                ("out.count", a.out.count, r.out.count),
                ("out.outliers", a.out.outliers, r.out.outliers),
            ];
            for (name, x, y) in counts {
                if x != y {
                    return Err(format!("head {h} {name}: {x} vs reference {y}"));
                }
            }
            let floats = [
                (
                    "sink_mass_sum",
                    a.sink_mass_sum.value(),
                    r.sink_mass_sum.value(),
                ),
                (
                    "learned_sink_mass_sum",
                    a.learned_sink_mass_sum.value(),
                    r.learned_sink_mass_sum.value(),
                ),
                ("entropy_sum", a.entropy_sum.value(), r.entropy_sum.value()),
                ("max_logit", a.max_logit, r.max_logit),
                ("out.abs_max", a.out.abs_max, r.out.abs_max),
                ("out.sq_sum", a.out.sq_sum.value(), r.out.sq_sum.value()),
            ];
            for (name, x, y) in floats {
                if !close(x, y) {
                    return Err(format!("head {h} {name}: {x:e} vs reference {y:e}"));
                }
            }
        }
        Ok(())
    }
}
