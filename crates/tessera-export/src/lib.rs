//! Exporters of Tessera plans to JAX Splash `MaskInfo` and PyTorch FlexAttention `BlockMask`
//! arrays (docs/ARCHITECTURE.md, `docs/export.md`).
//!
//! Contract: an export is a pure function of the [`Plan`]; it reproduces, array for array, what
//! the other engine's own mask preprocessing produces for the same token mask and block sizes
//! (`splash_attention_mask_info.process_mask` / `process_mask_dkv`; `create_block_mask`),
//! padding entries and dtypes included. Both engines see sequences padded with masked-out tokens
//! up to whole blocks, so a ragged-edge tile that Tessera marks Full is Partial there
//! ([`engine_states`]). Files are `.npz` archives written atomically.
//!
//! ```
//! use tessera_export::{export_npz, flex, ExportKind};
//! use tessera_mask::Mask;
//! use tessera_plan::{build_plan, PlanShape, TileShape};
//!
//! let shape = PlanShape::new(1, 1, 256, 256)?;
//! let plan = build_plan(&Mask::causal(), shape, TileShape::new(128, 128)?)?;
//! let f = flex::export(&plan)?;
//! // q block 0: one partial kv block; q block 1: one partial and one full.
//! assert_eq!(f.kv_num_blocks, [1, 1]);
//! assert_eq!(f.full_kv_num_blocks, [0, 1]);
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("causal.flex.npz");
//! export_npz(&plan, ExportKind::Flex, &path)?;
//! assert_eq!(flex::FlexArrays::read_npz(&path)?, f);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod flex;
pub mod npz;
pub mod splash;
mod tiles;

use std::path::Path;
use tessera_core::{Error, Result};
use tessera_plan::Plan;

pub use flex::FlexArrays;
pub use splash::{SplashArrays, SplashOptions};
pub use tiles::engine_states;

/// Which engine's arrays to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExportKind {
    /// JAX Splash attention `MaskInfo` (forward and dKV).
    Splash,
    /// PyTorch FlexAttention `BlockMask`.
    Flex,
}

impl ExportKind {
    /// The command-line spelling (`splash`, `flex`).
    pub fn name(self) -> &'static str {
        match self {
            ExportKind::Splash => "splash",
            ExportKind::Flex => "flex",
        }
    }
}

impl std::str::FromStr for ExportKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "splash" => Ok(ExportKind::Splash),
            "flex" => Ok(ExportKind::Flex),
            _ => Err(Error::invalid("--export", "splash or flex", s)),
        }
    }
}

impl std::fmt::Display for ExportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Refuses an export whose dense per-tile arrays (about 32 bytes per tile per head and batch
/// group, for every engine layout) exceed the memory budget.
pub(crate) fn check_budget(plan: &Plan, what: &str) -> Result<()> {
    let cells = plan.batch_groups as u128
        * plan.shape.heads as u128
        * plan.q_tiles as u128
        * plan.kv_tiles as u128;
    tessera_core::budget::check(|| what.to_string(), 32 * cells)
}

/// Exports `plan` for `kind` and writes the `.npz` at `path` (atomically: temp file + rename).
pub fn export_npz(plan: &Plan, kind: ExportKind, path: &Path) -> Result<()> {
    match kind {
        ExportKind::Splash => splash::export(plan)?.write_npz(path),
        ExportKind::Flex => flex::export(plan)?.write_npz(path),
    }
}
