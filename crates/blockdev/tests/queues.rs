//! Device queues: the io_uring queue, the inline queue, the worker-pool
//! queue and the out-of-order queue keep the same contract and give the
//! same results. Tests that do
//! not depend on a backend's completion order run on every queue (see
//! [`subjects`]).

mod common;

use std::sync::Arc;

use blockdev::error::IoOp;
use blockdev::{
    new_queue, open_device, AlignedBuf, Backend, BlockDevice, DeviceError, DeviceQueue,
    DeviceRequest, MemDevice, PoolDevice, PoolOptions, RequestLimits, SyncDevice, SyncOpenOptions,
    UringDevice, UringOptions, WriteMode,
};
use common::{image, initial, random_mix, reap_all};

const IMAGE_BYTES: usize = 4 << 20;
const DEPTHS: [usize; 9] = [1, 2, 3, 8, 17, 32, 64, 128, 256];
/// Seeds of the out-of-order queues the contract tests run on.
const OUT_OF_ORDER_SEEDS: [u64; 2] = [1, 0xdead_beef];

fn uring_device(path: &std::path::Path, opts: UringOptions) -> UringDevice {
    UringDevice::open(path, SyncOpenOptions::default(), opts).unwrap()
}

fn open_uring(path: &std::path::Path, opts: UringOptions) -> Arc<dyn BlockDevice> {
    Arc::new(uring_device(path, opts))
}

/// An io_uring device on `path` that takes no request larger than
/// `max_bytes` whole, so larger ones go in pieces.
fn split_uring(path: &std::path::Path, max_bytes: usize) -> Arc<UringDevice> {
    let limits = RequestLimits {
        max_bytes: Some(max_bytes),
        ..RequestLimits::NONE
    };
    Arc::new(uring_device(path, UringOptions::default()).with_request_limits(limits))
}

fn open_sync(path: &std::path::Path) -> Arc<dyn BlockDevice> {
    Arc::new(SyncDevice::open(path, SyncOpenOptions::default()).unwrap())
}

/// The worker-pool backend over `inner`, with more workers than the test
/// machine may have CPUs, so requests really overlap.
fn pooled(inner: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
    let opts = PoolOptions {
        workers: std::num::NonZeroUsize::new(3),
    };
    Arc::new(PoolDevice::new(inner, opts))
}

fn buf(len: usize, fill: u8) -> AlignedBuf {
    let mut b = AlignedBuf::new(len, 4096).unwrap();
    b.fill(fill);
    b
}

/// A memory device holding the standard initial image, with 512-byte
/// blocks; `Some(seed)` gives it out-of-order queues.
fn memory(out_of_order: Option<u64>) -> Arc<MemDevice> {
    let bytes: Vec<u8> = (0..IMAGE_BYTES).map(initial).collect();
    let dev = MemDevice::from_bytes(bytes, 512, true, false);
    Arc::new(match out_of_order {
        Some(seed) => dev.with_out_of_order_queue(seed),
        None => dev,
    })
}

/// One device whose queues a contract test runs on.
struct Subject {
    name: String,
    dev: Arc<dyn BlockDevice>,
    /// What the device holds, read behind its back (the image file, or the
    /// memory device's snapshot): not through the queue under test.
    contents: Box<dyn Fn() -> Vec<u8>>,
    /// Keeps a file-backed device's image alive.
    _image: Option<tempfile::NamedTempFile>,
}

impl Subject {
    fn file(name: &str, open: impl Fn(&std::path::Path) -> Arc<dyn BlockDevice>) -> Subject {
        let img = image(IMAGE_BYTES, initial);
        let path = img.path().to_owned();
        Subject {
            name: name.into(),
            dev: open(&path),
            contents: Box::new(move || std::fs::read(&path).unwrap()),
            _image: Some(img),
        }
    }

    fn memory(name: String, out_of_order: Option<u64>) -> Subject {
        let mem = memory(out_of_order);
        Subject {
            name,
            dev: mem.clone(),
            contents: Box::new(move || mem.snapshot()),
            _image: None,
        }
    }

    fn pooled_memory() -> Subject {
        let mem = memory(None);
        Subject {
            name: "memory, worker-pool queue".into(),
            dev: pooled(mem.clone()),
            contents: Box::new(move || mem.snapshot()),
            _image: None,
        }
    }
}

