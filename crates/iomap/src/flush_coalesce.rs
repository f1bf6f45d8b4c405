//! Flush coalescing: one device flush acknowledges every write that completed
//! before it was issued, so concurrent DSYNC writers share flushes instead of
//! each paying for one.
//!
//! One coalescer per device serves both kinds of waiter:
//! - a **synchronous** writer ([`FlushCoalescer::flush_completed_write`])
//!   blocks until a flush covers its write, issuing that flush itself when
//!   none is running;
//! - an **asynchronous** queue never blocks: it takes a [`FlushTicket`] when
//!   a write's data completes, queues a device flush on its own device queue
//!   ([`FlushCoalescer::start_queued_flush`] … [`FlushCoalescer::flush_done`])
//!   and asks [`FlushCoalescer::status`] which of its writes are settled —
//!   by its own flush or by anybody else's.
//!
//! Tickets are handed out in the order writes complete. A flush issued after
//! ticket `t` was taken covers every ticket up to `t`, so a flush records the
//! newest ticket at its start (`upto`) and, when it succeeds, makes every
//! ticket up to `upto` durable. A writer whose write completed while a flush
//! was already running cannot know whether its write reached the device
//! before that flush was issued, so it waits for a later one.
//!
//! # Fault model
//!
//! A failed flush fails every write it covered that no earlier flush made
//! durable: each such waiter gets the error, sync or async alike (the first
//! error wins; a later successful flush does not turn it into a success).
//! The data may still be on the device, but the caller was promised
//! durability and must hear that it was not reached.

use blockdev::{BlockDevice, DeviceError};
use parking_lot::{Condvar, Mutex};

/// A completed write waiting for a flush to cover it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlushTicket(u64);

/// A flush started by an asynchronous queue; hand it back to
/// [`FlushCoalescer::flush_done`] when the device completes it.
#[derive(Debug)]
#[must_use = "a started flush must be reported with flush_done"]
pub struct QueuedFlush {
    upto: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Tickets handed out: writes completed and waiting for durability.
    tickets: u64,
    /// Every ticket up to this one is durable.
    durable_upto: u64,
    /// Tickets `failed_from..=failed_upto` that are not durable were covered
    /// by a failed flush, which returned `failed_errno` (see `fail`).
    failed_from: u64,
    failed_upto: u64,
    failed_errno: i32,
    /// A blocking flush is running and covers tickets up to this one.
    running_upto: Option<u64>,
    /// Synchronous writers waiting (for tests and statistics).
    waiting: usize,
    /// Flushes issued.
    flushes: u64,
}

impl State {
    /// Where ticket `t` stands: durable, failed by a flush that covered it,
    /// or still waiting (`None`). A later successful flush settles a write
    /// as durable, also after an earlier one covering it failed: its data
    /// did reach stable storage.
    fn status(&self, t: u64) -> Option<Result<(), i32>> {
        if self.durable_upto >= t {
            return Some(Ok(()));
        }
        (self.failed_from <= t && t <= self.failed_upto).then_some(Err(self.failed_errno))
    }

    fn finish(&mut self, upto: u64, result: Result<(), i32>) {
        match result {
            Ok(()) => self.durable_upto = self.durable_upto.max(upto),
            Err(errno) => self.fail(upto, errno),
        }
    }

    /// A flush covering tickets up to `upto` failed: the ones not durable
    /// now fail with it. The failed range starts just past the durable
    /// ones: every ticket in it was covered by this flush or by an earlier
    /// failed one (whose range reached at least as low), and the tickets
    /// below it are durable, which `status` checks first.
    fn fail(&mut self, upto: u64, errno: i32) {
        if upto <= self.durable_upto {
            return;
        }
        self.failed_from = self.durable_upto + 1;
        self.failed_upto = self.failed_upto.max(upto);
        self.failed_errno = errno;
    }
}

/// Shares device flushes among concurrent writers. See the module docs.
#[derive(Debug, Default)]
pub struct FlushCoalescer {
    state: Mutex<State>,
    flushed: Condvar,
}

impl FlushCoalescer {
    pub fn new() -> FlushCoalescer {
        FlushCoalescer::default()
    }

