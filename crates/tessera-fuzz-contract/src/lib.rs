//! The fuzz contract of Tessera: one entry point per input surface, taking arbitrary bytes,
//! shared by the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`, nightly; each is one line that
//! calls an entry here) and the stable regression replay of `tests/corpus/<target>/`
//! (`tests/corpus_replay.rs` of this crate, run by `cargo test --workspace`). The surfaces and
//! the fuzzing done so far are described in `docs/reliability.md`.
//!
//! Contract: each entry drives one surface the way a user's input reaches it and **panics only
//! when a contract is broken**:
//!
//! - a user-facing failure must be a user error ([`Error::is_user_error`]), with a message,
//!   never [`Error::Internal`];
//! - what is accepted must satisfy the surface's own contract (round trips, agreement with
//!   brute force, structural invariants), documented on each entry with its input layout;
//! - under [`TrackingAlloc`] (installed as the global allocator by every fuzz target and by
//!   the replay test) a reader must not allocate more than a small multiple of its input.
//!
//! [`TARGETS`] names every entry by its fuzz target (and corpus directory); [`seeds`] gives
//! valid starting inputs. This is test infrastructure (`publish = false`), not part of
//! Tessera's API: it may `expect` on what an entry itself built, since a panic here *is* the
//! report of a broken contract.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use tessera_core::{Error, Result};
use tessera_export::{flex, splash, FlexArrays, SplashArrays};
use tessera_mask::{parse, BlockSelection, DenseMask, Mask, Resolver, SegmentIds, Segments};
use tessera_plan::{
    build_plan, build_plan_within, build_tile_states, Plan, PlanShape, TileShape, TileState,
};

// ---------------------------------------------------------------------------------------------
// Allocation tracking.

/// A global allocator that counts the bytes live on the current thread and their peak, so an
/// entry can assert how much a reader allocated. Install with
/// `#[global_allocator] static A: TrackingAlloc = TrackingAlloc;`.
pub struct TrackingAlloc;

static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    // Const-initialized cells without destructors: usable from inside the allocator.
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn grow(n: usize) {
    let _ = LIVE.try_with(|l| {
        let v = l.get().saturating_add(n);
        l.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

fn shrink(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(n)));
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are thread-local cells.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) };
        shrink(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrink(layout.size());
            grow(new_size);
        }
        p
    }
}

/// Runs `f` and returns its result with the peak of the bytes it allocated on this thread
/// beyond what was live before (`None` when [`TrackingAlloc`] is not the global allocator).
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, Option<usize>) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get).saturating_sub(base);
    (r, INSTALLED.load(Ordering::Relaxed).then_some(peak))
}

/// Asserts that `f` (a reader of `input_len` bytes) allocates at most `factor * input_len +
/// slack` bytes at its peak.
fn bounded<T>(what: &str, input_len: usize, factor: usize, f: impl FnOnce() -> T) -> T {
    const SLACK: usize = 1 << 20;
    let (r, peak) = peak_during(f);
    if let Some(peak) = peak {
        let limit = factor * input_len + SLACK;
        assert!(
            peak <= limit,
            "{what}: allocated {peak} bytes for {input_len} bytes of input (limit {limit})"
        );
    }
    r
}

/// A failure on hostile input must be the user's, with a message; `Internal` is a bug.
fn user_error(what: &str, e: &Error) {
    assert!(e.is_user_error(), "{what}: internal error on input: {e}");
    assert!(!e.to_string().is_empty(), "{what}: empty error message");
}

/// A scratch file holding `bytes`, removed when dropped.
fn temp_file(suffix: &str, bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .prefix("tessera-fuzz-")
        .suffix(suffix)
        .tempfile()
        .expect("scratch file in the temporary directory");
    f.write_all(bytes).expect("write scratch file");
    f.flush().expect("flush scratch file");
    f
}

/// A byte reader that yields zeros once the input runs out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn below(&mut self, n: usize) -> usize {
        self.u8() as usize % n.max(1)
    }
}

// ---------------------------------------------------------------------------------------------
// Mask text → plan.

/// Segment ids, dense arrays, band features and block selections for the data leaves of fuzzed
/// expressions, a deterministic function of the problem shape and (for `dense`, `band` and
/// `blocks`) the name (and block sizes), so a printed expression re-parses to the same data. A
/// feature named with a leading `k` has the key length, any other the query length (so
/// `band(q, k, ..)` fits every shape).
struct FuzzData {
    batch: usize,
    heads: usize,
    q_len: usize,
    kv_len: usize,
    seed: u8,
}

impl FuzzData {
    /// A named array's seed (the name hashed with the input's seed) and length: key-side (`Lkv`)
    /// for a name starting with `k`, query-side otherwise.
    fn named(&self, name: &str) -> (u64, usize) {
        let h = name.bytes().fold(self.seed as u64, |a, b| {
            a.wrapping_mul(31).wrapping_add(b as u64)
        });
        let len = if name.starts_with('k') {
            self.kv_len
        } else {
            self.q_len
        };
        (h, len)
    }
}