/// Every kind of queue: io_uring, the inline queue and the worker-pool
/// queue on image files, the inline and worker-pool queues on the memory
/// device, and out-of-order queues on it.
fn subjects() -> Vec<Subject> {
    let mut all = vec![
        Subject::file("uring", |p| open_uring(p, UringOptions::default())),
        Subject::file("sync, inline queue", open_sync),
        Subject::file("sync, worker-pool queue", |p| pooled(open_sync(p))),
        Subject::memory("memory, inline queue".into(), None),
        Subject::pooled_memory(),
    ];
    for seed in OUT_OF_ORDER_SEEDS {
        all.push(Subject::memory(
            format!("memory, out-of-order queue seed {seed}"),
            Some(seed),
        ));
    }
    all
}

/// The heart of it: for every depth, the same seeded mix of reads, writes,
/// FUA writes and flushes through io_uring, through the inline queue and
/// the worker-pool queue on the sync backend, through the inline queue on
/// the memory device, and through
/// out-of-order queues on it, gives the same completions and leaves the same
/// bytes. (The mix never has a write in flight with an overlapping request,
/// so completion order cannot change an answer.)
#[test]
fn uring_and_inline_queues_agree_on_random_mixes() {
    for (i, depth) in DEPTHS.into_iter().enumerate() {
        let seed = 0x5eed_0000 + i as u64;
        let ops = 300 + 8 * depth;

        let uring_img = image(IMAGE_BYTES, initial);
        let uring = open_uring(uring_img.path(), UringOptions::default());
        assert_eq!(uring.backend_name(), "uring");
        let lbs = uring.caps().logical_block_size as usize;
        let align = uring.caps().memory_alignment.max(1) as usize;
        let size = uring.caps().size_bytes as usize;
        let mut model: Vec<u8> = (0..size).map(initial).collect();
        let mut q = new_queue(&uring, depth).unwrap();
        assert_eq!(q.depth(), depth);
        let uring_log = random_mix(q.as_mut(), &mut model, lbs, align, seed, ops);
        drop(q);

        // The same on io_uring with requests cut into pieces of up to
        // three blocks (the mix's requests have up to sixteen).
        let split_img = image(IMAGE_BYTES, initial);
        let split: Arc<dyn BlockDevice> = split_uring(split_img.path(), 3 * lbs);
        let mut split_model: Vec<u8> = (0..size).map(initial).collect();
        let mut q = new_queue(&split, depth).unwrap();
        let split_log = random_mix(q.as_mut(), &mut split_model, lbs, align, seed, ops);
        drop(q);
        assert_eq!(
            uring_log, split_log,
            "depth {depth}: uring vs uring in pieces"
        );
        assert!(split_model == model);

        let sync_img = image(IMAGE_BYTES, initial);
        let sync = open_sync(sync_img.path());
        assert_eq!(sync.backend_name(), "sync");
        let mut sync_model: Vec<u8> = (0..size).map(initial).collect();
        let mut q = new_queue(&sync, depth).unwrap();
        let sync_log = random_mix(q.as_mut(), &mut sync_model, lbs, align, seed, ops);
        drop(q);

        let pool_img = image(IMAGE_BYTES, initial);
        let pool = pooled(open_sync(pool_img.path()));
        assert_eq!(pool.backend_name(), "pool");
        let mut pool_model: Vec<u8> = (0..size).map(initial).collect();
        let mut q = new_queue(&pool, depth).unwrap();
        let pool_log = random_mix(q.as_mut(), &mut pool_model, lbs, align, seed, ops);
        drop(q);

        let mem = Arc::new(MemDevice::new(size as u64, lbs as u32));
        let initial_bytes: Vec<u8> = (0..size).map(initial).collect();
        mem.write_at(&initial_bytes, 0, WriteMode::Normal).unwrap();
        let mem_dev: Arc<dyn BlockDevice> = mem.clone();
        let mut mem_model = initial_bytes.clone();
        let mut q = new_queue(&mem_dev, depth).unwrap();
        let mem_log = random_mix(q.as_mut(), &mut mem_model, lbs, align, seed, ops);
        drop(q);

        assert_eq!(uring_log.len(), ops);
        assert_eq!(uring_log, sync_log, "depth {depth}: uring vs sync");
        assert_eq!(uring_log, pool_log, "depth {depth}: uring vs worker pool");
        assert_eq!(uring_log, mem_log, "depth {depth}: uring vs memory");
        assert!(model == sync_model && model == pool_model && model == mem_model);

        for ooo_seed in OUT_OF_ORDER_SEEDS {
            let bytes = initial_bytes.clone();
            let ooo = Arc::new(
                MemDevice::from_bytes(bytes, lbs as u32, true, false)
                    .with_out_of_order_queue(ooo_seed ^ seed),
            );
            let ooo_dev: Arc<dyn BlockDevice> = ooo.clone();
            let mut ooo_model = initial_bytes.clone();
            let mut q = new_queue(&ooo_dev, depth).unwrap();
            let ooo_log = random_mix(q.as_mut(), &mut ooo_model, lbs, align, seed, ops);
            drop(q);
            assert_eq!(
                uring_log, ooo_log,
                "depth {depth}: uring vs out-of-order seed {ooo_seed}"
            );
            assert!(ooo_model == model && ooo.snapshot() == model);
        }

        // What reached the files: the model, byte for byte.
        drop((uring, sync, pool));
        assert!(std::fs::read(uring_img.path()).unwrap()[..size] == model[..]);
        assert!(std::fs::read(pool_img.path()).unwrap()[..size] == model[..]);
        drop(split);
        assert!(std::fs::read(split_img.path()).unwrap()[..size] == model[..]);
        assert!(std::fs::read(sync_img.path()).unwrap()[..size] == model[..]);
        assert!(mem.snapshot() == model);
    }
}

