//! `run()` on an image file with a tiny runtime: the JSON shape scripts rely
//! on, every requested workload measured on raw and iomapfs, ratios, and
//! device counters consistent with the workload. Needs no privileges.

use std::path::Path;
use std::time::Duration;

use iomapfs_bench::{run, Backend, BenchError, BenchOptions, NoProgress};
use serde_json::Value;

const DIRECT_WORKLOADS: [&str; 5] = [
    "randread-4k-qd1",
    "randread-4k-qd32",
    "overwrite-2k-unaligned",
    "dsync-overwrite-4k",
    "aio-overwrite-4k..16k-qd64",
];

/// One read and one write workload: every buffered variant and baseline.
const BUFFERED_WORKLOADS: [&str; 2] = ["buffered-read-4k", "buffered-write-64k"];

fn image(dir: &Path, bytes: u64) -> std::path::PathBuf {
    let path = dir.join("bench.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(bytes))
        .unwrap();
    path
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn image_file_run_reports_consistent_json() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), 128 << 20);
    let json_path = dir.path().join("report.json");
    let mut workloads: Vec<String> = DIRECT_WORKLOADS.iter().map(|s| s.to_string()).collect();
    workloads.extend(BUFFERED_WORKLOADS.map(String::from));
    let opts = BenchOptions {
        device: Some(img.clone()),
        runtime: Duration::from_millis(200),
        workloads,
        json: Some(json_path.clone()),
        no_kernel: true,
        ..BenchOptions::default()
    };
    let report = run(&opts, &NoProgress).unwrap();
    let table = iomapfs_bench::render_table(&report);
    eprintln!("{table}");

    let text = std::fs::read_to_string(&json_path).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();

    // machine
    let m = &v["machine"];
    for key in ["kernel", "device", "device_kind", "backend"] {
        assert!(m[key].is_string(), "machine.{key} missing: {m}");
    }
    for key in ["cpus", "memory_bytes", "logical_block_size"] {
        assert!(m[key].as_u64().is_some_and(|n| n > 0), "machine.{key}: {m}");
    }
    assert_eq!(m["device"], img.display().to_string());
    assert_eq!(m["device_kind"], "image file");
    let lbs = m["logical_block_size"].as_u64().unwrap();

    let results = v["results"].as_array().unwrap();
    let skipped = v["skipped"].as_array().unwrap();
    let find = |w: &str, t: &str| {
        results
            .iter()
            .find(|r| r["workload"] == w && r["target"] == t)
    };
    let skipped_reason = |w: &str, t: &str| {
        skipped
            .iter()
            .find(|s| s["workload"] == w && s["target"] == t)
            .map(|s| s["reason"].as_str().unwrap().to_string())
    };

    for w in DIRECT_WORKLOADS {
        if w == "overwrite-2k-unaligned" && lbs > 2048 {
            // The host file system's direct-I/O granularity is too coarse
            // for 2 KiB writes: reported as skipped, with why.
            for t in ["raw", "iomapfs"] {
                let reason = skipped_reason(w, t).expect("skip recorded");
                assert!(reason.contains("logical blocks"), "{reason}");
            }
            continue;
        }
        let raw = find(w, "raw").unwrap_or_else(|| {
            panic!(
                "{w}: no raw result; skipped: {:?}",
                skipped_reason(w, "raw")
            )
        });
        let fs = find(w, "iomapfs").unwrap_or_else(|| {
            panic!(
                "{w}: no iomapfs result; skipped: {:?}",
                skipped_reason(w, "iomapfs")
            )
        });
        for r in [raw, fs] {
            for key in [
                "iops",
                "bw_bytes",
                "lat_mean_ns",
                "lat_p99_ns",
                "ratio_to_raw",
            ] {
                assert!(num(r, key) > 0.0, "{w}/{}: {key} = {}", r["target"], r[key]);
            }
            assert!(num(r, "lat_p99_ns") >= num(r, "lat_mean_ns") * 0.5);
            assert!(r["command"].as_str().is_some_and(|c| !c.is_empty()));
            assert!(
                r["backend"] == "sync" || r["backend"] == "uring",
                "{w}: backend {}",
                r["backend"]
            );
            let req = &r["device_requests"];
            for key in ["reads", "writes", "fua_writes", "flushes"] {
                assert!(req[key].is_u64(), "{w}: device_requests.{key}: {req}");
            }
            let ops = r["ops"].as_u64().unwrap();
            assert!(ops > 0);
            // Bandwidth and IOPS describe the same I/Os (up to rounding).
            let per_io = num(r, "bw_bytes") / num(r, "iops");
            assert!(
                (2047.99..=16384.01).contains(&per_io),
                "{w}: {per_io} bytes per I/O"
            );
            if w.starts_with("randread") {
                assert!(
                    req["reads"].as_u64().unwrap() >= ops,
                    "{w}: {req} for {ops}"
                );
            } else {
                assert!(
                    req["writes"].as_u64().unwrap() >= ops,
                    "{w}: {req} for {ops}"
                );
            }
        }
        assert_eq!(num(raw, "ratio_to_raw"), 1.0);
        let expect = num(fs, "iops") / num(raw, "iops");
        assert!(
            (num(fs, "ratio_to_raw") - expect).abs() <= 1e-9 * expect,
            "{w}: ratio {} vs {expect}",
            fs["ratio_to_raw"]
        );
        // CPU per I/O: user + system of the whole process, split too, and
        // the ratio is against raw's.
        for r in [raw, fs] {
            let cpu = &r["cpu_per_io"];
            assert_eq!(cpu["scope"], "process", "{w}: {cpu}");
            assert!(num(cpu, "total_us") > 0.0, "{w}: {cpu}");
            let parts = num(cpu, "user_us") + num(cpu, "system_us");
            assert!((parts - num(cpu, "total_us")).abs() < 1e-9, "{w}: {cpu}");
            assert!(num(cpu, "io_threads_us") > 0.0, "{w}: {cpu}");
            assert!(r.get("cpu_note").is_none(), "{w}: {}", r["cpu_note"]);
        }
        assert_eq!(num(raw, "cpu_ratio_to_raw"), 1.0);
        let expect = num(&fs["cpu_per_io"], "total_us") / num(&raw["cpu_per_io"], "total_us");
        assert!(
            (num(fs, "cpu_ratio_to_raw") - expect).abs() <= 1e-9 * expect,
            "{w}: cpu ratio {} vs {expect}",
            fs["cpu_ratio_to_raw"]
        );
        // No kernel targets with --no-kernel, and the skip says so.
        for t in ["xfs", "ext4"] {
            assert!(find(w, t).is_none());
            let reason = skipped_reason(w, t).unwrap();
            assert!(reason.contains("no-kernel"), "{reason}");
        }
    }

    // DSYNC on a volatile-cache device (image files always are): every write
    // is made durable by a FUA write or a flush.
    let w = "dsync-overwrite-4k";
    for t in ["raw", "iomapfs"] {
        let r = find(w, t).unwrap();
        let ops = r["ops"].as_u64().unwrap();
        let req = &r["device_requests"];
        let count = |k: &str| req[k].as_u64().unwrap();
        assert!(count("writes") >= ops, "{t}: {req} for {ops} ops");
        assert!(
            count("flushes") + count("fua_writes") >= ops,
            "{t}: {req} for {ops} DSYNC writes"
        );
        assert!(count("fua_writes") <= count("writes"));
        let per_op = &r["requests_per_op"];
        assert!((num(per_op, "writes") - count("writes") as f64 / ops as f64).abs() < 1e-9);
    }

    check_buffered(results, skipped);
    assert!(table.contains("×memcpy") && table.contains("writeback throughput"));
    assert!(table.contains("randread-4k-qd1") && table.contains("iomapfs"));
    assert!(table.contains("cpu ×raw") && table.contains("cpu µs/IO"));
    assert!(!table.contains("no CPU figure"), "{table}");

    // The device is left blank, so a second run needs no --force.
    let head = std::fs::read(&img).unwrap();
    assert!(iomapfs_bench::recognise(&head[..4096]).is_none());
    let again = BenchOptions {
        workloads: vec!["randread-4k-qd1".into()],
        json: None,
        runtime: Duration::from_millis(50),
        ..opts
    };
    run(&again, &NoProgress).unwrap();
}

