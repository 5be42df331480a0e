//! The workspace's one `.npy` codec.
//!
//! Contract: one header parser ([`parse`]) serves every reader (tensors, raw arrays, streamed
//! integers) and one header encoder ([`write_header`]) every writer. Reads C-order (or 1-d)
//! arrays; every malformed or unsupported file is an [`Error::Format`] naming the file, never a
//! panic and never an allocation larger than the file itself. Writes C-order arrays in numpy's
//! own layout (format 1.0, header padded to 64 bytes, numpy's descrs, little-endian data), so
//! `numpy.load` reads every file and `numpy.savez`-style archives can embed the bytes as they
//! are; bf16 is written as `<u2` raw bits because numpy has no bf16 dtype.

use half::{bf16, f16};
use npyz::{NpyFile, NpyHeader, Order, TypeChar, TypeStr};
use std::io::Write;
use std::path::Path;
use tessera_core::{DType, Error, Result, Tensor, TensorData};

/// The 6-byte magic string every `.npy` file starts with.
const MAGIC: &[u8] = b"\x93NUMPY";

/// Element type of an [`NpyArray`]: the little-endian numpy dtypes Tessera reads and writes raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NpyDType {
    /// `|b1` (`bool`).
    Bool,
    /// `|u1` (`uint8`).
    U8,
    /// `|i1` (`int8`).
    I8,
    /// `<u2` (`uint16`; also bf16 raw bits).
    U16,
    /// `<i2` (`int16`).
    I16,
    /// `<i4` (`int32`).
    I32,
    /// `<i8` (`int64`).
    I64,
    /// `<f2` (`float16`).
    F16,
    /// `<f4` (`float32`).
    F32,
    /// `<f8` (`float64`).
    F64,
}

impl NpyDType {
    /// The numpy `descr` string (`|b1`, `<i4`, ...).
    pub fn descr(self) -> &'static str {
        match self {
            NpyDType::Bool => "|b1",
            NpyDType::U8 => "|u1",
            NpyDType::I8 => "|i1",
            NpyDType::U16 => "<u2",
            NpyDType::I16 => "<i2",
            NpyDType::I32 => "<i4",
            NpyDType::I64 => "<i8",
            NpyDType::F16 => "<f2",
            NpyDType::F32 => "<f4",
            NpyDType::F64 => "<f8",
        }
    }

    /// The numpy name (`bool`, `int8`, `float32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            NpyDType::Bool => "bool",
            NpyDType::U8 => "uint8",
            NpyDType::I8 => "int8",
            NpyDType::U16 => "uint16",
            NpyDType::I16 => "int16",
            NpyDType::I32 => "int32",
            NpyDType::I64 => "int64",
            NpyDType::F16 => "float16",
            NpyDType::F32 => "float32",
            NpyDType::F64 => "float64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            NpyDType::Bool | NpyDType::U8 | NpyDType::I8 => 1,
            NpyDType::U16 | NpyDType::I16 | NpyDType::F16 => 2,
            NpyDType::I32 | NpyDType::F32 => 4,
            NpyDType::I64 | NpyDType::F64 => 8,
        }
    }

    /// Whether the values are integers (bools included).
    pub fn is_integer(self) -> bool {
        !matches!(self, NpyDType::F16 | NpyDType::F32 | NpyDType::F64)
    }

    /// The dtype of a parsed type string; `None` for big-endian or unsupported types.
    fn of(ts: &TypeStr) -> Option<NpyDType> {
        if ts.endianness() == npyz::Endianness::Big && ts.size_field() > 1 {
            return None;
        }
        Some(match (ts.type_char(), ts.size_field()) {
            (TypeChar::Bool, 1) => NpyDType::Bool,
            (TypeChar::Uint, 1) => NpyDType::U8,
            (TypeChar::Int, 1) => NpyDType::I8,
            (TypeChar::Uint, 2) => NpyDType::U16,
            (TypeChar::Int, 2) => NpyDType::I16,
            (TypeChar::Int, 4) => NpyDType::I32,
            (TypeChar::Int, 8) => NpyDType::I64,
            (TypeChar::Float, 2) => NpyDType::F16,
            (TypeChar::Float, 4) => NpyDType::F32,
            (TypeChar::Float, 8) => NpyDType::F64,
            _ => return None,
        })
    }
}

/// One array in `.npy` form: dtype, C-order shape and little-endian element bytes. The raw
/// counterpart of [`Tensor`] for dtypes a tensor does not have (`int16`, `uint16`, `float64`)
/// and for containers that embed `.npy` files (the plan exporters' `.npz` archives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyArray {
    /// Element type.
    pub dtype: NpyDType,
    /// C-order shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// `len() * dtype.size()` little-endian bytes.
    pub bytes: Vec<u8>,
}

