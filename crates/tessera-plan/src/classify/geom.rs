//! What every node of the planner's stages shares, below all of them: the plan's sizes
//! ([`Geom`]), setting a run of bits in a bitmask row, and the content hash of bitmask words
//! (for content-addressed tables whose collisions are resolved by comparing contents).

use super::simd;

/// Sizes shared by every node of one plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    /// The row-compare instructions stage 2 uses.
    pub level: simd::Level,
    pub lq: usize,
    pub lkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub nq: usize,
    pub nk: usize,
    pub wpr: usize,
    /// Whether stage 2 builds the partial tiles' bitmasks; without them it finds each tile's
    /// state and allowed pairs only (a leaf that counts its pairs skips writing them).
    pub masks: bool,
}

impl Geom {
    /// Inclusive token range of q-tile `qt`.
    pub(super) fn qr(&self, qt: usize) -> (i64, i64) {
        let s = qt * self.tq;
        (s as i64, ((s + self.tq).min(self.lq) - 1) as i64)
    }
    /// Inclusive token range of kv-tile `kt`.
    pub(super) fn kr(&self, kt: usize) -> (i64, i64) {
        let s = kt * self.tk;
        (s as i64, ((s + self.tk).min(self.lkv) - 1) as i64)
    }
    /// Token range [lo, hi] (inclusive) to kv tiles, clipped; None when empty.
    pub(super) fn kv_tiles(&self, lo: i64, hi: i64) -> Option<(usize, usize)> {
        let lo = lo.max(0);
        let hi = hi.min(self.lkv as i64 - 1);
        (lo <= hi).then(|| (lo as usize / self.tk, hi as usize / self.tk))
    }
}

/// A 64-bit hash of the `len` words `words` yields (the length included), for keys compared in
/// full on a match: four multiply-rotate lanes (word `i` into lane `i % 4`).
pub(crate) fn hash_iter(len: usize, words: impl Iterator<Item = u64>) -> u64 {
    const P: u64 = 0x0100_0000_01b3;
    let step = |a: u64, w: u64| (a ^ w).wrapping_mul(P).rotate_left(29);
    let mut lanes = [
        0xcbf2_9ce4_8422_2325u64,
        0x9e37_79b9_7f4a_7c15,
        0x6c62_272e_07bb_0142,
        0x2545_f491_4f6c_dd1d,
    ];
    for (i, w) in words.enumerate() {
        lanes[i % 4] = step(lanes[i % 4], w);
    }
    lanes.iter().fold(len as u64, |a, &l| step(a, l))
}

/// Sets bits [lo, hi) of `row`, clipped to [0, ncols).
pub(super) fn set_range(row: &mut [u64], lo: i64, hi: i64, ncols: usize) {
    let lo = lo.max(0) as usize;
    let hi = hi.clamp(0, ncols as i64) as usize;
    let mut j = lo;
    while j < hi {
        let (w, b) = (j / 64, j % 64);
        let take = (64 - b).min(hi - j);
        row[w] |= if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << b
        };
        j += take;
    }
}
