//! iomapfs as a POSIX file system through FUSE.
//!
//! [`serve`] mounts a [`Volume`] at a directory and answers the kernel's
//! requests ([`fuse_fs::IomapFuse`]) until the mount goes away: `umount`,
//! `fusermount3 -u`, or a stop signal (SIGINT, SIGTERM, SIGHUP), which
//! unmounts it. Then the volume is unmounted cleanly (written back and
//! checkpointed). A daemon killed outright leaves its journal to the next
//! mount, which recovers from it as after a power cut.
//!
//! Permissions are checked by the kernel (`default_permissions`); other
//! users reach the mount only with `allow_other`. The pure-Rust mount path
//! of `fuser` is used: `mount(2)` as root, the setuid `fusermount3` (Debian
//! package `fuse3`) for a user who mounts an image file they own.

pub mod config;
pub mod fuse_fs;
pub mod fuse_uring;
pub(crate) mod fuse_wire;
pub mod mountinfo;
pub mod ring_transport;
pub mod transport_probe;
mod unmount;

use std::io;
use std::path::{Path, PathBuf};

use fuser::{BackgroundSession, Config, MountOption, Session, SessionACL};
use iomapfs_fs::Volume;

pub use config::{Caching, MountConfig, MountError, FS_SUBTYPE, MAX_THREADS};
pub use fuse_fs::IomapFuse;
use ring_transport::RingTransport;
pub use unmount::unmount;

/// The signals that unmount a mount cleanly.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn stop_signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a sigset_t we own;
    // they only fail for invalid signal numbers, which these are not.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in STOP_SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the stop signals in the calling thread and every thread it
