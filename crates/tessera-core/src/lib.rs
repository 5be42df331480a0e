//! Shared vocabulary of Tessera.
//!
//! Contract: every other crate reports failures through [`Error`], stores tensors as [`Tensor`]
//! (row-major, contiguous, f32 or bf16 or integer storage) and records counters in [`metrics`].
//! Nothing here knows about masks, plans or kernels.

pub mod error;
pub mod metrics;
pub mod tensor;

pub use error::{Error, Result};
pub use tensor::{DType, Tensor, TensorData};
