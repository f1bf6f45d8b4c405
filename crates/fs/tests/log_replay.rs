//! Log-writes replay of random workloads: every write, flush and mark of a
//! workload is recorded ([`blockdev::LogWritesDevice`]); the log is then
//! replayed onto a copy of the device as formatted, and at every flush
//! point the state must mount, pass fsck and be one the crash model allows
//! (`common/history.rs`) for the moment of that flush — the generic/482
//! method, with this suite's full checker instead of fsck alone.
//!
//! Env: `IOMAPFS_REPLAY_POINTS` (default 3,000 flush points per run),
//! `IOMAPFS_TEST_SEED`, `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use blockdev::memory::MemDevice;
use blockdev::{
    BlockDevice, DeviceCaps, DeviceCounters, DeviceError, LogEntry, LogReader, LogWritesDevice,
    Survival, WriteMode,
};
use common::dev::{try_fsck_clean, Geometry, MIB};
use common::history::Window;
use common::volstate::read_volume;
use common::workload::{Workload, WorkloadCfg};
use common::{env_u64, run_case, watchdog, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomapfs_fs::Volume;

/// Forwards to the recorder; notes the crash-model window at each flush
/// that succeeds, in the order the log holds them.
struct WindowTap {
    inner: Arc<LogWritesDevice>,
    progress: Mutex<Option<Arc<common::history::Progress>>>,
    windows: Mutex<Vec<Window>>,
}

impl BlockDevice for WindowTap {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.inner.write_at(buf, offset, mode)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        // Held across the flush and its log entry: flush entries and
        // windows stay in the same order when threads flush at once.
        let mut windows = self.windows.lock().unwrap();
        self.inner.flush()?;
        let w = self
            .progress
            .lock()
            .unwrap()
            .as_ref()
            .map(|p| p.window())
            .unwrap_or(Window {
                lo: 0,
                completed: 0,
                hi: 0,
            });
        windows.push(w);
        Ok(())
    }
    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }
}

fn replay_case(seed: u64, stats: &Stats) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let fua = rng.gen_bool(0.5);
    let geo = if rng.gen_bool(0.5) {
        Geometry::default_4k()
    } else {
        Geometry::random(&mut rng)
    };
    let size = 8 * MIB;
    let mem = geo.formatted_device(size, fua, rng.gen());
    mem.flush().unwrap();
    let base = mem.power_cut(&mut |_| Survival::Kept);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("run.log");
    let recorder = Arc::new(LogWritesDevice::create(mem.clone(), &log).unwrap());
    let tap = Arc::new(WindowTap {
        inner: recorder.clone(),
        progress: Mutex::new(None),
        windows: Mutex::new(Vec::new()),
    });
    let mut wl = Workload::new(
        tap.clone() as Arc<dyn BlockDevice>,
        SmallRng::seed_from_u64(rng.gen()),
        WorkloadCfg::default(),
    );
    *tap.progress.lock().unwrap() = Some(wl.h.progress.clone());
    let ops = rng.gen_range(20..120);
    for _ in 0..ops {
        assert!(wl.step(), "seed={seed}: {:?}", wl.failed);
        watchdog().beat();
    }
    wl.handles.clear();
    drop(wl.vol.take());
    recorder.flush_log().unwrap();
    let windows = std::mem::take(&mut *tap.windows.lock().unwrap());

    // Replay onto the formatted copy, checking at every flush.
    let mut reader = LogReader::open(&log).unwrap();
    let mut flushes = 0usize;
    let mut entries = 0u64;
    while let Some(entry) = reader.next_entry().unwrap() {
        entry.apply(&base).unwrap();
        entries += 1;
        if entry != LogEntry::Flush {
            continue;
        }
        let w = windows[flushes];
        flushes += 1;
        let ctx = format!(
            "seed={seed} ({}) flush point {flushes} (log entry {}), window lo={} completed={} hi={}",
            geo.describe(),
            entries - 1,
            w.lo,
            w.completed,
            w.hi
        );
        let copy: Arc<dyn BlockDevice> = Arc::new(base.power_cut(&mut |_| Survival::Kept));
        try_fsck_clean(copy.clone(), &ctx).unwrap_or_else(|e| panic!("{e}"));
        let vol = Volume::open(copy).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
        let st = read_volume(&vol, u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        if let Err(e) = wl.h.check(&st, w) {
            panic!("{ctx}:\n{e}");
        }
        stats.add("flush_points_verified", 1);
    }
    assert!(
        reader.tail.is_none(),
        "seed={seed}: log damaged: {:?}",
        reader.tail
    );
    assert_eq!(
        flushes,
        windows.len(),
        "seed={seed}: flush entries vs flushes seen"
    );
    // The full log rebuilds the device exactly.
    assert!(
        base.snapshot() == mem.snapshot(),
        "seed={seed}: replaying the whole log did not rebuild the device"
    );
    stats.add("workloads", 1);
    stats.add("log_entries", entries);
    let _: &MemDevice = &base;
}

#[test]
fn every_flush_point_of_a_recorded_workload_passes_the_crash_model() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("log_replay");
    let target = env_u64("IOMAPFS_REPLAY_POINTS", 3000);
    let stats = Stats::default();
    let mut i = 0;
    loop {
        let seed = seeds.case(i);
        run_case("log_replay", seed, "recorded workload", || {
            replay_case(seed, &stats)
        });
        i += 1;
        if seeds.fixed.is_some() || stats.get("flush_points_verified") >= target {
            break;
        }
    }
    stats.print("log_replay", t0.elapsed());
}
