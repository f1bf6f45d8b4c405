//! The state of a mounted volume that every handle shares: device,
//! superblock, in-memory metadata, journal writer, open-inode table and
//! shutdown flag. It sits below both [`crate::volume`] (the public face) and
//! [`crate::file`] (open files), so each of them imports it and neither needs
//! the other; the operations on it live in the modules named after them
//! (`mount`, `namespace`, `transaction`, `handles`).
//!
//! Locking (always taken in this order, never the reverse):
//! 1. an inode's I/O lock ([`iomap::InodeIoLock`]), held across data I/O;
//! 2. `commit` — the journal writer; held across journal and checkpoint I/O;
//! 3. `meta` — the in-memory metadata; held briefly, never across I/O (a
//!    checkpoint holds it only to clone the copy-on-write state, then
//!    encodes and writes the clone without it).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use blockdev::BlockDevice;
use iomap::sharded_rwlock::ShardedRwLock;
use iomap::{FlushCoalescer, FolioCache, InodeIoLock, Mapping};
use parking_lot::Mutex;

use crate::background_request::BackgroundRequest;
use crate::checkpoint::CHECKPOINT_HEADER_LEN;
use crate::codec::RECORD_MIN_ENCODED_LEN;
use crate::free_space::{FreeSpace, FreeSpaceGate};
use crate::journal::JournalWriter;
use crate::limits::{CHECKPOINT_HEADROOM, RECORD_BYTES_ESTIMATE};
use crate::state::{MetaState, IMAGE_BYTES_PER_EXTENT};
use crate::superblock::Superblock;
use crate::types::{Ino, InoMap, Record, Timestamp};
use crate::{Error, Result};

// The commit threshold counts every record at least as big as the smallest.
const _: () = assert!(RECORD_BYTES_ESTIMATE >= RECORD_MIN_ENCODED_LEN as u64);
// The headroom covers at least the slot's header.
const _: () = assert!(CHECKPOINT_HEADROOM >= CHECKPOINT_HEADER_LEN as u64);

/// An inode some handle has open: what the I/O engine locks, and its page
/// cache. (Also an inode nobody has open any more whose cache still holds
/// dirty data: it stays until writeback, see [`crate::handles`].)
pub struct OpenInode {
    pub(crate) ino: Ino,
    pub(crate) io_lock: InodeIoLock,
    pub(crate) mapping: Mapping,
    /// Open handles (`File`s, including those asynchronous requests hold
    /// while in flight). Atomic so that cloning a handle per request takes
    /// no lock; reaching zero takes the metadata lock to close the inode.
    pub(crate) handles: AtomicUsize,
    /// When the newest write not yet in the inode's logged attributes
    /// happened (ns since the epoch; 0: none): its mtime and ctime, kept
    /// here so that a write takes no metadata lock for them. See
    /// [`crate::write_times`].
    pub(crate) write_time_ns: AtomicU64,
}

impl OpenInode {
    /// An open inode with no handles yet.
    pub(crate) fn new(ino: Ino, cache: &FolioCache) -> OpenInode {
        OpenInode {
            ino,
            io_lock: InodeIoLock::new(),
            mapping: cache.new_mapping(),
            handles: AtomicUsize::new(0),
            write_time_ns: AtomicU64::new(0),
        }
    }
}

impl AsRef<InodeIoLock> for OpenInode {
    fn as_ref(&self) -> &InodeIoLock {
        &self.io_lock
    }
}

pub(crate) struct OpenEntry {
    pub(crate) inode: Arc<OpenInode>,
}

