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
//! - Items run on the call's threads ([`Par`]) from one sorted queue (dynamic pull): (batch,
//!   head) group by group, longest work list first within a group, each worker with a workspace
//!   from the caller's [`CpuWorkspace`].
//! - Per-worker workspace is bounded by the tile sizes and head dims; nothing of size Lq·Lkv.
//! - Hot loops are generic code compiled three times (AVX-512F/BW/VL+FMA, AVX2+FMA, portable)
//!   and selected at run time; [`Isa`] names a copy. With AVX512-BF16 ([`Isa::Avx512Bf16`])
//!   bf16 calls can also run dedicated `vdpbf16ps` kernels (bf16 operands including P and dS,
//!   f32 softmax and accumulation); otherwise bf16 is widened to f32 in an f32 copy.
//! - A [`CpuBackend`] holds one copy per storage dtype ([`KernelPaths`]: f32 `avx512` / `avx2` /
//!   `portable`; bf16 `dot` / `widen-avx512` / `widen-avx2` / `widen-portable`) and routes each
//!   call (forward, backward, telemetry forward, workspace sizes) by the call's dtype.
//!   [`CpuBackend::new`] takes the paths of [`dispatch::decision`]: measured speed on this
//!   machine, stored per machine so that results stay bit-identical across processes, or
//!   `TESSERA_CPU_PATHS`. [`CpuBackend::with_isa`] runs both dtypes on one copy and
//!   [`CpuBackend::with_paths`] on any two paths this CPU runs.
//! - Partial tiles only compute their live 16 × 16 sub-blocks, precomputed once per plan by
//!   `prepare`; masked pairs inside are still excluded exactly.
//!
//! Code map (one concept per file):
//! - `isa`: the instruction sets and the per-ISA kernel copies; [`dispatch`]: which path each
//!   dtype runs; [`peak`]: the measured compute peak of each instruction path (the yardstick
//!   of `% of peak`); `prepare`: what a plan is turned
//!   into once (`live_blocks`, `mask_partial_tile`'s transposed masks); `workspace`: the
//!   caller-owned scratch; `schedule`: work items on the pool; `load_tile`: strided inputs into
//!   tiles.
//! - Phases of a tile: `tile_matmul` (f32 `S = K·Qᵀ`, `P·V` and the backward products) and
//!   `tile_matmul_bf16` (`vdpbf16ps`); `mask_partial_tile` (where a pair of a partial tile is
//!   excluded, forward and backward); `online_softmax` (running max, rescale, finish);
//!   `column_softmax` (the forward's max and exponential passes 16 queries at a time, AVX-512);
//!   `simd` (exp, tanh, row helpers).
//! - Passes: `forward` (the f32 item, `forward::bf16`, `forward::telemetry`), `backward`
//!   (Δ, rounds, slots, reduce, the f32 item, `backward::bf16`).

mod backward;
#[cfg(target_arch = "x86_64")]
mod column_softmax;
pub mod dispatch;
mod forward;
mod isa;
mod live_blocks;
mod load_tile;
mod mask_partial_tile;
mod online_softmax;
pub mod peak;
mod prepare;
mod schedule;
mod simd;
mod tile_matmul;
#[cfg(target_arch = "x86_64")]
mod tile_matmul_bf16;

mod workspace;

pub use dispatch::{Bf16Path, F32Path, KernelPaths};
pub(crate) use isa::isa_entry;
pub use isa::Isa;
pub(crate) use load_tile::{load_transposed, rows, Src};
pub(crate) use prepare::{PlanData, Prep};
pub(crate) use schedule::{f32_pieces, run_items, Geometry, Order};
pub use workspace::CpuWorkspace;
pub(crate) use workspace::Rest;

use crate::validate::{check_forward_out, check_grad_out, check_plan_consistent};
use crate::{
    check_backward, check_forward, AttnInputs, AttnOptions, Backend, BackwardOutput, Dims,
    ForwardBufs, ForwardOut, ForwardOutput, GradBufs, GradInputs, GradOut, OutData, Par, Prepared,
};
use std::sync::Arc;
use std::time::Instant;
use tessera_core::{metrics, DType, Error, Result};
use tessera_plan::{Plan, TileShape};

