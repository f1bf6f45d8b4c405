//! Making changes durable: group commit of the journal, checkpoints that
//! trim it, and the shutdown that follows when either fails.
//!
//! Fault model: the device may lose or tear any write not followed by a
//! completed flush, and may fail any request. A failed journal commit or
//! checkpoint leaves memory ahead of the disk, so the volume shuts down: every
//! later call fails with [`Error::Shutdown`] and the next mount recovers from
//! what is durable. A checkpoint refused for space ([`Error::NoSpace`]: its
//! image spills to the data area and finds no room) writes nothing and
//! leaves memory consistent with the disk, so it is reported as ENOSPC and
//! the volume stays up.

use std::time::Instant;

use crate::checkpoint::{self, ChainEnd, DeltaCheckpoint, RecordHeader, SpillExtent};
use crate::extent_pages::{self, PagePlan};
use crate::limits::{
    CHAIN_DELTA_BYTES_DIVISOR, CHAIN_DELTA_BYTES_MIN, CHANGED_SPANS_MOST,
    COMMIT_BACKPRESSURE_THRESHOLDS, MAX_CHAIN_DELTAS,
};
use crate::lock_holds::{HoldSite, LOCK_HOLD_STEP};
use crate::mount_state::{Meta, VolumeInner};
use crate::types::MetaDelta;
use crate::{Error, Result};

/// A checkpoint writes a base, not a delta, once the chunks changed since
/// the last base (no page: never evicted) pass 1/this of the budget of
/// chunk bytes (`MountOptions::metadata_cache_bytes` less the maps'
/// shells, `DevicePages::budget`) and, with the clean chunks, all of it:
/// memory then stays within 1 + 1/this of that budget.
const UNPAGED_BUDGET_DIVISOR: u64 = 4;

/// The fewest bytes of chunks changing from paged to unpaged between two
/// looks of the checkpoint thread at the changed chunks (see
/// [`VolumeInner::ask_checkpoint_if_unpaged_may_pass`]), as a fraction of
/// the budget: a look walks every chunk, so looks come at most about 64
/// times per budget's worth of changed chunks.
pub(crate) const LOOK_BUDGET_DIVISOR: u64 = 64;

/// Changed key spans from which a checkpoint computes its delta in a
/// thread of its own while it flushes and appends to the journal (below,
/// a thread costs more than it saves). The delta reads one extent per
/// span, most of them cache and TLB misses: at 10k spans (1% of a
/// 1M-extent file changed) about 5 ms, as long as the rest together.
const PARALLEL_DELTA_SPANS_AT_LEAST: usize = 1024;

/// Most bytes of free space a base takes at a time to carve its extent
/// pages from (never more than the pages it has still to place).
const PAGE_RUN_BYTES: u64 = 1 << 20;
/// Most bytes allocated at once for index pages' second copies (no more
/// than one file's new index pages: a run per file with changed runs,
/// what it leaves going back after the base).
const INDEX_COPY_RUN_BYTES: u64 = 64 << 10;

/// Whether the key spans changed since the last checkpoint passed
/// [`CHANGED_SPANS_MOST`]: then a checkpoint is due, to give back their
/// memory, however empty the journal.
fn changed_spans_past_most(meta: &Meta) -> bool {
    meta.state.changed_span_count() >= CHANGED_SPANS_MOST
}

/// The first `len` bytes of `room` (which holds them), taken.
fn take_from(room: &mut (u64, u64), len: u64) -> u64 {
    let addr = room.0;
    *room = (addr + len, room.1 - len);
    addr
}

impl VolumeInner {
    /// Commits when enough uncommitted metadata has piled up: asks the
    /// commit thread (see [`crate::background_thread`]) at the commit
    /// threshold, and commits in this thread only once the records reach
    /// [`COMMIT_BACKPRESSURE_THRESHOLDS`] thresholds (or with no commit
    /// thread, at the threshold).
    pub fn commit_if_due(&self) -> Result<()> {
        let pending = self.meta.read().pending_bytes;
        // Looks first without `checkpointing`, which a running checkpoint
        // holds: the writer waits for it only when a base is due.
        if self.ask_checkpoint_if_unpaged_may_pass() && self.unpaged_over_budget_now() {
            self.checkpoint_if_due()?;
        }
        if pending < self.commit_threshold {
            return Ok(());
        }
        if self.commits_in_background()
            && pending < self.commit_threshold * COMMIT_BACKPRESSURE_THRESHOLDS
        {
            self.commit_request.ask();
            return Ok(());
        }
        self.commit()
    }

    /// Whether the chunks changed since the last base (they name no page,
    /// so memory alone holds them and the evictor cannot) are past a
    /// quarter of the budget of chunk bytes while the maps do not fit the
    /// budget: the evictor had to drop clean chunks since the last base
    /// (it makes room for the changed ones, so changed and clean together
    /// stay near its line and say little), or changed and clean chunks
    /// pass its line. Then the next checkpoint writes a base, which gives
    /// them pages; while everything fits a delta is cheaper (a 1% change
    /// of a 1M-extent file touches every chunk: 8 ms as a delta, 57 as a
    /// base). `unpaged` is
    /// [`crate::state::MetaState::unpaged_chunk_bytes`].
    fn unpaged_over_budget(&self, unpaged: impl FnOnce() -> u64) -> bool {
        let Some(loader) = &self.page_loader else {
            return false;
        };
        if self.sb.features_incompat & crate::superblock::INCOMPAT_EXTENT_PAGES == 0 {
            return false;
        }
        let (unpaged, budget) = (unpaged(), loader.budget());
        let line = crate::extent_cache::eviction_line(budget);
        unpaged > budget / UNPAGED_BUDGET_DIVISOR
            && (loader.evicted_since_base() || unpaged.saturating_add(loader.cached_bytes()) > line)
    }

    /// Changed chunks are held in memory until a checkpoint, and without
    /// one (a journal not yet half full) a session changing extents all
    /// over a large map would hold every chunk it touched, far past the
    /// budget: 509 MiB for a 1% change of a 10M-extent file (bench
    /// metadata-scale-10m, "+ change 1%"). So once the chunks that had a
    /// page and changed since the checkpoint thread's last look
    /// (`DevicePages::unpaged_so_far`) could have brought the changed
    /// chunks to the line, a change asks it to look again, and the thread
    /// writes a base when they are past it
    /// ([`VolumeInner::checkpoint_if_due`]). Costs a change two atomic
    /// loads (a few more until the first look).
    ///
    /// Returns whether the changes went another look interval (1/64 of
    /// the budget) past the ask while the thread has not looked yet (it
    /// writes a base meanwhile, which at 10M extents took 110-160 ms, about
    /// 20 now, long enough for a writer to touch every chunk, each first change
    /// copying a chunk the base's snapshot still holds): then a caller
    /// that holds no lock looks, and writes the base, itself (after the
    /// running checkpoint), as a commit does that finds the journal full.
    /// Measured at 10M extents (a fresh process reading every chunk, then
    /// changing 1%): with a quarter of the budget here the process peaked
    /// at 156 MiB, with 1/16 at 126 MiB, with 1/64 at 118-120 MiB, in the
    /// same 1.4 s.
    pub(crate) fn ask_checkpoint_if_unpaged_may_pass(&self) -> bool {
        use std::sync::atomic::Ordering;
        let Some(loader) = &self.page_loader else {
            return false;
        };
        let so_far = loader.unpaged_so_far();
        let due = self.unpaged_look_at.load(Ordering::Relaxed);
        if due == u64::MAX {
            let asked_at = self.unpaged_asked_at.load(Ordering::Relaxed);
            return so_far >= asked_at.saturating_add(loader.budget() / LOOK_BUDGET_DIVISOR);
        }
        // Before the first look (0): nothing changed at mount, so the
        // first is due at half of a quarter of the budget, as after a base.
        if so_far < due || (due == 0 && so_far < loader.budget() / UNPAGED_BUDGET_DIVISOR / 2) {
            return false;
        }
        // Asked once per look: the thread sets the next one.
        if self
            .unpaged_look_at
            .compare_exchange(due, u64::MAX, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.unpaged_asked_at.store(so_far, Ordering::Relaxed);
            self.checkpoint_request.ask();
        }
        false
    }

    /// The checkpoint thread's look at the changed chunks: whether they
    /// are past the line (see [`VolumeInner::unpaged_over_budget`]), and
    /// from what count of chunks changed the next change asks for another
    /// look. Walks a clone of the inode table (O(1) to take) without the
    /// metadata lock, so readers and writers go on meanwhile.
    fn unpaged_over_budget_now(&self) -> bool {
        use std::sync::atomic::Ordering;
        let Some(loader) = &self.page_loader else {
            return false;
        };
        let (inodes, block_size, so_far) = {
            let meta = self.meta.read();
            let so_far = loader.unpaged_so_far();
            (meta.state.inodes.clone(), meta.state.block_size, so_far)
        };
        let unpaged = crate::state::unpaged_chunk_bytes_of(&inodes, block_size);
        loader.set_map_shell_bytes(crate::state::paged_shell_bytes_of(&inodes, block_size));
        drop(inodes);
        let over = self.unpaged_over_budget(|| unpaged);
        // Before the base this may ask for: the clean chunks make room
        // for the changed ones meanwhile.
        loader.set_unpaged_seen(unpaged);
        // Until the changed chunks pass a quarter of the budget no base is
        // due; past it, loads alone can make one due (clean chunks count
        // too), so the looks come at the shortest interval. After the base
        // this look asks for, the changed chunks are paged: a quarter away
        // again. Half of what is left: a change counts the chunk it
        // unpages, and may also add an extent to a chunk changed before.
        let budget = loader.budget();
        let quarter = budget / UNPAGED_BUDGET_DIVISOR;
        let left = if over {
            quarter
        } else {
            quarter.saturating_sub(unpaged)
        };
        self.unpaged_look_at.store(
            so_far.saturating_add((left / 2).max(budget / LOOK_BUDGET_DIVISOR)),
            Ordering::Relaxed,
        );
        over
    }

    /// Asks the commit thread for a commit if the records `meta` queued
    /// reached the threshold. For paths that queue records without a
    /// caller to commit them (allocation and conversion inside the I/O
    /// path, asynchronous writes among them).
    pub(crate) fn ask_commit_if_due(&self, meta: &Meta) {
        self.ask_checkpoint_if_unpaged_may_pass();
        if meta.pending_bytes >= self.commit_threshold && self.commits_in_background() {
            self.commit_request.ask();
        }
    }

    /// The commit thread's job: a commit, unless one since the ask left
    /// fewer records than the threshold queued.
    pub(crate) fn commit_if_still_due(&self) -> Result<()> {
        if self.meta.read().pending_bytes < self.commit_threshold {
            return Ok(());
        }
        self.commit()
    }

