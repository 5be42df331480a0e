//! Each fault of a disk entry is rejected, counted, warned about once, rebuilt and rewritten.

mod common;

use common::*;
use std::fs::{self, OpenOptions};
use std::path::Path;
use tessera_cache::entry::{self, Header, HEADER_LEN};
use tessera_cache::{CacheWarning, PlanSource, RejectReason};
use tessera_core::metrics;
use tessera_plan::{Plan, PLAN_FORMAT_VERSION};

/// Builds a real entry (causal at 1024, tile 128), corrupts it with `corrupt`, and checks that
/// `verify` names the fault, that a fresh cache rejects it (counted globally and per cache,
/// one warning), rebuilds the same plan and rewrites a valid entry.
fn check_fault(
    what: &str,
    expect: impl Fn(&RejectReason) -> bool,
    corrupt: impl FnOnce(&Path, &Plan),
) {
    let _g = metrics_lock();
    let dir = tempfile::tempdir().unwrap();
    let (mask, shape, tile) = causal(1024);
    let c0 = cache(dir.path());
    let plan = c0.get_or_build(&mask, shape, tile).unwrap().plan;
    let path = c0.entry_path(&plan.contract).unwrap();
    assert!(path.is_file(), "{what}: entry written");
    assert!(c0.verify().unwrap().all_ok());

    corrupt(&path, &plan);

    let bad = c0.verify().unwrap();
    assert_eq!((bad.ok, bad.bad), (0, 1), "{what}: verify sees the fault");
    let reason = bad.entries[0].problem.clone().unwrap();
    assert!(expect(&reason), "{what}: unexpected reason {reason:?}");

    let before = metrics::snapshot();
    let c1 = cache(dir.path());
    let lookup = c1.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(lookup.source, PlanSource::Built, "{what}");
    assert_eq!(
        lookup.warnings,
        c1.warnings(),
        "{what}: the lookup returns its warning"
    );
    let got = lookup.plan;
    assert!(
        same_plan(&got, &plan),
        "{what}: rebuilt plan equals the original"
    );
    let after = metrics::snapshot();
    assert_eq!(after.rejects - before.rejects, 1, "{what}: reject recorded");
    assert_eq!(after.plans_built - before.plans_built, 1, "{what}: rebuilt");
    assert_eq!(
        after.disk_hits - before.disk_hits,
        0,
        "{what}: not a disk hit"
    );
    assert_eq!(after.misses - before.misses, 1, "{what}: counted as a miss");
    let c = c1.counters();
    assert_eq!((c.rejects, c.builds, c.disk_hits, c.misses), (1, 1, 0, 1));

    let warnings = c1.warnings();
    assert_eq!(warnings.len(), 1, "{what}: one warning: {warnings:?}");
    assert!(
        matches!(&warnings[0], CacheWarning::EntryRejected { path: p, .. } if p == &path),
        "{what}: {warnings:?}"
    );
    let w = &warnings[0].to_string();
    let expected_prefix = format!("plan cache entry {} rejected (", path.display());
    assert!(w.starts_with(&expected_prefix), "{what}: {w}");
    assert!(w.ends_with("); rebuilt"), "{what}: {w}");
    assert!(
        w.contains(&reason.to_string()),
        "{what}: {w} names {reason}"
    );

    // The same process never warns twice: the plan is now in memory.
    let again = c1.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(
        (again.source, again.warnings.len()),
        (PlanSource::Memory, 0)
    );
    assert_eq!(c1.warnings().len(), 1);
    assert_eq!(c1.counters().memory_hits, 1);

    // A valid entry is on disk again, and a fresh cache hits it.
    let good = c1.verify().unwrap();
    assert_eq!((good.ok, good.bad), (1, 0), "{what}: valid entry rewritten");
    assert!(path.is_file());
    let c2 = cache(dir.path());
    let hit = c2.get_or_build(&mask, shape, tile).unwrap();
    assert_eq!(hit.source, PlanSource::Disk, "{what}");
    assert!(same_plan(&hit.plan, &plan));
    let c = c2.counters();
    assert_eq!((c.disk_hits, c.rejects, c.builds), (1, 0, 0), "{what}");
    assert!(c2.warnings().is_empty());
}

fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = fs::read(path).unwrap();
    f(&mut bytes);
    fs::write(path, bytes).unwrap();
}

#[test]
fn truncated_payload() {
    check_fault(
        "truncated payload",
        |r| matches!(r, RejectReason::Length { .. }),
        |p, _| {
            let len = fs::metadata(p).unwrap().len();
            OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(len - 7)
                .unwrap();
        },
    );
}

#[test]
fn truncated_header() {
    check_fault(
        "truncated header",
        |r| matches!(r, RejectReason::TruncatedHeader { len: 40 }),
        |p, _| {
            OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(40)
                .unwrap()
        },
    );
}

#[test]
fn trailing_bytes() {
    check_fault(
        "trailing bytes",
        |r| matches!(r, RejectReason::Length { .. }),
        |p, _| rewrite(p, |b| b.extend_from_slice(b"junk")),
    );
}

#[test]
fn flipped_payload_byte() {
    check_fault(
        "flipped payload byte",
        |r| *r == RejectReason::Checksum,
        |p, _| {
            rewrite(p, |b| {
                let i = HEADER_LEN + (b.len() - HEADER_LEN) / 2;
                b[i] ^= 0x10;
            })
        },
    );
}

#[test]
fn flipped_magic_byte() {
    check_fault(
        "flipped magic byte",
        |r| *r == RejectReason::BadMagic,
        |p, _| rewrite(p, |b| b[2] ^= 0x01),
    );
}

