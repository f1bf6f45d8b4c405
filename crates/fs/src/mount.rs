//! Bringing a volume up: format, mount (newest checkpoint, journal replay,
//! orphans freed; free space rebuilt from the extents by a background
//! scan, see [`crate::free_space`]), and the loading that fsck shares with
//! mount (which builds free space synchronously).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use blockdev::BlockDevice;

use crate::alloc::Allocator;
use crate::checkpoint::{self, Checkpoint};
use crate::free_space::{Claim, FreeSpace, FreeSpaceGate, ScanInput, ScanPoint};
use crate::journal::{self, JournalWriter};
use crate::limits::{COMMIT_THRESHOLD_BYTES_MOST, COMMIT_THRESHOLD_DIVISOR};
use crate::mount_state::{now, CommitState, Meta, VolumeInner};
use crate::page_loader::DevicePages;
use crate::state::MetaState;
use crate::superblock::{self, Layout, Superblock};
use crate::types::{Ino, Record};
use crate::{Error, Result};
use iomap::sharded_rwlock::ShardedWriteGuard;

/// Choices made at format time.
#[derive(Clone, Debug)]
pub struct FormatOptions {
    /// File-system block size in bytes: a power of two, at least the device's
    /// logical block size, 512..=65536. Default 4096.
    pub block_size: u32,
    /// Journal size in bytes; `None` picks from the device size.
    pub journal_bytes: Option<u64>,
    /// Size of each of the two checkpoint slots in bytes; `None` picks from
    /// the device size.
    pub checkpoint_slot_bytes: Option<u64>,
    /// Owner of the root directory (mode 0755). Default: the effective user
    /// and group of the formatting process, so that a user who formats an
    /// image file and mounts it can write to it.
    pub root_owner: Option<(u32, u32)>,
    /// Base checkpoints keep extents in extent pages of the data area
    /// (incompat bit 2, see `docs/EXTENT_PAGES.md`), so a base writes only
    /// the chunks changed since the last one. On by default; off keeps the
    /// whole extent image in each base (readable by builds without bit 2).
    pub extent_pages: bool,
    /// With `extent_pages`: roots list index pages, each listing the
    /// extent pages of a run of chunks (incompat bit 3), so a root and a
    /// base's writes stop growing with every page. Each index page is
    /// written to two blocks, so that one bad block loses no checkpoint
    /// (see `docs/EXTENT_PAGES.md`). On by default; without
    /// `extent_pages` it does nothing (there are no pages to list). Off
    /// keeps every page in each root, readable by builds without bit 3.
    pub page_index: bool,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: 4096,
            journal_bytes: None,
            checkpoint_slot_bytes: None,
            root_owner: None,
            extent_pages: true,
            page_index: true,
        }
    }
}

/// Writes a new, empty file system to `device`.
pub(crate) fn format(device: Arc<dyn BlockDevice>, opts: &FormatOptions) -> Result<()> {
    let caps = device.caps().clone();
    let layout = Layout::compute(
        caps.size_bytes,
        caps.logical_block_size,
        opts.block_size,
        opts.journal_bytes,
        opts.checkpoint_slot_bytes,
    )?;
    let mut sb = Superblock::new(layout);
    if opts.extent_pages {
        sb.features_incompat |= superblock::INCOMPAT_EXTENT_PAGES;
        if opts.page_index {
            sb.features_incompat |= superblock::INCOMPAT_PAGE_INDEX;
        }
    }
    // SAFETY: geteuid and getegid cannot fail and touch no memory.
    let process = unsafe { (libc::geteuid(), libc::getegid()) };
    let (uid, gid) = opts.root_owner.unwrap_or(process);
    let state = MetaState::new_empty(sb.layout.block_size, now(), uid, gid);
    let ckpt = Checkpoint {
        generation: 1,
        journal_start: 0,
        journal_seq: 1,
        journal_chain: 0,
        image: state.to_image(),
    };
    // Slots first, superblock last: a crash mid-format leaves the old
    // superblock (or none), never a new superblock pointing at garbage.
    if opts.extent_pages {
        // No file has extents yet: a root with no pages.
        let index = opts.page_index.then(Vec::new);
        let root = state.encode_root_after(
            checkpoint::CHECKPOINT_HEADER_LEN,
            &Vec::new(),
            index.as_ref(),
        )?;
        let header = checkpoint::RecordHeader::of(&ckpt);
        checkpoint::write_base_record(&*device, &sb, 0, header, root, &[])?;
    } else {
        checkpoint::write_checkpoint(&*device, &sb, 0, &ckpt)?;
    }
    checkpoint::invalidate_slot(&*device, &sb, 1)?;
    superblock::write_backup_superblock(&*device, &sb)?;
    superblock::write_superblock(&*device, &sb)?;
    device
        .flush()
        .map_err(|e| Error::device("format: flush", e))?;
    Ok(())
}

