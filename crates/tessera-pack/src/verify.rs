//! Checking packed rows.
//!
//! Contract: [`verify_packed`] accepts a file exactly when it could have been produced by this
//! crate's packer, and otherwise names the row and column of the first violation in row-major
//! order.

use crate::{PackStats, Packed, PAD_SEGMENT, PAD_TOKEN};
use std::path::Path;
use tessera_core::{Error, Result, Tensor, TensorData};

/// The first violation found.
pub(crate) struct Violation {
    pub row: usize,
    pub col: usize,
    pub msg: String,
}

/// Re-reads a packed `.safetensors` file and checks every invariant:
///
/// - tensors `tokens`, `segment_ids` and `positions` exist, are i32 and share one shape
///   `[N, L]` with `L >= 2`;
/// - every row starts with a document (segment id 0 at column 0), segment ids are -1 or
///   non-negative, and each new segment in a row has the previous id plus one (ids 0, 1, 2, ...
///   in column order, each segment contiguous);
/// - at every segment start the token is BOS and the position is 0; within a segment positions
///   increase by one per column;
/// - padding (segment id -1) appears only as a row's tail, with token 0 and position 0.
///
/// BOS is taken from the first token of the file (the start of row 0); use
/// [`verify_packed_with`] to require a specific id. The returned statistics count segments as
/// documents (a split piece is indistinguishable from a whole document), with
/// `split_documents` and `empty_documents_skipped` set to 0.
pub fn verify_packed(path: &Path) -> Result<PackStats> {
    verify_packed_with(path, None)
}

/// [`verify_packed`], additionally requiring BOS to be `bos` when given.
pub fn verify_packed_with(path: &Path, bos: Option<u32>) -> Result<PackStats> {
    let mut tensors = tessera_io::read_safetensors(path)?;
    let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
    // Take the tensors out by value so the check needs no second copy of the rows.
    let mut take = |name: &str| -> Result<Tensor> {
        match tensors.iter().position(|(n, _)| n == name) {
            Some(i) => Ok(tensors.swap_remove(i).1),
            None => Err(Error::format(
                path,
                format!(
                    "missing tensor '{name}' (found: {}); is this a packed file?",
                    names.join(", ")
                ),
            )),
        }
    };
    let loaded = [take("tokens")?, take("segment_ids")?, take("positions")?];
    let shape = loaded[0].shape().to_vec();
    if shape.len() != 2 || shape[1] < 2 {
        return Err(Error::format(
            path,
            format!("tokens: expected shape [N, L] with L >= 2, found {shape:?}"),
        ));
    }
    let mut arrays = Vec::with_capacity(3);
    for (name, t) in ["tokens", "segment_ids", "positions"]
        .into_iter()
        .zip(loaded)
    {
        if t.shape() != shape.as_slice() {
            return Err(Error::format(
                path,
                format!(
                    "{name}: expected shape {shape:?} like tokens, found {:?}",
                    t.shape()
                ),
            ));
        }
        match t.into_data() {
            TensorData::I32(v) => arrays.push(v),
            other => {
                return Err(Error::format(
                    path,
                    format!("{name}: expected dtype i32, found {}", other.dtype()),
                ))
            }
        }
    }
    let mut arrays = arrays.into_iter();
    let (Some(tokens), Some(segment_ids), Some(positions)) =
        (arrays.next(), arrays.next(), arrays.next())
    else {
        return Err(Error::Internal("verify: lost a tensor".into()));
    };
    let packed = Packed {
        tokens,
        segment_ids,
        positions,
        rows: shape[0],
        seq_len: shape[1],
        stats: PackStats::default_for(shape[0], shape[1]),
    };
    check_arrays(&packed, bos)
        .map_err(|v| Error::format(path, format!("row {}, column {}: {}", v.row, v.col, v.msg)))
}

impl PackStats {
    fn default_for(rows: usize, seq_len: usize) -> Self {
        PackStats {
            rows,
            seq_len,
            documents: 0,
            pieces: 0,
            tokens: 0,
            padding_tokens: 0,
            padding_pct: 0.0,
            split_documents: 0,
            empty_documents_skipped: 0,
        }
    }
}

/// Checks the layout invariants of in-memory rows; see [`verify_packed`].
pub(crate) fn check_arrays(
    p: &Packed,
    bos: Option<u32>,
) -> std::result::Result<PackStats, Violation> {
    let l = p.seq_len;
    let (tok, seg, pos) = (&p.tokens, &p.segment_ids, &p.positions);
    let n = p.rows * l;
    if l < 2 || tok.len() != n || seg.len() != n || pos.len() != n {
        return Err(Violation {
            row: 0,
            col: 0,
            msg: format!(
                "arrays of {}, {}, {} elements do not match {} rows of {l}",
                tok.len(),
                seg.len(),
                pos.len(),
                p.rows
            ),
        });
    }
    let bos: i64 = match bos {
        Some(b) => b as i64,
        None => tok.first().map(|&t| t as i64).unwrap_or(0),
    };
    let (mut pieces, mut packed_tokens) = (0usize, 0usize);
    for r in 0..p.rows {
        let at = |c: usize, msg: String| Violation {
            row: r,
            col: c,
            msg,
        };
        let base = r * l;
        let mut in_pad = false;
        let mut cur = -1i32;
        let mut prev_pos = 0i32;
        for c in 0..l {
            let (t, s, q) = (tok[base + c], seg[base + c], pos[base + c]);
            if s < PAD_SEGMENT {
                return Err(at(
                    c,
                    format!("segment id {s} (expected -1 for padding or >= 0)"),
                ));
            }
            if s == PAD_SEGMENT {
                if c == 0 {
                    return Err(at(c, "row holds no document (padding at column 0)".into()));
                }
                if t != PAD_TOKEN {
                    return Err(at(c, format!("padding token {t}, expected {PAD_TOKEN}")));
                }
                if q != 0 {
                    return Err(at(c, format!("padding position {q}, expected 0")));
                }
                in_pad = true;
                continue;
            }
            if in_pad {
                return Err(at(
                    c,
                    format!("segment id {s} after padding (padding may only end a row)"),
                ));
            }
            packed_tokens += 1;
            if s != cur {
                let want = cur + 1;
                if s != want {
                    return Err(at(
                        c,
                        format!("segment id {s}, expected {want} (ids count 0, 1, 2, ... within a row, each segment contiguous)"),
                    ));
                }
                if q != 0 {
                    return Err(at(
                        c,
                        format!("document start has position {q}, expected 0"),
                    ));
                }
                if t as i64 != bos {
                    return Err(at(
                        c,
                        format!("document start has token {t}, expected BOS {bos}"),
                    ));
                }
                cur = s;
                pieces += 1;
            } else if q != prev_pos.wrapping_add(1) {
                return Err(at(
                    c,
                    format!(
                        "position {q}, expected {} (one more than the previous column)",
                        prev_pos.wrapping_add(1)
                    ),
                ));
            }
            prev_pos = q;
        }
    }
    let padding = n - packed_tokens;
    Ok(PackStats {
        rows: p.rows,
        seq_len: l,
        documents: pieces,
        pieces,
        tokens: packed_tokens - pieces,
        padding_tokens: padding,
        padding_pct: PackStats::padding_pct_of(padding, p.rows, l),
        split_documents: 0,
        empty_documents_skipped: 0,
    })
}
