//! `iomapfs mount -o uring`: the mount served over FUSE over io_uring.
//!
//! Why: a request over `/dev/fuse` wakes whichever daemon thread waits,
//! usually on another CPU; where waking an idle CPU is dear (a VM whose
//! idle vCPUs halt), that costs more than the request's own work. FUSE
//! over io_uring queues a request on the queue of the CPU its caller runs
//! on, and each queue here is served by a thread pinned to that CPU, so
//! the caller and the server hand over on one CPU
//! (`iomapfs fuse-transport-probe` measures both transports bare).
//!
//! How: READ and WRITE, the requests that move data, are answered by the
//! queue threads themselves: a read lands straight in the ring entry's
//! payload buffer (aligned, so a direct read takes the device's bytes
//! with no copy), a write is taken from it. Every other request is handed
//! to fuser's threads, unchanged, over a `SOCK_SEQPACKET` socket pair that
//! stands in for `/dev/fuse` (fuser's `Session::from_fd`); its reply comes
//! back on the socket and is committed to the ring entry the request came
//! in. What the kernel still sends over `/dev/fuse` (INIT, FORGET,
//! INTERRUPT, and everything before the queues are registered) is relayed
//! to fuser the same way, and the replies go back to `/dev/fuse`. The one
//! change to what fuser says: its INIT reply gains `FUSE_OVER_IO_URING`.
//!
//! Threads: `iomapfs-fuse-relay` (reads `/dev/fuse`, sends to fuser),
//! `iomapfs-fuse-router` (reads fuser's replies, routes them by request
//! id), `iomapfs-ring-N` (queue N, pinned to CPU N), and fuser's own.
//! When the connection ends (unmount or abort) the relay sends fuser's
//! threads one DESTROY each, which ends them; the router then sees the
//! socket close and tells the queues to stop once the kernel has ended
//! their commands.
//!
//! Failures: a thread of ours that fails before the connection ends (a
//! queue, the relay, the router, fuser's) aborts the connection through
//! fusectl, so callers get ENOTCONN as after a daemon crash instead of
//! waiting on a queue nobody serves; a mount that fails to start aborts,
//! unmounts and waits for every thread it started.
//!
//! `-o uring_idle` runs the queue threads at `SCHED_IDLE`: the scheduler
//! places a task it wakes on an idle CPU, and a CPU running only
//! idle-class threads counts as idle, so a caller woken by its queue
//! thread stays on its own CPU instead of moving to the other, idle one
//! (where the next request then goes). The price: on a CPU busy with
//! other programs the queue thread gets almost no time.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use blockdev::AlignedBuf;
use fuser::{BackgroundSession, Config, FileHandle, Session, SessionACL, WriteFlags};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use parking_lot::Mutex;

use crate::config::{MountConfig, MountError, FS_SUBTYPE};
use crate::fuse_fs::{IomapFuse, MAX_IO_BYTES};
use crate::fuse_uring::{
    abort_connection, command, connection_ended, connection_of, pin_to_cpu, possible_cpus,
    EntryBuffers, UringKnob,
};
use crate::fuse_wire::{self as wire, get_u32, get_u64, put_u32, uring};
use crate::unmount::unmount;

/// Ring entries per queue: requests one CPU's queue holds at once (more
/// wait in the kernel). Each has a payload buffer of the largest request.
pub const QUEUE_ENTRIES: usize = 4;

/// How long the kernel may take to send INIT and accept fuser's reply.
const INIT_TIMEOUT: Duration = Duration::from_secs(10);

/// `fuse_init_in.flags2` / `fuse_init_out.flags2` bit of
/// FUSE_OVER_IO_URING (bit 41 of the 64-bit flags).
const FLAGS2_OVER_IO_URING: u32 = 1 << (41 - 32);
/// `fuse_init_out.flags` bit FUSE_INIT_EXT: flags2 is meaningful.
const FLAG_INIT_EXT: u32 = 1 << 30;

/// Offsets in a /dev/fuse message: `fuse_in_header` (40 bytes) then
/// `fuse_init_in` (major, minor, max_readahead, flags, flags2, ...).
const INIT_IN_FLAGS2: usize = wire::IN_HEADER_LEN + 16;
/// Offsets in fuser's INIT reply: `fuse_out_header` (16 bytes) then
/// `fuse_init_out` (major, minor, max_readahead, flags, max_background,
/// congestion_threshold, max_write, time_gran, max_pages, map_alignment,
/// flags2, ...).
const INIT_OUT_FLAGS: usize = wire::OUT_HEADER_LEN + 12;
const INIT_OUT_MAX_WRITE: usize = wire::OUT_HEADER_LEN + 20;
const INIT_OUT_MAX_PAGES: usize = wire::OUT_HEADER_LEN + 28;
const INIT_OUT_FLAGS2: usize = wire::OUT_HEADER_LEN + 32;

