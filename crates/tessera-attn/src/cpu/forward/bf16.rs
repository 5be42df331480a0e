//! bf16 forward kernel on AVX512-BF16 (`vdpbf16ps`), used by [`Isa::Avx512Bf16`] when Q, K and
//! V are all bf16. Non-finite inputs keep the f32 kernels' semantics: a non-finite logit from Q
//! or K is masked to an exact 0 or propagates through P; non-finite V entries are packed as 0 and
//! added back exactly for the queries whose bf16 P weight on that key is nonzero.
//!
//! Layout: K and V are packed into bf16 pairs (`u32` = two bf16) per kv tile, each tile once per
//! call by the first item that visits it (so it is read next while still in cache):
//! K `[tkp × ⌈Dqk/2⌉]` (pairs along D), V `[tkp/2 × Dvp]` (pairs of consecutive keys). Per item
//! the unscaled Q tile is packed `[⌈Dqk/2⌉ × tq]` (pairs along D, queries contiguous). For each kv
//! tile: `Sᵀ = K·Qᵀ` by `vdpbf16ps` (f32 accumulation; rows = keys, 4 × 64 register blocks),
//! the scale is folded into the exponent (`exp(scale·s − m)`), the online softmax runs in f32
//! exactly as in the f32 kernel, and `P` is rounded to bf16 pairs along the keys (`[tk/2 × tq]`)
//! for `O += P·V` by `vdpbf16ps` (f32 accumulators in `O`). The column sums `l` use the f32 `P`.
//! Partial tiles use the same live sub-block spans as the f32 kernel ([`crate::cpu::live_blocks`]),
//! one product per run of key groups sharing a column range, with the masked column max taken
//! from the product's registers (no pass over `Sᵀ` for it).
//!
//! On [`Isa::Avx512Amx`] the two products run on AMX tiles (`crate::cpu::amx`) where their
//! extents allow (`Sᵀ` always: K and Q packed with pairs along D padded by zeros to a multiple
//! of 16, so K is read in place only when no padding is needed; `P·V` where padded kv tiles are
//! a multiple of 32 keys, else `vdpbf16ps` as above): `Sᵀ` for whole tiles, partial ones
//! included (16-key row blocks; a last 4, 8 or 12 keys on `vdpbf16ps`), then masked and
//! maximised like an unfused tile; `O += P·V` over all the tile's key pairs from `P` transposed to queries by pairs (the
//! tile unit reads A by rows), zero where masked. Same softmax, same rounding of P: the outputs
//! differ from the `vdpbf16ps` ones only by summation order.
//!
//! Telemetry: `item` is generic over [`crate::cpu::forward::TileObserver`] like the f32 kernel
//! (production: `NoTelemetry`, hooks compiled out). An observing copy gets every hook with the
//! trait's semantics, per key row (both keys of a pair) with the f32 P before rounding, so its
//! outputs are bit-identical to the production copy's.
//!
//! Accuracy: products of bf16 inputs are exact in f32, so S matches the f32 kernel up to
//! summation order; rounding P to bf16 adds ≤ 2⁻⁹ relative error per weight (FlashAttention does
//! the same), so P's exponential is the cheaper `simd::exp2_coarse` (base 2, the scale and
//! `log2 e` folded into the argument's FMA; ≤ 3e-6 relative, in the weights and in the sums `l`
//! alike); O stays well inside the 1e-2 bf16 tolerance. Deterministic: fixed loop order, no
//! atomics, each output written by one item.

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::{item, run, Ctx};

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn run(
    _isa: crate::cpu::isa::Isa,
    prep: crate::cpu::prepare::Prep<'_>,
    d: &crate::validate::Dims,
    inputs: &crate::args::AttnInputs<'_>,
    options: &crate::options::AttnOptions,
    out: crate::args::ForwardOut<'_>,
    rest: crate::cpu::workspace::Rest<'_>,
) -> tessera_core::Result<()> {
    crate::cpu::forward::run(
        crate::cpu::isa::Isa::Portable,
        prep,
        d,
        inputs,
        options,
        out,
        rest,
    )
}

/// `u32` words of packed K and V a bf16 forward of `d` keeps in the workspace (`amx`: on
/// [`crate::cpu::isa::Isa::Avx512Amx`], whose K rows are padded to a multiple of 16 pairs).
pub(crate) fn pack_words(plan: &tessera_plan::Plan, d: &crate::validate::Dims, amx: bool) -> usize {
    let tkp = crate::cpu::tile_matmul::round_up(plan.tile.kv, 16);
    let blocks = d.batch * d.heads_kv * plan.kv_tiles;
    blocks
        * (tkp * k_row_words(d.d_qk, amx) + tkp / 2 * crate::cpu::tile_matmul::round_up(d.d_v, 16))
}

