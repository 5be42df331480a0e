//! The one CPU feature query of Tessera: every kernel choice, and every check that guards a
//! call into a `#[target_feature]` copy, asks [`has`] (never `is_x86_feature_detected!` or
//! CPUID directly), so one switch can make Tessera behave as on a CPU that lacks a feature.
//!
//! Contract:
//! - [`has`]`(f)` is true when this CPU (and, for AMX, the OS) supports `f` and
//!   `TESSERA_HIDE_ISA` ([`HIDE_ENV`]) does not hide it. Hiding only ever removes features, so a
//!   call guarded by [`has`] stays sound whatever the variable says.
//! - [`HIDE_ENV`] is read once per process, at the first query: comma-separated names,
//!   case-insensitive, blanks ignored ([`HIDE_NAMES`]): `avx512` hides every AVX-512 extension
//!   (F, BW, VL, DQ, BF16, VPOPCNTDQ), `avx512bf16` only AVX512-BF16, `amx` AMX-BF16, `avx2` AVX2
//!   and FMA together with every AVX-512 extension (no CPU has those without AVX2), which leaves
//!   the scalar paths.
//! - A name it does not know is not applied (the names it knows still are, so one typo does not
//!   unhide everything) and is reported: [`check_hide_env`] returns an error naming the variable
//!   (the CLI refuses it, exit code 2), [`hide_warning`] the warning a library reports instead.
//! - [`state`] tells a present-but-hidden feature from an absent one, for reports (`tessera env`)
//!   and test skip messages; decisions use [`has`].

use crate::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that hides CPU features from Tessera.
pub const HIDE_ENV: &str = "TESSERA_HIDE_ISA";

/// The names [`HIDE_ENV`] accepts.
pub const HIDE_NAMES: [&str; 4] = ["avx2", "avx512", "avx512bf16", "amx"];

/// A CPU feature Tessera's kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// AVX2.
    Avx2,
    /// FMA (fused multiply-add on ymm registers).
    Fma,
    /// AVX-512 Foundation.
    Avx512f,
    /// AVX-512 byte and word instructions.
    Avx512bw,
    /// AVX-512 vector length extensions (the ymm and xmm forms).
    Avx512vl,
    /// AVX-512 doubleword and quadword instructions.
    Avx512dq,
    /// AVX512-BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`).
    Avx512bf16,
    /// AVX-512 VPOPCNTDQ (`vpopcntq`).
    Avx512vpopcntdq,
    /// AMX-BF16 and AMX-TILE, with the tile state enabled by the OS (XCR0 bits 17-18); whether
    /// this process may use it (the Linux permission, a self-check) is the kernels' business.
    AmxBf16,
}

impl Feature {
    /// Every feature, in the order reports list them.
    pub const ALL: [Feature; 9] = [
        Feature::Avx2,
        Feature::Fma,
        Feature::Avx512f,
        Feature::Avx512bw,
        Feature::Avx512vl,
        Feature::Avx512dq,
        Feature::Avx512bf16,
        Feature::Avx512vpopcntdq,
        Feature::AmxBf16,
    ];

    /// Lowercase name (`is_x86_feature_detected!`'s, and `amx-bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Feature::Avx2 => "avx2",
            Feature::Fma => "fma",
            Feature::Avx512f => "avx512f",
            Feature::Avx512bw => "avx512bw",
            Feature::Avx512vl => "avx512vl",
            Feature::Avx512dq => "avx512dq",
            Feature::Avx512bf16 => "avx512bf16",
            Feature::Avx512vpopcntdq => "avx512vpopcntdq",
            Feature::AmxBf16 => "amx-bf16",
        }
    }

    fn bit(self) -> u16 {
        1 << self as u16
    }
}

/// Whether a feature is usable, hidden or absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// The CPU has it and [`HIDE_ENV`] does not hide it.
    Available,
    /// The CPU has it but [`HIDE_ENV`] hides it.
    Hidden,
    /// The CPU (or, for AMX, the OS) lacks it.
    Absent,
}

/// Whether Tessera may use `f`: present and not hidden (see the module contract).
pub fn has(f: Feature) -> bool {
    state(f) == State::Available
}

/// Whether `f` is available, hidden by [`HIDE_ENV`], or absent.
pub fn state(f: Feature) -> State {
    // Checked first so that nothing is probed for a hidden feature.
    let hidden = setting().hidden & f.bit() != 0;
    match (present(f), hidden) {
        (false, _) => State::Absent,
        (true, true) => State::Hidden,
        (true, false) => State::Available,
    }
}

/// The features this CPU has that [`HIDE_ENV`] hides, in [`Feature::ALL`] order.
pub fn hidden() -> Vec<Feature> {
    Feature::ALL
        .into_iter()
        .filter(|&f| state(f) == State::Hidden)
        .collect()
}

/// Whether the AMX tile unit is there for this process, or why not: hidden by [`HIDE_ENV`],
/// or what the CPU or the OS lacks (the same check as [`has`]`(Feature::AmxBf16)`).
pub fn amx_hardware() -> std::result::Result<(), &'static str> {
    if setting().hidden & Feature::AmxBf16.bit() != 0 {
        return Err("hidden by TESSERA_HIDE_ISA");
    }
    amx_present()
}

/// [`HIDE_ENV`] checked: an error naming the variable and the unknown names, for callers that
/// can refuse bad input (the CLI).
pub fn check_hide_env() -> Result<()> {
    match &setting().unknown {
        None => Ok(()),
        Some((unknown, text)) => Err(Error::invalid(
            HIDE_ENV,
            format!("comma-separated names among {}", HIDE_NAMES.join(", ")),
            format!("{unknown} in {text:?}"),
        )),
    }
}

