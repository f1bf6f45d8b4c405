//! `mount.fuse.iomapfs`: this binary as mount(8)'s helper for the
//! `fuse.iomapfs` type, so that `mount -t fuse.iomapfs IMAGE DIR`, an
//! fstab line and `mount -o remount,ro DIR` work as for any file system.
//!
//! mount(8) runs `/sbin/mount.fuse.iomapfs SOURCE DIR [-sfnv] [-o OPTIONS]
//! [-t TYPE]`, also for a remount of a mounted volume (it learns the type
//! from the mount table). Without this helper it falls back to fuse3's
//! `mount.fuse`, which takes SOURCE for the command to run, so a remount
//! failed. Install it with `ln -s "$(command -v iomapfs)"
//! /sbin/mount.fuse.iomapfs`.
//!
//! A new mount runs `iomapfs mount SOURCE DIR -o OPTIONS` (a daemon). A
//! remount changes the mount's flags with mount(2) itself: FUSE takes a
//! read-only switch without the daemon (the kernel then fails every change
//! with EROFS before it reaches iomapfs).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The names mount(8) runs this binary by.
const HELPER_NAMES: [&str; 2] = ["mount.fuse.iomapfs", "mount.iomapfs"];

/// Options mount(8) may hand a helper that mean nothing to a mount itself
/// (fstab's `defaults`, `noauto`, `user`, `x-*` comments...), and flags
/// that `iomapfs mount` always sets (`nosuid`, `nodev`, `noatime`).
fn dropped_for_a_new_mount(opt: &str) -> bool {
    matches!(
        opt,
        "defaults"
            | "auto"
            | "noauto"
            | "nofail"
            | "_netdev"
            | "user"
            | "users"
            | "nouser"
            | "owner"
            | "group"
            | "nosuid"
            | "nodev"
            | "noatime"
            | "async"
    ) || opt.starts_with("x-")
        || opt.starts_with("comment=")
}

/// Runs as the helper when invoked by one of [`HELPER_NAMES`]; `None`
/// otherwise (the normal command line).
pub fn run_if_invoked_as_helper() -> Option<ExitCode> {
    let argv0 = std::env::args_os().next()?;
    let name = Path::new(&argv0).file_name()?.to_str()?.to_string();
    if !HELPER_NAMES.contains(&name.as_str()) {
        return None;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    Some(match run(&name, &args) {
        Ok(code) => code,
        Err(message) => {
            crate::report_error(&format!("{name}: {message}"));
            ExitCode::from(1)
        }
    })
}

/// What mount(8) asked for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Request {
    source: String,
    dir: PathBuf,
    options: Vec<String>,
    /// `-f`: do everything but the mount.
    fake: bool,
}

fn parse(args: &[String]) -> Result<Request, String> {
    let mut req = Request::default();
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-o" => {
                let opts = it.next().ok_or("-o needs a value")?;
                req.options.extend(split_options(opts));
            }
            "-t" | "-N" => {
                // The type is ours; another mount namespace is not supported.
                let value = it.next().ok_or(format!("{arg} needs a value"))?;
                if arg == "-N" {
                    return Err(format!("-N {value}: mount namespaces are not supported"));
                }
            }
            "-f" => req.fake = true,
            "-s" | "-n" | "-v" => {}
            a if a.starts_with("-o") => req.options.extend(split_options(&a[2..])),
            a if a.starts_with('-') => return Err(format!("unknown flag {a}")),
            a => positional.push(a.to_string()),
        }
    }
    let [source, dir] = <[String; 2]>::try_from(positional)
        .map_err(|p| format!("want SOURCE DIR, got {} arguments", p.len()))?;
    req.source = source;
    req.dir = PathBuf::from(dir);
    Ok(req)
}

fn split_options(opts: &str) -> impl Iterator<Item = String> + '_ {
    opts.split(',')
        .filter(|o| !o.is_empty())
        .map(str::to_string)
}

