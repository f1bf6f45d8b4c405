//! Synchronous backend: one `O_DIRECT` descriptor, `pread` and `pwritev2`.
//!
//! The simplest backend that is still honest about durability: every request
//! is one (looped) system call that has finished when the method returns, so
//! a completed write is exactly as durable as the device's write cache allows,
//! FUA is `RWF_DSYNC` on that one write, and flush is `fdatasync`. It is also
//! the right backend where io_uring cannot submit without a kernel worker
//! (see DESIGN.md, "Devices").

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::aligned_buf::AlignedBuf;
use crate::error::IoOp;
use crate::probe::{self, DioSupport};
use crate::request::Admission;
use crate::WriteMode;
use crate::{BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceKind, RequestLimits};

/// How to open a [`SyncDevice`].
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncOpenOptions {
    /// Open `O_RDONLY`: for fsck and inspection, which must not be able to
    /// change the device even by mistake. Writes then fail with
    /// [`DeviceError::ReadOnly`].
    pub read_only: bool,
}

/// Most bytes bounced at a time: a large misaligned request (a checkpoint
/// image of hundreds of megabytes, read at mount or written whole) goes
/// through one bounce buffer of this size in pieces, instead of one as large
/// as itself, which doubled the process's memory for the request. Small in
/// unit tests, so that their requests take several pieces.
const BOUNCE_PIECE_BYTES: usize = if cfg!(test) { 8 << 10 } else { 4 << 20 };

/// A block device or image file driven with synchronous system calls.
#[derive(Debug)]
pub struct SyncDevice {
    file: File,
    path: PathBuf,
    caps: DeviceCaps,
    counters: DeviceCounters,
    read_only: bool,
    /// `queue/nr_requests` of a block device ([`BlockDevice::request_slots`]).
    request_slots: Option<usize>,
    /// The largest request the kernel takes whole (block devices only).
    request_limits: RequestLimits,
    /// Requests copied through an aligned bounce buffer; a caller that
    /// cares about speed checks this stays 0.
    bounced: AtomicU64,
}

