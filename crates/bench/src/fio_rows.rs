//! The fio rows: one harness for every target. Each fio row
//! ([`FioJob`], the fio job line a kernel thread measured with, scaled to
//! this machine) runs as one fio job, on the same device in the same run,
//! against
//! - `raw`: the device itself, fio's `io_uring` (or `psync`) engine;
//! - `iomapfs`: a fresh volume on the device, through the fio engine
//!   `iomapfs` (`fio-engine/`, `--ioengine=external:...`), on the backend
//!   of the raw device's fio engine (io_uring, or sync for psync), or the
//!   worker pool where the device got it (see `iomapfs_backend`);
//! - `xfs`, `ext4`: a file on the kernel file system made on the device,
//!   fio's `io_uring` (or `psync`) engine (mkfs and mount: [`kernel`]).
//!
//! Each target's file is laid out by a fio run of its own before the
//! measured one (`create_only=1`: fio's layout, the engine's for iomapfs;
//! the raw device has no layout, so its span is written once with 1 MiB
//! writes), so the measured run is I/O only. It has no `ramp_time`: the
//! CPU time of the whole fio process (wait4), which counts what runs
//! outside fio's job threads (the engine's completion worker, io_uring's
//! io-wq workers), then covers the same I/Os as fio's counts. The raw
//! device is measured for half the runtime before iomapfs and half after,
//! as in the engine rows. Every fio command line, preparation included, is
//! in the result.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cpu::{CpuPerIoTime, CpuTime};
use crate::engine::Timing;
use crate::kernel::{self, FioRun};
use crate::report::{BenchReport, BenchResult, CpuPerIo, CPU_SCOPE_FIO_PROCESS};
use crate::target::IOMAPFS_FILE;
use crate::testbed::{BedDevice, Testbed};
use crate::workload::{FioEngine, FioJob, Workload};
use crate::{recorded, skip, span_for, Backend, BenchError, BenchOptions, Progress, TARGETS};

/// Said once in the report of a run with fio rows.
pub const NOTE: &str = "fio rows (fio-*): every target measured by fio with the same job \
     line: raw (the device, fio io_uring or psync), iomapfs (the fio engine iomapfs on a fresh \
     volume, on iomapfs's io_uring backend for io_uring rows, or its worker pool where the \
     device got it (no NOWAIT: zram), and its sync one for psync, as raw; at iodepth 1 it makes synchronous calls either way), xfs and ext4 (a file, fio io_uring or psync). Files are laid out by a separate \
     fio run first (create_only=1; raw: its span written once), and the measured run has no \
     ramp_time, so cpu µs/IO, the fio process's CPU time (wait4: all its threads, the \
     engine's completion worker and io_uring's io-wq workers too) per I/O, covers the I/Os \
     counted; jobs µs/IO is fio's job threads' share. ×xfs is IOPS over xfs's row.";

/// Where a fio row runs.
#[derive(Clone, Debug, PartialEq)]
pub enum FioTarget {
    /// The device (or image file) itself.
    Raw { device: PathBuf },
    /// iomapfs on the device, through the fio engine.
    Iomapfs {
        engine: PathBuf,
        device: PathBuf,
        backend: Backend,
    },
    /// A file on a mounted kernel file system.
    KernelFile { file: PathBuf },
}

/// The arguments naming the file and the I/O engine on `target`.
fn target_args(job: &FioJob, target: &FioTarget) -> Vec<String> {
    match target {
        FioTarget::Raw { device } => vec![
            format!("--filename={}", device.display()),
            format!("--ioengine={}", job.engine.name()),
        ],
        FioTarget::Iomapfs {
            engine,
            device,
            backend,
        } => vec![
            format!("--ioengine=external:{}", engine.display()),
            format!("--iomapfs_volume={}", device.display()),
            format!("--iomapfs_backend={}", backend.as_str()),
            format!("--filename={IOMAPFS_FILE}"),
        ],
        FioTarget::KernelFile { file } => vec![
            format!("--filename={}", file.display()),
            format!("--ioengine={}", job.engine.name()),
        ],
    }
}

