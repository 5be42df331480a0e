//! Row compares of stage 2: one q row against a kv tile's feature vector, 8 or 16 keys at a
//! time, written as the row's bit words.
//!
//! Contract: [`in_range`] (i64 keys) and [`in_range32`] (u32 keys) set bit `c` of `out` exactly
//! when `keys[c] - lo`, taken wrapping as unsigned, is at most `span`, that is when `keys[c]`
//! lies in `[lo, lo + span]` for bounds that do not wrap (callers clamp their bounds to the
//! tile's range first, so they never do). Bits from `keys.len()` on, within `out`, are 0. Every
//! [`Level`] gives the same words; `AVX-512` and `AVX2` are used only where the CPU reports them
//! at run time, and `TESSERA_PLAN_SIMD=avx2|scalar` caps the level (for benchmarks and tests of
//! the narrower paths).

use std::sync::OnceLock;

/// The instruction set a row compare uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Level {
    /// The widest level this CPU supports, capped by `TESSERA_PLAN_SIMD` (read once).
    pub fn detect() -> Level {
        static LEVEL: OnceLock<Level> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let cap = match std::env::var("TESSERA_PLAN_SIMD").as_deref() {
                Ok("scalar") => Level::Scalar,
                Ok("avx2") => Level::Avx2,
                _ => Level::Avx512,
            };
            cap.min(Self::supported())
        })
    }

    /// The widest level the CPU supports.
    pub fn supported() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            use tessera_core::cpu_features::{has, Feature};
            // F with VL/BW/DQ (every AVX-512 CPU since Skylake-SP): what `vectorized` enables.
            if has(Feature::Avx512f)
                && has(Feature::Avx512vl)
                && has(Feature::Avx512bw)
                && has(Feature::Avx512dq)
            {
                return Level::Avx512;
            }
            if has(Feature::Avx2) {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }

    /// Every level up to the supported one (for tests comparing them).
    #[cfg(test)]
    pub fn all_supported() -> Vec<Level> {
        [Level::Scalar, Level::Avx2, Level::Avx512]
            .into_iter()
            .filter(|&l| l <= Self::supported())
            .collect()
    }
}

/// `f()` compiled for the widest instruction set of `level`, so that plain integer loops in it
/// are auto-vectorized for AVX-512 or AVX2 (the same results at every level).
#[inline(always)]
pub(crate) fn vectorized<R>(level: Level, f: impl FnOnce() -> R) -> R {
    match level {
        // SAFETY: the level is at most `Level::supported()`, so the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::with_avx512(f) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::with_avx2(f) },
        _ => f(),
    }
}

/// Bit `c` of `out` set iff `keys[c].wrapping_sub(lo) as u64 <= span`; `out` holds at least
/// `keys.len().div_ceil(64)` words, which are overwritten.
pub(crate) fn in_range(level: Level, keys: &[i64], lo: i64, span: u64, out: &mut [u64]) {
    let full = keys.len() / 64;
    match level {
        // SAFETY: the level is at most `Level::supported()` (callers take it from `detect`, or
        // tests from `all_supported`), so the CPU has the features the functions enable.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::in_range_avx512(&keys[..full * 64], lo, span, out) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::in_range_avx2(&keys[..full * 64], lo, span, out) },
        _ => scalar(
            &keys[..full * 64],
            |v| v.wrapping_sub(lo) as u64 <= span,
            out,
        ),
    }
    tail(keys, full, |v| v.wrapping_sub(lo) as u64 <= span, out);
}

/// [`in_range`] for keys narrowed to u32 (twice the lanes).
pub(crate) fn in_range32(level: Level, keys: &[u32], lo: u32, span: u32, out: &mut [u64]) {
    let full = keys.len() / 64;
    match level {
        // SAFETY: as in `in_range`.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::in_range32_avx512(&keys[..full * 64], lo, span, out) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::in_range32_avx2(&keys[..full * 64], lo, span, out) },
        _ => scalar(&keys[..full * 64], |v| v.wrapping_sub(lo) <= span, out),
    }
    tail(keys, full, |v| v.wrapping_sub(lo) <= span, out);
}

