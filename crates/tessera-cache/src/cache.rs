//! The plan cache itself: memory LRU, disk store, verification and maintenance.

use crate::config::{resolve_dir, CacheConfig};
use crate::entry::{self, Header, RejectReason, HEADER_LEN};
use crate::lookup::{CacheWarning, Lookup, PlanSource};
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime};
use tessera_core::{metrics, Error, Result};
use tessera_mask::Mask;
use tessera_plan::{build_plan, contract_key, ContractKey, Plan, PlanShape, TileShape};

/// Temporary files older than this are leftovers of a crashed writer and are removed on trim.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// What one cache instance has done (the process-wide totals are in `tessera_core::metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheCounters {
    /// Lookups answered from the memory LRU.
    pub memory_hits: u64,
    /// Lookups answered from a valid disk entry.
    pub disk_hits: u64,
    /// Lookups that found no valid copy (rejected entries included).
    pub misses: u64,
    /// Disk entries that failed their checks (each also counted as a miss).
    pub rejects: u64,
    /// Plans built through this cache.
    pub builds: u64,
    /// Bytes read from disk entries.
    pub bytes_read: u64,
    /// Bytes of entries written to disk.
    pub bytes_written: u64,
}

#[derive(Default)]
struct Counters {
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    rejects: AtomicU64,
    builds: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// Size and location of the cache.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Cache directory (`None` when disabled or when no directory could be resolved).
    pub dir: Option<PathBuf>,
    /// Configured off (`--no-cache`).
    pub disabled: bool,
    /// Whether the disk store is in use (false after a degrade to memory only).
    pub disk_active: bool,
    /// Entry files on disk and their total size.
    pub entries: u64,
    /// Total size of the entry files, in bytes.
    pub bytes: u64,
    /// The configured size bound, in bytes.
    pub max_bytes: u64,
    /// Plans held in this process's memory LRU and their heap size.
    pub memory_entries: u64,
    /// Heap bytes of the plans held in memory.
    pub memory_bytes: u64,
}

/// The verdict on one disk entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryReport {
    /// The entry file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// `None` when the entry is valid.
    pub problem: Option<RejectReason>,
}

impl EntryReport {
    /// True when the entry is valid.
    pub fn is_ok(&self) -> bool {
        self.problem.is_none()
    }
}

impl serde::Serialize for EntryReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("EntryReport", 4)?;
        st.serialize_field("path", &self.path)?;
        st.serialize_field("bytes", &self.bytes)?;
        st.serialize_field("ok", &self.is_ok())?;
        st.serialize_field("reason", &self.problem.as_ref().map(|r| r.to_string()))?;
        st.end()
    }
}

/// Result of [`PlanCache::verify`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyReport {
    /// Cache directory checked (`None` when disabled or unresolvable).
    pub dir: Option<PathBuf>,
    /// Valid entries.
    pub ok: u64,
    /// Bad entries.
    pub bad: u64,
    /// Every entry checked, in file-name order.
    pub entries: Vec<EntryReport>,
}

impl VerifyReport {
    /// True when no entry is bad.
    pub fn all_ok(&self) -> bool {
        self.bad == 0
    }
}

/// Result of [`PlanCache::clear`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClearReport {
    /// Cache directory cleared (`None` when disabled or unresolvable).
    pub dir: Option<PathBuf>,
    /// Entry (and leftover temporary) files removed, and their size.
    pub removed: u64,
    /// Total size of the removed files, in bytes.
    pub bytes: u64,
}

struct MemEntry {
    plan: Arc<Plan>,
    bytes: u64,
    last_use: u64,
}

#[derive(Default)]
struct Lru {
    map: HashMap<ContractKey, MemEntry>,
    tick: u64,
    bytes: u64,
}

