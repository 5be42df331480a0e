//! Backward kernels.
//!
//! 1. Pre-pass per (batch, query head): `Δ_i = O_i·dO_i − dLSE_i` (f64 accumulation; dLSE is
//!    the optional gradient of a loss on the LSE, zero when absent) and the sink term
//!    `Σ_i exp(σ_h - LSE_i)·Δ_i`.
//! 2. dK/dV/dQ items (batch, kv head, kv-tile): `scale·Kᵀ`, `Vᵀ` and `K` of the tile are packed
//!    once; for each query head of the GQA group in ascending order and each q tile of that head's
//!    kv-major list `col(kt)` in ascending order: `S = Q·(scale·Kᵀ)`, `dP = dO·Vᵀ`,
//!    `P = exp(S - LSE)`, `dS = P ⊙ (dP - Δ)` (times the softcap derivative), `dV += Pᵀ·dO`,
//!    `dK += dSᵀ·Q`, and the tile's dQ contribution `dS·K` written to its own scratch slot:
//!    slot = (q tile, position of this kv tile in the q tile's forward row `row(qt)`). Five tile
//!    products per active tile (the dQ pass no longer recomputes `S` and `dP`).
//!    Partial tiles only compute their live 16 × 16 sub-blocks (`live_blocks`): `S`/`dP` per 16-query
//!    block over its key span, `Pᵀ·dO`/`dSᵀ·Q` per 16-key block over its query span, `dS·K` per
//!    16-query block over its key span; `P`/`dS` are zeroed outside the spans.
//! 3. dQ reduce items (batch, query head, q-tile): the slots of the q tile summed in ascending
//!    slot order (= ascending kv tile), times `scale`.
//!
//! Steps 2 and 3 run in rounds: the (batch, kv head, kv tile) sequence is cut into runs whose
//! slots fit [`SCRATCH_FLOATS`] (a round may exceed it only to give each thread two items), so
//! the scratch stays bounded at any sequence length. A q tile whose kv tiles span several rounds
//! carries its running dQ sum from round to round in the same sequential order, so results do
//! not depend on the split. The scratch buffer lives in the caller's workspace.
//! Every output element is written by one item in a fixed order: no atomics, bit-identical
//! results for any thread count.
//!
//! Files, in layer order: `tiles` (the call context and dK/dV item, the `P`/`dS` step, the live
//! spans of a partial tile, the dK/dV store: what both item drivers use), `bf16` (the
//! `vdpbf16ps` item; of `backward` it uses `tiles` only), this file (Δ, rounds, slots, reduce,
//! the f32 item, and the dispatch to `bf16`). Neither child imports this file's items.

#[cfg(target_arch = "x86_64")]
mod bf16;
mod tiles;

use super::isa::{isa_entry, Isa};
use super::load_tile::{load_transposed, rows, Src};
use super::prepare::Prep;
use super::schedule::{run_items, Geometry, Order};
use super::simd::Simd;
use super::tile_matmul::{gemm, product, round_up, RB};
use super::workspace::{grown, Rest};
use crate::args::{GradInputs, GradOut};
use crate::options::AttnOptions;
use crate::validate::Dims;
use crate::views::OutData as Out;
use rayon::prelude::*;
use tessera_core::tensor::ViewData;
use tessera_core::{Error, Result};
use tessera_plan::Plan;
use tiles::{key_blocks, p_ds_block, p_ds_full, query_blocks, store_dkv, BwdCtx, DkvItem};

/// Upper bound on the dQ scratch of one round, in f32 elements (exceeded only to give every
/// thread two items). Small on purpose: one buffer reused round after round stays in cache
/// (64 MB chunks measured ~20% slower on documents).
const SCRATCH_FLOATS: usize = 4 << 20;