fn seg_ids(rows: usize, len: usize, seed: u64) -> SegmentIds {
    let ids = (0..rows * len)
        .map(|k| {
            let (r, i) = ((k / len) as u64, (k % len) as u64);
            let x = (i + 3 * r + seed) / (1 + (seed + r) % 7);
            if (i * 7 + seed + r).is_multiple_of(11) {
                -1 // padding
            } else {
                (x % 4) as i64
            }
        })
        .collect();
    SegmentIds::new(rows, len, ids).expect("rows * len ids")
}

impl Resolver for FuzzData {
    fn segments(&self) -> Result<Arc<Segments>> {
        let rows = if self.seed.is_multiple_of(2) {
            1
        } else {
            self.batch
        };
        let s = self.seed as u64;
        if self.q_len == self.kv_len && self.seed.is_multiple_of(3) {
            Ok(Segments::shared(seg_ids(rows, self.q_len, s)))
        } else {
            Segments::cross(
                seg_ids(rows, self.q_len, s),
                seg_ids(rows, self.kv_len, s + 1),
            )
        }
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        let h = path.bytes().fold(self.seed as u64, |a, b| {
            a.wrapping_mul(31).wrapping_add(b as u64)
        });
        let heads = if h.is_multiple_of(2) { 1 } else { self.heads };
        let shape = [heads, self.q_len, self.kv_len];
        let n = heads * self.q_len * self.kv_len;
        let vals: Vec<bool> = (0..n as u64)
            .map(|k| (k.wrapping_mul(h | 1) >> 3) % 3 == 0)
            .collect();
        DenseMask::new(&shape, &vals, path)
    }
    fn feature(&self, name: &str) -> Result<SegmentIds> {
        let (h, len) = self.named(name);
        let rows = if (h >> 1).is_multiple_of(2) {
            1
        } else {
            self.batch
        };
        // Positions (shifted), small scrambled values, or values at the ends of i64.
        let vals = (0..(rows * len) as u64)
            .map(|k| {
                let (r, i) = (k / len as u64, k % len as u64);
                match h % 4 {
                    0 => i as i64 + r as i64,
                    1 => 2 * i as i64 - (h % 7) as i64,
                    2 => ((i.wrapping_mul(h | 1) >> 2) % 9) as i64 - 4,
                    _ => match (i + r + h) % 3 {
                        0 => i64::MIN,
                        1 => i64::MAX,
                        _ => i as i64,
                    },
                }
            })
            .collect();
        SegmentIds::named(name, rows, len, vals)
    }

    /// Ids of `document(NAME)`: a name starting with `k` is key-side (`Lkv` long), others
    /// query-side, seeded by the name (so `document(a)` needs `Lq == Lkv`, else planning refuses).
    fn segment_ids(&self, name: &str) -> Result<SegmentIds> {
        let (h, len) = self.named(name);
        let rows = if h.is_multiple_of(2) { 1 } else { self.batch };
        Ok(seg_ids(rows, len, h % 97))
    }

    /// `[1 or B, 1 or H, ceil(Lq / QB), k]` kv blocks with -1 and duplicates; one path in 16
    /// holds an entry one past the last block (a user error when planned).
    fn blocks(&self, path: &str, q_block: usize, kv_block: usize) -> Result<BlockSelection> {
        let h = path.bytes().fold(self.seed as u64 ^ 0x9e37, |a, b| {
            a.wrapping_mul(31).wrapping_add(b as u64)
        });
        let rows = self.q_len.div_ceil(q_block);
        let tk = self.kv_len.div_ceil(kv_block) as u64;
        let shape = [
            if h & 1 == 0 { 1 } else { self.batch },
            if h & 2 == 0 { 1 } else { self.heads },
            rows,
            (h >> 2) as usize % 4,
        ];
        let n: usize = shape.iter().product();
        let mut e: Vec<i64> = (0..n as u64)
            .map(|k| (k.wrapping_mul(h | 1) >> 3) % (tk + 1))
            .map(|x| x as i64 - 1)
            .collect();
        if (h >> 4) % 16 == 0 {
            if let Some(x) = e.first_mut() {
                *x = tk as i64;
            }
        }
        BlockSelection::new(&shape, &e, q_block, kv_block, path)
    }
}

/// The problem shape and tile of a small plan, from four bytes.
fn small_shape(b: &mut Bytes<'_>) -> (PlanShape, TileShape, u8) {
    let shape = PlanShape {
        batch: 1 + b.below(2),
        heads: 1 + b.below(3),
        q_len: 1 + b.below(72),
        kv_len: 1 + b.below(72),
    };
    let t = b.u8();
    let tile = TileShape {
        q: 16 << (t % 2),
        kv: 16 << ((t / 2) % 3),
    };
    (shape, tile, b.u8())
}

