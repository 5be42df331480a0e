//! Attention kernels for Python: zero-copy numpy views in (any batch/head/row strides, unit
//! stride in D), caller-allocated outputs written in place, the GIL released while the kernels
//! run, one CPU workspace per concurrent call reused across calls.
//!
//! Contract: the arrays come from `tessera.torch` (torch tensors viewed as numpy without a copy;
//! bf16 as their int16 bit pattern) or straight from numpy users. Every problem in the arguments
//! is a `ValueError`/`TypeError` naming the argument; nothing panics.

use numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::Mutex;
use tessera::{
    AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardOut, GradInputs, GradOut,
    OutData, Par, StridedView, TensorView, ViewData,
};

use crate::errors::to_py;
use crate::plan::PyPlan;

/// Workspaces of finished calls, reused by the next ones (one per concurrent call).
static WORKSPACES: Mutex<Vec<CpuWorkspace>> = Mutex::new(Vec::new());

pub(crate) fn take_workspace() -> CpuWorkspace {
    WORKSPACES
        .lock()
        .ok()
        .and_then(|mut v| v.pop())
        .unwrap_or_default()
}

pub(crate) fn give_workspace(ws: CpuWorkspace) {
    if let Ok(mut v) = WORKSPACES.lock() {
        // Bounded: as many as calls ever ran at once, at most 8.
        if v.len() < 8 {
            v.push(ws);
        }
    }
}

/// Storage dtype of a call: f32, or bf16 (from numpy: its 16-bit pattern, int16/uint16).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    F32,
    BF16,
}

/// Whether numpy lets the array be written.
fn writeable(a: &Bound<'_, PyUntypedArray>) -> bool {
    // SAFETY: reading the flags of a live array object.
    unsafe { (*a.as_array_ptr()).fields.flags & NPY_ARRAY_WRITEABLE != 0 }
}

fn kind_of(name: &str, a: &Bound<'_, PyUntypedArray>) -> PyResult<Kind> {
    let dt = a.dtype();
    let py = a.py();
    if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Ok(Kind::F32)
    } else if dt.is_equiv_to(&numpy::dtype::<i16>(py)) || dt.is_equiv_to(&numpy::dtype::<u16>(py)) {
        Ok(Kind::BF16)
    } else {
        Err(PyTypeError::new_err(format!(
            "{name}: expected float32, or bfloat16 passed as its int16 bit pattern; got {dt}"
        )))
    }
}

/// The element strides of `a` (non-negative multiples of the item size) and the length of
/// the storage span they address from the first element.
fn layout(name: &str, a: &Bound<'_, PyUntypedArray>) -> PyResult<(Vec<usize>, Vec<usize>, usize)> {
    let item = a.dtype().itemsize() as isize;
    let shape = a.shape().to_vec();
    let mut strides = Vec::with_capacity(shape.len());
    for &s in a.strides() {
        if s < 0 || s % item != 0 {
            return Err(PyValueError::new_err(format!(
                "{name}: strides {:?} (bytes) are negative or not whole elements; pass a \
                 tensor with non-negative strides (for example .contiguous())",
                a.strides()
            )));
        }
        strides.push((s / item) as usize);
    }
    let span = if shape.contains(&0) {
        0
    } else {
        1 + shape
            .iter()
            .zip(&strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum::<usize>()
    };
    Ok((shape, strides, span))
}

/// A read-only view of an input array. The caller keeps `a` alive (and unmutated by Python:
/// the GIL-free section only runs Tessera's kernels) for as long as the view is used.
fn input_view<'a>(
    name: &str,
    a: &'a Bound<'_, PyUntypedArray>,
    kind: Kind,
) -> PyResult<(ViewData<'a>, Vec<usize>, Vec<usize>)> {
    if kind_of(name, a)? != kind {
        return Err(PyTypeError::new_err(format!(
            "{name}: dtype {} differs from q's",
            a.dtype()
        )));
    }
    let (shape, strides, span) = layout(name, a)?;
    // SAFETY: numpy guarantees that every element addressed by the array's shape and
    // (non-negative, checked above) strides lies in its buffer, i.e. `span` elements from the
    // data pointer; the slice borrows `a`, which outlives it.
    let data = unsafe {
        let ptr = (*a.as_array_ptr()).fields.data;
        match kind {
            Kind::F32 => ViewData::F32(std::slice::from_raw_parts(ptr as *const f32, span)),
            Kind::BF16 => {
                ViewData::BF16(std::slice::from_raw_parts(ptr as *const half::bf16, span))
            }
        }
    };
    Ok((data, shape, strides))
}

