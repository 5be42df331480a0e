//! Context-parallel dispatch: which rank owns which query tiles of a planned row (docs/semantics.md#many-ranks).
//!
//! Contract: [`shard`] maps a self-attention [`Plan`] and a world size `R` to a [`Sharding`], a
//! deterministic function of (plan, `R`, [`Scheme`], [`CostModel`]) so that every rank computes the
//! same one without communicating. Each rank owns `nq / R` whole query tiles (equal token counts,
//! q-tile granularity), listed in ascending global order; the same token positions carry that
//! rank's Q, K, V, labels and position ids. Requirements (a clear error otherwise): `Lq == Lkv`,
//! square tiles, `Lq` a multiple of the tile, and the tile count a multiple of `R` (of `2R` for
//! [`Scheme::Zigzag`]): pad the row with `-1` segment ids (padding never attends) to reach one.
//!
//! Local problems. K/V tiles travel whole, so rank `r`'s attention is exactly the global plan's
//! forward rows of its own q tiles, against a local K/V laid out in *sharded order* (rank 0's tiles,
//! then rank 1's, ..., each rank's ascending): all of them ([`KvLayout::AllGather`], what an
//! all-gather of the ranks' shards yields) or only the tiles its rows touch
//! ([`KvLayout::Needed`], what an all-to-all of [`Sharding::needed`] yields). [`Sharding::local_plan`]
//! builds that plan from the global work lists (kv tile ids renumbered, partial bitmasks shared,
//! since a tile's content does not change when it moves), so it is exact for every mask (dense,
//! per-head, windows, not only documents) and the ranks' tiles add up to the global plan's: sharding
//! adds no tile work, only K/V traffic. The backward pass of a rank walks the same tiles (its dK/dV
//! partial sums go back to the tiles' owners).
//!
//! Costs. A full tile costs 1, a partial tile `partial_overhead + (1 - partial_overhead) ·
//! allowed fraction` (kernels skip dead 16×16 sub-blocks but still load and mask the tile), the
//! backward pass `backward` times the forward; each distinct (batch row, head) plan counts as many
//! times as it is used. Traffic: a rank's K/V tiles received in [`KvLayout::Needed`] mode, also as
//! a fraction of an all-gather ([`RankCost::kv_remote_fraction`], [`Sharding::kv_fraction`]).
//!
//! [`Scheme::Balanced`] minimises the busiest receiver's K/V subject to a balance cap
//! ([`CostModel::balance_cap`], default: the busiest rank at most 1.02× the mean cost), under the
//! equal-tile constraint. It works on *clusters* (runs of q tiles that interact with the rest only
//! through their boundary tiles: the documents, at tile granularity): short ones stay whole on one
//! rank (no traffic but a halo tile), long ones are cut into contiguous pieces. Candidates: deals
//! that fill rank after rank to exactly its tiles and the mean cost of what is left, pairing dense
//! pieces (long documents' tails) with sparse runs and continuing a document's pieces on the rank
//! that already receives its K/V (`deal`), then single-tile swaps that lower the largest load
//! without raising the busiest receiver (`repair`); and the balance-first longest-processing-time
//! greedies (`lpt`). The least traffic among candidates within the cap wins; if none is within
//! it, the best balance. Traffic is estimated from the rows' reach intervals (exact for
//! doc-causal rows and windows), so the choice is a pure function of the plan, `R` and the model.

use crate::plan::{HeadPlan, PartialMasks, Plan, PlanStats, TileEntry, FULL_TILE};
use crate::shape::PlanShape;
use crate::ContractKey;
use tessera_core::{Error, Result};

/// How query tiles are dealt to ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Rank `r` owns tiles `[r·n/R, (r+1)·n/R)`.
    Contiguous,
    /// `2R` equal chunks; rank `r` owns chunks `r` and `2R−1−r` (Llama 3, ring-flash-attention).
    Zigzag,
    /// Head-tail inside each cluster (document): each cluster is cut in `2R` chunks of whole tiles,
    /// rank `r` owns chunks `r` and `2R−1−r`; leftover middle tiles are dealt round-robin.
    PerDocZigzag,
    /// Minimises the busiest rank's received K/V within a balance cap on the plan's exact tile
    /// costs ([`CostModel::balance_cap`]): short clusters (documents) whole on one rank, long ones
    /// in contiguous pieces, split only where balance needs it.
    Balanced,
}

impl Scheme {
    /// Every scheme, in report order.
    pub const ALL: [Scheme; 4] = [
        Scheme::Contiguous,
        Scheme::Zigzag,
        Scheme::PerDocZigzag,
        Scheme::Balanced,
    ];

    /// The name used by the CLI and Python (`contiguous`, `zigzag`, `perdoc_zigzag`, `balanced`).
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Contiguous => "contiguous",
            Scheme::Zigzag => "zigzag",
            Scheme::PerDocZigzag => "perdoc_zigzag",
            Scheme::Balanced => "balanced",
        }
    }

    /// Parses a scheme name.
    pub fn parse(s: &str) -> Result<Self> {
        Scheme::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "scheme",
                    "one of contiguous, zigzag, perdoc_zigzag, balanced",
                    format!("'{s}'"),
                )
            })
    }
}

impl std::fmt::Display for Scheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Relative tile costs the balanced solver and the reports use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed part of a partial tile's cost (loads, masking), in `[0, 1]`.
    pub partial_overhead: f64,
    /// Backward cost of a tile relative to its forward cost.
    pub backward: f64,
    /// [`Scheme::Balanced`]'s balance cap: the busiest rank's cost at most this times the mean
    /// (when some candidate reaches it; else the best balance found). Within it the solver
    /// minimises the largest rank's received K/V.
    pub balance_cap: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // Backward does ~2.5x the forward's products (docs/semantics.md#attention FLOP counts: 6·Dqk + 4·Dv vs 2·(Dqk + Dv)).
        CostModel {
            partial_overhead: 0.3,
            backward: 2.5,
            balance_cap: 1.02,
        }
    }
}

impl CostModel {
    fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.partial_overhead) {
            return Err(Error::invalid(
                "partial_overhead",
                "a number in [0, 1]",
                self.partial_overhead,
            ));
        }
        if !(self.backward.is_finite() && self.backward >= 0.0) {
            return Err(Error::invalid(
                "backward",
                "a finite number >= 0",
                self.backward,
            ));
        }
        if !(self.balance_cap.is_finite() && self.balance_cap >= 1.0) {
            return Err(Error::invalid(
                "balance_cap",
                "a finite number >= 1",
                self.balance_cap,
            ));
        }
        Ok(())
    }
}

/// Which K/V tiles a rank's local problem holds (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// Every K/V tile, in sharded order (an all-gather of all ranks' shards).
    AllGather,
    /// Only the K/V tiles the rank's rows touch, in sharded order.
    Needed,
}

impl KvLayout {
    /// `allgather` or `needed`.
    pub fn name(self) -> &'static str {
        match self {
            KvLayout::AllGather => "allgather",
            KvLayout::Needed => "needed",
        }
    }

    /// Parses `allgather` or `needed`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "allgather" => Ok(KvLayout::AllGather),
            "needed" => Ok(KvLayout::Needed),
            _ => Err(Error::invalid(
                "mode",
                "'allgather' or 'needed'",
                format!("'{s}'"),
            )),
        }
    }
}

/// One rank's work and traffic.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankCost {
    /// Allowed (query, key) pairs of the rank's rows, over all batch rows and heads.
    pub pairs: u64,
    /// Full tiles of the rank's rows (forward; the backward walks the same tiles).
    pub full_tiles: u64,
    /// Partial tiles of the rank's rows (forward; the backward walks the same tiles).
    pub partial_tiles: u64,
    /// Modelled forward cost ([`CostModel`] units: one full tile = 1).
    pub forward_cost: f64,
    /// Modelled backward cost.
    pub backward_cost: f64,
    /// K/V tiles the rank's rows touch (its own included).
    pub kv_tiles_needed: u64,
    /// K/V tiles it must receive from other ranks in [`KvLayout::Needed`] mode.
    pub kv_tiles_remote: u64,
    /// `kv_tiles_remote` as a fraction of an all-gather (the `tiles − tiles/R` tiles every rank
    /// receives in [`KvLayout::AllGather`] mode; 0 when `R = 1`).
    pub kv_remote_fraction: f64,
}

