//! Choosing a backend: what the caller asked for, or what probing says is
//! faster, and why.
//!
//! io_uring beats one thread per request only when the device takes
//! non-blocking submission (NOWAIT): then the submitting thread starts each
//! request itself. Where NOWAIT is refused (zram, and other bio-based drivers)
//! io_uring hands every request to a kernel worker thread and is many times
//! slower than `pread` (see DESIGN.md, "Devices"), so [`Backend::Auto`] picks
//! io_uring only when io_uring works *and* the device accepts NOWAIT.
//!
//! A device that refuses NOWAIT does a request's work in the thread that
//! submits it (zram compresses there): one thread at a time keeps one core
//! busy, however deep its queue. There Auto picks the worker-pool backend
//! ([`PoolDevice`]) when the process may use more than one CPU: its
//! queues' requests run on one worker thread per CPU. Measured on zram
//! (2 CPUs, fio, 4-16 KiB random writes, QD 64): raw zram takes 58k IOPS
//! from one `psync` thread, 136k from two, 55k through io_uring. On one
//! CPU a pool would only add hand-offs, so Auto picks the sync backend.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use crate::pool_backend::{PoolDevice, PoolOptions};
use crate::probe::{self, Nowait};
use crate::uring::{check_uring, UringDevice, UringOptions};
use crate::{BlockDevice, DeviceError, SyncDevice, SyncOpenOptions};

/// Which backend drives a device: the value of `--backend`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// `pread`/`pwritev2` on the calling thread ([`SyncDevice`]).
    Sync,
    /// io_uring queues ([`UringDevice`]).
    Uring,
    /// `pread`/`pwritev2`; queued requests run on a pool of worker threads
    /// ([`PoolDevice`]).
    Pool,
    /// Probe, and pick the faster one that works.
    #[default]
    Auto,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sync => "sync",
            Backend::Uring => "uring",
            Backend::Pool => "pool",
            Backend::Auto => "auto",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `--backend` value that is not one of `sync`, `uring`, `pool`, `auto`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?}: expected sync, uring (or io_uring), pool or auto")]
pub struct ParseBackendError(pub String);

impl FromStr for Backend {
    type Err = ParseBackendError;

    fn from_str(s: &str) -> Result<Backend, ParseBackendError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sync" => Ok(Backend::Sync),
            "uring" | "io_uring" | "io-uring" => Ok(Backend::Uring),
            "pool" => Ok(Backend::Pool),
            "auto" => Ok(Backend::Auto),
            _ => Err(ParseBackendError(s.to_owned())),
        }
    }
}

