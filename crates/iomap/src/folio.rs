//! A folio: one cached, naturally aligned, power-of-two piece of a file, from
//! [`MIN_FOLIO_BYTES`] to [`MAX_FOLIO_BYTES`], with per-block uptodate and
//! dirty state (as Linux's `iomap_folio_state`).
//!
//! Blocks are file-system blocks. A block is *uptodate* when the folio holds
//! the file's bytes for it; *dirty* when those bytes are newer than the
//! device's. A dirty block is always uptodate. A partial write makes only its
//! edge blocks uptodate first (reading or zeroing them), never the folio.
//!
//! Writeback writes dirty blocks straight from the folio with its lock held,
//! so until that I/O completes the folio can be neither evicted nor
//! invalidated (a reader that missed it would read the device's older
//! bytes).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use blockdev::AlignedBuf;
use parking_lot::lock_api::ArcMutexGuard;
use parking_lot::{Mutex, MutexGuard, RawMutex};

use crate::folio_cache::{CacheShared, MappingShared};

/// Smallest folio: a page.
pub const MIN_FOLIO_BYTES: usize = 4096;
/// Largest folio: a huge page.
pub const MAX_FOLIO_BYTES: usize = 2 << 20;
/// Memory alignment of folio data: page-aligned, so any device can take it.
pub const FOLIO_ALIGN: usize = 4096;

/// One bit per block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks(Box<[u64]>);

impl Blocks {
    fn new(count: usize) -> Blocks {
        Blocks(vec![0u64; count.div_ceil(64)].into_boxed_slice())
    }

    pub fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, i: usize, on: bool) {
        if on {
            self.0[i / 64] |= 1 << (i % 64);
        } else {
            self.0[i / 64] &= !(1 << (i % 64));
        }
    }

    /// Sets blocks `range` on or off; returns how many changed.
    fn set_range(&mut self, range: std::ops::Range<usize>, on: bool) -> usize {
        let mut changed = 0;
        for i in range {
            if self.get(i) != on {
                self.set(i, on);
                changed += 1;
            }
        }
        changed
    }

    pub fn all(&self, range: std::ops::Range<usize>) -> bool {
        range.into_iter().all(|i| self.get(i))
    }

    pub fn any(&self) -> bool {
        self.0.iter().any(|&w| w != 0)
    }
}

/// What the folio's lock protects.
pub struct FolioState {
    pub data: AlignedBuf,
    pub uptodate: Blocks,
    pub dirty: Blocks,
    /// When the oldest dirty block became dirty (for writeback by age).
    pub dirty_since: Option<Instant>,
    /// Removed from its mapping (evicted, invalidated, punched): a thread
    /// that found it before must look the offset up again.
    pub evicted: bool,
}

/// A cached piece of a file. See the module docs.
pub struct Folio {
    pos: u64,
    len: usize,
    block_bytes: usize,
    state: Arc<Mutex<FolioState>>,
    /// CLOCK's reference bit: used since the hand last passed.
    referenced: AtomicBool,
    pub(crate) mapping: Weak<MappingShared>,
    cache: Arc<CacheShared>,
}

impl std::fmt::Debug for Folio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Folio")
            .field("pos", &self.pos)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Folio {
    /// A folio of `len` bytes (a power of two, aligned at `pos`) with
    /// nothing uptodate. Its memory counts against the cache until dropped.
    pub(crate) fn new(
        pos: u64,
        len: usize,
        block_bytes: usize,
        data: AlignedBuf,
        mapping: Weak<MappingShared>,
        cache: Arc<CacheShared>,
    ) -> Folio {
        debug_assert!(len.is_power_of_two() && pos.is_multiple_of(len as u64));
        debug_assert!(len.is_multiple_of(block_bytes));
        let blocks = len / block_bytes;
        Folio {
            pos,
            len,
            block_bytes,
            state: Arc::new(Mutex::new(FolioState {
                data,
                uptodate: Blocks::new(blocks),
                dirty: Blocks::new(blocks),
                dirty_since: None,
                evicted: false,
            })),
            // Unreferenced until used again: a folio read once (a scan) goes
            // before one read twice.
            referenced: AtomicBool::new(false),
            mapping,
            cache,
        }
    }

    pub fn pos(&self) -> u64 {
        self.pos
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn end(&self) -> u64 {
        self.pos + self.len as u64
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The folio locked by a guard that owns a reference to it: held across
    /// a queued writeback, which completes after the caller's scope.
    pub fn lock_owned(self: &Arc<Self>) -> ArcMutexGuard<RawMutex, FolioState> {
        // The state is a field of the folio; an owned guard needs the mutex
        // behind an `Arc` of its own, which `state` is.
        self.state.lock_arc()
    }

    pub fn lock(&self) -> MutexGuard<'_, FolioState> {
        self.state.lock()
    }

    pub fn try_lock(&self) -> Option<MutexGuard<'_, FolioState>> {
        self.state.try_lock()
    }

    /// Marks the folio used (CLOCK gives it a second chance).
    pub fn touch(&self) {
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
    }

    /// Clears the reference bit; returns whether it was set.
    pub(crate) fn take_reference(&self) -> bool {
        self.referenced.swap(false, Ordering::Relaxed)
    }

    /// Block indexes of the folio bytes `[from, to)` (offsets inside the
    /// folio), rounded out to whole blocks.
    pub fn blocks_of(&self, from: usize, to: usize) -> std::ops::Range<usize> {
        from / self.block_bytes..to.div_ceil(self.block_bytes)
    }

    /// Marks blocks uptodate.
    pub fn set_uptodate(&self, state: &mut FolioState, blocks: std::ops::Range<usize>) {
        state.uptodate.set_range(blocks, true);
    }

    /// Makes the clean blocks of `blocks` not uptodate (the next access
    /// reads them from the device); dirty ones stay as they are.
    pub fn forget_clean(&self, state: &mut FolioState, blocks: std::ops::Range<usize>) {
        for i in blocks {
            if !state.dirty.get(i) {
                state.uptodate.set(i, false);
            }
        }
    }

    /// Marks blocks dirty (and uptodate), counting them in the cache's dirty
    /// bytes.
    pub fn set_dirty(&self, state: &mut FolioState, blocks: std::ops::Range<usize>) {
        state.uptodate.set_range(blocks.clone(), true);
        let newly = state.dirty.set_range(blocks, true);
        if newly > 0 {
            self.cache.add_dirty((newly * self.block_bytes) as u64);
            state.dirty_since.get_or_insert_with(Instant::now);
        }
    }

    /// Clears dirty blocks (their bytes are being written back).
    pub fn clear_dirty(&self, state: &mut FolioState, blocks: std::ops::Range<usize>) {
        let cleaned = state.dirty.set_range(blocks, false);
        if cleaned > 0 {
            self.cache.sub_dirty((cleaned * self.block_bytes) as u64);
        }
        if !state.dirty.any() {
            state.dirty_since = None;
        }
    }
}

impl Drop for Folio {
    fn drop(&mut self) {
        let mut state = self.state.lock();
        let dirty = (0..self.len / self.block_bytes)
            .filter(|&i| state.dirty.get(i))
            .count();
        // A dropped dirty folio is data discarded on purpose (its file was
        // deleted or truncated): its bytes leave the dirty count with it.
        self.cache.sub_dirty((dirty * self.block_bytes) as u64);
        let data = std::mem::replace(
            &mut state.data,
            AlignedBuf::new(0, 1).expect("a zero-length buffer needs no memory"),
        );
        self.cache.recycle(data);
    }
}
