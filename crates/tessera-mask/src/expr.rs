//! The typed mask algebra and its token-level semantics.
//!
//! Contract on depth: the typed API can build trees of any depth (`!` applied 100,000 times),
//! deeper than the parser allows. Everything here that a caller can reach without validating
//! (`Drop`, `Clone`, `PartialEq`, `Debug`, `Display`, [`Mask::canonical`], [`Mask::depth`],
//! [`Mask::nodes`], [`Mask::dependence`], [`Mask::resolve_heads`], [`Mask::allowed`]) walks the
//! tree with an explicit stack, so no tree overflows the thread's stack. [`Mask::validate`]
//! refuses trees deeper than [`MAX_TREE_DEPTH`] before anything recursive (the planner) runs.

use crate::blocks::BlockSelection;
use crate::data::{BandFeatures, DenseMask, Segments};
use crate::syntax::{dense_arg, list_arg, MAX_DEPTH};
use std::fmt::Write as _;
use std::sync::Arc;
use tessera_core::{Error, Result};

/// Deepest mask tree (a leaf is depth 1) that [`Mask::validate`] accepts, and so the deepest
/// any recursive algorithm over a mask (the planner) sees. Every tree the parser builds is within
/// it: each level of `(`, `!` or `heads(` nesting adds at most three nodes (heads, or, and), so a
/// parsed tree is at most `3 * MAX_DEPTH + 3` deep.
pub const MAX_TREE_DEPTH: usize = 4 * MAX_DEPTH;

