//! What a workload runs against: the raw device, or a file on iomapfs.
//!
//! Both are [`Target`]s with the same `read_at`/`write_at` of aligned
//! buffers, driven by the same engine with the same offsets, so the ratio
//! between them is the file system's own cost. Kernel file systems are run
//! by fio instead (see `kernel`).
//!
//! Device handles are opened through [`open_device`], the one place that
//! picks a backend.

use std::path::Path;
use std::sync::Arc;

use blockdev::{
    AlignedBuf, BackendChoice, BlockDevice, DeviceCompletion, DeviceQueue, DeviceRequest,
    RequestCounts, WriteMode,
};
use iomapfs_fs::aio::{Completion, IoQueue};
use iomapfs_fs::{FiemapKind, File, FormatOptions, MountOptions, OpenFlags, Volume};

use crate::interrupt::stop_requested;
use crate::workload::{IoPattern, Op, Rng};
use crate::{Backend, BenchError};

/// Size of each prefill write.
const PREFILL_CHUNK: u64 = 1 << 20;
/// Seed of the data written before measuring; the same on every target.
const PREFILL_SEED: u64 = 0x1f0_3a9f;
/// The benchmark file on an iomapfs volume.
pub const IOMAPFS_FILE: &str = "/bench.dat";
/// File-system block size iomapfs is formatted with (the seeds' 4 KiB).
pub const IOMAPFS_BLOCK_SIZE: u32 = 4096;

/// Something the engine can do direct I/O on. Offsets and lengths are
/// multiples of the device's logical block size; buffers are aligned to
/// [`Target::memory_alignment`].
///
/// Two ways to drive it, picked by the engine from the backend: N threads
/// calling `read_at`/`write_at` (sync backend), or one thread keeping N
/// requests in flight in a [`TargetQueue`] (io_uring backend).
pub trait Target: Send + Sync {
    /// A queue holding up to `depth` requests in flight, for one thread.
    fn queue(&self, depth: usize) -> Result<Box<dyn TargetQueue + '_>, BenchError>;
    /// Alignment the engine gives its buffers.
    fn memory_alignment(&self) -> usize;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BenchError>;
    /// Writes `buf` at `offset`, durably before returning if the workload is
    /// DSYNC.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BenchError>;
    /// Device requests issued so far, when the target can see them.
    fn requests(&self) -> Option<RequestCounts>;
}

/// Opens the device at `path` with `backend` (Auto resolved by probing);
/// returns the handle and which backend was chosen, and why. The one place
/// a backend is chosen.
pub fn open_device(
    path: &Path,
    backend: Backend,
) -> Result<(Arc<dyn BlockDevice>, BackendChoice), BenchError> {
    blockdev::open_device(path, false, backend)
        .map_err(|e| BenchError::device(format!("open {}", path.display()), e))
}

/// Writes the prefill pattern over `[0, span)` with `write`, in
/// [`PREFILL_CHUNK`] pieces; chunk `i` has the same bytes on every target.
fn prefill(
    span: u64,
    align: usize,
    mut write: impl FnMut(&[u8], u64) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let mut buf = AlignedBuf::new(PREFILL_CHUNK as usize, align)
        .map_err(|e| BenchError::setup("prefill buffer", e.to_string()))?;
    let mut offset = 0;
    while offset < span {
        if stop_requested() {
            return Err(BenchError::Interrupted);
        }
        let len = PREFILL_CHUNK.min(span - offset) as usize;
        Rng::new(PREFILL_SEED ^ (offset / PREFILL_CHUNK)).fill(&mut buf[..len]);
        write(&buf[..len], offset)?;
        offset += len as u64;
    }
    Ok(())
}

/// Buffer alignment for a device: what it requires, and at least a page so
/// no backend ever bounces.
pub fn alignment_of(dev: &dyn BlockDevice) -> usize {
    (dev.caps().memory_alignment as usize).max(4096)
}

/// A finished queued request.
pub struct Done {
    pub token: u64,
    pub buf: AlignedBuf,
    pub result: Result<(), BenchError>,
}

