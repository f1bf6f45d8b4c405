//! The asynchronous queue: submit reads and writes with a token, submit,
//! reap with a minimum count and a timeout.
//!
//! Buffer ownership. The engine's queue takes owned, aligned buffers and
//! hands each back with its completion, so the device never writes into
//! memory the caller has freed or reused. In C that becomes two kinds of
//! memory a request may name:
//! - **queue buffers** (`iomapfs_queue_buf_alloc`): memory the queue owns.
//!   A request whose `buf` is the start of one is zero-copy: the buffer is
//!   *lent* to the request from submission until its completion is reaped.
//!   Lending is checked: submitting a lent buffer again, or freeing it, is
//!   refused with `-EBUSY`; a request longer than the buffer with `-EINVAL`.
//! - **any other memory**: the request goes through a bounce buffer of the
//!   queue: a write's bytes are copied at submission, a read's bytes into
//!   `buf` when its completion is reaped. The caller keeps `buf` valid
//!   until then (this cannot be checked).

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::AlignedBuf;
use iomapfs_fs::aio::{CompletedBy, Completion, IoQueue};

use crate::error::{guard, guard_int, set_last_error, Failure, Outcome};
use crate::file::{file_ref, iomapfs_file};
use crate::handles::{self, HandleKind};
use crate::queue_bufs::{QueueBufs, QUEUE_BUF_MIN_ALIGN};
use crate::volume::{iomapfs_volume, volume, VolumeShared};

/// `iomapfs_completion.flags`: the queue's completion worker completed the
/// request (it needed metadata, sync or byte-granular work); otherwise the
/// reaping thread did, inline.
pub const IOMAPFS_COMPLETED_BY_WORKER: u32 = 1 << 0;

/// Deepest queue: more requests in flight than any device takes at once.
pub const IOMAPFS_MAX_QUEUE_DEPTH: u32 = 32768;
const _: () = assert!(IOMAPFS_MAX_QUEUE_DEPTH as usize == blockdev::MAX_QUEUE_DEPTH);
// "A queue may be handed to another thread between calls": the engine's
// queue must be Send for that.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<IoQueue>();
};

/// How long a reap with a finite timeout sleeps between polls.
const POLL_INTERVAL: Duration = Duration::from_micros(50);
/// Smallest alignment of queue and bounce buffers (a page: no backend ever
/// bounces them again).
const MIN_BUFFER_ALIGN: usize = QUEUE_BUF_MIN_ALIGN;

/// One finished request, as `iomapfs_queue_reap` reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct iomapfs_completion {
    /// The caller's token, as given at submission.
    pub token: u64,
    /// Bytes read (short only at end of file) or written, or `-errno`.
    pub result: i64,
    /// The `buf` given at submission, back in the caller's hands. NULL
    /// only if the queue itself failed and lost the request's queue buffer
    /// (the buffer is then freed).
    pub buf: *mut c_void,
    /// `IOMAPFS_COMPLETED_BY_*` bits.
    pub flags: u32,
}

/// An asynchronous I/O queue on a volume, holding up to its depth of
/// requests in flight.
///
/// Thread-safety: not thread-safe. One thread at a time uses a queue; make
/// one per submitting thread (a queue may be handed to another thread
/// between calls). Files may be shared between queues.
pub struct iomapfs_queue {
    q: IoQueue,
    vol: Arc<VolumeShared>,
    align: usize,
    /// Queue buffers by start address.
    bufs: QueueBufs,
    /// Requests in flight; the engine's token is the index.
    reqs: Vec<Option<Request>>,
    free_reqs: Vec<usize>,
    /// Reaped completions not handed over yet (reap's `max`), with the
    /// message of a failed one.
    pending: VecDeque<(iomapfs_completion, Option<String>)>,
    scratch: Vec<Completion>,
    /// Spare bounce buffers.
    bounce: Vec<AlignedBuf>,
    depth: usize,
}

struct Request {
    token: u64,
    user: *mut c_void,
    len: usize,
    via: Via,
}

enum Via {
    /// A queue buffer, lent.
    Lent,
    /// Caller memory through a bounce buffer; reads copy back at reap.
    Bounce { read: bool },
}

/// The queue behind `q`.
///
/// # Safety
/// `q` is NULL or a queue from `iomapfs_queue_create` not yet destroyed,
/// used by no other thread during the call.
unsafe fn queue_mut<'a>(q: *mut iomapfs_queue) -> Outcome<&'a mut iomapfs_queue> {
    // SAFETY: the caller's contract above; `as_mut` handles NULL.
    unsafe { q.as_mut() }.ok_or_else(|| Failure::invalid("queue is NULL"))
}

