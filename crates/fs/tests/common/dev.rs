//! Devices for the suites: memory devices, and a tap that lets a test act
//! (cut power, say) just before any write or flush the file system issues.

use std::sync::{Arc, Mutex};

use blockdev::memory::{MemDevice, PendingWrite, Survival};
use blockdev::{
    BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceQueue, OutOfOrderQueue, WriteMode,
};
use iomapfs_fs::{fsck, FormatOptions, Volume};

use super::history::MARKER;
use super::{mix64, Rng, SeedableRng, SmallRng};

/// A sparse image file in a directory of its own, removed on drop (also
/// when the test panics).
pub struct ScratchImage {
    dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl ScratchImage {
    pub fn new(name: &str, size: u64) -> ScratchImage {
        let dir = std::env::temp_dir().join(format!("iomapfs-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("image");
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        ScratchImage { dir, path }
    }
}

impl Drop for ScratchImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub const LBS: u32 = 512;
pub const MIB: u64 = 1 << 20;

/// A memory device filled with the stale-data marker, with a volatile write
/// cache and FUA as asked.
pub fn marked_device(size: u64, fua: bool) -> Arc<MemDevice> {
    let d = MemDevice::with_caps(size, LBS, true, fua);
    d.fill(MARKER);
    Arc::new(d)
}

pub fn dynd(d: &Arc<MemDevice>) -> Arc<dyn BlockDevice> {
    d.clone()
}

pub fn format(dev: Arc<dyn BlockDevice>) {
    Volume::format(dev, &FormatOptions::default()).expect("format");
}

/// Checkpoints until one is a base (a chain holds at most 16 deltas),
/// each after renaming `a` to `b` or back, so that each has a change.
/// Leaves the file under its first name.
pub fn checkpoint_through_a_base(vol: &Volume, a: &str, b: &str) {
    for i in 0..20 {
        let (from, to) = if i % 2 == 0 { (a, b) } else { (b, a) };
        vol.rename(from, to).unwrap();
        vol.checkpoint().unwrap();
    }
}

/// Runs fsck; panics unless it is clean. Returns the report.
pub fn fsck_clean(dev: Arc<dyn BlockDevice>, ctx: &str) -> fsck::FsckReport {
    try_fsck_clean(dev, ctx).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs fsck; `Err` (saying why) unless it is clean.
pub fn try_fsck_clean(dev: Arc<dyn BlockDevice>, ctx: &str) -> Result<fsck::FsckReport, String> {
    match fsck::check(dev) {
        Ok(r) if r.is_clean() => Ok(r),
        Ok(r) => Err(format!(
            "{ctx}: fsck found {} problem(s):\n  {}",
            r.problems.len(),
            r.problems.join("\n  ")
        )),
        Err(e) => Err(format!("{ctx}: fsck could not read the volume: {e}")),
    }
}

/// How a power cut treats the writes that were not durable yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutPolicy {
    /// `power_cut_seeded`: each write lost, kept or torn at random.
    Seeded(u64),
    /// Every pending write lost.
    KeepNothing,
    /// Every pending write kept (a crash right after the writes landed).
    KeepEverything,
    /// Every pending write torn: each logical block kept with probability 1/2.
    TornAll(u64),
    /// The first `n` pending writes kept, the rest lost (an in-order device).
    Prefix(u64),
}

pub fn cut(dev: &MemDevice, policy: CutPolicy) -> MemDevice {
    match policy {
        CutPolicy::Seeded(seed) => dev.power_cut_seeded(seed),
        CutPolicy::KeepNothing => dev.power_cut(&mut |_| Survival::Lost),
        CutPolicy::KeepEverything => dev.power_cut(&mut |_| Survival::Kept),
        CutPolicy::TornAll(seed) => {
            let mut rng = SmallRng::seed_from_u64(seed);
            dev.power_cut(&mut |w: &PendingWrite| {
                Survival::Torn((0..w.blocks()).map(|_| rng.gen_bool(0.5)).collect())
            })
        }
        CutPolicy::Prefix(seed) => {
            let n = dev.pending_writes();
            let keep = if n == 0 {
                0
            } else {
                (mix64(seed) % (n as u64 + 1)) as usize
            };
            dev.power_cut(&mut |w: &PendingWrite| {
                if w.index() < keep {
                    Survival::Kept
                } else {
                    Survival::Lost
                }
            })
        }
    }
}

/// A request the tap is about to forward.
#[derive(Clone, Copy, Debug)]
pub enum Tapped {
    Write { offset: u64, len: u64, fua: bool },
    Flush,
}

pub type TapHook = Box<dyn FnMut(&MemDevice, Tapped) + Send>;

/// Forwards everything to a [`MemDevice`], calling a hook before each write
/// and flush: one workload then yields a crash state at any request.
pub struct TapDevice {
    pub inner: Arc<MemDevice>,
    /// Itself, for the out-of-order queue it builds over its own requests.
    me: std::sync::Weak<TapDevice>,
    /// Seed of its queues' completion order (each queue gets its own).
    queue_seed: u64,
    queues_made: std::sync::atomic::AtomicU64,
    hook: Mutex<Option<TapHook>>,
    /// Test-the-test switch: flushes succeed without reaching the device,
    /// as on a drive that lies about its cache. The crash checks must notice.
    pub lie_about_flush: std::sync::atomic::AtomicBool,
}

impl TapDevice {
    /// Asynchronous queues on it complete requests out of order, seeded by
    /// `queue_seed`; every request (at the moment it completes) reaches the
    /// hook.
    pub fn new(inner: Arc<MemDevice>, queue_seed: u64) -> Arc<TapDevice> {
        Arc::new_cyclic(|me| TapDevice {
            inner,
            me: me.clone(),
            queue_seed,
            queues_made: Default::default(),
            hook: Mutex::new(None),
            lie_about_flush: Default::default(),
        })
    }
    pub fn set_hook(&self, hook: Option<TapHook>) {
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }
    fn tap(&self, what: Tapped) {
        let mut h = self.hook.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = h.as_mut() {
            h(&self.inner, what);
        }
    }
}

impl BlockDevice for TapDevice {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.tap(Tapped::Write {
            offset,
            len: buf.len() as u64,
            fua: mode == WriteMode::Fua,
        });
        self.inner.write_at(buf, offset, mode)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.tap(Tapped::Flush);
        if self
            .lie_about_flush
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        self.inner.flush()
    }
    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }
    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        let Some(me) = self.me.upgrade() else {
            return Ok(None);
        };
        let n = self
            .queues_made
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seed = super::mix64(self.queue_seed.wrapping_add(n));
        Ok(Some(Box::new(OutOfOrderQueue::new(me, depth, seed))))
    }
}

