//! The forward pass: work items, their scheduling ([`schedule`]), the telemetry hooks
//! ([`TileObserver`]) and the f32 item kernel; the `vdpbf16ps` item is [`bf16`], the hooked
//! logging-step variant [`telemetry`].
//!
//! One work item per (batch, query head, q-tile).
//!
//! Per item the scaled Q tile is packed transposed once (`Qsᵀ`, `[Dqk × tq]`); for every kv tile
//! of the item's forward work-list row the kernel computes `Sᵀ = K_tile · Qsᵀ` (`[tk × tq]`, so
//! every softmax loop runs contiguous over the tile's queries with no per-tile transpose), applies
//! the partial bitmask (partial tiles only), the softcap, the online-softmax update (running max,
//! the exponent reference and, when it moves, the rescale of the O rows; exponentials, in base 2
//! on the copies with FMA, the coarse ones for bf16 storage on the AVX2 copy, whose output
//! rounding (2⁻⁹) hides their 3e-6; column sums), then accumulates `O += P·V` with O rows contiguous over Dv. The item finishes with the sink, the normalisation, LSE and the item's
//! pre-softcap max logit.

#[cfg(target_arch = "x86_64")]
use super::column_softmax;
use super::isa::{isa_entry, Isa};
use super::live_blocks::{LiveBlocks, SB};
use super::load_tile::prefetch_rows;
use super::load_tile::{in_place, load_transposed, rows, Src};
use super::mask_partial_tile::{mask_partial_row, MasksT};
use super::online_softmax::{self, column_max, finish_row};
use super::prepare::Prep;
use super::schedule::{f32_pieces, run_items, Geometry, Order};
use super::simd::{self, Simd};
use super::tile_matmul::{gemm, gemm_colmax, product, round_up, RB};
use super::workspace::{grown, Rest, WsPool};
use crate::args::{AttnInputs, ForwardOut};
use crate::options::AttnOptions;
use crate::validate::Dims;
use crate::views::OutData as Out;
use tessera_core::Result;
use tessera_plan::Plan;

pub(crate) mod bf16;
pub(crate) mod select;
pub(crate) mod telemetry;

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Compile-time hook into the forward kernels (`item_with` here and the AVX512-BF16
/// `forward::bf16::item`). The production kernels use [`NoTelemetry`] (every hook is an empty inline
/// function, so it compiles to nothing); the telemetry variant (`super::forward::telemetry`: per-row sink
/// mass, entropy) implements the hooks and is instantiated as a separate kernel copy. Hooks only
/// read kernel state; they never change what the kernel computes.
pub(crate) trait TileObserver {
    /// Whether any hook does something: `forward::bf16` keeps no f32 P row, and only writes one per key
    /// for the hooks when this is true (read only by that x86-64 kernel).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const OBSERVES: bool = true;

    /// Before the exponentials of one key row of a kv tile, over the row's live query span
    /// `a..b` (every query outside it is masked for this key): `Some(acc)` (`b − a` entries)
    /// makes the kernel run its fused exponential loop, which also does
    /// `acc[i − a] += p_i · max(s_i − m_use_i, −88)` (`p_i ln p_i` without a logarithm; the clamp
    /// only turns masked pairs, `p = 0`, into 0). `None` (production) keeps the plain loop.
    #[inline(always)]
    fn entropy_terms(&mut self, _a: usize, _b: usize) -> Option<&mut [f32]> {
        None
    }

    /// After them: `p[i − a] = exp(s_i − m_use_i)` for queries `a..a + p.len()`, `key` the
    /// absolute key index.
    #[inline(always)]
    fn after_exp(&mut self, _key: usize, _a: usize, _p: &[f32]) {}

    /// After the exponentials of one kv tile (one entry per query row of the item): `col[i]` is
    /// the tile's `Σ_j exp(s_ij − m_use[i])`, and the kernel rescaled its running sums from the
    /// previous exponent reference to `m_use` by `alpha` (1 where the reference stayed).
    #[inline(always)]
    fn on_tile(&mut self, _col: &[f32], _m_use: &[f32], _alpha: &[f32]) {}

    /// After row `i` of the item is final, with its LSE (f64, before rounding to the output).
    #[inline(always)]
    fn on_row(&mut self, _i: usize, _lse: f64) {}
}

/// The production forward kernel: no telemetry work at all.
#[derive(Default)]
pub(crate) struct NoTelemetry;
impl TileObserver for NoTelemetry {
    const OBSERVES: bool = false;
}

pub(crate) struct FwdCtx<'a> {
    plan: &'a Plan,
    d: Dims,
    g: Geometry,
    q: Src<'a>,
    k: Src<'a>,
    v: Src<'a>,
    masks_t: &'a MasksT,
    live: &'a LiveBlocks,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&'a [f32]>,
    /// Use the zero-skipping product for `P·V` (so a zero weight times a non-finite V entry
    /// stays 0) in every item: set when V was scanned and holds a non-finite value. Without
    /// the scan ([`FwdCtx::new`]), an item redoes itself with it when its output is not finite.
    exact: bool,
    /// V was not scanned: redo an item whose output has a non-finite value (see `item`).
    redo: bool,
}

