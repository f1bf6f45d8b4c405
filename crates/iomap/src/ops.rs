//! The contract between the engine and a file system.

use crate::{Iomap, IomapError};

/// What the caller of [`IomapOps::begin`] intends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IomapOpFlags(u16);

impl IomapOpFlags {
    pub const READ: IomapOpFlags = IomapOpFlags(0);
    /// The range will be written: holes must be allocated.
    pub const WRITE: IomapOpFlags = IomapOpFlags(1 << 0);
    /// Direct I/O: no page cache involved.
    pub const DIRECT: IomapOpFlags = IomapOpFlags(1 << 1);
    /// The caller may not block: fail with `WouldBlock` instead.
    pub const NOWAIT: IomapOpFlags = IomapOpFlags(1 << 2);
    /// Fail with `WouldBlock` rather than allocate, convert, zero, or cross
    /// EOF. Set when the caller holds only the inode's shared lock. A
    /// `Mapped` answer may still carry `DIRTY`: writing it is safe under the
    /// shared lock, but syncing it then needs a journal commit.
    pub const OVERWRITE_ONLY: IomapOpFlags = IomapOpFlags(1 << 3);
    /// Zeroing a range.
    pub const ZERO: IomapOpFlags = IomapOpFlags(1 << 4);
    /// The write is O_DSYNC.
    pub const DSYNC: IomapOpFlags = IomapOpFlags(1 << 5);
    /// With `OVERWRITE_ONLY`: the range's tail past EOF is read-modify-write
    /// padding inside the device block that holds EOF, not data, so the
    /// mapping may reach to the end of that block without crossing EOF.
    pub const PADDED_TAIL: IomapOpFlags = IomapOpFlags(1 << 6);

    pub const fn contains(self, other: IomapOpFlags) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn union(self, other: IomapOpFlags) -> IomapOpFlags {
        IomapOpFlags(self.0 | other.0)
    }
}

impl std::ops::BitOr for IomapOpFlags {
    type Output = IomapOpFlags;
    fn bitor(self, rhs: IomapOpFlags) -> IomapOpFlags {
        self.union(rhs)
    }
}

/// What a direct write's completion must do, collected from its mappings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DioEndFlags {
    /// Some of the written range was `Unwritten`: convert it to `Mapped`.
    pub unwritten: bool,
    /// The write ends past the in-memory size: raise the on-disk size.
    pub size_change: bool,
}

impl DioEndFlags {
    /// Completion needs no metadata work: a pure overwrite inside EOF.
    pub fn is_pure(&self) -> bool {
        !self.unwritten && !self.size_change
    }
}

/// The file system's side of the engine.
///
/// `begin` answers with the mapping at `pos` (which may cover less than `len`
/// bytes, never zero bytes); the engine does the I/O for that mapping, calls
/// `end`, and asks again for the rest.
pub trait IomapOps: Send + Sync {
    type Inode: ?Sized + Sync;
    type Error: std::error::Error + Send + Sync + From<IomapError> + 'static;

    /// The mapping at `pos`, covering at most `len` bytes.
    ///
    /// With [`IomapOpFlags::WRITE`] and [`IomapOpFlags::DIRECT`], holes are
    /// allocated as `Unwritten` with [`crate::IomapFlags::NEW`]. With
    /// [`IomapOpFlags::OVERWRITE_ONLY`], anything but a `Mapped` range inside
    /// EOF fails with [`IomapError::WouldBlock`].
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

    /// In-memory file size, used to detect EOF crossings. An inode that no
    /// longer exists is an error, not an empty file.
    fn size(&self, inode: &Self::Inode) -> Result<u64, Self::Error>;

    /// File-system block size in bytes (allocation and zeroing unit).
    fn block_size(&self) -> u32;

    /// A direct write of `[pos, pos + len)` reached the device. Convert
    /// unwritten space and raise the on-disk size as `flags` say, through the
    /// journal. Called once per write, after all its data I/O completed.
    fn dio_end_io(
        &self,
        inode: &Self::Inode,
        pos: u64,
        len: u64,
        flags: DioEndFlags,
    ) -> Result<(), Self::Error>;
}
