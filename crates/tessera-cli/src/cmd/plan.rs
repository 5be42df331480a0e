//! `tessera plan`: plan a mask and print its statistics; optionally dump states or a picture.

use crate::ctx::{check_outputs, print_json, Ctx};
use crate::maskload::MaskArgs;
use std::path::PathBuf;
use tessera::core::{Error, Result, Tensor, TensorData};
use tessera::plan::Plan;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  tessera plan --mask 'causal & document' --q-len 32768 --segments rows.safetensors:segment_ids --png plan.png\n  tessera plan --mask 'window(1024) & causal' --q-len 8192 --tile 64x128 --json"
)]
pub struct PlanArgs {
    #[command(flatten)]
    pub mask: MaskArgs,
    /// Query length.
    #[arg(long, value_name = "N")]
    pub q_len: usize,
    /// Key length (default: the query length).
    #[arg(long, value_name = "M")]
    pub kv_len: Option<usize>,
    /// Batch size.
    #[arg(long, value_name = "B", default_value_t = 1)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, value_name = "H", default_value_t = 1)]
    pub heads: usize,
    /// Head dimension used for the FLOP count.
    #[arg(long, value_name = "D", default_value_t = 128)]
    pub head_dim: usize,
    /// Write tile states as int8 [B', H', nq, nk] (.npy; 0 empty, 1 partial, 2 full).
    #[arg(long, value_name = "F.npy")]
    pub dump_states: Option<PathBuf>,
    /// Write a picture of the tile states of batch row 0, head 0.
    #[arg(long, value_name = "F.png")]
    pub png: Option<PathBuf>,
    /// Export the plan for another engine: `splash F.npz` (JAX Splash MaskInfo, forward and dKV)
    /// or `flex F.npz` (PyTorch FlexAttention BlockMask tensors). See docs/export.md.
    /// Repeat the option to write several exports.
    #[arg(long, num_args = 2, value_names = ["KIND", "F.npz"], action = clap::ArgAction::Append)]
    pub export: Vec<String>,
}

/// The statistics printed by `plan` (also used by `demo`).
#[derive(serde::Serialize)]
pub struct PlanReport<'a> {
    pub contract: String,
    pub mask: &'a str,
    pub batch: usize,
    pub heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub tile: String,
    pub q_tiles: usize,
    pub kv_tiles: usize,
    pub groups: [usize; 2],
    pub forward_gflop: f64,
    /// True when the plan was loaded from the cache instead of built by this call.
    pub from_cache: bool,
    #[serde(flatten)]
    pub stats: &'a tessera::plan::PlanStats,
}

impl<'a> PlanReport<'a> {
    pub fn new(plan: &'a Plan, head_dim: usize, from_cache: bool) -> Self {
        PlanReport {
            contract: plan.contract.hex(),
            mask: &plan.mask,
            batch: plan.shape.batch,
            heads: plan.shape.heads,
            q_len: plan.shape.q_len,
            kv_len: plan.shape.kv_len,
            tile: plan.tile.to_string(),
            q_tiles: plan.q_tiles,
            kv_tiles: plan.kv_tiles,
            groups: [plan.batch_groups, plan.head_groups],
            forward_gflop: plan.forward_flops(head_dim, head_dim) / 1e9,
            from_cache,
            stats: &plan.stats,
        }
    }

    pub fn to_text(&self) -> String {
        let s = self.stats;
        format!(
            "plan {}\n  mask      {}\n  shape     B={} H={} Lq={} Lkv={}  tile {}  grid {}x{}  groups B'={} H'={}\n  tiles     {} total: {} full, {} partial ({} unique masks), {} empty\n  density   pairs {:.5}  tiles {:.5}  grid width {}\n  work      {} allowed pairs, {:.2} GFLOP forward\n  plan      {} bytes, {} head plan(s), {} {:.3} ms",
            &self.contract[..16],
            self.mask,
            self.batch,
            self.heads,
            self.q_len,
            self.kv_len,
            self.tile,
            self.q_tiles,
            self.kv_tiles,
            self.groups[0],
            self.groups[1],
            s.tiles,
            s.full_tiles,
            s.partial_tiles,
            s.unique_partial_masks,
            s.empty_tiles,
            s.density,
            s.tile_density,
            s.grid_width,
            s.allowed_pairs,
            self.forward_gflop,
            s.plan_bytes,
            s.head_plans,
            if self.from_cache { "loaded from cache (first built in" } else { "built in" },
            s.build_ms
        ) + if self.from_cache { ")" } else { "" }
    }
}

/// Writes the tile states as an int8 `[B', H', nq, nk]` array.
pub fn dump_states(plan: &Plan, path: &std::path::Path) -> Result<()> {
    let cells = plan.group_plan.len() as u128 * plan.q_tiles as u128 * plan.kv_tiles as u128;
    // The array, plus its encoded copy on the way to the file.
    tessera::core::budget::check(|| format!("--dump-states {}", path.display()), 2 * cells)?;
    let (shape, states) = plan.states();
    let t = Tensor::new(shape.to_vec(), TensorData::I8(states))?;
    tessera::io::write_tensor(path, &t)
}

pub fn run(args: PlanArgs, ctx: &Ctx) -> Result<()> {
    let kv_len = args.kv_len.unwrap_or(args.q_len);
    if args.head_dim == 0 {
        return Err(Error::invalid("--head-dim", "a positive value", 0));
    }
    let shape = tessera::plan::PlanShape::new(args.batch, args.heads, args.q_len, kv_len)?;
    // Every argument and output path is checked before any work, so a bad one writes nothing.
    let mut exports = Vec::new();
    for e in args.export.chunks(2) {
        match e {
            [k, p] => exports.push((
                k.parse::<tessera::export::ExportKind>()?,
                std::path::Path::new(p),
            )),
            _ => return Err(Error::invalid("--export", "KIND F.npz", e.join(" "))),
        }
    }
    let mut outputs: Vec<(&str, &std::path::Path, &[&str])> = Vec::new();
    if let Some(p) = &args.dump_states {
        outputs.push(("--dump-states", p, &["npy", "safetensors"]));
    }
    if let Some(p) = &args.png {
        outputs.push(("--png", p, &[]));
    }
    for (_, p) in &exports {
        outputs.push(("--export", p, &[]));
    }
    check_outputs(&outputs)?;
    let lookup = ctx.lookup(&args.mask.mask()?, shape, args.mask.tile()?)?;
    let (plan, from_cache) = (lookup.plan, lookup.source.is_cached());
    if let Some(p) = &args.dump_states {
        dump_states(&plan, p)?;
    }
    for (kind, path) in exports {
        tessera::export::export_npz(&plan, kind, path)?;
    }
    if let Some(p) = &args.png {
        tessera::viz::write_plan_png(&plan, 0, 0, &args.mask.mask, p)?;
    }
    let report = PlanReport::new(&plan, args.head_dim, from_cache);
    if ctx.json() {
        print_json(&report)
    } else {
        println!("{}", report.to_text());
        Ok(())
    }
}
