//! JAX Splash attention `MaskInfo` arrays.
//!
//! Contract: for each distinct batch row of the plan, [`export`] returns exactly the arrays that
//! `splash_attention_mask_info.process_mask` (forward, also dQ) and `process_mask_dkv` (dK/dV)
//! return for a `MultiHeadMask` of `H` `NumpyMask`s holding that row's token mask, padded with
//! `False` up to whole blocks, and `block_shape = (tile.q, tile.kv)`: same values (padding and
//! wrap-around entries included), shapes and dtypes. See `docs/export.md` for the conventions.
//!
//! The algorithm mirrors the reference: heads are deduplicated by mask content; the
//! `block_mask`/`data_next`/`mask_next` leading axis is `head_shards` when every head shard holds
//! a single distinct mask, else `H`; `data_next[i]`/`mask_next[i]` hold the kv (forward) or local
//! q (dKV) block index and the partial-block index of the first non-empty / partial grid position
//! at or after `i` in grid order (`(head, q, kv)` forward, `(kv, head, q)` for dKV), wrapping to
//! the first one of the shard; partial blocks are deduplicated in order of first appearance over
//! (unique mask, q block, kv block); the grid is shrunk when there is a single distinct mask.

use crate::npz::{self, Members, NpyArray, NpyDType};
use crate::tiles::{Contents, Eff};
use std::ops::Range;
use std::path::Path;
use tessera_core::{Error, Result};
use tessera_plan::{HeadPlan, Plan};

/// The keyword arguments of `process_mask` / `process_mask_dkv` the export reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplashOptions {
    /// `head_shards` (must divide the number of heads). Default 1.
    pub head_shards: usize,
    /// `q_seq_shards` (must divide the number of q blocks). Default 1.
    pub q_seq_shards: usize,
    /// `shrink_grid` of the forward (and dQ) `process_mask`. Default true.
    pub shrink_grid: bool,
    /// `shrink_grid` of `process_mask_dkv`. Default true; `make_splash_mha` passes
    /// `not block_sizes.use_fused_bwd_kernel`, so use false for the fused backward kernel.
    pub shrink_grid_dkv: bool,
    /// `downcast_smem_data`. Default true.
    pub downcast_smem_data: bool,
}

impl Default for SplashOptions {
    fn default() -> Self {
        SplashOptions {
            head_shards: 1,
            q_seq_shards: 1,
            shrink_grid: true,
            shrink_grid_dkv: true,
            downcast_smem_data: true,
        }
    }
}

/// A rank-3 integer array with the numpy dtype `process_mask` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntArray {
    /// numpy dtype (int8, int16 or int32).
    pub dtype: NpyDType,
    /// Shape `[H, nq, nk]` (or the shrunk grid).
    pub shape: [usize; 3],
    /// Row-major values.
    pub data: Vec<i32>,
}

impl IntArray {
    fn new(shape: [usize; 3], data: Vec<i32>, downcast: bool) -> Self {
        // `_downcast_to_small_type`: the smallest of int8/int16/int32 holding the maximum.
        let max = data.iter().copied().max().unwrap_or(0);
        let dtype = if !downcast || data.is_empty() {
            NpyDType::I32
        } else if max <= i8::MAX as i32 {
            NpyDType::I8
        } else if max <= i16::MAX as i32 {
            NpyDType::I16
        } else {
            NpyDType::I32
        };
        IntArray { dtype, shape, data }
    }

    /// Entry `[a, b, c]`.
    pub fn get(&self, a: usize, b: usize, c: usize) -> i32 {
        self.data[(a * self.shape[1] + b) * self.shape[2] + c]
    }

    fn to_npy(&self) -> NpyArray {
        NpyArray::from_ints(
            self.dtype,
            self.shape.to_vec(),
            self.data.iter().map(|&v| v as i64),
        )
    }

