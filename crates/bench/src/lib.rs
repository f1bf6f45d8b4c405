//! The iomapfs benchmark engine (`iomapfs bench`).
//!
//! Runs the seed workloads on one device in one run. Direct workloads run
//! against
//! - `raw`: the device itself, same backend, same queue depth, same offsets;
//! - `iomapfs`: one preallocated, fully written file on a fresh volume;
//! - `xfs`, `ext4`: the kernel's file systems made on the same device,
//!   measured by fio with the equivalent job (root, fio and mkfs needed);
//!
//! and report absolute figures and ratios to raw (DESIGN.md, "Benchmarks").
//! Buffered workloads (see `buffered`) run iomapfs, xfs and ext4 through
//! their caches, against a `memcpy` ceiling and, for writeback, the raw
//! device's sequential writes, and report ratios to XFS and to those.
//! fio rows (see `fio_rows`) run every target through fio itself, iomapfs
//! through the fio engine: one harness for all.
//! Mount rows (see `mount_rows`) run fio through the FUSE mount of iomapfs
//! and on XFS, with the daemon's CPU per I/O beside fio's.
//!
//! Entry points: [`run`] with [`BenchOptions`] (the CLI flags, no clap
//! here) and a [`Progress`] sink; [`render_table`] for people and
//! [`BenchReport`] (serde) for scripts.
//!
//! Module map: `workload` (names and I/O patterns) · `testbed` (zram, loop,
//! image file; teardown) · `safety` (refusing devices with data) · `target`
//! (raw and iomapfs targets) · `engine` (threads, warm-up, measured window)
//! · `buffered` (buffered workloads: passes, iomapfs non-direct, memcpy,
//! ratios) · `fio_rows` (every target through fio) · `mount_rows` (fio
//! through the FUSE mount vs XFS) · `cpu` (getrusage, CPU per I/O) ·
//! `histogram` (latency) · `kernel` (mkfs, mount, fio) · `report` (JSON
//! shape, table) · `interrupt` (Ctrl-C).

mod buffered;
mod cpu;
mod engine;
mod error;
mod fio_rows;
pub mod histogram;
mod interrupt;
mod kernel;
mod metadata_scale;
mod mount_rows;
mod report;
mod safety;
mod target;
mod testbed;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use blockdev::Backend;
pub use error::BenchError;
pub use interrupt::request_stop;
pub use metadata_scale::MetadataScaleResult;
pub use report::{
    render_table, BenchReport, BenchResult, CpuPerIo, DeviceInfo, DeviceRequests, Machine,
    RequestsPerOp, Settings, Skipped, CPU_SCOPE_FIO, CPU_SCOPE_FIO_PROCESS, CPU_SCOPE_FUSE_DAEMON,
    CPU_SCOPE_PROCESS,
};
pub use safety::recognise;
pub use testbed::LOCK_PATH;

use cpu::CpuPerIoTime;
use engine::{Driver, Measurement, Timing};
use interrupt::SignalGuard;
use report::DeviceInfo as ReportDevice;
use target::{open_device, IomapfsTarget, RawTarget, IOMAPFS_BLOCK_SIZE, IOMAPFS_FILE};
use testbed::{BedDevice, BedKind, Testbed};
use workload::{seed_of, DeviceNeed, IoPattern, Kind, Workload};

