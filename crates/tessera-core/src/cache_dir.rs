//! Where Tessera keeps its per-user cache (docs/semantics.md#plan-cache): the plan cache and the CPU kernel-path
//! decision both live there.
//!
//! Contract: [`resolve`] returns `explicit` (CLI `--cache-dir`), else `$TESSERA_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/tessera` (absolute values only, as the XDG spec says), else
//! `$HOME/.cache/tessera` (`%USERPROFILE%` on Windows). Empty variables are ignored. `None` when
//! nothing applies. Nothing is created or checked here.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The cache directory, from `explicit` and the environment (see the module contract).
pub fn resolve(explicit: Option<&Path>) -> Option<PathBuf> {
    resolve_with(explicit, |name| std::env::var_os(name))
}

/// [`resolve`] reading variables through `env` (for tests and embedding).
pub fn resolve_with(
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
        assert_eq!(resolve_with(Some(Path::new("/e")), &all), Some("/e".into()));
        assert_eq!(resolve_with(None, &all), Some("/t".into()));
        let no_t = env(&[
            ("TESSERA_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
            ("USERPROFILE", "/h"),
        ]);
        assert_eq!(resolve_with(None, &no_t), Some("/x/tessera".into()));
        let rel_xdg = env(&[
            ("XDG_CACHE_HOME", "rel"),
            ("HOME", "/h"),
            ("USERPROFILE", "/h"),
        ]);
        assert_eq!(
            resolve_with(None, &rel_xdg),
            Some(PathBuf::from("/h").join(".cache").join("tessera"))
        );
        assert_eq!(resolve_with(None, env(&[])), None);
    }
}
