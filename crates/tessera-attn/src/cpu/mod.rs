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

mod workspace;

use live::LiveBlocks;
pub use workspace::CpuWorkspace;
pub(crate) use workspace::{Rest, WsPool};

use crate::validate::{check_forward_out, check_grad_out};
use crate::{
    check_backward, check_forward, AttnInputs, AttnOptions, Backend, BackwardOutput, Dims,
    ForwardBufs, ForwardOut, ForwardOutput, GradBufs, GradInputs, GradOut, OutData, Par, Prepared,
    StridedView,
};
use half::bf16;
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tessera_core::tensor::ViewData;
use tessera_core::{metrics, DType, Error, Result};
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

/// A plan prepared for the CPU kernels: the plan plus what every call derives from it (the
/// partial masks transposed for the key-major loops, and their live 16 × 16 sub-blocks).
pub struct CpuPlan {
    plan: Arc<Plan>,
    data: PlanData,
}

impl Prepared for CpuPlan {
    fn plan(&self) -> &Plan {
        &self.plan
    }
}

/// Everything the CPU kernels derive from a plan, built once by [`CpuBackend::prepare`].
pub(crate) struct PlanData {
    pub(crate) masks_t: MasksT,
    pub(crate) live: LiveBlocks,
}

impl PlanData {
    /// Builds the derived data; counted as kernel variant `cpu.prepare` in the metrics, so a
    /// caller can show that calls on a prepared plan do no preprocessing.
    pub(crate) fn new(plan: &Plan) -> Self {
        let start = Instant::now();
        let data = PlanData {
            masks_t: MasksT::new(plan),
            live: LiveBlocks::new(plan),
        };
        metrics::record_kernel("cpu.prepare", start.elapsed());
        data
    }
}

/// A plan and its derived data, as the kernels read them.
#[derive(Clone, Copy)]
pub(crate) struct Prep<'a> {
    pub(crate) plan: &'a Plan,
    pub(crate) data: &'a PlanData,
}

impl CpuPlan {
    fn prep(&self) -> Prep<'_> {
        Prep {
            plan: &self.plan,
            data: &self.data,
        }
    }
}

/// Catches a panic inside a kernel call so that a bug surfaces as [`Error::Internal`] and the
/// process (and the caller's workspace, which is reset) stays usable for the next call.
fn guarded<R>(ws: &mut CpuWorkspace, f: impl FnOnce(&mut CpuWorkspace) -> Result<R>) -> Result<R> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ws))) {
        Ok(r) => r,
        Err(p) => {
            *ws = CpuWorkspace::default();
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Internal(format!("cpu kernel panicked: {msg}")))
        }
    }
}

impl Backend for CpuBackend {
    type Prepared = CpuPlan;
    type Workspace = CpuWorkspace;

    fn name(&self) -> &str {
        "cpu"
    }

    fn prepare(&self, plan: &Arc<Plan>) -> Result<CpuPlan> {
        Ok(CpuPlan {
            plan: plan.clone(),
            data: PlanData::new(plan),
        })
    }

    fn forward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        let d = check_forward(inputs, &prepared.plan, &AttnOptions::default())?;
        Ok(workspace::forward_bytes(
            self.isa,
            &prepared.plan,
            &d,
            par_threads(par),
        ))
    }

    fn backward_workspace_size(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize> {
        let d = check_backward(inputs, &prepared.plan, &AttnOptions::default())?;
        Ok(workspace::backward_bytes(
            self.isa,
            &prepared.plan,
            &d,
            par_threads(par),
        ))
    }

    fn forward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.forward_prep(prepared.prep(), inputs, options, out, ws, par)
    }

    fn forward_with_telemetry_into(
        &self,
        prepared: &CpuPlan,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        tel: &crate::TelemetryInput<'_>,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<crate::AttnSummary> {
        let prep = prepared.prep();
        let d = check_forward(inputs, prep.plan, options)?;
        check_forward_out(&out, &d)?;
        tel.check(d.batch, d.kv_len)?;
        guarded(ws, |ws| {
            let (pools, rest) = ws.split(&prep, &d);
            par.run(pools, || {
                telemetry::forward(self, prep, &d, inputs, options, tel, out, rest)
            })?
        })
    }

    fn backward_into(
        &self,
        prepared: &CpuPlan,
        inputs: &GradInputs<'_>,
        options: &AttnOptions,
        out: GradOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        self.backward_prep(prepared.prep(), inputs, options, out, ws, par)
    }

    fn forward(
        &self,
        inputs: &AttnInputs<'_>,
        plan: &Arc<Plan>,
        options: &AttnOptions,
    ) -> Result<ForwardOutput> {
        let data = PlanData::new(plan);
        let prep = Prep { plan, data: &data };
        let d = check_forward(inputs, plan, options)?;
        let mut bufs = ForwardBufs::new(&d);
        let mut ws = CpuWorkspace::default();
        self.forward_prep(prep, inputs, options, bufs.out(), &mut ws, Par::Current)?;
        bufs.finish(&d)
    }

    fn backward(
        &self,
        inputs: &GradInputs<'_>,
        plan: &Arc<Plan>,
        options: &AttnOptions,
    ) -> Result<BackwardOutput> {
        let data = PlanData::new(plan);
        let prep = Prep { plan, data: &data };
        let d = check_backward(inputs, plan, options)?;
        let mut bufs = GradBufs::new(&d, options.sinks.is_some());
        let mut ws = CpuWorkspace::default();
        self.backward_prep(prep, inputs, options, bufs.out(), &mut ws, Par::Current)?;
        bufs.finish(&d)
    }
}