/// The job line of `job` on `target` over a `span`-byte file, measured for
/// `runtime` (fio's JSON output arguments come from [`kernel::run_fio`]).
pub fn job_args(
    name: &str,
    job: &FioJob,
    target: &FioTarget,
    span: u64,
    runtime: Duration,
) -> Vec<String> {
    let p = &job.pattern;
    let mut args = vec![format!("--name={name}")];
    args.extend(target_args(job, target));
    args.push(format!("--size={span}"));
    args.extend(kernel::pattern_args(p));
    let depth = match job.engine {
        FioEngine::IoUring => p.queue_depth,
        FioEngine::Psync => 1,
    };
    args.extend([
        format!("--iodepth={depth}"),
        format!("--numjobs={}", job.numjobs),
        "--thread".into(),
        "--group_reporting".into(),
        "--lat_percentiles=1".into(),
        "--time_based".into(),
        format!("--runtime={}ms", runtime.as_millis().max(1)),
    ]);
    args
}

/// The fio run that prepares `target` for `job`: the same job with
/// `create_only=1` (fio lays the file out as it would for the job; on
/// iomapfs the engine does, after formatting the volume), or, on the raw
/// device, which fio never lays out, the span written once.
pub fn prepare_args(name: &str, job: &FioJob, target: &FioTarget, span: u64) -> Vec<String> {
    match target {
        FioTarget::Raw { device } => vec![
            format!("--name={name}-prefill"),
            format!("--filename={}", device.display()),
            format!("--size={span}"),
            "--direct=1".into(),
            "--rw=write".into(),
            "--bs=1m".into(),
            "--ioengine=psync".into(),
            "--thread".into(),
        ],
        FioTarget::Iomapfs { .. } | FioTarget::KernelFile { .. } => {
            let mut args = job_args(name, job, target, span, Duration::from_millis(1));
            if matches!(target, FioTarget::Iomapfs { .. }) {
                args.push("--iomapfs_mkfs=1".into());
            }
            args.push("--create_only=1".into());
            args
        }
    }
}

/// The fio engine: `explicit` (`--fio-engine`), else
/// `$IOMAPFS_FIO_ENGINE`, else `fio-engine/build/libiomapfs_fio.so` of
/// the source tree this program was built in (found from its own path,
/// `target/release/...`), else under the working directory.
pub fn find_engine(explicit: Option<&Path>) -> Result<PathBuf, String> {
    const BUILT: &str = "fio-engine/build/libiomapfs_fio.so";
    let remedy = "build it with `make -C fio-engine` (needs fio installed), or name it with \
                  --fio-engine PATH";
    if let Some(path) = explicit {
        return if path.is_file() {
            Ok(path.to_owned())
        } else {
            Err(format!("--fio-engine {}: no such file", path.display()))
        };
    }
    if let Some(path) = std::env::var_os("IOMAPFS_FIO_ENGINE") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "IOMAPFS_FIO_ENGINE={}: no such file; {remedy}",
                path.display()
            ))
        };
    }
    let exe = std::env::current_exe().ok();
    let from_exe = exe
        .iter()
        .flat_map(|e| e.ancestors().skip(1).take(5))
        .map(|dir| dir.join(BUILT));
    let from_cwd = std::env::current_dir().ok().map(|d| d.join(BUILT));
    from_exe
        .chain(from_cwd)
        .find(|p| p.is_file())
        .ok_or_else(|| format!("the fio engine ({BUILT}) is not built; {remedy}"))
}

/// One target's measurement (the raw device's two halves merged).
#[derive(Clone, Debug)]
struct Measured {
    iops: f64,
    bw_bytes: f64,
    lat_mean_ns: f64,
    lat_p99_ns: f64,
    ios: u64,
    process_cpu: CpuTime,
    jobs_cpu: Result<CpuPerIoTime, String>,
    commands: Vec<String>,
    setup: Vec<String>,
}

