//! A queue's buffers (`iomapfs_queue_buf_alloc`), found by address.
//!
//! Every request looks its `buf` up here, so the exact lookup (is this the
//! start of a queue buffer?) is one hash probe: a queue buffer starts on a
//! page of its own (it is page-aligned and not empty), so its page number
//! is its key, spread by a multiplicative hash. The ordered index of starts
//! only answers "is this address inside a queue buffer?", which only
//! requests that are not zero-copy ask.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use blockdev::AlignedBuf;

/// Alignment every queue buffer has at least: its start is on a page of
/// its own.
pub(crate) const QUEUE_BUF_MIN_ALIGN: usize = 4096;

/// One queue buffer.
pub(crate) struct QueueBuf {
    /// `Some` while the caller holds it, `None` while it is lent to a
    /// request.
    pub buf: Option<AlignedBuf>,
    pub capacity: usize,
}

/// Hashes a page-aligned address: its page number times a 64-bit odd
/// constant (Fibonacci hashing), so both the low bits the table indexes by
/// and the high bits it tags entries with vary between buffers.
#[derive(Default)]
pub(crate) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `usize` keys are hashed here; any other use still hashes
        // every byte.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, addr: usize) {
        self.0 = ((addr / QUEUE_BUF_MIN_ALIGN) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The queue buffers of one queue, by start address.
#[derive(Default)]
pub(crate) struct QueueBufs {
    by_start: HashMap<usize, QueueBuf, BuildHasherDefault<PageHasher>>,
    /// Start → capacity of the same buffers, ordered.
    starts: BTreeMap<usize, usize>,
}

impl QueueBufs {
    /// Adds a buffer the caller holds; returns its start address.
    pub fn insert(&mut self, mut buf: AlignedBuf) -> usize {
        debug_assert!(buf.capacity() > 0 && buf.align() >= QUEUE_BUF_MIN_ALIGN);
        let start = buf.as_mut_ptr() as usize;
        let capacity = buf.capacity();
        self.starts.insert(start, capacity);
        self.by_start.insert(
            start,
            QueueBuf {
                buf: Some(buf),
                capacity,
            },
        );
        start
    }

    /// The buffer starting at `addr`.
    pub fn at(&mut self, addr: usize) -> Option<&mut QueueBuf> {
        self.by_start.get_mut(&addr)
    }

    /// The buffer `addr` lies inside (its start, and it), whether or not
    /// `addr` is its start.
    pub fn containing(&self, addr: usize) -> Option<(usize, &QueueBuf)> {
        let (&start, &capacity) = self.starts.range(..=addr).next_back()?;
        if addr >= start + capacity {
            return None;
        }
        self.by_start.get(&start).map(|entry| (start, entry))
    }

    /// Forgets the buffer starting at `addr` (and frees it, if held).
    pub fn remove(&mut self, addr: usize) -> Option<QueueBuf> {
        self.starts.remove(&addr);
        self.by_start.remove(&addr)
    }
}
