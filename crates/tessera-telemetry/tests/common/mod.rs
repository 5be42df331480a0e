//! Shared helpers: a tiny deterministic RNG and the "kernel-like" telemetry path (online row
//! sums fed to `finish_row`), computed in a straightforward way.

#![allow(dead_code)]

use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_telemetry::*;

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
    pub fn vec(&mut self, n: usize, amp: f64) -> Vec<f64> {
        (0..n).map(|_| amp * self.unit()).collect()
    }
}

/// An owned problem.
pub struct Problem {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub d_qk: usize,
    pub d_v: usize,
    pub mask: Mask,
    pub scale: f64,
    pub softcap: Option<f64>,
    pub sinks: Option<Vec<f64>>,
    pub sink_flags: Vec<bool>,
    pub ratio: f64,
}

pub struct Opts {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub len: usize,
    pub docs: bool,
    pub causal: bool,
    pub sinks: bool,
    pub softcap: Option<f64>,
    pub sink_tokens: usize,
    pub amp: f64,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            len: 23,
            docs: false,
            causal: true,
            sinks: false,
            softcap: None,
            sink_tokens: 1,
            amp: 2.0,
        }
    }
}

/// Segment ids with documents of varying length and trailing padding, per batch row.
pub fn doc_ids(batch: usize, len: usize) -> SegmentIds {
    let mut ids = Vec::new();
    for b in 0..batch {
        let mut doc = 0i64;
        let mut left = 3 + b;
        for j in 0..len {
            if j + 2 >= len {
                ids.push(-1);
                continue;
            }
            if left == 0 {
                doc += 1;
                left = 4 + (doc as usize * 3 + b) % 7;
            }
            ids.push(doc);
            left -= 1;
        }
    }
    SegmentIds::new(batch, len, ids).expect("valid ids")
}

pub fn problem(seed: u64, o: &Opts) -> Problem {
    let mut rng = Rng::new(seed);
    let (d_qk, d_v) = (8, 5);
    let (b, hq, hkv, l) = (o.batch, o.heads_q, o.heads_kv, o.len);
    let seg = o.docs.then(|| doc_ids(b, l));
    let mut mask = if o.causal {
        Mask::causal()
    } else {
        Mask::full()
    };
    if let Some(s) = &seg {
        mask = mask & Mask::document(Segments::shared(s.clone()));
    }
    let sink_flags = sink_key_flags(seg.as_ref(), b, l, o.sink_tokens).expect("flags");
    Problem {
        q: rng.vec(b * hq * l * d_qk, o.amp),
        k: rng.vec(b * hkv * l * d_qk, o.amp),
        v: rng.vec(b * hkv * l * d_v, 1.0),
        batch: b,
        heads_q: hq,
        heads_kv: hkv,
        q_len: l,
        kv_len: l,
        d_qk,
        d_v,
        mask,
        scale: 1.0 / (d_qk as f64).sqrt(),
        softcap: o.softcap,
        sinks: o.sinks.then(|| rng.vec(hq, 2.0)),
        sink_flags,
        ratio: 2.0,
    }
}

impl Problem {
    pub fn input(&self) -> ReferenceInput<'_> {
        ReferenceInput {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            batch: self.batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            q_len: self.q_len,
            kv_len: self.kv_len,
            d_qk: self.d_qk,
            d_v: self.d_v,
            mask: &self.mask,
            scale: self.scale,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
            sink_flags: &self.sink_flags,
            outlier_ratio: self.ratio,
        }
    }

    /// Allowed keys of row (b, h, i): (post-softcap logit, pre-softcap logit, is sink key).
    pub fn row_logits(&self, b: usize, h: usize, i: usize) -> Vec<(f64, f64, bool)> {
        let kvh = h / (self.heads_q / self.heads_kv);
        let d = self.d_qk;
        let q = &self.q[((b * self.heads_q + h) * self.q_len + i) * d..][..d];
        (0..self.kv_len)
            .filter(|&j| self.mask.allowed(b, h, i, j))
            .map(|j| {
                let k = &self.k[((b * self.heads_kv + kvh) * self.kv_len + j) * d..][..d];
                let raw = self.scale * q.iter().zip(k).map(|(a, c)| a * c).sum::<f64>();
                let s = self.softcap.map_or(raw, |c| c * (raw / c).tanh());
                (s, raw, self.sink_flags[b * self.kv_len + j])
            })
            .collect()
    }
}

