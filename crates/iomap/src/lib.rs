//! The iomap engine.
//!
//! The file system answers one question — "what is at file offset X?" — with
//! an [`Iomap`], through the [`IomapOps`] table. This crate turns reads and
//! writes into device requests from those answers. It knows nothing of the
//! on-disk format.

pub mod align;
pub mod async_dio;
pub mod byte_dio;
pub mod dio;
pub mod error;
pub mod flush_coalesce;
pub mod io_lock;
pub mod iomap;
pub mod iter;
pub mod ops;
pub mod range_lock;
pub mod zero;

#[cfg(test)]
mod test_support;

pub use byte_dio::{dio_read_bytes, dio_write_bytes};
pub use dio::{dio_read, dio_read_simple, dio_write, dio_write_padded, DioWriteOutcome};
pub use error::IomapError;
pub use flush_coalesce::FlushCoalescer;
pub use io_lock::{
    DioInflightGuard, InodeIoLock, IoLockExclusive, IoLockShared, OwnedDioInflight,
    OwnedSharedRange,
};
pub use iomap::{Iomap, IomapFlags, IomapKind};
pub use iter::{IomapIter, IomapSpan};
pub use ops::{DioEndFlags, IomapOpFlags, IomapOps};
pub use range_lock::{RangeGuard, RangeLock, RangeMode};
pub use zero::{zero_file_range, zero_range};
