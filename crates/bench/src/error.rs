//! Why a benchmark run could not be done. Each error names what failed and,
//! where one exists, the remedy.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A `--workload` name that is not one of [`crate::workloads`].
    #[error("unknown workload {name:?}; known workloads: {}", known.join(", "))]
    UnknownWorkload { name: String, known: Vec<String> },

    /// A bad option value (zero runtime, unsupported backend, ...).
    #[error("{0}")]
    InvalidOption(String),

    /// An explicit `--device` that bench will not touch: it holds data, is in
    /// use, or cannot be benchmarked.
    #[error("refusing to use {path}: {reason}")]
    DeviceRefused { path: PathBuf, reason: String },

    /// Preparing or tearing down the test bed (zram, loop device, image
    /// file, lock) failed.
    #[error("setup: {what}: {detail}")]
    Setup { what: String, detail: String },

    /// A check on a target failed (short read, unexpected file layout, ...).
    #[error("{what}: {detail}")]
    Failed { what: String, detail: String },

    /// A device request failed while preparing or measuring.
    #[error("{what}: {source}")]
    Device {
        what: String,
        #[source]
        source: blockdev::DeviceError,
    },

    /// An iomapfs operation failed while preparing or measuring.
    #[error("{what}: {source}")]
    Fs {
        what: String,
        #[source]
        source: iomapfs_fs::Error,
    },

    /// A file-system operation on the host (JSON output, temp files) failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// The run was stopped by SIGINT/SIGTERM/SIGHUP or [`crate::request_stop`];
    /// every device set up for it has been torn down.
    #[error("interrupted; devices set up for the benchmark were torn down")]
    Interrupted,
}

impl BenchError {
    pub(crate) fn setup(what: impl Into<String>, detail: impl Into<String>) -> BenchError {
        BenchError::Setup {
            what: what.into(),
            detail: detail.into(),
        }
    }

    pub(crate) fn failed(what: impl Into<String>, detail: impl Into<String>) -> BenchError {
        BenchError::Failed {
            what: what.into(),
            detail: detail.into(),
        }
    }

    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> BenchError {
        BenchError::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn device(what: impl Into<String>, source: blockdev::DeviceError) -> BenchError {
        BenchError::Device {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn fs(what: impl Into<String>, source: iomapfs_fs::Error) -> BenchError {
        BenchError::Fs {
            what: what.into(),
            source,
        }
    }
}
