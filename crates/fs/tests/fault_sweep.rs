//! Fault sweep: every device request of a set of scripted workloads fails
//! once, in turn — every read, every write, every flush, by index, not a
//! sample (DESIGN.md, fault model: "any single device request failing").
//!
//! A fault-free run counts the requests of each kind; then, for each kind
//! and each index, the workload runs again on a fresh volume with exactly
//! that request failing. Each run must show:
//! - no panic and no hang;
//! - a clear error (EIO, a message) from the step that issued the failed
//!   request, and from no step before it (the right caller). A failed read
//!   may be absorbed only if the step still returned the right bytes;
//! - the volume going on, or shutting down, as DESIGN.md says: a failed
//!   journal or checkpoint write, or a failed flush of a commit with
//!   records, shuts it down (every later step fails, none succeeds);
//!   anything else leaves it working (every later step succeeds, and the
//!   live data reads back as the model says: the state after a failed
//!   write, and after the next successful sync);
//! - after the run, for several power-cut policies: mount, fsck clean, and
//!   nothing lost that a step before made durable (a returned fsync, sync,
//!   checkpoint, unmount or DSYNC write), no stale bytes; after a
//!   successful unmount, a remount shows exactly the live state.
//!
//! Workloads: direct writes that allocate, overwrites (aligned, sub-block,
//! DSYNC), truncate / punch / fallocate, buffered writes with writeback by
//! fsync, sync and unmount (the folio cache), asynchronous writes through a
//! queue, and unlink + reuse. Each runs with and without native FUA, and
//! with a journal so small that commits wrap it and checkpoint. Background writeback is held off (long
//! expiry), so the request order is the same in every run.

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::memory::{FaultOp, FaultRule, MemDevice};
use blockdev::BlockDevice;
use common::dev::{cut, marked_device, try_fsck_clean, CutPolicy, RecDevice, Req, MIB};
use common::history::{find_marker, tagged};
use common::{run_case, watchdog, Stats};
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::{Error, File, FormatOptions, MountOptions, OpenFlags, Volume};

const SIZE: u64 = 8 * MIB;

