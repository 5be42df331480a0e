//! `tessera demo`: the main job on built-in defaults.
//!
//! Packs the shipped license-text corpus into rows of `--seq-len` tokens, plans the resulting
//! causal-within-documents mask for every row, writes its picture, then runs exact attention
//! forward and backward on the first row (seeded random Q/K/V) next to the same shapes with a
//! full mask, so the saving from skipping empty tiles is visible. Finally a few training-like
//! steps on a 4096-token prefix of row 0 with gated telemetry every 2 steps, written as
//! `telemetry.jsonl` and plotted as `telemetry.png`.

use crate::cmd::attend::{telemetry_brief, write_jsonl};
use crate::cmd::plan::PlanReport;
use crate::ctx::Ctx;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tessera::attn::{
    check_inputs, forward_logged_into, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace,
    ForwardBufs, GradInputs, LogContext, Par,
};
use tessera::conformance::workloads::random_tensor;
use tessera::core::{DType, Error, Result, Tensor};
use tessera::mask::{Mask, SegmentIds, Segments};
use tessera::pack::{PackConfig, Strategy};
use tessera::plan::{Plan, PlanShape, TileShape};
use tessera::telemetry::{
    document_kv_segments, sink_key_flags, Telemetry, TelemetryConfig, TelemetrySink,
};

/// The shipped corpus (see data/corpus/README.md), embedded so the demo runs from anywhere.
const CORPUS: &str = include_str!("../../../../data/corpus/licenses.jsonl");

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera demo\n  tessera demo --seq-len 16384 --heads 4 --out-dir /tmp/demo"
)]
pub struct DemoArgs {
    /// Tokens per packed row.
    #[arg(long, value_name = "N", default_value_t = 32768)]
    pub seq_len: usize,
    /// Query (= kv) heads for the attention run.
    #[arg(long, default_value_t = 2)]
    pub heads: usize,
    /// Head dimension for the attention run.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Directory for the demo's files (created if missing).
    #[arg(long, value_name = "DIR", default_value = "tessera-demo")]
    pub out_dir: PathBuf,
}

struct Timing {
    fwd_s: f64,
    bwd_s: f64,
}

/// One forward and one backward over `plan` with seeded inputs.
fn attend_once(plan: &Arc<Plan>, heads: usize, d: usize) -> Result<Timing> {
    let len = plan.shape.q_len;
    let shape = vec![1, heads, len, d];
    let q = random_tensor(shape.clone(), DType::F32, 11)?;
    let k = random_tensor(shape.clone(), DType::F32, 12)?;
    let v = random_tensor(shape.clone(), DType::F32, 13)?;
    let d_o = random_tensor(shape, DType::F32, 14)?;
    let backend = CpuBackend::new();
    let opts = AttnOptions::default();
    let t = Instant::now();
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
    let f = backend.forward(&inputs, plan, &opts)?;
    let fwd_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    backend.backward(
        &GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), d_o.view())?,
        plan,
        &opts,
    )?;
    Ok(Timing {
        fwd_s,
        bwd_s: t.elapsed().as_secs_f64(),
    })
}