/// A boolean expression over structured mask predicates (docs/semantics.md#masks).
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
    /// `lo <= f[b, i] - g[b, j] <= hi` for the integer features `f` (queries) and `g` (keys),
    /// in exact arithmetic.
    Band {
        /// The features `f` and `g`.
        features: Arc<BandFeatures>,
        /// Smallest allowed difference.
        lo: i64,
        /// Largest allowed difference.
        hi: i64,
    },
    /// A boolean array.
    Dense(Arc<DenseMask>),
    /// Key block `j / kv_block` is selected for query block `i / q_block` (docs/semantics.md#masks).
    Blocks(Arc<BlockSelection>),
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
    /// `band(F, G, lo, hi)`: `lo <= f[i] - g[j] <= hi` (see [`BandFeatures`]); `lo > hi` is
    /// refused by [`Mask::validate`]. `causal(offset=N)` is `band(pos, pos, -N, ∞)` over
    /// positions, `window(L, R)` is `band(pos, pos, -R, L)`, `document` on ids `>= 0` is
    /// `band(ids, ids, 0, 0)`; those leaves keep their own faster planning.
    pub fn band(features: Arc<BandFeatures>, lo: i64, hi: i64) -> Self {
        Mask::Band { features, lo, hi }
    }
    /// `dense(F)`: the boolean array.
    pub fn dense(mask: DenseMask) -> Self {
        Mask::Dense(Arc::new(mask))
    }
    /// `blocks(QB, KVB, NAME)`: the pairs of the selected (query block, key block) tiles.
    pub fn blocks(selection: BlockSelection) -> Self {
        Mask::Blocks(Arc::new(selection))
    }
    /// `heads(e0, e1, ...)`: head `h` uses `per_head[h]`.
    pub fn heads(per_head: Vec<Mask>) -> Self {
        Mask::Heads(per_head)
    }

    /// Token-level semantics: may query `i` of batch row `b`, head `h` attend key `j`?
    /// Callers must pass in-range indices of a mask that passed [`Mask::validate`]; any tree
    /// depth is safe (past [`MAX_TREE_DEPTH`] levels the evaluation continues on a heap stack).
    pub fn allowed(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        self.allowed_at(b, h, i, j, 0)
    }

    /// Recursive evaluation (fast, short-circuiting) up to [`MAX_TREE_DEPTH`] levels, then
    /// [`Mask::allowed_iterative`] for what lies below.
    fn allowed_at(&self, b: usize, h: usize, i: usize, j: usize, depth: usize) -> bool {
        if depth >= MAX_TREE_DEPTH {
            return self.allowed_iterative(b, h, i, j);
        }
        let d = depth + 1;
        match self {
            Mask::And(v) => v.iter().all(|m| m.allowed_at(b, h, i, j, d)),
            Mask::Or(v) => v.iter().any(|m| m.allowed_at(b, h, i, j, d)),
            Mask::Not(m) => !m.allowed_at(b, h, i, j, d),
            Mask::Heads(v) => v[h].allowed_at(b, h, i, j, d),
            leaf => leaf.leaf_allowed(b, h, i, j),
        }
    }

    /// The same semantics without recursion: a post-order fold on an explicit stack.
    fn allowed_iterative(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        self.fold(|m, kids: Vec<bool>| match m {
            Mask::And(_) => kids.iter().all(|&x| x),
            Mask::Or(_) => kids.iter().any(|&x| x),
            Mask::Not(_) => !kids.first().copied().unwrap_or(false),
            Mask::Heads(_) => kids.get(h).copied().unwrap_or(false),
            leaf => leaf.leaf_allowed(b, h, i, j),
        })
        .unwrap_or(false)
    }

    /// A leaf's predicate, in exact (128-bit) arithmetic so that extreme offsets cannot wrap.
    fn leaf_allowed(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (ii, jj) = (i as i128, j as i128);
        match self {
            Mask::Full => true,
            Mask::Causal { offset } => ii + *offset as i128 >= jj,
            Mask::Window { left, right } => ii - *left as i128 <= jj && jj <= ii + *right as i128,
            // chunk(0) is refused by `validate`; never allowing keeps this total.
            Mask::Chunk { size } => *size != 0 && i as u64 / size == j as u64 / size,
            Mask::Prefix { len } => (j as u64) < *len,
            Mask::Document(s) => {
                let a = s.q.row(b)[i];
                a >= 0 && a == s.kv.row(b)[j]
            }
            Mask::Band { features, lo, hi } => {
                let d = features.q.row(b)[i] as i128 - features.kv.row(b)[j] as i128;
                *lo as i128 <= d && d <= *hi as i128
            }
            Mask::Dense(d) => d.get(d.slice_index(b, h), i, j),
            Mask::Blocks(s) => s.allows(s.slice_index(b, h), i, j),
            Mask::And(_) | Mask::Or(_) | Mask::Not(_) | Mask::Heads(_) => false,
        }
    }

    /// The operands of an `&`, `|`, `!` or `heads(...)` node, in order; empty for a leaf.
    pub fn children(&self) -> &[Mask] {
        match self {
            Mask::And(v) | Mask::Or(v) | Mask::Heads(v) => v,
            Mask::Not(m) => std::slice::from_ref(&**m),
            _ => &[],
        }
    }

    /// Every node of the tree in depth-first pre-order (left to right), without recursion.
    pub fn nodes(&self) -> impl Iterator<Item = &Mask> + '_ {
        let mut stack = vec![self];
        std::iter::from_fn(move || {
            let m = stack.pop()?;
            stack.extend(m.children().iter().rev());
            Some(m)
        })
    }

    /// Depth of the tree (a leaf is 1), computed without recursion.
    pub fn depth(&self) -> usize {
        let mut stack = vec![(self, 1usize)];
        let mut max = 0;
        while let Some((m, d)) = stack.pop() {
            max = max.max(d);
            stack.extend(m.children().iter().map(|c| (c, d + 1)));
        }
        max
    }

    /// Post-order fold on an explicit stack: `f(node, results of its children)`; `None` never
    /// happens (the root always yields a result).
    fn fold<T>(&self, mut f: impl FnMut(&Mask, Vec<T>) -> T) -> Option<T> {
        let mut stack: Vec<(&Mask, usize)> = vec![(self, 0)];
        let mut results: Vec<T> = Vec::new();
        while let Some((node, next)) = stack.pop() {
            let kids = node.children();
            if next < kids.len() {
                stack.push((node, next + 1));
                stack.push((&kids[next], 0));
                continue;
            }
            let args = results.split_off(results.len() - kids.len());
            results.push(f(node, args));
        }
        results.pop()
    }

    /// A copy of this node with `kids` as its operands (leaves are copied as they are).
    fn with_children(&self, kids: Vec<Mask>) -> Mask {
        match self {
            Mask::Full => Mask::Full,
            Mask::Causal { offset } => Mask::Causal { offset: *offset },
            Mask::Window { left, right } => Mask::Window {
                left: *left,
                right: *right,
            },
            Mask::Chunk { size } => Mask::Chunk { size: *size },
            Mask::Prefix { len } => Mask::Prefix { len: *len },
            Mask::Document(s) => Mask::Document(Arc::clone(s)),
            Mask::Band { features, lo, hi } => Mask::Band {
                features: Arc::clone(features),
                lo: *lo,
                hi: *hi,
            },
            Mask::Dense(d) => Mask::Dense(Arc::clone(d)),
            Mask::Blocks(s) => Mask::Blocks(Arc::clone(s)),
            Mask::And(_) => Mask::And(kids),
            Mask::Or(_) => Mask::Or(kids),
            Mask::Heads(_) => Mask::Heads(kids),
            Mask::Not(_) => Mask::Not(Box::new(kids.into_iter().next().unwrap_or(Mask::Full))),
        }
    }

    /// Same node kind and leaf parameters (operands not compared).
    fn same_node(&self, other: &Mask) -> bool {
        match (self, other) {
            (Mask::Full, Mask::Full) => true,
            (Mask::Causal { offset: a }, Mask::Causal { offset: b }) => a == b,
            (
                Mask::Window { left: a, right: b },
                Mask::Window {
                    left: c, right: d, ..
                },
            ) => a == c && b == d,
            (Mask::Chunk { size: a }, Mask::Chunk { size: b }) => a == b,
            (Mask::Prefix { len: a }, Mask::Prefix { len: b }) => a == b,
            (Mask::Document(a), Mask::Document(b)) => a == b,
            (
                Mask::Band {
                    features: f,
                    lo: a,
                    hi: b,
                },
                Mask::Band {
                    features: g,
                    lo: c,
                    hi: d,
                },
            ) => a == c && b == d && f == g,
            (Mask::Dense(a), Mask::Dense(b)) => a == b,
            (Mask::Blocks(a), Mask::Blocks(b)) => a == b,
            (Mask::And(a), Mask::And(b))
            | (Mask::Or(a), Mask::Or(b))
            | (Mask::Heads(a), Mask::Heads(b)) => a.len() == b.len(),
            (Mask::Not(_), Mask::Not(_)) => true,
            _ => false,
        }
    }

    /// Refuses trees deeper than [`MAX_TREE_DEPTH`] (they would overflow recursive planning).
    pub fn check_depth(&self) -> Result<()> {
        let depth = self.depth();
        if depth > MAX_TREE_DEPTH {
            return Err(Error::invalid(
                "mask",
                format!("an expression tree at most {MAX_TREE_DEPTH} levels deep"),
                format!("{depth} levels"),
            ));
        }
        Ok(())
    }

    /// Checks the mask against a problem shape: tree depth ([`MAX_TREE_DEPTH`]), leaf
    /// parameters (`band` bounds `lo <= hi`), segment and feature lengths and rows, dense shapes,
    /// and the number of `heads(...)` entries.
    pub fn validate(&self, batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<()> {
        self.check_depth()?;
        self.validate_bounded(batch, heads, q_len, kv_len)
    }

    /// [`Mask::validate`] below the depth check (recursion is bounded by it).
    fn validate_bounded(
        &self,
        batch: usize,
        heads: usize,
        q_len: usize,
        kv_len: usize,
    ) -> Result<()> {
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
                    check_rows(arg, ids, batch, len, "the sequence length")?;
                }
                Ok(())
            }
            Mask::Band { features, lo, hi } => {
                // Errors name the argument and the leaf it belongs to.
                let leaf = || self.to_string();
                if lo > hi {
                    return Err(Error::invalid(
                        format!("lo of {}", leaf()),
                        format!("lo <= hi ({hi})"),
                        lo,
                    ));
                }
                check_rows(
                    &format!("q_feature of {}", leaf()),
                    &features.q,
                    batch,
                    q_len,
                    "the query length",
                )?;
                check_rows(
                    &format!("kv_feature of {}", leaf()),
                    &features.kv,
                    batch,
                    kv_len,
                    "the key length",
                )
            }
            Mask::Dense(d) => {
                if d.q_len() != q_len || d.kv_len() != kv_len {
                    return Err(Error::invalid(
                        format!("dense({})", dense_arg(d.label())),
                        format!("[.., {q_len}, {kv_len}] (Lq, Lkv)"),
                        format!("[.., {}, {}]", d.q_len(), d.kv_len()),
                    ));
                }
                if d.heads() != 1 && d.heads() != heads {
                    return Err(Error::invalid(
                        format!("dense({})", dense_arg(d.label())),
                        format!("1 or {heads} heads"),
                        d.heads(),
                    ));
                }
                if d.batch() != 1 && d.batch() != batch {
                    return Err(Error::invalid(
                        format!("dense({})", dense_arg(d.label())),
                        format!("1 or {batch} batch rows"),
                        d.batch(),
                    ));
                }
                Ok(())
            }
            Mask::Blocks(s) => s.check(batch, heads, q_len, kv_len),
            Mask::And(v) | Mask::Or(v) => {
                if v.is_empty() {
                    return Err(Error::invalid("mask", "at least one operand", "none"));
                }
                v.iter()
                    .try_for_each(|m| m.validate_bounded(batch, heads, q_len, kv_len))
            }
            Mask::Not(m) => m.validate_bounded(batch, heads, q_len, kv_len),
            Mask::Heads(v) => {
                if v.len() != heads {
                    return Err(Error::invalid(
                        "heads(...)",
                        format!("{heads} expressions (one per head)"),
                        v.len(),
                    ));
                }
                v.iter()
                    .try_for_each(|m| m.validate_bounded(batch, heads, q_len, kv_len))
            }
        }
    }

    /// Along which of batch and heads the mask can differ.
    pub fn dependence(&self) -> Dependence {
        self.nodes().fold(Dependence::default(), |a, m| {
            let d = match m {
                Mask::Document(s) => Dependence {
                    batch: s.rows() > 1,
                    heads: false,
                },
                Mask::Band { features, .. } => Dependence {
                    batch: features.rows() > 1,
                    heads: false,
                },
                Mask::Dense(d) => Dependence {
                    batch: d.batch() > 1,
                    heads: d.heads() > 1,
                },
                Mask::Heads(_) => Dependence {
                    batch: false,
                    heads: true,
                },
                Mask::Blocks(s) => Dependence {
                    batch: s.batch() > 1,
                    heads: s.heads() > 1,
                },
                _ => Dependence::default(),
            };
            Dependence {
                batch: a.batch || d.batch,
                heads: a.heads || d.heads,
            }
        })
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
            Mask::Band { features, lo, hi } => {
                let (q, kv) = (features.q.digest(), features.kv.digest());
                let _ = write!(out, "band#{}:{}({lo},{hi})", hex8(q), hex8(kv));
            }
            Mask::Dense(d) => {
                let _ = write!(out, "dense#{}", hex8(d.digest()));
            }
            Mask::Blocks(s) => {
                let _ = write!(out, "blocks#{}", hex8(s.digest()));
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
            Mask::Band { features, lo, hi } => {
                let (q, kv) = (features.q.row_digest(b), features.kv.row_digest(b));
                let _ = write!(out, "band#{}:{}({lo},{hi})", hex8(&q), hex8(&kv));
            }
            Mask::Dense(d) => {
                let _ = write!(out, "dense#{}", hex8(&d.slice_digest(d.slice_index(b, h))));
            }
            Mask::Blocks(s) => {
                let _ = write!(out, "blocks#{}", hex8(&s.slice_digest(s.slice_index(b, h))));
            }
            _ => {}
        })
    }

    /// The mask with every `heads(...)` replaced by head `h`'s expression (the last one when
    /// there are fewer than `h + 1`).
    pub fn resolve_heads(&self, h: usize) -> Mask {
        self.fold(|m, mut kids: Vec<Mask>| match m {
            Mask::Heads(_) => {
                let k = h.min(kids.len().saturating_sub(1));
                if k < kids.len() {
                    kids.swap_remove(k)
                } else {
                    Mask::Heads(Vec::new())
                }
            }
            other => other.with_children(kids),
        })
        .unwrap_or(Mask::Full)
    }

    /// Canonical text on an explicit stack: a frame per node being assembled, holding the
    /// operands still to visit and the texts of those done.
    fn canonical_with(&self, data: &dyn Fn(&Mask, &mut String)) -> String {
        struct Frame<'m> {
            node: &'m Mask,
            operands: Vec<&'m Mask>,
            parts: Vec<String>,
        }
        fn frame(m: &Mask) -> Frame<'_> {
            let node = strip_double_negation(m);
            let operands = match node {
                Mask::And(_) | Mask::Or(_) => flatten(node),
                other => other.children().iter().map(strip_double_negation).collect(),
            };
            Frame {
                node,
                parts: Vec::with_capacity(operands.len()),
                operands,
            }
        }
        let mut stack = vec![frame(self)];
        let mut root = String::new();
        while let Some(top) = stack.pop() {
            if top.parts.len() < top.operands.len() {
                let next = top.operands[top.parts.len()];
                stack.push(top);
                stack.push(frame(next));
                continue;
            }
            let mut parts = top.parts;
            let text = match top.node {
                Mask::Full => "full".into(),
                Mask::Causal { offset } => format!("causal(offset={offset})"),
                Mask::Window { left, right } => format!("window({left},{right})"),
                Mask::Chunk { size } => format!("chunk({size})"),
                Mask::Prefix { len } => format!("prefix({len})"),
                Mask::Document(_) | Mask::Band { .. } | Mask::Dense(_) | Mask::Blocks(_) => {
                    let mut s = String::new();
                    data(top.node, &mut s);
                    s
                }
                Mask::And(_) | Mask::Or(_) => {
                    let is_and = matches!(top.node, Mask::And(_));
                    parts.sort();
                    parts.dedup();
                    if parts.len() == 1 {
                        parts.pop().unwrap_or_default()
                    } else {
                        let sep = if is_and { "&" } else { "|" };
                        format!("{}({})", if is_and { "and" } else { "or" }, parts.join(sep))
                    }
                }
                Mask::Not(_) => format!("!{}", parts.concat()),
                Mask::Heads(_) => format!("heads({})", parts.join(",")),
            };
            match stack.last_mut() {
                Some(parent) => parent.parts.push(text),
                None => root = text,
            }
        }
        root
    }
}

