//! Mask algebra (docs/semantics.md#masks).
//!
//! Contract: [`Mask`] is the one definition of which (batch, head, query, key) pairs may attend.
//! [`Mask::allowed`] is its token-level semantics; the text language ([`parse`]) only builds a
//! `Mask`, and the planner's fast paths are tested against `allowed`. [`Mask::canonical`] is a
//! stable textual form (operands flattened and sorted, data replaced by its BLAKE3 hash) from which
//! contract keys are derived.
//!
//! ```
//! use tessera_mask::{parse, Mask, NoData};
//!
//! // The text form and the typed API build the same mask.
//! let typed = Mask::window(2, 0) & Mask::causal();
//! let text = parse("window(2) & causal", &NoData)?;
//! assert_eq!(text.canonical(), typed.canonical());
//! // Query 5 sees keys 3, 4 and 5 only.
//! let seen: Vec<usize> = (0..8).filter(|&j| typed.allowed(0, 0, 5, j)).collect();
//! assert_eq!(seen, [3, 4, 5]);
//! # Ok::<(), tessera_core::Error>(())
//! ```

mod blocks;
mod data;
mod expr;
mod parse;
mod syntax;

pub use blocks::BlockSelection;
pub use data::{BandFeatures, DenseMask, SegmentIds, Segments};
pub use expr::{Dependence, Mask, MAX_TREE_DEPTH};
pub use parse::{parse, NoData, Resolver, MAX_LEN};
pub use syntax::MAX_DEPTH;
