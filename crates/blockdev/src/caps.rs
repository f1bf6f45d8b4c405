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

/// The largest request a block device's kernel queue takes whole.
///
/// A request past any of these limits is split by the kernel into several,
/// which it will not do for a non-blocking (NOWAIT) submission: io_uring
/// then hands the request to a kernel worker thread, a much dearer path
/// (on a loop device, ~200 µs more before the first byte moves). The
/// io_uring backend sends larger requests as several pieces that fit.
/// Every limit is `None` where the kernel states none (image files,
/// memory) or sysfs cannot be read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestLimits {
    /// Bytes in one request (`queue/max_sectors_kb`).
    pub max_bytes: Option<usize>,
    /// Memory pages one request's buffer may touch: each page may be a
    /// segment of its own (the kernel merges only physically adjacent
    /// pages), so `queue/max_segments` bounds it, and one direct-I/O bio
    /// holds at most 256 pages (`BIO_MAX_VECS`; past it the kernel needs a
    /// second bio, which it refuses for NOWAIT too).
    pub max_pages: Option<usize>,
    /// Bytes in one request from physically contiguous memory (a buffer
    /// backed by transparent huge pages, whose pages merge into segments of
    /// up to `queue/max_segment_size`): `max_segments` such segments, less
    /// one for a start inside a segment. Used instead of `max_pages` for
    /// such buffers ([`crate::AlignedBuf::is_huge_page_mapping`]).
    pub max_contiguous_bytes: Option<usize>,
    /// A request must not cross a multiple of this many bytes of the disk
    /// (`queue/chunk_sectors`: RAID stripes, zones).
    pub boundary_bytes: Option<u64>,
    /// Where this device's byte 0 lies on the disk whose boundaries
    /// `boundary_bytes` counts: a partition's start (`/sys/dev/block/M:N/
    /// start`, in bytes), 0 for a whole disk. The kernel measures chunk
    /// boundaries from the disk's start, not the partition's.
    pub boundary_offset: u64,
}

impl RequestLimits {
    /// No limit: requests go whole.
    pub const NONE: RequestLimits = RequestLimits {
        max_bytes: None,
        max_pages: None,
        max_contiguous_bytes: None,
        boundary_bytes: None,
        boundary_offset: 0,
    };
}
