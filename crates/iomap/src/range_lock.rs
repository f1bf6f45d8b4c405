//! Byte-range locks on one inode's file offsets.
//!
//! A byte-granular direct write read-modify-writes the device blocks at its
//! edges: it reads a whole block, merges its bytes in and writes the block
//! back. Another write landing on that block between the read and the write
//! back would be undone by it. The read-modify-writer therefore holds its
//! device blocks *exclusive*, and every other direct write to those blocks
//! holds them *shared* (aligned writes do not conflict with one another: each
//! device block ends up with one writer's bytes, as on a raw device).
//!
//! Ranges are file offsets of one inode. Under the inode's shared I/O lock a
//! pure overwrite's file blocks map to fixed device blocks (remapping needs
//! the exclusive lock and a drain), and no two inodes share device blocks,
//! so locking file ranges locks exactly the affected device blocks.
//!
//! A hold lasts one write (for a long unaligned write, all of its chunks).
//! Few are held at once, so the table is a plain list under a mutex; waiters
//! sleep on a condition variable. There is no fairness: a waiter for an
//! exclusive range can wait as long as overlapping shared holds keep coming.
//!
//! # Fault model
//!
//! - A guard dropped on error or unwind releases its range; nothing leaks.
//! - Waiting for a range while holding another can deadlock if two threads
//!   do it in opposite orders: every holder takes exactly one range.

use parking_lot::{Condvar, Mutex};

/// How a range is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeMode {
    /// Compatible with other shared holds: whole-block writers.
    Shared,
    /// Alone on its range: a read-modify-write of edge blocks.
    Exclusive,
}

#[derive(Debug)]
struct Held {
    id: u64,
    start: u64,
    end: u64,
    mode: RangeMode,
}

impl Held {
    fn conflicts(&self, start: u64, end: u64, mode: RangeMode) -> bool {
        let overlaps = self.start < end && start < self.end;
        overlaps && (mode == RangeMode::Exclusive || self.mode == RangeMode::Exclusive)
    }
}

#[derive(Debug, Default)]
struct Table {
    held: Vec<Held>,
    next_id: u64,
    /// Threads sleeping in [`RangeLock::lock`]; releases skip the wake-up
    /// when there are none.
    waiters: usize,
}

/// The range table of one inode. See the module docs.
#[derive(Debug, Default)]
pub struct RangeLock {
    table: Mutex<Table>,
    released: Condvar,
}

/// A held range, released on drop.
#[must_use = "the range is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct RangeGuard<'a> {
    lock: &'a RangeLock,
    id: u64,
}

impl RangeLock {
    pub fn new() -> RangeLock {
        RangeLock::default()
    }

    /// Holds `[start, end)` in `mode`, waiting while a conflicting hold
    /// exists.
    pub fn lock(&self, start: u64, end: u64, mode: RangeMode) -> RangeGuard<'_> {
        RangeGuard {
            lock: self,
            id: self.acquire(start, end, mode),
        }
    }

    /// The hold behind [`RangeLock::lock`], for guards that own their
    /// lock's owner; `release` it exactly once.
    pub(crate) fn acquire(&self, start: u64, end: u64, mode: RangeMode) -> u64 {
        let mut table = self.table.lock();
        while table.held.iter().any(|h| h.conflicts(start, end, mode)) {
            table.waiters += 1;
            self.released.wait(&mut table);
            table.waiters -= 1;
        }
        insert(&mut table, start, end, mode)
    }

    /// Holds `[start, end)` in `mode` if no conflicting hold exists; never
    /// waits.
    pub fn try_lock(&self, start: u64, end: u64, mode: RangeMode) -> Option<RangeGuard<'_>> {
        self.try_acquire(start, end, mode)
            .map(|id| RangeGuard { lock: self, id })
    }

    /// The hold behind [`RangeLock::try_lock`], for guards that own their
    /// lock's owner; `release` it exactly once.
    pub(crate) fn try_acquire(&self, start: u64, end: u64, mode: RangeMode) -> Option<u64> {
        let mut table = self.table.lock();
        if table.held.iter().any(|h| h.conflicts(start, end, mode)) {
            return None;
        }
        Some(insert(&mut table, start, end, mode))
    }

    /// Threads waiting for a range (for tests and diagnostics).
    pub fn waiting(&self) -> usize {
        self.table.lock().waiters
    }

    /// Ranges currently held (for tests and diagnostics).
    pub fn held(&self) -> usize {
        self.table.lock().held.len()
    }

    pub(crate) fn release(&self, id: u64) {
        let mut table = self.table.lock();
        if let Some(i) = table.held.iter().position(|h| h.id == id) {
            table.held.swap_remove(i);
        }
        // Waiters count themselves and sleep under this mutex, so none can
        // slip between the removal and this check.
        if table.waiters != 0 {
            self.released.notify_all();
        }
    }
}

