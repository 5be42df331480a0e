//! `.npy` reading and writing.
//!
//! Contract: reads C-order (or 1-d) arrays of the dtypes listed in [`read_npy`]; every malformed
//! or unsupported file is an [`Error::Format`] naming the file, never a panic and never an
//! allocation larger than the file itself. Writes C-order arrays with numpy's standard descrs;
//! bf16 is written as `<u2` raw bits because numpy has no bf16 dtype.

use half::{bf16, f16};
use npyz::{NpyFile, NpyHeader, Order, TypeChar, WriteOptions, WriterBuilder};
use std::io::Write;
use std::path::Path;
use tessera_core::{DType, Error, Result, Tensor, TensorData};

/// The 6-byte magic string every `.npy` file starts with.
const MAGIC: &[u8] = b"\x93NUMPY";

/// Reads a `.npy` file.
///
/// Supported descrs: `f4`, `f2`, `f8` (narrowed to f32), `b1`, `u1`, `i1`, `i4`, `i8`, and `u2`
/// as bf16 raw bits only when `want == Some(DType::BF16)` (a `u2` file is otherwise ambiguous).
/// With `want` set, any other dtype mismatch is an error naming both dtypes.
pub(crate) fn read_npy(path: &Path, want: Option<DType>) -> Result<Tensor> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |msg: String| Error::format(path, msg);

    let header_end = check_preamble(&bytes).map_err(|m| bad(m.to_string()))?;
    check_shape_text(&bytes[..header_end]).map_err(&bad)?;
    let mut cursor: &[u8] = &bytes[..header_end];
    let header = NpyHeader::from_reader(&mut cursor)
        .map_err(|e| bad(format!("not a valid .npy header: {e}")))?;
    let data = &bytes[header_end..];

    let shape: Vec<usize> = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad("shape does not fit in memory".into()))?;
    if header.order() == Order::Fortran && shape.len() > 1 {
        return Err(bad(
            "Fortran-order arrays are not supported; save a C-contiguous array (np.ascontiguousarray)"
                .into(),
        ));
    }
    let npyz::DType::Plain(ts) = header.dtype() else {
        return Err(bad(format!(
            "structured dtype {} is not supported",
            header.dtype().descr()
        )));
    };
    let descr = ts.to_string();
    let item = ts.num_bytes().unwrap_or(usize::MAX);
    let want_bytes = usize::try_from(header.len())
        .ok()
        .and_then(|n| n.checked_mul(item))
        .ok_or_else(|| bad("data size overflows".into()))?;
    if data.len() != want_bytes {
        return Err(bad(format!(
            "expected {want_bytes} data bytes for shape {shape:?} and dtype {descr}, found {} (truncated or corrupt file)",
            data.len()
        )));
    }

    let file = NpyFile::with_header(header, data);
    let decode_err = |e: std::io::Error| bad(format!("bad data: {e}"));
    let tdata = match (ts.type_char(), ts.size_field()) {
        (TypeChar::Float, 4) => TensorData::F32(file.into_vec::<f32>().map_err(decode_err)?),
        (TypeChar::Float, 2) => TensorData::F16(file.into_vec::<f16>().map_err(decode_err)?),
        (TypeChar::Float, 8) => TensorData::F32(
            file.into_vec::<f64>()
                .map_err(decode_err)?
                .into_iter()
                .map(|x| x as f32)
                .collect(),
        ),
        (TypeChar::Bool, 1) => TensorData::Bool(file.into_vec::<bool>().map_err(decode_err)?),
        (TypeChar::Uint, 1) => TensorData::U8(file.into_vec::<u8>().map_err(decode_err)?),
        (TypeChar::Int, 1) => TensorData::I8(file.into_vec::<i8>().map_err(decode_err)?),
        (TypeChar::Int, 4) => TensorData::I32(file.into_vec::<i32>().map_err(decode_err)?),
        (TypeChar::Int, 8) => TensorData::I64(file.into_vec::<i64>().map_err(decode_err)?),
        (TypeChar::Uint, 2) if want == Some(DType::BF16) => TensorData::BF16(
            file.into_vec::<u16>()
                .map_err(decode_err)?
                .into_iter()
                .map(bf16::from_bits)
                .collect(),
        ),
        (TypeChar::Uint, 2) => {
            return Err(bad(format!(
                "npy dtype {descr} holds raw 16-bit values; if they are bf16 bits, pass --dtype bf16"
            )))
        }
        _ => {
            return Err(bad(format!(
                "unsupported npy dtype {descr} (supported: f4, f2, f8, b1, u1, i1, i4, i8, and u2 as bf16 bits)"
            )))
        }
    };
    let t = Tensor::new(shape, tdata).map_err(|e| bad(e.to_string()))?;
    crate::check_dtype(path, want, t.dtype(), &descr)?;
    Ok(t)
}

