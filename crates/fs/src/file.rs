//! Open files: data I/O, sync, space management.
//!
//! Reads and writes are the iomap engine's ([`iomap::file_io`]): this
//! module is the file system's face for them — checks, error context — and
//! the [`IomapFile`] the engine drives. Direct handles go to the device at
//! any byte offset, length and buffer address; other handles go through the
//! volume's folio cache. Truncate, punch and fallocate write back and drop
//! the file's cached folios first.

use std::sync::Arc;

use blockdev::BlockDevice;
use iomap::align::align_down;
use iomap::{
    file_io, FlushCoalescer, InodeIoLock, IomapFile, IomapKind, IomapOpFlags, IomapOps, Mapping,
    WriteSync,
};

use crate::iomap_ops::allocate_holes;
use crate::limits::MAX_FILE_SIZE;
use crate::mount_state::{now_ns, OpenInode, VolumeInner};
use crate::types::{ExtentState, FileKind, Ino, Record, Timestamp};
use crate::{Error, Result};

/// Ranges [`File::fiemap`] gathers per part: each part holds the
/// metadata lock shared once, so writers wait for one part at most.
const FIEMAP_PART: usize = 1 << 16;

/// A file's map in parts ([`File::fiemap_parts`]).
pub struct FiemapParts<'a> {
    file: &'a File,
    max: usize,
    /// Where the next part starts: the end of the last range given.
    from: u64,
    done: bool,
}

impl Iterator for FiemapParts<'_> {
    type Item = Result<Vec<FiemapExtent>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut part = match self.file.fiemap_from(self.from, self.max) {
            Ok(part) => part,
            Err(e) => {
                self.done = true;
                return Some(Err(e));
            }
        };
        let Some(last) = part.last() else {
            self.done = true;
            return None;
        };
        let end = last.offset + last.length;
        // A change between two parts can leave this part's first range
        // starting before the last one ended: it is cut there, so the
        // parts never overlap.
        if let Some(first) = part.first_mut().filter(|f| f.offset < self.from) {
            let cut = self.from - first.offset;
            first.offset += cut;
            first.length -= cut;
            if first.kind != FiemapKind::Hole {
                first.addr += cut;
            }
        }
        self.from = end;
        Some(Ok(part))
    }
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
    /// Bytes of data; a symlink's is its target's length.
    pub size: u64,
    /// Names of the inode; for a directory, as POSIX counts: 2 (its name
    /// and its `.`) plus one per subdirectory (their `..`), 0 once removed.
    pub nlink: u32,
    /// Bytes of device space allocated (written or unwritten).
    pub allocated_bytes: u64,
    pub block_size: u32,
    pub extents: u64,
    /// Permission bits (`st_mode & 0o7777`); the kind is `kind`.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Device number of a device node.
    pub rdev: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    /// Creation time.
    pub btime: Timestamp,
}

impl Stat {
    /// `st_mode`: kind and permission bits.
    pub fn st_mode(&self) -> u32 {
        self.kind.mode_bits() | self.mode
    }
}

/// What a range of a file is, for `fiemap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FiemapKind {
    Data,
    Unwritten,
    Hole,
}

/// What `lseek` looks for from an offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekFor {
    /// `SEEK_DATA`
    Data,
    /// `SEEK_HOLE`
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
///
/// A `File` is a counted reference to one open handle: a request in flight
/// holds the handle with one reference count ([`IomapFile::hold`]) rather
/// than a new handle, so a queued request costs no volume-wide bookkeeping.
pub struct File {
    handle: Arc<Handle>,
}

/// One open handle (a file description): what `open` and
/// [`File::try_clone`] make.
struct Handle {
    vol: Arc<VolumeInner>,
    inode: Arc<OpenInode>,
    flags: OpenFlags,
    path: Box<str>,
    /// Which writeback errors of the file this handle's `fsync` has
    /// reported (each handle sees each error once; a request in flight on
    /// the handle reports through it too).
    errors_seen: iomap::ErrorCursor,
}

