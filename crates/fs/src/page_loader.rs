//! The device behind absent extent chunks (issue 13, step 2: lazy pages).
//!
//! Mount leaves every paged file's chunks absent (`extent_map` keeps the
//! page reference only) and reads a page when an entry point first needs
//! its chunk. The root that lists the pages verified, and a base flushes
//! its pages before its root, so the pages were durable: a page that does
//! not verify now is damage, not a torn write, and no older slot stands in
//! for it. The operation that needed it fails (`Error::Corrupt` naming the
//! inode, the page's keys and device byte: EIO at the API), the chunk stays
//! absent, the damage is listed here for the user ([`PageLoads::damaged`]),
//! and no other chunk or file is affected. A device error is returned as
//! it is and a later access reads again.
//!
//! A page found damaged stays so until unmount, so that every access
//! answers alike. Free space cannot be known without its extents: the
//! scan that rebuilds it after mount (`mount::for_each_used_range`) stops
//! at the page with its error, and nothing is allocated this session, so
//! the blocks the page maps never go to another file.
//!
//! Clean chunks (their extents in memory and on a page: loaded, or
//! written by a base) are counted here against the mount's budget
//! (`MountOptions::metadata_cache_bytes`); past it the evictor is asked
//! (`crate::extent_cache`), which makes some absent again.
//!
//! A page is never freed while a chunk can still load it: a chunk names
//! its page until it changes (and a changed chunk is loaded), and a base
//! frees only pages neither slot's base lists, which no live chunk names
//! (`extent_pages::after_base`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use blockdev::BlockDevice;

use crate::background_request::BackgroundRequest;
use crate::codec::PageRef;
use crate::error::{Error, Result};
use crate::extent_map::{LoadPurpose, PageLoader};
use crate::superblock::Superblock;
use crate::types::{Extent, Ino};

/// Reads extent pages for a mounted volume's absent chunks, and counts.
pub(crate) struct DevicePages {
    dev: Arc<dyn BlockDevice>,
    sb: Superblock,
    loads: AtomicU64,
    scans: AtomicU64,
    unplanned: AtomicU64,
    /// One line per damaged page found, in the order found.
    damaged: Mutex<Vec<(u64, String)>>,
    /// Bytes of clean chunks in memory (see `PageLoader::cache_charge`).
    cached: AtomicU64,
    /// The mount's budget (`MountOptions::metadata_cache_bytes`): the
    /// shells, then clean and changed chunks' extents up to what is left
    /// (`budget()`), past which the evictor is asked.
    budget: AtomicU64,
    /// The evictor's (see [`crate::extent_cache`]).
    pub(crate) evict_request: Arc<BackgroundRequest>,
    /// Bytes of chunks that had a page and changed, since mount (see
    /// `PageLoader::chunk_unpaged`): only grows.
    unpaged_so_far: AtomicU64,
    /// Bytes of changed chunks (no page: never evicted) the checkpoint
    /// thread found at its last look, and `unpaged_so_far` then: with the
    /// chunks changed since, they count against the budget, so the clean
    /// chunks make room for them.
    unpaged_seen: AtomicU64,
    unpaged_seen_at: AtomicU64,
    /// Set once a chunk charged holds its extents in a slot: the budget
    /// then leaves the slot pool's warm slots room (`warm_slot_room`).
    slots_in_use: AtomicBool,
    /// Clean chunk bytes the evictor dropped since mount, and that count
    /// at the last base or budget change (see `evicted_since_base`).
    evicted_so_far: AtomicU64,
    evicted_at_base: AtomicU64,
    /// The paged maps' own memory as last counted
    /// (`ExtentMap::shell_bytes`), and the pages both slots' bases list
    /// (see `shell_bytes`).
    map_shell_bytes: AtomicU64,
    /// Shells of the segments lookups opened from cold, while they are
    /// open (`PageLoader::shells_opened`): counted as they change, not
    /// at the maps' counts.
    opened_shell_bytes: AtomicU64,
    listed_pages: AtomicU64,
}

