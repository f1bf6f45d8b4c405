//! Open files: data I/O, sync, space management.
//! (API surface; implementation in progress.)

use crate::types::{FileKind, Ino};
use crate::Result;

/// How to open a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenFlags {
    /// Create the file if it does not exist.
    pub create: bool,
    /// With `create`: fail if it exists.
    pub exclusive: bool,
    /// Truncate to zero length on open.
    pub truncate: bool,
    /// O_DIRECT: offsets and lengths must be aligned to the device's logical
    /// block size.
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

/// An open regular file.
pub struct File {
    _private: (),
}

impl File {
    pub fn ino(&self) -> Ino {
        todo!()
    }
    pub fn flags(&self) -> OpenFlags {
        todo!()
    }
    /// Reads at `offset`; returns bytes read (short at EOF).
    pub fn pread(&self, _buf: &mut [u8], _offset: u64) -> Result<usize> {
        todo!()
    }
    /// Writes at `offset`; returns bytes written.
    pub fn pwrite(&self, _buf: &[u8], _offset: u64) -> Result<usize> {
        todo!()
    }
    pub fn fsync(&self) -> Result<()> {
        todo!()
    }
    pub fn fdatasync(&self) -> Result<()> {
        todo!()
    }
    /// Allocates unwritten space for `[offset, offset+len)`; raises the size
    /// unless `keep_size`.
    pub fn fallocate(&self, _offset: u64, _len: u64, _keep_size: bool) -> Result<()> {
        todo!()
    }
    /// Deallocates `[offset, offset+len)`; it reads as zeros afterwards.
    pub fn punch_hole(&self, _offset: u64, _len: u64) -> Result<()> {
        todo!()
    }
    pub fn truncate(&self, _size: u64) -> Result<()> {
        todo!()
    }
    pub fn stat(&self) -> Result<Stat> {
        todo!()
    }
    /// The file's map from 0 to EOF (and unwritten space beyond it):
    /// data, unwritten and hole ranges in order.
    pub fn fiemap(&self) -> Result<Vec<FiemapExtent>> {
        todo!()
    }
}
