//! A measurement of FUSE's two kernel transports on this machine:
//! classic `/dev/fuse` read + write, and FUSE over io_uring. The probe
//! mounts a tiny synthetic file system ([`synthetic`]: a root directory and
//! one file of a fixed pattern, served from memory) over one transport or
//! the other, then times, from one thread at queue depth 1, a no-op
//! request (getxattr of a missing name) and 4 KiB O_DIRECT random preads,
//! with CPU time of the whole process (client and server threads) per
//! operation. Same file system, same INIT, same client: only the
//! transport differs. Root only (it mounts with mount(2)).

mod dev;
mod ring;
pub mod synthetic;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::fuse_uring::{
    abort_connection, connection_of, fresh_dir, possible_cpus, UringKnob, ENABLE_URING_KNOB,
};
use crate::fuse_wire::{self as wire, init_flag, opcode};
use synthetic::{SyntheticFs, FILE_NAME};

pub use ring::QueueError;

/// A FUSE transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// read(2) requests from /dev/fuse, write(2) replies.
    DevFuse,
    /// FUSE over io_uring: per-CPU queues, one commit-and-fetch per request.
    IoUring,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::DevFuse => "dev-fuse",
            Transport::IoUring => "io-uring",
        }
    }
}

/// What the client times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// fgetxattr of a missing `user.` name: one round trip, no work.
    Noop,
    /// 4 KiB O_DIRECT pread at random 4 KiB-aligned offsets of the file.
    RandRead4k,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Noop => "noop-getxattr",
            Workload::RandRead4k => "randread-4k-qd1",
        }
    }
}

/// How to run the probe.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    pub transports: Vec<Transport>,
    pub workloads: Vec<Workload>,
    /// Measured time per workload and transport, split in `rounds`
    /// rounds that alternate between the transports.
    pub runtime: Duration,
    pub rounds: usize,
    /// Untimed time before each round.
    pub warmup: Duration,
    /// Size of the synthetic file (random reads spread over all of it).
    pub file_size: u64,
    /// Answer opens with FOPEN_DIRECT_IO (as `iomapfs mount -o
    /// direct_io`); without it the kernel may cache data, and O_DIRECT
    /// opens take its direct path (the report counts READs reaching the
    /// server per pread to show that they still do).
    pub fopen_direct_io: bool,
    /// Ring entries per io_uring queue.
    pub queue_entries: usize,
    /// IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN on the queues' rings.
    pub defer_taskrun: bool,
    /// Directory to make mount points in.
    pub scratch_dir: PathBuf,
    /// A mount older than this has its connection aborted, so a client
    /// call the kernel never answers fails (ENOTCONN) instead of hanging
    /// the probe. [`run`] stretches it to cover the asked run time.
    pub watchdog: Duration,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            transports: vec![Transport::DevFuse, Transport::IoUring],
            workloads: vec![Workload::Noop, Workload::RandRead4k],
            runtime: Duration::from_secs(5),
            rounds: 5,
            warmup: Duration::from_millis(100),
            file_size: 1 << 30,
            fopen_direct_io: false,
            queue_entries: 2,
            defer_taskrun: true,
            scratch_dir: std::env::temp_dir(),
            watchdog: Duration::from_secs(60),
        }
    }
}

/// Why the probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error(
        "this kernel has no FUSE over io_uring ({ENABLE_URING_KNOB} is missing: \
         CONFIG_FUSE_IO_URING off or kernel older than 6.14)"
    )]
    NoUringSupport,
    #[error("FUSE over io_uring: {0}")]
    Queue(#[from] QueueError),
    #[error(
        "FUSE over io_uring: every queue registered but the kernel sent requests \
         over /dev/fuse ({dev} requests there, {ring} over the ring)"
    )]
    NotRouted { dev: u64, ring: u64 },
    #[error("{workload} over {transport}: {what}")]
    Client {
        transport: &'static str,
        workload: &'static str,
        what: String,
    },
    #[error("the {transport} server failed: {source}")]
    Server {
        transport: &'static str,
        source: io::Error,
    },
}

