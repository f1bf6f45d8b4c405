//! The devices a run measures on, and their teardown.
//!
//! Default bed (no `--device`):
//! - root with zram: `/dev/zram0` reset and sized to [`ZRAM_BYTES`] (4 KiB
//!   sectors, no write cache) for the 4 KiB direct workloads, and a loop
//!   device over a file on tmpfs with 512-byte sectors and direct I/O (a
//!   volatile write cache, so flushes exist; no compression, so its speed
//!   does not depend on the data) for the sub-block, DSYNC and buffered
//!   workloads;
//! - root without usable zram: the loop device for everything;
//! - not root (or neither works): an image file in a temporary directory.
//!
//! Everything set up is torn down by Drop guards — on success, error, panic
//! and interrupt alike: file systems unmounted (see `kernel`), loop devices
//! detached, zram reset, temporary files removed. Runs that use zram or loop
//! devices hold an exclusive `flock` on [`LOCK_PATH`] for their whole
//! length, so two benches (or tests) never share them.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use blockdev::{BackendChoice, DeviceCaps, WriteMode};
use tempfile::TempDir;

use crate::interrupt::stop_requested;
use crate::safety;
use crate::target::open_device;
use crate::workload::{DeviceNeed, IoPattern};
use crate::{Backend, BenchError, BenchOptions, Progress};

/// Serialises use of zram and loop devices between runs and tests.
pub const LOCK_PATH: &str = "/tmp/iomapfs-zram.lock";
/// The zram device bench takes over.
pub const ZRAM_NAME: &str = "zram0";
/// While bench owns zram, this file holds its pid: a later run (holding
/// the lock) that finds the file with a dead pid knows zram is a leftover of
/// a bench that was killed, and resets it.
pub const ZRAM_OWNER_PATH: &str = "/tmp/iomapfs-bench-zram.owner";
/// Size given to zram.
pub const ZRAM_BYTES: u64 = 512 << 20;
/// Size of the loop device's backing file on tmpfs.
pub const LOOP_BYTES: u64 = 512 << 20;
/// Size of the image file used without root.
pub const IMAGE_BYTES: u64 = 512 << 20;
/// Logical block size of the loop device (sub-block workloads need 512).
pub const LOOP_SECTOR: u32 = 512;
/// Prefix of every temporary directory bench makes (tests look for
/// leftovers by it).
pub const TEMP_PREFIX: &str = "iomapfs-bench-";
/// Bytes zeroed at the start of an explicit device after the run, so it is
/// not mistaken for the last file system bench made on it.
const WIPE_BYTES: u64 = 1 << 20;
/// How long teardown retries a busy device before giving up.
const TEARDOWN_PATIENCE: Duration = Duration::from_secs(5);

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// What a bed device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BedKind {
    Zram,
    LoopOnTmpfs,
    BlockDevice,
    ImageFile,
}

impl BedKind {
    pub fn label(self) -> &'static str {
        match self {
            BedKind::Zram => "zram",
            BedKind::LoopOnTmpfs => "loop (tmpfs file)",
            BedKind::BlockDevice => "block device",
            BedKind::ImageFile => "image file",
        }
    }
}

/// One device of the bed, with its probed capabilities.
#[derive(Clone, Debug)]
pub struct BedDevice {
    pub path: PathBuf,
    pub kind: BedKind,
    pub caps: DeviceCaps,
    /// The backend raw and iomapfs targets use on it, and why.
    pub backend: BackendChoice,
    /// The file behind a loop device.
    pub backing_file: Option<PathBuf>,
}

