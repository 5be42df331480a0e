//! The mask expression language: a text view of [`Mask`].
//!
//! Grammar (`!` binds tighter than `&`, which binds tighter than `|`):
//! ```text
//! expr    := and ('|' and)*
//! and     := unary ('&' unary)*
//! unary   := '!' unary | primary
//! primary := '(' expr ')' | 'heads' '(' expr (',' expr)* ')' | leaf
//! leaf    := full | causal ['(' [offset=]INT ')'] | window '(' [left=]INT [',' [right=]INT] ')'
//!          | chunk '(' [size=]INT ')' | prefix '(' [len=]INT ')' | document | dense '(' PATH ')'
//! ```
//! Errors carry the 1-based column and what was expected there.

use crate::data::{DenseMask, Segments};
use crate::expr::Mask;
use std::sync::Arc;
use tessera_core::{Error, Result};

/// Supplies the data that `document` and `dense(PATH)` leaves refer to.
pub trait Resolver {
    /// Segment ids for `document` (from `--segments`, or `--q-segments`/`--kv-segments`).
    fn segments(&self) -> Result<Arc<Segments>>;
    /// The boolean array stored at `path`.
    fn dense(&self, path: &str) -> Result<DenseMask>;
}

/// A resolver with no data: `document` and `dense` leaves are errors.
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
            format!("dense({path})"),
            "a dense mask loader",
            "none available",
        ))
    }
}

/// Deepest nesting of `(`, `!` and `heads(...)` the parser accepts: every algorithm over a mask
/// tree (canonical form, planning, evaluation) recurses at most this deep (times a small factor).
pub const MAX_DEPTH: usize = 256;

/// Longest expression the parser accepts, in bytes.
pub const MAX_LEN: usize = 1 << 20;

/// Parses a mask expression, resolving data leaves through `resolver`. Input longer than
/// [`MAX_LEN`] bytes or nested deeper than [`MAX_DEPTH`] is a parse error naming the limit.
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
                "a mask leaf (full, causal, window, chunk, prefix, document, dense, heads), '(' or '!'",
            )),
            "full" => {
                self.no_args()?;
                Ok(Mask::Full)
            }
            "document" => {
                self.no_args()?;
                self.resolver.segments().map(Mask::Document)
            }
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
                self.skip_ws();
                let path_pos = self.pos;
                let path = self.path()?;
                self.expect(')')?;
                if path.is_empty() {
                    return Err(self.error_at(path_pos, "a file path", "nothing".into()));
                }
                Ok(Mask::Dense(Arc::new(self.resolver.dense(&path)?)))
            }
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
                "a mask leaf (full, causal, window, chunk, prefix, document, dense, heads)",
                format!("unknown leaf '{other}'"),
            )),
        }
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
        let mut out = vec![None; names.len()];
        let save = self.pos;
        if !self.eat('(') {
            self.pos = save;
            if required > 0 {
                self.skip_ws();
                return Err(self.error("'(' followed by the leaf's arguments"));
            }
            return Ok(out);
        }
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

    /// A dense file path: quoted, or raw up to the matching ')'.
    fn path(&mut self) -> Result<String> {
        if let Some(q @ ('"' | '\'')) = self.peek() {
            let start = self.pos;
            self.pos += 1;
            let mut s = String::new();
            while let Some(c) = self.peek() {
                self.pos += 1;
                if c == q {
                    return Ok(s);
                }
                s.push(c);
            }
            return Err(self.error_at(start, "a closing quote", "end of input".into()));
        }
        let mut s = String::new();
        let mut depth = 0;
        while let Some(c) = self.peek() {
            if c == '(' {
                depth += 1;
            } else if c == ')' {
                if depth == 0 {
                    break;
                }
                depth -= 1;
            }
            s.push(c);
            self.pos += 1;
        }
        Ok(s.trim().to_string())
    }
}
