//! `tessera attend`: attention (and optionally its gradients) on tensors read from files.
//!
//! A thin layer: read Q, K, V (and dO, sinks), plan the mask through `MaskArgs` (plan cache),
//! run the CPU backend of `tessera-attn`, write every requested output atomically, print one
//! summary line (or one JSON object with `--json`). With `--telemetry F.jsonl` the forward is a
//! logging step (step 0, layer 0) of the gated telemetry (`tessera::attn::forward_logged`) and its
//! record is written to F (and included in the `--json` report). All checking of shapes, dtypes and options is
//! the library's (docs/semantics.md#errors); this file only checks how the flags combine.

use crate::ctx::{check_outputs, print_json, Ctx};
use crate::maskload::MaskArgs;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera::attn::{
    effective_gflops, forward_logged, AttnInputs, AttnOptions, Backend, GradInputs, LogContext,
};
use tessera::core::{DType, Error, Result, Tensor};
use tessera::telemetry::{
    Telemetry, TelemetryConfig, TelemetryRecord, TelemetrySink, DEFAULT_SINK_TOKENS,
};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera attend --q q.npy --k k.npy --v v.npy --mask 'causal & document' --segments seg.npy --out o.npy --lse lse.npy\n  tessera attend --q qkv.safetensors:q --k qkv.safetensors:k --v qkv.safetensors:v --mask 'window(1024) & causal' \\\n      --softcap 30 --sinks sinks.npy --out o.safetensors --grad-out do.npy --dq dq.npy --dk dk.npy --dv dv.npy --dsinks dsinks.npy\n  tessera attend --q q.npy --k k.npy --v v.npy --mask causal --dtype bf16 --out o.npy   # npy <u2 files as bf16\n  tessera attend --q q.npy --k k.npy --v v.npy --mask 'causal & document' --segments seg.npy --out o.npy \\\n      --telemetry telemetry.jsonl --sink-tokens 4   # also one telemetry record (step 0, layer 0)"
)]
pub struct AttendArgs {
    /// Queries [B, Hq, Lq, Dqk] (.npy, or FILE.safetensors[:NAME]).
    #[arg(long, value_name = "F")]
    pub q: String,
    /// Keys [B, Hkv, Lkv, Dqk]; Hq must be a multiple of Hkv (GQA/MQA).
    #[arg(long, value_name = "F")]
    pub k: String,
    /// Values [B, Hkv, Lkv, Dv].
    #[arg(long, value_name = "F")]
    pub v: String,
    #[command(flatten)]
    pub mask: MaskArgs,
    /// Logit scale (default 1/sqrt(Dqk)).
    #[arg(long, value_name = "S")]
    pub scale: Option<f32>,
    /// Softcap C: logits become C·tanh(s/C).
    #[arg(long, value_name = "C")]
    pub softcap: Option<f32>,
    /// Learned sink logits, one per query head: an f32 array [Hq].
    #[arg(long, value_name = "F")]
    pub sinks: Option<String>,
    /// Output O [B, Hq, Lq, Dv] (storage dtype of q).
    #[arg(long, value_name = "F")]
    pub out: PathBuf,
    /// Also write LSE [B, Hq, Lq] (f32).
    #[arg(long, value_name = "F")]
    pub lse: Option<PathBuf>,
    /// Also write the pre-softcap max logit [B, Hq] (f32).
    #[arg(long, value_name = "F")]
    pub max_logit: Option<PathBuf>,
    /// Output gradient dO [B, Hq, Lq, Dv]: run the backward pass too (needs --dq, --dk, --dv).
    #[arg(long, value_name = "F")]
    pub grad_out: Option<String>,
    /// Write dQ [B, Hq, Lq, Dqk].
    #[arg(long, value_name = "F")]
    pub dq: Option<PathBuf>,
    /// Write dK [B, Hkv, Lkv, Dqk].
    #[arg(long, value_name = "F")]
    pub dk: Option<PathBuf>,
    /// Write dV [B, Hkv, Lkv, Dv].
    #[arg(long, value_name = "F")]
    pub dv: Option<PathBuf>,
    /// Write the sink gradient [Hq] (f32; needs --sinks and --grad-out).
    #[arg(long, value_name = "F")]
    pub dsinks: Option<PathBuf>,
    /// Storage dtype of the inputs: f32 or bf16 (bf16 reads npy `<u2` files as raw bf16 bits).
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Also write the attention telemetry of this forward (sink mass, entropy, max_logit,
    /// outliers of O per head) as one JSON line, step 0 layer 0 (replacing the file).
    #[arg(long, value_name = "F.jsonl")]
    pub telemetry: Option<PathBuf>,
    /// Sink keys per document (per sequence without a `document` mask) for --telemetry.
    #[arg(long, value_name = "N")]
    pub sink_tokens: Option<usize>,
}

/// The summary printed by `attend`.
#[derive(serde::Serialize)]
struct AttendReport {
    q: Vec<usize>,
    k: Vec<usize>,
    v: Vec<usize>,
    dtype: String,
    mask: String,
    tile: String,
    backend: String,
    allowed_pairs: u64,
    density: f64,
    forward_ms: f64,
    forward_gflops: f64,
    backward_ms: Option<f64>,
    backward_gflops: Option<f64>,
    written: Vec<String>,
    telemetry: Option<TelemetryRecord>,
}

fn rank4(t: &Tensor, flag: &str) -> Result<[usize; 4]> {
    match *t.shape() {
        [b, h, l, d] => Ok([b, h, l, d]),
        ref s => Err(Error::invalid(
            flag,
            "a rank-4 array [B, H, L, D]",
            format!("shape {s:?}"),
        )),
    }
}

/// Checks how the gradient flags combine before any work is done.
fn check_flags(args: &AttendArgs) -> Result<()> {
    let grads = [("--dq", &args.dq), ("--dk", &args.dk), ("--dv", &args.dv)];
    if args.grad_out.is_some() {
        if let Some((flag, _)) = grads.iter().find(|(_, p)| p.is_none()) {
            return Err(Error::invalid(
                "--grad-out",
                "--dq, --dk and --dv as well",
                format!("no {flag}"),
            ));
        }
    } else {
        let given = grads
            .iter()
            .map(|(f, p)| (*f, p.is_some()))
            .chain([("--dsinks", args.dsinks.is_some())])
            .find(|(_, set)| *set);
        if let Some((flag, _)) = given {
            return Err(Error::invalid(
                flag,
                "--grad-out (dO) as well",
                "no --grad-out",
            ));
        }
    }
    if args.dsinks.is_some() && args.sinks.is_none() {
        return Err(Error::invalid("--dsinks", "--sinks as well", "no --sinks"));
    }
    if args.sink_tokens.is_some() && args.telemetry.is_none() {
        return Err(Error::invalid(
            "--sink-tokens",
            "--telemetry as well",
            "no --telemetry",
        ));
    }
    Ok(())
}

fn write(path: &Path, t: &Tensor, written: &mut Vec<String>) -> Result<()> {
    tessera::io::write_tensor(path, t)?;
    written.push(path.display().to_string());
    Ok(())
}

pub fn run(args: AttendArgs, ctx: &Ctx) -> Result<()> {
    check_flags(&args)?;
    // Every output path is checked before any work, so a bad one writes nothing.
    const TENSOR: &[&str] = &["npy", "safetensors"];
    let mut outputs: Vec<(&str, &Path, &[&str])> = vec![("--out", &args.out, TENSOR)];
    for (flag, p) in [
        ("--lse", &args.lse),
        ("--max-logit", &args.max_logit),
        ("--dq", &args.dq),
        ("--dk", &args.dk),
        ("--dv", &args.dv),
        ("--dsinks", &args.dsinks),
    ] {
        if let Some(p) = p {
            outputs.push((flag, p, TENSOR));
        }
    }
    if let Some(p) = &args.telemetry {
        outputs.push(("--telemetry", p, &[]));
    }
    check_outputs(&outputs)?;
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some(s) => match s.parse::<DType>()? {
            dt @ (DType::F32 | DType::BF16) => Some(dt),
            other => return Err(Error::invalid("--dtype", "f32 or bf16", other)),
        },
    };
    let q = tessera::io::read_tensor(&args.q, dtype)?;
    let k = tessera::io::read_tensor(&args.k, dtype)?;
    let v = tessera::io::read_tensor(&args.v, dtype)?;
    let [b, hq, lq, dqk] = rank4(&q, "--q")?;
    let [_, _, lkv, _] = rank4(&k, "--k")?;
    let [_, _, _, dv] = rank4(&v, "--v")?;
    let sinks = match &args.sinks {
        None => None,
        Some(spec) => {
            let t = tessera::io::read_tensor(spec, None)?;
            if t.shape().len() != 1 {
                return Err(Error::invalid(
                    "--sinks",
                    format!("a 1-D array [{hq}] (one logit per query head)"),
                    format!("shape {:?}", t.shape()),
                ));
            }
            // Name the flag: the tensor's own error does not know where it came from.
            Some(t.to_f32_vec().map_err(|_| {
                Error::invalid(
                    "--sinks",
                    "a floating-point array (f32, bf16 or f16)",
                    format!("{} in {spec}", t.dtype()),
                )
            })?)
        }
    };
    // Outputs are sized by the inputs' shapes (O is [B, Hq, Lq, Dv], gradients like their
    // inputs): refuse up front what the memory budget cannot hold.
    let out_elems = b as u128 * hq as u128 * lq as u128 * (dv as u128 + 2)
        + if args.grad_out.is_some() {
            (q.numel() + k.numel() + v.numel()) as u128
        } else {
            0
        };
    tessera::core::budget::check(|| "attention outputs".to_string(), 4 * out_elems)?;
    let (mask, plan) = args.mask.plan(ctx, b, hq, lq, lkv)?;
    let opts = AttnOptions {
        scale: args.scale,
        softcap: args.softcap,
        sinks,
    };
    let backend = ctx.cpu_backend()?;

