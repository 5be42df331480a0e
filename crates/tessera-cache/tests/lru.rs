//! The size bound: least recently used entries go first, on disk and in memory.

mod common;

use common::*;
use std::fs;
use std::path::Path;
use std::thread::sleep;
use std::time::Duration;
use tessera_cache::CacheConfig;
use tessera_mask::Mask;
use tessera_plan::{build_plan, PlanShape, TileShape};

/// Four different contracts of similar size.
fn contracts() -> Vec<(Mask, PlanShape, TileShape)> {
    [1024, 1152, 1280, 1408].into_iter().map(causal).collect()
}

fn entry_size(dir: &Path, c: &(Mask, PlanShape, TileShape)) -> u64 {
    let cache = cache(dir);
    let plan = cache.get_or_build(&c.0, c.1, c.2).unwrap().plan;
    fs::metadata(cache.entry_path(&plan.contract).unwrap())
        .unwrap()
        .len()
}

fn disk_bytes(dir: &Path) -> u64 {
    files_under(&dir.join("plans"))
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum()
}

/// A, B, C fit; A is then hit by another process (touching it); writing D must evict B, the
/// least recently used, and keep the store within the bound.
#[test]
fn disk_evicts_least_recently_used() {
    let _g = metrics_lock();
    let cs = contracts();
    let scratch = tempfile::tempdir().unwrap();
    let sizes: Vec<u64> = cs.iter().map(|c| entry_size(scratch.path(), c)).collect();
    let bound = sizes[0] + sizes[2] + sizes[1].max(sizes[3]);
    assert!(bound < sizes.iter().sum::<u64>());

    let dir = tempfile::tempdir().unwrap();
    let config = CacheConfig {
        dir: Some(dir.path().to_path_buf()),
        disabled: false,
        max_bytes: bound,
    };
    let paths: Vec<_> = cs
        .iter()
        .map(|c| {
            let cache = cache_with(config.clone());
            let p = cache.get_or_build(&c.0, c.1, c.2).unwrap().plan;
            sleep(Duration::from_millis(30));
            cache.entry_path(&p.contract).unwrap()
        })
        .take(3)
        .collect();
    assert!(paths.iter().all(|p| p.is_file()), "A, B, C fit");

    // A used again by a fresh process: a disk hit that refreshes its mtime.
    let a = cache_with(config.clone());
    a.get_or_build(&cs[0].0, cs[0].1, cs[0].2).unwrap();
    assert_eq!(a.counters().disk_hits, 1);
    let mtime = |p: &Path| fs::metadata(p).unwrap().modified().unwrap();
    assert!(mtime(&paths[0]) > mtime(&paths[2]), "hit touched A");
    sleep(Duration::from_millis(30));

    let d = cache_with(config.clone());
    let pd = d.get_or_build(&cs[3].0, cs[3].1, cs[3].2).unwrap().plan;
    assert!(d.entry_path(&pd.contract).unwrap().is_file(), "D written");
    assert!(!paths[1].exists(), "B, the least recently used, evicted");
    assert!(paths[0].is_file() && paths[2].is_file(), "A and C kept");
    assert!(disk_bytes(dir.path()) <= bound);
    assert_eq!(d.stats().bytes, disk_bytes(dir.path()));

    // B is now a plain miss; A still a disk hit.
    let e = cache_with(config);
    e.get_or_build(&cs[1].0, cs[1].1, cs[1].2).unwrap();
    assert_eq!((e.counters().builds, e.counters().rejects), (1, 0));
}

/// Many writes under a bound of about two entries: after every write the store is within the
/// bound and holds the newest entry.
#[test]
fn disk_stays_within_bound() {
    let _g = metrics_lock();
    let scratch = tempfile::tempdir().unwrap();
    let lens = [1024, 1152, 1280, 1408, 1536, 1664];
    let max = lens
        .iter()
        .map(|&l| entry_size(scratch.path(), &causal(l)))
        .max()
        .unwrap();
    let bound = 2 * max + max / 2;
    let dir = tempfile::tempdir().unwrap();
    let c = cache_with(CacheConfig {
        dir: Some(dir.path().to_path_buf()),
        disabled: false,
        max_bytes: bound,
    });
    for l in lens {
        let (mask, shape, tile) = causal(l);
        let p = c.get_or_build(&mask, shape, tile).unwrap().plan;
        assert!(c.entry_path(&p.contract).unwrap().is_file());
        assert!(disk_bytes(dir.path()) <= bound);
        sleep(Duration::from_millis(15));
    }
    assert_eq!(c.stats().entries, 2);
    assert!(c.verify().unwrap().all_ok());
}

/// The memory LRU obeys the same bound and evicts the least recently used plan.
#[test]
fn memory_evicts_least_recently_used() {
    let _g = metrics_lock();
    let cs = contracts();
    let sizes: Vec<u64> = cs
        .iter()
        .map(|c| {
            let p = build_plan(&c.0, c.1, c.2).unwrap();
            p.heap_bytes() + p.mask.len() as u64
        })
        .collect();
    let bound = sizes[0] + sizes[1].max(sizes[2]);
    let c = cache_with(CacheConfig {
        dir: None,
        disabled: true,
        max_bytes: bound,
    });
    let get = |i: usize| {
        c.get_or_build(&cs[i].0, cs[i].1, cs[i].2).unwrap();
    };
    get(0);
    get(1);
    get(0); // A is now more recent than B
    get(2); // evicts B
    assert_eq!(c.counters().builds, 3);
    assert!(c.stats().memory_bytes <= bound);
    assert_eq!(c.stats().memory_entries, 2);
    get(0);
    get(2);
    assert_eq!(c.counters().memory_hits, 3, "A and C stayed");
    get(1);
    assert_eq!(c.counters().builds, 4, "B was evicted");
}
