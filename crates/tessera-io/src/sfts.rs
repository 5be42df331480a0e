//! `.safetensors` reading and writing.
//!
//! Contract: reads F32, BF16, F16, BOOL, U8, I8, I32, I64 and F64 (narrowed to f32) tensors;
//! any other dtype, a malformed header or out-of-bounds offsets is an [`Error::Format`] naming
//! the file. Writes every Tessera dtype under its natural safetensors dtype (bf16 as BF16).

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView as StView, View};
use std::borrow::Cow;
use std::io::Write;
use std::path::Path;
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{DType, Error, Result, Tensor, TensorData};

/// Reads every tensor of a safetensors file, sorted by name.
pub(crate) fn read_all(path: &Path) -> Result<Vec<(String, Tensor)>> {
    decode_all(&crate::read_file(path)?, path)
}

/// [`read_all`] on file bytes already in memory; `path` names the source in errors.
pub(crate) fn decode_all(bytes: &[u8], path: &Path) -> Result<Vec<(String, Tensor)>> {
    let st = parse(path, bytes)?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        let t = convert(path, &name, &view)?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Reads one tensor: `name`, or the only tensor of the file when `name` is `None`.
pub(crate) fn read_one(path: &Path, name: Option<&str>, want: Option<DType>) -> Result<Tensor> {
    let bytes = crate::read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let available = || {
        if names.is_empty() {
            "(the file holds no tensors)".to_string()
        } else {
            names.join(", ")
        }
    };
    let chosen = match name {
        Some(n) => {
            if !names.iter().any(|x| x == n) {
                return Err(Error::invalid(
                    format!("tensor name in {}", path.display()),
                    format!("one of: {}", available()),
                    n,
                ));
            }
            n.to_string()
        }
        None => match names.as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(Error::invalid(
                    format!("{}", path.display()),
                    format!(
                        "a tensor name (PATH:NAME) since the file holds {} tensors: {}",
                        names.len(),
                        available()
                    ),
                    "no name",
                ))
            }
        },
    };
    let view = st
        .tensor(&chosen)
        .map_err(|e| Error::format(path, format!("tensor {chosen}: {e}")))?;
    let t = convert(path, &chosen, &view)?;
    crate::check_dtype(path, want, t.dtype(), &format!("{:?}", view.dtype()))?;
    Ok(t)
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))
}

/// Decodes little-endian storage into an owned tensor.
fn convert(path: &Path, name: &str, v: &StView<'_>) -> Result<Tensor> {
    let b = v.data();
    fn le<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }
    let data = match v.dtype() {
        Dtype::F32 => TensorData::F32(le(b, f32::from_le_bytes)),
        Dtype::F64 => TensorData::F32(le(b, |a| f64::from_le_bytes(a) as f32)),
        Dtype::BF16 => TensorData::BF16(le(b, |a| bf16::from_bits(u16::from_le_bytes(a)))),
        Dtype::F16 => TensorData::F16(le(b, |a| f16::from_bits(u16::from_le_bytes(a)))),
        Dtype::BOOL => TensorData::Bool(b.iter().map(|&x| x != 0).collect()),
        Dtype::U8 => TensorData::U8(b.to_vec()),
        Dtype::I8 => TensorData::I8(b.iter().map(|&x| x as i8).collect()),
        Dtype::I32 => TensorData::I32(le(b, i32::from_le_bytes)),
        Dtype::I64 => TensorData::I64(le(b, i64::from_le_bytes)),
        other => {
            return Err(Error::format(
                path,
                format!(
                    "tensor {name}: unsupported dtype {other:?} (supported: F32, BF16, F16, BOOL, U8, I8, I32, I64, F64)"
                ),
            ))
        }
    };
    Tensor::new(v.shape().to_vec(), data)
        .map_err(|e| Error::format(path, format!("tensor {name}: {e}")))
}

/// Owned little-endian bytes of one tensor, in the form the safetensors serializer wants.
struct Encoded {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Encoded {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn encode(t: &TensorView<'_>) -> Encoded {
    let (dtype, bytes) = match t.data {
        ViewData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ViewData::BF16(v) => (
            Dtype::BF16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        ViewData::F16(v) => (
            Dtype::F16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        ViewData::I8(v) => (Dtype::I8, v.iter().map(|&x| x as u8).collect()),
        ViewData::U8(v) => (Dtype::U8, v.to_vec()),
        ViewData::Bool(v) => (Dtype::BOOL, v.iter().map(|&x| x as u8).collect()),
        ViewData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ViewData::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    Encoded {
        dtype,
        shape: t.shape.to_vec(),
        bytes,
    }
}

/// Serializes named tensors into `out`. Names must be unique.
pub(crate) fn write(
    out: &mut dyn Write,
    path: &Path,
    tensors: &[(&str, TensorView<'_>)],
) -> Result<()> {
    let bytes = encode_all(tensors)?;
    out.write_all(&bytes).map_err(|e| Error::io(path, e))
}

/// The `.safetensors` bytes of named tensors. Names must be unique.
pub(crate) fn encode_all(tensors: &[(&str, TensorView<'_>)]) -> Result<Vec<u8>> {
    let mut seen = std::collections::BTreeSet::new();
    for (name, t) in tensors {
        // Views built by hand are not checked at construction; a wrong count would corrupt the file.
        let want: usize = t.shape.iter().product();
        if want != t.len() {
            return Err(Error::invalid(
                format!("tensor {name}"),
                format!("{want} elements for shape {:?}", t.shape),
                format!("{} elements", t.len()),
            ));
        }
        if !seen.insert(*name) {
            return Err(Error::invalid(
                "tensor names",
                "unique names",
                format!("{name:?} twice"),
            ));
        }
    }
    let encoded: Vec<(&str, Encoded)> = tensors.iter().map(|(n, t)| (*n, encode(t))).collect();
    safetensors::serialize(encoded.iter().map(|(n, e)| (*n, e)), &None)
        .map_err(|e| Error::Internal(format!("safetensors serialization: {e}")))
}
