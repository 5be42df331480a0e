//! The mask expression language: a text view of [`Mask`].
//!
//! Grammar (`!` binds tighter than `&`, which binds tighter than `|`):
//! ```text
//! expr    := and ('|' and)*
//! and     := unary ('&' unary)*
//! unary   := '!' unary | primary
//! primary := '(' expr ')' | 'heads' '(' expr (',' expr)* ')' | leaf
//! leaf    := full | causal ['(' [offset=]INT ')'] | window '(' [left=]INT [',' [right=]INT] ')'
//!          | chunk '(' [size=]INT ')' | prefix '(' [len=]INT ')'
//!          | document ['(' NAME [',' NAME] ')'] | dense '(' NAME ')'
//!          | band '(' NAME ',' NAME ',' [lo=]INT ',' [hi=]INT ')' | blocks '(' INT ',' INT ',' NAME ')'
//! NAME    := '"' (any char but '"' | '""')* '"' | "'" (any char but "'" | "''")* "'" | RAW
//! ```
//! Errors carry the 1-based column and what was expected there. `band(F, G, LO, HI)` allows
//! `LO <= F[i] - G[j] <= HI` for the integer features named `F` and `G` (`LO > HI` is an error).
//!
//! `document(NAME)` and `document(Q, KV)` name their segment ids (the same ids on both sides,
//! or query-side and key-side ids), read like `band` names, so that one expression can hold
//! `document` leaves over different ids; the bare `document` takes the resolver's one unnamed
//! set ([`Resolver::segments`]).
//!
//! `blocks(QB, KVB, NAME)` is a block selection (docs/semantics.md#masks, [`BlockSelection`]) of query blocks
//! of QB tokens by key blocks of KVB tokens; its name comes last and is read like a `dense` name
//! (a raw name runs to the closing `)`, commas included).
//!
//! # Names of data
//!
//! A data name (the file path of a `dense` array, a `band` feature or a `blocks` selection, or the
//! key of the Python `dense={...}` / `features={...}` / `blocks={...}` mapping) is written one of
//! three ways, and this is the one rule for what needs quoting, the same for every leaf:
//!
//! - **raw**: everything up to the `)` that closes the leaf's `(` (in `band`, also up to a `,`
//!   outside parentheses, which separates its arguments), with surrounding whitespace trimmed.
//!   Parentheses inside must balance (`dense(a b(1).npy)`, `band(f(1,2).npy, g, 0, 3)`); `&`,
//!   `|`, `!`, inner quotes, backslashes and any other character are taken as they are, and so
//!   are commas in `dense(...)`.
//! - **quoted** in `"` or `'`: every character up to the closing quote, whitespace included. The
//!   quote character itself is written twice (`dense("say ""hi""")` names `say "hi"`); there
//!   are no backslash escapes, a backslash is an ordinary character (`dense("C:\m\a.npy")`).
//!   A doubled quote used to be a parse error, so this reads no earlier text differently.
//! - an empty name is refused (a path names something).
//!
//! Printing (`Display` of [`Mask`]) writes a name raw when the raw reading gives it back
//! exactly (non-empty, no leading or trailing whitespace, not starting with a quote,
//! parentheses balanced, and in `band` no comma outside parentheses) and otherwise in `"` with
//! each `"` doubled, so every non-empty name prints to text that parses back to the same name,
//! and printing a parsed mask is a fixpoint. (An empty name can only come from the typed API; it
//! prints as `""`, which the parser refuses.)

use crate::blocks::BlockSelection;
use crate::data::{BandFeatures, DenseMask, SegmentIds, Segments};
use crate::expr::Mask;
use crate::syntax::{dense_arg, list_arg, read_name, MAX_DEPTH};
use std::sync::Arc;
use tessera_core::{Error, Result};

/// Supplies the data that `document`, `dense(NAME)` and `band(F, G, ..)` leaves refer to.
pub trait Resolver {
    /// Segment ids for `document` (from `--segments`, or `--q-segments`/`--kv-segments`).
    fn segments(&self) -> Result<Arc<Segments>>;
    /// The boolean array stored at `path`.
    fn dense(&self, path: &str) -> Result<DenseMask>;
    /// The integer feature `[L]` or `[B, L]` named `name` (a `band` argument). Resolvers
    /// without features keep this default: an error naming the feature.
    fn feature(&self, name: &str) -> Result<SegmentIds> {
        Err(Error::invalid(
            format!("band feature {}", list_arg(name)),
            "a feature loader",
            "none available",
        ))
    }
    /// The segment ids `[L]` or `[B, L]` named `name` (an argument of `document(...)`).
    /// Resolvers without named ids keep this default: an error naming the leaf.
    fn segment_ids(&self, name: &str) -> Result<SegmentIds> {
        Err(Error::invalid(
            format!("document({})", list_arg(name)),
            "named segment ids (Python: documents={'NAME': ids})",
            "none available",
        ))
    }
    /// The block selection stored at `path`, for blocks of `q_block` x `kv_block` tokens.
    /// Resolvers without block selections keep this default: an error naming the leaf.
    fn blocks(&self, path: &str, q_block: usize, kv_block: usize) -> Result<BlockSelection> {
        Err(Error::invalid(
            format!("blocks({q_block}, {kv_block}, {})", dense_arg(path)),
            "a block selection loader",
            "none available",
        ))
    }
}

