//! Backward kernels.
//!
//! 1. Pre-pass per (batch, query head): `Δ_i = O_i·dO_i` (f64 accumulation) and the sink term
//!    `Σ_i exp(σ_h - LSE_i)·Δ_i`.
//! 2. dK/dV items (batch, kv head, kv-tile): `scale·Kᵀ` and `Vᵀ` of the tile are packed once; for
//!    each query head of the GQA group in ascending order and each q tile of that head's kv-major
//!    list `col(kt)` in ascending order: `S = Q·(scale·Kᵀ)`, `dP = dO·Vᵀ`, `P = exp(S - LSE)`,
//!    `dS = P ⊙ (dP - Δ)` (times the softcap derivative), `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.
//! 3. dQ items (batch, query head, q-tile): `Qsᵀ` and `dOᵀ` packed once; for each kv tile of the
//!    q-major list `row(qt)`: `Sᵀ = K·Qsᵀ`, `dPᵀ = V·dOᵀ`, `dSᵀ` as above, `dQ += dS·K`.
//!
//! Both kinds of items share one longest-first queue. Every output element is written by one item
//! in a fixed order: no atomics, bit-identical results.

use super::gemm::{gemm, product, round_up, RB};
use super::math::{self, Simd};
use super::{
    isa_entry, load_transposed, row_off, rows, run_items, Geometry, Isa, MasksT, Out, OutBuf, Src,
};
use crate::{AttnOptions, BackwardOutput, Dims};
use rayon::prelude::*;
use tessera_core::tensor::TensorView;
use tessera_core::tensor::ViewData;
use tessera_core::{Error, Result, Tensor};
use tessera_plan::Plan;

pub(crate) struct BwdCtx<'a> {
    plan: &'a Plan,
    d: Dims,
    g: Geometry,
    q: Src<'a>,
    k: Src<'a>,
    v: Src<'a>,
    d_o: Src<'a>,
    lse: &'a [f32],
    delta: &'a [f32],
    masks_t: MasksT,
    scale: f32,
    softcap: Option<f32>,
    exact: bool,
}

pub(crate) enum BwdItem<'a> {
    Dkv {
        b: usize,
        g: usize,
        kt: usize,
        dk: Out<'a>,
        dv: Out<'a>,
    },
    Dq {
        b: usize,
        h: usize,
        qt: usize,
        dq: Out<'a>,
    },
}

pub(crate) struct BwdWs {
    s: Vec<f32>,
    dp: Vec<f32>,
    tmp: Vec<f32>,
    // dK/dV items
    kst: Vec<f32>,
    vt: Vec<f32>,
    qbuf: Vec<f32>,
    dobuf: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    // dQ items
    qt: Vec<f32>,
    dot: Vec<f32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    dq: Vec<f32>,
}

impl BwdWs {
    fn new(g: &Geometry, d: &Dims) -> Self {
        let z = |n: usize| vec![0f32; n];
        BwdWs {
            s: z(g.tq * g.tk),
            dp: z(g.tq * g.tk),
            tmp: z(d.d_qk.max(d.d_v)),
            kst: z(d.d_qk * g.tk),
            vt: z(d.d_v * g.tk),
            qbuf: z(g.tq * g.dqkp),
            dobuf: z(g.tq * g.dvp),
            dk: z(g.tk * g.dqkp),
            dv: z(g.tk * g.dvp),
            qt: z(d.d_qk * g.tq),
            dot: z(d.d_v * g.tq),
            kbuf: z(g.tk * g.dqkp),
            vbuf: z(g.tk * g.dvp),
            lse: z(g.tq),
            delta: z(g.tq),
            dq: z(g.tq * g.dqkp),
        }
    }
}

