//! Problem and tile shapes, with validation.

use tessera_core::{Error, Result};

/// Batch size, query heads and sequence lengths a plan is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PlanShape {
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `H`.
    pub heads: usize,
    /// Query length `Lq`.
    pub q_len: usize,
    /// Key length `Lkv`.
    pub kv_len: usize,
}

impl PlanShape {
    /// A shape; every dimension must be positive.
    pub fn new(batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<Self> {
        for (arg, v) in [
            ("batch", batch),
            ("heads", heads),
            ("q-len", q_len),
            ("kv-len", kv_len),
        ] {
            if v == 0 {
                return Err(Error::invalid(arg, "a positive value", 0));
            }
        }
        Ok(PlanShape {
            batch,
            heads,
            q_len,
            kv_len,
        })
    }
}

/// Tile sizes in tokens: `q` query rows by `kv` key columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TileShape {
    /// Query rows per tile.
    pub q: usize,
    /// Key columns per tile.
    pub kv: usize,
}

/// Largest tile side accepted (bitmasks of partial tiles grow with q·kv).
pub const MAX_TILE: usize = 4096;

impl Default for TileShape {
    fn default() -> Self {
        TileShape { q: 128, kv: 128 }
    }
}

impl TileShape {
    /// A tile shape; each side must be a power-of-two multiple of 16 (16, 32, ..., 4096).
    pub fn new(q: usize, kv: usize) -> Result<Self> {
        for (side, v) in [("query", q), ("key", kv)] {
            if v < 16 || !v.is_power_of_two() || v > MAX_TILE {
                return Err(Error::invalid(
                    "tile",
                    format!("{side} side a power-of-two multiple of 16 up to {MAX_TILE}"),
                    v,
                ));
            }
        }
        Ok(TileShape { q, kv })
    }

    /// Parses `128x64` (query x key) or `128` (square).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::invalid("tile", "QxK such as 128x128, or one size such as 64", s);
        let (a, b) = match s.split_once(['x', 'X']) {
            Some((a, b)) => (a, b),
            None => (s, s),
        };
        let q = a.trim().parse().map_err(|_| bad())?;
        let kv = b.trim().parse().map_err(|_| bad())?;
        Self::new(q, kv)
    }
}

impl std::fmt::Display for TileShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.q, self.kv)
    }
}
