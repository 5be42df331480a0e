//! Tensor files: `.npy` and `.safetensors` reading and atomic writing (docs/semantics.md#tensors, docs/semantics.md#errors).
//!
//! Contract:
//! - [`read_tensor`] takes `PATH` or `PATH:NAME` and picks the format from the extension
//!   (`.npy` or `.safetensors`, case-insensitive); any other extension is an error.
//! - Every failure is a [`tessera_core::Error`] naming the file or argument, what was expected and
//!   what was found; nothing panics on malformed files.
//! - Every writer goes through [`atomic_write`], so a failed write never leaves a partial file
//!   and never damages an existing one.
//! - One `.npy` codec ([`NpyArray`] for raw arrays, the same parser and encoder for tensors).
//! - Readers hold at most the file in memory plus the decoded tensor, and a file that would take
//!   more than the memory budget ([`tessera_core::budget`]) is refused before it is read; no
//!   allocation is sized by a header before the header is checked against the file's length.
//!
//! ```
//! use tessera_core::{Tensor, TensorData};
//!
//! let dir = tempfile::tempdir()?;
//! let t = Tensor::new(vec![2, 3], TensorData::I32(vec![1, 2, 3, 4, 5, 6]))?;
//! for name in ["t.npy", "t.safetensors"] {
//!     let path = dir.path().join(name);
//!     tessera_io::write_tensor(&path, &t)?;
//!     assert_eq!(tessera_io::read_tensor(&path.display().to_string(), None)?, t);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod atomic;
mod npy;
mod sfts;

pub use atomic::{
    atomic_create_bytes, atomic_write, atomic_write_bytes, atomic_write_with, Durability,
};
pub use npy::{open_npy_ints, NpyArray, NpyDType, NpyInts};

use std::path::Path;
use tessera_core::tensor::TensorView;
use tessera_core::{DType, Error, Result, Tensor};

/// File formats recognised by extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Npy,
    Safetensors,
}

fn format_of(path: &Path) -> Result<Format> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("npy") {
        Ok(Format::Npy)
    } else if ext.eq_ignore_ascii_case("safetensors") {
        Ok(Format::Safetensors)
    } else {
        Err(Error::invalid(
            "tensor file",
            "a path ending in .npy or .safetensors",
            path.display(),
        ))
    }
}

/// Splits `PATH[:NAME]`: a spec naming an existing file is taken whole (so paths containing ':'
/// still work); otherwise it is split at the last ':'.
fn split_spec(spec: &str) -> Result<(&str, Option<&str>)> {
    if Path::new(spec).is_file() {
        return Ok((spec, None));
    }
    match spec.rfind(':') {
        Some(i) => {
            let (path, name) = (&spec[..i], &spec[i + 1..]);
            if name.is_empty() {
                return Err(Error::invalid(
                    "tensor spec",
                    "PATH or PATH:NAME with a non-empty NAME",
                    spec,
                ));
            }
            Ok((path, Some(name)))
        }
        None => Ok((spec, None)),
    }
}

/// Reads one tensor from `PATH` or `PATH:NAME`.
///
/// A `.safetensors` file holding exactly one tensor may be read without NAME. With `dtype` set, a
/// file of another dtype is an error naming both, except that an npy `<u2` file is read as bf16
/// raw bits when `dtype == Some(DType::BF16)` (and only then). f64 data is narrowed to f32.
pub fn read_tensor(spec: &str, dtype: Option<DType>) -> Result<Tensor> {
    let (path_str, name) = split_spec(spec)?;
    let path = Path::new(path_str);
    match format_of(path)? {
        Format::Npy => {
            if let Some(n) = name {
                return Err(Error::invalid(
                    "tensor spec",
                    "no tensor name for a .npy file (it holds one array)",
                    format!("{path_str}:{n}"),
                ));
            }
            npy::read_npy(path, dtype)
        }
        Format::Safetensors => sfts::read_one(path, name, dtype),
    }
}

/// Reads every tensor of a `.safetensors` file, sorted by name.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    sfts::read_all(path)
}

/// Decodes `.npy` bytes held in memory as [`read_tensor`] decodes a `.npy` file (same dtype
/// rules); `path` only names the source in errors.
pub fn decode_npy(bytes: &[u8], path: &Path, dtype: Option<DType>) -> Result<Tensor> {
    npy::decode_npy(bytes, path, dtype)
}

/// Decodes `.safetensors` bytes held in memory as [`read_safetensors`] decodes a file; `path`
/// only names the source in errors.
pub fn decode_safetensors(bytes: &[u8], path: &Path) -> Result<Vec<(String, Tensor)>> {
    sfts::decode_all(bytes, path)
}

/// The `.safetensors` bytes of named tensors (what [`write_safetensors`] writes). Names must be
/// unique.
pub fn encode_safetensors(tensors: &[(&str, &Tensor)]) -> Result<Vec<u8>> {
    let views: Vec<(&str, TensorView<'_>)> = tensors.iter().map(|(n, t)| (*n, t.view())).collect();
    sfts::encode_all(&views)
}

/// Reads a whole input file after checking that it is a regular file and that holding it (and
/// a decoded copy of about the same size) fits the memory budget.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::invalid(
            "input file",
            "a file",
            format!("directory {}", path.display()),
        ));
    }
    tessera_core::budget::check(
        || format!("reading {}", path.display()),
        2 * meta.len() as u128,
    )?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Writes one tensor, format by extension: `.npy` (bf16 as `<u2` raw bits) or `.safetensors`
/// (under the name `tensor`). Atomic.
pub fn write_tensor(path: &Path, t: &Tensor) -> Result<()> {
    match format_of(path)? {
        Format::Npy => atomic_write(path, |w| npy::write_npy(w, path, t)),
        Format::Safetensors => write_safetensors(path, &[("tensor", t)]),
    }
}

/// Writes named tensors to a `.safetensors` file. Names must be unique. Atomic.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let views: Vec<(&str, TensorView<'_>)> = tensors.iter().map(|(n, t)| (*n, t.view())).collect();
    write_safetensors_views(path, &views)
}

/// Like [`write_safetensors`] for borrowed views, so callers holding plain vectors need not copy
/// them into owned tensors first. Each view's element count must match its shape. Atomic.
pub fn write_safetensors_views(path: &Path, tensors: &[(&str, TensorView<'_>)]) -> Result<()> {
    atomic_write(path, |w| sfts::write(w, path, tensors))
}

/// The dtype check shared by both readers: `found_descr` is the file's own spelling.
pub(crate) fn check_dtype(
    path: &Path,
    want: Option<DType>,
    got: DType,
    found_descr: &str,
) -> Result<()> {
    match want {
        Some(w) if w != got => Err(Error::invalid(
            format!("dtype of {}", path.display()),
            w.name(),
            format!("{got} (stored as {found_descr})"),
        )),
        _ => Ok(()),
    }
}