/// Why the `enable_uring` knob could not be turned on.
fn knob_error(e: io::Error) -> ProbeError {
    if e.kind() == io::ErrorKind::NotFound {
        ProbeError::NoUringSupport
    } else {
        io_err("turning on FUSE over io_uring")(e)
    }
}

/// A new directory for a probe mount under `parent`.
fn unique_dir(parent: &Path) -> Result<PathBuf, ProbeError> {
    fresh_dir(parent, "iomapfs-fuse-probe").map_err(io_err("a mount point"))
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ProbeError {
    let what = what.into();
    move |source| ProbeError::Io { what, source }
}

/// Requests served, by way and kind.
#[derive(Default, Debug)]
pub struct Counters {
    /// Requests read from /dev/fuse, except INIT and FORGET/INTERRUPT.
    pub dev_requests: AtomicU64,
    /// Requests taken from io_uring queues.
    pub ring_requests: AtomicU64,
    /// READ requests (either way).
    pub reads: AtomicU64,
}

/// State the server threads share.
pub struct Shared {
    fs: SyntheticFs,
    /// INIT flags asked of the kernel.
    init_flags: u64,
    counters: Counters,
}

impl Shared {
    fn count_request(&self, req: &synthetic::Request<'_>) {
        if req.header.opcode == opcode::READ {
            self.counters.reads.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One workload's figures over one transport.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub transport: Transport,
    pub workload: Workload,
    pub ops: u64,
    pub seconds: f64,
    pub iops: f64,
    /// IOPS of each round, in order (rounds alternate between transports).
    pub round_iops: Vec<f64>,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// User + system CPU time of the whole process (client and server
    /// threads) per operation.
    pub cpu_us_per_op: f64,
    /// READ requests the server answered per timed operation.
    pub server_reads_per_op: f64,
    /// Requests answered over the io_uring queues / /dev/fuse during the
    /// timed run.
    pub ring_requests: u64,
    pub dev_requests: u64,
}

/// The probe's result.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub measurements: Vec<Measurement>,
    /// The knob's value before the probe ("N"/"Y"), if io_uring was run.
    pub knob_before: Option<String>,
    /// Possible CPUs (io_uring queues).
    pub queues: usize,
}

/// Runs the probe: mounts the file system over each transport (turning
/// the io_uring knob on for the io_uring mount when it is off, and back
/// right after), then times each workload in `cfg.rounds` rounds that
/// alternate between the transports, so that load from other processes
/// falls on both alike; unmounts.
pub fn run(cfg: &ProbeConfig) -> Result<ProbeReport, ProbeError> {
    let fs = SyntheticFs {
        file_size: cfg.file_size,
        open_flags: if cfg.fopen_direct_io {
            wire::FOPEN_DIRECT_IO
        } else {
            0
        },
    };
    let mut report = ProbeReport {
        measurements: Vec::new(),
        knob_before: None,
        queues: possible_cpus().map_err(io_err("counting possible CPUs"))?,
    };
    let rounds = cfg.rounds.max(1);
    let busy = (cfg.runtime + cfg.warmup * rounds as u32) * cfg.workloads.len() as u32;
    let cfg = &ProbeConfig {
        watchdog: cfg.watchdog + busy * cfg.transports.len() as u32,
        ..cfg.clone()
    };
    let mut mounts = Vec::new();
    for &transport in &cfg.transports {
        let knob = match transport {
            Transport::IoUring => {
                let knob = UringKnob::enable().map_err(knob_error)?;
                report.knob_before = Some(knob.before().to_string());
                Some(knob)
            }
            Transport::DevFuse => None,
        };
        mounts.push(ProbeMount::start(transport, fs, cfg)?);
        // The connection keeps io_uring once its queues are registered.
        drop(knob);
    }
    let round_time = cfg.runtime / rounds as u32;
    for &workload in &cfg.workloads {
        let mut totals: Vec<Totals> = mounts.iter().map(|_| Totals::default()).collect();
        for _ in 0..rounds {
            for (mount, total) in mounts.iter().zip(&mut totals) {
                let sample = time_round(mount, workload, cfg, round_time)?;
                total.add(sample);
            }
        }
        for (mount, total) in mounts.iter().zip(totals) {
            report
                .measurements
                .push(total.into_measurement(mount.transport, workload)?);
        }
    }
    for mount in mounts {
        mount.finish()?;
    }
    Ok(report)
}

/// The synthetic file system mounted over one transport, with its server
/// threads. Dropping it without [`ProbeMount::finish`] aborts the
/// connection and detaches the mount, so nothing stays mounted after a
/// failure.
pub struct ProbeMount {
    transport: Transport,
    dir: PathBuf,
    mounted: bool,
    /// The FUSE connection number, to abort it on failure.
    connection: Option<u32>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<io::Result<()>>>,
    /// Held so the connection lives until the threads are joined.
    _dev: Arc<OwnedFd>,
    /// Dropping the sender stops the watchdog.
    watchdog: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

impl ProbeMount {
    /// Mounts at a fresh directory under `cfg.scratch_dir` and starts the
    /// servers; returns once requests flow over `transport`.
    pub fn start(
        transport: Transport,
        fs: SyntheticFs,
        cfg: &ProbeConfig,
    ) -> Result<ProbeMount, ProbeError> {
        let dir = unique_dir(&cfg.scratch_dir)?;
        let path = CString::new("/dev/fuse").expect("no NUL");
        // SAFETY: `path` is a valid C string; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            let _ = std::fs::remove_dir(&dir);
            return Err(io_err("opening /dev/fuse")(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a descriptor we just opened and own alone.
        let dev = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let mut init_flags = init_flag::ASYNC_READ
            | init_flag::BIG_WRITES
            | init_flag::ASYNC_DIO
            | init_flag::MAX_PAGES
            | init_flag::INIT_EXT;
        if transport == Transport::IoUring {
            init_flags |= init_flag::OVER_IO_URING;
        }
        let shared = Arc::new(Shared {
            fs,
            init_flags,
            counters: Counters::default(),
        });
        let mut mount = ProbeMount {
            transport,
            dir,
            mounted: false,
            connection: None,
            shared,
            threads: Vec::new(),
            _dev: dev.clone(),
            watchdog: None,
        };
        mount_fuse(&mount.dir, dev.as_raw_fd())?;
        mount.mounted = true;
        mount.connection = connection_of(&mount.dir);
        if let Some(id) = mount.connection {
            let (stop_tx, stop_rx) = mpsc::channel::<()>();
            let limit = cfg.watchdog;
            let thread = std::thread::Builder::new()
                .name("probe-watchdog".into())
                .spawn(move || {
                    if let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(limit) {
                        abort_connection(id);
                    }
                })
                .map_err(io_err("starting the watchdog thread"))?;
            mount.watchdog = Some((stop_tx, thread));
        }

        let (init_tx, init_rx) = mpsc::channel();
        let shared = mount.shared.clone();
        let dev_fd = dev.clone();
        mount.threads.push(
            std::thread::Builder::new()
                .name("probe-dev-fuse".into())
                .spawn(move || {
                    dev::serve(dev_fd.as_raw_fd(), &shared, || {
                        let _ = init_tx.send(());
                    })
                })
                .map_err(io_err("starting the /dev/fuse thread"))?,
        );
        if init_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            return Err(mount.server_failure("no INIT from the kernel within 10 s"));
        }
        if transport == Transport::IoUring {
            mount.start_queues(cfg, dev.as_raw_fd())?;
        }
        Ok(mount)
    }

    fn start_queues(&mut self, cfg: &ProbeConfig, fd: i32) -> Result<(), ProbeError> {
        let queues = possible_cpus().map_err(io_err("counting possible CPUs"))?;
        let (ready_tx, ready_rx) = mpsc::channel();
        for qid in 0..queues {
            let spec = ring::QueueSpec {
                qid: qid as u16,
                fd,
                entries: cfg.queue_entries.max(1),
                defer_taskrun: cfg.defer_taskrun,
            };
            let shared = self.shared.clone();
            let ready = ready_tx.clone();
            let dev = self._dev.clone();
            self.threads.push(
                std::thread::Builder::new()
                    .name(format!("probe-queue-{qid}"))
                    .spawn(move || {
                        let _dev = dev;
                        ring::serve(spec, &shared, ready)
                    })
                    .map_err(io_err("starting an io_uring queue thread"))?,
            );
        }
        for _ in 0..queues {
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(self.server_failure("a queue did not start within 10 s")),
            }
        }
        // Requests wait until every queue has registered; the first one
        // after shows whether the kernel routes them to the ring. It runs
        // in a thread of its own so that a kernel that never answers it
        // ends the probe with an error instead of hanging it.
        let before = self.counters_now();
        let path = self.file_path();
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let result = std::fs::File::open(&path)
                .map_err(|e| format!("opening {}: {e}", path.display()))
                .and_then(|file| noop(&file));
            let _ = done_tx.send(result);
        });
        match done_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(what)) => return Err(self.client_error(Workload::Noop, what)),
            Err(_) => {
                return Err(self.server_failure(
                    "the first request after every queue registered got no answer in 10 s",
                ))
            }
        }
        let after = self.counters_now();
        if after.1 == before.1 {
            return Err(ProbeError::NotRouted {
                dev: after.0 - before.0,
                ring: after.1 - before.1,
            });
        }
        Ok(())
    }

    /// Requests answered so far: (over /dev/fuse, over io_uring, READs).
    pub fn counters_now(&self) -> (u64, u64, u64) {
        let c = &self.shared.counters;
        (
            c.dev_requests.load(Ordering::Relaxed),
            c.ring_requests.load(Ordering::Relaxed),
            c.reads.load(Ordering::Relaxed),
        )
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the pattern file.
    pub fn file_path(&self) -> PathBuf {
        self.dir.join(std::ffi::OsStr::from_bytes(FILE_NAME))
    }

    /// Opens the pattern file, O_DIRECT if asked.
    pub fn open_file(&self, direct: bool) -> Result<std::fs::File, ProbeError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.file_path();
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))
    }

    fn client_error(&self, workload: Workload, what: String) -> ProbeError {
        ProbeError::Client {
            transport: self.transport.name(),
            workload: workload.name(),
            what,
        }
    }

    fn server_failure(&mut self, what: &str) -> ProbeError {
        self.abort();
        let mut source = io::Error::new(io::ErrorKind::TimedOut, what.to_string());
        for thread in self.threads.drain(..) {
            if let Ok(Err(e)) = thread.join() {
                source = e;
            }
        }
        ProbeError::Server {
            transport: self.transport.name(),
            source,
        }
    }

    /// Unmounts, waits for the server threads and returns their failure,
    /// if any.
    pub fn finish(mut self) -> Result<(), ProbeError> {
        let c = CString::new(self.dir.as_os_str().as_bytes()).expect("no NUL in path");
        // SAFETY: `c` is a valid C string for the call.
        if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
            let err = io::Error::last_os_error();
            return Err(io_err(format!("unmounting {}", self.dir.display()))(err));
        }
        self.mounted = false;
        self.stop_watchdog();
        let mut failure = None;
        for thread in self.threads.drain(..) {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(source)) => failure = failure.or(Some(source)),
                Err(_) => failure = failure.or(Some(io::Error::other("a server thread panicked"))),
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
        match failure {
            Some(source) => Err(ProbeError::Server {
                transport: self.transport.name(),
                source,
            }),
            None => Ok(()),
        }
    }

    fn stop_watchdog(&mut self) {
        if let Some((stop, thread)) = self.watchdog.take() {
            drop(stop);
            let _ = thread.join();
        }
    }

    /// Ends the connection (the servers see it gone, and so do clients
    /// with files still open) and detaches the mount.
    fn abort(&mut self) {
        if !self.mounted {
            return;
        }
        if let Some(id) = self.connection {
            abort_connection(id);
        }
        let c = CString::new(self.dir.as_os_str().as_bytes()).expect("no NUL in path");
        // SAFETY: `c` is a valid C string for the call.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        self.mounted = false;
    }
}

