//! The plan: tile states as forward/backward work lists plus deduplicated partial bitmasks.
//!
//! Contract: a plan is plain data (serde-serializable) that kernels and exporters read without
//! knowing the mask. A tile absent from a row's work list is Empty. Memory is proportional to
//! active tiles plus unique partial tiles; a dense `[nq, nk]` state grid is only materialized on
//! request ([`Plan::states`]). A plan of tile states only (`build_tile_states`) has the same
//! lists and counts without the partial bitmasks; whatever reads them refuses it
//! ([`Plan::has_masks`]).

use crate::contract::ContractKey;
use crate::shape::{PlanShape, TileShape};
use tessera_core::{Error, Result};

/// Tile state, with the JAX Splash `block_mask` numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(i8)]
pub enum TileState {
    /// No allowed pair.
    Empty = 0,
    /// Some pairs allowed, some not.
    Partial = 1,
    /// Every in-range pair allowed.
    Full = 2,
}

/// `TileEntry::mask` value marking a full tile.
pub const FULL_TILE: u32 = u32::MAX;

/// One non-empty tile in a work list: the other-axis tile index and its partial-mask id
/// ([`FULL_TILE`] when the tile is full).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TileEntry {
    /// Index of the tile along the other axis.
    pub tile: u32,
    /// Partial-mask id in [`PartialMasks`], or [`FULL_TILE`].
    pub mask: u32,
}

impl TileEntry {
    /// True for a full tile.
    pub fn is_full(&self) -> bool {
        self.mask == FULL_TILE
    }
}

/// The plan of one distinct (batch row, head) mask.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeadPlan {
    /// `fwd[fwd_offsets[qt]..fwd_offsets[qt + 1]]` are q-tile `qt`'s non-empty kv tiles, ascending.
    pub fwd_offsets: Vec<u32>,
    /// Forward work list entries (kv tiles).
    pub fwd: Vec<TileEntry>,
    /// `bwd[bwd_offsets[kt]..bwd_offsets[kt + 1]]` are kv-tile `kt`'s non-empty q tiles, ascending.
    pub bwd_offsets: Vec<u32>,
    /// Backward work list entries (q tiles).
    pub bwd: Vec<TileEntry>,
    /// Full tiles of this mask.
    pub full_tiles: u64,
    /// Partial tiles of this mask.
    pub partial_tiles: u64,
    /// Allowed (query, key) pairs of this mask.
    pub allowed_pairs: u64,
}

impl HeadPlan {
    /// Non-empty kv tiles of q-tile `qt` (forward work list row).
    pub fn row(&self, qt: usize) -> &[TileEntry] {
        &self.fwd[self.fwd_offsets[qt] as usize..self.fwd_offsets[qt + 1] as usize]
    }

    /// Non-empty q tiles of kv-tile `kt` (backward work list column).
    pub fn col(&self, kt: usize) -> &[TileEntry] {
        &self.bwd[self.bwd_offsets[kt] as usize..self.bwd_offsets[kt + 1] as usize]
    }

    /// State of tile (`qt`, `kt`), by binary search in the row.
    pub fn state(&self, qt: usize, kt: usize) -> TileState {
        let row = self.row(qt);
        match row.binary_search_by_key(&(kt as u32), |e| e.tile) {
            Ok(k) if row[k].is_full() => TileState::Full,
            Ok(_) => TileState::Partial,
            Err(_) => TileState::Empty,
        }
    }

    /// Non-empty tiles.
    pub fn active_tiles(&self) -> u64 {
        self.fwd.len() as u64
    }

    /// Length of the longest forward row.
    pub fn grid_width(&self) -> usize {
        self.fwd_offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }
}

/// Deduplicated bitmasks of partial tiles. Mask `id` has `tile.q` rows of `words_per_row` u64
/// words; bit `c % 64` of word `c / 64` of row `r` is pair (tile row r, tile column c). Bits of
/// out-of-range rows and columns (ragged tails) are 0.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PartialMasks {
    /// The tile shape of every mask.
    pub tile: TileShape,
    /// `ceil(tile.kv / 64)`.
    pub words_per_row: usize,
    /// The masks, one after the other.
    pub data: Vec<u64>,
}

impl PartialMasks {
    /// No masks yet, for tiles of `tile`.
    pub fn new(tile: TileShape) -> Self {
        PartialMasks {
            tile,
            words_per_row: tile.kv.div_ceil(64),
            data: Vec::new(),
        }
    }

    /// Words per mask.
    pub fn mask_words(&self) -> usize {
        self.tile.q * self.words_per_row
    }

