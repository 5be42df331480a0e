//! End-to-end tests of `tessera attend`, `tessera pack` and `tessera plan --export` through the
//! built binary: results against the float64 reference, and bad input giving exit code 2.

mod common;

use common::{bad, ok, save, values};
use std::path::Path;
use tessera::attn::AttnOptions;
use tessera::conformance::reference;
use tessera::core::{Tensor, TensorData};
use tessera::mask::{Mask, SegmentIds, Segments};

fn load(dir: &Path, name: &str) -> Vec<f32> {
    tessera::io::read_tensor(dir.join(name).to_str().unwrap(), None)
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

fn rel(x: &[f32], r: &[f64]) -> f64 {
    let num: f64 = x.iter().zip(r).map(|(&a, &b)| (a as f64 - b).powi(2)).sum();
    let den: f64 = r.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

#[test]
fn attend_matches_the_reference_with_gradients() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let (b, hq, hkv, l, dqk, dv) = (2usize, 4usize, 2usize, 70usize, 24usize, 16usize);
    let q = Tensor::from_f32(vec![b, hq, l, dqk], values(b * hq * l * dqk, 1)).unwrap();
    let k = Tensor::from_f32(vec![b, hkv, l, dqk], values(b * hkv * l * dqk, 2)).unwrap();
    let v = Tensor::from_f32(vec![b, hkv, l, dv], values(b * hkv * l * dv, 3)).unwrap();
    let g = Tensor::from_f32(vec![b, hq, l, dv], values(b * hq * l * dv, 4)).unwrap();
    let sinks = Tensor::from_f32(vec![hq], vec![0.5, -1.0, 0.0, 2.0]).unwrap();
    let ids: Vec<i64> = (0..b)
        .flat_map(|r| {
            (0..l).map(move |i| {
                if i >= 64 {
                    -1
                } else {
                    (i / (20 + 7 * r)) as i64
                }
            })
        })
        .collect();
    let segs = Tensor::new(vec![b, l], TensorData::I64(ids.clone())).unwrap();
    // Q and K in one safetensors file, selected with FILE:TENSOR.
    let qk = p.join("qk.safetensors");
    tessera::io::write_safetensors(&qk, &[("q", &q), ("k", &k)]).unwrap();
    let qk = qk.to_string_lossy();
    let (vf, gf, sf, segf) = (
        save(p, "v.npy", &v),
        save(p, "g.npy", &g),
        save(p, "s.npy", &sinks),
        save(p, "seg.npy", &segs),
    );
    ok(
        &[
            "attend",
            "--q",
            &format!("{qk}:q"),
            "--k",
            &format!("{qk}:k"),
            "--v",
            &vf,
            "--mask",
            "causal & document",
            "--segments",
            &segf,
            "--tile",
            "16x32",
            "--softcap",
            "5",
            "--sinks",
            &sf,
            "--out",
            "o.npy",
            "--lse",
            "lse.npy",
            "--max-logit",
            "ml.npy",
            "--grad-out",
            &gf,
            "--dq",
            "dq.npy",
            "--dk",
            "dk.npy",
            "--dv",
            "dv.npy",
            "--dsinks",
            "ds.npy",
        ],
        p,
    );
    let mask =
        Mask::causal() & Mask::document(Segments::shared(SegmentIds::new(b, l, ids).unwrap()));
    let opts = AttnOptions {
        scale: None,
        softcap: Some(5.0),
        sinks: Some(vec![0.5, -1.0, 0.0, 2.0]),
    };
    let f = reference::forward(q.view(), k.view(), v.view(), &mask, &opts).unwrap();
    let bw = reference::backward(q.view(), k.view(), v.view(), g.view(), &mask, &opts).unwrap();
    assert!(rel(&load(p, "o.npy"), &f.o) < 1e-5);
    for (x, r) in load(p, "lse.npy").iter().zip(&f.lse) {
        assert!((*x as f64 - r).abs() < 1e-4, "{x} vs {r}");
    }
    for (x, r) in load(p, "ml.npy").iter().zip(&f.max_logit) {
        assert!((*x as f64 - r).abs() < 1e-4, "{x} vs {r}");
    }
    assert!(rel(&load(p, "dq.npy"), &bw.dq) < 1e-5);
    assert!(rel(&load(p, "dk.npy"), &bw.dk) < 1e-5);
    assert!(rel(&load(p, "dv.npy"), &bw.dv) < 1e-5);
    assert!(rel(&load(p, "ds.npy"), bw.dsinks.as_ref().unwrap()) < 1e-4);
}

#[test]
fn attend_bad_inputs_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let t = |shape: Vec<usize>, seed| {
        Tensor::from_f32(shape.clone(), values(shape.iter().product(), seed)).unwrap()
    };
    let q = save(p, "q.npy", &t(vec![1, 3, 8, 4], 1));
    let k = save(p, "k.npy", &t(vec![1, 2, 8, 4], 2));
    let k1 = save(p, "k1.npy", &t(vec![1, 1, 8, 4], 2));
    let v1 = save(p, "v1.npy", &t(vec![1, 1, 8, 4], 3));
    let k3 = save(p, "k3.npy", &t(vec![1, 8, 4], 2));
    let kbf = save(
        p,
        "kbf.npy",
        &Tensor::from_bf16(vec![1, 1, 8, 4], vec![half::bf16::ONE; 32]).unwrap(),
    );
    let s2 = save(p, "s2.npy", &t(vec![2], 4));
    let base = ["attend", "--q", &q, "--mask", "causal", "--out", "o.npy"];
    let run = |extra: &[&str], needle: &str| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        bad(&a, p, needle);
    };
    run(&["--k", &k, "--v", &k], "3");
    run(&["--k", &k3, "--v", &v1], "rank");
    run(&["--k", &kbf, "--v", &v1], "dtype");
    run(&["--k", &k1, "--v", &v1, "--scale=inf"], "scale");
    run(&["--k", &k1, "--v", &v1, "--softcap=-1"], "softcap");
    run(&["--k", &k1, "--v", &v1, "--sinks", &s2], "sinks");
    run(&["--k", &k1, "--v", "missing.npy"], "missing.npy");
    run(&["--k", &k1, "--v", &v1, "--grad-out", &q], "--dq");
    bad(
        &[
            "attend", "--q", &q, "--k", &k1, "--v", &v1, "--mask", "causal",
        ],
        p,
        "--out",
    );
}

