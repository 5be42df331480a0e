//! `tessera bench`: the attention benchmark suite against measured per-path machine peaks.
//!
//! Each case builds its plan, draws seeded Q/K/V, runs each pass twice untimed to warm up, then
//! `--reps` timed runs; the table reports the median, effective GFLOP/s over allowed pairs only,
//! the kernel path the case ran on (the dispatch decision, or `--isa` / `--bf16-path`) and the
//! percentage of *that path's* measured peak: f32 rows and widened bf16 rows against the f32 FMA
//! peak of their copy, `bf16-dot` rows against the `vdpbf16ps` peak. The probe aims to be an
//! upper bound; where a row still beats it, that path's peak is raised to the row's rate, the
//! header and the JSON say so, and every percentage is taken against the raised peak, so no
//! printed `% peak` exceeds 100. A sparse row's `tile_time_ratio` is its time per active tile
//! over the `full` mask's (same length, D, dtype, pass and tile) when `full` ran too
//! (`--tile-ratio` adds it).

use crate::ctx::{print_json, Ctx};
use std::time::{Duration, Instant};
use tessera::attn::cpu::peak::{self, PeakPath, Peaks};
use tessera::attn::cpu::{Bf16Path, F32Path, KernelPaths};
use tessera::attn::{
    check_inputs, AttnInputs, AttnOptions, Backend, CpuBackend, CpuWorkspace, ForwardBufs,
    GradBufs, GradInputs, Par,
};
use tessera::conformance::workloads::{named_mask, random_tensor, MASK_NAMES};
use tessera::core::{DType, Error, Result};
use tessera::plan::{PlanShape, TileShape};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  tessera bench --masks causal,documents,window --lens 8192 --dims 64 --dtypes f32,bf16\n  tessera bench --quick --json\n  tessera bench --quick --tile-ratio --isa avx2 --bf16-path widen"
)]
pub struct BenchArgs {
    /// Masks to run (full, causal, documents, window, prefix, chunked).
    #[arg(long, value_delimiter = ',', default_values_t = MASK_NAMES.map(String::from))]
    pub masks: Vec<String>,
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 8192, 16384])]
    pub lens: Vec<usize>,
    /// Head dimensions (Dqk = Dv).
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128])]
    pub dims: Vec<usize>,
    /// Storage dtypes (f32, bf16).
    #[arg(long, value_delimiter = ',', default_values_t = ["f32".to_string(), "bf16".to_string()])]
    pub dtypes: Vec<String>,
    /// Passes (fwd, bwd).
    #[arg(long, value_delimiter = ',', default_values_t = ["fwd".to_string(), "bwd".to_string()])]
    pub passes: Vec<String>,
    /// Query heads (kv heads equal).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Timed repetitions per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Tile size QxK, or `auto`: the backend's recommended tile per head dim and dtype
    /// (128x128, and 64x128 for f32 with D >= 128).
    #[arg(long, default_value = "auto")]
    pub tile: String,
    /// Small suite: causal, documents and window at 8K, D=64.
    #[arg(long)]
    pub quick: bool,
    /// Skip the peak microbenchmark.
    #[arg(long)]
    pub no_peak: bool,
    /// Run f32 on this kernel copy instead of the dispatch decision's; bf16 is then widened
    /// on it unless --bf16-path dot.
    #[arg(long, value_parser = ["avx512", "avx2", "portable"])]
    pub isa: Option<String>,
    /// Run bf16 on the `vdpbf16ps` kernels (dot, needs AVX512-BF16), on them with the
    /// forward's products on AMX tiles (amx, needs AMX-BF16) or widened to f32 on the f32 copy
    /// (widen) instead of the dispatch decision's path.
    #[arg(long, value_parser = ["amx", "dot", "widen"])]
    pub bf16_path: Option<String>,
    /// Report each sparse mask's time per active tile over the full mask's (adds `full` to
    /// --masks when absent).
    #[arg(long)]
    pub tile_ratio: bool,
}

#[derive(serde::Serialize)]
struct Row {
    mask: String,
    len: usize,
    heads: usize,
    dim: usize,
    dtype: String,
    tile: String,
    /// Kernel path of the case (`avx512`, `bf16-dot`, `widen-avx512`, ...).
    path: String,
    /// The instruction path whose peak bounds it (`None` for the unprobed portable copy).
    peak_path: Option<PeakPath>,
    pass: String,
    median_ms: f64,
    gflops: f64,
    /// Percent of `peak_path`'s peak (never above 100; see the module contract).
    pct_peak: Option<f64>,
    /// Fraction of the tiles that are active (tile density).
    active_tiles: f64,
    /// Active tiles executed: tile density × heads × q tiles × kv tiles.
    active_tile_count: f64,
    /// On a backward row: its median time over the same case's forward median (the issue's
    /// "backward ≤ 2.5 × forward"), when both passes ran.
    bwd_over_fwd: Option<f64>,
    /// On a sparse row: (median_ms / active tiles) / (the full mask's median_ms / its active
    /// tiles), same len, D, dtype, pass and tile, when `full` ran.
    tile_time_ratio: Option<f64>,
}

