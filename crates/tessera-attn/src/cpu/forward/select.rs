//! Which forward item kernel a call runs, and the workspace it needs: the `vdpbf16ps` kernel
//! (`forward::bf16`) where [`runs_bf16_kernel`], else the f32 kernel of the call's copy.
//!
//! Contract: the plain forward ([`run`]), the telemetry forward (`forward::telemetry`, which
//! instantiates the same choice with its observer) and [`forward_bytes`] decide by the same
//! [`runs_bf16_kernel`], so a workspace sized here fits the kernel that runs.

use crate::args::{AttnInputs, ForwardOut};
use crate::cpu::isa::{runs_bf16_kernel, Isa};
use crate::cpu::prepare::Prep;
use crate::cpu::schedule::Geometry;
use crate::cpu::workspace::Rest;
use crate::options::AttnOptions;
use crate::validate::Dims;
use tessera_core::Result;
use tessera_plan::Plan;

/// The production forward kernel for this copy and dtype.
pub(crate) fn run(
    isa: Isa,
    prep: Prep<'_>,
    d: &Dims,
    inputs: &AttnInputs<'_>,
    options: &AttnOptions,
    out: ForwardOut<'_>,
    rest: Rest<'_>,
) -> Result<()> {
    if runs_bf16_kernel(isa, d.dtype) {
        super::bf16::run(isa, prep, d, inputs, options, out, rest)
    } else {
        super::run(isa, prep, d, inputs, options, out, rest)
    }
}

/// Bytes of workspace a forward of `d` over `plan` on `threads` threads uses.
pub(crate) fn forward_bytes(isa: Isa, plan: &Plan, d: &Dims, threads: usize) -> usize {
    let g = Geometry::new(plan, d);
    let bh = d.batch * d.heads_q;
    let mut floats = threads * super::ws_floats(&g, d) + bh * plan.q_tiles;
    if runs_bf16_kernel(isa, d.dtype) {
        floats += super::bf16::pack_words(plan, d, isa == Isa::Avx512Amx);
    }
    4 * floats
}