/// One file the workload uses: a path and how its handle is opened.
#[derive(Clone, Copy, Debug)]
struct Handle {
    path: &'static str,
    direct: bool,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    /// Opens (creating) handle `h`.
    Open(usize),
    Write {
        h: usize,
        off: u64,
        len: usize,
        dsync: bool,
    },
    /// Reads and compares with the model.
    Read {
        h: usize,
        off: u64,
        len: usize,
    },
    Fsync(usize),
    Truncate(usize, u64),
    Punch(usize, u64, u64),
    /// Allocates `[off, off + len)`, keeping the size.
    Falloc(usize, u64, u64),
    Unlink(usize),
    /// Asynchronous writes `(offset, len)` through an I/O queue, all
    /// submitted, then all reaped.
    Aio(usize, &'static [(u64, usize)]),
    Sync,
    Checkpoint,
    Unmount,
}

struct Workload {
    name: &'static str,
    handles: &'static [Handle],
    steps: &'static [Step],
}

const A: Handle = Handle {
    path: "/a",
    direct: true,
};
const B: Handle = Handle {
    path: "/b",
    direct: false,
};
const B_DIRECT: Handle = Handle {
    path: "/b",
    direct: true,
};
const D: Handle = Handle {
    path: "/d",
    direct: true,
};

use Step::*;

const fn write(h: usize, off: u64, len: usize) -> Step {
    Write {
        h,
        off,
        len,
        dsync: false,
    }
}

const fn dsync_write(h: usize, off: u64, len: usize) -> Step {
    Write {
        h,
        off,
        len,
        dsync: true,
    }
}

const fn read(h: usize, off: u64, len: usize) -> Step {
    Read { h, off, len }
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "direct_allocating_writes",
        handles: &[A],
        steps: &[
            Open(0),
            write(0, 0, 65536),
            write(0, 100_000, 10_000),
            Fsync(0),
            write(0, 65536, 8192),
            read(0, 0, 120_000),
            Fsync(0),
            Unmount,
        ],
    },
    Workload {
        name: "overwrites",
        handles: &[A],
        steps: &[
            Open(0),
            write(0, 0, 32768),
            Fsync(0),
            write(0, 4096, 4096),
            write(0, 10_000, 3000),
            dsync_write(0, 8192, 4096),
            dsync_write(0, 20_000, 700),
            read(0, 0, 32768),
            Sync,
            Unmount,
        ],
    },
    Workload {
        name: "truncate_punch_fallocate",
        handles: &[A, B],
        steps: &[
            Open(0),
            write(0, 0, 49152),
            Fsync(0),
            Truncate(0, 20_000),
            Punch(0, 4096, 4096),
            Falloc(0, 40_960, 16_384),
            Truncate(0, 60_000),
            Fsync(0),
            read(0, 0, 60_000),
            Open(1),
            write(1, 0, 30_000),
            Punch(1, 5000, 9000),
            Truncate(1, 12_345),
            Fsync(1),
            read(1, 0, 12_345),
            Unmount,
        ],
    },
    Workload {
        name: "buffered_writeback",
        handles: &[B, B_DIRECT],
        steps: &[
            Open(0),
            write(0, 0, 20_000),
            write(0, 30_000, 5000),
            read(0, 0, 40_000),
            Fsync(0),
            write(0, 1000, 2000),
            write(0, 60_000, 4096),
            Sync,
            write(0, 70_000, 1000),
            dsync_write(0, 8192, 3000),
            Open(1),
            read(1, 0, 71_000),
            write(0, 80_000, 9000),
            Checkpoint,
            write(0, 100, 100),
            Unmount,
        ],
    },
    Workload {
        name: "async_writes",
        handles: &[A],
        steps: &[
            Open(0),
            // Allocating, sub-block and extending writes, in one batch.
            Aio(0, &[(0, 16384), (20_480, 8192), (40_000, 3000)]),
            Fsync(0),
            // Pure overwrites and a sub-block overwrite.
            Aio(0, &[(4096, 4096), (24_576, 4096), (41_000, 100)]),
            read(0, 0, 43_000),
            Sync,
            Unmount,
        ],
    },
    Workload {
        // Ten commits: on the small journal, some of them checkpoint.
        name: "many_commits",
        handles: &[A, B],
        steps: &[
            Open(0),
            Open(1),
            write(0, 0, 4096),
            Fsync(0),
            write(1, 0, 5000),
            Fsync(1),
            write(0, 8192, 4096),
            Fsync(0),
            Truncate(1, 3000),
            Fsync(1),
            dsync_write(0, 16_384, 100),
            write(1, 9000, 5000),
            Fsync(1),
            write(0, 20_480, 4096),
            Fsync(0),
            Punch(0, 0, 4096),
            Fsync(0),
            dsync_write(1, 20_000, 100),
            Falloc(0, 32_768, 8192),
            Sync,
            read(0, 0, 24_576),
            read(1, 0, 20_100),
            Unmount,
        ],
    },
    Workload {
        name: "unlink_and_reuse",
        handles: &[A, D],
        steps: &[
            Open(0),
            write(0, 0, 16384),
            Sync,
            Unlink(0),
            Open(1),
            write(1, 0, 16384),
            Fsync(1),
            read(1, 0, 16384),
            Unmount,
        ],
    },
];

/// What one path holds in the model.
#[derive(Clone, Debug, Default)]
struct FileModel {
    /// The bytes, if every step so far did what it was asked.
    cur: Vec<u8>,
    /// Every content since the last durable point, that one first: after a
    /// power cut each byte must come from one of them.
    versions: Vec<Vec<u8>>,
    /// Ranges a failed step may have left in any state (old, new, torn).
    tainted: Vec<Range<u64>>,
    /// Ranges changed since the last durable point: what a failed
    /// writeback may have lost (the cache then drops or keeps it).
    dirty: Vec<Range<u64>>,
    /// Written through the cache.
    buffered: bool,
    /// Ranges a returned DSYNC write made durable, not written since.
    floors: Vec<(Range<u64>, Vec<u8>)>,
    linked: bool,
    /// The current name (linked or unlinked) is durable.
    name_durable: bool,
}

