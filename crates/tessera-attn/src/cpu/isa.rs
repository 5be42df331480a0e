//! The instruction sets the CPU kernels are compiled for ([`Isa`]), the macro that declares
//! one `#[target_feature]` copy of an item kernel per instruction set ([`isa_entry!`]), and
//! whether a copy runs a dtype's forward on the `vdpbf16ps` kernel ([`runs_bf16_kernel`]; the
//! forward, its telemetry variant and its workspace size all ask this one function).
//!
//! Contract: [`Isa::detect`] returns the widest copy this CPU runs (by feature flags; which copy
//! each dtype actually runs is chosen by measured speed in [`dispatch`](super::dispatch)); a
//! copy is only ever called on a CPU that has its features ([`Isa::supported`]), which is what
//! makes the `unsafe` calls of the `#[target_feature]` copies sound.

/// Instruction set of the kernel copy a [`CpuBackend`](super::CpuBackend) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F, BW, VL, DQ, FMA and AVX512-BF16: the f32 kernels of [`Isa::Avx512`], plus bf16
    /// forward and backward kernels on `vdpbf16ps` (bf16 operands, including P and dS; f32
    /// softmax and accumulation).
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] plus AMX-BF16 with the OS's tile-state permission (`amx`): the bf16
    /// forward's two products and the backward's full-tile products on the tile unit
    /// (`tdpbf16ps`), everything else as [`Isa::Avx512Bf16`]. Never returned by [`Isa::detect`] (a feature-flag choice): the
    /// dispatch picks it by measured speed.
    Avx512Amx,
    /// AVX-512F, BW, VL, DQ (`vreduceps` in the exponentials) and FMA.
    Avx512,
    /// AVX2 and FMA.
    Avx2,
    /// Baseline target features (any CPU).
    Portable,
}

impl Isa {
    /// Every copy, widest first (tests run each one this CPU supports).
    pub const ALL: [Isa; 5] = [
        Isa::Avx512Amx,
        Isa::Avx512Bf16,
        Isa::Avx512,
        Isa::Avx2,
        Isa::Portable,
    ];

    /// The widest copy this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("fma")
            {
                if is_x86_feature_detected!("avx512bf16") {
                    return Isa::Avx512Bf16;
                }
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU can run the copy.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => Isa::detect() == Isa::Avx512Bf16,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Amx => Isa::detect() == Isa::Avx512Bf16 && crate::cpu::amx::unit().is_some(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => matches!(Isa::detect(), Isa::Avx512 | Isa::Avx512Bf16),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Short lowercase name (`avx512-bf16`, `avx512`, `avx2`, `portable`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512-bf16",
            Isa::Avx512Amx => "avx512-amx",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// Whether a forward of this dtype on this kernel copy runs the `forward::bf16` (`vdpbf16ps`)
/// kernel; the plain and the telemetry forward both dispatch on it.
pub(crate) fn runs_bf16_kernel(isa: Isa, dtype: tessera_core::DType) -> bool {
    matches!(isa, Isa::Avx512Bf16 | Isa::Avx512Amx) && dtype == tessera_core::DType::BF16
}

/// Declares the per-ISA entry points of an item kernel: a `#[target_feature]` copy per ISA
/// around the same generic, `#[inline(always)]` body.
macro_rules! isa_entry {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        pub(crate) fn $name(isa: crate::cpu::isa::Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
            fn avx512($($arg: $ty),*) {
                $body::<crate::cpu::simd::Avx512>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) {
                $body::<crate::cpu::simd::Avx2>($($arg),*)
            }
            match isa {
                // SAFETY: `Isa::detect`, `CpuBackend::with_isa`/`with_paths` and the dispatch
                // decision only hand out copies whose features this CPU has.
                #[cfg(target_arch = "x86_64")]
                crate::cpu::isa::Isa::Avx512
                | crate::cpu::isa::Isa::Avx512Bf16
                | crate::cpu::isa::Isa::Avx512Amx => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                crate::cpu::isa::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => $body::<crate::cpu::simd::Portable>($($arg),*),
            }
        }
    };
}
pub(crate) use isa_entry;
