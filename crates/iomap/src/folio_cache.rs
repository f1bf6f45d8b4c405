//! The folio cache: one memory budget per volume, one [`Mapping`] (the
//! cached folios of a file) per open inode.
//!
//! # Budget
//!
//! Every folio's memory is counted from creation to drop. Before a folio is
//! created, [`FolioCache`] evicts clean folios with CLOCK (second chance: a
//! folio used since the hand last passed is spared once) until the new one
//! fits. Dirty folios and folios being written back are never evicted; writers
//! are throttled when dirty bytes reach [`CacheConfig::dirty_limit_bytes`],
//! which is below the budget, so clean folios to evict always exist and the
//! process stays within the budget.
//!
//! # Writeback errors
//!
//! A failed writeback is recorded in the file's mapping as an error sequence
//! (as Linux's `errseq_t`): every handle remembers the sequence it has seen,
//! and each handle's next `fsync` reports an error recorded since — once.
//!
//! # Fault model
//!
//! - A folio's lock is held only while copying to or from it, or while the
//!   device fills it; never while waiting for another folio's lock.
//! - Lock order: the CLOCK ring, then a mapping's folio tree. Folio locks
//!   come before a tree: writeback holds folios locked (across device I/O)
//!   while it looks up the next one in the tree. So nobody waits for a
//!   folio's lock while holding a tree (a queued tree writer would block
//!   writeback's lookup for good); under a tree a folio's lock is only
//!   tried (eviction), or taken where the inode's exclusive I/O lock keeps
//!   writeback out (punch).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use blockdev::{AlignedBuf, HUGE_PAGE_BYTES};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::background::Worker;
use crate::folio::{Folio, FolioState, FOLIO_ALIGN, MAX_FOLIO_BYTES, MIN_FOLIO_BYTES};
use crate::IomapError;

/// Default cache budget: an eighth of physical memory, within these bounds.
pub const DEFAULT_CACHE_MIN_BYTES: u64 = 64 << 20;
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 2 << 30;
/// Kernel-like defaults (`vm.dirty_background_ratio`, `vm.dirty_ratio`,
/// `vm.dirty_expire_centisecs`, `vm.dirty_writeback_centisecs`), as shares
/// of the cache instead of memory.
pub const DEFAULT_DIRTY_BACKGROUND_PERCENT: u64 = 10;
pub const DEFAULT_DIRTY_LIMIT_PERCENT: u64 = 20;
pub const DEFAULT_DIRTY_EXPIRE: Duration = Duration::from_secs(30);
pub const DEFAULT_WRITEBACK_INTERVAL: Duration = Duration::from_secs(5);
/// Write-behind is off by default: it does device work that a writer who
/// never syncs (or deletes the file) would not need, and where the device
/// costs CPU (a loop device, a RAM disk, 2 cores) that work slows the
/// writer. Streaming writers that end with `fsync` (logs, bulk loads) turn
/// it on with [`WRITE_BEHIND_CHUNK_BYTES`].
pub const DEFAULT_WRITE_BEHIND_BYTES: u64 = 0;
/// The write-behind chunk to use: two of the largest folios, so each chunk
/// keeps two device writes in flight while the writer fills the next.
pub const WRITE_BEHIND_CHUNK_BYTES: u64 = 2 * MAX_FOLIO_BYTES as u64;

/// Readahead threads per cache. Each reads a window with one synchronous
/// request at a time; two keep a second request queued at the device
/// while the first completes, so the device does not wait for a thread
/// between windows (raw 2 MiB reads from two threads: 5.3-5.6 GB/s
/// against 4.5-4.9 from one, loop device over tmpfs).
pub const READAHEAD_THREADS: usize = 2;

/// Largest read served by [`Mapping::copy_cached`]: a copy this size
/// (microseconds at memory bandwidth) is as long as a folio insert of the
/// same file may wait.
pub const CACHED_COPY_MAX_BYTES: usize = 64 << 10;

/// The cache's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Most bytes of folio memory.
    pub size_bytes: u64,
    /// Dirty bytes past which background writeback starts.
    pub dirty_background_bytes: u64,
    /// Dirty bytes past which writers write back before they return.
    pub dirty_limit_bytes: u64,
    /// Dirty data older than this is written back in the background.
    pub dirty_expire: Duration,
    /// How often background writeback looks for expired data.
    pub writeback_interval: Duration,
    /// A sequential writer's bytes are written back behind it in chunks
    /// of this size, while it goes on writing (0: off).
    pub write_behind_bytes: u64,
}

impl CacheConfig {
    /// A cache of `size_bytes` with the default dirty limits.
    pub fn with_size(size_bytes: u64) -> CacheConfig {
        let size_bytes = size_bytes.max(MAX_FOLIO_BYTES as u64 * 4);
        CacheConfig {
            size_bytes,
            dirty_background_bytes: size_bytes / 100 * DEFAULT_DIRTY_BACKGROUND_PERCENT,
            dirty_limit_bytes: size_bytes / 100 * DEFAULT_DIRTY_LIMIT_PERCENT,
            dirty_expire: DEFAULT_DIRTY_EXPIRE,
            writeback_interval: DEFAULT_WRITEBACK_INTERVAL,
            write_behind_bytes: DEFAULT_WRITE_BEHIND_BYTES,
        }
    }