fn run(name: &str, args: &[String]) -> Result<ExitCode, String> {
    let req = parse(args).map_err(|why| {
        format!("{why} (usage: {name} SOURCE DIR [-o OPTIONS]; mount(8) runs it)")
    })?;
    if req.options.iter().any(|o| o == "remount") {
        if !req.fake {
            remount(&req.dir, &req.options)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let options: Vec<&str> = req
        .options
        .iter()
        .map(String::as_str)
        .filter(|o| !dropped_for_a_new_mount(o))
        .collect();
    if req.fake {
        return Ok(ExitCode::SUCCESS);
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount").arg(&req.source).arg(&req.dir);
    if !options.is_empty() {
        cmd.arg("-o").arg(options.join(","));
    }
    let status = cmd
        .status()
        .map_err(|e| format!("running iomapfs mount: {e}"))?;
    Ok(ExitCode::from(
        status.code().map_or(1, |c| c.clamp(0, 255) as u8),
    ))
}

/// Per-mount flags mount(2) takes with `MS_REMOUNT`, by their
/// /proc/self/mountinfo names.
const MOUNT_FLAGS: [(&str, libc::c_ulong); 7] = [
    ("ro", libc::MS_RDONLY),
    ("nosuid", libc::MS_NOSUID),
    ("nodev", libc::MS_NODEV),
    ("noexec", libc::MS_NOEXEC),
    ("noatime", libc::MS_NOATIME),
    ("nodiratime", libc::MS_NODIRATIME),
    ("relatime", libc::MS_RELATIME),
];

/// Remounts `dir` keeping its flags, switched to read-only or read-write
/// where `options` say so (the last of `ro`/`rw` wins).
fn remount(dir: &Path, options: &[String]) -> Result<(), String> {
    let canonical = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let current = mount_options_of(&canonical)?;
    let mut flags = libc::MS_REMOUNT;
    for (name, flag) in MOUNT_FLAGS {
        if current.iter().any(|o| o == name) {
            flags |= flag;
        }
    }
    for opt in options {
        match opt.as_str() {
            "ro" => flags |= libc::MS_RDONLY,
            "rw" => flags &= !libc::MS_RDONLY,
            _ => {}
        }
    }
    let path = CString::new(canonical.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL in the path", canonical.display()))?;
    // SAFETY: mount(2) with a valid NUL-terminated target path; source,
    // type and data may be NULL for a remount.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            path.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        let hint = if err.raw_os_error() == Some(libc::EBUSY) {
            " (a file there is open for writing)"
        } else {
            ""
        };
        return Err(format!("remount of {}: {err}{hint}", canonical.display()));
    }
    Ok(())
}

/// The per-mount options (field 6 of /proc/self/mountinfo) of the mount
/// at `dir` (the topmost one there).
fn mount_options_of(dir: &Path) -> Result<Vec<String>, String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let wanted = escape_mountinfo(&dir.to_string_lossy());
    table
        .lines()
        .rev()
        .find_map(|line| {
            let mut fields = line.split(' ');
            let point = fields.nth(4)?;
            let options = fields.next()?;
            (point == wanted).then(|| options.split(',').map(str::to_string).collect())
        })
        .ok_or_else(|| format!("{} is not a mount point", dir.display()))
}

/// A path as mountinfo writes it: space, tab, newline and backslash in
/// octal escapes.
fn escape_mountinfo(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_what_mount_passes() {
        let req = parse(&strings(&[
            "/img",
            "/mnt/x",
            "-n",
            "-o",
            "rw,remount,ro",
            "-t",
            "fuse.iomapfs",
        ]))
        .unwrap();
        assert_eq!(req.source, "/img");
        assert_eq!(req.dir, PathBuf::from("/mnt/x"));
        assert_eq!(req.options, strings(&["rw", "remount", "ro"]));
        assert!(!req.fake);
        let req = parse(&strings(&["-f", "-oallow_other", "a", "b"])).unwrap();
        assert!(req.fake);
        assert_eq!(req.options, strings(&["allow_other"]));
        assert!(parse(&strings(&["a"])).is_err());
        assert!(parse(&strings(&["a", "b", "-N", "ns"])).is_err());
        assert!(parse(&strings(&["a", "b", "--bogus"])).is_err());
    }

    #[test]
    fn fstab_words_are_dropped_and_the_rest_kept() {
        let kept: Vec<&str> = ["defaults", "noauto", "x-systemd.foo", "threads=2", "ro"]
            .into_iter()
            .filter(|o| !dropped_for_a_new_mount(o))
            .collect();
        assert_eq!(kept, ["threads=2", "ro"]);
    }

    /// What mount(8) hands a helper for common fstab/command-line words
    /// must either be dropped here or accepted by `iomapfs mount -o`:
    /// otherwise `mount -t fuse.iomapfs -o noexec IMG DIR` (or an fstab
    /// line with `exec` or `relatime`) fails with "unknown or unsupported
    /// option".
    #[test]
    fn every_option_mount_8_passes_is_dropped_or_accepted() {
        for opt in ["noexec", "exec", "relatime", "nodiratime"] {
            if dropped_for_a_new_mount(opt) {
                continue;
            }
            let mut cfg = iomapfs_mount::MountConfig::default();
            assert!(
                cfg.apply_option(opt).is_ok(),
                "-o {opt} from mount(8) is neither dropped nor accepted"
            );
        }
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(escape_mountinfo("/a b\\c"), "/a\\040b\\134c");
    }
}
