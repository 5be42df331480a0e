//! Document packing into fixed-length rows with segment ids and positions (docs/semantics.md#packing).
//!
//! # Contract
//!
//! **Vocabulary.** Token ids are non-negative `i32`. JSON lines with `{"text": "..."}` are
//! tokenized at byte level: token = byte value (0..=255) of the UTF-8 text, so the vocabulary is
//! 257 ids with BOS = 256 by default ([`DEFAULT_BOS`], configurable). `{"tokens": [...]}` lines and
//! tokens `.npy` files carry ids directly (any id in `0..=i32::MAX`).
//!
//! **Documents and pieces.** Every non-empty document of `n` tokens becomes `n + 1` tokens with a
//! BOS in front. When that does not fit in a row of `seq_len` (`L`) tokens, the document is split
//! into `ceil(n / (L - 1))` pieces: each piece is BOS followed by the next `L - 1` document tokens
//! (the last piece takes the rest), so *every* piece starts with BOS and its positions restart at
//! 0. A piece is the packing unit: it is never split across rows. Empty documents (no tokens) are
//! skipped and counted. `L` must be at least 2.
//!
//! **Layout.** The output is three row-major `[N, L]` i32 arrays: `tokens`, `segment_ids` and
//! `positions`. Within a row, pieces are laid out left to right with segment ids 0, 1, 2, ...;
//! positions count 0, 1, 2, ... from each piece's BOS. The tail of a row that no piece fills is
//! padding: token [`PAD_TOKEN`] (0), segment id [`PAD_SEGMENT`] (-1), position 0. Every row holds
//! at least one piece.
//!
//! **Strategies.** [`Strategy::Greedy`] places pieces in input order, appending to the current
//! row and starting a new row when a piece does not fit. [`Strategy::BestFit`] (default) is
//! best-fit decreasing: pieces sorted by length (longest first, input order breaking ties), each
//! put in the open row with the least remaining room that still fits it (lowest row index on
//! ties), found in O(log n) in a B-tree keyed by remaining capacity; O(n log n) overall. BFD is not
//! optimal, and on rare small inputs an in-order placement happens to need fewer rows; best-fit
//! then keeps the greedy placement, so best-fit never uses more rows than greedy.
//!
//! **Streaming.** The corpus is read twice and never held whole: pass 1 records only piece
//! lengths (4 bytes per piece) and places them, pass 2 re-reads the input one document at a time
//! and writes tokens into the output rows, which are held in memory (`12 * N * L` bytes). A file
//! that changes between the passes is an error. The output is deterministic.
//!
//! ```
//! use tessera_pack::{pack_docs, PackConfig, PAD_SEGMENT};
//!
//! let cfg = PackConfig { seq_len: 8, ..PackConfig::default() };
//! let packed = pack_docs(&[vec![5, 6, 7], vec![8, 9]], &cfg)?;
//! // One row: BOS 5 6 7 | BOS 8 9 | padding (BOS = 256).
//! assert_eq!(packed.rows, 1);
//! assert_eq!(packed.tokens, [256, 5, 6, 7, 256, 8, 9, 0]);
//! assert_eq!(packed.segment_ids, [0, 0, 0, 0, 1, 1, 1, PAD_SEGMENT]);
//! assert_eq!(packed.positions, [0, 1, 2, 3, 0, 1, 2, 0]);
//! # Ok::<(), tessera_core::Error>(())
//! ```
//!
//! **Invariants** (checked by [`verify_packed`] and, in tests, on every packing): see
//! [`verify_packed`].

mod input;
mod place;
mod verify;

pub use verify::{verify_packed, verify_packed_with};

use serde::Serialize;
use std::path::Path;
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{Error, Result};

/// Default BOS id: one past the 256 byte tokens of the byte-level vocabulary.
pub const DEFAULT_BOS: u32 = 256;
/// Token id stored in padding slots (they are identified by [`PAD_SEGMENT`], not by this id).
pub const PAD_TOKEN: i32 = 0;
/// Segment id of padding slots.
pub const PAD_SEGMENT: i32 = -1;

