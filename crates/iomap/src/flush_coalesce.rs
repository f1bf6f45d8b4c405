//! Flush coalescing: one device flush acknowledges every write that completed
//! before it was issued, so concurrent DSYNC writers share flushes instead of
//! each paying for one.
//!
//! A writer whose data write has completed takes a ticket; a flush started
//! after the ticket was taken covers it. If a flush is already running, the
//! writer cannot know whether its write completed before that flush was
//! issued, so it waits for the running flush and then for the next one, which
//! it may issue itself on behalf of everyone waiting.

use blockdev::{BlockDevice, DeviceError};
use parking_lot::{Condvar, Mutex};

#[derive(Debug, Default)]
struct State {
    /// Tickets handed out: writes completed and waiting for durability.
    tickets: u64,
    /// Every ticket up to this one is durable.
    durable_upto: u64,
    /// A flush is running and covers tickets up to this one.
    running_upto: Option<u64>,
    /// Writers waiting (for tests and statistics).
    waiting: usize,
    /// Flushes issued.
    flushes: u64,
}

/// Shares device flushes among concurrent writers.
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
    /// completed; an error from that flush is returned to every writer it
    /// covered.
    pub fn flush_completed_write(&self, dev: &dyn BlockDevice) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        state.tickets += 1;
        let ticket = state.tickets;
        loop {
            if state.durable_upto >= ticket {
                return Ok(());
            }
            if state.running_upto.is_none() {
                let upto = state.tickets;
                state.running_upto = Some(upto);
                state.flushes += 1;
                drop(state);
                let result = dev.flush();
                state = self.state.lock();
                state.running_upto = None;
                if result.is_ok() {
                    state.durable_upto = state.durable_upto.max(upto);
                }
                self.flushed.notify_all();
                // Waiters covered by a failed flush retry with a flush of
                // their own: a later success does make their (completed)
                // write durable.
                return result;
            }
            state.waiting += 1;
            self.flushed.wait(&mut state);
            state.waiting -= 1;
        }
    }

    /// Writers currently waiting for a running flush.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiting
    }

    /// Flushes issued through this coalescer.
    pub fn flushes(&self) -> u64 {
        self.state.lock().flushes
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
        dev.inject(blockdev::FaultRule::new(blockdev::FaultOp::Flush).count(1));
        let c = FlushCoalescer::new();
        assert!(c.flush_completed_write(&dev).is_err());
        c.flush_completed_write(&dev).unwrap();
    }
}