    fn from_npy(a: &NpyArray, path: &Path, name: &str) -> Result<Self> {
        let shape = rank3(a, path, name)?;
        match (a.dtype, a.to_i64()) {
            (NpyDType::I8 | NpyDType::I16 | NpyDType::I32, Some(v)) => Ok(IntArray {
                dtype: a.dtype,
                shape,
                data: v.into_iter().map(|v| v as i32).collect(),
            }),
            _ => Err(Error::format(
                path,
                format!(
                    "{name}: expected int8/int16/int32, found {}",
                    a.dtype.name()
                ),
            )),
        }
    }
}

/// `partial_mask_blocks`: `bool[num_partial_blocks, rows, cols]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoolBlocks {
    /// `[blocks, rows, cols]`.
    pub shape: [usize; 3],
    /// Row-major bits.
    pub data: Vec<bool>,
}

impl BoolBlocks {
    /// Bit (`r`, `c`) of block `block`.
    pub fn get(&self, block: usize, r: usize, c: usize) -> bool {
        self.data[(block * self.shape[1] + r) * self.shape[2] + c]
    }
}

/// One `MaskInfo` (`q_sequence` is always `None`: the export is a data mask).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskInfo {
    /// Next data block index per grid step.
    pub data_next: IntArray,
    /// `None` when the mask has no partial block (as in the reference).
    pub mask_next: Option<IntArray>,
    /// Grid step state (0 empty, 1 partial, 2 full).
    pub block_mask: IntArray,
    /// `[n, tile.q, tile.kv]` forward, `[n, tile.kv, tile.q]` (transposed) for dKV; `None` when
    /// there is no partial block.
    pub partial_mask_blocks: Option<BoolBlocks>,
}

/// Forward and dKV mask infos of one batch row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplashRow {
    /// The forward `MaskInfo` (`process_mask`).
    pub fwd: MaskInfo,
    /// The dKV `MaskInfo` (`process_mask_dkv`).
    pub dkv: MaskInfo,
}

/// Splash arrays of a plan: one [`SplashRow`] per distinct batch row (`B'` of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplashArrays {
    /// The preprocessing options the arrays were made with.
    pub options: SplashOptions,
    /// `[B, H, Lq, Lkv]` of the plan.
    pub shape: [usize; 4],
    /// `(block_q, block_kv)` = the plan's tile.
    pub block_shape: (usize, usize),
    /// Sequence lengths after padding to whole blocks (what the JAX caller pads Q/K/V to).
    pub padded_lengths: (usize, usize),
    /// One per distinct batch row.
    pub rows: Vec<SplashRow>,
}

/// Splash arrays of `plan` with the default options of `process_mask`.
pub fn export(plan: &Plan) -> Result<SplashArrays> {
    export_with(plan, &SplashOptions::default())
}

/// Splash arrays of `plan` for the given `process_mask` options.
pub fn export_with(plan: &Plan, options: &SplashOptions) -> Result<SplashArrays> {
    plan.require_masks("a splash export")?;
    crate::check_budget(plan, "splash export")?;
    let heads = plan.shape.heads;
    if options.head_shards == 0 || heads % options.head_shards != 0 {
        return Err(Error::invalid(
            "head_shards",
            format!("a divisor of the number of heads ({heads})"),
            options.head_shards,
        ));
    }
    if options.q_seq_shards == 0 || plan.q_tiles % options.q_seq_shards != 0 {
        return Err(Error::invalid(
            "q_seq_shards",
            format!("a divisor of the number of q blocks ({})", plan.q_tiles),
            options.q_seq_shards,
        ));
    }
    let contents = Contents::new(plan);
    let rows = (0..plan.batch_groups)
        .map(|b| export_row(&contents, b, options))
        .collect::<Result<Vec<_>>>()?;
    Ok(SplashArrays {
        options: *options,
        shape: [plan.shape.batch, heads, plan.shape.q_len, plan.shape.kv_len],
        block_shape: (plan.tile.q, plan.tile.kv),
        padded_lengths: (plan.q_tiles * plan.tile.q, plan.kv_tiles * plan.tile.kv),
        rows,
    })
}

/// Dense grid of one distinct head mask: state per tile and Splash partial-block index.
struct Grid {
    st: Vec<i8>,
    pid: Vec<u32>,
}

fn same_content(a: &HeadPlan, b: &HeadPlan) -> bool {
    a.fwd_offsets == b.fwd_offsets && a.fwd == b.fwd
}