    /// Number of masks.
    pub fn len(&self) -> usize {
        self.data.len() / self.mask_words()
    }

    /// True when there is no partial mask.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// True when mask `id` has no bit set outside its first `rows` rows and `cols` columns.
    pub fn zero_outside(&self, id: u32, rows: usize, cols: usize) -> bool {
        let w = self.words_per_row;
        self.get(id).chunks(w).enumerate().all(|(r, row)| {
            row.iter().enumerate().all(|(k, &word)| {
                let lo = k * 64;
                let keep = if r >= rows || cols <= lo {
                    0
                } else if cols >= lo + 64 {
                    u64::MAX
                } else {
                    (1u64 << (cols - lo)) - 1
                };
                word & !keep == 0
            })
        })
    }

    /// All words of mask `id`.
    pub fn get(&self, id: u32) -> &[u64] {
        let n = self.mask_words();
        &self.data[id as usize * n..(id as usize + 1) * n]
    }

    /// Words of row `r` of mask `id`.
    pub fn row(&self, id: u32, r: usize) -> &[u64] {
        let m = self.get(id);
        &m[r * self.words_per_row..(r + 1) * self.words_per_row]
    }

    /// Whether pair (row `r`, column `c`) of mask `id` is allowed.
    pub fn allowed(&self, id: u32, r: usize, c: usize) -> bool {
        (self.row(id, r)[c / 64] >> (c % 64)) & 1 == 1
    }
}

/// Summary numbers of a plan.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlanStats {
    /// Tiles over the `[B', H', nq, nk]` grid, by state.
    pub tiles: u64,
    /// Empty tiles.
    pub empty_tiles: u64,
    /// Partial tiles.
    pub partial_tiles: u64,
    /// Full tiles.
    pub full_tiles: u64,
    /// Distinct partial bitmasks after deduplication.
    pub unique_partial_masks: u64,
    /// Distinct (batch row, head) masks actually planned.
    pub head_plans: u64,
    /// Allowed pairs over the whole `[B, H, Lq, Lkv]` problem.
    pub allowed_pairs: u64,
    /// Allowed pairs / (B·H·Lq·Lkv).
    pub density: f64,
    /// Active (non-empty) tiles / all tiles.
    pub tile_density: f64,
    /// Longest forward row in tiles.
    pub grid_width: u64,
    /// Heap size of the plan in bytes.
    pub plan_bytes: u64,
    /// Wall time of the build in milliseconds.
    pub build_ms: f64,
}

/// A plan for one contract (docs/semantics.md#plans).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    /// [`PLAN_FORMAT_VERSION`](crate::PLAN_FORMAT_VERSION) of the build that made it.
    pub format_version: u32,
    /// The contract this plan answers (mask, shapes, tiles, format version).
    pub contract: ContractKey,
    /// Canonical text of the planned mask.
    pub mask: String,
    /// Problem shape.
    pub shape: PlanShape,
    /// Tile shape.
    pub tile: TileShape,
    /// Query tiles `nq = ceil(Lq / tile.q)`.
    pub q_tiles: usize,
    /// Key tiles `nk = ceil(Lkv / tile.kv)`.
    pub kv_tiles: usize,
    /// `B'`: 1 when the mask is the same for every batch row, else `B`.
    pub batch_groups: usize,
    /// `H'`: 1 when the mask is the same for every head, else `H`.
    pub head_groups: usize,
    /// `[B' * H']` index into `head_plans`.
    pub group_plan: Vec<u32>,
    /// One plan per distinct (batch row, head) mask.
    pub head_plans: Vec<HeadPlan>,
    /// The deduplicated partial-tile bitmasks all head plans point into.
    pub partials: PartialMasks,
    /// Summary numbers.
    pub stats: PlanStats,
}

impl Plan {
    /// Index into `head_plans` used by batch row `b` and query head `h` (any b < B, h < H).
    pub fn head_plan_index(&self, b: usize, h: usize) -> usize {
        let bg = if self.batch_groups == 1 { 0 } else { b };
        let hg = if self.head_groups == 1 { 0 } else { h };
        self.group_plan[bg * self.head_groups + hg] as usize
    }

    /// The head plan used by batch row `b` and query head `h`.
    pub fn head_plan(&self, b: usize, h: usize) -> &HeadPlan {
        &self.head_plans[self.head_plan_index(b, h)]
    }

    /// Token range `[start, end)` of q-tile `qt`.
    pub fn q_range(&self, qt: usize) -> (usize, usize) {
        let s = qt * self.tile.q;
        (s, (s + self.tile.q).min(self.shape.q_len))
    }

