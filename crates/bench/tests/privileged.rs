//! The default bed (zram + loop on tmpfs) is set up and torn down: after a
//! normal run, and after a run stopped by a real SIGINT. Needs root and zram;
//! skipped with a printed reason otherwise, and failed instead when
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).
//!
//! One test function on purpose: the interrupt flag is process-wide, so the
//! interrupted run must not overlap another run in this binary.

use std::cell::Cell;
use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use iomapfs_bench::{run, BenchError, BenchOptions, BenchReport, Progress, LOCK_PATH};

fn require_privileged() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new("/sys/block/zram0").exists() {
        return Some("no /sys/block/zram0 (modprobe zram)".into());
    }
    if !["/usr/sbin/losetup", "/sbin/losetup", "/usr/bin/losetup"]
        .iter()
        .any(|p| Path::new(p).exists())
    {
        return Some("losetup not found".into());
    }
    None
}

/// Holds the bench lock while checking, so no other bench is mid-setup.
struct Locked(#[allow(dead_code)] fs::File);

fn lock() -> Locked {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(LOCK_PATH)
        .unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }, 0);
    Locked(file)
}

/// What a run left behind, checked under the lock: zram reset if it was
/// used, loop devices detached and backing files gone, nothing of ours
/// mounted.
fn assert_torn_down(report_devices: &[(String, String, Option<String>)], used_zram: bool) {
    let _held = lock();
    if used_zram {
        let size = fs::read_to_string("/sys/block/zram0/disksize").unwrap();
        assert_eq!(size.trim(), "0", "zram0 was not reset");
    }
    for (path, kind, backing) in report_devices {
        if !kind.starts_with("loop") {
            continue;
        }
        let backing = backing
            .as_deref()
            .expect("loop device reports its backing file");
        assert!(!Path::new(backing).exists(), "{backing} was not removed");
        let name = Path::new(path)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let attached = fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            .map(|b| b.trim().trim_end_matches(" (deleted)").to_string())
            .unwrap_or_default();
        assert_ne!(attached, backing, "{path} is still attached to {backing}");
    }
    let ours: Vec<&str> = report_devices.iter().map(|(p, _, _)| p.as_str()).collect();
    let left: Vec<String> = bench_mounts()
        .into_iter()
        .filter(|m| ours.iter().any(|d| m.starts_with(&format!("{d} "))))
        .collect();
    assert!(left.is_empty(), "bench mounts left behind: {left:?}");
}

/// Mounts on bench temp directories, as "SOURCE POINT".
fn bench_mounts() -> Vec<String> {
    fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.contains("iomapfs-bench-"))
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect()
}

fn devices_of(report: &BenchReport) -> Vec<(String, String, Option<String>)> {
    report
        .machine
        .devices
        .iter()
        .map(|d| (d.path.clone(), d.kind.clone(), d.backing_file.clone()))
        .collect()
}

/// Sends SIGINT to the process once the run starts measuring, and records
/// every message so the test can see where the run had got to.
struct InterruptWhenMeasuring {
    sent: Cell<bool>,
    messages: std::cell::RefCell<Vec<String>>,
    finished: Cell<bool>,
}

impl Progress for InterruptWhenMeasuring {
    fn set_message(&self, message: &str) {
        self.messages.borrow_mut().push(message.to_string());
        if message.contains("measuring") && !self.sent.get() {
            self.sent.set(true);
            // SAFETY: sending a signal to ourselves; run() has installed a
            // handler that only sets a flag.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGINT);
            }
        }
    }
    fn inc(&self, _steps: u64) {}
    fn finish(&self) {
        self.finished.set(true);
    }
}