/// `user_data` of the queue's read of its mailbox's eventfd.
const MAILBOX_TAG: u64 = u64::MAX;

/// Request ids of the DESTROYs that end fuser's threads (the kernel's
/// count up from 1 and never come near).
const DESTROY_UNIQUE_BASE: u64 = u64::MAX - 1024;

/// What the relay threads and the queues share.
struct Relay {
    dev: OwnedFd,
    /// This side of the socket pair whose other side fuser reads.
    sock: OwnedFd,
    /// Requests handed to fuser from a ring entry: request id to (queue,
    /// entry).
    on_ring: Mutex<HashMap<u64, (usize, usize)>>,
    mailboxes: Vec<Mailbox>,
    /// Request id of the INIT relayed to fuser (0: none yet).
    init_unique: AtomicU64,
    /// Whether the kernel's INIT offered FUSE_OVER_IO_URING.
    init_offered_uring: AtomicU64,
    init_done: Mutex<Option<mpsc::Sender<Result<Negotiated, String>>>>,
    counts: RingCounts,
    /// STATFS requests that came over a queue (the route check's).
    statfs_on_ring: AtomicU64,
    /// The FUSE connection (its fusectl number), to abort on a failure.
    connection: Mutex<Option<u32>>,
    /// The kernel ended the connection (`/dev/fuse` said so): from here
    /// on threads end as they should, and the number may name another
    /// mount's connection, so it is never aborted.
    ended: AtomicBool,
}

impl Relay {
    /// Ends the connection after a thread of ours failed, unless it has
    /// ended already: every waiting request fails (ENOTCONN), every
    /// thread ends, and the mount is left dead for `umount` (as after a
    /// daemon crash over `/dev/fuse`) instead of hanging its callers.
    fn abort(&self, why: &str) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        if let Some(id) = *self.connection.lock() {
            eprintln!("iomapfs: FUSE over io_uring: {why}: aborting the connection");
            abort_connection(id);
        }
    }
}

/// Requests that came over the ring, by who answered them.
#[derive(Debug, Default)]
pub struct RingCounts {
    /// READ and WRITE, answered by the queue threads.
    pub answered_on_ring: AtomicU64,
    /// Every other request, handed to fuser.
    pub handed_to_fuser: AtomicU64,
}

/// What INIT settled that the queues need.
#[derive(Clone, Copy, Debug)]
struct Negotiated {
    max_write: usize,
    max_pages: usize,
}

impl Negotiated {
    /// Payload buffer size: the kernel refuses a smaller one
    /// (`max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE)`).
    fn payload_len(&self) -> usize {
        // Without FUSE_MAX_PAGES the kernel keeps its default of 32.
        const DEFAULT_MAX_PAGES: usize = 32;
        uring::MIN_READ_BUFFER
            .max(self.max_write)
            .max(self.max_pages.max(DEFAULT_MAX_PAGES) * blockdev::page_size())
    }
}

/// Replies fuser gave for one queue's entries, and whether to stop.
struct Mailbox {
    eventfd: OwnedFd,
    state: Mutex<MailState>,
}

#[derive(Default)]
struct MailState {
    replies: Vec<(usize, Vec<u8>)>,
    stop: bool,
}

