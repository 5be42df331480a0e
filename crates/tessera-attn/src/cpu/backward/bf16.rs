//! The dK/dV/dQ-slot item on AVX512-BF16 (`vdpbf16ps`), used by [`Isa::Avx512Bf16`] and
//! [`Isa::Avx512Amx`] when Q, K, V and dO are bf16 and every input is finite (the f32 item with
//! exact zero-skipping products runs otherwise). Same walk, slots and reduction as the f32 item
//! of the parent module; only the five tile products change.
//!
//! Layout (bf16 pairs as `u32`, see [`super::super::tile_matmul_bf16`]):
//! - per visited q tile, zero-padded to `tq` queries: Q and dO with pairs along D
//!   (`[tq × ⌈D/2⌉]`, the A side of `S = Q·Kᵀ`, `dP = dO·Vᵀ`; read in place, the rows' own
//!   32-bit words, when every row starts on a word and every tile's rows are whole register
//!   blocks) and with pairs of consecutive queries (`[tq/2 × Dp]`, the B side of
//!   `dK += dSᵀ·Q`, `dV += Pᵀ·dO`); re-packing per visit costs ~1/64 of the visit's products,
//!   while packing all of Q and dO once per call meant 32 MB of fresh pages per 8K call
//!   (measured slower on sparse masks);
//! - once per item (kv tile): K and V with pairs along D, keys contiguous (`[⌈D/2⌉ × tk]`, by
//!   16 × 16 word transposes, masked gathers for the rest), and K with pairs of consecutive keys
//!   (`[tk/2 × Dqkp]`, the B side of `dS·K`);
//! - per active tile: `S` and `dP` in f32 (the scale is applied in the elementwise pass, not to a
//!   bf16 K), then `P` and `dS` rounded to bf16 pairs along the queries (for `dV`, `dK`) and `dS`
//!   along the keys (for the dQ slot), in one pass from `S`, `dP` (a partial tile's mask as lane
//!   masks) except under a softcap.
//!
//! On [`Isa::Avx512Amx`] a full tile's five products run on AMX tiles (`super::super::amx`) where
//! the padded inner dimension allows (see `Amx`; 16-query row blocks, a last 4, 8 or 12 rows on
//! `vdpbf16ps`): `dV += Pᵀ·dO` and `dK += dSᵀ·Q` from P and dS transposed to keys by query
//! pairs (the tile unit reads A by rows); partial tiles keep the per-block spans on
//! `vdpbf16ps`. Same P and dS: the gradients differ only by summation order.
//!
//! Accuracy: products of bf16 values are exact in f32 and accumulate in f32; rounding P and dS to
//! bf16 adds ≤ 2⁻⁹ relative error per term (FlashAttention rounds them the same way), well inside
//! the 1e-2 bf16 tolerance. Deterministic: fixed loop order, no atomics.

use super::super::amx;
use super::super::isa::Isa;
use super::super::load_tile::transpose16_words;
use super::super::schedule::Geometry;
use super::super::simd::Avx512;
use super::super::simd::{self, x512::exp2_coarse_in};
use super::super::tile_matmul::{round_up, RB};
use super::super::tile_matmul_bf16::{dot_gemm, dot_gemm_tiles, pair, tiles_acc_transposed};
use super::tiles::{
    key_blocks, p_ds_block, p_ds_full, query_blocks, store_dkv, BwdCtx, DkvItem, BF16_P_CAP2,
};
use crate::validate::Dims;
use half::bf16;
use std::arch::x86_64::*;
use tessera_plan::PartialMasks;

/// The bf16 inputs of a backward call (storage and layout).
pub(crate) struct Inputs<'a> {
    q: &'a [bf16],
    k: &'a [bf16],
    v: &'a [bf16],
    d_o: &'a [bf16],
    /// Q and dO as their own 32-bit words (pairs along D) and the row stride in words, when
    /// their layout lets the products read them in place (see [`in_place`]).
    q_words: Option<(&'a [u32], usize)>,
    do_words: Option<(&'a [u32], usize)>,
    /// The tile unit of full tiles' products ([`Isa::Avx512Amx`], see [`Amx`]), else `None`.
    amx: Option<Amx>,
    /// Words per row of packed Q and dO (pairs along D): `⌈D/2⌉`, padded with zero pairs to a
    /// multiple of 16 on AMX (a tile reads 16 pairs; the K and V packs' extra pair rows are
    /// zero, so the padding adds nothing).
    q_ld: usize,
    do_ld: usize,
}

/// Which of a full tile's products run on AMX tiles: `S` and `dP` always (pairs along D padded
/// in the packs); `dV`, `dK` and the dQ slot where their inner dimension, padded to a multiple of
/// 16 pairs, fits the buffers (pairs of queries, `tq / 2`; pairs of keys, `tk / 2`).
#[derive(Clone, Copy)]
struct Amx {
    unit: amx::Kind,
    dkv: bool,
    dq: bool,
}

/// `x` as 32-bit words when every row of `src` starts on a word (storage aligned, even
/// strides), `dim` is even (a row is whole pairs) and `rows_whole` (every tile's product rows,
/// a multiple of `RB`, are real rows: nothing past the tensor is read).
fn in_place<'a>(
    x: &'a [bf16],
    src: &super::super::load_tile::Src<'_>,
    dim: usize,
    rows_whole: bool,
) -> Option<(&'a [u32], usize)> {
    // SAFETY: u16-backed bf16 and u32 are plain integers; `align_to` only yields the aligned
    // middle part.
    let (pre, words, _) = unsafe { x.align_to::<u32>() };
    (pre.is_empty() && dim.is_multiple_of(2) && src.strides_even() && rows_whole)
        .then_some((words, src.ld() / 2))
}

/// Row strides up to this many elements keep a kv tile's gather offsets inside `i32`.
const MAX_GATHER_STRIDE: usize = (1 << 30) / 256;

/// `x` as a bf16 bit pattern.
#[inline(always)]
fn bits(x: &bf16) -> u16 {
    x.to_bits()
}

