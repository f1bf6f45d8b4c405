//! Threads against a model: several threads run random operations at once
//! on the same files, each on byte ranges it owns, and every byte they read
//! is checked against the model (read-your-writes, invariant 5: concurrent
//! I/O to disjoint byte ranges never damages the other's data).
//!
//! Each file is cut into stripes, dealt to the threads in turn: one
//! 40,000-byte region per thread, or many 3,000-byte stripes. Stripe
//! boundaries fall inside device sectors and file-system blocks, so
//! neighbours share blocks: sub-block writes, read-modify-writes, punches
//! and truncates next to a neighbour's bytes all race. Per thread: writes
//! crossing blocks (allocating ones racing pure overwrites), DSYNC writes,
//! asynchronous batches through an I/O queue, reads of its stripes, fsync,
//! punch and fallocate inside a stripe, checkpoints (so commits, DSYNC
//! writes and fsyncs of the other threads run while one is written, and
//! power cuts fall in its middle), and (the last region's owner) truncate. Two files take direct handles, two buffered handles (the folio
//! cache, writeback by fsync).
//!
//! Devices:
//! - the memory device with the out-of-order queue, with power cuts taken
//!   while the threads run (by one of them, between its operations): each
//!   cut state must mount, pass fsck, and hold in every region only bytes
//!   of versions since that region's last fsync that had returned (and
//!   every returned DSYNC write);
//! - a real io_uring ring on an image file: the volume is dropped without
//!   unmount (a killed process), remounted and checked the same way.
//!
//! After the threads: every file is read whole and must equal the model,
//! then after an unmount and a remount too.
//!
//! Env: `IOMAPFS_CONCURRENT_OPS` (default 100,000 operations per run, over
//! every case), `IOMAPFS_TEST_SEED`, `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use blockdev::memory::MemDevice;
use blockdev::{AlignedBuf, BlockDevice};
use common::dev::{try_fsck_clean, uring_volume_device, MIB};
use common::history::{find_marker, tagged, MARKER};
use common::{env_u64, run_case, watchdog, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomapfs_fs::{File, FormatOptions, OpenFlags, Volume};

const THREADS: usize = 4;

/// How a file is dealt to the threads: stripe `k` of thread `t` is file
/// bytes `[(k * THREADS + t) * stripe, +stripe)`. Stripe sizes are not
/// multiples of any block size.
#[derive(Clone, Copy, Debug)]
struct FileSpec {
    path: &'static str,
    direct: bool,
    stripe: u64,
    stripes: u64,
}

impl FileSpec {
    /// Bytes one thread owns.
    fn owned(&self) -> u64 {
        self.stripe * self.stripes
    }

    /// File offset of byte `local` of thread `t`'s share.
    fn abs(&self, t: usize, local: u64) -> u64 {
        let k = local / self.stripe;
        (k * THREADS as u64 + t as u64) * self.stripe + local % self.stripe
    }

    /// One region per thread: the last owner may truncate inside its own.
    fn truncatable(&self) -> bool {
        self.stripes == 1
    }
}

const FILES: [FileSpec; 4] = [
    FileSpec {
        path: "/d0",
        direct: true,
        stripe: 40_000,
        stripes: 1,
    },
    FileSpec {
        path: "/d1",
        direct: true,
        stripe: 3000,
        stripes: 12,
    },
    FileSpec {
        path: "/buf",
        direct: false,
        stripe: 40_000,
        stripes: 1,
    },
    FileSpec {
        path: "/buf1",
        direct: false,
        stripe: 3000,
        stripes: 12,
    },
];
const OPS_PER_THREAD: usize = 250;
const MAX_WRITE: u64 = 12_000;

/// What one thread knows of its region of one file.
#[derive(Clone, Default)]
struct RegionModel {
    cur: Vec<u8>,
    /// Every content the region had, in order; `versions[0]` is all zeros.
    versions: Vec<Arc<Vec<u8>>>,
    /// `(end_seq, version index at its start)` of every returned fsync.
    fsyncs: Vec<(u64, usize)>,
    /// `(end_seq, range of the share, version index after it)` of every
    /// returned DSYNC write.
    floors: Vec<(u64, std::ops::Range<usize>, usize)>,
    /// File offset of the end of the thread's highest write.
    written_end: u64,
    /// The file size as the last region's owner set it.
    tail_size: Option<u64>,
}

impl RegionModel {
    fn new(spec: &FileSpec) -> RegionModel {
        let zero = vec![0u8; spec.owned() as usize];
        RegionModel {
            versions: vec![Arc::new(zero.clone())],
            cur: zero,
            ..RegionModel::default()
        }
    }

    fn push_version(&mut self) {
        self.versions.push(Arc::new(self.cur.clone()));
    }

    /// Checks the region as a power cut at `cut_seq` left it (`got`: the
    /// region's bytes, zeros past EOF).
    fn check_cut(&self, got: &[u8], cut_seq: u64) -> Result<(), String> {
        let durable = self
            .fsyncs
            .iter()
            .rev()
            .find(|(end, _)| *end < cut_seq)
            .map(|&(_, v)| v)
            .unwrap_or(0);
        for (x, &b) in got.iter().enumerate() {
            let lo = self
                .floors
                .iter()
                .filter(|(end, r, _)| *end < cut_seq && r.contains(&x))
                .map(|&(_, _, v)| v)
                .max()
                .unwrap_or(0)
                .max(durable);
            if !self.versions[lo..].iter().any(|v| v[x] == b) {
                return Err(format!(
                    "byte {x} of the region = {b:#04x}: no version since the last durable one \
                     (#{lo} of {}) holds it there (durable: {:#04x})",
                    self.versions.len(),
                    self.versions[lo][x]
                ));
            }
        }
        Ok(())
    }
}

/// One thread's models, one per file.
type ThreadModel = Vec<RegionModel>;

/// A power cut taken while the threads ran.
struct Cut {
    dev: MemDevice,
    seq: u64,
}

struct Shared {
    vol: Volume,
    seq: AtomicU64,
    /// `Some`: the memory device under the volume, to cut.
    mem: Option<Arc<MemDevice>>,
    cuts: Mutex<Vec<Cut>>,
    stats: Stats,
}

fn flags(direct: bool, dsync: bool) -> OpenFlags {
    OpenFlags {
        create: true,
        direct,
        dsync,
        ..OpenFlags::default()
    }
}

/// A random range inside one of the thread's stripes: `(offset in the
/// thread's share, file offset, len)`.
fn pick_range(rng: &mut SmallRng, spec: &FileSpec, t: usize, max: u64) -> (usize, u64, u64) {
    let local = rng.gen_range(0..spec.owned());
    let left_in_stripe = spec.stripe - local % spec.stripe;
    let len = rng.gen_range(1..=max.min(left_in_stripe));
    (local as usize, spec.abs(t, local), len)
}

/// The file-system block size of the volumes here (the default format).
const FS_BLOCK: u64 = 4096;

/// `(local, off, _)` from [`pick_range`] moved to the whole file-system
/// blocks that follow it inside its stripe, if any fit: such direct writes
/// allocate and convert under the shared lock, beside the other threads'.
fn snap_to_blocks(
    rng: &mut SmallRng,
    spec: &FileSpec,
    (local, off, _): (usize, u64, u64),
) -> Option<(usize, u64, u64)> {
    let stripe_end = off + (spec.stripe - local as u64 % spec.stripe);
    let start = off.next_multiple_of(FS_BLOCK);
    let blocks = stripe_end.saturating_sub(start) / FS_BLOCK;
    if blocks == 0 {
        return None;
    }
    let len = rng.gen_range(1..=blocks.min(3)) * FS_BLOCK;
    Some((local + (start - off) as usize, start, len))
}

struct Worker {
    t: usize,
    rng: SmallRng,
    shared: Arc<Shared>,
    handles: Vec<File>,
    model: ThreadModel,
    next_tag: u64,
    failure: Option<String>,
}

impl Worker {
    fn seq(&self) -> u64 {
        self.shared.seq.fetch_add(1, Ordering::SeqCst)
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        (self.t as u64 + 1) << 32 | self.next_tag
    }

    fn fail(&mut self, what: String) {
        if self.failure.is_none() {
            self.failure = Some(format!("thread {}: {what}", self.t));
        }
    }

    fn is_tail(&self, f: usize) -> bool {
        FILES[f].truncatable() && self.t == THREADS - 1
    }

    fn apply_write(&mut self, f: usize, local: usize, off: u64, data: &[u8]) {
        let tail = self.is_tail(f);
        let m = &mut self.model[f];
        m.cur[local..local + data.len()].copy_from_slice(data);
        let end = off + data.len() as u64;
        m.written_end = m.written_end.max(end);
        if tail {
            m.tail_size = Some(m.tail_size.unwrap_or(0).max(end));
        }
        m.push_version();
    }

    fn op(&mut self) {
        let f = self.rng.gen_range(0..FILES.len());
        let direct = FILES[f].direct;
        let roll = self.rng.gen_range(0..100);
        match roll {
            0..=39 => {
                let dsync = direct && self.rng.gen_bool(0.15);
                self.write(f, dsync)
            }
            40..=49 if direct => self.aio_batch(f),
            40..=64 => self.read(f),
            65..=74 => self.fsync(f),
            75..=82 => self.punch(f),
            83..=89 => self.fallocate(f),
            90..=95 if self.is_tail(f) => self.truncate(f),
            96..=97 => self.checkpoint(),
            _ => self.read(f),
        }
    }

    fn write(&mut self, f: usize, dsync: bool) {
        let mut picked = pick_range(&mut self.rng, &FILES[f], self.t, MAX_WRITE);
        let mut aligned = false;
        if self.rng.gen_bool(0.3) {
            if let Some(blocks) = snap_to_blocks(&mut self.rng, &FILES[f], picked) {
                (picked, aligned) = (blocks, true);
            }
        }
        let (local, off, len) = picked;
        let tag = self.tag();
        let data = tagged(tag, off, len as usize);
        let r = if dsync {
            self.shared
                .vol
                .open_file(FILES[f].path, flags(true, true))
                .and_then(|h| h.pwrite(&data, off))
        } else {
            self.handles[f].pwrite(&data, off)
        };
        match r {
            Ok(n) if n == data.len() => {}
            Ok(n) => {
                return self.fail(format!(
                    "{}: write [{off}, +{len}) wrote {n}",
                    FILES[f].path
                ))
            }
            Err(e) => return self.fail(format!("{}: write [{off}, +{len}): {e}", FILES[f].path)),
        }
        self.apply_write(f, local, off, &data);
        if dsync {
            let end = self.seq();
            let m = &mut self.model[f];
            let v = m.versions.len() - 1;
            m.floors.push((end, local..local + len as usize, v));
        }
        self.shared
            .stats
            .add(if dsync { "dsync_writes" } else { "writes" }, 1);
        if aligned {
            self.shared.stats.add("whole_block_writes", 1);
        }
    }

    fn aio_batch(&mut self, f: usize) {
        let mut q = match self.shared.vol.io_queue(8) {
            Ok(q) => q,
            Err(e) => return self.fail(format!("io_queue: {e}")),
        };
        let mut writes: Vec<(usize, u64, Vec<u8>)> = Vec::new();
        for _ in 0..self.rng.gen_range(1..=4) {
            let (local, off, len) = pick_range(&mut self.rng, &FILES[f], self.t, 8192);
            let overlaps = writes
                .iter()
                .any(|(_, a, d)| off < a + d.len() as u64 && *a < off + len);
            if overlaps {
                continue;
            }
            let tag = self.tag();
            writes.push((local, off, tagged(tag, off, len as usize)));
        }
        for (token, (_, off, data)) in writes.iter().enumerate() {
            let mut buf = AlignedBuf::new(data.len(), 512).expect("buffer");
            buf.copy_from_slice(data);
            if let Err(r) = q.submit_write(&self.handles[f], *off, buf, token as u64) {
                return self.fail(format!("aio submit at {off}: {}", r.1));
            }
        }
        let mut done = Vec::new();
        while q.in_flight() > 0 {
            if let Err(e) = q.reap(1, &mut done) {
                return self.fail(format!("aio reap: {e}"));
            }
        }
        for c in done {
            let (_, off, data) = &writes[c.token as usize];
            match c.result {
                Ok(n) if n == data.len() => {}
                other => {
                    return self.fail(format!(
                        "{}: async write at {off} of {}: {:?}",
                        FILES[f].path,
                        data.len(),
                        other.map_err(|e| e.to_string())
                    ))
                }
            }
        }
        for (local, off, data) in writes {
            self.apply_write(f, local, off, &data);
        }
        self.shared.stats.add("async_batches", 1);
    }

    fn read(&mut self, f: usize) {
        let (local, off, len) = pick_range(&mut self.rng, &FILES[f], self.t, 16_384);
        let mut buf = vec![0u8; len as usize];
        let n = match self.handles[f].pread(&mut buf, off) {
            Ok(n) => n as u64,
            Err(e) => return self.fail(format!("{}: read [{off}, +{len}): {e}", FILES[f].path)),
        };
        let tail = self.is_tail(f);
        let m = &self.model[f];
        // The size is at least this thread's own writes' end, and other
        // threads may have raised it; inside the last region of a file
        // with one region per thread, its owner alone sets the size.
        let (min_n, max_n) = match m.tail_size {
            Some(size) if tail => {
                let n = size.saturating_sub(off).min(len);
                (n, n)
            }
            _ if tail => (0, 0),
            _ => (m.written_end.saturating_sub(off).min(len), len),
        };
        if n < min_n || n > max_n {
            return self.fail(format!(
                "{}: read [{off}, +{len}) returned {n} bytes, want {min_n}..={max_n}",
                FILES[f].path
            ));
        }
        let want = &m.cur[local..local + n as usize];
        if &buf[..n as usize] != want {
            let at = common::first_diff(&buf[..n as usize], want).unwrap_or(0);
            return self.fail(format!(
                "{}: read [{off}, +{len}): byte {} = {:#04x}, want {:#04x} ({})",
                FILES[f].path,
                off + at as u64,
                buf[at],
                want[at],
                common::history::attribute(&buf, at, u64::MAX)
            ));
        }
        self.shared.stats.add("reads_checked", 1);
    }

    /// Not counted as an fsync in the model: what it makes durable is only
    /// checked as far as the fsyncs around it vouch for.
    fn checkpoint(&mut self) {
        if let Err(e) = self.shared.vol.checkpoint() {
            return self.fail(format!("checkpoint: {e}"));
        }
        self.shared.stats.add("checkpoints", 1);
    }

    fn fsync(&mut self, f: usize) {
        let v = self.model[f].versions.len() - 1;
        if let Err(e) = self.handles[f].fsync() {
            return self.fail(format!("{}: fsync: {e}", FILES[f].path));
        }
        let end = self.seq();
        self.model[f].fsyncs.push((end, v));
        self.shared.stats.add("fsyncs", 1);
    }

    fn punch(&mut self, f: usize) {
        let (local, off, len) = pick_range(&mut self.rng, &FILES[f], self.t, 3 * 4096);
        if let Err(e) = self.handles[f].punch_hole(off, len) {
            return self.fail(format!("{}: punch [{off}, +{len}): {e}", FILES[f].path));
        }
        let m = &mut self.model[f];
        m.cur[local..local + len as usize].fill(0);
        m.push_version();
        self.shared.stats.add("punches", 1);
    }

    fn fallocate(&mut self, f: usize) {
        let (_, off, len) = pick_range(&mut self.rng, &FILES[f], self.t, 3 * 4096);
        if let Err(e) = self.handles[f].fallocate(off, len, true) {
            return self.fail(format!("{}: fallocate [{off}, +{len}): {e}", FILES[f].path));
        }
        self.shared.stats.add("fallocates", 1);
    }

    /// Only the last region's owner: the size moves inside its region.
    fn truncate(&mut self, f: usize) {
        let spec = FILES[f];
        let rs = spec.abs(self.t, 0);
        let size = rs + self.rng.gen_range(0..=spec.stripe);
        if let Err(e) = self.handles[f].truncate(size) {
            return self.fail(format!("{}: truncate to {size}: {e}", spec.path));
        }
        let m = &mut self.model[f];
        m.cur[(size - rs) as usize..].fill(0);
        m.written_end = m.written_end.min(size);
        m.tail_size = Some(size);
        m.push_version();
        self.shared.stats.add("truncates", 1);
    }

    /// Thread 0 takes a power cut of the device every so often.
    fn maybe_cut(&mut self) {
        let Some(mem) = self.shared.mem.clone() else {
            return;
        };
        if self.t != 0 || !self.rng.gen_bool(0.04) {
            return;
        }
        let seq = self.seq();
        let dev = mem.power_cut_seeded(self.rng.gen());
        self.shared.cuts.lock().unwrap().push(Cut { dev, seq });
    }
}

/// Reads each thread's share of each file (zeros past EOF).
fn read_regions(vol: &Volume) -> Result<Vec<Vec<Vec<u8>>>, String> {
    let mut out = vec![Vec::new(); THREADS];
    for spec in FILES {
        let data = match vol.open_file(spec.path, common::volstate::ro()) {
            Ok(_) => common::volstate::read_file(vol, spec.path, u64::MAX)?.data,
            Err(_) => Vec::new(),
        };
        if let Some(at) = find_marker(&data) {
            return Err(format!(
                "{}: stale device bytes ({MARKER:?}) at {at}",
                spec.path
            ));
        }
        for (t, shares) in out.iter_mut().enumerate() {
            let share = (0..spec.owned())
                .map(|local| data.get(spec.abs(t, local) as usize).copied().unwrap_or(0))
                .collect();
            shares.push(share);
        }
    }
    Ok(out)
}

fn check_state(vol: &Volume, models: &[ThreadModel], cut_seq: u64) -> Result<(), String> {
    let regions = read_regions(vol)?;
    for (t, m) in models.iter().enumerate() {
        for (f, rm) in m.iter().enumerate() {
            rm.check_cut(&regions[t][f], cut_seq)
                .map_err(|e| format!("{}, share of thread {t}: {e}", FILES[f].path))?;
        }
    }
    Ok(())
}

/// The live volume against the final models, exactly.
fn check_exact(vol: &Volume, models: &[ThreadModel]) -> Result<(), String> {
    for (f, spec) in FILES.iter().enumerate() {
        let data = common::volstate::read_file(vol, spec.path, u64::MAX)?.data;
        let size = models[THREADS - 1][f]
            .tail_size
            .unwrap_or_else(|| models.iter().map(|m| m[f].written_end).max().unwrap_or(0));
        if data.len() as u64 != size {
            return Err(format!("{}: size {} want {size}", spec.path, data.len()));
        }
        for (t, m) in models.iter().enumerate() {
            for local in 0..spec.owned() {
                let at = spec.abs(t, local) as usize;
                let want = m[f].cur[local as usize];
                let got = data.get(at).copied().unwrap_or(0);
                if got != want {
                    return Err(format!(
                        "{}: thread {t}'s byte at {at} = {got:#04x}, want {want:#04x} ({})",
                        spec.path,
                        common::history::attribute(&data, at, u64::MAX)
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Runs the threads on `vol`; returns the models and the cuts taken.
fn run_threads(
    seed: u64,
    vol: Volume,
    mem: Option<Arc<MemDevice>>,
    stats: &Stats,
) -> (Vec<ThreadModel>, Vec<Cut>, Arc<Shared>) {
    let shared = Arc::new(Shared {
        vol,
        seq: AtomicU64::new(1),
        mem,
        cuts: Mutex::new(Vec::new()),
        stats: Stats::default(),
    });
    for spec in FILES {
        shared
            .vol
            .open_file(spec.path, flags(spec.direct, false))
            .expect("create");
    }
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let shared = shared.clone();
            thread::spawn(move || {
                let handles = FILES
                    .iter()
                    .map(|spec| {
                        shared
                            .vol
                            .open_file(spec.path, flags(spec.direct, false))
                            .unwrap()
                    })
                    .collect();
                let mut w = Worker {
                    t,
                    rng: SmallRng::seed_from_u64(common::mix64(seed ^ t as u64)),
                    shared,
                    handles,
                    model: FILES.iter().map(RegionModel::new).collect(),
                    next_tag: 0,
                    failure: None,
                };
                for _ in 0..OPS_PER_THREAD {
                    w.op();
                    w.shared.stats.add("ops", 1);
                    if w.failure.is_some() {
                        break;
                    }
                    w.maybe_cut();
                    watchdog().beat();
                }
                (w.model, w.failure)
            })
        })
        .collect();
    let mut models = Vec::new();
    let mut failures = Vec::new();
    for w in workers {
        let (m, f) = w.join().expect("worker panicked");
        models.push(m);
        failures.extend(f);
    }
    assert!(failures.is_empty(), "seed={seed}: {}", failures.join("\n"));
    for name in [
        "ops",
        "writes",
        "whole_block_writes",
        "dsync_writes",
        "async_batches",
        "reads_checked",
        "fsyncs",
        "checkpoints",
        "punches",
        "fallocates",
        "truncates",
    ] {
        stats.add(name, shared.stats.get(name));
    }
    let cuts = std::mem::take(&mut *shared.cuts.lock().unwrap());
    (models, cuts, shared)
}

/// After the threads: exact state live, then unmount + remount exact.
fn check_after(seed: u64, shared: Arc<Shared>, models: &[ThreadModel], dev: Arc<dyn BlockDevice>) {
    check_exact(&shared.vol, models)
        .unwrap_or_else(|e| panic!("seed={seed}: live, after the threads: {e}"));
    let vol = Arc::try_unwrap(shared)
        .ok()
        .expect("no other owner of the shared state")
        .vol;
    vol.unmount()
        .unwrap_or_else(|e| panic!("seed={seed}: unmount: {e}"));
    try_fsck_clean(dev.clone(), "after unmount").unwrap_or_else(|e| panic!("seed={seed}: {e}"));
    let vol = Volume::open(dev).unwrap();
    check_exact(&vol, models)
        .unwrap_or_else(|e| panic!("seed={seed}: after unmount and remount: {e}"));
}

fn memory_case(seed: u64, stats: &Stats) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let fua = rng.gen_bool(0.5);
    let lbs = if rng.gen_bool(0.5) { 512 } else { 4096 };
    let mem = MemDevice::with_caps(64 * MIB, lbs, true, fua).with_out_of_order_queue(rng.gen());
    mem.fill(MARKER);
    let mem = Arc::new(mem);
    let dev: Arc<dyn BlockDevice> = mem.clone();
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let (models, cuts, shared) = run_threads(seed, vol, Some(mem.clone()), stats);
    for (i, cut) in cuts.into_iter().enumerate() {
        let ctx = format!(
            "seed={seed} (lbs {lbs}, fua {fua}) cut #{i} at seq {}",
            cut.seq
        );
        let cdev: Arc<dyn BlockDevice> = Arc::new(cut.dev);
        try_fsck_clean(cdev.clone(), &ctx).unwrap_or_else(|e| panic!("{e}"));
        let vol = Volume::open(cdev).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
        check_state(&vol, &models, cut.seq).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        stats.add("power_cuts_verified", 1);
    }
    check_after(seed, shared, &models, dev);
}

fn uring_case(seed: u64, stats: &Stats) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let Some(dev) = uring_volume_device(dir.path(), 64 * MIB) else {
        return false;
    };
    let vol = Volume::open(dev.clone()).unwrap();
    let (models, _, shared) = run_threads(seed, vol, None, stats);
    // A killed process: no unmount, no sync. Everything that completed is
    // in the image file; recovery must come up in a state the model allows.
    check_exact(&shared.vol, &models)
        .unwrap_or_else(|e| panic!("seed={seed} (io_uring): live: {e}"));
    drop(shared);
    try_fsck_clean(dev.clone(), "io_uring, after a kill")
        .unwrap_or_else(|e| panic!("seed={seed}: {e}"));
    let vol = Volume::open(dev.clone()).unwrap();
    check_state(&vol, &models, u64::MAX)
        .unwrap_or_else(|e| panic!("seed={seed} (io_uring) after a kill and remount: {e}"));
    drop(vol);
    stats.add("uring_cases", 1);
    true
}

#[test]
fn threads_on_shared_files_match_the_model() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("concurrent_model");
    let target = env_u64("IOMAPFS_CONCURRENT_OPS", 100_000);
    let stats = Stats::default();
    let mut i = 0;
    loop {
        let seed = seeds.case(i);
        run_case(
            "concurrent_model",
            seed,
            "threads on the memory device",
            || memory_case(seed, &stats),
        );
        i += 1;
        if seeds.fixed.is_some() || stats.get("ops") >= target {
            break;
        }
    }
    stats.print(
        "concurrent_model (memory, out-of-order queue)",
        t0.elapsed(),
    );
}

#[test]
fn threads_through_io_uring_match_the_model() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("concurrent_model");
    let stats = Stats::default();
    for i in 0..seeds.count(2) {
        let seed = seeds.case(i);
        let ran = run_case("concurrent_model", seed, "threads on io_uring", || {
            uring_case(seed, &stats)
        });
        if !ran {
            return;
        }
    }
    stats.print("concurrent_model (io_uring)", t0.elapsed());
}
