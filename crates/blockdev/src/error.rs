//! Device errors: each says what failed and where.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot open device {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot probe {what} of device {path}: {source}")]
    Probe {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// An exclusive open (`O_EXCL` on a block device) was refused: the device
    /// is mounted, or another program holds it. Separate from `Open` because
    /// the remedy differs (unmount / stop the other user, not fix the path).
    #[error(
        "device {path} is in use (mounted, or opened exclusively by another program): {source}"
    )]
    Busy {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A write was sent to a handle opened read-only.
    #[error(
        "device {path} is open read-only: write of {len} bytes at device byte {offset} refused"
    )]
    ReadOnly {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    #[error("device {path} is unusable: {reason}")]
    Unusable { path: PathBuf, reason: String },
    #[error("request at byte {offset} length {len} is not aligned to the logical block size {logical_block_size}")]
    Unaligned {
        offset: u64,
        len: u64,
        logical_block_size: u32,
    },
    #[error("request at byte {offset} length {len} runs past the end of the device ({device_size} bytes)")]
    OutOfRange {
        offset: u64,
        len: u64,
        device_size: u64,
    },
    #[error("{op} of {len} bytes at device byte {offset} failed: {source}")]
    Io {
        op: IoOp,
        offset: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("flush failed: {source}")]
    Flush {
        #[source]
        source: std::io::Error,
    },
    #[error("short {op} at device byte {offset}: {done} of {len} bytes")]
    Short {
        op: IoOp,
        offset: u64,
        len: u64,
        done: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read,
    Write,
    Flush,
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
        })
    }
}

impl DeviceError {
    /// The OS error number closest to this error, for CLI exit codes and C API.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::Unaligned { .. } | DeviceError::OutOfRange { .. } => libc::EINVAL,
            DeviceError::Busy { .. } => libc::EBUSY,
            DeviceError::ReadOnly { .. } => libc::EROFS,
            DeviceError::Open { source, .. }
            | DeviceError::Probe { source, .. }
            | DeviceError::Io { source, .. }
            | DeviceError::Flush { source } => source.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EIO,
        }
    }
}