fn strided<'a>(
    name: &str,
    a: &'a Bound<'_, PyUntypedArray>,
    kind: Kind,
) -> PyResult<StridedView<'a>> {
    let (data, shape, strides) = input_view(name, a, kind)?;
    let (Ok(shape), Ok(strides)) = (
        <[usize; 4]>::try_from(shape.as_slice()),
        <[usize; 4]>::try_from(strides.as_slice()),
    ) else {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a 4-D array [B, H, L, D], got shape {:?}",
            a.shape()
        )));
    };
    StridedView::new(name, data, shape, strides).map_err(to_py)
}

/// A contiguous f32 input (LSE-shaped arrays).
fn f32_slice<'a>(
    name: &str,
    a: &'a Bound<'_, PyUntypedArray>,
) -> PyResult<(&'a [f32], Vec<usize>)> {
    if !a.dtype().is_equiv_to(&numpy::dtype::<f32>(a.py())) {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected float32, got {}",
            a.dtype()
        )));
    }
    if !a.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a contiguous array"
        )));
    }
    let (shape, _, span) = layout(name, a)?;
    // SAFETY: a C-contiguous array holds `span` = product(shape) elements from its data
    // pointer; the slice borrows `a`.
    let data =
        unsafe { std::slice::from_raw_parts((*a.as_array_ptr()).fields.data as *const f32, span) };
    Ok((data, shape))
}

/// A writable contiguous output buffer of `kind`.
fn out_data<'a>(name: &str, a: &'a Bound<'_, PyUntypedArray>, kind: Kind) -> PyResult<OutData<'a>> {
    if kind_of(name, a)? != kind {
        return Err(PyTypeError::new_err(format!(
            "{name}: dtype {} differs from q's",
            a.dtype()
        )));
    }
    let (_, _, span) = layout(name, a)?;
    if !a.is_c_contiguous() || !writeable(a) {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a writable contiguous output array"
        )));
    }
    // SAFETY: a C-contiguous writable array owns `span` elements from its data pointer; the
    // caller hands distinct output arrays (checked by `distinct`), so no two slices alias.
    unsafe {
        let ptr = (*a.as_array_ptr()).fields.data;
        Ok(match kind {
            Kind::F32 => OutData::F32(std::slice::from_raw_parts_mut(ptr as *mut f32, span)),
            Kind::BF16 => {
                OutData::BF16(std::slice::from_raw_parts_mut(ptr as *mut half::bf16, span))
            }
        })
    }
}

fn f32_out<'a>(name: &str, a: &'a Bound<'_, PyUntypedArray>) -> PyResult<&'a mut [f32]> {
    match out_data(name, a, Kind::F32)? {
        OutData::F32(x) => Ok(x),
        OutData::BF16(_) => Err(PyTypeError::new_err(format!("{name}: expected float32"))),
    }
}

