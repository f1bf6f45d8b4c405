//! Registered (fixed) buffers on io_uring queues: the same bytes as plain
//! buffers, foreign buffers take the plain path, and pool buffers and queues
//! can be dropped in any order.

mod common;

use std::sync::Arc;

use blockdev::{
    new_queue, AlignedBuf, BlockDevice, DeviceQueue, DeviceRequest, MemDevice, SyncOpenOptions,
    UringDevice, UringOptions, UringQueue, WriteMode,
};
use common::{image, initial, reap_all};
use rand::rngs::SmallRng as StdRng;
use rand::{Rng, SeedableRng};

const IMAGE_BYTES: usize = 4 << 20;
const BUF_LEN: usize = 16 * 1024;

fn open(path: &std::path::Path, count: usize, len: usize) -> UringDevice {
    UringDevice::open(path, SyncOpenOptions::default(), UringOptions::default())
        .unwrap()
        .with_fixed_buffers(count, len)
}

/// A queue with its pool, or `None` (and why) where the pool cannot be
/// registered (e.g. a tiny RLIMIT_MEMLOCK).
fn pooled_queue(dev: &UringDevice, depth: usize) -> Option<UringQueue> {
    let q = dev.new_queue(depth).unwrap();
    if let Some(why) = q.fixed_buffer_error() {
        eprintln!("skipping: no registered buffers here: {why}");
        return None;
    }
    assert_eq!(q.fixed_buffers(), dev.fixed_buffer_options().count);
    Some(q)
}

/// At depths 1..64, batches of writes (to disjoint ranges) and reads mixing
/// pool and plain buffers leave and return exactly the model's bytes, and
/// the pool buffers really went out as fixed entries.
#[test]
fn fixed_and_plain_buffers_give_the_same_bytes() {
    for (round, depth) in [1usize, 2, 7, 16, 32, 64].into_iter().enumerate() {
        let img = image(IMAGE_BYTES, initial);
        let dev = open(img.path(), depth, BUF_LEN);
        let Some(mut q) = pooled_queue(&dev, depth) else {
            return;
        };
        let lbs = dev.caps().logical_block_size as usize;
        let blocks = IMAGE_BYTES / lbs;
        let mut model: Vec<u8> = (0..IMAGE_BYTES).map(initial).collect();
        let mut rng = StdRng::seed_from_u64(0xf1ed + round as u64);
        let mut pool: Vec<AlignedBuf> = Vec::new();
        for _ in 0..(8 + 200 / depth) {
            // Writes: disjoint ranges within one batch.
            let mut taken = vec![false; blocks];
            for token in 0..depth as u64 {
                let nblocks = rng.gen_range(1..=BUF_LEN / lbs);
                let first = rng.gen_range(0..=blocks - nblocks);
                if taken[first..first + nblocks].iter().any(|&t| t) {
                    continue;
                }
                taken[first..first + nblocks].fill(true);
                let len = nblocks * lbs;
                let mut buf = if token % 2 == 0 {
                    q.alloc_buffer(len).expect("pool has one buffer per slot")
                } else {
                    AlignedBuf::new(len, 4096).unwrap()
                };
                assert_eq!(buf.len(), len);
                assert!(buf.iter().all(|&b| b == 0), "pool buffers come zeroed");
                rng.fill(&mut buf[..]);
                let offset = first * lbs;
                model[offset..offset + len].copy_from_slice(&buf);
                let mode = if rng.gen_bool(0.2) {
                    WriteMode::Fua
                } else {
                    WriteMode::Normal
                };
                q.push(
                    token,
                    DeviceRequest::Write {
                        offset: offset as u64,
                        buf,
                        mode,
                    },
                )
                .unwrap();
            }
            for c in reap_all(&mut q) {
                assert_eq!(c.result.unwrap(), c.buf.as_ref().unwrap().len());
                q.recycle_buffer(c.buf.unwrap());
            }
            // Reads: anywhere.
            let mut offsets = Vec::new();
            for token in 0..depth as u64 {
                let nblocks = rng.gen_range(1..=BUF_LEN / lbs);
                let offset = rng.gen_range(0..=blocks - nblocks) * lbs;
                let len = nblocks * lbs;
                let buf = if token % 2 == 1 {
                    q.alloc_buffer(len).unwrap()
                } else {
                    AlignedBuf::new(len, 4096).unwrap()
                };
                offsets.push(offset);
                q.push(
                    token,
                    DeviceRequest::Read {
                        offset: offset as u64,
                        buf,
                    },
                )
                .unwrap();
            }
            for c in reap_all(&mut q) {
                let buf = c.buf.unwrap();
                assert_eq!(c.result.unwrap(), buf.len());
                let offset = offsets[c.token as usize];
                assert!(
                    buf[..] == model[offset..offset + buf.len()],
                    "depth {depth}: read at {offset} (registered: {})",
                    buf.is_registered()
                );
                // Keep some pool buffers out across batches.
                if buf.is_registered() && pool.len() < depth / 4 {
                    pool.push(buf);
                } else {
                    q.recycle_buffer(buf);
                }
            }
        }
        assert!(
            q.fixed_entries() > 0,
            "depth {depth}: no fixed entries sent"
        );
        drop(q);
        drop(pool);
        drop(dev);
        assert!(std::fs::read(img.path()).unwrap() == model, "depth {depth}");
    }
}

