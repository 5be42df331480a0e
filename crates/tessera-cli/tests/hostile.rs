//! Hostile input through the binary: deep nesting, garbage, integer overflow in
//! shapes and flags, truncated and mismatched tensors, bad safetensors, corrupted caches, bad
//! output paths, bad pack and telemetry input, over-budget sizes. Every case exits 2 with
//! exactly one line on stderr naming the input (or 0 where the input is valid), never panics,
//! and leaves the directory exactly as it was (no partial output, no temporary file).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tessera::core::{Tensor, TensorData};
use tessera::io::{NpyArray, NpyDType};

/// Runs `tessera ARGS` in `dir` with extra environment variables.
fn run(args: &[String], dir: &Path, env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(args)
        .current_dir(dir)
        .env_remove("TESSERA_MEMORY_BUDGET");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run tessera")
}

/// Every file under `dir`, recursively (relative paths).
fn listing(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            out.insert(p.strip_prefix(dir).expect("under dir").to_path_buf());
        }
    }
    out
}

struct Case {
    args: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
    /// Exit code wanted: 2 (bad input) or 0 (valid input).
    code: i32,
    /// Text the stderr line must contain (for code 2).
    needle: &'static str,
}

fn case(args: &[&str], needle: &'static str) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
        code: 2,
        needle,
    }
}

fn valid(args: &[&str]) -> Case {
    Case {
        code: 0,
        ..case(args, "")
    }
}

fn with_env(mut c: Case, env: &[(&'static str, &'static str)]) -> Case {
    c.env = env.to_vec();
    c
}

/// Checks one case in `dir`: exit code, one stderr line, no panic; a failure writes nothing.
fn check(c: &Case, dir: &Path) {
    let before = listing(dir);
    let mut args = c.args.clone();
    args.push("--no-cache".into());
    let out = run(&args, dir, &c.env);
    let err = String::from_utf8_lossy(&out.stderr);
    let shown: Vec<String> = args.iter().map(|a| a.chars().take(60).collect()).collect();
    assert_eq!(out.status.code(), Some(c.code), "{shown:?}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("internal error"),
        "{shown:?}: {err}"
    );
    if c.code == 2 {
        assert_eq!(err.trim_end().lines().count(), 1, "{shown:?}: {err}");
        assert!(
            err.contains(c.needle),
            "{shown:?}: expected {:?} in {err}",
            c.needle
        );
        assert_eq!(listing(dir), before, "{shown:?} left files behind");
    }
}

fn npy_bytes(a: &NpyArray) -> Vec<u8> {
    a.to_npy()
}

fn f32_tensor(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::new(shape.to_vec(), TensorData::F32(common::values(n, seed))).unwrap()
}

