//! A mounted volume: namespace operations, journal commits, checkpoints.
//!
//! Locking (always taken in this order, never the reverse):
//! 1. an inode's I/O lock ([`iomap::InodeIoLock`]), held across data I/O;
//! 2. `commit` — the journal writer; held across journal and checkpoint I/O;
//! 3. `meta` — the in-memory metadata; held briefly, never across data I/O
//!    (a checkpoint holds it across its own write so the image is consistent).
//!
//! Fault model: the device may lose or tear any write not followed by a
//! completed flush, and may fail any request. A failed journal commit or
//! checkpoint leaves memory ahead of the disk, so the volume shuts down: every
//! later call fails with [`Error::Shutdown`] and the next mount recovers from
//! what is durable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use blockdev::BlockDevice;
use iomap::{FlushCoalescer, InodeIoLock};
use parking_lot::{Mutex, RwLock};

use crate::alloc::Allocator;
use crate::checkpoint::{self, Checkpoint};
use crate::codec;
use crate::file::{File, OpenFlags, Stat};
use crate::journal::{self, JournalWriter};
use crate::limits::{
    CHECKPOINT_HEADROOM, COMMIT_THRESHOLD_DIVISOR, MAX_NAME_LEN, RECORD_BYTES_ESTIMATE,
};
use crate::state::{
    MetaState, IMAGE_BYTES_PER_ENTRY, IMAGE_BYTES_PER_EXTENT, IMAGE_BYTES_PER_INODE,
};
use crate::superblock::{self, Layout, Superblock};
use crate::types::{FileKind, Ino, Record, ROOT_INO};
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
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: 4096,
            journal_bytes: None,
            checkpoint_slot_bytes: None,
        }
    }
}

/// One name in a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub ino: Ino,
    pub kind: FileKind,
}

/// Space usage of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    /// Bytes in the data area.
    pub data_bytes: u64,
    /// Bytes free for allocation, including space freed by changes that
    /// are not durable yet (an allocation that needs it commits first).
    pub free_bytes: u64,
    pub inodes: u64,
}

/// A mounted iomapfs volume. Cheap to clone; all clones share one mount.
#[derive(Clone)]
pub struct Volume {
    pub(crate) inner: Arc<VolumeInner>,
}

/// An inode some handle has open: what the I/O engine locks.
pub(crate) struct OpenInode {
    pub ino: Ino,
    pub io_lock: InodeIoLock,
    /// Open handles (`File`s, including those asynchronous requests hold
    /// while in flight). Atomic so that cloning a handle per request takes
    /// no lock; reaching zero takes the metadata lock to close the inode.
    handles: AtomicUsize,
}

impl AsRef<InodeIoLock> for OpenInode {
    fn as_ref(&self) -> &InodeIoLock {
        &self.io_lock
    }
}

struct OpenEntry {
    inode: Arc<OpenInode>,
}

pub(crate) struct Meta {
    pub state: MetaState,
    pub alloc: Allocator,
    /// Applied but not yet journaled, in sequence order.
    pending: Vec<Record>,
    /// Sequence number the next record gets.
    next_seq: u64,
    pending_bytes: u64,
    open: HashMap<Ino, OpenEntry>,
    /// Newest record that is durable.
    committed_seq: u64,
    /// Per inode, the newest record that changed it: an inode is dirty while
    /// that record is not durable, and a write to it is then not metadata-free.
    last_change: HashMap<Ino, u64>,
}

struct CommitState {
    journal: JournalWriter,
    /// Slot holding the newest checkpoint.
    slot: usize,
    generation: u64,
}

pub(crate) struct VolumeInner {
    pub dev: Arc<dyn BlockDevice>,
    pub sb: Superblock,
    pub block_size: u32,
    pub meta: RwLock<Meta>,
    commit: Mutex<CommitState>,
    shutdown: Mutex<Option<String>>,
    /// Set once `shutdown` holds a reason.
    is_shut_down: AtomicBool,
    commit_threshold: u64,
    /// Shares flushes among concurrent DSYNC overwrites.
    pub flush_coalescer: FlushCoalescer,
}

pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl Meta {
    /// Applies `record` to memory and queues it for the journal. Space it
    /// releases stays busy until the record is durable.
    pub fn log(&mut self, record: Record) -> Result<u64> {
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
        self.pending.push(record);
        self.pending_bytes += RECORD_BYTES_ESTIMATE;
        Ok(seq)
    }

    /// The inode has metadata changes that are not durable yet.
    pub fn is_dirty(&self, ino: Ino) -> bool {
        self.last_change
            .get(&ino)
            .is_some_and(|&seq| seq > self.committed_seq)
    }

    fn mark_committed(&mut self, seq: u64) {
        self.committed_seq = self.committed_seq.max(seq);
        self.alloc.release_busy(seq);
        let committed = self.committed_seq;
        self.last_change.retain(|_, &mut last| last > committed);
    }

    /// Refuses a change that could grow the checkpoint image past its slot.
    pub fn reserve_image(&self, sb: &Superblock, extra: u64) -> Result<()> {
        let slot = sb.layout.checkpoint_slots[0].len;
        let needed = self.state.image_bytes_estimate() + extra + CHECKPOINT_HEADROOM;
        if needed > slot {
            return Err(Error::NoSpace {
                what: "metadata (checkpoint slot)".to_string(),
                needed,
                available: slot,
            });
        }
        Ok(())
    }
}

/// The regular file whose data mapping a record changes, if any.
fn record_inode(record: &Record) -> Option<Ino> {
    match record {
        Record::MapUnwritten { ino, .. }
        | Record::CompleteWrite { ino, .. }
        | Record::SetSize { ino, .. }
        | Record::Punch { ino, .. }
        | Record::Create { ino, .. } => Some(*ino),
        _ => None,
    }
}

impl Volume {
    /// Writes a new, empty file system to `device`.
    pub fn format(device: Arc<dyn BlockDevice>, opts: &FormatOptions) -> Result<()> {
        let caps = device.caps().clone();
        let layout = Layout::compute(
            caps.size_bytes,
            caps.logical_block_size,
            opts.block_size,
            opts.journal_bytes,
            opts.checkpoint_slot_bytes,
        )?;
        let sb = Superblock::new(layout);
        let state = MetaState::new_empty(sb.layout.block_size, now_ns());
        let ckpt = Checkpoint {
            generation: 1,
            journal_start: 0,
            journal_seq: 1,
            journal_chain: 0,
            image: state.to_image(),
        };
        // Slots first, superblock last: a crash mid-format leaves the old
        // superblock (or none), never a new superblock pointing at garbage.
        checkpoint::write_checkpoint(&*device, &sb, 0, &ckpt)?;
        checkpoint::invalidate_slot(&*device, &sb, 1)?;
        superblock::write_superblock(&*device, &sb)?;
        device
            .flush()
            .map_err(|e| Error::device("format: flush", e))?;
        Ok(())
    }

    /// Mounts the volume on `device`: reads the newest valid checkpoint and
    /// replays the journal after it. Cost is proportional to the metadata and
    /// the journal, never to the device.
    pub fn open(device: Arc<dyn BlockDevice>) -> Result<Volume> {
        let loaded = load(&*device, Strictness::Mount)?;
        let Loaded {
            sb,
            slot,
            generation,
            state,
            alloc,
            replay_end,
            journal_tail,
        } = loaded;
        let mut journal =
            JournalWriter::new(&sb, replay_end.head, replay_end.next_seq, replay_end.chain);
        journal.set_tail(journal_tail);
        let commit_threshold = sb.layout.journal.len / COMMIT_THRESHOLD_DIVISOR;
        let inner = Arc::new(VolumeInner {
            dev: device,
            block_size: sb.layout.block_size,
            sb,
            meta: RwLock::new(Meta {
                state,
                alloc,
                pending: Vec::new(),
                next_seq: replay_end.next_seq,
                pending_bytes: 0,
                open: HashMap::new(),
                committed_seq: replay_end.next_seq - 1,
                last_change: HashMap::new(),
            }),
            commit: Mutex::new(CommitState {
                journal,
                slot,
                generation,
            }),
            shutdown: Mutex::new(None),
            is_shut_down: AtomicBool::new(false),
            commit_threshold,
            flush_coalescer: FlushCoalescer::new(),
        });
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
        Ok(Volume { inner })
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.inner.dev
    }

