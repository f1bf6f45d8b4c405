//! The contract between the engine and a file system.

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::ioend::{EndIo, WriteSync};
use crate::{EngineError, ErrorCursor, FlushCoalescer, InodeIoLock, Iomap, Mapping};

bitflags::bitflags! {
    /// What the caller of [`IomapOps::begin`] intends. No flag set is a read.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct IomapOpFlags: u16 {
        /// The range will be written: holes must be allocated.
        const WRITE = 1 << 0;
        /// Direct I/O: no page cache involved.
        const DIRECT = 1 << 1;
        /// The caller may not block: fail with `WouldBlock` instead.
        const NOWAIT = 1 << 2;
        /// Fail with `WouldBlock` rather than allocate, convert, zero, or
        /// cross EOF. Set when the caller holds only the inode's shared lock.
        /// A `Mapped` answer may still carry `DIRTY`: writing it is safe
        /// under the shared lock, but syncing it then needs a journal commit.
        const OVERWRITE_ONLY = 1 << 3;
        /// Zeroing a range.
        const ZERO = 1 << 4;
        /// The write is O_DSYNC.
        const DSYNC = 1 << 5;
        /// With `OVERWRITE_ONLY`: the range's tail past EOF is
        /// read-modify-write padding inside the device block that holds EOF,
        /// not data, so the mapping may reach to the end of that block
        /// without crossing EOF.
        const PADDED_TAIL = 1 << 6;
        /// With `WRITE | DIRECT`: writeback of cached data. The buffered
        /// write that dirtied it was the call that could fail for want of
        /// space; writeback may not (issue 10), so the file system keeps
        /// what writeback will need from then on.
        const WRITEBACK = 1 << 7;
    }
}

impl IomapOpFlags {
    /// A read: no flag set.
    pub const READ: IomapOpFlags = IomapOpFlags::empty();
}

/// The file system's side of the engine.
///
/// `begin` answers with the mapping at `pos` (which may cover less than `len`
/// bytes, never zero bytes); the engine does the I/O for that mapping, calls
/// `end`, and asks again for the rest.
pub trait IomapOps: Send + Sync {
    type Inode: ?Sized + Sync;
    type Error: EngineError;

    /// The mapping at `pos`, covering at most `len` bytes.
    ///
    /// With [`IomapOpFlags::WRITE`] and [`IomapOpFlags::DIRECT`], holes are
    /// allocated as `Unwritten` with [`crate::IomapFlags::NEW`]. With
    /// [`IomapOpFlags::OVERWRITE_ONLY`], anything but a `Mapped` range inside
    /// EOF fails with [`crate::IomapError::WouldBlock`].
    fn begin(
        &self,
        inode: &Self::Inode,
        pos: u64,
        len: u64,
        flags: IomapOpFlags,
    ) -> Result<Iomap, Self::Error>;

    /// The I/O for `iomap` is done (or failed) after `written` bytes.
    fn end(
        &self,
        _inode: &Self::Inode,
        _pos: u64,
        _len: u64,
        _written: u64,
        _flags: IomapOpFlags,
        _iomap: &Iomap,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The simple-read fast path: the device address of `[pos, pos+len)`
    /// when the whole range lies inside one `Mapped` extent and inside EOF,
    /// found with one lookup that takes no exclusive lock and allocates
    /// nothing. `None` sends the read down the generic path.
    fn simple_read_addr(&self, _inode: &Self::Inode, _pos: u64, _len: u64) -> Option<u64> {
        None
    }

    /// In-core file size: what reads see, including buffered writes not yet
    /// written back. An inode that no longer exists is an error, not an
    /// empty file.
    fn size(&self, inode: &Self::Inode) -> Result<u64, Self::Error>;

    /// On-disk size: what a direct write extends and what writeback
    /// completion raises (it lags [`Self::size`] while buffered writes past
    /// it are not written back).
    fn disk_size(&self, inode: &Self::Inode) -> Result<u64, Self::Error> {
        self.size(inode)
    }

    /// A buffered write raised the in-core size to `size` (never lowers
    /// it). Nothing reaches the journal: the on-disk size follows at
    /// writeback completion.
    fn extend_size_in_core(&self, inode: &Self::Inode, size: u64) -> Result<(), Self::Error>;

    /// File-system block size in bytes (allocation and zeroing unit).
    fn block_size(&self) -> u32;

    /// A write's data reached the device: convert the unwritten space and
    /// raise the size as `end` says, through the journal. Called once per
    /// write, after all its data I/O completed, for the bytes that did.
    fn end_io(&self, inode: &Self::Inode, end: &EndIo) -> Result<(), Self::Error>;

    /// Makes every metadata change applied so far durable, together with
    /// the data I/O that completed before it (a journal group commit, whose
    /// preflush covers that data).
    fn commit(&self) -> Result<(), Self::Error>;
}

/// An open file, as the engine drives it: the file system's handle type.
///
/// Asynchronous requests hold one (from [`IomapFile::hold`]) from
/// submission to completion, so the file — and its space, if it is unlinked
/// meanwhile — stays alive while I/O is in flight. `AsRef<InodeIoLock>`
/// gives the inode's I/O lock.
pub trait IomapFile: AsRef<InodeIoLock> + Send + Sync + Sized + 'static {
    type Ops: IomapOps;

    /// The file system's answers (one table per volume).
    fn ops(&self) -> &Self::Ops;

    fn inode(&self) -> &<Self::Ops as IomapOps>::Inode;

    /// The device the file's data lives on.
    fn device(&self) -> &Arc<dyn BlockDevice>;

    /// The volume's flush coalescer (one per device).
    fn flushes(&self) -> &Arc<FlushCoalescer>;

    /// O_DIRECT: no cache between the caller and the device; reads of one
    /// written block may take the simple-read fast path. Other handles go
    /// through the folio cache.
    fn is_direct(&self) -> bool;

    /// The file's page cache (one per inode).
    fn mapping(&self) -> &Mapping;

    /// Where this handle stands in its file's writeback errors.
    fn error_cursor(&self) -> &ErrorCursor;

    /// What each write of this handle promises.
    fn write_sync(&self) -> WriteSync;

    /// The file system's checks before I/O on `[pos, pos + len)` starts:
    /// the volume is live; for a write, the handle is writable and the
    /// range within the largest file size.
    fn check_io(&self, pos: u64, len: u64, write: bool) -> Result<(), FileError<Self>>;

    /// Another handle on the same file, for a request in flight.
    fn hold(&self) -> Result<Self, FileError<Self>>;

    /// `err`, said of this file at `offset` (its path, for example).
    fn error_at(&self, offset: u64, err: FileError<Self>) -> FileError<Self>;
}

/// The error type of a file's operations table.
pub type FileError<F> = <<F as IomapFile>::Ops as IomapOps>::Error;