#[test]
fn counters_match_the_sync_backend() {
    for subject in subjects() {
        let name = &subject.name;
        let dev = &subject.dev;
        let lbs = dev.caps().logical_block_size as usize;
        let mut q = new_queue(dev, 8).unwrap();
        q.push(
            1,
            DeviceRequest::Write {
                offset: 0,
                buf: buf(2 * lbs, 1),
                mode: WriteMode::Normal,
            },
        )
        .unwrap();
        q.push(
            2,
            DeviceRequest::Write {
                offset: 0,
                buf: buf(lbs, 2),
                mode: WriteMode::Fua,
            },
        )
        .unwrap();
        q.push(
            3,
            DeviceRequest::Read {
                offset: 0,
                buf: buf(2 * lbs, 0),
            },
        )
        .unwrap();
        q.push(4, DeviceRequest::Flush).unwrap();
        q.push(5, DeviceRequest::Flush).unwrap();
        for c in reap_all(q.as_mut()) {
            c.result.unwrap();
        }
        let c = dev.counters().snapshot();
        assert_eq!(
            (c.reads, c.writes, c.fua_writes, c.flushes),
            (1, 2, 1, 2),
            "{name}: {c:?}"
        );
        assert_eq!(c.bytes_written, 3 * lbs as u64, "{name}");
        assert_eq!(c.bytes_read, 2 * lbs as u64, "{name}");
    }
}

/// Invalid requests, and requests the kernel fails, complete with the
/// error, their own token and their buffer; the queue stays usable.
#[test]
fn errors_are_completions_with_the_right_token() {
    for subject in subjects() {
        let mut q = new_queue(&subject.dev, 16).unwrap();
        invalid_requests_complete_with_their_errors(&subject, q.as_mut());
    }

    // A failure inside the kernel: the image shrank under the device.
    let img = image(IMAGE_BYTES, initial);
    let dev = open_uring(img.path(), UringOptions::default());
    let lbs = dev.caps().logical_block_size as usize;
    let mut q = new_queue(&dev, 16).unwrap();
    img.as_file().set_len(0).unwrap();
    q.push(
        20,
        DeviceRequest::Read {
            offset: 0,
            buf: buf(lbs, 0),
        },
    )
    .unwrap();
    q.push(21, DeviceRequest::Flush).unwrap();
    let out = reap_all(q.as_mut());
    assert_eq!(out[0].token, 20);
    assert!(
        matches!(out[0].result, Err(DeviceError::Short { done: 0, .. })),
        "{:?}",
        out[0].result
    );
    assert_eq!(out[1].token, 21);
    out[1].result.as_ref().unwrap();
}