/// Checks the magic string and header length against the file size, so that npyz never reads
/// (or allocates) past the end of a truncated or random file. Returns the offset of the data.
fn check_preamble(bytes: &[u8]) -> std::result::Result<usize, &'static str> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file (missing the \\x93NUMPY magic string)");
    }
    let (len_end, header_len): (usize, usize) = match bytes[6] {
        1 => (10, u16::from_le_bytes([bytes[8], bytes[9]]) as usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("truncated .npy header");
            }
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            (12, n as usize)
        }
        _ => return Err("unsupported .npy format version"),
    };
    let end = len_end
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or("truncated .npy header")?;
    Ok(end)
}

/// Rejects shapes whose element count overflows before npyz multiplies them out (which would
/// panic in debug builds). Only a pre-check: npyz still parses the header properly afterwards.
fn check_shape_text(header: &[u8]) -> std::result::Result<(), String> {
    let text = String::from_utf8_lossy(header);
    let Some(k) = text.find("shape") else {
        return Ok(()); // npyz reports the missing key
    };
    let rest = &text[k..];
    let (Some(open), Some(close)) = (rest.find(['(', '[']), rest.find([')', ']'])) else {
        return Ok(());
    };
    if close < open {
        return Ok(());
    }
    let mut total: u64 = 1;
    for part in rest[open + 1..close].split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let Ok(d) = part.parse::<u64>() else {
            return Ok(()); // not a plain integer: npyz gives the precise error
        };
        if d != 0 {
            total = total
                .checked_mul(d)
                .ok_or_else(|| format!("shape ({}) is too large", &rest[open + 1..close]))?;
        }
    }
    Ok(())
}

