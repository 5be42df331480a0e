//! Options shared by every subcommand and the per-run context built from them.

use tessera::attn::cpu::dispatch;
use tessera::core::{metrics, Error, Result};

#[derive(clap::Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Print results as JSON (and the metrics report as JSON with --metrics).
    #[arg(long, global = true)]
    pub json: bool,
    /// Print the metrics report (plans built, cache hits, kernel calls) to stderr at exit.
    #[arg(long, global = true)]
    pub metrics: bool,
    /// Plan cache directory (default: $TESSERA_CACHE_DIR, $XDG_CACHE_HOME/tessera, ~/.cache/tessera).
    #[arg(long, global = true, value_name = "DIR")]
    pub cache_dir: Option<std::path::PathBuf>,
    /// Disable the persistent cache directory: no plans are read or written, and the CPU
    /// kernel-path decision is measured by this process and not stored (pin it with
    /// TESSERA_CPU_PATHS).
    #[arg(long, global = true)]
    pub no_cache: bool,
    /// Size bound of the disk cache in bytes (least recently used entries are evicted).
    #[arg(long, global = true, value_name = "BYTES", default_value_t = 1 << 30)]
    pub cache_max_bytes: u64,
}

/// What every subcommand receives.
pub struct Ctx {
    pub global: GlobalArgs,
    cache: std::sync::OnceLock<tessera::cache::PlanCache>,
    /// Whether the kernel-path decision's warnings were printed.
    dispatch_warned: std::sync::atomic::AtomicBool,
}

impl Ctx {
    pub fn new(global: GlobalArgs) -> Self {
        // The kernel-path decision lives in the same directory as the plan cache (and nowhere
        // with --no-cache); set before anything can make it.
        let store = (!global.no_cache)
            .then(|| tessera::cache::resolve_dir(global.cache_dir.as_deref()))
            .flatten();
        dispatch::set_store_dir(store);
        Ctx {
            global,
            cache: std::sync::OnceLock::new(),
            dispatch_warned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The CPU kernel-path decision of this process; a malformed or unsupported
    /// TESSERA_CPU_PATHS is an error (exit 2) rather than ignored, and the decision's warnings
    /// are printed once.
    pub fn kernel_decision(&self) -> Result<&'static dispatch::Decision> {
        dispatch::check_env_override()?;
        let d = dispatch::decision();
        if !self
            .dispatch_warned
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            for w in &d.warnings {
                eprintln!("tessera: warning: {w}");
            }
        }
        Ok(d)
    }

    /// The CPU backend on this process's kernel paths ([`Ctx::kernel_decision`]).
    pub fn cpu_backend(&self) -> Result<tessera::attn::CpuBackend> {
        self.kernel_decision()?;
        Ok(tessera::attn::CpuBackend::new())
    }

    /// The plan of `mask` for `shape` and `tile`.
    pub fn plan(
        &self,
        mask: &tessera::mask::Mask,
        shape: tessera::plan::PlanShape,
        tile: tessera::plan::TileShape,
    ) -> Result<std::sync::Arc<tessera::plan::Plan>> {
        Ok(self.lookup(mask, shape, tile)?.plan)
    }

    /// The plan of `mask` for `shape` and `tile` with where it came from; the cache's warnings
    /// of this lookup are printed to stderr.
    pub fn lookup(
        &self,
        mask: &tessera::mask::Mask,
        shape: tessera::plan::PlanShape,
        tile: tessera::plan::TileShape,
    ) -> Result<tessera::cache::Lookup> {
        let lookup = self.plan_cache().get_or_build(mask, shape, tile)?;
        warn_all(&lookup.warnings);
        Ok(lookup)
    }

    /// The plan cache configured by `--cache-dir`, `--no-cache` and `--cache-max-bytes`; its
    /// construction warnings (no directory) are printed when it is first created.
    pub fn plan_cache(&self) -> &tessera::cache::PlanCache {
        self.cache.get_or_init(|| {
            let cache = tessera::cache::PlanCache::new(tessera::cache::CacheConfig {
                dir: self.global.cache_dir.clone(),
                disabled: self.global.no_cache,
                max_bytes: self.global.cache_max_bytes,
            });
            warn_all(&cache.warnings());
            cache
        })
    }

    /// The resolved cache directory (None when disabled or unresolvable).
    pub fn cache_dir(&self) -> Option<std::path::PathBuf> {
        self.plan_cache().dir().map(|p| p.to_path_buf())
    }

    pub fn json(&self) -> bool {
        self.global.json
    }

    /// Prints the metrics report to stderr when `--metrics` was given.
    pub fn report_metrics(&self) -> Result<()> {
        if !self.global.metrics {
            return Ok(());
        }
        let report = metrics::snapshot();
        if self.global.json {
            let s = serde_json::to_string(&report)
                .map_err(|e| Error::Internal(format!("metrics to JSON: {e}")))?;
            eprintln!("{s}");
        } else {
            eprint!("{}", report.to_text());
        }
        Ok(())
    }
}

/// Prints each warning as one `tessera: warning: ...` line on stderr.
fn warn_all(warnings: &[tessera::cache::CacheWarning]) {
    for w in warnings {
        eprintln!("tessera: warning: {w}");
    }
}

/// Prints a serializable value as one JSON line on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let s = serde_json::to_string(value).map_err(|e| Error::Internal(format!("to JSON: {e}")))?;
    println!("{s}");
    Ok(())
}

/// Checks every output a command will write before it does any work, so that a bad output path
/// (a directory, a missing directory, a wrong extension) fails the whole command with nothing
/// written, rather than after some outputs were. `exts` lists the accepted extensions.
pub fn check_outputs(outputs: &[(&str, &std::path::Path, &[&str])]) -> Result<()> {
    for (flag, path, exts) in outputs {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !exts.is_empty() && !exts.iter().any(|e| ext.eq_ignore_ascii_case(e)) {
            return Err(Error::invalid(
                *flag,
                format!("a path ending in .{}", exts.join(" or .")),
                path.display(),
            ));
        }
        if path.is_dir() {
            return Err(Error::invalid(
                *flag,
                "a file path",
                format!("directory {}", path.display()),
            ));
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() {
            return Err(Error::invalid(
                *flag,
                "a file in an existing directory",
                format!("{} (no directory {})", path.display(), dir.display()),
            ));
        }
    }
    Ok(())
}
