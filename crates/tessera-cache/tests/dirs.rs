//! Disabled cache, unusable directories, size accounting, stats/verify/clear.

mod common;

use common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use tessera_cache::{CacheConfig, CacheWarning, PlanCache, PlanSource};
use tessera_core::metrics;

#[test]
fn no_cache_writes_nothing() {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let (mask, shape, tile) = causal(1024);
    let before = metrics::snapshot();
    let c = cache_with(CacheConfig {
        dir: Some(dir.path().to_path_buf()),
        disabled: true,
        max_bytes: 1 << 30,
    });
    let a = c.get_or_build(&mask, shape, tile).unwrap().plan;
    let b = c.get_or_build(&mask, shape, tile).unwrap().plan;
    assert!(std::sync::Arc::ptr_eq(&a, &b), "memory cache still works");
    let after = metrics::snapshot();
    assert!(files_under(dir.path()).is_empty(), "nothing on disk");
    assert!(!dir.path().join("plans").exists());
    assert_eq!(after.plans_built - before.plans_built, 1);
    assert_eq!(after.memory_hits - before.memory_hits, 1);
    assert_eq!(after.bytes_written - before.bytes_written, 0);
    assert_eq!(after.bytes_read - before.bytes_read, 0);
    assert_eq!(after.disk_hits - before.disk_hits, 0);
    assert!(c.warnings().is_empty());
    let s = c.stats();
    assert!(s.disabled && !s.disk_active && s.dir.is_none());
    assert_eq!((s.entries, s.memory_entries), (0, 1));
    assert!(c.verify().unwrap().entries.is_empty());
    assert!(!c.disk_active());
    // A second, disabled process on a populated directory does not read it either.
    cache(dir.path()).get_or_build(&mask, shape, tile).unwrap();
    let c2 = cache_with(CacheConfig {
        dir: Some(dir.path().to_path_buf()),
        disabled: true,
        max_bytes: 1 << 30,
    });
    c2.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!((c2.counters().disk_hits, c2.counters().builds), (0, 1));
}

#[test]
fn warm_second_instance_builds_nothing_and_counts_bytes() {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let (mask, shape, tile) = causal(4096);
    let m0 = metrics::snapshot();
    let c1 = cache(dir.path());
    let p1 = c1.get_or_build(&mask, shape, tile).unwrap().plan;
    let m1 = metrics::snapshot();
    let len = fs::metadata(c1.entry_path(&p1.contract).unwrap())
        .unwrap()
        .len();
    assert_eq!(m1.plans_built - m0.plans_built, 1);
    assert_eq!(m1.misses - m0.misses, 1);
    assert_eq!(m1.bytes_written - m0.bytes_written, len);
    assert_eq!(c1.counters().bytes_written, len);

    let c2 = cache(dir.path());
    let p2 = c2.get_or_build(&mask, shape, tile).unwrap().plan;
    let m2 = metrics::snapshot();
    assert_eq!(*p1, *p2, "disk copy is bit-identical, build time included");
    assert_eq!(m2.plans_built - m1.plans_built, 0);
    assert_eq!(m2.disk_hits - m1.disk_hits, 1);
    assert_eq!(m2.misses - m1.misses, 0);
    assert_eq!(m2.bytes_read - m1.bytes_read, len);
    assert_eq!(m2.bytes_written - m1.bytes_written, 0);
    c2.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(metrics::snapshot().memory_hits - m2.memory_hits, 1);
    let s = c2.stats();
    assert_eq!((s.entries, s.bytes), (1, len));
    assert_eq!(s.dir.as_deref(), Some(dir.path()));
}

#[test]
fn invalid_input_is_an_error_and_caches_nothing() {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let c = cache(dir.path());
    let shape = tessera_plan::PlanShape {
        batch: 1,
        heads: 1,
        q_len: 0,
        kv_len: 16,
    };
    let err = c
        .get_or_build(&tessera_mask::Mask::causal(), shape, Default::default())
        .unwrap_err();
    assert!(err.is_user_error(), "{err}");
    assert_eq!(c.stats().entries, 0);
}

fn assert_degraded(c: &PlanCache, what: &str) {
    let (mask, shape, tile) = causal(1024);
    let a = c.get_or_build(&mask, shape, tile).unwrap().plan;
    let b = c.get_or_build(&mask, shape, tile).unwrap().plan;
    assert!(std::sync::Arc::ptr_eq(&a, &b), "{what}: memory cache works");
    let (mask2, shape2, tile2) = causal(2048);
    c.get_or_build(&mask2, shape2, tile2).unwrap();
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{what}: exactly one warning: {w:?}");
    assert!(
        matches!(&w[0], CacheWarning::DirectoryUnusable { .. }),
        "{what}: {w:?}"
    );
    let text = w[0].to_string();
    assert!(
        text.starts_with("plan cache directory ") && text.ends_with("; caching in memory only"),
        "{what}: {text}"
    );
    assert!(!c.disk_active(), "{what}");
    assert_eq!(c.counters().builds, 2, "{what}");
    assert_eq!(c.counters().rejects, 0, "{what}");
}

