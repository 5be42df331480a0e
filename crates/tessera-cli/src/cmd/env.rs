//! `tessera env`: the run manifest (SPEC §7).

use crate::ctx::{print_json, Ctx};
use tessera::core::Result;

/// Print the run manifest: version, git revision, rustc, CPU and its features, threads, cache.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  tessera env\n  tessera env --json")]
pub struct EnvArgs {}

pub fn run(_args: EnvArgs, ctx: &Ctx) -> Result<()> {
    let manifest = crate::manifest::collect(ctx.plan_cache().dir());
    if ctx.json() {
        print_json(&manifest)
    } else {
        print!("{}", manifest.to_text());
        Ok(())
    }
}