fn insert(table: &mut Table, start: u64, end: u64, mode: RangeMode) -> u64 {
    let id = table.next_id;
    table.next_id += 1;
    table.held.push(Held {
        id,
        start,
        end,
        mode,
    });
    id
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.lock.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc, Barrier};
    use std::thread;

    #[test]
    fn shared_holds_coexist_and_exclusive_excludes_overlaps_only() {
        let lock = Arc::new(RangeLock::new());
        let a = lock.lock(0, 4096, RangeMode::Shared);
        let b = lock.lock(0, 8192, RangeMode::Shared);
        assert_eq!(lock.held(), 2);
        assert!(lock.try_lock(4000, 4100, RangeMode::Exclusive).is_none());
        // Disjoint (half-open ranges: 8192 is not inside [0, 8192)).
        let c = lock
            .try_lock(8192, 9000, RangeMode::Exclusive)
            .expect("disjoint range");
        assert!(lock.try_lock(8500, 8600, RangeMode::Shared).is_none());
        drop((a, b));
        let d = lock
            .try_lock(0, 8192, RangeMode::Exclusive)
            .expect("overlapping holds released");
        drop((c, d));
        assert_eq!(lock.held(), 0);
    }

    /// An exclusive holder's read-modify-write must not interleave with
    /// another holder of an overlapping range: each worker does a
    /// non-atomic increment under the lock, so a broken lock loses counts.
    #[test]
    fn exclusive_holds_serialize_read_modify_write() {
        const THREADS: usize = 4;
        const ROUNDS: usize = 2000;
        let lock = Arc::new(RangeLock::new());
        let counter = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(Barrier::new(THREADS));
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (lock, counter, start) = (lock.clone(), counter.clone(), start.clone());
                thread::spawn(move || {
                    start.wait();
                    for i in 0..ROUNDS {
                        // Different ranges, all sharing bytes 512..1024.
                        let from = ((t + i) % 3) as u64 * 256;
                        let _g = lock.lock(from, from + 1024, RangeMode::Exclusive);
                        let v = counter.load(Ordering::Relaxed);
                        thread::yield_now();
                        counter.store(v + 1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(counter.load(Ordering::Relaxed), THREADS * ROUNDS);
    }

    #[test]
    fn waiter_wakes_when_the_conflicting_hold_is_released() {
        let lock = Arc::new(RangeLock::new());
        let held = lock.lock(100, 200, RangeMode::Shared);
        let acquired = Arc::new(AtomicBool::new(false));
        let (waiting_tx, waiting_rx) = mpsc::channel();
        let waiter = {
            let (lock, acquired) = (lock.clone(), acquired.clone());
            thread::spawn(move || {
                waiting_tx.send(()).unwrap();
                let _g = lock.lock(150, 160, RangeMode::Exclusive);
                acquired.store(true, Ordering::SeqCst);
            })
        };
        waiting_rx.recv().unwrap();
        // Condition wait, not a sleep: the waiter is parked in `lock`.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while lock.waiting() == 0 {
            assert!(
                !acquired.load(Ordering::SeqCst),
                "took a range held in conflict"
            );
            assert!(std::time::Instant::now() < deadline, "waiter never parked");
            thread::yield_now();
        }
        assert!(!acquired.load(Ordering::SeqCst));
        drop(held);
        waiter.join().unwrap();
        assert!(acquired.load(Ordering::SeqCst));
        assert_eq!(lock.held(), 0);
    }

    #[test]
    fn guards_release_on_panic() {
        let lock = Arc::new(RangeLock::new());
        let l = lock.clone();
        let result = thread::spawn(move || {
            let _g = l.lock(0, 10, RangeMode::Exclusive);
            panic!("writer panicked");
        })
        .join();
        assert!(result.is_err());
        assert_eq!(lock.held(), 0);
    }
}