pub fn run(args: DemoArgs, ctx: &Ctx) -> Result<()> {
    if args.heads == 0 || args.head_dim == 0 || args.seq_len < 2 {
        return Err(Error::invalid(
            "--heads/--head-dim/--seq-len",
            "positive values (seq-len >= 2)",
            0,
        ));
    }
    if args.seq_len > i32::MAX as usize {
        return Err(Error::invalid(
            "--seq-len",
            format!("at most {}", i32::MAX),
            args.seq_len,
        ));
    }
    // The attention run's tensors (Q, K, V, dO, outputs, gradients), checked before any step
    // writes a file.
    let elems = args.heads as u128 * args.seq_len as u128 * args.head_dim as u128;
    tessera::core::budget::check(
        || {
            format!(
                "demo attention --seq-len {} --heads {} --head-dim {}",
                args.seq_len, args.heads, args.head_dim
            )
        },
        8 * 4 * elems,
    )?;
    let dir = &args.out_dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let kernels = ctx.kernel_decision()?;
    print!(
        "{}",
        crate::manifest::collect(ctx.cache_dir().as_deref(), Some(kernels)).to_text()
    );

    // 1. Pack the corpus.
    let corpus = dir.join("corpus.jsonl");
    tessera::io::atomic_write(&corpus, |w| {
        w.write_all(CORPUS.as_bytes())
            .map_err(|e| Error::io(&corpus, e))
    })?;
    let cfg = PackConfig {
        seq_len: args.seq_len,
        strategy: Strategy::BestFit,
        bos: tessera::pack::DEFAULT_BOS,
    };
    let packed = tessera::pack::pack_jsonl(&corpus, &cfg)?;
    let rows_path = dir.join("rows.safetensors");
    tessera::pack::write_packed(&rows_path, &packed)?;
    println!(
        "\n[pack] {} -> {}",
        packed.stats.summary(),
        rows_path.display()
    );

    // 2. Plan causal-within-documents for every packed row.
    let ids: Vec<i64> = packed.segment_ids.iter().map(|&s| s as i64).collect();
    let segs = SegmentIds::new(packed.rows, packed.seq_len, ids)?;
    let mask = Mask::causal() & Mask::document(Segments::shared(segs.clone()));
    let tile = TileShape::default();
    let built_before = tessera::core::metrics::snapshot().plans_built;
    let plan = ctx.plan(
        &mask,
        PlanShape::new(packed.rows, 1, packed.seq_len, packed.seq_len)?,
        tile,
    )?;
    println!("\n[plan] causal & document over all {} rows", packed.rows);
    println!(
        "{}",
        PlanReport::new(
            &plan,
            args.head_dim,
            tessera::core::metrics::snapshot().plans_built == built_before,
        )
        .to_text()
    );
    let png = dir.join("plan.png");
    tessera::viz::write_plan_png(
        &plan,
        0,
        0,
        "causal & document: packed license corpus, row 0",
        &png,
    )?;
    println!("  picture   {}", png.display());

    // 3. Attention on row 0 versus a full mask of the same shape.
    let row0 = SegmentIds::shared(segs.row(0).to_vec())?;
    let docs_mask = Mask::causal() & Mask::document(Segments::shared(row0));
    let shape = PlanShape::new(1, args.heads, args.seq_len, args.seq_len)?;
    let docs_plan = ctx.plan(&docs_mask, shape, tile)?;
    let full_plan = ctx.plan(&Mask::full(), shape, tile)?;
    let (h, d) = (args.heads, args.head_dim);
    println!(
        "\n[attend] row 0: B=1 H={h} L={} D={d} f32, CPU backend ({})",
        args.seq_len,
        CpuBackend::new().isa().name()
    );
    let mut lines = Vec::new();
    for (name, p) in [("causal & document", &docs_plan), ("full", &full_plan)] {
        eprintln!("running {name} ...");
        let t = attend_once(p, h, d)?;
        lines.push((
            name,
            t,
            p.stats.tile_density,
            p.forward_flops(d, d),
            p.backward_flops(d, d),
        ));
    }
    println!(
        "  {:<18} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "mask", "tiles", "fwd ms", "fwd GF/s", "bwd ms", "bwd GF/s"
    );
    for (name, t, dens, ff, bf) in &lines {
        println!(
            "  {:<18} {:>7.2}% {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            name,
            100.0 * dens,
            t.fwd_s * 1e3,
            ff / t.fwd_s / 1e9,
            t.bwd_s * 1e3,
            bf / t.bwd_s / 1e9
        );
    }
    let (docs, full) = (&lines[0], &lines[1]);
    println!(
        "  skipping: forward time ratio {:.4} vs active-tile ratio {:.4}",
        docs.1.fwd_s / full.1.fwd_s,
        docs.2 / full.2
    );

    // 4. Gated telemetry over a few training-like steps on a prefix of row 0.
    eprintln!("running telemetry steps ...");
    telemetry_steps(ctx, segs.row(0), d, dir)
}

