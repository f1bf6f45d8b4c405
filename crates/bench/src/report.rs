//! The run's results: the JSON shape scripts rely on, and the table people
//! read.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// Everything a run measured and why anything was not.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub machine: Machine,
    pub settings: Settings,
    pub results: Vec<BenchResult>,
    pub skipped: Vec<Skipped>,
    /// How the bed was chosen, teardown problems, and other remarks.
    pub notes: Vec<String>,
}

/// Where the run happened.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    /// `uname -r`.
    pub kernel: String,
    pub cpus: usize,
    pub memory_bytes: u64,
    /// The device(s) measured on, comma-separated (details in `devices`).
    pub device: String,
    /// Their kinds, in the same order.
    pub device_kind: String,
    /// Logical block size of the first device.
    pub logical_block_size: u32,
    /// The I/O backend of raw and iomapfs targets.
    pub backend: String,
    pub devices: Vec<DeviceInfo>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub path: String,
    /// "zram", "loop (tmpfs file)", "block device" or "image file".
    pub kind: String,
    pub logical_block_size: u32,
    pub size_bytes: u64,
    pub volatile_write_cache: bool,
    pub fua: bool,
    /// Data I/O bypasses the host page cache.
    pub direct_io: bool,
    /// The backend raw and iomapfs use on it, and why it was chosen.
    pub backend: String,
    /// The file behind a loop device (removed after the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_file: Option<String>,
}

/// How long each target ran and how queue depth was produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub runtime_s: f64,
    pub warmup_s: f64,
    /// How queue depth is produced for each backend.
    pub queue_model: String,
}

/// One workload on one target.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    pub workload: String,
    /// "raw", "iomapfs", "xfs" or "ext4".
    pub target: String,
    /// Device path it ran on.
    pub device: String,
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat_mean_ns: f64,
    pub lat_p99_ns: f64,
    /// `iops / raw iops` of the same workload (1 for raw itself).
    pub ratio_to_raw: Option<f64>,
    /// Device requests during the measured window (raw and iomapfs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_requests: Option<DeviceRequests>,
    /// `device_requests` divided by `ops`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_op: Option<RequestsPerOp>,
    /// I/Os measured (raw and iomapfs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<u64>,
    /// "sync" or "uring" for raw and iomapfs; "kernel" for fio targets.
    pub backend: String,
    /// What ran: the fio command line for kernel targets; the engine's
    /// parameters for raw and iomapfs.
    pub command: String,
    /// Preparation that ran before `command` (mkfs and mount for kernel
    /// targets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRequests {
    pub reads: u64,
    /// Every write, FUA or not.
    pub writes: u64,
    /// The writes sent with FUA.
    pub fua_writes: u64,
    pub flushes: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestsPerOp {
    pub reads: f64,
    pub writes: f64,
    pub fua_writes: f64,
    pub flushes: f64,
}

/// A workload × target that was not measured, and why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Skipped {
    pub workload: String,
    pub target: String,
    pub reason: String,
}

/// Machine facts that do not depend on the run.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

pub fn memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

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

/// The report as a table: one row per workload × target with IOPS, MiB/s,
/// mean and p99 latency, ratio to raw, and device requests per I/O where
/// known; then what was skipped and the notes.
pub fn render_table(report: &BenchReport) -> String {
    let mut out = String::new();
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
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<28} {:<8} {:>9} {:>9} {:>9} {:>9} {:>6}  device req/IO",
        "workload", "target", "IOPS", "MiB/s", "mean µs", "p99 µs", "×raw"
    );
    let mut last = "";
    for r in &report.results {
        let name = if r.workload == last { "" } else { &r.workload };
        last = &r.workload;
        let ratio = r.ratio_to_raw.map_or("-".into(), |x| format!("{x:.2}"));
        let reqs = r.requests_per_op.as_ref().map_or(String::new(), per_op);
        let line = format!(
            "{:<28} {:<8} {:>9} {:>9.1} {:>9} {:>9} {:>6}  {}",
            name,
            r.target,
            si(r.iops),
            r.bw_bytes / f64::from(1u32 << 20),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio,
            reqs
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
    if report
        .results
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
    if !report.skipped.is_empty() {
        let _ = writeln!(out, "\nnot measured:");
        // Group targets sharing a workload and reason onto one line.
        let mut groups: Vec<(&str, &str, Vec<&str>)> = Vec::new();
        for s in &report.skipped {
            match groups
                .iter_mut()
                .find(|(w, why, _)| *w == s.workload && *why == s.reason)
            {
                Some(g) => g.2.push(&s.target),
                None => groups.push((&s.workload, &s.reason, vec![&s.target])),
            }
        }
        for (workload, reason, targets) in groups {
            let _ = writeln!(out, "  {workload} [{}]: {reason}", targets.join(", "));
        }
    }
    if !report.notes.is_empty() {
        let _ = writeln!(out, "\nnotes:");
        for n in &report.notes {
            let _ = writeln!(out, "  {n}");
        }
    }
    out
}
