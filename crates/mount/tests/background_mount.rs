//! A mount served by this process ([`iomapfs_mount::spawn`]) ends cleanly
//! when it is unmounted right after reads: readahead and RELEASE the kernel
//! still has queued race the unmount, and a server thread that was taking
//! one off the queue when the connection shut down must count that as the
//! end of the session, not as its failure. Needs root and /dev/fuse; skips
//! with the reason elsewhere, and fails instead under
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use blockdev::{BlockDevice, MemDevice};
use iomapfs_fs::{FormatOptions, Volume};
use iomapfs_mount::MountConfig;

fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root: the test mounts with mount(2)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse (modprobe fuse)".into());
    }
    None
}

/// Not a multiple of the page size, and larger than one readahead window.
const FILE_BYTES: usize = (1 << 20) + 777;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// Taken by each test: one test's mount threads must not show in
/// another's look at this process's threads.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether to skip for `reason` (printed); under
/// `IOMAPFS_REQUIRE_PRIVILEGED=1` a reason fails the test instead.
fn skip(reason: Option<String>) -> bool {
    let Some(reason) = reason else {
        return false;
    };
    if std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1") {
        panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
    }
    eprintln!("skipped: {reason}");
    true
}

#[test]
fn unmounting_right_after_reads_ends_the_session_cleanly() {
    if skip(unavailable()) {
        return;
    }
    let _turn = one_at_a_time();
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(64 << 20, 4096));
    Volume::format(dev.clone(), &FormatOptions::default()).expect("format");
    let dir = tempfile::tempdir().expect("mount point");
    let cfg = MountConfig::default();
    let want = pattern(FILE_BYTES);
    {
        let vol = Volume::open(dev.clone()).expect("open");
        let mount = iomapfs_mount::spawn(vol, dir.path(), &cfg).expect("mount");
        std::fs::write(mount.path().join("data"), &want).expect("write through the mount");
        mount.unmount().expect("first unmount");
    }
    // Before the fix about one unmount in 1500 met a request mid-read (one
    // run of this test in five failed); the deterministic check of the
    // rule is `connection_ended`'s unit test, and the transport probe's
    // server, where the race is ten times likelier, has its own.
    for round in 0..300 {
        let vol = Volume::open(dev.clone()).expect("open");
        let mount = iomapfs_mount::spawn(vol, dir.path(), &cfg).expect("mount");
        let mut file = std::fs::File::open(mount.path().join("data")).expect("open the file");
        let mut head = vec![0u8; 10_007];
        file.read_exact(&mut head).expect("read");
        assert!(head == want[..head.len()], "round {round}: bytes read");
        let names: Vec<_> = std::fs::read_dir(mount.path())
            .expect("readdir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["data"]);
        drop(file);
        if let Err(e) = mount.unmount() {
            panic!("round {round}: unmount after reads: {e}");
        }
    }
}

/// What the io_uring tests mount: a fresh volume in memory, a mount
/// point, `-o uring`, and this test's turn; `None` (after saying why)
/// where they cannot run.
struct UringBed {
    _turn: std::sync::MutexGuard<'static, ()>,
    dev: Arc<dyn BlockDevice>,
    dir: tempfile::TempDir,
    uring: MountConfig,
}

fn uring_bed() -> Option<UringBed> {
    let no_uring = || {
        (!Path::new("/sys/module/fuse/parameters/enable_uring").exists())
            .then(|| "the kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING)".to_string())
    };
    if skip(unavailable().or_else(no_uring)) {
        return None;
    }
    let _turn = one_at_a_time();
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(64 << 20, 4096));
    Volume::format(dev.clone(), &FormatOptions::default()).expect("format");
    Some(UringBed {
        _turn,
        dev,
        dir: tempfile::tempdir().expect("mount point"),
        uring: MountConfig {
            uring: true,
            ..MountConfig::default()
        },
    })
}

