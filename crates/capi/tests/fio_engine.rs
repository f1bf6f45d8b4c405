//! The fio engine (`fio-engine/`, built by `make -C fio-engine`, which
//! `.ci/run` does) driven by the installed fio on image files, with what
//! it wrote checked through the Rust API: direct jobs at queue depth 1 and
//! 32, buffered jobs, `verify=crc32c`, `fsync=`/`fdatasync=`,
//! `sync=dsync`, file layout with `overwrite=1` and
//! `allow_file_create=0`, several jobs sharing a file, and the errors a
//! user meets.
//!
//! The engine is `$IOMAPFS_FIO_ENGINE`, else
//! `fio-engine/build/libiomapfs_fio.so`. Without it, or without fio, these
//! tests say why and pass, unless `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use iomapfs_fs::{OpenFlags, Volume};

fn required() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// The engine and fio, or why the test cannot run.
fn engine() -> Option<PathBuf> {
    let path = std::env::var_os("IOMAPFS_FIO_ENGINE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fio-engine/build/libiomapfs_fio.so")
        });
    let fio = Command::new("fio").arg("--version").output().is_ok();
    let why = if !fio {
        "fio not found (apt-get install fio)".to_string()
    } else if !path.is_file() {
        format!("{} not built (make -C fio-engine)", path.display())
    } else {
        return Some(path);
    };
    assert!(
        !required(),
        "{why}, and IOMAPFS_REQUIRE_PRIVILEGED=1 (CI) needs it"
    );
    eprintln!("skipped: {why}");
    None
}

struct Bed {
    /// Holds the image, and is fio's working directory: fio saves verify
    /// state files (`local-*-verify.state`) there, not in the source tree.
    dir: tempfile::TempDir,
    image: PathBuf,
    engine: PathBuf,
}

