//! Block devices for iomapfs.
//!
//! This crate is the only place that performs data I/O system calls. It knows
//! nothing of files: it reads and writes byte ranges aligned to the device's
//! logical block size, flushes the volatile write cache, and reports what the
//! device can do ([`DeviceCaps`]).
//!
//! Backends:
//! - [`sync_backend::SyncDevice`]: an `O_DIRECT` descriptor on a block device or
//!   image file, driven by `pread`/`pwritev2`.
//! - [`uring::UringDevice`]: the same descriptor driven through io_uring by
//!   per-thread [`DeviceQueue`]s (one ring each, batched submission).
//! - [`pool_backend::PoolDevice`]: the synchronous calls of a device, with
//!   queues ([`PoolQueue`]) whose requests run on a bounded pool of worker
//!   threads: for devices that refuse NOWAIT and do each request's work in
//!   the submitting thread (zram), where io_uring would hand every request
//!   to a kernel worker and an [`InlineQueue`] keeps one core busy.
//! - [`memory::MemDevice`]: RAM-backed, for tests. Counts requests, injects
//!   errors, simulates power cuts, and on request completes queued requests
//!   out of order ([`OutOfOrderQueue`]).
//! - [`log_writes::LogWritesDevice`]: a wrapper recording every write, flush
//!   and mark to a log file, for replay at any point (dm-log-writes).
//!
//! [`backend::open_device`] opens a path with the backend the caller asked for,
//! or, for [`Backend::Auto`], the one probing says is faster, and says why.
//! Asynchronous I/O goes through [`new_queue`], which works on every device.

pub mod aligned_buf;
pub mod backend;
pub mod caps;
pub mod counters;
pub mod error;
pub mod log_writes;
pub mod memory;
pub mod pool_backend;
mod probe;
pub mod queue;
mod request;
pub mod rng;
pub mod sync_backend;
#[cfg(test)]
mod test_support;
pub mod uring;

pub use aligned_buf::{page_size, AlignedBuf, AlignedBufError, HUGE_PAGE_BYTES};
pub use backend::{open_device, Backend, BackendChoice};
pub use caps::{DeviceCaps, DeviceKind, RequestLimits};
pub use counters::{DeviceCounters, RequestCounts};
pub use error::DeviceError;
pub use log_writes::{LogEntry, LogReader, LogWritesDevice};
pub use memory::{FaultOp, FaultRule, MemDevice, PausedRequest, PendingWrite, Survival};
pub use pool_backend::{PoolDevice, PoolOptions};
pub use queue::{
    new_queue, new_thread_queue, DeviceCompletion, DeviceQueue, DeviceRequest, InlineQueue,
    OutOfOrderQueue, PoolQueue, QueueFull, Token, WorkerPool, MAX_QUEUE_DEPTH,
};
pub use sync_backend::{SyncDevice, SyncOpenOptions};
pub use uring::{FixedBufferOptions, UringDevice, UringOptions, UringQueue};

/// Whether a write must be durable when it completes (Force Unit Access).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// Ordinary write: may sit in the volatile write cache until a flush.
    Normal,
    /// Durable on completion. Backends without native FUA emulate it
    /// (write + flush, or `RWF_DSYNC`); counters record what was sent.
    Fua,
}

/// A block device.
///
/// Offsets and lengths of reads and writes must be multiples of
/// [`DeviceCaps::logical_block_size`]; backends reject anything else with
/// [`DeviceError::Unaligned`]. Buffer *memory* alignment is the backend's
/// concern: a backend that needs aligned memory bounces unaligned buffers.
///
/// Every method is callable concurrently from many threads.
pub trait BlockDevice: Send + Sync {
    /// What the device is and can do; fixed for the life of the handle.
    fn caps(&self) -> &DeviceCaps;

    /// Reads `buf.len()` bytes at byte `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError>;

    /// Writes `buf` at byte `offset`.
    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError>;

    /// Makes every write that completed before this call durable.
    fn flush(&self) -> Result<(), DeviceError>;

    /// Requests issued so far, by kind.
    fn counters(&self) -> &DeviceCounters;

    /// The backend's own asynchronous queue of (clamped) depth `depth`, or
    /// `None` when it has none. Callers use [`new_queue`], which falls back
    /// to an [`InlineQueue`] for `None`; a wrapper device that changes what
    /// requests do (fault injection, recording) keeps the default, so its
    /// queue goes through its own `read_at`/`write_at`/`flush`.
    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        let _ = depth;
        Ok(None)
    }

    /// [`native_queue`](BlockDevice::native_queue) for a queue that only
    /// the calling thread uses (pushes, submits, reaps and drops), which a
    /// backend may make cheaper (io_uring: completions deferred to that
    /// thread, see [`UringDevice::new_thread_queue`]). Callers use
    /// [`new_thread_queue`]. By default the ordinary native queue.
    fn native_thread_queue(
        &self,
        depth: usize,
    ) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        self.native_queue(depth)
    }

    /// Requests the device's kernel queue holds at once (a block device's
    /// `queue/nr_requests`), or `None` where there is no such limit (zram
    /// and other bio-based devices, image files, memory). Past it the
    /// kernel makes a submitter wait for a free request, and io_uring,
    /// which never waits in its submitter, hands the request to a worker
    /// thread instead: a much dearer path. Asynchronous queues that share
    /// the device keep their requests in the kernel below it.
    fn request_slots(&self) -> Option<usize> {
        None
    }

    /// Short name of the backend doing the I/O, for `stat`/`info` output:
    /// `"sync"`, `"uring"`, `"memory"`. Wrappers forward their inner
    /// device's name.
    fn backend_name(&self) -> &'static str {
        "other"
    }
}

/// Checks that a request is aligned to the device's logical block size and
/// inside the device.
pub fn check_request(caps: &DeviceCaps, offset: u64, len: usize) -> Result<(), DeviceError> {
    let lbs = u64::from(caps.logical_block_size);
    let len = len as u64;
    if !offset.is_multiple_of(lbs) || !len.is_multiple_of(lbs) {
        return Err(DeviceError::Unaligned {
            offset,
            len,
            logical_block_size: caps.logical_block_size,
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= caps.size_bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            offset,
            len,
            device_size: caps.size_bytes,
        }),
    }
}