impl RankCost {
    /// Forward plus backward modelled cost.
    pub fn cost(&self) -> f64 {
        self.forward_cost + self.backward_cost
    }
}

/// The result of [`shard`]: who owns what, what it costs, who needs what from whom.
#[derive(Debug, Clone, PartialEq)]
pub struct Sharding {
    /// The scheme that produced it.
    pub scheme: Scheme,
    /// The cost model it was solved and reported with.
    pub cost_model: CostModel,
    /// `R`.
    pub world_size: usize,
    /// Tile side in tokens (q and kv tiles are square).
    pub tile: usize,
    /// Tiles of the row (`Lq / tile`).
    pub tiles: usize,
    /// The global plan's contract key.
    pub contract: ContractKey,
    /// Per rank, its q tiles (global tile ids), ascending; `tiles / R` each.
    pub owned: Vec<Vec<u32>>,
    /// Per rank, its cost and traffic.
    pub costs: Vec<RankCost>,
    /// `needed[r][s]`: the K/V tiles (global ids, ascending) rank `r`'s rows touch that rank `s`
    /// owns.
    pub needed: Vec<Vec<Vec<u32>>>,
    /// Clusters (runs of q tiles that interact with the rest only through their boundary tiles:
    /// the documents, at tile granularity) as `[start, end)` tile ranges, ascending.
    pub clusters: Vec<(u32, u32)>,
    /// Digest of the plan's contract, scheme, `R`, cost model and assignment: ranks compare it to
    /// detect a rank that sharded a different plan.
    pub fingerprint: [u8; 32],
}

/// Per-q-tile costs of a plan, summed over its distinct head plans by use count.
struct TileCosts {
    cost: Vec<f64>,
    pairs: Vec<u64>,
    full: Vec<u64>,
    partial: Vec<u64>,
    /// Lowest and highest tile (q or kv, the same axis) row `t` reaches, `t` included.
    lo: Vec<u32>,
    hi: Vec<u32>,
    /// `cum[t]`: cost of tiles `0..t`.
    cum: Vec<f64>,
}

/// How many (b, h) of the problem each head plan serves.
fn head_plan_uses(plan: &Plan) -> Vec<u64> {
    let b_mult = (plan.shape.batch / plan.batch_groups.max(1)) as u64;
    let h_mult = (plan.shape.heads / plan.head_groups.max(1)) as u64;
    let mut uses = vec![0u64; plan.head_plans.len()];
    for &g in &plan.group_plan {
        if let Some(u) = uses.get_mut(g as usize) {
            *u += b_mult * h_mult;
        }
    }
    uses
}

fn tile_costs(plan: &Plan, model: &CostModel) -> TileCosts {
    let n = plan.q_tiles;
    let tile_pairs = (plan.tile.q * plan.tile.kv) as u64;
    let n_masks = plan.partials.len();
    let mut mask_pairs = vec![u64::MAX; n_masks];
    let mut tc = TileCosts {
        cost: vec![0.0; n],
        pairs: vec![0; n],
        full: vec![0; n],
        partial: vec![0; n],
        lo: (0..n as u32).collect(),
        hi: (0..n as u32).collect(),
        cum: Vec::new(),
    };
    let uses = head_plan_uses(plan);
    let po = model.partial_overhead;
    for (hp, &u) in plan.head_plans.iter().zip(&uses) {
        if u == 0 {
            continue;
        }
        for t in 0..n {
            let row = hp.row(t);
            let (mut c, mut pairs, mut full) = (0.0f64, 0u64, 0u64);
            for e in row {
                if e.is_full() {
                    full += 1;
                    pairs += tile_pairs;
                    c += 1.0;
                } else {
                    let id = e.mask as usize;
                    if mask_pairs[id] == u64::MAX {
                        mask_pairs[id] = plan
                            .partials
                            .get(e.mask)
                            .iter()
                            .map(|w| w.count_ones() as u64)
                            .sum();
                    }
                    let p = mask_pairs[id];
                    pairs += p;
                    c += po + (1.0 - po) * p as f64 / tile_pairs as f64;
                }
            }
            tc.cost[t] += c * u as f64;
            tc.pairs[t] += pairs * u;
            tc.full[t] += full * u;
            tc.partial[t] += (row.len() as u64 - full) * u;
            if let (Some(f), Some(l)) = (row.first(), row.last()) {
                tc.lo[t] = tc.lo[t].min(f.tile);
                tc.hi[t] = tc.hi[t].max(l.tile);
            }
        }
    }
    tc.cum = std::iter::once(0.0)
        .chain(tc.cost.iter().scan(0.0, |acc, &c| {
            *acc += c;
            Some(*acc)
        }))
        .collect();
    tc
}

/// Runs of tiles that interact only through the tile at their boundary: a cut goes before tile
/// `t` when no row from `t` on reaches before `t − 1` and no row before `t` reaches past `t`. For
/// packed documents these are the documents (a tile straddling two documents is the one halo
/// tile between them); `[start, end)` ranges covering `0..n`.
fn clusters(tc: &TileCosts) -> Vec<(u32, u32)> {
    let n = tc.lo.len();
    let mut suffix_lo = vec![u32::MAX; n + 1];
    for t in (0..n).rev() {
        suffix_lo[t] = suffix_lo[t + 1].min(tc.lo[t]);
    }
    let mut out = Vec::new();
    let (mut start, mut prefix_hi) = (0usize, 0u32);
    for (t, &lo_from_t) in suffix_lo.iter().enumerate().take(n).skip(1) {
        prefix_hi = prefix_hi.max(tc.hi[t - 1]);
        if lo_from_t as usize + 1 >= t && prefix_hi as usize <= t {
            out.push((start as u32, t as u32));
            start = t;
        }
    }
    if n > 0 {
        out.push((start as u32, n as u32));
    }
    out
}

/// Shards `plan` over `world_size` ranks with `scheme` (see the module doc for the requirements).
pub fn shard(plan: &Plan, world_size: usize, scheme: Scheme, model: CostModel) -> Result<Sharding> {
    model.validate()?;
    plan.require_masks("sharding")?;
    let s = plan.shape;
    if world_size == 0 {
        return Err(Error::invalid("world_size", "a positive rank count", 0));
    }
    if s.q_len != s.kv_len {
        return Err(Error::invalid(
            "plan",
            "self-attention (q_len == kv_len) for context parallelism",
            format!("q_len {} and kv_len {}", s.q_len, s.kv_len),
        ));
    }
    if plan.tile.q != plan.tile.kv {
        return Err(Error::invalid(
            "plan",
            "square tiles for context parallelism",
            format!("tile {}", plan.tile),
        ));
    }
    let tile = plan.tile.q;
    let chunks = if scheme == Scheme::Zigzag {
        2 * world_size
    } else {
        world_size
    };
    if !s.q_len.is_multiple_of(tile) || !(s.q_len / tile).is_multiple_of(chunks) {
        let unit = tile * chunks;
        return Err(Error::invalid(
            "world_size",
            format!(
                "a row of whole tiles dealt evenly: q_len a multiple of {unit} ({} scheme: \
                 {chunks} chunks of {tile}-token tiles); pad the row to {} tokens with -1 segment \
                 ids",
                scheme,
                s.q_len.div_ceil(unit) * unit
            ),
            format!("q_len {} for world_size {world_size}", s.q_len),
        ));
    }
    let n = plan.q_tiles;
    let cap = n / world_size;
    let tc = tile_costs(plan, &model);
    let clus = clusters(&tc);
    let mut owned: Vec<Vec<u32>> = match scheme {
        Scheme::Balanced => balanced(&tc, &clus, world_size, cap, model.balance_cap),
        _ => fixed(scheme, n, world_size, &clus),
    };
    for o in &mut owned {
        o.sort_unstable();
    }
    finish(plan, scheme, model, world_size, owned, &tc, clus)
}

