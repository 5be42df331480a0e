//! The tile helpers both dK/dV item drivers use: the f32 item (`dkv_item` in the parent) and
//! the `vdpbf16ps` item (`bf16`). The call context and the item, the elementwise `P`/`dS` step
//! (f32 and bf16-rounded `P`), the 16 × 16 live spans of a partial tile, and the store of dK/dV.
//!
//! Layering: this module imports nothing from `backward` or `bf16`; the parent imports `bf16`
//! only to dispatch to it, and `bf16` reaches the shared code only through this module.

use super::super::live_blocks::{LiveBlocks, SB};
use super::super::load_tile::Src;
use super::super::mask_partial_tile::mask_partial_row;
use super::super::schedule::Geometry;
use super::super::simd::{self, Simd};
use super::super::tile_matmul::round_up;
use crate::validate::Dims;
use crate::views::OutData as Out;
use tessera_plan::Plan;

/// What every item of a backward call reads: the plan, shapes, inputs, Δ and LSE, options.
pub(crate) struct BwdCtx<'a> {
    pub(super) plan: &'a Plan,
    pub(super) d: Dims,
    pub(super) g: Geometry,
    pub(super) q: Src<'a>,
    pub(super) k: Src<'a>,
    pub(super) v: Src<'a>,
    pub(super) d_o: Src<'a>,
    pub(super) lse: &'a [f32],
    pub(super) delta: &'a [f32],
    pub(super) live: &'a LiveBlocks,
    pub(super) scale: f32,
    pub(super) softcap: Option<f32>,
    pub(super) exact: bool,
}

/// A dK/dV item: (batch, kv head, kv tile), its output pieces and its dQ slots.
pub(crate) struct DkvItem<'a> {
    pub(super) b: usize,
    pub(super) g: usize,
    pub(super) kt: usize,
    pub(super) dk: Out<'a>,
    pub(super) dv: Out<'a>,
    /// dQ scratch slots, one per (query head of the group, q tile of `col(kt)`), in walk order.
    pub(super) dq: Vec<&'a mut [f32]>,
}

/// Elementwise over a strip of one query row of `S` (varying key): with `x = sc·s` (`sc` the
/// scale not yet applied to `s`) and `t = tanh(x/c)` under a softcap, `p = exp(c·t - lse)`
/// (`exp(x - lse)` without), `ds = p·(dp - Δ)·(1 - t²)`; `s` becomes `p`, `dp` becomes `ds`
/// (exactly 0 where `p` is 0, so `0·NaN` never appears). `BF16`: `P` and `dS` are rounded to bf16
/// next, so `p` is [`bf16_p`] (its argument in base 2 on the copies with FMA).
#[inline(always)]
fn p_ds_row<S: Simd, const SOFTCAP: bool, const BF16: bool>(
    sc: f32,
    s: &mut [f32],
    dp: &mut [f32],
    lse: f32,
    delta: f32,
    cap: f32,
) {
    let inv = 1.0 / cap;
    for (x, g) in s.iter_mut().zip(dp.iter_mut()) {
        let xs = *x * sc;
        let (v, dc) = if SOFTCAP {
            let t = simd::tanh::<S>(xs * inv);
            (cap * t, 1.0 - t * t)
        } else {
            (xs, 1.0)
        };
        let p = if !BF16 {
            f32_p::<S>(v - lse)
        } else if simd::base2::<S>() {
            // Base 2 (as `exp_base`): the argument in one FMA from the unscaled logit.
            let nl = -(lse * simd::LOG2E);
            bf16_p::<S>(if SOFTCAP {
                S::madd(v, simd::LOG2E, nl)
            } else {
                S::madd(*x, sc * simd::LOG2E, nl)
            })
        } else {
            bf16_p::<S>(v - lse)
        };
        let ds = p * (*g - delta) * dc;
        *x = p;
        *g = if p == 0.0 { 0.0 } else { ds };
    }
}

/// `P = e^a` of the f32 kernels: [`simd::exp_le88`] (4.5e-7 relative, 8 FMAs; `simd::exp`'s 11
/// measured 5.5% of a full tile) with `simd::exp`'s overflow to +inf above 88.3 (`a <= 0` unless
/// the given LSE is below the row's logits). NaN stays NaN.
#[inline(always)]
fn f32_p<S: Simd>(a: f32) -> f32 {
    let e = simd::exp_le88::<S>(if a > simd::EXP_HI { simd::EXP_HI } else { a });
    if a > simd::EXP_HI {
        f32::INFINITY
    } else {
        e
    }
}

/// [`bf16_p`]'s cap in base 2 (`2^127` is finite, as `e^88` is).
pub(super) const BF16_P_CAP2: f32 = 127.0;

/// `P = e^a` of the bf16 kernels, P and dS rounded to bf16 (2⁻⁹) next: on the copies with FMA
/// [`simd::exp2_coarse`] (3e-6 relative) of the base-2 argument `a·log2 e` capped at 127, else
/// [`simd::exp_le88_coarse`] (1.2e-5) of `a` capped at 88 (a NaN stays NaN); `a <= 0` unless the
/// given LSE is below the row's logits.
#[inline(always)]
fn bf16_p<S: Simd>(a: f32) -> f32 {
    if simd::base2::<S>() {
        simd::exp2_coarse::<S>(if a > BF16_P_CAP2 { BF16_P_CAP2 } else { a })
    } else {
        simd::exp_le88_coarse::<S>(if a > 88.0 { 88.0 } else { a })
    }
}

