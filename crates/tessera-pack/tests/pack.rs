//! Packing invariants on random inputs, the split rule, file inputs and bad input.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use tessera_core::{Error, Tensor, TensorData};
use tessera_pack::{
    pack_docs, pack_jsonl, pack_jsonl_with_progress, pack_npy, pack_npy_with_progress,
    verify_packed, verify_packed_with, write_packed, PackConfig, Packed, Progress, Strategy,
};

const BOS: u32 = 256;

fn cfg(seq_len: usize, strategy: Strategy) -> PackConfig {
    PackConfig {
        seq_len,
        strategy,
        bos: BOS,
    }
}

/// The documented split rule, computed independently: BOS + at most L-1 tokens per piece.
fn expected_pieces(docs: &[Vec<i32>], l: usize) -> Vec<Vec<i32>> {
    let mut out = Vec::new();
    for d in docs {
        let mut rest = &d[..];
        while !rest.is_empty() {
            let take = rest.len().min(l - 1);
            let mut p = vec![BOS as i32];
            p.extend_from_slice(&rest[..take]);
            out.push(p);
            rest = &rest[take..];
        }
    }
    out
}

/// Every piece found in the output, read back through segment ids.
fn output_pieces(p: &Packed) -> Vec<Vec<i32>> {
    let mut out: Vec<Vec<i32>> = Vec::new();
    for r in 0..p.rows {
        let mut cur = -1;
        for c in 0..p.seq_len {
            let i = r * p.seq_len + c;
            let s = p.segment_ids[i];
            if s < 0 {
                break;
            }
            if s != cur {
                out.push(Vec::new());
                cur = s;
            }
            out.last_mut().unwrap().push(p.tokens[i]);
        }
    }
    out
}

/// Checks invariants, content and statistics of one packing; returns the row count.
fn check_packing(docs: &[Vec<i32>], l: usize, strategy: Strategy) -> usize {
    let p = pack_docs(docs, &cfg(l, strategy)).unwrap();
    let verified = p.check(BOS).unwrap();
    let mut want = expected_pieces(docs, l);
    let mut got = output_pieces(&p);
    want.sort();
    got.sort();
    assert_eq!(
        got, want,
        "pieces (content and split rule), {strategy:?} L={l}"
    );

    let s = &p.stats;
    let non_empty = docs.iter().filter(|d| !d.is_empty()).count();
    let total: usize = docs.iter().map(Vec::len).sum();
    assert_eq!(s.documents, non_empty);
    assert_eq!(s.empty_documents_skipped, docs.len() - non_empty);
    assert_eq!(s.tokens, total);
    assert_eq!(s.pieces, want.len());
    assert_eq!(
        s.split_documents,
        docs.iter().filter(|d| d.len() > l - 1).count()
    );
    assert_eq!(s.rows * l, s.tokens + s.pieces + s.padding_tokens);
    assert_eq!((verified.rows, verified.pieces), (s.rows, s.pieces));
    assert_eq!(verified.tokens, s.tokens);
    assert_eq!(verified.padding_tokens, s.padding_tokens);
    assert!(s.rows >= (s.tokens + s.pieces).div_ceil(l));
    // Deterministic.
    assert_eq!(pack_docs(docs, &cfg(l, strategy)).unwrap(), p);
    s.rows
}

fn random_docs(rng: &mut ChaCha8Rng, kind: u32, l: usize) -> Vec<Vec<i32>> {
    let n = rng.gen_range(1..300);
    (0..n)
        .map(|_| {
            let len = match kind {
                0 => rng.gen_range(0..l), // shorter than a row
                1 => (rng.gen::<f64>() * (4.0 * l as f64).ln()).exp() as usize, // log-uniform
                2 => {
                    if rng.gen_bool(0.2) {
                        0 // many empty documents
                    } else {
                        rng.gen_range(1..3 * l)
                    }
                }
                _ => {
                    if rng.gen_bool(0.1) {
                        rng.gen_range(l..10 * l) // a few long ones
                    } else {
                        rng.gen_range(1..l / 4 + 2)
                    }
                }
            };
            (0..len).map(|_| rng.gen_range(0..300)).collect()
        })
        .collect()
}

