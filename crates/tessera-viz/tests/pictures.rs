//! The pictures decode as PNG, show the plan's states where they are, and refuse bad input.

use image::RgbImage;
use tessera_mask::Mask;
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};
use tessera_telemetry::TelemetryRecord;
use tessera_viz::{plan_png, telemetry_png, write_plan_png, write_telemetry_png, MAX_PLOT_HEADS};

fn decode(png: &[u8]) -> RgbImage {
    image::load_from_memory(png).unwrap().to_rgb8()
}

/// `causal` over `len` tokens with `heads` heads in 128x128 tiles.
fn causal(heads: usize, len: usize) -> Plan {
    let shape = PlanShape::new(1, heads, len, len).unwrap();
    build_plan(&Mask::causal(), shape, TileShape::default()).unwrap()
}

#[test]
fn plan_map_shows_each_state_in_its_tile() {
    // causal at 1024 with 128x128 tiles: an 8x8 grid drawn at 24 px per tile from (20, 20).
    let plan = causal(2, 1024);
    let img = decode(&plan_png(&plan, 0, 1, "causal").unwrap());
    assert!(img.width() >= 620 && img.height() >= 8 * 24 + 40);
    let at = |qt: u32, kt: u32| img.get_pixel(20 + kt * 24 + 12, 20 + qt * 24 + 12).0;
    assert_eq!(at(0, 7), [242, 242, 242], "above the diagonal: empty");
    assert_eq!(at(7, 0), [47, 93, 140], "below the diagonal: full");
    assert_eq!(at(3, 3), [242, 142, 43], "on the diagonal: partial");

    for (b, h) in [(1, 0), (0, 2)] {
        let e = plan_png(&plan, b, h, "out of range").unwrap_err();
        assert!(e.is_user_error(), "{e}");
    }
    // A long plan is downsampled (each pixel blends several tiles) and still fits.
    let long = causal(1, 1 << 18);
    let img = decode(&plan_png(&long, 0, 0, "long").unwrap());
    assert!(
        img.width() <= 1000 && img.height() <= 1100,
        "{:?}",
        img.dimensions()
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.png");
    write_plan_png(&plan, 0, 0, "causal", &path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        plan_png(&plan, 0, 0, "causal").unwrap()
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temp file left"
    );
}

fn record(step: u64, heads: usize) -> TelemetryRecord {
    let per_head = |f: fn(usize) -> f64| Some((0..heads).map(|h| Some(f(h))).collect());
    TelemetryRecord {
        step,
        layer: 3,
        sink_mass: per_head(|h| 0.1 + 0.05 * h as f64),
        sink_rate: Some(0.5),
        learned_sink_mass: None,
        max_logit: (0..heads).map(|h| Some(step as f64 + h as f64)).collect(),
        entropy: per_head(|_| 2.0),
        valid_rows: Some(vec![10; heads]),
        out_abs_max: None,
        out_rms: None,
        out_outliers: None,
        ranks: Some(2),
        tokens: Some(4096),
    }
}

#[test]
fn telemetry_plot_of_multi_rank_records_is_the_plot_of_the_same_values() {
    // `ranks` and `tokens` (records reduced across ranks) change nothing in the picture, and a
    // multi-rank JSON line parses into them.
    let with: Vec<_> = (0..5).map(|s| record(s, 3)).collect();
    let without: Vec<_> = with
        .iter()
        .cloned()
        .map(|mut r| {
            r.ranks = None;
            r.tokens = None;
            r
        })
        .collect();
    assert_eq!(
        telemetry_png(&with, "run").unwrap(),
        telemetry_png(&without, "run").unwrap()
    );
    let text: String = with
        .iter()
        .map(|r| r.to_json_line().unwrap() + "\n")
        .collect();
    assert!(text.contains("\"ranks\":2") && text.contains("\"tokens\":4096"));
    let back = tessera_telemetry::parse_jsonl(&text, std::path::Path::new("multi.jsonl")).unwrap();
    assert_eq!(back, with);
}

#[test]
fn telemetry_plot_draws_every_shape_of_run() {
    for (steps, heads) in [(1, 1), (6, 4), (2000, 3), (7, 64)] {
        let records: Vec<_> = (0..steps).map(|s| record(10 * s, heads)).collect();
        let img = decode(&telemetry_png(&records, "run").unwrap());
        assert!(img.width() > 760 && img.height() > 400, "{steps} x {heads}");
    }
    // Missing streams draw "no data" instead of failing.
    let mut r = record(0, 2);
    r.sink_mass = None;
    r.max_logit = vec![None, None];
    telemetry_png(&[r], "empty streams").unwrap();

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.png");
    let records = [record(0, 2), record(1, 2)];
    write_telemetry_png(&records, "run", &path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        telemetry_png(&records, "run").unwrap()
    );
}

#[test]
fn telemetry_plot_refuses_bad_records() {
    assert!(telemetry_png(&[], "none").unwrap_err().is_user_error());
    let e = telemetry_png(&[record(0, 2), record(1, 3)], "mixed").unwrap_err();
    assert!(e.to_string().contains("3 heads at step 1"), "{e}");
    let e = telemetry_png(&[record(0, MAX_PLOT_HEADS + 1)], "wide").unwrap_err();
    assert!(e.is_user_error(), "{e}");
}