/// Packs `n` rows (`sl` elements apart, from element `off`) of a bf16 input into `dpk` (pairs along D,
/// `[tq × dld]`, `dld >= ⌈dim/2⌉`) and `qpk` (pairs of consecutive rows, `[tq/2 × ld]`), zero padded.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
fn pack_rows(
    x: &[bf16],
    off: usize,
    sl: usize,
    n: usize,
    dim: usize,
    ld: usize,
    (dpk, dld): (&mut [u32], usize),
    qpk: &mut [u32],
) {
    let dh = dim.div_ceil(2);
    for (r, row) in dpk.chunks_exact_mut(dld).enumerate() {
        let (dst, pad) = row.split_at_mut(dh);
        pad.fill(0);
        if r >= n {
            dst.fill(0);
            continue;
        }
        let row = &x[off + r * sl..off + r * sl + dim];
        // Pairs along D are the row's own bytes (x86-64 is little-endian): a straight copy,
        // 32 elements per step (a `memcpy` call per 128-byte row measured no faster).
        let whole = 2 * (dim / 2);
        for c in (0..whole).step_by(32) {
            let m = lanes32(whole - c);
            // SAFETY: lanes `< left` lie inside `row` and, as `left / 2` words, inside `dst`;
            // masked-off lanes are neither read nor written. The caller runs with AVX-512BW.
            unsafe {
                let v = _mm512_maskz_loadu_epi16(m, row.as_ptr().add(c).cast());
                _mm512_mask_storeu_epi16(dst.as_mut_ptr().add(c / 2).cast(), m, v);
            }
        }
        if dim % 2 == 1 {
            dst[dh - 1] = pair(bits(&row[dim - 1]), 0);
        }
    }
    pack_row_pairs_x512(x, off, sl, n, dim, ld, qpk);
}

/// [`pack_row_pairs`] in AVX-512BW, 32 columns per step: two rows' bf16 interleaved by
/// `vpermt2w` (the same words).
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_row_pairs_x512(
    x: &[bf16],
    off: usize,
    sl: usize,
    n: usize,
    dim: usize,
    ld: usize,
    out: &mut [u32],
) {
    assert!(dim <= ld && (n == 0 || off + (n - 1) * sl + dim <= x.len()));
    // Word w of the low half takes element w of row a (u16 index w) and of row b (32 + w);
    // the high half elements 16 + w.
    let lo: [u16; 32] = std::array::from_fn(|i| (i / 2 + 32 * (i % 2)) as u16);
    let hi: [u16; 32] = std::array::from_fn(|i| (16 + i / 2 + 32 * (i % 2)) as u16);
    // SAFETY: both arrays are 64 bytes.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_si512(lo.as_ptr().cast()),
            _mm512_loadu_si512(hi.as_ptr().cast()),
        )
    };
    for (rp, dst) in out.chunks_exact_mut(ld).enumerate() {
        let (r0, r1) = (2 * rp, 2 * rp + 1);
        let (cols, pad) = dst.split_at_mut(dim);
        pad.fill(0);
        if r0 >= n {
            cols.fill(0);
            continue;
        }
        let (pa, pb) = (
            x.as_ptr().wrapping_add(off + r0 * sl),
            x.as_ptr().wrapping_add(off + r1 * sl),
        );
        for c in (0..dim).step_by(32) {
            let (left, m) = (dim - c, lanes32(dim - c));
            // SAFETY: lanes `< left` of rows `r0 < n` (and `r1` only when `< n`) lie inside `x`
            // (asserted above); masked-off lanes are not read. The stores write words
            // `c..c + min(left, 32)` of `cols`.
            unsafe {
                let a = _mm512_maskz_loadu_epi16(m, pa.add(c).cast());
                let b = if r1 < n {
                    _mm512_maskz_loadu_epi16(m, pb.add(c).cast())
                } else {
                    _mm512_setzero_si512()
                };
                let w0 = _mm512_permutex2var_epi16(a, lo, b);
                let w1 = _mm512_permutex2var_epi16(a, hi, b);
                let d = cols.as_mut_ptr().add(c);
                _mm512_mask_storeu_epi32(d.cast(), (m & 0xFFFF) as __mmask16, w0);
                if left > 16 {
                    _mm512_mask_storeu_epi32(d.add(16).cast(), (m >> 16) as __mmask16, w1);
                }
            }
        }
    }
}

/// The mask of the first `min(left, 32)` 16-bit lanes.
#[inline(always)]
fn lanes32(left: usize) -> __mmask32 {
    if left >= 32 {
        u32::MAX
    } else {
        (1u32 << left) - 1
    }
}

/// `out[(r/2)·ld + c]` = bf16 pair (row `r`, row `r + 1`) of column `c`, for the rows `[0, n)` of
/// an input starting at `off` (rows `sl` elements apart), over all `out.len() / ld` pair rows; columns
/// `dim..ld` and rows from `n` on are zero. Each pair row is written once (no fill first). The
/// element-wise reference of [`pack_row_pairs_x512`], which the kernels use.
#[cfg(test)]
fn pack_row_pairs(
    x: &[bf16],
    off: usize,
    sl: usize,
    n: usize,
    dim: usize,
    ld: usize,
    out: &mut [u32],
) {
    for (rp, dst) in out.chunks_exact_mut(ld).enumerate() {
        let (r0, r1) = (2 * rp, 2 * rp + 1);
        let (cols, pad) = dst.split_at_mut(dim);
        if r1 < n {
            let a = &x[off + r0 * sl..off + r0 * sl + dim];
            let b = &x[off + r1 * sl..off + r1 * sl + dim];
            for ((o, p), q) in cols.iter_mut().zip(a).zip(b) {
                *o = pair(bits(p), bits(q));
            }
        } else if r0 < n {
            let a = &x[off + r0 * sl..off + r0 * sl + dim];
            for (o, p) in cols.iter_mut().zip(a) {
                *o = bits(p) as u32;
            }
        } else {
            cols.fill(0);
        }
        pad.fill(0);
    }
}

impl<'a> Inputs<'a> {
    /// The inputs when the kernel copy is [`Isa::Avx512Bf16`] or [`Isa::Avx512Amx`] (whose
    /// backward is this one) and Q, K, V and dO are all bf16; `None` otherwise (so holding an
    /// `Inputs` proves the CPU has AVX512-BF16).
    pub(crate) fn new(isa: Isa, cx: &BwdCtx<'a>) -> Option<Self> {
        if !matches!(isa, Isa::Avx512Bf16 | Isa::Avx512Amx) {
            return None;
        }
        // Gather offsets of a kv tile (< 256 keys) must fit i32: larger strides (never seen
        // in practice) take the f32 item.
        if cx.k.ld().max(cx.v.ld()) > MAX_GATHER_STRIDE || cx.plan.tile.kv > 256 {
            return None;
        }
        let (q, d_o) = (cx.q.bf16()?, cx.d_o.bf16()?);
        let rows_whole = cx.plan.tile.q.is_multiple_of(RB) && cx.d.q_len.is_multiple_of(RB);
        let (g, tw) = (&cx.g, amx::TW);
        let amx = (isa == Isa::Avx512Amx)
            .then(amx::unit)
            .flatten()
            .map(|unit| Amx {
                unit,
                dkv: g.tq.is_multiple_of(2 * tw),
                dq: g.tk.is_multiple_of(2 * tw),
            });
        let (qh, vh) = (cx.d.d_qk.div_ceil(2), cx.d.d_v.div_ceil(2));
        let padded = |h: usize| if amx.is_some() { round_up(h, tw) } else { h };
        // In place only where no padding is needed (a tile would read past a row's pairs).
        let words = |x, src, dim: usize| {
            in_place(x, src, dim, rows_whole).filter(|_| padded(dim.div_ceil(2)) == dim.div_ceil(2))
        };
        Some(Inputs {
            q,
            k: cx.k.bf16()?,
            v: cx.v.bf16()?,
            d_o,
            q_words: words(q, &cx.q, cx.d.d_qk),
            do_words: words(d_o, &cx.d_o, cx.d.d_v),
            amx,
            q_ld: padded(qh),
            do_ld: padded(vh),
        })
    }
}

