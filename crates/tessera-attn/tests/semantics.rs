//! Exact semantics beyond tolerance checks: fully masked rows, NaN propagation, determinism
//! across thread counts, kernel copies (ISA fallbacks), metrics.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_attn::conformance::{run_case, standard_cases};
use tessera_attn::cpu::Isa;
use tessera_attn::{reference, AttnOptions, Backend, CpuBackend, ForwardOutput};
use tessera_core::Tensor;
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

fn rand_t(rng: &mut ChaCha8Rng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        (0..n).map(|_| rng.gen_range(-1.5f32..1.5)).collect(),
    )
    .unwrap()
}

fn plan(mask: &Mask, b: usize, h: usize, lq: usize, lkv: usize, tile: usize) -> Plan {
    build_plan(
        mask,
        PlanShape::new(b, h, lq, lkv).unwrap(),
        TileShape::new(tile, tile).unwrap(),
    )
    .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

#[test]
fn backend_is_object_safe_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CpuBackend>();
    let b: Box<dyn Backend> = Box::new(CpuBackend::new());
    assert_eq!(b.name(), "cpu");
}

#[test]
fn fully_masked_rows_are_exact() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (b, h, l, d) = (2, 2, 40, 16);
    let q = rand_t(&mut rng, &[b, h, l, d]);
    let k = rand_t(&mut rng, &[b, h, l, d]);
    let v = rand_t(&mut rng, &[b, h, l, d]);
    // Row 1 of the batch pads its first 8 and last 10 tokens.
    let mut ids = vec![0i64; l];
    ids.extend((0..l).map(|i| {
        if !(8..30).contains(&i) {
            -1
        } else {
            (i / 9) as i64
        }
    }));
    let mask = Mask::causal()
        & Mask::document(Segments::shared(
            SegmentIds::new(2, l, ids.clone()).unwrap(),
        ));
    let p = plan(&mask, b, h, l, l, 16);
    let be = CpuBackend::new();
    for sinks in [None, Some(vec![0.75f32, -1.25])] {
        let opts = AttnOptions {
            sinks: sinks.clone(),
            ..Default::default()
        };
        let f = be.forward(q.view(), k.view(), v.view(), &p, &opts).unwrap();
        let (o, lse) = (f32s(&f.o), f32s(&f.lse));
        for hh in 0..h {
            for i in 0..l {
                let padded = ids[l + i] < 0;
                let row = ((h + hh) * l + i) * d;
                let lse_v = lse[(h + hh) * l + i];
                if padded {
                    assert!(o[row..row + d].iter().all(|&x| x == 0.0), "O row must be 0");
                    match &sinks {
                        None => assert_eq!(lse_v, f32::NEG_INFINITY),
                        Some(s) => assert_eq!(lse_v, s[hh]),
                    }
                } else {
                    assert!(lse_v.is_finite());
                    assert!(o[row..row + d].iter().all(|x| x.is_finite()));
                }
            }
        }
        // Backward: padded rows get zero dQ; nothing is NaN.
        let d_o = rand_t(&mut rng, &[b, h, l, d]);
        let g = be
            .backward(
                q.view(),
                k.view(),
                v.view(),
                f.o.view(),
                f.lse.view(),
                d_o.view(),
                &p,
                &opts,
            )
            .unwrap();
        let dq = f32s(&g.dq);
        for hh in 0..h {
            for i in (0..l).filter(|&i| ids[l + i] < 0) {
                let row = ((h + hh) * l + i) * d;
                assert!(dq[row..row + d].iter().all(|&x| x == 0.0));
            }
        }
        for t in [&g.dq, &g.dk, &g.dv] {
            assert!(f32s(t).iter().all(|x| x.is_finite()));
        }
    }
    // A mask allowing nothing at all.
    let none = Mask::full() & !Mask::full();
    let p = plan(&none, b, h, l, l, 16);
    let f = be
        .forward(q.view(), k.view(), v.view(), &p, &AttnOptions::default())
        .unwrap();
    assert!(f32s(&f.o).iter().all(|&x| x == 0.0));
    assert!(f32s(&f.lse).iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(f32s(&f.max_logit).iter().all(|&x| x == f32::NEG_INFINITY));
}

/// The positions of NaN in `x` equal those in the reference `r`, and everything else is finite.
fn same_nan_pattern(name: &str, x: &[f32], r: &[f64]) {
    same_nan_pattern_opt(name, x, r, true)
}

