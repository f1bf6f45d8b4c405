//! The out-of-order queue (`MemDevice::with_out_of_order_queue`): it
//! reorders completions, reproducibly per seed, and stays inside the queue
//! contract. The contract tests it shares with the other queues are in
//! `queues.rs`.

use std::collections::BTreeSet;
use std::sync::Arc;

use blockdev::{
    new_queue, AlignedBuf, BlockDevice, DeviceCompletion, DeviceError, DeviceQueue, DeviceRequest,
    FaultOp, FaultRule, MemDevice, OutOfOrderQueue, Survival, Token, WriteMode,
};

const LBS: usize = 512;
const BLOCKS: usize = 64;
/// Enough seeds that every outcome a test looks for shows up many times
/// over (each has a probability of about 1/2 per seed).
const SEEDS: u64 = 64;

fn device(seed: u64) -> Arc<MemDevice> {
    Arc::new(MemDevice::new((BLOCKS * LBS) as u64, LBS as u32).with_out_of_order_queue(seed))
}

fn queue(dev: &Arc<MemDevice>, depth: usize) -> Box<dyn DeviceQueue> {
    let dev: Arc<dyn BlockDevice> = dev.clone();
    new_queue(&dev, depth).unwrap()
}

fn buf(blocks: usize, fill: u8) -> AlignedBuf {
    let mut b = AlignedBuf::new(blocks * LBS, LBS).unwrap();
    b.fill(fill);
    b
}

fn write(block: usize, blocks: usize, fill: u8) -> DeviceRequest {
    DeviceRequest::Write {
        offset: (block * LBS) as u64,
        buf: buf(blocks, fill),
        mode: WriteMode::Normal,
    }
}

fn read(block: usize, blocks: usize) -> DeviceRequest {
    DeviceRequest::Read {
        offset: (block * LBS) as u64,
        buf: buf(blocks, 0x55),
    }
}

/// Submits, then reaps one at a time until nothing is in flight; the
/// completions in the order the queue gave them.
fn drain(q: &mut dyn DeviceQueue) -> Vec<DeviceCompletion> {
    q.submit().unwrap();
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        let n = q.reap(1, &mut out).unwrap();
        assert!(n >= 1, "reap(1) with requests in flight returned {n}");
    }
    out
}

fn tokens(completions: &[DeviceCompletion]) -> Vec<Token> {
    completions.iter().map(|c| c.token).collect()
}

/// The byte each block of `dev` holds, checking blocks are uniform.
fn blocks_of(dev: &MemDevice) -> Vec<u8> {
    dev.snapshot()
        .chunks(LBS)
        .map(|b| {
            assert!(b.iter().all(|&x| x == b[0]), "block torn inside");
            b[0]
        })
        .collect()
}

/// Sixteen reads of distinct blocks, pushed in token order, completed.
fn read_order(seed: u64) -> Vec<Token> {
    let dev = device(seed);
    let mut q = queue(&dev, 16);
    for t in 0..16 {
        q.push(t, read(t as usize, 1)).unwrap();
    }
    tokens(&drain(q.as_mut()))
}

#[test]
fn completion_order_differs_from_submission_order_and_repeats_per_seed() {
    let in_order: Vec<Token> = (0..16).collect();
    let mut orders = BTreeSet::new();
    for seed in 0..SEEDS {
        let order = read_order(seed);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, in_order, "seed {seed}: each request exactly once");
        assert_eq!(order, read_order(seed), "seed {seed} is a reproducer");
        orders.insert(order);
    }
    assert!(
        !orders.contains(&in_order),
        "some seed completed 16 requests in submission order"
    );
    assert!(orders.len() > 1, "every seed gave the same order");
}

/// Determinism covers the whole call sequence, including reaps that do
/// not wait and the number of completions each reap returns.
#[test]
fn the_same_seed_and_calls_give_the_same_completions() {
    let run = |seed: u64| {
        let dev = device(seed);
        let mut q = queue(&dev, 32);
        let mut log = Vec::new();
        let mut out = Vec::new();
        for round in 0..20u64 {
            for i in 0..3 {
                let t = round * 3 + i;
                let block = (t % BLOCKS as u64) as usize;
                let request = match t % 4 {
                    0 => write(block, 1, t as u8),
                    1 => read(block, 1),
                    2 => DeviceRequest::Flush,
                    _ => write(block, 1, !(t as u8)),
                };
                q.push(t, request).unwrap();
            }
            q.submit().unwrap();
            let n = q.reap((round % 3) as usize, &mut out).unwrap();
            log.push(n as u64);
        }
        out.extend(drain(q.as_mut()));
        log.extend(tokens(&out));
        (log, dev.snapshot())
    };
    for seed in [3, 99] {
        assert_eq!(run(seed), run(seed), "seed {seed}");
    }
    assert_ne!(run(3).0, run(99).0, "the seed chooses");
}