/// Per-thread workspace of the bf16 item.
pub(crate) struct Ws {
    /// K, V pairs along D, keys contiguous: `[⌈D/2⌉ × tk]` (pair rows to a multiple of 16, the
    /// extra ones zero).
    kt: Vec<u32>,
    vt: Vec<u32>,
    /// K pairs of consecutive keys: `[tk/2 × Dqkp]`.
    kk: Vec<u32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    /// P and dS pairs of consecutive queries: `[tq/2 × tk]`.
    pq: Vec<u32>,
    dsq: Vec<u32>,
    /// dS pairs of consecutive keys: `[tq × tk/2]`.
    dsk: Vec<u32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    /// Q and dO of the current q tile, pairs along D (`[tq × ⌈D/2⌉]`) and pairs of consecutive
    /// queries (`[tq/2 × Dp]`), zero padded.
    qd: Vec<u32>,
    qq: Vec<u32>,
    dod: Vec<u32>,
    doq: Vec<u32>,
    /// `pq` and `dsq` transposed (`[tk × tq/2]`: keys by query pairs), the A operands of the
    /// AMX `dV` and `dK` products.
    pqt: Vec<u32>,
    dsqt: Vec<u32>,
}

/// Words (`u32` or f32) of one [`Ws`].
pub(crate) fn ws_words(g: &Geometry, d: &Dims) -> usize {
    let (tq, tk) = (g.tq, g.tk);
    let (dh, vh) = (
        round_up(d.d_qk.div_ceil(2), 16),
        round_up(d.d_v.div_ceil(2), 16),
    );
    (dh + vh) * tk
        + tk / 2 * g.dqkp
        + 2 * tq * tk
        + 3 * (tq / 2 * tk)
        + tk * (g.dqkp + g.dvp)
        + tq * (dh + vh)
        + tq / 2 * (g.dqkp + g.dvp)
        + 2 * (tk * tq / 2)
}

impl Ws {
    pub(crate) fn new(g: &Geometry, d: &Dims) -> Self {
        let (tq, tk) = (g.tq, g.tk);
        // Pairs along D padded to a multiple of 16 (what AMX tiles read; the extra pair rows of
        // the K/V packs stay zero, never written).
        let (dhp, vhp) = (
            round_up(d.d_qk.div_ceil(2), 16),
            round_up(d.d_v.div_ceil(2), 16),
        );
        Ws {
            kt: vec![0; dhp * tk],
            vt: vec![0; vhp * tk],
            kk: vec![0; tk / 2 * g.dqkp],
            s: vec![0.0; tq * tk],
            dp: vec![0.0; tq * tk],
            pq: vec![0; tq / 2 * tk],
            dsq: vec![0; tq / 2 * tk],
            dsk: vec![0; tq * tk / 2],
            dk: vec![0.0; tk * g.dqkp],
            dv: vec![0.0; tk * g.dvp],
            qd: vec![0; tq * dhp],
            qq: vec![0; tq / 2 * g.dqkp],
            dod: vec![0; tq * vhp],
            doq: vec![0; tq / 2 * g.dvp],
            pqt: vec![0; tk * tq / 2],
            dsqt: vec![0; tk * tq / 2],
        }
    }
}

/// Runs one dK/dV/dQ-slot item on the `vdpbf16ps` kernel.
pub(crate) fn entry(cx: &BwdCtx<'_>, inp: &Inputs<'_>, ws: &mut Ws, it: DkvItem<'_>) {
    // SAFETY: an `Inputs` exists only for `Isa::Avx512Bf16`, which is handed out only when the
    // CPU has AVX-512F/BW/VL, FMA and AVX512-BF16.
    unsafe { item(cx, inp, ws, it) }
}

/// Packs the K (or V) rows of a kv tile: `t[dp·tk + j]` pairs along D (columns `nk..nkp` zero)
/// and, when `kk` is given, `kk[(j/2)·ld + x]` pairs of consecutive keys (zero padded).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_kv(
    x: &[bf16],
    off: usize,
    sl: usize,
    nk: usize,
    dim: usize,
    tk: usize,
    t: &mut [u32],
    kk: Option<(&mut [u32], usize)>,
) {
    let dh = dim.div_ceil(2);
    let nkp = round_up(nk, 16);
    // Whole pairs (both halves inside the row).
    let whole = dim / 2;
    assert!(nk > 0 && off + (nk - 1) * sl + dim <= x.len() && (dh - 1) * tk + nkp <= t.len());
    assert!(nk * sl < 1 << 30);
    let base = x.as_ptr().wrapping_add(off).cast::<i32>();
    // With an even row stride a pair is a 32-bit word of its row at a fixed word stride, so
    // whole 16-key × 16-pair blocks move by register transposes (measured: the gathers cost
    // ~27k ticks per 128-key K+V item on Zen 4); the rest goes by gathers.
    let (rows16, pairs16) = if sl.is_multiple_of(2) {
        (nk / 16 * 16, whole / 16 * 16)
    } else {
        (0, 0)
    };
    for j0 in (0..rows16).step_by(16) {
        for dp0 in (0..pairs16).step_by(16) {
            // SAFETY: rows `j0..j0 + 16 <= nk`, words `dp0..dp0 + 16 <= dim / 2` of each lie
            // inside `x` (asserted above; unaligned loads), and their places `dp·tk + j` inside
            // `t`; AVX-512F is part of this function's features.
            unsafe {
                transpose16_words(
                    base.add(j0 * sl / 2 + dp0).cast(),
                    sl / 2,
                    t.as_mut_ptr().add(dp0 * tk + j0),
                    tk,
                )
            };
        }
    }
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for j0 in (0..nkp).step_by(16) {
        let live = nk.saturating_sub(j0).min(16);
        let mask: __mmask16 = ((1u32 << live) - 1) as u16;
        // Element offsets (in bf16 units) of key j0 + l, pair 0.
        let rows = _mm512_mullo_epi32(
            _mm512_add_epi32(lanes, _mm512_set1_epi32(j0 as i32)),
            _mm512_set1_epi32(sl as i32),
        );
        let done = if j0 < rows16 { pairs16 } else { 0 };
        for dp in done..whole {
            let idx = _mm512_add_epi32(rows, _mm512_set1_epi32(2 * dp as i32));
            // SAFETY: masked-off lanes are not read; live lanes read elements 2dp, 2dp + 1 of
            // rows `< nk`, inside `x` by the assert above.
            let v = unsafe {
                _mm512_mask_i32gather_epi32::<2>(_mm512_setzero_si512(), mask, idx, base)
            };
            // SAFETY: `dp·tk + j0 + 16 <= (dh − 1)·tk + nkp <= t.len()` (asserted).
            unsafe { _mm512_storeu_si512(t.as_mut_ptr().add(dp * tk + j0).cast(), v) };
        }
    }
    if dim % 2 == 1 {
        // The last pair has one element: read it alone (a 4-byte read would pass the row end).
        let last = &mut t[(dh - 1) * tk..(dh - 1) * tk + nkp];
        for (j, o) in last.iter_mut().enumerate() {
            *o = if j < nk {
                bits(&x[off + j * sl + dim - 1]) as u32
            } else {
                0
            };
        }
    }
    if let Some((kk, ld)) = kk {
        pack_row_pairs_x512(x, off, sl, nk, dim, ld, kk);
    }
}