fn same_nan_pattern_opt(name: &str, x: &[f32], r: &[f64], expect_nan: bool) {
    assert_eq!(x.len(), r.len());
    let mut nans = 0;
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        assert_eq!(
            a.is_nan(),
            b.is_nan(),
            "{name}[{i}]: kernel {a}, reference {b}"
        );
        if !b.is_nan() {
            assert!(!a.is_nan(), "{name}[{i}]");
        }
        nans += b.is_nan() as usize;
    }
    assert!(
        !expect_nan || nans > 0,
        "{name}: the test should poison something"
    );
}

fn poison(t: &Tensor, at: usize) -> Tensor {
    let mut v = f32s(t);
    v[at] = f32::NAN;
    Tensor::from_f32(t.shape().to_vec(), v).unwrap()
}

#[test]
fn nan_propagates_to_affected_outputs_only() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (b, h, l, d) = (1, 2, 50, 16);
    let q = rand_t(&mut rng, &[b, h, l, d]);
    let k = rand_t(&mut rng, &[b, h, l, d]);
    let v = rand_t(&mut rng, &[b, h, l, d]);
    let d_o = rand_t(&mut rng, &[b, h, l, d]);
    // Documents of 7 tokens: poison stays inside its document even within a shared tile.
    let seg = SegmentIds::shared((0..l as i64).map(|i| i / 7).collect()).unwrap();
    let mask = Mask::causal() & Mask::document(Segments::shared(seg));
    let p = plan(&mask, b, h, l, l, 16);
    let be = CpuBackend::new();
    let opts = AttnOptions::default();
    let clean = be.forward(q.view(), k.view(), v.view(), &p, &opts).unwrap();
    let row = |hh: usize, i: usize| (hh * l + i) * d + 3;
    for (which, qq, kk, vv) in [
        ("q", poison(&q, row(0, 20)), k.clone(), v.clone()),
        ("k", q.clone(), poison(&k, row(1, 22)), v.clone()),
        ("v", q.clone(), k.clone(), poison(&v, row(0, 23))),
    ] {
        let f: ForwardOutput = be
            .forward(qq.view(), kk.view(), vv.view(), &p, &opts)
            .unwrap();
        let r = reference::forward(qq.view(), kk.view(), vv.view(), &mask, &opts).unwrap();
        same_nan_pattern(&format!("{which}: o"), &f32s(&f.o), &r.o);
        // Unaffected outputs are exactly those of the clean inputs.
        for (name, got, want) in [("o", &f.o, &clean.o), ("lse", &f.lse, &clean.lse)] {
            for (i, (a, b)) in f32s(got).iter().zip(f32s(want)).enumerate() {
                assert!(
                    a.is_nan() || *a == b,
                    "{which}: {name}[{i}] {a} != clean {b}"
                );
            }
        }
        if which != "v" {
            same_nan_pattern(&format!("{which}: lse"), &f32s(&f.lse), &r.lse);
        } else {
            assert!(f32s(&f.lse).iter().all(|x| x.is_finite()));
        }
        let ml = f32s(&f.max_logit);
        for (a, b) in ml.iter().zip(&r.max_logit) {
            assert_eq!(a.is_nan(), b.is_nan(), "{which}: max_logit");
        }
        let g = be
            .backward(
                qq.view(),
                kk.view(),
                vv.view(),
                f.o.view(),
                f.lse.view(),
                d_o.view(),
                &p,
                &opts,
            )
            .unwrap();
        let rb =
            reference::backward(qq.view(), kk.view(), vv.view(), d_o.view(), &mask, &opts).unwrap();
        same_nan_pattern(&format!("{which}: dq"), &f32s(&g.dq), &rb.dq);
        same_nan_pattern(&format!("{which}: dk"), &f32s(&g.dk), &rb.dk);
        // dV does not depend on V: poisoning V leaves it finite.
        same_nan_pattern_opt(&format!("{which}: dv"), &f32s(&g.dv), &rb.dv, which != "v");
    }
    // NaN in dO poisons only the gradients that depend on that row.
    let f = be.forward(q.view(), k.view(), v.view(), &p, &opts).unwrap();
    let dop = poison(&d_o, row(1, 30));
    let g = be
        .backward(
            q.view(),
            k.view(),
            v.view(),
            f.o.view(),
            f.lse.view(),
            dop.view(),
            &p,
            &opts,
        )
        .unwrap();
    let rb = reference::backward(q.view(), k.view(), v.view(), dop.view(), &mask, &opts).unwrap();
    same_nan_pattern("d_o: dq", &f32s(&g.dq), &rb.dq);
    same_nan_pattern("d_o: dk", &f32s(&g.dk), &rb.dk);
    same_nan_pattern("d_o: dv", &f32s(&g.dv), &rb.dv);
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (b, hq, hkv, l, d) = (2, 4, 2, 150, 32);
    let q = rand_t(&mut rng, &[b, hq, l, d]);
    let k = rand_t(&mut rng, &[b, hkv, l, d]);
    let v = rand_t(&mut rng, &[b, hkv, l, d]);
    let d_o = rand_t(&mut rng, &[b, hq, l, d]);
    let mask = Mask::causal() & Mask::window(60, 0);
    let p = plan(&mask, b, hq, l, l, 32);
    let opts = AttnOptions {
        sinks: Some(vec![0.1, 0.2, 0.3, 0.4]),
        softcap: Some(10.0),
        ..Default::default()
    };
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let be = CpuBackend::new();
            let f = be.forward(q.view(), k.view(), v.view(), &p, &opts).unwrap();
            let g = be
                .backward(
                    q.view(),
                    k.view(),
                    v.view(),
                    f.o.view(),
                    f.lse.view(),
                    d_o.view(),
                    &p,
                    &opts,
                )
                .unwrap();
            (f, g)
        })
    };
    let (f1, g1) = run(1);
    for threads in [2, 3] {
        let (f, g) = run(threads);
        assert_eq!(f, f1, "forward with {threads} threads");
        assert_eq!(g, g1, "backward with {threads} threads");
    }
}

