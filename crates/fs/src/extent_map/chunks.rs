//! The storage under [`super::ExtentMap`]: extents sorted by file offset in
//! shared copy-on-write chunks.
//!
//! A checkpoint snapshots every extent map under the metadata write lock by
//! cloning it, and the first change to a file afterwards must copy whatever
//! the snapshot still shares. With one shared tree that copy is the whole
//! file (a million extents take tens of milliseconds, all under the lock);
//! here it is one chunk of at most [`CHUNK_MAX`] extents, the entries of
//! its segment (at most [`SEGMENT_MAX`] chunks) and the outer vector of
//! segments.
//!
//! A lookup is three binary searches: over the segments' first offsets,
//! over the chunks' in one segment, and in one chunk. It allocates
//! nothing, but when it opens a cold segment (see [`Segment`]) or loads
//! an absent chunk.
//!
//! Positions ([`Pos`]) are indices: any change invalidates them, so callers
//! look positions up again after each change.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::page_slots::ExtentStore;
use super::search::first_key_at_or_after;
use crate::codec::{PageRef, PageRun};
use crate::error::Result;
use crate::types::{Extent, Ino};

/// Most extents in one chunk: what the first change after a snapshot copies
/// (16 KiB of extents). Small in unit tests, so that their few extents
/// span many chunks and every split and merge path runs.
pub(super) const CHUNK_MAX: usize = if cfg!(test) { 8 } else { 512 };
/// Most bytes of extents one chunk keeps in memory.
#[cfg(test)]
pub(crate) const CHUNK_BYTES_MAX: u64 = (CHUNK_MAX * std::mem::size_of::<Extent>()) as u64;
/// Fewest extents in a chunk unless it is the only one: a smaller chunk is
/// merged with a neighbour, so the outer vector stays short however the
/// extents were removed.
const CHUNK_MIN: usize = CHUNK_MAX / 4;
// A chunk is written as one extent page.
const _: () = assert!(CHUNK_MAX <= crate::codec::PAGE_MAX_EXTENTS);

/// Memory a chunk of an open segment takes whatever its extents: its
/// entry in the segment's vector, which holds an absent chunk's page
/// (one of a cold segment takes its page reference alone). The loader
/// counts it against the budget ([`Chunks::shell_bytes`]); a loaded
/// chunk's extents are charged apart ([`PageLoader::cache_charge`]),
/// and its allocation beside them (about a hundred bytes, against tens
/// of KiB of extents) is not counted.
pub(crate) const CHUNK_SHELL_BYTES: u64 = std::mem::size_of::<Chunk>() as u64;

#[derive(Clone, Debug)]
struct Chunk {
    /// `extents[0].file_off` (for an absent chunk, its page's first key).
    first: u64,
    extents: Slot,
}

impl Chunk {
    fn new(extents: impl Into<ExtentStore>) -> Self {
        let extents = extents.into();
        Chunk {
            first: extents[0].file_off,
            extents: Slot::built(ChunkExtents::with(
                OnceLock::from(extents),
                OnceLock::new(),
                OnceLock::new(),
            )),
        }
    }

    /// A chunk whose extents are in `page` only, read from `source` when
    /// first needed; its extents must end by `limit` (the next chunk's
    /// first key when the page was named: pages are sorted and disjoint).
    /// Allocates nothing: its page is in its entry.
    fn absent(page: PageRef, source: Arc<PageSource>, limit: u64) -> Self {
        Chunk {
            first: page.first_key,
            extents: Slot {
                absent: Some(AbsentPage {
                    page,
                    source,
                    limit,
                }),
                loaded: OnceLock::new(),
            },
        }
    }

    /// Extents without loading: the page's count for an absent chunk.
    fn count(&self) -> usize {
        self.extents.count()
    }

    #[inline]
    fn is_loaded(&self) -> bool {
        self.extents.get().is_some()
    }
}

/// An absent chunk's page, where to read it, and the key its extents
/// must end by.
#[derive(Clone, Debug)]
struct AbsentPage {
    page: PageRef,
    source: Arc<PageSource>,
    limit: u64,
}

impl AbsentPage {
    /// The page's extents, verified (see [`PageLoader::load`]) and ending
    /// by the limit.
    fn read(&self, purpose: LoadPurpose) -> Result<Vec<Extent>> {
        let (page, limit) = (&self.page, self.limit);
        let ino = self.source.ino;
        // The keys the chunk owns (up to the next page's first key): what
        // cannot be read while the page is lost.
        let got = self
            .source
            .loader
            .load(ino, page, purpose)
            .map_err(|e| match e {
                crate::Error::Corrupt {
                    what,
                    offset,
                    reason,
                } => crate::Error::Corrupt {
                    what,
                    offset,
                    reason: format!(
                        "{reason}; file offsets {}..{limit} of inode {ino} cannot be mapped",
                        page.first_key
                    ),
                },
                other => other,
            })?;
        if let Some(last) = got.last().filter(|e| e.file_end() > limit) {
            return Err(crate::codec::page_lost(
                ino,
                page,
                page.addr,
                format!(
                    "its last extent ends at file offset {}, past the next page's first key {limit}",
                    last.file_end(),
                ),
            ));
        }
        Ok(got)
    }
}

/// A chunk's extents as its segment holds them: loaded (or built with
/// them), or *absent*, known by its page in the entry itself (mount and
/// the evictor leave chunks so; no allocation) until a lookup loads it.
/// Loading sets `loaded` through a shared reference, so a snapshot
/// sharing the segment sees the extents too. An absent chunk is never
/// changed: the fallible entry points of [`super::ExtentMap`] load the
/// chunks a change reaches first; `Deref` and [`Slot::make_mut`] load
/// what a path forgot (counted, [`PageLoader::note_unplanned`]), and
/// panic rather than answer with extents a chunk does not hold if that
/// load fails.
#[derive(Clone, Debug)]
struct Slot {
    /// Set while the chunk is known by its page: absent, or loaded from
    /// it (and unchanged since: a change clears it).
    absent: Option<AbsentPage>,
    loaded: OnceLock<Arc<ChunkExtents>>,
}

impl Slot {
    fn built(extents: ChunkExtents) -> Slot {
        Slot {
            absent: None,
            loaded: OnceLock::from(Arc::new(extents)),
        }
    }

    /// The loaded extents, if they are.
    #[inline]
    fn get(&self) -> Option<&ChunkExtents> {
        self.loaded.get().map(|a| &**a)
    }

    fn count(&self) -> usize {
        match (self.get(), &self.absent) {
            (Some(v), _) => v.len(),
            (None, Some(a)) => a.page.count as usize,
            (None, None) => 0,
        }
    }

    /// The page holding exactly the extents, if one is named.
    fn page(&self) -> Option<PageRef> {
        match (self.get(), &self.absent) {
            (Some(v), _) => v.page.get().copied(),
            (None, Some(a)) => Some(a.page),
            (None, None) => None,
        }
    }

    /// The extents, reading the page of an absent chunk (under whatever
    /// lock the caller holds on the map: a shared one suffices), with
    /// room for an insert when `to_change` (see
    /// [`ExtentStore::with_room`]).
    fn load(&self, to_change: bool) -> Result<&ChunkExtents> {
        if let Some(v) = self.get() {
            return Ok(v);
        }
        let Some(absent) = &self.absent else {
            return Err(crate::Error::invalid(
                "loading an extent chunk",
                "an absent chunk has no page (a bug)",
            ));
        };
        let got = absent.read(LoadPurpose::Keep)?;
        let mut loaded = spare_chunks::take();
        let fill = Arc::get_mut(&mut loaded).expect("a spare chunk is unshared");
        // Assigned, not set: nothing of what the allocation held before
        // can survive.
        let room = if to_change {
            room_to_grow(got.len())
        } else {
            0
        };
        fill.extents = OnceLock::from(ExtentStore::with_room(got, room));
        fill.page = OnceLock::from(absent.page);
        fill.source = OnceLock::from(absent.source.clone());
        // Another reader may have loaded it meanwhile: the same extents,
        // and that one's charge.
        let v = self.loaded.get_or_init(|| loaded);
        v.charge();
        Ok(v)
    }

    #[cold]
    fn load_unplanned(&self) -> &ChunkExtents {
        if let Some(a) = &self.absent {
            a.source.loader.note_unplanned();
        }
        match self.load(false) {
            Ok(v) => v,
            // No answer would be right: an empty chunk would be silent
            // wrong data (a hole over written blocks).
            Err(e) => panic!("an extent chunk needed outside a fallible path is lost: {e}"),
        }
    }

    /// The extents, to change: loaded first if absent, copied first if a
    /// snapshot shares them; no longer known by a page.
    fn make_mut(&mut self) -> &mut ExtentStore {
        debug_assert!(
            self.get().is_some(),
            "changing an absent extent chunk: the change's entry point must load it first"
        );
        if self.get().is_none() {
            self.load_unplanned();
        }
        self.absent = None;
        Arc::make_mut(self.loaded.get_mut().expect("loaded above")).changing()
    }

    /// The loaded extents, taken out (the slot is left absent, or empty).
    fn take_loaded(&mut self) -> Option<Arc<ChunkExtents>> {
        self.loaded.take()
    }
}

impl Deref for Slot {
    type Target = ChunkExtents;
    #[inline]
    fn deref(&self) -> &ChunkExtents {
        match self.get() {
            Some(v) => v,
            None => self.load_unplanned(),
        }
    }
}

/// Reads the extent page of one file's chunk: the device behind an absent
/// chunk. Implemented by the volume (`mount`), and by tests.
pub trait PageLoader: Send + Sync {
    /// The extents `page` of inode `ino` holds, verified against `page`
    /// (magic, inode, first key, count, crc, bytes mapped) and each one
    /// checked as a map's extent is; `Error::Corrupt` naming the inode,
    /// the page's keys and device byte if not, `Error::Device` if the read
    /// failed (a later access tries again).
    fn load(&self, ino: Ino, page: &PageRef, purpose: LoadPurpose) -> Result<Vec<Extent>>;

    /// A chunk was loaded outside the fallible entry points
    /// ([`super::ExtentMap::load_keys`] and the like): a path that should
    /// have loaded it first did not. Counted by the loader so tests can
    /// assert none happens on the paths they drive.
    fn note_unplanned(&self) {}

    /// A chunk now keeps `bytes` of extents in memory that its page holds
    /// too (loaded from it, or written to it by a base): what eviction
    /// can give back. Counted by the loader against the volume's budget.
    fn cache_charge(&self, _bytes: u64) {}

    /// A chunk charged holds its extents in a slot of the pool
    /// (`page_slots`): the budget then leaves room for the pool's warm
    /// free slots.
    fn slots_in_use(&self) {}

    /// Such a chunk dropped its extents, or changed (and no longer
    /// matches its page): the bytes [`PageLoader::cache_charge`] added.
    fn cache_refund(&self, _bytes: u64) {}

    /// A chunk that had a page changed: its `bytes` of extents are in
    /// memory only (never evicted) until a base gives them a page again.
    /// Counted by the loader, so that changes can ask for a base before
    /// such chunks pass the budget.
    fn chunk_unpaged(&self, _bytes: u64) {}

    /// A lookup opened a cold segment: its chunks' shells take `bytes`
    /// until the segment is dropped (made cold again by the evictor, or
    /// replaced). Counted by the loader with the maps' shells, against
    /// the budget.
    fn shells_opened(&self, _bytes: u64) {}

    /// Such a segment dropped: the bytes [`PageLoader::shells_opened`]
    /// added.
    fn shells_dropped(&self, _bytes: u64) {}
}

/// Why a page is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadPurpose {
    /// Its chunk keeps the extents (a lookup or a change needs them).
    Keep,
    /// A pass over every extent reads it and drops the extents
    /// ([`Chunks::for_each_unkept`]); the chunk stays absent.
    Scan,
}

/// Where one file's absent chunks are read from.
pub struct PageSource {
    pub ino: Ino,
    pub loader: Arc<dyn PageLoader>,
}

impl std::fmt::Debug for PageSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageSource {{ ino: {} }}", self.ino)
    }
}

/// A chunk's extents, and the extent page on disk that holds exactly them,
/// once a checkpoint has written one.
///
/// Every way to change the extents goes through `ChunkExtents::changing`
/// (from `Slot::make_mut`), which forgets the page (whether `Arc::make_mut` copied the chunk from a snapshot or
/// changes it in place). So a chunk that names a page holds what the page
/// holds, however the chunk was changed, and the chunks without one are
/// what the next checkpoint must write. A copy keeps the page: it holds
/// the same extents until it is changed.
///
/// A chunk whose extents are in memory and that names its page and a
/// source (loaded from the page, or recorded as written by a base) is
/// *clean*: its bytes are charged to the loader's count
/// ([`PageLoader::cache_charge`]) until it drops or changes, and the
/// evictor may replace it with an absent chunk sharing the page
/// ([`Chunks::evict`]). A lookup sets `referenced`, the evictor's clock
/// bit.
// `repr(C)`, extents first: a lookup reads the extents' pointer and
// length (of the vector or the slot) right after the `Arc`'s counts, and the clock bit after them,
// in the allocation's first cache line.
#[derive(Debug)]
#[repr(C)]
struct ChunkExtents {
    /// Always set (a `OnceLock` for `Clone`'s sake).
    extents: OnceLock<ExtentStore>,
    /// Set by a lookup, cleared by the evictor's sweep: a chunk found set
    /// is passed over once (the clock's second chance).
    referenced: AtomicBool,
    /// Bytes charged to the source's loader (0: none): set once the chunk
    /// is clean with its extents in memory, given back when it drops or
    /// changes. A chunk's vector is a few tens of KiB at most; 32 bits
    /// beside the clock bit keep every loaded chunk's allocation 16
    /// bytes smaller.
    charged: AtomicU32,
    /// Set through a shared reference: the checkpoint writer records the
    /// page in its snapshot's chunk, which the live map shares while the
    /// chunk is unchanged.
    page: OnceLock<PageRef>,
    /// Where the page is read from: set for a chunk loaded from it, and
    /// by a base that wrote the chunk's page.
    source: OnceLock<Arc<PageSource>>,
}

