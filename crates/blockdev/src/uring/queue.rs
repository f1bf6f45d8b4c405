//! [`UringQueue`]: one ring per submitting thread, and the table of requests
//! the kernel may be working on.
//!
//! # Memory safety of in-flight buffers
//!
//! The kernel writes into (or reads from) a request's buffer at any time
//! between the submission entry being pushed and its completion entry being
//! posted. The argument that it never touches freed memory:
//!
//! 1. Every entry's buffer pointer points into the heap allocation of an
//!    [`AlignedBuf`] owned by the queue's in-flight table (`slots`), at the
//!    index the entry carries in its `user_data`. Moving the `AlignedBuf`
//!    value (e.g. when the table grows) does not move its allocation.
//! 2. A request larger than the device takes whole has several entries in
//!    the kernel at once, one per piece (see `in_flight`), and the request
//!    records each piece whose entry is in the ring or the kernel
//!    (`InFlight::in_kernel`). A slot is only emptied when the request is
//!    finished (`InFlight::is_finished`): the completion entry of every
//!    piece it was given has been reaped (`UringQueue::complete`), including
//!    after one piece failed. Only then is the buffer handed back to the
//!    caller or dropped. Nothing else removes or borrows the buffer while
//!    the slot is occupied.
//! 3. Dropping the queue first waits for every outstanding completion entry,
//!    and frees a request's buffer only after the last of its pieces. If the
//!    kernel refuses to let it wait, the buffers are leaked, never freed: a
//!    leak is safe, a use after free is not. A queue that fails as a whole
//!    (an `Err` from `submit` or `reap`) keeps its requests in the table
//!    for that reason.

use std::io;
use std::sync::Arc;

use io_uring::{EnterFlags, IoUring};

use super::fixed_buffers::{FixedBufferOptions, FixedPool};
use super::in_flight::{into_completion, slot_and_piece, InFlight, Op, Split, PIECES_IN_FLIGHT};
use super::setup::{build_ring, errno_text, release_files, RingUse, UringOptions, MAX_RETRIES};
use crate::error::IoOp;
use crate::page_size;
use crate::queue::{
    clamp_depth, refuse_if_full, DeviceCompletion, DeviceQueue, DeviceRequest, QueueFull, Token,
    MAX_QUEUE_DEPTH,
};
use crate::{AlignedBuf, BlockDevice, DeviceError, RequestLimits, SyncDevice, WriteMode};

/// What a queue is built with, from its [`super::UringDevice`].
#[derive(Clone, Copy, Debug)]
pub(super) struct QueueOptions {
    pub(super) uring: UringOptions,
    pub(super) fixed: FixedBufferOptions,
    /// Requests larger than these go in pieces (see `in_flight`).
    pub(super) limits: RequestLimits,
}

/// A [`DeviceQueue`] with its own io_uring (see the [`crate::uring`] docs).
pub struct UringQueue {
    ring: IoUring,
    dev: Arc<SyncDevice>,
    depth: usize,
    iopoll: bool,
    sqpoll: bool,
    /// Completions wait in the kernel until this thread asks for them
    /// (`DEFER_TASKRUN`, see [`UringQueue::for_this_thread`]).
    deferred: bool,
    /// The in-flight table: a request's index here is its entry's
    /// `user_data`. Its buffers are owned here until the completion entry
    /// for that index is reaped (see the module docs).
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// Occupied slots.
    live: usize,
    /// Finished, not yet handed out by `reap`: completions from the ring, and
    /// requests that failed validation or needed no I/O.
    ready: Vec<DeviceCompletion>,
    /// Polled rings only: flushes to run at the next `submit`.
    polled_flushes: Vec<Token>,
    /// Requests pushed since the last `submit`.
    unsubmitted: usize,
    /// Entries pushed by `complete` to continue requests, not yet sent.
    resubmitted: bool,
    /// How requests are cut into pieces the device takes whole.
    split: Split,
    /// Submission entries pushed so far.
    entries: u64,
    /// Scratch: completion entries copied out of the ring.
    cqes: Vec<(u64, i32)>,
    /// Registered buffers (see `fixed_buffers`).
    pool: FixedPool,
}

