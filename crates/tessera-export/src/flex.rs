//! PyTorch FlexAttention `BlockMask` arrays.
//!
//! Contract: [`export`] returns exactly the eight int32 tensors that
//! `torch.nn.attention.flex_attention.create_block_mask(mask_mod, B', H', Lq, Lkv,
//! BLOCK_SIZE=(tile.q, tile.kv))` stores for the plan's token mask (`B'`, `H'` = the plan's
//! batch and head groups): `kv_*` count and list the *partial* blocks only, `full_kv_*` the full
//! ones; each index row lists its blocks ascending, followed by every other block index
//! ascending (`argsort(dense, descending=True, stable=True)`), so no slot holds a sentinel;
//! `q_*` / `full_q_*` are the transposes (`_transpose_ordered`). Tiles on a ragged edge that
//! Tessera marks Full are partial here, as in torch, which pads the mask with `False`.
//!
//! FlexAttention masks partial blocks by calling a `mask_mod`; so that a caller needs nothing
//! but the file, the export also carries the token content of partial blocks
//! (`mask_tile_states`, `mask_block_ids`, `mask_blocks`), from which `docs/export.md` builds a
//! `mask_mod`.

use crate::npz::{self, Members, NpyArray, NpyDType};
use crate::tiles::{Contents, Eff};
use std::path::Path;
use tessera_core::{Error, Result};
use tessera_plan::Plan;

/// The tensors of a `BlockMask` (row-major int32).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlexArrays {
    /// `[B, H, Lq, Lkv]` of the plan (`seq_lengths` = `(Lq, Lkv)`).
    pub shape: [usize; 4],
    /// `BLOCK_SIZE` = `(Q_BLOCK_SIZE, KV_BLOCK_SIZE)` = the plan's tile.
    pub block_size: (usize, usize),
    /// Leading dims `[B', H']` of every tensor (1 where the mask does not vary).
    pub groups: (usize, usize),
    /// Number of q blocks and kv blocks (`ceil(L / block)`).
    pub blocks: (usize, usize),
    /// `[B', H', nq]`.
    pub kv_num_blocks: Vec<i32>,
    /// `[B', H', nq, nk]`.
    pub kv_indices: Vec<i32>,
    /// `[B', H', nq]`: full kv blocks per q block.
    pub full_kv_num_blocks: Vec<i32>,
    /// `[B', H', nq, nk]`: full kv block indices, then the others.
    pub full_kv_indices: Vec<i32>,
    /// `[B', H', nk]`.
    pub q_num_blocks: Vec<i32>,
    /// `[B', H', nk, nq]`.
    pub q_indices: Vec<i32>,
    /// `[B', H', nk]`: full q blocks per kv block.
    pub full_q_num_blocks: Vec<i32>,
    /// `[B', H', nk, nq]`: full q block indices, then the others.
    pub full_q_indices: Vec<i32>,
    /// Tessera addition: engine tile states `[B', H', nq, nk]` (0 empty, 1 partial, 2 full).
    pub mask_tile_states: Vec<i8>,
    /// Tessera addition: `[B', H', nq, nk]` index into `mask_blocks` of each partial tile, -1
    /// elsewhere.
    pub mask_block_ids: Vec<i32>,
    /// Tessera addition: `bool[n, tile.q, tile.kv]` deduplicated partial-block contents (in
    /// order of first appearance over (group, q block, kv block)); one all-`False` block when
    /// there is no partial tile, so that `n >= 1` and gathers in a `mask_mod` never go empty.
    pub mask_blocks: Vec<bool>,
}