/// starts afterwards, so that only [`serve`]'s signal thread receives them
/// (by `sigwait`). Call it first, before the volume starts its threads.
pub fn block_stop_signals() -> Result<(), MountError> {
    let set = stop_signal_set();
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(MountError::SignalMask(io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

/// A mount's kernel session, by transport.
enum Served {
    /// `/dev/fuse`: fuser's session, not yet running.
    DevFuse(Session<IomapFuse>),
    /// `-o uring`: fuser's threads, running, and the queues'.
    Ring(BackgroundSession, RingTransport),
}

/// The kernel session for `vol` mounted at `path` (canonical), as `cfg`
/// asks.
fn session(vol: &Volume, path: &Path, cfg: &MountConfig) -> Result<Served, MountError> {
    if cfg.uring {
        let fs = IomapFuse::new(vol.clone(), cfg.caching, cfg.read_only);
        let (session, ring) = ring_transport::start(fs, path, cfg)?;
        return Ok(Served::Ring(session, ring));
    }
    dev_fuse_session(vol, path, cfg).map(Served::DevFuse)
}

/// The classic transport: fuser mounts and reads `/dev/fuse`.
fn dev_fuse_session(
    vol: &Volume,
    path: &Path,
    cfg: &MountConfig,
) -> Result<Session<IomapFuse>, MountError> {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(cfg.fs_name.clone()),
        // The kernel's own option, not fuser's Subtype (fusermount's, which
        // a root mount never passes on): the type reads `fuse.iomapfs`, so
        // mount(8) runs our helper (`mount.fuse.iomapfs`) for a remount,
        // not fuse3's `mount.fuse`, which takes the image for a command.
        MountOption::CUSTOM(format!("subtype={FS_SUBTYPE}")),
        MountOption::DefaultPermissions,
        if cfg.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
        MountOption::NoAtime,
    ];
    if cfg.no_exec {
        config.mount_options.push(MountOption::NoExec);
    }
    config.acl = if cfg.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(cfg.threads.max(1));
    config.clone_fd = true;
    let fs = IomapFuse::new(vol.clone(), cfg.caching, cfg.read_only);
    Session::new(fs, path, &config).map_err(|source| {
        let path = path.to_path_buf();
        // fuser opens /dev/fuse itself before it turns to fusermount3, and
        // gives up if it cannot.
        // SAFETY: geteuid has no preconditions; the path is a valid C string.
        let no_dev_fuse = unsafe {
            libc::geteuid() != 0
                && libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) != 0
        };
        if no_dev_fuse && source.kind() == io::ErrorKind::PermissionDenied {
            MountError::UserMount { path, source }
        } else {
            MountError::Mount { path, source }
        }
    })
}

fn canonical(mountpoint: &Path) -> Result<PathBuf, MountError> {
    mountpoint
        .canonicalize()
        .map_err(|source| MountError::MountPoint {
            path: mountpoint.to_path_buf(),
            source,
        })
}

/// Mounts `vol` at `mountpoint` and serves it until it is unmounted; then
/// unmounts the volume cleanly. `ready` runs once the mount is live.
/// Call [`block_stop_signals`] first (before opening the volume).
pub fn serve(
    vol: Volume,
    mountpoint: &Path,
    cfg: &MountConfig,
    ready: impl FnOnce(),
) -> Result<(), MountError> {
    let path = canonical(mountpoint)?;
    let session = session(&vol, &path, cfg)?;
    spawn_signal_thread(path.clone())?;
    ready();
    let served = match session {
        Served::DevFuse(session) => connection_ended(session.run()),
        Served::Ring(session, ring) => connection_ended(session.join()).and(ring.join()),
    };
    // Every handle the kernel held is closed with the session.
    let unmounted = release_volume(vol, cfg.read_only, &path);
    served.map_err(|source| MountError::Session { path, source })?;
    unmounted
}

/// A mount served by threads of this process (for programs that measure
/// or test the mount from inside, such as `iomapfs bench`), with no signal
/// handling of its own. [`BackgroundMount::unmount`] ends it cleanly;
/// dropping it unmounts lazily and ends the session without the
/// checkpoint (the next mount recovers from the journal).
pub struct BackgroundMount {
    session: Option<BackgroundSession>,
    /// The io_uring transport's threads; its mount is ours to undo.
    ring: Option<RingTransport>,
    vol: Option<Volume>,
    path: PathBuf,
    read_only: bool,
}

/// Mounts `vol` at `mountpoint`, served by `cfg.threads` threads of this
/// process until [`BackgroundMount::unmount`]. The process must not touch
/// the mount from a thread the session needs to answer it.
pub fn spawn(
    vol: Volume,
    mountpoint: &Path,
    cfg: &MountConfig,
) -> Result<BackgroundMount, MountError> {
    let path = canonical(mountpoint)?;
    let (session, ring) = match session(&vol, &path, cfg)? {
        Served::DevFuse(session) => {
            let session = session.spawn().map_err(|source| MountError::Session {
                path: path.clone(),
                source,
            })?;
            (session, None)
        }
        Served::Ring(session, ring) => (session, Some(ring)),
    };
    Ok(BackgroundMount {
        session: Some(session),
        ring,
        vol: Some(vol),
        path,
        read_only: cfg.read_only,
    })
}

impl BackgroundMount {
    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Under `-o uring`, the requests that came over the ring so far, by
    /// who answered them.
    pub fn ring_counts(&self) -> Option<&ring_transport::RingCounts> {
        self.ring.as_ref().map(RingTransport::counts)
    }

    /// Unmounts (lazily: the session ends when the last open file is
    /// closed), waits for the session's threads, then unmounts the volume
    /// cleanly (written back and checkpointed).
    pub fn unmount(mut self) -> Result<(), MountError> {
        let served = self.end_session();
        let vol = self.vol.take().expect("the volume is taken only here");
        let unmounted = release_volume(vol, self.read_only, &self.path);
        served?;
        unmounted
    }

    fn end_session(&mut self) -> Result<(), MountError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let ring = self.ring.take();
        if ring.is_some() {
            // fuser did not mount this one: it ends with the connection.
            let _ = unmount(&self.path);
        }
        connection_ended(session.umount_and_join())
            .and(ring.map_or(Ok(()), RingTransport::join))
            .map_err(|source| MountError::Session {
                path: self.path.clone(),
                source,
            })
    }
}

impl Drop for BackgroundMount {
    fn drop(&mut self) {
        let _ = self.end_session();
    }
}

