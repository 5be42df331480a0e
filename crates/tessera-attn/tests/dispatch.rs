//! NaN semantics on every kernel copy this CPU can run (portable, AVX2, AVX-512, AVX-512 +
//! BF16; copies the CPU lacks are skipped). The conformance suite itself runs on every copy in
//! `tessera-conformance/tests/cpu.rs`.

use tessera_attn::cpu::Isa;
use tessera_conformance::cpu_backend_or_skip;

#[test]
fn bf16_nan_propagates_to_affected_outputs_only() {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;
    use tessera_attn::{AttnInputs, AttnOptions, Backend, GradInputs};
    use tessera_conformance::reference;
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
    let (q, k, v, d_o) = (t(), t(), t(), t());
    let seg = SegmentIds::shared((0..l as i64).map(|i| i / 50).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg));
    let p = Arc::new(
        build_plan(
            &mask,
            PlanShape::new(1, h, l, l).unwrap(),
            TileShape::new(32, 32).unwrap(),
        )
        .unwrap(),
    );
    let opts = AttnOptions::default();
    let at = |hh: usize, i: usize| (hh * l + i) * d + 5;
    for isa in Isa::ALL {
        let Some(be) = cpu_backend_or_skip(isa) else {
            continue;
        };
        let (q0, k0, v0) = (mk(&q), mk(&k), mk(&v));
        let clean = be
            .forward(
                &AttnInputs::contiguous(q0.view(), k0.view(), v0.view()).unwrap(),
                &p,
                &opts,
            )
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
                .forward(
                    &AttnInputs::contiguous(qt.view(), kt.view(), vt.view()).unwrap(),
                    &p,
                    &opts,
                )
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
            // The gradients: NaN exactly where the reference has NaN (a zero weight times the
            // poisoned value must stay 0), on the same kernel copy.
            let dt = mk(&d_o);
            let inputs = AttnInputs::contiguous(qt.view(), kt.view(), vt.view()).unwrap();
            let gi = GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), dt.view()).unwrap();
            let g = be.backward(&gi, &p, &opts).unwrap();
            let rb = reference::backward(qt.view(), kt.view(), vt.view(), dt.view(), &mask, &opts)
                .unwrap();
            for (name, x, r) in [
                ("dq", &g.dq, &rb.dq),
                ("dk", &g.dk, &rb.dk),
                ("dv", &g.dv, &rb.dv),
            ] {
                let x = x.to_f32_vec().unwrap();
                for (i, (a, b)) in x.iter().zip(r.iter()).enumerate() {
                    assert_eq!(
                        a.is_nan(),
                        b.is_nan(),
                        "{isa:?} poison {which}: {name}[{i}]"
                    );
                }
            }
        }
    }
}
