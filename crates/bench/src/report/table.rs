//! The report as text for people: the machine and devices, then one table
//! for direct workloads (ratios to the raw device) and one for buffered
//! workloads (ratios to XFS and to the memcpy ceiling), the writeback
//! figures, what was not measured and why, and the notes. Every ratio
//! column is named for its baseline.

use std::fmt::Write as _;

use super::{BenchReport, BenchResult, RequestsPerOp, MOUNT_ROW_PREFIX};

fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn micros(ns: f64) -> String {
    let us = ns / 1e3;
    if us >= 1000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

fn mib(bytes_per_s: f64) -> f64 {
    bytes_per_s / f64::from(1u32 << 20)
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{x:.2}"))
}

fn cpu_us(r: &BenchResult) -> String {
    r.cpu_per_io
        .as_ref()
        .map_or("-".into(), |c| micros(c.total_us * 1e3))
}

fn per_op(r: &RequestsPerOp) -> String {
    if r.writes == 0.0 && r.fua_writes == 0.0 && r.flushes == 0.0 {
        format!("r {:.2}", r.reads)
    } else {
        format!(
            "w {:.2} fua {:.2} fl {:.2}",
            r.writes, r.fua_writes, r.flushes
        )
    }
}

/// Device traffic of a buffered row: requests per I/O, then device bytes
/// per byte the workload read or wrote (warm reads should read 0; writes
/// whose window includes writeback write at least 1).
fn buffered_device(r: &BenchResult) -> String {
    let (Some(per), Some(req), Some(ops)) = (r.requests_per_op, r.device_requests, r.ops) else {
        return String::new();
    };
    let bytes = if r.iops > 0.0 {
        ops as f64 * r.bw_bytes / r.iops
    } else {
        0.0
    };
    let share = |b: u64| {
        if bytes > 0.0 {
            format!("{:.2}", b as f64 / bytes)
        } else {
            "-".into()
        }
    };
    format!(
        "r {} w {} fl {} · bytes r {} w {}",
        fraction(per.reads),
        fraction(per.writes),
        fraction(per.flushes),
        share(req.bytes_read),
        share(req.bytes_written)
    )
}

/// Requests per I/O, with the digits a rare request needs (one flush per
/// pass of a thousand writes is 0.0010, not 0.00).
fn fraction(x: f64) -> String {
    if x > 0.0 && x < 0.01 {
        format!("{x:.4}")
    } else {
        format!("{x:.2}")
    }
}

/// Rows of buffered workloads carry a variant; direct ones do not.
fn is_buffered(r: &BenchResult) -> bool {
    r.variant.is_some()
}

/// Rows of fio rows say so.
fn is_fio(r: &BenchResult) -> bool {
    r.harness.as_deref() == Some("fio")
}

/// Rows of the mount workloads (fio through the FUSE mount and on XFS).
fn is_mount(r: &BenchResult) -> bool {
    r.workload.starts_with(MOUNT_ROW_PREFIX)
}

/// The report as a table: one row per workload × target with IOPS, MiB/s,
/// mean and p99 latency, ratios, CPU per I/O and device requests per I/O
/// where known; then the writeback figures, what was skipped, why CPU
/// figures are missing, and the notes.
pub fn render_table(report: &BenchReport) -> String {
    let mut out = String::new();
    header(&mut out, report);
    let direct: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| !is_buffered(r) && !is_fio(r) && !is_mount(r))
        .collect();
    let buffered: Vec<&BenchResult> = report.results.iter().filter(|r| is_buffered(r)).collect();
    let fio: Vec<&BenchResult> = report.results.iter().filter(|r| is_fio(r)).collect();
    let mount: Vec<&BenchResult> = report.results.iter().filter(|r| is_mount(r)).collect();
    if !direct.is_empty()
        || (buffered.is_empty()
            && fio.is_empty()
            && mount.is_empty()
            && report.metadata_scale.is_empty())
    {
        direct_table(&mut out, &direct);
    }
    if !fio.is_empty() {
        fio_table(&mut out, &fio);
    }
    if !report.metadata_scale.is_empty() {
        metadata_table(&mut out, &report.metadata_scale);
    }
    if !buffered.is_empty() {
        buffered_table(&mut out, &buffered);
        cold_reads(&mut out, &buffered);
        writeback(&mut out, &buffered);
    }
    if !mount.is_empty() {
        mount_table(&mut out, &mount);
    }
    if direct
        .iter()
        .any(|r| r.lat_p99_ns < r.lat_mean_ns && r.ops.is_some())
    {
        let _ = writeln!(
            out,
            "\n(p99 below the mean: with more I/O threads than CPUs, a few I/Os wait a whole \
             scheduler slice for a CPU; the mean then follows Little's law, queue depth / IOPS, \
             while p99 shows the I/O itself)"
        );
    }
    skipped(&mut out, report);
    no_cpu(&mut out, report);
    if !report.notes.is_empty() {
        let _ = writeln!(out, "\nnotes:");
        for n in &report.notes {
            let _ = writeln!(out, "  {n}");
        }
    }
    out
}