/// Mask text → parse → print → parse → plan, on small shapes.
///
/// Layout: 6 bytes (batch, heads, query length, key length, tile, data seed), then the
/// expression (UTF-8). Contracts: parse errors are user errors; a parsed tree is within
/// [`tessera_mask::MAX_TREE_DEPTH`]; its printed text parses to the same canonical form and
/// prints identically (printing is a fixpoint); planning fails only with a user error, and a
/// plan is consistent, agrees with [`Mask::allowed`] on every pair and tile (states exact,
/// partial bitmasks equal), and counts the allowed pairs exactly.
pub fn mask_plan(data: &[u8]) {
    let mut b = Bytes(data);
    let (shape, tile, seed) = small_shape(&mut b);
    let Ok(text) = std::str::from_utf8(b.0) else {
        return;
    };
    let res = FuzzData {
        batch: shape.batch,
        heads: shape.heads,
        q_len: shape.q_len,
        kv_len: shape.kv_len,
        seed,
    };
    let mask = match parse(text, &res) {
        Ok(m) => m,
        Err(e) => return user_error("parse", &e),
    };
    assert!(
        mask.depth() <= tessera_mask::MAX_TREE_DEPTH,
        "parsed tree too deep"
    );
    let printed = mask.to_string();
    let again = parse(&printed, &res)
        .unwrap_or_else(|e| panic!("printed form {printed:?} of {text:?} does not parse: {e}"));
    assert_eq!(
        again.canonical(),
        mask.canonical(),
        "print/parse changed the canonical form of {text:?} (printed {printed:?})"
    );
    assert_eq!(again.to_string(), printed, "printing is not a fixpoint");
    assert_eq!(again, mask.clone(), "re-parsed tree differs");
    match build_plan(&mask, shape, tile) {
        Ok(plan) => {
            check_plan_against_mask(&plan, &mask);
            check_tile_states(&plan, &mask);
        }
        Err(e) => user_error("build_plan", &e),
    }
}

/// The plan of tile states only has `plan`'s work lists, counts and allowed pairs, partial ids
/// 0, no bitmasks; the bitmask readers refuse it and the no-bits FlexAttention export of both
/// gives the same tables.
pub fn check_tile_states(plan: &Plan, mask: &Mask) {
    let states = build_tile_states(mask, plan.shape, plan.tile).expect("tile states of a plan");
    let unmasked = |l: &[tessera_plan::TileEntry]| -> Vec<(u32, bool)> {
        l.iter().map(|e| (e.tile, e.is_full())).collect()
    };
    assert_eq!(states.group_plan, plan.group_plan, "tile states: groups");
    for (a, b) in states.head_plans.iter().zip(&plan.head_plans) {
        assert_eq!(a.fwd_offsets, b.fwd_offsets, "tile states: forward offsets");
        assert_eq!(
            unmasked(&a.fwd),
            unmasked(&b.fwd),
            "tile states: forward list"
        );
        assert_eq!(
            unmasked(&a.bwd),
            unmasked(&b.bwd),
            "tile states: backward list"
        );
        assert!(a.fwd.iter().all(|e| e.is_full() || e.mask == 0));
        assert_eq!(
            (a.full_tiles, a.partial_tiles, a.allowed_pairs),
            (b.full_tiles, b.partial_tiles, b.allowed_pairs),
            "tile states: counts"
        );
    }
    assert!(states.partials.is_empty(), "tile states: no bitmasks");
    let partial = plan.stats.partial_tiles > 0;
    assert_eq!(states.has_masks(), !partial);
    assert_eq!(states.check_consistent().is_err(), partial);
    if partial {
        assert!(flex::export_packed(&states).is_err() && splash::export(&states).is_err());
    }
    // Within a budget: the whole plan exactly when its table fits, else the tile states.
    let table = plan.partials.data.len() * 8;
    for limit in [table / 2, table] {
        let w = build_plan_within(mask, plan.shape, plan.tile, limit).expect("plan within");
        let want = if table <= limit { plan } else { &states };
        assert_eq!(w.head_plans, want.head_plans, "plan within {limit}: lists");
        assert_eq!(w.partials, want.partials, "plan within {limit}: masks");
    }
    if let (Ok((fa, ca)), Ok((fb, cb))) = (flex::export_coded(&states), flex::export_coded(plan)) {
        assert_eq!(fa, fb, "tile states: flex tables");
        let kinds = |c: &[i32]| -> Vec<i32> { c.iter().map(|&x| x.min(2)).collect() };
        assert_eq!(kinds(&ca), kinds(&cb), "tile states: flex codes");
        // The tables alone are the same tables.
        assert_eq!(
            flex::export_tables(&states).ok(),
            Some(fa),
            "tile states: tables alone"
        );
    }
}

/// Brute force: the plan agrees with `mask.allowed` on every pair and every tile.
pub fn check_plan_against_mask(plan: &Plan, mask: &Mask) {
    plan.check_consistent().expect("a built plan is consistent");
    let s = plan.shape;
    let (tq, tk) = (plan.tile.q, plan.tile.kv);
    let mut allowed_total = 0u64;
    for b in 0..s.batch {
        for h in 0..s.heads {
            let hp = plan.head_plan(b, h);
            for qt in 0..plan.q_tiles {
                for kt in 0..plan.kv_tiles {
                    let (q0, q1) = plan.q_range(qt);
                    let (k0, k1) = plan.kv_range(kt);
                    let mut n = 0usize;
                    for i in q0..q1 {
                        for j in k0..k1 {
                            let want = mask.allowed(b, h, i, j);
                            assert_eq!(
                                plan.allowed(b, h, i, j),
                                want,
                                "pair ({i}, {j}) b={b} h={h} of {mask}"
                            );
                            n += want as usize;
                        }
                    }
                    allowed_total += n as u64;
                    let want = if n == 0 {
                        TileState::Empty
                    } else if n == (q1 - q0) * (k1 - k0) {
                        TileState::Full
                    } else {
                        TileState::Partial
                    };
                    assert_eq!(hp.state(qt, kt), want, "tile ({qt}, {kt}) b={b} h={h}");
                }
            }
        }
    }
    let _ = (tq, tk);
    assert_eq!(
        plan.stats.allowed_pairs, allowed_total,
        "allowed pair count"
    );
}

