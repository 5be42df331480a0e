//! Trees far deeper than the parser allows, built through the typed API: nothing overflows the
//! stack (each check runs on a thread with a 256 KiB stack, where a recursive walk of these
//! trees would overflow), validation refuses them naming the limit, and the parser's own worst
//! case stays within `MAX_TREE_DEPTH`.

use tessera_mask::{parse, Mask, NoData, MAX_DEPTH, MAX_TREE_DEPTH};

/// Runs `f` on a thread with a small stack.
fn small_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(f)
        .expect("spawn")
        .join()
        .expect("no stack overflow or panic");
}

#[test]
fn a_hundred_thousand_nots() {
    small_stack(|| {
        let mut m = Mask::causal();
        for _ in 0..100_000 {
            m = !m;
        }
        assert_eq!(m.depth(), 100_001);
        assert_eq!(m.nodes().count(), 100_001);
        // An even number of `!` cancels out.
        assert_eq!(m.canonical(), "causal(offset=0)");
        assert_eq!(m.specialized_canonical(0, 0), "causal(offset=0)");
        assert_eq!(m.to_string().len(), 100_000 + "causal".len());
        assert!(format!("{m:?}").starts_with("Mask(!!!"));
        assert!(m.allowed(0, 0, 3, 2) && !m.allowed(0, 0, 2, 3));
        assert_eq!(m.dependence(), Default::default());
        let c = m.clone();
        assert!(c == m);
        assert!(c != !m.clone());
        assert_eq!(m.resolve_heads(0).depth(), 100_001);
        let e = m.validate(1, 1, 8, 8).unwrap_err().to_string();
        assert!(
            e.contains(&format!("at most {MAX_TREE_DEPTH} levels")),
            "{e}"
        );
        assert!(e.contains("100001 levels"), "{e}");
        drop(c);
        drop(m);
    });
}

#[test]
fn deep_alternation_of_and_or_not_and_heads() {
    small_stack(|| {
        let mut m = Mask::window(2, 1);
        for k in 0..3_000 {
            m = match k % 4 {
                0 => Mask::Not(Box::new(m)),
                1 => Mask::And(vec![Mask::prefix(k), m]),
                2 => Mask::Or(vec![m, Mask::chunk(3)]),
                _ => Mask::Heads(vec![m]),
            };
        }
        assert_eq!(m.depth(), 3_001);
        let text = m.canonical();
        assert!(text.starts_with("heads("), "{}", &text[..40]);
        // Semantics by the iterative path agree with a shallow equivalent at each level.
        let mut shallow = Mask::window(2, 1);
        for k in 0..3_000u64 {
            shallow = match k % 4 {
                0 => !shallow,
                1 => Mask::And(vec![Mask::prefix(k), shallow]),
                2 => Mask::Or(vec![shallow, Mask::chunk(3)]),
                _ => shallow,
            };
            // Keep the reference shallow: fold it into its truth table over a 12x12 grid.
            let table: Vec<bool> = (0..144)
                .map(|p| shallow.allowed(0, 0, p / 12, p % 12))
                .collect();
            shallow =
                Mask::dense(tessera_mask::DenseMask::new(&[12, 12], &table, "t").expect("dense"));
        }
        for p in 0..144 {
            assert_eq!(
                m.allowed(0, 0, p / 12, p % 12),
                shallow.allowed(0, 0, p / 12, p % 12)
            );
        }
        assert!(m.validate(1, 1, 12, 12).is_err());
        let printed = m.to_string();
        assert!(printed.len() > 3_000);
        assert!(m.clone() == m);
    });
}

#[test]
fn operator_chains_stay_flat() {
    small_stack(|| {
        let mut m = Mask::causal();
        for k in 0..100_000u64 {
            m = if k % 2 == 0 {
                m & Mask::prefix(k)
            } else {
                m & Mask::window(k as i64, 0)
            };
        }
        assert_eq!(m.depth(), 2);
        assert_eq!(m.children().len(), 100_001);
        let mut o = Mask::full();
        for k in 0..1_000 {
            o = Mask::chunk(k + 1) | o;
        }
        assert_eq!(o.depth(), 2);
        // Mixed operators still nest, one level per change of operator.
        let mixed = (Mask::causal() & Mask::prefix(3)) | Mask::full();
        assert_eq!(mixed.depth(), 3);
        assert_eq!(mixed.to_string(), "causal & prefix(3) | full");
    });
}

#[test]
fn the_parsers_deepest_tree_is_within_the_tree_limit() {
    // Every nesting level adds heads, or and and nodes: the parser's worst case.
    let levels = MAX_DEPTH - 1;
    let text = format!(
        "{}causal{}",
        "heads(full | full & ".repeat(levels),
        ")".repeat(levels)
    );
    let m = parse(&text, &NoData).expect("within the parser's limit");
    assert!(m.depth() > 3 * levels, "depth {}", m.depth());
    assert!(m.depth() <= MAX_TREE_DEPTH);
    m.validate(1, 1, 4, 4).expect("a parsed tree validates");
    // And the printed form parses back to the same tree.
    let again = parse(&m.to_string(), &NoData).expect("printed form parses");
    assert!(again == m);
}