impl Drop for ProbeMount {
    fn drop(&mut self) {
        self.stop_watchdog();
        self.abort();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn mount_fuse(dir: &Path, fd: i32) -> Result<(), ProbeError> {
    let source = CString::new("iomapfs-probe").expect("no NUL");
    let target = CString::new(dir.as_os_str().as_bytes()).expect("no NUL in path");
    let fstype = CString::new("fuse.iomapfs-probe").expect("no NUL");
    let data = CString::new(format!(
        "fd={fd},rootmode=40000,user_id=0,group_id=0,max_read={}",
        synthetic::MAX_WRITE
    ))
    .expect("no NUL");
    // SAFETY: all pointers are valid C strings for the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        let _ = std::fs::remove_dir(dir);
        return Err(io_err(format!("mount(2) of FUSE at {}", dir.display()))(
            err,
        ));
    }
    Ok(())
}

/// One no-op round trip: fgetxattr of a name the server does not have.
fn noop(file: &std::fs::File) -> Result<(), String> {
    let name = c"user.iomapfs-probe-missing";
    let mut value = [0u8; 8];
    // SAFETY: valid descriptor, C string and buffer for the call.
    let rc = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    let err = io::Error::last_os_error();
    if rc < 0 && err.raw_os_error() == Some(libc::ENODATA) {
        Ok(())
    } else {
        Err(format!(
            "fgetxattr of a missing name: {rc} ({err}), expected ENODATA"
        ))
    }
}

/// A 4 KiB buffer aligned for O_DIRECT.
struct AlignedBlock {
    ptr: *mut u8,
}

const BLOCK: usize = 4096;

impl AlignedBlock {
    fn new() -> AlignedBlock {
        let layout = std::alloc::Layout::from_size_align(BLOCK, BLOCK).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBlock { ptr }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points at BLOCK initialised bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr, BLOCK) }
    }
}