/// One thread's asynchronous view of a [`Target`]: owned buffers in, the
/// same buffers back with each completion.
pub trait TargetQueue {
    /// Queues one request of `buf.len()` bytes at `offset`.
    fn push(&mut self, op: Op, token: u64, offset: u64, buf: AlignedBuf) -> Result<(), BenchError>;
    /// Sends what was pushed, then waits for at least `min` completions
    /// and appends every available one to `out`.
    fn submit_and_reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), BenchError>;
}

/// A [`DeviceQueue`] on the raw device.
struct RawQueue {
    queue: Box<dyn DeviceQueue>,
    write_mode: WriteMode,
    scratch: Vec<DeviceCompletion>,
}

impl TargetQueue for RawQueue {
    fn push(&mut self, op: Op, token: u64, offset: u64, buf: AlignedBuf) -> Result<(), BenchError> {
        let request = match op {
            Op::Read => DeviceRequest::Read { offset, buf },
            Op::Write => DeviceRequest::Write {
                offset,
                buf,
                mode: self.write_mode,
            },
        };
        self.queue.push(token, request).map_err(|full| {
            BenchError::failed(
                "raw queue",
                format!(
                    "full at depth {} (the engine keeps at most that many in flight)",
                    full.depth
                ),
            )
        })
    }

    fn submit_and_reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), BenchError> {
        self.queue
            .submit_and_reap(min, &mut self.scratch)
            .map_err(|e| BenchError::device("raw queue", e))?;
        for c in self.scratch.drain(..) {
            let Some(buf) = c.buf else {
                return Err(BenchError::failed(
                    "raw queue",
                    "a completion without its buffer",
                ));
            };
            let result = match c.result {
                Ok(n) if n == buf.len() => Ok(()),
                Ok(n) => Err(BenchError::failed(
                    "raw queue",
                    format!("short transfer: {n} of {} bytes", buf.len()),
                )),
                Err(e) => Err(BenchError::device("raw queued I/O", e)),
            };
            out.push(Done {
                token: c.token,
                buf,
                result,
            });
        }
        Ok(())
    }
}

/// An iomapfs [`IoQueue`] on the benchmark file.
struct IomapfsQueue<'a> {
    queue: IoQueue,
    file: &'a File,
    scratch: Vec<Completion>,
}

impl TargetQueue for IomapfsQueue<'_> {
    fn push(&mut self, op: Op, token: u64, offset: u64, buf: AlignedBuf) -> Result<(), BenchError> {
        let pushed = match op {
            Op::Read => self.queue.submit_read(self.file, offset, buf, token),
            Op::Write => self.queue.submit_write(self.file, offset, buf, token),
        };
        pushed.map_err(|refused| BenchError::fs("iomapfs queue", refused.1))
    }

    fn submit_and_reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), BenchError> {
        // `reap` sends queued requests in the kernel entry that waits, as
        // the raw target's `submit_and_reap` does.
        self.queue
            .reap(min, &mut self.scratch)
            .map_err(|e| BenchError::fs("iomapfs queue reap", e))?;
        for c in self.scratch.drain(..) {
            let result = match c.result {
                Ok(n) if n == c.buf.len() => Ok(()),
                Ok(n) => Err(BenchError::failed(
                    "iomapfs queue",
                    format!("short transfer: {n} of {} bytes", c.buf.len()),
                )),
                Err(e) => Err(BenchError::fs("iomapfs queued I/O", e)),
            };
            out.push(Done {
                token: c.token,
                buf: c.buf,
                result,
            });
        }
        Ok(())
    }
}

/// The device itself, over `[0, span)`.
pub struct RawTarget {
    dev: Arc<dyn BlockDevice>,
    write_mode: WriteMode,
}