fn invalid_requests_complete_with_their_errors(
    subject: &Subject,
    q: &mut dyn blockdev::DeviceQueue,
) {
    let name = &subject.name;
    let dev = &subject.dev;
    let lbs = dev.caps().logical_block_size as usize;
    let size = dev.caps().size_bytes;
    q.push(
        10,
        DeviceRequest::Read {
            offset: size,
            buf: buf(lbs, 10),
        },
    )
    .unwrap();
    q.push(
        11,
        DeviceRequest::Write {
            offset: 1,
            buf: buf(lbs, 11),
            mode: WriteMode::Normal,
        },
    )
    .unwrap();
    q.push(
        12,
        DeviceRequest::Read {
            offset: 0,
            buf: buf(lbs + 1, 12),
        },
    )
    .unwrap();
    q.push(
        13,
        DeviceRequest::Read {
            offset: 0,
            buf: buf(0, 13),
        },
    )
    .unwrap();
    q.push(
        14,
        DeviceRequest::Read {
            offset: lbs as u64,
            buf: buf(lbs, 14),
        },
    )
    .unwrap();
    let out = reap_all(q);
    let tokens: Vec<_> = out.iter().map(|c| c.token).collect();
    assert_eq!(tokens, [10, 11, 12, 13, 14], "{name}");
    assert!(
        matches!(out[0].result, Err(DeviceError::OutOfRange { .. })),
        "{name}: {:?}",
        out[0]
    );
    assert!(
        matches!(out[1].result, Err(DeviceError::Unaligned { .. })),
        "{name}: {:?}",
        out[1]
    );
    assert!(
        matches!(out[2].result, Err(DeviceError::Unaligned { .. })),
        "{name}: {:?}",
        out[2]
    );
    assert_eq!(*out[3].result.as_ref().unwrap(), 0, "{name}");
    assert_eq!(*out[4].result.as_ref().unwrap(), lbs, "{name}");
    for c in &out[..4] {
        let b = c.buf.as_ref().unwrap();
        assert!(
            b.iter().all(|&x| x == c.token as u8),
            "{name}: buffer {} untouched",
            c.token
        );
    }
    let expect: Vec<u8> = (lbs..2 * lbs).map(initial).collect();
    assert!(out[4].buf.as_ref().unwrap()[..] == expect[..], "{name}");
    // Rejected requests are not counted as issued.
    assert_eq!(dev.counters().snapshot().reads, 2, "{name}");
}

#[test]
fn read_only_devices_complete_writes_with_an_error() {
    let img = image(IMAGE_BYTES, initial);
    let dev: Arc<dyn BlockDevice> = Arc::new(
        UringDevice::open(
            img.path(),
            SyncOpenOptions { read_only: true },
            UringOptions::default(),
        )
        .unwrap(),
    );
    let mut q = new_queue(&dev, 4).unwrap();
    q.push(
        7,
        DeviceRequest::Write {
            offset: 0,
            buf: buf(4096, 7),
            mode: WriteMode::Fua,
        },
    )
    .unwrap();
    let out = reap_all(q.as_mut());
    assert_eq!(out[0].token, 7);
    let err = out[0].result.as_ref().unwrap_err();
    assert!(matches!(err, DeviceError::ReadOnly { .. }), "{err}");
    assert_eq!(dev.counters().snapshot().writes, 0);
}

#[test]
fn a_full_queue_hands_the_request_back() {
    for subject in subjects() {
        let name = &subject.name;
        let dev = &subject.dev;
        let mut q = new_queue(dev, 2).unwrap();
        q.push(1, DeviceRequest::Flush).unwrap();
        q.push(
            2,
            DeviceRequest::Read {
                offset: 0,
                buf: buf(4096, 0),
            },
        )
        .unwrap();
        let full = q
            .push(
                3,
                DeviceRequest::Read {
                    offset: 0,
                    buf: buf(4096, 3),
                },
            )
            .unwrap_err();
        assert_eq!((full.token, full.depth), (3, 2), "{name}");
        let DeviceRequest::Read { buf, .. } = full.request else {
            panic!("{name}: request changed")
        };
        assert!(buf.iter().all(|&b| b == 3), "{name}");
        // `min` beyond what is in flight waits for what there is.
        let mut out = Vec::new();
        assert_eq!(q.reap(100, &mut out).unwrap(), 2, "{name}");
        assert_eq!(q.in_flight(), 0, "{name}");
        // Depth is clamped, never zero.
        assert_eq!(new_queue(dev, 0).unwrap().depth(), 1, "{name}");
    }
}

/// Dropping a queue with requests in flight (submitted or only pushed)
/// waits for them: no crash, no write lost or torn, the device usable after.
#[test]
fn dropping_a_queue_with_requests_in_flight_is_safe() {
    drop_with_requests_in_flight(|dev| new_queue(dev, 256).unwrap());
}

/// The same for a thread queue dropped in its own thread: its completions
/// are deferred to this thread, so the drop's wait must run them.
#[test]
fn dropping_a_thread_queue_with_requests_in_flight_is_safe() {
    drop_with_requests_in_flight(|dev| blockdev::new_thread_queue(dev, 256).unwrap());
}

/// The same with every request in four pieces: a request's buffer may only
/// go once the kernel is done with all of them.
#[test]
fn dropping_a_queue_with_split_requests_in_flight_is_safe() {
    drop_on(
        |path| {
            let lbs = uring_device(path, UringOptions::default())
                .caps()
                .logical_block_size as usize;
            let dev: Arc<dyn BlockDevice> = split_uring(path, lbs);
            dev
        },
        |dev| new_queue(dev, 256).unwrap(),
    );
}

