//! Shared helpers for the invariant test suites: seeds and iteration counts
//! from the environment, a watchdog against hangs, devices, and reading a
//! whole volume back into plain data.
//!
//! Reproducing a failure: every suite prints `seed=...` for the failing case;
//! rerun that one case with `IOMAPFS_TEST_SEED=<seed> cargo test -p iomapfs-fs
//! --test <suite>`. `IOMAPFS_TEST_BASE_SEED` picks the base seed of a whole
//! run (default: fixed under CI, time-derived otherwise; always printed).

#![allow(dead_code)]

pub mod dev;
pub mod history;
pub mod volstate;
pub mod workload;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use rand::rngs::SmallRng;
pub use rand::{Rng, SeedableRng};

/// An integer from the environment, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => parse_u64(&v).unwrap_or_else(|| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn parse_u64(v: &str) -> Option<u64> {
    let v = v.trim().replace('_', "");
    if let Some(hex) = v.strip_prefix("0x") {
        u64::from_str_radix(hex, 16).ok()
    } else {
        v.parse().ok()
    }
}

/// SplitMix64's mixer (the workspace's one, from `blockdev::rng`), for
/// deriving seeds and patterns: saved seeds keep their meaning.
pub use blockdev::rng::mix64;

/// How a suite picks the seeds of its cases.
pub struct Seeds {
    /// `IOMAPFS_TEST_SEED`: run exactly this one case.
    pub fixed: Option<u64>,
    pub base: u64,
}

impl Seeds {
    pub fn from_env(suite: &str) -> Seeds {
        let fixed = std::env::var("IOMAPFS_TEST_SEED")
            .ok()
            .map(|v| parse_u64(&v).expect("IOMAPFS_TEST_SEED is not a number"));
        let base = match std::env::var("IOMAPFS_TEST_BASE_SEED") {
            Ok(v) => parse_u64(&v).expect("IOMAPFS_TEST_BASE_SEED is not a number"),
            Err(_) if std::env::var_os("CI").is_some() => 0x10_4A9F_5EED,
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1),
        };
        match fixed {
            Some(s) => eprintln!("{suite}: IOMAPFS_TEST_SEED={s} (one case)"),
            None => eprintln!("{suite}: base seed IOMAPFS_TEST_BASE_SEED={base}"),
        }
        Seeds { fixed, base }
    }

    /// Seed of case `i`.
    pub fn case(&self, i: u64) -> u64 {
        self.fixed.unwrap_or_else(|| mix64(self.base ^ mix64(i)))
    }

    /// Number of cases to run when `n` were asked for.
    pub fn count(&self, n: u64) -> u64 {
        if self.fixed.is_some() {
            1
        } else {
            n
        }
    }
}

/// Runs one case; on panic prints how to rerun it, then re-raises.
pub fn run_case<T>(suite: &str, seed: u64, what: &str, f: impl FnOnce() -> T) -> T {
    watchdog().enter(suite, seed, what);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => {
            watchdog().leave();
            v
        }
        Err(e) => {
            watchdog().leave();
            eprintln!(
                "\n*** {suite}: case FAILED: {what} seed={seed}\n*** rerun: IOMAPFS_TEST_SEED={seed} cargo test -p iomapfs-fs --test {suite}\n"
            );
            resume_unwind(e)
        }
    }
}

/// Aborts the process when a case makes no progress for too long: a hang is
/// a bug (invariant 6), and a hung test would otherwise say nothing.
pub struct Watchdog {
    current: Mutex<Option<(String, u64, String, Instant)>>,
    limit: Duration,
    started: AtomicBool,
    beats: AtomicU64,
}