/// A plain buffer, a clone of a pool buffer, and another queue's pool buffer
/// all go out as plain reads and writes, correctly; foreign buffers are not
/// taken into this queue's pool.
#[test]
fn foreign_and_plain_buffers_take_the_plain_path() {
    let img = image(IMAGE_BYTES, initial);
    let dev = open(img.path(), 2, 8192);
    let (Some(mut q1), Some(mut q2)) = (pooled_queue(&dev, 4), pooled_queue(&dev, 4)) else {
        return;
    };
    let theirs = q2.alloc_buffer(8192).unwrap();
    let mine = q1.alloc_buffer(4096).unwrap();
    let copy = mine.clone();
    assert!(theirs.is_registered() && mine.is_registered() && !copy.is_registered());
    let plain = AlignedBuf::new(4096, 4096).unwrap();

    let mut w = theirs;
    w.fill(0xa5);
    q1.push(
        1,
        DeviceRequest::Write {
            offset: 8192,
            buf: w,
            mode: WriteMode::Normal,
        },
    )
    .unwrap();
    q1.push(
        2,
        DeviceRequest::Read {
            offset: 0,
            buf: copy,
        },
    )
    .unwrap();
    q1.push(
        3,
        DeviceRequest::Read {
            offset: 4096,
            buf: plain,
        },
    )
    .unwrap();
    let out = reap_all(&mut q1);
    assert_eq!(q1.fixed_entries(), 0, "none of these is q1's own buffer");
    let expect = |at: usize, len: usize| (at..at + len).map(initial).collect::<Vec<u8>>();
    assert_eq!(out[1].buf.as_deref().unwrap(), &expect(0, 4096)[..]);
    assert_eq!(out[2].buf.as_deref().unwrap(), &expect(4096, 4096)[..]);

    // Back through q1's own buffer: fixed this time, and it sees the write.
    q1.push(
        4,
        DeviceRequest::Read {
            offset: 8192,
            buf: mine,
        },
    )
    .unwrap();
    let back = reap_all(&mut q1);
    assert_eq!(q1.fixed_entries(), 1);
    assert!(back[0].buf.as_ref().unwrap().iter().all(|&b| b == 0xa5));

    // q2's buffer recycled into q1 is not adopted (q1 has one left: the
    // other was read into and is recycled below).
    let mut outs = out.into_iter();
    let theirs = outs.next().unwrap().buf.unwrap();
    q1.recycle_buffer(theirs);
    assert!(q1.alloc_buffer(4096).is_some());
    assert!(q1.alloc_buffer(4096).is_none(), "pool exhausted");
    q1.recycle_buffer(back.into_iter().next().unwrap().buf.unwrap());
    assert!(
        q1.alloc_buffer(8193).is_none(),
        "longer than the pool's buffers"
    );
    assert_eq!(q1.alloc_buffer(512).unwrap().len(), 512);
}

/// Pool buffers outliving their queue, queues dropped with fixed requests in
/// flight, pool buffers dropped before the queue: all fine, and a buffer
/// whose ring is gone still works (plainly) on another queue.
#[test]
fn pool_buffers_and_queues_drop_in_any_order() {
    let img = image(IMAGE_BYTES, initial);
    let dev = Arc::new(open(img.path(), 8, 4096));
    let Some(mut q) = pooled_queue(&dev, 8) else {
        return;
    };
    let mut kept: Vec<AlignedBuf> = (0..4).map(|_| q.alloc_buffer(4096).unwrap()).collect();
    // Dropped by the caller: the slot is gone, the rest of the pool works.
    drop(q.alloc_buffer(4096).unwrap());
    for i in 0..3u64 {
        let buf = q.alloc_buffer(4096).unwrap();
        q.push(
            i,
            DeviceRequest::Read {
                offset: i * 4096,
                buf,
            },
        )
        .unwrap();
    }
    assert!(q.alloc_buffer(4096).is_none());
    q.submit().unwrap();
    // Dropped with fixed reads in flight: waits for them.
    drop(q);

    // The kept buffers outlived their ring; on a new queue they are foreign.
    let Some(mut q2) = pooled_queue(&dev, 8) else {
        return;
    };
    for (i, buf) in kept.drain(..).enumerate() {
        let offset = (i * 4096 + 65536) as u64;
        q2.push(i as u64, DeviceRequest::Read { offset, buf })
            .unwrap();
    }
    let out = reap_all(&mut q2);
    assert_eq!(q2.fixed_entries(), 0);
    for c in &out {
        let at = c.token as usize * 4096 + 65536;
        let want: Vec<u8> = (at..at + 4096).map(initial).collect();
        assert_eq!(c.buf.as_deref().unwrap(), &want[..]);
    }
    // Pool buffers of q2 out when the device handle and the queue go.
    let a = q2.alloc_buffer(4096).unwrap();
    let b = q2.alloc_buffer(4096).unwrap();
    drop(dev);
    drop(a);
    drop(q2);
    assert_eq!(b.len(), 4096);
    drop(b);
    drop(out);
}