/// Plan cache: memory LRU, then checked disk entries, then the planner. See the crate docs.
pub struct PlanCache {
    /// Resolved cache root (`None` when disabled or unresolvable).
    dir: Option<PathBuf>,
    disabled: bool,
    max_bytes: u64,
    /// Lazily set on first disk use: whether `plans/` exists or could be created.
    disk_ready: OnceLock<bool>,
    /// Set when a write failed: the rest of the process runs memory-only.
    disk_off: AtomicBool,
    memory: Mutex<Lru>,
    warnings: Mutex<Vec<CacheWarning>>,
    counters: Counters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Outcome of reading one entry file.
enum Load {
    Hit(Box<Plan>),
    Missing,
    Rejected(RejectReason),
    /// The directory itself cannot be searched: not an entry fault.
    DirUnusable(io::Error),
}

impl PlanCache {
    /// A cache as configured. Touches no file: the directory is created on first use.
    pub fn new(config: CacheConfig) -> Self {
        let dir = if config.disabled {
            None
        } else {
            resolve_dir(config.dir.as_deref())
        };
        let cache = PlanCache {
            dir,
            disabled: config.disabled,
            max_bytes: config.max_bytes,
            disk_ready: OnceLock::new(),
            disk_off: AtomicBool::new(false),
            memory: Mutex::new(Lru::default()),
            warnings: Mutex::new(Vec::new()),
            counters: Counters::default(),
        };
        if cache.dir.is_none() && !cache.disabled {
            cache.warn(&mut Vec::new(), CacheWarning::NoDirectory);
        }
        cache
    }

    /// A cache that never touches the disk.
    pub fn memory_only() -> Self {
        Self::new(CacheConfig {
            disabled: true,
            ..CacheConfig::default()
        })
    }

    /// The cache directory (`None` when disabled or unresolvable).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Whether the cache was configured off (`--no-cache`).
    pub fn is_disabled(&self) -> bool {
        self.disabled
    }

    /// The size bound of the disk store and of the memory LRU, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether the disk store is (still) in use. Probes the directory on first call; a fault
    /// found then is recorded in [`warnings`](Self::warnings).
    pub fn disk_active(&self) -> bool {
        self.plans_dir(&mut Vec::new()).is_some()
    }

