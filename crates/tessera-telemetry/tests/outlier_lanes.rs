//! The per-slice outlier statistics: the f32 path equals the f64 path on the same values bit for
//! bit (lengths around the lane count, thresholds hit exactly, NaN and infinities), and the
//! definition (max |x|, Σ x², count of |x| > ratio × RMS).

use tessera_telemetry::OutlierStats;

fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn both(x: &[f32], ratio: f64) -> OutlierStats {
    let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let a = OutlierStats::of_f32(x, ratio);
    let b = OutlierStats::of_f64(&wide, ratio);
    let c = OutlierStats::of_slice(wide.len(), |i| wide[i], ratio);
    for o in [&b, &c] {
        assert_eq!(a.abs_max.to_bits(), o.abs_max.to_bits(), "n = {}", x.len());
        assert_eq!(a.sq_sum, o.sq_sum, "n = {}", x.len());
        assert_eq!(
            (a.count, a.outliers),
            (o.count, o.outliers),
            "n = {}",
            x.len()
        );
    }
    a
}

#[test]
fn f32_and_f64_paths_agree_and_match_the_definition() {
    for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 100, 1001] {
        let mut x = lcg(n, n as u64);
        if n > 3 {
            x[n / 2] = 11.0;
        }
        for ratio in [0.0, 1.0, 2.5, 6.0] {
            let s = both(&x, ratio);
            let sq: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            let max = x.iter().fold(0f64, |a, &v| a.max(v.abs() as f64));
            let thr = ratio * (sq / n as f64).sqrt();
            let cnt = x.iter().filter(|&&v| v.abs() as f64 > thr).count() as u64;
            assert_eq!(s.count, n as u64);
            assert_eq!(s.abs_max, max);
            assert!((s.sq_sum.value() - sq).abs() <= 1e-12 * sq);
            assert_eq!(s.outliers, cnt, "n {n} ratio {ratio}");
        }
    }
    assert_eq!(both(&[], 2.0).count, 0);
}

#[test]
fn the_threshold_is_strict_and_exact() {
    // Σ x² = 9 over 9 elements: RMS = 1, so with ratio 3 the element 3 sits on the threshold.
    let mut x = vec![0f32; 9];
    x[4] = 3.0;
    assert_eq!(both(&x, 3.0).outliers, 0);
    assert_eq!(both(&x, 2.999_999).outliers, 1);
    // A threshold that is not an f32: RMS = sqrt(1/3) with ratio 1 lies between two f32s.
    let x = [1f32, 0.0, 0.0];
    let t = (1f64 / 3.0).sqrt();
    let near = [t as f32, f32::from_bits((t as f32).to_bits() + 1), 1.0];
    for v in near {
        let y = [1f32, 0.0, 0.0, v];
        let s = both(&y, 1.0);
        let thr = ((1.0 + v as f64 * v as f64) / 4.0).sqrt();
        let want = y.iter().filter(|&&a| a.abs() as f64 > thr).count() as u64;
        assert_eq!(s.outliers, want);
    }
    assert_eq!(both(&x, 1.0).outliers, 1);
}

#[test]
fn non_finite_values() {
    let mut x = lcg(20, 3);
    x[5] = f32::NAN;
    let s = both(&x, 1.0);
    assert!(s.abs_max.is_nan() && s.sq_sum.value().is_nan());
    assert_eq!((s.count, s.outliers), (20, 0));
    let mut x = lcg(20, 4);
    x[19] = f32::NEG_INFINITY;
    let s = both(&x, 1.0);
    assert_eq!(s.abs_max, f64::INFINITY);
    assert_eq!(s.sq_sum.value(), f64::INFINITY);
    assert_eq!(s.outliers, 0);
}