    /// Makes a write that has completed durable, sharing the flush with other
    /// callers. Returns once a flush issued after this call began has
    /// completed. A failed flush is an error for every writer it covered.
    pub fn flush_completed_write(&self, dev: &dyn BlockDevice) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        state.tickets += 1;
        let ticket = state.tickets;
        loop {
            match state.status(ticket) {
                Some(Ok(())) => return Ok(()),
                Some(Err(errno)) => return Err(flush_error(errno)),
                None => {}
            }
            if state.running_upto.is_none() {
                let upto = state.tickets;
                state.running_upto = Some(upto);
                state.flushes += 1;
                drop(state);
                let result = dev.flush();
                state = self.state.lock();
                state.running_upto = None;
                state.finish(upto, result.as_ref().map(|_| ()).map_err(|e| e.errno()));
                self.flushed.notify_all();
                return result;
            }
            state.waiting += 1;
            self.flushed.wait(&mut state);
            state.waiting -= 1;
        }
    }

    /// A write's data completed and must be made durable by a flush issued
    /// from now on: its place in line, for [`Self::status`].
    pub fn ticket(&self) -> FlushTicket {
        let mut state = self.state.lock();
        state.tickets += 1;
        FlushTicket(state.tickets)
    }

    /// Whether `ticket`'s write is durable (`Some(Ok)`), was failed by a
    /// flush that covered it (`Some(Err)`), or still needs a flush (`None`).
    pub fn status(&self, ticket: FlushTicket) -> Option<Result<(), DeviceError>> {
        self.state
            .lock()
            .status(ticket.0)
            .map(|r| r.map_err(flush_error))
    }

    /// An asynchronous queue is about to issue a device flush of its own; it
    /// covers every ticket handed out so far.
    pub fn start_queued_flush(&self) -> QueuedFlush {
        let mut state = self.state.lock();
        state.flushes += 1;
        QueuedFlush {
            upto: state.tickets,
        }
    }

    /// The device completed `flush`: the tickets it covered are settled, for
    /// every waiter (synchronous ones are woken).
    pub fn flush_done(&self, flush: QueuedFlush, result: &Result<usize, DeviceError>) {
        let mut state = self.state.lock();
        state.finish(
            flush.upto,
            result.as_ref().map(|_| ()).map_err(|e| e.errno()),
        );
        self.flushed.notify_all();
    }

    /// Synchronous writers currently waiting for a running flush.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiting
    }

    /// Flushes issued through this coalescer.
    pub fn flushes(&self) -> u64 {
        self.state.lock().flushes
    }
}