/// Output arrays must not overlap each other or the inputs (they are written while the inputs
/// are read).
fn distinct(
    outs: &[(&str, &Bound<'_, PyUntypedArray>)],
    ins: &[&Bound<'_, PyUntypedArray>],
) -> PyResult<()> {
    let range = |a: &Bound<'_, PyUntypedArray>| -> (usize, usize) {
        let item = a.dtype().itemsize();
        let span = layout("", a).map(|x| x.2).unwrap_or(0);
        // SAFETY: reading the data pointer of a live array.
        let p = unsafe { (*a.as_array_ptr()).fields.data as usize };
        (p, p + span * item)
    };
    for (i, (name, a)) in outs.iter().enumerate() {
        let (a0, a1) = range(a);
        let others = outs[i + 1..]
            .iter()
            .map(|(_, b)| *b)
            .chain(ins.iter().copied());
        for b in others {
            let (b0, b1) = range(b);
            if a0 < b1 && b0 < a1 && a1 > a0 && b1 > b0 {
                return Err(PyValueError::new_err(format!(
                    "{name}: the output array overlaps another argument"
                )));
            }
        }
    }
    Ok(())
}

pub(crate) fn options(
    scale: Option<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
) -> AttnOptions {
    AttnOptions {
        scale,
        softcap,
        sinks,
    }
}

/// Forward into caller-owned outputs: `o [B, Hq, Lq, Dv]` (q's dtype), `lse [B, Hq, Lq]` and
/// `max_logit [B, Hq]` (float32), all contiguous.
#[pyfunction]
#[pyo3(signature = (plan, q, k, v, o, lse, max_logit, scale=None, softcap=None, sinks=None))]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    py: Python<'_>,
    plan: PyRef<'_, PyPlan>,
    q: &Bound<'_, PyUntypedArray>,
    k: &Bound<'_, PyUntypedArray>,
    v: &Bound<'_, PyUntypedArray>,
    o: &Bound<'_, PyUntypedArray>,
    lse: &Bound<'_, PyUntypedArray>,
    max_logit: &Bound<'_, PyUntypedArray>,
    scale: Option<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
) -> PyResult<()> {
    let kind = kind_of("q", q)?;
    distinct(
        &[("o", o), ("lse", lse), ("max_logit", max_logit)],
        &[q, k, v],
    )?;
    let inputs = AttnInputs {
        q: strided("q", q, kind)?,
        k: strided("k", k, kind)?,
        v: strided("v", v, kind)?,
    };
    let out = ForwardOut {
        o: out_data("o", o, kind)?,
        lse: f32_out("lse", lse)?,
        max_logit: f32_out("max_logit", max_logit)?,
    };
    let opts = options(scale, softcap, sinks);
    let prepared = plan.prepared(py)?;
    let be = CpuBackend::new();
    let mut ws = take_workspace();
    let r = py.detach(|| be.forward_into(prepared, &inputs, &opts, out, &mut ws, Par::Current));
    give_workspace(ws);
    r.map_err(to_py)
}

/// Backward into caller-owned outputs `dq`, `dk`, `dv` (q's dtype, contiguous) and `dsinks`
/// (`[Hq]` float32, exactly when `sinks` is given); `d_lse` is the optional gradient of the LSE.
#[pyfunction]
#[pyo3(signature = (plan, q, k, v, o, lse, d_o, dq, dk, dv, d_lse=None, dsinks=None, scale=None, softcap=None, sinks=None))]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    py: Python<'_>,
    plan: PyRef<'_, PyPlan>,
    q: &Bound<'_, PyUntypedArray>,
    k: &Bound<'_, PyUntypedArray>,
    v: &Bound<'_, PyUntypedArray>,
    o: &Bound<'_, PyUntypedArray>,
    lse: &Bound<'_, PyUntypedArray>,
    d_o: &Bound<'_, PyUntypedArray>,
    dq: &Bound<'_, PyUntypedArray>,
    dk: &Bound<'_, PyUntypedArray>,
    dv: &Bound<'_, PyUntypedArray>,
    d_lse: Option<&Bound<'_, PyUntypedArray>>,
    dsinks: Option<&Bound<'_, PyUntypedArray>>,
    scale: Option<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
) -> PyResult<()> {
    let kind = kind_of("q", q)?;
    let mut ins = vec![q, k, v, o, lse, d_o];
    ins.extend(d_lse);
    let mut outs = vec![("dq", dq), ("dk", dk), ("dv", dv)];
    outs.extend(dsinks.map(|s| ("dsinks", s)));
    distinct(&outs, &ins)?;
    let (lse_data, lse_shape) = f32_slice("lse", lse)?;
    let d_lse_parts = match d_lse {
        Some(a) => Some(f32_slice("d_lse", a)?),
        None => None,
    };
    let inputs = GradInputs {
        q: strided("q", q, kind)?,
        k: strided("k", k, kind)?,
        v: strided("v", v, kind)?,
        o: strided("o", o, kind)?,
        lse: TensorView::new(&lse_shape, ViewData::F32(lse_data)).map_err(to_py)?,
        d_o: strided("d_o", d_o, kind)?,
        d_lse: match &d_lse_parts {
            Some((data, shape)) => {
                Some(TensorView::new(shape, ViewData::F32(data)).map_err(to_py)?)
            }
            None => None,
        },
    };
    let out = GradOut {
        dq: out_data("dq", dq, kind)?,
        dk: out_data("dk", dk, kind)?,
        dv: out_data("dv", dv, kind)?,
        dsinks: match dsinks {
            Some(a) => Some(f32_out("dsinks", a)?),
            None => None,
        },
    };
    let opts = options(scale, softcap, sinks);
    let prepared = plan.prepared(py)?;
    let be = CpuBackend::new();
    let mut ws = take_workspace();
    let r = py.detach(|| be.backward_into(prepared, &inputs, &opts, out, &mut ws, Par::Current));
    give_workspace(ws);
    r.map_err(to_py)
}