    /// Path of the entry file of `key` (whether or not it exists).
    pub fn entry_path(&self, key: &ContractKey) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join("plans").join(entry::file_name(key)))
    }

    /// Every warning issued so far, in order, each once: those of every lookup, plus
    /// [`CacheWarning::NoDirectory`] from construction and faults found by
    /// [`disk_active`](Self::disk_active).
    pub fn warnings(&self) -> Vec<CacheWarning> {
        lock(&self.warnings).clone()
    }

    /// This instance's counters.
    pub fn counters(&self) -> CacheCounters {
        let c = &self.counters;
        CacheCounters {
            memory_hits: c.memory_hits.load(Relaxed),
            disk_hits: c.disk_hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            rejects: c.rejects.load(Relaxed),
            builds: c.builds.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
        }
    }

    /// The plan of (`mask`, `shape`, `tile`): from memory, else a valid disk entry, else built
    /// (and then stored), with where it came from and the warnings this lookup raised. Errors
    /// only when building fails (invalid mask or shape); warnings raised before such a failure
    /// are still in [`warnings`](Self::warnings).
    pub fn get_or_build(&self, mask: &Mask, shape: PlanShape, tile: TileShape) -> Result<Lookup> {
        let key = contract_key(mask, shape, tile);
        self.get_or_build_with(key, || build_plan(mask, shape, tile))
    }

    /// [`get_or_build`](Self::get_or_build) for a precomputed `key`; `build` must return the plan
    /// of that contract (an internal error otherwise).
    pub fn get_or_build_with(
        &self,
        key: ContractKey,
        build: impl FnOnce() -> Result<Plan>,
    ) -> Result<Lookup> {
        let mut warnings = Vec::new();
        let found = |plan, source, warnings| Lookup {
            plan,
            source,
            warnings,
        };
        if let Some(plan) = self.memory_get(&key) {
            metrics::record_memory_hit();
            self.counters.memory_hits.fetch_add(1, Relaxed);
            return Ok(found(plan, PlanSource::Memory, warnings));
        }
        if let Some(plans) = self.plans_dir(&mut warnings) {
            let path = plans.join(entry::file_name(&key));
            let (load, read) = read_entry(&path, &key, true);
            if read > 0 {
                metrics::record_bytes_read(read);
                self.counters.bytes_read.fetch_add(read, Relaxed);
            }
            match load {
                Load::Hit(plan) => {
                    metrics::record_disk_hit();
                    self.counters.disk_hits.fetch_add(1, Relaxed);
                    let plan = Arc::new(*plan);
                    self.memory_put(key, plan.clone());
                    return Ok(found(plan, PlanSource::Disk, warnings));
                }
                Load::Missing => {}
                Load::DirUnusable(e) => self.degrade(&mut warnings, e),
                Load::Rejected(reason) => {
                    metrics::record_reject();
                    self.counters.rejects.fetch_add(1, Relaxed);
                    self.warn(&mut warnings, CacheWarning::EntryRejected { path, reason });
                }
            }
        }
        metrics::record_miss();
        self.counters.misses.fetch_add(1, Relaxed);
        let plan = build()?;
        self.counters.builds.fetch_add(1, Relaxed);
        if plan.contract != key {
            return Err(Error::Internal(format!(
                "plan cache: built plan has contract {}, expected {}",
                plan.contract, key
            )));
        }
        // A plan of tile states only is not the contract's plan.
        plan.require_masks("the plan cache")?;
        let plan = Arc::new(plan);
        self.memory_put(key, plan.clone());
        if let Some(plans) = self.plans_dir(&mut warnings) {
            self.store(&mut warnings, &plans, &plan);
        }
        Ok(found(plan, PlanSource::Built, warnings))
    }

    /// Entry count and size on disk, plus the memory LRU of this process. Creates nothing.
    pub fn stats(&self) -> CacheStats {
        let (entries, bytes) = match self.dir.as_ref() {
            Some(d) if !self.disabled => list_dir(&d.join("plans"))
                .unwrap_or_default()
                .iter()
                .filter(|f| f.kind == FileKind::Entry)
                .fold((0, 0), |(n, b), f| (n + 1, b + f.len)),
            _ => (0, 0),
        };
        let mem = lock(&self.memory);
        CacheStats {
            dir: self.dir.clone(),
            disabled: self.disabled,
            disk_active: self.dir.is_some()
                && !self.disk_off.load(Relaxed)
                && self.disk_ready.get().copied().unwrap_or(true),
            entries,
            bytes,
            max_bytes: self.max_bytes,
            memory_entries: mem.map.len() as u64,
            memory_bytes: mem.bytes,
        }
    }

    /// Checks every disk entry (`plans/*.tplan`) fully (header, checksum, decode, contract against
    /// its file name) without changing anything. Temporary files of in-flight writers and files
    /// that are not entries are skipped.
    pub fn verify(&self) -> Result<VerifyReport> {
        let Some((dir, files)) = self.listing()? else {
            return Ok(VerifyReport::default());
        };
        let mut report = VerifyReport {
            dir,
            ..VerifyReport::default()
        };
        for f in files.into_iter().filter(|f| f.kind == FileKind::Entry) {
            let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned());
            let problem = match name.as_deref().and_then(entry::key_from_file_name) {
                None => Some(RejectReason::BadName),
                Some(key) => match read_entry(&f.path, &key, false).0 {
                    Load::Hit(_) => None,
                    Load::Missing => continue, // removed meanwhile
                    Load::Rejected(r) => Some(r),
                    Load::DirUnusable(e) => Some(RejectReason::Unreadable(e.to_string())),
                },
            };
            if problem.is_some() {
                report.bad += 1;
            } else {
                report.ok += 1;
            }
            report.entries.push(EntryReport {
                path: f.path,
                bytes: f.len,
                problem,
            });
        }
        Ok(report)
    }

    /// Removes every entry and leftover temporary file from disk (other files in `plans/` are
    /// left alone) and empties the memory LRU.
    pub fn clear(&self) -> Result<ClearReport> {
        {
            let mut mem = lock(&self.memory);
            mem.map.clear();
            mem.bytes = 0;
        }
        let Some((dir, files)) = self.listing()? else {
            return Ok(ClearReport::default());
        };
        let mut report = ClearReport {
            dir,
            ..ClearReport::default()
        };
        for f in files
            .into_iter()
            .filter(|f| matches!(f.kind, FileKind::Entry | FileKind::Temp))
        {
            match remove_any(&f.path) {
                Ok(()) => {
                    report.removed += 1;
                    report.bytes += f.len;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&f.path, e)),
            }
        }
        Ok(report)
    }

    // ---- internals ----

    /// The cache directory and the files of its `plans/`; `None` when the disk is configured off.
    fn listing(&self) -> Result<Option<(Option<PathBuf>, Vec<Listed>)>> {
        let Some(dir) = self.dir.as_ref().filter(|_| !self.disabled) else {
            return Ok(None);
        };
        let plans = dir.join("plans");
        let files = list_dir(&plans).map_err(|e| Error::io(&plans, e))?;
        Ok(Some((Some(dir.clone()), files)))
    }

    /// Raises `w` into `out` (the current lookup's warnings) unless this cache raised it before.
    fn warn(&self, out: &mut Vec<CacheWarning>, w: CacheWarning) {
        let mut all = lock(&self.warnings);
        if !all.contains(&w) {
            all.push(w.clone());
            out.push(w);
        }
    }

    /// Turns the disk store off for the rest of the process, with a warning.
    fn degrade(&self, out: &mut Vec<CacheWarning>, why: impl std::fmt::Display) {
        self.disk_off.store(true, Relaxed);
        let dir = self.dir.clone().unwrap_or_default();
        let reason = why.to_string();
        self.warn(out, CacheWarning::DirectoryUnusable { dir, reason });
    }

    /// `<dir>/plans` when the disk store is usable; creates it on first call.
    fn plans_dir(&self, out: &mut Vec<CacheWarning>) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        if self.disabled || self.disk_off.load(Relaxed) {
            return None;
        }
        let plans = dir.join("plans");
        let ready = *self.disk_ready.get_or_init(|| {
            // Only creation is probed: entries are opened by name, so a directory that cannot be
            // listed still works, and one that cannot be searched or written is detected (and
            // degraded) on first use.
            match fs::create_dir_all(&plans) {
                Ok(()) => true,
                Err(e) => {
                    self.degrade(out, e);
                    false
                }
            }
        });
        (ready && !self.disk_off.load(Relaxed)).then_some(plans)
    }

    fn memory_get(&self, key: &ContractKey) -> Option<Arc<Plan>> {
        let mut mem = lock(&self.memory);
        mem.tick += 1;
        let tick = mem.tick;
        let e = mem.map.get_mut(key)?;
        e.last_use = tick;
        Some(e.plan.clone())
    }

    fn memory_put(&self, key: ContractKey, plan: Arc<Plan>) {
        let bytes = plan.heap_bytes() + plan.mask.len() as u64;
        let mut mem = lock(&self.memory);
        mem.tick += 1;
        let tick = mem.tick;
        if let Some(old) = mem.map.insert(
            key,
            MemEntry {
                plan,
                bytes,
                last_use: tick,
            },
        ) {
            mem.bytes -= old.bytes;
        }
        mem.bytes += bytes;
        while mem.bytes > self.max_bytes && mem.map.len() > 1 {
            let oldest = mem
                .map
                .iter()
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k)
                .expect("non-empty");
            let e = mem.map.remove(&oldest).expect("present");
            mem.bytes -= e.bytes;
        }
    }

    /// Writes `plan`'s entry atomically, then trims the store to the size bound.
    fn store(&self, out: &mut Vec<CacheWarning>, plans: &Path, plan: &Plan) {
        let contract = plan.contract;
        let encoded = match entry::encode_parts(plan) {
            Ok(e) => e,
            Err(e) => {
                let reason = e.to_string();
                return self.warn(out, CacheWarning::NotEncodable { contract, reason });
            }
        };
        let len = encoded.len();
        if len > self.max_bytes {
            let (bytes, max_bytes) = (len, self.max_bytes);
            let w = CacheWarning::TooLarge {
                contract,
                bytes,
                max_bytes,
            };
            return self.warn(out, w);
        }
        let path = plans.join(entry::file_name(&contract));
        if let Err(e) = write_entry(&path, &encoded.parts()) {
            return self.degrade(out, e);
        }
        metrics::record_bytes_written(len);
        self.counters.bytes_written.fetch_add(len, Relaxed);
        self.trim(plans, &path);
    }

    /// Deletes least recently used entries (oldest mtime first, never `keep`) until the store
    /// fits in `max_bytes`; also removes stale temporary files.
    fn trim(&self, plans: &Path, keep: &Path) {
        let Ok(files) = list_dir(plans) else { return };
        let now = SystemTime::now();
        let mut entries = Vec::new();
        for f in files {
            match f.kind {
                FileKind::Entry => entries.push(f),
                FileKind::Temp => {
                    let age = f.mtime.and_then(|m| now.duration_since(m).ok());
                    if age.is_some_and(|a| a > STALE_TEMP) {
                        let _ = fs::remove_file(&f.path);
                    }
                }
                FileKind::Other => {}
            }
        }
        let mut total: u64 = entries.iter().map(|f| f.len).sum();
        if total <= self.max_bytes {
            return;
        }
        entries.sort_by_key(|f| f.mtime.unwrap_or(SystemTime::UNIX_EPOCH));
        for f in entries {
            if total <= self.max_bytes {
                break;
            }
            if f.path == keep {
                continue;
            }
            match remove_any(&f.path) {
                // Gone already: another process evicted or replaced it.
                Ok(()) | Err(_) => total = total.saturating_sub(f.len),
            }
        }
    }
}

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanCache")
            .field("dir", &self.dir)
            .field("disabled", &self.disabled)
            .field("max_bytes", &self.max_bytes)
            .field("counters", &self.counters())
            .finish_non_exhaustive()
    }
}