/// A resolver with no data: `document`, `dense` and `band` leaves are errors.
pub struct NoData;

impl Resolver for NoData {
    fn segments(&self) -> Result<Arc<Segments>> {
        Err(Error::invalid(
            "document",
            "segment ids (--segments FILE)",
            "none given",
        ))
    }
    fn dense(&self, path: &str) -> Result<DenseMask> {
        Err(Error::invalid(
            format!("dense({})", dense_arg(path)),
            "a dense mask loader",
            "none available",
        ))
    }
}

/// Longest expression the parser accepts, in bytes.
pub const MAX_LEN: usize = 1 << 20;

/// Parses a mask expression, resolving data leaves through `resolver`. Input longer than
/// [`MAX_LEN`] bytes or nested deeper than [`MAX_DEPTH`] is a parse error naming the limit.
///
/// A data name is raw (up to the `)` closing `dense(`, or the `,` or `)` ending a `band`
/// argument; trimmed, parentheses balanced) or quoted in `"` or `'` with the quote character
/// doubled inside (`dense("say ""hi""")`); there are no backslash escapes. [`Mask`]'s `Display`
/// quotes exactly the names whose raw reading would differ, so the printed form of a parsed
/// mask parses back to it.
pub fn parse(text: &str, resolver: &dyn Resolver) -> Result<Mask> {
    if text.len() > MAX_LEN {
        return Err(Error::Parse {
            column: MAX_LEN + 1,
            expected: format!("an expression of at most {MAX_LEN} bytes"),
            found: format!("{} bytes", text.len()),
        });
    }
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
        depth: 0,
        resolver,
    };
    p.skip_ws();
    if p.peek().is_none() {
        return Err(p.error("a mask expression"));
    }
    let m = p.expr()?;
    p.skip_ws();
    if p.peek().is_some() {
        return Err(p.error("'&', '|' or the end of the expression"));
    }
    Ok(m)
}

