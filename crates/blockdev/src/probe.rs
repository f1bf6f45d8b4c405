//! Capability probing: asks the kernel what an open device handle can do.
//!
//! Everything iomapfs promises about durability and alignment rests on these
//! answers, so each value comes from the kernel (ioctl, `statx`, sysfs). When
//! the kernel cannot answer, the fallback is the choice that is *safe* (never
//! loses data or gets `EINVAL`), at the cost of speed — never the fast guess.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::aligned_buf::AlignedBuf;
use crate::error::DeviceError;
use crate::{DeviceCaps, DeviceKind, RequestLimits};

/// Capabilities learned from the kernel for one open descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Probed {
    pub logical_block_size: u32,
    pub memory_alignment: u32,
    pub size_bytes: u64,
    pub volatile_write_cache: bool,
    pub fua: bool,
}

/// `BLKGETSIZE64` from `<linux/fs.h>`: `_IOR(0x12, 114, size_t)`. The kernel
/// writes a `u64` whatever `size_t` is, so callers pass a `u64`.
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<libc::size_t>(0x12, 114);

/// Logical block size assumed for a buffered (non-`O_DIRECT`) image file that
/// the kernel gives no alignment for. Without `O_DIRECT` the kernel imposes no
/// alignment at all, so this only sets the device's I/O granularity: 512 is
/// the smallest sector any real disk has, so the image behaves like the
/// finest-grained device and sub-block code paths get the most exercise.
const BUFFERED_IMAGE_BLOCK_SIZE: u32 = 512;

/// Probes a block device node opened as `file`.
pub(crate) fn block_device(file: &File, path: &Path, rdev: u64) -> Result<Probed, DeviceError> {
    let fd = file.as_raw_fd();

    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET stores one `int` through its argument; `lbs` is a live,
    // writable `c_int` for the duration of the call, and `fd` is open (we hold
    // `file`).
    let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs as *mut libc::c_int) };
    if rc < 0 {
        return Err(probe_err(
            path,
            "logical block size (BLKSSZGET)",
            io::Error::last_os_error(),
        ));
    }
    let logical_block_size = u32::try_from(lbs)
        .ok()
        .filter(|b| b.is_power_of_two())
        .ok_or_else(|| unusable(path, format!("kernel reports logical block size {lbs}")))?;

    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 stores one `u64` through its argument; `size` is a
    // live, writable `u64` for the duration of the call, and `fd` is open.
    let rc = unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(probe_err(
            path,
            "size (BLKGETSIZE64)",
            io::Error::last_os_error(),
        ));
    }

    // Since Linux 6.11 statx reports a block device's DMA alignment, which
    // is often smaller than the block size (e.g. 4 bytes on NVMe). It is not
    // trusted below the block size: zram on Linux 6.18 reports 512 bytes
    // (queue/dma_alignment 511) but copies whole pages, so a 512-aligned,
    // not page-aligned buffer gets the bytes around it overwritten by a read
    // and wrong data written by a write. The block size is the alignment
    // the block layer has always honoured, and an `AlignedBuf` costs nothing
    // more at 4096 than at 4; only callers with arbitrary memory bounce more.
    let memory_alignment = match dio_support(file) {
        DioSupport::Aligned(dio) => dio.mem_align.max(logical_block_size),
        _ => logical_block_size,
    };

    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let queue = queue_dir(major, minor);
    // Conservative when sysfs cannot tell (not mounted in a container, or an
    // unusual driver): assuming a volatile cache only costs flushes that the
    // device treats as no-ops; assuming no FUA only costs the FUA fast path.
    let volatile_write_cache = read_sysfs_flag(
        path,
        queue.as_deref(),
        "write_cache",
        "volatile write cache (queue/write_cache)",
        parse_write_cache,
    )?
    .unwrap_or(true);
    let fua = read_sysfs_flag(
        path,
        queue.as_deref(),
        "fua",
        "FUA support (queue/fua)",
        parse_fua,
    )?
    .unwrap_or(false);

    finish(
        path,
        logical_block_size,
        memory_alignment,
        size,
        volatile_write_cache,
        fua,
    )
}

