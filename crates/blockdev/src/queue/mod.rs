//! Asynchronous device queues: many requests in flight from one thread.
//!
//! A queue belongs to one submitting thread (no shared submission lock). The
//! caller moves an owned, aligned buffer into each request and gets it back
//! with the completion, so the device can never write into memory the caller
//! has freed or reused: the guarantee is enforced by ownership, not by a
//! comment.
//!
//! Every device has a queue: [`new_queue`] asks the backend for its native
//! one (io_uring: [`crate::uring::UringQueue`]; the worker-pool backend: a
//! [`PoolQueue`], whose requests run on a few worker threads) and otherwise
//! builds an [`InlineQueue`], which runs each request synchronously at
//! [`DeviceQueue::submit`]. All follow the same contract, so code written
//! against [`DeviceQueue`] runs unchanged on the memory device in tests. The
//! inline queue completes in push order, which no real queue promises; tests
//! that must see reordered completions use an [`OutOfOrderQueue`] (see
//! [`crate::MemDevice::with_out_of_order_queue`]).
//!
//! # Contract, in one place
//!
//! - A request that is invalid for the device (unaligned, out of range, a
//!   write on a read-only handle) or that fails in the device is *not* refused
//!   by [`push`](DeviceQueue::push): it completes, with its token, its buffer
//!   and the error. `push` fails only when the queue is full.
//! - Requests in flight at the same time are unordered, as on any real queue:
//!   a read overlapping a write in flight may see either version, and a
//!   flush covers only writes that *completed* before it was submitted.
//! - A request is in flight from `push` until its completion is returned by
//!   `reap`; [`depth`](DeviceQueue::depth) bounds that count.

use std::sync::Arc;

use crate::{AlignedBuf, BlockDevice, DeviceError, WriteMode};

mod inline;
pub mod out_of_order;
pub mod pool;

pub use inline::InlineQueue;
pub use out_of_order::OutOfOrderQueue;
pub use pool::{PoolQueue, WorkerPool};

/// Caller-chosen identity of a request, returned with its completion.
pub type Token = u64;

/// Deepest queue any backend builds; deeper requests are clamped to it. It
/// is io_uring's own limit on submission entries (`IORING_MAX_ENTRIES`), so
/// every backend accepts the same depths.
pub const MAX_QUEUE_DEPTH: usize = 32 * 1024;

/// One request to queue.
#[derive(Debug)]
pub enum DeviceRequest {
    /// Read `buf.len()` bytes at device byte `offset` into `buf`.
    Read { offset: u64, buf: AlignedBuf },
    /// Write `buf` at device byte `offset`.
    Write {
        offset: u64,
        buf: AlignedBuf,
        mode: WriteMode,
    },
    /// Make every write completed before this flush was submitted durable.
    Flush,
}

/// A finished request.
#[derive(Debug)]
pub struct DeviceCompletion {
    pub token: Token,
    /// Bytes transferred (0 for a flush), or what failed and where.
    pub result: Result<usize, DeviceError>,
    /// The request's buffer, handed back (None for a flush).
    pub buf: Option<AlignedBuf>,
}

/// [`DeviceQueue::push`] on a full queue: the request is handed back
/// untouched, so the caller can reap and push it again.
#[derive(Debug, thiserror::Error)]
#[error("device queue full: {depth} requests already in flight")]
pub struct QueueFull {
    pub token: Token,
    pub request: DeviceRequest,
    pub depth: usize,
}

/// A per-thread submission and completion queue on a device.
pub trait DeviceQueue: Send {
    /// Most requests this queue holds in flight at once.
    fn depth(&self) -> usize;

    /// Queues a request; it reaches the device at the next [`submit`]
    /// (backends without real queues may run it right away). Fails, handing
    /// the request back, only when `depth` requests are already in flight;
    /// an invalid request is accepted and completes with its error.
    ///
    /// [`submit`]: DeviceQueue::submit
    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull>;

    /// Sends every queued request to the device in one batch; returns how
    /// many were sent.
    fn submit(&mut self) -> Result<usize, DeviceError>;

    /// Waits until at least `min` completions are available (0: don't wait),
    /// appends every available completion to `out`, returns how many.
    ///
    /// `min` is capped at [`in_flight`](DeviceQueue::in_flight), so a reap
    /// never waits for a request that does not exist; a reap that has to wait
    /// submits queued requests first, so it never waits for one that was not
    /// sent either. An `Err` means the queue itself failed (not a request:
    /// those fail in their completions); completions already appended to
    /// `out` stay there.
    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError>;

    /// Requests pushed but not yet reaped.
    fn in_flight(&self) -> usize;

