//! A seeded queue that completes requests out of submission order, as NVMe
//! and io_uring do, for tests.
//!
//! [`InlineQueue`](super::InlineQueue) runs each request at `submit`, in push
//! order, so code tested only on it has never seen a reordered completion;
//! this queue shows it the reorderings a real queue may produce, and the
//! same ones again for the same seed. [`MemDevice::with_out_of_order_queue`]
//! makes it the memory device's native queue; it works on any device.
//!
//! # Fault model
//!
//! Within the [`DeviceQueue`] contract ("Contract, in one place"), and next
//! to the device's own fault model (for the memory device, in
//! [`crate::memory`]):
//!
//! - `push` holds a request; `submit` hands the held ones to the device. A
//!   request never starts before it was submitted, except that a reap which
//!   has to wait submits first, as the contract says.
//! - Each `reap` completes a seeded-random number of the submitted requests,
//!   in seeded-random order: at least as many as the caller waits for (`min`,
//!   capped at [`in_flight`](DeviceQueue::in_flight)), possibly more, possibly
//!   none when the caller does not wait. Waiting is completing more, so a
//!   reap never blocks.
//! - Completing a request *is* running it on the device, at that moment,
//!   through the device's `read_at`/`write_at`/`flush`: validation,
//!   counters, injected faults and pauses apply exactly as for the inline
//!   queue, only later and in another order. Each request completes exactly
//!   once, with its own token and buffer.
//! - Hence: of two overlapping writes in flight, either may land last; a
//!   read overlapping a write in flight returns the old or the new data; a
//!   flush makes durable every write that completed before the flush *ran*.
//!   That covers every write completed before it was *submitted*, which is
//!   all the contract promises; a write still in flight when the flush
//!   completes may stay volatile. Durability can come early, never late.
//! - Deterministic: no threads, no clock. The same seed and the same calls
//!   give the same completions in the same order, so a failing seed is a
//!   reproducer.
//! - Dropping the queue abandons the requests it has not completed: they
//!   never reach the device, as if the process died before the device
//!   started them.
//!
//! Not modelled: a read torn against a write in flight (each request runs
//! whole, so a read sees every overlapping write wholly or not at all; real
//! devices may mix logical blocks within one request, never bytes within
//! one block), and completions that arrive between calls (the device only
//! makes progress inside `reap`).
//!
//! [`MemDevice::with_out_of_order_queue`]: crate::MemDevice::with_out_of_order_queue

use std::sync::Arc;

use super::{
    clamp_depth, refuse_if_full, DeviceCompletion, DeviceQueue, DeviceRequest, QueueFull, Token,
};
use crate::rng::SplitMix64;
use crate::{BlockDevice, DeviceError};

/// A [`DeviceQueue`] that completes submitted requests in a seeded-random
/// order: see the fault model in the [module docs](self).
pub struct OutOfOrderQueue {
    dev: Arc<dyn BlockDevice>,
    depth: usize,
    rng: SplitMix64,
    /// Pushed, not yet submitted, in push order.
    queued: Vec<(Token, DeviceRequest)>,
    /// Submitted and not yet run: the device may complete these in any
    /// order. Kept in no particular order (removal swaps).
    sent: Vec<(Token, DeviceRequest)>,
}

impl OutOfOrderQueue {
    /// A queue of `depth` (clamped to `1..=`[`super::MAX_QUEUE_DEPTH`])
    /// requests on `dev`, whose completion order `seed` chooses.
    pub fn new(dev: Arc<dyn BlockDevice>, depth: usize, seed: u64) -> OutOfOrderQueue {
        OutOfOrderQueue {
            dev,
            depth: clamp_depth(depth),
            rng: SplitMix64::new(seed),
            queued: Vec::new(),
            sent: Vec::new(),
        }
    }

    /// Runs one submitted request, chosen by the seed, and returns its
    /// completion. Only with `sent` not empty.
    fn complete_one(&mut self) -> DeviceCompletion {
        let i = self.rng.below(self.sent.len() as u64) as usize;
        let (token, request) = self.sent.swap_remove(i);
        request.run_on(self.dev.as_ref(), token)
    }
}

impl DeviceQueue for OutOfOrderQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull> {
        let request = refuse_if_full(self.in_flight(), self.depth, token, request)?;
        self.queued.push((token, request));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize, DeviceError> {
        let sent = self.queued.len();
        self.sent.append(&mut self.queued);
        Ok(sent)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError> {
        let wait_for = min.min(self.in_flight());
        if self.sent.len() < wait_for {
            self.submit()?;
        }
        // Anywhere from what the caller waits for to everything sent.
        let more = self.rng.below((self.sent.len() - wait_for + 1) as u64) as usize;
        let n = wait_for + more;
        out.reserve(n);
        for _ in 0..n {
            let completion = self.complete_one();
            out.push(completion);
        }
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.sent.len()
    }
}

impl std::fmt::Debug for OutOfOrderQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutOfOrderQueue")
            .field("depth", &self.depth)
            .field("queued", &self.queued.len())
            .field("sent", &self.sent.len())
            .finish()
    }
}