    pub fn superblock(&self) -> &Superblock {
        &self.inner.sb
    }

    /// Opens (and with `flags.create`, creates) the regular file at `path`.
    pub fn open_file(&self, path: &str, flags: OpenFlags) -> Result<File> {
        self.inner.check_live()?;
        if flags.read_only && flags.truncate {
            return Err(Error::invalid(path, "truncate on a read-only open"));
        }
        let inode = {
            let mut meta = self.inner.meta.write();
            let (parent, name) = resolve_parent(&meta.state, path)?;
            let existing = meta
                .state
                .inode(parent)
                .and_then(|d| d.entries.get(&name))
                .copied();
            let ino = match existing {
                Some(ino) => {
                    if flags.create && flags.exclusive {
                        return Err(Error::Exists {
                            path: path.to_string(),
                        });
                    }
                    if meta.state.inodes[&ino].kind == FileKind::Directory {
                        return Err(Error::IsDir {
                            path: path.to_string(),
                        });
                    }
                    ino
                }
                None if flags.create => {
                    if flags.read_only {
                        return Err(Error::invalid(path, "create on a read-only open"));
                    }
                    self.create_locked(&mut meta, parent, &name, FileKind::Regular)?
                }
                None => {
                    return Err(Error::NotFound {
                        path: path.to_string(),
                    })
                }
            };
            let entry = meta.open.entry(ino).or_insert_with(|| OpenEntry {
                inode: Arc::new(OpenInode {
                    ino,
                    io_lock: InodeIoLock::new(),
                    handles: AtomicUsize::new(0),
                }),
            });
            // Under the metadata lock: a concurrent last close re-checks the
            // count under the same lock before it closes the inode.
            entry.inode.handles.fetch_add(1, Ordering::AcqRel);
            entry.inode.clone()
        };
        self.inner.commit_if_due()?;
        let file = File::new(self.inner.clone(), inode, flags, path);
        if flags.truncate {
            file.truncate(0)?;
        }
        Ok(file)
    }

    fn create_locked(
        &self,
        meta: &mut Meta,
        parent: Ino,
        name: &str,
        kind: FileKind,
    ) -> Result<Ino> {
        meta.reserve_image(
            &self.inner.sb,
            IMAGE_BYTES_PER_INODE + IMAGE_BYTES_PER_ENTRY + name.len() as u64,
        )?;
        let ino = meta.state.next_ino;
        meta.log(Record::Create {
            ino,
            parent,
            name: name.to_string(),
            kind,
            mtime_ns: now_ns(),
        })?;
        Ok(ino)
    }

    pub fn mkdir(&self, path: &str) -> Result<()> {
        self.inner.check_live()?;
        {
            let mut meta = self.inner.meta.write();
            let (parent, name) = resolve_parent(&meta.state, path)?;
            if meta.state.inodes[&parent].entries.contains_key(&name) {
                return Err(Error::Exists {
                    path: path.to_string(),
                });
            }
            self.create_locked(&mut meta, parent, &name, FileKind::Directory)?;
        }
        self.inner.commit_if_due()
    }

