//! Backend API v2: the [`Backend`] trait (its argument structs are `args`'s) and the owned
//! output buffers of its allocating conveniences ([`ForwardBufs`], [`GradBufs`]).
//!
//! Contract:
//! - [`Backend::prepare`] derives everything a backend needs from a plan once (transposed
//!   partial masks, live sub-blocks, device copies, ...); a [`Prepared`] plan is reused across
//!   calls, layers and steps and never recomputed by them.
//! - [`Backend::forward_into`] / [`Backend::backward_into`] write into caller-owned, contiguous
//!   outputs ([`ForwardOut`], [`GradOut`]) using a caller-owned workspace
//!   ([`Backend::Workspace`], grown on first use and reused after; its size for a call is
//!   [`Backend::forward_workspace_size`] / [`Backend::backward_workspace_size`]) on the threads
//!   named by a [`Par`]. Every element of every output is written; nothing else is.
//! - Inputs are [`StridedView`](crate::StridedView)s: `[B, H, L, D]` with unit stride in D and
//!   any batch, head and row strides, so a PyTorch `[B, L, H, D]` tensor transposed to
//!   `[B, H, L, D]` is read in place. Outputs are contiguous `[B, H, L, D]` (the caller
//!   allocates them).
//! - [`Backend::forward`] / [`Backend::backward`] are the allocating conveniences, built on the
//!   `*_into` calls.

use crate::args::{
    AttnInputs, BackwardOutput, ForwardOut, ForwardOutput, GradInputs, GradOut, TelemetryInput,
};
use crate::options::AttnOptions;
use crate::par::Par;
use crate::validate::{check_inputs, Dims};
use crate::views::OutBuf;
use std::sync::Arc;
use tessera_core::{Error, Result, Tensor};
use tessera_plan::Plan;
use tessera_telemetry::AttnSummary;

/// A plan prepared for one backend: the plan plus everything derived from it.
pub trait Prepared: Send + Sync {
    /// The plan this was prepared from.
    fn plan(&self) -> &Plan;
}

/// An attention implementation. Every backend must pass the conformance suite.
pub trait Backend: Send + Sync {
    /// What [`Backend::prepare`] derives from a plan.
    type Prepared: Prepared;
    /// Caller-owned scratch memory, grown on first use and reused by later calls.
    type Workspace: Default + Send;

    /// Short name (`cpu`, `cuda`, ...).
    fn name(&self) -> &str;

    /// Derives everything the kernels need from `plan`, once.
    fn prepare(&self, plan: &Arc<Plan>) -> Result<Self::Prepared>;

    /// Bytes of workspace a forward of `inputs` on `par` uses.
    fn forward_workspace_size(
        &self,
        prepared: &Self::Prepared,
        inputs: &AttnInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize>;

    /// Bytes of workspace a backward of `inputs` on `par` uses.
    fn backward_workspace_size(
        &self,
        prepared: &Self::Prepared,
        inputs: &GradInputs<'_>,
        par: Par<'_>,
    ) -> Result<usize>;

    /// O, LSE and max_logit of `softmax(scale·QKᵀ masked by the plan)·V`, written into `out`.
    fn forward_into(
        &self,
        prepared: &Self::Prepared,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        out: ForwardOut<'_>,
        ws: &mut Self::Workspace,
        par: Par<'_>,
    ) -> Result<()>;

    /// The forward of a telemetry logging step (docs/semantics.md#telemetry): the same outputs as
    /// [`Backend::forward_into`] (bit-identical) plus the step's summary (`tel.streams` say which
    /// fields; `max_logit` always). The default returns [`Error::Unsupported`].
    #[allow(clippy::too_many_arguments)]
    fn forward_with_telemetry_into(
        &self,
        prepared: &Self::Prepared,
        inputs: &AttnInputs<'_>,
        options: &AttnOptions,
        tel: &TelemetryInput<'_>,
        out: ForwardOut<'_>,
        ws: &mut Self::Workspace,
        par: Par<'_>,
    ) -> Result<AttnSummary> {
        let _ = (prepared, inputs, options, tel, out, ws, par);
        Err(Error::Unsupported(format!(
            "backend {} has no telemetry forward",
            self.name()
        )))
    }

    /// dQ, dK, dV (and dsinks) given the forward's O and LSE and the output gradient dO,
    /// written into `out`.
    fn backward_into(
        &self,
        prepared: &Self::Prepared,
        inputs: &GradInputs<'_>,
        options: &AttnOptions,
        out: GradOut<'_>,
        ws: &mut Self::Workspace,
        par: Par<'_>,
    ) -> Result<()>;

    /// Allocating forward: prepares `plan`, allocates the outputs, runs [`Backend::forward_into`].
    fn forward(
        &self,
        inputs: &AttnInputs<'_>,
        plan: &Arc<Plan>,
        options: &AttnOptions,
    ) -> Result<ForwardOutput> {
        let prepared = self.prepare(plan)?;
        let d = check_inputs(inputs, options)?;
        let mut bufs = ForwardBufs::new(&d);
        self.forward_into(
            &prepared,
            inputs,
            options,
            bufs.out(),
            &mut Self::Workspace::default(),
            Par::Current,
        )?;
        bufs.finish(&d)
    }

    /// Allocating forward of a telemetry logging step.
    fn forward_with_telemetry(
        &self,
        inputs: &AttnInputs<'_>,
        plan: &Arc<Plan>,
        options: &AttnOptions,
        tel: &TelemetryInput<'_>,
    ) -> Result<(ForwardOutput, AttnSummary)> {
        let prepared = self.prepare(plan)?;
        let d = check_inputs(inputs, options)?;
        let mut bufs = ForwardBufs::new(&d);
        let summary = self.forward_with_telemetry_into(
            &prepared,
            inputs,
            options,
            tel,
            bufs.out(),
            &mut Self::Workspace::default(),
            Par::Current,
        )?;
        Ok((bufs.finish(&d)?, summary))
    }

    /// Allocating backward: prepares `plan`, allocates the outputs, runs
    /// [`Backend::backward_into`].
    fn backward(
        &self,
        inputs: &GradInputs<'_>,
        plan: &Arc<Plan>,
        options: &AttnOptions,
    ) -> Result<BackwardOutput> {
        let prepared = self.prepare(plan)?;
        let d = check_inputs(&inputs.forward(), options)?;
        let mut bufs = GradBufs::new(&d, options.sinks.is_some());
        self.backward_into(
            &prepared,
            inputs,
            options,
            bufs.out(),
            &mut Self::Workspace::default(),
            Par::Current,
        )?;
        bufs.finish(&d)
    }
}

/// Owned forward outputs for a problem (zeroed: the kernels write every element).
pub struct ForwardBufs {
    o: OutBuf,
    lse: Vec<f32>,
    max_logit: Vec<f32>,
}

impl ForwardBufs {
    /// Buffers for problem `d`.
    pub fn new(d: &Dims) -> Self {
        let bh = d.batch * d.heads_q;
        ForwardBufs {
            o: OutBuf::zeroed(d.dtype, bh * d.q_len * d.d_v),
            lse: vec![0.0; bh * d.q_len],
            max_logit: vec![0.0; bh],
        }
    }

