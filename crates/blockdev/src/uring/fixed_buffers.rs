//! Registered buffers: a per-queue pool whose pages the kernel pins once.
//!
//! With [`UringDevice::with_fixed_buffers`](super::UringDevice::with_fixed_buffers)`(count, len)`, each queue
//! allocates `count` buffers of `len` bytes (page-aligned, each a separate
//! [`AlignedBuf`] allocation) and registers them with its ring, one iovec
//! per buffer (`IORING_REGISTER_BUFFERS`). The kernel pins their pages
//! once, instead of per request. [`DeviceQueue::alloc_buffer`](crate::DeviceQueue::alloc_buffer) hands them
//! out; each carries a crate-private tag `(ring id, table index)`. A read or
//! write whose buffer carries *this* ring's tag, and lies inside the region
//! registered at that index, goes out as `READ_FIXED`/`WRITE_FIXED`; every
//! other buffer (plain, bounced, another queue's) as plain `READ`/`WRITE`.
//!
//! Why the tag can be trusted, which is the whole problem (a buffer merely
//! *at* a registered address may be a new allocation on pinned pages the
//! kernel would write through behind Rust's back):
//!
//! - The tag is a private field of `AlignedBuf`, set only here, at
//!   registration. It moves with the allocation (moving or swapping the
//!   value moves both) and is never copied (`Clone` makes an untagged
//!   buffer). Each table index is handed out at most once at a time, so at
//!   most one live `AlignedBuf` carries a given `(ring, index)` and it owns
//!   exactly the registered allocation.
//! - A handed-out buffer is the caller's. [`DeviceQueue::recycle_buffer`](crate::DeviceQueue::recycle_buffer)
//!   puts it back in the pool. Dropping it is an ordinary free; its table
//!   entry is then simply dead: no live buffer carries its tag, so no fixed
//!   entry ever names that index again, and the kernel's pinned pages behind
//!   it are never written or read (they are released at unregistration).
//!   The pool shrinks by one; that is the price of the simple design.
//! - The in-flight argument (in `queue`) is unchanged: a fixed entry's buffer is
//!   owned by the in-flight table until its completion, like a plain one.
//! - `Drop` waits for all in-flight entries, then unregisters the table,
//!   and only then do the pool's own buffers (fields) get freed.
//!
//! If registration fails (typically `ENOMEM` from `RLIMIT_MEMLOCK`), the
//! queue works without a pool: `alloc_buffer` returns `None` and
//! [`UringQueue::fixed_buffer_error`](super::UringQueue::fixed_buffer_error) says why.
//!
//! Buffers registered one at a time. A queue without a configured pool
//! registers buffers on demand instead
//! ([`DeviceQueue::register_buffer`](crate::DeviceQueue::register_buffer)),
//! for a caller that keeps its buffers across many requests (the C API's
//! queue buffers): the first one registers a sparse table
//! (`IORING_REGISTER_BUFFERS2` with `IORING_RSRC_REGISTER_SPARSE`), and each
//! buffer fills one empty entry (`IORING_REGISTER_BUFFERS_UPDATE`), tagged
//! as above. [`DeviceQueue::unregister_buffer`](crate::DeviceQueue::unregister_buffer)
//! empties the entry again before the buffer is freed; only then is the
//! index handed out anew, so at most one live buffer carries it. A tagged
//! buffer dropped instead leaves its entry dead, as above.

use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::IoUring;

use super::setup::errno_text;
use crate::aligned_buf::FixedTag;
use crate::{AlignedBuf, DeviceCaps};

/// Most entries a registered-buffer table holds (the kernel's
/// `IORING_MAX_REG_BUFFERS`).
const MAX_FIXED_BUFFERS: usize = 1 << 14;

/// Source of ring ids for registered-buffer tags: unique per queue for the
/// life of the process, so a tag never names another queue's table.
static NEXT_RING_ID: AtomicU64 = AtomicU64::new(1);

/// Per-queue pool of registered buffers (see "Registered buffers" in the
/// [`crate::uring`] docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedBufferOptions {
    /// Buffers per queue; 0 (the default) turns the pool off. At most
    /// 16384.
    pub count: usize,
    /// Bytes per buffer; 0 turns the pool off.
    pub len: usize,
}

