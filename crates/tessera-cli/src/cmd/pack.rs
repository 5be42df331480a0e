//! `tessera pack`: pack documents into fixed-length rows, or verify a packed file (docs/semantics.md#packing).
//!
//! A thin layer over `tessera::pack`: argument checks, input dispatch by extension (`.npy` means a
//! tokens array with `--offsets`; anything else is read as JSON lines), and one result line on
//! stdout (the statistics, as JSON with `--json`). The output file is written atomically.

use crate::ctx::{print_json, Ctx};
use std::path::{Path, PathBuf};
use tessera::core::{Error, Result};
use tessera::pack::{PackConfig, PackStats, Strategy, DEFAULT_BOS};

/// Row assignment strategy.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StrategyArg {
    /// Best-fit decreasing: longest pieces first, each into the fullest row that fits.
    #[default]
    BestFit,
    /// In input order: a new row whenever the next piece does not fit.
    Greedy,
}

impl From<StrategyArg> for Strategy {
    fn from(s: StrategyArg) -> Self {
        match s {
            StrategyArg::BestFit => Strategy::BestFit,
            StrategyArg::Greedy => Strategy::Greedy,
        }
    }
}

/// Pack documents into rows with segment ids and positions, or verify a packed file.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera pack --input data/corpus/licenses.jsonl --seq-len 2048 --out rows.safetensors\n  tessera pack --verify rows.safetensors"
)]
pub struct PackArgs {
    /// Documents: JSON lines with {"tokens": [...]} or {"text": "..."} (byte-level) per line, or a
    /// 1-d integer tokens .npy (with --offsets).
    #[arg(long, value_name = "F")]
    pub input: Option<PathBuf>,
    /// Document boundaries for a tokens .npy: ndocs+1 integers from 0 to the number of tokens,
    /// non-decreasing.
    #[arg(long, value_name = "F")]
    pub offsets: Option<PathBuf>,
    /// Row length in tokens (at least 2). Longer documents are split into pieces that each start
    /// with BOS.
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// How pieces are assigned to rows.
    #[arg(long, value_enum, default_value_t = StrategyArg::BestFit)]
    pub strategy: StrategyArg,
    /// BOS token id put at every document start [default: 256, after the 256 byte tokens]. With
    /// --verify, require this id at every document start.
    #[arg(long, value_name = "ID")]
    pub bos: Option<u32>,
    /// Output .safetensors with i32 tokens, segment_ids (-1 = padding) and positions, each
    /// [rows, seq-len]. Without it only the statistics are printed.
    #[arg(long, value_name = "F")]
    pub out: Option<PathBuf>,
    /// Re-read a packed file and check every invariant instead of packing.
    #[arg(long, value_name = "F", conflicts_with_all = ["input", "offsets", "seq_len", "out"])]
    pub verify: Option<PathBuf>,
}

pub fn run(args: PackArgs, ctx: &Ctx) -> Result<()> {
    if let Some(path) = &args.verify {
        let stats = tessera::pack::verify_packed_with(path, args.bos)?;
        return report(ctx, &stats, || {
            format!(
                "{}: ok, {} rows of {}: {} segments ({} tokens), padding {:.1}%",
                path.display(),
                stats.rows,
                stats.seq_len,
                stats.pieces,
                stats.tokens,
                stats.padding_pct
            )
        });
    }

    let input = args.input.as_deref().ok_or_else(|| {
        Error::invalid(
            "--input",
            "a JSON-lines or tokens .npy file to pack (or --verify F)",
            "nothing",
        )
    })?;
    let seq_len = args
        .seq_len
        .ok_or_else(|| Error::invalid("--seq-len", "a row length of at least 2", "nothing"))?;
    if seq_len < 2 {
        return Err(Error::invalid(
            "--seq-len",
            "a row length of at least 2 (BOS plus one token)",
            seq_len,
        ));
    }
    if let Some(out) = &args.out {
        // Fail before the (possibly long) packing rather than after it.
        crate::ctx::check_outputs(&[("--out", out, &["safetensors"])])?;
    }
    let cfg = PackConfig {
        seq_len,
        strategy: args.strategy.into(),
        bos: args.bos.unwrap_or(DEFAULT_BOS),
    };
    // Drawn only when stderr is a terminal.
    let mut bars = crate::progress::PackBars::default();
    let mut progress = |p: tessera::pack::Progress<'_>| bars.report(p);

    let packed = if has_ext(input, "npy") {
        let offsets = args.offsets.as_deref().ok_or_else(|| {
            Error::invalid(
                "--offsets",
                "an offsets .npy (ndocs+1 document boundaries) for a tokens .npy input",
                "nothing",
            )
        })?;
        tessera::pack::pack_npy_with_progress(input, offsets, &cfg, &mut progress)?
    } else {
        if let Some(off) = &args.offsets {
            return Err(Error::invalid(
                "--offsets",
                "no offsets for a JSON-lines input (only with a tokens .npy)",
                off.display(),
            ));
        }
        tessera::pack::pack_jsonl_with_progress(input, &cfg, &mut progress)?
    };

    if let Some(out) = &args.out {
        tessera::pack::write_packed(out, &packed)?;
    }
    report(ctx, &packed.stats, || packed.stats.summary())
}

fn has_ext(path: &Path, ext: &str) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

/// One result line on stdout: the statistics as JSON with `--json`, else `human()`.
fn report(ctx: &Ctx, stats: &PackStats, human: impl FnOnce() -> String) -> Result<()> {
    if ctx.json() {
        print_json(stats)
    } else {
        println!("{}", human());
        Ok(())
    }
}
