//! The buffered workloads (DESIGN.md fast path 5), in the shape of the
//! ext4-iomap thread's table: reads of 4 KiB, 64 KiB and 1 MiB from the
//! cache and from the device; writes of the same sizes over a written file
//! and into a fresh one, without sync and with an fsync ending every pass
//! (so with writeback in the window).
//!
//! Every variant ([`BufferedVariant`]) is one thread of synchronous
//! sequential I/O in passes over one [`crate::workload::BUFFERED_SPAN`]
//! file, measured on:
//! - `iomapfs`: through the Rust API with a non-direct handle
//!   ([`iomapfs::BufferedFs`]), in the window of [`passes`];
//! - `xfs`, `ext4`: fio `ioengine=psync`, `direct=0`, `numjobs=1` on the
//!   same device, arranged the same way ([`crate::kernel::buffered_fio_args`]);
//!
//! on the bed's loop device (see [`DeviceNeed::DataIndependent`]: fio writes
//! its own data, and zram's speed depends on the data),
//! against two baselines measured in the same workload:
//! - `memcpy` ("ceiling"): the same bytes copied from a buffer as large as
//!   the file at the file's offsets, or into it for writes ([`memcpy`]),
//!   the memory-bandwidth ceiling of a cache;
//! - `raw`: the raw device's sequential direct I/O, measured half before
//!   the variants and half after: "seq-write" (write workloads), 1 MiB
//!   at queue depth 1, the ceiling of writeback; "seq-read" (read
//!   workloads), [`RAW_SEQ_READ_SIZE`] at queue depth
//!   [`RAW_SEQ_READ_DEPTH`], the device's rate for cold reads, every byte
//!   of which comes from it.
//!
//! The raw device's row of direct workloads means nothing here (it has no
//! cache), so ratios are to XFS and memcpy, and, for windows that include
//! writeback or read the device, to raw sequential I/O ([`ratios`]).

mod iomapfs;
mod memcpy;
mod passes;
mod ratios;

use blockdev::AlignedBuf;

use crate::engine::{self, Measurement, Timing};
use crate::kernel::{self, KernelFs};
use crate::report::{BenchReport, BenchResult, Skipped, CPU_SCOPE_FIO};
use crate::target::{alignment_of, open_device, RawTarget, IOMAPFS_FILE};
use crate::testbed::{BedDevice, Testbed};
use crate::workload::{
    BufferedSpec, BufferedVariant, DeviceNeed, IoPattern, Op, Order, Rng, Workload,
};
use crate::{
    cpu_figures, driver_for, engine_command, engine_result, Baseline, BenchError, BenchOptions,
    Progress,
};

use self::iomapfs::BufferedFs;
use self::memcpy::Memcpy;
use self::passes::Window;
use self::ratios::{Role, Row};

const MIB: u64 = 1 << 20;

/// I/O size of the raw device's sequential writes.
const RAW_SEQ_WRITE_SIZE: u64 = MIB;

/// I/O size and queue depth of the raw device's sequential reads: the
/// requests iomapfs's readahead makes once a reader is sequential (one
/// folio of the largest size) and as many as it keeps in flight (one per
/// readahead thread). With 1 MiB reads, cold passes measured 1.05-1.26×
/// the device; with these, iomapfs 0.99-1.19× and XFS 0.86-1.16× (loop
/// bed): the device's rate, up to its noise, bounds them both.
const RAW_SEQ_READ_SIZE: u64 = 2 * MIB;
const RAW_SEQ_READ_DEPTH: usize = 2;

/// Said once in the report of a run with buffered workloads.
pub const NOTE: &str = "buffered workloads: one thread of sequential synchronous reads or \
     writes in passes over a 64 MiB file (less on a small device), on the bed's loop device \
     (zram's compression makes its speed depend on the data, and fio writes other data than \
     the bench). iomapfs uses a non-direct handle with the default mount options, so its \
     default cache size: warm rows assume the cache holds the file (their device reads per \
     I/O say whether it did). warm: the file read once before the window. cold: the cache \
     emptied before every pass, untimed (iomapfs: Volume::drop_caches, its memory kept for new folios; xfs/ext4: fio \
     invalidate=1, POSIX_FADV_DONTNEED of the file at each loop's open, never drop_caches). \
     overwrite: passes over the written file. alloc: each pass appends to a new file, the \
     previous one unlinked, untimed. +fsync: every pass, and the one the window cuts, ends \
     with an fsync inside the window, so everything written is written back in it. \
     ×xfs, ×memcpy and the device figures are against xfs of the same variant, the \
     memcpy ceiling, and the raw device's sequential direct writes (1 MiB, QD 1) or reads \
     (2 MiB, QD 2), half measured before the variants and half after.";