/// The fixed schemes' assignments (zigzag needs `n` a multiple of `2R`).
fn fixed(scheme: Scheme, n: usize, world_size: usize, clus: &[(u32, u32)]) -> Vec<Vec<u32>> {
    let cap = n / world_size;
    match scheme {
        Scheme::Zigzag => {
            let h = n / (2 * world_size);
            (0..world_size)
                .map(|r| {
                    let tail = 2 * world_size - 1 - r;
                    (r * h..(r + 1) * h)
                        .chain(tail * h..(tail + 1) * h)
                        .map(|t| t as u32)
                        .collect()
                })
                .collect()
        }
        Scheme::PerDocZigzag => perdoc_zigzag(clus, world_size),
        _ => (0..world_size)
            .map(|r| ((r * cap) as u32..((r + 1) * cap) as u32).collect())
            .collect(),
    }
}

fn perdoc_zigzag(clus: &[(u32, u32)], r: usize) -> Vec<Vec<u32>> {
    let mut owned = vec![Vec::new(); r];
    let mut next = 0usize; // round-robin pointer for leftover tiles, across clusters
    for &(a, b) in clus {
        let m = (b - a) as usize;
        let q = m / (2 * r);
        for (rank, o) in owned.iter_mut().enumerate() {
            let head = a as usize + rank * q;
            let tail = b as usize - (rank + 1) * q;
            o.extend((head..head + q).map(|t| t as u32));
            o.extend((tail..tail + q).map(|t| t as u32));
        }
        // Leftover middle tiles in head-tail order, one per rank in turn.
        let (mut lo, mut hi) = (a as usize + r * q, b as usize - r * q);
        let mut front = true;
        while lo < hi {
            let t = if front {
                lo += 1;
                lo - 1
            } else {
                hi -= 1;
                hi
            };
            front = !front;
            owned[next % r].push(t as u32);
            next += 1;
        }
    }
    owned
}

/// One placement unit: a whole cluster or a single tile.
#[derive(Clone, Copy)]
struct Unit {
    start: u32,
    len: u32,
    cost: f64,
}

/// LPT under the equal-tile constraint, keeping clusters of at most `keep` tiles whole; then
/// single-tile swaps off the most loaded rank. Returns the owned tiles and the largest load.
fn lpt(
    tc: &TileCosts,
    clus: &[(u32, u32)],
    r: usize,
    cap: usize,
    keep: usize,
    piece: usize,
) -> (Vec<Vec<u32>>, f64) {
    let mut units: Vec<Unit> = Vec::with_capacity(tc.cost.len());
    let unit = |a: u32, b: u32| Unit {
        start: a,
        len: b - a,
        cost: (a..b).map(|t| tc.cost[t as usize]).sum(),
    };
    for &(a, b) in clus {
        if ((b - a) as usize) <= keep {
            units.push(unit(a, b));
        } else {
            // Contiguous pieces: a rank holding a piece of a long document needs only the
            // document's K/V up to that piece.
            let step = piece.max(1) as u32;
            let mut s = a;
            while s < b {
                let e = (s + step).min(b);
                units.push(unit(s, e));
                s = e;
            }
        }
    }
    units.sort_by(|x, y| {
        y.cost
            .total_cmp(&x.cost)
            .then(y.len.cmp(&x.len))
            .then(x.start.cmp(&y.start))
    });
    let mut load = vec![0.0f64; r];
    let mut free = vec![cap; r];
    let mut owned: Vec<Vec<u32>> = vec![Vec::with_capacity(cap); r];
    // Per rank, its single tiles (candidates for swaps).
    let mut singles: Vec<Vec<u32>> = vec![Vec::new(); r];
    for u in units {
        if !place(u, &mut load, &mut free, &mut owned, &mut singles) {
            // No rank has room for the whole cluster any more: place its tiles one by one
            // (always possible: free tiles add up to the tiles left).
            for t in u.start..u.start + u.len {
                let one = Unit {
                    start: t,
                    len: 1,
                    cost: tc.cost[t as usize],
                };
                place(one, &mut load, &mut free, &mut owned, &mut singles);
            }
        }
    }
    swap_singles(tc, &mut load, &mut owned, &mut singles);
    let max = load.iter().copied().fold(0.0, f64::max);
    (owned, max)
}

/// Puts unit `u` on the least loaded rank with room for it; false when none has room.
fn place(
    u: Unit,
    load: &mut [f64],
    free: &mut [usize],
    owned: &mut [Vec<u32>],
    singles: &mut [Vec<u32>],
) -> bool {
    let best = (0..load.len())
        .filter(|&k| free[k] >= u.len as usize)
        .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
    match best {
        Some(k) => {
            load[k] += u.cost;
            free[k] -= u.len as usize;
            owned[k].extend(u.start..u.start + u.len);
            if u.len == 1 {
                singles[k].push(u.start);
            }
            true
        }
        None => false,
    }
}

/// Lowers the largest load by swapping one single tile of the most loaded rank with a cheaper
/// single tile of another rank, while that strictly helps (bounded number of rounds).
fn swap_singles(
    tc: &TileCosts,
    load: &mut [f64],
    owned: &mut [Vec<u32>],
    singles: &mut [Vec<u32>],
) {
    let r = load.len();
    let cost = |t: u32| tc.cost[t as usize];
    for s in singles.iter_mut() {
        s.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)));
    }
    for _round in 0..(4 * r + 16) {
        let a = (0..r)
            .max_by(|&x, &y| load[x].total_cmp(&load[y]).then(y.cmp(&x)))
            .unwrap_or(0);
        // The best swap: the pair whose cost difference is closest to half the load gap.
        let mut best: Option<(usize, usize, usize, f64)> = None; // (rank b, idx in a, idx in b, new max)
                                                                 // Partners: the few least loaded ranks (where a swap helps most; bounds the work).
        let mut partners: Vec<usize> = (0..r).collect();
        partners.sort_by(|&x, &y| load[x].total_cmp(&load[y]).then(x.cmp(&y)));
        partners.truncate(SWAP_PARTNERS);
        for b in partners {
            let gap = load[a] - load[b];
            if b == a || gap <= 0.0 || singles[b].is_empty() {
                continue;
            }
            swap_pairs(
                &cost,
                load[a],
                load[b],
                &singles[a],
                &singles[b],
                |ia, ib, new_max| {
                    if best.is_none_or(|x| new_max < x.3) {
                        best = Some((b, ia, ib, new_max));
                    }
                },
            );
        }
        let Some((b, ia, ib, new_max)) = best else {
            break;
        };
        if new_max >= load[a] * (1.0 - 1e-12) {
            break;
        }
        let (ta, tb) = (singles[a][ia], singles[b][ib]);
        let d = cost(ta) - cost(tb);
        load[a] -= d;
        load[b] += d;
        for (k, from, to) in [(a, ta, tb), (b, tb, ta)] {
            if let Some(p) = owned[k].iter().position(|&t| t == from) {
                owned[k][p] = to;
            }
            let s = &mut singles[k];
            if let Some(p) = s.iter().position(|&t| t == from) {
                s.remove(p);
            }
            let p = s.partition_point(|&t| cost(t).total_cmp(&cost(to)).then(t.cmp(&to)).is_lt());
            s.insert(p, to);
        }
    }
}

