//! Asynchronous direct I/O: a per-thread queue of file reads and writes,
//! each with a caller's token, submitted in batches and reaped as
//! completions. The file system keeps only the public face (it makes the
//! queue and names the file); everything from mapping to completion is
//! here.
//!
//! Completion policy (the one in [`crate::ioend`]):
//! - **inline**: the thread that reaps the device completion completes the
//!   request. Reads, and writes that are pure overwrites inside EOF with no
//!   sync work left ([`Durability::NotRequired`] or
//!   [`Durability::DurableWrites`]).
//! - **inline after a queued flush** ([`Durability::SharedFlush`]): the
//!   reaper queues one device flush (never waiting for it) and completes
//!   every DSYNC write that flush — or any other flush through the volume's
//!   [`FlushCoalescer`], synchronous writers' included — covers.
//! - **worker**: everything a reaper must never block on (allocation,
//!   unwritten conversion, size change, journal commit, read-modify-write
//!   of partial device blocks, waiting for a lock or a range) runs on the
//!   queue's completion worker through [`crate::file_io`], with the same
//!   [write protocol](crate::write_protocol).
//! - **after a cache update**: a direct write whose range a buffered
//!   handle cached meanwhile puts its bytes into the cached blocks before
//!   it completes; when a folio there is locked (a writeback holds it for
//!   its device write), the worker's second thread waits for it, never the
//!   reaper, and the write completes once that is done.
//!
//! Buffers are owned [`AlignedBuf`]s moved into the queue and handed back in
//! the [`Completion`]: the device can never write into memory the caller
//! has freed or reused. A request split over several mappings goes out as
//! several device requests ("parts") into buffers of their own, copied
//! back (reads) or out of (writes) the caller's buffer; one [`IoEnd`]
//! counts them and keeps the first error.
//!
//! Every request in flight holds a handle on its file (so an unlinked
//! file's space stays until it completes) and counts on its inode's
//! direct-I/O counter, so truncate, punch and other exclusive operations
//! wait for it. Reap regularly: the thread that owns a queue must not make
//! a synchronous call that needs the exclusive lock of a file it has
//! unreaped requests on (truncate, punch, an extending write, an
//! allocating write other than of whole blocks inside the EOF, the file's
//! first byte-granular write, a byte-granular write over its own unreaped
//! writes): that call would wait for a reap only this thread can do.

mod device_slots;
mod plan;
mod worker;

use std::collections::VecDeque;
use std::sync::Arc;

use blockdev::{AlignedBuf, BlockDevice, DeviceCompletion, DeviceQueue, DeviceRequest, Token};

pub use device_slots::DeviceSlots;
pub use plan::{plan_pure_overwrite, plan_read, Part, ReadPlan, WritePlan};

use crate::byte_dio::write_range;
use crate::file_io;
use crate::flush_coalesce::{FlushTicket, QueuedFlush};
use crate::ioend::{CompletedBy, Durability, IoEnd, WriteSync};
use crate::write_protocol::{self, Route};
use crate::{FileError, FlushCoalescer, InflightIo, IomapError, IomapFile};
use worker::{Done, Job, Worker};

/// A finished request.
#[derive(Debug)]
pub struct Completion<E> {
    /// The caller's token, as given at submission.
    pub token: u64,
    /// Bytes read (short at EOF) or written, or what failed and where.
    pub result: Result<usize, E>,
    /// The request's buffer, handed back.
    pub buf: AlignedBuf,
    pub completed_by: CompletedBy,
}

/// A request the queue refused, with its buffer handed back.
pub type Refused<E> = Box<(AlignedBuf, E)>;

/// Device tokens carry the request's slot and the index of the part.
const PART_BITS: u32 = 20;
const PART_MASK: u64 = (1 << PART_BITS) - 1;
/// Device token of this queue's flush (no slot reaches it).
const FLUSH_TOKEN: Token = u64::MAX;

