//! Asynchronous file I/O: a per-thread queue of reads and writes, each with a
//! caller's token, submitted in batches and reaped as completions.
//!
//! Completion policy — decided in one place, [`IoQueue::submit_write`]:
//! - **inline**: the thread that reaps the device completion completes the
//!   request. Reads, and writes that are pure overwrites inside EOF with no
//!   sync work left (not DSYNC, or DSYNC done by a durable write, see
//!   [`iomap::dio::dsync_as_durable_write`]).
//! - **inline after a queued flush**: a DSYNC pure overwrite on a device
//!   that needs a separate flush. The reaper queues one device flush (never waiting
//!   for it) and completes every such write the flush covers when it lands:
//!   one flush is shared by all DSYNC writes completed before it was issued.
//! - **deferred**: a completion worker does the work a reaper must never block
//!   on — allocation, unwritten conversion, size change, journal commit — and
//!   then posts the completion to this queue.
//!
//! Buffers are owned [`AlignedBuf`]s moved into the queue and handed back in
//! the [`Completion`]: the device can never write into memory the caller has
//! freed or reused. Any offset and length works; requests that are not whole
//! device blocks, and writes to a file that has seen such a write (their
//! blocks must be held in its range lock, see [`iomap::io_lock`]), are
//! completed by the worker through the synchronous byte-granular path.
//!
//! Every request in flight counts on its inode's direct-I/O counter until it
//! completes, so truncate, punch and other exclusive operations wait for it.
//! Reap regularly: a request is complete (and its count released) only once
//! reaped. So the thread that owns a queue must not make a synchronous call
//! that needs the exclusive lock of a file it has unreaped requests on
//! (truncate, punch, an allocating write, the file's first byte-granular
//! write): that call would wait for a reap only this thread can do.
//!
//! Once a file has seen a byte-granular write, its asynchronous writes hold
//! their blocks shared in the file's range lock until their data is on the
//! device (see [`iomap::io_lock`]); one that finds its blocks held by a
//! read-modify-write goes to the worker instead of waiting. So do not, from
//! the owning thread, write byte-granular over your own unreaped writes:
//! that write would wait for a reap only this thread can do.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use blockdev::{AlignedBuf, DeviceCompletion, DeviceQueue, DeviceRequest, Token};
use iomap::async_dio::{plan_pure_overwrite, plan_read, Part, ReadPlan, WritePlan};
use iomap::byte_dio::is_block_aligned;
use iomap::dio::dsync_as_durable_write;
use iomap::{IomapError, OwnedDioInflight, OwnedSharedRange};

use crate::file::File;
use crate::iomap_ops::FsOps;
use crate::mount_state::{OpenInode, VolumeInner};
use crate::volume::Volume;
use crate::{Error, Result};

/// Which context completed a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletedBy {
    /// The thread that reaped the device completion (inline completion).
    Reaper,
    /// The completion worker (metadata, journal or flush work was needed).
    Worker,
}

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    /// The caller's token, as given at submission.
    pub token: u64,
    /// Bytes read (short at EOF) or written, or what failed and where.
    pub result: Result<usize>,
    /// The request's buffer, handed back.
    pub buf: AlignedBuf,
    pub completed_by: CompletedBy,
}

/// Device tokens carry the request's slot and the part of the request.
const PART_BITS: u32 = 20;
/// Device token of this queue's flush (no slot reaches it).
const FLUSH_TOKEN: Token = u64::MAX;
const PART_MASK: u64 = (1 << PART_BITS) - 1;

enum Kind {
    Read,
    /// A write whose data is on the device once every part completes;
    /// `flush_after` makes it wait for a device flush queued after it.
    /// `_range` holds its blocks in a file whose writes must (released when
    /// the data is on the device).
    Write {
        flush_after: bool,
        _range: Option<OwnedSharedRange<OpenInode>>,
    },
}

/// A request whose device parts are in flight.
struct Inflight {
    token: u64,
    kind: Kind,
    /// Keeps the inode open; the worker uses it for a deferred flush.
    file: File,
    offset: u64,
    /// The caller's buffer while split parts are in flight; `None` when the
    /// single part carries it.
    user_buf: Option<AlignedBuf>,
    /// For each part of a split request: where its bytes go in the caller's
    /// buffer (empty for a single part, which covers the whole buffer).
    part_offsets: Vec<usize>,
    remaining: usize,
    done_len: usize,
    error: Option<Error>,
    _inflight: OwnedDioInflight<OpenInode>,
}