/// Appends one ordered row of `n` indices to `out`: `active` (ascending, distinct, below `n`)
/// first, then the remaining indices ascending. A row whose active indices form few runs fills
/// the gaps between them in bulk; one with many gaps (a scattered mask's, a few indices each,
/// which cost more to set up than to fill) lists the clear bits of a bitmap of the row
/// (`scratch`), one `tzcnt` each.
fn ordered_row(active: &[u32], n: usize, out: &mut Vec<i32>, scratch: &mut Vec<u64>) {
    out.reserve(n);
    out.extend(active.iter().map(|&a| a as i32));
    let gaps = active.windows(2).filter(|w| w[1] != w[0] + 1).count();
    if gaps * 16 < n {
        let mut next = 0u32;
        for &a in active {
            if a != next {
                out.extend(next as i32..a as i32);
            }
            next = a + 1;
        }
        out.extend(next as i32..n as i32);
        return;
    }
    scratch.clear();
    scratch.resize(n.div_ceil(64), 0);
    for &a in active {
        scratch[a as usize / 64] |= 1 << (a % 64);
    }
    // Written in place (a push per index reloads the vector's length and capacity).
    let start = out.len();
    out.resize(start + n - active.len(), 0);
    let (row, mut at) = (&mut out[start..], 0);
    for (w, &word) in scratch.iter().enumerate() {
        let left = n - 64 * w;
        let mut rest = if left < 64 {
            !word & ((1u64 << left) - 1)
        } else {
            !word
        };
        while rest != 0 {
            row[at] = (64 * w) as i32 + rest.trailing_zeros() as i32;
            at += 1;
            rest &= rest - 1;
        }
    }
}

/// FlexAttention `BlockMask` tensors of `plan`.
pub fn export(plan: &Plan) -> Result<FlexArrays> {
    Ok(export_impl(plan, BlockOutput::Bools, Cells::States)?.0)
}

/// [`export`] with the partial-block contents as packed bit rows instead of `mask_blocks`
/// (left empty): `[n, tile.q, ⌈tile.kv/64⌉]` words, bit `c % 64` of word `c / 64` of row `r` set
/// when (query `r`, key `c`) of the block is allowed. A `mask_mod` can read these directly (no
/// `n·tile.q·tile.kv` bool array is built; the live export path of the Python bindings).
pub fn export_packed(plan: &Plan) -> Result<(FlexArrays, Vec<u64>)> {
    let (a, _, mut packed) = export_impl(plan, BlockOutput::Packed(Vec::new()), Cells::States)?;
    if packed.is_empty() {
        packed = vec![0; plan.tile.q * plan.partials.words_per_row];
    }
    Ok((a, packed))
}

/// [`export_packed`] appending the blocks to `lead` (words the caller keeps in front of them,
/// such as its own constant blocks), so that a caller laying the blocks out behind a header
/// copies them once (nothing is appended when no block is partial), and with each tile's code
/// instead of `mask_tile_states` / `mask_block_ids` (left empty): `[B', H', nq, nk]` int32, 0
/// empty, 1 full, `2 + i` partial with block `i` (counted from the first appended block): what a
/// bit-table `mask_mod` indexes, built in the same pass.
pub fn export_coded_after(plan: &Plan, lead: Vec<u64>) -> Result<(FlexArrays, Vec<i32>, Vec<u64>)> {
    let (a, codes, packed) = export_impl(plan, BlockOutput::Packed(lead), Cells::Codes)?;
    Ok((a, codes, packed))
}

/// [`export_coded_after`] without the blocks' contents: the tables and codes alone, for a
/// `mask_mod` that does not read the bits (one generated from the mask expression). Also for a
/// plan of tile states only (`build_tile_states`), whose partial tiles share one code.
pub fn export_coded(plan: &Plan) -> Result<(FlexArrays, Vec<i32>)> {
    let (a, codes, _) = export_impl(plan, BlockOutput::Skip, Cells::Codes)?;
    Ok((a, codes))
}

/// The eight `BlockMask` tables alone (no per-cell states, block ids or codes, no blocks): what
/// a `mask_mod` computed from the mask needs on the host. Any plan, tile states only included.
pub fn export_tables(plan: &Plan) -> Result<FlexArrays> {
    Ok(export_impl(plan, BlockOutput::Skip, Cells::Neither)?.0)
}

