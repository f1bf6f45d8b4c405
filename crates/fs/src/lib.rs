//! The iomapfs file system: on-disk format, metadata, journal, recovery and
//! fsck. It answers the iomap engine's mapping questions ([`iomap::IomapOps`])
//! and handles completions; it never builds device requests for file data.

pub mod aio;
pub mod alloc;
mod attributes;
mod background_request;
mod background_thread;
pub mod checkpoint;
pub mod codec;
mod delalloc;
pub mod error;
mod extent_cache;
#[cfg(test)]
mod extent_cache_tests;
pub mod extent_map;
pub mod extent_pages;
pub mod file;
mod flusher;
mod free_space;
#[cfg(test)]
mod free_space_scan_tests;
pub mod fsck;
mod handles;
mod iomap_ops;
pub mod journal;
pub mod limits;
mod lock_holds;
mod mount;
mod mount_state;
mod namespace;
pub mod page_chunks;
pub mod page_loader;
#[cfg(test)]
mod paged_damage_tests;
#[cfg(test)]
mod room_hold_tests;
pub mod signature;
pub mod state;
pub mod superblock;
mod transaction;
pub mod types;
pub mod volume;
mod write_times;
mod xattr;

pub use attributes::{SetAttr, TimeSet};
pub use error::{Error, Result};
pub use file::{FiemapExtent, FiemapKind, FiemapParts, File, OpenFlags, SeekFor, Stat};
pub use free_space::{ScanHook, ScanPoint};
pub use lock_holds::LongestLockHolds;
pub use namespace::{NewNode, RenameFlags};
pub use types::{FileKind, Ino, Timestamp, ROOT_INO};
pub use volume::{DirEntry, FormatOptions, MountOptions, StatFs, Volume};
pub use xattr::XattrSet;