impl Mailbox {
    fn new() -> io::Result<Mailbox> {
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Mailbox {
            // SAFETY: `fd` was just created and is owned by nothing else.
            eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
            state: Mutex::new(MailState::default()),
        })
    }

    fn post(&self, change: impl FnOnce(&mut MailState)) {
        change(&mut self.state.lock());
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array to our eventfd. A full
        // counter (never, at 2^64 - 2) would only delay the wake-up.
        unsafe { libc::write(self.eventfd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// The threads of a mount served over io_uring, besides fuser's.
pub struct RingTransport {
    relay: Arc<Relay>,
    threads: Vec<JoinHandle<()>>,
    queues: Vec<JoinHandle<io::Result<()>>>,
}

impl RingTransport {
    /// Requests that came over the ring so far, by who answered them.
    pub fn counts(&self) -> &RingCounts {
        &self.relay.counts
    }

    /// Waits for every thread (call once fuser's session has ended); the
    /// first queue's error, if one failed. Fuser's threads end only with
    /// the connection or by failing: in the second case the connection
    /// is aborted first, so that the rest end too.
    pub fn join(mut self) -> io::Result<()> {
        self.relay.abort("fuser's threads ended");
        self.join_threads()
    }

    fn join_threads(&mut self) -> io::Result<()> {
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        let mut first = Ok(());
        for queue in self.queues.drain(..) {
            let result = queue
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("an io_uring queue thread panicked")));
            if first.is_ok() {
                first = result;
            }
        }
        first
    }
}

impl Drop for RingTransport {
    // A transport dropped unjoined (a failed mount, after `UndoMount`
    // aborted the connection) waits for its threads: none may outlive
    // the call that started them while they hold the volume.
    fn drop(&mut self) {
        let _ = self.join_threads();
    }
}

fn mount_error(path: &Path, what: &str, source: io::Error) -> MountError {
    MountError::Mount {
        path: path.to_path_buf(),
        source: io::Error::new(source.kind(), format!("-o uring: {what}: {source}")),
    }
}

/// Mounts at `path` (canonical) with the io_uring transport: our own
/// `mount(2)` of a fresh `/dev/fuse`, fuser on a socket pair (its threads
/// running), and one queue per possible CPU. Root only.
pub fn start(
    fs: IomapFuse,
    path: &Path,
    cfg: &MountConfig,
) -> Result<(BackgroundSession, RingTransport), MountError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(mount_error(
            path,
            "needs root (it mounts with mount(2) and turns on \
             /sys/module/fuse/parameters/enable_uring while its queues register)",
            io::Error::from(io::ErrorKind::PermissionDenied),
        ));
    }
    let knob = UringKnob::enable().map_err(|e| {
        mount_error(
            path,
            "FUSE over io_uring is not available here",
            io::Error::other(e.to_string()),
        )
    })?;
    let cpus = possible_cpus()
        .map_err(|e| mount_error(path, "counting CPUs", io::Error::other(e.to_string())))?;
    // SAFETY: a valid C string; the result is checked.
    let dev = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if dev < 0 {
        return Err(mount_error(
            path,
            "opening /dev/fuse",
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: just opened, owned by nothing else.
    let dev = unsafe { OwnedFd::from_raw_fd(dev) };
    let mut pair = [0 as RawFd; 2];
    // SAFETY: `pair` is a valid out array of two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            pair.as_mut_ptr(),
        )
    } != 0
    {
        return Err(mount_error(path, "socketpair", io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    let (ours, fusers) = unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
    // Messages as large as the largest request or reply.
    for fd in [&ours, &fusers] {
        let size: libc::c_int = (MAX_IO_BYTES as libc::c_int) * 2 + 65536;
        // SAFETY: sets an int socket option from a live int. FORCE (root)
        // passes net.core.wmem_max, which a whole request would exceed.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUFFORCE,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    let mailboxes = (0..cpus)
        .map(|_| Mailbox::new())
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| mount_error(path, "eventfd", e))?;
    let (init_tx, init_rx) = mpsc::channel();
    let relay = Arc::new(Relay {
        dev,
        sock: ours,
        on_ring: Mutex::new(HashMap::new()),
        mailboxes,
        init_unique: AtomicU64::new(0),
        init_offered_uring: AtomicU64::new(0),
        init_done: Mutex::new(Some(init_tx)),
        counts: RingCounts::default(),
        statfs_on_ring: AtomicU64::new(0),
        connection: Mutex::new(None),
        ended: AtomicBool::new(false),
    });
    mount_fuse(path, relay.dev.as_raw_fd(), cfg)?;
    *relay.connection.lock() = connection_of(path);
    let mut transport = RingTransport {
        relay: relay.clone(),
        threads: Vec::new(),
        queues: Vec::new(),
    };
    // From here on a failure must undo the mount: the guard aborts the
    // connection and detaches the mount, which ends every thread started;
    // `transport`, dropped after it, then waits for them.
    let undo = UndoMount(Some((path.to_path_buf(), relay.clone())));
    let threads = cfg.threads.max(1);
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name.into())
            .spawn(f)
            .map_err(|e| mount_error(path, "starting a thread", e))
    };
    let r = relay.clone();
    transport.threads.push(spawn(
        "iomapfs-fuse-relay",
        Box::new(move || relay_dev_to_fuser(&r, threads)),
    )?);
    let r = relay.clone();
    transport.threads.push(spawn(
        "iomapfs-fuse-router",
        Box::new(move || route_fuser_replies(&r)),
    )?);
    let config = {
        let mut c = Config::default();
        c.acl = if cfg.allow_other {
            SessionACL::All
        } else {
            SessionACL::Owner
        };
        c.n_threads = Some(threads);
        c.clone_fd = false;
        c
    };
    // Reads INIT (relayed) and answers it (routed, with io_uring added).
    let session = Session::from_fd(fs.clone(), fusers, config.acl, config)
        .map_err(|e| mount_error(path, "fuser's INIT", e))?;
    let negotiated = match init_rx.recv_timeout(INIT_TIMEOUT) {
        Ok(Ok(n)) => n,
        Ok(Err(why)) => return Err(mount_error(path, &why, io::Error::other("INIT"))),
        Err(_) => {
            return Err(mount_error(
                path,
                "no INIT reply reached the kernel",
                io::Error::from(io::ErrorKind::TimedOut),
            ))
        }
    };
    let payload_len = negotiated.payload_len();
    let mut ready = Vec::with_capacity(cpus);
    for qid in 0..cpus {
        let (tx, rx) = mpsc::channel();
        let r = relay.clone();
        let fs = fs.clone();
        let idle = cfg.uring_idle;
        transport.queues.push(
            std::thread::Builder::new()
                .name(format!("iomapfs-ring-{qid}"))
                .spawn(move || {
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        serve_queue(qid, idle, &r, &fs, payload_len, tx)
                    }))
                    .unwrap_or_else(|_| Err(io::Error::other(format!("queue {qid} panicked"))));
                    // A queue ends before the connection only by failing;
                    // its CPU's requests would then wait forever.
                    if let Err(e) = &served {
                        r.abort(&e.to_string());
                    }
                    r.abort(&format!("queue {qid} ended"));
                    served
                })
                .map_err(|e| mount_error(path, "starting a queue thread", e))?,
        );
        ready.push(rx);
    }
    for rx in ready {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(mount_error(path, "registering a queue", e)),
            Err(_) => {
                return Err(mount_error(
                    path,
                    "a queue thread ended before registering",
                    io::Error::other("queue"),
                ))
            }
        }
    }
    // Registered queues stay: the knob only gates new registrations.
    drop(knob);
    let session = session
        .spawn()
        .map_err(|e| mount_error(path, "starting fuser's threads", e))?;
    prove_the_route(path, &relay)?;
    undo.disarm();
    Ok((session, transport))
}

