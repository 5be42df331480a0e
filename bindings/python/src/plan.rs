//! Plans from Python: `plan(mask, q_len, ...)` through the process-wide plan cache (docs/semantics.md#plan-cache),
//! with the GIL released while planning; a `Plan` reports its statistics, tile states and a text
//! picture, hands its work lists to FlexAttention / Splash, and is prepared for the CPU kernels
//! once (on first use) for every attention call that uses it.

use numpy::{IntoPyArray, PyArray1, PyArray4, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, OnceLock};
use tessera::{
    build_plan, build_plan_within, Backend, CacheConfig, CpuBackend, CpuPlan, Mask, Plan,
    PlanCache, PlanShape, TileShape,
};

use crate::errors::to_py;
use crate::mask::PyMask;

/// The process-wide plan cache (directory from `TESSERA_CACHE_DIR`, `XDG_CACHE_HOME` or
/// `~/.cache/tessera`; memory-only when none applies or the directory is unusable).
pub fn cache() -> &'static PlanCache {
    static CACHE: OnceLock<PlanCache> = OnceLock::new();
    CACHE.get_or_init(|| PlanCache::new(CacheConfig::default()))
}

/// A plan: which tiles of `[B, H, Lq, Lkv]` are empty, full or partial, with the work lists the
/// kernels walk.
#[pyclass(name = "Plan", module = "tessera._tessera", frozen)]
pub struct PyPlan {
    /// The plan as built: whole, or its tile states only (planned without the plan cache, its
    /// masks past `KEEP_MASK_BYTES`), whose bitmasks [`PyPlan::whole`] builds on first need.
    tiles: Arc<Plan>,
    /// The whole plan of a tile-states `tiles`, once something read the bitmasks.
    built: OnceLock<Arc<Plan>>,
    /// The planned mask; `None` for a rank's local plan of a sharding (its rows and K/V are a
    /// permutation of the global ones: no mask expression describes it).
    pub(crate) mask: Option<Mask>,
    /// Where the plan came from: `memory`, `disk` (plan cache) or `built`.
    source: &'static str,
    /// Shared with the XLA FFI registry (`crate::ffi`), which runs kernels on this plan
    /// without the GIL.
    pub(crate) prepared: Arc<OnceLock<CpuPlan>>,
}

impl PyPlan {
    pub(crate) fn new(inner: Arc<Plan>, mask: Option<Mask>, source: &'static str) -> Self {
        PyPlan {
            tiles: inner,
            built: OnceLock::new(),
            mask,
            source,
            prepared: Arc::new(OnceLock::new()),
        }
    }

    /// The plan's tile states, work lists and counts (whole or not: the same).
    pub(crate) fn tiles(&self) -> &Arc<Plan> {
        &self.tiles
    }

    /// The whole plan, its partial bitmasks included: built now (GIL released) when only its
    /// tile states were, then kept.
    pub(crate) fn whole(&self, py: Python<'_>) -> PyResult<&Arc<Plan>> {
        if self.tiles.has_masks() {
            return Ok(&self.tiles);
        }
        if let Some(p) = self.built.get() {
            return Ok(p);
        }
        let Some(mask) = &self.mask else {
            return Err(PyValueError::new_err(
                "plan: a plan without its bitmasks and mask",
            ));
        };
        let t = &self.tiles;
        let p = py
            .detach(|| build_plan(mask, t.shape, t.tile))
            .map_err(to_py)?;
        Ok(self.built.get_or_init(|| Arc::new(p)))
    }

    /// The plan prepared for the CPU kernels (built on first use, then reused by every call).
    pub(crate) fn prepared(&self, py: Python<'_>) -> PyResult<&CpuPlan> {
        let whole = self.whole(py)?;
        prepare_once(&self.prepared, whole).map_err(to_py)
    }
}

/// `plan` prepared for the CPU kernels in `cell`: built by the first caller, reused after.
pub(crate) fn prepare_once<'a>(
    cell: &'a OnceLock<CpuPlan>,
    plan: &Arc<Plan>,
) -> tessera::Result<&'a CpuPlan> {
    if let Some(p) = cell.get() {
        return Ok(p);
    }
    let p = CpuBackend::new().prepare(plan)?;
    Ok(cell.get_or_init(|| p))
}

