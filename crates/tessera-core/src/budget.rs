//! The memory budget: sizes declared by input (file headers, shapes, flags) are checked against
//! it before anything that size is allocated, so hostile or mistaken input is refused with an
//! [`Error::OverBudget`] naming what was asked for, never an allocation abort or an OOM kill.
//!
//! Contract: the budget is `TESSERA_MEMORY_BUDGET` (bytes, optionally with a `K`, `M`, `G` or `T`
//! suffix in powers of 1024; `0` or `unlimited` turns the check off) when set, else the
//! `MemAvailable` line of `/proc/meminfo` at the time of the check, else no limit (a platform
//! without that file). [`check`] never allocates and is cheap: below [`ALWAYS_OK`] bytes it does
//! not even read `/proc/meminfo`.

use crate::{Error, Result};

/// Environment variable that sets the budget in bytes.
pub const ENV: &str = "TESSERA_MEMORY_BUDGET";

/// Requests below this many bytes pass without consulting available memory (only an explicit
/// `TESSERA_MEMORY_BUDGET` can refuse them).
pub const ALWAYS_OK: u128 = 256 << 20;

/// The budget in force: `Ok(Some((bytes, where it comes from)))`, `Ok(None)` when unlimited, an
/// error when `TESSERA_MEMORY_BUDGET` is malformed.
pub fn budget() -> Result<Option<(u64, String)>> {
    if let Some(v) = std::env::var_os(ENV) {
        let text = v.to_string_lossy();
        return match parse_bytes(&text) {
            Some(0) => Ok(None),
            Some(b) => Ok(Some((b, format!("{ENV}={}", text.trim())))),
            None => Err(Error::invalid(
                ENV,
                "a number of bytes such as 8G, 512M or 1073741824 (0 or unlimited: no limit)",
                format!("{text:?}"),
            )),
        };
    }
    Ok(available().map(|b| (b, format!("available memory; set {ENV} to change it"))))
}

/// Refuses `need` bytes for `what` when they exceed the budget.
pub fn check(what: impl FnOnce() -> String, need: u128) -> Result<()> {
    if need < ALWAYS_OK && std::env::var_os(ENV).is_none() {
        return Ok(());
    }
    match budget()? {
        Some((budget, source_of_budget)) if need > budget as u128 => Err(Error::OverBudget {
            what: what(),
            need,
            budget,
            source_of_budget,
        }),
        _ => Ok(()),
    }
}

/// `need = count × size` for `what`, refused when it overflows or exceeds the budget.
pub fn check_elems(what: impl FnOnce() -> String, count: u128, size: u128) -> Result<()> {
    check(what, count.saturating_mul(size))
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Parses `123`, `64K`, `512M`, `8G`, `1T` (powers of 1024, optional trailing `B`/`iB`) or
/// `unlimited` (0).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("unlimited") {
        return Some(0);
    }
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return None,
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().ok()?;
    n.checked_mul(1u64 << shift)
}

/// `12.0 GiB (12884901888 bytes)`.
pub fn human_bytes(n: impl Into<u128>) -> String {
    let n: u128 = n.into();
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {} ({n} bytes)", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("64K"), Some(64 << 10));
        assert_eq!(parse_bytes(" 8g "), Some(8 << 30));
        assert_eq!(parse_bytes("2GiB"), Some(2 << 30));
        assert_eq!(parse_bytes("1TB"), Some(1 << 40));
        assert_eq!(parse_bytes("unlimited"), Some(0));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("-1"), None);
        assert_eq!(parse_bytes("99999999999T"), None);
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(12u64), "12 bytes");
        assert_eq!(human_bytes(3u64 << 30), "3.0 GiB (3221225472 bytes)");
    }

    #[test]
    fn available_memory_is_read_here() {
        if cfg!(target_os = "linux") {
            assert!(available().is_some_and(|b| b > 0));
        }
    }
}
