//! One fio row end to end on the default bed: every target measured by
//! fio on the same device, iomapfs through the fio engine, with the exact
//! command lines in the report. Needs root (zram, mkfs, mount), fio and
//! the built engine (`make -C fio-engine`, or `$IOMAPFS_FIO_ENGINE`);
//! skipped with a printed reason otherwise, and failed instead when
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

use std::path::{Path, PathBuf};
use std::time::Duration;

use iomapfs_bench::{run, BenchOptions, BenchResult, NoProgress, CPU_SCOPE_FIO_PROCESS};

const ROW: &str = "fio-randread-4k-qd1";

fn require_privileged() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .any(|dir| dir.join(program).is_file())
}

/// The engine, or why this machine cannot run the test.
fn prerequisites() -> Result<PathBuf, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    if !on_path("fio") {
        return Err("fio not found (apt-get install fio)".into());
    }
    for mkfs in ["mkfs.xfs", "mkfs.ext4"] {
        if !on_path(mkfs) {
            return Err(format!("{mkfs} not found"));
        }
    }
    let engine = std::env::var_os("IOMAPFS_FIO_ENGINE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fio-engine/build/libiomapfs_fio.so")
        });
    if !engine.is_file() {
        return Err(format!(
            "{} not built (make -C fio-engine)",
            engine.display()
        ));
    }
    Ok(engine)
}

fn target<'a>(results: &'a [BenchResult], name: &str) -> &'a BenchResult {
    results
        .iter()
        .find(|r| r.workload == ROW && r.target == name)
        .unwrap_or_else(|| panic!("no {ROW} {name} row in {results:#?}"))
}

#[test]
fn a_fio_row_measures_every_target_through_fio_on_one_device() {
    let engine = match prerequisites() {
        Ok(engine) => engine,
        Err(reason) => {
            if require_privileged() {
                panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
            }
            eprintln!("skipped: {reason}");
            return;
        }
    };
    let opts = BenchOptions {
        runtime: Duration::from_millis(400),
        workloads: vec![ROW.into()],
        fio_only: true,
        fio_engine: Some(engine.clone()),
        ..BenchOptions::default()
    };
    let report = run(&opts, &NoProgress).unwrap();
    eprintln!("{}", iomapfs_bench::render_table(&report));
    assert!(report.skipped.is_empty(), "{:#?}", report.skipped);
    let results = &report.results;
    assert_eq!(results.len(), 4, "{results:#?}");
    let raw = target(results, "raw");
    let device = raw.device.clone();
    for r in results {
        assert_eq!(r.harness.as_deref(), Some("fio"), "{r:#?}");
        assert_eq!(r.device, device, "one device for every target");
        assert!(r.iops > 0.0 && r.ops.unwrap() > 0, "{r:#?}");
        let cpu = r.cpu_per_io.as_ref().unwrap();
        assert_eq!(cpu.scope, CPU_SCOPE_FIO_PROCESS);
        // The job threads are part of the process (a tick of slack).
        let jobs = cpu.io_threads_us.unwrap();
        assert!(jobs > 0.0 && jobs <= cpu.total_us * 1.5 + 1.0, "{cpu:?}");
        let ratio = r.ratio_to_raw.unwrap();
        assert!((ratio - r.iops / raw.iops).abs() < 1e-9, "{r:#?}");
        // Measured by fio, with no warm-up to fall outside the CPU window.
        assert!(r.command.starts_with("fio --name=fio-randread-4k-qd1 "));
        assert!(r.command.contains("--rw=randread") && r.command.contains("--iodepth=1"));
        assert!(!r.command.contains("--ramp_time"), "{}", r.command);
        assert!(!r.command.contains("--create_only"), "{}", r.command);
    }
    // The raw device: two halves through io_uring, each after writing the
    // span once.
    assert_eq!(
        raw.command.matches("fio --name").count(),
        2,
        "{}",
        raw.command
    );
    assert_eq!(
        raw.command.matches("--ioengine=io_uring").count(),
        2,
        "{}",
        raw.command
    );
    assert!(raw.command.contains(&format!("--filename={device} ")));
    let setup = raw.setup.as_deref().unwrap();
    assert_eq!(setup.matches("--rw=write --bs=1m").count(), 2, "{setup}");
    assert_eq!(raw.ratio_to_raw, Some(1.0));
    // iomapfs: the fio engine on a volume on the same device, formatted and
    // laid out by fio first.
    let fs = target(results, "iomapfs");
    assert!(
        fs.command
            .contains(&format!("--ioengine=external:{}", engine.display())),
        "{}",
        fs.command
    );
    assert!(fs.command.contains(&format!("--iomapfs_volume={device} ")));
    let setup = fs.setup.as_deref().unwrap();
    assert!(setup.contains("--create_only=1") && setup.contains("--iomapfs_mkfs=1"));
    // Kernel file systems: mkfs and mount, fio's layout, then the job on a
    // file through io_uring.
    for fs in ["xfs", "ext4"] {
        let r = target(results, fs);
        let setup = r.setup.as_deref().unwrap();
        assert!(
            setup.starts_with(&format!("mkfs.{fs} ")) && setup.contains(&device),
            "{setup}"
        );
        assert!(setup.contains("--create_only=1"), "{setup}");
        assert!(r.command.contains("--ioengine=io_uring"), "{}", r.command);
        assert!(r.command.contains("/bench.dat "), "{}", r.command);
    }
    let xfs = target(results, "xfs");
    assert_eq!(xfs.ratio_to_xfs, Some(1.0));
    let fs = target(results, "iomapfs");
    assert!((fs.ratio_to_xfs.unwrap() - fs.iops / xfs.iops).abs() < 1e-9);
    assert!(
        report.notes.iter().all(|n| !n.starts_with("teardown")),
        "{:?}",
        report.notes
    );
}