/// Workload × target steps of a buffered workload, for the progress bar:
/// memcpy, raw, and every variant on iomapfs, xfs and ext4.
pub fn steps(spec: &BufferedSpec) -> u64 {
    2 + spec.variants().len() as u64 * (1 + KernelFs::ALL.len() as u64)
}

/// The file size on a device: [`BufferedSpec::span`], or half the device
/// (whole MiB) when that is smaller, so a fresh file fits beside the
/// volume's metadata.
fn span_on(spec: &BufferedSpec, device_bytes: u64) -> u64 {
    let span = spec.span.min(device_bytes / 2 / MIB * MIB).max(MIB);
    span / spec.io_size.max(1) * spec.io_size.max(1)
}

/// What every row of one buffered workload shares.
struct Run<'a> {
    w: &'a Workload,
    spec: &'a BufferedSpec,
    dev: &'a BedDevice,
    span: u64,
    timing: Timing,
}

impl Run<'_> {
    fn memcpy_row(&self) -> Result<Row, BenchError> {
        let window = measure_memcpy(self.spec, self.span, self.timing)?;
        let (from, to) = match self.spec.op {
            Op::Read => ("from", "to"),
            Op::Write => ("to", "from"),
        };
        let command = format!(
            "memcpy of {} bytes {from} a page-aligned {}-byte buffer (the file's size, walked \
             at the file's offsets) {to} one of the I/O size, one thread, in the same window \
             (clock reads, latency records) as iomapfs",
            self.spec.io_size, self.span
        );
        let mut result = self.result(Role::Ceiling, "memcpy", &window.measurement, command);
        result.backend = "memory".into();
        result.device = "memory".into();
        Ok(Row {
            role: Role::Ceiling,
            result,
        })
    }

    /// Half the runtime of the raw device's sequential I/O.
    fn raw_sequential_half(&self) -> Result<Measurement, BenchError> {
        let pattern = raw_sequential(self.spec.op, self.span);
        let half = Timing {
            warmup: self.timing.warmup,
            runtime: self.timing.runtime / 2,
        };
        let (device, _) = open_device(&self.dev.path, self.dev.backend.backend)?;
        let raw = RawTarget::prepare(device, &pattern, self.span)?;
        engine::measure(&raw, &pattern, self.span, 0, half, driver_for(self.dev))
    }

    fn raw_row(&self, m: &Measurement) -> Row {
        let pattern = raw_sequential(self.spec.op, self.span);
        let command = format!(
            "{}; half the runtime before the variants, half after",
            engine_command(&pattern, self.span, "raw", self.dev)
        );
        let role = Role::raw_sequential(self.spec.op);
        Row {
            role,
            result: self.result(role, "raw", m, command),
        }
    }

    fn iomapfs_row(&self, variant: BufferedVariant) -> Result<Row, BenchError> {
        let window = measure_iomapfs(self.dev, self.spec, variant, self.span, self.timing)?;
        let role = Role::Measured(variant);
        let command = iomapfs_command(self.spec, variant, self.span, self.dev);
        let mut result = self.result(role, "iomapfs", &window.measurement, command);
        result.passes = Some(window.passes);
        let fsync_secs = window.end_pass_time.as_secs_f64();
        if variant.includes_writeback() && fsync_secs > 0.0 {
            result.fsync_write_bw_bytes = window
                .end_pass_bytes_written
                .map(|bytes| bytes as f64 / fsync_secs);
        }
        Ok(Row { role, result })
    }

    fn kernel_row(&self, fs: KernelFs, variant: BufferedVariant) -> Result<Row, BenchError> {
        let (w, spec, span, timing) = (self.w, self.spec, self.span, self.timing);
        let k = kernel::run(fs, self.dev, timing, spec.op, |file, output| {
            kernel::buffered_fio_args(w.name, spec, variant, file, span, timing, output)
        })?;
        let (cpu_per_io, _, cpu_note) =
            cpu_figures(k.cpu, None, CPU_SCOPE_FIO, &Baseline::default());
        let role = Role::Measured(variant);
        Ok(Row {
            role,
            result: BenchResult {
                workload: w.name.into(),
                variant: Some(role.name().into()),
                target: fs.name().into(),
                device: self.dev.path.display().to_string(),
                iops: k.iops,
                bw_bytes: k.bw_bytes,
                lat_mean_ns: k.lat_mean_ns,
                lat_p99_ns: k.lat_p99_ns,
                cpu_per_io,
                cpu_note,
                backend: "kernel".into(),
                command: k.command,
                setup: Some(k.setup),
                ..BenchResult::default()
            },
        })
    }

    /// A row from a window measured in this process (memcpy, raw, iomapfs).
    fn result(&self, role: Role, target: &str, m: &Measurement, command: String) -> BenchResult {
        let mut result = engine_result(
            self.w.name,
            target,
            self.dev,
            m,
            &Baseline::default(),
            command,
        );
        result.variant = Some(role.name().into());
        result
    }
}