/// The devices of one run, and the guards that tear them down. Fields drop
/// in declaration order: devices before the files and mounts under them,
/// the lock last.
pub struct Testbed {
    pub devices: Vec<BedDevice>,
    /// Index in `devices` for each need.
    any: usize,
    small_sectors: usize,
    volatile: usize,
    data_independent: usize,
    /// Things worth telling the user about how the bed was chosen.
    pub notes: Vec<String>,
    wipe: Option<WipeGuard>,
    zram: Option<ZramGuard>,
    loop_dev: Option<LoopGuard>,
    backing_dir: Option<TempDir>,
    tmpfs: Option<TmpfsMount>,
    image_dir: Option<TempDir>,
    _lock: Option<DeviceLock>,
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Capabilities of the device at `path`, and the backend `backend` resolves
/// to on it (Auto probes), with the reason.
fn probe(path: &Path, backend: Backend) -> Result<(DeviceCaps, BackendChoice), BenchError> {
    let (dev, choice) = open_device(path, backend)?;
    Ok((dev.caps().clone(), choice))
}

impl Testbed {
    /// Sets up the bed for workloads with `needs`: the explicit device, or
    /// the default one described in the module docs.
    pub fn prepare(
        opts: &BenchOptions,
        needs: &[DeviceNeed],
        progress: &dyn Progress,
    ) -> Result<Testbed, BenchError> {
        let mut bed = Testbed {
            devices: Vec::new(),
            any: 0,
            small_sectors: 0,
            volatile: 0,
            data_independent: 0,
            notes: Vec::new(),
            wipe: None,
            zram: None,
            loop_dev: None,
            backing_dir: None,
            tmpfs: None,
            image_dir: None,
            _lock: None,
        };
        if let Some(path) = &opts.device {
            safety::check_explicit(path, opts.force)?;
            let (caps, backend) = probe(path, opts.backend)?;
            let kind = if fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device()) {
                BedKind::BlockDevice
            } else {
                BedKind::ImageFile
            };
            bed.wipe = Some(WipeGuard {
                path: path.clone(),
                backend: opts.backend,
                done: false,
            });
            bed.devices.push(BedDevice {
                path: path.clone(),
                kind,
                caps,
                backend,
                backing_file: None,
            });
            return Ok(bed);
        }

        let want_any = needs.contains(&DeviceNeed::Any);
        let want_loop = needs.iter().any(|n| *n != DeviceNeed::Any);
        if is_root() && !needs.is_empty() {
            bed._lock = Some(DeviceLock::acquire(progress)?);
            bed.notes.extend(recover_stale());
            if want_any {
                progress.set_message(&format!("setting up /dev/{ZRAM_NAME}"));
                match ZramGuard::setup(ZRAM_BYTES) {
                    Ok(guard) => {
                        let path = guard.dev_path();
                        bed.zram = Some(guard);
                        let (caps, backend) = probe(&path, opts.backend)?;
                        bed.devices.push(BedDevice {
                            path,
                            kind: BedKind::Zram,
                            caps,
                            backend,
                            backing_file: None,
                        });
                    }
                    Err(reason) => bed
                        .notes
                        .push(format!("zram not used: {reason}; using a loop device")),
                }
            }
            if want_loop || bed.devices.is_empty() {
                progress.set_message("setting up a loop device on tmpfs");
                match bed.setup_loop() {
                    Ok((path, backing_file)) => {
                        let (caps, backend) = probe(&path, opts.backend)?;
                        bed.devices.push(BedDevice {
                            path,
                            kind: BedKind::LoopOnTmpfs,
                            caps,
                            backend,
                            backing_file: Some(backing_file),
                        });
                    }
                    Err(reason) => bed.notes.push(format!("loop device not used: {reason}")),
                }
            }
        }
        if bed.devices.is_empty() {
            if !needs.is_empty() && !is_root() {
                bed.notes.push(
                    "not root: measuring on an image file in a temporary directory \
                     (raw = the file itself)"
                        .into(),
                );
            }
            let dir = tempfile::Builder::new()
                .prefix(TEMP_PREFIX)
                .tempdir()
                .map_err(|e| BenchError::io("temporary directory for the image", e))?;
            let path = dir.path().join("bench.img");
            create_sparse(&path, IMAGE_BYTES)?;
            bed.image_dir = Some(dir);
            let (caps, backend) = probe(&path, opts.backend)?;
            bed.devices.push(BedDevice {
                path,
                kind: BedKind::ImageFile,
                caps,
                backend,
                backing_file: None,
            });
        }
        // Assign: zram (if any) for Any; the loop device (if any) for the
        // rest; whatever exists otherwise.
        let find = |kind| bed.devices.iter().position(|d| d.kind == kind);
        let first = 0;
        bed.any = find(BedKind::Zram).unwrap_or(first);
        bed.small_sectors = find(BedKind::LoopOnTmpfs).unwrap_or(first);
        bed.volatile = bed.small_sectors;
        bed.data_independent = bed.small_sectors;
        Ok(bed)
    }

