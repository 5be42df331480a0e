//! XLA FFI custom-call targets: Tessera's CPU kernels called from compiled JAX programs
//! (`tessera.jax.attention` on CPU), zero-copy on XLA's buffers.
//!
//! Contract:
//! - Three targets, each an `XLA_FFI_Handler` (typed FFI, API version 0.1) handed to
//!   `jax.ffi.register_ffi_target` as a PyCapsule ([`ffi_targets`]): `tessera_attention_fwd`,
//!   `tessera_attention_fwd_logged` (the forward plus the telemetry summary) and
//!   `tessera_attention_bwd`. The operand and result order, attribute names and layouts are
//!   those `tessera/engines/native_xla.py` declares; each handler checks them and reports a mismatch as an
//!   error, never by reading out of bounds.
//! - The plan travels as a traced `int64` scalar operand: a handle issued by [`ffi_register`]
//!   (random 63-bit values, so a forged or stale handle names no plan). The registry holds the
//!   plan until [`ffi_release`]; a handler clones the entry under the lock, so a release during
//!   a running call cannot free what the call reads.
//! - Layout attribute `layout`: 0 when q, k, v and dO are `[B, H, L, D]` row-major; 1 when
//!   they are `[B, L, H, D]` row-major (`jax.nn.dot_product_attention`'s layout), read in place
//!   through strides. Outputs (O, dQ, dK, dV) and the saved O are always `[B, H, L, D]` in
//!   memory: for layout 1 the JAX side declares them with the layout that makes XLA see them
//!   as `[B, L, H, D]` arrays (no copy made here).
//! - Errors are `XLA_FFI_Error`s (INVALID_ARGUMENT for bad input, INTERNAL otherwise) whose
//!   message names the argument; a panic never crosses the C boundary.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tessera::{
    AttnInputs, Backend, CpuBackend, CpuPlan, Error, ForwardOut, GradInputs, GradOut, Mask,
    OutData, Par, Plan, StridedView, TensorView, ViewData,
};

use crate::attention::{
    checked_telemetry_config, give_workspace, head_row, options, take_workspace, Kind, STAT_COLUMNS,
};
use crate::plan::{prepare_once, PyPlan};

// -- the C structs of xla/ffi/api/c_api.h (only the fields read or written here) -------------

#[repr(C)]
struct ExtensionBase {
    struct_size: usize,
    kind: i32,
    next: *mut ExtensionBase,
}

const EXTENSION_METADATA: i32 = 1;

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    major: i32,
    minor: i32,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const c_char,
    errc: i32,
}

type ErrorCreate = unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void;

#[repr(C)]
struct Api {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *const c_void,
    error_create: Option<ErrorCreate>,
}

#[repr(C)]
struct Buffer {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    dtype: i32,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

#[repr(C)]
struct List {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *const i32,
    items: *const *mut c_void,
}

#[repr(C)]
struct ByteSpan {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
struct Scalar {
    dtype: i32,
    value: *const c_void,
}

#[repr(C)]
struct Attrs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *const i32,
    names: *const *const ByteSpan,
    attrs: *const *const c_void,
}

#[repr(C)]
struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api: *const Api,
    ctx: *mut c_void,
    stage: i32,
    args: List,
    rets: List,
    attrs: Attrs,
    future: *mut c_void,
}

#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

#[repr(C)]
struct MetadataExtension {
    extension_base: ExtensionBase,
    metadata: *mut Metadata,
}

const STAGE_EXECUTE: i32 = 3;
const ARG_BUFFER: i32 = 1;
const ATTR_SCALAR: i32 = 3;
const DTYPE_PRED: i32 = 1;
const DTYPE_S32: i32 = 4;
const DTYPE_S64: i32 = 5;
const DTYPE_F32: i32 = 11;
const DTYPE_F64: i32 = 12;
const DTYPE_BF16: i32 = 16;
const ERRC_INVALID_ARGUMENT: i32 = 3;
const ERRC_INTERNAL: i32 = 13;

// -- the plan registry ---------------------------------------------------------------------

