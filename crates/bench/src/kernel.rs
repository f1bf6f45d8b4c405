//! Kernel XFS and ext4 on the same device, measured by fio with the job
//! equivalent to the workload.
//!
//! Direct workloads ([`fio_args`]): the same I/O sizes and offset
//! alignment, the same data span (file size), O_DIRECT, O_DSYNC where the
//! workload has it, the file fully
//! written before measuring (fio lays out read files; `overwrite=1` makes it
//! lay out write files too, so writes are overwrites of written blocks), and
//! the same queue-depth model as the engine: with the sync backend,
//! `ioengine=psync` with `numjobs` = queue depth as threads on one shared
//! file; with io_uring, `ioengine=io_uring` with `iodepth` = queue depth in
//! one job. Latency is fio's total latency (`lat_ns`, with
//! `lat_percentiles=1`): submission to completion, like the engine's per-I/O
//! time (for psync it equals clat).
//!
//! Buffered workloads ([`buffered_fio_args`]): one psync job through the
//! page cache, arranged variant by variant as the iomapfs side is.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

use crate::cpu::{self, CpuPerIoTime, CpuTime};
use crate::engine::Driver;
use crate::engine::Timing;
use crate::interrupt::stop_requested;
use crate::testbed::{is_root, run_command, BedDevice, BedKind, TEMP_PREFIX};
use crate::workload::{BufferedSpec, BufferedVariant, IoPattern, Op, Order};
use crate::BenchError;

/// How long fio may take beyond warm-up and runtime (file layout, mkfs'd
/// file system warming up) before it is killed.
const FIO_GRACE: Duration = Duration::from_secs(120);
/// How long unmount retries a busy mount.
const UMOUNT_PATIENCE: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFs {
    Xfs,
    Ext4,
}

impl KernelFs {
    pub const ALL: [KernelFs; 2] = [KernelFs::Xfs, KernelFs::Ext4];

    /// Target name in results.
    pub fn name(self) -> &'static str {
        match self {
            KernelFs::Xfs => "xfs",
            KernelFs::Ext4 => "ext4",
        }
    }

    fn mkfs(self) -> (&'static str, &'static [&'static str], &'static str) {
        match self {
            KernelFs::Xfs => ("mkfs.xfs", &["-f", "-q"], "xfsprogs"),
            // Initialise inode tables and journal now, not in the
            // background while fio measures.
            KernelFs::Ext4 => (
                "mkfs.ext4",
                &["-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0"],
                "e2fsprogs",
            ),
        }
    }
}

/// A program on PATH or in the sbin directories (which a non-login root
/// shell may not have on PATH).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Why kernel file systems cannot be measured in this run, if they cannot.
pub fn unavailable(no_kernel: bool) -> Option<String> {
    if no_kernel {
        Some("kernel comparisons disabled (--no-kernel)".into())
    } else if !is_root() {
        Some("not root: mkfs and mount need root".into())
    } else if find_program("fio").is_none() {
        Some("fio not found (apt-get install fio)".into())
    } else {
        None
    }
}

/// Why `fs` cannot be measured on `dev`, if it cannot.
pub fn unavailable_on(fs: KernelFs, dev: &BedDevice) -> Option<String> {
    let (mkfs, _, package) = fs.mkfs();
    if dev.kind == BedKind::ImageFile {
        Some("the device is an image file; kernel file systems need a block device".into())
    } else if find_program(mkfs).is_none() {
        Some(format!("{mkfs} not found (apt-get install {package})"))
    } else {
        None
    }
}

/// The kernel file systems that can be measured on `dev` in this run, and
/// the others with why not.
pub fn usable(no_kernel: bool, dev: &BedDevice) -> (Vec<KernelFs>, Vec<(KernelFs, String)>) {
    let off = unavailable(no_kernel);
    let mut usable = Vec::new();
    let mut not = Vec::new();
    for fs in KernelFs::ALL {
        match off.clone().or_else(|| unavailable_on(fs, dev)) {
            Some(reason) => not.push((fs, reason)),
            None => usable.push(fs),
        }
    }
    (usable, not)
}