fn errno_message(token: u64, e: &iomapfs_fs::Error) -> (i64, String) {
    (-i64::from(e.errno()), format!("request {token}: {e}"))
}

impl iomapfs_queue {
    fn in_flight(&self) -> usize {
        self.q.in_flight() + self.pending.len()
    }

    fn bounce_buf(&mut self, len: usize) -> Outcome<AlignedBuf> {
        let mut buf = match self.bounce.iter().rposition(|b| b.capacity() >= len) {
            Some(i) => self.bounce.swap_remove(i),
            None => AlignedBuf::new(len.next_multiple_of(MIN_BUFFER_ALIGN), self.align)
                .map_err(|e| Failure::new(libc::ENOMEM, e.to_string()))?,
        };
        buf.set_len(len)
            .map_err(|e| Failure::new(libc::ENOMEM, e.to_string()))?;
        Ok(buf)
    }

    fn recycle(&mut self, buf: AlignedBuf) {
        if buf.capacity() >= MIN_BUFFER_ALIGN && self.bounce.len() < self.depth * 2 {
            self.bounce.push(buf);
        }
    }

    /// Takes the request's buffer: a lent queue buffer, or a bounce buffer
    /// (holding the bytes, for writes).
    ///
    /// # Safety
    /// For a write through a bounce buffer, `user` is valid for reads of
    /// `len` bytes.
    unsafe fn take_buffer(
        &mut self,
        user: *mut c_void,
        len: usize,
        write: bool,
    ) -> Outcome<(AlignedBuf, Via)> {
        let addr = user as usize;
        if let Some(entry) = self.bufs.at(addr) {
            let Some(mut buf) = entry.buf.take() else {
                return Err(Failure::new(
                    libc::EBUSY,
                    format!("queue buffer {addr:#x} is lent to a request not yet reaped"),
                ));
            };
            if let Err(e) = buf.set_len(len) {
                entry.buf = Some(buf);
                return Err(Failure::invalid(format!(
                    "{len} bytes do not fit queue buffer {addr:#x} of {} bytes ({e})",
                    entry.capacity
                )));
            }
            return Ok((buf, Via::Lent));
        }
        if let Some((start, entry)) = self.bufs.containing(addr) {
            if entry.buf.is_none() {
                return Err(Failure::new(
                    libc::EBUSY,
                    format!(
                        "{addr:#x} is inside queue buffer {start:#x}, which is lent to a \
                         request not yet reaped"
                    ),
                ));
            }
        }
        let mut buf = self.bounce_buf(len)?;
        if write && len > 0 {
            // SAFETY: `user` is valid for reads of `len` bytes (the
            // caller's contract); `buf` holds `len` bytes we own, and the
            // two cannot overlap (`buf` is the queue's own allocation,
            // never lent while in the pool).
            unsafe { std::ptr::copy_nonoverlapping(user.cast::<u8>(), buf.as_mut_ptr(), len) };
        }
        Ok((buf, Via::Bounce { read: !write }))
    }

    /// Gives a request's buffer back where it came from.
    fn give_back(&mut self, user: *mut c_void, via: &Via, buf: AlignedBuf) -> *mut c_void {
        match via {
            Via::Lent => {
                let addr = user as usize;
                if buf.as_ptr() as usize == addr {
                    if let Some(entry) = self.bufs.at(addr) {
                        entry.buf = Some(buf);
                    }
                    user
                } else {
                    // The queue failed and kept no buffer for this request:
                    // that queue buffer is gone.
                    self.bufs.remove(addr);
                    std::ptr::null_mut()
                }
            }
            Via::Bounce { .. } => {
                self.recycle(buf);
                user
            }
        }
    }

