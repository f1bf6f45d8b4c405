//! The FUSE transport probe against the kernel: the synthetic file system
//! mounted over /dev/fuse and over io_uring serves its pattern, requests
//! travel the way asked, and no mount is left behind, after a clean finish
//! or after a failure. Needs root, /dev/fuse and a kernel with FUSE over
//! io_uring (6.14+); skips with the reason elsewhere, and fails instead
//! under `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use iomapfs_mount::fuse_uring::{self, ENABLE_URING_KNOB};
use iomapfs_mount::transport_probe::synthetic::{fill_pattern, SyntheticFs};
use iomapfs_mount::transport_probe::{self, ProbeConfig, ProbeMount, Transport, Workload};

/// The io_uring knob is global: tests that flip it take turns.
static KNOB: Mutex<()> = Mutex::new(());

/// Not a multiple of 4 KiB, so the last block is short.
const FILE_SIZE: u64 = (64 << 20) + 1000;

fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse (modprobe fuse)".into());
    }
    if !Path::new(ENABLE_URING_KNOB).exists() {
        return Some(format!(
            "{ENABLE_URING_KNOB} missing: no FUSE over io_uring in this kernel"
        ));
    }
    None
}

macro_rules! skip_unless_able {
    () => {
        if let Some(reason) = unavailable() {
            if std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1") {
                panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
            }
            eprintln!("skipped: {reason}");
            return;
        }
    };
}

fn config() -> ProbeConfig {
    ProbeConfig {
        file_size: FILE_SIZE,
        runtime: Duration::from_millis(200),
        rounds: 2,
        warmup: Duration::from_millis(20),
        ..ProbeConfig::default()
    }
}

fn fs() -> SyntheticFs {
    SyntheticFs {
        file_size: FILE_SIZE,
        open_flags: 0,
    }
}

/// Whether /proc/self/mountinfo lists a mount at `dir`.
fn is_mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let dir = dir.to_str().expect("UTF-8 scratch path");
    info.lines().any(|line| line.split(' ').nth(4) == Some(dir))
}

fn knob() -> String {
    std::fs::read_to_string(ENABLE_URING_KNOB)
        .expect("knob")
        .trim()
        .to_string()
}

fn expected(offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill_pattern(offset, &mut out);
    out
}

/// A 4 KiB-aligned buffer for O_DIRECT.
#[repr(C, align(4096))]
struct Block([u8; 4096]);

fn check_mount_serves_the_pattern(transport: Transport) {
    let cfg = config();
    let knob_before = knob();
    let knob_guard = (transport == Transport::IoUring)
        .then(|| fuse_uring::UringKnob::enable().expect("enable io_uring"));
    let mount = ProbeMount::start(transport, fs(), &cfg).expect("mount the probe");
    drop(knob_guard);
    assert_eq!(
        knob(),
        knob_before,
        "knob put back once the queues registered"
    );
    let dir = mount.dir().to_path_buf();
    assert!(is_mounted(&dir), "{} is mounted", dir.display());

    let (dev0, ring0, reads0) = mount.counters_now();
    // O_DIRECT 4 KiB reads, the last one short at the end of the file.
    let direct = mount.open_file(true).expect("O_DIRECT open");
    let mut block = Box::new(Block([0; 4096]));
    let last_block = FILE_SIZE / 4096 * 4096;
    let offsets = [0, 4096, 40 << 20, last_block - 4096, last_block];
    for offset in offsets {
        let n = direct
            .read_at(&mut block.0, offset)
            .expect("O_DIRECT pread");
        let want = (FILE_SIZE - offset).min(4096) as usize;
        assert_eq!(n, want, "bytes read at {offset}");
        assert!(
            block.0[..n] == expected(offset, n)[..],
            "{transport:?}: O_DIRECT bytes at {offset} are the pattern"
        );
    }
    let (dev1, ring1, reads1) = mount.counters_now();
    assert_eq!(
        reads1 - reads0,
        offsets.len() as u64,
        "every O_DIRECT pread reached the server as one READ, without FOPEN_DIRECT_IO"
    );
    match transport {
        Transport::IoUring => {
            assert!(
                ring1 - ring0 >= offsets.len() as u64,
                "READs came over the ring"
            );
            assert_eq!(dev1, dev0, "nothing but INIT/FORGET over /dev/fuse");
        }
        Transport::DevFuse => {
            assert_eq!(ring1, 0, "no ring on a /dev/fuse mount");
            assert!(dev1 - dev0 >= offsets.len() as u64);
        }
    }
    // Buffered reads at odd offsets and lengths (through the kernel page
    // cache, so in whole pages from the server) and the whole tail.
    let buffered = mount.open_file(false).expect("open");
    let mut odd = vec![0u8; 10_007];
    buffered.read_exact_at(&mut odd, 12_345).expect("read");
    assert!(
        odd == expected(12_345, odd.len()),
        "{transport:?}: buffered bytes"
    );
    let mut tail = Vec::new();
    let mut f = std::fs::File::open(mount.file_path()).expect("open");
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(FILE_SIZE - 5000)).expect("seek");
    f.read_to_end(&mut tail).expect("read to EOF");
    assert!(
        tail == expected(FILE_SIZE - 5000, 5000),
        "{transport:?}: tail"
    );
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["pattern"]);

    drop((direct, buffered, f));
    mount.finish().expect("clean unmount");
    assert!(
        !is_mounted(&dir),
        "{} still mounted after finish",
        dir.display()
    );
    assert!(!dir.exists(), "mount point removed");
}

