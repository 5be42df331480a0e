//! Measured compute peaks of this machine, so "% of peak" is measured, not assumed.
//!
//! Contract: [`measure`] runs independent FMA (f32) and bf16 dot-product (`vdpbf16ps`) chains on
//! every available core for a fixed time and reports GFLOP/s (an FMA is 2 FLOP per lane; a bf16
//! pair dot-accumulate is 4 FLOP per f32 lane). Paths missing on this CPU report `None`.

use std::time::{Duration, Instant};

/// Measured peaks of the instruction paths the kernels use.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Peaks {
    /// f32 FMA GFLOP/s over all threads (AVX-512 when present, else AVX2+FMA, else scalar).
    pub f32_gflops: f64,
    /// Which f32 path was measured (`avx512`, `avx2`, `scalar`).
    pub f32_path: &'static str,
    /// AVX512-BF16 dot-product GFLOP/s over all threads.
    pub bf16_gflops: Option<f64>,
    /// Threads the measurement ran on.
    pub threads: usize,
}

/// Runs `f(iters)` (returning FLOPs done) on `threads` threads for about `budget`.
fn timed(threads: usize, budget: Duration, f: fn(u64) -> f64) -> f64 {
    // Calibrate iterations on one thread, then run all threads together.
    let mut iters = 1 << 16;
    loop {
        let t = Instant::now();
        f(iters);
        if t.elapsed() > budget / 2 {
            break;
        }
        iters *= 2;
    }
    // Each thread times its own run and the rates are summed: thread start-up skew would
    // otherwise be charged to the machine (it under-reported the peak by ~30% here).
    let per_thread: f64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let t = Instant::now();
                    let flops = f(iters);
                    flops / t.elapsed().as_secs_f64()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    per_thread / 1e9
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const CHAINS: usize = 12;

    #[target_feature(enable = "avx512f")]
    unsafe fn fma512(n: u64) -> f32 {
        let mut acc = [_mm512_set1_ps(0.5); CHAINS];
        let a = _mm512_set1_ps(0.999_9);
        let b = _mm512_set1_ps(1e-4);
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    pub fn f32_avx512(n: u64) -> f64 {
        // SAFETY: only called after avx512f was detected.
        let s = unsafe { fma512(n) };
        std::hint::black_box(s);
        (n as usize * CHAINS * 16 * 2) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn fma256(n: u64) -> f32 {
        let mut acc = [_mm256_set1_ps(0.5); CHAINS];
        let a = _mm256_set1_ps(0.999_9);
        let b = _mm256_set1_ps(1e-4);
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(
            out.as_mut_ptr(),
            acc.iter()
                .fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x)),
        );
        out.iter().sum()
    }

    pub fn f32_avx2(n: u64) -> f64 {
        // SAFETY: only called after avx2 and fma were detected.
        let s = unsafe { fma256(n) };
        std::hint::black_box(s);
        (n as usize * CHAINS * 8 * 2) as f64
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dpbf16(n: u64) -> f32 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(-1e-3));
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, a);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    pub fn bf16_avx512(n: u64) -> f64 {
        // SAFETY: only called after avx512bf16 was detected.
        let s = unsafe { dpbf16(n) };
        std::hint::black_box(s);
        (n as usize * CHAINS * 16 * 4) as f64
    }
}

fn f32_scalar(n: u64) -> f64 {
    let mut acc = [0.5f32; 8];
    for _ in 0..n {
        for x in acc.iter_mut() {
            *x = x.mul_add(0.999_9, 1e-4);
        }
        std::hint::black_box(&mut acc);
    }
    (n * 8 * 2) as f64
}

/// Measures the peaks with every core busy, spending about `budget` per path.
pub fn measure(budget: Duration) -> Peaks {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_arch = "x86_64")]
    {
        let (f, path): (fn(u64) -> f64, _) = if is_x86_feature_detected!("avx512f") {
            (x86::f32_avx512, "avx512")
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            (x86::f32_avx2, "avx2")
        } else {
            (f32_scalar, "scalar")
        };
        let bf16 = (is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"))
            .then(|| timed(threads, budget, x86::bf16_avx512));
        Peaks {
            f32_gflops: timed(threads, budget, f),
            f32_path: path,
            bf16_gflops: bf16,
            threads,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Peaks {
        f32_gflops: timed(threads, budget, f32_scalar),
        f32_path: "scalar",
        bf16_gflops: None,
        threads,
    }
}