impl NpyArray {
    /// Encodes integer values as `dtype` (bools as `v != 0`, floats as the nearest value).
    /// Integers are truncated to the dtype's width: callers pass values that fit.
    pub fn from_ints(
        dtype: NpyDType,
        shape: Vec<usize>,
        values: impl ExactSizeIterator<Item = i64>,
    ) -> Self {
        let mut bytes = Vec::with_capacity(values.len() * dtype.size());
        for v in values {
            match dtype {
                NpyDType::Bool => bytes.push((v != 0) as u8),
                NpyDType::U8 | NpyDType::I8 => bytes.push(v as u8),
                NpyDType::U16 | NpyDType::I16 => bytes.extend_from_slice(&(v as u16).to_le_bytes()),
                NpyDType::I32 => bytes.extend_from_slice(&(v as i32).to_le_bytes()),
                NpyDType::I64 => bytes.extend_from_slice(&v.to_le_bytes()),
                NpyDType::F16 => bytes.extend_from_slice(&f16::from_f64(v as f64).to_le_bytes()),
                NpyDType::F32 => bytes.extend_from_slice(&(v as f32).to_le_bytes()),
                NpyDType::F64 => bytes.extend_from_slice(&(v as f64).to_le_bytes()),
            }
        }
        NpyArray {
            dtype,
            shape,
            bytes,
        }
    }

    /// A `bool` array.
    pub fn from_bools(shape: Vec<usize>, values: &[bool]) -> Self {
        NpyArray {
            dtype: NpyDType::Bool,
            shape,
            bytes: values.iter().map(|&b| b as u8).collect(),
        }
    }

    /// Number of elements (the product of the shape).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to i64 (bools as 0/1); `None` for a float dtype.
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        let b = &self.bytes;
        let le = |c: &[u8]| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            w
        };
        Some(match self.dtype {
            NpyDType::Bool => b.iter().map(|&x| (x != 0) as i64).collect(),
            NpyDType::U8 => b.iter().map(|&x| x as i64).collect(),
            NpyDType::I8 => b.iter().map(|&x| x as i8 as i64).collect(),
            NpyDType::U16 => b
                .chunks_exact(2)
                .map(|c| u64::from_le_bytes(le(c)) as i64)
                .collect(),
            NpyDType::I16 => b
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
                .collect(),
            NpyDType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect(),
            NpyDType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(le(c)))
                .collect(),
            NpyDType::F16 | NpyDType::F32 | NpyDType::F64 => return None,
        })
    }

    /// Writes the `.npy` bytes (header, then data) to `out`.
    pub fn write(&self, out: &mut dyn Write) -> std::io::Result<()> {
        write_header(out, self.dtype.descr(), &self.shape)?;
        out.write_all(&self.bytes)
    }

    /// The `.npy` file bytes.
    pub fn to_npy(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.bytes.len());
        // Writing to a Vec cannot fail.
        let _ = self.write(&mut out);
        out
    }

    /// Parses `.npy` bytes (format versions 1 to 3, C order, a dtype of [`NpyDType`]); `path`
    /// names the source in errors.
    pub fn from_npy(bytes: &[u8], path: &Path) -> Result<Self> {
        let p = parse(bytes).map_err(|m| Error::format(path, m))?;
        let dtype = NpyDType::of(&p.ts).ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "unsupported npy dtype {} (supported: little-endian b1, u1, i1, u2, i2, i4, i8, f2, f4, f8)",
                    p.ts
                ),
            )
        })?;
        Ok(NpyArray {
            dtype,
            shape: p.shape,
            bytes: p.data.to_vec(),
        })
    }

    /// Reads a `.npy` file into an [`NpyArray`] (see [`NpyArray::from_npy`]).
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = crate::read_file(path)?;
        Self::from_npy(&bytes, path)
    }
}

/// Writes a format-1.0 `.npy` header for a C-order array of `descr` and `shape`, exactly as
/// numpy does: the dictionary padded with spaces so the data starts at a multiple of 64 bytes.
pub(crate) fn write_header(
    out: &mut dyn Write,
    descr: &str,
    shape: &[usize],
) -> std::io::Result<()> {
    let dims = match shape {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + header length (2) + header, padded to 64 bytes, ending in '\n'.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
    header.push('\n');
    let len = u16::try_from(header.len())
        .map_err(|_| std::io::Error::other(format!("npy header of {} bytes", header.len())))?;
    out.write_all(MAGIC)?;
    out.write_all(&[1, 0])?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(header.as_bytes())
}

/// A parsed `.npy` file: its header, element type, C-order shape and data bytes.
struct Parsed<'a> {
    header: NpyHeader,
    ts: TypeStr,
    shape: Vec<usize>,
    data: &'a [u8],
}

/// Parses and checks a whole `.npy` file held in memory: magic, header length against the size,
/// the header itself, C order (or 1-d), a plain dtype, and a data size equal to what the shape
/// and dtype need. Errors are messages for [`Error::Format`].
fn parse(bytes: &[u8]) -> std::result::Result<Parsed<'_>, String> {
    let header_end = check_preamble(bytes).map_err(str::to_string)?;
    let (header, ts, shape) = parse_header(&bytes[..header_end])?;
    let data = &bytes[header_end..];
    let item = ts.num_bytes().unwrap_or(usize::MAX);
    let want_bytes = usize::try_from(header.len())
        .ok()
        .and_then(|n| n.checked_mul(item))
        .ok_or("data size overflows")?;
    if data.len() != want_bytes {
        return Err(format!(
            "expected {want_bytes} data bytes for shape {shape:?} and dtype {ts}, found {} (truncated or corrupt file)",
            data.len()
        ));
    }
    Ok(Parsed {
        header,
        ts,
        shape,
        data,
    })
}

