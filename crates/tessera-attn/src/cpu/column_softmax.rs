//! The online-softmax passes over one forward score tile `Sᵀ` (one row per key, queries
//! contiguous) in explicit AVX-512, one register of 16 queries at a time: the column maxima
//! ([`column_max`]), then the exponentials and column sums ([`exp_columns`] for the f32 `P`,
//! [`exp_pairs`] for the bf16 pairs of keys of the `vdpbf16ps` kernel).
//!
//! Contract: the values are those of the row-by-row loops they replace, bit for bit (same
//! `exp_le88`, same order of the sums per query, a masked pair contributes an exact 0), so the
//! telemetry copies, which keep the row-by-row loops for their per-key hooks, stay bit-identical.
//! Why per column: the running maximum, the exponent base and the column sum of 16 queries stay
//! in registers for the whole tile, and a partial tile applies its bitmask as a lane mask while
//! exponentiating (no separate `-inf` pass, no separate max pass, no span bookkeeping per key).
//! Masked pairs are excluded by the mask, never multiplied by zero: a masked logit may hold
//! anything (NaN, stale data) and still gives `P = 0`.

use super::live_blocks::{LiveBlocks, SB};
use super::mask_partial_tile::MasksT;
use super::simd::x512::{exp_le88, exp_le88_coarse};
use std::arch::x86_64::*;

/// Which pairs of a tile are live: all of `nq × nk` (full tile) or those of a partial mask.
#[derive(Clone, Copy)]
pub(crate) struct TileLive<'a> {
    nq: usize,
    nk: usize,
    part: Option<(&'a MasksT, &'a LiveBlocks, u32)>,
}

impl<'a> TileLive<'a> {
    /// Every pair of `nq` queries × `nk` keys.
    pub(crate) fn full(nq: usize, nk: usize) -> Self {
        TileLive { nq, nk, part: None }
    }

    /// The pairs allowed by partial mask `id` (transposed bitmask `masks`, live ranges `live`).
    pub(crate) fn partial(
        nq: usize,
        nk: usize,
        masks: &'a MasksT,
        live: &'a LiveBlocks,
        id: u32,
    ) -> Self {
        TileLive {
            nq,
            nk,
            part: Some((masks, live, id)),
        }
    }

    /// Keys `[r0, r1)` outside which every pair of query block `ib` is masked.
    #[inline(always)]
    fn keys(&self, ib: usize) -> (usize, usize) {
        match self.part {
            None => (0, self.nk),
            Some((_, live, id)) => {
                let (r0, r1) = live.keys(id, ib);
                let r1 = r1.min(self.nk);
                (r0.min(r1), r1)
            }
        }
    }

    /// Lanes of queries `i0..i0 + 16` that exist (`< nq`).
    #[inline(always)]
    fn lanes(&self, i0: usize) -> u16 {
        let n = self.nq - i0;
        if n >= 16 {
            0xFFFF
        } else {
            (1u16 << n) - 1
        }
    }

    /// Live lanes of key `j` among queries `i0..i0 + 16` (`exists`: [`Self::lanes`]).
    #[inline(always)]
    fn live(&self, exists: u16, j: usize, i0: usize) -> u16 {
        match self.part {
            None => exists,
            Some((masks, _, id)) => exists & (masks.row(id, j)[i0 / 64] >> (i0 % 64)) as u16,
        }
    }

    fn check(&self, tq: usize, rows: usize, len: usize) {
        assert!(
            tq.is_multiple_of(SB) && self.nq <= tq && (rows == 0 || len >= (rows - 1) * tq + tq),
            "column softmax: tile extents"
        );
    }
}

/// `col[i] = max(col[i], max_j s[j·tq + i])` over the live keys `j` of every query `i < nq` (NaN
/// ignored, like `online_softmax::column_max`); lanes `nq..` of the last block are left alone.
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn column_max(s: &[f32], tq: usize, live: TileLive<'_>, col: &mut [f32]) {
    live.check(tq, live.nk, s.len());
    assert!(col.len() >= live.nq.div_ceil(SB) * SB, "column max: col");
    for i0 in (0..live.nq).step_by(SB) {
        let exists = live.lanes(i0);
        let (r0, r1) = live.keys(i0 / SB);
        // SAFETY: rows `r0..r1 < nk` of 16 lanes from `i0 < tq` lie in `s` (checked above), and
        // `col` holds the block.
        unsafe {
            let cp = col.as_mut_ptr().add(i0);
            let mut mx = _mm512_maskz_loadu_ps(exists, cp);
            for j in r0..r1 {
                let x = _mm512_loadu_ps(s.as_ptr().add(j * tq + i0));
                // max(x, mx) keeps mx when x is NaN, as the scalar `if x > c`.
                mx = _mm512_mask_max_ps(mx, live.live(exists, j, i0), x, mx);
            }
            _mm512_mask_storeu_ps(cp, exists, mx);
        }
    }
}

