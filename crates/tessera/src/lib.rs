//! Tessera: block-sparse attention planned at tile granularity.
//!
//! This facade is the one crate a downstream user (and the CLI, and the Python bindings)
//! depends on. It re-exports the end-to-end path of docs/ARCHITECTURE.md: a [`Mask`] expression, the
//! planner ([`build_plan`] → [`Plan`]), the attention [`Backend`]s and the surrounding
//! services (plan [`cache`], document [`pack`]ing, [`export`]ers for Splash and FlexAttention,
//! tensor [`io`], gated [`telemetry`], PNG pictures in [`viz`]) and the [`conformance`] suite
//! with its seeded workloads. Each sub-crate is also reachable as a module.
//!
//! ```
//! use std::sync::Arc;
//! use tessera::{build_plan, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace,
//!               ForwardBufs, GradBufs, GradInputs, Mask, Par, PlanShape, SegmentIds,
//!               Segments, Tensor, TileShape};
//!
//! // Two documents packed into one 300-token row, causal within each.
//! let seg: Vec<i64> = (0..300).map(|i| if i < 180 { 0 } else { 1 }).collect();
//! let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(seg)?));
//! let (b, h, l, d) = (1, 2, 300, 32);
//! let plan = Arc::new(build_plan(&mask, PlanShape::new(b, h, l, l)?, TileShape::new(64, 64)?)?);
//! assert!(plan.stats.density < 0.5);
//!
//! let x = |seed: u32| -> tessera::Result<Tensor> {
//!     let v = (0..b * h * l * d).map(|i| ((i as u32 ^ seed) % 17) as f32 / 17.0 - 0.5);
//!     Tensor::from_f32(vec![b, h, l, d], v.collect())
//! };
//! let (q, k, v, d_o) = (x(1)?, x(2)?, x(3)?, x(4)?);
//! // Prepare once, then call with caller-owned outputs and workspace (reused across steps).
//! let (cpu, opts) = (CpuBackend::new(), AttnOptions::default());
//! let prepared = cpu.prepare(&plan)?;
//! let mut ws = CpuWorkspace::new();
//! let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
//! let dims = tessera::attn::check_inputs(&inputs, &opts)?;
//! let mut fwd = ForwardBufs::new(&dims);
//! cpu.forward_into(&prepared, &inputs, &opts, fwd.out(), &mut ws, Par::Current)?;
//! let fwd = fwd.finish(&dims)?;
//! let grads_in = GradInputs::contiguous(inputs, fwd.o.view(), fwd.lse.view(), d_o.view())?;
//! let mut grads = GradBufs::new(&dims, false);
//! cpu.backward_into(&prepared, &grads_in, &opts, grads.out(), &mut ws, Par::Current)?;
//! assert_eq!(grads.finish(&dims)?.dq.shape(), &[b, h, l, d]);
//! # Ok::<(), tessera::Error>(())
//! ```

pub use tessera_attn as attn;
pub use tessera_cache as cache;
pub use tessera_conformance as conformance;
pub use tessera_core as core;
pub use tessera_export as export;
pub use tessera_io as io;
pub use tessera_mask as mask;
pub use tessera_pack as pack;
pub use tessera_plan as plan;
pub use tessera_telemetry as telemetry;
pub use tessera_viz as viz;

pub use tessera_attn::{
    AttnInputs, AttnOptions, Backend, BackwardOutput, CpuBackend, CpuPlan, CpuWorkspace,
    ForwardBufs, ForwardOut, ForwardOutput, GradBufs, GradInputs, GradOut, OutData, Par, Prepared,
    StridedView, TensorView, ViewData,
};
pub use tessera_cache::{CacheConfig, CacheWarning, Lookup, PlanCache, PlanSource};
pub use tessera_core::{DType, Error, Result, Tensor, TensorData};
pub use tessera_mask::{parse, BlockSelection, DenseMask, Mask, SegmentIds, Segments};
pub use tessera_plan::{
    build_plan, build_plan_within, build_tile_states, shard, CostModel, KvLayout, Plan, PlanShape,
    PlanStats, RankCost, Scheme, Sharding, TileShape, TileState,
};