/// Columns of one head's row in a telemetry stats array (see [`head_row`]).
pub const STAT_COLUMNS: usize = 9;

/// One head's accumulator as a fixed-width row: valid rows, Σ sink mass, Σ learned-sink mass,
/// Σ entropy, max logit, max |O|, Σ O², O element count, outliers.
pub(crate) fn head_row(a: &tessera::telemetry::HeadAccum) -> [f64; STAT_COLUMNS] {
    [
        a.valid_rows as f64,
        a.sink_mass_sum.value(),
        a.learned_sink_mass_sum.value(),
        a.entropy_sum.value(),
        a.max_logit,
        a.out.abs_max,
        a.out.sq_sum.value(),
        a.out.count as f64,
        a.out.outliers as f64,
    ]
}

fn head_accum(r: &[f64]) -> tessera::telemetry::HeadAccum {
    use tessera::telemetry::{ExactSum, HeadAccum};
    let sum = |x: f64| {
        let mut s = ExactSum::new();
        s.add(x);
        s
    };
    let mut a = HeadAccum {
        valid_rows: r[0] as u64,
        sink_mass_sum: sum(r[1]),
        learned_sink_mass_sum: sum(r[2]),
        entropy_sum: sum(r[3]),
        max_logit: r[4],
        ..HeadAccum::default()
    };
    a.out.abs_max = r[5];
    a.out.sq_sum = sum(r[6]);
    a.out.count = r[7] as u64;
    a.out.outliers = r[8] as u64;
    a
}

/// A telemetry configuration, validated as `Telemetry::new` validates it.
pub(crate) fn checked_telemetry_config(
    every: u64,
    sink_tokens: usize,
    epsilon: f64,
    outlier_ratio: f64,
    sink: bool,
    outlier: bool,
) -> tessera::Result<tessera::telemetry::TelemetryConfig> {
    let c = tessera::telemetry::TelemetryConfig {
        every,
        streams: tessera::telemetry::Streams { sink, outlier },
        sink_tokens,
        epsilon,
        outlier_ratio,
    };
    tessera::telemetry::Telemetry::new(c.clone())?;
    Ok(c)
}