impl RawTarget {
    /// Writes the span with the prefill pattern (so reads hit written data,
    /// as on iomapfs) and returns the target. DSYNC workloads write with
    /// FUA, which is what an `O_DSYNC` write to a block device is.
    pub fn prepare(
        dev: Arc<dyn BlockDevice>,
        pattern: &IoPattern,
        span: u64,
    ) -> Result<RawTarget, BenchError> {
        let align = alignment_of(&*dev);
        prefill(span, align, |buf, offset| {
            dev.write_at(buf, offset, WriteMode::Normal)
                .map_err(|e| BenchError::device("raw prefill", e))
        })?;
        dev.flush()
            .map_err(|e| BenchError::device("raw prefill: flush", e))?;
        let write_mode = if pattern.dsync {
            WriteMode::Fua
        } else {
            WriteMode::Normal
        };
        Ok(RawTarget { dev, write_mode })
    }
}

impl Target for RawTarget {
    fn queue(&self, depth: usize) -> Result<Box<dyn TargetQueue + '_>, BenchError> {
        let queue = blockdev::new_queue(&self.dev, depth)
            .map_err(|e| BenchError::device("raw queue", e))?;
        Ok(Box::new(RawQueue {
            queue,
            write_mode: self.write_mode,
            scratch: Vec::with_capacity(depth),
        }))
    }

    fn memory_alignment(&self) -> usize {
        alignment_of(&*self.dev)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        self.dev
            .read_at(buf, offset)
            .map_err(|e| BenchError::device("raw read", e))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BenchError> {
        self.dev
            .write_at(buf, offset, self.write_mode)
            .map_err(|e| BenchError::device("raw write", e))
    }

    fn requests(&self) -> Option<RequestCounts> {
        Some(self.dev.counters().snapshot())
    }
}

/// Formats `dev` with the benchmark's block size and mounts it with the
/// default mount options (cache included).
pub fn format_and_mount(dev: Arc<dyn BlockDevice>) -> Result<Volume, BenchError> {
    let opts = FormatOptions {
        block_size: IOMAPFS_BLOCK_SIZE.max(dev.caps().logical_block_size),
        extent_pages: EXTENT_PAGES
            .get()
            .copied()
            .unwrap_or(FormatOptions::default().extent_pages),
        page_index: PAGE_INDEX
            .get()
            .copied()
            .unwrap_or(FormatOptions::default().page_index),
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).map_err(|e| BenchError::fs("iomapfs format", e))?;
    mount(dev)
}

/// Whether iomapfs targets of this run are formatted with extent pages
/// (the default; `--no-extent-pages` turns it off), set once by
/// [`crate::run`].
static EXTENT_PAGES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Records whether every later [`format_and_mount`] uses extent pages.
pub fn set_extent_pages(on: bool) {
    let _ = EXTENT_PAGES.set(on);
}

/// Whether iomapfs targets with extent pages list them in index pages
/// (the default; `--no-page-index` turns it off), set once by
/// [`crate::run`].
static PAGE_INDEX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Records whether every later [`format_and_mount`] lists extent pages in
/// index pages.
pub fn set_page_index(on: bool) {
    let _ = PAGE_INDEX.set(on);
}

/// The mount options of every iomapfs target in this run (the cache size
/// from `--cache-size`), set once by [`crate::run`].
static MOUNT_OPTIONS: std::sync::OnceLock<MountOptions> = std::sync::OnceLock::new();

/// Records the run's mount options for every later [`mount`].
pub fn set_mount_options(opts: MountOptions) {
    let _ = MOUNT_OPTIONS.set(opts);
}

/// Mounts the volume on `dev` (again, for a cold cache) with the run's
/// mount options.
pub fn mount(dev: Arc<dyn BlockDevice>) -> Result<Volume, BenchError> {
    let opts = MOUNT_OPTIONS.get().cloned().unwrap_or_default();
    Volume::open_with(dev, &opts).map_err(|e| BenchError::fs("iomapfs mount", e))
}

