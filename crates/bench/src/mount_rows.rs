//! The mount rows (`mount-*` workloads, all selected by `mount`): one fio
//! job ([`MountJob`]) on a file through the FUSE mount of iomapfs and on a
//! file of kernel XFS made on the same device, in the same run:
//! - `iomapfs-fuse`: a fresh volume on the device, mounted by this process
//!   with the code and defaults of `iomapfs mount` ([`iomapfs_mount::spawn`]:
//!   the same request handlers, threads and kernel options), so the
//!   daemon's CPU time is this process's;
//! - `iomapfs-fuse-uring`: the same over FUSE over io_uring (`-o uring`:
//!   one queue per CPU, served on that CPU), where the kernel has it;
//! - `iomapfs-fuse-uring-idle`: the same with its queue threads at
//!   `SCHED_IDLE` (`-o uring_idle`);
//! - `xfs`: mkfs.xfs and mount ([`kernel::with_mounted`]).
//!
//! On each, three fio runs of the same job line: the layout
//! (`create_only=1`), a warm-up for the warm-up time (buffered reads:
//! `pre_read=1`, so the file is in the cache), and the measured run, which
//! has no `ramp_time`. CPU then covers exactly the I/Os fio counts: fio's
//! whole process (wait4: job threads and io_uring's io-wq workers, where
//! the kernel's part of the request runs, the file system's for XFS), and
//! for the mount the daemon, i.e. this process over the measured run.

use std::path::Path;
use std::time::Duration;

use iomapfs_mount::MountConfig;

use crate::cpu::{CpuPerIoTime, CpuTime};
use crate::engine::Timing;
use crate::kernel::{self, FioRun, KernelFs};
use crate::report::{
    BenchReport, BenchResult, CpuPerIo, CPU_SCOPE_FIO_PROCESS, CPU_SCOPE_FUSE_DAEMON,
};
use crate::target::{format_and_mount, open_device, IOMAPFS_BLOCK_SIZE};
use crate::testbed::{is_root, BedDevice, Testbed, TEMP_PREFIX};
use crate::workload::{DeviceNeed, MountJob, Op, Order, Workload};
use crate::{recorded, skip, BenchError, BenchOptions, Progress};

/// The target name of the rows measured through the mount (over
/// `/dev/fuse`).
pub const TARGET: &str = "iomapfs-fuse";

/// The target name of the rows measured through the mount over FUSE over
/// io_uring (`-o uring`).
pub const URING_TARGET: &str = "iomapfs-fuse-uring";

/// The target name of the rows measured over io_uring with the queue
/// threads at `SCHED_IDLE` (`-o uring_idle`).
pub const URING_IDLE_TARGET: &str = "iomapfs-fuse-uring-idle";

/// The mount's targets: name, `-o uring`, `-o uring_idle`.
const MOUNT_TARGETS: [(&str, bool, bool); 3] = [
    (TARGET, false, false),
    (URING_TARGET, true, false),
    (URING_IDLE_TARGET, true, true),
];

/// Workload × target steps of a mount row, for the progress bar.
pub const STEPS: u64 = MOUNT_TARGETS.len() as u64 + 1;

fn is_mount_target(target: &str) -> bool {
    MOUNT_TARGETS.iter().any(|(name, _, _)| *name == target)
}

/// Said once in the report of a run with mount rows.
pub const NOTE: &str = "mount rows (mount-*): one fio job (numjobs=1) on a file through the \
     FUSE mount of iomapfs (iomapfs-fuse: a fresh volume, mounted by the bench process with \
     the handlers of `iomapfs mount` and the -o options its setup names; iomapfs-fuse-uring: \
     the same with -o uring, FUSE over io_uring; iomapfs-fuse-uring-idle: with -o uring_idle, \
     its queue threads at SCHED_IDLE) and on a file of XFS \
     made on the same device. Each file is laid out by a fio run of its own (create_only=1), then \
     warmed by a run of the warm-up time (buffered reads: pre_read=1), then measured by a run \
     without ramp_time, so CPU covers exactly the I/Os counted: fio µs/IO is the whole fio \
     process (wait4: its job thread and io_uring's io-wq workers, where the kernel's side of \
     each request runs), daemon µs/IO the bench process over the measured run (the mount's \
     request threads and iomapfs's own; the bench's main thread only polls fio every 20 ms), \
     cpu µs/IO their sum (xfs: fio alone). ×xfs is IOPS over xfs's row, cpu ×xfs cpu µs/IO \
     over xfs's.";

