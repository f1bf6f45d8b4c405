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
//! entry can carry are sent in pieces.
//!
//! # Memory safety of in-flight buffers
//!
//! The kernel writes into (or reads from) a request's buffer at any time
//! between the submission entry being pushed and its completion entry being
//! posted. The argument that it never touches freed memory:
//!
//! 1. Every entry's buffer pointer points into the heap allocation of an
//!    [`AlignedBuf`] owned by the queue's in-flight table (`slots`), at the
//!    index the entry carries as `user_data`. Moving the `AlignedBuf` value
//!    (e.g. when the table grows) does not move its allocation.
//! 2. A slot is only emptied when the completion entry with its index is
//!    reaped (`UringQueue::complete`); only then is the buffer handed back to
//!    the caller or dropped. Nothing else removes or borrows the buffer while
//!    the slot is occupied.
//! 3. Dropping the queue first waits for every outstanding completion. If the
//!    kernel refuses to let it wait, the buffers are leaked, never freed: a
//!    leak is safe, a use after free is not.
//!
//! # Registered buffers
//!
//! With [`UringDevice::with_fixed_buffers`]`(count, len)`, each queue
//! allocates `count` buffers of `len` bytes (page-aligned, each a separate
//! [`AlignedBuf`] allocation) and registers them with its ring, one iovec
//! per buffer (`IORING_REGISTER_BUFFERS`). The kernel pins their pages
//! once, instead of per request. [`DeviceQueue::alloc_buffer`] hands them
//! out; each carries a crate-private tag `(ring id, table index)`. A read or
//! write whose buffer carries *this* ring's tag, and lies inside the region
//! registered at that index, goes out as `READ_FIXED`/`WRITE_FIXED`; every
//! other buffer (plain, bounced, another queue's) as plain `READ`/`WRITE`.
//!
//! Why the tag can be trusted, which is the whole problem (a buffer merely
//! *at* a registered address may be a new allocation on pinned pages the
//! kernel would write through behind Rust's back):
//!
//! - The tag is a private field of `AlignedBuf`, set only here, at
//!   registration. It moves with the allocation (moving or swapping the
//!   value moves both) and is never copied (`Clone` makes an untagged
//!   buffer). Each table index is handed out at most once at a time, so at
//!   most one live `AlignedBuf` carries a given `(ring, index)` and it owns
//!   exactly the registered allocation.
//! - A handed-out buffer is the caller's. [`DeviceQueue::recycle_buffer`]
//!   puts it back in the pool. Dropping it is an ordinary free; its table
//!   entry is then simply dead: no live buffer carries its tag, so no fixed
//!   entry ever names that index again, and the kernel's pinned pages behind
//!   it are never written or read (they are released at unregistration).
//!   The pool shrinks by one; that is the price of the simple design.
//! - The in-flight argument below is unchanged: a fixed entry's buffer is
//!   owned by the in-flight table until its completion, like a plain one.
//! - `Drop` waits for all in-flight entries, then unregisters the table,
//!   and only then do the pool's own buffers (fields) get freed.
//!
//! If registration fails (typically `ENOMEM` from `RLIMIT_MEMLOCK`), the
//! queue works without a pool: `alloc_buffer` returns `None` and
//! [`UringQueue::fixed_buffer_error`] says why.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, EnterFlags, IoUring};

use crate::aligned_buf::FixedTag;
use crate::error::IoOp;
use crate::probe;
use crate::queue::{clamp_depth, DeviceCompletion, DeviceQueue, DeviceRequest, QueueFull, Token};
use crate::{
    check_request, AlignedBuf, BlockDevice, DeviceCaps, DeviceCounters, DeviceError, SyncDevice,
    SyncOpenOptions, WriteMode,
};

/// Index of the device descriptor in every ring's registered-file table.
const DEVICE_FILE: types::Fixed = types::Fixed(0);

/// Most bytes one submission entry transfers. Its length field is 32 bits
/// and the kernel caps one transfer at `MAX_RW_COUNT` (2 GiB less a page)
/// anyway; longer requests continue like short transfers. A multiple of
/// every logical block size, so each piece stays aligned.
const MAX_BYTES_PER_ENTRY: usize = 1 << 30;