/// How the test path builds a row's online sums.
#[derive(Clone, Copy, Debug)]
pub enum Online {
    /// One pass relative to the final max: `l = Σ e^{s−m}`, `es = Σ e^{s−m}(s−m)`.
    Direct,
    /// Kernel-like: keys in tiles of this size; per tile: new max, `α = e^{m_old − m_new}`,
    /// `rescale(α)`, then `add(p)` with `p = e^{s − m_new}` (masked keys would add p = 0).
    Tiles(usize),
}

pub fn row_sums(logits: &[(f64, f64, bool)], how: Online) -> RowSums {
    match how {
        Online::Direct => {
            let m = logits
                .iter()
                .fold(f64::NEG_INFINITY, |a, &(s, _, _)| a.max(s));
            let mut r = RowSums {
                m,
                ..RowSums::EMPTY
            };
            for &(s, _, sink) in logits {
                let x = s - m;
                r.l += x.exp();
                r.es += x.exp() * x;
                if sink {
                    r.sink_l += x.exp();
                }
            }
            r
        }
        Online::Tiles(t) => {
            let mut r = RowSums::EMPTY;
            for tile in logits.chunks(t) {
                let tmax = tile
                    .iter()
                    .fold(f64::NEG_INFINITY, |a, &(s, _, _)| a.max(s));
                let m_new = r.m.max(tmax);
                let alpha = if r.m == f64::NEG_INFINITY {
                    0.0
                } else {
                    (r.m - m_new).exp()
                };
                r.rescale(alpha);
                r.m = m_new;
                for &(s, _, sink) in tile {
                    r.add((s - m_new).exp(), sink);
                }
                // A masked key inside the tile contributes p = 0.
                r.add(0.0, true);
            }
            r
        }
    }
}

/// The summary through the kernel-facing path: online row sums → `finish_row`, max_logit
/// folded per (b, h) as the kernel's `[B, Hq]` output would be, O computed from the final
/// probabilities and handed to the outlier stream (f64 values, same slicing as the reference).
pub fn summary_via_rows(p: &Problem, how: Online, batches: std::ops::Range<usize>) -> AttnSummary {
    let mut sum = AttnSummary::new(7, 3, p.heads_q, p.sinks.is_some());
    let nb = batches.len();
    let mut o = vec![0f64; nb * p.heads_q * p.q_len * p.d_v];
    for (bi, b) in batches.enumerate() {
        for h in 0..p.heads_q {
            let sigma = p.sinks.as_ref().map(|s| s[h]);
            let kvh = h / (p.heads_q / p.heads_kv);
            let mut bh_max = f64::NEG_INFINITY;
            for i in 0..p.q_len {
                let logits = p.row_logits(b, h, i);
                for &(_, raw, _) in &logits {
                    bh_max = det_max(bh_max, raw);
                }
                let r = row_sums(&logits, how);
                finish_row(&mut sum.heads[h], &r, sigma);
                if let Some(st) = r.finish(sigma) {
                    let keys: Vec<usize> = (0..p.kv_len)
                        .filter(|&j| p.mask.allowed(b, h, i, j))
                        .collect();
                    let orow = &mut o[((bi * p.heads_q + h) * p.q_len + i) * p.d_v..][..p.d_v];
                    for (&(s, _, _), &j) in logits.iter().zip(&keys) {
                        let pij = (s - st.lse).exp();
                        let v = &p.v[((b * p.heads_kv + kvh) * p.kv_len + j) * p.d_v..][..p.d_v];
                        for (od, vd) in orow.iter_mut().zip(v) {
                            *od += pij * vd;
                        }
                    }
                }
            }
            sum.heads[h].observe_max_logit(bh_max);
        }
    }
    let stats = outlier_summary_f64(&[nb, p.heads_q, p.q_len, p.d_v], &o, p.ratio).expect("stats");
    for (acc, s) in sum.heads.iter_mut().zip(&stats) {
        acc.out.merge(s);
    }
    sum
}