// ---------------------------------------------------------------------------------------------
// Tensor files.

/// `.npy` bytes through every reader: [`tessera_io::NpyArray::from_npy`], the tensor decoder
/// (with and without `--dtype bf16`), and the streaming integer reader on a file.
///
/// Contracts: errors are user errors; readers allocate at most a small multiple of the input;
/// an accepted array holds exactly `shape × dtype` bytes and re-encodes to bytes that decode to
/// the same array; the streaming reader yields exactly its declared length, agreeing with the
/// in-memory reader.
pub fn npy(data: &[u8]) {
    use tessera_io::{decode_npy, open_npy_ints, NpyArray};
    let path = Path::new("fuzz.npy");
    let arr = bounded("NpyArray::from_npy", data.len(), 2, || {
        NpyArray::from_npy(data, path)
    });
    match &arr {
        Ok(a) => {
            assert_eq!(a.bytes.len(), a.len() * a.dtype.size(), "data size");
            let again = NpyArray::from_npy(&a.to_npy(), path).expect("re-encoded array decodes");
            assert_eq!(&again, a, "npy round trip");
        }
        Err(e) => user_error("NpyArray::from_npy", e),
    }
    for want in [None, Some(tessera_core::DType::BF16)] {
        match bounded("decode_npy", data.len(), 3, || decode_npy(data, path, want)) {
            Ok(t) => {
                assert_eq!(t.numel(), t.shape().iter().product::<usize>());
                let f = temp_file(".npy", b"");
                tessera_io::write_tensor(f.path(), &t).expect("write decoded tensor");
                let back = std::fs::read(f.path()).expect("read back");
                // Compared as bytes (NaN != NaN): decoding then writing is a fixpoint.
                let again = decode_npy(&back, path, want).expect("decodes");
                tessera_io::write_tensor(f.path(), &again).expect("write again");
                assert!(
                    std::fs::read(f.path()).expect("read back") == back,
                    "npy tensor round trip"
                );
            }
            Err(e) => user_error("decode_npy", &e),
        }
    }
    let f = temp_file(".npy", data);
    match bounded("open_npy_ints", data.len(), 1, || open_npy_ints(f.path())) {
        Ok(reader) => {
            let len = reader.len();
            let mut values = Vec::new();
            for v in reader {
                match v {
                    Ok(v) => values.push(v),
                    Err(e) => return user_error("NpyInts", &e),
                }
            }
            assert_eq!(values.len() as u64, len, "streamed length");
            if let Ok(a) = &arr {
                if let Some(want) = a.to_i64() {
                    assert_eq!(values, want, "streamed values differ from the array's");
                }
            }
        }
        Err(e) => user_error("open_npy_ints", &e),
    }
}

/// `.safetensors` bytes through the reader. Contracts: errors are user errors; the reader
/// allocates at most a small multiple of the input; accepted tensors re-encode to a file that
/// decodes to the same tensors.
pub fn safetensors(data: &[u8]) {
    use tessera_io::{decode_safetensors, encode_safetensors};
    let path = Path::new("fuzz.safetensors");
    let tensors = match bounded("decode_safetensors", data.len(), 3, || {
        decode_safetensors(data, path)
    }) {
        Ok(t) => t,
        Err(e) => return user_error("decode_safetensors", &e),
    };
    for (name, t) in &tensors {
        assert_eq!(
            t.numel(),
            t.shape().iter().product::<usize>(),
            "tensor {name}"
        );
    }
    let named: Vec<(&str, &tessera_core::Tensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes = encode_safetensors(&named).expect("accepted tensors re-encode");
    let again = decode_safetensors(&bytes, path).expect("re-encoded file decodes");
    // Compared as bytes: NaN payloads must survive too, and NaN != NaN.
    let named: Vec<(&str, &tessera_core::Tensor)> =
        again.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes_again = encode_safetensors(&named).expect("decoded tensors re-encode");
    assert!(
        bytes_again == bytes,
        "safetensors round trip changed the tensors"
    );
}

// ---------------------------------------------------------------------------------------------
// Plan cache entries.

/// The plan every cache-entry input is looked up against.
pub fn reference_plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let mask = Mask::heads(vec![
            Mask::causal() & Mask::window(40, 3),
            Mask::prefix(5) | Mask::chunk(24),
        ]);
        build_plan(
            &mask,
            PlanShape::new(1, 2, 100, 90).expect("shape"),
            TileShape::new(32, 64).expect("tile"),
        )
        .expect("reference plan")
    })
}