/// Mounts the volume on `device`: reads the newest valid checkpoint,
/// replays the journal after it and frees orphans. Free space is not
/// rebuilt yet: the returned volume holds the scan's input, which
/// [`crate::volume::Volume`] hands to a background thread
/// ([`crate::free_space`]). A layout whose extents overlap is therefore
/// found by that scan, after mount: allocations then fail with its
/// [`Error::Corrupt`] (fsck reports it as ever).
pub(crate) fn mount(
    device: Arc<dyn BlockDevice>,
    cache: iomap::FolioCache,
) -> Result<Arc<VolumeInner>> {
    let loaded = load_unscanned(&device, Strictness::Mount)?;
    let Loaded {
        sb,
        slot,
        generation,
        chain,
        state,
        alloc: (),
        replay_end,
        journal_tail,
        replay_freed,
        damage: _,
        damaged_index_copies,
        from_backup,
        clean_mark_names_newest,
        checkpoint_free_hint,
        spills,
        pages,
        index,
        page_loader,
    } = loaded;
    // After a clean unmount (the mark names the newest checkpoint: no
    // record after it), allocations start from the hint it left while
    // the scan runs; otherwise (a crash) from the loaded checkpoint's,
    // less what replay placed. Either must keep off the pages and spill
    // extents the slots list, or it is not used at all.
    let mut metadata = used_pages(&sb, &pages, &index);
    let page_bytes: u64 = metadata.iter().map(|&(_, len)| len).sum();
    metadata.extend(spills.iter().flatten().map(|s| (s.0, s.1)));
    let hint = if clean_mark_names_newest && from_backup.is_none() {
        &sb.free_hint
    } else {
        &checkpoint_free_hint
    };
    let reserve = crate::free_space::Reserve::of_hint(&sb, hint, &metadata);
    // Copies (maps are copy-on-write; cold segments get their own page
    // lists): the state the scan reads while the volume changes its own.
    let scan_input = ScanInput {
        sb: sb.clone(),
        state: state.detached_snapshot(),
        spills: spills.clone(),
        pages: pages.clone(),
        index: index.clone(),
    };
    let mut alloc = FreeSpace::Scanning(Vec::new(), reserve);
    for (seq, addr, len) in replay_freed {
        alloc
            .hold_busy(addr, len, seq)
            .map_err(|reason| Error::corrupt("journal record", addr, reason))?;
    }
    let mut journal =
        JournalWriter::new(&sb, replay_end.head, replay_end.next_seq, replay_end.chain);
    journal.set_tail(journal_tail);
    // Whether or not it was trusted: a mark must never be on disk with a
    // batch after it. When the backup stood in for block 0, block 0 may
    // hold a mark all the same (a read that failed once, a bit flipped
    // outside the mark): the first append writes the backup's copy over it,
    // as `fsck --repair` would, so no later mount that reads block 0 again
    // can trust a mark from before this session's batches.
    if sb.clean_mark.is_some() || from_backup.is_some() {
        journal.clear_clean_mark_first(&sb);
    }
    let sb = sb.without_clean_mark();
    let commit_threshold =
        (sb.layout.journal.len / COMMIT_THRESHOLD_DIVISOR).min(COMMIT_THRESHOLD_BYTES_MOST);
    let mut meta = Meta::new(state, alloc, replay_end.next_seq);
    if sb.features_incompat & superblock::INCOMPAT_SPILLED_CHECKPOINTS != 0 {
        meta.spill_slot_bytes = Some(checkpoint::slot_capacity(&sb));
    }
    meta.extent_pages = sb.features_incompat & superblock::INCOMPAT_EXTENT_PAGES != 0;
    meta.page_index = sb.features_incompat & superblock::INCOMPAT_PAGE_INDEX != 0;
    meta.shared_page_bytes = crate::extent_pages::shared_page_bytes(
        [&pages[0], &pages[1]],
        [&index[0], &index[1]],
        sb.block_size(),
    );
    meta.spilled_bytes = spills.iter().flatten().map(|&(_, len)| len).sum::<u64>() + page_bytes;
    let deltas = sb.features_incompat & superblock::INCOMPAT_DELTA_CHECKPOINTS != 0;
    let commit = CommitState {
        journal,
        slot,
        generation,
        chain,
        spills,
        pages: pages.map(std::sync::Arc::new),
        index: index.map(std::sync::Arc::new),
        index_to_rewrite: damaged_index_copies.iter().map(|d| d.index.addr).collect(),
    };
    meta.replaced_slot_bytes = commit.replaced_slot_bytes(&sb);
    let mut inner = VolumeInner::new(device, sb, meta, commit, commit_threshold, cache);
    inner.free_space_gate = FreeSpaceGate::scanning(scan_input);
    inner.mount_warnings = from_backup
        .iter()
        .map(ToString::to_string)
        .chain(damaged_index_copies.iter().map(ToString::to_string))
        .collect();
    inner.page_loader = page_loader;
    inner.mounted_from_backup = from_backup.is_some();
    *inner.checkpointing.get_mut() = deltas;
    let inner = Arc::new(inner);
    // Inodes unlinked while open when the volume went down: nothing can
    // reach them any more.
    {
        let mut meta = inner.meta.write();
        for ino in orphans(&meta.state) {
            meta.log(Record::FreeInode { ino })?;
        }
    }
    Ok(inner)
}

