//! FUSE over io_uring on this machine, for the mount's transport
//! ([`crate::ring_transport`]) and the transport probe alike: the kernel
//! knob that admits queue registrations (taken in turns), the possible
//! CPUs (one queue each), the queue commands (REGISTER, COMMIT_AND_FETCH)
//! and their ring entries' buffers, pinning a queue thread to its CPU,
//! the end of a queue, and a connection's fusectl number and abort.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use blockdev::{AlignedBuf, AlignedBufError};
use io_uring::{opcode, squeue, types};

use crate::fuse_wire::uring;

/// The kernel knob that lets FUSE servers register io_uring queues.
pub const ENABLE_URING_KNOB: &str = "/sys/module/fuse/parameters/enable_uring";

/// `/sys/module/fuse/parameters/enable_uring` set on for a while.
pub struct UringKnob {
    before: String,
    /// Held (flock) while the knob is ours: another process's knob put
    /// back early would turn the kernel's registrations away under us.
    _turn: std::fs::File,
}

/// Where the processes that turn the knob take turns (flock).
pub fn knob_lock_path() -> PathBuf {
    let run = Path::new("/run/lock");
    let dir = if run.is_dir() {
        run.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    dir.join("iomapfs-fuse-enable-uring.lock")
}

impl UringKnob {
    /// What the knob said before (`Y` or `N`).
    pub fn before(&self) -> &str {
        &self.before
    }

    /// Turns the knob on, after any other process of ours that has it
    /// (they take turns on a lock file); it goes back to its old value on
    /// drop. An error of kind `NotFound` means the kernel has no FUSE
    /// over io_uring.
    pub fn enable() -> io::Result<UringKnob> {
        let path = knob_lock_path();
        let turn = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| with_what(e, format!("opening {}", path.display())))?;
        // SAFETY: flock on a descriptor we own; blocks until our turn.
        if unsafe { libc::flock(turn.as_raw_fd(), libc::LOCK_EX) } != 0 {
            let e = io::Error::last_os_error();
            return Err(with_what(e, format!("locking {}", path.display())));
        }
        let before = std::fs::read_to_string(ENABLE_URING_KNOB)
            .map_err(|e| with_what(e, format!("reading {ENABLE_URING_KNOB}")))?
            .trim()
            .to_string();
        if before != "Y" {
            std::fs::write(ENABLE_URING_KNOB, "1")
                .map_err(|e| with_what(e, format!("writing 1 to {ENABLE_URING_KNOB}")))?;
        }
        Ok(UringKnob {
            before,
            _turn: turn,
        })
    }
}

impl Drop for UringKnob {
    fn drop(&mut self) {
        if self.before != "Y" {
            let _ = std::fs::write(ENABLE_URING_KNOB, "0");
        }
    }
}

/// Number of possible CPUs: the kernel makes one io_uring queue for each
/// and routes a request to the queue of the CPU its caller runs on.
pub fn possible_cpus() -> io::Result<usize> {
    let path = "/sys/devices/system/cpu/possible";
    let text =
        std::fs::read_to_string(path).map_err(|e| with_what(e, format!("reading {path}")))?;
    let mut count = 0;
    for range in text.trim().split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        match (lo.parse::<usize>(), hi.parse::<usize>()) {
            (Ok(lo), Ok(hi)) if hi >= lo => count += hi - lo + 1,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("parsing {path}: {text:?}"),
                ))
            }
        }
    }
    Ok(count)
}

/// Builds a FUSE uring command SQE: `fuse_uring_cmd_req` (flags,
/// commit_id, qid) in the 80-byte command area; REGISTER also points
/// `addr`/`len` at the entry's two iovecs.
pub(crate) fn command(
    fd: RawFd,
    cmd_op: u32,
    commit_id: u64,
    qid: u16,
    iov: Option<&[libc::iovec; 2]>,
    user_data: u64,
) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    let mut op = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
    if let Some(iov) = iov {
        op = op.addr(Some(iov.as_ptr() as u64));
    }
    let entry = op.build().user_data(user_data);
    match iov {
        Some(iov) => with_sqe_len(entry, iov.len() as u32),
        None => entry,
    }
}

