//! Planner orchestration: validation, per-(batch, head) deduplication, stages 1-3, statistics.

use crate::classify::{Geom, Node};
use crate::contract::{contract_key, PLAN_FORMAT_VERSION};
use crate::plan::{HeadPlan, PartialMasks, Plan, PlanStats, TileEntry, TileState, FULL_TILE};
use crate::shape::{PlanShape, TileShape};
use std::collections::HashMap;
use std::time::Instant;
use tessera_core::{metrics, Error, Result};
use tessera_mask::Mask;

/// Builds the plan of `mask` for `shape` and `tile` (SPEC §5). Records one plan build in
/// [`tessera_core::metrics`].
pub fn build_plan(mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<Plan> {
    let start = Instant::now();
    PlanShape::new(shape.batch, shape.heads, shape.q_len, shape.kv_len)?;
    TileShape::new(tile.q, tile.kv)?;
    mask.validate(shape.batch, shape.heads, shape.q_len, shape.kv_len)?;
    let g = Geom {
        lq: shape.q_len,
        lkv: shape.kv_len,
        tq: tile.q,
        tk: tile.kv,
        nq: shape.q_len.div_ceil(tile.q),
        nk: shape.kv_len.div_ceil(tile.kv),
        wpr: tile.kv.div_ceil(64),
    };
    if g.nq > u32::MAX as usize / 2 || g.nk > u32::MAX as usize / 2 {
        return Err(Error::invalid(
            "tile",
            "fewer than 2^31 tiles per side",
            g.nq.max(g.nk),
        ));
    }
    let dep = mask.dependence();
    let bg = if dep.batch { shape.batch } else { 1 };
    let hg = if dep.heads { shape.heads } else { 1 };

    let mut partials = PartialMasks::new(tile);
    let mut dedup = PartialDedup::default();
    let mut head_plans: Vec<HeadPlan> = Vec::new();
    let mut by_key: HashMap<String, u32> = HashMap::new();
    let mut group_plan = Vec::with_capacity(bg * hg);
    // How many (b, h) of the full problem each distinct head plan serves.
    let mut uses: Vec<u64> = Vec::new();
    let b_mult = (shape.batch / bg) as u64;
    let h_mult = (shape.heads / hg) as u64;
    for b in 0..bg {
        for h in 0..hg {
            // Heads/rows with identical specialized masks share one head plan.
            let key = if bg * hg == 1 {
                String::new()
            } else {
                mask.specialized_canonical(b, h)
            };
            let idx = match by_key.get(&key) {
                Some(&i) => i,
                None => {
                    let node = Node::prepare(mask, &g, b, h);
                    head_plans.push(plan_head(&node, &g, &mut partials, &mut dedup));
                    uses.push(0);
                    let i = (head_plans.len() - 1) as u32;
                    by_key.insert(key, i);
                    i
                }
            };
            uses[idx as usize] += b_mult * h_mult;
            group_plan.push(idx);
        }
    }

    let groups = group_plan.len() as u64;
    let tiles = groups * (g.nq * g.nk) as u64;
    let (mut full, mut partial) = (0u64, 0u64);
    for &p in &group_plan {
        full += head_plans[p as usize].full_tiles;
        partial += head_plans[p as usize].partial_tiles;
    }
    let allowed: u64 = head_plans
        .iter()
        .zip(&uses)
        .map(|(hp, &u)| hp.allowed_pairs * u)
        .sum();
    let total_pairs = (shape.batch * shape.heads) as f64 * shape.q_len as f64 * shape.kv_len as f64;
    let mut plan = Plan {
        format_version: PLAN_FORMAT_VERSION,
        contract: contract_key(mask, shape, tile),
        mask: mask.canonical(),
        shape,
        tile,
        q_tiles: g.nq,
        kv_tiles: g.nk,
        batch_groups: bg,
        head_groups: hg,
        group_plan,
        stats: PlanStats {
            tiles,
            empty_tiles: tiles - full - partial,
            partial_tiles: partial,
            full_tiles: full,
            unique_partial_masks: 0,
            head_plans: head_plans.len() as u64,
            allowed_pairs: allowed,
            density: allowed as f64 / total_pairs,
            tile_density: (full + partial) as f64 / tiles as f64,
            grid_width: head_plans.iter().map(|h| h.grid_width()).max().unwrap_or(0) as u64,
            plan_bytes: 0,
            build_ms: 0.0,
        },
        head_plans,
        partials,
    };
    plan.stats.unique_partial_masks = plan.partials.len() as u64;
    plan.stats.plan_bytes = plan.heap_bytes();
    let elapsed = start.elapsed();
    plan.stats.build_ms = elapsed.as_secs_f64() * 1e3;
    metrics::record_plan_built(elapsed);
    Ok(plan)
}

/// Content-addressed table of partial bitmasks.
#[derive(Default)]
struct PartialDedup {
    by_hash: HashMap<u64, Vec<u32>>,
}

impl PartialDedup {
    fn intern(&mut self, table: &mut PartialMasks, bits: &[u64]) -> u32 {
        // FNV-style mix: cheap, and collisions are resolved by comparing content.
        let h = bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |a, &w| {
            (a ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(29)
        });
        let ids = self.by_hash.entry(h).or_default();
        for &id in ids.iter() {
            if table.get(id) == bits {
                return id;
            }
        }
        let id = table.len() as u32;
        table.data.extend_from_slice(bits);
        ids.push(id);
        id
    }
}

/// Stages 1-3 for one specialized mask.
fn plan_head(
    node: &Node,
    g: &Geom,
    table: &mut PartialMasks,
    dedup: &mut PartialDedup,
) -> HeadPlan {
    let mut fwd_offsets = Vec::with_capacity(g.nq + 1);
    let mut fwd = Vec::new();
    let mut bits = vec![0u64; g.tq * g.wpr];
    let mut pool = Vec::new();
    let (mut full_tiles, mut partial_tiles, mut allowed) = (0u64, 0u64, 0u64);
    fwd_offsets.push(0u32);
    for qt in 0..g.nq {
        if let Some((lo, hi)) = node.reach(g, qt) {
            let rows = (g.lq - qt * g.tq).min(g.tq) as u64;
            for kt in lo..=hi {
                let cols = (g.lkv - kt * g.tk).min(g.tk) as u64;
                let state = match node.classify(g, qt, kt) {
                    TileState::Partial => {
                        // Stage 2: exact refinement at token level.
                        node.eval(g, qt, kt, &mut bits, &mut pool);
                        let n: u64 = bits.iter().map(|w| w.count_ones() as u64).sum();
                        if n == 0 {
                            TileState::Empty
                        } else if n == rows * cols {
                            TileState::Full
                        } else {
                            allowed += n;
                            partial_tiles += 1;
                            let id = dedup.intern(table, &bits);
                            fwd.push(TileEntry {
                                tile: kt as u32,
                                mask: id,
                            });
                            continue;
                        }
                    }
                    s => s,
                };
                if state == TileState::Full {
                    allowed += rows * cols;
                    full_tiles += 1;
                    fwd.push(TileEntry {
                        tile: kt as u32,
                        mask: FULL_TILE,
                    });
                }
            }
        }
        fwd_offsets.push(fwd.len() as u32);
    }
    // Stage 3: the backward list is the transpose (counting sort by kv tile keeps q order).
    let mut bwd_offsets = vec![0u32; g.nk + 1];
    for e in &fwd {
        bwd_offsets[e.tile as usize + 1] += 1;
    }
    for k in 0..g.nk {
        bwd_offsets[k + 1] += bwd_offsets[k];
    }
    let mut fill = bwd_offsets.clone();
    let mut bwd = vec![TileEntry { tile: 0, mask: 0 }; fwd.len()];
    for qt in 0..g.nq {
        for e in &fwd[fwd_offsets[qt] as usize..fwd_offsets[qt + 1] as usize] {
            let slot = &mut fill[e.tile as usize];
            bwd[*slot as usize] = TileEntry {
                tile: qt as u32,
                mask: e.mask,
            };
            *slot += 1;
        }
    }
    HeadPlan {
        fwd_offsets,
        fwd,
        bwd_offsets,
        bwd,
        full_tiles,
        partial_tiles,
        allowed_pairs: allowed,
    }
}