/// The largest batch and head counts the mask's data implies (1 when it implies none).
fn implied_dims(m: &Mask) -> (usize, usize) {
    // A fold over the nodes (an explicit stack): a mask built through the typed API can be
    // deeper than the call stack allows.
    m.nodes()
        .map(|n| match n {
            Mask::Document(s) => (s.rows(), 1),
            Mask::Band { features, .. } => (features.rows(), 1),
            Mask::Dense(d) => (d.batch(), d.heads()),
            Mask::Blocks(s) => (s.batch(), s.heads()),
            Mask::Heads(v) => (1, v.len()),
            _ => (1, 1),
        })
        .fold((1, 1), |a, b| (a.0.max(b.0), a.1.max(b.1)))
}

fn block_shape(block: &Bound<'_, PyAny>) -> PyResult<TileShape> {
    let (q, kv) = if let Ok(n) = block.extract::<usize>() {
        (n, n)
    } else if let Ok(p) = block.extract::<(usize, usize)>() {
        p
    } else {
        return Err(PyValueError::new_err(
            "block: expected an int or a (q, kv) pair of ints",
        ));
    };
    TileShape::new(q, kv).map_err(|e| PyValueError::new_err(format!("block: {e}")))
}

/// The partial masks a plan made without the cache keeps (64 blocks of 128 x 128): below it a
/// bit table is cheaper to hand out than the data of a computed `mask_mod` (a few masks, one
/// unique mask for a whole neighbourhood), above it the masks cost more than they save (a tree's
/// hundreds of distinct sparse tiles).
const KEEP_MASK_BYTES: usize = 128 << 10;

/// Plans `mask` for `[batch, heads, q_len, kv_len]` at tile `block`: through the plan cache, or
/// without it (`cache=False`) now whole (`masks=True`) or whole while its partial masks are few
/// (`KEEP_MASK_BYTES`), else as its tile states, the bitmasks built on first need.
#[pyfunction]
#[pyo3(signature = (mask, q_len, kv_len=None, heads=None, batch=None, block=None, cache=true, masks=true))]
#[allow(clippy::too_many_arguments)]
pub fn plan(
    py: Python<'_>,
    mask: PyRef<'_, PyMask>,
    q_len: usize,
    kv_len: Option<usize>,
    heads: Option<usize>,
    batch: Option<usize>,
    block: Option<&Bound<'_, PyAny>>,
    cache: bool,
    masks: bool,
) -> PyResult<PyPlan> {
    let m = mask.inner.clone();
    let (b0, h0) = implied_dims(&m);
    let shape = PlanShape::new(
        batch.unwrap_or(b0),
        heads.unwrap_or(h0),
        q_len,
        kv_len.unwrap_or(q_len),
    )
    .map_err(to_py)?;
    let tile = match block {
        Some(b) => block_shape(b)?,
        None => TileShape::default(),
    };
    let (inner, source) = py
        .detach(|| {
            if cache {
                self::cache()
                    .get_or_build(&m, shape, tile)
                    .map(|l| (l.plan, l.source.name()))
            } else if masks {
                build_plan(&m, shape, tile).map(|p| (Arc::new(p), "built"))
            } else {
                build_plan_within(&m, shape, tile, KEEP_MASK_BYTES).map(|p| (Arc::new(p), "built"))
            }
        })
        .map_err(|e| to_py(python_segment_names(e, &m, shape)))?;
    Ok(PyPlan::new(inner, Some(m), source))
}