pub(crate) fn run(
    isa: Isa,
    d: &Dims,
    views: [TensorView<'_>; 6],
    plan: &Plan,
    options: &AttnOptions,
) -> Result<BackwardOutput> {
    let [q, k, v, o, lse, d_o] = views;
    let g = Geometry::new(plan, d);
    let (q, k, v, o, d_o) = (
        Src::new(&q)?,
        Src::new(&k)?,
        Src::new(&v)?,
        Src::new(&o)?,
        Src::new(&d_o)?,
    );
    let ViewData::F32(lse) = lse.data else {
        return Err(Error::Internal("unvalidated lse dtype".into()));
    };
    let exact = !(q.all_finite() && k.all_finite() && v.all_finite() && d_o.all_finite());
    let (bh, lq, dv) = (d.batch * d.heads_q, d.q_len, d.d_v);

    // 1. Δ and the sink gradient.
    let mut delta = vec![0f32; bh * lq];
    let mut sink_part = vec![0f64; bh];
    let sinks = options.sinks.as_deref();
    delta
        .par_chunks_mut(lq)
        .zip(sink_part.par_iter_mut())
        .enumerate()
        .for_each(|(slab, (dl, sp))| {
            let (mut orow, mut drow) = (vec![0f32; dv], vec![0f32; dv]);
            let sigma = sinks.map(|s| s[slab % d.heads_q] as f64);
            let mut acc = 0f64;
            for (i, out) in dl.iter_mut().enumerate() {
                let off = (slab * lq + i) * dv;
                o.load(off, &mut orow, 1.0);
                d_o.load(off, &mut drow, 1.0);
                let dot: f64 = orow
                    .iter()
                    .zip(&drow)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                *out = dot as f32;
                if let Some(sg) = sigma {
                    let l = lse[slab * lq + i] as f64;
                    // A row with LSE = -inf has no mass anywhere (and no sink): it contributes 0.
                    if l != f64::NEG_INFINITY {
                        acc += (sg - l).exp() * dot;
                    }
                }
            }
            *sp = acc;
        });
    let dsinks = match sinks {
        None => None,
        Some(_) => {
            let ds: Vec<f32> = (0..d.heads_q)
                .map(|h| {
                    -(0..d.batch)
                        .map(|b| sink_part[b * d.heads_q + h])
                        .sum::<f64>() as f32
                })
                .collect();
            Some(Tensor::from_f32(vec![d.heads_q], ds)?)
        }
    };

    // 2 + 3. dK/dV and dQ items.
    let cx = BwdCtx {
        plan,
        d: *d,
        g,
        q,
        k,
        v,
        d_o,
        lse,
        delta: &delta,
        masks_t: MasksT::new(plan),
        scale: options.scale_for(d.d_qk),
        softcap: options.softcap,
        exact,
    };
    let (hkv, nkt, nqt, grp) = (d.heads_kv, plan.kv_tiles, plan.q_tiles, d.group());
    let kv_rows = d.batch * hkv * d.kv_len;
    let mut dk = OutBuf::poisoned(d.dtype, kv_rows * d.d_qk);
    let mut dvb = OutBuf::poisoned(d.dtype, kv_rows * dv);
    let mut dq = OutBuf::poisoned(d.dtype, bh * lq * d.d_qk);
    {
        let mut items: Vec<(usize, BwdItem<'_>)> = Vec::new();
        let dk_p = dk.pieces(d.kv_len * d.d_qk, plan.tile.kv * d.d_qk);
        let dv_p = dvb.pieces(d.kv_len * dv, plan.tile.kv * dv);
        for (idx, (dk, dv)) in dk_p.into_iter().zip(dv_p).enumerate() {
            let (b, gh, kt) = (idx / (hkv * nkt), (idx / nkt) % hkv, idx % nkt);
            let len: usize = (gh * grp..(gh + 1) * grp)
                .map(|h| plan.head_plan(b, h).col(kt).len())
                .sum();
            items.push((
                4 * len,
                BwdItem::Dkv {
                    b,
                    g: gh,
                    kt,
                    dk,
                    dv,
                },
            ));
        }
        let dq_p = dq.pieces(lq * d.d_qk, plan.tile.q * d.d_qk);
        for (idx, dq) in dq_p.into_iter().enumerate() {
            let (b, h, qt) = (idx / (d.heads_q * nqt), (idx / nqt) % d.heads_q, idx % nqt);
            let len = plan.head_plan(b, h).row(qt).len();
            items.push((3 * len, BwdItem::Dq { b, h, qt, dq }));
        }
        run_items(
            items,
            || BwdWs::new(&g, d),
            |ws, it| entry(isa, &cx, ws, it),
        );
    }
    Ok(BackwardOutput {
        dq: dq.into_tensor(vec![d.batch, d.heads_q, lq, d.d_qk])?,
        dk: dk.into_tensor(vec![d.batch, hkv, d.kv_len, d.d_qk])?,
        dv: dvb.into_tensor(vec![d.batch, hkv, d.kv_len, dv])?,
        dsinks,
    })
}

isa_entry!(entry, item, (cx: &BwdCtx<'_>, ws: &mut BwdWs, it: BwdItem<'_>));

#[inline(always)]
fn item<S: Simd>(cx: &BwdCtx<'_>, ws: &mut BwdWs, it: BwdItem<'_>) {
    match it {
        BwdItem::Dkv { b, g, kt, dk, dv } => dkv_item::<S>(cx, ws, b, g, kt, dk, dv),
        BwdItem::Dq { b, h, qt, dq } => dq_item::<S>(cx, ws, b, h, qt, dq),
    }
}

/// Elementwise over a strip of one key row of `Sᵀ` (varying query): with `t = tanh(s/c)` under a
/// softcap, `p = exp(c·t - lse_i)` (`exp(s - lse_i)` without), `ds = p·(dp - Δ_i)·(1 - t²)`;
/// `s` becomes `p`, `dp` becomes `ds` (exactly 0 where `p` is 0, so `0·NaN` never appears).
#[inline(always)]
fn p_ds<S: Simd, const SOFTCAP: bool>(
    s: &mut [f32],
    dp: &mut [f32],
    lse: &[f32],
    delta: &[f32],
    cap: f32,
) {
    let inv = 1.0 / cap;
    for (((x, g), &l), &dl) in s.iter_mut().zip(dp.iter_mut()).zip(lse).zip(delta) {
        let (v, dc) = if SOFTCAP {
            let t = math::tanh::<S>(*x * inv);
            (cap * t, 1.0 - t * t)
        } else {
            (*x, 1.0)
        };
        let p = math::exp::<S>(v - l);
        let ds = p * (*g - dl) * dc;
        *x = p;
        *g = if p == 0.0 { 0.0 } else { ds };
    }
}

/// Same as [`p_ds`] along one query row of `S` (varying key): one scalar LSE and Δ.
#[inline(always)]
fn p_ds_row<S: Simd, const SOFTCAP: bool>(
    s: &mut [f32],
    dp: &mut [f32],
    lse: f32,
    delta: f32,
    cap: f32,
) {
    let inv = 1.0 / cap;
    for (x, g) in s.iter_mut().zip(dp.iter_mut()) {
        let (v, dc) = if SOFTCAP {
            let t = math::tanh::<S>(*x * inv);
            (cap * t, 1.0 - t * t)
        } else {
            (*x, 1.0)
        };
        let p = math::exp::<S>(v - lse);
        let ds = p * (*g - delta) * dc;
        *x = p;
        *g = if p == 0.0 { 0.0 } else { ds };
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dkv_item<S: Simd>(
    cx: &BwdCtx<'_>,
    ws: &mut BwdWs,
    b: usize,
    gh: usize,
    kt: usize,
    mut dk_out: Out<'_>,
    mut dv_out: Out<'_>,
) {
    let (plan, d, g) = (cx.plan, &cx.d, &cx.g);
    let (dqk, dv, dqkp, dvp, tk) = (d.d_qk, d.d_v, g.dqkp, g.dvp, g.tk);
    let (k0, k1) = plan.kv_range(kt);
    let nk = k1 - k0;
    let (mk, nkp) = (round_up(nk, RB), round_up(nk, 16));
    let BwdWs {
        s,
        dp,
        tmp,
        kst,
        vt,
        qbuf,
        dobuf,
        dk,
        dv: dva,
        ..
    } = ws;
    load_transposed(
        cx.k,
        row_off(b, gh, k0, d.heads_kv, d.kv_len, dqk),
        nk,
        dqk,
        cx.scale,
        tmp,
        kst,
        tk,
    );
    load_transposed(
        cx.v,
        row_off(b, gh, k0, d.heads_kv, d.kv_len, dv),
        nk,
        dv,
        1.0,
        tmp,
        vt,
        tk,
    );
    dk[..mk * dqkp].fill(0.0);
    dva[..mk * dvp].fill(0.0);
    let cap = cx.softcap.unwrap_or(1.0);
    for h in gh * d.group()..(gh + 1) * d.group() {
        let hp = plan.head_plan(b, h);
        let bh = b * d.heads_q + h;
        for e in hp.col(kt) {
            let (q0, q1) = plan.q_range(e.tile as usize);
            let nq = q1 - q0;
            let mq = round_up(nq, RB);
            let (qa, ldq) = rows(
                cx.q,
                row_off(b, h, q0, d.heads_q, d.q_len, dqk),
                nq,
                mq,
                dqk,
                qbuf,
            );
            let (da, ldd) = rows(
                cx.d_o,
                row_off(b, h, q0, d.heads_q, d.q_len, dv),
                nq,
                mq,
                dv,
                dobuf,
            );
            gemm::<S, false, false>(mq, nkp, dqk, qa, ldq, kst, tk, s, tk);
            gemm::<S, false, false>(mq, nkp, dv, da, ldd, vt, tk, dp, tk);
            for i in 0..nq {
                let (l, dl) = (
                    cx.lse[bh * d.q_len + q0 + i],
                    cx.delta[bh * d.q_len + q0 + i],
                );
                let (sr, dr) = (&mut s[i * tk..i * tk + nk], &mut dp[i * tk..i * tk + nk]);
                if cx.softcap.is_some() {
                    p_ds_row::<S, true>(sr, dr, l, dl, cap);
                } else {
                    p_ds_row::<S, false>(sr, dr, l, dl, cap);
                }
                if !e.is_full() {
                    let bits = plan.partials.row(e.mask, i);
                    math::mask_row(sr, bits, 0.0);
                    math::mask_row(dr, bits, 0.0);
                }
            }
            product::<S, true, true>(cx.exact, mk, dvp, nq, s, tk, da, ldd, dva, dvp);
            product::<S, true, true>(cx.exact, mk, dqkp, nq, dp, tk, qa, ldq, dk, dqkp);
        }
    }
    for j in 0..nk {
        dk_out.store(j * dqk, &dk[j * dqkp..j * dqkp + dqk], cx.scale);
        dv_out.store(j * dv, &dva[j * dvp..j * dvp + dv], 1.0);
    }
}

#[inline(always)]
fn dq_item<S: Simd>(
    cx: &BwdCtx<'_>,
    ws: &mut BwdWs,
    b: usize,
    h: usize,
    qt_idx: usize,
    mut dq_out: Out<'_>,
) {
    let (plan, d, g) = (cx.plan, &cx.d, &cx.g);
    let (dqk, dv, dqkp, tq) = (d.d_qk, d.d_v, g.dqkp, g.tq);
    let kvh = h / d.group();
    let (q0, q1) = plan.q_range(qt_idx);
    let nq = q1 - q0;
    let (mq, nqp) = (round_up(nq, RB), round_up(nq, 16));
    let BwdWs {
        s,
        dp,
        tmp,
        qt,
        dot,
        kbuf,
        vbuf,
        lse,
        delta,
        dq,
        ..
    } = ws;
    let bh = b * d.heads_q + h;
    load_transposed(
        cx.q,
        row_off(b, h, q0, d.heads_q, d.q_len, dqk),
        nq,
        dqk,
        cx.scale,
        tmp,
        qt,
        tq,
    );
    load_transposed(
        cx.d_o,
        row_off(b, h, q0, d.heads_q, d.q_len, dv),
        nq,
        dv,
        1.0,
        tmp,
        dot,
        tq,
    );
    lse[..nq].copy_from_slice(&cx.lse[bh * d.q_len + q0..bh * d.q_len + q1]);
    delta[..nq].copy_from_slice(&cx.delta[bh * d.q_len + q0..bh * d.q_len + q1]);
    dq[..mq * dqkp].fill(0.0);
    let cap = cx.softcap.unwrap_or(1.0);
    for e in plan.head_plan(b, h).row(qt_idx) {
        let (k0, k1) = plan.kv_range(e.tile as usize);
        let nk = k1 - k0;
        let mk = round_up(nk, RB);
        let (ka, ldk) = rows(
            cx.k,
            row_off(b, kvh, k0, d.heads_kv, d.kv_len, dqk),
            nk,
            mk,
            dqk,
            kbuf,
        );
        let (va, ldv) = rows(
            cx.v,
            row_off(b, kvh, k0, d.heads_kv, d.kv_len, dv),
            nk,
            mk,
            dv,
            vbuf,
        );
        gemm::<S, false, false>(mk, nqp, dqk, ka, ldk, qt, tq, s, tq);
        gemm::<S, false, false>(mk, nqp, dv, va, ldv, dot, tq, dp, tq);
        for j in 0..nk {
            let (sr, dr) = (&mut s[j * tq..j * tq + nq], &mut dp[j * tq..j * tq + nq]);
            if cx.softcap.is_some() {
                p_ds::<S, true>(sr, dr, &lse[..nq], &delta[..nq], cap);
            } else {
                p_ds::<S, false>(sr, dr, &lse[..nq], &delta[..nq], cap);
            }
            if !e.is_full() {
                math::mask_row(dr, cx.masks_t.row(e.mask, j), 0.0);
            }
        }
        product::<S, true, true>(cx.exact, mq, dqkp, nk, dp, tq, ka, ldk, dq, dqkp);
    }
    for i in 0..nq {
        dq_out.store(i * dqk, &dq[i * dqkp..i * dqkp + dqk], cx.scale);
    }
}