    /// Turns an engine completion into the C one, finishing the request:
    /// copy-back of bounced reads, buffer back to its owner.
    fn finish(&mut self, c: Completion) -> (iomapfs_completion, Option<String>) {
        let index = c.token as usize;
        let Some(req) = self.reqs.get_mut(index).and_then(Option::take) else {
            // Cannot happen: every engine token is a live request index.
            return (
                iomapfs_completion {
                    token: u64::MAX,
                    result: -i64::from(libc::EIO),
                    buf: std::ptr::null_mut(),
                    flags: 0,
                },
                Some(format!("completion for unknown request slot {index}")),
            );
        };
        self.free_reqs.push(index);
        let (result, message) = match &c.result {
            Ok(n) => (*n as i64, None),
            Err(e) => {
                let (r, m) = errno_message(req.token, e);
                (r, Some(m))
            }
        };
        if let (Via::Bounce { read: true }, Ok(n)) = (&req.via, &c.result) {
            let n = (*n).min(req.len).min(c.buf.len());
            // SAFETY: at submission the caller promised `user` stays valid
            // for writes of `len` bytes until this completion is reaped;
            // `n <= len` and `n <= c.buf.len()`; the bounce buffer is the
            // queue's own memory, so they cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(c.buf.as_ptr(), req.user.cast::<u8>(), n) };
        }
        let flags = match c.completed_by {
            CompletedBy::Worker => IOMAPFS_COMPLETED_BY_WORKER,
            CompletedBy::Reaper => 0,
        };
        let buf = self.give_back(req.user, &req.via, c.buf);
        (
            iomapfs_completion {
                token: req.token,
                result,
                buf,
                flags,
            },
            message,
        )
    }

    /// Submits one request; see `iomapfs_queue_read`.
    ///
    /// # Safety
    /// `user` is valid for `len` bytes as the header's contract says.
    unsafe fn queue_io(
        &mut self,
        file: &iomapfs_file,
        user: *mut c_void,
        len: usize,
        offset: u64,
        token: u64,
        write: bool,
    ) -> Outcome<()> {
        if !Arc::ptr_eq(&file._vol, &self.vol) {
            return Err(Failure::new(
                libc::EXDEV,
                "the file is on another volume than the queue",
            ));
        }
        if len > isize::MAX as usize {
            return Err(Failure::invalid(format!("length {len} exceeds SSIZE_MAX")));
        }
        if user.is_null() && len > 0 {
            return Err(Failure::invalid("buf is NULL"));
        }
        // SAFETY: passed on from the caller's contract.
        let (buf, via) = unsafe { self.take_buffer(user, len, write) }?;
        let index = match self.free_reqs.pop() {
            Some(i) => i,
            None => {
                self.reqs.push(None);
                self.reqs.len() - 1
            }
        };
        let submitted = if write {
            self.q.submit_write(&file.file, offset, buf, index as u64)
        } else {
            self.q.submit_read(&file.file, offset, buf, index as u64)
        };
        match submitted {
            Ok(()) => {
                self.reqs[index] = Some(Request {
                    token,
                    user,
                    len,
                    via,
                });
                Ok(())
            }
            Err(refused) => {
                self.free_reqs.push(index);
                let (buf, e) = *refused;
                self.give_back(user, &via, buf);
                Err(Failure::fs(&e))
            }
        }
    }

    /// Waits as `iomapfs_queue_reap` says; appends what it reaps to
    /// `pending`.
    fn collect(&mut self, want: usize, timeout_ns: i64) -> Outcome<()> {
        let reap = |q: &mut Self, min: usize| -> Outcome<()> {
            let mut scratch = std::mem::take(&mut q.scratch);
            let result = q.q.reap(min, &mut scratch);
            // Completions already reaped are kept even when the reap fails.
            for c in scratch.drain(..) {
                let done = q.finish(c);
                q.pending.push_back(done);
            }
            q.scratch = scratch;
            result.map(drop).map_err(|e| Failure::fs(&e))
        };
        if timeout_ns < 0 {
            let need = want.saturating_sub(self.pending.len());
            return reap(self, need);
        }
        let deadline = Instant::now() + Duration::from_nanos(timeout_ns as u64);
        loop {
            reap(self, 0)?;
            if self.pending.len() >= want || self.q.in_flight() == 0 || Instant::now() >= deadline {
                return Ok(());
            }
            std::thread::sleep(
                POLL_INTERVAL.min(deadline.saturating_duration_since(Instant::now())),
            );
        }
    }
}