/// The chunks' extents get at least this fraction of the budget, however
/// much of it the shells take: with less, nearly every lookup would read
/// a page again.
const MIN_CHUNK_ROOM_DIVISOR: u64 = 8;

/// The share of a mount's budget the slot pool may keep in warm free
/// slots (and the budget counts for them), up to
/// [`crate::extent_map::WARM_SLOT_BYTES_MOST`]: 16 MiB of the default 64.
const WARM_SLOT_SHARE_DIVISOR: u64 = 4;

/// What a budget of `budget` bytes counts for the slot pool's warm
/// slots.
fn warm_slot_share(budget: u64) -> u64 {
    (budget / WARM_SLOT_SHARE_DIVISOR).min(crate::extent_map::WARM_SLOT_BYTES_MOST as u64)
}

/// What [`DevicePages`] did since mount.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageLoads {
    /// Pages read for absent chunks that keep their extents (including
    /// the reads that failed).
    pub loads: u64,
    /// Pages read and dropped by a pass over every extent (free space at
    /// mount): their chunks stay absent.
    pub scans: u64,
    /// Chunks of every file's map with their extents in memory, and all
    /// chunks (filled by `Volume::extent_page_loads`).
    pub chunks_loaded: u64,
    pub chunks: u64,
    /// Segments of chunks with shells in memory, and all segments (the
    /// rest are cold: known by their chunks' pages alone).
    pub segments_open: u64,
    pub segments: u64,
    /// Chunks loaded outside a fallible entry point (a path that did not
    /// load what it reads first); each is a bug to fix, not a failure.
    pub unplanned: u64,
    /// The damaged pages found: inode, keys, device byte and why.
    pub damaged: Vec<String>,
    /// Bytes of clean extent chunks in memory (loaded from their page, or
    /// written to one by a base), and the mount's whole budget
    /// (`MountOptions::metadata_cache_bytes`, shells included).
    pub cached_bytes: u64,
    pub cache_budget: u64,
    /// Bytes of clean chunks the evictor dropped since mount.
    pub evicted_bytes: u64,
    /// Memory the paged maps take whatever is evicted: a shell per chunk,
    /// loaded or absent, and both slots' lists of pages. Counted against
    /// the budget: the clean chunks get what is left (`chunk_budget`).
    pub shell_bytes: u64,
    /// Of which: the shells of segments lookups opened from cold (the
    /// evictor makes a segment cold again once every chunk of it is
    /// absent).
    pub opened_shell_bytes: u64,
    /// What the chunks' extents may take (the budget less the shells, at
    /// least an eighth of it): clean chunks past it, with the changed
    /// ones, are evicted.
    pub chunk_budget: u64,
}

impl DevicePages {
    pub(crate) fn new(dev: Arc<dyn BlockDevice>, sb: Superblock) -> Self {
        DevicePages {
            dev,
            sb,
            loads: AtomicU64::new(0),
            scans: AtomicU64::new(0),
            unplanned: AtomicU64::new(0),
            damaged: Mutex::new(Vec::new()),
            cached: AtomicU64::new(0),
            budget: AtomicU64::new(u64::MAX),
            evict_request: Arc::default(),
            unpaged_so_far: AtomicU64::new(0),
            unpaged_seen: AtomicU64::new(0),
            unpaged_seen_at: AtomicU64::new(0),
            slots_in_use: AtomicBool::new(false),
            evicted_so_far: AtomicU64::new(0),
            evicted_at_base: AtomicU64::new(0),
            map_shell_bytes: AtomicU64::new(0),
            opened_shell_bytes: AtomicU64::new(0),
            listed_pages: AtomicU64::new(0),
        }
    }

