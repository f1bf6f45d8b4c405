//! The iomapfs file system: on-disk format, metadata, journal, recovery and
//! fsck. It answers the iomap engine's mapping questions ([`iomap::IomapOps`])
//! and handles completions; it never builds device requests for file data.

pub mod aio;
pub mod alloc;
pub mod checkpoint;
pub mod codec;
mod delalloc;
pub mod error;
pub mod extent_map;
pub mod file;
mod flusher;
pub mod fsck;
mod handles;
mod iomap_ops;
pub mod journal;
pub mod limits;
mod mount;
mod mount_state;
mod namespace;
pub mod signature;
pub mod state;
pub mod superblock;
mod transaction;
pub mod types;
pub mod volume;

pub use error::{Error, Result};
pub use file::{FiemapExtent, FiemapKind, File, OpenFlags, Stat};
pub use types::{FileKind, Ino, ROOT_INO};
pub use volume::{DirEntry, FormatOptions, MountOptions, StatFs, Volume};