    /// Group commit: makes every change applied so far durable, together with
    /// the data I/O that completed before them. Concurrent callers queue on
    /// the commit lock and the first one in writes everybody's records. A
    /// running checkpoint does not hold the commit lock while it writes, so
    /// a commit appends behind the checkpoint's journal start meanwhile.
    pub fn commit(&self) -> Result<()> {
        self.check_live()?;
        let mut commit = self.commit.lock();
        self.check_live()?;
        let (records, last_seq) = {
            let mut meta = self.meta.write();
            if !meta.pending.is_empty() {
                // A batch is written anyway: pending write times ride along.
                meta.log_write_times()?;
            }
            meta.pending_bytes = 0;
            (std::mem::take(&mut meta.pending), meta.next_seq - 1)
        };
        // The preflush makes the data whose completion these records describe
        // durable before the records can be; without records, it is the whole
        // of fsync.
        if let Err(e) = self.dev.flush() {
            let err = Error::device("journal commit: flush", e);
            if !records.is_empty() {
                self.shut_down(&err);
            }
            return Err(err);
        }
        if records.is_empty() {
            return Ok(());
        }
        if commit.journal.batch_bytes(&records) > commit.journal.free_bytes() {
            // Only a checkpoint frees the journal. Its snapshot must hold
            // these records, and nothing may be journaled after them before
            // they are: they go back to the front of the queue, and the
            // checkpoint (after any running one) takes everything queued.
            self.meta.write().requeue(records);
            drop(commit);
            return self.checkpoint();
        }
        let result = commit.journal.append(&*self.dev, &records).and_then(|_| {
            self.dev
                .flush()
                .map_err(|e| Error::device("journal commit: flush", e))
        });
        if let Err(err) = result {
            self.shut_down(&err);
            return Err(err);
        }
        let half_full = commit.journal.is_half_full();
        drop(commit);
        let spans_past_most = {
            let mut meta = self.meta.write();
            meta.mark_committed(last_seq);
            changed_spans_past_most(&meta)
        };
        if half_full || spans_past_most {
            self.checkpoint_request.ask();
        }
        Ok(())
    }

    /// Writes a checkpoint and trims the journal. One checkpoint at a time;
    /// commits go on meanwhile (see [`VolumeInner::write_checkpoint`]).
    pub(crate) fn checkpoint(&self) -> Result<()> {
        self.checkpoint_unless_done(|| Some(false))
    }

    /// The final checkpoint of a clean unmount. With extent pages it is a
    /// base, never a delta: the next mount then has no chain to apply and
    /// loads no chunk (pages are read on demand), so its time does not
    /// follow how much the session changed. The base writes pages only for
    /// the chunks changed since the last one, which the next base would
    /// write anyway.
    pub(crate) fn checkpoint_for_unmount(&self) -> Result<()> {
        let base = self.sb.features_incompat & crate::superblock::INCOMPAT_EXTENT_PAGES != 0;
        self.checkpoint_unless_done(|| Some(base))
    }

    /// The background checkpoint: skipped when, once its turn comes, the
    /// journal is no longer half full (a checkpoint that ran meanwhile
    /// freed it) and the changed chunks are within the budget (see
    /// [`VolumeInner::ask_checkpoint_if_unpaged_may_pass`]). A base when
    /// these are past their line: decided here, since the clean chunks
    /// may drop below theirs before the snapshot (the evictor runs
    /// meanwhile), and a delta would leave the changed chunks growing.
    /// Before a base, the evictor's sweep makes room for what the base's
    /// snapshot holds while it is written
    /// ([`VolumeInner::evict_before_base`]).
    pub(crate) fn checkpoint_if_due(&self) -> Result<()> {
        self.checkpoint_unless_done(|| {
            let over = self.unpaged_over_budget_now();
            if over {
                self.evict_before_base();
            }
            let spans_past_most = changed_spans_past_most(&self.meta.read());
            (over || spans_past_most || self.commit.lock().journal.is_half_full()).then_some(over)
        })
    }

    /// After the final checkpoint of a clean unmount: sets the superblock's
    /// clean-unmount mark, so the next mount need not scan the journal for
    /// later batches. Only while the journal holds nothing after the newest
    /// checkpoint (a commit that slipped in after it leaves the mark unset:
    /// the next mount scans), and never over a block 0 the mount found
    /// damaged; the next append clears it first.
    pub(crate) fn mark_clean_unmount(&self) -> Result<()> {
        self.check_live()?;
        let _no_checkpoint_running = self.checkpointing.lock();
        // Taken before the journal's lock (the order allocations take
        // them in). Whatever is allocated after this is logged, and the
        // append that writes it clears the mark, and the hint with it.
        let free_hint = if self.sb.features_compat & crate::superblock::COMPAT_FREE_SPACE_HINT != 0
        {
            self.meta.read().alloc.allocator().map_or(Vec::new(), |a| {
                a.largest_free(crate::superblock::FREE_HINT_MAX)
            })
        } else {
            Vec::new()
        };
        let mut commit = self.commit.lock();
        self.check_live()?;
        if commit.journal.used_bytes() != 0 || self.mounted_from_backup {
            return Ok(());
        }
        // The checkpoint the mark names flushed itself; this also covers its
        // supersede mark, so that nothing of it is still in flight when the
        // superblock says the session ended there.
        self.dev
            .flush()
            .map_err(|e| Error::device("clean unmount: flush", e))?;
        let mark = crate::superblock::CleanMark {
            generation: commit.generation,
            journal_start: commit.journal.tail(),
            journal_seq: commit.journal.next_seq(),
            journal_chain: commit.journal.chain(),
        };
        let marked = crate::superblock::Superblock {
            clean_mark: Some(mark),
            free_hint,
            ..self.sb.clone()
        };
        crate::superblock::write_superblock(&*self.dev, &marked)?;
        commit.journal.clear_clean_mark_first(&self.sb);
        Ok(())
    }

    /// Writes a checkpoint once none runs, unless `which` then says none
    /// is needed (`None`); `Some(true)` makes it a base.
    fn checkpoint_unless_done(&self, which: impl FnOnce() -> Option<bool>) -> Result<()> {
        self.check_live()?;
        let mut delta_ready = self.checkpointing.lock();
        self.check_live()?;
        let Some(base) = which() else {
            return Ok(());
        };
        let result = self.write_checkpoint(&mut delta_ready, base);
        match &result {
            // Refused before anything was written: the newest checkpoint
            // and the journal on disk are as they were, and memory holds
            // nothing they do not (see `write_checkpoint`).
            Err(Error::NoSpace { .. }) => {}
            Err(err) => self.shut_down(err),
            Ok(()) => {}
        }
        result
    }