    pub fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.check_live()?;
        let meta = self.inner.meta.read();
        let ino = resolve(&meta.state, path)?;
        let dir = &meta.state.inodes[&ino];
        if dir.kind != FileKind::Directory {
            return Err(Error::NotDir {
                path: path.to_string(),
            });
        }
        Ok(dir
            .entries
            .iter()
            .map(|(name, &ino)| DirEntry {
                name: name.clone(),
                ino,
                kind: meta.state.inodes[&ino].kind,
            })
            .collect())
    }

    pub fn unlink(&self, path: &str) -> Result<()> {
        self.remove(path, FileKind::Regular)
    }

    pub fn rmdir(&self, path: &str) -> Result<()> {
        self.remove(path, FileKind::Directory)
    }

    fn remove(&self, path: &str, want: FileKind) -> Result<()> {
        self.inner.check_live()?;
        {
            let mut meta = self.inner.meta.write();
            let (parent, name) = resolve_parent(&meta.state, path)?;
            let ino = *meta.state.inodes[&parent]
                .entries
                .get(&name)
                .ok_or_else(|| Error::NotFound {
                    path: path.to_string(),
                })?;
            let inode = &meta.state.inodes[&ino];
            match (want, inode.kind) {
                (FileKind::Regular, FileKind::Directory) => {
                    return Err(Error::IsDir {
                        path: path.to_string(),
                    })
                }
                (FileKind::Directory, FileKind::Regular) => {
                    return Err(Error::NotDir {
                        path: path.to_string(),
                    })
                }
                (FileKind::Directory, FileKind::Directory) if !inode.entries.is_empty() => {
                    return Err(Error::NotEmpty {
                        path: path.to_string(),
                    })
                }
                _ => {}
            }
            meta.log(Record::Unlink { parent, name })?;
            if !meta.open.contains_key(&ino) {
                meta.log(Record::FreeInode { ino })?;
            }
        }
        self.inner.commit_if_due()
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.inner.check_live()?;
        {
            let mut meta = self.inner.meta.write();
            let (src_parent, src_name) = resolve_parent(&meta.state, from)?;
            let (dst_parent, dst_name) = resolve_parent(&meta.state, to)?;
            let state = &meta.state;
            let src = *state.inodes[&src_parent]
                .entries
                .get(&src_name)
                .ok_or_else(|| Error::NotFound {
                    path: from.to_string(),
                })?;
            let src_kind = state.inodes[&src].kind;
            let replaced = state.inodes[&dst_parent].entries.get(&dst_name).copied();
            if replaced == Some(src) {
                return Ok(());
            }
            if src_kind == FileKind::Directory && state.is_ancestor(src, dst_parent) {
                return Err(Error::invalid(
                    format!("rename {from} to {to}"),
                    "cannot move a directory into itself",
                ));
            }
            if let Some(old) = replaced {
                let old_inode = &state.inodes[&old];
                match (src_kind, old_inode.kind) {
                    (FileKind::Regular, FileKind::Directory) => {
                        return Err(Error::IsDir {
                            path: to.to_string(),
                        })
                    }
                    (FileKind::Directory, FileKind::Regular) => {
                        return Err(Error::NotDir {
                            path: to.to_string(),
                        })
                    }
                    (FileKind::Directory, FileKind::Directory) if !old_inode.entries.is_empty() => {
                        return Err(Error::NotEmpty {
                            path: to.to_string(),
                        })
                    }
                    _ => {}
                }
            }
            meta.reserve_image(&self.inner.sb, dst_name.len() as u64)?;
            meta.log(Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            })?;
            if let Some(old) = replaced {
                if !meta.open.contains_key(&old) {
                    meta.log(Record::FreeInode { ino: old })?;
                }
            }
        }
        self.inner.commit_if_due()
    }

    /// DSYNC writers waiting for a device flush to cover their write
    /// (shared flushes; diagnostics and tests).
    pub fn dsync_flush_waiters(&self) -> usize {
        self.inner.flush_coalescer.waiting()
    }

    pub fn stat(&self, path: &str) -> Result<Stat> {
        self.inner.check_live()?;
        let meta = self.inner.meta.read();
        let ino = resolve(&meta.state, path)?;
        Ok(self.inner.stat_locked(&meta, ino))
    }

    pub fn statfs(&self) -> StatFs {
        let meta = self.inner.meta.read();
        StatFs {
            block_size: self.inner.block_size,
            data_bytes: self.inner.sb.layout.data.len,
            free_bytes: meta.alloc.free_bytes() + meta.alloc.busy_bytes(),
            inodes: meta.state.inodes.len() as u64,
        }
    }

    /// Makes every completed change durable (journal commit).
    pub fn sync(&self) -> Result<()> {
        self.inner.commit()
    }

    /// Writes a checkpoint and trims the journal.
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.check_live()?;
        let mut commit = self.inner.commit.lock();
        self.inner.checkpoint_locked(&mut commit)
    }

    /// Checkpoints and releases the volume. Dropping a volume without
    /// unmounting leaves it to journal recovery at the next open.
    pub fn unmount(self) -> Result<()> {
        self.checkpoint()
    }
}

impl VolumeInner {
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