    /// The buffers as caller-owned outputs.
    pub fn out(&mut self) -> ForwardOut<'_> {
        ForwardOut {
            o: self.o.data(),
            lse: &mut self.lse,
            max_logit: &mut self.max_logit,
        }
    }

    /// The buffers as tensors.
    pub fn finish(self, d: &Dims) -> Result<ForwardOutput> {
        Ok(ForwardOutput {
            o: self
                .o
                .into_tensor(vec![d.batch, d.heads_q, d.q_len, d.d_v])?,
            lse: Tensor::from_f32(vec![d.batch, d.heads_q, d.q_len], self.lse)?,
            max_logit: Tensor::from_f32(vec![d.batch, d.heads_q], self.max_logit)?,
        })
    }
}

/// Owned backward outputs for a problem.
pub struct GradBufs {
    dq: OutBuf,
    dk: OutBuf,
    dv: OutBuf,
    dsinks: Option<Vec<f32>>,
}

impl GradBufs {
    /// Buffers for problem `d` (with a dsinks buffer when `sinks`).
    pub fn new(d: &Dims, sinks: bool) -> Self {
        let kv = d.batch * d.heads_kv * d.kv_len;
        GradBufs {
            dq: OutBuf::zeroed(d.dtype, d.batch * d.heads_q * d.q_len * d.d_qk),
            dk: OutBuf::zeroed(d.dtype, kv * d.d_qk),
            dv: OutBuf::zeroed(d.dtype, kv * d.d_v),
            dsinks: sinks.then(|| vec![0.0; d.heads_q]),
        }
    }

    /// The buffers as caller-owned outputs.
    pub fn out(&mut self) -> GradOut<'_> {
        GradOut {
            dq: self.dq.data(),
            dk: self.dk.data(),
            dv: self.dv.data(),
            dsinks: self.dsinks.as_deref_mut(),
        }
    }

    /// The buffers as tensors.
    pub fn finish(self, d: &Dims) -> Result<BackwardOutput> {
        Ok(BackwardOutput {
            dq: self
                .dq
                .into_tensor(vec![d.batch, d.heads_q, d.q_len, d.d_qk])?,
            dk: self
                .dk
                .into_tensor(vec![d.batch, d.heads_kv, d.kv_len, d.d_qk])?,
            dv: self
                .dv
                .into_tensor(vec![d.batch, d.heads_kv, d.kv_len, d.d_v])?,
            dsinks: match self.dsinks {
                Some(v) => Some(Tensor::from_f32(vec![d.heads_q], v)?),
                None => None,
            },
        })
    }
}
