//! `iomapfs fuse-transport-probe`: FUSE's /dev/fuse transport against FUSE
//! over io_uring on this machine, with a synthetic in-memory file system.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use iomapfs_mount::transport_probe::{self, ProbeConfig, ProbeReport, Transport, Workload};

use crate::Failure;

const LONG_ABOUT: &str = "\
Measure FUSE's two kernel transports on this machine: classic /dev/fuse
(read a request, write the reply) and FUSE over io_uring (per-CPU queues;
one io_uring_enter answers a request and waits for the next).

The probe mounts a tiny synthetic file system (a root directory and one
read-only file of a fixed pattern, served from memory; no iomapfs volume)
over each transport, then, from one thread at queue depth 1, in rounds that
alternate between the two mounts (so load from other processes falls on
both alike), times
  noop-getxattr    fgetxattr of a missing name: a round trip doing no work
  randread-4k-qd1  4 KiB O_DIRECT preads at random offsets (every read's
                   first and last words are checked against the pattern)
reporting IOPS, mean, p50 and p99 latency, CPU time of the whole process (client
and server threads) per operation, and how many requests travelled each way.

Root only. FUSE over io_uring needs kernel 6.14 or later built with
CONFIG_FUSE_IO_URING, and /sys/module/fuse/parameters/enable_uring on: the
probe turns it on for the io_uring mount when it is off and puts it back
right after the queues are registered (the connection keeps io_uring).";

const AFTER_HELP: &str = "\
Example:
  iomapfs fuse-transport-probe --runtime 5
  iomapfs fuse-transport-probe --transport io-uring --workload randread-4k-qd1";

/// Measure FUSE over /dev/fuse against FUSE over io_uring (root).
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct ProbeArgs {
    /// Seconds timed per workload and transport.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub runtime: f64,
    /// Rounds the run time is split into; rounds alternate between the
    /// transports, so load from other processes falls on both alike.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Transports to measure, in this order.
    #[arg(long = "transport", value_enum, value_delimiter = ',', default_values_t = vec![TransportArg::DevFuse, TransportArg::IoUring])]
    pub transports: Vec<TransportArg>,
    /// Workloads to time.
    #[arg(long = "workload", value_enum, value_delimiter = ',', default_values_t = vec![WorkloadArg::NoopGetxattr, WorkloadArg::Randread4kQd1])]
    pub workloads: Vec<WorkloadArg>,
    /// Answer opens with FOPEN_DIRECT_IO (as `iomapfs mount -o
    /// direct_io`). Without it the O_DIRECT preads still reach the server:
    /// the reads-per-I/O column shows it.
    #[arg(long)]
    pub fopen_direct_io: bool,
    /// Ring entries per io_uring queue.
    #[arg(long, default_value_t = 2)]
    pub queue_entries: usize,
    /// Set up the queues' rings without SINGLE_ISSUER | DEFER_TASKRUN.
    #[arg(long)]
    pub no_defer_taskrun: bool,
    /// Directory for the temporary mount points.
    #[arg(long, value_name = "DIR")]
    pub scratch_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TransportArg {
    DevFuse,
    IoUring,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum WorkloadArg {
    NoopGetxattr,
    #[value(name = "randread-4k-qd1")]
    Randread4kQd1,
}

pub fn run(args: &ProbeArgs) -> Result<u8, Failure> {
    if !(args.runtime > 0.0 && args.runtime.is_finite()) {
        return Err(Failure::new(
            2,
            "--runtime must be a positive number of seconds",
        ));
    }
    let mut cfg = ProbeConfig {
        transports: args
            .transports
            .iter()
            .map(|t| match t {
                TransportArg::DevFuse => Transport::DevFuse,
                TransportArg::IoUring => Transport::IoUring,
            })
            .collect(),
        workloads: args
            .workloads
            .iter()
            .map(|w| match w {
                WorkloadArg::NoopGetxattr => Workload::Noop,
                WorkloadArg::Randread4kQd1 => Workload::RandRead4k,
            })
            .collect(),
        runtime: Duration::from_secs_f64(args.runtime),
        rounds: args.rounds.max(1),
        fopen_direct_io: args.fopen_direct_io,
        queue_entries: args.queue_entries,
        defer_taskrun: !args.no_defer_taskrun,
        ..ProbeConfig::default()
    };
    if let Some(dir) = &args.scratch_dir {
        cfg.scratch_dir = dir.clone();
    }
    let report = transport_probe::run(&cfg).map_err(|e| Failure::new(1, e.to_string()))?;
    print_report(&report, &cfg);
    Ok(0)
}

fn print_report(report: &ProbeReport, cfg: &ProbeConfig) {
    println!(
        "FUSE transport probe: synthetic in-memory file, one client thread at QD 1, \
         {:.1} s per row in {} alternating rounds, opens {}",
        cfg.runtime.as_secs_f64(),
        cfg.rounds,
        if cfg.fopen_direct_io {
            "FOPEN_DIRECT_IO"
        } else {
            "without FOPEN_DIRECT_IO"
        }
    );
    if let Some(before) = &report.knob_before {
        println!(
            "io_uring: {} queues (possible CPUs), {} entries each, {}; {} was {before}{}",
            report.queues,
            cfg.queue_entries,
            if cfg.defer_taskrun {
                "SINGLE_ISSUER|DEFER_TASKRUN"
            } else {
                "plain rings"
            },
            iomapfs_mount::fuse_uring::ENABLE_URING_KNOB,
            if before == "Y" {
                ""
            } else {
                ", turned on for the io_uring mount and put back"
            }
        );
    }
    println!(
        "{:<16} {:<9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9}",
        "workload",
        "transport",
        "IOPS",
        "mean µs",
        "p50 µs",
        "p99 µs",
        "CPU µs/op",
        "READs/op",
        "via ring",
        "via dev"
    );
    for m in &report.measurements {
        println!(
            "{:<16} {:<9} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>9.2} {:>9} {:>9}",
            m.workload.name(),
            m.transport.name(),
            m.iops,
            m.mean_us,
            m.p50_us,
            m.p99_us,
            m.cpu_us_per_op,
            m.server_reads_per_op,
            m.ring_requests,
            m.dev_requests
        );
    }
    for workload in &cfg.workloads {
        let find = |t| {
            report
                .measurements
                .iter()
                .find(|m| m.workload == *workload && m.transport == t)
        };
        if let (Some(dev), Some(ring)) = (find(Transport::DevFuse), find(Transport::IoUring)) {
            let mut ratios: Vec<f64> = ring
                .round_iops
                .iter()
                .zip(&dev.round_iops)
                .map(|(r, d)| r / d)
                .collect();
            ratios.sort_by(f64::total_cmp);
            println!(
                "{}: io-uring/dev-fuse IOPS {:.2}x (rounds: median {:.2}x, {:.2}x..{:.2}x), \
                 CPU per op {:.2}x",
                workload.name(),
                ring.iops / dev.iops,
                ratios[ratios.len() / 2],
                ratios[0],
                ratios[ratios.len() - 1],
                ring.cpu_us_per_op / dev.cpu_us_per_op
            );
        }
    }
}