/// The buffered rows of an image-file run without kernel targets: the
/// memcpy ceiling and raw sequential reads or writes, iomapfs in every
/// variant, each with its ratios to the baselines that ran, and device
/// traffic showing each arrangement (cold reads read the device, +fsync
/// windows write back and flush every pass).
fn check_buffered(results: &[Value], skipped: &[Value]) {
    let find = |w: &str, variant: &str, t: &str| {
        results
            .iter()
            .find(|r| r["workload"] == w && r["variant"] == variant && r["target"] == t)
            .unwrap_or_else(|| panic!("no {w} {variant} {t} in {results:?}; skipped {skipped:?}"))
    };
    let u = |v: &Value, key: &str| {
        v[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} is not a count in {v}"))
    };
    for (w, io_size, variants) in [
        ("buffered-read-4k", 4096.0, &["warm", "cold"][..]),
        (
            "buffered-write-64k",
            65536.0,
            &["overwrite", "overwrite+fsync", "alloc", "alloc+fsync"][..],
        ),
    ] {
        let memcpy = find(w, "ceiling", "memcpy");
        assert_eq!(num(memcpy, "ratio_to_memcpy"), 1.0);
        let memcpy_bw = num(memcpy, "bw_bytes");
        let (raw_variant, raw_ratio, raw_io_size) = if w.contains("write") {
            ("seq-write", "ratio_to_raw_seq_write", 1048576.0)
        } else {
            ("seq-read", "ratio_to_raw_seq_read", 2097152.0)
        };
        let raw = find(w, raw_variant, "raw");
        assert!((num(raw, "bw_bytes") / num(raw, "iops") - raw_io_size).abs() < 1e-3);
        assert_eq!(num(raw, raw_ratio), 1.0);
        let raw_bw = num(raw, "bw_bytes");
        for r in std::iter::once(memcpy).chain(variants.iter().map(|v| find(w, v, "iomapfs"))) {
            let what = format!("{w} {} {}", r["variant"], r["target"]);
            for key in ["iops", "bw_bytes", "lat_mean_ns", "lat_p99_ns"] {
                assert!(num(r, key) > 0.0, "{what}: {key} = {}", r[key]);
            }
            assert!(
                (num(r, "bw_bytes") / num(r, "iops") - io_size).abs() < 1e-6 * io_size,
                "{what}: {} bytes per I/O",
                num(r, "bw_bytes") / num(r, "iops")
            );
            let cpu = &r["cpu_per_io"];
            assert_eq!(cpu["scope"], "process", "{what}: {cpu}");
            assert!(num(cpu, "total_us") > 0.0, "{what}: {cpu}");
            // Buffered rows are compared with xfs and memcpy, never raw's
            // direct figures; without kernel targets, there is no xfs.
            assert!(r["ratio_to_raw"].is_null(), "{what}: {}", r["ratio_to_raw"]);
            assert!(r.get("ratio_to_xfs").is_none(), "{what}");
            let expect = num(r, "bw_bytes") / memcpy_bw;
            assert!(
                (num(r, "ratio_to_memcpy") - expect).abs() <= 1e-9 * expect,
                "{what}: ×memcpy {} vs {expect}",
                r["ratio_to_memcpy"]
            );
        }
        for v in variants {
            let r = find(w, v, "iomapfs");
            let what = format!("{w} {v}");
            let ops = u(r, "ops");
            let passes = u(r, "passes");
            assert!(
                ops > 0 && passes > 0,
                "{what}: {ops} ops in {passes} passes"
            );
            assert!(
                r["command"].as_str().unwrap().contains("non-direct"),
                "{what}"
            );
            let req = &r["device_requests"];
            let bytes = ops * io_size as u64;
            if *v == "cold" {
                // The cache was empty at the start of every pass.
                assert!(u(req, "bytes_read") >= bytes, "{what}: {req} for {bytes}");
                let expect = num(r, "bw_bytes") / raw_bw;
                assert!(
                    (num(r, "ratio_to_raw_seq_read") - expect).abs() <= 1e-9 * expect,
                    "{what}: {} vs {expect}",
                    r["ratio_to_raw_seq_read"]
                );
            } else {
                assert!(r.get("ratio_to_raw_seq_read").is_none(), "{what}");
            }
            if v.ends_with("+fsync") {
                // Every pass, the last one too, ended in an fsync, which
                // wrote back what the pass wrote and flushed the device.
                assert!(
                    u(req, "flushes") >= passes,
                    "{what}: {req} for {passes} passes"
                );
                assert!(
                    u(req, "bytes_written") >= bytes,
                    "{what}: {req} for {bytes}"
                );
                let expect = num(r, "bw_bytes") / raw_bw;
                assert!(
                    (num(r, "ratio_to_raw_seq_write") - expect).abs() <= 1e-9 * expect,
                    "{what}: {} vs {expect}",
                    r["ratio_to_raw_seq_write"]
                );
            } else {
                assert!(r.get("ratio_to_raw_seq_write").is_none(), "{what}");
            }
        }
        // Kernel targets: skipped once per workload, saying why.
        for t in ["xfs", "ext4"] {
            let s = skipped
                .iter()
                .find(|s| s["workload"] == w && s["target"] == t)
                .unwrap_or_else(|| panic!("{w} {t} not reported skipped"));
            assert!(s["reason"].as_str().unwrap().contains("no-kernel"), "{s}");
            assert!(s.get("variant").is_none(), "{s}");
        }
    }
    assert!(
        !skipped.iter().any(|s| {
            let buffered = BUFFERED_WORKLOADS.iter().any(|w| s["workload"] == *w);
            buffered
                && ["iomapfs", "memcpy", "raw"]
                    .iter()
                    .any(|t| s["target"] == *t)
        }),
        "{skipped:?}"
    );
}