/// Makes a queue of `depth` (1 to `IOMAPFS_MAX_QUEUE_DEPTH`) requests in
/// flight on `vol`; stores it in `*out` and returns 0, or `-errno`.
///
/// # Safety
/// `vol` is an open volume; `out` points to writable room for a pointer.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_create(
    vol: *mut iomapfs_volume,
    depth: u32,
    out: *mut *mut iomapfs_queue,
) -> c_int {
    guard_int("iomapfs_queue_create", || {
        // SAFETY: the caller's contract above.
        let v = unsafe { volume(vol) }?;
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        if depth == 0 || depth > IOMAPFS_MAX_QUEUE_DEPTH {
            return Err(Failure::invalid(format!(
                "depth {depth} is not 1..={IOMAPFS_MAX_QUEUE_DEPTH}"
            )));
        }
        let q = v
            .shared
            .vol
            .io_queue(depth as usize)
            .map_err(|e| Failure::fs(&e))?;
        let align = (v.shared.vol.device().caps().memory_alignment as usize).max(MIN_BUFFER_ALIGN);
        let handle = Box::into_raw(Box::new(iomapfs_queue {
            q,
            vol: v.shared.clone(),
            align,
            bufs: QueueBufs::default(),
            reqs: Vec::with_capacity(depth as usize),
            free_reqs: Vec::with_capacity(depth as usize),
            pending: VecDeque::new(),
            scratch: Vec::with_capacity(depth as usize),
            bounce: Vec::new(),
            depth: depth as usize,
        }));
        handles::register(HandleKind::Queue, handle as usize);
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write(handle) };
        Ok(0)
    })
}

/// Destroys a queue: waits for every request in flight to finish (their
/// completions are dropped), then frees the queue and all its buffers.
/// `-EBADF`: not an open queue.
///
/// # Safety
/// `q` is NULL or a pointer `iomapfs_queue_create` returned, used by no
/// other thread; its buffers are not used after this call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_destroy(q: *mut iomapfs_queue) -> c_int {
    guard_int("iomapfs_queue_destroy", || {
        if q.is_null() {
            return Err(Failure::invalid("queue is NULL"));
        }
        handles::unregister(HandleKind::Queue, q as usize)?;
        // SAFETY: made by Box::into_raw in iomapfs_queue_create and just
        // unregistered, so freed exactly once. Dropping the engine queue
        // waits for its requests in flight.
        drop(unsafe { Box::from_raw(q) });
        Ok(0)
    })
}

/// Allocates a queue buffer of `len` bytes, aligned for direct I/O (at
/// least 4096), zeroed. Requests naming it go to the device without a copy
/// (see "Buffers" in the header); on the io_uring backend it is also
/// registered with the queue's ring, so they pin no pages either (a queue
/// registers up to 16384; past that, or where the kernel refuses, buffers
/// are plain). Returns NULL on failure (see `iomapfs_last_error`). Freed by
/// `iomapfs_queue_buf_free` or with the queue.
///
/// # Safety
/// `q` is an open queue, used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_buf_alloc(q: *mut iomapfs_queue, len: usize) -> *mut c_void {
    guard(
        "iomapfs_queue_buf_alloc",
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: the caller's contract above.
            let q = unsafe { queue_mut(q) }?;
            if len == 0 || len > isize::MAX as usize {
                return Err(Failure::invalid(format!(
                    "length {len} is not 1..=SSIZE_MAX"
                )));
            }
            // Registered with the device queue where it can be (no page
            // pinning per request), else a plain allocation.
            let buf = match q.q.register_buffer(len) {
                Some(buf) if buf.align() >= q.align => buf,
                other => {
                    if let Some(unfit) = other {
                        q.q.unregister_buffer(unfit);
                    }
                    AlignedBuf::new(len, q.align)
                        .map_err(|e| Failure::new(libc::ENOMEM, e.to_string()))?
                }
            };
            Ok(q.bufs.insert(buf) as *mut c_void)
        },
    )
}

/// Frees a queue buffer. `-EBUSY`: it is lent to a request not yet reaped
/// (nothing changes); `-EINVAL`: not a buffer of this queue.
///
/// # Safety
/// `q` is an open queue, used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_buf_free(q: *mut iomapfs_queue, buf: *mut c_void) -> c_int {
    guard_int("iomapfs_queue_buf_free", || {
        // SAFETY: the caller's contract above.
        let q = unsafe { queue_mut(q) }?;
        let addr = buf as usize;
        match q.bufs.at(addr) {
            None => Err(Failure::invalid(format!(
                "{addr:#x} is not a buffer of this queue"
            ))),
            Some(entry) if entry.buf.is_none() => Err(Failure::new(
                libc::EBUSY,
                format!("queue buffer {addr:#x} is lent to a request not yet reaped"),
            )),
            Some(_) => {
                if let Some(buf) = q.bufs.remove(addr).and_then(|entry| entry.buf) {
                    q.q.unregister_buffer(buf);
                }
                Ok(0)
            }
        }
    })
}

