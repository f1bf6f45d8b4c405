//! Helpers shared by the queue and backend-choice tests: temp images,
//! privileged-test plumbing (loop devices, zram) and a random workload that
//! drives any [`DeviceQueue`] and checks every completion against a model.

#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use blockdev::{AlignedBuf, DeviceCompletion, DeviceQueue, DeviceRequest, Token, WriteMode};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A temp image of `size` bytes on the current file system (the target dir's,
/// not /tmp, which may be tmpfs), filled with `fill(i)` for byte `i`.
pub fn image(size: usize, fill: impl Fn(usize) -> u8) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bytes: Vec<u8> = (0..size).map(fill).collect();
    f.write_all(&bytes).unwrap();
    f.flush().unwrap();
    f
}

/// Byte `i` of the standard initial image content.
pub fn initial(i: usize) -> u8 {
    (i / 512) as u8 ^ (i as u8).wrapping_mul(7)
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

// The crate's own test plumbing (its unit tests use it), compiled into
// this test crate as well: one place says how a privileged test skips and
// how a command runs.
#[path = "../../src/test_support.rs"]
mod test_support;
#[allow(unused_imports)] // each test binary uses a different subset
pub(crate) use test_support::{run, skip_privileged};

/// A loop device over `image`, detached on drop.
pub struct LoopDev {
    pub path: PathBuf,
}

impl LoopDev {
    /// A loop device over `image` with the partitions of its table:
    /// partition N is `{path}pN`. `partx --add` adds them where the
    /// kernel's own scan does not (a kernel built without the table's
    /// parser).
    #[allow(dead_code)]
    pub fn attach_partitioned(image: &Path) -> Result<LoopDev, String> {
        run("losetup", &["--version"])?;
        let dev = run(
            "losetup",
            &["--find", "--show", "--partscan", image.to_str().unwrap()],
        )?;
        let lo = LoopDev {
            path: PathBuf::from(dev),
        };
        if !Path::new(&format!("{}p1", lo.path.display())).exists() {
            run("partx", &["--add", &lo.path.to_string_lossy()])?;
        }
        Ok(lo)
    }

    pub fn attach(image: &Path) -> Result<LoopDev, String> {
        run("losetup", &["--version"])?;
        let dev = run(
            "losetup",
            &[
                "--find",
                "--show",
                "--direct-io=on",
                image.to_str().unwrap(),
            ],
        )
        .or_else(|_| run("losetup", &["--find", "--show", image.to_str().unwrap()]))?;
        Ok(LoopDev {
            path: PathBuf::from(dev),
        })
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        // A handle closed a moment ago may still hold the device (a failing
        // test unwinding): retry briefly rather than leave it attached.
        for _ in 0..20 {
            if run("losetup", &["-d", &self.path.to_string_lossy()]).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        eprintln!("warning: could not detach {}", self.path.display());
    }
}

/// `/dev/zram0`, configured with `disksize` for the life of the guard and
/// reset (emptied, unconfigured) before and after, also when the test panics.
/// Holds an exclusive `flock` on `/tmp/iomapfs-zram.lock` so tests in
/// different processes never share the device.
pub struct Zram {
    pub path: PathBuf,
    _lock: File,
}

const ZRAM_SYSFS: &str = "/sys/block/zram0";
const ZRAM_LOCK: &str = "/tmp/iomapfs-zram.lock";

impl Zram {
    pub fn setup(disksize: &str) -> Result<Zram, String> {
        if !Path::new("/dev/zram0").exists() {
            return Err("no /dev/zram0 (zram module not loaded?)".into());
        }
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(ZRAM_LOCK)
            .map_err(|e| format!("{ZRAM_LOCK}: {e}"))?;
        // SAFETY: flock on a descriptor we own; blocks until the lock is ours.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(format!(
                "flock {ZRAM_LOCK}: {}",
                std::io::Error::last_os_error()
            ));
        }
        let zram = Zram {
            path: PathBuf::from("/dev/zram0"),
            _lock: lock,
        };
        zram.reset()?;
        std::fs::write(format!("{ZRAM_SYSFS}/disksize"), disksize)
            .map_err(|e| format!("zram0 disksize {disksize}: {e}"))?;
        Ok(zram)
    }

    fn reset(&self) -> Result<(), String> {
        std::fs::write(format!("{ZRAM_SYSFS}/reset"), "1").map_err(|e| format!("zram0 reset: {e}"))
    }
}