/// Both engine drivers: threads (sync backend) and one queue (io_uring),
/// with the same accounting.
#[test]
fn sync_and_uring_backends_both_measure() {
    for backend in [Backend::Sync, Backend::Uring] {
        let dir = tempfile::tempdir().unwrap();
        let img = image(dir.path(), 128 << 20);
        let opts = BenchOptions {
            device: Some(img),
            runtime: Duration::from_millis(150),
            workloads: vec![
                "randread-4k-qd32".into(),
                "dsync-overwrite-4k".into(),
                "aio-overwrite-4k..16k-qd64".into(),
            ],
            no_kernel: true,
            backend,
            ..BenchOptions::default()
        };
        let report = match run(&opts, &NoProgress) {
            Ok(r) => r,
            Err(e) if backend == Backend::Uring && e.to_string().contains("io_uring") => {
                eprintln!("skipped io_uring: {e}");
                continue;
            }
            Err(e) => panic!("{backend}: {e}"),
        };
        assert!(
            report
                .skipped
                .iter()
                .all(|s| s.target != "raw" && s.target != "iomapfs"),
            "{backend}: {:?}",
            report.skipped
        );
        assert_eq!(report.results.len(), 6, "{backend}");
        for r in &report.results {
            assert_eq!(r.backend, backend.as_str());
            let ops = r.ops.unwrap();
            assert!(ops > 0 && r.iops > 0.0);
            let req = r.device_requests.unwrap();
            if r.workload == "dsync-overwrite-4k" {
                assert!(
                    req.writes >= ops && req.flushes + req.fua_writes >= ops,
                    "{backend}: {req:?} for {ops}"
                );
            }
            let per_io = r.bw_bytes / r.iops;
            assert!(
                (4095.99..=16384.01).contains(&per_io),
                "{backend} {}: {per_io}",
                r.workload
            );
        }
    }
}