/// Words of a packed K row (pairs along D): `⌈Dqk/2⌉`, padded to a multiple of 16 on AMX.
fn k_row_words(d_qk: usize, amx: bool) -> usize {
    let pairs = d_qk.div_ceil(2);
    if amx {
        crate::cpu::tile_matmul::round_up(pairs, 16)
    } else {
        pairs
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use crate::args::{AttnInputs, ForwardOut};
    use crate::cpu::amx;
    use crate::cpu::column_softmax::{self, TileLive};
    use crate::cpu::forward::{self, NoTelemetry, TileObserver};
    use crate::cpu::isa::Isa;
    use crate::cpu::live_blocks::LiveBlocks;
    use crate::cpu::load_tile::transpose16_words;
    use crate::cpu::load_tile::Src;
    use crate::cpu::mask_partial_tile::{mask_partial_row, MasksT};
    use crate::cpu::online_softmax::{self, column_max, finish_row};
    use crate::cpu::prepare::Prep;
    use crate::cpu::simd::{self, Avx512, Simd};
    use crate::cpu::tile_matmul::{round_up, RB};
    use crate::cpu::tile_matmul_bf16::{
        dot_gemm, dot_gemm_acc_groups, dot_gemm_masked_max, dot_gemm_tiles, pair, round_bits,
        tiles_acc_transposed,
    };
    use crate::cpu::workspace::{grown, Bufs, Rest};
    use crate::options::AttnOptions;
    use crate::validate::Dims;
    use half::bf16;
    use std::arch::x86_64::*;
    use std::marker::PhantomData;
    use std::sync::OnceLock;
    use tessera_core::Result;
    use tessera_plan::Plan;

    const NEG_INF: f32 = f32::NEG_INFINITY;

    /// The per-call state of the kernel: inputs packed to bf16 pairs, masks, options.
    pub(crate) struct Ctx<'a> {
        plan: &'a Plan,
        d: Dims,
        tq: usize,
        tkp: usize,
        dpair: usize,
        /// Words per packed K row (and rows of the packed Q): `dpair`, padded with zero pairs
        /// to a multiple of 16 on AMX (a tile reads 16 pairs).
        dkp: usize,
        dvp: usize,
        q: Src<'a>,
        qx: &'a [bf16],
        /// K and V's bf16 storage (the rows `ks` and `vs` address), read when packing a block.
        kx: &'a [bf16],
        /// Packed K, when K is not read in place (`tkp × dkp` words per kv block).
        kp: PackBuf<'a>,
        /// K read in place as its own 32-bit words (pairs along D) and the row stride in
        /// words, when its layout allows (see `Ctx::new`); then `kp` is empty.
        k_words: Option<(&'a [u32], usize)>,
        ks: Src<'a>,
        vs: Src<'a>,
        vx: &'a [bf16],
        /// Packed V (`tkp / 2 × dvp` words per kv block).
        vp: PackBuf<'a>,
        /// Per kv block (batch, kv head, kv tile): set once the block is packed, by the first
        /// item that visits it ([`Ctx::block`]), to the block's non-finite V entries.
        blocks: Vec<OnceLock<Vec<Fixup>>>,
        masks_t: &'a MasksT,
        live: &'a LiveBlocks,
        scale: f32,
        softcap: Option<f32>,
        sinks: Option<&'a [f32]>,
        /// The tile unit of `Sᵀ = K·Qᵀ` ([`Isa::Avx512Amx`]; K and Q packed with `dkp` pairs),
        /// else `None` (`vdpbf16ps`).
        amx_qk: Option<amx::Kind>,
        /// The tile unit of `O += P·V` ([`Isa::Avx512Amx`] with a multiple of 32 padded keys
        /// per tile), else `None`.
        amx_pv: Option<amx::Kind>,
    }

    /// A non-finite V entry: key pair `jp`, `half` (0: even key), column `col`, value `val`.
    #[derive(Clone, Copy)]
    struct Fixup {
        jp: usize,
        half: usize,
        col: usize,
        val: f32,
    }

    /// A workspace buffer of packed kv blocks shared by the workers of one call. Each block's
    /// words are written once, inside that block's `OnceLock` initialisation ([`Ctx::block`]),
    /// and read only after it returned, which orders the writes before every read.
    struct PackBuf<'a> {
        ptr: *mut u32,
        len: usize,
        _buf: PhantomData<&'a mut [u32]>,
    }

    // SAFETY: the buffer is exclusively borrowed for `'a`; blocks are disjoint, each written by
    // one thread inside its `OnceLock` initialisation and read only after it (see `PackBuf`).
    unsafe impl Sync for PackBuf<'_> {}
    // SAFETY: as above; the pointer is only a view of the borrowed buffer.
    unsafe impl Send for PackBuf<'_> {}

    impl<'a> PackBuf<'a> {
        fn new(buf: &'a mut [u32]) -> Self {
            PackBuf {
                ptr: buf.as_mut_ptr(),
                len: buf.len(),
                _buf: PhantomData,
            }
        }

        /// Words `r` to write.
        ///
        /// # Safety
        /// Only inside the `OnceLock` initialisation of the block that owns `r`.
        #[allow(clippy::mut_from_ref)]
        unsafe fn write(&self, r: std::ops::Range<usize>) -> &mut [u32] {
            assert!(r.start <= r.end && r.end <= self.len, "PackBuf: range");
            // SAFETY: in bounds (asserted); no other reference to the range exists (caller).
            unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
        }

        /// Words `r` to read.
        ///
        /// # Safety
        /// Only after the `OnceLock` of the block that owns `r` was initialised.
        unsafe fn read(&self, r: std::ops::Range<usize>) -> &[u32] {
            assert!(r.start <= r.end && r.end <= self.len, "PackBuf: range");
            // SAFETY: in bounds (asserted); written before and never again (caller).
            unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
        }
    }

    /// A per-worker workspace.
    pub(crate) struct Ws {
        qp: Vec<u32>,
        s: Vec<f32>,
        pp: Vec<u32>,
        /// `pp` transposed (`[tq × tkp / 2]`: queries by key pairs), the A operand of the
        /// AMX `P·V`.
        ppt: Vec<u32>,
        o: Vec<f32>,
        m: Vec<f32>,
        l: Vec<f32>,
        m_use: Vec<f32>,
        alpha: Vec<f32>,
        col: Vec<f32>,
        raw_max: Vec<f32>,
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
        if d.dtype != tessera_core::DType::BF16 {
            return forward::run(FALLBACK, prep, d, inputs, options, out, rest);
        }
        let Rest { items, bufs } = rest;
        let Bufs {
            kpack,
            vpack,
            maxes,
            ..
        } = bufs;
        let cx = Ctx::new(isa, prep, d, inputs, options, kpack, vpack)?;
        forward::schedule(
            prep.plan,
            d,
            out,
            items,
            maxes,
            || cx.workspace(),
            // SAFETY: this kernel is only selected as `Isa::Avx512Bf16` or `Isa::Avx512Amx`,
            // which are handed out only when the CPU has AVX-512F/BW/VL, FMA and AVX512-BF16.
            |ws, it| unsafe { item(&cx, ws, it, &mut NoTelemetry) },
            |it| it.prefetch(prep.plan, cx.q),
        )
    }

    /// Packs two V rows `v0`, `v1` (`None`: zeros) into `dst` as pairs of keys per column
    /// (`dst[c]` = `v0[c]` low, `v1[c]` high), 16 columns per step; returns whether every value
    /// read is finite (bf16 exponent not all ones), so the kernel needs no separate pass over V.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn pack_v_pair(v0: &[bf16], v1: Option<&[bf16]>, dst: &mut [u32]) -> bool {
        let n = dst.len();
        assert!(v0.len() >= n && v1.is_none_or(|v| v.len() >= n));
        let exp = _mm256_set1_epi16(0x7F80);
        let mut bad: __mmask16 = 0;
        for c in (0..n).step_by(16) {
            let lanes: __mmask16 = if n - c >= 16 {
                0xFFFF
            } else {
                (1 << (n - c)) - 1
            };
            // SAFETY: lanes `c..n` of `v0`, `v1` and `dst` exist (asserted); masked-off lanes
            // are neither read nor written.
            unsafe {
                let lo = _mm256_maskz_loadu_epi16(lanes, v0.as_ptr().add(c).cast());
                let hi = match v1 {
                    Some(v) => _mm256_maskz_loadu_epi16(lanes, v.as_ptr().add(c).cast()),
                    None => _mm256_setzero_si256(),
                };
                bad |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(lo, exp), exp)
                    | _mm256_cmpeq_epi16_mask(_mm256_and_si256(hi, exp), exp);
                let w = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(lo),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
                );
                _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(c).cast(), lanes, w);
            }
        }
        bad == 0
    }

    /// The f32 kernel copy that runs for inputs that are not bf16.
    pub(crate) const FALLBACK: Isa = Isa::Avx512;

    impl<'a> Ctx<'a> {
        /// The call's state over bf16 inputs (checked by the caller), with the workspace's
        /// buffers for packed K and V; no block is packed yet ([`Ctx::block`]). `isa`
        /// [`Isa::Avx512Amx`] puts the products on AMX tiles where their extents allow.
        pub(crate) fn new(
            isa: Isa,
            prep: Prep<'a>,
            d: &Dims,
            inputs: &AttnInputs<'a>,
            options: &'a AttnOptions,
            kpack: &'a mut Vec<u32>,
            vpack: &'a mut Vec<u32>,
        ) -> Result<Self> {
            let plan = prep.plan;
            let (qs, ks, vs) = (
                Src::new(&inputs.q)?,
                Src::new(&inputs.k)?,
                Src::new(&inputs.v)?,
            );
            let (Some(qx), Some(kx), Some(vx)) = (qs.bf16(), ks.bf16(), vs.bf16()) else {
                return Err(tessera_core::Error::Internal(
                    "bf16 kernel handed non-bf16 inputs".into(),
                ));
            };
            let tq = round_up(plan.tile.q, 16);
            let tkp = round_up(plan.tile.kv, 16);
            let dpair = d.d_qk.div_ceil(2);
            let dvp = round_up(d.d_v, 16);
            let blocks = d.batch * d.heads_kv * plan.kv_tiles;
            let unit = if isa == Isa::Avx512Amx {
                amx::unit()
            } else {
                None
            };
            let dkp = super::k_row_words(d.d_qk, unit.is_some());
            // K pairs along D are the rows' own 32-bit words: read K in place when every row
            // starts on a word and every tile's rows fill whole RB-row blocks (no zero padding
            // rows needed), which saves a copy of K per call.
            // SAFETY: u16-backed bf16 and u32 are plain integers; `align_to` only yields the
            // aligned middle part.
            let (pre, words, _) = unsafe { kx.align_to::<u32>() };
            let k_words = (pre.is_empty()
                && d.d_qk.is_multiple_of(2)
                && ks.strides_even()
                && plan.tile.kv.is_multiple_of(RB)
                && d.kv_len.is_multiple_of(RB)
                && dkp == dpair)
                .then_some((words, ks.ld() / 2));
            // Words of packed K: none when K is read in place.
            let kp_len = if k_words.is_some() {
                0
            } else {
                blocks * tkp * dkp
            };
            Ok(Ctx {
                plan,
                d: *d,
                tq,
                tkp,
                dpair,
                dkp,
                dvp,
                q: qs,
                qx,
                kx,
                kp: PackBuf::new(grown(kpack, kp_len)),
                k_words,
                ks,
                vs,
                vx,
                vp: PackBuf::new(grown(vpack, blocks * (tkp / 2) * dvp)),
                blocks: (0..blocks).map(|_| OnceLock::new()).collect(),
                masks_t: &prep.data.masks_t,
                live: &prep.data.live,
                scale: options.scale_for(d.d_qk),
                softcap: options.softcap,
                sinks: options.sinks.as_deref(),
                amx_qk: unit,
                amx_pv: unit.filter(|_| tkp.is_multiple_of(2 * amx::TW)),
            })
        }

        /// Kv block `blk` (batch, kv head, kv tile) packed, by this call if no item did it
        /// before (a packed block is read by the items that visit it next, while it is still
        /// in cache; the blocks no item visits are never packed); returns its non-finite V
        /// entries.
        fn block(&self, blk: usize) -> &[Fixup] {
            self.blocks[blk].get_or_init(|| self.pack_block(blk))
        }

        /// Packs kv block `blk`: K (unless read in place) as pairs along D, V as pairs of keys,
        /// both zero padded to `tkp` keys. Non-finite V values (only V matters: a non-finite
        /// logit from Q or K is masked to an exact 0 or propagates through P, as in the f32
        /// kernel) are packed as 0 and returned, to be added back per tile for the queries
        /// whose bf16 P weight on that key is nonzero, so 0·NaN never appears and rows that
        /// cannot attend the key keep the bits of a clean run. Call only from [`Ctx::block`].
        fn pack_block(&self, blk: usize) -> Vec<Fixup> {
            let (plan, d) = (self.plan, &self.d);
            let (tkp, dpair, dkp, dvp) = (self.tkp, self.dpair, self.dkp, self.dvp);
            let (dqk, dv, nkt) = (d.d_qk, d.d_v, plan.kv_tiles);
            let (bg, kt) = (blk / nkt, blk % nkt);
            let (b, g) = (bg / d.heads_kv, bg % d.heads_kv);
            let (k0, k1) = plan.kv_range(kt);
            let nk = k1 - k0;
            let bits = |x: &bf16| x.to_bits();
            if self.k_words.is_none() {
                // SAFETY: inside block `blk`'s initialisation; the range is that block's.
                let kd = unsafe { self.kp.write(blk * tkp * dkp..(blk + 1) * tkp * dkp) };
                // Padding keys are zero (the buffer is reused: clear them explicitly).
                kd[nk * dkp..].fill(0);
                for j in 0..nk {
                    let off = self.ks.row(b, g, k0 + j);
                    let (src, row) = (&self.kx[off..off + dqk], &mut kd[j * dkp..(j + 1) * dkp]);
                    let (dst, pad) = row.split_at_mut(dpair);
                    pad.fill(0);
                    // Pairs along D are the row's own bytes: a straight (vectorized) copy.
                    for (o, p) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *o = pair(bits(&p[0]), bits(&p[1]));
                    }
                    if dqk % 2 == 1 {
                        dst[dpair - 1] = pair(bits(&src[dqk - 1]), 0);
                    }
                }
            }
            // SAFETY: as above.
            let vd = unsafe {
                self.vp
                    .write(blk * (tkp / 2) * dvp..(blk + 1) * (tkp / 2) * dvp)
            };
            vd[nk.div_ceil(2) * dvp..].fill(0);
            let (vs, vx) = (self.vs, self.vx);
            let mut finite = true;
            for jp in 0..nk.div_ceil(2) {
                let off0 = vs.row(b, g, k0 + 2 * jp);
                let dst = &mut vd[jp * dvp..(jp + 1) * dvp];
                dst[dv..].fill(0);
                let v1 = (2 * jp + 1 < nk).then(|| {
                    let off1 = vs.row(b, g, k0 + 2 * jp + 1);
                    &vx[off1..off1 + dv]
                });
                // SAFETY: this kernel runs only where the CPU has AVX-512F/BW/VL.
                finite &= unsafe { pack_v_pair(&vx[off0..off0 + dv], v1, &mut dst[..dv]) };
            }
            let mut fix = Vec::new();
            if finite {
                return fix;
            }
            for j in 0..nk {
                let off = vs.row(b, g, k0 + j);
                for (col, x) in vx[off..off + dv].iter().enumerate() {
                    if x.is_finite() {
                        continue;
                    }
                    let half = j % 2;
                    vd[(j / 2) * dvp + col] &= if half == 0 { 0xFFFF_0000 } else { 0x0000_FFFF };
                    fix.push(Fixup {
                        jp: j / 2,
                        half,
                        col,
                        val: x.to_f32(),
                    });
                }
            }
            fix
        }

        /// A fresh per-worker workspace.
        pub(crate) fn workspace(&self) -> Ws {
            let (tq, tkp, dvp) = (self.tq, self.tkp, self.dvp);
            let z = |n: usize| vec![0f32; n];
            Ws {
                qp: vec![0u32; self.dkp * tq],
                s: z(tkp * tq),
                pp: vec![0u32; tkp / 2 * tq],
                ppt: Vec::new(),
                o: z(tq * dvp),
                m: z(tq),
                l: z(tq),
                m_use: z(tq),
                alpha: z(tq),
                col: z(tq),
                raw_max: z(tq),
            }
        }
    }

    /// One work item, observed by `obs` (production: [`NoTelemetry`], whose hooks compile to
    /// nothing).
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL, FMA and AVX512-BF16 (`Isa::Avx512Bf16`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
    pub(crate) unsafe fn item<T: TileObserver>(
        cx: &Ctx<'_>,
        ws: &mut Ws,
        mut it: forward::FwdItem<'_>,
        obs: &mut T,
    ) {
        let (plan, d) = (cx.plan, &cx.d);
        let (b, h) = (it.b, it.h);
        let kvh = h / d.group();
        let (q0, q1) = plan.q_range(it.qt);
        let nq = q1 - q0;
        let (mq, nqp) = (round_up(nq, RB), round_up(nq, 16));
        let (dqk, dv, dvp, tq, tkp, dpair) = (d.d_qk, d.d_v, cx.dvp, cx.tq, cx.tkp, cx.dpair);
        let dkp = cx.dkp;
        let nkt = plan.kv_tiles;
        let Ws {
            qp,
            s,
            pp,
            ppt,
            o,
            m,
            l,
            m_use,
            alpha,
            col,
            raw_max,
        } = ws;
        // A pooled workspace may come from a call on another kernel copy: grown to what this
        // call reads (Q rows padded to `dkp` pairs, zero past `dpair`; `P` transposed on AMX).
        let qp = grown(qp, dkp * tq);
        qp[dpair * tq..].fill(0);
        let ppt = grown(
            ppt,
            if cx.amx_pv.is_some() {
                tq * (tkp / 2)
            } else {
                0
            },
        );
        // Q pairs along D, queries contiguous; padding queries zero.
        let (q_off, qld) = (cx.q.row(b, h, q0), cx.q.ld());
        // Whole 16-query × 16-pair blocks: the pairs are the rows' own 32-bit words, so when
        // rows start on a word (even offset and stride) a register transpose moves them.
        let mut done = 0;
        let blocks = nq / 16 * 16;
        if blocks > 0
            && dpair.is_multiple_of(16)
            && dqk == 2 * dpair
            && q_off.is_multiple_of(2)
            && qld.is_multiple_of(2)
            && q_off + (blocks - 1) * qld + dqk <= cx.qx.len()
            && qp.len() >= (dpair - 1) * tq + blocks
        {
            let (src, dst) = (cx.qx.as_ptr().cast::<u32>(), qp.as_mut_ptr());
            for i0 in (0..blocks).step_by(16) {
                for dp0 in (0..dpair).step_by(16) {
                    // SAFETY: rows i0..i0 + 16 <= nq of words dp0..dp0 + 16 <= dpair lie inside
                    // `qx` and their transposed places inside `qp` (checked above); AVX-512F is
                    // part of this kernel's features.
                    unsafe {
                        transpose16_words(
                            src.add((q_off + i0 * qld) / 2 + dp0),
                            qld / 2,
                            dst.add(dp0 * tq + i0),
                            tq,
                        )
                    }
                }
            }
            done = blocks;
        }
        for dp in 0..dpair {
            let row = &mut qp[dp * tq..(dp + 1) * tq];
            for (i, x) in row[..nq].iter_mut().enumerate().skip(done) {
                let off = q_off + i * qld + 2 * dp;
                let hi = if 2 * dp + 1 < dqk {
                    cx.qx[off + 1].to_bits()
                } else {
                    0
                };
                *x = pair(cx.qx[off].to_bits(), hi);
            }
            row[nq..nqp].fill(0);
        }
        o[..mq * dvp].fill(0.0);
        m[..nq].fill(NEG_INF);
        l[..nq].fill(0.0);
        raw_max[..nq].fill(NEG_INF);

        for e in plan.head_plan(b, h).row(it.qt) {
            let kt = e.tile as usize;
            let (k0, k1) = plan.kv_range(kt);
            let nk = k1 - k0;
            let mk = round_up(nk, RB);
            let blk = (b * d.heads_kv + kvh) * nkt + kt;
            let fix = cx.block(blk);
            // SAFETY (both reads): `cx.block(blk)` returned, so block `blk` is packed.
            let (kp, kld) = match cx.k_words {
                Some((words, ld)) => (&words[cx.ks.row(b, kvh, k0) / 2..], ld),
                None => (
                    unsafe { cx.kp.read(blk * tkp * dkp..(blk + 1) * tkp * dkp) },
                    dkp,
                ),
            };
            let vp = unsafe {
                cx.vp
                    .read(blk * (tkp / 2) * dvp..(blk + 1) * (tkp / 2) * dvp)
            };
            let full = e.is_full();
            let span = |j: usize| cx.live.row_span(full, e.mask, j, nq);
            // Full tiles without padding key rows get the raw column max fused into the product.
            let fused_max = full && mk == nk;
            // Without per-key hooks or softcap, 16 queries at a time (`column_softmax`).
            let by_column = !T::OBSERVES && cx.softcap.is_none();
            let tile = if full {
                TileLive::full(nq, nk)
            } else {
                TileLive::partial(nq, nk, cx.masks_t, cx.live, e.mask)
            };
            col[..nqp].fill(NEG_INF);
            // On AMX the whole tile's logits (16-key row blocks; a last 4, 8 or 12 keys on
            // `vdpbf16ps`), then the masks and the column max over them as for unfused tiles.
            let m16 = mk / amx::TW * amx::TW;
            let on_amx = cx.amx_qk.is_some() && m16 > 0;
            if let (Some(unit), true) = (cx.amx_qk, on_amx) {
                // SAFETY: `unit` came from `amx::unit`; this kernel's CPU features.
                unsafe {
                    dot_gemm_tiles(unit, (mk, nqp, dpair, dkp), (kp, kld), (qp, tq), (s, tq))
                };
                for j in (0..nk).filter(|_| !full && !by_column) {
                    let (a, bb) = span(j);
                    mask_partial_row(
                        &mut s[j * tq..j * tq + bb],
                        cx.masks_t.row(e.mask, j),
                        a,
                        NEG_INF,
                    );
                }
            } else if fused_max {
                dot_gemm::<false, true>(mk, nqp, dpair, kp, kld, 1, qp, tq, s, tq, col);
            } else if full {
                dot_gemm::<false, false>(mk, nqp, dpair, kp, kld, 1, qp, tq, s, tq, col);
            } else {
                for (r0, r1, c0, c1) in cx.live.col_runs(e.mask, mk, RB) {
                    let (a, b) = (&kp[r0 * kld..], &qp[c0..]);
                    let c = &mut s[r0 * tq + c0..];
                    if by_column {
                        // The masked column max while the products are in registers.
                        let (bits, stride) = cx.masks_t.bytes_from(e.mask, r0);
                        dot_gemm_masked_max(
                            r1 - r0,
                            c1 - c0,
                            dpair,
                            (a, kld),
                            (b, tq),
                            (c, tq),
                            &mut col[c0..],
                            (&bits[c0 / 8..], stride),
                        );
                    } else {
                        dot_gemm::<false, false>(
                            r1 - r0,
                            c1 - c0,
                            dpair,
                            a,
                            kld,
                            1,
                            b,
                            tq,
                            c,
                            tq,
                            &mut [],
                        );
                    }
                }
                for j in (0..nk).filter(|_| !by_column) {
                    let (a, bb) = span(j);
                    mask_partial_row(
                        &mut s[j * tq..j * tq + bb],
                        cx.masks_t.row(e.mask, j),
                        a,
                        NEG_INF,
                    );
                }
            }
            // Max of the raw logits; the scale (> 0) commutes with the max.
            let mut sc = cx.scale;
            if cx.softcap.is_some() {
                for j in 0..nk {
                    let (a, bb) = span(j);
                    simd::scale_row(&mut s[j * tq + a..j * tq + bb], cx.scale);
                }
                sc = 1.0;
            }
            // The max was fused into the product for full tiles without padding key rows and,
            // masked, for partial tiles walked by column.
            let fused = !on_amx && (fused_max || (!full && by_column));
            if !fused && by_column {
                // SAFETY: this kernel runs only where the CPU has AVX-512F.
                unsafe { column_softmax::column_max::<Avx512>(s, tq, tile, col) };
            } else if !fused {
                for j in 0..nk {
                    let (a, bb) = span(j);
                    column_max(&s[j * tq..j * tq + bb], &mut col[..bb], a);
                }
            }
            // The fused max is of the unscaled logits; the pass above saw them scaled in place
            // when a softcap is on.
            let cfac = if fused { cx.scale } else { sc };
            for (c, r) in col[..nq].iter_mut().zip(raw_max[..nq].iter_mut()) {
                *c *= cfac;
                *r = if *c > *r { *c } else { *r };
            }
            if let Some(cap) = cx.softcap {
                col[..nq].fill(NEG_INF);
                for j in 0..nk {
                    let (a, bb) = span(j);
                    simd::softcap_row::<Avx512>(&mut s[j * tq + a..j * tq + bb], cap);
                    column_max(&s[j * tq..j * tq + bb], &mut col[..bb], a);
                }
            }
            online_softmax::update_max::<Avx512>(
                &col[..nq],
                &mut m[..nq],
                &mut m_use[..nq],
                &mut alpha[..nq],
            );
            col[..nqp].fill(0.0);
            m_use[nq..nqp].fill(0.0);
            if by_column {
                // SAFETY: this kernel runs only where the CPU has AVX-512F/BW, AVX512-BF16 and FMA.
                unsafe { column_softmax::exp_pairs(s, tq, tile, m_use, sc, col, pp) };
            }
            // P = exp(sc·s − m) in f32 for the sums, rounded to bf16 pairs of keys for P·V.
            for jp in (0..nk.div_ceil(2)).filter(|_| !by_column) {
                let (j0, j1) = (2 * jp, 2 * jp + 1);
                let (a, bb) = span(j0);
                let has1 = j1 < nk;
                let bp = round_up(bb, 16);
                let prow = &mut pp[jp * tq..jp * tq + nqp];
                prow[..a].fill(0);
                prow[bp..].fill(0);
                if T::OBSERVES {
                    // Observed copy: the hooks take one key row at a time, so each key's f32 P
                    // (the values of the loop below, bit for bit) replaces its logits in `s`.
                    let (r0, r1) = s.split_at_mut(j1 * tq);
                    let (r0, r1) = (&mut r0[j0 * tq..j0 * tq + bp], &mut r1[..bp]);
                    exp_row(obs, r0, &m_use[..bp], a, bb, sc);
                    obs.after_exp(k0 + j0, a, &r0[a..bb]);
                    if has1 {
                        exp_row(obs, r1, &m_use[..bp], a, bb, sc);
                        obs.after_exp(k0 + j1, a, &r1[a..bb]);
                    } else {
                        r1[a..].fill(0.0);
                    }
                    let lanes = prow[a..bp]
                        .iter_mut()
                        .zip(col[a..bp].iter_mut())
                        .zip(r0[a..].iter().zip(&r1[a..]));
                    for ((pv, c), (&p0, &p1)) in lanes {
                        *c += p0 + p1;
                        *pv = round_bits(p0) | round_bits(p1) << 16;
                    }
                    continue;
                }
                let (r0, r1) = s.split_at(j1 * tq);
                let (r0, r1) = (&r0[j0 * tq..j0 * tq + bp], &r1[..bp]);
                p_pairs(
                    &mut prow[a..bp],
                    &mut col[a..bp],
                    &r0[a..],
                    &r1[a..],
                    &m_use[a..bp],
                    bb - a,
                    has1,
                    sc,
                );
            }
            for i in 0..nq {
                l[i] = l[i] * alpha[i] + col[i];
            }
            for i in (0..nq).filter(|&i| alpha[i] != 1.0) {
                simd::scale_row(&mut o[i * dvp..i * dvp + dv], alpha[i]);
            }
            obs.on_tile(&col[..nq], &m_use[..nq], &alpha[..nq]);
            if let Some(unit) = cx.amx_pv {
                // `O += P·V` over every key pair of the tile (P is exactly 0 where masked; V's
                // padding pairs are zero).
                let (dims, src) = ((nqp, dvp, nk.div_ceil(2)), (&mut pp[..], tq));
                // SAFETY: `unit` came from `amx::unit`; AVX-512F is this kernel's.
                unsafe { tiles_acc_transposed(unit, dims, src, ppt, (vp, dvp), (o, dvp)) };
            } else if full {
                dot_gemm::<true, false>(
                    mq,
                    dvp,
                    nk.div_ceil(2),
                    pp,
                    1,
                    tq,
                    vp,
                    dvp,
                    o,
                    dvp,
                    &mut [],
                );
            } else {
                // Each query group over its own key range, in one call.
                let pairs = |g: usize| {
                    let (r0, r1) = cx.live.group_keys(e.mask, g);
                    if r0 < r1 {
                        (r0 / 2, r1.div_ceil(2))
                    } else {
                        (0, 0)
                    }
                };
                dot_gemm_acc_groups(
                    (mq / RB, dvp, nk.div_ceil(2)),
                    pairs,
                    (pp, 1, tq),
                    (vp, dvp),
                    (o, dvp),
                );
            }
            for f in fix {
                let row = &pp[f.jp * tq..f.jp * tq + nq];
                for (i, &w) in row.iter().enumerate() {
                    let pb = (w >> (16 * f.half)) & 0xFFFF;
                    if pb != 0 {
                        o[i * dvp + f.col] += f32::from_bits(pb << 16) * f.val;
                    }
                }
            }
        }

        let sink = cx.sinks.map(|x| x[h] as f64);
        let mut any_nan = false;
        for i in 0..nq {
            let orow = &mut o[i * dvp..i * dvp + dv];
            let (factor, lse) = finish_row::<Avx512>(l[i], m_use[i], sink, orow);
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
    }

    /// One key pair's bf16 P row and column sums, 16 queries per step: for every lane `i`
    /// (`prow.len()` a multiple of 16), `p0 = 2^(r0[i]·(sc·log2 e) − u[i]·log2 e)` and `p1`
    /// likewise from `r1` (0 when `i >= live` or, for `p1`, without a second key),
    /// `col[i] += p0 + p1`, and `prow[i]` = the two rounded to bf16 (`p0` in the low half), the
    /// same values as [`round_bits`] (`vcvtne2ps2bf16` rounds to nearest even).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")]
    #[allow(clippy::too_many_arguments)]
    fn p_pairs(
        prow: &mut [u32],
        col: &mut [f32],
        r0: &[f32],
        r1: &[f32],
        u: &[f32],
        live: usize,
        has1: bool,
        sc: f32,
    ) {
        use std::arch::x86_64::*;
        let n = prow.len();
        assert!(
            n.is_multiple_of(16)
                && col.len() >= n
                && r0.len() >= n
                && r1.len() >= n
                && u.len() >= n,
            "p_pairs: extents"
        );
        // Word 2i of the packed vector takes p0's lane i (low half of the conversion), word
        // 2i + 1 takes p1's (high half).
        let idx: [u16; 32] = std::array::from_fn(|w| (w / 2 + 16 * (w % 2)) as u16);
        // SAFETY: the `idx` array is 64 bytes.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
        let scv = _mm512_set1_ps(sc * simd::LOG2E);
        let mut i = 0;
        while i < n {
            let left = live.saturating_sub(i);
            let m0: __mmask16 = if left >= 16 {
                0xFFFF
            } else {
                (1u16 << left) - 1
            };
            let m1 = if has1 { m0 } else { 0 };
            // SAFETY: `i + 16 <= n` and every slice holds `n` lanes (asserted above).
            unsafe {
                let uv = _mm512_loadu_ps(u.as_ptr().add(i));
                let x0 = _mm512_loadu_ps(r0.as_ptr().add(i));
                let x1 = _mm512_loadu_ps(r1.as_ptr().add(i));
                let nu = _mm512_mul_ps(uv, _mm512_set1_ps(-simd::LOG2E));
                let p0 = simd::x512::exp2_coarse_in(m0, _mm512_fmadd_ps(x0, scv, nu));
                let p1 = simd::x512::exp2_coarse_in(m1, _mm512_fmadd_ps(x1, scv, nu));
                let cp = col.as_mut_ptr().add(i);
                _mm512_storeu_ps(
                    cp,
                    _mm512_add_ps(_mm512_loadu_ps(cp), _mm512_add_ps(p0, p1)),
                );
                let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p1, p0));
                _mm512_storeu_si512(
                    prow.as_mut_ptr().add(i).cast(),
                    _mm512_permutexvar_epi16(idx, bh),
                );
            }
            i += 16;
        }
    }

    /// `row[i] = p_i = exp(sc·s_i − m_use_i)` over the live span `a..bb` of one key row (as the
    /// plain P loop computes it), 0 on the padding lanes after it; with the observer's entropy
    /// accumulator, also `acc[i − a] += p_i · max(sc·s_i − m_use_i, −88)` (see
    /// `TileObserver::entropy_terms`).
    #[inline(always)]
    fn exp_row<T: TileObserver>(
        obs: &mut T,
        row: &mut [f32],
        m_use: &[f32],
        a: usize,
        bb: usize,
        sc: f32,
    ) {
        let (live, mu) = (&mut row[a..bb], &m_use[a..bb]);
        // In base 2, with the arguments `exp_pairs` forms.
        let sc2 = sc * simd::LOG2E;
        if let Some(acc) = obs.entropy_terms(a, bb) {
            for ((x, &u), e) in live.iter_mut().zip(mu).zip(acc.iter_mut()) {
                let d = Avx512::madd(*x, sc, -u);
                let p = simd::exp2_coarse::<Avx512>(Avx512::madd(*x, sc2, -(u * simd::LOG2E)));
                *x = p;
                *e += p * if d > -88.0 { d } else { -88.0 };
            }
        } else {
            for (x, &u) in live.iter_mut().zip(mu) {
                *x = simd::exp2_coarse::<Avx512>(Avx512::madd(*x, sc2, -(u * simd::LOG2E)));
            }
        }
        row[bb..].fill(0.0);
    }
}