/// [`p_ds_row`] with or without the softcap (not a closure: closures do not inherit the caller's
/// target features).
#[inline(always)]
pub(super) fn p_ds<S: Simd, const BF16: bool>(
    softcap: Option<f32>,
    sc: f32,
    s: &mut [f32],
    dp: &mut [f32],
    lse: f32,
    delta: f32,
) {
    match softcap {
        Some(cap) => p_ds_row::<S, true, BF16>(sc, s, dp, lse, delta, cap),
        None => p_ds_row::<S, false, BF16>(sc, s, dp, lse, delta, 1.0),
    }
}

/// `P`, `dS` of a full tile in place: rows `0..nq`, keys `0..nk` (`sc`: the scale still to
/// apply to `s`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn p_ds_full<S: Simd, const BF16: bool>(
    cx: &BwdCtx<'_>,
    sc: f32,
    s: &mut [f32],
    dp: &mut [f32],
    tk: usize,
    nq: usize,
    nk: usize,
    lse: &[f32],
    delta: &[f32],
) {
    for i in 0..nq {
        let (sr, dr) = (&mut s[i * tk..i * tk + nk], &mut dp[i * tk..i * tk + nk]);
        p_ds::<S, BF16>(cx.softcap, sc, sr, dr, lse[i], delta[i]);
    }
}

/// The key span of a 16-query block of a partial tile: allowed keys `r0..r1`, computed over
/// `n0..n1` (`r0`, `r1` rounded out to 16).
pub(super) struct Span {
    pub(super) r0: usize,
    pub(super) r1: usize,
    pub(super) n0: usize,
    pub(super) n1: usize,
}

/// Rows `i0..i0 + m` of a partial tile, with their key span (`None`: no allowed key).
pub(super) struct QueryBlock {
    pub(super) i0: usize,
    pub(super) m: usize,
    pub(super) span: Option<Span>,
}

/// The 16-query blocks of partial mask `mask` over `mq` padded rows and `nk` keys.
#[inline(always)]
pub(super) fn query_blocks<'a>(
    cx: &'a BwdCtx<'_>,
    mask: u32,
    mq: usize,
    nk: usize,
) -> impl Iterator<Item = QueryBlock> + 'a {
    (0..mq).step_by(SB).map(move |i0| {
        let (r0, r1) = cx.live.keys(mask, i0 / SB);
        let r1 = r1.min(nk);
        QueryBlock {
            i0,
            m: (mq - i0).min(SB),
            span: (r0 < r1).then(|| Span {
                r0,
                r1,
                n0: r0 / SB * SB,
                n1: round_up(r1, SB),
            }),
        }
    })
}

/// The 16-key blocks `(j0, m, c0, c1)` of partial mask `mask` over `mk` padded keys with a
/// non-empty live query range `c0..c1` (clipped to the `nq` real queries).
#[inline(always)]
pub(super) fn key_blocks<'a>(
    cx: &'a BwdCtx<'_>,
    mask: u32,
    mk: usize,
    nq: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + 'a {
    (0..mk).step_by(SB).filter_map(move |j0| {
        let (c0, c1) = cx.live.cols(mask, j0 / SB);
        let c1 = c1.min(nq);
        (c0 < c1).then_some((j0, (mk - j0).min(SB), c0, c1))
    })
}

/// `P`, `dS` in place for the rows of query block `qb` (with a span) of partial mask `mask`:
/// exact over `n0..r1` (masked pairs 0), zero elsewhere in `0..nkp`; rows `>= nq` are padding
/// (their logits are already 0 and stay unexponentiated).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn p_ds_block<S: Simd, const BF16: bool>(
    cx: &BwdCtx<'_>,
    mask: u32,
    sc: f32,
    s: &mut [f32],
    dp: &mut [f32],
    tk: usize,
    nkp: usize,
    qb: &QueryBlock,
    nq: usize,
    lse: &[f32],
    delta: &[f32],
) {
    let Some(Span { r1, n0, n1, .. }) = qb.span else {
        return;
    };
    for i in qb.i0..qb.i0 + qb.m {
        let (sr, dr) = (&mut s[i * tk..i * tk + nkp], &mut dp[i * tk..i * tk + nkp]);
        sr[..n0].fill(0.0);
        dr[..n0].fill(0.0);
        sr[n1..].fill(0.0);
        dr[n1..].fill(0.0);
        if i < nq {
            p_ds::<S, BF16>(
                cx.softcap,
                sc,
                &mut sr[n0..r1],
                &mut dr[n0..r1],
                lse[i],
                delta[i],
            );
            // From the 64-key word holding n0 on (the keys before n0 are 0 already).
            let (w0, bits) = (n0 / 64, cx.plan.partials.row(mask, i));
            mask_partial_row(&mut sr[w0 * 64..r1], &bits[w0..], 0, 0.0);
            mask_partial_row(&mut dr[w0 * 64..r1], &bits[w0..], 0, 0.0);
        }
        sr[r1..n1].fill(0.0);
        dr[r1..n1].fill(0.0);
    }
}

/// Writes an item's `nk` rows of dK (times the scale: `S` used the unscaled product) and dV
/// from its padded accumulators to the output pieces.
#[inline(always)]
pub(super) fn store_dkv(
    cx: &BwdCtx<'_>,
    nk: usize,
    dk: &[f32],
    dv: &[f32],
    dk_out: &mut Out<'_>,
    dv_out: &mut Out<'_>,
) {
    let (dqk, d_v, dqkp, dvp) = (cx.d.d_qk, cx.d.d_v, cx.g.dqkp, cx.g.dvp);
    for j in 0..nk {
        dk_out.store(j * dqk, &dk[j * dqkp..j * dqkp + dqk], cx.scale);
        dv_out.store(j * d_v, &dv[j * dvp..j * dvp + d_v], 1.0);
    }
}