/// `m` with any even number of leading `!` removed.
fn strip_double_negation(mut m: &Mask) -> &Mask {
    while let Mask::Not(a) = m {
        match a.as_ref() {
            Mask::Not(inner) => m = inner,
            _ => break,
        }
    }
    m
}

/// The operands of `node` (an `&` or `|`) with nested same-kind nodes flattened into it, seen
/// through double negations, in order; without recursion.
fn flatten(node: &Mask) -> Vec<&Mask> {
    let is_and = matches!(node, Mask::And(_));
    let mut out = Vec::new();
    let mut stack: Vec<&Mask> = node.children().iter().rev().collect();
    while let Some(m) = stack.pop() {
        let m = strip_double_negation(m);
        match m {
            Mask::And(v) if is_and => stack.extend(v.iter().rev()),
            Mask::Or(v) if !is_and => stack.extend(v.iter().rev()),
            other => out.push(other),
        }
    }
    out
}

/// Refuses per-token data of `len` tokens that are not `len` long or not 1 or `batch` rows.
fn check_rows(
    arg: &str,
    ids: &crate::SegmentIds,
    batch: usize,
    len: usize,
    what: &str,
) -> Result<()> {
    if ids.len() != len {
        return Err(Error::invalid(
            arg,
            format!("length {len} ({what})"),
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
    Ok(())
}

fn hex8(d: &[u8; 32]) -> String {
    tessera_core::hex(&d[..16])
}

/// The text form (parseable by [`crate::parse`] given the same data bindings), written from an
/// explicit stack. `dense` and `band` names are quoted where the parser needs it (see [`crate::parse`]'s
/// rule), so the text of a parsed mask parses back to the same mask and prints identically.
impl std::fmt::Display for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        enum Item<'m> {
            Node(&'m Mask),
            Text(&'static str),
        }
        // Pushes `m` to be written, in parentheses when it is an `|`, or an `&` inside an `&`
        // or a `!` (`&` binds tighter than `|`, so `a & b | c` needs none: the printed text
        // never nests deeper than the parsed one).
        fn operand<'m>(stack: &mut Vec<Item<'m>>, m: &'m Mask, in_or: bool) {
            let wrap = match m {
                Mask::Or(_) => true,
                Mask::And(_) => !in_or,
                _ => false,
            };
            if wrap {
                stack.extend([Item::Text(")"), Item::Node(m), Item::Text("(")]);
            } else {
                stack.push(Item::Node(m));
            }
        }
        // Pushes `v` separated by `sep` (in reverse, so that they pop in order); `heads`
        // operands are whole expressions and need no parentheses.
        fn list<'m>(stack: &mut Vec<Item<'m>>, parent: &'m Mask, v: &'m [Mask], sep: &'static str) {
            for (k, m) in v.iter().enumerate().rev() {
                match parent {
                    Mask::Heads(_) => stack.push(Item::Node(m)),
                    _ => operand(stack, m, matches!(parent, Mask::Or(_))),
                }
                if k > 0 {
                    stack.push(Item::Text(sep));
                }
            }
        }
        let mut stack = vec![Item::Node(self)];
        while let Some(item) = stack.pop() {
            let m = match item {
                Item::Text(t) => {
                    f.write_str(t)?;
                    continue;
                }
                Item::Node(m) => m,
            };
            match m {
                Mask::Full => f.write_str("full")?,
                Mask::Causal { offset: 0 } => f.write_str("causal")?,
                Mask::Causal { offset } => write!(f, "causal(offset={offset})")?,
                Mask::Window { left, right: 0 } => write!(f, "window({left})")?,
                Mask::Window { left, right } => write!(f, "window({left}, {right})")?,
                Mask::Chunk { size } => write!(f, "chunk({size})")?,
                Mask::Prefix { len } => write!(f, "prefix({len})")?,
                Mask::Document(s) => match &s.names {
                    None => f.write_str("document")?,
                    Some((q, kv)) if q == kv => write!(f, "document({})", list_arg(q))?,
                    Some((q, kv)) => write!(f, "document({}, {})", list_arg(q), list_arg(kv))?,
                },
                Mask::Band { features, lo, hi } => write!(
                    f,
                    "band({}, {}, {lo}, {hi})",
                    list_arg(&features.q_name),
                    list_arg(&features.kv_name)
                )?,
                Mask::Dense(d) => write!(f, "dense({})", dense_arg(d.label()))?,
                Mask::Blocks(s) => write!(
                    f,
                    "blocks({}, {}, {})",
                    s.q_block(),
                    s.kv_block(),
                    dense_arg(s.label())
                )?,
                Mask::And(v) => list(&mut stack, m, v, " & "),
                Mask::Or(v) => list(&mut stack, m, v, " | "),
                Mask::Not(inner) => {
                    f.write_str("!")?;
                    operand(&mut stack, inner, false);
                }
                Mask::Heads(v) => {
                    f.write_str("heads(")?;
                    stack.push(Item::Text(")"));
                    list(&mut stack, m, v, ", ");
                }
            }
        }
        Ok(())
    }
}

