//! What the FUSE mount lets a caller reach, end to end through the kernel:
//! `-o ro` changes nothing on the image; names iomapfs cannot store are
//! refused, not altered; a user who owns an image mounts it without root,
//! and other users reach it only with `allow_other`; nothing read through
//! the mount comes from past a file's end, from freed blocks, from past the
//! volume, or from the host behind a symlink. Needs root and /dev/fuse
//! (and `fusermount3`, `setpriv` for the unprivileged mount); skipped with
//! a printed reason otherwise, failed instead under
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

#[macro_use]
mod mount_support;

use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use mount_support::*;

/// Asserts that `r` failed with `want` (an errno), naming `what`.
#[track_caller]
fn fails_with<T: std::fmt::Debug>(what: &str, want: i32, r: io::Result<T>) {
    match r {
        Err(e) => assert_eq!(
            e.raw_os_error(),
            Some(want),
            "{what}: {e}, want {}",
            io::Error::from_raw_os_error(want)
        ),
        Ok(v) => panic!(
            "{what} succeeded ({v:?}), want {}",
            io::Error::from_raw_os_error(want)
        ),
    }
}

/// `rc` of a libc call as a `Result` (errno on -1).
fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn setxattr(path: &Path, name: &[u8], value: &[u8]) -> io::Result<()> {
    let (p, n) = (cstr(path), CString::new(name).unwrap());
    // SAFETY: valid C strings; `value` is valid for its length.
    check(unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    })
}

fn getxattr(path: &Path, name: &str) -> io::Result<Vec<u8>> {
    let (p, n) = (cstr(path), CString::new(name).unwrap());
    let mut buf = vec![0u8; 256];
    // SAFETY: valid C strings; `buf` is writable for its length.
    let got = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(got as usize);
    Ok(buf)
}

fn removexattr(path: &Path, name: &str) -> io::Result<()> {
    let (p, n) = (cstr(path), CString::new(name).unwrap());
    // SAFETY: valid C strings.
    check(unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) })
}

fn mkfifo(path: &Path) -> io::Result<()> {
    let p = cstr(path);
    // SAFETY: a valid C string.
    check(unsafe { libc::mkfifo(p.as_ptr(), 0o644) })
}

fn touch_now(path: &Path) -> io::Result<()> {
    let p = cstr(path);
    // SAFETY: a valid C string; null times mean "now".
    check(unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), std::ptr::null(), 0) })
}

fn truncate(path: &Path, len: i64) -> io::Result<()> {
    let p = cstr(path);
    // SAFETY: a valid C string.
    check(unsafe { libc::truncate(p.as_ptr(), len) })
}

/// The mount options field of `mnt`'s line in /proc/self/mountinfo.
fn mount_options(mnt: &Path) -> String {
    let mnt = mnt.canonicalize().unwrap();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(mnt.to_str().unwrap()))
        .map(|l| l.split(' ').nth(5).unwrap().to_string())
        .unwrap_or_else(|| panic!("{} not mounted", mnt.display()))
}

over_both_transports!(
    read_only_mount_refuses_every_change_and_leaves_the_image_unwritten,
    read_only_mount_refuses_every_change_and_leaves_the_image_unwritten_over_io_uring,
    read_only_mount_refuses_every_change_and_leaves_the_image_unwritten_over
);

