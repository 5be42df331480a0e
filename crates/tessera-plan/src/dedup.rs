//! The plan's table of partial bitmasks, content-addressed.
//!
//! Contract: [`PartialDedup::intern`] returns the id of a mask in the table equal to the given
//! words, appending them when none is, so every distinct partial mask is stored once and ids
//! follow first appearance. Lookups go by [`digest`] (the words' set-bit count and a 64-bit hash
//! in one pass); equal hashes are resolved by comparing content, so the hash decides speed, never
//! the result. [`digest`] is one exactly defined function: every [`Level`] returns the same pair.

use crate::classify::simd::Level;
use crate::plan::PartialMasks;
use rustc_hash::FxHashMap;
use tessera_core::{budget, Result};

/// The partial-mask table is checked against the memory budget from this many words on.
const FIRST_TABLE_CHECK: usize = 16 << 20;

/// Ids of the table's masks by hash: the latest id per hash, and per id the one before it with
/// the same hash (chains resolve collisions; no allocation per entry).
#[derive(Default)]
pub(crate) struct PartialDedup {
    latest: FxHashMap<u64, u32>,
    earlier: Vec<u32>,
    /// Table size in words at which the memory budget is checked next (doubling).
    next_check: usize,
}

const NONE: u32 = u32::MAX;

impl PartialDedup {
    /// Room for `n` more masks without rehashing.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.latest.reserve(n);
        self.earlier.reserve(n);
    }

    /// The id of `bits` (whose [`digest`] hash is `hash`) in `table`, appended when new.
    pub(crate) fn intern(
        &mut self,
        table: &mut PartialMasks,
        bits: &[u64],
        hash: u64,
        what: &dyn Fn() -> String,
    ) -> Result<u32> {
        let head = self.latest.get(&hash).copied().unwrap_or(NONE);
        let mut id = head;
        while id != NONE {
            if table.get(id) == bits {
                return Ok(id);
            }
            id = self.earlier[id as usize];
        }
        let words = table.data.len() + bits.len();
        if words >= self.next_check.max(FIRST_TABLE_CHECK) {
            // Checked at doublings so the growing table never outruns the budget by more than 2x.
            budget::check(what, 8 * 2 * words as u128)?;
            self.next_check = 2 * words;
        }
        let id = table.len() as u32;
        table.data.extend_from_slice(bits);
        self.earlier.push(head);
        self.latest.insert(hash, id);
        Ok(id)
    }
}

/// Words hashed between two scrambles of the lanes (one 128 x 128 tile).
const BLOCK: usize = 256;

/// The per-position keys of a block (splitmix64 of the position).
const KEYS: [u64; BLOCK] = {
    let mut k = [0u64; BLOCK];
    let mut i = 0;
    while i < BLOCK {
        k[i] = splitmix(i as u64 + 1);
        i += 1;
    }
    k
};

const fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const SEED: [u64; 8] = [
    0x243F_6A88_85A3_08D3,
    0x1319_8A2E_0370_7344,
    0xA409_3822_299F_31D0,
    0x082E_FA98_EC4E_6C89,
    0x4528_21E6_38D0_1377,
    0xBE54_66CF_34E9_0C6C,
    0xC0AC_29B7_C97C_50DD,
    0x3F84_D5B5_B547_0917,
];

/// One word into its lane: `acc += lo32(d) * hi32(d) + rotl(w, 32)` with `d = w ^ key` (a
/// multiply-accumulate SIMD units do 4-8 lanes at a time; the key makes it depend on position).
#[inline(always)]
fn step(acc: u64, w: u64, key: u64) -> u64 {
    let d = w ^ key;
    acc.wrapping_add((d & 0xFFFF_FFFF).wrapping_mul(d >> 32))
        .wrapping_add(w.rotate_left(32))
}