impl FileModel {
    fn is_tainted(&self, x: u64) -> bool {
        self.tainted.iter().any(|r| r.contains(&x))
    }

    fn changed(&mut self, range: Range<u64>, failed: bool) {
        self.floors
            .retain(|(r, _)| r.end <= range.start || range.end <= r.start);
        if failed {
            self.tainted.push(range.clone());
        }
        self.dirty.push(range);
        self.versions.push(self.cur.clone());
    }

    fn durable(&mut self) {
        self.versions = vec![self.cur.clone()];
        self.dirty.clear();
        self.name_durable = true;
    }

    /// A step failed that may have written back this file's cached data:
    /// what was dirty may now be lost or half written.
    fn writeback_failed(&mut self) {
        if self.buffered {
            let dirty = std::mem::take(&mut self.dirty);
            self.tainted.extend(dirty);
        }
    }

    /// Checks a file read back after a power cut.
    fn check_recovered(&self, got: &[u8]) -> Result<(), String> {
        if let Some(at) = find_marker(got) {
            return Err(format!("stale device bytes at {at}"));
        }
        let any_tainted = !self.tainted.is_empty();
        let sizes = self.versions.iter().map(|v| v.len());
        let (lo, hi) = (sizes.clone().min().unwrap_or(0), sizes.max().unwrap_or(0));
        if !any_tainted && !(lo..=hi).contains(&got.len()) {
            return Err(format!(
                "size {} outside the sizes it had since its last durable point ({lo}..={hi})",
                got.len()
            ));
        }
        for (x, &b) in got.iter().enumerate() {
            let x64 = x as u64;
            if self.is_tainted(x64) {
                continue;
            }
            let ok = self
                .versions
                .iter()
                .any(|v| v.get(x).copied().unwrap_or(0) == b);
            if !ok {
                return Err(format!(
                    "byte {x} = {b:#04x}, which no version since the last durable point holds \
                     (durable: {:#04x})",
                    self.versions[0].get(x).copied().unwrap_or(0)
                ));
            }
        }
        for (r, want) in &self.floors {
            let have = got.get(r.start as usize..r.end as usize);
            if have != Some(&want[..]) {
                return Err(format!("a returned DSYNC write of {r:?} was lost"));
            }
        }
        Ok(())
    }

    /// Checks a live read of `[off, off + len)` that returned `got`.
    fn check_live(&self, off: u64, got: &[u8]) -> Result<(), String> {
        for (i, &b) in got.iter().enumerate() {
            let x = off + i as u64;
            if self.is_tainted(x) {
                continue;
            }
            let want = self.cur.get(x as usize).copied().unwrap_or(0);
            if b != want {
                return Err(format!("live read: byte {x} = {b:#04x}, want {want:#04x}"));
            }
        }
        Ok(())
    }
}

/// The outcome of one step.
#[derive(Debug)]
struct StepResult {
    step: usize,
    error: Option<Error>,
    /// Not run: it needs a handle whose open failed.
    skipped: bool,
    /// Device requests logged before the step started / after it ended.
    reqs: Range<usize>,
}

struct Run {
    results: Vec<StepResult>,
    /// `Some` once the mount itself failed.
    mount_error: Option<Error>,
    /// What the mount worked around (a failed read of block 0: the backup
    /// superblock was read), and the requests the mount issued.
    mount_warnings: Vec<String>,
    mount_reqs: usize,
    model: BTreeMap<&'static str, FileModel>,
    log: Vec<Req>,
    unmounted: bool,
    /// Wrong bytes seen by a live read: (step, why).
    live_mismatch: Option<(usize, String)>,
}

fn mount_options() -> MountOptions {
    let mut opts = MountOptions::default();
    // Background writeback would issue requests at times of its own.
    opts.cache.dirty_expire = Duration::from_secs(3600);
    opts.cache.writeback_interval = Duration::from_secs(3600);
    opts.background_checkpoints = false;
    opts.background_commits = false;
    opts
}

/// The device variants each workload runs on.
#[derive(Clone, Copy, Debug)]
struct Variant {
    fua: bool,
    /// A journal of a few blocks: commits wrap it and checkpoint.
    tiny_journal: bool,
}