/// Flash attention on the CPU (rayon's global pool), with one kernel copy for f32 calls and
/// one for bf16 calls ([`KernelPaths`]).
#[derive(Debug, Clone, Copy)]
pub struct CpuBackend {
    /// Copy of f32 calls (`Avx512Bf16` runs them as `Avx512`).
    f32_isa: Isa,
    /// Copy of bf16 calls: `Avx512Bf16` is the `vdpbf16ps` (`dot`) kernels, any other copy
    /// widens bf16 to f32 in its f32 kernels.
    bf16_isa: Isa,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// The backend on this machine's kernel paths: the process-wide [`dispatch::decision`]
    /// (measured speed, stored per machine, or `TESSERA_CPU_PATHS`).
    pub fn new() -> Self {
        let paths = dispatch::decision().paths();
        // The decision only names paths this CPU runs; checked again because the kernel
        // copies' `unsafe` calls rely on it.
        let paths = if dispatch::Caps::detect().runs(paths) {
            paths
        } else {
            KernelPaths::of_isa(Isa::detect())
        };
        CpuBackend {
            f32_isa: paths.f32.isa(),
            bf16_isa: paths.bf16.isa(),
        }
    }

    /// The backend running both dtypes on one kernel copy (for testing the fallbacks): f32 on
    /// its f32 kernels, bf16 on `vdpbf16ps` for [`Isa::Avx512Bf16`], else widened to f32.
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if !isa.supported() {
            return Err(Error::Unsupported(format!(
                "kernel copy {} needs CPU features this machine lacks",
                isa.name()
            )));
        }
        Ok(CpuBackend {
            f32_isa: isa,
            bf16_isa: isa,
        })
    }

    /// The backend on the given path of each dtype; an error names a path this CPU cannot run.
    pub fn with_paths(paths: KernelPaths) -> Result<Self> {
        let caps = dispatch::Caps::detect();
        if !caps.runs_f32(paths.f32) {
            let f = paths.f32;
            return Err(dispatch::unsupported(
                &format!("kernel path f32 {}", f.name()),
                f.isa().name(),
            ));
        }
        if !caps.runs_bf16(paths.bf16) {
            let b = paths.bf16;
            return Err(dispatch::unsupported(
                &format!("kernel path bf16 {}", b.name()),
                b.isa().name(),
            ));
        }
        Ok(CpuBackend {
            f32_isa: paths.f32.isa(),
            bf16_isa: paths.bf16.isa(),
        })
    }

    /// The kernel copy of f32 calls (the one copy of a [`with_isa`](Self::with_isa) backend);
    /// [`isa_for`](Self::isa_for) gives any dtype's.
    pub fn isa(&self) -> Isa {
        self.f32_isa
    }

    /// The kernel copy calls of `dtype` run on.
    pub fn isa_for(&self, dtype: DType) -> Isa {
        match dtype {
            DType::BF16 => self.bf16_isa,
            _ => self.f32_isa,
        }
    }

    /// The kernel path of each dtype.
    pub fn paths(&self) -> KernelPaths {
        KernelPaths {
            f32: F32Path::of_isa(self.f32_isa),
            bf16: Bf16Path::of_isa(self.bf16_isa),
        }
    }

    /// This backend reduced to the one copy calls of `dtype` run on (for the kernels that
    /// take the backend itself).
    fn on(&self, dtype: DType) -> CpuBackend {
        let isa = self.isa_for(dtype);
        CpuBackend {
            f32_isa: isa,
            bf16_isa: isa,
        }
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
        check_plan_consistent(plan)?;
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
            self.isa_for(d.dtype),
            &prepared.plan,
            &d,
            par.threads(),
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
            self.isa_for(d.dtype),
            &prepared.plan,
            &d,
            par.threads(),
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
                forward::telemetry::forward(
                    &self.on(d.dtype),
                    prep,
                    &d,
                    inputs,
                    options,
                    tel,
                    out,
                    rest,
                )
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
        let d = check_forward(inputs, plan, options)?;
        let data = PlanData::new(plan);
        let prep = Prep { plan, data: &data };
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
        let d = check_backward(inputs, plan, options)?;
        let data = PlanData::new(plan);
        let prep = Prep { plan, data: &data };
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
                dispatch_forward(self.isa_for(d.dtype), prep, &d, inputs, options, out, rest)
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
                backward::run(self.isa_for(d.dtype), prep, &d, inputs, options, out, rest)
            })?
        })?;
        metrics::record_kernel(&format!("cpu.backward.{}", d.dtype), start.elapsed());
        Ok(())
    }
}

