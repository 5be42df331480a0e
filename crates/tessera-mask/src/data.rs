//! Data-carrying leaves: segment ids for `document`, integer features for `band` and boolean
//! arrays for `dense`.
//!
//! Contract: constructors validate shapes; each value carries a BLAKE3 digest of its content so
//! canonical forms and contract keys change whenever the data changes.

use std::sync::Arc;
use tessera_core::{Error, Result};

/// Per-token integers of one side (queries or keys): `rows` rows (1 = shared by every batch row)
/// of `len` values. As segment ids (`document`) a negative id is padding and matches nothing; as
/// the features of a `band` leaf every value is an ordinary integer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SegmentIds {
    rows: usize,
    len: usize,
    ids: Vec<i64>,
    digest: [u8; 32],
    /// Digest of each row alone (planning compares rows once per (batch row, head)).
    row_digests: Vec<[u8; 32]>,
    /// The smallest and largest id, found with the digest (exporters ask for them per export).
    span: (i64, i64),
}

/// Little-endian bytes of `ids`, for hashing in one update (per-id updates cost more than
/// the hashing itself).
fn le_bytes(ids: &[i64]) -> Vec<u8> {
    ids.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl SegmentIds {
    /// Segment ids shaped `[rows, len]` (row-major).
    pub fn new(rows: usize, len: usize, ids: Vec<i64>) -> Result<Self> {
        Self::named("segments", rows, len, ids)
    }

    /// Values shaped `[rows, len]` (row-major); errors name the argument `arg`.
    pub fn named(arg: &str, rows: usize, len: usize, ids: Vec<i64>) -> Result<Self> {
        if rows == 0 || len == 0 {
            return Err(Error::invalid(
                arg,
                "a non-empty [B, L] or [L] array",
                format!("shape [{rows}, {len}]"),
            ));
        }
        if ids.len() != rows * len {
            return Err(Error::invalid(
                arg,
                format!("{} ids for shape [{rows}, {len}]", rows * len),
                ids.len(),
            ));
        }
        let bytes = le_bytes(&ids);
        let mut h = blake3::Hasher::new();
        h.update(&(rows as u64).to_le_bytes());
        h.update(&(len as u64).to_le_bytes());
        h.update(&bytes);
        let row_digests = bytes
            .chunks(8 * len)
            .map(|r| *blake3::hash(r).as_bytes())
            .collect();
        let span = ids
            .iter()
            .fold((i64::MAX, i64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        Ok(SegmentIds {
            rows,
            len,
            ids,
            digest: *h.finalize().as_bytes(),
            row_digests,
            span,
        })
    }

    /// One row shared by every batch row.
    pub fn shared(ids: Vec<i64>) -> Result<Self> {
        let len = ids.len();
        Self::new(1, len, ids)
    }

    /// Batch rows held (1 when shared by every row).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per row.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when rows have no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every stored id, row after row (`rows() x len()`).
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// `(smallest, largest)` of every stored id (never empty: a constructor refuses no ids).
    pub fn span(&self) -> (i64, i64) {
        self.span
    }

    /// The ids of batch row `b` (row 0 when the ids are shared).
    pub fn row(&self, b: usize) -> &[i64] {
        let r = if self.rows == 1 { 0 } else { b };
        &self.ids[r * self.len..(r + 1) * self.len]
    }

    /// BLAKE3 digest of the shape and ids (part of the plan contract).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Digest of batch row `b` alone (used to share plans between identical rows).
    pub fn row_digest(&self, b: usize) -> [u8; 32] {
        let r = if self.rows == 1 { 0 } else { b };
        self.row_digests[r]
    }
}

/// Query-side and key-side segment ids of a `document` leaf.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segments {
    /// Segment ids of the queries.
    pub q: SegmentIds,
    /// Segment ids of the keys.
    pub kv: SegmentIds,
    /// How the text form names the query-side and key-side ids (`document(Q, KV)`, or
    /// `document(Q)` when both are the same name); `None` prints the bare `document`, whose ids
    /// come from the resolver's one unnamed set (`--segments`, Python `segments=`).
    #[serde(default)]
    pub names: Option<(String, String)>,
}

impl Segments {
    /// Self-attention: queries and keys share the same ids.
    pub fn shared(ids: SegmentIds) -> Arc<Self> {
        Arc::new(Segments {
            q: ids.clone(),
            kv: ids,
            names: None,
        })
    }

    /// Cross attention with separate query and key ids.
    pub fn cross(q: SegmentIds, kv: SegmentIds) -> Result<Arc<Self>> {
        if q.rows != kv.rows && q.rows != 1 && kv.rows != 1 {
            return Err(Error::invalid(
                "kv-segments",
                format!("1 or {} rows (as q-segments)", q.rows),
                kv.rows,
            ));
        }
        Ok(Arc::new(Segments { q, kv, names: None }))
    }

    /// Segment ids named in the text form: `q` named `q_name`, `kv` named `kv_name` (the same
    /// name for self-attention prints `document(NAME)`); row counts checked as [`Segments::cross`].
    pub fn named(
        q_name: impl Into<String>,
        q: SegmentIds,
        kv_name: impl Into<String>,
        kv: SegmentIds,
    ) -> Result<Arc<Self>> {
        let mut s = Arc::unwrap_or_clone(Self::cross(q, kv)?);
        s.names = Some((q_name.into(), kv_name.into()));
        Ok(Arc::new(s))
    }

    /// Batch rows covered: the larger of the two sides.
    pub fn rows(&self) -> usize {
        self.q.rows.max(self.kv.rows)
    }
}

/// The per-token integer features of a `band` leaf: `q` for the queries (rows of the mask) and
/// `kv` for the keys (columns), each `[1 or B, L]` like segment ids, with the names the text form
/// writes (`band(q_name, kv_name, lo, hi)`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BandFeatures {
    /// Query-side feature `f`.
    pub q: SegmentIds,
    /// Key-side feature `g`.
    pub kv: SegmentIds,
    /// How the text form names `q` (a file path, or a key of the Python `features=` mapping).
    pub q_name: String,
    /// How the text form names `kv`.
    pub kv_name: String,
}

impl BandFeatures {
    /// Features `f` (named `q_name`) and `g` (named `kv_name`).
    pub fn new(
        q_name: impl Into<String>,
        q: SegmentIds,
        kv_name: impl Into<String>,
        kv: SegmentIds,
    ) -> Arc<Self> {
        Arc::new(BandFeatures {
            q,
            kv,
            q_name: q_name.into(),
            kv_name: kv_name.into(),
        })
    }

    /// Batch rows covered: the larger of the two sides.
    pub fn rows(&self) -> usize {
        self.q.rows.max(self.kv.rows)
    }
}

/// A boolean mask array shaped `[Lq, Lkv]`, `[H, Lq, Lkv]` or `[B, H, Lq, Lkv]`, bit-packed by row.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DenseMask {
    batch: usize,
    heads: usize,
    rank: usize,
    q_len: usize,
    kv_len: usize,
    words_per_row: usize,
    bits: Vec<u64>,
    digest: [u8; 32],
    label: String,
}