/// One row of a tile compare: tile row `row` gets the keys in `[lo, lo + span]` (wrapping test
/// as in [`in_range`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowBounds<T> {
    pub row: u32,
    pub lo: T,
    pub span: T,
}

/// [`in_range`] of every row of `rows` into `out` (rows of `wpr` words): one call per tile, so
/// the keys stay in registers or L1 across rows and the dispatch is paid once.
pub(crate) fn tile_in_range(
    level: Level,
    keys: &[i64],
    rows: &[RowBounds<i64>],
    wpr: usize,
    out: &mut [u64],
) {
    match level {
        // SAFETY: as in `in_range`.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::tile_avx512(keys, rows, wpr, out) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::tile_avx2(keys, rows, wpr, out) },
        _ => {
            for b in rows {
                let at = b.row as usize * wpr;
                in_range(
                    Level::Scalar,
                    keys,
                    b.lo,
                    b.span as u64,
                    &mut out[at..at + wpr],
                );
            }
        }
    }
}

/// [`tile_in_range`] for keys narrowed to u32.
pub(crate) fn tile_in_range32(
    level: Level,
    keys: &[u32],
    rows: &[RowBounds<u32>],
    wpr: usize,
    out: &mut [u64],
) {
    match level {
        // SAFETY: as in `in_range`.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::tile32_avx512(keys, rows, wpr, out) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::tile32_avx2(keys, rows, wpr, out) },
        _ => {
            for b in rows {
                let at = b.row as usize * wpr;
                in_range32(Level::Scalar, keys, b.lo, b.span, &mut out[at..at + wpr]);
            }
        }
    }
}

/// Per row `(row, f)` of `rows`: bit `c` of tile row `row` set iff `f - l[c]` (wrapping u32)
/// is at most `w[c]`, that is `l[c] <= f <= l[c] + w[c]` for intervals that do not wrap; whole
/// words overwritten, other rows untouched.
pub(crate) fn tile_in_intervals32(
    level: Level,
    l: &[u32],
    w: &[u32],
    rows: &[(u32, u32)],
    wpr: usize,
    out: &mut [u64],
) {
    let full = l.len() / 64;
    match level {
        // SAFETY: as in `in_range`.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe {
            x86::intervals32_avx512(&l[..full * 64], &w[..full * 64], rows, wpr, out)
        },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe {
            x86::intervals32_avx2(&l[..full * 64], &w[..full * 64], rows, wpr, out)
        },
        _ => {
            for &(row, f) in rows {
                let at = row as usize * wpr;
                let o = &mut out[at..at + full];
                for (word, (lc, wc)) in o.iter_mut().zip(l.chunks_exact(64).zip(w.chunks_exact(64)))
                {
                    *word = lc
                        .iter()
                        .zip(wc)
                        .enumerate()
                        .fold(0u64, |acc, (c, (&a, &b))| {
                            acc | ((f.wrapping_sub(a) <= b) as u64) << c
                        });
                }
            }
        }
    }
    if l.len() > full * 64 {
        for &(row, f) in rows {
            let word = &mut out[row as usize * wpr + full];
            *word = l[full * 64..]
                .iter()
                .zip(&w[full * 64..])
                .enumerate()
                .fold(0u64, |acc, (c, (&a, &b))| {
                    acc | ((f.wrapping_sub(a) <= b) as u64) << c
                });
        }
    }
}

/// The last, partial word of every row of `rows` (keys from `64 * full` on), as [`tail`].
fn row_tails32(keys: &[u32], full: usize, rows: &[RowBounds<u32>], wpr: usize, out: &mut [u64]) {
    for b in rows {
        let row = &mut out[b.row as usize * wpr..(b.row as usize + 1) * wpr];
        tail(keys, full, |v: u32| v.wrapping_sub(b.lo) <= b.span, row);
    }
}

/// The whole 64-key words of `keys`, one compare per key.
fn scalar<T: Copy>(keys: &[T], ok: impl Fn(T) -> bool, out: &mut [u64]) {
    for (word, chunk) in out.iter_mut().zip(keys.chunks_exact(64)) {
        *word = chunk
            .iter()
            .enumerate()
            .fold(0u64, |w, (c, &v)| w | (ok(v) as u64) << c);
    }
}

