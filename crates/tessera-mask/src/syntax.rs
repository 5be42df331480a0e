//! What the text form's reader ([`crate::parse`]) and writer (`Display` of [`crate::Mask`]) share:
//! the nesting limit and the one rule for data names (read raw or quoted, written raw exactly
//! when the raw reading gives the name back; see the "Names of data" section of `parse`).
//!
//! Layering: this module imports nothing from the crate, so `blocks`, `expr` and `parse` all
//! build on it and no two of them import each other both ways.

/// Deepest nesting of `(`, `!` and `heads(...)` the parser accepts: every algorithm over a mask
/// tree (canonical form, planning, evaluation) recurses at most this deep (times a small factor).
pub const MAX_DEPTH: usize = 256;

/// Reads a data name from `chars` at `*pos`, leaving `*pos` after it: quoted in `"` or `'` (the
/// quote doubled inside stands for one), or raw up to the `)` closing the leaf (or, `in_list`, a
/// `,`) outside parentheses, trimmed. `Err(at)`: the quote opened at `at` is never closed.
pub(crate) fn read_name(chars: &[char], pos: &mut usize, in_list: bool) -> Result<String, usize> {
    let peek = |pos: usize| chars.get(pos).copied();
    if let Some(q @ ('"' | '\'')) = peek(*pos) {
        let start = *pos;
        *pos += 1;
        let mut s = String::new();
        while let Some(c) = peek(*pos) {
            *pos += 1;
            if c == q {
                if peek(*pos) != Some(q) {
                    return Ok(s);
                }
                // A doubled quote stands for one.
                *pos += 1;
            }
            s.push(c);
        }
        return Err(start);
    }
    let mut s = String::new();
    let mut depth = 0;
    while let Some(c) = peek(*pos) {
        if c == '(' {
            depth += 1;
        } else if c == ')' || (c == ',' && in_list) {
            if depth == 0 {
                break;
            }
            if c == ')' {
                depth -= 1;
            }
        }
        s.push(c);
        *pos += 1;
    }
    Ok(s.trim().to_string())
}

/// `name` as the argument of `dense(...)` in the text form: raw when the parser's raw reading
/// gives it back exactly, otherwise in `"` with every `"` doubled (see the module doc).
pub(crate) fn dense_arg(name: &str) -> std::borrow::Cow<'_, str> {
    quote_name(name, false)
}

/// `name` as a name argument of `band(...)`: as [`dense_arg`], and quoted also when it holds a
/// `,` outside parentheses (which would end it there).
pub(crate) fn list_arg(name: &str) -> std::borrow::Cow<'_, str> {
    quote_name(name, true)
}

fn quote_name(name: &str, in_list: bool) -> std::borrow::Cow<'_, str> {
    if raw_reads_back(name, in_list) {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut s = String::with_capacity(name.len() + 2);
    s.push('"');
    for c in name.chars() {
        if c == '"' {
            s.push('"');
        }
        s.push(c);
    }
    s.push('"');
    std::borrow::Cow::Owned(s)
}

/// Whether `name` written raw parses back to `name`: non-empty, not trimmed by the parser, not
/// read as a quoted name, and not ended early (or never) by its parentheses or, `in_list`, by a
/// comma outside them.
fn raw_reads_back(name: &str, in_list: bool) -> bool {
    if name.is_empty() || name.trim().len() != name.len() || name.starts_with(['"', '\'']) {
        return false;
    }
    let mut depth = 0usize;
    for c in name.chars() {
        match c {
            '(' => depth += 1,
            ')' => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            ',' if in_list && depth == 0 => return false,
            _ => {}
        }
    }
    depth == 0
}
