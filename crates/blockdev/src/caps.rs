//! Device capabilities: probed from the kernel, never assumed.

/// What kind of thing backs a device handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// A block device node, e.g. `/dev/zram0`.
    BlockDevice,
    /// A regular file used as an image.
    ImageFile,
    /// RAM, for tests.
    Memory,
}

/// What a device is and can do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    pub kind: DeviceKind,
    /// Human-readable identity, e.g. the path.
    pub name: String,
    /// Smallest unit of direct I/O, in bytes (512 or 4096 typically).
    pub logical_block_size: u32,
    /// Required alignment of buffer memory for direct I/O, in bytes.
    pub memory_alignment: u32,
    /// Usable size in bytes (a multiple of `logical_block_size`).
    pub size_bytes: u64,
    /// The device has a volatile write cache: writes need a flush (or FUA)
    /// to become durable.
    pub volatile_write_cache: bool,
    /// The device supports Force Unit Access natively.
    pub fua: bool,
    /// A [`WriteMode::Fua`](crate::WriteMode::Fua) write is a kernel
    /// `RWF_DSYNC` write: the kernel makes it durable before completing it.
    /// On a block device it sets FUA, which the block layer turns into a
    /// write and then a cache flush (merged with concurrent flushes) where
    /// the device lacks it; on an image file the host file system syncs the
    /// written range.
    /// Either way it is one request from here, and counters record it as a
    /// FUA write.
    pub kernel_durable_writes: bool,
    /// Data I/O bypasses the kernel page cache (`O_DIRECT`). False when the
    /// file system refused `O_DIRECT` and the backend fell back to buffered
    /// I/O: durability still holds (flush is `fdatasync`), but benchmark
    /// figures then measure the page cache, not the device.
    pub direct_io: bool,
}