impl DenseMask {
    /// Builds a dense mask from a shape (rank 2, 3 or 4) and one bool per element (row-major).
    /// `label` is how the text form names it (usually the file path).
    pub fn new(shape: &[usize], values: &[bool], label: impl Into<String>) -> Result<Self> {
        let (batch, heads, q_len, kv_len) = dense_dims(shape)?;
        let n = batch * heads * q_len * kv_len;
        if values.len() != n {
            return Err(Error::invalid(
                "dense mask",
                format!("{n} values for shape {shape:?}"),
                values.len(),
            ));
        }
        let words_per_row = kv_len.div_ceil(64);
        let rows = batch * heads * q_len;
        let mut bits = vec![0u64; rows * words_per_row];
        for r in 0..rows {
            let src = &values[r * kv_len..(r + 1) * kv_len];
            let dst = &mut bits[r * words_per_row..(r + 1) * words_per_row];
            for (j, &v) in src.iter().enumerate() {
                if v {
                    dst[j / 64] |= 1u64 << (j % 64);
                }
            }
        }
        Ok(Self::from_parts(
            shape.len(),
            (batch, heads, q_len, kv_len),
            bits,
            label,
        ))
    }

    /// The dense mask of `shape` (rank 2, 3 or 4) from its rows already packed as this type
    /// stores them: per row `ceil(Lkv / 64)` words, bit `j % 64` of word `j / 64` is key `j`.
    /// Bits past `Lkv` must be clear (they would change the digest, not the mask), so the
    /// result equals [`DenseMask::new`] of the same values. Costs `Lq·Lkv/8` bytes per slice,
    /// against `new`'s one bool per pair on the way in.
    pub fn from_words(shape: &[usize], words: Vec<u64>, label: impl Into<String>) -> Result<Self> {
        let (batch, heads, q_len, kv_len) = dense_dims(shape)?;
        let words_per_row = kv_len.div_ceil(64);
        let n = batch * heads * q_len * words_per_row;
        if words.len() != n {
            return Err(Error::invalid(
                "dense mask",
                format!("{n} words for shape {shape:?} (ceil(Lkv / 64) per row)"),
                words.len(),
            ));
        }
        if kv_len % 64 != 0 {
            let pad = !0u64 << (kv_len % 64);
            if let Some(r) = words
                .chunks(words_per_row)
                .position(|row| row[words_per_row - 1] & pad != 0)
            {
                return Err(Error::invalid(
                    "dense mask",
                    format!("clear bits past Lkv = {kv_len} in every row"),
                    format!("set bits in row {r}"),
                ));
            }
        }
        Ok(Self::from_parts(
            shape.len(),
            (batch, heads, q_len, kv_len),
            words,
            label,
        ))
    }