/// How often one request is resubmitted after `EINTR`/`EAGAIN` without
/// progress, and how often the ring may refuse to take entries, before the
/// error is reported: bounded so that a device that keeps saying "try
/// again" gives an error instead of a hang.
const MAX_RETRIES: u32 = 16;

/// Most entries a registered-buffer table holds (the kernel's
/// `IORING_MAX_REG_BUFFERS`).
const MAX_FIXED_BUFFERS: usize = 1 << 14;

/// Source of ring ids for registered-buffer tags: unique per queue for the
/// life of the process, so a tag never names another queue's table.
static NEXT_RING_ID: AtomicU64 = AtomicU64::new(1);

/// Per-queue pool of registered buffers (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedBufferOptions {
    /// Buffers per queue; 0 (the default) turns the pool off. At most
    /// 16384.
    pub count: usize,
    /// Bytes per buffer; 0 turns the pool off.
    pub len: usize,
}

/// Ring options. Both are off by default; each needs support the device
/// may not have, and costs CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringOptions {
    /// `IORING_SETUP_IOPOLL`: completions are busy-polled from the device
    /// instead of signalled by interrupt. Needs direct I/O and a driver with
    /// poll queues (e.g. NVMe with `poll_queues` set); elsewhere reads and
    /// writes complete with `EOPNOTSUPP`. A polled ring cannot fsync, so
    /// flushes run as `fdatasync` on the submitting thread at `submit`.
    pub iopoll: bool,
    /// `IORING_SETUP_SQPOLL` with this idle time in milliseconds: a kernel
    /// thread per ring picks up submissions, so `submit` rarely enters the
    /// kernel, at the cost of a CPU spinning while the ring is busy. Pushed
    /// requests may then start before `submit`.
    pub sqpoll_idle_ms: Option<u32>,
}

/// Why io_uring cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum UringUnavailable {
    #[error("io_uring disabled (kernel.io_uring_disabled=2)")]
    Disabled,
    #[error(
        "io_uring restricted to kernel.io_uring_group (kernel.io_uring_disabled=1) and \
         io_uring_setup failed: {}",
        errno_text(.0)
    )]
    Restricted(io::Error),
    #[error("io_uring_setup failed: EPERM (seccomp?)")]
    Denied,
    #[error("kernel has no io_uring (io_uring_setup: ENOSYS)")]
    NotBuilt,
    #[error("io_uring_setup failed: {}", errno_text(.0))]
    Setup(io::Error),
    #[error("registering the device with io_uring failed: {}", errno_text(.0))]
    Register(io::Error),
    #[error("a test read through io_uring failed: {}", errno_text(.0))]
    Broken(io::Error),
}

/// `EPERM (Operation not permitted)`: the symbolic name a user can search
/// for, then the description.
fn errno_text(e: &io::Error) -> String {
    let name = match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM",
        Some(libc::ENOSYS) => "ENOSYS",
        Some(libc::ENOMEM) => "ENOMEM",
        Some(libc::EINVAL) => "EINVAL",
        Some(libc::EMFILE) => "EMFILE",
        Some(libc::ENFILE) => "ENFILE",
        Some(libc::EFAULT) => "EFAULT",
        Some(libc::EBADF) => "EBADF",
        Some(libc::EAGAIN) => "EAGAIN",
        Some(libc::EOPNOTSUPP) => "EOPNOTSUPP",
        Some(libc::EIO) => "EIO",
        _ => return e.to_string(),
    };
    let text = e.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text);
    format!("{name} ({text})")
}

/// Sets up a ring of at least `entries` submission entries with `opts`,
/// registers `dev`'s descriptor as fixed file 0, and tells why not if it
/// cannot.
fn build_ring(
    dev: &SyncDevice,
    entries: u32,
    opts: UringOptions,
) -> Result<IoUring, UringUnavailable> {
    let mut base = IoUring::builder();
    if opts.iopoll {
        base.setup_iopoll();
    }
    if let Some(idle) = opts.sqpoll_idle_ms {
        base.setup_sqpoll(idle);
    }
    // Cheaper completions (no interrupting the task for each one; it runs
    // them when it next enters the kernel, and the TASKRUN flag tells us when
    // that is due) and a submit that does not stop at the first bad entry.
    // Linux 5.19+; older kernels refuse the flags, so retry without.
    let mut fast = base.clone();
    fast.setup_coop_taskrun()
        .setup_taskrun_flag()
        .setup_submit_all();
    let ring = match fast.build(entries) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => base.build(entries),
        other => other,
    }
    .map_err(setup_error)?;
    ring.submitter()
        .register_files(&[dev.file().as_raw_fd()])
        .map_err(UringUnavailable::Register)?;
    Ok(ring)
}

