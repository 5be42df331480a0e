//! Masking inside partial tiles: the one place where a pair of a partial tile is excluded.
//!
//! Contract: [`mask_partial_row`] sets every entry of a score (or probability) row whose bit in
//! the plan's partial bitmask is 0 to `fill`: the forward writes `-inf` into `S` before the
//! online softmax, the backward writes `0` into `P` and `dS`, so masked pairs are excluded exactly
//! (never multiplied by zero). Rows are walked 16 entries at a time and fully live groups are
//! skipped. [`MasksT`] holds the bitmasks transposed (key-major) for the forward kernels, whose
//! score tiles are `Sᵀ` (one row per key); it is built once per plan by `prepare`.

use rayon::prelude::*;
use tessera_plan::Plan;

/// Sets `s[c] = fill` for `c >= start` wherever bit `c` of the row bitmask `bits` is 0 (`start` a
/// multiple of 16; entries before `start` are not touched).
#[inline(always)]
pub(crate) fn mask_partial_row(s: &mut [f32], bits: &[u64], start: usize, fill: f32) {
    let n = s.len();
    let mut c = start;
    while c < n {
        let end = (c + 16).min(n);
        let g = ((bits[c / 64] >> (c % 64)) & 0xFFFF) as u32;
        if g != 0xFFFF {
            for (k, x) in s[c..end].iter_mut().enumerate() {
                if (g >> k) & 1 == 0 {
                    *x = fill;
                }
            }
        }
        c = end;
    }
}

/// The plan's partial bitmasks transposed: mask `id`, key row `j` holds bit `i % 64` of word
/// `i / 64` set when pair (query `i`, key `j`) of the tile is allowed.
pub(crate) struct MasksT {
    words: usize,
    rows: usize,
    data: Vec<u64>,
}

impl MasksT {
    pub(crate) fn new(plan: &Plan) -> Self {
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let words = tq.div_ceil(64);
        let per = tk * words;
        let p = &plan.partials;
        let mut data = vec![0u64; p.len() * per];
        data.par_chunks_mut(per.max(1))
            .enumerate()
            .for_each(|(id, out)| {
                for r in 0..tq {
                    for (w, &word) in p.row(id as u32, r).iter().enumerate() {
                        let mut bits = word;
                        while bits != 0 {
                            let c = w * 64 + bits.trailing_zeros() as usize;
                            bits &= bits - 1;
                            if c < tk {
                                out[c * words + r / 64] |= 1u64 << (r % 64);
                            }
                        }
                    }
                }
            });
        MasksT {
            words,
            rows: tk,
            data,
        }
    }

    /// Key rows `j0..` of mask `id` as bytes and the row stride in bytes: on a little-endian
    /// target (the x86-64 kernels that use it), bit `i` of a row is bit `i % 8` of byte `i / 8`.
    pub(crate) fn bytes_from(&self, id: u32, j0: usize) -> (&[u8], usize) {
        let rows = &self.data[(id as usize * self.rows + j0) * self.words
            ..(id as usize + 1) * self.rows * self.words];
        // SAFETY: any u64 storage is valid as bytes; the length covers the same memory.
        let view =
            unsafe { std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), rows.len() * 8) };
        (view, self.words * 8)
    }

    #[inline(always)]
    pub(crate) fn row(&self, id: u32, j: usize) -> &[u64] {
        let o = (id as usize * self.rows + j) * self.words;
        &self.data[o..o + self.words]
    }
}

#[cfg(test)]
mod tests {
    use super::mask_partial_row;

    #[test]
    fn masks_exactly_the_cleared_bits_from_start() {
        let mut r = vec![1.0f32; 70];
        mask_partial_row(&mut r, &[0b101, 1], 0, f32::NEG_INFINITY);
        assert_eq!(r[0], 1.0);
        assert_eq!(r[1], f32::NEG_INFINITY);
        assert_eq!(r[2], 1.0);
        assert_eq!(r[64], 1.0);
        assert_eq!(r[65], f32::NEG_INFINITY);
        // Entries before `start` are left alone; the fill value is the caller's.
        let mut r = vec![1.0f32; 40];
        mask_partial_row(&mut r, &[0], 16, 0.0);
        assert!(r[..16].iter().all(|&x| x == 1.0));
        assert!(r[16..].iter().all(|&x| x == 0.0));
    }
}
