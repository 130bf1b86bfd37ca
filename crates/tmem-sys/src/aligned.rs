//! Page-aligned heap buffers, as `O_DIRECT` I/O needs them (the disk tier, the cache device).

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of buffers, file offsets and I/O lengths (the largest logical
/// block size the tier accepts).
pub const ALIGN: usize = 4096;

/// A zero-initialised byte buffer whose start is aligned to [`ALIGN`] and
/// whose length is a multiple of it. Owns its memory like a `Box<[u8]>`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBuf` uniquely owns its allocation (like `Box<[u8]>`); it
// has no interior mutability and no thread-affine state, so moving it to
// another thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]` access (mutation needs
// `&mut self`), so sharing across threads is as sound as sharing `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; `len` must be a non-zero multiple of [`ALIGN`].
    pub fn zeroed(len: usize) -> Self {
        assert!(len > 0 && len.is_multiple_of(ALIGN), "aligned buffer of {len} bytes");
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size (asserted above) and a valid
        // power-of-two alignment; a null return is handled below.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, ALIGN).expect("aligned buffer size overflows")
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes allocated by `zeroed` (so
        // initialised), owned by `self` and alive until `drop`; the returned
        // slice borrows `self`, so no `&mut` to the bytes can exist meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and the exclusive borrow of `self` makes this
        // the only reference to the bytes for its lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this
        // layout (same `len`, same alignment) and is freed only here, once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::zeroed(3 * ALIGN);
        assert_eq!(b.as_ptr().align_offset(ALIGN), 0);
        assert_eq!(b.len(), 3 * ALIGN);
        assert!(b.iter().all(|&x| x == 0));
        b[ALIGN] = 7;
        assert_eq!(b[ALIGN], 7);
    }

    #[test]
    #[should_panic(expected = "aligned buffer")]
    fn refuses_unaligned_length() {
        let _ = AlignedBuf::zeroed(100);
    }
}
