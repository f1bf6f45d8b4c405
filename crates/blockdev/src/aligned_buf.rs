//! Heap buffers whose address is aligned for direct I/O.
//!
//! `O_DIRECT` transfers go straight between the device and user memory, so
//! the kernel requires the buffer address (not only the offset and length) to
//! be aligned, typically to the logical block size. `Vec<u8>` only promises
//! 1-byte alignment, so callers that want zero-copy direct I/O allocate an
//! [`AlignedBuf`], and backends use one to bounce misaligned caller buffers.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Why an [`AlignedBuf`] could not be described. Allocation failure itself is
/// not reported here: like `Vec`, it aborts through
/// [`std::alloc::handle_alloc_error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot allocate {len} bytes aligned to {align}: the alignment must be a power of two \
     and the size, rounded up to it, must not exceed isize::MAX"
)]
pub struct AlignedBufError {
    pub len: usize,
    pub align: usize,
}

/// The system's memory page size in bytes (a power of two; 4096 if the
/// system does not say).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let raw = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(raw)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// A transparent huge page on x86-64 and most 64-bit systems: the
/// alignment and size unit of [`AlignedBuf::new_huge_pages`].
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A zero-initialised heap buffer of `len` bytes whose first byte is aligned to
/// `align` bytes.
///
/// It owns its memory exactly like `Box<[u8]>`; only the alignment differs.
pub struct AlignedBuf {
    /// Start of the allocation; valid for `len` bytes (and for
    /// `layout.size()` bytes, which is `len` or 1 when `len` is 0).
    ptr: NonNull<u8>,
    len: usize,
    /// The exact layout passed to `alloc_zeroed`, which `dealloc` must get
    /// back; for a mapped buffer, the mapping's length and alignment.
    layout: Layout,
    /// Whether the memory is an anonymous mapping of its own
    /// ([`AlignedBuf::new_huge_pages`]), unmapped on drop, rather than a
    /// heap allocation.
    mapped: bool,
    /// Set only by an io_uring queue's buffer pool (see
    /// [`crate::uring`], "Registered buffers"): this allocation is entry
    /// `index` of the registered-buffer table of the ring `ring_id`. The tag
    /// travels with the allocation (it is a private field, so moving or
    /// swapping the `AlignedBuf` moves both together) and is never copied:
    /// [`Clone`] makes an untagged buffer.
    fixed: Option<FixedTag>,
}

/// Which registered-buffer slot of which ring an [`AlignedBuf`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FixedTag {
    pub(crate) ring_id: u64,
    pub(crate) index: u16,
}