impl SyncDevice {
    /// Opens `path` (a block device node or an existing regular file) and
    /// probes its capabilities.
    ///
    /// Block devices are opened `O_EXCL`, so a mounted device or one another
    /// program holds exclusively is refused with [`DeviceError::Busy`] instead
    /// of being corrupted underneath its owner.
    pub fn open(path: &Path, opts: SyncOpenOptions) -> Result<SyncDevice, DeviceError> {
        let open_err = |source| DeviceError::Open {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(open_err)?;
        let kind = kind_of(path, &meta.file_type())?;
        let exclusive = kind == DeviceKind::BlockDevice;

        let (mut file, mut direct_io) = open_fd(path, opts.read_only, exclusive)?;

        // The path was looked up twice (stat, then open); make sure both
        // found the same object, or the open flags we chose (O_EXCL or not)
        // would have been for something else.
        let opened = file.metadata().map_err(open_err)?;
        if (opened.dev(), opened.ino()) != (meta.dev(), meta.ino()) {
            return Err(DeviceError::Unusable {
                path: path.to_owned(),
                reason: "it was replaced while being opened".into(),
            });
        }
        let meta = opened;

        let probed = match kind {
            DeviceKind::BlockDevice => probe::block_device(&file, path, meta.rdev())?,
            _ => {
                let mut dio = probe::dio_support(&file);
                if direct_io && dio == DioSupport::Unsupported {
                    // Open succeeded but the file system says this file cannot
                    // do direct I/O; every request would fail with EINVAL.
                    file = open_with(path, opts.read_only, false, false).map_err(open_err)?;
                    direct_io = false;
                    dio = probe::dio_support(&file);
                }
                probe::image_file(path, meta.len(), direct_io, dio)?
            }
        };

        let caps = DeviceCaps {
            kind,
            name: path.display().to_string(),
            logical_block_size: probed.logical_block_size,
            memory_alignment: probed.memory_alignment,
            size_bytes: probed.size_bytes,
            volatile_write_cache: probed.volatile_write_cache,
            fua: probed.fua,
            kernel_durable_writes: true,
            direct_io,
        };
        Ok(SyncDevice {
            file,
            path: path.to_owned(),
            caps,
            counters: DeviceCounters::default(),
            read_only: opts.read_only,
            request_slots: exclusive
                .then(|| probe::request_slots(meta.rdev()))
                .flatten(),
            request_limits: if exclusive {
                probe::request_limits(meta.rdev())
            } else {
                RequestLimits::NONE
            },
            bounced: AtomicU64::new(0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The largest request the kernel takes whole ([`RequestLimits`]);
    /// no limit for an image file.
    pub fn request_limits(&self) -> RequestLimits {
        self.request_limits
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Requests that went through a bounce buffer because the caller's
    /// memory was not aligned to [`DeviceCaps::memory_alignment`]. Each costs
    /// an allocation and a copy; hot paths should keep this at 0.
    pub fn bounced_requests(&self) -> u64 {
        self.bounced.load(Ordering::Relaxed)
    }

    /// The descriptor, for backends that drive it another way (io_uring)
    /// and for probes.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Validates and counts requests on this handle, for every path that
    /// sends them (these methods, and queues on the same descriptor).
    pub(crate) fn admission(&self) -> Admission<'_> {
        let admission = Admission::new(&self.caps, &self.counters);
        if self.read_only {
            admission.read_only(&self.path)
        } else {
            admission
        }
    }

    /// Counts one request bounced outside this type (by a queue).
    pub(crate) fn note_bounce(&self) {
        self.bounced.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn needs_bounce(&self, addr: *const u8, len: usize) -> bool {
        self.caps.direct_io
            && len != 0
            && !(addr as usize).is_multiple_of(self.caps.memory_alignment as usize)
    }

    fn bounce_buf(&self, op: IoOp, offset: u64, len: usize) -> Result<AlignedBuf, DeviceError> {
        self.bounced.fetch_add(1, Ordering::Relaxed);
        AlignedBuf::new(len, self.caps.memory_alignment as usize).map_err(|e| DeviceError::Io {
            op,
            offset,
            len: len as u64,
            source: io::Error::new(io::ErrorKind::OutOfMemory, e),
        })
    }

    /// `pread` until `buf` is full. Short reads are legal (signals, device
    /// limits) and are continued; a read of 0 bytes means the image shrank
    /// under us, which is reported rather than looped on.
    fn read_fully(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        let len = buf.len() as u64;
        let mut done = 0usize;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(DeviceError::Short {
                        op: IoOp::Read,
                        offset,
                        len,
                        done: done as u64,
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(DeviceError::Io {
                        op: IoOp::Read,
                        offset,
                        len,
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// `pwritev2` until all of `buf` is written. `flags` is 0 or
    /// `RWF_DSYNC`; with `RWF_DSYNC` each partial write is itself durable, so
    /// looping keeps the whole write durable at completion.
    fn write_fully(&self, buf: &[u8], offset: u64, flags: libc::c_int) -> Result<(), DeviceError> {
        let len = buf.len() as u64;
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            let iov = libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // `open` guaranteed every in-range offset fits off_t, and
            // `check_request` kept this request in range.
            let pos = (offset + done as u64) as libc::off_t;
            // SAFETY: `iov` describes `rest`, which is borrowed for the whole
            // call and is `rest.len()` readable bytes; pwritev2 only reads
            // through `iov_base` despite the `*mut` in `iovec`. One iovec is
            // passed, matching `iovcnt = 1`. The descriptor is open (we own
            // `self.file`).
            let n = unsafe { libc::pwritev2(self.file.as_raw_fd(), &iov, 1, pos, flags) };
            if n < 0 {
                let source = io::Error::last_os_error();
                if source.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(DeviceError::Io {
                    op: IoOp::Write,
                    offset,
                    len,
                    source,
                });
            }
            if n == 0 {
                return Err(DeviceError::Short {
                    op: IoOp::Write,
                    offset,
                    len,
                    done: done as u64,
                });
            }
            done += n as usize;
        }
        Ok(())
    }
}

impl BlockDevice for SyncDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.admission().read(offset, buf.len())?;
        if self.needs_bounce(buf.as_ptr(), buf.len()) {
            let piece = buf.len().min(BOUNCE_PIECE_BYTES);
            let mut bounce = self.bounce_buf(IoOp::Read, offset, piece)?;
            for (at, part) in (offset..).step_by(piece).zip(buf.chunks_mut(piece)) {
                let bounced = &mut bounce[..part.len()];
                self.read_fully(bounced, at)?;
                part.copy_from_slice(bounced);
            }
            Ok(())
        } else {
            self.read_fully(buf, offset)
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.admission().write(offset, buf.len(), mode)?;
        let flags = match mode {
            WriteMode::Fua => libc::RWF_DSYNC,
            WriteMode::Normal => 0,
        };
        if self.needs_bounce(buf.as_ptr(), buf.len()) {
            let piece = buf.len().min(BOUNCE_PIECE_BYTES);
            let mut bounce = self.bounce_buf(IoOp::Write, offset, piece)?;
            for (at, part) in (offset..).step_by(piece).zip(buf.chunks(piece)) {
                let bounced = &mut bounce[..part.len()];
                bounced.copy_from_slice(part);
                self.write_fully(bounced, at, flags)?;
            }
            Ok(())
        } else {
            self.write_fully(buf, offset, flags)
        }
    }

    /// `fdatasync`. After a failed flush the kernel may already have dropped
    /// the dirty state, so retrying and getting `Ok` does not mean the data
    /// is durable: callers must treat the failure as data loss.
    fn flush(&self) -> Result<(), DeviceError> {
        self.admission().flush();
        // std retries fdatasync on EINTR.
        self.file
            .sync_data()
            .map_err(|source| DeviceError::Flush { source })
    }

    fn request_slots(&self) -> Option<usize> {
        self.request_slots
    }

    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    fn backend_name(&self) -> &'static str {
        "sync"
    }
}

fn kind_of(path: &Path, ft: &std::fs::FileType) -> Result<DeviceKind, DeviceError> {
    if ft.is_block_device() {
        Ok(DeviceKind::BlockDevice)
    } else if ft.is_file() {
        Ok(DeviceKind::ImageFile)
    } else {
        Err(DeviceError::Unusable {
            path: path.to_owned(),
            reason: "not a block device or regular file".into(),
        })
    }
}

/// Opens with `O_DIRECT`, falling back to buffered I/O when the file system
/// refuses it (`EINVAL`, e.g. ramfs, or tmpfs before Linux 6.6). Returns
/// whether direct I/O is on.
fn open_fd(path: &Path, read_only: bool, exclusive: bool) -> Result<(File, bool), DeviceError> {
    let open = || match open_with(path, read_only, exclusive, true) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            open_with(path, read_only, exclusive, false).map(|file| (file, false))
        }
        Err(e) => Err(e),
    };
    let result = if exclusive {
        retry_while_busy(open, &BUSY_BACKOFF, std::thread::sleep)
    } else {
        open()
    };
    result.map_err(|source| {
        if exclusive && source.raw_os_error() == Some(libc::EBUSY) {
            DeviceError::Busy {
                path: path.to_owned(),
                source,
            }
        } else {
            DeviceError::Open {
                path: path.to_owned(),
                source,
            }
        }
    })
}

/// How long an exclusive open waits out `EBUSY`: the pauses between
/// tries, about 0.25 s in all.
const BUSY_BACKOFF: [Duration; 8] = [
    Duration::from_millis(1),
    Duration::from_millis(2),
    Duration::from_millis(4),
    Duration::from_millis(8),
    Duration::from_millis(16),
    Duration::from_millis(32),
    Duration::from_millis(64),
    Duration::from_millis(128),
];

/// Runs `open` until it succeeds or fails with something other than
/// `EBUSY`, pausing (`pause`) for each of `backoff` in turn; the last
/// `EBUSY` is returned once they are spent.
///
/// A device this process has just closed can still look claimed for a
/// moment: a child that another thread of the process is starting holds a
/// copy of every descriptor between its fork and its exec (`O_CLOEXEC`
/// closes them only at the exec), and the claim goes with the last copy.
/// Likewise a request the kernel finished in one of io_uring's workers
/// can keep the file for a moment after its ring is gone.
/// With one thread starting processes beside another that closed and
/// reopened a loop device 20,000 times, 73% of the reopens failed with
/// `EBUSY`; CI saw it once (a test reopening a device while the tests
/// beside it ran `losetup`). A device another program holds is still
/// refused, a quarter of a second later.
fn retry_while_busy<T>(
    mut open: impl FnMut() -> io::Result<T>,
    backoff: &[Duration],
    mut pause: impl FnMut(Duration),
) -> io::Result<T> {
    let mut pauses = backoff.iter();
    loop {
        match open() {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => match pauses.next() {
                Some(&p) => pause(p),
                None => return Err(e),
            },
            done => return done,
        }
    }
}

fn open_with(path: &Path, read_only: bool, exclusive: bool, direct: bool) -> io::Result<File> {
    // std sets O_CLOEXEC on every open already; it is spelled out so that a
    // reader of this function sees the descriptor never leaks into children.
    let mut flags = libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    if exclusive {
        // Without O_CREAT, O_EXCL on a block device claims it exclusively
        // (Linux ≥ 2.6): EBUSY if mounted or claimed by someone else.
        flags |= libc::O_EXCL;
    }
    OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(flags)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemDevice;
    use crate::test_support::{run, skip_privileged, sysfs_queue, Loop};
    use std::io::Write;

    /// A temp image of `size` bytes filled with a marker, in the default temp
    /// dir (which may be tmpfs or even ramfs: the tests must pass either way).
    fn image(size: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![0xa5u8; size]).unwrap();
        f.flush().unwrap();
        f
    }

    fn open_rw(f: &tempfile::NamedTempFile) -> SyncDevice {
        SyncDevice::open(f.path(), SyncOpenOptions::default()).unwrap()
    }

    fn pattern(len: usize, seed: u8) -> AlignedBuf {
        let mut buf = AlignedBuf::new(len, 4096).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        buf
    }

    #[test]
    fn image_caps_are_probed_and_sane() {
        let f = image(1 << 20);
        let dev = open_rw(&f);
        let caps = dev.caps();
        assert_eq!(caps.kind, DeviceKind::ImageFile);
        assert!(caps.logical_block_size.is_power_of_two());
        assert!(caps.memory_alignment.is_power_of_two());
        assert_eq!(caps.size_bytes % u64::from(caps.logical_block_size), 0);
        assert_eq!(caps.size_bytes, 1 << 20);
        assert!(caps.volatile_write_cache, "image files are assumed cached");
        assert!(!caps.fua);
        eprintln!("probed {caps:?}");
    }

    #[test]
    fn write_read_round_trip_including_fua_and_flush() {
        let f = image(1 << 20);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        let data = pattern(4 * lbs, 1);
        dev.write_at(&data, 2 * lbs as u64, WriteMode::Normal)
            .unwrap();
        let fua = pattern(lbs, 2);
        dev.write_at(&fua, 10 * lbs as u64, WriteMode::Fua).unwrap();
        dev.flush().unwrap();

        let mut back = AlignedBuf::new(4 * lbs, 4096).unwrap();
        dev.read_at(&mut back, 2 * lbs as u64).unwrap();
        assert_eq!(&back[..], &data[..]);
        let mut back = AlignedBuf::new(lbs, 4096).unwrap();
        dev.read_at(&mut back, 10 * lbs as u64).unwrap();
        assert_eq!(&back[..], &fua[..]);
        // Untouched blocks keep the marker the image was created with.
        dev.read_at(&mut back, 0).unwrap();
        assert!(back.iter().all(|&b| b == 0xa5));

        // The bytes really reached the file, through a second handle.
        drop(dev);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert_eq!(&on_disk[2 * lbs..6 * lbs], &data[..]);
        assert_eq!(&on_disk[10 * lbs..11 * lbs], &fua[..]);
    }

    #[test]
    fn unaligned_and_out_of_range_requests_are_rejected_uncounted() {
        let f = image(64 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        let size = dev.caps().size_bytes;
        let mut buf = AlignedBuf::new(2 * lbs, 4096).unwrap();
        assert!(matches!(
            dev.read_at(&mut buf, 1),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.read_at(&mut buf[..lbs - 1], 0),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.write_at(&buf[..lbs + 1], 0, WriteMode::Normal),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.read_at(&mut buf, size - lbs as u64),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            dev.write_at(&buf, u64::MAX - lbs as u64 + 1, WriteMode::Fua),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert_eq!(dev.counters().snapshot(), Default::default());
        // The last block itself is fine.
        dev.read_at(&mut buf[..lbs], size - lbs as u64).unwrap();
    }

    #[test]
    fn misaligned_buffers_bounce_and_still_round_trip() {
        let f = image(256 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        let src = pattern(3 * lbs + 1, 7);
        // One byte into a 4096-aligned buffer: misaligned for any alignment
        // above 1.
        let misaligned = &src[1..];
        dev.write_at(misaligned, lbs as u64, WriteMode::Normal)
            .unwrap();
        let mut dst = AlignedBuf::new(3 * lbs + 1, 4096).unwrap();
        dev.read_at(&mut dst[1..], lbs as u64).unwrap();
        assert_eq!(&dst[1..], misaligned);

        let bounces_expected = dev.caps().direct_io && dev.caps().memory_alignment > 1;
        assert_eq!(dev.bounced_requests(), if bounces_expected { 2 } else { 0 });

        // Aligned buffers never bounce.
        let aligned = pattern(lbs, 9);
        dev.write_at(&aligned, 0, WriteMode::Normal).unwrap();
        assert_eq!(dev.bounced_requests(), if bounces_expected { 2 } else { 0 });
    }

    /// A misaligned request larger than the bounce buffer goes through it
    /// in pieces, each to its own place, and counts as one bounced request.
    #[test]
    fn a_large_misaligned_request_bounces_in_pieces() {
        let f = image(256 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        let len = 5 * BOUNCE_PIECE_BYTES / 2 + lbs;
        let src = pattern(len + 1, 3);
        dev.write_at(&src[1..], lbs as u64, WriteMode::Normal)
            .unwrap();
        let mut dst = AlignedBuf::new(len + 1, 4096).unwrap();
        dev.read_at(&mut dst[1..], lbs as u64).unwrap();
        assert_eq!(&dst[1..], &src[1..]);
        drop(dev);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert_eq!(&on_disk[lbs..lbs + len], &src[1..]);
        assert!(on_disk[..lbs].iter().all(|&b| b == 0xa5));
        assert!(on_disk[lbs + len..].iter().all(|&b| b == 0xa5));
    }

    #[test]
    fn counters_count_every_request_by_kind() {
        let f = image(64 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        let mut buf = AlignedBuf::new(2 * lbs, 4096).unwrap();
        dev.write_at(&buf, 0, WriteMode::Normal).unwrap();
        dev.write_at(&buf[..lbs], 0, WriteMode::Fua).unwrap();
        dev.read_at(&mut buf, 0).unwrap();
        dev.flush().unwrap();
        dev.flush().unwrap();
        let c = dev.counters().snapshot();
        assert_eq!(
            (c.reads, c.writes, c.fua_writes, c.flushes),
            (1, 2, 1, 2),
            "{c:?}"
        );
        assert_eq!(c.bytes_written, 3 * lbs as u64);
        assert_eq!(c.bytes_read, 2 * lbs as u64);
    }

    #[test]
    fn read_only_handles_refuse_writes() {
        let f = image(64 * 1024);
        let dev = SyncDevice::open(f.path(), SyncOpenOptions { read_only: true }).unwrap();
        let lbs = dev.caps().logical_block_size as usize;
        let mut buf = AlignedBuf::new(lbs, 4096).unwrap();
        dev.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0xa5));
        let err = dev.write_at(&buf, 0, WriteMode::Normal).unwrap_err();
        assert!(matches!(err, DeviceError::ReadOnly { .. }), "{err}");
        assert_eq!(err.errno(), libc::EROFS);
    }

    #[test]
    fn unusable_things_are_refused_with_typed_errors() {
        let empty = tempfile::NamedTempFile::new().unwrap();
        let err = SyncDevice::open(empty.path(), SyncOpenOptions::default()).unwrap_err();
        assert!(matches!(err, DeviceError::Unusable { .. }), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let err = SyncDevice::open(dir.path(), SyncOpenOptions::default()).unwrap_err();
        assert!(matches!(err, DeviceError::Unusable { .. }), "{err}");

        let missing = dir.path().join("nope");
        let err = SyncDevice::open(&missing, SyncOpenOptions::default()).unwrap_err();
        assert!(matches!(err, DeviceError::Open { .. }), "{err}");
        assert_eq!(err.errno(), libc::ENOENT);
    }

    #[test]
    fn image_shrinking_under_us_is_a_short_read_not_a_hang() {
        let f = image(64 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size as usize;
        f.as_file().set_len(0).unwrap();
        let mut buf = AlignedBuf::new(lbs, 4096).unwrap();
        let err = dev.read_at(&mut buf, 0).unwrap_err();
        assert!(matches!(err, DeviceError::Short { done: 0, .. }), "{err}");
    }

    /// Same requests against a `SyncDevice` and a `MemDevice` of the same
    /// geometry give the same bytes: the memory backend is a faithful
    /// stand-in in tests.
    #[test]
    fn agrees_with_the_memory_backend() {
        let f = image(128 * 1024);
        let dev = open_rw(&f);
        let lbs = dev.caps().logical_block_size;
        let mem = MemDevice::new(dev.caps().size_bytes, lbs);
        mem.fill(&[0xa5]);
        let lbs = lbs as usize;
        for (i, blocks) in [(0usize, 1usize), (3, 2), (1, 4), (7, 1)] {
            let data = pattern(blocks * lbs, i as u8);
            let off = (i * lbs) as u64;
            dev.write_at(&data, off, WriteMode::Normal).unwrap();
            mem.write_at(&data, off, WriteMode::Normal).unwrap();
        }
        let mut a = AlignedBuf::new(dev.caps().size_bytes as usize, 4096).unwrap();
        dev.read_at(&mut a, 0).unwrap();
        assert_eq!(&a[..], &mem.snapshot()[..]);
    }

    /// A partition node for `loop_dev`'s first partition: the kernel's
    /// `/dev` node if devtmpfs made one, else one we make in `dir`.
    fn partition_node(loop_dev: &Path, dir: &Path) -> Option<PathBuf> {
        let name = loop_dev.file_name()?.to_string_lossy().into_owned();
        let dev = std::fs::read_to_string(format!("/sys/block/{name}/{name}p1/dev")).ok()?;
        let node = PathBuf::from(format!("/dev/{name}p1"));
        if node.exists() {
            return Some(node);
        }
        let (major, minor) = dev.trim().split_once(':')?;
        let node = dir.join("part1");
        let cpath = std::ffi::CString::new(node.to_str()?).ok()?;
        // SAFETY: `cpath` is a valid NUL-terminated path that outlives the
        // call; mknod reads nothing else from our memory.
        let rc = unsafe {
            libc::mknod(
                cpath.as_ptr(),
                libc::S_IFBLK | 0o600,
                libc::makedev(major.parse().ok()?, minor.parse().ok()?),
            )
        };
        (rc == 0).then_some(node)
    }

    #[test]
    fn busy_opens_are_tried_again_through_the_backoff_then_reported() {
        let busy = || io::Error::from_raw_os_error(libc::EBUSY);
        let backoff = [1, 2, 4].map(Duration::from_millis);
        // Busy twice, then free: opened after the first two pauses.
        let mut tries = 0;
        let mut paused = Vec::new();
        let got = retry_while_busy(
            || {
                tries += 1;
                if tries <= 2 {
                    Err(busy())
                } else {
                    Ok(tries)
                }
            },
            &backoff,
            |d| paused.push(d),
        );
        assert_eq!(got.unwrap(), 3);
        assert_eq!(paused, backoff[..2]);
        // Busy throughout: every pause, then the last EBUSY.
        paused.clear();
        let got: io::Result<()> = retry_while_busy(|| Err(busy()), &backoff, |d| paused.push(d));
        assert_eq!(got.unwrap_err().raw_os_error(), Some(libc::EBUSY));
        assert_eq!(paused, backoff);
        // Another error at once, without a pause.
        paused.clear();
        let got: io::Result<()> = retry_while_busy(
            || Err(io::Error::from_raw_os_error(libc::ENOENT)),
            &backoff,
            |d| paused.push(d),
        );
        assert_eq!(got.unwrap_err().raw_os_error(), Some(libc::ENOENT));
        assert!(paused.is_empty());
    }

    /// A thread starting processes (each child holds a copy of every open
    /// descriptor until its exec) beside reopens of a device just closed:
    /// every reopen gets the device (73% failed with `EBUSY` without the
    /// retry).
    #[test]
    fn a_device_closed_while_another_thread_starts_processes_reopens() {
        let _serial = crate::test_support::serial();
        let Some((_image, lo)) = crate::test_support::attach_loop(4 << 20) else {
            return;
        };
        /// Stops the spawning thread however the reopens end (a failed
        /// one panics, and the scope then waits for the thread).
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let spawned = std::sync::atomic::AtomicUsize::new(0);
        let (during, total) = std::thread::scope(|s| {
            let spawner = s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::process::Command::new("true").status().unwrap();
                    spawned.fetch_add(1, Ordering::Relaxed);
                }
            });
            let _stop = StopOnDrop(&stop);
            // The spawner is going (a loaded machine may take a while to
            // start it) before the reopens begin.
            while spawned.load(Ordering::Relaxed) == 0 && !spawner.is_finished() {
                std::thread::yield_now();
            }
            let before = spawned.load(Ordering::Relaxed);
            for reopened in 0..300 {
                let dev = SyncDevice::open(&lo.dev, SyncOpenOptions::default())
                    .unwrap_or_else(|e| panic!("reopen {reopened}: {e}"));
                drop(dev);
            }
            let during = spawned.load(Ordering::Relaxed) - before;
            drop(_stop);
            spawner.join().unwrap();
            (during, spawned.load(Ordering::Relaxed))
        });
        assert!(total > 0, "no process was started");
        eprintln!("{during} processes started during the reopens, {total} in all");
    }

    /// Needs root and `losetup`: attaches a loop device over a temp image
    /// (with 512- and 4096-byte sectors) and checks the block-device probe
    /// against sysfs, the exclusive open, a partition's capabilities coming
    /// from its parent disk, and a write/read round trip.
    #[test]
    fn loop_device_probe_exclusive_open_and_round_trip() {
        let _serial = crate::test_support::serial();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return skip_privileged("not root");
        }
        if let Err(e) = run("losetup", &["--version"]) {
            return skip_privileged(&e);
        }
        for sector in [512u32, 4096] {
            let dir = tempfile::tempdir().unwrap();
            let img = dir.path().join("disk.img");
            let size = 8u64 << 20;
            let mut bytes = vec![0x5au8; size as usize];
            // An MBR with one Linux partition at 1 MiB, 4 MiB long; its
            // fields count logical sectors.
            let (first, count) = ((1u32 << 20) / sector, (4u32 << 20) / sector);
            bytes[446..510].fill(0); // four entries; the other three unused
            let entry = &mut bytes[446..462];
            entry[4] = 0x83;
            entry[8..12].copy_from_slice(&first.to_le_bytes());
            entry[12..16].copy_from_slice(&count.to_le_bytes());
            bytes[510] = 0x55;
            bytes[511] = 0xaa;
            std::fs::write(&img, &bytes).unwrap();

            let attached = match run(
                "losetup",
                &[
                    "--find",
                    "--show",
                    "--sector-size",
                    &sector.to_string(),
                    img.to_str().unwrap(),
                ],
            ) {
                Ok(dev) => {
                    let dev = PathBuf::from(dev);
                    let write_cache = sysfs_queue(&dev, "write_cache");
                    Loop { dev, write_cache }
                }
                Err(e) => return skip_privileged(&e),
            };
            let path = attached.dev.as_path();

            let dev = SyncDevice::open(path, SyncOpenOptions::default()).unwrap();
            let caps = dev.caps().clone();
            eprintln!("probed {caps:?}");
            assert_eq!(caps.kind, DeviceKind::BlockDevice);
            assert!(caps.direct_io);
            assert_eq!(caps.logical_block_size, sector);
            assert_eq!(caps.size_bytes, size);
            assert!(caps.memory_alignment.is_power_of_two());
            assert_eq!(
                caps.volatile_write_cache,
                sysfs_queue(path, "write_cache") == "write back"
            );
            assert_eq!(caps.fua, sysfs_queue(path, "fua") == "1");

            // A second exclusive open, even read-only, is refused.
            let err = SyncDevice::open(path, SyncOpenOptions { read_only: true }).unwrap_err();
            assert!(matches!(err, DeviceError::Busy { .. }), "{err}");
            assert_eq!(err.errno(), libc::EBUSY);

            // Round trip at the last blocks, FUA and not, through a
            // misaligned buffer too.
            let lbs = sector as usize;
            let data = pattern(2 * lbs + 1, 3);
            let last = size - 2 * lbs as u64;
            dev.write_at(&data[1..], last, WriteMode::Fua).unwrap();
            // Block 1, not 0: block 0 holds the partition table.
            dev.write_at(&data[..lbs], lbs as u64, WriteMode::Normal)
                .unwrap();
            dev.flush().unwrap();
            let mut back = AlignedBuf::new(2 * lbs, 4096).unwrap();
            dev.read_at(&mut back, last).unwrap();
            assert_eq!(&back[..], &data[1..]);
            let c = dev.counters().snapshot();
            assert_eq!((c.writes, c.fua_writes, c.flushes, c.reads), (2, 1, 1, 1));
            drop(dev);
            let on_disk = std::fs::read(&img).unwrap();
            assert_eq!(&on_disk[last as usize..], &data[1..]);

            // Make the cache report "write through" so the probe's answer
            // differs from its conservative default, then check a partition
            // inherits its parent's queue settings.
            attached.set_write_cache("write through");
            let dev = SyncDevice::open(path, SyncOpenOptions { read_only: true }).unwrap();
            assert!(!dev.caps().volatile_write_cache);
            drop(dev);
            if let Err(e) = run("partx", &["-a", path.to_str().unwrap()]) {
                skip_privileged(&format!("partition probe: {e}"));
                continue;
            }
            let Some(part) = partition_node(path, dir.path()) else {
                skip_privileged("partition probe: no node for the partition");
                continue;
            };
            let pdev = SyncDevice::open(&part, SyncOpenOptions { read_only: true }).unwrap();
            let pcaps = pdev.caps();
            eprintln!("partition {pcaps:?}");
            assert_eq!(pcaps.logical_block_size, sector);
            assert_eq!(pcaps.size_bytes, 4 << 20);
            assert!(!pcaps.volatile_write_cache, "taken from the parent's queue");
            assert_eq!(pcaps.fua, sysfs_queue(path, "fua") == "1");
        }
    }
}
