//! `tessera telemetry plot`: picture of a telemetry JSON-lines file (docs/semantics.md#telemetry): sink mass per
//! head over steps as a heatmap, and max_logit per head over steps.
//!
//! The file holds one record per (step, layer) (schema: `docs/telemetry.md`). `--layer N` plots
//! one layer (heads over steps, max_logit per head); `--layer all`, the default when the file
//! holds several layers, draws the overview of every layer (sink mass per layer and head, the
//! largest max_logit per layer). When a (step, layer) appears more than once (a resumed run
//! appending again) the last record wins, with a note on stderr.

use crate::ctx::{print_json, Ctx};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tessera::core::{Error, Result};

/// Inspect attention telemetry written as JSON lines.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera telemetry plot --in telemetry.jsonl --out sinks.png --layer 0\n  tessera telemetry plot --in telemetry.jsonl --out layers.png --layer all"
)]
pub struct TelemetryArgs {
    #[command(subcommand)]
    pub action: TelemetryAction,
}

#[derive(clap::Subcommand, Debug)]
pub enum TelemetryAction {
    /// Plot sink mass (head × step heatmap) and max_logit per head over steps as a PNG.
    #[command(
        after_help = "Examples:\n  tessera telemetry plot --in telemetry.jsonl --out sinks.png\n  tessera telemetry plot --in run/telemetry.jsonl --out layer3.png --layer 3 --json\n  tessera telemetry plot --in run/telemetry.jsonl --out layers.png --layer all"
    )]
    Plot {
        /// Telemetry JSON lines, one record per (step, layer).
        #[arg(long = "in", value_name = "F.jsonl")]
        input: PathBuf,
        /// Output picture (PNG, written atomically).
        #[arg(long, value_name = "F.png")]
        out: PathBuf,
        /// Layer to plot, or `all` for every layer in one picture (the default when the file
        /// holds more than one layer).
        #[arg(long, value_name = "N|all", value_parser = parse_layer)]
        layer: Option<LayerChoice>,
    },
}

/// What `--layer` selects.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LayerChoice {
    /// Every layer, in the overview picture.
    All,
    /// One layer.
    One(u32),
}

fn parse_layer(s: &str) -> std::result::Result<LayerChoice, String> {
    if s == "all" {
        return Ok(LayerChoice::All);
    }
    s.parse::<u32>()
        .map(LayerChoice::One)
        .map_err(|_| format!("expected a layer number or 'all', got '{s}'"))
}

#[derive(serde::Serialize)]
struct PlotReport {
    out: String,
    /// The plotted layers.
    layers: Vec<u32>,
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

fn plot(input: &Path, out: &Path, layer: Option<LayerChoice>, ctx: &Ctx) -> Result<()> {
    crate::ctx::check_outputs(&[("--out", out, &[])])?;
    let records = tessera::telemetry::read_jsonl(input)?;
    if records.is_empty() {
        return Err(Error::format(
            input,
            "no telemetry records (the file is empty)",
        ));
    }
    let layers: BTreeSet<u32> = records.iter().map(|r| r.layer).collect();
    let choice = match layer {
        Some(LayerChoice::One(l)) if !layers.contains(&l) => {
            let list: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
            return Err(Error::invalid(
                "--layer",
                format!(
                    "one of the layers in {}: {} (or 'all')",
                    input.display(),
                    list.join(", ")
                ),
                l,
            ));
        }
        Some(c) => c,
        None if layers.len() == 1 => LayerChoice::One(*layers.first().unwrap_or(&0)),
        None => LayerChoice::All,
    };
    // The last record of each (layer, step) wins.
    let mut by_key = BTreeMap::new();
    let mut selected = 0usize;
    let wanted = |l: u32| choice == LayerChoice::All || choice == LayerChoice::One(l);
    for r in records.into_iter().filter(|r| wanted(r.layer)) {
        selected += 1;
        by_key.insert((r.layer, r.step), r);
    }
    let duplicates = selected - by_key.len();
    if duplicates > 0 {
        eprintln!(
            "tessera: note: {duplicates} (step, layer) record(s) appear more than once; the last of each is plotted"
        );
    }
    let records: Vec<_> = by_key.into_values().collect();
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| input.display().to_string());
    let title = format!("attention telemetry: {name}");
    match choice {
        LayerChoice::One(_) => tessera::viz::write_telemetry_png(&records, &title, out)?,
        LayerChoice::All => tessera::viz::write_telemetry_layers_png(&records, &title, out)?,
    }
    let steps: BTreeSet<u64> = records.iter().map(|r| r.step).collect();
    let report = PlotReport {
        out: out.display().to_string(),
        layers: records
            .iter()
            .map(|r| r.layer)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect(),
        steps: steps.len(),
        first_step: steps.first().copied().unwrap_or(0),
        last_step: steps.last().copied().unwrap_or(0),
        heads: records.first().map_or(0, |r| r.heads()),
        duplicate_steps: duplicates,
    };
    if ctx.json() {
        return print_json(&report);
    }
    let which = match choice {
        LayerChoice::One(l) => format!("layer {l}"),
        LayerChoice::All => format!("{} layers", report.layers.len()),
    };
    println!(
        "wrote {}: {which}, {} steps ({} .. {}), {} heads",
        report.out, report.steps, report.first_step, report.last_step, report.heads
    );
    Ok(())
}