/// What to run; mirrors `iomapfs bench`'s flags.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Device or image file to use (destroyed). `None`: set up a RAM-backed
    /// bed (zram + loop on tmpfs as root, else an image file) and tear it
    /// down afterwards.
    pub device: Option<PathBuf>,
    /// Measured time per workload per target (after a warm-up of a tenth of
    /// it, between 50 ms and 1 s).
    pub runtime: Duration,
    /// Workload names (see [`workloads`]); empty: all of them.
    pub workloads: Vec<String>,
    /// Also write the report as JSON here.
    pub json: Option<PathBuf>,
    /// Skip kernel XFS/ext4 comparisons.
    pub no_kernel: bool,
    /// Overwrite an explicit device even if it holds a file system or
    /// partition table (never one that is mounted or in use).
    pub force: bool,
    /// Backend of raw and iomapfs targets: `Sync` (queue depth N = N
    /// threads), `Uring` (one thread, N requests in flight), or `Auto`
    /// (probed per device: io_uring only where the device takes NOWAIT).
    pub backend: Backend,
    /// How iomapfs targets mount their volume (the cache size).
    pub mount: iomapfs_fs::MountOptions,
    /// Only the fio rows (`fio-*` workloads): all of them, or those of
    /// `workloads`.
    pub fio_only: bool,
    /// The fio engine for fio rows' iomapfs target; `None`: found as
    /// `fio_rows::find_engine` says (`$IOMAPFS_FIO_ENGINE`, then the
    /// source tree's `fio-engine/build/libiomapfs_fio.so`).
    pub fio_engine: Option<PathBuf>,
    /// How mount rows mount the volume through FUSE (threads, caching), as
    /// `iomapfs mount -o` would.
    pub fuse: iomapfs_mount::MountConfig,
    /// Record every write, FUA write and flush of the iomapfs target (its
    /// format, file preparation, measurement and unmount) to this
    /// log-writes file, for `iomapfs replay`. Only for one direct-I/O
    /// workload (see `check_record`); the recording slows the target, so
    /// its figures are not comparable with an unrecorded run.
    pub record: Option<PathBuf>,
    /// Format iomapfs targets with extent pages
    /// (`FormatOptions::extent_pages`, on by default as for mkfs).
    pub extent_pages: bool,
    /// With extent pages, list them in index pages
    /// (`FormatOptions::page_index`, on by default as for mkfs).
    pub page_index: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            device: None,
            runtime: Duration::from_secs(5),
            workloads: Vec::new(),
            json: None,
            no_kernel: false,
            force: false,
            backend: Backend::Auto,
            mount: iomapfs_fs::MountOptions::default(),
            fio_only: false,
            fio_engine: None,
            fuse: iomapfs_mount::MountConfig::default(),
            record: None,
            extent_pages: true,
            page_index: true,
        }
    }
}

/// Where a run reports progress (the CLI plugs an indicatif bar in).
/// Called from the thread that called [`run`].
pub trait Progress {
    /// Total steps (workloads × targets), announced once at the start.
    fn set_length(&self, _steps: u64) {}
    /// What is happening now, e.g. `randread-4k-qd1 · iomapfs: measuring`.
    fn set_message(&self, message: &str);
    /// `steps` more workload × target pairs done (measured or skipped).
    fn inc(&self, steps: u64);
    /// The run is over (also called on failure).
    fn finish(&self);
}

/// A [`Progress`] that shows nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn set_message(&self, _message: &str) {}
    fn inc(&self, _steps: u64) {}
    fn finish(&self) {}
}

/// Every workload name with a one-line summary, in run order (for `--help`):
/// the seed workloads, then the fio rows.
pub fn workloads() -> Vec<(&'static str, &'static str)> {
    workload::all()
        .map(|w| (w.name, w.summary))
        .chain(metadata_scale::workloads())
        .collect()
}

/// Whether `name` is a fio row (every target measured by fio).
pub fn is_fio_row(name: &str) -> bool {
    workload::FIO_WORKLOADS.iter().any(|w| w.name == name)
}

/// Names that select several workloads at once, with what they select
/// (for `--workload` and `--help`).
pub fn workload_groups() -> Vec<(&'static str, &'static str)> {
    vec![(
        workload::MOUNT_GROUP,
        "every mount-* row: fio through the FUSE mount of iomapfs vs XFS on the same device",
    )]
}

/// Every variant of the buffered workloads (`buffered-read-*`: the first
/// two; `buffered-write-*`: the rest) with a one-line summary, for
/// `--help`. Each is a row (`variant` in results) of each target.
pub fn buffered_variants() -> Vec<(&'static str, &'static str)> {
    workload::BufferedVariant::ALL
        .iter()
        .map(|v| (v.name(), v.summary()))
        .collect()
}

/// Target names of direct workloads, in the order each runs them
/// (buffered workloads: `memcpy`, `raw` for writes, then `iomapfs`, `xfs`
/// and `ext4` in each variant).
pub const TARGETS: [&str; 4] = ["raw", "iomapfs", "xfs", "ext4"];

