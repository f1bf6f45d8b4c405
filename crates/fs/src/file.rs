//! Open files: data I/O, sync, space management.
//!
//! Reads and writes go straight to the iomap engine, at any byte offset,
//! length and buffer address ([`iomap::byte_dio`]). A write first runs under
//! the inode's *shared* I/O lock with `OVERWRITE_ONLY`: a pure overwrite needs
//! nothing else. If the mapping says allocation, conversion, zeroing or an EOF
//! crossing is needed, the engine reports `WouldBlock` and the write is
//! retried under the *exclusive* lock after draining in-flight direct I/O, so
//! zeroing never races another writer in the same block.
//!
//! A write that is not aligned to the device block read-modify-writes its
//! edge blocks. Under the shared lock it holds those blocks exclusive in the
//! inode's range lock, and aligned writes hold theirs shared, once the inode
//! has seen one such write (the protocol is in [`iomap::io_lock`]).
//!
//! Until the folio cache exists, non-direct handles take the same path.

use iomap::align::align_down;
use std::sync::Arc;

use iomap::byte_dio::{self, dio_read_bytes, dio_write_bytes, write_lock_range};
use iomap::dio::{self, DioWriteOutcome};
use iomap::{IomapError, IomapOpFlags, IomapOps, RangeMode};

use crate::iomap_ops::{allocate_holes, FsOps};
use crate::limits::MAX_FILE_SIZE;
use crate::mount_state::{now_ns, OpenInode, VolumeInner};
use crate::types::{ExtentState, FileKind, Ino, Record};
use crate::{Error, Result};

#[cfg(test)]
thread_local! {
    /// Reads this thread sent down the simple-read fast path (tests only).
    pub(crate) static SIMPLE_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How to open a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenFlags {
    /// Create the file if it does not exist.
    pub create: bool,
    /// With `create`: fail if it exists.
    pub exclusive: bool,
    /// Truncate to zero length on open.
    pub truncate: bool,
    /// O_DIRECT: no cache between the caller and the device. Any offset,
    /// length and buffer address works; whole device blocks at aligned
    /// offsets take the fast paths.
    pub direct: bool,
    /// O_DSYNC: each write is durable (data and the metadata to reach it)
    /// when it returns.
    pub dsync: bool,
    /// O_SYNC: like dsync, and all inode metadata too.
    pub sync: bool,
    /// Open read-only.
    pub read_only: bool,
}

/// What `stat` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub ino: Ino,
    pub kind: FileKind,
    pub size: u64,
    pub nlink: u32,
    /// Bytes of device space allocated (written or unwritten).
    pub allocated_bytes: u64,
    pub block_size: u32,
    pub mtime_ns: u64,
    pub extents: u64,
}

/// What a range of a file is, for `fiemap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FiemapKind {
    Data,
    Unwritten,
    Hole,
}

/// One range of a file's map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FiemapExtent {
    pub offset: u64,
    pub length: u64,
    /// Device byte address; 0 for holes.
    pub addr: u64,
    pub kind: FiemapKind,
}

/// An open regular file. Closing (dropping) the last handle of an unlinked
/// file frees its space.
pub struct File {
    vol: Arc<VolumeInner>,
    inode: Arc<OpenInode>,
    flags: OpenFlags,
    /// Shared, not copied, by clones: asynchronous requests clone the handle.
    path: Arc<str>,
}

impl Drop for File {
    fn drop(&mut self) {
        self.vol.release_handle(&self.inode);
    }
}

impl File {
    pub(crate) fn new(
        vol: Arc<VolumeInner>,
        inode: Arc<OpenInode>,
        flags: OpenFlags,
        path: &str,
    ) -> File {
        File {
            vol,
            inode,
            flags,
            path: Arc::from(path),
        }
    }

    /// Another handle on the same open file, with the same flags (like
    /// `dup`): the file stays open until both are dropped.
    pub fn try_clone(&self) -> Result<File> {
        self.vol.check_live()?;
        self.vol.add_handle(&self.inode);
        Ok(File {
            vol: self.vol.clone(),
            inode: self.inode.clone(),
            flags: self.flags,
            path: Arc::clone(&self.path),
        })
    }

    pub(crate) fn volume(&self) -> &Arc<VolumeInner> {
        &self.vol
    }

    pub(crate) fn open_inode(&self) -> &Arc<OpenInode> {
        &self.inode
    }