const TEL_LEN: usize = 4096;
const TEL_HEADS: usize = 4;
const TEL_STEPS: u64 = 6;
const TEL_EVERY: u64 = 2;

/// Q, K, V of one step: seeded noise plus a shared query direction that the sink keys (the first
/// key of each document) pick up more strongly with every step and every head, so the sink mass
/// visibly grows over the run (the attention-sink pattern).
fn step_inputs(step: u64, len: usize, d: usize, sink: &[bool]) -> Result<[Tensor; 3]> {
    let shape = vec![1, TEL_HEADS, len, d];
    let mut q = random_tensor(shape.clone(), DType::F32, 100 + 3 * step)?.to_f32_vec()?;
    let mut k = random_tensor(shape.clone(), DType::F32, 101 + 3 * step)?.to_f32_vec()?;
    let v = random_tensor(shape.clone(), DType::F32, 102 + 3 * step)?;
    let root = (d as f32).sqrt();
    for h in 0..TEL_HEADS {
        // Logit boost of a sink key for a typical query: up to ~10 at the last step, last head.
        let boost = 10.0 * (h + 1) as f32 / TEL_HEADS as f32 * (step + 1) as f32 / TEL_STEPS as f32;
        for (i, &is_sink) in sink.iter().enumerate().take(len) {
            let row = (h * len + i) * d;
            q[row] += 1.0;
            if is_sink {
                k[row] += boost * root;
            }
        }
    }
    Ok([
        Tensor::from_f32(shape.clone(), q)?,
        Tensor::from_f32(shape, k)?,
        v,
    ])
}

/// `TEL_STEPS` forwards with telemetry every `TEL_EVERY` steps through
/// `tessera::attn::forward_logged`; writes the records and their picture, prints one line.
fn telemetry_steps(ctx: &Ctx, row0: &[i64], d: usize, dir: &Path) -> Result<()> {
    let len = TEL_LEN.min(row0.len());
    let ids = SegmentIds::shared(row0[..len].to_vec())?;
    let mask = Mask::causal() & Mask::document(Segments::shared(ids));
    let plan = ctx.plan(
        &mask,
        PlanShape::new(1, TEL_HEADS, len, len)?,
        TileShape::default(),
    )?;
    let config = TelemetryConfig::every(TEL_EVERY);
    let flags = sink_key_flags(document_kv_segments(&mask), 1, len, config.sink_tokens)?;
    let mut tel = Telemetry::new(config.clone())?;
    let mut sink = TelemetrySink::new(config);
    let backend = CpuBackend::new();
    let opts = AttnOptions::default();
    // A training loop's shape: the plan prepared once, outputs and workspace reused every step.
    let prepared = backend.prepare(&plan)?;
    let mut ws = CpuWorkspace::new();
    let mut out: Option<ForwardBufs> = None;
    for step in 0..TEL_STEPS {
        let [q, k, v] = step_inputs(step, len, d, &flags)?;
        let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
        let bufs = match &mut out {
            Some(b) => b,
            None => out.insert(ForwardBufs::new(&check_inputs(&inputs, &opts)?)),
        };
        forward_logged_into(
            &backend,
            &prepared,
            &inputs,
            &opts,
            bufs.out(),
            &mut ws,
            Par::Current,
            LogContext {
                tel: &tel,
                mask: &mask,
                layer: 0,
                sink: &mut sink,
            },
        )?;
        tel.advance();
    }
    let records = sink.flush();
    let jsonl = dir.join("telemetry.jsonl");
    write_jsonl(&jsonl, &records)?;
    let png = dir.join("telemetry.png");
    let title = format!("tessera demo: causal & document, row 0, L={len}, every {TEL_EVERY} steps");
    tessera::viz::write_telemetry_png(&records, &title, &png)?;
    println!(
        "\n[telemetry] {} of {TEL_STEPS} steps logged: {} -> {}, {}",
        records.len(),
        telemetry_brief(&records),
        jsonl.display(),
        png.display()
    );
    Ok(())
}