/// Smallest and largest warm-up.
const WARMUP_MIN: Duration = Duration::from_millis(50);
const WARMUP_MAX: Duration = Duration::from_secs(1);

fn warmup_for(runtime: Duration) -> Duration {
    (runtime / 10).clamp(WARMUP_MIN, WARMUP_MAX)
}

/// Data span of a workload on a device: its nominal file size, or half the
/// device (whole MiB) when that is smaller.
pub(crate) fn span_for(pattern: &IoPattern, device_bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    pattern.span.min(device_bytes / 2 / MIB * MIB).max(MIB)
}

/// Runs the selected workloads and returns the report (also written to
/// `opts.json` when set). Devices set up for the run are torn down before it
/// returns, whatever happens; SIGINT/SIGTERM/SIGHUP during the run stop it
/// with [`BenchError::Interrupted`] after teardown.
pub fn run(opts: &BenchOptions, progress: &dyn Progress) -> Result<BenchReport, BenchError> {
    target::set_mount_options(opts.mount.clone());
    target::set_extent_pages(opts.extent_pages);
    target::set_page_index(opts.page_index);
    let result = run_inner(opts, progress);
    progress.finish();
    result
}

fn run_inner(opts: &BenchOptions, progress: &dyn Progress) -> Result<BenchReport, BenchError> {
    if opts.runtime.is_zero() {
        return Err(BenchError::InvalidOption(
            "the runtime must be more than zero".into(),
        ));
    }
    if opts.fio_only {
        if let Some(other) = opts.workloads.iter().find(|n| !is_fio_row(n)) {
            return Err(BenchError::InvalidOption(format!(
                "{other} is not a fio row; with only fio rows, name fio-* workloads"
            )));
        }
    }
    // The metadata workloads make their own image files and run after
    // the others; they are only run when named.
    let (metadata, device_workloads): (Vec<String>, Vec<String>) = opts
        .workloads
        .iter()
        .cloned()
        .partition(|n| metadata_scale::is_metadata_workload(n));
    if device_workloads.is_empty() && !metadata.is_empty() {
        return run_metadata_only(opts, &metadata, progress);
    }
    let mut selected = workload::select(&device_workloads)?;
    if opts.fio_only {
        selected.retain(|w| matches!(w.kind, Kind::Fio(_)));
    }
    check_record(opts, &selected, &metadata)?;
    let timing = Timing {
        warmup: warmup_for(opts.runtime),
        runtime: opts.runtime,
    };
    let _signals = SignalGuard::install();
    let needs: Vec<DeviceNeed> = selected.iter().map(|w| w.kind.needs()).collect();
    progress.set_length(
        selected.iter().map(|w| steps(w)).sum::<u64>() + metadata_scale::steps(&metadata),
    );
    progress.set_message("setting up devices");
    let bed = Testbed::prepare(opts, &needs, progress)?;
    let mut report = BenchReport {
        machine: machine(&bed),
        settings: Settings {
            runtime_s: timing.runtime.as_secs_f64(),
            warmup_s: timing.warmup.as_secs_f64(),
            queue_model: "sync and pool backends: queue depth N = N threads with one \
                          synchronous I/O each (fio psync, numjobs=N); io_uring backend: one \
                          thread with N \
                          requests in flight (fio io_uring, iodepth=N)"
                .into(),
        },
        results: Vec::new(),
        skipped: Vec::new(),
        notes: bed.notes.clone(),
        metadata_scale: Vec::new(),
    };
    if selected.iter().any(|w| matches!(w.kind, Kind::Direct(_))) {
        report.notes.push(
            "raw is measured for half the runtime just before iomapfs and half just after, \
             and ×raw is against both halves: drift of this machine over the pair cancels"
                .into(),
        );
    }
    report.notes.push(report::CPU_NOTE.into());
    if selected.iter().any(|w| matches!(w.kind, Kind::Buffered(_))) {
        report.notes.push(buffered::NOTE.into());
    }
    if selected.iter().any(|w| matches!(w.kind, Kind::Fio(_))) {
        report.notes.push(fio_rows::NOTE.into());
    }
    if selected.iter().any(|w| matches!(w.kind, Kind::Mount(_))) {
        report.notes.push(mount_rows::NOTE.into());
    }
    let outcome = (|| {
        for w in &selected {
            run_workload(w, &bed, opts, timing, progress, &mut report)?;
        }
        if !metadata.is_empty() {
            report.metadata_scale = metadata_scale::run(
                &metadata,
                &metadata_scale::image_dir(),
                opts.backend,
                opts.runtime,
                progress,
            )?;
        }
        Ok(())
    })();
    progress.set_message("tearing down");
    let problems = bed.teardown();
    report
        .notes
        .extend(problems.into_iter().map(|p| format!("teardown: {p}")));
    outcome?;
    write_json(opts, &report)?;
    Ok(report)
}

