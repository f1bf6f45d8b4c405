//! What the benchmark examples share: the read size, offsets, and the loop
//! that keeps a queue full of random reads.

use std::time::{Duration, Instant};

use blockdev::rng::SplitMix64;
use blockdev::{AlignedBuf, DeviceQueue, DeviceRequest};

/// Bytes per read.
pub const BLOCK: usize = 4096;

/// Random block-aligned offsets from the workspace's seeded generator.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    /// A random block-aligned offset below `blocks` blocks.
    pub fn offset(&mut self, blocks: u64) -> u64 {
        self.0.below(blocks) * BLOCK as u64
    }
}

/// One thread keeping `depth` random reads in flight on `q` for `run_for`,
/// each buffer from `buffer`; returns reads per second. Leaves nothing in
/// flight.
pub fn keep_reads_in_flight(
    q: &mut dyn DeviceQueue,
    blocks: u64,
    depth: usize,
    run_for: Duration,
    mut buffer: impl FnMut(&mut dyn DeviceQueue) -> AlignedBuf,
) -> f64 {
    let mut rng = Rng::new(0x51_7cc1_b727_220a);
    for token in 0..depth as u64 {
        let buf = buffer(q);
        let offset = rng.offset(blocks);
        q.push(token, DeviceRequest::Read { offset, buf }).unwrap();
    }
    q.submit().unwrap();
    let mut out = Vec::with_capacity(depth);
    let mut n = 0u64;
    let start = Instant::now();
    q.reap(1, &mut out).unwrap();
    loop {
        let stopping = start.elapsed() >= run_for;
        for c in out.drain(..) {
            c.result.unwrap();
            n += 1;
            if !stopping {
                let buf = c.buf.unwrap();
                let offset = rng.offset(blocks);
                q.push(c.token, DeviceRequest::Read { offset, buf })
                    .unwrap();
            }
        }
        if stopping {
            break;
        }
        // One io_uring_enter: send the new reads, wait for the next.
        q.submit_and_reap(1, &mut out).unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    while q.in_flight() > 0 {
        q.reap(q.in_flight(), &mut out).unwrap();
        out.clear();
    }
    n as f64 / elapsed
}