    /// Token range `[start, end)` of kv-tile `kt`.
    pub fn kv_range(&self, kt: usize) -> (usize, usize) {
        let s = kt * self.tile.kv;
        (s, (s + self.tile.kv).min(self.shape.kv_len))
    }

    /// Dense tile states `[B', H', nq, nk]` (Empty 0, Partial 1, Full 2) and their shape.
    pub fn states(&self) -> ([usize; 4], Vec<i8>) {
        let (nq, nk) = (self.q_tiles, self.kv_tiles);
        let mut out = vec![TileState::Empty as i8; self.group_plan.len() * nq * nk];
        for (g, &p) in self.group_plan.iter().enumerate() {
            let hp = &self.head_plans[p as usize];
            for qt in 0..nq {
                for e in hp.row(qt) {
                    out[(g * nq + qt) * nk + e.tile as usize] = if e.is_full() {
                        TileState::Full as i8
                    } else {
                        TileState::Partial as i8
                    };
                }
            }
        }
        ([self.batch_groups, self.head_groups, nq, nk], out)
    }

    /// Whether pair (`i`, `j`) is allowed for batch row `b`, head `h`, read from the plan alone.
    pub fn allowed(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (qt, kt) = (i / self.tile.q, j / self.tile.kv);
        let row = self.head_plan(b, h).row(qt);
        match row.binary_search_by_key(&(kt as u32), |e| e.tile) {
            Ok(k) if row[k].is_full() => true,
            Ok(k) => self
                .partials
                .allowed(row[k].mask, i % self.tile.q, j % self.tile.kv),
            Err(_) => false,
        }
    }

    /// Forward FLOPs over allowed pairs: `2·Dqk` for QKᵀ plus `2·Dv` for PV per pair.
    pub fn forward_flops(&self, d_qk: usize, d_v: usize) -> f64 {
        self.stats.allowed_pairs as f64 * 2.0 * (d_qk + d_v) as f64
    }

    /// Backward FLOPs over allowed pairs: recomputed S (2·Dqk), dP (2·Dv), dV (2·Dv), dQ (2·Dqk),
    /// dK (2·Dqk) per pair.
    pub fn backward_flops(&self, d_qk: usize, d_v: usize) -> f64 {
        self.stats.allowed_pairs as f64 * (6 * d_qk + 4 * d_v) as f64
    }
    /// Whether the partial tiles' bitmasks are in [`Plan::partials`]: false only for a plan of
    /// [`build_tile_states`](crate::build_tile_states) that has partial tiles.
    pub fn has_masks(&self) -> bool {
        self.stats.partial_tiles == 0 || !self.partials.is_empty()
    }

    /// `Ok` when the plan has its bitmasks ([`Plan::has_masks`]), else an error saying that
    /// `what` needs them.
    pub fn require_masks(&self, what: &str) -> Result<()> {
        if self.has_masks() {
            return Ok(());
        }
        Err(Error::invalid(
            "plan",
            format!("a plan with its partial-tile bitmasks for {what} (build_plan)"),
            "a plan of tile states only (build_tile_states)",
        ))
    }