#[test]
fn bad_options_and_devices_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), 128 << 20);
    let base = BenchOptions {
        device: Some(img.clone()),
        runtime: Duration::from_millis(50),
        no_kernel: true,
        ..BenchOptions::default()
    };

    let err = run(
        &BenchOptions {
            workloads: vec!["randread-4k-qd7".into()],
            ..base.clone()
        },
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, BenchError::UnknownWorkload { .. }));
    assert!(err.to_string().contains("randread-4k-qd32"), "{err}");

    let err = run(
        &BenchOptions {
            runtime: Duration::ZERO,
            ..base.clone()
        },
        &NoProgress,
    )
    .unwrap_err();
    assert!(err.to_string().contains("runtime"), "{err}");

    // An XFS superblock: refused without --force, and nothing is written.
    let mut bytes = vec![0u8; 4096];
    bytes[..4].copy_from_slice(b"XFSB");
    std::fs::write(&img, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let err = run(&base, &NoProgress).unwrap_err();
    assert!(matches!(err, BenchError::DeviceRefused { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("XFS") && msg.contains("--force"), "{msg}");
    assert_eq!(&std::fs::read(&img).unwrap()[..4], b"XFSB");

    // With --force it runs.
    let forced = BenchOptions {
        force: true,
        workloads: vec!["randread-4k-qd1".into()],
        ..base
    };
    let report = run(&forced, &NoProgress).unwrap();
    assert_eq!(report.results.len(), 2);
}