    /// Sets the mount's budget, shells included (asks the evictor at once
    /// if the chunks are past what is left for them).
    pub(crate) fn set_budget(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::Relaxed);
        let warm = usize::try_from(warm_slot_share(bytes)).unwrap_or(usize::MAX);
        crate::extent_map::keep_warm_slots_up_to(warm);
        self.based();
        self.ask_if_over();
    }

    /// The evictor dropped `bytes` of clean chunks to stay in the budget.
    pub(crate) fn evicted(&self, bytes: u64) {
        self.evicted_so_far.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether the evictor had to drop clean chunks since the last base
    /// (or budget change): the maps do not fit the budget.
    pub(crate) fn evicted_since_base(&self) -> bool {
        self.evicted_so_far.load(Ordering::Relaxed) > self.evicted_at_base.load(Ordering::Relaxed)
    }

    /// A base was written (or the budget changed): what the evictor drops
    /// from now on says whether the maps fit.
    pub(crate) fn based(&self) {
        self.evicted_at_base.store(
            self.evicted_so_far.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }

    /// Bytes the extents of chunks in memory (clean and changed) may
    /// take: the mount's budget less the shells (see
    /// [`PageLoads::shell_bytes`]) and, once its chunks live in slots,
    /// the most the slot pool keeps warm (memory the chunks leave behind
    /// to be reused, see `extent_map::page_slots`), and never under an
    /// eighth of it.
    pub(crate) fn budget(&self) -> u64 {
        let total = self.budget.load(Ordering::Relaxed);
        total
            .saturating_sub(self.shell_bytes())
            .saturating_sub(self.warm_slot_room())
            .max(total / MIN_CHUNK_ROOM_DIVISOR)
    }

    /// The room the slot pool's warm free slots take, once chunks of
    /// this mount live in slots (chunks too small for a slot never
    /// leave any): counted at its most, not as it is now. Counted as it
    /// is, a pass that evicts many chunks turns their bytes into warm
    /// slots and the budget shrinks only after the chunks that made it
    /// grow are in memory: at 50M extents a session peaked at 85-89 MiB
    /// so, and at 70 counted at the most.
    fn warm_slot_room(&self) -> u64 {
        if self.slots_in_use.load(Ordering::Relaxed) {
            warm_slot_share(self.budget.load(Ordering::Relaxed))
        } else {
            0
        }
    }

    /// The shells' memory: the paged maps' own (a page reference per
    /// chunk of a cold segment with a list of its own, a 72-byte entry
    /// per chunk of an open one: an absent chunk is nothing more, a loaded
    /// one adds its extents, charged apart), and a page reference per page
    /// the slots list (each run once: both slots and the cold segments
    /// mount builds share them).
    fn shell_bytes(&self) -> u64 {
        let maps = self
            .map_shell_bytes
            .load(Ordering::Relaxed)
            .saturating_add(self.opened_shell_bytes.load(Ordering::Relaxed));
        let pages = self.listed_pages.load(Ordering::Relaxed);
        maps.saturating_add(pages.saturating_mul(std::mem::size_of::<PageRef>() as u64))
    }

    /// The paged maps now take `bytes` beside their chunks' extents
    /// (counted at mount, at the checkpoint thread's looks and at each
    /// base; in between, splits, merges and segments opened by lookups
    /// or made cold by the evictor leave the count off).
    pub(crate) fn set_map_shell_bytes(&self, bytes: u64) {
        self.map_shell_bytes.store(bytes, Ordering::Relaxed);
        self.ask_if_over();
    }

    /// Both slots' bases now list `pages` pages (at mount and after each
    /// base).
    pub(crate) fn set_listed_pages(&self, pages: u64) {
        self.listed_pages.store(pages, Ordering::Relaxed);
        self.ask_if_over();
    }

    pub(crate) fn cached_bytes(&self) -> u64 {
        self.cached.load(Ordering::Relaxed)
    }

    /// Bytes of chunks that had a page and changed, since mount.
    pub(crate) fn unpaged_so_far(&self) -> u64 {
        self.unpaged_so_far.load(Ordering::Relaxed)
    }

    /// Records the changed chunks' bytes a look found (see
    /// `unpaged_seen`), asking the evictor if the clean ones must now
    /// make room.
    pub(crate) fn set_unpaged_seen(&self, bytes: u64) {
        self.unpaged_seen_at
            .store(self.unpaged_so_far(), Ordering::Relaxed);
        self.unpaged_seen.store(bytes, Ordering::Relaxed);
        self.ask_if_over();
    }

    /// The changed chunks' bytes: as the last look found them, and those
    /// that changed since (as they were when they did).
    pub(crate) fn unpaged_estimate(&self) -> u64 {
        let since = self
            .unpaged_so_far()
            .saturating_sub(self.unpaged_seen_at.load(Ordering::Relaxed));
        self.unpaged_seen
            .load(Ordering::Relaxed)
            .saturating_add(since)
    }

    /// Wakes the evictor's thread (see `crate::extent_cache`).
    pub(crate) fn ask_evictor(&self) {
        self.evict_request.ask();
    }

    fn ask_if_over(&self) {
        if self.cached_bytes().saturating_add(self.unpaged_estimate()) > self.budget() {
            self.evict_request.ask();
        }
    }

    pub(crate) fn stats(&self) -> PageLoads {
        PageLoads {
            loads: self.loads.load(Ordering::Relaxed),
            scans: self.scans.load(Ordering::Relaxed),
            chunks_loaded: 0,
            chunks: 0,
            segments_open: 0,
            segments: 0,
            unplanned: self.unplanned.load(Ordering::Relaxed),
            cached_bytes: self.cached_bytes(),
            cache_budget: self.budget.load(Ordering::Relaxed),
            shell_bytes: self.shell_bytes(),
            opened_shell_bytes: self.opened_shell_bytes.load(Ordering::Relaxed),
            chunk_budget: self.budget(),
            evicted_bytes: self.evicted_so_far.load(Ordering::Relaxed),
            damaged: self
                .damaged
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(_, why)| why.clone())
                .collect(),
        }
    }
}