/// `--record` records one log of one volume: the iomapfs target of exactly
/// one direct-I/O workload (the rows that drive the volume through this
/// process). Buffered, fio and mount rows reach the device through other
/// processes or the kernel, and several workloads would reformat the device
/// in one log, which no replay point could mount.
fn check_record(
    opts: &BenchOptions,
    selected: &[&'static Workload],
    metadata: &[String],
) -> Result<(), BenchError> {
    if opts.record.is_none() {
        return Ok(());
    }
    let direct =
        selected.len() == 1 && metadata.is_empty() && matches!(selected[0].kind, Kind::Direct(_));
    if !direct {
        let names: Vec<&str> = workload::all()
            .filter(|w| matches!(w.kind, Kind::Direct(_)))
            .map(|w| w.name)
            .collect();
        return Err(BenchError::InvalidOption(format!(
            "--record records the iomapfs target of one direct-I/O workload: name exactly one with --workload ({})",
            names.join(", ")
        )));
    }
    Ok(())
}

/// Runs only metadata workloads: they need no bed (no zram, loop device or
/// its lock), just image files in RAM.
fn run_metadata_only(
    opts: &BenchOptions,
    names: &[String],
    progress: &dyn Progress,
) -> Result<BenchReport, BenchError> {
    let _signals = SignalGuard::install();
    progress.set_length(metadata_scale::steps(names));
    let dir = metadata_scale::image_dir();
    let results = metadata_scale::run(names, &dir, opts.backend, opts.runtime, progress)?;
    let report = BenchReport {
        machine: Machine {
            kernel: report::kernel_release(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes: report::memory_bytes(),
            device: format!("sparse image files in {}", dir.display()),
            device_kind: BedKind::ImageFile.label().into(),
            logical_block_size: 0,
            backend: results
                .first()
                .map_or_else(String::new, |r| r.backend.clone()),
            devices: Vec::new(),
        },
        settings: Settings {
            runtime_s: opts.runtime.as_secs_f64(),
            warmup_s: 0.0,
            queue_model: "metadata-scale: one reader thread, one synchronous 4 KiB direct \
                          read at a time"
                .into(),
        },
        results: Vec::new(),
        skipped: Vec::new(),
        notes: Vec::new(),
        metadata_scale: results,
    };
    write_json(opts, &report)?;
    Ok(report)
}

fn write_json(opts: &BenchOptions, report: &BenchReport) -> Result<(), BenchError> {
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| BenchError::io("encode JSON report", std::io::Error::other(e)))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| BenchError::io(format!("write {}", path.display()), e))?;
    }
    Ok(())
}