/// The warning a library reports for a [`HIDE_ENV`] with unknown names (see [`check_hide_env`]),
/// `None` when it has none.
pub fn hide_warning() -> Option<String> {
    check_hide_env()
        .err()
        .map(|e| format!("{e}; those names are ignored"))
}

/// The parsed [`HIDE_ENV`] of this process.
struct Setting {
    /// [`Feature::bit`]s hidden.
    hidden: u16,
    /// The unknown names (quoted, comma-separated) and the whole value, when there are any.
    unknown: Option<(String, String)>,
}

fn setting() -> &'static Setting {
    static SETTING: OnceLock<Setting> = OnceLock::new();
    SETTING.get_or_init(|| {
        let text = std::env::var_os(HIDE_ENV)
            .map(|v| v.to_string_lossy().into_owned())
            .unwrap_or_default();
        parse(&text)
    })
}

fn parse(text: &str) -> Setting {
    use Feature::*;
    let avx512 = [
        Avx512f,
        Avx512bw,
        Avx512vl,
        Avx512dq,
        Avx512bf16,
        Avx512vpopcntdq,
    ];
    let bits = |fs: &[Feature]| fs.iter().fold(0, |acc, f| acc | f.bit());
    let mut hidden = 0;
    let mut unknown = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        hidden |= match name.to_ascii_lowercase().as_str() {
            "avx2" => bits(&[Avx2, Fma]) | bits(&avx512),
            "avx512" => bits(&avx512),
            "avx512bf16" => bits(&[Avx512bf16]),
            "amx" => bits(&[AmxBf16]),
            _ => {
                unknown.push(format!("{name:?}"));
                0
            }
        };
    }
    Setting {
        hidden,
        unknown: (!unknown.is_empty()).then(|| (unknown.join(", "), text.to_string())),
    }
}

/// Whether the CPU has `f`, hiding aside.
fn present(f: Feature) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as d;
        match f {
            Feature::Avx2 => d!("avx2"),
            Feature::Fma => d!("fma"),
            Feature::Avx512f => d!("avx512f"),
            Feature::Avx512bw => d!("avx512bw"),
            Feature::Avx512vl => d!("avx512vl"),
            Feature::Avx512dq => d!("avx512dq"),
            Feature::Avx512bf16 => d!("avx512bf16"),
            Feature::Avx512vpopcntdq => d!("avx512vpopcntdq"),
            Feature::AmxBf16 => amx_present().is_ok(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = f;
        false
    }
}

/// AMX-BF16 and AMX-TILE by CPUID (`is_x86_feature_detected!` has no stable AMX names) with the
/// tile state enabled by the OS, or why not; cached (CPUID is slow under some hypervisors).
fn amx_present() -> std::result::Result<(), &'static str> {
    static AMX: OnceLock<std::result::Result<(), &'static str>> = OnceLock::new();
    *AMX.get_or_init(amx_cpuid)
}

#[cfg(target_arch = "x86_64")]
fn amx_cpuid() -> std::result::Result<(), &'static str> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return Err("the CPU has no AMX-BF16 (CPUID has no leaf 7)");
    }
    let leaf7 = __cpuid_count(7, 0);
    if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return Err("the CPU has no AMX-BF16 (CPUID)");
    }
    if __cpuid(1).ecx & (1 << 27) == 0 {
        return Err("the OS has not enabled XSAVE (no OSXSAVE)");
    }
    // SAFETY: OSXSAVE is set, so XGETBV is available.
    let xcr0 = unsafe { xgetbv0() };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return Err("the OS has not enabled the AMX tile state (XCR0 bits 17-18)");
    }
    Ok(())
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_cpuid() -> std::result::Result<(), &'static str> {
    Err("AMX exists only on x86-64")
}

/// XCR0.
///
/// # Safety
/// The CPU must support XGETBV (CPUID.1:ECX.OSXSAVE).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    // SAFETY: the caller checked OSXSAVE.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_hide_their_features() {
        let hides = |text: &str, f: Feature| parse(text).hidden & f.bit() != 0;
        assert_eq!(parse("").hidden, 0);
        assert!(hides("avx512", Feature::Avx512bf16) && hides("avx512", Feature::Avx512vpopcntdq));
        assert!(!hides("avx512", Feature::Avx2) && !hides("avx512", Feature::AmxBf16));
        assert!(hides(" AMX , avx512bf16 ", Feature::AmxBf16));
        assert!(!hides("avx512bf16", Feature::Avx512f));
        // AVX2 takes FMA and every AVX-512 extension with it (scalar paths only), not AMX.
        for f in [
            Feature::Avx2,
            Feature::Fma,
            Feature::Avx512f,
            Feature::Avx512dq,
        ] {
            assert!(hides("avx2", f), "{f:?}");
        }
        assert!(!hides("avx2", Feature::AmxBf16));
        assert!(parse("avx2,,avx512,").unknown.is_none());
    }

    #[test]
    fn unknown_names_are_reported_and_the_known_ones_still_apply() {
        let s = parse("avx512,amx-bf16, sse9");
        assert_eq!(s.hidden & Feature::Avx512f.bit(), Feature::Avx512f.bit());
        let (unknown, text) = s.unknown.expect("unknown names");
        assert_eq!(unknown, "\"amx-bf16\", \"sse9\"");
        assert_eq!(text, "avx512,amx-bf16, sse9");
    }

    #[test]
    fn hidden_features_are_never_available() {
        for f in Feature::ALL {
            match state(f) {
                State::Available => assert!(has(f) && present(f)),
                State::Hidden => assert!(!has(f) && present(f)),
                State::Absent => assert!(!has(f) && !present(f)),
            }
        }
        assert_eq!(amx_hardware().is_ok(), has(Feature::AmxBf16));
    }
}