impl UringQueue {
    pub(super) fn new(
        dev: Arc<SyncDevice>,
        depth: usize,
        opts: QueueOptions,
    ) -> Result<UringQueue, DeviceError> {
        UringQueue::build(dev, depth, opts, RingUse::AnyThread)
    }

    /// A queue for the calling thread alone: only it may push, submit, reap
    /// and drop it. Its ring defers completions to it where the kernel can
    /// (Linux 6.1+; elsewhere it is an ordinary queue): a thread that waits
    /// for a batch of `n` requests is woken once, when `n` are done, instead
    /// of once for each as they finish, which spares the CPUs an
    /// interruption per request (on a loop device, the CPU its worker copies
    /// on). Used from another thread, the kernel refuses it (`EEXIST`): its
    /// calls fail with [`DeviceError::Unusable`], and a drop there leaks the
    /// buffers of requests still in flight rather than free them under the
    /// kernel, and cannot unregister its buffers or release the device's
    /// descriptor at once (an `O_EXCL` block device then stays claimed until
    /// the kernel tears the ring down).
    pub(super) fn for_this_thread(
        dev: Arc<SyncDevice>,
        depth: usize,
        opts: QueueOptions,
    ) -> Result<UringQueue, DeviceError> {
        UringQueue::build(dev, depth, opts, RingUse::OneThread)
    }

    fn build(
        dev: Arc<SyncDevice>,
        depth: usize,
        opts: QueueOptions,
        ring_use: RingUse,
    ) -> Result<UringQueue, DeviceError> {
        let depth = clamp_depth(depth);
        // Room for `PIECES_IN_FLIGHT` entries per request, up to io_uring's
        // limit; the kernel rounds up to a power of two. Each request has at
        // most `budget` entries in the ring or the kernel and at most
        // `depth` requests are in the table, so the submission ring cannot
        // overflow; the completion ring is twice as large, so it cannot
        // either.
        let want = depth.saturating_mul(PIECES_IN_FLIGHT).min(MAX_QUEUE_DEPTH);
        let (ring, deferred) =
            build_ring(&dev, want as u32, opts.uring, ring_use).map_err(|why| {
                DeviceError::Unusable {
                    path: dev.path().to_owned(),
                    reason: format!("cannot make an io_uring queue of depth {depth}: {why}"),
                }
            })?;
        let budget = ring.params().sq_entries() as usize / depth;
        let caps = dev.caps();
        let split = Split::new(
            opts.limits,
            page_size(),
            caps.logical_block_size as usize,
            budget,
        );
        let pool = FixedPool::register(&ring, dev.caps(), opts.fixed);
        Ok(UringQueue {
            ring,
            dev,
            depth,
            iopoll: opts.uring.iopoll,
            sqpoll: opts.uring.sqpoll_idle_ms.is_some(),
            deferred,
            slots: Vec::with_capacity(depth),
            free: Vec::with_capacity(depth),
            live: 0,
            ready: Vec::with_capacity(depth),
            polled_flushes: Vec::new(),
            unsubmitted: 0,
            resubmitted: false,
            split,
            entries: 0,
            cqes: Vec::with_capacity(depth),
            pool,
        })
    }

    /// Whether completions wait in the kernel until this queue's thread
    /// asks for them (a queue [`for_this_thread`](Self::for_this_thread) on
    /// a kernel that has `DEFER_TASKRUN`).
    pub fn defers_completions(&self) -> bool {
        self.deferred
    }

    /// Registered buffers in this queue's table (0 without a pool).
    pub fn fixed_buffers(&self) -> usize {
        self.pool.registered()
    }

    /// Submission entries pushed so far: one for each piece of a request
    /// (one piece unless it is larger than the device takes whole, see
    /// [`crate::RequestLimits`]) and for each continuation of a short
    /// transfer.
    pub fn submission_entries(&self) -> u64 {
        self.entries
    }