fn rw(job: &MountJob) -> &'static str {
    match (job.op, job.order) {
        (Op::Read, Order::Random) => "randread",
        (Op::Read, Order::Sequential) => "read",
        (Op::Write, Order::Random) => "randwrite",
        (Op::Write, Order::Sequential) => "write",
    }
}

/// The job line of `job` on `file` over `span` bytes, time based for
/// `runtime` (without the output arguments).
pub fn job_args(
    name: &str,
    job: &MountJob,
    file: &Path,
    span: u64,
    runtime: Duration,
) -> Vec<String> {
    let mut args = vec![
        format!("--name={name}"),
        format!("--filename={}", file.display()),
        format!("--size={span}"),
        format!("--rw={}", rw(job)),
        format!("--bs={}", job.io_size),
        format!("--direct={}", u8::from(job.direct)),
    ];
    if job.iodepth > 1 {
        args.extend([
            "--ioengine=io_uring".into(),
            format!("--iodepth={}", job.iodepth),
        ]);
    } else {
        args.extend(["--ioengine=psync".into(), "--iodepth=1".into()]);
    }
    if job.order == Order::Random {
        args.extend(["--norandommap".into(), "--randrepeat=0".into()]);
    }
    if job.op == Op::Write {
        // The file is laid out first: writes overwrite written blocks.
        args.push("--overwrite=1".into());
    }
    if !job.direct {
        // Keep what the warm-up cached: fio's default drops the file's
        // page cache at open.
        args.push("--invalidate=0".into());
    }
    args.extend([
        "--numjobs=1".into(),
        "--thread".into(),
        "--group_reporting".into(),
        "--lat_percentiles=1".into(),
        "--time_based".into(),
        format!("--runtime={}ms", runtime.as_millis().max(1)),
    ]);
    args
}

/// The run that lays the file out and exits.
pub fn layout_args(name: &str, job: &MountJob, file: &Path, span: u64) -> Vec<String> {
    let mut args = job_args(name, job, file, span, Duration::from_millis(1));
    args.push("--create_only=1".into());
    args
}

/// The warm-up run: the job for `warmup`; buffered reads first read the
/// whole file into the cache.
pub fn warmup_args(
    name: &str,
    job: &MountJob,
    file: &Path,
    span: u64,
    warmup: Duration,
) -> Vec<String> {
    let mut args = job_args(name, job, file, span, warmup);
    if !job.direct && job.op == Op::Read {
        args.push("--pre_read=1".into());
    }
    args
}

/// The measured run, its JSON report written to `output`.
pub fn measured_args(
    name: &str,
    job: &MountJob,
    file: &Path,
    span: u64,
    runtime: Duration,
    output: &Path,
) -> Vec<String> {
    let mut args = job_args(name, job, file, span, runtime);
    args.extend([
        "--output-format=json".into(),
        format!("--output={}", output.display()),
    ]);
    args
}

/// The three fio runs on one target.
struct Measured {
    run: FioRun,
    /// This process's CPU time over the measured run (the daemon's, for
    /// the mount).
    own_cpu: Option<CpuTime>,
    /// The layout and warm-up command lines, as run.
    preparation: String,
}

fn fio_runs(
    what: &str,
    name: &str,
    job: &MountJob,
    file: &Path,
    span: u64,
    timing: Timing,
) -> Result<Measured, BenchError> {
    let work = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempdir()
        .map_err(|e| BenchError::io("fio working directory", e))?;
    let (layout, _) = kernel::spawn_fio(
        what,
        &layout_args(name, job, file, span),
        timing,
        work.path(),
    )?;
    let (warmup, _) = kernel::spawn_fio(
        what,
        &warmup_args(name, job, file, span, timing.warmup),
        timing,
        work.path(),
    )?;
    let before = CpuTime::process().ok();
    let run = kernel::run_fio(what, timing, job.op, |output| {
        measured_args(name, job, file, span, timing.runtime, output)
    })?;
    let own_cpu = before
        .zip(CpuTime::process().ok())
        .map(|(before, after)| after.since(&before));
    Ok(Measured {
        run,
        own_cpu,
        preparation: format!("layout: {layout}; warm-up: {warmup}"),
    })
}