/// The same on the worker pool: workers run the requests, and the drop
/// waits for them.
#[test]
fn dropping_a_pool_queue_with_requests_in_flight_is_safe() {
    drop_on(
        |path| pooled(open_sync(path)),
        |dev| new_queue(dev, 256).unwrap(),
    );
}

fn drop_with_requests_in_flight(make: impl Fn(&Arc<dyn BlockDevice>) -> Box<dyn DeviceQueue>) {
    drop_on(|path| open_uring(path, UringOptions::default()), make);
}

/// Twenty rounds of 128 writes and 128 reads pushed to a queue from
/// `make` on the device `open` makes, 202 of them submitted, none reaped,
/// then the queue dropped: every write is on the device after the drop.
fn drop_on(
    open: impl Fn(&std::path::Path) -> Arc<dyn BlockDevice>,
    make: impl Fn(&Arc<dyn BlockDevice>) -> Box<dyn DeviceQueue>,
) {
    let img = image(IMAGE_BYTES, initial);
    let dev = open(img.path());
    let lbs = dev.caps().logical_block_size as usize;
    let chunk = 4 * lbs;
    for round in 0..20u8 {
        let mut q = make(&dev);
        for i in 0..128usize {
            let offset = (i * chunk) as u64;
            q.push(
                i as u64,
                DeviceRequest::Write {
                    offset,
                    buf: buf(chunk, round ^ i as u8),
                    mode: WriteMode::Normal,
                },
            )
            .unwrap();
            // Reads of other blocks, into buffers the kernel writes to.
            let roff = ((128 + i) * chunk) as u64;
            q.push(
                1000 + i as u64,
                DeviceRequest::Read {
                    offset: roff,
                    buf: buf(chunk, 0),
                },
            )
            .unwrap();
            if i == 100 {
                q.submit().unwrap();
            }
        }
        // 202 submitted, 54 only pushed; none reaped.
        drop(q);
        let mut back = buf(128 * chunk, 0);
        dev.read_at(&mut back, 0).unwrap();
        for i in 0..128usize {
            let want = round ^ i as u8;
            let got = &back[i * chunk..(i + 1) * chunk];
            assert!(got.iter().all(|&b| b == want), "round {round} write {i}");
        }
    }
    let c = dev.counters().snapshot();
    assert_eq!(c.writes, 20 * 128);
}

/// Whether this kernel can defer io_uring completions to a ring's thread
/// (`IORING_SETUP_DEFER_TASKRUN`, Linux 6.1).
fn kernel_defers_completions() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(['.', '-']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or(0)
    };
    (next(), next()) >= (6, 1)
}

/// A queue made for one thread defers its completions to that thread where
/// the kernel can (and an ordinary queue never does), and gives the same
/// results as the sync backend on the same mix of requests, waiting in
/// batches or polling with `reap(0)`.
#[test]
fn a_thread_queue_defers_completions_and_gives_the_same_results() {
    for (i, depth) in [1usize, 8, 64].into_iter().enumerate() {
        let seed = 0x7e7e_0000 + i as u64;
        let ops = 200 + 8 * depth;
        let img = image(IMAGE_BYTES, initial);
        let uring = uring_device(img.path(), UringOptions::default());
        assert!(!uring.new_queue(depth).unwrap().defers_completions());
        let mut q = uring.new_thread_queue(depth).unwrap();
        assert_eq!(q.defers_completions(), kernel_defers_completions());
        let caps = uring.caps().clone();
        let (lbs, size) = (caps.logical_block_size as usize, caps.size_bytes as usize);
        let align = caps.memory_alignment.max(1) as usize;
        let mut model: Vec<u8> = (0..size).map(initial).collect();
        let log = random_mix(&mut q, &mut model, lbs, align, seed, ops);

        let sync_img = image(IMAGE_BYTES, initial);
        let sync = open_sync(sync_img.path());
        let mut sync_model: Vec<u8> = (0..size).map(initial).collect();
        let mut sq = new_queue(&sync, depth).unwrap();
        let sync_log = random_mix(sq.as_mut(), &mut sync_model, lbs, align, seed, ops);
        assert_eq!(log, sync_log, "depth {depth}");
        assert!(model == sync_model);

        // A caller that never waits in the kernel still gets every
        // completion: reap(0) asks the ring for what it deferred.
        for k in 0..depth as u64 {
            let offset = k * lbs as u64;
            let write = DeviceRequest::Write {
                offset,
                buf: buf(lbs, 0xa0 ^ k as u8),
                mode: WriteMode::Normal,
            };
            q.push(k, write).unwrap();
        }
        q.submit().unwrap();
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while done.len() < depth {
            q.reap(0, &mut done).unwrap();
            assert!(
                std::time::Instant::now() < deadline,
                "depth {depth}: {} of {depth} completions after 20 s of reap(0)",
                done.len()
            );
            std::thread::yield_now();
        }
        assert!(done.iter().all(|c| matches!(c.result, Ok(n) if n == lbs)));
        drop(q);
        drop(uring);
        let bytes = std::fs::read(img.path()).unwrap();
        for k in 0..depth {
            assert!(bytes[k * lbs..(k + 1) * lbs]
                .iter()
                .all(|&b| b == 0xa0 ^ k as u8));
        }
    }
}