impl Measured {
    fn of(run: FioRun, setup: Vec<String>) -> Measured {
        let f = run.figures;
        Measured {
            iops: f.iops,
            bw_bytes: f.bw_bytes,
            lat_mean_ns: f.lat_mean_ns,
            lat_p99_ns: f.lat_p99_ns,
            ios: f.ios,
            process_cpu: run.process_cpu,
            jobs_cpu: f.cpu,
            commands: vec![run.command],
            setup,
        }
    }

    /// Both halves as one window: IOPS and bandwidth over the summed
    /// time, means (and p99, approximately) weighted by I/Os, CPU summed.
    fn merge(self, other: Measured) -> Measured {
        let seconds = |m: &Measured| {
            if m.iops > 0.0 {
                m.ios as f64 / m.iops
            } else {
                0.0
            }
        };
        let (t1, t2) = (seconds(&self), seconds(&other));
        let (n1, n2) = (self.ios as f64, other.ios as f64);
        let per_time = |a: f64, b: f64| {
            if t1 + t2 > 0.0 {
                (a * t1 + b * t2) / (t1 + t2)
            } else {
                0.0
            }
        };
        let per_io = |a: f64, b: f64| {
            if n1 + n2 > 0.0 {
                (a * n1 + b * n2) / (n1 + n2)
            } else {
                0.0
            }
        };
        let jobs_cpu = match (&self.jobs_cpu, &other.jobs_cpu) {
            (Ok(a), Ok(b)) => Ok(CpuPerIoTime {
                user_us: per_io(a.user_us, b.user_us),
                system_us: per_io(a.system_us, b.system_us),
            }),
            (Err(e), _) | (_, Err(e)) => Err(e.clone()),
        };
        Measured {
            iops: per_time(self.iops, other.iops),
            bw_bytes: per_time(self.bw_bytes, other.bw_bytes),
            lat_mean_ns: per_io(self.lat_mean_ns, other.lat_mean_ns),
            lat_p99_ns: per_io(self.lat_p99_ns, other.lat_p99_ns),
            ios: self.ios + other.ios,
            process_cpu: self.process_cpu + other.process_cpu,
            jobs_cpu,
            commands: [self.commands, other.commands].concat(),
            setup: [self.setup, other.setup].concat(),
        }
    }

    fn cpu_per_io(&self) -> Option<CpuPerIo> {
        let per = self.process_cpu.per_io(self.ios)?;
        Some(CpuPerIo {
            total_us: per.total_us(),
            user_us: per.user_us,
            system_us: per.system_us,
            scope: CPU_SCOPE_FIO_PROCESS.into(),
            io_threads_us: self.jobs_cpu.as_ref().ok().map(CpuPerIoTime::total_us),
        })
    }
}

/// Prepares `target` (see [`prepare_args`]) and measures `job` on it.
fn measure(
    what: &str,
    name: &str,
    job: &FioJob,
    target: &FioTarget,
    span: u64,
    runtime: Duration,
) -> Result<Measured, BenchError> {
    let timing = Timing {
        warmup: Duration::ZERO,
        runtime,
    };
    let work_dir = tempfile::Builder::new()
        .prefix(crate::testbed::TEMP_PREFIX)
        .tempdir()
        .map_err(|e| BenchError::io("fio working directory", e))?;
    let (prepared, _) = kernel::spawn_fio(
        what,
        &prepare_args(name, job, target, span),
        timing,
        work_dir.path(),
    )?;
    let ran = kernel::run_fio(what, timing, job.pattern.op, |output| {
        let mut args = job_args(name, job, target, span, runtime);
        args.extend([
            "--output-format=json".into(),
            format!("--output={}", output.display()),
        ]);
        args
    })?;
    Ok(Measured::of(ran, vec![prepared]))
}

