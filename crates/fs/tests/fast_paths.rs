//! The direct-I/O fast paths, proven by device request counts and by data
//! that a wrong implementation would damage.

mod common;

use std::sync::{Arc, Barrier};

use common::dev::ScratchImage;

use blockdev::{
    BlockDevice, DeviceCaps, DeviceCounters, DeviceError, FaultOp, FaultRule, MemDevice,
    RequestCounts, WriteMode,
};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;
const SECTOR: usize = 512;

fn volume_on(dev: &Arc<MemDevice>) -> Volume {
    dev.fill(b"STALE!!!");
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    Volume::open(dev.clone()).unwrap()
}

fn flags(dsync: bool, sync: bool) -> OpenFlags {
    OpenFlags {
        create: true,
        direct: true,
        dsync,
        sync,
        ..OpenFlags::default()
    }
}

fn counts(dev: &MemDevice) -> RequestCounts {
    dev.counters().snapshot()
}

/// A file with `blocks` written blocks, all durable.
fn written_file(vol: &Volume, path: &str, blocks: usize, f: OpenFlags) -> iomapfs_fs::File {
    let file = vol.open_file(path, f).unwrap();
    let plain = vol.open_file(path, flags(false, false)).unwrap();
    plain.pwrite(&vec![0x11; blocks * BLOCK], 0).unwrap();
    plain.fsync().unwrap();
    file
}

#[test]
fn dsync_pure_overwrite_on_a_fua_device_is_one_fua_write_and_no_flush() {
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, true));
    let vol = volume_on(&dev);
    let f = written_file(&vol, "/db", 8, flags(true, false));
    let before = counts(&dev);
    f.pwrite(&[0xAB; BLOCK], 3 * BLOCK as u64).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!((d.writes, d.fua_writes, d.flushes), (1, 1, 0), "{d:?}");
}

#[test]
fn dsync_pure_overwrite_without_fua_is_one_write_and_one_flush() {
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, false));
    let vol = volume_on(&dev);
    let f = written_file(&vol, "/db", 8, flags(true, false));
    let before = counts(&dev);
    f.pwrite(&[0xAB; BLOCK], 3 * BLOCK as u64).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!((d.writes, d.fua_writes, d.flushes), (1, 0, 1), "{d:?}");
}

#[test]
fn dsync_on_a_device_without_volatile_cache_needs_no_flush() {
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, false, false));
    let vol = volume_on(&dev);
    let f = written_file(&vol, "/db", 8, flags(true, false));
    let before = counts(&dev);
    f.pwrite(&[0xAB; BLOCK], 0).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!((d.writes, d.flushes), (1, 0), "{d:?}");
}

#[test]
fn o_sync_never_takes_the_fua_shortcut() {
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, true));
    let vol = volume_on(&dev);
    let f = written_file(&vol, "/db", 8, flags(false, true));
    let before = counts(&dev);
    f.pwrite(&[0xAB; BLOCK], 0).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!(d.fua_writes, 0, "{d:?}");
    assert!(d.flushes >= 1, "{d:?}");
}

#[test]
fn dsync_write_that_allocates_commits_the_journal() {
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, true));
    let vol = volume_on(&dev);
    let f = vol.open_file("/log", flags(true, false)).unwrap();
    let before = counts(&dev);
    f.pwrite(&[0xAB; BLOCK], 0).unwrap();
    let d = counts(&dev).since(&before);
    // Data (not FUA: it needs metadata), then preflush, journal batch, flush.
    assert_eq!(d.fua_writes, 0, "{d:?}");
    assert!(d.writes >= 2 && d.flushes >= 2, "{d:?}");
}

#[test]
fn dsync_write_into_a_dirty_inode_is_not_metadata_free() {
    // The block was allocated and written by a write whose conversion is not
    // durable yet: FUA of the data alone would leave it unreachable after a
    // crash, so the DSYNC overwrite must commit.
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, true));
    let vol = volume_on(&dev);
    let plain = vol.open_file("/f", flags(false, false)).unwrap();
    plain.pwrite(&[1; BLOCK], 0).unwrap();
    let f = vol.open_file("/f", flags(true, false)).unwrap();
    f.pwrite(&[2; BLOCK], 0).unwrap();
    let cut = dev.power_cut(&mut |_| blockdev::Survival::Lost);
    let vol = Volume::open(Arc::new(cut)).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let mut buf = vec![0; BLOCK];
    assert_eq!(f.pread(&mut buf, 0).unwrap(), BLOCK);
    assert!(buf.iter().all(|&b| b == 2));
}

