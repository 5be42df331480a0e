//! Which keys are sink keys.

use tessera_core::{Error, Result};
use tessera_mask::{Mask, SegmentIds};

/// Sink-key flags `[batch, kv_len]` (row-major, flattened).
///
/// Key `j` of batch row `b` is a sink key when its position within its document is
/// `< sink_tokens`, where its document is the maximal run of equal kv segment id containing `j`
/// and its position is `j − (start of the run)`. Padding keys (id < 0) are never sink keys.
/// Without segment ids, key `j` is a sink key when `j < sink_tokens`. Segment ids with one row
/// are shared by every batch row. Fails when the ids do not have length `kv_len` and 1 or
/// `batch` rows.
pub fn sink_key_flags(
    kv_segments: Option<&SegmentIds>,
    batch: usize,
    kv_len: usize,
    sink_tokens: usize,
) -> Result<Vec<bool>> {
    let mut flags = vec![false; batch * kv_len];
    let Some(seg) = kv_segments else {
        for row in flags.chunks_mut(kv_len.max(1)) {
            for f in row.iter_mut().take(sink_tokens) {
                *f = true;
            }
        }
        return Ok(flags);
    };
    if seg.len() != kv_len {
        return Err(Error::invalid(
            "kv-segments",
            format!("length {kv_len} (the key length)"),
            seg.len(),
        ));
    }
    if seg.rows() != 1 && seg.rows() != batch {
        return Err(Error::invalid(
            "kv-segments",
            format!("1 or {batch} rows (the batch size)"),
            seg.rows(),
        ));
    }
    for b in 0..batch {
        let ids = seg.row(b);
        let row = &mut flags[b * kv_len..(b + 1) * kv_len];
        let mut start = 0usize;
        for j in 0..kv_len {
            if j > 0 && ids[j] != ids[j - 1] {
                start = j;
            }
            row[j] = ids[j] >= 0 && j - start < sink_tokens;
        }
    }
    Ok(flags)
}

/// The kv segment ids of the first `document` leaf of `mask` (depth-first, left to right), the
/// ids [`sink_key_flags`] should use for a document-masked problem; `None` without one.
pub fn document_kv_segments(mask: &Mask) -> Option<&SegmentIds> {
    // `nodes` walks without recursion: the mask may be any depth here.
    mask.nodes().find_map(|m| match m {
        Mask::Document(s) => Some(&s.kv),
        _ => None,
    })
}