    /// Takes a snapshot of the metadata under the metadata lock, then
    /// flushes, encodes and writes it with the lock released, so reads,
    /// overwrites and allocating writes go on meanwhile.
    ///
    /// The snapshot is a clone of [`crate::state::MetaState`], O(1) because
    /// the inode table and each inode's maps are copy-on-write: the lock is
    /// held for a time that does not grow with the metadata.
    ///
    /// The records the snapshot holds beyond the journal (the queue it
    /// empties) are journaled first, under the commit lock, so that the
    /// journal continues the current checkpoint without a gap through the
    /// snapshot's last record, and the new checkpoint's journal starts
    /// right after them. Then the commit lock is released: commits append
    /// records made after the snapshot behind that start while the image is
    /// written. A power cut before the new checkpoint is durable replays
    /// them on the old one (its journal runs through them); after, on the
    /// new one. The tail moves to the new start only once the new checkpoint
    /// is durable, so nothing the old one needs is overwritten before.
    /// When the queue does not fit in the journal, the journal stays still
    /// (commit lock held) until the checkpoint is durable, as commits could
    /// not append anyway.
    ///
    /// Space freed by records after the snapshot stays busy until a later
    /// checkpoint holds them (`release_busy` below releases only what this
    /// one covers).
    ///
    /// With `delta_ready` (the changes taken with the snapshot are those
    /// since the newest checkpoint's), the checkpoint is a delta from the
    /// newest when [`delta_is_due`] says so: appended to the chain in the
    /// current slot instead of a whole image in the other (never with
    /// `base`). The snapshot is dropped once written: while it lives, the
    /// first change to each extent chunk copies that chunk.
    fn write_checkpoint(&self, delta_ready: &mut bool, base: bool) -> Result<()> {
        let mut commit = self.commit.lock();
        let (snapshot, changed, journal_seq, records, free_hint) = {
            let mut meta = self.meta.write();
            let held = Instant::now();
            // Write times still in core go into the snapshot too.
            meta.log_write_times()?;
            meta.pending_bytes = 0;
            // Taken first, so the clone carries an empty set.
            let changed = meta.state.take_changed();
            let taken = (
                meta.state.clone(),
                changed,
                meta.next_seq,
                std::mem::take(&mut meta.pending),
                self.free_hint_at_snapshot(&meta),
            );
            self.lock_holds.record(HoldSite::CheckpointSnapshot, held);
            taken
        };
        // Outside every lock but `checkpointing` (and `commit`, until the
        // records are journaled): the diff walks only what changed, but
        // that may be a lot, so a large one runs while the device flushes
        // and takes the journal batch. Whatever this checkpoint does, the
        // next is whole unless it ends well (below).
        let wants_delta = std::mem::take(delta_ready) && !base;
        let spans: usize = changed.values().map(|c| c.spans.len()).sum();
        let (delta, journaled) = std::thread::scope(|scope| -> Result<_> {
            let beside = (wants_delta && spans >= PARALLEL_DELTA_SPANS_AT_LEAST)
                .then(|| {
                    std::thread::Builder::new()
                        .name("iomapfs-delta".to_string())
                        .spawn_scoped(scope, || snapshot.delta_since(&changed))
                        // No thread to be had: computed below instead.
                        .ok()
                })
                .flatten();
            // After the snapshot, so it covers the data of every write whose
            // completion the snapshot records (and the journal batch below).
            self.dev
                .flush()
                .map_err(|e| Error::device("checkpoint: flush", e))?;
            let journaled = records.is_empty()
                || commit.journal.batch_bytes(&records) <= commit.journal.free_bytes();
            if !records.is_empty() && journaled {
                // No flush after: the checkpoint's own flush, or the preflush of
                // the next commit that appends behind it, makes it durable first.
                commit.journal.append(&*self.dev, &records)?;
            }
            let delta = match beside {
                Some(thread) => Some(
                    thread
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                ),
                None => wants_delta.then(|| snapshot.delta_since(&changed)),
            };
            Ok((delta, journaled))
        })?;
        debug_assert!(!journaled || commit.journal.next_seq() == journal_seq);
        let (generation, journal_start, journal_chain) = (
            commit.generation + 1,
            commit.journal.head(),
            commit.journal.chain(),
        );
        let (older_slot, older_chain) = (commit.slot, commit.chain);
        let held = if journaled {
            drop(commit);
            None
        } else {
            Some(commit)
        };
        // Chunks changed since the last base are in memory only and
        // cannot be evicted: past a quarter of the budget, while the
        // chunks in memory are past all of it, a base gives them pages
        // (and makes them evictable). Within the budget a delta is still
        // cheaper: the 1% change of the metadata-scale bench touches every
        // chunk of a 1 M-extent file (30 MiB of chunks, under the 64 MiB
        // default), and a base for it costs 57 ms instead of 8.
        // An index page with a damaged copy leaves the slots' bases one
        // bad block from lost: only bases write it again, so none waits
        // for the delta policy.
        let copies_to_rewrite = match &held {
            Some(commit) => !commit.index_to_rewrite.is_empty(),
            None => !self.commit.lock().index_to_rewrite.is_empty(),
        };
        let delta = delta.filter(|delta| {
            !copies_to_rewrite
                && delta_is_due(&self.sb, &older_chain, delta)
                && !self.unpaged_over_budget(|| snapshot.unpaged_chunk_bytes())
        });
        // `Some(spill)` for a new base: the spill extents that replace the
        // slot's old ones; and with extent pages, the pages it wrote.
        let written = match delta {
            Some(delta) => {
                let ckpt = DeltaCheckpoint {
                    generation,
                    journal_start,
                    journal_seq,
                    journal_chain,
                    delta,
                };
                checkpoint::write_delta(
                    &*self.dev,
                    &self.sb,
                    older_slot,
                    &older_chain,
                    &ckpt,
                    &free_hint,
                )
                .map(|chain| (older_slot, chain, None, None))
            }
            None => {
                let header = RecordHeader {
                    generation,
                    journal_start,
                    journal_seq,
                    journal_chain,
                };
                let slot = checkpoint::other_slot(older_slot);
                if self.sb.features_incompat & crate::superblock::INCOMPAT_EXTENT_PAGES != 0 {
                    // `checkpointing` keeps the tables as they are until
                    // this base is durable.
                    let listing = |commit: &crate::mount_state::CommitState| {
                        (
                            commit.pages.clone(),
                            commit.index.clone(),
                            commit.index_to_rewrite.clone(),
                        )
                    };
                    let (tables, index, rewrite) = match &held {
                        Some(commit) => listing(commit),
                        None => listing(&self.commit.lock()),
                    };
                    let listed = extent_pages::ListedPages::of(tables.iter().map(|t| &**t));
                    let listed_index =
                        (self.sb.features_incompat & crate::superblock::INCOMPAT_PAGE_INDEX != 0)
                            .then(|| {
                                extent_pages::ListedIndex::of(
                                    tables.iter().map(|t| &**t).zip(index.iter().map(|i| &**i)),
                                )
                                .rewriting(&rewrite)
                            });
                    self.write_paged_base(
                        &snapshot,
                        slot,
                        header,
                        &listed,
                        listed_index.as_ref(),
                        &free_hint,
                    )
                    .map(|(chain, spill, plan)| (slot, chain, Some(spill), Some(plan)))
                } else {
                    snapshot
                        .encode_image_after(checkpoint::CHECKPOINT_HEADER_LEN)
                        .and_then(|record| self.write_base(slot, header, record, &free_hint))
                        .map(|(chain, spill)| (slot, chain, Some(spill), None))
                }
            }
        };
        let (slot, chain, new_spill, new_pages) = match written {
            Ok(written) => written,
            Err(err @ Error::NoSpace { .. }) => {
                // Nothing was written. Records the journal could not take
                // go back to the queue, in front of those logged since (the
                // commit lock, still held, kept them out of the journal);
                // `delta_ready` is cleared, so the next checkpoint is whole.
                if held.is_some() {
                    self.meta.write().requeue(records);
                }
                return Err(err);
            }
            Err(err) => return Err(err),
        };
        // Durable: the chunks written now name their pages, and are not
        // written again until they change.
        // With the loader, they are clean: counted against the budget of
        // chunk bytes, and evictable.
        if let Some(plan) = &new_pages {
            let loader = self
                .page_loader
                .clone()
                .map(|l| l as std::sync::Arc<dyn crate::extent_map::PageLoader>);
            plan.record_written(&snapshot, loader.as_ref())?;
            // The chunks' shells, as the snapshot has them (the pages both
            // slots list are counted once the tables are installed).
            if let Some(loader) = &self.page_loader {
                loader.set_map_shell_bytes(crate::state::paged_shell_bytes_of(
                    &snapshot.inodes,
                    snapshot.block_size,
                ));
            }
        }
        let deltas = self.sb.features_incompat & crate::superblock::INCOMPAT_DELTA_CHECKPOINTS != 0;
        *delta_ready = deltas;
        // Before anything else: while it lives, each change copies what
        // it touches.
        drop(snapshot);
        let mut commit = held.unwrap_or_else(|| self.commit.lock());
        commit.slot = slot;
        commit.generation = generation;
        commit.chain = chain;
        let replaced_spill =
            new_spill.map(|spill| std::mem::replace(&mut commit.spills[slot], spill));
        // Pages the base this one replaced listed, that neither it nor the
        // other slot's base lists.
        let (freed_pages, shared_page_bytes) = match new_pages {
            Some(plan) => {
                if let Some(loader) = &self.page_loader {
                    // Whoever decided on this base (a look, the chain's
                    // rule, an unmount), it paged the changed chunks: the
                    // next look counts what changed since.
                    loader.set_unpaged_seen(0);
                    loader.based();
                }
                let replaced =
                    std::mem::replace(&mut commit.pages[slot], std::sync::Arc::new(plan.table));
                let replaced_index =
                    std::mem::replace(&mut commit.index[slot], std::sync::Arc::new(plan.index));
                let other = checkpoint::other_slot(slot);
                let after = extent_pages::after_base(
                    [&replaced, &commit.pages[slot], &commit.pages[other]],
                    [&replaced_index, &commit.index[slot], &commit.index[other]],
                    self.sb.block_size(),
                );
                if !commit.index_to_rewrite.is_empty() {
                    let listed = extent_pages::listed_index_addrs(&commit.index);
                    commit.index_to_rewrite.retain(|addr| listed.contains(addr));
                }
                if let Some(loader) = &self.page_loader {
                    loader.set_listed_pages(extent_pages::listed_pages(&commit.pages));
                }
                (after.freed, Some(after.shared_bytes))
            }
            None => (Vec::new(), None),
        };
        if journaled {
            commit.journal.set_tail(journal_start);
        } else {
            commit
                .journal
                .restart_at(journal_start, journal_seq, journal_chain);
        }
        // From here on, losing the new checkpoint is damage, not a torn
        // write: the mark on the record before it tells the next mount so.
        // Before the space the snapshot freed is reused, so that no
        // rollback the mark would not report can show it.
        checkpoint::mark_superseded(
            &*self.dev,
            &self.sb,
            older_slot,
            older_chain.last_offset,
            older_chain.generation,
        )?;
        // A delta leaves both slots' sets as they were.
        let replaced_slot_bytes = replaced_spill
            .is_some()
            .then(|| commit.replaced_slot_bytes(&self.sb));
        {
            let mut meta = self.meta.write();
            let held = Instant::now();
            meta.mark_committed(journal_seq - 1);
            if let Some(shared) = shared_page_bytes {
                meta.shared_page_bytes = shared;
            }
            if let Some(replaced) = replaced_slot_bytes {
                meta.replaced_slot_bytes = replaced;
            }
            self.lock_holds.record(HoldSite::CheckpointInstall, held);
        }
        // The journal is done with: commits need not wait for the rest.
        drop(commit);
        // Then space is given back, in bounded steps with the lock
        // released in between: every reader and writer waits while it is
        // held, and the backlog can be large (a base replaced after much
        // change frees thousands of pages; after a mass punch, the busy
        // ranges of the metadata-scale bench are 200k: 150 ms in one hold).
        // Space not yet given back only makes an allocation wait for it or
        // fail over to the checkpoint that ends with it released.
        //
        // First what is free for good now: the spill extents of the
        // checkpoint the new base replaced in its slot (superseded before
        // this one began, its record gone), and the pages only it listed.
        let mut freed = replaced_spill.into_iter().flatten().chain(freed_pages);
        self.in_short_holds(|meta| {
            let Some((addr, len)) = freed.next() else {
                return Ok(false);
            };
            meta.alloc
                .free_now(addr, len)
                .map_err(|reason| Error::corrupt("free space", addr, reason))?;
            meta.spilled_bytes -= len;
            Ok(true)
        })?;
        // Then the space the snapshot's records freed.
        self.in_short_holds(|meta| Ok(meta.alloc.release_busy_at_most(journal_seq - 1, 1)))
    }

    /// The free-space hint of a checkpoint whose snapshot is taken under
    /// `meta`'s lock (with [`crate::superblock::COMPAT_CHECKPOINT_FREE_HINT`]):
    /// the largest free ranges of the installed allocator, none while
    /// mount's scan runs. Free, not busy: what records up to the snapshot
    /// freed stays busy until a later checkpoint is durable, so no range
    /// here is used by the snapshot, nor by either slot's pages and spill
    /// extents (allocated until neither lists them). The pages and spill
    /// extents this checkpoint allocates after the snapshot are cut out
    /// before it is written ([`VolumeInner::write_paged_base`],
    /// [`VolumeInner::write_base`]).
    fn free_hint_at_snapshot(&self, meta: &Meta) -> Vec<(u64, u64)> {
        if self.sb.features_compat & crate::superblock::COMPAT_CHECKPOINT_FREE_HINT == 0 {
            return Vec::new();
        }
        meta.alloc.installed().map_or(Vec::new(), |a| {
            a.largest_free(crate::superblock::FREE_HINT_MAX)
        })
    }

    /// Calls `step` until it returns false, with the metadata lock held
    /// exclusive for at most about [`LOCK_HOLD_STEP`] at a time and
    /// released fairly in between (whoever queued meanwhile runs first).
    /// Timed, not counted: the cost of a step varies a hundredfold with
    /// the size of what it changes and with the caches.
    fn in_short_holds(&self, mut step: impl FnMut(&mut Meta) -> Result<bool>) -> Result<()> {
        loop {
            let mut meta = self.meta.write();
            let held = Instant::now();
            let mut more = step(&mut meta)?;
            while more && held.elapsed() < LOCK_HOLD_STEP {
                more = step(&mut meta)?;
            }
            self.lock_holds
                .record(HoldSite::CheckpointReleaseStep, held);
            meta.unlock_fair();
            if !more {
                return Ok(());
            }
        }
    }

    /// Writes a new base to `slot`: `record`, an image encoded after
    /// [`checkpoint::CHECKPOINT_HEADER_LEN`] bytes of room, spilled to
    /// extents of the data area when it does not fit the slot; returns the
    /// chain and those extents. Fails with [`Error::NoSpace`], writing
    /// nothing and keeping no space, when the data area cannot hold the
    /// image (or the slot its table of extents). `free_hint` goes with the
    /// record, less the spill extents.
    fn write_base(
        &self,
        slot: usize,
        header: RecordHeader,
        record: Vec<u8>,
        free_hint: &[(u64, u64)],
    ) -> Result<(ChainEnd, Vec<SpillExtent>)> {
        let image_len = (record.len() - checkpoint::CHECKPOINT_HEADER_LEN) as u64;
        if !checkpoint::must_spill(&self.sb, image_len) {
            let chain = checkpoint::write_base_record(
                &*self.dev, &self.sb, slot, header, record, free_hint,
            )?;
            return Ok((chain, Vec::new()));
        }
        let spill = self.allocate_spill(image_len)?;
        // Allocated after the snapshot, maybe from the hint's ranges, and
        // listed by this record: never free while it is the fallback.
        let free_hint = crate::free_space::hint_without(free_hint, &spill);
        match checkpoint::write_spilled_base_record(
            &*self.dev, &self.sb, slot, header, &record, &spill, &free_hint,
        ) {
            Ok(chain) => Ok((chain, spill)),
            Err(err) => {
                if matches!(err, Error::NoSpace { .. }) {
                    self.free_spill(&spill)?;
                }
                Err(err)
            }
        }
    }