/// A thread queue's completions belong to its thread: moved to another
/// thread with a write in flight, it cannot reap there (the kernel refuses:
/// `DEFER_TASKRUN` runs a ring's completions only in its thread), the call
/// fails instead of hanging, and dropping it there returns.
#[test]
fn a_thread_queue_reaps_only_in_its_own_thread() {
    if !kernel_defers_completions() {
        eprintln!("skipped: this kernel has no IORING_SETUP_DEFER_TASKRUN (Linux 6.1)");
        return;
    }
    let img = image(IMAGE_BYTES, initial);
    let uring = uring_device(img.path(), UringOptions::default());
    let lbs = uring.caps().logical_block_size as usize;
    let mut q = uring.new_thread_queue(4).unwrap();
    assert!(q.defers_completions());
    let write = DeviceRequest::Write {
        offset: 0,
        buf: buf(lbs, 0x11),
        mode: WriteMode::Normal,
    };
    q.push(1, write).unwrap();
    q.submit().unwrap();
    let elsewhere = std::thread::spawn(move || {
        let mut done = Vec::new();
        let result = q.reap(1, &mut done);
        drop(q);
        (result, done.len())
    });
    let (result, reaped) = elsewhere.join().expect("the other thread panicked");
    assert!(
        matches!(result, Err(DeviceError::Unusable { .. })),
        "{result:?}, {reaped} reaped"
    );
}

/// Each thread makes its own queue (its own ring) on one shared device.
#[test]
fn one_queue_per_thread_on_a_shared_device() {
    for subject in subjects() {
        let name = &subject.name;
        let dev = &subject.dev;
        let lbs = dev.caps().logical_block_size as usize;
        let size = dev.caps().size_bytes as usize;
        let threads = 4;
        let slice = size / threads;
        std::thread::scope(|s| {
            for t in 0..threads {
                let dev = Arc::clone(dev);
                s.spawn(move || {
                    let mut q = new_queue(&dev, 32).unwrap();
                    let base = (t * slice) as u64;
                    for i in 0..slice / lbs {
                        let offset = base + (i * lbs) as u64;
                        let fill = (t * 31 + i) as u8;
                        if q.in_flight() == q.depth() {
                            q.submit().unwrap();
                            let mut out = Vec::new();
                            q.reap(1, &mut out).unwrap();
                            for c in out {
                                c.result.unwrap();
                            }
                        }
                        q.push(
                            offset,
                            DeviceRequest::Write {
                                offset,
                                buf: buf(lbs, fill),
                                mode: WriteMode::Normal,
                            },
                        )
                        .unwrap();
                    }
                    for c in reap_all(q.as_mut()) {
                        c.result.unwrap();
                    }
                });
            }
        });
        let on_disk = (subject.contents)();
        for t in 0..threads {
            for i in 0..slice / lbs {
                let at = t * slice + i * lbs;
                assert!(
                    on_disk[at..at + lbs]
                        .iter()
                        .all(|&b| b == (t * 31 + i) as u8),
                    "{name}: thread {t} block {i}"
                );
            }
        }
    }
}

/// SQPOLL: a kernel thread takes submissions; same results.
#[test]
fn sqpoll_ring_gives_the_same_results() {
    let img = image(IMAGE_BYTES, initial);
    let opts = UringOptions {
        iopoll: false,
        sqpoll_idle_ms: Some(20),
    };
    let dev = match UringDevice::open(img.path(), SyncOpenOptions::default(), opts) {
        Ok(dev) => Arc::new(dev) as Arc<dyn BlockDevice>,
        // Unprivileged SQPOLL needs Linux 5.11+; say so rather than fail.
        Err(e) => return eprintln!("skipping: SQPOLL unavailable: {e}"),
    };
    let lbs = dev.caps().logical_block_size as usize;
    let size = dev.caps().size_bytes as usize;
    let mut model: Vec<u8> = (0..size).map(initial).collect();
    let mut q = new_queue(&dev, 32).unwrap();
    random_mix(q.as_mut(), &mut model, lbs, 4096, 77, 1000);
    drop(q);
    drop(dev);
    assert!(std::fs::read(img.path()).unwrap()[..size] == model[..]);
}