/// The `metadata-scale` rows: one per extent count.
fn metadata_table(out: &mut String, rows: &[crate::MetadataScaleResult]) {
    let ms = |ns: u64| format!("{:.2} ms", ns as f64 / 1e6);
    let us = |ns: u64| format!("{:.0} µs", ns as f64 / 1e3);
    let _ = writeln!(
        out,
        "\n{:<20} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "metadata workload",
        "extents",
        "build",
        "ckpt med",
        "ckpt max",
        "ckpt 1%",
        "mount",
        "free ready",
        "1st alloc",
        "max RSS",
        "p99 quiet",
        "p99.9 q",
        "max quiet",
        "p99 ckpt",
        "p99.9 c",
        "max ckpt",
        "max/p99q"
    );
    let write_columns = |out: &mut String| {
        let _ = writeln!(
            out,
            "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>13}",
            "  writes",
            "quiet",
            "p99",
            "max",
            "ckpt p99",
            "ckpt max",
            "late q",
            "late c",
            "cpu gap",
            "ckpt lock",
            "commit 1",
            "commit 2",
            "1st read",
            "RSS mnt",
            "chunks mnt"
        );
    };
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>5} MiB {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8.1}×",
            r.workload,
            r.extents,
            r.build,
            ms(r.checkpoint_median_ns),
            ms(r.checkpoint_max_ns),
            ms(r.checkpoint_1pct_changed_ns),
            ms(r.mount_ns),
            ms(r.free_space_ready_ns),
            ms(r.first_allocating_write_ns),
            r.max_rss_bytes >> 20,
            us(r.quiet_read_p99_ns),
            us(r.quiet_read_p999_ns),
            us(r.quiet_read_max_ns),
            us(r.checkpointing_read_p99_ns),
            us(r.checkpointing_read_p999_ns),
            us(r.checkpointing_read_max_ns),
            r.worst_over_quiet_p99,
        );
    }
    write_columns(out);
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>5} MiB {:>13}",
            format!("  {}", r.extents),
            r.quiet_writes,
            us(r.quiet_write_p99_ns),
            us(r.quiet_write_max_ns),
            us(r.checkpointing_write_p99_ns),
            us(r.checkpointing_write_max_ns),
            us(r.quiet_wakeup_late_max_ns),
            us(r.checkpointing_wakeup_late_max_ns),
            us(r.cpu_gap_max_ns),
            us(r.checkpointing_lock_hold_max_ns.max(r.checkpointing_eviction_hold_max_ns)),
            us(r.first_commit_ns),
            us(r.second_commit_ns),
            us(r.first_read_ns),
            r.rss_after_mount_bytes >> 20,
            format!("{}/{}", r.mount_chunks_loaded, r.mount_chunks),
        );
    }
    let _ = writeln!(
        out,
        "{:<20} {:>10} {:>10} {:>9} {:>13} {:>10} {:>9} {:>9} {:>9} {:>13}",
        "  mount after a base",
        "mount",
        "1st read",
        "RSS mnt",
        "chunks mnt",
        "read all",
        "RSS all",
        "cached",
        "shells",
        "chunks all"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>10} {:>10} {:>5} MiB {:>13} {:>10} {:>5} MiB {:>5} MiB {:>5} MiB {:>13}",
            format!("  {}", r.extents),
            ms(r.base_mount_ns),
            us(r.base_first_read_ns),
            r.base_rss_after_mount_bytes >> 20,
            format!("{}/{}", r.base_mount_chunks_loaded, r.mount_chunks),
            ms(r.all_chunks_read_ns),
            r.all_chunks_rss_bytes >> 20,
            r.all_chunks_cached_bytes >> 20,
            r.all_chunks_shell_bytes >> 20,
            format!("{}/{}", r.all_chunks_loaded, r.mount_chunks),
        );
    }
    let _ = writeln!(
        out,
        "{:<20} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "  free space",
        "build",
        "alloc mnt",
        "alloc ready",
        "free ranges",
        "as a tree",
        "child RSS",
        "+ read all",
        "+ change 1%"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>8.1} s {:>8} KiB {:>8} KiB {:>12} {:>8} KiB {:>8} MiB {:>8} MiB {:>8} MiB",
            format!("  {}", r.extents),
            r.build_ns as f64 / 1e9,
            r.alloc_bytes_at_mount >> 10,
            r.alloc_bytes_free_ready >> 10,
            r.free_ranges,
            r.free_range_tree_bytes >> 10,
            r.child_mount_max_rss_bytes >> 20,
            r.child_read_all_max_rss_bytes >> 20,
            r.child_one_percent_max_rss_bytes >> 20,
        );
    }
    let _ = writeln!(
        out,
        "(reads: one thread of 4 KiB direct reads of random extents beside one writer thread \
         (4 KiB direct overwrites and allocating writes into holes, alternating), quiet = no \
         checkpoint running, ckpt = while checkpoints run back to back ({} during the window of the last \
         row); ckpt 1% = the median of {} checkpoints, each after 1% of the extents changed; max/p99q = worst read while checkpointing over the quiet p99 (on a loaded machine \
         the quiet max shows what preemption alone costs); late q/c = the most a thread that only sleeps 1 ms at a time \
         woke late in each window (what scheduling, the bench's own threads included, costs a thread that holds no lock); cpu gap = the longest any of a thread per CPU that only read the clock, nothing else of the bench running, went between two reads in 1 s before the quiet window (what the machine alone takes from a running thread when every CPU is busy: no worst latency here can be promised below it); ckpt lock = the longest a checkpoint (or the evictor of extent chunks) held the metadata lock exclusive in the ckpt window: the most any read or write waited behind it; mount = until the mount returns (free space is rebuilt in the background since); free ready = from the mount's start until free space is ready; 1st alloc = the first allocating 4 KiB write right after the mount returns (it waits for free space); commit 1/2 = the first and second commit after the mount (a file created each; the first clears the clean-unmount mark); 1st read = the first 4 KiB direct read after the mount, open included (with extent pages it reads the page mount left on disk: mount + 1st read is what a mount that loads every map did at once); RSS mnt = resident set right after it; chunks mnt = extent chunks in memory after the mount / all (extent pages read on demand: the chunks the delta chain reaches); mount after a base = the same after checkpoints until one was a base, whose chain then reaches no chunk of the file; read all = then one 4 KiB direct read in every chunk of the file; RSS all, cached, shells and chunks all = once the evictor is idle after it: resident set, clean extent chunks in memory, the maps' shells (a chunk's entry and allocation, loaded or not, and the page references both checkpoint slots list: together with the clean chunks bounded by the mount's metadata_cache_bytes, 64 MiB by default) and chunks in memory / all; max RSS is the process's high-water mark so far; build = {:.1} s for the last row; free space: build = time to make the extents, alloc mnt / alloc ready = the allocator's own heap bytes (estimated) right after the mount (the clean unmount's reserve while the scan runs) and once free space is ready, free ranges then and as a tree = what a tree of them (the allocator before the bitmap) takes by the same estimate, child RSS = peak resident set (VmHWM) of a fresh process mounting the final image until free space is ready (iomapfs io, statfs; $IOMAPFS_BENCH_MOUNT_BIN picks another build), + read all = its peak once it also read one 4 KiB block in every chunk, + change 1% = then once it changed 1% of the extents as ckpt 1% does (no checkpoint asked for): the memory of a session under the default 64 MiB metadata budget, nothing of the build in it)",
        rows.last().map_or(0, |r| r.checkpoints_during_reads),
        crate::metadata_scale::ONE_PERCENT_ROUNDS,
        rows.last().map_or(0.0, |r| r.build_ns as f64 / 1e9),
    );
}

