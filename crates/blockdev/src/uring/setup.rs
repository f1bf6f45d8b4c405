//! Setting up a ring, and finding out whether io_uring works here at all.
//!
//! io_uring may be missing, disabled by sysctl, restricted to a group, or
//! blocked by seccomp, and each needs a different remedy; so availability is
//! probed with a real ring and a real read, and the reason it fails is
//! named ([`UringUnavailable`]) for `--backend auto` to report.

use std::io;
use std::os::fd::AsRawFd;

use io_uring::{opcode, types, IoUring};

use crate::probe;
use crate::{AlignedBuf, BlockDevice, SyncDevice};

/// Index of the device descriptor in every ring's registered-file table.
pub(super) const DEVICE_FILE: types::Fixed = types::Fixed(0);

/// How often one request is resubmitted after `EINTR`/`EAGAIN` without
/// progress, and how often the ring may refuse to take entries, before the
/// error is reported: bounded so that a device that keeps saying "try
/// again" gives an error instead of a hang.
pub(super) const MAX_RETRIES: u32 = 16;

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
pub(super) fn errno_text(e: &io::Error) -> String {
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

/// Whether a ring may defer its completions to the one thread that uses it
/// (see [`build_ring`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RingUse {
    /// Any thread may submit and reap (one at a time).
    AnyThread,
    /// Only the thread that builds the ring submits, reaps and drops it.
    OneThread,
}

/// Sets up a ring of at least `entries` submission entries with `opts`,
/// registers `dev`'s descriptor as fixed file 0, and tells why not if it
/// cannot. Returns the ring and whether it defers completions: for
/// [`RingUse::OneThread`], `IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN`
/// where the kernel has them (6.1+), so a completion waits in the ring
/// until its thread asks for completions, and a thread waiting for `n` is
/// woken once when `n` are there, not once for each (without it, every
/// completion of a batch interrupts the waiting thread to post its entry).
pub(super) fn build_ring(
    dev: &SyncDevice,
    entries: u32,
    opts: UringOptions,
    ring_use: RingUse,
) -> Result<(IoUring, bool), UringUnavailable> {
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
    // SQPOLL submits from a kernel thread, which a single issuer excludes.
    let deferred = (ring_use == RingUse::OneThread && opts.sqpoll_idle_ms.is_none()).then(|| {
        let mut deferred = fast.clone();
        deferred.setup_single_issuer().setup_defer_taskrun();
        deferred
    });
    let refused = |e: &io::Error| e.raw_os_error() == Some(libc::EINVAL);
    let (ring, defers) = match deferred.map(|d| d.build(entries)) {
        Some(Ok(ring)) => (Ok(ring), true),
        Some(Err(e)) if !refused(&e) => (Err(e), false),
        _ => match fast.build(entries) {
            Err(e) if refused(&e) => (base.build(entries), false),
            other => (other, false),
        },
    };
    let ring = ring.map_err(setup_error)?;
    ring.submitter()
        .register_files(&[dev.file().as_raw_fd()])
        .map_err(UringUnavailable::Register)?;
    Ok((ring, defers))
}

/// Drops `ring`'s registered files synchronously, before the ring is closed.
///
/// Closing a ring tears it down in a kernel worker, some time later, and
/// only then drops the ring's reference to the registered device file. A
/// block device opened `O_EXCL` would stay claimed meanwhile, so reopening it
/// at once (the next command on the same device, a test) would fail with
/// `EBUSY`. Unregistering first releases the reference before this returns.
/// Only call with no request in flight. (A queue that gives up waiting for
/// its requests, and `check_uring` when its test read fails, skip this: the
/// claim then lasts until the kernel tears the ring down, which requests
/// that never complete can delay for good.)
pub(super) fn release_files(ring: &IoUring) {
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
    let (mut ring, _) = build_ring(dev, 2, opts, RingUse::AnyThread)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::attach_loop;
    use crate::SyncOpenOptions;

    /// A dropped queue leaves the device closed, not only unclaimed: a
    /// loop device detached right after goes at once (instead of lingering,
    /// marked autoclear, until the kernel's asynchronous teardown of the
    /// ring), and a zram device can be reset. No request is sent: one the
    /// kernel finished in one of its workers may be freed a little later,
    /// keeping the device open that long (an exclusive reopen waits that
    /// out; a detach or a zram reset right then does not).
    #[test]
    fn a_dropped_queue_leaves_the_device_closed() {
        let _serial = crate::test_support::serial();
        let Some((_image, lo)) = attach_loop(4 << 20) else {
            return;
        };
        let opened =
            crate::UringDevice::open(&lo.dev, SyncOpenOptions::default(), UringOptions::default());
        let dev = match opened {
            Ok(dev) => dev,
            // As `backend_choice`'s tests do: io_uring may be turned off.
            Err(e @ crate::DeviceError::Unusable { .. }) => {
                return eprintln!("skipping: no io_uring here: {e}")
            }
            Err(e) => panic!("{e}"),
        };
        let queue = dev.new_queue(4).unwrap();
        drop((queue, dev));
        let detached = lo.detach();
        assert!(detached.is_ok(), "{detached:?}");
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