/// How pieces are assigned to rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Best-fit decreasing (fewest rows in practice; default).
    #[default]
    BestFit,
    /// In input order, a new row whenever the next piece does not fit.
    Greedy,
}

impl Strategy {
    /// The command-line spelling (`best-fit`, `greedy`).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::BestFit => "best-fit",
            Strategy::Greedy => "greedy",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "best-fit" => Ok(Strategy::BestFit),
            "greedy" => Ok(Strategy::Greedy),
            other => Err(Error::invalid("strategy", "best-fit or greedy", other)),
        }
    }
}

/// Packing options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackConfig {
    /// Row length `L` (at least 2: BOS plus one token).
    pub seq_len: usize,
    /// Row assignment strategy.
    pub strategy: Strategy,
    /// BOS token id put at the start of every piece (at most `i32::MAX`).
    pub bos: u32,
}

impl Default for PackConfig {
    fn default() -> Self {
        PackConfig {
            seq_len: 2048,
            strategy: Strategy::BestFit,
            bos: DEFAULT_BOS,
        }
    }
}

impl PackConfig {
    fn validate(&self) -> Result<()> {
        if self.seq_len < 2 {
            return Err(Error::invalid(
                "seq_len",
                "a row length of at least 2 (BOS plus one token)",
                self.seq_len,
            ));
        }
        if self.seq_len > i32::MAX as usize {
            return Err(Error::invalid(
                "seq_len",
                format!("at most {}", i32::MAX),
                self.seq_len,
            ));
        }
        if self.bos > i32::MAX as u32 {
            return Err(Error::invalid(
                "bos",
                format!("a token id in 0..={}", i32::MAX),
                self.bos,
            ));
        }
        Ok(())
    }
}

/// What a packing produced (or what [`verify_packed`] found in a file).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PackStats {
    /// Rows `N`.
    pub rows: usize,
    /// Row length `L`.
    pub seq_len: usize,
    /// Non-empty documents packed. [`verify_packed`] cannot tell a split piece from a whole
    /// document and reports the number of pieces here.
    pub documents: usize,
    /// Pieces (segments) in the output: documents plus the extra pieces of split documents.
    pub pieces: usize,
    /// Document tokens packed, BOS excluded.
    pub tokens: usize,
    /// Padding slots (`N * L - tokens - pieces`).
    pub padding_tokens: usize,
    /// Padding as a percentage of all `N * L` slots (0 when there are no rows).
    pub padding_pct: f64,
    /// Documents split into more than one piece (0 from [`verify_packed`]).
    pub split_documents: usize,
    /// Empty documents skipped (0 from [`verify_packed`]).
    pub empty_documents_skipped: usize,
}

impl PackStats {
    pub(crate) fn padding_pct_of(padding: usize, rows: usize, seq_len: usize) -> f64 {
        let slots = rows as f64 * seq_len as f64;
        if slots == 0.0 {
            0.0
        } else {
            100.0 * padding as f64 / slots
        }
    }

    /// One human-readable line, e.g.
    /// `packed 312 documents (401234 tokens) into 201 rows of 2048: padding 2.1%, 14 split, 0 empty skipped`.
    pub fn summary(&self) -> String {
        format!(
            "packed {} documents ({} tokens) into {} rows of {}: padding {:.1}%, {} split, {} empty skipped",
            self.documents,
            self.tokens,
            self.rows,
            self.seq_len,
            self.padding_pct,
            self.split_documents,
            self.empty_documents_skipped
        )
    }
}

/// Packed rows: three row-major `[rows, seq_len]` arrays and the statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Token ids, `[rows, seq_len]` row-major.
    pub tokens: Vec<i32>,
    /// Segment ids (0, 1, ... per row; [`PAD_SEGMENT`] for padding).
    pub segment_ids: Vec<i32>,
    /// Position of each token in its piece (0 at each BOS, 0 for padding).
    pub positions: Vec<i32>,
    /// Rows `N`.
    pub rows: usize,
    /// Row length `L`.
    pub seq_len: usize,
    /// The statistics of the run.
    pub stats: PackStats,
}