fn header(out: &mut String, report: &BenchReport) {
    let m = &report.machine;
    let _ = writeln!(
        out,
        "iomapfs bench: kernel {}, {} CPUs, {:.1} GiB RAM, backend {}",
        m.kernel,
        m.cpus,
        m.memory_bytes as f64 / f64::from(1u32 << 30),
        m.backend
    );
    let _ = writeln!(
        out,
        "{:.2} s measured per target after {:.2} s warm-up",
        report.settings.runtime_s, report.settings.warmup_s
    );
    for d in &m.devices {
        let _ = writeln!(
            out,
            "device {}: {}, {} MiB, {}-byte logical blocks, write cache {}, FUA {}{}; {}",
            d.path,
            d.kind,
            d.size_bytes >> 20,
            d.logical_block_size,
            if d.volatile_write_cache {
                "volatile"
            } else {
                "none"
            },
            if d.fua { "yes" } else { "no" },
            if d.direct_io {
                ""
            } else {
                ", NO direct I/O (page cache)"
            },
            d.backend,
        );
    }
}

fn direct_table(out: &mut String, rows: &[&BenchResult]) {
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<28} {:<8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9}  device req/IO",
        "workload", "target", "IOPS", "MiB/s", "mean µs", "p99 µs", "×raw", "cpu ×raw", "cpu µs/IO"
    );
    let mut last = "";
    for r in rows {
        let name = if r.workload == last { "" } else { &r.workload };
        last = &r.workload;
        let reqs = r.requests_per_op.as_ref().map_or(String::new(), per_op);
        let line = format!(
            "{:<28} {:<8} {:>9} {:>9.1} {:>9} {:>9} {:>6} {:>8} {:>9}  {}",
            name,
            r.target,
            si(r.iops),
            mib(r.bw_bytes),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio(r.ratio_to_raw),
            ratio(r.cpu_ratio_to_raw),
            cpu_us(r),
            reqs
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

fn jobs_cpu_us(r: &BenchResult) -> String {
    r.cpu_per_io
        .as_ref()
        .and_then(|c| c.io_threads_us)
        .map_or("-".into(), |us| micros(us * 1e3))
}

fn fio_table(out: &mut String, rows: &[&BenchResult]) {
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "fio rows (every target measured by fio; iomapfs through the fio engine): ×raw and \
         ×xfs are IOPS over the raw device's and xfs's rows; cpu µs/IO is the fio process's \
         CPU per I/O, jobs µs/IO its job threads' share"
    );
    let _ = writeln!(
        out,
        "{:<32} {:<8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>8} {:>9} {:>9}",
        "workload",
        "target",
        "IOPS",
        "MiB/s",
        "mean µs",
        "p99 µs",
        "×raw",
        "×xfs",
        "cpu ×raw",
        "cpu µs/IO",
        "jobs µs/IO"
    );
    let mut last = "";
    for r in rows {
        let name = if r.workload == last { "" } else { &r.workload };
        last = &r.workload;
        let _ = writeln!(
            out,
            "{:<32} {:<8} {:>9} {:>9.1} {:>9} {:>9} {:>6} {:>6} {:>8} {:>9} {:>9}",
            name,
            r.target,
            si(r.iops),
            mib(r.bw_bytes),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio(r.ratio_to_raw),
            ratio(r.ratio_to_xfs),
            ratio(r.cpu_ratio_to_raw),
            cpu_us(r),
            jobs_cpu_us(r),
        );
    }
}

fn buffered_table(out: &mut String, rows: &[&BenchResult]) {
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "buffered I/O (one thread, sequential, synchronous calls): ×xfs is IOPS over xfs's of \
         the same variant, ×memcpy MiB/s over the memcpy ceiling's, cpu ×xfs CPU per I/O over \
         xfs's; mean and p99 are of the reads or writes (an fsync ending a pass is in IOPS and \
         MiB/s, not in them)"
    );
    let _ = writeln!(
        out,
        "{:<20} {:<16} {:<8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>8} {:>9}  device req/IO · bytes per byte",
        "workload",
        "variant",
        "target",
        "IOPS",
        "MiB/s",
        "mean µs",
        "p99 µs",
        "×xfs",
        "×memcpy",
        "cpu ×xfs",
        "cpu µs/IO"
    );
    let mut last_workload = "";
    let mut last_variant = "";
    for r in rows {
        let variant = r.variant.as_deref().unwrap_or("");
        let same_workload = r.workload == last_workload;
        let name = if same_workload { "" } else { &r.workload };
        let shown_variant = if same_workload && variant == last_variant {
            ""
        } else {
            variant
        };
        last_workload = &r.workload;
        last_variant = variant;
        let line = format!(
            "{:<20} {:<16} {:<8} {:>9} {:>9.1} {:>9} {:>9} {:>6} {:>8} {:>8} {:>9}  {}",
            name,
            shown_variant,
            r.target,
            si(r.iops),
            mib(r.bw_bytes),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio(r.ratio_to_xfs),
            ratio(r.ratio_to_memcpy),
            ratio(r.cpu_ratio_to_xfs),
            cpu_us(r),
            buffered_device(r)
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

fn mount_table(out: &mut String, rows: &[&BenchResult]) {
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "through the FUSE mount (fio, one job): ×xfs is IOPS over xfs's; CPU per I/O of fio's \
         process, of the daemon serving the mount, their sum, and that sum over xfs's (cpu ×xfs)"
    );
    // As wide as the longest target name (iomapfs-fuse-uring-idle).
    let tw = rows
        .iter()
        .map(|r| r.target.len())
        .max()
        .unwrap_or(0)
        .max(12);
    let _ = writeln!(
        out,
        "{:<28} {:<tw$} {:>9} {:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>8}",
        "workload",
        "target",
        "IOPS",
        "MiB/s",
        "mean µs",
        "p99 µs",
        "×xfs",
        "fio µs/IO",
        "daemon µs",
        "cpu µs/IO",
        "cpu ×xfs"
    );
    let mut last = "";
    for r in rows {
        let name = if r.workload == last { "" } else { &r.workload };
        last = &r.workload;
        let daemon = r.daemon_cpu_per_io.as_ref().map(|c| c.total_us);
        let total = r
            .cpu_per_io
            .as_ref()
            .map(|c| c.total_us + daemon.unwrap_or(0.0));
        let us = |x: Option<f64>| x.map_or("-".into(), |x| micros(x * 1e3));
        let line = format!(
            "{:<28} {:<tw$} {:>9} {:>9.1} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>8}",
            name,
            r.target,
            si(r.iops),
            mib(r.bw_bytes),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio(r.ratio_to_xfs),
            cpu_us(r),
            us(daemon),
            us(total),
            ratio(r.cpu_ratio_to_xfs),
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// The device figures of cold reads: every row that read all its bytes
/// from the device, against the raw device's sequential reads: the
/// device's rate, which bounds iomapfs and the kernel's file systems
/// alike up to its noise.
fn cold_reads(out: &mut String, rows: &[&BenchResult]) {
    let with: Vec<&&BenchResult> = rows
        .iter()
        .filter(|r| r.ratio_to_raw_seq_read.is_some() && r.target != "raw")
        .collect();
    if with.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\ncold reads (every byte read comes from the device) against the raw device's \
         sequential 2 MiB direct reads at QD 2 (seq-read):"
    );
    for r in with {
        let raw = raw_of(rows, r);
        let _ = writeln!(
            out,
            "  {:<20} {:<16} {:<8} {:>9.1} MiB/s = {} × raw seq-read{raw}",
            r.workload,
            r.variant.as_deref().unwrap_or(""),
            r.target,
            mib(r.bw_bytes),
            ratio(r.ratio_to_raw_seq_read),
        );
    }
}

/// " of N MiB/s": the bandwidth of the raw row of `r`'s workload.
fn raw_of(rows: &[&BenchResult], r: &BenchResult) -> String {
    rows.iter()
        .find(|b| b.workload == r.workload && b.target == "raw")
        .map_or(String::new(), |b| {
            format!(" of {:.1} MiB/s", mib(b.bw_bytes))
        })
}

/// The writeback figures: every row whose window includes writing back
/// what it wrote, against the raw device's sequential writes.
fn writeback(out: &mut String, rows: &[&BenchResult]) {
    let with: Vec<&&BenchResult> = rows
        .iter()
        .filter(|r| r.ratio_to_raw_seq_write.is_some() && r.target != "raw")
        .collect();
    if with.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nwriteback throughput (+fsync variants: every byte written in the window is written \
         back in it) against the raw device's sequential 1 MiB direct writes (seq-write):"
    );
    for r in with {
        let raw = raw_of(rows, r);
        let fsyncs = match (r.fsync_write_bw_bytes, r.fsync_write_ratio_to_raw_seq_write) {
            (Some(bw), Some(x)) => format!(
                "; its fsyncs alone wrote {:.1} MiB/s = {} × raw",
                mib(bw),
                ratio(Some(x))
            ),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<20} {:<16} {:<8} {:>9.1} MiB/s = {} × raw seq-write{raw}{fsyncs}",
            r.workload,
            r.variant.as_deref().unwrap_or(""),
            r.target,
            mib(r.bw_bytes),
            ratio(r.ratio_to_raw_seq_write),
        );
    }
}

fn skipped(out: &mut String, report: &BenchReport) {
    if report.skipped.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nnot measured:");
    // Group targets sharing a workload, variant and reason onto one line.
    let mut groups: Vec<(String, &str, Vec<&str>)> = Vec::new();
    for s in &report.skipped {
        let what = match &s.variant {
            Some(v) => format!("{} {v}", s.workload),
            None => s.workload.clone(),
        };
        match groups
            .iter_mut()
            .find(|(w, why, _)| *w == what && *why == s.reason)
        {
            Some(g) => g.2.push(&s.target),
            None => groups.push((what, &s.reason, vec![&s.target])),
        }
    }
    for (what, reason, targets) in groups {
        let _ = writeln!(out, "  {what} [{}]: {reason}", targets.join(", "));
    }
}

fn no_cpu(out: &mut String, report: &BenchReport) {
    let missing: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| r.cpu_per_io.is_none())
        .collect();
    if missing.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nno CPU figure:");
    // Group by reason: one line per reason, its workload × targets.
    let mut groups: Vec<(&str, Vec<String>)> = Vec::new();
    for r in missing {
        let reason = r.cpu_note.as_deref().unwrap_or("not measured");
        let which = match &r.variant {
            Some(v) => format!("{} {v} · {}", r.workload, r.target),
            None => format!("{} · {}", r.workload, r.target),
        };
        match groups.iter_mut().find(|(why, _)| *why == reason) {
            Some(g) => g.1.push(which),
            None => groups.push((reason, vec![which])),
        }
    }
    for (reason, which) in groups {
        let _ = writeln!(out, "  {reason} [{}]", which.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{cpu, report, result};
    use super::super::{CPU_SCOPE_FIO, CPU_SCOPE_PROCESS};
    use super::*;

    /// The cell of `column` (a header) in `line`: the text right-aligned
    /// under the header, back to the previous space.
    fn cell<'a>(header: &str, line: &'a str, column: &str) -> &'a str {
        let end = header.find(column).unwrap() + column.len();
        let chars: Vec<(usize, char)> = line.char_indices().collect();
        let header_chars = header[..end].chars().count();
        let stop = chars.get(header_chars).map_or(line.len(), |c| c.0);
        line[..stop].rsplit(' ').next().unwrap()
    }

    #[test]
    fn metadata_rows_show_clean_chunks_and_shells_under_their_headers() {
        let mut rep = report(Vec::new());
        rep.metadata_scale = vec![crate::MetadataScaleResult {
            workload: "metadata-scale".into(),
            extents: 1_000_000,
            all_chunks_cached_bytes: 51 << 20,
            all_chunks_shell_bytes: 8 << 20,
            ..Default::default()
        }];
        let table = render_table(&rep);
        let lines: Vec<&str> = table.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("  mount after a base"))
            .unwrap();
        let (header, row) = (lines[at], lines[at + 1]);
        // Each cell ends under its header: "51 MiB", then "8 MiB".
        let before = |column: &str| {
            let end = header.find(column).unwrap() + column.len();
            let chars = header[..end].chars().count();
            row.chars().take(chars).collect::<String>()
        };
        assert!(before("cached").ends_with(" 51 MiB"), "{header}\n{row}");
        assert!(before("shells").ends_with(" 8 MiB"), "{header}\n{row}");
    }

    #[test]
    fn table_shows_cpu_per_io_and_its_ratio_under_their_headers() {
        let mut raw = result("raw", 400_000.0, Some(1.0));
        raw.cpu_per_io = cpu(4.0, CPU_SCOPE_PROCESS);
        raw.cpu_ratio_to_raw = Some(1.0);
        let mut fs = result("iomapfs", 300_000.0, Some(0.75));
        fs.cpu_per_io = cpu(5.5, CPU_SCOPE_PROCESS);
        fs.cpu_ratio_to_raw = Some(1.375);
        let mut xfs = result("xfs", 250_000.0, Some(0.625));
        xfs.cpu_per_io = cpu(123.456, CPU_SCOPE_FIO);
        xfs.cpu_ratio_to_raw = Some(30.864);
        let mut ext4 = result("ext4", 200_000.0, Some(0.5));
        ext4.cpu_note = Some("fio JSON has no number jobs[0].usr_cpu".into());
        let table = render_table(&report(vec![raw, fs, xfs, ext4]));
        let lines: Vec<&str> = table.lines().collect();
        let header = *lines.iter().find(|l| l.starts_with("workload")).unwrap();
        // "cpu ×raw" comes right after "×raw", then "cpu µs/IO".
        let at = |c: &str| header.find(c).unwrap();
        assert!(at("×raw") < at("cpu ×raw") && at("cpu ×raw") < at("cpu µs/IO"));
        assert!(header[at("×raw")..at("cpu ×raw")].trim() == "×raw");
        let row = |t: &str| {
            *lines
                .iter()
                .find(|l| l.contains(&format!(" {t} ")))
                .unwrap()
        };
        let cells = |t: &str| {
            (
                cell(header, row(t), "  ×raw"),
                cell(header, row(t), "cpu ×raw"),
                cell(header, row(t), "cpu µs/IO"),
            )
        };
        assert_eq!(cells("raw"), ("1.00", "1.00", "4.00"), "{table}");
        assert_eq!(cells("iomapfs"), ("0.75", "1.38", "5.50"), "{table}");
        assert_eq!(cells("xfs"), ("0.62", "30.86", "123.5"), "{table}");
        assert_eq!(cells("ext4"), ("0.50", "-", "-"), "{table}");
        // Why ext4 has none is said once, with where.
        let why = table.split("no CPU figure:").nth(1).expect(&table);
        assert!(
            why.contains("fio JSON has no number jobs[0].usr_cpu [randread-4k-qd1 · ext4]"),
            "{table}"
        );
    }

    fn buffered(variant: &str, target: &str, iops: f64) -> BenchResult {
        BenchResult {
            workload: "buffered-write-64k".into(),
            variant: Some(variant.into()),
            bw_bytes: iops * 65536.0,
            ..result(target, iops, None)
        }
    }

    #[test]
    fn fio_rows_have_their_own_table_with_xfs_and_job_thread_cpu() {
        let engine_row = result("raw", 400_000.0, Some(1.0));
        let fio = |target: &str, iops: f64, raw: f64, xfs: Option<f64>, cpu_us: f64| {
            let mut r = result(target, iops, Some(raw));
            r.workload = "fio-randread-4k-qd1".into();
            r.harness = Some("fio".into());
            r.ratio_to_xfs = xfs;
            r.cpu_per_io = cpu(cpu_us, super::super::CPU_SCOPE_FIO_PROCESS);
            if let Some(c) = r.cpu_per_io.as_mut() {
                c.io_threads_us = Some(cpu_us / 2.0);
            }
            r
        };
        let rows = vec![
            engine_row,
            fio("raw", 100_000.0, 1.0, Some(2.0), 8.0),
            fio("iomapfs", 120_000.0, 1.2, Some(2.4), 6.0),
            fio("xfs", 50_000.0, 0.5, Some(1.0), 20.0),
        ];
        let table = render_table(&report(rows));
        let header = table
            .lines()
            .find(|l| l.starts_with("workload") && l.contains("jobs µs/IO"))
            .expect(&table);
        let section = table.split(header).nth(1).expect(&table);
        let row = |t: &str| {
            section
                .lines()
                .find(|l| l.contains(&format!(" {t} ")))
                .unwrap_or_else(|| panic!("no {t} row in {table}"))
        };
        let cells = |t: &str| {
            (
                cell(header, row(t), "  ×raw"),
                cell(header, row(t), "  ×xfs"),
                cell(header, row(t), "cpu µs/IO"),
                cell(header, row(t), "jobs µs/IO"),
            )
        };
        assert_eq!(
            cells("iomapfs"),
            ("1.20", "2.40", "6.00", "3.00"),
            "{table}"
        );
        assert_eq!(cells("xfs"), ("0.50", "1.00", "20.00", "10.00"), "{table}");
        // The engine's row stays in the engine's table, not this one.
        assert_eq!(section.matches(" raw ").count(), 1, "{table}");
        assert!(row("raw").starts_with("fio-randread-4k-qd1"), "{table}");
    }

    #[test]
    fn buffered_rows_have_their_own_table_with_their_baselines_named() {
        let direct = result("raw", 400_000.0, Some(1.0));
        let mut memcpy = buffered("ceiling", "memcpy", 200_000.0);
        memcpy.ratio_to_memcpy = Some(1.0);
        let mut raw = buffered("seq-write", "raw", 2_000.0);
        raw.ratio_to_raw_seq_write = Some(1.0);
        let mut fs = buffered("overwrite+fsync", "iomapfs", 1_800.0);
        fs.ratio_to_xfs = Some(2.0);
        fs.cpu_ratio_to_xfs = Some(0.25);
        fs.ratio_to_memcpy = Some(0.009);
        fs.ratio_to_raw_seq_write = Some(0.9);
        fs.fsync_write_bw_bytes = Some(250.0 * 1024.0 * 1024.0);
        fs.fsync_write_ratio_to_raw_seq_write = Some(2.0);
        fs.cpu_per_io = cpu(12.0, CPU_SCOPE_PROCESS);
        fs.ops = Some(1000);
        fs.requests_per_op = Some(RequestsPerOp {
            writes: 0.5,
            flushes: 0.25,
            ..RequestsPerOp::default()
        });
        fs.device_requests = Some(super::super::DeviceRequests {
            writes: 500,
            flushes: 250,
            bytes_written: 1000 * 65536,
            ..Default::default()
        });
        let mut xfs = buffered("overwrite+fsync", "xfs", 900.0);
        xfs.ratio_to_xfs = Some(1.0);
        xfs.ratio_to_raw_seq_write = Some(0.45);
        let ext4 = buffered("overwrite+fsync", "ext4", 800.0);
        let table = render_table(&report(vec![direct, memcpy, raw, fs, xfs, ext4]));
        let lines: Vec<&str> = table.lines().collect();
        let headers: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with("workload"))
            .collect();
        assert_eq!(headers.len(), 2, "{table}");
        let (direct_header, header) = (headers[0], headers[1]);
        assert!(direct_header.contains("×raw") && !direct_header.contains("×xfs"));
        assert!(
            header.contains("variant") && !header.contains("×raw"),
            "{header}"
        );
        let section = table
            .split(header)
            .nth(1)
            .and_then(|rest| rest.split("\n\n").next())
            .expect(&table);
        let row = |t: &str| {
            section
                .lines()
                .find(|l| l.contains(&format!(" {t} ")))
                .unwrap_or_else(|| panic!("no {t} row in {table}"))
        };
        let cells = |t: &str| {
            (
                cell(header, row(t), "  ×xfs"),
                cell(header, row(t), "×memcpy"),
                cell(header, row(t), "cpu ×xfs"),
                cell(header, row(t), "cpu µs/IO"),
            )
        };
        assert_eq!(
            cells("iomapfs"),
            ("2.00", "0.01", "0.25", "12.00"),
            "{table}"
        );
        assert_eq!(cells("memcpy"), ("-", "1.00", "-", "-"), "{table}");
        assert_eq!(cells("ext4"), ("-", "-", "-", "-"), "{table}");
        // The variant is named once for its three targets.
        assert!(row("iomapfs").contains("overwrite+fsync"), "{table}");
        assert!(!row("xfs").contains("overwrite+fsync"), "{table}");
        // Device traffic: requests per I/O and bytes per byte written.
        assert!(
            row("iomapfs").ends_with("r 0.00 w 0.50 fl 0.25 · bytes r 0.00 w 1.00"),
            "{table}"
        );
        // The writeback figures: rows with writeback against raw's.
        let wb = table.split("writeback throughput").nth(1).expect(&table);
        let wb_line = |t: &str| {
            wb.lines()
                .find(|l| l.contains(&format!(" {t} ")))
                .unwrap_or_else(|| panic!("no {t} in {wb}"))
        };
        assert!(
            wb_line("iomapfs").contains(
                "112.5 MiB/s = 0.90 × raw seq-write of 125.0 MiB/s; \
                 its fsyncs alone wrote 250.0 MiB/s = 2.00 × raw"
            ),
            "{wb}"
        );
        assert!(wb_line("xfs").contains("0.45 × raw"), "{wb}");
        assert!(!wb_line("xfs").contains("fsyncs alone"), "{wb}");
        assert!(!wb.contains(" ext4 ") && !wb.contains(" raw  "), "{wb}");
    }

    #[test]
    fn cold_reads_are_shown_against_the_raw_devices_sequential_reads() {
        let read = |variant: &str, target: &str, iops: f64, raw: Option<f64>| BenchResult {
            workload: "buffered-read-64k".into(),
            ratio_to_raw_seq_read: raw,
            ..buffered(variant, target, iops)
        };
        let rows = vec![
            read("seq-read", "raw", 2_000.0, Some(1.0)),
            read("warm", "iomapfs", 100_000.0, None),
            read("cold", "iomapfs", 1_900.0, Some(0.95)),
            read("cold", "xfs", 1_600.0, Some(0.8)),
            read("cold", "ext4", 1_500.0, None),
        ];
        let table = render_table(&report(rows));
        let section = table.split("cold reads (").nth(1).expect(&table);
        let section = section.split("\n\n").next().unwrap();
        let line = |t: &str| {
            section
                .lines()
                .skip(1)
                .find(|l| l.split_whitespace().nth(2) == Some(t))
        };
        assert!(
            line("iomapfs").unwrap().contains(
                "cold             iomapfs      118.8 MiB/s = 0.95 × raw seq-read of 125.0 MiB/s"
            ),
            "{section}"
        );
        assert!(line("xfs").unwrap().contains("0.80 × raw"), "{section}");
        // Rows without the ratio (warm, no baseline) and raw itself are not
        // listed, and writes have no such section.
        assert!(line("ext4").is_none() && line("raw").is_none(), "{section}");
        assert!(!section.contains("warm"), "{section}");
        assert!(!table.contains("writeback throughput"), "{table}");
    }

    #[test]
    fn mount_rows_have_their_own_table_with_daemon_cpu_beside_fio_cpu() {
        let direct = result("raw", 400_000.0, Some(1.0));
        let mount = |target: &str, iops: f64| BenchResult {
            workload: "mount-randread-4k-qd1".into(),
            ..result(target, iops, None)
        };
        let mut fuse = mount("iomapfs-fuse", 100_000.0);
        fuse.cpu_per_io = cpu(3.0, super::super::CPU_SCOPE_FIO_PROCESS);
        fuse.daemon_cpu_per_io = cpu(5.25, super::super::CPU_SCOPE_FUSE_DAEMON);
        fuse.ratio_to_xfs = Some(0.4);
        fuse.cpu_ratio_to_xfs = Some(3.3);
        let mut xfs = mount("xfs", 250_000.0);
        xfs.cpu_per_io = cpu(2.5, super::super::CPU_SCOPE_FIO_PROCESS);
        xfs.ratio_to_xfs = Some(1.0);
        xfs.cpu_ratio_to_xfs = Some(1.0);
        let table = render_table(&report(vec![direct, fuse, xfs]));
        let headers: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("workload"))
            .collect();
        assert_eq!(headers.len(), 2, "{table}");
        let header = headers[1];
        assert!(
            !headers[0].contains("daemon") && header.contains("daemon"),
            "{table}"
        );
        let section = table.split(header).nth(1).expect(&table);
        let row = |t: &str| {
            section
                .lines()
                .find(|l| l.contains(&format!(" {t} ")))
                .unwrap_or_else(|| panic!("no {t} row in {table}"))
        };
        let cells = |t: &str| {
            (
                cell(header, row(t), "  ×xfs"),
                cell(header, row(t), "fio µs/IO"),
                cell(header, row(t), "daemon µs"),
                cell(header, row(t), "cpu µs/IO"),
                cell(header, row(t), "cpu ×xfs"),
            )
        };
        assert_eq!(
            cells("iomapfs-fuse"),
            ("0.40", "3.00", "5.25", "8.25", "3.30"),
            "{table}"
        );
        assert_eq!(
            cells("xfs"),
            ("1.00", "2.50", "-", "2.50", "1.00"),
            "{table}"
        );
        // The mount rows are not in the direct table.
        let direct_section = table.split(headers[0]).nth(1).unwrap();
        let direct_rows = direct_section
            .split("through the FUSE mount")
            .next()
            .unwrap();
        assert!(!direct_rows.contains("iomapfs-fuse"), "{table}");
    }
}