/// The iomapfs backend of a fio row, given the one the device got
/// (`device`: Auto's choice, or `--backend`): the raw device's I/O model,
/// so the two run the same way: io_uring rows use iomapfs's queues, the
/// psync row its synchronous calls. The queues are io_uring's, except on
/// a device that got the worker pool (Auto gives it where the device
/// refuses NOWAIT, such as zram: io_uring would punt every request to its
/// kernel workers there, and the pool is iomapfs's answer to that). Jobs
/// at `iodepth=1` make synchronous calls on any backend (the engine's
/// pread/pwrite path).
fn iomapfs_backend(engine: FioEngine, device: Backend) -> Backend {
    match (engine, device) {
        (FioEngine::IoUring, Backend::Pool) => Backend::Pool,
        (FioEngine::IoUring, _) => Backend::Uring,
        (FioEngine::Psync, _) => Backend::Sync,
    }
}

fn ratio(x: f64, base: Option<f64>) -> Option<f64> {
    base.filter(|b| *b > 0.0).map(|b| x / b)
}

/// Runs one fio row on every target; failures of one target are recorded
/// as skips with the error, and the row goes on.
pub fn run_workload(
    w: &Workload,
    job: &FioJob,
    bed: &Testbed,
    opts: &BenchOptions,
    timing: Timing,
    progress: &dyn Progress,
    report: &mut BenchReport,
) -> Result<(), BenchError> {
    let steps = TARGETS.len() as u64;
    let dev = match bed.device_for(&job.pattern) {
        Ok(dev) => dev,
        Err(reason) => {
            for t in TARGETS {
                skip(report, w.name, t, reason.clone());
            }
            progress.inc(steps);
            return Ok(());
        }
    };
    if kernel::find_program("fio").is_none() {
        for t in TARGETS {
            skip(report, w.name, t, "fio not found (apt-get install fio)");
        }
        progress.inc(steps);
        return Ok(());
    }
    let span = span_for(&job.pattern, dev.caps.size_bytes);
    let say = |target: &str, what: &str| {
        progress.set_message(&format!("{} · {target}: fio {what}", w.name));
    };
    let raw_target = FioTarget::Raw {
        device: dev.path.clone(),
    };
    let half = timing.runtime / 2;
    say("raw", "(before iomapfs)");
    let raw_before = measure("raw", w.name, job, &raw_target, span, half);

    let engine = find_engine(opts.fio_engine.as_deref());
    let fs_measured = engine.map(|engine| {
        say("iomapfs", "(engine)");
        let target = FioTarget::Iomapfs {
            engine,
            device: dev.path.clone(),
            backend: iomapfs_backend(job.engine, dev.backend.backend),
        };
        measure("iomapfs", w.name, job, &target, span, timing.runtime)
    });
    let raw_measured = raw_before.and_then(|before| {
        say("raw", "(after iomapfs)");
        Ok(before.merge(measure("raw", w.name, job, &raw_target, span, half)?))
    });

    let mut rows: Vec<(&str, Measured, String)> = Vec::new();
    if let Some(m) = recorded(raw_measured, report, w.name, "raw")? {
        rows.push(("raw", m, format!("fio {}", job.engine.name())));
    }
    progress.inc(1);
    match fs_measured {
        Err(why) => skip(report, w.name, "iomapfs", why),
        Ok(result) => {
            if let Some(m) = recorded(result, report, w.name, "iomapfs")? {
                let backend = format!(
                    "fio engine iomapfs ({})",
                    iomapfs_backend(job.engine, dev.backend.backend).as_str()
                );
                rows.push(("iomapfs", m, backend));
            }
        }
    }
    progress.inc(1);

    let (kernels, unusable) = kernel::usable(opts.no_kernel, dev);
    for (fs, reason) in unusable {
        skip(report, w.name, fs.name(), reason);
        progress.inc(1);
    }
    for fs in kernels {
        let target = fs.name();
        say(target, "(mkfs, mount)");
        let ran = kernel::with_mounted(fs, dev, |file| {
            let on = FioTarget::KernelFile {
                file: file.to_owned(),
            };
            measure(target, w.name, job, &on, span, timing.runtime)
        })
        .map(|(mut m, mkfs)| {
            m.setup.insert(0, mkfs);
            m
        });
        if let Some(m) = recorded(ran, report, w.name, target)? {
            rows.push((target, m, format!("fio {}", job.engine.name())));
        }
        progress.inc(1);
    }
    push_results(w.name, dev, rows, report);
    Ok(())
}

