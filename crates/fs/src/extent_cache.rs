//! Eviction of extent chunks to the mount's budget (issue 13, step 2,
//! item 5 of `docs/EXTENT_PAGES.md`).
//!
//! A chunk whose extents are also on an extent page (loaded from it, or
//! written to it by a base) is *clean*: its bytes are counted by the page
//! loader (`crate::page_loader::DevicePages`). Past what
//! `MountOptions::metadata_cache_bytes` leaves once the maps' shells are
//! counted (`DevicePages::budget`) the loader asks this evictor, which
//! replaces clean chunks with absent ones sharing the page; the entry
//! points that read a map (`ExtentMap::load_keys` and the like) read the
//! page again when they next need the chunk. A chunk changed since the
//! last base names no page and is never evicted: memory alone holds it.
//! A checkpoint writes a base instead of a delta once those pass a quarter
//! of the budget (`crate::transaction`), which gives them pages. Before
//! such a base, the thread that writes it (the checkpoint thread, or a
//! writer that got ahead of it) sweeps a quarter of the budget further
//! below the line ([`BASE_ROOM_DIVISOR`]): the base's snapshot
//! holds every chunk while it runs, so nothing the changes meanwhile load
//! or copy is freed until it ends.
//!
//! The choice is a clock: a lookup sets the chunk's bit (read first, set
//! only when clear, so a hot chunk's line is not written on every read);
//! the sweep clears a set bit and evicts a chunk it finds clear. The read
//! path keeps no list and allocates nothing.
//!
//! Where it runs: in its own background thread (`iomapfs-evict`). The
//! loader runs under the shared metadata lock, which a change to the maps
//! cannot take; the checkpoint and commit threads run only when the
//! journal asks, and a read-only session loading a big file never does;
//! the flusher wakes on a timer. So the loader asks this thread (a
//! [`crate::background_request::BackgroundRequest`]) as soon as a load
//! passes the budget. The sweep holds the metadata write lock, which every
//! reader waits on, for at most about [`LOCK_HOLD_STEP`] at a time and
//! releases it fairly in between.
//!
//! A running checkpoint's snapshot shares the live maps' chunks, so the
//! sweep waits for it (`VolumeInner::checkpointing`): the snapshot,
//! dropped once written, frees what it held. In an inode changed since
//! the last checkpoint's snapshot, the chunks whose keys meet a changed
//! span are left alone: the next delta reads those spans from the next
//! snapshot, without a fallible entry point. The rest of such a file is
//! evicted like any other: a file changed all the time (a database's)
//! would otherwise keep every chunk it ever read.
//!
//! Any other snapshot that shares a chunk (mount's free-space scan's, for
//! the scan's length) keeps its extents in memory until it drops: the
//! sweep counts such a chunk as freed, so that it does not empty the map
//! of chunks whose memory it cannot give back now. Every such holder drops
//! its snapshot before it reports its work done (the scan before free
//! space is ready).

use std::sync::Arc;

use crate::extent_map::{PageLoader, PageSource};
use crate::lock_holds::{HoldSite, LOCK_HOLD_STEP};
use crate::mount_state::VolumeInner;
use crate::types::{FileKind, Ino};

/// The sweep stops at the budget less this fraction of it, so that the
/// loads after it do not ask again at once.
const MARGIN_DIVISOR: u64 = 8;

/// Before a base, the sweep goes this fraction of the budget further
/// below its line. A base's snapshot shares every chunk while it is
/// written (at 10M extents, about 20 ms), and the sweep waits for it: what
/// changes meanwhile loads and copies chunks that nothing frees until it
/// ends. Measured with a fresh process reading every chunk of a
/// 10M-extent file, then changing 1% of its extents, 64 MiB budget: peak
/// RSS 114-117 MiB without it, 91-92 with it (`iomapfs io`, bench
/// `metadata-scale-10m`); with glibc's default allocator settings,
/// 114-118 and 97-100 (with half the budget, 101; with an eighth, 104).
const BASE_ROOM_DIVISOR: u64 = 4;

/// Clean bytes a sweep stops at: the line, less the `changed` chunks'
/// bytes (changed chunks cannot be evicted: the clean ones make room for
/// them until a base pages them) and `room` more.
fn sweep_target(budget: u64, changed: u64, room: u64) -> u64 {
    eviction_line(budget)
        .saturating_sub(changed)
        .saturating_sub(room)
}