    /// Checks the limits hold together.
    pub fn validate(&self) -> Result<(), String> {
        let min = MAX_FOLIO_BYTES as u64 * 4;
        if self.size_bytes < min {
            return Err(format!(
                "cache size {} is below the minimum of {min} bytes (four of the largest folios)",
                self.size_bytes
            ));
        }
        if self.dirty_limit_bytes == 0 || self.dirty_limit_bytes >= self.size_bytes {
            return Err(format!(
                "dirty limit {} must be above 0 and below the cache size {}",
                self.dirty_limit_bytes, self.size_bytes
            ));
        }
        if self.dirty_background_bytes > self.dirty_limit_bytes {
            return Err(format!(
                "background writeback threshold {} is above the dirty limit {}",
                self.dirty_background_bytes, self.dirty_limit_bytes
            ));
        }
        if !self
            .write_behind_bytes
            .is_multiple_of(MAX_FOLIO_BYTES as u64)
        {
            return Err(format!(
                "write-behind chunk {} is not a multiple of the largest folio ({MAX_FOLIO_BYTES} \
                 bytes; 0 turns write-behind off)",
                self.write_behind_bytes
            ));
        }
        Ok(())
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        // SAFETY: `sysconf` reads a system value and touches no memory of
        // ours; a negative answer (unknown) is handled below.
        let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let memory = u64::try_from(pages)
            .ok()
            .zip(u64::try_from(page).ok())
            .map(|(n, p)| n.saturating_mul(p))
            .unwrap_or(DEFAULT_CACHE_MIN_BYTES * 8);
        CacheConfig::with_size((memory / 8).clamp(DEFAULT_CACHE_MIN_BYTES, DEFAULT_CACHE_MAX_BYTES))
    }
}

/// The accounting every folio reaches (its memory and dirty bytes).
pub(crate) struct CacheShared {
    config: CacheConfig,
    used: AtomicU64,
    dirty: AtomicU64,
    /// Folios in CLOCK order; the hand is the front.
    clock: Mutex<VecDeque<Weak<Folio>>>,
    /// Memory of dropped folios, by size (index: log2 of the size over the
    /// smallest), kept for new folios: fresh memory costs a page fault per
    /// page on first touch. Counted in `used`.
    pool: Mutex<Vec<Vec<AlignedBuf>>>,
    /// Woken when dirty bytes drop (throttled writers) or rise past the
    /// background threshold (the flusher).
    dirty_changed: Condvar,
    dirty_lock: Mutex<()>,
    /// One per [`READAHEAD_THREADS`]; see [`FolioCache::readahead`].
    readahead: [Worker; READAHEAD_THREADS],
    write_behind: Worker,
}

impl CacheShared {
    pub(crate) fn add_dirty(&self, bytes: u64) {
        let now = self.dirty.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if now > self.config.dirty_background_bytes
            && now - bytes <= self.config.dirty_background_bytes
        {
            let _g = self.dirty_lock.lock();
            self.dirty_changed.notify_all();
        }
    }

    pub(crate) fn sub_dirty(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let before = self.dirty.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(before >= bytes, "dirty bytes underflow");
        if before > self.config.dirty_limit_bytes {
            let _g = self.dirty_lock.lock();
            self.dirty_changed.notify_all();
        }
    }

    /// A dropped folio's memory, kept for the next folio of its size.
    pub(crate) fn recycle(&self, buf: AlignedBuf) {
        if buf.is_empty() {
            return;
        }
        let order = order_of(buf.len());
        let mut pool = self.pool.lock();
        if pool.len() <= order {
            pool.resize_with(order + 1, Vec::new);
        }
        pool[order].push(buf);
    }

    /// Pooled memory of exactly `len` bytes.
    fn take_pooled(&self, len: usize) -> Option<AlignedBuf> {
        self.pool.lock().get_mut(order_of(len))?.pop()
    }