#[test]
fn every_request_completes_once_with_its_own_token_and_buffer() {
    for seed in 0..SEEDS {
        let dev = device(seed);
        let mut q = queue(&dev, 48);
        // Writes to distinct blocks (fill = token), reads of other blocks,
        // flushes, in batches reaped partially between them.
        let mut out = Vec::new();
        for t in 0..48u64 {
            let request = match t % 3 {
                0 => write(t as usize, 1, t as u8 + 1),
                1 => read(t as usize, 1),
                _ => DeviceRequest::Flush,
            };
            q.push(t, request).unwrap();
            if t % 7 == 6 {
                q.submit().unwrap();
                let min = (t % 3) as usize;
                let n = q.reap(min, &mut out).unwrap();
                assert!(n >= min, "seed {seed}: reap({min}) returned {n}");
            }
        }
        out.extend(drain(q.as_mut()));
        let mut seen: Vec<Token> = tokens(&out);
        seen.sort();
        assert_eq!(seen, (0..48).collect::<Vec<_>>(), "seed {seed}");
        for c in &out {
            let t = c.token;
            match t % 3 {
                0 => {
                    assert_eq!(*c.result.as_ref().unwrap(), LBS, "seed {seed} token {t}");
                    let b = c.buf.as_ref().expect("write buffer handed back");
                    assert!(b.iter().all(|&x| x == t as u8 + 1), "seed {seed} {t}");
                }
                1 => {
                    assert_eq!(*c.result.as_ref().unwrap(), LBS, "seed {seed} token {t}");
                    // Nothing ever writes the blocks reads look at.
                    let b = c.buf.as_ref().expect("read buffer handed back");
                    assert!(b.iter().all(|&x| x == 0), "seed {seed} token {t}");
                }
                _ => {
                    assert_eq!(*c.result.as_ref().unwrap(), 0, "seed {seed} token {t}");
                    assert!(c.buf.is_none(), "a flush has no buffer");
                }
            }
        }
    }
}

/// Two overlapping writes in flight: the one that completes last is the one
/// that lands, and across seeds each of them does.
#[test]
fn overlapping_writes_in_flight_land_in_either_order() {
    let mut winners = BTreeSet::new();
    for seed in 0..SEEDS {
        let dev = device(seed);
        let mut q = queue(&dev, 4);
        q.push(1, write(0, 4, 1)).unwrap(); // blocks 0..4
        q.push(2, write(2, 4, 2)).unwrap(); // blocks 2..6
        let order = tokens(&drain(q.as_mut()));
        let b = blocks_of(&dev);
        assert_eq!(&b[0..2], &[1, 1], "seed {seed}");
        assert_eq!(&b[4..6], &[2, 2], "seed {seed}");
        let last = order[1] as u8;
        assert_eq!(
            &b[2..4],
            &[last, last],
            "seed {seed}: the later completion wins"
        );
        winners.insert(last);
    }
    assert_eq!(winners, BTreeSet::from([1, 2]), "both orders seen");
}

/// A read racing a write sees the old or the new data, whole blocks only,
/// and which one agrees with the completion order.
#[test]
fn a_read_racing_a_write_sees_old_or_new_never_a_torn_block() {
    let mut seen = BTreeSet::new();
    for seed in 0..SEEDS {
        let dev = device(seed);
        dev.fill(&[0xee]);
        let mut q = queue(&dev, 4);
        q.push(1, write(1, 4, 7)).unwrap(); // blocks 1..5
        q.push(2, read(0, 4)).unwrap(); // blocks 0..4
        let out = drain(q.as_mut());
        let read_first = out[0].token == 2;
        let r = out.iter().find(|c| c.token == 2).unwrap();
        let data = r.buf.as_ref().unwrap();
        for (i, block) in data.chunks(LBS).enumerate() {
            assert!(
                block.iter().all(|&x| x == block[0]),
                "seed {seed}: block {i} of the read is a mix"
            );
        }
        let per_block: Vec<u8> = data.chunks(LBS).map(|b| b[0]).collect();
        let want = if read_first {
            [0xee, 0xee, 0xee, 0xee]
        } else {
            [0xee, 7, 7, 7]
        };
        assert_eq!(per_block, want, "seed {seed}");
        seen.insert(read_first);
    }
    assert_eq!(seen.len(), 2, "old and new data both seen");
}

