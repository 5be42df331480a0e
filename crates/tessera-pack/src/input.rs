//! Document sources for the two-pass packer.
//!
//! Contract: a [`Source`] can be walked any number of times and yields the same documents in the
//! same order each time; [`Source::lengths`] may be cheaper than [`Source::docs`] (the npy source
//! answers it from the offsets alone). Only one document is held in memory at a time. Every token
//! id handed out is in `0..=i32::MAX`; anything else is an error naming where it was found.

use crate::Progress;
use serde::Deserialize;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// Where a source reports how far a pass has got (see [`Progress`]).
pub(crate) type OnProgress<'a> = &'a mut dyn FnMut(Progress<'_>);

pub(crate) trait Source {
    /// The input file errors are reported against.
    fn path(&self) -> &Path;
    /// Calls `f` with every document's token ids, in order.
    fn docs(&mut self, f: &mut dyn FnMut(&[i32]) -> Result<()>, progress: OnProgress)
        -> Result<()>;
    /// Calls `f` with every document's length, in order.
    fn lengths(
        &mut self,
        f: &mut dyn FnMut(usize) -> Result<()>,
        progress: OnProgress,
    ) -> Result<()> {
        self.docs(&mut |d| f(d.len()), progress)
    }
}

/// In-memory documents (tests and library callers).
pub(crate) struct Memory<'a>(pub &'a [Vec<i32>]);

impl Source for Memory<'_> {
    fn path(&self) -> &Path {
        Path::new("<memory>")
    }
    fn docs(&mut self, f: &mut dyn FnMut(&[i32]) -> Result<()>, _: OnProgress) -> Result<()> {
        for (d, doc) in self.0.iter().enumerate() {
            if let Some((i, &t)) = doc.iter().enumerate().find(|(_, &t)| t < 0) {
                return Err(Error::invalid(
                    format!("document {d}, token {i}"),
                    format!("a token id in 0..={}", i32::MAX),
                    t,
                ));
            }
            f(doc)?;
        }
        Ok(())
    }
}

/// One JSON line. Unknown keys (ids, metadata) are ignored on purpose: corpora carry them.
#[derive(Deserialize)]
struct Line {
    tokens: Option<Vec<i64>>,
    text: Option<String>,
}

/// JSON lines, `{"tokens": [...]}` or `{"text": "..."}` per line.
pub(crate) struct Jsonl {
    path: PathBuf,
    size: u64,
    pass: u8,
}

impl Jsonl {
    pub(crate) fn new(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Err(Error::invalid(
                "input",
                "a JSON-lines file",
                format!("directory {}", path.display()),
            ));
        }
        Ok(Jsonl {
            path: path.to_path_buf(),
            size: meta.len(),
            pass: 0,
        })
    }
}

impl Source for Jsonl {
    fn path(&self) -> &Path {
        &self.path
    }

    fn docs(
        &mut self,
        f: &mut dyn FnMut(&[i32]) -> Result<()>,
        progress: OnProgress,
    ) -> Result<()> {
        self.pass += 1;
        let path = &self.path;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        progress(Progress::Begin {
            label: &format!("pack pass {}/2", self.pass.min(2)),
            total: self.size,
        });
        let mut reader = BufReader::with_capacity(1 << 16, file);
        let mut line = Vec::new();
        let mut ids: Vec<i32> = Vec::new();
        let mut lineno = 0usize;
        loop {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| Error::io(path, e))?;
            if n == 0 {
                break;
            }
            lineno += 1;
            progress(Progress::Advance(n as u64));
            if line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let at = |msg: String| Error::format(path, format!("line {lineno}: {msg}"));
            let parsed: Line =
                serde_json::from_slice(&line).map_err(|e| at(format!("malformed JSON: {e}")))?;
            ids.clear();
            match (parsed.tokens, parsed.text) {
                (Some(toks), None) => {
                    for (i, t) in toks.into_iter().enumerate() {
                        let v = i32::try_from(t).ok().filter(|&v| v >= 0).ok_or_else(|| {
                            at(format!(
                                "token {i} = {t} is out of range (expected 0..={})",
                                i32::MAX
                            ))
                        })?;
                        ids.push(v);
                    }
                }
                (None, Some(text)) => ids.extend(text.bytes().map(i32::from)),
                (Some(_), Some(_)) => {
                    return Err(at(
                        "has both \"tokens\" and \"text\"; give exactly one".to_string()
                    ))
                }
                (None, None) => {
                    return Err(at(
                        "expected an object with a \"tokens\" array or a \"text\" string"
                            .to_string(),
                    ))
                }
            }
            f(&ids)?;
        }
        progress(Progress::End);
        Ok(())
    }
}