#[test]
fn invariants_on_random_inputs_and_best_fit_beats_greedy() {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let (mut bf_total, mut gr_total) = (0, 0);
    for round in 0..200 {
        let l = [2, 3, 7, 16, 64, 255][round % 6];
        let docs = random_docs(&mut rng, (round / 6 % 4) as u32, l);
        let bf = check_packing(&docs, l, Strategy::BestFit);
        let gr = check_packing(&docs, l, Strategy::Greedy);
        assert!(bf <= gr, "round {round}: best-fit {bf} rows > greedy {gr}");
        bf_total += bf;
        gr_total += gr;
    }
    assert!(
        bf_total < gr_total,
        "best-fit {bf_total} vs greedy {gr_total}"
    );
}

proptest! {
    // No regression files written into the source tree.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_for_any_lengths(
        lens in prop::collection::vec(0usize..100, 0..60),
        l in 2usize..40,
    ) {
        let docs: Vec<Vec<i32>> = lens
            .iter()
            .enumerate()
            .map(|(d, &n)| (0..n as i32).map(|t| t + d as i32).collect())
            .collect();
        let bf = check_packing(&docs, l, Strategy::BestFit);
        let gr = check_packing(&docs, l, Strategy::Greedy);
        prop_assert!(bf <= gr);
    }
}

#[test]
fn split_rule_is_exact() {
    // L = 4: a 7-token document becomes [B 0 1 2] [B 3 4 5] [B 6].
    let docs = vec![vec![0, 1, 2, 3, 4, 5, 6]];
    let p = pack_docs(&docs, &cfg(4, Strategy::Greedy)).unwrap();
    let b = BOS as i32;
    assert_eq!(p.rows, 3);
    assert_eq!(p.tokens, vec![b, 0, 1, 2, b, 3, 4, 5, b, 6, 0, 0]);
    assert_eq!(p.positions, vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 0]);
    assert_eq!(p.segment_ids, vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1]);
    assert_eq!(p.stats.split_documents, 1);
    assert_eq!(p.stats.pieces, 3);

    // A document of exactly L-1 tokens fills one row and is not split.
    let p = pack_docs(&[vec![5, 6, 7]], &cfg(4, Strategy::BestFit)).unwrap();
    assert_eq!(
        (p.rows, p.stats.split_documents, p.stats.padding_tokens),
        (1, 0, 0)
    );
}

#[test]
fn greedy_keeps_input_order_and_best_fit_fills_gaps() {
    let b = BOS as i32;
    // Pieces of length 3, 4, 2 with L = 5.
    let docs = vec![vec![1, 1], vec![2, 2, 2], vec![3]];
    let g = pack_docs(&docs, &cfg(5, Strategy::Greedy)).unwrap();
    assert_eq!(g.rows, 3);
    let bf = pack_docs(&docs, &cfg(5, Strategy::BestFit)).unwrap();
    assert_eq!(bf.rows, 2);
    // Longest first: row 0 = [B 2 2 2 pad], row 1 = [B 1 1 | B 3].
    assert_eq!(bf.tokens, vec![b, 2, 2, 2, 0, b, 1, 1, b, 3]);
    assert_eq!(bf.segment_ids, vec![0, 0, 0, 0, -1, 0, 0, 0, 1, 1]);
    assert_eq!(bf.positions, vec![0, 1, 2, 3, 0, 0, 1, 2, 0, 1]);
}

#[test]
fn empty_documents_are_skipped_and_counted() {
    let docs = vec![vec![], vec![1, 2], vec![], vec![]];
    let p = pack_docs(&docs, &cfg(8, Strategy::BestFit)).unwrap();
    assert_eq!(p.stats.empty_documents_skipped, 3);
    assert_eq!((p.stats.documents, p.rows), (1, 1));

    let p = pack_docs(&[vec![], vec![]], &cfg(8, Strategy::Greedy)).unwrap();
    assert_eq!(
        (p.rows, p.stats.empty_documents_skipped, p.stats.padding_pct),
        (0, 2, 0.0)
    );
    assert!(p.tokens.is_empty());
}

