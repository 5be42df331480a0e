//! Balance and traffic model of context-parallel shardings (`tessera cp-sim`).
//!
//! Contract: [`doc_mix`] draws a seeded packed row of document lengths (a lognormal body plus long
//! documents, as a fraction of the row's tokens or of its documents: [`DocMix::web`] is the packed web-document
//! mix, 1 % of documents 32K–128K tokens); [`simulate`] plans `causal & document` over it, shards it
//! with every [`Scheme`] for every world size, and reports per scheme the largest and mean
//! per-rank compute (pairs, tiles, modelled cost), the tile work sharding adds, the K/V bytes a
//! rank receives in all-gather and needed mode (and the busiest receiver's as a fraction of an
//! all-gather), and a modelled step time from the stated
//! [`SimModel`] (compute at a FLOP rate plus K/V traffic at a link bandwidth, no overlap). Pure
//! and deterministic for a given configuration.

use crate::shard::{shard, CostModel, Scheme};
use crate::{build_plan, Plan, PlanShape, TileShape};
use std::time::Instant;
use tessera_core::{Error, Result};
use tessera_mask::{Mask, SegmentIds, Segments};

/// The document-length mix of a simulated row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DocMix {
    /// Median length of the lognormal body, tokens.
    pub median: f64,
    /// Lognormal sigma of the body.
    pub sigma: f64,
    /// Shortest and longest body document, tokens.
    pub body_range: (usize, usize),
    /// Fraction of the row's tokens in long documents (drawn first).
    pub long_fraction: f64,
    /// Fraction of the documents that fill the rest of the row that are long: each one is long
    /// with this probability.
    pub long_docs: f64,
    /// Long document lengths, uniform in this range (tokens, capped at the row).
    pub long_range: (usize, usize),
    /// Seed of the draw.
    pub seed: u64,
}

impl Default for DocMix {
    fn default() -> Self {
        DocMix {
            median: 1000.0,
            sigma: 1.3,
            body_range: (64, 32 * 1024 - 1),
            long_fraction: 0.3,
            long_docs: 0.0,
            long_range: (32 * 1024, 128 * 1024),
            seed: 0,
        }
    }
}

impl DocMix {
    /// Packed web documents: the lognormal body, and 1 % of documents long (32K–128K
    /// tokens) instead of a fixed share of tokens.
    pub fn web(seed: u64) -> Self {
        DocMix {
            long_fraction: 0.0,
            long_docs: 0.01,
            seed,
            ..DocMix::default()
        }
    }
}

/// SplitMix64: a tiny seeded generator (the same numbers on every platform).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Segment ids of one packed row of `len` tokens drawn from `mix`: long documents first take
/// about `long_fraction` of the row, then documents fill the rest, each long with probability
/// `long_docs` (else from the body), then the documents are shuffled (the last one is cut at the
/// row's end).
pub fn doc_mix(len: usize, mix: &DocMix) -> Result<Vec<i64>> {
    if !(0.0..=1.0).contains(&mix.long_fraction)
        || !(0.0..=1.0).contains(&mix.long_docs)
        || mix.body_range.0 == 0
        || mix.body_range.0 > mix.body_range.1
        || mix.long_range.0 == 0
        || mix.long_range.0 > mix.long_range.1
        || !(mix.median > 0.0 && mix.sigma >= 0.0)
    {
        return Err(Error::invalid(
            "doc mix",
            "median > 0, sigma >= 0, 0 < min <= max lengths, long_fraction and long_docs in [0, 1]",
            format!("{mix:?}"),
        ));
    }
    let mut rng = Rng(mix.seed ^ 0x7e55_e2a0_c9f1_d00d);
    let mut docs = Vec::new();
    let long_budget = (len as f64 * mix.long_fraction) as usize;
    let mut used = 0;
    let span = (mix.long_range.1 - mix.long_range.0) as u64 + 1;
    while used < long_budget {
        let n = (mix.long_range.0 + (rng.next() % span) as usize).min(len - used);
        docs.push(n);
        used += n;
    }
    while used < len {
        // No draw when long_docs is 0: the token-fraction mixes keep their documents.
        if mix.long_docs > 0.0 && rng.unit() < mix.long_docs {
            let n = (mix.long_range.0 + (rng.next() % span) as usize).min(len - used);
            docs.push(n);
            used += n;
            continue;
        }
        let x = (mix.median.ln() + mix.sigma * rng.normal()).exp();
        let n = (x as usize)
            .clamp(mix.body_range.0, mix.body_range.1)
            .min(len - used);
        docs.push(n);
        used += n;
    }
    // Fisher-Yates: long documents anywhere in the row.
    for i in (1..docs.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        docs.swap(i, j);
    }
    let mut ids = Vec::with_capacity(len);
    for (d, &n) in docs.iter().enumerate() {
        ids.extend(std::iter::repeat_n(d as i64, n));
    }
    Ok(ids)
}

