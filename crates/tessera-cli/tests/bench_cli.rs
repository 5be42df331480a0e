//! End-to-end test of `tessera bench` through the built binary: the suite subset, the JSON report
//! (manifest, measured per-path peaks, rows with their kernel path, effective GFLOP/s, % of that
//! path's peak, the backward/forward ratio and the per-tile ratio to `full`), forced paths and
//! the bad-input contract.

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
    // The f32 peaks are FMA probes: a CPU without AVX2 (or with it hidden) has none.
    let fma = tessera::core::cpu_features::has(tessera::core::cpu_features::Feature::Fma);
    assert_eq!(
        ["avx2", "avx512"]
            .iter()
            .any(|p| peaks[p].as_f64().is_some_and(|g| g > 0.0)),
        fma,
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
            check_pct_peak(r, peaks);
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

/// A row's `% peak` is its GFLOP/s over the peak of its own path (never above 100), and its
/// path is the run's path for its dtype.
fn check_pct_peak(r: &serde_json::Value, peaks: &serde_json::Value) {
    let Some(path) = r["peak_path"].as_str() else {
        // Seen on a CPU without AVX2 (TESSERA_HIDE_ISA=avx2): bf16 rows run `widen-portable`.
        assert!(
            r["path"] == "portable" || r["path"] == "widen-portable",
            "only the portable copy has no peak: {r}"
        );
        assert!(r["pct_peak"].is_null(), "{r}");
        return;
    };
    let want = match r["path"].as_str().unwrap_or_default() {
        "bf16-dot" => "bf16_dot",
        "avx512" | "widen-avx512" => "avx512",
        "avx2" | "widen-avx2" => "avx2",
        other => panic!("unexpected path {other}: {r}"),
    };
    assert_eq!(path, want, "{r}");
    let peak = peaks[path].as_f64().expect("the path's peak");
    let pct = r["pct_peak"].as_f64().expect("pct_peak");
    let gflops = r["gflops"].as_f64().unwrap_or(f64::NAN);
    assert!(pct > 0.0 && pct <= 100.0, "{r}");
    assert!(
        (pct - 100.0 * gflops / peak).abs() <= 1e-9 * pct,
        "{r} vs {peaks}"
    );
}

/// A tiny bench with the peak probe: every `% peak` is at most 100 and taken against its row's
/// path; `--tile-ratio` adds the full mask and fills the sparse rows' per-tile ratio; `--isa`
/// and `--bf16-path` force the paths the rows report.
#[test]
fn bench_reports_paths_peaks_and_tile_ratios() {
    let base = [
        "--masks",
        "causal",
        "--lens",
        "256",
        "--tile",
        "64x64",
        "--dims",
        "16",
        "--heads",
        "1",
        "--dtypes",
        "f32,bf16",
        "--passes",
        "fwd,bwd",
        "--reps",
        "1",
        "--no-cache",
        "--tile-ratio",
    ];
    let v = bench_json(&base);
    let peaks = &v["peaks"];
    assert!(peaks["raised"].is_array(), "{peaks}");
    let rows = v["rows"].as_array().expect("rows");
    // full (added) and causal × f32, bf16 × fwd, bwd.
    assert_eq!(rows.len(), 8, "{v}");
    let paths = &v["manifest"]["kernel_paths"];
    for r in rows {
        check_pct_peak(r, peaks);
        let dt = r["dtype"].as_str().unwrap_or_default();
        let decided = paths[dt]["path"].as_str().unwrap_or_default();
        let want = if decided == "dot" {
            "bf16-dot"
        } else {
            decided
        };
        assert_eq!(r["path"], want, "{r}");
        let ratio = r["tile_time_ratio"].as_f64();
        if r["mask"] == "full" {
            assert!(ratio.is_none(), "{r}");
        } else {
            let full = rows
                .iter()
                .find(|f| f["mask"] == "full" && f["dtype"] == r["dtype"] && f["pass"] == r["pass"])
                .expect("the full row of the same case");
            let per_tile = |x: &serde_json::Value| {
                x["median_ms"].as_f64().unwrap_or(f64::NAN)
                    / x["active_tile_count"].as_f64().unwrap_or(f64::NAN)
            };
            let want = per_tile(r) / per_tile(full);
            assert!(
                ratio.is_some_and(|x| (x - want).abs() <= 1e-9 * want),
                "{r} {full}"
            );
        }
    }
    // 256 tokens in 64-token tiles: 16 tiles, 10 of them active under causal.
    assert_eq!(rows[4]["active_tile_count"].as_f64(), Some(10.0), "{v}");

    let forced = bench_json(
        &[
            &base[..],
            &["--isa", "portable", "--bf16-path", "widen", "--no-peak"],
        ]
        .concat(),
    );
    assert_eq!(forced["forced"], true);
    assert_eq!(forced["paths"]["f32"], "portable");
    assert_eq!(forced["paths"]["bf16"], "widen-portable");
    for r in forced["rows"].as_array().expect("rows") {
        let want = if r["dtype"] == "bf16" {
            "widen-portable"
        } else {
            "portable"
        };
        assert_eq!(r["path"], want, "{r}");
        assert!(r["pct_peak"].is_null(), "{r}");
    }
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
        &["bench", "--isa", "avx9", "--no-peak"][..],
        &["bench", "--bf16-path", "fast", "--no-peak"][..],
    ] {
        let out = tessera(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}

/// Forcing a path this CPU cannot run is refused with one line (exit 2) before any work.
#[test]
fn bench_refuses_a_forced_path_the_cpu_lacks() {
    #[cfg(target_arch = "x86_64")]
    use tessera::core::cpu_features::{has, Feature};
    #[cfg(target_arch = "x86_64")]
    let lacks: Vec<&[&str]> = [
        (!has(Feature::Avx512bf16)).then_some(&["--bf16-path", "dot"][..]),
        (!has(Feature::Avx512f)).then_some(&["--isa", "avx512"][..]),
        (!has(Feature::Avx2)).then_some(&["--isa", "avx2"][..]),
    ]
    .into_iter()
    .flatten()
    .collect();
    #[cfg(not(target_arch = "x86_64"))]
    let lacks: Vec<&[&str]> = vec![&["--isa", "avx2"][..]];
    if lacks.is_empty() {
        eprintln!("skipping: this CPU runs every path");
        return;
    }
    for flags in lacks {
        let out = tessera(&[&["bench", "--no-peak", "--quick"], flags].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{flags:?}: {err}");
        assert!(err.contains("lacks"), "{flags:?}: {err}");
    }
}