    /// The mask of packed `bits` (validated) with its digest.
    fn from_parts(
        rank: usize,
        (batch, heads, q_len, kv_len): (usize, usize, usize, usize),
        bits: Vec<u64>,
        label: impl Into<String>,
    ) -> Self {
        let mut h = blake3::Hasher::new();
        for d in [rank, batch, heads, q_len, kv_len] {
            h.update(&(d as u64).to_le_bytes());
        }
        // The words' bytes in blocks: per-word updates cost more than the hashing itself.
        let mut buf = Vec::with_capacity(8 * 4096);
        for block in bits.chunks(4096) {
            buf.clear();
            buf.extend(block.iter().flat_map(|w| w.to_le_bytes()));
            h.update(&buf);
        }
        DenseMask {
            batch,
            heads,
            rank,
            q_len,
            kv_len,
            words_per_row: kv_len.div_ceil(64),
            bits,
            digest: *h.finalize().as_bytes(),
            label: label.into(),
        }
    }

    /// Batch dimension (1 unless the array is 4-d).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Head dimension (1 for a 2-d array).
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Rank of the array as given (2, 3 or 4).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Query length.
    pub fn q_len(&self) -> usize {
        self.q_len
    }

    /// Key length.
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }

    /// Where the array came from (its file name), for the canonical text.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The same array under another name in the text form (the digest is unchanged: it covers
    /// the content, never the name).
    pub fn with_label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// BLAKE3 digest of the shape and bits (part of the plan contract).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Index of the (batch, head) slice used for query batch `b` and head `h` (broadcast over
    /// missing leading dimensions).
    pub fn slice_index(&self, b: usize, h: usize) -> usize {
        slice_index(self.batch, self.heads, b, h)
    }

    /// The packed bit row `i` of slice `slice` (bit `j % 64` of word `j / 64` is key `j`).
    pub fn row_bits(&self, slice: usize, i: usize) -> &[u64] {
        let r = slice * self.q_len + i;
        &self.bits[r * self.words_per_row..(r + 1) * self.words_per_row]
    }

    /// Token-level lookup.
    pub fn get(&self, slice: usize, i: usize, j: usize) -> bool {
        (self.row_bits(slice, i)[j / 64] >> (j % 64)) & 1 == 1
    }

    /// Digest of one slice alone (used to share plans between identical heads).
    pub fn slice_digest(&self, slice: usize) -> [u8; 32] {
        let n = self.q_len * self.words_per_row;
        let mut h = blake3::Hasher::new();
        for w in &self.bits[slice * n..(slice + 1) * n] {
            h.update(&w.to_le_bytes());
        }
        *h.finalize().as_bytes()
    }
}

/// Index of the (batch, head) slice of data shaped `[batch, heads, ..]` that batch row `b` and
/// head `h` use: a dimension of 1 is shared (broadcast).
pub(crate) fn slice_index(batch: usize, heads: usize, b: usize, h: usize) -> usize {
    let b = if batch == 1 { 0 } else { b };
    let h = if heads == 1 { 0 } else { h };
    b * heads + h
}

/// `(batch, heads, q_len, kv_len)` of a dense mask's shape (rank 2, 3 or 4, no zero dimension).
fn dense_dims(shape: &[usize]) -> Result<(usize, usize, usize, usize)> {
    let dims = match *shape {
        [l, m] => (1, 1, l, m),
        [h, l, m] => (1, h, l, m),
        [b, h, l, m] => (b, h, l, m),
        _ => {
            return Err(Error::invalid(
                "dense mask",
                "shape [Lq, Lkv], [H, Lq, Lkv] or [B, H, Lq, Lkv]",
                format!("{shape:?}"),
            ))
        }
    };
    if shape.contains(&0) {
        return Err(Error::invalid(
            "dense mask",
            "non-zero dimensions",
            format!("{shape:?}"),
        ));
    }
    // The element count must fit (the packed rows are allocated from it).
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if n.is_none() {
        return Err(Error::invalid(
            "dense mask",
            "fewer than 2^64 elements",
            format!("{shape:?}"),
        ));
    }
    Ok(dims)
}