/// Rounds rows `i0..i0+m` (`i0`, `m` even) of `P` (in `s`) and `dS` (in `dp`), columns `0..n`
/// (`n` a multiple of 16), to bf16 pairs: `pq`, `dsq` pairs of consecutive queries, `dsk` pairs
/// of consecutive keys.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn round_pairs(
    s: &[f32],
    dp: &[f32],
    tk: usize,
    i0: usize,
    m: usize,
    n: usize,
    pq: &mut [u32],
    dsq: &mut [u32],
    dsk: &mut [u32],
) {
    assert!(i0.is_multiple_of(2) && m.is_multiple_of(2) && n.is_multiple_of(16) && n <= tk);
    assert!((i0 + m) * tk <= s.len() && (i0 + m) * tk <= dp.len());
    assert!((i0 + m) / 2 * tk <= pq.len() && (i0 + m) / 2 * tk <= dsq.len());
    assert!((i0 + m) * tk / 2 <= dsk.len());
    // 16-bit lane 2x takes lane x (row i), lane 2x+1 takes lane 16+x (row i+1).
    let mut idx = [0i16; 32];
    for x in 0..16 {
        idx[2 * x] = x as i16;
        idx[2 * x + 1] = 16 + x as i16;
    }
    // SAFETY: the asserts above bound every access; `idx` is 64 bytes.
    unsafe {
        let perm = _mm512_loadu_si512(idx.as_ptr().cast());
        let (sp, dpp) = (s.as_ptr(), dp.as_ptr());
        for i in (i0..i0 + m).step_by(2) {
            let (r0, r1) = (i * tk, (i + 1) * tk);
            let o = i / 2 * tk;
            for j in (0..n).step_by(16) {
                let p = _mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(sp.add(r1 + j)),
                    _mm512_loadu_ps(sp.add(r0 + j)),
                );
                let p = _mm512_permutexvar_epi16(perm, std::mem::transmute::<__m512bh, __m512i>(p));
                _mm512_storeu_si512(pq.as_mut_ptr().add(o + j).cast(), p);
                let d = _mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(dpp.add(r1 + j)),
                    _mm512_loadu_ps(dpp.add(r0 + j)),
                );
                let d = _mm512_permutexvar_epi16(perm, std::mem::transmute::<__m512bh, __m512i>(d));
                _mm512_storeu_si512(dsq.as_mut_ptr().add(o + j).cast(), d);
            }
            for r in [i, i + 1] {
                let (row, out) = (dpp.add(r * tk), dsk.as_mut_ptr().add(r * tk / 2));
                let mut j = 0;
                while j + 32 <= n {
                    let d = _mm512_cvtne2ps_pbh(
                        _mm512_loadu_ps(row.add(j + 16)),
                        _mm512_loadu_ps(row.add(j)),
                    );
                    _mm512_storeu_si512(
                        out.add(j / 2).cast(),
                        std::mem::transmute::<__m512bh, __m512i>(d),
                    );
                    j += 32;
                }
                if j < n {
                    let d = _mm512_cvtneps_pbh(_mm512_loadu_ps(row.add(j)));
                    _mm256_storeu_si256(
                        out.add(j / 2).cast(),
                        std::mem::transmute::<__m256bh, __m256i>(d),
                    );
                }
            }
        }
    }
}

