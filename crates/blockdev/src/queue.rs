//! Asynchronous device queues: many requests in flight from one thread.
//!
//! A queue belongs to one submitting thread (no shared submission lock). The
//! caller moves an owned, aligned buffer into each request and gets it back
//! with the completion, so the device can never write into memory the caller
//! has freed or reused: the guarantee is enforced by ownership, not by a
//! comment.

use crate::{AlignedBuf, DeviceError, WriteMode};

/// Caller-chosen identity of a request, returned with its completion.
pub type Token = u64;

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

/// A per-thread submission and completion queue on a device.
pub trait DeviceQueue: Send {
    /// Most requests this queue holds in flight at once.
    fn depth(&self) -> usize;

    /// Queues a request; it reaches the device at the next [`submit`]
    /// (backends without real queues may run it right away). Fails, handing
    /// the request back, when `depth` requests are already in flight.
    ///
    /// [`submit`]: DeviceQueue::submit
    fn push(&mut self, token: Token, request: DeviceRequest)
        -> Result<(), (DeviceRequest, DeviceError)>;

    /// Sends every queued request to the device in one batch; returns how
    /// many were sent.
    fn submit(&mut self) -> Result<usize, DeviceError>;

    /// Waits until at least `min` completions are available (0: don't wait),
    /// appends every available completion to `out`, returns how many.
    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError>;

    /// Requests pushed but not yet reaped.
    fn in_flight(&self) -> usize;
}
