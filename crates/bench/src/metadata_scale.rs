//! The `metadata-scale` workloads: how checkpoints and mount behave as the
//! metadata of one file grows (issue 13).
//!
//! For each extent count N, a fresh volume on a sparse image file in RAM
//! (tmpfs, so device time stays small next to the metadata's) gets one file
//! with N extents: every other 4 KiB block is written, so no two extents
//! are contiguous in the file and none merge. Then, measured:
//! - checkpoint time: [`CHECKPOINTS_TIMED`] checkpoints back to back, and
//!   the median of `ONE_PERCENT_ROUNDS` after 1% of the extents changed
//!   (a new one-block extent placed in the hole after every hundredth;
//!   undone after each), issue 13's measure of a checkpoint whose cost
//!   should follow what changed;
//! - 4 KiB direct reads of random written blocks from one thread, for the
//!   runtime, once with nothing else running ("quiet") and once while the
//!   main thread runs checkpoints back to back ("checkpointing"): p99 and
//!   worst latency of each. A checkpoint that holds the metadata lock
//!   across its encoding and write shows as a worst read as long as the
//!   checkpoint;
//! - beside the reader in both windows, one writer thread alternating 4 KiB
//!   direct overwrites of random written blocks and allocating writes into
//!   random holes of the same file (each a new extent, so the first one
//!   after a checkpoint's snapshot pays for copying what the snapshot
//!   shares): p99 and worst latency of those writes. The holes filled are
//!   punched again after the window, so the file keeps its N extents;
//! - mount time after a clean unmount, then the first 4 KiB direct read
//!   after it (open included: with extent pages, mount keeps no page in
//!   memory and that read loads the one it needs, so mount alone would
//!   hide the work it moved), the process's resident set right after that
//!   read, and the time of the first two commits after it (one file
//!   created each): the first also clears the superblock's clean-unmount
//!   mark;
//! - the process's max RSS (`ru_maxrss`) after the size is done. It is a
//!   high-water mark of the whole run, so sizes run smallest first.
//!
//! `metadata-scale-10m` and `-50m` build their extents with `fallocate`
//! (unwritten extents, one per other block) instead of writes: 40 GiB of
//! written data would not fit a RAM-backed image on most machines. Their
//! reads land on unwritten blocks, which read as zeros without device I/O.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{AlignedBuf, BlockDevice};
use iomapfs_fs::{FiemapKind, OpenFlags, Volume};
use serde::{Deserialize, Serialize};

use crate::histogram::Histogram;
use crate::interrupt::stop_requested;
use crate::target::{alignment_of, format_and_mount, mount, open_device};
use crate::workload::Rng;
use crate::{Backend, BenchError, Progress};

/// Size of every block written and read.
const BLOCK: u64 = 4096;
/// Checkpoints whose time is reported (the median and the longest).
const CHECKPOINTS_TIMED: usize = 5;
/// Checkpoints a checkpointing window runs at least, however short the
/// runtime.
const MIN_CHECKPOINTS_DURING_READS: usize = 3;
/// The file the extents are built in.
const FILE: &str = "/extents.dat";

/// How the extents of a size are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// 4 KiB direct writes to every other block.
    Write,
    /// `fallocate` of every other block (unwritten extents, no data I/O).
    Fallocate,
}

/// One `metadata-scale` workload: the extent counts it measures, in order.
struct Spec {
    name: &'static str,
    summary: &'static str,
    sizes: &'static [(u64, Build)],
}

const SPECS: &[Spec] = &[
    Spec {
        name: "metadata-scale",
        summary: "one file with 100k then 1M extents (every other 4 KiB block written): \
                  checkpoint and mount time, max RSS, p99/worst 4 KiB read with and without \
                  checkpoints running (not in the default set)",
        sizes: &[(100_000, Build::Write), (1_000_000, Build::Write)],
    },
    Spec {
        name: "metadata-scale-10m",
        summary: "metadata-scale at 10M extents, built with fallocate (unwritten extents; \
                  not in the default set)",
        sizes: &[(10_000_000, Build::Fallocate)],
    },
    Spec {
        name: "metadata-scale-50m",
        summary: "metadata-scale at 50M extents, built with fallocate: memory beyond 10M \
                  (a sparse 800 GiB image in RAM, several minutes; not in the default set)",
        sizes: &[(50_000_000, Build::Fallocate)],
    },
];

/// Names and summaries, for `--help`.
pub fn workloads() -> impl Iterator<Item = (&'static str, &'static str)> {
    SPECS.iter().map(|s| (s.name, s.summary))
}

/// Whether `name` is one of these workloads.
pub fn is_metadata_workload(name: &str) -> bool {
    SPECS.iter().any(|s| s.name == name)
}