const VARIANTS: [Variant; 3] = [
    Variant {
        fua: false,
        tiny_journal: false,
    },
    Variant {
        fua: true,
        tiny_journal: false,
    },
    Variant {
        fua: false,
        tiny_journal: true,
    },
];

fn fresh_device(variant: Variant) -> Arc<MemDevice> {
    let mem = marked_device(SIZE, variant.fua);
    let opts = FormatOptions {
        journal_bytes: variant.tiny_journal.then_some(32 * 1024),
        ..FormatOptions::default()
    };
    Volume::format(mem.clone(), &opts).expect("format");
    mem.flush().unwrap();
    mem
}

/// Data written by step `i` at `off`: distinct per step and offset.
fn data_for(step: usize, off: u64, len: usize) -> Vec<u8> {
    tagged(100 + step as u64, off, len)
}

fn run_workload(wl: &Workload, mem: &Arc<MemDevice>) -> Run {
    let rec = RecDevice::new(mem.clone());
    let dev: Arc<dyn BlockDevice> = rec.clone();
    let mut run = Run {
        results: Vec::new(),
        mount_error: None,
        mount_warnings: Vec::new(),
        mount_reqs: 0,
        model: BTreeMap::new(),
        log: Vec::new(),
        unmounted: false,
        live_mismatch: None,
    };
    let vol = match Volume::open_with(dev, &mount_options()) {
        Ok(v) => {
            run.mount_warnings = v.mount_warnings().to_vec();
            run.mount_reqs = rec.since(0).len();
            v
        }
        Err(e) => {
            run.mount_error = Some(e);
            run.log = rec.since(0);
            return run;
        }
    };
    let mut vol = Some(vol);
    let mut files: Vec<Option<File>> = wl.handles.iter().map(|_| None).collect();
    for (i, step) in wl.steps.iter().enumerate() {
        watchdog().beat();
        let start = rec.mark();
        let needs = match *step {
            Write {
                h, dsync: false, ..
            }
            | Read { h, .. } => Some(h),
            Fsync(h) | Truncate(h, _) | Punch(h, ..) | Falloc(h, ..) | Aio(h, _) => Some(h),
            _ => None,
        };
        let skipped = needs.is_some_and(|h| files[h].is_none());
        let r = if skipped {
            Ok(())
        } else {
            run_step(wl, i, *step, &mut vol, &mut files, &mut run)
        };
        if r.is_err() {
            for m in run.model.values_mut() {
                m.writeback_failed();
            }
        }
        run.results.push(StepResult {
            step: i,
            error: r.err(),
            skipped,
            reqs: start..rec.mark(),
        });
    }
    run.log = rec.since(0);
    run
}