/// The active tiles of a plan in row-major order over `[B', H', nq, nk]`, O(active tiles): what
/// a device needs to expand every `BlockMask` table itself (see [`export_compact`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompactTiles {
    /// `[B, H, Lq, Lkv]` of the plan.
    pub shape: [usize; 4],
    /// `(tile.q, tile.kv)`.
    pub block_size: (usize, usize),
    /// `(B', H')`.
    pub groups: (usize, usize),
    /// `(nq, nk)`.
    pub blocks: (usize, usize),
    /// Flat index `((b·H' + h)·nq + qt)·nk + kt` of each non-empty tile, ascending.
    pub cells: Vec<i32>,
    /// Per entry of `cells`: 1 full, `2 + i` partial with packed bit block `i` (as in `FlexAttention`,
    /// a ragged edge tile is partial).
    pub codes: Vec<i32>,
}

/// The plan's non-empty tiles and their deduplicated partial-block bits (packed as in
/// [`export_packed`]; one all-clear block when there is none). Fails when the `[B', H', nq, nk]`
/// grid has 2^31 cells or more (int32 indices).
pub fn export_compact(plan: &Plan) -> Result<(CompactTiles, Vec<u64>)> {
    let (out, packed) = export_compact_after(plan, Some(Vec::new()))?;
    let mut packed = packed.unwrap_or_default();
    if packed.is_empty() {
        packed = vec![0; plan.tile.q * plan.partials.words_per_row];
    }
    Ok((out, packed))
}

/// [`export_compact`] appending the blocks to `lead` (as [`export_coded_after`]: nothing when no
/// block is partial), or copying none with `lead` None (for a `mask_mod` that reads no bits; a
/// plan of tile states only then works too, as in [`export_coded`]).
pub fn export_compact_after(
    plan: &Plan,
    mut lead: Option<Vec<u64>>,
) -> Result<(CompactTiles, Option<Vec<u64>>)> {
    if lead.is_some() {
        plan.require_masks("the partial blocks of a flex export")?;
    }
    crate::check_budget(plan, "flex export")?;
    let c = Contents::new(plan);
    let (nq, nk) = (plan.q_tiles, plan.kv_tiles);
    let (bg, hg) = (plan.batch_groups, plan.head_groups);
    let cells = (bg * hg).saturating_mul(nq).saturating_mul(nk);
    if cells > i32::MAX as usize {
        return Err(Error::invalid(
            "tile",
            "fewer than 2^31 blocks over (B', H', nq, nk)",
            cells,
        ));
    }
    let mut out = CompactTiles {
        shape: [
            plan.shape.batch,
            plan.shape.heads,
            plan.shape.q_len,
            plan.shape.kv_len,
        ],
        block_size: (plan.tile.q, plan.tile.kv),
        groups: (bg, hg),
        blocks: (nq, nk),
        cells: Vec::new(),
        codes: Vec::new(),
    };
    let blocks = match lead.as_mut() {
        Some(p) => Blocks::Packed(p),
        None => Blocks::Skip,
    };
    let mut row_tiles: Vec<(u32, i32)> = Vec::new();
    visit_rows(plan, &c, blocks, |gi, qt, row| {
        row_tiles.clear();
        row_tiles.extend_from_slice(row);
        row_tiles.sort_unstable_by_key(|&(t, _)| t);
        for &(t, id) in &row_tiles {
            out.cells.push(((gi * nq + qt) * nk + t as usize) as i32);
            out.codes.push(if id < 0 { 1 } else { id + 2 });
        }
    });
    Ok((out, lead))
}

