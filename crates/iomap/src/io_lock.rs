//! The inode's I/O lock and its in-flight direct-I/O counter.
//!
//! Pure overwrites hold the lock shared and run concurrently, and so do
//! direct writes of whole file-system blocks inside the on-disk EOF, which
//! may allocate and convert (they zero nothing and change no size; the
//! metadata lock orders their allocations); anything else that allocates,
//! converts, zeroes or changes the size holds it exclusive, and first
//! drains in-flight direct I/O (which, once asynchronous, may outlive the
//! shared lock that submitted it).
//!
//! # Protocol
//!
//! ```text
//! shared path:     lock_shared() -> dio_begin() -> submit ... -> guard dropped at completion
//! exclusive path:  lock_exclusive() -> drain_dio() -> allocate / zero / convert ...
//! ```
//!
//! Why the exclusive holder must drain: a sub-block write zeroes the rest of
//! its file-system block when the block is new or unwritten. If a direct write
//! submitted under the shared lock were still in flight to that block, the
//! zeroes could land after its data and destroy it (invariant 5). Holding the
//! lock exclusive stops *new* direct I/O from starting; draining waits out the
//! I/O that already started. Once the counter is zero under the exclusive
//! lock, it stays zero until the lock is released.
//!
//! # Byte-granular writes
//!
//! A write that is not aligned to the device block read-modify-writes its
//! edge blocks. Under the shared lock it holds its device blocks exclusive in
//! the inode's [`RangeLock`], and then every other direct write must hold its
//! blocks shared there, or it could land between the read and the write back
//! and be undone. So that inodes that never see such writes pay nothing, the
//! shared holds start with the inode's first byte-granular write, which runs
//! under the exclusive lock (after a drain, so no unregistered write is in
//! flight) and turns them on for good
//! ([`IoLockExclusive::enable_byte_granular_writes`]):
//!
//! ```text
//! byte_granular_writes() false: aligned writers take no range; an unaligned writer goes exclusive
//! byte_granular_writes() true:  aligned writers hold [pos, end) Shared; unaligned ones hold their
//!                               device blocks Exclusive, both under the shared lock
//! ```
//!
//! # Fault model
//!
//! - A direct I/O that fails or panics still drops its [`InflightIo`],
//!   so the counter cannot leak and `drain_dio` cannot hang on a dead I/O.
//! - A thread that holds an `InflightIo` and then calls `drain_dio` on
//!   the same lock deadlocks: a direct I/O must never wait for its own inode's
//!   drain. This is the caller's rule; it is not detected.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::range_lock::{RangeLock, RangeMode};
use crate::sharded_rwlock::{ShardedReadGuard, ShardedRwLock, ShardedWriteGuard};

/// Per-inode I/O lock (shared/exclusive) plus the count of direct I/Os in
/// flight.
///
/// The counter is an atomic so that starting and completing a direct I/O —
/// the hot path of concurrent overwrites and of inline completion — touches
/// no mutex unless someone is actually draining.
#[derive(Debug, Default)]
pub struct InodeIoLock {
    /// Sharded by CPU: shared holders on different CPUs share no line.
    rw: ShardedRwLock<()>,
    /// Direct I/Os between `dio_begin` and the drop of their guard.
    inflight: AtomicU64,
    /// Threads inside `drain_dio`. Lets the last completion skip the mutex
    /// and condvar when nobody waits.
    drain_waiters: AtomicUsize,
    /// Protects the sleep in `drain_dio` against a lost wake-up.
    drain_mutex: Mutex<()>,
    drained: Condvar,
    /// Device blocks held by byte-granular writes and the writes that must
    /// not interleave with them (see the module docs).
    ranges: RangeLock,
    /// Writes under the shared lock hold ranges (set once, never cleared).
    byte_granular: AtomicBool,
}

/// The I/O lock held shared. Released on drop.
#[must_use = "the lock is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct IoLockShared<'a> {
    _guard: ShardedReadGuard<'a, ()>,
}

/// The I/O lock held exclusive. Released on drop.
#[must_use = "the lock is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct IoLockExclusive<'a> {
    lock: &'a InodeIoLock,
    guard: ShardedWriteGuard<'a, ()>,
}

