//! The `blocks` leaf (docs/semantics.md#masks): token semantics, text form, canonical form and errors.

use proptest::prelude::*;
use std::sync::Arc;
use tessera_core::Result;
use tessera_mask::{parse, BlockSelection, DenseMask, Mask, NoData, Resolver, Segments};

/// `blocks(QB, KVB, NAME)` resolves NAME in a table of (shape, entries).
struct Table(Vec<(&'static str, Vec<usize>, Vec<i64>)>);

impl Resolver for Table {
    fn segments(&self) -> Result<Arc<Segments>> {
        NoData.segments()
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        NoData.dense(path)
    }
    fn blocks(&self, path: &str, q_block: usize, kv_block: usize) -> Result<BlockSelection> {
        let (_, shape, entries) = self.0.iter().find(|e| e.0 == path).expect("known name");
        BlockSelection::new(shape, entries, q_block, kv_block, path)
    }
}

/// Brute force from the raw array: query `i` of (b, h) may attend key `j` iff `j / kb` is
/// among the entries of row `i / qb`.
fn brute(
    shape: &[usize; 4],
    e: &[i64],
    qb: usize,
    kb: usize,
    (b, h, i, j): (usize, usize, usize, usize),
) -> bool {
    let [bb, hh, tq, k] = *shape;
    let (b, h) = (if bb == 1 { 0 } else { b }, if hh == 1 { 0 } else { h });
    let row = ((b * hh + h) * tq + i / qb) * k;
    e[row..row + k].contains(&((j / kb) as i64))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// `allowed` equals the definition on the raw entries (duplicates, -1, broadcast dims),
    /// and the selection is invariant to the order and repetition within each row.
    #[test]
    fn allowed_is_the_selected_tiles(
        b in 1usize..3, h in 1usize..4, lq in 1usize..90, lkv in 1usize..90,
        qb in 1usize..40, kb in 1usize..40, k in 0usize..6,
        shared_b in any::<bool>(), shared_h in any::<bool>(), seed in any::<u64>(),
    ) {
        let (tq, tk) = (lq.div_ceil(qb), lkv.div_ceil(kb));
        let shape = [if shared_b { 1 } else { b }, if shared_h { 1 } else { h }, tq, k];
        let n: usize = shape.iter().product();
        let mut x = seed | 1;
        let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
        let e: Vec<i64> = (0..n).map(|_| (next() % (tk as u64 + 1)) as i64 - 1).collect();
        let sel = BlockSelection::new(&shape, &e, qb, kb, "kv_tiles").unwrap();
        let m = Mask::blocks(sel);
        m.validate(b, h, lq, lkv).unwrap();
        for bi in 0..b { for hi in 0..h { for i in 0..lq { for j in 0..lkv {
            prop_assert_eq!(m.allowed(bi, hi, i, j), brute(&shape, &e, qb, kb, (bi, hi, i, j)));
        }}}}
        let dep = m.dependence();
        prop_assert_eq!((dep.batch, dep.heads), (shape[0] > 1, shape[1] > 1));
        // Each row reversed and padded with a repeat and a -1: the same selection.
        let (n_rows, mut e2) = (shape[0] * shape[1] * tq, Vec::new());
        for r in 0..n_rows {
            let row = &e[r * k..(r + 1) * k];
            e2.extend(row.iter().rev());
            e2.push(row.first().copied().unwrap_or(-1));
            e2.push(-1);
        }
        let shape2 = [shape[0], shape[1], tq, k + 2];
        let m2 = Mask::blocks(BlockSelection::new(&shape2, &e2, qb, kb, "other").unwrap());
        prop_assert_eq!(m.canonical(), m2.canonical());
        // Another block size is another mask.
        let m3 = Mask::blocks(BlockSelection::new(&shape, &e, qb + 1, kb, "kv_tiles").unwrap());
        prop_assert_ne!(m.canonical(), m3.canonical());
    }
}

#[test]
fn text_form_parses_prints_and_names_its_data() {
    let t = Table(vec![
        (
            "sel.npy",
            vec![2, 2, 3],
            vec![0, 1, 1, -1, 0, 0, 2, 2, -1, -1, -1, -1],
        ),
        ("a, b", vec![1, 1], vec![0]),
    ]);
    let m = parse("causal & blocks(64, 1K, sel.npy)", &t).unwrap();
    assert_eq!(m.to_string(), "causal & blocks(64, 1024, sel.npy)");
    let Mask::And(v) = &m else { panic!("{m:?}") };
    let Mask::Blocks(s) = &v[1] else {
        panic!("{m:?}")
    };
    assert_eq!(
        (
            s.batch(),
            s.heads(),
            s.rows(),
            s.k(),
            s.q_block(),
            s.kv_block()
        ),
        (1, 2, 2, 3, 64, 1024)
    );
    assert_eq!(s.row(0, 0), [0, 1]);
    assert_eq!(s.row(1, 0), [2]);
    assert!(s.row(1, 1).is_empty());
    assert_eq!(s.selected(), 4);
    assert!(m.canonical().contains("blocks#"), "{}", m.canonical());
    // Heads differ, so the specialized forms do.
    assert_ne!(m.specialized_canonical(0, 0), m.specialized_canonical(0, 1));
    // A raw name runs to the closing parenthesis, commas included.
    let m = parse("blocks(16, 16, a, b)", &t).unwrap();
    assert_eq!(m.to_string(), "blocks(16, 16, a, b)");
    assert_eq!(parse(&m.to_string(), &t).unwrap(), m);
}

#[test]
fn text_form_errors_name_the_column_or_the_data() {
    let t = Table(vec![("s", vec![1, 1], vec![0])]);
    for (text, col, what) in [
        ("blocks", 7, "'('"),
        ("blocks(16)", 10, "','"),
        ("blocks(0, 16, s)", 8, "a block size >= 1"),
        ("blocks(16, -4, s)", 12, "a block size >= 1"),
        ("blocks(16, x, s)", 12, "an integer"),
        ("blocks(16, 16, )", 16, "a file path"),
        ("blocks(16, 16, s", 17, "')'"),
    ] {
        let e = parse(text, &t).unwrap_err().to_string();
        assert!(
            e.contains(&format!("column {col}:")) && e.contains(what),
            "{text}: {e}"
        );
    }
    let e = parse("blocks(16, 16, x.npy)", &NoData)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "blocks(16, 16, x.npy): expected a block selection loader, found none available"
    );
    let e = parse("blockz(1)", &t).unwrap_err().to_string();
    assert!(e.contains("blocks"), "{e}");
}

#[test]
fn validation_names_kv_tiles() {
    let sel =
        |shape: &[usize], e: &[i64], label: &str| BlockSelection::new(shape, e, 16, 16, label);
    // 40 queries = 3 query blocks, 33 keys = 3 key blocks.
    let m = Mask::blocks(sel(&[3, 1], &[0, 2, 1], "kv_tiles").unwrap());
    assert!(m.validate(1, 1, 40, 33).is_ok());
    let e = m.validate(1, 1, 40, 32).unwrap_err().to_string();
    assert_eq!(
        e,
        "kv_tiles: expected entries in [-1, 2) (Lkv 32 in blocks of 16), found 2"
    );
    assert!(m.validate(1, 1, 48, 33).is_ok());
    let e = m.validate(1, 1, 60, 33).unwrap_err().to_string();
    assert!(e.starts_with("kv_tiles: expected 4 query blocks"), "{e}");
    let m = Mask::blocks(sel(&[3, 1], &[0, 2, 1], "sel.npy").unwrap());
    let e = m.validate(1, 1, 40, 20).unwrap_err().to_string();
    assert!(
        e.starts_with("kv_tiles of blocks(.., sel.npy): expected entries"),
        "{e}"
    );
    for (shape, e) in [
        (&[3][..], &[0i64, 0, 0][..]),
        (&[1, 1, 1, 3, 1], &[0, 0, 0]),
        (&[0, 1], &[]),
        (&[3, 1], &[0, 0]),
        (&[3, 1], &[0, -2, 0]),
        (&[3, 1], &[0, 1 << 40, 0]),
    ] {
        let err = sel(shape, e, "kv_tiles").unwrap_err().to_string();
        assert!(err.starts_with("kv_tiles: expected"), "{shape:?}: {err}");
    }
    let err = sel(&[3, 1], &[0, -7, 0], "kv_tiles")
        .unwrap_err()
        .to_string();
    assert!(err.ends_with("found -7 at [1, 0]"), "{err}");
    // k = 0: nothing selected, a valid (empty) mask.
    let none = Mask::blocks(sel(&[3, 0], &[], "kv_tiles").unwrap());
    assert!(none.validate(1, 1, 40, 33).is_ok());
    assert!(!none.allowed(0, 0, 5, 5));
}

#[test]
fn an_empty_selection_of_absurd_shape_is_refused_not_allocated() {
    // No entries (k = 0), but 2^31 rows: the row index alone would need 8 GiB.
    std::env::set_var("TESSERA_MEMORY_BUDGET", "64M");
    let e = BlockSelection::new(&[1 << 31, 0], &[], 16, 16, "kv_tiles").unwrap_err();
    std::env::remove_var("TESSERA_MEMORY_BUDGET");
    assert!(e.to_string().contains("memory budget"), "{e}");
}