/// Where [`visit_rows`] puts each new partial block's contents.
enum Blocks<'a> {
    /// As `tq x tk` bools.
    Bools(&'a mut Vec<bool>, usize, usize),
    /// As packed words.
    Packed(&'a mut Vec<u64>),
    /// Nowhere (the ids alone).
    Skip,
}

/// Walks the kv rows of every (group, q tile): `row(gi, qt, tiles)` gets the row's non-empty
/// tiles as `(kv tile, partial block id or -1 for full)`, block ids numbered in order of first
/// appearance; each new partial block's contents go to `blocks`. Returns the number of partial
/// blocks.
fn visit_rows(
    plan: &Plan,
    c: &Contents<'_>,
    mut blocks: Blocks<'_>,
    mut row: impl FnMut(usize, usize, &[(u32, i32)]),
) -> i32 {
    let nq = plan.q_tiles;
    let (bg, hg) = (plan.batch_groups, plan.head_groups);
    let wpr = plan.partials.words_per_row;
    let mut block_of = vec![-1i32; c.len()];
    let mut n_blocks = 0i32;
    let mut tiles = Vec::new();
    for b in 0..bg {
        for h in 0..hg {
            let gi = b * hg + h;
            let hp = plan.head_plan(b, h);
            for qt in 0..nq {
                tiles.clear();
                for e in hp.row(qt) {
                    let id = match c.effective(qt, e.tile as usize, e) {
                        Eff::Full => -1,
                        Eff::Partial(cid) => {
                            let id = &mut block_of[cid as usize];
                            if *id < 0 {
                                *id = n_blocks;
                                n_blocks += 1;
                                match &mut blocks {
                                    Blocks::Bools(out, tq, tk) => {
                                        append_block(out, c.bits(cid), *tq, *tk, wpr)
                                    }
                                    Blocks::Packed(out) => out.extend_from_slice(c.bits(cid)),
                                    Blocks::Skip => {}
                                }
                            }
                            *id
                        }
                    };
                    tiles.push((e.tile, id));
                }
                row(gi, qt, &tiles);
            }
        }
    }
    n_blocks
}

/// What [`export_impl`] does with the partial blocks' contents.
enum BlockOutput {
    /// `mask_blocks` (bools).
    Bools,
    /// Appended to these words (returned).
    Packed(Vec<u64>),
    /// Nothing (the ids alone).
    Skip,
}

/// What [`export_impl`] writes per `[B', H', nq, nk]` cell.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cells {
    /// `mask_tile_states` and `mask_block_ids`.
    States,
    /// The tile codes of [`export_coded_after`] (returned).
    Codes,
    /// Nothing: the eight tables alone.
    Neither,
}