/// One direct I/O in flight on an inode, and the range it holds in the
/// inode's [`RangeLock`] if it holds one. Dropping it (on completion, error
/// or unwind) releases the range, decrements the counter and wakes a drainer
/// if it was the last.
///
/// `H` is what reaches the lock: `&InodeIoLock` for an I/O that completes
/// in the submitter's scope, or an owning handle (the file system's open
/// file) for an asynchronous request that outlives the lock under which it
/// was counted and must keep the inode alive until it completes.
#[must_use = "the I/O counts as completed as soon as the guard is dropped"]
#[derive(Debug)]
pub struct InflightIo<H: AsRef<InodeIoLock>> {
    /// `None` only once `into_owner` took it out.
    owner: Option<H>,
    range: Option<u64>,
}

impl AsRef<InodeIoLock> for InodeIoLock {
    fn as_ref(&self) -> &InodeIoLock {
        self
    }
}

impl InodeIoLock {
    pub fn new() -> InodeIoLock {
        InodeIoLock::default()
    }

    /// Takes the lock shared: for pure overwrites and reads.
    pub fn lock_shared(&self) -> IoLockShared<'_> {
        IoLockShared {
            _guard: self.rw.read(),
        }
    }

    /// Takes the lock exclusive: for anything that zeroes or changes the
    /// size, and allocations and conversions other than the whole-block
    /// direct writes of the module docs. Call [`IoLockExclusive::drain_dio`] before
    /// doing such work.
    pub fn lock_exclusive(&self) -> IoLockExclusive<'_> {
        IoLockExclusive {
            lock: self,
            guard: self.rw.write(),
        }
    }

    /// Takes the lock shared if that needs no waiting (for NOWAIT callers).
    pub fn try_lock_shared(&self) -> Option<IoLockShared<'_>> {
        self.rw
            .try_read()
            .map(|guard| IoLockShared { _guard: guard })
    }

    /// Takes the lock exclusive if that needs no waiting (for NOWAIT callers).
    pub fn try_lock_exclusive(&self) -> Option<IoLockExclusive<'_>> {
        self.rw
            .try_write()
            .map(|guard| IoLockExclusive { lock: self, guard })
    }

    /// Counts one direct I/O as in flight until the returned guard drops.
    ///
    /// Call it while holding the lock (shared or exclusive), before the I/O
    /// is submitted, so that a later exclusive holder's drain sees it.
    pub fn dio_begin(&self) -> InflightIo<&InodeIoLock> {
        InflightIo::begin(self, None)
    }

    /// Holds `[start, end)` in the range table, waiting for conflicting
    /// holds to go; the hold belongs to an [`InflightIo`].
    pub(crate) fn acquire_range(&self, start: u64, end: u64, mode: RangeMode) -> u64 {
        self.ranges.acquire(start, end, mode)
    }

    /// Like [`Self::acquire_range`], but `None` instead of waiting.
    pub(crate) fn try_acquire_range(&self, start: u64, end: u64, mode: RangeMode) -> Option<u64> {
        self.ranges.try_acquire(start, end, mode)
    }

    fn count_dio(&self) {
        // Relaxed is enough: the increment happens under the I/O lock, whose
        // release/acquire orders it before any later exclusive holder's
        // drain.
        self.inflight.fetch_add(1, Ordering::Relaxed);
    }

    /// The inode's range table (see the module docs).
    pub fn ranges(&self) -> &RangeLock {
        &self.ranges
    }

    /// Whether writes under the shared lock must hold ranges: a
    /// byte-granular write has run on this inode. Stable while the lock is
    /// held in either mode (it changes only under the exclusive lock).
    pub fn byte_granular_writes(&self) -> bool {
        self.byte_granular.load(Ordering::Acquire)
    }

    /// Direct I/Os currently in flight.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Waits until no direct I/O is in flight.
    ///
    /// Call it with the lock held exclusive (prefer
    /// [`IoLockExclusive::drain_dio`], which proves it): otherwise new direct
    /// I/O may start while this waits, and the wait may never end. Sleeps on a
    /// condition variable; no polling.
    pub fn drain_dio(&self) {
        debug_assert!(
            self.rw.is_locked_exclusive(),
            "drain_dio called without the exclusive I/O lock"
        );
        if self.inflight.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut guard = self.drain_mutex.lock();
        // Announce the waiter before re-reading the counter. With SeqCst on
        // both this store and the completion's decrement-then-load (see
        // `dio_end`), at least one side sees the other: either we read zero
        // here, or the last completion sees a waiter and notifies.
        self.drain_waiters.fetch_add(1, Ordering::SeqCst);
        while self.inflight.load(Ordering::SeqCst) != 0 {
            // The completion takes `drain_mutex` before notifying, and we hold
            // it from the check above until `wait` releases it atomically, so
            // the wake-up cannot fall between the check and the sleep.
            self.drained.wait(&mut guard);
        }
        self.drain_waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// One direct I/O completed (its guard dropped).
    fn dio_end(&self) {
        let previous = self.inflight.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(previous > 0, "direct-I/O counter underflow");
        if previous == 1 && self.drain_waiters.load(Ordering::SeqCst) != 0 {
            let _guard = self.drain_mutex.lock();
            self.drained.notify_all();
        }
    }
}

