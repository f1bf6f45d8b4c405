//! Bringing a volume up: format, mount (newest checkpoint, journal replay,
//! free space rebuilt from the extents, orphans freed), and the loading
//! that fsck shares with mount.

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::alloc::Allocator;
use crate::checkpoint::{self, Checkpoint};
use crate::journal::{self, JournalWriter};
use crate::limits::COMMIT_THRESHOLD_DIVISOR;
use crate::mount_state::{now, CommitState, Meta, VolumeInner};
use crate::state::MetaState;
use crate::superblock::{self, Layout, Superblock};
use crate::types::{Ino, Record};
use crate::{Error, Result};

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
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: 4096,
            journal_bytes: None,
            checkpoint_slot_bytes: None,
            root_owner: None,
            extent_pages: true,
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
        let root = state.encode_root_after(checkpoint::CHECKPOINT_HEADER_LEN, &Vec::new())?;
        let header = checkpoint::RecordHeader::of(&ckpt);
        checkpoint::write_base_record(&*device, &sb, 0, header, root)?;
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
/// replays the journal after it and frees orphans.
pub(crate) fn mount(
    device: Arc<dyn BlockDevice>,
    cache: iomap::FolioCache,
) -> Result<Arc<VolumeInner>> {
    let loaded = load(&*device, Strictness::Mount)?;
    let Loaded {
        sb,
        slot,
        generation,
        chain,
        chain_state,
        state,
        mut alloc,
        replay_end,
        journal_tail,
        replay_freed,
        damage: _,
        from_backup,
        clean_mark_names_newest: _,
        spills,
        pages,
    } = loaded;
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
    let commit_threshold = sb.layout.journal.len / COMMIT_THRESHOLD_DIVISOR;
    let mut meta = Meta::new(state, alloc, replay_end.next_seq);
    if sb.features_incompat & superblock::INCOMPAT_SPILLED_CHECKPOINTS != 0 {
        meta.spill_slot_bytes = Some(checkpoint::slot_capacity(&sb));
    }
    meta.extent_pages = sb.features_incompat & superblock::INCOMPAT_EXTENT_PAGES != 0;
    meta.shared_page_bytes =
        crate::extent_pages::shared_page_bytes(&pages[0], &pages[1], sb.block_size());
    meta.spilled_bytes = spills.iter().flatten().map(|&(_, len)| len).sum::<u64>()
        + used_pages(&sb, &pages)
            .iter()
            .map(|&(_, len)| len)
            .sum::<u64>();
    let deltas = sb.features_incompat & superblock::INCOMPAT_DELTA_CHECKPOINTS != 0;
    let commit = CommitState {
        journal,
        slot,
        generation,
        chain,
        spills,
        pages,
    };
    let mut inner = VolumeInner::new(device, sb, meta, commit, commit_threshold, cache);
    inner.mount_warnings = from_backup.iter().map(|b| b.to_string()).collect();
    inner.mounted_from_backup = from_backup.is_some();
    if deltas {
        *inner.checkpointing.get_mut() = Some(chain_state);
    }
    let inner = Arc::new(inner);
    // Inodes unlinked while open when the volume went down: nothing can
    // reach them any more.
    {
        let mut meta = inner.meta.write();
        let mut orphans: Vec<Ino> = meta
            .state
            .inodes
            .values()
            .filter(|i| i.nlink == 0)
            .map(|i| i.ino)
            .collect();
        orphans.sort_unstable();
        for ino in orphans {
            meta.log(Record::FreeInode { ino })?;
        }
    }
    Ok(inner)
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

/// What mount and fsck read from a device.
pub(crate) struct Loaded {
    pub sb: Superblock,
    pub slot: usize,
    pub generation: u64,
    /// Where the chain of checkpoints in `slot` ends.
    pub chain: checkpoint::ChainEnd,
    /// The state the newest checkpoint holds, before journal replay.
    pub chain_state: MetaState,
    pub state: MetaState,
    pub alloc: Allocator,
    pub replay_end: journal::ReplayEnd,
    pub journal_tail: u64,
    /// `(seq, addr, len)`: space the replayed records freed. Only the
    /// journal records those frees, so mount keeps it busy (see `alloc`).
    pub replay_freed: Vec<(u64, u64, u64)>,
    /// Damage loading worked around (fsck only; mount refuses instead).
    pub damage: Vec<String>,
    /// Set when block 0 was unusable and the backup superblock was read.
    pub from_backup: Option<superblock::FromBackup>,
    /// The superblock's clean-unmount mark names the newest checkpoint.
    pub clean_mark_names_newest: bool,
    /// Per slot, the spill extents of its checkpoint (in use, see
    /// [`build_allocator`]).
    pub spills: [Vec<checkpoint::SpillExtent>; superblock::CHECKPOINT_SLOTS],
    /// Per slot, the extent pages its base lists (in use likewise).
    pub pages: [crate::codec::PageTable; superblock::CHECKPOINT_SLOTS],
}

/// Reads the superblock and newest checkpoint, replays the journal and
/// rebuilds free space. Shared by mount and fsck.
pub(crate) fn load(device: &dyn BlockDevice, strictness: Strictness) -> Result<Loaded> {
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
    let newest = checkpoint::read_checkpoints(device, &sb)?;
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
    let (slot, chain, ckpt, spills, pages) = (
        newest.slot,
        newest.chain,
        newest.checkpoint,
        newest.spills,
        newest.pages,
    );
    let slot_start = sb.layout.checkpoint_slots[slot].start;
    let block_size = sb.layout.block_size;
    let mut state = MetaState::from_image_and_pages(&ckpt.image, newest.paged, block_size)
        .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    if strictness == Strictness::Mount {
        state
            .check_links_and_kinds()
            .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    }
    // O(1): replay below changes `state` copy-on-write.
    let chain_state = state.clone();
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
    let replay_end = journal::replay(
        device,
        &sb,
        ckpt.journal_start,
        ckpt.journal_seq,
        ckpt.journal_chain,
        later,
        &mut |seq, record| {
            state.apply(&record, &mut freed).map_err(|reason| {
                Error::corrupt(
                    "journal record",
                    journal_start,
                    format!("record {seq} does not apply: {reason}"),
                )
            })?;
            replay_freed.extend(freed.drain(..).map(|(addr, len)| (seq, addr, len)));
            Ok(())
        },
    )?;
    let alloc = build_allocator(&sb, &state, &spills, &used_pages(&sb, &pages))?;
    Ok(Loaded {
        sb,
        slot,
        generation: ckpt.generation,
        chain,
        chain_state,
        state,
        alloc,
        replay_end,
        journal_tail: ckpt.journal_start,
        replay_freed,
        damage,
        from_backup,
        clean_mark_names_newest,
        spills,
        pages,
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

/// The device ranges of the extent pages both slots' bases list, each
/// once (the bases share the pages neither rewrote).
pub(crate) fn used_pages(
    sb: &Superblock,
    pages: &[crate::codec::PageTable; superblock::CHECKPOINT_SLOTS],
) -> Vec<(u64, u64)> {
    let bs = sb.block_size();
    let mut used = crate::extent_pages::page_ranges(&pages[0], bs);
    used.extend(crate::extent_pages::page_ranges(&pages[1], bs));
    used.into_iter().collect()
}

/// Free space = the data area minus every extent and the spill extents and
/// extent pages (`pages`, from [`used_pages`]) of both slots' checkpoints
/// (the older is the fallback while the newer is not durable). An extent
/// outside the data area or overlapping another is corruption.
pub(crate) fn build_allocator(
    sb: &Superblock,
    state: &MetaState,
    spills: &[Vec<checkpoint::SpillExtent>],
    pages: &[(u64, u64)],
) -> Result<Allocator> {
    let data = &sb.layout.data;
    let mut inos: Vec<&Ino> = state.inodes.keys().collect();
    inos.sort_unstable();
    let owners: Vec<(Ino, &crate::types::Extent)> = inos
        .into_iter()
        .flat_map(|ino| state.inodes[ino].extents.iter().map(move |e| (*ino, e)))
        .collect();
    let spilled: Vec<(usize, checkpoint::SpillExtent)> = spills
        .iter()
        .enumerate()
        .flat_map(|(slot, s)| s.iter().map(move |&e| (slot, e)))
        .collect();
    let used: Vec<(u64, u64)> = owners
        .iter()
        .map(|(_, e)| (e.addr, e.len))
        .chain(spilled.iter().map(|&(_, e)| e))
        .chain(pages.iter().copied())
        .collect();
    Allocator::with_used(data.start, data.len, sb.layout.block_size, &used).map_err(
        |(i, reason)| match owners.get(i) {
            Some(&(ino, ext)) => Error::corrupt(
                "extent map",
                ext.addr,
                format!(
                    "inode {ino} extent at file offset {}: {reason}",
                    ext.file_off
                ),
            ),
            None if i < owners.len() + spilled.len() => {
                let (slot, (addr, _)) = spilled[i - owners.len()];
                Error::corrupt(
                    "spill table",
                    addr,
                    format!("checkpoint slot {slot}'s spill extent: {reason}"),
                )
            }
            None => {
                let (addr, _) = pages[i - owners.len() - spilled.len()];
                Error::corrupt(
                    "extent page",
                    addr,
                    format!("a checkpoint's extent page: {reason}"),
                )
            }
        },
    )
}
