//! The one write protocol, for synchronous and asynchronous writers alike.
//!
//! ```text
//! shared lock ─► range hold (once the inode has byte-granular writes)
//!             ─► attempt the write as a pure overwrite (OVERWRITE_ONLY),
//!                or, whole file-system blocks inside the on-disk EOF, as
//!                a write allowed to allocate and convert (as XFS does)
//!                 └─ WouldBlock (allocation, conversion, zeroing, EOF) ─┐
//! exclusive lock ◄──────────────────────────────────────────────────────┘
//!             ─► drain in-flight direct I/O ─► (first unaligned write:
//!                enable range holds) ─► the write, allowed to allocate
//! ```
//!
//! Why each step is there is in [`crate::io_lock`]. A caller that may not
//! wait ([`Wait::NoWait`]: an asynchronous submitter) takes the shared lock
//! and the range only if they are free, and gets [`Route::Deferred`]
//! wherever a waiting caller would wait or go exclusive: it then hands the
//! write to a context that may block, which runs the protocol again with
//! [`Wait::Block`].
//!
//! The protocol knows locks, not I/O: the caller passes the shared attempt
//! (which receives the write's in-flight count and range hold, to drop when
//! its data is on the device or to move into an asynchronous request) and
//! the exclusive one.

use crate::io_lock::{InflightIo, InodeIoLock, IoLockExclusive, IoLockShared};
use crate::{EngineError, RangeMode};

/// Whether the writer may wait for the lock and for range holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Block,
    NoWait,
}

/// Where a write went.
#[derive(Debug)]
pub enum Route<T> {
    /// The shared or exclusive attempt ran; its result.
    Done(T),
    /// [`Wait::NoWait`] only: the write needs to wait or the exclusive lock.
    Deferred,
}

/// The write's device blocks and alignment, as the protocol needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRange {
    /// File range of the write rounded out to device blocks: what it holds
    /// in the inode's range lock.
    pub start: u64,
    pub end: u64,
    /// The write covers whole device blocks (no read-modify-write).
    pub aligned: bool,
}

