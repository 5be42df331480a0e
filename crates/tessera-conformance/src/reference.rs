//! Float64 dense reference of docs/semantics.md#attention, the yardstick of the [conformance suite](crate::suite)
//! suite.
//!
//! Contract: simple loops over every (b, h, i, j), the mask taken as a [`Mask`] through
//! [`Mask::allowed`] (never through a plan), inputs widened to f64 (bf16 inputs are used exactly
//! as stored), f64 everywhere, `O(B·Hq·Lq·Lkv·D)` time and `O(Lkv)` scratch per row. Outputs are
//! f64 vectors in the layouts of [`ForwardOutput`](tessera_attn::ForwardOutput) and
//! [`BackwardOutput`](tessera_attn::BackwardOutput). NaN inputs propagate like the kernels document: a
//! masked pair never contributes, not even `0·NaN`.

use tessera_attn::{check_inputs, check_o_like, AttnInputs, AttnOptions, Dims, StridedView};
use tessera_core::tensor::TensorView;
use tessera_core::Result;
use tessera_mask::Mask;

/// Reference forward results (f64).
#[derive(Debug, Clone, PartialEq)]
pub struct RefForward {
    /// `[B, Hq, Lq, Dv]`.
    pub o: Vec<f64>,
    /// `[B, Hq, Lq]`.
    pub lse: Vec<f64>,
    /// `[B, Hq]`, pre-softcap scaled logits; -inf when a head has no allowed pair.
    pub max_logit: Vec<f64>,
}

/// Reference backward results (f64).
#[derive(Debug, Clone, PartialEq)]
pub struct RefBackward {
    /// `[B, Hq, Lq, Dqk]`.
    pub dq: Vec<f64>,
    /// `[B, Hkv, Lkv, Dqk]`.
    pub dk: Vec<f64>,
    /// `[B, Hkv, Lkv, Dv]`.
    pub dv: Vec<f64>,
    /// `[Hq]` when sinks are given.
    pub dsinks: Option<Vec<f64>>,
    /// Magnitudes of dQ and dK: the same sums with every term replaced by its absolute value
    /// (`|P_ij|·(|dP_ij| + |Δ_i|)·|softcap'|·scale·|k_j|`, resp. `·|q_i|`). They bound the rounding
    /// error of any summation order and serve as the error scale where dQ or dK vanish
    /// analytically (a row with a single allowed key has `dS = 0`).
    pub dq_mag: Vec<f64>,
    pub dk_mag: Vec<f64>,
}

fn widen(v: &TensorView<'_>) -> Result<Vec<f64>> {
    Ok(v.to_f32_vec()?.into_iter().map(f64::from).collect())
}

struct Prob {
    d: Dims,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    scale: f64,
    cap: Option<f64>,
    sinks: Option<Vec<f64>>,
}

impl Prob {
    fn new(
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        mask: &Mask,
        options: &AttnOptions,
    ) -> Result<Self> {
        let d = check_inputs(&AttnInputs::contiguous(*q, *k, *v)?, options)?;
        mask.validate(d.batch, d.heads_q, d.q_len, d.kv_len)?;
        Ok(Prob {
            d,
            q: widen(q)?,
            k: widen(k)?,
            v: widen(v)?,
            scale: options.scale_for(d.d_qk) as f64,
            cap: options.softcap.map(f64::from),
            sinks: options
                .sinks
                .as_ref()
                .map(|s| s.iter().map(|&x| x as f64).collect()),
        })
    }

    fn q_row(&self, b: usize, h: usize, i: usize) -> &[f64] {
        let d = &self.d;
        let o = ((b * d.heads_q + h) * d.q_len + i) * d.d_qk;
        &self.q[o..o + d.d_qk]
    }

    fn kv_base(&self, b: usize, h: usize) -> usize {
        let d = &self.d;
        (b * d.heads_kv + h / d.group()) * d.kv_len
    }

    /// Raw scaled logits of row i over allowed keys: (j, raw, capped).
    fn logits(&self, mask: &Mask, b: usize, h: usize, i: usize) -> Vec<(usize, f64, f64)> {
        let d = &self.d;
        let qi = self.q_row(b, h, i);
        let base = self.kv_base(b, h);
        (0..d.kv_len)
            .filter(|&j| mask.allowed(b, h, i, j))
            .map(|j| {
                let kj = &self.k[(base + j) * d.d_qk..(base + j + 1) * d.d_qk];
                let raw = self.scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                let capped = match self.cap {
                    Some(c) => c * (raw / c).tanh(),
                    None => raw,
                };
                (j, raw, capped)
            })
            .collect()
    }

    /// log Z over the capped logits and the sink (-inf if neither exists).
    fn lse(&self, h: usize, s: &[(usize, f64, f64)]) -> f64 {
        let sink = self.sinks.as_ref().map(|x| x[h]);
        let mut m = f64::NEG_INFINITY;
        for &(_, _, c) in s {
            if c.is_nan() {
                return f64::NAN;
            }
            m = m.max(c);
        }
        if let Some(sg) = sink {
            m = m.max(sg);
        }
        if m == f64::NEG_INFINITY {
            return m;
        }
        let mut z: f64 = s.iter().map(|&(_, _, c)| (c - m).exp()).sum();
        if let Some(sg) = sink {
            z += (sg - m).exp();
        }
        m + z.ln()
    }
}

