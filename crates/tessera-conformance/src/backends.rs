//! The CPU kernel copies a test runs: those this CPU has once `TESSERA_HIDE_ISA` has hidden what
//! it names ([`tessera_core::cpu_features`]); every other copy is skipped with its reason on
//! stderr, so the suite passes on any x86-64 CPU and says what it did not run.
//!
//! Contract: a `TESSERA_HIDE_ISA` with a name it does not know panics here (a test run that
//! meant to hide a feature must not silently run on it).

use tessera_attn::cpu::Isa;
use tessera_attn::CpuBackend;

/// The backend on `isa`, or `None` after printing why this CPU does not run it.
pub fn cpu_backend_or_skip(isa: Isa) -> Option<CpuBackend> {
    if let Err(e) = tessera_core::cpu_features::check_hide_env() {
        panic!("{e}");
    }
    match CpuBackend::with_isa(isa) {
        Ok(be) => Some(be),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The backends on those of `isas` this CPU runs (each other one skipped with its reason),
/// with their copy.
pub fn cpu_backends_or_skip(isas: impl IntoIterator<Item = Isa>) -> Vec<(Isa, CpuBackend)> {
    isas.into_iter()
        .filter_map(|isa| cpu_backend_or_skip(isa).map(|be| (isa, be)))
        .collect()
}
