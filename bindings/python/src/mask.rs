//! Masks from Python: the same algebra and spelling as Rust and the CLI (docs/semantics.md#masks). Typed
//! constructors (`causal()`, `document(ids)`, `band(f, g, lo, hi)`, ...) combine with `&`, `|`,
//! `~`; `mask(text, ...)` parses the CLI's expression language with the segment ids, dense arrays,
//! band features and block selections passed in.
//!
//! Contract: a `Mask` is immutable. `str(mask)` is its text form (Rust's `Display`, the CLI's
//! language) and `tessera.mask(str(m), **m.data())` is a mask equal to `m`: the typed
//! constructors name their data by content (`document(ids_<hex>)`, `band(f_<hex>, ...)`,
//! `dense(dense_<hex>)`, `blocks(QB, KVB, sel_<hex>)`, the first 8 bytes of the data's BLAKE3
//! digest), so different data never share a name. `mask.canonical()` is the canonical form
//! (operands sorted, data by full digest): equality and hashing use it. Integer arrays (segment ids, band
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
    /// The text form, which `tessera.mask(str(m), **m.data())` parses back to an equal mask.
    fn __str__(&self) -> String {
        self.inner.to_string()
    }
    fn __repr__(&self) -> String {
        format!("tessera.Mask('{}')", self.inner)
    }
    /// The canonical form: `&`/`|` operands sorted and deduplicated, data by digest; equal
    /// masks (same semantics and data) have equal canonical forms.
    fn canonical(&self) -> String {
        self.inner.canonical()
    }
    /// The keyword arguments of `tessera.mask` that resolve the data named in `str(self)`:
    /// `segments` (or `q_segments` and `kv_segments`) for a bare `document`, and the
    /// `documents`, `features`, `dense` and `blocks` mappings by name (copies of the data,
    /// numpy arrays). `ValueError` when the text form cannot tell two data apart: one name for
    /// two different arrays, or bare `document` leaves over different ids (masks parsed
    /// separately with the same names and combined).
    fn data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        mask_data(py, &self.inner)
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

/// The first 8 bytes of `digest` in hex after `prefix`: the name the typed constructors give
/// their data, so that equal data share a name and different data (almost surely) do not.
fn content_name(prefix: &str, digest: &[u8; 32]) -> String {
    digest[..8].iter().fold(String::from(prefix), |mut s, b| {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Records `value` (with its digest) under `name` in one of [`mask_data`]'s tables, refusing a
/// second, different value under the same name.
fn bind<T>(
    table: &mut Vec<(String, [u8; 32], T)>,
    what: &str,
    name: &str,
    digest: &[u8; 32],
    value: impl FnOnce() -> T,
) -> PyResult<()> {
    match table.iter().find(|(n, _, _)| n == name) {
        Some((_, d, _)) if d == digest => Ok(()),
        Some(_) => Err(PyValueError::new_err(format!(
            "mask: two different {what} are both named '{name}' in the text form; rebuild the \
             mask with distinct names (or with the typed constructors, which name data by content)"
        ))),
        None => {
            table.push((name.to_string(), *digest, value()));
            Ok(())
        }
    }
}

/// A `[rows, L]` int64 numpy copy of `ids`.
fn ids_array<'py>(py: Python<'py>, ids: &SegmentIds) -> PyResult<Bound<'py, PyAny>> {
    Ok(ids
        .ids()
        .to_vec()
        .into_pyarray(py)
        .reshape([ids.rows(), ids.len()])?
        .into_any())
}

/// A bool numpy copy of a dense mask in the rank it was given (the rank is part of its digest).
fn dense_array<'py>(py: Python<'py>, d: &DenseMask) -> PyResult<Bound<'py, PyAny>> {
    let (lq, lkv) = (d.q_len(), d.kv_len());
    let slices = d.batch() * d.heads();
    let mut vals = Vec::with_capacity(slices * lq * lkv);
    for s in 0..slices {
        for i in 0..lq {
            let row = d.row_bits(s, i);
            vals.extend((0..lkv).map(|j| (row[j / 64] >> (j % 64)) & 1 == 1));
        }
    }
    let shape: Vec<usize> = match d.rank() {
        2 => vec![lq, lkv],
        3 => vec![d.heads(), lq, lkv],
        _ => vec![d.batch(), d.heads(), lq, lkv],
    };
    Ok(vals.into_pyarray(py).reshape(shape)?.into_any())
}