    /// Frees one pooled buffer (the largest); false if the pool is empty.
    fn free_pooled(&self) -> bool {
        let freed = {
            let mut pool = self.pool.lock();
            pool.iter_mut().rev().find_map(|sizes| sizes.pop())
        };
        match freed {
            Some(buf) => {
                self.used.fetch_sub(buf.len() as u64, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }
}

fn order_of(len: usize) -> usize {
    (len.max(MIN_FOLIO_BYTES) / MIN_FOLIO_BYTES).trailing_zeros() as usize
}

/// Fresh memory for a folio of `len` bytes. The largest folios are huge
/// pages, advised before their first touch: a cold read into one takes one
/// page fault instead of 512 (heap memory zeroed before the advice was
/// backed by small pages).
pub(crate) fn new_buffer(len: usize, pos: u64) -> Result<AlignedBuf, IomapError> {
    if len == MAX_FOLIO_BYTES && MAX_FOLIO_BYTES.is_multiple_of(HUGE_PAGE_BYTES) {
        return AlignedBuf::new_huge_pages(len)
            .map_err(|source| IomapError::Bounce { pos, source });
    }
    AlignedBuf::new(len, FOLIO_ALIGN).map_err(|source| IomapError::Bounce { pos, source })
}

/// A volume's folio cache: the budget and the eviction policy. Cheap to
/// clone.
#[derive(Clone)]
pub struct FolioCache {
    shared: Arc<CacheShared>,
}

impl std::fmt::Debug for FolioCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FolioCache")
            .field("config", &self.shared.config)
            .field("used", &self.used_bytes())
            .field("dirty", &self.dirty_bytes())
            .finish()
    }
}

impl FolioCache {
    pub fn new(config: CacheConfig) -> Result<FolioCache, String> {
        config.validate()?;
        Ok(FolioCache {
            shared: Arc::new(CacheShared {
                config,
                used: AtomicU64::new(0),
                dirty: AtomicU64::new(0),
                clock: Mutex::new(VecDeque::new()),
                pool: Mutex::new(Vec::new()),
                dirty_changed: Condvar::new(),
                dirty_lock: Mutex::new(()),
                readahead: [Worker::new("iomap-ra-even"), Worker::new("iomap-ra-odd")],
                write_behind: Worker::new("iomap-writebehind"),
            }),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.shared.config
    }

    /// The readahead thread for a window starting at file byte `pos`:
    /// neighbouring windows of the largest folio go to different threads,
    /// so while one thread waits for its window's device read, the other's
    /// read is queued at the device behind it.
    pub(crate) fn readahead(&self, pos: u64) -> &Worker {
        let slot = (pos / MAX_FOLIO_BYTES as u64) as usize % READAHEAD_THREADS;
        &self.shared.readahead[slot]
    }

    pub(crate) fn write_behind(&self) -> &Worker {
        &self.shared.write_behind
    }

    /// Waits until every write-behind queued so far is done: before a
    /// checkpoint or unmount writes back everything, so none of it runs
    /// after.
    pub fn wait_write_behind(&self) {
        self.shared.write_behind.wait_idle();
    }

    /// Waits until every readahead queued so far is done (for tests and
    /// benches: readahead otherwise runs on its own).
    pub fn wait_readahead(&self) {
        for worker in &self.shared.readahead {
            worker.wait_idle();
        }
    }

    /// Ends background I/O for good (the volume is going away, or a crash
    /// test dropped it): readahead and write-behind queued and not started
    /// are dropped (their data stays dirty for `fsync`), later ones are not
    /// queued, and this returns once those running now are done.
    pub fn stop_background(&self) {
        for worker in &self.shared.readahead {
            worker.stop();
        }
        self.shared.write_behind.stop();
    }

    /// Bytes of folio memory held now.
    pub fn used_bytes(&self) -> u64 {
        self.shared.used.load(Ordering::Relaxed)
    }

    /// Bytes of dirty blocks now.
    pub fn dirty_bytes(&self) -> u64 {
        self.shared.dirty.load(Ordering::Relaxed)
    }

    /// Dirty bytes are past the background threshold.
    pub fn over_background(&self) -> bool {
        self.dirty_bytes() > self.shared.config.dirty_background_bytes
    }

    /// Dirty bytes are past the limit at which writers must wait.
    pub fn over_dirty_limit(&self) -> bool {
        self.dirty_bytes() > self.shared.config.dirty_limit_bytes
    }

    /// Waits until dirty bytes may have changed across a threshold, or
    /// `timeout` passed (the background flusher's sleep, and a throttled
    /// writer's wait for it).
    pub fn wait_dirty_change(&self, timeout: Duration) {
        let mut g = self.shared.dirty_lock.lock();
        let _ = self.shared.dirty_changed.wait_for(&mut g, timeout);
    }

    /// [`Self::wait_dirty_change`], unless `stop` is set: checked under the
    /// lock that [`Self::notify_dirty_change`] takes, so a stop set before
    /// the notify is never slept through.
    pub fn wait_dirty_change_unless(&self, timeout: Duration, stop: &AtomicBool) {
        let mut g = self.shared.dirty_lock.lock();
        if stop.load(Ordering::Acquire) {
            return;
        }
        let _ = self.shared.dirty_changed.wait_for(&mut g, timeout);
    }

    /// Wakes whoever waits in [`Self::wait_dirty_change`].
    pub fn notify_dirty_change(&self) {
        let _g = self.shared.dirty_lock.lock();
        self.shared.dirty_changed.notify_all();
    }

    /// A new mapping (one file's folios) on this cache.
    pub fn new_mapping(&self) -> Mapping {
        Mapping {
            shared: Arc::new(MappingShared {
                folios: RwLock::new(BTreeMap::new()),
                count: Default::default(),
                cache: self.clone(),
                writeback: Mutex::new(()),
                write_behind_end: AtomicU64::new(0),
                errors: Mutex::new(ErrorSeq::default()),
                sequential: Sequential::default(),
                readahead_end: AtomicU64::new(0),
            }),
        }
    }

    /// Memory for a new folio of `len` bytes within the budget: a pooled
    /// buffer of that size, or fresh memory once pooled buffers of other
    /// sizes and clean folios (CLOCK) have made room. When nothing can be
    /// evicted (every folio dirty or in use) it goes over by this folio.
    fn acquire(&self, len: usize, pos: u64) -> Result<AlignedBuf, IomapError> {
        let budget = self.shared.config.size_bytes;
        loop {
            if let Some(buf) = self.shared.take_pooled(len) {
                return Ok(buf);
            }
            if self.used_bytes() + len as u64 <= budget
                || !(self.shared.free_pooled() || self.evict_one())
            {
                self.shared.used.fetch_add(len as u64, Ordering::Relaxed);
                return new_buffer(len, pos).inspect_err(|_| {
                    self.shared.used.fetch_sub(len as u64, Ordering::Relaxed);
                });
            }
        }
    }

    /// Evicts one clean folio (its memory goes to the pool); false when a
    /// full turn of the hand found none.
    fn evict_one(&self) -> bool {
        let mut clock = self.shared.clock.lock();
        // Each folio is looked at at most twice (once to clear its bit).
        for _ in 0..clock.len() * 2 {
            let Some(weak) = clock.pop_front() else {
                return false;
            };
            let Some(folio) = weak.upgrade() else {
                continue; // dropped already (its file closed or shrank)
            };
            if folio.take_reference() || !try_evict(&folio) {
                clock.push_back(weak);
            } else {
                return true;
            }
        }
        false
    }

    /// Counts a new folio of `len` bytes and enters it in the CLOCK ring.
    fn admit(&self, folio: &Arc<Folio>) {
        self.shared.clock.lock().push_back(Arc::downgrade(folio));
    }
}

/// Removes `folio` from its mapping if it is clean, idle and unused: its
/// memory goes when the last reference does.
fn try_evict(folio: &Arc<Folio>) -> bool {
    let Some(mapping) = folio.mapping.upgrade() else {
        return true; // its mapping is gone: it will be dropped with it
    };
    // Waiting for the tree is safe: nobody holding a tree waits for the
    // CLOCK ring (lock order: ring, tree, folio), and a tree is held only
    // briefly (a scan for dirty folios, an insert).
    let mut folios = mapping.folios.write();
    {
        let Some(mut state) = folio.try_lock() else {
            return false;
        };
        if state.dirty.any() {
            return false;
        }
        // A thread that found it before and locks it after sees this and
        // looks again: its write must land in the folio the tree holds.
        state.evicted = true;
    }
    match folios.get(&folio.pos()) {
        Some(f) if Arc::ptr_eq(f, folio) => {
            folios.remove(&folio.pos());
            mapping.count.fetch_sub(1, Ordering::AcqRel);
            true
        }
        _ => true,
    }
}

/// Writeback errors of one file (see the module docs).
#[derive(Debug, Default)]
struct ErrorSeq {
    /// Bumped by every recorded error.
    seq: u64,
    last: Option<(i32, String)>,
}

/// Sequential-access detection for readahead: the next offset a
/// sequential reader would ask for, and how large its folios have grown;
/// the same for writers. Atomics, not a lock: every cached read updates
/// them, and a race between two readers only perturbs a heuristic.
#[derive(Debug, Default)]
pub(crate) struct Sequential {
    pub next_pos: AtomicU64,
    pub window: std::sync::atomic::AtomicUsize,
    pub next_write_pos: AtomicU64,
    pub write_window: std::sync::atomic::AtomicUsize,
}

/// One file's cached folios and writeback state.
pub(crate) struct MappingShared {
    /// Folios by file offset; they never overlap.
    pub folios: RwLock<BTreeMap<u64, Arc<Folio>>>,
    /// `folios.len()`, readable without the tree's lock: every direct I/O
    /// asks whether anything is cached.
    pub count: std::sync::atomic::AtomicUsize,
    pub cache: FolioCache,
    /// Held by whoever writes this file back: one writeback at a time.
    pub writeback: Mutex<()>,
    /// How far write-behind has been asked to write back a sequential
    /// writer's bytes ([`crate::buffered_io`]).
    pub write_behind_end: AtomicU64,
    errors: Mutex<ErrorSeq>,
    pub sequential: Sequential,
    /// How far asynchronous readahead has been asked to read.
    pub readahead_end: AtomicU64,
}

/// A file's page cache (its folios, writeback lock and errors). The file
/// system keeps one per open inode.
pub struct Mapping {
    pub(crate) shared: Arc<MappingShared>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("folios", &self.shared.folios.read().len())
            .finish_non_exhaustive()
    }
}

/// Where a handle stands in its file's writeback error sequence.
#[derive(Debug, Default)]
pub struct ErrorCursor(AtomicU64);

impl Mapping {
    /// The cache this mapping's folios count against.
    pub fn cache(&self) -> &FolioCache {
        &self.shared.cache
    }