/// Plan-cache entry bytes through the decoder, for the key of [`reference_plan`].
///
/// First byte even: the rest is a whole entry file. Contract: it is rejected, or it is the
/// reference plan exactly but for its recorded build time (the checksum makes anything else
/// infeasible). First byte odd: the
/// rest is a payload that gets a valid header and checksum, as a forger would give it.
/// Contract: it is rejected, or it decodes to a plan for the same contract that passes
/// [`Plan::check_consistent`] and every consumer (states, both exporters, the CPU kernels)
/// runs on it without a panic.
pub fn cache_entry(data: &[u8]) {
    use tessera_cache::entry;
    let reference = reference_plan();
    let key = reference.contract;
    let (mode, rest) = data.split_first().unwrap_or((&0, &[]));
    if mode.is_multiple_of(2) {
        if let Ok(mut p) = bounded("entry::decode", rest.len(), 2, || entry::decode(rest, &key)) {
            // Equal to a freshly built plan, up to the recorded build time.
            p.stats.build_ms = reference.stats.build_ms;
            assert!(
                &p == reference,
                "an entry other than the reference was accepted"
            );
        }
        return;
    }
    let header = entry::Header {
        version: tessera_plan::PLAN_FORMAT_VERSION,
        key,
        payload_len: rest.len() as u64,
        checksum: *blake3::hash(rest).as_bytes(),
    };
    let mut file = header.to_bytes().to_vec();
    file.extend_from_slice(rest);
    let Ok(p) = bounded("entry::decode", file.len(), 2, || {
        entry::decode(&file, &key)
    }) else {
        return;
    };
    assert_eq!(p.contract, key);
    assert_eq!((p.shape, p.tile), (reference.shape, reference.tile));
    p.check_consistent().expect("a decoded plan is consistent");
    let _ = p.states();
    flex::export(&p).expect("flex export of a consistent plan");
    if let Err(e) = splash::export(&p) {
        user_error("splash export", &e);
    }
    run_cpu(Arc::new(p));
}

/// One forward and backward of the CPU kernels on `plan`'s shapes (head dim 8).
fn run_cpu(plan: Arc<Plan>) {
    use tessera_attn::{AttnInputs, AttnOptions, Backend, CpuBackend, GradInputs};
    let s = plan.shape;
    let d = 8;
    let x = |seed: usize, len: usize| -> tessera_core::Tensor {
        let v = (0..s.batch * s.heads * len * d)
            .map(|k| ((k * 7 + seed) % 13) as f32 / 13.0 - 0.5)
            .collect();
        tessera_core::Tensor::from_f32(vec![s.batch, s.heads, len, d], v).expect("shape")
    };
    let (q, k, v, d_o) = (x(1, s.q_len), x(2, s.kv_len), x(3, s.kv_len), x(4, s.q_len));
    let cpu = CpuBackend::new();
    let opts = AttnOptions::default();
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view()).expect("inputs");
    let f = cpu
        .forward(&inputs, &plan, &opts)
        .expect("forward on a consistent plan");
    let g = GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), d_o.view()).expect("grads");
    cpu.backward(&g, &plan, &opts)
        .expect("backward on a consistent plan");
}

// ---------------------------------------------------------------------------------------------
// Packing.

/// Packing options from two bytes: a row length of 2..=41 and a strategy.
fn pack_config(b: &mut Bytes<'_>) -> tessera_pack::PackConfig {
    tessera_pack::PackConfig {
        seq_len: 2 + b.below(40),
        strategy: if b.u8().is_multiple_of(2) {
            tessera_pack::Strategy::BestFit
        } else {
            tessera_pack::Strategy::Greedy
        },
        bos: 7,
    }
}

/// The pieces of packed rows (BOS included), row by row.
fn pieces_of(p: &tessera_pack::Packed) -> Vec<Vec<i32>> {
    let mut out = Vec::new();
    for r in 0..p.rows {
        let row = r * p.seq_len..(r + 1) * p.seq_len;
        let (toks, segs) = (&p.tokens[row.clone()], &p.segment_ids[row]);
        let mut c = 0;
        while c < p.seq_len && segs[c] >= 0 {
            let s = segs[c];
            let start = c;
            while c < p.seq_len && segs[c] == s {
                c += 1;
            }
            out.push(toks[start..c].to_vec());
        }
    }
    out
}

/// Checks a packing of `docs` against the packer's contract: invariants, and the rows hold
/// exactly the documents' pieces (in order for greedy).
fn check_packing(p: &tessera_pack::Packed, cfg: &tessera_pack::PackConfig, docs: &[Vec<i32>]) {
    p.check(cfg.bos)
        .expect("packed rows satisfy every invariant");
    let content = cfg.seq_len - 1;
    let mut want: Vec<Vec<i32>> = Vec::new();
    for d in docs.iter().filter(|d| !d.is_empty()) {
        for chunk in d.chunks(content) {
            let mut piece = vec![cfg.bos as i32];
            piece.extend_from_slice(chunk);
            want.push(piece);
        }
    }
    let mut got = pieces_of(p);
    assert_eq!(p.stats.pieces, want.len(), "piece count");
    if cfg.strategy == tessera_pack::Strategy::Greedy {
        assert_eq!(got, want, "greedy keeps input order");
    } else {
        got.sort();
        want.sort();
        assert_eq!(got, want, "best-fit packs exactly the pieces");
    }
}