/// Swaps that lower the larger of loads `la > lb`: for each tile of `sa` (ascending cost), the
/// two tiles of `sb` (ascending cost) nearest to closing half the gap; `f(index in sa, index in
/// sb, the new larger load)`.
fn swap_pairs(
    cost: &impl Fn(u32) -> f64,
    la: f64,
    lb: f64,
    sa: &[u32],
    sb: &[u32],
    mut f: impl FnMut(usize, usize, f64),
) {
    let gap = la - lb;
    for (ia, &ta) in sa.iter().enumerate() {
        let want = cost(ta) - gap / 2.0;
        let pos = sb.partition_point(|&t| cost(t) < want);
        for ib in [pos.wrapping_sub(1), pos] {
            let Some(&tb) = sb.get(ib) else { continue };
            let d = cost(ta) - cost(tb);
            if d > 0.0 && d < gap {
                f(ia, ib, (la - d).max(lb + d));
            }
        }
    }
}

/// Ranks a swap round tries as partners of the most loaded one.
const SWAP_PARTNERS: usize = 4;

/// Swaps a repair round checks for traffic, best first.
const REPAIR_TRIES: usize = 128;

/// Ranks a repair round tries as partners of the most loaded one (the least loaded).
const REPAIR_PARTNERS: usize = 8;

/// Per rank, the K/V tiles it would receive, estimated from the rows' reach intervals (exact for
/// masks whose rows reach one interval, such as causal documents and windows).
fn remote_estimate(tc: &TileCosts, owned: &[Vec<u32>]) -> Vec<u64> {
    let mut iv: Vec<(u32, u32)> = Vec::new();
    owned
        .iter()
        .map(|o| {
            iv.clear();
            iv.extend(o.iter().map(|&t| (tc.lo[t as usize], tc.hi[t as usize])));
            iv.sort_unstable();
            let (mut covered, mut cur) = (0u64, None::<(u32, u32)>);
            for &(a, b) in &iv {
                cur = match cur {
                    Some((x, y)) if a <= y + 1 => Some((x, y.max(b))),
                    Some((x, y)) => {
                        covered += (y - x + 1) as u64;
                        Some((a, b))
                    }
                    None => Some((a, b)),
                };
            }
            if let Some((x, y)) = cur {
                covered += (y - x + 1) as u64;
            }
            covered.saturating_sub(o.len() as u64)
        })
        .collect()
}

/// A run of q tiles placed as one: a whole cluster or a contiguous piece of one, with the hull of
/// the tiles its rows reach.
#[derive(Clone, Copy, Debug)]
struct Run {
    start: u32,
    len: u32,
    cost: f64,
    lo: u32,
    hi: u32,
    whole: bool,
}

fn run_of(tc: &TileCosts, a: u32, b: u32, whole: bool) -> Run {
    let r = a as usize..b as usize;
    Run {
        start: a,
        len: b - a,
        cost: tc.cost[r.clone()].iter().sum(),
        lo: tc.lo[r.clone()].iter().copied().min().unwrap_or(a),
        hi: tc.hi[r].iter().copied().max().unwrap_or(a),
        whole,
    }
}

/// Set bits of `bits` in the inclusive tile range `[lo, hi]`.
fn ones_in(bits: &[u64], lo: usize, hi: usize) -> usize {
    let (wa, wb) = (lo / 64, hi / 64);
    (wa..=wb)
        .map(|w| {
            let mut x = bits[w];
            if w == wa {
                x &= !0u64 << (lo % 64);
            }
            if w == wb && hi % 64 != 63 {
                x &= (1u64 << (hi % 64 + 1)) - 1;
            }
            x.count_ones() as usize
        })
        .sum()
}

fn set_range(bits: &mut [u64], lo: usize, hi: usize) {
    for t in lo..=hi {
        bits[t / 64] |= 1 << (t % 64);
    }
}

/// The state of a traffic-aware placement: per rank its load, free tiles, the tiles its rows
/// reach (a bitset over the row) and how many of those it does not own.
struct Placer {
    words: usize,
    need: Vec<u64>,
    load: Vec<f64>,
    free: Vec<usize>,
    remote: Vec<i64>,
    owned: Vec<Vec<u32>>,
    wholes: Vec<Vec<Run>>,
}

impl Placer {
    fn new(tc: &TileCosts, r: usize, cap: usize) -> Self {
        let words = tc.cost.len().div_ceil(64).max(1);
        Placer {
            words,
            need: vec![0; r * words],
            load: vec![0.0; r],
            free: vec![cap; r],
            remote: vec![0; r],
            owned: vec![Vec::with_capacity(cap); r],
            wholes: vec![Vec::new(); r],
        }
    }

    fn bits(&self, k: usize) -> &[u64] {
        &self.need[k * self.words..(k + 1) * self.words]
    }

    /// Change of rank `k`'s received tiles if it took `u` (its tiles are owned by no one yet).
    fn delta(&self, k: usize, u: &Run) -> i64 {
        let span = (u.hi - u.lo + 1) as usize;
        let new = span - ones_in(self.bits(k), u.lo as usize, u.hi as usize);
        new as i64 - u.len as i64
    }

    fn put(&mut self, k: usize, u: Run) {
        self.remote[k] += self.delta(k, &u);
        let w = self.words;
        set_range(
            &mut self.need[k * w..(k + 1) * w],
            u.lo as usize,
            u.hi as usize,
        );
        self.load[k] += u.cost;
        self.free[k] -= u.len as usize;
        self.owned[k].extend(u.start..u.start + u.len);
        if u.whole {
            self.wholes[k].push(u);
        }
    }
}

/// The clusters as placement runs: clusters of at most half a rank's tiles costing at most
/// `keep_cost` whole; longer ones as their contiguous pieces of `piece` tiles, in order.
fn make_runs(
    tc: &TileCosts,
    clus: &[(u32, u32)],
    cap: usize,
    piece: usize,
    keep_cost: f64,
) -> (Vec<Run>, Vec<Vec<Run>>) {
    let (mut wholes, mut split) = (Vec::new(), Vec::new());
    for &(a, b) in clus {
        let whole = run_of(tc, a, b, true);
        if whole.len as usize <= cap / 2 && whole.cost <= keep_cost {
            wholes.push(whole);
        } else {
            let step = piece.max(1) as u32;
            let mut pieces = Vec::new();
            let mut s = a;
            while s < b {
                let e = (s + step).min(b);
                pieces.push(run_of(tc, s, e, false));
                s = e;
            }
            split.push(pieces);
        }
    }
    (wholes, split)
}