pub fn watchdog() -> &'static Watchdog {
    static W: OnceLock<Watchdog> = OnceLock::new();
    let w = W.get_or_init(|| Watchdog {
        current: Mutex::new(None),
        limit: Duration::from_secs(env_u64("IOMAPFS_HANG_SECS", 120)),
        started: AtomicBool::new(false),
        beats: AtomicU64::new(0),
    });
    if !w.started.swap(true, Ordering::SeqCst) {
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(500));
                let cur = w.current.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((suite, seed, what, t)) = &*cur {
                    if t.elapsed() > w.limit {
                        eprintln!(
                            "\n*** {suite}: HANG: case {what} seed={seed} made no progress for {:?}\n*** rerun: IOMAPFS_TEST_SEED={seed} cargo test -p iomapfs-fs --test {suite}",
                            w.limit
                        );
                        std::process::abort();
                    }
                }
            })
            .expect("spawn watchdog");
    }
    w
}

impl Watchdog {
    fn enter(&self, suite: &str, seed: u64, what: &str) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((suite.to_string(), seed, what.to_string(), Instant::now()));
    }
    fn leave(&self) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
    /// Progress inside a long case: resets the hang timer.
    pub fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &mut *self.current.lock().unwrap_or_else(|e| e.into_inner()) {
            c.3 = Instant::now();
        }
    }
}

/// Counters printed at the end of a suite.
#[derive(Default)]
pub struct Stats {
    items: Mutex<Vec<(String, u64)>>,
}

impl Stats {
    pub fn add(&self, name: &str, n: u64) {
        let mut items = self.items.lock().unwrap();
        if let Some(e) = items.iter_mut().find(|(k, _)| k == name) {
            e.1 += n;
        } else {
            items.push((name.to_string(), n));
        }
    }
    pub fn get(&self, name: &str) -> u64 {
        let items = self.items.lock().unwrap();
        items
            .iter()
            .find(|(k, _)| k == name)
            .map(|e| e.1)
            .unwrap_or(0)
    }
    pub fn print(&self, suite: &str, elapsed: Duration) {
        let items = self.items.lock().unwrap();
        let body: Vec<String> = items.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let line = format!("{suite}: {} in {:.1?}", body.join(" "), elapsed);
        eprintln!("{line}");
        // A passing test's output is captured: CI collects these lines in a
        // file it prints at the end (the counts one CI run covered).
        if let Some(path) = std::env::var_os("IOMAPFS_CI_COUNTS") {
            use std::io::Write;
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
            if let Err(e) = appended {
                panic!("{suite}: cannot append to IOMAPFS_CI_COUNTS={path:?}: {e}");
            }
        }
    }
}

pub type Shared<T> = Arc<Mutex<T>>;

/// First offset where `a` and `b` differ, for failure messages.
pub fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b.iter())
        .position(|(x, y)| x != y)
        .or(if a.len() != b.len() {
            Some(a.len().min(b.len()))
        } else {
            None
        })
}

/// A short hex excerpt of `data` around `at`.
pub fn excerpt(data: &[u8], at: usize) -> String {
    let lo = at.saturating_sub(8);
    let hi = (at + 24).min(data.len());
    if lo >= hi {
        return "<empty>".into();
    }
    let hex: Vec<String> = data[lo..hi].iter().map(|b| format!("{b:02x}")).collect();
    format!("[{lo}..{hi}) {}", hex.join(" "))
}

/// `IOMAPFS_SKIP=name,...` turns off the checks that keep hitting a known,
/// reported bug, so that a run can look for others. Names:
/// - `eof-tail`: extending a file after a crash exposes bytes a lost write
///   left past the recovered EOF (no crash-like remounts in workloads, no
///   extension after recovery).
pub fn skip(name: &str) -> bool {
    std::env::var("IOMAPFS_SKIP")
        .map(|v| v.split(',').any(|s| s.trim() == name))
        .unwrap_or(false)
}

/// Mounts `dev` with every device request coming from the test's own calls
/// (no background checkpoints or commits), so that a seed replays the same request
/// sequence: for the suites that cut power at request indices and promise
/// that a failing seed reproduces.
pub fn open_replayable(
    dev: std::sync::Arc<dyn blockdev::BlockDevice>,
) -> iomapfs_fs::Result<iomapfs_fs::Volume> {
    let opts = iomapfs_fs::MountOptions {
        background_checkpoints: false,
        background_commits: false,
        ..iomapfs_fs::MountOptions::default()
    };
    iomapfs_fs::Volume::open_with(dev, &opts)
}
