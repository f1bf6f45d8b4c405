//! The window of a buffered workload: one thread doing sequential I/O over
//! a file in passes, with untimed work before each pass and timed work
//! ending it, until the timed work adds up to the runtime.
//!
//! Only the passes make the window: elapsed time, CPU time (the whole
//! process and this thread) and device requests are summed over them, so
//! emptying a cache or making a fresh file between passes costs the
//! figures nothing, while an fsync ending a pass does. A pass cut short by
//! the end of the window is ended all the same (its fsync is timed), as
//! fio's `end_fsync` does. Latency is per read or write; what ends a pass
//! counts in the window's time but in no I/O's latency (fio reports its
//! fsyncs apart too).

use std::time::{Duration, Instant};

use blockdev::RequestCounts;

use crate::cpu::CpuTime;
use crate::engine::Measurement;
use crate::histogram::Histogram;
use crate::interrupt::stop_requested;
use crate::BenchError;

/// What a buffered window drives.
pub trait PassTarget {
    /// Untimed: brings the target to where a pass starts (an empty cache,
    /// a fresh file).
    fn before_pass(&mut self) -> Result<(), BenchError>;
    /// One read or write of `buf.len()` bytes at `offset`.
    fn io(&mut self, buf: &mut [u8], offset: u64) -> Result<(), BenchError>;
    /// Timed: what ends a pass (an fsync), also one cut short.
    fn end_pass(&mut self) -> Result<(), BenchError>;
    /// Device requests so far, when the target sees them.
    fn requests(&self) -> Option<RequestCounts>;
}

/// A window's figures.
#[derive(Debug)]
pub struct Window {
    pub measurement: Measurement,
    /// Passes started (each one also ended).
    pub passes: u64,
    /// The part of `measurement.elapsed` spent ending passes (fsyncs).
    pub end_pass_time: Duration,
    /// Bytes the device wrote while passes were ended, when the target
    /// sees its requests: with `end_pass_time`, the throughput of the
    /// writeback an fsync does, the copying into the cache left out.
    pub end_pass_bytes_written: Option<u64>,
}

/// What is read at both ends of a pass.
struct Mark {
    requests: Option<RequestCounts>,
    process: Option<CpuTime>,
    thread: Option<CpuTime>,
}

impl Mark {
    fn take(target: &dyn PassTarget) -> Mark {
        Mark {
            requests: target.requests(),
            process: CpuTime::process().ok(),
            thread: CpuTime::thread().ok(),
        }
    }
}

/// `total + (end - start)`, unknown if any part is.
fn add_cpu(
    total: Option<CpuTime>,
    start: Option<CpuTime>,
    end: Option<CpuTime>,
) -> Option<CpuTime> {
    total.zip(start.zip(end)).map(|(t, (s, e))| t + e.since(&s))
}

fn add_requests(
    total: Option<RequestCounts>,
    start: Option<RequestCounts>,
    end: Option<RequestCounts>,
) -> Option<RequestCounts> {
    total.zip(start.zip(end)).map(|(t, (s, e))| {
        let d = e.since(&s);
        RequestCounts {
            reads: t.reads + d.reads,
            writes: t.writes + d.writes,
            fua_writes: t.fua_writes + d.fua_writes,
            flushes: t.flushes + d.flushes,
            bytes_read: t.bytes_read + d.bytes_read,
            bytes_written: t.bytes_written + d.bytes_written,
        }
    })
}