    /// Submission entries sent so far as `READ_FIXED`/`WRITE_FIXED`.
    pub fn fixed_entries(&self) -> u64 {
        self.pool.fixed_entries
    }

    /// Why a configured pool is missing (registration failed), if it is.
    pub fn fixed_buffer_error(&self) -> Option<&str> {
        self.pool.error()
    }

    /// The registered-buffer index for `buf` unless it is bounced.
    fn fixed_index(&self, buf: &AlignedBuf, bounce: &Option<AlignedBuf>) -> Option<u16> {
        match bounce {
            Some(_) => None,
            None => self.pool.index_of(buf),
        }
    }

    fn ring_error(&self, what: &str, e: io::Error) -> DeviceError {
        DeviceError::Unusable {
            path: self.dev.path().to_owned(),
            reason: format!("{what} failed: {}", errno_text(&e)),
        }
    }

    /// A completion that never reached the kernel.
    fn finish_now(
        &mut self,
        token: Token,
        result: Result<usize, DeviceError>,
        buf: Option<AlignedBuf>,
    ) {
        self.ready.push(DeviceCompletion { token, result, buf });
    }

    /// An aligned copy of `buf` when its memory is misaligned for direct
    /// I/O; `Err` only if the allocation cannot be described.
    fn bounce_for(
        &self,
        buf: &AlignedBuf,
        op: IoOp,
        offset: u64,
        copy: bool,
    ) -> Result<Option<AlignedBuf>, DeviceError> {
        if !self.dev.needs_bounce(buf.as_ptr(), buf.len()) {
            return Ok(None);
        }
        self.dev.note_bounce();
        let align = self.dev.caps().memory_alignment as usize;
        let mut bounce = AlignedBuf::new(buf.len(), align).map_err(|e| DeviceError::Io {
            op,
            offset,
            len: buf.len() as u64,
            source: io::Error::new(io::ErrorKind::OutOfMemory, e),
        })?;
        if copy {
            bounce.copy_from_slice(buf);
        }
        Ok(Some(bounce))
    }

    /// Puts `request` in a free slot and pushes its first entries.
    fn start(&mut self, token: Token, op: Op) {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[index] = Some(InFlight::new(token, op));
        self.live += 1;
        self.unsubmitted += 1;
        self.advance(index);
    }