impl Drop for Zram {
    fn drop(&mut self) {
        // Before the lock (a field) is released.
        if let Err(e) = self.reset() {
            eprintln!("warning: {e}");
        }
    }
}

/// One request the workload has in flight.
struct Outstanding {
    flush: bool,
    write: bool,
    range: std::ops::Range<u64>,
    len: usize,
    /// Reads: the bytes the model says the read must return. Writes: the
    /// bytes written (the buffer must come back unchanged).
    expect: Vec<u8>,
}

/// What a random mix did: one line per token, in token order, so two
/// backends running the same seed can be compared line by line.
pub type MixLog = Vec<String>;

/// Runs `ops` random reads, writes (some FUA) and flushes through `queue`,
/// `seed` choosing them, keeping up to `queue.depth()` in flight.
///
/// Requests in flight at the same time never overlap a write (the device may
/// order those any way it likes), so every read has exactly one right answer:
/// `model` as it was when the read was pushed. `model` starts as the device's
/// content and ends as what it must hold. Panics on any wrong completion.
pub fn random_mix(
    queue: &mut dyn DeviceQueue,
    model: &mut [u8],
    lbs: usize,
    align: usize,
    seed: u64,
    ops: usize,
) -> MixLog {
    let mut rng = SmallRng::seed_from_u64(seed);
    let blocks = model.len() / lbs;
    let max_blocks = 16.min(blocks);
    let mut outstanding: HashMap<Token, Outstanding> = HashMap::new();
    let mut log: Vec<(Token, String)> = Vec::new();
    let mut done = Vec::new();
    let mut unsubmitted = 0usize;

    for token in 0..ops as Token {
        // Choose the request from the rng alone, so the sequence does not
        // depend on completion timing.
        let kind = rng.gen_range(0..20);
        let nblocks = rng.gen_range(1..=max_blocks);
        let first = rng.gen_range(0..=blocks - nblocks);
        let (offset, len) = ((first * lbs) as u64, nblocks * lbs);
        let range = offset..offset + len as u64;
        let (write, flush, fua) = match kind {
            0 => (false, true, false),
            1..=3 => (true, false, true),
            4..=10 => (true, false, false),
            _ => (false, false, false),
        };
        let fill: u8 = rng.gen();

        // Wait for conflicting requests and for room.
        loop {
            let conflict = !flush
                && outstanding.values().any(|o| {
                    (o.write || write) && o.range.start < range.end && range.start < o.range.end
                });
            if !conflict && queue.in_flight() < queue.depth() {
                break;
            }
            // Both ways of sending a batch and waiting: two calls, or one.
            let combined = unsubmitted > 0 && token % 2 == 0;
            if unsubmitted > 0 && !combined {
                queue.submit().unwrap();
            }
            unsubmitted = 0;
            settle(queue, &mut outstanding, &mut done, &mut log, 1, combined);
        }

        let request = if flush {
            outstanding.insert(
                token,
                Outstanding {
                    flush: true,
                    write: false,
                    range: 0..0,
                    len: 0,
                    expect: Vec::new(),
                },
            );
            DeviceRequest::Flush
        } else if write {
            let mut buf = AlignedBuf::new(len, align).unwrap();
            for (i, b) in buf.iter_mut().enumerate() {
                *b = fill.wrapping_add((i / 97) as u8);
            }
            model[offset as usize..range.end as usize].copy_from_slice(&buf);
            outstanding.insert(
                token,
                Outstanding {
                    flush: false,
                    write: true,
                    range,
                    len,
                    expect: buf.to_vec(),
                },
            );
            let mode = if fua {
                WriteMode::Fua
            } else {
                WriteMode::Normal
            };
            DeviceRequest::Write { offset, buf, mode }
        } else {
            let mut buf = AlignedBuf::new(len, align).unwrap();
            // Garbage the device must overwrite.
            buf.fill(!fill);
            outstanding.insert(
                token,
                Outstanding {
                    flush: false,
                    write: false,
                    range: range.clone(),
                    len,
                    expect: model[offset as usize..range.end as usize].to_vec(),
                },
            );
            DeviceRequest::Read { offset, buf }
        };
        queue
            .push(token, request)
            .unwrap_or_else(|e| panic!("push {token}: {e}"));
        unsubmitted += 1;
        // Batches of random size.
        if rng.gen_ratio(1, 4) {
            let sent = queue.submit().unwrap();
            assert_eq!(sent, unsubmitted, "submit counts the batch");
            unsubmitted = 0;
        }
        if rng.gen_ratio(1, 8) {
            settle(queue, &mut outstanding, &mut done, &mut log, 0, false);
        }
    }
    queue.submit().unwrap();
    while queue.in_flight() > 0 {
        let n = queue.in_flight();
        settle(queue, &mut outstanding, &mut done, &mut log, n, false);
    }
    assert!(outstanding.is_empty(), "every request completed");
    log.sort();
    log.into_iter().map(|(_, line)| line).collect()
}

