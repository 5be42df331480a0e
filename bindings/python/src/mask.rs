//! Masks from Python: the same algebra and spelling as Rust and the CLI (docs/semantics.md#masks). Typed
//! constructors (`causal()`, `document(ids)`, `band(f, g, lo, hi)`, ...) combine with `&`, `|`,
//! `~`; `mask(text, ...)` parses the CLI's expression language with the segment ids, dense arrays,
//! band features and block selections passed in.
//!
//! Contract: a `Mask` is immutable; `str(mask)` is its canonical form (data named by digest), so
//! two masks with the same semantics and data print the same. Integer arrays (segment ids, band
//! features) arrive as int64 numpy arrays `[L]` or `[B, L]`, block selections as int64
//! `[B, H, Tq, k]` (or `[H, Tq, k]`, `[Tq, k]`); the Python layer converts torch tensors and lists.

use numpy::{IntoPyArray, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::collections::HashMap;
use std::sync::Arc;
use tessera::mask::{parse, Resolver};
use tessera::mask::{BandFeatures, BlockSelection, MAX_TREE_DEPTH};
use tessera::{DenseMask, Mask, Result as TResult, SegmentIds, Segments};

use crate::errors::to_py;

/// An attention mask expression.
#[pyclass(name = "Mask", module = "tessera", frozen)]
#[derive(Clone)]
pub struct PyMask {
    pub(crate) inner: Mask,
}

#[pymethods]
impl PyMask {
    fn __and__(&self, other: &PyMask) -> PyMask {
        PyMask {
            inner: self.inner.clone() & other.inner.clone(),
        }
    }
    fn __or__(&self, other: &PyMask) -> PyMask {
        PyMask {
            inner: self.inner.clone() | other.inner.clone(),
        }
    }
    fn __invert__(&self) -> PyMask {
        PyMask {
            inner: !self.inner.clone(),
        }
    }
    fn __str__(&self) -> String {
        self.inner.canonical()
    }
    fn __repr__(&self) -> String {
        format!("tessera.Mask('{}')", self.inner.canonical())
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyMask>()
            .map(|o| o.get().inner.canonical() == self.inner.canonical())
            .unwrap_or(false)
    }
    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.inner.canonical().hash(&mut h);
        h.finish()
    }
    /// The expression tree as nested tuples, for code generation (the flex engine's analytic
    /// `mask_mod`): `("full",)`, `("causal", offset)`, `("window", left, right)`,
    /// `("chunk", size)`, `("prefix", len)`, `("document", q_ids, kv_ids, bounds)` (`bounds`
    /// the q-indexed key bounds `(starts, ends)`, int32 `[rows, Lq]`, when every id is one run
    /// of keys in every row, else `None`) and
    /// `("band", f, g, lo, hi, (min, max))` with read-only int64 arrays `[rows, L]` (`rows` 1 or
    /// B) viewing the mask's data (the band's least and greatest feature value after them),
    /// `("dense",)` and
    /// `("blocks",)` (their data stays native: the plan's bit table covers them),
    /// `("and", (..))`, `("or", (..))`, `("not", child)`, `("heads", (..))`. Trees deeper
    /// than the planner accepts are refused (the walk recurses).
    fn _tree<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let depth = self.inner.depth();
        if depth > MAX_TREE_DEPTH {
            return Err(PyValueError::new_err(format!(
                "mask: tree depth {depth} exceeds the limit {MAX_TREE_DEPTH}"
            )));
        }
        tree(py, &self.inner)
    }
    /// Whether query `i` may attend key `j` in batch row `b`, head `h`.
    #[pyo3(signature = (i, j, b=0, h=0))]
    fn allowed(&self, i: usize, j: usize, b: usize, h: usize) -> bool {
        self.inner.allowed(b, h, i, j)
    }
}

