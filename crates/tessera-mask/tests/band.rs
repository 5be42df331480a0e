//! The `band(F, G, LO, HI)` leaf: token semantics in exact arithmetic, validation errors naming
//! the argument, canonical form by digest, dependence, and the text form.

use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_core::{Error, Result};
use tessera_mask::{parse, BandFeatures, DenseMask, Mask, NoData, Resolver, SegmentIds, Segments};

/// Features by name.
struct Features(HashMap<String, SegmentIds>);

impl Resolver for Features {
    fn segments(&self) -> Result<Arc<Segments>> {
        NoData.segments()
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        NoData.dense(path)
    }
    fn feature(&self, name: &str) -> Result<SegmentIds> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| Error::invalid(name, "a known feature", "no such name"))
    }
}

fn features(items: &[(&str, SegmentIds)]) -> Features {
    Features(
        items
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    )
}

fn ids(rows: usize, v: Vec<i64>) -> SegmentIds {
    let len = v.len() / rows;
    SegmentIds::new(rows, len, v).expect("ids")
}

fn band(q: SegmentIds, kv: SegmentIds, lo: i64, hi: i64) -> Mask {
    Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
}

/// The definition, written independently: `lo <= f - g <= hi` without wrapping.
fn brute(f: i64, g: i64, lo: i64, hi: i64) -> bool {
    let d = f as i128 - g as i128;
    (lo as i128..=hi as i128).contains(&d)
}

/// Values near zero most of the time, extremes sometimes.
fn value() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => -6i64..6,
        1 => prop::sample::select(vec![i64::MIN, i64::MIN + 1, -1 << 62, 1 << 62, i64::MAX - 1, i64::MAX]),
        1 => any::<i64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn allowed_is_the_exact_difference_test(
        rows in 1usize..3,
        lq in 1usize..9,
        lkv in 1usize..9,
        f in prop::collection::vec(value(), 16),
        g in prop::collection::vec(value(), 16),
        a in value(),
        b in value(),
    ) {
        let (lo, hi) = (a.min(b), a.max(b));
        let q = ids(rows, f[..rows * lq].to_vec());
        let kv = ids(rows, g[..rows * lkv].to_vec());
        let m = band(q.clone(), kv.clone(), lo, hi);
        prop_assert!(m.validate(rows, 1, lq, lkv).is_ok());
        for bb in 0..rows {
            for i in 0..lq {
                for j in 0..lkv {
                    let want = brute(q.row(bb)[i], kv.row(bb)[j], lo, hi);
                    prop_assert_eq!(m.allowed(bb, 0, i, j), want);
                    // `!band` is its complement, also at the extremes.
                    prop_assert_eq!((!band(q.clone(), kv.clone(), lo, hi)).allowed(bb, 0, i, j), !want);
                }
            }
        }
    }
}

#[test]
fn extreme_values_do_not_wrap() {
    let q = SegmentIds::shared(vec![i64::MAX, i64::MIN, 0]).unwrap();
    let kv = SegmentIds::shared(vec![i64::MIN, i64::MAX, 0]).unwrap();
    // f - g = 2^64 - 1 for (0, 0): far above i64::MAX, never inside [0, i64::MAX].
    let m = band(q.clone(), kv.clone(), 0, i64::MAX);
    assert!(!m.allowed(0, 0, 0, 0));
    assert!(m.allowed(0, 0, 0, 2)); // i64::MAX - 0
    assert!(!m.allowed(0, 0, 1, 1)); // -(2^64 - 1)
    let m = band(q, kv, i64::MIN, i64::MAX);
    assert!(!m.allowed(0, 0, 0, 0) && !m.allowed(0, 0, 1, 1));
    assert!(m.allowed(0, 0, 2, 2) && m.allowed(0, 0, 1, 2));
}

