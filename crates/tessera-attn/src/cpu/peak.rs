//! Measured compute peaks of this machine, per instruction path, so "% of peak" is measured, not
//! assumed.
//!
//! Contract:
//! - [`measure`] reports, for each path this CPU has ([`PeakPath`]: f32 FMA on 256-bit AVX2
//!   registers, f32 FMA on 512-bit AVX-512 registers, bf16 pair dot-products `vdpbf16ps`), the
//!   GFLOP/s of independent register-resident chains on `threads` threads; a path the CPU lacks
//!   is `None`. An FMA is 2 FLOP per f32 lane; a `vdpbf16ps` is 4 FLOP per f32 lane (two
//!   products, two sums), the counts the kernels' FLOPs use.
//! - It aims to be an upper bound on what a kernel on that path can reach: every path is tried
//!   with several numbers of independent accumulator chains (enough to cover FMA latency times
//!   ports on current Intel and AMD cores; all of them stay in registers) and the best is kept;
//!   threads really run together: they start at one [`Barrier`], run small fixed chunks until a
//!   shared stop flag is raised after the time slice, and the rate is their total FLOPs over the
//!   wall window from the barrier's release to the last thread's finish (summing per-thread
//!   self-timed rates would credit threads that did not in fact overlap).
//! - A kernel that still beats the probe proves the probe was not an upper bound; callers that
//!   print a percentage (`tessera bench`) raise the peak to the observed rate and say so.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Barrier};
use std::time::{Duration, Instant};

/// An instruction path with its own peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")] // as the fields of `Peaks`
pub enum PeakPath {
    /// f32 FMA on 256-bit registers (AVX2 + FMA): the `avx2` kernels and bf16 widened on them.
    Avx2,
    /// f32 FMA on 512-bit registers (AVX-512F): the `avx512` kernels and bf16 widened on them.
    Avx512,
    /// bf16 pair dot-products into f32 (`vdpbf16ps`, AVX512-BF16): the `bf16-dot` kernels.
    Bf16Dot,
    /// AMX-BF16 tile products (`tdpbf16ps`): the `amx` kernels' products.
    AmxBf16,
}

impl PeakPath {
    /// Every path, in report order.
    pub const ALL: [PeakPath; 4] = [
        PeakPath::Avx512,
        PeakPath::Avx2,
        PeakPath::Bf16Dot,
        PeakPath::AmxBf16,
    ];

    /// Short name (`avx2`, `avx512`, `bf16-dot`, `amx-bf16`), the one bench prints.
    pub fn name(self) -> &'static str {
        match self {
            PeakPath::Avx2 => "avx2",
            PeakPath::Avx512 => "avx512",
            PeakPath::Bf16Dot => "bf16-dot",
            PeakPath::AmxBf16 => "amx-bf16",
        }
    }

    /// What the path measures, for reports.
    pub fn what(self) -> &'static str {
        match self {
            PeakPath::Avx2 => "f32 FMA, ymm",
            PeakPath::Avx512 => "f32 FMA, zmm",
            PeakPath::Bf16Dot => "vdpbf16ps, zmm",
            PeakPath::AmxBf16 => "tdpbf16ps, tiles",
        }
    }
}

/// Measured peaks of the instruction paths the kernels use, GFLOP/s over all threads.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Peaks {
    /// f32 FMA on AVX2 (ymm) registers, or `None` without AVX2 + FMA.
    pub avx2: Option<f64>,
    /// f32 FMA on AVX-512 (zmm) registers, or `None` without AVX-512F.
    pub avx512: Option<f64>,
    /// `vdpbf16ps` (zmm), or `None` without AVX512-BF16.
    pub bf16_dot: Option<f64>,
    /// `tdpbf16ps` (AMX tiles), or `None` where this process cannot run AMX.
    pub amx_bf16: Option<f64>,
    /// Threads the measurement ran on together.
    pub threads: usize,
}

impl Peaks {
    /// The peak of `path`, when this CPU has it and it was measured.
    pub fn for_path(&self, path: PeakPath) -> Option<f64> {
        match path {
            PeakPath::Avx2 => self.avx2,
            PeakPath::Avx512 => self.avx512,
            PeakPath::Bf16Dot => self.bf16_dot,
            PeakPath::AmxBf16 => self.amx_bf16,
        }
    }

    /// Sets the peak of `path` (what a caller does when a kernel beat the probe).
    pub fn set(&mut self, path: PeakPath, gflops: f64) {
        let slot = match path {
            PeakPath::Avx2 => &mut self.avx2,
            PeakPath::Avx512 => &mut self.avx512,
            PeakPath::Bf16Dot => &mut self.bf16_dot,
            PeakPath::AmxBf16 => &mut self.amx_bf16,
        };
        *slot = Some(gflops);
    }
}