/// One fio measurement.
#[derive(Clone, Debug)]
pub struct KernelRun {
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat_mean_ns: f64,
    pub lat_p99_ns: f64,
    /// CPU per I/O of fio's job threads, or why it is not known.
    pub cpu: Result<CpuPerIoTime, String>,
    /// The exact fio command line.
    pub command: String,
    /// mkfs and mount, as run.
    pub setup: String,
}

/// A mounted file system; unmounted (then the directory removed) on drop.
struct Mounted {
    dir: TempDir,
    mounted: bool,
}

impl Mounted {
    fn release(&mut self) -> Result<(), String> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        let at = self.dir.path().to_string_lossy().into_owned();
        let deadline = Instant::now() + UMOUNT_PATIENCE;
        loop {
            match run_command("umount", &[&at]) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    // Last resort: detach it so the device is released when
                    // the last user goes away, and say so.
                    let _ = run_command("umount", &["-l", &at]);
                    return Err(e);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

fn shell_quote(arg: &str) -> String {
    if !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=./:,+@%".contains(c))
    {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

fn command_line(program: &str, args: &[String]) -> String {
    std::iter::once(program.to_string())
        .chain(args.iter().map(|a| shell_quote(a)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn millis(d: Duration) -> u128 {
    d.as_millis().max(1)
}

/// The fio arguments of `pattern`'s I/O: direct, `rw`, sizes, offset
/// alignment, overwrites of the laid-out file for writes, O_DSYNC, and
/// random offsets drawn as the engine draws them (no random map, not
/// repeated).
pub fn pattern_args(pattern: &IoPattern) -> Vec<String> {
    let mut args = vec!["--direct=1".into(), format!("--rw={}", pattern.fio_rw())];
    if pattern.min_size == pattern.max_size {
        args.push(format!("--bs={}", pattern.min_size));
    } else {
        args.push(format!(
            "--bsrange={}-{}",
            pattern.min_size, pattern.max_size
        ));
    }
    args.push(format!("--blockalign={}", pattern.align));
    if pattern.op == Op::Write {
        args.push("--overwrite=1".into());
    }
    if pattern.dsync {
        args.push("--sync=dsync".into());
    }
    if pattern.order == Order::Random {
        args.push("--norandommap".into());
        args.push("--randrepeat=0".into());
    }
    args
}

/// The fio arguments equivalent to `pattern` over a `span`-byte file.
pub fn fio_args(
    name: &str,
    pattern: &IoPattern,
    file: &Path,
    span: u64,
    timing: Timing,
    output: &Path,
    driver: Driver,
) -> Vec<String> {
    let mut args = vec![
        format!("--name={name}"),
        format!("--filename={}", file.display()),
        format!("--size={span}"),
    ];
    args.extend(pattern_args(pattern));
    match driver {
        Driver::Threads => args.extend([
            "--ioengine=psync".into(),
            format!("--numjobs={}", pattern.queue_depth),
        ]),
        Driver::Queue => args.extend([
            "--ioengine=io_uring".into(),
            format!("--iodepth={}", pattern.queue_depth),
            "--numjobs=1".into(),
        ]),
    }
    args.extend([
        "--thread".into(),
        "--group_reporting".into(),
        "--lat_percentiles=1".into(),
        "--time_based".into(),
        format!("--ramp_time={}ms", millis(timing.warmup)),
        format!("--runtime={}ms", millis(timing.runtime)),
        "--output-format=json".into(),
        format!("--output={}", output.display()),
    ]);
    args
}

/// Loops of fio jobs that run pass after pass until their runtime ends
/// (more than any runtime allows).
const FIO_LOOPS: u64 = 1_000_000;

/// The fio arguments equivalent to a buffered workload's `variant` over a
/// `span`-byte file: one psync job (`numjobs=1`) of sequential `bs`-byte
/// I/O through the page cache (`direct=0`), arranged as the iomapfs side
/// is (see [`BufferedVariant`]):
/// - warm: `pre_read=1` (the file read into the cache before the job),
///   `invalidate=0`, time based;
/// - cold: `invalidate=1`, which drops the file's cached pages
///   (`POSIX_FADV_DONTNEED`) each time fio opens it, once per loop; the job
///   loops over the file until its runtime ends;
/// - overwrite: `overwrite=1` (the file written before the job), time
///   based, wrapping at the end of the file; with fsync, `fsync=N` with N
///   the writes of one pass, and `end_fsync=1` for the pass the runtime
///   cuts (fio counts both in its runtime, so in IOPS and bandwidth);
/// - alloc: `fallocate=none` and `unlink_each_loop=1`, so each loop
///   appends to a new, empty file; with fsync, `end_fsync=1`, which ends
///   every loop.
///
/// Time-based jobs (warm, overwrite) warm up with `ramp_time`; loop jobs
/// (cold, alloc) have none: fio 3.33 with `ramp_time` and `loops` often
/// records no I/O at all (seen with `end_fsync` or `fsync`), and their
/// first pass differs from the others in nothing a warm-up would remove.
///
/// Caches are never dropped machine-wide (`drop_caches`): other work on a
/// shared machine would pay for it, and only this file's pages matter.
pub fn buffered_fio_args(
    name: &str,
    spec: &BufferedSpec,
    variant: BufferedVariant,
    file: &Path,
    span: u64,
    timing: Timing,
    output: &Path,
) -> Vec<String> {
    let rw = match spec.op {
        Op::Read => "read",
        Op::Write => "write",
    };
    let mut args = vec![
        format!("--name={name}-{}", variant.name()),
        format!("--filename={}", file.display()),
        format!("--size={span}"),
        "--direct=0".into(),
        format!("--rw={rw}"),
        format!("--bs={}", spec.io_size),
        "--ioengine=psync".into(),
        "--numjobs=1".into(),
    ];
    let time_based = "--time_based".to_string();
    let loops = format!("--loops={FIO_LOOPS}");
    let ramp = matches!(
        variant,
        BufferedVariant::Warm | BufferedVariant::Overwrite { .. }
    );
    match variant {
        BufferedVariant::Warm => {
            args.extend(["--pre_read=1".into(), "--invalidate=0".into(), time_based])
        }
        BufferedVariant::Cold => args.extend(["--invalidate=1".into(), loops]),
        BufferedVariant::Overwrite { fsync } => {
            args.extend(["--overwrite=1".into(), "--invalidate=0".into(), time_based]);
            if fsync {
                args.push(format!("--fsync={}", spec.ios_per_pass(span)));
                args.push("--end_fsync=1".into());
            }
        }
        BufferedVariant::Alloc { fsync } => {
            args.extend([
                "--fallocate=none".into(),
                "--unlink_each_loop=1".into(),
                "--invalidate=0".into(),
                loops,
            ]);
            if fsync {
                args.push("--end_fsync=1".into());
            }
        }
    }
    args.extend([
        "--thread".into(),
        "--group_reporting".into(),
        "--lat_percentiles=1".into(),
    ]);
    if ramp {
        args.push(format!("--ramp_time={}ms", millis(timing.warmup)));
    }
    args.extend([
        format!("--runtime={}ms", millis(timing.runtime)),
        "--output-format=json".into(),
        format!("--output={}", output.display()),
    ]);
    args
}

/// What fio's JSON says about one job group.
#[derive(Clone, Debug, PartialEq)]
pub struct FioFigures {
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat_mean_ns: f64,
    pub lat_p99_ns: f64,
    /// CPU per I/O of fio's job threads, or why it cannot be had.
    pub cpu: Result<CpuPerIoTime, String>,
    /// I/Os of the side read (`total_ios`; 0 when fio left it out).
    pub ios: u64,
}

/// Pulls iops, bandwidth, latency (mean, p99) and CPU per I/O out of fio's
/// JSON.
pub fn parse_fio_json(text: &str, op: Op) -> Result<FioFigures, String> {
    // fio may print notes before the JSON object.
    let start = text.find('{').ok_or("fio wrote no JSON")?;
    let v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("fio JSON unreadable: {e}"))?;
    let side = match op {
        Op::Read => "read",
        Op::Write => "write",
    };
    let group = v
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or("fio JSON has no jobs[0]")?;
    let job = group
        .get(side)
        .ok_or_else(|| format!("fio JSON has no jobs[0].{side}"))?;
    let num = |path: &[&str]| -> Result<f64, String> {
        let mut at = job;
        for key in path {
            at = at
                .get(key)
                .ok_or_else(|| format!("fio JSON has no {side}.{}", path.join(".")))?;
        }
        at.as_f64()
            .ok_or_else(|| format!("fio JSON {side}.{} is not a number", path.join(".")))
    };
    // Total latency (submission to completion), as the engine measures:
    // for psync it equals clat; for io_uring, clat alone would leave out
    // work done inside the submitting system call. Older fio without
    // lat_ns percentiles falls back to clat.
    let lat = |field: &[&str]| {
        let mut path = vec!["lat_ns"];
        path.extend_from_slice(field);
        num(&path).or_else(|_| {
            let mut path = vec!["clat_ns"];
            path.extend_from_slice(field);
            num(&path)
        })
    };
    // CPU: usr_cpu and sys_cpu are percent of job_runtime (ms, summed over
    // the group's jobs), both reset with the I/O counts when ramp_time
    // ends, and total_ios counts the group's I/Os after it.
    let cpu = (|| {
        let root = |key: &str| {
            group
                .get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("fio JSON has no number jobs[0].{key}"))
        };
        let ios = job
            .get("total_ios")
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("fio JSON has no number {side}.total_ios"))?;
        let (usr, sys, runtime) = (root("usr_cpu")?, root("sys_cpu")?, root("job_runtime")?);
        cpu::fio_per_io(usr, sys, runtime, ios).ok_or_else(|| {
            format!("fio reported no I/O or no runtime ({ios} I/Os in {runtime} ms)")
        })
    })();
    Ok(FioFigures {
        iops: num(&["iops"])?,
        bw_bytes: num(&["bw_bytes"])?,
        lat_mean_ns: lat(&["mean"])?,
        // fio leaves percentiles out when it recorded nothing: say that.
        lat_p99_ns: lat(&["percentile", "99.000000"]).map_err(|e| {
            if job.get("total_ios").and_then(Value::as_u64) == Some(0) {
                format!("fio recorded no {side} I/O (jobs[0].{side}.total_ios is 0)")
            } else {
                e
            }
        })?,
        cpu,
        ios: job.get("total_ios").and_then(Value::as_u64).unwrap_or(0),
    })
}

/// Makes `fs` on the device, mounts it, runs the fio job `args` gives for
/// a file on it and an output path (see [`fio_args`] and
/// [`buffered_fio_args`]), reads the `op` side of its report, and
/// unmounts. Errors other than [`BenchError::Interrupted`] mean "could not
/// be measured" and are reported as skips by the caller.
pub fn run(
    fs: KernelFs,
    dev: &BedDevice,
    timing: Timing,
    op: Op,
    args: impl FnOnce(&Path, &Path) -> Vec<String>,
) -> Result<KernelRun, BenchError> {
    let (ran, setup) = with_mounted(fs, dev, |file| {
        run_fio(fs.name(), timing, op, |output| args(file, output))
    })?;
    Ok(KernelRun {
        iops: ran.figures.iops,
        bw_bytes: ran.figures.bw_bytes,
        lat_mean_ns: ran.figures.lat_mean_ns,
        lat_p99_ns: ran.figures.lat_p99_ns,
        cpu: ran.figures.cpu,
        command: ran.command,
        setup,
    })
}

/// Makes `fs` on the device and mounts it, runs `body` with the path of
/// the file to use on it (`bench.dat`, not created), and unmounts, also
/// when `body` fails. Returns what `body` did and the mkfs and mount
/// commands as run.
pub fn with_mounted<T>(
    fs: KernelFs,
    dev: &BedDevice,
    body: impl FnOnce(&Path) -> Result<T, BenchError>,
) -> Result<(T, String), BenchError> {
    let failed =
        |what: &str, detail: String| BenchError::failed(format!("{} {what}", fs.name()), detail);
    let (mkfs, mkfs_flags, _) = fs.mkfs();
    let mkfs_path =
        find_program(mkfs).ok_or_else(|| failed("mkfs", format!("{mkfs} not found")))?;
    let dev_path = dev.path.to_string_lossy().into_owned();

    let mut mkfs_args: Vec<&str> = mkfs_flags.to_vec();
    mkfs_args.push(&dev_path);
    run_command(&mkfs_path.to_string_lossy(), &mkfs_args).map_err(|e| failed("mkfs", e))?;
    if stop_requested() {
        return Err(BenchError::Interrupted);
    }

    let dir = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempdir()
        .map_err(|e| BenchError::io("mount point", e))?;
    let at = dir.path().to_string_lossy().into_owned();
    run_command("mount", &["-t", fs.name(), &dev_path, &at]).map_err(|e| failed("mount", e))?;
    let mut mounted = Mounted { dir, mounted: true };
    let setup = format!(
        "{} {} && mount -t {} {dev_path} {at}",
        mkfs,
        mkfs_args.join(" "),
        fs.name()
    );
    let done = body(&mounted.dir.path().join("bench.dat"))?;
    mounted.release().map_err(|e| failed("umount", e))?;
    Ok((done, setup))
}

/// One measured fio run.
#[derive(Clone, Debug)]
pub struct FioRun {
    pub figures: FioFigures,
    /// The exact fio command line.
    pub command: String,
    /// CPU time of the whole fio process (every thread: fio's jobs, an
    /// external engine's own threads, io_uring's io-wq workers), from
    /// wait4(2).
    pub process_cpu: CpuTime,
}

/// Runs fio with the arguments `args` gives for its JSON output path,
/// reads the `op` side of its report. `what` names the target in errors.
pub fn run_fio(
    what: &str,
    timing: Timing,
    op: Op,
    args: impl FnOnce(&Path) -> Vec<String>,
) -> Result<FioRun, BenchError> {
    let out_dir = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempdir()
        .map_err(|e| BenchError::io("fio output directory", e))?;
    let output = out_dir.path().join("fio.json");
    let args = args(&output);
    let (command, process_cpu) = spawn_fio(what, &args, timing, out_dir.path())?;
    let failed = |detail: String| BenchError::failed(format!("{what} fio"), detail);
    let text = fs::read_to_string(&output).map_err(|e| BenchError::io("read fio output", e))?;
    let figures = parse_fio_json(&text, op).map_err(failed)?;
    Ok(FioRun {
        figures,
        command,
        process_cpu,
    })
}

/// Runs fio with `args` in `work_dir` (its working directory: files fio
/// saves, such as verify state, land there) and waits for it, at most
/// `timing`'s warm-up and runtime and [`FIO_GRACE`]; fio is killed when
/// the bench dies, runs out of time or is interrupted. Returns the command
/// line and the CPU time of the fio process.
pub fn spawn_fio(
    what: &str,
    args: &[String],
    timing: Timing,
    work_dir: &Path,
) -> Result<(String, CpuTime), BenchError> {
    let failed = |detail: String| BenchError::failed(format!("{what} fio"), detail);
    let fio = find_program("fio").ok_or_else(|| failed("fio not found".into()))?;
    let command = command_line("fio", args);
    let stderr_path = work_dir.join("fio.stderr");
    let stderr =
        fs::File::create(&stderr_path).map_err(|e| BenchError::io("fio stderr file", e))?;
    let mut command_builder = Command::new(&fio);
    // SAFETY: the closure runs in the forked child before exec and only
    // makes one async-signal-safe system call.
    unsafe {
        command_builder.pre_exec(|| {
            // fio dies with us: a killed bench must not leave fio holding
            // the mount (and so the device) busy.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command_builder
        .args(args)
        .current_dir(work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| failed(format!("cannot start {}: {e}", fio.display())))?;
    let deadline = Instant::now() + timing.warmup + timing.runtime + FIO_GRACE;
    let (status, process_cpu) = loop {
        match cpu::try_wait_with_cpu(&child) {
            Ok(Some(done)) => break done,
            Ok(None) => {}
            Err(e) => return Err(failed(format!("waiting: {e}"))),
        }
        if stop_requested() || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            if stop_requested() {
                return Err(BenchError::Interrupted);
            }
            return Err(failed(format!("did not finish in time: {command}")));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if stop_requested() {
        return Err(BenchError::Interrupted);
    }
    if !status.success() {
        let err = fs::read_to_string(&stderr_path).unwrap_or_default();
        return Err(failed(format!("{status}: {}: {command}", err.trim())));
    }
    Ok((command, process_cpu))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{select, BufferedVariant, Kind};

    #[test]
    fn fio_job_mirrors_the_workload() {
        let timing = Timing {
            warmup: Duration::from_millis(500),
            runtime: Duration::from_secs(5),
        };
        let p = match select(&["aio-overwrite-4k..16k-qd64".into()]).unwrap()[0].kind {
            Kind::Direct(p) => p,
            _ => unreachable!(),
        };
        let args = fio_args(
            "w",
            &p,
            Path::new("/m/bench.dat"),
            1 << 28,
            timing,
            Path::new("/o.json"),
            Driver::Threads,
        );
        for want in [
            "--rw=randwrite",
            "--bsrange=4096-16384",
            "--blockalign=4096",
            "--numjobs=64",
            "--overwrite=1",
            "--direct=1",
            "--ioengine=psync",
            "--size=268435456",
            "--runtime=5000ms",
            "--ramp_time=500ms",
        ] {
            assert!(
                args.iter().any(|a| a == want),
                "{want} missing from {args:?}"
            );
        }
        let p = match select(&["dsync-overwrite-4k".into()]).unwrap()[0].kind {
            Kind::Direct(p) => p,
            _ => unreachable!(),
        };
        let args = fio_args(
            "d",
            &p,
            Path::new("/m/f"),
            1 << 25,
            timing,
            Path::new("/o"),
            Driver::Queue,
        );
        assert!(args.iter().any(|a| a == "--ioengine=io_uring"));
        assert!(args.iter().any(|a| a == "--iodepth=1"));
        assert!(args.iter().any(|a| a == "--sync=dsync"));
        assert!(args.iter().any(|a| a == "--rw=write"));
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("--bs=4096"), "--bs=4096");
    }

    #[test]
    fn buffered_fio_jobs_are_arranged_as_their_variant() {
        let timing = Timing {
            warmup: Duration::from_millis(300),
            runtime: Duration::from_secs(3),
        };
        let spec = |name: &str| match select(&[name.into()]).unwrap()[0].kind {
            Kind::Buffered(s) => s,
            _ => unreachable!(),
        };
        let args = |name: &str, variant| {
            buffered_fio_args(
                name,
                &spec(name),
                variant,
                Path::new("/m/bench.dat"),
                1 << 26,
                timing,
                Path::new("/o.json"),
            )
        };
        let has = |args: &[String], want: &str| args.iter().any(|a| a == want);
        let common = [
            "--direct=0",
            "--ioengine=psync",
            "--numjobs=1",
            "--size=67108864",
            "--runtime=3000ms",
        ];
        // Only time-based jobs warm up with fio's ramp_time.
        let ramp = "--ramp_time=300ms";
        let warm: &[&str] = &[
            "--rw=read",
            "--pre_read=1",
            "--invalidate=0",
            "--time_based",
            ramp,
        ];
        let cold: &[&str] = &["--rw=read", "--invalidate=1", "--loops=1000000"];
        let overwrite: &[&str] = &["--rw=write", "--overwrite=1", "--time_based", ramp];
        // One fsync per pass: 64 MiB / 64 KiB writes, and one at the end.
        let overwrite_fsync: &[&str] = &[
            "--rw=write",
            "--overwrite=1",
            "--time_based",
            "--fsync=1024",
            "--end_fsync=1",
            ramp,
        ];
        let alloc: &[&str] = &[
            "--rw=write",
            "--fallocate=none",
            "--unlink_each_loop=1",
            "--loops=1000000",
        ];
        let alloc_fsync: &[&str] = &["--fallocate=none", "--unlink_each_loop=1", "--end_fsync=1"];
        for (name, variant, bs, want, not) in [
            (
                "buffered-read-4k",
                BufferedVariant::Warm,
                "--bs=4096",
                warm,
                &["--invalidate=1", "--fsync=16384"][..],
            ),
            (
                "buffered-read-1m",
                BufferedVariant::Cold,
                "--bs=1048576",
                cold,
                &["--time_based", "--pre_read=1", "--invalidate=0", ramp][..],
            ),
            (
                "buffered-write-64k",
                BufferedVariant::Overwrite { fsync: false },
                "--bs=65536",
                overwrite,
                &["--fsync=1024", "--end_fsync=1", "--unlink_each_loop=1"][..],
            ),
            (
                "buffered-write-64k",
                BufferedVariant::Overwrite { fsync: true },
                "--bs=65536",
                overwrite_fsync,
                &["--unlink_each_loop=1"][..],
            ),
            (
                "buffered-write-4k",
                BufferedVariant::Alloc { fsync: false },
                "--bs=4096",
                alloc,
                &["--overwrite=1", "--time_based", "--end_fsync=1", ramp][..],
            ),
            (
                "buffered-write-1m",
                BufferedVariant::Alloc { fsync: true },
                "--bs=1048576",
                alloc_fsync,
                &["--overwrite=1", "--time_based", ramp][..],
            ),
        ] {
            let a = args(name, variant);
            for want in common.iter().chain(want).chain([&bs]) {
                assert!(
                    has(&a, want),
                    "{name} {}: {want} missing from {a:?}",
                    variant.name()
                );
            }
            for not in not {
                assert!(!has(&a, not), "{name} {}: {not} in {a:?}", variant.name());
            }
            assert!(has(&a, &format!("--name={name}-{}", variant.name())));
        }
    }

    #[test]
    fn parses_fio_json() {
        let text = r#"note: something
{"jobs":[{"write":{"iops":1234.5,"bw_bytes":5056512,
  "clat_ns":{"mean":800.25,"percentile":{"99.000000":1500}}}}]}"#;
        let f = parse_fio_json(text, Op::Write).unwrap();
        assert_eq!(
            (f.iops, f.bw_bytes, f.lat_mean_ns, f.lat_p99_ns),
            (1234.5, 5056512.0, 800.25, 1500.0)
        );
        // No CPU fields: the figures stand, CPU says why it is missing.
        assert!(f.cpu.unwrap_err().contains("total_ios"));
        assert!(parse_fio_json(text, Op::Read).unwrap_err().contains("read"));
        let text = r#"{"jobs":[{"read":{"iops":1,"bw_bytes":2,"total_ios":1000,
  "clat_ns":{"mean":3,"percentile":{"99.000000":4}},
  "lat_ns":{"mean":5,"percentile":{"99.000000":6}}}}]}"#;
        let f = parse_fio_json(text, Op::Read).unwrap();
        assert_eq!(
            (f.iops, f.bw_bytes, f.lat_mean_ns, f.lat_p99_ns),
            (1.0, 2.0, 5.0, 6.0)
        );
        assert!(f.cpu.unwrap_err().contains("usr_cpu"));
        assert!(parse_fio_json("", Op::Read).is_err());
        // A job that recorded nothing is an error that says so, not a
        // missing percentile.
        let text = r#"{"jobs":[{"write":{"iops":0,"bw_bytes":0,"total_ios":0,
  "lat_ns":{"min":0,"max":0,"mean":0.0,"stddev":0.0,"N":0}}}]}"#;
        let err = parse_fio_json(text, Op::Write).unwrap_err();
        assert!(err.contains("no write I/O"), "{err}");
    }

    #[test]
    fn fio_cpu_becomes_microseconds_per_io() {
        // As fio 3.x writes it: 8 psync jobs ran 2000 ms each (16000 ms of
        // job time), 10 % of it user and 30 % system = 1600 ms + 4800 ms,
        // for 800,000 writes: 2 + 6 µs per I/O.
        let text = r#"{"fio version":"fio-3.36","jobs":[{"jobname":"w","groupid":0,
  "read":{"iops":0,"bw_bytes":0,"total_ios":0,
    "lat_ns":{"mean":0,"percentile":{"99.000000":0}}},
  "write":{"iops":400000.0,"bw_bytes":1638400000,"total_ios":800000,
    "lat_ns":{"mean":19000.5,"percentile":{"99.000000":40000}}},
  "job_runtime":16000,"usr_cpu":10.000000,"sys_cpu":30.000000,"ctx":12}]}"#;
        let cpu = parse_fio_json(text, Op::Write).unwrap().cpu.unwrap();
        assert!((cpu.user_us - 2.0).abs() < 1e-9, "{cpu:?}");
        assert!((cpu.system_us - 6.0).abs() < 1e-9, "{cpu:?}");
        // The read side of the same job did no I/O: no figure, and why.
        let why = parse_fio_json(text, Op::Read).unwrap().cpu.unwrap_err();
        assert!(why.contains("0 I/Os"), "{why}");
    }
}
