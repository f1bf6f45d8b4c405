//! io_uring backend: the [`SyncDevice`] descriptor driven by per-thread rings.
//!
//! [`UringDevice`] opens and probes exactly like [`SyncDevice`] (it is one,
//! underneath) and answers the synchronous [`BlockDevice`] calls through it.
//! What it adds is [`UringQueue`]: one io_uring per queue, and so per
//! submitting thread, with no lock shared between queues. `push` only fills
//! a submission entry, `submit` is one `io_uring_enter`, and `reap` reads the
//! completion ring and enters the kernel only when it has to wait.
//!
//! Per ring: the device descriptor is registered (fixed file 0), FUA writes
//! carry `RWF_DSYNC`, flushes are `IORING_OP_FSYNC` with `DATASYNC`, misaligned
//! buffers are bounced as in [`SyncDevice`], short transfers and
//! `EINTR`/`EAGAIN` are continued, and requests longer than one submission
//! entry can carry, or than the device takes whole ([`RequestLimits`]:
//! the kernel would not split them without blocking, and would hand them to
//! a worker thread), are sent in pieces that complete as one request.
//!
//! # Registered buffers
//!
//! With [`UringDevice::with_fixed_buffers`]`(count, len)`, each queue
//! registers a pool of `count` page-aligned buffers of `len` bytes with its
//! ring, so the kernel pins their pages once instead of per request.
//! [`DeviceQueue::alloc_buffer`] hands them out; a read or write carrying one
//! of *this* queue's buffers goes out as `READ_FIXED`/`WRITE_FIXED`, any
//! other buffer as a plain one. If registration fails (typically `ENOMEM`
//! from `RLIMIT_MEMLOCK`), the queue works without a pool and
//! [`UringQueue::fixed_buffer_error`] says why.
//!
//! # Where each part lives
//!
//! - `setup`: building a ring, and whether io_uring works here ([`check_uring`]).
//! - `fixed_buffers`: the pool of registered buffers, with the argument that
//!   the kernel never reads or writes through a buffer it should not.
//! - `in_flight`: one request's submission entries and completions, and how
//!   a large request is cut into pieces.
//! - `queue`: [`UringQueue`], the ring and its table of requests in flight,
//!   with the argument that the kernel never touches freed memory.

use std::path::Path;
use std::sync::Arc;

use crate::{
    BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceQueue, RequestLimits, SyncDevice,
    SyncOpenOptions, WriteMode,
};

mod fixed_buffers;
mod in_flight;
mod queue;
mod setup;

pub use fixed_buffers::FixedBufferOptions;
use queue::QueueOptions;
pub use queue::UringQueue;
pub use setup::{check_uring, UringOptions, UringUnavailable};

/// A block device or image file whose asynchronous queues use io_uring.
/// Synchronous calls go through the [`SyncDevice`] it wraps.
#[derive(Debug)]
pub struct UringDevice {
    sync: Arc<SyncDevice>,
    opts: UringOptions,
    fixed: FixedBufferOptions,
    limits: RequestLimits,
}

impl UringDevice {
    /// Opens `path` as [`SyncDevice::open`] does and checks that io_uring
    /// works on it ([`check_uring`]).
    pub fn open(
        path: &Path,
        opts: SyncOpenOptions,
        uring: UringOptions,
    ) -> Result<UringDevice, DeviceError> {
        UringDevice::from_sync(Arc::new(SyncDevice::open(path, opts)?), uring)
    }

    /// Drives an open [`SyncDevice`] with io_uring; fails with
    /// [`DeviceError::Unusable`] saying why when io_uring does not work.
    pub fn from_sync(
        sync: Arc<SyncDevice>,
        opts: UringOptions,
    ) -> Result<UringDevice, DeviceError> {
        check_uring(&sync, opts).map_err(|why| DeviceError::Unusable {
            path: sync.path().to_owned(),
            reason: why.to_string(),
        })?;
        Ok(UringDevice::new_unchecked(sync, opts))
    }

    /// For callers that already ran [`check_uring`].
    pub(crate) fn new_unchecked(sync: Arc<SyncDevice>, opts: UringOptions) -> UringDevice {
        let limits = sync.request_limits();
        UringDevice {
            sync,
            opts,
            fixed: FixedBufferOptions::default(),
            limits,
        }
    }

    /// Gives every queue made from now on a pool of `count` registered
    /// buffers of `len` bytes (see the module docs); `0` for either turns
    /// pools off (the default).
    pub fn with_fixed_buffers(mut self, count: usize, len: usize) -> UringDevice {
        self.fixed = FixedBufferOptions { count, len };
        self
    }

    /// Sends every read and write larger than `limits` allow in pieces that
    /// fit, on queues made from now on, instead of the limits probed from
    /// the device ([`SyncDevice::request_limits`]; none for an image file).
    pub fn with_request_limits(mut self, limits: RequestLimits) -> UringDevice {
        self.limits = limits;
        self
    }

    /// The limits requests are cut to (see [`Self::with_request_limits`]).
    pub fn request_limits(&self) -> RequestLimits {
        self.limits
    }

    pub fn fixed_buffer_options(&self) -> FixedBufferOptions {
        self.fixed
    }

    pub fn sync_device(&self) -> &SyncDevice {
        &self.sync
    }

    pub fn options(&self) -> UringOptions {
        self.opts
    }

    /// A queue of `depth` (clamped to `1..=`[`crate::MAX_QUEUE_DEPTH`])
    /// requests with its own ring. Make one per submitting thread.
    pub fn new_queue(&self, depth: usize) -> Result<UringQueue, DeviceError> {
        UringQueue::new(Arc::clone(&self.sync), depth, self.queue_options())
    }

    /// A queue that only the calling thread may use, whose completions wait
    /// in the kernel until that thread asks for them (see
    /// [`UringQueue::defers_completions`]): a thread that waits for a batch
    /// is woken once for it. Another thread's calls on it fail.
    pub fn new_thread_queue(&self, depth: usize) -> Result<UringQueue, DeviceError> {
        UringQueue::for_this_thread(Arc::clone(&self.sync), depth, self.queue_options())
    }

    fn queue_options(&self) -> QueueOptions {
        QueueOptions {
            uring: self.opts,
            fixed: self.fixed,
            limits: self.limits,
        }
    }
}

impl BlockDevice for UringDevice {
    fn caps(&self) -> &DeviceCaps {
        self.sync.caps()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.sync.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.sync.write_at(buf, offset, mode)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.sync.flush()
    }

    fn counters(&self) -> &DeviceCounters {
        self.sync.counters()
    }

    fn request_slots(&self) -> Option<usize> {
        self.sync.request_slots()
    }

    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        Ok(Some(Box::new(self.new_queue(depth)?)))
    }

    fn native_thread_queue(
        &self,
        depth: usize,
    ) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        Ok(Some(Box::new(self.new_thread_queue(depth)?)))
    }

    fn backend_name(&self) -> &'static str {
        "uring"
    }
}
