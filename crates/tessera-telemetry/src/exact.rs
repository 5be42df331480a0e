//! Deterministic arithmetic: [`ExactSum`], an order-independent, exactly mergeable sum of f64
//! values, and [`det_max`], a bit-for-bit commutative maximum. The leaf of the crate's module
//! graph (config → exact → outlier → summary → record; reference uses summary and outlier).
//!
//! Contract: the sum of any multiset of f64 values is held *exactly* (a fixed-point integer
//! wide enough for every finite f64, a "superaccumulator"), so adding in any order, on any
//! thread, and merging partial sums in any grouping gives bit-identical state and therefore a
//! bit-identical [`ExactSum::value`]. Non-finite inputs are tracked by flags: any NaN, or both
//! +inf and -inf, reads as NaN; otherwise an infinity reads as that infinity.

use serde::{Deserialize, Serialize};

/// Number of 32-bit digits. Digit `k` weighs `2^(32k - BIAS)`; the lowest f64 bit (2^-1074)
/// lands at or above digit 0 and 2^63 additions of the largest f64 fit below the top digit.
const DIGITS: usize = 70;
const BIAS: i32 = 1088;
const MASK32: i64 = (1 << 32) - 1;
/// Additions between carry normalisations: each addition moves a digit by less than 2^32, so
/// 2^30 of them keep every digit below 2^62 in magnitude.
const NORMALIZE_EVERY: u32 = 1 << 30;

/// An exact sum of f64 values (see the module doc). `Default` is the empty sum (0).
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "ExactSumRepr", into = "ExactSumRepr")]
pub struct ExactSum {
    digits: [i64; DIGITS],
    pending: u32,
    nan: bool,
    pos_inf: bool,
    neg_inf: bool,
}

impl Default for ExactSum {
    fn default() -> Self {
        ExactSum {
            digits: [0; DIGITS],
            pending: 0,
            nan: false,
            pos_inf: false,
            neg_inf: false,
        }
    }
}

impl std::fmt::Debug for ExactSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExactSum({:e})", self.value())
    }
}

impl PartialEq for ExactSum {
    fn eq(&self, other: &Self) -> bool {
        let (mut a, mut b) = (self.clone(), other.clone());
        a.normalize();
        b.normalize();
        a.digits == b.digits && a.nan == b.nan && a.pos_inf == b.pos_inf && a.neg_inf == b.neg_inf
    }
}

impl ExactSum {
    /// The empty sum.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `x` exactly.
    #[inline]
    pub fn add(&mut self, x: f64) {
        if !x.is_finite() {
            if x.is_nan() {
                self.nan = true;
            } else if x > 0.0 {
                self.pos_inf = true;
            } else {
                self.neg_inf = true;
            }
            return;
        }
        if x == 0.0 {
            return;
        }
        let bits = x.to_bits();
        let biased = ((bits >> 52) & 0x7ff) as i32;
        let frac = bits & ((1u64 << 52) - 1);
        let (mant, exp) = if biased == 0 {
            (frac, -1074)
        } else {
            (frac | (1u64 << 52), biased - 1075)
        };
        // 0 <= pos <= 1023 - 52 + 1088.
        let pos = (exp + BIAS) as u32;
        let k = (pos / 32) as usize;
        let wide = (mant as u128) << (pos % 32);
        let parts = [
            (wide & 0xffff_ffff) as i64,
            ((wide >> 32) & 0xffff_ffff) as i64,
            ((wide >> 64) & 0xffff_ffff) as i64,
        ];
        let neg = x < 0.0;
        for (d, p) in self.digits[k..k + 3].iter_mut().zip(parts) {
            if neg {
                *d -= p;
            } else {
                *d += p;
            }
        }
        self.pending += 1;
        if self.pending >= NORMALIZE_EVERY {
            self.normalize();
        }
    }

    /// Adds every value of `other` (exact; the grouping of merges never matters).
    pub fn merge(&mut self, other: &ExactSum) {
        self.normalize();
        let mut o = other.clone();
        o.normalize();
        for (d, x) in self.digits.iter_mut().zip(o.digits) {
            *d += x;
        }
        self.nan |= o.nan;
        self.pos_inf |= o.pos_inf;
        self.neg_inf |= o.neg_inf;
        self.normalize();
    }

    /// Propagates carries: digits `0..DIGITS-1` in `[0, 2^32)`, the top digit signed. This form
    /// is unique for a given exact value.
    fn normalize(&mut self) {
        let mut carry = 0i64;
        for d in self.digits[..DIGITS - 1].iter_mut() {
            let v = *d + carry;
            carry = v >> 32;
            *d = v & MASK32;
        }
        self.digits[DIGITS - 1] += carry;
        self.pending = 0;
    }

