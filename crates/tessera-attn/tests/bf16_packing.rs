//! The `vdpbf16ps` forward packs each kv block of K and V when the first item visits it, into
//! buffers of the caller's reused workspace. Whatever a workspace held before, and however many
//! threads race to pack, a call's outputs are bit for bit those of a fresh workspace on one
//! thread: stale blocks or stale non-finite-V fix-ups from an earlier call would show here.
//! Skipped, with a printed reason, where the CPU lacks AVX512-BF16.

use half::bf16;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use tessera_attn::cpu::Isa;
use tessera_attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs, Par,
};
use tessera_conformance::cpu_backend_or_skip;
use tessera_core::Tensor;
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, Plan, PlanShape, TileShape};

/// One call's inputs: `[1, h, l, d]` Q and K of head dim `dqk`, V of `dv`.
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Arc<Plan>,
}

fn case(seed: u64, h: usize, l: usize, dqk: usize, dv: usize, mask: &Mask, nan_v: bool) -> Case {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = |d: usize| -> Vec<bf16> {
        (0..h * l * d)
            .map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0)))
            .collect()
    };
    let (q, k, mut v) = (t(dqk), t(dqk), t(dv));
    if nan_v {
        // A NaN and an infinity in V: the kernel's fix-up path.
        let n = v.len();
        v[dv + 3] = bf16::NAN;
        v[n / 2] = bf16::INFINITY;
    }
    let mk = |x: Vec<bf16>, d: usize| Tensor::from_bf16(vec![1, h, l, d], x).unwrap();
    let plan = build_plan(
        mask,
        PlanShape::new(1, h, l, l).unwrap(),
        TileShape::new(32, 32).unwrap(),
    )
    .unwrap();
    Case {
        q: mk(q, dqk),
        k: mk(k, dqk),
        v: mk(v, dv),
        plan: Arc::new(plan),
    }
}

/// O, LSE and max logits as bits, from a forward of `c` on workspace `ws` with `par`.
fn run(be: &CpuBackend, c: &Case, ws: &mut CpuWorkspace, par: Par<'_>) -> Vec<u32> {
    let x = AttnInputs::contiguous(c.q.view(), c.k.view(), c.v.view()).unwrap();
    let opts = AttnOptions::default();
    let dims = check_inputs(&x, &opts).unwrap();
    let prepared = be.prepare(&c.plan).unwrap();
    let mut fb = ForwardBufs::new(&dims);
    be.forward_into(&prepared, &x, &opts, fb.out(), ws, par)
        .unwrap();
    let f = fb.finish(&dims).unwrap();
    [f.o, f.lse, f.max_logit]
        .iter()
        .flat_map(|t| t.to_f32_vec().unwrap())
        .map(f32::to_bits)
        .collect()
}

#[test]
fn a_reused_workspace_and_racing_packers_give_fresh_results_bit_for_bit() {
    // The vdpbf16ps kernels' packs only.
    let Some(be) = cpu_backend_or_skip(Isa::Avx512Bf16) else {
        return;
    };
    let docs = |l: usize, len: i64| {
        let seg = SegmentIds::shared((0..l as i64).map(|i| i / len).collect()).unwrap();
        Mask::causal() & Mask::document(Segments::shared(seg))
    };
    // K read in place (even D, whole row blocks) and packed (odd Dqk, ragged length); V with
    // and without non-finite values; masks that visit different kv blocks.
    let cases = [
        case(1, 3, 200, 64, 64, &docs(200, 45), true),
        case(
            2,
            2,
            150,
            33,
            20,
            &(Mask::causal() & Mask::window(40, 0)),
            false,
        ),
        case(3, 3, 200, 64, 64, &Mask::causal(), false),
        case(4, 2, 150, 33, 20, &docs(150, 29), true),
        case(5, 3, 200, 64, 64, &docs(200, 45), false),
    ];
    let fresh: Vec<Vec<u32>> = cases
        .iter()
        .map(|c| run(&be, c, &mut CpuWorkspace::new(), Par::Seq))
        .collect();
    // The fix-up path ran: a NaN reached some output.
    assert!(fresh[0].iter().any(|&b| f32::from_bits(b).is_nan()));
    let mut ws = CpuWorkspace::new();
    for round in 0..2 {
        for (i, c) in cases.iter().enumerate() {
            for par in [Par::Rayon(2), Par::Rayon(3), Par::Seq] {
                let got = run(&be, c, &mut ws, par);
                assert!(
                    got == fresh[i],
                    "case {i} (round {round}, {par:?}): outputs differ from a fresh workspace's"
                );
            }
        }
    }
}