/// Probes a regular file used as an image. `dio` is what
/// [`dio_support`] said about the descriptor; `direct_io` whether it was
/// opened with `O_DIRECT`.
pub(crate) fn image_file(
    path: &Path,
    st_size: u64,
    direct_io: bool,
    dio: DioSupport,
) -> Result<Probed, DeviceError> {
    let (logical_block_size, memory_alignment) = match (direct_io, dio) {
        (true, DioSupport::Aligned(dio)) => (dio.offset_align, dio.mem_align),
        // Kernel before 6.1, or a file system that does not report
        // STATX_DIOALIGN. Linux file systems derive their O_DIRECT alignment
        // from the underlying logical block size, which is at most the page
        // size on every mainstream configuration, so page-aligned offsets,
        // lengths and buffers are always accepted.
        (true, _) => (page_size(), page_size()),
        (false, _) => (BUFFERED_IMAGE_BLOCK_SIZE, 1),
    };
    // The host file system may keep our writes in its page cache or in the
    // disk's cache; we cannot see through it, so flushes are always needed and
    // durable writes are emulated with RWF_DSYNC rather than native FUA.
    finish(
        path,
        logical_block_size,
        memory_alignment,
        st_size,
        true,
        false,
    )
}

/// Rounds the size down to whole blocks and rejects devices that cannot hold
/// one, or whose byte offsets would not fit `off_t`.
fn finish(
    path: &Path,
    logical_block_size: u32,
    memory_alignment: u32,
    raw_size: u64,
    volatile_write_cache: bool,
    fua: bool,
) -> Result<Probed, DeviceError> {
    let size_bytes = raw_size - raw_size % u64::from(logical_block_size);
    if size_bytes == 0 {
        return Err(unusable(
            path,
            format!(
                "size {raw_size} bytes holds no whole logical block of {logical_block_size} bytes"
            ),
        ));
    }
    if i64::try_from(size_bytes).is_err() {
        return Err(unusable(
            path,
            format!("size {size_bytes} bytes does not fit off_t"),
        ));
    }
    Ok(Probed {
        logical_block_size,
        memory_alignment,
        size_bytes,
        volatile_write_cache,
        fua,
    })
}

/// Direct-I/O alignment of one descriptor, from `statx(STATX_DIOALIGN)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DioAlign {
    pub mem_align: u32,
    pub offset_align: u32,
}

/// What the kernel says about direct I/O on a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DioSupport {
    Aligned(DioAlign),
    /// The kernel answered with zero alignments: this file cannot do
    /// `O_DIRECT` even though the open may have succeeded (e.g. ext4 with
    /// `data=journal`), so I/O would fail with `EINVAL`.
    Unsupported,
    /// No usable answer: statx missing or filtered (ENOSYS, EPERM under
    /// seccomp), the DIOALIGN bit not returned (kernel before 6.1, or a file
    /// system that does not report it), or a value that is not a power of two.
    Unknown,
}

pub(crate) fn dio_support(file: &File) -> DioSupport {
    // SAFETY: `statx` is plain old data (integers and padding); all-zero bytes
    // are a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid NUL-terminated empty string, which with
    // AT_EMPTY_PATH makes statx describe `fd` itself; `stx` is a live,
    // writable `statx` the kernel fills in; `fd` is open (we hold `file`).
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return DioSupport::Unknown;
    }
    match (stx.stx_dio_mem_align, stx.stx_dio_offset_align) {
        (0, _) | (_, 0) => DioSupport::Unsupported,
        (mem, off) if mem.is_power_of_two() && off.is_power_of_two() => {
            DioSupport::Aligned(DioAlign {
                mem_align: mem,
                offset_align: off,
            })
        }
        _ => DioSupport::Unknown,
    }
}