/// O, LSE and max_logit of docs/semantics.md#attention in float64.
pub fn forward(
    q: TensorView<'_>,
    k: TensorView<'_>,
    v: TensorView<'_>,
    mask: &Mask,
    options: &AttnOptions,
) -> Result<RefForward> {
    let p = Prob::new(&q, &k, &v, mask, options)?;
    let d = p.d;
    let mut o = vec![0f64; d.batch * d.heads_q * d.q_len * d.d_v];
    let mut lse = vec![0f64; d.batch * d.heads_q * d.q_len];
    let mut max_logit = vec![f64::NEG_INFINITY; d.batch * d.heads_q];
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            let bh = b * d.heads_q + h;
            let base = p.kv_base(b, h);
            for i in 0..d.q_len {
                let s = p.logits(mask, b, h, i);
                for &(_, raw, _) in &s {
                    let m = &mut max_logit[bh];
                    *m = if raw.is_nan() || m.is_nan() {
                        f64::NAN
                    } else {
                        m.max(raw)
                    };
                }
                let l = p.lse(h, &s);
                lse[bh * d.q_len + i] = l;
                let orow = &mut o[(bh * d.q_len + i) * d.d_v..(bh * d.q_len + i + 1) * d.d_v];
                for &(j, _, c) in &s {
                    let w = (c - l).exp();
                    let vj = &p.v[(base + j) * d.d_v..(base + j + 1) * d.d_v];
                    for (x, &vv) in orow.iter_mut().zip(vj) {
                        *x += w * vv;
                    }
                }
            }
        }
    }
    Ok(RefForward { o, lse, max_logit })
}

/// dQ, dK, dV (and dσ) of docs/semantics.md#attention in float64 for output gradient `d_o`, with the reference's own
/// forward (so `Δ_i = Σ_j P_ij·dP_ij = O_i·dO_i` exactly).
pub fn backward(
    q: TensorView<'_>,
    k: TensorView<'_>,
    v: TensorView<'_>,
    d_o: TensorView<'_>,
    mask: &Mask,
    options: &AttnOptions,
) -> Result<RefBackward> {
    backward_with_lse_grad(q, k, v, d_o, None, mask, options)
}

/// [`backward`] for a loss that also depends on the LSE, with gradient `d_lse` `[B, Hq, Lq]`:
/// `∂LSE_i/∂s_ij = P_ij`, so `dS_ij = P_ij·(dP_ij − Δ_i + dLSE_i)` and the sink logit gets
/// `exp(σ − LSE_i)·dLSE_i` more.
#[allow(clippy::too_many_arguments)]
pub fn backward_with_lse_grad(
    q: TensorView<'_>,
    k: TensorView<'_>,
    v: TensorView<'_>,
    d_o: TensorView<'_>,
    d_lse: Option<&[f32]>,
    mask: &Mask,
    options: &AttnOptions,
) -> Result<RefBackward> {
    let p = Prob::new(&q, &k, &v, mask, options)?;
    let d = p.d;
    check_o_like("d_o", &StridedView::contiguous("d_o", d_o)?, &d)?;
    let dout = widen(&d_o)?;
    if let Some(g) = d_lse {
        let want = d.batch * d.heads_q * d.q_len;
        if g.len() != want {
            return Err(tessera_core::Error::invalid(
                "d_lse",
                format!("{want} values [B, Hq, Lq]"),
                g.len(),
            ));
        }
    }
    let mut dq = vec![0f64; p.q.len()];
    let mut dk = vec![0f64; p.k.len()];
    let mut dq_mag = vec![0f64; p.q.len()];
    let mut dk_mag = vec![0f64; p.k.len()];
    let mut dv = vec![0f64; p.v.len()];
    let mut dsinks = p.sinks.as_ref().map(|s| vec![0f64; s.len()]);
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            let bh = b * d.heads_q + h;
            let base = p.kv_base(b, h);
            for i in 0..d.q_len {
                let s = p.logits(mask, b, h, i);
                let l = p.lse(h, &s);
                let doi = &dout[(bh * d.q_len + i) * d.d_v..(bh * d.q_len + i + 1) * d.d_v];
                // P, dP and Δ of this row.
                let rows: Vec<(usize, f64, f64, f64)> = s
                    .iter()
                    .map(|&(j, raw, c)| {
                        let vj = &p.v[(base + j) * d.d_v..(base + j + 1) * d.d_v];
                        let dpj: f64 = doi.iter().zip(vj).map(|(a, b)| a * b).sum();
                        (j, raw, (c - l).exp(), dpj)
                    })
                    .collect();
                let delta: f64 = rows.iter().map(|&(_, _, pj, dpj)| pj * dpj).sum::<f64>()
                    - d_lse.map_or(0.0, |g| g[bh * d.q_len + i] as f64);
                if let (Some(ds), Some(sk)) = (dsinks.as_mut(), p.sinks.as_ref()) {
                    if l != f64::NEG_INFINITY {
                        ds[h] -= (sk[h] - l).exp() * delta;
                    }
                }
                let qo = (bh * d.q_len + i) * d.d_qk;
                for &(j, raw, pj, dpj) in &rows {
                    let dcap = match p.cap {
                        Some(c) => 1.0 - (raw / c).tanh().powi(2),
                        None => 1.0,
                    };
                    let dsij = pj * (dpj - delta) * dcap * p.scale;
                    let mag = pj * (dpj.abs() + delta.abs()) * dcap.abs() * p.scale;
                    let ko = (base + j) * d.d_qk;
                    for x in 0..d.d_qk {
                        dq[qo + x] += dsij * p.k[ko + x];
                        dk[ko + x] += dsij * p.q[qo + x];
                        dq_mag[qo + x] += mag * p.k[ko + x].abs();
                        dk_mag[ko + x] += mag * p.q[qo + x].abs();
                    }
                    let vo = (base + j) * d.d_v;
                    for x in 0..d.d_v {
                        dv[vo + x] += pj * doi[x];
                    }
                }
            }
        }
    }
    Ok(RefBackward {
        dq,
        dk,
        dv,
        dsinks,
        dq_mag,
        dk_mag,
    })
}
