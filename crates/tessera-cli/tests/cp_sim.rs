//! End-to-end tests of `tessera cp-sim` through the built binary.

mod common;

use common::{bad, tessera};

#[test]
fn cp_sim_reports_every_scheme_as_table_json_and_chart() {
    let d = tempfile::tempdir().unwrap();
    let out = tessera(
        &[
            "cp-sim",
            "--lengths",
            "64K",
            "--ranks",
            "2,4",
            "--png",
            "cp.png",
        ],
        d.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for scheme in ["contiguous", "zigzag", "perdoc_zigzag", "balanced"] {
        assert_eq!(text.matches(&format!("| {scheme} |")).count(), 2, "{text}");
    }
    assert_eq!(text.matches("assumption:").count(), 3, "{text}");
    let png = image::open(d.path().join("cp.png")).unwrap();
    assert!(png.width() > 200 && png.height() > 200);

    let out = tessera(
        &["cp-sim", "--lengths", "64K", "--ranks", "4", "--json"],
        d.path(),
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let get = |s: &str| rows.iter().find(|r| r["scheme"] == s).unwrap();
    let b = get("balanced");
    assert!(
        b["cost_max_over_mean"].as_f64().unwrap()
            <= get("zigzag")["cost_max_over_mean"].as_f64().unwrap()
    );
    assert!(b["needed_bytes_max"].as_f64().unwrap() < b["allgather_bytes"].as_f64().unwrap());
    assert_eq!(b["tokens"], 65536);
    // The needed fraction is the busiest receiver's bytes over an all-gather's.
    for r in rows {
        let f = r["needed_fraction_max"].as_f64().unwrap();
        let want = r["needed_bytes_max"].as_f64().unwrap() / r["allgather_bytes"].as_f64().unwrap();
        assert!((f - want).abs() < 1e-9, "{r}");
    }

    // The web mix: 1 % of documents long, named in the header.
    let out = tessera(
        &[
            "cp-sim",
            "--mix",
            "web",
            "--seed",
            "6",
            "--lengths",
            "128K",
            "--ranks",
            "8",
        ],
        d.path(),
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1% of documents"), "{text}");
    assert!(text.contains("needed max / all-gather"), "{text}");
}

#[test]
fn cp_sim_bad_arguments_exit_2_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    bad(&["cp-sim", "--lengths", "0"], d.path(), "--lengths");
    bad(&["cp-sim", "--ranks", "two"], d.path(), "--ranks");
    bad(&["cp-sim", "--link-gbps", "0"], d.path(), "--link-gbps");
    bad(
        &["cp-sim", "--balance-cap", "0.9"],
        d.path(),
        "--balance-cap",
    );
    bad(&["cp-sim", "--mix", "books"], d.path(), "--mix");
    // 64K tokens in 128-token tiles is 512 tiles: 3 ranks cannot share them evenly.
    bad(
        &["cp-sim", "--lengths", "64K", "--ranks", "3"],
        d.path(),
        "pad the row",
    );
}