/// The schedule: writer 0's flush is held in the device; writers 1..N then
/// complete their writes and wait. Their writes completed after flush 1 was
/// issued, so it cannot cover them, but one more flush covers them all:
/// exactly 2 flushes for N DSYNC writes. One flush per write gives N; a
/// writer that trusted the flush already running gives 1 (and loses
/// durability).
#[test]
fn concurrent_dsync_overwriters_share_flushes() {
    const WRITERS: usize = 6;
    let dev = Arc::new(MemDevice::with_caps(16 * MIB, 512, true, false));
    let vol = volume_on(&dev);
    drop(written_file(&vol, "/db", WRITERS, flags(false, false)));
    let first_flush = dev.pause_after(FaultRule::new(FaultOp::Flush));
    let before = counts(&dev);
    let writer = |w: usize| {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let f = vol.open_file("/db", flags(true, false)).unwrap();
            f.pwrite(&[w as u8 + 1; BLOCK], (w * BLOCK) as u64).unwrap();
        })
    };
    let mut threads = vec![writer(0)];
    first_flush.wait_reached();
    threads.extend((1..WRITERS).map(writer));
    // Condition wait, not a sleep: the writers park in the coalescer. Writers
    // that flush on their own never park: fail instead of hanging.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while vol.dsync_flush_waiters() < WRITERS - 1 {
        if std::time::Instant::now() > deadline {
            first_flush.resume();
            panic!(
                "DSYNC writers did not wait for a shared flush ({} waiting)",
                vol.dsync_flush_waiters()
            );
        }
        std::thread::yield_now();
    }
    first_flush.resume();
    for t in threads {
        t.join().unwrap();
    }
    let d = counts(&dev).since(&before);
    assert_eq!(
        d.writes, WRITERS as u64,
        "pure overwrites write data only: {d:?}"
    );
    assert_eq!(d.flushes, 2, "{WRITERS} DSYNC writes: {d:?}");
}

#[test]
fn acknowledged_dsync_writes_survive_power_cuts() {
    // Each way a DSYNC overwrite is made durable: write + shared flush,
    // native FUA, and the kernel's durable write (no flush from us). Some
    // writes are byte-granular (edge read-modify-write).
    #[derive(Clone, Copy, Debug)]
    enum Mode {
        SeparateFlush,
        NativeFua,
        KernelDurable,
    }
    for (mode, seed) in [
        (Mode::SeparateFlush, 1u64),
        (Mode::NativeFua, 2),
        (Mode::KernelDurable, 3),
        (Mode::SeparateFlush, 4),
        (Mode::KernelDurable, 5),
    ] {
        let mem = MemDevice::with_caps(16 * MIB, 512, true, matches!(mode, Mode::NativeFua));
        let dev = Arc::new(match mode {
            Mode::KernelDurable => mem.with_kernel_durable_writes(),
            _ => mem,
        });
        let vol = volume_on(&dev);
        let f = written_file(&vol, "/db", 16, flags(true, false));
        let mut expect = vec![0x11u8; 16 * BLOCK];
        for i in 0..16usize {
            let off = ((i * 7) % 16) * BLOCK + if i % 3 == 0 { 100 } else { 0 };
            let len = if i % 3 == 0 { 700 } else { BLOCK };
            let byte = 0x40 + i as u8;
            let before = counts(&dev);
            f.pwrite(&vec![byte; len], off as u64).unwrap();
            let d = counts(&dev).since(&before);
            let flushes_expected = matches!(mode, Mode::SeparateFlush) as u64;
            assert_eq!(d.flushes, flushes_expected, "{mode:?} write {i}: {d:?}");
            expect[off..off + len].fill(byte);
            let cut = Arc::new(dev.power_cut_seeded(seed * 1000 + i as u64));
            let after = Volume::open(cut).unwrap();
            let g = after.open_file("/db", OpenFlags::default()).unwrap();
            let mut buf = vec![0; 16 * BLOCK];
            assert_eq!(g.pread(&mut buf, 0).unwrap(), 16 * BLOCK);
            assert!(buf == expect, "{mode:?} write {i}: acknowledged data lost");
        }
    }
}