/// The file's size on `dev`: the job's, or half the device (whole MiB).
fn span_on(job: &MountJob, device_bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    job.span.min(device_bytes / 2 / MIB * MIB).max(MIB)
}

/// Why the mount over io_uring cannot be measured here, if it cannot
/// (beyond [`mount_unavailable`]).
fn uring_unavailable() -> Option<String> {
    (!Path::new(iomapfs_mount::fuse_uring::ENABLE_URING_KNOB).exists()).then(|| {
        "the kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)".into()
    })
}

/// Why the mount cannot be measured here, if it cannot.
fn mount_unavailable() -> Option<String> {
    if !is_root() {
        Some("not root: the bench mounts with mount(2)".into())
    } else if !Path::new("/dev/fuse").exists() {
        Some("no /dev/fuse (modprobe fuse)".into())
    } else if kernel::find_program("fio").is_none() {
        Some("fio not found (apt-get install fio)".into())
    } else {
        None
    }
}

fn measure_fuse(
    dev: &BedDevice,
    target: &str,
    fuse: &MountConfig,
    name: &str,
    job: &MountJob,
    span: u64,
    timing: Timing,
) -> Result<(Measured, String), BenchError> {
    let (device, _) = open_device(&dev.path, dev.backend.backend)?;
    let vol = format_and_mount(device)?;
    let dir = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempdir()
        .map_err(|e| BenchError::io("mount point", e))?;
    let cfg = MountConfig {
        fs_name: "iomapfs-bench".into(),
        ..fuse.clone()
    };
    let mount = iomapfs_mount::spawn(vol, dir.path(), &cfg)
        .map_err(|e| BenchError::failed(format!("{target} mount"), e.to_string()))?;
    let setup = format!(
        "iomapfs mkfs (block size {IOMAPFS_BLOCK_SIZE}) of {dev}, mounted at {at} by the bench \
         process as `iomapfs mount {dev} {at} -o {options}` would ({backend} backend)",
        dev = dev.path.display(),
        at = mount.path().display(),
        options = cfg.options(),
        backend = dev.backend.backend.as_str(),
    );
    let measured = fio_runs(
        target,
        name,
        job,
        &mount.path().join("bench.dat"),
        span,
        timing,
    );
    let unmounted = mount
        .unmount()
        .map_err(|e| BenchError::failed(format!("{target} unmount"), e.to_string()));
    let measured = measured?;
    unmounted?;
    Ok((measured, setup))
}

fn per_io(cpu: CpuPerIoTime, scope: &str, job_threads: Option<f64>) -> CpuPerIo {
    CpuPerIo {
        total_us: cpu.total_us(),
        user_us: cpu.user_us,
        system_us: cpu.system_us,
        scope: scope.into(),
        io_threads_us: job_threads,
    }
}

/// The row of one target, from its measured run.
fn row(w: &Workload, target: &str, dev: &BedDevice, m: &Measured, setup: String) -> BenchResult {
    let f = &m.run.figures;
    let ios = f.ios;
    let fio_cpu = m.run.process_cpu.per_io(ios);
    let cpu_per_io = fio_cpu.map(|c| {
        per_io(
            c,
            CPU_SCOPE_FIO_PROCESS,
            f.cpu.as_ref().ok().map(|j| j.total_us()),
        )
    });
    let daemon_cpu_per_io = is_mount_target(target)
        .then(|| m.own_cpu.and_then(|c| c.per_io(ios)))
        .flatten()
        .map(|c| per_io(c, CPU_SCOPE_FUSE_DAEMON, None));
    BenchResult {
        workload: w.name.into(),
        target: target.into(),
        device: dev.path.display().to_string(),
        iops: f.iops,
        bw_bytes: f.bw_bytes,
        lat_mean_ns: f.lat_mean_ns,
        lat_p99_ns: f.lat_p99_ns,
        cpu_note: cpu_per_io
            .is_none()
            .then(|| format!("fio counted no I/O ({ios})")),
        cpu_per_io,
        daemon_cpu_per_io,
        ops: Some(ios),
        backend: if is_mount_target(target) {
            dev.backend.backend.as_str().into()
        } else {
            "kernel".into()
        },
        command: m.run.command.clone(),
        setup: Some(format!("{setup}; {}", m.preparation)),
        ..BenchResult::default()
    }
}

