//! Report values for the tests of the JSON shape and the table.

use super::*;

pub fn result(target: &str, iops: f64, ratio: Option<f64>) -> BenchResult {
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
        ..BenchResult::default()
    }
}

pub fn cpu(total_us: f64, scope: &str) -> Option<CpuPerIo> {
    Some(CpuPerIo {
        total_us,
        user_us: total_us / 4.0,
        system_us: total_us * 3.0 / 4.0,
        scope: scope.into(),
        io_threads_us: None,
    })
}

pub fn report(results: Vec<BenchResult>) -> BenchReport {
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
        metadata_scale: Vec::new(),
    }
}