impl VolumeInner {
    /// Returns once mount's scan has installed the allocator, or failed
    /// (the allocator's calls then give its error). Never call it holding
    /// the metadata lock: the install takes it. Runs the scan itself when
    /// no thread does (see [`crate::free_space`]).
    pub(crate) fn wait_free_space(&self) {
        if self.free_space_gate.is_done() {
            return;
        }
        let never = AtomicBool::new(false);
        while let Some(Claim::Scan(input)) = self.free_space_gate.claim(true) {
            self.scan_free_space(input, &never);
        }
    }

    /// The metadata lock, once free space can be allocated from (or the
    /// scan failed).
    pub(crate) fn meta_for_allocation(&self) -> ShardedWriteGuard<'_, Meta> {
        self.wait_free_space();
        self.meta.write()
    }

    /// Runs `change` under the metadata write lock. A change whose room
    /// check for the next base reads free space while the scan runs gets
    /// [`Error::FreeSpacePending`] from it before changing anything (or,
    /// with the clean unmount's reserve, ENOSPC when that is short): the
    /// lock is dropped, the scan waited for, and `change` run again.
    /// Changes that need no free space (most, on a volume whose bases take
    /// no data-area space) never wait.
    pub(crate) fn with_free_space<T>(
        &self,
        mut change: impl FnMut(&mut Meta) -> Result<T>,
    ) -> Result<T> {
        loop {
            let mut meta = self.meta.write();
            match change(&mut meta) {
                Err(e) if meta.alloc.waits_for_scan(&e) => {
                    drop(meta);
                    self.wait_free_space();
                }
                done => return done,
            }
        }
    }

    /// Builds the allocator from `input` as [`build_allocator`] does and
    /// installs it, with the frees made since mount; gives up, leaving the
    /// scan to whoever claims it next, once `cancel` is set.
    ///
    /// `input` is dropped before the gate opens: its snapshot shares the
    /// maps' chunks, and a chunk a snapshot holds stays in memory whatever
    /// the evictor does, so a caller that found free space ready must
    /// find the snapshot gone too.
    pub(crate) fn scan_free_space(&self, input: Arc<ScanInput>, cancel: &AtomicBool) {
        let gate = &self.free_space_gate;
        gate.hook(ScanPoint::Start);
        let built = build_allocator_unless(
            &input.sb,
            &input.state,
            &input.spills,
            &used_pages(&input.sb, &input.pages, &input.index),
            cancel,
        );
        if matches!(built, Ok(Some(_))) {
            // One block per index page beside the scan's read of every
            // extent page (up to 127 per index page): done before free
            // space is ready, so that whoever waited for it sees the
            // warnings.
            self.check_second_index_copies(&input.index);
        }
        drop(input);
        let built = match built {
            Ok(None) => return gate.abandon(),
            Ok(Some(alloc)) => Ok(alloc),
            Err(err) => Err(err),
        };
        gate.hook(ScanPoint::BeforeInstall);
        let failure = self.meta.write().alloc.install(built);
        gate.finish(failure);
        gate.hook(ScanPoint::Finished);
    }

    /// Reads the second copy of every index page either slot lists
    /// (mount read the first copies): one that fails is warned of and
    /// written anew by the next bases, as a first copy mount found bad.
    fn check_second_index_copies(&self, index: &[crate::codec::IndexTable]) {
        let damaged = checkpoint::check_second_index_copies(&*self.dev, &self.sb, index);
        if damaged.is_empty() {
            return;
        }
        self.commit
            .lock()
            .index_to_rewrite
            .extend(damaged.iter().map(|d| d.index.addr));
        self.scan_warnings
            .lock()
            .extend(damaged.iter().map(ToString::to_string));
    }
}