/// The planner names a `document` leaf's ids by the CLI's flags (`q-segments`, `kv-segments`).
/// From Python the caller passed `ids` / `kv_ids` (`tessera.document`) or `segments` /
/// `q_segments` / `kv_segments` (`tessera.mask`): an error about them names those, and the
/// plan length the ids had to match.
fn python_segment_names(e: tessera::Error, m: &Mask, shape: PlanShape) -> tessera::Error {
    let tessera::Error::InvalidArgument {
        arg,
        expected,
        found,
    } = e
    else {
        return e;
    };
    let kv_side = match arg.as_str() {
        "q-segments" => false,
        "kv-segments" => true,
        _ => {
            return tessera::Error::InvalidArgument {
                arg,
                expected,
                found,
            }
        }
    };
    let rows_ok = |r: usize| r == 1 || r == shape.batch;
    // One array serves both sides when the caller passed one (`document(ids)`, `segments=`):
    // the first leaf that does not fit is the one validation refused.
    let shared = m
        .nodes()
        .find_map(|n| match n {
            Mask::Document(s)
                if s.q.len() != shape.q_len
                    || s.kv.len() != shape.kv_len
                    || !rows_ok(s.q.rows())
                    || !rows_ok(s.kv.rows()) =>
            {
                Some(s.q == s.kv)
            }
            _ => None,
        })
        .unwrap_or(false);
    let arg = match (shared, kv_side) {
        (true, _) => "ids (the document ids; segments= of tessera.mask)",
        (false, false) => "ids (the query-side document ids; q_segments= of tessera.mask)",
        (false, true) => "kv_ids (the key-side document ids; kv_segments= of tessera.mask)",
    };
    let (expected, found) = if expected.starts_with("length ") {
        let want = match (shared, kv_side) {
            (_, false) => format!("length {} (the plan's q_len)", shape.q_len),
            (true, true) => format!(
                "length {} (the plan's kv_len: the same ids serve the keys; pass kv_ids for keys \
                 of another length)",
                shape.kv_len
            ),
            (false, true) => format!("length {} (the plan's kv_len)", shape.kv_len),
        };
        (want, format!("length {found}"))
    } else {
        (expected, format!("{found} rows"))
    };
    tessera::Error::InvalidArgument {
        arg: arg.to_string(),
        expected,
        found,
    }
}

/// Counters of the process-wide plan cache.
#[pyfunction]
pub fn cache_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = cache().counters();
    let d = PyDict::new(py);
    d.set_item("memory_hits", c.memory_hits)?;
    d.set_item("disk_hits", c.disk_hits)?;
    d.set_item("misses", c.misses)?;
    d.set_item("rejects", c.rejects)?;
    d.set_item("plans_built", c.builds)?;
    d.set_item("bytes_read", c.bytes_read)?;
    d.set_item("bytes_written", c.bytes_written)?;
    d.set_item("dir", cache().dir().map(|p| p.display().to_string()))?;
    let warnings: Vec<String> = cache().warnings().iter().map(|w| w.to_string()).collect();
    d.set_item("warnings", warnings)?;
    Ok(d)
}

/// How many tiles one of `m` picture cells covers along an axis of `n` tiles (`n / m`, or both
/// neighbours when `m` does not divide `n`), as [`PyPlan::__repr__`] splits them.
fn span(n: usize, m: usize) -> String {
    let m = m.max(1);
    if n.is_multiple_of(m) {
        (n / m).to_string()
    } else {
        format!("{}-{}", n / m, n / m + 1)
    }
}

/// Cell of the text picture covering tiles `[q0, q1) × [k0, k1)` of group 0.
fn cell(states: &[i8], nk: usize, q: (usize, usize), k: (usize, usize)) -> char {
    let (mut any_full, mut any_part, mut all_full) = (false, false, true);
    for qt in q.0..q.1 {
        for &s in &states[qt * nk + k.0..qt * nk + k.1] {
            any_full |= s == 2;
            any_part |= s == 1;
            all_full &= s == 2;
        }
    }
    if all_full {
        '█'
    } else if any_part || any_full {
        '░'
    } else {
        ' '
    }
}