/// A logging step's forward: the outputs of [`attention_forward`] (bit-identical) plus the
/// step's per-head summary written into `stats` (`float64 [Hq, 9]`, see `head_row`).
///
/// The sink keys come from the plan's mask (its first `document` leaf, or the sequence start),
/// or from `sink_flags` (`bool [B, Lkv]`, contiguous) when given: a rank's local plan of a
/// sharding has no mask (its keys are a permutation of the global row's), so context
/// parallelism passes the global flags of its local keys.
#[pyfunction]
#[pyo3(signature = (plan, q, k, v, o, lse, max_logit, stats, scale=None, softcap=None, sinks=None, sink_tokens=1, outlier_ratio=6.0, sink_stream=true, outlier_stream=true, sink_flags=None))]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_logged(
    py: Python<'_>,
    plan: PyRef<'_, PyPlan>,
    q: &Bound<'_, PyUntypedArray>,
    k: &Bound<'_, PyUntypedArray>,
    v: &Bound<'_, PyUntypedArray>,
    o: &Bound<'_, PyUntypedArray>,
    lse: &Bound<'_, PyUntypedArray>,
    max_logit: &Bound<'_, PyUntypedArray>,
    stats: &Bound<'_, PyUntypedArray>,
    scale: Option<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
    sink_tokens: usize,
    outlier_ratio: f64,
    sink_stream: bool,
    outlier_stream: bool,
    sink_flags: Option<numpy::PyReadonlyArray2<'_, bool>>,
) -> PyResult<()> {
    use tessera::telemetry::{document_kv_segments, sink_key_flags};
    let kind = kind_of("q", q)?;
    distinct(
        &[
            ("o", o),
            ("lse", lse),
            ("max_logit", max_logit),
            ("stats", stats),
        ],
        &[q, k, v],
    )?;
    let inputs = AttnInputs {
        q: strided("q", q, kind)?,
        k: strided("k", k, kind)?,
        v: strided("v", v, kind)?,
    };
    let out = ForwardOut {
        o: out_data("o", o, kind)?,
        lse: f32_out("lse", lse)?,
        max_logit: f32_out("max_logit", max_logit)?,
    };
    if !stats.dtype().is_equiv_to(&numpy::dtype::<f64>(stats.py())) || !stats.is_c_contiguous() {
        return Err(PyTypeError::new_err(
            "stats: expected a contiguous float64 array",
        ));
    }
    let (_, _, span) = layout("stats", stats)?;
    let hq = inputs.q.shape[1];
    if span != hq * STAT_COLUMNS || !writeable(stats) {
        return Err(PyValueError::new_err(format!(
            "stats: expected a writable float64 array [{hq}, {STAT_COLUMNS}]"
        )));
    }
    // SAFETY: a writable C-contiguous float64 array of `span` elements, distinct from the
    // other arguments (checked above).
    let stats_out = unsafe {
        std::slice::from_raw_parts_mut((*stats.as_array_ptr()).fields.data as *mut f64, span)
    };
    let opts = options(scale, softcap, sinks);
    let p = plan.whole(py)?;
    // The inputs' batch size: a batch-invariant plan built for one row serves any batch.
    let (batch, kv_len) = (inputs.q.shape[0], p.shape.kv_len);
    let flags = match (&sink_flags, &plan.mask) {
        (Some(f), _) => {
            if f.shape() != [batch, kv_len] {
                return Err(PyValueError::new_err(format!(
                    "sink_flags: expected bool [{batch}, {kv_len}] (batch rows, keys), got {:?}",
                    f.shape()
                )));
            }
            f.as_array().iter().copied().collect::<Vec<bool>>()
        }
        (None, Some(mask)) => {
            sink_key_flags(document_kv_segments(mask), batch, kv_len, sink_tokens).map_err(to_py)?
        }
        (None, None) => {
            return Err(PyValueError::new_err(
                "sink_flags: required for a rank's local plan of a sharding (its keys are a \
                 permutation of the row's: pass the sink flags of its keys, as \
                 tessera.cp.attention(..., telemetry=) does)",
            ))
        }
    };
    let config = checked_telemetry_config(
        1,
        sink_tokens,
        0.3,
        outlier_ratio,
        sink_stream,
        outlier_stream,
    )
    .map_err(to_py)?;
    let tel = tessera::attn::TelemetryInput::new(&flags, 0, 0, &config);
    let prepared = plan.prepared(py)?;
    let be = CpuBackend::new();
    let mut ws = take_workspace();
    let r = py.detach(|| {
        be.forward_with_telemetry_into(prepared, &inputs, &opts, &tel, out, &mut ws, Par::Current)
    });
    give_workspace(ws);
    let summary = r.map_err(to_py)?;
    for (row, acc) in stats_out.chunks_mut(STAT_COLUMNS).zip(&summary.heads) {
        row.copy_from_slice(&head_row(acc));
    }
    Ok(())
}