    /// Pushes every entry the request in slot `index` has to send now (new
    /// pieces, continuations), and hands the request back if it is
    /// finished.
    fn advance(&mut self, index: usize) {
        loop {
            let Some(request) = self.slots.get_mut(index).and_then(Option::as_mut) else {
                return;
            };
            if request.is_finished() {
                break;
            }
            let Some(entry) = request.next_entry(index, &self.split) else {
                return;
            };
            let fixed = matches!(
                request.op,
                Op::Read { fixed: Some(_), .. } | Op::Write { fixed: Some(_), .. }
            );
            // SAFETY: `entry` was built by `InFlight::next_entry` for the
            // request in `self.slots[index]`, which it stays in, so its
            // buffer pointer (if any) points into an `AlignedBuf` owned by
            // that slot, and its length stays inside it. The request records
            // the piece as in the kernel until `complete` handles the
            // completion entry naming it, and the slot is not emptied (the
            // buffer not moved out, dropped or borrowed) while any piece is
            // (module docs); `Drop` waits for those completions or leaks the
            // buffer. The descriptor is fixed file 0 of this ring, which
            // holds its own reference to the open file.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_err() {
                // Cannot happen: the ring has room for `budget` entries of
                // each of `depth` requests (see `build`). Fail the piece
                // rather than lose it; the request ends once the kernel is
                // done with its other pieces.
                let (_, piece) = slot_and_piece(entry.get_user_data());
                let source = io::Error::other("io_uring submission queue unexpectedly full");
                request.refused(piece, source);
                continue;
            }
            self.entries += 1;
            if fixed {
                self.pool.fixed_entries += 1;
            }
        }
        if let Some(request) = self.slots[index].take() {
            self.live -= 1;
            self.free.push(index);
            self.ready.push(into_completion(request));
        }
    }

    /// Sends everything in the submission ring to the kernel.
    fn enter_submit(&mut self) -> Result<(), DeviceError> {
        self.resubmitted = false;
        let mut stalls = 0;
        loop {
            if !self.sqpoll && self.ring.submission().is_empty() {
                return Ok(());
            }
            match self.ring.submit() {
                Ok(_) if self.sqpoll => return Ok(()),
                Ok(n) if n > 0 => stalls = 0,
                Ok(_) => stalls += 1,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // The kernel is short of memory for requests, or its
                // completion backlog is full: make room and try again.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    stalls += 1;
                    if stalls > MAX_RETRIES {
                        return Err(self.ring_error("io_uring_enter (submit)", e));
                    }
                    self.drain_completions();
                }
                Err(e) => return Err(self.ring_error("io_uring_enter (submit)", e)),
            }
            if stalls > MAX_RETRIES {
                return Err(self.ring_error(
                    "io_uring_enter (submit)",
                    io::Error::other("the kernel took no entries"),
                ));
            }
        }
    }

    /// Enters the kernel to run completion work and, when `want > 0`, to
    /// wait for that many completions, without submitting anything.
    fn get_events(&mut self, want: usize) -> Result<(), DeviceError> {
        // SAFETY: `to_submit` is 0, so the kernel reads no submission entry;
        // no argument pointer is passed (`None`, size of `sigset_t` as the
        // crate's own submit does).
        let r = unsafe {
            self.ring.submitter().enter::<libc::sigset_t>(
                0,
                want as u32,
                EnterFlags::GETEVENTS.bits(),
                None,
            )
        };
        match r {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(self.ring_error("io_uring_enter (wait)", e)),
        }
    }

    /// Handles every completion entry in the ring: finished requests go to
    /// `ready`, unfinished ones are pushed again (`resubmitted`).
    fn drain_completions(&mut self) {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(user_data, res) in &cqes {
            self.complete(user_data, res);
        }
        self.cqes = cqes;
    }

    /// The kernel is done with the entry `user_data` names, with result
    /// `res`.
    fn complete(&mut self, user_data: u64, res: i32) {
        let (index, piece) = slot_and_piece(user_data);
        let Some(request) = self.slots.get_mut(index).and_then(Option::as_mut) else {
            // Not ours (cannot happen: every entry is tagged with an
            // occupied slot). Nothing to hand back.
            return;
        };
        request.complete(piece, res);
        let pushed = self.entries;
        self.advance(index);
        if self.entries != pushed {
            self.resubmitted = true;
        }
    }

    /// Polled rings only: runs the flushes pushed since the last submit.
    fn run_polled_flushes(&mut self) {
        for token in std::mem::take(&mut self.polled_flushes) {
            let result = self.dev.flush().map(|()| 0);
            self.finish_now(token, result, None);
        }
    }

    /// Drains the completion ring, then sends any continuations.
    fn harvest(&mut self) -> Result<(), DeviceError> {
        self.drain_completions();
        if self.resubmitted {
            self.enter_submit()?;
        }
        Ok(())
    }
}