/// A block selection as int64 `[B, H, Tq, k]` (`k` its longest row, `-1` padding): the same
/// selection (its digest covers the sorted distinct entries and block sizes only).
fn blocks_array<'py>(py: Python<'py>, s: &BlockSelection) -> PyResult<Bound<'py, PyAny>> {
    let slices = s.batch() * s.heads();
    let tq = s.rows();
    let k = (0..slices)
        .flat_map(|sl| (0..tq).map(move |r| (sl, r)))
        .map(|(sl, r)| s.row(sl, r).len())
        .max()
        .unwrap_or(0);
    let mut v = vec![-1i64; slices * tq * k];
    for sl in 0..slices {
        for r in 0..tq {
            let at = (sl * tq + r) * k;
            for (c, &t) in s.row(sl, r).iter().enumerate() {
                v[at + c] = i64::from(t);
            }
        }
    }
    Ok(v.into_pyarray(py)
        .reshape([s.batch(), s.heads(), tq, k])?
        .into_any())
}

/// [`PyMask::data`]: every data leaf of `m` (walked without recursion) bound by its name.
fn mask_data<'py>(py: Python<'py>, m: &Mask) -> PyResult<Bound<'py, PyDict>> {
    type Table<'m, T> = Vec<(String, [u8; 32], T)>;
    let mut unnamed: Option<&Segments> = None;
    let mut documents: Table<&SegmentIds> = Vec::new();
    let mut features: Table<&SegmentIds> = Vec::new();
    let mut dense: Table<&DenseMask> = Vec::new();
    let mut blocks: Table<&BlockSelection> = Vec::new();
    for node in m.nodes() {
        match node {
            Mask::Document(s) => match &s.names {
                Some((qn, kn)) => {
                    bind(&mut documents, "segment ids", qn, s.q.digest(), || &s.q)?;
                    bind(&mut documents, "segment ids", kn, s.kv.digest(), || &s.kv)?;
                }
                None => match unnamed {
                    Some(u) if u.q.digest() != s.q.digest() || u.kv.digest() != s.kv.digest() => {
                        return Err(PyValueError::new_err(
                            "mask: two bare `document` leaves over different segment ids; the \
                             text form names one set (build them with tessera.document, which \
                             names each set)",
                        ))
                    }
                    _ => unnamed = Some(s),
                },
            },
            Mask::Band { features: f, .. } => {
                bind(
                    &mut features,
                    "band features",
                    &f.q_name,
                    f.q.digest(),
                    || &f.q,
                )?;
                bind(
                    &mut features,
                    "band features",
                    &f.kv_name,
                    f.kv.digest(),
                    || &f.kv,
                )?;
            }
            Mask::Dense(d) => bind(&mut dense, "dense arrays", d.label(), d.digest(), || &**d)?,
            Mask::Blocks(b) => bind(
                &mut blocks,
                "block selections",
                b.label(),
                b.digest(),
                || &**b,
            )?,
            _ => {}
        }
    }
    let out = PyDict::new(py);
    if let Some(s) = unnamed {
        if s.q.digest() == s.kv.digest() {
            out.set_item("segments", ids_array(py, &s.q)?)?;
        } else {
            out.set_item("q_segments", ids_array(py, &s.q)?)?;
            out.set_item("kv_segments", ids_array(py, &s.kv)?)?;
        }
    }
    let put = |key: &str, items: Vec<(String, Bound<'py, PyAny>)>| -> PyResult<()> {
        if !items.is_empty() {
            let d = PyDict::new(py);
            for (k, v) in items {
                d.set_item(k, v)?;
            }
            out.set_item(key, d)?;
        }
        Ok(())
    };
    let arrays = |t: Table<&SegmentIds>| -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        t.into_iter()
            .map(|(n, _, v)| Ok((n, ids_array(py, v)?)))
            .collect()
    };
    put("documents", arrays(documents)?)?;
    put("features", arrays(features)?)?;
    put(
        "dense",
        dense
            .into_iter()
            .map(|(n, _, v)| Ok((n, dense_array(py, v)?)))
            .collect::<PyResult<_>>()?,
    )?;
    put(
        "blocks",
        blocks
            .into_iter()
            .map(|(n, _, v)| Ok((n, blocks_array(py, v)?)))
            .collect::<PyResult<_>>()?,
    )?;
    Ok(out)
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
    let kv = match kv_ids {
        None => q.clone(),
        Some(k) => segment_ids("kv_ids", k)?,
    };
    // Named by content, so that str() tells documents over different ids apart.
    let (qn, kn) = (
        content_name("ids_", q.digest()),
        content_name("ids_", kv.digest()),
    );
    let seg = Segments::named(qn, q, kn, kv).map_err(to_py)?;
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
    let (qn, kn) = (
        content_name("f_", q.digest()),
        content_name("f_", kv.digest()),
    );
    let features = BandFeatures::new(qn, q, kn, kv);
    Ok(wrap(Mask::band(features, lo, hi)))
}

#[pyfunction]
pub fn dense(values: PyReadonlyArrayDyn<'_, bool>) -> PyResult<PyMask> {
    let d = dense_mask("dense", values)?;
    let name = content_name("dense_", d.digest());
    Ok(wrap(Mask::dense(d.with_label(name))))
}

