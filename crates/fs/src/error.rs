//! File-system errors: each says what failed and where.

use blockdev::DeviceError;
use iomap::IomapError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: no such file or directory")]
    NotFound { path: String },
    #[error("{path}: file exists")]
    Exists { path: String },
    #[error("{path}: not a directory")]
    NotDir { path: String },
    #[error("{path}: is a directory")]
    IsDir { path: String },
    #[error("{path}: directory not empty")]
    NotEmpty { path: String },
    #[error("{path}: file name too long (max {max} bytes)")]
    NameTooLong { path: String, max: usize },
    #[error("{what}: invalid argument: {reason}")]
    InvalidArgument { what: String, reason: String },
    #[error("no space left on device: {what} needs {needed} bytes, {available} free")]
    NoSpace {
        what: String,
        needed: u64,
        available: u64,
    },
    #[error("{what}: operation would block")]
    WouldBlock { what: String },
    #[error("file is stale: inode {ino} was deleted")]
    Stale { ino: u64 },
    #[error("corrupt volume: {what} at device byte {offset}: {reason}")]
    Corrupt {
        what: &'static str,
        offset: u64,
        reason: String,
    },
    #[error("volume is not iomapfs or not supported: {reason}")]
    NotIomapfs { reason: String },
    #[error("iomapfs on-disk format version {found} is not supported (this build reads version {supported}): {hint}")]
    UnsupportedVersion {
        found: u32,
        supported: u32,
        hint: String,
    },
    #[error("{path}: too many links (max {max})")]
    TooManyLinks { path: String, max: u32 },
    #[error("{path}: operation not permitted: {reason}")]
    NotPermitted { path: String, reason: String },
    #[error("{path}: extended attribute {name:?} not found")]
    NoXattr { path: String, name: String },
    #[error("{path}: extended attribute {name:?}: {reason}")]
    XattrNotSupported {
        path: String,
        name: String,
        reason: String,
    },
    #[error("{path}: extended attribute name of {len} bytes is longer than {max}")]
    XattrNameTooLong {
        path: String,
        len: usize,
        max: usize,
    },
    #[error("{what}: {size} bytes exceed the limit of {max}")]
    TooBig { what: String, size: u64, max: u64 },
    /// A write, allocation or size past the largest file size (EFBIG, as
    /// POSIX names it; a caller through the mount sees this errno).
    #[error("{what}: ends past the largest file size {max}")]
    FileTooLarge { what: String, max: u64 },
    #[error(
        "{path}: is a symbolic link (paths given to the API are not followed through symlinks)"
    )]
    IsSymlink { path: String },
    #[error("{what}: {source}")]
    Device {
        what: String,
        #[source]
        source: DeviceError,
    },
    #[error(transparent)]
    Iomap(#[from] IomapError),
    /// An error in an operation on a file, with where it happened.
    #[error("{path} at offset {offset}: {source}")]
    At {
        path: String,
        offset: u64,
        #[source]
        source: Box<Error>,
    },
    #[error("volume was shut down after an I/O error; remount to recover: {reason}")]
    Shutdown { reason: String },
    /// Free space is still being rebuilt after mount (see
    /// `free_space`). Internal: a caller that gets it under the metadata
    /// lock drops the lock, waits for the scan and retries; it reaches
    /// nobody outside the crate.
    #[error("free space is still being rebuilt after mount")]
    FreeSpacePending,
    /// The scan that rebuilds free space after mount failed for a reason
    /// other than corruption (which is [`Error::Corrupt`]): nothing can be
    /// allocated until a remount.
    #[error("free space could not be rebuilt after mount, so nothing can be allocated until a remount: {reason}")]
    FreeSpaceUnavailable { reason: String },
}

impl iomap::EngineError for Error {
    fn as_iomap(&self) -> Option<&IomapError> {
        match self {
            Error::Iomap(e) => Some(e),
            _ => None,
        }
    }
}

impl Error {
    pub fn device(what: impl Into<String>, source: DeviceError) -> Error {
        Error::Device {
            what: what.into(),
            source,
        }
    }

    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            what: what.into(),
            reason: reason.into(),
        }
    }

    pub fn corrupt(what: &'static str, offset: u64, reason: impl Into<String>) -> Error {
        Error::Corrupt {
            what,
            offset,
            reason: reason.into(),
        }
    }

    /// The error beneath any [`Error::At`] wrappers.
    pub fn root(&self) -> &Error {
        match self {
            Error::At { source, .. } => source.root(),
            other => other,
        }
    }

    /// The closest POSIX errno, for the CLI, FUSE and a C API.
    pub fn errno(&self) -> i32 {
        match self {
            Error::NotFound { .. } => libc::ENOENT,
            Error::Exists { .. } => libc::EEXIST,
            Error::NotDir { .. } => libc::ENOTDIR,
            Error::IsDir { .. } => libc::EISDIR,
            Error::NotEmpty { .. } => libc::ENOTEMPTY,
            Error::NameTooLong { .. } => libc::ENAMETOOLONG,
            Error::InvalidArgument { .. } => libc::EINVAL,
            Error::NoSpace { .. } => libc::ENOSPC,
            Error::WouldBlock { .. } => libc::EAGAIN,
            Error::Stale { .. } => libc::ESTALE,
            Error::Corrupt { .. } | Error::NotIomapfs { .. } => libc::EUCLEAN,
            Error::UnsupportedVersion { .. } => libc::EPROTONOSUPPORT,
            Error::TooManyLinks { .. } => libc::EMLINK,
            Error::NotPermitted { .. } => libc::EPERM,
            Error::NoXattr { .. } => libc::ENODATA,
            Error::XattrNotSupported { .. } => libc::EOPNOTSUPP,
            Error::TooBig { .. } => libc::E2BIG,
            Error::FileTooLarge { .. } => libc::EFBIG,
            Error::XattrNameTooLong { .. } => libc::ERANGE,
            Error::IsSymlink { .. } => libc::ELOOP,
            Error::Device { source, .. } => source.errno(),
            Error::Iomap(e) => e.errno(),
            Error::Shutdown { .. } | Error::FreeSpaceUnavailable { .. } => libc::EIO,
            Error::FreeSpacePending => libc::EAGAIN,
            Error::At { source, .. } => source.errno(),
        }
    }
}