#[test]
fn every_kernel_copy_passes_a_sample_of_the_suite() {
    let names = [
        "mask/and_causal_document",
        "mask/dense_random",
        "len/33x17",
        "gqa/8to2_softcap_sinks",
        "dims/40x24",
        "tile/32x64",
        "masked/padding_rows_sinks",
        "bf16/batch_document",
    ];
    let cases: Vec<_> = standard_cases()
        .into_iter()
        .filter(|c| names.contains(&c.name.as_str()))
        .collect();
    assert_eq!(cases.len(), names.len());
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16] {
        let Ok(be) = CpuBackend::with_isa(isa) else {
            eprintln!("skipping {isa:?}: not supported here");
            continue;
        };
        for c in &cases {
            let r = run_case(&be, c).unwrap();
            assert!(r.passed(), "{isa:?}: {r}");
        }
    }
}

#[test]
fn kernel_calls_are_recorded() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let q = rand_t(&mut rng, &[1, 1, 20, 8]);
    let p = plan(&Mask::causal(), 1, 1, 20, 20, 16);
    let before = tessera_core::metrics::snapshot();
    let be = CpuBackend::new();
    let f = be
        .forward(q.view(), q.view(), q.view(), &p, &AttnOptions::default())
        .unwrap();
    be.backward(
        q.view(),
        q.view(),
        q.view(),
        f.o.view(),
        f.lse.view(),
        q.view(),
        &p,
        &AttnOptions::default(),
    )
    .unwrap();
    let after = tessera_core::metrics::snapshot();
    let calls =
        |m: &tessera_core::metrics::MetricsReport, k: &str| m.kernels.get(k).map_or(0, |s| s.calls);
    assert!(calls(&after, "cpu.forward.f32") > calls(&before, "cpu.forward.f32"));
    assert!(calls(&after, "cpu.backward.f32") > calls(&before, "cpu.backward.f32"));
}

#[test]
fn max_logit_is_taken_before_softcap() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let q = rand_t(&mut rng, &[1, 1, 30, 16]);
    let k = rand_t(&mut rng, &[1, 1, 30, 16]);
    let p = plan(&Mask::full(), 1, 1, 30, 30, 16);
    let opts = AttnOptions {
        scale: Some(2.0),
        softcap: Some(1.0),
        sinks: None,
    };
    let f = CpuBackend::new()
        .forward(q.view(), k.view(), k.view(), &p, &opts)
        .unwrap();
    let r = reference::forward(q.view(), k.view(), k.view(), &Mask::full(), &opts).unwrap();
    let m = f32s(&f.max_logit)[0];
    assert!(m > 1.0, "max_logit {m} must exceed the softcap");
    assert!((m as f64 - r.max_logit[0]).abs() < 1e-4 * r.max_logit[0].abs());
}