/// `P` and `dS` without softcap in one pass, straight from `S`, `dP` into the bf16 pairs
/// [`round_pairs`] makes (without writing them back to `S`, `dP` first), for rows
/// `i0..i0 + m` (`i0`, `m` even) over keys `0..nkp` (`nkp = ⌈nk/16⌉·16`): exactly as
/// `p_ds_row::<Avx512, false, true>` computes them for rows `< nq`, keys `< nk` inside `n0..n1`
/// (multiples of 16) and, with `PART`, pairs the partial mask `bits` allows; 0 elsewhere. A full
/// tile (`!PART`, no mask) passes `n0..n1 = 0..nkp`; a partial block skips the arithmetic of the
/// 16-key chunks with nothing live.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn p_ds_pairs<const PART: bool>(
    (s, dp, tk): (&[f32], &[f32], usize),
    (i0, m, nq): (usize, usize, usize),
    (n0, n1, nk): (usize, usize, usize),
    bits: Option<(&PartialMasks, u32)>,
    sc: f32,
    lse: &[f32],
    delta: &[f32],
    pq: &mut [u32],
    dsq: &mut [u32],
    dsk: &mut [u32],
) {
    let nkp = round_up(nk, 16);
    let end = i0 + m;
    assert!(i0.is_multiple_of(2) && m.is_multiple_of(2) && nq.min(end) <= lse.len());
    assert!(n0.is_multiple_of(16) && n1.is_multiple_of(16) && n0 <= n1 && n1 <= nkp);
    assert!(nkp <= tk && nq.min(end) <= delta.len() && end * tk <= s.len());
    assert!(end * tk <= dp.len() && end / 2 * tk <= pq.len() && end / 2 * tk <= dsq.len());
    assert!(end * tk / 2 <= dsk.len() && PART == bits.is_some());
    assert!(bits.is_none_or(|(p, id)| (i0..end.min(nq)).all(|i| p.row(id, i).len() * 64 >= nkp)));
    // 16-bit lane 2x takes lane x (row i), lane 2x+1 takes lane 16+x (row i+1).
    let idx: [u16; 32] = std::array::from_fn(|w| (w / 2 + 16 * (w % 2)) as u16);
    // Lanes of keys `j..j + 16` of row `i` (lanes `rm` of the row exist): below `nk` and, with
    // a mask, allowed by it. (No vector arithmetic: a closure would not inherit this function's
    // target features.)
    let lanes = |row: &[u64], rm: __mmask16, j: usize| -> __mmask16 {
        if PART && (j < n0 || j >= n1 || rm == 0) {
            return 0;
        }
        let allowed = if PART {
            (row[j / 64] >> (j % 64)) as u16
        } else {
            0xFFFF
        };
        rm & key_lanes(nk, j) & allowed
    };
    // The mask row of query `i` (empty without a mask or for a padding row).
    let mask_row = |i: usize| match bits {
        Some((p, id)) if i < nq => p.row(id, i),
        _ => &[][..],
    };
    // SAFETY: the asserts above bound every access (rows `< end`, keys `< nkp <= tk`); `idx` is
    // 64 bytes.
    unsafe {
        let perm = _mm512_loadu_si512(idx.as_ptr().cast());
        let sc = _mm512_set1_ps(sc * simd::LOG2E);
        for i in (i0..end).step_by(2) {
            let o = i / 2 * tk;
            let (r0, m0) = Row::new(s, dp, tk, i, nq, lse, delta);
            let (r1, m1) = Row::new(s, dp, tk, i + 1, nq, lse, delta);
            let (b0, b1) = (mask_row(i), mask_row(i + 1));
            // Over all keys: zeros outside `n0..n1` (measured faster than a separate zero fill
            // with the pass over `n0..n1` alone).
            let mut j = 0;
            while j < nkp {
                let (p0, d0) = p_ds16::<PART>(&r0, j, lanes(b0, m0, j), sc);
                let (p1, d1) = p_ds16::<PART>(&r1, j, lanes(b1, m1, j), sc);
                _mm512_storeu_si512(pq.as_mut_ptr().add(o + j).cast(), pairs(perm, p0, p1));
                _mm512_storeu_si512(dsq.as_mut_ptr().add(o + j).cast(), pairs(perm, d0, d1));
                if j + 32 <= nkp {
                    let k = j + 16;
                    let (p2, d2) = p_ds16::<PART>(&r0, k, lanes(b0, m0, k), sc);
                    let (p3, d3) = p_ds16::<PART>(&r1, k, lanes(b1, m1, k), sc);
                    let at = o + k;
                    _mm512_storeu_si512(pq.as_mut_ptr().add(at).cast(), pairs(perm, p2, p3));
                    _mm512_storeu_si512(dsq.as_mut_ptr().add(at).cast(), pairs(perm, d2, d3));
                    // Pairs of consecutive keys: the conversion's own order.
                    let w0: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(d2, d0));
                    let w1: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(d3, d1));
                    _mm512_storeu_si512(dsk.as_mut_ptr().add(i * tk / 2 + j / 2).cast(), w0);
                    _mm512_storeu_si512(dsk.as_mut_ptr().add((i + 1) * tk / 2 + j / 2).cast(), w1);
                    j += 32;
                } else {
                    let w0: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(d0));
                    let w1: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(d1));
                    _mm256_storeu_si256(dsk.as_mut_ptr().add(i * tk / 2 + j / 2).cast(), w0);
                    _mm256_storeu_si256(dsk.as_mut_ptr().add((i + 1) * tk / 2 + j / 2).cast(), w1);
                    j += 16;
                }
            }
        }
    }
}

/// One query row of [`p_ds_pairs`]: its `S`, `dP` and broadcast LSE, Δ.
struct Row {
    s: *const f32,
    dp: *const f32,
    /// `−LSE·log2 e`: the exponentials run in base 2.
    nl: __m512,
    delta: __m512,
}

impl Row {
    /// Row `r` of `S`, `dP` (`tk` apart) and the lanes to compute: all, or none for a padding
    /// row (`r >= nq`: nothing loaded, P and dS zero).
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        s: &[f32],
        dp: &[f32],
        tk: usize,
        r: usize,
        nq: usize,
        lse: &[f32],
        delta: &[f32],
    ) -> (Row, __mmask16) {
        let live = r < nq;
        let (l, d) = if live { (lse[r], delta[r]) } else { (0.0, 0.0) };
        let row = Row {
            s: s.as_ptr().wrapping_add(r * tk),
            dp: dp.as_ptr().wrapping_add(r * tk),
            nl: _mm512_set1_ps(-(l * simd::LOG2E)),
            delta: _mm512_set1_ps(d),
        };
        (row, if live { 0xFFFF } else { 0 })
    }
}

/// Lanes of keys `j..j + 16` below `nk`.
#[inline(always)]
fn key_lanes(nk: usize, j: usize) -> __mmask16 {
    let left = nk.saturating_sub(j);
    if left >= 16 {
        0xFFFF
    } else {
        ((1u32 << left) - 1) as u16
    }
}

/// `P` and `dS` of keys `j..j + 16` of row `r` on lanes `m` (0 elsewhere), as
/// `p_ds_row::<Avx512, false, true>`.
///
/// `sc2` is the scale times `log2 e`.
///
/// # Safety
/// Lanes `m` of the row's `S` and `dP` from `j` must be readable; AVX-512F/DQ and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma")]
unsafe fn p_ds16<const SKIP: bool>(
    r: &Row,
    j: usize,
    m: __mmask16,
    sc2: __m512,
) -> (__m512, __m512) {
    // Partial tiles skip the arithmetic of chunks with no live lane.
    if SKIP && m == 0 {
        return (_mm512_setzero_ps(), _mm512_setzero_ps());
    }
    // SAFETY: the caller's contract; masked-off lanes are not read.
    unsafe {
        let x = _mm512_maskz_loadu_ps(m, r.s.add(j));
        let a = _mm512_fmadd_ps(x, sc2, r.nl);
        // min(cap, a) returns a NaN `a` (the second operand), as `bf16_p`'s compare.
        let p = exp2_coarse_in(m, _mm512_min_ps(_mm512_set1_ps(BF16_P_CAP2), a));
        let g = _mm512_maskz_loadu_ps(m, r.dp.add(j));
        let ds = _mm512_mul_ps(p, _mm512_sub_ps(g, r.delta));
        let live = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(p, _mm512_setzero_ps());
        (p, _mm512_maskz_mov_ps(live, ds))
    }
}

/// Two rows' 16 values rounded to bf16 and interleaved: word `x` = (lane `x` of `lo`, of `hi`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn pairs(perm: __m512i, lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: both are 64-byte plain vector types.
    let bh = unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) };
    _mm512_permutexvar_epi16(perm, bh)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