pub(crate) struct BwdWs {
    s: Vec<f32>,
    dp: Vec<f32>,
    tmp: Vec<f32>,
    kst: Vec<f32>,
    vt: Vec<f32>,
    kbuf: Vec<f32>,
    qbuf: Vec<f32>,
    dobuf: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// f32 elements of one [`BwdWs`].
pub(crate) fn ws_floats(g: &Geometry, d: &Dims) -> usize {
    2 * g.tq * g.tk
        + d.d_qk.max(d.d_v)
        + (d.d_qk + d.d_v) * g.tk
        + g.tk * (2 * g.dqkp + g.dvp)
        + g.tq * (g.dqkp + g.dvp)
}

/// f32 elements of one bf16 item workspace (`u32` words count as one each).
#[cfg(target_arch = "x86_64")]
pub(crate) fn bf16_ws_floats(g: &Geometry, d: &Dims) -> usize {
    bf16::ws_words(g, d)
}

/// No bf16 kernel off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn bf16_ws_floats(_: &Geometry, _: &Dims) -> usize {
    0
}

/// f32 elements of the buffers shared by the workers: Δ, the dQ scratch of the largest round,
/// the cross-round carries and the reduce workspaces.
pub(crate) fn shared_floats(plan: &Plan, d: &Dims, g: &Geometry, threads: usize) -> usize {
    let sz = g.tq * g.dqkp;
    let bh = d.batch * d.heads_q;
    let rounds = rounds(plan, d, sz, threads);
    let max_slots = rounds.iter().map(|r| r.slots).max().unwrap_or(0);
    let split = rounds.iter().flat_map(|r| &r.parts).count() > d.batch * d.heads_kv;
    bh * d.q_len + max_slots * sz + if split { bh * plan.q_tiles * sz } else { 0 } + threads * sz
}

/// Bytes of workspace a backward of `d` over `plan` on `threads` threads uses.
pub(crate) fn backward_bytes(isa: Isa, plan: &Plan, d: &Dims, threads: usize) -> usize {
    let g = Geometry::new(plan, d);
    let per_worker = if crate::cpu::isa::runs_bf16_kernel(isa, d.dtype) {
        ws_floats(&g, d).max(bf16_ws_floats(&g, d))
    } else {
        ws_floats(&g, d)
    };
    4 * (threads * per_worker + shared_floats(plan, d, &g, threads))
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
            kbuf: z(g.tk * g.dqkp),
            qbuf: z(g.tq * g.dqkp),
            dobuf: z(g.tq * g.dvp),
            dk: z(g.tk * g.dqkp),
            dv: z(g.tk * g.dvp),
        }
    }
}

