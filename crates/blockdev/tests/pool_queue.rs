//! The worker-pool queue ([`PoolDevice`], [`WorkerPool`]): its requests
//! really run at the same time, on a fixed set of threads shared by every
//! queue, and a queue dropped with requests in flight returns only once
//! they are done. The contract tests it shares with the other queues are
//! in `queues.rs`.
//!
//! A [`MemDevice`] pause is the gate: it holds a request inside the
//! device, in the worker running it, until the test lets it go.

use std::num::NonZeroUsize;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use blockdev::error::IoOp;
use blockdev::{
    AlignedBuf, BlockDevice, DeviceCaps, DeviceCompletion, DeviceCounters, DeviceError,
    DeviceQueue, DeviceRequest, FaultOp, FaultRule, MemDevice, PausedRequest, PoolDevice,
    PoolOptions, WorkerPool, WriteMode,
};

const LBS: usize = 512;
const BLOCKS: usize = 64;
/// Longest a test waits for something that must happen before calling it
/// a hang (a failure, never a way to synchronise).
const WATCHDOG: Duration = Duration::from_secs(20);

fn memory() -> Arc<MemDevice> {
    Arc::new(MemDevice::new((BLOCKS * LBS) as u64, LBS as u32))
}

fn pool_device(mem: &Arc<MemDevice>, workers: usize) -> Arc<PoolDevice> {
    let opts = PoolOptions {
        workers: NonZeroUsize::new(workers),
    };
    Arc::new(PoolDevice::new(mem.clone(), opts))
}

fn queue(dev: &Arc<PoolDevice>, depth: usize) -> Box<dyn DeviceQueue> {
    let dev: Arc<dyn BlockDevice> = dev.clone();
    blockdev::new_queue(&dev, depth).unwrap()
}

fn write(block: usize, fill: u8) -> DeviceRequest {
    let mut buf = AlignedBuf::new(LBS, LBS).unwrap();
    buf.fill(fill);
    DeviceRequest::Write {
        offset: (block * LBS) as u64,
        buf,
        mode: WriteMode::Normal,
    }
}

/// A pause on the write to `block`, before it reaches the device.
fn hold_write(mem: &MemDevice, block: usize) -> PausedRequest {
    let at = (block * LBS) as u64;
    mem.pause_before(FaultRule::new(FaultOp::Write).range(at..at + LBS as u64))
}

/// Waits until every one of `pauses` holds its request, all at the same
/// time, or fails after [`WATCHDOG`]; gives them back in the same order.
fn wait_all_held(pauses: Vec<PausedRequest>) -> Vec<PausedRequest> {
    let total = pauses.len();
    let (tx, rx) = mpsc::channel();
    for (i, p) in pauses.into_iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            p.wait_reached();
            // If the test gave up, dropping `p` lets the request go.
            let _ = tx.send((i, p));
        });
    }
    let mut held: Vec<(usize, PausedRequest)> = Vec::new();
    while held.len() < total {
        match rx.recv_timeout(WATCHDOG) {
            Ok(p) => held.push(p),
            Err(_) => {
                let n = held.len();
                // Let the held ones go, so the queue's drop can finish.
                for (_, p) in held {
                    p.resume();
                }
                panic!("only {n} of {total} requests ever reached the device at once");
            }
        }
    }
    held.sort_by_key(|(i, _)| *i);
    held.into_iter().map(|(_, p)| p).collect()
}

fn block_of(mem: &MemDevice, block: usize) -> u8 {
    let all = mem.snapshot();
    let b = &all[block * LBS..(block + 1) * LBS];
    assert!(b.iter().all(|&x| x == b[0]), "block {block} torn");
    b[0]
}

/// How many of this process's threads have a name starting with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with(prefix))
        .count()
}

/// Waits until exactly `n` threads are named `prefix…`: a new thread
/// names itself once it runs, and a joined one leaves the task list a
/// moment after its join returns.
fn wait_threads_named(prefix: &str, n: usize) {
    let started = Instant::now();
    while threads_named(prefix) != n {
        assert!(
            started.elapsed() < WATCHDOG,
            "{} threads named {prefix}…, not {n}",
            threads_named(prefix)
        );
        std::thread::yield_now();
    }
}

