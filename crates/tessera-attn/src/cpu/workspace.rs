//! The CPU backend's caller-owned workspace ([`CpuWorkspace`]): the containers the kernels
//! fill, below every kernel (each pass states the bytes it uses: `forward::select::forward_bytes`,
//! `backward::backward_bytes`).
//!
//! Contract: everything a CPU call needs besides its inputs and outputs lives here and is
//! reused by the next call: the per-worker tile workspaces (kept in a pool while their geometry
//! — tile shape and head dims — stays the same, dropped when it changes), the shared buffers
//! (backward Δ, dQ scratch and carries, per-item max logits, the bf16 forward's packed K/V), and
//! the thread pool of a [`Par::Seq`](crate::Par::Seq)/[`Par::Rayon`](crate::Par::Rayon) call.
//! Nothing is process-wide. A workspace serves one call at a time (`&mut`); concurrent calls
//! use one workspace each.

use crate::cpu::prepare::Prep;
use crate::par::PoolCache;
use crate::validate::Dims;
use std::any::Any;
use std::sync::Mutex;
use tessera_plan::TileShape;

/// Scratch memory of CPU attention calls, owned by the caller and reused across calls.
#[derive(Default)]
pub struct CpuWorkspace {
    pools: PoolCache,
    key: Option<(TileShape, usize, usize)>,
    items: WsPool,
    bufs: Bufs,
}

impl std::fmt::Debug for CpuWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuWorkspace")
            .field("geometry", &self.key)
            .field("shared_bytes", &self.bufs.bytes())
            .finish_non_exhaustive()
    }
}

impl CpuWorkspace {
    /// An empty workspace (it grows on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// The thread-pool cache and the rest, for a call with this plan and these dims: pooled
    /// per-worker workspaces of another geometry are dropped first.
    pub(crate) fn split(&mut self, prep: &Prep<'_>, d: &Dims) -> (&mut PoolCache, Rest<'_>) {
        let key = (prep.plan.tile, d.d_qk, d.d_v);
        if self.key != Some(key) {
            self.items = WsPool::default();
            self.key = Some(key);
        }
        (
            &mut self.pools,
            Rest {
                items: &self.items,
                bufs: &mut self.bufs,
            },
        )
    }
}

/// The per-call part of a workspace: the per-worker pool and the shared buffers.
pub(crate) struct Rest<'a> {
    pub(crate) items: &'a WsPool,
    pub(crate) bufs: &'a mut Bufs,
}

/// Shared buffers, grown to the largest call seen.
#[derive(Default)]
pub(crate) struct Bufs {
    pub(crate) delta: Vec<f32>,
    pub(crate) scratch: Vec<f32>,
    pub(crate) carry: Vec<f32>,
    pub(crate) maxes: Vec<f32>,
    pub(crate) kpack: Vec<u32>,
    pub(crate) vpack: Vec<u32>,
}

impl Bufs {
    fn bytes(&self) -> usize {
        4 * (self.delta.len()
            + self.scratch.len()
            + self.carry.len()
            + self.maxes.len()
            + self.kpack.len()
            + self.vpack.len())
    }
}

/// The first `n` elements of `v`, growing it when shorter (contents unspecified).
pub(crate) fn grown<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// Per-worker workspaces of any kernel type, handed out to the workers of a call and given back.
#[derive(Default)]
pub(crate) struct WsPool {
    free: Mutex<Vec<Box<dyn Any + Send>>>,
}

impl WsPool {
    /// A pooled workspace of type `W`, if one is free.
    pub(crate) fn take<W: Any + Send>(&self) -> Option<W> {
        let mut g = self.free.lock().ok()?;
        let i = g.iter().position(|b| b.is::<W>())?;
        g.swap_remove(i).downcast::<W>().ok().map(|b| *b)
    }

    /// Returns a workspace to the pool.
    pub(crate) fn give<W: Any + Send>(&self, w: W) {
        if let Ok(mut g) = self.free.lock() {
            g.push(Box::new(w));
        }
    }
}