impl Packed {
    /// Checks every layout invariant (see [`verify_packed`]) on the in-memory arrays. A violation
    /// here is a packer bug, so it is reported as [`Error::Internal`].
    pub fn check(&self, bos: u32) -> Result<PackStats> {
        verify::check_arrays(self, Some(bos)).map_err(|v| {
            Error::Internal(format!(
                "packed rows violate an invariant at row {}, column {}: {}",
                v.row, v.col, v.msg
            ))
        })
    }
}

/// How far a packing run has got, reported to the callback of [`pack_jsonl_with_progress`] and
/// [`pack_npy_with_progress`] (the library never draws anything itself). Each pass over an input
/// file is one `Begin`, then `Advance`s adding up to `total`, then one `End`: two passes of
/// `total` = file bytes for JSON lines, one pass of `total` = tokens for a tokens `.npy` (its
/// first pass reads only the offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress<'a> {
    /// A pass starts: what it is (`pack pass 1/2`, ...) and how many units it will do.
    Begin {
        /// Short name of the pass.
        label: &'a str,
        /// Units of work in the pass (bytes or tokens).
        total: u64,
    },
    /// This many more units are done.
    Advance(u64),
    /// The pass is over.
    End,
}

/// Packs a JSON-lines file: one document per line, `{"tokens": [ids...]}` or `{"text": "..."}`
/// (byte-level). Other keys are ignored; blank lines are skipped. Errors name the 1-based line.
pub fn pack_jsonl(path: &Path, cfg: &PackConfig) -> Result<Packed> {
    pack_jsonl_with_progress(path, cfg, &mut |_| {})
}