    /// A zeroed buffer of `len` bytes from this queue's own pool, which the
    /// queue may transfer through more cheaply (io_uring: registered buffers,
    /// `READ_FIXED`/`WRITE_FIXED`, no page pinning per request). `None` when
    /// the queue has no pool, `len` exceeds its buffers, or all of them are
    /// handed out.
    ///
    /// The buffer is an ordinary [`AlignedBuf`] (aligned for direct I/O):
    /// it works in any request on any queue, and dropping it is an ordinary
    /// free. Handing it back with [`recycle_buffer`](DeviceQueue::recycle_buffer)
    /// instead returns it to the pool; a dropped one is gone from the pool
    /// for the life of the queue.
    fn alloc_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        let _ = len;
        None
    }

    /// Returns a buffer from [`alloc_buffer`](DeviceQueue::alloc_buffer) to
    /// the pool; any other buffer is simply dropped.
    fn recycle_buffer(&mut self, buf: AlignedBuf) {
        drop(buf);
    }

    /// A new zeroed buffer of `len` bytes registered with this queue alone,
    /// for a caller that keeps it across many requests (io_uring: an entry
    /// of the ring's registered-buffer table, so transfers through it pin
    /// no pages). `None` where the backend has no such thing, the queue has
    /// a configured pool ([`alloc_buffer`](DeviceQueue::alloc_buffer)), its
    /// table is full or registration failed: use a plain buffer then.
    ///
    /// Like a pool buffer it is an ordinary [`AlignedBuf`] that works in any
    /// request on any queue. Give it back with
    /// [`unregister_buffer`](DeviceQueue::unregister_buffer), which frees
    /// its table entry; dropping it instead leaves the entry unused for the
    /// life of the queue.
    fn register_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        let _ = len;
        None
    }

    /// Frees a buffer of [`register_buffer`](DeviceQueue::register_buffer)
    /// and its table entry; any other buffer is simply dropped.
    fn unregister_buffer(&mut self, buf: AlignedBuf) {
        drop(buf);
    }

    /// [`submit`](DeviceQueue::submit), then [`reap`](DeviceQueue::reap)
    /// `(min, out)`, in one system call where the backend can (io_uring: one
    /// `io_uring_enter` that submits and waits). The loop of a queue-depth-1
    /// caller pays one kernel entry per request instead of two.
    fn submit_and_reap(
        &mut self,
        min: usize,
        out: &mut Vec<DeviceCompletion>,
    ) -> Result<usize, DeviceError> {
        self.submit()?;
        self.reap(min, out)
    }
}

/// A queue on `dev`: the backend's native queue if it has one (see
/// [`BlockDevice::native_queue`]), else an [`InlineQueue`].
///
/// `depth` is clamped to `1..=`[`MAX_QUEUE_DEPTH`]; [`DeviceQueue::depth`]
/// says what was built. Make one queue per submitting thread.
pub fn new_queue(
    dev: &Arc<dyn BlockDevice>,
    depth: usize,
) -> Result<Box<dyn DeviceQueue>, DeviceError> {
    match dev.native_queue(depth)? {
        Some(queue) => Ok(queue),
        None => Ok(Box::new(InlineQueue::new(Arc::clone(dev), depth))),
    }
}

/// A queue on `dev` for the calling thread alone: [`new_queue`], except
/// that only this thread may push, submit, reap and drop it, which lets the
/// backend complete requests more cheaply (see
/// [`BlockDevice::native_thread_queue`]). For a queue that lives inside one
/// call, such as a writeback pass; a queue handed to other threads must
/// come from [`new_queue`].
pub fn new_thread_queue(
    dev: &Arc<dyn BlockDevice>,
    depth: usize,
) -> Result<Box<dyn DeviceQueue>, DeviceError> {
    match dev.native_thread_queue(depth)? {
        Some(queue) => Ok(queue),
        None => Ok(Box::new(InlineQueue::new(Arc::clone(dev), depth))),
    }
}

/// Clamps a requested depth to what every backend supports.
pub(crate) fn clamp_depth(depth: usize) -> usize {
    depth.clamp(1, MAX_QUEUE_DEPTH)
}

/// The queue-full test every queue's `push` starts with: `request` back as
/// [`QueueFull`] when `in_flight` requests already fill `depth`, so the
/// caller can reap and push it again.
pub(crate) fn refuse_if_full(
    in_flight: usize,
    depth: usize,
    token: Token,
    request: DeviceRequest,
) -> Result<DeviceRequest, QueueFull> {
    if in_flight >= depth {
        return Err(QueueFull {
            token,
            request,
            depth,
        });
    }
    Ok(request)
}

impl DeviceRequest {
    /// Runs the request now through `dev`'s synchronous calls, so it gets
    /// the device's own checks, counters and faults: how a queue without
    /// its own I/O path does a request.
    pub(crate) fn run_on(self, dev: &dyn BlockDevice, token: Token) -> DeviceCompletion {
        let (result, buf) = match self {
            DeviceRequest::Read { offset, mut buf } => {
                let result = dev.read_at(&mut buf, offset).map(|()| buf.len());
                (result, Some(buf))
            }
            DeviceRequest::Write { offset, buf, mode } => {
                let result = dev.write_at(&buf, offset, mode).map(|()| buf.len());
                (result, Some(buf))
            }
            DeviceRequest::Flush => (dev.flush().map(|()| 0), None),
        };
        DeviceCompletion { token, result, buf }
    }
}
