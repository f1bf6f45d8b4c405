//! The harness of the FUSE mount tests (`mount.rs`, `mount_access.rs`):
//! an image file mounted by the `iomapfs` binary, unmounted and its daemon
//! stopped on drop whatever happened; skipping (with the reason printed)
//! or, under `IOMAPFS_REQUIRE_PRIVILEGED=1`, failing where the machine
//! cannot mount. Each test binary uses part of it.
#![allow(dead_code)]

use std::ffi::CString;
use std::fs::{self, File};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_iomapfs");

pub fn require_privileged() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// Why this machine cannot mount, if it cannot.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse (modprobe fuse)".into());
    }
    None
}

/// Skips the test when `$reason` is `Some` (printing it), or, under
/// IOMAPFS_REQUIRE_PRIVILEGED=1, fails it.
macro_rules! skip_if {
    ($reason:expr) => {
        if let Some(reason) = $reason {
            if require_privileged() {
                panic!("IOMAPFS_REQUIRE_PRIVILEGED=1 but: {reason}");
            }
            eprintln!("skipped: {reason}");
            return;
        }
    };
}

/// Skips (printing why) or, under IOMAPFS_REQUIRE_PRIVILEGED=1, fails.
macro_rules! need_fuse {
    () => {
        skip_if!(unavailable())
    };
}

pub fn iomapfs(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running iomapfs {args:?}: {e}"))
}

pub fn ok(args: &[&str]) -> String {
    let out = iomapfs(args);
    assert!(
        out.status.success(),
        "iomapfs {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn is_mounted(mnt: &Path) -> bool {
    let mnt = mnt.canonicalize().unwrap_or_else(|_| mnt.to_path_buf());
    iomapfs_mount::mountinfo::mount_at(&mnt).is_ok_and(|m| m.is_some())
}

/// Whether any thread of process `pid` still runs (a zombie does not:
/// nobody may reap the daemon's parent's orphan in a container). Every
/// thread, not the leader alone: after a SIGKILL the leader can be a
/// zombie while other threads are still exiting, and the process's files,
/// the flock on its TARGET among them, close only with the last (a fsck
/// right after the leader died found the image still locked).
pub fn alive(pid: u32) -> bool {
    let Ok(threads) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    threads.flatten().any(|thread| {
        fs::read_to_string(thread.path().join("stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X")
        })
    })
}

/// Waits (bounded) until `cond` holds; `what` names it in the panic.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < timeout,
            "timed out after {timeout:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How requests reach the daemon: the tests that exercise the request
/// handlers run over both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `/dev/fuse`, read by fuser's threads (the default).
    DevFuse,
    /// `-o uring`: FUSE over io_uring queues, one per CPU.
    Uring,
}

impl Transport {
    /// `options` (comma-separated, may be empty) with this transport's.
    pub fn with(self, options: &str) -> String {
        match (self, options.is_empty()) {
            (Transport::DevFuse, _) => options.to_string(),
            (Transport::Uring, true) => "uring".to_string(),
            (Transport::Uring, false) => format!("{options},uring"),
        }
    }
}

/// Skips (or fails under `IOMAPFS_REQUIRE_PRIVILEGED=1`) a test over
/// `transport` where it cannot run.
#[macro_export]
macro_rules! need_transport {
    ($t:expr) => {
        need_fuse!();
        skip_if!(($t == Transport::Uring
            && !std::path::Path::new("/sys/module/fuse/parameters/enable_uring").exists())
        .then_some("the kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING)"));
    };
}

/// A test over `/dev/fuse` and its twin over io_uring (`-o uring`), both
/// running `$body` with the transport.
#[macro_export]
macro_rules! over_both_transports {
    ($dev_fuse:ident, $uring:ident, $body:ident) => {
        #[test]
        fn $dev_fuse() {
            $body(Transport::DevFuse);
        }

        #[test]
        fn $uring() {
            $body(Transport::Uring);
        }
    };
}

/// A volume in an image file and its mountpoint; unmounts and stops the
/// daemon on drop, whatever happened.
pub struct Mounted {
    pub dir: tempfile::TempDir,
    pub img: PathBuf,
    pub mnt: PathBuf,
    pub pid: Option<u32>,
    pub foreground: Option<Child>,
}

