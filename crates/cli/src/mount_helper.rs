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
//! A new mount runs `iomapfs mount -o OPTIONS -- SOURCE DIR` (a daemon). A
//! remount changes the mount's flags with mount(2) itself: FUSE takes a
//! read-only switch without the daemon (the kernel then fails every change
//! with EROFS before it reaches iomapfs). A read-only remount does not
//! quiesce the daemon: writeback and checkpoints of what was written before
//! go on; and `remount,rw` of a volume mounted with `-o ro` succeeds, but
//! the daemon still refuses every change (EROFS).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use iomapfs_mount::MountConfig;

/// The names mount(8) runs this binary by.
const HELPER_NAMES: [&str; 2] = ["mount.fuse.iomapfs", "mount.iomapfs"];

/// Options mount(8) may hand a helper that mean nothing to a mount itself
/// (fstab's `defaults`, `noauto`, `user`, `x-*` comments...).
fn is_fstab_word(opt: &str) -> bool {
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
    ) || opt.starts_with("x-")
        || opt.starts_with("comment=")
        || opt.starts_with("user=")
}

/// Options of the FUSE mount itself, which mount(8) hands back on a
/// remount (from the mount table) and which cannot change.
fn is_fuse_mount_option(opt: &str) -> bool {
    matches!(opt, "default_permissions" | "allow_other")
        || [
            "user_id=",
            "group_id=",
            "rootmode=",
            "fd=",
            "max_read=",
            "blksize=",
            "subtype=",
            "fsname=",
        ]
        .iter()
        .any(|prefix| opt.starts_with(prefix))
}

/// Whether `iomapfs mount -o` takes `opt`.
fn mount_accepts(opt: &str) -> bool {
    MountConfig::default().apply_option(opt).is_ok()
}

/// For a new mount: fstab words are dropped, and with `-s` (sloppy) also
/// what `iomapfs mount` would refuse; the rest goes to `iomapfs mount -o`.
fn dropped_for_a_new_mount(opt: &str, sloppy: bool) -> bool {
    is_fstab_word(opt) || (sloppy && !mount_accepts(opt))
}