impl DeviceQueue for UringQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull> {
        let request = refuse_if_full(self.in_flight(), self.depth, token, request)?;
        match request {
            DeviceRequest::Read { offset, buf } => {
                if let Err(e) = self.dev.admission().read(offset, buf.len()) {
                    self.finish_now(token, Err(e), Some(buf));
                    return Ok(());
                }
                if buf.is_empty() {
                    self.finish_now(token, Ok(0), Some(buf));
                    return Ok(());
                }
                match self.bounce_for(&buf, IoOp::Read, offset, false) {
                    Ok(bounce) => {
                        let fixed = self.fixed_index(&buf, &bounce);
                        self.start(
                            token,
                            Op::Read {
                                offset,
                                buf,
                                bounce,
                                fixed,
                            },
                        )
                    }
                    Err(e) => self.finish_now(token, Err(e), Some(buf)),
                }
            }
            DeviceRequest::Write { offset, buf, mode } => {
                if let Err(e) = self.dev.admission().write(offset, buf.len(), mode) {
                    self.finish_now(token, Err(e), Some(buf));
                    return Ok(());
                }
                let fua = mode == WriteMode::Fua;
                if buf.is_empty() {
                    self.finish_now(token, Ok(0), Some(buf));
                    return Ok(());
                }
                match self.bounce_for(&buf, IoOp::Write, offset, true) {
                    Ok(bounce) => {
                        let fixed = self.fixed_index(&buf, &bounce);
                        self.start(
                            token,
                            Op::Write {
                                offset,
                                buf,
                                bounce,
                                fua,
                                fixed,
                            },
                        )
                    }
                    Err(e) => self.finish_now(token, Err(e), Some(buf)),
                }
            }
            DeviceRequest::Flush if self.iopoll => {
                // Counted by `SyncDevice::flush` when it runs.
                self.polled_flushes.push(token);
                self.unsubmitted += 1;
            }
            DeviceRequest::Flush => {
                self.dev.admission().flush();
                self.start(token, Op::Flush);
            }
        }
        Ok(())
    }

    fn submit(&mut self) -> Result<usize, DeviceError> {
        // A polled ring cannot fsync. Running the flush now, before the
        // entries below are sent, covers every write that completed before
        // this submit, which is all a flush promises.
        self.run_polled_flushes();
        let sent = std::mem::take(&mut self.unsubmitted);
        self.enter_submit()?;
        Ok(sent)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError> {
        let start = out.len();
        // Completions may be waiting on work the kernel only does when we
        // enter it (deferred task work, or polling on a polled ring).
        if min == 0
            && self.live > 0
            && (self.iopoll || self.ring.submission().taskrun())
            && self.ring.completion().is_empty()
        {
            self.get_events(0)?;
        }
        self.harvest()?;
        out.append(&mut self.ready);
        loop {
            let have = out.len() - start;
            let target = min.min(have + self.in_flight());
            if have >= target {
                return Ok(have);
            }
            if self.unsubmitted > 0 || !self.polled_flushes.is_empty() {
                self.submit()?;
            } else {
                // Everything in flight is in the kernel; `ready` is empty.
                self.get_events(target - have)?;
            }
            self.harvest()?;
            out.append(&mut self.ready);
        }
    }

    fn in_flight(&self) -> usize {
        self.live + self.ready.len() + self.polled_flushes.len()
    }

    fn alloc_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        self.pool.take(len)
    }

    fn recycle_buffer(&mut self, buf: AlignedBuf) {
        self.pool.put_back(buf);
    }

    fn register_buffer(&mut self, len: usize) -> Option<AlignedBuf> {
        self.pool.register_one(&self.ring, self.dev.caps(), len)
    }

    fn unregister_buffer(&mut self, buf: AlignedBuf) {
        self.pool.unregister_one(&self.ring, buf);
    }

    fn submit_and_reap(
        &mut self,
        min: usize,
        out: &mut Vec<DeviceCompletion>,
    ) -> Result<usize, DeviceError> {
        let start = out.len();
        self.run_polled_flushes();
        self.unsubmitted = 0;
        // Continuations pushed here go out with the same enter.
        self.drain_completions();
        out.append(&mut self.ready);
        let have = out.len() - start;
        let want = min.min(have + self.in_flight()).saturating_sub(have);
        let mut stalls = 0;
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                // Interrupted while waiting: the entries were taken before
                // the wait began; `reap` below waits again if needed.
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => break,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    stalls += 1;
                    if stalls > MAX_RETRIES {
                        return Err(self.ring_error("io_uring_enter (submit and wait)", e));
                    }
                    self.drain_completions();
                }
                Err(e) => return Err(self.ring_error("io_uring_enter (submit and wait)", e)),
            }
        }
        // Whatever the kernel did not take (a partial submit) goes now.
        self.enter_submit()?;
        self.reap(min.saturating_sub(out.len() - start), out)?;
        Ok(out.len() - start)
    }
}

