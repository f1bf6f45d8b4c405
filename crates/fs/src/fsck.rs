//! Offline consistency check. (API surface; implementation in progress.)

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::Result;

/// What fsck found. Clean when `problems` is empty.
#[derive(Clone, Debug, Default)]
pub struct FsckReport {
    /// One line per inconsistency, saying what and where.
    pub problems: Vec<String>,
    pub inodes: u64,
    pub directories: u64,
    pub extents: u64,
    /// Bytes of the data area used by extents.
    pub used_bytes: u64,
    pub data_bytes: u64,
    /// Journal records replayed on top of the checkpoint.
    pub journal_records: u64,
    /// Generation of the checkpoint used.
    pub checkpoint_generation: u64,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks the volume on `device` without modifying it. Returns `Err` only when
/// the volume cannot be read at all (no valid superblock or checkpoint, device
/// error); every other inconsistency is a line in the report.
pub fn check(_device: Arc<dyn BlockDevice>) -> Result<FsckReport> {
    todo!()
}
