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

#[test]
fn unmounting_right_after_reads_ends_the_session_cleanly() {
    if let Some(reason) = unavailable() {
        if std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1") {
            panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
        }
        eprintln!("skipped: {reason}");
        return;
    }
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