enum Job {
    Read {
        file: File,
        offset: u64,
        buf: AlignedBuf,
        token: u64,
    },
    Write {
        file: File,
        offset: u64,
        buf: AlignedBuf,
        token: u64,
    },
}

/// A per-thread asynchronous I/O queue on a volume. See the module docs.
pub struct IoQueue {
    vol: Arc<VolumeInner>,
    devq: Box<dyn DeviceQueue>,
    slots: Vec<Option<Inflight>>,
    free_slots: Vec<usize>,
    ready: VecDeque<Completion>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    done_tx: Sender<Completion>,
    done_rx: Receiver<Completion>,
    /// Jobs handed to the worker and not yet back.
    deferred: usize,
    /// Occupied entries of `slots`.
    active_slots: usize,
    /// DSYNC writes covered by the device flush in flight.
    flushing: Vec<Completion>,
    /// DSYNC writes whose data completed after that flush was issued: they
    /// need the next one.
    awaiting_flush: Vec<Completion>,
    scratch: Vec<DeviceCompletion>,
}

impl Volume {
    /// A new asynchronous queue holding up to `depth` device requests in
    /// flight. Make one per submitting thread.
    pub fn io_queue(&self, depth: usize) -> Result<IoQueue> {
        self.inner.check_live()?;
        let devq = blockdev::queue::new_queue(&self.inner.dev, depth)
            .map_err(|e| Error::device("io queue", e))?;
        let (done_tx, done_rx) = mpsc::channel();
        Ok(IoQueue {
            vol: self.inner.clone(),
            devq,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ready: VecDeque::new(),
            jobs: None,
            worker: None,
            done_tx,
            done_rx,
            deferred: 0,
            active_slots: 0,
            flushing: Vec::new(),
            awaiting_flush: Vec::new(),
            scratch: Vec::new(),
        })
    }
}

/// A request the queue refused, with its buffer handed back.
pub type Refused = Box<(AlignedBuf, Error)>;

fn refused(buf: AlignedBuf, error: Error) -> Refused {
    Box::new((buf, error))
}

/// Stands in for a buffer that went into a device request which never
/// completed (the queue itself failed).
fn empty_buf() -> AlignedBuf {
    AlignedBuf::new(0, 1).expect("a zero-length buffer needs no memory")
}

impl IoQueue {
    /// The handle a request keeps until it completes (it holds the file
    /// open), once the file is known to be on this live volume.
    fn admit(&self, file: &File, offset: u64) -> Result<File> {
        let admitted = if Arc::ptr_eq(file.volume(), &self.vol) {
            file.try_clone()
        } else {
            Err(Error::invalid(
                file.path(),
                "file belongs to another volume",
            ))
        };
        admitted.map_err(|e| file.at(offset, e))
    }

    /// Whole device blocks: the device can take the request as it is.
    fn is_block_aligned(&self, offset: u64, len: usize) -> bool {
        is_block_aligned(&*self.vol.dev, offset, len as u64)
    }

    fn complete_now(&mut self, token: u64, result: Result<usize>, buf: AlignedBuf) {
        self.ready.push_back(Completion {
            token,
            result,
            buf,
            completed_by: CompletedBy::Reaper,
        });
    }