impl CpuBackend {
    fn forward_prep(
        &self,
        prep: Prep<'_>,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        let d = check_forward(inputs, prep.plan, options)?;
        check_forward_out(&out, &d)?;
        let start = Instant::now();
        guarded(ws, |ws| {
            let (pools, rest) = ws.split(&prep, &d);
            par.run(pools, || {
                dispatch_forward(self.isa, prep, &d, inputs, options, out, rest)
            })?
        })?;
        metrics::record_kernel(&format!("cpu.forward.{}", d.dtype), start.elapsed());
        Ok(())
    }

    fn backward_prep(
        &self,
        prep: Prep<'_>,
        inputs: &GradInputs<'_>,
        options: &AttnOptions,
        out: GradOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<()> {
        let d = check_backward(inputs, prep.plan, options)?;
        check_grad_out(&out, &d, options.sinks.is_some())?;
        let start = Instant::now();
        guarded(ws, |ws| {
            let (pools, rest) = ws.split(&prep, &d);
            par.run(pools, || {
                backward::run(self.isa, prep, &d, inputs, options, out, rest)
            })?
        })?;
        metrics::record_kernel(&format!("cpu.backward.{}", d.dtype), start.elapsed());
        Ok(())
    }
}

/// The production forward kernel for this copy and dtype (the plain and the telemetry forward
/// both dispatch through [`runs_bf16dot`]).
fn dispatch_forward(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<()> {
    if runs_bf16dot(isa, d.dtype) {
        bf16dot::run(prep, d, inputs, options, out, rest)
    } else {
        forward::run(isa, prep, d, inputs, options, out, rest)
    }
}

/// Threads a call on `par` runs on (for workspace sizing).
fn par_threads(par: Par<'_>) -> usize {
    match par {
        Par::Seq => 1,
        Par::Rayon(0) | Par::Current => rayon::current_num_threads(),
        Par::Rayon(n) => n,
        Par::Pool(p) => p.current_num_threads(),
    }
}

/// Whether a forward of this dtype on this kernel copy runs the `bf16dot` kernel (which itself
/// falls back to the f32 kernels when the inputs are not all bf16); the plain and the telemetry
/// forward both dispatch on it.
fn runs_bf16dot(isa: Isa, dtype: DType) -> bool {
    isa == Isa::Avx512Bf16 && dtype == DType::BF16
}

/// The storage of a validated f32 or bf16 input.
#[derive(Clone, Copy)]
pub(crate) enum SrcData<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

/// A validated f32 or bf16 input `[B, H, L, D]` with its strides, read row by row into f32
/// tiles. Row `i` of head `h` in batch `b` starts at [`Src::row`]; consecutive rows are
/// [`Src::ld`] elements apart (`D` when contiguous); a row's D elements are contiguous.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub(crate) data: SrcData<'a>,
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a> Src<'a> {
    pub(crate) fn new(v: &StridedView<'a>) -> Result<Self> {
        let data = match v.data {
            ViewData::F32(x) => SrcData::F32(x),
            ViewData::BF16(x) => SrcData::BF16(x),
            _ => return Err(Error::Internal(format!("unvalidated dtype {}", v.dtype()))),
        };
        Ok(Src {
            data,
            shape: v.shape,
            strides: v.strides,
        })
    }

    /// Element offset of row `i` of head `h` in batch `b`.
    #[inline(always)]
    pub(crate) fn row(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.strides[0] + h * self.strides[1] + i * self.strides[2]
    }

    /// Elements between consecutive rows.
    #[inline(always)]
    pub(crate) fn ld(&self) -> usize {
        self.strides[2]
    }

    /// The bf16 storage, if that is the dtype.
    pub(crate) fn bf16(&self) -> Option<&'a [bf16]> {
        match self.data {
            SrcData::BF16(x) => Some(x),
            SrcData::F32(_) => None,
        }
    }

