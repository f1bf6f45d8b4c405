//! CPU time, from getrusage(2), and its arithmetic per I/O.
//!
//! What a measured window is charged with (see `engine::measure`):
//! - the whole process (`RUSAGE_SELF`) from the moment the window opens
//!   until every I/O thread has been joined. That covers the I/O threads,
//!   iomapfs's own threads (the asynchronous queue's completion worker,
//!   flush helpers) and io_uring's io-wq workers, which since Linux 5.12
//!   are threads of the submitting process (`PF_IO_WORKER`, created with
//!   `CLONE_THREAD`) and so are summed into `RUSAGE_SELF`. Checked on
//!   6.18 by forcing io_uring onto zram, which punts every request to an
//!   `iou-wrk-*` thread: the process figure was 4.5 µs per I/O against
//!   1.9 µs for the submitting thread, matching the worker's own schedstat.
//!   It also covers the bench's main thread (asleep, waking every 10 ms)
//!   and the CLI's progress ticker (every 200 ms): on the sync backend the
//!   process and the I/O threads differ by under 1 %.
//! - separately, the I/O threads alone (`RUSAGE_THREAD` of each, from the
//!   first I/O it issues in the window to its last), to show how much of
//!   the process figure ran elsewhere.
//!
//! Neither includes kernel work outside the process: the loop driver's
//! workers, which do a loop device's reads and writes of its backing file,
//! and block completions run in softirq threads or kblockd. On the loop
//! device that is about as much CPU again as the bench process (measured
//! on 6.18 from those kernel threads' schedstat over a run); zram does its
//! work in the submitting thread, so there it is counted.
//!
//! Precision: user + system together are the scheduler's exact runtime
//! (nanoseconds, reported in microseconds), except that a thread running on
//! another CPU when the snapshot is taken has up to one scheduler tick not
//! yet added; the split between user and system is sampled at ticks and
//! scaled to that total, so it is coarser.

use std::io;
use std::ops::Add;
use std::time::Duration;

/// User and system CPU time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTime {
    pub user: Duration,
    pub system: Duration,
}

impl CpuTime {
    /// Every thread of this process so far, live or exited (`RUSAGE_SELF`).
    pub fn process() -> io::Result<CpuTime> {
        rusage(libc::RUSAGE_SELF)
    }

    /// The calling thread so far (`RUSAGE_THREAD`).
    pub fn thread() -> io::Result<CpuTime> {
        rusage(libc::RUSAGE_THREAD)
    }

    // Reports work per I/O (`per_io`); the sum is for tests' checks.
    #[cfg(test)]
    pub fn total(&self) -> Duration {
        self.user + self.system
    }

    /// What was used between `earlier` and `self` (zero rather than negative
    /// if the snapshots came in the wrong order).
    pub fn since(&self, earlier: &CpuTime) -> CpuTime {
        CpuTime {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }

    /// Microseconds per I/O, `None` without I/O.
    pub fn per_io(&self, ops: u64) -> Option<CpuPerIoTime> {
        if ops == 0 {
            return None;
        }
        let us = |d: Duration| d.as_secs_f64() * 1e6 / ops as f64;
        Some(CpuPerIoTime {
            user_us: us(self.user),
            system_us: us(self.system),
        })
    }
}

impl Add for CpuTime {
    type Output = CpuTime;

    fn add(self, other: CpuTime) -> CpuTime {
        CpuTime {
            user: self.user + other.user,
            system: self.system + other.system,
        }
    }
}

/// CPU microseconds per I/O.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuPerIoTime {
    pub user_us: f64,
    pub system_us: f64,
}

impl CpuPerIoTime {
    pub fn total_us(&self) -> f64 {
        self.user_us + self.system_us
    }
}

/// CPU per I/O from fio's job figures: `usr_cpu` and `sys_cpu` are percent
/// of `job_runtime` (milliseconds, summed over the jobs), and `total_ios`
/// is every I/O of every job, all after `ramp_time` (fio resets the CPU
/// and I/O counters when the ramp ends).
pub fn fio_per_io(
    usr_cpu_pct: f64,
    sys_cpu_pct: f64,
    job_runtime_ms: f64,
    total_ios: u64,
) -> Option<CpuPerIoTime> {
    if total_ios == 0 || job_runtime_ms.is_nan() || job_runtime_ms <= 0.0 {
        return None;
    }
    // percent of ms -> µs: /100 * 1000.
    let us = |pct: f64| pct * job_runtime_ms * 10.0 / total_ios as f64;
    Some(CpuPerIoTime {
        user_us: us(usr_cpu_pct),
        system_us: us(sys_cpu_pct),
    })
}

