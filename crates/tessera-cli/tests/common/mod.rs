//! Helpers shared by the end-to-end tests that run the built binary without a plan cache.
#![allow(dead_code)] // each test file uses its own subset

use std::path::Path;
use std::process::{Command, Output};
use tessera::core::Tensor;

/// Runs `tessera ARGS --no-cache` in `dir`.
pub fn tessera(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .arg("--no-cache")
        .current_dir(dir)
        .output()
        .expect("run tessera")
}

/// Runs `tessera`, asserts success and returns stdout.
pub fn ok(args: &[&str], dir: &Path) -> String {
    let out = tessera(args, dir);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts exit code 2 and exactly one stderr line containing `needle`, never a panic.
pub fn bad(args: &[&str], dir: &Path, needle: &str) {
    let out = tessera(args, dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected '{needle}' in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Seeded values in [-1, 1) (a small LCG keeps the tests free of extra dependencies).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Writes `t` to `dir/name` and returns the path as a string argument.
pub fn save(dir: &Path, name: &str, t: &Tensor) -> String {
    let p = dir.join(name);
    tessera::io::write_tensor(&p, t).unwrap();
    p.to_string_lossy().into_owned()
}
