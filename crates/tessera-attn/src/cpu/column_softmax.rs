//! The online-softmax passes over one forward score tile `Sᵀ` (one row per key, queries
//! contiguous) in explicit AVX-512 or AVX2, one register of queries (16 in a zmm, 8 in a ymm) at
//! a time: the column maxima ([`column_max`]), then the exponentials and column sums
//! ([`exp_columns`] for the f32 `P`, [`exp_pairs`] for the bf16 pairs of keys of the `vdpbf16ps`
//! kernel).
//!
//! Contract: the values are those of the row-by-row loops they replace, bit for bit (same
//! arguments and exponential, `simd::softmax_exp` / `exp2_coarse`, same order of the sums per
//! query, a masked pair contributes an exact 0), so the telemetry copies, which keep the
//! row-by-row loops for their per-key hooks, stay bit-identical. Keys live on every lane of a
//! block (a full tile's, a partial tile's dense run) skip the per-key lane masks.
//! Why per column: the running maximum, the exponent base and the column sum of 16 queries stay
//! in registers for the whole tile, and a partial tile applies its bitmask as a lane mask while
//! exponentiating (no separate `-inf` pass, no separate max pass, no span bookkeeping per key).
//! Masked pairs are excluded by the mask, never multiplied by zero: a masked logit may hold
//! anything (NaN, stale data) and still gives `P = 0`.