fn export_row(c: &Contents, b: usize, o: &SplashOptions) -> Result<SplashRow> {
    let plan = c.plan;
    let (nh, nq, nk) = (plan.shape.heads, plan.q_tiles, plan.kv_tiles);
    let (tq, tk) = (plan.tile.q, plan.tile.kv);

    // Unique masks, numbered by first head (`assign_unique_ids` over `mask.masks`).
    let mut uniq: Vec<usize> = Vec::new();
    let mut head_mask = vec![0usize; nh];
    for (h, hm) in head_mask.iter_mut().enumerate() {
        let hp = plan.head_plan_index(b, h);
        *hm = match uniq
            .iter()
            .position(|&u| u == hp || same_content(&plan.head_plans[u], &plan.head_plans[hp]))
        {
            Some(k) => k,
            None => {
                uniq.push(hp);
                uniq.len() - 1
            }
        };
    }

    // Tile grids and partial-block ids in first-appearance order over (mask, q, kv).
    let mut pid_of = vec![u32::MAX; c.len()];
    let mut blocks: Vec<u32> = Vec::new();
    let mut grids = Vec::with_capacity(uniq.len());
    for &hp in &uniq {
        let hp = &plan.head_plans[hp];
        let mut st = vec![0i8; nq * nk];
        let mut pid = vec![u32::MAX; nq * nk];
        for qt in 0..nq {
            for e in hp.row(qt) {
                let cell = qt * nk + e.tile as usize;
                match c.effective(qt, e.tile as usize, e) {
                    Eff::Full => st[cell] = 2,
                    Eff::Partial(cid) => {
                        st[cell] = 1;
                        let p = &mut pid_of[cid as usize];
                        if *p == u32::MAX {
                            *p = blocks.len() as u32;
                            blocks.push(cid);
                        }
                        pid[cell] = *p;
                    }
                }
            }
        }
        grids.push(Grid { st, pid });
    }
    let has_mask_next = !blocks.is_empty();

    // Head shards.
    let hs = o.head_shards;
    let hps = nh / hs;
    let shard_sets: Vec<Vec<usize>> = (0..hs)
        .map(|s| {
            let mut v = head_mask[s * hps..(s + 1) * hps].to_vec();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect();
    let one_per_shard = shard_sets.iter().all(|s| s.len() == 1);
    let all_identical = one_per_shard && shard_sets.iter().all(|s| s[0] == shard_sets[0][0]);
    // Mask of each row of block_mask / data_next / mask_next.
    let row_masks: Vec<usize> = if one_per_shard {
        (0..hs).map(|s| head_mask[s * hps]).collect()
    } else {
        head_mask.clone()
    };
    let mut block = Vec::with_capacity(row_masks.len() * nq * nk);
    for &m in &row_masks {
        block.extend(grids[m].st.iter().map(|&s| s as i32));
    }

    let qbps = nq / o.q_seq_shards;
    let shrink = |flag: bool| flag && row_masks.len() == hs && uniq.len() == 1;
    let mut infos = Vec::with_capacity(2);
    for is_dkv in [false, true] {
        // Segments processed by `_get_mask_info_for_shard`: (first output row, masks of its rows).
        let segments: Vec<(usize, Vec<usize>)> = if one_per_shard {
            let n = if all_identical { 1 } else { hs };
            (0..n).map(|s| (s, vec![head_mask[s * hps]])).collect()
        } else {
            (0..hs)
                .map(|s| (s * hps, head_mask[s * hps..(s + 1) * hps].to_vec()))
                .collect()
        };
        let out_rows: usize = segments.iter().map(|s| s.1.len()).sum();
        let mut data = vec![-1i32; out_rows * nq * nk];
        let mut mask = if has_mask_next {
            vec![-1i32; out_rows * nq * nk]
        } else {
            Vec::new()
        };
        for (r0, seg) in &segments {
            for t in 0..o.q_seq_shards {
                let qr = t * qbps..(t + 1) * qbps;
                fill_next(&grids, seg, *r0, qr, nq, nk, is_dkv, &mut data, &mut mask);
            }
        }
        if all_identical && hs > 1 {
            // np.broadcast_to(shard, (head_shards, nq, nk)).
            data = data.repeat(hs);
            mask = mask.repeat(hs);
        }
        let rows = row_masks.len();
        let mut bm = IntArray::new([rows, nq, nk], block.clone(), false);
        let mut dn = IntArray::new([rows, nq, nk], data, false);
        let mut mn = has_mask_next.then(|| IntArray::new([rows, nq, nk], mask, false));
        if shrink(if is_dkv {
            o.shrink_grid_dkv
        } else {
            o.shrink_grid
        }) {
            let mut arrays: Vec<(&mut IntArray, bool)> = vec![(&mut bm, true), (&mut dn, false)];
            if let Some(m) = mn.as_mut() {
                arrays.push((m, false));
            }
            if is_dkv {
                shrink_dkv(&grids[row_masks[0]].st, nq, nk, o.q_seq_shards, &mut arrays)?;
            } else {
                shrink_fwd(&grids[row_masks[0]].st, nq, nk, o.q_seq_shards, &mut arrays)?;
            }
        }
        let cast = |a: IntArray| IntArray::new(a.shape, a.data, o.downcast_smem_data);
        let pmb = has_mask_next.then(|| partial_blocks(c, &blocks, tq, tk, is_dkv));
        infos.push(MaskInfo {
            data_next: cast(dn),
            mask_next: mn.map(cast),
            block_mask: cast(bm),
            partial_mask_blocks: pmb,
        });
    }
    let dkv = infos
        .pop()
        .ok_or_else(|| Error::Internal("splash: no dkv info".into()))?;
    let fwd = infos
        .pop()
        .ok_or_else(|| Error::Internal("splash: no fwd info".into()))?;
    Ok(SplashRow { fwd, dkv })
}

/// `data_next` / `mask_next` of one (head shard, q shard) segment: the kv (forward) or local q
/// (dKV) index, and the partial-block index, of the first non-empty / partial position at or
/// after each position in grid order (`(head, q, kv)` forward, `(kv, head, q)` for dKV),
/// wrapping to the first one; zeros when there is none.
#[allow(clippy::too_many_arguments)]
fn fill_next(
    grids: &[Grid],
    seg: &[usize],
    r0: usize,
    qr: Range<usize>,
    nq: usize,
    nk: usize,
    is_dkv: bool,
    data: &mut [i32],
    mask: &mut [i32],
) {
    let with_mask = !mask.is_empty();
    let q0 = qr.start;
    let nh = seg.len();
    // Rows of the segment in (head, q) order; every sweep below is row-major (cache friendly).
    let rows = || (0..nh).flat_map(|hl| qr.clone().map(move |q| (hl, q)));
    if !is_dkv {
        // Grid order is row-major: one reverse sweep carries the next value across rows.
        let (mut nd, mut nm) = (-1i32, -1i32);
        let all: Vec<(usize, usize)> = rows().collect();
        for &(hl, q) in all.iter().rev() {
            let g = &grids[seg[hl]];
            let base = ((r0 + hl) * nq + q) * nk;
            for kv in (0..nk).rev() {
                let s = g.st[q * nk + kv];
                if s != 0 {
                    nd = kv as i32;
                }
                data[base + kv] = nd;
                if with_mask {
                    if s == 1 {
                        nm = g.pid[q * nk + kv] as i32;
                    }
                    mask[base + kv] = nm;
                }
            }
        }
        // `nd` / `nm` now hold the first position's values: the wrap-around target.
        let (fd, fm) = (nd.max(0), nm.max(0));
        for &(hl, q) in &all {
            let base = ((r0 + hl) * nq + q) * nk;
            replace_neg(&mut data[base..base + nk], |_| fd);
            if with_mask {
                replace_neg(&mut mask[base..base + nk], |_| fm);
            }
        }
        return;
    }
    // dKV: grid order is column-major over the segment's rows. First the next value within the
    // same column (reverse row sweep keeping one "next" per column); positions with none after
    // them in their column take the first value of the next non-empty column, wrapping around.
    let all: Vec<(usize, usize)> = rows().collect();
    let mut col_d = vec![-1i32; nk];
    let mut col_m = vec![-1i32; if with_mask { nk } else { 0 }];
    for &(hl, q) in all.iter().rev() {
        let g = &grids[seg[hl]];
        let base = ((r0 + hl) * nq + q) * nk;
        for kv in 0..nk {
            let s = g.st[q * nk + kv];
            if s != 0 {
                col_d[kv] = (q - q0) as i32;
            }
            data[base + kv] = col_d[kv];
            if with_mask {
                if s == 1 {
                    col_m[kv] = g.pid[q * nk + kv] as i32;
                }
                mask[base + kv] = col_m[kv];
            }
        }
    }
    // col_*[kv] is now the first value of column kv; after_*[kv] that of the next non-empty
    // column after kv (wrapping to the first non-empty column, else 0).
    let after = |col: &[i32]| -> Vec<i32> {
        let first = col.iter().copied().find(|&v| v >= 0).unwrap_or(0);
        let mut out = vec![first; col.len()];
        let mut next = first;
        for kv in (0..col.len()).rev() {
            out[kv] = next;
            if col[kv] >= 0 {
                next = col[kv];
            }
        }
        out
    };
    let after_d = after(&col_d);
    let after_m = if with_mask { after(&col_m) } else { Vec::new() };
    for &(hl, q) in &all {
        let base = ((r0 + hl) * nq + q) * nk;
        replace_neg(&mut data[base..base + nk], |kv| after_d[kv]);
        if with_mask {
            replace_neg(&mut mask[base..base + nk], |kv| after_m[kv]);
        }
    }
}

fn replace_neg(row: &mut [i32], f: impl Fn(usize) -> i32) {
    for (k, v) in row.iter_mut().enumerate() {
        if *v < 0 {
            *v = f(k);
        }
    }
}

fn empty_shard_error(t: usize) -> Error {
    Error::Unsupported(format!(
        "splash export: q shard {t} has no active block; process_mask with shrink_grid=True \
         fails on such a mask (AssertionError); export with shrink_grid disabled"
    ))
}

/// `_shrink_mask_info` per q shard, then edge padding across q shards (`block_mask` with 0).
fn shrink_fwd(
    st0: &[i8],
    nq: usize,
    nk: usize,
    shards: usize,
    arrays: &mut [(&mut IntArray, bool)],
) -> Result<()> {
    let per = nq / shards;
    let cols: Vec<Vec<usize>> = (0..nq)
        .map(|q| (0..nk).filter(|&k| st0[q * nk + k] != 0).collect())
        .collect();
    let widths: Vec<usize> = (0..shards)
        .map(|t| {
            cols[t * per..(t + 1) * per]
                .iter()
                .map(Vec::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    if let Some(t) = widths.iter().position(|&w| w == 0) {
        return Err(empty_shard_error(t));
    }
    let wmax = widths.iter().copied().max().unwrap_or(0);
    for (arr, is_block) in arrays.iter_mut() {
        let rows = arr.shape[0];
        let mut out = vec![0i32; rows * nq * wmax];
        for r in 0..rows {
            for q in 0..nq {
                let w = widths[q / per];
                let src = &arr.data[(r * nq + q) * nk..(r * nq + q + 1) * nk];
                let dst = &mut out[(r * nq + q) * wmax..(r * nq + q + 1) * wmax];
                for (k, &col) in cols[q].iter().enumerate() {
                    dst[k] = src[col];
                }
                if !*is_block {
                    let edge = dst[w - 1];
                    for v in &mut dst[w..] {
                        *v = edge;
                    }
                }
            }
        }
        arr.shape = [rows, nq, wmax];
        arr.data = out;
    }
    Ok(())
}

/// `_shrink_mask_info_dkv` per q shard (columns' non-empty rows, padded at the front), then
/// edge padding at the end of each q shard's rows (`block_mask` with 0).
fn shrink_dkv(
    st0: &[i8],
    nq: usize,
    nk: usize,
    shards: usize,
    arrays: &mut [(&mut IntArray, bool)],
) -> Result<()> {
    let per = nq / shards;
    // rows[t][kv]: local non-empty q rows of column kv in shard t.
    let rows_of: Vec<Vec<Vec<usize>>> = (0..shards)
        .map(|t| {
            (0..nk)
                .map(|k| {
                    (0..per)
                        .filter(|&ql| st0[(t * per + ql) * nk + k] != 0)
                        .collect()
                })
                .collect()
        })
        .collect();
    let heights: Vec<usize> = rows_of
        .iter()
        .map(|cs| cs.iter().map(Vec::len).max().unwrap_or(0))
        .collect();
    if let Some(t) = heights.iter().position(|&h| h == 0) {
        return Err(empty_shard_error(t));
    }
    let rmax = heights.iter().copied().max().unwrap_or(0);
    let out_q = shards * rmax;
    for (arr, is_block) in arrays.iter_mut() {
        let hr = arr.shape[0];
        let mut out = vec![0i32; hr * out_q * nk];
        for r in 0..hr {
            for (t, cs) in rows_of.iter().enumerate() {
                let h = heights[t];
                for (k, rows) in cs.iter().enumerate() {
                    let pad = h - rows.len();
                    for (i, &ql) in rows.iter().enumerate() {
                        out[(r * out_q + t * rmax + pad + i) * nk + k] =
                            arr.data[(r * nq + t * per + ql) * nk + k];
                    }
                    if !*is_block {
                        let edge = out[(r * out_q + t * rmax + h - 1) * nk + k];
                        for i in h..rmax {
                            out[(r * out_q + t * rmax + i) * nk + k] = edge;
                        }
                    }
                }
            }
        }
        arr.shape = [hr, out_q, nk];
        arr.data = out;
    }
    Ok(())
}

/// `partial_mask_blocks` in Splash order; transposed (`[n, tk, tq]`) for dKV.
fn partial_blocks(c: &Contents, blocks: &[u32], tq: usize, tk: usize, is_dkv: bool) -> BoolBlocks {
    let wpr = c.plan.partials.words_per_row;
    let mut data = vec![false; blocks.len() * tq * tk];
    for (n, &cid) in blocks.iter().enumerate() {
        let bits = c.bits(cid);
        let blk = &mut data[n * tq * tk..(n + 1) * tq * tk];
        for r in 0..tq {
            let row = &bits[r * wpr..(r + 1) * wpr];
            for (w, &word) in row.iter().enumerate() {
                let mut x = word;
                while x != 0 {
                    let col = w * 64 + x.trailing_zeros() as usize;
                    x &= x - 1;
                    if is_dkv {
                        blk[col * tq + r] = true;
                    } else {
                        blk[r * tk + col] = true;
                    }
                }
            }
        }
    }
    let shape = if is_dkv {
        [blocks.len(), tk, tq]
    } else {
        [blocks.len(), tq, tk]
    };
    BoolBlocks { shape, data }
}

fn rank3(a: &NpyArray, path: &Path, name: &str) -> Result<[usize; 3]> {
    match a.shape[..] {
        [x, y, z] => Ok([x, y, z]),
        _ => Err(Error::format(
            path,
            format!("{name}: expected a rank-3 array, found shape {:?}", a.shape),
        )),
    }
}

/// Tile states and partial-block pointers decoded from Splash arrays the way the kernel reads
/// them (`block_mask != 0` runs block `data_next`, masked by `partial_mask_blocks[mask_next]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedGrid {
    /// `[B', H, nq, nk]`.
    pub shape: [usize; 4],
    /// 0 empty, 1 partial, 2 full.
    pub states: Vec<i8>,
    /// Index into the info's `partial_mask_blocks` for partial tiles, else -1.
    pub block: Vec<i32>,
}

impl SplashArrays {
    /// Number of q and kv blocks.
    pub fn blocks(&self) -> (usize, usize) {
        (
            self.padded_lengths.0 / self.block_shape.0,
            self.padded_lengths.1 / self.block_shape.1,
        )
    }

    /// The npz member names and arrays (see `docs/export.md`).
    pub fn to_members(&self) -> Vec<(String, NpyArray)> {
        let meta = npz::meta;
        let o = &self.options;
        let mut out = vec![
            ("tessera_export".to_string(), meta(&[1, 0])),
            ("meta_shape".to_string(), meta(&self.shape)),
            (
                "meta_block_shape".to_string(),
                meta(&[self.block_shape.0, self.block_shape.1]),
            ),
            (
                "meta_padded_lengths".to_string(),
                meta(&[self.padded_lengths.0, self.padded_lengths.1]),
            ),
            (
                "meta_options".to_string(),
                meta(&[
                    o.head_shards,
                    o.q_seq_shards,
                    o.shrink_grid as usize,
                    o.shrink_grid_dkv as usize,
                    o.downcast_smem_data as usize,
                ]),
            ),
        ];
        let multi = self.rows.len() > 1;
        for (b, row) in self.rows.iter().enumerate() {
            let sfx = if multi {
                format!("_b{b}")
            } else {
                String::new()
            };
            for (info, kind) in [(&row.fwd, ""), (&row.dkv, "_dkv")] {
                out.push((format!("data_next{kind}{sfx}"), info.data_next.to_npy()));
                if let Some(m) = &info.mask_next {
                    out.push((format!("mask_next{kind}{sfx}"), m.to_npy()));
                }
                out.push((format!("block_mask{kind}{sfx}"), info.block_mask.to_npy()));
                if let Some(p) = &info.partial_mask_blocks {
                    out.push((
                        format!("partial_mask_blocks{kind}{sfx}"),
                        NpyArray::from_bools(p.shape.to_vec(), &p.data),
                    ));
                }
            }
        }
        out
    }

    /// Writes the arrays to an `.npz` at `path` atomically (temp file + rename).
    pub fn write_npz(&self, path: &Path) -> Result<()> {
        npz::write_npz(path, &self.to_members())
    }

    /// Reads arrays written by [`SplashArrays::write_npz`].
    pub fn read_npz(path: &Path) -> Result<Self> {
        let m = Members::read_export(path, [1, 0], "Splash")?;
        let s = m.meta("meta_shape", 4)?;
        let bs = m.meta("meta_block_shape", 2)?;
        let pl = m.meta("meta_padded_lengths", 2)?;
        let op = m.meta("meta_options", 5)?;
        let options = SplashOptions {
            head_shards: op[0],
            q_seq_shards: op[1],
            shrink_grid: op[2] != 0,
            shrink_grid_dkv: op[3] != 0,
            downcast_smem_data: op[4] != 0,
        };
        let multi = m.get("data_next").is_none();
        let mut rows = Vec::new();
        for b in 0.. {
            let sfx = if multi {
                format!("_b{b}")
            } else {
                String::new()
            };
            if m.get(&format!("data_next{sfx}")).is_none() {
                break;
            }
            let info = |kind: &str| -> Result<MaskInfo> {
                let int = |n: &str| -> Result<Option<IntArray>> {
                    let name = format!("{n}{kind}{sfx}");
                    m.get(&name)
                        .map(|a| IntArray::from_npy(a, path, &name))
                        .transpose()
                };
                let need = |n: &str| -> Result<IntArray> {
                    int(n)?
                        .ok_or_else(|| Error::format(path, format!("missing array {n}{kind}{sfx}")))
                };
                let pname = format!("partial_mask_blocks{kind}{sfx}");
                let pmb = match m.get(&pname) {
                    Some(a) => {
                        if a.dtype != NpyDType::Bool {
                            return Err(Error::format(path, format!("{pname}: expected bool")));
                        }
                        Some(BoolBlocks {
                            shape: rank3(a, path, &pname)?,
                            data: a.bytes.iter().map(|&x| x != 0).collect(),
                        })
                    }
                    None => None,
                };
                Ok(MaskInfo {
                    data_next: need("data_next")?,
                    mask_next: int("mask_next")?,
                    block_mask: need("block_mask")?,
                    partial_mask_blocks: pmb,
                })
            };
            rows.push(SplashRow {
                fwd: info("")?,
                dkv: info("_dkv")?,
            });
            if !multi {
                break;
            }
        }
        Ok(SplashArrays {
            options,
            shape: [s[0], s[1], s[2], s[3]],
            block_shape: (bs[0], bs[1]),
            padded_lengths: (pl[0], pl[1]),
            rows,
        })
    }

    /// Decodes the forward (`dkv == false`) or dKV infos into tile states `[B', H, nq, nk]`,
    /// checking that every index the kernel would follow is in range and consistent.
    pub fn decode(&self, dkv: bool) -> Result<DecodedGrid> {
        let bad = |m: String| Error::Internal(format!("splash decode: {m}"));
        let (nq, nk) = self.blocks();
        let nh = self.shape[1];
        let nb = self.rows.len();
        let mut states = vec![0i8; nb * nh * nq * nk];
        let mut block = vec![-1i32; nb * nh * nq * nk];
        let qbps = nq / self.options.q_seq_shards.max(1);
        for (b, row) in self.rows.iter().enumerate() {
            let info = if dkv { &row.dkv } else { &row.fwd };
            let bm = &info.block_mask;
            let rows = bm.shape[0];
            if rows == 0 || nh % rows != 0 || info.data_next.shape != bm.shape {
                return Err(bad(format!(
                    "block_mask shape {:?} for {nh} heads",
                    bm.shape
                )));
            }
            if let Some(mn) = &info.mask_next {
                if mn.shape != bm.shape {
                    return Err(bad("mask_next shape differs from block_mask".into()));
                }
            }
            let npart = info.partial_mask_blocks.as_ref().map_or(0, |p| p.shape[0]);
            let [_, d1, d2] = bm.shape;
            for h in 0..nh {
                let r = h / (nh / rows);
                for i in 0..d1 {
                    for j in 0..d2 {
                        let v = bm.get(r, i, j);
                        if v == 0 {
                            continue;
                        }
                        let dn = info.data_next.get(r, i, j);
                        let (q, k) = if dkv {
                            let shard = i / (d1 / self.options.q_seq_shards.max(1));
                            (shard * qbps + dn as usize, j)
                        } else {
                            (i, dn as usize)
                        };
                        if dn < 0 || q >= nq || k >= nk || !(1..=2).contains(&v) {
                            return Err(bad(format!(
                                "entry ({r}, {i}, {j}) points to block ({q}, {k}) with state {v}"
                            )));
                        }
                        let cell = ((b * nh + h) * nq + q) * nk + k;
                        if states[cell] != 0 {
                            return Err(bad(format!("block ({q}, {k}) of head {h} listed twice")));
                        }
                        states[cell] = v as i8;
                        if v == 1 {
                            let mn = info
                                .mask_next
                                .as_ref()
                                .ok_or_else(|| bad("partial block without mask_next".into()))?
                                .get(r, i, j);
                            if mn < 0 || mn as usize >= npart {
                                return Err(bad(format!(
                                    "mask_next {mn} out of range ({npart} blocks)"
                                )));
                            }
                            block[cell] = mn;
                        }
                    }
                }
            }
        }
        Ok(DecodedGrid {
            shape: [nb, nh, nq, nk],
            states,
            block,
        })
    }

    /// Whether padded-sequence pair (`i`, `j`) is allowed for batch group `b`, head `h`,
    /// according to a grid from [`SplashArrays::decode`] with the same `dkv`.
    pub fn allowed(
        &self,
        grid: &DecodedGrid,
        dkv: bool,
        b: usize,
        h: usize,
        i: usize,
        j: usize,
    ) -> bool {
        let [_, nh, nq, nk] = grid.shape;
        let (tq, tk) = self.block_shape;
        let cell = ((b * nh + h) * nq + i / tq) * nk + j / tk;
        match grid.states[cell] {
            2 => true,
            1 => {
                let row = &self.rows[b];
                let info = if dkv { &row.dkv } else { &row.fwd };
                let p = info
                    .partial_mask_blocks
                    .as_ref()
                    .expect("decoded partial block");
                let blk = grid.block[cell] as usize;
                if dkv {
                    p.get(blk, j % tk, i % tq)
                } else {
                    p.get(blk, i % tq, j % tk)
                }
            }
            _ => false,
        }
    }
}