/// Two workers hold two requests in the device at once: the second is
/// taken while the first is still inside the device. (An inline queue, or
/// a pool running one request at a time, never gets the second there.)
#[test]
fn two_requests_are_in_the_device_at_once() {
    let mem = memory();
    let dev = pool_device(&mem, 2);
    assert_eq!(dev.workers(), 2);
    let mut q = queue(&dev, 8);
    let pauses = vec![hold_write(&mem, 3), hold_write(&mem, 9)];
    q.push(1, write(3, 0x31)).unwrap();
    q.push(2, write(9, 0x32)).unwrap();
    assert_eq!(q.submit().unwrap(), 2);
    let [first, second]: [PausedRequest; 2] = wait_all_held(pauses).try_into().ok().unwrap();
    // Both are inside the device: neither has completed.
    let mut out = Vec::new();
    assert_eq!(q.reap(0, &mut out).unwrap(), 0);
    assert_eq!(q.in_flight(), 2);
    second.resume();
    assert_eq!(q.reap(1, &mut out).unwrap(), 1);
    assert_eq!(out[0].token, 2, "the one let go completes first");
    first.resume();
    q.reap(1, &mut out).unwrap();
    assert_eq!(out.len(), 2);
    for c in &out {
        assert_eq!(*c.result.as_ref().unwrap(), LBS);
    }
    assert_eq!((block_of(&mem, 3), block_of(&mem, 9)), (0x31, 0x32));
}

/// `workers` threads run the requests of every queue on the device, all
/// at once: as many as there are workers are in the device together, and
/// no more threads ever exist, however many queues there are.
#[test]
fn queues_share_a_fixed_set_of_named_workers() {
    const NAME: &str = "pooltest-share";
    let mem = memory();
    let inner: Arc<dyn BlockDevice> = mem.clone();
    let workers = 3;
    let pool = Arc::new(WorkerPool::new(inner, NonZeroUsize::new(workers).unwrap(), NAME).unwrap());
    assert_eq!(pool.workers(), workers);
    wait_threads_named(NAME, workers);
    let mut queues: Vec<_> = (0..8).map(|_| pool.queue(16)).collect();
    let held: Vec<PausedRequest> = (0..workers).map(|i| hold_write(&mem, i)).collect();
    // One request in each of three queues: all three in the device at once.
    for (i, q) in queues.iter_mut().take(workers).enumerate() {
        q.push(i as u64, write(i, i as u8 + 1)).unwrap();
        q.submit().unwrap();
    }
    let held = wait_all_held(held);
    // Many more requests from every queue while the workers are busy.
    for (i, q) in queues.iter_mut().enumerate() {
        for j in 0..4 {
            let block = 8 + i * 4 + j;
            q.push(block as u64, write(block, block as u8)).unwrap();
        }
        q.submit().unwrap();
    }
    assert_eq!(threads_named(NAME), workers, "threads grew with queues");
    for p in &held {
        p.resume();
    }
    for q in &mut queues {
        let mut out = Vec::new();
        while q.in_flight() > 0 {
            q.reap(q.in_flight(), &mut out).unwrap();
        }
        for c in out {
            c.result.unwrap();
        }
    }
    for block in (0..workers).chain(8..40) {
        let want = if block < workers { block + 1 } else { block };
        assert_eq!(block_of(&mem, block), want as u8, "block {block}");
    }
    assert_eq!(threads_named(NAME), workers);
    drop(queues);
    drop(pool);
    // Stopped with the pool.
    wait_threads_named(NAME, 0);
}

/// A dropped queue waits for its requests in a worker: the drop is still
/// waiting (asleep, in a futex) while one is held in the device, returns
/// once it is let go, and by then every request it had, pushed ones
/// included, is on the device.
#[test]
fn dropping_a_queue_waits_for_the_requests_its_workers_hold() {
    let mem = memory();
    let dev = pool_device(&mem, 2);
    let mut q = queue(&dev, 8);
    let held = hold_write(&mem, 5);
    q.push(1, write(5, 0x55)).unwrap();
    q.push(2, write(6, 0x66)).unwrap();
    q.submit().unwrap();
    // Only pushed: the drop sends it too.
    q.push(3, write(7, 0x77)).unwrap();
    held.wait_reached();
    let (tid_tx, tid_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let dropper = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }).unwrap();
        drop(q);
        done_tx.send(()).unwrap();
    });
    let tid = tid_rx.recv().unwrap();
    let started = Instant::now();
    let futex = format!("{} ", libc::SYS_futex);
    loop {
        assert!(
            done_rx.try_recv().is_err(),
            "the drop returned while a worker held one of its requests"
        );
        let syscall =
            std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).unwrap_or_default();
        if syscall.starts_with(&futex) && done_rx.try_recv().is_err() {
            break;
        }
        assert!(started.elapsed() < WATCHDOG, "the drop never waited");
        std::thread::yield_now();
    }
    assert_eq!(block_of(&mem, 5), 0, "the held write is not on the device");
    held.resume();
    done_rx
        .recv_timeout(WATCHDOG)
        .expect("the drop never returned after the request was let go");
    dropper.join().unwrap();
    let blocks = [5, 6, 7].map(|b| block_of(&mem, b));
    assert_eq!(blocks, [0x55, 0x66, 0x77]);
}

