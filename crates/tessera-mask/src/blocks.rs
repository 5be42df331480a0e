//! Per-step block selections for the `blocks` leaf (docs/semantics.md#masks): per (batch, head, query block)
//! a list of key blocks, as a MoBA / NSA gate's top-k gives them.
//!
//! Contract: [`BlockSelection::new`] takes the array `[B, H, Tq, k]` (or `[H, Tq, k]`,
//! `[Tq, k]`: missing leading dimensions are 1) of key-block indices, `-1` meaning "none", and
//! stores each row sorted and deduplicated, so a selection's meaning does not depend on the
//! order or repetition of its entries, and its BLAKE3 digest (part of the plan contract) is a
//! function of that meaning and the block sizes alone. Query `i` may attend key `j` iff key
//! block `j / kv_block` is in the list of query block `i / q_block`. What needs the problem
//! shape (`Tq == ceil(Lq / q_block)`, entries below `ceil(Lkv / kv_block)`, dims 1 or B / H)
//! is [`BlockSelection::check`], run by `Mask::validate`. Every error names the data as
//! `kv_tiles` (with the leaf's name where it has one other than that).

use crate::syntax::dense_arg;
use tessera_core::{budget, Error, Result};

/// The name the Python API gives the data (`plan_from_blocks(mask, kv_tiles, ...)`).
const PY_NAME: &str = "kv_tiles";

/// A block selection: for each (batch, head) slice and query block, the sorted distinct key
/// blocks it keeps.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockSelection {
    batch: usize,
    heads: usize,
    rows: usize,
    k: usize,
    rank: usize,
    q_block: usize,
    kv_block: usize,
    /// Row `r` of the flattened `[batch, heads, rows]` is `tiles[offsets[r]..offsets[r + 1]]`.
    offsets: Vec<u32>,
    tiles: Vec<u32>,
    /// Largest selected key block (None when nothing is selected).
    max_tile: Option<u32>,
    digest: [u8; 32],
    slice_digests: Vec<[u8; 32]>,
    label: String,
    /// Errors name the data `kv_tiles` alone (the Python argument), whatever the text form
    /// calls it (a name made from the content, see [`BlockSelection::with_text_name`]).
    #[serde(default)]
    errors_as_argument: bool,
}

impl BlockSelection {
    /// A selection from the array `shape` (rank 2 to 4, last two dims `[Tq, k]`) of key-block
    /// indices (row-major; `-1` = none, duplicates count once) for blocks of `q_block` queries
    /// by `kv_block` keys. `label` is how the text form names it (a file path or mapping key).
    pub fn new(
        shape: &[usize],
        entries: &[i64],
        q_block: usize,
        kv_block: usize,
        label: impl Into<String>,
    ) -> Result<Self> {
        let label = label.into();
        let arg = arg_name(&label);
        let (batch, heads, rows, k) = match *shape {
            [r, k] => (1, 1, r, k),
            [h, r, k] => (1, h, r, k),
            [b, h, r, k] => (b, h, r, k),
            _ => {
                return Err(Error::invalid(
                    arg,
                    "an integer array [B, H, Tq, k] (or [H, Tq, k], [Tq, k])",
                    format!("shape {shape:?}"),
                ))
            }
        };
        if batch == 0 || heads == 0 || rows == 0 {
            return Err(Error::invalid(
                arg,
                "non-zero B, H and Tq dimensions (k may be 0)",
                format!("shape {shape:?}"),
            ));
        }
        if q_block == 0 || kv_block == 0 {
            return Err(Error::invalid(
                arg,
                "block sizes >= 1",
                format!("{q_block}x{kv_block}"),
            ));
        }
        let n_rows = batch
            .checked_mul(heads)
            .and_then(|x| x.checked_mul(rows))
            .filter(|&x| x < u32::MAX as usize);
        let n = n_rows
            .and_then(|r| r.checked_mul(k))
            .filter(|&x| x < u32::MAX as usize);
        let (Some(n_rows), Some(n)) = (n_rows, n) else {
            return Err(Error::invalid(
                arg,
                "fewer than 2^32 rows and entries",
                format!("shape {shape:?}"),
            ));
        };
        if entries.len() != n {
            return Err(Error::invalid(
                arg,
                format!("{n} entries for shape {shape:?}"),
                entries.len(),
            ));
        }
        // Row offsets and slice digests are not bounded by the entries (k may be 0).
        let index_bytes = 4 * (n_rows as u128 + 1) + 32 * (batch as u128 * heads as u128);
        budget::check(|| format!("{arg} of shape {shape:?}"), index_bytes)?;
        let mut offsets = Vec::with_capacity(n_rows + 1);
        let mut tiles = Vec::with_capacity(n);
        let mut row_buf = Vec::with_capacity(k);
        offsets.push(0u32);
        for r in 0..n_rows {
            row_buf.clear();
            for (c, &t) in entries[r * k..(r + 1) * k].iter().enumerate() {
                match t {
                    -1 => {}
                    0..=0x7fff_ffff => row_buf.push(t as u32),
                    _ => {
                        return Err(Error::invalid(
                            arg,
                            "key-block indices >= 0 (or -1 for none) below 2^31",
                            format!("{t} at {:?}", index(shape, r * k + c)),
                        ))
                    }
                }
            }
            row_buf.sort_unstable();
            row_buf.dedup();
            tiles.extend_from_slice(&row_buf);
            offsets.push(tiles.len() as u32);
        }
        let max_tile = tiles.iter().copied().max();
        let slice_digests: Vec<[u8; 32]> = (0..batch * heads)
            .map(|s| {
                let mut h = header(rows, q_block, kv_block);
                hash_rows(&mut h, &offsets[s * rows..=(s + 1) * rows], &tiles);
                *h.finalize().as_bytes()
            })
            .collect();
        // The whole selection: its shape and the slices' digests.
        let mut h = header(rows, q_block, kv_block);
        h.update(&(batch as u64).to_le_bytes());
        h.update(&(heads as u64).to_le_bytes());
        slice_digests.iter().for_each(|d| {
            h.update(d);
        });
        Ok(BlockSelection {
            batch,
            heads,
            rows,
            k,
            rank: shape.len(),
            q_block,
            kv_block,
            offsets,
            tiles,
            max_tile,
            digest: *h.finalize().as_bytes(),
            slice_digests,
            label,
            errors_as_argument: false,
        })
    }

