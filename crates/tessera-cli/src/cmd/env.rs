//! `tessera env`: the run manifest (docs/semantics.md#plan-cache), with the CPU kernel-path decision.

use crate::ctx::{print_json, Ctx};
use tessera::core::Result;

/// Print the run manifest: version, git revision, rustc, CPU and its features, threads, cache,
/// and the CPU kernel path of each dtype with why it was chosen (measured, stored, the
/// TESSERA_CPU_PATHS override, or the only candidate). The peak probe is not run here.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  tessera env\n  tessera env --json\n  TESSERA_CPU_PATHS=f32=avx2,bf16=widen-avx2 tessera env"
)]
pub struct EnvArgs {}

pub fn run(_args: EnvArgs, ctx: &Ctx) -> Result<()> {
    let decision = ctx.kernel_decision()?;
    let manifest = crate::manifest::collect(ctx.plan_cache().dir(), Some(decision));
    if ctx.json() {
        print_json(&manifest)
    } else {
        print!("{}", manifest.to_text());
        Ok(())
    }
}
