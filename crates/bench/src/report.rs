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
    /// CPU time per I/O in the measured window; `None` with `cpu_note`
    /// saying why.
    #[serde(default)]
    pub cpu_per_io: Option<CpuPerIo>,
    /// `cpu_per_io.total_us / raw's` of the same workload (1 for raw
    /// itself): below 1 is less CPU per I/O than the raw device.
    #[serde(default)]
    pub cpu_ratio_to_raw: Option<f64>,
    /// Why `cpu_per_io` is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_note: Option<String>,
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

/// User and system CPU time per I/O, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuPerIo {
    /// `user_us + system_us`.
    pub total_us: f64,
    pub user_us: f64,
    pub system_us: f64,
    /// Whose CPU time: [`CPU_SCOPE_PROCESS`] (raw, iomapfs) or
    /// [`CPU_SCOPE_FIO`] (xfs, ext4).
    pub scope: String,
    /// Of `total_us`, the part spent in the threads that issued the I/O
    /// (raw and iomapfs); the rest ran in other threads of the process,
    /// such as iomapfs's completion worker and io_uring's io-wq workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_threads_us: Option<f64>,
}

/// [`CpuPerIo::scope`] of raw and iomapfs.
pub const CPU_SCOPE_PROCESS: &str = "process";
/// [`CpuPerIo::scope`] of fio-measured targets.
pub const CPU_SCOPE_FIO: &str = "fio job threads";

/// What "cpu µs/IO" counts, for the report's notes.
pub const CPU_NOTE: &str = "cpu µs/IO is user + system CPU time per I/O in the measured window \
     (not warm-up, prefill or setup), and cpu ×raw that over raw's (below 1: less CPU per I/O \
     than raw). raw and iomapfs: the whole bench process (getrusage RUSAGE_SELF), so also \
     iomapfs's completion worker and io_uring's io-wq workers, which are threads of the \
     process; the bench's other threads sleep. xfs and ext4: fio's usr_cpu + sys_cpu, its job \
     threads only (RUSAGE_THREAD): all of the in-process work with psync, not io-wq work with \
     io_uring. Kernel work outside the process is in neither: a loop device's workers (its \
     reads and writes of the backing file) and block completions in softirq or kblockd, about \
     as much CPU again on the loop device, where cpu µs/IO is thus mostly the submitting side; \
     zram does its work in the submitting thread, where it is counted.";

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
/// mean and p99 latency, ratio to raw, CPU per I/O and its ratio to raw,
/// and device requests per I/O where known; then what was skipped, why CPU
/// figures are missing, and the notes.
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
        "{:<28} {:<8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9}  device req/IO",
        "workload", "target", "IOPS", "MiB/s", "mean µs", "p99 µs", "×raw", "cpu ×raw", "cpu µs/IO"
    );
    let mut last = "";
    for r in &report.results {
        let name = if r.workload == last { "" } else { &r.workload };
        last = &r.workload;
        let ratio = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}"));
        let cpu = r
            .cpu_per_io
            .as_ref()
            .map_or("-".into(), |c| micros(c.total_us * 1e3));
        let reqs = r.requests_per_op.as_ref().map_or(String::new(), per_op);
        let line = format!(
            "{:<28} {:<8} {:>9} {:>9.1} {:>9} {:>9} {:>6} {:>8} {:>9}  {}",
            name,
            r.target,
            si(r.iops),
            r.bw_bytes / f64::from(1u32 << 20),
            micros(r.lat_mean_ns),
            micros(r.lat_p99_ns),
            ratio(r.ratio_to_raw),
            ratio(r.cpu_ratio_to_raw),
            cpu,
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
    let no_cpu: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| r.cpu_per_io.is_none())
        .collect();
    if !no_cpu.is_empty() {
        let _ = writeln!(out, "\nno CPU figure:");
        // Group by reason: one line per reason, its workload × targets.
        let mut groups: Vec<(&str, Vec<String>)> = Vec::new();
        for r in no_cpu {
            let reason = r.cpu_note.as_deref().unwrap_or("not measured");
            let which = format!("{} · {}", r.workload, r.target);
            match groups.iter_mut().find(|(why, _)| *why == reason) {
                Some(g) => g.1.push(which),
                None => groups.push((reason, vec![which])),
            }
        }
        for (reason, which) in groups {
            let _ = writeln!(out, "  {reason} [{}]", which.join(", "));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn result(target: &str, iops: f64, ratio: Option<f64>) -> BenchResult {
        BenchResult {
            workload: "randread-4k-qd1".into(),
            target: target.into(),
            device: "/dev/zram0".into(),
            iops,
            bw_bytes: iops * 4096.0,
            lat_mean_ns: 2500.0,
            lat_p99_ns: 4000.0,
            ratio_to_raw: ratio,
            cpu_per_io: None,
            cpu_ratio_to_raw: None,
            cpu_note: None,
            device_requests: None,
            requests_per_op: None,
            ops: Some(1000),
            backend: "sync".into(),
            command: "engine".into(),
            setup: None,
        }
    }

    fn cpu(total_us: f64, scope: &str) -> Option<CpuPerIo> {
        Some(CpuPerIo {
            total_us,
            user_us: total_us / 4.0,
            system_us: total_us * 3.0 / 4.0,
            scope: scope.into(),
            io_threads_us: None,
        })
    }

    fn report(results: Vec<BenchResult>) -> BenchReport {
        BenchReport {
            machine: Machine {
                kernel: "6.18".into(),
                cpus: 2,
                memory_bytes: 4 << 30,
                device: "/dev/zram0".into(),
                device_kind: "zram".into(),
                logical_block_size: 4096,
                backend: "sync".into(),
                devices: Vec::new(),
            },
            settings: Settings {
                runtime_s: 3.0,
                warmup_s: 0.3,
                queue_model: String::new(),
            },
            results,
            skipped: Vec::new(),
            notes: Vec::new(),
        }
    }

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

    #[test]
    fn cpu_fields_round_trip_through_json() {
        let mut r = result("iomapfs", 1.0, None);
        r.cpu_per_io = cpu(8.0, CPU_SCOPE_PROCESS);
        r.cpu_ratio_to_raw = Some(2.0);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["cpu_per_io"]["total_us"], 8.0);
        assert_eq!(v["cpu_per_io"]["user_us"], 2.0);
        assert_eq!(v["cpu_per_io"]["system_us"], 6.0);
        assert_eq!(v["cpu_per_io"]["scope"], "process");
        assert_eq!(v["cpu_ratio_to_raw"], 2.0);
        assert!(v.get("cpu_note").is_none());
        let back: BenchResult = serde_json::from_value(v).unwrap();
        assert_eq!(back.cpu_per_io, r.cpu_per_io);
        // Reports written before CPU was measured still load.
        let mut old = serde_json::to_value(result("raw", 1.0, None)).unwrap();
        let obj = old.as_object_mut().unwrap();
        obj.remove("cpu_per_io");
        obj.remove("cpu_ratio_to_raw");
        let back: BenchResult = serde_json::from_value(old).unwrap();
        assert!(back.cpu_per_io.is_none());
    }
}