/// The peaks the percentages are taken against: the probe's, raised where a row beat it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
struct PathPeaks {
    /// Peaks in use (GFLOP/s per path, threads).
    #[serde(flatten)]
    used: Peaks,
    /// What the probe measured.
    probed: Peaks,
    /// Paths whose peak was raised to an observed rate (the probe was not an upper bound).
    raised: Vec<PeakPath>,
}

#[derive(serde::Serialize)]
struct Report {
    manifest: crate::manifest::Manifest,
    peaks: Option<PathPeaks>,
    backend: String,
    /// The kernel path of each dtype in this run.
    paths: KernelPaths,
    /// Whether --isa / --bf16-path overrode the dispatch decision.
    forced: bool,
    rows: Vec<Row>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Untimed calls before the timed ones: the first calls pay one-off costs (fresh output pages
/// until the allocator keeps them, cold caches) that a training loop does not pay every step;
/// measured here, the second call of a backward was still ~15% slower than the steady state.
const WARMUP_CALLS: usize = 2;

/// Time the peak probe gets over all its paths and chain counts.
const PEAK_BUDGET: Duration = Duration::from_millis(1200);

/// Seconds of each of `reps` timed calls of `f`, after [`WARMUP_CALLS`] untimed ones.
fn timed_calls(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..WARMUP_CALLS {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// The paths `--isa` / `--bf16-path` ask for on top of `decided` (see their help).
fn forced_paths(
    decided: KernelPaths,
    isa: Option<&str>,
    bf16_path: Option<&str>,
) -> Result<KernelPaths> {
    let f32 = match isa {
        None => decided.f32,
        Some(name) => F32Path::parse(name)
            .ok_or_else(|| Error::invalid("--isa", "avx512, avx2 or portable", name))?,
    };
    let bf16 = match (bf16_path, isa) {
        (Some("dot"), _) => Bf16Path::Dot,
        (Some("amx"), _) => Bf16Path::Amx,
        (Some("widen"), _) | (None, Some(_)) => Bf16Path::widen(f32),
        (None, None) => decided.bf16,
        (Some(other), _) => return Err(Error::invalid("--bf16-path", "amx, dot or widen", other)),
    };
    Ok(KernelPaths { f32, bf16 })
}

/// Takes every row's percentage against its path's peak, first raising a path's peak to the
/// fastest row on it where that row beat the probe (so no percentage exceeds 100).
fn settle_peaks(probed: Peaks, rows: &mut [Row]) -> PathPeaks {
    let mut used = probed;
    let mut raised = Vec::new();
    for path in PeakPath::ALL {
        let Some(peak) = probed.for_path(path) else {
            continue;
        };
        let fastest = rows
            .iter()
            .filter(|r| r.peak_path == Some(path))
            .map(|r| r.gflops)
            .filter(|g| g.is_finite())
            .fold(f64::NEG_INFINITY, f64::max);
        if fastest > peak {
            used.set(path, fastest);
            raised.push(path);
        }
    }
    for r in rows.iter_mut() {
        r.pct_peak = r
            .peak_path
            .and_then(|p| used.for_path(p))
            .filter(|&p| p > 0.0)
            .map(|p| 100.0 * r.gflops / p);
    }
    PathPeaks {
        used,
        probed,
        raised,
    }
}

/// Fills each sparse row's `tile_time_ratio` from the `full` row of the same case.
fn tile_ratios(rows: &mut [Row]) {
    let per_tile = |r: &Row| (r.active_tile_count > 0.0).then(|| r.median_ms / r.active_tile_count);
    let fulls: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.mask == "full")
        .filter_map(|r| Some((case_key(r), per_tile(r)?)))
        .collect();
    for r in rows.iter_mut().filter(|r| r.mask != "full") {
        let full = fulls.iter().find(|(k, _)| *k == case_key(r)).map(|f| f.1);
        r.tile_time_ratio = per_tile(r).zip(full).map(|(s, f)| s / f);
    }
}

/// What a sparse row and its `full` row share.
fn case_key(r: &Row) -> String {
    format!("{}|{}|{}|{}|{}", r.len, r.dim, r.dtype, r.pass, r.tile)
}

pub fn run(mut args: BenchArgs, ctx: &Ctx) -> Result<()> {
    if args.quick {
        args.masks = vec!["causal".into(), "documents".into(), "window".into()];
        args.lens = vec![8192];
        args.dims = vec![64];
    }
    if args.tile_ratio && !args.masks.iter().any(|m| m == "full") {
        args.masks.insert(0, "full".into());
    }
    if args.reps == 0 || args.heads == 0 {
        return Err(Error::invalid("--reps/--heads", "positive values", 0));
    }
    let dtypes: Vec<DType> = args
        .dtypes
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_>>()?;
    for p in &args.passes {
        if p != "fwd" && p != "bwd" {
            return Err(Error::invalid("--passes", "fwd and/or bwd", p));
        }
    }
    let fixed_tile = match args.tile.as_str() {
        "auto" => None,
        t => Some(TileShape::parse(t)?),
    };
    let decision = ctx.kernel_decision()?;
    let forced = args.isa.is_some() || args.bf16_path.is_some();
    let backend = if forced {
        let paths = forced_paths(
            decision.paths(),
            args.isa.as_deref(),
            args.bf16_path.as_deref(),
        )?;
        CpuBackend::with_paths(paths)
            .map_err(|e| Error::Unsupported(format!("--isa/--bf16-path: {e}")))?
    } else {
        ctx.cpu_backend()?
    };
    let paths = backend.paths();
    let probed = (!args.no_peak).then(|| {
        eprintln!("measuring machine peaks ...");
        peak::measure(PEAK_BUDGET, Par::Current.threads())
    });
    let total = args.masks.len() * args.lens.len() * args.dims.len() * dtypes.len();
    let progress = crate::progress::bar(total as u64, "bench");
    let mut rows = Vec::new();
    let opts = AttnOptions::default();
    for name in &args.masks {
        for &len in &args.lens {
            let (label, mask) = named_mask(name, len)?;
            let shape = PlanShape::new(1, args.heads, len, len)?;
            for &d in &args.dims {
                for &dt in &dtypes {
                    let tile = fixed_tile.unwrap_or_else(|| backend.recommended_tile(d, dt));
                    // Planning is cheap (< 1 ms at 8K) and goes through the plan cache.
                    let plan = ctx.plan(&mask, shape, tile)?;
                    // Q, K, V, dO and the outputs and gradients: about eight such tensors.
                    let elems = args.heads as u128 * len as u128 * d as u128;
                    tessera::core::budget::check(
                        || {
                            format!(
                                "bench workload --heads {} --lens {len} --dims {d}",
                                args.heads
                            )
                        },
                        8 * 4 * elems,
                    )?;
                    let qs = vec![1, args.heads, len, d];
                    let q = random_tensor(qs.clone(), dt, 1)?;
                    let k = random_tensor(qs.clone(), dt, 2)?;
                    let v = random_tensor(qs.clone(), dt, 3)?;
                    let d_o = random_tensor(qs, dt, 4)?;
                    // The training-loop path: the plan prepared once, caller-owned outputs and
                    // workspace reused by every call.
                    let prepared = backend.prepare(&plan)?;
                    let inputs = AttnInputs::contiguous(q.view(), k.view(), v.view())?;
                    let dims = check_inputs(&inputs, &opts)?;
                    let mut ws = CpuWorkspace::new();
                    let mut fwd = ForwardBufs::new(&dims);
                    backend.forward_into(
                        &prepared,
                        &inputs,
                        &opts,
                        fwd.out(),
                        &mut ws,
                        Par::Current,
                    )?;
                    let fwd = fwd.finish(&dims)?;
                    let mut out = ForwardBufs::new(&dims);
                    let mut grads = GradBufs::new(&dims, false);
                    let tiles = (args.heads * plan.q_tiles * plan.kv_tiles) as f64;
                    let mut push = |pass: &str, times: Vec<f64>, flops: f64| {
                        let ms = median(times) * 1e3;
                        let gflops = flops / (ms / 1e3) / 1e9;
                        rows.push(Row {
                            mask: label.clone(),
                            len,
                            heads: args.heads,
                            dim: d,
                            dtype: dt.to_string(),
                            tile: tile.to_string(),
                            path: paths.label(dt).to_string(),
                            peak_path: paths.peak_path(dt),
                            pass: pass.into(),
                            median_ms: ms,
                            gflops,
                            pct_peak: None,
                            active_tiles: plan.stats.tile_density,
                            active_tile_count: plan.stats.tile_density * tiles,
                            bwd_over_fwd: None,
                            tile_time_ratio: None,
                        });
                    };
                    if args.passes.iter().any(|p| p == "fwd") {
                        let times = timed_calls(args.reps, || {
                            backend.forward_into(
                                &prepared,
                                &inputs,
                                &opts,
                                out.out(),
                                &mut ws,
                                Par::Current,
                            )
                        })?;
                        push("fwd", times, plan.forward_flops(d, d));
                    }
                    if args.passes.iter().any(|p| p == "bwd") {
                        let g_in = GradInputs::contiguous(
                            inputs,
                            fwd.o.view(),
                            fwd.lse.view(),
                            d_o.view(),
                        )?;
                        let times = timed_calls(args.reps, || {
                            backend.backward_into(
                                &prepared,
                                &g_in,
                                &opts,
                                grads.out(),
                                &mut ws,
                                Par::Current,
                            )
                        })?;
                        push("bwd", times, plan.backward_flops(d, d));
                        // The forward row of this case, if it ran, sits just before.
                        if let [.., f, b] = rows.as_mut_slice() {
                            if f.pass == "fwd" {
                                b.bwd_over_fwd = Some(b.median_ms / f.median_ms);
                            }
                        }
                    }
                    progress.inc(1);
                }
            }
        }
    }
    progress.finish_and_clear();
    let peaks = probed.map(|p| settle_peaks(p, &mut rows));
    tile_ratios(&mut rows);
    let report = Report {
        manifest: crate::manifest::collect(ctx.cache_dir().as_deref(), Some(decision)),
        peaks,
        backend: format!("{} ({paths})", backend.name()),
        paths,
        forced,
        rows,
    };
    if ctx.json() {
        return print_json(&report);
    }
    print_text(&report);
    Ok(())
}

fn print_text(report: &Report) {
    print!("{}", report.manifest.to_text());
    if let Some(p) = &report.peaks {
        let paths: Vec<String> = PeakPath::ALL
            .iter()
            .map(|&path| {
                let mark = if p.raised.contains(&path) { "*" } else { "" };
                match p.used.for_path(path) {
                    Some(g) => format!("{} ({}) {g:.0}{mark}", path.name(), path.what()),
                    None => format!("{} n/a", path.name()),
                }
            })
            .collect();
        println!(
            "peak GFLOP/s ({} threads): {}",
            p.used.threads,
            paths.join(", ")
        );
        for &path in &p.raised {
            println!(
                "* peak raised to observed rate on path {}: probe {:.0}, observed {:.0} GFLOP/s",
                path.name(),
                p.probed.for_path(path).unwrap_or(0.0),
                p.used.for_path(path).unwrap_or(0.0)
            );
        }
    }
    let how = if report.forced {
        "forced by --isa/--bf16-path"
    } else {
        "dispatch decision"
    };
    println!("backend: {}, {how}", report.backend);
    println!(
        "{:<30} {:>6} {:>4} {:>5} {:>7} {:>14} {:>4} {:>10} {:>9} {:>7} {:>7} {:>8} {:>9}",
        "mask",
        "len",
        "D",
        "dtype",
        "tile",
        "path",
        "pass",
        "median ms",
        "GFLOP/s",
        "% peak",
        "tiles",
        "bwd/fwd",
        "tile/full"
    );
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |x| format!("{x:.digits$}"));
    for r in &report.rows {
        println!(
            "{:<30} {:>6} {:>4} {:>5} {:>7} {:>14} {:>4} {:>10.2} {:>9.1} {:>7} {:>6.1}% {:>8} {:>9}",
            r.mask,
            r.len,
            r.dim,
            r.dtype,
            r.tile,
            r.path,
            r.pass,
            r.median_ms,
            r.gflops,
            opt(r.pct_peak, 1),
            100.0 * r.active_tiles,
            opt(r.bwd_over_fwd, 2),
            opt(r.tile_time_ratio, 2),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mask: &str, dtype: &str, path: Option<PeakPath>, gflops: f64) -> Row {
        Row {
            mask: mask.into(),
            len: 1024,
            heads: 1,
            dim: 64,
            dtype: dtype.into(),
            tile: "128x128".into(),
            path: String::new(),
            peak_path: path,
            pass: "fwd".into(),
            median_ms: 1.0,
            gflops,
            pct_peak: None,
            active_tiles: 1.0,
            active_tile_count: 64.0,
            bwd_over_fwd: None,
            tile_time_ratio: None,
        }
    }

    const PROBED: Peaks = Peaks {
        avx2: Some(100.0),
        avx512: Some(200.0),
        bf16_dot: Some(400.0),
        amx_bf16: Some(1600.0),
        threads: 2,
    };

    #[test]
    fn percentages_are_against_each_rows_path() {
        let mut rows = vec![
            row("causal", "f32", Some(PeakPath::Avx512), 100.0),
            row("causal", "bf16", Some(PeakPath::Bf16Dot), 100.0),
            row("causal", "bf16", Some(PeakPath::Avx2), 50.0),
            row("causal", "f32", None, 10.0),
            row("causal", "bf16", Some(PeakPath::AmxBf16), 400.0),
        ];
        let p = settle_peaks(PROBED, &mut rows);
        assert!(p.raised.is_empty());
        assert_eq!(p.used, PROBED);
        let pct: Vec<Option<f64>> = rows.iter().map(|r| r.pct_peak).collect();
        assert_eq!(pct, [Some(50.0), Some(25.0), Some(50.0), None, Some(25.0)]);
    }

    /// A row faster than its path's probed peak raises that peak (and only that one) to its
    /// rate: it reads 100%, the other rows of the path are recomputed, none exceeds 100.
    #[test]
    fn a_row_above_the_probe_raises_its_paths_peak() {
        let mut rows = vec![
            row("causal", "f32", Some(PeakPath::Avx512), 250.0),
            row("documents", "f32", Some(PeakPath::Avx512), 125.0),
            row("full", "f32", Some(PeakPath::Avx512), 300.0),
            row("causal", "bf16", Some(PeakPath::Bf16Dot), 200.0),
            row("causal", "bf16", Some(PeakPath::AmxBf16), 2000.0),
        ];
        let p = settle_peaks(PROBED, &mut rows);
        assert_eq!(p.raised, [PeakPath::Avx512, PeakPath::AmxBf16]);
        assert_eq!(p.used.amx_bf16, Some(2000.0));
        assert_eq!(p.used.avx512, Some(300.0));
        assert_eq!(p.probed, PROBED);
        assert_eq!((p.used.avx2, p.used.bf16_dot), (Some(100.0), Some(400.0)));
        let pct: Vec<f64> = rows.iter().filter_map(|r| r.pct_peak).collect();
        assert_eq!(pct, [250.0 / 3.0, 125.0 / 3.0, 100.0, 50.0, 100.0]);
        assert!(pct.iter().all(|&x| x <= 100.0));
    }

    #[test]
    fn unmeasured_paths_give_no_percentage() {
        let mut rows = vec![row("causal", "bf16", Some(PeakPath::Bf16Dot), 900.0)];
        let probed = Peaks {
            bf16_dot: None,
            ..PROBED
        };
        let p = settle_peaks(probed, &mut rows);
        assert!(p.raised.is_empty() && rows[0].pct_peak.is_none());
    }

    #[test]
    fn tile_ratio_is_time_per_active_tile_over_full() {
        let mut rows = vec![
            row("full", "f32", None, 1.0),
            row("causal", "f32", None, 1.0),
            row("causal", "bf16", None, 1.0),
        ];
        rows[0].median_ms = 8.0; // 64 tiles: 0.125 ms a tile
        rows[1].median_ms = 6.0; // 36 tiles: 1/6 ms a tile
        rows[1].active_tile_count = 36.0;
        tile_ratios(&mut rows);
        assert_eq!(rows[0].tile_time_ratio, None, "full itself");
        let r = rows[1].tile_time_ratio.unwrap_or(f64::NAN);
        assert!((r - 4.0 / 3.0).abs() < 1e-12, "{r}");
        assert_eq!(rows[2].tile_time_ratio, None, "no full bf16 row");
    }

    #[test]
    fn forced_paths_follow_the_flags() {
        let decided = KernelPaths {
            f32: F32Path::Avx512,
            bf16: Bf16Path::Dot,
        };
        let f = |isa, bf16| forced_paths(decided, isa, bf16).unwrap();
        assert_eq!(f(None, None), decided);
        assert_eq!(
            f(Some("avx2"), None),
            KernelPaths {
                f32: F32Path::Avx2,
                bf16: Bf16Path::WidenAvx2
            }
        );
        assert_eq!(f(None, Some("widen")).bf16, Bf16Path::WidenAvx512);
        assert_eq!(
            f(Some("portable"), Some("dot")),
            KernelPaths {
                f32: F32Path::Portable,
                bf16: Bf16Path::Dot
            }
        );
        assert!(forced_paths(decided, Some("sse"), None).is_err());
    }
}
