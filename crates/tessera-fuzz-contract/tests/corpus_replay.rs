//! Replays the fuzz corpus under stable `cargo test`: every file in `tests/corpus/<target>/`
//! (the minimised corpus and every input that ever crashed a target) goes through the same
//! entry point the fuzz target calls (`tessera_fuzz_contract`), with the same allocation
//! tracking, so a regression fails CI without nightly or cargo-fuzz.

use std::path::PathBuf;
use tessera_fuzz_contract::{seeds, TrackingAlloc, TARGETS};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn corpus_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/corpus")
}

#[test]
fn every_corpus_input_meets_its_target_contract() {
    let root = corpus_root();
    let mut total = 0;
    for (name, entry) in TARGETS {
        let dir = root.join(name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("corpus directory {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no corpus for target {name}");
        for f in &files {
            let data = std::fs::read(f).expect("corpus file");
            // A failing input is named before its panic propagates.
            let r = std::panic::catch_unwind(|| entry(&data));
            assert!(
                r.is_ok(),
                "target {name}: input {} broke its contract",
                f.display()
            );
        }
        total += files.len();
    }
    assert!(total > 0);
}

#[test]
fn seed_inputs_meet_their_contracts() {
    for (name, label, data) in seeds() {
        let entry = TARGETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, e)| *e)
            .expect("seed of a known target");
        let r = std::panic::catch_unwind(|| entry(&data));
        assert!(r.is_ok(), "target {name}: seed {label} broke its contract");
    }
}

/// Writes the seed inputs into `tests/corpus/<target>/seed-*` (run by hand when the formats
/// change: `cargo test -p tessera-fuzz-contract --test corpus_replay -- --ignored`).
#[test]
#[ignore]
fn write_seed_corpus() {
    for (name, label, data) in seeds() {
        let dir = corpus_root().join(name);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        std::fs::write(dir.join(label), data).expect("seed file");
    }
}