/// Keeps alive the mask data that read-only numpy views of [`PyMask::_tree`] borrow.
#[pyclass(frozen)]
struct Held(#[allow(dead_code)] Arc<dyn std::any::Any + Send + Sync>);

/// `ids` as a read-only int64 numpy array `[rows, L]` viewing the mask's own data (no copy),
/// kept alive by `owner` (a [`Held`] of the `Arc` that owns `ids`).
fn rows_array<'py>(ids: &SegmentIds, owner: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let view = numpy::ndarray::ArrayView2::from_shape((ids.rows(), ids.len()), ids.ids())
        .map_err(|e| PyValueError::new_err(format!("mask: ids of the wrong size: {e}")))?;
    // SAFETY: `owner` holds the `Arc` owning `ids`, which is immutable while it lives; the view
    // is made read-only below, so numpy never writes to it.
    let arr = unsafe { numpy::PyArray2::borrow_from_array(&view, owner.clone()) };
    // SAFETY: clearing a flag of the array just created (no other reference to it yet).
    unsafe { (*arr.as_array_ptr()).fields.flags &= !numpy::npyffi::flags::NPY_ARRAY_WRITEABLE };
    Ok(arr.into_any())
}

/// Per batch row of a `document` leaf (`rows` = the larger side's), each query's document as
/// key bounds `[start, end)` (int32 `[rows, Lq]`, row-major; `(0, 0)` for padding queries and
/// ids no key has): `Some((rows, starts, ends))` when, in every key row, each id is one
/// contiguous run of keys (and the keys fit int32), else `None` (the ids must be compared).
fn document_bounds(s: &Segments) -> Option<(usize, Vec<i32>, Vec<i32>)> {
    let rows = s.rows();
    let (lq, lkv) = (s.q.len(), s.kv.len());
    if i32::try_from(lkv).is_err() {
        return None;
    }
    let (mut starts, mut ends) = (vec![0i32; rows * lq], vec![0i32; rows * lq]);
    let mut run_of: HashMap<i64, (i32, i32)> = HashMap::new();
    for r in 0..rows {
        run_of.clear();
        let kv = s.kv.row(r);
        let mut j = 0;
        while j < lkv {
            let id = kv[j];
            let start = j;
            while j < lkv && kv[j] == id {
                j += 1;
            }
            if id >= 0 && run_of.insert(id, (start as i32, j as i32)).is_some() {
                return None; // an id in two runs
            }
        }
        let (st, en) = (
            &mut starts[r * lq..(r + 1) * lq],
            &mut ends[r * lq..(r + 1) * lq],
        );
        let q = s.q.row(r);
        let mut i = 0;
        while i < lq {
            // One lookup per run of equal query ids.
            let id = q[i];
            let (a, b) = if id >= 0 {
                run_of.get(&id).copied().unwrap_or((0, 0))
            } else {
                (0, 0)
            };
            while i < lq && q[i] == id {
                st[i] = a;
                en[i] = b;
                i += 1;
            }
        }
    }
    Some((rows, starts, ends))
}

/// `(min, max)` over both features of a band (kept by the features since their construction).
fn feature_span(f: &BandFeatures) -> (i64, i64) {
    let ((ql, qh), (kl, kh)) = (f.q.span(), f.kv.span());
    (ql.min(kl), qh.max(kh))
}

