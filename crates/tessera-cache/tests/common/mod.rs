//! Shared helpers of the cache tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use tessera_cache::{CacheConfig, PlanCache};
use tessera_mask::Mask;
use tessera_plan::{PlanShape, TileShape};

/// Tests that read the process-wide metrics hold this lock so their deltas are their own.
pub static METRICS: Mutex<()> = Mutex::new(());

pub fn metrics_lock() -> MutexGuard<'static, ()> {
    METRICS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `causal` at `len` with 128×128 tiles.
pub fn causal(len: usize) -> (Mask, PlanShape, TileShape) {
    (
        Mask::causal(),
        PlanShape::new(1, 1, len, len).unwrap(),
        TileShape::new(128, 128).unwrap(),
    )
}

pub fn config(dir: &Path) -> CacheConfig {
    CacheConfig {
        dir: Some(dir.to_path_buf()),
        disabled: false,
        max_bytes: 1 << 30,
    }
}

/// A quiet cache on `dir`.
pub fn cache(dir: &Path) -> PlanCache {
    PlanCache::new(config(dir))
}

pub fn cache_with(config: CacheConfig) -> PlanCache {
    PlanCache::new(config)
}

/// Every file under `dir`, recursively (directories excluded).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// True when the process can read files whatever their mode (root): permission faults cannot
/// be staged then.
pub fn permissions_ignored(dir: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("perm-probe");
    std::fs::write(&p, b"x").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o000)).unwrap();
    let readable = std::fs::read(&p).is_ok();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::remove_file(&p).unwrap();
    readable
}

/// Plans equal up to the recorded build time (which differs between builds).
pub fn same_plan(a: &tessera_plan::Plan, b: &tessera_plan::Plan) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.stats.build_ms = 0.0;
    b.stats.build_ms = 0.0;
    a == b
}
