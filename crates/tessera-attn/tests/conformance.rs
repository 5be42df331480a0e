//! The standard conformance suite on the CPU backend, one test per group.

use tessera_attn::conformance::{run_case, standard_cases, Case};
use tessera_attn::CpuBackend;

fn run_group(group: &str) {
    let cases: Vec<Case> = standard_cases()
        .into_iter()
        .filter(|c| c.group() == group)
        .collect();
    assert!(!cases.is_empty(), "no cases in group {group}");
    let backend = CpuBackend::new();
    let mut failed = Vec::new();
    for c in &cases {
        let r = run_case(&backend, c).unwrap_or_else(|e| panic!("case {}: {e}", c.name));
        println!("{r}");
        if !r.passed() {
            failed.push(r.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn groups_are_all_tested() {
    let mut groups: Vec<String> = standard_cases()
        .iter()
        .map(|c| c.group().to_string())
        .collect();
    groups.sort();
    groups.dedup();
    assert_eq!(
        groups,
        ["batch", "bf16", "dims", "feat", "gqa", "large", "len", "mask", "masked", "tile"]
    );
    let mut names: Vec<String> = standard_cases().into_iter().map(|c| c.name).collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n, "case names are unique");
}

#[test]
fn mask_leaves_and_combinations() {
    run_group("mask");
}

#[test]
fn lengths() {
    run_group("len");
}

#[test]
fn batch_segments() {
    run_group("batch");
}

#[test]
fn gqa_mqa() {
    run_group("gqa");
}

#[test]
fn head_dims() {
    run_group("dims");
}

#[test]
fn tile_shapes() {
    run_group("tile");
}

#[test]
fn softcap_sinks_scale() {
    run_group("feat");
}

#[test]
fn fully_masked_rows() {
    run_group("masked");
}

#[test]
fn bf16_storage() {
    run_group("bf16");
}

#[test]
fn large_problems() {
    run_group("large");
}

/// 4K tokens with the default tile height: the largest problems of the suite (a few seconds; the
/// f64 reference is O(L²·D)).
#[test]
fn stress_4k() {
    use tessera_attn::conformance::packed_segments;
    use tessera_mask::{Mask, Segments};
    let seg = Segments::shared(packed_segments(1, 4096, 1500, 99).unwrap());
    let cases = [
        Case::new(
            "stress/causal_document",
            Mask::causal() & Mask::document(seg),
        )
        .lens(4096, 4096)
        .heads(1, 4, 2)
        .dims(64, 64)
        .tile(128, 128)
        .sinks(),
        Case::new("stress/window_bf16", Mask::window(512, 0) & Mask::causal())
            .lens(4096, 4096)
            .heads(1, 2, 2)
            .dims(128, 128)
            .tile(64, 128)
            .bf16(),
    ];
    let backend = CpuBackend::new();
    for c in &cases {
        let r = run_case(&backend, c).unwrap();
        println!("{r}");
        assert!(r.passed(), "{r}");
    }
}
