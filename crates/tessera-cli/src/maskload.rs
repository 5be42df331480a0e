//! Mask options shared by `plan`, `attend` and `bench`: parse `--mask`, load segment, band
//! feature and dense files, and obtain the plan (through the plan cache).

use crate::ctx::Ctx;
use std::sync::Arc;
use tessera::core::{DType, Error, Result};
use tessera::mask::{DenseMask, Mask, Resolver, SegmentIds, Segments};
use tessera::plan::{Plan, PlanShape, TileShape};

#[derive(clap::Args, Debug, Clone)]
pub struct MaskArgs {
    /// Mask expression, e.g. 'causal & document', 'window(1024) & causal' or
    /// 'band(pos.npy, pos.npy, 0, 512)' (see README).
    #[arg(long, value_name = "EXPR")]
    pub mask: String,
    /// Segment ids [B, L] or [L] for `document` (.npy, or FILE.safetensors:TENSOR).
    #[arg(long, value_name = "FILE")]
    pub segments: Option<String>,
    /// Query-side segment ids for cross attention.
    #[arg(
        long,
        value_name = "FILE",
        requires = "kv_segments",
        conflicts_with = "segments"
    )]
    pub q_segments: Option<String>,
    /// Key-side segment ids for cross attention.
    #[arg(long, value_name = "FILE", requires = "q_segments")]
    pub kv_segments: Option<String>,
    /// Tile size QxK (power-of-two multiples of 16).
    #[arg(long, value_name = "QxK", default_value = "128x128")]
    pub tile: String,
}

/// Loads data leaves from files named on the command line.
struct FileResolver<'a> {
    args: &'a MaskArgs,
}

fn load_segments(spec: &str) -> Result<SegmentIds> {
    load_ints(spec, &format!("segments {spec}"), true)
}

/// A `[L]` or `[B, L]` integer array (bool too when `bool_ok`) from a file; errors name `arg`.
fn load_ints(spec: &str, arg: &str, bool_ok: bool) -> Result<SegmentIds> {
    let t = tessera::io::read_tensor(spec, None)?;
    let ids = match t.dtype() {
        DType::Bool if !bool_ok => None,
        _ => t.to_i64_vec().ok(),
    }
    .ok_or_else(|| Error::invalid(arg, "an integer array", t.dtype()))?;
    match *t.shape() {
        [l] => SegmentIds::named(arg, 1, l, ids),
        [b, l] => SegmentIds::named(arg, b, l, ids),
        ref s => Err(Error::invalid(arg, "shape [B, L] or [L]", format!("{s:?}"))),
    }
}

impl Resolver for FileResolver<'_> {
    fn segments(&self) -> Result<Arc<Segments>> {
        let a = self.args;
        match (&a.segments, &a.q_segments, &a.kv_segments) {
            (Some(s), _, _) => Ok(Segments::shared(load_segments(s)?)),
            (None, Some(q), Some(k)) => Segments::cross(load_segments(q)?, load_segments(k)?),
            _ => Err(Error::invalid(
                "document",
                "segment ids (--segments FILE, or --q-segments and --kv-segments)",
                "none given",
            )),
        }
    }

    fn dense(&self, path: &str) -> Result<DenseMask> {
        let t = tessera::io::read_tensor(path, None)?;
        let vals: Vec<bool> = match t.dtype() {
            DType::Bool | DType::U8 => t.to_i64_vec()?.into_iter().map(|v| v != 0).collect(),
            other => {
                return Err(Error::invalid(
                    format!("dense({path})"),
                    "a bool or uint8 array",
                    other,
                ))
            }
        };
        DenseMask::new(t.shape(), &vals, path)
    }

    fn feature(&self, name: &str) -> Result<SegmentIds> {
        load_ints(name, &format!("band feature {name}"), false)
    }
}

impl MaskArgs {
    /// Parses the mask expression and loads its data.
    pub fn mask(&self) -> Result<Mask> {
        tessera::mask::parse(&self.mask, &FileResolver { args: self })
    }

    pub fn tile(&self) -> Result<TileShape> {
        TileShape::parse(&self.tile)
    }

    /// The mask and its plan for the given problem shape (from the plan cache when possible).
    pub fn plan(
        &self,
        ctx: &Ctx,
        batch: usize,
        heads: usize,
        q_len: usize,
        kv_len: usize,
    ) -> Result<(Mask, Arc<Plan>)> {
        let mask = self.mask()?;
        let shape = PlanShape::new(batch, heads, q_len, kv_len)?;
        let plan = ctx.plan(&mask, shape, self.tile()?)?;
        Ok((mask, plan))
    }
}