/// FLOPs of one call of a probe kernel: `CHUNK` iterations over its chains.
type Kernel = fn() -> f64;

/// Iterations of one kernel call: tens of microseconds, so every thread notices the stop flag
/// promptly and the window's tail (the last thread's last chunk) stays negligible.
const CHUNK: u64 = 2048;

/// GFLOP/s of `kernel` run by `threads` threads together for about `slice` (see the module
/// contract), with the threads that could be started; `None` when none could.
fn window_rate(threads: usize, slice: Duration, kernel: Kernel) -> Option<f64> {
    let stop = AtomicBool::new(false);
    let stop = &stop;
    let done: Vec<(f64, Instant, Instant)> = std::thread::scope(|s| {
        // The barrier is sized once the workers exist (a spawn can fail); each worker gets it
        // through its own channel.
        let mut senders = Vec::with_capacity(threads);
        let mut handles = Vec::with_capacity(threads);
        for _ in 0..threads {
            let (tx, rx) = mpsc::channel::<std::sync::Arc<Barrier>>();
            let spawned = std::thread::Builder::new().spawn_scoped(s, move || {
                let barrier = rx.recv().ok()?;
                barrier.wait();
                let start = Instant::now();
                let mut flops = 0.0;
                loop {
                    flops += kernel();
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                Some((flops, start, Instant::now()))
            });
            if let Ok(h) = spawned {
                senders.push(tx);
                handles.push(h);
            }
        }
        let barrier = std::sync::Arc::new(Barrier::new(handles.len() + 1));
        for tx in &senders {
            // A worker that is gone cannot block the barrier: it was counted, so give up on
            // this window rather than wait forever.
            if tx.send(barrier.clone()).is_err() {
                return Vec::new();
            }
        }
        if !handles.is_empty() {
            barrier.wait();
            std::thread::sleep(slice);
        }
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    });
    let start = done.iter().map(|d| d.1).min()?;
    let end = done.iter().map(|d| d.2).max()?;
    let secs = end.duration_since(start).as_secs_f64();
    let flops: f64 = done.iter().map(|d| d.0).sum();
    (secs > 0.0).then(|| flops / secs / 1e9)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kernel, PeakPath, CHUNK};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use tessera_core::cpu_features::{has, Feature};

    /// One probe kernel in assembly, so each chain really is one register (compiled from
    /// intrinsics, 16 and 24 accumulators were spilled to the stack and ran slower than 8):
    /// every accumulator `$r` starts as a copy of `$b`, then `CHUNK` rounds of `$op r, $a, $b`
    /// on each. `$feat` are the target features the instructions need.
    macro_rules! probe {
        ($name:ident, $feat:literal, $op:literal, $a:tt = $av:expr, $b:tt = $bv:expr,
         [$($r:tt)+]) => {
            #[target_feature(enable = $feat)]
            unsafe fn $name() {
                asm!(
                    $(concat!("vmovaps ", $r, ", ", $b)),+,
                    "2:",
                    $(concat!($op, " ", $r, ", ", $a, ", ", $b)),+,
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) CHUNK => _,
                    in($a) $av,
                    in($b) $bv,
                    $(out($r) _),+,
                    options(nostack, nomem),
                );
            }
        };
    }

    // FMA chains are `x = a·x + b` from x = b with a < 1: they converge to b / (1 - a), so
    // values stay normal (denormals would slow some cores down).
    macro_rules! fma512 {
        ($name:ident, [$($r:tt)+]) => {
            probe!($name, "avx512f", "vfmadd213ps", "zmm30" = _mm512_set1_ps(0.999_9),
                "zmm31" = _mm512_set1_ps(1e-4), [$($r)+]);
        };
    }
    // AVX2 has 16 registers: the constants in ymm14 and ymm15 leave at most 14 chains.
    macro_rules! fma256 {
        ($name:ident, [$($r:tt)+]) => {
            probe!($name, "avx2,fma", "vfmadd213ps", "ymm14" = _mm256_set1_ps(0.999_9),
                "ymm15" = _mm256_set1_ps(1e-4), [$($r)+]);
        };
    }
    // bf16 chains `x += a·a` over the pairs (1e-3, -1e-3): ~2e-6 a step, far from overflow.
    macro_rules! dot512 {
        ($name:ident, [$($r:tt)+]) => {
            probe!($name, "avx512f,avx512bf16", "vdpbf16ps", "zmm30" = bf16_pairs(),
                "zmm31" = bf16_pairs(), [$($r)+]);
        };
    }

    /// 32 bf16 values alternating 1e-3 and -1e-3, as the bits of a `__m512`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn bf16_pairs() -> __m512 {
        let p = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(-1e-3));
        _mm512_castsi512_ps(std::mem::transmute::<__m512bh, __m512i>(p))
    }

    fma512!(fma512_8, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7"]);
    fma512!(fma512_12, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11"]);
    fma512!(fma512_16, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11" "zmm12" "zmm13" "zmm14" "zmm15"]);
    fma512!(fma512_24, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11" "zmm12" "zmm13" "zmm14" "zmm15" "zmm16" "zmm17" "zmm18" "zmm19" "zmm20" "zmm21" "zmm22" "zmm23"]);
    fma256!(fma256_8, ["ymm0" "ymm1" "ymm2" "ymm3" "ymm4" "ymm5" "ymm6" "ymm7"]);
    fma256!(fma256_10, ["ymm0" "ymm1" "ymm2" "ymm3" "ymm4" "ymm5" "ymm6" "ymm7" "ymm8" "ymm9"]);
    fma256!(fma256_12, ["ymm0" "ymm1" "ymm2" "ymm3" "ymm4" "ymm5" "ymm6" "ymm7" "ymm8" "ymm9" "ymm10" "ymm11"]);
    fma256!(fma256_14, ["ymm0" "ymm1" "ymm2" "ymm3" "ymm4" "ymm5" "ymm6" "ymm7" "ymm8" "ymm9" "ymm10" "ymm11" "ymm12" "ymm13"]);
    dot512!(dot512_8, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7"]);
    dot512!(dot512_12, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11"]);
    dot512!(dot512_16, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11" "zmm12" "zmm13" "zmm14" "zmm15"]);
    dot512!(dot512_24, ["zmm0" "zmm1" "zmm2" "zmm3" "zmm4" "zmm5" "zmm6" "zmm7" "zmm8" "zmm9" "zmm10" "zmm11" "zmm12" "zmm13" "zmm14" "zmm15" "zmm16" "zmm17" "zmm18" "zmm19" "zmm20" "zmm21" "zmm22" "zmm23"]);

    /// A safe [`Kernel`] around a probe: runs it and returns its FLOPs (`$chains` vectors of
    /// `$lanes` f32 lanes, `$flop` FLOP per lane and step).
    macro_rules! kernel {
        ($probe:ident, $chains:expr, $lanes:expr, $flop:expr) => {{
            fn k() -> f64 {
                // SAFETY: `kernels` lists a probe only after detecting its target features.
                unsafe { $probe() };
                (CHUNK as usize * $chains * $lanes * $flop) as f64
            }
            k as Kernel
        }};
    }

    /// `CHUNK` rounds of `tdpbf16ps` on `$acc` accumulator tiles (tiles 0 to `$acc - 1`) from
    /// two A and two B tiles of small bf16 values (pairs of ±2⁻¹⁰, which keep the sums far
    /// from overflow), after configuring the tiles; released at the end.
    fn amx_rounds<const ACC: usize>() {
        use crate::cpu::amx::{Hw, Unit};
        let src = [0x3A80_BA80u32; 256];
        let p = src.as_ptr().cast::<u8>();
        // SAFETY: `kernels` lists this probe only where `amx::status` is Ok (hardware AMX with
        // the tile permission); every load reads the 1 KiB `src` (16 rows of 64 bytes).
        unsafe {
            Hw::configure();
            for t in 0..4 {
                Hw::zero(t);
            }
            for t in 4..8 {
                Hw::load(t, p, 64);
            }
            for _ in 0..CHUNK {
                Hw::dot(0, 4, 6);
                Hw::dot(1, 4, 7);
                Hw::dot(2, 5, 6);
                if ACC == 4 {
                    Hw::dot(3, 5, 7);
                }
            }
            Hw::release();
        }
    }

    /// The probe kernels this CPU runs, one per (path, chain count). 8 chains cover a 4-cycle
    /// FMA on 2 ports; up to 24 (zmm, 32 registers) cover longer latencies (`vdpbf16ps`).
    pub(super) fn kernels() -> Vec<(PeakPath, Kernel)> {
        let mut v: Vec<(PeakPath, Kernel)> = Vec::new();
        if has(Feature::Avx512f) {
            v.extend([
                (PeakPath::Avx512, kernel!(fma512_8, 8, 16, 2)),
                (PeakPath::Avx512, kernel!(fma512_12, 12, 16, 2)),
                (PeakPath::Avx512, kernel!(fma512_16, 16, 16, 2)),
                (PeakPath::Avx512, kernel!(fma512_24, 24, 16, 2)),
            ]);
        }
        if has(Feature::Avx2) && has(Feature::Fma) {
            v.extend([
                (PeakPath::Avx2, kernel!(fma256_8, 8, 8, 2)),
                (PeakPath::Avx2, kernel!(fma256_10, 10, 8, 2)),
                (PeakPath::Avx2, kernel!(fma256_12, 12, 8, 2)),
                (PeakPath::Avx2, kernel!(fma256_14, 14, 8, 2)),
            ]);
        }
        if has(Feature::Avx512f) && has(Feature::Avx512bf16) {
            v.extend([
                (PeakPath::Bf16Dot, kernel!(dot512_8, 8, 16, 4)),
                (PeakPath::Bf16Dot, kernel!(dot512_12, 12, 16, 4)),
                (PeakPath::Bf16Dot, kernel!(dot512_16, 16, 16, 4)),
                (PeakPath::Bf16Dot, kernel!(dot512_24, 24, 16, 4)),
            ]);
        }
        if crate::cpu::amx::status().is_ok() {
            // One `tdpbf16ps` is 16 × 16 outputs of 32 products and 32 sums.
            fn amx3() -> f64 {
                amx_rounds::<3>();
                (CHUNK as usize * 3 * 16 * 16 * 64) as f64
            }
            fn amx4() -> f64 {
                amx_rounds::<4>();
                (CHUNK as usize * 4 * 16 * 16 * 64) as f64
            }
            v.extend([
                (PeakPath::AmxBf16, amx3 as Kernel),
                (PeakPath::AmxBf16, amx4 as Kernel),
            ]);
        }
        v
    }
}

/// The probe kernels of this CPU (none off x86_64).
fn kernels() -> Vec<(PeakPath, Kernel)> {
    #[cfg(target_arch = "x86_64")]
    return x86::kernels();
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

/// Windows per kernel: the budget is spent in [`ROUNDS`] passes over all kernels, each kernel's
/// best window kept. A shared machine slows some windows down and none up, so the maximum of
/// windows spread over time is the upper bound; one long window per kernel measured 8 % low
/// when it fell in a slow phase (zmm 213 against 230-235 GFLOP/s in other runs).
const ROUNDS: u32 = 3;

/// Measures the peak of every path this CPU has on `threads` threads (at least 1), spending
/// about `budget` in all (split evenly over the paths' chain counts and three passes).
pub fn measure(budget: Duration, threads: usize) -> Peaks {
    let threads = threads.max(1);
    let kernels = kernels();
    let slice = budget / (kernels.len().max(1) as u32 * ROUNDS);
    let mut peaks = Peaks {
        avx2: None,
        avx512: None,
        bf16_dot: None,
        amx_bf16: None,
        threads,
    };
    for _ in 0..ROUNDS {
        for &(path, kernel) in &kernels {
            if let Some(rate) = window_rate(threads, slice, kernel) {
                if peaks.for_path(path).is_none_or(|best| rate > best) {
                    peaks.set(path, rate);
                }
            }
        }
    }
    peaks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path the CPU has is measured (positive) and the others are absent.
    #[test]
    fn measures_exactly_the_paths_this_cpu_has() {
        let p = measure(Duration::from_millis(60), 2);
        assert_eq!(p.threads, 2);
        #[cfg(target_arch = "x86_64")]
        {
            use tessera_core::cpu_features::{has, Feature};
            let measured_iff = |f: bool, g: Option<f64>| {
                assert_eq!(f, g.is_some(), "{p:?}");
                assert!(g.is_none_or(|g| g > 0.0), "{p:?}");
            };
            measured_iff(has(Feature::Avx512f), p.avx512);
            measured_iff(has(Feature::Avx2) && has(Feature::Fma), p.avx2);
            measured_iff(has(Feature::Avx512bf16), p.bf16_dot);
            measured_iff(crate::cpu::amx::status().is_ok(), p.amx_bf16);
        }
        for path in PeakPath::ALL {
            let want = match path {
                PeakPath::Avx2 => p.avx2,
                PeakPath::Avx512 => p.avx512,
                PeakPath::Bf16Dot => p.bf16_dot,
                PeakPath::AmxBf16 => p.amx_bf16,
            };
            assert_eq!(p.for_path(path), want);
        }
    }

    /// The wall-window rate of threads that all run counts each thread's work once: two
    /// threads of a kernel with a known FLOP count never report more than the FLOPs they did
    /// over the wall time (a kernel that sleeps cannot look faster with more threads).
    #[test]
    fn window_rate_is_total_flops_over_the_wall_window() {
        fn sleepy() -> f64 {
            std::thread::sleep(Duration::from_millis(2));
            1e6
        }
        let one = window_rate(1, Duration::from_millis(30), sleepy).unwrap_or(0.0);
        let two = window_rate(2, Duration::from_millis(30), sleepy).unwrap_or(0.0);
        // 1e6 FLOPs per ≥ 2 ms per thread: at most 0.5 GFLOP/s per thread.
        assert!(one > 0.0 && one <= 0.5 + 1e-9, "{one}");
        assert!(two > 0.0 && two <= 1.0 + 1e-9, "{two}");
    }
}
