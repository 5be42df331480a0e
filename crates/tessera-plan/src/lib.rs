//! The tile planner (docs/semantics.md#plans).
//!
//! Contract: [`build_plan`] turns a validated [`Mask`](tessera_mask::Mask), a [`PlanShape`] and a
//! [`TileShape`] into a [`Plan`] whose tile states are sound and exact: an Empty tile holds no
//! allowed pair, a Full tile no disallowed in-range pair, a Partial tile both, and every partial
//! tile's bitmask equals the token mask. Stages: (1) analytic interval classification per tile,
//! visiting only the kv tiles a q-tile row can reach (under a `blocks` leaf, only the selected
//! ones: planning a block selection costs O(selected tiles)), (2) token-level refinement of partial tiles
//! with content-deduplicated bitmasks, (3) compaction into forward and backward work lists.
//! No stage allocates O(Lq·Lkv) for structured masks. This crate holds no kernel code.
//!
//! ```
//! use tessera_mask::Mask;
//! use tessera_plan::{build_plan, PlanShape, TileShape, TileState};
//!
//! // causal over 512 tokens in 128x128 tiles: a 4x4 grid.
//! let shape = PlanShape::new(1, 1, 512, 512)?;
//! let plan = build_plan(&Mask::causal(), shape, TileShape::new(128, 128)?)?;
//! let head = plan.head_plan(0, 0);
//! assert_eq!(head.state(0, 1), TileState::Empty);
//! assert_eq!(head.state(1, 0), TileState::Full);
//! assert_eq!(head.state(2, 2), TileState::Partial);
//! assert_eq!((plan.stats.full_tiles, plan.stats.partial_tiles), (6, 4));
//! # Ok::<(), tessera_core::Error>(())
//! ```

mod build;
mod classify;
mod contract;
pub mod cp_sim;
mod dedup;
mod plan;
mod shape;
pub mod shard;

pub use build::{build_plan, build_plan_within, build_tile_states, stage1_census};
pub use contract::{contract_key, contract_key_of_canonical, ContractKey, PLAN_FORMAT_VERSION};
pub use plan::{HeadPlan, PartialMasks, Plan, PlanStats, TileEntry, TileState, FULL_TILE};
pub use shape::{PlanShape, TileShape};
pub use shard::{shard, CostModel, KvLayout, RankCost, Scheme, Sharding};
