//! `document` leaves: query `i` attends key `j` when both carry the same valid (non-negative)
//! segment id.
//!
//! Contract: stage 1 ([`DocLeaf::state`], `q_reach`) is sound from per-tile id ranges and
//! padding flags; stage 2 ([`DocLeaf::write`]) ORs exactly the tile's allowed pairs into `out`
//! (so it serves unions in place). A key tile of few runs of equal ids is written run by run;
//! one whose ids scatter (many runs) by SIMD row compares against each query run's id. A tile of
//! few runs has a key ([`DocLeaf::tile_key`]: the runs' places and which meet), so stage 2 runs
//! once for all tiles of one pattern (a document's interior, each boundary).

use super::geom::{set_range, Geom};
use super::simd;
use crate::plan::TileState;
use std::collections::HashMap;

/// Segment-id summary of one tile side: range of valid ids and whether padding is present.
#[derive(Clone, Copy, Debug)]
struct SegSummary {
    min: i64,
    max: i64,
    any_valid: bool,
    any_pad: bool,
}

fn summarize(ids: &[i64], tile: usize) -> Vec<SegSummary> {
    ids.chunks(tile)
        .map(|c| {
            let mut s = SegSummary {
                min: i64::MAX,
                max: i64::MIN,
                any_valid: false,
                any_pad: false,
            };
            for &v in c {
                if v < 0 {
                    s.any_pad = true;
                } else {
                    s.any_valid = true;
                    s.min = s.min.min(v);
                    s.max = s.max.max(v);
                }
            }
            s
        })
        .collect()
}

/// A `document` leaf for one batch row.
pub(crate) struct DocLeaf<'a> {
    kv: &'a [i64],
    q_sum: Vec<SegSummary>,
    kv_sum: Vec<SegSummary>,
    /// Runs of equal valid ids per tile, (start, end exclusive, id) within the tile:
    /// `q_runs[q_run_off[qt]..q_run_off[qt + 1]]`, and the same for kv tiles. Stage 2 works
    /// run by run, so a tile costs its runs, not its rows.
    q_runs: Vec<(u32, u32, i64)>,
    q_run_off: Vec<u32>,
    kv_runs: Vec<(u32, u32, i64)>,
    kv_run_off: Vec<u32>,
    /// Per q tile: the hull of kv tiles holding any of its ids.
    pub(super) q_reach: Vec<Option<(usize, usize)>>,
}

/// Runs of equal valid (non-negative) ids of every `tile`-sized chunk of `ids`, and the offset
/// of each chunk's first run (one more offset at the end).
fn tile_runs(ids: &[i64], tile: usize) -> (Vec<(u32, u32, i64)>, Vec<u32>) {
    let mut runs = Vec::new();
    let mut off = Vec::with_capacity(ids.len().div_ceil(tile) + 1);
    for chunk in ids.chunks(tile) {
        off.push(runs.len() as u32);
        let mut s = 0;
        while s < chunk.len() {
            let id = chunk[s];
            let mut e = s + 1;
            while e < chunk.len() && chunk[e] == id {
                e += 1;
            }
            if id >= 0 {
                runs.push((s as u32, e as u32, id));
            }
            s = e;
        }
    }
    off.push(runs.len() as u32);
    (runs, off)
}

impl<'a> DocLeaf<'a> {
    /// The leaf over query ids `q` and key ids `kv`; `shared`: the two are equal (self-attention),
    /// so the key side's runs and summaries are the query side's when the tiles are square.
    pub(super) fn new(g: &Geom, q: &[i64], kv: &'a [i64], shared: bool) -> Self {
        let same = shared && g.tq == g.tk && q.len() == kv.len();
        let (q_runs, q_run_off) = tile_runs(q, g.tq);
        let (kv_runs, kv_run_off) = if same {
            (q_runs.clone(), q_run_off.clone())
        } else {
            tile_runs(kv, g.tk)
        };
        // First and last kv tile of every id: bounds the kv tiles a q tile can reach.
        let mut span: HashMap<i64, (usize, usize)> = HashMap::new();
        for kt in 0..g.nk {
            for &(_, _, id) in &kv_runs[kv_run_off[kt] as usize..kv_run_off[kt + 1] as usize] {
                span.entry(id).and_modify(|x| x.1 = kt).or_insert((kt, kt));
            }
        }
        let q_reach = (0..g.nq)
            .map(|qt| {
                let runs = &q_runs[q_run_off[qt] as usize..q_run_off[qt + 1] as usize];
                runs.iter()
                    .filter_map(|&(_, _, id)| span.get(&id).copied())
                    .reduce(|(x, y), (a, b)| (x.min(a), y.max(b)))
            })
            .collect();
        let q_sum = summarize(q, g.tq);
        let kv_sum = if same {
            q_sum.clone()
        } else {
            summarize(kv, g.tk)
        };
        DocLeaf {
            kv,
            q_sum,
            kv_sum,
            q_runs,
            q_run_off,
            kv_runs,
            kv_run_off,
            q_reach,
        }
    }
}