/// Most device parts one request may be split into.
pub const MAX_PARTS: usize = 1 << PART_BITS;

/// Smallest device block any backend has: a part is at least one.
const MIN_DEVICE_BLOCK: u64 = 512;

/// Longest request the queue sends to the device itself: at most
/// [`MAX_PARTS`] parts of at least one device block each. Longer requests
/// go to the completion worker, whose synchronous path has no limit.
pub const MAX_INLINE_REQUEST_BYTES: u64 = MAX_PARTS as u64 * MIN_DEVICE_BLOCK;

// A slot index shifted past the part bits must fit in a token, for every
// slot a queue of the deepest depth can hold (one per request in flight,
// plus the one being launched), and stay clear of the flush token.
const _: () = assert!((blockdev::MAX_QUEUE_DEPTH as u64 + 1) < (FLUSH_TOKEN >> PART_BITS));

/// Stands in for a buffer that went into a device request which never
/// completed (the queue itself failed).
fn empty_buf() -> AlignedBuf {
    AlignedBuf::new(0, 1).expect("a zero-length buffer needs no memory")
}

fn refused<E>(buf: AlignedBuf, error: E) -> Refused<E> {
    Box::new((buf, error))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotKind {
    Read,
    Write { durability: Durability },
}

/// A request whose device parts are in flight.
struct Slot<F: IomapFile> {
    token: u64,
    kind: SlotKind,
    ioend: IoEnd,
    /// The caller's buffer while split parts are in flight; `None` while the
    /// single part carries it.
    user_buf: Option<AlignedBuf>,
    /// Where each part's bytes sit in the caller's buffer (empty for a
    /// single part, which covers it all).
    part_offsets: Vec<usize>,
    /// The file handle, its in-flight count and range hold.
    holds: InflightIo<F>,
}

/// A request whose device parts have all completed, on its way to its
/// completion.
pub(super) struct FinishedRequest<F: IomapFile> {
    token: u64,
    kind: SlotKind,
    pos: u64,
    buf: AlignedBuf,
    result: Result<usize, IomapError>,
    holds: InflightIo<F>,
}

impl<F: IomapFile> FinishedRequest<F> {
    /// Bytes a write put on the device (none when it failed).
    fn written(&self) -> usize {
        self.result.as_ref().map_or(0, |&len| len)
    }
}

/// A DSYNC write whose data is on the device, waiting for a flush.
struct AwaitingFlush<F: IomapFile> {
    ticket: FlushTicket,
    file: F,
    pos: u64,
    completion: Completion<FileError<F>>,
}

/// How a planned request reaches the device.
enum Launch {
    Whole(DeviceRequest),
    Split(AlignedBuf, Vec<Part>),
}

/// A per-thread asynchronous I/O queue on one device. See the module docs.
pub struct IoQueue<F: IomapFile> {
    dev: Arc<dyn BlockDevice>,
    flushes: Arc<FlushCoalescer>,
    devq: Box<dyn DeviceQueue>,
    slots: Vec<Option<Slot<F>>>,
    free_slots: Vec<usize>,
    /// Occupied entries of `slots`.
    active_slots: usize,
    ready: VecDeque<Completion<FileError<F>>>,
    worker: Worker<F>,
    awaiting_flush: Vec<AwaitingFlush<F>>,
    /// This queue's device flush in flight, if any.
    own_flush: Option<QueuedFlush>,
    scratch: Vec<DeviceCompletion>,
    /// The device's request slots, shared with the volume's other queues,
    /// and how many this queue holds (one per device request pushed and
    /// not yet reaped).
    device_slots: Arc<DeviceSlots>,
    held_slots: usize,
    /// Device requests waiting for a request slot, in push order. Only a
    /// queue holding slots keeps any (one with none always gets one), so
    /// its own completions free slots for them: they go out at the next
    /// submit or reap, and the submitter never waits for a slot.
    waiting_for_slot: VecDeque<(Token, DeviceRequest)>,
}

impl<F: IomapFile> IoQueue<F> {
    /// A queue holding up to `depth` device requests in flight on `dev`,
    /// sharing DSYNC flushes through `flushes` (the volume's coalescer) and
    /// the device's request slots with the volume's other queues.
    pub fn new(
        dev: Arc<dyn BlockDevice>,
        flushes: Arc<FlushCoalescer>,
        device_slots: Arc<DeviceSlots>,
        depth: usize,
    ) -> Result<IoQueue<F>, IomapError> {
        let devq = blockdev::queue::new_queue(&dev, depth).map_err(|source| IomapError::Queue {
            what: "cannot create the device queue",
            source,
        })?;
        Ok(IoQueue {
            dev,
            flushes,
            devq,
            slots: Vec::new(),
            free_slots: Vec::new(),
            active_slots: 0,
            ready: VecDeque::new(),
            worker: Worker::new(),
            awaiting_flush: Vec::new(),
            own_flush: None,
            scratch: Vec::new(),
            device_slots,
            held_slots: 0,
            waiting_for_slot: VecDeque::new(),
        })
    }

    /// The handle a request keeps until it completes, once the file system
    /// allows the I/O and the file is on this queue's device.
    fn admit(&self, file: &F, pos: u64, len: usize, write: bool) -> Result<F, FileError<F>> {
        let admitted = if Arc::ptr_eq(file.device(), &self.dev) {
            file.check_io(pos, len as u64, write)
                .and_then(|()| file.hold())
        } else {
            Err(IomapError::ForeignFile.into())
        };
        admitted.map_err(|e| file.error_at(pos, e))
    }

    /// Whether the queue itself can send a request of `len` bytes at `pos`
    /// on `file` to the device: a direct handle on a file with nothing
    /// cached, whole device blocks, not too many parts. Anything else goes
    /// through the cache or a flush of it: the worker's business.
    fn fits_device(&self, file: &F, pos: u64, len: usize) -> bool {
        len > 0
            && len as u64 <= MAX_INLINE_REQUEST_BYTES
            && file.is_direct()
            && file.mapping().is_empty()
            && crate::byte_dio::is_block_aligned(&*self.dev, pos, len as u64)
    }

    fn complete_now(&mut self, token: u64, result: Result<usize, FileError<F>>, buf: AlignedBuf) {
        self.ready.push_back(Completion {
            token,
            result,
            buf,
            completed_by: CompletedBy::Reaper,
        });
    }

    fn defer(&mut self, job: Job<F>) -> Result<(), Refused<FileError<F>>> {
        self.worker.send(job).map_err(|failed| {
            let (job, e) = *failed;
            let (Job::Read { buf, .. } | Job::Write { buf, .. }) = job;
            refused(buf, e.into())
        })
    }

    /// Queues a read of `buf.len()` bytes at `pos`. On a refused request
    /// the buffer comes back with the error.
    pub fn submit_read(
        &mut self,
        file: &F,
        pos: u64,
        buf: AlignedBuf,
        token: u64,
    ) -> Result<(), Refused<FileError<F>>> {
        let held = match self.admit(file, pos, buf.len(), false) {
            Ok(held) => held,
            Err(e) => return Err(refused(buf, e)),
        };
        let shared = if self.fits_device(file, pos, buf.len()) {
            file.as_ref().try_lock_shared()
        } else {
            None
        };
        let Some(_shared) = shared else {
            // Byte-granular, or an exclusive operation holds the file: the
            // worker reads it; a submitter never blocks.
            return self.defer(Job::Read {
                file: held,
                pos,
                buf,
                token,
            });
        };
        let (plan, len) = match plan_read(file.ops(), &*self.dev, file.inode(), pos, buf) {
            Ok(planned) => planned,
            Err((buf, e)) => return Err(refused(buf, file.error_at(pos, e))),
        };
        let launch = match plan {
            ReadPlan::Done(buf) => {
                self.complete_now(token, Ok(len), buf);
                return Ok(());
            }
            ReadPlan::Whole(request) => Launch::Whole(request),
            ReadPlan::Split(buf, parts) => Launch::Split(buf, parts),
        };
        // Counted under the shared lock, so a later exclusive holder's drain
        // waits for it.
        let holds = InflightIo::count(held);
        self.launch(token, SlotKind::Read, pos, len, holds, launch)
    }

    /// Queues a write of `buf` at `pos`. Pure overwrites go to the device
    /// from this thread; anything that needs metadata, sync work or a wait
    /// goes to the completion worker (the completion says which).
    pub fn submit_write(
        &mut self,
        file: &F,
        pos: u64,
        buf: AlignedBuf,
        token: u64,
    ) -> Result<(), Refused<FileError<F>>> {
        let held = match self.admit(file, pos, buf.len(), true) {
            Ok(held) => held,
            Err(e) => return Err(refused(buf, e)),
        };
        let len = buf.len();
        let sync = file.write_sync();
        // O_SYNC commits inode metadata: never a reaper's work.
        if sync == WriteSync::Sync || !self.fits_device(file, pos, len) {
            return self.defer(Job::Write {
                file: held,
                pos,
                buf,
                token,
            });
        }
        let range = match write_range(&*self.dev, pos, len as u64) {
            Ok(range) => range,
            Err(e) => return Err(refused(buf, file.error_at(pos, e.into()))),
        };
        let durability = Durability::for_pure_overwrite(sync, &*self.dev);
        let dev = &*self.dev;
        let mut buf_slot = Some(buf);
        let mut held_slot = Some(held);
        let route = write_protocol::write_nowait(file.as_ref(), range, |holds| {
            let buf = buf_slot.take().expect("the shared attempt runs once");
            match plan_pure_overwrite(file.ops(), dev, file.inode(), pos, buf, durability) {
                Ok(WritePlan::NotPure(buf)) => {
                    buf_slot = Some(buf);
                    Err(IomapError::WouldBlock.into())
                }
                Ok(WritePlan::Whole(request)) => {
                    let held = held_slot.take().expect("taken once");
                    Ok((Launch::Whole(request), holds.transfer(held)))
                }
                Ok(WritePlan::Split(buf, parts)) => {
                    let held = held_slot.take().expect("taken once");
                    Ok((Launch::Split(buf, parts), holds.transfer(held)))
                }
                Err((buf, e)) => {
                    buf_slot = Some(buf);
                    Err(e)
                }
            }
        });
        match route {
            Ok(Route::Done((launch, holds))) => {
                let kind = SlotKind::Write { durability };
                self.launch(token, kind, pos, len, holds, launch)
            }
            Ok(Route::Deferred) => self.defer(Job::Write {
                file: held_slot.take().expect("not taken when deferred"),
                pos,
                buf: buf_slot.take().expect("handed back when deferred"),
                token,
            }),
            Err(e) => Err(refused(
                buf_slot.take().expect("handed back on error"),
                file.error_at(pos, e),
            )),
        }
    }

    fn take_slot(&mut self, slot: Slot<F>) -> usize {
        self.active_slots += 1;
        match self.free_slots.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        }
    }

    /// Queues a planned request: one slot, one device request per part.
    fn launch(
        &mut self,
        token: u64,
        kind: SlotKind,
        pos: u64,
        len: usize,
        holds: InflightIo<F>,
        launch: Launch,
    ) -> Result<(), Refused<FileError<F>>> {
        let (requests, user_buf, part_offsets) = match launch {
            Launch::Whole(request) => (vec![request], None, Vec::new()),
            Launch::Split(buf, parts) => {
                let offsets = parts.iter().map(|p| p.buf_offset).collect();
                let requests = parts.into_iter().map(|p| p.request).collect();
                (requests, Some(buf), offsets)
            }
        };
        debug_assert!(requests.len() <= MAX_PARTS, "request over MAX_PARTS parts");
        let slot = self.take_slot(Slot {
            token,
            kind,
            ioend: IoEnd::new(pos, len, requests.len()),
            user_buf,
            part_offsets,
            holds,
        });
        for (part, request) in requests.into_iter().enumerate() {
            let device_token = (slot as u64) << PART_BITS | part as u64;
            if let Err(e) = self.push(device_token, request) {
                return Err(refused(empty_buf(), e.into()));
            }
        }
        Ok(())
    }

    /// Pushes one device request, or keeps it until a device request slot
    /// is free (see `waiting_for_slot`).
    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), IomapError> {
        if !self.waiting_for_slot.is_empty() || !self.device_slots.try_take(self.held_slots == 0) {
            self.waiting_for_slot.push_back((token, request));
            return Ok(());
        }
        self.held_slots += 1;
        self.push_to_device(token, request)
    }

    /// Pushes the requests waiting for a slot, as far as slots are free.
    fn release_waiting(&mut self) -> Result<(), IomapError> {
        while !self.waiting_for_slot.is_empty() && self.device_slots.try_take(self.held_slots == 0)
        {
            self.held_slots += 1;
            let (token, request) = self.waiting_for_slot.pop_front().expect("not empty");
            self.push_to_device(token, request)?;
        }
        Ok(())
    }

    /// Pushes one device request holding a slot, making room by reaping
    /// when the device queue is full.
    fn push_to_device(
        &mut self,
        token: Token,
        mut request: DeviceRequest,
    ) -> Result<(), IomapError> {
        loop {
            match self.devq.push(token, request) {
                Ok(()) => return Ok(()),
                Err(full) => {
                    request = full.request;
                    if let Err(e) = self.handle_device_completions(1) {
                        self.held_slots -= 1;
                        self.device_slots.give_back(1);
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Sends every queued request to the device; returns how many.
    pub fn submit(&mut self) -> Result<usize, IomapError> {
        self.release_waiting()?;
        self.devq.submit().map_err(|source| IomapError::Queue {
            what: "submit",
            source,
        })
    }

    /// A zeroed buffer of `len` bytes registered with this queue's device
    /// queue ([`DeviceQueue::register_buffer`]), for a caller that submits
    /// it again and again: a request that goes out as one device request
    /// through it pins no pages. `None`: use a plain buffer.
    pub fn register_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        self.devq.register_buffer(len)
    }

    /// Frees a buffer of [`register_buffer`](IoQueue::register_buffer)
    /// and its registration; any other buffer is simply dropped.
    pub fn unregister_buffer(&mut self, buf: AlignedBuf) {
        self.devq.unregister_buffer(buf);
    }

    /// Requests submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.active_slots + self.worker.pending() + self.ready.len() + self.awaiting_flush.len()
    }

    /// Completes the DSYNC writes a flush has settled — this queue's or
    /// anybody's — and issues this queue's flush for the rest.
    fn settle_flush_waiters(&mut self) {
        let mut i = 0;
        while i < self.awaiting_flush.len() {
            let Some(status) = self.flushes.status(self.awaiting_flush[i].ticket) else {
                i += 1;
                continue;
            };
            let waiter = self.awaiting_flush.swap_remove(i);
            let mut completion = waiter.completion;
            if let Err(source) = status {
                let error = IomapError::Flush { source }.into();
                completion.result = Err(waiter.file.error_at(waiter.pos, error));
            }
            self.ready.push_back(completion);
        }
        self.start_own_flush();
    }

    /// Issues a device flush for the DSYNC writes waiting, unless this
    /// queue has one in flight already (they then wait for the next: it
    /// may have been issued before their data completed). It is queued,
    /// never waited for.
    fn start_own_flush(&mut self) {
        if self.awaiting_flush.is_empty() || self.own_flush.is_some() {
            return;
        }
        self.own_flush = Some(self.flushes.start_queued_flush());
        if let Err(e) = self.push(FLUSH_TOKEN, DeviceRequest::Flush) {
            // The queue itself failed: the flush never reaches the device,
            // and the writes it was to cover fail with that.
            let failed = Err(blockdev::DeviceError::Flush {
                source: std::io::Error::from_raw_os_error(e.errno()),
            });
            if let Some(flush) = self.own_flush.take() {
                self.flushes.flush_done(flush, &failed);
            }
            self.settle_flush_waiters();
        }
    }

    fn on_device_completion(&mut self, c: DeviceCompletion) {
        if c.token == FLUSH_TOKEN {
            if let Some(flush) = self.own_flush.take() {
                self.flushes.flush_done(flush, &c.result);
            }
            self.settle_flush_waiters();
            return;
        }
        let index = (c.token >> PART_BITS) as usize;
        let part = (c.token & PART_MASK) as usize;
        let Some(Some(slot)) = self.slots.get_mut(index) else {
            return;
        };
        let buf_offset = slot.part_offsets.get(part).copied().unwrap_or(0);
        match (slot.user_buf.as_mut(), c.buf) {
            // Split read: copy the part into the caller's buffer.
            (Some(user), Some(part_buf)) if slot.kind == SlotKind::Read && c.result.is_ok() => {
                user[buf_offset..buf_offset + part_buf.len()].copy_from_slice(&part_buf);
            }
            (None, Some(whole)) => slot.user_buf = Some(whole),
            _ => {}
        }
        let part_pos = slot.ioend.pos() + buf_offset as u64;
        if !slot.ioend.part_done(part_pos, c.result) {
            return;
        }
        let slot = self.slots[index].take().expect("checked above");
        self.free_slots.push(index);
        self.active_slots -= 1;
        let Slot {
            token,
            kind,
            ioend,
            user_buf,
            holds,
            ..
        } = slot;
        let finished = FinishedRequest {
            token,
            kind,
            pos: ioend.pos(),
            buf: user_buf.unwrap_or_else(empty_buf),
            result: ioend.finish(),
            holds,
        };
        if let SlotKind::Write { .. } = kind {
            let cache_is_current = file_io::try_update_cache_after_direct_write(
                finished.holds.owner(),
                finished.pos,
                &finished.buf,
                finished.written(),
            );
            if !cache_is_current {
                // A folio of the range is locked (a writeback can hold one
                // for as long as its device write takes): the reaper never
                // waits for it, the worker's cache thread does, and the
                // write completes after, still counted in flight (truncate
                // and punch wait for it).
                match self.worker.update_cache(Box::new(finished)) {
                    Ok(()) => return,
                    Err(finished) => {
                        // No thread for it: waiting here is still correct.
                        let file = finished.holds.owner();
                        let written = finished.written();
                        file_io::update_cache_after_direct_write(
                            file,
                            finished.pos,
                            &finished.buf,
                            written,
                        );
                        self.complete_finished(*finished);
                        return;
                    }
                }
            }
        }
        self.complete_finished(finished);
    }

    /// Completes a request whose device parts are done and whose cache
    /// update (for a write) is done: now, or once a flush covers it.
    fn complete_finished(&mut self, finished: FinishedRequest<F>) {
        let FinishedRequest {
            token,
            kind,
            pos,
            buf,
            result,
            holds,
        } = finished;
        match (kind, result) {
            (
                SlotKind::Write {
                    durability: Durability::SharedFlush,
                },
                Ok(len),
            ) => {
                // The data is on the device: its in-flight count can go. It
                // completes once a flush issued from now on settles it.
                let file = holds.into_owner();
                self.awaiting_flush.push(AwaitingFlush {
                    ticket: self.flushes.ticket(),
                    file,
                    pos,
                    completion: Completion {
                        token,
                        result: Ok(len),
                        buf,
                        completed_by: CompletedBy::Reaper,
                    },
                });
                self.start_own_flush();
            }
            (_, result) => {
                let result = result.map_err(|e| {
                    let at = e.file_offset().unwrap_or(pos);
                    holds.owner().error_at(at, e.into())
                });
                drop(holds);
                self.complete_now(token, result, buf);
            }
        }
    }

    /// Takes what the worker posted: a completion, or a finished request
    /// whose cache update is done.
    fn on_worker_done(&mut self, done: Done<F>) {
        match done {
            Done::Completed(completion) => self.ready.push_back(completion),
            Done::CacheUpdated(finished) => self.complete_finished(*finished),
        }
    }

    /// Handles the device completions available. With `wait_for > 0` it
    /// first sends queued requests and waits for that many completions, in
    /// one kernel entry where the backend can; with 0 it only looks.
    fn handle_device_completions(&mut self, wait_for: usize) -> Result<(), IomapError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = if wait_for == 0 {
            self.devq.reap(0, &mut scratch)
        } else {
            self.devq.submit_and_reap(wait_for, &mut scratch)
        };
        let reaped = scratch.len();
        self.held_slots -= reaped;
        self.device_slots.give_back(reaped);
        for c in scratch.drain(..) {
            self.on_device_completion(c);
        }
        self.scratch = scratch;
        result.map_err(|source| IomapError::Queue {
            what: "reap",
            source,
        })?;
        if !self.awaiting_flush.is_empty() {
            // Other queues' and synchronous writers' flushes may have
            // settled some.
            self.settle_flush_waiters();
        }
        Ok(())
    }

    /// Waits for at least `min` completions (capped at what is in flight),
    /// appends every available one to `out`, returns how many. Requests
    /// queued but not yet submitted are sent first, in the same kernel entry
    /// that waits where the backend can (io_uring), so a queue-depth-1 loop
    /// needs no separate [`submit`](IoQueue::submit). On an error, the
    /// completions already appended to `out` stay there: look at them
    /// before dropping `out`.
    ///
    /// Never call a synchronous operation on a file from the thread that
    /// owns this queue while requests on that file are in flight unreaped:
    /// if it needs the file's exclusive lock (truncate, punch, a write that
    /// allocates, a file's first byte-granular write) it waits for them to
    /// be reaped, which only this thread can do.
    pub fn reap(
        &mut self,
        min: usize,
        out: &mut Vec<Completion<FileError<F>>>,
    ) -> Result<usize, IomapError> {
        let min = min.min(self.in_flight());
        let mut got = 0;
        loop {
            self.handle_device_completions(0)?;
            // Slots those completions freed: their requests go out in the
            // kernel entry below.
            self.release_waiting()?;
            while let Some(done) = self.worker.try_take() {
                self.on_worker_done(done);
            }
            let enough = got + self.ready.len() >= min;
            if enough {
                // Queued requests must not wait for the next call (no
                // kernel entry when nothing is queued). Before anything is
                // handed over, so an error loses no completion.
                self.submit()?;
            }
            got += self.ready.len();
            out.extend(self.ready.drain(..));
            if enough {
                return Ok(got);
            }
            if self.devq.in_flight() > 0 {
                // Device completions first: a deferred job may be waiting
                // for these requests' in-flight count to drain. Queued
                // requests go out in the same kernel entry that waits.
                self.handle_device_completions(1)?;
            } else if self.worker.pending() > 0 {
                let done = self.worker.take()?;
                self.on_worker_done(done);
            } else {
                return Ok(got);
            }
        }
    }
}

impl<F: IomapFile> Drop for IoQueue<F> {
    fn drop(&mut self) {
        // Every request must finish before its buffers and in-flight counts
        // go: reap until nothing is left (errors only end the wait early).
        let mut sink = Vec::new();
        while self.in_flight() > 0 {
            let before = self.in_flight();
            if self.reap(before, &mut sink).is_err() {
                break;
            }
            sink.clear();
            if self.in_flight() >= before {
                break;
            }
        }
        // Slots of requests a failed queue could not reap: the device queue
        // waits for them as it drops, and the other queues need not.
        self.device_slots.give_back(self.held_slots);
    }
}