#[test]
fn validation_names_the_argument() {
    let q = SegmentIds::shared(vec![0, 1, 2, 3]).unwrap();
    let kv = SegmentIds::new(2, 3, vec![0, 1, 2, 5, 6, 7]).unwrap();
    let m = band(q.clone(), kv.clone(), -1, 1);
    assert!(m.validate(2, 3, 4, 3).is_ok());
    let e = m.validate(2, 1, 5, 3).unwrap_err().to_string();
    assert!(e.starts_with("q_feature of band(f, g, -1, 1)"), "{e}");
    assert!(
        e.contains("length 5 (the query length)") && e.contains("found 4"),
        "{e}"
    );
    let e = m.validate(2, 1, 4, 4).unwrap_err().to_string();
    assert!(e.starts_with("kv_feature of band(f, g, -1, 1)"), "{e}");
    assert!(e.contains("length 4 (the key length)"), "{e}");
    let e = m.validate(3, 1, 4, 3).unwrap_err().to_string();
    assert!(e.contains("kv_feature") && e.contains("1 or 3 rows"), "{e}");
    // lo > hi: refused before anything is planned, naming `lo`.
    let e = band(q, kv, 2, 1)
        .validate(2, 1, 4, 3)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("lo of band(f, g, 2, 1)"), "{e}");
    assert!(e.contains("lo <= hi (1)") && e.contains("found 2"), "{e}");
    // The constructor of the data names its argument.
    let e = SegmentIds::named("q_feature", 1, 0, vec![])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("q_feature:"), "{e}");
}

#[test]
fn dependence_and_canonical_form() {
    let shared = SegmentIds::shared(vec![0, 1, 2]).unwrap();
    let rows = SegmentIds::new(2, 3, vec![0, 1, 2, 0, 1, 2]).unwrap();
    assert!(
        !band(shared.clone(), shared.clone(), 0, 1)
            .dependence()
            .batch
    );
    assert!(band(shared.clone(), rows.clone(), 0, 1).dependence().batch);
    assert!(band(rows.clone(), shared.clone(), 0, 1).dependence().batch);

    let base = band(shared.clone(), shared.clone(), 0, 1);
    let c = base.canonical();
    assert!(c.starts_with("band#") && c.ends_with("(0,1)"), "{c}");
    // Names do not matter to the contract; data and bounds do.
    let renamed = Mask::band(
        BandFeatures::new("x.npy", shared.clone(), "y.npy", shared.clone()),
        0,
        1,
    );
    assert_eq!(renamed.canonical(), c);
    assert_ne!(renamed.to_string(), base.to_string());
    let other = SegmentIds::shared(vec![0, 1, 3]).unwrap();
    for different in [
        band(other.clone(), shared.clone(), 0, 1),
        band(shared.clone(), other.clone(), 0, 1),
        band(shared.clone(), shared.clone(), 0, 2),
        band(shared.clone(), shared.clone(), -1, 1),
        band(rows.clone(), shared.clone(), 0, 1),
    ] {
        assert_ne!(different.canonical(), c, "{different}");
    }
    // Swapping the sides is another mask.
    assert_ne!(
        band(shared.clone(), other.clone(), 0, 1).canonical(),
        band(other.clone(), shared.clone(), 0, 1).canonical()
    );
    // Per-row specialization: rows with equal features share a key, and a shared feature's key
    // equals the two-row one's where the rows agree.
    let m = band(rows.clone(), shared.clone(), 0, 1);
    assert_eq!(m.specialized_canonical(0, 0), m.specialized_canonical(1, 0));
    assert_eq!(
        m.specialized_canonical(1, 0),
        base.specialized_canonical(0, 0)
    );
    let two = SegmentIds::new(2, 3, vec![0, 1, 2, 0, 1, 4]).unwrap();
    let m = band(two, shared, 0, 1);
    assert_ne!(m.specialized_canonical(0, 0), m.specialized_canonical(1, 0));
    // Operands of `&` sort and deduplicate as for every leaf.
    assert_eq!(
        (base.clone() & Mask::causal()).canonical(),
        (Mask::causal() & base.clone() & base).canonical()
    );
}

