//! Sink-key flags, outlier statistics, gating, the deferred sink and JSON lines.

mod common;

use half::bf16;
use tessera_core::Tensor;
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_telemetry::*;

#[test]
fn sink_flags_without_documents() {
    let f = sink_key_flags(None, 2, 5, 2).expect("flags");
    let row = [true, true, false, false, false];
    assert_eq!(f, [row, row].concat());
    assert!(sink_key_flags(None, 1, 3, 0)
        .expect("flags")
        .iter()
        .all(|&x| !x));
    assert_eq!(
        sink_key_flags(None, 1, 2, 9).expect("flags"),
        vec![true, true]
    );
}

#[test]
fn sink_flags_with_documents_and_padding() {
    // Row 0: docs [0 0 0] [1 1] [0 0] (a repeated id starts a new run) [-1 -1].
    // Row 1: [-1] [5 5 5 5] [6] [7 7 7] [-1].
    let ids = vec![
        0, 0, 0, 1, 1, 0, 0, -1, -1, -1, //
        -1, 5, 5, 5, 5, 6, 7, 7, 7, -1,
    ];
    let seg = SegmentIds::new(2, 10, ids).expect("ids");
    let f = sink_key_flags(Some(&seg), 2, 10, 1).expect("flags");
    let t = true;
    let o = false;
    assert_eq!(
        f,
        vec![
            t, o, o, t, o, t, o, o, o, o, //
            o, t, o, o, o, t, t, o, o, o
        ]
    );
    let f2 = sink_key_flags(Some(&seg), 2, 10, 2).expect("flags");
    assert_eq!(
        &f2[10..],
        &[o, t, t, o, o, t, t, t, o, o],
        "two sink tokens per document"
    );
    // One shared row broadcasts to every batch row.
    let shared = SegmentIds::shared(vec![3, 3, -1, 4, 4]).expect("ids");
    let f = sink_key_flags(Some(&shared), 3, 5, 1).expect("flags");
    assert_eq!(f, [[t, o, o, t, o]; 3].concat());
    // Wrong length or rows.
    assert!(sink_key_flags(Some(&shared), 3, 6, 1).is_err());
    assert!(sink_key_flags(Some(&seg), 3, 10, 1).is_err());
    // The document leaf's kv ids are found inside a compound mask.
    let mask = Mask::causal() & Mask::document(Segments::shared(shared.clone()));
    assert_eq!(document_kv_segments(&mask), Some(&shared));
    assert_eq!(document_kv_segments(&Mask::causal()), None);
}

fn direct_stats(vals: &[f64], ratio: f64) -> (f64, f64, u64) {
    let sq: f64 = vals.iter().map(|x| x * x).sum();
    let rms = (sq / vals.len() as f64).sqrt();
    let max = vals.iter().fold(0f64, |a, x| a.max(x.abs()));
    let n = vals.iter().filter(|x| x.abs() > ratio * rms).count() as u64;
    (max, sq, n)
}