/// Drops `ring`'s registered files synchronously, before the ring is closed.
///
/// Closing a ring tears it down in a kernel worker, some time later, and
/// only then drops the ring's reference to the registered device file. A
/// block device opened `O_EXCL` would stay claimed meanwhile, so reopening it
/// at once (the next command on the same device, a test) would fail with
/// `EBUSY`. Unregistering first releases the reference before this returns.
/// Only call with no request in flight.
fn release_files(ring: &IoUring) {
    // Failure leaves the reference to the asynchronous teardown: the device
    // is released a little later, which is all that is lost.
    let _ = ring.submitter().unregister_files();
}

fn setup_error(e: io::Error) -> UringUnavailable {
    match (e.raw_os_error(), probe::io_uring_disabled()) {
        (_, Some(2)) => UringUnavailable::Disabled,
        (Some(libc::EPERM), Some(1)) => UringUnavailable::Restricted(e),
        (Some(libc::EPERM), _) => UringUnavailable::Denied,
        (Some(libc::ENOSYS), _) => UringUnavailable::NotBuilt,
        _ => UringUnavailable::Setup(e),
    }
}

/// Checks that io_uring works on `dev` with `opts`: a ring can be set up,
/// the descriptor registered, and one logical block read through it. The
/// read is not counted in the device's counters.
pub fn check_uring(dev: &SyncDevice, opts: UringOptions) -> Result<(), UringUnavailable> {
    if probe::io_uring_disabled() == Some(2) {
        return Err(UringUnavailable::Disabled);
    }
    let mut ring = build_ring(dev, 2, opts)?;
    let caps = dev.caps();
    let len = caps.logical_block_size as usize;
    let align = caps.memory_alignment.max(caps.logical_block_size) as usize;
    let mut buf = AlignedBuf::new(len, align)
        .map_err(|e| UringUnavailable::Broken(io::Error::new(io::ErrorKind::OutOfMemory, e)))?;
    let read = opcode::Read::new(DEVICE_FILE, buf.as_mut_ptr(), len as u32)
        .offset(0)
        .build()
        .user_data(0);
    // SAFETY: the entry points at `buf`'s `len` bytes. `buf` is only dropped
    // at the end of this function after the loop below has reaped the
    // entry's completion, or leaked (`mem::forget`) if it could not be
    // reaped, so the kernel never writes into freed memory. Fixed file 0 was
    // registered by `build_ring`.
    unsafe { ring.submission().push(&read) }
        .map_err(|_| UringUnavailable::Broken(io::Error::other("submission queue full")))?;
    let mut failures = 0;
    let res = loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => {
                failures += 1;
                if failures > MAX_RETRIES {
                    std::mem::forget(buf);
                    return Err(UringUnavailable::Broken(e));
                }
            }
        }
        if let Some(cqe) = ring.completion().next() {
            break cqe.result();
        }
    };
    drop(buf);
    release_files(&ring);
    match res {
        n if n >= 0 => Ok(()),
        n => Err(UringUnavailable::Broken(io::Error::from_raw_os_error(-n))),
    }
}

/// A block device or image file whose asynchronous queues use io_uring.
/// Synchronous calls go through the [`SyncDevice`] it wraps.
#[derive(Debug)]
pub struct UringDevice {
    sync: Arc<SyncDevice>,
    opts: UringOptions,
    fixed: FixedBufferOptions,
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
        UringDevice {
            sync,
            opts,
            fixed: FixedBufferOptions::default(),
        }
    }

    /// Gives every queue made from now on a pool of `count` registered
    /// buffers of `len` bytes (see the module docs); `0` for either turns
    /// pools off (the default).
    pub fn with_fixed_buffers(mut self, count: usize, len: usize) -> UringDevice {
        self.fixed = FixedBufferOptions { count, len };
        self
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
        UringQueue::new(Arc::clone(&self.sync), depth, self.opts, self.fixed)
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

    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        Ok(Some(Box::new(self.new_queue(depth)?)))
    }

    fn backend_name(&self) -> &'static str {
        "uring"
    }
}