pub(crate) struct FwdItem<'a> {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) qt: usize,
    pub(super) o: Out<'a>,
    pub(super) lse: &'a mut [f32],
    pub(super) max_logit: &'a mut f32,
}

impl FwdItem<'_> {
    /// Cache hints for the item's Q rows (source `q`) and its O piece, issued one item ahead
    /// (`run_items`): both are touched once per item, at its start and its end, and otherwise
    /// cost a memory round trip per line (~25k cycles per 128-query f32 item, measured).
    pub(super) fn prefetch(&self, plan: &Plan, q: Src<'_>) {
        let (q0, q1) = plan.q_range(self.qt);
        let dim = q.dim();
        prefetch_rows(q, q.row(self.b, self.h, q0), q1 - q0, dim);
        self.o.prefetch_for_write();
    }
}

pub(crate) struct FwdWs {
    /// `Qsᵀ` `[Dqk × tq]`.
    qt: Vec<f32>,
    /// K rows (when converted) `[tk × Dqkp]`.
    kbuf: Vec<f32>,
    /// V rows (when converted) `[tk × Dvp]`.
    vbuf: Vec<f32>,
    /// `Sᵀ` then `Pᵀ`, `[tk × tq]`.
    s: Vec<f32>,
    /// Unnormalised O `[tq × Dvp]`.
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    m_use: Vec<f32>,
    alpha: Vec<f32>,
    col: Vec<f32>,
    raw_max: Vec<f32>,
    tmp: Vec<f32>,
}

/// f32 elements of one [`FwdWs`].
pub(crate) fn ws_floats(g: &Geometry, d: &Dims) -> usize {
    d.d_qk * g.tq + g.tk * (g.dqkp + g.dvp + g.tq) + g.tq * g.dvp + 6 * g.tq + d.d_qk.max(d.d_v)
}

impl FwdWs {
    fn new(g: &Geometry, d: &Dims) -> Self {
        let z = |n: usize| vec![0f32; n];
        FwdWs {
            qt: z(d.d_qk * g.tq),
            kbuf: z(g.tk * g.dqkp),
            vbuf: z(g.tk * g.dvp),
            s: z(g.tk * g.tq),
            o: z(g.tq * g.dvp),
            m: z(g.tq),
            l: z(g.tq),
            m_use: z(g.tq),
            alpha: z(g.tq),
            col: z(g.tq),
            raw_max: z(g.tq),
            tmp: z(d.d_qk.max(d.d_v)),
        }
    }
}

