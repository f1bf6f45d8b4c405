//! Taking a mount away from the namespace, as root or as a user.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

/// Unmounts `mountpoint` lazily (it goes from the namespace now; the
/// session ends when the last open file closes): `umount2` as root,
/// `fusermount3 -u -z` (or `fusermount`) otherwise.
pub fn unmount(mountpoint: &Path) -> io::Result<()> {
    let c = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated path for the call's duration.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(err);
    }
    for helper in ["fusermount3", "fusermount"] {
        if let Ok(status) = Command::new(helper)
            .arg("-u")
            .arg("-z")
            .arg(mountpoint)
            .status()
        {
            return if status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!("{helper} -u failed: {status}")))
            };
        }
    }
    Err(err)
}