#[test]
fn outlier_summary_f32_bf16_and_ranks() {
    let mut rng = common::Rng::new(21);
    let (b, g, n) = (3, 4, 50);
    let mut vals: Vec<f64> = rng.vec(b * g * n, 1.0);
    vals[7] = 30.0;
    vals[b * g * n - 3] = -25.0;
    let vals: Vec<f64> = vals.iter().map(|&x| x as f32 as f64).collect();
    let t = Tensor::from_f32(vec![b, g, 5, 10], vals.iter().map(|&x| x as f32).collect())
        .expect("tensor");
    let got = outlier_summary(&t.view(), 3.0).expect("stats");
    assert_eq!(got.len(), g);
    for (gi, s) in got.iter().enumerate() {
        let (mut max, mut sq, mut cnt) = (0f64, 0f64, 0u64);
        for bi in 0..b {
            let slice = &vals[(bi * g + gi) * n..][..n];
            let (m, q, c) = direct_stats(slice, 3.0);
            max = max.max(m);
            sq += q;
            cnt += c;
        }
        assert_eq!(s.count, (b * n) as u64);
        assert_eq!(s.abs_max, max);
        assert_eq!(s.outliers, cnt);
        assert!((s.sq_sum.value() - sq).abs() <= 1e-12 * sq);
        assert!((s.rms() - (sq / (b * n) as f64).sqrt()).abs() < 1e-12);
    }
    assert!(got[0].outliers >= 1 && got[g - 1].outliers >= 1);

    // bf16: the same statistics of the bf16-rounded values.
    let bvals: Vec<bf16> = vals.iter().map(|&x| bf16::from_f64(x)).collect();
    let rounded: Vec<f64> = bvals.iter().map(|x| x.to_f64()).collect();
    let tb = Tensor::from_bf16(vec![b, g, n], bvals).expect("tensor");
    let got_b = outlier_summary(&tb.view(), 3.0).expect("stats");
    let want_b = outlier_summary_f64(&[b, g, n], &rounded, 3.0).expect("stats");
    assert_eq!(got_b, want_b);

    // Rank 1: one group over everything.
    let t1 = Tensor::from_f32(vec![vals.len()], vals.iter().map(|&x| x as f32).collect())
        .expect("tensor");
    let one = outlier_summary(&t1.view(), 3.0).expect("stats");
    assert_eq!(one.len(), 1);
    let (m, _, c) = direct_stats(&vals, 3.0);
    assert_eq!((one[0].abs_max, one[0].outliers), (m, c));

    // Bad input.
    let empty = Tensor::from_f32(vec![2, 0, 3], vec![]).expect("tensor");
    assert!(outlier_summary(&empty.view(), 3.0).is_err());
    let ints = Tensor::new(vec![2], tessera_core::TensorData::I32(vec![1, 2])).expect("tensor");
    assert!(outlier_summary(&ints.view(), 3.0).is_err());
    assert!(outlier_summary(&t1.view(), f64::NAN).is_err());
    assert!(outlier_summary(&t1.view(), -1.0).is_err());
}

#[test]
fn gating_every_two() {
    let mut t = Telemetry::new(TelemetryConfig::every(2)).expect("config");
    let mut logged = Vec::new();
    for _ in 0..7 {
        if t.should_log() {
            logged.push(t.step);
        }
        assert_eq!(t.sink_stream(), t.should_log());
        assert_eq!(t.outlier_stream(), t.should_log());
        t.advance();
    }
    assert_eq!(logged, vec![0, 2, 4, 6]);
    assert_eq!(t.summary(3, 8, true).step, 7);

    let never = Telemetry::new(TelemetryConfig::default()).expect("config");
    assert!(!never.should_log());
    let mut cfg = TelemetryConfig::every(1);
    cfg.streams.outlier = false;
    let t = Telemetry::new(cfg.clone()).expect("config");
    assert!(t.should_log() && t.sink_stream() && !t.outlier_stream());
    cfg.streams.sink = false;
    assert!(!Telemetry::new(cfg).expect("config").should_log());

    let bad = TelemetryConfig {
        epsilon: 1.5,
        ..TelemetryConfig::every(1)
    };
    assert!(Telemetry::new(bad).is_err());
    let bad = TelemetryConfig {
        outlier_ratio: f64::INFINITY,
        ..TelemetryConfig::every(1)
    };
    assert!(Telemetry::new(bad).is_err());
    let d = TelemetryConfig::default();
    assert_eq!((d.sink_tokens, d.epsilon, d.outlier_ratio), (1, 0.3, 6.0));
}

fn sample_summary(step: u64, layer: u32, seed: u64) -> AttnSummary {
    let p = common::problem(
        seed,
        &common::Opts {
            sinks: true,
            docs: true,
            ..Default::default()
        },
    );
    let mut s = reference_summary(&p.input(), step, layer)
        .expect("reference")
        .summary;
    // One head with nothing: null entries.
    s.heads[3] = HeadAccum::default();
    s
}