/// Between blocks: each lane's bits mixed so that a block's lanes do not commute with the next's.
fn scramble(acc: &mut [u64; 8]) {
    for (l, a) in acc.iter_mut().enumerate() {
        *a = (*a ^ (*a >> 47) ^ SEED[l]).wrapping_mul(0x9E37_79B1);
    }
}

/// `(set bits, hash)` of `words`: lanes `i % 8` accumulate [`step`] with key `KEYS[i % 256]`,
/// scrambled after each whole block of 256 words, then folded with the length.
pub(crate) fn digest(level: Level, words: &[u64]) -> (u64, u64) {
    let mut acc = SEED;
    let mut ones = 0u64;
    let mut blocks = words.chunks(BLOCK).peekable();
    while let Some(block) = blocks.next() {
        let body = block.len() / 8 * 8;
        ones += lanes(level, &block[..body], &mut acc);
        for (i, &w) in block.iter().enumerate().skip(body) {
            acc[i % 8] = step(acc[i % 8], w, KEYS[i]);
            ones += w.count_ones() as u64;
        }
        if block.len() == BLOCK && blocks.peek().is_some() {
            scramble(&mut acc);
        }
    }
    let mut h = (words.len() as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    for a in acc {
        h = (h.rotate_left(23) ^ a).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    (ones, splitmix(h))
}

/// [`step`] over `words` (a multiple of 8, starting a block) into `acc`; the set bits.
fn lanes(level: Level, words: &[u64], acc: &mut [u64; 8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the features each kernel enables were detected on this CPU.
        if level == Level::Avx512 && x86::has_avx512_popcnt() {
            return unsafe { x86::lanes_avx512(words, acc) };
        }
        if level >= Level::Avx2 {
            return unsafe { x86::lanes_avx2(words, acc) };
        }
    }
    let _ = level;
    let mut ones = 0;
    for (i, &w) in words.iter().enumerate() {
        acc[i % 8] = step(acc[i % 8], w, KEYS[i]);
        ones += w.count_ones() as u64;
    }
    ones
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KEYS;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;
    use tessera_core::cpu_features::{has, Feature};

    /// AVX-512 with the 64-bit popcount (Ice Lake and Zen 4 on; not Skylake-SP).
    pub(super) fn has_avx512_popcnt() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| has(Feature::Avx512f) && has(Feature::Avx512vpopcntdq))
    }

    #[target_feature(enable = "avx512f,avx512vpopcntdq")]
    pub(super) unsafe fn lanes_avx512(words: &[u64], acc: &mut [u64; 8]) -> u64 {
        // SAFETY: every load reads 8 words at 8 * k < words.len() (a multiple of 8) or within
        // KEYS (words.len() <= 256), and `acc` is 8 words.
        unsafe {
            let mut a = _mm512_loadu_si512(acc.as_ptr().cast());
            let mut ones = _mm512_setzero_si512();
            for k in 0..words.len() / 8 {
                let w = _mm512_loadu_si512(words.as_ptr().add(8 * k).cast());
                let d = _mm512_xor_si512(w, _mm512_loadu_si512(KEYS.as_ptr().add(8 * k).cast()));
                let p = _mm512_mul_epu32(d, _mm512_srli_epi64::<32>(d));
                a = _mm512_add_epi64(a, _mm512_add_epi64(p, _mm512_rol_epi64::<32>(w)));
                ones = _mm512_add_epi64(ones, _mm512_popcnt_epi64(w));
            }
            _mm512_storeu_si512(acc.as_mut_ptr().cast(), a);
            _mm512_reduce_add_epi64(ones) as u64
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn lanes_avx2(words: &[u64], acc: &mut [u64; 8]) -> u64 {
        // SAFETY: as in `lanes_avx512`, 4 words at a time.
        unsafe {
            let mut a = [
                _mm256_loadu_si256(acc.as_ptr().cast()),
                _mm256_loadu_si256(acc.as_ptr().add(4).cast()),
            ];
            // Popcount by nibble lookup, summed per 64-bit lane by `sad`.
            let table = _mm256_setr_epi8(
                0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3,
                2, 3, 3, 4,
            );
            let low = _mm256_set1_epi8(0x0F);
            let mut ones = _mm256_setzero_si256();
            for k in 0..words.len() / 4 {
                let w = _mm256_loadu_si256(words.as_ptr().add(4 * k).cast());
                let d = _mm256_xor_si256(w, _mm256_loadu_si256(KEYS.as_ptr().add(4 * k).cast()));
                let p = _mm256_mul_epu32(d, _mm256_srli_epi64::<32>(d));
                let rot = _mm256_shuffle_epi32::<0b10_11_00_01>(w);
                a[k % 2] = _mm256_add_epi64(a[k % 2], _mm256_add_epi64(p, rot));
                let c = _mm256_add_epi8(
                    _mm256_shuffle_epi8(table, _mm256_and_si256(w, low)),
                    _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(w), low)),
                );
                ones = _mm256_add_epi64(ones, _mm256_sad_epu8(c, _mm256_setzero_si256()));
            }
            _mm256_storeu_si256(acc.as_mut_ptr().cast(), a[0]);
            _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast(), a[1]);
            let mut o = [0u64; 4];
            _mm256_storeu_si256(o.as_mut_ptr().cast(), ones);
            o.iter().sum()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize, seed: u64) -> Vec<u64> {
        (0..n as u64)
            .map(|i| match (i + seed) % 5 {
                0 => 0,
                1 => u64::MAX,
                _ => splitmix(i ^ seed << 20),
            })
            .collect()
    }

    #[test]
    fn every_level_gives_the_same_digest() {
        for n in [0usize, 1, 7, 8, 9, 255, 256, 257, 300, 512, 520, 1031] {
            let w = words(n, n as u64);
            let ones: u64 = w.iter().map(|x| x.count_ones() as u64).sum();
            let want = digest(Level::Scalar, &w);
            assert_eq!(want.0, ones, "{n} words");
            for level in Level::all_supported() {
                assert_eq!(digest(level, &w), want, "{level:?}, {n} words");
            }
        }
    }

    #[test]
    fn the_hash_sees_position_and_every_bit() {
        // Moving one bit, or swapping two words (in and across lanes and blocks), changes it.
        let base = words(600, 3);
        let h = digest(Level::detect(), &base).1;
        let mut seen = std::collections::HashSet::from([h]);
        for i in (0..600).step_by(37) {
            for b in [0, 31, 32, 63] {
                let mut w = base.clone();
                w[i] ^= 1 << b;
                assert!(
                    seen.insert(digest(Level::detect(), &w).1),
                    "bit {b} of word {i}"
                );
            }
        }
        for (i, j) in [(0, 8), (1, 2), (5, 261), (100, 356)] {
            let mut w = base.clone();
            w.swap(i, j);
            if w != base {
                assert!(seen.insert(digest(Level::detect(), &w).1), "swap {i} {j}");
            }
        }
    }

    #[test]
    fn interning_returns_equal_masks_ids_and_appends_new_ones() {
        use crate::shape::TileShape;
        let mut table = PartialMasks::new(TileShape::new(16, 64).unwrap());
        let mut dedup = PartialDedup::default();
        let what = || String::from("test");
        let (a, b) = ([1u64; 16], [2u64; 16]);
        // The same hash for different content still gives different ids (collisions resolve).
        let ia = dedup.intern(&mut table, &a, 7, &what).unwrap();
        let ib = dedup.intern(&mut table, &b, 7, &what).unwrap();
        assert_eq!((ia, ib), (0, 1));
        assert_eq!(dedup.intern(&mut table, &a, 7, &what).unwrap(), 0);
        assert_eq!(dedup.intern(&mut table, &b, 7, &what).unwrap(), 1);
        assert_eq!(table.data, [a, b].concat());
    }
}
