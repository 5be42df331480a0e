//! The kernel paths a CPU call can run ([`F32Path`], [`Bf16Path`], both as [`KernelPaths`]),
//! which of them this CPU runs ([`Caps`]) and the `TESSERA_CPU_PATHS` override syntax
//! ([`PathOverride`]).
//!
//! Contract: names and capabilities only, no measurement: below the backend, which refuses a
//! path this CPU lacks ([`Caps`]), and below [`dispatch`](super::dispatch), which measures the
//! backend on each path and picks one per dtype (and re-exports this module's items).

use super::isa::Isa;
use super::peak::PeakPath;
use tessera_core::{DType, Error, Result};

/// The environment variable that overrides the decision.
pub const ENV: &str = "TESSERA_CPU_PATHS";

/// What a valid [`ENV`] value looks like (the error messages' "expected").
const OVERRIDE_SYNTAX: &str =
    "comma-separated f32=avx512|avx2|portable and/or bf16=amx|dot|widen-avx512|widen-avx2|widen-portable";

/// The kernel path of f32 calls: one f32 kernel copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum F32Path {
    /// AVX-512F/BW/VL + FMA ([`Isa::Avx512`]).
    Avx512,
    /// AVX2 + FMA ([`Isa::Avx2`]).
    Avx2,
    /// Baseline features ([`Isa::Portable`]).
    Portable,
}

impl F32Path {
    /// Every f32 path, widest first (the tie-break order).
    pub const ALL: [F32Path; 3] = [F32Path::Avx512, F32Path::Avx2, F32Path::Portable];

    /// Its name (`avx512`, `avx2`, `portable`).
    pub fn name(self) -> &'static str {
        match self {
            F32Path::Avx512 => "avx512",
            F32Path::Avx2 => "avx2",
            F32Path::Portable => "portable",
        }
    }

    /// The path named `name`.
    pub fn parse(name: &str) -> Option<F32Path> {
        F32Path::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The kernel copy it runs.
    pub fn isa(self) -> Isa {
        match self {
            F32Path::Avx512 => Isa::Avx512,
            F32Path::Avx2 => Isa::Avx2,
            F32Path::Portable => Isa::Portable,
        }
    }

    /// The f32 path of a kernel copy (`Avx512Bf16` runs its f32 calls on the AVX-512 copy).
    pub fn of_isa(isa: Isa) -> F32Path {
        match isa {
            Isa::Avx512Amx | Isa::Avx512Bf16 | Isa::Avx512 => F32Path::Avx512,
            Isa::Avx2 => F32Path::Avx2,
            Isa::Portable => F32Path::Portable,
        }
    }

    /// The instruction path whose peak bounds it (`None`: the portable copy is not probed).
    pub fn peak_path(self) -> Option<PeakPath> {
        match self {
            F32Path::Avx512 => Some(PeakPath::Avx512),
            F32Path::Avx2 => Some(PeakPath::Avx2),
            F32Path::Portable => None,
        }
    }

    /// The CPU features it needs, for messages.
    fn needs(self) -> &'static str {
        match self {
            F32Path::Avx512 => "AVX-512F/BW/VL and FMA",
            F32Path::Avx2 => "AVX2 and FMA",
            F32Path::Portable => "nothing",
        }
    }
}

/// The kernel path of bf16 calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bf16Path {
    /// The `vdpbf16ps` kernels with the forward's products on AMX tiles ([`Isa::Avx512Amx`]).
    Amx,
    /// The `vdpbf16ps` kernels ([`Isa::Avx512Bf16`]): bf16 operands, P and dS included.
    Dot,
    /// Widened to f32 in the AVX-512 f32 kernels.
    WidenAvx512,
    /// Widened to f32 in the AVX2 f32 kernels.
    WidenAvx2,
    /// Widened to f32 in the portable f32 kernels.
    WidenPortable,
}

impl Bf16Path {
    /// Every bf16 path (the tie-break order).
    pub const ALL: [Bf16Path; 5] = [
        Bf16Path::Amx,
        Bf16Path::Dot,
        Bf16Path::WidenAvx512,
        Bf16Path::WidenAvx2,
        Bf16Path::WidenPortable,
    ];

