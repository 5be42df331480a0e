//! Float64 dense reference: every telemetry quantity computed from the dense probability matrix
//! with simple loops. Kernel telemetry is tested against it.

use crate::exact::det_max;
use crate::outlier::outlier_summary_f64;
use crate::summary::{AttnSummary, RowStats};
use tessera_core::{Error, Result};
use tessera_mask::Mask;

/// A dense attention problem in f64 (layouts as docs/semantics.md#tensors: Q `[B, Hq, Lq, Dqk]`,
/// K `[B, Hkv, Lkv, Dqk]`, V `[B, Hkv, Lkv, Dv]`, row-major).
#[derive(Debug, Clone, Copy)]
pub struct ReferenceInput<'a> {
    /// Q `[B, Hq, Lq, Dqk]`.
    pub q: &'a [f64],
    /// K `[B, Hkv, Lkv, Dqk]`.
    pub k: &'a [f64],
    /// V `[B, Hkv, Lkv, Dv]`.
    pub v: &'a [f64],
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub heads_q: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub heads_kv: usize,
    /// Query length `Lq`.
    pub q_len: usize,
    /// Key length `Lkv`.
    pub kv_len: usize,
    /// Query/key head dimension `Dqk`.
    pub d_qk: usize,
    /// Value head dimension `Dv`.
    pub d_v: usize,
    /// Which pairs may attend.
    pub mask: &'a Mask,
    /// Logit scale.
    pub scale: f64,
    /// Softcap `c` (`c * tanh(s / c)`), if any.
    pub softcap: Option<f64>,
    /// Learned sink logit per query head (`Hq` values).
    pub sinks: Option<&'a [f64]>,
    /// Sink-key flags `[B, Lkv]` ([`crate::sink_key_flags`]).
    pub sink_flags: &'a [bool],
    /// Outlier threshold as a multiple of the RMS of each (b, h) slice.
    pub outlier_ratio: f64,
}

/// Reference outputs: O `[B, Hq, Lq, Dv]`, LSE `[B, Hq, Lq]`, max_logit `[B, Hq]` and the
/// telemetry summary (both streams filled).
#[derive(Debug, Clone)]
pub struct ReferenceOutput {
    /// O `[B, Hq, Lq, Dv]`.
    pub o: Vec<f64>,
    /// LSE `[B, Hq, Lq]`.
    pub lse: Vec<f64>,
    /// max_logit `[B, Hq]` (pre-softcap).
    pub max_logit: Vec<f64>,
    /// The telemetry summary, both streams filled.
    pub summary: AttnSummary,
}

fn check_len(arg: &str, want: usize, found: usize) -> Result<()> {
    if want == found {
        Ok(())
    } else {
        Err(Error::invalid(arg, format!("{want} values"), found))
    }
}

