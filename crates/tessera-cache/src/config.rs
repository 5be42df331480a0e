//! Cache configuration and directory resolution.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

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
/// else `$HOME/.cache/tessera` (`%USERPROFILE%` on Windows). Empty variables and a relative
/// `XDG_CACHE_HOME` are ignored. `None` when nothing applies.
pub fn resolve_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    resolve_dir_with(explicit, |name| std::env::var_os(name))
}

/// [`resolve_dir`] reading variables through `env` (for tests and embedding).
pub fn resolve_dir_with(
    explicit: Option<&Path>,
    env: impl Fn(&str) -> Option<OsString>,
) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let var = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("TESSERA_CACHE_DIR") {
        return Some(p);
    }
    if let Some(p) = var("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(p.join("tessera"));
    }
    let home = if cfg!(windows) {
        var("USERPROFILE")
    } else {
        var("HOME")
    };
    home.map(|h| h.join(".cache").join("tessera"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn precedence() {
        let all = env(&[
            ("TESSERA_CACHE_DIR", "/t"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
            ("USERPROFILE", "/h"),
        ]);
        assert_eq!(
            resolve_dir_with(Some(Path::new("/e")), &all),
            Some("/e".into())
        );
        assert_eq!(resolve_dir_with(None, &all), Some("/t".into()));
        let no_t = env(&[
            ("TESSERA_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
            ("USERPROFILE", "/h"),
        ]);
        assert_eq!(resolve_dir_with(None, &no_t), Some("/x/tessera".into()));
        let rel_xdg = env(&[
            ("XDG_CACHE_HOME", "rel"),
            ("HOME", "/h"),
            ("USERPROFILE", "/h"),
        ]);
        assert_eq!(
            resolve_dir_with(None, &rel_xdg),
            Some(PathBuf::from("/h").join(".cache").join("tessera"))
        );
        assert_eq!(resolve_dir_with(None, env(&[])), None);
    }
}