    /// Creates the tmpfs backing file and attaches the loop device; returns
    /// the device's path and the backing file's.
    fn setup_loop(&mut self) -> Result<(PathBuf, PathBuf), String> {
        let base = match tmpfs_dir() {
            Some(dir) => dir,
            None => {
                let mount = TmpfsMount::mount(LOOP_BYTES + (64 << 20))?;
                let dir = mount.dir.path().to_owned();
                self.tmpfs = Some(mount);
                dir
            }
        };
        let dir = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempdir_in(&base)
            .map_err(|e| format!("temporary directory in {}: {e}", base.display()))?;
        let file = dir.path().join("loop.img");
        create_sparse(&file, LOOP_BYTES).map_err(|e| e.to_string())?;
        self.backing_dir = Some(dir);
        let guard = LoopGuard::attach(&file)?;
        let path = guard.dev.clone();
        self.loop_dev = Some(guard);
        Ok((path, file))
    }

    /// The device for workloads with `need`.
    pub fn device(&self, need: DeviceNeed) -> &BedDevice {
        let index = match need {
            DeviceNeed::Any => self.any,
            DeviceNeed::SmallSectors => self.small_sectors,
            DeviceNeed::VolatileCache => self.volatile,
            DeviceNeed::DataIndependent => self.data_independent,
        };
        &self.devices[index]
    }

    /// The device a direct workload runs on, or why it cannot run here.
    pub fn device_for(&self, pattern: &IoPattern) -> Result<&BedDevice, String> {
        let dev = self.device(pattern.needs);
        let lbs = u64::from(dev.caps.logical_block_size);
        if !pattern.min_size.is_multiple_of(lbs) || !pattern.align.is_multiple_of(lbs) {
            return Err(format!(
                "{} has {lbs}-byte logical blocks; {}-byte direct I/O needs a device with \
                 logical blocks of at most {} bytes (e.g. a 512-byte-sector loop device)",
                dev.path.display(),
                pattern.min_size,
                pattern.min_size.min(pattern.align),
            ));
        }
        Ok(dev)
    }

    /// Tears everything down now, returning what could not be undone (also
    /// done by Drop, which cannot report).
    pub fn teardown(mut self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(w) = &mut self.wipe {
            problems.extend(w.release().err());
        }
        if let Some(z) = &mut self.zram {
            problems.extend(z.release().err());
        }
        if let Some(l) = &mut self.loop_dev {
            problems.extend(l.release().err());
        }
        if let Some(dir) = self.backing_dir.take() {
            let path = dir.path().to_owned();
            if let Err(e) = dir.close() {
                problems.push(format!("removing {}: {e}", path.display()));
            }
        }
        if let Some(t) = &mut self.tmpfs {
            problems.extend(t.release().err());
        }
        if let Some(dir) = self.image_dir.take() {
            let path = dir.path().to_owned();
            if let Err(e) = dir.close() {
                problems.push(format!("removing {}: {e}", path.display()));
            }
        }
        problems
    }
}

fn create_sparse(path: &Path, size: u64) -> Result<(), BenchError> {
    let file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| BenchError::io(format!("create {}", path.display()), e))?;
    file.set_len(size)
        .map_err(|e| BenchError::io(format!("size {}", path.display()), e))
}

/// A directory on tmpfs we may create files in, if the system has one.
fn tmpfs_dir() -> Option<PathBuf> {
    ["/dev/shm", "/run", "/tmp"]
        .iter()
        .map(PathBuf::from)
        .find(|p| is_tmpfs(p) && p.is_dir())
}

fn is_tmpfs(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct we own; `c` is a valid
    // NUL-terminated path for the duration of the call.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC
    }
}

/// Runs a setup command, returning its stdout or a message with its stderr.
pub(crate) fn run_command(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            stderr.trim()
        ))
    }
}