#[pymethods]
impl PyPlan {
    /// `(B, H, Lq, Lkv)` the plan is for.
    #[getter]
    fn shape(&self) -> (usize, usize, usize, usize) {
        let s = self.tiles.shape;
        (s.batch, s.heads, s.q_len, s.kv_len)
    }
    /// `(q, kv)` tile sides.
    #[getter]
    fn block(&self) -> (usize, usize) {
        (self.tiles.tile.q, self.tiles.tile.kv)
    }
    /// `(B', H')`: 1 where the mask does not vary along batch rows / heads.
    #[getter]
    fn groups(&self) -> (usize, usize) {
        (self.tiles.batch_groups, self.tiles.head_groups)
    }
    /// The planned mask (`None` for a rank's local plan of a sharding).
    #[getter]
    fn mask(&self) -> Option<PyMask> {
        self.mask.clone().map(crate::mask::wrap)
    }
    /// Where the plan came from: `"memory"` or `"disk"` (plan cache hits), `"built"`, or
    /// `"sharded"` (a rank's local plan of a sharding).
    #[getter]
    fn source(&self) -> &'static str {
        self.source
    }
    /// Writes a PNG picture of the tile states of batch row `batch`, head `head` (the CLI's
    /// `tessera plan --png`); the GIL is released while drawing.
    #[pyo3(signature = (path, batch=0, head=0, title=None))]
    fn save_png(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        batch: usize,
        head: usize,
        title: Option<String>,
    ) -> PyResult<()> {
        let s = self.tiles.shape;
        if batch >= s.batch || head >= s.heads {
            return Err(PyValueError::new_err(format!(
                "batch/head: expected batch < {} and head < {}, got ({batch}, {head})",
                s.batch, s.heads
            )));
        }
        let title = title.unwrap_or_else(|| {
            format!(
                "{}  [B={} H={} Lq={} Lkv={}]",
                self.tiles.mask, s.batch, s.heads, s.q_len, s.kv_len
            )
        });
        let plan = self.tiles.clone();
        py.detach(|| tessera::viz::write_plan_png(&plan, batch, head, &title, &path))
            .map_err(to_py)
    }
    /// Whether the partial tiles' bitmasks are built (a plan made without the plan cache may
    /// have its tile states only; whatever reads the bitmasks builds them).
    #[getter]
    fn has_masks(&self) -> bool {
        self.tiles.has_masks() || self.built.get().is_some()
    }
    /// Hex contract key (what the plan cache is keyed by).
    #[getter]
    fn contract(&self) -> String {
        self.tiles.contract.to_string()
    }
    /// Statistics: tiles by state, unique partial masks, allowed pairs, density, ... Tile
    /// counts cover the `[B', H', Tq, Tk]` grid (`tile_grid`: one grid serves every batch row
    /// and head along which the mask does not vary), pairs the whole `[B, H, Lq, Lkv]`; `units`
    /// says so per key.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The whole plan's (its unique masks and bytes).
        let p = self.whole(py)?;
        let s = &p.stats;
        let d = PyDict::new(py);
        let grid = (p.batch_groups, p.head_groups, p.q_tiles, p.kv_tiles);
        d.set_item("tile_grid", grid)?;
        let tiles = format!(
            "tiles of the [B', H', Tq, Tk] = [{}, {}, {}, {}] grid (tile_grid)",
            grid.0, grid.1, grid.2, grid.3
        );
        let sh = p.shape;
        let pairs = format!(
            "(query, key) pairs of the whole [B, H, Lq, Lkv] = [{}, {}, {}, {}]",
            sh.batch, sh.heads, sh.q_len, sh.kv_len
        );
        let units = PyDict::new(py);
        for key in ["tiles", "empty_tiles", "partial_tiles", "full_tiles"] {
            units.set_item(key, &tiles)?;
        }
        units.set_item("unique_partial_masks", "distinct partial-tile bitmasks")?;
        units.set_item("head_plans", "distinct (batch row, head) masks planned")?;
        units.set_item("allowed_pairs", &pairs)?;
        units.set_item("density", format!("allowed_pairs / all {pairs}"))?;
        units.set_item("tile_density", "non-empty tiles / tiles (of tile_grid)")?;
        units.set_item("grid_width", "tiles in the longest forward tile row")?;
        units.set_item("plan_bytes", "bytes")?;
        units.set_item("build_ms", "milliseconds")?;
        d.set_item("units", units)?;
        d.set_item("tiles", s.tiles)?;
        d.set_item("empty_tiles", s.empty_tiles)?;
        d.set_item("partial_tiles", s.partial_tiles)?;
        d.set_item("full_tiles", s.full_tiles)?;
        d.set_item("unique_partial_masks", s.unique_partial_masks)?;
        d.set_item("head_plans", s.head_plans)?;
        d.set_item("allowed_pairs", s.allowed_pairs)?;
        d.set_item("density", s.density)?;
        d.set_item("tile_density", s.tile_density)?;
        d.set_item("grid_width", s.grid_width)?;
        d.set_item("plan_bytes", s.plan_bytes)?;
        d.set_item("build_ms", s.build_ms)?;
        Ok(d)
    }
    /// The key-side segment ids of the mask's `document` leaf, `int64 [B', Lkv]` (the ids
    /// the Tessera kernel's telemetry takes its sink keys from), or `None` when the mask has no
    /// `document` leaf. A rank's local plan of a sharding (no mask) is a `ValueError`.
    fn kv_segments<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, numpy::PyArray2<i64>>>> {
        let Some(mask) = &self.mask else {
            return Err(PyValueError::new_err(
                "plan: a rank's local plan of a sharding has no mask; take the global plan's",
            ));
        };
        let Some(seg) = tessera::telemetry::document_kv_segments(mask) else {
            return Ok(None);
        };
        let (rows, len) = (seg.rows(), seg.len());
        let ids: Vec<i64> = (0..rows).flat_map(|b| seg.row(b).iter().copied()).collect();
        Ok(Some(ids.into_pyarray(py).reshape([rows, len])?))
    }
    /// Tile states `uint8 [B', H', Tq, Tk]`: 0 empty, 1 partial, 2 full.
    fn states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray4<u8>>> {
        let (shape, v) = self.tiles.states();
        let v: Vec<u8> = v.into_iter().map(|x| x as u8).collect();
        v.into_pyarray(py).reshape(shape)
    }
    /// FLOPs of the forward (backward) pass over allowed pairs for head dims `d_qk`, `d_v`.
    #[pyo3(signature = (d_qk, d_v=None, backward=false))]
    fn flops(&self, d_qk: usize, d_v: Option<usize>, backward: bool) -> f64 {
        let dv = d_v.unwrap_or(d_qk);
        if backward {
            self.tiles.backward_flops(d_qk, dv)
        } else {
            self.tiles.forward_flops(d_qk, dv)
        }
    }
    fn __repr__(&self) -> String {
        let p = &self.tiles;
        let s = p.shape;
        let (nq, nk) = (p.q_tiles, p.kv_tiles);
        let (_, states) = p.states();
        let w = nk.min(32);
        let h = nq.min(32);
        // Units on the line: density counts pairs of the whole problem, the tile counts one
        // [B', H'] grid of tiles (one head's grid when the mask does not vary along heads).
        let mut out = format!(
            "tessera.Plan(mask='{}', shape=(B={}, H={}, Lq={}, Lkv={}), block={}x{}, \
             density={:.4} of B*H*Lq*Lkv pairs, tiles of the [B'={}, H'={}, Tq={}, Tk={}] grid: \
             {} full, {} partial, {} empty)\n",
            p.mask,
            s.batch,
            s.heads,
            s.q_len,
            s.kv_len,
            p.tile.q,
            p.tile.kv,
            p.stats.density,
            p.batch_groups,
            p.head_groups,
            nq,
            nk,
            p.stats.full_tiles,
            p.stats.partial_tiles,
            p.stats.empty_tiles
        );
        for r in 0..h {
            let q = (r * nq / h, ((r + 1) * nq / h).max(r * nq / h + 1));
            out.push_str("  ");
            for c in 0..w {
                let k = (c * nk / w, ((c + 1) * nk / w).max(c * nk / w + 1));
                let ch = cell(&states, nk, q, k);
                out.push(ch);
                out.push(ch);
            }
            out.push('\n');
        }
        if h < nq || w < nk {
            // A shrunk picture says so: its cells are blocks of tiles, not tiles.
            out.push_str(&format!(
                "  (shrunk: {h} of {nq} tile rows, {w} of {nk} tile columns; each cell covers \
                 {} x {} tiles: ██ all full, ░░ some allowed, blank all empty)\n",
                span(nq, h),
                span(nk, w)
            ));
        }
        if p.batch_groups * p.head_groups > 1 {
            out.push_str("  (batch row 0, head 0 shown)\n");
        }
        out
    }
    fn __str__(&self) -> String {
        self.__repr__()
    }

    /// The eight FlexAttention `BlockMask` tables plus the partial-block contents (int32 / bool
    /// numpy arrays), exactly what `create_block_mask` builds for this mask. With `packed`, the
    /// contents are `mask_bits` (int64 `[n, tq, ⌈tk/64⌉]` bit rows) instead of `mask_blocks`.
    #[pyo3(signature = (packed=false))]
    fn _flex_arrays<'py>(&self, py: Python<'py>, packed: bool) -> PyResult<Bound<'py, PyDict>> {
        let plan = self.whole(py)?.clone();
        let (f, bits) = py
            .detach(|| {
                if packed {
                    tessera::export::flex::export_packed(&plan)
                } else {
                    tessera::export::flex::export(&plan).map(|f| (f, Vec::new()))
                }
            })
            .map_err(to_py)?;
        let (bg, hg) = f.groups;
        let (nq, nk) = f.blocks;
        let d = PyDict::new(py);
        let i3 = |v: Vec<i32>, n: usize| -> PyResult<Bound<'py, PyAny>> {
            Ok(v.into_pyarray(py).reshape([bg, hg, n])?.into_any())
        };
        let i4 = |v: Vec<i32>, a: usize, b: usize| -> PyResult<Bound<'py, PyAny>> {
            Ok(v.into_pyarray(py).reshape([bg, hg, a, b])?.into_any())
        };
        d.set_item("kv_num_blocks", i3(f.kv_num_blocks, nq)?)?;
        d.set_item("kv_indices", i4(f.kv_indices, nq, nk)?)?;
        d.set_item("full_kv_num_blocks", i3(f.full_kv_num_blocks, nq)?)?;
        d.set_item("full_kv_indices", i4(f.full_kv_indices, nq, nk)?)?;
        d.set_item("q_num_blocks", i3(f.q_num_blocks, nk)?)?;
        d.set_item("q_indices", i4(f.q_indices, nk, nq)?)?;
        d.set_item("full_q_num_blocks", i3(f.full_q_num_blocks, nk)?)?;
        d.set_item("full_q_indices", i4(f.full_q_indices, nk, nq)?)?;
        let st: Vec<i8> = f.mask_tile_states;
        d.set_item(
            "mask_tile_states",
            st.into_pyarray(py).reshape([bg, hg, nq, nk])?,
        )?;
        d.set_item("mask_block_ids", i4(f.mask_block_ids, nq, nk)?)?;
        let (tq, tk) = f.block_size;
        if packed {
            let words = tk.div_ceil(64);
            let n = bits.len() / (tq * words).max(1);
            // The same bits as int64 (torch has no general uint64 support).
            let bits: Vec<i64> = bits.into_iter().map(|w| w as i64).collect();
            d.set_item("mask_bits", bits.into_pyarray(py).reshape([n, tq, words])?)?;
        } else {
            let n = f.mask_blocks.len() / (tq * tk).max(1);
            d.set_item(
                "mask_blocks",
                f.mask_blocks.into_pyarray(py).reshape([n, tq, tk])?,
            )?;
        }
        d.set_item("block_size", f.block_size)?;
        d.set_item("seq_lengths", (f.shape[2], f.shape[3]))?;
        Ok(d)
    }

    /// What a `BlockMask` is built from, with no copy of the tables:
    /// - nine int32 arrays, flat: `kv_num_blocks`, `kv_indices`, `full_kv_num_blocks`,
    ///   `full_kv_indices`, `q_num_blocks`, `q_indices`, `full_q_num_blocks`, `full_q_indices`
    ///   (shapes as in `_flex_arrays`), then `[B', H', nq, nk]` block codes: 0 for an empty
    ///   tile, 1 for a full one, `2 + i` for partial block `i` (empty with `bits=False`, for a
    ///   `mask_mod` that reads neither);
    /// - int64 `[capacity, tq, ceil(tk / 64)]` packed bit rows per code (bit `c % 64` of word
    ///   `c / 64`): code 0 all clear, code 1 all set, then the plan's partial blocks, zero past
    ///   them. `capacity` is the next power of two of at least the codes used and of
    ///   `min(per_tile * B' * H' * max(nq, nk), max_floor)`; `None` with `bits=False` (for a
    ///   `mask_mod` that does not read them: no block is copied).
    ///
    /// With `(B', H', nq, nk, tq, tk, Lq, Lkv)`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (per_tile, max_floor, bits=true))]
    fn _flex_tables<'py>(
        &self,
        py: Python<'py>,
        per_tile: usize,
        max_floor: usize,
        bits: bool,
    ) -> PyResult<(
        Vec<Bound<'py, PyArray1<i32>>>,
        Option<Bound<'py, PyAny>>,
        (usize, usize, usize, usize, usize, usize, usize, usize),
    )> {
        let plan = if bits { self.whole(py)? } else { self.tiles() }.clone();
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let floor = bits_floor(&plan, per_tile, max_floor);
        let lead = bits.then(|| lead_blocks(&plan, floor));
        let (f, codes, bits) = py
            .detach(|| match lead {
                Some(lead) => tessera::export::flex::export_coded_after(&plan, lead)
                    .map(|(f, c, b)| (f, c, Some(b))),
                None => tessera::export::flex::export_tables(&plan).map(|f| (f, Vec::new(), None)),
            })
            .map_err(to_py)?;
        let (bg, hg) = f.groups;
        let (nq, nk) = f.blocks;
        let tables = [
            f.kv_num_blocks,
            f.kv_indices,
            f.full_kv_num_blocks,
            f.full_kv_indices,
            f.q_num_blocks,
            f.q_indices,
            f.full_q_num_blocks,
            f.full_q_indices,
            codes,
        ]
        .into_iter()
        .map(|v| v.into_pyarray(py))
        .collect();
        let padded = bits.map(|b| led_bits(py, b, (tq, tk), floor)).transpose()?;
        Ok((
            tables,
            padded,
            (bg, hg, nq, nk, tq, tk, f.shape[2], f.shape[3]),
        ))
    }

    /// The plan's non-empty tiles, O(active tiles), for a device to expand the `BlockMask`
    /// tables itself: `(cells, codes, bits, dims)` with int32 `cells` (flat index over
    /// `[B', H', nq, nk]`, ascending), int32 `codes` (1 full, `2 + i` partial block `i`), the
    /// padded bit blocks as in `_flex_tables` (`None` with `bits=False`) and the same `dims`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (per_tile, max_floor, bits=true))]
    fn _flex_compact<'py>(
        &self,
        py: Python<'py>,
        per_tile: usize,
        max_floor: usize,
        bits: bool,
    ) -> PyResult<(
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Option<Bound<'py, PyAny>>,
        (usize, usize, usize, usize, usize, usize, usize, usize),
    )> {
        let plan = if bits { self.whole(py)? } else { self.tiles() }.clone();
        let floor = bits_floor(&plan, per_tile, max_floor);
        let lead = bits.then(|| lead_blocks(&plan, floor));
        let (c, led) = py
            .detach(|| tessera::export::flex::export_compact_after(&plan, lead))
            .map_err(to_py)?;
        let (bg, hg) = c.groups;
        let (nq, nk) = c.blocks;
        let (tq, tk) = c.block_size;
        let padded = led.map(|b| led_bits(py, b, (tq, tk), floor)).transpose()?;
        Ok((
            c.cells.into_pyarray(py),
            c.codes.into_pyarray(py),
            padded,
            (bg, hg, nq, nk, tq, tk, c.shape[2], c.shape[3]),
        ))
    }

    /// Splash `MaskInfo` arrays per distinct batch row: a list of `(fwd, dkv)` dicts of numpy
    /// arrays (`None` for absent fields), as `process_mask` / `process_mask_dkv` build them.
    #[pyo3(signature = (head_shards=1, q_seq_shards=1, shrink_grid=true, shrink_grid_dkv=true, downcast_smem_data=true))]
    fn _splash_arrays<'py>(
        &self,
        py: Python<'py>,
        head_shards: usize,
        q_seq_shards: usize,
        shrink_grid: bool,
        shrink_grid_dkv: bool,
        downcast_smem_data: bool,
    ) -> PyResult<Vec<(Bound<'py, PyDict>, Bound<'py, PyDict>)>> {
        use tessera::export::npz::NpyDType as NDType;
        use tessera::export::splash::{export_with, IntArray, MaskInfo, SplashOptions};
        let opts = SplashOptions {
            head_shards,
            q_seq_shards,
            shrink_grid,
            shrink_grid_dkv,
            downcast_smem_data,
        };
        let plan = self.whole(py)?.clone();
        let s = py.detach(|| export_with(&plan, &opts)).map_err(to_py)?;
        let ints = |a: IntArray| -> PyResult<Bound<'py, PyAny>> {
            let sh = a.shape;
            Ok(match a.dtype {
                NDType::I8 => {
                    let v: Vec<i8> = a.data.iter().map(|&x| x as i8).collect();
                    v.into_pyarray(py).reshape(sh)?.into_any()
                }
                NDType::I16 => {
                    let v: Vec<i16> = a.data.iter().map(|&x| x as i16).collect();
                    v.into_pyarray(py).reshape(sh)?.into_any()
                }
                _ => a.data.into_pyarray(py).reshape(sh)?.into_any(),
            })
        };
        let info = |m: MaskInfo| -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            d.set_item("data_next", ints(m.data_next)?)?;
            d.set_item(
                "mask_next",
                match m.mask_next {
                    Some(x) => Some(ints(x)?),
                    None => None,
                },
            )?;
            d.set_item("block_mask", ints(m.block_mask)?)?;
            d.set_item(
                "partial_mask_blocks",
                match m.partial_mask_blocks {
                    Some(b) => Some(b.data.into_pyarray(py).reshape(b.shape)?.into_any()),
                    None => None,
                },
            )?;
            Ok(d)
        };
        s.rows
            .into_iter()
            .map(|r| Ok((info(r.fwd)?, info(r.dkv)?)))
            .collect()
    }
}