use super::live_blocks::{LiveBlocks, SB};
use super::mask_partial_tile::MasksT;
use super::simd::x512::{exp2_coarse_in, exp2_fine_in};
use super::simd::{self, x256, Avx2, Avx512, Simd};
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

    /// Keys `[d0, d1)` inside [`Self::keys`] live on every existing lane of query block `ib`
    /// (the whole range in a full tile).
    #[inline(always)]
    fn dense(&self, ib: usize) -> (usize, usize) {
        let (r0, r1) = self.keys(ib);
        match self.part {
            None => (r0, r1),
            Some((_, live, id)) => {
                let (d0, d1) = live.dense(id, ib);
                let d1 = d1.min(r1);
                if d0.max(r0) < d1 {
                    (d0.max(r0), d1)
                } else {
                    (r1, r1)
                }
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

    /// Live lanes of key `j` among queries `i0..i0 + w` (`w` = 16 or 8, `i0` a multiple of
    /// `w`; `exists`: [`Self::lanes`]).
    #[inline(always)]
    fn live(&self, exists: u16, j: usize, i0: usize, w: usize) -> u16 {
        match self.part {
            None => exists,
            Some((masks, _, id)) => {
                let row = masks.row(id, j);
                assert!(i0.is_multiple_of(w) && i0 + w <= 64 * row.len());
                // The block's bits by one 16- or 8-bit load (bit `i` of the little-endian row
                // is bit `i % 8` of its byte `i / 8`) instead of a word load and a shift.
                // SAFETY: bytes `i0 / 8..(i0 + w) / 8` lie inside the row (asserted).
                let bits = unsafe {
                    let p = row.as_ptr().cast::<u8>().add(i0 / 8);
                    if w == 16 {
                        p.cast::<u16>().read_unaligned()
                    } else {
                        u16::from(*p)
                    }
                };
                exists & bits
            }
        }
    }

    fn check(&self, tq: usize, rows: usize, len: usize) {
        assert!(
            tq.is_multiple_of(SB) && self.nq <= tq && (rows == 0 || len >= (rows - 1) * tq + tq),
            "column softmax: tile extents"
        );
    }
}

/// 16 f32 lanes (one block of queries) on one instruction set, with its lane mask.
trait Lanes: Copy {
    type Mask: Copy;
    /// Queries per block (lanes): 16 or 8.
    const W: usize;
    /// Keys per step of the exponential loop (4 or 1): independent exponential chains in flight
    /// (one zmm chain is latency-bound) without spilling registers (16 ymm hold one chain and
    /// the constants; 2 keys there measured 1-2% slower).
    const KEYS: usize;
    /// The mask of lanes whose bit is set (bit `l` for lane `l < W`).
    unsafe fn mask(bits: u16) -> Self::Mask;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn splat(x: f32) -> Self;
    unsafe fn add(self, o: Self) -> Self;
    /// `self · b + c`, fused.
    unsafe fn fma(self, b: Self, c: Self) -> Self;
    /// The base of the exponentials' arguments (`simd::exp_base` of the copy).
    const BASE: f32;
    /// `simd::softmax_exp_with` of the copy per lane in the lanes of `m` (bit for bit), `+0` in
    /// the others (`COARSE`: `exp2_coarse`, else `exp2_fine`).
    unsafe fn exp_in<const COARSE: bool>(self, m: Self::Mask) -> Self;
    /// `max(x, self)` (NaN `x` keeps `self`) in the lanes of `m`, `self` elsewhere.
    unsafe fn max_in(self, m: Self::Mask, x: Self) -> Self;
    /// `self` in the lanes of `m`, `+0` elsewhere.
    unsafe fn keep(self, m: Self::Mask) -> Self;
}

/// One zmm register.
#[derive(Clone, Copy)]
struct Zmm(__m512);

impl Lanes for Zmm {
    type Mask = __mmask16;
    const W: usize = 16;
    const KEYS: usize = 4;
    #[inline(always)]
    unsafe fn mask(bits: u16) -> __mmask16 {
        bits
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Zmm(unsafe { _mm512_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Zmm(unsafe { _mm512_set1_ps(x) })
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Zmm(unsafe { _mm512_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        Zmm(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
    }
    const BASE: f32 = simd::exp_base::<Avx512>();
    #[inline(always)]
    unsafe fn exp_in<const COARSE: bool>(self, m: __mmask16) -> Self {
        if COARSE {
            Zmm(unsafe { exp2_coarse_in(m, self.0) })
        } else {
            Zmm(unsafe { exp2_fine_in(m, self.0) })
        }
    }
    #[inline(always)]
    unsafe fn max_in(self, m: __mmask16, x: Self) -> Self {
        Zmm(unsafe { _mm512_mask_max_ps(self.0, m, x.0, self.0) })
    }
    #[inline(always)]
    unsafe fn keep(self, m: __mmask16) -> Self {
        Zmm(unsafe { _mm512_maskz_mov_ps(m, self.0) })
    }
}

/// One ymm register: blocks of 8 queries. (Two registers per 16-query block ran out of the 16
/// ymm registers: the exponential's constants were re-broadcast from memory at every key.)
/// No closures in this file: a closure does not inherit its caller's target features, so the
/// intrinsics in it would not inline.
#[derive(Clone, Copy)]
struct Ymm(__m256);

impl Lanes for Ymm {
    type Mask = __m256;
    const W: usize = 8;
    const KEYS: usize = 1;
    #[inline(always)]
    unsafe fn mask(bits: u16) -> __m256 {
        // SAFETY (all methods): the callers run with AVX2 and FMA.
        unsafe {
            let sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            let v = _mm256_and_si256(_mm256_set1_epi32((bits & 0xFF) as i32), sel);
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel))
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Ymm(unsafe { _mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Ymm(unsafe { _mm256_set1_ps(x) })
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Ymm(unsafe { _mm256_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        Ymm(unsafe { _mm256_fmadd_ps(self.0, b.0, c.0) })
    }
    const BASE: f32 = simd::exp_base::<Avx2>();
    #[inline(always)]
    unsafe fn exp_in<const COARSE: bool>(self, m: __m256) -> Self {
        if COARSE {
            Ymm(unsafe { x256::exp2_coarse(self.0) }).keep(m)
        } else {
            Ymm(unsafe { x256::exp2_fine(self.0) }).keep(m)
        }
    }
    #[inline(always)]
    unsafe fn max_in(self, m: __m256, x: Self) -> Self {
        // max(x, self) keeps self when x is NaN.
        Ymm(unsafe { _mm256_blendv_ps(self.0, _mm256_max_ps(x.0, self.0), m) })
    }
    #[inline(always)]
    unsafe fn keep(self, m: __m256) -> Self {
        Ymm(unsafe { _mm256_and_ps(self.0, m) })
    }
}

/// `col[i] = max(col[i], max_j s[j·tq + i])` over the live keys `j` of every query `i < nq` (NaN
/// ignored, like `online_softmax::column_max`); lanes `nq..` of the last block are left alone.
///
/// # Safety
/// `S` must be the AVX-512 copy (`S::WIDE`) or the AVX2 copy (`S::YMM`), run only on a CPU with
/// its features.
#[inline(always)]
pub(crate) unsafe fn column_max<S: Simd>(
    s: &[f32],
    tq: usize,
    live: TileLive<'_>,
    col: &mut [f32],
) {
    #[target_feature(enable = "avx512f")]
    fn zmm(s: &[f32], tq: usize, live: TileLive<'_>, col: &mut [f32]) {
        // SAFETY: this copy has AVX-512F.
        unsafe { column_max_with::<Zmm>(s, tq, live, col) }
    }
    #[target_feature(enable = "avx2,fma")]
    fn ymm(s: &[f32], tq: usize, live: TileLive<'_>, col: &mut [f32]) {
        // SAFETY: this copy has AVX2 and FMA.
        unsafe { column_max_with::<Ymm>(s, tq, live, col) }
    }
    // SAFETY: the caller's contract.
    unsafe {
        if S::WIDE {
            zmm(s, tq, live, col)
        } else {
            ymm(s, tq, live, col)
        }
    }
}

/// # Safety
/// The CPU must have `L`'s instruction set.
#[inline(always)]
unsafe fn column_max_with<L: Lanes>(s: &[f32], tq: usize, live: TileLive<'_>, col: &mut [f32]) {
    live.check(tq, live.nk, s.len());
    assert!(col.len() >= live.nq.div_ceil(SB) * SB, "column max: col");
    let mut tail = [f32::NEG_INFINITY; SB];
    for i0 in (0..live.nq).step_by(L::W) {
        let exists = live.lanes(i0);
        let (r0, r1) = live.keys(i0 / SB);
        // SAFETY: rows `r0..r1 < nk` of 16 lanes from `i0 < tq` lie in `s` (checked above), and
        // `col` holds the block; the ISA is the caller's.
        unsafe {
            // Lanes `nq..` keep their value: through a copy, so the block is always 16 wide.
            let cp = col.as_mut_ptr().add(i0);
            let mut mx = L::load(cp);
            for j in r0..r1 {
                let x = L::load(s.as_ptr().add(j * tq + i0));
                mx = mx.max_in(L::mask(live.live(exists, j, i0, L::W)), x);
            }
            if live.nq - i0 >= L::W {
                mx.store(cp);
            } else {
                mx.store(tail.as_mut_ptr());
                let n = live.nq - i0;
                col[i0..i0 + n].copy_from_slice(&tail[..n]);
            }
        }
    }
}

/// `s[j·tq + i] = p = exp(sc·s[j·tq + i] − u[i])` for the live pairs, `0` for the masked ones
/// (rows `r0..r1` of each 16-query block, see [`TileLive`]; the rows outside are not written and
/// every pair there is masked), and `col[i] = Σ_j p` in ascending `j` from 0 (`u`: lanes up to
/// the 16-query padding, finite).
///
/// # Safety
/// As [`column_max`].
#[inline(always)]
pub(crate) unsafe fn exp_columns<S: Simd, const COARSE: bool>(
    s: &mut [f32],
    tq: usize,
    live: TileLive<'_>,
    u: &[f32],
    sc: f32,
    col: &mut [f32],
) {
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    fn zmm<const C: bool>(
        s: &mut [f32],
        tq: usize,
        live: TileLive<'_>,
        u: &[f32],
        sc: f32,
        col: &mut [f32],
    ) {
        // SAFETY: this copy has AVX-512F/DQ and FMA.
        unsafe { exp_columns_with::<Zmm, C>(s, tq, live, u, sc, col) }
    }
    #[target_feature(enable = "avx2,fma")]
    fn ymm<const C: bool>(
        s: &mut [f32],
        tq: usize,
        live: TileLive<'_>,
        u: &[f32],
        sc: f32,
        col: &mut [f32],
    ) {
        // SAFETY: this copy has AVX2 and FMA.
        unsafe { exp_columns_with::<Ymm, C>(s, tq, live, u, sc, col) }
    }
    // SAFETY: the caller's contract.
    unsafe {
        if S::WIDE {
            zmm::<COARSE>(s, tq, live, u, sc, col)
        } else {
            ymm::<COARSE>(s, tq, live, u, sc, col)
        }
    }
}

/// # Safety
/// The CPU must have `L`'s instruction set.
#[inline(always)]
unsafe fn exp_columns_with<L: Lanes, const COARSE: bool>(
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
    for i0 in (0..live.nq).step_by(L::W) {
        let exists = live.lanes(i0);
        // SAFETY: as in `column_max_with`; `u` and `col` hold the block.
        unsafe {
            // Arguments `x·(sc·B) − u·B` in the copy's base `B`; lanes `nq..` exponentiate
            // against a zero base and are masked anyway (a zero base gives +0 here, -0 in the
            // row loops: the same exponentials).
            let scv = L::splat(sc * L::BASE);
            let nu = L::load(u.as_ptr().add(i0))
                .keep(L::mask(exists))
                .fma(L::splat(-L::BASE), L::splat(0.0));
            let sp = s.as_mut_ptr().add(i0);
            let (r0, r1) = live.keys(i0 / SB);
            // Keys live on every lane (a full tile's all, a partial tile's dense run) take one
            // lane mask for all (no per-key lookup); the sum runs in key order throughout.
            let (d0, d1) = live.dense(i0 / SB);
            let block = ExpBlock {
                sp,
                tq,
                scv,
                nu,
                live: &live,
                exists,
                i0,
            };
            let acc = block.run::<false, COARSE>((r0, d0), L::splat(0.0));
            let acc = block.run::<true, COARSE>((d0, d1), acc);
            let acc = block.run::<false, COARSE>((d1, r1), acc);
            acc.store(col.as_mut_ptr().add(i0));
        }
    }
}

/// One query block of [`exp_columns`]: its first lane in key row 0 (`sp`), the scale and
/// negated base in the copy's base, the tile's live pairs and the lanes that exist.
struct ExpBlock<'a, L: Lanes> {
    sp: *mut f32,
    tq: usize,
    scv: L,
    nu: L,
    live: &'a TileLive<'a>,
    exists: u16,
    i0: usize,
}

impl<L: Lanes> ExpBlock<'_, L> {
    /// The exponentials over keys `r0..r1`, stored over the logits; returns the column sums
    /// `acc` continued over them. `FULL`: every key is live on the lanes of `exists`.
    ///
    /// # Safety
    /// As [`Self::key`] for every key of the range.
    #[inline(always)]
    unsafe fn run<const FULL: bool, const COARSE: bool>(
        &self,
        (r0, r1): (usize, usize),
        mut acc: L,
    ) -> L {
        // SAFETY (both loops): the caller's contract.
        unsafe {
            let all = L::mask(self.exists);
            // `L::KEYS` keys per step, the sum still in ascending key order.
            let mut j = r0;
            while L::KEYS == 4 && j + 4 <= r1 {
                let p0 = self.key::<FULL, COARSE>(j, all);
                let p1 = self.key::<FULL, COARSE>(j + 1, all);
                let p2 = self.key::<FULL, COARSE>(j + 2, all);
                let p3 = self.key::<FULL, COARSE>(j + 3, all);
                acc = acc.add(p0).add(p1).add(p2).add(p3);
                j += 4;
            }
            for j in j..r1 {
                acc = acc.add(self.key::<FULL, COARSE>(j, all));
            }
            acc
        }
    }

    /// `p = exp(sc·x − u)` of key `j` (row `sp + j·tq`) on its live lanes (`all`, the mask of
    /// `exists`, when `FULL`), 0 elsewhere, stored over `x` and returned. (A method, not a
    /// closure: closures do not inherit the caller's target features.)
    ///
    /// # Safety
    /// The row must hold 16 lanes; the CPU must have `L`'s instruction set.
    #[inline(always)]
    unsafe fn key<const FULL: bool, const COARSE: bool>(&self, j: usize, all: L::Mask) -> L {
        // SAFETY: the caller's contract.
        unsafe {
            let m = if FULL {
                all
            } else {
                L::mask(self.live.live(self.exists, j, self.i0, L::W))
            };
            let x = self.sp.add(j * self.tq);
            let p = L::load(x).fma(self.scv, self.nu).exp_in::<COARSE>(m);
            p.store(x);
            p
        }
    }
}

/// The bf16 `P` of the `vdpbf16ps` kernel: for every pair of keys `jp < ⌈nk/2⌉` and query `i` of
/// the padded tile, `pp[jp·tq + i]` holds `p(2jp)` (low half) and `p(2jp + 1)` rounded to bf16,
/// `p(j) = 2^(s[j·tq + i]·(sc·log2 e) − u[i]·log2 e)` (`exp2_coarse`: P is rounded to bf16) for a
/// live pair and `0` otherwise (key `nk`, lanes `nq..`, masked pairs and rows outside the block's
/// key range included); `col[i] = Σ_jp (p0 + p1)` in ascending `jp` from 0.
///
/// # Safety
/// The CPU must have AVX-512F/BW/DQ, AVX512-BF16 and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,fma")]
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
    let scv = _mm512_set1_ps(sc * simd::LOG2E);
    for i0 in (0..live.nq).step_by(SB) {
        let exists = live.lanes(i0);
        let (r0, r1) = live.keys(i0 / SB);
        // SAFETY: as in `exp_columns`; pair rows `jp < np` of 16 words from `i0` lie in `pp`.
        unsafe {
            let nu = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(exists, u.as_ptr().add(i0)),
                _mm512_set1_ps(-simd::LOG2E),
            );
            // Pairs whose keys are both live on every lane (a full tile's all, a partial
            // tile's dense run) go without per-key masks; the sum runs in pair order throughout.
            // A run reaching key `nk` takes the last pair too (its missing second key of an odd
            // `nk` is masked either way).
            let (d0, d1) = live.dense(i0 / SB);
            let jd0 = d0.div_ceil(2).min(np);
            let jd1 = if d1 >= live.nk { np } else { d1 / 2 }.max(jd0);
            let block = Block {
                s: s.as_ptr().add(i0),
                tq,
                keys: (r0, r1),
                lanes: (live, exists, i0),
                sc: scv,
                nu,
            };
            let out = pp.as_mut_ptr().add(i0);
            let acc = _mm512_setzero_ps();
            let acc = block.masked_pairs((0, jd0), idx, out, acc);
            let acc = full_block_pairs(
                block.s,
                tq,
                (jd0, jd1, live.nk),
                exists,
                scv,
                nu,
                idx,
                out,
                acc,
            );
            let acc = block.masked_pairs((jd1, np), idx, out, acc);
            _mm512_storeu_ps(col.as_mut_ptr().add(i0), acc);
        }
    }
}

/// [`exp_pairs`] on the pairs `jp0..jp1` of one 16-query block whose keys are all live on the
/// lanes of `exists` (a full tile's, or a partial tile's dense run; `nk` keys in the tile):
/// the same values without the per-key range checks and lane masks, and with plain loads where
/// all 16 lanes exist (measured in place, rdtsc: 7.8k -> 6.5k ticks per full 128 × 128 tile;
/// the loop alone runs 5.5k). Returns the column sums `acc` continued over the pairs.
///
/// # Safety
/// `s` must hold `nk` rows of 16 lanes `tq` apart, `pp` `⌈nk/2⌉` rows of 16 words `tq` apart;
/// AVX-512F/BW/DQ, AVX512-BF16 and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn full_block_pairs(
    s: *const f32,
    tq: usize,
    (jp0, jp1, nk): (usize, usize, usize),
    exists: __mmask16,
    scv: __m512,
    nu: __m512,
    idx: __m512i,
    pp: *mut u32,
    mut acc: __m512,
) -> __m512 {
    for jp in jp0..jp1 {
        // The last pair of an odd `nk` has no second key.
        let m1 = if 2 * jp + 1 < nk { exists } else { 0 };
        // SAFETY: the caller's contract; masked-off lanes are not read.
        unsafe {
            let (x0, x1) = if exists == 0xFFFF && m1 == 0xFFFF {
                (
                    _mm512_loadu_ps(s.add(2 * jp * tq)),
                    _mm512_loadu_ps(s.add((2 * jp + 1) * tq)),
                )
            } else {
                (
                    _mm512_maskz_loadu_ps(exists, s.add(2 * jp * tq)),
                    _mm512_maskz_loadu_ps(m1, s.add((2 * jp + 1) * tq)),
                )
            };
            let p0 = exp2_coarse_in(exists, _mm512_fmadd_ps(x0, scv, nu));
            let p1 = exp2_coarse_in(m1, _mm512_fmadd_ps(x1, scv, nu));
            acc = _mm512_add_ps(acc, _mm512_add_ps(p0, p1));
            let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p1, p0));
            _mm512_storeu_si512(pp.add(jp * tq).cast(), _mm512_permutexvar_epi16(idx, bh));
        }
    }
    acc
}

/// One 16-query block of [`exp_pairs`]: its first lane in key row 0, the live key range, the
/// lane masks, and the scale and negated exponent base.
struct Block<'a> {
    s: *const f32,
    tq: usize,
    keys: (usize, usize),
    lanes: (TileLive<'a>, u16, usize),
    sc: __m512,
    nu: __m512,
}

impl Block<'_> {
    /// [`exp_pairs`] on the pairs `jp0..jp1` of the block with the lane mask of every key (0
    /// outside the block's key range); returns the column sums `acc` continued over them.
    ///
    /// # Safety
    /// `pp` must hold rows `jp0..jp1` of 16 words `tq` apart; the key rows as [`Self::key`];
    /// AVX-512F/BW/DQ, AVX512-BF16 and FMA.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,fma")]
    unsafe fn masked_pairs(
        &self,
        (jp0, jp1): (usize, usize),
        idx: __m512i,
        pp: *mut u32,
        mut acc: __m512,
    ) -> __m512 {
        let (r0, r1) = self.keys;
        for jp in jp0..jp1 {
            // SAFETY: the caller's contract.
            unsafe {
                let dst = pp.add(jp * self.tq).cast();
                let (j0, j1) = (2 * jp, 2 * jp + 1);
                if j1 < r0 || j0 >= r1 {
                    _mm512_storeu_si512(dst, _mm512_setzero_si512());
                    continue;
                }
                let (m0, x0) = self.key(j0);
                let (m1, x1) = self.key(j1);
                let p0 = exp2_coarse_in(m0, x0);
                let p1 = exp2_coarse_in(m1, x1);
                acc = _mm512_add_ps(acc, _mm512_add_ps(p0, p1));
                let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p1, p0));
                _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, bh));
            }
        }
        acc
    }

    /// Key `j`: its live lanes (none outside the key range) and `s·(sc·log2 e) − u·log2 e` on
    /// them.
    ///
    /// # Safety
    /// Key row `j` of the block must be readable when it lies in the key range; AVX-512F, FMA.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn key(&self, j: usize) -> (__mmask16, __m512) {
        let (live, exists, i0) = self.lanes;
        if j < self.keys.0 || j >= self.keys.1 {
            return (0, _mm512_setzero_ps());
        }
        let m = live.live(exists, j, i0, SB);
        // SAFETY: the caller's contract; masked-off lanes are not read.
        let x = unsafe { _mm512_maskz_loadu_ps(m, self.s.add(j * self.tq)) };
        (m, _mm512_fmadd_ps(x, self.sc, self.nu))
    }
}