#[test]
fn single_huge_document() {
    let n = 100_000usize;
    let doc: Vec<i32> = (0..n as i32).map(|i| i % 251).collect();
    for strategy in [Strategy::BestFit, Strategy::Greedy] {
        let p = pack_docs(std::slice::from_ref(&doc), &cfg(128, strategy)).unwrap();
        let pieces = n.div_ceil(127);
        assert_eq!(p.rows, pieces);
        assert_eq!(p.stats.pieces, pieces);
        assert_eq!(p.stats.split_documents, 1);
        assert_eq!(p.stats.padding_tokens, pieces * 128 - n - pieces);
        p.check(BOS).unwrap();
        assert_eq!(
            output_pieces(&p),
            expected_pieces(std::slice::from_ref(&doc), 128)
        );
    }
}

fn write_lines(dir: &Path, name: &str, lines: &[&str]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

#[test]
fn jsonl_pack_write_verify_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let input = write_lines(
        dir.path(),
        "in.jsonl",
        &[
            r#"{"text": "hello"}"#,
            "",
            r#"{"tokens": [1, 2, 3], "id": "ignored"}"#,
            r#"{"text": ""}"#,
            r#"{"text": "héllo wörld, a longer line that will need splitting"}"#,
            "   ",
        ],
    );
    let c = cfg(16, Strategy::BestFit);
    let p = pack_jsonl(&input, &c).unwrap();
    let docs = vec![
        "hello".bytes().map(i32::from).collect::<Vec<_>>(),
        vec![1, 2, 3],
        vec![],
        "héllo wörld, a longer line that will need splitting"
            .bytes()
            .map(i32::from)
            .collect(),
    ];
    assert_eq!(p, pack_docs(&docs, &c).unwrap());
    assert_eq!(p.stats.empty_documents_skipped, 1);

    let out = dir.path().join("rows.safetensors");
    write_packed(&out, &p).unwrap();
    let v = verify_packed(&out).unwrap();
    assert_eq!((v.rows, v.seq_len, v.pieces), (p.rows, 16, p.stats.pieces));
    assert_eq!(
        (v.tokens, v.padding_tokens),
        (p.stats.tokens, p.stats.padding_tokens)
    );
    verify_packed_with(&out, Some(BOS)).unwrap();
    let e = verify_packed_with(&out, Some(1)).unwrap_err();
    assert!(e.to_string().contains("row 0, column 0"), "{e}");

    // The tensors are readable by name with the shared reader, as masks consume them.
    let seg = tessera_io::read_tensor(&format!("{}:segment_ids", out.display()), None).unwrap();
    assert_eq!(seg.shape(), &[p.rows, 16]);
    assert_eq!(seg.data(), &TensorData::I32(p.segment_ids.clone()));
}

/// The progress events of a run, with labels owned.
#[derive(Debug, PartialEq)]
enum Event {
    Begin(String, u64),
    Advance(u64),
    End,
}