/// The least block capacity of `plan`'s bit table: `min(per_tile * B' * H' * max(nq, nk),
/// max_floor)` (so that plans of the same shapes share one compiled kernel).
fn bits_floor(plan: &tessera::Plan, per_tile: usize, max_floor: usize) -> usize {
    per_tile
        .saturating_mul(plan.batch_groups * plan.head_groups)
        .saturating_mul(plan.q_tiles.max(plan.kv_tiles))
        .min(max_floor)
}

/// The two constant blocks (all clear, all set) a bit table starts with, with room for the
/// plan's blocks behind them and the padding to `floor` (so the export copies each block once).
fn lead_blocks(plan: &tessera::Plan, floor: usize) -> Vec<u64> {
    let row = plan.tile.q * plan.tile.kv.div_ceil(64);
    let expect = (plan.partials.len() + 2).max(floor).next_power_of_two();
    let mut lead = Vec::with_capacity(expect * row);
    lead.resize(row, 0);
    lead.resize(2 * row, u64::MAX);
    lead
}

/// Packed partial-block bits as int64 `[capacity, tq, ceil(tk / 64)]` from words led by the two
/// constant blocks (code 0 all clear, code 1 all set, then the blocks, zero past them), padded
/// in place to `capacity` (the next power of two of at least the codes used and of `floor`,
/// [`bits_floor`]) and reinterpreted as int64 (torch has no general uint64 support), no copy.
fn led_bits<'py>(
    py: Python<'py>,
    mut led: Vec<u64>,
    (tq, tk): (usize, usize),
    floor: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let row = tq * tk.div_ceil(64);
    // At least one block past the two constant ones (all clear when no block is partial, as
    // the compact export gives it), so both exports pad to the same capacity.
    let blocks = (led.len() / row.max(1)).max(3);
    let capacity = blocks.max(floor).next_power_of_two();
    led.resize(capacity * row, 0);
    // Same size and alignment: the allocation reinterpreted, no pass over it.
    let padded: Vec<i64> = bytemuck::allocation::cast_vec(led);
    Ok(padded
        .into_pyarray(py)
        .reshape([capacity, tq, tk.div_ceil(64)])?
        .into_any())
}