/// One JSON line as the packer reads it.
#[derive(serde::Deserialize)]
struct Line {
    tokens: Option<Vec<i64>>,
    text: Option<String>,
}

/// JSON-lines bytes through the packer. Layout: 2 bytes of options, then the file. Contracts:
/// errors are user errors; an accepted file's rows satisfy every invariant and hold exactly the
/// documents' pieces; memory stays within a multiple of input and output.
pub fn pack_jsonl(data: &[u8]) {
    let mut b = Bytes(data);
    let cfg = pack_config(&mut b);
    let f = temp_file(".jsonl", b.0);
    let limit_factor = 16 * cfg.seq_len;
    let packed = match bounded("pack_jsonl", b.0.len(), limit_factor, || {
        tessera_pack::pack_jsonl(f.path(), &cfg)
    }) {
        Ok(p) => p,
        Err(e) => return user_error("pack_jsonl", &e),
    };
    // Accepted: every non-blank line is one document.
    let docs: Vec<Vec<i32>> =
        b.0.split(|&c| c == b'\n')
            .filter(|l| !l.iter().all(|c| c.is_ascii_whitespace()))
            .map(|l| {
                let line: Line = serde_json::from_slice(l).expect("accepted line parses");
                match (line.tokens, line.text) {
                    (Some(t), None) => t.into_iter().map(|v| v as i32).collect(),
                    (None, Some(s)) => s.bytes().map(i32::from).collect(),
                    _ => panic!("accepted line has neither or both of tokens and text"),
                }
            })
            .collect();
    check_packing(&packed, &cfg, &docs);
}

/// Tokens and offsets `.npy` bytes through the packer. Layout: 2 bytes of options, 2 bytes
/// (little-endian) giving the length of the tokens file, the tokens file, the offsets file.
/// Contracts as [`pack_jsonl`]; an accepted input's documents are the offsets' slices of the
/// tokens.
pub fn pack_npy(data: &[u8]) {
    let mut b = Bytes(data);
    let cfg = pack_config(&mut b);
    let split = (b.u8() as usize | (b.u8() as usize) << 8).min(b.0.len());
    let (tokens_bytes, offsets_bytes) = b.0.split_at(split);
    let (tf, of) = (
        temp_file(".npy", tokens_bytes),
        temp_file(".npy", offsets_bytes),
    );
    let limit_factor = 16 * cfg.seq_len;
    let packed = match bounded("pack_npy", b.0.len(), limit_factor, || {
        tessera_pack::pack_npy(tf.path(), of.path(), &cfg)
    }) {
        Ok(p) => p,
        Err(e) => return user_error("pack_npy", &e),
    };
    let ints = |bytes: &[u8]| -> Vec<i64> {
        tessera_io::open_npy_ints(temp_file(".npy", bytes).path())
            .expect("accepted file opens")
            .map(|v| v.expect("accepted file reads"))
            .collect()
    };
    let (tokens, offsets) = (ints(tokens_bytes), ints(offsets_bytes));
    let docs: Vec<Vec<i32>> = offsets
        .windows(2)
        .map(|w| {
            tokens[w[0] as usize..w[1] as usize]
                .iter()
                .map(|&t| t as i32)
                .collect()
        })
        .collect();
    check_packing(&packed, &cfg, &docs);
}

// ---------------------------------------------------------------------------------------------
// Exporters.

/// A small mask tree from bytes (depth at most 5) over the leaves the planner knows.
fn gen_mask(b: &mut Bytes<'_>, res: &FuzzData, depth: usize) -> Mask {
    let pick = if depth >= 5 { b.below(6) } else { b.below(10) };
    let small = |b: &mut Bytes<'_>| b.u8() as i64 - 96;
    match pick {
        0 => Mask::full(),
        1 => Mask::causal_offset(small(b)),
        2 => Mask::window(small(b), small(b)),
        3 => Mask::chunk(1 + b.below(40) as u64),
        4 => Mask::prefix(b.below(80) as u64),
        5 => match res.segments() {
            Ok(s) => Mask::document(s),
            Err(_) => Mask::full(),
        },
        6 => gen_mask(b, res, depth + 1) & gen_mask(b, res, depth + 1),
        7 => gen_mask(b, res, depth + 1) | gen_mask(b, res, depth + 1),
        8 => !gen_mask(b, res, depth + 1),
        _ => Mask::heads(
            (0..res.heads)
                .map(|_| gen_mask(b, res, depth + 1))
                .collect(),
        ),
    }
}

