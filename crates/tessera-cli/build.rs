//! Captures the git revision and the rustc version for the run manifest (`tessera env`).
//!
//! Emits `TESSERA_GIT_REV` (`git rev-parse --short HEAD`, or "unknown" outside a git checkout or
//! without git) and `TESSERA_RUSTC_VERSION` (`$RUSTC --version`, or "unknown"). Re-runs when
//! HEAD moves: on changes of `.git/HEAD`, of the branch ref it points to (loose or packed), and
//! of this script; never on every build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn rerun_if_exists(path: &Path) {
    // A missing path would make cargo re-run the script on every build.
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());

    let rev = git(&manifest_dir, &["rev-parse", "--short", "HEAD"]);
    println!(
        "cargo:rustc-env=TESSERA_GIT_REV={}",
        rev.as_deref().unwrap_or("unknown")
    );
    if rev.is_some() {
        if let Some(git_dir) = git(&manifest_dir, &["rev-parse", "--absolute-git-dir"]) {
            let git_dir = PathBuf::from(git_dir);
            // Worktrees keep HEAD in their own git dir and refs in the common one.
            let common = git(&manifest_dir, &["rev-parse", "--git-common-dir"])
                .map(PathBuf::from)
                .map(|p| {
                    if p.is_absolute() {
                        p
                    } else {
                        manifest_dir.join(p)
                    }
                })
                .unwrap_or_else(|| git_dir.clone());
            let head = git_dir.join("HEAD");
            rerun_if_exists(&head);
            if let Ok(text) = std::fs::read_to_string(&head) {
                if let Some(r) = text.trim().strip_prefix("ref: ") {
                    rerun_if_exists(&common.join(r));
                    rerun_if_exists(&common.join("packed-refs"));
                }
            }
        }
    }

    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=TESSERA_RUSTC_VERSION={version}");
}
