//! The whole standard conformance suite on every kernel copy this CPU can run (the default
//! backend runs it in `conformance.rs`): portable, AVX2, AVX-512 (f32 kernels for bf16 storage
//! too) and AVX-512 + BF16 (the `vdpbf16ps` bf16 forward and backward kernels). Copies the CPU lacks are
//! skipped with a note; the portable copy always runs.

use tessera_attn::conformance::{run_case, standard_cases, Case};
use tessera_attn::cpu::Isa;
use tessera_attn::CpuBackend;

fn suite_on(isa: Isa) {
    let Ok(be) = CpuBackend::with_isa(isa) else {
        eprintln!("skipping {isa:?}: not supported here");
        return;
    };
    let mut failed = Vec::new();
    for c in standard_cases().into_iter().chain(extra_cases()) {
        let r = run_case(&be, &c).unwrap_or_else(|e| panic!("{isa:?} case {}: {e}", c.name));
        if !r.passed() {
            failed.push(r.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{isa:?}: {} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// Long enough for full tiles next to partial ones, so every tile path of every copy runs
/// (fused column max on full tiles, live spans on partial ones) with softcap, sinks, odd sizes.
fn extra_cases() -> Vec<Case> {
    use tessera_mask::Mask;
    let causal = || Mask::causal();
    vec![
        Case::new("dispatch/causal_softcap_sinks_bf16", causal())
            .lens(300, 300)
            .dims(64, 64)
            .tile(64, 64)
            .softcap(5.0)
            .sinks()
            .bf16(),
        Case::new(
            "dispatch/window_odd_dims_bf16",
            Mask::window(70, 0) & causal(),
        )
        .lens(333, 333)
        .heads(1, 4, 2)
        .dims(37, 19)
        .tile(32, 64)
        .bf16(),
        Case::new("dispatch/causal_softcap_f32", causal())
            .lens(300, 300)
            .dims(64, 64)
            .tile(64, 64)
            .softcap(5.0)
            .sinks(),
    ]
}

#[test]
fn portable_copy_passes_the_suite() {
    suite_on(Isa::Portable);
}

#[test]
fn avx2_copy_passes_the_suite() {
    suite_on(Isa::Avx2);
}

#[test]
fn avx512_copy_passes_the_suite() {
    suite_on(Isa::Avx512);
}

#[test]
fn avx512_bf16_copy_passes_the_suite() {
    suite_on(Isa::Avx512Bf16);
}

/// bf16 storage with a NaN in Q, K or V on every copy (the `vdpbf16ps` kernel checks only V up
/// front): O is NaN exactly where the reference is, every other output equals the clean run.
#[test]
fn bf16_nan_propagates_to_affected_outputs_only() {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use tessera_attn::{reference, AttnOptions, Backend};
    use tessera_core::Tensor;
    use tessera_mask::{Mask, SegmentIds, Segments};
    use tessera_plan::{build_plan, PlanShape, TileShape};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let (h, l, d) = (2, 160, 64);
    let mut t = || -> Vec<f32> {
        (0..h * l * d)
            .map(|_| rng.gen_range(-1.5f32..1.5))
            .collect()
    };
    let mk = |v: &[f32]| {
        Tensor::from_bf16(
            vec![1, h, l, d],
            v.iter().map(|&x| bf16::from_f32(x)).collect(),
        )
        .unwrap()
    };
    let (q, k, v) = (t(), t(), t());
    let seg = SegmentIds::shared((0..l as i64).map(|i| i / 50).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg));
    let p = build_plan(
        &mask,
        PlanShape::new(1, h, l, l).unwrap(),
        TileShape::new(32, 32).unwrap(),
    )
    .unwrap();
    let opts = AttnOptions::default();
    let at = |hh: usize, i: usize| (hh * l + i) * d + 5;
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16] {
        let Ok(be) = CpuBackend::with_isa(isa) else {
            continue;
        };
        let clean = be
            .forward(mk(&q).view(), mk(&k).view(), mk(&v).view(), &p, &opts)
            .unwrap();
        let clean_o = clean.o.to_f32_vec().unwrap();
        for which in 0..3 {
            let (mut qq, mut kk, mut vv) = (q.clone(), k.clone(), v.clone());
            match which {
                0 => qq[at(0, 70)] = f32::NAN,
                1 => kk[at(1, 99)] = f32::NAN,
                _ => vv[at(0, 120)] = f32::NAN,
            }
            let (qt, kt, vt) = (mk(&qq), mk(&kk), mk(&vv));
            let f = be
                .forward(qt.view(), kt.view(), vt.view(), &p, &opts)
                .unwrap();
            let r = reference::forward(qt.view(), kt.view(), vt.view(), &mask, &opts).unwrap();
            let o = f.o.to_f32_vec().unwrap();
            let mut nans = 0;
            for (i, (a, b)) in o.iter().zip(&r.o).enumerate() {
                assert_eq!(a.is_nan(), b.is_nan(), "{isa:?} poison {which}: o[{i}]");
                if !a.is_nan() {
                    assert_eq!(*a, clean_o[i], "{isa:?} poison {which}: o[{i}] vs clean");
                }
                nans += a.is_nan() as usize;
            }
            assert!(nans > 0, "{isa:?} poison {which}: nothing poisoned");
        }
    }
}