/// `-o uring`: after INIT every request comes over the queues; READ and
/// WRITE are answered there, the rest by fuser's threads through the
/// socket pair. Data written over the ring reads back over it and, after
/// a clean unmount, over `/dev/fuse`; unmounting right after reads ends
/// the session cleanly here too.
#[test]
fn over_io_uring_reads_and_writes_are_answered_on_the_ring_and_the_rest_by_fuser() {
    let Some(UringBed {
        _turn,
        dev,
        dir,
        uring,
    }) = uring_bed()
    else {
        return;
    };
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    use std::sync::atomic::Ordering::Relaxed;

    let want = pattern(FILE_BYTES);
    const BLOCKS: u64 = 16;
    {
        let vol = Volume::open(dev.clone()).expect("open");
        let mount = iomapfs_mount::spawn(vol, dir.path(), &uring).expect("mount -o uring");
        let counts = mount.ring_counts().expect("the io_uring transport");
        std::fs::write(mount.path().join("data"), &want).expect("write through the mount");
        let writes = counts.answered_on_ring.load(Relaxed);
        assert!(writes > 0, "no WRITE was answered on the ring");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(mount.path().join("data"))
            .expect("open O_DIRECT");
        let handed = counts.handed_to_fuser.load(Relaxed);
        assert!(handed > 0, "LOOKUP, OPEN, ... were not handed to fuser");
        let before = counts.answered_on_ring.load(Relaxed);
        let mut block = blockdev::AlignedBuf::new(4096, 4096).expect("buffer");
        for b in 0..BLOCKS {
            let at = (b * 3 % 64) * 4096;
            let n = file.read_at(&mut block, at).expect("direct read");
            assert_eq!(n, 4096);
            assert!(
                block[..] == want[at as usize..at as usize + 4096],
                "block at {at}"
            );
        }
        // One READ per direct read, each answered on the ring.
        assert_eq!(counts.answered_on_ring.load(Relaxed) - before, BLOCKS);
        drop(file);
        mount.unmount().expect("unmount -o uring");
    }
    // What the ring wrote, read back over /dev/fuse.
    {
        let vol = Volume::open(dev.clone()).expect("open");
        let mount = iomapfs_mount::spawn(vol, dir.path(), &MountConfig::default()).expect("mount");
        assert!(mount.ring_counts().is_none());
        let got = std::fs::read(mount.path().join("data")).expect("read back");
        assert!(
            got == want,
            "data written over the ring read back over /dev/fuse"
        );
        mount.unmount().expect("unmount");
    }
    // -o uring_idle: the queue threads run at SCHED_IDLE, the others not.
    {
        let vol = Volume::open(dev.clone()).expect("open");
        let idle = MountConfig {
            uring: true,
            uring_idle: true,
            ..MountConfig::default()
        };
        let mount = iomapfs_mount::spawn(vol, dir.path(), &idle).expect("mount -o uring_idle");
        let policies = thread_policies();
        // Queue threads are iomapfs-ring-N (N a CPU number).
        let is_queue = |n: &str| {
            n.strip_prefix("iomapfs-ring-")
                .is_some_and(|cpu| cpu.parse::<usize>().is_ok())
        };
        let queues: Vec<_> = policies.iter().filter(|(n, _)| is_queue(n)).collect();
        assert!(!queues.is_empty(), "no queue threads in {policies:?}");
        assert!(
            queues.iter().all(|(_, p)| *p == libc::SCHED_IDLE as u32),
            "{policies:?}"
        );
        assert!(policies
            .iter()
            .filter(|(n, _)| n.starts_with("fuser-"))
            .all(|(_, p)| *p == libc::SCHED_OTHER as u32));
        let got = std::fs::read(mount.path().join("data")).expect("read -o uring_idle");
        assert!(got == want);
        mount.unmount().expect("unmount -o uring_idle");
    }
    for round in 0..50 {
        let vol = Volume::open(dev.clone()).expect("open");
        let mount = iomapfs_mount::spawn(vol, dir.path(), &uring).expect("mount -o uring");
        let mut file = std::fs::File::open(mount.path().join("data")).expect("open the file");
        let mut head = vec![0u8; 10_007];
        file.read_exact(&mut head).expect("read");
        assert!(head == want[..head.len()], "round {round}: bytes read");
        drop(file);
        if let Err(e) = mount.unmount() {
            panic!("round {round}: unmount -o uring after reads: {e}");
        }
    }
}

/// Name and scheduling policy (`/proc/self/task/*/stat` field 41) of
/// every thread of this process.
fn thread_policies() -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("tasks") {
        let dir = task.expect("task").path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(dir.join("stat")) else {
            continue;
        };
        // Fields after the parenthesised name, which may hold spaces:
        // state is field 3, so policy (41) is the 39th of these.
        let rest = &stat[stat.rfind(')').expect("comm in parentheses") + 2..];
        let policy = rest
            .split(' ')
            .nth(38)
            .and_then(|f| f.parse().ok())
            .expect("policy");
        out.push((name.trim().to_string(), policy));
    }
    out
}

/// Over io_uring, a connection aborted from outside (fusectl, as a stuck
/// mount's admin would) ends the session: the queues, the relay and
/// fuser's threads all end, the volume is let go, and nothing stays
/// mounted; the volume mounts again with what was written.
#[test]
fn over_io_uring_an_aborted_connection_ends_the_session() {
    let Some(UringBed {
        _turn,
        dev,
        dir,
        uring,
    }) = uring_bed()
    else {
        return;
    };
    use iomapfs_mount::fuse_uring::{abort_connection, connection_of};
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    let want = pattern(FILE_BYTES);
    let vol = Volume::open(dev.clone()).expect("open");
    let mount = iomapfs_mount::spawn(vol, dir.path(), &uring).expect("mount -o uring");
    let file = mount.path().join("data");
    std::fs::write(&file, &want).expect("write through the mount");
    // O_DIRECT: the read asks the daemon, not the kernel's cache.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&file)
        .expect("open O_DIRECT");
    let mut block = blockdev::AlignedBuf::new(4096, 4096).expect("buffer");
    assert_eq!(
        f.read_at(&mut block, 0).expect("a read before the abort"),
        4096
    );
    let id = connection_of(mount.path()).expect("the mount's connection");
    abort_connection(id);
    let after = f.read_at(&mut block, 0);
    assert_eq!(
        after.map_err(|e| e.raw_os_error()),
        Err(Some(libc::ENOTCONN)),
        "a read after the abort"
    );
    drop(f);
    mount.unmount().expect("the session ends after an abort");
    let mounted = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let path = dir.path().to_str().expect("utf-8 path");
    assert!(!mounted.contains(path), "still mounted: {mounted}");
    let vol = Volume::open(dev.clone()).expect("open again");
    let mount = iomapfs_mount::spawn(vol, dir.path(), &MountConfig::default()).expect("mount");
    assert!(std::fs::read(mount.path().join("data")).expect("read back") == want);
    mount.unmount().expect("unmount");
}