fn run_step(
    wl: &Workload,
    i: usize,
    step: Step,
    vol: &mut Option<Volume>,
    files: &mut [Option<File>],
    run: &mut Run,
) -> Result<(), Error> {
    let Some(v) = vol.as_ref() else {
        return Err(Error::invalid("workload", "volume already unmounted"));
    };
    let handle = |h: usize| wl.handles[h];
    match step {
        Open(h) => {
            let hd = handle(h);
            let r = v.open_file(
                hd.path,
                OpenFlags {
                    create: true,
                    direct: hd.direct,
                    ..OpenFlags::default()
                },
            );
            let created = !run.model.get(hd.path).is_some_and(|m| m.linked);
            if created {
                let m = run.model.entry(hd.path).or_default();
                *m = FileModel {
                    versions: vec![Vec::new()],
                    linked: true,
                    buffered: !hd.direct,
                    ..FileModel::default()
                };
                if r.is_err() {
                    m.tainted.push(0..u64::MAX);
                }
            }
            files[h] = Some(r?);
            Ok(())
        }
        Write { h, off, len, dsync } => {
            let hd = handle(h);
            let data = data_for(i, off, len);
            let r = if dsync {
                v.open_file(
                    hd.path,
                    OpenFlags {
                        direct: hd.direct,
                        dsync: true,
                        ..OpenFlags::default()
                    },
                )
                .and_then(|f| f.pwrite(&data, off))
            } else {
                file(files, h).and_then(|f| f.pwrite(&data, off))
            };
            let m = run.model.get_mut(hd.path).expect("model of an open file");
            let end = off as usize + len;
            if m.cur.len() < end {
                m.cur.resize(end, 0);
            }
            m.cur[off as usize..end].copy_from_slice(&data);
            m.changed(off..end as u64, r.is_err());
            if dsync && r.is_ok() {
                m.floors.push((off..end as u64, data));
            }
            r.map(drop)
        }
        Read { h, off, len } => {
            let hd = handle(h);
            let f = file(files, h)?;
            let mut buf = vec![0u8; len];
            let r = f.pread(&mut buf, off);
            v.cache().wait_readahead();
            let n = r?;
            let m = &run.model[hd.path];
            let want = (m.cur.len() as u64).saturating_sub(off).min(len as u64) as usize;
            let why = if n != want && m.tainted.is_empty() {
                Some(format!("read returned {n} bytes, want {want}"))
            } else {
                m.check_live(off, &buf[..n]).err()
            };
            if let (Some(why), None) = (why, &run.live_mismatch) {
                run.live_mismatch = Some((i, why));
            }
            Ok(())
        }
        Fsync(h) => {
            let r = file(files, h)?.fsync();
            if r.is_ok() {
                run.model
                    .get_mut(handle(h).path)
                    .expect("model of an open file")
                    .durable();
            }
            r
        }
        Aio(h, writes) => {
            let f = file(files, h)?;
            let r = aio_writes(v, f, i, writes);
            let m = run.model.get_mut(handle(h).path).expect("model");
            for &(off, len) in writes {
                let data = data_for(i, off, len);
                let end = off as usize + len;
                if m.cur.len() < end {
                    m.cur.resize(end, 0);
                }
                m.cur[off as usize..end].copy_from_slice(&data);
                m.changed(off..end as u64, r.is_err());
            }
            r
        }
        Truncate(h, size) => {
            let r = file(files, h)?.truncate(size);
            let m = run.model.get_mut(handle(h).path).expect("model");
            let old = m.cur.len() as u64;
            m.cur.resize(size as usize, 0);
            m.changed(size.min(old)..size.max(old), r.is_err());
            r
        }
        Punch(h, off, len) => {
            let r = file(files, h)?.punch_hole(off, len);
            let m = run.model.get_mut(handle(h).path).expect("model");
            let end = ((off + len) as usize).min(m.cur.len());
            if (off as usize) < end {
                m.cur[off as usize..end].fill(0);
            }
            m.changed(off..off + len, r.is_err());
            r
        }
        Falloc(h, off, len) => {
            let r = file(files, h)?.fallocate(off, len, true);
            let m = run.model.get_mut(handle(h).path).expect("model");
            m.changed(off..off + len, r.is_err());
            r
        }
        Unlink(h) => {
            let hd = handle(h);
            files[h] = None;
            let r = v.unlink(hd.path);
            let m = run.model.get_mut(hd.path).expect("model");
            m.linked = false;
            m.name_durable = false;
            if r.is_err() {
                // Unlinked or not: either name state may survive.
                m.tainted.push(0..u64::MAX);
            }
            r
        }
        Sync | Checkpoint | Unmount => {
            let r = match step {
                Sync => v.sync(),
                Checkpoint => v.checkpoint(),
                _ => {
                    for f in files.iter_mut() {
                        *f = None;
                    }
                    let r = vol.take().expect("mounted").unmount();
                    run.unmounted = r.is_ok();
                    r
                }
            };
            if r.is_ok() {
                for m in run.model.values_mut() {
                    m.durable();
                }
            }
            r
        }
    }
}

