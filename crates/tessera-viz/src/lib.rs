//! Pictures for people (docs/semantics.md#telemetry, docs/semantics.md#command-line): the tile-state map of a [`Plan`] and the plot of an
//! attention-telemetry run, as PNG.
//!
//! Contract: every function returns the PNG bytes ([`plan_png`], [`telemetry_png`],
//! [`telemetry_layers_png`]) or writes them atomically through [`tessera_io::atomic_write`]
//! ([`write_plan_png`], [`write_telemetry_png`], [`write_telemetry_layers_png`]); nothing is printed. Text uses a built-in bitmap font
//! (`embedded-graphics`), so no font file or system library is needed. Bad input (a batch row or
//! head outside the plan, records with differing head counts) is an
//! [`Error::InvalidArgument`](tessera_core::Error::InvalidArgument), never a panic.
//!
//! ```
//! use tessera_mask::Mask;
//! use tessera_plan::{build_plan, PlanShape, TileShape};
//!
//! let plan = build_plan(
//!     &(Mask::causal() & Mask::window(256, 0)),
//!     PlanShape::new(1, 1, 2048, 2048)?,
//!     TileShape::new(128, 128)?,
//! )?;
//! let png = tessera_viz::plan_png(&plan, 0, 0, "window(256) & causal")?;
//! assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
//! assert!(tessera_viz::plan_png(&plan, 1, 0, "no such batch row").is_err());
//! # Ok::<(), tessera_core::Error>(())
//! ```

mod canvas;
mod cp_sim;
mod plan;
mod telemetry;
mod telemetry_layers;

pub use cp_sim::cp_sim_png;
pub use plan::plan_png;
pub use telemetry::{telemetry_png, MAX_PLOT_HEADS};
pub use telemetry_layers::{telemetry_layers_png, MAX_PLOT_LAYERS};

use std::path::Path;
use tessera_core::Result;
use tessera_plan::Plan;
use tessera_telemetry::TelemetryRecord;

/// Writes [`plan_png`] to `path`, atomically.
pub fn write_plan_png(
    plan: &Plan,
    batch: usize,
    head: usize,
    title: &str,
    path: &Path,
) -> Result<()> {
    tessera_io::atomic_write_bytes(path, &plan_png(plan, batch, head, title)?)
}

/// Writes [`cp_sim_png`] to `path`, atomically.
pub fn write_cp_sim_png(
    rows: &[tessera_plan::cp_sim::SimRow],
    title: &str,
    path: &Path,
) -> Result<()> {
    tessera_io::atomic_write_bytes(path, &cp_sim_png(rows, title)?)
}

/// Writes [`telemetry_png`] to `path`, atomically.
pub fn write_telemetry_png(records: &[TelemetryRecord], title: &str, path: &Path) -> Result<()> {
    tessera_io::atomic_write_bytes(path, &telemetry_png(records, title)?)
}

/// Writes [`telemetry_layers_png`] to `path`, atomically.
pub fn write_telemetry_layers_png(
    records: &[TelemetryRecord],
    title: &str,
    path: &Path,
) -> Result<()> {
    tessera_io::atomic_write_bytes(path, &telemetry_layers_png(records, title)?)
}