fn machine(bed: &Testbed) -> Machine {
    let devices: Vec<ReportDevice> = bed
        .devices
        .iter()
        .map(|d| ReportDevice {
            path: d.path.display().to_string(),
            kind: d.kind.label().to_string(),
            logical_block_size: d.caps.logical_block_size,
            size_bytes: d.caps.size_bytes,
            volatile_write_cache: d.caps.volatile_write_cache,
            fua: d.caps.fua,
            direct_io: d.caps.direct_io,
            backend: d.backend.reason.clone(),
            backing_file: d.backing_file.as_ref().map(|p| p.display().to_string()),
        })
        .collect();
    let join =
        |f: &dyn Fn(&ReportDevice) -> String| devices.iter().map(f).collect::<Vec<_>>().join(", ");
    let mut backends: Vec<&str> = bed
        .devices
        .iter()
        .map(|d| d.backend.backend.as_str())
        .collect();
    backends.dedup();
    let mut backend = backends.join(" + ");
    if devices.iter().any(|d| !d.direct_io) {
        backend.push_str(
            " (O_DIRECT refused by the host file system: figures include its page cache)",
        );
    }
    Machine {
        kernel: report::kernel_release(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_bytes: report::memory_bytes(),
        device: join(&|d| d.path.clone()),
        device_kind: join(&|d| d.kind.clone()),
        logical_block_size: devices.first().map_or(0, |d| d.logical_block_size),
        backend,
        devices,
    }
}

/// Workload × target steps of `w`, for the progress bar.
fn steps(w: &Workload) -> u64 {
    match &w.kind {
        Kind::Direct(_) | Kind::Fio(_) => TARGETS.len() as u64,
        Kind::Buffered(spec) => buffered::steps(spec),
        Kind::Mount(_) => mount_rows::STEPS,
    }
}

/// The engine driver for a device's chosen backend. The worker-pool
/// backend gets threads, as sync: on the devices it is chosen for, N
/// threads with one synchronous call each already keep N requests in the
/// device, and the kernel targets keep fio's psync model beside them.
pub(crate) fn driver_for(dev: &BedDevice) -> Driver {
    if dev.backend.backend == Backend::Uring {
        Driver::Queue
    } else {
        Driver::Threads
    }
}

pub(crate) fn skip(
    report: &mut BenchReport,
    workload: &str,
    target: &str,
    reason: impl Into<String>,
) {
    report.skipped.push(Skipped {
        workload: workload.into(),
        variant: None,
        target: target.into(),
        reason: reason.into(),
    });
}

/// Describes what the engine ran, for the result's `command`.
pub(crate) fn engine_command(
    pattern: &IoPattern,
    span: u64,
    target: &str,
    dev: &BedDevice,
) -> String {
    let depth = match driver_for(dev) {
        Driver::Threads => format!(
            "threads={} ({} backend)",
            pattern.queue_depth,
            dev.backend.backend.as_str()
        ),
        Driver::Queue => format!("iodepth={} (io_uring queue, 1 thread)", pattern.queue_depth),
    };
    let rw = pattern.fio_rw();
    let size = if pattern.min_size == pattern.max_size {
        format!("bs={}", pattern.min_size)
    } else {
        format!("bsrange={}-{}", pattern.min_size, pattern.max_size)
    };
    let on = match target {
        "raw" => format!("raw device {} [0, {span})", dev.path.display()),
        _ => format!(
            "iomapfs file {IOMAPFS_FILE} ({span} bytes, block size {IOMAPFS_BLOCK_SIZE}) on {}",
            dev.path.display()
        ),
    };
    let sync = match (pattern.dsync, target) {
        (false, _) => "",
        // What an O_DSYNC write to a block device is.
        (true, "raw") => " dsync=1 (each write RWF_DSYNC, counted as FUA)",
        (true, _) => " dsync=1 (file opened O_DSYNC)",
    };
    format!(
        "engine rw={rw} {size} blockalign={} {depth} direct=1{sync} on {on}",
        pattern.align,
    )
}

/// The raw device's figures of a workload, which other targets are
/// compared with.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Baseline {
    iops: Option<f64>,
    cpu_us_per_io: Option<f64>,
}

/// CPU per I/O for the report, from per-I/O times (or why there are none).
pub(crate) fn cpu_figures(
    per_io: Result<CpuPerIoTime, String>,
    io_threads: Option<CpuPerIoTime>,
    scope: &str,
    raw: &Baseline,
) -> (Option<CpuPerIo>, Option<f64>, Option<String>) {
    match per_io {
        Ok(c) => {
            let total_us = c.total_us();
            (
                Some(CpuPerIo {
                    total_us,
                    user_us: c.user_us,
                    system_us: c.system_us,
                    scope: scope.into(),
                    io_threads_us: io_threads.map(|t| t.total_us()),
                }),
                ratio(total_us, raw.cpu_us_per_io),
                None,
            )
        }
        Err(why) => (None, None, Some(why)),
    }
}