/// Creates [`IOMAPFS_FILE`] of `span` bytes with `fallocate`, writes all of
/// it with the prefill pattern through a direct handle, commits,
/// checkpoints, and checks that the whole file is written data (Mapped), so
/// reads and overwrites take the steady-state paths, not first-write
/// conversion. The handle is closed again.
pub fn write_bench_file(vol: &Volume, span: u64) -> Result<(), BenchError> {
    let align = alignment_of(&**vol.device());
    let setup = OpenFlags {
        create: true,
        truncate: true,
        direct: true,
        ..OpenFlags::default()
    };
    let file = vol
        .open_file(IOMAPFS_FILE, setup)
        .map_err(|e| BenchError::fs("iomapfs create", e))?;
    file.fallocate(0, span, false)
        .map_err(|e| BenchError::fs("iomapfs fallocate", e))?;
    prefill(span, align, |buf, offset| {
        file.pwrite(buf, offset)
            .map(drop)
            .map_err(|e| BenchError::fs("iomapfs prefill", e))
    })?;
    file.fdatasync()
        .map_err(|e| BenchError::fs("iomapfs prefill: fdatasync", e))?;
    vol.checkpoint()
        .map_err(|e| BenchError::fs("iomapfs checkpoint", e))?;
    let map = file
        .fiemap()
        .map_err(|e| BenchError::fs("iomapfs fiemap", e))?;
    let data: u64 = map
        .iter()
        .filter(|e| e.kind == FiemapKind::Data)
        .map(|e| e.length)
        .sum();
    if data < span {
        return Err(BenchError::failed(
            "iomapfs prefill",
            format!("only {data} of {span} bytes of {IOMAPFS_FILE} are written data: {map:?}"),
        ));
    }
    Ok(())
}

/// One preallocated, fully written file on a freshly formatted iomapfs
/// volume, opened `O_DIRECT` (and `O_DSYNC` for DSYNC workloads).
pub struct IomapfsTarget {
    // Field order is drop order: the file handle goes before the volume.
    file: File,
    vol: Volume,
    align: usize,
}

impl IomapfsTarget {
    /// Formats `dev`, writes [`IOMAPFS_FILE`] of `span` bytes (see
    /// [`write_bench_file`]) and opens it `O_DIRECT` (and `O_DSYNC` for
    /// DSYNC workloads).
    pub fn prepare(
        dev: Arc<dyn BlockDevice>,
        pattern: &IoPattern,
        span: u64,
    ) -> Result<IomapfsTarget, BenchError> {
        let align = alignment_of(&*dev);
        let vol = format_and_mount(dev)?;
        write_bench_file(&vol, span)?;
        let flags = OpenFlags {
            direct: true,
            dsync: pattern.dsync,
            ..OpenFlags::default()
        };
        let file = vol
            .open_file(IOMAPFS_FILE, flags)
            .map_err(|e| BenchError::fs("iomapfs open", e))?;
        Ok(IomapfsTarget { file, vol, align })
    }

    /// Closes the file and unmounts cleanly (checkpoint).
    pub fn close(self) -> Result<(), BenchError> {
        let IomapfsTarget { file, vol, .. } = self;
        drop(file);
        vol.unmount()
            .map_err(|e| BenchError::fs("iomapfs unmount", e))
    }
}

impl Target for IomapfsTarget {
    fn queue(&self, depth: usize) -> Result<Box<dyn TargetQueue + '_>, BenchError> {
        let queue = self
            .vol
            .io_queue(depth)
            .map_err(|e| BenchError::fs("iomapfs io_queue", e))?;
        Ok(Box::new(IomapfsQueue {
            queue,
            file: &self.file,
            scratch: Vec::with_capacity(depth),
        }))
    }

    fn memory_alignment(&self) -> usize {
        self.align
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        match self.file.pread(buf, offset) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(n) => Err(BenchError::failed(
                "iomapfs read",
                format!("short read: {n} of {} bytes at {offset}", buf.len()),
            )),
            Err(e) => Err(BenchError::fs("iomapfs read", e)),
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BenchError> {
        self.file
            .pwrite(buf, offset)
            .map(drop)
            .map_err(|e| BenchError::fs("iomapfs write", e))
    }

    fn requests(&self) -> Option<RequestCounts> {
        Some(self.vol.device().counters().snapshot())
    }
}
