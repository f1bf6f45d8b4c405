//! The device's request slots, shared by every asynchronous queue on it.
//!
//! A block device's kernel queue holds so many requests at once
//! ([`BlockDevice::request_slots`](blockdev::BlockDevice::request_slots)).
//! Past that, io_uring — whose submitter never waits — hands each request
//! to a kernel worker thread, which costs more CPU than the request itself.
//! So the queues of a volume keep their requests in the kernel within the
//! device's slots: a queue that finds none free keeps the request until one
//! of its own completes (it is sent at the next submit or reap; the
//! submitter does not wait). A queue with no request in the kernel always
//! gets a slot, so it never waits for other queues' requests.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Request slots of one device, counted across its queues.
#[derive(Debug, Default)]
pub struct DeviceSlots {
    /// `None`: no limit (nothing is counted).
    limit: Option<usize>,
    used: AtomicUsize,
}

impl DeviceSlots {
    /// Slots of a device whose kernel queue holds `limit` requests (`None`:
    /// no limit).
    pub fn new(limit: Option<usize>) -> DeviceSlots {
        DeviceSlots {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// Takes a slot for one device request; `false` when all are taken,
    /// unless the caller holds none (then it may go past the limit).
    pub(crate) fn try_take(&self, holds_none: bool) -> bool {
        let Some(limit) = self.limit else {
            return true;
        };
        let before = self.used.fetch_add(1, Ordering::AcqRel);
        if before < limit || holds_none {
            return true;
        }
        self.used.fetch_sub(1, Ordering::AcqRel);
        false
    }

    /// Gives back `n` slots of [`try_take`](DeviceSlots::try_take).
    pub(crate) fn give_back(&self, n: usize) {
        if self.limit.is_some() && n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Slots taken now (0 without a limit).
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_except_for_a_holder_of_none() {
        let slots = DeviceSlots::new(Some(2));
        assert!(slots.try_take(true) && slots.try_take(false));
        assert!(!slots.try_take(false), "both taken");
        assert_eq!(slots.used(), 2);
        assert!(
            slots.try_take(true),
            "a queue with none in the kernel goes on"
        );
        slots.give_back(2);
        assert!(slots.try_take(false));
        assert_eq!(slots.used(), 2);

        let unlimited = DeviceSlots::new(None);
        assert!((0..1000).all(|_| unlimited.try_take(false)));
        assert_eq!(unlimited.used(), 0);
    }
}