/// The thread that rebuilds free space after mount; dropping it stops
/// and joins it (what it has not installed, the next waiter scans).
pub(crate) struct FreeSpaceScan {
    vol: std::sync::Weak<VolumeInner>,
    cancel: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FreeSpaceScan {
    /// Starts the scan of a volume [`mount`] returned. Should the thread
    /// not start, the first allocation scans in its caller's thread.
    pub(crate) fn start(vol: &Arc<VolumeInner>) -> FreeSpaceScan {
        let cancel = Arc::new(AtomicBool::new(false));
        let Some(Claim::Scan(input)) = vol.free_space_gate.claim(false) else {
            return FreeSpaceScan {
                vol: Arc::downgrade(vol),
                cancel,
                thread: None,
            };
        };
        let (weak, stop) = (Arc::downgrade(vol), cancel.clone());
        let thread = std::thread::Builder::new()
            .name("iomapfs-free-space".to_string())
            .spawn(move || {
                if let Some(vol) = weak.upgrade() {
                    vol.scan_free_space(input, &stop);
                }
            });
        match thread {
            Ok(thread) => FreeSpaceScan {
                vol: Arc::downgrade(vol),
                cancel,
                thread: Some(thread),
            },
            Err(_) => {
                vol.free_space_gate.abandon();
                FreeSpaceScan {
                    vol: Arc::downgrade(vol),
                    cancel,
                    thread: None,
                }
            }
        }
    }
}

impl Drop for FreeSpaceScan {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            if let Some(vol) = self.vol.upgrade() {
                vol.free_space_gate.hook(ScanPoint::Cancelled);
            }
            let _ = thread.join();
        }
    }
}

/// The inodes no name reaches (unlinked while open when the volume went
/// down), in number order: mount frees them.
pub(crate) fn orphans(state: &MetaState) -> Vec<Ino> {
    let mut orphans: Vec<Ino> = state
        .inodes
        .values()
        .filter(|i| i.nlink == 0)
        .map(|i| i.ino)
        .collect();
    orphans.sort_unstable();
    orphans
}

/// How much inconsistency loading tolerates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Strictness {
    /// Refuse a checkpoint whose link counts, sizes or kinds disagree: never
    /// mount an inconsistent volume.
    Mount,
    /// Load what can be loaded, so fsck can list every inconsistency.
    Fsck,
}