/// The exporters: a plan of a generated mask exported for Flex and Splash, written as `.npz`,
/// read back; then arbitrary bytes read as `.npz` exports.
///
/// First byte even: 6 bytes of shape, tile and data seed, then a mask tree. Contracts: both exports succeed, read
/// back equal to what was written, and reproduce the token mask (padding never attends). First
/// byte odd: the rest is an `.npz` file. Contracts: reading fails with a user error or yields
/// arrays whose decoding and per-token lookup never panic; the reader allocates at most a
/// small multiple of the file.
pub fn export(data: &[u8]) {
    let (mode, rest) = data.split_first().unwrap_or((&0, &[]));
    if !mode.is_multiple_of(2) {
        let f = temp_file(".npz", rest);
        match bounded("FlexArrays::read_npz", rest.len(), 8, || {
            FlexArrays::read_npz(f.path())
        }) {
            Ok(a) => {
                for q_side in [false, true] {
                    let _ = a.decode_states(q_side);
                }
            }
            Err(e) => user_error("FlexArrays::read_npz", &e),
        }
        match bounded("SplashArrays::read_npz", rest.len(), 8, || {
            SplashArrays::read_npz(f.path())
        }) {
            Ok(a) => {
                for dkv in [false, true] {
                    if let Ok(grid) = a.decode(dkv) {
                        let [bg, nh, _, _] = grid.shape;
                        let (pq, pk) = a.padded_lengths;
                        for b in 0..bg.min(2) {
                            for h in 0..nh.min(2) {
                                for i in (0..pq).step_by(pq / 8 + 1) {
                                    for j in (0..pk).step_by(pk / 8 + 1) {
                                        let _ = a.allowed(&grid, dkv, b, h, i, j);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            Err(e) => user_error("SplashArrays::read_npz", &e),
        }
        return;
    }
    let mut b = Bytes(rest);
    let (shape, tile, seed) = small_shape(&mut b);
    let res = FuzzData {
        batch: shape.batch,
        heads: shape.heads,
        q_len: shape.q_len,
        kv_len: shape.kv_len,
        seed,
    };
    let mask = gen_mask(&mut b, &res, 0);
    let plan = match build_plan(&mask, shape, tile) {
        Ok(p) => p,
        Err(e) => return user_error("build_plan", &e),
    };
    let f = temp_file(".npz", b"");
    let fa = flex::export(&plan).expect("flex export");
    fa.write_npz(f.path()).expect("write flex npz");
    assert_eq!(FlexArrays::read_npz(f.path()).expect("read flex npz"), fa);
    // Splash refuses some plans its own preprocessing cannot handle (Unsupported, named).
    let sa = match splash::export(&plan) {
        Ok(sa) => Some(sa),
        Err(e) => {
            user_error("splash export", &e);
            None
        }
    };
    if let Some(sa) = &sa {
        sa.write_npz(f.path()).expect("write splash npz");
        assert_eq!(
            &SplashArrays::read_npz(f.path()).expect("read splash npz"),
            sa
        );
    }
    let grids = match &sa {
        Some(sa) => vec![
            sa.decode(false).expect("decode"),
            sa.decode(true).expect("decode dkv"),
        ],
        None => Vec::new(),
    };
    let (tq, tk) = fa.block_size;
    let (nq, nk) = fa.blocks;
    for bb in 0..plan.batch_groups {
        for h in 0..shape.heads {
            let hf = if fa.groups.1 == 1 { 0 } else { h };
            for i in 0..nq * tq {
                for j in 0..nk * tk {
                    let truth = i < shape.q_len && j < shape.kv_len && mask.allowed(bb, h, i, j);
                    assert_eq!(
                        fa.allowed(bb, hf, i, j),
                        truth,
                        "flex ({i}, {j}) b={bb} h={h}"
                    );
                    for (dkv, grid) in grids.iter().enumerate() {
                        let sa = sa.as_ref().expect("grids come from an export");
                        assert_eq!(
                            sa.allowed(grid, dkv == 1, bb, h, i, j),
                            truth,
                            "splash ({i}, {j}) b={bb} h={h} dkv={dkv}"
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Telemetry JSON lines.

/// Telemetry JSON-lines bytes through the reader and the plot. Contracts: errors are user
/// errors; accepted records are valid, survive a write/read round trip, and plot (or fail with
/// a user error) without a panic.
pub fn telemetry_jsonl(data: &[u8]) {
    use tessera_telemetry::parse_jsonl;
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz.jsonl");
    let records = match bounded("parse_jsonl", data.len(), 16, || parse_jsonl(text, path)) {
        Ok(r) => r,
        Err(e) => return user_error("parse_jsonl", &e),
    };
    let mut out = String::new();
    for r in &records {
        out.push_str(&r.to_json_line().expect("accepted record serializes"));
        out.push('\n');
    }
    let again = parse_jsonl(&out, path).expect("written records parse");
    assert_eq!(again.len(), records.len());
    if !records.is_empty() {
        if let Err(e) = tessera_viz::telemetry_png(&records, "fuzz") {
            user_error("telemetry_png", &e);
        }
    }
}

/// A fuzz entry point.
pub type Entry = fn(&[u8]);

/// Every entry by its fuzz target name (the corpus directories under `tests/corpus/`).
pub const TARGETS: &[(&str, Entry)] = &[
    ("mask_plan", mask_plan),
    ("npy", npy),
    ("safetensors", safetensors),
    ("cache_entry", cache_entry),
    ("pack_jsonl", pack_jsonl),
    ("pack_npy", pack_npy),
    ("export", export),
    ("telemetry_jsonl", telemetry_jsonl),
];

/// Valid starting inputs for every target (written to `tests/corpus/` as the fuzzers' seeds by
/// the ignored test `write_seed_corpus`, and replayed by the corpus test).
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    use tessera_io::{NpyArray, NpyDType};
    let mut out: Vec<(&'static str, String, Vec<u8>)> = Vec::new();
    let shape = [1u8, 1, 40, 33, 2, 3];
    for (k, e) in [
        "causal & window(16)",
        "heads(causal, !prefix(3) | chunk(8))",
        "document & causal",
        "dense(a) | causal(offset=-3)",
        "!(window(2, 3) & !full) | prefix(7) & chunk(5)",
        "causal(offset=9223372036854775807) | window(-5, 9223372036854775807)",
        "band(q, k, -3, 3) & causal | !band(q2, kb, -9223372036854775808, 0)",
        "heads(band(\"q,1\", k(1,2), 0, 9223372036854775807), document & band(p, kp, -1, 1))",
        "blocks(16, 8, s) & causal | !blocks(1, 64, \"t\") & document",
    ]
    .iter()
    .enumerate()
    {
        let mut d = shape.to_vec();
        d[0] = k as u8;
        d.extend_from_slice(e.as_bytes());
        out.push(("mask_plan", format!("seed-{k}"), d));
    }
    let arrays = [
        NpyArray::from_ints(NpyDType::I64, vec![5], [0i64, 2, 2, 7, 9].into_iter()),
        NpyArray::from_ints(NpyDType::U16, vec![2, 3], (0..6i32).map(|v| v as i64 * 999)),
        NpyArray::from_ints(NpyDType::F32, vec![3, 1], (0..3i32).map(|v| v as i64 - 1)),
        NpyArray::from_bools(vec![2, 2], &[true, false, false, true]),
    ];
    for (k, a) in arrays.iter().enumerate() {
        out.push(("npy", format!("seed-{k}"), a.to_npy()));
    }
    let t = |shape: Vec<usize>, data: tessera_core::TensorData| {
        tessera_core::Tensor::new(shape, data).expect("seed tensor")
    };
    let st = tessera_io::encode_safetensors(&[
        (
            "a",
            &t(
                vec![2, 2],
                tessera_core::TensorData::F32(vec![1.0, 2.0, 3.0, 4.0]),
            ),
        ),
        (
            "ids",
            &t(vec![3], tessera_core::TensorData::I64(vec![0, 0, 1])),
        ),
    ])
    .expect("seed safetensors");
    out.push(("safetensors", "seed-0".into(), st));
    let entry = tessera_cache::entry::encode(reference_plan()).expect("seed entry");
    out.push((
        "cache_entry",
        "seed-raw".into(),
        [&[0u8][..], &entry].concat(),
    ));
    out.push((
        "cache_entry",
        "seed-payload".into(),
        [&[1u8][..], &entry[tessera_cache::entry::HEADER_LEN..]].concat(),
    ));
    let jsonl = b"{\"tokens\": [1, 2, 3, 4, 5]}\n{\"text\": \"hello world\"}\n\n{\"text\": \"\"}\n";
    out.push((
        "pack_jsonl",
        "seed-0".into(),
        [&[6u8, 0][..], jsonl].concat(),
    ));
    out.push((
        "pack_jsonl",
        "seed-1".into(),
        [&[3u8, 1][..], jsonl].concat(),
    ));
    let toks =
        NpyArray::from_ints(NpyDType::I32, vec![9], (1..10i32).map(|v| v as i64 * 3)).to_npy();
    let offs = NpyArray::from_ints(NpyDType::I64, vec![4], [0i64, 4, 4, 9].into_iter()).to_npy();
    let len = (toks.len() as u16).to_le_bytes();
    out.push((
        "pack_npy",
        "seed-0".into(),
        [&[4u8, 1, len[0], len[1]][..], &toks, &offs].concat(),
    ));
    for (k, gen) in [
        [0u8, 1, 1, 50, 45, 1, 0, 6, 1, 10, 2, 100, 90],
        [0, 1, 2, 33, 70, 3, 5, 9, 7, 5, 8, 4, 30],
    ]
    .iter()
    .enumerate()
    {
        out.push(("export", format!("seed-{k}"), gen.to_vec()));
    }
    let plan = reference_plan();
    let f = temp_file(".npz", b"");
    flex::export(plan)
        .expect("flex")
        .write_npz(f.path())
        .expect("npz");
    let flex_npz = std::fs::read(f.path()).expect("npz bytes");
    out.push((
        "export",
        "seed-flex-npz".into(),
        [&[1u8][..], &flex_npz].concat(),
    ));
    splash::export(plan)
        .expect("splash")
        .write_npz(f.path())
        .expect("npz");
    let splash_npz = std::fs::read(f.path()).expect("npz bytes");
    out.push((
        "export",
        "seed-splash-npz".into(),
        [&[1u8][..], &splash_npz].concat(),
    ));
    let rec = concat!(
        r#"{"step":0,"layer":0,"sink_mass":[0.5,0.25],"sink_rate":0.5,"learned_sink_mass":null,"#,
        r#""max_logit":[3.0,2.5],"entropy":[1.0,1.5],"out_abs_max":[2.0,1.0],"out_rms":[0.5,0.4],"out_outliers":[0,1]}"#
    );
    out.push((
        "telemetry_jsonl",
        "seed-0".into(),
        format!("{rec}\n").into_bytes(),
    ));
    out
}