/// `s[j·tq + i] = p = exp(sc·s[j·tq + i] − u[i])` for the live pairs, `0` for the masked ones
/// (rows `r0..r1` of each 16-query block, see [`TileLive`]; the rows outside are not written and
/// every pair there is masked), and `col[i] = Σ_j p` in ascending `j` from 0.
///
/// # Safety
/// The CPU must have AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn exp_columns(
    s: &mut [f32],
    tq: usize,
    live: TileLive<'_>,
    u: &[f32],
    sc: f32,
    col: &mut [f32],
) {
    live.check(tq, live.nk, s.len());
    let nqp = live.nq.div_ceil(SB) * SB;
    assert!(col.len() >= nqp && u.len() >= nqp, "exp columns: extents");
    let scv = _mm512_set1_ps(sc);
    for i0 in (0..live.nq).step_by(SB) {
        let exists = live.lanes(i0);
        let (r0, r1) = live.keys(i0 / SB);
        // SAFETY: as in `column_max`; `u` and `col` hold the block.
        unsafe {
            let nu = neg(_mm512_maskz_loadu_ps(exists, u.as_ptr().add(i0)));
            let mut acc = _mm512_setzero_ps();
            let mut p_of = |j: usize| {
                let sp = s.as_mut_ptr().add(j * tq + i0);
                let p = exp_le88(_mm512_fmadd_ps(_mm512_loadu_ps(sp), scv, nu));
                let p = _mm512_maskz_mov_ps(live.live(exists, j, i0), p);
                _mm512_storeu_ps(sp, p);
                p
            };
            // Four keys per step: four independent exponential chains in flight (one chain
            // is latency-bound), the sum still in ascending key order.
            let mut j = r0;
            while j + 4 <= r1 {
                let (p0, p1, p2, p3) = (p_of(j), p_of(j + 1), p_of(j + 2), p_of(j + 3));
                acc = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc, p0), p1), p2),
                    p3,
                );
                j += 4;
            }
            for j in j..r1 {
                acc = _mm512_add_ps(acc, p_of(j));
            }
            _mm512_storeu_ps(col.as_mut_ptr().add(i0), acc);
        }
    }
}

/// The bf16 `P` of the `vdpbf16ps` kernel: for every pair of keys `jp < ⌈nk/2⌉` and query `i` of
/// the padded tile, `pp[jp·tq + i]` holds `p(2jp)` (low half) and `p(2jp + 1)` rounded to bf16,
/// `p(j) = exp(sc·s[j·tq + i] − u[i])` (`exp_le88_coarse`: P is rounded to bf16) for a live pair and `0` otherwise (key `nk`, lanes `nq..`,
/// masked pairs and rows outside the block's key range included); `col[i] = Σ_jp (p0 + p1)` in
/// ascending `jp` from 0.
///
/// # Safety
/// The CPU must have AVX-512F/BW, AVX512-BF16 and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn exp_pairs(
    s: &[f32],
    tq: usize,
    live: TileLive<'_>,
    u: &[f32],
    sc: f32,
    col: &mut [f32],
    pp: &mut [u32],
) {
    let np = live.nk.div_ceil(2);
    live.check(tq, live.nk, s.len());
    live.check(tq, np, pp.len());
    let nqp = live.nq.div_ceil(SB) * SB;
    assert!(col.len() >= nqp && u.len() >= nqp, "exp pairs: extents");
    // Word 2i of the packed vector takes p0's lane i (low half of the conversion), word 2i + 1
    // takes p1's (high half).
    let idx: [u16; 32] = std::array::from_fn(|w| (w / 2 + 16 * (w % 2)) as u16);
    // SAFETY: the `idx` array is 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    let scv = _mm512_set1_ps(sc);
    for i0 in (0..live.nq).step_by(SB) {
        let exists = live.lanes(i0);
        let (r0, r1) = live.keys(i0 / SB);
        // SAFETY: as in `exp_columns`; pair rows `jp < np` of 16 words from `i0` lie in `pp`.
        unsafe {
            let nu = neg(_mm512_maskz_loadu_ps(exists, u.as_ptr().add(i0)));
            let mut acc = _mm512_setzero_ps();
            for jp in 0..np {
                let dst = pp.as_mut_ptr().add(jp * tq + i0).cast();
                let (j0, j1) = (2 * jp, 2 * jp + 1);
                if j1 < r0 || j0 >= r1 {
                    _mm512_storeu_si512(dst, _mm512_setzero_si512());
                    continue;
                }
                let key = |j: usize| -> (__mmask16, __m512) {
                    if j < r0 || j >= r1 {
                        return (0, _mm512_setzero_ps());
                    }
                    let m = live.live(exists, j, i0);
                    let x = _mm512_maskz_loadu_ps(m, s.as_ptr().add(j * tq + i0));
                    (m, _mm512_fmadd_ps(x, scv, nu))
                };
                let (m0, x0) = key(j0);
                let (m1, x1) = key(j1);
                let p0 = _mm512_maskz_mov_ps(m0, exp_le88_coarse(x0));
                let p1 = _mm512_maskz_mov_ps(m1, exp_le88_coarse(x1));
                acc = _mm512_add_ps(acc, _mm512_add_ps(p0, p1));
                let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p1, p0));
                _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, bh));
            }
            _mm512_storeu_ps(col.as_mut_ptr().add(i0), acc);
        }
    }
}

/// `-x` (sign flip, exact).
#[inline]
#[target_feature(enable = "avx512f")]
fn neg(x: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ))
}