/// Sets the SQE's `len` field, which `UringCmd80` (io-uring 0.7) has no
/// setter for and FUSE's REGISTER requires (the iovec count, 2).
fn with_sqe_len(entry: squeue::Entry128, len: u32) -> squeue::Entry128 {
    /// Offset of `len` in `struct io_uring_sqe` (opcode, flags, ioprio,
    /// fd, off, addr, then len): kernel ABI.
    const SQE_LEN_OFFSET: usize = 24;
    // SAFETY: `Entry128` is `#[repr(C)]` around the kernel's 64-byte
    // `io_uring_sqe` (itself `#[repr(C)]` plain integers with no padding)
    // followed by `[u8; 64]`: 128 bytes (the crate asserts the size), all
    // initialised, with no invalid bit patterns either way; the bytes are
    // the SQE128 the kernel reads.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
    raw[SQE_LEN_OFFSET..SQE_LEN_OFFSET + 4].copy_from_slice(&len.to_le_bytes());
    // SAFETY: as above, in the other direction.
    unsafe { std::mem::transmute(raw) }
}

/// Whether a queue command's failure `result` (a negated errno) is the
/// connection going away (unmount, abort), the normal end of a queue.
pub(crate) fn connection_ended(result: i32) -> bool {
    matches!(
        -result,
        libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV
    )
}

pub(crate) fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // within it (cpu < CPU_SETSIZE is checked); sched_setaffinity reads
    // it. Failing to pin is not an error: the queue then serves from
    // wherever it runs, which the report's figures reflect.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// The FUSE connection number of the mount at `dir` (its device minor,
/// the name of its fusectl directory), from /proc/self/mountinfo, which
/// unlike stat(2) never waits for the server.
pub fn connection_of(dir: &Path) -> Option<u32> {
    let mount = crate::mountinfo::mount_at(dir).ok()??;
    Some(mount.device.1)
}

/// Aborts FUSE connection `id` through fusectl: at
/// /sys/fs/fuse/connections when it is mounted there, else through a
/// private fusectl mount made for the write.
pub fn abort_connection(id: u32) {
    let standard = format!("/sys/fs/fuse/connections/{id}/abort");
    if std::fs::write(&standard, "1").is_ok() {
        return;
    }
    let Ok(dir) = fresh_dir(&std::env::temp_dir(), "iomapfs-fusectl") else {
        return;
    };
    let target = CString::new(dir.as_os_str().as_bytes()).expect("no NUL in path");
    let fusectl = c"fusectl";
    // SAFETY: valid C strings; no mount data.
    let rc = unsafe {
        libc::mount(
            fusectl.as_ptr(),
            target.as_ptr(),
            fusectl.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        let _ = std::fs::write(dir.join(id.to_string()).join("abort"), "1");
        // SAFETY: as above.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_dir(&dir);
}

/// A new directory under `parent`, named `prefix-PID-N`.
pub(crate) fn fresh_dir(parent: &Path, prefix: &str) -> io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("{prefix}-{}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(with_what(e, format!("making {}", dir.display()))),
        }
    }
}

/// `e` saying what failed, its kind kept.
fn with_what(e: io::Error, what: String) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A queue entry's buffers: the request header area, the payload (page
/// aligned, so a direct read can land in it), and the two as the iovec
/// array REGISTER names (kept for the entry's life in case the kernel
/// reads it late).
pub(crate) struct EntryBuffers {
    pub header: Box<[u8; uring::REQ_HEADER_LEN]>,
    pub payload: AlignedBuf,
    pub iov: [libc::iovec; 2],
}

impl EntryBuffers {
    pub fn new(payload_len: usize, align: usize) -> Result<EntryBuffers, AlignedBufError> {
        let mut header = Box::new([0u8; uring::REQ_HEADER_LEN]);
        let mut payload = AlignedBuf::new(payload_len, align)?;
        let iov = [
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ];
        Ok(EntryBuffers {
            header,
            payload,
            iov,
        })
    }
}
