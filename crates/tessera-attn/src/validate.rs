//! Input validation shared by every backend (docs/semantics.md#errors).
//!
//! Contract: [`check_forward`] and [`check_backward`] (and [`check_forward_out`],
//! [`check_grad_out`] for caller-owned outputs) accept exactly the inputs the kernels can
//! run on and return their [`Dims`]; everything else is an `InvalidArgument` error naming the
//! argument, what was expected and what was found. The plan is checked for internal consistency
//! too (so a corrupt deserialized plan is an error, not a panic).

use crate::args::{AttnInputs, ForwardOut, GradInputs, GradOut};
use crate::options::AttnOptions;
use crate::views::StridedView;
use tessera_core::tensor::TensorView;
use tessera_core::{DType, Error, Result};
use tessera_plan::Plan;

/// Problem dimensions of a validated attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub heads_q: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub heads_kv: usize,
    /// Query length `Lq`.
    pub q_len: usize,
    /// Key/value length `Lkv`.
    pub kv_len: usize,
    /// Query/key head dimension `Dqk`.
    pub d_qk: usize,
    /// Value head dimension `Dv`.
    pub d_v: usize,
    /// Storage dtype of q, k, v (and o, dO, and every storage-dtype output).
    pub dtype: DType,
}

impl Dims {
    /// Query heads per kv head (`Hq / Hkv`).
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("shape {s:?}")
}

/// Rank, emptiness and element count of one contiguous tensor argument.
fn check_tensor<'a>(name: &str, t: &TensorView<'a>, layout: &str) -> Result<&'a [usize]> {
    let rank = layout.split(',').count();
    if t.shape.len() != rank {
        return Err(Error::invalid(
            name,
            format!("rank {rank} {layout}"),
            format!("rank {} ({})", t.shape.len(), shape_str(t.shape)),
        ));
    }
    if t.shape.contains(&0) {
        return Err(Error::invalid(
            name,
            format!("a non-empty tensor {layout}"),
            shape_str(t.shape),
        ));
    }
    let want = t
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            Error::invalid(
                name,
                "a shape whose size fits in memory",
                shape_str(t.shape),
            )
        })?;
    if want != t.len() {
        return Err(Error::invalid(
            name,
            format!("{want} elements for {}", shape_str(t.shape)),
            format!("{} elements", t.len()),
        ));
    }
    Ok(t.shape)
}

/// Emptiness, unit D stride and bounds of one strided input.
fn check_view(name: &str, t: &StridedView<'_>, layout: &str) -> Result<[usize; 4]> {
    if t.shape.contains(&0) {
        return Err(Error::invalid(
            name,
            format!("a non-empty tensor {layout}"),
            shape_str(&t.shape),
        ));
    }
    t.check(name)?;
    Ok(t.shape)
}

fn check_dim(name: &str, what: &str, want: usize, got: usize, shape: &[usize]) -> Result<()> {
    if want != got {
        return Err(Error::invalid(
            name,
            format!("{what} = {want}"),
            format!("{got} ({})", shape_str(shape)),
        ));
    }
    Ok(())
}

fn check_same_dtype(name: &str, got: DType, want: DType) -> Result<()> {
    if got != want {
        return Err(Error::invalid(
            name,
            format!("dtype {want} (the storage dtype of q)"),
            got,
        ));
    }
    Ok(())
}

fn check_positive(name: &str, v: Option<f32>) -> Result<()> {
    if let Some(x) = v {
        if !x.is_finite() || x <= 0.0 {
            return Err(Error::invalid(name, "a finite positive number", x));
        }
    }
    Ok(())
}

/// Checks the inputs, the plan and the options of a forward call.
pub fn check_forward(inputs: &AttnInputs<'_>, plan: &Plan, options: &AttnOptions) -> Result<Dims> {
    let d = check_inputs(inputs, options)?;
    check_plan(plan, &d)?;
    Ok(d)
}