/// Reads and checks the entry at `path` for `key`; also returns how many bytes were read.
/// With `touch`, a valid entry's mtime is set to now (the LRU clock).
fn read_entry(path: &Path, key: &ContractKey, touch: bool) -> (Load, u64) {
    let unreadable = |e: io::Error| Load::Rejected(RejectReason::Unreadable(e.to_string()));
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return (Load::Missing, 0),
        // Tell an unreadable entry from a directory that cannot be searched.
        Err(e) => {
            return match fs::symlink_metadata(path) {
                Ok(_) => (unreadable(e), 0),
                Err(m) if m.kind() == io::ErrorKind::NotFound => (Load::Missing, 0),
                Err(_) => (Load::DirUnusable(e), 0),
            }
        }
    };
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => return (unreadable(e), 0),
    };
    if !meta.is_file() {
        return (Load::Rejected(RejectReason::NotAFile), 0);
    }
    let mut head = Vec::with_capacity(HEADER_LEN);
    if let Err(e) = (&mut file).take(HEADER_LEN as u64).read_to_end(&mut head) {
        return (unreadable(e), head.len() as u64);
    }
    let mut read = head.len() as u64;
    let header = match Header::parse(&head, key) {
        Ok(h) => h,
        Err(r) => return (Load::Rejected(r), read),
    };
    // Compare lengths before reading, so a bogus header never makes us read a huge file.
    let present = meta.len().saturating_sub(HEADER_LEN as u64);
    if present != header.payload_len {
        return (
            Load::Rejected(RejectReason::Length {
                header: header.payload_len,
                actual: present,
            }),
            read,
        );
    }
    match entry::read_payload(&mut file, &header, key, &mut read) {
        Ok(plan) => {
            if touch {
                // Best effort: a failed touch only makes the entry look older to the evictor.
                let _ = file.set_modified(SystemTime::now());
            }
            (Load::Hit(Box::new(plan)), read)
        }
        Err(r) => (Load::Rejected(r), read),
    }
}