#[test]
fn pack_then_plan_and_export() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let mut jsonl = String::new();
    for n in [5usize, 40, 13, 70, 1, 22, 9] {
        jsonl.push_str(&format!(
            "{{\"tokens\": {:?}}}\n",
            (1..=n).collect::<Vec<_>>()
        ));
    }
    std::fs::write(p.join("docs.jsonl"), jsonl).unwrap();
    let stats = ok(
        &[
            "pack",
            "--input",
            "docs.jsonl",
            "--seq-len",
            "32",
            "--out",
            "rows.safetensors",
            "--json",
        ],
        p,
    );
    let v: serde_json::Value = serde_json::from_str(stats.trim()).unwrap();
    let rows = v["rows"].as_u64().unwrap();
    ok(&["pack", "--verify", "rows.safetensors"], p);
    let out = ok(
        &[
            "plan",
            "--mask",
            "causal & document",
            "--q-len",
            "32",
            "--batch",
            &rows.to_string(),
            "--segments",
            "rows.safetensors:segment_ids",
            "--tile",
            "16",
            "--json",
            "--export",
            "flex",
            "f.npz",
            "--export",
            "splash",
            "s.npz",
        ],
        p,
    );
    assert!(out.contains("\"q_tiles\":2"), "{out}");
    for f in ["f.npz", "s.npz"] {
        let bytes = std::fs::read(p.join(f)).unwrap();
        assert_eq!(&bytes[..2], b"PK", "{f} is a zip archive");
    }
    // Bad packing input: malformed JSON names its line, row length 0, offsets not monotone.
    std::fs::write(p.join("bad.jsonl"), "{\"tokens\": [1]}\n{\"tokens\": [1,\n").unwrap();
    bad(
        &[
            "pack",
            "--input",
            "bad.jsonl",
            "--seq-len",
            "8",
            "--out",
            "x.safetensors",
        ],
        p,
        "line 2",
    );
    assert!(!p.join("x.safetensors").exists(), "no partial output");
    bad(
        &[
            "pack",
            "--input",
            "docs.jsonl",
            "--seq-len",
            "0",
            "--out",
            "x.safetensors",
        ],
        p,
        "seq-len",
    );
    let toks = save(
        p,
        "t.npy",
        &Tensor::new(vec![6], TensorData::I32(vec![1, 2, 3, 4, 5, 6])).unwrap(),
    );
    let offs = save(
        p,
        "o.npy",
        &Tensor::new(vec![3], TensorData::I64(vec![0, 4, 2])).unwrap(),
    );
    bad(
        &[
            "pack",
            "--input",
            &toks,
            "--offsets",
            &offs,
            "--seq-len",
            "8",
            "--out",
            "x.safetensors",
        ],
        p,
        "offsets",
    );
    bad(
        &[
            "plan", "--mask", "causal", "--q-len", "8", "--export", "jax", "x.npz",
        ],
        p,
        "splash or flex",
    );
}
