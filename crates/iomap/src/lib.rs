//! The iomap engine.
//!
//! The file system answers one question — "what is at file offset X?" — with
//! an [`Iomap`], through the [`IomapOps`] table. This crate turns reads and
//! writes into device requests from those answers, submits them, and
//! completes them. It knows nothing of the on-disk format.
//!
//! Module map: `iomap`/`ops` (the contract) · `iter` (walking mappings) ·
//! `dio` (direct I/O: planning and synchronous submission) · `byte_dio`
//! (any offset and length) · `ioend` (the in-flight I/O object and the one
//! completion policy) · `flush_coalesce` (shared flushes) · `folio`/`folio_cache` (the page cache:
//! folios with per-block state, budget, eviction, per-file mappings) ·
//! `buffered_io` (reads and writes through it, write-behind) · `readahead`
//! (the next window read in the background) · `background` (their job
//! threads) · `writeback` · `io_lock` and
//! `range_lock` (the inode's I/O lock, in-flight count, range holds) ·
//! `sharded_rwlock` (the I/O lock's reader-scalable core) ·
//! `write_protocol` (shared → exclusive, for every writer) · `file_io` (the
//! synchronous file entry points) · `aio` (the asynchronous queue) · `zero`.

pub mod aio;
pub mod align;
mod background;
pub mod buffered_io;
pub mod byte_dio;
pub mod dio;
pub mod error;
pub mod file_io;
pub mod flush_coalesce;
pub mod folio;
pub mod folio_cache;
pub mod io_lock;
pub mod ioend;
pub mod iomap;
pub mod iter;
pub mod ops;
pub mod range_lock;
pub mod readahead;
pub mod sharded_rwlock;
pub mod write_protocol;
pub mod writeback;
pub mod zero;

#[cfg(test)]
mod test_support;

pub use byte_dio::{dio_read_bytes, dio_write_bytes};
pub use dio::{dio_read, dio_read_simple, dio_write, dio_write_padded};
pub use error::{EngineError, IomapError};
pub use flush_coalesce::{FlushCoalescer, FlushTicket};
pub use folio_cache::{CacheConfig, ErrorCursor, FolioCache, Mapping};
pub use io_lock::{InflightIo, InodeIoLock, IoLockExclusive, IoLockShared};
pub use ioend::{
    CompletedBy, DioEndFlags, DioWriteOutcome, Durability, EndIo, IoEnd, WriteEnd, WriteSync,
};
pub use iomap::{Iomap, IomapFlags, IomapKind};
pub use iter::{IomapIter, IomapSpan};
pub use ops::{FileError, IomapFile, IomapOpFlags, IomapOps};
pub use range_lock::{RangeGuard, RangeLock, RangeMode};
pub use zero::{zero_eof_gap, zero_file_range, zero_range};