impl DocLeaf<'_> {
    /// Stage 1 of tile (`qt`, `kt`): Empty when no valid id is shared by the ranges, Full when
    /// both sides are one id and unpadded.
    pub(super) fn state(&self, qt: usize, kt: usize) -> TileState {
        let (q, k) = (self.q_sum[qt], self.kv_sum[kt]);
        if !q.any_valid || !k.any_valid || q.max < k.min || k.max < q.min {
            TileState::Empty
        } else if !q.any_pad && !k.any_pad && q.min == q.max && k.min == k.max && q.min == k.min {
            TileState::Full
        } else {
            TileState::Partial
        }
    }

    /// Appends a key that determines the tile's bitmask with its row and column counts: the
    /// runs of valid ids of both sides (within the tile) and which query run matches which key
    /// run; self-delimiting (run counts first). `false` past [`KEY_RUNS`] runs.
    pub(super) fn tile_key(&self, qt: usize, kt: usize, key: &mut Vec<i128>) -> bool {
        let kv = &self.kv_runs[self.kv_run_off[kt] as usize..self.kv_run_off[kt + 1] as usize];
        let q = &self.q_runs[self.q_run_off[qt] as usize..self.q_run_off[qt + 1] as usize];
        if q.len() + kv.len() > KEY_RUNS {
            return false;
        }
        key.push(((q.len() as i128) << 32) | kv.len() as i128);
        let mut matches: i128 = 0;
        for (i, &(a, b, id)) in q.iter().enumerate() {
            key.push(((a as i128) << 32) | b as i128);
            for (j, run) in kv.iter().enumerate() {
                if run.2 == id {
                    matches |= 1 << (i * KEY_RUNS + j);
                }
            }
        }
        key.extend(kv.iter().map(|&(c, e, _)| ((c as i128) << 32) | e as i128));
        key.push(matches);
        true
    }

    /// Stage 2: ORs the tile's allowed pairs into `out` (`tq` rows of `wpr` words).
    pub(super) fn write(&self, g: &Geom, qt: usize, kt: usize, out: &mut [u64]) {
        let (j0, j1) = g.kr(kt);
        let ncols = (j1 - j0 + 1) as usize;
        let wpr = g.wpr;
        let kv = &self.kv_runs[self.kv_run_off[kt] as usize..self.kv_run_off[kt + 1] as usize];
        let q = &self.q_runs[self.q_run_off[qt] as usize..self.q_run_off[qt + 1] as usize];
        if kv.len() <= DOC_RUNS {
            for &(a, b, id) in q {
                for &(c, e, _) in kv.iter().filter(|run| run.2 == id) {
                    for r in a as usize..b as usize {
                        set_range(&mut out[r * wpr..(r + 1) * wpr], c as i64, e as i64, ncols);
                    }
                }
            }
            return;
        }
        // Scattered key ids: one row compare per query run (padding keys, negative, never
        // equal a valid id), ORed into its rows.
        let keys = &self.kv[j0 as usize..=j1 as usize];
        let mut row = [0u64; MAX_WPR];
        let row = &mut row[..wpr];
        let k = self.kv_sum[kt];
        for &(a, b, id) in q {
            if id < k.min || id > k.max {
                continue;
            }
            simd::in_range(g.level, keys, id, 0, row);
            for r in a as usize..b as usize {
                out[r * wpr..(r + 1) * wpr]
                    .iter_mut()
                    .zip(row.iter())
                    .for_each(|(o, w)| *o |= w);
            }
        }
    }
}

/// Runs of equal ids up to which a key tile is written run by run (past it, by row compares).
const DOC_RUNS: usize = 8;

/// Runs (query and key sides together) up to which a tile has a [`DocLeaf::tile_key`]: the key
/// stays short (at most 10 values) and the match bits (query run `i`, key run `j` at bit
/// `8i + j`) fit one value.
const KEY_RUNS: usize = 8;

/// Words of the widest tile row (tiles are at most 4096 keys wide).
pub(super) const MAX_WPR: usize = crate::shape::MAX_TILE / 64;