    pub fn ino(&self) -> Ino {
        self.inode.ino
    }

    pub fn flags(&self) -> OpenFlags {
        self.flags
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub(crate) fn ops(&self) -> FsOps<'_> {
        FsOps { vol: &self.vol }
    }

    fn block(&self) -> u64 {
        u64::from(self.vol.block_size)
    }

    /// Wraps an error with this file's path and the offset it concerns.
    pub(crate) fn at(&self, offset: u64, err: Error) -> Error {
        match err {
            Error::At { .. } | Error::Shutdown { .. } => err,
            other => Error::At {
                path: self.path.to_string(),
                offset,
                source: Box::new(other),
            },
        }
    }

    fn size(&self) -> Result<u64> {
        self.ops().size(&self.inode)
    }

    fn check_writable(&self, offset: u64, len: u64) -> Result<()> {
        self.vol.check_live()?;
        if self.flags.read_only {
            return Err(Error::invalid(&*self.path, "file is open read-only"));
        }
        match offset.checked_add(len) {
            Some(end) if end <= MAX_FILE_SIZE => Ok(()),
            _ => Err(Error::invalid(
                format!("{} at offset {offset} length {len}", self.path),
                format!("range ends past the largest file size {MAX_FILE_SIZE}"),
            )),
        }
    }

