//! Tessera: block-sparse attention planned at tile granularity.
//!
//! This facade is the one crate a downstream user (and the CLI, and the Python bindings)
//! depends on. It re-exports the end-to-end path of SPEC §1: a [`Mask`] expression, the
//! planner ([`build_plan`] → [`Plan`]), the attention [`Backend`]s and the surrounding
//! services (plan [`cache`], document [`pack`]ing, [`export`]ers for Splash and FlexAttention,
//! tensor [`io`], gated [`telemetry`], PNG pictures in [`viz`]). Each sub-crate is also
//! reachable as a module.
//!
//! ```
//! use tessera::{build_plan, AttnOptions, Backend, CpuBackend, Mask, PlanShape, Segments,
//!               SegmentIds, Tensor, TileShape};
//!
//! // Two documents packed into one 300-token row, causal within each.
//! let seg: Vec<i64> = (0..300).map(|i| if i < 180 { 0 } else { 1 }).collect();
//! let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(seg)?));
//! let (b, h, l, d) = (1, 2, 300, 32);
//! let plan = build_plan(&mask, PlanShape::new(b, h, l, l)?, TileShape::new(64, 64)?)?;
//! assert!(plan.stats.density < 0.5);
//!
//! let x = |seed: u32| -> tessera::Result<Tensor> {
//!     let v = (0..b * h * l * d).map(|i| ((i as u32 ^ seed) % 17) as f32 / 17.0 - 0.5);
//!     Tensor::from_f32(vec![b, h, l, d], v.collect())
//! };
//! let (q, k, v, d_o) = (x(1)?, x(2)?, x(3)?, x(4)?);
//! let cpu = CpuBackend::new();
//! let fwd = cpu.forward(q.view(), k.view(), v.view(), &plan, &AttnOptions::default())?;
//! let grads = cpu.backward(
//!     q.view(), k.view(), v.view(), fwd.o.view(), fwd.lse.view(), d_o.view(),
//!     &plan, &AttnOptions::default(),
//! )?;
//! assert_eq!(grads.dq.shape(), &[b, h, l, d]);
//! # Ok::<(), tessera::Error>(())
//! ```

pub use tessera_attn as attn;
pub use tessera_cache as cache;
pub use tessera_core as core;
pub use tessera_export as export;
pub use tessera_io as io;
pub use tessera_mask as mask;
pub use tessera_pack as pack;
pub use tessera_plan as plan;
pub use tessera_telemetry as telemetry;
pub use tessera_viz as viz;

pub use tessera_attn::{
    AttnOptions, Backend, BackwardOutput, CpuBackend, ForwardOutput, TensorView, ViewData,
};
pub use tessera_cache::{CacheConfig, CacheWarning, Lookup, PlanCache, PlanSource};
pub use tessera_core::{DType, Error, Result, Tensor, TensorData};
pub use tessera_mask::{parse, DenseMask, Mask, SegmentIds, Segments};
pub use tessera_plan::{build_plan, Plan, PlanShape, PlanStats, TileShape, TileState};
