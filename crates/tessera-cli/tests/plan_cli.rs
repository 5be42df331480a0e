//! End-to-end tests of `tessera plan` and `tessera demo` through the built binary.

mod common;

use common::{bad, tessera};
use std::path::Path;
use tessera::core::{Tensor, TensorData};

fn write(dir: &Path, name: &str, shape: Vec<usize>, data: TensorData) -> String {
    let p = dir.join(name);
    tessera::io::write_tensor(&p, &Tensor::new(shape, data).unwrap()).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn demo_runs_and_writes_its_picture() {
    let d = tempfile::tempdir().unwrap();
    let out = tessera(&["demo", "--seq-len", "4096"], d.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("partial"), "{text}");
    let png = image::open(d.path().join("tessera-demo/plan.png")).unwrap();
    assert!(png.width() > 200 && png.height() > 200);
}

#[test]
fn plan_json_states_and_png() {
    let d = tempfile::tempdir().unwrap();
    let ids: Vec<i64> = (0..2)
        .flat_map(|b| (0..300).map(move |i| if i >= 290 { -1 } else { i / (40 + 30 * b) }))
        .collect();
    let segs = write(d.path(), "segs.npy", vec![2, 300], TensorData::I64(ids));
    let out = tessera(
        &[
            "plan",
            "--mask",
            "causal & document",
            "--q-len",
            "300",
            "--batch",
            "2",
            "--heads",
            "3",
            "--segments",
            &segs,
            "--tile",
            "32x64",
            "--json",
            "--dump-states",
            "s.npy",
            "--png",
            "p.png",
        ],
        d.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["q_tiles"], 10);
    assert_eq!(v["kv_tiles"], 5);
    assert_eq!(v["groups"], serde_json::json!([2, 1]));
    let states = tessera::io::read_tensor(d.path().join("s.npy").to_str().unwrap(), None).unwrap();
    assert_eq!(states.shape(), &[2, 1, 10, 5]);
    let TensorData::I8(s) = states.data() else {
        panic!("dtype {}", states.dtype())
    };
    // Upper triangle is empty, a diagonal tile partial, and only 0/1/2 appear.
    assert_eq!(s[4], 0);
    assert_eq!(s[0], 1);
    assert!(s.iter().all(|&x| (0..=2).contains(&x)));
    let total = v["empty_tiles"].as_u64().unwrap()
        + v["partial_tiles"].as_u64().unwrap()
        + v["full_tiles"].as_u64().unwrap();
    assert_eq!(total, 100);
    assert!(image::open(d.path().join("p.png")).is_ok());
}

/// `band(F, G, LO, HI)` with features read from `.npy` files (`[B, L]` int32 and `[L]` int64):
/// the dumped states equal those of the same mask planned through the library, and a band over
/// positions dumps causal's states.
#[test]
fn band_features_from_npy_files() {
    use tessera::mask::{BandFeatures, Mask, SegmentIds};
    use tessera::plan::{build_plan, PlanShape, TileShape};
    let d = tempfile::tempdir().unwrap();
    let (lq, lkv) = (200usize, 150usize);
    // Per-row "time stamps" that repeat and jump; keys are positions.
    let f: Vec<i32> = (0..2)
        .flat_map(|b| (0..lq as i32).map(move |i| (i * (2 + b)) / 3 + (i % 7 == 0) as i32))
        .collect();
    let g: Vec<i64> = (0..lkv as i64).collect();
    write(d.path(), "f.npy", vec![2, lq], TensorData::I32(f.clone()));
    write(d.path(), "g.npy", vec![lkv], TensorData::I64(g.clone()));
    let dump = |mask: &str, kv: usize, out: &str| -> Vec<i8> {
        let o = tessera(
            &[
                "plan",
                "--mask",
                mask,
                "--q-len",
                &lq.to_string(),
                "--kv-len",
                &kv.to_string(),
                "--batch",
                "2",
                "--tile",
                "16x32",
                "--dump-states",
                out,
            ],
            d.path(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let t = tessera::io::read_tensor(d.path().join(out).to_str().unwrap(), None).unwrap();
        match t.data() {
            TensorData::I8(s) => s.clone(),
            _ => panic!("dtype {}", t.dtype()),
        }
    };
    let got = dump(
        "band(f.npy, g.npy, -3, 20) & !causal(offset=-40)",
        lkv,
        "band.npy",
    );
    let f64s: Vec<i64> = f.iter().map(|&v| v as i64).collect();
    let feats = BandFeatures::new(
        "f.npy",
        SegmentIds::new(2, lq, f64s).unwrap(),
        "g.npy",
        SegmentIds::shared(g).unwrap(),
    );
    let mask = Mask::band(feats, -3, 20) & !Mask::causal_offset(-40);
    let shape = PlanShape::new(2, 1, lq, lkv).unwrap();
    let plan = build_plan(&mask, shape, TileShape::new(16, 32).unwrap()).unwrap();
    assert_eq!(got, plan.states().1);
    assert!(got.contains(&1) && got.contains(&0));
    // Positions on both sides, from 0 up: causal.
    write(
        d.path(),
        "pos.npy",
        vec![lq],
        TensorData::I64((0..lq as i64).collect()),
    );
    let band = dump(
        "band(pos.npy, pos.npy, 0, 9223372036854775807)",
        lq,
        "b.npy",
    );
    assert_eq!(band, dump("causal", lq, "c.npy"));
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let segs10 = write(p, "segs10.npy", vec![10], TensorData::I32(vec![0; 10]));
    let dense_bad_shape = write(p, "d1.npy", vec![4, 5], TensorData::Bool(vec![true; 20]));
    let dense_f32 = write(p, "d2.npy", vec![8, 8], TensorData::F32(vec![1.0; 64]));
    std::fs::write(p.join("garbage.npy"), b"not an npy file at all").unwrap();
    bad(
        &["plan", "--mask", "causal & wndow(3)", "--q-len", "8"],
        p,
        "column 10",
    );
    bad(
        &["plan", "--mask", "causal & wndow(3)", "--q-len", "8"],
        p,
        "unknown leaf",
    );
    bad(
        &["plan", "--mask", "causal & (full", "--q-len", "8"],
        p,
        "expected ')'",
    );
    bad(
        &[
            "plan", "--mask", "causal", "--q-len", "8", "--tile", "24x16",
        ],
        p,
        "tile",
    );
    bad(
        &["plan", "--mask", "causal", "--q-len", "8", "--tile", "big"],
        p,
        "tile",
    );
    bad(&["plan", "--mask", "causal", "--q-len", "0"], p, "q-len");
    bad(
        &[
            "plan",
            "--mask",
            "document",
            "--q-len",
            "12",
            "--segments",
            &segs10,
        ],
        p,
        "length 12",
    );
    bad(
        &["plan", "--mask", "document", "--q-len", "10"],
        p,
        "--segments",
    );
    bad(
        &[
            "plan",
            "--mask",
            &format!("dense({dense_bad_shape})"),
            "--q-len",
            "8",
        ],
        p,
        "[.., 8, 8]",
    );
    bad(
        &[
            "plan",
            "--mask",
            &format!("dense({dense_f32})"),
            "--q-len",
            "8",
        ],
        p,
        "bool or uint8",
    );
    bad(
        &["plan", "--mask", "dense(missing.npy)", "--q-len", "8"],
        p,
        "missing.npy",
    );
    bad(
        &["plan", "--mask", "dense(garbage.npy)", "--q-len", "8"],
        p,
        "garbage.npy",
    );
    bad(
        &[
            "plan",
            "--mask",
            "heads(causal, full)",
            "--q-len",
            "8",
            "--heads",
            "3",
        ],
        p,
        "3 expressions",
    );
    bad(&["plan", "--mask", "causal"], p, "--q-len");
    bad(
        &["plan", "--mask", "chunk(0)", "--q-len", "8"],
        p,
        "column 7",
    );
}

/// `blocks(QB, KVB, FILE)`: a block selection from an integer `.npy` (docs/semantics.md#masks), intersected
/// with causal; the dumped states equal brute force over the selected tiles.
#[test]
fn plan_of_a_block_selection_file() {
    let d = tempfile::tempdir().unwrap();
    let (lq, t, k) = (300usize, 64usize, 3usize);
    let tq = lq.div_ceil(t);
    // Per head and query block: 3 entries (a duplicate and -1 padding among them).
    let sel: Vec<i32> = (0..2 * tq)
        .flat_map(|r| {
            let (h, q) = (r / tq, (r % tq) as i32);
            [q, (q + h as i32) % (q + 1), if q % 2 == 0 { -1 } else { q }]
        })
        .collect();
    let path = write(
        d.path(),
        "sel.npy",
        vec![1, 2, tq, k],
        TensorData::I32(sel.clone()),
    );
    let mask = format!("causal & blocks({t}, {t}, {path})");
    let q_len = lq.to_string();
    let args = [
        "plan",
        "--mask",
        &mask,
        "--q-len",
        &q_len,
        "--heads",
        "2",
        "--tile",
        "64x64",
        "--json",
        "--dump-states",
        "s.npy",
    ];
    let out = common::ok(&args, d.path());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["groups"], serde_json::json!([1, 2]));
    let states = tessera::io::read_tensor(d.path().join("s.npy").to_str().unwrap(), None).unwrap();
    let TensorData::I8(s) = states.data() else {
        panic!("dtype {}", states.dtype())
    };
    for h in 0..2 {
        for qt in 0..tq {
            let row = &sel[(h * tq + qt) * k..(h * tq + qt + 1) * k];
            for kt in 0..tq {
                let chosen = row.contains(&(kt as i32));
                // Causal in 64x64 tiles: below the diagonal full, on it partial.
                let want = match (chosen, kt.cmp(&qt)) {
                    (false, _) | (_, std::cmp::Ordering::Greater) => 0,
                    (true, std::cmp::Ordering::Equal) => 1,
                    (true, std::cmp::Ordering::Less) => 2,
                };
                assert_eq!(s[(h * tq + qt) * tq + kt], want, "h={h} tile ({qt}, {kt})");
            }
        }
    }
    // Bad selections: one line, exit 2, naming the file.
    let p = d.path();
    let far = write(p, "far.npy", vec![tq, 1], TensorData::I64(vec![9; tq]));
    let f32s = write(p, "f.npy", vec![tq, 1], TensorData::F32(vec![0.0; tq]));
    let short = write(
        p,
        "short.npy",
        vec![tq - 1, 1],
        TensorData::I64(vec![0; tq - 1]),
    );
    let flat = write(p, "flat.npy", vec![tq], TensorData::I64(vec![0; tq]));
    for (file, needle) in [
        (far.as_str(), "entries in [-1, 5)"),
        (&f32s, "an integer array"),
        (&short, "5 query blocks"),
        (&flat, "[B, H, Tq, k]"),
        ("missing.npy", "missing.npy"),
    ] {
        let mask = format!("blocks(64, 64, {file})");
        bad(&["plan", "--mask", &mask, "--q-len", "300"], p, needle);
    }
    bad(
        &["plan", "--mask", "blocks(0, 64, x.npy)", "--q-len", "300"],
        p,
        "a block size >= 1",
    );
}