/// Reaps `child` if it has exited, with the CPU time of all its threads
/// (wait4(2)'s rusage: a child's whole process, which getrusage of our own
/// process cannot see until it is reaped). `None` while it runs. After
/// `Some`, `child` is reaped: do not wait for or kill it again.
pub fn try_wait_with_cpu(
    child: &std::process::Child,
) -> io::Result<Option<(std::process::ExitStatus, CpuTime)>> {
    use std::os::unix::process::ExitStatusExt;
    let pid = libc::pid_t::try_from(child.id())
        .map_err(|_| io::Error::other(format!("pid {} out of range", child.id())))?;
    let mut status = 0;
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `status` and `ru` are writable and owned here; `pid` is our
    // own child, not yet reaped (std reaps only in wait/try_wait, which
    // the caller does not use alongside this).
    let rc = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, ru.as_mut_ptr()) };
    match rc {
        0 => Ok(None),
        r if r == pid => {
            // SAFETY: all-zero bytes are a valid `rusage`, and wait4
            // filled it in when it reaped the child.
            let ru = unsafe { ru.assume_init() };
            Ok(Some((
                std::process::ExitStatus::from_raw(status),
                CpuTime {
                    user: timeval(ru.ru_utime),
                    system: timeval(ru.ru_stime),
                },
            )))
        }
        _ => Err(io::Error::last_os_error()),
    }
}

fn rusage(who: libc::c_int) -> io::Result<CpuTime> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a writable `struct rusage`, the only thing getrusage
    // writes to; `who` is one of the selectors it defines.
    let rc = unsafe { libc::getrusage(who, ru.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: all-zero bytes are a valid `rusage` (plain integers), and
    // getrusage succeeded and filled it in.
    let ru = unsafe { ru.assume_init() };
    Ok(CpuTime {
        user: timeval(ru.ru_utime),
        system: timeval(ru.ru_stime),
    })
}

fn timeval(tv: libc::timeval) -> Duration {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let micros = u32::try_from(tv.tv_usec).unwrap_or(0);
    Duration::from_secs(secs) + Duration::from_micros(u64::from(micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(user_ms: u64, system_ms: u64) -> CpuTime {
        CpuTime {
            user: Duration::from_millis(user_ms),
            system: Duration::from_millis(system_ms),
        }
    }

    #[test]
    fn per_io_divides_user_and_system_by_the_ios() {
        // 300 ms user + 100 ms system over 100,000 I/Os: 3 + 1 µs each.
        let per = cpu(300, 100).per_io(100_000).unwrap();
        assert!((per.user_us - 3.0).abs() < 1e-9, "{per:?}");
        assert!((per.system_us - 1.0).abs() < 1e-9, "{per:?}");
        assert!((per.total_us() - 4.0).abs() < 1e-9);
        assert_eq!(cpu(1, 1).per_io(0), None);
    }

    #[test]
    fn differences_and_sums() {
        let a = cpu(10, 20);
        let b = cpu(15, 50);
        assert_eq!(b.since(&a), cpu(5, 30));
        assert_eq!(a.since(&b), cpu(0, 0));
        assert_eq!(a + b, cpu(25, 70));
        assert_eq!((a + b).total(), Duration::from_millis(95));
    }

    #[test]
    fn fio_percentages_become_microseconds_per_io() {
        // 4 jobs x 2000 ms = 8000 ms of job time; 25 % user and 50 %
        // system of it = 2000 ms + 4000 ms, over 1,000,000 I/Os.
        let per = fio_per_io(25.0, 50.0, 8000.0, 1_000_000).unwrap();
        assert!((per.user_us - 2.0).abs() < 1e-9, "{per:?}");
        assert!((per.system_us - 4.0).abs() < 1e-9, "{per:?}");
        assert_eq!(fio_per_io(1.0, 1.0, 1000.0, 0), None);
        assert_eq!(fio_per_io(1.0, 1.0, 0.0, 10), None);
    }

    #[test]
    // Reaped by `try_wait_with_cpu` (wait4), which clippy cannot see.
    #[allow(clippy::zombie_processes)]
    fn a_reaped_child_reports_its_cpu_time() {
        // A child that burns about 50 ms of CPU, then exits 3.
        let child = std::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; exit 3",
            ])
            .spawn()
            .unwrap();
        let (status, used) = loop {
            if let Some(done) = try_wait_with_cpu(&child).unwrap() {
                break done;
            }
            std::thread::yield_now();
        };
        assert_eq!(status.code(), Some(3));
        assert!(used.total() > Duration::from_millis(1), "{used:?}");
        assert!(used.total() < Duration::from_secs(20), "{used:?}");
    }

    #[test]
    fn getrusage_sees_this_thread_spin() {
        const WANT: Duration = Duration::from_millis(30);
        // Up to one scheduler tick (10 ms at HZ=100) not yet accounted.
        const TICK: Duration = Duration::from_millis(12);
        let before_thread = CpuTime::thread().unwrap();
        let before_process = CpuTime::process().unwrap();
        // Spin until this thread has used WANT of CPU by its own account,
        // however busy the machine is (bounded by wall time in case the
        // counter never moves, which is the failure this looks for).
        let started = std::time::Instant::now();
        let mut x = 0u64;
        let thread = loop {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            let used = CpuTime::thread().unwrap().since(&before_thread);
            if used.total() >= WANT || started.elapsed() > Duration::from_secs(20) {
                break used;
            }
        };
        let process = CpuTime::process().unwrap().since(&before_process);
        assert!(
            thread.total() >= WANT,
            "{thread:?} in {:?}",
            started.elapsed()
        );
        assert!(thread.total() <= WANT + 2 * TICK, "{thread:?}");
        // The process includes this thread (other test threads may add).
        assert!(
            process.total() + TICK >= thread.total(),
            "{process:?} < {thread:?}"
        );
    }
}
