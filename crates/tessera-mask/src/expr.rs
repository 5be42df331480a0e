//! The typed mask algebra and its token-level semantics.

use crate::data::{DenseMask, Segments};
use std::fmt::Write as _;
use std::sync::Arc;
use tessera_core::{Error, Result};

/// A boolean expression over structured mask predicates (SPEC §3).
#[derive(Debug, Clone, PartialEq)]
pub enum Mask {
    /// Every pair allowed.
    Full,
    /// `i + offset >= j`.
    Causal {
        /// Diagonal offset `N`.
        offset: i64,
    },
    /// `i - left <= j <= i + right`.
    Window {
        /// Keys allowed before the query.
        left: i64,
        /// Keys allowed after the query.
        right: i64,
    },
    /// `i / size == j / size`.
    Chunk {
        /// Chunk length `C`.
        size: u64,
    },
    /// `j < len`.
    Prefix {
        /// Prefix length `N`.
        len: u64,
    },
    /// `seg_q[b, i] == seg_kv[b, j]`, both non-negative.
    Document(Arc<Segments>),
    /// A boolean array.
    Dense(Arc<DenseMask>),
    /// Every operand allows the pair.
    And(Vec<Mask>),
    /// Some operand allows the pair.
    Or(Vec<Mask>),
    /// The operand does not allow the pair.
    Not(Box<Mask>),
    /// Head `h` uses expression `h`.
    Heads(Vec<Mask>),
}

/// Which plan dimensions a mask varies along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dependence {
    /// Differs between batch rows.
    pub batch: bool,
    /// Differs between heads.
    pub heads: bool,
}

impl Mask {
    /// `full`: every pair allowed.
    pub fn full() -> Self {
        Mask::Full
    }
    /// `causal`: `i >= j`.
    pub fn causal() -> Self {
        Mask::Causal { offset: 0 }
    }
    /// `causal(offset=N)`: `i + N >= j`.
    pub fn causal_offset(offset: i64) -> Self {
        Mask::Causal { offset }
    }
    /// `i - left <= j <= i + right`.
    pub fn window(left: i64, right: i64) -> Self {
        Mask::Window { left, right }
    }
    /// `chunk(C)`: `i / C == j / C`.
    pub fn chunk(size: u64) -> Self {
        Mask::Chunk { size }
    }
    /// `prefix(N)`: `j < N`.
    pub fn prefix(len: u64) -> Self {
        Mask::Prefix { len }
    }
    /// `document`: same non-negative segment id (see [`Segments`]).
    pub fn document(segments: Arc<Segments>) -> Self {
        Mask::Document(segments)
    }
    /// `dense(F)`: the boolean array.
    pub fn dense(mask: DenseMask) -> Self {
        Mask::Dense(Arc::new(mask))
    }
    /// `heads(e0, e1, ...)`: head `h` uses `per_head[h]`.
    pub fn heads(per_head: Vec<Mask>) -> Self {
        Mask::Heads(per_head)
    }

    /// Token-level semantics: may query `i` of batch row `b`, head `h` attend key `j`?
    /// Callers must pass in-range indices of a mask that passed [`Mask::validate`].
    pub fn allowed(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (ii, jj) = (i as i64, j as i64);
        match self {
            Mask::Full => true,
            Mask::Causal { offset } => ii + offset >= jj,
            Mask::Window { left, right } => ii - left <= jj && jj <= ii + right,
            Mask::Chunk { size } => i as u64 / size == j as u64 / size,
            Mask::Prefix { len } => (j as u64) < *len,
            Mask::Document(s) => {
                let a = s.q.row(b)[i];
                a >= 0 && a == s.kv.row(b)[j]
            }
            Mask::Dense(d) => d.get(d.slice_index(b, h), i, j),
            Mask::And(v) => v.iter().all(|m| m.allowed(b, h, i, j)),
            Mask::Or(v) => v.iter().any(|m| m.allowed(b, h, i, j)),
            Mask::Not(m) => !m.allowed(b, h, i, j),
            Mask::Heads(v) => v[h].allowed(b, h, i, j),
        }
    }

