//! `iomapfs mount` end to end, through the kernel: POSIX calls on the
//! mountpoint, O_DIRECT and buffered opens, fio with verification, kill -9
//! of the daemon and recovery, signals, concurrent clients. Needs root and
//! /dev/fuse; skipped with a printed reason otherwise, and failed instead
//! when `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI). Every test unmounts and stops
//! its daemon also when it fails (the `Mounted` guard).

#[macro_use]
mod mount_support;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mount_support::*;

/// The inode numbers readdir gives `.` and `..` of `dir` (what `ls -ai`
/// shows).
fn dot_inodes(dir: &Path) -> (u64, u64) {
    let path = cstr(dir);
    let (mut dot, mut dotdot) = (0, 0);
    // SAFETY: `path` is a valid C string; the stream is checked for null,
    // each entry is read before the next readdir call may reuse it, and the
    // stream is closed once.
    unsafe {
        let stream = libc::opendir(path.as_ptr());
        assert!(!stream.is_null(), "opendir {}", dir.display());
        loop {
            let entry = libc::readdir(stream);
            if entry.is_null() {
                break;
            }
            match std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()).to_bytes() {
                b"." => dot = (*entry).d_ino,
                b".." => dotdot = (*entry).d_ino,
                _ => {}
            }
        }
        libc::closedir(stream);
    }
    (dot, dotdot)
}

over_both_transports!(
    posix_calls_on_the_mountpoint_match_the_volume_after_remount,
    posix_calls_on_the_mountpoint_match_the_volume_after_remount_over_io_uring,
    posix_calls_on_the_mountpoint_match_the_volume_after_remount_over
);