#[test]
fn dev_fuse_mount_serves_the_pattern_and_unmounts() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    check_mount_serves_the_pattern(Transport::DevFuse);
}

#[test]
fn io_uring_mount_serves_the_pattern_and_unmounts() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    check_mount_serves_the_pattern(Transport::IoUring);
}

/// A probe that fails half-way (here: dropped while a file is open and
/// requests are in flight in another thread) leaves nothing mounted.
#[test]
fn a_mount_dropped_without_finishing_is_gone() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    let knob_before = knob();
    for transport in [Transport::DevFuse, Transport::IoUring] {
        let knob_guard = (transport == Transport::IoUring)
            .then(|| fuse_uring::UringKnob::enable().expect("enable io_uring"));
        let mount = ProbeMount::start(transport, fs(), &config()).expect("mount");
        drop(knob_guard);
        assert_eq!(knob(), knob_before, "knob put back");
        let dir = mount.dir().to_path_buf();
        let file = mount.open_file(false).expect("open");
        let mut buf = [0u8; 100];
        file.read_exact_at(&mut buf, 7).expect("read");
        assert!(is_mounted(&dir));
        drop(mount);
        assert!(
            !is_mounted(&dir),
            "{transport:?}: {} left mounted",
            dir.display()
        );
        assert!(!dir.exists(), "{transport:?}: mount point left behind");
        // The connection is gone: the open file now fails, no hang.
        let mut again = [0u8; 100];
        assert!(file.read_exact_at(&mut again, 1 << 20).is_err());
    }
}

/// The whole probe: both transports, both workloads, in rounds; its
/// counts say which way requests went.
#[test]
fn the_probe_measures_both_transports() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    let knob_before = knob();
    let report = transport_probe::run(&config()).expect("probe");
    assert_eq!(knob(), knob_before, "knob restored");
    assert_eq!(report.knob_before.as_deref(), Some(knob_before.as_str()));
    assert_eq!(report.measurements.len(), 4);
    for m in &report.measurements {
        assert!(m.ops > 0 && m.iops > 0.0, "{m:?}");
        assert_eq!(m.round_iops.len(), 2);
        assert!(m.p99_us >= m.p50_us && m.cpu_us_per_op > 0.0, "{m:?}");
        let (way, other) = match m.transport {
            Transport::IoUring => (m.ring_requests, m.dev_requests),
            Transport::DevFuse => (m.dev_requests, m.ring_requests),
        };
        assert!(way >= m.ops, "{m:?}: every op a request the asked way");
        assert_eq!(other, 0, "{m:?}: none the other way");
        let reads = if m.workload == Workload::RandRead4k {
            1.0
        } else {
            0.0
        };
        assert_eq!(m.server_reads_per_op, reads, "{m:?}");
    }
}

/// An unmount right after reads and a readdir, with RELEASE, RELEASEDIR
/// or readahead still queued, ends cleanly: the server thread that was
/// taking one of them off the queue when the unmount shut the connection
/// down (its read fails with ECONNABORTED) counts that as the end, not as
/// a failure. Before the fix about one round in 300 failed; CI saw it once.
#[test]
fn finishing_right_after_reads_is_clean() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    for round in 0..1000 {
        let mount = ProbeMount::start(Transport::DevFuse, fs(), &config()).expect("mount");
        let file = mount.open_file(false).expect("open");
        let mut odd = vec![0u8; 10_007];
        file.read_exact_at(&mut odd, 12_345).expect("read");
        let names: Vec<_> = std::fs::read_dir(mount.dir())
            .expect("readdir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["pattern"]);
        drop(file);
        if let Err(e) = mount.finish() {
            panic!("round {round}: {e}");
        }
    }
}

/// While one holder has the knob on, no other can take it (the lock file
/// is held), so one process putting the knob back cannot turn away another's
/// queue registrations; once it is put back, the next may.
#[test]
fn the_knob_is_held_by_one_process_at_a_time() {
    skip_unless_able!();
    let _turn = KNOB.lock().unwrap_or_else(|e| e.into_inner());
    let try_lock = || {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(fuse_uring::knob_lock_path())
            .expect("open the lock file");
        // SAFETY: flock on a descriptor we own; LOCK_NB never blocks.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        rc == 0
    };
    let knob = fuse_uring::UringKnob::enable().expect("enable io_uring");
    assert!(!try_lock(), "the lock is free while the knob is held");
    drop(knob);
    assert!(
        try_lock(),
        "the lock is still held after the knob went back"
    );
}