/// One request the kernel may be working on.
struct InFlight {
    token: Token,
    op: Op,
    /// Bytes transferred so far (short transfers are continued).
    done: usize,
    /// Resubmissions after `EINTR`/`EAGAIN` without progress.
    retries: u32,
}

enum Op {
    Read {
        offset: u64,
        buf: AlignedBuf,
        /// Aligned stand-in for a `buf` whose memory is misaligned for
        /// direct I/O; copied into `buf` at completion.
        bounce: Option<AlignedBuf>,
        /// Registered-buffer index of `buf` in this ring's table, checked by
        /// `UringQueue::fixed_index` (never set with a bounce).
        fixed: Option<u16>,
    },
    Write {
        offset: u64,
        buf: AlignedBuf,
        /// Aligned copy of a misaligned `buf`.
        bounce: Option<AlignedBuf>,
        fua: bool,
        /// As for reads.
        fixed: Option<u16>,
    },
    Flush,
}

impl InFlight {
    /// The submission entry for the rest of this request, tagged with its
    /// slot `index`.
    fn entry(&mut self, index: usize) -> squeue::Entry {
        let done = self.done;
        let entry = match &mut self.op {
            Op::Read {
                offset,
                buf,
                bounce,
                fixed,
            } => {
                let target = bounce.as_mut().unwrap_or(buf);
                let rest = &mut target[done..];
                let len = rest.len().min(MAX_BYTES_PER_ENTRY) as u32;
                let at = *offset + done as u64;
                match fixed {
                    // The piece lies inside `buf`, which lies inside the
                    // region registered at `index`.
                    Some(index) => {
                        opcode::ReadFixed::new(DEVICE_FILE, rest.as_mut_ptr(), len, *index)
                            .offset(at)
                            .build()
                    }
                    None => opcode::Read::new(DEVICE_FILE, rest.as_mut_ptr(), len)
                        .offset(at)
                        .build(),
                }
            }
            Op::Write {
                offset,
                buf,
                bounce,
                fua,
                fixed,
            } => {
                let source = bounce.as_ref().unwrap_or(buf);
                let rest = &source[done..];
                let len = rest.len().min(MAX_BYTES_PER_ENTRY) as u32;
                let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                let at = *offset + done as u64;
                match fixed {
                    Some(index) => opcode::WriteFixed::new(DEVICE_FILE, rest.as_ptr(), len, *index)
                        .offset(at)
                        .rw_flags(flags)
                        .build(),
                    None => opcode::Write::new(DEVICE_FILE, rest.as_ptr(), len)
                        .offset(at)
                        .rw_flags(flags)
                        .build(),
                }
            }
            Op::Flush => opcode::Fsync::new(DEVICE_FILE)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        entry.user_data(index as u64)
    }

    /// Kind and device offset of a read or write; `None` for a flush.
    fn target(&self) -> Option<(IoOp, u64)> {
        match &self.op {
            Op::Read { offset, .. } => Some((IoOp::Read, *offset)),
            Op::Write { offset, .. } => Some((IoOp::Write, *offset)),
            Op::Flush => None,
        }
    }

    fn io_len(&self) -> usize {
        match &self.op {
            Op::Read { buf, .. } | Op::Write { buf, .. } => buf.len(),
            Op::Flush => 0,
        }
    }
}

/// What one completion entry means for its request.
enum Outcome {
    Done(Result<usize, DeviceError>),
    /// Not finished: send the rest again.
    Resubmit,
}

/// A [`DeviceQueue`] with its own io_uring (see the module docs).
pub struct UringQueue {
    ring: IoUring,
    dev: Arc<SyncDevice>,
    depth: usize,
    iopoll: bool,
    sqpoll: bool,
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
    /// Scratch: completion entries copied out of the ring.
    cqes: Vec<(u64, i32)>,
    /// Registered buffers (see the module docs, "Registered buffers").
    pool: FixedPool,
}

/// A queue's registered-buffer table and the buffers of it not handed out.
struct FixedPool {
    /// Tags of this ring's buffers carry this id; unique per queue.
    ring_id: u64,
    /// `(address, length)` registered at each table index; empty when the
    /// queue has no pool.
    regions: Vec<(usize, usize)>,
    /// Buffers of the table that are neither handed out nor in flight.
    /// Declared after `ring` in `UringQueue`, but freed only after `Drop`
    /// unregistered the table, whatever the field order.
    free: Vec<AlignedBuf>,
    /// Why the configured pool could not be registered.
    error: Option<String>,
    /// Entries sent with `READ_FIXED`/`WRITE_FIXED`.
    fixed_entries: u64,
}

impl FixedPool {
    fn none() -> FixedPool {
        FixedPool {
            ring_id: NEXT_RING_ID.fetch_add(1, Ordering::Relaxed),
            regions: Vec::new(),
            free: Vec::new(),
            error: None,
            fixed_entries: 0,
        }
    }

