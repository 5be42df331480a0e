//! End-to-end plan cache behaviour of the `tessera` binary: cross-process reuse, every disk
//! fault rejected/warned/rebuilt, concurrent writers, `--no-cache`, and the `cache`/`env`
//! subcommands.

use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn tessera(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        // Never fall back to the user's real cache.
        .env(
            "TESSERA_CACHE_DIR",
            std::env::temp_dir().join("tessera-test-unused"),
        )
        .stdin(Stdio::null());
    c
}

fn run(args: &[&str]) -> Output {
    tessera(args).output().expect("run tessera")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The lines of `text` that start with `prefix`.
fn lines_starting<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// The metrics report: the last stderr line starting with `{`.
fn metrics(o: &Output) -> Value {
    let err = stderr(o);
    let line = err
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no metrics JSON line in stderr:\n{err}"));
    serde_json::from_str(line).expect("metrics JSON")
}

fn count(m: &Value, field: &str) -> u64 {
    m[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {m}"))
}

/// `tessera plan --mask causal --q-len LEN --cache-dir DIR --metrics --json`, which must succeed.
fn plan(dir: &Path, len: usize) -> Output {
    let o = run(&[
        "plan",
        "--mask",
        "causal",
        "--q-len",
        &len.to_string(),
        "--cache-dir",
        dir.to_str().unwrap(),
        "--metrics",
        "--json",
    ]);
    assert!(o.status.success(), "tessera plan failed:\n{}", stderr(&o));
    o
}

/// The one entry file in `dir/plans`.
fn entry(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = fs::read_dir(dir.join("plans"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let entries: Vec<&PathBuf> = files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "tplan"))
        .collect();
    assert_eq!(entries.len(), 1, "one entry: {files:?}");
    assert_eq!(files.len(), 1, "no temporary file left: {files:?}");
    entries[0].clone()
}

fn verify(dir: &Path) -> Output {
    run(&["cache", "verify", "--cache-dir", dir.to_str().unwrap()])
}

fn assert_valid(dir: &Path) {
    let v = verify(dir);
    assert!(
        v.status.success(),
        "cache verify failed:\n{}{}",
        String::from_utf8_lossy(&v.stdout),
        stderr(&v)
    );
    entry(dir);
}

#[test]
fn warm_second_process_builds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = metrics(&plan(dir.path(), 4096));
    assert_eq!(count(&first, "plans_built"), 1, "{first}");
    assert_eq!(count(&first, "misses"), 1, "{first}");
    assert_eq!(count(&first, "disk_hits"), 0, "{first}");
    assert!(count(&first, "bytes_written") > 0, "{first}");
    let len = fs::metadata(entry(dir.path())).unwrap().len();
    assert_eq!(count(&first, "bytes_written"), len);

    let second = metrics(&plan(dir.path(), 4096));
    assert_eq!(count(&second, "plans_built"), 0, "{second}");
    assert_eq!(count(&second, "disk_hits"), 1, "{second}");
    assert_eq!(count(&second, "misses"), 0, "{second}");
    assert_eq!(count(&second, "rejects"), 0, "{second}");
    assert_eq!(count(&second, "bytes_read"), len, "{second}");
    assert_eq!(count(&second, "bytes_written"), 0, "{second}");
    assert_valid(dir.path());
}

/// Populates a cache, corrupts its entry, and checks the next run: success, one warning,
/// one reject, one build, and a valid entry afterwards.
fn check_fault(what: &str, corrupt: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    plan(dir.path(), 4096);
    let path = entry(dir.path());
    corrupt(&path);
    let bad = verify(dir.path());
    assert_eq!(bad.status.code(), Some(2), "{what}: verify flags the entry");
    assert!(String::from_utf8_lossy(&bad.stdout).contains("bad "));

    let o = plan(dir.path(), 4096);
    let err = stderr(&o);
    let warnings = lines_starting(&err, "tessera: warning: plan cache entry");
    assert_eq!(warnings.len(), 1, "{what}: one warning:\n{err}");
    assert!(
        warnings[0].contains(&path.display().to_string())
            && warnings[0].contains(" rejected (")
            && warnings[0].ends_with("); rebuilt"),
        "{what}: {}",
        warnings[0]
    );
    let m = metrics(&o);
    assert_eq!(count(&m, "rejects"), 1, "{what}: {m}");
    assert_eq!(count(&m, "plans_built"), 1, "{what}: {m}");
    assert_eq!(count(&m, "disk_hits"), 0, "{what}: {m}");
    assert_valid(dir.path());

    // And the rewritten entry is used by the next process.
    let m = metrics(&plan(dir.path(), 4096));
    assert_eq!((count(&m, "plans_built"), count(&m, "disk_hits")), (0, 1));
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = fs::read(path).unwrap();
    f(&mut b);
    fs::write(path, b).unwrap();
}

#[test]
fn fault_truncated_file() {
    check_fault("truncated", |p| edit(p, |b| b.truncate(b.len() / 2)));
}

#[test]
fn fault_flipped_byte() {
    check_fault("flipped byte", |p| {
        edit(p, |b| {
            let i = b.len() - 5;
            b[i] ^= 0x40;
        })
    });
}

#[test]
fn fault_zero_length_file() {
    check_fault("zero length", |p| fs::write(p, b"").unwrap());
}

#[test]
fn fault_other_format_version() {
    // Bytes 8..12 of the header hold the format version (little-endian u32).
    check_fault("other version", |p| {
        edit(p, |b| b[8..12].copy_from_slice(&0xfffe_u32.to_le_bytes()))
    });
}

#[test]
fn fault_entry_of_another_key() {
    check_fault("key mismatch", |p| {
        let other = tempfile::tempdir().unwrap();
        plan(other.path(), 2048);
        fs::copy(entry(other.path()), p).unwrap();
    });
}

#[test]
fn fault_unreadable_entry() {
    check_fault("directory in place of the entry", |p| {
        fs::remove_file(p).unwrap();
        fs::create_dir(p).unwrap();
    });
}

#[test]
fn fault_entry_without_read_permission() {
    use std::os::unix::fs::PermissionsExt;
    let probe = tempfile::tempdir().unwrap();
    let f = probe.path().join("p");
    fs::write(&f, b"x").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o000)).unwrap();
    if fs::read(&f).is_ok() {
        eprintln!("skipped: permissions are not enforced for this user");
        return;
    }
    check_fault("mode 000", |p| {
        fs::set_permissions(p, fs::Permissions::from_mode(0o000)).unwrap()
    });
}