/// Submits every write, reaps every completion; the first error wins.
fn aio_writes(v: &Volume, f: &File, step: usize, writes: &[(u64, usize)]) -> Result<(), Error> {
    let mut q = v.io_queue(writes.len())?;
    let align = v.device().caps().memory_alignment.max(512) as usize;
    for (token, &(off, len)) in writes.iter().enumerate() {
        let mut buf = blockdev::AlignedBuf::new(len, align)
            .map_err(|e| Error::invalid("aligned buffer", e.to_string()))?;
        buf.copy_from_slice(&data_for(step, off, len));
        q.submit_write(f, off, buf, token as u64).map_err(|r| r.1)?;
    }
    let mut done = Vec::new();
    while q.in_flight() > 0 {
        q.reap(q.in_flight(), &mut done)?;
    }
    let mut first = None;
    for c in done {
        match c.result {
            Ok(n) if n != writes[c.token as usize].1 => {
                first.get_or_insert(Error::invalid("aio write", format!("short: {n} bytes")));
            }
            Ok(_) => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

fn file(files: &[Option<File>], h: usize) -> Result<&File, Error> {
    files[h]
        .as_ref()
        .ok_or_else(|| Error::invalid("workload", "handle not open"))
}

/// Where a request went, for the expectations and the messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Region {
    Superblock,
    Slot,
    Journal,
    Data,
    Flush,
}

fn region_of(req: &Req, mem: &MemDevice) -> Region {
    if req.flush {
        return Region::Flush;
    }
    let l = read_superblock(mem).expect("superblock").layout;
    let within = |r: &iomapfs_fs::superblock::Region| req.offset >= r.start && req.offset < r.end();
    if within(&l.journal) {
        Region::Journal
    } else if l.checkpoint_slots.iter().any(within) {
        Region::Slot
    } else if within(&l.data) {
        Region::Data
    } else {
        Region::Superblock
    }
}

fn is_shutdown(e: &Error) -> bool {
    matches!(e.root(), Error::Shutdown { .. })
}

/// Checks one faulted run; `Err` says what broke.
fn check_run(wl: &Workload, mem: &Arc<MemDevice>, run: &Run, stats: &Stats) -> Result<(), String> {
    let failed: Vec<(usize, &Req)> = run.log.iter().enumerate().filter(|(_, r)| !r.ok).collect();
    let Some(&(failed_at, failed_req)) = failed.first() else {
        return Err(
            "the fault never hit: the request order differs from the fault-free run".into(),
        );
    };
    if failed.len() > 1 {
        return Err(format!(
            "{} requests failed, one was injected",
            failed.len()
        ));
    }
    let region = region_of(failed_req, mem);
    stats.add(&format!("failed_{region:?}"), 1);
    if let Some(e) = &run.mount_error {
        if e.to_string().is_empty() || e.errno() != libc::EIO {
            return Err(format!("mount failed without a clear EIO: {e:?}"));
        }
        stats.add("mount_errors", 1);
    } else if failed_at < run.mount_reqs {
        // Only a read of block 0 may fail at mount without failing it: the
        // backup superblock stands in, and the mount says so.
        if region != Region::Superblock || failed_req.write || failed_req.offset != 0 {
            return Err(format!(
                "mount absorbed its failed {region:?} request #{failed_at}: {failed_req:?}"
            ));
        }
        if !run
            .mount_warnings
            .iter()
            .any(|w| w.contains("backup superblock"))
        {
            return Err(format!(
                "mount read the backup superblock without a warning: {:?}",
                run.mount_warnings
            ));
        }
        if let Some(r) = run.results.iter().find(|r| r.error.is_some() || r.skipped) {
            return Err(format!(
                "step {} ({:?}) failed after a mount through the backup: {:?}",
                r.step, wl.steps[r.step], r.error
            ));
        }
        if let Some((s, why)) = &run.live_mismatch {
            return Err(format!(
                "step {s} ({:?}) read wrong bytes: {why}",
                wl.steps[*s]
            ));
        }
        stats.add("superblock_reads_absorbed_by_the_backup", 1);
    } else {
        let Some(at) = run.results.iter().position(|r| r.reqs.contains(&failed_at)) else {
            return Err(format!(
                "request #{failed_at} ({region:?}) failed outside every step"
            ));
        };
        let step = wl.steps[at];
        if let Some(early) = run.results[..at].iter().find(|r| r.error.is_some()) {
            return Err(format!(
                "step {} ({:?}) failed before the faulted request: {:?}",
                early.step, wl.steps[early.step], early.error
            ));
        }
        match &run.results[at].error {
            Some(e) => {
                if e.errno() != libc::EIO || e.to_string().is_empty() {
                    return Err(format!("step {at} ({step:?}): error not a clear EIO: {e:?} ({e})"));
                }
                stats.add("errors_reported", 1);
            }
            None if !failed_req.write && !failed_req.flush => {
                if let Some((s, why)) = &run.live_mismatch {
                    return Err(format!(
                        "a failed read was absorbed by step {at} ({step:?}) but step {s} read wrong bytes: {why}"
                    ));
                }
                stats.add("failed_reads_absorbed", 1);
            }
            None => {
                return Err(format!(
                    "step {at} ({step:?}) returned Ok although its {region:?} request #{failed_at} failed: {failed_req:?}"
                ))
            }
        }
        let later = &run.results[at + 1..];
        let shut = later
            .iter()
            .any(|r| r.error.as_ref().is_some_and(is_shutdown))
            || run.results[at].error.as_ref().is_some_and(is_shutdown);
        // DESIGN.md: a failed commit (journal or checkpoint) shuts down.
        let must_shut = matches!(region, Region::Journal | Region::Slot);
        let may_shut = must_shut || region == Region::Flush;
        if must_shut && !shut && !later.is_empty() && !matches!(step, Unmount) {
            return Err(format!(
                "a failed {region:?} write in step {at} ({step:?}) did not shut the volume down"
            ));
        }
        if shut && !may_shut {
            return Err(format!(
                "a failed {region:?} request in step {at} ({step:?}) shut the volume down"
            ));
        }
        // A writeback error met by a step that is not a sync (a punch, a
        // truncate, a direct read flushing the cache) sticks to its file
        // until an fsync (or sync, unmount) reports it: once more, later.
        let mut sticky_report =
            region == Region::Data && !matches!(step, Fsync(_) | Sync | Checkpoint | Unmount);
        for r in later {
            if r.skipped {
                if !shut {
                    return Err(format!("step {} skipped on a volume that goes on", r.step));
                }
                continue;
            }
            match (&r.error, shut) {
                (Some(e), true) if is_shutdown(e) => {}
                (Some(e), false)
                    if sticky_report
                        && matches!(wl.steps[r.step], Fsync(_) | Sync | Unmount)
                        && e.to_string().contains("writeback") =>
                {
                    sticky_report = false;
                    stats.add("writeback_errors_reported_again_at_sync", 1);
                }
                (Some(e), _) => {
                    return Err(format!(
                        "step {} ({:?}) after the fault in step {at} failed{}: {e}",
                        r.step,
                        wl.steps[r.step],
                        if shut {
                            " but not with Shutdown"
                        } else {
                            " though the volume goes on"
                        }
                    ))
                }
                (None, true) => {
                    return Err(format!(
                        "step {} ({:?}) succeeded on a volume shut down in step {at}",
                        r.step, wl.steps[r.step]
                    ))
                }
                (None, false) => {}
            }
        }
        if let Some((s, why)) = &run.live_mismatch {
            return Err(format!(
                "step {s} ({:?}) read wrong bytes: {why}",
                wl.steps[*s]
            ));
        }
        stats.add(
            if shut {
                "volume_shut_down"
            } else {
                "volume_went_on"
            },
            1,
        );
    }
    // After the run: the device as an unmount left it, then power cuts.
    mem.clear_faults();
    if run.unmounted {
        let dev: Arc<dyn BlockDevice> = mem.clone();
        try_fsck_clean(dev.clone(), "after unmount")?;
        let vol = Volume::open(dev).map_err(|e| format!("remount after unmount: {e}"))?;
        check_volume(&vol, run, true).map_err(|e| format!("after unmount and remount: {e}"))?;
        stats.add("remounts_checked", 1);
    }
    for policy in [
        CutPolicy::KeepNothing,
        CutPolicy::KeepEverything,
        CutPolicy::Seeded(7),
        CutPolicy::TornAll(9),
    ] {
        let dev: Arc<dyn BlockDevice> = Arc::new(cut(mem, policy));
        let ctx = format!("after cut {policy:?}");
        try_fsck_clean(dev.clone(), &ctx)?;
        let vol = Volume::open(dev).map_err(|e| format!("{ctx}: mount: {e}"))?;
        check_volume(&vol, run, false).map_err(|e| format!("{ctx}: {e}"))?;
        stats.add("crash_states_verified", 1);
    }
    Ok(())
}

/// Every modelled path after a remount: present or absent as its name's
/// durability allows, and holding only bytes the model allows. `exact`:
/// after a clean unmount, the live state itself.
fn check_volume(vol: &Volume, run: &Run, exact: bool) -> Result<(), String> {
    for (path, m) in &run.model {
        let present = vol.stat(path).is_ok();
        let name_tainted = m.tainted.iter().any(|r| r.end == u64::MAX && r.start == 0);
        if !name_tainted && m.name_durable && present != m.linked {
            return Err(format!(
                "{path}: {} although its {} was durable",
                if present { "present" } else { "missing" },
                if m.linked { "creation" } else { "unlink" }
            ));
        }
        if !present {
            continue;
        }
        let got = common::volstate::read_file(vol, path, u64::MAX)?.data;
        if exact && m.linked && !name_tainted {
            let mut only_cur = m.clone();
            only_cur.versions = vec![m.cur.clone()];
            only_cur
                .check_recovered(&got)
                .map_err(|e| format!("{path}: {e}"))?;
        } else {
            m.check_recovered(&got)
                .map_err(|e| format!("{path}: {e}"))?;
        }
    }
    Ok(())
}

#[test]
fn every_request_fails_once_in_turn() {
    let t0 = Instant::now();
    let stats = Stats::default();
    let mut failures = Vec::new();
    for wl in WORKLOADS {
        for variant in VARIANTS {
            let mem = fresh_device(variant);
            let before = mem.counters().snapshot();
            let clean = run_workload(wl, &mem);
            let counts = mem.counters().snapshot().since(&before);
            if let Some(e) = &clean.mount_error {
                panic!("{}: fault-free mount failed: {e}", wl.name);
            }
            for r in &clean.results {
                if let Some(e) = &r.error {
                    panic!(
                        "{} ({variant:?}): fault-free step {} ({:?}) failed: {e}",
                        wl.name, r.step, wl.steps[r.step]
                    );
                }
            }
            if let Some((s, why)) = &clean.live_mismatch {
                panic!(
                    "{} ({variant:?}): fault-free step {s} read wrong bytes: {why}",
                    wl.name
                );
            }
            check_run_clean(wl, &mem, &clean);
            for (op, n) in [
                (FaultOp::Read, counts.reads),
                (FaultOp::Write, counts.writes),
                (FaultOp::Flush, counts.flushes),
            ] {
                for i in 0..n {
                    let fault = format!("{} {variant:?}: {op:?} #{i} of {n} fails", wl.name);
                    let r = run_case("fault_sweep", i, &fault, || {
                        catch_unwind(AssertUnwindSafe(|| {
                            let mem = fresh_device(variant);
                            mem.inject(FaultRule::new(op).skip(i).count(1));
                            let run = run_workload(wl, &mem);
                            check_run(wl, &mem, &run, &stats)
                        }))
                    });
                    stats.add("requests_failed", 1);
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => failures.push(format!("{fault}: {e}")),
                        Err(p) => failures.push(format!(
                            "{fault}: PANIC {}",
                            p.downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_default()
                        )),
                    }
                }
            }
        }
    }
    stats.print("fault_sweep", t0.elapsed());
    assert!(
        failures.is_empty(),
        "{} of {} single-request faults mishandled:\n  {}",
        failures.len(),
        stats.get("requests_failed"),
        failures[..failures.len().min(30)].join("\n  ")
    );
}

/// The fault-free run must pass the same post-run checks (a harness that
/// fails everything would prove nothing either).
fn check_run_clean(wl: &Workload, mem: &Arc<MemDevice>, run: &Run) {
    assert!(run.unmounted, "{}: fault-free unmount failed", wl.name);
    let dev: Arc<dyn BlockDevice> = mem.clone();
    try_fsck_clean(dev.clone(), wl.name).unwrap();
    let vol = Volume::open(dev).unwrap();
    check_volume(&vol, run, true).unwrap_or_else(|e| panic!("{}: fault-free: {e}", wl.name));
}
