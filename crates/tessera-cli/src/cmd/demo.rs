//! `tessera demo`: the main job on built-in defaults.
//!
//! Plans a packed-document causal mask at 32K tokens (documents of varied lengths, seeded),
//! prints its statistics and writes its picture.

use crate::cmd::plan::PlanReport;
use crate::ctx::Ctx;
use std::path::PathBuf;
use tessera_core::{Error, Result};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{PlanShape, TileShape};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera demo\n  tessera demo --seq-len 16384 --out-dir /tmp/demo"
)]
pub struct DemoArgs {
    /// Tokens in the packed row.
    #[arg(long, value_name = "N", default_value_t = 32768)]
    pub seq_len: usize,
    /// Directory for the demo's files (created if missing).
    #[arg(long, value_name = "DIR", default_value = "tessera-demo")]
    pub out_dir: PathBuf,
}

/// Seeded document lengths between 256 and 3072 tokens (a small xorshift keeps it dependency-free
/// and identical on every machine).
pub fn demo_segments(len: usize) -> Vec<i64> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut ids = Vec::with_capacity(len);
    let mut doc = 0;
    while ids.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let n = (256 + (state % 2817) as usize).min(len - ids.len());
        ids.extend(std::iter::repeat_n(doc, n));
        doc += 1;
    }
    ids
}

pub fn run(args: DemoArgs, ctx: &Ctx) -> Result<()> {
    std::fs::create_dir_all(&args.out_dir).map_err(|e| Error::io(&args.out_dir, e))?;
    let segs = SegmentIds::shared(demo_segments(args.seq_len))?;
    let docs = segs.row(0).last().map_or(0, |d| d + 1);
    let mask = Mask::causal() & Mask::document(Segments::shared(segs));
    let shape = PlanShape::new(1, 1, args.seq_len, args.seq_len)?;
    let plan = ctx.plan(&mask, shape, TileShape::default())?;
    println!(
        "demo: {docs} packed documents in one row of {} tokens, mask 'causal & document'",
        args.seq_len
    );
    println!("{}", PlanReport::new(&plan, 128).to_text());
    let png = args.out_dir.join("plan.png");
    crate::picture::plan_picture(&plan, 0, 0, "causal & document (demo)", &png)?;
    println!("picture: {}", png.display());
    Ok(())
}