/// The arrays with the partial blocks' contents as `blocks` says, and per cell what `cells`
/// says.
fn export_impl(
    plan: &Plan,
    blocks: BlockOutput,
    cells_out: Cells,
) -> Result<(FlexArrays, Vec<i32>, Vec<u64>)> {
    let bools = matches!(blocks, BlockOutput::Bools);
    if !matches!(blocks, BlockOutput::Skip) {
        plan.require_masks("the partial blocks of a flex export")?;
    }
    crate::check_budget(plan, "flex export")?;
    let c = Contents::new(plan);
    let (nq, nk) = (plan.q_tiles, plan.kv_tiles);
    let (bg, hg) = (plan.batch_groups, plan.head_groups);
    let g = bg * hg;
    if nq > i32::MAX as usize || nk > i32::MAX as usize {
        return Err(Error::invalid(
            "tile",
            "fewer than 2^31 blocks per side",
            nq.max(nk),
        ));
    }
    let cells = g * nq * nk;
    // Index rows are appended whole; the per-cell tables are written where a tile is.
    let (per_cell, code_cells) = match cells_out {
        Cells::States => (cells, 0),
        Cells::Codes => (0, cells),
        Cells::Neither => (0, 0),
    };
    let mut a = FlexArrays {
        shape: [
            plan.shape.batch,
            plan.shape.heads,
            plan.shape.q_len,
            plan.shape.kv_len,
        ],
        block_size: (plan.tile.q, plan.tile.kv),
        groups: (bg, hg),
        blocks: (nq, nk),
        kv_num_blocks: vec![0; g * nq],
        kv_indices: Vec::with_capacity(cells),
        full_kv_num_blocks: vec![0; g * nq],
        full_kv_indices: Vec::with_capacity(cells),
        q_num_blocks: vec![0; g * nk],
        q_indices: Vec::with_capacity(cells),
        full_q_num_blocks: vec![0; g * nk],
        full_q_indices: Vec::with_capacity(cells),
        mask_tile_states: vec![0; per_cell],
        mask_block_ids: vec![-1; per_cell],
        mask_blocks: Vec::new(),
    };
    let mut code = vec![0i32; code_cells];
    let (tq, tk) = (plan.tile.q, plan.tile.kv);
    let (mut part, mut full) = (Vec::new(), Vec::new());
    let mut scratch = Vec::new();
    let mut mask_blocks = Vec::new();
    let mut packed = Vec::new();
    let sink = match blocks {
        BlockOutput::Bools => Blocks::Bools(&mut mask_blocks, tq, tk),
        BlockOutput::Packed(p) => {
            packed = p;
            Blocks::Packed(&mut packed)
        }
        BlockOutput::Skip => Blocks::Skip,
    };
    let n_blocks = visit_rows(plan, &c, sink, |gi, qt, row| {
        part.clear();
        full.clear();
        for &(tile, id) in row {
            let cell = (gi * nq + qt) * nk + tile as usize;
            if id < 0 {
                full.push(tile);
            } else {
                part.push(tile);
            }
            match cells_out {
                Cells::Codes => code[cell] = if id < 0 { 1 } else { id.saturating_add(2) },
                Cells::States if id < 0 => a.mask_tile_states[cell] = 2,
                Cells::States => {
                    a.mask_tile_states[cell] = 1;
                    a.mask_block_ids[cell] = id;
                }
                Cells::Neither => {}
            }
        }
        let r = gi * nq + qt;
        a.kv_num_blocks[r] = part.len() as i32;
        a.full_kv_num_blocks[r] = full.len() as i32;
        ordered_row(&part, nk, &mut a.kv_indices, &mut scratch);
        ordered_row(&full, nk, &mut a.full_kv_indices, &mut scratch);
    });
    a.mask_blocks = mask_blocks;
    for b in 0..bg {
        for h in 0..hg {
            let gi = b * hg + h;
            let hp = plan.head_plan(b, h);
            for kt in 0..nk {
                part.clear();
                full.clear();
                for e in hp.col(kt) {
                    match c.effective(e.tile as usize, kt, e) {
                        Eff::Full => full.push(e.tile),
                        Eff::Partial(_) => part.push(e.tile),
                    }
                }
                let r = gi * nk + kt;
                a.q_num_blocks[r] = part.len() as i32;
                a.full_q_num_blocks[r] = full.len() as i32;
                ordered_row(&part, nq, &mut a.q_indices, &mut scratch);
                ordered_row(&full, nq, &mut a.full_q_indices, &mut scratch);
            }
        }
    }
    if n_blocks == 0 && bools {
        a.mask_blocks = vec![false; tq * tk];
    }
    Ok((a, code, packed))
}

fn append_block(out: &mut Vec<bool>, bits: &[u64], tq: usize, tk: usize, wpr: usize) {
    let base = out.len();
    out.resize(base + tq * tk, false);
    for r in 0..tq {
        for c in 0..tk {
            out[base + r * tk + c] = (bits[r * wpr + c / 64] >> (c % 64)) & 1 == 1;
        }
    }
}

impl FlexArrays {
    /// Number of entries in `mask_blocks`.
    pub fn num_mask_blocks(&self) -> usize {
        self.mask_blocks.len() / (self.block_size.0 * self.block_size.1)
    }

    /// Whether padded-sequence pair (`i`, `j`) is allowed for group (`b`, `h`) according to the
    /// `mask_*` arrays (what the `mask_mod` of `docs/export.md` returns).
    pub fn allowed(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (tq, tk) = self.block_size;
        let (nq, nk) = self.blocks;
        let cell = ((b * self.groups.1 + h) * nq + i / tq) * nk + j / tk;
        match self.mask_tile_states[cell] {
            2 => true,
            1 => {
                let id = self.mask_block_ids[cell] as usize;
                self.mask_blocks[(id * tq + i % tq) * tk + j % tk]
            }
            _ => false,
        }
    }