/// Retries `op` while it fails, until [`TEARDOWN_PATIENCE`] runs out.
fn retry<T>(mut op: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = Instant::now() + TEARDOWN_PATIENCE;
    loop {
        match op() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// An exclusive `flock` on [`LOCK_PATH`].
pub struct DeviceLock {
    _file: File,
}

impl DeviceLock {
    /// Waits for the lock (polling, so Ctrl-C still works while waiting).
    pub fn acquire(progress: &dyn Progress) -> Result<DeviceLock, BenchError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o666)
            .open(LOCK_PATH)
            .map_err(|e| BenchError::io(format!("open lock file {LOCK_PATH}"), e))?;
        let mut told = false;
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(DeviceLock { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(BenchError::io(format!("lock {LOCK_PATH}"), err));
            }
            if !told {
                progress.set_message(&format!(
                    "waiting for another user of zram/loop devices to finish ({LOCK_PATH})"
                ));
                told = true;
            }
            if stop_requested() {
                return Err(BenchError::Interrupted);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// zram0, sized for the run; reset on release.
struct ZramGuard {
    released: bool,
}

fn zram_sys(attr: &str) -> PathBuf {
    Path::new("/sys/block").join(ZRAM_NAME).join(attr)
}

impl ZramGuard {
    fn setup(bytes: u64) -> Result<ZramGuard, String> {
        if !zram_sys("disksize").exists() {
            return Err(format!("no /sys/block/{ZRAM_NAME} (modprobe zram)"));
        }
        let disksize = fs::read_to_string(zram_sys("disksize"))
            .map_err(|e| format!("read {ZRAM_NAME} disksize: {e}"))?;
        if disksize.trim() != "0" {
            return Err(format!(
                "/dev/{ZRAM_NAME} is already in use (disksize {}); bench only takes an unused \
                 zram device (reset it with `echo 1 > /sys/block/{ZRAM_NAME}/reset` if it is a \
                 leftover)",
                disksize.trim()
            ));
        }
        // Only after this write succeeds is the device ours to reset: if
        // someone initialised it since we looked, the write fails (EBUSY)
        // and we leave their device alone.
        fs::write(zram_sys("disksize"), bytes.to_string())
            .map_err(|e| format!("set {ZRAM_NAME} disksize: {e}"))?;
        let guard = ZramGuard { released: false };
        // Best effort: without the marker a killed run's zram is only
        // reported, not reclaimed.
        let _ = fs::write(ZRAM_OWNER_PATH, std::process::id().to_string());
        let dev = guard.dev_path();
        if !fs::metadata(&dev).is_ok_and(|m| m.file_type().is_block_device()) {
            return Err(format!("{} is not a block device node", dev.display()));
        }
        Ok(guard)
    }

    fn dev_path(&self) -> PathBuf {
        Path::new("/dev").join(ZRAM_NAME)
    }

    fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let reset = reset_zram();
        if reset.is_ok() {
            let _ = fs::remove_file(ZRAM_OWNER_PATH);
        }
        reset
    }
}

fn reset_zram() -> Result<(), String> {
    retry(|| {
        fs::write(zram_sys("reset"), "1").map_err(|e| format!("reset {ZRAM_NAME}: {e}"))?;
        match fs::read_to_string(zram_sys("disksize")) {
            Ok(s) if s.trim() == "0" => Ok(()),
            Ok(s) => Err(format!(
                "{ZRAM_NAME} disksize still {} after reset",
                s.trim()
            )),
            Err(e) => Err(format!("read {ZRAM_NAME} disksize: {e}")),
        }
    })
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// Unmounts every mount of `dev` whose mount point is a bench temp dir.
fn unmount_bench_mounts_of(dev: &Path) -> Vec<String> {
    let Ok(mounts) = fs::read_to_string("/proc/mounts") else {
        return Vec::new();
    };
    let mut done = Vec::new();
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (Some(source), Some(point)) = (f.next(), f.next()) else {
            continue;
        };
        if Path::new(source) == dev && point.contains(TEMP_PREFIX) {
            // A killed run's fio may still be finishing on it: retry.
            match retry(|| run_command("umount", &[point])) {
                Ok(_) => {
                    let _ = fs::remove_dir(point);
                    done.push(format!("unmounted {point}"));
                }
                Err(e) => done.push(format!("could not unmount {point}: {e}")),
            }
        }
    }
    done
}

/// Reclaims what a bench that was killed (SIGKILL, abort) left behind:
/// loop devices over `*/iomapfs-bench-*/loop.img` and zram with a dead
/// owner, with their bench mounts. Only called with the lock held, so no
/// live default run owns any of it. Returns notes of what was done.
fn recover_stale() -> Vec<String> {
    let mut notes = Vec::new();
    if let Ok(entries) = fs::read_dir("/sys/block") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(backing) = fs::read_to_string(e.path().join("loop/backing_file")) else {
                continue;
            };
            let backing = backing.trim().trim_end_matches(" (deleted)");
            let file = Path::new(backing);
            let ours = file.file_name().is_some_and(|n| n == "loop.img")
                && file
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|d| d.to_string_lossy().starts_with(TEMP_PREFIX));
            if !ours {
                continue;
            }
            let dev = Path::new("/dev").join(&name);
            notes.extend(unmount_bench_mounts_of(&dev));
            let detached = run_command("losetup", &["-d", &dev.to_string_lossy()]);
            if let Some(dir) = file.parent() {
                let _ = fs::remove_dir_all(dir);
            }
            notes.push(match detached {
                Ok(_) => format!("detached leftover {} ({backing})", dev.display()),
                Err(e) => format!("could not detach leftover {}: {e}", dev.display()),
            });
        }
    }
    if let Ok(owner) = fs::read_to_string(ZRAM_OWNER_PATH) {
        let pid = owner.trim().parse::<i32>().unwrap_or(0);
        if !pid_alive(pid) {
            notes.extend(unmount_bench_mounts_of(&Path::new("/dev").join(ZRAM_NAME)));
            match reset_zram() {
                Ok(()) => {
                    let _ = fs::remove_file(ZRAM_OWNER_PATH);
                    notes.push(format!(
                        "reset leftover /dev/{ZRAM_NAME} of bench pid {pid}"
                    ));
                }
                Err(e) => notes.push(format!("could not reset leftover /dev/{ZRAM_NAME}: {e}")),
            }
        }
    }
    notes
        .into_iter()
        .map(|n| format!("cleaned up after an earlier bench that did not finish: {n}"))
        .collect()
}

