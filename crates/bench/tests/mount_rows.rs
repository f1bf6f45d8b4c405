//! One short mount row end to end: fio through the FUSE mount the bench
//! serves itself and on XFS, on the default bed, with CPU per I/O of fio
//! and of the daemon, and nothing left mounted afterwards. Needs root,
//! /dev/fuse, fio, mkfs.xfs and zram or loop devices; skipped with a
//! printed reason otherwise, and failed instead when
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

use std::path::Path;
use std::time::Duration;

use iomapfs_bench::{run, BenchOptions, NoProgress, CPU_SCOPE_FIO_PROCESS, CPU_SCOPE_FUSE_DAEMON};

fn require_privileged() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

fn on_path(name: &str) -> bool {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .any(|d| Path::new(d).join(name).exists())
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse (modprobe fuse)".into());
    }
    for program in ["fio", "mkfs.xfs", "losetup"] {
        if !on_path(program) {
            return Some(format!("{program} not found"));
        }
    }
    None
}

/// Mounts whose source or point is the bench's.
fn bench_mounts() -> Vec<String> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.contains("iomapfs-bench"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_mount_row_measures_fio_through_the_mount_and_on_xfs() {
    if let Some(why) = unavailable() {
        assert!(
            !require_privileged(),
            "IOMAPFS_REQUIRE_PRIVILEGED=1 but {why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let opts = BenchOptions {
        runtime: Duration::from_millis(400),
        workloads: vec!["mount-randread-4k-qd1".into()],
        ..BenchOptions::default()
    };
    let report = run(&opts, &NoProgress).unwrap();
    // Without FUSE over io_uring its two targets are skipped, saying so,
    // and the rest is measured.
    let has_uring = Path::new("/sys/module/fuse/parameters/enable_uring").exists();
    if has_uring {
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    } else {
        let skipped = format!("{:?}", report.skipped);
        assert_eq!(report.skipped.len(), 2, "{skipped}");
        assert!(skipped.contains("no FUSE over io_uring"), "{skipped}");
        eprintln!("FUSE over io_uring targets skipped: {skipped}");
    }
    assert!(
        report.notes.iter().any(|n| n.starts_with("mount rows")),
        "{:?}",
        report.notes
    );
    let row = |target: &str| {
        report
            .results
            .iter()
            .find(|r| r.target == target)
            .unwrap_or_else(|| panic!("no {target} row in {:?}", report.results))
    };
    let (fuse, xfs) = (row("iomapfs-fuse"), row("xfs"));
    let uring_rows = has_uring.then(|| (row("iomapfs-fuse-uring"), row("iomapfs-fuse-uring-idle")));
    assert_eq!(report.results.len(), if has_uring { 4 } else { 2 });
    let mut rows = vec![fuse, xfs];
    rows.extend(uring_rows.iter().flat_map(|(u, i)| [*u, *i]));
    for r in rows {
        assert_eq!(r.workload, "mount-randread-4k-qd1");
        let ops = r.ops.expect("I/O count");
        assert!(ops > 0 && r.iops > 0.0, "{r:?}");
        // 4 KiB reads: bandwidth is IOPS × 4 KiB.
        assert!((r.bw_bytes / r.iops - 4096.0).abs() < 1.0, "{r:?}");
        assert!(r.lat_mean_ns > 0.0, "{r:?}");
        let cpu = r.cpu_per_io.as_ref().expect("fio's CPU per I/O");
        assert_eq!(cpu.scope, CPU_SCOPE_FIO_PROCESS);
        assert!(cpu.total_us > 0.0, "{r:?}");
        // The exact fio line, measured on the target's file.
        for want in [
            "--rw=randread",
            "--bs=4096",
            "--direct=1",
            "--ioengine=psync",
        ] {
            assert!(r.command.contains(want), "{want}: {}", r.command);
        }
        assert!(r.command.starts_with("fio --name=mount-randread-4k-qd1 "));
        let setup = r.setup.as_deref().unwrap();
        assert!(setup.contains("--create_only=1"), "{setup}");
        assert!(!r.command.contains("--ramp_time"), "{}", r.command);
    }
    // The daemon's CPU is counted beside fio's; xfs has no daemon.
    let daemon = fuse.daemon_cpu_per_io.as_ref().expect("daemon CPU");
    assert_eq!(daemon.scope, CPU_SCOPE_FUSE_DAEMON);
    // Every request crosses into the daemon: it reads /dev/fuse, reads
    // the device and answers, in system calls.
    assert!(daemon.system_us > 0.5, "{daemon:?}");
    assert!(xfs.daemon_cpu_per_io.is_none());
    assert!(fuse.setup.as_deref().unwrap().contains("iomapfs mount"));
    assert!(!fuse.setup.as_deref().unwrap().contains("uring"));
    // The same over FUSE over io_uring: mounts of their own, named so.
    if let Some((uring, idle)) = uring_rows {
        let uring_setup = uring.setup.as_deref().unwrap();
        assert!(
            uring_setup.contains("-o threads=4,kernel_cache,uring`"),
            "{uring_setup}"
        );
        let uring_daemon = uring
            .daemon_cpu_per_io
            .as_ref()
            .expect("daemon CPU over io_uring");
        assert_eq!(uring_daemon.scope, CPU_SCOPE_FUSE_DAEMON);
        assert!((uring.ratio_to_xfs.expect("×xfs") - uring.iops / xfs.iops).abs() < 1e-9);
        let idle_setup = idle.setup.as_deref().unwrap();
        assert!(
            idle_setup.contains("-o threads=4,kernel_cache,uring_idle`"),
            "{idle_setup}"
        );
        assert!(idle.daemon_cpu_per_io.is_some());
    }
    let ratio = fuse.ratio_to_xfs.expect("×xfs");
    assert!((ratio - fuse.iops / xfs.iops).abs() < 1e-9);
    let cpu_ratio = fuse.cpu_ratio_to_xfs.expect("cpu ×xfs");
    let sum = fuse.cpu_per_io.as_ref().unwrap().total_us + daemon.total_us;
    let xfs_cpu = xfs.cpu_per_io.as_ref().unwrap().total_us;
    assert!((cpu_ratio - sum / xfs_cpu).abs() < 1e-9);
    assert_eq!(xfs.ratio_to_xfs, Some(1.0));
    // The table shows them in a table of their own.
    let table = iomapfs_bench::render_table(&report);
    assert!(table.contains("through the FUSE mount"), "{table}");
    assert!(table.contains("iomapfs-fuse "), "{table}");
    if has_uring {
        assert!(table.contains("iomapfs-fuse-uring "), "{table}");
        assert!(table.contains("iomapfs-fuse-uring-idle"), "{table}");
    }
    // Nothing of the run is still mounted: the FUSE mount, XFS.
    assert!(bench_mounts().is_empty(), "{:?}", bench_mounts());
}