/// One request as a [`RecDevice`] saw it.
#[derive(Clone, Copy, Debug)]
pub struct Req {
    pub write: bool,
    pub flush: bool,
    pub offset: u64,
    pub len: u64,
    pub ok: bool,
}

/// Forwards to a [`MemDevice`] and records every request and its outcome.
pub struct RecDevice {
    pub inner: Arc<MemDevice>,
    pub log: Mutex<Vec<Req>>,
}

impl RecDevice {
    pub fn new(inner: Arc<MemDevice>) -> Arc<RecDevice> {
        Arc::new(RecDevice {
            inner,
            log: Mutex::new(Vec::new()),
        })
    }
    pub fn mark(&self) -> usize {
        self.log.lock().unwrap().len()
    }
    pub fn since(&self, mark: usize) -> Vec<Req> {
        self.log.lock().unwrap()[mark..].to_vec()
    }
    fn rec(&self, r: Req) {
        self.log.lock().unwrap().push(r);
    }
}

impl BlockDevice for RecDevice {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        let r = self.inner.read_at(buf, offset);
        self.rec(Req {
            write: false,
            flush: false,
            offset,
            len: buf.len() as u64,
            ok: r.is_ok(),
        });
        r
    }
    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        let r = self.inner.write_at(buf, offset, mode);
        self.rec(Req {
            write: true,
            flush: false,
            offset,
            len: buf.len() as u64,
            ok: r.is_ok(),
        });
        r
    }
    fn flush(&self) -> Result<(), DeviceError> {
        let r = self.inner.flush();
        self.rec(Req {
            write: false,
            flush: true,
            offset: 0,
            len: 0,
            ok: r.is_ok(),
        });
        r
    }
    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }
}