pub(crate) struct Meta {
    pub state: MetaState,
    /// The allocator, once mount's scan has built it (see
    /// [`crate::free_space`]).
    pub alloc: FreeSpace,
    /// Applied but not yet journaled, in sequence order.
    pub(crate) pending: Vec<Record>,
    /// Sequence number the next record gets.
    pub(crate) next_seq: u64,
    pub(crate) pending_bytes: u64,
    pub(crate) open: InoMap<OpenEntry>,
    /// Newest record that is durable.
    committed_seq: u64,
    /// Per inode, the newest record that changed it: an inode is dirty while
    /// that record is not durable, and a write to it is then not metadata-free.
    last_change: InoMap<u64>,
    /// Delayed allocations of buffered writes, per inode (see
    /// [`crate::delalloc`]), and the bytes they reserve.
    pub(crate) delalloc: InoMap<std::collections::BTreeMap<u64, u64>>,
    pub(crate) delalloc_reserved: u64,
    /// In-core sizes above the on-disk size (`InodeState::size`): buffered
    /// writes past EOF not written back yet. Never journaled.
    pub(crate) size_in_core: InoMap<u64>,
    /// The slot capacity past which the checkpoint image spills to the data
    /// area, on volumes whose images spill (`None`: they never do, and an
    /// image must fit its slot).
    pub(crate) spill_slot_bytes: Option<u64>,
    /// Bytes of the spill extents checkpoints hold (both slots', and those
    /// of a checkpoint being written), and of the extent pages either
    /// slot's base lists.
    pub(crate) spilled_bytes: u64,
    /// Bases are roots with extent pages (`INCOMPAT_EXTENT_PAGES`): the
    /// space kept for the next base covers its pages too.
    pub(crate) extent_pages: bool,
    /// Roots list index pages (`INCOMPAT_PAGE_INDEX`): that space covers
    /// them too.
    pub(crate) page_index: bool,
    /// Bytes of the extent pages (and index pages) both slots' bases
    /// list. A base frees only pages neither the other slot nor itself
    /// lists, so these stay in use through the next base whatever it
    /// rewrites, and are freed at the earliest by the one after
    /// ([`Meta::base_reserve_for`]).
    pub(crate) shared_page_bytes: u64,
    /// Bytes in the data area the slot the next base is written over
    /// holds (its spill extents, extent pages and index pages, those the
    /// other slot lists too included). Less `shared_page_bytes`, what
    /// that base frees if it reuses none of them; one that reuses some
    /// takes as much less ([`Meta::base_reserve_for`]).
    pub(crate) replaced_slot_bytes: u64,
    /// Per regular file, extents its pending work may still add to its map
    /// (see [`crate::delalloc`]: the room held for writeback and for
    /// splits at I/O completion), and their sum. The room for the next
    /// base counts them as if already in the maps, so the call that takes
    /// them is the one refused, never a writeback or a completion.
    pub(crate) held: InoMap<u64>,
    pub(crate) held_extents: u64,
    /// Per file, the block range of the last write that held its splits
    /// (see [`Meta::splits_to_hold`]).
    pub(crate) split_hold: InoMap<(u64, u64)>,
    /// Per file, the direct writes in flight that hold splits: their block
    /// range and the extents held, part of `held`, released at the write's
    /// completion ([`Meta::release_direct_splits`]).
    pub(crate) direct_splits: InoMap<Vec<DirectSplits>>,
}

/// The splits one direct write of `[start, end)` holds (see
/// [`Meta::direct_splits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectSplits {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) extents: u64,
}

/// What a change may add to the next base, for the space kept for it:
/// `image` bytes to the image (extents included), and `file`, a regular
/// file's map (its size now) gaining up to that many extents, each of
/// which may split a chunk.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BaseGrowth {
    pub(crate) image: u64,
    pub(crate) file: Option<(crate::state::MapSize, u64)>,
}