impl<'a> IoLockExclusive<'a> {
    /// Waits until no direct I/O is in flight on this inode. Holding `self`
    /// proves the exclusive lock is held, so none can start meanwhile.
    pub fn drain_dio(&self) {
        self.lock.drain_dio();
    }

    /// Lets byte-granular writes run under the shared lock from now on:
    /// every later write holds ranges. Call after [`Self::drain_dio`], so
    /// no write that started without a range hold is still in flight.
    pub fn enable_byte_granular_writes(&self) {
        debug_assert_eq!(self.lock.inflight(), 0, "enable without a drain");
        self.lock.byte_granular.store(true, Ordering::Release);
    }

    /// Turns the exclusive lock into a shared one without letting another
    /// exclusive holder in between (e.g. after extending a file, to let
    /// overwrites proceed concurrently).
    pub fn downgrade(self) -> IoLockShared<'a> {
        IoLockShared {
            _guard: self.guard.downgrade(),
        }
    }
}

impl<H: AsRef<InodeIoLock>> InflightIo<H> {
    /// Counts one direct I/O in flight on `owner`'s lock, holding `range`
    /// (an id from the lock's range table) until it ends. Call with the lock
    /// held (either mode), like [`InodeIoLock::dio_begin`].
    pub(crate) fn begin(owner: H, range: Option<u64>) -> InflightIo<H> {
        owner.as_ref().count_dio();
        InflightIo {
            owner: Some(owner),
            range,
        }
    }

    /// Counts one direct I/O in flight on `owner`'s lock, with no range.
    pub fn count(owner: H) -> InflightIo<H> {
        InflightIo::begin(owner, None)
    }

    /// The same I/O, now kept by `owner` (a handle on the same inode that
    /// can travel with an asynchronous request).
    pub fn transfer<H2: AsRef<InodeIoLock>>(mut self, owner: H2) -> InflightIo<H2> {
        let from = self.owner.take().expect("owner present until dropped");
        assert!(
            std::ptr::eq(from.as_ref(), owner.as_ref()),
            "an in-flight I/O moved to another inode's lock"
        );
        InflightIo {
            owner: Some(owner),
            range: self.range.take(),
        }
    }

    /// Whoever keeps the I/O in flight.
    pub fn owner(&self) -> &H {
        self.owner.as_ref().expect("owner present until dropped")
    }

    /// Ends the I/O (releasing its range and count) and hands back its
    /// owner.
    pub fn into_owner(mut self) -> H {
        let owner = self.owner.take().expect("owner present until dropped");
        Self::end(owner.as_ref(), self.range.take());
        owner
    }

    fn end(lock: &InodeIoLock, range: Option<u64>) {
        if let Some(id) = range {
            lock.ranges.release(id);
        }
        lock.dio_end();
    }
}

impl<H: AsRef<InodeIoLock>> Drop for InflightIo<H> {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            Self::end(owner.as_ref(), self.range.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Arc, Barrier};
    use std::thread;

    #[test]
    fn shared_is_shared_and_exclusive_excludes() {
        let lock = InodeIoLock::new();
        let a = lock.lock_shared();
        let b = lock.try_lock_shared().expect("two shared holders");
        assert!(lock.try_lock_exclusive().is_none());
        drop((a, b));
        let x = lock.try_lock_exclusive().expect("free lock");
        assert!(lock.try_lock_shared().is_none());
        assert!(lock.try_lock_exclusive().is_none());
        let s = x.downgrade();
        assert!(lock.try_lock_shared().is_some());
        assert!(lock.try_lock_exclusive().is_none());
        drop(s);
        assert!(lock.try_lock_exclusive().is_some());
    }