/// JSON lines (the CLI's telemetry schema, one per (step, layer), merged across calls of the
/// same step and layer) from stacked stats rows `float64 [N, Hq, 9]` and their steps, layers and
/// whether learned sinks were used.
///
/// With `ranks` and `tokens` (one per stats entry), records gain the `ranks` field (the largest
/// of their entries: how many ranks were reduced into them) and `tokens` (the sum: query rows
/// summarised).
#[pyfunction]
#[pyo3(signature = (stats, steps, layers, learned_sinks, every, sink_tokens=1, epsilon=0.3, outlier_ratio=6.0, sink_stream=true, outlier_stream=true, ranks=None, tokens=None))]
#[allow(clippy::too_many_arguments)]
pub fn telemetry_records(
    stats: numpy::PyReadonlyArray3<'_, f64>,
    steps: Vec<u64>,
    layers: Vec<u32>,
    learned_sinks: Vec<bool>,
    every: u64,
    sink_tokens: usize,
    epsilon: f64,
    outlier_ratio: f64,
    sink_stream: bool,
    outlier_stream: bool,
    ranks: Option<Vec<u64>>,
    tokens: Option<Vec<u64>>,
) -> PyResult<Vec<String>> {
    use tessera::telemetry::AttnSummary;
    let a = stats.as_array();
    let (n, hq, c) = a.dim();
    if c != STAT_COLUMNS || steps.len() != n || layers.len() != n || learned_sinks.len() != n {
        return Err(PyValueError::new_err(format!(
            "stats: expected [N, Hq, {STAT_COLUMNS}] with N steps, layers and learned_sinks; got \
             {:?} with {}, {}, {}",
            a.dim(),
            steps.len(),
            layers.len(),
            learned_sinks.len()
        )));
    }
    let config = checked_telemetry_config(
        every,
        sink_tokens,
        epsilon,
        outlier_ratio,
        sink_stream,
        outlier_stream,
    )
    .map_err(to_py)?;
    for (name, v) in [("ranks", &ranks), ("tokens", &tokens)] {
        if let Some(v) = v {
            if v.len() != n {
                return Err(PyValueError::new_err(format!(
                    "{name}: expected one entry per stats entry ({n}), got {}",
                    v.len()
                )));
            }
        }
    }
    if ranks.as_ref().is_some_and(|r| r.contains(&0)) {
        return Err(PyValueError::new_err("ranks: expected counts >= 1"));
    }
    // (summary, ranks, tokens) per (step, layer)
    let mut merged: Vec<(AttnSummary, Option<u64>, Option<u64>)> = Vec::new();
    for i in 0..n {
        let mut s = AttnSummary::new(steps[i], layers[i], hq, learned_sinks[i]);
        for (h, acc) in s.heads.iter_mut().enumerate() {
            let row: Vec<f64> = (0..c).map(|x| a[[i, h, x]]).collect();
            *acc = head_accum(&row);
        }
        let (r, t) = (ranks.as_ref().map(|v| v[i]), tokens.as_ref().map(|v| v[i]));
        match merged
            .iter_mut()
            .find(|m| m.0.step == s.step && m.0.layer == s.layer)
        {
            Some(m) => {
                m.0.merge(&s).map_err(to_py)?;
                m.1 = m.1.max(r);
                m.2 = t.map(|t| t + m.2.unwrap_or(0));
            }
            None => merged.push((s, r, t)),
        }
    }
    merged.sort_by_key(|m| (m.0.step, m.0.layer));
    merged
        .iter()
        .map(|(m, r, t)| {
            let mut rec = m.record(&config);
            rec.ranks = *r;
            rec.tokens = *t;
            rec.to_json_line().map_err(to_py)
        })
        .collect()
}

/// The sink-key flags (`bool [batch, Lkv]`, docs/semantics.md#telemetry) of a plan's mask: the first `sink_tokens`
/// keys of each key's document (its first `document` leaf), or of the sequence without one.
#[pyfunction]
#[pyo3(signature = (plan, batch, sink_tokens=1))]
pub fn telemetry_sink_flags<'py>(
    py: Python<'py>,
    plan: PyRef<'_, PyPlan>,
    batch: usize,
    sink_tokens: usize,
) -> PyResult<Bound<'py, numpy::PyArray2<bool>>> {
    use numpy::{IntoPyArray, PyArrayMethods};
    use tessera::telemetry::{document_kv_segments, sink_key_flags};
    let Some(mask) = &plan.mask else {
        return Err(PyValueError::new_err(
            "plan: a rank's local plan of a sharding has no mask; take the flags of the global plan",
        ));
    };
    let kv_len = plan.tiles().shape.kv_len;
    let flags =
        sink_key_flags(document_kv_segments(mask), batch, kv_len, sink_tokens).map_err(to_py)?;
    flags.into_pyarray(py).reshape([batch, kv_len])
}

