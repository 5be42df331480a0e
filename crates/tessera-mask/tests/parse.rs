//! Parser, canonical form and semantics of the mask language.

use std::sync::Arc;
use tessera_core::{Error, Result};
use tessera_mask::{parse, DenseMask, Mask, NoData, Resolver, SegmentIds, Segments};

struct Data(Arc<Segments>);

impl Resolver for Data {
    fn segments(&self) -> Result<Arc<Segments>> {
        Ok(self.0.clone())
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        DenseMask::new(&[2, 3], &[true, false, true, false, true, true], path)
    }
    fn feature(&self, name: &str) -> Result<SegmentIds> {
        SegmentIds::shared(vec![name.len() as i64, 0, -2])
    }
}

fn data(ids: Vec<i64>) -> Data {
    Data(Segments::shared(SegmentIds::shared(ids).unwrap()))
}

fn p(s: &str) -> Mask {
    parse(s, &data(vec![0, 0, 1])).unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn leaves_parse_to_typed_masks() {
    assert_eq!(p("full"), Mask::Full);
    assert_eq!(p("causal"), Mask::causal());
    assert_eq!(p("causal(offset=-3)"), Mask::causal_offset(-3));
    assert_eq!(p("causal(5)"), Mask::causal_offset(5));
    assert_eq!(p("window(8)"), Mask::window(8, 0));
    assert_eq!(p("window(8, 2)"), Mask::window(8, 2));
    assert_eq!(p("window(left=8, right=2)"), Mask::window(8, 2));
    assert_eq!(p("window(1K)"), Mask::window(1024, 0));
    assert_eq!(p("chunk(16)"), Mask::chunk(16));
    assert_eq!(p("prefix(0)"), Mask::prefix(0));
    assert!(matches!(p("document"), Mask::Document(_)));
    assert!(matches!(p("dense(some/file.npy)"), Mask::Dense(_)));
    assert!(matches!(p("dense('a b(1).npy')"), Mask::Dense(_)));
    assert!(matches!(p("heads(causal, full)"), Mask::Heads(ref v) if v.len() == 2));
}

#[test]
fn precedence_and_grouping() {
    // `!` > `&` > `|`.
    assert_eq!(
        p("causal | prefix(2) & !full"),
        Mask::Or(vec![
            Mask::causal(),
            Mask::And(vec![Mask::prefix(2), !Mask::Full])
        ])
    );
    assert_eq!(
        p("(causal | prefix(2)) & full"),
        Mask::And(vec![
            Mask::Or(vec![Mask::causal(), Mask::prefix(2)]),
            Mask::Full
        ])
    );
}

#[test]
fn canonical_form_ignores_spelling_but_not_meaning() {
    let a = p("causal & window(64)");
    for same in [
        "  causal&window( 64 )",
        "((causal) & (window(64, 0)))",
        "window(64) & causal",
        "causal(offset=0) & window(left=64)",
        "!!(causal & window(64))",
        "causal & causal & window(64)",
    ] {
        assert_eq!(a.canonical(), p(same).canonical(), "{same}");
    }
    for different in [
        "causal & window(65)",
        "causal | window(64)",
        "causal(1) & window(64)",
    ] {
        assert_ne!(a.canonical(), p(different).canonical(), "{different}");
    }
}

#[test]
fn different_data_changes_the_canonical_form() {
    let a = parse("causal & document", &data(vec![0, 0, 1])).unwrap();
    let b = parse("causal & document", &data(vec![0, 1, 1])).unwrap();
    let c = parse("causal & document", &data(vec![0, 0, 1])).unwrap();
    assert_ne!(a.canonical(), b.canonical());
    assert_eq!(a.canonical(), c.canonical());
}

#[test]
fn display_round_trips() {
    for s in [
        "causal & (window(8, 2) | prefix(3))",
        "!(chunk(4) & causal(offset=-1)) | full",
        "heads(causal, document & causal)",
    ] {
        let m = p(s);
        assert_eq!(p(&m.to_string()), m, "{s} -> {m}");
    }
}

fn err(s: &str) -> (usize, String) {
    match parse(s, &NoData) {
        Err(Error::Parse {
            column,
            expected,
            found,
        }) => (column, format!("{expected} / {found}")),
        Err(e) => (0, e.to_string()),
        Ok(m) => panic!("{s} parsed as {m:?}"),
    }
}

#[test]
fn parse_errors_name_the_column_and_expectation() {
    assert_eq!(err("causal & wndow(3)").0, 10);
    assert!(err("causal & wndow(3)").1.contains("unknown leaf 'wndow'"));
    assert_eq!(err("causal & (window(3)").0, 20);
    assert!(err("causal & (window(3)").1.contains("')'"));
    assert_eq!(err("").0, 1);
    assert_eq!(err("causal causal").0, 8);
    assert_eq!(err("chunk(0)").0, 7);
    assert_eq!(err("window()").0, 8);
    assert!(err("window(x=3)").1.contains("argument name"));
    assert_eq!(err("causal &").0, 9);
    assert!(err("full(3)").1.contains("no arguments"));
    assert_eq!(err("window(99999999999999999999)").0, 8);
    // Data leaves without data are errors, not panics.
    assert!(err("document").1.contains("--segments"));
}

#[test]
fn validation_checks_shapes() {
    let segs = Segments::shared(SegmentIds::new(2, 3, vec![0, 0, 1, 0, 1, 1]).unwrap());
    let m = Mask::document(segs);
    assert!(m.validate(2, 1, 3, 3).is_ok());
    assert!(m
        .validate(3, 1, 3, 3)
        .unwrap_err()
        .to_string()
        .contains("1 or 3 rows"));
    assert!(m
        .validate(2, 1, 4, 4)
        .unwrap_err()
        .to_string()
        .contains("length 4"));
    let d = DenseMask::new(&[2, 3, 4], &[true; 24], "d.npy").unwrap();
    assert!(Mask::dense(d.clone()).validate(1, 2, 3, 4).is_ok());
    assert!(Mask::dense(d).validate(1, 4, 3, 4).is_err());
    assert!(DenseMask::new(&[3, 4], &[true; 11], "x").is_err());
    assert!(DenseMask::new(&[3], &[true; 3], "x").is_err());
    assert!(SegmentIds::new(1, 0, vec![]).is_err());
}

#[test]
fn document_semantics_padding_never_matches() {
    let segs = Segments::shared(SegmentIds::shared(vec![-1, -1, 0, 0]).unwrap());
    let m = Mask::document(segs);
    assert!(!m.allowed(0, 0, 0, 0));
    assert!(!m.allowed(0, 0, 0, 1));
    assert!(m.allowed(0, 0, 2, 3));
    assert!(!m.allowed(0, 0, 2, 0));
}

/// Hostile nesting is a parse error naming the limit and a column, never a stack overflow.
#[test]
fn deep_and_long_input_is_bounded() {
    use tessera_mask::{MAX_DEPTH, MAX_LEN};
    let deep = format!("{}causal{}", "(".repeat(60_000), ")".repeat(60_000));
    let e = parse(&deep, &NoData).unwrap_err().to_string();
    assert!(
        e.contains(&format!("at most {MAX_DEPTH} levels")) && e.contains("column"),
        "{e}"
    );
    let nots = format!("{}causal", "!".repeat(120_000));
    let e = parse(&nots, &NoData).unwrap_err().to_string();
    assert!(e.contains("levels of nesting"), "{e}");
    let heads = format!("{}causal{}", "heads(".repeat(5_000), ")".repeat(5_000));
    assert!(parse(&heads, &NoData).is_err());
    // At the limit it still parses (and means the same as the flat form).
    let ok = format!("{}causal{}", "(".repeat(MAX_DEPTH), ")".repeat(MAX_DEPTH));
    assert_eq!(
        parse(&ok, &NoData).unwrap(),
        parse("causal", &NoData).unwrap()
    );
    let ok = format!("{}causal", "!".repeat(MAX_DEPTH));
    assert!(parse(&ok, &NoData).is_ok());
    let long = format!("causal{}", " ".repeat(MAX_LEN));
    let e = parse(&long, &NoData).unwrap_err().to_string();
    assert!(e.contains("bytes"), "{e}");
}