/// Checks q, k, v and the options (everything [`check_forward`] checks except the plan).
pub fn check_inputs(inputs: &AttnInputs<'_>, options: &AttnOptions) -> Result<Dims> {
    let qs = check_view("q", &inputs.q, "[B, Hq, Lq, Dqk]")?;
    let ks = check_view("k", &inputs.k, "[B, Hkv, Lkv, Dqk]")?;
    let vs = check_view("v", &inputs.v, "[B, Hkv, Lkv, Dv]")?;
    let dtype = inputs.q.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(Error::invalid("q", "dtype f32 or bf16", dtype));
    }
    check_same_dtype("k", inputs.k.dtype(), dtype)?;
    check_same_dtype("v", inputs.v.dtype(), dtype)?;
    let d = Dims {
        batch: qs[0],
        heads_q: qs[1],
        heads_kv: ks[1],
        q_len: qs[2],
        kv_len: ks[2],
        d_qk: qs[3],
        d_v: vs[3],
        dtype,
    };
    check_dim("k", "batch B (as q)", d.batch, ks[0], &ks)?;
    check_dim("k", "head dim Dqk (as q)", d.d_qk, ks[3], &ks)?;
    check_dim("v", "batch B (as q)", d.batch, vs[0], &vs)?;
    check_dim("v", "kv heads Hkv (as k)", d.heads_kv, vs[1], &vs)?;
    check_dim("v", "kv length Lkv (as k)", d.kv_len, vs[2], &vs)?;
    if !d.heads_q.is_multiple_of(d.heads_kv) {
        return Err(Error::invalid(
            "k",
            format!(
                "kv heads Hkv dividing the query heads Hq = {} (GQA/MQA)",
                d.heads_q
            ),
            format!("Hkv = {}", d.heads_kv),
        ));
    }
    check_positive("scale", options.scale)?;
    check_positive("softcap", options.softcap)?;
    if let Some(s) = &options.sinks {
        if s.len() != d.heads_q {
            return Err(Error::invalid(
                "sinks",
                format!("{} values (one per query head)", d.heads_q),
                format!("{} values", s.len()),
            ));
        }
        if let Some((h, x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(Error::invalid(
                "sinks",
                "finite values",
                format!("{x} at head {h}"),
            ));
        }
    }
    Ok(d)
}

/// Checks an O-shaped input (`[B, Hq, Lq, Dv]`, q's dtype) against validated dims.
pub fn check_o_like(name: &str, t: &StridedView<'_>, d: &Dims) -> Result<()> {
    let want_o = [d.batch, d.heads_q, d.q_len, d.d_v];
    let s = check_view(name, t, "[B, Hq, Lq, Dv]")?;
    if s != want_o {
        return Err(Error::invalid(
            name,
            format!("shape {want_o:?} ([B, Hq, Lq, Dv] from q and v)"),
            shape_str(&s),
        ));
    }
    check_same_dtype(name, t.dtype(), d.dtype)
}

/// Checks the inputs of a backward call: everything [`check_forward`] checks, plus o and d_o
/// (`[B, Hq, Lq, Dv]`, q's dtype) and lse (`[B, Hq, Lq]` f32, contiguous).
pub fn check_backward(inputs: &GradInputs<'_>, plan: &Plan, options: &AttnOptions) -> Result<Dims> {
    let d = check_forward(&inputs.forward(), plan, options)?;
    check_o_like("o", &inputs.o, &d)?;
    check_o_like("d_o", &inputs.d_o, &d)?;
    check_lse_like("lse", &inputs.lse, &d)?;
    if let Some(g) = &inputs.d_lse {
        check_lse_like("d_lse", g, &d)?;
    }
    Ok(d)
}

/// A contiguous `[B, Hq, Lq]` f32 tensor.
fn check_lse_like(name: &str, t: &TensorView<'_>, d: &Dims) -> Result<()> {
    let s = check_tensor(name, t, "[B, Hq, Lq]")?;
    let want = [d.batch, d.heads_q, d.q_len];
    if s != want {
        return Err(Error::invalid(
            name,
            format!("shape {want:?} ([B, Hq, Lq] from q)"),
            shape_str(s),
        ));
    }
    if t.dtype() != DType::F32 {
        return Err(Error::invalid(name, "dtype f32", t.dtype()));
    }
    Ok(())
}