/// Queues a read of `len` bytes at `offset` of `file` into `buf`, with the
/// caller's `token`. Sent to the device by `iomapfs_queue_submit` (or the
/// next reap). Returns 0, or `-errno` (the request was not queued and
/// `buf` is the caller's again): `-EBUSY` for a queue buffer already lent,
/// `-EXDEV` for a file of another volume.
///
/// # Safety
/// `q` is an open queue used by no other thread during the call; `file`
/// an open file; `buf` a queue buffer of at least `len` bytes, or memory
/// valid for writes of `len` bytes until the completion is reaped.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_read(
    q: *mut iomapfs_queue,
    file: *mut iomapfs_file,
    buf: *mut c_void,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    guard_int("iomapfs_queue_read", || {
        // SAFETY: the caller's contract above.
        let (q, f) = unsafe { (queue_mut(q)?, file_ref(file)?) };
        // SAFETY: `buf` as the contract says.
        unsafe { q.queue_io(f, buf, len, offset, token, false) }?;
        Ok(0)
    })
}

/// Queues a write of `len` bytes from `buf` at `offset` of `file`, with
/// the caller's `token`. As `iomapfs_queue_read`; memory that is not a
/// queue buffer is copied before this returns.
///
/// # Safety
/// `q` is an open queue used by no other thread during the call; `file`
/// an open file; `buf` a queue buffer of at least `len` bytes, or memory
/// valid for reads of `len` bytes during the call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_write(
    q: *mut iomapfs_queue,
    file: *mut iomapfs_file,
    buf: *const c_void,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    guard_int("iomapfs_queue_write", || {
        // SAFETY: the caller's contract above.
        let (q, f) = unsafe { (queue_mut(q)?, file_ref(file)?) };
        // SAFETY: `buf` as the contract says; the queue never writes
        // through a write request's pointer.
        unsafe { q.queue_io(f, buf.cast_mut(), len, offset, token, true) }?;
        Ok(0)
    })
}

/// Sends every queued request to the device; returns how many, or
/// `-errno`.
///
/// # Safety
/// `q` is an open queue, used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_submit(q: *mut iomapfs_queue) -> c_int {
    guard_int("iomapfs_queue_submit", || {
        // SAFETY: the caller's contract above.
        let q = unsafe { queue_mut(q) }?;
        let n = q.q.submit().map_err(|e| Failure::fs(&e))?;
        Ok(i32::try_from(n).unwrap_or(i32::MAX))
    })
}

/// Requests queued or in flight whose completions have not been returned
/// by `iomapfs_queue_reap` yet.
///
/// # Safety
/// `q` is an open queue, used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_in_flight(q: *mut iomapfs_queue) -> c_int {
    guard_int("iomapfs_queue_in_flight", || {
        // SAFETY: the caller's contract above.
        let q = unsafe { queue_mut(q) }?;
        Ok(i32::try_from(q.in_flight()).unwrap_or(i32::MAX))
    })
}