/// The rows as results, with ratios to the raw device's and XFS's rows.
fn push_results(
    workload: &str,
    dev: &BedDevice,
    rows: Vec<(&str, Measured, String)>,
    report: &mut BenchReport,
) {
    let of = |target: &str| rows.iter().find(|(t, _, _)| *t == target).map(|r| &r.1);
    let raw_iops = of("raw").map(|m| m.iops);
    let raw_cpu = of("raw").and_then(|m| m.cpu_per_io()).map(|c| c.total_us);
    let xfs_iops = of("xfs").map(|m| m.iops);
    for (target, m, backend) in &rows {
        let cpu_per_io = m.cpu_per_io();
        let cpu_ratio_to_raw = cpu_per_io.as_ref().and_then(|c| ratio(c.total_us, raw_cpu));
        report.results.push(BenchResult {
            workload: workload.into(),
            target: (*target).into(),
            device: dev.path.display().to_string(),
            iops: m.iops,
            bw_bytes: m.bw_bytes,
            lat_mean_ns: m.lat_mean_ns,
            lat_p99_ns: m.lat_p99_ns,
            ratio_to_raw: ratio(m.iops, raw_iops),
            ratio_to_xfs: ratio(m.iops, xfs_iops),
            cpu_note: cpu_per_io
                .is_none()
                .then(|| "fio reported no I/O".to_string()),
            cpu_per_io,
            cpu_ratio_to_raw,
            ops: Some(m.ios),
            backend: backend.clone(),
            command: m.commands.join("; "),
            setup: Some(m.setup.join(" && ")),
            harness: Some("fio".into()),
            ..BenchResult::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{select, Kind, Op, Order, FIO_WORKLOADS};

    fn job(name: &str) -> FioJob {
        match select(&[name.into()]).unwrap()[0].kind {
            Kind::Fio(job) => job,
            _ => panic!("{name} is not a fio row"),
        }
    }

    fn has(args: &[String], want: &str) -> bool {
        args.iter().any(|a| a == want)
    }

    #[test]
    fn every_target_runs_the_same_job_line_on_its_own_file_and_engine() {
        let runtime = Duration::from_secs(5);
        let dev = PathBuf::from("/dev/zram0");
        let targets = [
            FioTarget::Raw {
                device: dev.clone(),
            },
            FioTarget::Iomapfs {
                engine: "/e/libiomapfs_fio.so".into(),
                device: dev.clone(),
                backend: Backend::Sync,
            },
            FioTarget::KernelFile {
                file: "/mnt/x/bench.dat".into(),
            },
        ];
        let j = job("fio-overwrite-2k-2jobs-qd256");
        let lines: Vec<Vec<String>> = targets
            .iter()
            .map(|t| job_args("fio-overwrite-2k-2jobs-qd256", &j, t, 128 << 20, runtime))
            .collect();
        // The thread's line, scaled to two cores, on every target.
        for args in &lines {
            for want in [
                "--overwrite=1",
                "--thread",
                "--numjobs=2",
                "--bs=2048",
                "--iodepth=256",
                "--blockalign=2048",
                "--rw=randwrite",
                "--direct=1",
                "--size=134217728",
                "--time_based",
                "--runtime=5000ms",
                "--group_reporting",
            ] {
                assert!(has(args, want), "{want} missing from {args:?}");
            }
            assert!(!args.iter().any(|a| a.starts_with("--ramp_time")));
        }
        // Only the file and the engine differ.
        assert!(has(&lines[0], "--filename=/dev/zram0"));
        assert!(has(&lines[0], "--ioengine=io_uring"));
        for want in [
            "--ioengine=external:/e/libiomapfs_fio.so",
            "--iomapfs_volume=/dev/zram0",
            "--iomapfs_backend=sync",
            "--filename=/bench.dat",
        ] {
            assert!(has(&lines[1], want), "{want} missing from {:?}", lines[1]);
        }
        assert!(has(&lines[2], "--filename=/mnt/x/bench.dat"));
        assert!(has(&lines[2], "--ioengine=io_uring"));
        let rest = |args: &[String]| -> Vec<String> {
            args.iter()
                .filter(|a| {
                    !a.starts_with("--filename")
                        && !a.starts_with("--ioengine")
                        && !a.starts_with("--iomapfs_")
                })
                .cloned()
                .collect()
        };
        assert_eq!(rest(&lines[0]), rest(&lines[1]));
        assert_eq!(rest(&lines[0]), rest(&lines[2]));
    }

    #[test]
    fn each_row_is_its_threads_line() {
        let runtime = Duration::from_secs(1);
        let raw = FioTarget::Raw {
            device: "/dev/loop0".into(),
        };
        let line = |name: &str| job_args(name, &job(name), &raw, 1 << 25, runtime);
        let cases: [(&str, &[&str]); 5] = [
            (
                "fio-randread-4k-qd1",
                &["--rw=randread", "--bs=4096", "--iodepth=1", "--numjobs=1"],
            ),
            (
                "fio-randread-4k-qd32",
                &[
                    "--rw=randread",
                    "--bs=4096",
                    "--iodepth=32",
                    "--ioengine=io_uring",
                ],
            ),
            (
                "fio-aio-overwrite-4k..16k-qd64",
                &[
                    "--rw=randwrite",
                    "--bsrange=4096-16384",
                    "--blockalign=4096",
                    "--iodepth=64",
                    "--overwrite=1",
                    "--ioengine=io_uring",
                ],
            ),
            (
                "fio-dsync-overwrite-4k-psync",
                &[
                    "--rw=write",
                    "--bs=4096",
                    "--sync=dsync",
                    "--ioengine=psync",
                    "--iodepth=1",
                    "--overwrite=1",
                ],
            ),
            (
                "fio-overwrite-2k-2jobs-qd256",
                &["--numjobs=2", "--iodepth=256", "--bs=2048"],
            ),
        ];
        for (name, wants) in cases {
            let args = line(name);
            for want in wants {
                assert!(has(&args, want), "{name}: {want} missing from {args:?}");
            }
            assert!(has(&args, &format!("--name={name}")));
            // Reads are not overwrites, and only the dsync row syncs.
            assert_eq!(
                has(&args, "--overwrite=1"),
                job(name).pattern.op == Op::Write
            );
            assert_eq!(has(&args, "--sync=dsync"), name.contains("dsync"));
            // Random rows draw offsets as the engine rows do: no random map.
            assert_eq!(
                has(&args, "--norandommap"),
                job(name).pattern.order == Order::Random
            );
        }
        assert_eq!(FIO_WORKLOADS.len(), cases.len());
    }

    #[test]
    fn iomapfs_runs_on_the_raw_devices_io_model() {
        for w in FIO_WORKLOADS {
            let Kind::Fio(j) = w.kind else { panic!() };
            for device in [Backend::Sync, Backend::Uring, Backend::Pool] {
                let want = match (j.engine, device) {
                    (FioEngine::IoUring, Backend::Pool) => Backend::Pool,
                    (FioEngine::IoUring, _) => Backend::Uring,
                    (FioEngine::Psync, _) => Backend::Sync,
                };
                assert_eq!(iomapfs_backend(j.engine, device), want, "{}", w.name);
            }
        }
        assert_eq!(job("fio-dsync-overwrite-4k-psync").engine, FioEngine::Psync);
    }

    #[test]
    fn files_are_laid_out_before_the_measured_run() {
        let j = job("fio-randread-4k-qd32");
        let raw = prepare_args(
            "r",
            &j,
            &FioTarget::Raw {
                device: "/dev/zram0".into(),
            },
            1 << 28,
        );
        for want in [
            "--filename=/dev/zram0",
            "--rw=write",
            "--bs=1m",
            "--size=268435456",
            "--direct=1",
        ] {
            assert!(has(&raw, want), "{want} missing from {raw:?}");
        }
        assert!(!has(&raw, "--time_based"));
        let engine = FioTarget::Iomapfs {
            engine: "/e.so".into(),
            device: "/dev/zram0".into(),
            backend: Backend::Uring,
        };
        let fs = prepare_args("r", &j, &engine, 1 << 28);
        for want in [
            "--create_only=1",
            "--iomapfs_mkfs=1",
            "--rw=randread",
            "--size=268435456",
        ] {
            assert!(has(&fs, want), "{want} missing from {fs:?}");
        }
        // The measured run never formats.
        let measured = job_args("r", &j, &engine, 1 << 28, Duration::from_secs(1));
        assert!(!measured.iter().any(|a| a.starts_with("--iomapfs_mkfs")));
        assert!(!has(&measured, "--create_only=1"));
        let kernel = prepare_args(
            "r",
            &j,
            &FioTarget::KernelFile {
                file: "/m/bench.dat".into(),
            },
            1 << 28,
        );
        assert!(has(&kernel, "--create_only=1"));
        assert!(!kernel.iter().any(|a| a.starts_with("--iomapfs_")));
    }

    #[test]
    fn two_halves_merge_into_one_window() {
        let half = |iops: f64, ios: u64, lat: f64, cpu_ms: u64| Measured {
            iops,
            bw_bytes: iops * 4096.0,
            lat_mean_ns: lat,
            lat_p99_ns: lat * 2.0,
            ios,
            process_cpu: CpuTime {
                user: Duration::from_millis(cpu_ms),
                system: Duration::ZERO,
            },
            jobs_cpu: Ok(CpuPerIoTime {
                user_us: lat / 1000.0,
                system_us: 0.0,
            }),
            commands: vec![format!("fio {iops}")],
            setup: vec![],
        };
        // 1 s at 1000 IOPS, then 3 s at 3000 IOPS: 10000 I/Os in 4 s.
        let m = half(1000.0, 1000, 100.0, 100).merge(half(3000.0, 9000, 200.0, 800));
        assert!((m.iops - 2500.0).abs() < 1e-6, "{m:?}");
        assert!((m.bw_bytes - 2500.0 * 4096.0).abs() < 1e-3);
        assert_eq!(m.ios, 10000);
        assert!((m.lat_mean_ns - 190.0).abs() < 1e-9, "{m:?}");
        let cpu = m.cpu_per_io().unwrap();
        // 900 ms over 10000 I/Os.
        assert!((cpu.total_us - 90.0).abs() < 1e-9, "{cpu:?}");
        assert!((cpu.io_threads_us.unwrap() - 0.19).abs() < 1e-9, "{cpu:?}");
        assert_eq!(cpu.scope, CPU_SCOPE_FIO_PROCESS);
        assert_eq!(m.commands, ["fio 1000", "fio 3000"]);
    }

    #[test]
    fn an_engine_named_but_missing_is_an_error_that_says_how_to_build_it() {
        let err = find_engine(Some(Path::new("/nonexistent/x.so"))).unwrap_err();
        assert!(err.contains("/nonexistent/x.so"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let so = dir.path().join("e.so");
        std::fs::write(&so, b"").unwrap();
        assert_eq!(find_engine(Some(&so)).unwrap(), so);
    }
}