#[test]
fn unusable_cache_dir_degrades_to_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    fs::write(&file, b"x").unwrap();
    let o = plan(&file.join("cache"), 4096);
    let err = stderr(&o);
    let warnings = lines_starting(&err, "tessera: warning:");
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("caching in memory only"), "{err}");
    assert_eq!(count(&metrics(&o), "plans_built"), 1);
}

#[test]
fn no_cache_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for _ in 0..2 {
        let o = run(&[
            "plan",
            "--mask",
            "causal",
            "--q-len",
            "4096",
            "--cache-dir",
            d,
            "--no-cache",
            "--metrics",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let m = metrics(&o);
        assert_eq!(count(&m, "plans_built"), 1, "{m}");
        assert_eq!(count(&m, "bytes_written"), 0, "{m}");
        assert_eq!(count(&m, "disk_hits"), 0, "{m}");
    }
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing written"
    );
}

#[test]
fn four_processes_writing_one_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            tessera(&[
                "plan",
                "--mask",
                "causal",
                "--q-len",
                "65536",
                "--cache-dir",
                d,
                "--metrics",
                "--json",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let m = metrics(&o);
        assert_eq!(count(&m, "rejects"), 0, "{m}");
        assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    }
    assert_valid(dir.path());
}

#[test]
fn cache_stats_verify_clear() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    plan(dir.path(), 4096);
    plan(dir.path(), 2048);

    let o = run(&["cache", "stats", "--json", "--cache-dir", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["entries"], 2, "{s}");
    assert_eq!(s["dir"], d, "{s}");
    let o = run(&["cache", "stats", "--cache-dir", d]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("entries:   2"));

    let o = run(&["cache", "verify", "--json", "--cache-dir", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["ok"].as_u64(), v["bad"].as_u64()),
        (Some(2), Some(0)),
        "{v}"
    );

    // One bad entry: listed, exit 2, one line on stderr.
    let victim = fs::read_dir(dir.path().join("plans"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    fs::write(&victim, b"garbage").unwrap();
    let o = verify(dir.path());
    assert_eq!(o.status.code(), Some(2));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&format!("bad {}", victim.display())), "{out}");
    assert!(out.contains("1 entries ok, 1 bad"), "{out}");
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));

    let o = run(&["cache", "clear", "--cache-dir", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("removed 2 files"));
    let o = run(&["cache", "stats", "--json", "--cache-dir", d]);
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["entries"], 0, "{s}");
    assert!(verify(dir.path()).status.success());
}

#[test]
fn cache_help_has_examples() {
    for args in [
        &["cache", "--help"][..],
        &["cache", "stats", "--help"],
        &["cache", "verify", "--help"],
        &["cache", "clear", "--help"],
        &["env", "--help"],
    ] {
        let o = run(args);
        assert!(o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("tessera "),
            "{args:?}"
        );
    }
}