impl Drop for Handle {
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
        let errors_seen = inode.mapping.error_cursor();
        File {
            handle: Arc::new(Handle {
                vol,
                inode,
                flags,
                path: Box::from(path),
                errors_seen,
            }),
        }
    }

    /// Another handle on the same open file, with the same flags (like
    /// `dup`): the file stays open until both are dropped.
    pub fn try_clone(&self) -> Result<File> {
        self.handle.vol.check_live()?;
        self.handle.vol.add_handle(&self.handle.inode);
        let h = &self.handle;
        Ok(File::new(h.vol.clone(), h.inode.clone(), h.flags, &h.path))
    }

    pub fn ino(&self) -> Ino {
        self.handle.inode.ino
    }

    pub fn flags(&self) -> OpenFlags {
        self.handle.flags
    }

    pub fn path(&self) -> &str {
        &self.handle.path
    }

    fn block(&self) -> u64 {
        u64::from(self.handle.vol.block_size)
    }

    /// Wraps an error with this file's path and the offset it concerns.
    pub(crate) fn at(&self, offset: u64, err: Error) -> Error {
        match err {
            Error::At { .. } | Error::Shutdown { .. } => err,
            other => Error::At {
                path: self.handle.path.to_string(),
                offset,
                source: Box::new(other),
            },
        }
    }

    fn size(&self) -> Result<u64> {
        self.handle.vol.size(&self.handle.inode)
    }

    fn check_writable(&self, offset: u64, len: u64) -> Result<()> {
        self.handle.vol.check_live()?;
        if self.handle.flags.read_only {
            return Err(Error::invalid(&*self.handle.path, "file is open read-only"));
        }
        match offset.checked_add(len) {
            Some(end) if end <= MAX_FILE_SIZE => Ok(()),
            _ => Err(Error::FileTooLarge {
                what: format!("{} at offset {offset} length {len}", self.handle.path),
                max: MAX_FILE_SIZE,
            }),
        }
    }

    /// Reads at `offset`; returns bytes read (short at EOF).
    pub fn pread(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        file_io::read(self, offset, buf).map_err(|e| self.at(offset, e))
    }

    /// Writes at `offset`; returns bytes written. With O_DSYNC/O_SYNC the
    /// data (and the metadata to reach it) is durable when it returns.
    ///
    /// A write that needs the file's exclusive lock (it allocates, converts,
    /// extends, or is the file's first that is not whole device blocks)
    /// first waits for the file's asynchronous requests in flight to be
    /// reaped: never call it from the thread that owns such requests.
    pub fn pwrite(&self, buf: &[u8], offset: u64) -> Result<usize> {
        self.modified(offset, buf.len() as u64)
            .map_err(|e| self.at(offset, e))?;
        let outcome = file_io::write(self, offset, buf).map_err(|e| self.at(offset, e))?;
        if self.handle.flags.direct && !outcome.pure_overwrite {
            // Its records (allocation, conversion, size) are bounded like
            // every other change's: committed once enough pile up. A writer
            // that never syncs otherwise grew the queue without limit, and
            // a queue of a million records grew (a copy of tens of MiB)
            // under the metadata lock.
            self.handle
                .vol
                .commit_if_due()
                .map_err(|e| self.at(offset, e))?;
        }
        Ok(buf.len())
    }

    /// A write of `len` bytes at `offset` is about to change the file (as
    /// Linux's `file_modified` in a file system's write checks): its mtime
    /// and ctime become now, in core (see [`crate::write_times`]). An
    /// O_SYNC handle logs them at once, so that the write's own commit
    /// makes them durable. A write of nothing changes nothing.
    pub(crate) fn modified(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.check_writable(offset, len)?;
        self.handle.inode.stamp_write();
        if self.handle.flags.sync {
            self.handle.vol.log_write_time(&self.handle.inode)?;
        }
        Ok(())
    }

    /// Makes this file's data and metadata durable: writes back its cached
    /// data and commits the journal (one commit covers every file), its
    /// times included. Reports a writeback error of this file this handle
    /// has not seen yet, once, whether this writeback or an earlier one met
    /// it.
    pub fn fsync(&self) -> Result<()> {
        self.handle.vol.check_live().map_err(|e| self.at(0, e))?;
        self.handle
            .vol
            .log_write_time(&self.handle.inode)
            .map_err(|e| self.at(0, e))?;
        file_io::fsync(self).map_err(|e| self.at(0, e))?;
        self.handle
            .vol
            .release_holds_if_idle(&self.handle.inode, false);
        Ok(())
    }

    /// Makes this file's data and the metadata needed to read it durable,
    /// as [`File::fsync`] but without waiting for the times of writes (an
    /// overwrite's `fdatasync` stays one device flush).
    pub fn fdatasync(&self) -> Result<()> {
        self.handle.vol.check_live().map_err(|e| self.at(0, e))?;
        file_io::fsync(self).map_err(|e| self.at(0, e))?;
        self.handle
            .vol
            .release_holds_if_idle(&self.handle.inode, false);
        Ok(())
    }

    /// Writes back and drops this file's cached folios before an operation
    /// that changes what its blocks hold (truncate, punch, fallocate).
    fn flush_cache(&self, offset: u64) -> Result<()> {
        iomap::buffered_io::flush_and_invalidate(self, 0, u64::MAX).map_err(|e| self.at(offset, e))
    }

    /// Allocates unwritten space for `[offset, offset+len)`; raises the size
    /// unless `keep_size`. Out of space changes nothing.
    pub fn fallocate(&self, offset: u64, len: u64, keep_size: bool) -> Result<()> {
        self.check_writable(offset, len)
            .map_err(|e| self.at(offset, e))?;
        if len == 0 {
            return Err(self.at(offset, Error::invalid("fallocate", "length 0")));
        }
        self.flush_cache(offset)?;
        let _exclusive = self.handle.inode.io_lock.lock_exclusive();
        self.handle.inode.io_lock.drain_dio();
        let block = self.block();
        let end = offset + len;
        if !keep_size {
            self.zero_past_eof_locked(end)
                .map_err(|e| self.at(offset, e))?;
        }
        let (blocks_start, blocks_end) = (align_down(offset, block), end.next_multiple_of(block));
        self.handle
            .vol
            .load_before_change(self.handle.inode.ino, blocks_start, blocks_end)
            .map_err(|e| self.at(offset, e))?;
        self.handle
            .vol
            .with_busy_retry(|meta| {
                allocate_holes(
                    &self.handle.vol,
                    meta,
                    self.handle.inode.ino,
                    blocks_start,
                    blocks_end,
                    false,
                )
            })
            .map_err(|e| self.at(offset, e))
            .map(drop)?;
        {
            let mut meta = self.handle.vol.meta.write();
            let size = meta
                .state
                .inode(self.handle.inode.ino)
                .map(|i| i.size)
                .ok_or(Error::Stale {
                    ino: self.handle.inode.ino,
                })?;
            if !keep_size && end > size {
                meta.log(Record::SetSize {
                    ino: self.handle.inode.ino,
                    size: end,
                    mtime_ns: now_ns(),
                })
                .map_err(|e| self.at(offset, e))?;
            }
        }
        // Done, under the exclusive lock with direct I/O drained: the
        // moment to drop the file's holds if nothing else is pending.
        self.handle
            .vol
            .release_holds_if_idle(&self.handle.inode, true);
        self.handle.vol.commit_if_due()
    }

    /// Before the size grows to cover `new_start` or beyond (see
    /// [`iomap::zero_eof_gap`]). Caller holds the exclusive lock.
    fn zero_past_eof_locked(&self, new_start: u64) -> Result<()> {
        iomap::zero_eof_gap(
            &*self.handle.vol,
            &*self.handle.vol.dev,
            &self.handle.inode,
            new_start,
        )
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
            &*self.handle.vol,
            &*self.handle.vol.dev,
            &self.handle.inode,
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
        self.flush_cache(offset)?;
        let _exclusive = self.handle.inode.io_lock.lock_exclusive();
        self.handle.inode.io_lock.drain_dio();
        let block = self.block();
        let end = offset + len;
        let inner_start = offset.next_multiple_of(block);
        let inner_end = align_down(end, block);
        let result = (|| {
            if inner_start >= inner_end {
                // No whole block inside: only zeroing to do.
                return self.zero_inside_eof_locked(offset, end);
            }
            // A punch inside an extent splits it: one more extent, which
            // with extent pages may be a paged file's. Checked before the
            // edges are zeroed too, so that a refused punch changes nothing.
            let reserve = |meta: &crate::mount_state::Meta| {
                let growth = meta.growth_for_extents(self.handle.inode.ino, 1);
                meta.reserve_base(&self.handle.vol.sb, growth)
            };
            self.handle
                .vol
                .load_before_change(self.handle.inode.ino, inner_start, inner_end)?;
            self.handle
                .vol
                .retry_if_busy(|| self.handle.vol.with_free_space(|meta| reserve(meta)))?;
            self.zero_inside_eof_locked(offset, inner_start)?;
            self.zero_inside_eof_locked(inner_end, end)?;
            self.handle.vol.with_free_space(|meta| {
                reserve(meta)?;
                meta.log(Record::Punch {
                    ino: self.handle.inode.ino,
                    file_off: inner_start,
                    len: inner_end - inner_start,
                    mtime_ns: now_ns(),
                })
            })?;
            Ok(())
        })();
        if result.is_ok() {
            // Also when only edge zeroing was done (the early return above).
            self.handle.inode.mapping.punch(offset, end);
        }
        result.map_err(|e| self.at(offset, e))?;
        // Done, under the exclusive lock with direct I/O drained: the
        // moment to drop the file's holds if nothing else is pending.
        self.handle
            .vol
            .release_holds_if_idle(&self.handle.inode, true);
        self.handle.vol.commit_if_due()
    }

    /// Sets the size. Shrinking frees the space past it; growing leaves a
    /// hole.
    pub fn truncate(&self, size: u64) -> Result<()> {
        self.check_writable(size, 0).map_err(|e| self.at(size, e))?;
        self.flush_cache(size)?;
        let _exclusive = self.handle.inode.io_lock.lock_exclusive();
        self.handle.inode.io_lock.drain_dio();
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
            let mut meta = self.handle.vol.meta.write();
            meta.log(Record::SetSize {
                ino: self.handle.inode.ino,
                size,
                mtime_ns: now_ns(),
            })?;
            drop(meta);
            self.handle.inode.mapping.punch(size, u64::MAX);
            Ok(())
        })();
        result.map_err(|e| self.at(size, e))?;
        // Done, under the exclusive lock with direct I/O drained: the
        // moment to drop the file's holds if nothing else is pending.
        self.handle
            .vol
            .release_holds_if_idle(&self.handle.inode, true);
        self.handle.vol.commit_if_due()
    }

    pub fn stat(&self) -> Result<Stat> {
        self.handle.vol.check_live()?;
        let meta = self.handle.vol.meta.read();
        if meta.state.inode(self.handle.inode.ino).is_none() {
            return Err(Error::Stale {
                ino: self.handle.inode.ino,
            });
        }
        Ok(self.handle.vol.stat_locked(&meta, self.handle.inode.ino))
    }

    /// `lseek(SEEK_DATA)` or `lseek(SEEK_HOLE)` from `offset`: the first
    /// offset at or after it that is data, or a hole (EOF counts as one).
    /// `None` (ENXIO) when `offset` is at or past EOF, or no data follows
    /// it. Data is written or unwritten space and buffered data not placed
    /// yet (a delayed allocation): answered from the mapping alone, so
    /// nothing is written back or flushed, and a writeback error stays for
    /// `fsync` to report.
    pub fn seek(&self, offset: u64, to: SeekFor) -> Result<Option<u64>> {
        self.handle.vol.check_live()?;
        let size = self.size()?;
        let mut pos = offset;
        while pos < size {
            let map = self
                .handle
                .vol
                .begin(&self.handle.inode, pos, size - pos, IomapOpFlags::empty())
                .map_err(|e| self.at(pos, e))?;
            if (map.kind != IomapKind::Hole) == (to == SeekFor::Data) {
                return Ok(Some(pos));
            }
            pos = map.end();
        }
        Ok((to == SeekFor::Hole && offset < size).then_some(size))
    }

    /// The file's map from 0 to EOF (and unwritten space beyond it):
    /// data, unwritten and hole ranges in order. Its memory is the
    /// caller's: for a file of millions of extents, walk the map in parts
    /// with [`File::fiemap_parts`].
    pub fn fiemap(&self) -> Result<Vec<FiemapExtent>> {
        let mut out = Vec::new();
        for part in self.fiemap_parts(FIEMAP_PART) {
            out.extend(part?);
        }
        Ok(out)
    }

    /// The file's map as [`File::fiemap`] lists it, in parts of at most
    /// `max` ranges (at least one), each read under the metadata lock on
    /// its own: a file changed meanwhile may show an earlier state in one
    /// part and a later one in the next, but parts never overlap or go
    /// back.
    pub fn fiemap_parts(&self, max: usize) -> FiemapParts<'_> {
        FiemapParts {
            file: self,
            max,
            from: 0,
            done: false,
        }
    }

    /// At most `max` ranges (at least one) of the file's map, as
    /// [`File::fiemap`] lists them, from the one that holds byte `offset`
    /// on; the next part starts where the last range ends. Empty at the
    /// end of the map.
    ///
    /// The extent pages it passes are read and dropped, not kept, so a map
    /// of any size is walked within the mount's metadata budget, and the
    /// metadata lock is held for one part at a time.
    pub fn fiemap_from(&self, offset: u64, max: usize) -> Result<Vec<FiemapExtent>> {
        self.handle.vol.check_live()?;
        let meta = self.handle.vol.meta.read();
        let inode = meta
            .state
            .inode(self.handle.inode.ino)
            .ok_or(Error::Stale {
                ino: self.handle.inode.ino,
            })?;
        let max = max.max(1);
        let mut out = Vec::new();
        // The end of the last extent passed: a hole that holds `offset`
        // starts there, as the whole map lists it.
        let mut cursor = 0;
        let hole = |from: u64, to: u64| FiemapExtent {
            offset: from,
            length: to - from,
            addr: 0,
            kind: FiemapKind::Hole,
        };
        // A page that fails to load (damage, a device error) fails the
        // call.
        let complete = inode.extents.for_each_unkept(offset, |ext| {
            if ext.file_end() <= offset {
                cursor = ext.file_end();
                return true;
            }
            // A hole that ends at or before `offset` is not listed.
            if ext.file_off > cursor.max(offset) {
                out.push(hole(cursor, ext.file_off));
                if out.len() == max {
                    return false;
                }
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
            out.len() < max
        })?;
        let eof = inode.size.next_multiple_of(self.block());
        if complete && eof > cursor.max(offset) && out.len() < max {
            out.push(hole(cursor, eof));
        }
        Ok(out)
    }
}