/// Runs one buffered workload on every target and appends its rows.
pub fn run_workload(
    w: &Workload,
    spec: &BufferedSpec,
    bed: &Testbed,
    opts: &BenchOptions,
    timing: Timing,
    progress: &dyn Progress,
    report: &mut BenchReport,
) -> Result<(), BenchError> {
    let dev = bed.device(DeviceNeed::DataIndependent);
    let run = Run {
        w,
        spec,
        dev,
        span: span_on(spec, dev.caps.size_bytes),
        timing,
    };
    let say =
        |target: &str, what: &str| progress.set_message(&format!("{} · {target}: {what}", w.name));
    let mut rows: Vec<Row> = Vec::new();

    say("memcpy", "measuring");
    rows.extend(recorded(run.memcpy_row(), report, w.name, None, "memcpy")?);
    progress.inc(1);

    // The raw device's sequential I/O: half the runtime before the
    // variants and half after, merged, so that drift of a shared machine
    // over the workload does not pass for a ratio to the device.
    let raw_what = match spec.op {
        Op::Read => "sequential 2 MiB direct reads",
        Op::Write => "sequential 1 MiB direct writes",
    };
    say("raw", &format!("{raw_what} (before the variants)"));
    let raw_before = run.raw_sequential_half();

    let (kernels, unusable) = kernel::usable(opts.no_kernel, dev);
    for (fs, reason) in unusable {
        skip(report, w.name, None, fs.name(), reason);
    }
    // Variant by variant, every target in turn, so the rows compared with
    // each other are measured minutes apart at most.
    for &variant in spec.variants() {
        say(
            "iomapfs",
            &format!("{}: preparing, measuring", variant.name()),
        );
        let row = recorded(
            run.iomapfs_row(variant),
            report,
            w.name,
            Some(variant),
            "iomapfs",
        )?;
        if let Some(row) = row {
            if variant == BufferedVariant::Warm {
                warn_if_warm_read_the_device(&row.result, report);
            }
            rows.push(row);
        }
        progress.inc(1);
        for fs in KernelFs::ALL {
            if kernels.contains(&fs) {
                say(fs.name(), &format!("{}: mkfs, mount, fio", variant.name()));
                let row = run.kernel_row(fs, variant);
                rows.extend(recorded(row, report, w.name, Some(variant), fs.name())?);
            }
            progress.inc(1);
        }
    }

    say("raw", &format!("{raw_what} (after the variants)"));
    let measured = raw_before.and_then(|mut m| {
        m.merge(&run.raw_sequential_half()?);
        Ok(m)
    });
    if let Some(m) = recorded(measured, report, w.name, None, "raw")? {
        rows.push(run.raw_row(&m));
    }
    progress.inc(1);

    ratios::apply(&mut rows);
    report.results.extend(display_order(rows));
    Ok(())
}