/// What an exact outlier count over a `(b, h)` slice split across ranks needs from this rank's
/// part `o [B, Hq, Lr, Dv]` (f32, or bf16 as int16; contiguous), with `slice_len` the elements of
/// the whole slice (over all ranks) and `ratio` the outlier ratio:
///
/// - `sq [B, Hq]` float64: Σ o² of the part (in the fixed lane order of `OutlierStats`),
/// - `counts [B, Hq]` int64 and `cand [Σ counts]` float32: the `|o|` of the part's elements
///   above `ratio · sqrt(sq / slice_len)`, slice after slice in row-major order.
///
/// The whole slice's threshold is `ratio · sqrt(Σ_ranks sq / slice_len)`, never below this rank's
/// bound (Σ_ranks sq >= sq), so every element above it is a candidate; and fewer than
/// `slice_len / ratio²` elements exceed the bound (each adds more than `sq / (slice_len / ratio²)`
/// to `sq`), so the candidates of a part are at most `min(Lr·Dv, slice_len / ratio²)` values.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn outlier_candidates<'py>(
    py: Python<'py>,
    o: &Bound<'py, PyUntypedArray>,
    slice_len: usize,
    ratio: f64,
) -> PyResult<(
    Bound<'py, numpy::PyArray2<f64>>,
    Bound<'py, numpy::PyArray2<i64>>,
    Bound<'py, numpy::PyArray1<f32>>,
)> {
    use numpy::{IntoPyArray, PyArrayMethods};
    use rayon::prelude::*;
    if !(ratio.is_finite() && ratio >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "ratio: expected a finite number >= 0, got {ratio}"
        )));
    }
    let kind = kind_of("o", o)?;
    let shape = o.shape().to_vec();
    if shape.len() != 4 || !o.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "o: expected a contiguous 4-D array [B, Hq, L, Dv], got shape {shape:?}"
        )));
    }
    let (b, hq, part) = (shape[0], shape[1], shape[2] * shape[3]);
    if slice_len < part || slice_len == 0 {
        return Err(PyValueError::new_err(format!(
            "slice_len: expected at least this rank's {part} elements per (b, h) slice and > 0, \
             got {slice_len}"
        )));
    }
    let (data, _, _) = input_view("o", o, kind)?;
    let n = slice_len as f64;
    let per_slice = |x: &[f32]| -> (f64, Vec<f32>) {
        let mut lanes = [0f64; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for l in 0..8 {
                let v = c[l] as f64;
                lanes[l] += v * v;
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            lanes[l] += v as f64 * v as f64;
        }
        let sq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        let bound = ratio * (sq / n).sqrt();
        // NaN bound (a NaN element): no candidate; the whole slice's threshold is NaN too.
        let cand = x
            .iter()
            .map(|v| v.abs())
            .filter(|&a| a as f64 > bound)
            .collect();
        (sq, cand)
    };
    let parts: Vec<(f64, Vec<f32>)> = py.detach(|| match &data {
        ViewData::F32(x) => x[..b * hq * part]
            .par_chunks(part.max(1))
            .map(per_slice)
            .collect(),
        ViewData::BF16(x) => x[..b * hq * part]
            .par_chunks(part.max(1))
            .map(|c| per_slice(&c.iter().map(|v| v.to_f32()).collect::<Vec<f32>>()))
            .collect(),
        _ => Vec::new(),
    });
    let parts = if part == 0 {
        vec![(0.0, Vec::new()); b * hq]
    } else {
        parts
    };
    let sq: Vec<f64> = parts.iter().map(|p| p.0).collect();
    let counts: Vec<i64> = parts.iter().map(|p| p.1.len() as i64).collect();
    let cand: Vec<f32> = parts.into_iter().flat_map(|p| p.1).collect();
    Ok((
        sq.into_pyarray(py).reshape([b, hq])?,
        counts.into_pyarray(py).reshape([b, hq])?,
        cand.into_pyarray(py),
    ))
}
