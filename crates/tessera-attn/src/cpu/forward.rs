//! Forward kernel: one work item per (batch, query head, q-tile).
//!
//! Per item the scaled Q tile is packed transposed once (`Qsᵀ`, `[Dqk × tq]`); for every kv tile
//! of the item's forward work-list row the kernel computes `Sᵀ = K_tile · Qsᵀ` (`[tk × tq]`, so
//! every softmax loop runs contiguous over the tile's queries with no per-tile transpose), applies
//! the partial bitmask (partial tiles only), the softcap, the online-softmax update (running max,
//! rescale of the O rows, exponentials, column sums), then accumulates `O += P·V` with O rows
//! contiguous over Dv. The item finishes with the sink, the normalisation, LSE and the item's
//! pre-softcap max logit.

use super::gemm::{gemm, product, round_up, RB};
use super::math::{self, Simd};
use super::{
    f32_pieces, isa_entry, load_transposed, row_off, rows, run_items, Geometry, Isa, MasksT, Out,
    OutBuf, Src,
};
use crate::{AttnOptions, Dims, ForwardOutput};
use tessera_core::tensor::TensorView;
use tessera_core::{Result, Tensor};
use tessera_plan::Plan;

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Compile-time hook into the forward kernel. The production kernel uses [`NoTelemetry`] (every
/// hook is an empty inline function, so it compiles to nothing); a telemetry variant (per-row sink
/// mass, entropy) implements the hooks and is instantiated as a separate kernel copy.
pub(crate) trait TileObserver: Default {
    /// After the exponentials of one kv tile: `p_t[j * ld + i]` (`j < nk`, `i < nq`) holds
    /// `exp(s_ij - m_use[i])` for key `kv0 + j`, and the item's running sums were rescaled by `alpha`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn on_tile(
        &mut self,
        _kv0: usize,
        _p_t: &[f32],
        _ld: usize,
        _nk: usize,
        _nq: usize,
        _m_use: &[f32],
        _alpha: &[f32],
    ) {
    }

    /// After row `i` of the item is final.
    #[inline(always)]
    fn on_row(&mut self, _i: usize, _lse: f32) {}
}

/// The production forward kernel: no telemetry work at all.
#[derive(Default)]
pub(crate) struct NoTelemetry;
impl TileObserver for NoTelemetry {}

pub(crate) struct FwdCtx<'a> {
    plan: &'a Plan,
    d: Dims,
    g: Geometry,
    q: Src<'a>,
    k: Src<'a>,
    v: Src<'a>,
    masks_t: MasksT,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&'a [f32]>,
    /// Some input is non-finite: use the zero-skipping product so masked pairs stay exact.
    exact: bool,
}

