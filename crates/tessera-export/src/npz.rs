//! `.npz` archives of the exported arrays.
//!
//! Contract: [`write_npz`] writes a zip of `NAME.npy` members (stored, uncompressed, as
//! `numpy.savez` does) atomically through [`tessera_io::atomic_write`]; the members are encoded
//! by tessera-io's `.npy` codec ([`NpyArray`]). [`read_npz`] reads back what numpy or this
//! module wrote for the dtypes of [`NpyDType`] (C order).

use std::io::{Read, Write};
use std::path::Path;
use tessera_core::{Error, Result};
pub use tessera_io::{NpyArray, NpyDType};

/// Writes `arrays` as an `.npz` (members `NAME.npy`, stored) to `path`, atomically.
pub fn write_npz(path: &Path, arrays: &[(String, NpyArray)]) -> Result<()> {
    tessera_io::atomic_write_with(path, tessera_io::Durability::Synced, |file| {
        let mut zw = zip::ZipWriter::new(file);
        for (name, arr) in arrays {
            let bytes = arr.to_npy();
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Stored)
                .large_file(bytes.len() as u64 >= u32::MAX as u64);
            zw.start_file(format!("{name}.npy"), opts)
                .map_err(|e| zip_err(path, e))?;
            zw.write_all(&bytes).map_err(|e| Error::io(path, e))?;
        }
        zw.finish().map_err(|e| zip_err(path, e))?;
        Ok(())
    })
}

/// Reads every `NAME.npy` member of an `.npz`, in archive order. Members are stored (not
/// compressed), so no member holds more bytes than the file: sizes declared in the archive are
/// never trusted for allocation.
pub fn read_npz(path: &Path) -> Result<Vec<(String, NpyArray)>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    tessera_core::budget::check(
        || format!("reading {}", path.display()),
        2 * file_len as u128,
    )?;
    let mut za =
        zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| zip_err(path, e))?;
    let mut out = Vec::with_capacity(za.len());
    for i in 0..za.len() {
        let mut member = za.by_index(i).map_err(|e| zip_err(path, e))?;
        let name = member.name().map_err(|e| zip_err(path, e))?.to_string();
        let Some(key) = name.strip_suffix(".npy") else {
            continue;
        };
        let key = key.to_string();
        // A hostile header can declare any size: reserve no more than the file holds, and read
        // no more than that either.
        let mut bytes = Vec::with_capacity(member.size().min(file_len) as usize);
        (&mut member)
            .take(file_len)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        let arr = NpyArray::from_npy(&bytes, path).map_err(|e| match e {
            Error::Format { msg, .. } => Error::format(path, format!("member {name}: {msg}")),
            e => e,
        })?;
        out.push((key, arr));
    }
    Ok(out)
}

fn zip_err(path: &Path, e: zip::result::ZipError) -> Error {
    match e {
        zip::result::ZipError::Io(io) => Error::io(path, io),
        other => Error::format(path, format!("zip: {other}")),
    }
}

/// A small int64 metadata vector (shapes, tags, options).
pub(crate) fn meta(v: &[usize]) -> NpyArray {
    NpyArray::from_ints(NpyDType::I64, vec![v.len()], v.iter().map(|&x| x as i64))
}

/// Name → array lookup over a read `.npz`.
pub(crate) struct Members {
    pub path: std::path::PathBuf,
    pub arrays: Vec<(String, NpyArray)>,
}

impl Members {
    pub fn read(path: &Path) -> Result<Self> {
        Ok(Members {
            path: path.to_path_buf(),
            arrays: read_npz(path)?,
        })
    }

    /// Reads a Tessera export: the `tessera_export` tag must be `tag` (`what` names the kind).
    pub fn read_export(path: &Path, tag: [usize; 2], what: &str) -> Result<Self> {
        let m = Self::read(path)?;
        let found = m.meta("tessera_export", 2)?;
        if found != tag {
            let msg = format!("not a Tessera {what} export (tag {found:?})");
            return Err(Error::format(path, msg));
        }
        Ok(m)
    }

    pub fn get(&self, name: &str) -> Option<&NpyArray> {
        self.arrays.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    pub fn need(&self, name: &str) -> Result<&NpyArray> {
        self.get(name)
            .ok_or_else(|| Error::format(&self.path, format!("missing array {name}")))
    }

    /// The values of array `name` as i64, which must have dtype `want` and shape `shape`.
    pub fn ints(&self, name: &str, want: NpyDType, shape: &[usize]) -> Result<Vec<i64>> {
        let a = self.need(name)?;
        match a.to_i64() {
            Some(v) if a.dtype == want && a.shape == shape => Ok(v),
            _ => Err(Error::format(
                &self.path,
                format!(
                    "{name}: expected {} {shape:?}, found {} {:?}",
                    want.name(),
                    a.dtype.name(),
                    a.shape
                ),
            )),
        }
    }

    /// A small int64 metadata vector of exactly `n` entries.
    pub fn meta(&self, name: &str, n: usize) -> Result<Vec<usize>> {
        let a = self.need(name)?;
        let v = a.to_i64().unwrap_or_default();
        if v.len() != n || v.iter().any(|&x| x < 0) {
            return Err(Error::format(
                &self.path,
                format!("{name}: expected {n} non-negative integers, found {v:?}"),
            ));
        }
        Ok(v.into_iter().map(|x| x as usize).collect())
    }
}