/// The stated hardware and model of a simulated step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimModel {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (GQA).
    pub kv_heads: usize,
    /// Head dimension (q, k and v).
    pub head_dim: usize,
    /// Bytes per K/V element on the wire.
    pub kv_bytes: usize,
    /// Sustained attention FLOP rate per rank, FLOP/s.
    pub flops: f64,
    /// Link bandwidth into one rank, bytes/s.
    pub link_bytes_per_s: f64,
    /// Tile side.
    pub tile: usize,
    /// Tile costs of the solver and the compute model.
    pub cost: CostModel,
}

impl Default for SimModel {
    fn default() -> Self {
        SimModel {
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            kv_bytes: 2,
            flops: 400e12,
            link_bytes_per_s: 50e9,
            tile: 128,
            cost: CostModel::default(),
        }
    }
}

impl SimModel {
    /// Bytes of one token's K and V (all kv heads).
    pub fn kv_token_bytes(&self) -> f64 {
        (self.kv_heads * 2 * self.head_dim * self.kv_bytes) as f64
    }

    /// FLOPs of one full tile, forward, all query heads (`4·D` per pair: QKᵀ and PV).
    pub fn tile_flops(&self) -> f64 {
        (self.tile * self.tile) as f64 * self.heads as f64 * 4.0 * self.head_dim as f64
    }

    /// One line per assumption, for the report.
    pub fn assumptions(&self) -> Vec<String> {
        vec![
            format!(
                "attention: {} query heads, {} kv heads, head dim {}, K/V {} bytes/element on the wire",
                self.heads, self.kv_heads, self.head_dim, self.kv_bytes
            ),
            format!(
                "compute: {:.0} TFLOP/s per rank; a full {}x{} tile is 4·D FLOPs per pair per head \
                 forward, backward {}x forward; a partial tile costs {} + {}·(allowed fraction) of a full one",
                self.flops / 1e12,
                self.tile,
                self.tile,
                self.cost.backward,
                self.cost.partial_overhead,
                1.0 - self.cost.partial_overhead
            ),
            format!(
                "traffic: {:.0} GB/s into each rank; forward receives K/V, backward sends the same \
                 bytes of dK/dV back; step = slowest rank's compute + traffic (no overlap)",
                self.link_bytes_per_s / 1e9
            ),
        ]
    }
}

/// One (row length, world size, scheme) line of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRow {
    /// Tokens in the row.
    pub tokens: usize,
    /// World size.
    pub ranks: usize,
    /// Scheme.
    pub scheme: Scheme,
    /// Largest / mean modelled per-rank cost (forward + backward).
    pub cost_max_over_mean: f64,
    /// Largest / mean allowed pairs per rank.
    pub pairs_max_over_mean: f64,
    /// Largest / mean active tiles per rank.
    pub tiles_max_over_mean: f64,
    /// Largest per-rank active tiles.
    pub tiles_max: u64,
    /// Tiles all ranks walk minus the tiles of the unsharded plan.
    pub extra_tiles: i64,
    /// K/V bytes one rank receives in all-gather mode (forward).
    pub allgather_bytes: f64,
    /// Largest K/V bytes one rank receives in needed mode (forward).
    pub needed_bytes_max: f64,
    /// Mean K/V bytes a rank receives in needed mode (forward).
    pub needed_bytes_mean: f64,
    /// The busiest receiver's K/V in needed mode over an all-gather's ([`crate::Sharding::kv_fraction`]).
    pub needed_fraction_max: f64,
    /// Modelled step time, all-gather mode, seconds.
    pub step_allgather_s: f64,
    /// Modelled step time, needed mode, seconds.
    pub step_needed_s: f64,
    /// Wall time of the sharding, milliseconds.
    pub shard_ms: f64,
}