    #[test]
    fn counter_follows_guards() {
        let lock = InodeIoLock::new();
        assert_eq!(lock.inflight(), 0);
        let g1 = lock.dio_begin();
        let g2 = lock.dio_begin();
        assert_eq!(lock.inflight(), 2);
        drop(g1);
        assert_eq!(lock.inflight(), 1);
        drop(g2);
        assert_eq!(lock.inflight(), 0);
        // Nothing in flight: drain returns at once.
        lock.lock_exclusive().drain_dio();
    }

    #[test]
    fn guard_is_released_on_panic() {
        let lock = Arc::new(InodeIoLock::new());
        let l = Arc::clone(&lock);
        let result = thread::spawn(move || {
            let _shared = l.lock_shared();
            let _dio = l.dio_begin();
            panic!("I/O path panicked");
        })
        .join();
        assert!(result.is_err());
        assert_eq!(lock.inflight(), 0);
        // The poisoned-by-panic thread released both the lock and the count.
        lock.lock_exclusive().drain_dio();
    }

    /// Several threads hold direct-I/O guards; a drainer holding the exclusive
    /// lock must not return before the last one is dropped. Each holder
    /// checks, just before releasing, that the drain has not finished.
    #[test]
    fn drain_waits_for_guards_held_by_other_threads() {
        const HOLDERS: usize = 4;
        let lock = Arc::new(InodeIoLock::new());
        let drained = Arc::new(AtomicBool::new(false));
        let all_holding = Arc::new(Barrier::new(HOLDERS + 1));
        let mut release = Vec::new();
        let mut holders = Vec::new();
        for _ in 0..HOLDERS {
            let (tx, rx) = mpsc::channel::<()>();
            release.push(tx);
            let lock = Arc::clone(&lock);
            let drained = Arc::clone(&drained);
            let all_holding = Arc::clone(&all_holding);
            holders.push(thread::spawn(move || {
                let guard = {
                    let _shared = lock.lock_shared();
                    lock.dio_begin()
                    // The shared lock is released here, the I/O stays in
                    // flight: as an asynchronous I/O would.
                };
                all_holding.wait();
                rx.recv().unwrap();
                assert!(
                    !drained.load(Ordering::SeqCst),
                    "drain returned while a direct I/O was in flight"
                );
                drop(guard);
            }));
        }
        all_holding.wait();
        assert_eq!(lock.inflight(), HOLDERS as u64);

        let (drain_started_tx, drain_started_rx) = mpsc::channel();
        let drainer = {
            let lock = Arc::clone(&lock);
            let drained = Arc::clone(&drained);
            thread::spawn(move || {
                let exclusive = lock.lock_exclusive();
                drain_started_tx.send(()).unwrap();
                exclusive.drain_dio();
                assert_eq!(lock.inflight(), 0);
                drained.store(true, Ordering::SeqCst);
            })
        };
        drain_started_rx.recv().unwrap();
        // Release the holders one at a time, in order.
        for (tx, holder) in release.into_iter().zip(holders) {
            tx.send(()).unwrap();
            holder.join().unwrap();
        }
        drainer.join().unwrap();
        assert!(drained.load(Ordering::SeqCst));
        assert_eq!(lock.inflight(), 0);
    }

    /// Many rounds of begin/end racing a drain: no lost wake-up (a lost one
    /// hangs this test).
    #[test]
    fn drain_races_completions_without_losing_wakeups() {
        let lock = Arc::new(InodeIoLock::new());
        for _ in 0..500 {
            let (tx, rx) = mpsc::channel();
            let guard_holder = {
                let lock = Arc::clone(&lock);
                thread::spawn(move || {
                    let guard = {
                        let _shared = lock.lock_shared();
                        lock.dio_begin()
                    };
                    tx.send(()).unwrap();
                    drop(guard);
                })
            };
            rx.recv().unwrap();
            lock.lock_exclusive().drain_dio();
            assert_eq!(lock.inflight(), 0);
            guard_holder.join().unwrap();
        }
    }
}