/// What one extent count measured. Times in nanoseconds.
/// Fields missing from older reports read as 0.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MetadataScaleResult {
    pub workload: String,
    pub extents: u64,
    /// "write" or "fallocate".
    pub build: String,
    pub build_ns: u64,
    pub checkpoint_median_ns: u64,
    pub checkpoint_max_ns: u64,
    /// The median of `ONE_PERCENT_ROUNDS` checkpoints, each after 1% of
    /// the extents changed.
    pub checkpoint_1pct_changed_ns: u64,
    /// Until `Volume::open` returns. Since free space is rebuilt in the
    /// background, this no longer includes that scan: see
    /// `free_space_ready_ns`.
    pub mount_ns: u64,
    /// The first 4 KiB direct read after that mount, the file's open
    /// included (a block in the middle of the file).
    pub first_read_ns: u64,
    /// The process's resident set (`VmRSS`) right after that read, in
    /// bytes: unlike `max_rss_bytes`, not a high-water mark of the build.
    pub rss_after_mount_bytes: u64,
    /// Extent chunks in memory right after that mount (before the read),
    /// and all chunks (`Volume::extent_page_loads`; 0 and 0 without extent
    /// pages): mount loads only the chunks its delta chain reaches.
    pub mount_chunks_loaded: u64,
    pub mount_chunks: u64,
    /// The same four after checkpoints until one was a base (a file
    /// created before each), unmount and mount: a chain that reaches no
    /// chunk of the large file, so mount leaves all of them on disk.
    pub base_mount_ns: u64,
    pub base_first_read_ns: u64,
    pub base_rss_after_mount_bytes: u64,
    pub base_mount_chunks_loaded: u64,
    /// After that mount and first read: one 4 KiB direct read in every
    /// chunk of the large file (every 64th extent), timed; then, once the
    /// evictor is idle, the resident set, the bytes of clean extent chunks
    /// in memory (`PageLoads::cached_bytes`), the memory of the maps'
    /// shells (`PageLoads::shell_bytes`: with the clean chunks, bounded by
    /// the mount's `metadata_cache_bytes`, 64 MiB by default) and the
    /// chunks in memory.
    pub all_chunks_read_ns: u64,
    pub all_chunks_rss_bytes: u64,
    pub all_chunks_cached_bytes: u64,
    pub all_chunks_shell_bytes: u64,
    pub all_chunks_loaded: u64,
    /// From the start of the mount until free space is ready
    /// (`Volume::wait_free_space` returns): what mount cost before the
    /// scan moved to the background.
    pub free_space_ready_ns: u64,
    /// The first allocating write after the mount returns (4 KiB direct,
    /// into a hole; punched again after): it waits for the scan.
    pub first_allocating_write_ns: u64,
    /// The first commit after that mount (a file created, then
    /// `sync_metadata`): it clears the clean-unmount mark first.
    pub first_commit_ns: u64,
    /// The commit after it, the same way.
    pub second_commit_ns: u64,
    /// `ru_maxrss` of the process after this size, in bytes.
    pub max_rss_bytes: u64,
    /// The allocator's own heap bytes (`Volume::allocator_memory_bytes`,
    /// an estimate) right after the mount returns (the clean unmount's
    /// reserve, while the scan runs) and once free space is ready.
    pub alloc_bytes_at_mount: u64,
    pub alloc_bytes_free_ready: u64,
    /// Free ranges once free space is ready, and what a tree of them
    /// (the allocator before the bitmap: two B-trees of 16-byte entries)
    /// would take by the same estimate.
    pub free_ranges: u64,
    pub free_range_tree_bytes: u64,
    /// Peak resident set (`VmHWM`) of a fresh process that mounts the
    /// final image and waits for free space (`iomapfs io IMAGE`, command
    /// `statfs`): the memory of a mount and its scan, with nothing of the
    /// build in it. The binary is this one, or `$IOMAPFS_BENCH_MOUNT_BIN`
    /// (another build, for a before/after on the same image).
    pub child_mount_max_rss_bytes: u64,
    /// The same process's peak once it also read one 4 KiB block in every
    /// chunk of the file (direct), and once it then changed 1% of the
    /// extents as `ckpt 1%` does (no checkpoint asked for): what reading
    /// and changing a map costs in memory under the default 64 MiB
    /// metadata budget, with nothing of the build in it.
    #[serde(default)]
    pub child_read_all_max_rss_bytes: u64,
    #[serde(default)]
    pub child_one_percent_max_rss_bytes: u64,
    pub quiet_reads: u64,
    pub quiet_read_p99_ns: u64,
    pub quiet_read_p999_ns: u64,
    pub quiet_read_max_ns: u64,
    pub checkpointing_reads: u64,
    pub checkpointing_read_p99_ns: u64,
    pub checkpointing_read_p999_ns: u64,
    pub checkpointing_read_max_ns: u64,
    /// Writes (overwrites and allocating writes) beside the quiet reads.
    pub quiet_writes: u64,
    pub quiet_write_p99_ns: u64,
    pub quiet_write_max_ns: u64,
    /// Writes beside the reads while checkpoints run.
    pub checkpointing_writes: u64,
    pub checkpointing_write_p99_ns: u64,
    pub checkpointing_write_max_ns: u64,
    /// Checkpoints completed during the checkpointing window.
    pub checkpoints_during_reads: u64,
    /// Worst lateness of a thread that only sleeps 1 ms at a time, beside
    /// the reader and writer, in each window: how long a runnable thread
    /// that holds no lock was kept off a CPU, by the scheduler, other
    /// processes, a hypervisor, and the bench's own threads (reader,
    /// writer, the checkpoint loop and this one crowd the CPUs too). Not
    /// matched in time with the worst read: a bound on what the machine
    /// adds to any latency here, not the cause of a given one.
    pub quiet_wakeup_late_max_ns: u64,
    pub checkpointing_wakeup_late_max_ns: u64,
    /// The longest one of a thread per CPU that only read the clock, with
    /// nothing else of the bench running, went between two reads during
    /// `CPU_GAP_WINDOW` right before the quiet window: time the machine
    /// itself (interrupts, kernel threads, other processes, a hypervisor
    /// taking the vCPU) takes from a running thread when every CPU is
    /// busy, as in the windows. No worst latency measured here can be
    /// promised below it.
    pub cpu_gap_max_ns: u64,
    /// The longest time a checkpoint held the metadata lock exclusive in
    /// the checkpointing window (what any read or write could wait for
    /// behind it; see `Volume::take_longest_lock_holds`), and the
    /// evictor of extent chunks likewise.
    #[serde(default)]
    pub checkpointing_lock_hold_max_ns: u64,
    #[serde(default)]
    pub checkpointing_eviction_hold_max_ns: u64,
    /// `checkpointing_read_max_ns / quiet_read_p99_ns` (issue 13's goal: ≤ 2).
    pub worst_over_quiet_p99: f64,
    pub device: String,
    pub backend: String,
}