/// Writes a tensor as `.npy` (C order); bf16 becomes `<u2` raw bits.
pub(crate) fn write_npy(out: &mut dyn Write, path: &Path, t: &Tensor) -> Result<()> {
    let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
    let io = |e: std::io::Error| Error::io(path, e);
    match t.data() {
        TensorData::F32(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::F16(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::BF16(v) => write_vec(out, &shape, v.iter().map(|x| x.to_bits())).map_err(io),
        TensorData::I8(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::U8(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::Bool(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::I32(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
        TensorData::I64(v) => write_vec(out, &shape, v.iter().copied()).map_err(io),
    }
}

fn write_vec<T: npyz::AutoSerialize>(
    out: &mut dyn Write,
    shape: &[u64],
    values: impl Iterator<Item = T>,
) -> std::io::Result<()> {
    let mut w = WriteOptions::<T>::new()
        .default_dtype()
        .shape(shape)
        .writer(out)
        .begin_nd()?;
    for v in values {
        w.push(&v)?;
    }
    w.finish()
}

/// A streaming reader over a 1-d integer `.npy` file: yields the values as `i64` without holding
/// the array in memory (for token streams larger than RAM).
pub struct NpyInts {
    path: std::path::PathBuf,
    reader: std::io::BufReader<std::fs::File>,
    len: u64,
    read: u64,
    item: usize,
    signed: bool,
    big_endian: bool,
}

impl std::fmt::Debug for NpyInts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpyInts")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("read", &self.read)
            .finish()
    }
}

impl NpyInts {
    /// Number of elements in the array.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Iterator for NpyInts {
    type Item = Result<i64>;

    fn next(&mut self) -> Option<Result<i64>> {
        use std::io::Read;
        if self.read >= self.len {
            return None;
        }
        self.read += 1;
        let mut b = [0u8; 8];
        let buf = &mut b[..self.item];
        if let Err(e) = self.reader.read_exact(buf) {
            return Some(Err(Error::io(&self.path, e)));
        }
        if self.big_endian {
            buf.reverse();
        }
        // Now little-endian; sign-extend narrow signed values.
        let neg = self.signed && buf[self.item - 1] & 0x80 != 0;
        let mut full = if neg { [0xffu8; 8] } else { [0u8; 8] };
        full[..self.item].copy_from_slice(&b[..self.item]);
        let v = u64::from_le_bytes(full);
        if !self.signed && self.item == 8 && v > i64::MAX as u64 {
            return Some(Err(Error::format(
                &self.path,
                format!("element {} = {v} does not fit in i64", self.read - 1),
            )));
        }
        Some(Ok(v as i64))
    }
}

/// Opens a 1-d integer `.npy` file (`i1 i2 i4 i8 u1 u2 u4 u8`, either endianness) for
/// streaming. The header, dtype and file size are checked up front, so iteration can fail only
/// on an I/O error or a u8 value above `i64::MAX`.
pub fn open_npy_ints(path: &Path) -> Result<NpyInts> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |msg: String| Error::format(path, msg);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut reader = std::io::BufReader::new(file);
    let mut pre = Vec::with_capacity(12);
    (&mut reader)
        .take(12)
        .read_to_end(&mut pre)
        .map_err(|e| Error::io(path, e))?;
    // check_preamble needs the header bytes; read exactly as many as it says exist.
    let header_len: u64 = match pre.get(6) {
        Some(1) if pre.len() >= 10 => 10 + u16::from_le_bytes([pre[8], pre[9]]) as u64,
        Some(2 | 3) if pre.len() >= 12 => {
            12 + u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as u64
        }
        _ => 12,
    };
    if header_len > file_len {
        check_preamble(&pre).map_err(|m| bad(m.to_string()))?;
        return Err(bad("truncated .npy header".into()));
    }
    let mut head = Vec::with_capacity(header_len as usize);
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|e| Error::io(path, e))?;
    (&mut reader)
        .take(header_len)
        .read_to_end(&mut head)
        .map_err(|e| Error::io(path, e))?;
    let end = check_preamble(&head).map_err(|m| bad(m.to_string()))?;
    check_shape_text(&head[..end]).map_err(&bad)?;
    let mut cursor: &[u8] = &head[..end];
    let header = NpyHeader::from_reader(&mut cursor)
        .map_err(|e| bad(format!("not a valid .npy header: {e}")))?;
    if header.shape().len() != 1 {
        return Err(Error::invalid(
            format!("{}", path.display()),
            "a 1-d integer array",
            format!("shape {:?}", header.shape()),
        ));
    }
    let npyz::DType::Plain(ts) = header.dtype() else {
        return Err(bad(format!(
            "structured dtype {} is not an integer dtype",
            header.dtype().descr()
        )));
    };
    let item = ts.size_field() as usize;
    let signed = match ts.type_char() {
        TypeChar::Int => true,
        TypeChar::Uint => false,
        _ => {
            return Err(Error::invalid(
                format!("dtype of {}", path.display()),
                "an integer dtype (i1, i2, i4, i8, u1, u2, u4, u8)",
                ts.to_string(),
            ))
        }
    };
    if ![1, 2, 4, 8].contains(&item) {
        return Err(bad(format!("unsupported integer dtype {ts}")));
    }
    let len = header.len();
    let want = len
        .checked_mul(item as u64)
        .and_then(|d| d.checked_add(end as u64))
        .ok_or_else(|| bad("data size overflows".into()))?;
    if want != file_len {
        return Err(bad(format!(
            "expected {} data bytes for {len} elements of {ts}, found {} (truncated or corrupt file)",
            want - end as u64,
            file_len.saturating_sub(end as u64)
        )));
    }
    reader
        .seek(SeekFrom::Start(end as u64))
        .map_err(|e| Error::io(path, e))?;
    Ok(NpyInts {
        path: path.to_path_buf(),
        reader,
        len,
        read: 0,
        item,
        signed,
        big_endian: ts.endianness() == npyz::Endianness::Big,
    })
}