/// Reaps at least `min` completions (after submitting, with `submit_first`)
/// and checks each against what was pushed.
fn settle(
    queue: &mut dyn DeviceQueue,
    outstanding: &mut HashMap<Token, Outstanding>,
    done: &mut Vec<DeviceCompletion>,
    log: &mut Vec<(Token, String)>,
    min: usize,
    submit_first: bool,
) {
    let n = if submit_first {
        queue.submit_and_reap(min, done).unwrap()
    } else {
        queue.reap(min, done).unwrap()
    };
    assert!(n >= min, "reap({min}) returned {n}");
    assert_eq!(n, done.len());
    for c in done.drain(..) {
        let o = outstanding
            .remove(&c.token)
            .unwrap_or_else(|| panic!("unknown or repeated token {}", c.token));
        let line = check_completion(c.token, &o, c);
        log.push(line);
    }
}

fn check_completion(token: Token, o: &Outstanding, c: DeviceCompletion) -> (Token, String) {
    let n = match &c.result {
        Ok(n) => *n,
        Err(e) => panic!("token {token}: {e}"),
    };
    assert_eq!(n, o.len, "token {token}: bytes transferred");
    if o.flush {
        assert!(c.buf.is_none(), "token {token}: a flush has no buffer");
        return (token, format!("{token} flush"));
    }
    let buf = c
        .buf
        .unwrap_or_else(|| panic!("token {token}: buffer not handed back"));
    assert_eq!(buf.len(), o.len, "token {token}: buffer length");
    if buf[..] != o.expect[..] {
        let at = buf.iter().zip(&o.expect).position(|(a, b)| a != b).unwrap();
        panic!(
            "token {token}: {} at {:?} differs at byte {at}: {} != expected {}",
            if o.write { "write buffer" } else { "read data" },
            o.range,
            buf[at],
            o.expect[at]
        );
    }
    let sum = buf.iter().fold(0u64, |h, &b| {
        h.wrapping_mul(1_000_003).wrapping_add(u64::from(b))
    });
    let kind = if o.write { "write" } else { "read" };
    (token, format!("{token} {kind} {:?} {sum:x}", o.range))
}

/// Submits what is queued and reaps everything in flight, by token.
pub fn reap_all(q: &mut dyn DeviceQueue) -> Vec<DeviceCompletion> {
    q.submit().unwrap();
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        let n = q.in_flight();
        q.reap(n, &mut out).unwrap();
    }
    out.sort_by_key(|c| c.token);
    out
}