/// A tokens `.npy` plus an offsets `.npy` of document boundaries.
pub(crate) struct NpyDocs {
    tokens_path: PathBuf,
    offsets: Vec<u64>,
}

impl NpyDocs {
    pub(crate) fn new(tokens_path: &Path, offsets_path: &Path) -> Result<Self> {
        let tokens = tessera_io::open_npy_ints(tokens_path)?;
        let n_tokens = tokens.len();
        let bad = |msg: String| Error::format(offsets_path, msg);
        let offsets_reader = tessera_io::open_npy_ints(offsets_path)?;
        if offsets_reader.is_empty() {
            return Err(bad(
                "offsets must have ndocs+1 entries starting with 0; found an empty array".into(),
            ));
        }
        let mut offsets = Vec::with_capacity(offsets_reader.len() as usize);
        let mut prev = 0u64;
        for (i, v) in offsets_reader.enumerate() {
            let v = v?;
            if i == 0 && v != 0 {
                return Err(bad(format!("offsets[0] must be 0, found {v}")));
            }
            let v = u64::try_from(v).map_err(|_| bad(format!("offsets[{i}] = {v} is negative")))?;
            if v < prev {
                return Err(bad(format!(
                    "offsets must be non-decreasing: offsets[{}] = {prev} > offsets[{i}] = {v}",
                    i - 1
                )));
            }
            prev = v;
            offsets.push(v);
        }
        if prev != n_tokens {
            return Err(bad(format!(
                "the last offset must equal the number of tokens in {} ({n_tokens}), found {prev}",
                tokens_path.display()
            )));
        }
        Ok(NpyDocs {
            tokens_path: tokens_path.to_path_buf(),
            offsets,
        })
    }
}

impl Source for NpyDocs {
    fn path(&self) -> &Path {
        &self.tokens_path
    }

    fn lengths(&mut self, f: &mut dyn FnMut(usize) -> Result<()>, _: OnProgress) -> Result<()> {
        for w in self.offsets.windows(2) {
            let n = usize::try_from(w[1] - w[0]).map_err(|_| {
                Error::invalid(
                    "document length",
                    "a length that fits in memory",
                    w[1] - w[0],
                )
            })?;
            f(n)?;
        }
        Ok(())
    }

    fn docs(
        &mut self,
        f: &mut dyn FnMut(&[i32]) -> Result<()>,
        progress: OnProgress,
    ) -> Result<()> {
        let path = &self.tokens_path;
        let mut reader = tessera_io::open_npy_ints(path)?;
        let total = self.offsets.last().copied().unwrap_or(0);
        if reader.len() != total {
            return Err(Error::format(
                path,
                "input changed between the two packing passes (pack a file that is not being written)",
            ));
        }
        progress(Progress::Begin {
            label: "pack tokens",
            total,
        });
        let mut ids: Vec<i32> = Vec::new();
        for (d, w) in self.offsets.windows(2).enumerate() {
            ids.clear();
            for k in w[0]..w[1] {
                let t = reader
                    .next()
                    .transpose()?
                    .ok_or_else(|| Error::format(path, format!("ended before token {k}")))?;
                let v = i32::try_from(t).ok().filter(|&v| v >= 0).ok_or_else(|| {
                    Error::format(
                        path,
                        format!(
                            "token {k} (document {d}) = {t} is out of range (expected 0..={})",
                            i32::MAX
                        ),
                    )
                })?;
                ids.push(v);
            }
            progress(Progress::Advance(w[1] - w[0]));
            f(&ids)?;
        }
        progress(Progress::End);
        Ok(())
    }
}