/// What a handler needs of a plan, shared with the `PyPlan` it came from.
struct Entry {
    plan: Arc<Plan>,
    /// The planned mask; for a rank's local plan of a sharding, the global plan's mask.
    mask: Option<Mask>,
    prepared: Arc<OnceLock<CpuPlan>>,
    /// For a local plan: the global position of each local key (`None`: padding) and the
    /// global key count, so telemetry finds the sink keys of the permuted local K/V.
    kv_positions: Option<(Vec<Option<usize>>, usize)>,
}

fn insert(entry: Entry) -> PyResult<i64> {
    let mut r = registry()
        .lock()
        .map_err(|_| PyValueError::new_err("plan: the FFI plan registry is poisoned"))?;
    loop {
        let h = fresh_handle();
        if let std::collections::hash_map::Entry::Vacant(v) = r.entry(h) {
            v.insert(Arc::new(entry));
            return Ok(h);
        }
    }
}

fn registry() -> &'static Mutex<HashMap<i64, Arc<Entry>>> {
    static R: OnceLock<Mutex<HashMap<i64, Arc<Entry>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A fresh random positive 62-bit handle (std's randomly keyed hasher over a counter).
fn fresh_handle() -> i64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let state = std::collections::hash_map::RandomState::new();
    loop {
        let h = (state.hash_one(N.fetch_add(1, Ordering::Relaxed)) >> 2) as i64;
        if h != 0 {
            return h;
        }
    }
}

/// Registers `plan` for the FFI handlers; returns its handle (one per call).
#[pyfunction]
pub fn ffi_register(py: Python<'_>, plan: PyRef<'_, PyPlan>) -> PyResult<i64> {
    insert(Entry {
        plan: plan.whole(py)?.clone(),
        mask: plan.mask.clone(),
        prepared: plan.prepared.clone(),
        kv_positions: None,
    })
}

/// Registers a rank's local plan `local` of a sharding of `global_plan`, whose local key `j` is
/// global key `kv_positions[j]` (`-1`: padding); returns its handle.
#[pyfunction]
pub fn ffi_register_local(
    local: PyRef<'_, PyPlan>,
    global_plan: PyRef<'_, PyPlan>,
    kv_positions: Vec<i64>,
) -> PyResult<i64> {
    let (lkv, gkv) = (local.tiles().shape.kv_len, global_plan.tiles().shape.kv_len);
    if kv_positions.len() != lkv {
        return Err(PyValueError::new_err(format!(
            "kv_positions: expected {lkv} positions (the local plan's keys), got {}",
            kv_positions.len()
        )));
    }
    let positions = kv_positions
        .iter()
        .map(|&p| match usize::try_from(p) {
            Ok(p) if p < gkv => Ok(Some(p)),
            Ok(_) => Err(PyValueError::new_err(format!(
                "kv_positions: {p} is past the global plan's {gkv} keys"
            ))),
            Err(_) if p == -1 => Ok(None),
            Err(_) => Err(PyValueError::new_err(format!(
                "kv_positions: {p} is neither a key position nor -1"
            ))),
        })
        .collect::<PyResult<Vec<_>>>()?;
    insert(Entry {
        plan: local.tiles().clone(),
        mask: global_plan.mask.clone(),
        prepared: local.prepared.clone(),
        kv_positions: Some((positions, gkv)),
    })
}

/// Forgets `handle` (a no-op for an unknown one). Calls already running keep their plan.
#[pyfunction]
pub fn ffi_release(handle: i64) {
    if let Ok(mut r) = registry().lock() {
        r.remove(&handle);
    }
}

/// Whether `handle` names a registered plan.
#[pyfunction]
pub fn ffi_registered(handle: i64) -> bool {
    registry()
        .lock()
        .map(|r| r.contains_key(&handle))
        .unwrap_or(false)
}

/// How many plans the registry holds (tests check that released plans leave it).
#[pyfunction]
pub fn ffi_registry_size() -> usize {
    registry().lock().map(|r| r.len()).unwrap_or(0)
}

fn lookup(handle: i64) -> Result<Arc<Entry>, Failure> {
    let r = registry()
        .lock()
        .map_err(|_| Failure::internal("the FFI plan registry is poisoned".into()))?;
    r.get(&handle).cloned().ok_or_else(|| {
        Failure::user(format!(
            "plan: handle {handle} names no live plan (the Plan was freed, or the handle was \
             not made by tessera.jax)"
        ))
    })
}