    /// Whether any folio is cached (direct I/O then flushes and invalidates
    /// first).
    pub fn is_empty(&self) -> bool {
        self.shared.count.load(Ordering::Acquire) == 0
    }

    /// Whether any block is dirty.
    pub fn is_dirty(&self) -> bool {
        let mut dirty = false;
        self.each_folio_state(|state| {
            dirty = state.dirty.any();
            !dirty
        });
        dirty
    }

    /// When the oldest dirty block of the file became dirty.
    pub fn dirty_since(&self) -> Option<std::time::Instant> {
        let mut oldest = None;
        self.each_folio_state(|state| {
            if let Some(t) = state.dirty_since {
                oldest = Some(oldest.map_or(t, |o: std::time::Instant| o.min(t)));
            }
            true
        });
        oldest
    }

    /// Calls `look` with each cached folio's state, locked, until it
    /// returns false. The tree is never held while a folio lock is waited
    /// for: writeback holds folios locked while it looks up the next one in
    /// the tree (lock order: folio, then tree), and a tree writer queued
    /// between the two would block that lookup for good.
    fn each_folio_state(&self, mut look: impl FnMut(&FolioState) -> bool) {
        let mut pos = 0;
        while let Some(folio) = self.next_folio(pos, u64::MAX) {
            pos = folio.end();
            if !look(&folio.lock()) {
                return;
            }
        }
    }