/// Reaps completions into `out` (room for `max`): waits until at least
/// `min` are available — or fewer, when fewer requests are in flight —
/// or until `timeout_ns` has passed (`< 0`: no limit, waits in the kernel;
/// `0`: does not wait; `> 0`: polls every 50 µs). Queued requests are sent
/// first. Returns the number stored (0 to `max`), or `-errno` if the queue
/// itself failed (completions reaped before the failure are returned by
/// the next call). A request's own failure is its completion's `result`;
/// the message of the last failed one stored is `iomapfs_last_error()`.
///
/// # Safety
/// `q` is an open queue used by no other thread during the call; `out`
/// points to writable room for `max` completions.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_queue_reap(
    q: *mut iomapfs_queue,
    min: u32,
    max: u32,
    out: *mut iomapfs_completion,
    timeout_ns: i64,
) -> c_int {
    guard_int("iomapfs_queue_reap", || {
        // SAFETY: the caller's contract above.
        let q = unsafe { queue_mut(q) }?;
        if min > max {
            return Err(Failure::invalid(format!("min {min} > max {max}")));
        }
        if max > 0 && out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        q.collect(min as usize, timeout_ns)?;
        let n = (max as usize).min(q.pending.len());
        let mut failed = None;
        for (i, (c, message)) in q.pending.drain(..n).enumerate() {
            // SAFETY: `out` has room for `max` completions and `i < n <=
            // max`.
            unsafe { out.add(i).write(c) };
            if message.is_some() {
                failed = message;
            }
        }
        if let Some(message) = failed {
            set_last_error(&format!("iomapfs_queue_reap: {message}"));
        }
        Ok(n as c_int)
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::ptr::{null, null_mut};

    use super::*;
    use crate::file::{iomapfs_file_close, iomapfs_file_open, iomapfs_pread};
    use crate::file::{IOMAPFS_O_CREAT, IOMAPFS_O_DIRECT};
    use crate::volume::{
        iomapfs_format, iomapfs_volume_close, iomapfs_volume_open, iomapfs_volume_options,
        IOMAPFS_BACKEND_URING,
    };

    fn registered(q: *mut iomapfs_queue, buf: *mut c_void) -> bool {
        // SAFETY: `q` is a live queue this test made and uses alone.
        let q = unsafe { &mut *q };
        let entry = q.bufs.at(buf as usize).expect("a queue buffer");
        entry.buf.as_ref().expect("held").is_registered()
    }

    /// On the io_uring backend, queue buffers are registered with the
    /// queue's ring, a zero-copy write and read through them move the right
    /// bytes, and a buffer allocated after a free is registered too. The lending
    /// checks are the C tests' (test_api.c), on this backend too.
    #[test]
    fn queue_buffers_are_registered_on_io_uring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let c_path = CString::new(path.to_str().unwrap()).unwrap();
        let opts = iomapfs_volume_options {
            backend: IOMAPFS_BACKEND_URING,
            cache_bytes: 0,
        };
        let (mut vol, mut file, mut q) = (null_mut(), null_mut(), null_mut());
        // SAFETY: a NUL-terminated path, NULL options, and `out` pointers to
        // live locals; every handle is used on this thread only and closed
        // below.
        unsafe {
            assert_eq!(iomapfs_format(c_path.as_ptr(), null()), 0);
            if iomapfs_volume_open(c_path.as_ptr(), &opts, &mut vol) != 0 {
                let why = std::ffi::CStr::from_ptr(crate::iomapfs_last_error());
                assert!(
                    std::env::var_os("IOMAPFS_REQUIRE_PRIVILEGED").is_none(),
                    "io_uring volume: {why:?}"
                );
                eprintln!("skipping: no io_uring volume here: {why:?}");
                return;
            }
            let name = CString::new("/data").unwrap();
            let flags = IOMAPFS_O_CREAT | IOMAPFS_O_DIRECT;
            assert_eq!(iomapfs_file_open(vol, name.as_ptr(), flags, &mut file), 0);
            assert_eq!(iomapfs_queue_create(vol, 4, &mut q), 0);
        }
        // SAFETY (this block and the next): `q`, `file` and `vol` are live
        // and this thread's; buffers are the queue's own, of 8192 bytes.
        unsafe {
            let first = iomapfs_queue_buf_alloc(q, 8192);
            assert!(registered(q, first));
            assert_eq!(iomapfs_queue_buf_free(q, first), 0);
            let buf = iomapfs_queue_buf_alloc(q, 8192);
            assert!(registered(q, buf), "allocated after a free");
            std::slice::from_raw_parts_mut(buf.cast::<u8>(), 8192).fill(0x3c);
            assert_eq!(iomapfs_queue_write(q, file, buf, 8192, 0, 7), 0);
            let mut done = [iomapfs_completion {
                token: 0,
                result: 0,
                buf: null_mut(),
                flags: 0,
            }];
            assert_eq!(iomapfs_queue_reap(q, 1, 1, done.as_mut_ptr(), -1), 1);
            assert_eq!((done[0].token, done[0].result, done[0].buf), (7, 8192, buf));
            let mut back = vec![0u8; 8192];
            assert_eq!(iomapfs_pread(file, back.as_mut_ptr().cast(), 8192, 0), 8192);
            assert!(back.iter().all(|&b| b == 0x3c));

            let other = iomapfs_queue_buf_alloc(q, 4096);
            assert!(registered(q, other));
            assert_eq!(iomapfs_queue_read(q, file, other, 4096, 4096, 8), 0);
            assert_eq!(iomapfs_queue_reap(q, 1, 1, done.as_mut_ptr(), -1), 1);
            assert_eq!((done[0].token, done[0].result), (8, 4096));
            let read = std::slice::from_raw_parts(other.cast::<u8>(), 4096);
            assert!(read.iter().all(|&b| b == 0x3c));
        }
        // SAFETY: as above; nothing is in flight.
        unsafe {
            assert_eq!(iomapfs_queue_destroy(q), 0);
            assert_eq!(iomapfs_file_close(file), 0);
            assert_eq!(iomapfs_volume_close(vol), 0);
        }
    }
}
