//! End-to-end tests of the telemetry outputs of `tessera attend --telemetry` and `tessera demo`
//! through the built binary.

mod common;

use common::{bad, ok, save, tessera, values};
use tessera::core::{Tensor, TensorData};
use tessera::mask::{Mask, SegmentIds, Segments};
use tessera::telemetry::{read_jsonl, reference_summary, sink_key_flags, ReferenceInput};

#[test]
fn attend_writes_one_telemetry_record_matching_the_reference() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let (b, hq, hkv, l, dim) = (2usize, 4usize, 2usize, 90usize, 16usize);
    let qv = values(b * hq * l * dim, 1);
    let kv = values(b * hkv * l * dim, 2);
    let vv = values(b * hkv * l * dim, 3);
    let q = Tensor::from_f32(vec![b, hq, l, dim], qv.clone()).unwrap();
    let k = Tensor::from_f32(vec![b, hkv, l, dim], kv.clone()).unwrap();
    let v = Tensor::from_f32(vec![b, hkv, l, dim], vv.clone()).unwrap();
    let ids: Vec<i64> = (0..b)
        .flat_map(|r| {
            (0..l).map(move |i| {
                if i >= 80 {
                    -1
                } else {
                    (i / (17 + 9 * r)) as i64
                }
            })
        })
        .collect();
    let segs = Tensor::new(vec![b, l], TensorData::I64(ids.clone())).unwrap();
    let (qf, kf, vf, sf) = (
        save(p, "q.npy", &q),
        save(p, "k.npy", &k),
        save(p, "v.npy", &v),
        save(p, "seg.npy", &segs),
    );
    let text = ok(
        &[
            "attend",
            "--q",
            &qf,
            "--k",
            &kf,
            "--v",
            &vf,
            "--mask",
            "causal & document",
            "--segments",
            &sf,
            "--tile",
            "16x16",
            "--out",
            "o.npy",
            "--telemetry",
            "t.jsonl",
            "--sink-tokens",
            "2",
        ],
        p,
    );
    assert!(text.contains("telemetry: sink mass mean"), "{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    let recs = read_jsonl(p.join("t.jsonl")).unwrap();
    assert_eq!(recs.len(), 1);
    let r = &recs[0];
    assert_eq!((r.step, r.layer, r.heads()), (0, 0, hq));

    let seg = SegmentIds::new(b, l, ids).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg.clone()));
    let flags = sink_key_flags(Some(&seg), b, l, 2).unwrap();
    let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q64, k64, v64) = (f64s(&qv), f64s(&kv), f64s(&vv));
    let want = reference_summary(
        &ReferenceInput {
            q: &q64,
            k: &k64,
            v: &v64,
            batch: b,
            heads_q: hq,
            heads_kv: hkv,
            q_len: l,
            kv_len: l,
            d_qk: dim,
            d_v: dim,
            mask: &mask,
            scale: 1.0 / (dim as f64).sqrt(),
            softcap: None,
            sinks: None,
            sink_flags: &flags,
            outlier_ratio: tessera::telemetry::DEFAULT_OUTLIER_RATIO,
        },
        0,
        0,
    )
    .unwrap()
    .summary
    .record(&tessera::telemetry::TelemetryConfig::every(1));
    let close = |a: &[Option<f64>], b: &[Option<f64>], tol: f64| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x.unwrap() - y.unwrap()).abs() <= tol * y.unwrap().abs())
    };
    let (got_m, want_m) = (
        r.sink_mass.as_ref().unwrap(),
        want.sink_mass.as_ref().unwrap(),
    );
    assert!(close(got_m, want_m, 1e-5), "{got_m:?} vs {want_m:?}");
    let (got_e, want_e) = (r.entropy.as_ref().unwrap(), want.entropy.as_ref().unwrap());
    assert!(close(got_e, want_e, 1e-5), "{got_e:?} vs {want_e:?}");
    assert_eq!(r.valid_rows, want.valid_rows);
    assert!(close(&r.max_logit, &want.max_logit, 1e-5));

    // --json carries the record; without --telemetry it is null and no file is written.
    let json = ok(
        &[
            "attend",
            "--q",
            &qf,
            "--k",
            &kf,
            "--v",
            &vf,
            "--mask",
            "causal",
            "--out",
            "o2.npy",
            "--telemetry",
            "t2.jsonl",
            "--json",
        ],
        p,
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["telemetry"]["step"], 0);
    assert_eq!(v["telemetry"]["sink_mass"].as_array().unwrap().len(), hq);
    let json = ok(
        &[
            "attend", "--q", &qf, "--k", &kf, "--v", &vf, "--mask", "causal", "--out", "o3.npy",
            "--json",
        ],
        p,
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["telemetry"].is_null());

    // The file plots.
    ok(
        &["telemetry", "plot", "--in", "t.jsonl", "--out", "t.png"],
        p,
    );
    assert!(p.join("t.png").exists());

    // --sink-tokens needs --telemetry.
    let out = tessera(
        &[
            "attend",
            "--q",
            &qf,
            "--k",
            &kf,
            "--v",
            &vf,
            "--mask",
            "causal",
            "--out",
            "o4.npy",
            "--sink-tokens",
            "3",
        ],
        p,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--sink-tokens") && err.contains("--telemetry"),
        "{err}"
    );
}