/// The journal writer and the newest checkpoint: what the `commit` lock
/// guards. Here rather than in `transaction` because it is a field of
/// [`VolumeInner`].
pub(crate) struct CommitState {
    pub(crate) journal: JournalWriter,
    /// Slot holding the newest checkpoint.
    pub(crate) slot: usize,
    pub(crate) generation: u64,
    /// Where the chain of checkpoints in `slot` ends: what the next delta
    /// checkpoint follows.
    pub(crate) chain: crate::checkpoint::ChainEnd,
    /// Per slot, the spill extents of the checkpoint it holds: used space
    /// until a checkpoint written over that slot is durable.
    pub(crate) spills: [Vec<crate::checkpoint::SpillExtent>; crate::superblock::CHECKPOINT_SLOTS],
    /// Per slot, the extent pages its base lists (volumes with
    /// `INCOMPAT_EXTENT_PAGES`): used space while either slot lists them.
    pub(crate) pages:
        [std::sync::Arc<crate::codec::PageTable>; crate::superblock::CHECKPOINT_SLOTS],
    /// Per slot, the index pages its base lists (volumes with
    /// `INCOMPAT_PAGE_INDEX`), which list `pages`: used space likewise.
    pub(crate) index:
        [std::sync::Arc<crate::codec::IndexTable>; crate::superblock::CHECKPOINT_SLOTS],
    /// Index pages (by address) one of whose copies failed at mount: a
    /// base writes their runs again rather than list them, so that once
    /// neither slot lists them no checkpoint depends on one copy. Kept
    /// while either slot lists them.
    pub(crate) index_to_rewrite: std::collections::BTreeSet<u64>,
}

pub struct VolumeInner {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) sb: Superblock,
    pub(crate) block_size: u32,
    /// Sharded by CPU (the simple-read path takes it shared on every
    /// read; see `iomap::sharded_rwlock`).
    pub(crate) meta: ShardedRwLock<Meta>,
    pub(crate) commit: Mutex<CommitState>,
    /// Held by a checkpoint from its snapshot until it is durable (it takes
    /// `commit` only at both ends): one checkpoint at a time. Taken before
    /// `commit`, never while holding it. Holds whether the changes the
    /// state lists (`MetaState::take_changed`) are those since the newest
    /// checkpoint's state, so that the next checkpoint may be a delta from
    /// it; `false` when the next checkpoint must be whole.
    pub(crate) checkpointing: Mutex<bool>,
    shutdown: Mutex<Option<String>>,
    /// Set once `shutdown` holds a reason.
    is_shut_down: AtomicBool,
    pub(crate) commit_threshold: u64,
    /// Shares flushes among concurrent DSYNC overwrites.
    pub(crate) flush_coalescer: Arc<FlushCoalescer>,
    /// The device's request slots, shared by the volume's asynchronous
    /// queues.
    pub(crate) device_slots: Arc<iomap::aio::DeviceSlots>,
    /// The page cache of every file of this volume.
    pub(crate) cache: FolioCache,
    /// Writeback errors of files closed since: the next `Volume::sync`
    /// reports them (syncfs-like), so none is dropped silently.
    pub(crate) lost_writeback: Mutex<Vec<String>>,
    /// Damage mount worked around, for the caller to show (e.g. the primary
    /// superblock was unusable and the backup was read).
    pub(crate) mount_warnings: Vec<String>,
    /// Damage found after mount by the background scan: second copies of
    /// index pages that fail (mount reads first copies only).
    pub(crate) scan_warnings: Mutex<Vec<String>>,
    /// Reads the extent pages of chunks mount left absent (`None`: a
    /// volume without extent pages, or nothing left absent).
    pub(crate) page_loader: Option<Arc<crate::page_loader::DevicePages>>,
    /// Block 0 was unusable and the backup superblock was read: block 0 is
    /// left as it is (for `fsck --repair`), so no clean-unmount mark goes
    /// there.
    pub(crate) mounted_from_backup: bool,
    /// Commits that leave the journal half full ask here for a background
    /// checkpoint (see [`crate::background_thread`]).
    pub(crate) checkpoint_request: Arc<BackgroundRequest>,
    /// The count of chunks changed from paged (`DevicePages::unpaged_so_far`)
    /// at which the next change asks the checkpoint thread to look at the
    /// changed chunks' bytes (`u64::MAX`: asked, not looked yet), and the
    /// count when it asked (see
    /// `VolumeInner::ask_checkpoint_if_unpaged_may_pass`).
    pub(crate) unpaged_look_at: AtomicU64,
    pub(crate) unpaged_asked_at: AtomicU64,
    /// Changes whose records reach the commit threshold ask here for a
    /// background commit (see [`crate::background_thread`]).
    pub(crate) commit_request: Arc<BackgroundRequest>,
    /// Opens when mount's scan has installed the allocator in `meta`
    /// (see [`crate::free_space`]): what allocating calls wait on,
    /// without the metadata lock.
    pub(crate) free_space_gate: FreeSpaceGate,
    /// Where the evictor of extent chunks goes on from: an inode and the
    /// first key of a chunk in its map (see [`crate::extent_cache`]): a key
    /// stays meaningful while the map changes between the sweep's holds,
    /// and finds its chunk by halves.
    pub(crate) evict_hand: Mutex<(Ino, u64)>,
    /// The longest holds of `meta` by checkpoints and the evictor.
    pub(crate) lock_holds: crate::lock_holds::LockHolds,
}

