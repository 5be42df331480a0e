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

#[cfg(target_arch = "x86_64")]
mod bf16;

use super::isa::{isa_entry, Isa};
use super::live_blocks::{LiveBlocks, SB};
use super::load_tile::{load_transposed, rows, Src};
use super::mask_partial_tile::mask_partial_row;
use super::prepare::Prep;
use super::schedule::{run_items, Geometry, Order};
use super::simd::{self, Simd};
use super::tile_matmul::{gemm, product, round_up, RB};
use super::workspace::{grown, Rest};
use crate::args::{GradInputs, GradOut};
use crate::options::AttnOptions;
use crate::validate::Dims;
use crate::views::OutData as Out;
use rayon::prelude::*;
use tessera_core::tensor::ViewData;
use tessera_core::{DType, Error, Result};
use tessera_plan::Plan;

/// Upper bound on the dQ scratch of one round, in f32 elements (exceeded only to give every
/// thread two items). Small on purpose: one buffer reused round after round stays in cache
/// (64 MB chunks measured ~20% slower on documents).
const SCRATCH_FLOATS: usize = 4 << 20;

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
    live: &'a LiveBlocks,
    scale: f32,
    softcap: Option<f32>,
    exact: bool,
}

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
    let per_worker = if isa == Isa::Avx512Bf16 && d.dtype == DType::BF16 {
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

pub(crate) struct DkvItem<'a> {
    b: usize,
    g: usize,
    kt: usize,
    dk: Out<'a>,
    dv: Out<'a>,
    /// dQ scratch slots, one per (query head of the group, q tile of `col(kt)`), in walk order.
    dq: Vec<&'a mut [f32]>,
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
const BF16_P_CAP2: f32 = 127.0;

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
fn p_ds<S: Simd, const BF16: bool>(
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
fn p_ds_full<S: Simd, const BF16: bool>(
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
struct Span {
    r0: usize,
    r1: usize,
    n0: usize,
    n1: usize,
}

/// Rows `i0..i0 + m` of a partial tile, with their key span (`None`: no allowed key).
struct QueryBlock {
    i0: usize,
    m: usize,
    span: Option<Span>,
}

/// The 16-query blocks of partial mask `mask` over `mq` padded rows and `nk` keys.
#[inline(always)]
fn query_blocks<'a>(
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
fn key_blocks<'a>(
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
fn p_ds_block<S: Simd, const BF16: bool>(
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

/// Writes an item's `nk` rows of dK (times the scale: `S` used the unscaled product) and dV
/// from its padded accumulators to the output pieces.
#[inline(always)]
fn store_dkv(
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
