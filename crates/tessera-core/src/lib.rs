//! Shared vocabulary of Tessera.
//!
//! Contract: every other crate reports failures through [`Error`], stores tensors as [`Tensor`]
//! (row-major, contiguous, f32 or bf16 or integer storage), records counters in [`metrics`] and
//! finds its per-user cache directory with [`cache_dir`] and writes digests as text with [`hex()`](fn@hex).
//! Every CPU feature check goes through [`cpu_features`] (where `TESSERA_HIDE_ISA` hides features).
//! Nothing here knows about masks, plans or kernels.
//!
//! ```
//! use tessera_core::{DType, Error, Tensor};
//!
//! let t = Tensor::from_f32(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! assert_eq!((t.shape(), t.dtype(), t.numel()), (&[2, 3][..], DType::F32, 6));
//! // A shape that does not match the data is an error naming what was expected.
//! let bad = Tensor::from_f32(vec![4], vec![0.0; 3]).unwrap_err();
//! assert!(matches!(bad, Error::InvalidArgument { .. }) && bad.to_string().contains("4 elements"));
//! # Ok::<(), Error>(())
//! ```

pub mod budget;
pub mod cache_dir;
pub mod cpu_features;
pub mod error;
pub mod hex;
pub mod metrics;
pub mod tensor;

pub use error::{Error, Result};
pub use hex::hex;
pub use tensor::{DType, Tensor, TensorData};