impl PageLoader for DevicePages {
    fn load(&self, ino: Ino, page: &PageRef, purpose: LoadPurpose) -> Result<Vec<Extent>> {
        // Found damaged once, damaged for the session: free space was
        // built without its extents, so a read that verified later (a
        // device that returned bad bytes once) must not bring back a map
        // over blocks that may belong to another file since.
        if let Some((_, why)) = self
            .damaged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|&&(addr, _)| addr == page.addr)
        {
            return Err(crate::codec::page_lost(
                ino,
                page,
                page.addr,
                format!("found damaged earlier in this session ({why})"),
            ));
        }
        match purpose {
            LoadPurpose::Keep => &self.loads,
            LoadPurpose::Scan => &self.scans,
        }
        .fetch_add(1, Ordering::Relaxed);
        crate::checkpoint::read_page(&*self.dev, &self.sb, ino, page).inspect_err(|e| {
            if let Error::Corrupt { .. } = e {
                let mut damaged = self.damaged.lock().unwrap_or_else(|e| e.into_inner());
                if !damaged.iter().any(|&(addr, _)| addr == page.addr) {
                    damaged.push((page.addr, e.to_string()));
                }
            }
        })
    }

    fn note_unplanned(&self) {
        self.unplanned.fetch_add(1, Ordering::Relaxed);
    }

    fn cache_charge(&self, bytes: u64) {
        self.cached.fetch_add(bytes, Ordering::Relaxed);
        // Loads run under the shared metadata lock, which eviction cannot
        // take: it runs in its own thread.
        self.ask_if_over();
    }

    fn slots_in_use(&self) {
        if !self.slots_in_use.load(Ordering::Relaxed) {
            self.slots_in_use.store(true, Ordering::Relaxed);
            // Less room for the chunks: the evictor may have work.
            self.ask_if_over();
        }
    }

    fn cache_refund(&self, bytes: u64) {
        self.cached.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn chunk_unpaged(&self, bytes: u64) {
        self.unpaged_so_far.fetch_add(bytes, Ordering::Relaxed);
    }

    fn shells_opened(&self, bytes: u64) {
        self.opened_shell_bytes.fetch_add(bytes, Ordering::Relaxed);
        // Less room for the chunks: the evictor may have work.
        self.ask_if_over();
    }

    fn shells_dropped(&self, bytes: u64) {
        self.opened_shell_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}
