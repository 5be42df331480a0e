//! Contract keys: the stable identity of a plan.
//!
//! Contract: two calls with equal canonical mask (data included by digest), shape, tile shape and
//! format version get equal keys; anything else differs (up to BLAKE3 collisions).

use crate::shape::{PlanShape, TileShape};
use tessera_mask::Mask;

/// Bumped whenever the plan's layout or semantics change, so old cache entries are never used.
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// BLAKE3 digest identifying a plan contract.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ContractKey(pub [u8; 32]);

impl ContractKey {
    /// Lowercase hex of the full digest.
    pub fn hex(&self) -> String {
        tessera_core::hex(&self.0)
    }
}

impl std::fmt::Debug for ContractKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContractKey({})", &self.hex()[..16])
    }
}

impl std::fmt::Display for ContractKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// The contract key of planning `mask` for `shape` with `tile`.
pub fn contract_key(mask: &Mask, shape: PlanShape, tile: TileShape) -> ContractKey {
    contract_key_of_canonical(&mask.canonical(), shape, tile)
}

/// The contract key of a mask given by its canonical text ([`Mask::canonical`], what a
/// [`crate::Plan`] records): lets a loaded plan be checked against the key it is stored under.
pub fn contract_key_of_canonical(
    canonical: &str,
    shape: PlanShape,
    tile: TileShape,
) -> ContractKey {
    let text = format!(
        "tessera-plan v{PLAN_FORMAT_VERSION}\nmask={}\nB={} H={} Lq={} Lkv={}\ntile={}x{}",
        canonical, shape.batch, shape.heads, shape.q_len, shape.kv_len, tile.q, tile.kv
    );
    ContractKey(*blake3::hash(text.as_bytes()).as_bytes())
}
