//! `tessera cache stats | verify | clear`: inspect and maintain the plan cache (docs/semantics.md#plan-cache).
//!
//! `verify` prints every bad entry and a summary on stdout; it exits 0 only when every entry is
//! valid, and 2 (with one line on stderr) when any is bad. Bad entries are harmless otherwise:
//! the next run that needs one rejects, rebuilds and rewrites it.

use crate::ctx::{print_json, Ctx};
use tessera::core::{Error, Result};

/// Inspect or maintain the persistent plan cache.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  tessera cache stats\n  tessera cache verify --cache-dir /tmp/plans\n  tessera cache clear"
)]
pub struct CacheArgs {
    #[command(subcommand)]
    pub action: CacheAction,
}

#[derive(clap::Subcommand, Debug)]
pub enum CacheAction {
    /// Show the cache directory, the number of entries and their size.
    #[command(
        after_help = "Examples:\n  tessera cache stats\n  tessera cache stats --json --cache-dir /tmp/plans"
    )]
    Stats,
    /// Check every entry (header, checksum, decoding, contract); exit 2 if any is bad.
    #[command(after_help = "Example:\n  tessera cache verify --cache-dir ~/.cache/tessera")]
    Verify,
    /// Remove every cache entry (other files in the directory are left alone).
    #[command(after_help = "Example:\n  tessera cache clear --cache-dir /tmp/plans")]
    Clear,
}

pub fn run(args: CacheArgs, ctx: &Ctx) -> Result<()> {
    let cache = ctx.plan_cache();
    let where_ = || match cache.dir() {
        Some(d) => d.display().to_string(),
        None if cache.is_disabled() => "disabled (--no-cache)".to_string(),
        None => "none (no cache directory could be resolved)".to_string(),
    };
    match args.action {
        CacheAction::Stats => {
            let s = cache.stats();
            if ctx.json() {
                return print_json(&s);
            }
            println!("cache dir: {}", where_());
            println!(
                "entries:   {} ({} bytes; bound {} bytes)",
                s.entries, s.bytes, s.max_bytes
            );
        }
        CacheAction::Verify => {
            let r = cache.verify()?;
            if ctx.json() {
                print_json(&r)?;
            } else {
                for e in r.entries.iter().filter(|e| !e.is_ok()) {
                    let why = e
                        .problem
                        .as_ref()
                        .map(|p| p.to_string())
                        .unwrap_or_default();
                    println!("bad {}: {why}", e.path.display());
                }
                println!("{} entries ok, {} bad in {}", r.ok, r.bad, where_());
            }
            if !r.all_ok() {
                let dir = cache.dir().map(|d| d.to_path_buf()).unwrap_or_default();
                return Err(Error::format(
                    dir,
                    format!(
                        "{} of {} plan cache entries are bad (the next run that needs one rebuilds it; `tessera cache clear` removes all)",
                        r.bad,
                        r.ok + r.bad
                    ),
                ));
            }
        }
        CacheAction::Clear => {
            let r = cache.clear()?;
            if ctx.json() {
                return print_json(&r);
            }
            println!(
                "removed {} files ({} bytes) from {}",
                r.removed,
                r.bytes,
                where_()
            );
        }
    }
    Ok(())
}
