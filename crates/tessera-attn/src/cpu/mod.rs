//! The CPU backend: tiled online-softmax flash attention driven by the plan's work lists.
//!
//! Contract:
//! - Forward work items are (batch, query head, q-tile); each walks its forward work-list row
//!   (empty tiles are never touched, full tiles do no masking work, partial tiles apply their
//!   bitmask) and writes its own disjoint slice of O and LSE.
//! - Backward runs a Δ pre-pass, then dK/dV items (batch, kv head, kv-tile) walking the kv-major
//!   lists of every query head of the GQA group in a fixed order and writing each tile's dQ
//!   contribution to its own scratch slot, then dQ items (batch, query head, q-tile) summing
//!   their slots in q-major list order. No atomics; each output element is produced by exactly
//!   one item in a fixed order, so results are bit-identical run to run (for any thread count).
//! - Items run on the rayon pool, longest work list first (dynamic pull from a sorted queue).
//! - Per-thread workspace is bounded by the tile sizes and head dims; nothing of size Lq·Lkv.
//! - Hot loops are generic code compiled three times (AVX-512F/BW/VL+FMA, AVX2+FMA, portable)
//!   and selected at run time; [`Isa`] names the copy in use. With AVX512-BF16
//!   ([`Isa::Avx512Bf16`]) bf16 calls with finite inputs run dedicated `vdpbf16ps` kernels
//!   (`bf16dot` forward, `backward::bf16`; products in `bf16gemm`: bf16 operands including P
//!   and dS, f32 softmax and accumulation).
//! - Partial tiles only compute their live 16 × 16 sub-blocks (`live`, precomputed per plan
//!   call from the deduplicated partial masks); masked pairs inside are still excluded exactly.
//! - Output buffers are filled with NaN before any work, so an element a kernel forgot to write is
//!   visible to the conformance suite.

mod backward;
mod bf16dot;
#[cfg(target_arch = "x86_64")]
mod bf16gemm;
mod forward;
mod gemm;
mod live;
mod math;
mod telemetry;

use crate::{
    check_backward, check_forward, AttnOptions, Backend, BackwardOutput, Dims, ForwardOutput,
};
use half::bf16;
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tessera_core::tensor::TensorView;
use tessera_core::tensor::ViewData;
use tessera_core::{metrics, DType, Error, Result, Tensor};
use tessera_plan::{Plan, TileShape};

/// Instruction set of the kernel copy a [`CpuBackend`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F, BW, VL, FMA and AVX512-BF16: the f32 kernels of [`Isa::Avx512`], plus bf16
    /// forward and backward kernels on `vdpbf16ps` (bf16 operands, including P and dS; f32
    /// softmax and accumulation).
    Avx512Bf16,
    /// AVX-512F, BW, VL and FMA.
    Avx512,
    /// AVX2 and FMA.
    Avx2,
    /// Baseline target features (any CPU).
    Portable,
}