    /// Space freed by changes that are not durable yet stays busy (reusing it
    /// could expose new data in its old owner after a crash). When an
    /// allocation fails while space is busy, commit to release it and try
    /// once more.
    fn with_busy_retry<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        match op() {
            Err(e)
                if matches!(e.root(), Error::NoSpace { .. })
                    && self.vol.meta.read().alloc.busy_bytes() > 0 =>
            {
                self.vol.commit()?;
                op()
            }
            other => other,
        }
    }

    /// Reads at `offset`; returns bytes read (short at EOF).
    pub fn pread(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.vol.check_live().map_err(|e| self.at(offset, e))?;
        let _shared = self.inode.io_lock.lock_shared();
        if self.flags.direct {
            let ops = self.ops();
            if let Some(result) =
                dio::dio_read_simple(&ops, &*self.vol.dev, &self.inode, offset, buf)
            {
                #[cfg(test)]
                SIMPLE_READS.with(|n| n.set(n.get() + 1));
                return result.map_err(|e| self.at(offset, e));
            }
        }
        dio_read_bytes(
            &self.ops(),
            &*self.vol.dev,
            &self.inode,
            offset,
            buf,
            IomapOpFlags::DIRECT,
        )
        .map_err(|e| self.at(offset, e))
    }

    /// Writes at `offset`; returns bytes written.
    ///
    /// A write that needs the file's exclusive lock (it allocates, converts,
    /// extends, or is the file's first that is not whole device blocks)
    /// first waits for the file's asynchronous requests in flight to be
    /// reaped: never call it from the thread that owns such requests.
    pub fn pwrite(&self, buf: &[u8], offset: u64) -> Result<usize> {
        self.check_writable(offset, buf.len() as u64)
            .map_err(|e| self.at(offset, e))?;
        if buf.is_empty() {
            return Ok(0);
        }
        let outcome = self
            .write_any(buf, offset)
            .map_err(|e| self.at(offset, e))?;
        if self.flags.dsync || self.flags.sync {
            self.sync_after_write(&outcome)
                .map_err(|e| self.at(offset, e))?;
        }
        Ok(buf.len())
    }

    /// The write itself: shared lock first, exclusive retry (module docs).
    fn write_any(&self, buf: &[u8], offset: u64) -> Result<DioWriteOutcome> {
        let ops = self.ops();
        let dev = &*self.vol.dev;
        let io_lock = &self.inode.io_lock;
        let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
        if self.flags.dsync && !self.flags.sync {
            // O_SYNC never takes the FUA shortcut: it commits inode metadata
            // too.
            flags = flags | IomapOpFlags::DSYNC;
        }
        let len = buf.len() as u64;
        let aligned = byte_dio::is_block_aligned(dev, offset, len);
        // `check_writable` bounds the range far below overflow.
        let (lock_start, lock_end) =
            write_lock_range(dev, offset, len).expect("range checked by check_writable");
        {
            let _shared = io_lock.lock_shared();
            let ranges_on = io_lock.byte_granular_writes();
            // An inode's first unaligned write goes exclusive: it turns the
            // range holds on (see `iomap::io_lock`).
            if aligned || ranges_on {
                let mode = if aligned {
                    RangeMode::Shared
                } else {
                    RangeMode::Exclusive
                };
                let _range = ranges_on.then(|| io_lock.ranges().lock(lock_start, lock_end, mode));
                let _inflight = io_lock.dio_begin();
                match dio_write_bytes(
                    &ops,
                    dev,
                    &self.inode,
                    offset,
                    buf,
                    flags | IomapOpFlags::OVERWRITE_ONLY,
                ) {
                    Err(Error::Iomap(IomapError::WouldBlock)) => {}
                    other => return other,
                }
            }
        }
        let exclusive = io_lock.lock_exclusive();
        exclusive.drain_dio();
        if !aligned {
            exclusive.enable_byte_granular_writes();
        }
        self.zero_past_eof_locked(offset)?;
        let _inflight = io_lock.dio_begin();
        self.with_busy_retry(|| dio_write_bytes(&ops, dev, &self.inode, offset, buf, flags))
    }

    /// Makes a DSYNC/SYNC write durable. A pure overwrite sent with FUA is
    /// durable already; one without needs only its data flushed, and shares
    /// that flush with concurrent writers. Anything else commits the journal
    /// (group commit, which flushes first).
    fn sync_after_write(&self, outcome: &DioWriteOutcome) -> Result<()> {
        if self.flags.sync || !outcome.pure_overwrite {
            return self.vol.commit();
        }
        if outcome.fua {
            return Ok(());
        }
        self.vol
            .flush_coalescer
            .flush_completed_write(&*self.vol.dev)
            .map_err(|e| Error::device("dsync write: flush", e))
    }

    /// Makes this file's data and metadata durable. (Commits the whole
    /// journal: one commit covers every file.)
    pub fn fsync(&self) -> Result<()> {
        self.vol.commit().map_err(|e| self.at(0, e))
    }

    /// Makes this file's data and the metadata needed to read it durable.
    pub fn fdatasync(&self) -> Result<()> {
        self.vol.commit().map_err(|e| self.at(0, e))
    }

    /// Allocates unwritten space for `[offset, offset+len)`; raises the size
    /// unless `keep_size`. Out of space changes nothing.
    pub fn fallocate(&self, offset: u64, len: u64, keep_size: bool) -> Result<()> {
        self.check_writable(offset, len)
            .map_err(|e| self.at(offset, e))?;
        if len == 0 {
            return Err(self.at(offset, Error::invalid("fallocate", "length 0")));
        }
        let _exclusive = self.inode.io_lock.lock_exclusive();
        self.inode.io_lock.drain_dio();
        let block = self.block();
        let end = offset + len;
        if !keep_size {
            self.zero_past_eof_locked(end)
                .map_err(|e| self.at(offset, e))?;
        }
        self.with_busy_retry(|| {
            let mut meta = self.vol.meta.write();
            allocate_holes(
                &self.vol,
                &mut meta,
                self.inode.ino,
                align_down(offset, block),
                end.next_multiple_of(block),
            )
        })
        .map_err(|e| self.at(offset, e))?;
        {
            let mut meta = self.vol.meta.write();
            let size = meta
                .state
                .inode(self.inode.ino)
                .map(|i| i.size)
                .ok_or(Error::Stale {
                    ino: self.inode.ino,
                })?;
            if !keep_size && end > size {
                meta.log(Record::SetSize {
                    ino: self.inode.ino,
                    size: end,
                    mtime_ns: now_ns(),
                })
                .map_err(|e| self.at(offset, e))?;
            }
        }
        self.vol.commit_if_due()
    }

    /// Before the size grows to cover `new_start` or beyond: zeros the tail
    /// of the current EOF block up to `new_start`. Those bytes read as zeros
    /// today only because reads stop at EOF; on the device they may hold data
    /// of a write whose size change was lost in a crash, or of a truncate.
    /// Caller holds the exclusive lock.
    fn zero_past_eof_locked(&self, new_start: u64) -> Result<()> {
        let size = self.size()?;
        let end = new_start.min(size.next_multiple_of(self.block()));
        if end <= size {
            return Ok(());
        }
        iomap::zero_file_range(&self.ops(), &*self.vol.dev, &self.inode, size, end - size)
    }

    /// Writes zeros over the written data in `[offset, end)` inside EOF;
    /// unwritten space, holes and bytes past EOF already read as zeros.
    /// Caller holds the exclusive lock.
    fn zero_inside_eof_locked(&self, offset: u64, end: u64) -> Result<()> {
        let end = end.min(self.size()?);
        if offset >= end {
            return Ok(());
        }
        iomap::zero_file_range(
            &self.ops(),
            &*self.vol.dev,
            &self.inode,
            offset,
            end - offset,
        )
    }

    /// Deallocates `[offset, offset+len)`; it reads as zeros afterwards.
    pub fn punch_hole(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable(offset, len)
            .map_err(|e| self.at(offset, e))?;
        if len == 0 {
            return Ok(());
        }
        let _exclusive = self.inode.io_lock.lock_exclusive();
        self.inode.io_lock.drain_dio();
        let block = self.block();
        let end = offset + len;
        let inner_start = offset.next_multiple_of(block);
        let inner_end = align_down(end, block);
        let result = (|| {
            if inner_start >= inner_end {
                // No whole block inside: only zeroing to do.
                return self.zero_inside_eof_locked(offset, end);
            }
            self.zero_inside_eof_locked(offset, inner_start)?;
            self.zero_inside_eof_locked(inner_end, end)?;
            let mut meta = self.vol.meta.write();
            meta.reserve_image(&self.vol.sb, crate::mount_state::image_bytes_for_extents(1))?;
            meta.log(Record::Punch {
                ino: self.inode.ino,
                file_off: inner_start,
                len: inner_end - inner_start,
                mtime_ns: now_ns(),
            })?;
            Ok(())
        })();
        result.map_err(|e| self.at(offset, e))?;
        self.vol.commit_if_due()
    }

    /// Sets the size. Shrinking frees the space past it; growing leaves a
    /// hole.
    pub fn truncate(&self, size: u64) -> Result<()> {
        self.check_writable(size, 0).map_err(|e| self.at(size, e))?;
        let _exclusive = self.inode.io_lock.lock_exclusive();
        self.inode.io_lock.drain_dio();
        let block = self.block();
        let result = (|| {
            let old = self.size()?;
            if size > old {
                self.zero_past_eof_locked(size)?;
            }
            if size < old && !size.is_multiple_of(block) {
                // Bytes past the new EOF must read as zeros if the file grows
                // again: clear them on disk before the size drops.
                self.zero_inside_eof_locked(size, size.next_multiple_of(block))?;
            }
            let mut meta = self.vol.meta.write();
            meta.log(Record::SetSize {
                ino: self.inode.ino,
                size,
                mtime_ns: now_ns(),
            })?;
            Ok(())
        })();
        result.map_err(|e| self.at(size, e))?;
        self.vol.commit_if_due()
    }

    pub fn stat(&self) -> Result<Stat> {
        self.vol.check_live()?;
        let meta = self.vol.meta.read();
        if meta.state.inode(self.inode.ino).is_none() {
            return Err(Error::Stale {
                ino: self.inode.ino,
            });
        }
        Ok(self.vol.stat_locked(&meta, self.inode.ino))
    }

    /// The file's map from 0 to EOF (and unwritten space beyond it):
    /// data, unwritten and hole ranges in order.
    pub fn fiemap(&self) -> Result<Vec<FiemapExtent>> {
        self.vol.check_live()?;
        let meta = self.vol.meta.read();
        let inode = meta.state.inode(self.inode.ino).ok_or(Error::Stale {
            ino: self.inode.ino,
        })?;
        let mut out = Vec::new();
        let mut cursor = 0u64;
        for ext in inode.extents.iter() {
            if ext.file_off > cursor {
                out.push(FiemapExtent {
                    offset: cursor,
                    length: ext.file_off - cursor,
                    addr: 0,
                    kind: FiemapKind::Hole,
                });
            }
            out.push(FiemapExtent {
                offset: ext.file_off,
                length: ext.len,
                addr: ext.addr,
                kind: match ext.state {
                    ExtentState::Written => FiemapKind::Data,
                    ExtentState::Unwritten => FiemapKind::Unwritten,
                },
            });
            cursor = ext.file_end();
        }
        let eof = inode.size.next_multiple_of(self.block());
        if eof > cursor {
            out.push(FiemapExtent {
                offset: cursor,
                length: eof - cursor,
                addr: 0,
                kind: FiemapKind::Hole,
            });
        }
        Ok(out)
    }
}