/// Computes O, LSE, max_logit and the telemetry summary of `p` densely in f64.
///
/// Per row `(b, h, i)`: raw logits `r_ij = scale·q_i·k_j` over allowed `j`; `s_ij` = softcapped
/// `r_ij`; `Z = e^σ + Σ e^{s_ij}` (σ term only with sinks); `p_ij = e^{s_ij}/Z`; then sink mass
/// `Σ_{sink keys} p_ij`, `p_sink = e^σ/Z`, entropy `−Σ p ln p − p_sink ln p_sink` (terms with
/// `p = 0` are 0), `O_i = Σ p_ij v_j`; rows with no allowed key are not valid (O = 0, LSE = σ or
/// -inf). Outliers are taken over the f64 O by [`crate::outlier_summary_f64`].
pub fn reference_summary(p: &ReferenceInput<'_>, step: u64, layer: u32) -> Result<ReferenceOutput> {
    let (b_n, hq, hkv, lq, lk, dqk, dv) = (
        p.batch, p.heads_q, p.heads_kv, p.q_len, p.kv_len, p.d_qk, p.d_v,
    );
    if [b_n, hq, hkv, lq, lk, dqk, dv].contains(&0) {
        return Err(Error::invalid(
            "reference shape",
            "every dimension >= 1",
            format!("B={b_n} Hq={hq} Hkv={hkv} Lq={lq} Lkv={lk} Dqk={dqk} Dv={dv}"),
        ));
    }
    if hq % hkv != 0 {
        return Err(Error::invalid(
            "heads",
            format!("Hq divisible by Hkv = {hkv}"),
            hq,
        ));
    }
    check_len("q", b_n * hq * lq * dqk, p.q.len())?;
    check_len("k", b_n * hkv * lk * dqk, p.k.len())?;
    check_len("v", b_n * hkv * lk * dv, p.v.len())?;
    check_len("sink flags", b_n * lk, p.sink_flags.len())?;
    if let Some(s) = p.sinks {
        check_len("sinks", hq, s.len())?;
    }
    if !(p.scale.is_finite()) {
        return Err(Error::invalid("scale", "a finite number", p.scale));
    }
    if let Some(c) = p.softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(Error::invalid("softcap", "a finite number > 0", c));
        }
    }
    p.mask.validate(b_n, hq, lq, lk)?;

    let group = hq / hkv;
    let mut summary = AttnSummary::new(step, layer, hq, p.sinks.is_some());
    let mut o = vec![0f64; b_n * hq * lq * dv];
    let mut lse_out = vec![0f64; b_n * hq * lq];
    let mut max_logit = vec![f64::NEG_INFINITY; b_n * hq];
    let mut s = vec![0f64; lk];
    let mut allowed = vec![false; lk];
    for b in 0..b_n {
        for h in 0..hq {
            let kvh = h / group;
            let sigma = p.sinks.map(|x| x[h]);
            let flags = &p.sink_flags[b * lk..(b + 1) * lk];
            for i in 0..lq {
                let qrow = &p.q[((b * hq + h) * lq + i) * dqk..][..dqk];
                let mut any = false;
                for j in 0..lk {
                    allowed[j] = p.mask.allowed(b, h, i, j);
                    if !allowed[j] {
                        continue;
                    }
                    any = true;
                    let krow = &p.k[((b * hkv + kvh) * lk + j) * dqk..][..dqk];
                    let raw = p.scale * qrow.iter().zip(krow).map(|(a, c)| a * c).sum::<f64>();
                    let mi = &mut max_logit[b * hq + h];
                    *mi = det_max(*mi, raw);
                    s[j] = match p.softcap {
                        Some(c) => c * (raw / c).tanh(),
                        None => raw,
                    };
                }
                let row = (b * hq + h) * lq + i;
                if !any {
                    lse_out[row] = sigma.unwrap_or(f64::NEG_INFINITY);
                    continue;
                }
                // LSE over the allowed logits and the sink.
                let mut hi = sigma.unwrap_or(f64::NEG_INFINITY);
                for j in (0..lk).filter(|&j| allowed[j]) {
                    hi = hi.max(s[j]);
                }
                let mut z = sigma.map_or(0.0, |sg| (sg - hi).exp());
                for j in (0..lk).filter(|&j| allowed[j]) {
                    z += (s[j] - hi).exp();
                }
                let lse = hi + z.ln();
                lse_out[row] = lse;
                // The dense probability row.
                let mut sink_mass = 0.0;
                let mut entropy = 0.0;
                let orow = &mut o[row * dv..(row + 1) * dv];
                for j in (0..lk).filter(|&j| allowed[j]) {
                    let pij = (s[j] - lse).exp();
                    if flags[j] {
                        sink_mass += pij;
                    }
                    if pij > 0.0 {
                        entropy -= pij * pij.ln();
                    }
                    let vrow = &p.v[((b * hkv + kvh) * lk + j) * dv..][..dv];
                    for (od, vd) in orow.iter_mut().zip(vrow) {
                        *od += pij * vd;
                    }
                }
                let p_sink = sigma.map_or(0.0, |sg| (sg - lse).exp());
                if p_sink > 0.0 {
                    entropy -= p_sink * p_sink.ln();
                }
                summary.heads[h].add_row(&RowStats {
                    sink_mass,
                    learned_sink_mass: p_sink,
                    entropy,
                    lse,
                });
            }
            let ml = max_logit[b * hq + h];
            summary.heads[h].observe_max_logit(ml);
        }
    }
    let stats = outlier_summary_f64(&[b_n, hq, lq, dv], &o, p.outlier_ratio)?;
    for (acc, st) in summary.heads.iter_mut().zip(&stats) {
        acc.out.merge(st);
    }
    Ok(ReferenceOutput {
        o,
        lse: lse_out,
        max_logit,
        summary,
    })
}