/// [`pack_jsonl`], reporting [`Progress`] to `progress`.
pub fn pack_jsonl_with_progress(
    path: &Path,
    cfg: &PackConfig,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Packed> {
    cfg.validate()?;
    pack_source(&mut input::Jsonl::new(path)?, cfg, progress)
}

/// Packs a 1-d integer tokens `.npy` with document boundaries from a 1-d integer offsets `.npy`
/// (length ndocs+1, starting at 0, non-decreasing, last == number of tokens). Document `d` is
/// `tokens[offsets[d]..offsets[d+1]]`.
pub fn pack_npy(tokens_path: &Path, offsets_path: &Path, cfg: &PackConfig) -> Result<Packed> {
    pack_npy_with_progress(tokens_path, offsets_path, cfg, &mut |_| {})
}

/// [`pack_npy`], reporting [`Progress`] to `progress`.
pub fn pack_npy_with_progress(
    tokens_path: &Path,
    offsets_path: &Path,
    cfg: &PackConfig,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Packed> {
    cfg.validate()?;
    let mut src = input::NpyDocs::new(tokens_path, offsets_path)?;
    pack_source(&mut src, cfg, progress)
}

/// Packs in-memory documents (token ids must be non-negative). Same rules as the file packers.
pub fn pack_docs(docs: &[Vec<i32>], cfg: &PackConfig) -> Result<Packed> {
    cfg.validate()?;
    pack_source(&mut input::Memory(docs), cfg, &mut |_| {})
}

/// Writes packed rows as `.safetensors` with i32 tensors `tokens`, `segment_ids` and
/// `positions`, each `[rows, seq_len]`, atomically.
pub fn write_packed(path: &Path, packed: &Packed) -> Result<()> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("safetensors") {
        return Err(Error::invalid(
            "output",
            "a path ending in .safetensors",
            path.display(),
        ));
    }
    let n = packed.rows.checked_mul(packed.seq_len);
    for (name, v) in [
        ("tokens", &packed.tokens),
        ("segment_ids", &packed.segment_ids),
        ("positions", &packed.positions),
    ] {
        if n != Some(v.len()) {
            return Err(Error::invalid(
                format!("packed {name}"),
                format!("{} x {} elements", packed.rows, packed.seq_len),
                v.len(),
            ));
        }
    }
    let shape = [packed.rows, packed.seq_len];
    fn view<'a>(shape: &'a [usize], v: &'a [i32]) -> TensorView<'a> {
        TensorView {
            shape,
            data: ViewData::I32(v),
        }
    }
    let views = [
        ("tokens", view(&shape, &packed.tokens)),
        ("segment_ids", view(&shape, &packed.segment_ids)),
        ("positions", view(&shape, &packed.positions)),
    ];
    tessera_io::write_safetensors_views(path, &views)
}

/// The two-pass engine shared by every input kind.
fn pack_source(
    src: &mut dyn input::Source,
    cfg: &PackConfig,
    progress: input::OnProgress,
) -> Result<Packed> {
    let l = cfg.seq_len;
    let content = l - 1; // document tokens per piece after its BOS

    // Pass 1: piece lengths only.
    let mut pieces: Vec<u32> = Vec::new();
    let (mut documents, mut tokens, mut split, mut empty) = (0usize, 0usize, 0usize, 0usize);
    src.lengths(
        &mut |n| {
            if n == 0 {
                empty += 1;
                return Ok(());
            }
            documents += 1;
            tokens += n;
            let k = n.div_ceil(content);
            if k > 1 {
                split += 1;
            }
            for i in 0..k {
                let take = content.min(n - i * content);
                pieces.push((take + 1) as u32);
            }
            Ok(())
        },
        progress,
    )?;

    let placement = place::place(&pieces, l as u32, cfg.strategy);
    let rows = placement.rows;
    let slots = rows
        .checked_mul(l)
        .filter(|&s| s <= isize::MAX as usize / 4)
        .ok_or_else(|| {
            Error::invalid(
                "packed output",
                "rows x seq_len that fits in memory",
                format!("{rows} x {l}"),
            )
        })?;
    // Three i32 arrays of `slots` each: refused up front when over the memory budget.
    tessera_core::budget::check(
        || format!("packed output of {rows} rows x {l} tokens (--seq-len)"),
        12 * slots as u128,
    )?;
    let mut out_tokens = vec![PAD_TOKEN; slots];
    let mut out_segments = vec![PAD_SEGMENT; slots];
    let mut out_positions = vec![0i32; slots];

    // Pass 2: tokens, written straight into their slots.
    let bos = cfg.bos as i32;
    let mut next_piece = 0usize;
    let src_path = src.path().to_path_buf();
    let changed = || {
        Error::format(
            &src_path,
            "input changed between the two packing passes (pack a file that is not being written)",
        )
    };
    src.docs(
        &mut |doc| {
            for chunk in doc.chunks(content) {
                let slot = placement.slots.get(next_piece).ok_or_else(changed)?;
                if pieces[next_piece] as usize != chunk.len() + 1 {
                    return Err(changed());
                }
                next_piece += 1;
                let base = slot.row as usize * l + slot.col as usize;
                let seg = slot.seg as i32;
                out_tokens[base] = bos;
                out_tokens[base + 1..base + 1 + chunk.len()].copy_from_slice(chunk);
                for (j, p) in out_positions[base..base + 1 + chunk.len()]
                    .iter_mut()
                    .enumerate()
                {
                    *p = j as i32;
                }
                out_segments[base..base + 1 + chunk.len()].fill(seg);
            }
            Ok(())
        },
        progress,
    )?;
    if next_piece != pieces.len() {
        return Err(changed());
    }

    let padding = slots - tokens - pieces.len();
    let stats = PackStats {
        rows,
        seq_len: l,
        documents,
        pieces: pieces.len(),
        tokens,
        padding_tokens: padding,
        padding_pct: PackStats::padding_pct_of(padding, rows, l),
        split_documents: split,
        empty_documents_skipped: empty,
    };
    Ok(Packed {
        tokens: out_tokens,
        segment_ids: out_segments,
        positions: out_positions,
        rows,
        seq_len: l,
        stats,
    })
}