impl Isa {
    /// The best copy this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
            {
                if is_x86_feature_detected!("avx512bf16") {
                    return Isa::Avx512Bf16;
                }
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU can run the copy.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => Isa::detect() == Isa::Avx512Bf16,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => matches!(Isa::detect(), Isa::Avx512 | Isa::Avx512Bf16),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512-bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// Flash attention on the CPU (rayon's global pool).
#[derive(Debug, Clone, Copy)]
pub struct CpuBackend {
    isa: Isa,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// The backend using the best kernel copy for this CPU.
    pub fn new() -> Self {
        CpuBackend { isa: Isa::detect() }
    }

    /// The backend forced to one kernel copy (for testing the fallbacks).
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if !isa.supported() {
            return Err(Error::Unsupported(format!(
                "kernel copy {} needs CPU features this machine lacks",
                isa.name()
            )));
        }
        Ok(CpuBackend { isa })
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The tile shape these kernels run fastest with for a head dimension and storage dtype
    /// (measured on an AVX-512 + BF16 Zen 5, 8K tokens; see BENCHMARKS.md): 128×128, except f32
    /// with `Dqk` ≥ 128, where 64-query tiles keep the per-item working set (Q tile, `S`, O
    /// accumulator) in L2 and run forward and backward ~10–15% faster. Any valid tile gives the
    /// same results; this is only the default of `tessera bench`.
    pub fn recommended_tile(&self, d_qk: usize, dtype: DType) -> TileShape {
        if dtype == DType::F32 && d_qk >= 128 {
            TileShape { q: 64, kv: 128 }
        } else {
            TileShape::default()
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn forward(
        &self,
        q: TensorView<'_>,
        k: TensorView<'_>,
        v: TensorView<'_>,
        plan: &Plan,
        options: &AttnOptions,
    ) -> Result<ForwardOutput> {
        let d = check_forward(&q, &k, &v, plan, options)?;
        let start = Instant::now();
        let out = if runs_bf16dot(self.isa, d.dtype) {
            bf16dot::run(&d, q, k, v, plan, options)?
        } else {
            forward::run(self.isa, &d, q, k, v, plan, options)?
        };
        metrics::record_kernel(&format!("cpu.forward.{}", d.dtype), start.elapsed());
        Ok(out)
    }

    fn forward_with_telemetry(
        &self,
        q: TensorView<'_>,
        k: TensorView<'_>,
        v: TensorView<'_>,
        plan: &Plan,
        options: &AttnOptions,
        tel: &crate::TelemetryInput<'_>,
    ) -> Result<(ForwardOutput, crate::AttnSummary)> {
        telemetry::forward(self, q, k, v, plan, options, tel)
    }

    fn backward(
        &self,
        q: TensorView<'_>,
        k: TensorView<'_>,
        v: TensorView<'_>,
        o: TensorView<'_>,
        lse: TensorView<'_>,
        d_o: TensorView<'_>,
        plan: &Plan,
        options: &AttnOptions,
    ) -> Result<BackwardOutput> {
        let d = check_backward(&q, &k, &v, &o, &lse, &d_o, plan, options)?;
        let start = Instant::now();
        let out = backward::run(self.isa, &d, [q, k, v, o, lse, d_o], plan, options)?;
        metrics::record_kernel(&format!("cpu.backward.{}", d.dtype), start.elapsed());
        Ok(out)
    }
}

/// Whether a forward of this dtype on this kernel copy runs the `bf16dot` kernel (which itself
/// falls back to the f32 kernels when the inputs are not all bf16); the plain and the telemetry
/// forward both dispatch on it.
fn runs_bf16dot(isa: Isa, dtype: DType) -> bool {
    isa == Isa::Avx512Bf16 && dtype == DType::BF16
}

/// A validated f32 or bf16 input, read row by row into f32 tiles.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

impl<'a> Src<'a> {
    fn new(v: &TensorView<'a>) -> Result<Self> {
        match v.data {
            ViewData::F32(x) => Ok(Src::F32(x)),
            ViewData::BF16(x) => Ok(Src::BF16(x)),
            _ => Err(Error::Internal(format!("unvalidated dtype {}", v.dtype()))),
        }
    }

    /// `dst[i] = self[off + i] * scale` for `i < dst.len()`.
    #[inline(always)]
    pub(crate) fn load(self, off: usize, dst: &mut [f32], scale: f32) {
        let n = dst.len();
        match self {
            Src::F32(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = s * scale;
                }
            }
            Src::BF16(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = math::bf16_to_f32(s) * scale;
                }
            }
        }
    }

    /// Whether every element is finite.
    fn all_finite(self) -> bool {
        match self {
            // Branch-free folds over the exponent bits (vectorize; an early exit per element
            // does not): a value is non-finite when its exponent field is all ones.
            Src::F32(x) => x.par_chunks(1 << 16).all(|c| {
                c.iter().fold(0u32, |a, v| {
                    a | u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
                }) == 0
            }),
            Src::BF16(x) => x.par_chunks(1 << 16).all(|c| {
                c.iter()
                    .fold(0u16, |a, v| a | u16::from(v.to_bits() & 0x7F80 == 0x7F80))
                    == 0
            }),
        }
    }
}

/// A mutable slice of an output in the storage dtype.
pub(crate) enum Out<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
}

impl Out<'_> {
    /// `self[off + i] = src[i] * scale`, rounded to the storage dtype.
    #[inline(always)]
    pub(crate) fn store(&mut self, off: usize, src: &[f32], scale: f32) {
        let n = src.len();
        match self {
            Out::F32(x) => {
                for (d, &s) in x[off..off + n].iter_mut().zip(src) {
                    *d = s * scale;
                }
            }
            Out::BF16(x) => {
                for (d, &s) in x[off..off + n].iter_mut().zip(src) {
                    *d = bf16::from_f32(s * scale);
                }
            }
        }
    }
}