#[test]
fn demo_logs_every_other_step_and_plots_them() {
    let d = tempfile::tempdir().unwrap();
    let text = ok(&["demo", "--seq-len", "4096", "--heads", "1"], d.path());
    let line: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("[telemetry]"))
        .collect();
    assert_eq!(line.len(), 1, "{text}");
    assert!(line[0].contains("3 of 6 steps logged"), "{}", line[0]);
    let recs = read_jsonl(d.path().join("tessera-demo/telemetry.jsonl")).unwrap();
    assert_eq!(
        recs.iter().map(|r| r.step).collect::<Vec<_>>(),
        vec![0, 2, 4]
    );
    // The sink keys gain mass over the run, most on the last head.
    let mass = |r: usize, h: usize| recs[r].sink_mass.as_ref().unwrap()[h].unwrap();
    assert!(mass(2, 3) > mass(0, 3) && mass(2, 3) > mass(2, 0));
    let png = d.path().join("tessera-demo/telemetry.png");
    let bytes = std::fs::read(png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG"));
}

#[test]
fn plot_draws_one_layer_or_every_layer() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    // Three layers of two heads over four steps; layer 2 misses step 3, and (step 1, layer 0)
    // is written twice (a resumed run appending again).
    let mut lines = Vec::new();
    for step in 0..4u64 {
        for layer in 0..3u32 {
            if layer == 2 && step == 3 {
                continue;
            }
            let m = 0.1 * (step as f64 + 1.0) + 0.01 * layer as f64;
            lines.push(serde_json::json!({
                "step": step, "layer": layer, "sink_mass": [m, m / 2.0], "sink_rate": 0.0,
                "learned_sink_mass": null, "max_logit": [1.0 + step as f64, 2.0], "entropy": null,
                "valid_rows": null, "out_abs_max": null, "out_rms": null, "out_outliers": null,
            }));
        }
    }
    lines.push(lines[3].clone());
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(p.join("t.jsonl"), text).unwrap();
    let png = |name: &str| std::fs::read(p.join(name)).unwrap();

    // Several layers and no --layer: the overview of all of them.
    let out = ok(
        &[
            "telemetry",
            "plot",
            "--in",
            "t.jsonl",
            "--out",
            "all.png",
            "--json",
        ],
        p,
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["layers"], serde_json::json!([0, 1, 2]));
    assert_eq!(
        (v["steps"].as_u64(), v["heads"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(v["duplicate_steps"], 1);
    assert!(png("all.png").starts_with(b"\x89PNG"));
    // --layer all is the same picture; --layer N one layer's picture.
    ok(
        &[
            "telemetry",
            "plot",
            "--in",
            "t.jsonl",
            "--out",
            "all2.png",
            "--layer",
            "all",
        ],
        p,
    );
    assert_eq!(png("all.png"), png("all2.png"));
    let out = ok(
        &[
            "telemetry",
            "plot",
            "--in",
            "t.jsonl",
            "--out",
            "l2.png",
            "--layer",
            "2",
            "--json",
        ],
        p,
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["layers"].clone(), v["steps"].as_u64()),
        (serde_json::json!([2]), Some(3))
    );
    assert_ne!(png("l2.png"), png("all.png"));
    // A layer that is not in the file, or not a layer, is bad input naming --layer.
    bad(
        &[
            "telemetry",
            "plot",
            "--in",
            "t.jsonl",
            "--out",
            "x.png",
            "--layer",
            "7",
        ],
        p,
        "--layer",
    );
    bad(
        &[
            "telemetry",
            "plot",
            "--in",
            "t.jsonl",
            "--out",
            "x.png",
            "--layer",
            "last",
        ],
        p,
        "--layer",
    );
    assert!(!p.join("x.png").exists());
}

#[test]
fn plot_reads_multi_rank_files_unchanged() {
    // Records reduced across ranks (what `tessera.Telemetry(group=...)` writes) carry `ranks` and
    // `tokens`; the plot reads them as it reads single-process files and draws the same picture.
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let line = |step: u64, extra: bool| {
        let mut v = serde_json::json!({
            "step": step, "layer": 0, "sink_mass": [0.2 + 0.1 * step as f64, 0.05],
            "sink_rate": 0.0, "learned_sink_mass": null, "max_logit": [3.0, 2.0],
            "entropy": [1.5, 2.5], "valid_rows": [8192, 8192], "out_abs_max": [4.0, 3.0],
            "out_rms": [1.0, 0.9], "out_outliers": [3, 0],
        });
        if extra {
            v["ranks"] = serde_json::json!(4);
            v["tokens"] = serde_json::json!(8192);
        }
        format!("{v}\n")
    };
    let multi: String = (0..3).map(|s| line(s, true)).collect();
    let single: String = (0..3).map(|s| line(s, false)).collect();
    std::fs::write(p.join("multi.jsonl"), multi).unwrap();
    std::fs::write(p.join("single.jsonl"), single).unwrap();
    for name in ["multi", "single"] {
        let out = ok(
            &[
                "telemetry",
                "plot",
                "--in",
                &format!("{name}.jsonl"),
                "--out",
                &format!("{name}.png"),
                "--json",
            ],
            p,
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (v["steps"].as_u64(), v["heads"].as_u64()),
            (Some(3), Some(2))
        );
    }
    let recs = read_jsonl(p.join("multi.jsonl")).unwrap();
    assert_eq!((recs[0].ranks, recs[0].tokens), (Some(4), Some(8192)));
    let png = std::fs::read(p.join("multi.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG"));
}