/// Where the sweep brings the chunks in memory, for a budget of `budget`
/// bytes (clean chunks less the room the changed ones take).
pub(crate) fn eviction_line(budget: u64) -> u64 {
    budget - budget / MARGIN_DIVISOR
}

impl VolumeInner {
    /// Counts the memory the paged maps take whatever is evicted (their
    /// chunks' shells and both slots' page lists) for the loader, which
    /// gives the chunks' extents the rest of the budget. At mount; the
    /// checkpoint thread's looks and each base count again.
    pub(crate) fn count_shells(&self) {
        let Some(loader) = &self.page_loader else {
            return;
        };
        let maps = {
            let meta = self.meta.read();
            crate::state::paged_shell_bytes_of(&meta.state.inodes, self.block_size)
        };
        let pages = crate::extent_pages::listed_pages(&self.commit.lock().pages);
        loader.set_map_shell_bytes(maps);
        loader.set_listed_pages(pages);
    }

    /// Reads the absent chunks a change of `ino`'s `[start, end)` reads
    /// ([`crate::extent_map::ExtentMap::load_for_change`]) under the shared
    /// metadata lock, before the change takes the exclusive one: a page
    /// read there would hold every read and write of every file for its
    /// I/O (at 10M extents, under a 64 MiB budget, most allocating writes
    /// into a random hole read one). The change loads again what the
    /// evictor dropped in between, so this is a speed-up, never a
    /// condition. Without extent pages there is nothing to read.
    pub(crate) fn load_before_change(&self, ino: Ino, start: u64, end: u64) -> crate::Result<()> {
        if self.page_loader.is_none() {
            return Ok(());
        }
        let meta = self.meta.read();
        if let Some(inode) = meta.state.inode(ino) {
            inode.extents.load_for_change(start, end)?;
        }
        Ok(())
    }

    /// The evictor's job: makes clean chunks absent until the clean bytes
    /// are below the budget (less a margin), in steps of
    /// about [`LOCK_HOLD_STEP`] per hold of the metadata lock. Gives up
    /// after two sweeps over every chunk (the first may only clear clock
    /// bits) when what is left is changed or in use.
    pub(crate) fn evict_extent_chunks(&self) {
        self.evict_to_budget();
        // What this pass freed, and an eviction before a base (which asks
        // this thread after it): given back here, not in the thread that
        // dropped the chunks.
        crate::extent_map::give_back_excess_slots();
    }

    fn evict_to_budget(&self) {
        let Some(loader) = &self.page_loader else {
            return;
        };
        let budget = loader.budget();
        let start = loader.cached_bytes();
        // Changed chunks cannot be evicted: the clean ones make room for
        // them (until a base pages them).
        let changed = loader.unpaged_estimate();
        if start.saturating_add(changed) <= budget {
            return;
        }
        let _no_checkpoint_running = self.checkpointing.lock();
        self.sweep_to(start, sweep_target(budget, changed, 0));
    }

    /// Before a base's snapshot (the caller holds `checkpointing`): evicts
    /// clean chunks to [`BASE_ROOM_DIVISOR`] of the budget below the line.
    pub(crate) fn evict_before_base(&self) {
        let Some(loader) = &self.page_loader else {
            return;
        };
        let budget = loader.budget();
        let target = sweep_target(
            budget,
            loader.unpaged_estimate(),
            budget / BASE_ROOM_DIVISOR,
        );
        let start = loader.cached_bytes();
        if start > target {
            self.sweep_to(start, target);
            // The slots of what it dropped go back to the system mostly in
            // the evictor's thread, not in this checkpoint's time (this
            // thread gives back only past twice the warm bytes, in runs).
            loader.ask_evictor();
        }
    }