    /// Checks the selection against a problem shape: `Tq == ceil(q_len / q_block)`, every
    /// entry below `ceil(kv_len / kv_block)`, batch and head dims 1 or the problem's.
    pub fn check(&self, batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<()> {
        let arg = || {
            if self.errors_as_argument {
                PY_NAME.to_string()
            } else {
                arg_name(&self.label)
            }
        };
        let tq = q_len.div_ceil(self.q_block);
        if self.rows != tq {
            return Err(Error::invalid(
                arg(),
                format!(
                    "{tq} query blocks (Lq {q_len} in blocks of {}) in dim -2",
                    self.q_block
                ),
                self.rows,
            ));
        }
        let tk = kv_len.div_ceil(self.kv_block);
        if let Some(m) = self.max_tile.filter(|&m| m as usize >= tk) {
            return Err(Error::invalid(
                arg(),
                format!(
                    "entries in [-1, {tk}) (Lkv {kv_len} in blocks of {})",
                    self.kv_block
                ),
                m,
            ));
        }
        for (what, have, want, dim) in [
            ("heads", self.heads, heads, -3),
            ("batch rows", self.batch, batch, -4),
        ] {
            if have != 1 && have != want {
                return Err(Error::invalid(
                    arg(),
                    format!("1 or {want} {what} in dim {dim}"),
                    have,
                ));
            }
        }
        Ok(())
    }

    /// Batch dimension (1 = shared by every batch row).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Head dimension (1 = shared by every head).
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Query blocks `Tq`.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Entries per row as given (`k`, before `-1` and duplicates were dropped).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Rank of the array as given (2, 3 or 4).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Queries per block.
    pub fn q_block(&self) -> usize {
        self.q_block
    }

    /// Keys per block.
    pub fn kv_block(&self) -> usize {
        self.kv_block
    }

    /// How the text form names the data (a file path or mapping key).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The same selection under another name in the text form (the digest covers the content
    /// and block sizes, never the name).
    pub fn with_label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// The same selection named `name` in the text form while its errors keep naming the data
    /// `kv_tiles`, the argument it came from (the Python `blocks(kv_tiles)` names it by content).
    pub fn with_text_name(mut self, name: impl Into<String>) -> Self {
        self.label = name.into();
        self.errors_as_argument = true;
        self
    }

    /// Distinct selected blocks over every row.
    pub fn selected(&self) -> usize {
        self.tiles.len()
    }

    /// BLAKE3 digest of the block sizes, shape and normalized rows (part of the plan contract).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Index of the (batch, head) slice used by batch row `b` and head `h` (broadcast over dims
    /// of size 1).
    pub fn slice_index(&self, b: usize, h: usize) -> usize {
        crate::data::slice_index(self.batch, self.heads, b, h)
    }

    /// Digest of one slice alone with the block sizes (shares plans between equal slices).
    pub fn slice_digest(&self, slice: usize) -> [u8; 32] {
        self.slice_digests.get(slice).copied().unwrap_or([0; 32])
    }

    /// The sorted distinct key blocks of query block `row` of `slice` (empty out of range).
    pub fn row(&self, slice: usize, row: usize) -> &[u32] {
        let r = slice * self.rows + row;
        if row >= self.rows || r + 1 >= self.offsets.len() {
            return &[];
        }
        &self.tiles[self.offsets[r] as usize..self.offsets[r + 1] as usize]
    }

    /// Token-level semantics on `slice`: key block `j / kv_block` is in query block
    /// `i / q_block`'s list.
    pub fn allows(&self, slice: usize, i: usize, j: usize) -> bool {
        let t = j / self.kv_block;
        t <= u32::MAX as usize
            && self
                .row(slice, i / self.q_block)
                .binary_search(&(t as u32))
                .is_ok()
    }
}

/// How errors name the data: `kv_tiles`, with the leaf's name where it has another one.
fn arg_name(label: &str) -> String {
    if label.is_empty() || label == PY_NAME {
        PY_NAME.into()
    } else {
        format!("{PY_NAME} of blocks(.., {})", dense_arg(label))
    }
}

/// The multi-index of flat position `flat` in `shape`.
fn index(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    for (o, &d) in out.iter_mut().zip(shape).rev() {
        *o = flat % d.max(1);
        flat /= d.max(1);
    }
    out
}

fn header(rows: usize, q_block: usize, kv_block: usize) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    h.update(b"blocks");
    for d in [rows, q_block, kv_block] {
        h.update(&(d as u64).to_le_bytes());
    }
    h
}

/// Hashes the rows delimited by `offsets` (their lengths, then their entries) in one update.
fn hash_rows(h: &mut blake3::Hasher, offsets: &[u32], tiles: &[u32]) {
    let (a, b) = (offsets[0] as usize, offsets[offsets.len() - 1] as usize);
    let mut bytes = Vec::with_capacity(4 * (offsets.len() + b - a));
    for w in offsets.windows(2) {
        bytes.extend_from_slice(&(w[1] - w[0]).to_le_bytes());
    }
    for t in &tiles[a..b] {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    h.update(&bytes);
}