    /// The sum rounded to f64 (within one ulp of the exact sum; a deterministic function of
    /// the exact sum, so equal sums read equal).
    pub fn value(&self) -> f64 {
        if self.nan || (self.pos_inf && self.neg_inf) {
            return f64::NAN;
        }
        if self.pos_inf {
            return f64::INFINITY;
        }
        if self.neg_inf {
            return f64::NEG_INFINITY;
        }
        let mut s = self.clone();
        s.normalize();
        let negative = s.digits[DIGITS - 1] < 0;
        if negative {
            for d in s.digits.iter_mut() {
                *d = -*d;
            }
            s.normalize();
        }
        let Some(top) = s.digits.iter().rposition(|&d| d != 0) else {
            return 0.0;
        };
        let lo = top.saturating_sub(2);
        let mut wide = 0u128;
        for k in (lo..=top).rev() {
            wide = (wide << 32) | s.digits[k] as u128;
        }
        // One rounding (u128 -> f64 is round-to-nearest); lower digits are truncated.
        let acc = wide as f64;
        let v = ldexp(acc, 32 * lo as i32 - BIAS);
        if negative {
            -v
        } else {
            v
        }
    }
}

/// `x · 2^n` for any `n`, stepping through the exponent range.
fn ldexp(mut x: f64, mut n: i32) -> f64 {
    let pow2 = |e: i32| f64::from_bits(((e + 1023) as u64) << 52);
    while n > 1000 {
        x *= pow2(1000);
        n -= 1000;
    }
    while n < -1000 {
        x *= pow2(-1000);
        n += 1000;
    }
    x * pow2(n)
}

/// Serialized form: normalized digits plus the non-finite flags.
#[derive(Serialize, Deserialize)]
struct ExactSumRepr {
    digits: Vec<i64>,
    nan: bool,
    pos_inf: bool,
    neg_inf: bool,
}

impl From<ExactSum> for ExactSumRepr {
    fn from(mut s: ExactSum) -> Self {
        s.normalize();
        ExactSumRepr {
            digits: s.digits.to_vec(),
            nan: s.nan,
            pos_inf: s.pos_inf,
            neg_inf: s.neg_inf,
        }
    }
}

impl TryFrom<ExactSumRepr> for ExactSum {
    type Error = String;
    fn try_from(r: ExactSumRepr) -> Result<Self, String> {
        let digits: [i64; DIGITS] = r.digits.try_into().map_err(|d: Vec<i64>| {
            format!("ExactSum: expected {DIGITS} digits, found {}", d.len())
        })?;
        let lower_ok = digits[..DIGITS - 1]
            .iter()
            .all(|&d| (0..=MASK32).contains(&d));
        let top_ok = digits[DIGITS - 1].unsigned_abs() <= MASK32 as u64;
        if !lower_ok || !top_ok {
            return Err("ExactSum: digits are not normalized".to_string());
        }
        Ok(ExactSum {
            digits,
            pending: 0,
            nan: r.nan,
            pos_inf: r.pos_inf,
            neg_inf: r.neg_inf,
        })
    }
}

/// Maximum that is commutative and associative bit for bit: NaN if either is NaN, and
/// `max(-0.0, +0.0) = +0.0` whatever the order.
#[inline]
pub fn det_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a > b {
        a
    } else if b > a {
        b
    } else if a.is_sign_positive() {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(xs: &[f64]) -> ExactSum {
        let mut s = ExactSum::new();
        for &x in xs {
            s.add(x);
        }
        s
    }

    #[test]
    fn exact_small_and_large() {
        assert_eq!(sum(&[]).value(), 0.0);
        assert_eq!(sum(&[1.5]).value(), 1.5);
        assert_eq!(sum(&[1e300, 1.0, -1e300]).value(), 1.0);
        assert_eq!(sum(&[f64::MIN_POSITIVE / 8.0, 3.0]).value(), 3.0);
        assert_eq!(sum(&[5e-324, 5e-324]).value(), 1e-323);
        assert_eq!(sum(&[f64::MAX, f64::MAX, -f64::MAX]).value(), f64::MAX);
        assert_eq!(sum(&[-2.0, 0.5]).value(), -1.5);
        assert_eq!(sum(&[0.1; 10]).value(), 1.0);
        assert!(sum(&[1.0, f64::NAN]).value().is_nan());
        assert_eq!(sum(&[1.0, f64::INFINITY]).value(), f64::INFINITY);
        assert!(sum(&[f64::NEG_INFINITY, f64::INFINITY]).value().is_nan());
    }

    #[test]
    fn order_and_grouping_do_not_matter() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let vals: Vec<f64> = (0..5000)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let m = (x >> 11) as f64 / (1u64 << 53) as f64;
                let e = (i % 40) - 20;
                (m - 0.3) * 2f64.powi(e)
            })
            .collect();
        let a = sum(&vals);
        let mut rev = vals.clone();
        rev.reverse();
        let b = sum(&rev);
        let mut c = sum(&vals[..1234]);
        c.merge(&sum(&vals[1234..]));
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_eq!(a.value().to_bits(), c.value().to_bits());
        let json = serde_json::to_string(&a).unwrap();
        let back: ExactSum = serde_json::from_str(&json).unwrap();
        assert_eq!(a, back);
    }
}