pub(crate) struct FwdItem<'a> {
    b: usize,
    h: usize,
    qt: usize,
    o: Out<'a>,
    lse: &'a mut [f32],
    max_logit: &'a mut f32,
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
    d: &Dims,
    q: TensorView<'_>,
    k: TensorView<'_>,
    v: TensorView<'_>,
    plan: &Plan,
    options: &AttnOptions,
) -> Result<ForwardOutput> {
    let g = Geometry::new(plan, d);
    let (q, k, v) = (Src::new(&q)?, Src::new(&k)?, Src::new(&v)?);
    let exact = !(q.all_finite() && k.all_finite() && v.all_finite());
    let cx = FwdCtx {
        plan,
        d: *d,
        g,
        q,
        k,
        v,
        masks_t: MasksT::new(plan),
        scale: options.scale_for(d.d_qk),
        softcap: options.softcap,
        sinks: options.sinks.as_deref(),
        exact,
    };
    let (bh, nqt) = (d.batch * d.heads_q, plan.q_tiles);
    let mut o = OutBuf::poisoned(d.dtype, bh * d.q_len * d.d_v);
    let mut lse = vec![f32::NAN; bh * d.q_len];
    let mut maxes = vec![f32::NAN; bh * nqt];
    {
        let o_pieces = o.pieces(d.q_len * d.d_v, plan.tile.q * d.d_v);
        let l_pieces = f32_pieces(&mut lse, d.q_len, plan.tile.q);
        let items: Vec<(usize, FwdItem<'_>)> = o_pieces
            .into_iter()
            .zip(l_pieces)
            .zip(maxes.iter_mut())
            .enumerate()
            .map(|(idx, ((o, lse), max_logit))| {
                let (b, h, qt) = (idx / (d.heads_q * nqt), (idx / nqt) % d.heads_q, idx % nqt);
                let cost = plan.head_plan(b, h).row(qt).len();
                (
                    cost,
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
        run_items(
            items,
            || FwdWs::new(&g, d),
            |ws, it| entry(isa, &cx, ws, it),
        );
    }
    let max_logit: Vec<f32> = maxes
        .chunks(nqt)
        .map(|c| {
            c.iter().fold(NEG_INF, |a, &x| {
                if x.is_nan() || a.is_nan() {
                    f32::NAN
                } else {
                    a.max(x)
                }
            })
        })
        .collect();
    Ok(ForwardOutput {
        o: o.into_tensor(vec![d.batch, d.heads_q, d.q_len, d.d_v])?,
        lse: Tensor::from_f32(vec![d.batch, d.heads_q, d.q_len], lse)?,
        max_logit: Tensor::from_f32(vec![d.batch, d.heads_q], max_logit)?,
    })
}

isa_entry!(entry, item, (cx: &FwdCtx<'_>, ws: &mut FwdWs, it: FwdItem<'_>));

#[inline(always)]
fn item<S: Simd>(cx: &FwdCtx<'_>, ws: &mut FwdWs, it: FwdItem<'_>) {
    item_with::<S, NoTelemetry>(cx, ws, it)
}

#[inline(always)]
fn item_with<S: Simd, T: TileObserver>(cx: &FwdCtx<'_>, ws: &mut FwdWs, mut it: FwdItem<'_>) {
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
    let q_off = row_off(b, h, q0, d.heads_q, d.q_len, dqk);
    load_transposed(cx.q, q_off, nq, dqk, cx.scale, tmp, qt, tq);
    o[..mq * dvp].fill(0.0);
    m[..nq].fill(NEG_INF);
    l[..nq].fill(0.0);
    raw_max[..nq].fill(NEG_INF);
    let mut obs = T::default();

    for e in plan.head_plan(b, h).row(it.qt) {
        let (k0, k1) = plan.kv_range(e.tile as usize);
        let nk = k1 - k0;
        let mk = round_up(nk, RB);
        let (ka, lda) = rows(
            cx.k,
            row_off(b, kvh, k0, d.heads_kv, d.kv_len, dqk),
            nk,
            mk,
            dqk,
            kbuf,
        );
        gemm::<S, false, false>(mk, nqp, dqk, ka, lda, qt, tq, s, tq);

        if !e.is_full() {
            for j in 0..nk {
                math::mask_row(
                    &mut s[j * tq..j * tq + nq],
                    cx.masks_t.row(e.mask, j),
                    NEG_INF,
                );
            }
        }
        let col = &mut col[..nq];
        col_max(s, tq, nk, col);
        for (r, &c) in raw_max[..nq].iter_mut().zip(col.iter()) {
            *r = if c > *r { c } else { *r };
        }
        if let Some(cap) = cx.softcap {
            for j in 0..nk {
                math::softcap_row::<S>(&mut s[j * tq..j * tq + nq], cap);
            }
            col_max(s, tq, nk, col);
        }
        for i in 0..nq {
            let m_old = m[i];
            let m_new = if col[i] > m_old { col[i] } else { m_old };
            // A row with nothing allowed yet keeps -inf as its max but exponentiates against 0,
            // so masked logits give exactly 0 and NaN logits stay NaN.
            let u = if m_new == NEG_INF { 0.0 } else { m_new };
            m_use[i] = u;
            alpha[i] = if m_old == u {
                1.0
            } else {
                math::exp::<S>(m_old - u)
            };
            m[i] = m_new;
        }
        col.fill(0.0);
        let mu = &m_use[..nq];
        for j in 0..nk {
            let row = &mut s[j * tq..j * tq + nq];
            for ((x, &u), c) in row.iter_mut().zip(mu).zip(col.iter_mut()) {
                let p = math::exp::<S>(*x - u);
                *x = p;
                *c += p;
            }
        }
        for i in 0..nq {
            l[i] = l[i] * alpha[i] + col[i];
            if alpha[i] != 1.0 {
                math::scale_row(&mut o[i * dvp..i * dvp + dv], alpha[i]);
            }
        }
        obs.on_tile(k0, s, tq, nk, nq, mu, &alpha[..nq]);
        let (vb, ldv) = rows(
            cx.v,
            row_off(b, kvh, k0, d.heads_kv, d.kv_len, dv),
            nk,
            nk,
            dv,
            vbuf,
        );
        product::<S, true, true>(cx.exact, mq, dvp, nk, s, tq, vb, ldv, o, dvp);
    }

    let sink = cx.sinks.map(|x| x[h] as f64);
    let mut any_nan = false;
    for i in 0..nq {
        let (li, mi) = (l[i] as f64, m[i] as f64);
        let orow = &mut o[i * dvp..i * dvp + dv];
        let (factor, lse) = if li == 0.0 {
            // No allowed key: O = 0, LSE = log(exp(σ)) = σ, or -inf without a sink.
            orow.fill(0.0);
            (0.0, sink.unwrap_or(f64::NEG_INFINITY))
        } else {
            let a = mi + li.ln();
            match sink {
                None => (1.0 / li, a),
                Some(sg) => {
                    let hi = a.max(sg);
                    let lse = hi + ((a - hi).exp() + (sg - hi).exp()).ln();
                    ((mi - lse).exp(), lse)
                }
            }
        };
        it.o.store(i * dv, orow, factor as f32);
        it.lse[i] = lse as f32;
        any_nan |= lse.is_nan();
        obs.on_row(i, lse as f32);
    }
    *it.max_logit = if any_nan {
        f32::NAN
    } else {
        math::max_row(&raw_max[..nq])
    };
}

/// `col[i] = max_j s[j * ld + i]` over `j < nk` (NaN ignored), vectorized over `i`.
#[inline(always)]
fn col_max(s: &[f32], ld: usize, nk: usize, col: &mut [f32]) {
    let n = col.len();
    col.fill(NEG_INF);
    for j in 0..nk {
        for (c, &x) in col.iter_mut().zip(&s[j * ld..j * ld + n]) {
            *c = if x > *c { x } else { *c };
        }
    }
}