impl CommitState {
    /// See [`Meta::replaced_slot_bytes`]: the slot the next base is
    /// written over is the one the chain does not end in.
    pub(crate) fn replaced_slot_bytes(&self, sb: &Superblock) -> u64 {
        let replaced = crate::checkpoint::other_slot(self.slot);
        self.spills[replaced]
            .iter()
            .map(|&(_, len)| len)
            .sum::<u64>()
            + crate::checkpoint::listed_page_bytes(sb, &self.pages[replaced], &self.index[replaced])
    }
}

impl VolumeInner {
    /// A live volume (not shut down).
    pub(crate) fn new(
        dev: Arc<dyn BlockDevice>,
        sb: Superblock,
        meta: Meta,
        commit: CommitState,
        commit_threshold: u64,
        cache: FolioCache,
    ) -> VolumeInner {
        let device_slots = Arc::new(iomap::aio::DeviceSlots::new(dev.request_slots()));
        VolumeInner {
            dev,
            block_size: sb.layout.block_size,
            sb,
            meta: ShardedRwLock::new(meta),
            commit: Mutex::new(commit),
            checkpointing: Mutex::new(false),
            shutdown: Mutex::new(None),
            is_shut_down: AtomicBool::new(false),
            commit_threshold,
            mount_warnings: Vec::new(),
            scan_warnings: Mutex::new(Vec::new()),
            page_loader: None,
            mounted_from_backup: false,
            flush_coalescer: Arc::new(FlushCoalescer::new()),
            device_slots,
            cache,
            lost_writeback: Mutex::new(Vec::new()),
            checkpoint_request: Arc::default(),
            unpaged_look_at: AtomicU64::new(0),
            unpaged_asked_at: AtomicU64::new(0),
            commit_request: Arc::default(),
            free_space_gate: FreeSpaceGate::done(),
            evict_hand: Mutex::new((0, 0)),
            lock_holds: Default::default(),
        }
    }

    /// Whether a commit thread answers `commit_request` (a stopped one,
    /// after the last `Volume` handle went, does not).
    pub(crate) fn commits_in_background(&self) -> bool {
        self.commit_request.is_served()
    }