    /// Evicts clean chunks from `start` bytes to `target`, the caller
    /// holding `checkpointing` (no snapshot shares the chunks).
    fn sweep_to(&self, start: u64, target: u64) {
        let Some(loader) = &self.page_loader else {
            return;
        };
        let as_loader: Arc<dyn PageLoader> = loader.clone();
        let (inos, chunks) = {
            let meta = self.meta.read();
            let mut chunks = 0;
            let mut inos: Vec<Ino> = crate::state::paged_maps(&meta.state.inodes, self.block_size)
                .map(|(&ino, i)| {
                    chunks += i.extents.chunk_count();
                    ino
                })
                .collect();
            inos.sort_unstable();
            (inos, chunks)
        };
        if inos.is_empty() {
            return;
        }
        let mut hand = self.evict_hand.lock();
        // The file the hand is in (or the next one), from its chunk.
        let mut file = inos.partition_point(|&ino| ino < hand.0) % inos.len();
        let mut chunk = if inos[file] == hand.0 { hand.1 } else { 0 };
        let mut freed = 0u64;
        let mut looked = 0usize;
        let mut spans = ChangedSpans::default();
        let done = |freed: u64| {
            let now = loader.cached_bytes();
            now <= target || start.saturating_sub(freed) <= target
        };
        while !done(freed) && looked <= 2 * chunks {
            let mut meta = self.meta.write();
            let held = std::time::Instant::now();
            // Freed once the lock is released: dropping a chunk frees its
            // extents, which readers need not wait for.
            let mut dropped = Vec::new();
            while held.elapsed() < LOCK_HOLD_STEP && !done(freed) && looked <= 2 * chunks {
                let ino = inos[file];
                spans.follow(ino, meta.state.changed_spans(ino));
                let next = match meta.state.inodes.get_mut(&ino) {
                    Some(inode) if inode.kind == FileKind::Regular => {
                        let source = Arc::new(PageSource {
                            ino,
                            loader: as_loader.clone(),
                        });
                        let before = freed;
                        // The rest of this hold in one step (it asks
                        // the clock every few chunks).
                        let max = (2 * chunks + 1).saturating_sub(looked);
                        let (next, seen, evicted) = inode.extents.evict(
                            chunk,
                            max,
                            &source,
                            |first, limit| spans.meet(first, limit),
                            |f| done(before + f) || held.elapsed() >= LOCK_HOLD_STEP,
                        );
                        looked += seen.max(1);
                        freed += evicted_bytes(&evicted);
                        dropped.push(evicted);
                        next
                    }
                    _ => {
                        looked += 1;
                        None
                    }
                };
                match next {
                    Some(at) => chunk = at,
                    None => {
                        file = (file + 1) % inos.len();
                        chunk = 0;
                    }
                }
            }
            *hand = (inos[file], chunk);
            self.lock_holds.record(HoldSite::EvictionStep, held);
            // Fair: readers queued during the step run before the next.
            meta.unlock_fair();
            loader.evicted(dropped.iter().map(|e| evicted_bytes(e)).sum());
            drop(dropped);
        }
    }
}

/// The changed key spans of the inode the sweep is in (see the module
/// doc), sorted and merged once per inode: a delta of 1% of a 10M-extent
/// file has 100k spans. The sweep holds `checkpointing`, so no checkpoint
/// takes them meanwhile and they only grow (changes between the sweep's
/// holds): those added since they were merged are looked through as they
/// are, and merged in again once there are many.
#[derive(Default)]
struct ChangedSpans {
    ino: Option<Ino>,
    merged: Vec<crate::types::KeySpan>,
    /// Spans merged, and those added since.
    merged_from: usize,
    added: Vec<crate::types::KeySpan>,
}

/// Spans added since the merge past which they are merged again.
const ADDED_SPANS_MERGED_AT: usize = 64;

impl ChangedSpans {
    fn follow(&mut self, ino: Ino, changed: Option<&[crate::types::KeySpan]>) {
        let Some(all) = changed else {
            *self = ChangedSpans::default();
            return;
        };
        let fresh = self.ino != Some(ino) || all.len() < self.merged_from;
        if fresh || all.len() - self.merged_from > ADDED_SPANS_MERGED_AT {
            self.ino = Some(ino);
            self.merged = crate::state::merged_spans(all);
            self.merged_from = all.len();
        }
        self.added.clear();
        self.added.extend_from_slice(&all[self.merged_from..]);
    }

    /// Whether keys `[first, limit)` meet a changed span: hold a key in
    /// it, or the span's start (a delta reads the chunk a span starts in
    /// even when the span is empty).
    fn meet(&self, first: u64, limit: u64) -> bool {
        let meets = |&(start, end): &crate::types::KeySpan| {
            start < limit && (first < end || first <= start)
        };
        // The merged spans are sorted and disjoint: only the last one
        // starting before `limit` can reach back to `first`.
        let before_limit = self.merged.partition_point(|&(start, _)| start < limit);
        before_limit
            .checked_sub(1)
            .is_some_and(|i| meets(&self.merged[i]))
            || self.added.iter().any(meets)
    }
}

fn evicted_bytes(evicted: &[crate::extent_map::Evicted]) -> u64 {
    evicted.iter().map(|e| e.charged()).sum()
}