/// Writes the input files every case reads.
fn inputs(dir: &Path) {
    let w = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
    common::save(dir, "q.npy", &f32_tensor(&[1, 2, 40, 8], 1));
    common::save(dir, "k.npy", &f32_tensor(&[1, 1, 40, 8], 2));
    common::save(dir, "v.npy", &f32_tensor(&[1, 1, 40, 8], 3));
    common::save(dir, "k_d4.npy", &f32_tensor(&[1, 1, 40, 4], 4));
    common::save(dir, "v_len30.npy", &f32_tensor(&[1, 1, 30, 8], 5));
    common::save(dir, "k3.npy", &f32_tensor(&[2, 40, 8], 6));
    common::save(dir, "k_h3.npy", &f32_tensor(&[1, 3, 40, 8], 7));
    common::save(dir, "qkv.safetensors", &f32_tensor(&[1, 2, 40, 8], 8));
    let q = std::fs::read(dir.join("q.npy")).unwrap();
    w("q_trunc.npy", &q[..q.len() - 7]);
    w("q_header_only.npy", &q[..80]);
    w("garbage.npy", b"this is not an array at all, just text\n");
    w("empty.npy", b"");
    // Headers declaring far more data than the file holds, and shapes that overflow.
    let header = |descr: &str, shape: &str| header_with(descr, "False", shape);
    fn header_with(descr: &str, fortran: &str, shape: &str) -> Vec<u8> {
        let mut h =
            format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b
    }
    let mut huge = header("<f4", "(1099511627776,)");
    huge.extend_from_slice(&[0u8; 64]);
    w("huge_shape.npy", &huge);
    let mut overflow = header("<f4", "(4294967296, 4294967296, 4294967296)");
    overflow.extend_from_slice(&[0u8; 16]);
    w("overflow_shape.npy", &overflow);
    let mut fortran = header_with("<f4", "True", "(2, 2)");
    fortran.extend_from_slice(&[0u8; 16]);
    w("fortran.npy", &fortran);
    let mut big_endian = header(">f4", "(1, 2, 40, 8)");
    big_endian.extend_from_slice(&vec![0u8; 640 * 4]);
    w("big_endian.npy", &big_endian);
    // Safetensors: garbage, an absurd header length, a header pointing past the data.
    w("garbage.safetensors", b"\x01\x02\x03");
    let mut absurd = u64::MAX.to_le_bytes().to_vec();
    absurd.extend_from_slice(b"{}");
    w("absurd.safetensors", &absurd);
    let json = br#"{"t":{"dtype":"F32","shape":[1,2,40,8],"data_offsets":[0,999999]}}"#;
    let mut oob = (json.len() as u64).to_le_bytes().to_vec();
    oob.extend_from_slice(json);
    oob.extend_from_slice(&[0u8; 32]);
    w("oob.safetensors", &oob);
    let json = br#"{"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#;
    let mut ovf = (json.len() as u64).to_le_bytes().to_vec();
    ovf.extend_from_slice(json);
    w("overflow.safetensors", &ovf);
    // Segment ids.
    let seg = NpyArray::from_ints(NpyDType::I64, vec![40], (0..40i32).map(|i| i as i64 / 10));
    w("seg.npy", &npy_bytes(&seg));
    let seg_short = NpyArray::from_ints(NpyDType::I64, vec![33], (0..33i32).map(|i| i as i64 / 10));
    w("seg33.npy", &npy_bytes(&seg_short));
    // Band features of the wrong dtype or rank.
    let feat = |dt: NpyDType, shape: Vec<usize>| {
        npy_bytes(&NpyArray::from_ints(
            dt,
            shape,
            (0..40i32).map(|i| i as i64 % 2),
        ))
    };
    w("feat_f32.npy", &feat(NpyDType::F32, vec![40]));
    w("feat_3d.npy", &feat(NpyDType::I64, vec![1, 1, 40]));
    w(
        "feat_bool.npy",
        &npy_bytes(&NpyArray::from_bools(vec![40], &[true; 40])),
    );
    // Pack inputs.
    w(
        "docs.jsonl",
        b"{\"text\": \"hello\"}\n{\"tokens\": [1, 2, 3]}\n",
    );
    w(
        "bad_json.jsonl",
        b"{\"text\": \"ok\"}\n{\"tokens\": [1, 2,\n",
    );
    w("neg_token.jsonl", b"{\"tokens\": [1, -5]}\n");
    w("big_token.jsonl", b"{\"tokens\": [4294967296]}\n");
    w("both.jsonl", b"{\"tokens\": [1], \"text\": \"a\"}\n");
    w("wrong_type.jsonl", b"{\"tokens\": \"abc\"}\n");
    w("binary.jsonl", &[0xff, 0xfe, 0x00, 0x01, b'\n']);
    let toks = NpyArray::from_ints(NpyDType::I32, vec![6], (1..7i32).map(|v| v as i64));
    w("toks.npy", &npy_bytes(&toks));
    let offs = |v: &[i64]| {
        npy_bytes(&NpyArray::from_ints(
            NpyDType::I64,
            vec![v.len()],
            v.iter().copied(),
        ))
    };
    w("offs_ok.npy", &offs(&[0, 2, 6]));
    w("offs_start.npy", &offs(&[1, 2, 6]));
    w("offs_down.npy", &offs(&[0, 4, 2, 6]));
    w("offs_end.npy", &offs(&[0, 2, 9]));
    w("offs_neg.npy", &offs(&[0, -2, 6]));
    w(
        "offs_float.npy",
        &npy_bytes(&NpyArray::from_ints(
            NpyDType::F32,
            vec![2],
            [0i64, 6].into_iter(),
        )),
    );
    // Telemetry.
    w("garbage.jsonl", b"{\"step\": \"x\"}\n");
    w("empty.jsonl", b"");
    std::fs::create_dir(dir.join("adir")).unwrap();
}