/// Runs the named metadata workloads, smallest first, on image files in
/// `dir` (removed again). `runtime` is each read window's length.
pub fn run(
    names: &[String],
    dir: &Path,
    backend: Backend,
    runtime: Duration,
    progress: &dyn Progress,
) -> Result<Vec<MetadataScaleResult>, BenchError> {
    let mut results = Vec::new();
    for spec in SPECS.iter().filter(|s| names.iter().any(|n| n == s.name)) {
        for &(extents, build) in spec.sizes {
            let path = dir.join(format!("{}-{extents}.img", spec.name));
            let say = |what: &str| {
                progress.set_message(&format!("{} · {extents} extents: {what}", spec.name))
            };
            let result = run_size(&path, extents, build, backend, runtime, &say);
            let removed = std::fs::remove_file(&path);
            let mut r = result?;
            removed.map_err(|e| BenchError::io(format!("remove {}", path.display()), e))?;
            r.workload = spec.name.into();
            results.push(r);
            progress.inc(1);
        }
    }
    Ok(results)
}

/// Steps (sizes) the named workloads take, for the progress bar.
pub fn steps(names: &[String]) -> u64 {
    SPECS
        .iter()
        .filter(|s| names.iter().any(|n| n == s.name))
        .map(|s| s.sizes.len() as u64)
        .sum()
}

/// A device twice the span the file covers plus room for the metadata
/// regions: sparse, so only what is written takes memory.
fn device_bytes(extents: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    (extents * 2 * BLOCK * 2 + 2 * GIB).next_multiple_of(GIB)
}