/// Rank-by-rank dealing. Rank `k` is filled to exactly its tiles and, as nearly as the runs
/// allow, the mean cost of what is left (`pool cost / ranks left`, so earlier errors spread
/// over later ranks): each step takes the run that leaves the rest of the rank best fillable
/// by the pool's average (the cost error if the rank's remaining tiles were filled at the
/// density of what is left, relative to the mean) plus `traffic` times the K/V tiles it adds
/// to the rank, relative to the row. A split cluster offers only its first and last remaining
/// pieces, so its pieces are dealt from both ends inwards in contiguous runs: dense tail pieces
/// pair with sparse runs (short documents, head pieces), and a rank holding a piece prefers the
/// neighbouring ones, whose K/V it already receives. When no run fits the tiles left, the head
/// of the best run is split off (its tail returns to the pool). Then swaps of equal-length
/// whole clusters lower the largest load.
fn deal(
    tc: &TileCosts,
    wholes: &[Run],
    split: &[Vec<Run>],
    r: usize,
    cap: usize,
    traffic: f64,
    cursor: bool,
) -> Vec<Vec<u32>> {
    let n = tc.cost.len().max(1) as f64;
    let mut pool: Vec<Option<Run>> = wholes.iter().copied().map(Some).collect();
    // Per split cluster, the remaining pieces [first, last).
    let mut ends: Vec<(usize, usize)> = split.iter().map(|v| (0, v.len())).collect();
    let mut pool_cost: f64 = wholes
        .iter()
        .chain(split.iter().flatten())
        .map(|u| u.cost)
        .sum();
    let mut pool_tiles: usize = wholes
        .iter()
        .chain(split.iter().flatten())
        .map(|u| u.len as usize)
        .sum();
    let mut p = Placer::new(tc, r, cap);
    // A candidate: a whole-pool index, or (cluster, front?) of a split cluster.
    #[derive(Clone, Copy)]
    enum Src {
        Pool(usize),
        Front(usize),
        Back(usize),
    }
    // Cursor mode: the split clusters' pieces in one sequence, each cluster tail first.
    let seq: Vec<(usize, usize)> = if cursor {
        (0..split.len())
            .flat_map(|c| (0..split[c].len()).rev().map(move |i| (c, i)))
            .collect()
    } else {
        Vec::new()
    };
    let mut at = 0usize;
    // Cost and tiles of the sequence's pieces not yet dealt (cursor mode).
    let mut seq_cost: f64 = seq.iter().map(|&(c, i)| split[c][i].cost).sum();
    let mut seq_tiles: usize = seq.iter().map(|&(c, i)| split[c][i].len as usize).sum();
    for k in 0..r {
        let target = pool_cost / (r - k) as f64;
        let scale = target.max(f64::MIN_POSITIVE);
        // Cursor mode: first the next pieces of the sequence, while the rest of the rank can
        // still be filled at the density of the whole clusters left (the last rank takes all).
        while let Some(&(c, i)) = seq.get(at) {
            let u = split[c][i];
            let (tiles_left, cost_left) = (p.free[k], target - p.load[k]);
            if u.len as usize > tiles_left {
                break;
            }
            let (fc, ft) = (pool_cost - seq_cost, pool_tiles - seq_tiles);
            let rest = (tiles_left - u.len as usize) as f64;
            if k + 1 < r && cost_left - u.cost < fc / ft.max(1) as f64 * rest {
                break;
            }
            ends[c].1 = i;
            at += 1;
            seq_cost -= u.cost;
            seq_tiles -= u.len as usize;
            pool_cost -= u.cost;
            pool_tiles -= u.len as usize;
            p.put(k, u);
        }
        while p.free[k] > 0 {
            let (tiles_left, cost_left) = (p.free[k], target - p.load[k]);
            // (score, source, split length or 0)
            let mut best: Option<(f64, Src, u32)> = None;
            let mut consider = |u: &Run, src: Src, p: &Placer| {
                let take = if (u.len as usize) <= tiles_left {
                    *u
                } else {
                    // The head's estimate (cost exact up to rounding, reach from its ends).
                    let e = u.start as usize + tiles_left;
                    Run {
                        len: tiles_left as u32,
                        cost: tc.cum[e] - tc.cum[u.start as usize],
                        hi: tc.hi[e - 1].max(e as u32 - 1),
                        whole: false,
                        ..*u
                    }
                };
                let rest = tiles_left - take.len as usize;
                let err = if rest == 0 {
                    (cost_left - take.cost).abs()
                } else {
                    // What the rest of the rank is filled from: the pool (cursor mode: its
                    // whole clusters, the sequence being dealt in order).
                    let (c, t) = match src {
                        Src::Back(_) if cursor => (0.0, 0),
                        _ => (take.cost, take.len as usize),
                    };
                    let rho = (pool_cost - seq_cost - c)
                        / (pool_tiles - seq_tiles).saturating_sub(t).max(1) as f64;
                    (cost_left - take.cost - rho * rest as f64).abs()
                };
                let split = if take.len < u.len { take.len } else { 0 };
                // A split also costs the K/V the tail's later owner receives from this head.
                let d = if traffic > 0.0 {
                    (p.delta(k, &take).max(0) + split as i64) as f64
                } else {
                    0.0
                };
                let score = err / scale + traffic * d / n;
                if best.is_none_or(|b| score < b.0) {
                    best = Some((score, src, split));
                }
            };
            for (i, slot) in pool.iter().enumerate() {
                if let Some(u) = slot {
                    consider(u, Src::Pool(i), &p);
                }
            }
            if cursor {
                // The sequence's next piece stays on offer (the last ranks must take the rest).
                if let Some(&(c, i)) = seq.get(at) {
                    consider(&split[c][i], Src::Back(c), &p);
                }
            } else {
                for (c, &(a, b)) in ends.iter().enumerate() {
                    if a < b {
                        consider(&split[c][a], Src::Front(c), &p);
                        if b - 1 > a {
                            consider(&split[c][b - 1], Src::Back(c), &p);
                        }
                    }
                }
            }
            let Some((_, src, cut)) = best else { break };
            let u = match src {
                Src::Pool(i) => pool[i].take(),
                Src::Front(c) => {
                    ends[c].0 += 1;
                    split[c].get(ends[c].0 - 1).copied()
                }
                Src::Back(c) => {
                    if cursor {
                        at += 1;
                        if let Some(v) = split[c].get(ends[c].1 - 1) {
                            seq_cost -= v.cost;
                            seq_tiles -= v.len as usize;
                        }
                    }
                    ends[c].1 -= 1;
                    split[c].get(ends[c].1).copied()
                }
            };
            let Some(u) = u else { break };
            let u = if cut > 0 {
                // The tail goes back to the pool.
                pool.push(Some(run_of(tc, u.start + cut, u.start + u.len, false)));
                run_of(tc, u.start, u.start + cut, false)
            } else {
                u
            };
            pool_cost -= u.cost;
            pool_tiles -= u.len as usize;
            p.put(k, u);
        }
    }
    swap_wholes(&mut p);
    p.owned
}

/// Lowers the largest load by swapping a whole cluster of the most loaded rank with a cheaper
/// one of the same length on a less loaded rank (tile counts and traffic stay), while that
/// strictly helps (bounded number of rounds).
fn swap_wholes(p: &mut Placer) {
    let r = p.load.len();
    let key = |u: &Run| (u.len, u.cost);
    for w in p.wholes.iter_mut() {
        w.sort_by(|x, y| key(x).0.cmp(&key(y).0).then(x.cost.total_cmp(&y.cost)));
    }
    for _round in 0..(8 * r + 64) {
        let a = (0..r)
            .max_by(|&x, &y| p.load[x].total_cmp(&p.load[y]).then(y.cmp(&x)))
            .unwrap_or(0);
        let mut partners: Vec<usize> = (0..r).filter(|&b| b != a).collect();
        partners.sort_by(|&x, &y| p.load[x].total_cmp(&p.load[y]).then(x.cmp(&y)));
        partners.truncate(SWAP_PARTNERS);
        // (rank b, index in a, index in b, new max)
        let mut best: Option<(usize, usize, usize, f64)> = None;
        for b in partners {
            let gap = p.load[a] - p.load[b];
            if gap <= 0.0 {
                continue;
            }
            let wb = &p.wholes[b];
            for (ia, x) in p.wholes[a].iter().enumerate() {
                let want = x.cost - gap / 2.0;
                let pos =
                    wb.partition_point(|y| y.len < x.len || (y.len == x.len && y.cost < want));
                for ib in [pos.wrapping_sub(1), pos] {
                    let Some(y) = wb.get(ib) else { continue };
                    let d = x.cost - y.cost;
                    if y.len != x.len || d <= 0.0 || d >= gap {
                        continue;
                    }
                    let new_max = (p.load[a] - d).max(p.load[b] + d);
                    if best.is_none_or(|z| new_max < z.3) {
                        best = Some((b, ia, ib, new_max));
                    }
                }
            }
        }
        let Some((b, ia, ib, new_max)) = best else {
            break;
        };
        if new_max >= p.load[a] * (1.0 - 1e-12) {
            break;
        }
        let x = p.wholes[a].remove(ia);
        let y = p.wholes[b].remove(ib);
        p.load[a] += y.cost - x.cost;
        p.load[b] += x.cost - y.cost;
        for (k, from, to) in [(a, x, y), (b, y, x)] {
            let o = &mut p.owned[k];
            o.retain(|&t| t < from.start || t >= from.start + from.len);
            o.extend(to.start..to.start + to.len);
            let w = &mut p.wholes[k];
            let pos = w.partition_point(|z| {
                z.len < to.len || (z.len == to.len && z.cost.total_cmp(&to.cost).is_lt())
            });
            w.insert(pos, to);
        }
    }
}