/// A session's result, with the end of the connection counted as the end
/// of the session. fuser ends quietly on ENODEV, but a server thread that
/// is taking a request off the queue (readahead, a RELEASE sent after the
/// last close) when the unmount or an abort shuts the connection down gets
/// ECONNABORTED from its read instead: the same end, reached mid-read.
/// An abort through fusectl ends it the same way, and the volume is
/// then let go cleanly as after an unmount (the kernel already failed
/// what was in flight). fuser reports the first thread's result: one
/// that saw ECONNABORTED hides a real error of another, as an ENODEV
/// would.
fn connection_ended(served: io::Result<()>) -> io::Result<()> {
    match served {
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
        other => other,
    }
}

/// Lets the volume go once its session ended: the clean unmount (written
/// back and checkpointed) of a writable mount; for a read-only one, the
/// release that writes nothing (nothing changed, and the checkpoint would
/// be a write) and gives large metadata's heap back.
fn release_volume(vol: Volume, read_only: bool, path: &Path) -> Result<(), MountError> {
    if read_only {
        vol.release();
        return Ok(());
    }
    vol.unmount().map_err(|source| MountError::Unmount {
        path: path.to_path_buf(),
        source,
    })
}

/// Waits for a stop signal and unmounts `mountpoint` on it.
fn spawn_signal_thread(mountpoint: PathBuf) -> Result<(), MountError> {
    std::thread::Builder::new()
        .name("iomapfs-signals".into())
        .spawn(move || loop {
            let set = stop_signal_set();
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is initialised and `sig` is a valid out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                return;
            }
            if let Err(e) = unmount(&mountpoint) {
                eprintln!(
                    "iomapfs: signal {sig}: unmounting {}: {e}",
                    mountpoint.display()
                );
            }
        })
        .map(drop)
        .map_err(MountError::Signals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_shut_down_mid_read_ends_the_session_and_other_errors_stay() {
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert!(connection_ended(Err(aborted)).is_ok());
        assert!(connection_ended(Ok(())).is_ok());
        let failed = connection_ended(Err(io::Error::from_raw_os_error(libc::EIO)));
        assert_eq!(failed.unwrap_err().raw_os_error(), Some(libc::EIO));
    }

    #[test]
    fn options_set_caching_and_threads_and_refuse_the_rest() {
        let mut cfg = MountConfig::default();
        assert_eq!(cfg.caching, Caching::KernelCache);
        assert_eq!(cfg.options(), "threads=4,kernel_cache");
        for (opt, caching) in [
            ("writeback_cache", Caching::Writeback),
            ("direct_io", Caching::DirectIo),
            ("kernel_cache", Caching::KernelCache),
        ] {
            cfg.apply_option(opt).unwrap();
            assert_eq!(cfg.caching, caching, "{opt}");
            assert!(cfg.options().ends_with(opt), "{}", cfg.options());
        }
        cfg.apply_option("threads=8").unwrap();
        cfg.apply_option("allow_other").unwrap();
        cfg.apply_option("").unwrap();
        assert_eq!((cfg.threads, cfg.allow_other), (8, true));
        cfg.apply_option("ro").unwrap();
        assert!(cfg.read_only);
        cfg.apply_option("rw").unwrap();
        assert!(!cfg.read_only);
        for bad in [
            "threads=0",
            "threads=65",
            "threads=x",
            "cache=yes",
            "ro=1",
            "fsname=",
        ] {
            let why = cfg.apply_option(bad).unwrap_err();
            assert!(why.contains(bad.split('=').next().unwrap()), "{bad}: {why}");
        }
        assert_eq!(cfg.threads, 8, "a refused option changes nothing");
    }

    #[test]
    fn uring_options_pick_the_transport_and_the_queue_threads_class() {
        let mut cfg = MountConfig::default();
        assert!(!cfg.uring && !cfg.uring_idle);
        cfg.apply_option("uring").unwrap();
        assert!(cfg.uring && !cfg.uring_idle);
        assert_eq!(cfg.options(), "threads=4,kernel_cache,uring");
        let mut idle = MountConfig::default();
        idle.apply_option("uring_idle").unwrap();
        assert!(idle.uring && idle.uring_idle, "uring_idle implies uring");
        assert_eq!(idle.options(), "threads=4,kernel_cache,uring_idle");
        assert!(idle.apply_option("uring=1").is_err());
    }
}