// -- decoding a call frame -------------------------------------------------------------------

/// An error to hand back to XLA.
struct Failure {
    code: i32,
    message: String,
}

impl Failure {
    fn user(message: String) -> Self {
        Failure {
            code: ERRC_INVALID_ARGUMENT,
            message,
        }
    }
    fn internal(message: String) -> Self {
        Failure {
            code: ERRC_INTERNAL,
            message,
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = if e.is_user_error() {
            ERRC_INVALID_ARGUMENT
        } else {
            ERRC_INTERNAL
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

/// One buffer operand or result.
struct Buf {
    dtype: i32,
    data: *mut c_void,
    dims: Vec<usize>,
}

impl Buf {
    fn len(&self) -> usize {
        self.dims.iter().product()
    }
}

enum AttrValue {
    Int(i64),
    Float(f64),
}

/// The decoded frame: operands, results and scalar attributes by name.
struct Frame {
    args: Vec<Buf>,
    rets: Vec<Buf>,
    attrs: HashMap<String, AttrValue>,
}

/// # Safety
/// `list` comes from a live XLA call frame: `size` entries of `types` and `items`, each a
/// buffer pointer for buffer entries.
unsafe fn buffers(list: &List, what: &str) -> Result<Vec<Buf>, Failure> {
    let n = usize::try_from(list.size)
        .map_err(|_| Failure::internal(format!("{what}: negative count")))?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if *list.types.add(i) != ARG_BUFFER {
            return Err(Failure::internal(format!("{what} {i}: not a buffer")));
        }
        let b = &*(*list.items.add(i) as *const Buffer);
        let rank = usize::try_from(b.rank)
            .map_err(|_| Failure::internal(format!("{what} {i}: negative rank")))?;
        let dims = (0..rank)
            .map(|d| usize::try_from(*b.dims.add(d)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Failure::internal(format!("{what} {i}: negative dimension")))?;
        out.push(Buf {
            dtype: b.dtype,
            data: b.data,
            dims,
        });
    }
    Ok(out)
}

/// # Safety
/// `frame` is a live XLA call frame.
unsafe fn decode(frame: &CallFrame) -> Result<Frame, Failure> {
    let args = buffers(&frame.args, "operand")?;
    let rets = buffers(&frame.rets, "result")?;
    let mut attrs = HashMap::new();
    let n = usize::try_from(frame.attrs.size)
        .map_err(|_| Failure::internal("attributes: negative count".into()))?;
    for i in 0..n {
        let name = &**frame.attrs.names.add(i);
        let name =
            String::from_utf8_lossy(std::slice::from_raw_parts(name.ptr as *const u8, name.len))
                .into_owned();
        if *frame.attrs.types.add(i) != ATTR_SCALAR {
            return Err(Failure::internal(format!(
                "attribute {name}: expected a scalar"
            )));
        }
        let s = &*(*frame.attrs.attrs.add(i) as *const Scalar);
        let v = match s.dtype {
            DTYPE_PRED => AttrValue::Int(i64::from(*(s.value as *const u8))),
            DTYPE_S32 => AttrValue::Int(i64::from(*(s.value as *const i32))),
            DTYPE_S64 => AttrValue::Int(*(s.value as *const i64)),
            DTYPE_F32 => AttrValue::Float(f64::from(*(s.value as *const f32))),
            DTYPE_F64 => AttrValue::Float(*(s.value as *const f64)),
            d => {
                return Err(Failure::internal(format!(
                    "attribute {name}: unsupported scalar dtype {d}"
                )))
            }
        };
        attrs.insert(name, v);
    }
    Ok(Frame { args, rets, attrs })
}

impl Frame {
    fn int(&self, name: &str) -> Result<i64, Failure> {
        match self.attrs.get(name) {
            Some(AttrValue::Int(v)) => Ok(*v),
            _ => Err(Failure::internal(format!(
                "attribute {name}: missing or not an integer"
            ))),
        }
    }

    fn float(&self, name: &str) -> Result<f64, Failure> {
        match self.attrs.get(name) {
            Some(AttrValue::Float(v)) => Ok(*v),
            Some(AttrValue::Int(v)) => Ok(*v as f64),
            None => Err(Failure::internal(format!("attribute {name}: missing"))),
        }
    }

    fn counts(&self, args: usize, rets: usize) -> Result<(), Failure> {
        if self.args.len() != args || self.rets.len() != rets {
            return Err(Failure::internal(format!(
                "expected {args} operands and {rets} results, got {} and {}",
                self.args.len(),
                self.rets.len()
            )));
        }
        Ok(())
    }

    /// scale, softcap (absent when not positive) and whether the layout is `[B, L, H, D]`.
    fn common(&self) -> Result<(f32, Option<f32>, bool), Failure> {
        let scale = self.float("scale")? as f32;
        let softcap = self.float("softcap")? as f32;
        let blhd = match self.int("layout")? {
            0 => false,
            1 => true,
            l => return Err(Failure::internal(format!("attribute layout: {l}"))),
        };
        Ok((scale, (softcap > 0.0).then_some(softcap), blhd))
    }

    /// The layout of q, k, v, dO (`io`) and of the saved O (`saved`).
    fn layouts(&self, blhd: bool) -> (Layout, Layout) {
        if blhd {
            (Layout::Blhd, Layout::BlhdAsBhld)
        } else {
            (Layout::Bhld, Layout::Bhld)
        }
    }
}

fn kind_of(name: &str, b: &Buf) -> Result<Kind, Failure> {
    match b.dtype {
        DTYPE_F32 => Ok(Kind::F32),
        DTYPE_BF16 => Ok(Kind::BF16),
        d => Err(Failure::user(format!(
            "{name}: expected float32 or bfloat16 (XLA dtype {d})"
        ))),
    }
}

/// The elements of a read-only buffer of `kind`.
///
/// # Safety
/// `b` is a live XLA buffer of `b.len()` elements of its dtype, unmodified while the slice lives.
unsafe fn input_data<'a>(name: &str, b: &Buf, kind: Kind) -> Result<ViewData<'a>, Failure> {
    if kind_of(name, b)? != kind {
        return Err(Failure::user(format!("{name}: dtype differs from q's")));
    }
    let n = b.len();
    Ok(match kind {
        Kind::F32 if n == 0 => ViewData::F32(&[]),
        Kind::BF16 if n == 0 => ViewData::BF16(&[]),
        Kind::F32 => ViewData::F32(std::slice::from_raw_parts(b.data as *const f32, n)),
        Kind::BF16 => ViewData::BF16(std::slice::from_raw_parts(b.data as *const half::bf16, n)),
    })
}

/// How a rank-4 operand's dimensions and memory are laid out.
#[derive(Clone, Copy)]
enum Layout {
    /// Dimensions `[B, H, L, D]`, row-major.
    Bhld,
    /// Dimensions `[B, L, H, D]`, row-major (read through strides).
    Blhd,
    /// Dimensions `[B, L, H, D]` with `[B, H, L, D]` memory (what the forward writes for
    /// layout 1).
    BlhdAsBhld,
}

/// A `[B, H, L, D]` view of an operand laid out as `layout`.
///
/// # Safety
/// As [`input_data`].
unsafe fn view<'a>(
    name: &str,
    b: &Buf,
    kind: Kind,
    layout: Layout,
) -> Result<StridedView<'a>, Failure> {
    let data = input_data(name, b, kind)?;
    let [d0, d1, d2, d3] = <[usize; 4]>::try_from(b.dims.as_slice())
        .map_err(|_| Failure::user(format!("{name}: expected a rank-4 array, got {:?}", b.dims)))?;
    let (shape, strides) = match layout {
        Layout::Bhld => ([d0, d1, d2, d3], [d1 * d2 * d3, d2 * d3, d3, 1]),
        Layout::Blhd => ([d0, d2, d1, d3], [d1 * d2 * d3, d3, d2 * d3, 1]),
        Layout::BlhdAsBhld => ([d0, d2, d1, d3], [d1 * d2 * d3, d1 * d3, d3, 1]),
    };
    Ok(StridedView::new(name, data, shape, strides)?)
}

/// A writable result buffer of `kind`, `[B, H, L, D]` in memory.
///
/// # Safety
/// `b` is a live XLA result buffer, written only through this slice.
unsafe fn output<'a>(name: &str, b: &Buf, kind: Kind) -> Result<OutData<'a>, Failure> {
    if kind_of(name, b)? != kind {
        return Err(Failure::internal(format!("{name}: dtype differs from q's")));
    }
    let n = b.len();
    Ok(match kind {
        Kind::F32 if n == 0 => OutData::F32(&mut []),
        Kind::BF16 if n == 0 => OutData::BF16(&mut []),
        Kind::F32 => OutData::F32(std::slice::from_raw_parts_mut(b.data as *mut f32, n)),
        Kind::BF16 => OutData::BF16(std::slice::from_raw_parts_mut(b.data as *mut half::bf16, n)),
    })
}

/// # Safety
/// As [`output`].
unsafe fn f32_output<'a>(name: &str, b: &Buf) -> Result<&'a mut [f32], Failure> {
    match output(name, b, Kind::F32)? {
        OutData::F32(x) => Ok(x),
        OutData::BF16(_) => Err(Failure::internal(format!("{name}: expected float32"))),
    }
}

/// # Safety
/// As [`input_data`].
unsafe fn f32_input<'a>(name: &str, b: &Buf) -> Result<&'a [f32], Failure> {
    match input_data(name, b, Kind::F32)? {
        ViewData::F32(x) => Ok(x),
        _ => Err(Failure::user(format!("{name}: expected float32"))),
    }
}

/// The plan of the handle operand: `int32 [2]`, the handle's high and low 31 bits (JAX
/// without x64 mode has no int64 arrays).
///
/// # Safety
/// As [`input_data`].
unsafe fn plan_of(b: &Buf) -> Result<Arc<Entry>, Failure> {
    if b.dtype != DTYPE_S32 || b.dims != [2] {
        return Err(Failure::user(format!(
            "plan: expected the plan's int32 [2] handle (XLA dtype {}, shape {:?})",
            b.dtype, b.dims
        )));
    }
    let w = std::slice::from_raw_parts(b.data as *const i32, 2);
    lookup((i64::from(w[0]) << 31) | i64::from(w[1]))
}

/// Sink logits from a `[Hq]` float32 operand; an empty operand means no sinks.
///
/// # Safety
/// As [`input_data`].
unsafe fn sinks_of(b: &Buf) -> Result<Option<Vec<f32>>, Failure> {
    let s = f32_input("sinks", b)?;
    Ok((!s.is_empty()).then(|| s.to_vec()))
}

// -- the three handlers ----------------------------------------------------------------------

/// Forward; with `logged`, also the telemetry summary (result 3: `float32 [Hq, 9, 2]`, each
/// float64 column value as an exact-to-48-bits (hi, lo) pair, so no x64 mode is needed).
///
/// # Safety
/// `f` was decoded from a live call frame.
unsafe fn forward(f: &Frame, logged: bool) -> Result<(), Failure> {
    f.counts(5, if logged { 4 } else { 3 })?;
    let (scale, softcap, blhd) = f.common()?;
    let (io, _) = f.layouts(blhd);
    let kind = kind_of("q", &f.args[0])?;
    let inputs = AttnInputs {
        q: view("q", &f.args[0], kind, io)?,
        k: view("k", &f.args[1], kind, io)?,
        v: view("v", &f.args[2], kind, io)?,
    };
    let entry = plan_of(&f.args[3])?;
    let opts = options(Some(scale), softcap, sinks_of(&f.args[4])?);
    let out = ForwardOut {
        o: output("o", &f.rets[0], kind)?,
        lse: f32_output("lse", &f.rets[1])?,
        max_logit: f32_output("max_logit", &f.rets[2])?,
    };
    let prepared = prepare_once(&entry.prepared, &entry.plan)?;
    let be = CpuBackend::new();
    let mut ws = take_workspace();
    let r = if logged {
        logged_forward(f, &entry, prepared, &inputs, &opts, out, &mut ws)
    } else {
        be.forward_into(prepared, &inputs, &opts, out, &mut ws, Par::Current)
            .map_err(Failure::from)
    };
    give_workspace(ws);
    r
}

#[allow(clippy::too_many_arguments)]
unsafe fn logged_forward(
    f: &Frame,
    entry: &Entry,
    prepared: &CpuPlan,
    inputs: &AttnInputs<'_>,
    opts: &tessera::AttnOptions,
    out: ForwardOut<'_>,
    ws: &mut tessera::CpuWorkspace,
) -> Result<(), Failure> {
    use tessera::telemetry::{document_kv_segments, sink_key_flags};
    let hq = inputs.q.shape[1];
    let stats = f32_output("stats", &f.rets[3])?;
    if stats.len() != hq * STAT_COLUMNS * 2 {
        return Err(Failure::internal(format!(
            "stats: expected [{hq}, {STAT_COLUMNS}, 2] float32"
        )));
    }
    let sink_tokens = usize::try_from(f.int("sink_tokens")?)
        .map_err(|_| Failure::user("sink_tokens: expected a non-negative int".into()))?;
    let config = checked_telemetry_config(
        1,
        sink_tokens,
        0.3,
        f.float("outlier_ratio")?,
        f.int("sink_stream")? != 0,
        f.int("outlier_stream")? != 0,
    )?;
    let Some(mask) = &entry.mask else {
        return Err(Failure::user(
            "telemetry: not available for this plan (a local plan of a sharding registered \
             without its global plan)"
                .into(),
        ));
    };
    let batch = inputs.q.shape[0];
    let flags = match &entry.kv_positions {
        None => sink_key_flags(
            document_kv_segments(mask),
            batch,
            entry.plan.shape.kv_len,
            sink_tokens,
        )?,
        Some((positions, global_kv)) => {
            let global =
                sink_key_flags(document_kv_segments(mask), batch, *global_kv, sink_tokens)?;
            (0..batch)
                .flat_map(|b| {
                    let row = &global[b * global_kv..(b + 1) * global_kv];
                    positions.iter().map(move |p| p.is_some_and(|p| row[p]))
                })
                .collect()
        }
    };
    let tel = tessera::attn::TelemetryInput::new(&flags, 0, 0, &config);
    let summary = CpuBackend::new().forward_with_telemetry_into(
        prepared,
        inputs,
        opts,
        &tel,
        out,
        ws,
        Par::Current,
    )?;
    for (row, acc) in stats.chunks_mut(STAT_COLUMNS * 2).zip(&summary.heads) {
        for (pair, x) in row.chunks_mut(2).zip(head_row(acc)) {
            let hi = x as f32;
            pair[0] = hi;
            pair[1] = if hi.is_finite() {
                (x - f64::from(hi)) as f32
            } else {
                0.0
            };
        }
    }
    Ok(())
}

/// Backward: operands q, k, v, o, lse, dO, dLSE (`[0]` when the loss ignores the LSE), handle,
/// sinks (`[0]`: none); results dQ, dK, dV, dsinks (`[0]` without sinks).
///
/// # Safety
/// `f` was decoded from a live call frame.
unsafe fn backward(f: &Frame) -> Result<(), Failure> {
    f.counts(9, 4)?;
    let (scale, softcap, blhd) = f.common()?;
    let (io, saved) = f.layouts(blhd);
    let kind = kind_of("q", &f.args[0])?;
    let lse_buf = &f.args[4];
    let d_lse_buf = &f.args[6];
    let lse = f32_input("lse", lse_buf)?;
    let d_lse = f32_input("d_lse", d_lse_buf)?;
    // The LSE of layout 1 is `[B, L, H]` with `[B, H, L]` memory, like O.
    let bhl = |dims: &[usize]| -> Vec<usize> {
        match (blhd, dims) {
            (true, [b, l, h]) => vec![*b, *h, *l],
            _ => dims.to_vec(),
        }
    };
    let (lse_dims, d_lse_dims) = (bhl(&lse_buf.dims), bhl(&d_lse_buf.dims));
    let inputs = GradInputs {
        q: view("q", &f.args[0], kind, io)?,
        k: view("k", &f.args[1], kind, io)?,
        v: view("v", &f.args[2], kind, io)?,
        o: view("o", &f.args[3], kind, saved)?,
        lse: TensorView::new(&lse_dims, ViewData::F32(lse))?,
        d_o: view("d_o", &f.args[5], kind, io)?,
        d_lse: if d_lse.is_empty() {
            None
        } else {
            Some(TensorView::new(&d_lse_dims, ViewData::F32(d_lse))?)
        },
    };
    let entry = plan_of(&f.args[7])?;
    let sinks = sinks_of(&f.args[8])?;
    let has_sinks = sinks.is_some();
    let opts = options(Some(scale), softcap, sinks);
    let out = GradOut {
        dq: output("dq", &f.rets[0], kind)?,
        dk: output("dk", &f.rets[1], kind)?,
        dv: output("dv", &f.rets[2], kind)?,
        dsinks: if has_sinks {
            Some(f32_output("dsinks", &f.rets[3])?)
        } else {
            None
        },
    };
    let prepared = prepare_once(&entry.prepared, &entry.plan)?;
    let mut ws = take_workspace();
    let r = CpuBackend::new().backward_into(prepared, &inputs, &opts, out, &mut ws, Par::Current);
    give_workspace(ws);
    Ok(r?)
}

// -- the C entry points ----------------------------------------------------------------------

/// Runs `body` on the frame: answers XLA's metadata query, skips stages other than execute,
/// turns failures and panics into `XLA_FFI_Error`s.
///
/// # Safety
/// `frame` is the call frame XLA passes to a handler.
unsafe fn handle(
    frame: *mut CallFrame,
    body: unsafe fn(&Frame) -> Result<(), Failure>,
) -> *mut c_void {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    let frame = &*frame;
    let ext = frame.extension_start;
    if !ext.is_null() && (*ext).kind == EXTENSION_METADATA {
        let meta = (*(ext as *mut MetadataExtension)).metadata;
        if !meta.is_null() {
            (*meta).api_version = ApiVersion {
                struct_size: std::mem::size_of::<ApiVersion>(),
                extension_start: std::ptr::null_mut(),
                major: 0,
                minor: 1,
            };
            (*meta).traits = 0;
        }
        return std::ptr::null_mut();
    }
    if frame.stage != STAGE_EXECUTE {
        return std::ptr::null_mut();
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let f = decode(frame)?;
        body(&f)
    }));
    let failure = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            Failure::internal(format!("internal error in the Tessera kernel: {what}"))
        }
    };
    error(frame.api, failure)
}