/// Asks one STATFS of the mount and checks it came over a queue: a
/// kernel that took the registrations but kept sending over `/dev/fuse`
/// (or over neither) is found here, at mount, not by a hung caller
/// later. A request left unanswered is failed by aborting the connection.
fn prove_the_route(path: &Path, relay: &Relay) -> Result<(), MountError> {
    let before = relay.statfs_on_ring.load(Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    let target = path.to_path_buf();
    std::thread::Builder::new()
        .name("iomapfs-route-chk".into())
        .spawn(move || {
            let c =
                CString::new(target.as_os_str().as_bytes()).expect("no NUL in a canonical path");
            // SAFETY: a valid C string and a zeroed out struct for the call.
            let rc = unsafe {
                let mut st: libc::statvfs = std::mem::zeroed();
                libc::statvfs(c.as_ptr(), &mut st)
            };
            let _ = tx.send(if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            });
        })
        .map_err(|e| mount_error(path, "starting a thread", e))?;
    let fail = |what: &str| {
        mount_error(
            path,
            what,
            io::Error::other("the kernel did not route requests to the queues"),
        )
    };
    match rx.recv_timeout(INIT_TIMEOUT) {
        Ok(Ok(())) if relay.statfs_on_ring.load(Ordering::Relaxed) > before => Ok(()),
        Ok(Ok(())) => Err(fail("a STATFS of the mount came over /dev/fuse")),
        Ok(Err(e)) => Err(mount_error(path, "a STATFS of the mount", e)),
        Err(_) => Err(fail("a STATFS of the mount got no answer")),
    }
}

/// Aborts the connection and detaches the mount unless disarmed.
struct UndoMount(Option<(PathBuf, Arc<Relay>)>);

