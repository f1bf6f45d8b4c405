//! `iomapfs bench`: the seed workloads on one device, raw device vs iomapfs
//! vs kernel XFS and ext4, as absolute figures and ratios to the raw device
//! (buffered workloads: to XFS and a memcpy ceiling).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use iomapfs_bench::{BenchOptions, Progress};

use crate::Failure;

const LONG_ABOUT: &str = "\
Runs the seed workloads on one device in one run and prints, for each, the
raw device (same backend and queue depth), iomapfs, and the kernel's XFS and
ext4 (through fio), as IOPS, bandwidth, mean and p99 latency, CPU time per
I/O, and ratios to the raw device (of IOPS and of CPU per I/O).

Buffered workloads (buffered-*) go through caches, where the raw device means
nothing: each of their variants (warm/cold reads; overwrite/alloc writes,
with and without fsync) is a row for iomapfs (a non-direct handle, default
cache) and for XFS and ext4 (fio psync, direct=0), in their own table with
ratios to XFS (×xfs, cpu ×xfs) and to a memcpy of the same bytes from a
file-sized buffer for reads, into it for writes (×memcpy, the memory-bandwidth ceiling); windows that include writeback (+fsync) are also
compared with the raw device's sequential 1 MiB direct writes.

fio rows (fio-*) run each direct workload as one fio job line (the kernel
threads' lines, scaled to 2 cores) against every target on the same device:
the raw device and XFS/ext4 files through fio's io_uring (psync for the DSYNC
row), iomapfs through the fio engine (fio-engine/, built by `make -C
fio-engine`). Their table has ×raw and ×xfs; the JSON holds every fio command
line. They need fio, and for the iomapfs target the built engine
(--fio-engine, $IOMAPFS_FIO_ENGINE, or fio-engine/build/libiomapfs_fio.so of
this source tree); what is missing is reported as not measured. --fio-only
runs only them.
Mount rows (mount-*, or all of them with --workload mount) run one fio job
through the FUSE mount of iomapfs (target iomapfs-fuse: a fresh volume mounted
by the bench itself with the handlers and defaults of `iomapfs mount`; target
iomapfs-fuse-uring: the same with -o uring, FUSE over io_uring, where the
kernel has it; iomapfs-fuse-uring-idle: with -o uring_idle) and on XFS made on
the same device: 4 KiB random direct reads at queue depth 1 (psync)
and 32 (io_uring), 1 MiB sequential direct reads and writes, 4 KiB random
buffered reads (cached file) and writes. Each row shows fio's CPU per I/O, the
daemon's, their sum and ratios to XFS; the JSON has the exact fio command lines
(layout, warm-up and measured runs). Needs root, /dev/fuse and fio.

With no --device: as root with zram and loop devices available, a RAM-backed
bed is set up (zram for 4 KiB direct workloads; a loop device over a tmpfs
file with 512-byte sectors and a volatile write cache for sub-block, DSYNC
and buffered workloads, whose speed, unlike zram's, does not depend on the
data written) and always torn down afterwards, also on Ctrl-C or error.
Without root: an image file in a temporary directory, iomapfs vs the raw
file, and kernel comparisons are skipped (the report says why).

An explicit --device is DESTROYED. It is refused if it holds a file system or
partition table (unless --force) or is mounted or in use.";

const EXAMPLES: &str = "\
Examples:
  iomapfs bench                                  # everything, default bed
  iomapfs bench --runtime 2 --workload randread-4k-qd1 --workload randread-4k-qd32
  iomapfs bench --runtime 3 --workload buffered-write-64k
  iomapfs bench --fio-only --runtime 5           # every target through fio
  iomapfs bench --workload fio-randread-4k-qd1 --fio-engine fio-engine/build/libiomapfs_fio.so
  iomapfs bench --runtime 3 --workload mount --json mount.json
  iomapfs bench --device /dev/nvme0n1p3 --json results.json --no-kernel";

/// The examples, then every workload and buffered variant with its summary
/// (from the bench engine, so the list never lags behind it).
fn after_help() -> String {
    let mut text = format!("{EXAMPLES}\n\nWorkloads (--workload NAME):\n");
    let workloads = iomapfs_bench::workloads();
    let width = workloads.iter().map(|w| w.0.len()).max().unwrap_or(0);
    for (name, summary) in workloads.iter().chain(&iomapfs_bench::workload_groups()) {
        text.push_str(&format!("  {name:<width$}  {summary}\n"));
    }
    text.push_str(
        "\nVariants of buffered workloads (the `variant` column and JSON field), each one\n\
         thread of sequential I/O in passes over a 64 MiB file:\n",
    );
    let variants = iomapfs_bench::buffered_variants();
    let width = variants.iter().map(|v| v.0.len()).max().unwrap_or(0);
    for (name, summary) in variants {
        text.push_str(&format!("  {name:<width$}  {summary}\n"));
    }
    text.push_str(
        "  and the baselines: ceiling (memcpy from a file-sized buffer, or into it for writes), seq-read (raw device, 2 MiB \
         direct reads at QD 2, reads only: the device's rate for cold reads), seq-write (raw device, 1 MiB direct writes, writes \
         only: the ceiling of writeback)",
    );
    text
}