/// An owned output buffer, NaN-poisoned at creation.
pub(crate) enum OutBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

impl OutBuf {
    pub(crate) fn poisoned(dtype: DType, n: usize) -> Self {
        // Zeroed allocation (fresh pages, no serial write), then the poison fill on every
        // thread, so the page faults and the fill of a large output are spread over the pool.
        match dtype {
            DType::BF16 => {
                let mut v = vec![bf16::ZERO; n];
                v.par_chunks_mut(1 << 16).for_each(|c| c.fill(bf16::NAN));
                OutBuf::BF16(v)
            }
            _ => {
                let mut v = vec![0f32; n];
                v.par_chunks_mut(1 << 16).for_each(|c| c.fill(f32::NAN));
                OutBuf::F32(v)
            }
        }
    }

    /// Splits into consecutive slabs of `slab` elements, each split into pieces of `piece`
    /// (the last piece of a slab may be shorter); slab-major order.
    pub(crate) fn pieces(&mut self, slab: usize, piece: usize) -> Vec<Out<'_>> {
        match self {
            OutBuf::F32(v) => v
                .chunks_mut(slab)
                .flat_map(|s| s.chunks_mut(piece))
                .map(Out::F32)
                .collect(),
            OutBuf::BF16(v) => v
                .chunks_mut(slab)
                .flat_map(|s| s.chunks_mut(piece))
                .map(Out::BF16)
                .collect(),
        }
    }

    pub(crate) fn into_tensor(self, shape: Vec<usize>) -> Result<Tensor> {
        match self {
            OutBuf::F32(v) => Tensor::from_f32(shape, v),
            OutBuf::BF16(v) => Tensor::from_bf16(shape, v),
        }
    }
}

/// f32 slices of `slab`-sized slabs split into `piece`-sized pieces (slab-major).
pub(crate) fn f32_pieces(v: &mut [f32], slab: usize, piece: usize) -> Vec<&mut [f32]> {
    v.chunks_mut(slab)
        .flat_map(|s| s.chunks_mut(piece))
        .collect()
}

/// Runs `work` on every item on the rayon pool: items sorted by cost (descending, stable), each
/// worker pulling the next item from the shared queue with its own workspace from `make_ws`.
pub(crate) fn run_items<T: Send, W>(
    items: Vec<(usize, T)>,
    make_ws: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, T) + Sync,
) {
    let mut items = items;
    items.sort_by_key(|(cost, _)| std::cmp::Reverse(*cost));
    let slots: Vec<Mutex<Option<T>>> = items
        .into_iter()
        .map(|(_, t)| Mutex::new(Some(t)))
        .collect();
    let next = AtomicUsize::new(0);
    let workers = rayon::current_num_threads().min(slots.len()).max(1);
    (0..workers).into_par_iter().with_max_len(1).for_each(|_| {
        let mut ws: Option<W> = None;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(i) else { break };
            let item = slot.lock().ok().and_then(|mut g| g.take());
            if let Some(item) = item {
                work(ws.get_or_insert_with(&make_ws), item);
            }
        }
    });
}

/// Sizes shared by the kernels: tile sides and padded head dims.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub tq: usize,
    pub tk: usize,
    /// `Dqk`, `Dv` rounded up to 16.
    pub dqkp: usize,
    pub dvp: usize,
}

impl Geometry {
    pub(crate) fn new(plan: &Plan, d: &Dims) -> Self {
        Geometry {
            tq: gemm::round_up(plan.tile.q, 16),
            tk: gemm::round_up(plan.tile.kv, 16),
            dqkp: gemm::round_up(d.d_qk, 16),
            dvp: gemm::round_up(d.d_v, 16),
        }
    }
}