fn run_size(
    path: &Path,
    extents: u64,
    build: Build,
    backend: Backend,
    runtime: Duration,
    say: &dyn Fn(&str),
) -> Result<MetadataScaleResult, BenchError> {
    let image = std::fs::File::create(path)
        .map_err(|e| BenchError::io(format!("create {}", path.display()), e))?;
    image
        .set_len(device_bytes(extents))
        .map_err(|e| BenchError::io(format!("size {}", path.display()), e))?;
    drop(image);
    let (dev, choice) = open_device(path, backend)?;
    let vol = format_and_mount(dev.clone())?;

    say("building the extents");
    let started = Instant::now();
    build_extents(&vol, &dev, extents, build)?;
    let build_ns = started.elapsed().as_nanos() as u64;

    say("timing checkpoints");
    let mut times = Vec::with_capacity(CHECKPOINTS_TIMED);
    for _ in 0..CHECKPOINTS_TIMED {
        times.push(timed_checkpoint(&vol)?);
    }
    times.sort_unstable();
    say("checkpoint after 1% changed");
    let mut one_percent = (0..ONE_PERCENT_ROUNDS)
        .map(|_| checkpoint_after_one_percent(&vol, &dev, extents, build))
        .collect::<Result<Vec<u64>, BenchError>>()?;
    one_percent.sort_unstable();
    let checkpoint_1pct_changed_ns = one_percent[one_percent.len() / 2];

    say("the machine's own gaps");
    let cpu_gap_max_ns = longest_clock_gap_on_every_cpu().as_nanos() as u64;
    say("reads and writes, quiet");
    let quiet = io_while(&vol, &dev, extents, runtime, false)?;
    say("reads and writes, checkpoints running");
    vol.take_longest_lock_holds();
    let busy = io_while(&vol, &dev, extents, runtime, true)?;
    let busy_holds = vol.take_longest_lock_holds();
    let checkpoints = busy.checkpoints;
    let (quiet_late, busy_late) = (quiet.wakeup_late_max_ns, busy.wakeup_late_max_ns);
    let (quiet, quiet_writes) = (quiet.reads, quiet.writes);
    let (busy, busy_writes) = (busy.reads, busy.writes);

    say("unmount and mount");
    vol.unmount()
        .map_err(|e| BenchError::fs("iomapfs unmount", e))?;
    let started = Instant::now();
    let vol = mount(dev.clone())?;
    let mount_ns = started.elapsed().as_nanos() as u64;
    let alloc_bytes_at_mount = vol.allocator_memory().map_or(0, |(bytes, _)| bytes);
    let (mount_chunks_loaded, mount_chunks) = vol
        .extent_page_loads()
        .map_or((0, 0), |l| (l.chunks_loaded, l.chunks));
    let first_read_ns = timed_first_read(&vol, &dev, extents)?;
    let rss_after_mount_bytes = rss_bytes();
    let first_allocating_write_ns = timed_allocating_write(&vol, &dev)?;
    vol.wait_free_space()
        .map_err(|e| BenchError::fs("iomapfs free space after mount", e))?;
    let free_space_ready_ns = started.elapsed().as_nanos() as u64;
    let (alloc_bytes_free_ready, free_ranges) = vol.allocator_memory().unwrap_or((0, 0));
    let free_range_tree_bytes =
        2 * iomapfs_fs::alloc::bitmap::btree_heap_bytes(free_ranges as usize, 16) as u64;
    check_extents(&vol, extents)?;
    say("first commits after the mount");
    let first_commit_ns = timed_create_commit(&vol, "/first-commit")?;
    let second_commit_ns = timed_create_commit(&vol, "/second-commit")?;
    say("checkpoints until a base, unmount and mount");
    // A chain holds at most MAX_CHAIN_DELTAS deltas: one of these is a
    // base, and the deltas after it change no chunk of the large file.
    for i in 0..=iomapfs_fs::limits::MAX_CHAIN_DELTAS {
        let create = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        vol.open_file(&format!("/base-{i}"), create)
            .map_err(|e| BenchError::fs("iomapfs create", e))?;
        vol.checkpoint()
            .map_err(|e| BenchError::fs("iomapfs checkpoint", e))?;
    }
    vol.unmount()
        .map_err(|e| BenchError::fs("iomapfs unmount", e))?;
    let started = Instant::now();
    let vol = mount(dev.clone())?;
    let base_mount_ns = started.elapsed().as_nanos() as u64;
    let base_mount_chunks_loaded = vol.extent_page_loads().map_or(0, |l| l.chunks_loaded);
    let base_first_read_ns = timed_first_read(&vol, &dev, extents)?;
    let base_rss_after_mount_bytes = rss_bytes();
    say("reading every chunk");
    let all_chunks_read_ns = timed_read_every_chunk(&vol, &dev, extents)?;
    vol.wait_extent_eviction();
    let all_chunks_rss_bytes = rss_bytes();
    let (all_chunks_cached_bytes, all_chunks_shell_bytes, all_chunks_loaded) =
        vol.extent_page_loads().map_or((0, 0, 0), |l| {
            (l.cached_bytes, l.shell_bytes, l.chunks_loaded)
        });
    vol.unmount()
        .map_err(|e| BenchError::fs("iomapfs unmount", e))?;
    say("mount, read every chunk and change 1% in a fresh process");
    let child_rss = child_session_max_rss(path, extents, build)?;

    let quiet_p99 = quiet.quantile(0.99);
    let busy_max = busy.max().unwrap_or(0);
    Ok(MetadataScaleResult {
        workload: String::new(),
        extents,
        build: match build {
            Build::Write => "write",
            Build::Fallocate => "fallocate",
        }
        .into(),
        build_ns,
        checkpoint_median_ns: times[times.len() / 2],
        checkpoint_max_ns: *times.last().expect("timed at least one"),
        checkpoint_1pct_changed_ns,
        mount_ns,
        first_read_ns,
        rss_after_mount_bytes,
        mount_chunks_loaded,
        mount_chunks,
        base_mount_ns,
        base_first_read_ns,
        base_rss_after_mount_bytes,
        base_mount_chunks_loaded,
        all_chunks_read_ns,
        all_chunks_rss_bytes,
        all_chunks_cached_bytes,
        all_chunks_shell_bytes,
        all_chunks_loaded,
        free_space_ready_ns,
        first_allocating_write_ns,
        first_commit_ns,
        second_commit_ns,
        max_rss_bytes: max_rss_bytes(),
        alloc_bytes_at_mount,
        alloc_bytes_free_ready,
        free_ranges,
        free_range_tree_bytes,
        child_mount_max_rss_bytes: child_rss.mount,
        child_read_all_max_rss_bytes: child_rss.read_all,
        child_one_percent_max_rss_bytes: child_rss.one_percent,
        quiet_reads: quiet.count(),
        quiet_read_p99_ns: quiet_p99,
        quiet_read_p999_ns: quiet.quantile(0.999),
        quiet_read_max_ns: quiet.max().unwrap_or(0),
        checkpointing_reads: busy.count(),
        checkpointing_read_p99_ns: busy.quantile(0.99),
        checkpointing_read_p999_ns: busy.quantile(0.999),
        checkpointing_read_max_ns: busy_max,
        quiet_writes: quiet_writes.count(),
        quiet_write_p99_ns: quiet_writes.quantile(0.99),
        quiet_write_max_ns: quiet_writes.max().unwrap_or(0),
        checkpointing_writes: busy_writes.count(),
        checkpointing_write_p99_ns: busy_writes.quantile(0.99),
        checkpointing_write_max_ns: busy_writes.max().unwrap_or(0),
        checkpoints_during_reads: checkpoints,
        quiet_wakeup_late_max_ns: quiet_late,
        checkpointing_wakeup_late_max_ns: busy_late,
        cpu_gap_max_ns,
        checkpointing_lock_hold_max_ns: busy_holds.checkpoint_ns(),
        checkpointing_eviction_hold_max_ns: busy_holds.eviction_step_ns,
        worst_over_quiet_p99: busy_max as f64 / quiet_p99.max(1) as f64,
        device: format!(
            "{} (sparse image file, {} bytes)",
            path.display(),
            dev.caps().size_bytes
        ),
        backend: choice.backend.as_str().into(),
    })
}