/// Whether a descriptor accepts non-blocking submission (`RWF_NOWAIT`,
/// the kernel's `IOCB_NOWAIT`).
///
/// io_uring first issues every read and write with NOWAIT from the
/// submitting thread; a file that refuses NOWAIT outright (zram, and other
/// bio-based drivers without `QUEUE_FLAG_NOWAIT`) has every request handed to
/// an io-wq kernel worker instead, which costs a context switch per request
/// and makes io_uring slower than plain `pread`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Nowait {
    Supported,
    /// Refused; the text is the evidence, for the user.
    Unsupported(String),
    /// The probe could not tell; the text says why.
    Unknown(String),
}

/// Probes NOWAIT on `file` (opened as described by `caps`): the block
/// queue's `nowait` attribute where sysfs has one, then one aligned
/// `preadv2(RWF_NOWAIT)` of the first logical block, which is what decides:
/// the kernel answers `EOPNOTSUPP` when the file cannot take NOWAIT at all,
/// and `EAGAIN` only when it can but would block right now.
pub(crate) fn nowait_support(file: &File, caps: &DeviceCaps) -> Nowait {
    if caps.kind == DeviceKind::BlockDevice {
        if let Ok(meta) = file.metadata() {
            let queue = queue_dir(libc::major(meta.rdev()), libc::minor(meta.rdev()));
            if let Some(queue) = queue {
                // Not every kernel has the attribute; when it says 0 the
                // read below would only confirm it.
                if let Ok(text) = std::fs::read_to_string(queue.join("nowait")) {
                    if text.trim() == "0" {
                        return Nowait::Unsupported(format!(
                            "{} is 0",
                            queue.join("nowait").display()
                        ));
                    }
                }
            }
        }
    }
    let len = caps.logical_block_size as usize;
    let align = caps.memory_alignment.max(caps.logical_block_size) as usize;
    let mut buf = match AlignedBuf::new(len, align) {
        Ok(buf) => buf,
        Err(e) => return Nowait::Unknown(e.to_string()),
    };
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    loop {
        // SAFETY: `iov` describes `buf`, `len` writable bytes that live (and
        // are not otherwise borrowed) for the whole call; one iovec is passed,
        // matching `iovcnt = 1`; `file` keeps the descriptor open.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
        if n >= 0 {
            return Nowait::Supported;
        }
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => Nowait::Supported,
            Some(libc::EOPNOTSUPP) => {
                Nowait::Unsupported("preadv2(RWF_NOWAIT) fails with EOPNOTSUPP".into())
            }
            _ => Nowait::Unknown(format!("preadv2(RWF_NOWAIT) failed: {err}")),
        };
    }
}

/// The `kernel.io_uring_disabled` sysctl (Linux 6.6+): 0 enabled, 1 only
/// for members of `kernel.io_uring_group` (and CAP_SYS_ADMIN), 2 disabled
/// for everyone. `None` when the kernel has no such knob or it is unreadable.
pub(crate) fn io_uring_disabled() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The page size as the capabilities hold it (a page is far below 4 GiB).
fn page_size() -> u32 {
    crate::page_size() as u32
}

/// The sysfs `queue` directory describing the device `major:minor`. A whole
/// disk has `/sys/dev/block/M:N/queue`; a partition has none, and its queue
/// is the parent disk's, one directory up. `None` if neither exists (sysfs
/// not mounted, or no queue for this driver).
fn queue_dir(major: u32, minor: u32) -> Option<PathBuf> {
    let dev = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    // `..` is resolved by the kernel after following the `M:N` symlink, so it
    // names the parent disk's directory.
    [dev.join("queue"), dev.join("../queue")]
        .into_iter()
        .find(|dir| dir.is_dir())
}

/// `queue/nr_requests` of the block device `rdev`: how many requests its
/// kernel queue holds at once. `None` where sysfs does not say (bio-based
/// devices such as zram have no request queue).
pub(crate) fn request_slots(rdev: u64) -> Option<usize> {
    let queue = queue_dir(libc::major(rdev), libc::minor(rdev))?;
    usize::try_from(queue_number(&queue, "nr_requests")?).ok()
}

