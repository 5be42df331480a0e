//! Minimal `.npy` / `.npz` encoding for the exported arrays.
//!
//! Contract: [`write_npz`] writes a zip of `NAME.npy` members (stored, uncompressed, as
//! `numpy.savez` does) atomically: a temporary file in the destination directory, then a rename.
//! [`read_npz`] reads back what numpy or this module wrote for the dtypes used here (`|b1`,
//! `|i1`, `<i2`, `<i4`, `<i8`, C order).

use std::io::{Read, Write};
use std::path::Path;
use tessera_core::{Error, Result};

/// Element types of the exported arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    I8,
    I16,
    I32,
    I64,
}

impl DType {
    /// The numpy `descr` string.
    pub fn descr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::I8 => "|i1",
            DType::I16 => "<i2",
            DType::I32 => "<i4",
            DType::I64 => "<i8",
        }
    }

    /// The numpy name (`int8`, `bool`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 => 1,
            DType::I16 => 2,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    fn from_descr(s: &str) -> Option<DType> {
        Some(match s {
            "|b1" | "b1" | "?" | "|?" => DType::Bool,
            "|i1" | "i1" | "<i1" => DType::I8,
            "<i2" => DType::I16,
            "<i4" => DType::I32,
            "<i8" => DType::I64,
            _ => return None,
        })
    }
}

/// One array as stored in an `.npy` member: dtype, C-order shape and little-endian bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyArray {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl NpyArray {
    /// Encodes integer values as `dtype` (values must fit; exporters guarantee it).
    pub fn from_ints(
        dtype: DType,
        shape: Vec<usize>,
        values: impl ExactSizeIterator<Item = i64>,
    ) -> Self {
        let mut bytes = Vec::with_capacity(values.len() * dtype.size());
        for v in values {
            match dtype {
                DType::Bool => bytes.push((v != 0) as u8),
                DType::I8 => bytes.push(v as i8 as u8),
                DType::I16 => bytes.extend_from_slice(&(v as i16).to_le_bytes()),
                DType::I32 => bytes.extend_from_slice(&(v as i32).to_le_bytes()),
                DType::I64 => bytes.extend_from_slice(&v.to_le_bytes()),
            }
        }
        NpyArray {
            dtype,
            shape,
            bytes,
        }
    }

    pub fn from_bools(shape: Vec<usize>, values: &[bool]) -> Self {
        NpyArray {
            dtype: DType::Bool,
            shape,
            bytes: values.iter().map(|&b| b as u8).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to i64 (bools as 0/1).
    pub fn to_i64(&self) -> Vec<i64> {
        let b = &self.bytes;
        match self.dtype {
            DType::Bool => b.iter().map(|&x| (x != 0) as i64).collect(),
            DType::I8 => b.iter().map(|&x| x as i8 as i64).collect(),
            DType::I16 => b
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect(),
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        }
    }

    /// The `.npy` file bytes (format version 1.0).
    pub fn to_npy(&self) -> Vec<u8> {
        let shape = match self.shape.len() {
            0 => "()".to_string(),
            1 => format!("({},)", self.shape[0]),
            _ => format!(
                "({})",
                self.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut header = format!(
            "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
            self.dtype.descr(),
            shape
        );
        // Magic (6) + version (2) + header length (2) + header, padded to 64 bytes, ending in '\n'.
        let total = 10 + header.len() + 1;
        header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
        header.push('\n');
        let mut out = Vec::with_capacity(10 + header.len() + self.bytes.len());
        out.extend_from_slice(b"\x93NUMPY\x01\x00");
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&self.bytes);
        out
    }

    /// Parses `.npy` bytes (versions 1.0-3.0, C order, the dtypes of [`DType`]).
    pub fn from_npy(data: &[u8]) -> std::result::Result<Self, String> {
        if data.len() < 10 || &data[..6] != b"\x93NUMPY" {
            return Err("not an .npy file (bad magic)".into());
        }
        let (hlen, start) = match data[6] {
            1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10),
            2 | 3 => {
                if data.len() < 12 {
                    return Err("truncated .npy header".into());
                }
                (
                    u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
                    12,
                )
            }
            v => return Err(format!("unsupported .npy version {v}")),
        };
        let header = data
            .get(start..start + hlen)
            .ok_or("truncated .npy header")?;
        let header = std::str::from_utf8(header).map_err(|_| "non-UTF-8 .npy header")?;
        let field = |key: &str| -> std::result::Result<&str, String> {
            let k = format!("'{key}':");
            let at = header.find(&k).ok_or(format!("header lacks {key}"))?;
            Ok(header[at + k.len()..].trim_start())
        };
        let descr = field("descr")?;
        let descr = descr
            .strip_prefix('\'')
            .and_then(|s| s.split('\'').next())
            .ok_or("bad descr")?;
        let dtype = DType::from_descr(descr).ok_or(format!("unsupported dtype {descr}"))?;
        if field("fortran_order")?.starts_with("True") {
            return Err("Fortran-order arrays are not supported".into());
        }
        let shape_s = field("shape")?;
        let shape_s = shape_s
            .strip_prefix('(')
            .and_then(|s| s.split(')').next())
            .ok_or("bad shape")?;
        let mut shape = Vec::new();
        for part in shape_s.split(',') {
            let p = part.trim();
            if !p.is_empty() {
                shape.push(
                    p.parse::<usize>()
                        .map_err(|_| format!("bad shape entry {p}"))?,
                );
            }
        }
        let n: usize = shape.iter().product();
        let body = &data[start + hlen..];
        if body.len() != n * dtype.size() {
            return Err(format!(
                "expected {} data bytes for shape {shape:?}, found {}",
                n * dtype.size(),
                body.len()
            ));
        }
        Ok(NpyArray {
            dtype,
            shape,
            bytes: body.to_vec(),
        })
    }
}

/// Writes `arrays` as an `.npz` (members `NAME.npy`, stored) to `path`, atomically.
pub fn write_npz(path: &Path, arrays: &[(String, NpyArray)]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".tessera-export-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    {
        let file = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file());
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
        let mut file = zw.finish().map_err(|e| zip_err(path, e))?;
        file.flush().map_err(|e| Error::io(path, e))?;
    }
    tmp.as_file().sync_all().map_err(|e| Error::io(path, e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// Reads every `NAME.npy` member of an `.npz`, in archive order.
pub fn read_npz(path: &Path) -> Result<Vec<(String, NpyArray)>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
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
        let mut bytes = Vec::with_capacity(member.size() as usize);
        member
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        let arr = NpyArray::from_npy(&bytes)
            .map_err(|m| Error::format(path, format!("member {name}: {m}")))?;
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

    pub fn get(&self, name: &str) -> Option<&NpyArray> {
        self.arrays.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    pub fn need(&self, name: &str) -> Result<&NpyArray> {
        self.get(name)
            .ok_or_else(|| Error::format(&self.path, format!("missing array {name}")))
    }

    /// A small int64 metadata vector of exactly `n` entries.
    pub fn meta(&self, name: &str, n: usize) -> Result<Vec<usize>> {
        let a = self.need(name)?;
        let v = a.to_i64();
        if v.len() != n || v.iter().any(|&x| x < 0) {
            return Err(Error::format(
                &self.path,
                format!("{name}: expected {n} non-negative integers, found {v:?}"),
            ));
        }
        Ok(v.into_iter().map(|x| x as usize).collect())
    }
}
