//! The conformance suite on the CPU backend: the default dispatch and every kernel copy this CPU
//! can run (portable, AVX2, AVX-512, AVX-512 + BF16, AVX-512 + BF16 + AMX; copies the CPU lacks are skipped with a
//! printed reason), one test per case group and copy.

use tessera_attn::cpu::Isa;
use tessera_attn::CpuBackend;
use tessera_conformance::{
    backend_conformance_tests, cpu_backend_or_skip, run_case, standard_cases, Case,
};

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

backend_conformance_tests!(default, Ok::<_, tessera_core::Error>(CpuBackend::new()));
backend_conformance_tests!(portable, CpuBackend::with_isa(Isa::Portable));
backend_conformance_tests!(avx2, CpuBackend::with_isa(Isa::Avx2));
backend_conformance_tests!(avx512, CpuBackend::with_isa(Isa::Avx512));
backend_conformance_tests!(avx512_bf16, CpuBackend::with_isa(Isa::Avx512Bf16));
backend_conformance_tests!(avx512_amx, CpuBackend::with_isa(Isa::Avx512Amx));

/// 4K tokens with the default tile height: the largest problems of the suite (a few seconds; the
/// f64 reference is O(L²·D)).
#[test]
fn stress_4k() {
    use tessera_conformance::workloads::packed_segments;
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

/// A loss on the LSE as well as on O (`GradInputs::d_lse`): gradients equal the float64
/// reference's, on every kernel copy, with sinks and softcap, f32 and bf16.
#[test]
fn lse_gradient_matches_the_reference() {
    use std::sync::Arc;
    use tessera_attn::{AttnInputs, AttnOptions, Backend, GradInputs};
    use tessera_conformance::workloads::{packed_segments, random_tensor};
    use tessera_conformance::{reference, rel_error};
    use tessera_core::{DType, Tensor};
    use tessera_mask::{Mask, Segments};
    use tessera_plan::{build_plan, PlanShape, TileShape};

    let (b, hq, hkv, l, d) = (2, 4, 2, 150, 24);
    let seg = Segments::shared(packed_segments(b, l, 60, 5).unwrap());
    let mask = Mask::causal() & Mask::document(seg);
    let plan = Arc::new(
        build_plan(
            &mask,
            PlanShape::new(b, hq, l, l).unwrap(),
            TileShape::new(32, 64).unwrap(),
        )
        .unwrap(),
    );
    for dt in [DType::F32, DType::BF16] {
        let q = random_tensor(vec![b, hq, l, d], dt, 1).unwrap();
        let k = random_tensor(vec![b, hkv, l, d], dt, 2).unwrap();
        let v = random_tensor(vec![b, hkv, l, d], dt, 3).unwrap();
        let d_o = random_tensor(vec![b, hq, l, d], dt, 4).unwrap();
        let g = random_tensor(vec![b, hq, l], DType::F32, 5).unwrap();
        let opts = AttnOptions {
            scale: None,
            softcap: Some(4.0),
            sinks: Some(vec![0.5, -1.0, 1.5, 0.0]),
        };
        let r = reference::backward_with_lse_grad(
            q.view(),
            k.view(),
            v.view(),
            d_o.view(),
            Some(&g.to_f32_vec().unwrap()),
            &mask,
            &opts,
        )
        .unwrap();
        let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
        for isa in Isa::ALL {
            let Some(be) = cpu_backend_or_skip(isa) else {
                continue;
            };
            let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap();
            let f = be.forward(&inputs, &plan, &opts).unwrap();
            let mut gi =
                GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), d_o.view()).unwrap();
            gi.d_lse = Some(g.view());
            let out = be.backward(&gi, &plan, &opts).unwrap();
            let check = |name: &str, t: &Tensor, want: &[f64]| {
                let e = rel_error(&t.to_f32_vec().unwrap(), want, 0.0);
                assert!(e <= tol, "{isa:?} {dt} {name}: relative error {e:.2e}");
            };
            check("dq", &out.dq, &r.dq);
            check("dk", &out.dk, &r.dk);
            check("dv", &out.dv, &r.dv);
            let ds = out.dsinks.as_ref().unwrap();
            check("dsinks", ds, r.dsinks.as_ref().unwrap());
        }
    }
}

/// A plan of a mask that does not vary along batch rows or heads, built for B = 1, H = 1, serves
/// any batch size and head count with the same bits as the plan of the full shape; a plan whose
/// mask varies per row is refused for another batch size.
#[test]
fn one_row_plan_serves_any_batch_and_heads() {
    use std::sync::Arc;
    use tessera_attn::{AttnInputs, AttnOptions, Backend};
    use tessera_conformance::workloads::{packed_segments, random_tensor};
    use tessera_core::DType;
    use tessera_mask::{Mask, Segments};
    use tessera_plan::{build_plan, PlanShape, TileShape};

    let (b, hq, hkv, l, d) = (3, 4, 2, 130, 16);
    let tile = TileShape::new(32, 32).unwrap();
    let shared = Segments::shared(packed_segments(1, l, 50, 3).unwrap());
    let mask = Mask::causal() & Mask::document(shared);
    let small = Arc::new(build_plan(&mask, PlanShape::new(1, 1, l, l).unwrap(), tile).unwrap());
    let whole = Arc::new(build_plan(&mask, PlanShape::new(b, hq, l, l).unwrap(), tile).unwrap());
    let q = random_tensor(vec![b, hq, l, d], DType::F32, 1).unwrap();
    let k = random_tensor(vec![b, hkv, l, d], DType::F32, 2).unwrap();
    let v = random_tensor(vec![b, hkv, l, d], DType::F32, 3).unwrap();
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).unwrap();
    let opts = AttnOptions::default();
    let be = CpuBackend::new();
    let a = be.forward(&inputs, &small, &opts).unwrap();
    let c = be.forward(&inputs, &whole, &opts).unwrap();
    assert_eq!(a, c);
    let per_row = Segments::shared(packed_segments(2, l, 50, 4).unwrap());
    let varying = Mask::causal() & Mask::document(per_row);
    let two = Arc::new(build_plan(&varying, PlanShape::new(2, 1, l, l).unwrap(), tile).unwrap());
    let e = be.forward(&inputs, &two, &opts).unwrap_err().to_string();
    assert!(e.contains("plan"), "{e}");
}
