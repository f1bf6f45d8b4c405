//! Asynchronous file I/O: the file system's face for the engine's queue
//! ([`iomap::aio`], where the completion policy, splitting, copy-back and
//! the completion worker live). A queue belongs to one submitting thread;
//! make one per thread with [`Volume::io_queue`].
//!
//! Reads and pure overwrites complete inline in the reaping thread; writes
//! that allocate, convert, change the size or need a journal commit, and
//! requests that are not whole device blocks, are completed by the queue's
//! completion worker. Each [`Completion`] says which. Requests count as
//! in-flight direct I/O until reaped, so exclusive operations (truncate,
//! punch, allocating writes) wait for them: reap regularly, and never make
//! such a synchronous call from the thread that owns unreaped requests on
//! that file.

use blockdev::AlignedBuf;

pub use iomap::CompletedBy;

use crate::file::File;
use crate::volume::Volume;
use crate::{Error, Result};

/// A finished request: token, result (bytes or what failed and where), the
/// buffer handed back, and which context completed it.
pub type Completion = iomap::aio::Completion<Error>;

/// A request the queue refused, with its buffer handed back.
pub type Refused = iomap::aio::Refused<Error>;

/// A per-thread asynchronous I/O queue on a volume. See the module docs.
pub struct IoQueue {
    engine: iomap::aio::IoQueue<File>,
}

impl Volume {
    /// A new asynchronous queue holding up to `depth` device requests in
    /// flight. Make one per submitting thread.
    pub fn io_queue(&self, depth: usize) -> Result<IoQueue> {
        self.inner.check_live()?;
        let engine = iomap::aio::IoQueue::new(
            self.inner.dev.clone(),
            self.inner.flush_coalescer.clone(),
            self.inner.device_slots.clone(),
            depth,
        )?;
        Ok(IoQueue { engine })
    }
}

impl Volume {
    /// Device request slots the volume's asynchronous queues hold now: 0
    /// where the device has no limit ([`blockdev::BlockDevice::request_slots`];
    /// see [`iomap::aio::DeviceSlots`]).
    pub fn device_slots_in_use(&self) -> usize {
        self.inner.device_slots.used()
    }
}

impl IoQueue {
    /// Queues a read of `buf.len()` bytes at `offset`. On a refused request
    /// the buffer comes back with the error.
    pub fn submit_read(
        &mut self,
        file: &File,
        offset: u64,
        buf: AlignedBuf,
        token: u64,
    ) -> std::result::Result<(), Refused> {
        self.engine.submit_read(file, offset, buf, token)
    }

    /// Queues a write of `buf` at `offset`. Pure overwrites go to the device
    /// from this thread; anything that needs metadata or sync work is handed
    /// to the completion worker (the completion says which).
    pub fn submit_write(
        &mut self,
        file: &File,
        offset: u64,
        buf: AlignedBuf,
        token: u64,
    ) -> std::result::Result<(), Refused> {
        if let Err(e) = file.modified(offset, buf.len() as u64) {
            return Err(Box::new((buf, file.at(offset, e))));
        }
        self.engine.submit_write(file, offset, buf, token)
    }

    /// Sends every queued request to the device; returns how many.
    pub fn submit(&mut self) -> Result<usize> {
        Ok(self.engine.submit()?)
    }

    /// A zeroed buffer of `len` bytes registered with the queue's device
    /// queue, for a caller that submits it again and again (no page pinning
    /// per request on io_uring). `None`: use a plain buffer. See
    /// [`iomap::aio::IoQueue::register_buffer`].
    pub fn register_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        self.engine.register_buffer(len)
    }

    /// Frees a buffer of [`register_buffer`](IoQueue::register_buffer)
    /// and its registration; any other buffer is simply dropped.
    pub fn unregister_buffer(&mut self, buf: AlignedBuf) {
        self.engine.unregister_buffer(buf);
    }

    /// Requests submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.engine.in_flight()
    }

    /// Waits for at least `min` completions (capped at what is in flight),
    /// appends every available one to `out`, returns how many; queued
    /// requests are sent first, in the same kernel entry where the backend
    /// can. See [`iomap::aio::IoQueue::reap`], including the rule about
    /// synchronous calls from the owning thread.
    pub fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> Result<usize> {
        Ok(self.engine.reap(min, out)?)
    }
}