fn posix_calls_on_the_mountpoint_match_the_volume_after_remount_over(transport: Transport) {
    need_transport!(transport);
    let mut m = Mounted::new("128m");
    m.mount_over(transport, "");
    // Files: create, write, read, truncate, append.
    fs::write(m.path("a"), b"hello world").unwrap();
    assert_eq!(fs::read(m.path("a")).unwrap(), b"hello world");
    let f = OpenOptions::new().write(true).open(m.path("a")).unwrap();
    f.set_len(5).unwrap();
    drop(f);
    let mut f = OpenOptions::new().append(true).open(m.path("a")).unwrap();
    f.write_all(b"!!").unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"hello!!");
    // Directories.
    fs::create_dir(m.path("d")).unwrap();
    fs::create_dir(m.path("d/e")).unwrap();
    File::open(m.path("d")).unwrap().sync_all().unwrap(); // fsyncdir
    let ino = |p: &str| fs::metadata(m.path(p)).unwrap().ino();
    assert_eq!(dot_inodes(&m.path("d/e")), (ino("d/e"), ino("d")));
    assert_eq!(
        dot_inodes(&m.mnt),
        (ino(""), ino("")),
        "the root is its own parent"
    );
    assert_eq!(fs::metadata(m.path("d")).unwrap().nlink(), 3);
    assert_eq!(
        fs::remove_dir(m.path("d")).unwrap_err().raw_os_error(),
        Some(libc::ENOTEMPTY)
    );
    fs::remove_dir(m.path("d/e")).unwrap();
    // Hard links and symlinks.
    fs::hard_link(m.path("a"), m.path("d/a2")).unwrap();
    assert_eq!(fs::metadata(m.path("a")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(m.path("a")).unwrap().ino(),
        fs::metadata(m.path("d/a2")).unwrap().ino()
    );
    std::os::unix::fs::symlink("d/a2", m.path("s")).unwrap();
    assert_eq!(fs::read_link(m.path("s")).unwrap(), Path::new("d/a2"));
    assert_eq!(fs::read(m.path("s")).unwrap(), b"hello!!"); // followed by the kernel
                                                            // Rename: replace, NOREPLACE, EXCHANGE.
    fs::write(m.path("b"), b"bee").unwrap();
    assert_eq!(
        renameat2(&m.path("b"), &m.path("a"), libc::RENAME_NOREPLACE),
        libc::EEXIST
    );
    assert_eq!(
        renameat2(&m.path("b"), &m.path("a"), libc::RENAME_EXCHANGE),
        0
    );
    assert_eq!(fs::read(m.path("a")).unwrap(), b"bee");
    assert_eq!(fs::read(m.path("b")).unwrap(), b"hello!!");
    fs::rename(m.path("b"), m.path("c")).unwrap();
    assert!(!m.path("b").exists());
    // Attributes.
    fs::set_permissions(m.path("c"), fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(m.path("c"), Some(1234), Some(5678)).unwrap();
    let when = std::time::UNIX_EPOCH + Duration::new(1_000_000_000, 123_456_789);
    // As cp -p, tar and rsync -t do: a write (still in iomapfs's cache),
    // then the time. Writeback at unmount must leave it (checked after the
    // remount below).
    let c = File::options().write(true).open(m.path("c")).unwrap();
    c.write_all_at_helper(b"!", 7);
    c.set_modified(when).unwrap();
    drop(c);
    let md = fs::metadata(m.path("c")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o640);
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_000_000_000, 123_456_789));
    // Extended attributes.
    let (p, n) = (cstr(&m.path("c")), CString::new("user.color").unwrap());
    // SAFETY: valid paths, names and buffers for the calls' duration.
    unsafe {
        assert_eq!(
            libc::setxattr(p.as_ptr(), n.as_ptr(), b"blue".as_ptr().cast(), 4, 0),
            0
        );
        let mut buf = [0u8; 16];
        let len = libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), 16);
        assert_eq!(&buf[..len as usize], b"blue");
        assert_eq!(
            libc::setxattr(
                p.as_ptr(),
                n.as_ptr(),
                b"x".as_ptr().cast(),
                1,
                libc::XATTR_CREATE
            ),
            -1
        );
        assert_eq!(errno(), libc::EEXIST);
        let t = CString::new("trusted.x").unwrap();
        assert_eq!(
            libc::setxattr(p.as_ptr(), t.as_ptr(), b"x".as_ptr().cast(), 1, 0),
            -1
        );
        assert_eq!(errno(), libc::EOPNOTSUPP);
    }
    // fallocate modes and SEEK_DATA/SEEK_HOLE.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("sparse"))
        .unwrap();
    assert_eq!(fallocate(&f, 0, 0, 1 << 20), 0);
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    assert_eq!(
        fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 1 << 20, 1 << 20),
        0
    );
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    f.write_all_at_helper(&[7u8; 8192], 0);
    assert_eq!(
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            4096,
            4096
        ),
        0
    );
    assert_eq!(fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 0, 1024), 0);
    let mut back = vec![0u8; 8192];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 0).unwrap();
    assert!(back[..1024].iter().all(|&b| b == 0) && back[1024..4096].iter().all(|&b| b == 7));
    assert!(back[4096..].iter().all(|&b| b == 0));
    assert_eq!(lseek(&f, 0, libc::SEEK_DATA), Ok(0));
    assert_eq!(lseek(&f, 8192, libc::SEEK_HOLE), Ok(1 << 20));
    assert_eq!(lseek(&f, 1 << 20, libc::SEEK_DATA), Err(libc::ENXIO));
    let g = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("holes"))
        .unwrap();
    g.write_all_at_helper(&[1u8; 4096], 1 << 20);
    assert_eq!(lseek(&g, 0, libc::SEEK_HOLE), Ok(0));
    assert_eq!(lseek(&g, 0, libc::SEEK_DATA), Ok(1 << 20));
    drop((f, g));
    // statfs and unlink.
    // SAFETY: statvfs is plain old data (integers only): all zeros is a
    // valid value of it.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and an out struct we own.
    assert_eq!(unsafe { libc::statvfs(cstr(&m.mnt).as_ptr(), &mut sv) }, 0);
    assert_eq!(sv.f_bsize, 4096);
    assert!(sv.f_bfree > 0 && sv.f_bfree < sv.f_blocks);
    fs::remove_file(m.path("d/a2")).unwrap();
    let names: Vec<String> = fs::read_dir(&m.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["a", "c", "d", "holes", "s", "sparse"]);
    // Everything survives a clean unmount and remount; fsck agrees.
    m.unmount();
    let report = m.fsck_clean();
    assert!(report.contains("journal records replayed  0"), "{report}");
    m.mount_over(transport, "");
    assert_eq!(fs::read(m.path("a")).unwrap(), b"bee");
    assert_eq!(fs::read(m.path("c")).unwrap(), b"hello!!!");
    let md = fs::metadata(m.path("c")).unwrap();
    assert_eq!((md.mode() & 0o7777, md.uid(), md.nlink()), (0o640, 1234, 1));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!(fs::read_link(m.path("s")).unwrap(), Path::new("d/a2"));
    m.unmount();
}