    /// Writes a base with extent pages to `slot`: a page for each chunk of
    /// `snapshot`'s paged files that names none `listed` holds (then a
    /// flush), then the root listing
    /// them and the pages the other chunks name, spilled if it does not fit
    /// the slot. Returns the chain, the spill extents and the plan (whose
    /// new pages the caller records once the base is durable). Refused
    /// for space ([`Error::NoSpace`]), it gives back what it allocated; the
    /// pages written are in free space, which no checkpoint lists.
    /// `free_hint` goes with the root, less the pages it lists.
    fn write_paged_base(
        &self,
        snapshot: &crate::state::MetaState,
        slot: usize,
        header: RecordHeader,
        listed: &extent_pages::ListedPages<'_>,
        listed_index: Option<&extent_pages::ListedIndex<'_>>,
        free_hint: &[(u64, u64)],
    ) -> Result<(ChainEnd, Vec<SpillExtent>, PagePlan)> {
        // Pages are carved from runs of free space, one allocation (one
        // hold of the metadata lock, which every read and write takes)
        // per run instead of per page: a base at 10M extents writes about
        // 2000 pages, and allocating them one by one was a quarter of its
        // planning time. A run is never more than the pages still to
        // place, so the base holds no room its reserve does not cover
        // (writeback of reserved data allocates without checking); room
        // a run has left that the next page does not fit goes back at
        // once.
        //
        // Index pages' second copies come from runs of their own, far
        // from the first copies (see `index_copy_hint`).
        let mut placed: Vec<(u64, u64)> = Vec::new();
        let mut room = (0u64, 0u64);
        let mut copy_room = (0u64, 0u64);
        let mut pages_end = None;
        let planned = extent_pages::plan_pages(
            snapshot,
            self.sb.crc_seed(),
            listed,
            listed_index,
            |len, ahead, what| {
                // `ahead` counts what goes to the same room: pages and
                // first copies, or second copies.
                let addr = match what {
                    extent_pages::Placed::Page => {
                        if room.1 < len {
                            let run = self.allocate_page_run(len, ahead, pages_end)?;
                            // Only now: refused, the room left still takes
                            // the block-sized pages the plan falls back to.
                            let left = std::mem::replace(&mut room, run);
                            if left.1 > 0 {
                                self.free_spill(&[left])?;
                            }
                        }
                        pages_end = Some(room.0 + len);
                        take_from(&mut room, len)
                    }
                    extent_pages::Placed::IndexCopy { of } => self.place_index_copy(
                        &mut copy_room,
                        len,
                        ahead.min(INDEX_COPY_RUN_BYTES),
                        of,
                    )?,
                };
                placed.push((addr, len));
                Ok(addr)
            },
            |pages| checkpoint::write_pages_unflushed(&*self.dev, pages),
        );
        let left: Vec<(u64, u64)> = [room, copy_room].into_iter().filter(|r| r.1 > 0).collect();
        if !left.is_empty() {
            self.free_spill(&left)?;
        }
        let written = planned.and_then(|plan| {
            checkpoint::flush_pages(&*self.dev)?;
            let root = snapshot.encode_root_after(
                checkpoint::CHECKPOINT_HEADER_LEN,
                &plan.table,
                listed_index.is_some().then_some(&plan.index),
            )?;
            // The pages were planned after the snapshot, maybe in the
            // hint's ranges: they are cut out (those planned before were
            // not free at the snapshot).
            let free_hint = crate::free_space::hint_without(free_hint, &plan.written);
            let (mut chain, spill) = self.write_base(slot, header, root, &free_hint)?;
            chain.base_bytes += checkpoint::listed_page_bytes(&self.sb, &plan.table, &plan.index);
            Ok((chain, spill, plan))
        });
        if let Err(Error::NoSpace { .. }) = &written {
            self.free_spill(&placed)?;
        }
        written
    }

    /// Places the second copy (`len`, one block) of the index page whose
    /// first copy is at `of`: from `room` (a run kept for second copies)
    /// if its next block is [`VolumeInner::index_copies_apart`] from `of`,
    /// else from a new run of up to `ahead` bytes looked for at
    /// [`VolumeInner::index_copy_hint`], then from the data area's start.
    /// Best effort: where no free run is that far, the copy goes where
    /// there is room (beside the first copy rather than no base).
    fn place_index_copy(
        &self,
        room: &mut (u64, u64),
        len: u64,
        ahead: u64,
        of: u64,
    ) -> Result<u64> {
        let apart = self.index_copies_apart();
        let near = |addr: u64| addr.abs_diff(of) < apart;
        if room.1 < len || near(room.0) {
            let mut found = None;
            for hint in [self.index_copy_hint(of), self.sb.layout.data.start] {
                match self.allocate_page_run(len, ahead, Some(hint)) {
                    Ok(run) if !near(run.0) => {
                        found = Some(run);
                        break;
                    }
                    Ok(run) => self.free_spill(&[run])?,
                    Err(Error::NoSpace { .. }) => break,
                    Err(e) => return Err(e),
                }
            }
            let run = match found {
                Some(run) => Some(run),
                None if room.1 >= len => None,
                None => Some(self.allocate_page_run(len, ahead, None)?),
            };
            if let Some(run) = run {
                let left = std::mem::replace(room, run);
                if left.1 > 0 {
                    self.free_spill(&[left])?;
                }
            }
        }
        Ok(take_from(room, len))
    }

    /// Where to look for free space for the second copy of the index
    /// page whose first copy is at `first`: the same offset in the other
    /// half of the data area, so that one failed region of the device
    /// (a sector, a flash page or erase block, one write command) takes
    /// at most one copy.
    fn index_copy_hint(&self, first: u64) -> u64 {
        let data = &self.sb.layout.data;
        let half = (data.len / 2).next_multiple_of(self.sb.block_size());
        data.start + (first.saturating_sub(data.start) + half) % data.len.max(1)
    }

    /// How far apart an index page's two copies must be: 1 MiB (past any
    /// sector, flash page or erase block), or a quarter of a smaller data
    /// area.
    fn index_copies_apart(&self) -> u64 {
        (1u64 << 20).min(self.sb.layout.data.len / 4)
    }

    /// Allocates a run of free space (never busy space, as
    /// [`VolumeInner::allocate_spill`]) to carve extent pages from, near
    /// `hint`: `ahead` (the pages still to place) up to
    /// [`PAGE_RUN_BYTES`] if a free extent is that long, else the longest,
    /// refused for space unless it holds a page of `len` bytes. Counted as
    /// metadata bytes; the caller frees what it does not use.
    fn allocate_page_run(&self, len: u64, ahead: u64, hint: Option<u64>) -> Result<(u64, u64)> {
        let bs = self.sb.block_size();
        let want = ahead.min(PAGE_RUN_BYTES.next_multiple_of(bs)).max(len);
        let mut meta = self.meta_for_allocation();
        match meta.alloc.allocator_mut()?.alloc(want, hint) {
            Some((addr, got)) if got >= len => {
                meta.spilled_bytes += got;
                Ok((addr, got))
            }
            got => {
                if let Some((addr, got)) = got {
                    meta.alloc
                        .free_now(addr, got)
                        .map_err(|reason| Error::corrupt("free space", addr, reason))?;
                }
                Err(Error::NoSpace {
                    what: format!("metadata (an extent page of {len} bytes)"),
                    needed: len,
                    available: meta.alloc.allocator()?.free_bytes(),
                })
            }
        }
    }

    /// Allocates [`checkpoint::spill_bytes`] of `image_len` from free space
    /// (never busy space: it may still hold what the checkpoint on disk
    /// and the journal after it refer to), in at most as many extents as
    /// the slot's table lists. All or nothing.
    fn allocate_spill(&self, image_len: u64) -> Result<Vec<SpillExtent>> {
        let want = checkpoint::spill_bytes(&self.sb, image_len);
        let max_extents = checkpoint::max_spill_extents(&self.sb);
        let mut spill: Vec<SpillExtent> = Vec::new();
        let mut left = want;
        let mut meta = self.meta_for_allocation();
        while left > 0 {
            let hint = spill.last().map(|&(addr, len)| addr + len);
            let got = if spill.len() < max_extents {
                meta.alloc.allocator_mut()?.alloc(left, hint)
            } else {
                None
            };
            match got {
                Some((addr, len)) => {
                    spill.push((addr, len));
                    left -= len;
                }
                None => {
                    let available = meta.alloc.allocator()?.free_bytes() + (want - left);
                    for &(addr, len) in &spill {
                        meta.alloc
                            .free_now(addr, len)
                            .map_err(|reason| Error::corrupt("free space", addr, reason))?;
                    }
                    return Err(Error::NoSpace {
                        what: format!(
                            "metadata (a checkpoint image of {image_len} bytes spilled to the data area, in at most {max_extents} extents)"
                        ),
                        needed: want,
                        available,
                    });
                }
            }
        }
        meta.spilled_bytes += want;
        Ok(spill)
    }

    /// Gives back spill extents [`VolumeInner::allocate_spill`] (or pages
    /// [`VolumeInner::allocate_page_run`]) returned that no checkpoint on disk
    /// lists.
    fn free_spill(&self, spill: &[SpillExtent]) -> Result<()> {
        let mut meta = self.meta.write();
        for &(addr, len) in spill {
            meta.alloc
                .free_now(addr, len)
                .map_err(|reason| Error::corrupt("free space", addr, reason))?;
            meta.spilled_bytes -= len;
        }
        Ok(())
    }
}

