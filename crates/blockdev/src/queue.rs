//! Asynchronous device queues: many requests in flight from one thread.
//!
//! A queue belongs to one submitting thread (no shared submission lock). The
//! caller moves an owned, aligned buffer into each request and gets it back
//! with the completion, so the device can never write into memory the caller
//! has freed or reused: the guarantee is enforced by ownership, not by a
//! comment.
//!
//! Every device has a queue: [`new_queue`] asks the backend for its native
//! one (io_uring: [`crate::uring::UringQueue`]) and otherwise builds an
//! [`InlineQueue`], which runs each request synchronously at
//! [`DeviceQueue::submit`]. Both follow the same contract, so code written
//! against [`DeviceQueue`] runs unchanged on the memory device in tests.
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

use std::collections::VecDeque;
use std::sync::Arc;

use crate::{AlignedBuf, BlockDevice, DeviceError, WriteMode};

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

/// Clamps a requested depth to what every backend supports.
pub(crate) fn clamp_depth(depth: usize) -> usize {
    depth.clamp(1, MAX_QUEUE_DEPTH)
}

/// A queue for devices without one of their own: [`submit`] runs each queued
/// request in push order through [`BlockDevice::read_at`], `write_at` and
/// `flush`, so its completion is available at once.
///
/// It keeps the queue contract (tokens, buffers handed back, errors as
/// completions, depth limit), so the memory device can stand in for a real
/// queue in tests. It gives no overlap between requests: its throughput is
/// that of one thread calling the device synchronously.
///
/// [`submit`]: DeviceQueue::submit
pub struct InlineQueue {
    dev: Arc<dyn BlockDevice>,
    depth: usize,
    /// Pushed, not yet submitted, in push order.
    queued: VecDeque<(Token, DeviceRequest)>,
    /// Submitted (so finished), not yet reaped.
    done: Vec<DeviceCompletion>,
}

impl InlineQueue {
    /// `depth` is clamped to `1..=`[`MAX_QUEUE_DEPTH`].
    pub fn new(dev: Arc<dyn BlockDevice>, depth: usize) -> InlineQueue {
        let depth = clamp_depth(depth);
        InlineQueue {
            dev,
            depth,
            queued: VecDeque::new(),
            done: Vec::new(),
        }
    }

    fn run(&self, token: Token, request: DeviceRequest) -> DeviceCompletion {
        let (result, buf) = match request {
            DeviceRequest::Read { offset, mut buf } => {
                let result = self.dev.read_at(&mut buf, offset).map(|()| buf.len());
                (result, Some(buf))
            }
            DeviceRequest::Write { offset, buf, mode } => {
                let result = self.dev.write_at(&buf, offset, mode).map(|()| buf.len());
                (result, Some(buf))
            }
            DeviceRequest::Flush => (self.dev.flush().map(|()| 0), None),
        };
        DeviceCompletion { token, result, buf }
    }
}

impl DeviceQueue for InlineQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull> {
        if self.in_flight() >= self.depth {
            return Err(QueueFull {
                token,
                request,
                depth: self.depth,
            });
        }
        self.queued.push_back((token, request));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize, DeviceError> {
        let sent = self.queued.len();
        while let Some((token, request)) = self.queued.pop_front() {
            let completion = self.run(token, request);
            self.done.push(completion);
        }
        Ok(sent)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError> {
        if self.done.len() < min.min(self.in_flight()) {
            self.submit()?;
        }
        let n = self.done.len();
        out.append(&mut self.done);
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.done.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultOp, FaultRule, MemDevice};

    fn buf(len: usize, fill: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len, 512).unwrap();
        b.fill(fill);
        b
    }

    #[test]
    fn inline_queue_runs_at_submit_in_push_order() {
        let mem = Arc::new(MemDevice::new(64 * 1024, 512));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let mut q = new_queue(&dev, 4).unwrap();
        assert_eq!(q.depth(), 4);
        q.push(
            1,
            DeviceRequest::Write {
                offset: 512,
                buf: buf(1024, 7),
                mode: WriteMode::Normal,
            },
        )
        .unwrap();
        q.push(
            2,
            DeviceRequest::Read {
                offset: 0,
                buf: buf(2048, 0xff),
            },
        )
        .unwrap();
        q.push(3, DeviceRequest::Flush).unwrap();
        // Nothing reached the device before submit.
        assert_eq!(mem.counters().snapshot().writes, 0);
        let mut out = Vec::new();
        assert_eq!(q.reap(0, &mut out).unwrap(), 0);
        assert_eq!(q.in_flight(), 3);
        assert_eq!(q.submit().unwrap(), 3);
        assert_eq!(q.reap(3, &mut out).unwrap(), 3);
        assert_eq!(q.in_flight(), 0);
        let tokens: Vec<Token> = out.iter().map(|c| c.token).collect();
        assert_eq!(tokens, [1, 2, 3]);
        assert_eq!(*out[0].result.as_ref().unwrap(), 1024);
        let read = out[1].buf.as_ref().unwrap();
        // The read was pushed after the write, so it sees it.
        assert!(read[..512].iter().all(|&b| b == 0));
        assert!(read[512..1536].iter().all(|&b| b == 7));
        assert!(out[2].buf.is_none());
        let c = mem.counters().snapshot();
        assert_eq!((c.reads, c.writes, c.flushes), (1, 1, 1));
    }

    #[test]
    fn full_queue_hands_the_request_back_and_reap_never_hangs() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4096, 512));
        let mut q = InlineQueue::new(dev, 0);
        assert_eq!(q.depth(), 1, "depth 0 is clamped to 1");
        q.push(5, DeviceRequest::Flush).unwrap();
        let full = q.push(6, DeviceRequest::Flush).unwrap_err();
        assert_eq!((full.token, full.depth), (6, 1));
        assert!(matches!(full.request, DeviceRequest::Flush));
        // Asking for more than is in flight waits for what there is, and a
        // waiting reap submits first.
        let mut out = Vec::new();
        assert_eq!(q.reap(10, &mut out).unwrap(), 1);
        assert_eq!(out[0].token, 5);
        assert_eq!(q.reap(10, &mut out).unwrap(), 0);
    }

    #[test]
    fn errors_are_completions_with_their_token_and_buffer() {
        let mem = Arc::new(MemDevice::new(8192, 512));
        mem.inject(FaultRule::new(FaultOp::Write).count(1));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let mut q = new_queue(&dev, 8).unwrap();
        let reqs = [
            (10, 0u64, 512usize), // injected EIO
            (11, 8192, 512),      // out of range
            (12, 100, 512),       // unaligned
            (13, 512, 512),       // fine
        ];
        for (token, offset, len) in reqs {
            q.push(
                token,
                DeviceRequest::Write {
                    offset,
                    buf: buf(len, token as u8),
                    mode: WriteMode::Fua,
                },
            )
            .unwrap();
        }
        q.submit().unwrap();
        let mut out = Vec::new();
        q.reap(4, &mut out).unwrap();
        assert_eq!(out.len(), 4);
        for c in &out {
            let b = c.buf.as_ref().expect("buffer handed back");
            assert!(b.iter().all(|&x| x == c.token as u8));
        }
        assert!(matches!(out[0].result, Err(DeviceError::Io { .. })));
        assert!(matches!(out[1].result, Err(DeviceError::OutOfRange { .. })));
        assert!(matches!(out[2].result, Err(DeviceError::Unaligned { .. })));
        assert_eq!(*out[3].result.as_ref().unwrap(), 512);
    }
}