/// What mount and fsck read from a device: with `A` the allocator, or
/// `()` before free space is rebuilt ([`load_unscanned`]).
pub(crate) struct Loaded<A = Allocator> {
    pub sb: Superblock,
    pub slot: usize,
    pub generation: u64,
    /// Where the chain of checkpoints in `slot` ends.
    pub chain: checkpoint::ChainEnd,
    pub state: MetaState,
    pub alloc: A,
    pub replay_end: journal::ReplayEnd,
    pub journal_tail: u64,
    /// `(seq, addr, len)`: space the replayed records freed. Only the
    /// journal records those frees, so mount keeps it busy (see `alloc`).
    pub replay_freed: Vec<(u64, u64, u64)>,
    /// Damage loading worked around (fsck only; mount refuses instead).
    pub damage: Vec<String>,
    /// Index page copies that failed where the other copy verified (in
    /// `damage` too): mount warns, and its bases write those index pages
    /// again.
    pub damaged_index_copies: Vec<checkpoint::DamagedIndexCopy>,
    /// Set when block 0 was unusable and the backup superblock was read.
    pub from_backup: Option<superblock::FromBackup>,
    /// The superblock's clean-unmount mark names the newest checkpoint.
    pub clean_mark_names_newest: bool,
    /// Mount without a usable clean mark only: the free-space hint of the
    /// checkpoint record loaded, less every range journal replay placed
    /// after it (see [`load_unscanned`]); empty without one.
    pub checkpoint_free_hint: Vec<(u64, u64)>,
    /// Per slot, the spill extents of its checkpoint (in use, see
    /// [`build_allocator`]).
    pub spills: [Vec<checkpoint::SpillExtent>; superblock::CHECKPOINT_SLOTS],
    /// Per slot, the extent pages its base lists (in use likewise).
    pub pages: [crate::codec::PageTable; superblock::CHECKPOINT_SLOTS],
    /// Per slot, the index pages its base lists (in use likewise).
    pub index: [crate::codec::IndexTable; superblock::CHECKPOINT_SLOTS],
    /// Reads the pages of the chunks mount left absent (mount only: fsck
    /// reads every page).
    pub page_loader: Option<Arc<DevicePages>>,
}

/// Reads the superblock and newest checkpoint, replays the journal and
/// rebuilds free space, synchronously: fsck's loading (mount rebuilds
/// free space in the background, see [`crate::free_space`]).
pub(crate) fn load(device: &Arc<dyn BlockDevice>, strictness: Strictness) -> Result<Loaded> {
    let loaded = load_unscanned(device, strictness)?;
    let alloc = build_allocator(
        &loaded.sb,
        &loaded.state,
        &loaded.spills,
        &used_pages(&loaded.sb, &loaded.pages, &loaded.index),
    )?;
    Ok(loaded.with_alloc(alloc))
}

impl Loaded<()> {
    fn with_alloc(self, alloc: Allocator) -> Loaded {
        let Loaded {
            sb,
            slot,
            generation,
            chain,
            state,
            alloc: (),
            replay_end,
            journal_tail,
            replay_freed,
            damage,
            damaged_index_copies,
            from_backup,
            clean_mark_names_newest,
            checkpoint_free_hint,
            spills,
            pages,
            index,
            page_loader,
        } = self;
        Loaded {
            sb,
            slot,
            generation,
            chain,
            state,
            alloc,
            replay_end,
            journal_tail,
            replay_freed,
            damage,
            damaged_index_copies,
            from_backup,
            clean_mark_names_newest,
            checkpoint_free_hint,
            spills,
            pages,
            index,
            page_loader,
        }
    }
}