/// Whether `delta` goes after `chain` rather than a whole image in the
/// other slot: the chain holds fewer than [`MAX_CHAIN_DELTAS`] deltas, its
/// deltas with this one take at most 1/[`CHAIN_DELTA_BYTES_DIVISOR`] of its
/// base's bytes (or [`CHAIN_DELTA_BYTES_MIN`]), and it fits in the slot.
/// Mount then reads at most 1 + 1/[`CHAIN_DELTA_BYTES_DIVISOR`] times the
/// bytes of a whole image (plus that minimum);
/// a checkpoint writes a whole image at most once per that many bytes of
/// deltas, so its cost follows what changed.
fn delta_is_due(sb: &crate::superblock::Superblock, chain: &ChainEnd, delta: &MetaDelta) -> bool {
    let len = checkpoint::delta_record_len(delta);
    chain.deltas < MAX_CHAIN_DELTAS
        && chain.delta_bytes + len
            <= (chain.base_bytes / CHAIN_DELTA_BYTES_DIVISOR).max(CHAIN_DELTA_BYTES_MIN)
        && checkpoint::delta_fits(sb, chain, len)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use blockdev::memory::{FaultOp, FaultRule, MemDevice, Survival};
    use blockdev::BlockDevice;

    use crate::checkpoint::read_checkpoint;
    use crate::limits::{
        CHANGED_SPANS_MOST, COMMIT_BACKPRESSURE_THRESHOLDS, COMMIT_THRESHOLD_BYTES_MOST,
        COMMIT_THRESHOLD_DIVISOR, RECORD_BYTES_ESTIMATE,
    };
    use crate::types::{Extent, Ino};
    use crate::{FormatOptions, OpenFlags, Volume};

    fn write_file(vol: &Volume, path: &str) {
        let f = create_file(vol, path);
        f.pwrite(&[7u8; 5000], 0).unwrap();
        f.fsync().unwrap();
    }

    /// While a checkpoint's slot write is held, the journal the old
    /// checkpoint needs stays live (tail unmoved) even as commits append
    /// behind the new start; once the checkpoint is durable, the tail is
    /// the new checkpoint's `journal_start`.
    #[test]
    fn the_journal_tail_moves_only_once_the_checkpoint_is_durable() {
        let mem = Arc::new(MemDevice::with_caps(16 << 20, 512, true, false));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Arc::new(Volume::open(dev).unwrap());
        write_file(&vol, "/before");
        let journal = |vol: &Volume| {
            let c = vol.inner.commit.lock();
            (c.journal.tail(), c.journal.head(), c.slot)
        };
        let (old_tail, old_head, old_slot) = journal(&vol);
        assert_ne!(old_tail, old_head, "the fsync left batches in the journal");

        let sb = vol.inner.sb.clone();
        // The new checkpoint is a delta after the chain in the same slot.
        let chain = vol.inner.commit.lock().chain;
        let slot_region = sb.layout.checkpoint_slots[old_slot];
        let held = mem.pause_after(
            FaultRule::new(FaultOp::Write)
                .range(slot_region.start + chain.next_offset..slot_region.end()),
        );
        let checkpointer = {
            let vol = vol.clone();
            thread::spawn(move || vol.checkpoint())
        };
        held.wait_reached();
        write_file(&vol, "/during");
        let (tail, head, _) = journal(&vol);
        assert_eq!(
            tail, old_tail,
            "the tail moved while the checkpoint that frees the journal was not durable"
        );
        assert_ne!(head, old_head, "the fsync during the checkpoint appended");
        held.resume();
        checkpointer.join().unwrap().unwrap();
        let (tail, _, slot) = journal(&vol);
        assert_eq!(slot, old_slot);
        assert_eq!(vol.inner.commit.lock().chain.deltas, chain.deltas + 1);
        let written = read_checkpoint(&*mem, &sb, slot).unwrap();
        assert_eq!(
            tail, written.journal_start,
            "after the checkpoint the tail is its journal start"
        );
        assert_ne!(tail, old_tail);
    }

    /// The commit that leaves the journal half full asks for a checkpoint,
    /// and the thread writes it (a newer generation on disk, the journal's
    /// space back) without any commit having found the journal full.
    #[test]
    fn a_commit_that_leaves_the_journal_half_full_gets_a_background_checkpoint() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let inner = &vol.inner;
        let generation = inner.commit.lock().generation;
        let journal = inner.sb.layout.journal.len;
        let mut made = 0u64;
        while inner.checkpoint_request.asks() == 0 {
            let commit = inner.commit.lock();
            assert!(
                commit.generation == generation && !commit.journal.is_half_full(),
                "the journal reached half full ({} of {journal} bytes, {made} commits) \
                 without asking for a checkpoint",
                commit.journal.used_bytes()
            );
            drop(commit);
            vol.mkdir(&format!("/d{made}")).unwrap();
            inner.commit().unwrap();
            made += 1;
        }
        inner.checkpoint_request.wait_idle();
        let commit = inner.commit.lock();
        assert_eq!(commit.generation, generation + 1, "after {made} commits");
        assert!(!commit.journal.is_half_full());
        // A delta after the chain in the same slot, or a whole image in
        // the other.
        let written = read_checkpoint(&*dev, &inner.sb, commit.slot).unwrap();
        assert_eq!(written.generation, generation + 1);
    }

    fn direct_file(vol: &Volume) -> crate::File {
        let f = vol
            .open_file(
                "/f",
                OpenFlags {
                    create: true,
                    direct: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        f.pwrite(&vec![1u8; 4096], 40 << 20).unwrap(); // EOF past the holes
        f
    }

    /// Writes one block into each of the first 4000 holes of `f` (every
    /// other block: each write allocates), asserting after each that the
    /// records queued stay below `limit`; `what` names the case.
    fn fill_holes_keeping_queue_below(
        f: &crate::File,
        inner: &crate::mount_state::VolumeInner,
        limit: u64,
        what: &str,
    ) {
        let block = vec![7u8; 4096];
        for i in 0..4000u64 {
            f.pwrite(&block, 2 * i * 4096).unwrap();
            let pending = inner.meta.read().pending_bytes;
            assert!(
                pending < limit,
                "after {} allocating writes{what}, {pending} bytes of records queued (limit {limit})",
                i + 1
            );
        }
    }

    /// Without a commit thread, direct writes that allocate, never synced,
    /// commit in the writer once their records reach the commit threshold
    /// instead of queueing without bound.
    #[test]
    fn unsynced_allocating_direct_writes_commit_past_the_threshold() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let opts = crate::MountOptions {
            background_commits: false,
            ..crate::MountOptions::default()
        };
        let vol = Volume::open_with(dev.clone(), &opts).unwrap();
        let f = direct_file(&vol);
        fill_holes_keeping_queue_below(&f, &vol.inner, vol.inner.commit_threshold, "");
    }

    /// Once the last `Volume` handle is gone its commit thread is stopped,
    /// but open files still write: with no commit thread, the change that
    /// reaches the threshold must commit in its caller (the contract of
    /// `commit_if_due`), not ask a thread that no longer answers.
    #[test]
    fn after_the_volume_is_dropped_writers_commit_at_the_threshold() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let f = direct_file(&vol);
        let inner = vol.inner.clone();
        drop(vol);
        fill_holes_keeping_queue_below(
            &f,
            &inner,
            inner.commit_threshold,
            " with no commit thread",
        );
    }

    /// With the commit thread (the default), the write whose records reach
    /// the threshold asks it for the commit; a writer never gets more than
    /// the backpressure limit ahead of it; once the thread is idle, what is
    /// queued is below the threshold again.
    #[test]
    fn the_commit_thread_commits_what_unsynced_direct_writes_queue() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let f = direct_file(&vol);
        let inner = &vol.inner;
        let threshold = inner.commit_threshold;
        let head = inner.commit.lock().journal.used_bytes();
        fill_holes_keeping_queue_below(&f, inner, threshold * COMMIT_BACKPRESSURE_THRESHOLDS, "");
        assert!(inner.commit_request.asks() > 0, "no commit was asked for");
        inner.commit_request.wait_idle();
        assert!(inner.meta.read().pending_bytes < threshold);
        assert!(
            inner.commit.lock().journal.used_bytes() > head,
            "nothing was committed"
        );
    }

    /// Asynchronous writes that allocate, never synced, have no caller to
    /// commit for them: the allocation and the conversion at completion
    /// ask the commit thread once the records reach the threshold.
    #[test]
    fn unsynced_async_allocating_writes_are_committed_in_the_background() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let f = direct_file(&vol);
        let inner = &vol.inner;
        let threshold = inner.commit_threshold;
        let mut q = vol.io_queue(8).unwrap();
        let mut done = Vec::new();
        for i in 0..4000u64 {
            let mut buf = blockdev::AlignedBuf::new(4096, 4096).unwrap();
            buf.fill(7);
            q.submit_write(&f, 2 * i * 4096, buf, i).unwrap();
            q.reap(1, &mut done).unwrap();
            for c in done.drain(..) {
                c.result.unwrap();
            }
        }
        while q.in_flight() > 0 {
            q.reap(1, &mut done).unwrap();
        }
        assert!(inner.commit_request.asks() > 0, "no commit was asked for");
        inner.commit_request.wait_idle();
        let pending = inner.meta.read().pending_bytes;
        assert!(
            pending < threshold,
            "{pending} bytes of records still queued (threshold {threshold})"
        );
    }

    /// A volume on a 2 GiB device with a 64 MiB journal, whose eighth
    /// (the threshold without its cap) is past [`COMMIT_THRESHOLD_BYTES_MOST`].
    fn large_journal_volume(opts: &crate::MountOptions) -> Volume {
        let dev = Arc::new(MemDevice::new(2 << 30, 512));
        let format = FormatOptions {
            journal_bytes: Some(64 << 20),
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), &format).unwrap();
        let vol = Volume::open_with(dev, opts).unwrap();
        let journal = vol.inner.sb.layout.journal.len;
        assert!(journal / COMMIT_THRESHOLD_DIVISOR > COMMIT_THRESHOLD_BYTES_MOST);
        vol
    }

    /// However large the journal, the records queued between commits stay
    /// below [`COMMIT_THRESHOLD_BYTES_MOST`]: they are memory outside the
    /// metadata budget.
    #[test]
    fn a_large_journal_commits_at_the_capped_threshold() {
        let vol = large_journal_volume(&crate::MountOptions {
            background_commits: false,
            ..crate::MountOptions::default()
        });
        let f = direct_file(&vol);
        for i in 0..2 * COMMIT_THRESHOLD_BYTES_MOST / RECORD_BYTES_ESTIMATE {
            f.fallocate(2 * i * 4096, 4096, false).unwrap();
            let pending = vol.inner.meta.read().pending_bytes;
            assert!(
                pending < COMMIT_THRESHOLD_BYTES_MOST,
                "after {} fallocates, {pending} bytes of records queued",
                i + 1
            );
        }
    }

    /// Changes that pass [`CHANGED_SPANS_MOST`] changed key spans get a
    /// checkpoint, which gives the spans' memory back, though the journal
    /// is far from half full.
    #[test]
    fn changed_spans_past_their_most_get_a_checkpoint() {
        let vol = large_journal_volume(&crate::MountOptions::default());
        let inner = &vol.inner;
        let generation = inner.commit.lock().generation;
        let f = direct_file(&vol);
        // A span per record, though the blocks make one extent.
        for i in 0..CHANGED_SPANS_MOST as u64 + 1000 {
            f.fallocate(i * 4096, 4096, false).unwrap();
        }
        // The commit that finds the spans past their most asks.
        inner.commit().unwrap();
        inner.checkpoint_request.wait_idle();
        let commit = inner.commit.lock();
        assert!(!commit.journal.is_half_full());
        assert!(commit.generation > generation, "no checkpoint ran");
        drop(commit);
        let spans = inner.meta.read().state.changed_span_count();
        assert!(spans < CHANGED_SPANS_MOST, "{spans} spans still kept");
    }

    /// A writer that gets [`COMMIT_BACKPRESSURE_THRESHOLDS`] thresholds
    /// ahead of a commit thread that is stuck (its journal write held)
    /// commits in its own thread: no write returns with that much queued.
    #[test]
    fn a_writer_far_ahead_of_the_commit_thread_commits_itself() {
        use std::sync::mpsc;
        use std::time::Duration;
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let f = direct_file(&vol);
        let inner = vol.inner.clone();
        let limit = inner.commit_threshold * COMMIT_BACKPRESSURE_THRESHOLDS;
        let journal = inner.sb.layout.journal;
        let held = dev.pause_after(
            FaultRule::new(FaultOp::Write).range(journal.start..journal.start + journal.len),
        );
        let (progress, seen) = mpsc::channel();
        let writer = {
            let inner = inner.clone();
            thread::spawn(move || {
                let block = vec![7u8; 4096];
                for i in 0..20_000u64 {
                    f.pwrite(&block, 2 * i * 4096).unwrap();
                    let after = inner.meta.read().pending_bytes;
                    if progress.send(after).is_err() {
                        return;
                    }
                }
            })
        };
        held.wait_reached();
        // The first journal write is held: the writer either blocks in
        // its own commit once it reaches the limit (no message comes while
        // held), or (wrongly) returns from writes with more queued.
        let mut worst = 0;
        while let Ok(after) = seen.recv_timeout(Duration::from_secs(2)) {
            worst = worst.max(after);
            if after >= limit {
                break;
            }
        }
        held.resume();
        assert!(
            worst >= inner.commit_threshold,
            "the writer queued only {worst} bytes while the commit thread was held: \
             the test did not reach the backpressure limit"
        );
        assert!(
            worst < limit,
            "a write returned with {worst} bytes of records queued (limit {limit}) \
             while the commit thread was stuck"
        );
        drop(seen);
        writer.join().unwrap();
    }

    // ---- extent pages -------------------------------------------------------

    fn paged_volume(dev: &Arc<MemDevice>) -> Volume {
        paged_volume_with(dev, false)
    }

    /// A volume with extent pages, listed in index pages if `page_index`.
    fn paged_volume_with(dev: &Arc<MemDevice>, page_index: bool) -> Volume {
        let opts = FormatOptions {
            extent_pages: true,
            page_index,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), &opts).unwrap();
        Volume::open(dev.clone()).unwrap()
    }

    /// Checkpoints (a directory made before each) until one is a base;
    /// returns its slot.
    fn checkpoint_a_base(vol: &Volume, tag: &str) -> usize {
        let mut i = 0;
        checkpoint_until_a_base(vol, || {
            vol.mkdir(&format!("/{tag}{i}")).unwrap();
            i += 1;
        })
    }

    /// Checkpoints, each after `change`, until one is a base; returns its
    /// slot.
    fn checkpoint_until_a_base(vol: &Volume, mut change: impl FnMut()) -> usize {
        loop {
            change();
            vol.checkpoint().unwrap();
            let commit = vol.inner.commit.lock();
            if commit.chain.deltas == 0 {
                return commit.slot;
            }
        }
    }

    /// `path` created (or opened) for writing.
    /// A checkpoint keeps nothing of its snapshot once written, base or
    /// delta: the maps share no chunk with it, so the first change after
    /// it copies none. The deltas still hold every change: a remount reads
    /// each write back.
    #[test]
    fn a_written_checkpoint_keeps_nothing_that_shares_the_maps() {
        let mem = Arc::new(MemDevice::with_caps(64 << 20, 512, true, false));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        vol.wait_free_space().unwrap();
        let ino = write_paged_file(&vol, "/f", 1);
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        // As a change reaches the map: through the inode table, which
        // copies the inode first if a snapshot shares the table's node.
        let shared = |vol: &Volume| {
            let mut meta = vol.inner.meta.write();
            meta.state.inodes.get_mut(&ino).unwrap().extents.is_shared()
        };
        let mut deltas = 0;
        for k in 0..6 {
            // Into the hole after extent 20k: a change every chunk-sized
            // stretch of the file, so each checkpoint writes something.
            f.pwrite(&[k as u8 + 2; 4096], (2 * 20 * k + 1) * 4096)
                .unwrap();
            f.fsync().unwrap();
            let before = vol.inner.commit.lock().chain.deltas;
            vol.checkpoint().unwrap();
            deltas += usize::from(vol.inner.commit.lock().chain.deltas > before);
            assert!(!shared(&vol), "after checkpoint {k}");
        }
        assert!(deltas >= 4, "{deltas} deltas of 6 checkpoints");
        // A power cut, not an unmount (whose base would end the chain):
        // the next mount applies the chain of deltas.
        let cut = Arc::new(mem.power_cut(&mut |_| Survival::Lost));
        drop((f, vol));
        let vol = Volume::open(cut).unwrap();
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        let mut buf = [0u8; 4096];
        for k in 0..6u64 {
            f.pread(&mut buf, (2 * 20 * k + 1) * 4096).unwrap();
            assert_eq!(buf, [k as u8 + 2; 4096], "write {k}");
        }
        vol.unmount().unwrap();
    }

    /// A delta of more spans than [`super::PARALLEL_DELTA_SPANS_AT_LEAST`]
    /// is computed beside the flush and the journal append: after a power
    /// cut, the chain it ends holds every write it covers.
    #[test]
    fn a_delta_computed_beside_the_journal_append_holds_every_change() {
        let mem = Arc::new(MemDevice::with_caps(256 << 20, 512, true, false));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev).unwrap();
        let holes = super::PARALLEL_DELTA_SPANS_AT_LEAST as u64 + 100;
        // Sixteen extents per hole filled below (allocated, unwritten: no
        // data to keep), so that the delta is a small part of the base.
        let extents = 16 * holes;
        let f = create_file(&vol, "/f");
        for k in 0..extents {
            f.fallocate(2 * k * 4096, 4096, false).unwrap();
        }
        f.fsync().unwrap();
        vol.checkpoint().unwrap();
        // One new extent between two others each: a span each.
        let stride = extents / holes;
        for k in 0..holes {
            f.pwrite(&[k as u8 | 2; 4096], (2 * stride * k + 1) * 4096)
                .unwrap();
        }
        let before = vol.inner.commit.lock().chain.deltas;
        vol.checkpoint().unwrap();
        assert_eq!(vol.inner.commit.lock().chain.deltas, before + 1);
        // Lost: what the checkpoint did not make durable (nothing after it).
        let cut = Arc::new(mem.power_cut(&mut |_| Survival::Lost));
        drop((f, vol));
        let vol = Volume::open(cut).unwrap();
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        let mut buf = [0u8; 4096];
        for k in 0..holes {
            f.pread(&mut buf, (2 * stride * k + 1) * 4096).unwrap();
            assert_eq!(buf, [k as u8 | 2; 4096], "write {k}");
        }
        vol.unmount().unwrap();
    }

    fn create_file(vol: &Volume, path: &str) -> crate::File {
        vol.open_file(
            path,
            OpenFlags {
                create: true,
                ..OpenFlags::default()
            },
        )
        .unwrap()
    }

    fn assert_fsck_clean(dev: &Arc<MemDevice>) {
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
    }

    fn pages_of(vol: &Volume, slot: usize) -> std::collections::BTreeSet<(u64, u64)> {
        crate::extent_pages::page_ranges(&vol.inner.commit.lock().pages[slot], 4096)
    }

    /// Extents of [`write_paged_file`]'s files: past the inline bound.
    const PAGED_FILE_EXTENTS: u64 = 170;

    /// Writes `path` as [`PAGED_FILE_EXTENTS`] blocks of `fill`, a hole
    /// after each (an extent each: more than the root keeps inline).
    fn write_paged_file(vol: &Volume, path: &str, fill: u8) -> Ino {
        let f = create_file(vol, path);
        f.truncate(0).unwrap();
        for k in 0..PAGED_FILE_EXTENTS {
            f.pwrite(&[fill; 4096], 2 * k * 4096).unwrap();
        }
        f.fsync().unwrap();
        let ino = vol.stat(path).unwrap().ino;
        assert!(
            vol.inner.meta.read().state.inodes[&ino].extents.len() as u64
                > crate::codec::inline_extents_max(4096) as u64
        );
        ino
    }

    /// The pages `slot`'s base lists for `ino`.
    fn file_pages(vol: &Volume, slot: usize, ino: Ino) -> std::collections::BTreeSet<(u64, u64)> {
        let commit = vol.inner.commit.lock();
        let table: crate::codec::PageTable = commit.pages[slot]
            .iter()
            .filter(|(i, _)| *i == ino)
            .cloned()
            .collect();
        crate::extent_pages::page_ranges(&table, 4096)
    }

    /// A base writes pages only for what changed, lists the rest as the
    /// base before it did, and frees a page only once neither slot's base
    /// lists it: a page the other slot's base still lists stays in use,
    /// so new data never lands on it and the volume mounts and checks
    /// clean.
    #[test]
    fn extent_pages_stay_in_use_while_either_slot_lists_them() {
        for page_index in [false, true] {
            extent_pages_stay_in_use_while_either_slot_lists_them_with(page_index);
        }
    }

    fn extent_pages_stay_in_use_while_either_slot_lists_them_with(page_index: bool) {
        let dev = Arc::new(MemDevice::new(16 << 20, 512));
        let vol = paged_volume_with(&dev, page_index);
        let one_ino = write_paged_file(&vol, "/one", 7);
        let two_ino = write_paged_file(&vol, "/two", 7);
        let x = checkpoint_a_base(&vol, "a");
        let first = pages_of(&vol, x);
        let two = file_pages(&vol, x, two_ino);
        assert!(!two.is_empty() && !file_pages(&vol, x, one_ino).is_empty());
        assert_eq!(first.len(), two.len() + file_pages(&vol, x, one_ino).len());
        let y = checkpoint_a_base(&vol, "b");
        assert_ne!(x, y);
        assert_eq!(pages_of(&vol, y), first, "nothing changed: the same pages");

        // "/one" gets other extents: its pages are rewritten at the next
        // base (in slot x again), while slot y's base still lists the old.
        write_paged_file(&vol, "/one", 9);
        let one = vol.open_file("/one", OpenFlags::default()).unwrap();
        assert_eq!(checkpoint_a_base(&vol, "c"), x);
        let third = pages_of(&vol, x);
        assert_eq!(
            third
                .intersection(&first)
                .copied()
                .collect::<std::collections::BTreeSet<_>>(),
            two,
            "/two's pages are kept, /one's new"
        );
        let mut listed: std::collections::BTreeSet<_> = first.union(&third).copied().collect();
        let index = vol.inner.commit.lock().index.clone();
        assert_eq!(
            !index[x].is_empty() && !index[y].is_empty(),
            page_index,
            "index pages"
        );
        for table in &index {
            listed.extend(crate::extent_pages::index_page_ranges(table, 4096));
        }
        assert_eq!(
            vol.inner.meta.read().spilled_bytes,
            listed.iter().map(|&(_, len)| len).sum::<u64>(),
            "metadata bytes are the pages and index pages either slot lists"
        );
        // Small files now take the smallest free holes first: none may be
        // a page slot y lists.
        for i in 0..8 {
            write_file(&vol, &format!("/new{i}"));
        }
        drop(one);
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        let mut buf = vec![0u8; 4096];
        let one = vol.open_file("/one", OpenFlags::default()).unwrap();
        for k in [0, PAGED_FILE_EXTENTS - 1] {
            one.pread(&mut buf, 2 * k * 4096).unwrap();
            assert_eq!(buf, vec![9u8; 4096]);
        }
        drop(one);
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    /// Mount starts a segment where each index page's run starts, so the
    /// first base after a remount finds the runs it read: after one
    /// extent changes, it writes one index page, however the segments
    /// were split before the unmount (extents inserted in the middle of
    /// the file split chunks and segments there).
    #[test]
    fn after_a_remount_a_base_rewrites_only_the_changed_runs_index_page() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        let vol = paged_volume_with(&dev, true);
        let f = create_file(&vol, "/f");
        const N: u64 = 1200;
        for k in 0..N {
            f.fallocate(4 * k * 4096, 4096, false).unwrap();
        }
        for k in 300..500 {
            f.fallocate((4 * k + 2) * 4096, 4096, false).unwrap();
        }
        f.fsync().unwrap();
        let ino = vol.stat("/f").unwrap().ino;
        drop(f);
        vol.unmount().unwrap();
        let index_of = |dev: &Arc<MemDevice>| {
            let sb = crate::superblock::read_superblock(&**dev).unwrap();
            let newest = crate::checkpoint::read_checkpoints(&**dev, &sb).unwrap();
            let (_, refs) = newest.index[newest.slot]
                .iter()
                .find(|(i, _)| *i == ino)
                .cloned()
                .expect("/f is paged");
            refs
        };
        let before = index_of(&dev);
        assert!(before.len() >= 10, "{} index pages", before.len());

        let vol = Volume::open(dev.clone()).unwrap();
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        f.punch_hole(4 * 900 * 4096, 4096).unwrap();
        f.fsync().unwrap();
        drop(f);
        vol.unmount().unwrap();
        let after = index_of(&dev);
        let new = after.iter().filter(|r| !before.contains(r)).count();
        assert_eq!(new, 1, "{new} of {} index pages written again", after.len());
        assert_fsck_clean(&dev);
    }

    /// Page references are held once: both slots' tables share the run
    /// of each index page both list (read once at mount, listed again by
    /// a base), and the cold segments mount builds share the newest
    /// table's runs.
    #[test]
    fn both_slots_and_the_maps_share_each_index_pages_run() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        let vol = paged_volume_with(&dev, true);
        let f = create_file(&vol, "/f");
        for k in 0..1200 {
            f.fallocate(4 * k * 4096, 4096, false).unwrap();
        }
        f.fsync().unwrap();
        let ino = vol.stat("/f").unwrap().ino;
        drop(f);
        vol.unmount().unwrap();
        // A second base over the same pages (a clean unmount writes
        // one): both slots list the same index pages.
        Volume::open(dev.clone()).unwrap().unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        vol.wait_free_space().unwrap();
        let runs_of = |vol: &Volume, slot: usize| -> Vec<crate::codec::PageRun> {
            let commit = vol.inner.commit.lock();
            let table = &commit.pages[slot];
            let at = table.binary_search_by_key(&ino, |&(i, _)| i).unwrap();
            table[at].1.runs().to_vec()
        };
        let (a, b) = (runs_of(&vol, 0), runs_of(&vol, 1));
        assert!(a.len() >= 10, "{} runs", a.len());
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(Arc::ptr_eq(x, y), "both slots list it: one allocation");
            // `a` and `b` here, the tables' own (the same run twice) and
            // the cold segment's.
            assert!(Arc::strong_count(x) >= 5, "{}", Arc::strong_count(x));
        }
        let pages: usize = a.iter().map(|r| r.len()).sum();
        let listed = crate::extent_pages::listed_pages(&vol.inner.commit.lock().pages);
        assert_eq!(listed, pages as u64, "each run counted once");
        drop((a, b));

        // A base after one change shares every run but the changed one
        // with the other slot's table.
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        f.punch_hole(4 * 900 * 4096, 4096).unwrap();
        f.fsync().unwrap();
        let slot = checkpoint_a_base(&vol, "d");
        let shared_with_other = |vol: &Volume, slot: usize| {
            let (new, other) = (runs_of(vol, slot), runs_of(vol, 1 - slot));
            let shared = new
                .iter()
                .filter(|r| other.iter().any(|o| Arc::ptr_eq(r, o)))
                .count();
            (shared, new.len())
        };
        let (shared, runs) = shared_with_other(&vol, slot);
        assert_eq!(shared, runs - 1, "of {runs} runs");
        // A change that adds pages (chunks split): the runs before the
        // changed segment and after the next long one are the same, so
        // shared still. Index runs follow segments (of 2 to 4 chunks in
        // unit builds: more than 100 runs); cut over the whole file they
        // would be 75 of 4 pages.
        for k in 600..640 {
            f.fallocate((4 * k + 2) * 4096, 4096, false).unwrap();
        }
        f.fsync().unwrap();
        drop(f);
        let slot = checkpoint_a_base(&vol, "e");
        let (shared, runs) = shared_with_other(&vol, slot);
        assert!(runs > 100 && shared + 10 >= runs, "{shared} of {runs} runs");
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    /// Files of a few extents stay inline in the root: a volume of many
    /// spends no page blocks (metadata bytes 0), before and after a
    /// remount. A file that grows past the bound is paged at the next
    /// base; truncated back, it is inline again and, once both slots'
    /// bases are past it, its pages are free.
    #[test]
    fn small_files_spend_no_page_blocks_and_a_file_changes_form_at_the_bound() {
        for page_index in [false, true] {
            small_files_spend_no_page_blocks_and_a_file_changes_form_at_the_bound_with(page_index);
        }
    }

    fn small_files_spend_no_page_blocks_and_a_file_changes_form_at_the_bound_with(
        page_index: bool,
    ) {
        let dev = Arc::new(MemDevice::new(32 << 20, 512));
        let vol = paged_volume_with(&dev, page_index);
        for i in 0..200 {
            write_file(&vol, &format!("/small{i}"));
        }
        let x = checkpoint_a_base(&vol, "a");
        let y = checkpoint_a_base(&vol, "b");
        assert_ne!(x, y);
        assert!(pages_of(&vol, x).is_empty() && pages_of(&vol, y).is_empty());
        assert_eq!(vol.statfs().metadata_bytes, 0, "no page blocks");
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        assert_eq!(vol.statfs().metadata_bytes, 0);

        let big = write_paged_file(&vol, "/big", 3);
        let z = checkpoint_a_base(&vol, "c");
        let paged = file_pages(&vol, z, big);
        assert!(!paged.is_empty(), "paged at the next base");
        let index = crate::extent_pages::index_page_ranges(&vol.inner.commit.lock().index[z], 4096);
        // Runs of at most a segment's chunks: 4 in unit builds, so
        // several index pages.
        assert_eq!(!index.is_empty(), page_index, "index pages list them");
        assert_eq!(
            vol.inner.meta.read().spilled_bytes,
            paged.iter().chain(&index).map(|&(_, len)| len).sum::<u64>()
        );
        let max = crate::codec::inline_extents_max(4096) as u64;
        let f = vol.open_file("/big", OpenFlags::default()).unwrap();
        // Blocks at 2k * 4096: `max` extents end at (2 * max - 1) blocks.
        f.truncate((2 * max - 1) * 4096).unwrap();
        f.fsync().unwrap();
        drop(f);
        assert_eq!(
            vol.inner.meta.read().state.inodes[&big].extents.len() as u64,
            max
        );
        checkpoint_a_base(&vol, "d");
        checkpoint_a_base(&vol, "e");
        assert!(pages_of(&vol, 0).is_empty() && pages_of(&vol, 1).is_empty());
        assert_eq!(vol.statfs().metadata_bytes, 0, "its pages are free");
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let mut buf = vec![0u8; 4096];
        let f = vol.open_file("/big", OpenFlags::default()).unwrap();
        f.pread(&mut buf, 2 * (max - 1) * 4096).unwrap();
        assert_eq!(buf, vec![3u8; 4096], "the inline extents read back");
        drop(f);
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    /// Checkpoints, each after renaming `/x` to `/y` or back (a change
    /// that does not grow the metadata), until one is a base; returns its
    /// slot.
    fn rename_until_a_base(vol: &Volume) -> usize {
        checkpoint_until_a_base(vol, || {
            let (from, to) = if vol.stat("/x").is_ok() {
                ("/x", "/y")
            } else {
                ("/y", "/x")
            };
            vol.rename(from, to).unwrap();
        })
    }

    /// Both slots' bases can list the same pages (nothing changed between
    /// them): a base that then rewrites every chunk frees none of them, so
    /// the base after it needs a whole new set again before any is freed.
    /// The room data writes leave covers that: after a fill to ENOSPC, a
    /// base rewriting every chunk, then a change to every chunk (punches,
    /// which must not be refused) and another base all succeed, also when
    /// the pages came from a mount.
    #[test]
    fn shared_pages_are_room_until_a_base_frees_them() {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        let vol = paged_volume(&dev);
        write_file(&vol, "/x");
        // Past the inline bound (162 extents) even after two punches in
        // every chunk.
        const EXTENTS: u64 = 400;
        let f = create_file(&vol, "/big");
        for k in 0..EXTENTS {
            f.pwrite(&[1u8; 4096], 2 * k * 4096).unwrap();
        }
        f.fsync().unwrap();
        drop(f);
        let big = vol.stat("/big").unwrap().ino;
        let a = checkpoint_a_base(&vol, "a");
        let b = checkpoint_a_base(&vol, "b");
        assert_ne!(a, b);
        assert!(!file_pages(&vol, a, big).is_empty());
        assert_eq!(file_pages(&vol, a, big), file_pages(&vol, b, big));
        // Mount finds the pages both slots list, as the writer knew them.
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let chunks = vol.inner.meta.read().state.inodes[&big]
            .extents
            .chunk_pages()
            .count() as u64;
        let punch_every_chunk = |round: u64| {
            let f = vol.open_file("/big", OpenFlags::default()).unwrap();
            let per_chunk = EXTENTS / chunks;
            for k in (round..EXTENTS).step_by(per_chunk as usize) {
                f.punch_hole(2 * k * 4096, 4096)
                    .unwrap_or_else(|e| panic!("punch of extent {k} in round {round}: {e}"));
            }
            f.fsync().unwrap();
        };
        punch_every_chunk(0);
        let filler = create_file(&vol, "/filler");
        let mut size = 0;
        for step in [65536, 4096] {
            loop {
                match filler.pwrite(&vec![7u8; step], size) {
                    Ok(_) => size += step as u64,
                    Err(err) if err.errno() == libc::ENOSPC => break,
                    Err(err) => panic!("{err}"),
                }
            }
        }
        filler.fsync().unwrap();
        assert!(size > 1 << 20, "{size} bytes of filler");
        let c = rename_until_a_base(&vol);
        assert!(file_pages(&vol, c, big).is_disjoint(&file_pages(&vol, 1 - c, big)));
        punch_every_chunk(1);
        rename_until_a_base(&vol);
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    /// Data writes leave free the room the next base needs (a page per
    /// chunk of every paged file, and its root): a volume filled to ENOSPC
    /// by fragmented files still checkpoints a base, unmounts, mounts and
    /// checks clean, with every block written before the ENOSPC intact.
    #[test]
    fn a_paged_volume_filled_to_enospc_still_checkpoints_a_base() {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        let vol = paged_volume(&dev);
        checkpoint_a_base(&vol, "a");
        let mut written: Vec<(String, u64)> = Vec::new();
        'fill: for n in 0.. {
            let path = format!("/f{n}");
            let f = create_file(&vol, &path);
            for k in 0..2 * PAGED_FILE_EXTENTS {
                match f.pwrite(&[n as u8; 4096], 2 * k * 4096) {
                    Ok(_) => written.push((path.clone(), k)),
                    Err(err) if err.errno() == libc::ENOSPC => break 'fill,
                    Err(err) => panic!("{err}"),
                }
            }
            f.fsync().unwrap();
        }
        let extents: u64 = vol
            .inner
            .meta
            .read()
            .state
            .inodes
            .values()
            .map(|i| i.extents.len() as u64)
            .sum();
        assert!(extents > 1000, "{extents} extents: a page's worth of files");
        vol.sync().unwrap();
        let slot = checkpoint_a_base(&vol, "z");
        assert!(!pages_of(&vol, slot).is_empty());
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
        let vol = Volume::open(dev.clone()).unwrap();
        let mut buf = vec![0u8; 4096];
        for (path, k) in written.iter().step_by(97) {
            let f = vol.open_file(path, OpenFlags::default()).unwrap();
            f.pread(&mut buf, 2 * k * 4096).unwrap();
            let n: u8 = path[2..].parse::<u64>().unwrap() as u8;
            assert_eq!(buf, vec![n; 4096], "{path} block {k}");
        }
        vol.unmount().unwrap();
    }

    /// With a little free space left, a one-block write that makes a file
    /// at the inline bound paged (its every chunk then needs room for a
    /// page) is either refused with ENOSPC when it is written or finds its
    /// room: its writeback and the base that pages the file (the clean
    /// unmount's) succeed, never short of space.
    #[test]
    fn a_write_that_would_page_a_file_never_leaves_its_base_short() {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        let vol = paged_volume(&dev);
        let max = crate::codec::inline_extents_max(4096) as u64;
        let big = create_file(&vol, "/big");
        for k in 0..max {
            big.pwrite(&[1u8; 4096], 2 * k * 4096).unwrap();
        }
        big.fsync().unwrap();
        let fill = create_file(&vol, "/fill");
        let mut size = 0u64;
        for len in [1 << 20, 4096] {
            while fill.pwrite(&vec![2u8; len], size).is_ok() {
                size += len as u64;
            }
        }
        fill.fsync().unwrap();
        // Free 64 KiB: less than the pages /big would need once paged.
        fill.truncate(size - (64 << 10)).unwrap();
        fill.fsync().unwrap();
        vol.checkpoint().unwrap();
        let (free, reserve) = {
            let m = vol.inner.meta.read();
            (m.unreserved_bytes().unwrap(), m.spill_reserve_for(0))
        };
        assert!(free >= 64 << 10, "{free} bytes free");
        assert_eq!(reserve, 0, "no paged file yet");

        // The room counts a file with held extents as paged already
        // (crate::delalloc), so the write may fit; if it does not, it is
        // the write that is refused. Either way its writeback and the base
        // that pages /big find their space (sync and the base below).
        match big.pwrite(&[3u8; 4096], 2 * max * 4096) {
            Ok(_) => {}
            Err(err) => assert_eq!(err.errno(), libc::ENOSPC, "{err}"),
        }
        vol.sync().unwrap();
        drop((big, fill));
        vol.unmount().unwrap();
        assert_fsck_clean(&dev);
    }

    /// After a remount, the chunks of the files no delta changed name the
    /// pages they were read from: the first base writes a page only for
    /// the file a delta changed after the last base.
    #[test]
    fn after_a_remount_a_base_rewrites_only_the_files_deltas_changed() {
        let dev = Arc::new(MemDevice::new(16 << 20, 512));
        let vol = paged_volume(&dev);
        let inos: Vec<Ino> = ["/one", "/two", "/three"]
            .iter()
            .map(|name| write_paged_file(&vol, name, 7))
            .collect();
        let x = checkpoint_a_base(&vol, "a");
        let before = pages_of(&vol, x);
        let two_before = file_pages(&vol, x, inos[1]);
        // A delta changes one extent of "/two".
        let two = vol.open_file("/two", OpenFlags::default()).unwrap();
        two.pwrite(&[5u8; 4096], 4096).unwrap();
        two.fsync().unwrap();
        drop(two);
        vol.checkpoint().unwrap();
        assert!(
            vol.inner.commit.lock().chain.deltas > 0,
            "a delta, not a base"
        );
        vol.unmount().unwrap();

        let vol = Volume::open(dev.clone()).unwrap();
        assert_eq!(pages_of(&vol, x), before);
        let y = checkpoint_a_base(&vol, "b");
        let after = pages_of(&vol, y);
        for ino in [inos[0], inos[2]] {
            assert_eq!(
                file_pages(&vol, y, ino),
                file_pages(&vol, x, ino),
                "files no delta changed keep their pages"
            );
        }
        let two_after = file_pages(&vol, y, inos[1]);
        assert!(
            !two_after.is_subset(&two_before),
            "the changed chunk's page"
        );
        assert!(
            after.difference(&before).all(|p| two_after.contains(p)),
            "only the changed file's pages are new"
        );
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        let mut buf = vec![0u8; 4096];
        vol.open_file("/two", OpenFlags::default())
            .unwrap()
            .pread(&mut buf, 4096)
            .unwrap();
        assert_eq!(buf, vec![5u8; 4096]);
    }

    /// After a remount, a delta costs the next base the chunks its spans
    /// reach, not the whole file: of a file of several pages, one extent
    /// changed by a delta, the base after the remount replaces only the
    /// page of the chunk holding it and lists the others again.
    #[test]
    fn after_a_remount_a_base_rewrites_only_the_chunks_a_delta_changed() {
        let dev = Arc::new(MemDevice::new(16 << 20, 512));
        let vol = paged_volume(&dev);
        let f = create_file(&vol, "/big");
        // 200 one-block extents, every other block (past the 162 a root
        // keeps inline): pages of up to 8 extents (the unit tests' chunks).
        for i in 0..200u64 {
            f.fallocate(2 * i * 4096, 4096, false).unwrap();
        }
        let x = checkpoint_a_base(&vol, "a");
        let before = pages_of(&vol, x);
        assert!(before.len() >= 5, "{} pages", before.len());
        // A delta: the hole after the 20th extent.
        f.fallocate(41 * 4096, 4096, false).unwrap();
        f.fsync().unwrap();
        vol.checkpoint().unwrap();
        assert!(
            vol.inner.commit.lock().chain.deltas > 0,
            "a delta, not a base"
        );
        let ino = f.ino();
        let map: Vec<Extent> = vol.inner.meta.read().state.inodes[&ino]
            .extents
            .iter()
            .copied()
            .collect();
        drop(f);
        vol.unmount().unwrap();

        let vol = Volume::open(dev.clone()).unwrap();
        let remounted: Vec<Extent> = vol.inner.meta.read().state.inodes[&ino]
            .extents
            .iter()
            .copied()
            .collect();
        assert_eq!(remounted, map);
        let y = checkpoint_a_base(&vol, "b");
        let after = pages_of(&vol, y);
        assert_eq!(
            before.difference(&after).count(),
            1,
            "only the page of the chunk the delta reached is replaced"
        );
        assert!(after.difference(&before).count() >= 1);
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        let again: Vec<Extent> = vol.inner.meta.read().state.inodes[&ino]
            .extents
            .iter()
            .copied()
            .collect();
        assert_eq!(again, map);
    }

    /// As above, with the maps left as a lazy mount leaves them: after the
    /// remount only the chunk the delta reached is in memory, a base
    /// writes a page for it alone and reads no other (the absent chunks
    /// keep the pages they name), and the map reads back whole.
    #[test]
    fn after_a_lazy_remount_a_base_reads_and_rewrites_only_the_changed_chunk() {
        let dev = Arc::new(MemDevice::new(16 << 20, 512));
        let vol = paged_volume(&dev);
        let f = create_file(&vol, "/big");
        for i in 0..200u64 {
            f.fallocate(2 * i * 4096, 4096, false).unwrap();
        }
        let x = checkpoint_a_base(&vol, "a");
        let before = pages_of(&vol, x);
        f.fallocate(41 * 4096, 4096, false).unwrap();
        f.fsync().unwrap();
        vol.checkpoint().unwrap();
        assert!(vol.inner.commit.lock().chain.deltas > 0);
        let ino = f.ino();
        let map: Vec<Extent> = vol.inner.meta.read().state.inodes[&ino]
            .extents
            .iter()
            .copied()
            .collect();
        drop(f);
        // Dropped: a clean unmount would write a base instead.
        drop(vol);

        let vol = Volume::open(dev.clone()).unwrap();
        let loaded = |vol: &Volume| {
            let meta = vol.inner.meta.read();
            let m = &meta.state.inodes[&ino].extents;
            (m.loaded_chunks(), m.chunk_count())
        };
        let (at_mount, chunks) = loaded(&vol);
        assert_eq!(at_mount, 1, "the chunk the delta reached, of {chunks}");
        let y = checkpoint_a_base(&vol, "b");
        let after = pages_of(&vol, y);
        assert_eq!(before.difference(&after).count(), 1, "one page replaced");
        assert_eq!(loaded(&vol).0, 1, "the base read no absent chunk");
        let stats = vol.extent_page_loads().unwrap();
        assert_eq!((stats.loads, stats.unplanned), (0, 0), "{stats:?}");
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        assert_eq!(loaded(&vol).0, 0, "after the base: nothing to replay");
        let again: Vec<Extent> = vol.inner.meta.read().state.inodes[&ino]
            .extents
            .iter()
            .copied()
            .collect();
        assert_eq!(again, map);
    }

    /// The delta policy weighs a chain's deltas against what a base costs,
    /// and with extent pages that is its pages, not its root alone (which
    /// holds no extents): a change of a few percent of a large file is a
    /// delta, not a base that rewrites every page it touches.
    #[test]
    fn with_extent_pages_a_delta_is_weighed_against_the_pages() {
        let dev = Arc::new(MemDevice::new(64 << 20, 512));
        let vol = paged_volume(&dev);
        let f = create_file(&vol, "/big");
        // 3000 one-block extents, every other block, in pages of 8.
        for i in 0..3000u64 {
            f.fallocate(2 * i * 4096, 4096, false).unwrap();
        }
        checkpoint_a_base(&vol, "a");
        // The hole after each of the first 2000: a delta above the
        // policy's minimum, below a quarter of the pages.
        for i in 0..2000u64 {
            f.fallocate((2 * i + 1) * 4096, 4096, false).unwrap();
        }
        vol.checkpoint().unwrap();
        let chain = vol.inner.commit.lock().chain;
        assert!(
            chain.delta_bytes > crate::limits::CHAIN_DELTA_BYTES_MIN,
            "the delta ({} bytes) is above the minimum",
            chain.delta_bytes
        );
        assert_eq!(chain.deltas, 1, "a delta after the base with pages");
        // Mount weighs the chain as the writer did.
        drop(f);
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        assert_eq!(vol.inner.commit.lock().chain.base_bytes, chain.base_bytes);
    }
}
