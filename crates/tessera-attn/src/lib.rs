//! Attention backends (docs/semantics.md#tensors, docs/semantics.md#attention, docs/semantics.md#errors): the [`Backend`] trait, the CPU flash-attention kernels
//! ([`CpuBackend`]); the float64 reference and the conformance suite every backend passes live in
//! the `tessera-conformance` crate.
//!
//! Contract:
//! - Backend API v2 ([`Backend`]): a plan is [`prepare`](Backend::prepare)d once per backend;
//!   [`forward_into`](Backend::forward_into) / [`backward_into`](Backend::backward_into) take
//!   their inputs as structs of [`StridedView`]s (`[B, H, L, D]`, unit stride in D, any batch,
//!   head and row strides), write caller-owned contiguous outputs, use a caller-owned workspace
//!   and run on the threads a [`Par`] names. Q `[B, Hq, Lq, Dqk]`, K `[B, Hkv, Lkv, Dqk]`,
//!   V `[B, Hkv, Lkv, Dv]`, storage f32 or bf16 (the same for q, k, v, and for o and d_o in
//!   backward). O, dQ, dK and dV are in q's storage dtype; LSE `[B, Hq, Lq]`, max_logit `[B, Hq]`
//!   and dsinks `[Hq]` are f32. [`Backend::forward`]/[`Backend::backward`] allocate their outputs.
//! - Every input is checked first ([`check_forward`], [`check_backward`], shared by all backends);
//!   bad input is an [`Error::InvalidArgument`](tessera_core::Error) naming the argument, what was
//!   expected and what was found. Nothing panics on user input.
//! - Semantics are docs/semantics.md#attention: `s_ij = scale·q_i·k_j`, optional softcap `c·tanh(s/c)`, optional sink
//!   logit per query head in the denominator only, rows with no allowed key give `O = 0` and
//!   `LSE = -inf` (`LSE = σ_h` with a sink), never NaN; `max_logit` is taken before the softcap.
//! - NaN/inf inputs: a non-finite value in Q, K, V (or dO, O in backward) propagates only to the
//!   outputs that depend on it through allowed pairs. In the forward pass a NaN in `q_i` makes
//!   `O_i`, `LSE_i` and `max_logit[b, h]` NaN; a NaN in `k_j` does the same for every row `i` that
//!   may attend `j`; a NaN in `v_j` makes `O_i` NaN for every such row (LSE untouched). Rows that
//!   cannot attend the poisoned key are bit-for-bit unaffected: masked pairs are excluded exactly
//!   (never multiplied by zero). The CPU backend detects non-finite inputs up front and then uses a
//!   slower zero-skipping product for the affected matrix products.
//! - Results are deterministic: bit-identical run to run with the same thread count (the CPU
//!   backend's results do not even depend on the thread count; no atomics, fixed reduction order).
//!
//! Crate map, in layer order (a module imports only from modules listed before it; this file
//! only declares modules and re-exports): [`AttnOptions`] (`options`), strided views and output
//! buffers (`views`), [`Par`] (`par`); the argument structs of a call (`args`); validation
//! (`validate`); the [`Backend`] trait and the owned output buffers (`backend`); [`cpu`]
//! (work-list driven tiled kernels, runtime ISA dispatch; its module doc maps the kernel phases
//! to files and layers) and [`cuda`] (the GPU backend's place, empty in this build); gated
//! telemetry over any backend and [`effective_gflops`] (`telemetry`). A new backend implements
//! [`Backend`], calls [`check_forward`]/[`check_backward`] first, and must pass the suite.
//!
//! ```
//! use std::sync::Arc;
//! use tessera_attn::{AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs,
//!                    Par, StridedView, ViewData};
//! use tessera_mask::Mask;
//! use tessera_plan::{build_plan, PlanShape, TileShape};
//!
//! // Q stored as PyTorch's [B, L, H, D] (B=1, L=48, H=2, D=16), read in place as [B, H, L, D].
//! let (l, h, d) = (48, 2, 16);
//! let x: Vec<f32> = (0..l * h * d).map(|i| ((i * 7919) % 23) as f32 / 23.0 - 0.5).collect();
//! let q = StridedView::new("q", ViewData::F32(&x), [1, h, l, d], [l * h * d, d, h * d, 1])?;
//! let inputs = AttnInputs { q, k: q, v: q };
//! let plan = Arc::new(build_plan(&Mask::causal(), PlanShape::new(1, h, l, l)?,
//!                                TileShape::new(16, 16)?)?);
//! let cpu = CpuBackend::new();
//! let prepared = cpu.prepare(&plan)?;                       // once per plan
//! let opts = AttnOptions { softcap: Some(20.0), ..AttnOptions::default() };
//! let dims = tessera_attn::check_inputs(&inputs, &opts)?;
//! let (mut out, mut ws) = (ForwardBufs::new(&dims), CpuWorkspace::new());
//! cpu.forward_into(&prepared, &inputs, &opts, out.out(), &mut ws, Par::Seq)?;
//! let out = out.finish(&dims)?;
//! // Query 0 attends only key 0: its output (head 0) is V's row 0 (stored first) exactly.
//! assert_eq!(out.o.to_f32_vec()?[..d], x[..d]);
//! assert!(out.lse.to_f32_vec()?.iter().all(|x| x.is_finite()));
//! # Ok::<(), tessera_core::Error>(())
//! ```

mod args;
mod backend;
pub mod cpu;
pub mod cuda;
mod options;
mod par;
mod telemetry;
mod validate;
mod views;

pub use args::{
    AttnInputs, BackwardOutput, ForwardOut, ForwardOutput, GradInputs, GradOut, TelemetryInput,
};
pub use backend::{Backend, ForwardBufs, GradBufs, Prepared};
pub use cpu::{CpuBackend, CpuPlan, CpuWorkspace};
pub use options::AttnOptions;
pub use par::{Par, PoolCache};
pub use telemetry::{effective_gflops, forward_logged, forward_logged_into, LogContext};
pub use tessera_telemetry::AttnSummary;
pub use validate::{
    check_backward, check_forward, check_forward_out, check_grad_out, check_inputs, check_o_like,
    check_plan_consistent, Dims,
};
pub use views::{OutData, StridedView};

pub use tessera_core::tensor::{TensorView, ViewData};
