//! Several threads and processes reading, deleting and writing one key at once: nobody ever
//! sees a bad entry, and a valid entry is left.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "TESSERA_CACHE_TEST_CHILD_DIR";
const ROUNDS: usize = 12;
const LEN: usize = 32768;

/// One writer: `ROUNDS` fresh caches (as fresh processes would be), each fetching the plan;
/// on some rounds the entry is deleted first so that writers race to rewrite it.
fn writer(dir: &Path, id: usize) {
    let (mask, shape, tile) = causal(LEN);
    let expected = tessera_plan::contract_key(&mask, shape, tile);
    for round in 0..ROUNDS {
        let c = cache(dir);
        if (round + id) % 3 == 1 {
            let _ = std::fs::remove_file(c.entry_path(&expected).unwrap());
        }
        let p = c.get_or_build(&mask, shape, tile).unwrap().plan;
        assert_eq!(p.contract, expected);
        assert_eq!(
            c.counters().rejects,
            0,
            "writer {id} round {round} saw a bad entry"
        );
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    }
}

fn check_final(dir: &Path) {
    let c = cache(dir);
    let r = c.verify().unwrap();
    assert_eq!((r.ok, r.bad), (1, 0), "{r:?}");
    let files = files_under(&dir.join("plans"));
    assert_eq!(files.len(), 1, "no temporary file left behind: {files:?}");
    let (mask, shape, tile) = causal(LEN);
    c.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(c.counters().disk_hits, 1);
}

#[test]
fn threads_writing_one_key() {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|id| {
            let dir = dir.path().to_path_buf();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                writer(&dir, id);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer thread");
    }
    check_final(dir.path());
}

/// Runs only as a child of `processes_writing_one_key`.
#[test]
fn child_writer() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let id: usize = std::env::var("TESSERA_CACHE_TEST_CHILD_ID")
        .unwrap()
        .parse()
        .unwrap();
    let go = dir.join("go");
    let start = Instant::now();
    while !go.exists() {
        assert!(start.elapsed() < Duration::from_secs(60), "no start signal");
        std::thread::sleep(Duration::from_millis(1));
    }
    writer(&dir.join("cache"), id);
}

#[test]
fn processes_writing_one_key() {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..4)
        .map(|id| {
            Command::new(&exe)
                .args(["--exact", "child_writer", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, dir.path())
                .env("TESSERA_CACHE_TEST_CHILD_ID", id.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    // Let every child start and spin, then release them together.
    std::thread::sleep(Duration::from_millis(200));
    std::fs::write(dir.path().join("go"), b"").unwrap();
    for mut c in children {
        let out = c.wait().unwrap();
        assert!(out.success(), "child writer failed: {out}");
    }
    check_final(&dir.path().join("cache"));
}