/// Writes `parts` atomically to `path` (unsynced: a torn entry fails its checksum and is
/// rebuilt). A directory squatting on the entry's name is removed and the write retried once.
fn write_entry(path: &Path, parts: &[&[u8]]) -> Result<()> {
    let write = || {
        tessera_io::atomic_write_with(path, tessera_io::Durability::Unsynced, |w| {
            parts
                .iter()
                .try_for_each(|p| w.write_all(p))
                .map_err(|e| Error::io(path, e))
        })
    };
    match write() {
        Err(_) if fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) => {
            fs::remove_dir_all(path).map_err(|e| Error::io(path, e))?;
            write()
        }
        res => res,
    }
}

/// Removes a file, link, or (entry-named) directory.
fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileKind {
    /// `*.tplan` (any file type).
    Entry,
    /// `.<name>.tmp.<pid>.<n>` of a writer.
    Temp,
    Other,
}

struct Listed {
    path: PathBuf,
    kind: FileKind,
    len: u64,
    mtime: Option<SystemTime>,
}

/// Lists `plans`; a missing directory lists as empty.
fn list_dir(plans: &Path) -> io::Result<Vec<Listed>> {
    let rd = match fs::read_dir(plans) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for de in rd {
        let de = de?;
        let name = de.file_name().to_string_lossy().into_owned();
        let kind = if name.starts_with('.') && name.contains(".tplan.tmp.") {
            FileKind::Temp
        } else if name.ends_with(".tplan") && !name.starts_with('.') {
            FileKind::Entry
        } else {
            FileKind::Other
        };
        // The entry may vanish between listing and stat (a concurrent evictor).
        let meta = match fs::symlink_metadata(de.path()) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        out.push(Listed {
            path: de.path(),
            kind,
            len: if meta.is_file() { meta.len() } else { 0 },
            mtime: meta.modified().ok(),
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