    // One step (0) that logs when --telemetry is given, else a plain forward.
    let config = TelemetryConfig {
        every: u64::from(args.telemetry.is_some()),
        sink_tokens: args.sink_tokens.unwrap_or(DEFAULT_SINK_TOKENS),
        ..TelemetryConfig::default()
    };
    let tel = Telemetry::new(config.clone())?;
    let mut sink = TelemetrySink::new(config);

    let t0 = Instant::now();
    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
    let f = forward_logged(
        &backend,
        &inputs,
        &plan,
        &opts,
        LogContext {
            tel: &tel,
            mask: &mask,
            layer: 0,
            sink: &mut sink,
        },
    )?;
    let forward_s = t0.elapsed().as_secs_f64();
    let mut written = Vec::new();
    let records = sink.flush();
    if let Some(path) = &args.telemetry {
        write_jsonl(path, &records)?;
        written.push(path.display().to_string());
    }
    write(&args.out, &f.o, &mut written)?;
    if let Some(p) = &args.lse {
        write(p, &f.lse, &mut written)?;
    }
    if let Some(p) = &args.max_logit {
        write(p, &f.max_logit, &mut written)?;
    }

    let mut backward_s = None;
    if let Some(spec) = &args.grad_out {
        let d_o = tessera::io::read_tensor(spec, dtype)?;
        let t1 = Instant::now();
        let g = backend.backward(
            &GradInputs::contiguous(inputs, f.o.view(), f.lse.view(), d_o.view())?,
            &plan,
            &opts,
        )?;
        backward_s = Some(t1.elapsed().as_secs_f64());
        for (path, t) in [(&args.dq, &g.dq), (&args.dk, &g.dk), (&args.dv, &g.dv)] {
            if let Some(p) = path {
                write(p, t, &mut written)?;
            }
        }
        if let (Some(p), Some(t)) = (&args.dsinks, &g.dsinks) {
            write(p, t, &mut written)?;
        }
    }