impl Clone for ChunkExtents {
    /// A copy (`Arc::make_mut` before a change): the same extents and
    /// page, charged on its own.
    fn clone(&self) -> Self {
        let copy = ChunkExtents::with(self.extents.clone(), self.page.clone(), self.source.clone());
        copy.charge();
        copy
    }
}

impl Drop for ChunkExtents {
    fn drop(&mut self) {
        self.refund();
    }
}

impl ChunkExtents {
    fn with(
        extents: OnceLock<ExtentStore>,
        page: OnceLock<PageRef>,
        source: OnceLock<Arc<PageSource>>,
    ) -> Self {
        ChunkExtents {
            extents,
            referenced: AtomicBool::new(false),
            page,
            source,
            charged: AtomicU32::new(0),
        }
    }

    /// Sets the clock bit. Read first and written only if clear, so a
    /// hot chunk's line is not written on every lookup.
    #[inline]
    fn touch(&self) {
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
    }

    /// Charges a clean chunk's bytes to its loader, once.
    fn charge(&self) {
        let (Some(v), Some(_), Some(source)) =
            (self.extents.get(), self.page.get(), self.source.get())
        else {
            return;
        };
        // The entry is counted apart (`CHUNK_SHELL_BYTES`), loaded or not.
        let bytes = u32::try_from(v.capacity() * std::mem::size_of::<Extent>()).unwrap_or(u32::MAX);
        // Two readers loading the same chunk: one charges.
        if self
            .charged
            .compare_exchange(0, bytes, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            source.loader.cache_charge(u64::from(bytes));
            if matches!(v, ExtentStore::Slot(_)) {
                source.loader.slots_in_use();
            }
        }
    }

    fn refund(&mut self) {
        let bytes = std::mem::take(self.charged.get_mut());
        if let (true, Some(source)) = (bytes > 0, self.source.get()) {
            source.loader.cache_refund(u64::from(bytes));
        }
    }
}

impl Deref for ChunkExtents {
    type Target = [Extent];
    #[inline]
    fn deref(&self) -> &[Extent] {
        self.extents
            .get()
            .expect("a chunk's extents are set when it is built")
    }
}

impl ChunkExtents {
    /// Extents the chunk's memory could hold (what a clean chunk is
    /// charged as).
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.extents.get().map_or(0, ExtentStore::capacity)
    }

    /// The extents, to change in place (an insert makes its own room,
    /// see [`grow_for_one_more`]; a removal adds none).
    fn changing(&mut self) -> &mut ExtentStore {
        // Changed: no longer what its page holds, so not the loader's to
        // count (a chunk without a page is never evicted).
        self.refund();
        let (page, source) = (self.page.take(), self.source.take());
        let extents = self
            .extents
            .get_mut()
            .expect("a chunk's extents are set when it is built");
        // The memory it holds until a base pages it, counted as it will
        // be once an insert made room (most changes insert: a chunk read
        // into a full slot then moves to a larger one).
        if let (Some(_), Some(source)) = (page, source) {
            let capacity = extents.capacity_with_room(room_to_grow(extents.len()));
            let bytes = capacity * std::mem::size_of::<Extent>();
            source.loader.chunk_unpaged(bytes as u64);
        }
        extents
    }
}

/// One chunk as a checkpoint sees it: its extents, and the page that holds
/// them if one was written.
pub struct ChunkPage<'a> {
    at: PageAt<'a>,
    /// The chunk is its segment's first.
    starts_segment: bool,
}

enum PageAt<'a> {
    /// A chunk of an open segment.
    Open(&'a Slot),
    /// Chunk `index` of a cold segment, known by its page alone.
    Cold {
        segment: &'a Segment,
        index: usize,
        page: &'a PageRef,
    },
}

impl ChunkPage<'_> {
    /// The extents (loading an absent chunk, see [`ChunkExtents`]; a cold
    /// segment's is opened first).
    pub fn extents(&self) -> &[Extent] {
        match self.at {
            PageAt::Open(chunk) => &chunk[..],
            PageAt::Cold { segment, index, .. } => &segment.chunks()[index].extents[..],
        }
    }

    /// Whether the extents are in memory (see [`ChunkExtents`]); an absent
    /// chunk always names its page.
    pub fn is_loaded(&self) -> bool {
        match self.at {
            PageAt::Open(chunk) => chunk.get().is_some(),
            PageAt::Cold { .. } => false,
        }
    }

    /// Extents the chunk holds, without loading it.
    pub fn count(&self) -> usize {
        match self.at {
            PageAt::Open(chunk) => chunk.count(),
            PageAt::Cold { page, .. } => page.count as usize,
        }
    }

    /// Whether the chunk is the first of its segment: a base lists the
    /// pages of a segment's chunks in index pages of their own, so that
    /// a change rewrites the index pages of the segments it reaches only.
    pub fn starts_segment(&self) -> bool {
        self.starts_segment
    }

    /// The page holding exactly [`ChunkPage::extents`], if one was written.
    pub fn page(&self) -> Option<PageRef> {
        match self.at {
            PageAt::Open(chunk) => chunk.page(),
            PageAt::Cold { page, .. } => Some(*page),
        }
    }

    /// Records that `page` now holds the chunk's extents (written from
    /// [`ChunkPage::extents`] and durable), and `source` (when given) as
    /// where to read it again: the chunk is then clean, charged to the
    /// source's loader and evictable. The live map sees it for as long as
    /// it shares the chunk. Fails if the chunk already names another
    /// page.
    pub fn record_written(
        &self,
        page: PageRef,
        source: Option<&Arc<PageSource>>,
    ) -> Result<(), PageRef> {
        let chunk = match self.at {
            PageAt::Open(slot) => match slot.get() {
                Some(chunk) => chunk,
                // Absent: it names its page.
                None if slot.page() == Some(page) => return Ok(()),
                None => return Err(slot.page().unwrap_or(page)),
            },
            // A cold chunk is absent and names its page: nothing to record.
            PageAt::Cold { page: named, .. } if *named == page => return Ok(()),
            PageAt::Cold { page: named, .. } => return Err(*named),
        };
        match chunk.page.set(page) {
            // After the page is set: a count stamped before this misses it.
            Ok(()) => unpaged_count::page_recorded(),
            Err(_) if self.page() == Some(page) => {}
            Err(_) => return Err(self.page().unwrap_or(page)),
        }
        if let Some(source) = source {
            let _ = chunk.source.set(source.clone());
            chunk.charge();
        }
        Ok(())
    }
}

/// A chunk the evictor replaced by an absent one: its first key and the
/// loaded chunk (freed when the last map sharing it lets go: the caller
/// drops it after releasing its lock).
pub struct Evicted {
    first: u64,
    /// Never read: held so that the caller chooses where it is freed
    /// (always set until dropped).
    old: Option<Arc<ChunkExtents>>,
    charged: u64,
}

impl Drop for Evicted {
    /// Frees the extents, and keeps the chunk's allocation for a load to
    /// reuse if nothing else holds it (see [`spare_chunks`]).
    fn drop(&mut self) {
        if let Some(old) = self.old.take() {
            spare_chunks::give_back(old);
        }
    }
}

pub(crate) use spare_chunks::release as release_spare_chunks;

/// A segment's count of its changed extents (loaded chunks that name no
/// page), kept in its body beside the stamp it was counted at.
///
/// The count stays true while the body is unchanged, but for one event:
/// a base records a page in a chunk through a shared reference
/// ([`ChunkPage::record_written`]),
/// which the live maps see in every segment that shares the chunk (not
/// only the snapshot's). Every such record moves the stamp on, after the
/// page is set, and a count is used only while the stamp it was taken
/// at is still the current one. Other events leave it true: a change
/// goes through [`open_mut`], which
/// forgets the count; loading an absent chunk and evicting a clean one
/// change no chunk's page. Process-wide, since a chunk does not know its
/// volume: a base in one volume has the others count again once.
mod unpaged_count {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Bits of a packed count that hold the extents (a segment holds at
    /// most `SEGMENT_MAX` chunks of at most `CHUNK_MAX` extents, 64k).
    const EXTENT_BITS: u32 = 24;

    /// No count kept (the stamp never reaches it).
    pub(super) const UNCOUNTED: u64 = u64::MAX;

    static RECORDED: AtomicU64 = AtomicU64::new(0);

    /// A page was recorded: counts stamped before are stale. Release:
    /// a count stamped with the new value sees the page.
    pub(super) fn page_recorded() {
        RECORDED.fetch_add(1, Ordering::Release);
    }

    /// The stamp to count at: read before the chunks are.
    pub(super) fn stamp() -> u64 {
        RECORDED.load(Ordering::Acquire) & (u64::MAX >> EXTENT_BITS)
    }

    /// `extents` counted at `stamp`, packed; uncounted if it does not fit.
    pub(super) fn packed(extents: usize, stamp: u64) -> u64 {
        match u64::try_from(extents) {
            Ok(n) if n < 1 << EXTENT_BITS => (stamp << EXTENT_BITS) | n,
            _ => UNCOUNTED,
        }
    }

    /// The extents of a `packed` count, if it was taken at `stamp`.
    pub(super) fn valid(packed: u64, stamp: u64) -> Option<usize> {
        (packed != UNCOUNTED && packed >> EXTENT_BITS == stamp)
            .then_some((packed & ((1 << EXTENT_BITS) - 1)) as usize)
    }
}

/// Allocations of loaded chunks that the evictor freed, kept for loads to
/// reuse. A load runs in a reader's thread and an eviction frees in the
/// evictor's: with glibc, the small allocations readers made among the
/// extents' vectors kept the holes evicted vectors left from being
/// reused, and a 10M-extent session peaked at 82-128 MiB instead of 71-76
/// (a fresh `iomapfs io` reading one block per chunk, 64 MiB budget).
/// Bounded ([`spare_chunks::MAX`], about 450 KiB); shared by every
/// volume of the process.
mod spare_chunks {
    use std::sync::{Arc, OnceLock};

    use parking_lot::Mutex;

    // Named in full: the module graph test reads `super` here as the
    // parent module, which imports this one.
    use crate::extent_map::chunks::ChunkExtents;

    pub(super) const MAX: usize = 4096;

    static SPARE: Mutex<Vec<Arc<ChunkExtents>>> = Mutex::new(Vec::new());

    /// An empty chunk allocation, unshared: a spare one if there is.
    pub(super) fn take() -> Arc<ChunkExtents> {
        SPARE.lock().pop().unwrap_or_else(|| {
            Arc::new(ChunkExtents::with(
                OnceLock::new(),
                OnceLock::new(),
                OnceLock::new(),
            ))
        })
    }

    /// Empties `chunk` (its charge given back, its extents freed) and
    /// keeps it, if nothing else holds it and there is room.
    pub(super) fn give_back(mut chunk: Arc<ChunkExtents>) {
        let Some(empty) = Arc::get_mut(&mut chunk) else {
            return;
        };
        empty.refund();
        empty.extents.take();
        empty.page.take();
        empty.source.take();
        *empty.referenced.get_mut() = false;
        let mut spare = SPARE.lock();
        if spare.len() < MAX {
            spare.push(chunk);
        }
    }

    /// Frees every spare allocation.
    pub(crate) fn release() {
        let spare = std::mem::take(&mut *SPARE.lock());
        drop(spare);
    }
}

impl Evicted {
    /// Bytes the chunk was charged (given back once nothing holds it).
    pub fn charged(&self) -> u64 {
        self.charged
    }
}

impl std::fmt::Debug for Evicted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Evicted {{ first: {} }}", self.first)
    }
}

/// Chunks [`Chunks::evict`] looks at between two asks whether to stop: a
/// few microseconds' work (an eviction drops a chunk of up to 16 KiB of
/// extents, freed after the caller releases its lock).
const CHUNKS_PER_STOP_ASK: usize = 8;

/// Most chunks in one segment: a segment splits past it. A cold segment
/// of this many chunks costs its page references and about a hundred
/// bytes, against a shell per chunk once open. Small in unit tests, so
/// that their few chunks span many segments.
pub(crate) const SEGMENT_MAX: usize = if cfg!(test) { 4 } else { 128 };
/// Fewest chunks in a segment unless it is the only one, or a neighbour
/// is cold: a smaller one is merged with an open neighbour, so the
/// segments stay few however the chunks were removed.
const SEGMENT_MIN: usize = if cfg!(test) { 2 } else { SEGMENT_MAX / 4 };

/// Consecutive chunks of a map, in a shared copy-on-write allocation.
///
/// A segment is *cold* while it is known by its chunks' pages alone
/// ([`ColdPages`]: what mount builds, and what the evictor makes of a
/// segment whose chunks are all absent again): no chunk shell exists
/// until a lookup reaches it and *opens* it, through a shared reference
/// as a chunk is loaded, so that a snapshot sharing the segment sees the
/// chunks too. Opening reads nothing: each chunk starts absent. A change
/// to a segment (through [`open_mut`]) copies its list of chunks if a
/// snapshot shares it, and forgets the cold list, which no longer
/// describes it.
#[derive(Clone, Debug)]
struct Segment {
    /// Its first chunk's first key.
    first: u64,
    body: Arc<SegmentBody>,
}

#[derive(Debug)]
struct SegmentBody {
    /// Unset while the segment is cold.
    chunks: OnceLock<Vec<Chunk>>,
    /// Set while cold; kept once opened until a change (it then still
    /// lists the chunks' pages).
    cold: Option<ColdPages>,
    /// Set when a lookup opened the segment from cold: the loader its
    /// shells were counted to ([`PageLoader::shells_opened`]) and how
    /// many bytes, given back when the body drops. So the budget's room
    /// for chunks shrinks as lookups open segments, and grows again as
    /// the evictor makes them cold.
    charged: OnceLock<(Arc<PageSource>, u64)>,
    /// Its changed extents as last counted ([`unpaged_count`]).
    unpaged: AtomicU64,
}

