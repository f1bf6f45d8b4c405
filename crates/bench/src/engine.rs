//! The measuring engine: drives a [`Target`] with a workload's I/O pattern
//! for a warm-up and then a fixed measured window.
//!
//! Queue depth N comes from one of two drivers, the same for every target of
//! a workload:
//! - [`Driver::Threads`] (sync backend): N threads, each with one
//!   synchronous I/O outstanding (fio's `psync` with `numjobs=N`);
//! - [`Driver::Queue`] (io_uring backend): one thread keeping N requests in
//!   flight in a [`TargetQueue`] (fio's `io_uring` with `iodepth=N`).
//!   Latency is from push to reap: completion latency as the caller sees it.
//!
//! Accounting: an I/O counts if it *started* inside the measured window.
//! Device counters are read just before the window opens and after every
//! thread has finished, so every request of a counted I/O is inside the
//! counter difference (counters can only over-count by the few warm-up I/Os
//! in flight when the window opens, never under-count). CPU time is taken
//! the same way, for the whole process (see `cpu`): from the window opening
//! until every thread has finished, so it too can only over-count by the
//! finishing of those few warm-up I/Os (at most the queue depth, against
//! the tens of thousands counted).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use blockdev::{AlignedBuf, RequestCounts};

use crate::cpu::{CpuPerIoTime, CpuTime};
use crate::histogram::Histogram;
use crate::interrupt::{sleep_unless_stopped, stop_requested};
use crate::target::{Done, Target, TargetQueue};
use crate::workload::{IoPattern, Op, Rng, Stream};
use crate::BenchError;

const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
const STOP: u8 = 2;

/// How queue depth is produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    /// N threads, one synchronous I/O each.
    Threads,
    /// One thread, N requests in flight in a queue.
    Queue,
}

/// How long to run.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub warmup: Duration,
    pub runtime: Duration,
}

/// What one target did in the measured window.
#[derive(Clone, Debug)]
pub struct Measurement {
    /// I/Os started in the window.
    pub ops: u64,
    pub bytes: u64,
    /// From the window opening until the last counted I/O finished.
    pub elapsed: Duration,
    /// Per-I/O latency (submission to completion), nanoseconds.
    pub latency: Histogram,
    /// Device requests issued during the window, when the target reports
    /// them.
    pub requests: Option<RequestCounts>,
    /// CPU time of the whole process over the window (every thread: see
    /// `cpu`); `None` if getrusage failed.
    pub cpu: Option<CpuTime>,
    /// CPU time of the I/O threads alone, each from its first I/O in the
    /// window to its last; `None` if getrusage failed in one.
    pub io_thread_cpu: Option<CpuTime>,
}

impl Measurement {
    /// One measurement of two windows on the same target (the raw device
    /// measured before and after iomapfs).
    pub fn merge(&mut self, other: &Measurement) {
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.elapsed += other.elapsed;
        self.latency.merge(&other.latency);
        self.requests = match (self.requests, other.requests) {
            (Some(a), Some(b)) => Some(RequestCounts {
                reads: a.reads + b.reads,
                writes: a.writes + b.writes,
                fua_writes: a.fua_writes + b.fua_writes,
                flushes: a.flushes + b.flushes,
                bytes_read: a.bytes_read + b.bytes_read,
                bytes_written: a.bytes_written + b.bytes_written,
            }),
            _ => None,
        };
        // Time and I/Os are summed, so per-I/O figures of the merge weigh
        // each window by its I/Os, as IOPS weighs them by time.
        let sum = |a: Option<CpuTime>, b: Option<CpuTime>| a.zip(b).map(|(a, b)| a + b);
        self.cpu = sum(self.cpu, other.cpu);
        self.io_thread_cpu = sum(self.io_thread_cpu, other.io_thread_cpu);
    }

    pub fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    pub fn bandwidth(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64()
    }

    /// Process CPU time per measured I/O.
    pub fn cpu_per_io(&self) -> Option<CpuPerIoTime> {
        self.cpu.and_then(|c| c.per_io(self.ops))
    }