impl Bed {
    /// A fresh 256 MiB image (formatted by the first job: iomapfs_mkfs=1).
    fn new() -> Option<Bed> {
        let engine = engine()?;
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("vol.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(256 << 20)
            .unwrap();
        Some(Bed { dir, image, engine })
    }

    /// Runs fio with the engine on the volume and `args`; returns (exit
    /// success, stdout + stderr).
    fn fio(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("fio")
            .current_dir(self.dir.path())
            .arg(format!("--ioengine=external:{}", self.engine.display()))
            .arg(format!("--iomapfs_volume={}", self.image.display()))
            .arg("--iomapfs_backend=sync")
            .args(args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// As [`Bed::fio`], which must succeed; returns fio's JSON report.
    fn fio_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--output-format=json"];
        all.extend_from_slice(args);
        let (ok, text) = self.fio(&all);
        assert!(ok, "fio {args:?} failed:\n{text}");
        let start = text.find('{').unwrap_or_else(|| panic!("no JSON:\n{text}"));
        let json: serde_json::Value = serde_json::Deserializer::from_str(&text[start..])
            .into_iter()
            .next()
            .unwrap()
            .unwrap();
        for job in json["jobs"].as_array().unwrap() {
            assert_eq!(job["error"], 0, "job failed: {job}");
        }
        json
    }

    fn mount(&self) -> Volume {
        let (dev, _) = blockdev::open_device(&self.image, false, blockdev::Backend::Sync).unwrap();
        Volume::open(Arc::clone(&dev)).unwrap()
    }
}

fn ios(json: &serde_json::Value, side: &str) -> u64 {
    json["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j[side]["total_ios"].as_u64().unwrap())
        .sum()
}

#[test]
fn direct_jobs_at_depth_1_and_32_write_where_fio_says_and_verify() {
    let Some(bed) = Bed::new() else { return };
    for depth in ["1", "32"] {
        let json = bed.fio_json(&[
            "--thread",
            "--iomapfs_mkfs=1",
            "--name=w",
            "--filename=/data",
            "--size=16m",
            "--rw=randwrite",
            "--bs=4k",
            "--direct=1",
            &format!("--iodepth={depth}"),
            "--verify=crc32c",
            "--do_verify=1",
        ]);
        // Every block written once, then read back and checked by fio.
        assert_eq!(ios(&json, "write"), 4096, "depth {depth}");
        assert_eq!(ios(&json, "read"), 4096, "depth {depth}");
    }
    // A known pattern through the engine, read back through the Rust API.
    bed.fio_json(&[
        "--thread",
        "--name=p",
        "--filename=/pattern",
        "--size=1m",
        "--rw=write",
        "--bs=64k",
        "--direct=1",
        "--iodepth=8",
        "--buffer_pattern=0x5a",
    ]);
    let vol = bed.mount();
    let f = vol.open_file("/pattern", OpenFlags::default()).unwrap();
    assert_eq!(f.stat().unwrap().size, 1 << 20);
    let mut back = vec![0u8; 1 << 20];
    assert_eq!(f.pread(&mut back, 0).unwrap(), 1 << 20);
    assert!(back.iter().all(|&b| b == 0x5a), "the bytes fio wrote");
    assert_eq!(vol.stat("/data").unwrap().size, 16 << 20);
    drop(f);
    vol.unmount().unwrap();
}

#[test]
fn buffered_jobs_with_fsync_and_dsync_jobs_with_fdatasync() {
    let Some(bed) = Bed::new() else { return };
    let json = bed.fio_json(&[
        "--thread",
        "--iomapfs_mkfs=1",
        "--name=b",
        "--filename=/buffered",
        "--size=8m",
        "--rw=write",
        "--bs=64k",
        "--direct=0",
        "--fsync=16",
        "--verify=crc32c",
    ]);
    let job = &json["jobs"][0];
    assert_eq!(job["write"]["total_ios"], 128);
    // 128 writes, an fsync after every 16 (fio issues none after the last).
    assert!(job["sync"]["lat_ns"]["N"].as_u64().unwrap() >= 7, "{job}");
    let json = bed.fio_json(&[
        "--thread",
        "--name=d",
        "--filename=/dsync",
        "--size=1m",
        "--rw=write",
        "--bs=4k",
        "--direct=1",
        "--sync=dsync",
        "--fdatasync=32",
        "--verify=crc32c",
    ]);
    let job = &json["jobs"][0];
    assert_eq!(job["write"]["total_ios"], 256);
    assert!(job["sync"]["lat_ns"]["N"].as_u64().unwrap() >= 7, "{job}");
    let vol = bed.mount();
    assert_eq!(vol.stat("/buffered").unwrap().size, 8 << 20);
    assert_eq!(vol.stat("/dsync").unwrap().size, 1 << 20);
    vol.unmount().unwrap();
}

#[test]
fn verify_crc32c_passes_with_several_direct_and_buffered_jobs() {
    let Some(bed) = Bed::new() else { return };
    // No --filename: each job has a file of its own (fio's "name.job.0"),
    // which fio writes, then reads back and checks.
    for (name, direct, depth) in [("vd", "1", "16"), ("vb", "0", "16"), ("vs", "1", "1")] {
        // Formatted by the first run only (each fio run is a process).
        let mkfs = if name == "vd" { "1" } else { "0" };
        let json = bed.fio_json(&[
            "--thread",
            &format!("--iomapfs_mkfs={mkfs}"),
            &format!("--name={name}"),
            "--numjobs=3",
            "--size=4m",
            "--rw=randwrite",
            "--bs=4k",
            &format!("--direct={direct}"),
            &format!("--iodepth={depth}"),
            "--verify=crc32c",
            "--do_verify=1",
        ]);
        assert_eq!(ios(&json, "write"), 3 * 1024, "{name}");
        assert_eq!(ios(&json, "read"), 3 * 1024, "{name}: every block verified");
    }
    let vol = bed.mount();
    for name in ["vd", "vb", "vs"] {
        for job in 0..3 {
            assert_eq!(vol.stat(&format!("/{name}.{job}.0")).unwrap().size, 4 << 20);
        }
    }
    vol.unmount().unwrap();
}

#[test]
fn buffered_jobs_reach_the_device_with_dsync_fdatasync_and_at_unmount() {
    let Some(bed) = Bed::new() else { return };
    for (name, pattern, extra) in [
        ("bd", "0x11", "--sync=dsync"),
        ("bf", "0x22", "--fdatasync=8"),
        ("bu", "0x33", "--end_fsync=0"),
    ] {
        let mkfs = if name == "bd" { "1" } else { "0" };
        let json = bed.fio_json(&[
            "--thread",
            &format!("--iomapfs_mkfs={mkfs}"),
            "--iomapfs_cache_size=32m",
            &format!("--name={name}"),
            &format!("--filename=/{name}"),
            "--size=2m",
            "--rw=write",
            "--bs=16k",
            "--direct=0",
            &format!("--buffer_pattern={pattern}"),
            extra,
        ]);
        assert_eq!(json["jobs"][0]["write"]["total_ios"], 128, "{name}");
        if name == "bf" {
            let syncs = json["jobs"][0]["sync"]["lat_ns"]["N"].as_u64().unwrap();
            assert!(syncs >= 15, "an fdatasync every 8 writes: {syncs}");
        }
    }
    // What the jobs wrote is on the device: read back after fio unmounted.
    let vol = bed.mount();
    for (name, byte) in [("/bd", 0x11u8), ("/bf", 0x22), ("/bu", 0x33)] {
        let f = vol.open_file(name, OpenFlags::default()).unwrap();
        let mut back = vec![0u8; 2 << 20];
        assert_eq!(f.pread(&mut back, 0).unwrap(), 2 << 20, "{name}");
        assert!(
            back.iter().all(|&b| b == byte),
            "{name}: the bytes fio wrote"
        );
    }
    vol.unmount().unwrap();
    // The cache size reaches the library, which checks it.
    let (ok, text) = bed.fio(&[
        "--thread",
        "--iomapfs_cache_size=1m",
        "--name=c",
        "--filename=/bu",
        "--size=2m",
        "--rw=read",
    ]);
    assert!(!ok && text.contains("cache_bytes 1048576"), "{text}");
}

#[test]
fn files_are_laid_out_as_fio_expects() {
    let Some(bed) = Bed::new() else { return };
    // allow_file_create=0 on a file that does not exist: fio's own error.
    let (ok, text) = bed.fio(&[
        "--thread",
        "--iomapfs_mkfs=1",
        "--name=n",
        "--filename=/missing",
        "--size=4m",
        "--rw=randwrite",
        "--bs=4k",
        "--direct=1",
        "--overwrite=1",
        "--allow_file_create=0",
    ]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("file creation disallowed by allow_file_create=0"),
        "{text}"
    );
    // overwrite=1: laid out whole before the job (fully written, so
    // overwrites are pure overwrites), shared by four jobs.
    let json = bed.fio_json(&[
        "--thread",
        "--name=o",
        "--filename=/shared",
        "--size=8m",
        "--rw=randwrite",
        "--bs=2k",
        "--direct=1",
        "--overwrite=1",
        "--numjobs=4",
        "--iodepth=16",
        "--number_ios=500",
    ]);
    assert_eq!(ios(&json, "write"), 2000);
    let vol = bed.mount();
    let st = vol.stat("/shared").unwrap();
    assert_eq!(st.size, 8 << 20);
    let f = vol.open_file("/shared", OpenFlags::default()).unwrap();
    let map = f.fiemap().unwrap();
    assert!(
        map.iter().all(|e| e.kind == iomapfs_fs::FiemapKind::Data),
        "laid out fully written: {map:?}"
    );
    drop(f);
    vol.unmount().unwrap();
    // Now it exists: allow_file_create=0 is fine, and reads need no layout.
    let json = bed.fio_json(&[
        "--thread",
        "--name=r",
        "--filename=/shared",
        "--size=8m",
        "--rw=randread",
        "--bs=4k",
        "--direct=1",
        "--iodepth=4",
        "--allow_file_create=0",
        "--number_ios=100",
    ]);
    assert_eq!(ios(&json, "read"), 100);
}

/// Jobs that end at once (`create_only=1`: fio lays the file out and the
/// jobs do no I/O) while others are still starting: the last job out
/// unmounts the volume, and no job may touch it after. The engine once
/// counted a job in only after looking the volume up, so a job ending in
/// between freed it under the next (heap corruption, fio aborted in 5 of
/// 6 runs of this).
#[test]
fn jobs_ending_while_others_start_never_use_a_freed_volume() {
    let Some(bed) = Bed::new() else { return };
    for run in 0..6 {
        let mkfs = if run == 0 { "1" } else { "0" };
        let (ok, text) = bed.fio(&[
            "--thread",
            &format!("--iomapfs_mkfs={mkfs}"),
            "--name=c",
            "--filename=/f",
            "--size=8m",
            "--rw=randwrite",
            "--bs=4k",
            "--direct=1",
            "--iodepth=16",
            "--overwrite=1",
            "--numjobs=8",
            "--create_only=1",
        ]);
        assert!(ok, "run {run}: {text}");
    }
    let vol = bed.mount();
    assert_eq!(vol.stat("/f").unwrap().size, 8 << 20, "laid out once");
    vol.unmount().unwrap();
}

#[test]
fn mistakes_get_clear_errors() {
    let Some(bed) = Bed::new() else { return };
    let (ok, text) = bed.fio(&[
        "--iomapfs_mkfs=1",
        "--name=p",
        "--filename=/f",
        "--size=1m",
        "--rw=read",
    ]);
    assert!(
        !ok && text.contains("jobs must be threads (--thread)"),
        "{text}"
    );
    let (ok, text) = bed.fio(&[
        "--thread",
        "--iomapfs_backend=fast",
        "--name=p",
        "--filename=/f",
        "--size=1m",
        "--rw=read",
    ]);
    assert!(
        !ok && text.contains("use auto, sync, uring or pool"),
        "{text}"
    );
    // Not formatted: the library's message reaches the user.
    let (ok, text) = bed.fio(&["--thread", "--name=p", "--filename=/f", "--size=1m"]);
    assert!(!ok && text.contains("cannot mount"), "{text}");
}