pub(crate) fn run(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &GradInputs<'_>,
    options: &AttnOptions,
    out: GradOut<'_>,
    rest: Rest<'_>,
) -> Result<()> {
    let plan = prep.plan;
    let g = Geometry::new(plan, d);
    let (q, k, v, o, d_o) = (
        Src::new(&inputs.q)?,
        Src::new(&inputs.k)?,
        Src::new(&inputs.v)?,
        Src::new(&inputs.o)?,
        Src::new(&inputs.d_o)?,
    );
    let ViewData::F32(lse) = inputs.lse.data else {
        return Err(Error::Internal("unvalidated lse dtype".into()));
    };
    let d_lse = match inputs.d_lse.map(|t| t.data) {
        None => None,
        Some(ViewData::F32(g)) => Some(g),
        Some(_) => return Err(Error::Internal("unvalidated d_lse dtype".into())),
    };
    let (bh, lq, dv) = (d.batch * d.heads_q, d.q_len, d.d_v);
    let GradOut {
        mut dq,
        mut dk,
        dv: mut dvb,
        dsinks,
    } = out;
    let Rest { items: pool, bufs } = rest;

    // 1. Δ and the sink gradient; whether dO is finite, found on the way.
    let delta = grown(&mut bufs.delta, bh * lq);
    let mut sink_part = vec![0f64; bh];
    let sinks = options.sinks.as_deref();
    let d_o_finite = delta
        .par_chunks_mut(lq)
        .zip(sink_part.par_iter_mut())
        .enumerate()
        .map(|(slab, (dl, sp))| {
            let (mut orow, mut drow) = (vec![0f32; dv], vec![0f32; dv]);
            let (b, h) = (slab / d.heads_q, slab % d.heads_q);
            let sigma = sinks.map(|s| s[h] as f64);
            let mut acc = 0f64;
            // Bit 0 set: some dO value is non-finite (exponent all ones).
            let mut bad = 0u32;
            for (i, out) in dl.iter_mut().enumerate() {
                o.load(o.row(b, h, i), &mut orow, 1.0);
                d_o.load(d_o.row(b, h, i), &mut drow, 1.0);
                bad |= drow.iter().fold(0, |a, v| {
                    a | u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
                });
                let dot: f64 = orow
                    .iter()
                    .zip(&drow)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                // A loss on LSE adds `dlse_i·P_ij` to dS_ij: the same as Δ_i − dlse_i in
                // `dS = P ⊙ (dP − Δ)` (and in the sink term below).
                let dot = match d_lse {
                    Some(g) => dot - g[slab * lq + i] as f64,
                    None => dot,
                };
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
            bad == 0
        })
        .reduce(|| true, |a, b| a & b);
    // The zero-skipping products are needed where a zero `P` or `dS` weight meets a
    // non-finite row of dO, Q or K (the B sides of `Pᵀ·dO`, `dSᵀ·Q`, `dS·K`). A non-finite V
    // only reaches `dP`, and `dS` is set to exactly 0 wherever `P` is 0.
    let exact = !(d_o_finite && q.all_finite() && k.all_finite());
    if let Some(ds) = dsinks {
        for (h, x) in ds.iter_mut().enumerate() {
            *x = -(0..d.batch)
                .map(|b| sink_part[b * d.heads_q + h])
                .sum::<f64>() as f32;
        }
    }

    // 2 + 3. dK/dV/dQ-slot items, then dQ reduce items, per chunk of (batch, kv head) pairs.
    let cx = BwdCtx {
        plan,
        d: *d,
        g,
        q,
        k,
        v,
        d_o,
        lse,
        delta,
        live: &prep.data.live,
        scale: options.scale_for(d.d_qk),
        softcap: options.softcap,
        exact,
    };
    // bf16 storage with finite inputs on AVX512-BF16: the `vdpbf16ps` item kernel.
    #[cfg(target_arch = "x86_64")]
    let bf16_inputs = (!exact).then(|| bf16::Inputs::new(isa, &cx)).flatten();
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_inputs: Option<()> = None;
    let (hkv, nkt, nqt, grp) = (d.heads_kv, plan.kv_tiles, plan.q_tiles, d.group());
    {
        let sz = g.tq * g.dqkp;
        fn take<T>(v: Vec<T>) -> Vec<Option<T>> {
            v.into_iter().map(Some).collect()
        }
        let mut dk_p = take(dk.pieces(d.kv_len * d.d_qk, plan.tile.kv * d.d_qk));
        let mut dv_p = take(dvb.pieces(d.kv_len * dv, plan.tile.kv * dv));
        let mut dq_p = take(dq.pieces(lq * d.d_qk, plan.tile.q * d.d_qk));
        let rounds = rounds(plan, d, sz, rayon::current_num_threads());
        let max_slots = rounds.iter().map(|r| r.slots).max().unwrap_or(0);
        // Running dQ sums of q tiles whose kv tiles span several rounds (only then used).
        let split = rounds.iter().flat_map(|r| &r.parts).count() > d.batch * hkv;
        let carry = grown(&mut bufs.carry, if split { bh * nqt * sz } else { 0 });
        // Every slot is written before it is read: the buffer's old contents never matter.
        let scratch = grown(&mut bufs.scratch, max_slots * sz);
        for round in &rounds {
            let mut slots: Vec<Option<&mut [f32]>> = scratch[..round.slots * sz]
                .chunks_mut(sz.max(1))
                .map(Some)
                .collect();
            // Slot layout of each (part, head of the group): per q tile, the entries of its
            // forward row whose kv tile lies in the part's range, in row order.
            let mut layout: Vec<SlotLayout> = Vec::with_capacity(round.parts.len() * grp);
            let mut base = 0usize;
            for &(p, kt0, kt1) in &round.parts {
                let (b, gh) = (p / hkv, p % hkv);
                for h in gh * grp..(gh + 1) * grp {
                    let l = SlotLayout::new(plan.head_plan(b, h), base, kt0, kt1);
                    base += l.len();
                    layout.push(l);
                }
            }
            debug_assert_eq!(base, round.slots);
            {
                let mut items: Vec<(Order, DkvItem<'_>)> = Vec::new();
                for (pi, &(p, kt0, kt1)) in round.parts.iter().enumerate() {
                    let (b, gh) = (p / hkv, p % hkv);
                    for kt in kt0..kt1 {
                        let mut mine = Vec::new();
                        for (hi, h) in (gh * grp..(gh + 1) * grp).enumerate() {
                            let (hp, l) = (plan.head_plan(b, h), &layout[pi * grp + hi]);
                            for e in hp.col(kt) {
                                let s = l.slot(hp, e.tile as usize, kt);
                                mine.push(slots[s].take().expect("plan: dQ slot used twice"));
                            }
                        }
                        let idx = p * nkt + kt;
                        items.push((
                            Order {
                                group: p,
                                cost: 5 * mine.len(),
                            },
                            DkvItem {
                                b,
                                g: gh,
                                kt,
                                dk: dk_p[idx].take().expect("dK piece"),
                                dv: dv_p[idx].take().expect("dV piece"),
                                dq: mine,
                            },
                        ));
                    }
                }
                match &bf16_inputs {
                    #[cfg(target_arch = "x86_64")]
                    Some(inp) => run_items(
                        items,
                        pool,
                        || bf16::Ws::new(&g, d),
                        |ws, it| bf16::entry(&cx, inp, ws, it),
                        |_| {},
                    ),
                    _ => run_items(
                        items,
                        pool,
                        || BwdWs::new(&g, d),
                        |ws, it| entry(isa, &cx, ws, it),
                        |_| {},
                    ),
                }
            }
            let scr = &scratch[..round.slots * sz];
            let mut carry_p: Vec<Option<&mut [f32]>> =
                carry.chunks_mut(sz.max(1)).map(Some).collect();
            let mut items: Vec<(Order, RedItem<'_>)> = Vec::new();
            for (pi, &(p, kt0, kt1)) in round.parts.iter().enumerate() {
                let (b, gh) = (p / hkv, p % hkv);
                for (hi, h) in (gh * grp..(gh + 1) * grp).enumerate() {
                    let (hp, l) = (plan.head_plan(b, h), &layout[pi * grp + hi]);
                    for qt in 0..nqt {
                        let (s0, s1) = l.range(qt);
                        let row = hp.row(qt);
                        let first = row.first().is_none_or(|e| e.tile as usize >= kt0);
                        let last = row.last().is_none_or(|e| (e.tile as usize) < kt1);
                        // A q tile with no entries in this round is finished elsewhere, except
                        // an empty row (all zeros), finished with the pair's first kv tile.
                        if s0 == s1 && !(row.is_empty() && kt0 == 0) {
                            continue;
                        }
                        let t = (b * d.heads_q + h) * nqt + qt;
                        let carry = if first && last {
                            None
                        } else {
                            Some(carry_p[t].take().expect("dQ carry piece"))
                        };
                        items.push((
                            Order {
                                group: b * d.heads_q + h,
                                cost: s1 - s0 + 1,
                            },
                            RedItem {
                                qt,
                                slots: &scr[s0 * sz..s1 * sz],
                                first,
                                carry,
                                dq: if last {
                                    Some(dq_p[t].take().expect("dQ piece"))
                                } else {
                                    None
                                },
                            },
                        ));
                    }
                }
            }
            run_items(
                items,
                pool,
                || vec![0f32; sz],
                |ws, it| reduce_entry(isa, &cx, ws, it),
                |_| {},
            );
        }
    }
    Ok(())
}

pub(crate) struct RedItem<'a> {
    qt: usize,
    /// The q tile's slots of this round in ascending kv-tile order, `tq × dqkp` each.
    slots: &'a [f32],
    /// Whether no earlier round had slots of this q tile (else `carry` holds their sum).
    first: bool,
    /// Running sum across rounds, for q tiles whose slots span several rounds.
    carry: Option<&'a mut [f32]>,
    /// The output piece, when this round holds the q tile's last slots.
    dq: Option<Out<'a>>,
}

isa_entry!(entry, dkv_item, (cx: &BwdCtx<'_>, ws: &mut BwdWs, it: DkvItem<'_>));
isa_entry!(reduce_entry, reduce_item, (cx: &BwdCtx<'_>, acc: &mut [f32], it: RedItem<'_>));

/// `dQ = scale · Σ slots` over the q tile's rows, slots in ascending order; across rounds the
/// running sum goes through `carry`, continuing the same sequential order (so the result does
/// not depend on how the kv tiles were split into rounds).
#[inline(always)]
fn reduce_item<S: Simd>(cx: &BwdCtx<'_>, acc: &mut [f32], it: RedItem<'_>) {
    let RedItem {
        qt,
        slots,
        first,
        carry,
        dq,
    } = it;
    let (dqk, dqkp) = (cx.d.d_qk, cx.g.dqkp);
    let (q0, q1) = cx.plan.q_range(qt);
    let n = (q1 - q0) * dqkp;
    let acc = &mut acc[..n];
    match (&carry, first) {
        (Some(c), false) => acc.copy_from_slice(&c[..n]),
        _ => acc.fill(0.0),
    }
    for slot in slots.chunks_exact(cx.g.tq * dqkp) {
        for (a, &x) in acc.iter_mut().zip(&slot[..n]) {
            *a += x;
        }
    }
    match dq {
        Some(mut dq) => {
            for i in 0..q1 - q0 {
                dq.store(i * dqk, &acc[i * dqkp..i * dqkp + dqk], cx.scale);
            }
        }
        None => {
            if let Some(c) = carry {
                c[..n].copy_from_slice(acc);
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Test override of [`SCRATCH_FLOATS`] for calls made from this thread (set by the
    /// round-split test in `cpu::backend`, which needs whole backend calls).
    pub(super) static TEST_BOUND: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// The round bound in f32 elements.
fn scratch_bound() -> usize {
    #[cfg(test)]
    if let Some(b) = TEST_BOUND.with(|c| c.get()) {
        return b;
    }
    SCRATCH_FLOATS
}

/// A round of the dK/dV pass: `(pair, kt0, kt1)` parts (kv tiles `kt0..kt1` of (batch, kv head)
/// pair `pair`), in (pair, kv tile) order, and the dQ slots they need.
pub(super) struct Round {
    parts: Vec<(usize, usize, usize)>,
    slots: usize,
}

/// Splits the (pair, kv tile) sequence into rounds whose dQ slots fit [`SCRATCH_FLOATS`], each
/// round holding at least two items per thread when the sequence has them (so both cores stay
/// busy even when single kv tiles have long columns; a round may then exceed the bound).
pub(super) fn rounds(plan: &Plan, d: &Dims, sz: usize, threads: usize) -> Vec<Round> {
    let (hkv, grp) = (d.heads_kv, d.group());
    let min_items = 2 * threads;
    let mut out: Vec<Round> = Vec::new();
    let mut cur = Round {
        parts: Vec::new(),
        slots: 0,
    };
    let mut items = 0usize;
    for p in 0..d.batch * hkv {
        let (b, gh) = (p / hkv, p % hkv);
        for kt in 0..plan.kv_tiles {
            let n: usize = (gh * grp..(gh + 1) * grp)
                .map(|h| plan.head_plan(b, h).col(kt).len())
                .sum();
            if items >= min_items && (cur.slots + n) * sz > scratch_bound() {
                out.push(std::mem::replace(
                    &mut cur,
                    Round {
                        parts: Vec::new(),
                        slots: 0,
                    },
                ));
                items = 0;
            }
            match cur.parts.last_mut() {
                Some(last) if last.0 == p && last.2 == kt => last.2 = kt + 1,
                _ => cur.parts.push((p, kt, kt + 1)),
            }
            cur.slots += n;
            items += 1;
        }
    }
    if !cur.parts.is_empty() {
        out.push(cur);
    }
    out
}

/// Where the dQ slots of one (part, query head) lie in the round's scratch.
struct SlotLayout {
    kt0: usize,
    kt1: usize,
    /// Per q tile, the first row position with a kv tile `>= kt0`.
    lo: Vec<usize>,
    /// Slot index of each q tile's first slot (`nqt + 1` entries).
    start: Vec<usize>,
}

impl SlotLayout {
    fn new(hp: &tessera_plan::HeadPlan, base: usize, kt0: usize, kt1: usize) -> Self {
        let nqt = hp.fwd_offsets.len() - 1;
        let (mut lo, mut start) = (Vec::with_capacity(nqt), Vec::with_capacity(nqt + 1));
        let mut at = base;
        for qt in 0..nqt {
            let row = hp.row(qt);
            let a = row.partition_point(|e| (e.tile as usize) < kt0);
            let z = row.partition_point(|e| (e.tile as usize) < kt1);
            lo.push(a);
            start.push(at);
            at += z - a;
        }
        start.push(at);
        SlotLayout {
            kt0,
            kt1,
            lo,
            start,
        }
    }

    fn len(&self) -> usize {
        self.start[self.start.len() - 1] - self.start[0]
    }

    /// Slot range of q tile `qt`.
    fn range(&self, qt: usize) -> (usize, usize) {
        (self.start[qt], self.start[qt + 1])
    }

    /// Slot of tile (`qt`, `kt`), `kt` in the part's range and present in row `qt`.
    fn slot(&self, hp: &tessera_plan::HeadPlan, qt: usize, kt: usize) -> usize {
        debug_assert!(self.kt0 <= kt && kt < self.kt1);
        let pos = hp
            .row(qt)
            .binary_search_by_key(&(kt as u32), |x| x.tile)
            .expect("plan: kv-major entry missing from its q-major row");
        self.start[qt] + pos - self.lo[qt]
    }
}

#[inline(always)]
fn dkv_item<S: Simd>(cx: &BwdCtx<'_>, ws: &mut BwdWs, it: DkvItem<'_>) {
    let DkvItem {
        b,
        g: gh,
        kt,
        dk: mut dk_out,
        dv: mut dv_out,
        dq: mut dq_slots,
    } = it;
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
        kbuf,
        qbuf,
        dobuf,
        dk,
        dv: dva,
    } = ws;
    load_transposed::<S>(cx.k, cx.k.row(b, gh, k0), nk, dqk, cx.scale, tmp, kst, tk);
    load_transposed::<S>(cx.v, cx.v.row(b, gh, k0), nk, dv, 1.0, tmp, vt, tk);
    let (ka, ldk) = rows(cx.k, cx.k.row(b, gh, k0), nk, mk, dqk, kbuf);
    dk[..mk * dqkp].fill(0.0);
    dva[..mk * dvp].fill(0.0);
    let mut slot_it = dq_slots.iter_mut();
    for h in gh * d.group()..(gh + 1) * d.group() {
        let hp = plan.head_plan(b, h);
        let bh = b * d.heads_q + h;
        for e in hp.col(kt) {
            let slot: &mut [f32] = slot_it.next().expect("one dQ slot per entry");
            let (q0, q1) = plan.q_range(e.tile as usize);
            let nq = q1 - q0;
            let mq = round_up(nq, RB);
            let (qa, ldq) = rows(cx.q, cx.q.row(b, h, q0), nq, mq, dqk, qbuf);
            let (da, ldd) = rows(cx.d_o, cx.d_o.row(b, h, q0), nq, mq, dv, dobuf);
            let lse = &cx.lse[bh * d.q_len + q0..bh * d.q_len + q1];
            let delta = &cx.delta[bh * d.q_len + q0..bh * d.q_len + q1];
            if e.is_full() {
                gemm::<S, false, false>(mq, nkp, dqk, qa, ldq, kst, tk, s, tk);
                gemm::<S, false, false>(mq, nkp, dv, da, ldd, vt, tk, dp, tk);
                p_ds_full::<S, false>(cx, 1.0, s, dp, tk, nq, nk, lse, delta);
                product::<S, true, true>(cx.exact, mk, dvp, nq, s, tk, da, ldd, dva, dvp);
                product::<S, true, true>(cx.exact, mk, dqkp, nq, dp, tk, qa, ldq, dk, dqkp);
                product::<S, false, false>(cx.exact, mq, dqkp, nk, dp, tk, ka, ldk, slot, dqkp);
                continue;
            }
            // Partial tile: per 16-query block, S/dP/P/dS over its key span only, zero outside;
            // dQ slot rows = dS·K over the span.
            for qb in query_blocks(cx, e.mask, mq, nk) {
                let (i0, m) = (qb.i0, qb.m);
                let Some(span) = &qb.span else {
                    s[i0 * tk..(i0 + m) * tk].fill(0.0);
                    dp[i0 * tk..(i0 + m) * tk].fill(0.0);
                    slot[i0 * dqkp..(i0 + m) * dqkp].fill(0.0);
                    continue;
                };
                let (n0, n1) = (span.n0, span.n1);
                gemm::<S, false, false>(
                    m,
                    n1 - n0,
                    dqk,
                    &qa[i0 * ldq..],
                    ldq,
                    &kst[n0..],
                    tk,
                    &mut s[i0 * tk + n0..],
                    tk,
                );
                gemm::<S, false, false>(
                    m,
                    n1 - n0,
                    dv,
                    &da[i0 * ldd..],
                    ldd,
                    &vt[n0..],
                    tk,
                    &mut dp[i0 * tk + n0..],
                    tk,
                );
                p_ds_block::<S, false>(cx, e.mask, 1.0, s, dp, tk, nkp, &qb, nq, lse, delta);
                product::<S, false, false>(
                    cx.exact,
                    m,
                    dqkp,
                    span.r1 - span.r0,
                    &dp[i0 * tk + span.r0..],
                    tk,
                    &ka[span.r0 * ldk..],
                    ldk,
                    &mut slot[i0 * dqkp..],
                    dqkp,
                );
            }
            // dV += Pᵀ·dO, dK += dSᵀ·Q per 16-key block over its query span.
            for (j0, m, c0, c1) in key_blocks(cx, e.mask, mk, nq) {
                product::<S, true, true>(
                    cx.exact,
                    m,
                    dvp,
                    c1 - c0,
                    &s[c0 * tk + j0..],
                    tk,
                    &da[c0 * ldd..],
                    ldd,
                    &mut dva[j0 * dvp..],
                    dvp,
                );
                product::<S, true, true>(
                    cx.exact,
                    m,
                    dqkp,
                    c1 - c0,
                    &dp[c0 * tk + j0..],
                    tk,
                    &qa[c0 * ldq..],
                    ldq,
                    &mut dk[j0 * dqkp..],
                    dqkp,
                );
            }
        }
    }
    store_dkv(cx, nk, dk, dva, &mut dk_out, &mut dv_out);
}
