//! Planner orchestration: validation, per-(batch, head) deduplication, stages 1-3, statistics.
//! A mask `blocks & rest` (a block selection intersected with a mask) refines each of the
//! rest's partial tiles once for every head plan that selects it.

use crate::classify::{simd, Candidates, Geom, Node};
use crate::contract::{contract_key_of_canonical, PLAN_FORMAT_VERSION};
use crate::dedup::{digest, PartialDedup};
use crate::plan::{HeadPlan, PartialMasks, Plan, PlanStats, TileEntry, TileState, FULL_TILE};
use crate::shape::{PlanShape, TileShape};
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::time::Instant;
use tessera_core::{budget, metrics, Error, Result};
use tessera_mask::Mask;

/// How many tiles' masks the partial-mask table reserves room for up front (2 MiB at 128 x 128).
const RESERVE_TILES: usize = 1024;

/// Bytes of one work-list entry (forward or backward).
const ENTRY_BYTES: u128 = std::mem::size_of::<TileEntry>() as u128;

/// Builds the plan of `mask` for `shape` and `tile` (docs/semantics.md#plans). Records one plan build in
/// [`tessera_core::metrics`].
///
/// Refused up front (never an allocation abort): a mask tree deeper than
/// [`tessera_mask::MAX_TREE_DEPTH`], more than 2^31 tiles per side, and a plan whose work lists
/// (bounded by stage 1 before they are built) or partial-mask table would exceed the memory
/// budget ([`tessera_core::budget`]).
pub fn build_plan(mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<Plan> {
    build(mask, shape, tile, None)
}

/// The plan of `mask` for `shape` and `tile` without its partial tiles' bitmasks: tile states,
/// work lists, tile counts and allowed pairs exactly as [`build_plan`] gives them, but every
/// partial entry's mask id is 0 and [`Plan::partials`] is empty (`stats.unique_partial_masks`
/// 0). For what reads tile states only (a FlexAttention `BlockMask` whose `mask_mod` is
/// computed, pictures); it costs what stage 2 needs to decide each tile, no more (a walked
/// interval column is counted, not listed; nothing is hashed or stored). Whatever reads
/// bitmasks refuses it ([`Plan::has_masks`]; [`Plan::check_consistent`] fails), and it must not
/// be cached as the contract's plan.
pub fn build_tile_states(mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<Plan> {
    build(mask, shape, tile, Some(0))
}

/// [`build_plan`] while the partial masks take at most `mask_bytes`, else [`build_tile_states`]
/// ([`Plan::has_masks`] says which): a caller that needs only tile states unless the masks are
/// cheap (a small table is cheaper to hand out than anything computed from the mask) pays for
/// at most `mask_bytes` of masks before they are dropped.
pub fn build_plan_within(
    mask: &Mask,
    shape: PlanShape,
    tile: TileShape,
    mask_bytes: usize,
) -> Result<Plan> {
    build(mask, shape, tile, Some(mask_bytes))
}

/// The plan, with every partial mask (`keep` None) or while they take at most `keep` bytes.
fn build(mask: &Mask, shape: PlanShape, tile: TileShape, keep: Option<usize>) -> Result<Plan> {
    let start = Instant::now();
    let (mut g, bg, hg) = checked(mask, shape, tile)?;
    g.masks = keep != Some(0);
    let what = || {
        format!(
            "plan for B={} H={} Lq={} Lkv={} tile {tile}",
            shape.batch, shape.heads, shape.q_len, shape.kv_len
        )
    };
    // The smallest possible plan: one head plan's work-list offsets and the group table.
    let offsets_bytes = 4 * (g.nq as u128 + g.nk as u128 + 2);
    budget::check(what, offsets_bytes + 4 * (bg as u128 * hg as u128))?;

    let mut partials = PartialMasks::new(tile);
    let mut dedup = PartialDedup::default();
    // `blocks & rest`: head plans share the rest's refined tiles (see `RestTiles`).
    let split = split_selection(mask);
    let mut shared = RestTiles::default();
    let mut cx = Refine {
        g: &g,
        bits: vec![0u64; g.tq * g.wpr],
        pool: Vec::new(),
        memo: FxHashMap::default(),
        key: Vec::new(),
        table: &mut partials,
        dedup: &mut dedup,
        what: &what,
        keep: keep.map(|b| b / 8),
        masks: g.masks,
    };
    let mut head_plans: Vec<HeadPlan> = Vec::new();
    // How many head plans were finished while the masks were still kept.
    let mut kept_ids = 0usize;
    let mut by_key: HashMap<String, u32> = HashMap::new();
    let mut group_plan = Vec::with_capacity(bg * hg);
    // Upper bound of the work lists so far (stage 1 reach of every head plan built).
    let mut lists_bytes: u128 = 0;
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
                    let rest = split.as_ref().map(|(_, rest)| shared.id(rest, b, h));
                    let node = match &split {
                        Some((reshaped, _)) => Node::prepare(reshaped, &g, b, h),
                        None => Node::prepare(mask, &g, b, h),
                    };
                    let visit: Vec<Candidates> =
                        (0..g.nq).map(|qt| node.candidates(&g, qt)).collect();
                    let reach: u128 = visit.iter().map(|c| c.len() as u128).sum();
                    lists_bytes += offsets_bytes + 2 * ENTRY_BYTES * reach;
                    budget::check(what, lists_bytes)?;
                    if cx.masks && cx.table.data.is_empty() {
                        // Room for the partial masks the visited tiles may add (at most
                        // RESERVE_TILES, or what may be kept): growing the table by doubling
                        // copied it once more. Untouched room costs address space only.
                        let kept = cx.keep.map_or(usize::MAX, |w| w / (g.tq * g.wpr) + 1);
                        let tiles = (reach as usize).min(RESERVE_TILES).min(kept);
                        cx.table.data.reserve(tiles * g.tq * g.wpr);
                        cx.dedup.reserve(tiles);
                    }
                    let share = rest.map(|id| (&mut shared, id));
                    let hp = plan_head(&node, &visit, &mut cx, share)?;
                    head_plans.push(hp);
                    if cx.masks {
                        kept_ids = head_plans.len();
                    }
                    uses.push(0);
                    let i = (head_plans.len() - 1) as u32;
                    by_key.insert(key, i);
                    i
                }
            };
            uses[idx as usize] = uses[idx as usize].saturating_add(b_mult.saturating_mul(h_mult));
            group_plan.push(idx);
        }
    }

    let masks_kept = cx.masks;
    // Counts saturate: B·H·Lq·Lkv can exceed u64 for shapes whose plan is small.
    let groups = group_plan.len() as u64;
    let tiles = groups.saturating_mul((g.nq as u64).saturating_mul(g.nk as u64));
    let (mut full, mut partial) = (0u64, 0u64);
    for &p in &group_plan {
        full = full.saturating_add(head_plans[p as usize].full_tiles);
        partial = partial.saturating_add(head_plans[p as usize].partial_tiles);
    }
    let allowed: u64 = head_plans.iter().zip(&uses).fold(0u64, |a, (hp, &u)| {
        a.saturating_add(hp.allowed_pairs.saturating_mul(u))
    });
    let total_pairs =
        shape.batch as f64 * shape.heads as f64 * shape.q_len as f64 * shape.kv_len as f64;
    let canonical = mask.canonical();
    let mut plan = Plan {
        format_version: PLAN_FORMAT_VERSION,
        contract: contract_key_of_canonical(&canonical, shape, tile),
        mask: canonical,
        shape,
        tile,
        q_tiles: g.nq,
        kv_tiles: g.nk,
        batch_groups: bg,
        head_groups: hg,
        group_plan,
        stats: PlanStats {
            tiles,
            empty_tiles: tiles.saturating_sub(full).saturating_sub(partial),
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
    if !masks_kept {
        plan.partials.data = Vec::new();
        // Head plans finished while masks were kept hold ids; a later one cleared its own.
        for hp in &mut plan.head_plans[..kept_ids] {
            clear_ids(&mut hp.fwd);
            clear_ids(&mut hp.bwd);
        }
    }
    plan.stats.unique_partial_masks = plan.partials.len() as u64;
    plan.stats.plan_bytes = plan.heap_bytes();
    let elapsed = start.elapsed();
    plan.stats.build_ms = elapsed.as_secs_f64() * 1e3;
    metrics::record_plan_built(elapsed);
    Ok(plan)
}

/// `mask`, `shape` and `tile` checked, and the plan's geometry with the batch rows and heads the
/// mask varies over (1 where it does not).
fn checked(mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<(Geom, usize, usize)> {
    PlanShape::new(shape.batch, shape.heads, shape.q_len, shape.kv_len)?;
    TileShape::new(tile.q, tile.kv)?;
    mask.validate(shape.batch, shape.heads, shape.q_len, shape.kv_len)?;
    let g = geom(shape, tile)?;
    let dep = mask.dependence();
    let bg = if dep.batch { shape.batch } else { 1 };
    let hg = if dep.heads { shape.heads } else { 1 };
    Ok((g, bg, hg))
}

/// The plan geometry of `shape` in `tile`: refused past 2^31 tiles per side.
fn geom(shape: PlanShape, tile: TileShape) -> Result<Geom> {
    let g = Geom {
        level: simd::Level::detect(),
        lq: shape.q_len,
        lkv: shape.kv_len,
        tq: tile.q,
        tk: tile.kv,
        nq: shape.q_len.div_ceil(tile.q),
        nk: shape.kv_len.div_ceil(tile.kv),
        wpr: tile.kv.div_ceil(64),
        masks: true,
    };
    if g.nq > u32::MAX as usize / 2 || g.nk > u32::MAX as usize / 2 {
        return Err(Error::invalid(
            "tile",
            "fewer than 2^31 tiles per side",
            g.nq.max(g.nk),
        ));
    }
    Ok(g)
}

/// Stage 1 alone, for measuring it: how many visited tiles of every distinct (batch row, head)
/// specialization it proves Empty, leaves Partial (for stage 2) and proves Full, and how many
/// tiles there are. Not a stable API.
#[doc(hidden)]
pub fn stage1_census(mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<[u64; 4]> {
    let (g, bg, hg) = checked(mask, shape, tile)?;
    let mut seen = std::collections::HashSet::new();
    let mut out = [0u64; 4];
    for b in 0..bg {
        for h in 0..hg {
            if !seen.insert(mask.specialized_canonical(b, h)) {
                continue;
            }
            let node = Node::prepare(mask, &g, b, h);
            out[3] += (g.nq * g.nk) as u64;
            for qt in 0..g.nq {
                for kt in node.candidates(&g, qt).iter() {
                    out[node.classify(&g, qt, kt) as usize] += 1;
                }
            }
        }
    }
    Ok(out)
}

/// `mask` reshaped as `blocks operands & rest` when it is an `&` of `blocks` leaves and other
/// operands: the same mask as `&(b1, .., bn, rest)`, and `rest` alone. With the plan's tile
/// equal to the blocks, a selected tile's state is the rest's, and heads that select the same
/// tile (every head its diagonal) refine it once.
fn split_selection(mask: &Mask) -> Option<(Mask, Mask)> {
    let Mask::And(v) = mask else {
        return None;
    };
    let (sel, rest): (Vec<&Mask>, Vec<&Mask>) =
        v.iter().partition(|m| matches!(m, Mask::Blocks(_)));
    let rest = match rest.as_slice() {
        [] => return None,
        [one] => (*one).clone(),
        _ => Mask::And(rest.into_iter().cloned().collect()),
    };
    if sel.is_empty() {
        return None;
    }
    let mut ops: Vec<Mask> = sel.into_iter().cloned().collect();
    ops.push(rest.clone());
    Some((Mask::And(ops), rest))
}

/// Refined partial tiles of the `rest` of a split mask, shared between head plans: keyed by
/// the rest's specialization (its specialized canonical form, as an id) and the tile.
#[derive(Default)]
struct RestTiles {
    ids: HashMap<String, u32>,
    tiles: HashMap<(u32, u32, u32), Option<(u32, u64)>>,
}

impl RestTiles {
    /// The id of `rest` specialized to batch row `b`, head `h`.
    fn id(&mut self, rest: &Mask, b: usize, h: usize) -> u32 {
        let n = self.ids.len() as u32;
        *self
            .ids
            .entry(rest.specialized_canonical(b, h))
            .or_insert(n)
    }
}

/// Refined tiles a head plan remembers by tile key, and the longest key kept (values): at
/// most 8 MiB of keys; the masks that repeat tiles need a few hundred keys of a few values.
const MEMO_TILES: usize = 1 << 14;
const MEMO_KEY_LEN: usize = 32;

/// What stage 2 of one build shares: sizes, scratch, the partial-mask table.
struct Refine<'a> {
    g: &'a Geom,
    bits: Vec<u64>,
    pool: Vec<Vec<u64>>,
    /// Stage-2 results by tile key ([`Node::tile_key`] after the node's address, then the
    /// tile's rows and columns); cleared for every head plan, whose nodes number their own
    /// band tile shapes.
    memo: FxHashMap<Box<[i128]>, Option<(u32, u64)>>,
    key: Vec<i128>,
    table: &'a mut PartialMasks,
    dedup: &'a mut PartialDedup,
    what: &'a dyn Fn() -> String,
    /// The most table words kept (None: all); past it the masks are dropped.
    keep: Option<usize>,
    /// Whether partial masks are still being built (false once dropped, or never built).
    masks: bool,
}

impl Refine<'_> {
    /// Stages 1 and 2 of tile (`qt`, `kt`) under `node`: `None` when empty, else its mask id
    /// ([`FULL_TILE`] when full) and allowed pairs.
    fn tile(&mut self, node: &Node, qt: usize, kt: usize) -> Result<Option<(u32, u64)>> {
        let state = node.classify(self.g, qt, kt);
        self.stage2(node, qt, kt, state, None)
    }

    /// [`Refine::tile`] given the tile's stage-1 state and, when known, its place `at` among
    /// the node's candidates of row `qt` (inlined: most tiles of a large plan are Empty or Full).
    #[inline]
    fn stage2(
        &mut self,
        node: &Node,
        qt: usize,
        kt: usize,
        state: TileState,
        at: Option<usize>,
    ) -> Result<Option<(u32, u64)>> {
        let g = self.g;
        let rows = (g.lq - qt * g.tq).min(g.tq) as u64;
        let cols = (g.lkv - kt * g.tk).min(g.tk) as u64;
        Ok(match state {
            TileState::Empty => None,
            TileState::Full => Some((FULL_TILE, rows * cols)),
            TileState::Partial => self.refine(node, (qt, kt, at), rows, cols)?,
        })
    }

    /// Stage 2 of a Partial tile of `rows` x `cols` pairs (`at` as in [`Refine::stage2`]).
    fn refine(
        &mut self,
        node: &Node,
        (qt, kt, at): (usize, usize, Option<usize>),
        rows: u64,
        cols: u64,
    ) -> Result<Option<(u32, u64)>> {
        let g = self.g;
        // Without masks, a count stage 1 kept decides the tile at once (no key, no memo).
        if let Some(n) = node.pairs(qt, kt, at).filter(|_| !self.masks) {
            return Ok(counted(n, rows * cols));
        }
        // A tile keyed like one refined before has its bitmask: stage 2 runs once per key (the
        // diagonal of a causal mask, the translates of a neighbourhood).
        self.key.clear();
        self.key.push(node as *const Node as usize as i128);
        let keyed = node.tile_key(g, qt, kt, &mut self.key) && self.key.len() <= MEMO_KEY_LEN;
        if keyed {
            self.key.extend([rows as i128, cols as i128]);
            if let Some(&t) = self.memo.get(self.key.as_slice()) {
                return Ok(t);
            }
        }
        // Stage 2: exact refinement at token level (without masks, the count decides).
        node.eval(g, qt, kt, &mut self.bits, &mut self.pool);
        let (n, hash) = if self.masks {
            digest(g.level, &self.bits)
        } else {
            (self.bits.iter().map(|w| w.count_ones() as u64).sum(), 0)
        };
        let t = if n == 0 || n == rows * cols || !self.masks {
            counted(n, rows * cols)
        } else {
            let id = self.dedup.intern(self.table, &self.bits, hash, self.what)?;
            if self.keep.is_some_and(|words| self.table.data.len() > words) {
                // Too many to keep: tile states from here on (the ids given so far are
                // cleared: see `plan_head` and `build`).
                self.masks = false;
            }
            Some((id, n))
        };
        if keyed && self.memo.len() < MEMO_TILES {
            self.memo.insert(self.key.as_slice().into(), t);
        }
        Ok(t)
    }

    /// [`Refine::tile`] of a split mask's node (`&(blocks.., rest)`): where the blocks
    /// operands are Full the tile is the rest's, refined once per rest id and tile.
    fn split_tile(
        &mut self,
        node: &Node,
        (shared, id): (&mut RestTiles, u32),
        qt: usize,
        kt: usize,
    ) -> Result<Option<(u32, u64)>> {
        let Node::And(v) = node else {
            return self.tile(node, qt, kt);
        };
        let Some((rest, sel)) = v.split_last() else {
            return self.tile(node, qt, kt);
        };
        let sel_full = sel
            .iter()
            .all(|n| n.classify(self.g, qt, kt) == TileState::Full);
        if !sel_full || rest.classify(self.g, qt, kt) != TileState::Partial {
            return self.tile(node, qt, kt);
        }
        let key = (id, qt as u32, kt as u32);
        if let Some(&t) = shared.tiles.get(&key) {
            return Ok(t);
        }
        let t = self.tile(rest, qt, kt)?;
        shared.tiles.insert(key, t);
        Ok(t)
    }
}

/// A tile of `n` allowed pairs out of `area` in a plan without masks: None when empty, else
/// its mask id ([`FULL_TILE`], or 0 for every partial tile) and `n`.
fn counted(n: u64, area: u64) -> Option<(u32, u64)> {
    match n {
        0 => None,
        n if n == area => Some((FULL_TILE, n)),
        n => Some((0, n)),
    }
}

/// Mask id `id` in a plan without masks: [`FULL_TILE`] stays, every partial tile's is 0.
fn unmasked(id: u32) -> u32 {
    if id == FULL_TILE {
        FULL_TILE
    } else {
        0
    }
}

/// Sets the mask id of every partial entry to 0 (the masks were dropped).
fn clear_ids(entries: &mut [TileEntry]) {
    for e in entries {
        e.mask = unmasked(e.mask);
    }
}

/// Stages 1-3 for one specialized mask, visiting the kv tiles `visit[qt]` of each q-tile row;
/// `share` when `node` is a split mask's (see [`split_selection`]).
fn plan_head(
    node: &Node,
    visit: &[Candidates],
    cx: &mut Refine,
    mut share: Option<(&mut RestTiles, u32)>,
) -> Result<HeadPlan> {
    let g = cx.g;
    cx.memo.clear();
    let mut fwd_offsets = Vec::with_capacity(g.nq + 1);
    // The visited tiles bound the list (and were checked against the memory budget).
    let mut fwd = Vec::with_capacity(visit.iter().map(Candidates::len).sum());
    let mut allowed = 0u64;
    let mut states = Vec::new();
    // How many entries were listed while the build still kept masks: once it drops them
    // (`Refine::keep`), only these may hold a mask id.
    let mut with_ids = if cx.masks { None } else { Some(0) };
    fwd_offsets.push(0u32);
    for (qt, cands) in visit.iter().enumerate() {
        if share.is_none() {
            // A row's stage 1 at once (some leaves classify a row faster than its tiles).
            node.classify_row(g, qt, cands, &mut states);
        }
        for (at, kt) in cands.iter().enumerate() {
            let t = match share.as_mut() {
                Some((shared, id)) => cx.split_tile(node, (shared, *id), qt, kt)?,
                None => cx.stage2(node, qt, kt, states[at], Some(at))?,
            };
            let Some((mut mask, n)) = t else { continue };
            if !cx.masks {
                // A memo or a shared tile may hand back an id given before the drop.
                mask = unmasked(mask);
            }
            allowed += n;
            fwd.push(TileEntry {
                tile: kt as u32,
                mask,
            });
        }
        if with_ids.is_none() && !cx.masks {
            with_ids = Some(fwd.len());
        }
        fwd_offsets.push(fwd.len() as u32);
    }
    // Counted here, not per tile (two counters in that loop were kept in memory, a stall per
    // tile).
    let full_tiles = fwd.iter().filter(|e| e.is_full()).count() as u64;
    let partial_tiles = fwd.len() as u64 - full_tiles;
    if let Some(n) = with_ids {
        // The masks were dropped during this head plan: the ids given before are void.
        clear_ids(&mut fwd[..n]);
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
    Ok(HeadPlan {
        fwd_offsets,
        fwd,
        bwd_offsets,
        bwd,
        full_tiles,
        partial_tiles,
        allowed_pairs: allowed,
    })
}