    /// Its name (`amx`, `dot`, `widen-avx512`, `widen-avx2`, `widen-portable`).
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx",
            Bf16Path::Dot => "dot",
            Bf16Path::WidenAvx512 => "widen-avx512",
            Bf16Path::WidenAvx2 => "widen-avx2",
            Bf16Path::WidenPortable => "widen-portable",
        }
    }

    /// The path named `name` (`bf16-dot` is accepted for `dot`).
    pub fn parse(name: &str) -> Option<Bf16Path> {
        if name == "bf16-dot" {
            return Some(Bf16Path::Dot);
        }
        Bf16Path::ALL.into_iter().find(|p| p.name() == name)
    }

    /// bf16 widened on the f32 path `f`.
    pub fn widen(f: F32Path) -> Bf16Path {
        match f {
            F32Path::Avx512 => Bf16Path::WidenAvx512,
            F32Path::Avx2 => Bf16Path::WidenAvx2,
            F32Path::Portable => Bf16Path::WidenPortable,
        }
    }

    /// The f32 path it widens onto (`None` for `dot` and `amx`).
    pub fn widened_on(self) -> Option<F32Path> {
        match self {
            Bf16Path::Amx | Bf16Path::Dot => None,
            Bf16Path::WidenAvx512 => Some(F32Path::Avx512),
            Bf16Path::WidenAvx2 => Some(F32Path::Avx2),
            Bf16Path::WidenPortable => Some(F32Path::Portable),
        }
    }

    /// The kernel copy its calls run on.
    pub fn isa(self) -> Isa {
        match self {
            Bf16Path::Amx => Isa::Avx512Amx,
            other => other.widened_on().map_or(Isa::Avx512Bf16, F32Path::isa),
        }
    }

    /// The bf16 path of a kernel copy (what
    /// [`CpuBackend::with_isa`](super::CpuBackend::with_isa) runs bf16 calls on).
    pub fn of_isa(isa: Isa) -> Bf16Path {
        match isa {
            Isa::Avx512Amx => Bf16Path::Amx,
            Isa::Avx512Bf16 => Bf16Path::Dot,
            other => Bf16Path::widen(F32Path::of_isa(other)),
        }
    }

    /// The instruction path whose peak bounds it: the AMX tile peak for `amx`, `vdpbf16ps`
    /// for `dot`, else the f32 FMA peak of the copy it widens onto.
    pub fn peak_path(self) -> Option<PeakPath> {
        match (self, self.widened_on()) {
            (Bf16Path::Amx, _) => Some(PeakPath::AmxBf16),
            (_, None) => Some(PeakPath::Bf16Dot),
            (_, Some(f)) => f.peak_path(),
        }
    }

    /// Its name in bench tables: `bf16-dot` for `dot`, else [`Bf16Path::name`].
    pub fn label(self) -> &'static str {
        match self {
            Bf16Path::Dot => "bf16-dot",
            other => other.name(),
        }
    }
}

macro_rules! serialize_by_name {
    ($($t:ty),*) => {$(
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
    )*};
}
serialize_by_name!(F32Path, Bf16Path);

/// The paths of one backend: one per storage dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct KernelPaths {
    /// Path of f32 calls.
    pub f32: F32Path,
    /// Path of bf16 calls.
    pub bf16: Bf16Path,
}

impl KernelPaths {
    /// Both dtypes on one kernel copy (f32 on its f32 kernels; bf16 on `dot` for
    /// [`Isa::Avx512Bf16`], else widened on it).
    pub fn of_isa(isa: Isa) -> KernelPaths {
        KernelPaths {
            f32: F32Path::of_isa(isa),
            bf16: Bf16Path::of_isa(isa),
        }
    }

    /// The kernel copy calls of `dtype` run on.
    pub fn isa_for(self, dtype: DType) -> Isa {
        match dtype {
            DType::BF16 => self.bf16.isa(),
            _ => self.f32.isa(),
        }
    }

    /// The path name of calls of `dtype` in bench tables (`avx512`, `bf16-dot`,
    /// `widen-avx512`, ...).
    pub fn label(self, dtype: DType) -> &'static str {
        match dtype {
            DType::BF16 => self.bf16.label(),
            _ => self.f32.name(),
        }
    }

    /// The instruction path whose peak bounds calls of `dtype`.
    pub fn peak_path(self, dtype: DType) -> Option<PeakPath> {
        match dtype {
            DType::BF16 => self.bf16.peak_path(),
            _ => self.f32.peak_path(),
        }
    }
}

impl std::fmt::Display for KernelPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "f32 {}, bf16 {}", self.f32.name(), self.bf16.name())
    }
}

/// The kernel copies a CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// AVX2 + FMA ([`Isa::Avx2`]).
    pub avx2: bool,
    /// AVX-512F/BW/VL + FMA ([`Isa::Avx512`]).
    pub avx512: bool,
    /// The above plus AVX512-BF16 ([`Isa::Avx512Bf16`]).
    pub avx512_bf16: bool,
    /// The above plus AMX-BF16, usable by this process ([`Isa::Avx512Amx`]).
    pub amx: bool,
}

impl Caps {
    /// This CPU's.
    pub fn detect() -> Caps {
        Caps {
            avx2: Isa::Avx2.supported(),
            avx512: Isa::Avx512.supported(),
            avx512_bf16: Isa::Avx512Bf16.supported(),
            amx: Isa::Avx512Amx.supported(),
        }
    }