/// A flush covers every write completed before it was submitted; a write in
/// flight with it is covered exactly when it completes first.
#[test]
fn a_flush_covers_writes_completed_before_it_was_submitted() {
    let mut covered = BTreeSet::new();
    for seed in 0..SEEDS {
        let dev = device(seed);
        let mut q = queue(&dev, 4);
        q.push(1, write(0, 1, 1)).unwrap();
        assert_eq!(tokens(&drain(q.as_mut())), [1]);
        q.push(2, write(1, 1, 2)).unwrap();
        q.push(3, DeviceRequest::Flush).unwrap();
        let out = drain(q.as_mut());
        for c in &out {
            c.result.as_ref().unwrap();
        }
        let write_first = out[0].token == 2;
        let cut = blocks_of(&dev.power_cut(&mut |_| Survival::Lost));
        assert_eq!(cut[0], 1, "seed {seed}: completed before the flush");
        let want = if write_first { 2 } else { 0 };
        assert_eq!(cut[1], want, "seed {seed}: in flight with the flush");
        covered.insert(write_first);
    }
    assert_eq!(
        covered.len(),
        2,
        "a write in flight was both covered and not"
    );
}

#[test]
fn reap_returns_at_least_min_capped_at_in_flight_and_never_waits_forever() {
    let mut partial = false;
    for seed in 0..SEEDS {
        let dev = device(seed);
        let mut q = queue(&dev, 8);
        let mut out = Vec::new();
        // Nothing in flight: nothing to wait for.
        assert_eq!(q.reap(5, &mut out).unwrap(), 0);
        for t in 0..6 {
            q.push(t, read(t as usize, 1)).unwrap();
        }
        // Not waiting, nothing sent: nothing can complete.
        assert_eq!(q.reap(0, &mut out).unwrap(), 0, "seed {seed}");
        assert_eq!(dev.counters().snapshot().reads, 0, "seed {seed}");
        // Waiting sends first, and waits for what it asked for at least.
        let n = q.reap(2, &mut out).unwrap();
        assert!((2..=6).contains(&n), "seed {seed}: reap(2) gave {n}");
        assert_eq!(q.in_flight(), 6 - n);
        partial |= n < 6;
        // More than in flight: everything left, no hang.
        let rest = q.reap(100, &mut out).unwrap();
        assert_eq!(n + rest, 6, "seed {seed}");
        assert_eq!((q.in_flight(), out.len()), (0, 6));
        // Reaps that never wait still drain a submitted batch.
        for t in 0..6 {
            q.push(t, read(t as usize, 1)).unwrap();
        }
        q.submit().unwrap();
        let mut polls = 0;
        while q.in_flight() > 0 {
            q.reap(0, &mut out).unwrap();
            polls += 1;
            assert!(polls < 1000, "seed {seed}: reap(0) made no progress");
        }
    }
    assert!(partial, "a reap never left anything in flight");
}

/// Queue full: as for every queue, the request comes back untouched, and
/// pushed-but-unsent requests count towards the depth.
#[test]
fn a_full_queue_hands_the_request_back() {
    let dev = device(5);
    let mut q = queue(&dev, 3);
    q.push(1, read(0, 1)).unwrap();
    q.push(2, read(1, 1)).unwrap();
    q.submit().unwrap();
    q.push(3, DeviceRequest::Flush).unwrap();
    let full = q.push(4, write(2, 1, 4)).unwrap_err();
    assert_eq!((full.token, full.depth), (4, 3));
    let DeviceRequest::Write { buf, .. } = full.request else {
        panic!("request changed")
    };
    assert!(buf.iter().all(|&b| b == 4));
    let mut out = Vec::new();
    q.reap(1, &mut out).unwrap();
    q.push(4, write(2, 1, 4)).unwrap();
    assert_eq!(tokens(&out).len() + q.in_flight(), 4);
}