/// A positive number a queue attribute states; `None` where it is absent,
/// unreadable, zero or not a number (the attributes read this way are
/// hints for speed, never for durability).
fn queue_number(queue: &Path, attr: &str) -> Option<u64> {
    let text = std::fs::read_to_string(queue.join(attr)).ok()?;
    text.trim().parse::<u64>().ok().filter(|&n| n > 0)
}

/// Pages one direct-I/O bio holds (`BIO_MAX_VECS`): a larger request needs
/// a second bio, which the kernel does not allocate for a NOWAIT request.
const BIO_MAX_PAGES: usize = 256;

/// The largest request the queue of block device `rdev` takes whole (see
/// [`RequestLimits`]). Only a hint for speed: a limit sysfs does not state
/// (or states in a form not understood) is `None`, which sends requests
/// whole, as the kernel then splits them itself, slower but correctly.
pub(crate) fn request_limits(rdev: u64) -> RequestLimits {
    let Some(queue) = queue_dir(libc::major(rdev), libc::minor(rdev)) else {
        return RequestLimits {
            max_pages: Some(BIO_MAX_PAGES),
            ..RequestLimits::NONE
        };
    };
    let number = |attr: &str| queue_number(&queue, attr);
    let limits = limits_from(
        number("max_sectors_kb"),
        number("max_segments"),
        number("max_segment_size"),
        number("chunk_sectors"),
        page_size() as u64,
    );
    RequestLimits {
        boundary_offset: partition_start_bytes(rdev),
        ..limits
    }
}

/// Bytes from its disk's start to partition `rdev`'s first byte (`start`,
/// in 512-byte sectors, exists only for partitions); 0 for a whole disk or
/// where sysfs does not say.
fn partition_start_bytes(rdev: u64) -> u64 {
    let dev = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    std::fs::read_to_string(dev.join("start"))
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .map_or(0, |sectors| sectors.saturating_mul(512))
}

/// [`request_limits`] from the queue's attributes (`None`: absent).
fn limits_from(
    max_sectors_kb: Option<u64>,
    max_segments: Option<u64>,
    max_segment_size: Option<u64>,
    chunk_sectors: Option<u64>,
    page: u64,
) -> RequestLimits {
    // A page of the buffer takes as many segments as it has pieces of
    // `max_segment_size`.
    let segments_per_page = max_segment_size.map_or(1, |size| page.div_ceil(size));
    let pages_by_segments = max_segments.map(|n| n / segments_per_page);
    let max_pages = pages_by_segments
        .map_or(BIO_MAX_PAGES, |n| (n as usize).min(BIO_MAX_PAGES))
        .max(1);
    let max_contiguous_bytes = match (max_segments, max_segment_size) {
        (Some(n), Some(size)) => usize::try_from(n.saturating_sub(1).saturating_mul(size)).ok(),
        _ => None,
    };
    RequestLimits {
        max_bytes: max_sectors_kb.and_then(|kb| usize::try_from(kb.saturating_mul(1024)).ok()),
        max_pages: Some(max_pages),
        max_contiguous_bytes: max_contiguous_bytes.filter(|&n| n > 0),
        boundary_bytes: chunk_sectors.map(|s| s.saturating_mul(512)),
        boundary_offset: 0,
    }
}

/// Reads and parses one sysfs attribute. `Ok(None)` when the queue directory
/// or the attribute does not exist; an error when it exists but cannot be
/// read or says something we do not understand (better to stop than to guess
/// about durability).
fn read_sysfs_flag(
    path: &Path,
    queue: Option<&Path>,
    attr: &str,
    what: &'static str,
    parse: fn(&str) -> Option<bool>,
) -> Result<Option<bool>, DeviceError> {
    let Some(queue) = queue else { return Ok(None) };
    let file = queue.join(attr);
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(probe_err(path, what, e)),
    };
    parse(&text).map(Some).ok_or_else(|| {
        probe_err(
            path,
            what,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "unrecognised content {:?} in {}",
                    text.trim(),
                    file.display()
                ),
            ),
        )
    })
}

