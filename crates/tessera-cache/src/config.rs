//! Cache configuration and directory resolution.

use std::path::PathBuf;

/// Default size bound of the disk cache: 1 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// How a [`PlanCache`](crate::PlanCache) is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Explicit cache directory (CLI `--cache-dir`); `None` resolves it from the environment
    /// with [`resolve_dir`].
    pub dir: Option<PathBuf>,
    /// `--no-cache`: never touch the disk (plans are still built and kept in memory).
    pub disabled: bool,
    /// Size bound of the disk store (and of the memory LRU) in bytes.
    pub max_bytes: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            dir: None,
            disabled: false,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}

/// The cache directory: `explicit`, else `$TESSERA_CACHE_DIR`, else `$XDG_CACHE_HOME/tessera`,
/// else `$HOME/.cache/tessera` (one resolution shared with the CPU kernel-path decision, which
/// lives in `tessera_core::cache_dir`; its tests cover the precedence).
pub use tessera_core::cache_dir::{resolve as resolve_dir, resolve_with as resolve_dir_with};
