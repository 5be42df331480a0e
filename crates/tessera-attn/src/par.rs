//! Explicit parallelism of one kernel call ([`Par`]) and the thread pools a caller-owned
//! workspace keeps for it ([`PoolCache`]).
//!
//! Contract: a call runs on exactly the threads its [`Par`] names. `Par::Rayon(0)` (the default)
//! is every thread of the rayon pool the caller is in (the global pool unless inside
//! `ThreadPool::install`); `Par::Rayon(n)` and `Par::Seq` (= one thread) run on a pool of that
//! size kept in the caller's workspace (built on first use, reused after: no process-wide state);
//! `Par::Pool(p)` runs on the caller's pool. Results never depend on the thread count.

use tessera_core::{Error, Result};

/// How many threads a call may use.
#[derive(Debug, Clone, Copy, Default)]
pub enum Par<'p> {
    /// One thread.
    Seq,
    /// `n` threads; `0` means every thread of the current rayon pool.
    Rayon(usize),
    /// The caller's pool, all its threads.
    Pool(&'p rayon::ThreadPool),
    /// Every thread of the current rayon pool (`Rayon(0)`).
    #[default]
    Current,
}

/// Thread pools built for [`Par::Seq`] / [`Par::Rayon`] sizes, owned by a workspace.
#[derive(Debug, Default)]
pub struct PoolCache {
    pool: Option<rayon::ThreadPool>,
}

impl Par<'_> {
    /// The number of threads a call on this `Par` runs on, from where it is called.
    pub fn threads(self) -> usize {
        match self {
            Par::Seq => 1,
            Par::Rayon(0) | Par::Current => rayon::current_num_threads(),
            Par::Rayon(n) => n,
            Par::Pool(p) => p.current_num_threads(),
        }
    }

    /// Runs `f` on the threads this `Par` names (see the module contract).
    pub fn run<R: Send>(self, cache: &mut PoolCache, f: impl FnOnce() -> R + Send) -> Result<R> {
        let n = match self {
            Par::Pool(p) => return Ok(p.install(f)),
            Par::Current | Par::Rayon(0) => return Ok(f()),
            Par::Seq => 1,
            Par::Rayon(n) => n,
        };
        if n == rayon::current_num_threads() {
            return Ok(f());
        }
        if cache.pool.as_ref().map(|p| p.current_num_threads()) != Some(n) {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(|i| format!("tessera-{i}"))
                .build()
                .map_err(|e| Error::Internal(format!("cannot start {n} worker threads: {e}")))?;
            cache.pool = Some(pool);
        }
        match &cache.pool {
            Some(p) => Ok(p.install(f)),
            None => Ok(f()),
        }
    }
}
