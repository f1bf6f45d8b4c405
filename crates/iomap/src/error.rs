//! Engine errors.

use blockdev::{AlignedBufError, DeviceError};

#[derive(Debug, thiserror::Error)]
pub enum IomapError {
    /// The request cannot proceed without blocking, allocating, converting or
    /// zeroing; retry without `NOWAIT`/`OVERWRITE_ONLY`.
    #[error("operation would block")]
    WouldBlock,
    #[error("direct I/O at file offset {pos} length {len} is not aligned to {alignment} bytes")]
    Unaligned { pos: u64, len: u64, alignment: u32 },
    #[error("device I/O for file offset {file_offset} failed: {source}")]
    Device {
        file_offset: u64,
        #[source]
        source: DeviceError,
    },
    #[error("file range at offset {pos} length {len} overflows the largest offset")]
    RangeOverflow { pos: u64, len: u64 },
    #[error("bounce buffer for byte-granular direct I/O at file offset {pos}: {source}")]
    Bounce {
        pos: u64,
        #[source]
        source: AlignedBufError,
    },
    #[error("file system returned a bad mapping for offset {pos}: {reason}")]
    BadMapping { pos: u64, reason: String },
    /// The device flush that was to make an O_DSYNC write durable failed.
    #[error("O_DSYNC write: device flush failed: {source}")]
    Flush {
        #[source]
        source: DeviceError,
    },
    /// The asynchronous queue itself failed (not one request).
    #[error("asynchronous I/O queue: {what}: {source}")]
    Queue {
        what: &'static str,
        #[source]
        source: DeviceError,
    },
    /// The completion worker of an asynchronous queue could not be started
    /// or has exited.
    #[error("asynchronous I/O completion worker: {reason}")]
    Worker { reason: String },
    /// Writing cached data back to the device failed; reported by the
    /// `fsync` that follows.
    #[error("writeback failed: {what}")]
    Writeback { errno: i32, what: String },
    /// A request named a file of another volume than its queue's.
    #[error("file belongs to another volume than this I/O queue")]
    ForeignFile,
}

impl IomapError {
    /// The file offset a device error concerns.
    pub fn file_offset(&self) -> Option<u64> {
        match self {
            IomapError::Device { file_offset, .. } => Some(*file_offset),
            IomapError::Unaligned { pos, .. }
            | IomapError::RangeOverflow { pos, .. }
            | IomapError::Bounce { pos, .. }
            | IomapError::BadMapping { pos, .. } => Some(*pos),
            _ => None,
        }
    }

    /// The closest POSIX errno.
    pub fn errno(&self) -> i32 {
        match self {
            IomapError::WouldBlock => libc::EAGAIN,
            IomapError::Unaligned { .. }
            | IomapError::Bounce { .. }
            | IomapError::RangeOverflow { .. }
            | IomapError::ForeignFile => libc::EINVAL,
            IomapError::Device { source, .. }
            | IomapError::Flush { source }
            | IomapError::Queue { source, .. } => source.errno(),
            IomapError::BadMapping { .. } => libc::EUCLEAN,
            IomapError::Worker { .. } => libc::EIO,
            IomapError::Writeback { errno, .. } => *errno,
        }
    }
}

/// A file system's error type, as the engine needs it: it carries engine
/// errors, and the engine must recognise `WouldBlock` in it to retry a
/// write under the exclusive lock.
pub trait EngineError: std::error::Error + Send + Sync + From<IomapError> + 'static {
    /// The engine error this is, if it is one.
    fn as_iomap(&self) -> Option<&IomapError>;

    fn is_would_block(&self) -> bool {
        matches!(self.as_iomap(), Some(IomapError::WouldBlock))
    }
}

impl EngineError for IomapError {
    fn as_iomap(&self) -> Option<&IomapError> {
        Some(self)
    }
}