    /// Checks the mask against a problem shape: leaf parameters, segment lengths and rows,
    /// dense shapes, and the number of `heads(...)` entries.
    pub fn validate(&self, batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<()> {
        match self {
            Mask::Full | Mask::Causal { .. } | Mask::Window { .. } | Mask::Prefix { .. } => Ok(()),
            Mask::Chunk { size } => {
                if *size == 0 {
                    Err(Error::invalid("chunk(C)", "C >= 1", 0))
                } else {
                    Ok(())
                }
            }
            Mask::Document(s) => {
                for (arg, ids, len) in [("q-segments", &s.q, q_len), ("kv-segments", &s.kv, kv_len)]
                {
                    if ids.len() != len {
                        return Err(Error::invalid(
                            arg,
                            format!("length {len} (the sequence length)"),
                            ids.len(),
                        ));
                    }
                    if ids.rows() != 1 && ids.rows() != batch {
                        return Err(Error::invalid(
                            arg,
                            format!("1 or {batch} rows (the batch size)"),
                            ids.rows(),
                        ));
                    }
                }
                Ok(())
            }
            Mask::Dense(d) => {
                if d.q_len() != q_len || d.kv_len() != kv_len {
                    return Err(Error::invalid(
                        format!("dense({})", d.label()),
                        format!("[.., {q_len}, {kv_len}] (Lq, Lkv)"),
                        format!("[.., {}, {}]", d.q_len(), d.kv_len()),
                    ));
                }
                if d.heads() != 1 && d.heads() != heads {
                    return Err(Error::invalid(
                        format!("dense({})", d.label()),
                        format!("1 or {heads} heads"),
                        d.heads(),
                    ));
                }
                if d.batch() != 1 && d.batch() != batch {
                    return Err(Error::invalid(
                        format!("dense({})", d.label()),
                        format!("1 or {batch} batch rows"),
                        d.batch(),
                    ));
                }
                Ok(())
            }
            Mask::And(v) | Mask::Or(v) => {
                if v.is_empty() {
                    return Err(Error::invalid("mask", "at least one operand", "none"));
                }
                v.iter()
                    .try_for_each(|m| m.validate(batch, heads, q_len, kv_len))
            }
            Mask::Not(m) => m.validate(batch, heads, q_len, kv_len),
            Mask::Heads(v) => {
                if v.len() != heads {
                    return Err(Error::invalid(
                        "heads(...)",
                        format!("{heads} expressions (one per head)"),
                        v.len(),
                    ));
                }
                v.iter()
                    .try_for_each(|m| m.validate(batch, heads, q_len, kv_len))
            }
        }
    }

    /// Along which of batch and heads the mask can differ.
    pub fn dependence(&self) -> Dependence {
        match self {
            Mask::Full
            | Mask::Causal { .. }
            | Mask::Window { .. }
            | Mask::Chunk { .. }
            | Mask::Prefix { .. } => Dependence::default(),
            Mask::Document(s) => Dependence {
                batch: s.rows() > 1,
                heads: false,
            },
            Mask::Dense(d) => Dependence {
                batch: d.batch() > 1,
                heads: d.heads() > 1,
            },
            Mask::And(v) | Mask::Or(v) => v.iter().fold(Dependence::default(), |a, m| {
                let d = m.dependence();
                Dependence {
                    batch: a.batch || d.batch,
                    heads: a.heads || d.heads,
                }
            }),
            Mask::Not(m) => m.dependence(),
            Mask::Heads(v) => Dependence {
                batch: v.iter().any(|m| m.dependence().batch),
                heads: true,
            },
        }
    }

    /// Stable canonical text: `&`/`|` operands flattened, sorted and deduplicated, double
    /// negation removed, every parameter explicit, data leaves named by their BLAKE3 digest.
    /// Equal canonical forms mean equal masks.
    pub fn canonical(&self) -> String {
        self.canonical_with(&|m, out| match m {
            Mask::Document(s) => {
                let _ = write!(
                    out,
                    "document#{}:{}",
                    hex8(s.q.digest()),
                    hex8(s.kv.digest())
                );
            }
            Mask::Dense(d) => {
                let _ = write!(out, "dense#{}", hex8(d.digest()));
            }
            _ => {}
        })
    }

    /// Canonical text of the mask seen by batch row `b` and head `h` alone: `heads(...)` is
    /// resolved and data leaves are named by the digest of the row/slice actually used. Two
    /// (b, h) with equal keys have identical token masks.
    pub fn specialized_canonical(&self, b: usize, h: usize) -> String {
        self.resolve_heads(h).canonical_with(&|m, out| match m {
            Mask::Document(s) => {
                let _ = write!(
                    out,
                    "document#{}:{}",
                    hex8(&s.q.row_digest(b)),
                    hex8(&s.kv.row_digest(b))
                );
            }
            Mask::Dense(d) => {
                let _ = write!(out, "dense#{}", hex8(&d.slice_digest(d.slice_index(b, h))));
            }
            _ => {}
        })
    }

    /// The mask with every `heads(...)` replaced by head `h`'s expression.
    pub fn resolve_heads(&self, h: usize) -> Mask {
        match self {
            Mask::Heads(v) => v[h.min(v.len().saturating_sub(1))].resolve_heads(h),
            Mask::And(v) => Mask::And(v.iter().map(|m| m.resolve_heads(h)).collect()),
            Mask::Or(v) => Mask::Or(v.iter().map(|m| m.resolve_heads(h)).collect()),
            Mask::Not(m) => Mask::Not(Box::new(m.resolve_heads(h))),
            other => other.clone(),
        }
    }

    fn canonical_with(&self, data: &dyn Fn(&Mask, &mut String)) -> String {
        match self {
            Mask::Full => "full".into(),
            Mask::Causal { offset } => format!("causal(offset={offset})"),
            Mask::Window { left, right } => format!("window({left},{right})"),
            Mask::Chunk { size } => format!("chunk({size})"),
            Mask::Prefix { len } => format!("prefix({len})"),
            Mask::Document(_) | Mask::Dense(_) => {
                let mut s = String::new();
                data(self, &mut s);
                s
            }
            Mask::And(_) | Mask::Or(_) => {
                let is_and = matches!(self, Mask::And(_));
                let mut parts = Vec::new();
                self.flatten(is_and, &mut |m| parts.push(m.canonical_with(data)));
                parts.sort();
                parts.dedup();
                if parts.len() == 1 {
                    return parts.pop().unwrap_or_default();
                }
                let sep = if is_and { "&" } else { "|" };
                format!("{}({})", if is_and { "and" } else { "or" }, parts.join(sep))
            }
            Mask::Not(m) => match m.as_ref() {
                Mask::Not(inner) => inner.canonical_with(data),
                other => format!("!{}", other.canonical_with(data)),
            },
            Mask::Heads(v) => {
                let parts: Vec<String> = v.iter().map(|m| m.canonical_with(data)).collect();
                format!("heads({})", parts.join(","))
            }
        }
    }

    /// Visits the operands of nested same-kind `&` (or `|`) nodes in order.
    fn flatten(&self, is_and: bool, f: &mut dyn FnMut(&Mask)) {
        match self {
            Mask::And(v) if is_and => v.iter().for_each(|m| m.flatten(is_and, f)),
            Mask::Or(v) if !is_and => v.iter().for_each(|m| m.flatten(is_and, f)),
            Mask::Not(m) if matches!(m.as_ref(), Mask::Not(_)) => {
                if let Mask::Not(inner) = m.as_ref() {
                    inner.flatten(is_and, f)
                }
            }
            other => f(other),
        }
    }
}

fn hex8(d: &[u8; 32]) -> String {
    d[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The text form (parseable by [`crate::parse`] given the same data bindings).
impl std::fmt::Display for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn join(f: &mut std::fmt::Formatter<'_>, v: &[Mask], sep: &str) -> std::fmt::Result {
            for (k, m) in v.iter().enumerate() {
                if k > 0 {
                    f.write_str(sep)?;
                }
                match m {
                    Mask::And(_) | Mask::Or(_) => write!(f, "({m})")?,
                    _ => write!(f, "{m}")?,
                }
            }
            Ok(())
        }
        match self {
            Mask::Full => f.write_str("full"),
            Mask::Causal { offset: 0 } => f.write_str("causal"),
            Mask::Causal { offset } => write!(f, "causal(offset={offset})"),
            Mask::Window { left, right: 0 } => write!(f, "window({left})"),
            Mask::Window { left, right } => write!(f, "window({left}, {right})"),
            Mask::Chunk { size } => write!(f, "chunk({size})"),
            Mask::Prefix { len } => write!(f, "prefix({len})"),
            Mask::Document(_) => f.write_str("document"),
            Mask::Dense(d) => write!(f, "dense({})", d.label()),
            Mask::And(v) => join(f, v, " & "),
            Mask::Or(v) => join(f, v, " | "),
            Mask::Not(m) => match m.as_ref() {
                Mask::And(_) | Mask::Or(_) => write!(f, "!({m})"),
                _ => write!(f, "!{m}"),
            },
            Mask::Heads(v) => {
                f.write_str("heads(")?;
                for (k, m) in v.iter().enumerate() {
                    if k > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{m}")?;
                }
                f.write_str(")")
            }
        }
    }
}

impl std::ops::BitAnd for Mask {
    type Output = Mask;
    fn bitand(self, rhs: Mask) -> Mask {
        Mask::And(vec![self, rhs])
    }
}

impl std::ops::BitOr for Mask {
    type Output = Mask;
    fn bitor(self, rhs: Mask) -> Mask {
        Mask::Or(vec![self, rhs])
    }
}

impl std::ops::Not for Mask {
    type Output = Mask;
    fn not(self) -> Mask {
        Mask::Not(Box::new(self))
    }
}