impl Drop for SegmentBody {
    fn drop(&mut self) {
        if let Some((source, bytes)) = self.charged.get() {
            source.loader.shells_dropped(*bytes);
        }
    }
}

/// The pages of a cold segment's chunks, in key order.
#[derive(Debug)]
struct ColdPages {
    pages: ColdList,
    source: Arc<PageSource>,
    /// No extent of the last page may reach past this key.
    limit: u64,
}

/// A cold segment's page references: part of a run a checkpoint slot's
/// page table holds (what mount builds: one allocation for both), or a
/// list of its own.
#[derive(Clone, Debug)]
enum ColdList {
    Shared { run: PageRun, from: u32, len: u32 },
    Own(Vec<PageRef>),
}

impl Deref for ColdList {
    type Target = [PageRef];

    fn deref(&self) -> &[PageRef] {
        match self {
            ColdList::Shared { run, from, len } => &run[*from as usize..(*from + *len) as usize],
            ColdList::Own(pages) => pages,
        }
    }
}

impl ColdList {
    /// A list of `page`, which is `run[at]` when `at` is given: shared
    /// from a run's start only, so that no two segments share a run (each
    /// counts it once nothing else holds it, [`ColdList::own_bytes`]).
    fn of(page: PageRef, at: Option<(&PageRun, usize)>) -> ColdList {
        match at.filter(|&(_, at)| at == 0) {
            Some((run, at)) => ColdList::Shared {
                run: run.clone(),
                from: at as u32,
                len: 1,
            },
            None => ColdList::Own(vec![page]),
        }
    }

    /// Adds `page`, the next page of the map (`run[at]` when `at` is
    /// given): a shared list grows while the pages are its run's next,
    /// and becomes its own copy otherwise.
    fn push(&mut self, page: PageRef, at: Option<(&PageRun, usize)>) {
        if let ColdList::Shared { run, from, len } = self {
            if at.is_some_and(|(r, at)| Arc::ptr_eq(r, run) && at == (*from + *len) as usize) {
                *len += 1;
                return;
            }
            *self = ColdList::Own(self.to_vec());
        }
        if let ColdList::Own(pages) = self {
            if pages.capacity() == pages.len() {
                pages.reserve_exact(SEGMENT_MAX.saturating_sub(pages.len()).max(1));
            }
            pages.push(page);
        }
    }

    /// Heap bytes it holds that no page table counts: its own list, or a
    /// shared run nothing else holds any more (the tables replaced it at
    /// a base while this segment stayed cold: a base counts the shells
    /// before its replaced table goes, so such a run counts from the
    /// checkpoint thread's next look on).
    fn own_bytes(&self) -> u64 {
        let bytes = match self {
            ColdList::Shared { run, .. } if Arc::strong_count(run) == 1 => run.len(),
            ColdList::Shared { .. } => 0,
            ColdList::Own(pages) => pages.capacity(),
        };
        (bytes * std::mem::size_of::<PageRef>()) as u64
    }

    /// Frees what an own list holds past its pages.
    fn shrink(&mut self) {
        if let ColdList::Own(pages) = self {
            pages.shrink_to_fit();
        }
    }
}

impl ColdPages {
    /// The absent chunk of page `i`.
    fn chunk(&self, i: usize) -> Chunk {
        let limit = self.pages.get(i + 1).map_or(self.limit, |p| p.first_key);
        Chunk::absent(self.pages[i], self.source.clone(), limit)
    }

    /// Where page `i` is read, for a pass that drops what it reads
    /// ([`Chunks::for_each_unkept`]).
    fn probe(&self, i: usize) -> AbsentPage {
        let limit = self.pages.get(i + 1).map_or(self.limit, |p| p.first_key);
        AbsentPage {
            page: self.pages[i],
            source: self.source.clone(),
            limit,
        }
    }
}

/// The index of the last of `items` (sorted by `key_of`) whose key is at
/// most `key`, trying the last item before a binary search.
#[inline]
fn last_index_at_or_before<T>(items: &[T], key: u64, key_of: impl Fn(&T) -> u64) -> Option<usize> {
    match items.last() {
        Some(last) if key_of(last) <= key => Some(items.len() - 1),
        _ => items.partition_point(|i| key_of(i) <= key).checked_sub(1),
    }
}

impl SegmentBody {
    fn with(chunks: OnceLock<Vec<Chunk>>, cold: Option<ColdPages>) -> Self {
        SegmentBody {
            chunks,
            cold,
            charged: OnceLock::new(),
            unpaged: AtomicU64::new(unpaged_count::UNCOUNTED),
        }
    }

    /// Opens a cold segment through a shared reference (a lookup's),
    /// charging its shells to its source's loader.
    fn open_charged(&self) -> Vec<Chunk> {
        let chunks = self.built_chunks();
        if let Some(cold) = &self.cold {
            let bytes = chunks.len() as u64 * CHUNK_SHELL_BYTES;
            if self.charged.set((cold.source.clone(), bytes)).is_ok() {
                cold.source.loader.shells_opened(bytes);
            }
        }
        chunks
    }

    /// The chunks of a cold segment, each absent.
    fn built_chunks(&self) -> Vec<Chunk> {
        match &self.cold {
            Some(cold) => (0..cold.pages.len()).map(|i| cold.chunk(i)).collect(),
            // A segment is built open or cold; never neither.
            None => Vec::new(),
        }
    }
}

impl Segment {
    fn open_with(chunks: Vec<Chunk>) -> Self {
        Segment {
            first: chunks[0].first,
            body: Arc::new(SegmentBody::with(OnceLock::from(chunks), None)),
        }
    }

    fn cold(pages: ColdList, source: Arc<PageSource>, limit: u64) -> Self {
        Segment {
            first: pages[0].first_key,
            body: Arc::new(SegmentBody::with(
                OnceLock::new(),
                Some(ColdPages {
                    pages,
                    source,
                    limit,
                }),
            )),
        }
    }

    fn is_open(&self) -> bool {
        self.body.chunks.get().is_some()
    }

    /// Its chunks, opening a cold segment (no I/O: they start absent).
    #[inline]
    fn chunks(&self) -> &[Chunk] {
        match self.body.chunks.get() {
            Some(chunks) => chunks,
            None => self.open(),
        }
    }

    #[cold]
    fn open(&self) -> &[Chunk] {
        self.body.chunks.get_or_init(|| self.body.open_charged())
    }

    /// Chunks in it, without opening it.
    #[inline]
    fn chunk_count(&self) -> usize {
        match (self.body.chunks.get(), &self.body.cold) {
            (Some(chunks), _) => chunks.len(),
            (None, Some(cold)) => cold.pages.len(),
            (None, None) => 0,
        }
    }

    /// Extents of its chunks that are loaded and name no page (changed
    /// since the last base): counted once per change or recorded page
    /// ([`unpaged_count`]), not at every ask.
    fn unpaged_extents(&self) -> usize {
        // Cold: every chunk absent, so named by its page.
        let Some(chunks) = self.body.chunks.get() else {
            return 0;
        };
        let stamp = unpaged_count::stamp();
        if let Some(counted) =
            unpaged_count::valid(self.body.unpaged.load(Ordering::Relaxed), stamp)
        {
            return counted;
        }
        let extents = chunks
            .iter()
            .filter(|c| c.is_loaded() && c.extents.page().is_none())
            .map(Chunk::count)
            .sum();
        self.body
            .unpaged
            .store(unpaged_count::packed(extents, stamp), Ordering::Relaxed);
        extents
    }

    /// Memory it takes beside the chunks' extents, less the shells a
    /// lookup's opening charged to the loader (see
    /// [`Chunks::shell_bytes`]).
    fn shell_bytes(&self) -> u64 {
        let own = std::mem::size_of::<Segment>()
            + std::mem::size_of::<SegmentBody>()
            + 2 * std::mem::size_of::<usize>();
        let cold = self.body.cold.as_ref().map_or(0, |c| c.pages.own_bytes());
        let open = match (self.body.chunks.get(), self.body.charged.get()) {
            (Some(chunks), None) => chunks.len() as u64 * CHUNK_SHELL_BYTES,
            _ => 0,
        };
        own as u64 + cold + open
    }
}

/// The chunks of segment `body`, to change: copied first if a snapshot
/// shares them, opened if cold. Forgets the cold list and the count of
/// changed extents: the change makes them stale.
fn open_mut(body: &mut Arc<SegmentBody>) -> &mut Vec<Chunk> {
    let body = open_keeping_pages(body);
    body.cold = None;
    *body.unpaged.get_mut() = unpaged_count::UNCOUNTED;
    body.chunks.get_mut().expect("opened")
}

/// The body of a segment, unshared and open, its cold list kept if it
/// has one and was not shared (a copy has none): for a change that
/// leaves every chunk's page as it was (the evictor's, which makes
/// loaded chunks absent again), so that the segment can go cold on the
/// same list without a new allocation.
fn open_keeping_pages(body: &mut Arc<SegmentBody>) -> &mut SegmentBody {
    if Arc::get_mut(body).is_none() {
        // A snapshot shares it: a copy of its chunks, without opening the
        // shared one.
        let chunks = match body.chunks.get() {
            Some(chunks) => chunks.clone(),
            None => body.built_chunks(),
        };
        *body = Arc::new(SegmentBody::with(OnceLock::from(chunks), None));
    }
    let body = Arc::get_mut(body).expect("unshared above");
    if body.chunks.get().is_none() {
        let chunks = body.built_chunks();
        let _ = body.chunks.set(chunks);
    }
    body
}

/// Where one extent is: segment, chunk in it, index in the chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pos {
    seg: usize,
    chunk: usize,
    idx: usize,
}

/// Extents with distinct file offsets, sorted by them: non-empty chunks
/// in order, grouped in non-empty segments.
#[derive(Clone, Debug, Default)]
pub(super) struct Chunks {
    segments: Arc<Vec<Segment>>,
    len: usize,
    /// Chunks in all segments, kept as they change: every record's
    /// change asks for it twice (`state::MapSize`), and a sum over the
    /// segments made building a 2M-extent file a third slower.
    chunks: usize,
}

impl PartialEq for Chunks {
    /// Same extents, however they are chunked.
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for Chunks {}

impl Chunks {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn chunk_count(&self) -> usize {
        self.chunks
    }

    pub(super) fn is_shared(&self) -> bool {
        Arc::strong_count(&self.segments) > 1
    }

    /// Every chunk in order, opening every segment.
    fn all_chunks(&self) -> impl Iterator<Item = &Chunk> + '_ {
        self.segments.iter().flat_map(|s| s.chunks().iter())
    }

    /// Memory the map takes beside its loaded chunks' extents: a shell
    /// per chunk of an open segment ([`CHUNK_SHELL_BYTES`]), a page
    /// reference per chunk of a cold one with a list of its own (a run it
    /// shares with a slot's table counts there, or here once no table
    /// holds it: [`ColdList::own_bytes`]), and each segment's own; not the
    /// shells of segments a lookup opened from cold, which are charged
    /// to the loader as loaded extents are (see `SegmentBody::charged`).
    pub(super) fn shell_bytes(&self) -> u64 {
        self.segments.iter().map(Segment::shell_bytes).sum()
    }

    pub(super) fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Segments whose chunks have shells.
    pub(super) fn open_segments(&self) -> usize {
        self.segments.iter().filter(|s| s.is_open()).count()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Extent> + '_ {
        self.all_chunks().flat_map(|c| c.extents.iter())
    }