    /// Cached folios (for tests and diagnostics): (offset, length).
    pub fn folio_spans(&self) -> Vec<(u64, usize)> {
        self.shared
            .folios
            .read()
            .values()
            .map(|f| (f.pos(), f.len()))
            .collect()
    }

    /// The folio holding file byte `pos`, if cached.
    pub(crate) fn find(&self, pos: u64) -> Option<Arc<Folio>> {
        let folios = self.shared.folios.read();
        let (_, f) = folios.range(..=pos).next_back()?;
        (pos < f.end()).then(|| f.clone())
    }

    /// Copies `[pos, pos + buf.len())` into `buf` when one cached folio
    /// holds all of it uptodate and is not busy; returns whether it did.
    /// The folio is used under the tree's read lock, which takes no
    /// reference (one atomic pair less per hit than [`Self::find`]), so
    /// only copies up to [`CACHED_COPY_MAX_BYTES`] come here: inserting a
    /// folio waits for them. `try_lock` keeps it deadlock-free: whoever
    /// holds a folio's lock may wait for the tree's write lock.
    pub(crate) fn copy_cached(&self, pos: u64, buf: &mut [u8]) -> bool {
        if buf.len() > CACHED_COPY_MAX_BYTES {
            return false;
        }
        let folios = self.shared.folios.read();
        let Some((_, folio)) = folios.range(..=pos).next_back() else {
            return false;
        };
        let end = pos + buf.len() as u64;
        if end > folio.end() {
            return false;
        }
        let Some(state) = folio.try_lock() else {
            return false;
        };
        let from = (pos - folio.pos()) as usize;
        let to = from + buf.len();
        if state.evicted || !state.uptodate.all(folio.blocks_of(from, to)) {
            return false;
        }
        buf.copy_from_slice(&state.data[from..to]);
        folio.touch();
        true
    }

    /// The folio holding `pos`, creating an empty one (nothing uptodate) of
    /// at most `want` bytes when none is cached: the largest power of two
    /// that is naturally aligned, at least `min_len` (a block, or a page),
    /// and does not overlap a cached neighbour.
    pub(crate) fn find_or_create(
        &self,
        pos: u64,
        want: usize,
        block_bytes: usize,
    ) -> Result<Arc<Folio>, IomapError> {
        if let Some(f) = self.find(pos) {
            f.touch();
            return Ok(f);
        }
        let min_len = block_bytes.max(MIN_FOLIO_BYTES);
        let want = want.clamp(min_len, MAX_FOLIO_BYTES).next_power_of_two();
        let folios = self.shared.folios.write();
        if let Some((_, f)) = folios.range(..=pos).next_back() {
            if pos < f.end() {
                return Ok(f.clone());
            }
        }
        let prev_end = folios
            .range(..=pos)
            .next_back()
            .map(|(_, f)| f.end())
            .unwrap_or(0);
        let next_start = folios
            .range(pos + 1..)
            .next()
            .map(|(&p, _)| p)
            .unwrap_or(u64::MAX);
        let mut len = want;
        loop {
            let start = pos - pos % len as u64;
            if (start >= prev_end && start + len as u64 <= next_start) || len == min_len {
                break;
            }
            len /= 2;
        }
        let start = pos - pos % len as u64;
        drop(folios);
        // Memory before the tree is taken again: eviction takes trees.
        let cache = &self.shared.cache;
        let data = cache.acquire(len, start)?;
        let mut folios = self.shared.folios.write();
        // Another thread may have cached a folio in the range meanwhile.
        if let Some((_, f)) = folios.range(..start + len as u64).next_back() {
            if f.end() > start {
                let found = (pos >= f.pos() && pos < f.end()).then(|| f.clone());
                drop(folios);
                cache.shared.recycle(data);
                return match found {
                    Some(f) => Ok(f),
                    None => self.find_or_create(pos, want, block_bytes),
                };
            }
        }
        let folio = Arc::new(Folio::new(
            start,
            len,
            block_bytes,
            data,
            Arc::downgrade(&self.shared),
            cache.shared.clone(),
        ));
        folios.insert(start, folio.clone());
        self.shared.count.fetch_add(1, Ordering::AcqRel);
        drop(folios);
        cache.admit(&folio);
        Ok(folio)
    }