fn read_only_mount_refuses_every_change_and_leaves_the_image_unwritten_over(transport: Transport) {
    need_transport!(transport);
    let mut m = Mounted::new("64m");
    m.mount_over(transport, "");
    fs::write(m.path("f"), b"kept as it was").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    symlink("f", m.path("l")).unwrap();
    setxattr(&m.path("f"), b"user.a", b"1").unwrap();
    m.unmount();
    let before = fs::read(&m.img).unwrap();

    m.mount_foreground(&["-o", &transport.with("ro")]);
    let opts = mount_options(&m.mnt);
    assert!(opts.split(',').any(|o| o == "ro"), "mount options {opts}");
    // Everything reads.
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept as it was");
    assert_eq!(fs::read_link(m.path("l")).unwrap(), Path::new("f"));
    assert_eq!(getxattr(&m.path("f"), "user.a").unwrap(), b"1");
    let mut names: Vec<_> = fs::read_dir(&m.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["d", "f", "l"]);
    // Nothing changes.
    let (f, d, new) = (m.path("f"), m.path("d"), m.path("new"));
    let erofs = libc::EROFS;
    fails_with(
        "open for writing",
        erofs,
        OpenOptions::new().write(true).open(&f),
    );
    fails_with(
        "open O_TRUNC",
        erofs,
        File::options()
            .read(true)
            .custom_flags(libc::O_TRUNC)
            .open(&f),
    );
    fails_with("create", erofs, File::create(&new));
    fails_with("mkdir", erofs, fs::create_dir(&new));
    fails_with("mkfifo", erofs, mkfifo(&new));
    fails_with("symlink", erofs, symlink("f", &new));
    fails_with("link", erofs, fs::hard_link(&f, &new));
    fails_with("rename", erofs, fs::rename(&f, &new));
    fails_with("unlink", erofs, fs::remove_file(&f));
    fails_with("rmdir", erofs, fs::remove_dir(&d));
    fails_with(
        "chmod",
        erofs,
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600)),
    );
    fails_with(
        "chown",
        erofs,
        std::os::unix::fs::chown(&f, Some(1), Some(1)),
    );
    fails_with("utimensat", erofs, touch_now(&f));
    fails_with("truncate", erofs, truncate(&f, 0));
    fails_with("setxattr", erofs, setxattr(&f, b"user.b", b"2"));
    fails_with("removexattr", erofs, removexattr(&f, "user.a"));
    // A read-only mount shares the image with readers, never with a writer.
    m.fsck_clean();
    let rw = iomapfs(&["io", m.img(), "-c", "ls /"]);
    assert_eq!(rw.status.code(), Some(1), "io beside a read-only mount");
    let (status, err) = m.stop_foreground();
    assert!(
        status.success(),
        "read-only mount after SIGINT: {status}\n{err}"
    );
    assert!(
        fs::read(&m.img).unwrap() == before,
        "the read-only mount wrote to the image"
    );

    // After a crash the journal is replayed in memory, not on the image,
    // and the orphan the crash left (a file unlinked while open) is freed
    // in memory only, however the read-only mount is used.
    let pid = m.mount_over(transport, "");
    let mut g = File::create(m.path("g")).unwrap();
    g.write_all(b"fsynced before the crash").unwrap();
    g.sync_all().unwrap();
    drop(g);
    let mut orphan = File::create(m.path("orphan")).unwrap();
    orphan.write_all(b"unlinked while open").unwrap();
    orphan.sync_all().unwrap();
    fs::remove_file(m.path("orphan")).unwrap();
    File::open(&m.mnt).unwrap().sync_all().unwrap();
    // SAFETY: kill on the daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_until("the killed daemon is gone", Duration::from_secs(30), || {
        !alive(pid)
    });
    m.pid = None;
    assert!(Command::new("umount")
        .arg("-l")
        .arg(&m.mnt)
        .status()
        .unwrap()
        .success());
    drop(orphan);
    let crashed = fs::read(&m.img).unwrap();
    m.mount_foreground(&["-o", &transport.with("ro")]);
    assert_eq!(fs::read(m.path("g")).unwrap(), b"fsynced before the crash");
    File::open(&m.mnt).unwrap().sync_all().unwrap();
    File::open(m.path("g")).unwrap().sync_all().unwrap();
    let (status, err) = m.stop_foreground();
    assert!(
        status.success(),
        "read-only mount after SIGINT: {status}\n{err}"
    );
    assert!(
        fs::read(&m.img).unwrap() == crashed,
        "the read-only mount replayed onto the image"
    );
    m.mount_over(transport, "");
    assert_eq!(fs::read(m.path("g")).unwrap(), b"fsynced before the crash");
    m.unmount();
    m.fsck_clean();
}