impl Drop for ZramGuard {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// A loop device over a tmpfs file: 512-byte sectors, direct I/O on the
/// backing file; detached on release.
struct LoopGuard {
    dev: PathBuf,
    released: bool,
}

impl LoopGuard {
    fn attach(file: &Path) -> Result<LoopGuard, String> {
        let file = file.to_str().ok_or("backing file path is not UTF-8")?;
        let sector = LOOP_SECTOR.to_string();
        let out = run_command(
            "losetup",
            &[
                "--sector-size",
                &sector,
                "--direct-io=on",
                "-f",
                "--show",
                file,
            ],
        )?;
        let dev = PathBuf::from(out.trim());
        if !dev.starts_with("/dev/") {
            return Err(format!("losetup printed {out:?}, not a device"));
        }
        Ok(LoopGuard {
            dev,
            released: false,
        })
    }

    fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let dev = self.dev.to_string_lossy().into_owned();
        retry(|| run_command("losetup", &["-d", &dev]).map(drop))
    }
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// A private tmpfs, for systems without one to put the loop file on.
struct TmpfsMount {
    dir: TempDir,
    mounted: bool,
}

impl TmpfsMount {
    fn mount(bytes: u64) -> Result<TmpfsMount, String> {
        let dir = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempdir()
            .map_err(|e| format!("temporary directory: {e}"))?;
        let at = dir
            .path()
            .to_str()
            .ok_or("temp path is not UTF-8")?
            .to_owned();
        let size = format!("size={bytes}");
        run_command("mount", &["-t", "tmpfs", "-o", &size, "tmpfs", &at])?;
        Ok(TmpfsMount { dir, mounted: true })
    }

    fn release(&mut self) -> Result<(), String> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        let at = self.dir.path().to_string_lossy().into_owned();
        retry(|| run_command("umount", &[&at]).map(drop))
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// Zeroes the start of an explicit device after the run, so the last file
/// system bench made there is not mistaken for data (and the next run does
/// not need `--force`).
struct WipeGuard {
    path: PathBuf,
    backend: Backend,
    done: bool,
}

impl WipeGuard {
    fn release(&mut self) -> Result<(), String> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let fail = |e: BenchError| format!("wiping the start of {}: {e}", self.path.display());
        let (dev, _) = open_device(&self.path, self.backend).map_err(fail)?;
        let len = WIPE_BYTES.min(dev.caps().size_bytes) as usize;
        let zeros = blockdev::AlignedBuf::new(len, 4096)
            .map_err(|e| fail(BenchError::setup("buffer", e.to_string())))?;
        dev.write_at(&zeros, 0, WriteMode::Normal)
            .and_then(|()| dev.flush())
            .map_err(|e| fail(BenchError::device("write", e)))
    }
}

impl Drop for WipeGuard {
    fn drop(&mut self) {
        let _ = self.release();
    }
}