/// A queue's registered-buffer table and the buffers of it not handed out.
pub(super) struct FixedPool {
    /// Tags of this ring's buffers carry this id; unique per queue.
    ring_id: u64,
    /// `(address, length)` registered at each table index; empty when the
    /// queue has no pool.
    regions: Vec<(usize, usize)>,
    /// Buffers of the table that are neither handed out nor in flight.
    /// Declared after `ring` in `UringQueue`, but freed only after `Drop`
    /// unregistered the table, whatever the field order.
    free: Vec<AlignedBuf>,
    /// Why the configured pool (or the sparse table) could not be
    /// registered.
    error: Option<String>,
    /// Entries sent with `READ_FIXED`/`WRITE_FIXED`.
    pub(super) fixed_entries: u64,
    /// A sparse table is registered (buffers one at a time), with these
    /// entries empty (indexes below `regions.len()`; the rest are empty
    /// too).
    sparse: Option<Vec<u16>>,
}

impl FixedPool {
    pub(super) fn none() -> FixedPool {
        FixedPool {
            ring_id: NEXT_RING_ID.fetch_add(1, Ordering::Relaxed),
            regions: Vec::new(),
            free: Vec::new(),
            error: None,
            fixed_entries: 0,
            sparse: None,
        }
    }

    /// Allocates `opts.count` buffers and registers them with `ring`.
    pub(super) fn register(
        ring: &IoUring,
        caps: &DeviceCaps,
        opts: FixedBufferOptions,
    ) -> FixedPool {
        let mut pool = FixedPool::none();
        if opts.count == 0 || opts.len == 0 {
            return pool;
        }
        let count = opts.count.min(MAX_FIXED_BUFFERS);
        // Page-aligned, so each buffer pins only its own pages and never
        // needs a bounce.
        let align = (caps.memory_alignment.max(caps.logical_block_size) as usize).max(4096);
        let mut bufs = Vec::with_capacity(count);
        for _ in 0..count {
            match AlignedBuf::new(opts.len, align) {
                Ok(buf) => bufs.push(buf),
                Err(e) => {
                    pool.error = Some(e.to_string());
                    return pool;
                }
            }
        }
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: each iovec is the whole of a live allocation owned by
        // `bufs`. From here on the kernel touches those pages only for a
        // READ_FIXED/WRITE_FIXED entry naming the index, and such an entry
        // is only pushed for a buffer that carries this ring's tag for that
        // index and is owned by the in-flight table until its completion
        // (module docs): the memory is live and exclusively the kernel's
        // for the transfer. A tagged buffer the caller dropped is never
        // named again; its pages stay pinned by the kernel, not accessed,
        // until `Drop` unregisters the table.
        if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
            pool.error = Some(format!(
                "registering {count} buffers of {} bytes failed: {}",
                opts.len,
                errno_text(&e)
            ));
            return pool;
        }
        for (index, buf) in bufs.iter_mut().enumerate() {
            pool.regions.push((buf.as_ptr() as usize, buf.len()));
            buf.set_fixed_tag(Some(FixedTag {
                ring_id: pool.ring_id,
                index: index as u16,
            }));
        }
        // Hand out low indexes first.
        bufs.reverse();
        pool.free = bufs;
        pool
    }

    /// Registered buffers in the table (0 without a pool).
    pub(super) fn registered(&self) -> usize {
        self.regions.iter().filter(|&&(_, len)| len > 0).count()
    }

    /// Why a configured pool is missing (registration failed), if it is.
    pub(super) fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// A zeroed buffer of `len` bytes from the pool, if one is free and
    /// large enough.
    pub(super) fn take(&mut self, len: usize) -> Option<AlignedBuf> {
        let at = self.free.iter().rposition(|b| b.capacity() >= len)?;
        let mut buf = self.free.swap_remove(at);
        buf.reset_zeroed(len);
        Some(buf)
    }

    /// Registers a new zeroed buffer of `len` bytes in an empty entry of
    /// the sparse table (registering the table first); `None` when the
    /// queue has a configured pool, the table is full, or registration
    /// failed (`error` says why).
    pub(super) fn register_one(
        &mut self,
        ring: &IoUring,
        caps: &DeviceCaps,
        len: usize,
    ) -> Option<AlignedBuf> {
        if len == 0 || (self.sparse.is_none() && !self.regions.is_empty()) {
            return None;
        }
        if self.sparse.is_none() {
            if let Err(e) = ring
                .submitter()
                .register_buffers_sparse(MAX_FIXED_BUFFERS as u32)
            {
                self.error = Some(format!(
                    "registering a sparse table of {MAX_FIXED_BUFFERS} buffers failed: {}",
                    errno_text(&e)
                ));
                return None;
            }
            self.sparse = Some(Vec::new());
        }
        let empty = self.sparse.as_mut()?;
        let index = match empty.pop() {
            Some(index) => usize::from(index),
            None if self.regions.len() < MAX_FIXED_BUFFERS => self.regions.len(),
            None => return None,
        };
        let align = (caps.memory_alignment.max(caps.logical_block_size) as usize).max(4096);
        let Ok(mut buf) = AlignedBuf::new(len, align) else {
            empty.push(index as u16);
            return None;
        };
        let iovec = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.capacity(),
        };
        // SAFETY: the iovec is the whole of a live allocation that `buf`
        // owns, and entry `index` is empty. The kernel touches those pages
        // only for a READ_FIXED/WRITE_FIXED entry naming `index`, pushed only
        // for the one buffer carrying this ring's tag for it, owned by the
        // in-flight table until its completion (module docs). If `buf` is
        // dropped without `unregister_one`, the entry is dead: never named
        // again, the pages pinned until the table is unregistered.
        if let Err(e) = unsafe {
            ring.submitter()
                .register_buffers_update(index as u32, &[iovec], None)
        } {
            self.error = Some(format!(
                "registering a buffer of {len} bytes at index {index} failed: {}",
                errno_text(&e)
            ));
            empty.push(index as u16);
            return None;
        }
        if index == self.regions.len() {
            self.regions.push((0, 0));
        }
        self.regions[index] = (buf.as_ptr() as usize, buf.capacity());
        buf.set_fixed_tag(Some(FixedTag {
            ring_id: self.ring_id,
            index: index as u16,
        }));
        Some(buf)
    }

    /// Empties the sparse-table entry of `buf` (one of `register_one`'s,
    /// whole) and frees it; its index may then be handed out again. Any
    /// other buffer is simply dropped.
    pub(super) fn unregister_one(&mut self, ring: &IoUring, buf: AlignedBuf) {
        let Some(index) = self.index_of(&buf) else {
            return;
        };
        let Some(empty) = self.sparse.as_mut() else {
            return;
        };
        if self.regions[usize::from(index)].0 != buf.as_ptr() as usize {
            return;
        }
        let iovec = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: an empty iovec registers nothing: it only drops the
        // kernel's reference to the pages of entry `index` (requests still
        // using them keep their own).
        if unsafe {
            ring.submitter()
                .register_buffers_update(u32::from(index), &[iovec], None)
        }
        .is_ok()
        {
            self.regions[usize::from(index)] = (0, 0);
            empty.push(index);
        }
        // Otherwise the entry stays dead (never named again): still safe.
        drop(buf);
    }

    /// Puts `buf` back if it is one of this ring's own buffers, whole (as
    /// registered); drops anything else.
    pub(super) fn put_back(&mut self, buf: AlignedBuf) {
        if self.sparse.is_none() && self.index_of(&buf).is_some() {
            let index = buf.fixed_tag().map_or(0, |t| t.index as usize);
            if self.regions[index].0 == buf.as_ptr() as usize {
                self.free.push(buf);
            }
        }
    }

    /// Unregisters the table. Only with nothing in flight, and before the
    /// pool's buffers are freed.
    pub(super) fn unregister(&self, ring: &IoUring) {
        if !self.regions.is_empty() || self.sparse.is_some() {
            let _ = ring.submitter().unregister_buffers();
        }
    }

    /// The table index to name for `buf`, if it is one of this ring's
    /// registered buffers and lies inside the region registered for it.
    pub(super) fn index_of(&self, buf: &AlignedBuf) -> Option<u16> {
        let tag = buf.fixed_tag()?;
        if tag.ring_id != self.ring_id {
            return None;
        }
        let &(base, len) = self.regions.get(tag.index as usize)?;
        let start = buf.as_ptr() as usize;
        let inside = start >= base && start.checked_add(buf.len())? <= base + len;
        inside.then_some(tag.index)
    }
}