#[derive(Args)]
#[command(about = "Benchmark iomapfs against the raw device and kernel XFS/ext4", long_about = LONG_ABOUT, after_help = after_help())]
pub struct BenchArgs {
    /// Device or image file to benchmark on (its contents are destroyed).
    /// Default: a RAM-backed bed set up and torn down by the run.
    #[arg(long, value_name = "PATH")]
    pub device: Option<PathBuf>,
    /// Seconds measured per workload and target (after a short warm-up).
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub runtime: f64,
    /// Run only this workload (repeatable; `mount` names every mount row).
    /// Default: all.
    #[arg(long = "workload", value_name = "NAME")]
    pub workloads: Vec<String>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Skip the kernel XFS/ext4 comparisons.
    #[arg(long)]
    pub no_kernel: bool,
    /// Format iomapfs targets with extent pages: the default, as for
    /// mkfs; kept for scripts that name it.
    #[arg(long, conflicts_with = "no_extent_pages")]
    pub extent_pages: bool,
    /// Format iomapfs targets without extent pages (each base checkpoint
    /// writes the whole extent image), to compare with the default.
    #[arg(long)]
    pub no_extent_pages: bool,
    /// Format iomapfs targets with extent pages listed in index pages:
    /// the default, as for mkfs; kept for scripts that name it.
    #[arg(long, conflicts_with_all = ["no_extent_pages", "no_page_index"])]
    pub page_index: bool,
    /// Format iomapfs targets with every extent page listed in each
    /// checkpoint root (as `mkfs --no-page-index`), to compare with the
    /// default.
    #[arg(long)]
    pub no_page_index: bool,
    /// Format --device even if it holds a file system or partition table.
    #[arg(long)]
    pub force: bool,
    /// Run only the fio rows (fio-* workloads): all, or those --workload names.
    #[arg(long)]
    pub fio_only: bool,
    /// The fio engine for the fio rows' iomapfs target (default:
    /// $IOMAPFS_FIO_ENGINE, else fio-engine/build/libiomapfs_fio.so of this
    /// source tree).
    #[arg(long, value_name = "PATH")]
    pub fio_engine: Option<PathBuf>,
    /// Mount options of the mount rows, as for `iomapfs mount -o` (e.g.
    /// threads=8,kernel_cache).
    #[arg(long, value_name = "OPTIONS", value_delimiter = ',')]
    pub fuse_options: Vec<String>,
    /// Record the iomapfs target's device requests (format, file, measured
    /// I/O, unmount) to LOG for `iomapfs replay`. Needs exactly one
    /// direct-I/O --workload; the recording slows that target.
    #[arg(long, value_name = "LOG")]
    pub record: Option<PathBuf>,
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn set_length(&self, steps: u64) {
        self.0.set_length(steps);
    }
    fn set_message(&self, message: &str) {
        self.0.set_message(message.to_string());
    }
    fn inc(&self, steps: u64) {
        self.0.inc(steps);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

pub fn run(args: &BenchArgs, backend: blockdev::Backend) -> Result<(), Failure> {
    if !(args.runtime.is_finite() && args.runtime > 0.0 && args.runtime <= 3600.0) {
        return Err(Failure::new(
            2,
            format!(
                "bench: --runtime {} must be between 0 and 3600 seconds",
                args.runtime
            ),
        ));
    }
    let known: Vec<&str> = iomapfs_bench::workloads()
        .iter()
        .chain(&iomapfs_bench::workload_groups())
        .map(|w| w.0)
        .collect();
    for w in &args.workloads {
        if !known.contains(&w.as_str()) {
            return Err(Failure::new(
                2,
                format!("bench: unknown workload {w:?}; known: {}", known.join(", ")),
            ));
        }
        if args.fio_only && !iomapfs_bench::is_fio_row(w) {
            return Err(Failure::new(
                2,
                format!("bench: --fio-only runs fio rows only, and {w:?} is not one (fio-*)"),
            ));
        }
    }
    let mut fuse = iomapfs_mount::MountConfig::default();
    for opt in &args.fuse_options {
        fuse.apply_option(opt)
            .map_err(|why| Failure::new(2, format!("bench: --fuse-options: {why}")))?;
    }
    if fuse.uring {
        return Err(Failure::new(
            2,
            "bench: --fuse-options uring, uring_idle: the mount rows measure every transport \
             already (targets iomapfs-fuse over /dev/fuse, iomapfs-fuse-uring over io_uring, \
             iomapfs-fuse-uring-idle with -o uring_idle)",
        ));
    }
    let opts = BenchOptions {
        device: args.device.clone(),
        runtime: Duration::from_secs_f64(args.runtime),
        workloads: args.workloads.clone(),
        json: args.json.clone(),
        no_kernel: args.no_kernel,
        force: args.force,
        backend,
        fuse,
        mount: crate::target::mount_options()
            .map_err(|f| Failure::new(f.code, format!("bench: {}", f.message)))?,
        fio_only: args.fio_only,
        fio_engine: args.fio_engine.clone(),
        record: args.record.clone(),
        extent_pages: !args.no_extent_pages,
        page_index: !args.no_extent_pages && !args.no_page_index,
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let progress = Bar(bar);
    let result = iomapfs_bench::run(&opts, &progress);
    progress.finish();
    let report = result.map_err(|e| Failure::new(1, format!("bench: {e}")))?;
    print!("{}", iomapfs_bench::render_table(&report));
    if let Some(path) = &args.json {
        println!("results written to {}", path.display());
    }
    Ok(())
}
