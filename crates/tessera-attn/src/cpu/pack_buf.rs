//! A caller-owned buffer of per-kv-block packed inputs shared by the workers of one call
//! ([`PackBuf`]): each block is written once, by the first item that needs it, inside that
//! block's `OnceLock` initialisation, and read by every item after it.
//!
//! Contract: a block's elements are written only inside its own `OnceLock` initialisation and
//! read only after that `OnceLock` returned, which orders the writes before every read; blocks
//! are disjoint ranges. Both accessors check their range against the buffer.

use std::marker::PhantomData;

/// A view of a caller's buffer whose disjoint blocks are written once and then read (see the
/// module contract).
pub(crate) struct PackBuf<'a, T> {
    ptr: *mut T,
    len: usize,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: the buffer is exclusively borrowed for `'a`; blocks are disjoint, each written by one
// thread inside its `OnceLock` initialisation and read only after it (module contract).
unsafe impl<T: Send> Sync for PackBuf<'_, T> {}
// SAFETY: as above; the pointer is only a view of the borrowed buffer.
unsafe impl<T: Send> Send for PackBuf<'_, T> {}

impl<'a, T> PackBuf<'a, T> {
    pub(crate) fn new(buf: &'a mut [T]) -> Self {
        PackBuf {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: PhantomData,
        }
    }

    /// Elements `r` to write.
    ///
    /// # Safety
    /// Only inside the `OnceLock` initialisation of the block that owns `r`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn write(&self, r: std::ops::Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.len, "PackBuf: range");
        // SAFETY: in bounds (asserted); no other reference to the range exists (caller).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }

    /// Elements `r` to read.
    ///
    /// # Safety
    /// Only after the `OnceLock` of the block that owns `r` was initialised.
    pub(crate) unsafe fn read(&self, r: std::ops::Range<usize>) -> &[T] {
        assert!(r.start <= r.end && r.end <= self.len, "PackBuf: range");
        // SAFETY: in bounds (asserted); written before and never again (caller).
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}