fn direct_flags() -> OpenFlags {
    OpenFlags {
        direct: true,
        ..OpenFlags::default()
    }
}

/// Makes `extents` one-block extents at every other block of [`FILE`],
/// then commits and checkpoints.
fn build_extents(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: u64,
    build: Build,
) -> Result<(), BenchError> {
    let file = vol
        .open_file(
            FILE,
            OpenFlags {
                create: true,
                ..direct_flags()
            },
        )
        .map_err(|e| BenchError::fs("iomapfs create", e))?;
    let mut buf = AlignedBuf::new(BLOCK as usize, alignment_of(&**dev))
        .map_err(|e| BenchError::setup("write buffer", e.to_string()))?;
    let mut rng = Rng::new(extents);
    for i in 0..extents {
        if i % 4096 == 0 && stop_requested() {
            return Err(BenchError::Interrupted);
        }
        let offset = i * 2 * BLOCK;
        match build {
            Build::Write => {
                rng.fill(&mut buf[..8]);
                file.pwrite(&buf, offset)
                    .map(drop)
                    .map_err(|e| BenchError::fs("iomapfs build write", e))?;
            }
            Build::Fallocate => file
                .fallocate(offset, BLOCK, false)
                .map_err(|e| BenchError::fs("iomapfs build fallocate", e))?,
        }
    }
    file.fsync()
        .map_err(|e| BenchError::fs("iomapfs build fsync", e))?;
    vol.checkpoint()
        .map_err(|e| BenchError::fs("iomapfs checkpoint", e))?;
    check_extents(vol, extents)
}

/// Opens the file and reads one 4 KiB block in the middle of it, direct:
/// the time from the call to the data.
fn timed_first_read(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: u64,
) -> Result<u64, BenchError> {
    timed_reads(vol, dev, std::iter::once(extents / 2))
}

/// One 4 KiB direct read every 64th extent of the large file: at least
/// one in each of its chunks (a chunk holds 128 to 512 extents unless
/// alone).
fn timed_read_every_chunk(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: u64,
) -> Result<u64, BenchError> {
    timed_reads(vol, dev, (0..extents).step_by(64))
}

/// Opens [`FILE`] and reads the 4 KiB block of each extent `k` in
/// `extents` (at `2 k` blocks), direct: the time from the open to the
/// last read's data.
fn timed_reads(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: impl Iterator<Item = u64>,
) -> Result<u64, BenchError> {
    let mut buf = AlignedBuf::new(BLOCK as usize, alignment_of(&**dev))
        .map_err(|e| BenchError::setup("read buffer", e.to_string()))?;
    let started = Instant::now();
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    for k in extents {
        file.pread(&mut buf, k * 2 * BLOCK)
            .map_err(|e| BenchError::fs("iomapfs read", e))?;
    }
    Ok(started.elapsed().as_nanos() as u64)
}

/// Peak resident sets (`VmHWM`) of one fresh process, after each step of
/// its session (see [`child_session_max_rss`]), in bytes.
struct ChildRss {
    mount: u64,
    read_all: u64,
    one_percent: u64,
}