impl UndoMount {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for UndoMount {
    fn drop(&mut self) {
        if let Some((path, relay)) = self.0.take() {
            relay.abort("the mount failed");
            let _ = unmount(&path);
        }
    }
}

/// `mount(2)` of a FUSE file system at `path` served through `fd`, with
/// the options fuser's own root mount gives for `cfg`.
fn mount_fuse(path: &Path, fd: RawFd, cfg: &MountConfig) -> Result<(), MountError> {
    let meta =
        std::fs::metadata(path).map_err(|e| mount_error(path, "stat of the mount point", e))?;
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data = format!(
        "fd={fd},rootmode={:o},user_id={uid},group_id={gid},default_permissions,subtype={FS_SUBTYPE}",
        meta.mode() & libc::S_IFMT
    );
    if cfg.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if cfg.read_only {
        flags |= libc::MS_RDONLY;
    }
    if cfg.no_exec {
        flags |= libc::MS_NOEXEC;
    }
    let bad = |_| {
        mount_error(
            path,
            "a NUL byte in a name",
            io::Error::from(io::ErrorKind::InvalidInput),
        )
    };
    let source = CString::new(cfg.fs_name.as_str()).map_err(bad)?;
    let target = CString::new(path.as_os_str().as_bytes()).map_err(bad)?;
    let data = CString::new(data).map_err(bad)?;
    // SAFETY: all pointers are valid C strings for the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"fuse".as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(MountError::Mount {
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn send(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: sends `msg.len()` bytes from a live slice.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Reads `/dev/fuse` and hands each request to fuser, until the
/// connection ends; then ends fuser's `threads` threads.
fn relay_dev_to_fuser(relay: &Relay, threads: usize) {
    // The kernel refuses reads smaller than a whole request of max_write.
    let mut buf = vec![0u8; MAX_IO_BYTES as usize + 4096];
    loop {
        // SAFETY: `buf` is a live, writable buffer of the given length.
        let n = unsafe { libc::read(relay.dev.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                // ENODEV: unmounted or aborted; ECONNABORTED: the same,
                // landing while the read took a request off the queue.
                Some(libc::ENODEV) | Some(libc::ECONNABORTED) => {
                    relay.ended.store(true, Ordering::Release);
                }
                _ => relay.abort(&format!("reading /dev/fuse: {e}")),
            }
            break;
        }
        let msg = &buf[..n as usize];
        let Some(header) = wire::InHeader::parse(msg) else {
            relay.abort(&format!("/dev/fuse gave a {n}-byte request"));
            break;
        };
        if header.opcode == wire::opcode::INIT && msg.len() >= INIT_IN_FLAGS2 + 4 {
            let offered = get_u32(msg, INIT_IN_FLAGS2) & FLAGS2_OVER_IO_URING != 0;
            relay
                .init_offered_uring
                .store(offered as u64, Ordering::Release);
            relay.init_unique.store(header.unique, Ordering::Release);
        }
        if let Err(e) = send(&relay.sock, msg) {
            relay.abort(&format!("handing a request to fuser: {e}"));
            break;
        }
    }
    for i in 0..threads as u64 {
        let mut destroy = [0u8; wire::IN_HEADER_LEN];
        put_u32(&mut destroy, 0, wire::IN_HEADER_LEN as u32);
        put_u32(&mut destroy, 4, wire::opcode::DESTROY);
        destroy[8..16].copy_from_slice(&(DESTROY_UNIQUE_BASE + i).to_le_bytes());
        if send(&relay.sock, &destroy).is_err() {
            break;
        }
    }
}

/// Reads fuser's replies: one to a request from a ring entry goes to that
/// entry's queue; the INIT reply gains FUSE_OVER_IO_URING and goes to
/// `/dev/fuse`, as does every other. Ends when fuser's side closes, and
/// then tells every queue to stop.
fn route_fuser_replies(relay: &Relay) {
    let mut buf = vec![0u8; wire::OUT_HEADER_LEN + MAX_IO_BYTES as usize + 4096];
    loop {
        // SAFETY: `buf` is a live, writable buffer of the given length.
        let n = unsafe {
            libc::recv(
                relay.sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            relay.abort(&format!("reading fuser's replies: {e}"));
            break;
        }
        if n == 0 {
            // Fuser's threads ended: after the connection did, or by
            // failing, and then nothing answers what goes to fuser.
            relay.abort("fuser's threads ended");
            break;
        }
        let msg = &mut buf[..n as usize];
        if msg.len() < wire::OUT_HEADER_LEN {
            continue;
        }
        let unique = get_u64(msg, 8);
        let ring_entry = relay.on_ring.lock().remove(&unique);
        if let Some((queue, entry)) = ring_entry {
            let reply = msg.to_vec();
            relay.mailboxes[queue].post(|m| m.replies.push((entry, reply)));
            continue;
        }
        let is_init = unique != 0 && unique == relay.init_unique.load(Ordering::Acquire);
        let outcome = if is_init {
            Some(patch_init_reply(relay, msg))
        } else {
            None
        };
        // SAFETY: writes `msg.len()` bytes from a live slice. A refused
        // reply (ENOENT: the request was interrupted; ENODEV: the
        // connection is gone) needs nothing more from us, but INIT's.
        let written = unsafe { libc::write(relay.dev.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
        let outcome = match outcome {
            Some(Ok(_)) if written < 0 => Some(Err(format!(
                "the kernel refused fuser's INIT reply: {}",
                io::Error::last_os_error()
            ))),
            other => other,
        };
        if let Some(outcome) = outcome {
            if let Some(tx) = relay.init_done.lock().take() {
                let _ = tx.send(outcome);
            }
        }
    }
    for mailbox in &relay.mailboxes {
        mailbox.post(|m| m.stop = true);
    }
}

/// Adds FUSE_OVER_IO_URING to fuser's INIT reply; what it settled, or why
/// the transport cannot be used.
fn patch_init_reply(relay: &Relay, msg: &mut [u8]) -> Result<Negotiated, String> {
    if get_u32(msg, 4) != 0 {
        return Err("fuser refused the kernel's INIT".into());
    }
    if msg.len() < INIT_OUT_FLAGS2 + 4 {
        return Err(format!(
            "fuser's INIT reply is {} bytes, too short to carry flags2",
            msg.len()
        ));
    }
    if relay.init_offered_uring.load(Ordering::Acquire) == 0 {
        return Err(
            "the kernel did not offer FUSE over io_uring (it needs Linux 6.14 or later \
             built with CONFIG_FUSE_IO_URING)"
                .into(),
        );
    }
    let flags = get_u32(msg, INIT_OUT_FLAGS) | FLAG_INIT_EXT;
    put_u32(msg, INIT_OUT_FLAGS, flags);
    let flags2 = get_u32(msg, INIT_OUT_FLAGS2) | FLAGS2_OVER_IO_URING;
    put_u32(msg, INIT_OUT_FLAGS2, flags2);
    Ok(Negotiated {
        max_write: get_u32(msg, INIT_OUT_MAX_WRITE) as usize,
        max_pages: u16::from_le_bytes([msg[INIT_OUT_MAX_PAGES], msg[INIT_OUT_MAX_PAGES + 1]])
            as usize,
    })
}

struct RingEntry {
    header: Box<[u8; uring::REQ_HEADER_LEN]>,
    payload: AlignedBuf,
    /// Header and payload buffers as REGISTER's iovec array; kept for the
    /// entry's life in case the kernel reads it late.
    iov: [libc::iovec; 2],
    commit_id: u64,
}

impl RingEntry {
    /// Writes the reply header and the payload's length.
    fn set_reply(&mut self, unique: u64, error: i32, body_len: usize) {
        wire::put_out_header(
            &mut self.header[uring::IN_OUT_OFFSET..],
            unique,
            error,
            body_len,
        );
        put_u32(
            &mut self.header[..],
            uring::PAYLOAD_SZ_OFFSET,
            body_len as u32,
        );
    }

    /// Copies a reply fuser wrote (out header, body) into the entry.
    fn take_reply(&mut self, reply: &[u8]) {
        let body = &reply[wire::OUT_HEADER_LEN..];
        let unique = get_u64(reply, 8);
        if body.len() > self.payload.len() {
            return self.set_reply(unique, -libc::EIO, 0);
        }
        self.payload[..body.len()].copy_from_slice(body);
        let error = get_u32(reply, 4) as i32;
        self.set_reply(unique, error, body.len());
    }
}

/// Answers READ and WRITE in place; `None` for a request fuser answers.
fn answer_here(
    fs: &IomapFuse,
    opcode: u32,
    op: &[u8],
    entry: &mut RingEntry,
    payload_sz: usize,
) -> Option<(i32, usize)> {
    use wire::opcode::{READ, WRITE};
    match opcode {
        READ if op.len() >= 24 => {
            // fuse_read_in: fh, offset, size, ...
            let (fh, offset) = (get_u64(op, 0), get_u64(op, 8));
            let size = (get_u32(op, 16) as usize).min(entry.payload.len());
            Some(
                match fs.read_at(FileHandle(fh), offset, &mut entry.payload[..size]) {
                    Ok(n) => (0, n),
                    Err(e) => (-e.code(), 0),
                },
            )
        }
        WRITE if op.len() >= 24 => {
            // fuse_write_in: fh, offset, size, write_flags, ...
            let (fh, offset) = (get_u64(op, 0), get_u64(op, 8));
            let size = (get_u32(op, 16) as usize).min(payload_sz);
            let kill = get_u32(op, 20) & WriteFlags::FUSE_WRITE_KILL_SUIDGID.bits() != 0;
            let result = fs.write_at(FileHandle(fh), offset, &entry.payload[..size], kill);
            Some(match result {
                Ok(n) => {
                    // fuse_write_out: size, padding.
                    put_u32(&mut entry.payload[..], 0, n as u32);
                    put_u32(&mut entry.payload[..], 4, 0);
                    (0, 8)
                }
                Err(e) => (-e.code(), 0),
            })
        }
        _ => None,
    }
}

/// Serves queue `qid` (on CPU `qid`, at `SCHED_IDLE` if `idle`) until the
/// connection ends and the router says stop. `ready` gets Ok once every
/// entry is registered.
fn serve_queue(
    qid: usize,
    idle: bool,
    relay: &Relay,
    fs: &IomapFuse,
    payload_len: usize,
    ready: mpsc::Sender<io::Result<()>>,
) -> io::Result<()> {
    pin_to_cpu(qid);
    if idle {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sets the calling thread's policy from a live struct.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
            let e = io::Error::last_os_error();
            let _ = ready.send(Err(io::Error::new(
                e.kind(),
                format!("queue {qid}: SCHED_IDLE: {e}"),
            )));
            return Ok(());
        }
    }
    let dev = relay.dev.as_raw_fd();
    let align = blockdev::page_size().max(fs.memory_alignment());
    let mut entries = Vec::with_capacity(QUEUE_ENTRIES);
    for _ in 0..QUEUE_ENTRIES {
        match EntryBuffers::new(payload_len, align) {
            Ok(EntryBuffers {
                header,
                payload,
                iov,
            }) => entries.push(RingEntry {
                header,
                payload,
                iov,
                commit_id: 0,
            }),
            Err(e) => {
                let _ = ready.send(Err(io::Error::other(format!("queue {qid}: {e}"))));
                return Ok(());
            }
        }
    }
    // The mailbox read's buffer. It and `entries` are declared before the
    // ring, so they are dropped after it on every path: the kernel may
    // write into them until the ring is gone.
    let mut counter = [0u8; 8];
    let mut ring = match IoUring::<squeue::Entry128, cqueue::Entry32>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build((2 * QUEUE_ENTRIES + 2).next_power_of_two() as u32)
    {
        Ok(ring) => ring,
        Err(e) => {
            let _ = ready.send(Err(io::Error::new(
                e.kind(),
                format!("queue {qid}: io_uring setup: {e}"),
            )));
            return Ok(());
        }
    };
    let q = qid as u16;
    for (index, entry) in entries.iter().enumerate() {
        let sqe = command(
            dev,
            uring::CMD_REGISTER,
            0,
            q,
            Some(&entry.iov),
            index as u64,
        );
        // SAFETY: the iovecs and the buffers they point at live in
        // `entries`, declared before the ring and so dropped after it.
        unsafe { ring.submission().push(&sqe) }.expect("ring sized for every entry");
    }
    let mailbox = &relay.mailboxes[qid];
    let arm_mailbox = |ring: &mut IoUring<squeue::Entry128, cqueue::Entry32>,
                       counter: &mut [u8; 8]| {
        let read = opcode::Read::new(
            types::Fd(mailbox.eventfd.as_raw_fd()),
            counter.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(MAILBOX_TAG)
        .into();
        // SAFETY: `counter`, declared before the ring, outlives it.
        unsafe { ring.submission().push(&read) }.expect("a slot is kept for the mailbox");
    };
    // Answers entry `index` (its reply written) and fetches its next request.
    let commit = |ring: &mut IoUring<squeue::Entry128, cqueue::Entry32>,
                  entries: &[RingEntry],
                  index: usize| {
        let sqe = command(
            dev,
            uring::CMD_COMMIT_AND_FETCH,
            entries[index].commit_id,
            q,
            None,
            index as u64,
        );
        // SAFETY: as for REGISTER: the entry's buffers outlive the ring.
        unsafe { ring.submission().push(&sqe) }.expect("one slot per entry");
    };
    arm_mailbox(&mut ring, &mut counter);
    if let Err(e) = ring.submit() {
        let _ = ready.send(Err(io::Error::new(
            e.kind(),
            format!("queue {qid}: REGISTER: {e}"),
        )));
        return Ok(());
    }
    // A refused REGISTER completes at once; an accepted one stays in
    // flight until the kernel has a request for it. `find` consumes the
    // completions before the one it returns: none of them can be an
    // accepted command's or the mailbox's yet (with DEFER_TASKRUN the
    // kernel completes those only inside a later io_uring_enter).
    if let Some(cqe) = ring
        .completion()
        .find(|c| c.user_data() != MAILBOX_TAG && c.result() < 0)
    {
        let e = io::Error::from_raw_os_error(-cqe.result());
        let _ = ready.send(Err(io::Error::new(
            e.kind(),
            format!("queue {qid}: REGISTER refused: {e}"),
        )));
        return Ok(());
    }
    let _ = ready.send(Ok(()));

    let mut live = entries.len();
    let mut stopping = false;
    let mut done: Vec<(u64, i32)> = Vec::with_capacity(2 * QUEUE_ENTRIES + 2);
    let mut relayed = Vec::new();
    while live > 0 || !stopping {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
        }
        done.clear();
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(tag, result) in &done {
            if tag == MAILBOX_TAG {
                let (replies, stop) = {
                    let mut state = mailbox.state.lock();
                    (std::mem::take(&mut state.replies), state.stop)
                };
                for (index, reply) in replies {
                    entries[index].take_reply(&reply);
                    commit(&mut ring, &entries, index);
                    live += 1;
                }
                if stop {
                    stopping = true;
                } else {
                    arm_mailbox(&mut ring, &mut counter);
                }
                continue;
            }
            let index = tag as usize;
            live -= 1;
            if result < 0 {
                if connection_ended(result) {
                    continue;
                }
                // An entry the kernel no longer takes requests for: the
                // queue would starve, so it fails (and the caller aborts
                // the connection).
                let e = io::Error::from_raw_os_error(-result);
                return Err(io::Error::new(
                    e.kind(),
                    format!("queue {qid}: a command failed: {e}"),
                ));
            }
            let entry = &mut entries[index];
            let header = &entry.header[..];
            entry.commit_id = get_u64(header, uring::COMMIT_ID_OFFSET);
            let payload_sz = (get_u32(header, uring::PAYLOAD_SZ_OFFSET) as usize).min(payload_len);
            let Some(request) = wire::InHeader::parse(&header[uring::IN_OUT_OFFSET..]) else {
                continue;
            };
            let total = get_u32(header, uring::IN_OUT_OFFSET) as usize;
            let op_len = total
                .saturating_sub(wire::IN_HEADER_LEN + payload_sz)
                .min(uring::OP_IN_LEN);
            let mut op = [0u8; uring::OP_IN_LEN];
            op[..op_len]
                .copy_from_slice(&header[uring::OP_IN_OFFSET..uring::OP_IN_OFFSET + op_len]);
            let answered = answer_here(fs, request.opcode, &op[..op_len], entry, payload_sz);
            let (error, body_len) = match answered {
                Some(answer) => {
                    relay
                        .counts
                        .answered_on_ring
                        .fetch_add(1, Ordering::Relaxed);
                    answer
                }
                None => {
                    relay.counts.handed_to_fuser.fetch_add(1, Ordering::Relaxed);
                    if request.opcode == wire::opcode::STATFS {
                        relay.statfs_on_ring.fetch_add(1, Ordering::Relaxed);
                    }
                    // As /dev/fuse would give it: header, fixed part, rest.
                    relayed.clear();
                    relayed.extend_from_slice(
                        &entry.header
                            [uring::IN_OUT_OFFSET..uring::IN_OUT_OFFSET + wire::IN_HEADER_LEN],
                    );
                    relayed.extend_from_slice(&op[..op_len]);
                    relayed.extend_from_slice(&entry.payload[..payload_sz]);
                    let len = relayed.len() as u32;
                    put_u32(&mut relayed, 0, len);
                    relay.on_ring.lock().insert(request.unique, (qid, index));
                    if send(&relay.sock, &relayed).is_ok() {
                        continue;
                    }
                    relay.on_ring.lock().remove(&request.unique);
                    (-libc::EIO, 0)
                }
            };
            entry.set_reply(request.unique, error, body_len);
            commit(&mut ring, &entries, index);
            live += 1;
        }
    }
    drop(ring);
    Ok(())
}