/// IOPOLL on a device without poll queues (an image file): reads and writes
/// complete with the kernel's error, flushes still work (they run as
/// fdatasync), and nothing hangs.
#[test]
fn iopoll_ring_reports_unsupported_io_as_completions() {
    let img = image(IMAGE_BYTES, initial);
    let opts = UringOptions {
        iopoll: true,
        sqpoll_idle_ms: None,
    };
    let sync = Arc::new(SyncDevice::open(img.path(), SyncOpenOptions::default()).unwrap());
    if !sync.caps().direct_io {
        return eprintln!("skipping: no O_DIRECT here, IOPOLL cannot apply");
    }
    // The availability check reads through the ring, which IOPOLL refuses
    // on a file without poll support: that is an honest "unusable".
    match UringDevice::from_sync(Arc::clone(&sync), opts) {
        Ok(dev) => {
            let dev: Arc<dyn BlockDevice> = Arc::new(dev);
            let mut q = new_queue(&dev, 4).unwrap();
            q.push(
                1,
                DeviceRequest::Read {
                    offset: 0,
                    buf: buf(4096, 0),
                },
            )
            .unwrap();
            q.push(2, DeviceRequest::Flush).unwrap();
            let out = reap_all(q.as_mut());
            assert_eq!(out.len(), 2);
            out[1].result.as_ref().unwrap();
            eprintln!("IOPOLL read on an image: {:?}", out[0].result);
        }
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("io_uring"), "{text}");
            eprintln!("IOPOLL refused as expected: {text}");
        }
    }
}

/// Big requests and misaligned buffer memory: bounced where direct I/O
/// needs it, correct either way.
#[test]
fn large_and_misaligned_buffers_round_trip() {
    let img = image(IMAGE_BYTES, initial);
    let dev = Arc::new(
        UringDevice::open(
            img.path(),
            SyncOpenOptions::default(),
            UringOptions::default(),
        )
        .unwrap(),
    );
    let as_dyn: Arc<dyn BlockDevice> = dev.clone();
    let len = 1 << 20;
    // Alignment 1: at this size the allocator returns mmap'd memory 16 bytes
    // into a page, misaligned for any direct-I/O alignment above 16.
    let mut data = AlignedBuf::new(len, 1).unwrap();
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let needs_bounce = |b: &AlignedBuf| {
        dev.caps().direct_io
            && !(b.as_ptr() as usize).is_multiple_of(dev.caps().memory_alignment as usize)
    };
    let mut bounces = u64::from(needs_bounce(&data));
    let expect = data.to_vec();
    let mut q = new_queue(&as_dyn, 4).unwrap();
    q.push(
        1,
        DeviceRequest::Write {
            offset: 0,
            buf: data,
            mode: WriteMode::Fua,
        },
    )
    .unwrap();
    let out = reap_all(q.as_mut());
    assert_eq!(*out[0].result.as_ref().unwrap(), len);
    let back = AlignedBuf::new(len, 1).unwrap();
    bounces += u64::from(needs_bounce(&back));
    q.push(
        2,
        DeviceRequest::Read {
            offset: 0,
            buf: back,
        },
    )
    .unwrap();
    let out = reap_all(q.as_mut());
    assert!(out[0].buf.as_ref().unwrap()[..] == expect[..]);
    assert_eq!(dev.sync_device().bounced_requests(), bounces);
    eprintln!("bounced {bounces} of 2 requests");
}

#[test]
fn open_device_on_an_image_file() {
    let img = image(IMAGE_BYTES, initial);
    let (dev, choice) = open_device(img.path(), false, Backend::Sync).unwrap();
    assert_eq!(choice.backend, Backend::Sync);
    assert_eq!(dev.backend_name(), "sync");
    assert_eq!(choice.reason, "sync: requested");
    drop(dev);

    let (dev, choice) = open_device(img.path(), false, Backend::Auto).unwrap();
    eprintln!("image file: {choice}");
    assert_ne!(choice.backend, Backend::Auto);
    assert_eq!(dev.backend_name(), choice.backend.as_str());
    // Regular files on ext4, xfs, btrfs and tmpfs all take NOWAIT, so where
    // io_uring works, Auto must pick it.
    if choice.backend == Backend::Sync {
        assert!(
            choice.reason.contains("io_uring"),
            "sync chosen for a reason other than io_uring: {choice}"
        );
    } else {
        assert_eq!(choice.reason, "io_uring: device accepts NOWAIT");
    }
    let works = choice.backend == Backend::Uring;
    drop(dev);

    match open_device(img.path(), true, Backend::Uring) {
        Ok((dev, choice)) => {
            assert!(works);
            assert_eq!(choice.backend, Backend::Uring);
            assert_eq!(dev.backend_name(), "uring");
            assert!(choice.reason.starts_with("io_uring: requested"), "{choice}");
        }
        Err(e) => {
            assert!(!works);
            assert!(matches!(e, DeviceError::Unusable { .. }));
            assert!(e.to_string().contains("io_uring backend requested"), "{e}");
        }
    }
}

