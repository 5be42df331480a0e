//! Borrowed tensors at the kernel boundary: strided inputs ([`StridedView`]) and caller-owned
//! output slices ([`OutData`]).
//!
//! Contract:
//! - A [`StridedView`] is a rank-4 `[B, H, L, D]` view of f32 or bf16 storage with element
//!   strides `[sb, sh, sl, 1]`: the innermost (D) dimension must have unit stride; the batch, head
//!   and row strides are free (zero strides included, so an expanded K works without a copy).
//!   [`StridedView::new`] checks that every addressed element lies inside the storage, so
//!   kernels index without further checks. The usual PyTorch `[B, L, H, D].transpose(1, 2)` is
//!   `strides = [L·H·D, D, H·D, 1]`.
//! - An [`OutData`] is a contiguous row-major output buffer written by a kernel; outputs are
//!   always contiguous (the caller allocates them).

use half::bf16;
use tessera_core::tensor::{TensorView, ViewData};
use tessera_core::{DType, Error, Result};

/// A strided rank-4 input view `[B, H, L, D]` with unit stride in D.
#[derive(Debug, Clone, Copy)]
pub struct StridedView<'a> {
    /// The storage the strides index into (f32 or bf16 for attention inputs).
    pub data: ViewData<'a>,
    /// `[B, H, L, D]`.
    pub shape: [usize; 4],
    /// Element strides of the four dimensions; `strides[3]` is 1.
    pub strides: [usize; 4],
}

impl<'a> StridedView<'a> {
    /// A view of `data` with the given shape and element strides. `name` is the argument named
    /// in errors: a non-unit D stride, or an element outside the storage.
    pub fn new(
        name: &str,
        data: ViewData<'a>,
        shape: [usize; 4],
        strides: [usize; 4],
    ) -> Result<Self> {
        let v = StridedView {
            data,
            shape,
            strides,
        };
        v.check(name)?;
        Ok(v)
    }

    /// The contiguous row-major view of a rank-4 [`TensorView`].
    pub fn contiguous(name: &str, t: TensorView<'a>) -> Result<Self> {
        let [b, h, l, d] = *t.shape else {
            return Err(Error::invalid(
                name,
                "a rank-4 tensor [B, H, L, D]",
                format!("shape {:?}", t.shape),
            ));
        };
        Self::new(name, t.data, [b, h, l, d], [h * l * d, l * d, d, 1])
    }

    /// Whether the view is the contiguous row-major layout of its shape.
    pub fn is_contiguous(&self) -> bool {
        let [_, h, l, d] = self.shape;
        self.strides == [h * l * d, l * d, d, 1]
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        TensorView {
            shape: &[],
            data: self.data,
        }
        .dtype()
    }

    /// Element offset of row `i` of head `h` in batch `b`.
    #[inline(always)]
    pub fn row_offset(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.strides[0] + h * self.strides[1] + i * self.strides[2]
    }

    fn storage_len(&self) -> usize {
        TensorView {
            shape: &[],
            data: self.data,
        }
        .len()
    }

    /// Unit D stride and every addressed element inside the storage (empty shapes address none).
    pub(crate) fn check(&self, name: &str) -> Result<()> {
        if self.shape.contains(&0) {
            return Ok(());
        }
        if self.strides[3] != 1 {
            return Err(Error::invalid(
                name,
                "unit stride in the last (head) dimension D (call .contiguous() first)",
                format!("strides {:?}", self.strides),
            ));
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(0usize, |acc, (&n, &s)| {
                (n - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            });
        match last {
            Some(x) if x < self.storage_len() => Ok(()),
            _ => Err(Error::invalid(
                name,
                format!(
                    "strides {:?} addressing only the {} elements of its storage",
                    self.strides,
                    self.storage_len()
                ),
                format!("shape {:?}", self.shape),
            )),
        }
    }
}

/// A caller-owned contiguous output buffer in the storage dtype.
#[derive(Debug)]
pub enum OutData<'a> {
    /// f32 storage.
    F32(&'a mut [f32]),
    /// bf16 storage.
    BF16(&'a mut [bf16]),
}

impl OutData<'_> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            OutData::F32(x) => x.len(),
            OutData::BF16(x) => x.len(),
        }
    }

