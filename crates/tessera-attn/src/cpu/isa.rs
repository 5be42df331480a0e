//! The instruction sets the CPU kernels are compiled for ([`Isa`]), the macro that declares
//! one `#[target_feature]` copy of an item kernel per instruction set ([`isa_entry!`]), and
//! whether a copy runs a dtype's forward on the `vdpbf16ps` kernel ([`runs_bf16_kernel`]; the
//! forward, its telemetry variant and its workspace size all ask this one function).
//!
//! Contract: [`Isa::detect`] returns the widest copy this CPU runs (by feature flags; which copy
//! each dtype actually runs is chosen by measured speed in [`dispatch`](super::dispatch)); a
//! copy is only ever called on a CPU that has its features ([`Isa::supported`]), which is what
//! makes the `unsafe` calls of the `#[target_feature]` copies sound.

use tessera_core::cpu_features::{has, state, Feature, State};

/// What [`Isa::Avx2`] needs.
const AVX2: [Feature; 2] = [Feature::Avx2, Feature::Fma];
/// What [`Isa::Avx512`] needs (its `#[target_feature]` list in [`isa_entry!`]).
const AVX512: [Feature; 5] = [
    Feature::Avx512f,
    Feature::Avx512bw,
    Feature::Avx512vl,
    Feature::Avx512dq,
    Feature::Fma,
];
/// What [`Isa::Avx512Bf16`] needs.
const AVX512_BF16: [Feature; 6] = [
    Feature::Avx512f,
    Feature::Avx512bw,
    Feature::Avx512vl,
    Feature::Avx512dq,
    Feature::Fma,
    Feature::Avx512bf16,
];

fn has_all(features: impl IntoIterator<Item = Feature>) -> bool {
    features.into_iter().all(has)
}

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

    /// The widest copy this CPU supports (features hidden by `TESSERA_HIDE_ISA` count as absent:
    /// [`tessera_core::cpu_features`]).
    pub fn detect() -> Isa {
        if has_all(AVX512) {
            if has(Feature::Avx512bf16) {
                return Isa::Avx512Bf16;
            }
            return Isa::Avx512;
        }
        if has_all(AVX2) {
            return Isa::Avx2;
        }
        Isa::Portable
    }

    /// Whether this CPU can run the copy.
    pub fn supported(self) -> bool {
        self.unsupported_reason().is_none()
    }

    /// The copies this CPU runs, widest first (what tests iterate over).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// Why this CPU cannot run the copy (`None` when it can): the features it needs and whether
    /// they are hidden by `TESSERA_HIDE_ISA` or absent; for errors and test skip messages.
    pub fn unsupported_reason(self) -> Option<String> {
        let (needs, features): (&str, &[Feature]) = match self {
            Isa::Portable => return None,
            Isa::Avx2 => ("AVX2 and FMA", &AVX2),
            Isa::Avx512 => ("AVX-512F/BW/VL/DQ and FMA", &AVX512),
            Isa::Avx512Bf16 | Isa::Avx512Amx => {
                ("AVX-512F/BW/VL/DQ, FMA and AVX512-BF16", &AVX512_BF16)
            }
        };
        let any = |s: State| features.iter().any(|&f| state(f) == s);
        let why = if any(State::Absent) {
            Some("which this CPU lacks")
        } else if any(State::Hidden) {
            Some("hidden by TESSERA_HIDE_ISA")
        } else {
            None
        };
        if let Some(why) = why {
            return Some(format!("kernel copy {} needs {needs}, {why}", self.name()));
        }
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512Amx && crate::cpu::amx::unit().is_none() {
            let why = crate::cpu::amx::status().err().unwrap_or("unused");
            return Some(format!(
                "kernel copy {} needs AMX-BF16 (or TESSERA_AMX_MODEL=1): {why}",
                self.name()
            ));
        }
        None
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
                // decision only hand out copies whose features this CPU has (they ask
                // `tessera_core::cpu_features::has`, which hiding can only make stricter).
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