/// Per rank, how many of its tiles' reach intervals cover each tile, and how many tiles are
/// covered: the rank's estimated received K/V is `covered − owned`.
struct Cover {
    n: usize,
    count: Vec<u32>,
    covered: Vec<usize>,
}

impl Cover {
    fn new(tc: &TileCosts, owned: &[Vec<u32>]) -> Self {
        let n = tc.cost.len();
        let mut c = Cover {
            n,
            count: vec![0; owned.len() * n],
            covered: vec![0; owned.len()],
        };
        for (k, o) in owned.iter().enumerate() {
            for &t in o {
                c.add(tc, k, t);
            }
        }
        c
    }

    fn add(&mut self, tc: &TileCosts, k: usize, t: u32) {
        let (lo, hi) = (tc.lo[t as usize] as usize, tc.hi[t as usize] as usize);
        for x in &mut self.count[k * self.n + lo..=k * self.n + hi] {
            self.covered[k] += (*x == 0) as usize;
            *x += 1;
        }
    }

    fn remove(&mut self, tc: &TileCosts, k: usize, t: u32) {
        let (lo, hi) = (tc.lo[t as usize] as usize, tc.hi[t as usize] as usize);
        for x in &mut self.count[k * self.n + lo..=k * self.n + hi] {
            *x -= 1;
            self.covered[k] -= (*x == 0) as usize;
        }
    }

    /// Moves tile `ta` from rank `a` to `b` and `tb` from `b` to `a`.
    fn swap(&mut self, tc: &TileCosts, a: usize, b: usize, ta: u32, tb: u32) {
        self.remove(tc, a, ta);
        self.add(tc, a, tb);
        self.remove(tc, b, tb);
        self.add(tc, b, ta);
    }
}

/// Lowers the largest load below `stop` by swapping single tiles between the most loaded rank
/// and the least loaded ones (any tiles: pieces' boundary tiles and short documents give the
/// fine steps whole-cluster swaps lack), accepting a swap only when neither rank then receives
/// more K/V than the busiest receiver before the repair (estimated from reach intervals).
/// Bounded number of rounds.
fn repair(tc: &TileCosts, owned: &mut [Vec<u32>], stop: f64) {
    let r = owned.len();
    let cost = |t: u32| tc.cost[t as usize];
    let mut load: Vec<f64> = owned
        .iter()
        .map(|o| o.iter().map(|&t| cost(t)).sum())
        .collect();
    if load.iter().all(|&l| l <= stop) {
        return;
    }
    let mut cover = Cover::new(tc, owned);
    let limit = (0..r)
        .map(|k| cover.covered[k].saturating_sub(owned[k].len()))
        .max()
        .unwrap_or(0);
    let mut sorted: Vec<Vec<u32>> = owned.to_vec();
    for s in sorted.iter_mut() {
        s.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)));
    }
    let mut cands: Vec<(f64, usize, u32, u32)> = Vec::new();
    for _round in 0..(8 * r + 64) {
        let a = (0..r)
            .max_by(|&x, &y| load[x].total_cmp(&load[y]).then(y.cmp(&x)))
            .unwrap_or(0);
        if load[a] <= stop {
            break;
        }
        // Several partners: the one holding a piece's neighbours takes its tiles for free.
        let mut partners: Vec<usize> = (0..r).filter(|&b| b != a).collect();
        partners.sort_by(|&x, &y| load[x].total_cmp(&load[y]).then(x.cmp(&y)));
        partners.truncate(REPAIR_PARTNERS);
        // (new max, rank b, tile of a, tile of b)
        cands.clear();
        for b in partners {
            let gap = load[a] - load[b];
            if gap <= 0.0 {
                continue;
            }
            let (sa, sb) = (&sorted[a], &sorted[b]);
            swap_pairs(&cost, load[a], load[b], sa, sb, |ia, ib, new_max| {
                cands.push((new_max, b, sa[ia], sb[ib]));
            });
        }
        // The best few by new maximum, in order (a partial sort: the lists are long).
        let by = |x: &(f64, usize, u32, u32), y: &(f64, usize, u32, u32)| {
            x.0.total_cmp(&y.0)
                .then((x.1, x.2, x.3).cmp(&(y.1, y.2, y.3)))
        };
        if cands.len() > REPAIR_TRIES {
            cands.select_nth_unstable_by(REPAIR_TRIES, by);
            cands.truncate(REPAIR_TRIES);
        }
        cands.sort_unstable_by(by);
        let mut done = false;
        for &(new_max, b, ta, tb) in cands.iter() {
            if new_max >= load[a] * (1.0 - 1e-12) {
                break;
            }
            cover.swap(tc, a, b, ta, tb);
            let ok = [a, b]
                .iter()
                .all(|&k| cover.covered[k].saturating_sub(owned[k].len()) <= limit);
            if !ok {
                cover.swap(tc, a, b, tb, ta);
                continue;
            }
            let d = cost(ta) - cost(tb);
            load[a] -= d;
            load[b] += d;
            for (k, from, to) in [(a, ta, tb), (b, tb, ta)] {
                if let Some(x) = owned[k].iter_mut().find(|x| **x == from) {
                    *x = to;
                }
                let s = &mut sorted[k];
                if let Some(i) = s.iter().position(|&t| t == from) {
                    s.remove(i);
                }
                let i =
                    s.partition_point(|&t| cost(t).total_cmp(&cost(to)).then(t.cmp(&to)).is_lt());
                s.insert(i, to);
            }
            done = true;
            break;
        }
        if !done {
            break;
        }
    }
}

/// Candidate result of a solver run: the assignment, its largest load, largest and total
/// estimated received K/V tiles.
struct Candidate {
    owned: Vec<Vec<u32>>,
    max_load: f64,
    max_remote: u64,
    sum_remote: u64,
}

/// `None` unless `owned` deals every tile once, `cap` to each rank.
fn candidate(tc: &TileCosts, owned: Vec<Vec<u32>>, cap: usize) -> Option<Candidate> {
    let mut seen = vec![false; tc.cost.len()];
    for o in &owned {
        if o.len() != cap {
            return None;
        }
        for &t in o {
            let s = seen.get_mut(t as usize)?;
            if std::mem::replace(s, true) {
                return None;
            }
        }
    }
    let max_load = owned
        .iter()
        .map(|o| o.iter().map(|&t| tc.cost[t as usize]).sum::<f64>())
        .fold(0.0, f64::max);
    let rem = remote_estimate(tc, &owned);
    Some(Candidate {
        owned,
        max_load,
        max_remote: rem.iter().copied().max().unwrap_or(0),
        sum_remote: rem.iter().sum(),
    })
}