    fn defer(&mut self, job: Job) -> Result<()> {
        if self.jobs.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let done = self.done_tx.clone();
            let worker = std::thread::Builder::new()
                .name("iomapfs-completion".to_string())
                .spawn(move || completion_worker(rx, done))
                .map_err(|e| Error::invalid("completion worker", e.to_string()))?;
            self.jobs = Some(tx);
            self.worker = Some(worker);
        }
        let jobs = self.jobs.as_ref().expect("started above");
        jobs.send(job)
            .map_err(|_| Error::invalid("completion worker", "worker exited"))?;
        self.deferred += 1;
        Ok(())
    }

    fn take_slot(&mut self, inflight: Inflight) -> usize {
        self.active_slots += 1;
        match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(inflight);
                slot
            }
            None => {
                self.slots.push(Some(inflight));
                self.slots.len() - 1
            }
        }
    }

    /// Pushes one device request, making room by reaping when the device
    /// queue is full.
    fn push(&mut self, token: Token, mut request: DeviceRequest) -> Result<()> {
        loop {
            match self.devq.push(token, request) {
                Ok(()) => return Ok(()),
                Err(full) => {
                    request = full.request;
                    self.handle_device_completions(1)?;
                }
            }
        }
    }

    /// Queues a read of `buf.len()` bytes at `offset`. On a refused request
    /// the buffer comes back with the error.
    pub fn submit_read(
        &mut self,
        file: &File,
        offset: u64,
        buf: AlignedBuf,
        token: u64,
    ) -> std::result::Result<(), Refused> {
        let file = match self.admit(file, offset) {
            Ok(f) => f,
            Err(e) => return Err(refused(buf, e)),
        };
        let inode = file.open_inode().clone();
        let shared = if self.is_block_aligned(offset, buf.len()) {
            inode.io_lock.try_lock_shared()
        } else {
            None
        };
        let Some(_shared) = shared else {
            // Byte-granular, or an exclusive operation holds the file: the
            // worker reads it; never block a submitter.
            return self
                .defer(Job::Read {
                    file,
                    offset,
                    buf,
                    token,
                })
                .map_err(|e| refused(empty_buf(), e));
        };
        let vol = self.vol.clone();
        let ops = FsOps { vol: &vol };
        let (plan, len) = match plan_read(&ops, &*vol.dev, &*inode, offset, buf) {
            Ok(planned) => planned,
            Err((buf, e)) => return Err(refused(buf, file.at(offset, e))),
        };
        match plan {
            ReadPlan::Done(buf) => {
                self.complete_now(token, Ok(len), buf);
                Ok(())
            }
            ReadPlan::Whole(request) => self.launch(token, Kind::Read, file, offset, len, request),
            ReadPlan::Split(buf, parts) => {
                self.launch_parts(token, Kind::Read, file, offset, len, buf, parts)
            }
        }
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
        if file.flags().read_only {
            return Err(refused(
                buf,
                Error::invalid(file.path(), "file is open read-only"),
            ));
        }
        let file = match self.admit(file, offset) {
            Ok(f) => f,
            Err(e) => return Err(refused(buf, e)),
        };
        let flags = file.flags();
        let dsync = flags.dsync || flags.sync;
        let inode = file.open_inode().clone();
        let len = buf.len();
        // The one place the completion class is decided: O_SYNC (inode
        // metadata too), a file held exclusively, a byte-granular write, a
        // range held by a read-modify-write, or anything but a pure
        // overwrite goes to the worker.
        let shared = if flags.sync || buf.is_empty() || !self.is_block_aligned(offset, len) {
            None
        } else {
            inode.io_lock.try_lock_shared()
        };
        // Read under the shared lock, where it cannot change.
        let holds_ranges = shared.is_some() && inode.io_lock.byte_granular_writes();
        let range = if holds_ranges {
            OwnedSharedRange::try_hold(&inode, offset, offset + len as u64)
        } else {
            None
        };
        let plan = match shared {
            None => WritePlan::NotPure(buf),
            Some(_) if holds_ranges && range.is_none() => WritePlan::NotPure(buf),
            Some(_) => {
                let ops = FsOps { vol: &self.vol };
                match plan_pure_overwrite(&ops, &*self.vol.dev, &*inode, offset, buf, dsync) {
                    Ok(plan) => plan,
                    Err((buf, Error::Iomap(IomapError::WouldBlock))) => WritePlan::NotPure(buf),
                    Err((buf, e)) => return Err(refused(buf, file.at(offset, e))),
                }
            }
        };
        // Without a durable write, a DSYNC write completes once a flush
        // issued after its data landed has completed.
        let kind = Kind::Write {
            flush_after: dsync && !dsync_as_durable_write(&*self.vol.dev),
            _range: range,
        };
        match plan {
            WritePlan::NotPure(buf) => self
                .defer(Job::Write {
                    file,
                    offset,
                    buf,
                    token,
                })
                .map_err(|e| refused(empty_buf(), e)),
            WritePlan::Whole(request) => self.launch(token, kind, file, offset, len, request),
            WritePlan::Split(buf, parts) => {
                self.launch_parts(token, kind, file, offset, len, buf, parts)
            }
        }
    }

    fn in_flight_record(
        &self,
        token: u64,
        kind: Kind,
        file: File,
        offset: u64,
        len: usize,
    ) -> Inflight {
        let inode = file.open_inode().clone();
        Inflight {
            token,
            kind,
            file,
            offset,
            user_buf: None,
            part_offsets: Vec::new(),
            remaining: 1,
            done_len: len,
            error: None,
            _inflight: OwnedDioInflight::begin(&inode),
        }
    }

    /// Queues a request served by one device request on the caller's buffer.
    fn launch(
        &mut self,
        token: u64,
        kind: Kind,
        file: File,
        offset: u64,
        len: usize,
        request: DeviceRequest,
    ) -> std::result::Result<(), Refused> {
        let inflight = self.in_flight_record(token, kind, file, offset, len);
        let slot = self.take_slot(inflight);
        self.push((slot as u64) << PART_BITS, request)
            .map_err(|e| refused(empty_buf(), e))
    }

    /// Queues a request split into parts; it completes once all have.
    #[allow(clippy::too_many_arguments)] // one request's identity, as the caller has it
    fn launch_parts(
        &mut self,
        token: u64,
        kind: Kind,
        file: File,
        offset: u64,
        len: usize,
        buf: AlignedBuf,
        parts: Vec<Part>,
    ) -> std::result::Result<(), Refused> {
        let mut inflight = self.in_flight_record(token, kind, file, offset, len);
        inflight.remaining = parts.len();
        inflight.part_offsets = parts.iter().map(|p| p.buf_offset).collect();
        inflight.user_buf = Some(buf);
        let slot = self.take_slot(inflight);
        for (i, part) in parts.into_iter().enumerate() {
            let token = (slot as u64) << PART_BITS | i as u64;
            self.push(token, part.request)
                .map_err(|e| refused(empty_buf(), e))?;
        }
        Ok(())
    }

    /// Sends every queued request to the device; returns how many.
    pub fn submit(&mut self) -> Result<usize> {
        self.devq
            .submit()
            .map_err(|e| Error::device("io queue submit", e))
    }

    /// Requests submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.active_slots
            + self.deferred
            + self.ready.len()
            + self.flushing.len()
            + self.awaiting_flush.len()
    }

    /// Issues a device flush for the DSYNC writes waiting for one, unless a
    /// flush is already in flight (they then wait for the next).
    fn start_flush_if_idle(&mut self) {
        if !self.flushing.is_empty() || self.awaiting_flush.is_empty() {
            return;
        }
        self.flushing = std::mem::take(&mut self.awaiting_flush);
        if let Err(e) = self.push(FLUSH_TOKEN, DeviceRequest::Flush) {
            self.finish_flush(Err(e));
        }
    }

    /// The device flush landed: its writes are durable (or failed with it).
    fn finish_flush(&mut self, result: Result<()>) {
        // Every write the flush covered fails with it, with the same errno.
        let failure = result.err().map(|e| (e.errno(), e.to_string()));
        for mut done in std::mem::take(&mut self.flushing) {
            if let Some((errno, reason)) = &failure {
                done.result = Err(Error::device(
                    format!("dsync write: {reason}"),
                    blockdev::DeviceError::Flush {
                        source: std::io::Error::from_raw_os_error(*errno),
                    },
                ));
            }
            self.ready.push_back(done);
        }
        self.start_flush_if_idle();
    }

    fn on_device_completion(&mut self, c: DeviceCompletion) {
        if c.token == FLUSH_TOKEN {
            let result = c
                .result
                .map(|_| ())
                .map_err(|e| Error::device("dsync write: flush", e));
            self.finish_flush(result);
            return;
        }
        let slot = (c.token >> PART_BITS) as usize;
        let part = (c.token & PART_MASK) as usize;
        let Some(Some(inflight)) = self.slots.get_mut(slot) else {
            return;
        };
        if let Err(source) = c.result {
            let offset =
                inflight.offset + inflight.part_offsets.get(part).copied().unwrap_or(0) as u64;
            inflight.error.get_or_insert(
                inflight.file.at(
                    offset,
                    IomapError::Device {
                        file_offset: offset,
                        source,
                    }
                    .into(),
                ),
            );
        }
        match (inflight.user_buf.as_mut(), c.buf) {
            // Split read: copy the part into the caller's buffer.
            (Some(user), Some(part_buf)) => {
                if matches!(inflight.kind, Kind::Read) {
                    let at = inflight.part_offsets[part];
                    user[at..at + part_buf.len()].copy_from_slice(&part_buf);
                }
            }
            (None, Some(whole)) => inflight.user_buf = Some(whole),
            _ => {}
        }
        inflight.remaining -= 1;
        if inflight.remaining > 0 {
            return;
        }
        let inflight = self.slots[slot].take().expect("checked above");
        self.free_slots.push(slot);
        self.active_slots -= 1;
        let buf = inflight.user_buf.unwrap_or_else(empty_buf);
        let result = match inflight.error {
            Some(e) => Err(e),
            None => Ok(inflight.done_len),
        };
        match (inflight.kind, result) {
            (
                Kind::Write {
                    flush_after: true, ..
                },
                Ok(len),
            ) => {
                // The data is on the device; the in-flight count can go. The
                // write completes when a flush issued after now lands.
                self.awaiting_flush.push(Completion {
                    token: inflight.token,
                    result: Ok(len),
                    buf,
                    completed_by: CompletedBy::Reaper,
                });
                self.start_flush_if_idle();
            }
            (_, result) => self.complete_now(inflight.token, result, buf),
        }
    }

    /// Handles the device completions available. With `wait_for > 0` it
    /// first sends queued requests and waits for that many completions, in
    /// one kernel entry where the backend can; with 0 it only looks.
    fn handle_device_completions(&mut self, wait_for: usize) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = if wait_for == 0 {
            self.devq.reap(0, &mut scratch)
        } else {
            self.devq.submit_and_reap(wait_for, &mut scratch)
        };
        for c in scratch.drain(..) {
            self.on_device_completion(c);
        }
        self.scratch = scratch;
        result
            .map(|_| ())
            .map_err(|e| Error::device("io queue reap", e))
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
    pub fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let min = min.min(self.in_flight());
        let mut got = 0;
        loop {
            self.handle_device_completions(0)?;
            while let Ok(done) = self.done_rx.try_recv() {
                self.deferred -= 1;
                self.ready.push_back(done);
            }
            let enough = got + self.ready.len() >= min;
            if enough {
                // Queued requests must not wait for the next call (no
                // kernel entry when nothing is queued). Before anything is
                // handed over, so an error loses no completion.
                self.devq
                    .submit()
                    .map_err(|e| Error::device("io queue submit", e))?;
            }
            got += self.ready.len();
            out.extend(self.ready.drain(..));
            if enough {
                return Ok(got);
            }
            if self.devq.in_flight() > 0 {
                // Device completions first: a deferred job may be waiting
                // for these requests' in-flight count to drain.
                // Queued requests go out in the same kernel entry that waits.
                self.handle_device_completions(1)?;
            } else if self.deferred > 0 {
                match self.done_rx.recv() {
                    Ok(done) => {
                        self.deferred -= 1;
                        self.ready.push_back(done);
                    }
                    Err(_) => return Err(Error::invalid("completion worker", "worker exited")),
                }
            } else {
                return Ok(got);
            }
        }
    }
}

impl Drop for IoQueue {
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
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Runs deferred work in order and posts each completion back.
fn completion_worker(jobs: Receiver<Job>, done: Sender<Completion>) {
    for job in jobs {
        let completion = match job {
            Job::Read {
                file,
                offset,
                mut buf,
                token,
            } => {
                let result = file.pread(&mut buf, offset);
                Completion {
                    token,
                    result,
                    buf,
                    completed_by: CompletedBy::Worker,
                }
            }
            Job::Write {
                file,
                offset,
                buf,
                token,
            } => {
                let result = file.pwrite(&buf, offset);
                Completion {
                    token,
                    result,
                    buf,
                    completed_by: CompletedBy::Worker,
                }
            }
        };
        if done.send(completion).is_err() {
            return;
        }
    }
}