#[test]
fn uncreatable_directory_degrades_to_memory() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    fs::write(&file, b"not a directory").unwrap();
    assert_degraded(&cache(&file.join("cache")), "parent is a file");
}

#[test]
fn plans_path_taken_by_a_file_degrades_to_memory() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("plans"), b"x").unwrap();
    assert_degraded(&cache(tmp.path()), "plans is a file");
    assert_eq!(fs::read(tmp.path().join("plans")).unwrap(), b"x");
}

/// `dir/plans` created with `mode`; `None` (the test is skipped) when this user ignores
/// permissions.
fn plans_with_mode(dir: &std::path::Path, mode: u32) -> Option<std::path::PathBuf> {
    if permissions_ignored(dir) {
        eprintln!("skipped: permissions are not enforced for this user");
        return None;
    }
    let plans = dir.join("plans");
    fs::create_dir(&plans).unwrap();
    fs::set_permissions(&plans, fs::Permissions::from_mode(mode)).unwrap();
    Some(plans)
}

#[test]
fn unreadable_directory_degrades_to_memory() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    let Some(plans) = plans_with_mode(tmp.path(), 0o000) else {
        return;
    };
    assert_degraded(&cache(tmp.path()), "plans mode 000");
    fs::set_permissions(&plans, fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn unwritable_directory_degrades_to_memory_but_serves_hits() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    if permissions_ignored(tmp.path()) {
        eprintln!("skipped: permissions are not enforced for this user");
        return;
    }
    // A valid entry of another contract stays readable.
    let (mask, shape, tile) = causal(4096);
    cache(tmp.path()).get_or_build(&mask, shape, tile).unwrap();
    let plans = tmp.path().join("plans");
    fs::set_permissions(&plans, fs::Permissions::from_mode(0o555)).unwrap();
    let c = cache(tmp.path());
    c.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(c.counters().disk_hits, 1);
    assert_degraded(&c, "plans mode 555");
    fs::set_permissions(&plans, fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn entry_larger_than_bound_is_not_written() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    let c = cache_with(CacheConfig {
        dir: Some(tmp.path().to_path_buf()),
        disabled: false,
        max_bytes: 100,
    });
    let (mask, shape, tile) = causal(1024);
    let first = c.get_or_build(&mask, shape, tile).unwrap();
    let second = c.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(c.counters().memory_hits, 1, "still kept in memory");
    assert_eq!(c.stats().entries, 0);
    assert_eq!(c.warnings().len(), 1);
    assert!(matches!(
        c.warnings()[0],
        CacheWarning::TooLarge { max_bytes: 100, .. }
    ));
    assert!(c.warnings()[0].to_string().contains("over the cache bound"));
    assert_eq!(
        first.warnings,
        c.warnings(),
        "raised by the building lookup"
    );
    assert_eq!(
        (second.source, second.warnings.len()),
        (PlanSource::Memory, 0)
    );
}

#[test]
fn verify_reports_and_clear_removes() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    let c = cache(tmp.path());
    for len in [1024, 2048, 4096] {
        let (mask, shape, tile) = causal(len);
        c.get_or_build(&mask, shape, tile).unwrap();
    }
    let plans = tmp.path().join("plans");
    fs::write(plans.join("not-a-key.tplan"), b"x").unwrap();
    fs::write(plans.join("README"), b"left alone").unwrap();
    fs::write(plans.join(".abc.tplan.tmp.1.2"), b"in flight").unwrap();
    let r = c.verify().unwrap();
    assert_eq!((r.ok, r.bad), (3, 1), "{r:?}");
    let bad: Vec<_> = r.entries.iter().filter(|e| !e.is_ok()).collect();
    assert!(bad
        .iter()
        .all(|e| e.problem == Some(tessera_cache::RejectReason::BadName)));
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"ok\":false"), "{json}");
    let s = c.stats();
    assert_eq!(s.entries, 4, "the stray .tplan counts as an entry file");
    let cleared = c.clear().unwrap();
    assert_eq!(cleared.removed, 5, "4 entry files and 1 temporary file");
    assert!(plans.join("README").exists());
    assert_eq!(c.stats().entries, 0);
    assert_eq!(c.stats().memory_entries, 0);
    assert!(c.verify().unwrap().entries.is_empty());
}

/// Entries are opened by name: a directory that cannot be listed (mode 300) still caches.
#[test]
fn unlistable_directory_still_caches() {
    let _g = metrics_lock();
    let tmp = tempfile::tempdir().unwrap();
    let Some(plans) = plans_with_mode(tmp.path(), 0o300) else {
        return;
    };
    let (mask, shape, tile) = causal(1024);
    let c1 = cache(tmp.path());
    c1.get_or_build(&mask, shape, tile).unwrap();
    let c2 = cache(tmp.path());
    c2.get_or_build(&mask, shape, tile).unwrap();
    fs::set_permissions(&plans, fs::Permissions::from_mode(0o755)).unwrap();
    assert!(c1.warnings().is_empty() && c2.warnings().is_empty());
    assert_eq!(c2.counters().disk_hits, 1);
}
