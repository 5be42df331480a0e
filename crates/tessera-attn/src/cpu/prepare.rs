//! What `CpuBackend::prepare` derives from a plan, once: the partial masks transposed for the
//! key-major forward loops ([`MasksT`]) and their live 16 × 16 sub-blocks ([`LiveBlocks`]).
//!
//! Contract: [`PlanData::new`] is the only place plan preprocessing happens; it is counted as
//! the kernel variant `cpu.prepare` in `tessera_core::metrics`, so callers (and tests) can show
//! that calls on a prepared plan do none.

use super::live_blocks::LiveBlocks;
use super::mask_partial_tile::MasksT;
use std::time::Instant;
use tessera_core::metrics;
use tessera_plan::Plan;

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