unsafe fn item(cx: &BwdCtx<'_>, inp: &Inputs<'_>, ws: &mut Ws, it: DkvItem<'_>) {
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
    let (qh, vh, tk2) = (dqk.div_ceil(2), dv.div_ceil(2), tk / 2);
    let (k0, k1) = plan.kv_range(kt);
    let nk = k1 - k0;
    let (mk, nkp) = (round_up(nk, RB), round_up(nk, 16));
    let Ws {
        kt: ktp,
        vt,
        kk,
        s,
        dp,
        pq,
        dsq,
        dsk,
        dk,
        dv: dva,
        qd,
        qq,
        dod,
        doq,
        pqt,
        dsqt,
    } = ws;
    let koff = cx.k.row(b, gh, k0);
    pack_kv(
        inp.k,
        koff,
        cx.k.ld(),
        nk,
        dqk,
        tk,
        ktp,
        Some((&mut kk[..tk / 2 * dqkp], dqkp)),
    );
    let voff = cx.v.row(b, gh, k0);
    pack_kv(inp.v, voff, cx.v.ld(), nk, dv, tk, vt, None);
    dk[..mk * dqkp].fill(0.0);
    dva[..mk * dvp].fill(0.0);
    let mut slot_it = dq_slots.iter_mut();
    for h in gh * d.group()..(gh + 1) * d.group() {
        let hp = plan.head_plan(b, h);
        let bh = b * d.heads_q + h;
        for e in hp.col(kt) {
            let slot: &mut [f32] = slot_it.next().expect("one dQ slot per entry");
            let qt = e.tile as usize;
            let (q0, q1) = plan.q_range(qt);
            let nq = q1 - q0;
            let mq = round_up(nq, RB);
            let oq = cx.q.row(b, h, q0);
            // Pairs along D in place when the layout allows, else packed; pairs of queries
            // always packed.
            let qa: &[u32] = match inp.q_words {
                Some((w, _)) => {
                    pack_row_pairs_x512(inp.q, oq, cx.q.ld(), nq, dqk, dqkp, qq);
                    &w[oq / 2..]
                }
                None => {
                    pack_rows(
                        inp.q,
                        oq,
                        cx.q.ld(),
                        nq,
                        dqk,
                        dqkp,
                        (&mut qd[..g.tq * inp.q_ld], inp.q_ld),
                        qq,
                    );
                    qd
                }
            };
            let qars = inp.q_words.map_or(inp.q_ld, |(_, ld)| ld);
            let od = cx.d_o.row(b, h, q0);
            let da: &[u32] = match inp.do_words {
                Some((w, _)) => {
                    pack_row_pairs_x512(inp.d_o, od, cx.d_o.ld(), nq, dv, dvp, doq);
                    &w[od / 2..]
                }
                None => {
                    pack_rows(
                        inp.d_o,
                        od,
                        cx.d_o.ld(),
                        nq,
                        dv,
                        dvp,
                        (&mut dod[..g.tq * inp.do_ld], inp.do_ld),
                        doq,
                    );
                    dod
                }
            };
            let dars = inp.do_words.map_or(inp.do_ld, |(_, ld)| ld);
            let lse = &cx.lse[bh * d.q_len + q0..bh * d.q_len + q1];
            let delta = &cx.delta[bh * d.q_len + q0..bh * d.q_len + q1];
            if e.is_full() {
                let on = |f: fn(&Amx) -> bool| inp.amx.filter(f).map(|a| a.unit);
                // `h` pairs along D; the tiles read them padded to a multiple of 16 (zero in the
                // packs of Q/dO and of K/V): whole 16-query blocks on tiles, the rest (4, 8 or
                // 12 queries) on `vdpbf16ps`.
                let logits = |(a, lda): (&[u32], usize), h, b, c: &mut [f32]| match inp.amx {
                    // SAFETY: `unit` came from `amx::unit`; this kernel's CPU features.
                    Some(x) => unsafe {
                        let hp = round_up(h, amx::TW);
                        dot_gemm_tiles(x.unit, (mq, nkp, h, hp), (a, lda), (b, tk), (c, tk))
                    },
                    None => dot_gemm::<false, false>(mq, nkp, h, a, lda, 1, b, tk, c, tk, &mut []),
                };
                logits((qa, qars), qh, &ktp[..], &mut s[..]);
                logits((da, dars), vh, &vt[..], &mut dp[..]);
                if cx.softcap.is_none() {
                    let (st, rows, keys) = ((&s[..], &dp[..], tk), (0, mq, nq), (0, nkp, nk));
                    p_ds_pairs::<false>(st, rows, keys, None, cx.scale, lse, delta, pq, dsq, dsk);
                } else {
                    p_ds_full::<Avx512, true>(cx, cx.scale, s, dp, tk, nq, nk, lse, delta);
                    round_pairs(s, dp, tk, 0, mq, nkp, pq, dsq, dsk);
                }
                let mp = mq / 2;
                if let Some(unit) = on(|a| a.dkv) {
                    // dV += Pᵀ·dO, dK += dSᵀ·Q over query pairs up to a multiple of 16 (P and
                    // dS zero past the tile's: dO and Q are finite there), keys by blocks of 16
                    // (rows past `nk` are never stored), from P and dS transposed to keys by
                    // query pairs.
                    // SAFETY (both): `unit` came from `amx::unit`; AVX-512F is this kernel's.
                    unsafe {
                        let (pqs, dsqs) = ((&mut pq[..], tk), (&mut dsq[..], tk));
                        tiles_acc_transposed(
                            unit,
                            (nkp, dvp, mp),
                            pqs,
                            pqt,
                            (doq, dvp),
                            (dva, dvp),
                        );
                        tiles_acc_transposed(
                            unit,
                            (nkp, dqkp, mp),
                            dsqs,
                            dsqt,
                            (qq, dqkp),
                            (dk, dqkp),
                        );
                    }
                } else {
                    dot_gemm::<true, false>(mk, dvp, mp, pq, 1, tk, doq, dvp, dva, dvp, &mut []);
                    dot_gemm::<true, false>(mk, dqkp, mp, dsq, 1, tk, qq, dqkp, dk, dqkp, &mut []);
                }
                let np = nk.div_ceil(2);
                match on(|a| a.dq) {
                    Some(unit) => {
                        // Key pairs up to a multiple of 16: dS zero past the tile's (`kk` holds
                        // zeros or finite keys there).
                        let np16 = round_up(np, amx::TW);
                        for row in dsk.chunks_mut(tk2).take(mq) {
                            row[np..np16].fill(0);
                        }
                        let (dims, a, b) = ((mq, dqkp, np, np16), (&dsk[..], tk2), (&kk[..], dqkp));
                        // SAFETY: `unit` came from `amx::unit`; this kernel's CPU features.
                        unsafe { dot_gemm_tiles(unit, dims, a, b, (slot, dqkp)) };
                    }
                    None => dot_gemm::<false, false>(
                        mq,
                        dqkp,
                        np,
                        dsk,
                        tk2,
                        1,
                        kk,
                        dqkp,
                        slot,
                        dqkp,
                        &mut [],
                    ),
                }
                continue;
            }
            // Partial tile: per 16-query block, S/dP/P/dS over its key span only, zero outside;
            // dQ slot rows = dS·K over the span.
            for qb in query_blocks(cx, e.mask, mq, nk) {
                let (i0, m) = (qb.i0, qb.m);
                let Some(span) = &qb.span else {
                    s[i0 * tk..(i0 + m) * tk].fill(0.0);
                    dp[i0 * tk..(i0 + m) * tk].fill(0.0);
                    round_pairs(s, dp, tk, i0, m, nkp, pq, dsq, dsk);
                    slot[i0 * dqkp..(i0 + m) * dqkp].fill(0.0);
                    continue;
                };
                let (n0, n1) = (span.n0, span.n1);
                let (sb, db) = (&mut s[i0 * tk + n0..], &mut dp[i0 * tk + n0..]);
                let (qa, da) = (&qa[i0 * qars..], &da[i0 * dars..]);
                dot_gemm::<false, false>(
                    m,
                    n1 - n0,
                    qh,
                    qa,
                    qars,
                    1,
                    &ktp[n0..],
                    tk,
                    sb,
                    tk,
                    &mut [],
                );
                dot_gemm::<false, false>(
                    m,
                    n1 - n0,
                    vh,
                    da,
                    dars,
                    1,
                    &vt[n0..],
                    tk,
                    db,
                    tk,
                    &mut [],
                );
                let (sc, d) = (cx.scale, delta);
                if cx.softcap.is_none() {
                    // One pass from S, dP to the pairs, the mask as lane masks.
                    let (st, bits) = ((&s[..], &dp[..], tk), Some((&plan.partials, e.mask)));
                    let (rows, keys) = ((i0, m, nq), (n0, n1, nk));
                    p_ds_pairs::<true>(st, rows, keys, bits, sc, lse, d, pq, dsq, dsk);
                } else {
                    p_ds_block::<Avx512, true>(cx, e.mask, sc, s, dp, tk, nkp, &qb, nq, lse, d);
                    round_pairs(s, dp, tk, i0, m, nkp, pq, dsq, dsk);
                }
                let (jp0, jp1) = (span.r0 / 2, span.r1.div_ceil(2));
                dot_gemm::<false, false>(
                    m,
                    dqkp,
                    jp1 - jp0,
                    &dsk[i0 * tk2 + jp0..],
                    tk2,
                    1,
                    &kk[jp0 * dqkp..],
                    dqkp,
                    &mut slot[i0 * dqkp..],
                    dqkp,
                    &mut [],
                );
            }
            // dV += Pᵀ·dO, dK += dSᵀ·Q per 16-key block over its query span.
            for (j0, m, c0, c1) in key_blocks(cx, e.mask, mk, nq) {
                let (ip0, ip1) = (c0 / 2, c1.div_ceil(2));
                let np = ip1 - ip0;
                let (pa, dsa) = (&pq[ip0 * tk + j0..], &dsq[ip0 * tk + j0..]);
                let (dob, qb) = (&doq[ip0 * dvp..], &qq[ip0 * dqkp..]);
                let dvj = &mut dva[j0 * dvp..];
                dot_gemm::<true, false>(m, dvp, np, pa, 1, tk, dob, dvp, dvj, dvp, &mut []);
                let dkj = &mut dk[j0 * dqkp..];
                dot_gemm::<true, false>(m, dqkp, np, dsa, 1, tk, qb, dqkp, dkj, dqkp, &mut []);
            }
        }
    }
    store_dkv(cx, nk, dk, dva, &mut dk_out, &mut dv_out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::cpu_features::{has, Feature};

    /// `round_pairs` of rows `i0..i0 + m`, keys `0..nkp` of the two-pass `P`, `dS` (`s2`, `dp2`)
    /// equals the one-pass pairs `got` over keys `0..nkp` of every row (rows outside the block
    /// hold the buffers' initial 7 on both sides).
    fn assert_two_passes_give(
        (s2, dp2, tk): (&[f32], &[f32], usize),
        (i0, m, nkp): (usize, usize, usize),
        (pq, dsq, dsk): (&[u32], &[u32], &[u32]),
    ) {
        let (mut pq2, mut dsq2, mut dsk2) = (
            vec![7u32; pq.len()],
            vec![7u32; dsq.len()],
            vec![7u32; dsk.len()],
        );
        // SAFETY: only reached after the callers' AVX512-BF16/BW checks.
        unsafe { round_pairs(s2, dp2, tk, i0, m, nkp, &mut pq2, &mut dsq2, &mut dsk2) };
        for i in 0..pq.len() / tk {
            let row = i * tk..i * tk + nkp;
            assert_eq!(pq[row.clone()], pq2[row.clone()], "P pairs {i}");
            assert_eq!(dsq[row.clone()], dsq2[row], "dS pairs {i}");
        }
        for r in 0..dsk.len() / (tk / 2) {
            let w = r * tk / 2;
            assert_eq!(
                dsk[w..w + nkp / 2],
                dsk2[w..w + nkp / 2],
                "dS key pairs {r}"
            );
        }
    }

    /// The one-pass full tile equals the two passes it replaces (`p_ds_row` in place, then
    /// `round_pairs`) bit for bit: ragged rows and keys (a 16-key tail), logits whose exponent
    /// underflows (dS forced to 0) and an LSE below the logits (the cap at 88).
    #[test]
    fn one_pass_full_tile_equals_the_two_passes() {
        if !(has(Feature::Avx512bf16) && has(Feature::Avx512bw)) {
            println!("skipped: needs AVX512-BF16, hidden or absent");
            return;
        }
        let (tk, nq, nk, mq, sc) = (64, 13, 37, 16, 0.125f32);
        let v = |i: usize, k: u32| ((i as u32).wrapping_mul(2_654_435_761) ^ k) % 4001;
        let s: Vec<f32> = (0..mq * tk)
            .map(|i| v(i, 7) as f32 * 0.37 - 740.0)
            .collect();
        let dp: Vec<f32> = (0..mq * tk).map(|i| v(i, 3) as f32 * 1e-3 - 2.0).collect();
        let mut lse: Vec<f32> = (0..nq).map(|i| v(i, 5) as f32 * 0.01).collect();
        lse[2] = -200.0;
        let delta: Vec<f32> = (0..nq).map(|i| v(i, 9) as f32 * 1e-4).collect();
        let words = mq / 2 * tk;
        let (mut pq, mut dsq, mut dsk) = (vec![7u32; words], vec![7u32; words], vec![7u32; words]);
        // SAFETY: AVX512-BF16 and AVX512-BW were detected above (AVX-512F/VL with them).
        unsafe {
            p_ds_pairs::<false>(
                (&s, &dp, tk),
                (0, mq, nq),
                (0, round_up(nk, 16), nk),
                None,
                sc,
                &lse,
                &delta,
                &mut pq,
                &mut dsq,
                &mut dsk,
            )
        };
        let (mut s2, mut dp2) = (s.clone(), dp.clone());
        for i in 0..mq {
            let (sr, dr) = (
                &mut s2[i * tk..(i + 1) * tk],
                &mut dp2[i * tk..(i + 1) * tk],
            );
            if i < nq {
                super::super::tiles::p_ds::<Avx512, true>(
                    None,
                    sc,
                    &mut sr[..nk],
                    &mut dr[..nk],
                    lse[i],
                    delta[i],
                );
                sr[nk..].fill(0.0);
                dr[nk..].fill(0.0);
            } else {
                sr.fill(0.0);
                dr.fill(0.0);
            }
        }
        assert!(s2.iter().any(|&p| p > 1e30), "no capped logit");
        let live = |i: usize| &s2[i * tk..i * tk + nk];
        assert!((0..nq).any(|i| live(i).contains(&0.0)), "no underflow");
        let nkp = round_up(nk, 16);
        assert_two_passes_give((&s2, &dp2, tk), (0, mq, nkp), (&pq, &dsq, &dsk));
    }

    /// K/V packing (pairs along D, keys contiguous) against the element-wise layout: even row
    /// strides (transposed blocks plus gathered tails), odd strides and odd D (gathers), ragged
    /// key counts; the padding keys are zero.
    #[test]
    fn kv_packing_matches_the_elementwise_layout() {
        if !(has(Feature::Avx512bf16) && has(Feature::Avx512bw)) {
            println!("skipped: needs AVX512-BF16, hidden or absent");
            return;
        }
        let tk = 64;
        for &(nk, dim, sl, off) in &[
            (64usize, 64usize, 64usize, 0usize),
            (64, 64, 512, 3),
            (37, 72, 80, 5),
            (16, 32, 33, 1),
            (50, 71, 90, 2),
            (5, 40, 40, 0),
        ] {
            let x: Vec<bf16> = (0..off + nk * sl + dim)
                .map(|i| bf16::from_bits((i as u16).wrapping_mul(40503) | 1))
                .collect();
            let dh = dim.div_ceil(2);
            let mut t = vec![0xDEAD_BEEFu32; dh * tk];
            // SAFETY: AVX512-BF16 and AVX512-BW were detected above (AVX-512F/VL with them).
            unsafe { pack_kv(&x, off, sl, nk, dim, tk, &mut t, None) };
            let nkp = round_up(nk, 16);
            for dp in 0..dh {
                for j in 0..nkp {
                    let want = if j >= nk {
                        0
                    } else {
                        let e = |c: usize| {
                            if c < dim {
                                bits(&x[off + j * sl + c])
                            } else {
                                0
                            }
                        };
                        pair(e(2 * dp), e(2 * dp + 1))
                    };
                    assert_eq!(
                        t[dp * tk + j],
                        want,
                        "nk={nk} dim={dim} sl={sl} ({dp}, {j})"
                    );
                }
            }
        }
    }

    /// A partial block in one pass equals `p_ds_block` then `round_pairs` (the softcap path) bit
    /// for bit: masked pairs, keys outside the block's columns and padding rows all 0, the other
    /// rows' pairs untouched.
    #[test]
    fn one_pass_partial_block_equals_the_masked_two_passes() {
        if !(has(Feature::Avx512bf16) && has(Feature::Avx512bw)) {
            println!("skipped: needs AVX512-BF16, hidden or absent");
            return;
        }
        let (tk, nq, nk, sc) = (128, 27, 117, 0.125f32);
        let mq = round_up(nq, RB);
        let v = |i: usize, k: u32| ((i as u32).wrapping_mul(2_654_435_761) ^ k) % 4001;
        let mut partials = PartialMasks::new(tessera_plan::TileShape { q: 32, kv: tk });
        partials.data = (0..2 * 32 * 2)
            .map(|i| (v(i, 11) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v(i, 13) as u64)
            .collect();
        let s: Vec<f32> = (0..mq * tk).map(|i| v(i, 7) as f32 * 0.01 - 20.0).collect();
        let dp: Vec<f32> = (0..mq * tk).map(|i| v(i, 3) as f32 * 1e-3 - 2.0).collect();
        let lse: Vec<f32> = (0..nq).map(|i| v(i, 5) as f32 * 0.002).collect();
        let delta: Vec<f32> = (0..nq).map(|i| v(i, 9) as f32 * 1e-4).collect();
        let words = mq / 2 * tk;
        // Rows 16..mq (a block with padding rows) over keys 32..112 (the last keys of the tile,
        // 112..117, outside the block's columns).
        let (i0, m, n0, n1) = (16, mq - 16, 32, 112);
        let (mut pq, mut dsq, mut dsk) = (vec![7u32; words], vec![7u32; words], vec![7u32; words]);
        // SAFETY: AVX512-BF16 and AVX512-BW were detected above (AVX-512F/VL with them).
        unsafe {
            p_ds_pairs::<true>(
                (&s, &dp, tk),
                (i0, m, nq),
                (n0, n1, nk),
                Some((&partials, 1)),
                sc,
                &lse,
                &delta,
                &mut pq,
                &mut dsq,
                &mut dsk,
            )
        };
        let (mut s2, mut dp2) = (s.clone(), dp.clone());
        for i in i0..i0 + m {
            let (sr, dr) = (
                &mut s2[i * tk..(i + 1) * tk],
                &mut dp2[i * tk..(i + 1) * tk],
            );
            if i < nq {
                super::super::tiles::p_ds::<Avx512, true>(
                    None,
                    sc,
                    &mut sr[n0..n1],
                    &mut dr[n0..n1],
                    lse[i],
                    delta[i],
                );
            }
            for j in 0..tk {
                if i >= nq || j < n0 || j >= n1 || j >= nk || !partials.allowed(1, i, j) {
                    (sr[j], dr[j]) = (0.0, 0.0);
                }
            }
        }
        assert!(
            s2[i0 * tk..nq * tk].iter().any(|&p| p > 0.0),
            "nothing allowed"
        );
        let nkp = round_up(nk, 16);
        assert_two_passes_give((&s2, &dp2, tk), (i0, m, nkp), (&pq, &dsq, &dsk));
    }
}

#[cfg(test)]
mod pack_tests {
    use super::*;
    use tessera_core::cpu_features::{has, Feature};

    /// The AVX-512 pair interleave writes what the scalar one does, for ragged widths (tails
    /// under 16 and 32), an odd row count and zero padding.
    #[test]
    fn vector_row_pairs_equal_the_scalar_ones() {
        if !has(Feature::Avx512bw) {
            println!("skipped: needs AVX-512BW, hidden or absent");
            return;
        }
        for &(n, dim, ld, rows) in &[
            (7, 64, 64, 8),
            (5, 13, 16, 6),
            (9, 40, 48, 10),
            (4, 33, 48, 4),
        ] {
            let (off, sl) = (3, dim + 5);
            let x: Vec<bf16> = (0..off + rows * sl)
                .map(|i| bf16::from_f32((i as f32 * 0.37).sin()))
                .collect();
            let mut want = vec![7u32; rows / 2 * ld];
            let mut got = vec![9u32; rows / 2 * ld];
            pack_row_pairs(&x, off, sl, n, dim, ld, &mut want);
            // SAFETY: AVX-512BW was detected above (with AVX-512F).
            unsafe { pack_row_pairs_x512(&x, off, sl, n, dim, ld, &mut got) };
            assert_eq!(got, want, "n={n} dim={dim}");
        }
    }
}