fn max_over_mean(v: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = v.clone().count().max(1) as f64;
    let mean = v.clone().sum::<f64>() / n;
    let max = v.fold(0.0, f64::max);
    if mean > 0.0 {
        max / mean
    } else {
        1.0
    }
}

/// The doc-causal plan of a `len`-token row drawn from `mix`, at tile `tile`.
pub fn doc_causal_plan(len: usize, mix: &DocMix, tile: usize) -> Result<Plan> {
    let ids = doc_mix(len, mix)?;
    let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(ids)?));
    build_plan(
        &mask,
        PlanShape::new(1, 1, len, len)?,
        TileShape::new(tile, tile)?,
    )
}

/// Every scheme at every world size for one planned row (see the module doc).
pub fn simulate_plan(plan: &Plan, ranks: &[usize], model: &SimModel) -> Result<Vec<SimRow>> {
    let mut out = Vec::new();
    let tile_tokens = plan.tile.kv as f64;
    let global_tiles = plan.stats.full_tiles + plan.stats.partial_tiles;
    for &r in ranks {
        for scheme in Scheme::ALL {
            let t0 = Instant::now();
            let s = shard(plan, r, scheme, model.cost)?;
            let shard_ms = t0.elapsed().as_secs_f64() * 1e3;
            let c = &s.costs;
            let tiles = |x: &crate::RankCost| (x.full_tiles + x.partial_tiles) as f64;
            let sum_tiles: u64 = c.iter().map(|x| x.full_tiles + x.partial_tiles).sum();
            let kvb = model.kv_token_bytes() * tile_tokens;
            let allgather =
                (plan.shape.kv_len - s.tokens_per_rank()) as f64 * model.kv_token_bytes();
            let needed: Vec<f64> = c.iter().map(|x| x.kv_tiles_remote as f64 * kvb).collect();
            // A rank's step: its compute plus its traffic (K/V in, dK/dV out: twice the bytes).
            let flop_s = model.tile_flops() / model.flops;
            let step = |bytes: &dyn Fn(usize) -> f64| {
                c.iter()
                    .enumerate()
                    .map(|(k, x)| x.cost() * flop_s + 2.0 * bytes(k) / model.link_bytes_per_s)
                    .fold(0.0, f64::max)
            };
            out.push(SimRow {
                tokens: plan.shape.q_len,
                ranks: r,
                scheme,
                cost_max_over_mean: max_over_mean(c.iter().map(|x| x.cost())),
                pairs_max_over_mean: max_over_mean(c.iter().map(|x| x.pairs as f64)),
                tiles_max_over_mean: max_over_mean(c.iter().map(tiles)),
                tiles_max: c
                    .iter()
                    .map(|x| x.full_tiles + x.partial_tiles)
                    .max()
                    .unwrap_or(0),
                extra_tiles: sum_tiles as i64 - global_tiles as i64,
                allgather_bytes: allgather,
                needed_bytes_max: needed.iter().copied().fold(0.0, f64::max),
                needed_bytes_mean: needed.iter().sum::<f64>() / needed.len().max(1) as f64,
                needed_fraction_max: s.kv_fraction(),
                step_allgather_s: step(&|_| allgather),
                step_needed_s: step(&|k| needed[k]),
                shard_ms,
            });
        }
    }
    Ok(out)
}

/// [`simulate_plan`] for the doc-causal row of each length in `lengths`.
pub fn simulate(
    lengths: &[usize],
    ranks: &[usize],
    mix: &DocMix,
    model: &SimModel,
) -> Result<Vec<SimRow>> {
    let mut out = Vec::new();
    for &n in lengths {
        let plan = doc_causal_plan(n, mix, model.tile)?;
        out.extend(simulate_plan(&plan, ranks, model)?);
    }
    Ok(out)
}