// SAFETY: `AlignedBuf` uniquely owns its allocation (no aliasing pointer
// escapes except through borrows of `self`), like `Box<[u8]>`, which is Send.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access (`&AlignedBuf`) only hands out `&[u8]`; mutation needs
// `&mut AlignedBuf`. This is the same contract as `Box<[u8]>`, which is Sync.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align`.
    ///
    /// Zeroed rather than uninitialised so that the buffer can be handed out
    /// as `&[u8]` immediately and a short read never exposes old heap
    /// contents.
    pub fn new(len: usize, align: usize) -> Result<AlignedBuf, AlignedBufError> {
        // A zero-size allocation is undefined behaviour for the global
        // allocator, so an empty buffer still allocates one byte; `len` stays
        // 0 and that byte is never exposed.
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|_| AlignedBufError { len, align })?;
        // SAFETY: `layout` has a non-zero size (`len.max(1)`) and was validated
        // by `Layout::from_size_align` (power-of-two alignment, no overflow).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        Ok(AlignedBuf {
            ptr,
            len,
            layout,
            mapped: false,
            fixed: None,
        })
    }

    /// Allocates `len` zeroed bytes (a positive multiple of
    /// [`HUGE_PAGE_BYTES`]) aligned to [`HUGE_PAGE_BYTES`], straight from
    /// the kernel as an anonymous mapping advised for transparent huge
    /// pages before any byte is touched: its first touch then takes one
    /// page fault per huge page instead of one per 4 KiB page. ([`new`]
    /// zeroes heap memory first, so the advice came after the kernel had
    /// already backed it with small pages.) Where transparent huge pages
    /// are off the advice fails and small pages back it, zeroed all the
    /// same.
    ///
    /// # Errors
    /// If `len` is not such a multiple. Running out of address space, as
    /// for [`new`], goes to [`std::alloc::handle_alloc_error`].
    ///
    /// [`new`]: AlignedBuf::new
    pub fn new_huge_pages(len: usize) -> Result<AlignedBuf, AlignedBufError> {
        let align = HUGE_PAGE_BYTES;
        let refuse = AlignedBufError { len, align };
        if len == 0 || !len.is_multiple_of(align) {
            return Err(refuse);
        }
        let layout = Layout::from_size_align(len, align).map_err(|_| refuse)?;
        // Over-map by one huge page, so an aligned range of `len` lies
        // inside, then unmap the slack before and after it.
        let span = len.checked_add(align).ok_or(refuse)?;
        // SAFETY: a fresh private anonymous mapping at an address of the
        // kernel's choosing: it aliases nothing of ours.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            alloc::handle_alloc_error(layout)
        }
        let base = raw as usize;
        let start = base.next_multiple_of(align);
        let (head, tail) = (start - base, base + span - (start + len));
        // SAFETY: `[base, start)` and `[start + len, base + span)` lie
        // inside the mapping just made and nothing refers to them; the
        // aligned range `[start, start + len)` stays mapped. Failure would
        // only leave slack mapped (a leak of address space, not of
        // safety), and munmap of a range inside a mapping does not fail.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: it changes no content, and where THP is off it
            // fails harmlessly (the result is ignored).
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        let Some(ptr) = NonNull::new(start as *mut u8) else {
            alloc::handle_alloc_error(layout)
        };
        Ok(AlignedBuf {
            ptr,
            len,
            layout,
            mapped: true,
            fixed: None,
        })
    }

    /// Whether this buffer came from a queue's registered-buffer pool
    /// ([`crate::DeviceQueue::alloc_buffer`]), so that queue can use it
    /// without per-request page pinning.
    pub fn is_registered(&self) -> bool {
        self.fixed.is_some()
    }

    pub(crate) fn fixed_tag(&self) -> Option<FixedTag> {
        self.fixed
    }

    pub(crate) fn set_fixed_tag(&mut self, tag: Option<FixedTag>) {
        self.fixed = tag;
    }

    /// Whether the memory is a mapping of its own advised for transparent
    /// huge pages ([`AlignedBuf::new_huge_pages`]): then it is most likely
    /// physically contiguous in runs of [`HUGE_PAGE_BYTES`], though the
    /// kernel may have backed it with small pages instead.
    pub fn is_huge_page_mapping(&self) -> bool {
        self.mapped
    }

    /// Bytes the allocation holds (at least `len`).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Sets the visible length to `len` bytes of the allocation, keeping
    /// what they hold (every byte of the allocation is initialised: it was
    /// zeroed when allocated). For callers that reuse one buffer for
    /// requests of several sizes, such as the C API's queue buffers.
    ///
    /// # Errors
    /// If `len` exceeds [`capacity`](AlignedBuf::capacity); nothing changes.
    pub fn set_len(&mut self, len: usize) -> Result<(), AlignedBufError> {
        if len > self.capacity() {
            return Err(AlignedBufError {
                len,
                align: self.align(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Sets the visible length to `len` bytes of the allocation and zeroes
    /// them.
    ///
    /// # Panics
    /// If `len` exceeds [`capacity`](AlignedBuf::capacity).
    pub(crate) fn reset_zeroed(&mut self, len: usize) {
        assert!(len <= self.capacity(), "{len} > {}", self.capacity());
        self.len = len;
        self.fill(0);
    }

    /// The alignment the buffer's address is guaranteed to have.
    pub fn align(&self) -> usize {
        self.layout.align()
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to an allocation of at least `len` bytes that
        // this struct owns and that was zero-initialised by `alloc_zeroed`
        // or is a fresh anonymous mapping, which the kernel zeroes (`len`
        // never exceeds `layout.size()`: `reset_zeroed` checks), so every
        // byte is initialised. The returned borrow is tied to `&self`,
        // so no `&mut` to the same bytes can exist while it lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; additionally `&mut self` guarantees this is
        // the only live reference to the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: `ptr` is the start of the mapping of
            // `layout.size()` bytes made by `new_huge_pages`, not unmapped
            // before (only `drop` unmaps it); no borrow of the bytes can
            // outlive `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.layout.size()) };
            return;
        }
        // SAFETY: `ptr` was returned by `alloc_zeroed(self.layout)` with this
        // very layout, has not been freed (only `drop` frees it), and no
        // borrow of the bytes can outlive `self`.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> AlignedBuf {
        // The layout was valid when `self` was built, so rebuilding the same
        // shape cannot fail; were it to, treat it like allocation failure.
        let mut copy = match AlignedBuf::new(self.len, self.align()) {
            Ok(buf) => buf,
            Err(_) => alloc::handle_alloc_error(self.layout),
        };
        copy.copy_from_slice(self);
        copy
    }
}

impl fmt::Debug for AlignedBuf {
    /// Shape only: dumping megabytes of buffer contents helps nobody.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align())
            .field("ptr", &self.ptr)
            .field("fixed", &self.fixed)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed_for_many_shapes() {
        for align in [1usize, 2, 8, 512, 4096, 65536] {
            for len in [0usize, 1, 511, 512, 4096, 100_000] {
                let buf = AlignedBuf::new(len, align).unwrap();
                assert_eq!(buf.len(), len);
                assert_eq!(buf.align(), align);
                assert_eq!(buf.as_ptr() as usize % align, 0, "len {len} align {align}");
                assert!(buf.iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn writes_are_visible_and_clone_is_deep() {
        let mut buf = AlignedBuf::new(4096, 4096).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = i as u8;
        }
        let copy = buf.clone();
        buf[0] = 0xff;
        assert_eq!(copy[0], 0);
        assert_eq!(copy[4095], 4095u32 as u8);
        assert_eq!(copy.as_ptr() as usize % 4096, 0);
        assert_ne!(copy.as_ptr(), buf.as_ptr());
    }

    #[test]
    fn set_len_keeps_contents_within_capacity() {
        let mut buf = AlignedBuf::new(8192, 4096).unwrap();
        buf.fill(7);
        buf.set_len(100).unwrap();
        assert_eq!(buf.len(), 100);
        buf.set_len(8192).unwrap();
        assert!(buf.iter().all(|&b| b == 7), "contents kept");
        assert_eq!(
            buf.set_len(8193).unwrap_err(),
            AlignedBufError {
                len: 8193,
                align: 4096
            }
        );
        assert_eq!(buf.len(), 8192, "a refused length changes nothing");
    }

    #[test]
    fn bad_alignment_is_an_error_not_a_panic() {
        for align in [0usize, 3, 12, 4097] {
            assert_eq!(
                AlignedBuf::new(16, align).unwrap_err(),
                AlignedBufError { len: 16, align }
            );
        }
        // Rounded up to the alignment, this overflows isize.
        assert!(AlignedBuf::new(isize::MAX as usize, 4096).is_err());
    }

    #[test]
    fn registration_tag_is_not_cloned_and_len_shrinks_within_capacity() {
        let mut buf = AlignedBuf::new(8192, 4096).unwrap();
        assert!(!buf.is_registered());
        buf.set_fixed_tag(Some(FixedTag {
            ring_id: 3,
            index: 7,
        }));
        buf.fill(9);
        assert!(buf.is_registered());
        assert!(!buf.clone().is_registered());
        buf.reset_zeroed(4096);
        assert_eq!(buf.len(), 4096);
        assert_eq!(buf.capacity(), 8192);
        assert!(buf.iter().all(|&b| b == 0));
        buf.reset_zeroed(8192);
        assert!(buf.iter().all(|&b| b == 0));
    }

    /// Minor page faults of the calling thread so far.
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage writes only the struct we pass.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; RUSAGE_THREAD is Linux's per-thread figure.
        assert_eq!(
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) },
            0
        );
        usage.ru_minflt
    }

    #[test]
    fn huge_page_buffers_are_aligned_zeroed_and_refuse_other_sizes() {
        for len in [HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES] {
            let mut buf = AlignedBuf::new_huge_pages(len).unwrap();
            assert_eq!((buf.len(), buf.capacity()), (len, len));
            assert_eq!(buf.align(), HUGE_PAGE_BYTES);
            assert_eq!(buf.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
            buf[len - 1] = 5;
            let copy = buf.clone();
            assert_eq!(copy[len - 1], 5);
            buf.reset_zeroed(len / 2);
            assert!(buf.iter().all(|&b| b == 0));
        }
        for len in [0, 4096, HUGE_PAGE_BYTES + 4096] {
            assert_eq!(
                AlignedBuf::new_huge_pages(len).unwrap_err(),
                AlignedBufError {
                    len,
                    align: HUGE_PAGE_BYTES
                }
            );
        }
    }

    /// The point of `new_huge_pages`: the advice is in place before the
    /// first touch, so touching every 4 KiB page of 2 MiB faults about once
    /// (a huge page), not 512 times. Zeroing heap memory before advising
    /// it, as `new` does, took the 512.
    #[test]
    fn a_huge_page_buffer_faults_once_per_huge_page() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !thp.contains("[always]") && !thp.contains("[madvise]") {
            eprintln!("skipped: transparent huge pages are off ({thp:?})");
            return;
        }
        let mut buf = AlignedBuf::new_huge_pages(HUGE_PAGE_BYTES).unwrap();
        let before = thread_minor_faults();
        for page in buf.chunks_mut(4096) {
            page[0] = 1;
        }
        let faults = thread_minor_faults() - before;
        assert!(
            faults < 64,
            "{faults} page faults touching one 2 MiB buffer (small pages)"
        );
    }

    #[test]
    fn moves_between_threads() {
        let mut buf = AlignedBuf::new(512, 512).unwrap();
        buf[7] = 7;
        let buf = std::thread::spawn(move || {
            assert_eq!(buf[7], 7);
            buf
        })
        .join()
        .unwrap();
        assert_eq!(buf[7], 7);
    }
}
