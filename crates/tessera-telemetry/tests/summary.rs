//! The finish_row path against the float64 dense reference, analytic cases, and exact merging.

mod common;

use common::*;
use tessera_core::Tensor;
use tessera_telemetry::*;

const RTOL: f64 = 1e-9;
const ATOL: f64 = 1e-12;

fn check_case(name: &str, seed: u64, o: &Opts) {
    let p = problem(seed, o);
    let reference = reference_summary(&p.input(), 7, 3).expect("reference");
    for how in [
        Online::Direct,
        Online::Tiles(1),
        Online::Tiles(4),
        Online::Tiles(64),
    ] {
        let got = summary_via_rows(&p, how, 0..p.batch);
        if let Err(e) = got.check_close(&reference.summary, RTOL, ATOL) {
            panic!("{name} ({how:?}): {e}");
        }
        let cfg = TelemetryConfig::every(1);
        let (a, b) = (got.record(&cfg), reference.summary.record(&cfg));
        assert_eq!(a.valid_rows, b.valid_rows, "{name}");
        assert_eq!(a.sink_rate, b.sink_rate, "{name}");
    }
    // Sanity of the reference itself: some sink mass, entropy > 0, every row valid or not as
    // the mask says.
    let rec = reference.summary.record(&TelemetryConfig::every(1));
    for e in rec.entropy.expect("entropy").into_iter().flatten() {
        assert!(e >= 0.0, "{name}: entropy {e}");
    }
}

#[test]
fn finish_row_matches_reference_plain() {
    check_case("plain causal", 1, &Opts::default());
    check_case(
        "full mask MHA",
        2,
        &Opts {
            causal: false,
            heads_kv: 4,
            ..Opts::default()
        },
    );
}

#[test]
fn finish_row_matches_reference_documents() {
    check_case(
        "documents",
        3,
        &Opts {
            docs: true,
            ..Opts::default()
        },
    );
    check_case(
        "documents, 2 sink tokens, bidirectional",
        4,
        &Opts {
            docs: true,
            causal: false,
            sink_tokens: 2,
            ..Opts::default()
        },
    );
}

#[test]
fn finish_row_matches_reference_sinks_and_softcap() {
    check_case(
        "learned sinks",
        5,
        &Opts {
            sinks: true,
            ..Opts::default()
        },
    );
    check_case(
        "softcap",
        6,
        &Opts {
            softcap: Some(3.0),
            amp: 4.0,
            ..Opts::default()
        },
    );
    check_case(
        "documents + sinks + softcap + MQA",
        7,
        &Opts {
            docs: true,
            sinks: true,
            softcap: Some(5.0),
            heads_kv: 1,
            amp: 3.0,
            ..Opts::default()
        },
    );
    check_case(
        "large logits",
        8,
        &Opts {
            sinks: true,
            amp: 12.0,
            ..Opts::default()
        },
    );
}

#[test]
fn padding_rows_are_not_valid() {
    let p = problem(
        9,
        &Opts {
            docs: true,
            ..Opts::default()
        },
    );
    let r = reference_summary(&p.input(), 0, 0).expect("reference");
    // Two padding queries per batch row attend nothing.
    let want = (p.batch * (p.q_len - 2)) as u64;
    for h in &r.summary.heads {
        assert_eq!(h.valid_rows, want);
    }
    // And their O rows are zero, LSE -inf.
    let row = p.q_len - 1;
    assert_eq!(r.lse[row], f64::NEG_INFINITY);
    assert!(r.o[row * p.d_v..(row + 1) * p.d_v]
        .iter()
        .all(|&x| x == 0.0));
}

/// Q = K = a large vector only at key 0: every row puts ≈ all its mass on the first key.
#[test]
fn huge_first_key_gives_sink_mass_one() {
    let mut p = problem(10, &Opts::default());
    let d = p.d_qk;
    for x in p.q.iter_mut() {
        *x = 0.0;
    }
    for x in p.k.iter_mut() {
        *x = 0.0;
    }
    for row in p.q.chunks_mut(d) {
        row[0] = 10.0;
    }
    for (r, row) in p.k.chunks_mut(d).enumerate() {
        if r % p.kv_len == 0 {
            row[0] = 10.0;
        }
    }
    let reference = reference_summary(&p.input(), 0, 0).expect("reference");
    let got = summary_via_rows(&p, Online::Tiles(4), 0..p.batch);
    got.check_close(&reference.summary, RTOL, ATOL)
        .expect("close");
    let rec = got.record(&TelemetryConfig::every(1));
    for m in rec.sink_mass.expect("sink stream").into_iter() {
        let m = m.expect("defined");
        assert!((m - 1.0).abs() < 1e-9, "sink mass {m}");
    }
    assert_eq!(rec.sink_rate, Some(1.0));
    for e in rec.entropy.expect("entropy").into_iter() {
        assert!(e.expect("defined") < 1e-9);
    }
    let big = 100.0 / (d as f64).sqrt();
    for m in rec.max_logit {
        assert!((m.expect("defined") - big).abs() < 1e-12);
    }
}

