//! `tessera._tessera`: the native half of the `tessera` Python package (PyO3, one abi3 wheel).
//!
//! Contract: every function checks its arguments and raises `ValueError`/`TypeError` naming the
//! argument (never panics); planning, packing, exporting and the attention kernels release the
//! GIL. The pure-Python layer builds the user API on top: `tessera/core/` (masks, plans,
//! shardings), `tessera/engines/` (this module's kernels as torch ops and XLA FFI calls,
//! FlexAttention, Splash) and the frontends `tessera.torch`, `tessera.jax`, `tessera.cp`.

mod attention;
mod errors;
mod ffi;
mod mask;
mod pack;
mod plan;
mod shard;

use pyo3::prelude::*;

/// Every Rust allocation of this module (plans, exported tables, kernel scratch) through
/// mimalloc: glibc's malloc hands the large blocks of a plan back to the kernel when they are
/// freed and faults them in again on the next plan, which at 4K tokens cost more than planning
/// (tree-causal plan + BlockMask: 2.5 ms against 1.06 ms, 800 against 0 page faults per call;
/// BENCHMARKS.md, 2026-11-28, commit 5ba8a91).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The native module.
#[pymodule]
fn _tessera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<mask::PyMask>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_function(wrap_pyfunction!(mask::full, m)?)?;
    m.add_function(wrap_pyfunction!(mask::causal, m)?)?;
    m.add_function(wrap_pyfunction!(mask::window, m)?)?;
    m.add_function(wrap_pyfunction!(mask::chunk, m)?)?;
    m.add_function(wrap_pyfunction!(mask::prefix, m)?)?;
    m.add_function(wrap_pyfunction!(mask::document, m)?)?;
    m.add_function(wrap_pyfunction!(mask::dense, m)?)?;
    m.add_function(wrap_pyfunction!(mask::dense_words, m)?)?;
    m.add_function(wrap_pyfunction!(mask::band, m)?)?;
    m.add_function(wrap_pyfunction!(mask::heads, m)?)?;
    m.add_function(wrap_pyfunction!(mask::blocks, m)?)?;
    m.add_function(wrap_pyfunction!(mask::mask, m)?)?;
    m.add_function(wrap_pyfunction!(plan::plan, m)?)?;
    m.add_function(wrap_pyfunction!(plan::cache_stats, m)?)?;
    m.add_function(wrap_pyfunction!(pack::pack, m)?)?;
    m.add_class::<shard::PySharding>()?;
    m.add_function(wrap_pyfunction!(shard::shard, m)?)?;
    m.add_function(wrap_pyfunction!(shard::doc_mix, m)?)?;
    m.add_function(wrap_pyfunction!(shard::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention_forward, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention_forward_logged, m)?)?;
    m.add_function(wrap_pyfunction!(attention::telemetry_records, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_targets, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_register, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_register_local, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_release, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_registered, m)?)?;
    m.add_function(wrap_pyfunction!(ffi::ffi_registry_size, m)?)?;
    m.add_function(wrap_pyfunction!(attention::telemetry_sink_flags, m)?)?;
    m.add_function(wrap_pyfunction!(attention::outlier_candidates, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("TELEMETRY_COLUMNS", attention::STAT_COLUMNS)?;
    m.add("isa", tessera::CpuBackend::new().paths().to_string())?;
    // The library only reports a TESSERA_HIDE_ISA with unknown names; here it reaches the user.
    if let Some(w) = tessera::core::cpu_features::hide_warning() {
        let msg = std::ffi::CString::new(w).unwrap_or_default();
        let category = m.py().get_type::<pyo3::exceptions::PyRuntimeWarning>();
        PyErr::warn(m.py(), category.as_any(), &msg, 1)?;
    }
    m.add(
        "amx",
        match tessera::attn::cpu::amx_status() {
            Ok(on) => format!("used: {on}"),
            Err(why) => format!("not used: {why}"),
        },
    )?;
    Ok(())
}