#[test]
fn names_that_are_not_utf8_are_refused_and_utf8_names_are_kept_byte_exact() {
    need_fuse!();
    let mut m = Mounted::new("64m");
    m.mount(&[]);
    fs::write(m.path("plain"), b"x").unwrap();
    // Latin-1 "café", a lone continuation byte, an overlong '/' encoding.
    for raw in [&b"caf\xe9"[..], b"\x80", b"a\xc0\xafb"] {
        let bad = m.mnt.join(OsStr::from_bytes(raw));
        let eilseq = libc::EILSEQ;
        fails_with("create", eilseq, File::create(&bad));
        fails_with("mkdir", eilseq, fs::create_dir(&bad));
        fails_with("mkfifo", eilseq, mkfifo(&bad));
        fails_with("symlink", eilseq, symlink("plain", &bad));
        fails_with("link", eilseq, fs::hard_link(m.path("plain"), &bad));
        fails_with("rename to", eilseq, fs::rename(m.path("plain"), &bad));
        // No such name can exist.
        fails_with("stat", libc::ENOENT, fs::metadata(&bad));
        fails_with("unlink", libc::ENOENT, fs::remove_file(&bad));
        fails_with("rename from", libc::ENOENT, fs::rename(&bad, m.path("x")));
        let mut xname = b"user.".to_vec();
        xname.extend_from_slice(raw);
        fails_with("setxattr", eilseq, setxattr(&m.path("plain"), &xname, b"v"));
    }
    // UTF-8 names, the NFC and NFD spellings of one word apart, and the
    // longest name, come back byte for byte: readdir, rename, unlink,
    // after a remount too. A symlink's target is bytes, UTF-8 or not.
    let long = "é".repeat(127) + "x"; // 255 bytes
    let names: Vec<String> = [
        "café",
        "cafe\u{301}",
        "日本語",
        "🦀",
        "tab\tnew\nline",
        &long,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for n in &names {
        fs::write(m.mnt.join(n), n.as_bytes()).unwrap();
    }
    for n in &names[..3] {
        fs::rename(m.mnt.join(n), m.mnt.join(format!("{n}→"))).unwrap();
    }
    fs::remove_file(m.mnt.join("🦀")).unwrap();
    let target = OsStr::from_bytes(b"\xff\xfe/not utf-8/\x80");
    symlink(target, m.path("link")).unwrap();
    let mut want: Vec<Vec<u8>> = names[..3]
        .iter()
        .map(|n| format!("{n}→").into_bytes())
        .chain([names[4].clone().into_bytes(), long.clone().into_bytes()])
        .chain([b"plain".to_vec(), b"link".to_vec()])
        .collect();
    want.sort();
    for pass in ["mounted", "remounted"] {
        let mut got: Vec<Vec<u8>> = fs::read_dir(&m.mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name().as_bytes().to_vec())
            .collect();
        got.sort();
        assert_eq!(got, want, "{pass}");
        for n in &names[..3] {
            assert_eq!(
                fs::read(m.mnt.join(format!("{n}→"))).unwrap(),
                n.as_bytes(),
                "{pass}"
            );
        }
        assert_eq!(
            fs::read_link(m.path("link")).unwrap().as_os_str(),
            target,
            "{pass}"
        );
        m.unmount();
        m.fsck_clean();
        m.mount(&[]);
    }
    m.unmount();
}

/// `setpriv` arguments that run the rest as `uid` (group `uid`, no
/// supplementary groups).
fn as_user(uid: u32) -> Vec<String> {
    vec![
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "--".into(),
    ]
}

/// Runs `argv` as `uid`.
fn run_as(uid: u32, argv: &[&str]) -> Output {
    let via = as_user(uid);
    Command::new(&via[0])
        .args(&via[1..])
        .args(argv)
        .output()
        .unwrap_or_else(|e| panic!("setpriv {argv:?}: {e}"))
}

/// Why this machine cannot mount as a user, if it cannot.
fn no_user_mount() -> Option<String> {
    for (tool, package) in [("fusermount3", "fuse3"), ("setpriv", "util-linux")] {
        let found = Command::new(tool).arg("--version").output().is_ok();
        if !found {
            return Some(format!("no {tool} (Debian package {package})"));
        }
    }
    let mode = fs::metadata("/dev/fuse").map_or(0, |m| m.mode() & 0o777);
    if mode & 0o006 != 0o006 {
        return Some(format!(
            "/dev/fuse is mode {mode:o}: a user mount needs 0666 (Debian's default; .ci/run sets it)"
        ));
    }
    None
}

/// The uid of the `nobody` account.
fn nobody() -> u32 {
    let name = CString::new("nobody").unwrap();
    // SAFETY: a valid C string; the entry is read at once, before any other
    // getpw* call could reuse it, and checked for null.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "no account `nobody`");
    // SAFETY: checked non-null just above.
    unsafe { (*pw).pw_uid }
}

/// Whether /etc/fuse.conf lets users ask for `allow_other`.
fn users_may_allow_other() -> bool {
    fs::read_to_string("/etc/fuse.conf")
        .unwrap_or_default()
        .lines()
        .any(|l| l.trim() == "user_allow_other")
}

#[test]
fn a_user_who_owns_an_image_mounts_it_and_others_reach_it_only_with_allow_other() {
    need_fuse!();
    skip_if!(no_user_mount());
    // fusermount3 wants the mounting user's name: `nobody` owns the
    // image; the other user is an id no account has.
    let owner = nobody();
    let other = 64_202u32;
    let mut m = Mounted::new("64m");
    // The user's own directory, image (their mkfs: the volume's root is
    // theirs) and mountpoint.
    fs::set_permissions(m.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    for p in [m.dir.path(), &m.mnt] {
        std::os::unix::fs::chown(p, Some(owner), Some(owner)).unwrap();
    }
    fs::remove_file(&m.img).unwrap();
    let made = run_as(owner, &[BIN, "mkfs", m.img(), "--size", "64m"]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let via: Vec<String> = as_user(owner);
    let via: Vec<&str> = via.iter().map(String::as_str).collect();
    let mnt = m.mnt.to_str().unwrap().to_string();
    let f = format!("{mnt}/f");

    // FUSE over io_uring is root's: the user is told so; nothing mounts.
    let refused = m
        .try_mount_via(&via, &["-o", "uring"])
        .expect_err("a user's mount -o uring");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("-o uring: needs root"), "{why}");
    assert!(!is_mounted(&m.mnt));
    m.try_mount_via(&via, &[]).unwrap_or_else(|out| {
        panic!(
            "user mount: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let opts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        opts.lines()
            .any(|l| l.contains(&mnt) && l.contains(&format!("user_id={owner}"))),
        "mounted by the user (fusermount3): {opts}"
    );
    // The owner writes and reads; the file is theirs.
    let wrote = run_as(
        owner,
        &["sh", "-c", "printf hello > \"$1\" && cat \"$1\"", "sh", &f],
    );
    assert!(
        wrote.status.success(),
        "{}",
        String::from_utf8_lossy(&wrote.stderr)
    );
    assert_eq!(wrote.stdout, b"hello");
    let listed = run_as(owner, &["stat", "-c", "%u %a", &f]);
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout).trim(),
        format!("{owner} 644")
    );
    // Nobody else without allow_other, root included.
    fails_with("root stat", libc::EACCES, fs::metadata(m.path("f")));
    let denied = run_as(other, &["cat", &f]);
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    let unmounted = run_as(owner, &["fusermount3", "-u", &mnt]);
    assert!(
        unmounted.status.success(),
        "{}",
        String::from_utf8_lossy(&unmounted.stderr)
    );
    let pid = m.pid.take().unwrap();
    wait_until("the user's daemon exits", Duration::from_secs(30), || {
        !alive(pid)
    });
    let report = m.fsck_clean();
    assert!(report.contains("journal records replayed  0"), "{report}");
    assert_eq!(fs::metadata(&m.img).unwrap().uid(), owner);

    // allow_other only as /etc/fuse.conf lets users ask for it.
    match m.try_mount_via(&via, &["-o", "allow_other"]) {
        Ok(_) => {
            assert!(
                users_may_allow_other(),
                "allow_other without user_allow_other"
            );
            let read = run_as(other, &["cat", &f]);
            assert_eq!(
                read.stdout,
                b"hello",
                "{}",
                String::from_utf8_lossy(&read.stderr)
            );
            m.unmount();
        }
        Err(out) => {
            assert!(
                !users_may_allow_other(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!is_mounted(&m.mnt));
        }
    }
    // A user cannot mount an image they do not own.
    let other_img = m.dir.path().join("root.img");
    fs::copy(&m.img, &other_img).unwrap();
    fs::set_permissions(&other_img, fs::Permissions::from_mode(0o600)).unwrap();
    let refused = run_as(owner, &[BIN, "mount", other_img.to_str().unwrap(), &mnt]);
    assert!(!refused.status.success());
    assert!(!is_mounted(&m.mnt));
    // Root's mount: others reach it with allow_other only (and then the
    // file's mode decides).
    for (opts, reaches) in [(&[][..], false), (&["-o", "allow_other"][..], true)] {
        m.mount(opts);
        let read = run_as(other, &["cat", &f]);
        assert_eq!(
            read.status.success(),
            reaches,
            "{opts:?}: {}",
            String::from_utf8_lossy(&read.stderr)
        );
        if reaches {
            assert_eq!(read.stdout, b"hello");
            fs::set_permissions(m.path("f"), fs::Permissions::from_mode(0o600)).unwrap();
            let read = run_as(other, &["cat", &f]);
            assert!(!read.status.success(), "mode 0600 of another user's file");
        }
        m.unmount();
    }
    m.fsck_clean();
}

/// Reads all of `path` with O_DIRECT into an aligned buffer.
fn read_direct(path: &Path, len: usize) -> Vec<u8> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    let mut buf = AlignedBuf::new(len);
    let n = f.read_at(buf.bytes(), 0).unwrap();
    buf.bytes()[..n].to_vec()
}

/// A 4096-aligned byte buffer for O_DIRECT.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let raw = vec![0xA5u8; len + 4096];
        let start = raw.as_ptr().align_offset(4096);
        AlignedBuf { raw, start, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

over_both_transports!(
    nothing_read_through_the_mount_comes_from_past_a_file_the_volume_or_the_host,
    nothing_read_through_the_mount_comes_from_past_a_file_the_volume_or_the_host_over_io_uring,
    nothing_read_through_the_mount_comes_from_past_a_file_the_volume_or_the_host_over
);

fn nothing_read_through_the_mount_comes_from_past_a_file_the_volume_or_the_host_over(
    transport: Transport,
) {
    need_transport!(transport);
    let mut m = Mounted::new("64m");
    let image_len = fs::metadata(&m.img).unwrap().len();
    m.mount_over(transport, "");
    // Freed blocks on the device hold this file's bytes afterwards.
    let secret = b"SECRET OF A REMOVED FILE\n".repeat(40_000);
    let mut s = File::create(m.path("s")).unwrap();
    s.write_all(&secret).unwrap();
    s.sync_all().unwrap();
    drop(s);
    fs::remove_file(m.path("s")).unwrap();
    let n = File::create(m.path("n")).unwrap();
    let one_mib = 1 << 20;
    // SAFETY: a descriptor we own.
    check(unsafe { libc::fallocate(n.as_raw_fd(), 0, 0, one_mib) }).unwrap();
    n.set_len(3 << 20).unwrap();
    drop(n);
    let zeros = vec![0u8; 3 << 20];
    assert!(
        fs::read(m.path("n")).unwrap() == zeros,
        "buffered read of unwritten space and a hole"
    );
    assert!(
        read_direct(&m.path("n"), 3 << 20) == zeros,
        "direct read of unwritten space and a hole"
    );

    // A direct read of a short file returns its bytes and touches no more
    // of the buffer; reads past the end return nothing.
    fs::write(m.path("p"), [7u8; 100]).unwrap();
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("p"))
        .unwrap();
    let mut buf = AlignedBuf::new(4096);
    assert_eq!(f.read_at(buf.bytes(), 0).unwrap(), 100);
    assert!(buf.bytes()[..100].iter().all(|&b| b == 7));
    assert!(
        buf.bytes()[100..].iter().all(|&b| b == 0xA5),
        "bytes past EOF were filled"
    );
    for off in [4096, 1 << 40, (1 << 62) - 4096] {
        assert_eq!(
            f.read_at(buf.bytes(), off).unwrap(),
            0,
            "direct read at {off}"
        );
        assert_eq!(
            File::open(m.path("p"))
                .unwrap()
                .read_at(&mut [0; 64], off)
                .unwrap(),
            0
        );
    }
    // A write far past the volume's size is sparse: it reads back, holds
    // one block, and the image does not grow.
    let far = 1u64 << 40;
    let h = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(m.path("far"))
        .unwrap();
    h.write_all_at(b"far away", far).unwrap();
    h.sync_all().unwrap();
    let mut back = [0u8; 8];
    h.read_exact_at(&mut back, far).unwrap();
    assert_eq!(&back, b"far away");
    let st = h.metadata().unwrap();
    assert_eq!(st.len(), far + 8);
    assert!(
        st.blocks() * 512 <= 64 << 10,
        "{} blocks for one write",
        st.blocks()
    );
    let mut start = vec![1u8; 4096];
    h.read_exact_at(&mut start, far - 4096).unwrap();
    assert!(start.iter().all(|&b| b == 0));
    // Past the largest file size the kernel was told: EFBIG.
    fails_with(
        "write past the largest size",
        libc::EFBIG,
        h.write_at(b"x", i64::MAX as u64 - 1),
    );
    drop(h);
    // A symlink out of the volume is a name: readlink gives it, O_NOFOLLOW
    // refuses it, and following it is the kernel's walk of the caller's own
    // namespace (the daemon never opens host files).
    for target in ["/etc/passwd", "../../../../../../../etc/passwd"] {
        let link = m.path("out");
        symlink(target, &link).unwrap();
        assert_eq!(fs::read_link(&link).unwrap(), Path::new(target));
        let meta = fs::symlink_metadata(&link).unwrap();
        assert!(meta.file_type().is_symlink());
        assert_eq!(meta.len(), target.len() as u64);
        fails_with(
            "open O_NOFOLLOW",
            libc::ELOOP,
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&link),
        );
        fs::remove_file(&link).unwrap();
    }
    // Every byte read back anywhere is zero or ours, never the removed file's.
    let mut all = Vec::new();
    for e in fs::read_dir(&m.mnt).unwrap() {
        let p = e.unwrap().path();
        let len = fs::metadata(&p).unwrap().len();
        let mut r = File::open(&p).unwrap();
        let mut head = vec![0u8; len.min(4 << 20) as usize];
        r.read_exact(&mut head).unwrap();
        all.extend_from_slice(&head);
    }
    assert!(
        !all.windows(6).any(|w| w == b"SECRET"),
        "freed blocks read back"
    );
    drop(f);
    m.unmount();
    assert_eq!(fs::metadata(&m.img).unwrap().len(), image_len);
    m.fsck_clean();
}
