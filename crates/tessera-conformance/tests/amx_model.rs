//! The AMX kernels on the software model of the tile unit (`TESSERA_AMX_MODEL=1`), so they are
//! checked against float64 on CPUs without AMX: every standard case in bf16 storage (the AMX
//! path is the bf16 forward's; its backward is the `vdpbf16ps` one), forward and backward,
//! with the bf16 tolerances. An f32 case whose bf16 version fails them on the `vdpbf16ps` path
//! too (bf16 storage is past what it was written for: `feat/large_logits`' dQ) is held to that
//! path's errors instead: the AMX run's may exceed them by at most 10 %. Needs AVX512-BF16 (the
//! rest of the kernel); skipped without it.
//! On a CPU with AMX the same cases run on the hardware instead (the model is not used there).
//!
//! Its own test binary: the variable is read once per process, before any kernel runs.

use tessera_attn::cpu::{Isa, AMX_MODEL_ENV};
use tessera_attn::CpuBackend;
use tessera_conformance::{cpu_backend_or_skip, run_case, standard_cases};
use tessera_core::DType;

#[test]
fn every_case_in_bf16_on_the_amx_path() {
    // Only this process's own kernels read the variable, and every test in this binary sets the
    // same value before using them.
    std::env::set_var(AMX_MODEL_ENV, "1");
    // Needs AVX512-BF16 underneath, model or not.
    let Some(be) = cpu_backend_or_skip(Isa::Avx512Amx) else {
        return;
    };
    let dot = CpuBackend::with_isa(Isa::Avx512Bf16).expect("AVX512-BF16 where AMX runs");
    let mut failed = Vec::new();
    let mut ran = 0;
    for c in standard_cases() {
        // The model is slow: the 4K-token cases run on hardware only.
        if c.group() == "large" && std::env::var("TESSERA_AMX_MODEL_LARGE").is_err() {
            continue;
        }
        let c = if c.dtype == DType::BF16 { c } else { c.bf16() };
        let r = run_case(&be, &c).unwrap_or_else(|e| panic!("case {}: {e}", c.name));
        ran += 1;
        if r.passed() {
            continue;
        }
        let base = run_case(&dot, &c).unwrap_or_else(|e| panic!("case {}: {e}", c.name));
        let within = !base.passed()
            && r.metrics.len() == base.metrics.len()
            && r.metrics
                .iter()
                .zip(&base.metrics)
                .all(|(m, b)| m.name == b.name && m.value <= m.tolerance.max(1.1 * b.value));
        if within {
            println!("{} fails on the dot path too: {base}\n  amx: {r}", c.name);
        } else {
            failed.push(r.to_string());
        }
    }
    assert!(ran > 50, "only {ran} cases ran");
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