/// One node of [`PyMask::_tree`]; depth is bounded by the caller's check.
fn tree<'py>(py: Python<'py>, m: &Mask) -> PyResult<Bound<'py, PyTuple>> {
    let kids = |v: &[Mask]| -> PyResult<Bound<'py, PyTuple>> {
        let items = v
            .iter()
            .map(|c| tree(py, c))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    };
    Ok(match m {
        Mask::Full => PyTuple::new(py, ["full"])?,
        Mask::Causal { offset } => ("causal", *offset).into_pyobject(py)?,
        Mask::Window { left, right } => ("window", *left, *right).into_pyobject(py)?,
        Mask::Chunk { size } => ("chunk", *size).into_pyobject(py)?,
        Mask::Prefix { len } => ("prefix", *len).into_pyobject(py)?,
        Mask::Document(s) => {
            let owner = Bound::new(py, Held(s.clone()))?.into_any();
            let bounds = match document_bounds(s) {
                Some((rows, starts, ends)) => {
                    let len = s.q.len();
                    let starts = starts.into_pyarray(py).reshape([rows, len])?;
                    let ends = ends.into_pyarray(py).reshape([rows, len])?;
                    (starts, ends).into_pyobject(py)?.into_any()
                }
                None => py.None().into_bound(py),
            };
            let (q, kv) = (rows_array(&s.q, &owner)?, rows_array(&s.kv, &owner)?);
            ("document", q, kv, bounds).into_pyobject(py)?
        }
        Mask::Band { features, lo, hi } => {
            let owner = Bound::new(py, Held(features.clone()))?.into_any();
            (
                "band",
                rows_array(&features.q, &owner)?,
                rows_array(&features.kv, &owner)?,
                *lo,
                *hi,
                feature_span(features),
            )
                .into_pyobject(py)?
        }
        Mask::Dense(_) => PyTuple::new(py, ["dense"])?,
        Mask::Blocks(_) => PyTuple::new(py, ["blocks"])?,
        Mask::And(v) => ("and", kids(v)?).into_pyobject(py)?,
        Mask::Or(v) => ("or", kids(v)?).into_pyobject(py)?,
        Mask::Not(c) => ("not", tree(py, c)?).into_pyobject(py)?,
        Mask::Heads(v) => ("heads", kids(v)?).into_pyobject(py)?,
    })
}

/// Segment ids from an int64 array `[L]` or `[B, L]` (-1 = padding).
pub fn segment_ids(name: &str, a: PyReadonlyArrayDyn<'_, i64>) -> PyResult<SegmentIds> {
    int_rows(name, "segment ids", a)
}

/// An int64 array `[L]` or `[B, L]` of `what` (segment ids, a band feature); errors name `name`.
fn int_rows(name: &str, what: &str, a: PyReadonlyArrayDyn<'_, i64>) -> PyResult<SegmentIds> {
    let shape = a.shape().to_vec();
    let ids: Vec<i64> = a.as_array().iter().copied().collect();
    let r = match shape.as_slice() {
        [l] => SegmentIds::named(name, 1, *l, ids),
        [b, l] => SegmentIds::named(name, *b, *l, ids),
        _ => {
            return Err(PyValueError::new_err(format!(
                "{name}: expected {what} of shape [L] or [B, L], got {shape:?}"
            )))
        }
    };
    r.map_err(to_py)
}