/// The error every waiter covered by a failed flush gets (the device error
/// itself is not `Clone`; its errno is what callers act on).
fn flush_error(errno: i32) -> DeviceError {
    DeviceError::Flush {
        source: std::io::Error::from_raw_os_error(errno),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::{FaultOp, FaultRule, MemDevice};
    use std::sync::Arc;

    #[test]
    fn writers_arriving_during_a_flush_share_the_next_one() {
        const WRITERS: usize = 8;
        let dev = Arc::new(MemDevice::new(1 << 20, 512));
        // The first flush is held until the others are parked.
        let first_flush = dev.pause_after(FaultRule::new(FaultOp::Flush));
        let coalescer = Arc::new(FlushCoalescer::new());
        let first = {
            let (dev, c) = (dev.clone(), coalescer.clone());
            std::thread::spawn(move || c.flush_completed_write(&*dev))
        };
        first_flush.wait_reached();
        let others: Vec<_> = (1..WRITERS)
            .map(|_| {
                let (dev, c) = (dev.clone(), coalescer.clone());
                std::thread::spawn(move || c.flush_completed_write(&*dev))
            })
            .collect();
        // Every other writer must be parked behind the running flush before
        // it completes, so the schedule (and the bound below) is exact.
        while coalescer.waiting() < WRITERS - 1 {
            std::thread::yield_now();
        }
        first_flush.resume();
        first.join().unwrap().unwrap();
        for t in others {
            t.join().unwrap().unwrap();
        }
        // One flush for the first writer, one shared by the seven that came
        // while it ran (their writes may have completed after it was issued).
        assert_eq!(dev.counters().snapshot().flushes, 2);
        assert_eq!(coalescer.flushes(), 2);
    }

    #[test]
    fn a_lone_writer_flushes_once_per_write() {
        let dev = MemDevice::new(1 << 20, 512);
        let c = FlushCoalescer::new();
        for _ in 0..3 {
            c.flush_completed_write(&dev).unwrap();
        }
        assert_eq!(dev.counters().snapshot().flushes, 3);
    }

    #[test]
    fn a_failed_flush_is_reported() {
        let dev = MemDevice::new(1 << 20, 512);
        dev.inject(FaultRule::new(FaultOp::Flush).count(1));
        let c = FlushCoalescer::new();
        assert!(c.flush_completed_write(&dev).is_err());
        c.flush_completed_write(&dev).unwrap();
    }

    /// A queued flush settles exactly the tickets taken before it started;
    /// later ones wait for the next.
    #[test]
    fn a_queued_flush_covers_the_tickets_taken_before_it() {
        let c = FlushCoalescer::new();
        let a = c.ticket();
        let b = c.ticket();
        let flush = c.start_queued_flush();
        let late = c.ticket();
        assert!(c.status(a).is_none() && c.status(b).is_none());
        c.flush_done(flush, &Ok(0));
        assert!(matches!(c.status(a), Some(Ok(()))));
        assert!(matches!(c.status(b), Some(Ok(()))));
        assert!(c.status(late).is_none(), "issued after the flush started");
        let next = c.start_queued_flush();
        c.flush_done(next, &Ok(0));
        assert!(matches!(c.status(late), Some(Ok(()))));
        assert_eq!(c.flushes(), 2);
    }

    /// A failed queued flush fails exactly the tickets it covered that were
    /// not durable; tickets taken after it still wait, and a second failure
    /// keeps the first one's tickets failed.
    #[test]
    fn a_failed_queued_flush_fails_exactly_what_it_covered() {
        let c = FlushCoalescer::new();
        let durable = c.ticket();
        let f = c.start_queued_flush();
        c.flush_done(f, &Ok(0));
        let covered = c.ticket();
        let f = c.start_queued_flush();
        let after = c.ticket();
        c.flush_done(
            f,
            &Err(DeviceError::Flush {
                source: std::io::Error::from_raw_os_error(libc::EIO),
            }),
        );
        assert!(matches!(c.status(durable), Some(Ok(()))));
        let err = c.status(covered).unwrap().unwrap_err();
        assert_eq!(err.errno(), libc::EIO);
        assert!(c.status(after).is_none());
        // Another failure, covering `after`: `covered` stays failed.
        let f = c.start_queued_flush();
        c.flush_done(
            f,
            &Err(DeviceError::Flush {
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            }),
        );
        assert!(c.status(covered).unwrap().is_err());
        assert_eq!(c.status(after).unwrap().unwrap_err().errno(), libc::ENOSPC);
        assert!(matches!(c.status(durable), Some(Ok(()))));
    }

    /// Synchronous writers parked behind a running flush are covered by a
    /// queued (asynchronous) flush that completes meanwhile, and both kinds
    /// of waiter see one order of tickets.
    #[test]
    fn sync_waiters_are_settled_by_a_queued_flush() {
        let dev = Arc::new(MemDevice::new(1 << 20, 512));
        let first_flush = dev.pause_after(FaultRule::new(FaultOp::Flush));
        let c = Arc::new(FlushCoalescer::new());
        let first = {
            let (dev, c) = (dev.clone(), c.clone());
            std::thread::spawn(move || c.flush_completed_write(&*dev))
        };
        first_flush.wait_reached();
        let second = {
            let (dev, c) = (dev.clone(), c.clone());
            std::thread::spawn(move || c.flush_completed_write(&*dev))
        };
        while c.waiting() < 1 {
            std::thread::yield_now();
        }
        // An asynchronous queue's flush starts after the parked writer's
        // ticket and completes first: it covers that writer.
        let queued = c.start_queued_flush();
        c.flush_done(queued, &Ok(0));
        second.join().unwrap().unwrap();
        first_flush.resume();
        first.join().unwrap().unwrap();
        // The parked writer issued no flush of its own.
        assert_eq!(dev.counters().snapshot().flushes, 1);
    }
}