    fn dims(&self) -> [[usize; 4]; 2] {
        let (bg, hg) = self.groups;
        let (nq, nk) = self.blocks;
        [[bg, hg, nq, nk], [bg, hg, nk, nq]]
    }

    /// The npz member names and arrays (see `docs/export.md`).
    pub fn to_members(&self) -> Vec<(String, NpyArray)> {
        let meta = npz::meta;
        let int = |shape: &[usize], v: &[i32]| {
            NpyArray::from_ints(NpyDType::I32, shape.to_vec(), v.iter().map(|&x| x as i64))
        };
        let [kv, q] = self.dims();
        vec![
            ("tessera_export".into(), meta(&[1, 1])),
            ("meta_shape".into(), meta(&self.shape)),
            (
                "block_size".into(),
                meta(&[self.block_size.0, self.block_size.1]),
            ),
            ("seq_lengths".into(), meta(&[self.shape[2], self.shape[3]])),
            ("kv_num_blocks".into(), int(&kv[..3], &self.kv_num_blocks)),
            ("kv_indices".into(), int(&kv, &self.kv_indices)),
            (
                "full_kv_num_blocks".into(),
                int(&kv[..3], &self.full_kv_num_blocks),
            ),
            ("full_kv_indices".into(), int(&kv, &self.full_kv_indices)),
            ("q_num_blocks".into(), int(&q[..3], &self.q_num_blocks)),
            ("q_indices".into(), int(&q, &self.q_indices)),
            (
                "full_q_num_blocks".into(),
                int(&q[..3], &self.full_q_num_blocks),
            ),
            ("full_q_indices".into(), int(&q, &self.full_q_indices)),
            (
                "mask_tile_states".into(),
                NpyArray::from_ints(
                    NpyDType::I8,
                    kv.to_vec(),
                    self.mask_tile_states.iter().map(|&x| x as i64),
                ),
            ),
            ("mask_block_ids".into(), int(&kv, &self.mask_block_ids)),
            (
                "mask_blocks".into(),
                NpyArray::from_bools(
                    vec![self.num_mask_blocks(), self.block_size.0, self.block_size.1],
                    &self.mask_blocks,
                ),
            ),
        ]
    }

    /// Writes the tensors to an `.npz` at `path` atomically (temp file + rename).
    pub fn write_npz(&self, path: &Path) -> Result<()> {
        npz::write_npz(path, &self.to_members())
    }

    /// Reads tensors written by [`FlexArrays::write_npz`].
    pub fn read_npz(path: &Path) -> Result<Self> {
        let m = Members::read_export(path, [1, 1], "Flex")?;
        let s = m.meta("meta_shape", 4)?;
        let bs = m.meta("block_size", 2)?;
        let kvi = m.need("kv_indices")?;
        let (bg, hg, nq, nk) = match kvi.shape[..] {
            [a, b, c, d] => (a, b, c, d),
            _ => {
                return Err(Error::format(
                    path,
                    format!("kv_indices: expected rank 4, found {:?}", kvi.shape),
                ))
            }
        };
        let get = |name: &str, shape: &[usize]| -> Result<Vec<i32>> {
            Ok(m.ints(name, NpyDType::I32, shape)?
                .into_iter()
                .map(|v| v as i32)
                .collect())
        };
        let kv = [bg, hg, nq, nk];
        let q = [bg, hg, nk, nq];
        Ok(FlexArrays {
            shape: [s[0], s[1], s[2], s[3]],
            block_size: (bs[0], bs[1]),
            groups: (bg, hg),
            blocks: (nq, nk),
            kv_num_blocks: get("kv_num_blocks", &kv[..3])?,
            kv_indices: get("kv_indices", &kv)?,
            full_kv_num_blocks: get("full_kv_num_blocks", &kv[..3])?,
            full_kv_indices: get("full_kv_indices", &kv)?,
            q_num_blocks: get("q_num_blocks", &q[..3])?,
            q_indices: get("q_indices", &q)?,
            full_q_num_blocks: get("full_q_num_blocks", &q[..3])?,
            full_q_indices: get("full_q_indices", &q)?,
            mask_tile_states: m
                .ints("mask_tile_states", NpyDType::I8, &kv)?
                .into_iter()
                .map(|v| v as i8)
                .collect(),
            mask_block_ids: get("mask_block_ids", &kv)?,
            mask_blocks: {
                let a = m.need("mask_blocks")?;
                if a.dtype != NpyDType::Bool || a.shape.len() != 3 || a.shape[1..] != [bs[0], bs[1]]
                {
                    return Err(Error::format(
                        path,
                        format!(
                            "mask_blocks: expected bool [n, {}, {}], found {:?}",
                            bs[0], bs[1], a.shape
                        ),
                    ));
                }
                a.bytes.iter().map(|&x| x != 0).collect()
            },
        })
    }