fn dense_mask(name: &str, a: PyReadonlyArrayDyn<'_, bool>) -> PyResult<DenseMask> {
    let shape = a.shape().to_vec();
    let vals: Vec<bool> = a.as_array().iter().copied().collect();
    DenseMask::new(&shape, &vals, name).map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

pub(crate) fn wrap(inner: Mask) -> PyMask {
    PyMask { inner }
}

#[pyfunction]
pub fn full() -> PyMask {
    wrap(Mask::full())
}

#[pyfunction]
#[pyo3(signature = (offset=0))]
pub fn causal(offset: i64) -> PyMask {
    wrap(Mask::causal_offset(offset))
}

#[pyfunction]
#[pyo3(signature = (left, right=0))]
pub fn window(left: i64, right: i64) -> PyMask {
    // Negative sides are allowed, as in the text form and the Rust API (`i - L <= j <= i + R`).
    wrap(Mask::window(left, right))
}

#[pyfunction]
pub fn chunk(size: u64) -> PyResult<PyMask> {
    if size == 0 {
        return Err(PyValueError::new_err("chunk: expected size >= 1, got 0"));
    }
    Ok(wrap(Mask::chunk(size)))
}

#[pyfunction]
pub fn prefix(n: u64) -> PyMask {
    wrap(Mask::prefix(n))
}

/// `document` over segment ids (`kv_ids` for cross attention).
#[pyfunction]
#[pyo3(signature = (ids, kv_ids=None))]
pub fn document(
    ids: PyReadonlyArrayDyn<'_, i64>,
    kv_ids: Option<PyReadonlyArrayDyn<'_, i64>>,
) -> PyResult<PyMask> {
    let q = segment_ids("ids", ids)?;
    let seg = match kv_ids {
        None => Segments::shared(q),
        Some(k) => Segments::cross(q, segment_ids("kv_ids", k)?).map_err(to_py)?,
    };
    Ok(wrap(Mask::document(seg)))
}

/// `band`: `lo <= q_feature[b, i] - kv_feature[b, j] <= hi` (exact; `lo > hi` is refused).
#[pyfunction]
pub fn band(
    q_feature: PyReadonlyArrayDyn<'_, i64>,
    kv_feature: PyReadonlyArrayDyn<'_, i64>,
    lo: i64,
    hi: i64,
) -> PyResult<PyMask> {
    if lo > hi {
        return Err(PyValueError::new_err(format!(
            "band: lo must be <= hi, got lo={lo} > hi={hi}"
        )));
    }
    let q = int_rows("q_feature", "a feature", q_feature)?;
    let kv = int_rows("kv_feature", "a feature", kv_feature)?;
    let features = BandFeatures::new("q_feature", q, "kv_feature", kv);
    Ok(wrap(Mask::band(features, lo, hi)))
}

#[pyfunction]
pub fn dense(values: PyReadonlyArrayDyn<'_, bool>) -> PyResult<PyMask> {
    Ok(wrap(Mask::dense(dense_mask("dense", values)?)))
}

/// An int64 array's shape and entries (row-major).
fn int_entries(a: &PyReadonlyArrayDyn<'_, i64>) -> (Vec<usize>, Vec<i64>) {
    let shape = a.shape().to_vec();
    let v = match a.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => a.as_array().iter().copied().collect(),
    };
    (shape, v)
}

/// The `blocks` leaf: key blocks `kv_tiles [B, H, Tq, k]` (-1 = none) selected per query
/// block, for blocks of `q_block` x `kv_block` tokens; `label` names the data in the text form.
#[pyfunction]
#[pyo3(signature = (kv_tiles, q_block, kv_block, label="kv_tiles"))]
pub fn blocks(
    py: Python<'_>,
    kv_tiles: PyReadonlyArrayDyn<'_, i64>,
    q_block: usize,
    kv_block: usize,
    label: &str,
) -> PyResult<PyMask> {
    let (shape, v) = int_entries(&kv_tiles);
    let sel = py
        .detach(|| BlockSelection::new(&shape, &v, q_block, kv_block, label))
        .map_err(to_py)?;
    Ok(wrap(Mask::blocks(sel)))
}

#[pyfunction]
pub fn heads(masks: Vec<PyRef<'_, PyMask>>) -> PyResult<PyMask> {
    if masks.is_empty() {
        return Err(PyValueError::new_err("heads: expected at least one mask"));
    }
    Ok(wrap(Mask::heads(
        masks.iter().map(|m| m.inner.clone()).collect(),
    )))
}

/// What the parser's `document`, `dense(NAME)`, `band(F, G, ..)` and `blocks(QB, KVB, NAME)`
/// leaves resolve to.
struct Data {
    segments: Option<Arc<Segments>>,
    dense: HashMap<String, DenseMask>,
    features: HashMap<String, SegmentIds>,
    /// Shape and entries of each block selection (its block sizes come from the text).
    blocks: HashMap<String, (Vec<usize>, Vec<i64>)>,
}

