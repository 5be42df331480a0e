//! `tessera cp-sim`: balance and K/V traffic of context-parallel shardings on a seeded
//! doc-causal row (the model of `tessera::plan::cp_sim`), as a table, JSON and a chart.

use crate::ctx::{print_json, Ctx};
use std::path::PathBuf;
use tessera::core::{Error, Result};
use tessera::plan::cp_sim::{simulate, DocMix, SimModel, SimRow};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  tessera cp-sim\n  tessera cp-sim --lengths 512K --ranks 8 --json\n  tessera cp-sim --mix web --seed 6 --lengths 512K --ranks 8\n  tessera cp-sim --flops-tera 400 --link-gbps 50 --png cp.png"
)]
pub struct CpSimArgs {
    /// Row lengths in tokens (K = 1024, M = 1048576), comma-separated.
    #[arg(long, value_name = "N,...", default_value = "128K,512K,1M")]
    pub lengths: String,
    /// World sizes, comma-separated.
    #[arg(long, value_name = "R,...", default_value = "2,4,8,16,32")]
    pub ranks: String,
    /// Seed of the document-length draw.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Document mix: `tokens` (30% of the row's tokens in 32K-128K documents) or `web` (packed web
    /// documents: 1% of documents 32K-128K).
    #[arg(long, default_value = "tokens", value_parser = ["tokens", "web"])]
    pub mix: String,
    /// Balanced scheme's cap on the busiest rank's cost over the mean.
    #[arg(long, value_name = "X", default_value_t = 1.02)]
    pub balance_cap: f64,
    /// Sustained attention TFLOP/s per rank.
    #[arg(long, value_name = "T", default_value_t = 400.0)]
    pub flops_tera: f64,
    /// Link bandwidth into one rank, GB/s.
    #[arg(long, value_name = "G", default_value_t = 50.0)]
    pub link_gbps: f64,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// K/V heads.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tile side.
    #[arg(long, default_value_t = 128)]
    pub tile: usize,
    /// Write the balance chart (max/mean per-rank cost) as PNG.
    #[arg(long, value_name = "F.png")]
    pub png: Option<PathBuf>,
}

/// `128K` → 131072, `1M` → 1048576, `4096` → 4096.
fn size(arg: &str, s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K') | Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') | Some('m') => (&t[..t.len() - 1], 1 << 20),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::invalid(arg, "positive sizes such as 4096, 128K or 1M", s))
}

fn list(arg: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',').map(|x| size(arg, x)).collect()
}

fn mib(b: f64) -> String {
    format!("{:.1}", b / (1 << 20) as f64)
}

#[derive(serde::Serialize)]
struct JsonRow {
    tokens: usize,
    ranks: usize,
    scheme: &'static str,
    cost_max_over_mean: f64,
    pairs_max_over_mean: f64,
    tiles_max_over_mean: f64,
    tiles_max: u64,
    extra_tiles: i64,
    allgather_bytes: f64,
    needed_bytes_max: f64,
    needed_bytes_mean: f64,
    needed_fraction_max: f64,
    step_allgather_s: f64,
    step_needed_s: f64,
    shard_ms: f64,
}

impl From<&SimRow> for JsonRow {
    fn from(r: &SimRow) -> Self {
        JsonRow {
            tokens: r.tokens,
            ranks: r.ranks,
            scheme: r.scheme.name(),
            cost_max_over_mean: r.cost_max_over_mean,
            pairs_max_over_mean: r.pairs_max_over_mean,
            tiles_max_over_mean: r.tiles_max_over_mean,
            tiles_max: r.tiles_max,
            extra_tiles: r.extra_tiles,
            allgather_bytes: r.allgather_bytes,
            needed_bytes_max: r.needed_bytes_max,
            needed_bytes_mean: r.needed_bytes_mean,
            needed_fraction_max: r.needed_fraction_max,
            step_allgather_s: r.step_allgather_s,
            step_needed_s: r.step_needed_s,
            shard_ms: r.shard_ms,
        }
    }
}

#[derive(serde::Serialize)]
struct Report {
    assumptions: Vec<String>,
    rows: Vec<JsonRow>,
}

pub fn run(args: CpSimArgs, ctx: &Ctx) -> Result<()> {
    let lengths = list("--lengths", &args.lengths)?;
    let ranks = list("--ranks", &args.ranks)?;
    for (name, v) in [
        ("--flops-tera", args.flops_tera),
        ("--link-gbps", args.link_gbps),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::invalid(name, "a finite positive number", v));
        }
    }
    for (name, v) in [
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
    ] {
        if v == 0 {
            return Err(Error::invalid(name, "a positive int", v));
        }
    }
    if !(args.balance_cap.is_finite() && args.balance_cap >= 1.0) {
        return Err(Error::invalid(
            "--balance-cap",
            "a finite number >= 1",
            args.balance_cap,
        ));
    }
    let model = SimModel {
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        flops: args.flops_tera * 1e12,
        link_bytes_per_s: args.link_gbps * 1e9,
        tile: args.tile,
        cost: tessera::CostModel {
            balance_cap: args.balance_cap,
            ..tessera::CostModel::default()
        },
        ..SimModel::default()
    };
    let mix = if args.mix == "web" {
        DocMix::web(args.seed)
    } else {
        DocMix {
            seed: args.seed,
            ..DocMix::default()
        }
    };
    let rows = simulate(&lengths, &ranks, &mix, &model)?;
    if let Some(p) = &args.png {
        tessera::viz::write_cp_sim_png(&rows, "tessera cp-sim: doc-causal mix", p)?;
    }
    if ctx.json() {
        return print_json(&Report {
            assumptions: model.assumptions(),
            rows: rows.iter().map(JsonRow::from).collect(),
        });
    }
    let long = if mix.long_docs > 0.0 {
        format!("{}% of documents", mix.long_docs * 100.0)
    } else {
        format!("{:.0}% of tokens in", mix.long_fraction * 100.0)
    };
    println!(
        "doc-causal row: lognormal body (median {} tokens, sigma {}) + {long} {}K-{}K documents, seed {}",
        mix.median,
        mix.sigma,
        mix.long_range.0 >> 10,
        mix.long_range.1 >> 10,
        mix.seed
    );
    println!(
        "balanced: least K/V for the busiest receiver with the busiest rank <= {}x the mean cost",
        model.cost.balance_cap
    );
    for a in model.assumptions() {
        println!("assumption: {a}");
    }
    println!(
        "| N | R | scheme | cost max/mean | pairs max/mean | tiles max/mean | extra tiles | KV in/rank all-gather MiB | KV in/rank needed max (mean) MiB | needed max / all-gather | step all-gather ms | step needed ms | shard ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} ({}) | {:.3} | {:.2} | {:.2} | {:.1} |",
            r.tokens,
            r.ranks,
            r.scheme,
            r.cost_max_over_mean,
            r.pairs_max_over_mean,
            r.tiles_max_over_mean,
            r.extra_tiles,
            mib(r.allgather_bytes),
            mib(r.needed_bytes_max),
            mib(r.needed_bytes_mean),
            r.needed_fraction_max,
            r.step_allgather_s * 1e3,
            r.step_needed_s * 1e3,
            r.shard_ms
        );
    }
    Ok(())
}
