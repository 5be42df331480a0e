//! Persistent plan cache: contract key → in-memory LRU → checked on-disk entries (docs/semantics.md#plan-cache).
//!
//! Contract:
//! - [`PlanCache::get_or_build`] returns the plan of a contract, looking in memory first, then on
//!   disk, and building it (then storing it in both) only when neither holds a valid copy, as a
//!   [`Lookup`]: the plan, its [`PlanSource`] (memory / disk / built) and the [`CacheWarning`]s
//!   the lookup raised. It is `Sync`: one cache may serve many threads, and many processes may
//!   share one directory. The library never prints: warnings are returned, the caller reports
//!   them.
//! - Directory: an explicit directory (CLI `--cache-dir`), else `$TESSERA_CACHE_DIR`, else
//!   `$XDG_CACHE_HOME/tessera` (absolute values only, as the XDG spec says), else
//!   `$HOME/.cache/tessera` ([`resolve_dir`]). [`CacheConfig::disabled`] (`--no-cache`) turns the
//!   disk off entirely: nothing is read or written there; the memory cache still works.
//! - Entries live in `<dir>/plans/<64 hex digits of the contract key>.tplan`: an 84-byte header
//!   (magic, [`PLAN_FORMAT_VERSION`](tessera_plan::PLAN_FORMAT_VERSION), the full 32-byte key,
//!   payload length, BLAKE3 of the payload; see [`entry`]) followed by the payload: the
//!   postcard-encoded [`Plan`](tessera_plan::Plan), its bulk partial-mask words stored raw ahead
//!   of the postcard part (postcard varints made loading slower than planning). A load checks all
//!   of it, then that the decoded plan's contract and format version are the requested ones. Any failure is a *reject*: counted
//!   (`metrics::record_reject`), returned once as a [`CacheWarning::EntryRejected`], rebuilt and
//!   rewritten; a bad entry is never used and never passed off as a plain miss.
//! - Writes are atomic ([`tessera_io::atomic_write_with`], unsynced): a uniquely named temporary
//!   file in `plans/` (pid + per-process counter) renamed over the entry. Concurrent writers of one key each rename a complete, identical file,
//!   so the last rename wins and readers see either no entry or a whole one. Files are not fsynced:
//!   an entry torn by a power failure fails its checksum and is rebuilt like any other bad entry.
//! - Size bound: after each write the disk store is trimmed to `max_bytes` (default 1 GiB) by
//!   deleting the entries with the oldest modification time. Every disk hit sets the entry's mtime
//!   to now, so mtime order is least-recently-*used* order, shared by all processes without an
//!   index file. An entry larger than `max_bytes` on its own is not written. The memory LRU is
//!   bounded by the same number of bytes (always keeping the most recent plan).
//! - An unusable directory (cannot be created, searched or written) degrades the cache to memory
//!   only, with one [`CacheWarning::DirectoryUnusable`]; that is a directory fault, not an entry
//!   reject. An entry that exists
//!   but cannot be read (permissions, a directory in its place) is a reject like a corrupt one.
//! - Two threads of one process missing the same key at once may both build it; the plans are
//!   equal and the second write replaces the first. Each distinct warning is raised once per
//!   cache (in the [`Lookup`] that hit it) and kept for [`PlanCache::warnings`].
//! - Metrics: memory hits, disk hits, misses (every lookup that found no valid copy, rejected
//!   entries included, so `memory_hits + disk_hits + misses` = lookups), rejects, bytes read and
//!   written go to `tessera_core::metrics` and to per-cache [`CacheCounters`]. Plans built and
//!   build time are recorded by the planner itself.
//!
//! ```
//! use tessera_cache::{CacheConfig, PlanCache, PlanSource};
//! use tessera_mask::Mask;
//! use tessera_plan::{PlanShape, TileShape};
//!
//! let dir = tempfile::tempdir()?;
//! let config = CacheConfig {
//!     dir: Some(dir.path().to_path_buf()),
//!     ..CacheConfig::default()
//! };
//! let (mask, shape, tile) = (Mask::causal(), PlanShape::new(1, 1, 4096, 4096)?, TileShape::default());
//! let first = PlanCache::new(config.clone()).get_or_build(&mask, shape, tile)?;
//! assert_eq!(first.source, PlanSource::Built);
//! // A second cache on the same directory (as in a second process) loads it from disk, then
//! // answers from memory.
//! let cache = PlanCache::new(config);
//! let again = cache.get_or_build(&mask, shape, tile)?;
//! assert_eq!((again.source, again.warnings.len()), (PlanSource::Disk, 0));
//! assert_eq!(cache.get_or_build(&mask, shape, tile)?.source, PlanSource::Memory);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cache;
mod config;
pub mod entry;
mod lookup;

pub use cache::{CacheCounters, CacheStats, ClearReport, EntryReport, PlanCache, VerifyReport};
pub use config::{resolve_dir, resolve_dir_with, CacheConfig, DEFAULT_MAX_BYTES};
pub use entry::RejectReason;
pub use lookup::{CacheWarning, Lookup, PlanSource};