impl Resolver for Data {
    fn segments(&self) -> TResult<Arc<Segments>> {
        self.segments.clone().ok_or_else(|| {
            tessera::Error::invalid(
                "document",
                "segment ids (segments=..., or q_segments= and kv_segments=)",
                "none given",
            )
        })
    }
    fn dense(&self, name: &str) -> TResult<DenseMask> {
        self.dense.get(name).cloned().ok_or_else(|| {
            tessera::Error::invalid(
                format!("dense({name})"),
                "an array passed as dense={'NAME': array}",
                "no such name",
            )
        })
    }
    fn feature(&self, name: &str) -> TResult<SegmentIds> {
        self.features.get(name).cloned().ok_or_else(|| {
            tessera::Error::invalid(
                format!("band feature {name}"),
                "an integer array passed as features={'NAME': array}",
                "no such name",
            )
        })
    }

    fn blocks(&self, name: &str, q_block: usize, kv_block: usize) -> TResult<BlockSelection> {
        let (shape, v) = self.blocks.get(name).ok_or_else(|| {
            tessera::Error::invalid(
                format!("blocks({q_block}, {kv_block}, {name})"),
                "an integer array passed as blocks={'NAME': kv_tiles}",
                "no such name",
            )
        })?;
        BlockSelection::new(shape, v, q_block, kv_block, name)
    }
}

/// The `{name: array}` mapping passed as `arg` (`dense=`, `features=`), each numpy array of
/// element type `dtype` converted by `convert` (which names it `arg['name']`).
fn named_arrays<'py, E: numpy::Element, T>(
    table: Option<&Bound<'py, PyDict>>,
    arg: &str,
    dtype: &str,
    convert: impl Fn(&str, PyReadonlyArrayDyn<'py, E>) -> PyResult<T>,
) -> PyResult<HashMap<String, T>> {
    let mut out = HashMap::new();
    for (k, v) in table.iter().flat_map(|d| d.iter()) {
        let name: String = k.extract().map_err(|_| {
            PyTypeError::new_err(format!("{arg}: expected a dict of str -> {dtype} array"))
        })?;
        let what = format!("{arg}['{name}']");
        let arr: PyReadonlyArrayDyn<'py, E> = v
            .extract()
            .map_err(|_| PyTypeError::new_err(format!("{what}: expected a numpy {dtype} array")))?;
        out.insert(name, convert(&what, arr)?);
    }
    Ok(out)
}

/// Parses a mask expression (`causal & document`, `window(4K) | prefix(64)`,
/// `band(t, t, 0, 64)` with `features={'t': ...}`, ...).
#[pyfunction]
#[pyo3(signature = (expr, segments=None, q_segments=None, kv_segments=None, dense=None, features=None, blocks=None))]
pub fn mask(
    expr: &str,
    segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    q_segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    kv_segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    dense: Option<&Bound<'_, PyDict>>,
    features: Option<&Bound<'_, PyDict>>,
    blocks: Option<&Bound<'_, PyDict>>,
) -> PyResult<PyMask> {
    let segments = match (segments, q_segments, kv_segments) {
        (Some(s), None, None) => Some(Segments::shared(segment_ids("segments", s)?)),
        (None, Some(q), Some(k)) => Some(
            Segments::cross(
                segment_ids("q_segments", q)?,
                segment_ids("kv_segments", k)?,
            )
            .map_err(to_py)?,
        ),
        (None, None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "segments: pass either segments=, or both q_segments= and kv_segments=",
            ))
        }
    };
    let data = Data {
        segments,
        dense: named_arrays(dense, "dense", "bool", |n, a| dense_mask(n, a))?,
        features: named_arrays(features, "features", "int64", |n, a| {
            int_rows(n, "a feature", a)
        })?,
        blocks: named_arrays(blocks, "blocks", "int64", |_, a| Ok(int_entries(&a)))?,
    };
    parse(expr, &data).map(wrap).map_err(to_py)
}
