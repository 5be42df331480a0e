//! Names of data (`dense` arrays, `band` features, `blocks` selections) in the text form: printing
//! quotes exactly what the parser needs quoted, so print → parse → print is a fixpoint for any
//! non-empty name (found by fuzzing: `dense("*(")` printed as `dense(*()`, which does not parse).

use proptest::prelude::*;
use std::sync::Arc;
use tessera_core::Result;
use tessera_mask::{
    parse, BandFeatures, BlockSelection, DenseMask, Mask, Resolver, SegmentIds, Segments,
};

/// Every name resolves to the same small array labelled with the name.
struct Names;

fn dense(name: &str) -> Result<DenseMask> {
    DenseMask::new(&[2, 2], &[true, false, true, true], name)
}

impl Resolver for Names {
    fn segments(&self) -> Result<Arc<Segments>> {
        tessera_mask::NoData.segments()
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        dense(path)
    }
    fn feature(&self, name: &str) -> Result<SegmentIds> {
        feature(name)
    }
    fn segment_ids(&self, name: &str) -> Result<SegmentIds> {
        feature(name)
    }
    fn blocks(&self, path: &str, q_block: usize, kv_block: usize) -> Result<BlockSelection> {
        BlockSelection::new(&[2, 2], &[0, -1, 1, 0], q_block, kv_block, path)
    }
}

/// A feature whose values depend on the name, so that swapped names change the mask.
fn feature(name: &str) -> Result<SegmentIds> {
    let n = name.len() as i64;
    SegmentIds::shared(vec![n, 1 - n, 2 * n])
}

/// `band(q, kv, -1, 2)` with features named `q` and `kv`.
fn band(q: &str, kv: &str) -> Mask {
    let f = BandFeatures::new(q, feature(q).expect("q"), kv, feature(kv).expect("kv"));
    Mask::band(f, -1, 2)
}

fn parsed(text: &str) -> Mask {
    parse(text, &Names).unwrap_or_else(|e| panic!("{text:?} does not parse: {e}"))
}

/// The one dense (or blocks) leaf's name.
fn name_of(m: &Mask) -> &str {
    match m {
        Mask::Dense(d) => d.label(),
        Mask::Blocks(s) => s.label(),
        other => panic!("not a dense leaf: {other:?}"),
    }
}

/// The two feature names of a band leaf.
fn band_names(m: &Mask) -> (&str, &str) {
    match m {
        Mask::Band { features, .. } => (&features.q_name, &features.kv_name),
        other => panic!("not a band leaf: {other:?}"),
    }
}

/// `m` prints to text that parses back to `m` (same tree, same names, same canonical form)
/// and prints identically; returns the printed text.
fn round_trips(m: &Mask) -> String {
    let printed = m.to_string();
    let again = parse(&printed, &Names)
        .unwrap_or_else(|e| panic!("printed form {printed:?} does not parse: {e}"));
    assert_eq!(&again, m, "printed form {printed:?} parses to another mask");
    assert_eq!(
        again.canonical(),
        m.canonical(),
        "canonical form of {printed:?}"
    );
    assert_eq!(
        again.to_string(),
        printed,
        "printing {printed:?} is not a fixpoint"
    );
    printed
}