/// An `XLA_FFI_Error` carrying `f` (XLA copies the message).
///
/// # Safety
/// `api` is the API table of a live call frame.
unsafe fn error(api: *const Api, f: Failure) -> *mut c_void {
    let Some(create) = api.as_ref().and_then(|a| a.error_create) else {
        return std::ptr::null_mut();
    };
    let msg =
        CString::new(format!("tessera: {}", f.message).replace('\0', " ")).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: msg.as_ptr(),
        errc: f.code,
    };
    create(&mut args)
}

unsafe fn fwd_body(f: &Frame) -> Result<(), Failure> {
    forward(f, false)
}

unsafe fn fwd_logged_body(f: &Frame) -> Result<(), Failure> {
    forward(f, true)
}

unsafe extern "C" fn attention_fwd(frame: *mut CallFrame) -> *mut c_void {
    handle(frame, fwd_body)
}

unsafe extern "C" fn attention_fwd_logged(frame: *mut CallFrame) -> *mut c_void {
    handle(frame, fwd_logged_body)
}

unsafe extern "C" fn attention_bwd(frame: *mut CallFrame) -> *mut c_void {
    handle(frame, backward)
}

/// The handlers as `{target name: PyCapsule}` for `jax.ffi.register_ffi_target`.
#[pyfunction]
pub fn ffi_targets(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut c_void;
    let d = PyDict::new(py);
    let targets: [(&str, Handler); 3] = [
        ("tessera_attention_fwd", attention_fwd),
        ("tessera_attention_fwd_logged", attention_fwd_logged),
        ("tessera_attention_bwd", attention_bwd),
    ];
    for (name, f) in targets {
        // SAFETY: a capsule around a function pointer with static lifetime, no name and no
        // destructor (what `jax.ffi.pycapsule` makes for ctypes function pointers).
        let cap = unsafe {
            let raw = pyo3::ffi::PyCapsule_New(f as *mut c_void, std::ptr::null(), None);
            Bound::from_owned_ptr_or_err(py, raw)?
        };
        d.set_item(name, cap)?;
    }
    Ok(d)
}