/// A request larger than the device takes whole goes as one submission
/// entry per piece, at most the device's limit each, and completes once,
/// with every byte where it belongs; 20 pieces are more than one request
/// may have in the kernel at once, so later ones start as earlier ones
/// finish.
#[test]
fn a_request_larger_than_the_device_takes_goes_in_pieces() {
    let img = image(IMAGE_BYTES, initial);
    let lbs = uring_device(img.path(), UringOptions::default())
        .caps()
        .logical_block_size as usize;
    let piece = 16 * lbs.max(1024);
    let dev = split_uring(img.path(), piece);
    assert_eq!(dev.request_limits().max_bytes, Some(piece));
    let mut q = dev.new_queue(2).unwrap();
    for (pieces, offset) in [(20, 3 * lbs), (6, 0)] {
        let len = pieces * piece;
        let mut data = buf(len, 0);
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i % 251) as u8 ^ pieces as u8;
        }
        let expect = data.to_vec();
        let before = q.submission_entries();
        q.push(
            1,
            DeviceRequest::Write {
                offset: offset as u64,
                buf: data,
                mode: WriteMode::Normal,
            },
        )
        .unwrap();
        let out = reap_all(&mut q);
        assert_eq!(out.len(), 1, "one completion for all the pieces");
        assert_eq!(*out[0].result.as_ref().unwrap(), len);
        assert_eq!(q.submission_entries() - before, pieces as u64);
        let file = std::fs::read(img.path()).unwrap();
        assert!(file[offset..offset + len] == expect[..], "{pieces} pieces");
        assert!(file[..offset]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == initial(i)));

        let before = q.submission_entries();
        q.push(
            2,
            DeviceRequest::Read {
                offset: offset as u64,
                buf: buf(len, 0xee),
            },
        )
        .unwrap();
        let out = reap_all(&mut q);
        assert_eq!(out.len(), 1);
        assert_eq!(*out[0].result.as_ref().unwrap(), len);
        assert_eq!(q.submission_entries() - before, pieces as u64);
        assert!(out[0].buf.as_ref().unwrap()[..] == expect[..]);
    }
    // Whole on a device without limits.
    let whole = uring_device(img.path(), UringOptions::default());
    assert_eq!(whole.request_limits(), RequestLimits::NONE, "image file");
    let mut q = whole.new_queue(2).unwrap();
    q.push(
        3,
        DeviceRequest::Read {
            offset: 0,
            buf: buf(20 * piece, 0),
        },
    )
    .unwrap();
    reap_all(&mut q)[0].result.as_ref().unwrap();
    assert_eq!(q.submission_entries(), 1);
}

/// Pieces that fail (here: past the end of an image that shrank) fail the
/// whole request, once, with the error of the first failed piece, naming
/// its device range; the pieces before it finished first, so their bytes
/// are in the buffer handed back.
#[test]
fn a_failed_piece_fails_the_whole_request() {
    let img = image(IMAGE_BYTES, initial);
    let piece = 64 << 10;
    let dev = split_uring(img.path(), piece);
    let mut q = dev.new_queue(4).unwrap();
    // Ends half way into the third piece.
    img.as_file()
        .set_len(2 * piece as u64 + piece as u64 / 2)
        .unwrap();
    q.push(
        9,
        DeviceRequest::Read {
            offset: 0,
            buf: buf(5 * piece, 0xee),
        },
    )
    .unwrap();
    let out = reap_all(&mut q);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].token, 9);
    match &out[0].result {
        Err(DeviceError::Short {
            op: IoOp::Read,
            offset,
            len,
            done,
        }) => assert_eq!(
            (*offset, *len, *done),
            (2 * piece as u64, piece as u64, piece as u64 / 2)
        ),
        other => panic!("{other:?}"),
    }
    let back = out[0].buf.as_ref().unwrap();
    assert_eq!(back.len(), 5 * piece);
    assert!(back[..2 * piece]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == initial(i)));
    assert_eq!(q.in_flight(), 0);
}