/// CPU per I/O of a row, the daemon's included.
fn total_cpu_us(r: &BenchResult) -> Option<f64> {
    let fio = r.cpu_per_io.as_ref()?.total_us;
    let daemon = r.daemon_cpu_per_io.as_ref().map_or(0.0, |c| c.total_us);
    Some(fio + daemon)
}

/// Ratios of every row to the xfs row among them.
fn apply_ratios(rows: &mut [BenchResult]) {
    let Some(xfs) = rows.iter().find(|r| r.target == "xfs").cloned() else {
        return;
    };
    for r in rows {
        r.ratio_to_xfs = (xfs.iops > 0.0).then(|| r.iops / xfs.iops);
        r.cpu_ratio_to_xfs = total_cpu_us(r)
            .zip(total_cpu_us(&xfs))
            .filter(|(_, x)| *x > 0.0)
            .map(|(c, x)| c / x);
    }
}

/// Runs one mount row on the mount and on XFS and appends its rows.
pub fn run_workload(
    w: &Workload,
    job: &MountJob,
    bed: &Testbed,
    opts: &BenchOptions,
    timing: Timing,
    progress: &dyn Progress,
    report: &mut BenchReport,
) -> Result<(), BenchError> {
    let dev = bed.device(DeviceNeed::Any);
    let span = span_on(job, dev.caps.size_bytes);
    let say =
        |target: &str, what: &str| progress.set_message(&format!("{} · {target}: {what}", w.name));
    let mut rows = Vec::new();

    for (target, uring, uring_idle) in MOUNT_TARGETS {
        let why_not = mount_unavailable().or_else(|| uring.then(uring_unavailable).flatten());
        match why_not {
            Some(reason) => skip(report, w.name, target, reason),
            None => {
                say(target, "mkfs, mount, fio layout, warm-up, measuring");
                let fuse = MountConfig {
                    uring,
                    uring_idle,
                    ..opts.fuse.clone()
                };
                let measured = measure_fuse(dev, target, &fuse, w.name, job, span, timing);
                if let Some((m, setup)) = recorded(measured, report, w.name, target)? {
                    rows.push(row(w, target, dev, &m, setup));
                }
            }
        }
        progress.inc(1);
    }

    let xfs = KernelFs::Xfs;
    match kernel::unavailable(opts.no_kernel).or_else(|| kernel::unavailable_on(xfs, dev)) {
        Some(reason) => skip(report, w.name, xfs.name(), reason),
        None => {
            say(xfs.name(), "mkfs, mount, fio layout, warm-up, measuring");
            let measured = kernel::with_mounted(xfs, dev, |file| {
                fio_runs(xfs.name(), w.name, job, file, span, timing)
            });
            if let Some((m, setup)) = recorded(measured, report, w.name, xfs.name())? {
                rows.push(row(w, xfs.name(), dev, &m, setup));
            }
        }
    }
    progress.inc(1);

    apply_ratios(&mut rows);
    report.results.extend(rows);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{all, select, Kind, MOUNT_GROUP};

    fn job(name: &str) -> MountJob {
        match select(&[name.to_string()]).unwrap()[0].kind {
            Kind::Mount(job) => job,
            _ => panic!("{name} is not a mount row"),
        }
    }

    fn has(args: &[String], want: &str) -> bool {
        args.iter().any(|a| a == want)
    }

    #[test]
    fn fio_job_lines_are_the_rows_jobs() {
        let file = Path::new("/m/bench.dat");
        let runtime = Duration::from_secs(5);
        let common = [
            "--filename=/m/bench.dat",
            "--numjobs=1",
            "--thread",
            "--time_based",
            "--runtime=5000ms",
        ];
        for (name, want, not) in [
            (
                "mount-randread-4k-qd1",
                &[
                    "--rw=randread",
                    "--bs=4096",
                    "--direct=1",
                    "--ioengine=psync",
                    "--iodepth=1",
                    "--norandommap",
                    "--size=268435456",
                ][..],
                &["--overwrite=1", "--invalidate=0", "--ioengine=io_uring"][..],
            ),
            (
                "mount-randread-4k-qd32",
                &["--rw=randread", "--ioengine=io_uring", "--iodepth=32"][..],
                &["--ioengine=psync", "--numjobs=32"][..],
            ),
            (
                "mount-read-1m",
                &[
                    "--rw=read",
                    "--bs=1048576",
                    "--direct=1",
                    "--ioengine=psync",
                ][..],
                &["--norandommap", "--overwrite=1"][..],
            ),
            (
                "mount-write-1m",
                &["--rw=write", "--bs=1048576", "--direct=1", "--overwrite=1"][..],
                &["--norandommap", "--invalidate=0"][..],
            ),
            (
                "mount-buffered-randread-4k",
                &[
                    "--rw=randread",
                    "--direct=0",
                    "--invalidate=0",
                    "--size=67108864",
                ][..],
                &["--overwrite=1", "--pre_read=1"][..],
            ),
            (
                "mount-buffered-randwrite-4k",
                &[
                    "--rw=randwrite",
                    "--direct=0",
                    "--invalidate=0",
                    "--overwrite=1",
                ][..],
                &["--pre_read=1", "--end_fsync=1"][..],
            ),
        ] {
            let j = job(name);
            let out = Path::new("/o/fio.json");
            let args = measured_args(name, &j, file, j.span, runtime, out);
            assert!(has(&args, &format!("--name={name}")), "{args:?}");
            for want in common.iter().chain(want) {
                assert!(has(&args, want), "{name}: {want} missing from {args:?}");
            }
            for not in not {
                assert!(!has(&args, not), "{name}: {not} in {args:?}");
            }
            // No ramp: CPU of the whole run is divided by its I/Os.
            assert!(
                !args.iter().any(|a| a.starts_with("--ramp_time")),
                "{args:?}"
            );
            assert!(has(&args, "--output=/o/fio.json") && has(&args, "--output-format=json"));
            // The layout run only lays out; the warm-up runs the job for
            // the warm-up time and reads a buffered file into the cache.
            let layout = layout_args(name, &j, file, j.span);
            assert!(has(&layout, "--create_only=1"), "{layout:?}");
            let warm = warmup_args(name, &j, file, j.span, Duration::from_millis(500));
            assert!(has(&warm, "--runtime=500ms"), "{warm:?}");
            let reads_cache = !j.direct && j.op == Op::Read;
            assert_eq!(has(&warm, "--pre_read=1"), reads_cache, "{name}: {warm:?}");
            assert!(!has(&warm, "--create_only=1") && !has(&args, "--create_only=1"));
        }
    }

    #[test]
    fn the_group_name_selects_every_mount_row_and_nothing_else() {
        let picked: Vec<&str> = select(&[MOUNT_GROUP.into()])
            .unwrap()
            .iter()
            .map(|w| w.name)
            .collect();
        let mounts: Vec<&str> = all()
            .filter(|w| matches!(w.kind, Kind::Mount(_)))
            .map(|w| w.name)
            .collect();
        assert_eq!(picked, mounts);
        assert_eq!(picked.len(), 6);
        assert!(picked.iter().all(|n| n.starts_with("mount-")));
        // The group and a member: each workload once.
        let again = select(&["mount-read-1m".into(), MOUNT_GROUP.into()]).unwrap();
        assert_eq!(again.len(), 6);
    }

    #[test]
    fn ratios_count_the_daemon_with_fio() {
        let cpu = |us: f64| {
            Some(CpuPerIo {
                total_us: us,
                user_us: us,
                system_us: 0.0,
                scope: CPU_SCOPE_FIO_PROCESS.into(),
                io_threads_us: None,
            })
        };
        let mut rows = vec![
            BenchResult {
                target: TARGET.into(),
                iops: 50.0,
                cpu_per_io: cpu(3.0),
                daemon_cpu_per_io: cpu(5.0),
                ..BenchResult::default()
            },
            BenchResult {
                target: "xfs".into(),
                iops: 100.0,
                cpu_per_io: cpu(4.0),
                ..BenchResult::default()
            },
        ];
        apply_ratios(&mut rows);
        assert_eq!(rows[0].ratio_to_xfs, Some(0.5));
        assert_eq!(rows[0].cpu_ratio_to_xfs, Some(2.0));
        assert_eq!(rows[1].ratio_to_xfs, Some(1.0));
        assert_eq!(rows[1].cpu_ratio_to_xfs, Some(1.0));
        // Without xfs there is nothing to compare with.
        let mut alone = vec![rows[0].clone()];
        alone[0].ratio_to_xfs = None;
        alone[0].cpu_ratio_to_xfs = None;
        apply_ratios(&mut alone);
        assert_eq!(alone[0].ratio_to_xfs, None);
    }
}