pub(crate) fn engine_result(
    workload: &str,
    target: &str,
    dev: &BedDevice,
    m: &Measurement,
    raw: &Baseline,
    command: String,
) -> BenchResult {
    let iops = m.iops();
    let requests = m.requests.map(|r| DeviceRequests {
        reads: r.reads,
        writes: r.writes,
        fua_writes: r.fua_writes,
        flushes: r.flushes,
        bytes_read: r.bytes_read,
        bytes_written: r.bytes_written,
    });
    let per_op = requests.filter(|_| m.ops > 0).map(|r| {
        let ops = m.ops as f64;
        RequestsPerOp {
            reads: r.reads as f64 / ops,
            writes: r.writes as f64 / ops,
            fua_writes: r.fua_writes as f64 / ops,
            flushes: r.flushes as f64 / ops,
        }
    });
    let cpu = match (m.cpu, m.cpu_per_io()) {
        (None, _) => Err("getrusage failed".to_string()),
        (Some(_), None) => Err("no I/O measured".to_string()),
        (Some(_), Some(c)) => Ok(c),
    };
    let (cpu_per_io, cpu_ratio_to_raw, cpu_note) =
        cpu_figures(cpu, m.io_thread_cpu_per_io(), CPU_SCOPE_PROCESS, raw);
    BenchResult {
        workload: workload.into(),
        target: target.into(),
        device: dev.path.display().to_string(),
        iops,
        bw_bytes: m.bandwidth(),
        lat_mean_ns: m.latency.mean(),
        lat_p99_ns: m.latency.quantile(0.99) as f64,
        ratio_to_raw: ratio(iops, raw.iops),
        cpu_per_io,
        cpu_ratio_to_raw,
        cpu_note,
        device_requests: requests,
        requests_per_op: per_op,
        ops: Some(m.ops),
        backend: dev.backend.backend.as_str().into(),
        command,
        setup: None,
        ..BenchResult::default()
    }
}

fn ratio(x: f64, raw: Option<f64>) -> Option<f64> {
    raw.filter(|r| *r > 0.0).map(|r| x / r)
}

/// Interrupts end the run; any other failure of one target is recorded as
/// a skip with the error, and the run goes on.
pub(crate) fn recorded<T>(
    result: Result<T, BenchError>,
    report: &mut BenchReport,
    workload: &str,
    target: &str,
) -> Result<Option<T>, BenchError> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
        Err(e) => {
            skip(report, workload, target, format!("failed: {e}"));
            Ok(None)
        }
    }
}