    let report = AttendReport {
        q: q.shape().to_vec(),
        k: k.shape().to_vec(),
        v: v.shape().to_vec(),
        dtype: q.dtype().to_string(),
        mask: args.mask.mask.clone(),
        tile: plan.tile.to_string(),
        backend: format!("{} ({})", backend.name(), backend.paths().label(q.dtype())),
        allowed_pairs: plan.stats.allowed_pairs,
        density: plan.stats.density,
        forward_ms: forward_s * 1e3,
        forward_gflops: effective_gflops(plan.forward_flops(dqk, dv), forward_s),
        backward_ms: backward_s.map(|s| s * 1e3),
        backward_gflops: backward_s.map(|s| effective_gflops(plan.backward_flops(dqk, dv), s)),
        written,
        telemetry: records.into_iter().next(),
    };
    if ctx.json() {
        return print_json(&report);
    }
    let mut line = format!(
        "attend: q {:?} k {:?} v {:?} {}, mask '{}', tile {}, {} allowed pairs (density {:.4}), {}: forward {:.2} ms ({:.1} GFLOP/s effective)",
        report.q,
        report.k,
        report.v,
        report.dtype,
        report.mask,
        report.tile,
        report.allowed_pairs,
        report.density,
        report.backend,
        report.forward_ms,
        report.forward_gflops
    );
    if let (Some(ms), Some(gf)) = (report.backward_ms, report.backward_gflops) {
        line.push_str(&format!(
            ", backward {ms:.2} ms ({gf:.1} GFLOP/s effective)"
        ));
    }
    if let (Some(rec), Some(path)) = (&report.telemetry, &args.telemetry) {
        line.push_str(&format!(
            "; telemetry: {} -> {}",
            telemetry_brief(std::slice::from_ref(rec)),
            path.display()
        ));
    }
    println!("{line}");
    Ok(())
}