/// [`Scheme::Balanced`]: among balance-first assignments ([`lpt`]), the fixed schemes and
/// traffic-first ones ([`deal`] then [`repair`]), the one whose busiest receiver gets the fewest
/// K/V tiles among those within `balance_cap` of the mean cost; when none is, the best balanced.
fn balanced(
    tc: &TileCosts,
    clus: &[(u32, u32)],
    r: usize,
    cap: usize,
    balance_cap: f64,
) -> Vec<Vec<u32>> {
    let total: f64 = tc.cost.iter().sum();
    let mean = total / r as f64;
    let cap_cost = mean * balance_cap;
    let fits = |c: &Candidate| c.max_load <= cap_cost * (1.0 + 1e-12);
    let mut cands: Vec<Candidate> = Vec::new();
    // Balance first: short clusters kept whole (up to half a rank's share, or smaller), long ones
    // cut into contiguous pieces or single tiles; single tiles balance finest.
    let mut shapes: Vec<(usize, usize)> = vec![
        (cap / 2, cap / 16),
        (cap / 2, cap / 64),
        (cap / 2, 1),
        (cap / 8, 1),
        (cap / 32, 1),
        (0, 1),
    ];
    shapes.dedup();
    for &(keep, piece) in &shapes {
        cands.extend(candidate(tc, lpt(tc, clus, r, cap, keep, piece).0, cap));
    }
    // The fixed schemes too: balanced is within the cap whenever one of them is, with no more
    // traffic than any that is (by the estimate).
    let n = tc.cost.len();
    for scheme in [Scheme::Contiguous, Scheme::Zigzag, Scheme::PerDocZigzag] {
        if scheme != Scheme::Zigzag || n.is_multiple_of(2 * r) {
            cands.extend(candidate(tc, fixed(scheme, n, r, clus), cap));
        }
    }
    // Traffic first: deals over piece sizes, whole-cluster thresholds, traffic weights and both
    // piece orders.
    let mut dealt: Vec<Candidate> = Vec::new();
    let mut pieces = vec![(cap / 32).max(1), (cap / 128).max(1)];
    pieces.dedup();
    for &piece in &pieces {
        let mut last_split = None;
        for keep in [1.0, 0.5, 0.25] {
            let (wholes, split) = make_runs(tc, clus, cap, piece, keep * mean);
            // Thresholds that split the same clusters deal the same.
            let starts: Vec<u32> = split
                .iter()
                .filter_map(|v| v.first().map(|u| u.start))
                .collect();
            if last_split.as_ref() == Some(&starts) {
                continue;
            }
            last_split = Some(starts);
            for traffic in [0.0, 0.05, 0.2, 1.0] {
                for cursor in [false, true] {
                    let owned = deal(tc, &wholes, &split, r, cap, traffic, cursor);
                    dealt.extend(candidate(tc, owned, cap));
                }
            }
        }
    }
    // Repair never raises the busiest receiver, so repairing deals in increasing order of it
    // can stop at the first that then fits the cap unless a later one starts lower.
    let mut order: Vec<usize> = (0..dealt.len()).collect();
    order.sort_by_key(|&i| (dealt[i].max_remote, dealt[i].sum_remote, i));
    let stop = mean * (1.0 + (balance_cap - 1.0) / 2.0);
    let mut best_fit = cands
        .iter()
        .filter(|c| fits(c))
        .map(|c| c.max_remote)
        .min()
        .unwrap_or(u64::MAX);
    let mut slots: Vec<Option<Candidate>> = dealt.into_iter().map(Some).collect();
    for i in order {
        let Some(c) = slots[i].take() else { continue };
        if c.max_remote >= best_fit {
            break;
        }
        let mut owned = c.owned;
        repair(tc, &mut owned, stop);
        if let Some(c) = candidate(tc, owned, cap) {
            if fits(&c) {
                best_fit = best_fit.min(c.max_remote);
            }
            cands.push(c);
        }
    }
    // Within the cap: the least K/V for the busiest receiver; else the best balance.
    let pick = cands
        .iter()
        .enumerate()
        .min_by(|(i, x), (j, y)| {
            let (fx, fy) = (fits(x), fits(y));
            fy.cmp(&fx)
                .then_with(|| {
                    let traffic = (x.max_remote, x.sum_remote).cmp(&(y.max_remote, y.sum_remote));
                    if fx && fy {
                        traffic.then(x.max_load.total_cmp(&y.max_load))
                    } else {
                        x.max_load.total_cmp(&y.max_load).then(traffic)
                    }
                })
                .then(i.cmp(j))
        })
        .map(|(i, _)| i)
        .unwrap_or(0);
    cands
        .into_iter()
        .nth(pick)
        .map(|c| c.owned)
        .unwrap_or_default()
}

fn finish(
    plan: &Plan,
    scheme: Scheme,
    model: CostModel,
    r: usize,
    owned: Vec<Vec<u32>>,
    tc: &TileCosts,
    clusters: Vec<(u32, u32)>,
) -> Result<Sharding> {
    let n = plan.q_tiles;
    let mut owner = vec![u32::MAX; n];
    for (k, o) in owned.iter().enumerate() {
        for &t in o {
            owner[t as usize] = k as u32;
        }
    }
    if owner.contains(&u32::MAX) || owned.iter().any(|o| o.len() != n / r) {
        return Err(Error::Internal(format!(
            "{scheme} sharding did not deal every tile exactly once"
        )));
    }
    let mut needed = vec![vec![Vec::new(); r]; r];
    let mut costs = Vec::with_capacity(r);
    let mut mark = vec![false; n];
    for (k, o) in owned.iter().enumerate() {
        mark.iter_mut().for_each(|m| *m = false);
        let mut c = RankCost::default();
        for &t in o {
            let t = t as usize;
            c.pairs += tc.pairs[t];
            c.full_tiles += tc.full[t];
            c.partial_tiles += tc.partial[t];
            c.forward_cost += tc.cost[t];
            for hp in &plan.head_plans {
                for e in hp.row(t) {
                    mark[e.tile as usize] = true;
                }
            }
        }
        c.backward_cost = c.forward_cost * model.backward;
        for (s, o2) in owned.iter().enumerate() {
            needed[k][s] = o2.iter().copied().filter(|&t| mark[t as usize]).collect();
            c.kv_tiles_needed += needed[k][s].len() as u64;
            if s != k {
                c.kv_tiles_remote += needed[k][s].len() as u64;
            }
        }
        let allgather = (n - n / r) as f64;
        c.kv_remote_fraction = if allgather > 0.0 {
            c.kv_tiles_remote as f64 / allgather
        } else {
            0.0
        };
        costs.push(c);
    }
    let mut h = blake3::Hasher::new();
    h.update(b"tessera-shard v1\n");
    h.update(&plan.contract.0);
    h.update(scheme.name().as_bytes());
    h.update(&(r as u64).to_le_bytes());
    h.update(&model.partial_overhead.to_le_bytes());
    h.update(&model.backward.to_le_bytes());
    h.update(&model.balance_cap.to_le_bytes());
    for o in &owned {
        for &t in o {
            h.update(&t.to_le_bytes());
        }
    }
    Ok(Sharding {
        scheme,
        cost_model: model,
        world_size: r,
        tile: plan.tile.q,
        tiles: n,
        contract: plan.contract,
        owned,
        costs,
        needed,
        clusters,
        fingerprint: *h.finalize().as_bytes(),
    })
}

impl Sharding {
    /// Tiles per rank.
    pub fn tiles_per_rank(&self) -> usize {
        self.tiles / self.world_size
    }

    /// Tokens per rank.
    pub fn tokens_per_rank(&self) -> usize {
        self.tiles_per_rank() * self.tile
    }

    /// Rank `rank`'s token positions in local order (its tiles ascending, tokens ascending).
    pub fn positions(&self, rank: usize) -> Result<Vec<usize>> {
        self.check_rank(rank)?;
        let t = self.tile;
        Ok(self.owned[rank]
            .iter()
            .flat_map(|&k| k as usize * t..(k as usize + 1) * t)
            .collect())
    }

    /// Every rank's positions, rank after rank: the *sharded order*. `x[permutation]` puts a row
    /// in sharded order; position `p` of the row sits at sharded index `inverse[p]`.
    pub fn permutation(&self) -> Vec<usize> {
        let t = self.tile;
        self.owned
            .iter()
            .flatten()
            .flat_map(|&k| k as usize * t..(k as usize + 1) * t)
            .collect()
    }