/// Runs as the helper when invoked by one of [`HELPER_NAMES`]; `None`
/// otherwise (the normal command line).
pub fn run_if_invoked_as_helper() -> Option<ExitCode> {
    let argv0 = std::env::args_os().next()?;
    let name = Path::new(&argv0).file_name()?.to_str()?.to_string();
    if !HELPER_NAMES.contains(&name.as_str()) {
        return None;
    }
    let args: Option<Vec<String>> = std::env::args_os()
        .skip(1)
        .map(|a| a.into_string().ok())
        .collect();
    let result = args
        .ok_or_else(|| "an argument is not valid UTF-8".to_string())
        .and_then(|args| run(&name, &args));
    Some(match result {
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
    /// `-s`: ignore options that are not supported.
    sloppy: bool,
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
            "-s" => req.sloppy = true,
            "-n" | "-v" => {}
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
        let dir = absolute(&req.dir)?;
        let flags = remount_flags(&mount_options_of(&dir)?, &req.options, req.sloppy)?;
        if !req.fake {
            remount(&dir, flags)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let options: Vec<&str> = req
        .options
        .iter()
        .map(String::as_str)
        .filter(|o| !dropped_for_a_new_mount(o, req.sloppy))
        .collect();
    if req.fake {
        return Ok(ExitCode::SUCCESS);
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount");
    if !options.is_empty() {
        cmd.arg("-o").arg(options.join(","));
    }
    // A source or directory starting with `-` is not an option.
    cmd.arg("--").arg(&req.source).arg(&req.dir);
    let status = cmd
        .status()
        .map_err(|e| format!("running iomapfs mount: {e}"))?;
    Ok(ExitCode::from(
        status.code().map_or(1, |c| c.clamp(0, 255) as u8),
    ))
}

/// Linux's `MS_NOSYMFOLLOW` (5.10), which the libc crate does not name.
const MS_NOSYMFOLLOW: libc::c_ulong = 256;

/// Per-mount flags mount(2) takes with `MS_REMOUNT`: the word that sets
/// each (as /proc/self/mountinfo and mount(8) write it) and the one that
/// clears it.
const MOUNT_FLAGS: [(&str, &str, libc::c_ulong); 10] = [
    ("ro", "rw", libc::MS_RDONLY),
    ("nosuid", "suid", libc::MS_NOSUID),
    ("nodev", "dev", libc::MS_NODEV),
    ("noexec", "exec", libc::MS_NOEXEC),
    ("noatime", "atime", libc::MS_NOATIME),
    ("nodiratime", "diratime", libc::MS_NODIRATIME),
    ("relatime", "norelatime", libc::MS_RELATIME),
    ("strictatime", "nostrictatime", libc::MS_STRICTATIME),
    ("nosymfollow", "symfollow", MS_NOSYMFOLLOW),
    ("lazytime", "nolazytime", libc::MS_LAZYTIME),
];

/// The flags a remount passes: the mount's `current` ones (its mountinfo
/// options), changed as `options` say, later words winning. Options of the
/// file system itself (`threads=`, caching, FUSE's `user_id=`...) cannot
/// change on a remount and are ignored, like fstab words; anything else is
/// refused, unless `sloppy`.
fn remount_flags(
    current: &[String],
    options: &[String],
    sloppy: bool,
) -> Result<libc::c_ulong, String> {
    let mut flags = libc::MS_REMOUNT;
    for (set, _, flag) in MOUNT_FLAGS {
        if current.iter().any(|o| o == set) {
            flags |= flag;
        }
    }
    for opt in options {
        if let Some(&(_, _, flag)) = MOUNT_FLAGS.iter().find(|(set, _, _)| set == opt) {
            flags |= flag;
        } else if let Some(&(_, _, flag)) = MOUNT_FLAGS.iter().find(|(_, clear, _)| clear == opt) {
            flags &= !flag;
        } else if opt != "remount"
            && !is_fstab_word(opt)
            && !is_fuse_mount_option(opt)
            && !mount_accepts(opt)
            && !sloppy
        {
            return Err(format!("remount: unknown option {opt}"));
        }
    }
    Ok(flags)
}

/// `dir` as an absolute path without touching the mount: mount(8) hands
/// helpers absolute paths, and a stat of a FUSE root would hang while its
/// daemon does.
fn absolute(dir: &Path) -> Result<PathBuf, String> {
    if dir.is_absolute() {
        return Ok(dir.to_path_buf());
    }
    let cwd = std::env::current_dir().map_err(|e| format!("the current directory: {e}"))?;
    Ok(cwd.join(dir))
}

/// Remounts the mount at `dir` (absolute) with `flags`.
fn remount(dir: &Path, flags: libc::c_ulong) -> Result<(), String> {
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL in the path", dir.display()))?;
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
        return Err(format!("remount of {}: {err}{hint}", dir.display()));
    }
    Ok(())
}

/// The per-mount options of the mount at `dir` (the topmost one there).
fn mount_options_of(dir: &Path) -> Result<Vec<String>, String> {
    iomapfs_mount::mountinfo::mount_at(dir)
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?
        .map(|m| m.options)
        .ok_or_else(|| format!("{} is not a mount point", dir.display()))
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
        let words = [
            "defaults",
            "noauto",
            "x-systemd.foo",
            "user=me",
            "threads=2",
            "ro",
            "bogus",
        ];
        let kept: Vec<&str> = words
            .into_iter()
            .filter(|o| !dropped_for_a_new_mount(o, false))
            .collect();
        assert_eq!(kept, ["threads=2", "ro", "bogus"]);
        // Sloppy: what `iomapfs mount` refuses goes too.
        let kept: Vec<&str> = words
            .into_iter()
            .filter(|o| !dropped_for_a_new_mount(o, true))
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
        for opt in [
            "noexec",
            "exec",
            "relatime",
            "nodiratime",
            "nosuid",
            "nodev",
            "noatime",
        ] {
            if dropped_for_a_new_mount(opt, false) {
                continue;
            }
            let mut cfg = iomapfs_mount::MountConfig::default();
            assert!(
                cfg.apply_option(opt).is_ok(),
                "-o {opt} from mount(8) is neither dropped nor accepted"
            );
        }
    }

    /// A remount keeps the mount's flags (nosymfollow too) and changes
    /// those its options name, both ways; file-system options are ignored,
    /// unknown words refused unless sloppy.
    #[test]
    fn remount_flags_keep_the_mount_s_and_apply_the_options() {
        let current = strings(&["rw", "nosuid", "nodev", "noatime", "nosymfollow"]);
        let kept = libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
        let flags = |opts: &[&str]| remount_flags(&current, &strings(opts), false);
        assert_eq!(
            flags(&["remount", "ro"]).unwrap(),
            kept | MS_NOSYMFOLLOW | libc::MS_RDONLY
        );
        assert_eq!(
            flags(&[
                "remount",
                "ro",
                "rw",
                "noexec",
                "symfollow",
                "threads=2",
                "defaults"
            ])
            .unwrap(),
            kept | libc::MS_NOEXEC
        );
        assert!(flags(&["remount", "bogus"]).is_err());
        assert_eq!(
            remount_flags(&current, &strings(&["remount", "bogus"]), true).unwrap(),
            kept | MS_NOSYMFOLLOW
        );
    }
}