/// Writes telemetry records as JSON lines, atomically (replacing `path`).
pub(crate) fn write_jsonl(path: &Path, records: &[TelemetryRecord]) -> Result<()> {
    let mut text = String::new();
    for r in records {
        text.push_str(&r.to_json_line()?);
        text.push('\n');
    }
    tessera::io::atomic_write(path, |w| {
        w.write_all(text.as_bytes()).map_err(|e| Error::io(path, e))
    })
}

/// `sink mass mean 0.41 (rate 0.50), max_logit max 3.2, entropy mean 5.1` over every head of
/// every record (`n/a` where nothing is defined).
pub(crate) fn telemetry_brief(records: &[TelemetryRecord]) -> String {
    fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
        let (n, s) = v.fold((0usize, 0f64), |(n, s), x| (n + 1, s + x));
        (n > 0).then(|| s / n as f64)
    }
    let per_head = |f: fn(&TelemetryRecord) -> Option<&Vec<Option<f64>>>| {
        mean(records.iter().filter_map(f).flatten().flatten().copied())
    };
    let fmt = |x: Option<f64>, digits: usize| match x {
        Some(x) => format!("{x:.digits$}"),
        None => "n/a".to_string(),
    };
    let sink_mass = per_head(|r| r.sink_mass.as_ref());
    let entropy = per_head(|r| r.entropy.as_ref());
    let rate = mean(records.iter().filter_map(|r| r.sink_rate));
    let max_logit = records
        .iter()
        .flat_map(|r| r.max_logit.iter().flatten().copied())
        .reduce(f64::max);
    format!(
        "sink mass mean {} (rate {}), max_logit max {}, entropy mean {}",
        fmt(sink_mass, 2),
        fmt(rate, 2),
        fmt(max_logit, 1),
        fmt(entropy, 1)
    )
}