    /// Whether it runs the f32 path `p`.
    pub fn runs_f32(self, p: F32Path) -> bool {
        match p {
            F32Path::Avx512 => self.avx512,
            F32Path::Avx2 => self.avx2,
            F32Path::Portable => true,
        }
    }

    /// Whether it runs the bf16 path `p`.
    pub fn runs_bf16(self, p: Bf16Path) -> bool {
        match (p, p.widened_on()) {
            (Bf16Path::Amx, _) => self.amx,
            (_, None) => self.avx512_bf16,
            (_, Some(f)) => self.runs_f32(f),
        }
    }

    /// Whether it runs both of `paths`.
    pub fn runs(self, paths: KernelPaths) -> bool {
        self.runs_f32(paths.f32) && self.runs_bf16(paths.bf16)
    }

    /// The f32 paths it runs, in [`F32Path::ALL`] order (never empty).
    pub fn f32_candidates(self) -> Vec<F32Path> {
        F32Path::ALL
            .into_iter()
            .filter(|&p| self.runs_f32(p))
            .collect()
    }

    /// The bf16 paths it runs, in [`Bf16Path::ALL`] order (never empty).
    pub fn bf16_candidates(self) -> Vec<Bf16Path> {
        Bf16Path::ALL
            .into_iter()
            .filter(|&p| self.runs_bf16(p))
            .collect()
    }

    /// Feature names for the fingerprint and the stored file.
    pub(super) fn names(self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.avx512, "avx512"),
            (self.avx512_bf16, "avx512bf16"),
            (self.amx, "amx-bf16"),
        ]
        .into_iter()
        .filter_map(|(has, n)| has.then_some(n))
        .collect()
    }
}

/// A parsed [`ENV`] value: the paths it forces (either may be absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathOverride {
    /// Forced f32 path.
    pub f32: Option<F32Path>,
    /// Forced bf16 path.
    pub bf16: Option<Bf16Path>,
}

impl PathOverride {
    /// Parses `f32=PATH,bf16=PATH` (either part optional, each at most once, spaces allowed).
    pub fn parse(text: &str) -> Result<PathOverride> {
        let bad = |what: &str| {
            let found = if what == text.trim() {
                format!("{what:?}")
            } else {
                format!("{what:?} in {text:?}")
            };
            Error::invalid(ENV, OVERRIDE_SYNTAX, found)
        };
        let mut o = PathOverride::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (dtype, path) = part.split_once('=').ok_or_else(|| bad(part))?;
            match (dtype.trim(), path.trim()) {
                ("f32", p) if o.f32.is_none() => {
                    o.f32 = Some(F32Path::parse(p).ok_or_else(|| bad(part))?)
                }
                ("bf16", p) if o.bf16.is_none() => {
                    o.bf16 = Some(Bf16Path::parse(p).ok_or_else(|| bad(part))?)
                }
                _ => return Err(bad(part)),
            }
        }
        if o == PathOverride::default() {
            return Err(bad(text));
        }
        Ok(o)
    }

    /// `Ok` when a CPU with `caps` runs every path this override forces.
    pub fn check(self, caps: Caps) -> Result<()> {
        if let Some(p) = self.f32.filter(|&p| !caps.runs_f32(p)) {
            return Err(unsupported(&format!("{ENV}: f32={}", p.name()), p.needs()));
        }
        if let Some(p) = self.bf16.filter(|&p| !caps.runs_bf16(p)) {
            let needs = p.widened_on().map_or("AVX512-BF16", F32Path::needs);
            return Err(unsupported(&format!("{ENV}: bf16={}", p.name()), needs));
        }
        Ok(())
    }
}

/// "`what` needs `needs`, which this CPU lacks".
pub(crate) fn unsupported(what: &str, needs: &str) -> Error {
    let lacks = if tessera_core::cpu_features::hidden().is_empty() {
        "which this CPU lacks"
    } else {
        "which this CPU lacks or TESSERA_HIDE_ISA hides"
    };
    Error::Unsupported(format!("{what} needs {needs}, {lacks}"))
}

/// The [`ENV`] override of this process, checked against this CPU: `Ok(None)` when unset or
/// empty, an error naming the variable when malformed or unsupported (for callers that can
/// refuse bad input, such as the CLI; [`decision`](super::dispatch::decision) ignores it with
/// a warning instead).
pub fn check_env_override() -> Result<Option<PathOverride>> {
    let Some(text) = env_text() else {
        return Ok(None);
    };
    let o = PathOverride::parse(&text)?;
    o.check(Caps::detect())?;
    Ok(Some(o))
}

/// [`ENV`]'s value when set and not blank.
pub(super) fn env_text() -> Option<String> {
    std::env::var_os(ENV)
        .map(|v| v.to_string_lossy().trim().to_string())
        .filter(|v| !v.is_empty())
}
