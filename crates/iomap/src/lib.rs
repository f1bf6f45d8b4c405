//! The iomap engine.
//!
//! The file system answers one question — "what is at file offset X?" — with
//! an [`Iomap`], through the [`IomapOps`] table. This crate turns reads and
//! writes into device requests from those answers. It knows nothing of the
//! on-disk format.

pub mod dio;
pub mod error;
pub mod io_lock;
pub mod iomap;
pub mod ops;

pub use error::IomapError;
pub use io_lock::InodeIoLock;
pub use iomap::{Iomap, IomapFlags, IomapKind};
pub use ops::{DioEndFlags, IomapOpFlags, IomapOps};