/// A device and volume geometry: logical block size, and format options
/// (block size from 512 to 16 KiB, sometimes a tiny journal so that it wraps
/// and forces checkpoints often).
#[derive(Clone, Debug)]
pub struct Geometry {
    pub lbs: u32,
    pub opts: FormatOptions,
}

impl Geometry {
    pub fn random(rng: &mut SmallRng) -> Geometry {
        let lbs = if rng.gen_bool(0.75) { 512 } else { 4096 };
        let sizes: Vec<u32> = [512, 1024, 2048, 4096, 4096, 4096, 4096, 8192, 16384]
            .into_iter()
            .filter(|&b| b >= lbs)
            .collect();
        let block_size = sizes[rng.gen_range(0..sizes.len())];
        let journal_bytes = if rng.gen_bool(0.3) {
            // 8..=32 blocks, at least 16 KiB.
            Some((u64::from(block_size) * rng.gen_range(8..=32)).max(16 * 1024))
        } else {
            None
        };
        // Half the volumes keep extents in pages, half of those with index
        // pages. Drawn from a copy, so that every draw after this one (and
        // every recorded seed) is as it was before extent pages existed.
        let mut copy = rng.clone();
        let extent_pages = copy.gen_bool(0.5);
        let page_index = copy.gen_bool(0.5) && extent_pages;
        Geometry {
            lbs,
            opts: FormatOptions {
                block_size,
                journal_bytes,
                checkpoint_slot_bytes: None,
                extent_pages,
                page_index,
                ..FormatOptions::default()
            },
        }
    }

    pub fn default_4k() -> Geometry {
        Geometry {
            lbs: LBS,
            opts: FormatOptions::default(),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "lbs={} block_size={} journal={} slot={} extent_pages={} page_index={}",
            self.lbs,
            self.opts.block_size,
            self.opts
                .journal_bytes
                .map(|j| j.to_string())
                .unwrap_or_else(|| "default".into()),
            self.opts
                .checkpoint_slot_bytes
                .map(|j| j.to_string())
                .unwrap_or_else(|| "default".into()),
            self.opts.extent_pages,
            self.opts.page_index
        )
    }

    /// A marker-filled device of `size` bytes with this geometry, formatted,
    /// whose asynchronous queues complete out of order (seeded by
    /// `queue_seed`).
    pub fn formatted_device(&self, size: u64, fua: bool, queue_seed: u64) -> Arc<MemDevice> {
        let d = MemDevice::with_caps(size, self.lbs, true, fua).with_out_of_order_queue(queue_seed);
        d.fill(MARKER);
        let d = Arc::new(d);
        Volume::format(dynd(&d), &self.opts)
            .unwrap_or_else(|e| panic!("format with {}: {e}", self.describe()));
        d
    }
}

/// A formatted volume's device on an image file of `size` bytes in `dir`,
/// driven through io_uring; `None` (with the reason printed) where io_uring
/// is unavailable, which `IOMAPFS_REQUIRE_PRIVILEGED` turns into a failure.
pub fn uring_volume_device(dir: &std::path::Path, size: u64) -> Option<Arc<dyn BlockDevice>> {
    let path = dir.join("vol.img");
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    let dev = match blockdev::open_device(&path, false, blockdev::Backend::Uring) {
        Ok((dev, _)) => dev,
        Err(e) => {
            if std::env::var_os("IOMAPFS_REQUIRE_PRIVILEGED").is_some() {
                panic!("io_uring unavailable: {e}");
            }
            println!("skipped: io_uring unavailable here: {e}");
            return None;
        }
    };
    assert_eq!(dev.backend_name(), "uring");
    format(dev.clone());
    Some(dev)
}
