//! The CUDA backend's place in the tree (docs/ARCHITECTURE.md: "CPU today; CUDA next").
//!
//! Contract: a GPU backend implements [`Backend`](crate::Backend) next to [`cpu`](crate::cpu):
//! `prepare` uploads the plan's work lists and partial masks once (its `Prepared` holds the
//! device copies), `forward_into`/`backward_into` take device views and a stream in its
//! `Workspace`, and it passes the same conformance suite by one test-macro line. This build has
//! no CUDA code: [`CudaBackend::new`] says so with [`Error::Unsupported`], so callers can write
//! their backend selection (and GPU users get a clear message) today.

use tessera_core::{Error, Result};

/// The CUDA backend (not in this build).
#[derive(Debug)]
pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    /// Always [`Error::Unsupported`] in this build: Tessera has no CUDA kernels yet. GPU users
    /// plan with Tessera and run PyTorch FlexAttention or JAX Splash on the exported plan.
    pub fn new() -> Result<Self> {
        Err(Error::Unsupported(
            "this build of Tessera has no CUDA backend; on a GPU, export the plan \
             (FlexAttention BlockMask or Splash MaskInfo) and run that engine's kernel"
                .into(),
        ))
    }
}