/// Baselines first, then variant by variant (in run order): iomapfs, xfs,
/// ext4.
fn display_order(mut rows: Vec<Row>) -> impl Iterator<Item = BenchResult> {
    let mut variants: Vec<Role> = Vec::new();
    for r in &rows {
        if !variants.contains(&r.role) {
            variants.push(r.role);
        }
    }
    rows.sort_by_key(|r| {
        let baseline = match r.role {
            Role::Ceiling => 0,
            Role::RawSeqRead | Role::RawSeqWrite => 1,
            Role::Measured(_) => 2,
        };
        let variant = variants.iter().position(|v| *v == r.role);
        let target = match r.result.target.as_str() {
            "iomapfs" => 0,
            "xfs" => 1,
            _ => 2,
        };
        (baseline, variant, target)
    });
    rows.into_iter().map(|r| r.result)
}

/// Direct sequential I/O over the span: what writeback (writes) or a
/// cold pass (reads) could reach at best on this device.
fn raw_sequential(op: Op, span: u64) -> IoPattern {
    let (size, queue_depth) = match op {
        Op::Read => (RAW_SEQ_READ_SIZE, RAW_SEQ_READ_DEPTH),
        Op::Write => (RAW_SEQ_WRITE_SIZE, 1),
    };
    // A span is whole MiB, at least one.
    let size = size.min(span);
    IoPattern {
        op,
        order: Order::Sequential,
        min_size: size,
        max_size: size,
        size_step: size,
        align: size,
        queue_depth,
        dsync: false,
        span,
        needs: DeviceNeed::DataIndependent,
    }
}

/// An I/O buffer of the workload's size with data in it.
fn io_buffer(len: u64, align: usize) -> Result<AlignedBuf, BenchError> {
    let mut buf = AlignedBuf::new(len as usize, align)
        .map_err(|e| BenchError::setup("I/O buffer", e.to_string()))?;
    Rng::new(0x6275_6666).fill(&mut buf);
    Ok(buf)
}

fn measure_memcpy(spec: &BufferedSpec, span: u64, timing: Timing) -> Result<Window, BenchError> {
    let source = usize::try_from(span)
        .map_err(|_| BenchError::setup("memcpy buffer", format!("{span} bytes")))?;
    let mut target = Memcpy::new(source, spec.op)?;
    let mut buf = io_buffer(spec.io_size, 4096)?;
    passes::run(&mut target, spec.io_size, span, timing.warmup, &mut buf)?;
    passes::run(&mut target, spec.io_size, span, timing.runtime, &mut buf)
}

/// Prepares iomapfs for `variant`, warms up, measures, and unmounts.
fn measure_iomapfs(
    dev: &BedDevice,
    spec: &BufferedSpec,
    variant: BufferedVariant,
    span: u64,
    timing: Timing,
) -> Result<Window, BenchError> {
    let (device, _) = open_device(&dev.path, dev.backend.backend)?;
    let align = alignment_of(&*device);
    let mut fs = BufferedFs::prepare(device, spec, variant, span)?;
    let measured = io_buffer(spec.io_size, align).and_then(|mut buf| {
        passes::run(&mut fs, spec.io_size, span, timing.warmup, &mut buf)?;
        passes::run(&mut fs, spec.io_size, span, timing.runtime, &mut buf)
    });
    let closed = fs.close();
    let measured = measured?;
    closed.map(|()| measured)
}

/// What the iomapfs row ran, for its `command`.
fn iomapfs_command(
    spec: &BufferedSpec,
    variant: BufferedVariant,
    span: u64,
    dev: &BedDevice,
) -> String {
    let rw = match spec.op {
        Op::Read => "read",
        Op::Write => "write",
    };
    let arrangement = match variant {
        BufferedVariant::Warm => "the file read once before the window".to_string(),
        BufferedVariant::Cold => {
            "the volume's cached folios dropped (Volume::drop_caches) before every pass (untimed)"
                .to_string()
        }
        BufferedVariant::Overwrite { fsync } => format!(
            "passes over the written file{}",
            if fsync {
                ", each ended by fsync (timed)"
            } else {
                ""
            }
        ),
        BufferedVariant::Alloc { fsync } => format!(
            "each pass appends to a new file, the previous one unlinked (untimed){}",
            if fsync {
                ", each ended by fsync (timed)"
            } else {
                ""
            }
        ),
    };
    format!(
        "iomapfs rw={rw} bs={} passes over {IOMAPFS_FILE} ({span} bytes) on {}, one thread, \
         non-direct handle, default mount options; {arrangement}",
        spec.io_size,
        dev.path.display()
    )
}