fn recorder(events: &mut Vec<Event>) -> impl FnMut(Progress<'_>) + '_ {
    |p| {
        events.push(match p {
            Progress::Begin { label, total } => Event::Begin(label.to_string(), total),
            Progress::Advance(n) => Event::Advance(n),
            Progress::End => Event::End,
        })
    }
}

/// Splits events into passes: (label, total, sum of advances), checking Begin ... End framing.
fn passes(events: &[Event]) -> Vec<(String, u64, u64)> {
    let mut out: Vec<(String, u64, u64)> = Vec::new();
    let mut open = false;
    for e in events {
        match e {
            Event::Begin(l, t) => {
                assert!(!open, "nested Begin: {events:?}");
                open = true;
                out.push((l.clone(), *t, 0));
            }
            Event::Advance(n) => {
                assert!(open, "Advance outside a pass");
                out.last_mut().unwrap().2 += n;
            }
            Event::End => {
                assert!(open, "End without Begin");
                open = false;
            }
        }
    }
    assert!(!open, "unfinished pass: {events:?}");
    out
}

#[test]
fn progress_is_reported_to_the_callback() {
    let dir = tempfile::tempdir().unwrap();
    let lines = [r#"{"text": "hello"}"#, r#"{"tokens": [1, 2, 3]}"#, ""];
    let input = write_lines(dir.path(), "p.jsonl", &lines);
    let size = std::fs::metadata(&input).unwrap().len();
    let c = cfg(8, Strategy::BestFit);
    let mut events = Vec::new();
    let p = pack_jsonl_with_progress(&input, &c, &mut recorder(&mut events)).unwrap();
    assert_eq!(p, pack_jsonl(&input, &c).unwrap());
    assert_eq!(
        passes(&events),
        vec![
            ("pack pass 1/2".to_string(), size, size),
            ("pack pass 2/2".to_string(), size, size)
        ]
    );

    let (tp, op) = (dir.path().join("tok.npy"), dir.path().join("off.npy"));
    write_i64(&tp, &[5, 6, 7, 8, 9]);
    write_i64(&op, &[0, 2, 5]);
    let mut events = Vec::new();
    pack_npy_with_progress(&tp, &op, &c, &mut recorder(&mut events)).unwrap();
    assert_eq!(passes(&events), vec![("pack tokens".to_string(), 5, 5)]);
}

fn write_i64(path: &Path, v: &[i64]) {
    let t = Tensor::new(vec![v.len()], TensorData::I64(v.to_vec())).unwrap();
    tessera_io::write_tensor(path, &t).unwrap();
}

#[test]
fn npy_input_matches_in_memory_docs() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let docs = random_docs(&mut rng, 2, 32);
    let flat: Vec<i64> = docs.iter().flatten().map(|&t| t as i64).collect();
    let mut offsets = vec![0i64];
    for d in &docs {
        offsets.push(offsets.last().unwrap() + d.len() as i64);
    }
    let (tp, op) = (dir.path().join("tok.npy"), dir.path().join("off.npy"));
    write_i64(&tp, &flat);
    write_i64(&op, &offsets);
    for strategy in [Strategy::BestFit, Strategy::Greedy] {
        let c = cfg(32, strategy);
        assert_eq!(
            pack_npy(&tp, &op, &c).unwrap(),
            pack_docs(&docs, &c).unwrap()
        );
    }
    // i32 tokens with i32 offsets work as well.
    let t32 = Tensor::new(
        vec![flat.len()],
        TensorData::I32(flat.iter().map(|&t| t as i32).collect()),
    )
    .unwrap();
    tessera_io::write_tensor(&tp, &t32).unwrap();
    let o32 = Tensor::new(
        vec![offsets.len()],
        TensorData::I32(offsets.iter().map(|&t| t as i32).collect()),
    )
    .unwrap();
    tessera_io::write_tensor(&op, &o32).unwrap();
    let c = cfg(32, Strategy::BestFit);
    assert_eq!(
        pack_npy(&tp, &op, &c).unwrap(),
        pack_docs(&docs, &c).unwrap()
    );
}

fn assert_err(r: tessera_core::Result<Packed>, needle: &str) -> Error {
    let e = r.unwrap_err();
    assert!(e.is_user_error(), "{e}");
    assert!(
        e.to_string().contains(needle),
        "expected {needle:?} in: {e}"
    );
    e
}

#[test]
fn bad_jsonl_input() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = cfg(16, Strategy::BestFit);
    let ok = r#"{"text": "ok"}"#;
    for (lines, needle) in [
        (vec![ok, ok, "{not json"], "line 3"),
        (vec![ok, r#"{"tokens": [1, -2]}"#], "line 2"),
        (vec![r#"{"tokens": [2147483648]}"#], "out of range"),
        (vec![r#"{"tokens": [1.5]}"#], "line 1"),
        (vec![r#"{"tokens": [1], "text": "x"}"#], "both"),
        (vec![ok, r#"{"id": 3}"#], "line 2"),
        (vec![r#"[1, 2]"#], "line 1"),
        (vec![r#"{"text": 5}"#], "line 1"),
    ] {
        let p = write_lines(d, "bad.jsonl", &lines);
        assert_err(pack_jsonl(&p, &c), needle);
    }
    std::fs::write(d.join("bin.jsonl"), [0xff, 0xfe, b'\n']).unwrap();
    assert_err(pack_jsonl(&d.join("bin.jsonl"), &c), "line 1");

    let e = pack_jsonl(&d.join("missing.jsonl"), &c).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");

    let input = write_lines(d, "in.jsonl", &[ok]);
    for l in [0, 1] {
        assert_err(pack_jsonl(&input, &cfg(l, Strategy::Greedy)), "seq_len");
    }
    let mut big_bos = cfg(16, Strategy::Greedy);
    big_bos.bos = u32::MAX;
    assert_err(pack_jsonl(&input, &big_bos), "bos");
    assert_err(pack_docs(&[vec![1, -1]], &c), "document 0, token 1");
}

#[test]
fn bad_npy_input() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = cfg(16, Strategy::BestFit);
    let (tp, op) = (d.join("t.npy"), d.join("o.npy"));
    write_i64(&tp, &[1, 2, 3, 4, 5]);
    for (offsets, needle) in [
        (vec![0, 3, 2, 5], "non-decreasing"),
        (vec![1, 5], "offsets[0] must be 0"),
        (vec![0, 4], "last offset"),
        (vec![0, 6], "last offset"),
        (vec![], "empty"),
    ] {
        write_i64(&op, &offsets);
        assert_err(pack_npy(&tp, &op, &c), needle);
    }
    write_i64(&op, &[0, 5]);
    write_i64(&tp, &[1, 2, -3, 4, 5]);
    assert_err(pack_npy(&tp, &op, &c), "token 2");
    write_i64(&tp, &[1, 2, 3, 4, 1 << 40]);
    assert_err(pack_npy(&tp, &op, &c), "out of range");
    let f = Tensor::from_f32(vec![5], vec![0.0; 5]).unwrap();
    tessera_io::write_tensor(&tp, &f).unwrap();
    assert_err(pack_npy(&tp, &op, &c), "integer");
    let e = pack_npy(&d.join("none.npy"), &op, &c).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
}

/// Rewrites one element of one tensor of a packed file.
fn corrupt(src: &Path, dst: &Path, name: &str, idx: usize, value: i32) {
    let mut ts = tessera_io::read_safetensors(src).unwrap();
    for (n, t) in ts.iter_mut() {
        if n == name {
            let shape = t.shape().to_vec();
            let TensorData::I32(mut v) = t.clone().into_data() else {
                panic!()
            };
            v[idx] = value;
            *t = Tensor::new(shape, TensorData::I32(v)).unwrap();
        }
    }
    let refs: Vec<(&str, &Tensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    tessera_io::write_safetensors(dst, &refs).unwrap();
}

#[test]
fn verify_names_the_first_violation() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let b = BOS as i32;
    // L = 6; rows: [B 2 2 2 2 2] [B 1 1 | B 3 pad].
    let docs = vec![vec![1, 1], vec![2, 2, 2, 2, 2], vec![3]];
    let p = pack_docs(&docs, &cfg(6, Strategy::BestFit)).unwrap();
    assert_eq!(p.tokens, vec![b, 2, 2, 2, 2, 2, b, 1, 1, b, 3, 0]);
    let good = d.join("good.safetensors");
    write_packed(&good, &p).unwrap();
    verify_packed(&good).unwrap();

    let bad = d.join("bad.safetensors");
    for (name, idx, value, needle) in [
        ("positions", 8, 5, "row 1, column 2: position 5"),
        (
            "positions",
            9,
            3,
            "row 1, column 3: document start has position 3",
        ),
        (
            "tokens",
            9,
            7,
            "row 1, column 3: document start has token 7",
        ),
        (
            "segment_ids",
            9,
            2,
            "row 1, column 3: segment id 2, expected 1",
        ),
        ("segment_ids", 8, -1, "row 1, column 2: padding token 1"),
        (
            "segment_ids",
            6,
            -1,
            "row 1, column 0: row holds no document",
        ),
        (
            "segment_ids",
            11,
            1,
            "row 1, column 5: position 0, expected 2",
        ),
        ("tokens", 11, 9, "row 1, column 5: padding token 9"),
        ("positions", 11, 4, "row 1, column 5: padding position 4"),
        ("segment_ids", 3, -7, "row 0, column 3: segment id -7"),
        (
            "segment_ids",
            0,
            1,
            "row 0, column 0: segment id 1, expected 0",
        ),
    ] {
        corrupt(&good, &bad, name, idx, value);
        let e = verify_packed(&bad).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e}");
        assert!(
            e.to_string().contains(needle),
            "expected {needle:?} in: {e}"
        );
    }

    // Wrong structure.
    let t = |v: Vec<i32>, shape: Vec<usize>| Tensor::new(shape, TensorData::I32(v)).unwrap();
    let ok = t(vec![b, 1], vec![1, 2]);
    let cases: Vec<(Vec<(&str, Tensor)>, &str)> = vec![
        (
            vec![("tokens", ok.clone()), ("segment_ids", ok.clone())],
            "missing tensor 'positions'",
        ),
        (
            vec![
                ("tokens", ok.clone()),
                ("segment_ids", t(vec![0, 0, 0], vec![1, 3])),
                ("positions", ok.clone()),
            ],
            "segment_ids: expected shape",
        ),
        (
            vec![
                ("tokens", ok.clone()),
                (
                    "segment_ids",
                    Tensor::new(vec![1, 2], TensorData::I64(vec![0, 0])).unwrap(),
                ),
                ("positions", ok.clone()),
            ],
            "expected dtype i32",
        ),
        (
            vec![
                ("tokens", t(vec![b], vec![1])),
                ("segment_ids", t(vec![0], vec![1])),
                ("positions", t(vec![0], vec![1])),
            ],
            "shape [N, L]",
        ),
    ];
    for (tensors, needle) in cases {
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        tessera_io::write_safetensors(&bad, &refs).unwrap();
        let e = verify_packed(&bad).unwrap_err();
        assert!(
            e.to_string().contains(needle),
            "expected {needle:?} in: {e}"
        );
    }
    let e = verify_packed(&d.join("nope.safetensors")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
}

#[test]
fn failed_writes_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = pack_docs(&[vec![1, 2, 3]], &cfg(8, Strategy::Greedy)).unwrap();
    let e = write_packed(&dir.path().join("rows.npy"), &p).unwrap_err();
    assert!(e.to_string().contains(".safetensors"), "{e}");
    let mut broken = p.clone();
    broken.positions.pop();
    let out = dir.path().join("rows.safetensors");
    assert!(write_packed(&out, &broken).is_err());
    assert!(write_packed(&dir.path().join("no/dir/rows.safetensors"), &p).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The shipped corpus at seq_len 2048: run with `--nocapture` to see the numbers.
#[test]
fn shipped_corpus_best_fit_pads_less_than_greedy() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus/licenses.jsonl");
    let dir = tempfile::tempdir().unwrap();
    let mut padding = Vec::new();
    for strategy in [Strategy::BestFit, Strategy::Greedy] {
        let p = pack_jsonl(&corpus, &cfg(2048, strategy)).unwrap();
        p.check(BOS).unwrap();
        let out = dir.path().join(format!("{}.safetensors", strategy.name()));
        write_packed(&out, &p).unwrap();
        verify_packed_with(&out, Some(BOS)).unwrap();
        println!("{:>8}: {}", strategy.name(), p.stats.summary());
        println!("{:>8}  {}", "", serde_json::to_string(&p.stats).unwrap());
        padding.push(p.stats.padding_pct);
    }
    assert!(padding[0] < padding[1], "best-fit {padding:?}");
}