    /// The first folio that ends past `pos` and starts before `to`: a walk
    /// over the range that holds one folio at a time (a snapshot of all
    /// would keep evicted folios' memory alive while it lasts).
    pub(crate) fn next_folio(&self, pos: u64, to: u64) -> Option<Arc<Folio>> {
        if pos >= to {
            return None;
        }
        let folios = self.shared.folios.read();
        if let Some((_, f)) = folios.range(..=pos).next_back() {
            if f.end() > pos {
                return Some(f.clone());
            }
        }
        folios.range(pos..to).next().map(|(_, f)| f.clone())
    }

    /// Folios overlapping `[from, to)`, in file order.
    pub(crate) fn folios_in(&self, from: u64, to: u64) -> Vec<Arc<Folio>> {
        let folios = self.shared.folios.read();
        let first = folios
            .range(..=from)
            .next_back()
            .filter(|(_, f)| f.end() > from)
            .map(|(&p, _)| p)
            .unwrap_or(from);
        folios.range(first..to).map(|(_, f)| f.clone()).collect()
    }

    /// After a direct write put `data` at file offset `pos` on the device:
    /// every cached block it overlaps that is uptodate takes its bytes and
    /// becomes dirty. A dirty block keeps the bytes a buffered writer put
    /// around them, as if that write came first; without this, the
    /// buffered write's older copy of the direct write's bytes (read into
    /// the block before the direct write landed) would be written back
    /// over them. Dirty also for a clean block: a writeback that raced the
    /// direct write may have put that older copy on the device after it.
    /// Blocks not uptodate are left alone: they are read from the device,
    /// which has the direct write's bytes. Waits for a folio's lock.
    pub(crate) fn write_through(&self, pos: u64, data: &[u8]) {
        let end = pos + data.len() as u64;
        for folio in self.folios_in(pos, end) {
            let mut state = folio.lock();
            copy_into_uptodate_blocks(&folio, &mut state, pos, data);
        }
    }

    /// [`Self::write_through`] for a thread that must not wait (an
    /// asynchronous queue's reaper): false, with the folios before it
    /// updated, at the first folio whose lock is held (a writeback, a
    /// buffered reader or writer). Calling `write_through` after it is
    /// safe: copying the same bytes again changes nothing.
    pub(crate) fn try_write_through(&self, pos: u64, data: &[u8]) -> bool {
        let end = pos + data.len() as u64;
        for folio in self.folios_in(pos, end) {
            let Some(mut state) = folio.try_lock() else {
                return false;
            };
            copy_into_uptodate_blocks(&folio, &mut state, pos, data);
        }
        true
    }