/// Runs a fresh `iomapfs io IMAGE` ([`mount_binary`]) through three steps
/// and takes its peak resident set (`VmHWM`) after each: the mount and its
/// free-space scan (`statfs` waits for it); one 4 KiB direct read in every
/// chunk of [`FILE`], as `read all` in this process; then 1% of the extents
/// changed as `ckpt 1%` changes them (a block in the hole after every
/// hundredth extent, written or allocated like the build), without a
/// checkpoint asked for. Read from `/proc` while the process waits for its
/// next command after a `statfs` that marks the step's end: `ru_maxrss`
/// would not do, Linux carries the forking process's high-water mark into
/// the child across exec.
fn child_session_max_rss(image: &Path, extents: u64, build: Build) -> Result<ChildRss, BenchError> {
    use std::io::{BufRead, Write};
    let bin = mount_binary()?;
    let what = format!("{} io {}", bin.display(), image.display());
    let read_all: String = std::iter::once(format!("open -d {FILE}\n"))
        .chain(
            (0..extents)
                .step_by(64)
                .map(|k| format!("pread -q {} 4k\n", k * 2 * BLOCK)),
        )
        .chain(std::iter::once("statfs\n".to_string()))
        .collect();
    let one_percent: String = (0..extents)
        .step_by(100)
        .map(|i| {
            let offset = (i * 2 + 1) * BLOCK;
            match build {
                Build::Write => format!("pwrite -q {offset} 4k\n"),
                Build::Fallocate => format!("falloc {offset} 4k\n"),
            }
        })
        .chain(std::iter::once("statfs\n".to_string()))
        .collect();
    let mut child = std::process::Command::new(&bin)
        .arg("io")
        .arg(image)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| BenchError::io(format!("run {what}"), e))?;
    let child_id = child.id();
    let peak = || -> Result<u64, BenchError> {
        let status = std::fs::read_to_string(format!("/proc/{child_id}/status"))
            .map_err(|e| BenchError::io(format!("read the status of {what}"), e))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .ok_or_else(|| BenchError::failed("metadata-scale", format!("{what}: no VmHWM")))
    };
    // Read beside the session: a failing command per line could fill the
    // pipe and stop the child.
    let stderr = child.stderr.take().expect("piped");
    let first_error = std::thread::spawn(move || {
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .next()
    });
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    // Each step's commands are written while its output is read, so that
    // neither side waits for the other's pipe.
    let measured = std::thread::scope(|scope| {
        let (step_tx, step_rx) = std::sync::mpsc::channel::<()>();
        let writer = scope.spawn(move || -> std::io::Result<()> {
            for step in ["statfs\n", &read_all, &one_percent] {
                stdin.write_all(step.as_bytes())?;
                stdin.flush()?;
                if step_rx.recv().is_err() {
                    break;
                }
            }
            Ok(())
        });
        let mut peaks = Vec::with_capacity(3);
        let result = (|| {
            for _ in 0..3 {
                let mut answered = false;
                for line in stdout.by_ref() {
                    let line = line.map_err(|e| BenchError::io(format!("read from {what}"), e))?;
                    if line.starts_with("statfs.inodes") {
                        answered = true;
                        break;
                    }
                }
                if !answered {
                    return Err(BenchError::failed(
                        "metadata-scale",
                        format!("{what}: a step ended without its statfs answer"),
                    ));
                }
                peaks.push(peak()?);
                let _ = step_tx.send(());
            }
            Ok(())
        })();
        // Dropping the sender ends the writer, which closes stdin: the
        // session ends (a clean unmount).
        drop(step_tx);
        let written = writer.join().expect("the writer does not panic");
        result?;
        written.map_err(|e| BenchError::io(format!("write to {what}"), e))?;
        Ok::<_, BenchError>(peaks)
    });
    // What it still prints is read to the end, or it would die of SIGPIPE
    // writing it.
    for line in stdout {
        line.map_err(|e| BenchError::io(format!("read from {what}"), e))?;
    }
    let exited = child
        .wait()
        .map_err(|e| BenchError::io(format!("wait for {what}"), e))?;
    let first_error = first_error.join().ok().flatten();
    let peaks = measured?;
    if !exited.success() {
        let first = first_error.as_deref().unwrap_or("no message");
        return Err(BenchError::failed(
            "metadata-scale",
            format!("{what}: {exited}: {first}"),
        ));
    }
    Ok(ChildRss {
        mount: peaks[0],
        read_all: peaks[1],
        one_percent: peaks[2],
    })
}

/// The binary the fresh-process mount runs: `$IOMAPFS_BENCH_MOUNT_BIN`
/// if set, else this one.
fn mount_binary() -> Result<PathBuf, BenchError> {
    match std::env::var_os("IOMAPFS_BENCH_MOUNT_BIN") {
        Some(bin) => Ok(PathBuf::from(bin)),
        None => std::env::current_exe()
            .map_err(|e| BenchError::io("locate the bench binary".to_string(), e)),
    }
}

/// The process's resident set now (`/proc/self/statm`), 0 if unknown.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).unwrap_or(4096)
}

/// Fails unless [`FILE`] has exactly `extents` extents (none merged).
fn check_extents(vol: &Volume, extents: u64) -> Result<(), BenchError> {
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    // In parts: the whole map of a 50M-extent file is 100M ranges (3 GiB),
    // which would pass for the metadata's memory in max RSS.
    let mut mapped = 0u64;
    for part in file.fiemap_parts(1 << 16) {
        let part = part.map_err(|e| BenchError::fs("iomapfs fiemap", e))?;
        mapped += part.iter().filter(|e| e.kind != FiemapKind::Hole).count() as u64;
    }
    if mapped != extents {
        return Err(BenchError::failed(
            "metadata-scale",
            format!("{FILE} has {mapped} extents, not {extents}"),
        ));
    }
    Ok(())
}

/// Rounds of [`checkpoint_after_one_percent`]; their median is reported,
/// because one checkpoint of a few milliseconds on a shared machine is often
/// one preemption longer than its cost.
pub const ONE_PERCENT_ROUNDS: usize = 5;

fn timed_checkpoint(vol: &Volume) -> Result<u64, BenchError> {
    let started = Instant::now();
    vol.checkpoint()
        .map_err(|e| BenchError::fs("iomapfs checkpoint", e))?;
    Ok(started.elapsed().as_nanos() as u64)
}

/// Creates `path` and times the commit that makes it durable.
/// One allocating write (4 KiB direct into the hole after the first
/// extent), timed; punched again after, so the file keeps its extents.
fn timed_allocating_write(vol: &Volume, dev: &Arc<dyn BlockDevice>) -> Result<u64, BenchError> {
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    let buf = AlignedBuf::new(BLOCK as usize, alignment_of(&**dev))
        .map_err(|e| BenchError::setup("write buffer", e.to_string()))?;
    let started = Instant::now();
    file.pwrite(&buf, BLOCK)
        .map_err(|e| BenchError::fs("iomapfs allocating write after mount", e))?;
    let ns = started.elapsed().as_nanos() as u64;
    file.punch_hole(BLOCK, BLOCK)
        .map_err(|e| BenchError::fs("iomapfs punch", e))?;
    Ok(ns)
}