    /// Allocates `opts.count` buffers and registers them with `ring`.
    fn register(ring: &IoUring, caps: &DeviceCaps, opts: FixedBufferOptions) -> FixedPool {
        let mut pool = FixedPool::none();
        if opts.count == 0 || opts.len == 0 {
            return pool;
        }
        let count = opts.count.min(MAX_FIXED_BUFFERS);
        // Page-aligned, so each buffer pins only its own pages and never
        // needs a bounce.
        let align = (caps.memory_alignment.max(caps.logical_block_size) as usize).max(4096);
        let mut bufs = Vec::with_capacity(count);
        for _ in 0..count {
            match AlignedBuf::new(opts.len, align) {
                Ok(buf) => bufs.push(buf),
                Err(e) => {
                    pool.error = Some(e.to_string());
                    return pool;
                }
            }
        }
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: each iovec is the whole of a live allocation owned by
        // `bufs`. From here on the kernel touches those pages only for a
        // READ_FIXED/WRITE_FIXED entry naming the index, and such an entry
        // is only pushed for a buffer that carries this ring's tag for that
        // index and is owned by the in-flight table until its completion
        // (module docs): the memory is live and exclusively the kernel's
        // for the transfer. A tagged buffer the caller dropped is never
        // named again; its pages stay pinned by the kernel, not accessed,
        // until `Drop` unregisters the table.
        if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
            pool.error = Some(format!(
                "registering {count} buffers of {} bytes failed: {}",
                opts.len,
                errno_text(&e)
            ));
            return pool;
        }
        for (index, buf) in bufs.iter_mut().enumerate() {
            pool.regions.push((buf.as_ptr() as usize, buf.len()));
            buf.set_fixed_tag(Some(FixedTag {
                ring_id: pool.ring_id,
                index: index as u16,
            }));
        }
        // Hand out low indexes first.
        bufs.reverse();
        pool.free = bufs;
        pool
    }

    /// The table index to name for `buf`, if it is one of this ring's
    /// registered buffers and lies inside the region registered for it.
    fn index_of(&self, buf: &AlignedBuf) -> Option<u16> {
        let tag = buf.fixed_tag()?;
        if tag.ring_id != self.ring_id {
            return None;
        }
        let &(base, len) = self.regions.get(tag.index as usize)?;
        let start = buf.as_ptr() as usize;
        let inside = start >= base && start.checked_add(buf.len())? <= base + len;
        inside.then_some(tag.index)
    }
}

impl UringQueue {
    fn new(
        dev: Arc<SyncDevice>,
        depth: usize,
        opts: UringOptions,
        fixed: FixedBufferOptions,
    ) -> Result<UringQueue, DeviceError> {
        let depth = clamp_depth(depth);
        // The kernel rounds up to a power of two itself; `depth` entries is
        // enough because an entry is only ever pushed for an occupied slot
        // and at most `depth` slots are occupied. The completion ring is
        // twice that, so it cannot overflow either.
        let ring = build_ring(&dev, depth as u32, opts).map_err(|why| DeviceError::Unusable {
            path: dev.path().to_owned(),
            reason: format!("cannot make an io_uring queue of depth {depth}: {why}"),
        })?;
        let pool = FixedPool::register(&ring, dev.caps(), fixed);
        Ok(UringQueue {
            ring,
            dev,
            depth,
            iopoll: opts.iopoll,
            sqpoll: opts.sqpoll_idle_ms.is_some(),
            slots: Vec::with_capacity(depth),
            free: Vec::with_capacity(depth),
            live: 0,
            ready: Vec::with_capacity(depth),
            polled_flushes: Vec::new(),
            unsubmitted: 0,
            resubmitted: false,
            cqes: Vec::with_capacity(depth),
            pool,
        })
    }