#[test]
fn deferred_sink_merges_and_orders() {
    let cfg = TelemetryConfig::every(1);
    let mut sink = TelemetrySink::new(cfg.clone());
    let parts = [(4, 1, 30), (4, 0, 31), (2, 1, 32), (4, 1, 33)];
    for &(step, layer, seed) in &parts {
        sink.submit(sample_summary(step, layer, seed))
            .expect("submit");
    }
    assert_eq!(sink.pending(), 3);
    let recs = sink.flush();
    assert_eq!(sink.pending(), 0);
    let keys: Vec<(u64, u32)> = recs.iter().map(|r| (r.step, r.layer)).collect();
    assert_eq!(keys, vec![(2, 1), (4, 0), (4, 1)]);
    let mut merged = sample_summary(4, 1, 30);
    merged.merge(&sample_summary(4, 1, 33)).expect("merge");
    assert_eq!(recs[2], merged.record(&cfg));
    assert!(sink.submit(AttnSummary::new(4, 1, 2, true)).is_ok());
    assert!(sink.submit(AttnSummary::new(4, 1, 3, true)).is_err());
}

#[test]
fn jsonl_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.jsonl");
    let cfg = TelemetryConfig::every(1);
    let mut no_sinks = AttnSummary::new(6, 0, 4, false);
    no_sinks.heads[1].observe_max_logit(2.5);
    let recs = vec![
        sample_summary(0, 0, 40).record(&cfg),
        sample_summary(0, 1, 41).record(&cfg),
        no_sinks.record(&cfg),
    ];
    assert!(recs[0].entropy.as_ref().expect("entropy")[3].is_none());
    {
        let mut w = JsonlWriter::append(&path).expect("open");
        w.write_all(&recs[..2]).expect("write");
    }
    {
        let mut w = JsonlWriter::append(&path).expect("reopen");
        w.write_all(&recs[2..]).expect("write");
    }
    let text = std::fs::read_to_string(&path).expect("read");
    assert_eq!(text.lines().count(), 3);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        for f in [
            "step",
            "layer",
            "sink_mass",
            "sink_rate",
            "learned_sink_mass",
            "max_logit",
            "entropy",
            "out_abs_max",
            "out_rms",
            "out_outliers",
        ] {
            assert!(v.get(f).is_some(), "field {f} missing in {line}");
        }
    }
    let back = read_jsonl(&path).expect("read back");
    assert_eq!(back, recs);
    assert!(back[2].learned_sink_mass.is_none());
}

#[test]
fn malformed_jsonl_names_the_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.jsonl");
    let good = sample_summary(0, 0, 50)
        .record(&TelemetryConfig::every(1))
        .to_json_line()
        .expect("json");
    std::fs::write(&path, format!("{good}\n\n{{\"step\": 1, oops}}\n")).expect("write");
    let e = read_jsonl(&path).expect_err("malformed").to_string();
    assert!(e.contains("line 3"), "{e}");
    assert!(e.contains("bad.jsonl"), "{e}");
    // Inconsistent head counts.
    let mut v: serde_json::Value = serde_json::from_str(&good).expect("json");
    v["entropy"] = serde_json::json!([0.1]);
    std::fs::write(&path, format!("{good}\n{v}\n")).expect("write");
    let e = read_jsonl(&path).expect_err("bad lengths").to_string();
    assert!(e.contains("line 2") && e.contains("entropy"), "{e}");
    // Missing required field.
    std::fs::write(&path, "{\"step\": 1, \"layer\": 0}\n").expect("write");
    let e = read_jsonl(&path).expect_err("missing").to_string();
    assert!(e.contains("line 1") && e.contains("max_logit"), "{e}");
    // Not UTF-8.
    std::fs::write(&path, b"{}\n\xff\n").expect("write");
    let e = read_jsonl(&path).expect_err("utf8").to_string();
    assert!(e.contains("line 2"), "{e}");
    assert!(read_jsonl(dir.path().join("missing.jsonl")).is_err());
}