    pub fn check_live(&self) -> Result<()> {
        // Every I/O asks: one relaxed load, the reason only when it is set.
        if !self.is_shut_down.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.shutdown.lock() {
            Some(reason) => Err(Error::Shutdown {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses every later call: memory is ahead of the disk (see the fault
    /// model in [`crate::transaction`]).
    pub(crate) fn shut_down(&self, err: &Error) {
        let mut shutdown = self.shutdown.lock();
        if shutdown.is_none() {
            *shutdown = Some(err.to_string());
        }
        self.is_shut_down.store(true, Ordering::Release);
    }
}

/// The current time, for the records that carry one.
pub(crate) fn now() -> Timestamp {
    Timestamp::from_ns(now_ns())
}

pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl Meta {
    /// The metadata as loaded: every record up to `next_seq` is durable.
    pub(crate) fn new(mut state: MetaState, alloc: FreeSpace, next_seq: u64) -> Meta {
        // A mount may have rebuilt maps from extent pages.
        state.recount();
        Meta {
            state,
            alloc,
            pending: Vec::new(),
            next_seq,
            pending_bytes: 0,
            open: InoMap::default(),
            committed_seq: next_seq - 1,
            last_change: InoMap::default(),
            delalloc: InoMap::default(),
            delalloc_reserved: 0,
            size_in_core: InoMap::default(),
            spill_slot_bytes: None,
            spilled_bytes: 0,
            extent_pages: false,
            page_index: false,
            shared_page_bytes: 0,
            replaced_slot_bytes: 0,
            held: InoMap::default(),
            held_extents: 0,
            split_hold: InoMap::default(),
            direct_splits: InoMap::default(),
        }
    }

    /// The size reads see: the on-disk size, or above it what buffered
    /// writes not yet written back reached.
    pub(crate) fn size_in_core(&self, ino: Ino) -> Option<u64> {
        let disk = self.state.inode(ino)?.size;
        Some(self.size_in_core.get(&ino).map_or(disk, |&s| s.max(disk)))
    }

    /// Keeps the in-memory-only state (delayed allocations, in-core sizes,
    /// pending write times) in step with a record just applied.
    fn follow_record(&mut self, record: &Record) {
        let block = u64::from(self.state.block_size);
        match *record {
            Record::SetSize { ino, size, .. } => {
                self.size_in_core.remove(&ino);
                self.release_delalloc(ino, size.next_multiple_of(block), u64::MAX);
                self.drop_write_time(ino);
            }
            Record::Punch {
                ino, file_off, len, ..
            } => {
                self.release_delalloc(ino, file_off, file_off + len);
                self.drop_write_time(ino);
            }
            Record::FreeInode { ino } => {
                self.size_in_core.remove(&ino);
                self.release_delalloc(ino, 0, u64::MAX);
                self.release_holds(ino);
            }
            Record::CompleteWrite { ino, .. } => {
                let disk = self.state.inode(ino).map_or(0, |i| i.size);
                if self.size_in_core.get(&ino).is_some_and(|&s| s <= disk) {
                    self.size_in_core.remove(&ino);
                }
            }
            _ => {}
        }
    }

    /// Applies `record` to memory and queues it for the journal. Space it
    /// releases stays busy until a checkpoint holding the record is durable.
    pub fn log(&mut self, record: Record) -> Result<u64> {
        // Absent chunks the record changes, read before anything changes:
        // a damaged page fails this operation only (EIO), not the volume.
        self.state.load_for_record(&record)?;
        let mut freed = Vec::new();
        self.state
            .apply(&record, &mut freed)
            .map_err(|reason| Error::invalid("metadata update", reason))?;
        let seq = self.next_seq;
        self.next_seq += 1;
        for (addr, len) in freed {
            self.alloc
                .free(addr, len, seq)
                .map_err(|reason| Error::corrupt("free space", addr, reason))?;
        }
        if let Some(ino) = record_inode(&record) {
            self.last_change.insert(ino, seq);
        }
        self.follow_record(&record);
        self.pending.push(record);
        self.pending_bytes += RECORD_BYTES_ESTIMATE;
        Ok(seq)
    }

    /// Puts `records`, taken from the queue by a commit that could not
    /// journal them, back in front of what was queued since.
    pub(crate) fn requeue(&mut self, mut records: Vec<Record>) {
        self.pending_bytes += records.len() as u64 * RECORD_BYTES_ESTIMATE;
        records.append(&mut self.pending);
        self.pending = records;
    }

    /// The inode has metadata changes that are not durable yet.
    pub fn is_dirty(&self, ino: Ino) -> bool {
        self.last_change
            .get(&ino)
            .is_some_and(|&seq| seq > self.committed_seq)
    }

    /// The journal is durable through record `seq`. Space those records
    /// freed stays busy until a checkpoint holds them (see `alloc`).
    pub(crate) fn mark_committed(&mut self, seq: u64) {
        self.committed_seq = self.committed_seq.max(seq);
        let committed = self.committed_seq;
        self.last_change.retain(|_, &mut last| last > committed);
    }

    /// Refuses a change that could grow the checkpoint image past its slot
    /// or, on volumes whose images spill, past the data-area space kept
    /// for it ([`Meta::base_reserve_for`]).
    pub fn reserve_image(&self, sb: &Superblock, extra: u64) -> Result<()> {
        self.reserve_base(
            sb,
            BaseGrowth {
                image: extra,
                file: None,
            },
        )
    }

    /// Refuses a change that could grow the next base's payload (image or
    /// root) past its slot, when images do not spill, or the space that
    /// base needs past the free space delayed allocations leave.
    pub(crate) fn reserve_base(&self, sb: &Superblock, growth: BaseGrowth) -> Result<()> {
        let slot = sb.layout.checkpoint_slots[0].len;
        let needed = self.base_payload_estimate(growth) + CHECKPOINT_HEADROOM;
        if needed > slot && self.spill_slot_bytes.is_none() {
            return Err(Error::NoSpace {
                what: "metadata (checkpoint slot)".to_string(),
                needed,
                available: slot,
            });
        }
        let reserve = self.base_reserve_for(growth);
        if reserve == 0 {
            return Ok(());
        }
        let available = self
            .alloc
            .allocator()?
            .free_bytes()
            .saturating_sub(self.delalloc_reserved);
        if reserve > available {
            return Err(Error::NoSpace {
                what: if self.extent_pages {
                    "metadata (the next checkpoint base's extent pages and spilled root)"
                } else {
                    "metadata (checkpoint image spilled to the data area)"
                }
                .to_string(),
                needed: reserve,
                available,
            });
        }
        Ok(())
    }

    /// Free data-area bytes kept for the next base (see
    /// [`Meta::base_reserve_for`]), were its image to grow by `extra`
    /// bytes.
    #[cfg(test)]
    pub(crate) fn spill_reserve_for(&self, extra: u64) -> u64 {
        self.base_reserve_for(BaseGrowth {
            image: extra,
            file: None,
        })
    }

    /// Free data-area bytes kept for the next bases, were the next to
    /// grow by `growth`. A base takes up to [`Meta::next_base_bytes`] and,
    /// once durable, frees what only the slot it was written over listed;
    /// what both slots list is freed by the base after at the earliest.
    /// With no space given back in between, the next base takes a set and
    /// frees the replaced slot's own bytes, the one after takes a set and
    /// frees the rest of what the slots hold now, and only from the third
    /// on does each free a set as large as it takes. So free space holds
    /// up to three sets, less what the slots hold: a map that grows by a
    /// page grows both slots' sets by a page before a base frees one
    /// (docs/EXTENT_PAGES.md, "Room for the bases after the next").
    /// Data allocations leave this free ([`Meta::unreserved_bytes`]), so
    /// that bases find their space, and `statfs` does not count it as free.
    pub(crate) fn base_reserve_for(&self, growth: BaseGrowth) -> u64 {
        room_for_bases(
            self.next_base_bytes(growth),
            self.replaced_slot_bytes
                .saturating_sub(self.shared_page_bytes),
            self.spilled_bytes,
        )
    }

    /// The most a base takes from the data area, were it to grow by
    /// `growth`: its payload (the image, or with extent pages the root),
    /// in whole blocks, when that does not fit the slot, and with extent
    /// pages a new page for every chunk of every paged file (at worst it
    /// rewrites them all).
    pub(crate) fn next_base_bytes(&self, growth: BaseGrowth) -> u64 {
        let block_size = u64::from(self.state.block_size);
        let payload = match self.spill_slot_bytes {
            Some(slot) => {
                let needed = self.base_payload_estimate(growth) + CHECKPOINT_HEADROOM;
                if needed <= slot {
                    0
                } else {
                    needed.next_multiple_of(block_size)
                }
            }
            None => 0,
        };
        if !self.extent_pages {
            return payload;
        }
        let paged = self.paged_after(growth);
        // A page of n extents takes (32 + 25 n) bytes rounded up to a
        // block: less than 32 + 25 n + a block. Where free space has no
        // run that long, the chunk goes as one-block pages of at most
        // `per_block` extents each: fewer than n / per_block + 1 blocks.
        let whole_pages = paged.extents * IMAGE_BYTES_PER_EXTENT
            + paged.chunks * (crate::codec::PAGE_HEADER_LEN as u64 + block_size);
        let per_block = crate::codec::inline_extents_max(block_size).max(1) as u64;
        let most_pages = paged.extents.div_ceil(per_block) + paged.chunks;
        let block_pages = most_pages * block_size;
        // With index pages, the index pages of every page, were all new:
        // a file's are at most `index_pages_at_most` of its pages, each
        // written twice.
        let index_pages = if self.page_index {
            crate::extent_pages::index_pages_at_most(most_pages, paged.files, block_size)
                * crate::codec::INDEX_COPIES as u64
                * block_size
        } else {
            0
        };
        payload + whole_pages.max(block_pages).next_multiple_of(block_size) + index_pages
    }

    /// The bytes of the next base's payload, were it to grow by `growth`:
    /// the image, or with extent pages the root (the image less the paged
    /// files' extents, plus their page table).
    fn base_payload_estimate(&self, growth: BaseGrowth) -> u64 {
        let held = self.held_extents + self.fragmentation_extents();
        let image =
            self.state.image_bytes_estimate() + growth.image + image_bytes_for_extents(held);
        if !self.extent_pages {
            return image;
        }
        let paged = self.paged_after(growth);
        // With index pages a root lists at most `index_pages_at_most`
        // references of 56 bytes per file: 2P / max + 1 each, within 32
        // per page (a page reference's bytes) and one more per file, as
        // `max` is at least 4 at any block size.
        let per_file = if self.page_index {
            ROOT_BYTES_PER_PAGED_FILE + crate::codec::INDEX_REF_ENCODED_LEN as u64
        } else {
            ROOT_BYTES_PER_PAGED_FILE
        };
        (image + paged.files * per_file + paged.chunks * ROOT_BYTES_PER_PAGE)
            .saturating_sub(paged.extents * IMAGE_BYTES_PER_EXTENT)
    }

    /// What `holes` new ranges of `ino`'s map may add to the next base:
    /// [`crate::limits::EXTENTS_PER_HOLE_ESTIMATE`] extents each.
    pub(crate) fn growth_for_holes(&self, ino: Ino, holes: usize) -> BaseGrowth {
        self.growth_for_extents(ino, holes as u64 * crate::limits::EXTENTS_PER_HOLE_ESTIMATE)
    }

    /// What `extents` more extents of `ino`'s map may add to the next base.
    pub(crate) fn growth_for_extents(&self, ino: Ino, extents: u64) -> BaseGrowth {
        BaseGrowth {
            image: image_bytes_for_extents(extents),
            file: self
                .state
                .inode(ino)
                .map(|i| (crate::state::MapSize::of(&i.extents), extents)),
        }
    }

    /// [`MetaState::paged_size`] after `growth`.
    fn paged_after(&self, growth: BaseGrowth) -> crate::state::PagedSize {
        let now = self.state.paged_size().plus(self.pending_paged());
        let Some((size, extra)) = growth.file else {
            return now;
        };
        let block_size = u64::from(self.state.block_size);
        let grown = crate::state::MapSize {
            extents: size.extents + extra,
            chunks: size.chunks
                + crate::extent_map::chunks_added_at_most(size.chunks.max(1), extra),
        };
        now.minus(size.paged(block_size))
            .plus(grown.paged(block_size))
    }
}

impl Meta {
    /// What the held extents may add to the paged maps, at worst: the
    /// chunks a file's holds can add ([`crate::extent_map::chunks_added_at_most`];
    /// the extents of fragmentation each their own), and each file with
    /// holds paged by them, its inline extents too, in the chunks its map
    /// has now (a file that grows past the inline bound is paged whole,
    /// a page per chunk; a file paged already is counted in the state).
    fn pending_paged(&self) -> crate::state::PagedSize {
        let files = self.held.len() as u64;
        if files == 0 {
            return crate::state::PagedSize::default();
        }
        let block_size = u64::from(self.state.block_size);
        let inline = crate::codec::inline_extents_max(block_size) as u64;
        let fragmentation = self.fragmentation_extents();
        let extents = self.held_extents + fragmentation;
        let mut chunks = fragmentation;
        for (&ino, &held) in &self.held {
            let size = self
                .state
                .inode(ino)
                .map_or(crate::state::MapSize::default(), |inode| {
                    crate::state::MapSize::of(&inode.extents)
                });
            let now = size.chunks.max(1);
            chunks += crate::extent_map::chunks_added_at_most(now, held);
            // A file paged already is in the state; one more chunk for
            // it as before, the inline ones whole.
            chunks += match size.paged(block_size).files {
                0 => now,
                _ => 1,
            };
        }
        crate::state::PagedSize {
            files,
            extents: extents + files * inline,
            chunks,
        }
    }

    /// Extents writeback of the delayed allocations may add beyond one per
    /// range (held): the allocator returns a piece shorter than asked only
    /// when it takes a whole free range, the largest, so the pieces past
    /// the first of each allocation are at most the free ranges, and at
    /// most the blocks reserved.
    pub(crate) fn fragmentation_extents(&self) -> u64 {
        if self.delalloc_reserved == 0 {
            return 0;
        }
        let blocks = self.delalloc_reserved / u64::from(self.state.block_size);
        // While mount's scan runs, the bound without the free ranges (the
        // reserve's are not those writeback will take from).
        self.alloc
            .installed()
            .map_or(blocks, |a| blocks.min(a.free_extent_count() as u64))
    }
}

/// Bytes a root's page table spends per paged file and per page.
const ROOT_BYTES_PER_PAGED_FILE: u64 = 8 + 4;
const ROOT_BYTES_PER_PAGE: u64 = crate::codec::PAGE_REF_ENCODED_LEN as u64;

/// The regular file whose data mapping a record changes, if any.
fn record_inode(record: &Record) -> Option<Ino> {
    match record {
        Record::MapUnwritten { ino, .. }
        | Record::CompleteWrite { ino, .. }
        | Record::SetSize { ino, .. }
        | Record::Punch { ino, .. }
        | Record::Create { ino, .. }
        | Record::Link { ino, .. }
        | Record::SetAttr { ino, .. }
        | Record::SetXattr { ino, .. }
        | Record::RemoveXattr { ino, .. } => Some(*ino),
        _ => None,
    }
}

/// Extents a change of `bytes` could add to a checkpoint image, at worst.
pub(crate) fn image_bytes_for_extents(extents: u64) -> u64 {
    extents * IMAGE_BYTES_PER_EXTENT
}

/// The free bytes that let bases go on with no space given back, each
/// taking up to `set` ([`Meta::base_reserve_for`]): the next frees
/// `replaced_only` (what only the slot it is written over lists), the one
/// after the rest of `slots_hold` (what both slots list now), and each
/// base after frees a base's set.
fn room_for_bases(set: u64, replaced_only: u64, slots_hold: u64) -> u64 {
    set.max((2 * set).saturating_sub(replaced_only))
        .max((3 * set).saturating_sub(slots_hold))
}

#[cfg(test)]
mod tests {
    use super::room_for_bases;
    use proptest::prelude::*;

    /// Bases in a row, each taking a whole `set`, with nothing else given
    /// back: the first frees the replaced slot's own bytes, the second
    /// the rest, each later one the set of the base two before it.
    fn bases_go_on(free: u64, set: u64, replaced_only: u64, slots_hold: u64) -> bool {
        let mut free = i128::from(free);
        let freed_by = [replaced_only, slots_hold - replaced_only, set, set];
        freed_by.iter().all(|&freed| {
            free -= i128::from(set);
            let found = free >= 0;
            free += i128::from(freed);
            found
        })
    }

    proptest! {
        #[test]
        fn the_room_is_what_bases_in_a_row_need(
            set in 0u64..1 << 20,
            replaced_only in 0u64..1 << 20,
            newer in 0u64..1 << 20,
        ) {
            let slots_hold = replaced_only + newer;
            let room = room_for_bases(set, replaced_only, slots_hold);
            prop_assert!(bases_go_on(room, set, replaced_only, slots_hold));
            prop_assert!(room == 0 || !bases_go_on(room - 1, set, replaced_only, slots_hold));
        }
    }
}
