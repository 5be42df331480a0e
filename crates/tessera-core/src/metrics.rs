//! Process-wide run metrics.
//!
//! Contract: counters only ever increase during a process; [`snapshot`] reads them all at once
//! into a plain serializable [`MetricsReport`]. Recording is cheap (relaxed atomics, one short
//! lock per kernel call) so it can stay on in production. Work run inside [`unrecorded`] (a
//! library's own calibration, such as the CPU kernel-path measurement) records nothing from
//! that thread, so the report counts the caller's work only.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

static PLANS_BUILT: AtomicU64 = AtomicU64::new(0);
static PLAN_BUILD_NS: AtomicU64 = AtomicU64::new(0);
static MEMORY_HITS: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);
static REJECTS: AtomicU64 = AtomicU64::new(0);
static BYTES_READ: AtomicU64 = AtomicU64::new(0);
static BYTES_WRITTEN: AtomicU64 = AtomicU64::new(0);
static KERNELS: Mutex<BTreeMap<String, KernelStat>> = Mutex::new(BTreeMap::new());
static COUNTERS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// Whether this thread is inside [`unrecorded`].
    static MUTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with recording off on this thread (restored afterwards, also if `f` panics).
pub fn unrecorded<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            MUTED.with(|m| m.set(self.0));
        }
    }
    let _restore = Restore(MUTED.with(|m| m.replace(true)));
    f()
}

/// Whether recording is on for this thread.
fn on() -> bool {
    !MUTED.with(|m| m.get())
}

/// Calls and total wall time of one kernel variant.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelStat {
    /// Number of calls.
    pub calls: u64,
    /// Total wall time of those calls in milliseconds.
    pub total_ms: f64,
}

/// A point-in-time copy of every counter.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricsReport {
    /// Plans built by the planner (cache misses that built).
    pub plans_built: u64,
    /// Total planner time in milliseconds.
    pub plan_build_ms: f64,
    /// Plan-cache lookups answered from memory.
    pub memory_hits: u64,
    /// Plan-cache lookups answered from a valid disk entry.
    pub disk_hits: u64,
    /// Plan-cache lookups that found no valid copy (rejected entries included).
    pub misses: u64,
    /// Disk entries rejected (corrupt, wrong version or contract, unreadable).
    pub rejects: u64,
    /// Bytes read from the disk cache.
    pub bytes_read: u64,
    /// Bytes written to the disk cache.
    pub bytes_written: u64,
    /// Kernel calls by variant name (for example `cpu.forward.f32.avx512`).
    pub kernels: BTreeMap<String, KernelStat>,
    /// Other named counters (for example `cuda.nvrtc_compiles`).
    pub counters: BTreeMap<String, u64>,
}

/// Records one plan build and how long it took.
pub fn record_plan_built(elapsed: Duration) {
    if !on() {
        return;
    }
    PLANS_BUILT.fetch_add(1, Relaxed);
    PLAN_BUILD_NS.fetch_add(elapsed.as_nanos() as u64, Relaxed);
}

/// Counts one plan-cache memory hit.
pub fn record_memory_hit() {
    if !on() {
        return;
    }
    MEMORY_HITS.fetch_add(1, Relaxed);
}

/// Counts one plan-cache disk hit.
pub fn record_disk_hit() {
    if !on() {
        return;
    }
    DISK_HITS.fetch_add(1, Relaxed);
}

/// Counts one plan-cache miss.
pub fn record_miss() {
    if !on() {
        return;
    }
    MISSES.fetch_add(1, Relaxed);
}

/// Counts one rejected disk entry.
pub fn record_reject() {
    if !on() {
        return;
    }
    REJECTS.fetch_add(1, Relaxed);
}

/// Adds `n` bytes read from the disk cache.
pub fn record_bytes_read(n: u64) {
    if !on() {
        return;
    }
    BYTES_READ.fetch_add(n, Relaxed);
}

/// Adds `n` bytes written to the disk cache.
pub fn record_bytes_written(n: u64) {
    if !on() {
        return;
    }
    BYTES_WRITTEN.fetch_add(n, Relaxed);
}

/// Records one call of a kernel variant and its wall time.
pub fn record_kernel(variant: &str, elapsed: Duration) {
    if !on() {
        return;
    }
    if let Ok(mut map) = KERNELS.lock() {
        let stat = map.entry(variant.to_string()).or_default();
        stat.calls += 1;
        stat.total_ms += elapsed.as_secs_f64() * 1e3;
    }
}

/// Adds `n` to a named counter.
pub fn add_counter(name: &str, n: u64) {
    if !on() {
        return;
    }
    if let Ok(mut map) = COUNTERS.lock() {
        *map.entry(name.to_string()).or_default() += n;
    }
}

/// Reads every counter.
pub fn snapshot() -> MetricsReport {
    MetricsReport {
        plans_built: PLANS_BUILT.load(Relaxed),
        plan_build_ms: PLAN_BUILD_NS.load(Relaxed) as f64 / 1e6,
        memory_hits: MEMORY_HITS.load(Relaxed),
        disk_hits: DISK_HITS.load(Relaxed),
        misses: MISSES.load(Relaxed),
        rejects: REJECTS.load(Relaxed),
        bytes_read: BYTES_READ.load(Relaxed),
        bytes_written: BYTES_WRITTEN.load(Relaxed),
        kernels: KERNELS.lock().map(|m| m.clone()).unwrap_or_default(),
        counters: COUNTERS.lock().map(|m| m.clone()).unwrap_or_default(),
    }
}

impl MetricsReport {
    /// Human-readable multi-line report.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "plans built: {} ({:.3} ms)\nplan cache: {} memory hits, {} disk hits, {} misses, {} rejects\ncache bytes: {} read, {} written\n",
            self.plans_built,
            self.plan_build_ms,
            self.memory_hits,
            self.disk_hits,
            self.misses,
            self.rejects,
            self.bytes_read,
            self.bytes_written
        );
        for (name, k) in &self.kernels {
            s.push_str(&format!(
                "kernel {name}: {} calls, {:.3} ms\n",
                k.calls, k.total_ms
            ));
        }
        for (name, n) in &self.counters {
            s.push_str(&format!("{name}: {n}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrecorded_work_is_not_counted_and_recording_resumes() {
        let name = "test.unrecorded";
        let calls = || snapshot().kernels.get(name).map_or(0, |k| k.calls);
        unrecorded(|| record_kernel(name, Duration::from_millis(1)));
        assert_eq!(calls(), 0);
        record_kernel(name, Duration::from_millis(1));
        assert_eq!(calls(), 1);
        let r = std::panic::catch_unwind(|| unrecorded(|| panic!("inside unrecorded")));
        assert!(r.is_err());
        record_kernel(name, Duration::from_millis(1));
        assert_eq!(calls(), 2, "recording is back on after a panic");
    }
}