/// The last, partial word (keys from `64 * full` on), one compare per key.
fn tail<T: Copy>(keys: &[T], full: usize, ok: impl Fn(T) -> bool, out: &mut [u64]) {
    let rest = &keys[full * 64..];
    if !rest.is_empty() {
        out[full] = rest
            .iter()
            .enumerate()
            .fold(0u64, |w, (c, &v)| w | (ok(v) as u64) << c);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
    pub(super) unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// `keys.len()` a multiple of 64.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn in_range_avx512(keys: &[i64], lo: i64, span: u64, out: &mut [u64]) {
        let (vlo, vspan) = (_mm512_set1_epi64(lo), _mm512_set1_epi64(span as i64));
        for (word, chunk) in out.iter_mut().zip(keys.chunks_exact(64)) {
            let mut w = 0u64;
            for k in 0..8 {
                // SAFETY: 8 keys at `8 * k` lie in the 64-key chunk.
                let v = unsafe { _mm512_loadu_si512(chunk.as_ptr().add(8 * k).cast()) };
                let m = _mm512_cmple_epu64_mask(_mm512_sub_epi64(v, vlo), vspan);
                w |= (m as u64) << (8 * k);
            }
            *word = w;
        }
    }

    /// `keys.len()` a multiple of 64.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn in_range32_avx512(keys: &[u32], lo: u32, span: u32, out: &mut [u64]) {
        let (vlo, vspan) = (_mm512_set1_epi32(lo as i32), _mm512_set1_epi32(span as i32));
        for (word, chunk) in out.iter_mut().zip(keys.chunks_exact(64)) {
            let mut w = 0u64;
            for k in 0..4 {
                // SAFETY: 16 keys at `16 * k` lie in the 64-key chunk.
                let v = unsafe { _mm512_loadu_si512(chunk.as_ptr().add(16 * k).cast()) };
                let m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, vlo), vspan);
                w |= (m as u64) << (16 * k);
            }
            *word = w;
        }
    }

    /// `keys.len()` a multiple of 64. AVX2 compares signed only: flipping the sign bit of both
    /// sides turns the unsigned `x <= span` into the signed `!(x' > span')`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn in_range_avx2(keys: &[i64], lo: i64, span: u64, out: &mut [u64]) {
        let sign = _mm256_set1_epi64x(i64::MIN);
        let vlo = _mm256_set1_epi64x(lo);
        let vspan = _mm256_set1_epi64x((span as i64) ^ i64::MIN);
        for (word, chunk) in out.iter_mut().zip(keys.chunks_exact(64)) {
            let mut over = 0u64;
            for k in 0..16 {
                // SAFETY: 4 keys at `4 * k` lie in the 64-key chunk.
                let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().add(4 * k).cast()) };
                let x = _mm256_xor_si256(_mm256_sub_epi64(v, vlo), sign);
                let gt = _mm256_cmpgt_epi64(x, vspan);
                over |= (_mm256_movemask_pd(_mm256_castsi256_pd(gt)) as u64) << (4 * k);
            }
            *word = !over;
        }
    }

    /// `keys.len()` a multiple of 64 (see [`in_range_avx2`]).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn in_range32_avx2(keys: &[u32], lo: u32, span: u32, out: &mut [u64]) {
        let sign = _mm256_set1_epi32(i32::MIN);
        let vlo = _mm256_set1_epi32(lo as i32);
        let vspan = _mm256_set1_epi32((span as i32) ^ i32::MIN);
        for (word, chunk) in out.iter_mut().zip(keys.chunks_exact(64)) {
            let mut over = 0u64;
            for k in 0..8 {
                // SAFETY: 8 keys at `8 * k` lie in the 64-key chunk.
                let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().add(8 * k).cast()) };
                let x = _mm256_xor_si256(_mm256_sub_epi32(v, vlo), sign);
                let gt = _mm256_cmpgt_epi32(x, vspan);
                over |= (_mm256_movemask_ps(_mm256_castsi256_ps(gt)) as u32 as u64) << (8 * k);
            }
            *word = !over;
        }
    }

    /// Whole-tile drivers: every row of `rows` through one row kernel (inlined: the driver
    /// enables the same features), then the row's tail word scalar. `conv` maps a difference or
    /// span to the unsigned type the kernel compares in.
    macro_rules! tile_driver {
        ($name:ident, $feature:literal, $kernel:ident, $t:ty, $conv:expr) => {
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $name(
                keys: &[$t],
                rows: &[super::RowBounds<$t>],
                wpr: usize,
                out: &mut [u64],
            ) {
                let full = keys.len() / 64;
                let conv = $conv;
                for b in rows {
                    let row = &mut out[b.row as usize * wpr..(b.row as usize + 1) * wpr];
                    // SAFETY: the CPU has this function's features, the kernel's own.
                    unsafe { $kernel(&keys[..full * 64], b.lo, conv(b.span), row) };
                    let ok = |v: $t| conv(v.wrapping_sub(b.lo)) <= conv(b.span);
                    super::tail(keys, full, ok, row);
                }
            }
        };
    }
    tile_driver!(tile_avx512, "avx512f", in_range_avx512, i64, |s: i64| s
        as u64);

    /// [`super::tile_in_range32`] in AVX-512, word by word: the word's 64 keys held in
    /// registers across the rows (a row costs four compares, no key loads); tails scalar.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn tile32_avx512(
        keys: &[u32],
        rows: &[super::RowBounds<u32>],
        wpr: usize,
        out: &mut [u64],
    ) {
        let full = keys.len() / 64;
        for k in 0..full {
            // SAFETY: 64 keys at `64 * k` lie within `keys`.
            let v = unsafe {
                let p = keys.as_ptr().add(64 * k);
                [0, 16, 32, 48].map(|h| _mm512_loadu_si512(p.add(h).cast()))
            };
            for b in rows {
                let (vlo, vspan) = (
                    _mm512_set1_epi32(b.lo as i32),
                    _mm512_set1_epi32(b.span as i32),
                );
                let m = v.map(|x| _mm512_cmple_epu32_mask(_mm512_sub_epi32(x, vlo), vspan));
                // The four 16-bit masks joined in mask registers (no shifts through GPRs).
                let w = _mm512_kunpackd(
                    _mm512_kunpackw(m[3].into(), m[2].into()) as __mmask64,
                    _mm512_kunpackw(m[1].into(), m[0].into()) as __mmask64,
                );
                out[b.row as usize * wpr + k] = w;
            }
        }
        super::row_tails32(keys, full, rows, wpr, out);
    }

    /// [`tile32_avx512`] in AVX2 (unsigned compare by flipping sign bits, as in
    /// [`in_range32_avx2`]).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tile32_avx2(
        keys: &[u32],
        rows: &[super::RowBounds<u32>],
        wpr: usize,
        out: &mut [u64],
    ) {
        let full = keys.len() / 64;
        let sign = _mm256_set1_epi32(i32::MIN);
        for k in 0..full {
            // SAFETY: 64 keys at `64 * k` lie within `keys`.
            let v = unsafe {
                let p = keys.as_ptr().add(64 * k);
                [0, 8, 16, 24, 32, 40, 48, 56].map(|h| _mm256_loadu_si256(p.add(h).cast()))
            };
            for b in rows {
                let vlo = _mm256_set1_epi32(b.lo as i32);
                let vspan = _mm256_set1_epi32((b.span as i32) ^ i32::MIN);
                let mut over = 0u64;
                for (h, &x) in v.iter().enumerate() {
                    let d = _mm256_xor_si256(_mm256_sub_epi32(x, vlo), sign);
                    let gt = _mm256_cmpgt_epi32(d, vspan);
                    over |= (_mm256_movemask_ps(_mm256_castsi256_ps(gt)) as u32 as u64) << (8 * h);
                }
                out[b.row as usize * wpr + k] = !over;
            }
        }
        super::row_tails32(keys, full, rows, wpr, out);
    }
    tile_driver!(tile_avx2, "avx2", in_range_avx2, i64, |s: i64| s as u64);

    /// [`super::tile_in_intervals32`]'s whole words (`l.len()` a multiple of 64) in AVX-512.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn intervals32_avx512(
        l: &[u32],
        w: &[u32],
        rows: &[(u32, u32)],
        wpr: usize,
        out: &mut [u64],
    ) {
        // Word by word, the word's 64 intervals held in registers across the rows.
        for k in 0..l.len() / 64 {
            // SAFETY: 64 lanes at `64 * k` lie within `l` and `w` (same length).
            let (a, b) = unsafe {
                let (pl, pw) = (l.as_ptr().add(64 * k), w.as_ptr().add(64 * k));
                (
                    [0, 16, 32, 48].map(|h| _mm512_loadu_si512(pl.add(h).cast())),
                    [0, 16, 32, 48].map(|h| _mm512_loadu_si512(pw.add(h).cast())),
                )
            };
            for &(row, f) in rows {
                let vf = _mm512_set1_epi32(f as i32);
                let mut acc = 0u64;
                for h in 0..4 {
                    let m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(vf, a[h]), b[h]);
                    acc |= (m as u64) << (16 * h);
                }
                out[row as usize * wpr + k] = acc;
            }
        }
    }

    /// [`intervals32_avx512`] in AVX2 (unsigned compare by flipping sign bits).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn intervals32_avx2(
        l: &[u32],
        w: &[u32],
        rows: &[(u32, u32)],
        wpr: usize,
        out: &mut [u64],
    ) {
        let sign = _mm256_set1_epi32(i32::MIN);
        for &(row, f) in rows {
            let vf = _mm256_set1_epi32(f as i32);
            let at = row as usize * wpr;
            for (k, word) in out[at..at + l.len() / 64].iter_mut().enumerate() {
                let mut over = 0u64;
                for h in 0..8 {
                    let c = 64 * k + 8 * h;
                    // SAFETY: 8 lanes at `c` lie within `l` and `w` (same length).
                    let (a, b) = unsafe {
                        (
                            _mm256_loadu_si256(l.as_ptr().add(c).cast()),
                            _mm256_loadu_si256(w.as_ptr().add(c).cast()),
                        )
                    };
                    let x = _mm256_xor_si256(_mm256_sub_epi32(vf, a), sign);
                    let gt = _mm256_cmpgt_epi32(x, _mm256_xor_si256(b, sign));
                    over |= (_mm256_movemask_ps(_mm256_castsi256_ps(gt)) as u32 as u64) << (8 * h);
                }
                *word = !over;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proptest cases: `PROPTEST_CASES` when set (the 1,500-case runs), else `default` (CI).
    fn test_cases(default: u32) -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }
    use proptest::prelude::*;

    /// The definition: `v - lo`, wrapped to u64, at most `span`.
    fn brute(keys: &[i64], lo: i64, span: u64, words: usize) -> Vec<u64> {
        let mut out = vec![0u64; words];
        for (c, &v) in keys.iter().enumerate() {
            out[c / 64] |= ((v.wrapping_sub(lo) as u64 <= span) as u64) << (c % 64);
        }
        out
    }

    fn value() -> impl Strategy<Value = i64> {
        prop_oneof![
            -40i64..40,
            i64::MIN..i64::MIN + 4,
            i64::MAX - 4..=i64::MAX,
            any::<i64>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: test_cases(256),
            ..ProptestConfig::default()
        })]

        /// Every level against brute force, i64 keys and (where they fit) u32 keys.
        #[test]
        fn every_level_equals_brute_force(
            keys in proptest::collection::vec(value(), 0..300),
            lo in value(),
            span in prop_oneof![0u64..50, any::<u64>(), Just(u64::MAX)],
        ) {
            let words = keys.len().div_ceil(64) + 1;
            let want = brute(&keys, lo, span, words);
            let small: Vec<u32> = keys.iter().map(|&v| v as u32).collect();
            let (lo32, span32) = (lo as u32, span as u32);
            let mut want32 = vec![0u64; words];
            for (c, &v) in small.iter().enumerate() {
                want32[c / 64] |= ((v.wrapping_sub(lo32) <= span32) as u64) << (c % 64);
            }
            for level in Level::all_supported() {
                let mut out = vec![0u64; words];
                in_range(level, &keys, lo, span, &mut out);
                prop_assert_eq!(&out, &want, "{:?}", level);
                let mut out = vec![0u64; words];
                in_range32(level, &small, lo32, span32, &mut out);
                prop_assert_eq!(&out, &want32, "{:?} u32", level);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: test_cases(128),
            ..ProptestConfig::default()
        })]

        /// A whole tile at every level equals its rows compared one by one by brute force; rows
        /// not listed stay as they were.
        #[test]
        fn tiles_equal_their_rows(
            keys in proptest::collection::vec(value(), 1..300),
            rows in proptest::collection::vec((0u32..6, value(), any::<u64>()), 0..6),
        ) {
            let wpr = keys.len().div_ceil(64);
            let small: Vec<u32> = keys.iter().map(|&v| v as u32).collect();
            let mut b64: Vec<RowBounds<i64>> = Vec::new();
            let mut b32: Vec<RowBounds<u32>> = Vec::new();
            let (mut want, mut want32) = (vec![7u64; 6 * wpr], vec![7u64; 6 * wpr]);
            for &(row, lo, span) in &rows {
                if b64.iter().any(|b| b.row == row) {
                    continue;
                }
                b64.push(RowBounds { row, lo, span: span as i64 });
                b32.push(RowBounds { row, lo: lo as u32, span: span as u32 });
                let at = row as usize * wpr;
                want[at..at + wpr].copy_from_slice(&brute(&keys, lo, span, wpr));
                for w in &mut want32[at..at + wpr] {
                    *w = 0;
                }
                for (c, &v) in small.iter().enumerate() {
                    let ok = v.wrapping_sub(lo as u32) <= span as u32;
                    want32[at + c / 64] |= (ok as u64) << (c % 64);
                }
            }
            for level in Level::all_supported() {
                let mut out = vec![7u64; 6 * wpr];
                tile_in_range(level, &keys, &b64, wpr, &mut out);
                prop_assert_eq!(&out, &want, "{:?}", level);
                let mut out = vec![7u64; 6 * wpr];
                tile_in_range32(level, &small, &b32, wpr, &mut out);
                prop_assert_eq!(&out, &want32, "{:?} u32", level);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: test_cases(128),
            ..ProptestConfig::default()
        })]

        /// Interval compares at every level equal brute force, rows not listed untouched.
        #[test]
        fn intervals_equal_brute_force(
            ivs in proptest::collection::vec((any::<u32>(), prop_oneof![0u32..40, any::<u32>()]), 1..300),
            rows in proptest::collection::vec((0u32..5, any::<u32>()), 0..5),
            near in any::<bool>(),
        ) {
            let wpr = ivs.len().div_ceil(64);
            let (l, w): (Vec<u32>, Vec<u32>) = ivs.into_iter().unzip();
            // Values near the intervals' starts as well as anywhere.
            let rows: Vec<(u32, u32)> = rows
                .iter()
                .enumerate()
                .filter(|(k, (r, _))| rows[..*k].iter().all(|(s, _)| s != r))
                .map(|(_, &(r, f))| (r, if near { l[f as usize % l.len()].wrapping_add(f % 3) } else { f }))
                .collect();
            let mut want = vec![5u64; 5 * wpr];
            for &(r, f) in &rows {
                let at = r as usize * wpr;
                want[at..at + wpr].iter_mut().for_each(|x| *x = 0);
                for c in 0..l.len() {
                    let ok = f as u64 >= l[c] as u64 && f as u64 <= l[c] as u64 + w[c] as u64
                        || (l[c] as u64 + w[c] as u64 > u32::MAX as u64
                            && (f as u64) + (1u64 << 32) <= l[c] as u64 + w[c] as u64);
                    want[at + c / 64] |= (ok as u64) << (c % 64);
                }
            }
            for level in Level::all_supported() {
                let mut out = vec![5u64; 5 * wpr];
                tile_in_intervals32(level, &l, &w, &rows, wpr, &mut out);
                prop_assert_eq!(&out, &want, "{:?}", level);
            }
        }
    }

    #[test]
    fn this_machine_has_its_levels() {
        // Every level at or below the supported one is exercised by the test above; on an
        // x86-64 CI machine that is at least AVX2.
        #[cfg(target_arch = "x86_64")]
        if tessera_core::cpu_features::has(tessera_core::cpu_features::Feature::Avx2) {
            assert!(Level::all_supported().contains(&Level::Avx2));
        }
        assert!(Level::detect() <= Level::supported());
    }
}