    /// Registered buffers in this queue's table (0 without a pool).
    pub fn fixed_buffers(&self) -> usize {
        self.pool.regions.len()
    }

    /// Submission entries sent so far as `READ_FIXED`/`WRITE_FIXED`.
    pub fn fixed_entries(&self) -> u64 {
        self.pool.fixed_entries
    }

    /// Why a configured pool is missing (registration failed), if it is.
    pub fn fixed_buffer_error(&self) -> Option<&str> {
        self.pool.error.as_deref()
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

    /// Puts `request` in a free slot and pushes its entry.
    fn start(&mut self, token: Token, op: Op) {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let mut request = InFlight {
            token,
            op,
            done: 0,
            retries: 0,
        };
        let entry = request.entry(index);
        if matches!(
            request.op,
            Op::Read { fixed: Some(_), .. } | Op::Write { fixed: Some(_), .. }
        ) {
            self.pool.fixed_entries += 1;
        }
        self.slots[index] = Some(request);
        self.live += 1;
        self.unsubmitted += 1;
        self.push_entry(index, &entry);
    }

    /// Pushes the entry for occupied slot `index`.
    fn push_entry(&mut self, index: usize, entry: &squeue::Entry) {
        // SAFETY: `entry` was built by `InFlight::entry` for the request in
        // `self.slots[index]`, so its buffer pointer (if any) points into an
        // `AlignedBuf` owned by that slot, and `len` stays inside it. The
        // slot stays occupied, with that buffer neither moved out, dropped
        // nor borrowed, until `complete` handles the completion entry tagged
        // `index`; `Drop` waits for that completion or leaks the buffer (see
        // the module docs). The descriptor is fixed file 0 of this ring,
        // which holds its own reference to the open file.
        let pushed = unsafe { self.ring.submission().push(entry) };
        if pushed.is_err() {
            // Cannot happen: the ring has at least `depth` entries and each
            // occupied slot has at most one entry queued. Fail the request
            // rather than lose it.
            let Some(request) = self.slots[index].take() else {
                return;
            };
            self.live -= 1;
            self.free.push(index);
            let source = io::Error::other("io_uring submission queue unexpectedly full");
            let err = match request.target() {
                Some((op, offset)) => io_error(op, offset, request.io_len(), source),
                None => DeviceError::Flush { source },
            };
            let completion = into_completion(request, Err(err));
            self.ready.push(completion);
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
        for &(index, res) in &cqes {
            self.complete(index as usize, res);
        }
        self.cqes = cqes;
    }

    /// The kernel is done with the entry for slot `index`, with result `res`.
    fn complete(&mut self, index: usize, res: i32) {
        let Some(mut request) = self.slots.get_mut(index).and_then(Option::take) else {
            // Not ours (cannot happen: every entry is tagged with an
            // occupied slot). Nothing to hand back.
            return;
        };
        match outcome(&mut request, res) {
            Outcome::Resubmit => {
                let entry = request.entry(index);
                self.slots[index] = Some(request);
                self.push_entry(index, &entry);
                self.resubmitted = true;
            }
            Outcome::Done(result) => {
                self.live -= 1;
                self.free.push(index);
                let completion = into_completion(request, result);
                self.ready.push(completion);
            }
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

/// Interprets the result of the entry just completed for `request`.
fn outcome(request: &mut InFlight, res: i32) -> Outcome {
    let Some((op, offset)) = request.target() else {
        return Outcome::Done(if res < 0 {
            Err(DeviceError::Flush {
                source: io::Error::from_raw_os_error(-res),
            })
        } else {
            Ok(0)
        });
    };
    let len = request.io_len();
    if res < 0 {
        let errno = -res;
        if matches!(errno, libc::EINTR | libc::EAGAIN) && request.retries < MAX_RETRIES {
            request.retries += 1;
            return Outcome::Resubmit;
        }
        let source = io::Error::from_raw_os_error(errno);
        return Outcome::Done(Err(io_error(op, offset, len, source)));
    }
    if res == 0 {
        // End of file: the image shrank under us. Reported, not looped on.
        return Outcome::Done(Err(DeviceError::Short {
            op,
            offset,
            len: len as u64,
            done: request.done as u64,
        }));
    }
    request.done += res as usize;
    request.retries = 0;
    if request.done < len {
        Outcome::Resubmit
    } else {
        Outcome::Done(Ok(len))
    }
}

fn io_error(op: IoOp, offset: u64, len: usize, source: io::Error) -> DeviceError {
    DeviceError::Io {
        op,
        offset,
        len: len as u64,
        source,
    }
}

/// Hands a finished request's buffer back, copying a bounced read into it.
fn into_completion(request: InFlight, result: Result<usize, DeviceError>) -> DeviceCompletion {
    let buf = match request.op {
        Op::Read {
            mut buf, bounce, ..
        } => {
            if let (Some(bounce), Ok(_)) = (bounce, &result) {
                buf.copy_from_slice(&bounce);
            }
            Some(buf)
        }
        Op::Write { buf, .. } => Some(buf),
        Op::Flush => None,
    };
    DeviceCompletion {
        token: request.token,
        result,
        buf,
    }
}

impl DeviceQueue for UringQueue {
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
        match request {
            DeviceRequest::Read { offset, buf } => {
                if let Err(e) = check_request(self.dev.caps(), offset, buf.len()) {
                    self.finish_now(token, Err(e), Some(buf));
                    return Ok(());
                }
                self.dev.counters().record_read(buf.len());
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
                if let Err(e) = check_request(self.dev.caps(), offset, buf.len()) {
                    self.finish_now(token, Err(e), Some(buf));
                    return Ok(());
                }
                if self.dev.is_read_only() {
                    let err = DeviceError::ReadOnly {
                        path: self.dev.path().to_owned(),
                        offset,
                        len: buf.len() as u64,
                    };
                    self.finish_now(token, Err(err), Some(buf));
                    return Ok(());
                }
                let fua = mode == WriteMode::Fua;
                self.dev.counters().record_write(buf.len(), fua);
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
                self.dev.counters().record_flush();
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
        let at = self.pool.free.iter().rposition(|b| b.capacity() >= len)?;
        let mut buf = self.pool.free.swap_remove(at);
        buf.reset_zeroed(len);
        Some(buf)
    }

    fn recycle_buffer(&mut self, buf: AlignedBuf) {
        // Only this ring's own buffers, whole (as registered), go back.
        if self.pool.index_of(&buf).is_some() {
            let index = buf.fixed_tag().map_or(0, |t| t.index as usize);
            if self.pool.regions[index].0 == buf.as_ptr() as usize {
                self.pool.free.push(buf);
            }
        }
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
            for &(index, _) in &cqes {
                // The kernel is done with this entry, so its buffers may go.
                if let Some(request) = self.slots.get_mut(index as usize).and_then(Option::take) {
                    self.live -= 1;
                    drop(request);
                }
            }
            self.cqes = cqes;
        }
        // Nothing is in flight: unregister the buffer table before the pool's
        // buffers (fields, dropped after this) are freed.
        if !self.pool.regions.is_empty() {
            let _ = self.ring.submitter().unregister_buffers();
        }
        release_files(&self.ring);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

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

    #[test]
    fn unavailability_reasons_name_the_cause() {
        assert_eq!(
            UringUnavailable::Disabled.to_string(),
            "io_uring disabled (kernel.io_uring_disabled=2)"
        );
        if probe::io_uring_disabled().unwrap_or(0) != 0 {
            return eprintln!("skipping the errno mapping: io_uring is restricted here");
        }
        let denied = setup_error(io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(
            denied.to_string(),
            "io_uring_setup failed: EPERM (seccomp?)"
        );
        let missing = setup_error(io::Error::from_raw_os_error(libc::ENOSYS));
        assert!(matches!(missing, UringUnavailable::NotBuilt), "{missing}");
        let other = setup_error(io::Error::from_raw_os_error(libc::ENOMEM));
        assert!(
            other
                .to_string()
                .starts_with("io_uring_setup failed: ENOMEM"),
            "{other}"
        );
    }

    #[test]
    fn errno_text_names_common_errors() {
        let e = io::Error::from_raw_os_error(libc::EPERM);
        assert_eq!(errno_text(&e), "EPERM (Operation not permitted)");
        let e = io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(errno_text(&e).contains("No space left"));
    }
}