/// Reaping: `reap(0)` never waits, `reap(n)` waits for `n` (capped at what
/// is in flight) and submits first, while requests held in the device
/// stay in flight.
#[test]
fn reap_waits_for_min_and_never_for_what_cannot_come() {
    let mem = memory();
    let dev = pool_device(&mem, 2);
    let mut q = queue(&dev, 8);
    let mut out: Vec<DeviceCompletion> = Vec::new();
    assert_eq!(q.reap(5, &mut out).unwrap(), 0, "nothing in flight");
    let held = hold_write(&mem, 0);
    q.push(1, write(0, 1)).unwrap();
    q.submit().unwrap();
    // A worker holds it (a waiting reap could run it itself).
    held.wait_reached();
    q.push(2, write(1, 2)).unwrap();
    q.push(3, write(2, 3)).unwrap();
    // Not submitted, not waiting: nothing more runs.
    assert_eq!(q.reap(0, &mut out).unwrap(), 0);
    assert_eq!(mem.counters().snapshot().writes, 0);
    // Waiting for two submits first; the held one cannot be among them.
    assert_eq!(q.reap(2, &mut out).unwrap(), 2);
    let mut tokens: Vec<_> = out.iter().map(|c| c.token).collect();
    tokens.sort();
    assert_eq!(tokens, [2, 3]);
    assert_eq!(q.reap(0, &mut out).unwrap(), 0, "reap(0) does not wait");
    assert_eq!(q.in_flight(), 1);
    held.resume();
    assert_eq!(q.reap(100, &mut out).unwrap(), 1, "capped at in flight");
    assert_eq!(q.in_flight(), 0);
}

/// A device that panics on any write, for the panic test.
struct PanickingDevice {
    inner: MemDevice,
}

impl BlockDevice for PanickingDevice {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, _: &[u8], offset: u64, _: WriteMode) -> Result<(), DeviceError> {
        panic!("test device: write at {offset}");
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }
}

/// A device that panics fails that request, in a completion naming it,
/// and the worker goes on: a later request on the same (only) worker runs.
#[test]
fn a_panic_in_the_device_fails_the_request_not_the_pool() {
    let inner: Arc<dyn BlockDevice> = Arc::new(PanickingDevice {
        inner: MemDevice::new((BLOCKS * LBS) as u64, LBS as u32),
    });
    let dev = Arc::new(PoolDevice::new(
        inner,
        PoolOptions {
            workers: NonZeroUsize::new(1),
        },
    ));
    let mut q = queue(&dev, 4);
    q.push(1, write(4, 1)).unwrap();
    q.push(
        2,
        DeviceRequest::Read {
            offset: 0,
            buf: AlignedBuf::new(LBS, LBS).unwrap(),
        },
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    let reaper = std::thread::spawn(move || {
        let mut out = Vec::new();
        while q.in_flight() > 0 {
            q.reap(q.in_flight(), &mut out).unwrap();
        }
        tx.send(out).unwrap();
    });
    let mut out = rx
        .recv_timeout(WATCHDOG)
        .expect("a request never completed after the device panicked");
    reaper.join().unwrap();
    out.sort_by_key(|c| c.token);
    let err = out[0].result.as_ref().unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::Io {
                op: IoOp::Write,
                offset: 2048,
                len: 512,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("panicked"), "{err}");
    assert_eq!(*out[1].result.as_ref().unwrap(), LBS);
}

/// A reap that has to wait runs its queue's requests no worker took yet
/// itself: with the only worker held in the device, a second request
/// still completes, on the reaping thread.
#[test]
fn a_waiting_reap_runs_requests_no_worker_has_taken() {
    let mem = memory();
    let dev = pool_device(&mem, 1);
    let mut q = queue(&dev, 4);
    let held = hold_write(&mem, 0);
    q.push(1, write(0, 1)).unwrap();
    q.submit().unwrap();
    held.wait_reached();
    q.push(2, write(1, 2)).unwrap();
    let (tx, rx) = mpsc::channel();
    let reaper = std::thread::spawn(move || {
        let mut out = Vec::new();
        let n = q.reap(1, &mut out).unwrap();
        tx.send((n, out)).unwrap();
        q
    });
    // The one worker is held: only the reaping thread can have run it.
    let got = rx.recv_timeout(WATCHDOG);
    held.resume();
    let (n, out) = got.expect("the reap waited for the held worker");
    assert_eq!((n, out[0].token), (1, 2));
    assert_eq!(*out[0].result.as_ref().unwrap(), LBS);
    assert_eq!(block_of(&mem, 1), 2);
    drop(reaper.join().unwrap());
    assert_eq!(block_of(&mem, 0), 1);
}