    /// The I/O threads' CPU time per measured I/O.
    pub fn io_thread_cpu_per_io(&self) -> Option<CpuPerIoTime> {
        self.io_thread_cpu.and_then(|c| c.per_io(self.ops))
    }
}

#[derive(Default)]
struct Tally {
    ops: u64,
    bytes: u64,
    latency: Histogram,
    /// This thread's CPU time in the window (`None`: getrusage failed, or
    /// the thread ended on an error).
    cpu: Option<CpuTime>,
}

/// One I/O thread's share of the window: opened before the first I/O it
/// issues while measuring, closed when it stops.
#[derive(Default)]
struct ThreadWindow {
    start: Option<std::io::Result<CpuTime>>,
}

impl ThreadWindow {
    /// Takes the starting snapshot the first time it is called.
    fn open(&mut self) {
        if self.start.is_none() {
            self.start = Some(CpuTime::thread());
        }
    }

    /// CPU used since `open`: zero if the thread issued no I/O in the
    /// window (nothing of it counted), `None` if getrusage failed.
    fn close(&self) -> Option<CpuTime> {
        match &self.start {
            None => Some(CpuTime::default()),
            Some(Ok(start)) => CpuTime::thread().ok().map(|end| end.since(start)),
            Some(Err(_)) => None,
        }
    }
}

/// Runs `pattern` over `[0, span)` of `target`: `timing.warmup`, then
/// `timing.runtime` measured. Stops early with [`BenchError::Interrupted`]
/// on a stop request, or with the first I/O error any thread hit.
pub fn measure(
    target: &dyn Target,
    pattern: &IoPattern,
    span: u64,
    seed: u64,
    timing: Timing,
    driver: Driver,
) -> Result<Measurement, BenchError> {
    let phase = AtomicU8::new(WARMUP);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<BenchError>> = Mutex::new(None);
    let fail = |e: BenchError| {
        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
        failed.store(true, Ordering::SeqCst);
        phase.store(STOP, Ordering::SeqCst);
    };

    let (tallies, before, elapsed, cpu) = thread::scope(|scope| {
        let threads = match driver {
            Driver::Threads => pattern.queue_depth,
            Driver::Queue => 1,
        };
        let mut workers = Vec::with_capacity(threads);
        for index in 0..threads {
            let spawned = thread::Builder::new()
                .name(format!("bench-io-{index}"))
                .spawn_scoped(scope, {
                    let (phase, fail) = (&phase, &fail);
                    move || match driver {
                        Driver::Threads => worker(target, pattern, span, seed, index, phase, fail),
                        Driver::Queue => queue_worker(target, pattern, span, seed, phase, fail),
                    }
                });
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    fail(BenchError::io("spawn I/O thread", e));
                    break;
                }
            }
        }
        sleep_unless_stopped(timing.warmup, &failed);
        let before = target.requests();
        // The whole process, opened with the window and closed once every
        // I/O thread is joined: this takes in work the I/O threads hand to
        // other threads (iomapfs's completion worker, io_uring's io-wq),
        // which RUSAGE_THREAD of the I/O threads would miss. What else runs
        // meanwhile is this thread, asleep but for a 10 ms poll, and the
        // caller's progress display (the CLI's ticks every 200 ms).
        let cpu_before = CpuTime::process();
        let start = Instant::now();
        // Relaxed would do for the flag itself; SeqCst orders it after the
        // counter snapshot above, which the accounting relies on.
        let _ = phase.compare_exchange(WARMUP, MEASURE, Ordering::SeqCst, Ordering::SeqCst);
        sleep_unless_stopped(timing.runtime, &failed);
        phase.store(STOP, Ordering::SeqCst);
        let tallies: Vec<Tally> = workers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect();
        let cpu_after = CpuTime::process();
        let elapsed = start.elapsed();
        let cpu = cpu_before
            .ok()
            .zip(cpu_after.ok())
            .map(|(b, a)| a.since(&b));
        (tallies, before, elapsed, cpu)
    });

    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if stop_requested() {
        return Err(BenchError::Interrupted);
    }
    let after = target.requests();
    let mut total = Tally {
        cpu: Some(CpuTime::default()),
        ..Tally::default()
    };
    for t in &tallies {
        total.ops += t.ops;
        total.bytes += t.bytes;
        total.latency.merge(&t.latency);
        total.cpu = total.cpu.zip(t.cpu).map(|(a, b)| a + b);
    }
    Ok(Measurement {
        ops: total.ops,
        bytes: total.bytes,
        elapsed,
        latency: total.latency,
        requests: before.zip(after).map(|(b, a)| a.since(&b)),
        cpu,
        io_thread_cpu: total.cpu,
    })
}