#[test]
fn hostile_inputs_exit_2_with_one_line_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    inputs(dir);
    let deep_parens = format!("{}causal{}", "(".repeat(60_000), ")".repeat(60_000));
    let deep_nots = format!("{}causal", "!".repeat(120_000));
    let deep_heads = format!("{}causal{}", "heads(".repeat(300), ")".repeat(300));
    let plan = |mask: &str| -> Vec<String> {
        ["plan", "--mask", mask, "--q-len", "64"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let attend = |extra: &[&str]| -> Case {
        let mut a = vec![
            "attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--mask", "causal", "--out",
            "o.npy",
        ];
        a.extend_from_slice(extra);
        case(&a, "")
    };
    let with_needle = |mut c: Case, needle: &'static str| {
        c.needle = needle;
        c
    };
    let attend_q = |q: &str, needle: &'static str| {
        case(
            &[
                "attend", "--q", q, "--k", "k.npy", "--v", "v.npy", "--mask", "causal", "--out",
                "o.npy",
            ],
            needle,
        )
    };
    let cases: Vec<Case> = vec![
        // Deep nesting and garbage in the mask expression.
        Case { args: plan(&deep_parens), ..case(&[], "at most 256 levels") },
        Case { args: plan(&deep_nots), ..case(&[], "at most 256 levels") },
        Case { args: plan(&deep_heads), ..case(&[], "at most 256 levels") },
        Case { args: plan("causal &&& foo("), ..case(&[], "mask expression, column") },
        Case { args: plan("unknown_leaf"), ..case(&[], "unknown leaf") },
        Case { args: plan("window(99999999999999999999999)"), ..case(&[], "an integer") },
        Case { args: plan("window(9000000000000000000K)"), ..case(&[], "an integer") },
        Case { args: plan("chunk(0)"), ..case(&[], "chunk(N) with N >= 1") },
        Case { args: plan("\u{1}\u{7f}"), ..case(&[], "mask expression") },
        Case { args: plan("heads(causal, full)"), ..case(&[], "heads(...)") },
        Case { args: plan("document"), ..case(&[], "document") },
        Case { args: plan("dense(missing.npy)"), ..case(&[], "missing.npy") },
        Case { args: plan("dense(garbage.npy)"), ..case(&[], "garbage.npy") },
        // Band features: missing, wrong dtype, rank or length; bounds out of order.
        Case { args: plan("band(missing.npy, seg.npy, 0, 1)"), ..case(&[], "missing.npy") },
        Case { args: plan("band(feat_f32.npy, seg.npy, 0, 1)"), ..case(&[], "band feature feat_f32.npy: expected an integer array") },
        Case { args: plan("band(seg.npy, feat_bool.npy, 0, 1)"), ..case(&[], "band feature feat_bool.npy: expected an integer array") },
        Case { args: plan("band(feat_3d.npy, seg.npy, 0, 1)"), ..case(&[], "shape [B, L] or [L]") },
        Case { args: plan("band(seg.npy, seg.npy, 3, 2)"), ..case(&[], "LO <= HI") },
        case(&["plan", "--mask", "band(seg.npy, seg.npy, 0, 1)", "--q-len", "64"], "q_feature of band(seg.npy, seg.npy, 0, 1): expected length 64"),
        case(&["plan", "--mask", "band(seg.npy, seg33.npy, 0, 1)", "--q-len", "40"], "kv_feature of band(seg.npy, seg33.npy, 0, 1): expected length 40"),
        valid(&["plan", "--mask", "band(seg.npy, seg33.npy, 0, 1) & causal", "--q-len", "40", "--kv-len", "33"]),
        Case { code: 0, ..Case { args: plan("causal(offset=9223372036854775807)"), ..valid(&[]) } },
        Case { code: 0, ..Case { args: plan("window(-9223372036854775808, 9223372036854775807) & !causal(offset=-9223372036854775808)"), ..valid(&[]) } },
        // Integer overflow and absurd sizes in shapes and flags.
        case(&["plan", "--mask", "causal", "--q-len", "18446744073709551616"], "--q-len"),
        case(&["plan", "--mask", "causal", "--q-len", "-1"], "-1"),
        case(&["plan", "--mask", "causal", "--q-len", "0"], "q-len"),
        case(&["plan", "--mask", "causal", "--q-len", "1099511627776"], "tile"),
        case(&["plan", "--mask", "full", "--q-len", "68719476736", "--tile", "4096"], "memory budget"),
        case(&["plan", "--mask", "causal", "--q-len", "16", "--kv-len", "4611686018427387904"], "tile"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--tile", "128x0"], "tile"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--tile", "99999999999999999999x16"], "tile"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--tile", "8192"], "tile"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--head-dim", "0"], "--head-dim"),
        valid(&["plan", "--mask", "causal", "--q-len", "64", "--batch", "18446744073709551615", "--heads", "18446744073709551615"]),
        case(&["plan", "--mask", "document", "--q-len", "64", "--segments", "seg.npy"], "length 64"),
        case(&["plan", "--mask", "document & causal", "--q-len", "40", "--segments", "seg33.npy"], "segments"),
        with_env(
            case(&["plan", "--mask", "causal", "--q-len", "64"], "TESSERA_MEMORY_BUDGET"),
            &[("TESSERA_MEMORY_BUDGET", "lots")],
        ),
        with_env(
            case(&["plan", "--mask", "full", "--q-len", "65536", "--tile", "16", "--dump-states", "s.npy"], "memory budget"),
            &[("TESSERA_MEMORY_BUDGET", "1M")],
        ),
        // Truncated, garbage and mismatched tensors.
        attend_q("q_trunc.npy", "q_trunc.npy"),
        attend_q("q_header_only.npy", "q_header_only.npy"),
        attend_q("garbage.npy", "garbage.npy"),
        attend_q("empty.npy", "empty.npy"),
        attend_q("huge_shape.npy", "huge_shape.npy"),
        attend_q("overflow_shape.npy", "overflow_shape.npy"),
        attend_q("fortran.npy", "fortran.npy"),
        Case { code: 0, ..attend_q("big_endian.npy", "") },
        attend_q("missing.npy", "missing.npy"),
        attend_q("adir", "adir"),
        attend_q("q.txt", "q.txt"),
        attend_q("seg.npy", "--q"),
        with_needle(
            case(&["attend", "--q", "q.npy", "--k", "k_d4.npy", "--v", "v.npy", "--mask", "causal", "--out", "o.npy"], ""),
            "k",
        ),
        with_needle(
            case(&["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v_len30.npy", "--mask", "causal", "--out", "o.npy"], ""),
            "v",
        ),
        case(&["attend", "--q", "q.npy", "--k", "k3.npy", "--v", "v.npy", "--mask", "causal", "--out", "o.npy"], "--k"),
        with_needle(
            case(&["attend", "--q", "q.npy", "--k", "k_h3.npy", "--v", "v.npy", "--mask", "causal", "--out", "o.npy"], ""),
            "k",
        ),
        with_needle(attend(&["--scale", "NaN"]), "scale"),
        with_needle(attend(&["--softcap=-1"]), "softcap"),
        with_needle(attend(&["--sinks", "seg.npy"]), "sinks"),
        with_needle(attend(&["--dtype", "int8"]), "--dtype"),
        with_needle(attend(&["--dtype", "bf16"]), "dtype"),
        // Bad safetensors.
        attend_q("garbage.safetensors", "garbage.safetensors"),
        attend_q("absurd.safetensors", "absurd.safetensors"),
        attend_q("oob.safetensors", "oob.safetensors"),
        attend_q("overflow.safetensors", "overflow.safetensors"),
        attend_q("qkv.safetensors:nope", "nope"),
        attend_q("qkv.safetensors:", "NAME"),
        // Bad output paths: a directory, a missing directory, a wrong extension; nothing of a
        // multi-output command is written when any output is bad.
        case(&["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--mask", "causal", "--out", "adir"], "adir"),
        with_needle(
            case(&["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--mask", "causal", "--out", "no/such/o.npy"], ""),
            "no/such",
        ),
        with_needle(attend(&["--lse", "no/such/lse.npy"]), "no/such"),
        with_needle(attend(&["--lse", "lse.txt"]), "lse.txt"),
        with_needle(attend(&["--telemetry", "adir"]), "adir"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--dump-states", "ok.npy", "--png", "no/such/p.png"], "no/such"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--dump-states", "ok.npy", "--export", "flex", "adir"], "adir"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--dump-states", "ok.npy", "--export", "nonsense", "x.npz"], "--export"),
        case(&["plan", "--mask", "causal", "--q-len", "64", "--dump-states", "states.bin"], "states.bin"),
        // Bad pack input.
        case(&["pack", "--input", "bad_json.jsonl", "--seq-len", "8"], "line 2"),
        case(&["pack", "--input", "neg_token.jsonl", "--seq-len", "8"], "line 1"),
        case(&["pack", "--input", "big_token.jsonl", "--seq-len", "8"], "line 1"),
        case(&["pack", "--input", "both.jsonl", "--seq-len", "8"], "both"),
        case(&["pack", "--input", "wrong_type.jsonl", "--seq-len", "8"], "line 1"),
        case(&["pack", "--input", "binary.jsonl", "--seq-len", "8"], "line 1"),
        case(&["pack", "--input", "missing.jsonl", "--seq-len", "8"], "missing.jsonl"),
        case(&["pack", "--input", "adir", "--seq-len", "8"], "adir"),
        case(&["pack", "--input", "docs.jsonl", "--seq-len", "1"], "--seq-len"),
        case(&["pack", "--input", "docs.jsonl", "--seq-len", "1099511627776"], "seq_len"),
        with_env(
            case(&["pack", "--input", "docs.jsonl", "--seq-len", "2147483647"], "memory budget"),
            &[("TESSERA_MEMORY_BUDGET", "1G")],
        ),
        case(&["pack", "--input", "docs.jsonl", "--seq-len", "8", "--out", "rows.npy"], "--out"),
        case(&["pack", "--input", "docs.jsonl", "--seq-len", "8", "--out", "no/such/rows.safetensors"], "no/such"),
        case(&["pack", "--input", "toks.npy", "--offsets", "offs_start.npy", "--seq-len", "8"], "offs_start.npy"),
        case(&["pack", "--input", "toks.npy", "--offsets", "offs_down.npy", "--seq-len", "8"], "offs_down.npy"),
        case(&["pack", "--input", "toks.npy", "--offsets", "offs_end.npy", "--seq-len", "8"], "offs_end.npy"),
        case(&["pack", "--input", "toks.npy", "--offsets", "offs_neg.npy", "--seq-len", "8"], "offs_neg.npy"),
        case(&["pack", "--input", "toks.npy", "--offsets", "offs_float.npy", "--seq-len", "8"], "offs_float.npy"),
        case(&["pack", "--input", "toks.npy", "--offsets", "garbage.npy", "--seq-len", "8"], "garbage.npy"),
        case(&["pack", "--input", "toks.npy", "--seq-len", "8"], "--offsets"),
        case(&["pack", "--verify", "garbage.safetensors"], "garbage.safetensors"),
        case(&["pack", "--verify", "qkv.safetensors"], "qkv.safetensors"),
        valid(&["pack", "--input", "toks.npy", "--offsets", "offs_ok.npy", "--seq-len", "4"]),
        // Telemetry input.
        case(&["telemetry", "plot", "--in", "garbage.jsonl", "--out", "t.png"], "garbage.jsonl"),
        case(&["telemetry", "plot", "--in", "empty.jsonl", "--out", "t.png"], "empty.jsonl"),
        case(&["telemetry", "plot", "--in", "binary.jsonl", "--out", "t.png"], "binary.jsonl"),
        case(&["telemetry", "plot", "--in", "docs.jsonl", "--out", "t.png"], "docs.jsonl"),
        // Workload flags of bench and demo.
        case(&["bench", "--masks", "causal", "--lens", "1024", "--dims", "4294967296", "--heads", "1", "--dtypes", "f32", "--passes", "fwd", "--reps", "1", "--no-peak"], "memory budget"),
        case(&["bench", "--masks", "causal", "--lens", "1099511627776", "--dims", "64", "--dtypes", "f32", "--no-peak"], "tile"),
        case(&["demo", "--head-dim", "4294967296", "--out-dir", "demo_out"], "memory budget"),
        case(&["demo", "--seq-len", "1099511627776", "--out-dir", "demo_out"], "--seq-len"),
        // Usage.
        case(&["plan"], "--mask"),
        case(&["frobnicate"], "frobnicate"),
    ];
    for c in &cases {
        check(c, dir);
    }
}