fn timed_create_commit(vol: &Volume, path: &str) -> Result<u64, BenchError> {
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    vol.open_file(path, create)
        .map_err(|e| BenchError::fs(format!("iomapfs create {path}"), e))?;
    let started = Instant::now();
    vol.sync_metadata()
        .map_err(|e| BenchError::fs("iomapfs commit", e))?;
    Ok(started.elapsed().as_nanos() as u64)
}

/// What one window of [`io_while`] measured.
struct Window {
    reads: Histogram,
    writes: Histogram,
    checkpoints: u64,
    /// See [`MetadataScaleResult::quiet_wakeup_late_max_ns`].
    wakeup_late_max_ns: u64,
}

/// Places a one-block extent in the hole after every hundredth extent (as
/// the build made them: written or unwritten), times one checkpoint, then
/// punches them again and checkpoints untimed, so the file keeps its
/// extents. Returns the timed checkpoint's nanoseconds.
fn checkpoint_after_one_percent(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: u64,
    build: Build,
) -> Result<u64, BenchError> {
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    let buf = AlignedBuf::new(BLOCK as usize, alignment_of(&**dev))
        .map_err(|e| BenchError::setup("write buffer", e.to_string()))?;
    let holes: Vec<u64> = (0..extents)
        .step_by(100)
        .map(|i| (i * 2 + 1) * BLOCK)
        .collect();
    for &offset in &holes {
        match build {
            Build::Write => file
                .pwrite(&buf, offset)
                .map(drop)
                .map_err(|e| BenchError::fs("iomapfs write into a hole", e))?,
            Build::Fallocate => file
                .fallocate(offset, BLOCK, false)
                .map_err(|e| BenchError::fs("iomapfs fallocate a hole", e))?,
        }
    }
    let ns = timed_checkpoint(vol)?;
    for &offset in &holes {
        file.punch_hole(offset, BLOCK)
            .map_err(|e| BenchError::fs("iomapfs punch", e))?;
    }
    vol.checkpoint()
        .map_err(|e| BenchError::fs("iomapfs checkpoint", e))?;
    Ok(ns)
}

/// 4 KiB direct reads of random extents from one thread and writes from
/// another (see [`writer`]) for `runtime`; with `checkpointing`, this thread
/// runs checkpoints back to back meanwhile (at least
/// [`MIN_CHECKPOINTS_DURING_READS`], the window stretching to cover them).
/// The holes the writer filled are punched again before it returns.
fn io_while(
    vol: &Volume,
    dev: &Arc<dyn BlockDevice>,
    extents: u64,
    runtime: Duration,
    checkpointing: bool,
) -> Result<Window, BenchError> {
    let done = AtomicBool::new(false);
    let align = alignment_of(&**dev);
    let (reads, written, checkpoints, late) = std::thread::scope(|s| {
        let reader = s.spawn(|| reader(vol, align, extents, &done));
        let writer = s.spawn(|| writer(vol, align, extents, &done));
        let wakeups = s.spawn(|| wakeup_lateness(&done));
        let started = Instant::now();
        let mut checkpoints = 0u64;
        let mut outcome = Ok(());
        while started.elapsed() < runtime
            || (checkpointing && checkpoints < MIN_CHECKPOINTS_DURING_READS as u64)
        {
            if stop_requested() {
                outcome = Err(BenchError::Interrupted);
                break;
            }
            if reader.is_finished() || writer.is_finished() {
                break;
            }
            if checkpointing {
                if let Err(e) = vol.checkpoint() {
                    outcome = Err(BenchError::fs("iomapfs checkpoint", e));
                    break;
                }
                checkpoints += 1;
            } else {
                std::thread::park_timeout(Duration::from_millis(10));
            }
        }
        done.store(true, Ordering::Release);
        let reads = reader
            .join()
            .map_err(|_| BenchError::failed("metadata-scale", "the reader thread panicked"));
        let written = writer
            .join()
            .map_err(|_| BenchError::failed("metadata-scale", "the writer thread panicked"));
        let late = wakeups.join().unwrap_or(0);
        outcome.map(|()| (reads, written, checkpoints, late))
    })?;
    let (writes, filled) = written??;
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    for offset in filled {
        file.punch_hole(offset, BLOCK)
            .map_err(|e| BenchError::fs("iomapfs punch the writer's block", e))?;
    }
    Ok(Window {
        reads: reads??,
        writes,
        checkpoints,
        wakeup_late_max_ns: late,
    })
}

/// How long [`longest_clock_gap`] spins before the quiet window.
const CPU_GAP_WINDOW: Duration = Duration::from_secs(1);

/// Reads `now` back to back for `window` and returns the longest interval
/// between two reads: with nothing else to run, how long this thread was
/// kept from running at a time.
fn longest_clock_gap(window: Duration, mut now: impl FnMut() -> Instant) -> Duration {
    let started = now();
    let (mut last, mut longest) = (started, Duration::ZERO);
    while last.duration_since(started) < window {
        let t = now();
        longest = longest.max(t.duration_since(last));
        last = t;
    }
    longest
}