    /// Drops the clean folios overlapping `[from, to)` (waiting for a
    /// writeback holding one). A folio dirtied again since the caller wrote
    /// it back stays: a racing buffered write is never lost (as Linux's
    /// invalidation gives up on dirty pages); its clean blocks in the range
    /// stop being uptodate, so they are read again, not served stale.
    pub(crate) fn invalidate(&self, from: u64, to: u64) {
        for folio in self.folios_in(from, to) {
            {
                let mut state = folio.lock();
                if state.dirty.any() {
                    let start = from.saturating_sub(folio.pos()) as usize;
                    let end = (to.min(folio.end()) - folio.pos()) as usize;
                    let blocks = folio.blocks_of(start, end);
                    folio.forget_clean(&mut state, blocks);
                    continue;
                }
                state.evicted = true;
            }
            let mut folios = self.shared.folios.write();
            if folios
                .get(&folio.pos())
                .is_some_and(|f| Arc::ptr_eq(f, &folio))
            {
                folios.remove(&folio.pos());
                self.shared.count.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Drops every clean folio (dirty ones stay): a cold cache for the
    /// file, with the memory pooled for new folios. Readahead queued before
    /// the call is waited for and dropped with the rest: run after the
    /// drop, it filled the cold cache behind it (the bench's cold passes
    /// then found a window of the file cached).
    pub fn drop_clean(&self) {
        self.cache().wait_readahead();
        self.invalidate(0, u64::MAX);
    }

    /// Makes the cached bytes of `[from, to)` read as zeros, as truncate
    /// and hole punching make the file's: folios wholly inside are dropped
    /// (dirty data in them with them), the covered bytes of folios at the
    /// edges are zeroed in place. The caller holds the inode's I/O lock
    /// exclusive (no writeback runs), and has written back what it keeps:
    /// this only catches what a racing write cached since.
    pub fn punch(&self, from: u64, to: u64) {
        for folio in self.folios_in(from, to) {
            if folio.pos() >= from && folio.end() <= to {
                let mut folios = self.shared.folios.write();
                folio.lock().evicted = true;
                if folios
                    .get(&folio.pos())
                    .is_some_and(|f| Arc::ptr_eq(f, &folio))
                {
                    folios.remove(&folio.pos());
                    self.shared.count.fetch_sub(1, Ordering::AcqRel);
                }
                continue;
            }
            let mut state = folio.lock();
            let a = (from.max(folio.pos()) - folio.pos()) as usize;
            let b = (to.min(folio.end()) - folio.pos()) as usize;
            state.data[a..b].fill(0);
        }
    }

    /// Records a writeback error for every handle's next `fsync`.
    pub(crate) fn record_error(&self, errno: i32, what: String) {
        let mut errors = self.shared.errors.lock();
        errors.seq += 1;
        errors.last = Some((errno, what));
    }

    /// A cursor at the current end of the error sequence: a new handle sees
    /// only errors recorded after it was opened.
    pub fn error_cursor(&self) -> ErrorCursor {
        ErrorCursor(AtomicU64::new(self.shared.errors.lock().seq))
    }

    /// The writeback error recorded since `cursor` last looked, once.
    pub fn take_error(&self, cursor: &ErrorCursor) -> Option<(i32, String)> {
        let errors = self.shared.errors.lock();
        let seen = cursor.0.swap(errors.seq, Ordering::AcqRel);
        if seen == errors.seq {
            return None;
        }
        errors.last.clone()
    }

    pub(crate) fn writeback_lock(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.shared.writeback.lock()
    }
}

/// The body of [`Mapping::write_through`] for one folio, locked.
fn copy_into_uptodate_blocks(folio: &Folio, state: &mut FolioState, pos: u64, data: &[u8]) {
    if state.evicted {
        return;
    }
    let end = pos + data.len() as u64;
    let from = pos.max(folio.pos());
    let to = end.min(folio.end());
    let (start, stop) = ((from - folio.pos()) as usize, (to - folio.pos()) as usize);
    let bs = folio.block_bytes();
    for block in folio.blocks_of(start, stop) {
        if !state.uptodate.get(block) {
            continue;
        }
        let a = start.max(block * bs);
        let b = stop.min((block + 1) * bs);
        let src = (folio.pos() + a as u64 - pos) as usize;
        state.data[a..b].copy_from_slice(&data[src..src + (b - a)]);
        folio.set_dirty(state, block..block + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(size: u64) -> FolioCache {
        let mut config = CacheConfig::with_size(size);
        config.size_bytes = size;
        FolioCache::new(config).unwrap()
    }

    #[test]
    fn copy_cached_serves_only_uptodate_bytes_of_one_idle_folio() {
        let c = cache(64 << 20);
        let m = c.new_mapping();
        let f = m.find_or_create(0, 16384, 4096).unwrap();
        {
            let mut state = f.lock();
            for (i, b) in state.data.iter_mut().enumerate() {
                *b = i as u8;
            }
            f.set_uptodate(&mut state, 0..2);
        }
        let mut buf = vec![0u8; 4096];
        assert!(m.copy_cached(1000, &mut buf));
        assert!(buf.iter().enumerate().all(|(i, &b)| b == (i + 1000) as u8));
        // Block 2 is not uptodate, and nothing is cached past the folio.
        assert!(!m.copy_cached(6000, &mut buf));
        assert!(!m.copy_cached(16000, &mut buf));
        assert!(!m.copy_cached(1 << 20, &mut buf));
        // A busy folio is left to the slow path, which waits for it.
        let held = f.lock();
        assert!(!m.copy_cached(0, &mut buf));
        drop(held);
        f.lock().evicted = true;
        assert!(!m.copy_cached(0, &mut buf));
        // Large copies never hold the tree.
        let mut big = vec![0u8; CACHED_COPY_MAX_BYTES + 4096];
        assert!(!m.copy_cached(0, &mut big));
    }

    /// A readahead job queued before `drop_clean` (here: one that caches a
    /// folio, held back behind a gate until the drop has been called)
    /// lands before the drop, not after it: nothing is cached afterwards.
    #[test]
    fn drop_clean_leaves_no_folio_of_readahead_queued_before_it() {
        let c = cache(64 << 20);
        let m = Arc::new(c.new_mapping());
        let (open_gate, gate) = std::sync::mpsc::channel::<()>();
        assert!(c.readahead(0).submit(Box::new(move || {
            let _ = gate.recv();
        })));
        let filler = m.clone();
        assert!(c.readahead(0).submit(Box::new(move || {
            let f = filler.find_or_create(0, 65536, 4096).unwrap();
            let mut state = f.lock();
            f.set_uptodate(&mut state, 0..16);
        })));
        let (calling, called) = std::sync::mpsc::channel::<()>();
        let dropper = {
            let m = m.clone();
            std::thread::spawn(move || {
                calling.send(()).unwrap();
                m.drop_clean();
            })
        };
        called.recv().unwrap();
        open_gate.send(()).unwrap();
        dropper.join().unwrap();
        c.wait_readahead();
        assert!(m.is_empty(), "cached after the drop: {:?}", m.folio_spans());
    }

    #[test]
    fn folios_are_aligned_powers_of_two_that_never_overlap() {
        let c = cache(64 << 20);
        let m = c.new_mapping();
        let a = m.find_or_create(8192, 4096, 4096).unwrap();
        assert_eq!((a.pos(), a.len()), (8192, 4096));
        // A 64 KiB folio wanted at 0 would cover [0, 64 KiB) and overlap the
        // one at 8 KiB: it shrinks to 8 KiB.
        let b = m.find_or_create(0, 65536, 4096).unwrap();
        assert_eq!((b.pos(), b.len()), (0, 8192));
        // Above: aligned down to its own size.
        let d = m.find_or_create(3 << 20, 2 << 20, 4096).unwrap();
        assert_eq!((d.pos(), d.len()), (2 << 20, 2 << 20));
        assert!(Arc::ptr_eq(
            &m.find_or_create(3 << 20, 4096, 4096).unwrap(),
            &d
        ));
        let used = 4096 + 8192 + (2 << 20);
        assert_eq!(c.used_bytes(), used);
        drop((a, b, d));
        drop(m);
        // Their memory is pooled, still counted, and serves new folios of
        // the same sizes without growing.
        assert_eq!(c.used_bytes(), used);
        let m = c.new_mapping();
        let again = m.find_or_create(0, 2 << 20, 4096).unwrap();
        assert_eq!(again.len(), 2 << 20);
        assert_eq!(c.used_bytes(), used, "a pooled buffer was not reused");
    }

    #[test]
    fn clean_folios_are_evicted_to_stay_in_the_budget_dirty_ones_never() {
        let budget = 16 << 20;
        let c = cache(budget);
        let m = c.new_mapping();
        // Eight dirty 1 MiB folios: half the budget, kept.
        for i in 0..8u64 {
            let f = m.find_or_create(i << 20, 1 << 20, 4096).unwrap();
            let mut st = f.lock();
            let all = f.blocks_of(0, f.len());
            f.set_dirty(&mut st, all);
        }
        // Then a long scan of clean folios: the budget holds throughout.
        for i in 8..200u64 {
            let f = m.find_or_create(i << 20, 1 << 20, 4096).unwrap();
            drop(f);
            assert!(c.used_bytes() <= budget, "over budget at folio {i}");
        }
        for i in 0..8u64 {
            assert!(m.find(i << 20).is_some(), "dirty folio {i} was evicted");
        }
        assert_eq!(c.dirty_bytes(), 8 << 20);
    }

    #[test]
    fn dirty_state_covers_every_folio_and_the_oldest_dirty_time() {
        let c = cache(16 << 20);
        let m = c.new_mapping();
        let folios: Vec<_> = (0..3u64)
            .map(|i| m.find_or_create(i << 20, 1 << 20, 4096).unwrap())
            .collect();
        assert!(!m.is_dirty() && m.dirty_since().is_none());
        let dirty = |f: &Arc<Folio>| {
            let mut st = f.lock();
            f.set_dirty(&mut st, 0..1);
            st.dirty_since.unwrap()
        };
        // The middle folio first, then the first: the oldest is the middle
        // one's, and a clean folio after them changes nothing.
        let older = dirty(&folios[1]);
        let newer = dirty(&folios[0]);
        assert!(older <= newer);
        assert!(m.is_dirty());
        assert_eq!(m.dirty_since(), Some(older));
        let mut st = folios[1].lock();
        folios[1].clear_dirty(&mut st, 0..1);
        drop(st);
        assert_eq!(m.dirty_since(), Some(newer));
        let mut st = folios[0].lock();
        folios[0].clear_dirty(&mut st, 0..1);
        drop(st);
        // Only the last folio dirty: found past the clean ones.
        let last = dirty(&folios[2]);
        assert!(m.is_dirty());
        assert_eq!(m.dirty_since(), Some(last));
    }

    #[test]
    fn a_used_folio_gets_a_second_chance() {
        let c = cache(8 << 20);
        let m = c.new_mapping();
        let hot = m.find_or_create(0, 1 << 20, 4096).unwrap().pos();
        for i in 1..64u64 {
            drop(m.find_or_create(i << 20, 1 << 20, 4096).unwrap());
            // The hot folio is read between every new one.
            m.find(hot).unwrap().touch();
        }
        assert!(m.find(hot).is_some(), "a folio in constant use was evicted");
    }

    #[test]
    fn each_handle_sees_a_writeback_error_once() {
        let c = cache(16 << 20);
        let m = c.new_mapping();
        let old = m.error_cursor();
        m.record_error(libc::EIO, "writeback at 4096".into());
        let new = m.error_cursor();
        assert_eq!(m.take_error(&old).unwrap().0, libc::EIO);
        assert!(m.take_error(&old).is_none(), "reported twice");
        assert!(m.take_error(&new).is_none(), "opened after the error");
        m.record_error(libc::ENOSPC, "writeback at 0".into());
        assert_eq!(m.take_error(&new).unwrap().0, libc::ENOSPC);
        assert_eq!(m.take_error(&old).unwrap().0, libc::ENOSPC);
    }

    #[test]
    fn limits_must_hold_together() {
        assert!(CacheConfig::default().validate().is_ok());
        let mut c = CacheConfig::with_size(64 << 20);
        c.dirty_limit_bytes = c.size_bytes;
        assert!(c.validate().is_err());
        let mut c = CacheConfig::with_size(64 << 20);
        c.dirty_background_bytes = c.dirty_limit_bytes + 1;
        assert!(c.validate().is_err());
        let mut c = CacheConfig::with_size(64 << 20);
        c.size_bytes = 4096;
        assert!(c.validate().is_err());
    }
}