/// Parses the header bytes (preamble included, already length-checked): a C-order (or 1-d)
/// array of a plain dtype.
fn parse_header(head: &[u8]) -> std::result::Result<(NpyHeader, TypeStr, Vec<usize>), String> {
    check_nesting(head)?;
    check_shape_text(head)?;
    let mut cursor: &[u8] = head;
    let header =
        NpyHeader::from_reader(&mut cursor).map_err(|e| format!("not a valid .npy header: {e}"))?;
    let shape: Vec<usize> = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| "shape does not fit in memory".to_string())?;
    if header.order() == Order::Fortran && shape.len() > 1 {
        return Err(
            "Fortran-order arrays are not supported; save a C-contiguous array (np.ascontiguousarray)"
                .into(),
        );
    }
    let npyz::DType::Plain(ts) = header.dtype() else {
        return Err(format!(
            "structured dtype {} is not supported",
            header.dtype().descr()
        ));
    };
    Ok((header, ts, shape))
}

/// Reads a `.npy` file as a [`Tensor`].
///
/// Supported descrs: `f4`, `f2`, `f8` (narrowed to f32), `b1`, `u1`, `i1`, `i4`, `i8`, and `u2`
/// as bf16 raw bits only when `want == Some(DType::BF16)` (a `u2` file is otherwise ambiguous).
/// With `want` set, any other dtype mismatch is an error naming both dtypes.
pub(crate) fn read_npy(path: &Path, want: Option<DType>) -> Result<Tensor> {
    let bytes = crate::read_file(path)?;
    decode_npy(&bytes, path, want)
}

/// [`read_npy`] on file bytes already in memory; `path` names the source in errors.
pub(crate) fn decode_npy(bytes: &[u8], path: &Path, want: Option<DType>) -> Result<Tensor> {
    let bad = |msg: String| Error::format(path, msg);
    let Parsed {
        header,
        ts,
        shape,
        data,
    } = parse(bytes).map_err(bad)?;
    let descr = ts.to_string();
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

/// Deepest bracket nesting a header may have: a plain-dtype header has a dict holding a shape
/// tuple (2); anything deeper is a structured dtype, which is refused anyway.
const MAX_HEADER_NESTING: usize = 4;

/// Rejects headers nested deeper than [`MAX_HEADER_NESTING`] before npyz's literal parser sees
/// them: its backtracking is exponential in the nesting (18 `{` took 23 s, found by fuzzing).
fn check_nesting(header: &[u8]) -> std::result::Result<(), String> {
    let mut depth = 0usize;
    for &c in header {
        match c {
            b'{' | b'[' | b'(' => {
                depth += 1;
                if depth > MAX_HEADER_NESTING {
                    return Err(format!(
                        "not a valid .npy header: brackets nested deeper than {MAX_HEADER_NESTING}"
                    ));
                }
            }
            b'}' | b']' | b')' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
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
    let descr = match t.data() {
        TensorData::F32(_) => NpyDType::F32,
        TensorData::F16(_) => NpyDType::F16,
        TensorData::BF16(_) => NpyDType::U16,
        TensorData::I8(_) => NpyDType::I8,
        TensorData::U8(_) => NpyDType::U8,
        TensorData::Bool(_) => NpyDType::Bool,
        TensorData::I32(_) => NpyDType::I32,
        TensorData::I64(_) => NpyDType::I64,
    }
    .descr();
    let io = |e: std::io::Error| Error::io(path, e);
    write_header(out, descr, t.shape()).map_err(io)?;
    match t.data() {
        TensorData::F32(v) => write_le(out, v, |x| x.to_le_bytes()),
        TensorData::F16(v) => write_le(out, v, |x| x.to_le_bytes()),
        TensorData::BF16(v) => write_le(out, v, |x| x.to_le_bytes()),
        TensorData::I8(v) => write_le(out, v, |x| x.to_le_bytes()),
        TensorData::U8(v) => out.write_all(v),
        TensorData::Bool(v) => write_le(out, v, |&x| [x as u8]),
        TensorData::I32(v) => write_le(out, v, |x| x.to_le_bytes()),
        TensorData::I64(v) => write_le(out, v, |x| x.to_le_bytes()),
    }
    .map_err(io)
}

/// Writes `values` as little-endian bytes, a bounded chunk at a time.
fn write_le<T, const N: usize>(
    out: &mut dyn Write,
    values: &[T],
    le: impl Fn(&T) -> [u8; N],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(N * 4096);
    for chunk in values.chunks(4096) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(&le));
        out.write_all(&buf)?;
    }
    Ok(())
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
    let (header, ts, shape) = parse_header(&head[..end]).map_err(&bad)?;
    if shape.len() != 1 {
        return Err(Error::invalid(
            format!("{}", path.display()),
            "a 1-d integer array",
            format!("shape {shape:?}"),
        ));
    }
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