fn worker(
    target: &dyn Target,
    pattern: &IoPattern,
    span: u64,
    seed: u64,
    index: usize,
    phase: &AtomicU8,
    fail: &dyn Fn(BenchError),
) -> Tally {
    let mut tally = Tally::default();
    let mut buf = match AlignedBuf::new(pattern.max_size as usize, target.memory_alignment()) {
        Ok(buf) => buf,
        Err(e) => {
            fail(BenchError::setup("I/O buffer", e.to_string()));
            return tally;
        }
    };
    Rng::new(seed.rotate_left(17) ^ index as u64).fill(&mut buf);
    let mut stream =
        Stream::new(pattern, span, seed, index).interleaved(index, pattern.queue_depth);
    let mut window = ThreadWindow::default();
    loop {
        let now_phase = phase.load(Ordering::Acquire);
        if now_phase == STOP {
            tally.cpu = window.close();
            return tally;
        }
        if now_phase == MEASURE {
            window.open();
        }
        let (offset, len) = stream.next_io();
        let io = &mut buf[..len as usize];
        let started = Instant::now();
        let result = match pattern.op {
            Op::Read => target.read_at(io, offset),
            Op::Write => target.write_at(io, offset),
        };
        let nanos = started.elapsed().as_nanos() as u64;
        if let Err(e) = result {
            fail(e);
            return tally;
        }
        if now_phase == MEASURE {
            tally.latency.record(nanos);
            tally.ops += 1;
            tally.bytes += len;
        }
    }
}

/// A request in flight in the queue driver.
#[derive(Clone, Copy)]
struct Flight {
    started: Instant,
    /// Phase when it was pushed: it counts only if pushed while measuring.
    phase: u8,
    len: u64,
}

/// Waits for everything still in flight (after an error), so buffers come
/// back before the queue is dropped. Errors here add nothing new.
fn drain(queue: &mut dyn TargetQueue, mut in_flight: usize) {
    let mut done = Vec::new();
    while in_flight > 0 {
        if queue.submit_and_reap(1, &mut done).is_err() {
            return;
        }
        in_flight = in_flight.saturating_sub(done.len());
        done.clear();
    }
}

