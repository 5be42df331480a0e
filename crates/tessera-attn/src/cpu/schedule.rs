//! Work items on the thread pool: [`run_items`] runs items group by group, longest first within
//! a group, with pooled per-worker workspaces; [`Geometry`] holds the padded tile and head sizes
//! every kernel shares.
//!
//! Contract: every item runs exactly once on one worker; a worker's workspace comes from the
//! caller's pool (or is made) and goes back to it, so a second call allocates nothing.

use super::tile_matmul;
use super::workspace::WsPool;
use crate::validate::Dims;
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use tessera_plan::Plan;

/// f32 slices of `slab`-sized slabs split into `piece`-sized pieces (slab-major).
pub(crate) fn f32_pieces(v: &mut [f32], slab: usize, piece: usize) -> Vec<&mut [f32]> {
    v.chunks_mut(slab)
        .flat_map(|s| s.chunks_mut(piece))
        .collect()
}

/// Where an item runs in the queue: its group (a (batch, head) pair: items of one group share
/// their K/V or Q tiles) and its cost.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Order {
    pub group: usize,
    pub cost: usize,
}

/// Runs `work` on every item on the current rayon pool: items sorted by group, then by cost
/// (descending, stable), each worker pulling the next item from the shared queue, with a
/// workspace taken from `pool` (or made by `make_ws` when the pool has none) and given back at
/// the end. A worker claims its next item before running the current one and calls `ahead` on it
/// first (cache hints for the next item's inputs, which then load while the current one
/// computes); so each worker holds at most one claimed item that nobody else can take. Group order keeps the tiles a group's items share in cache (a global longest-first
/// order interleaves all heads; measured 3–6% slower on doc-causal, BENCHMARKS.md); longest
/// first within the group keeps the queue's tail short.
pub(crate) fn run_items<T: Send, W: std::any::Any + Send>(
    items: Vec<(Order, T)>,
    pool: &WsPool,
    make_ws: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, T) + Sync,
    ahead: impl Fn(&T) + Sync,
) {
    let mut items = items;
    items.sort_by_key(|(o, _)| (o.group, std::cmp::Reverse(o.cost)));
    let slots: Vec<Mutex<Option<T>>> = items
        .into_iter()
        .map(|(_, t)| Mutex::new(Some(t)))
        .collect();
    let next = AtomicUsize::new(0);
    let workers = rayon::current_num_threads().min(slots.len()).max(1);
    let claim = || loop {
        let slot = slots.get(next.fetch_add(1, Ordering::Relaxed))?;
        if let Some(item) = slot.lock().ok().and_then(|mut g| g.take()) {
            return Some(item);
        }
    };
    (0..workers).into_par_iter().with_max_len(1).for_each(|_| {
        let mut ws: Option<W> = None;
        let mut cur = claim();
        while let Some(item) = cur {
            cur = claim();
            if let Some(n) = &cur {
                ahead(n);
            }
            let w = ws.get_or_insert_with(|| pool.take::<W>().unwrap_or_else(&make_ws));
            work(w, item);
        }
        if let Some(w) = ws {
            pool.give(w);
        }
    });
}

/// Sizes shared by the kernels: tile sides and padded head dims.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub tq: usize,
    pub tk: usize,
    /// `Dqk`, `Dv` rounded up to 16.
    pub dqkp: usize,
    pub dvp: usize,
}

impl Geometry {
    pub(crate) fn new(plan: &Plan, d: &Dims) -> Self {
        Geometry {
            tq: tile_matmul::round_up(plan.tile.q, 16),
            tk: tile_matmul::round_up(plan.tile.kv, 16),
            dqkp: tile_matmul::round_up(d.d_qk, 16),
            dvp: tile_matmul::round_up(d.d_v, 16),
        }
    }
}