/// [`load`] without free space: the superblock, the newest checkpoint and
/// the journal replayed on it; for mount, also the free-space hint of the
/// checkpoint record it loaded less what replay placed
/// ([`Loaded::checkpoint_free_hint`]).
///
/// Why every byte of that hint is free in the state loaded here, though
/// the volume went down without unmount (the mount still checks it is in
/// the data area and off the listed pages and spill extents, and the
/// install claims what it handed out against the scan: a lie fails free
/// space for the session, never silently doubles a block):
///
/// - The hint is the largest *free* ranges of the allocator under the
///   lock the record's snapshot was taken under. The allocator marks
///   every extent of the state used, and space a record up to the
///   snapshot freed stays *busy* (not free) until a later checkpoint is
///   durable; so no hint range is used by the snapshot, which is the
///   record's state. Both slots' pages and spill extents stay allocated
///   while either slot lists them, and the pages and spill extents of
///   this record's own base, allocated after the snapshot, are cut out
///   before it is written (`transaction`).
/// - The state here is that snapshot with the journal after it replayed.
///   Every record that places space (`Record::placed`) is collected as
///   replay applies it and cut out below; records that convert, resize or
///   free place nothing new, and frees stay busy at mount (space replay
///   freed is held busy; the reserve never sees frees).
/// - Space allocated after the snapshot whose record never reached the
///   journal (the crash came first), including delayed allocation placed
///   at writeback, is referenced by nothing here: free.
/// - Extent pages and spill extents of the *next* checkpoint (a base
///   written after this record's snapshot) are listed by nothing here:
///   mount loads that base if it verifies (and then its own hint), and
///   a torn one verifies nowhere. If the newer slot is torn and mount
///   falls back to the older one, the hint read is the older record's,
///   with the journal after it replayed: the same argument holds for it.
///   Space the newer checkpoint released (busy space, pages its base
///   replaced) is reused only after the older record is marked
///   superseded, and a marked record with no newer one refuses the mount.
/// - The hint block sits where the next delta goes and names its
///   record's generation and crc: a delta written after the record
///   overwrites it (and is the record loaded, unless torn, when the old
///   hint, if it survived, is still its record's), and a block left by
///   another record never matches.
pub(crate) fn load_unscanned(
    device: &Arc<dyn BlockDevice>,
    strictness: Strictness,
) -> Result<Loaded<()>> {
    let dev_arc = device;
    let device: &dyn BlockDevice = &**device;
    let backup_use = match strictness {
        Strictness::Mount => superblock::BackupUse::IfDamaged,
        Strictness::Fsck => superblock::BackupUse::Always,
    };
    let (sb, from_backup) = superblock::read_superblock_or_backup(device, backup_use)?;
    // There is no read-only mount: a volume with read-only-compatible
    // features this build does not know (e.g. a clean-unmount mark it would
    // leave standing over its own journal appends) is refused, not written.
    if strictness == Strictness::Mount {
        sb.check_writable()?;
    }
    // Mount reads no page of the newest base (only those its chain's
    // deltas reach); fsck reads and checks every one.
    let reading = match strictness {
        Strictness::Mount => checkpoint::PageReading::OnDemand,
        Strictness::Fsck => checkpoint::PageReading::Survey,
    };
    let newest = checkpoint::read_checkpoints_reading(device, &sb, reading)?;
    let page_loader = (reading == checkpoint::PageReading::OnDemand)
        .then(|| Arc::new(DevicePages::new(dev_arc.clone(), sb.clone())));
    let mut damage = Vec::new();
    if let Some(lost) = &newest.lost {
        if strictness == Strictness::Mount {
            return Err(checkpoint::lost_error(&sb, lost));
        }
        damage.push(format!(
            "{lost}; what follows is generation {}'s state",
            lost.left_generation
        ));
    }
    damage.extend(newest.damaged_pages.iter().map(ToString::to_string));
    damage.extend(newest.damaged_index_copies.iter().map(ToString::to_string));
    let newest_damaged_index_copies = newest.damaged_index_copies;
    let (slot, chain, ckpt, spills, pages, index) = (
        newest.slot,
        newest.chain,
        newest.checkpoint,
        newest.spills,
        newest.pages,
        newest.index,
    );
    let slot_start = sb.layout.checkpoint_slots[slot].start;
    let block_size = sb.layout.block_size;
    let mut state = MetaState::from_image_and_pages(
        &ckpt.image,
        newest.paged,
        block_size,
        page_loader
            .clone()
            .map(|l| l as Arc<dyn crate::extent_map::PageLoader>),
    )
    .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    if strictness == Strictness::Mount {
        state
            .check_links_and_kinds()
            .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    }
    // The state lists no change yet: replay's are listed from here, which
    // is what lets the first checkpoint be a delta from the newest.
    let journal_start = sb.layout.journal.start;
    let clean_mark_names_newest = sb.clean_mark == Some(clean_mark_for(&ckpt));
    // fsck always scans: finding damage is its job, not mounting fast.
    let later =
        if strictness == Strictness::Mount && from_backup.is_none() && clean_mark_names_newest {
            journal::LaterBatches::TrustCleanMark
        } else {
            journal::LaterBatches::Scan
        };
    let mut freed = Vec::new();
    let mut replay_freed = Vec::new();
    // Only a mount without a usable clean mark (whose own hint stands
    // then) allocates from it; fsck builds free space itself.
    let record_free_hint =
        if later == journal::LaterBatches::Scan && strictness == Strictness::Mount {
            checkpoint::read_free_hint(device, &sb, slot, &chain)?
        } else {
            Vec::new()
        };
    let mut replay_placed = Vec::new();
    let replay_end = journal::replay(
        device,
        &sb,
        ckpt.journal_start,
        ckpt.journal_seq,
        ckpt.journal_chain,
        later,
        &mut |seq, record| {
            // The chunks the record changes, read first (a damaged one
            // fails the mount, naming the page: the record cannot apply).
            state.load_for_record(&record)?;
            state.apply(&record, &mut freed).map_err(|reason| {
                Error::corrupt(
                    "journal record",
                    journal_start,
                    format!("record {seq} does not apply: {reason}"),
                )
            })?;
            replay_freed.extend(freed.drain(..).map(|(addr, len)| (seq, addr, len)));
            if !record_free_hint.is_empty() {
                replay_placed.extend(record.placed());
            }
            Ok(())
        },
    )?;
    let checkpoint_free_hint = crate::free_space::hint_without(&record_free_hint, &replay_placed);
    Ok(Loaded {
        sb,
        slot,
        generation: ckpt.generation,
        chain,
        state,
        alloc: (),
        replay_end,
        journal_tail: ckpt.journal_start,
        replay_freed,
        damage,
        damaged_index_copies: newest_damaged_index_copies,
        from_backup,
        clean_mark_names_newest,
        checkpoint_free_hint,
        spills,
        pages,
        index,
        page_loader,
    })
}