/// `queue/write_cache`: "write back" means a volatile cache that needs
/// flushes; "write through" means completed writes are durable.
fn parse_write_cache(text: &str) -> Option<bool> {
    match text.trim() {
        "write back" => Some(true),
        "write through" => Some(false),
        _ => None,
    }
}

/// `queue/fua`: "1" when the device honours Force Unit Access natively.
fn parse_fua(text: &str) -> Option<bool> {
    match text.trim() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

fn probe_err(path: &Path, what: &'static str, source: io::Error) -> DeviceError {
    DeviceError::Probe {
        path: path.to_owned(),
        what,
        source,
    }
}

fn unusable(path: &Path, reason: String) -> DeviceError {
    DeviceError::Unusable {
        path: path.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_values_parse_strictly() {
        assert_eq!(parse_write_cache("write back\n"), Some(true));
        assert_eq!(parse_write_cache("write through\n"), Some(false));
        assert_eq!(parse_write_cache("writeback"), None);
        assert_eq!(parse_write_cache(""), None);
        assert_eq!(parse_fua("1\n"), Some(true));
        assert_eq!(parse_fua("0\n"), Some(false));
        assert_eq!(parse_fua("yes"), None);
    }

    #[test]
    fn size_is_rounded_down_and_empty_devices_are_refused() {
        let p = Path::new("/x");
        let probed = finish(p, 4096, 512, 3 * 4096 + 100, true, false).unwrap();
        assert_eq!(probed.size_bytes, 3 * 4096);
        for raw in [0, 4095] {
            assert!(matches!(
                finish(p, 4096, 512, raw, true, false),
                Err(DeviceError::Unusable { .. })
            ));
        }
        assert!(matches!(
            finish(p, 512, 512, u64::MAX - 511, true, false),
            Err(DeviceError::Unusable { .. })
        ));
    }

    /// The loop device of the bench bed: 1280 KiB, 128 segments of up to
    /// 64 KiB, no chunks. A buffer of scattered 4 KiB pages is 128 segments
    /// at 512 KiB, which binds first.
    #[test]
    fn request_limits_take_every_queue_limit() {
        let page = 4096;
        let lo = limits_from(Some(1280), Some(128), Some(65536), None, page);
        assert_eq!(lo.max_bytes, Some(1280 << 10));
        assert_eq!(lo.max_pages, Some(128));
        assert_eq!(lo.max_contiguous_bytes, Some(127 * 65536));
        assert_eq!(lo.boundary_bytes, None);
        // Segments smaller than a page: two per page.
        let small = limits_from(None, Some(128), Some(2048), Some(8), page);
        assert_eq!(small.max_pages, Some(64));
        assert_eq!(small.boundary_bytes, Some(4096));
        assert_eq!(small.max_bytes, None);
        assert_eq!(small.max_contiguous_bytes, Some(127 * 2048));
        let unknown_segments = limits_from(Some(1280), Some(128), None, None, page);
        assert_eq!(unknown_segments.max_contiguous_bytes, None);
        // Many segments: one bio's 256 pages bind.
        let nvme = limits_from(Some(128), Some(1024), None, None, page);
        assert_eq!(nvme.max_pages, Some(BIO_MAX_PAGES));
    }

    #[test]
    fn missing_sysfs_queue_gives_no_answer() {
        let p = Path::new("/x");
        assert_eq!(
            read_sysfs_flag(p, None, "fua", "fua", parse_fua).unwrap(),
            None
        );
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read_sysfs_flag(p, Some(dir.path()), "fua", "fua", parse_fua).unwrap(),
            None
        );
        std::fs::write(dir.path().join("fua"), "maybe\n").unwrap();
        assert!(matches!(
            read_sysfs_flag(p, Some(dir.path()), "fua", "fua", parse_fua),
            Err(DeviceError::Probe { .. })
        ));
        std::fs::write(dir.path().join("fua"), "1\n").unwrap();
        assert_eq!(
            read_sysfs_flag(p, Some(dir.path()), "fua", "fua", parse_fua).unwrap(),
            Some(true)
        );
    }
}