fn run_workload(
    w: &Workload,
    bed: &Testbed,
    opts: &BenchOptions,
    timing: Timing,
    progress: &dyn Progress,
    report: &mut BenchReport,
) -> Result<(), BenchError> {
    let steps = TARGETS.len() as u64;
    let pattern = match w.kind {
        Kind::Direct(p) => p,
        Kind::Buffered(spec) => {
            return buffered::run_workload(w, &spec, bed, opts, timing, progress, report)
        }
        Kind::Fio(job) => {
            return fio_rows::run_workload(w, &job, bed, opts, timing, progress, report)
        }
        Kind::Mount(job) => {
            return mount_rows::run_workload(w, &job, bed, opts, timing, progress, report)
        }
    };
    let dev = match bed.device_for(&pattern) {
        Ok(dev) => dev,
        Err(reason) => {
            for t in TARGETS {
                skip(report, w.name, t, reason.clone());
            }
            progress.inc(steps);
            return Ok(());
        }
    };
    if pattern.dsync && !dev.caps.volatile_write_cache {
        report.notes.push(format!(
            "{}: {} has no volatile write cache, so DSYNC writes need no flush there",
            w.name,
            dev.path.display()
        ));
    }
    let span = span_for(&pattern, dev.caps.size_bytes);
    let seed = seed_of(w.name);
    let say =
        |target: &str, what: &str| progress.set_message(&format!("{} · {target}: {what}", w.name));

    // raw, iomapfs, raw: the raw device is measured for half the runtime
    // before iomapfs and half after, and the ratio taken against both
    // halves together, so that a machine slowing down or speeding up over
    // the pair (this one is shared) does not pass for a difference between
    // them.
    // Open with the backend probed for this device, so every target of
    // the run uses the same one.
    let backend = dev.backend.backend;
    let driver = driver_for(dev);
    let half = Timing {
        warmup: timing.warmup,
        runtime: timing.runtime / 2,
    };
    let measure_raw = |when: &str| {
        say("raw", &format!("writing the data span ({when})"));
        open_device(&dev.path, backend)
            .and_then(|(d, _)| RawTarget::prepare(d, &pattern, span))
            .and_then(|raw| {
                say("raw", &format!("measuring ({when})"));
                engine::measure(&raw, &pattern, span, seed, half, driver)
            })
    };
    let raw_before = measure_raw("before iomapfs");

    say("iomapfs", "formatting and writing the file");
    let mut recorder = None;
    let fs_measured = open_device(&dev.path, backend)
        .and_then(|(d, _)| match &opts.record {
            None => Ok(d),
            Some(log) => {
                let r = Arc::new(
                    blockdev::LogWritesDevice::create(d, log)
                        .map_err(|e| BenchError::device("--record", e))?,
                );
                recorder = Some(r.clone());
                Ok(r as Arc<dyn blockdev::BlockDevice>)
            }
        })
        .and_then(|d| IomapfsTarget::prepare(d, &pattern, span))
        .and_then(|fs| {
            say("iomapfs", "measuring");
            let m = engine::measure(&fs, &pattern, span, seed, timing, driver);
            let closed = fs.close();
            let m = m?;
            closed.map(|()| m)
        })
        .and_then(|m| match recorder.take() {
            Some(r) => r
                .flush_log()
                .map(|()| m)
                .map_err(|e| BenchError::device("--record", e)),
            None => Ok(m),
        });
    let raw_measured = raw_before.and_then(|mut before| {
        let after = measure_raw("after iomapfs")?;
        before.merge(&after);
        Ok(before)
    });

    let mut raw = Baseline::default();
    if let Some(m) = recorded(raw_measured, report, w.name, "raw")? {
        raw = Baseline {
            iops: Some(m.iops()),
            cpu_us_per_io: m.cpu_per_io().map(|c| c.total_us()),
        };
        let command = engine_command(&pattern, span, "raw", dev);
        report
            .results
            .push(engine_result(w.name, "raw", dev, &m, &raw, command));
    }
    progress.inc(1);
    if let Some(m) = recorded(fs_measured, report, w.name, "iomapfs")? {
        let command = engine_command(&pattern, span, "iomapfs", dev);
        report
            .results
            .push(engine_result(w.name, "iomapfs", dev, &m, &raw, command));
    }
    progress.inc(1);

    // kernel file systems
    let (kernels, unusable) = kernel::usable(opts.no_kernel, dev);
    for (fs, reason) in unusable {
        skip(report, w.name, fs.name(), reason);
        progress.inc(1);
    }
    for fs in kernels {
        let target = fs.name();
        say(target, "mkfs, mount, fio");
        let ran = kernel::run(fs, dev, timing, pattern.op, |file, output| {
            kernel::fio_args(w.name, &pattern, file, span, timing, output, driver)
        });
        if let Some(k) = recorded(ran, report, w.name, target)? {
            let (cpu_per_io, cpu_ratio_to_raw, cpu_note) =
                cpu_figures(k.cpu, None, CPU_SCOPE_FIO, &raw);
            report.results.push(BenchResult {
                workload: w.name.into(),
                target: target.into(),
                device: dev.path.display().to_string(),
                iops: k.iops,
                bw_bytes: k.bw_bytes,
                lat_mean_ns: k.lat_mean_ns,
                lat_p99_ns: k.lat_p99_ns,
                ratio_to_raw: ratio(k.iops, raw.iops),
                cpu_per_io,
                cpu_ratio_to_raw,
                cpu_note,
                device_requests: None,
                requests_per_op: None,
                ops: None,
                backend: "kernel".into(),
                command: k.command,
                setup: Some(k.setup),
                ..BenchResult::default()
            });
        }
        progress.inc(1);
    }
    Ok(())
}