/// All logits equal: entropy = ln(number of allowed keys), +1 outcome with a sink of the same
/// logit; sink mass = 1/n.
#[test]
fn identical_logits_entropy_is_ln_n() {
    for (causal, sinks) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut p = problem(
            11,
            &Opts {
                causal,
                sinks,
                ..Opts::default()
            },
        );
        for x in p.q.iter_mut() {
            *x = 0.0;
        }
        if let Some(s) = p.sinks.as_mut() {
            s.fill(0.0);
        }
        let n = p.kv_len;
        let extra = usize::from(sinks);
        let expect_entropy = if causal {
            (1..=n).map(|k| ((k + extra) as f64).ln()).sum::<f64>() / n as f64
        } else {
            ((n + extra) as f64).ln()
        };
        let expect_sink = if causal {
            (1..=n).map(|k| 1.0 / (k + extra) as f64).sum::<f64>() / n as f64
        } else {
            1.0 / (n + extra) as f64
        };
        let reference = reference_summary(&p.input(), 0, 0).expect("reference");
        for how in [Online::Direct, Online::Tiles(3)] {
            let got = summary_via_rows(&p, how, 0..p.batch);
            got.check_close(&reference.summary, RTOL, ATOL)
                .expect("close");
            let rec = got.record(&TelemetryConfig::every(1));
            for e in rec.entropy.expect("entropy") {
                let e = e.expect("defined");
                assert!(
                    (e - expect_entropy).abs() < 1e-12,
                    "{e} vs {expect_entropy}"
                );
            }
            for m in rec.sink_mass.expect("sink") {
                let m = m.expect("defined");
                assert!((m - expect_sink).abs() < 1e-12, "{m} vs {expect_sink}");
            }
            assert_eq!(rec.learned_sink_mass.is_some(), sinks);
        }
    }
}

#[test]
fn row_finish_direct_formulas() {
    // Two keys with logits 0 and ln 3, a sink at ln 2 (both keys are sink keys in turn).
    let s = [(0.0f64, true), (3f64.ln(), false)];
    let sigma = 2f64.ln();
    let mut r = RowSums::EMPTY;
    for &(x, sink) in &s {
        r.push_logit(x, sink);
    }
    let st = r.finish(Some(sigma)).expect("valid");
    // Z = 1 + 3 + 2 = 6.
    let p: [f64; 3] = [1.0 / 6.0, 3.0 / 6.0, 2.0 / 6.0];
    let h: f64 = -p.iter().map(|x| x * x.ln()).sum::<f64>();
    assert!((st.lse - 6f64.ln()).abs() < 1e-15);
    assert!((st.sink_mass - p[0]).abs() < 1e-15);
    assert!((st.learned_sink_mass - p[2]).abs() < 1e-15);
    assert!((st.entropy - h).abs() < 1e-15);
    // Without the sink.
    let st = r.finish(None).expect("valid");
    assert!((st.entropy - -(0.25f64 * 0.25f64.ln() + 0.75 * 0.75f64.ln())).abs() < 1e-15);
    // An empty row is skipped.
    assert!(RowSums::EMPTY.finish(Some(0.0)).is_none());
    let mut acc = HeadAccum::default();
    finish_row(&mut acc, &RowSums::EMPTY, None);
    assert_eq!(acc.valid_rows, 0);
    // A sink far above the keys: w underflows, no NaN.
    let mut r = RowSums::EMPTY;
    r.push_logit(0.0, true);
    let st = r.finish(Some(2000.0)).expect("valid");
    assert!(st.entropy.is_finite() && st.sink_mass == 0.0 && st.learned_sink_mass == 1.0);
}

fn f32_tensor(shape: Vec<usize>, data: &[f64]) -> Tensor {
    Tensor::from_f32(shape, data.iter().map(|&x| x as f32).collect()).expect("tensor")
}