impl AsRef<InodeIoLock> for File {
    fn as_ref(&self) -> &InodeIoLock {
        &self.handle.inode.io_lock
    }
}

/// What the engine needs of an open file: the volume's answers, the inode,
/// the device, and the file system's checks and error context.
impl IomapFile for File {
    type Ops = VolumeInner;

    fn ops(&self) -> &VolumeInner {
        &self.handle.vol
    }

    fn inode(&self) -> &OpenInode {
        &self.handle.inode
    }

    fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.handle.vol.dev
    }

    fn flushes(&self) -> &Arc<FlushCoalescer> {
        &self.handle.vol.flush_coalescer
    }

    fn is_direct(&self) -> bool {
        self.handle.flags.direct
    }

    fn mapping(&self) -> &Mapping {
        &self.handle.inode.mapping
    }

    fn error_cursor(&self) -> &iomap::ErrorCursor {
        &self.handle.errors_seen
    }

    fn write_sync(&self) -> WriteSync {
        if self.handle.flags.sync {
            WriteSync::Sync
        } else if self.handle.flags.dsync {
            WriteSync::Dsync
        } else {
            WriteSync::None
        }
    }

    fn check_io(&self, pos: u64, len: u64, write: bool) -> Result<()> {
        if write {
            self.check_writable(pos, len)
        } else {
            self.handle.vol.check_live()
        }
    }

    /// The same handle, counted once more: the request reports through
    /// it, and the file stays open until the request is done.
    fn hold(&self) -> Result<File> {
        Ok(File {
            handle: Arc::clone(&self.handle),
        })
    }

    fn error_at(&self, offset: u64, err: Error) -> Error {
        self.at(offset, err)
    }
}