#[test]
fn env_prints_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = run(&["env", "--json", "--cache-dir", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m: Value = serde_json::from_slice(&o.stdout).unwrap();
    for field in [
        "version",
        "git_revision",
        "rustc_version",
        "os",
        "cpu_model",
    ] {
        assert!(
            m[field].as_str().is_some_and(|s| !s.is_empty()),
            "{field}: {m}"
        );
    }
    assert!(m["cpu_features"].is_array(), "{m}");
    assert!(m["threads"].as_u64().is_some_and(|n| n >= 1), "{m}");
    assert_eq!(m["cache_dir"], d, "{m}");
    assert!(m["gpu"].is_null(), "{m}");
    assert!(!dir.path().join("plans").exists(), "env creates nothing");

    let o = run(&["env", "--cache-dir", d]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("git revision:") && text.contains(d), "{text}");
}

/// `tessera env` names each dtype's kernel path and why: measured and stored by the first
/// process, read back by the next, forced by TESSERA_CPU_PATHS (which must be valid), and
/// never stored with --no-cache.
#[test]
fn env_reports_kernel_paths_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let kernels = |o: &Output| -> Value {
        assert!(o.status.success(), "{}", stderr(o));
        let m: Value = serde_json::from_slice(&o.stdout).unwrap();
        m["kernel_paths"].clone()
    };
    let reasons = |k: &Value| {
        (
            k["f32"]["reason"].as_str().unwrap_or("").to_string(),
            k["bf16"]["reason"].as_str().unwrap_or("").to_string(),
        )
    };
    let first = kernels(&run(&["env", "--json", "--cache-dir", d]));
    let file = first["file"].as_str().map(PathBuf::from);
    if reasons(&first) == ("only_candidate".into(), "only_candidate".into()) {
        return; // a CPU with only the portable copy: nothing to measure or store
    }
    assert_eq!(
        reasons(&first),
        ("measured".into(), "measured".into()),
        "{first}"
    );
    let file = file.expect("the decision is stored");
    assert!(file.starts_with(dir.path()) && file.is_file(), "{first}");
    let again = kernels(&run(&["env", "--json", "--cache-dir", d]));
    assert_eq!(
        reasons(&again),
        ("stored".into(), "stored".into()),
        "{again}"
    );
    for dt in ["f32", "bf16"] {
        assert_eq!(again[dt]["path"], first[dt]["path"], "{again}");
        assert_eq!(again[dt]["candidates"], first[dt]["candidates"], "{again}");
    }
    let text = String::from_utf8_lossy(&run(&["env", "--cache-dir", d]).stdout).into_owned();
    assert!(
        text.contains("kernels:      f32 ") && text.contains("(stored decision from "),
        "{text}"
    );

    let forced = tessera(&["env", "--json", "--cache-dir", d])
        .env("TESSERA_CPU_PATHS", "bf16=widen-portable")
        .output()
        .unwrap();
    let forced = kernels(&forced);
    assert_eq!(forced["bf16"]["path"], "widen-portable");
    assert_eq!(reasons(&forced).1, "env_override");
    for bad in ["bf16=fast", "f64=avx2", "f32=avx2,f32=avx2"] {
        let o = tessera(&["env", "--cache-dir", d])
            .env("TESSERA_CPU_PATHS", bad)
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains("TESSERA_CPU_PATHS"), "{bad}: {err}");
    }

    let none = tempfile::tempdir().unwrap();
    let n = none.path().to_str().unwrap();
    let k = kernels(&run(&["env", "--json", "--cache-dir", n, "--no-cache"]));
    assert!(k["file"].is_null(), "{k}");
    assert_eq!(
        fs::read_dir(none.path()).unwrap().count(),
        0,
        "nothing stored"
    );
}

/// `TESSERA_HIDE_ISA`: `tessera env` lists what it hides as hidden, not available, and with
/// every SIMD feature hidden only the portable kernels are left; an unknown name is refused
/// with one line (exit 2).
#[test]
fn env_reports_hidden_cpu_features() {
    let hide_all = |args: &[&str]| {
        let o = tessera(args)
            .env("TESSERA_HIDE_ISA", "avx2,avx512,amx")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    let m: Value =
        serde_json::from_slice(&hide_all(&["env", "--json", "--no-cache"]).stdout).unwrap();
    assert_eq!(m["cpu_features"], serde_json::json!([]), "{m}");
    assert_eq!(m["kernel_paths"]["f32"]["path"], "portable", "{m}");
    assert_eq!(m["kernel_paths"]["bf16"]["path"], "widen-portable", "{m}");
    let hidden = m["hidden_cpu_features"].as_array().expect("a list").len();
    let text = String::from_utf8_lossy(&hide_all(&["env", "--no-cache"]).stdout).into_owned();
    assert_eq!(
        text.contains("(hidden by TESSERA_HIDE_ISA: "),
        hidden > 0,
        "{text}"
    );

    let o = tessera(&["env", "--no-cache"])
        .env("TESSERA_HIDE_ISA", "avx512,sse9")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("TESSERA_HIDE_ISA") && err.contains("\"sse9\""),
        "{err}"
    );
}