/// [`longest_clock_gap`] in one thread per CPU at once, for
/// `CPU_GAP_WINDOW`: the longest gap any of them saw. With every CPU
/// busy, as in the windows, whatever else the machine runs must take a
/// CPU from a running thread.
fn longest_clock_gap_on_every_cpu() -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        let spinners: Vec<_> = (0..cpus)
            .map(|_| s.spawn(|| longest_clock_gap(CPU_GAP_WINDOW, Instant::now)))
            .collect();
        spinners
            .into_iter()
            .map(|t| t.join().unwrap_or(Duration::ZERO))
            .max()
            .unwrap_or(Duration::ZERO)
    })
}

/// Sleeps 1 ms at a time until `done`; returns the most any sleep
/// overran. The sleep is the measurement (a hiccup meter), not a wait
/// for another thread.
fn wakeup_lateness(done: &AtomicBool) -> u64 {
    const NAP: Duration = Duration::from_millis(1);
    let mut worst = Duration::ZERO;
    while !done.load(Ordering::Acquire) {
        let started = Instant::now();
        std::thread::sleep(NAP);
        worst = worst.max(started.elapsed().saturating_sub(NAP));
    }
    worst.as_nanos() as u64
}

/// Random 4 KiB direct reads of written blocks until `done`.
fn reader(
    vol: &Volume,
    align: usize,
    extents: u64,
    done: &AtomicBool,
) -> Result<Histogram, BenchError> {
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    let mut buf = AlignedBuf::new(BLOCK as usize, align)
        .map_err(|e| BenchError::setup("read buffer", e.to_string()))?;
    let mut rng = Rng::new(0x5ca1e ^ extents);
    let mut hist = Histogram::new();
    while !done.load(Ordering::Acquire) {
        let offset = rng.below(extents) * 2 * BLOCK;
        let started = Instant::now();
        let n = file
            .pread(&mut buf, offset)
            .map_err(|e| BenchError::fs("iomapfs read", e))?;
        hist.record(started.elapsed().as_nanos() as u64);
        if n != BLOCK as usize {
            return Err(BenchError::failed(
                "iomapfs read",
                format!("short read: {n} bytes at {offset}"),
            ));
        }
    }
    Ok(hist)
}

/// 4 KiB direct writes until `done`, alternating an overwrite of a random
/// written block (no metadata change) and an allocating write into a
/// random hole between the built extents (a new extent). Returns the write
/// latencies and the holes it filled.
fn writer(
    vol: &Volume,
    align: usize,
    extents: u64,
    done: &AtomicBool,
) -> Result<(Histogram, Vec<u64>), BenchError> {
    let file = vol
        .open_file(FILE, direct_flags())
        .map_err(|e| BenchError::fs("iomapfs open", e))?;
    let mut buf = AlignedBuf::new(BLOCK as usize, align)
        .map_err(|e| BenchError::setup("write buffer", e.to_string()))?;
    let mut rng = Rng::new(0x3717e ^ extents);
    let mut hist = Histogram::new();
    let mut filled = Vec::new();
    let mut allocating = false;
    while !done.load(Ordering::Acquire) {
        let block = rng.below(extents) * 2 + u64::from(allocating);
        let offset = block * BLOCK;
        rng.fill(&mut buf[..8]);
        let started = Instant::now();
        file.pwrite(&buf, offset)
            .map_err(|e| BenchError::fs("iomapfs write", e))?;
        hist.record(started.elapsed().as_nanos() as u64);
        if allocating {
            filled.push(offset);
        }
        allocating = !allocating;
    }
    filled.sort_unstable();
    filled.dedup();
    Ok((hist, filled))
}

/// The process's peak resident set so far.
fn max_rss_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a `rusage` into the pointer we pass, which
    // points to one of that type; RUSAGE_SELF is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: getrusage returned 0, so it filled the struct (and it was
    // zeroed before in any case).
    let usage = unsafe { usage.assume_init() };
    // Linux reports kilobytes.
    (usage.ru_maxrss as u64).saturating_mul(1024)
}

/// A directory in RAM for the images: `/dev/shm` when it is tmpfs, else
/// the temporary directory.
pub fn image_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_gap_is_the_longest_interval_between_two_reads() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        // Reads at 0, 1, 2, 900, 901, then 2000: the last interval (1099),
        // past the window, counts too.
        let mut reads = [0, 1, 2, 900, 901, 2000].into_iter().map(at);
        let gap = longest_clock_gap(Duration::from_millis(1), || reads.next().unwrap());
        assert_eq!(gap, Duration::from_micros(1099));
        let mut steady = (0..).map(|k| at(3 * k));
        let gap = longest_clock_gap(Duration::from_millis(1), || steady.next().unwrap());
        assert_eq!(gap, Duration::from_micros(3));
    }

    #[test]
    fn every_size_fits_its_device_with_room_for_metadata() {
        for spec in SPECS {
            for &(extents, _) in spec.sizes {
                let span = extents * 2 * BLOCK;
                assert!(device_bytes(extents) >= 2 * span + (1 << 30), "{extents}");
            }
        }
    }

    #[test]
    fn names_are_known_and_steps_count_sizes() {
        assert!(is_metadata_workload("metadata-scale"));
        assert!(!is_metadata_workload("randread-4k-qd1"));
        assert_eq!(steps(&["metadata-scale".into()]), 2);
        assert_eq!(
            steps(&["metadata-scale".into(), "metadata-scale-10m".into()]),
            3
        );
    }
}