struct Parser<'a> {
    chars: Vec<char>,
    pos: usize,
    /// Current nesting of `(`, `!` and `heads(`, bounded by [`MAX_DEPTH`].
    depth: usize,
    resolver: &'a dyn Resolver,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn found(&self) -> String {
        match self.peek() {
            None => "end of input".into(),
            Some(_) => {
                let rest: String = self.chars[self.pos..].iter().take(12).collect();
                format!("'{rest}'")
            }
        }
    }

    fn error(&self, expected: &str) -> Error {
        self.error_at(self.pos, expected, self.found())
    }

    fn error_at(&self, pos: usize, expected: &str, found: String) -> Error {
        Error::Parse {
            column: pos + 1,
            expected: expected.into(),
            found,
        }
    }

    fn eat(&mut self, c: char) -> bool {
        self.skip_ws();
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.error(&format!("'{c}'")))
        }
    }

    fn expr(&mut self) -> Result<Mask> {
        let mut v = vec![self.and()?];
        while self.eat('|') {
            v.push(self.and()?);
        }
        Ok(if v.len() == 1 {
            v.remove(0)
        } else {
            Mask::Or(v)
        })
    }

    fn and(&mut self) -> Result<Mask> {
        let mut v = vec![self.unary()?];
        while self.eat('&') {
            v.push(self.unary()?);
        }
        Ok(if v.len() == 1 {
            v.remove(0)
        } else {
            Mask::And(v)
        })
    }

    /// Runs `f` one nesting level deeper, refusing to go past [`MAX_DEPTH`].
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.depth >= MAX_DEPTH {
            return Err(self.error_at(
                self.pos.saturating_sub(1),
                &format!("at most {MAX_DEPTH} levels of nesting of '(', '!' and heads(...)"),
                "deeper nesting".into(),
            ));
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    fn unary(&mut self) -> Result<Mask> {
        if self.eat('!') {
            return self.nested(|p| Ok(Mask::Not(Box::new(p.unary()?))));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Mask> {
        self.skip_ws();
        if self.eat('(') {
            let m = self.nested(|p| p.expr())?;
            self.expect(')')?;
            return Ok(m);
        }
        let start = self.pos;
        let name = self.ident();
        match name.as_str() {
            "" => Err(self.error(
                "a mask leaf (full, causal, window, chunk, prefix, document, dense, band, blocks, heads), '(' or '!'",
            )),
            "full" => {
                self.no_args()?;
                Ok(Mask::Full)
            }
            "document" => self.document(),
            "causal" => {
                let args = self.int_args(&["offset"], 0)?;
                Ok(Mask::Causal {
                    offset: args[0].unwrap_or(0),
                })
            }
            "window" => {
                let args_pos = self.pos;
                let args = self.int_args(&["left", "right"], 1)?;
                let left = args[0].ok_or_else(|| self.error_at(args_pos, "window(L) or window(L, R)", "no L".into()))?;
                Ok(Mask::Window {
                    left,
                    right: args[1].unwrap_or(0),
                })
            }
            "chunk" | "prefix" => {
                let key = if name == "chunk" { "size" } else { "len" };
                let args_pos = self.pos;
                let args = self.int_args(&[key], 1)?;
                let v = args[0].unwrap_or(-1);
                let min = if name == "chunk" { 1 } else { 0 };
                if v < min {
                    // Point at the value, just inside the parenthesis.
                    return Err(self.error_at(
                        args_pos + 1,
                        &format!("{name}(N) with N >= {min}"),
                        v.to_string(),
                    ));
                }
                Ok(if name == "chunk" {
                    Mask::Chunk { size: v as u64 }
                } else {
                    Mask::Prefix { len: v as u64 }
                })
            }
            "dense" => {
                self.expect('(')?;
                let path = self.data_name(false, "a file path")?;
                self.expect(')')?;
                Ok(Mask::Dense(Arc::new(self.resolver.dense(&path)?)))
            }
            "band" => {
                self.expect('(')?;
                let q_name = self.data_name(true, "a feature name (the query-side feature)")?;
                self.expect(',')?;
                let kv_name = self.data_name(true, "a feature name (the key-side feature)")?;
                self.expect(',')?;
                self.skip_ws();
                let args_pos = self.pos;
                let args = self.int_list(&["lo", "hi"], 2)?;
                let (lo, hi) = (args[0].unwrap_or(0), args[1].unwrap_or(0));
                if lo > hi {
                    return Err(self.error_at(
                        args_pos,
                        "band(F, G, LO, HI) with LO <= HI",
                        format!("LO {lo} > HI {hi}"),
                    ));
                }
                let q = self.resolver.feature(&q_name)?;
                let kv = self.resolver.feature(&kv_name)?;
                Ok(Mask::band(BandFeatures::new(q_name, q, kv_name, kv), lo, hi))
            }
            "blocks" => self.blocks(),
            "heads" => {
                self.expect('(')?;
                let v = self.nested(|p| {
                    let mut v = vec![p.expr()?];
                    while p.eat(',') {
                        v.push(p.expr()?);
                    }
                    Ok(v)
                })?;
                self.expect(')')?;
                Ok(Mask::Heads(v))
            }
            other => Err(self.error_at(
                start,
                "a mask leaf (full, causal, window, chunk, prefix, document, dense, band, blocks, heads)",
                format!("unknown leaf '{other}'"),
            )),
        }
    }

    /// `document` after its name: nothing (the resolver's unnamed ids), `()`, `(NAME)` (the
    /// same ids for queries and keys) or `(Q, KV)`.
    fn document(&mut self) -> Result<Mask> {
        let save = self.pos;
        if !self.eat('(') {
            self.pos = save;
            return self.resolver.segments().map(Mask::Document);
        }
        if self.eat(')') {
            return self.resolver.segments().map(Mask::Document);
        }
        let q_name = self.data_name(true, "a segment-ids name (or ')')")?;
        let kv_name = if self.eat(',') {
            self.data_name(true, "a segment-ids name (the key-side ids)")?
        } else {
            q_name.clone()
        };
        self.expect(')')?;
        let q = self.resolver.segment_ids(&q_name)?;
        let kv = if kv_name == q_name {
            q.clone()
        } else {
            self.resolver.segment_ids(&kv_name)?
        };
        Segments::named(q_name, q, kv_name, kv).map(Mask::Document)
    }

    /// `blocks` after its name: `(QB, KVB, PATH)` with QB, KVB >= 1.
    fn blocks(&mut self) -> Result<Mask> {
        self.expect('(')?;
        let mut size = || -> Result<usize> {
            self.skip_ws();
            let at = self.pos;
            let v = self.int()?;
            self.expect(',')?;
            usize::try_from(v).ok().filter(|&v| v >= 1).ok_or_else(|| {
                self.error_at(
                    at,
                    "a block size >= 1 (blocks(QB, KVB, PATH))",
                    v.to_string(),
                )
            })
        };
        let q_block = size()?;
        let kv_block = size()?;
        let path = self.data_name(false, "a file path")?;
        self.expect(')')?;
        let sel = self.resolver.blocks(&path, q_block, kv_block)?;
        Ok(Mask::Blocks(Arc::new(sel)))
    }

    fn ident(&mut self) -> String {
        let mut s = String::new();
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == '_' {
                s.push(c);
                self.pos += 1;
            } else {
                break;
            }
        }
        s
    }

    /// Accepts nothing or an empty `()`.
    fn no_args(&mut self) -> Result<()> {
        let save = self.pos;
        if self.eat('(') {
            if self.eat(')') {
                return Ok(());
            }
            self.skip_ws();
            return Err(self.error("')' (this leaf takes no arguments)"));
        }
        self.pos = save;
        Ok(())
    }

    /// Parses an optional `(a, b, ...)` of integers, positional or `name=value`.
    /// `required` is how many must be present when there are none at all.
    fn int_args(&mut self, names: &[&str], required: usize) -> Result<Vec<Option<i64>>> {
        let save = self.pos;
        if !self.eat('(') {
            self.pos = save;
            if required > 0 {
                self.skip_ws();
                return Err(self.error("'(' followed by the leaf's arguments"));
            }
            return Ok(vec![None; names.len()]);
        }
        self.int_list(names, required)
    }

    /// The integers of an argument list, positional or `name=value`, through its closing `)`
    /// (what comes before them, `(` included, already read).
    fn int_list(&mut self, names: &[&str], required: usize) -> Result<Vec<Option<i64>>> {
        let mut out = vec![None; names.len()];
        let mut k = 0;
        loop {
            self.skip_ws();
            if k == 0 && self.peek() == Some(')') && required == 0 {
                self.pos += 1;
                return Ok(out);
            }
            let save = self.pos;
            let name = self.ident();
            let slot = if !name.is_empty() && self.eat('=') {
                names.iter().position(|n| *n == name).ok_or_else(|| {
                    self.error_at(
                        save,
                        &format!("an argument name ({})", names.join(", ")),
                        format!("'{name}'"),
                    )
                })?
            } else {
                self.pos = save;
                if k >= names.len() {
                    return Err(self.error(&format!("at most {} argument(s)", names.len())));
                }
                k
            };
            out[slot] = Some(self.int()?);
            k += 1;
            if self.eat(',') {
                continue;
            }
            self.expect(')')?;
            break;
        }
        if out.iter().take(required).any(Option::is_none) {
            return Err(self.error(&format!("{} argument(s)", names.len().min(required.max(1)))));
        }
        Ok(out)
    }

    fn int(&mut self) -> Result<i64> {
        self.skip_ws();
        let start = self.pos;
        let mut s = String::new();
        if self.peek() == Some('-') || self.peek() == Some('+') {
            s.push(self.chars[self.pos]);
            self.pos += 1;
        }
        while let Some(c) = self.peek() {
            if c.is_ascii_digit() || c == '_' {
                if c != '_' {
                    s.push(c);
                }
                self.pos += 1;
            } else {
                break;
            }
        }
        // Allow K/M suffixes (window(4K)) since masks are usually written in those units.
        let mult = match self.peek() {
            Some('k' | 'K') => {
                self.pos += 1;
                1024
            }
            Some('m' | 'M') => {
                self.pos += 1;
                1024 * 1024
            }
            _ => 1,
        };
        s.parse::<i64>()
            .ok()
            .and_then(|v| v.checked_mul(mult))
            .ok_or_else(|| {
                self.pos = start;
                self.error("an integer")
            })
    }

    /// A non-empty data name (see the module doc); `expected` says what it names when it is
    /// empty.
    fn data_name(&mut self, in_list: bool, expected: &str) -> Result<String> {
        self.skip_ws();
        let at = self.pos;
        let name = self.name(in_list)?;
        if name.is_empty() {
            return Err(self.error_at(at, expected, "nothing".into()));
        }
        Ok(name)
    }

    /// A data name (see [`read_name`]); an unclosed quote is an error at the quote.
    fn name(&mut self, in_list: bool) -> Result<String> {
        read_name(&self.chars, &mut self.pos, in_list)
            .map_err(|open| self.error_at(open, "a closing quote", "end of input".into()))
    }
}
