//! The run's results: the JSON shape scripts rely on (here), and the table
//! people read (`table`).

#[cfg(test)]
mod fixtures;
mod table;

pub use table::render_table;

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
    /// The `metadata-scale` workloads, one entry per extent count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metadata_scale: Vec<crate::MetadataScaleResult>,
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
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BenchResult {
    pub workload: String,
    /// Which arrangement of a buffered workload this row measured: "warm",
    /// "cold" (reads); "overwrite", "overwrite+fsync", "alloc",
    /// "alloc+fsync" (writes); and the baselines "ceiling" (memcpy) and
    /// "seq-read" and "seq-write" (raw). Absent for direct workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    /// "raw", "iomapfs", "xfs", "ext4", or "memcpy" (buffered workloads'
    /// ceiling: the same bytes copied between two buffers in memory).
    pub target: String,
    /// Device path it ran on.
    pub device: String,
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat_mean_ns: f64,
    pub lat_p99_ns: f64,
    /// `iops / raw iops` of the same workload (1 for raw itself). Direct
    /// workloads only: buffered ones are compared with XFS and memcpy.
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
    /// Buffered workloads and fio rows: `iops / xfs iops` of the same
    /// workload (and variant) (1 for xfs itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_xfs: Option<f64>,
    /// Buffered workloads: `cpu_per_io.total_us / xfs's` of the same
    /// workload and variant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ratio_to_xfs: Option<f64>,
    /// Buffered workloads: `bw_bytes / memcpy's bw_bytes` of the same
    /// workload (the memory-bandwidth ceiling; 1 for memcpy itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_memcpy: Option<f64>,
    /// Buffered writes whose window includes writeback (the `+fsync`
    /// variants): `bw_bytes / bw_bytes` of the raw device's sequential
    /// 1 MiB direct writes (the "seq-write" row, 1 for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_raw_seq_write: Option<f64>,
    /// The `+fsync` variants on iomapfs: bytes the device wrote during the
    /// fsyncs ending the passes, per second of those fsyncs — the
    /// writeback's own throughput, without the copying into the cache
    /// that `bw_bytes` also pays for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsync_write_bw_bytes: Option<f64>,
    /// `fsync_write_bw_bytes` over the raw device's sequential writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsync_write_ratio_to_raw_seq_write: Option<f64>,
    /// Cold buffered reads (every byte read from the device): `bw_bytes /
    /// bw_bytes` of the raw device's sequential 2 MiB direct reads at
    /// queue depth 2 (the "seq-read" row, 1 for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_raw_seq_read: Option<f64>,
    /// Device requests during the measured window (raw and iomapfs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_requests: Option<DeviceRequests>,
    /// `device_requests` divided by `ops`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_op: Option<RequestsPerOp>,
    /// I/Os measured (raw, iomapfs, memcpy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<u64>,
    /// Buffered workloads on iomapfs: passes over the file the window
    /// made (the last may be cut short by the end of the window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passes: Option<u64>,
    /// "sync" or "uring" for raw and iomapfs; "kernel" for fio targets.
    pub backend: String,
    /// What ran: the fio command line for kernel targets; the engine's
    /// parameters for raw and iomapfs.
    pub command: String,
    /// Preparation that ran before `command` (mkfs and mount for kernel
    /// targets; for fio rows also the fio runs that laid the file out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// "fio" for fio rows: every target of the workload was measured by
    /// fio (iomapfs through the fio engine), `command` holds the exact fio
    /// command lines, and `ratio_to_xfs` is IOPS over xfs's row. Absent
    /// for the engine's rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub harness: Option<String>,
    /// Mount rows through the FUSE mount: CPU time per I/O of the daemon
    /// serving it (`cpu_per_io` is fio's, the client's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_cpu_per_io: Option<CpuPerIo>,
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
/// [`CpuPerIo::scope`] of fio rows: the whole fio process (wait4), with
/// its job threads' share in `io_threads_us`.
pub const CPU_SCOPE_FIO_PROCESS: &str = "fio process";
/// [`CpuPerIo::scope`] of the FUSE daemon's CPU in mount rows: the bench
/// process, which serves the mount, over the measured run.
pub const CPU_SCOPE_FUSE_DAEMON: &str = "FUSE daemon (bench process)";

/// Workload names of the mount rows start with this (they have a table of
/// their own).
pub const MOUNT_ROW_PREFIX: &str = "mount-";

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
    #[serde(default)]
    pub bytes_read: u64,
    #[serde(default)]
    pub bytes_written: u64,
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
    /// The buffered variant, when only that one was not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
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

#[cfg(test)]
mod tests {
    use super::fixtures::{cpu, result};
    use super::*;

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