#[test]
fn flipped_checksum_byte() {
    check_fault(
        "flipped checksum byte",
        |r| *r == RejectReason::Checksum,
        |p, _| rewrite(p, |b| b[60] ^= 0x80),
    );
}

#[test]
fn flipped_length_byte() {
    check_fault(
        "flipped length byte",
        |r| matches!(r, RejectReason::Length { .. }),
        |p, _| rewrite(p, |b| b[44] ^= 0x01),
    );
}

#[test]
fn flipped_key_byte() {
    check_fault(
        "flipped key byte",
        |r| matches!(r, RejectReason::KeyMismatch { .. }),
        |p, _| rewrite(p, |b| b[20] ^= 0x01),
    );
}

#[test]
fn zero_length_file() {
    check_fault(
        "zero-length file",
        |r| *r == RejectReason::Empty,
        |p, _| fs::write(p, b"").unwrap(),
    );
}

#[test]
fn other_format_version() {
    check_fault(
        "other format version",
        |r| {
            *r == RejectReason::Version {
                found: PLAN_FORMAT_VERSION + 1,
                expected: PLAN_FORMAT_VERSION,
            }
        },
        |p, _| {
            rewrite(p, |b| {
                b[8..12].copy_from_slice(&(PLAN_FORMAT_VERSION + 1).to_le_bytes())
            })
        },
    );
}

/// Another contract's entry copied over this one.
#[test]
fn entry_of_another_key_copied_over() {
    check_fault(
        "copied entry",
        |r| matches!(r, RejectReason::KeyMismatch { .. }),
        |p, _| {
            let scratch = tempfile::tempdir().unwrap();
            let (mask, shape, tile) = causal(2048);
            let other = cache(scratch.path());
            let plan = other.get_or_build(&mask, shape, tile).unwrap().plan;
            fs::copy(other.entry_path(&plan.contract).unwrap(), p).unwrap();
        },
    );
}

/// Header claims this key, payload (with a valid checksum) is another contract's plan.
#[test]
fn payload_of_another_key() {
    check_fault(
        "payload of another key",
        |r| matches!(r, RejectReason::ContractMismatch { .. }),
        |p, mine| {
            let (mask, shape, tile) = causal(2048);
            let other = tessera_plan::build_plan(&mask, shape, tile).unwrap();
            let mut bytes = entry::encode(&other).unwrap();
            bytes[12..44].copy_from_slice(&mine.contract.0);
            fs::write(p, bytes).unwrap();
        },
    );
}

/// Writes a payload with a valid checksum and header for `key`.
fn write_payload(path: &Path, key: tessera_plan::ContractKey, payload: &[u8]) {
    let header = Header {
        version: PLAN_FORMAT_VERSION,
        key,
        payload_len: payload.len() as u64,
        checksum: *blake3::hash(payload).as_bytes(),
    };
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(payload);
    fs::write(path, bytes).unwrap();
}

/// A payload with a valid checksum whose postcard part is not a plan.
#[test]
fn payload_not_a_plan() {
    check_fault(
        "garbage payload",
        |r| matches!(r, RejectReason::Decode(_)),
        |p, mine| {
            let mut payload = 0u64.to_le_bytes().to_vec();
            payload.extend_from_slice(&[0xff; 64]);
            write_payload(p, mine.contract, &payload);
        },
    );
}

/// A payload with a valid checksum claiming more words than it holds.
#[test]
fn payload_word_count_too_large() {
    check_fault(
        "word count",
        |r| matches!(r, RejectReason::Decode(m) if m.contains("do not fit")),
        |p, mine| write_payload(p, mine.contract, &[0xff; 64]),
    );
}

/// A valid plan followed by extra bytes inside the checksummed payload.
#[test]
fn payload_with_trailing_bytes() {
    check_fault(
        "trailing payload bytes",
        |r| matches!(r, RejectReason::Decode(m) if m.contains("after the plan")),
        |p, mine| {
            let full = entry::encode(mine).unwrap();
            let mut payload = full[HEADER_LEN..].to_vec();
            payload.extend_from_slice(b"xyz");
            write_payload(p, mine.contract, &payload);
        },
    );
}

/// A well-formed entry whose plan carries another format version.
#[test]
fn plan_of_other_format_version() {
    check_fault(
        "plan of other format version",
        |r| matches!(r, RejectReason::PlanVersion { found: 99, .. }),
        |p, mine| {
            let mut plan = mine.clone();
            plan.format_version = 99;
            fs::write(p, entry::encode(&plan).unwrap()).unwrap();
        },
    );
}

/// A directory squatting on the entry's path cannot be read as an entry.
#[test]
fn unreadable_entry_directory_in_place() {
    check_fault(
        "directory at entry path",
        |r| *r == RejectReason::NotAFile,
        |p, _| {
            fs::remove_file(p).unwrap();
            fs::create_dir(p).unwrap();
            fs::write(p.join("inner"), b"x").unwrap();
        },
    );
}

/// An entry without read permission (skipped when running as root, which reads anyway).
#[test]
fn unreadable_entry_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let probe = tempfile::tempdir().unwrap();
    if permissions_ignored(probe.path()) {
        eprintln!("skipped: permissions are not enforced for this user");
        return;
    }
    check_fault(
        "entry mode 000",
        |r| matches!(r, RejectReason::Unreadable(_)),
        |p, _| fs::set_permissions(p, fs::Permissions::from_mode(0o000)).unwrap(),
    );
}