pub(crate) fn run(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<()> {
    let cx = FwdCtx::new(prep, d, inputs, options, false)?;
    run_with(
        &cx,
        out,
        rest,
        || cx.workspace(),
        |ws, it| entry(isa, &cx, ws, it),
    )
}

impl<'a> FwdCtx<'a> {
    /// The per-call state every item reads (inputs, transposed masks, options). `scan_v`: scan
    /// V for non-finite values up front (a pass over all of V: ~1 % of a sparse forward) and
    /// pick the product for every item from it, as a copy with per-item hooks must (it cannot
    /// run an item twice); without it, items redo themselves when needed (`item`).
    pub(super) fn new(
        prep: Prep<'a>,
        d: &Dims,
        inputs: &AttnInputs<'a>,
        options: &'a AttnOptions,
        scan_v: bool,
    ) -> Result<Self> {
        let plan = prep.plan;
        let g = Geometry::new(plan, d);
        let (q, k, v) = (
            Src::new(&inputs.q)?,
            Src::new(&inputs.k)?,
            Src::new(&inputs.v)?,
        );
        // Only V needs the zero-skipping product: a non-finite logit (from Q or K) is either
        // masked (set to -inf, so P is exactly 0) or propagates through P as it must, and a
        // zero P times a finite V row is 0. Skipping the Q/K scans saves two full input reads.
        let exact = scan_v && !v.all_finite();
        Ok(FwdCtx {
            plan,
            d: *d,
            g,
            q,
            k,
            v,
            masks_t: &prep.data.masks_t,
            live: &prep.data.live,
            scale: options.scale_for(d.d_qk),
            softcap: options.softcap,
            sinks: options.sinks.as_deref(),
            exact,
            redo: !scan_v,
        })
    }

    /// A fresh per-worker workspace.
    pub(super) fn workspace(&self) -> FwdWs {
        FwdWs::new(&self.g, &self.d)
    }
}

/// Splits O, LSE and the per-item max logits into work items (batch, query head, q-tile) and runs
/// `work` on every item on the rayon pool (per head, longest first), each worker with its own
/// workspace from `make_ws`; assembles the outputs.
pub(super) fn run_with<W: std::any::Any + Send>(
    cx: &FwdCtx<'_>,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
    make_ws: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, FwdItem<'_>) + Sync,
) -> Result<()> {
    schedule(
        cx.plan,
        &cx.d,
        out,
        rest.items,
        &mut rest.bufs.maxes,
        make_ws,
        work,
        |it| it.prefetch(cx.plan, cx.q),
    )
}

/// The scheduling shared by every forward kernel: the caller's outputs split into one item per
/// (batch, query head, q tile), run head by head, longest first within a head, on the current
/// pool with per-worker workspaces from `pool` (`ahead` runs on each item one item before it,
/// for cache hints), max logits (per item in `maxes`) reduced per (batch, head) with NaN
/// propagated.
#[allow(clippy::too_many_arguments)]
pub(super) fn schedule<W: std::any::Any + Send>(
    plan: &Plan,
    d: &Dims,
    out: ForwardOut<'_>,
    pool: &WsPool,
    maxes: &mut Vec<f32>,
    make_ws: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, FwdItem<'_>) + Sync,
    ahead: impl Fn(&FwdItem<'_>) + Sync,
) -> Result<()> {
    let (bh, nqt) = (d.batch * d.heads_q, plan.q_tiles);
    let ForwardOut {
        mut o,
        lse,
        max_logit,
    } = out;
    let maxes = grown(maxes, bh * nqt);
    {
        let o_pieces = o.pieces(d.q_len * d.d_v, plan.tile.q * d.d_v);
        let l_pieces = f32_pieces(lse, d.q_len, plan.tile.q);
        let items: Vec<(Order, FwdItem<'_>)> = o_pieces
            .into_iter()
            .zip(l_pieces)
            .zip(maxes.iter_mut())
            .enumerate()
            .map(|(idx, ((o, lse), max_logit))| {
                let (b, h, qt) = (idx / (d.heads_q * nqt), (idx / nqt) % d.heads_q, idx % nqt);
                let cost = plan.head_plan(b, h).row(qt).len();
                (
                    Order {
                        group: idx / nqt,
                        cost,
                    },
                    FwdItem {
                        b,
                        h,
                        qt,
                        o,
                        lse,
                        max_logit,
                    },
                )
            })
            .collect();
        run_items(items, pool, make_ws, work, ahead);
    }
    for (m, c) in max_logit.iter_mut().zip(maxes.chunks(nqt)) {
        *m = c.iter().fold(NEG_INF, |a, &x| {
            if x.is_nan() || a.is_nan() {
                f32::NAN
            } else {
                a.max(x)
            }
        });
    }
    Ok(())
}

isa_entry!(entry, item, (cx: &FwdCtx<'_>, ws: &mut FwdWs, it: FwdItem<'_>));

/// One item with the plain product; redone with the zero-skipping one when its output holds a
/// non-finite value and V was not scanned. Same bits as a run with the zero-skipping product
/// throughout: the two differ only where a zero weight meets a non-finite V entry, which makes
/// the plain product's sum (and every later sum of that row: NaN and inf stay non-finite
/// through the rescales) non-finite; where no such entry is met, adding `0·v` changes nothing
/// (the accumulators start at +0 and are never -0).
#[inline(always)]
fn item<S: Simd>(cx: &FwdCtx<'_>, ws: &mut FwdWs, mut it: FwdItem<'_>) {
    let finite = item_with::<S, NoTelemetry>(cx, ws, &mut it, &mut NoTelemetry, cx.exact);
    if cx.redo && !finite {
        item_with::<S, NoTelemetry>(cx, ws, &mut it, &mut NoTelemetry, true);
    }
}

/// Runs item `it` (`exact`: with the zero-skipping product); returns whether every
/// accumulated output value was finite (checked only for `!exact`, else `true`).
#[inline(always)]
pub(super) fn item_with<S: Simd, T: TileObserver>(
    cx: &FwdCtx<'_>,
    ws: &mut FwdWs,
    it: &mut FwdItem<'_>,
    obs: &mut T,
    exact: bool,
) -> bool {
    let (plan, d, g) = (cx.plan, &cx.d, &cx.g);
    let (b, h) = (it.b, it.h);
    let kvh = h / d.group();
    let (q0, q1) = plan.q_range(it.qt);
    let nq = q1 - q0;
    let (mq, nqp) = (round_up(nq, RB), round_up(nq, 16));
    let (dqk, dv, dvp, tq) = (d.d_qk, d.d_v, g.dvp, g.tq);
    let FwdWs {
        qt,
        kbuf,
        vbuf,
        s,
        o,
        m,
        l,
        m_use,
        alpha,
        col,
        raw_max,
        tmp,
    } = ws;
    // bf16 storage widened on the AVX2 copy: P by the coarse exponentials
    // (`simd::softmax_exp_with`). The AVX-512 copies keep one (fine) instantiation, so their
    // f32 code stays as it was (bf16 runs on `vdpbf16ps` where they are fastest).
    let coarse = S::YMM && d.dtype == tessera_core::DType::BF16;
    let q_off = cx.q.row(b, h, q0);
    load_transposed::<S>(cx.q, q_off, nq, dqk, cx.scale, tmp, qt, tq);
    o[..mq * dvp].fill(0.0);
    m[..nq].fill(NEG_INF);
    l[..nq].fill(0.0);
    raw_max[..nq].fill(NEG_INF);

    let entries = plan.head_plan(b, h).row(it.qt);
    for (ei, e) in entries.iter().enumerate() {
        let (k0, k1) = plan.kv_range(e.tile as usize);
        let nk = k1 - k0;
        let mk = round_up(nk, RB);
        // Converted K and V rows (bf16, or f32 that cannot be read in place) are read by
        // `rows` in one burst, not streamed inside a product: request this tile's V rows and
        // the next tile's K rows into L2 now, so that those bursts hit (their misses were ~6 %
        // of a forced-AVX2 widened bf16 causal forward, perf). In-place rows get no hints.
        let v_off = cx.v.row(b, kvh, k0);
        if !in_place(cx.v, v_off, nk, dv) {
            prefetch_rows(cx.v, v_off, nk, dv);
        }
        if let Some(next) = entries.get(ei + 1) {
            let (n0, n1) = plan.kv_range(next.tile as usize);
            let k_off = cx.k.row(b, kvh, n0);
            if !in_place(cx.k, k_off, round_up(n1 - n0, RB), dqk) {
                prefetch_rows(cx.k, k_off, n1 - n0, dqk);
            }
        }
        let (ka, lda) = rows(cx.k, cx.k.row(b, kvh, k0), nk, mk, dqk, kbuf);
        let full = e.is_full();
        // Live query-column span of key row `j` (whole tile for full tiles; per 16-key block of
        // the partial mask otherwise, see `live_blocks`).
        let span = |j: usize| cx.live.row_span(full, e.mask, j, nq);
        // Full tiles without padding key rows get the column max fused into the product.
        let fused_max = full && mk == nk;
        // Partial tiles by row groups of RB (their live ranges per group, see `live_blocks`),
        // on the AVX2 copy by blocks of 16: its 3-row GEMM blocks run 4-row groups as 2 + 2,
        // which cost more than the skipped work saves (doc-causal +2 %, measured).
        let step = if S::YMM { SB } else { RB };
        // The AVX-512 and AVX2 copies without per-key hooks or softcap mask, maximise and
        // exponentiate 16 queries at a time (`column_softmax`); the others walk the tile key row
        // by key row.
        let by_column = cfg!(target_arch = "x86_64")
            && (S::WIDE || S::YMM)
            && !T::OBSERVES
            && cx.softcap.is_none();
        col[..nqp].fill(NEG_INF);
        if fused_max {
            gemm_colmax::<S>(mk, nqp, dqk, ka, lda, qt, tq, s, tq, &mut col[..nqp]);
        } else if full {
            gemm::<S, false, false>(mk, nqp, dqk, ka, lda, qt, tq, s, tq);
        } else {
            for (r0, r1, c0, c1) in cx.live.col_runs(e.mask, mk, step) {
                gemm::<S, false, false>(
                    r1 - r0,
                    c1 - c0,
                    dqk,
                    &ka[r0 * lda..],
                    lda,
                    &qt[c0..],
                    tq,
                    &mut s[r0 * tq + c0..],
                    tq,
                );
            }
            for j in (0..nk).filter(|_| !by_column) {
                let (a, b) = span(j);
                mask_partial_row(
                    &mut s[j * tq..j * tq + b],
                    cx.masks_t.row(e.mask, j),
                    a,
                    NEG_INF,
                );
            }
        }
        #[cfg(target_arch = "x86_64")]
        let tile = if full {
            column_softmax::TileLive::full(nq, nk)
        } else {
            column_softmax::TileLive::partial(nq, nk, cx.masks_t, cx.live, e.mask)
        };
        #[cfg(target_arch = "x86_64")]
        if by_column && !fused_max {
            // SAFETY: `S::WIDE` is only the AVX-512 copy, `S::YMM` the AVX2 copy, each run only
            // where the CPU has its features.
            unsafe { column_softmax::column_max::<S>(s, tq, tile, col) };
        }
        if !fused_max && !by_column {
            for j in 0..nk {
                let (a, b) = span(j);
                column_max(&s[j * tq..j * tq + b], &mut col[..b], a);
            }
        }
        for (r, &c) in raw_max[..nq].iter_mut().zip(col[..nq].iter()) {
            *r = if c > *r { c } else { *r };
        }
        if let Some(cap) = cx.softcap {
            col[..nq].fill(NEG_INF);
            for j in 0..nk {
                let (a, b) = span(j);
                simd::softcap_row::<S>(&mut s[j * tq + a..j * tq + b], cap);
                column_max(&s[j * tq..j * tq + b], &mut col[..b], a);
            }
        }
        online_softmax::update_max::<S>(
            &col[..nq],
            &mut m[..nq],
            &mut m_use[..nq],
            &mut alpha[..nq],
        );
        #[cfg(target_arch = "x86_64")]
        if by_column {
            // SAFETY: as above.
            unsafe {
                if coarse {
                    column_softmax::exp_columns::<S, true>(s, tq, tile, m_use, 1.0, col)
                } else {
                    column_softmax::exp_columns::<S, false>(s, tq, tile, m_use, 1.0, col)
                }
            };
        }
        let (mu, col) = (&m_use[..nq], &mut col[..nq]);
        if !by_column {
            col.fill(0.0);
        }
        for j in (0..nk).filter(|_| !by_column) {
            let (a, b) = span(j);
            let row = &mut s[j * tq..j * tq + nq];
            // Outside the live span every pair is masked: P is exactly 0 there.
            row[..a].fill(0.0);
            row[b..].fill(0.0);
            // P = e^(x − u) from the argument `x·B − u·B` in the copy's base, as the column
            // loops form it.
            let base = simd::exp_base::<S>();
            if let Some(acc) = obs.entropy_terms(a, b) {
                // Telemetry copy only (see `TileObserver::entropy_terms`); P exactly as below.
                let lanes = row[a..b]
                    .iter_mut()
                    .zip(&mu[a..b])
                    .zip(col[a..b].iter_mut());
                for (((x, &u), c), e) in lanes.zip(acc.iter_mut()) {
                    let d = *x - u;
                    let p = simd::softmax_exp_with::<S>(S::madd(*x, base, -(u * base)), coarse);
                    *x = p;
                    *c += p;
                    *e += p * if d > -88.0 { d } else { -88.0 };
                }
            } else {
                for ((x, &u), c) in row[a..b]
                    .iter_mut()
                    .zip(&mu[a..b])
                    .zip(col[a..b].iter_mut())
                {
                    let p = simd::softmax_exp_with::<S>(S::madd(*x, base, -(u * base)), coarse);
                    *x = p;
                    *c += p;
                }
            }
            obs.after_exp(k0 + j, a, &row[a..b]);
        }
        for i in 0..nq {
            l[i] = l[i] * alpha[i] + col[i];
        }
        for i in (0..nq).filter(|&i| alpha[i] != 1.0) {
            simd::scale_row(&mut o[i * dvp..i * dvp + dv], alpha[i]);
        }
        obs.on_tile(col, mu, &alpha[..nq]);
        let (vb, ldv) = rows(cx.v, v_off, nk, nk, dv, vbuf);
        if full {
            product::<S, true, true>(exact, mq, dvp, nk, s, tq, vb, ldv, o, dvp);
        } else {
            for i0 in (0..mq).step_by(step) {
                let (r0, r1) = cx.live.keys_of(e.mask, i0, step);
                if r0 < r1 {
                    product::<S, true, true>(
                        exact,
                        (i0 + step).min(mq) - i0,
                        dvp,
                        r1 - r0,
                        &s[r0 * tq + i0..],
                        tq,
                        &vb[r0 * ldv..],
                        ldv,
                        &mut o[i0 * dvp..],
                        dvp,
                    );
                }
            }
        }
    }

    let sink = cx.sinks.map(|x| x[h] as f64);
    let mut any_nan = false;
    // Bit 0 set: some accumulated output value is non-finite (exponent all ones).
    let mut bad = 0u32;
    for i in 0..nq {
        let orow = &mut o[i * dvp..i * dvp + dv];
        if !exact {
            bad |= orow.iter().fold(0, |a, v| {
                a | u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
            });
        }
        let (factor, lse) = finish_row::<S>(l[i], m_use[i], sink, orow);
        it.o.store(i * dv, orow, factor as f32);
        it.lse[i] = lse as f32;
        any_nan |= lse.is_nan();
        obs.on_row(i, lse);
    }
    *it.max_logit = if any_nan {
        f32::NAN
    } else {
        simd::max_row(&raw_max[..nq])
    };
    bad == 0
}
