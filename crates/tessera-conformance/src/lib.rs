//! The conformance suite every attention backend passes (docs/ARCHITECTURE.md, docs/semantics.md#attention), the float64 dense
//! reference it compares with, and the seeded workloads shared by tests, benches and the CLI.
//!
//! Contract: a backend is tested by one line,
//! `tessera_conformance::backend_conformance_tests!(name, make_backend_expr);`, where the
//! expression evaluates to `Result<impl Backend, impl Display>` (an `Err` skips the tests with a
//! printed reason, for kernel copies this CPU lacks). It generates one `#[test]` per case group;
//! each case runs through `prepare` / `forward_into` / `backward_into` with NaN-poisoned outputs,
//! twice (contiguous, then strided inputs with the workspace reused: bit-identical), and is
//! compared with [`reference`](mod@reference) (see [`suite`] for the tolerances).
//!
//! ```
//! use tessera_attn::CpuBackend;
//! use tessera_conformance::{run_case, Case};
//! use tessera_mask::Mask;
//!
//! let case = Case::new("doc/causal", Mask::causal()).lens(40, 40).tile(16, 16);
//! let report = run_case(&CpuBackend::new(), &case)?;
//! assert!(report.passed(), "{report}");
//! # Ok::<(), tessera_core::Error>(())
//! ```

pub mod backends;
pub mod reference;
pub mod suite;
pub mod workloads;

pub use backends::{cpu_backend_or_skip, cpu_backends_or_skip};
pub use suite::{
    dispatch_cases, rel_error, run_case, run_group_or_skip, run_suite, standard_cases, Case,
    CaseReport, Metric, Tolerances, MAG_FLOOR,
};

/// One `#[test]` per conformance case group for the backend `$make` builds (an expression of
/// type `Result<B, E>`, `B: Backend`, `E: Display`; `Err` skips with the reason printed).
#[macro_export]
macro_rules! backend_conformance_tests {
    ($name:ident, $make:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn run(group: &str) {
                $crate::run_group_or_skip(|| $make, group);
            }

            #[test]
            fn mask_leaves_and_combinations() {
                run("mask");
            }
            #[test]
            fn lengths() {
                run("len");
            }
            #[test]
            fn batch_segments() {
                run("batch");
            }
            #[test]
            fn gqa_mqa() {
                run("gqa");
            }
            #[test]
            fn head_dims() {
                run("dims");
            }
            #[test]
            fn tile_shapes() {
                run("tile");
            }
            #[test]
            fn softcap_sinks_scale() {
                run("feat");
            }
            #[test]
            fn fully_masked_rows() {
                run("masked");
            }
            #[test]
            fn bf16_storage() {
                run("bf16");
            }
            #[test]
            fn large_problems() {
                run("large");
            }
            #[test]
            fn dispatch_paths() {
                run("dispatch");
            }
        }
    };
}
