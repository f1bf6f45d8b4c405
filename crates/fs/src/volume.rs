//! A mounted volume: namespace operations, journal commits, checkpoints.
//! (API surface; implementation in progress.)

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::file::{File, OpenFlags, Stat};
use crate::types::{FileKind, Ino};
use crate::Result;

/// Choices made at format time.
#[derive(Clone, Debug)]
pub struct FormatOptions {
    /// File-system block size in bytes: a power of two, at least the device's
    /// logical block size, 512..=65536. Default 4096.
    pub block_size: u32,
    /// Journal size in bytes; `None` picks from the device size.
    pub journal_bytes: Option<u64>,
    /// Size of each of the two checkpoint slots in bytes; `None` picks from
    /// the device size.
    pub checkpoint_slot_bytes: Option<u64>,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: 4096,
            journal_bytes: None,
            checkpoint_slot_bytes: None,
        }
    }
}

/// One name in a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub ino: Ino,
    pub kind: FileKind,
}

/// Space usage of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    /// Bytes in the data area.
    pub data_bytes: u64,
    /// Bytes free for allocation now (excluding space freed by uncommitted
    /// changes).
    pub free_bytes: u64,
    pub inodes: u64,
}

/// A mounted iomapfs volume. Cheap to clone; all clones share one mount.
#[derive(Clone)]
pub struct Volume {
    _private: (),
}

impl Volume {
    /// Writes a new, empty file system to `device`.
    pub fn format(_device: Arc<dyn BlockDevice>, _opts: &FormatOptions) -> Result<()> {
        todo!()
    }

    /// Mounts the volume on `device`: reads the newest valid checkpoint and
    /// replays the journal after it.
    pub fn open(_device: Arc<dyn BlockDevice>) -> Result<Volume> {
        todo!()
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        todo!()
    }

    /// Opens (and with `flags.create`, creates) the regular file at `path`.
    pub fn open_file(&self, _path: &str, _flags: OpenFlags) -> Result<File> {
        todo!()
    }

    pub fn mkdir(&self, _path: &str) -> Result<()> {
        todo!()
    }

    pub fn readdir(&self, _path: &str) -> Result<Vec<DirEntry>> {
        todo!()
    }

    pub fn unlink(&self, _path: &str) -> Result<()> {
        todo!()
    }

    pub fn rmdir(&self, _path: &str) -> Result<()> {
        todo!()
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub fn rename(&self, _from: &str, _to: &str) -> Result<()> {
        todo!()
    }

    pub fn stat(&self, _path: &str) -> Result<Stat> {
        todo!()
    }

    pub fn statfs(&self) -> StatFs {
        todo!()
    }

    /// Makes every completed change durable (journal commit).
    pub fn sync(&self) -> Result<()> {
        todo!()
    }

    /// Writes a checkpoint and trims the journal.
    pub fn checkpoint(&self) -> Result<()> {
        todo!()
    }

    /// Checkpoints and releases the volume. Dropping a volume without
    /// unmounting leaves it to journal recovery at the next open.
    pub fn unmount(self) -> Result<()> {
        todo!()
    }
}