impl Mounted {
    pub fn new(size: &str) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        ok(&["mkfs", img.to_str().unwrap(), "--size", size]);
        Mounted {
            dir,
            img,
            mnt,
            pid: None,
            foreground: None,
        }
    }

    pub fn img(&self) -> &str {
        self.img.to_str().unwrap()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }

    /// Mounts as a daemon with `-o options` over `transport` (see
    /// [`Transport`]); returns its pid.
    pub fn mount_over(&mut self, transport: Transport, options: &str) -> u32 {
        let joined = transport.with(options);
        if joined.is_empty() {
            self.mount(&[])
        } else {
            self.mount(&["-o", &joined])
        }
    }

    /// Mounts as a daemon; returns its pid.
    pub fn mount(&mut self, opts: &[&str]) -> u32 {
        self.try_mount_via(&[], opts).unwrap_or_else(|out| {
            panic!(
                "iomapfs mount {opts:?}: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    /// Mounts as a daemon started by the command `via` (such as `setpriv`
    /// to another user; empty: directly); its pid, or the command's output
    /// if the mount failed.
    pub fn try_mount_via(&mut self, via: &[&str], opts: &[&str]) -> Result<u32, Output> {
        let mut argv: Vec<&str> = via.to_vec();
        argv.extend([BIN, "mount", self.img(), self.mnt.to_str().unwrap()]);
        argv.extend_from_slice(opts);
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .output()
            .unwrap_or_else(|e| panic!("running {argv:?}: {e}"));
        if !out.status.success() {
            return Err(out);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let pid: u32 = text
            .rsplit("daemon pid ")
            .next()
            .and_then(|s| s.trim().trim_end_matches(')').parse().ok())
            .unwrap_or_else(|| panic!("no daemon pid in {text:?}"));
        self.pid = Some(pid);
        assert!(is_mounted(&self.mnt), "not in mountinfo after: {text}");
        Ok(pid)
    }

    /// Mounts with `--foreground`, served by a child of this process
    /// (whose exit status [`Mounted::stop_foreground`] returns).
    pub fn mount_foreground(&mut self, opts: &[&str]) {
        let mut child = Command::new(BIN)
            .args([
                "mount",
                "--foreground",
                self.img(),
                self.mnt.to_str().unwrap(),
            ])
            .args(opts)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = [0u8; 7];
        let started = child.stdout.take().unwrap().read_exact(&mut line);
        self.foreground = Some(child);
        if started.is_err() || &line != b"mounted" {
            let out = self.foreground.take().unwrap().wait_with_output().unwrap();
            panic!(
                "iomapfs mount --foreground {opts:?}: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(is_mounted(&self.mnt));
    }

    /// SIGINT to the foreground mount: waits for it; its exit status and
    /// what it said on stderr.
    pub fn stop_foreground(&mut self) -> (ExitStatus, String) {
        let child = self.foreground.take().expect("a foreground mount");
        // SAFETY: kill on the child this test started.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Unmounts with `umount` and waits for the daemon to finish its clean
    /// unmount.
    pub fn unmount(&mut self) {
        // A child that a test on another thread forks holds copies of this
        // process's descriptors, ours on the mount too, until it execs (they
        // are close-on-exec): for that moment `umount` finds the mount busy.
        let t0 = Instant::now();
        loop {
            let out = Command::new("umount").arg(&self.mnt).output().unwrap();
            if out.status.success() {
                break;
            }
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("busy") && t0.elapsed() < Duration::from_secs(10),
                "umount {}: {}: {err}",
                self.mnt.display(),
                out.status
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(pid) = self.pid.take() {
            wait_until(
                "the daemon exits after umount",
                Duration::from_secs(30),
                || !alive(pid),
            );
        }
    }

    /// fsck's report; asserts it is clean.
    pub fn fsck_clean(&self) -> String {
        let out = ok(&["fsck", self.img()]);
        assert!(out.contains("clean: no problems found"), "{out}");
        out
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        if let Some(mut c) = self.foreground.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(pid) = self.pid.take() {
            if alive(pid) {
                // SAFETY: kill on a pid this test started (the daemon).
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
    }
}

pub fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

pub fn renameat2(from: &Path, to: &Path, flags: u32) -> i32 {
    let (a, b) = (cstr(from), cstr(to));
    // SAFETY: valid NUL-terminated paths; AT_FDCWD directories.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        0
    } else {
        errno()
    }
}

pub fn fallocate(f: &File, mode: i32, off: i64, len: i64) -> i32 {
    // SAFETY: a descriptor we own.
    if unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) } == 0 {
        0
    } else {
        errno()
    }
}

pub fn lseek(f: &File, off: i64, whence: i32) -> Result<i64, i32> {
    // SAFETY: a descriptor we own.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(r)
    }
}

/// Where mount(8) looks for the helper of type `fuse.iomapfs`.
pub const MOUNT_HELPER: &str = "/sbin/mount.fuse.iomapfs";

static MOUNT_HELPER_USERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// mount(8)'s helper for `fuse.iomapfs` as a link to the binary under
/// test, while this lives (one test at a time in this process); removed
/// after unless it was there before.
pub struct MountHelper {
    created: bool,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

impl MountHelper {
    pub fn install() -> MountHelper {
        let guard = MOUNT_HELPER_USERS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let path = Path::new(MOUNT_HELPER);
        let created = match fs::read_link(path) {
            Ok(target) if target == Path::new(BIN) => false,
            Err(_) if path.symlink_metadata().is_err() => {
                std::os::unix::fs::symlink(BIN, path)
                    .unwrap_or_else(|e| panic!("linking {MOUNT_HELPER}: {e}"));
                true
            }
            _ => {
                // Someone's own helper: testing it instead of the binary
                // under test would prove nothing, and it is not ours to
                // replace.
                let why = format!("{MOUNT_HELPER} is installed already, not as this build");
                assert!(
                    !require_privileged(),
                    "IOMAPFS_REQUIRE_PRIVILEGED=1 but: {why}"
                );
                eprintln!("note: {why}; the test uses it");
                false
            }
        };
        MountHelper {
            created,
            _one_at_a_time: guard,
        }
    }
}

impl Drop for MountHelper {
    fn drop(&mut self) {
        if self.created {
            let _ = fs::remove_file(MOUNT_HELPER);
        }
    }
}

/// Runs mount(8) with `args`; its output.
pub fn mount_cmd(args: &[&str]) -> Output {
    Command::new("mount")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running mount {args:?}: {e}"))
}

/// The type /proc/self/mounts gives the mount at `mnt`.
pub fn mount_type(mnt: &Path) -> Option<String> {
    let mnt = mnt.canonicalize().ok()?;
    fs::read_to_string("/proc/self/mounts")
        .ok()?
        .lines()
        .rfind(|l| l.split(' ').nth(1) == mnt.to_str())
        .and_then(|l| l.split(' ').nth(2).map(str::to_string))
}