    /// Tile states `[B', H', nq, nk]` decoded from the kv-major tensors (`q_side == false`) or
    /// from the q-major ones (`q_side == true`, transposed back). Fails when an index is out of
    /// range or a block is listed twice.
    pub fn decode_states(&self, q_side: bool) -> Result<Vec<i8>> {
        let (bg, hg) = self.groups;
        let (nq, nk) = self.blocks;
        let (rows, width) = if q_side { (nk, nq) } else { (nq, nk) };
        let (num, idx, fnum, fidx) = if q_side {
            (
                &self.q_num_blocks,
                &self.q_indices,
                &self.full_q_num_blocks,
                &self.full_q_indices,
            )
        } else {
            (
                &self.kv_num_blocks,
                &self.kv_indices,
                &self.full_kv_num_blocks,
                &self.full_kv_indices,
            )
        };
        let mut out = vec![0i8; bg * hg * nq * nk];
        for g in 0..bg * hg {
            for r in 0..rows {
                for (n, ix, state) in [(num, idx, 1i8), (fnum, fidx, 2i8)] {
                    let cnt = n[g * rows + r];
                    if cnt < 0 || cnt as usize > width {
                        return Err(Error::Internal(format!(
                            "flex decode: count {cnt} > {width}"
                        )));
                    }
                    for &c in &ix[(g * rows + r) * width..][..cnt as usize] {
                        if c < 0 || c as usize >= width {
                            return Err(Error::Internal(format!(
                                "flex decode: index {c} out of range"
                            )));
                        }
                        let (qt, kt) = if q_side {
                            (c as usize, r)
                        } else {
                            (r, c as usize)
                        };
                        let cell = (g * nq + qt) * nk + kt;
                        if out[cell] != 0 {
                            return Err(Error::Internal(format!(
                                "flex decode: block ({qt}, {kt}) listed twice"
                            )));
                        }
                        out[cell] = state;
                    }
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::ordered_row;

    #[test]
    fn ordered_rows_list_the_active_then_the_rest_ascending() {
        // Dense and sparse rows (both ways of listing the rest), lengths around word ends.
        let mut scratch = vec![u64::MAX; 3];
        for (n, pattern, sparsity) in [1usize, 2, 7, 63, 64, 65, 130, 1000]
            .into_iter()
            .flat_map(|n| (0u64..64).map(move |p| (n, p)))
            .flat_map(|(n, p)| [1u64, 3, 40].map(|s| (n, p, s)))
        {
            let active: Vec<u32> = (0..n as u32)
                .filter(|&i| {
                    let mix = (i as u64 ^ pattern).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
                    pattern.rotate_left(i * 5) & 1 == 1 && mix % sparsity == 0
                })
                .collect();
            let mut out = vec![-7];
            ordered_row(&active, n, &mut out, &mut scratch);
            let rest = (0..n as i32).filter(|i| !active.contains(&(*i as u32)));
            let want: Vec<i32> = [-7]
                .into_iter()
                .chain(active.iter().map(|&a| a as i32))
                .chain(rest)
                .collect();
            assert_eq!(out, want, "n {n} active {active:?}");
        }
    }
}