    fn shut_down(&self, err: &Error) {
        let mut shutdown = self.shutdown.lock();
        if shutdown.is_none() {
            *shutdown = Some(err.to_string());
        }
        self.is_shut_down.store(true, Ordering::Release);
    }

    pub(crate) fn stat_locked(&self, meta: &Meta, ino: Ino) -> Stat {
        let inode = &meta.state.inodes[&ino];
        Stat {
            ino,
            kind: inode.kind,
            size: inode.size,
            nlink: inode.nlink,
            allocated_bytes: inode.extents.allocated_bytes(),
            block_size: self.block_size,
            mtime_ns: inode.mtime_ns,
            extents: inode.extents.len() as u64,
        }
    }

    /// Commits when enough uncommitted metadata has piled up.
    pub fn commit_if_due(&self) -> Result<()> {
        let due = self.meta.read().pending_bytes >= self.commit_threshold;
        if due {
            self.commit()
        } else {
            Ok(())
        }
    }

    /// Group commit: makes every change applied so far durable, together with
    /// the data I/O that completed before them. Concurrent callers queue on
    /// the commit lock and the first one in writes everybody's records.
    pub fn commit(&self) -> Result<()> {
        self.check_live()?;
        let mut commit = self.commit.lock();
        self.check_live()?;
        let (records, last_seq) = {
            let mut meta = self.meta.write();
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
            // The checkpoint captures the in-memory state, which already
            // contains these records.
            return self.checkpoint_locked(&mut commit);
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
        self.meta.write().mark_committed(last_seq);
        Ok(())
    }

    fn checkpoint_locked(&self, commit: &mut CommitState) -> Result<()> {
        self.check_live()?;
        let mut meta = self.meta.write();
        let result = self.write_checkpoint(commit, &mut meta);
        if let Err(err) = &result {
            self.shut_down(err);
        }
        result
    }

    fn write_checkpoint(&self, commit: &mut CommitState, meta: &mut Meta) -> Result<()> {
        self.dev
            .flush()
            .map_err(|e| Error::device("checkpoint: flush", e))?;
        let ckpt = Checkpoint {
            generation: commit.generation + 1,
            journal_start: commit.journal.head(),
            journal_seq: meta.next_seq,
            journal_chain: commit.journal.chain(),
            image: meta.state.to_image(),
        };
        let slot = 1 - commit.slot;
        checkpoint::write_checkpoint(&*self.dev, &self.sb, slot, &ckpt)?;
        commit.slot = slot;
        commit.generation = ckpt.generation;
        commit.journal = JournalWriter::new(
            &self.sb,
            ckpt.journal_start,
            ckpt.journal_seq,
            ckpt.journal_chain,
        );
        meta.pending.clear();
        meta.pending_bytes = 0;
        let last_seq = meta.next_seq - 1;
        meta.mark_committed(last_seq);
        Ok(())
    }

    /// Another handle on an inode that is open already (the caller holds
    /// one, so the count cannot be at zero).
    pub(crate) fn add_handle(&self, inode: &OpenInode) {
        inode.handles.fetch_add(1, Ordering::AcqRel);
    }

    /// A handle on `inode` closed; the last one closes the inode, and frees
    /// it if it was unlinked.
    pub(crate) fn release_handle(&self, inode: &Arc<OpenInode>) {
        if inode.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let mut meta = self.meta.write();
        // An open by path may have revived it meanwhile, or a new open inode
        // may already stand in its place.
        let still_ours = meta
            .open
            .get(&inode.ino)
            .is_some_and(|e| Arc::ptr_eq(&e.inode, inode));
        if !still_ours || inode.handles.load(Ordering::Acquire) != 0 {
            return;
        }
        meta.open.remove(&inode.ino);
        let unlinked = meta.state.inode(inode.ino).is_some_and(|i| i.nlink == 0);
        if unlinked && self.check_live().is_ok() {
            // Failure only leaves an orphan that the next mount frees.
            let _ = meta.log(Record::FreeInode { ino: inode.ino });
        }
    }
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
    pub state: MetaState,
    pub alloc: Allocator,
    pub replay_end: journal::ReplayEnd,
    pub journal_tail: u64,
}

/// Reads the superblock and newest checkpoint, replays the journal and
/// rebuilds free space. Shared by mount and fsck.
pub(crate) fn load(device: &dyn BlockDevice, strictness: Strictness) -> Result<Loaded> {
    let sb = superblock::read_superblock(device)?;
    let (slot, ckpt) = checkpoint::read_newest_checkpoint(device, &sb)?;
    let slot_start = sb.layout.checkpoint_slots[slot].start;
    let block_size = sb.layout.block_size;
    let mut state = MetaState::from_image(&ckpt.image, block_size)
        .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    if strictness == Strictness::Mount {
        state
            .check_links_and_kinds()
            .map_err(|reason| Error::corrupt("checkpoint image", slot_start, reason))?;
    }
    let journal_start = sb.layout.journal.start;
    let mut freed = Vec::new();
    let replay_end = journal::replay(
        device,
        &sb,
        ckpt.journal_start,
        ckpt.journal_seq,
        ckpt.journal_chain,
        &mut |seq, record| {
            state.apply(&record, &mut freed).map_err(|reason| {
                Error::corrupt(
                    "journal record",
                    journal_start,
                    format!("record {seq} does not apply: {reason}"),
                )
            })
        },
    )?;
    let alloc = build_allocator(&sb, &state)?;
    Ok(Loaded {
        sb,
        slot,
        generation: ckpt.generation,
        state,
        alloc,
        replay_end,
        journal_tail: ckpt.journal_start,
    })
}

/// Free space = the data area minus every extent. An extent outside the data
/// area or overlapping another is corruption.
pub(crate) fn build_allocator(sb: &Superblock, state: &MetaState) -> Result<Allocator> {
    let data = &sb.layout.data;
    let mut alloc = Allocator::new(data.start, data.len, sb.layout.block_size);
    let mut inos: Vec<&Ino> = state.inodes.keys().collect();
    inos.sort_unstable();
    for ino in inos {
        for ext in state.inodes[ino].extents.iter() {
            alloc.mark_used(ext.addr, ext.len).map_err(|reason| {
                Error::corrupt(
                    "extent map",
                    ext.addr,
                    format!(
                        "inode {ino} extent at file offset {}: {reason}",
                        ext.file_off
                    ),
                )
            })?;
        }
    }
    Ok(alloc)
}

/// Splits a path into components, resolving "." and "..".
fn components(path: &str) -> Result<Vec<&str>> {
    let mut out: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            name => {
                if name.len() > MAX_NAME_LEN {
                    return Err(Error::NameTooLong {
                        path: path.to_string(),
                        max: MAX_NAME_LEN,
                    });
                }
                if name.contains('\0') {
                    return Err(Error::invalid(path, "NUL in path"));
                }
                out.push(name);
            }
        }
    }
    Ok(out)
}