impl Drop for AlignedBlock {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(BLOCK, BLOCK).expect("valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Reads 4 KiB at `offset` with pread into `block` and checks the first
/// and last words against the pattern.
fn read_block(file: &std::fs::File, block: &AlignedBlock, offset: u64) -> Result<(), String> {
    // SAFETY: `block.ptr` is a writable buffer of BLOCK bytes.
    let n = unsafe {
        libc::pread(
            file.as_raw_fd(),
            block.ptr.cast(),
            BLOCK,
            offset as libc::off_t,
        )
    };
    if n != BLOCK as isize {
        let err = io::Error::last_os_error();
        return Err(format!("pread of 4 KiB at {offset}: {n} ({err})"));
    }
    let bytes = block.bytes();
    let first = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let last = u64::from_le_bytes(bytes[BLOCK - 8..].try_into().expect("8 bytes"));
    let word = offset / 8;
    if first != synthetic::pattern_word(word)
        || last != synthetic::pattern_word(word + (BLOCK as u64) / 8 - 1)
    {
        return Err(format!("4 KiB at {offset} does not hold the pattern"));
    }
    Ok(())
}

/// xorshift64*: random block numbers without a dependency.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn cpu_seconds() -> f64 {
    // SAFETY: a zeroed rusage is a valid out buffer for getrusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// One timed round of a workload on one mount.
struct Round {
    latencies: Vec<u32>,
    seconds: f64,
    cpu_seconds: f64,
    /// Requests answered during the round: (over /dev/fuse, over
    /// io_uring, READs).
    requests: (u64, u64, u64),
}

/// Times `workload` on `mount` from this thread at queue depth 1 for
/// `runtime`, after `cfg.warmup` untimed.
fn time_round(
    mount: &ProbeMount,
    workload: Workload,
    cfg: &ProbeConfig,
    runtime: Duration,
) -> Result<Round, ProbeError> {
    let file = mount.open_file(workload == Workload::RandRead4k)?;
    let block = AlignedBlock::new();
    let blocks = (cfg.file_size / BLOCK as u64).max(1);
    let mut random = Random(0x9E37_79B9_7F4A_7C15 ^ mount.counters_now().2);
    let mut one = || -> Result<(), String> {
        match workload {
            Workload::Noop => noop(&file),
            Workload::RandRead4k => {
                read_block(&file, &block, (random.next() % blocks) * BLOCK as u64)
            }
        }
    };
    let fail = |what| mount.client_error(workload, what);
    let warm_end = Instant::now() + cfg.warmup;
    while Instant::now() < warm_end {
        one().map_err(fail)?;
    }
    let mut latencies: Vec<u32> = Vec::with_capacity(1 << 20);
    let before = mount.counters_now();
    let cpu_before = cpu_seconds();
    let start = Instant::now();
    let end = start + runtime;
    let mut now = start;
    while now < end {
        let t0 = now;
        one().map_err(fail)?;
        now = Instant::now();
        latencies.push((now - t0).as_nanos().min(u32::MAX as u128) as u32);
    }
    let cpu_seconds = cpu_seconds() - cpu_before;
    let after = mount.counters_now();
    Ok(Round {
        latencies,
        seconds: (now - start).as_secs_f64(),
        cpu_seconds,
        requests: (after.0 - before.0, after.1 - before.1, after.2 - before.2),
    })
}

/// A workload's rounds on one mount, added up.
#[derive(Default)]
struct Totals {
    latencies: Vec<u32>,
    seconds: f64,
    cpu_seconds: f64,
    requests: (u64, u64, u64),
    round_iops: Vec<f64>,
}

impl Totals {
    fn add(&mut self, round: Round) {
        self.round_iops
            .push(round.latencies.len() as f64 / round.seconds);
        self.latencies.extend_from_slice(&round.latencies);
        self.seconds += round.seconds;
        self.cpu_seconds += round.cpu_seconds;
        self.requests.0 += round.requests.0;
        self.requests.1 += round.requests.1;
        self.requests.2 += round.requests.2;
    }

    fn into_measurement(
        mut self,
        transport: Transport,
        workload: Workload,
    ) -> Result<Measurement, ProbeError> {
        let ops = self.latencies.len() as u64;
        if ops == 0 {
            return Err(ProbeError::Client {
                transport: transport.name(),
                workload: workload.name(),
                what: "no operation completed in the run time".to_string(),
            });
        }
        let mean_us = self.latencies.iter().map(|&l| l as f64).sum::<f64>() / ops as f64 / 1e3;
        let p99_index = (((ops as f64) * 0.99) as usize).min(self.latencies.len() - 1);
        let p99_us = *self.latencies.select_nth_unstable(p99_index).1 as f64 / 1e3;
        let p50_index = self.latencies.len() / 2;
        let p50_us = *self.latencies.select_nth_unstable(p50_index).1 as f64 / 1e3;
        Ok(Measurement {
            transport,
            workload,
            ops,
            seconds: self.seconds,
            iops: ops as f64 / self.seconds,
            round_iops: self.round_iops,
            mean_us,
            p50_us,
            p99_us,
            cpu_us_per_op: self.cpu_seconds * 1e6 / ops as f64,
            server_reads_per_op: self.requests.2 as f64 / ops as f64,
            ring_requests: self.requests.1,
            dev_requests: self.requests.0,
        })
    }
}