/// Runs the write protocol (module docs). `shared` gets the write's
/// in-flight count and range hold and must keep them until its data is on
/// the device; returning a `WouldBlock` error sends the write exclusive.
/// `exclusive` runs with the lock held exclusive and in-flight I/O drained.
pub fn write<T, E: EngineError>(
    lock: &InodeIoLock,
    range: WriteRange,
    wait: Wait,
    shared: impl FnOnce(InflightIo<&InodeIoLock>) -> Result<T, E>,
    exclusive: impl FnOnce(&IoLockExclusive<'_>) -> Result<T, E>,
) -> Result<Route<T>, E> {
    if let Some(attempt) = shared_attempt(lock, range, wait) {
        let Some((_shared, holds)) = attempt else {
            return Ok(Route::Deferred);
        };
        match shared(holds) {
            Err(e) if e.is_would_block() => {}
            other => return other.map(Route::Done),
        }
    }
    if wait == Wait::NoWait {
        return Ok(Route::Deferred);
    }
    let exclusive_lock = lock.lock_exclusive();
    exclusive_lock.drain_dio();
    if !range.aligned {
        exclusive_lock.enable_byte_granular_writes();
    }
    exclusive(&exclusive_lock).map(Route::Done)
}

/// [`write()`] for a caller that may wait: it never defers.
pub fn write_waiting<T, E: EngineError>(
    lock: &InodeIoLock,
    range: WriteRange,
    shared: impl FnOnce(InflightIo<&InodeIoLock>) -> Result<T, E>,
    exclusive: impl FnOnce(&IoLockExclusive<'_>) -> Result<T, E>,
) -> Result<T, E> {
    match write(lock, range, Wait::Block, shared, exclusive)? {
        Route::Done(t) => Ok(t),
        Route::Deferred => unreachable!("a waiting writer is never deferred"),
    }
}

/// [`write()`] for a caller that may not wait (an asynchronous submitter):
/// it never goes exclusive.
pub fn write_nowait<T, E: EngineError>(
    lock: &InodeIoLock,
    range: WriteRange,
    shared: impl FnOnce(InflightIo<&InodeIoLock>) -> Result<T, E>,
) -> Result<Route<T>, E> {
    write(lock, range, Wait::NoWait, shared, |_| {
        unreachable!("a writer that may not wait never goes exclusive")
    })
}

/// The shared half: `None` when the write must go exclusive (an inode's
/// first unaligned write turns range holds on); `Some(None)` when a
/// non-waiting caller would have to wait; otherwise the shared lock and
/// the write's holds.
#[allow(clippy::type_complexity)] // the three outcomes, named in the docs
fn shared_attempt(
    lock: &InodeIoLock,
    range: WriteRange,
    wait: Wait,
) -> Option<Option<(IoLockShared<'_>, InflightIo<&InodeIoLock>)>> {
    let shared = match wait {
        Wait::Block => lock.lock_shared(),
        Wait::NoWait => match lock.try_lock_shared() {
            Some(shared) => shared,
            None => return Some(None),
        },
    };
    // Stable under the shared lock: it changes only under the exclusive one.
    let ranges_on = lock.byte_granular_writes();
    if !range.aligned && !ranges_on {
        return None;
    }
    let hold = if ranges_on {
        let mode = if range.aligned {
            RangeMode::Shared
        } else {
            RangeMode::Exclusive
        };
        match wait {
            Wait::Block => Some(lock.acquire_range(range.start, range.end, mode)),
            Wait::NoWait => match lock.try_acquire_range(range.start, range.end, mode) {
                Some(id) => Some(id),
                None => return Some(None),
            },
        }
    } else {
        None
    };
    Some(Some((shared, InflightIo::begin(lock, hold))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IomapError;
    use std::cell::Cell;

    const ALIGNED: WriteRange = WriteRange {
        start: 0,
        end: 4096,
        aligned: true,
    };
    const UNALIGNED: WriteRange = WriteRange {
        start: 0,
        end: 512,
        aligned: false,
    };

    #[test]
    fn a_pure_overwrite_stays_shared_and_counts_in_flight() {
        let lock = InodeIoLock::new();
        let out = write_waiting::<_, IomapError>(
            &lock,
            ALIGNED,
            |holds| {
                assert_eq!(lock.inflight(), 1);
                assert!(lock.try_lock_exclusive().is_none(), "shared lock held");
                assert!(lock.try_lock_shared().is_some());
                assert_eq!(
                    lock.ranges().held(),
                    0,
                    "no range before byte-granular writes"
                );
                drop(holds);
                Ok(7)
            },
            |_| panic!("went exclusive"),
        )
        .unwrap();
        assert_eq!(out, 7);
        assert_eq!(lock.inflight(), 0);
    }

    #[test]
    fn would_block_retries_exclusive_after_draining() {
        let lock = InodeIoLock::new();
        let tried_shared = Cell::new(false);
        let out = write_waiting::<_, IomapError>(
            &lock,
            ALIGNED,
            |_holds| {
                tried_shared.set(true);
                Err(IomapError::WouldBlock)
            },
            |exclusive| {
                assert!(lock.try_lock_shared().is_none(), "exclusive lock held");
                assert_eq!(lock.inflight(), 0, "the shared attempt's count was dropped");
                exclusive.drain_dio();
                Ok(1)
            },
        )
        .unwrap();
        assert!(tried_shared.get());
        assert_eq!(out, 1);
        assert!(
            !lock.byte_granular_writes(),
            "an aligned write enables nothing"
        );
    }

    #[test]
    fn the_first_unaligned_write_goes_exclusive_and_enables_range_holds() {
        let lock = InodeIoLock::new();
        write_waiting::<_, IomapError>(
            &lock,
            UNALIGNED,
            |_| panic!("first unaligned write ran shared"),
            |_| Ok(()),
        )
        .unwrap();
        assert!(lock.byte_granular_writes());
        // From now on unaligned writes run shared, holding their blocks
        // exclusive; aligned ones hold theirs shared.
        write_waiting::<_, IomapError>(
            &lock,
            UNALIGNED,
            |_holds| {
                assert_eq!(lock.ranges().held(), 1);
                assert!(lock.ranges().try_lock(0, 512, RangeMode::Shared).is_none());
                Ok(())
            },
            |_| panic!("went exclusive"),
        )
        .unwrap();
        write_waiting::<_, IomapError>(
            &lock,
            ALIGNED,
            |_holds| {
                assert!(lock.ranges().try_lock(0, 4096, RangeMode::Shared).is_some());
                assert!(lock
                    .ranges()
                    .try_lock(0, 512, RangeMode::Exclusive)
                    .is_none());
                Ok(())
            },
            |_| panic!("went exclusive"),
        )
        .unwrap();
        assert_eq!(lock.ranges().held(), 0, "holds released with the write");
    }

    #[test]
    fn a_writer_that_may_not_wait_is_deferred_instead() {
        let lock = InodeIoLock::new();
        let never =
            |_: InflightIo<&InodeIoLock>| -> Result<(), IomapError> { panic!("ran shared") };
        let never_exclusive =
            |_: &IoLockExclusive<'_>| -> Result<(), IomapError> { panic!("ran exclusive") };
        // The lock is held exclusive elsewhere.
        {
            let _held = lock.lock_exclusive();
            let route = write(&lock, ALIGNED, Wait::NoWait, never, never_exclusive).unwrap();
            assert!(matches!(route, Route::Deferred));
        }
        // An unaligned write would need the exclusive lock.
        let route = write(&lock, UNALIGNED, Wait::NoWait, never, never_exclusive).unwrap();
        assert!(matches!(route, Route::Deferred));
        // The shared attempt would block.
        let route = write::<(), IomapError>(
            &lock,
            ALIGNED,
            Wait::NoWait,
            |_| Err(IomapError::WouldBlock),
            never_exclusive,
        )
        .unwrap();
        assert!(matches!(route, Route::Deferred));
        // A range held by a read-modify-write.
        lock.lock_exclusive().enable_byte_granular_writes();
        let rmw = lock.ranges().lock(0, 512, RangeMode::Exclusive);
        let route = write(&lock, ALIGNED, Wait::NoWait, never, never_exclusive).unwrap();
        assert!(matches!(route, Route::Deferred));
        drop(rmw);
        let route = write_nowait::<_, IomapError>(&lock, ALIGNED, |holds| {
            assert_eq!(lock.ranges().held(), 1, "aligned writes hold ranges now");
            Ok(std::ptr::eq(holds.into_owner(), &lock))
        })
        .unwrap();
        assert!(matches!(route, Route::Done(true)));
        assert_eq!(lock.inflight(), 0);
        assert_eq!(lock.ranges().held(), 0);
    }

    /// Other errors from the shared attempt are the write's result: no
    /// exclusive retry.
    #[test]
    fn other_errors_end_the_write() {
        let lock = InodeIoLock::new();
        let err = write_waiting::<(), IomapError>(
            &lock,
            ALIGNED,
            |_| Err(IomapError::ForeignFile),
            |_| panic!("retried exclusive"),
        )
        .unwrap_err();
        assert!(matches!(err, IomapError::ForeignFile));
    }
}