/// The backend [`open_device`] chose, and why, for `stat`/`info` output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// [`Backend::Sync`], [`Backend::Uring`] or [`Backend::Pool`], never
    /// `Auto`.
    pub backend: Backend,
    /// One line, starting with the backend: e.g. `io_uring: device accepts
    /// NOWAIT`, or `sync: io_uring disabled (kernel.io_uring_disabled=2)`.
    pub reason: String,
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Opens `path` (block device or image file, as [`SyncDevice::open`]) with
/// `backend`, resolving [`Backend::Auto`] by probing:
///
/// - io_uring must work: `kernel.io_uring_disabled`, a ring can be set up
///   (seccomp and container policies show up as `EPERM` here), the device can
///   be registered with it and read through it;
/// - the device must accept NOWAIT submission (see [`crate::backend`]).
///
/// If both hold, Auto gives io_uring. A device that refuses NOWAIT gets
/// the worker-pool backend when the process may use more than one CPU
/// ([`crate::pool_backend::default_workers`]), else the sync backend; any
/// other failure gives the sync backend. The reason says which check
/// decided. An explicit [`Backend::Uring`] that cannot work is an error
/// ([`DeviceError::Unusable`]) naming the cause; one on a device without
/// NOWAIT is honoured, and the reason says it will be slow.
pub fn open_device(
    path: &Path,
    read_only: bool,
    backend: Backend,
) -> Result<(Arc<dyn BlockDevice>, BackendChoice), DeviceError> {
    let sync = Arc::new(SyncDevice::open(path, SyncOpenOptions { read_only })?);
    let choose_sync = |sync: Arc<SyncDevice>, reason: String| {
        let dev: Arc<dyn BlockDevice> = sync;
        let choice = BackendChoice {
            backend: Backend::Sync,
            reason: format!("sync: {reason}"),
        };
        Ok((dev, choice))
    };
    let choose_uring = |sync: Arc<SyncDevice>, reason: String| {
        let dev: Arc<dyn BlockDevice> =
            Arc::new(UringDevice::new_unchecked(sync, UringOptions::default()));
        let choice = BackendChoice {
            backend: Backend::Uring,
            reason: format!("io_uring: {reason}"),
        };
        Ok((dev, choice))
    };
    let pool = PoolOptions::default();
    let choose_pool = |sync: Arc<SyncDevice>, reason: String| {
        let pooled = PoolDevice::new(sync, pool);
        let workers = pooled.workers();
        let dev: Arc<dyn BlockDevice> = Arc::new(pooled);
        let choice = BackendChoice {
            backend: Backend::Pool,
            reason: format!("pool: {reason}; queued requests run on {workers} worker threads"),
        };
        Ok((dev, choice))
    };

    match backend {
        Backend::Sync => return choose_sync(sync, "requested".into()),
        Backend::Pool => return choose_pool(sync, "requested".into()),
        Backend::Uring | Backend::Auto => {}
    }
    let uring = check_uring(&sync, UringOptions::default());
    let nowait = probe::nowait_support(sync.file(), sync.caps());
    let name = device_name(&sync);
    let cpus = pool.workers().get();
    match (backend, uring, nowait) {
        (Backend::Uring, Err(why), _) => Err(DeviceError::Unusable {
            path: path.to_owned(),
            reason: format!("io_uring backend requested, but {why}"),
        }),
        (Backend::Uring, Ok(()), Nowait::Supported) => {
            choose_uring(sync, "requested; device accepts NOWAIT".into())
        }
        (Backend::Uring, Ok(()), Nowait::Unsupported(evidence)) => choose_uring(
            sync,
            format!(
                "requested, although {name} does not support NOWAIT ({evidence}): \
                 every request goes through a kernel worker"
            ),
        ),
        (Backend::Uring, Ok(()), Nowait::Unknown(why)) => {
            choose_uring(sync, format!("requested; NOWAIT probe inconclusive: {why}"))
        }
        (_, _, Nowait::Unsupported(evidence)) if cpus > 1 => choose_pool(
            sync,
            format!(
                "{name} does not support NOWAIT ({evidence}), so it works in the \
                 submitting thread: io_uring would punt every request to a kernel worker, \
                 one thread keeps one CPU busy"
            ),
        ),
        (_, Err(why), _) => choose_sync(sync, why.to_string()),
        (_, Ok(()), Nowait::Supported) => choose_uring(sync, "device accepts NOWAIT".into()),
        (_, Ok(()), Nowait::Unsupported(evidence)) => choose_sync(
            sync,
            format!(
                "{name} does not support NOWAIT ({evidence}); \
                 io_uring would punt every request to a kernel worker, \
                 and with one CPU a worker pool would only add hand-offs"
            ),
        ),
        (_, Ok(()), Nowait::Unknown(why)) => choose_sync(
            sync,
            format!("cannot tell whether {name} supports NOWAIT ({why}); sync is the safe choice"),
        ),
    }
}

/// `zram0` for `/dev/zram0`, `image file foo.img` for an image.
fn device_name(dev: &SyncDevice) -> String {
    let base = dev
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dev.path().display().to_string());
    match dev.caps().kind {
        crate::DeviceKind::BlockDevice => base,
        _ => format!("image file {base}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_round_trip() {
        for b in [Backend::Sync, Backend::Uring, Backend::Pool, Backend::Auto] {
            assert_eq!(b.to_string().parse::<Backend>().unwrap(), b);
        }
        assert_eq!("io_uring".parse::<Backend>().unwrap(), Backend::Uring);
        assert_eq!(" Auto ".parse::<Backend>().unwrap(), Backend::Auto);
        let err = "aio".parse::<Backend>().unwrap_err();
        assert!(err.to_string().contains("sync, uring"), "{err}");
    }
}