    /// Largest over mean per-rank modelled cost (1 is perfect balance).
    pub fn imbalance(&self) -> f64 {
        let c: Vec<f64> = self.costs.iter().map(RankCost::cost).collect();
        let mean = c.iter().sum::<f64>() / c.len().max(1) as f64;
        let max = c.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            max / mean
        } else {
            1.0
        }
    }

    /// The busiest receiver's K/V in [`KvLayout::Needed`] mode as a fraction of an all-gather
    /// (the largest [`RankCost::kv_remote_fraction`]).
    pub fn kv_fraction(&self) -> f64 {
        self.costs
            .iter()
            .map(|c| c.kv_remote_fraction)
            .fold(0.0, f64::max)
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size {
            return Err(Error::invalid(
                "rank",
                format!("a rank below world_size {}", self.world_size),
                rank,
            ));
        }
        Ok(())
    }

    /// The global kv tiles of rank `rank`'s local K/V in `layout`, in local order (sharded
    /// order). A rank whose rows touch nothing (all padding) keeps its own first tile, so its
    /// local problem is never empty.
    pub fn local_kv_tiles(&self, rank: usize, layout: KvLayout) -> Result<Vec<u32>> {
        self.check_rank(rank)?;
        let mut v: Vec<u32> = match layout {
            KvLayout::AllGather => self.owned.iter().flatten().copied().collect(),
            KvLayout::Needed => self.needed[rank].iter().flatten().copied().collect(),
        };
        if v.is_empty() {
            v.push(self.owned[rank][0]);
        }
        Ok(v)
    }

    /// Rank `rank`'s local plan: the global plan's rows of its q tiles, against its local K/V in
    /// `layout` (see the module doc). `plan` must be the plan this sharding was made from.
    pub fn local_plan(&self, plan: &Plan, rank: usize, layout: KvLayout) -> Result<Plan> {
        self.local_plan_padded(plan, rank, layout, 0)
    }

    /// [`Sharding::local_plan`] against a local K/V of at least `kv_tiles` tiles: tiles past the
    /// rank's own ones are padding that no work list visits. SPMD programs (one compiled step
    /// for every rank) give every rank the same K/V length this way.
    pub fn local_plan_padded(
        &self,
        plan: &Plan,
        rank: usize,
        layout: KvLayout,
        kv_tiles: usize,
    ) -> Result<Plan> {
        if plan.contract != self.contract {
            return Err(Error::invalid(
                "plan",
                format!(
                    "the plan this sharding was made from (contract {})",
                    self.contract
                ),
                format!("contract {}", plan.contract),
            ));
        }
        let kv = self.local_kv_tiles(rank, layout)?;
        let rows = &self.owned[rank];
        let mut kv_local = vec![u32::MAX; plan.kv_tiles];
        for (i, &t) in kv.iter().enumerate() {
            kv_local[t as usize] = i as u32;
        }
        if kv_tiles > plan.kv_tiles.max(kv.len()) {
            return Err(Error::invalid(
                "kv_tiles",
                format!("at most the plan's {} kv tiles", plan.kv_tiles),
                kv_tiles,
            ));
        }
        let (nq, nk) = (rows.len(), kv.len().max(kv_tiles));
        let mut mask_map = vec![u32::MAX; plan.partials.len()];
        let mut partials = PartialMasks::new(plan.tile);
        let mut head_plans = Vec::with_capacity(plan.head_plans.len());
        for hp in &plan.head_plans {
            let mut fwd_offsets = Vec::with_capacity(nq + 1);
            let mut fwd = Vec::new();
            fwd_offsets.push(0u32);
            let (mut full, mut partial, mut pairs) = (0u64, 0u64, 0u64);
            for &t in rows {
                let start = fwd.len();
                for e in hp.row(t as usize) {
                    let lt = kv_local[e.tile as usize];
                    if lt == u32::MAX {
                        return Err(Error::Internal(format!(
                            "rank {rank}: kv tile {} missing from its {} layout",
                            e.tile,
                            layout.name()
                        )));
                    }
                    let mask = if e.is_full() {
                        full += 1;
                        pairs += (plan.tile.q * plan.tile.kv) as u64;
                        FULL_TILE
                    } else {
                        partial += 1;
                        let m = &mut mask_map[e.mask as usize];
                        if *m == u32::MAX {
                            *m = partials.len() as u32;
                            partials.data.extend_from_slice(plan.partials.get(e.mask));
                        }
                        pairs += plan
                            .partials
                            .get(e.mask)
                            .iter()
                            .map(|w| w.count_ones() as u64)
                            .sum::<u64>();
                        *m
                    };
                    fwd.push(TileEntry { tile: lt, mask });
                }
                // Sharded order may reorder a row's kv tiles: work lists are ascending.
                fwd[start..].sort_unstable_by_key(|e| e.tile);
                fwd_offsets.push(fwd.len() as u32);
            }
            let (bwd_offsets, bwd) = transpose(&fwd_offsets, &fwd, nk);
            head_plans.push(HeadPlan {
                fwd_offsets,
                fwd,
                bwd_offsets,
                bwd,
                full_tiles: full,
                partial_tiles: partial,
                allowed_pairs: pairs,
            });
        }
        let t = plan.tile.q;
        let shape = PlanShape::new(plan.shape.batch, plan.shape.heads, nq * t, nk * t)?;
        let uses = head_plan_uses(plan);
        let groups = plan.group_plan.len() as u64;
        let tiles = groups * (nq * nk) as u64;
        let (mut f, mut p) = (0u64, 0u64);
        for &g in &plan.group_plan {
            f += head_plans[g as usize].full_tiles;
            p += head_plans[g as usize].partial_tiles;
        }
        let allowed: u64 = head_plans
            .iter()
            .zip(&uses)
            .map(|(h, &u)| h.allowed_pairs * u)
            .sum();
        let total = (shape.batch * shape.heads) as f64 * shape.q_len as f64 * shape.kv_len as f64;
        let mut h = blake3::Hasher::new();
        h.update(b"tessera-local-plan v1\n");
        h.update(&self.fingerprint);
        h.update(&(rank as u64).to_le_bytes());
        h.update(layout.name().as_bytes());
        if nk > kv.len() {
            h.update(&(nk as u64).to_le_bytes());
        }
        let mut local = Plan {
            format_version: plan.format_version,
            contract: ContractKey(*h.finalize().as_bytes()),
            mask: format!(
                "shard({}, scheme={}, world_size={}, rank={rank}, kv={})",
                plan.mask,
                self.scheme,
                self.world_size,
                layout.name()
            ),
            shape,
            tile: plan.tile,
            q_tiles: nq,
            kv_tiles: nk,
            batch_groups: plan.batch_groups,
            head_groups: plan.head_groups,
            group_plan: plan.group_plan.clone(),
            stats: PlanStats {
                tiles,
                empty_tiles: tiles - f - p,
                partial_tiles: p,
                full_tiles: f,
                unique_partial_masks: partials.len() as u64,
                head_plans: head_plans.len() as u64,
                allowed_pairs: allowed,
                density: allowed as f64 / total,
                tile_density: (f + p) as f64 / tiles as f64,
                grid_width: head_plans.iter().map(|h| h.grid_width()).max().unwrap_or(0) as u64,
                plan_bytes: 0,
                build_ms: 0.0,
            },
            head_plans,
            partials,
        };
        local.stats.plan_bytes = local.heap_bytes();
        Ok(local)
    }
}

/// The backward (kv-major) work list of a forward list with `nk` kv tiles.
fn transpose(fwd_offsets: &[u32], fwd: &[TileEntry], nk: usize) -> (Vec<u32>, Vec<TileEntry>) {
    let mut offsets = vec![0u32; nk + 1];
    for e in fwd {
        offsets[e.tile as usize + 1] += 1;
    }
    for k in 0..nk {
        offsets[k + 1] += offsets[k];
    }
    let mut fill = offsets.clone();
    let mut bwd = vec![TileEntry { tile: 0, mask: 0 }; fwd.len()];
    for q in 0..fwd_offsets.len().saturating_sub(1) {
        for e in &fwd[fwd_offsets[q] as usize..fwd_offsets[q + 1] as usize] {
            let slot = &mut fill[e.tile as usize];
            bwd[*slot as usize] = TileEntry {
                tile: q as u32,
                mask: e.mask,
            };
            *slot += 1;
        }
    }
    (offsets, bwd)
}