    /// The extents from `pos` on.
    pub(super) fn iter_from(&self, pos: Pos) -> impl Iterator<Item = &Extent> + '_ {
        let (head, rest, later): (&[Extent], &[Chunk], &[Segment]) =
            match self.segments.get(pos.seg) {
                Some(s) => {
                    let chunks = s.chunks();
                    (
                        &chunks[pos.chunk].extents[pos.idx..],
                        &chunks[pos.chunk + 1..],
                        &self.segments[pos.seg + 1..],
                    )
                }
                None => (&[], &[], &[]),
            };
        head.iter()
            .chain(rest.iter().flat_map(|c| c.extents.iter()))
            .chain(
                later
                    .iter()
                    .flat_map(|s| s.chunks().iter())
                    .flat_map(|c| c.extents.iter()),
            )
    }

    #[inline]
    fn chunk(&self, pos: Pos) -> &Chunk {
        &self.segments[pos.seg].chunks()[pos.chunk]
    }

    #[inline]
    pub(super) fn get(&self, pos: Pos) -> &Extent {
        &self.chunk(pos).extents[pos.idx]
    }

    /// The file offset of the extent at `pos`, without loading its chunk
    /// when it is the chunk's first (a hole's end is the next chunk's
    /// first key).
    #[inline]
    pub(super) fn key(&self, pos: Pos) -> u64 {
        match (pos.chunk, pos.idx) {
            // Without opening a cold segment.
            (0, 0) => self.segments[pos.seg].first,
            (_, 0) => self.chunk(pos).first,
            _ => self.get(pos).file_off,
        }
    }

    /// The chunk owning `key`: the last whose first key is at most `key`,
    /// or the first (a chunk owns the keys from its first up to the next
    /// chunk's). `None` if there are no chunks.
    #[inline]
    fn owner(&self, key: u64) -> Option<Pos> {
        let seg = last_index_at_or_before(&self.segments, key, |s| s.first)
            .or((!self.segments.is_empty()).then_some(0))?;
        let chunk =
            last_index_at_or_before(self.segments[seg].chunks(), key, |c| c.first).unwrap_or(0);
        Some(Pos { seg, chunk, idx: 0 })
    }

    /// The chunk after the one at `pos`.
    #[inline]
    fn next_chunk(&self, pos: Pos) -> Option<Pos> {
        if pos.chunk + 1 < self.segments[pos.seg].chunk_count() {
            Some(Pos {
                chunk: pos.chunk + 1,
                idx: 0,
                ..pos
            })
        } else {
            (pos.seg + 1 < self.segments.len()).then_some(Pos {
                seg: pos.seg + 1,
                chunk: 0,
                idx: 0,
            })
        }
    }

    /// Loads the absent chunks from the one owning `from` through the one
    /// owning `to` (with room for an insert when `to_change`), and
    /// `after` chunks past that; returns how many it read.
    pub(super) fn load_owners(
        &self,
        from: u64,
        to: u64,
        after: usize,
        to_change: bool,
    ) -> Result<usize> {
        let (Some(mut at), Some(last)) = (self.owner(from), self.owner(to)) else {
            return Ok(0);
        };
        let mut loaded = 0;
        let mut extra = 0;
        loop {
            let c = self.chunk(at);
            let past_last = (at.seg, at.chunk) > (last.seg, last.chunk);
            if !c.is_loaded() {
                c.extents.load(to_change && !past_last)?;
                loaded += 1;
            }
            if (at.seg, at.chunk) >= (last.seg, last.chunk) {
                extra += 1;
                if extra > after {
                    break;
                }
            }
            match self.next_chunk(at) {
                Some(next) => at = next,
                None => break,
            }
        }
        Ok(loaded)
    }

    /// Loads every absent chunk; returns how many it read.
    pub(super) fn load_all(&self) -> Result<usize> {
        let mut loaded = 0;
        for c in self.all_chunks() {
            if !c.is_loaded() {
                c.extents.load(false)?;
                loaded += 1;
            }
        }
        Ok(loaded)
    }

    /// A copy that shares no cold segment with `self`: each gets a body
    /// of its own (its list of pages copied), so that what lookups in one
    /// open and load stays out of the other. For a long pass over a
    /// snapshot (the free-space scan after mount): sharing, it would keep
    /// every chunk the live map loads and then evicts until the pass
    /// ends. Open segments are shared as a clone shares them: at mount
    /// they hold the chunks replayed deltas changed, already loaded, so
    /// a live load that the snapshot then keeps can only come from an
    /// absent chunk beside them (a copy would cost their whole entry
    /// vector for that case).
    pub(super) fn detached(&self) -> Chunks {
        let segments = self
            .segments
            .iter()
            .map(|s| match (s.body.chunks.get(), &s.body.cold) {
                (None, Some(cold)) => {
                    Segment::cold(cold.pages.clone(), cold.source.clone(), cold.limit)
                }
                _ => s.clone(),
            })
            .collect();
        Chunks {
            segments: Arc::new(segments),
            len: self.len,
            chunks: self.chunks,
        }
    }

    /// Extents of the chunks that are loaded and name no page: changed
    /// since the last base, in memory only. Counted per segment and kept
    /// until the segment changes or a base records a page, so a count
    /// between two bases walks the segments changed since the last one,
    /// not every chunk (at 50M extents the checkpoint thread counted
    /// every 1 MiB of changes, 1-2 ms over 195k chunks each time).
    pub(super) fn unpaged_extents(&self) -> usize {
        self.segments.iter().map(Segment::unpaged_extents).sum()
    }

    /// Chunks whose extents are in memory.
    pub(super) fn loaded_chunks(&self) -> usize {
        self.segments
            .iter()
            .filter_map(|s| s.body.chunks.get())
            .flatten()
            .filter(|c| c.is_loaded())
            .count()
    }

    /// The first chunk whose first key is at least `key` (looked for in
    /// the segment that holds `key`), as a segment and an index there;
    /// `(segments, 0)` past the last chunk. By halves over segments, then over the
    /// segment's chunks (or a cold one's pages): a position by chunk
    /// number took a walk over every segment, which the evictor's sweep
    /// did per 8 chunks looked at (at 50M extents its sweeps before a base
    /// took 100-150 ms, while writers waited for that base).
    fn position_of_key(&self, key: u64) -> (usize, usize) {
        let s = self
            .segments
            .partition_point(|seg| seg.first <= key)
            .saturating_sub(1);
        let Some(seg) = self.segments.get(s) else {
            return (self.segments.len(), 0);
        };
        let c = match (seg.body.chunks.get(), &seg.body.cold) {
            (Some(chunks), _) => chunks.partition_point(|c| c.first < key),
            (None, Some(cold)) => cold.pages.partition_point(|p| p.first_key < key),
            (None, None) => 0,
        };
        if c < seg.chunk_count() {
            (s, c)
        } else {
            (s + 1, 0)
        }
    }

    /// The first key of chunk `c` of segment `s`, without opening it.
    fn first_key_at(&self, s: usize, c: usize) -> Option<u64> {
        let seg = self.segments.get(s)?;
        match (seg.body.chunks.get(), &seg.body.cold) {
            (Some(chunks), _) => chunks.get(c).map(|ch| ch.first),
            (None, Some(cold)) => cold.pages.get(c).map(|p| p.first_key),
            (None, None) => None,
        }
    }

    /// One step of the evictor's clock over the chunks from the first
    /// whose first key is at least `from` (at most `max` of them): a
    /// clean chunk (extents in
    /// memory, page named) whose clock bit is set has it cleared and is
    /// passed over; one whose bit is clear is replaced with an absent
    /// chunk sharing its page, read again from its own source or else
    /// `source` when next needed. Stops early once `stop` says so, asked
    /// with the bytes charged so far after each eviction, after every
    /// [`CHUNKS_PER_STOP_ASK`] chunks looked at and after each cold
    /// segment passed over (so a caller bounds a step by time in one
    /// call: the search for `from` and the caller's own work per call,
    /// paid per 8 chunks, were most of the sweep before a base at 50M
    /// extents, which writers waited for). A changed
    /// chunk (no page) is never evicted: only memory holds its extents;
    /// nor is one for whose key range `[first, limit)` `keep` answers
    /// true. A segment the step leaves with every chunk absent becomes
    /// cold again, its shells dropped. Returns where to go on from (the
    /// next chunk's first key, `None` past the last chunk), how many
    /// chunks it looked at, and the chunks replaced with what they were
    /// charged, in the order replaced.
    pub(super) fn evict(
        &mut self,
        from: u64,
        max: usize,
        source: &Arc<PageSource>,
        keep: impl Fn(u64, u64) -> bool,
        mut stop: impl FnMut(u64) -> bool,
    ) -> (Option<u64>, usize, Vec<Evicted>) {
        let mut evicted = Vec::new();
        let mut freed = 0;
        let (mut s, mut c) = self.position_of_key(from);
        let mut at = 0usize;
        let end = max;
        let mut stopped = false;
        while s < self.segments.len() && at < end && !stopped {
            let n = self.segments[s].chunk_count();
            if !self.segments[s].is_open() {
                // Cold: every chunk absent already.
                at += n - c;
                (s, c) = (s + 1, 0);
                stopped = stop(freed);
                continue;
            }
            while c < n && at < end {
                if at > 0 && at.is_multiple_of(CHUNKS_PER_STOP_ASK) && stop(freed) {
                    stopped = true;
                    break;
                }
                let i = c;
                (c, at) = (c + 1, at + 1);
                let chunks = self.segments[s].chunks();
                let ch = &chunks[i];
                let Some(loaded) = ch.extents.get() else {
                    continue;
                };
                let Some(page) = loaded.page.get().copied() else {
                    continue;
                };
                if loaded.referenced.load(Ordering::Relaxed) {
                    loaded.referenced.store(false, Ordering::Relaxed);
                    continue;
                }
                let src = loaded
                    .source
                    .get()
                    .map_or_else(|| source.clone(), Arc::clone);
                let limit = match chunks.get(i + 1) {
                    Some(next) => next.first,
                    None => self.segments.get(s + 1).map_or(u64::MAX, |n| n.first),
                };
                if keep(ch.first, limit) {
                    continue;
                }
                let bytes = u64::from(loaded.charged.load(Ordering::Relaxed));
                let absent = Chunk::absent(page, src, limit);
                let seg = &mut Arc::make_mut(&mut self.segments)[s];
                let body = open_keeping_pages(&mut seg.body);
                let chunks = body.chunks.get_mut().expect("opened");
                let mut old = std::mem::replace(&mut chunks[i], absent);
                if let Some(old_extents) = old.extents.take_loaded() {
                    evicted.push(Evicted {
                        first: old.first,
                        old: Some(old_extents),
                        charged: bytes,
                    });
                }
                freed += bytes;
                if stop(freed) {
                    stopped = true;
                    break;
                }
            }
            if c >= n {
                self.make_cold_if_absent(s, source);
                (s, c) = (s + 1, 0);
            }
        }
        (self.first_key_at(s, c), at, evicted)
    }

    /// Makes segment `s` cold if every chunk of it is absent (its shells
    /// are then dropped; a snapshot sharing them keeps its own).
    fn make_cold_if_absent(&mut self, s: usize, source: &Arc<PageSource>) {
        let Some(chunks) = self.segments[s].body.chunks.get() else {
            return;
        };
        if chunks.is_empty()
            || !chunks
                .iter()
                .all(|ch| !ch.is_loaded() && ch.extents.page().is_some())
        {
            return;
        }
        let limit = self.segments.get(s + 1).map_or(u64::MAX, |n| n.first);
        let seg = &mut Arc::make_mut(&mut self.segments)[s];
        // Its own cold list when it still has it: cold again without an
        // allocation (one made now would land among the chunks' vectors
        // and keep the holes they leave from being reused).
        if let Some(body) = Arc::get_mut(&mut seg.body).filter(|b| b.cold.is_some()) {
            body.chunks.take();
            if let Some((source, bytes)) = body.charged.take() {
                source.loader.shells_dropped(bytes);
            }
            return;
        }
        let pages = chunks_of(seg)
            .iter()
            .filter_map(|ch| ch.extents.page())
            .collect();
        *seg = Segment::cold(ColdList::Own(pages), source.clone(), limit);
    }

    /// Passes every extent to `f` in order from the chunk that owns key
    /// `from` (so the first few may end before it), reading the page of
    /// each absent chunk into a buffer that is dropped after: the chunk
    /// stays absent (a cold segment stays cold), so a pass over every
    /// extent keeps none of them. Stops (`Ok(false)`) when `f` returns
    /// `false`, and at a page that fails to load (its error).
    pub(super) fn for_each_unkept(
        &self,
        from: u64,
        mut f: impl FnMut(&Extent) -> bool,
    ) -> Result<bool> {
        let start = last_index_at_or_before(&self.segments, from, |s| s.first).unwrap_or(0);
        for (s, seg) in self.segments.iter().enumerate().skip(start) {
            // In the first segment, the walk starts at the chunk owning
            // `from`.
            let from_in = |i: Option<usize>| if s == start { i.unwrap_or(0) } else { 0 };
            let more = match (seg.body.chunks.get(), &seg.body.cold) {
                (Some(chunks), _) => {
                    let mut more = true;
                    let skip = from_in(last_index_at_or_before(chunks, from, |c| c.first));
                    for c in &chunks[skip..] {
                        more = match (c.extents.get(), &c.extents.absent) {
                            (Some(v), _) => v.iter().all(&mut f),
                            (None, Some(absent)) => {
                                absent.read(LoadPurpose::Scan)?.iter().all(&mut f)
                            }
                            (None, None) => true,
                        };
                        if !more {
                            break;
                        }
                    }
                    more
                }
                (None, Some(cold)) => {
                    let mut more = true;
                    let skip = from_in(last_index_at_or_before(&cold.pages, from, |p| p.first_key));
                    for i in skip..cold.pages.len() {
                        more = cold.probe(i).read(LoadPurpose::Scan)?.iter().all(&mut f);
                        if !more {
                            break;
                        }
                    }
                    more
                }
                (None, None) => true,
            };
            if !more {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The chunks of segment `s`, to change (see [`open_mut`]).
    fn segment_mut(&mut self, s: usize) -> &mut Vec<Chunk> {
        open_mut(&mut Arc::make_mut(&mut self.segments)[s].body)
    }

    /// The extent at `pos`, to change in place (its chunk copied first if
    /// a snapshot shares it). The caller must keep its file offset.
    pub(super) fn get_mut(&mut self, pos: Pos) -> &mut Extent {
        let chunk = &mut self.segment_mut(pos.seg)[pos.chunk];
        &mut chunk.extents.make_mut()[pos.idx]
    }

    /// The last extent whose file offset is at most `key`.
    #[inline]
    pub(super) fn last_at_or_before(&self, key: u64) -> Option<Pos> {
        self.descend(key).map(|(pos, _)| pos)
    }

    /// [`Chunks::last_at_or_before`] and that extent, its chunk marked in
    /// use for the evictor's clock: a lookup's one descent through
    /// segment, chunk and extents, not one for each.
    #[inline]
    pub(super) fn touch_last_at_or_before(&self, key: u64) -> Option<(Pos, &Extent)> {
        let (pos, extents) = self.descend(key)?;
        extents.touch();
        Some((pos, &extents[pos.idx]))
    }

    /// Each level is asked first whether `key` is at or past its last
    /// entry: an append (a log, a WAL, a file being built) looks up the
    /// file's end each time, and takes the last of each level without a
    /// binary search.
    #[inline]
    fn descend(&self, key: u64) -> Option<(Pos, &ChunkExtents)> {
        let seg = last_index_at_or_before(&self.segments, key, |s| s.first)?;
        let chunks = self.segments[seg].chunks();
        let chunk = last_index_at_or_before(chunks, key, |c| c.first)
            .expect("a segment's first key is its first chunk's");
        let extents: &ChunkExtents = &chunks[chunk].extents;
        let idx = last_index_at_or_before(extents, key, |e| e.file_off)
            .expect("a chunk's first key is its first extent's");
        Some((Pos { seg, chunk, idx }, extents))
    }

    /// The last extent whose file offset is below `key`.
    #[inline]
    pub(super) fn last_before(&self, key: u64) -> Option<Pos> {
        self.last_at_or_before(key.checked_sub(1)?)
    }

    /// The first extent whose file offset is above `key`.
    pub(super) fn first_after(&self, key: u64) -> Option<Pos> {
        match self.last_at_or_before(key) {
            Some(pos) => self.next(pos),
            None => self.first(),
        }
    }

    /// The first extent whose file offset is at least `key`.
    pub(super) fn first_at_or_after(&self, key: u64) -> Option<Pos> {
        match self.last_before(key) {
            Some(pos) => self.next(pos),
            None => self.first(),
        }
    }

    /// The extent stored under exactly `key`.
    #[inline]
    pub(super) fn find(&self, key: u64) -> Option<Pos> {
        // The descent's own chunk, not a second walk to it.
        let (pos, extents) = self.descend(key)?;
        (extents[pos.idx].file_off == key).then_some(pos)
    }

    fn first(&self) -> Option<Pos> {
        (!self.segments.is_empty()).then_some(Pos {
            seg: 0,
            chunk: 0,
            idx: 0,
        })
    }

    #[inline]
    pub(super) fn next(&self, pos: Pos) -> Option<Pos> {
        if pos.idx + 1 < self.chunk(pos).extents.len() {
            Some(Pos {
                idx: pos.idx + 1,
                ..pos
            })
        } else {
            self.next_chunk(pos)
        }
    }

    /// Adds `e` after the extents with smaller offsets. No extent may be
    /// stored under its offset yet.
    pub(super) fn insert(&mut self, e: Extent) {
        debug_assert!(self.find(e.file_off).is_none(), "{e:?} already stored");
        self.len += 1;
        let Some(at) = self.owner(e.file_off) else {
            Arc::make_mut(&mut self.segments).push(Segment::open_with(vec![Chunk::new(vec![e])]));
            self.chunks += 1;
            return;
        };
        let extents = self.segment_mut(at.seg)[at.chunk].extents.make_mut();
        // After the last: an append.
        let idx = match extents.last() {
            Some(last) if last.file_off < e.file_off => extents.len(),
            _ => extents.partition_point(|x| x.file_off < e.file_off),
        };
        grow_for_one_more(extents);
        extents.insert(idx, e);
        self.rebalance(at.seg, at.chunk);
    }

    /// Appends a chunk after every stored one, into the last segment if it
    /// is open and has room.
    fn push_chunk_entry(&mut self, chunk: Chunk) {
        self.chunks += 1;
        let segments = Arc::make_mut(&mut self.segments);
        match segments.last_mut() {
            Some(last) if last.is_open() && last.chunk_count() < SEGMENT_MAX => {
                open_mut(&mut last.body).push(chunk)
            }
            _ => segments.push(Segment::open_with(vec![chunk])),
        }
    }

    /// Appends `e`, whose offset must be above every stored one: how a map
    /// read from disk is built, filling chunks to [`CHUNK_MAX`].
    pub(super) fn push(&mut self, e: Extent) {
        debug_assert!(self
            .segments
            .last()
            .and_then(|s| s.chunks().last())
            .and_then(|c| c.extents.last())
            .is_none_or(|l| l.file_off < e.file_off));
        self.len += 1;
        if let Some(last) = Arc::make_mut(&mut self.segments)
            .last_mut()
            .filter(|s| s.is_open())
        {
            if let Some(c) = open_mut(&mut last.body)
                .last_mut()
                .filter(|c| c.extents.len() < CHUNK_MAX)
            {
                c.extents.make_mut().push(e);
                return;
            }
        }
        self.push_chunk_entry(Chunk::new(vec![e]));
    }

    /// Appends a chunk of `extents`, held by `page` if given, after every
    /// stored extent: how a map read from extent pages is built, one chunk
    /// per page. `extents` must be non-empty, at most [`CHUNK_MAX`], sorted
    /// and above every stored offset (the caller checks).
    pub(super) fn push_chunk(&mut self, extents: Vec<Extent>, page: Option<PageRef>) {
        debug_assert!(!extents.is_empty() && extents.len() <= CHUNK_MAX);
        let chunk = Chunk::new(extents);
        if let Some(page) = page {
            let _ = chunk.extents.page.set(page);
        }
        self.len += chunk.extents.len();
        self.push_chunk_entry(chunk);
    }

    /// Appends an absent chunk held by `page`, read from `source` when
    /// first needed, whose extents end by `limit` (the next page's first
    /// key, or `u64::MAX`): how mount builds a paged file's map without
    /// reading its pages, in cold segments; a new one if `new_segment`.
    /// `page` must be above every stored offset and hold 1..=[`CHUNK_MAX`]
    /// extents (the caller checks).
    pub(super) fn push_absent(
        &mut self,
        page: PageRef,
        source: Arc<PageSource>,
        limit: u64,
        new_segment: bool,
        at: Option<(&PageRun, usize)>,
    ) {
        debug_assert!(page.count >= 1 && page.count as usize <= CHUNK_MAX);
        debug_assert!(at.is_none_or(|(run, at)| run.get(at) == Some(&page)));
        self.len += page.count as usize;
        self.chunks += 1;
        let segments = Arc::make_mut(&mut self.segments);
        if let Some(cold) = segments
            .last_mut()
            .filter(|_| !new_segment)
            .and_then(|s| Arc::get_mut(&mut s.body))
            .filter(|b| b.chunks.get().is_none())
            .and_then(|b| b.cold.as_mut())
            .filter(|c| c.pages.len() < SEGMENT_MAX && Arc::ptr_eq(&c.source, &source))
        {
            cold.pages.push(page, at);
            cold.limit = limit;
            return;
        }
        if let Some(cold) = segments
            .last_mut()
            .and_then(|s| Arc::get_mut(&mut s.body))
            .and_then(|b| b.cold.as_mut())
        {
            cold.pages.shrink();
        }
        segments.push(Segment::cold(ColdList::of(page, at), source, limit));
    }

    /// The chunks in order, with their pages; a cold segment's are known
    /// without opening it.
    pub(super) fn pages(&self) -> impl Iterator<Item = ChunkPage<'_>> + '_ {
        self.segments.iter().flat_map(|segment| {
            let (open, cold): (&[Chunk], &[PageRef]) =
                match (segment.body.chunks.get(), &segment.body.cold) {
                    (Some(chunks), _) => (chunks, &[]),
                    (None, Some(cold)) => (&[], &cold.pages),
                    (None, None) => (&[], &[]),
                };
            open.iter()
                .enumerate()
                .map(|(index, c)| ChunkPage {
                    at: PageAt::Open(&c.extents),
                    starts_segment: index == 0,
                })
                .chain(cold.iter().enumerate().map(move |(index, page)| ChunkPage {
                    at: PageAt::Cold {
                        segment,
                        index,
                        page,
                    },
                    starts_segment: index == 0,
                }))
        })
    }

    /// The chunks numbered `indices` (strictly rising, as [`Chunks::pages`]
    /// numbers them), with their pages: whole segments before each are
    /// passed over by their count, so finding a base's few new pages
    /// does not walk every chunk. Stops at the first index past the last
    /// chunk (or, in release builds, one that does not rise).
    pub(super) fn pages_at<'a>(
        &'a self,
        indices: &'a [usize],
    ) -> impl Iterator<Item = (usize, ChunkPage<'a>)> + 'a {
        let mut segments = self.segments.iter();
        let mut segment: Option<&Segment> = None;
        // Chunks in the segments before `segment`.
        let mut before = 0usize;
        let mut last = None;
        indices.iter().map_while(move |&i| {
            debug_assert!(last < Some(i), "chunk numbers must rise: {last:?} then {i}");
            last = Some(i);
            loop {
                if let Some(seg) = segment.filter(|seg| i < before + seg.chunk_count()) {
                    let index = i.checked_sub(before)?;
                    let at = match (seg.body.chunks.get(), &seg.body.cold) {
                        (Some(chunks), _) => PageAt::Open(&chunks[index].extents),
                        (None, Some(cold)) => PageAt::Cold {
                            segment: seg,
                            index,
                            page: &cold.pages[index],
                        },
                        (None, None) => return None,
                    };
                    return Some((
                        i,
                        ChunkPage {
                            at,
                            starts_segment: index == 0,
                        },
                    ));
                }
                before += segment.map_or(0, Segment::chunk_count);
                segment = Some(segments.next()?);
            }
        })
    }

    /// Removes the extent at `pos` and returns it.
    pub(super) fn remove(&mut self, pos: Pos) -> Extent {
        let chunk = &mut self.segment_mut(pos.seg)[pos.chunk];
        let e = chunk.extents.make_mut().remove(pos.idx);
        self.len -= 1;
        self.rebalance(pos.seg, pos.chunk);
        e
    }

    /// Removes every extent whose offset is in `[off, end)`, passing each to
    /// `removed` in order. Chunks wholly inside are dropped, not copied.
    pub(super) fn remove_span(&mut self, off: u64, end: u64, mut removed: impl FnMut(Extent)) {
        let Some(start) = self
            .first_at_or_after(off)
            .filter(|&p| self.get(p).file_off < end)
        else {
            return;
        };
        let (mut s, mut c, mut from) = (start.seg, start.chunk, start.idx);
        // At most two chunks are cut rather than dropped: the first and the
        // last touched. Each is known by a key it keeps: rebalancing one
        // may merge segments and move the other.
        let mut cut = Vec::new();
        loop {
            // A segment past the span is left as it is (cold stays cold).
            if s > start.seg && self.segments[s].first >= end {
                break;
            }
            let chunks = open_mut(&mut Arc::make_mut(&mut self.segments)[s].body);
            let mut ends_here = false;
            while c < chunks.len() {
                let n = chunks[c].extents.len();
                let to = chunks[c].extents.partition_point(|e| e.file_off < end);
                for e in &chunks[c].extents[from..to] {
                    removed(*e);
                }
                self.len -= to - from;
                if from == 0 && to == n {
                    chunks.remove(c);
                    self.chunks -= 1;
                    from = 0;
                    continue;
                }
                if to > from {
                    chunks[c].extents.make_mut().remove_range(from, to);
                    cut.push(chunks[c].extents[0].file_off);
                }
                if to < n {
                    ends_here = true;
                    break; // This chunk goes on past the span.
                }
                c += 1;
                from = 0;
            }
            let segments = Arc::make_mut(&mut self.segments);
            if chunks_of(&segments[s]).is_empty() {
                segments.remove(s);
            } else {
                segments[s].first = chunks_of(&segments[s])[0].first;
                s += 1;
            }
            (c, from) = (0, 0);
            if ends_here || s >= self.segments.len() {
                break;
            }
        }
        for &key in cut.iter().rev() {
            if let Some(at) = self.owner(key) {
                self.rebalance(at.seg, at.chunk);
            }
        }
    }

    /// Appends to `out` the extents stored under keys in `spans` (sorted,
    /// disjoint). One pass: the cursor (chunk and index in it) only moves
    /// forward, and each search gallops from it instead of bisecting the
    /// chunk. A checkpoint after scattered small changes asks for thousands
    /// of spans a few extents long and a few hundred apart: bisecting a
    /// chunk per span end is a chain of dependent cache misses (7 of the
    /// 9 ms of such a checkpoint at a million extents), while a forward
    /// gallop touches lines near the cursor, whose loads do not wait on
    /// each other.
    pub(super) fn extents_in_spans(&self, spans: &[(u64, u64)], out: &mut Vec<Extent>) {
        let segments = &self.segments[..];
        let (mut s, mut at, mut from) = (0, 0, 0);
        for &(start, end) in spans {
            // Past whole segments first: a cold one is not opened.
            while s + 1 < segments.len() && segments[s + 1].first <= start {
                (s, at, from) = (s + 1, 0, 0);
            }
            let Some(segment) = segments.get(s) else {
                return;
            };
            let chunks = segment.chunks();
            while at + 1 < chunks.len() && chunks[at + 1].first <= start {
                (at, from) = (at + 1, 0);
            }
            from = first_key_at_or_after(&chunks[at].extents, from, start);
            let mut pos = Pos {
                seg: s,
                chunk: at,
                idx: from,
            };
            loop {
                let chunk = self.chunk(pos);
                let to = first_key_at_or_after(&chunk.extents, pos.idx, end);
                out.extend_from_slice(&chunk.extents[pos.idx..to]);
                if to < chunk.extents.len() {
                    (s, at, from) = (pos.seg, pos.chunk, to);
                    break;
                }
                // A chunk past the span is not read (its first key says
                // so): the evictor may have left it absent (`keep`), and a
                // segment past it cold.
                let next = self.next_chunk(pos).filter(|n| {
                    if n.seg != pos.seg {
                        segments[n.seg].first < end
                    } else {
                        self.chunk(*n).first < end
                    }
                });
                match next {
                    Some(n) => pos = n,
                    None => {
                        (s, at, from) = (pos.seg, pos.chunk, to);
                        break;
                    }
                }
            }
        }
    }

    /// Checks the chunking itself: no empty or oversized chunk or segment,
    /// first offsets right, offsets strictly increasing, length right, a
    /// cold list that still lists its open segment's pages.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut count = 0;
        let mut prev: Option<u64> = None;
        for (s, seg) in self.segments.iter().enumerate() {
            let n = seg.chunk_count();
            if n == 0 {
                return Err(format!("extent segment #{s} is empty"));
            }
            match (seg.body.chunks.get(), &seg.body.cold) {
                (None, Some(cold)) => {
                    if seg.first != cold.pages[0].first_key {
                        return Err(format!(
                            "cold extent segment #{s} is filed under the wrong key"
                        ));
                    }
                    for (i, page) in cold.pages.iter().enumerate() {
                        if page.count == 0 || page.count as usize > CHUNK_MAX {
                            return Err(format!(
                                "cold extent segment #{s}, page #{i}: {} extents",
                                page.count
                            ));
                        }
                        if prev.is_some_and(|p| p >= page.first_key) {
                            return Err(format!(
                                "cold extent segment #{s}, page #{i} is out of order"
                            ));
                        }
                        prev = Some(page.first_key);
                        count += page.count as usize;
                    }
                    continue;
                }
                (Some(chunks), cold) => {
                    if seg.first != chunks[0].first {
                        return Err(format!(
                            "extent segment #{s} is filed under offset {} but starts at {}",
                            seg.first, chunks[0].first
                        ));
                    }
                    if let Some(cold) = cold {
                        let listed = chunks.iter().map(|c| c.extents.page());
                        if !listed.eq(cold.pages.iter().map(|p| Some(*p))) {
                            return Err(format!("extent segment #{s} changed under its cold list"));
                        }
                    }
                }
                (None, None) => return Err(format!("extent segment #{s} has no chunks")),
            }
            for (i, c) in seg.chunks().iter().enumerate() {
                let n = c.count();
                if !c.is_loaded() {
                    // Checked when loaded; only what is known without it here.
                    if c.extents.page().map(|p| p.first_key) != Some(c.first) || n == 0 {
                        return Err(format!(
                            "absent extent chunk #{i} of segment #{s} does not match its page"
                        ));
                    }
                    if prev.is_some_and(|p| p >= c.first) {
                        return Err(format!(
                            "absent extent chunk #{i} of segment #{s} is out of order"
                        ));
                    }
                    prev = Some(c.first);
                    count += n;
                    continue;
                }
                if n == 0 || n > CHUNK_MAX {
                    return Err(format!(
                        "extent chunk #{i} of segment #{s} holds {n} extents"
                    ));
                }
                if c.first != c.extents[0].file_off {
                    return Err(format!(
                        "extent chunk #{i} of segment #{s} is filed under offset {} but starts at {}",
                        c.first, c.extents[0].file_off
                    ));
                }
                for e in c.extents.iter() {
                    if prev.is_some_and(|p| p >= e.file_off) {
                        return Err(format!(
                            "extent chunk #{i} of segment #{s}: offset {} does not follow {}",
                            e.file_off,
                            prev.unwrap_or(0)
                        ));
                    }
                    prev = Some(e.file_off);
                }
                count += n;
            }
        }
        if count != self.len {
            return Err(format!(
                "extent chunks hold {count} extents, counted {}",
                self.len
            ));
        }
        let chunks: usize = self.segments.iter().map(Segment::chunk_count).sum();
        if chunks != self.chunks {
            return Err(format!(
                "extent segments hold {chunks} chunks, counted {}",
                self.chunks
            ));
        }
        Ok(())
    }

    /// Restores the chunk and segment rules around chunk `at` of segment
    /// `s` after a change to that chunk: drops it if empty, refreshes the
    /// first offsets, splits it if too big, merges it with a neighbour if
    /// too small (across segments when it is alone in its own), and then
    /// the same for its segment.
    fn rebalance(&mut self, s: usize, at: usize) {
        let chunks = self.segment_mut(s);
        let alone = chunks.len() == 1;
        let n = chunks[at].extents.len();
        // First, whatever follows: a merge across segments may not happen
        // (its neighbour cold or absent), and the segment takes its first
        // key from this chunk.
        if n > 0 {
            chunks[at].first = chunks[at].extents[0].file_off;
        }
        if alone && n > 0 && n < CHUNK_MIN && self.segments.len() > 1 {
            self.merge_across(s);
            return;
        }
        let change = rebalance_chunks(self.segment_mut(s), at);
        self.chunks = self.chunks.wrapping_add_signed(change);
        self.fix_segment(s);
    }

    /// Merges the only chunk of segment `s`, too small, into the nearest
    /// chunk of a neighbouring segment if both are loaded (merging would
    /// otherwise read a page), dropping segment `s`.
    fn merge_across(&mut self, s: usize) {
        let right = s + 1 < self.segments.len();
        let (n, neighbour) = if right {
            (s + 1, 0)
        } else {
            (s - 1, usize::MAX)
        };
        let near = match self.segments[n].body.chunks.get() {
            Some(chunks) => {
                let i = neighbour.min(chunks.len() - 1);
                chunks[i].is_loaded().then_some(i)
            }
            None => None,
        };
        let mine_loaded = self.segments[s]
            .body
            .chunks
            .get()
            .is_some_and(|c| c[0].is_loaded());
        let (Some(i), true) = (near, mine_loaded) else {
            self.fix_segment(s);
            return;
        };
        let mine = self.segment_mut(s).remove(0);
        self.chunks -= 1;
        Arc::make_mut(&mut self.segments).remove(s);
        let n = if right { n - 1 } else { n };
        let chunks = self.segment_mut(n);
        let target = chunks[i].extents.make_mut();
        if right {
            target.insert_slice(0, &mine.extents);
        } else {
            target.extend_from_slice(&mine.extents);
        }
        let len = target.len();
        if len > CHUNK_MAX {
            let tail = target.split_off(len / 2);
            trim_slack(target);
            chunks.insert(i + 1, Chunk::new(tail));
            self.chunks += 1;
        }
        let chunks = self.segment_mut(n);
        chunks[i].first = chunks[i].extents[0].file_off;
        self.fix_segment(n);
    }

    /// Restores the segment rules for segment `s`: drops it if empty,
    /// refreshes its first key, splits it if too big, merges it with an
    /// open neighbour if too small.
    fn fix_segment(&mut self, s: usize) {
        let segments = Arc::make_mut(&mut self.segments);
        let n = segments[s].chunk_count();
        if n == 0 {
            segments.remove(s);
            return;
        }
        segments[s].first = chunks_of(&segments[s])[0].first;
        if n > SEGMENT_MAX {
            let tail = open_mut(&mut segments[s].body).split_off(n / 2);
            segments.insert(s + 1, Segment::open_with(tail));
        } else if n < SEGMENT_MIN && segments.len() > 1 {
            let left = if s + 1 < segments.len() { s } else { s - 1 };
            // Merging a cold neighbour would give it shells it does not
            // need.
            if !(segments[left].is_open() && segments[left + 1].is_open()) {
                return;
            }
            let right = segments.remove(left + 1);
            let merged = open_mut(&mut segments[left].body);
            merged.extend_from_slice(right.chunks());
            let n = merged.len();
            if n > SEGMENT_MAX {
                let tail = merged.split_off(n / 2);
                segments.insert(left + 1, Segment::open_with(tail));
            }
        }
    }
}

/// The chunks of an open segment.
fn chunks_of(segment: &Segment) -> &[Chunk] {
    segment.body.chunks.get().map_or(&[], Vec::as_slice)
}

/// Most room a chunk keeps past its extents, as a fraction of them: a
/// chunk read from its page has none, and the first extent a change adds
/// would double it (a 1% change of a large map then takes twice the
/// memory of the chunks it touched).
const SLACK_DIVISOR: usize = 8;

/// Makes room for one more extent, growing by [`SLACK_DIVISOR`] rather
/// than doubling. Costs a copy of the chunk about every eighth insert
/// into it, which its shift of the extents after the insert point costs
/// anyway.
fn grow_for_one_more(extents: &mut ExtentStore) {
    if extents.len() == extents.capacity() {
        extents.reserve_exact(room_to_grow(extents.len()));
    }
}

/// Room a chunk of `len` extents grows by ([`SLACK_DIVISOR`]).
fn room_to_grow(len: usize) -> usize {
    len / SLACK_DIVISOR + 1
}

/// Gives back the room past [`SLACK_DIVISOR`] of a chunk's extents (after
/// a split or a merge).
fn trim_slack(extents: &mut ExtentStore) {
    extents.shrink_to(extents.len() + extents.len() / SLACK_DIVISOR);
}

/// Restores the chunk rules around `at` after a change to that chunk:
/// drops it if empty, refreshes its first offset, splits it if too big,
/// merges it with a neighbour if too small.
/// Returns by how many chunks the segment grew (-1, 0 or 1).
fn rebalance_chunks(chunks: &mut Vec<Chunk>, at: usize) -> isize {
    let n = chunks[at].extents.len();
    if n == 0 {
        chunks.remove(at);
        return -1;
    }
    chunks[at].first = chunks[at].extents[0].file_off;
    if n > CHUNK_MAX {
        let head = chunks[at].extents.make_mut();
        let tail = head.split_off(n / 2);
        trim_slack(head);
        chunks.insert(at + 1, Chunk::new(tail));
        1
    } else if n < CHUNK_MIN && chunks.len() > 1 {
        let left = if at + 1 < chunks.len() { at } else { at - 1 };
        // Merging would read an absent neighbour and rewrite its page:
        // a small chunk beside one costs a page, not a read.
        if !(chunks[left].is_loaded() && chunks[left + 1].is_loaded()) {
            return 0;
        }
        let right = chunks.remove(left + 1);
        let merged = chunks[left].extents.make_mut();
        merged.extend_from_slice(&right.extents);
        let n = merged.len();
        let tail = (n > CHUNK_MAX).then(|| merged.split_off(n / 2));
        trim_slack(merged);
        match tail {
            Some(tail) => {
                chunks.insert(left + 1, Chunk::new(tail));
                0
            }
            None => -1,
        }
    } else {
        0
    }
}

/// A store of pages in memory standing in for the device, and a way to
/// make a map's chunks absent as mount leaves them: for the tests of the
/// chunks and of [`super::ExtentMap`] across absent and loaded chunks.
#[cfg(test)]
pub(super) mod testing {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    // Named in full: the module graph test reads `super` here as the
    // parent module, which imports this one.
    use crate::codec::PageRef;
    use crate::error::Result;
    use crate::extent_map::chunks::{Chunk, Chunks, LoadPurpose, PageLoader, PageSource};
    use crate::types::{Extent, Ino};

    #[derive(Default)]
    pub struct PageStore {
        pages: Mutex<HashMap<u64, Vec<Extent>>>,
        pub loads: AtomicUsize,
        pub unplanned: AtomicUsize,
        /// Pages that fail to load (as a damaged page does).
        pub damaged: Mutex<Vec<u64>>,
    }

    impl PageStore {
        /// Keeps `extents` as the page `page` names.
        pub fn keep(&self, page: &PageRef, extents: &[Extent]) {
            self.pages
                .lock()
                .unwrap()
                .insert(page.addr, extents.to_vec());
        }
    }

    impl PageLoader for PageStore {
        fn load(&self, ino: Ino, page: &PageRef, purpose: LoadPurpose) -> Result<Vec<Extent>> {
            if purpose == LoadPurpose::Keep {
                self.loads.fetch_add(1, Ordering::Relaxed);
            }
            if self.damaged.lock().unwrap().contains(&page.addr) {
                return Err(crate::codec::page_lost(ino, page, page.addr, "damaged"));
            }
            Ok(self.pages.lock().unwrap()[&page.addr].clone())
        }
        fn note_unplanned(&self) {
            self.unplanned.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The page a checkpoint would write for `extents`: its address a
    /// fingerprint of them.
    pub fn page_of(extents: &[Extent]) -> PageRef {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        extents.hash(&mut h);
        PageRef {
            addr: h.finish(),
            crc: 0,
            count: extents.len() as u32,
            first_key: extents[0].file_off,
            allocated: extents.iter().map(|e| e.len).sum(),
        }
    }

    impl Chunks {
        /// A checkpoint (a page for each chunk naming none, kept in
        /// `store`), then a remount: every chunk absent, reading `store`.
        pub fn write_and_unload(&mut self, store: &Arc<PageStore>) {
            let source = Arc::new(PageSource {
                ino: 1,
                loader: store.clone(),
            });
            let mut rebuilt = Chunks::default();
            let chunks: Vec<&Chunk> = self.all_chunks().collect();
            for (i, c) in chunks.iter().enumerate() {
                // A loaded chunk's page is kept whoever named it (a
                // checkpoint may have named it without keeping it).
                let page = match c.extents.page() {
                    Some(p) if !c.is_loaded() => p,
                    named => {
                        let p = named.unwrap_or_else(|| page_of(&c.extents));
                        store.keep(&p, &c.extents);
                        p
                    }
                };
                let limit = chunks.get(i + 1).map_or(u64::MAX, |c| c.first);
                rebuilt.push_absent(page, source.clone(), limit, false, None);
            }
            *self = rebuilt;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::types::ExtentState;
    use proptest::prelude::*;

    fn ext(key: u64) -> Extent {
        Extent {
            file_off: key,
            len: 1,
            addr: key * 7,
            state: ExtentState::Unwritten,
        }
    }

    /// A chunk read from its page has no room past its extents; the
    /// inserts of a change, and the splits they cause, leave at most an
    /// eighth more (doubling would leave up to twice the extents, and a
    /// split's first half kept all of it), and removals add none.
    #[test]
    fn changed_chunks_keep_little_room_past_their_extents() {
        let room_ok = |c: &Chunks| {
            c.all_chunks().all(|ch| {
                let v = ch.extents.get().unwrap();
                v.capacity() <= v.len() + v.len() / SLACK_DIVISOR + 1
            })
        };
        let mut c = Chunks::default();
        // Every other key, chunk by chunk as a page gives them: exact.
        for first in (0..4 * CHUNK_MAX as u64).step_by(CHUNK_MAX) {
            let page: Vec<Extent> = (first..first + CHUNK_MAX as u64 / 2)
                .map(|k| ext(2 * k))
                .collect();
            c.push_chunk(page, None);
        }
        for k in 0..2 * CHUNK_MAX as u64 {
            c.insert(ext(2 * k + 1));
            assert!(room_ok(&c), "after inserting key {}", 2 * k + 1);
        }
        // Removals leave room where they remove, but never add any: a
        // merge gives back what it gathers past the slack.
        let capacity = |c: &Chunks| -> usize {
            c.all_chunks()
                .map(|ch| ch.extents.get().unwrap().capacity())
                .sum()
        };
        let mut before = capacity(&c);
        let mut removed = 0;
        for k in 0..8 * CHUNK_MAX as u64 {
            let Some(at) = c.find(k) else { continue };
            c.remove(at);
            removed += 1;
            let now = capacity(&c);
            assert!(now <= before, "removing key {k}: room {before} -> {now}");
            before = now;
        }
        assert_eq!(removed, 4 * CHUNK_MAX / 2 + 2 * CHUNK_MAX);
    }

    impl Chunks {
        /// Chunks of `self` that `other` shares (same allocation).
        fn shared_with(&self, other: &Chunks) -> usize {
            self.all_chunks()
                .filter(|c| {
                    other.all_chunks().any(|o| {
                        match (c.extents.loaded.get(), o.extents.loaded.get()) {
                            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                            _ => false,
                        }
                    })
                })
                .count()
        }
    }

    /// An evicted chunk's allocation goes back to the spare list
    /// emptied: its charge given back (else the loader would count bytes
    /// nobody holds), its extents freed, page and source forgotten. One
    /// a snapshot still holds is left alone.
    #[test]
    fn an_evicted_chunk_is_kept_spare_only_emptied_and_unshared() {
        #[derive(Default)]
        struct Counting(std::sync::atomic::AtomicI64);
        impl PageLoader for Counting {
            fn load(&self, _: Ino, _: &PageRef, _: LoadPurpose) -> Result<Vec<Extent>> {
                unreachable!("nothing is absent here")
            }
            fn cache_charge(&self, bytes: u64) {
                self.0.fetch_add(bytes as i64, Ordering::Relaxed);
            }
            fn cache_refund(&self, bytes: u64) {
                self.0.fetch_sub(bytes as i64, Ordering::Relaxed);
            }
        }
        let loader = Arc::new(Counting::default());
        let source = Arc::new(PageSource {
            ino: 1,
            loader: loader.clone(),
        });
        let clean = |extents: Vec<Extent>| {
            let page = page_of(&extents);
            let chunk = Arc::new(ChunkExtents::with(
                OnceLock::from(ExtentStore::from(extents)),
                OnceLock::from(page),
                OnceLock::from(source.clone()),
            ));
            chunk.charge();
            chunk
        };
        let chunk = clean(vec![ext(0), ext(2)]);
        let at = Arc::as_ptr(&chunk) as usize;
        assert!(loader.0.load(Ordering::Relaxed) > 0);
        spare_chunks::give_back(chunk);
        assert_eq!(loader.0.load(Ordering::Relaxed), 0, "charge given back");
        // Other tests take spares too: look for this one among them.
        let mut taken = Vec::new();
        while let Some(spare) = (taken.len() < spare_chunks::MAX).then(spare_chunks::take) {
            let found = Arc::as_ptr(&spare) as usize == at;
            assert!(
                spare.extents.get().is_none()
                    && spare.page.get().is_none()
                    && spare.source.get().is_none(),
                "a spare is empty"
            );
            taken.push(spare);
            if found {
                break;
            }
        }
        assert_eq!(
            Arc::as_ptr(taken.last().unwrap()) as usize,
            at,
            "kept spare"
        );
        // Held by a snapshot as well: not emptied under it.
        let shared = clean(vec![ext(4)]);
        let snapshot = shared.clone();
        spare_chunks::give_back(shared);
        assert_eq!(snapshot.len(), 1);
        assert!(loader.0.load(Ordering::Relaxed) > 0, "still charged");
    }

    /// A small chunk alone in its segment, beside a cold one it cannot
    /// merge with, still files itself (and its segment) under its new
    /// first key when a change removes its first extent (found in review:
    /// lookups between the old and the new first key then underflowed).
    #[test]
    fn a_lone_chunk_that_cannot_merge_keeps_its_first_key() {
        let store = Arc::new(testing::PageStore::default());
        let mut c = Chunks::default();
        // Four full chunks (one segment), then a chunk of two alone in the
        // next segment.
        for k in 0..4 * CHUNK_MAX as u64 {
            c.push(ext(2 * k));
        }
        c.push(ext(100));
        c.push(ext(110));
        c.write_and_unload(&store);
        assert_eq!((c.segment_count(), c.open_segments()), (2, 0));
        let at = c.find(100).unwrap();
        c.remove(at);
        c.check().unwrap();
        assert_eq!(
            c.last_at_or_before(105).map(|p| *c.get(p)),
            Some(ext(2 * (4 * CHUNK_MAX as u64 - 1)))
        );
        assert_eq!(c.first_after(90).map(|p| c.key(p)), Some(110));
        // And the other way: an insert below the lone chunk's first key.
        let mut c = Chunks::default();
        for k in 0..4 * CHUNK_MAX as u64 {
            c.push(ext(2 * k));
        }
        c.push(ext(100));
        c.write_and_unload(&store);
        c.insert(ext(99));
        c.check().unwrap();
        assert_eq!(c.find(99).map(|p| *c.get(p)), Some(ext(99)));
    }

    #[test]
    fn a_change_after_a_snapshot_copies_one_chunk() {
        let mut live = Chunks::default();
        for k in 0..(20 * CHUNK_MAX as u64) {
            live.push(ext(2 * k));
        }
        let chunks = live.chunk_count();
        assert_eq!(chunks, 20);
        let snapshot = live.clone();
        let at = live.last_at_or_before(2 * 150).unwrap();
        live.get_mut(at).state = ExtentState::Written;
        assert_eq!(live.shared_with(&snapshot), chunks - 1, "one chunk copied");
        // An insert into a full chunk splits it: two new chunks, the rest
        // still shared.
        live.insert(ext(2 * 77 + 1));
        assert_eq!(live.chunk_count(), chunks + 1);
        assert_eq!(live.shared_with(&snapshot), chunks - 2);
        live.check().unwrap();
        snapshot.check().unwrap();
        assert!(snapshot.iter().all(|e| e.state == ExtentState::Unwritten));
        assert_eq!(snapshot.len(), 20 * CHUNK_MAX);
        assert!(snapshot.find(2 * 77 + 1).is_none());
        assert_eq!(
            live.get(live.find(2 * 150).unwrap()).state,
            ExtentState::Written
        );
    }

    /// A stand-in for the page a checkpoint would write for `extents`: its
    /// address is a fingerprint of them.
    fn page_of(extents: &[Extent]) -> PageRef {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        extents.hash(&mut h);
        PageRef {
            addr: h.finish(),
            crc: 0,
            count: extents.len() as u32,
            first_key: extents[0].file_off,
            allocated: extents.iter().map(|e| e.len).sum(),
        }
    }

    /// Every chunk that names a page holds what that page was written
    /// from.
    fn pages_hold_their_chunks(c: &Chunks) -> Result<(), TestCaseError> {
        for (i, chunk) in c.pages().enumerate() {
            if let Some(page) = chunk.page() {
                prop_assert_eq!(
                    page,
                    page_of(chunk.extents()),
                    "chunk #{} changed under its page",
                    i
                );
            }
        }
        Ok(())
    }

    /// What a checkpoint does: pages for the chunks of a snapshot that
    /// have none, recorded in the snapshot; the live map sees them in the
    /// chunks it still shares. Returns how many were written.
    fn write_pages(snapshot: &Chunks) -> usize {
        let mut written = 0;
        for chunk in snapshot.pages() {
            if chunk.page().is_none() {
                chunk
                    .record_written(page_of(chunk.extents()), None)
                    .unwrap();
                written += 1;
            }
        }
        written
    }

    /// `chunks` full chunks of one-block extents at every other block,
    /// written to pages of a store and unloaded, with the source that
    /// reads them back.
    fn paged_chunks(chunks: u64) -> (Chunks, Arc<testing::PageStore>, Arc<PageSource>) {
        let store = Arc::new(testing::PageStore::default());
        let mut live = Chunks::default();
        for k in 0..(chunks * CHUNK_MAX as u64) {
            live.push(ext(2 * k));
        }
        live.write_and_unload(&store);
        let source = Arc::new(PageSource {
            ino: 1,
            loader: store.clone(),
        });
        (live, store, source)
    }

    /// A cold list shares a run from the run's first page while the pages
    /// pushed are that run's next; any other page makes it a list of its
    /// own with the same pages, and one started inside a run is its own
    /// from the start.
    #[test]
    fn a_cold_list_shares_its_run_from_the_start_and_copies_otherwise() {
        let page = |k: u64| PageRef {
            addr: 4096 * k,
            crc: 0,
            count: 1,
            first_key: 10 * k,
            allocated: 4096,
        };
        let run: PageRun = (0..4).map(page).collect::<Vec<_>>().into();
        let shared = |l: &ColdList| matches!(l, ColdList::Shared { .. });
        let mut list = ColdList::of(page(0), Some((&run, 0)));
        list.push(page(1), Some((&run, 1)));
        assert!(shared(&list));
        assert_eq!(&*list, &run[..2]);
        // Not the run's next (index 3 after 1): copied.
        list.push(page(3), Some((&run, 3)));
        assert!(!shared(&list));
        assert_eq!(&*list, &[page(0), page(1), page(3)]);
        list.push(page(4), None);
        assert_eq!(list.len(), 4);
        // Started inside the run: its own.
        let inside = ColdList::of(page(2), Some((&run, 2)));
        assert!(!shared(&inside));
        assert_eq!(&*inside, &[page(2)]);
        // A shared list counts nothing while the run is held elsewhere,
        // the whole run once it alone holds it.
        let list = ColdList::of(page(0), Some((&run, 0)));
        assert_eq!(list.own_bytes(), 0);
        drop(run);
        assert_eq!(list.own_bytes(), 4 * std::mem::size_of::<PageRef>() as u64);
    }

    /// The evictor's hand is a key: a step starts at the first chunk whose
    /// first key is at least it, in whichever segment (cold or open), and
    /// says where the next chunk starts; past the last chunk, `None`.
    #[test]
    fn an_eviction_step_starts_at_the_chunk_its_key_names() {
        // 12 chunks in several segments (4 at most each in unit builds).
        let (mut live, _store, source) = paged_chunks(12);
        assert!(live.segment_count() >= 3, "{}", live.segment_count());
        let firsts: Vec<u64> = live.all_chunks().map(|c| c.first).collect();
        for (k, &first) in firsts.iter().enumerate() {
            live.load_all().unwrap();
            let loaded_before: Vec<bool> = live.all_chunks().map(Chunk::is_loaded).collect();
            assert!(loaded_before.iter().all(|&l| l));
            // From its first key, and from a key inside the chunk before.
            let from = if k > 0 && k % 2 == 1 {
                firsts[k - 1] + 1
            } else {
                first
            };
            let (next, looked, evicted) = live.evict(from, 1, &source, |_, _| false, |_| false);
            assert_eq!(looked, 1, "chunk {k}");
            assert_eq!(next, firsts.get(k + 1).copied(), "chunk {k}");
            assert_eq!(evicted.len(), 1, "chunk {k}");
            assert_eq!(evicted[0].first, first, "chunk {k}");
        }
        // Past the last chunk's first key: nothing to look at.
        let (next, looked, evicted) =
            live.evict(firsts[11] + 1, 4, &source, |_, _| false, |_| false);
        assert_eq!((next, looked, evicted.len()), (None, 0, 0));
    }

    /// Changed extents as a walk over every chunk counts them.
    fn unpaged_by_walk(c: &Chunks) -> usize {
        c.pages()
            .filter(|p| p.is_loaded() && p.page().is_none())
            .map(|p| p.count())
            .sum()
    }

    /// A segment's kept count of changed extents stays what a walk over
    /// every chunk gives: after changes (in a segment counted before),
    /// while a snapshot shares some segments, after a base records pages
    /// through the snapshot's chunks (which the live map shares, also in
    /// a segment it copied and counted since), and after evictions.
    #[test]
    fn the_count_of_changed_extents_follows_changes_records_and_evictions() {
        let (mut live, store, source) = paged_chunks(12);
        live.load_all().unwrap();
        assert_eq!((live.unpaged_extents(), unpaged_by_walk(&live)), (0, 0));
        let change = |c: &mut Chunks, chunk: u64| {
            let at = c.find(2 * chunk * CHUNK_MAX as u64 + 2).unwrap();
            c.get_mut(at).state = ExtentState::Written;
        };
        // Counted once and kept; a change forgets its own segment's count
        // only. Chunks 4 and 6 share a segment (4 chunks each in unit
        // builds).
        let kept = |c: &Chunks| {
            c.segments
                .iter()
                .map(|s| s.body.unpaged.load(Ordering::Relaxed) != unpaged_count::UNCOUNTED)
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(&live), [true, true, true]);
        change(&mut live, 4);
        assert_eq!(kept(&live), [true, false, true]);
        assert_eq!(live.unpaged_extents(), CHUNK_MAX);
        assert_eq!(kept(&live), [true, true, true]);
        change(&mut live, 6);
        live.insert(ext(2 * 9 * CHUNK_MAX as u64 + 1));
        assert_eq!(live.unpaged_extents(), unpaged_by_walk(&live));
        assert_eq!(live.unpaged_extents(), 3 * CHUNK_MAX + 1);

        // A base's snapshot; then chunk 5 changes in the live map, whose
        // segment is now a copy, counted before the base records.
        let snapshot = live.clone();
        change(&mut live, 5);
        assert_eq!(live.unpaged_extents(), 4 * CHUNK_MAX + 1);
        assert_eq!(snapshot.unpaged_extents(), 3 * CHUNK_MAX + 1);
        for chunk in snapshot.pages().filter(|p| p.page().is_none()) {
            let page = testing::page_of(chunk.extents());
            store.keep(&page, chunk.extents());
            chunk.record_written(page, Some(&source)).unwrap();
        }
        assert_eq!(snapshot.unpaged_extents(), 0);
        assert_eq!(unpaged_by_walk(&live), CHUNK_MAX, "chunk 5 alone");
        assert_eq!(live.unpaged_extents(), CHUNK_MAX);
        drop(snapshot);

        // Eviction leaves changed chunks, and their count, as they are.
        let (_, _, evicted) = live.evict(0, usize::MAX, &source, |_, _| false, |_| false);
        assert!(!evicted.is_empty());
        assert_eq!(live.unpaged_extents(), CHUNK_MAX);
        assert_eq!(unpaged_by_walk(&live), CHUNK_MAX);
        live.check().unwrap();
    }

    /// An eviction step asks whether to stop every few chunks it looks at
    /// (not only after an eviction), and goes on from where it stopped.
    #[test]
    fn an_eviction_step_asks_whether_to_stop_every_few_chunks() {
        let (mut live, _store, source) = paged_chunks(3 * CHUNKS_PER_STOP_ASK as u64);
        live.load_all().unwrap();
        // Every chunk looked up: the first sweep evicts none of them.
        for c in live.all_chunks() {
            c.extents.touch();
        }
        let firsts: Vec<u64> = live.all_chunks().map(|c| c.first).collect();
        let mut asks = 0;
        let (next, looked, evicted) = live.evict(
            0,
            usize::MAX,
            &source,
            |_, _| false,
            |_| {
                asks += 1;
                true
            },
        );
        assert_eq!((looked, evicted.len(), asks), (CHUNKS_PER_STOP_ASK, 0, 1));
        assert_eq!(next, Some(firsts[CHUNKS_PER_STOP_ASK]));
        // Not stopped: asked once per few chunks up to the end.
        let mut asks = 0;
        let (next, looked, _) = live.evict(
            next.unwrap(),
            usize::MAX,
            &source,
            |_, _| false,
            |_| {
                asks += 1;
                false
            },
        );
        assert_eq!((looked, asks), (2 * CHUNKS_PER_STOP_ASK, 1));
        assert_eq!(next, None);
    }

    /// A chunk loaded to be changed gets an insert's room (so that the
    /// change does not move it to a larger slot), the neighbour loaded
    /// past it and a chunk loaded for a lookup none.
    #[test]
    fn chunks_loaded_to_change_get_room_and_the_rest_none() {
        let (live, _store, _source) = paged_chunks(6);
        let capacity_of = |live: &Chunks, n: usize| {
            let ch = live.all_chunks().nth(n).unwrap();
            ch.extents.get().map(|v| (v.len(), v.capacity()))
        };
        // Chunk 1 changes; chunk 2 is read as its neighbour.
        let key = 2 * (CHUNK_MAX as u64 + 3);
        assert_eq!(live.load_owners(key, key, 1, true).unwrap(), 2);
        assert_eq!(
            capacity_of(&live, 1),
            Some((CHUNK_MAX, CHUNK_MAX + room_to_grow(CHUNK_MAX)))
        );
        assert_eq!(capacity_of(&live, 2), Some((CHUNK_MAX, CHUNK_MAX)));
        let key = 2 * (4 * CHUNK_MAX as u64 + 3);
        assert_eq!(live.load_owners(key, key, 0, false).unwrap(), 1);
        assert_eq!(capacity_of(&live, 4), Some((CHUNK_MAX, CHUNK_MAX)));
        assert_eq!(capacity_of(&live, 0), None, "not loaded");
    }

    /// Chunks found by number are the ones a walk over every chunk
    /// numbers so, in open and cold segments alike; a number past the
    /// last chunk ends the answer.
    #[test]
    fn chunks_found_by_number_are_the_walks() {
        let (live, _store, _source) = paged_chunks(12);
        // Segment 1 open, the rest cold.
        live.load_owners(
            2 * 5 * CHUNK_MAX as u64,
            2 * 5 * CHUNK_MAX as u64 + 1,
            0,
            false,
        )
        .unwrap();
        assert!(live.open_segments() >= 1 && live.open_segments() < live.segment_count());
        let all: Vec<(Option<PageRef>, bool, usize)> = live
            .pages()
            .map(|p| (p.page(), p.starts_segment(), p.count()))
            .collect();
        for picks in [
            vec![0, 3, 4, 5, 9, 11],
            vec![7],
            vec![],
            vec![2, 11, 12, 13],
        ] {
            let got: Vec<(usize, Option<PageRef>, bool, usize)> = live
                .pages_at(&picks)
                .map(|(i, p)| (i, p.page(), p.starts_segment(), p.count()))
                .collect();
            let want: Vec<(usize, Option<PageRef>, bool, usize)> = picks
                .iter()
                .filter(|&&i| i < all.len())
                .map(|&i| (i, all[i].0, all[i].1, all[i].2))
                .collect();
            assert_eq!(got, want, "{picks:?}");
        }
    }

    /// The evictor's clock: a chunk looked up since the last sweep is
    /// passed over once (its bit cleared), a changed chunk (no page) never
    /// goes, the others become absent and read back the same from their
    /// pages; a snapshot sharing an evicted chunk drops it too.
    #[test]
    fn the_clock_passes_over_a_touched_chunk_once_and_keeps_changed_ones() {
        let (mut live, store, source) = paged_chunks(6);
        live.load_all().unwrap();
        let want: Vec<Extent> = live.iter().copied().collect();
        // Chunk 1 looked up, chunk 3 changed (it names no page now).
        live.touch_last_at_or_before(2 * CHUNK_MAX as u64).unwrap();
        let at = live.find(2 * 3 * CHUNK_MAX as u64 + 2).unwrap();
        live.get_mut(at).state = ExtentState::Written;
        let snapshot = live.clone();
        let loaded = |c: &Chunks| c.all_chunks().map(Chunk::is_loaded).collect::<Vec<_>>();
        let (next, looked, evicted) = live.evict(0, usize::MAX, &source, |_, _| false, |_| false);
        assert_eq!((next, looked), (None, 6));
        assert_eq!(loaded(&live), [false, true, false, true, false, false]);
        drop((snapshot, evicted));
        // The next sweep takes the chunk looked up before.
        let (_, _, again) = live.evict(0, usize::MAX, &source, |_, _| false, |_| false);
        assert_eq!(again.len(), 1);
        assert_eq!(loaded(&live), [false, false, false, true, false, false]);
        let loads = store.loads.load(std::sync::atomic::Ordering::Relaxed);
        live.load_all().unwrap();
        assert_eq!(
            store.loads.load(std::sync::atomic::Ordering::Relaxed) - loads,
            5,
            "read again from their pages"
        );
        let mut got: Vec<Extent> = live.iter().copied().collect();
        got[CHUNK_MAX * 3 + 1].state = ExtentState::Unwritten;
        assert_eq!(got, want);
        live.check().unwrap();
    }

    #[test]
    fn a_checkpoint_after_a_change_writes_the_changed_chunks_only() {
        let mut live = Chunks::default();
        for k in 0..(20 * CHUNK_MAX as u64) {
            live.push(ext(2 * k));
        }
        assert_eq!(write_pages(&live.clone()), 20, "first checkpoint: all");
        assert!(
            live.pages().all(|c| c.page().is_some()),
            "the live map shares them"
        );
        let snapshot = live.clone();
        let at = live.last_at_or_before(2 * 150).unwrap();
        live.get_mut(at).state = ExtentState::Written;
        assert_eq!(live.pages().filter(|c| c.page().is_none()).count(), 1);
        assert!(snapshot.pages().all(|c| c.page().is_some()));
        // Unshared now: a change in place forgets the page as well.
        drop(snapshot);
        let at = live.last_at_or_before(2 * 3).unwrap();
        live.remove(at);
        assert_eq!(live.pages().filter(|c| c.page().is_none()).count(), 2);
        assert_eq!(write_pages(&live.clone()), 2);
        let chunks: Vec<(Vec<Extent>, Option<PageRef>)> = live
            .pages()
            .map(|c| (c.extents().to_vec(), c.page()))
            .collect();
        // Read back one chunk per page, each naming its page.
        let mut read = Chunks::default();
        for (extents, page) in chunks {
            read.push_chunk(extents, page);
        }
        read.check().unwrap();
        assert_eq!(read, live);
        assert!(read
            .pages()
            .zip(live.pages())
            .all(|(a, b)| a.page() == b.page()));
        let first = read.pages().next().unwrap();
        let other = PageRef {
            addr: 1,
            ..first.page().unwrap()
        };
        assert!(
            first.record_written(other, None).is_err(),
            "a chunk names one page"
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64),
        Remove(u64),
        RemoveSpan(u64, u64),
        Mark(u64),
        Snapshot,
        Checkpoint,
        /// A checkpoint whose pages are kept in a store, then two sweeps
        /// of the evictor over every chunk.
        Evict,
        /// A checkpoint and a remount: every segment cold.
        Unload,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..200u64).prop_map(Op::Insert),
            2 => (0..200u64).prop_map(Op::Remove),
            1 => (0..200u64, 0..80u64).prop_map(|(a, n)| Op::RemoveSpan(a, a + n)),
            1 => (0..200u64).prop_map(Op::Mark),
            1 => Just(Op::Snapshot),
            1 => Just(Op::Checkpoint),
            1 => Just(Op::Evict),
            1 => Just(Op::Unload),
        ]
    }

    fn same(c: &Chunks, model: &BTreeMap<u64, Extent>) -> Result<(), TestCaseError> {
        c.check().map_err(TestCaseError::fail)?;
        prop_assert_eq!(c.len(), model.len());
        prop_assert!(c.iter().eq(model.values()));
        for key in 0..=201u64 {
            let want = model.range(..=key).next_back().map(|(_, e)| *e);
            prop_assert_eq!(c.last_at_or_before(key).map(|p| *c.get(p)), want);
            let want = model.range(key + 1..).next().map(|(_, e)| *e);
            prop_assert_eq!(c.first_after(key).map(|p| *c.get(p)), want);
            let want = model.range(key..).next().map(|(_, e)| *e);
            let from = c.first_at_or_after(key);
            prop_assert_eq!(from.map(|p| *c.get(p)), want);
            if let Some(p) = from {
                prop_assert!(c.iter_from(p).eq(model.range(key..).map(|(_, e)| e)));
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn matches_a_sorted_map_and_snapshots_stay_put(
            ops in prop::collection::vec(op(), 1..120)
        ) {
            let mut c = Chunks::default();
            let mut model = BTreeMap::new();
            let mut snapshots = Vec::new();
            let store = Arc::new(testing::PageStore::default());
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        if let std::collections::btree_map::Entry::Vacant(v) = model.entry(k) {
                            v.insert(ext(k));
                            c.insert(ext(k));
                        }
                    }
                    Op::Remove(k) => {
                        let got = c.find(k).map(|p| c.remove(p));
                        prop_assert_eq!(got, model.remove(&k));
                    }
                    Op::RemoveSpan(a, b) => {
                        let mut got = Vec::new();
                        c.remove_span(a, b, |e| got.push(e));
                        let want: Vec<Extent> = model.range(a..b).map(|(_, e)| *e).collect();
                        model.retain(|&k, _| !(a..b).contains(&k));
                        prop_assert_eq!(got, want);
                    }
                    Op::Mark(k) => {
                        if let Some(p) = c.find(k) {
                            c.get_mut(p).state = ExtentState::Written;
                            model.get_mut(&k).unwrap().state = ExtentState::Written;
                        }
                    }
                    Op::Snapshot => snapshots.push((c.clone(), model.clone())),
                    Op::Checkpoint => {
                        write_pages(&c.clone());
                    }
                    Op::Evict => {
                        let source = Arc::new(PageSource { ino: 1, loader: store.clone() });
                        for chunk in c.clone().pages() {
                            // Pages an earlier checkpoint named are kept
                            // too: evicted chunks read them back.
                            if chunk.is_loaded() || chunk.page().is_none() {
                                let page = page_of(chunk.extents());
                                store.keep(&page, chunk.extents());
                                chunk.record_written(page, Some(&source)).unwrap();
                            }
                        }
                        for _ in 0..2 {
                            c.evict(0, usize::MAX, &source, |_, _| false, |_| false);
                        }
                        c.check().map_err(TestCaseError::fail)?;
                        // Every chunk was clean: no segment keeps shells.
                        prop_assert_eq!(c.open_segments(), 0);
                        prop_assert_eq!(c.loaded_chunks(), 0);
                    }
                    Op::Unload => {
                        c.write_and_unload(&store);
                        c.check().map_err(TestCaseError::fail)?;
                        prop_assert_eq!(c.open_segments(), 0);
                    }
                }
                same(&c, &model)?;
                pages_hold_their_chunks(&c)?;
                // The kept counts of changed extents, after every kind
                // of change, page record and eviction, in the live map
                // and in every snapshot sharing its segments.
                prop_assert_eq!(c.unpaged_extents(), unpaged_by_walk(&c));
                for (snap, _) in &snapshots {
                    prop_assert_eq!(snap.unpaged_extents(), unpaged_by_walk(snap));
                }
                let max_chunks = model.len().div_ceil(CHUNK_MIN).max(1);
                prop_assert!(c.chunk_count() <= max_chunks, "{} chunks", c.chunk_count());
            }
            for (snap, want) in &snapshots {
                same(snap, want)?;
                pages_hold_their_chunks(snap)?;
            }
        }

        /// Spans of every length and gap, within one chunk and across
        /// several (a chunk holds 8 extents in tests), give exactly the
        /// extents a sorted map holds under them.
        #[test]
        fn extents_in_spans_matches_a_sorted_map(
            keys in prop::collection::btree_set(0..400u64, 0..150),
            cuts in prop::collection::btree_set(0..420u64, 0..40),
        ) {
            let mut c = Chunks::default();
            for &k in &keys {
                c.insert(ext(k));
            }
            // Consecutive cut points, every other pair a span: sorted, disjoint.
            let cuts: Vec<u64> = cuts.into_iter().collect();
            let spans: Vec<(u64, u64)> = cuts.chunks_exact(2).map(|p| (p[0], p[1])).collect();
            let mut got = Vec::new();
            c.extents_in_spans(&spans, &mut got);
            let want: Vec<Extent> = spans
                .iter()
                .flat_map(|&(a, b)| keys.range(a..b).map(|&k| ext(k)))
                .collect();
            prop_assert_eq!(got, want);
        }
    }
}