/// The queue driver: one thread, `queue_depth` requests in flight.
fn queue_worker(
    target: &dyn Target,
    pattern: &IoPattern,
    span: u64,
    seed: u64,
    phase: &AtomicU8,
    fail: &dyn Fn(BenchError),
) -> Tally {
    let mut tally = Tally::default();
    let depth = pattern.queue_depth;
    let mut queue = match target.queue(depth) {
        Ok(q) => q,
        Err(e) => {
            fail(e);
            return tally;
        }
    };
    // Requests own their buffers and a buffer's length is the I/O size:
    // one pool per size, `depth` buffers each.
    let mut rng = Rng::new(seed.rotate_left(17));
    let mut pools: Vec<Vec<AlignedBuf>> = Vec::new();
    for class in 0..pattern.size_choices() {
        let len = (pattern.min_size + class * pattern.size_step) as usize;
        let mut pool = Vec::with_capacity(depth);
        for _ in 0..depth {
            match AlignedBuf::new(len, target.memory_alignment()) {
                Ok(mut buf) => {
                    rng.fill(&mut buf);
                    pool.push(buf);
                }
                Err(e) => {
                    fail(BenchError::setup("I/O buffer", e.to_string()));
                    return tally;
                }
            }
        }
        pools.push(pool);
    }
    let class_of = |len: u64| ((len - pattern.min_size) / pattern.size_step) as usize;
    let mut flights: Vec<Option<Flight>> = vec![None; depth];
    let mut free_slots: Vec<usize> = (0..depth).rev().collect();
    let mut stream = Stream::new(pattern, span, seed, 0);
    let mut done: Vec<Done> = Vec::with_capacity(depth);
    let mut in_flight = 0usize;
    let mut window = ThreadWindow::default();
    loop {
        let now_phase = phase.load(Ordering::Acquire);
        if now_phase == MEASURE {
            window.open();
        }
        if now_phase == STOP {
            if in_flight == 0 {
                tally.cpu = window.close();
                return tally;
            }
        } else {
            while let Some(slot) = free_slots.pop() {
                let (offset, len) = stream.next_io();
                let Some(buf) = pools[class_of(len)].pop() else {
                    fail(BenchError::failed("queue driver", "buffer pool empty"));
                    drain(&mut *queue, in_flight);
                    return tally;
                };
                flights[slot] = Some(Flight {
                    started: Instant::now(),
                    phase: now_phase,
                    len,
                });
                if let Err(e) = queue.push(pattern.op, slot as u64, offset, buf) {
                    fail(e);
                    drain(&mut *queue, in_flight);
                    return tally;
                }
                in_flight += 1;
            }
        }
        if let Err(e) = queue.submit_and_reap(1, &mut done) {
            fail(e);
            drain(&mut *queue, in_flight);
            return tally;
        }
        let reaped = Instant::now();
        for Done { token, buf, result } in done.drain(..) {
            let slot = token as usize;
            let Some(flight) = flights.get_mut(slot).and_then(Option::take) else {
                fail(BenchError::failed(
                    "queue driver",
                    format!("unknown token {token}"),
                ));
                drain(&mut *queue, in_flight);
                return tally;
            };
            in_flight -= 1;
            free_slots.push(slot);
            pools[class_of(flight.len)].push(buf);
            if let Err(e) = result {
                fail(e);
                drain(&mut *queue, in_flight);
                return tally;
            }
            if flight.phase == MEASURE {
                tally
                    .latency
                    .record((reaped - flight.started).as_nanos() as u64);
                tally.ops += 1;
                tally.bytes += flight.len;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{IomapfsTarget, RawTarget};
    use crate::workload::{seed_of, select, Kind};
    use blockdev::{BlockDevice, MemDevice};
    use std::sync::Arc;

    fn pattern(name: &str) -> IoPattern {
        match select(&[name.to_string()]).unwrap()[0].kind {
            Kind::Direct(p) => p,
            _ => unreachable!(),
        }
    }

    const TIMING: Timing = Timing {
        warmup: Duration::from_millis(20),
        runtime: Duration::from_millis(100),
    };

    fn cpu_ms(user: u64, system: u64) -> Option<CpuTime> {
        Some(CpuTime {
            user: Duration::from_millis(user),
            system: Duration::from_millis(system),
        })
    }

    fn window(ops: u64, ms: u64, lat: u64) -> Measurement {
        let mut latency = Histogram::new();
        for _ in 0..ops {
            latency.record(lat);
        }
        Measurement {
            ops,
            bytes: ops * 4096,
            elapsed: Duration::from_millis(ms),
            latency,
            requests: Some(RequestCounts {
                writes: ops,
                ..RequestCounts::default()
            }),
            cpu: cpu_ms(ms / 2, ms / 4),
            io_thread_cpu: cpu_ms(ms / 2, 0),
        }
    }

    #[test]
    fn merged_windows_weigh_by_time_not_by_window() {
        // 1000 ops in 1 s, then 3000 in 1 s: 4000 ops in 2 s.
        let mut m = window(1000, 1000, 10);
        m.merge(&window(3000, 1000, 20));
        assert_eq!(m.ops, 4000);
        assert!((m.iops() - 2000.0).abs() < 1e-9);
        assert_eq!(m.latency.count(), 4000);
        assert_eq!(m.requests.unwrap().writes, 4000);
        // Unequal windows: 1000 ops in 1 s and 1000 in 3 s is 500 IOPS.
        let mut m = window(1000, 1000, 10);
        m.merge(&window(1000, 3000, 10));
        assert!((m.iops() - 500.0).abs() < 1e-9);
        // A window without request counts makes the merge unknown.
        let mut m = window(1, 1, 1);
        m.merge(&Measurement {
            requests: None,
            ..window(1, 1, 1)
        });
        assert!(m.requests.is_none());
    }

    #[test]
    fn merged_windows_sum_cpu_and_ios() {
        // 1000 I/Os on 500 + 250 ms of CPU (750 µs each), then 3000 I/Os on
        // the same (250 µs each): 1500 ms over 4000 I/Os is 375 µs per
        // I/O, not the mean of the two windows' figures (500).
        let mut m = window(1000, 1000, 10);
        m.merge(&window(3000, 1000, 10));
        assert_eq!(m.cpu, cpu_ms(1000, 500));
        let per = m.cpu_per_io().unwrap();
        assert!((per.total_us() - 375.0).abs() < 1e-9, "{per:?}");
        assert!((per.user_us - 250.0).abs() < 1e-9, "{per:?}");
        assert!((per.system_us - 125.0).abs() < 1e-9, "{per:?}");
        assert_eq!(m.io_thread_cpu, cpu_ms(1000, 0));
        let io = m.io_thread_cpu_per_io().unwrap();
        assert!((io.total_us() - 250.0).abs() < 1e-9, "{io:?}");
        // A window whose CPU is unknown makes the merge unknown.
        let mut m = window(10, 10, 1);
        m.merge(&Measurement {
            cpu: None,
            ..window(10, 10, 1)
        });
        assert!(m.cpu.is_none() && m.cpu_per_io().is_none());
        assert!(m.io_thread_cpu.is_some());
    }

    #[test]
    fn raw_and_iomapfs_on_memory_count_consistently() {
        for (name, driver) in [
            ("randread-4k-qd32", Driver::Threads),
            ("dsync-overwrite-4k", Driver::Threads),
            ("overwrite-2k-unaligned", Driver::Threads),
            // MemDevice has no native queue: an InlineQueue drives it,
            // which still exercises the queue driver's bookkeeping.
            ("randread-4k-qd32", Driver::Queue),
            ("dsync-overwrite-4k", Driver::Queue),
            ("aio-overwrite-4k..16k-qd64", Driver::Queue),
        ] {
            let p = pattern(name);
            let span = 8 << 20;
            let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(64 << 20, 512));
            let raw = RawTarget::prepare(dev.clone(), &p, span).unwrap();
            let m = measure(&raw, &p, span, seed_of(name), TIMING, driver).unwrap();
            assert!(m.ops > 0 && m.latency.count() == m.ops, "{name} raw: {m:?}");
            // The memory device works in the I/O threads, so they used CPU,
            // and the process used at least about as much (one scheduler
            // tick per thread of slack at each snapshot).
            let (cpu, io) = (m.cpu.unwrap(), m.io_thread_cpu.unwrap());
            assert!(cpu.total() > Duration::ZERO && io.total() > Duration::ZERO);
            let slack = Duration::from_millis(10) * (p.queue_depth as u32 + 1);
            assert!(
                cpu.total() + slack >= io.total(),
                "{name}: {cpu:?} < {io:?}"
            );
            // And no more than every CPU for the whole window.
            let cpus = thread::available_parallelism().map_or(1, |n| n.get()) as u32;
            assert!(
                cpu.total() <= m.elapsed * cpus + slack,
                "{name}: {cpu:?} in {:?}",
                m.elapsed
            );
            let per_io = m.bytes as f64 / m.ops as f64;
            assert!(per_io >= p.min_size as f64 && per_io <= p.max_size as f64);
            let req = m.requests.unwrap();
            match p.op {
                Op::Read => assert!(req.reads >= m.ops),
                Op::Write => assert!(req.writes >= m.ops),
            }
            drop(raw);

            let fs = IomapfsTarget::prepare(dev.clone(), &p, span).unwrap();
            let m = measure(&fs, &p, span, seed_of(name), TIMING, driver).unwrap();
            assert!(m.ops > 0, "{name} iomapfs ({driver:?})");
            let req = m.requests.unwrap();
            if p.dsync {
                assert!(req.writes >= m.ops);
                assert!(
                    req.flushes + req.fua_writes >= m.ops,
                    "{req:?} for {}",
                    m.ops
                );
            }
            fs.close().unwrap();
        }
    }
}