/// Gives up the CPU before every write, so that on a machine with few cores
/// the writers' requests interleave as they would on many.
struct InterleavingDevice(MemDevice);

impl BlockDevice for InterleavingDevice {
    fn caps(&self) -> &DeviceCaps {
        self.0.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        std::thread::yield_now();
        self.0.write_at(buf, offset, mode)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.0.flush()
    }
    fn counters(&self) -> &DeviceCounters {
        self.0.counters()
    }
}

#[test]
fn concurrent_sub_block_writers_never_lose_each_others_bytes() {
    // Blocks alternate written / unwritten (fallocated) / hole. Each thread
    // owns one sector of every block and writes it repeatedly. A first write
    // into an unwritten or new block must zero the rest of the block: done
    // under the shared lock, that zeroing would wipe sectors other threads
    // already wrote. The final check sees every sector's last write.
    const THREADS: usize = BLOCK / SECTOR;
    const BLOCKS: usize = 96;
    // One round: only first writes into fresh blocks zero, and a later
    // round of pure overwrites would repair what a racing zeroing wiped.
    const ROUNDS: usize = 1;
    for trial in 0..8u8 {
        let mem = MemDevice::new(32 * MIB, SECTOR as u32);
        mem.fill(b"STALE!!!");
        let dev = Arc::new(InterleavingDevice(mem));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let setup = vol.open_file("/f", flags(false, false)).unwrap();
        for b in 0..BLOCKS {
            let off = (b * BLOCK) as u64;
            match b % 3 {
                0 => {
                    setup.pwrite(&[0x11; BLOCK], off).unwrap();
                }
                1 => setup.fallocate(off, BLOCK as u64, false).unwrap(),
                _ => {}
            }
        }
        setup.truncate((BLOCKS * BLOCK) as u64).unwrap();
        let barrier = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let vol = vol.clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let d = vol
                        .open_file(
                            "/f",
                            OpenFlags {
                                direct: true,
                                ..OpenFlags::default()
                            },
                        )
                        .unwrap();
                    for round in 0..ROUNDS {
                        // All threads enter each block together, so first
                        // writes into a fresh block race each other.
                        for b in 0..BLOCKS {
                            barrier.wait();
                            let off = (b * BLOCK + t * SECTOR) as u64;
                            let byte = trial.wrapping_mul(64) ^ ((t as u8) << 4 | round as u8);
                            d.pwrite(&[byte; SECTOR], off).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        let mut buf = vec![0; BLOCKS * BLOCK];
        assert_eq!(f.pread(&mut buf, 0).unwrap(), BLOCKS * BLOCK);
        for b in 0..BLOCKS {
            for t in 0..THREADS {
                let want = trial.wrapping_mul(64) ^ ((t as u8) << 4 | (ROUNDS - 1) as u8);
                let at = b * BLOCK + t * SECTOR;
                assert!(
                    buf[at..at + SECTOR].iter().all(|&x| x == want),
                    "trial {trial}: block {b} sector {t} lost its last write: has {:#x} want {want:#x}",
                    buf[at]
                );
            }
        }
        vol.unmount().unwrap();
        let report = iomapfs_fs::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    }
}

/// On a kernel device without FUA (an image file: volatile cache, no FUA),
/// a DSYNC pure overwrite is one durable (`RWF_DSYNC`) write that the kernel
/// completes with its own flush: no flush request from us, no journal.
#[test]
fn dsync_pure_overwrite_on_a_kernel_device_is_one_durable_write() {
    use blockdev::{SyncDevice, SyncOpenOptions};
    let image = ScratchImage::new("dsync-kernel", 64 * MIB);
    let dev = Arc::new(SyncDevice::open(&image.path, SyncOpenOptions::default()).unwrap());
    let caps = dev.caps().clone();
    assert!(caps.volatile_write_cache && !caps.fua && caps.kernel_durable_writes);
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let f = vol.open_file("/db", flags(true, false)).unwrap();
    f.pwrite(&[0x11; 8 * BLOCK], 0).unwrap();
    f.fsync().unwrap();
    let before = dev.counters().snapshot();
    f.pwrite(&[0xAB; BLOCK], 3 * BLOCK as u64).unwrap();
    let d = dev.counters().snapshot().since(&before);
    assert_eq!((d.writes, d.fua_writes, d.flushes), (1, 1, 0), "{d:?}");
    drop(f);
    vol.unmount().unwrap();
}