/// A corrupted cache entry is rejected with one warning, rebuilt and rewritten (exit 0);
/// `cache verify` on it exits 2 with one line; a cache directory that is a file is a warning.
#[test]
fn corrupted_caches_are_rebuilt_and_verify_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cache = dir.join("cache");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "plan",
            "--mask",
            "causal & window(20)",
            "--q-len",
            "300",
            "--cache-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.push(cache.display().to_string());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let out = run(&args(&[]), dir, &[]);
    assert_eq!(out.status.code(), Some(0));
    let entry = std::fs::read_dir(cache.join("plans"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "tplan"))
        .expect("an entry");
    let good = std::fs::read(&entry).unwrap();
    let corruptions: Vec<Vec<u8>> = vec![
        Vec::new(),
        good[..40].to_vec(),
        good[..good.len() - 1].to_vec(),
        {
            let mut b = good.clone();
            let n = b.len();
            b[n - 3] ^= 0x40;
            b
        },
        {
            let mut b = good.clone();
            b[50] ^= 0xff; // payload length
            b
        },
        b"garbage".repeat(40),
    ];
    for bytes in corruptions {
        std::fs::write(&entry, &bytes).unwrap();
        let mut verify: Vec<String> = vec!["cache".into(), "verify".into(), "--cache-dir".into()];
        verify.push(cache.display().to_string());
        let out = run(&verify, dir, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let out = run(&args(&[]), dir, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one warning: {err}");
        assert!(err.contains("warning"), "{err}");
        // Rewritten: the cache verifies clean again.
        let out = run(&verify, dir, &[]);
        assert_eq!(out.status.code(), Some(0), "entry not rewritten");
    }
    // A cache "directory" that is a file: a warning, the plan is still built.
    std::fs::write(dir.join("notadir"), b"x").unwrap();
    let out = run(
        &[
            "plan",
            "--mask",
            "causal",
            "--q-len",
            "64",
            "--cache-dir",
            "notadir",
        ]
        .map(String::from),
        dir,
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