trait WriteAt {
    fn write_all_at_helper(&self, data: &[u8], off: u64);
}

impl WriteAt for File {
    fn write_all_at_helper(&self, data: &[u8], off: u64) {
        std::os::unix::fs::FileExt::write_all_at(self, data, off).unwrap();
    }
}

/// A 4 KiB-aligned buffer for O_DIRECT (the kernel checks user buffers of
/// direct opens before they reach FUSE only on real files; aligned anyway).
fn aligned(len: usize, fill: u8) -> Vec<u8> {
    let mut v = vec![fill; len + 4096];
    let off = v.as_ptr().align_offset(4096);
    v.drain(..off);
    v.truncate(len);
    v
}

/// A shared writable mapping of `len` bytes of `file`, unmapped on drop.
struct SharedMap {
    ptr: *mut u8,
    len: usize,
}

impl SharedMap {
    fn new(file: &File, len: usize) -> SharedMap {
        // SAFETY: a fresh shared mapping of an open file; the kernel picks
        // the address; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        SharedMap {
            ptr: ptr.cast(),
            len,
        }
    }

    /// Whether the page at `offset` is in the page cache (`mincore`),
    /// without touching it.
    fn resident(&self, offset: usize) -> bool {
        let mut vec = [0u8; 1];
        // SAFETY: asks about one page inside the mapping; `vec` has room
        // for its one byte.
        let rc = unsafe { libc::mincore(self.ptr.add(offset).cast(), 4096, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec[0] & 1 == 1
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, alive
        // until drop, and only reached through this exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

over_both_transports!(
    direct_and_buffered_opens_see_each_others_writes,
    direct_and_buffered_opens_see_each_others_writes_over_io_uring,
    direct_and_buffered_opens_see_each_others_writes_over
);

/// O_DIRECT and buffered opens (and a shared mapping) of one file see each
/// other's writes at once, in every caching mode: without the kernel page
/// cache iomapfs keeps them coherent; with it, the kernel writes cached
/// pages back before a direct read and drops them after a direct write.
fn direct_and_buffered_opens_see_each_others_writes_over(transport: Transport) {
    need_transport!(transport);
    for mode in ["direct_io", "kernel_cache", "writeback_cache"] {
        let mut m = Mounted::new("64m");
        m.mount_over(transport, mode);
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .custom_flags(libc::O_DIRECT)
            .open(m.path("f"))
            .unwrap();
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("f"))
            .unwrap();
        for round in 0..20u8 {
            let off = u64::from(round) * 8192;
            // Buffered write, direct read.
            buffered.write_all_at_helper(&[round + 1; 4096], off);
            let mut buf = aligned(4096, 0);
            std::os::unix::fs::FileExt::read_exact_at(&direct, &mut buf, off).unwrap();
            assert!(
                buf.iter().all(|&b| b == round + 1),
                "{mode} round {round}: direct read"
            );
            // Direct write, buffered read (no stale cached copy).
            direct.write_all_at_helper(&aligned(4096, round + 100), off);
            let mut buf = vec![0u8; 4096];
            std::os::unix::fs::FileExt::read_exact_at(&buffered, &mut buf, off).unwrap();
            assert!(
                buf.iter().all(|&b| b == round + 100),
                "{mode} round {round}: buffered read"
            );
        }
        // Unaligned direct I/O works (iomapfs does read-modify-write).
        direct.write_all_at_helper(b"xyz", 4095);
        let mut buf = [0u8; 5];
        std::os::unix::fs::FileExt::read_exact_at(&buffered, &mut buf, 4094).unwrap();
        // Byte 4094 is round 0's direct write; 4098 was never written.
        assert_eq!(&buf, &[100, b'x', b'y', b'z', 0], "{mode}");
        // A store through a shared mapping (not synced) is seen by a direct
        // read; a direct write is seen through the mapping.
        // (4 MiB, so that its last MiB is far from the pages faulted in.)
        buffered.set_len(4 << 20).unwrap();
        let mut map = SharedMap::new(&buffered, 4 << 20);
        map.bytes()[8192..12288].fill(0xa5);
        let mut buf = aligned(4096, 0);
        std::os::unix::fs::FileExt::read_exact_at(&direct, &mut buf, 8192).unwrap();
        assert!(
            buf.iter().all(|&b| b == 0xa5),
            "{mode}: direct read of a mapped store"
        );
        direct.write_all_at_helper(&aligned(4096, 0x5a), 16384);
        assert!(
            map.bytes()[16384..20480].iter().all(|&b| b == 0x5a),
            "{mode}: mapped read of a direct write"
        );
        // The page a buffered read brought in stays in the kernel page
        // cache exactly when the mode uses it.
        let mut buf = vec![0u8; 4096];
        std::os::unix::fs::FileExt::read_exact_at(&buffered, &mut buf, 3 << 20).unwrap();
        assert_eq!(
            map.resident(3 << 20),
            mode != "direct_io",
            "{mode}: page cache residency after a buffered read"
        );
        drop(map);
        drop((direct, buffered));
        m.unmount();
        m.fsck_clean();
    }
}

/// Appends a byte to `name` in `dir` as user and group 65534 (no
/// capabilities): the shell enters `dir` as root, then drops privileges.
fn append_as_nobody(dir: &Path, name: &str) {
    let status = Command::new("sh")
        .current_dir(dir)
        .args([
            "-c",
            &format!(
            "exec setpriv --reuid=65534 --regid=65534 --clear-groups sh -c 'printf x >> {name}'"
        ),
        ])
        .status()
        .unwrap();
    assert!(status.success(), "append to {name} as nobody: {status}");
}

over_both_transports!(
    unprivileged_writes_drop_setuid_and_setgid,
    unprivileged_writes_drop_setuid_and_setgid_over_io_uring,
    unprivileged_writes_drop_setuid_and_setgid_over
);

/// A write by a caller without CAP_FSETID drops set-user-ID, and
/// set-group-ID where group execute is set, in every caching mode (the
/// daemon does it: it takes FUSE_HANDLE_KILLPRIV_V2); root's writes keep
/// them.
fn unprivileged_writes_drop_setuid_and_setgid_over(transport: Transport) {
    need_transport!(transport);
    for mode in ["direct_io", "kernel_cache", "writeback_cache"] {
        let mut m = Mounted::new("64m");
        m.mount_over(transport, &format!("allow_other,{mode}"));
        for (name, before, after) in [
            ("both", 0o6777, 0o0777),
            // Set-group-ID without group execute is not a privilege.
            ("mandatory-lock", 0o2767, 0o2767),
            ("suid-only", 0o4766, 0o0766),
        ] {
            fs::write(m.path(name), b"root").unwrap();
            fs::set_permissions(m.path(name), fs::Permissions::from_mode(before)).unwrap();
            // Root (CAP_FSETID) keeps the bits.
            fs::OpenOptions::new()
                .append(true)
                .open(m.path(name))
                .unwrap()
                .write_all(b"!")
                .unwrap();
            let mode_of = |p: PathBuf| fs::metadata(p).unwrap().mode() & 0o7777;
            assert_eq!(mode_of(m.path(name)), before, "{mode} {name}: root's write");
            append_as_nobody(&m.mnt, name);
            assert_eq!(
                mode_of(m.path(name)),
                after,
                "{mode} {name}: {before:#o} after an unprivileged write"
            );
            assert_eq!(fs::read(m.path(name)).unwrap(), b"root!x", "{mode} {name}");
        }
        m.unmount();
        // The dropped bits were journaled and checkpointed.
        let report = m.fsck_clean();
        assert!(report.contains("clean"), "{report}");
    }
}

over_both_transports!(
    a_mounted_target_is_refused_and_signals_unmount_cleanly,
    a_mounted_target_is_refused_and_signals_unmount_cleanly_over_io_uring,
    a_mounted_target_is_refused_and_signals_unmount_cleanly_over
);

fn a_mounted_target_is_refused_and_signals_unmount_cleanly_over(transport: Transport) {
    need_transport!(transport);
    let mut m = Mounted::new("64m");
    let pid = m.mount_over(transport, "");
    let second = iomapfs(&["mount", m.img(), m.mnt.to_str().unwrap()]);
    assert_eq!(second.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use"));
    // Nor may io or fsck open the mounted image file.
    for (args, code) in [
        (vec!["io", m.img(), "-c", "ls /"], 1),
        (vec!["fsck", m.img()], 2),
    ] {
        let refused = iomapfs(&args);
        let err = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains("in use"), "{args:?}: {err}");
    }
    fs::write(m.path("x"), b"kept").unwrap();
    // SIGTERM: unmounted, written back, checkpointed.
    // SAFETY: kill on the daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    wait_until(
        "the daemon exits on SIGTERM",
        Duration::from_secs(30),
        || !alive(pid),
    );
    m.pid = None;
    assert!(!is_mounted(&m.mnt));
    let report = m.fsck_clean();
    assert!(report.contains("journal records replayed  0"), "{report}");
    // SIGINT to a foreground mount.
    let mut child = Command::new(BIN)
        .args(["mount", "--foreground", m.img(), m.mnt.to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = [0u8; 7];
    child.stdout.take().unwrap().read_exact(&mut line).unwrap();
    assert_eq!(&line, b"mounted");
    assert_eq!(fs::read(m.path("x")).unwrap(), b"kept");
    fs::write(m.path("y"), b"also").unwrap();
    // SAFETY: kill on the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert!(status.success(), "foreground mount after SIGINT: {status}");
    assert!(!is_mounted(&m.mnt));
    let report = m.fsck_clean();
    assert!(report.contains("journal records replayed  0"), "{report}");
}

over_both_transports!(
    kill_9_during_writes_keeps_every_fsynced_byte,
    kill_9_during_writes_keeps_every_fsynced_byte_over_io_uring,
    kill_9_during_writes_keeps_every_fsynced_byte_over
);

fn kill_9_during_writes_keeps_every_fsynced_byte_over(transport: Transport) {
    need_transport!(transport);
    let mut m = Mounted::new("256m");
    let pid = m.mount_over(transport, "");
    // Writers append 4 KiB records (direct and buffered) and fsync every
    // few; each remembers how many records were fsynced.
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4u8)
        .map(|w| {
            let path = m.path(&format!("w{w}"));
            let stop = stop.clone();
            std::thread::spawn(move || -> u64 {
                let mut opts = OpenOptions::new();
                opts.write(true).create(true).truncate(true);
                if w % 2 == 0 {
                    opts.custom_flags(libc::O_DIRECT);
                }
                let Ok(f) = opts.open(&path) else { return 0 };
                let mut synced = 0u64;
                for i in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let rec = aligned(4096, (i % 251) as u8 + w);
                    if std::os::unix::fs::FileExt::write_all_at(&f, &rec, i * 4096).is_err() {
                        break;
                    }
                    if i % 4 == 3 {
                        if f.sync_data().is_err() {
                            break;
                        }
                        synced = i + 1;
                    }
                }
                synced
            })
        })
        .collect();
    // Kill once every writer has fsynced something.
    wait_until("writers fsync", Duration::from_secs(60), || {
        (0..4).all(|w| fs::metadata(m.path(&format!("w{w}"))).is_ok_and(|md| md.len() >= 64 * 1024))
    });
    // SAFETY: kill on the daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_until("the daemon dies", Duration::from_secs(10), || !alive(pid));
    m.pid = None;
    stop.store(true, Ordering::Relaxed);
    let synced: Vec<u64> = writers.into_iter().map(|t| t.join().unwrap()).collect();
    // The dead mount must be cleared before the next.
    let st = Command::new("umount")
        .arg("-l")
        .arg(&m.mnt)
        .status()
        .unwrap();
    assert!(st.success());
    let report = m.fsck_clean();
    assert!(
        !report.contains("journal records replayed  0"),
        "nothing to recover? {report}"
    );
    m.mount_over(transport, "");
    for (w, &n) in synced.iter().enumerate() {
        assert!(n > 0, "writer {w} never fsynced");
        let data = fs::read(m.path(&format!("w{w}"))).unwrap();
        assert!(
            data.len() as u64 >= n * 4096,
            "w{w}: {} bytes, {n} records fsynced",
            data.len()
        );
        for i in 0..n {
            let want = (i % 251) as u8 + w as u8;
            let rec = &data[(i * 4096) as usize..((i + 1) * 4096) as usize];
            assert!(
                rec.iter().all(|&b| b == want),
                "w{w} record {i} lost or damaged"
            );
        }
    }
    m.unmount();
    m.fsck_clean();
}

over_both_transports!(
    concurrent_clients_on_one_file_and_on_many,
    concurrent_clients_on_one_file_and_on_many_over_io_uring,
    concurrent_clients_on_one_file_and_on_many_over
);

fn concurrent_clients_on_one_file_and_on_many_over(transport: Transport) {
    need_transport!(transport);
    let mut m = Mounted::new("256m");
    m.mount_over(transport, "threads=4");
    let shared = m.path("shared");
    File::create(&shared).unwrap();
    let threads: Vec<_> = (0..6u8)
        .map(|t| {
            let shared = shared.clone();
            let own = m.path(&format!("own{t}"));
            std::thread::spawn(move || {
                let mut opts = OpenOptions::new();
                opts.read(true).write(true);
                if t % 2 == 0 {
                    opts.custom_flags(libc::O_DIRECT);
                }
                let f = opts.open(&shared).unwrap();
                let mut o = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&own)
                    .unwrap();
                for i in 0..64u64 {
                    // Interleaved 4 KiB slots of one file, and a file each.
                    let slot = (i * 6 + u64::from(t)) * 4096;
                    f.write_all_at_helper(&aligned(4096, t + 1), slot);
                    o.write_all(&[t ^ (i as u8); 1000]).unwrap();
                }
                o.sync_all().unwrap();
                o.seek(SeekFrom::Start(0)).unwrap();
                let mut back = Vec::new();
                o.read_to_end(&mut back).unwrap();
                for (i, chunk) in back.chunks(1000).enumerate() {
                    assert!(
                        chunk.iter().all(|&b| b == t ^ (i as u8)),
                        "own{t} chunk {i}"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let data = fs::read(&shared).unwrap();
    assert_eq!(data.len(), 64 * 6 * 4096);
    for (slot, chunk) in data.chunks(4096).enumerate() {
        let want = (slot % 6) as u8 + 1;
        assert!(chunk.iter().all(|&b| b == want), "shared slot {slot}");
    }
    m.unmount();
    m.fsck_clean();
}

over_both_transports!(
    fio_verifies_crc32c_through_the_mount_direct_and_buffered,
    fio_verifies_crc32c_through_the_mount_direct_and_buffered_over_io_uring,
    fio_verifies_crc32c_through_the_mount_direct_and_buffered_over
);

/// fio writes with crc32c verification headers and reads them back, direct
/// and buffered, four jobs each.
fn fio_verifies_crc32c_through_the_mount_direct_and_buffered_over(transport: Transport) {
    need_transport!(transport);
    skip_if!(Command::new("fio")
        .arg("--version")
        .output()
        .is_err()
        .then_some("fio is not installed"));
    for mode in ["direct_io", "kernel_cache", "writeback_cache"] {
        fio_verifies_in_mode(transport, mode);
    }
}

fn fio_verifies_in_mode(transport: Transport, mode: &str) {
    let mut m = Mounted::new("512m");
    m.mount_over(transport, &format!("threads=4,{mode}"));
    // psync jobs, and io_uring at depth 16, whose direct I/O the kernel
    // queues to the daemon without waiting (FUSE_ASYNC_DIO).
    for (direct, rw, engine) in [
        (1, "randwrite", "psync"),
        (0, "randwrite", "psync"),
        (1, "write", "psync"),
        (0, "rw", "psync"),
        (1, "randrw", "io_uring"),
    ] {
        let out = Command::new("fio")
            .args([
                "--name=mnt",
                &format!("--directory={}", m.mnt.display()),
                "--size=16m",
                "--bs=4k",
                "--bsrange=4k-64k",
                &format!("--rw={rw}"),
                &format!("--direct={direct}"),
                &format!("--ioengine={engine}"),
                "--iodepth=16",
                "--numjobs=4",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--group_reporting",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && text.contains("err= 0")
                && !text.contains("bad magic")
                && !text.contains("crc32c: verify failed"),
            "{mode}: fio direct={direct} rw={rw} {engine}: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    m.unmount();
    m.fsck_clean();
}

over_both_transports!(
    pjdfstest_passes_through_the_mount,
    pjdfstest_passes_through_the_mount_over_io_uring,
    pjdfstest_passes_through_the_mount_over
);

/// The POSIX conformance suite pjdfstest (its Rust port, crates.io
/// `pjdfstest` 0.2.2, which .ci/run installs) against the mount: every test
/// that can apply passes. Those that cannot apply are skipped by the suite
/// itself and counted: a second file system (EXDEV), and LINK_MAX (FUSE has
/// no pathconf). The 13 EROFS tests remount read-only with mount(8)
/// (through our helper) and run on their own, in a second run: the suite's
/// `open::einval_invalid_combination` and `posix_fallocate` tests leak
/// descriptors open for writing, and Linux refuses a read-only remount
/// (EBUSY) while one is open, whatever the file system.
fn pjdfstest_passes_through_the_mount_over(transport: Transport) {
    need_transport!(transport);
    let program = std::env::var_os("IOMAPFS_PJDFSTEST")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join("pjdfstest"))
                    .find(|p| p.exists())
            })
        });
    skip_if!(program
        .is_none()
        .then_some("pjdfstest is not installed (cargo install pjdfstest)"));
    let program = program.expect("checked above");
    let _helper = MountHelper::install();
    let mut m = Mounted::new("4g");
    // The suite switches to other users: they must reach the mount.
    m.mount_over(transport, "allow_other");
    let run = |allow_remount: bool, patterns: &[&str], least: usize| {
        let config = m.dir.path().join(format!("pjdfstest-{allow_remount}.toml"));
        fs::write(
            &config,
            format!(
                r#"
[features]
posix_fallocate = {{}}
rename_ctime = {{}}
utimensat = {{}}
utime_now = {{}}

[settings]
naptime = 0.001
allow_remount = {allow_remount}

[dummy_auth]
entries = [["nobody", "nogroup"], ["daemon", "daemon"]]
"#
            ),
        )
        .unwrap();
        let out = Command::new(&program)
            .arg("-c")
            .arg(&config)
            .arg("-p")
            .arg(&m.mnt)
            .args(patterns)
            .current_dir(&m.mnt)
            .output()
            .unwrap_or_else(|e| panic!("cannot run pjdfstest at {}: {e}", program.display()));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let count = |end: &str| text.lines().filter(|l| l.trim_end().ends_with(end)).count();
        let (passed, failed, skipped) = (count(" ok"), count("FAILED"), count("skipped"));
        eprintln!("pjdfstest {patterns:?}: {passed} passed, {failed} failed, {skipped} skipped");
        assert!(
            out.status.success() && failed == 0 && passed >= least,
            "pjdfstest {patterns:?}: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let text = run(false, &[], 300);
    // Every skip has one of the reasons the doc comment lists, or is an
    // EROFS test, run below.
    let reasons: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with('\t'))
        .map(str::trim)
        .collect();
    for r in &reasons {
        assert!(
            r.contains("allow_remount")
                || r.contains("secondary file-system")
                || r.contains("LINK_MAX"),
            "pjdfstest skipped for an unexpected reason: {r}"
        );
    }
    let erofs = run(true, &["erofs"], 13);
    assert!(
        !erofs.lines().any(|l| l.trim_end().ends_with("skipped")),
        "an EROFS test was skipped:\n{erofs}"
    );
    m.unmount();
    m.fsck_clean();
}

/// mount(8) drives a volume as any file system through the helper
/// `mount.fuse.iomapfs` (this binary by that name): `mount -t
/// fuse.iomapfs IMAGE DIR -o OPTIONS` (an fstab line's form, its generic
/// words dropped, mount flags such as noexec applied) mounts it; `mount -o remount,ro DIR` makes every change
/// fail with EROFS and `remount,rw` undoes it, both keeping the mount's
/// other flags; the data survives and fsck is clean.
#[test]
fn mount_8_mounts_and_remounts_through_the_helper() {
    need_fuse!();
    let _helper = MountHelper::install();
    let mut m = Mounted::new("128m");
    let mnt = m.mnt.to_str().unwrap().to_string();
    let out = mount_cmd(&[
        "-t",
        "fuse.iomapfs",
        m.img(),
        &mnt,
        "-o",
        "defaults,noauto,threads=2,noexec,nosuid",
    ]);
    assert!(
        out.status.success(),
        "mount -t fuse.iomapfs: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    m.pid = text
        .rsplit("daemon pid ")
        .next()
        .and_then(|s| s.trim().trim_end_matches(')').parse().ok());
    assert!(m.pid.is_some(), "no daemon pid in {text:?}");
    assert!(is_mounted(&m.mnt));
    assert_eq!(mount_type(&m.mnt).as_deref(), Some("fuse.iomapfs"));
    fs::write(m.path("kept"), b"before").unwrap();
    let flags = |m: &Mounted| -> Vec<String> {
        let canonical = m.mnt.canonicalize().unwrap();
        iomapfs_mount::mountinfo::mount_at(&canonical)
            .unwrap()
            .expect("mounted")
            .options
    };
    for (mode, other) in [("ro", "rw"), ("rw", "ro")] {
        let out = mount_cmd(&["-o", &format!("remount,{mode}"), &mnt]);
        assert!(
            out.status.success(),
            "mount -o remount,{mode}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let now = flags(&m);
        assert!(
            now.contains(&mode.to_string()) && !now.contains(&other.to_string()),
            "remount,{mode}: {now:?}"
        );
        for kept in ["nosuid", "nodev", "noatime", "noexec"] {
            assert!(
                now.contains(&kept.to_string()),
                "remount lost {kept}: {now:?}"
            );
        }
        let write = fs::write(m.path(&format!("new-{mode}")), mode.as_bytes());
        if mode == "ro" {
            assert_eq!(
                write.unwrap_err().raw_os_error(),
                Some(libc::EROFS),
                "a change on a read-only remount"
            );
        } else {
            write.unwrap();
        }
        assert_eq!(fs::read(m.path("kept")).unwrap(), b"before");
    }
    m.unmount();
    m.fsck_clean();
    m.mount(&[]);
    assert_eq!(fs::read(m.path("new-rw")).unwrap(), b"rw");
    assert!(!m.path("new-ro").exists());
    m.unmount();
}