    /// The plan's internal consistency: valid tile and problem shapes; tile counts, batch/head
    /// groups, work lists and the partial-mask table agree; every row of a work list is
    /// strictly ascending; the backward lists are exactly the transpose of the forward ones; the
    /// per-head tile counts match the lists. Every consumer (kernels, exporters, pictures) can
    /// index a plan that passes without going out of range; the plan cache refuses a decoded
    /// entry that fails. Errors name what is inconsistent.
    pub fn check_consistent(&self) -> Result<()> {
        self.require_masks("its consumers")?;
        let bad = |found: String| Error::invalid("plan", "an internally consistent plan", found);
        let (s, t) = (self.shape, self.tile);
        PlanShape::new(s.batch, s.heads, s.q_len, s.kv_len).map_err(|e| bad(e.to_string()))?;
        TileShape::new(t.q, t.kv).map_err(|e| bad(e.to_string()))?;
        if self.partials.tile != t {
            return Err(bad(format!("partial masks of tile {}", self.partials.tile)));
        }
        if self.q_tiles != s.q_len.div_ceil(t.q) || self.kv_tiles != s.kv_len.div_ceil(t.kv) {
            return Err(bad(format!(
                "{}x{} tiles for Lq={} Lkv={} and tile {t}",
                self.q_tiles, self.kv_tiles, s.q_len, s.kv_len
            )));
        }
        if self.partials.words_per_row != t.kv.div_ceil(64)
            || !self
                .partials
                .data
                .len()
                .is_multiple_of(self.partials.mask_words())
        {
            return Err(bad("a partial-mask table of the wrong size".into()));
        }
        let groups_ok = (self.batch_groups == 1 || self.batch_groups == s.batch)
            && (self.head_groups == 1 || self.head_groups == s.heads)
            && self.batch_groups.checked_mul(self.head_groups) == Some(self.group_plan.len())
            && self
                .group_plan
                .iter()
                .all(|&g| (g as usize) < self.head_plans.len());
        if !groups_ok {
            return Err(bad("inconsistent batch/head groups".into()));
        }
        let n_masks = self.partials.len() as u64;
        // Every mask is 0 past the tile's own columns (the padding bits of its last word).
        if let Some(id) = (0..n_masks as u32).find(|&id| !self.partials.zero_outside(id, t.q, t.kv))
        {
            return Err(bad(format!(
                "partial mask {id} has bits past the tile's {} columns",
                t.kv
            )));
        }
        for (k, hp) in self.head_plans.iter().enumerate() {
            let lists = [
                (&hp.fwd_offsets, &hp.fwd, self.q_tiles, self.kv_tiles),
                (&hp.bwd_offsets, &hp.bwd, self.kv_tiles, self.q_tiles),
            ];
            for (offsets, entries, n, other) in lists {
                let ok = offsets.len() == n + 1
                    && offsets.first() == Some(&0)
                    && offsets.windows(2).all(|w| w[0] <= w[1])
                    && offsets.last().map(|&x| x as usize) == Some(entries.len())
                    && offsets.windows(2).all(|w| {
                        entries[w[0] as usize..w[1] as usize]
                            .windows(2)
                            .all(|p| p[0].tile < p[1].tile)
                    })
                    && entries.iter().all(|e| {
                        (e.tile as usize) < other && (e.is_full() || (e.mask as u64) < n_masks)
                    });
                if !ok {
                    return Err(bad(format!("head plan {k}: a work list out of range")));
                }
            }
            // The backward lists must be the transpose of the forward ones: walking the forward
            // rows in order visits each backward column's entries in order.
            let mut fill: Vec<u32> = hp.bwd_offsets[..self.kv_tiles].to_vec();
            let (mut full, mut partial) = (0u64, 0u64);
            for qt in 0..self.q_tiles {
                for e in hp.row(qt) {
                    let slot = &mut fill[e.tile as usize];
                    let matches = *slot < hp.bwd_offsets[e.tile as usize + 1]
                        && hp.bwd[*slot as usize]
                            == TileEntry {
                                tile: qt as u32,
                                mask: e.mask,
                            };
                    if !matches {
                        return Err(bad(format!(
                            "head plan {k}: backward work list is not the forward one transposed"
                        )));
                    }
                    *slot += 1;
                    if e.is_full() {
                        full += 1;
                    } else {
                        partial += 1;
                    }
                }
            }
            // Partial bitmasks of ragged edge tiles must be 0 outside the in-range pairs
            // (kernels derive the live sub-blocks of a tile from its bits).
            let ragged_q = s.q_len % t.q != 0;
            let ragged_kv = s.kv_len % t.kv != 0;
            for qt in 0..self.q_tiles {
                let last_q = ragged_q && qt + 1 == self.q_tiles;
                for e in hp.row(qt) {
                    let last_kv = ragged_kv && e.tile as usize + 1 == self.kv_tiles;
                    if e.is_full() || !(last_q || last_kv) {
                        continue;
                    }
                    let rows = if last_q { s.q_len % t.q } else { t.q };
                    let cols = if last_kv { s.kv_len % t.kv } else { t.kv };
                    if !self.partials.zero_outside(e.mask, rows, cols) {
                        return Err(bad(format!(
                            "head plan {k}: partial mask {} has bits outside tile ({qt}, {})",
                            e.mask, e.tile
                        )));
                    }
                }
            }
            if (full, partial) != (hp.full_tiles, hp.partial_tiles) {
                return Err(bad(format!(
                    "head plan {k}: {} full and {} partial tiles recorded, {full} and {partial} listed",
                    hp.full_tiles, hp.partial_tiles
                )));
            }
        }
        Ok(())
    }

    /// Bytes held by the plan's arrays.
    pub fn heap_bytes(&self) -> u64 {
        let entry = std::mem::size_of::<TileEntry>();
        let lists: usize = self
            .head_plans
            .iter()
            .map(|h| {
                (h.fwd_offsets.len() + h.bwd_offsets.len()) * 4
                    + (h.fwd.len() + h.bwd.len()) * entry
            })
            .sum();
        (lists + self.partials.data.len() * 8 + self.group_plan.len() * 4) as u64
    }
}
