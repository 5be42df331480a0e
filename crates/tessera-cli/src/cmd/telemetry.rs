//! `tessera telemetry plot`: picture of a telemetry JSON-lines file (SPEC §6): sink mass per
//! head over steps as a heatmap, and max_logit per head over steps.
//!
//! The file holds one record per (step, layer) (schema: `docs/telemetry.md`). One layer is
//! plotted: `--layer N`, or the only layer in the file. When a step appears more than once for
//! that layer (a resumed run appending again) the last record wins, with a note on stderr.

use crate::ctx::{print_json, Ctx};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tessera::core::{Error, Result};

/// Inspect attention telemetry written as JSON lines.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera telemetry plot --in telemetry.jsonl --out sinks.png --layer 0"
)]
pub struct TelemetryArgs {
    #[command(subcommand)]
    pub action: TelemetryAction,
}

#[derive(clap::Subcommand, Debug)]
pub enum TelemetryAction {
    /// Plot sink mass (head × step heatmap) and max_logit per head over steps as a PNG.
    #[command(
        after_help = "Examples:\n  tessera telemetry plot --in telemetry.jsonl --out sinks.png\n  tessera telemetry plot --in run/telemetry.jsonl --out layer3.png --layer 3 --json"
    )]
    Plot {
        /// Telemetry JSON lines, one record per (step, layer).
        #[arg(long = "in", value_name = "F.jsonl")]
        input: PathBuf,
        /// Output picture (PNG, written atomically).
        #[arg(long, value_name = "F.png")]
        out: PathBuf,
        /// Layer to plot (required when the file holds more than one).
        #[arg(long, value_name = "N")]
        layer: Option<u32>,
    },
}

#[derive(serde::Serialize)]
struct PlotReport {
    out: String,
    layer: u32,
    steps: usize,
    first_step: u64,
    last_step: u64,
    heads: usize,
    duplicate_steps: usize,
}

pub fn run(args: TelemetryArgs, ctx: &Ctx) -> Result<()> {
    match args.action {
        TelemetryAction::Plot { input, out, layer } => plot(&input, &out, layer, ctx),
    }
}

fn plot(input: &Path, out: &Path, layer: Option<u32>, ctx: &Ctx) -> Result<()> {
    crate::ctx::check_outputs(&[("--out", out, &[])])?;
    let records = tessera::telemetry::read_jsonl(input)?;
    if records.is_empty() {
        return Err(Error::format(
            input,
            "no telemetry records (the file is empty)",
        ));
    }
    let layers: BTreeSet<u32> = records.iter().map(|r| r.layer).collect();
    let list = || {
        layers
            .iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let layer = match layer {
        Some(l) if layers.contains(&l) => l,
        Some(l) => {
            return Err(Error::invalid(
                "--layer",
                format!("one of the layers in {}: {}", input.display(), list()),
                l,
            ))
        }
        None if layers.len() == 1 => layers.iter().copied().next().unwrap_or(0),
        None => {
            return Err(Error::invalid(
                "--layer",
                format!(
                    "a layer to plot ({} holds layers {})",
                    input.display(),
                    list()
                ),
                "none given",
            ))
        }
    };
    let mut by_step = BTreeMap::new();
    let mut selected = 0usize;
    for r in records.into_iter().filter(|r| r.layer == layer) {
        selected += 1;
        by_step.insert(r.step, r);
    }
    let duplicates = selected - by_step.len();
    if duplicates > 0 {
        eprintln!(
            "tessera: note: {duplicates} step(s) of layer {layer} appear more than once; the last record of each is plotted"
        );
    }
    let records: Vec<_> = by_step.into_values().collect();
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| input.display().to_string());
    tessera::viz::write_telemetry_png(&records, &format!("attention telemetry: {name}"), out)?;
    let report = PlotReport {
        out: out.display().to_string(),
        layer,
        steps: records.len(),
        first_step: records.first().map_or(0, |r| r.step),
        last_step: records.last().map_or(0, |r| r.step),
        heads: records.first().map_or(0, |r| r.heads()),
        duplicate_steps: duplicates,
    };
    if ctx.json() {
        return print_json(&report);
    }
    println!(
        "wrote {}: layer {}, {} steps ({} .. {}), {} heads",
        report.out, report.layer, report.steps, report.first_step, report.last_step, report.heads
    );
    Ok(())
}