/// `Mask(<text form>)`; written without recursion like [`Display`](std::fmt::Display).
impl std::fmt::Debug for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mask({self})")
    }
}

impl Clone for Mask {
    fn clone(&self) -> Mask {
        self.fold(|m, kids| m.with_children(kids))
            .unwrap_or(Mask::Full)
    }
}

impl PartialEq for Mask {
    fn eq(&self, other: &Mask) -> bool {
        let mut stack = vec![(self, other)];
        while let Some((a, b)) = stack.pop() {
            if !a.same_node(b) {
                return false;
            }
            stack.extend(a.children().iter().zip(b.children()));
        }
        true
    }
}

impl Drop for Mask {
    fn drop(&mut self) {
        // The default drop glue recurses once per level; a deep tree is taken apart on a heap
        // stack instead. Nodes whose operands are all leaves need no help.
        if self.children().iter().all(|c| c.children().is_empty()) {
            return;
        }
        let mut stack = Vec::new();
        detach_operands(self, &mut stack);
        while let Some(mut m) = stack.pop() {
            detach_operands(&mut m, &mut stack);
        }
    }
}

/// Moves the operands of `m` onto `out`, leaving `m` with none (a `!` keeps a `full`).
fn detach_operands(m: &mut Mask, out: &mut Vec<Mask>) {
    match m {
        Mask::And(v) | Mask::Or(v) | Mask::Heads(v) => out.append(v),
        Mask::Not(inner) => out.push(std::mem::replace(&mut **inner, Mask::Full)),
        _ => {}
    }
}

/// `a & b`: an `&` on the left absorbs the new operand (an `&` on the right its operands), so
/// chains built in a loop stay one flat node instead of a tree as deep as the chain.
impl std::ops::BitAnd for Mask {
    type Output = Mask;
    fn bitand(self, rhs: Mask) -> Mask {
        join(self, rhs, true)
    }
}

/// `a | b`, flattened like `&`.
impl std::ops::BitOr for Mask {
    type Output = Mask;
    fn bitor(self, rhs: Mask) -> Mask {
        join(self, rhs, false)
    }
}

fn join(lhs: Mask, rhs: Mask, is_and: bool) -> Mask {
    let mut ops = Vec::new();
    for mut m in [lhs, rhs] {
        let same = if is_and {
            matches!(m, Mask::And(_))
        } else {
            matches!(m, Mask::Or(_))
        };
        if same {
            detach_operands(&mut m, &mut ops);
        } else {
            ops.push(m);
        }
    }
    if is_and {
        Mask::And(ops)
    } else {
        Mask::Or(ops)
    }
}

impl std::ops::Not for Mask {
    type Output = Mask;
    fn not(self) -> Mask {
        Mask::Not(Box::new(self))
    }
}