/// Requests reach the device when they complete: faults, validation and
/// counters apply then, and errors come back as completions.
#[test]
fn faults_validation_and_counters_apply_when_a_request_completes() {
    for seed in 0..SEEDS {
        let dev = device(seed);
        dev.inject(FaultRule::new(FaultOp::Write).range(0..LBS as u64).count(1));
        let mut q = queue(&dev, 8);
        q.push(10, write(0, 1, 10)).unwrap(); // injected EIO
        q.push(11, write(1, 1, 11)).unwrap();
        q.push(
            12,
            DeviceRequest::Read {
                offset: 1,
                buf: buf(1, 12),
            },
        )
        .unwrap(); // unaligned
        q.push(
            13,
            DeviceRequest::Read {
                offset: (BLOCKS * LBS) as u64,
                buf: buf(1, 13),
            },
        )
        .unwrap(); // past the end
        q.submit().unwrap();
        assert_eq!(
            dev.counters().snapshot(),
            Default::default(),
            "seed {seed}: nothing reached the device before completing"
        );
        let mut out = drain(q.as_mut());
        out.sort_by_key(|c| c.token);
        assert!(matches!(out[0].result, Err(DeviceError::Io { .. })));
        assert_eq!(*out[1].result.as_ref().unwrap(), LBS);
        assert!(matches!(out[2].result, Err(DeviceError::Unaligned { .. })));
        assert!(matches!(out[3].result, Err(DeviceError::OutOfRange { .. })));
        for c in &out {
            let b = c.buf.as_ref().unwrap();
            assert!(b.iter().all(|&x| x == c.token as u8), "seed {seed}");
        }
        let c = dev.counters().snapshot();
        assert_eq!((c.writes, c.reads), (2, 0), "seed {seed}: {c:?}");
        // The failed write changed nothing.
        assert_eq!(&blocks_of(&dev)[0..2], &[0, 11]);
    }
}

/// Each queue of a device draws its own order, and the device's seed
/// reproduces all of them, also on the device a power cut returns.
#[test]
fn each_queue_of_a_device_has_its_own_reproducible_order() {
    let orders = |dev: &Arc<MemDevice>| -> Vec<Vec<Token>> {
        (0..3)
            .map(|_| {
                let mut q = queue(dev, 16);
                for t in 0..16 {
                    q.push(t, read(t as usize, 1)).unwrap();
                }
                tokens(&drain(q.as_mut()))
            })
            .collect()
    };
    let dev = device(11);
    let first = orders(&dev);
    assert!(
        first[0] != first[1] || first[1] != first[2],
        "queues reorder in lockstep"
    );
    assert_eq!(orders(&device(11)), first);
    let cut = Arc::new(dev.power_cut(&mut |_| Survival::Kept));
    assert_eq!(orders(&cut), first, "a cut device keeps its queue model");
    // The default device keeps the inline queue: push order.
    let inline = Arc::new(MemDevice::new((BLOCKS * LBS) as u64, LBS as u32));
    assert_eq!(orders(&inline)[0], (0..16).collect::<Vec<_>>());
}

/// Dropping the queue abandons what it has not completed: never run.
#[test]
fn dropping_the_queue_abandons_requests_not_completed() {
    let dev = device(2);
    let mut q = queue(&dev, 8);
    q.push(1, write(0, 1, 1)).unwrap();
    q.submit().unwrap();
    q.push(2, write(1, 1, 2)).unwrap();
    drop(q);
    assert_eq!(dev.counters().snapshot(), Default::default());
    assert_eq!(&blocks_of(&dev)[0..2], &[0, 0]);
}

/// The queue works on any device, built directly.
#[test]
fn works_on_any_device_when_built_directly() {
    let mem = Arc::new(MemDevice::new((BLOCKS * LBS) as u64, LBS as u32));
    let dev: Arc<dyn BlockDevice> = mem.clone();
    let mut q = OutOfOrderQueue::new(dev, 0, 1);
    assert_eq!(q.depth(), 1, "depth is clamped");
    q.push(1, write(3, 1, 9)).unwrap();
    let out = drain(&mut q);
    assert_eq!(tokens(&out), [1]);
    assert_eq!(blocks_of(&mem)[3], 9);
}