/// The clean-unmount mark that says the journal holds nothing after `ckpt`.
pub(crate) fn clean_mark_for(ckpt: &Checkpoint) -> superblock::CleanMark {
    superblock::CleanMark {
        generation: ckpt.generation,
        journal_start: ckpt.journal_start,
        journal_seq: ckpt.journal_seq,
        journal_chain: ckpt.journal_chain,
    }
}

/// The device ranges of the extent pages, then of the index pages, both
/// slots' bases list, each page once (the bases share the pages neither
/// rewrote), each kind sorted. An index page at an extent page's range is
/// listed twice: an overlap for whoever builds free space from them.
///
/// Sorted in one vector sized at once: sets per slot merged into a third
/// took about 10 MB at once at 50M extents, most of a mount's peak heap.
pub(crate) fn used_pages(
    sb: &Superblock,
    pages: &[crate::codec::PageTable; superblock::CHECKPOINT_SLOTS],
    index: &[crate::codec::IndexTable; superblock::CHECKPOINT_SLOTS],
) -> Vec<(u64, u64)> {
    use crate::extent_pages::{index_page_ranges_listed, page_ranges_listed};
    let bs = sb.block_size();
    let listed: usize = pages
        .iter()
        .flat_map(|table| table.iter().map(|(_, list)| list.len()))
        .sum();
    let mut used = Vec::with_capacity(listed);
    used.extend(pages.iter().flat_map(|table| page_ranges_listed(table, bs)));
    used.sort_unstable();
    used.dedup();
    let mut index_pages: Vec<(u64, u64)> = index
        .iter()
        .flat_map(|table| index_page_ranges_listed(table, bs))
        .collect();
    index_pages.sort_unstable();
    index_pages.dedup();
    used.extend(index_pages);
    used
}

/// What uses a device range (see [`for_each_used_range`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UsedBy {
    /// The extent of inode `ino` at `file_off`.
    Extent { ino: Ino, file_off: u64 },
    /// A spill extent of the checkpoint in `slot`.
    Spill { slot: usize },
    /// An extent page or index page either slot's base lists.
    Page,
}

