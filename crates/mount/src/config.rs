//! How to mount (the `-o` options of `iomapfs mount`) and why a mount
//! failed: what the crate root, the request handlers and the io_uring
//! transport all read.

use std::io;
use std::path::PathBuf;

/// Why a mount failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("mount point {path}: {source}")]
    MountPoint { path: PathBuf, source: io::Error },
    #[error("cannot mount at {path}: {source}")]
    Mount { path: PathBuf, source: io::Error },
    #[error(
        "cannot mount at {path} as a user: {source}; a user mount needs /dev/fuse open to \
         every user (mode 0666, as Debian's udev makes it) and the setuid fusermount3 \
         (Debian package fuse3)"
    )]
    UserMount { path: PathBuf, source: io::Error },
    #[error("serving {path}: {source}")]
    Session { path: PathBuf, source: io::Error },
    #[error("clean unmount of the volume after {path} was unmounted: {source}")]
    Unmount {
        path: PathBuf,
        source: iomapfs_fs::Error,
    },
    #[error("blocking the stop signals (pthread_sigmask): {0}")]
    SignalMask(io::Error),
    #[error("starting the stop-signal thread: {0}")]
    Signals(io::Error),
}

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Let users other than the one who mounted reach the files
    /// (`allow_other`; for a non-root user, needs `user_allow_other` in
    /// /etc/fuse.conf).
    pub allow_other: bool,
    /// Threads reading requests, each on its own `/dev/fuse` descriptor.
    pub threads: usize,
    /// The source `mount` and /proc/mounts show.
    pub fs_name: String,
    /// Whether and how the kernel page cache holds file data.
    pub caching: Caching,
    /// `-o ro`: the kernel refuses every change (EROFS), the daemon
    /// refuses any that reaches it, and the volume is let go without the
    /// unmount checkpoint. The caller opens the device read-only too, so
    /// nothing of the mount can write to it.
    pub read_only: bool,
    /// `-o noexec`: programs on the mount cannot be executed.
    pub no_exec: bool,
    /// `-o uring`: requests travel over FUSE over io_uring, one queue per
    /// CPU served on that CPU ([`crate::ring_transport`]); root only.
    pub uring: bool,
    /// `-o uring_idle`: `uring`, with the queue threads at `SCHED_IDLE`,
    /// so that the scheduler keeps a client it wakes on the CPU it asked
    /// from (a CPU running only idle-class threads counts as idle); a CPU
    /// kept busy by other programs then answers requests made on it
    /// slowly.
    pub uring_idle: bool,
}

/// Mount flags every iomapfs mount has; asking for them is accepted and
/// changes nothing.
const ALWAYS_ON_FLAGS: [&str; 6] = [
    "nosuid",
    "nodev",
    "noatime",
    "nodiratime",
    "relatime",
    "async",
];

/// Mount flags an iomapfs mount never has (it is always nosuid, nodev,
/// noatime, and synchronous only per open): refused with a reason.
const NEVER_ON_FLAGS: [&str; 5] = ["suid", "dev", "atime", "strictatime", "sync"];

/// Whether and how the kernel page cache holds file data (see
/// [`crate::fuse_fs`]). iomapfs's folio cache serves non-direct opens in every
/// case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Caching {
    /// `-o direct_io`: every open bypasses the kernel page cache.
    DirectIo,
    /// `-o kernel_cache` (the default): non-direct opens read through the kernel page
    /// cache; their writes update it and reach the daemon before they
    /// return. `O_DIRECT` opens take the kernel's direct I/O path, which
    /// writes cached pages back before and drops them after.
    #[default]
    KernelCache,
    /// `-o writeback_cache`: as `KernelCache`, and writes stay in the
    /// kernel page cache until the kernel writes them back.
    Writeback,
}

impl Caching {
    /// The `-o` option that picks it.
    pub fn option(self) -> &'static str {
        match self {
            Caching::DirectIo => "direct_io",
            Caching::KernelCache => "kernel_cache",
            Caching::Writeback => "writeback_cache",
        }
    }
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            allow_other: false,
            threads: 4,
            fs_name: "iomapfs".into(),
            caching: Caching::default(),
            read_only: false,
            no_exec: false,
            uring: false,
            uring_idle: false,
        }
    }
}

impl MountConfig {
    /// Applies one `-o` option of `iomapfs mount` (see its `--help`);
    /// `Err` says why it is refused. An empty option does nothing.
    pub fn apply_option(&mut self, opt: &str) -> Result<(), String> {
        match opt.split_once('=') {
            None if opt.is_empty() || opt == "default_permissions" => {}
            None if opt == "rw" => self.read_only = false,
            None if opt == "ro" => self.read_only = true,
            None if opt == "allow_other" => self.allow_other = true,
            None if opt == "direct_io" => self.caching = Caching::DirectIo,
            None if opt == "kernel_cache" => self.caching = Caching::KernelCache,
            None if opt == "writeback_cache" => self.caching = Caching::Writeback,
            None if opt == "noexec" => self.no_exec = true,
            None if opt == "exec" => self.no_exec = false,
            None if opt == "uring" => self.uring = true,
            None if opt == "uring_idle" => {
                self.uring = true;
                self.uring_idle = true;
            }
            None if ALWAYS_ON_FLAGS.contains(&opt) => {}
            None if NEVER_ON_FLAGS.contains(&opt) => {
                return Err(format!(
                    "-o {opt} is not supported: an iomapfs mount is always nosuid, nodev and \
                     noatime (O_SYNC/O_DSYNC opens are honoured)"
                ))
            }
            Some(("threads", n)) => {
                self.threads = n
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_THREADS).contains(n))
                    .ok_or_else(|| format!("-o threads={n}: want 1 to {MAX_THREADS}"))?
            }
            Some(("fsname", name)) if !name.is_empty() => self.fs_name = name.to_string(),
            _ => {
                return Err(format!(
                    "unknown or unsupported option -o {opt} (see --help)"
                ))
            }
        }
        Ok(())
    }

    /// The `-o` options that give this configuration's caching and
    /// threads (for reports).
    pub fn options(&self) -> String {
        let transport = match (self.uring, self.uring_idle) {
            (_, true) => ",uring_idle",
            (true, false) => ",uring",
            (false, false) => "",
        };
        format!(
            "threads={},{}{transport}",
            self.threads,
            self.caching.option()
        )
    }
}

/// The mount's type is `fuse.` and this (see /proc/mounts).
pub const FS_SUBTYPE: &str = "iomapfs";

/// Most request threads a mount may have.
pub const MAX_THREADS: usize = 64;