#[test]
fn text_form_parses_prints_and_refuses_bad_input() {
    let pos = SegmentIds::shared(vec![0, 1, 2, 3]).unwrap();
    let rev = SegmentIds::shared(vec![3, 2, 1, 0]).unwrap();
    let data = features(&[("pos", pos.clone()), ("data/rev.npy", rev.clone())]);
    let typed = Mask::band(
        BandFeatures::new("pos", pos.clone(), "data/rev.npy", rev.clone()),
        -2,
        5,
    );
    for text in [
        "band(pos, data/rev.npy, -2, 5)",
        " band ( pos ,data/rev.npy,-2,5 ) ",
        "band('pos', \"data/rev.npy\", lo=-2, hi=5)",
        "band(pos, data/rev.npy, hi=5, lo=-2)",
    ] {
        let m = parse(text, &data).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(m, typed, "{text}");
        assert_eq!(m.to_string(), "band(pos, data/rev.npy, -2, 5)");
    }
    let m = parse(
        "causal & !band(pos, pos, 0, 1K) | heads(band(pos, pos, -1, 1))",
        &data,
    )
    .unwrap();
    let again = parse(&m.to_string(), &data).unwrap();
    assert_eq!(again, m);
    assert_eq!(again.canonical(), m.canonical());

    let err = |text: &str, r: &dyn Resolver| match parse(text, r) {
        Err(Error::Parse {
            column,
            expected,
            found,
        }) => (column, format!("{expected} / {found}")),
        Err(e) => (0, e.to_string()),
        Ok(m) => panic!("{text} parsed as {m:?}"),
    };
    // lo > hi points at the bounds.
    let (col, msg) = err("band(pos, pos, 3, 2)", &data);
    assert_eq!(col, 16, "{msg}");
    assert!(
        msg.contains("LO <= HI") && msg.contains("LO 3 > HI 2"),
        "{msg}"
    );
    assert!(err("band(pos, pos, 3)", &data).1.contains("2 argument(s)"));
    assert!(err("band(pos, pos)", &data).1.contains("','"));
    assert!(err("band(pos)", &data).1.contains("','"));
    assert!(err("band", &data).1.contains("'('"));
    assert!(err("band(pos, pos, 1, 2, 3)", &data)
        .1
        .contains("at most 2"));
    assert!(err("band(pos, pos, x=1, 2)", &data)
        .1
        .contains("argument name (lo, hi)"));
    assert!(err("band(pos, pos, 1.5, 2)", &data).1.contains("')'"));
    // Unknown names and missing loaders are errors from the resolver, not panics.
    assert!(err("band(pos, nope, 0, 1)", &data)
        .1
        .contains("no such name"));
    let e = err("band(pos, pos, 0, 1)", &NoData).1;
    assert!(
        e.contains("band feature pos") && e.contains("feature loader"),
        "{e}"
    );
}

#[test]
fn special_cases_agree_token_by_token() {
    // causal(offset=N) = band(pos, pos, -N, MAX); window(L, R) = band(pos, pos, -R, L);
    // document on ids >= 0 = band(ids, ids, 0, 0).
    let n = 40;
    let pos = SegmentIds::shared((0..n as i64).collect()).unwrap();
    let docs: Vec<i64> = (0..n as i64).map(|i| i / 7 + (i % 3 == 0) as i64).collect();
    let seg = SegmentIds::shared(docs).unwrap();
    let pairs = [
        (Mask::causal(), band(pos.clone(), pos.clone(), 0, i64::MAX)),
        (
            Mask::causal_offset(5),
            band(pos.clone(), pos.clone(), -5, i64::MAX),
        ),
        (Mask::window(6, 2), band(pos.clone(), pos.clone(), -2, 6)),
        (
            Mask::document(Segments::shared(seg.clone())),
            band(seg.clone(), seg, 0, 0),
        ),
    ];
    for (leaf, b) in pairs {
        for i in 0..n {
            for j in 0..n {
                assert_eq!(
                    leaf.allowed(0, 0, i, j),
                    b.allowed(0, 0, i, j),
                    "{leaf} {i} {j}"
                );
            }
        }
    }
}
