//! The queue of every device without one of its own.
//!
//! It runs each request synchronously at `submit`, in push order, through
//! the device's own `read_at`/`write_at`/`flush`, so a wrapper device (fault
//! injection, recording) sees every request its queue carries, and code
//! written against [`DeviceQueue`] runs unchanged on any device.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{
    clamp_depth, refuse_if_full, DeviceCompletion, DeviceQueue, DeviceRequest, QueueFull, Token,
};
use crate::{BlockDevice, DeviceError};

/// A queue for devices without one of their own: [`submit`] runs each queued
/// request in push order through [`BlockDevice::read_at`], `write_at` and
/// `flush`, so its completion is available at once.
///
/// It keeps the queue contract (tokens, buffers handed back, errors as
/// completions, depth limit), so the memory device can stand in for a real
/// queue in tests. It gives no overlap between requests: its throughput is
/// that of one thread calling the device synchronously.
///
/// [`submit`]: DeviceQueue::submit
pub struct InlineQueue {
    dev: Arc<dyn BlockDevice>,
    depth: usize,
    /// Pushed, not yet submitted, in push order.
    queued: VecDeque<(Token, DeviceRequest)>,
    /// Submitted (so finished), not yet reaped.
    done: Vec<DeviceCompletion>,
}

impl InlineQueue {
    /// `depth` is clamped to `1..=`[`MAX_QUEUE_DEPTH`](super::MAX_QUEUE_DEPTH).
    pub fn new(dev: Arc<dyn BlockDevice>, depth: usize) -> InlineQueue {
        let depth = clamp_depth(depth);
        InlineQueue {
            dev,
            depth,
            queued: VecDeque::new(),
            done: Vec::new(),
        }
    }
}

impl DeviceQueue for InlineQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull> {
        let request = refuse_if_full(self.in_flight(), self.depth, token, request)?;
        self.queued.push_back((token, request));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize, DeviceError> {
        let sent = self.queued.len();
        while let Some((token, request)) = self.queued.pop_front() {
            let completion = request.run_on(self.dev.as_ref(), token);
            self.done.push(completion);
        }
        Ok(sent)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError> {
        if self.done.len() < min.min(self.in_flight()) {
            self.submit()?;
        }
        let n = self.done.len();
        out.append(&mut self.done);
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.done.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::new_queue;
    use crate::{AlignedBuf, FaultOp, FaultRule, MemDevice, WriteMode};

    fn buf(len: usize, fill: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len, 512).unwrap();
        b.fill(fill);
        b
    }

    #[test]
    fn inline_queue_runs_at_submit_in_push_order() {
        let mem = Arc::new(MemDevice::new(64 * 1024, 512));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let mut q = new_queue(&dev, 4).unwrap();
        assert_eq!(q.depth(), 4);
        q.push(
            1,
            DeviceRequest::Write {
                offset: 512,
                buf: buf(1024, 7),
                mode: WriteMode::Normal,
            },
        )
        .unwrap();
        q.push(
            2,
            DeviceRequest::Read {
                offset: 0,
                buf: buf(2048, 0xff),
            },
        )
        .unwrap();
        q.push(3, DeviceRequest::Flush).unwrap();
        // Nothing reached the device before submit.
        assert_eq!(mem.counters().snapshot().writes, 0);
        let mut out = Vec::new();
        assert_eq!(q.reap(0, &mut out).unwrap(), 0);
        assert_eq!(q.in_flight(), 3);
        assert_eq!(q.submit().unwrap(), 3);
        assert_eq!(q.reap(3, &mut out).unwrap(), 3);
        assert_eq!(q.in_flight(), 0);
        let tokens: Vec<Token> = out.iter().map(|c| c.token).collect();
        assert_eq!(tokens, [1, 2, 3]);
        assert_eq!(*out[0].result.as_ref().unwrap(), 1024);
        let read = out[1].buf.as_ref().unwrap();
        // The read was pushed after the write, so it sees it.
        assert!(read[..512].iter().all(|&b| b == 0));
        assert!(read[512..1536].iter().all(|&b| b == 7));
        assert!(out[2].buf.is_none());
        let c = mem.counters().snapshot();
        assert_eq!((c.reads, c.writes, c.flushes), (1, 1, 1));
    }

    #[test]
    fn full_queue_hands_the_request_back_and_reap_never_hangs() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4096, 512));
        let mut q = InlineQueue::new(dev, 0);
        assert_eq!(q.depth(), 1, "depth 0 is clamped to 1");
        q.push(5, DeviceRequest::Flush).unwrap();
        let full = q.push(6, DeviceRequest::Flush).unwrap_err();
        assert_eq!((full.token, full.depth), (6, 1));
        assert!(matches!(full.request, DeviceRequest::Flush));
        // Asking for more than is in flight waits for what there is, and a
        // waiting reap submits first.
        let mut out = Vec::new();
        assert_eq!(q.reap(10, &mut out).unwrap(), 1);
        assert_eq!(out[0].token, 5);
        assert_eq!(q.reap(10, &mut out).unwrap(), 0);
    }

    #[test]
    fn errors_are_completions_with_their_token_and_buffer() {
        let mem = Arc::new(MemDevice::new(8192, 512));
        mem.inject(FaultRule::new(FaultOp::Write).count(1));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let mut q = new_queue(&dev, 8).unwrap();
        let reqs = [
            (10, 0u64, 512usize), // injected EIO
            (11, 8192, 512),      // out of range
            (12, 100, 512),       // unaligned
            (13, 512, 512),       // fine
        ];
        for (token, offset, len) in reqs {
            q.push(
                token,
                DeviceRequest::Write {
                    offset,
                    buf: buf(len, token as u8),
                    mode: WriteMode::Fua,
                },
            )
            .unwrap();
        }
        q.submit().unwrap();
        let mut out = Vec::new();
        q.reap(4, &mut out).unwrap();
        assert_eq!(out.len(), 4);
        for c in &out {
            let b = c.buf.as_ref().expect("buffer handed back");
            assert!(b.iter().all(|&x| x == c.token as u8));
        }
        assert!(matches!(out[0].result, Err(DeviceError::Io { .. })));
        assert!(matches!(out[1].result, Err(DeviceError::OutOfRange { .. })));
        assert!(matches!(out[2].result, Err(DeviceError::Unaligned { .. })));
        assert_eq!(*out[3].result.as_ref().unwrap(), 512);
    }
}