/// Rows `[off/dim, off/dim + n)` of a `[.., dim]` input as an f32 matrix with at least `m >= n`
/// readable rows and at least `round_up(dim, 16)` readable columns: borrowed when the input is f32,
/// `dim` is a multiple of 16 and enough rows follow, else converted into `buf` (leading dimension
/// `round_up(dim, 16)`, rows `n..m` zeroed; `buf`'s padding columns must already be zero).
/// Returns the matrix and its leading dimension.
#[inline(always)]
pub(crate) fn rows<'s>(
    src: Src<'s>,
    off: usize,
    n: usize,
    m: usize,
    dim: usize,
    buf: &'s mut [f32],
) -> (&'s [f32], usize) {
    if let Src::F32(x) = src {
        if dim.is_multiple_of(16) && off + m * dim <= x.len() {
            return (&x[off..off + m * dim], dim);
        }
    }
    let ld = gemm::round_up(dim, 16);
    for r in 0..n {
        src.load(off + r * dim, &mut buf[r * ld..r * ld + dim], 1.0);
    }
    buf[n * ld..m * ld].fill(0.0);
    (&buf[..m * ld], ld)
}

/// Writes rows `[off/dim, off/dim + n)` of a `[.., dim]` input, times `scale`, transposed into
/// `dst[x * ld + r]` (`x < dim`, `r < n`), zeroing columns `n..round_up(n, 16)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_transposed(
    src: Src<'_>,
    off: usize,
    n: usize,
    dim: usize,
    scale: f32,
    tmp: &mut [f32],
    dst: &mut [f32],
    ld: usize,
) {
    let tmp = &mut tmp[..dim];
    for r in 0..n {
        src.load(off + r * dim, tmp, scale);
        for (x, &val) in tmp.iter().enumerate() {
            dst[x * ld + r] = val;
        }
    }
    let np = gemm::round_up(n, 16);
    if np > n {
        for x in 0..dim {
            dst[x * ld + n..x * ld + np].fill(0.0);
        }
    }
}

/// The plan's partial bitmasks transposed: mask `id`, key row `j` holds bit `i % 64` of word
/// `i / 64` set when pair (query `i`, key `j`) of the tile is allowed.
pub(crate) struct MasksT {
    words: usize,
    rows: usize,
    data: Vec<u64>,
}

impl MasksT {
    pub(crate) fn new(plan: &Plan) -> Self {
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let words = tq.div_ceil(64);
        let per = tk * words;
        let p = &plan.partials;
        let mut data = vec![0u64; p.len() * per];
        data.par_chunks_mut(per.max(1))
            .enumerate()
            .for_each(|(id, out)| {
                for r in 0..tq {
                    for (w, &word) in p.row(id as u32, r).iter().enumerate() {
                        let mut bits = word;
                        while bits != 0 {
                            let c = w * 64 + bits.trailing_zeros() as usize;
                            bits &= bits - 1;
                            if c < tk {
                                out[c * words + r / 64] |= 1u64 << (r % 64);
                            }
                        }
                    }
                }
            });
        MasksT {
            words,
            rows: tk,
            data,
        }
    }

    #[inline(always)]
    pub(crate) fn row(&self, id: u32, j: usize) -> &[u64] {
        let o = (id as usize * self.rows + j) * self.words;
        &self.data[o..o + self.words]
    }
}

/// Element offsets of row `i` of head `h` in batch `b` of a `[B, H, L, D]` tensor.
#[inline(always)]
pub(crate) fn row_off(b: usize, h: usize, i: usize, heads: usize, len: usize, dim: usize) -> usize {
    ((b * heads + h) * len + i) * dim
}

/// Declares the per-ISA entry points of an item kernel: a `#[target_feature]` copy per ISA
/// around the same generic, `#[inline(always)]` body.
macro_rules! isa_entry {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        pub(crate) fn $name(isa: crate::cpu::Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
            fn avx512($($arg: $ty),*) {
                $body::<crate::cpu::math::Avx512>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) {
                $body::<crate::cpu::math::Avx2>($($arg),*)
            }
            match isa {
                // SAFETY: `Isa::detect`/`CpuBackend::with_isa` only hand out copies whose
                // features this CPU has.
                #[cfg(target_arch = "x86_64")]
                crate::cpu::Isa::Avx512 | crate::cpu::Isa::Avx512Bf16 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                crate::cpu::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => $body::<crate::cpu::math::Portable>($($arg),*),
            }
        }
    };
}
pub(crate) use isa_entry;
