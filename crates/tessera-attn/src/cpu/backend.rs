//! [`CpuBackend`]: the [`Backend`] implementation over the CPU kernels, and [`CpuPlan`], a plan
//! prepared for them.
//!
//! Contract: every call is validated first (`validate`), then runs the kernels of the call's
//! dtype's copy on the threads its [`Par`] names, with the caller's [`CpuWorkspace`]; a kernel
//! panic becomes [`Error::Internal`] and leaves the workspace reset and usable. Which copy each
//! dtype runs is fixed at construction; [`CpuBackend::new`] (the measured choice of `dispatch`)
//! lives in the parent module, above `dispatch`, which runs this backend to measure.

use super::backward;
use super::forward;
use super::isa::Isa;
use super::paths::{unsupported, Bf16Path, Caps, F32Path, KernelPaths};
use super::prepare::{PlanData, Prep};
use super::workspace::CpuWorkspace;
use crate::args::{
    AttnInputs, BackwardOutput, ForwardOut, ForwardOutput, GradInputs, GradOut, TelemetryInput,
};
use crate::backend::{Backend, ForwardBufs, GradBufs, Prepared};
use crate::options::AttnOptions;
use crate::par::Par;
use crate::validate::{
    check_backward, check_forward, check_forward_out, check_grad_out, check_plan_consistent,
};
use std::sync::Arc;
use std::time::Instant;
use tessera_core::{metrics, DType, Error, Result};
use tessera_plan::{Plan, TileShape};
use tessera_telemetry::AttnSummary;

/// Flash attention on the CPU (rayon's global pool), with one kernel copy for f32 calls and
/// one for bf16 calls ([`KernelPaths`]).
#[derive(Debug, Clone, Copy)]
pub struct CpuBackend {
    /// Copy of f32 calls (`Avx512Bf16` runs them as `Avx512`).
    pub(super) f32_isa: Isa,
    /// Copy of bf16 calls: `Avx512Bf16` is the `vdpbf16ps` (`dot`) kernels, any other copy
    /// widens bf16 to f32 in its f32 kernels.
    pub(super) bf16_isa: Isa,
}

impl CpuBackend {
    /// The backend running both dtypes on one kernel copy (for testing the fallbacks): f32 on
    /// its f32 kernels, bf16 on `vdpbf16ps` for [`Isa::Avx512Bf16`], else widened to f32.
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if let Some(why) = isa.unsupported_reason() {
            return Err(Error::Unsupported(why));
        }
        Ok(CpuBackend {
            f32_isa: isa,
            bf16_isa: isa,
        })
    }

    /// The backend on the given path of each dtype; an error names a path this CPU cannot run.
    pub fn with_paths(paths: KernelPaths) -> Result<Self> {
        let caps = Caps::detect();
        if !caps.runs_f32(paths.f32) {
            let f = paths.f32;
            return Err(unsupported(
                &format!("kernel path f32 {}", f.name()),
                f.isa().name(),
            ));
        }
        if !caps.runs_bf16(paths.bf16) {
            let b = paths.bf16;
            return Err(unsupported(
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
        Ok(forward::select::forward_bytes(
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
        Ok(backward::backward_bytes(
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
        tel: &TelemetryInput<'_>,
        out: ForwardOut<'_>,
        ws: &mut CpuWorkspace,
        par: Par<'_>,
    ) -> Result<AttnSummary> {
        let prep = prepared.prep();
        let d = check_forward(inputs, prep.plan, options)?;
        check_forward_out(&out, &d)?;
        tel.check(d.batch, d.kv_len)?;
        guarded(ws, |ws| {
            let (pools, rest) = ws.split(&prep, &d);
            par.run(pools, || {
                forward::telemetry::forward(
                    self.isa_for(d.dtype),
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
                forward::select::run(self.isa_for(d.dtype), prep, &d, inputs, options, out, rest)
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
            let mut bufs = ForwardBufs::new(&dims);
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

#[cfg(test)]
mod backward_round_tests {
    //! The backward's round split seen through whole backend calls (forward for O and LSE,
    //! then backward), so it lives above the kernels.
    use super::*;
    use crate::cpu::backward::{rounds, TEST_BOUND};
    use crate::cpu::schedule::Geometry;
    use crate::validate::Dims;
    use tessera_core::Tensor;
    use tessera_mask::Mask;
    use tessera_plan::{build_plan, PlanShape, TileShape};

    fn tensor(dt: DType, shape: Vec<usize>, seed: u32) -> Tensor {
        let n: usize = shape.iter().product();
        // Deterministic, nonzero, varied values.
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed * 97);
                ((x >> 8) % 2001) as f32 / 1000.0 - 1.0005
            })
            .collect();
        match dt {
            DType::BF16 => {
                Tensor::from_bf16(shape, v.into_iter().map(half::bf16::from_f32).collect())
            }
            _ => Tensor::from_f32(shape, v),
        }
        .expect("tensor")
    }

    /// Splitting the kv tiles into many rounds (tiny scratch bound) gives bit-identical
    /// gradients to the single-round run, on every kernel copy here and both dtypes.
    #[test]
    fn rounds_do_not_change_results() {
        let mask = (Mask::causal() & !Mask::window(40, 0)) | Mask::prefix(5) | Mask::chunk(64);
        let (b, hq, hkv, l, dim) = (2, 4, 2, 300, 24);
        let shape = PlanShape::new(b, hq, l, l).expect("shape");
        let plan = std::sync::Arc::new(
            build_plan(&mask, shape, TileShape { q: 32, kv: 32 }).expect("plan"),
        );
        for dt in [DType::F32, DType::BF16] {
            let q = tensor(dt, vec![b, hq, l, dim], 1);
            let k = tensor(dt, vec![b, hkv, l, dim], 2);
            let v = tensor(dt, vec![b, hkv, l, dim], 3);
            let d_o = tensor(dt, vec![b, hq, l, dim], 4);
            for isa in [Isa::Portable, Isa::Avx512, Isa::Avx512Bf16] {
                let Ok(be) = CpuBackend::with_isa(isa) else {
                    continue;
                };
                let opts = AttnOptions::default();
                let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).expect("inputs");
                let f = be.forward(&inputs, &plan, &opts).expect("fwd");
                let grads = GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), d_o.view())
                    .expect("grad inputs");
                let run = || be.backward(&grads, &plan, &opts).expect("bwd");
                let whole = run();
                let d = Dims {
                    batch: b,
                    heads_q: hq,
                    heads_kv: hkv,
                    q_len: l,
                    kv_len: l,
                    d_qk: dim,
                    d_v: dim,
                    dtype: dt,
                };
                let sz = Geometry::new(&plan, &d).tq * Geometry::new(&plan, &d).dqkp;
                let threads = rayon::current_num_threads();
                assert_eq!(rounds(&plan, &d, sz, threads).len(), 1);
                TEST_BOUND.with(|c| c.set(Some(1)));
                assert!(rounds(&plan, &d, sz, threads).len() > 4);
                let split = run();
                TEST_BOUND.with(|c| c.set(None));
                for (a, c) in [
                    (&whole.dq, &split.dq),
                    (&whole.dk, &split.dk),
                    (&whole.dv, &split.dv),
                ] {
                    let (a, c) = (a.to_f32_vec().expect("a"), c.to_f32_vec().expect("c"));
                    assert!(a.iter().all(|x| x.is_finite()));
                    let same = a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{isa:?} {dt}: split rounds changed the gradients");
                }
            }
        }
    }
}
