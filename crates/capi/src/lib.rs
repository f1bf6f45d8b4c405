//! libiomapfs: the C API of iomapfs (`libiomapfs.so`, `libiomapfs.a`,
//! header `include/iomapfs.h`, generated from this crate by cbindgen and
//! checked in; `tests/header.rs` fails when it is not current).
//!
//! Conventions, for every function:
//! - Errors are negative errno values (`-ENOENT`, `-ENOSPC`, ...);
//!   `iomapfs_last_error()` then says, for the calling thread, what failed
//!   and where (function, file, offset, device, cause).
//! - No panic crosses the boundary: each entry point runs its body under
//!   `catch_unwind` ([`error::guard`]); a caught panic is `-EIO` with its
//!   message.
//! - Objects and their thread-safety: `iomapfs_volume` (any thread, any
//!   number at once), `iomapfs_file` (like a file descriptor: any thread,
//!   any number at once), `iomapfs_queue` (one thread at a time). Closing
//!   one is the last call on it; a volume refuses to close (`-EBUSY`)
//!   while files or queues of it are open; a second close is `-EBADF`.
//! - Buffers of asynchronous requests: see [`queue`].
//!
//! Module map: `error` (errno, messages, the panic guard) · `handles` (open
//! handles, for close) · `volume` (format, open/close, namespace, statfs,
//! sync) · `file` (file I/O and space) · `queue` (asynchronous I/O) ·
//! `queue_bufs` (a queue's buffers, by address).

#![allow(non_camel_case_types)]

mod error;
mod file;
mod handles;
mod queue;
mod queue_bufs;
mod volume;

use std::ffi::c_char;

pub use error::iomapfs_last_error;
pub use file::*;
pub use queue::*;
pub use volume::*;

/// This library's version, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn iomapfs_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
