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
}