/// Warm reads that went to the device were not warm: says so, with the
/// likely reason.
fn warn_if_warm_read_the_device(result: &BenchResult, report: &mut BenchReport) {
    let Some(per) = result.requests_per_op else {
        return;
    };
    if per.reads > 0.0 {
        report.notes.push(format!(
            "{} warm · iomapfs: {:.2} device reads per read, so reads were not all served \
             from a cache (non-direct handles not cached yet, or a cache smaller than the \
             file)",
            result.workload, per.reads
        ));
    }
}

fn skip(
    report: &mut BenchReport,
    workload: &str,
    variant: Option<BufferedVariant>,
    target: &str,
    reason: impl Into<String>,
) {
    report.skipped.push(Skipped {
        workload: workload.into(),
        variant: variant.map(|v| v.name().into()),
        target: target.into(),
        reason: reason.into(),
    });
}

/// Interrupts end the run; any other failure of one target in one variant
/// is recorded as a skip with the error, and the run goes on.
fn recorded<T>(
    result: Result<T, BenchError>,
    report: &mut BenchReport,
    workload: &str,
    variant: Option<BufferedVariant>,
    target: &str,
) -> Result<Option<T>, BenchError> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
        Err(e) => {
            skip(report, workload, variant, target, format!("failed: {e}"));
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{select, Kind, WORKLOADS};

    fn spec(name: &str) -> BufferedSpec {
        match select(&[name.to_string()]).unwrap()[0].kind {
            Kind::Buffered(s) => s,
            _ => panic!("{name} is not buffered"),
        }
    }

    #[test]
    fn the_file_fits_the_device_and_holds_whole_ios() {
        let s = spec("buffered-read-1m");
        assert_eq!(span_on(&s, 512 * MIB), 64 * MIB);
        assert_eq!(span_on(&s, 100 * MIB), 50 * MIB);
        // Never below one MiB, and always whole I/Os.
        assert_eq!(span_on(&s, MIB), MIB);
        let s = BufferedSpec {
            io_size: 3 * MIB,
            ..s
        };
        assert_eq!(span_on(&s, 100 * MIB), 48 * MIB);
    }

    #[test]
    fn steps_count_every_row_the_workload_can_make() {
        assert_eq!(steps(&spec("buffered-read-4k")), 2 + 2 * 3);
        assert_eq!(steps(&spec("buffered-write-4k")), 2 + 4 * 3);
        let buffered = WORKLOADS
            .iter()
            .filter(|w| matches!(w.kind, Kind::Buffered(_)))
            .count();
        assert_eq!(buffered, 6);
    }

    #[test]
    fn rows_show_baselines_first_then_each_variant_iomapfs_xfs_ext4() {
        let overwrite = Role::Measured(BufferedVariant::Overwrite { fsync: false });
        let alloc = Role::Measured(BufferedVariant::Alloc { fsync: true });
        let row = |role: Role, target: &str| Row {
            role,
            result: BenchResult {
                variant: Some(role.name().into()),
                target: target.into(),
                ..BenchResult::default()
            },
        };
        let rows = vec![
            row(overwrite, "ext4"),
            row(overwrite, "iomapfs"),
            row(Role::RawSeqWrite, "raw"),
            row(alloc, "xfs"),
            row(overwrite, "xfs"),
            row(alloc, "iomapfs"),
            row(Role::Ceiling, "memcpy"),
        ];
        let order: Vec<String> = display_order(rows)
            .map(|r| format!("{} {}", r.variant.unwrap(), r.target))
            .collect();
        assert_eq!(
            order,
            [
                "ceiling memcpy",
                "seq-write raw",
                "overwrite iomapfs",
                "overwrite xfs",
                "overwrite ext4",
                "alloc+fsync iomapfs",
                "alloc+fsync xfs",
            ]
        );
    }
}
