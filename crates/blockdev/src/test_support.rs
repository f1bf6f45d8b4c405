//! Plumbing for the unit tests that need root: loop devices over temp
//! images, and skipping with a printed reason (or failing, in CI).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Held for the whole of each test that attaches a loop device: one test's
/// commands (`losetup`, `partx`, any child) hold a copy of every descriptor
/// of this process between their fork and their exec, so a device another
/// test just closed could still look open to that test's checks.
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    static LOOP_TESTS: Mutex<()> = Mutex::new(());
    // A test that failed holding it leaves nothing to repair.
    LOOP_TESTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Skips a privileged test, or fails it where CI promised privileges.
pub(crate) fn skip_privileged(why: &str) {
    if std::env::var_os("IOMAPFS_REQUIRE_PRIVILEGED").is_some_and(|v| v == "1") {
        panic!("privileged test cannot run: {why}");
    }
    eprintln!("skipping privileged test: {why}");
}

pub(crate) fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A loop device this test attached; detached (by its own name) on drop.
/// Its queue settings outlive detaching, so any the test changes are
/// put back first.
pub(crate) struct Loop {
    pub(crate) dev: PathBuf,
    pub(crate) write_cache: String,
}

impl Loop {
    pub(crate) fn set_write_cache(&self, value: &str) {
        std::fs::write(self.sysfs("queue/write_cache"), value).unwrap();
    }

    pub(crate) fn sysfs(&self, attr: &str) -> String {
        let name = self.dev.file_name().unwrap().to_string_lossy();
        format!("/sys/block/{name}/{attr}")
    }

    /// Detaches the device now, and says whether it went: a device still
    /// open when `losetup -d` runs stays attached (marked autoclear) until
    /// it is closed. Once called, dropping does nothing (the number may
    /// belong to another test's device by then).
    pub(crate) fn detach(self) -> Result<(), String> {
        let mut this = std::mem::ManuallyDrop::new(self);
        this.undo()?;
        let backing = this.sysfs("loop/backing_file");
        if Path::new(&backing).exists() {
            return Err(format!(
                "{} still attached after losetup -d: something still has it open",
                this.dev.display()
            ));
        }
        // The fields own memory only; nothing else to undo.
        drop(std::mem::take(&mut this.dev));
        drop(std::mem::take(&mut this.write_cache));
        Ok(())
    }

    /// Puts the write cache setting back and detaches the device.
    fn undo(&self) -> Result<(), String> {
        let _ = std::fs::write(self.sysfs("queue/write_cache"), &self.write_cache);
        let _ = run("partx", &["-d", &self.dev.to_string_lossy()]);
        run("losetup", &["-d", &self.dev.to_string_lossy()]).map(|_| ())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.undo();
    }
}

/// A loop device over a fresh temp image of `size` bytes, or `None` (the
/// test skipped, with the reason printed) when not root or when no loop
/// device can be attached.
pub(crate) fn attach_loop(size: u64) -> Option<(tempfile::TempDir, Loop)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip_privileged("not root");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; size as usize]).unwrap();
    match run("losetup", &["--find", "--show", img.to_str().unwrap()]) {
        Ok(dev) => {
            let dev = PathBuf::from(dev);
            let write_cache = sysfs_queue(&dev, "write_cache");
            Some((dir, Loop { dev, write_cache }))
        }
        Err(e) => {
            skip_privileged(&e);
            None
        }
    }
}

/// `queue/ATTR` of block device `loop_dev` in sysfs.
pub(crate) fn sysfs_queue(loop_dev: &Path, attr: &str) -> String {
    let name = loop_dev.file_name().unwrap().to_string_lossy();
    std::fs::read_to_string(format!("/sys/block/{name}/queue/{attr}"))
        .unwrap()
        .trim()
        .to_owned()
}