/// Calls `each` with every device range the volume uses: every extent of
/// every file (inodes in number order, extents in file order), both slots'
/// spill extents, then `pages` (from [`used_pages`]). Stops early,
/// returning `false`, when `each` does. The extents of an absent chunk
/// come from its page, read, passed and dropped: the chunk stays absent,
/// so the scan after mount leaves no map in memory. A page that does not
/// verify (or cannot be read) stops the pass with its error: free space
/// cannot be known without its extents. The one enumeration of used space
/// that the allocator is built from, at mount and by fsck.
pub(crate) fn for_each_used_range(
    state: &MetaState,
    spills: &[Vec<checkpoint::SpillExtent>],
    pages: &[(u64, u64)],
    each: &mut dyn FnMut(UsedBy, u64, u64) -> bool,
) -> Result<bool> {
    let mut inos: Vec<&Ino> = state.inodes.keys().collect();
    inos.sort_unstable();
    for ino in inos {
        let complete = state.inodes[ino].extents.for_each_unkept(0, |e| {
            let by = UsedBy::Extent {
                ino: *ino,
                file_off: e.file_off,
            };
            each(by, e.addr, e.len)
        })?;
        if !complete {
            return Ok(false);
        }
    }
    for (slot, spill) in spills.iter().enumerate() {
        for &(addr, len) in spill {
            if !each(UsedBy::Spill { slot }, addr, len) {
                return Ok(false);
            }
        }
    }
    for &(addr, len) in pages {
        if !each(UsedBy::Page, addr, len) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How often (in ranges) the scan looks whether it is to stop.
const RANGES_PER_CANCEL_CHECK: usize = 1 << 16;

/// Free space = the data area minus every extent and the spill extents and
/// extent pages (`pages`, from [`used_pages`]) of both slots' checkpoints
/// (the older is the fallback while the newer is not durable). An extent
/// outside the data area or overlapping another is corruption, and so is
/// an extent page that does not verify (its extents' blocks are unknown).
pub(crate) fn build_allocator(
    sb: &Superblock,
    state: &MetaState,
    spills: &[Vec<checkpoint::SpillExtent>],
    pages: &[(u64, u64)],
) -> Result<Allocator> {
    let never = AtomicBool::new(false);
    build_allocator_unless(sb, state, spills, pages, &never)
        .map(|built| built.expect("never cancelled"))
}

/// [`build_allocator`], or `None` once `cancel` is set.
pub(crate) fn build_allocator_unless(
    sb: &Superblock,
    state: &MetaState,
    spills: &[Vec<checkpoint::SpillExtent>],
    pages: &[(u64, u64)],
    cancel: &AtomicBool,
) -> Result<Option<Allocator>> {
    let data = &sb.layout.data;
    if cancel.load(Ordering::Relaxed) {
        return Ok(None);
    }
    // Claimed as enumerated: no list of the ranges, no sort. An overlap
    // shows on the second of the two ranges enumerated, named with its
    // owner there and then.
    let mut builder = Allocator::builder(data.start, data.len, sb.layout.block_size);
    let mut refused = None;
    let mut seen = 0usize;
    let complete = for_each_used_range(state, spills, pages, &mut |by, addr, len| {
        if let Err(reason) = builder.mark_used(addr, len) {
            refused = Some((by, addr, reason));
            return false;
        }
        seen += 1;
        !(seen.is_multiple_of(RANGES_PER_CANCEL_CHECK) && cancel.load(Ordering::Relaxed))
    })?;
    let Some((by, addr, reason)) = refused else {
        return Ok(complete.then(|| builder.finish()));
    };
    Err(match by {
        UsedBy::Extent { ino, file_off } => Error::corrupt(
            "extent map",
            addr,
            format!("inode {ino} extent at file offset {file_off}: {reason}"),
        ),
        UsedBy::Spill { slot } => Error::corrupt(
            "spill table",
            addr,
            format!("checkpoint slot {slot}'s spill extent: {reason}"),
        ),
        UsedBy::Page => Error::corrupt(
            "extent page",
            addr,
            format!("a checkpoint's extent page or index page: {reason}"),
        ),
    })
}