fn check_out(
    name: &str,
    len: usize,
    dtype: DType,
    want: usize,
    d: &Dims,
    layout: &str,
) -> Result<()> {
    if dtype != d.dtype {
        return Err(Error::invalid(
            name,
            format!("dtype {} (the storage dtype of q)", d.dtype),
            dtype,
        ));
    }
    if len != want {
        return Err(Error::invalid(
            name,
            format!("a contiguous buffer of {want} elements {layout}"),
            format!("{len} elements"),
        ));
    }
    Ok(())
}

/// Checks caller-owned forward outputs against validated dims.
pub fn check_forward_out(out: &ForwardOut<'_>, d: &Dims) -> Result<()> {
    let bh = d.batch * d.heads_q;
    check_out(
        "o",
        out.o.len(),
        out.o.dtype(),
        bh * d.q_len * d.d_v,
        d,
        "[B, Hq, Lq, Dv]",
    )?;
    check_out(
        "lse",
        out.lse.len(),
        DType::F32,
        bh * d.q_len,
        &Dims {
            dtype: DType::F32,
            ..*d
        },
        "[B, Hq, Lq]",
    )?;
    check_out(
        "max_logit",
        out.max_logit.len(),
        DType::F32,
        bh,
        &Dims {
            dtype: DType::F32,
            ..*d
        },
        "[B, Hq]",
    )
}

/// Checks caller-owned backward outputs against validated dims (dsinks exactly when `sinks`).
pub fn check_grad_out(out: &GradOut<'_>, d: &Dims, sinks: bool) -> Result<()> {
    let kv = d.batch * d.heads_kv * d.kv_len;
    check_out(
        "dq",
        out.dq.len(),
        out.dq.dtype(),
        d.batch * d.heads_q * d.q_len * d.d_qk,
        d,
        "[B, Hq, Lq, Dqk]",
    )?;
    check_out(
        "dk",
        out.dk.len(),
        out.dk.dtype(),
        kv * d.d_qk,
        d,
        "[B, Hkv, Lkv, Dqk]",
    )?;
    check_out(
        "dv",
        out.dv.len(),
        out.dv.dtype(),
        kv * d.d_v,
        d,
        "[B, Hkv, Lkv, Dv]",
    )?;
    match (&out.dsinks, sinks) {
        (Some(s), true) => check_out(
            "dsinks",
            s.len(),
            DType::F32,
            d.heads_q,
            &Dims {
                dtype: DType::F32,
                ..*d
            },
            "[Hq]",
        ),
        (None, false) => Ok(()),
        (None, true) => Err(Error::invalid(
            "dsinks",
            "an [Hq] f32 buffer (sinks were given)",
            "none",
        )),
        (Some(_), false) => Err(Error::invalid(
            "dsinks",
            "no buffer (no sinks were given)",
            "a buffer",
        )),
    }
}

/// The plan must be built for exactly this problem and be internally consistent.
fn check_plan(plan: &Plan, d: &Dims) -> Result<()> {
    let s = plan.shape;
    // A plan whose mask does not vary along batch rows (heads) and that was built for one row
    // (head) serves any batch size (head count): every row (head) uses its one head plan.
    let batch_ok = s.batch == d.batch || (s.batch == 1 && plan.batch_groups == 1);
    let heads_ok = s.heads == d.heads_q || (s.heads == 1 && plan.head_groups == 1);
    if !(batch_ok && heads_ok) || (s.q_len, s.kv_len) != (d.q_len, d.kv_len) {
        return Err(Error::invalid(
            "plan",
            format!(
                "a plan for B={} Hq={} Lq={} Lkv={} (the shapes of q and k)",
                d.batch, d.heads_q, d.q_len, d.kv_len
            ),
            format!(
                "a plan for B={} H={} Lq={} Lkv={}",
                s.batch, s.heads, s.q_len, s.kv_len
            ),
        ));
    }
    check_plan_consistent(plan)
}

/// The plan's internal consistency (tiles, groups, work lists and partial-mask table agree), so
/// that a corrupt or hand-edited plan is an error, never an out-of-range index in a kernel
/// (see [`Plan::check_consistent`]).
pub fn check_plan_consistent(plan: &Plan) -> Result<()> {
    plan.check_consistent()
}
