//! The CPU backend: tiled online-softmax flash attention driven by the plan's work lists.
//!
//! Contract:
//! - Forward work items are (batch, query head, q-tile); each walks its forward work-list row
//!   (empty tiles are never touched, full tiles do no masking work, partial tiles apply their
//!   bitmask) and writes its own disjoint slice of O and LSE.
//! - Backward runs a Δ pre-pass, then dK/dV items (batch, kv head, kv-tile) walking the kv-major
//!   lists of every query head of the GQA group in a fixed order and writing each tile's dQ
//!   contribution to its own scratch slot, then dQ items (batch, query head, q-tile) summing
//!   their slots in q-major list order. No atomics; each output element is produced by exactly
//!   one item in a fixed order, so results are bit-identical run to run (for any thread count).
//! - Items run on the call's threads ([`Par`](crate::Par)) from one sorted queue (dynamic
//!   pull): (batch, head) group by group, longest work list first within a group, each worker
//!   with a workspace from the caller's [`CpuWorkspace`].
//! - Per-worker workspace is bounded by the tile sizes and head dims; nothing of size Lq·Lkv.
//! - Hot loops are generic code compiled three times (AVX-512F/BW/VL+FMA, AVX2+FMA, portable)
//!   and selected at run time; [`Isa`] names a copy. With AVX512-BF16 ([`Isa::Avx512Bf16`])
//!   bf16 calls can also run dedicated `vdpbf16ps` kernels (bf16 operands including P and dS,
//!   f32 softmax and accumulation); otherwise bf16 is widened to f32 in an f32 copy.
//! - A [`CpuBackend`] holds one copy per storage dtype ([`KernelPaths`]: f32 `avx512` / `avx2` /
//!   `portable`; bf16 `dot` / `widen-avx512` / `widen-avx2` / `widen-portable`) and routes each
//!   call (forward, backward, telemetry forward, workspace sizes) by the call's dtype.
//!   [`CpuBackend::new`] takes the paths of [`dispatch::decision`]: measured speed on this
//!   machine, stored per machine so that results stay bit-identical across processes, or
//!   `TESSERA_CPU_PATHS`. [`CpuBackend::with_isa`] runs both dtypes on one copy and
//!   [`CpuBackend::with_paths`] on any two paths this CPU runs.
//! - Partial tiles only compute their live 16 × 16 sub-blocks, precomputed once per plan by
//!   `prepare`; masked pairs inside are still excluded exactly.
//!
//! Code map (one concept per file), in layer order (a file imports only from files listed
//! before it, and from the crate's `options`, `views`, `par`, `args`, `validate`, `backend`):
//! - Building blocks: `amx` (AMX-BF16 tile products, the software model they are tested on
//!   where the CPU has none, and whether this process may use them); `simd` (exp, tanh, row
//!   helpers); [`peak`]: the measured compute peak of each instruction path (the yardstick of
//!   `% of peak`); `isa`: the instruction sets, the per-ISA kernel copies and which forward
//!   kernel a copy and dtype run; `tile_matmul` (f32 `S = K·Qᵀ`, `P·V` and the backward
//!   products); `load_tile`: strided inputs into tiles; `tile_matmul_bf16` (`vdpbf16ps`, and
//!   its products on AMX tiles); `paths`: the kernel paths of each dtype and which of them this
//!   CPU runs; `mask_partial_tile` (where a pair of a partial tile is excluded,
//!   forward and backward); `online_softmax` (running max, rescale, finish); `live_blocks`;
//!   `column_softmax` (the forward's max and exponential passes 16 queries at a time, AVX-512);
//!   `prepare`: what a plan is turned into once (`live_blocks`, `mask_partial_tile`'s
//!   transposed masks); `workspace`: the caller-owned scratch; `schedule`: work items on the
//!   pool.
//! - Passes: `forward` (the f32 item, `forward::bf16`, `forward::select`: which item a call
//!   runs and its workspace bytes, `forward::telemetry`), `backward` (Δ, rounds, slots, reduce,
//!   the f32 item; `backward::tiles`: what both items use; `backward::bf16`, which uses only
//!   `tiles`).
//! - `backend`: [`CpuBackend`]'s [`Backend`](crate::Backend) implementation over the passes;
//!   [`dispatch`]: which path each dtype runs, measured by running that backend; this file:
//!   [`CpuBackend::new`] on the [`dispatch::decision`], and the re-exports.

#[cfg(target_arch = "x86_64")]
mod amx;
mod backend;
mod backward;
#[cfg(target_arch = "x86_64")]
mod column_softmax;
pub mod dispatch;
mod forward;
mod isa;
mod live_blocks;
mod load_tile;
mod mask_partial_tile;
mod online_softmax;
mod paths;
pub mod peak;
mod prepare;
mod schedule;
mod simd;
mod tile_matmul;
#[cfg(target_arch = "x86_64")]
mod tile_matmul_bf16;
mod workspace;

#[cfg(target_arch = "x86_64")]
pub use amx::MODEL_ENV as AMX_MODEL_ENV;

/// Whether the CPU reports AMX-BF16, the OS enabled the tile state and `TESSERA_HIDE_ISA` does
/// not hide it ([`tessera_core::cpu_features::amx_hardware`]; [`amx_status`] says whether the
/// kernels use it).
pub fn amx_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::hardware().is_ok();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this process runs the AMX kernels ([`Isa::Avx512Amx`]), and on what: `Ok("AMX-BF16")`,
/// `Ok("the software model ...")` under `TESSERA_AMX_MODEL=1`, or `Err` with the reason AMX is
/// not used (no AVX512-BF16 or AMX-BF16, no OS support, the permission refused, the self-check
/// failed, hidden by `TESSERA_HIDE_ISA`).
pub fn amx_status() -> std::result::Result<&'static str, &'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        // The rest of the AMX kernels runs on AVX512-BF16 (the model included).
        if !Isa::Avx512Bf16.supported() {
            return Err(
                "the AMX kernels need AVX512-BF16, which this CPU lacks or TESSERA_HIDE_ISA hides",
            );
        }
        match (amx::unit(), amx::status()) {
            (Some(amx::Kind::Hw), _) => Ok("AMX-BF16"),
            (Some(amx::Kind::Model), _) => {
                Ok("the software model of the tile unit (TESSERA_AMX_MODEL=1)")
            }
            (None, Err(why)) => Err(why),
            (None, Ok(())) => Err("unused"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Err("AMX exists only on x86-64")
}
pub use backend::{CpuBackend, CpuPlan};
pub use isa::Isa;
pub use paths::{Bf16Path, F32Path, KernelPaths};
pub use workspace::CpuWorkspace;

use paths::Caps;

impl CpuBackend {
    /// The backend on this machine's kernel paths: the process-wide [`dispatch::decision`]
    /// (measured speed, stored per machine, or `TESSERA_CPU_PATHS`).
    pub fn new() -> Self {
        let paths = dispatch::decision().paths();
        // The decision only names paths this CPU runs; checked again because the kernel
        // copies' `unsafe` calls rely on it.
        let paths = if Caps::detect().runs(paths) {
            paths
        } else {
            KernelPaths::of_isa(Isa::detect())
        };
        CpuBackend {
            f32_isa: paths.f32.isa(),
            bf16_isa: paths.bf16.isa(),
        }
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}