fn walk(state: &MetaState, path: &str, parts: &[&str]) -> Result<Ino> {
    let mut ino = ROOT_INO;
    for part in parts {
        let dir = &state.inodes[&ino];
        if dir.kind != FileKind::Directory {
            return Err(Error::NotDir {
                path: path.to_string(),
            });
        }
        ino = *dir.entries.get(*part).ok_or_else(|| Error::NotFound {
            path: path.to_string(),
        })?;
    }
    Ok(ino)
}

/// The inode at `path`.
pub(crate) fn resolve(state: &MetaState, path: &str) -> Result<Ino> {
    let parts = components(path)?;
    walk(state, path, &parts)
}

/// The directory that would hold `path`, and the last component.
pub(crate) fn resolve_parent(state: &MetaState, path: &str) -> Result<(Ino, String)> {
    let parts = components(path)?;
    let Some((name, dirs)) = parts.split_last() else {
        return Err(Error::invalid(path, "path names the root directory"));
    };
    let parent = walk(state, path, dirs)?;
    if state.inodes[&parent].kind != FileKind::Directory {
        return Err(Error::NotDir {
            path: path.to_string(),
        });
    }
    codec::check_name(name).map_err(|reason| Error::invalid(path, reason))?;
    Ok((parent, name.to_string()))
}