    /// Whether the buffer has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        match self {
            OutData::F32(_) => DType::F32,
            OutData::BF16(_) => DType::BF16,
        }
    }

    /// A shorter-lived reborrow.
    pub fn reborrow(&mut self) -> OutData<'_> {
        match self {
            OutData::F32(x) => OutData::F32(x),
            OutData::BF16(x) => OutData::BF16(x),
        }
    }

    /// `self[off + i] = src[i] * scale`, rounded to the storage dtype.
    #[inline(always)]
    pub(crate) fn store(&mut self, off: usize, src: &[f32], scale: f32) {
        let n = src.len();
        match self {
            OutData::F32(x) => {
                for (d, &s) in x[off..off + n].iter_mut().zip(src) {
                    *d = s * scale;
                }
            }
            OutData::BF16(x) => {
                for (d, &s) in x[off..off + n].iter_mut().zip(src) {
                    *d = bf16::from_f32(s * scale);
                }
            }
        }
    }

    /// Cache hint: requests every 64-byte line of the buffer for writing (`prefetchw`), so the
    /// stores that fill it later do not wait on memory. No effect on results; no-op off x86-64.
    pub(crate) fn prefetch_for_write(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            let (base, bytes) = match self {
                OutData::F32(x) => (x.as_ptr().cast::<u8>(), std::mem::size_of_val(*x)),
                OutData::BF16(x) => (x.as_ptr().cast::<u8>(), std::mem::size_of_val(*x)),
            };
            for b in (0..bytes).step_by(64) {
                // SAFETY: `b` lies inside the buffer; a prefetch never faults or changes memory.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(
                        base.add(b).cast(),
                    )
                }
            }
        }
    }

    /// Splits into consecutive slabs of `slab` elements, each split into pieces of `piece`
    /// (the last piece of a slab may be shorter); slab-major order.
    pub(crate) fn pieces(&mut self, slab: usize, piece: usize) -> Vec<OutData<'_>> {
        let (slab, piece) = (slab.max(1), piece.max(1));
        match self {
            OutData::F32(v) => v
                .chunks_mut(slab)
                .flat_map(|s| s.chunks_mut(piece))
                .map(OutData::F32)
                .collect(),
            OutData::BF16(v) => v
                .chunks_mut(slab)
                .flat_map(|s| s.chunks_mut(piece))
                .map(OutData::BF16)
                .collect(),
        }
    }

    /// Fills every element with NaN (used by tests to expose elements a kernel never writes).
    pub fn poison(&mut self) {
        match self {
            OutData::F32(x) => x.fill(f32::NAN),
            OutData::BF16(x) => x.fill(bf16::NAN),
        }
    }
}

/// An owned output buffer (the allocating convenience calls fill one, then make it a tensor).
pub(crate) enum OutBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

impl OutBuf {
    /// A zeroed buffer (fresh pages: no write pass; the kernel writes every element).
    pub(crate) fn zeroed(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::BF16 => OutBuf::BF16(vec![bf16::ZERO; n]),
            _ => OutBuf::F32(vec![0f32; n]),
        }
    }

    pub(crate) fn data(&mut self) -> OutData<'_> {
        match self {
            OutBuf::F32(v) => OutData::F32(v),
            OutBuf::BF16(v) => OutData::BF16(v),
        }
    }

    pub(crate) fn into_tensor(self, shape: Vec<usize>) -> Result<tessera_core::Tensor> {
        match self {
            OutBuf::F32(v) => tessera_core::Tensor::from_f32(shape, v),
            OutBuf::BF16(v) => tessera_core::Tensor::from_bf16(shape, v),
        }
    }
}