impl Drop for UringQueue {
    /// Waits for every request the kernel may still be working on, so that
    /// no buffer is freed under it. Requests pushed but not submitted are
    /// sent too (the ring has no way to take an entry back): a queue dropped
    /// with unsubmitted writes performs them. Completions are discarded.
    fn drop(&mut self) {
        self.polled_flushes.clear();
        // A request with nothing in the kernel (none, by the invariant of
        // `advance`, but cheap to be sure of) can go now.
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|r| r.in_kernel() == 0) {
                *slot = None;
                self.live -= 1;
            }
        }
        let mut failures = 0;
        while self.live > 0 {
            let waited = self.ring.submit_and_wait(1);
            if let Err(e) = waited {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    failures += 1;
                }
                if failures > MAX_RETRIES {
                    // The kernel may still own these buffers and we cannot
                    // wait for it: leak them (safe) rather than free them.
                    for request in self.slots.drain(..).flatten() {
                        std::mem::forget(request);
                    }
                    return;
                }
            }
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.clear();
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| c.user_data())
                    .map(|u| (u, 0)),
            );
            for &(user_data, _) in &cqes {
                // The kernel is done with this entry; the request's buffers
                // may go once it is done with the request's other pieces.
                let (index, piece) = slot_and_piece(user_data);
                let Some(slot) = self.slots.get_mut(index) else {
                    continue;
                };
                if let Some(request) = slot {
                    request.retire(piece);
                    if request.in_kernel() == 0 {
                        *slot = None;
                        self.live -= 1;
                    }
                }
            }
            self.cqes = cqes;
        }
        // Nothing is in flight: unregister the buffer table before the pool's
        // buffers (fields, dropped after this) are freed.
        self.pool.unregister(&self.ring);
        release_files(&self.ring);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    use crate::{SyncOpenOptions, UringDevice};

    fn image(size: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![0x3cu8; size]).unwrap();
        f.flush().unwrap();
        f
    }

    /// A polled ring on a file without poll support (its availability check
    /// would refuse it, so it is built unchecked): reads and writes complete
    /// with the kernel's error, flushes run as fdatasync at submit, and
    /// nothing hangs.
    #[test]
    fn polled_ring_runs_flushes_synchronously() {
        let f = image(1 << 20);
        let sync = Arc::new(SyncDevice::open(f.path(), SyncOpenOptions::default()).unwrap());
        let opts = UringOptions {
            iopoll: true,
            sqpoll_idle_ms: None,
        };
        let dev = UringDevice::new_unchecked(sync, opts).with_fixed_buffers(2, 4096);
        let mut q = match dev.new_queue(4) {
            Ok(q) => q,
            Err(e) => return eprintln!("skipping: no IOPOLL ring here: {e}"),
        };
        let lbs = dev.caps().logical_block_size as usize;
        let buf = AlignedBuf::new(lbs, lbs).unwrap();
        q.push(1, DeviceRequest::Read { offset: 0, buf }).unwrap();
        q.push(2, DeviceRequest::Flush).unwrap();
        assert_eq!(q.in_flight(), 2);
        assert_eq!(dev.counters().snapshot().flushes, 0, "not before submit");
        assert_eq!(q.submit().unwrap(), 2);
        assert_eq!(dev.counters().snapshot().flushes, 1);
        let mut out = Vec::new();
        q.reap(2, &mut out).unwrap();
        out.sort_by_key(|c| c.token);
        assert_eq!(out.len(), 2);
        eprintln!("polled read on an image file: {:?}", out[0].result);
        assert!(out[0].buf.is_some());
        assert!(out[1].result.is_ok());
    }
}