/// Summaries of batch shards, merged in any grouping, equal the whole-batch summary exactly.
#[test]
fn batch_shards_merge_exactly() {
    let p = problem(
        12,
        &Opts {
            batch: 5,
            docs: true,
            sinks: true,
            softcap: Some(4.0),
            ..Opts::default()
        },
    );
    let whole = summary_via_rows(&p, Online::Tiles(4), 0..5);
    let shards = [0..2, 2..3, 3..5];
    let parts: Vec<AttnSummary> = shards
        .iter()
        .map(|r| summary_via_rows(&p, Online::Tiles(4), r.clone()))
        .collect();
    let mut a = parts[0].clone();
    a.merge(&parts[1]).expect("merge");
    a.merge(&parts[2]).expect("merge");
    let mut b = parts[2].clone();
    let mut bc = parts[1].clone();
    bc.merge(&parts[0]).expect("merge");
    b.merge(&bc).expect("merge");
    assert_eq!(a, whole);
    assert_eq!(b, whole);
    let cfg = TelemetryConfig::every(1);
    let (ra, rw) = (a.record(&cfg), whole.record(&cfg));
    assert_eq!(ra, rw);
    // Bit-identical readout, not just close.
    let bits = |r: &TelemetryRecord| -> Vec<u64> {
        r.sink_mass
            .iter()
            .chain(r.entropy.iter())
            .chain(r.out_rms.iter())
            .flatten()
            .map(|x| x.map_or(0, f64::to_bits))
            .collect()
    };
    assert_eq!(bits(&ra), bits(&rw));
    assert!(rw.out_outliers.expect("outliers").iter().any(|&c| c > 0));

    // The outlier stream over an f32 O tensor, whole vs shards, through add_output.
    let r = reference_summary(&p.input(), 7, 3).expect("reference");
    let per_b = p.heads_q * p.q_len * p.d_v;
    let shape = |nb: usize| vec![nb, p.heads_q, p.q_len, p.d_v];
    let mut whole_o = AttnSummary::new(7, 3, p.heads_q, true);
    whole_o
        .add_output(&f32_tensor(shape(5), &r.o).view(), 1.5)
        .expect("add_output");
    let mut sharded = AttnSummary::new(7, 3, p.heads_q, true);
    for rg in [3..5, 0..1, 1..3] {
        let mut s = AttnSummary::new(7, 3, p.heads_q, true);
        let t = f32_tensor(shape(rg.len()), &r.o[rg.start * per_b..rg.end * per_b]);
        s.add_output(&t.view(), 1.5).expect("add_output");
        sharded.merge(&s).expect("merge");
    }
    assert_eq!(sharded, whole_o);
}

#[test]
fn merge_rejects_mismatches() {
    let mut a = AttnSummary::new(1, 0, 4, false);
    assert!(a.merge(&AttnSummary::new(1, 0, 3, false)).is_err());
    assert!(a.merge(&AttnSummary::new(2, 0, 4, false)).is_err());
    assert!(a.merge(&AttnSummary::new(1, 1, 4, false)).is_err());
    assert!(a.merge(&AttnSummary::new(1, 0, 4, true)).is_err());
    assert!(a.merge(&AttnSummary::new(1, 0, 4, false)).is_ok());
}

#[test]
fn max_logit_from_kernel_output() {
    let mut s = AttnSummary::new(0, 0, 3, false);
    let t = Tensor::from_f32(
        vec![2, 3],
        vec![1.0, f32::NEG_INFINITY, -2.0, 0.5, f32::NEG_INFINITY, 4.0],
    )
    .expect("tensor");
    s.absorb_max_logit(&t.view()).expect("absorb");
    let rec = s.record(&TelemetryConfig::every(1));
    assert_eq!(rec.max_logit, vec![Some(1.0), None, Some(4.0)]);
    let bad = Tensor::from_f32(vec![3, 2], vec![0.0; 6]).expect("tensor");
    assert!(s.absorb_max_logit(&bad.view()).is_err());
    let o = Tensor::from_f32(vec![1, 2, 1, 1], vec![0.0; 2]).expect("tensor");
    assert!(s.add_output(&o.view(), 6.0).is_err());
}

#[test]
fn record_streams_and_sink_rate() {
    let mut s = AttnSummary::new(5, 2, 3, false);
    let row = |m: f64| RowStats {
        sink_mass: m,
        learned_sink_mass: 0.0,
        entropy: 1.0,
        lse: 0.0,
    };
    s.heads[0].add_row(&row(0.5));
    s.heads[0].add_row(&row(0.3));
    s.heads[1].add_row(&row(0.1));
    // head 2 has no valid rows.
    let cfg = TelemetryConfig::every(1);
    let rec = s.record(&cfg);
    assert_eq!(rec.sink_mass, Some(vec![Some(0.4), Some(0.1), None]));
    assert_eq!(rec.sink_rate, Some(0.5));
    assert_eq!(rec.valid_rows, Some(vec![2, 1, 0]));
    assert_eq!(rec.learned_sink_mass, None);
    assert_eq!(rec.out_abs_max, Some(vec![None, None, None]));
    assert_eq!(rec.out_outliers, Some(vec![0, 0, 0]));
    let off = TelemetryConfig {
        streams: Streams {
            sink: false,
            outlier: false,
        },
        ..cfg
    };
    let rec = s.record(&off);
    assert!(rec.sink_mass.is_none() && rec.sink_rate.is_none() && rec.entropy.is_none());
    assert!(rec.out_rms.is_none() && rec.out_outliers.is_none());
    assert_eq!(rec.max_logit.len(), 3);
}

#[test]
fn reference_rejects_bad_input() {
    let p = problem(13, &Opts::default());
    let mut i = p.input();
    i.q = &p.q[1..];
    assert!(reference_summary(&i, 0, 0).is_err());
    let mut i = p.input();
    i.heads_kv = 3;
    assert!(reference_summary(&i, 0, 0).is_err());
    let mut i = p.input();
    i.softcap = Some(0.0);
    assert!(reference_summary(&i, 0, 0).is_err());
    let mut i = p.input();
    i.sink_flags = &p.sink_flags[1..];
    assert!(reference_summary(&i, 0, 0).is_err());
    let mut i = p.input();
    i.outlier_ratio = -1.0;
    assert!(reference_summary(&i, 0, 0).is_err());
}