/// `dense` from rows already packed (uint64 `[..., Lq, ceil(kv_len / 64)]`, bit `j % 64` of word
/// `j / 64` is key `j`, bits past `kv_len` clear): the same mask as `dense` of the unpacked bools
/// at an eighth of the memory on the way in (`tessera.from_mask_mod` packs as it evaluates).
#[pyfunction]
pub fn dense_words(
    py: Python<'_>,
    words: PyReadonlyArrayDyn<'_, u64>,
    kv_len: usize,
) -> PyResult<PyMask> {
    let mut shape = words.shape().to_vec();
    if kv_len == 0 || shape.last() != Some(&kv_len.div_ceil(64)) {
        return Err(PyValueError::new_err(format!(
            "dense: expected words [..., Lq, {}] for kv_len={kv_len}, got {shape:?}",
            kv_len.div_ceil(64)
        )));
    }
    if let Some(last) = shape.last_mut() {
        *last = kv_len;
    }
    let w: Vec<u64> = match words.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => words.as_array().iter().copied().collect(),
    };
    let d = py
        .detach(|| DenseMask::from_words(&shape, w, "dense"))
        .map_err(to_py)?;
    let name = content_name("dense_", d.digest());
    Ok(wrap(Mask::dense(d.with_label(name))))
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
/// block, for blocks of `q_block` x `kv_block` tokens; `label` names the data in the text form
/// (by default `sel_<hex>`, by content; errors name it `kv_tiles`).
#[pyfunction]
#[pyo3(signature = (kv_tiles, q_block, kv_block, label=None))]
pub fn blocks(
    py: Python<'_>,
    kv_tiles: PyReadonlyArrayDyn<'_, i64>,
    q_block: usize,
    kv_block: usize,
    label: Option<&str>,
) -> PyResult<PyMask> {
    let (shape, v) = int_entries(&kv_tiles);
    let sel = py
        .detach(|| BlockSelection::new(&shape, &v, q_block, kv_block, "kv_tiles"))
        .map_err(to_py)?;
    Ok(wrap(Mask::blocks(match label {
        Some(l) => sel.with_label(l),
        None => {
            let name = content_name("sel_", sel.digest());
            sel.with_text_name(name)
        }
    })))
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
    /// Segment ids of `document(NAME)` / `document(Q, KV)` leaves.
    documents: HashMap<String, SegmentIds>,
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
        // Labelled by its name in the text (errors while converting named it `dense['NAME']`).
        self.dense
            .get(name)
            .map(|d| d.clone().with_label(name))
            .ok_or_else(|| {
                no_such_name(
                    format!("dense({name})"),
                    "an array passed as dense={'NAME': array}",
                )
            })
    }
    fn segment_ids(&self, name: &str) -> TResult<SegmentIds> {
        self.documents.get(name).cloned().ok_or_else(|| {
            no_such_name(
                format!("document({name})"),
                "segment ids passed as documents={'NAME': ids}",
            )
        })
    }
    fn feature(&self, name: &str) -> TResult<SegmentIds> {
        self.features.get(name).cloned().ok_or_else(|| {
            no_such_name(
                format!("band feature {name}"),
                "an integer array passed as features={'NAME': array}",
            )
        })
    }

    fn blocks(&self, name: &str, q_block: usize, kv_block: usize) -> TResult<BlockSelection> {
        let (shape, v) = self.blocks.get(name).ok_or_else(|| {
            no_such_name(
                format!("blocks({q_block}, {kv_block}, {name})"),
                "an integer array passed as blocks={'NAME': kv_tiles}",
            )
        })?;
        BlockSelection::new(shape, v, q_block, kv_block, name)
    }
}

/// A leaf of the text names data the call did not pass (`leaf`: the leaf as written; `expected`:
/// the keyword that passes it).
fn no_such_name(leaf: String, expected: &str) -> tessera::Error {
    tessera::Error::invalid(leaf, expected, "no such name")
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
// One argument per keyword of `tessera.mask` (each data mapping its own, as the text names them).
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (expr, segments=None, q_segments=None, kv_segments=None, dense=None, features=None, blocks=None, documents=None))]
pub fn mask(
    expr: &str,
    segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    q_segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    kv_segments: Option<PyReadonlyArrayDyn<'_, i64>>,
    dense: Option<&Bound<'_, PyDict>>,
    features: Option<&Bound<'_, PyDict>>,
    blocks: Option<&Bound<'_, PyDict>>,
    documents: Option<&Bound<'_, PyDict>>,
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
        documents: named_arrays(documents, "documents", "int64", |n, a| {
            int_rows(n, "segment ids", a)
        })?,
        dense: named_arrays(dense, "dense", "bool", |n, a| dense_mask(n, a))?,
        features: named_arrays(features, "features", "int64", |n, a| {
            int_rows(n, "a feature", a)
        })?,
        blocks: named_arrays(blocks, "blocks", "int64", |_, a| Ok(int_entries(&a)))?,
    };
    parse(expr, &data).map(wrap).map_err(to_py)
}
