//! End-to-end test of `tessera bench` through the built binary: the suite subset, the JSON report
//! (manifest, measured peaks, rows with effective GFLOP/s and the backward/forward ratio) and the
//! bad-input contract.

use std::process::Command;

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("run tessera")
}

/// Runs `tessera bench ... --json`, requires success and returns the parsed report.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = tessera(&[&["bench"], args, &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bench --json is JSON")
}

#[test]
fn bench_json_reports_every_case_with_its_ratio() {
    let v = bench_json(&[
        "--masks",
        "causal,documents",
        "--lens",
        "2048",
        "--tile",
        "64x64",
        "--dims",
        "16",
        "--dtypes",
        "f32,bf16",
        "--reps",
        "1",
        "--no-cache",
    ]);
    assert!(v["manifest"].is_object(), "manifest missing: {v}");
    let peaks = &v["peaks"];
    assert!(
        ["avx2", "avx512"]
            .iter()
            .any(|p| peaks[p].as_f64().is_some_and(|g| g > 0.0)),
        "f32 peak: {peaks}"
    );
    let rows = v["rows"].as_array().expect("rows");
    // 2 masks × 1 length × 1 dim × 2 dtypes × 2 passes.
    assert_eq!(rows.len(), 8, "{v}");
    for pair in rows.chunks(2) {
        let (f, b) = (&pair[0], &pair[1]);
        assert_eq!(
            (f["pass"].as_str(), b["pass"].as_str()),
            (Some("fwd"), Some("bwd"))
        );
        assert_eq!(f["mask"], b["mask"]);
        assert_eq!(
            (f["tile"].as_str(), b["tile"].as_str()),
            (Some("64x64"), Some("64x64"))
        );
        assert_eq!(f["dtype"], b["dtype"]);
        for r in [f, b] {
            assert!(r["median_ms"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert!(r["gflops"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert!(r["pct_peak"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        }
        assert!(f["bwd_over_fwd"].is_null(), "{f}");
        let ratio = b["bwd_over_fwd"]
            .as_f64()
            .expect("ratio on the backward row");
        let want = b["median_ms"].as_f64().unwrap_or(0.0) / f["median_ms"].as_f64().unwrap_or(1.0);
        assert!(
            (ratio - want).abs() <= 1e-9 * want.abs().max(1.0),
            "{ratio} vs {want}"
        );
    }
    // Documents of 512–1536 tokens leave fewer active tiles than causal at the same length.
    let tiles = |i: usize| rows[i]["active_tiles"].as_f64().unwrap_or(f64::NAN);
    assert!(tiles(4) < tiles(0), "documents vs causal tile density: {v}");
}

/// `--tile auto` (the default) takes the backend's recommended tile per head dim and dtype.
#[test]
fn bench_default_tile_follows_the_backend_recommendation() {
    let v = bench_json(&[
        "--masks",
        "causal",
        "--lens",
        "256",
        "--dims",
        "64,128",
        "--passes",
        "fwd",
        "--reps",
        "1",
        "--no-cache",
        "--no-peak",
    ]);
    let tiles: Vec<(u64, String, String)> = v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (r["dim"].as_u64().unwrap_or(0), s("dtype"), s("tile"))
        })
        .collect();
    let want = [
        (64, "f32", "128x128"),
        (64, "bf16", "128x128"),
        (128, "f32", "64x128"),
        (128, "bf16", "128x128"),
    ];
    let want: Vec<(u64, String, String)> = want
        .iter()
        .map(|&(d, t, s)| (d, t.to_string(), s.to_string()))
        .collect();
    assert_eq!(tiles, want);
}

#[test]
fn bench_rejects_bad_options_with_one_line() {
    for args in [
        &["bench", "--masks", "spiral", "--no-peak"][..],
        &["bench", "--passes", "sideways", "--no-peak"][..],
        &["bench", "--dtypes", "f64", "--no-peak"][..],
        &["bench", "--tile", "100x7", "--no-peak"][..],
    ] {
        let out = tessera(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}