/// Extents a change of `bytes` could add to a checkpoint image, at worst.
pub(crate) fn image_bytes_for_extents(extents: u64) -> u64 {
    extents * IMAGE_BYTES_PER_EXTENT
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;

    fn fresh(size: u64) -> (Arc<MemDevice>, Volume) {
        let dev = Arc::new(MemDevice::new(size, 512));
        dev.fill(b"STALE!!!");
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        (dev, vol)
    }

    #[test]
    fn write_read_reopen_round_trip() {
        let (dev, vol) = fresh(8 << 20);
        vol.mkdir("/d").unwrap();
        let direct = OpenFlags {
            create: true,
            direct: true,
            ..OpenFlags::default()
        };
        let f = vol.open_file("/d/a", direct).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(f.pwrite(&data, 4096).unwrap(), 8192);
        let mut back = vec![0u8; 16384];
        assert_eq!(f.pread(&mut back, 0).unwrap(), 12288);
        assert!(back[..4096].iter().all(|&b| b == 0));
        assert_eq!(&back[4096..12288], &data[..]);
        // Sub-block overwrite through a buffered handle.
        let g = vol.open_file("/d/a", OpenFlags::default()).unwrap();
        g.pwrite(b"hello", 5000).unwrap();
        f.fsync().unwrap();
        drop(f);
        drop(g);
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        let f = vol.open_file("/d/a", OpenFlags::default()).unwrap();
        let mut back = vec![0u8; 12288];
        assert_eq!(f.pread(&mut back, 0).unwrap(), 12288);
        assert_eq!(&back[5000..5005], b"hello");
        assert_eq!(&back[4096..5000], &data[..904]);
        assert_eq!(&back[5005..12288], &data[909..]);
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    }

    #[test]
    fn enospc_changes_nothing() {
        let (_dev, vol) = fresh(4 << 20);
        let f = vol
            .open_file(
                "big",
                OpenFlags {
                    create: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        let free = vol.statfs().free_bytes;
        let err = f.fallocate(0, free + 4096, false).unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC, "{err}");
        assert_eq!(f.stat().unwrap().size, 0);
        assert_eq!(vol.statfs().free_bytes, free);
        f.fallocate(0, free, false).unwrap();
        assert_eq!(vol.statfs().free_bytes, 0);
    }

    #[test]
    fn space_freed_by_uncommitted_unlink_is_reused_after_an_internal_commit() {
        let (_dev, vol) = fresh(4 << 20);
        let create = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        let a = vol.open_file("a", create).unwrap();
        let free = vol.statfs().free_bytes;
        a.fallocate(0, free, false).unwrap();
        drop(a);
        vol.unlink("a").unwrap();
        // Freed but busy until the unlink is durable; statfs counts it.
        assert_eq!(vol.inner.meta.read().alloc.free_bytes(), 0);
        assert_eq!(vol.statfs().free_bytes, free);
        let b = vol.open_file("b", create).unwrap();
        b.fallocate(0, free, false).unwrap();
        assert_eq!(b.stat().unwrap().allocated_bytes, free);
    }

    #[test]
    fn direct_reads_of_one_written_block_take_the_simple_path() {
        use crate::file::SIMPLE_READS;
        let (_dev, vol) = fresh(8 << 20);
        let direct = OpenFlags {
            create: true,
            direct: true,
            ..OpenFlags::default()
        };
        let f = vol.open_file("/f", direct).unwrap();
        f.pwrite(&[5u8; 3 * 4096], 0).unwrap();
        f.fallocate(3 * 4096, 4096, false).unwrap();
        let taken = || SIMPLE_READS.with(|n| n.get());
        let mut block = vec![0u8; 4096];
        let mut two = vec![0u8; 8192];
        let before = taken();
        f.pread(&mut block, 4096).unwrap();
        f.pread(&mut block[..512], 1024).unwrap();
        assert_eq!(
            taken() - before,
            2,
            "one-block reads inside a written extent"
        );
        f.pread(&mut two, 0).unwrap(); // longer than a block
        f.pread(&mut block, 3 * 4096).unwrap(); // unwritten
        let buffered = vol.open_file("/f", OpenFlags::default()).unwrap();
        buffered.pread(&mut block, 0).unwrap(); // not a direct handle
        assert_eq!(
            taken() - before,
            2,
            "only qualifying reads take the fast path"
        );
        assert!(block.iter().all(|&b| b == 5));
    }
}