/// Loop devices whose backing file is in a bench temp directory.
fn bench_loops() -> Vec<String> {
    fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let b = fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            b.contains("iomapfs-bench-")
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

#[test]
fn default_bed_is_set_up_and_always_torn_down() {
    if let Some(reason) = unavailable() {
        if require_privileged() {
            panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
        }
        eprintln!("skipped: {reason}");
        return;
    }

    // 1. A normal run: one 4 KiB workload (zram) and the DSYNC one (loop),
    //    with kernel file systems when fio and mkfs are present.
    let opts = BenchOptions {
        runtime: Duration::from_millis(200),
        workloads: vec!["randread-4k-qd1".into(), "dsync-overwrite-4k".into()],
        ..BenchOptions::default()
    };
    let report = run(&opts, &iomapfs_bench::NoProgress).unwrap();
    eprintln!("{}", iomapfs_bench::render_table(&report));
    let kinds: Vec<&str> = report
        .machine
        .devices
        .iter()
        .map(|d| d.kind.as_str())
        .collect();
    let used_zram = kinds.contains(&"zram");
    if !used_zram {
        let why = report.notes.join("; ");
        assert!(
            !require_privileged() || why.contains("in use"),
            "zram not used: {why}"
        );
        eprintln!("zram was not used: {why}");
    }
    assert!(kinds.iter().any(|k| k.starts_with("loop")), "{kinds:?}");
    for w in ["randread-4k-qd1", "dsync-overwrite-4k"] {
        for t in ["raw", "iomapfs"] {
            assert!(
                report
                    .results
                    .iter()
                    .any(|r| r.workload == w && r.target == t && r.iops > 0.0),
                "{w}/{t} missing: {:?}",
                report.skipped
            );
        }
    }
    // The DSYNC workload ran on the loop device, which has a volatile cache.
    let dsync = report
        .results
        .iter()
        .find(|r| r.workload == "dsync-overwrite-4k" && r.target == "iomapfs")
        .unwrap();
    let loop_dev = report
        .machine
        .devices
        .iter()
        .find(|d| d.path == dsync.device)
        .unwrap();
    assert!(loop_dev.volatile_write_cache && loop_dev.logical_block_size == 512);
    let req = dsync.device_requests.unwrap();
    assert!(req.flushes + req.fua_writes >= dsync.ops.unwrap());
    assert!(
        report.notes.iter().all(|n| !n.starts_with("teardown")),
        "{:?}",
        report.notes
    );
    assert_torn_down(&devices_of(&report), used_zram);

    // 2. Ctrl-C (a real SIGINT) in the middle of measuring: the run stops
    //    early with Interrupted, and everything is still torn down.
    let loops_before = bench_loops();
    let mounts_before = bench_mounts();
    let progress = InterruptWhenMeasuring {
        sent: Cell::new(false),
        messages: Default::default(),
        finished: Cell::new(false),
    };
    let opts = BenchOptions {
        runtime: Duration::from_secs(20),
        workloads: vec!["randread-4k-qd1".into(), "overwrite-2k-unaligned".into()],
        no_kernel: true,
        ..BenchOptions::default()
    };
    let sigint_before = sigint_handler();
    let started = Instant::now();
    let err = run(&opts, &progress).unwrap_err();
    assert!(matches!(err, BenchError::Interrupted), "{err}");
    assert!(progress.sent.get() && progress.finished.get());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "stop took {:?}",
        started.elapsed()
    );
    {
        let _held = lock();
        if used_zram {
            let size = fs::read_to_string("/sys/block/zram0/disksize").unwrap();
            assert_eq!(size.trim(), "0", "zram0 not reset after interrupt");
        }
        let left: Vec<_> = bench_loops()
            .into_iter()
            .filter(|l| !loops_before.contains(l))
            .collect();
        assert!(left.is_empty(), "loop devices left attached: {left:?}");
        let left: Vec<_> = bench_mounts()
            .into_iter()
            .filter(|m| !mounts_before.contains(m))
            .collect();
        assert!(left.is_empty(), "bench mounts left behind: {left:?}");
    }
    assert_eq!(
        sigint_handler(),
        sigint_before,
        "SIGINT handler not restored"
    );
    eprintln!(
        "interrupted run's progress: {:?}",
        progress.messages.borrow()
    );
}

/// The current SIGINT disposition.
fn sigint_handler() -> libc::sighandler_t {
    // SAFETY: querying only (null new action) into a zeroed struct we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(libc::SIGINT, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}
