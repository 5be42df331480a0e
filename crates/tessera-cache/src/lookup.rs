//! What one lookup returns: the plan, where it came from, and the warnings it raised.

use crate::entry::RejectReason;
use std::path::PathBuf;
use std::sync::Arc;
use tessera_plan::{ContractKey, Plan};

/// Where [`PlanCache::get_or_build`](crate::PlanCache::get_or_build) found a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlanSource {
    /// This process's memory LRU.
    Memory,
    /// A valid entry of the disk store (written by this or another process).
    Disk,
    /// Neither held a valid copy: the planner built it (and the cache stored it).
    Built,
}

impl PlanSource {
    /// `memory`, `disk` or `built`.
    pub fn name(self) -> &'static str {
        match self {
            PlanSource::Memory => "memory",
            PlanSource::Disk => "disk",
            PlanSource::Built => "built",
        }
    }

    /// True unless the plan was built by this lookup.
    pub fn is_cached(self) -> bool {
        self != PlanSource::Built
    }
}

impl std::fmt::Display for PlanSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Something the cache could not do as configured; the lookup still succeeded. A cache raises
/// each distinct warning once ([`PlanCache::warnings`](crate::PlanCache::warnings) lists all of
/// them); the library never prints, callers decide (the CLI prints `tessera: warning: {w}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheWarning {
    /// No directory was given and none could be resolved from the environment: memory only.
    NoDirectory,
    /// The directory cannot be created, searched or written: memory only from now on.
    DirectoryUnusable {
        /// The cache directory.
        dir: PathBuf,
        /// The operating system's reason.
        reason: String,
    },
    /// A disk entry failed its checks: it was not used, and the plan was rebuilt and rewritten.
    EntryRejected {
        /// The entry file.
        path: PathBuf,
        /// What was wrong with it.
        reason: RejectReason,
    },
    /// A plan could not be encoded as an entry: kept in memory only.
    NotEncodable {
        /// The plan's contract.
        contract: ContractKey,
        /// The encoder's reason.
        reason: String,
    },
    /// An encoded plan is larger than the whole disk bound: kept in memory only.
    TooLarge {
        /// The plan's contract.
        contract: ContractKey,
        /// Size of its entry.
        bytes: u64,
        /// The cache's size bound.
        max_bytes: u64,
    },
}

impl std::fmt::Display for CacheWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheWarning::NoDirectory => write!(
                f,
                "no plan cache directory (set --cache-dir, TESSERA_CACHE_DIR, XDG_CACHE_HOME or \
                 HOME); caching in memory only"
            ),
            CacheWarning::DirectoryUnusable { dir, reason } => write!(
                f,
                "plan cache directory {} unusable ({reason}); caching in memory only",
                dir.display()
            ),
            CacheWarning::EntryRejected { path, reason } => write!(
                f,
                "plan cache entry {} rejected ({reason}); rebuilt",
                path.display()
            ),
            CacheWarning::NotEncodable { contract, reason } => write!(
                f,
                "plan {contract} could not be encoded for the cache ({reason}); not cached on disk"
            ),
            CacheWarning::TooLarge {
                contract,
                bytes,
                max_bytes,
            } => write!(
                f,
                "plan {contract} is {bytes} bytes, over the cache bound of {max_bytes} bytes; \
                 not cached on disk"
            ),
        }
    }
}

/// The result of one [`PlanCache::get_or_build`](crate::PlanCache::get_or_build).
#[derive(Debug, Clone)]
pub struct Lookup {
    /// The plan of the requested contract.
    pub plan: Arc<Plan>,
    /// Where it came from.
    pub source: PlanSource,
    /// Warnings this lookup raised (new ones only: each distinct warning is raised once per
    /// cache), in order.
    pub warnings: Vec<CacheWarning>,
}