/// Queues without a pool (inline queues, uring without the option) hand out
/// nothing.
#[test]
fn queues_without_a_pool_return_none() {
    let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 20, 512));
    let mut q = new_queue(&mem, 4).unwrap();
    assert!(q.alloc_buffer(4096).is_none());
    let img = image(1 << 20, initial);
    let dev = open(img.path(), 0, 4096);
    let mut q = dev.new_queue(4).unwrap();
    assert_eq!(q.fixed_buffers(), 0);
    assert!(q.fixed_buffer_error().is_none());
    assert!(q.alloc_buffer(4096).is_none());
}

/// A queue without a configured pool registers buffers one at a time: they
/// go out as fixed entries with the right bytes, an unregistered buffer's
/// table entry is handed out again, a buffer dropped instead never is, and
/// a queue with a configured pool registers none this way.
#[test]
fn buffers_registered_one_at_a_time() {
    let img = image(IMAGE_BYTES, initial);
    let dev = open(img.path(), 0, 0);
    let mut q = dev.new_queue(8).unwrap();
    let Some(mut a) = q.register_buffer(8192) else {
        eprintln!(
            "skipping: no registered buffers here: {:?}",
            q.fixed_buffer_error()
        );
        return;
    };
    let b = q.register_buffer(4096).unwrap();
    assert!(a.is_registered() && b.is_registered());
    assert_eq!((a.len(), b.len(), q.fixed_buffers()), (8192, 4096, 2));
    assert!(a.iter().all(|&x| x == 0), "zeroed");

    a.fill(0x5a);
    q.push(
        1,
        DeviceRequest::Write {
            offset: 16384,
            buf: a,
            mode: WriteMode::Normal,
        },
    )
    .unwrap();
    q.push(2, DeviceRequest::Read { offset: 0, buf: b })
        .unwrap();
    let mut out = reap_all(&mut q);
    assert_eq!(q.fixed_entries(), 2, "both went out as fixed entries");
    out.sort_by_key(|c| c.token);
    let want: Vec<u8> = (0..4096).map(initial).collect();
    assert_eq!(out[1].buf.as_deref().unwrap(), &want[..]);
    let a = out[0].buf.take().unwrap();
    q.push(
        3,
        DeviceRequest::Read {
            offset: 16384,
            buf: a,
        },
    )
    .unwrap();
    let back = reap_all(&mut q).pop().unwrap().buf.unwrap();
    assert!(back.iter().all(|&x| x == 0x5a));
    assert_eq!(q.fixed_entries(), 3);

    // Unregistered: its entry is emptied; a new buffer works as a fixed
    // entry.
    q.unregister_buffer(back);
    assert_eq!(q.fixed_buffers(), 1);
    let c = q.register_buffer(4096).unwrap();
    assert_eq!(q.fixed_buffers(), 2);
    // Dropped instead: that entry stays out of use, the next one is new.
    drop(out.pop().unwrap().buf.unwrap());
    let d = q.register_buffer(4096).unwrap();
    assert_eq!(q.fixed_buffers(), 3);
    q.push(
        4,
        DeviceRequest::Read {
            offset: 4096,
            buf: c,
        },
    )
    .unwrap();
    q.push(
        5,
        DeviceRequest::Read {
            offset: 8192,
            buf: d,
        },
    )
    .unwrap();
    for done in reap_all(&mut q) {
        let at = done.token as usize * 4096 - 12288;
        let want: Vec<u8> = (at..at + 4096).map(initial).collect();
        assert_eq!(done.buf.as_deref().unwrap(), &want[..]);
    }
    assert_eq!(q.fixed_entries(), 5);

    // A configured pool excludes buffers registered one at a time.
    let pooled = open(img.path(), 2, 4096);
    if let Some(mut p) = pooled_queue(&pooled, 4) {
        assert!(p.register_buffer(4096).is_none());
    }
}
