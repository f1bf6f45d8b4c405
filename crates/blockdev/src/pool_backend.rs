//! The worker-pool backend: synchronous calls, queued requests run by a
//! few worker threads.
//!
//! For devices that do a request's work in the thread that submits it and
//! refuse NOWAIT (zram compresses in the caller of `pwrite`): there,
//! io_uring punts every request to a kernel worker and the
//! [`InlineQueue`](crate::InlineQueue) runs a queue's requests one after
//! another, so a queue of either kind keeps one core busy. Here a queue's
//! requests run on a [`WorkerPool`] of as many threads as the process may
//! use CPUs, so a deep queue keeps every core in the device. Synchronous
//! calls ([`BlockDevice::read_at`] and the rest) still run in the caller,
//! as on the inner device. [`crate::backend`] says when it is chosen.

use std::num::NonZeroUsize;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::queue::pool::WorkerPool;
use crate::{BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceQueue, WriteMode};

/// Name of a pool's worker threads, before their number.
const WORKER_NAME: &str = "iomapfs-io";

/// How a [`PoolDevice`] sizes its pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Worker threads; `None`: [`default_workers`].
    pub workers: Option<NonZeroUsize>,
}

impl PoolOptions {
    /// The number of workers these options give.
    pub fn workers(&self) -> NonZeroUsize {
        self.workers.unwrap_or_else(default_workers)
    }
}

/// The CPUs this process may run on (its affinity mask and cgroup quota,
/// [`std::thread::available_parallelism`]), or 1 if that is unknown: more
/// workers than CPUs would only take turns.
pub fn default_workers() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

/// A device whose queues run their requests on a pool of worker threads,
/// shared by every queue made on it (see the [module docs](self)).
pub struct PoolDevice {
    inner: Arc<dyn BlockDevice>,
    workers: NonZeroUsize,
    /// Started at the first queue: a handle that only makes synchronous
    /// calls (fsck, mkfs) never has threads.
    pool: Mutex<Option<Arc<WorkerPool>>>,
}

impl PoolDevice {
    /// `inner` with queues on a pool of `opts.workers()` threads.
    pub fn new(inner: Arc<dyn BlockDevice>, opts: PoolOptions) -> PoolDevice {
        PoolDevice {
            inner,
            workers: opts.workers(),
            pool: Mutex::new(None),
        }
    }

    /// Worker threads the pool has, or will have once started.
    pub fn workers(&self) -> usize {
        self.workers.get()
    }

    /// The device the workers call.
    pub fn inner(&self) -> &Arc<dyn BlockDevice> {
        &self.inner
    }

    fn pool(&self) -> Result<Arc<WorkerPool>, DeviceError> {
        let mut pool = self.pool.lock();
        if let Some(pool) = &*pool {
            return Ok(Arc::clone(pool));
        }
        let started = Arc::new(WorkerPool::new(
            Arc::clone(&self.inner),
            self.workers,
            WORKER_NAME,
        )?);
        *pool = Some(Arc::clone(&started));
        Ok(started)
    }
}

impl BlockDevice for PoolDevice {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.inner.write_at(buf, offset, mode)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }

    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }

    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        Ok(Some(Box::new(self.pool()?.queue(depth))))
    }

    fn request_slots(&self) -> Option<usize> {
        self.inner.request_slots()
    }

    fn backend_name(&self) -> &'static str {
        "pool"
    }
}

impl std::fmt::Debug for PoolDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolDevice")
            .field("device", &self.inner.caps().name)
            .field("workers", &self.workers)
            .field("started", &self.pool.lock().is_some())
            .finish()
    }
}