    /// `dst[i] = self[off + i] * scale` for `i < dst.len()`.
    #[inline(always)]
    pub(crate) fn load(self, off: usize, dst: &mut [f32], scale: f32) {
        let n = dst.len();
        match self.data {
            SrcData::F32(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = s * scale;
                }
            }
            SrcData::BF16(x) => {
                for (d, &s) in dst.iter_mut().zip(&x[off..off + n]) {
                    *d = math::bf16_to_f32(s) * scale;
                }
            }
        }
    }

    /// `(b, h)` slabs as `(offset of row 0, rows, whether the rows are back to back)`.
    fn slabs(&self) -> impl Iterator<Item = (usize, usize, bool)> + '_ {
        let [nb, nh, nl, nd] = self.shape;
        let dense = self.strides[2] == nd;
        (0..nb * nh).map(move |bh| (self.row(bh / nh, bh % nh, 0), nl, dense))
    }

    /// Every `(b, h, i)` row's D elements, as `(offset, len)` runs (whole slabs when dense).
    fn runs(&self) -> Vec<(usize, usize)> {
        let nd = self.shape[3];
        let mut out = Vec::new();
        for (off, nl, dense) in self.slabs() {
            if dense {
                out.push((off, nl * nd));
            } else {
                out.extend((0..nl).map(|i| (off + i * self.ld(), nd)));
            }
        }
        out
    }

    /// Whether every element of the view is finite.
    pub(crate) fn all_finite(self) -> bool {
        // Branch-free folds over the exponent bits (vectorize; an early exit per element
        // does not): a value is non-finite when its exponent field is all ones.
        let runs = self.runs();
        runs.par_iter().all(|&(off, n)| match self.data {
            SrcData::F32(x) => x[off..off + n].chunks(1 << 16).all(|c| {
                c.iter().fold(0u32, |a, v| {
                    a | u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
                }) == 0
            }),
            SrcData::BF16(x) => x[off..off + n].chunks(1 << 16).all(|c| {
                c.iter()
                    .fold(0u16, |a, v| a | u16::from(v.to_bits() & 0x7F80 == 0x7F80))
                    == 0
            }),
        })
    }
}

/// A mutable slice of an output in the storage dtype.
pub(crate) type Out<'a> = OutData<'a>;

/// f32 slices of `slab`-sized slabs split into `piece`-sized pieces (slab-major).
pub(crate) fn f32_pieces(v: &mut [f32], slab: usize, piece: usize) -> Vec<&mut [f32]> {
    v.chunks_mut(slab)
        .flat_map(|s| s.chunks_mut(piece))
        .collect()
}

/// Runs `work` on every item on the current rayon pool: items sorted by cost (descending,
/// stable), each worker pulling the next item from the shared queue, with a workspace taken from
/// `pool` (or made by `make_ws` when the pool has none) and given back at the end.
pub(crate) fn run_items<T: Send, W: std::any::Any + Send>(
    items: Vec<(usize, T)>,
    pool: &WsPool,
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
                let w = ws.get_or_insert_with(|| pool.take::<W>().unwrap_or_else(&make_ws));
                work(w, item);
            }
        }
        if let Some(w) = ws {
            pool.give(w);
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

/// Rows `n` rows from element `off` of an input (at its row stride) as an f32 matrix with at least `m >= n`
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
    let sl = src.ld();
    if let SrcData::F32(x) = src.data {
        // `dim` a multiple of 16: the products read exactly `dim` columns of each row, so the
        // rows are used in place at their own stride.
        if dim.is_multiple_of(16) && sl >= dim && off + (m - 1) * sl + dim <= x.len() {
            return (&x[off..off + (m - 1) * sl + dim], sl);
        }
    }
    let ld = gemm::round_up(dim, 16);
    for r in 0..n {
        src.load(off + r * sl, &mut buf[r * ld..r * ld + dim], 1.0);
    }
    buf[n * ld..m * ld].fill(0.0);
    (&buf[..m * ld], ld)
}

/// Writes `n` rows from element `off` of an input (at its row stride), times `scale`, transposed into
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
        src.load(off + r * src.ld(), tmp, scale);
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