#[test]
fn the_fuzz_finding_round_trips() {
    let m = parsed(r#"dense("*(")"#);
    assert_eq!(name_of(&m), "*(");
    assert_eq!(round_trips(&m), r#"dense("*(")"#);
}

/// (name, its printed form): raw where the raw reading gives the name back, otherwise in `"`
/// with `"` doubled.
const CASES: &[(&str, &str)] = &[
    ("*(", r#"dense("*(")"#),
    ("some/file.npy", "dense(some/file.npy)"),
    ("a b(1).npy", "dense(a b(1).npy)"),
    ("a b", "dense(a b)"),
    (" a", r#"dense(" a")"#),
    ("a ", r#"dense("a ")"#),
    (" ", r#"dense(" ")"#),
    ("a\tb", "dense(a\tb)"),
    ("a\n", "dense(\"a\n\")"),
    ("\u{a0}x", "dense(\"\u{a0}x\")"),
    ("(", r#"dense("(")"#),
    (")", r#"dense(")")"#),
    (")(", r#"dense(")(")"#),
    ("()", "dense(())"),
    ("a(b(c)d)e", "dense(a(b(c)d)e)"),
    ("a)", r#"dense("a)")"#),
    ("((x)", r#"dense("((x)")"#),
    ("a,b", "dense(a,b)"),
    ("a, b | c & !d", "dense(a, b | c & !d)"),
    ("heads(a, b)", "dense(heads(a, b))"),
    ("\"", r#"dense("""")"#),
    ("'", r#"dense("'")"#),
    ("\"quoted\"", r#"dense("""quoted""")"#),
    ("'single'", r#"dense("'single'")"#),
    ("say \"hi\"", r#"dense(say "hi")"#),
    ("it's", "dense(it's)"),
    ("'\"(", r#"dense("'""(")"#),
    ("\"\"", r#"dense("""""")"#),
    (r"C:\m\a.npy", r"dense(C:\m\a.npy)"),
    (r#"\""#, r#"dense(\")"#),
    (r#"\"("#, r#"dense("\""(")"#),
    ("\\", r"dense(\)"),
    ("causal", "dense(causal)"),
    ("full", "dense(full)"),
    ("dense", "dense(dense)"),
    ("42", "dense(42)"),
    ("-1", "dense(-1)"),
    ("1K", "dense(1K)"),
    ("0x1f", "dense(0x1f)"),
    ("données/masque✓.npy", "dense(données/masque✓.npy)"),
    ("日本 語", "dense(日本 語)"),
    ("🎭(", "dense(\"🎭(\")"),
];

#[test]
fn awkward_names_print_quoted_exactly_when_needed_and_round_trip() {
    for &(name, want) in CASES {
        let typed = Mask::dense(dense(name).expect("dense"));
        let printed = round_trips(&typed);
        assert_eq!(printed, want, "printed form of {name:?}");
        assert_eq!(
            name_of(&parsed(&printed)),
            name,
            "name read from {printed:?}"
        );
    }
}

/// A `band` name follows the same rule, and a `,` outside parentheses also needs quotes (it
/// would end the argument).
#[test]
fn awkward_band_names_print_like_dense_ones_and_commas_quoted() {
    for &(name, dense_form) in CASES {
        let m = band(name, "g");
        let printed = round_trips(&m);
        let arg = &dense_form["dense(".len()..dense_form.len() - 1];
        let top_comma = {
            let mut depth = 0i32;
            name.chars().any(|c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
        };
        let want = if top_comma {
            format!("band(\"{}\", g, -1, 2)", name.replace('"', "\"\""))
        } else {
            format!("band({arg}, g, -1, 2)")
        };
        assert_eq!(printed, want, "printed form of {name:?}");
        assert_eq!(band_names(&parsed(&printed)), (name, "g"));
        // As the key-side name too.
        let m = band("f", name);
        assert_eq!(band_names(&parsed(&round_trips(&m))), ("f", name));
    }
    assert_eq!(
        band_names(&parsed("band(f(1,2).npy, g , 0, 1)")),
        ("f(1,2).npy", "g")
    );
    assert_eq!(
        band_names(&parsed("band('a,b', \"c\"\"\", 0, 1)")),
        ("a,b", "c\"")
    );
    assert_eq!(
        band("a,b", "c,(d)").to_string(),
        "band(\"a,b\", \"c,(d)\", -1, 2)"
    );
    assert_eq!(band("(a,b)", "c").to_string(), "band((a,b), c, -1, 2)");
    for bad in ["band(, g, 0, 1)", "band(f, '', 0, 1)", "band(f,  , 0, 1)"] {
        let e = parse(bad, &Names).expect_err(bad);
        assert!(e.to_string().contains("a feature name"), "{bad:?}: {e}");
    }
}

#[test]
fn blocks_names_follow_the_dense_rule() {
    for &(name, want) in CASES {
        let sel = Names.blocks(name, 16, 32).expect("blocks");
        let printed = round_trips(&Mask::blocks(sel));
        let arg = want.strip_prefix("dense(").expect("dense(...)");
        assert_eq!(
            printed,
            format!("blocks(16, 32, {arg}"),
            "printed form of {name:?}"
        );
        assert_eq!(
            name_of(&parsed(&printed)),
            name,
            "name read from {printed:?}"
        );
    }
    let m = Mask::heads(vec![
        Mask::blocks(Names.blocks("a, b", 1, 2).expect("blocks")) & Mask::causal(),
        !Mask::blocks(Names.blocks("(", 3, 4).expect("blocks")),
    ]);
    assert_eq!(
        round_trips(&m),
        r#"heads(blocks(1, 2, a, b) & causal, !blocks(3, 4, "("))"#
    );
}

#[test]
fn awkward_names_round_trip_inside_expressions() {
    let names: Vec<&str> = CASES.iter().map(|c| c.0).collect();
    let leaf = |k: usize| Mask::dense(dense(names[k % names.len()]).expect("dense"));
    for k in 0..names.len() {
        let m = Mask::heads(vec![
            leaf(k) | !leaf(k + 1),
            (leaf(k + 2) | Mask::causal()) & leaf(k + 3),
        ]);
        round_trips(&m);
    }
}

#[test]
fn quoted_names_double_their_quote_character() {
    assert_eq!(name_of(&parsed(r#"dense("a""b")"#)), "a\"b");
    assert_eq!(name_of(&parsed("dense('it''s')")), "it's");
    assert_eq!(name_of(&parsed(r#"dense('say "hi"')"#)), "say \"hi\"");
    assert_eq!(name_of(&parsed(r#"dense("it's")"#)), "it's");
    assert_eq!(name_of(&parsed(r#"dense( " a " )"#)), " a ");
    assert_eq!(name_of(&parsed("dense(  a b  )")), "a b");
    // No backslash escapes.
    assert_eq!(name_of(&parsed(r#"dense("a\\b")"#)), r"a\\b");
    assert_eq!(name_of(&parsed(r#"dense("a\")"#)), r"a\");
    // A doubled quote must follow immediately; an unterminated name is still an error.
    for bad in [
        r#"dense("a" "b")"#,
        r#"dense("a"")"#,
        r#"dense("*()"#,
        "dense(*()",
        "dense('''",
    ] {
        assert!(parse(bad, &Names).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn an_empty_name_is_refused_and_prints_as_empty_quotes() {
    for bad in ["dense()", "dense(  )", r#"dense("")"#, "dense('')"] {
        let e = parse(bad, &Names).expect_err(bad);
        assert!(e.to_string().contains("a file path"), "{bad:?}: {e}");
    }
    // Only the typed API can make one; its text is the quoted empty name, which is refused.
    let typed = Mask::dense(dense("").expect("dense"));
    assert_eq!(typed.to_string(), r#"dense("")"#);
}

/// Characters that matter to the parser, with ordinary and wide ones.
fn awkward_name() -> impl Strategy<Value = String> {
    let chars = prop::sample::select(vec![
        '"', '\'', '(', ')', '\\', ',', '&', '|', '!', ' ', '\t', '\n', '\u{a0}', 'a', 'Z', '0',
        '-', '.', '/', '*', '=', 'é', '語', '🎭',
    ]);
    prop::collection::vec(chars, 0..16).prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_names_round_trip(name in prop_oneof![awkward_name(), any::<String>()]) {
        prop_assume!(!name.is_empty());
        let typed = Mask::dense(dense(&name).expect("dense"));
        let printed = round_trips(&typed);
        let back = parsed(&printed);
        prop_assert_eq!(name_of(&back), name.as_str());
        // Inside an expression too, next to operators and another name.
        let m = !Mask::dense(dense(&name).expect("dense")) | (Mask::causal() & typed);
        round_trips(&m);
        // As both names of a band leaf.
        let b = band(&name, &name);
        let back = parsed(&round_trips(&b));
        prop_assert_eq!(band_names(&back), (name.as_str(), name.as_str()));
        round_trips(&(band("x", &name) & !b));
        let sel = Names.blocks(&name, 64, 128).expect("blocks");
        round_trips(&(Mask::blocks(sel) & Mask::causal()));
    }

    #[test]
    fn parsed_names_print_to_a_fixpoint(name in awkward_name(), quote in 0..3usize) {
        // Whatever text the parser accepts for a name, its print is a fixpoint.
        let text = match quote {
            0 => format!("dense({name})"),
            1 => format!("dense(\"{}\")", name.replace('"', "\"\"")),
            _ => format!("dense('{}')", name.replace('\'', "''")),
        };
        if let Ok(m) = parse(&text, &Names) {
            round_trips(&m);
        }
        let text = match quote {
            0 => format!("band({name}, {name}, 0, 3)"),
            1 => format!("band(\"{}\", g, 0, 3)", name.replace('"', "\"\"")),
            _ => format!("band(f, '{}', 0, 3)", name.replace('\'', "''")),
        };
        if let Ok(m) = parse(&text, &Names) {
            round_trips(&m);
        }
    }
}

/// `document(NAME)` and `document(Q, KV)` name their ids like `band` features, so one
/// expression holds documents over different ids and prints back to itself; awkward names are
/// quoted by the same rule.
#[test]
fn named_documents_round_trip() {
    let doc = |q: &str, kv: &str| {
        let s = Segments::named(q, feature(q).expect("q"), kv, feature(kv).expect("kv"));
        Mask::document(s.expect("segments"))
    };
    let m = doc("a", "a") & !doc("bb", "a,b") | doc(" x", "y");
    assert_eq!(
        round_trips(&m),
        r#"document(a) & !document(bb, "a,b") | document(" x", y)"#
    );
    // The bare leaf and an empty argument list still take the unnamed ids.
    for bare in ["document", "document()", "document ( )"] {
        let e = parse(bare, &Names).expect_err(bare);
        assert!(e.to_string().contains("document"), "{bare:?}: {e}");
    }
    for bad in ["document(,a)", "document(a,)", "document(a", "document('a)"] {
        assert!(parse(bad, &Names).is_err(), "{bad:?} parsed");
    }
    // Different ids under the same leaf are different masks.
    assert_ne!(doc("a", "a").canonical(), doc("bb", "bb").canonical());
}