/// Runs passes of `span / io_size` I/Os of `io_size` bytes at offsets 0,
/// `io_size`, ... until their timed parts add up to `duration`, and
/// returns what they did. `buf` is the caller's I/O buffer (at least
/// `io_size` bytes). Stops with [`BenchError::Interrupted`] on a stop
/// request, or with the target's first error.
pub fn run(
    target: &mut dyn PassTarget,
    io_size: u64,
    span: u64,
    duration: Duration,
    buf: &mut [u8],
) -> Result<Window, BenchError> {
    let len = usize::try_from(io_size)
        .ok()
        .filter(|len| *len > 0 && *len <= buf.len())
        .ok_or_else(|| {
            BenchError::failed(
                "buffered window",
                format!(
                    "I/O size {io_size} does not fit the {}-byte buffer",
                    buf.len()
                ),
            )
        })?;
    let ios = (span / io_size).max(1);
    let mut latency = Histogram::new();
    let (mut ops, mut passes) = (0u64, 0u64);
    let mut elapsed = Duration::ZERO;
    let mut requests = target.requests().map(|_| RequestCounts::default());
    let (mut cpu, mut io_thread_cpu) = (Some(CpuTime::default()), Some(CpuTime::default()));
    let mut end_pass_time = Duration::ZERO;
    let mut end_pass_bytes_written = target.requests().map(|_| 0u64);
    while elapsed < duration {
        if stop_requested() {
            return Err(BenchError::Interrupted);
        }
        target.before_pass()?;
        let open = Mark::take(target);
        let started = Instant::now();
        let left = duration - elapsed;
        passes += 1;
        // One clock read per I/O: an I/O's end is the next one's issue (the
        // latency record between them is a few ns). Two reads cost a 4 KiB
        // cache hit about 15% more; fio times with the TSC, at half a
        // clock read's price.
        let mut issued = started;
        for i in 0..ios {
            target.io(&mut buf[..len], i * io_size)?;
            let done = Instant::now();
            latency.record((done - issued).as_nanos() as u64);
            issued = done;
            ops += 1;
            if done - started >= left || stop_requested() {
                break;
            }
        }
        let before_end = target.requests();
        let ending = Instant::now();
        target.end_pass()?;
        end_pass_time += ending.elapsed();
        end_pass_bytes_written = end_pass_bytes_written
            .zip(before_end.zip(target.requests()))
            .map(|(total, (a, b))| total + b.since(&a).bytes_written);
        elapsed += started.elapsed();
        let close = Mark::take(target);
        cpu = add_cpu(cpu, open.process, close.process);
        io_thread_cpu = add_cpu(io_thread_cpu, open.thread, close.thread);
        requests = add_requests(requests, open.requests, close.requests);
    }
    if stop_requested() {
        return Err(BenchError::Interrupted);
    }
    Ok(Window {
        measurement: Measurement {
            ops,
            bytes: ops * io_size,
            elapsed,
            latency,
            requests,
            cpu,
            io_thread_cpu,
        },
        passes,
        end_pass_time,
        end_pass_bytes_written,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what the window asked of it; `before_pass` and `end_pass`
    /// sleep for the given time.
    #[derive(Default)]
    struct Fake {
        before: Duration,
        end: Duration,
        log: Vec<String>,
        reads: u64,
        flushes: u64,
        written: u64,
    }

    impl PassTarget for Fake {
        fn before_pass(&mut self) -> Result<(), BenchError> {
            std::thread::sleep(self.before);
            self.log.push("before".into());
            Ok(())
        }
        fn io(&mut self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
            self.reads += 1;
            self.log.push(format!("io {offset}+{}", buf.len()));
            Ok(())
        }
        fn end_pass(&mut self) -> Result<(), BenchError> {
            std::thread::sleep(self.end);
            self.flushes += 1;
            self.written += 4096;
            self.log.push("end".into());
            Ok(())
        }
        fn requests(&self) -> Option<RequestCounts> {
            Some(RequestCounts {
                reads: self.reads,
                flushes: self.flushes,
                bytes_written: self.written,
                ..RequestCounts::default()
            })
        }
    }

    /// The log split into passes, each from its "before" to its "end".
    fn passes_of(log: &[String]) -> Vec<Vec<String>> {
        let mut passes: Vec<Vec<String>> = Vec::new();
        for entry in log {
            if entry == "before" {
                passes.push(Vec::new());
            }
            passes
                .last_mut()
                .expect("an I/O before any pass")
                .push(entry.clone());
        }
        passes
    }

    #[test]
    fn passes_walk_the_file_from_its_start_and_each_is_ended() {
        // Two I/Os a pass, each instant: many passes in 5 ms.
        let mut t = Fake::default();
        let mut buf = vec![0u8; 8192];
        let w = run(&mut t, 4096, 2 * 4096, Duration::from_millis(5), &mut buf).unwrap();
        let passes = passes_of(&t.log);
        assert!(passes.len() > 2, "{passes:?}");
        assert_eq!(w.passes, passes.len() as u64);
        let (last, whole) = passes.split_last().unwrap();
        for p in whole {
            assert_eq!(p, &["before", "io 0+4096", "io 4096+4096", "end"]);
        }
        assert!(
            last == &["before", "io 0+4096", "end"]
                || last == &["before", "io 0+4096", "io 4096+4096", "end"],
            "{last:?}"
        );
        let m = &w.measurement;
        assert_eq!(m.ops, t.reads);
        assert_eq!(m.bytes, m.ops * 4096);
        assert_eq!(m.latency.count(), m.ops);
        // The device counted what happened inside the passes.
        let req = m.requests.unwrap();
        assert_eq!((req.reads, req.flushes), (m.ops, w.passes));
        assert!(m.elapsed >= Duration::from_millis(5), "{:?}", m.elapsed);
    }

    #[test]
    fn a_pass_cut_by_the_end_of_the_window_is_ended() {
        // A window shorter than one I/O: the first pass is cut after its
        // first I/O, and still ended.
        let mut t = Fake::default();
        let mut buf = vec![0u8; 4096];
        let w = run(&mut t, 4096, 16 * 4096, Duration::from_nanos(1), &mut buf).unwrap();
        assert_eq!(t.log, ["before", "io 0+4096", "end"]);
        assert_eq!((w.passes, w.measurement.ops), (1, 1));
    }

    #[test]
    fn work_before_a_pass_is_untimed_and_work_ending_it_is_timed() {
        // One I/O per pass; 30 ms before each pass, 25 ms ending each.
        let mut t = Fake {
            before: Duration::from_millis(30),
            end: Duration::from_millis(25),
            ..Fake::default()
        };
        let mut buf = vec![0u8; 512];
        let wall = Instant::now();
        let w = run(&mut t, 512, 512, Duration::from_millis(40), &mut buf).unwrap();
        let wall = wall.elapsed();
        let m = &w.measurement;
        let each = |ms: u64| Duration::from_millis(ms) * w.passes as u32;
        // The endings are in the window, the befores are not (the wall
        // clock saw both).
        assert!(
            m.elapsed >= each(25),
            "{:?} for {} passes",
            m.elapsed,
            w.passes
        );
        assert!(
            m.elapsed < each(25) + Duration::from_millis(25),
            "{:?}",
            m.elapsed
        );
        assert!(wall >= m.elapsed + each(30), "{wall:?} vs {:?}", m.elapsed);
        // The endings alone: their time, and what the device wrote in them.
        assert!(w.end_pass_time >= each(25), "{:?}", w.end_pass_time);
        assert!(w.end_pass_time <= m.elapsed, "{:?}", w.end_pass_time);
        assert_eq!(w.end_pass_bytes_written, Some(4096 * w.passes));
        // Sleeping uses no CPU: this thread's time in the window is far
        // below the window.
        let cpu = m.io_thread_cpu.unwrap();
        assert!(cpu.total() < Duration::from_millis(20), "{cpu:?}");
    }

    #[test]
    fn an_io_size_larger_than_the_buffer_is_refused() {
        let mut t = Fake::default();
        let mut buf = vec![0u8; 512];
        let err = run(&mut t, 4096, 4096, Duration::from_millis(1), &mut buf).unwrap_err();
        assert!(err.to_string().contains("4096"), "{err}");
        assert!(t.log.is_empty());
    }
}
