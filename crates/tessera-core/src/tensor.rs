//! Owned tensors and borrowed views.
//!
//! Contract: a tensor is a shape plus row-major contiguous storage whose element count equals the
//! product of the shape. Constructors check this; nothing else in Tessera re-checks it.

use crate::{Error, Result};
use half::{bf16, f16};

/// Storage element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// 16-bit IEEE float.
    F16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean (one byte).
    Bool,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Short lowercase name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::I64 => 8,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "bool" => DType::Bool,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            other => {
                return Err(Error::invalid(
                    "dtype",
                    "one of f32, bf16, f16, i8, u8, bool, i32, i64",
                    other,
                ))
            }
        })
    }
}

/// Owned element storage.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// i8 elements.
    I8(Vec<i8>),
    /// u8 elements.
    U8(Vec<u8>),
    /// bool elements.
    Bool(Vec<bool>),
    /// i32 elements.
    I32(Vec<i32>),
    /// i64 elements.
    I64(Vec<i64>),
}

impl TensorData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
            TensorData::I8(_) => DType::I8,
            TensorData::U8(_) => DType::U8,
            TensorData::Bool(_) => DType::Bool,
            TensorData::I32(_) => DType::I32,
            TensorData::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::I8(v) => v.len(),
            TensorData::U8(v) => v.len(),
            TensorData::Bool(v) => v.len(),
            TensorData::I32(v) => v.len(),
            TensorData::I64(v) => v.len(),
        }
    }

    /// Whether there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An owned, row-major, contiguous tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl Tensor {
    /// Builds a tensor, checking that the element count matches the shape.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(Error::invalid(
                "tensor",
                format!("{want} elements for shape {shape:?}"),
                format!("{} elements", data.len()),
            ));
        }
        Ok(Tensor { shape, data })
    }

    /// An f32 tensor (element count checked against the shape).
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        Self::new(shape, TensorData::F32(data))
    }

    /// A bf16 tensor (element count checked against the shape).
    pub fn from_bf16(shape: Vec<usize>, data: Vec<bf16>) -> Result<Self> {
        Self::new(shape, TensorData::BF16(data))
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements, row-major.
    pub fn data(&self) -> &TensorData {
        &self.data
    }

    /// The elements, consuming the tensor.
    pub fn into_data(self) -> TensorData {
        self.data
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// A borrowed view of this tensor.
    pub fn view(&self) -> TensorView<'_> {
        let data = match &self.data {
            TensorData::F32(v) => ViewData::F32(v),
            TensorData::BF16(v) => ViewData::BF16(v),
            TensorData::F16(v) => ViewData::F16(v),
            TensorData::I8(v) => ViewData::I8(v),
            TensorData::U8(v) => ViewData::U8(v),
            TensorData::Bool(v) => ViewData::Bool(v),
            TensorData::I32(v) => ViewData::I32(v),
            TensorData::I64(v) => ViewData::I64(v),
        };
        TensorView {
            shape: &self.shape,
            data,
        }
    }

    /// Values widened to f32 (floating dtypes only).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.view().to_f32_vec()
    }

    /// Values as i64 (integer and bool dtypes only).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        self.view().to_i64_vec()
    }
}

/// Borrowed element storage.
#[derive(Debug, Clone, Copy)]
pub enum ViewData<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
    /// i8 elements.
    I8(&'a [i8]),
    /// u8 elements.
    U8(&'a [u8]),
    /// bool elements.
    Bool(&'a [bool]),
    /// i32 elements.
    I32(&'a [i32]),
    /// i64 elements.
    I64(&'a [i64]),
}

/// A borrowed tensor: shape, dtype and data. The shape is not re-checked against the data length
/// here; [`TensorView::new`] checks it.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The shape, outermost dimension first (row-major, contiguous).
    pub shape: &'a [usize],
    /// The borrowed elements.
    pub data: ViewData<'a>,
}

impl<'a> TensorView<'a> {
    /// A view over borrowed storage, checking the element count.
    pub fn new(shape: &'a [usize], data: ViewData<'a>) -> Result<Self> {
        let v = TensorView { shape, data };
        let want: usize = shape.iter().product();
        if want != v.len() {
            return Err(Error::invalid(
                "tensor view",
                format!("{want} elements for shape {shape:?}"),
                format!("{} elements", v.len()),
            ));
        }
        Ok(v)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self.data {
            ViewData::F32(v) => v.len(),
            ViewData::BF16(v) => v.len(),
            ViewData::F16(v) => v.len(),
            ViewData::I8(v) => v.len(),
            ViewData::U8(v) => v.len(),
            ViewData::Bool(v) => v.len(),
            ViewData::I32(v) => v.len(),
            ViewData::I64(v) => v.len(),
        }
    }

    /// Whether there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            ViewData::F32(_) => DType::F32,
            ViewData::BF16(_) => DType::BF16,
            ViewData::F16(_) => DType::F16,
            ViewData::I8(_) => DType::I8,
            ViewData::U8(_) => DType::U8,
            ViewData::Bool(_) => DType::Bool,
            ViewData::I32(_) => DType::I32,
            ViewData::I64(_) => DType::I64,
        }
    }

    /// Values widened to f32 (floating dtypes only).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        Ok(match self.data {
            ViewData::F32(v) => v.to_vec(),
            ViewData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            ViewData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            _ => {
                return Err(Error::invalid(
                    "tensor",
                    "a floating dtype (f32, bf16, f16)",
                    self.dtype(),
                ))
            }
        })
    }

    /// Values as i64 (integer and bool dtypes only).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        Ok(match self.data {
            ViewData::I8(v) => v.iter().map(|&x| x as i64).collect(),
            ViewData::U8(v) => v.iter().map(|&x| x as i64).collect(),
            ViewData::Bool(v) => v.iter().map(|&x| x as i64).collect(),
            ViewData::I32(v) => v.iter().map(|&x| x as i64).collect(),
            ViewData::I64(v) => v.to_vec(),
            _ => {
                return Err(Error::invalid(
                    "tensor",
                    "an integer or bool dtype",
                    self.dtype(),
                ))
            }
        })
    }
}