/// The production forward kernel for this copy and dtype (the plain and the telemetry forward
/// both dispatch through [`runs_bf16_kernel`]).
fn dispatch_forward(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<()> {
    if runs_bf16_kernel(isa, d.dtype) {
        forward::bf16::run(prep, d, inputs, options, out, rest)
    } else {
        forward::run(isa, prep, d, inputs, options, out, rest)
    }
}

/// Whether a forward of this dtype on this kernel copy runs the `forward::bf16` (`vdpbf16ps`)
/// kernel; the plain and the telemetry forward both dispatch on it.
fn runs_bf16_kernel(isa: Isa, dtype: DType) -> bool {
    isa == Isa::Avx512Bf16 && dtype == DType::BF16
}

/// A mutable slice of an output in the storage dtype.
pub(crate) type Out<'a> = OutData<'a>;

#[cfg(test)]
mod panic_guard_tests {
    use super::*;
    use rayon::prelude::*;
    use tessera_core::Tensor;
    use tessera_mask::Mask;
    use tessera_plan::{build_plan, PlanShape, TileShape};

    /// A panic on a pool worker inside a kernel call becomes `Error::Internal` at the API
    /// boundary, and the same backend, pool and workspace serve the next call correctly (Python
    /// users call in a loop).
    #[test]
    fn a_worker_panic_is_an_error_and_the_next_call_works() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut ws = CpuWorkspace::new();
        let r: Result<()> = guarded(&mut ws, |_| {
            pool.install(|| {
                (0..64).into_par_iter().for_each(|i| {
                    if i == 37 {
                        panic!("injected kernel bug");
                    }
                })
            });
            Ok(())
        });
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Internal(_)) && !e.is_user_error(), "{e}");
        assert!(e.to_string().contains("injected kernel bug"), "{e}");

        let (b, h, l, d) = (1, 2, 70, 16);
        let plan = Arc::new(
            build_plan(
                &Mask::causal(),
                PlanShape::new(b, h, l, l).unwrap(),
                TileShape::new(32, 32).unwrap(),
            )
            .unwrap(),
        );
        let x = |seed: usize| {
            let v = (0..b * h * l * d)
                .map(|k| ((k * 31 + seed) % 17) as f32 / 17.0 - 0.5)
                .collect();
            Tensor::from_f32(vec![b, h, l, d], v).unwrap()
        };
        let (q, k, v) = (x(1), x(2), x(3));
        let cpu = CpuBackend::new();
        let prepared = cpu.prepare(&plan).unwrap();
        let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap();
        let want = cpu
            .forward(&inputs, &plan, &AttnOptions::default())
            .unwrap();
        for _ in 0..3 {
            let dims = crate::validate::check_inputs(&inputs, &AttnOptions::default()).unwrap();
            let mut bufs = crate::ForwardBufs::new(&dims);
            cpu.forward_into(
                &prepared,
                &inputs,
                &AttnOptions::default(),
                bufs.out(),
                &mut ws,
                Par::Pool(&pool),
            )
            .unwrap();
            let got = bufs.finish(&dims).unwrap();
            assert_eq!(got.o, want.o);
        }
    }
}
