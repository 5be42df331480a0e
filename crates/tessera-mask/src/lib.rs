//! Mask algebra (SPEC §3).
//!
//! Contract: [`Mask`] is the one definition of which (batch, head, query, key) pairs may attend.
//! [`Mask::allowed`] is its token-level semantics; the text language ([`parse`]) only builds a
//! `Mask`, and the planner's fast paths are tested against `allowed`. [`Mask::canonical`] is a
//! stable textual form (operands flattened and sorted, data replaced by its BLAKE3 hash) from which
//! contract keys are derived.

mod data;
mod expr;
mod parse;

pub use data::{DenseMask, SegmentIds, Segments};
pub use expr::{Dependence, Mask};
pub use parse::{parse, NoData, Resolver};
