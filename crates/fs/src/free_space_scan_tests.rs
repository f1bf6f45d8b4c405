//! Tests of free space rebuilt after mount by a background scan
//! ([`crate::free_space`]): what it installs equals the synchronous build,
//! frees while it runs are applied once, allocations wait for it, it
//! joins at unmount, a power cut while it runs loses nothing, and a scan
//! that finds corruption refuses allocations.
//!
//! Here rather than in `free_space` or `mount`: they drive whole volumes,
//! and `volume` imports `mount`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use blockdev::memory::{FaultOp, FaultRule, MemDevice, PendingWrite, Survival};
use blockdev::BlockDevice;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::alloc::Allocator;
use crate::free_space::{Claim, ScanHook, ScanPoint};
use crate::mount::{self, build_allocator, used_pages, Strictness};
use crate::types::Record;
use crate::volume::{FormatOptions, MountOptions, Volume};
use crate::{Error, OpenFlags};

const DIRECT: OpenFlags = OpenFlags {
    create: true,
    exclusive: false,
    truncate: false,
    direct: true,
    dsync: false,
    sync: false,
    read_only: false,
};

fn quiet() -> MountOptions {
    MountOptions::foreground_only()
}

/// A scan held at [`ScanPoint::Start`] until `release`; `installing` is
/// set when it reaches [`ScanPoint::BeforeInstall`].
struct Held {
    opts: MountOptions,
    release: Mutex<Option<mpsc::Sender<()>>>,
    installing: Arc<AtomicBool>,
}

impl Held {
    fn new() -> Held {
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Mutex::new(rx);
        let on_cancel = Mutex::new(tx.clone());
        let installing = Arc::new(AtomicBool::new(false));
        let seen = installing.clone();
        let hook = ScanHook(Arc::new(move |point| match point {
            // Returns once released, or cancelled.
            ScanPoint::Start => drop(rx.lock().unwrap().recv()),
            ScanPoint::BeforeInstall => seen.store(true, Ordering::SeqCst),
            ScanPoint::Cancelled => drop(on_cancel.lock().unwrap().send(())),
            ScanPoint::Finished => {}
        }));
        Held {
            opts: MountOptions {
                free_space_scan_hook: Some(hook),
                ..quiet()
            },
            release: Mutex::new(Some(tx)),
            installing,
        }
    }

    fn release(&self) {
        if let Some(tx) = self.release.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }
}

/// The allocator a synchronous mount of `dev` would have: fsck's load
/// (which builds it with `build_allocator`), space replay freed held busy,
/// orphans freed as mount frees them.
fn synchronous(dev: &Arc<MemDevice>) -> Allocator {
    let dev: Arc<dyn BlockDevice> = dev.clone();
    let loaded = mount::load(&dev, Strictness::Mount).unwrap();
    let mut alloc = loaded.alloc;
    for &(seq, addr, len) in &loaded.replay_freed {
        alloc.hold_busy(addr, len, seq).unwrap();
    }
    let mut state = loaded.state;
    let orphans = mount::orphans(&state);
    for (seq, ino) in (loaded.replay_end.next_seq..).zip(orphans) {
        let mut freed = Vec::new();
        state.apply(&Record::FreeInode { ino }, &mut freed).unwrap();
        for (addr, len) in freed {
            alloc.free(addr, len, seq).unwrap();
        }
    }
    alloc
}

/// The installed allocator, once the scan is done.
fn installed(vol: &Volume) -> Allocator {
    vol.wait_free_space().unwrap();
    let meta = vol.inner.meta.read();
    let alloc = meta.alloc.allocator().unwrap().clone();
    alloc.check().unwrap();
    alloc
}

/// Free space as the volume's current layout says: data area minus every
/// extent, spill extent and page in use now.
fn rebuilt_now(vol: &Volume) -> Allocator {
    let commit = vol.inner.commit.lock();
    let meta = vol.inner.meta.read();
    build_allocator(
        &vol.inner.sb,
        &meta.state,
        &commit.spills,
        &used_pages(
            &vol.inner.sb,
            &commit.pages.clone().map(|t| (*t).clone()),
            &commit.index.clone().map(|t| (*t).clone()),
        ),
    )
    .unwrap()
}

/// Free and busy space together, coalesced: what `rebuilt_now` calls free.
fn free_or_busy(alloc: &Allocator) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = alloc.free_extents();
    ranges.extend(alloc.busy_ranges().into_iter().map(|(a, l, _)| (a, l)));
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, l) in ranges {
        match out.last_mut() {
            Some((pa, pl)) if *pa + *pl == a => *pl += l,
            _ => out.push((a, l)),
        }
    }
    out
}

/// A random volume left without unmount: files written in scattered
/// blocks, some punched, truncated or unlinked (one of them while open:
/// an orphan), checkpoints now and then, everything fsynced, so the next
/// mount replays a journal with frees. Half with extent pages, some with
/// slots small enough to spill.
fn random_volume(seed: u64) -> Arc<MemDevice> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let block_size = if rng.gen_bool(0.5) { 512 } else { 4096 };
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let extent_pages = rng.gen_bool(0.5);
    let opts = FormatOptions {
        block_size,
        extent_pages,
        // Not drawn: the seeds' volumes stay what they were.
        page_index: extent_pages && seed.is_multiple_of(2),
        checkpoint_slot_bytes: rng.gen_bool(0.3).then_some(64 << 10),
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    let bs = u64::from(block_size);
    let mut files = Vec::new();
    for i in 0..rng.gen_range(2..6) {
        let f = vol.open_file(&format!("/f{i}"), DIRECT).unwrap();
        let blocks = rng.gen_range(20..400u64);
        for _ in 0..blocks {
            let at = rng.gen_range(0..2 * blocks) * bs;
            f.pwrite(&vec![i as u8 + 1; bs as usize], at).unwrap();
        }
        files.push(f);
        if rng.gen_bool(0.3) {
            vol.checkpoint().unwrap();
        }
    }
    for (i, f) in files.iter().enumerate() {
        let size = f.stat().unwrap().size;
        match rng.gen_range(0..4) {
            0 => f.punch_hole(rng.gen_range(0..size / 2), size / 3).unwrap(),
            1 => f.truncate(size / 2).unwrap(),
            2 => vol.unlink(&format!("/f{i}")).unwrap(),
            _ => {}
        }
        f.fsync().unwrap();
    }
    vol.sync().unwrap();
    // Not unmounted: the open, unlinked files are orphans at the next
    // mount, and the frees since the last checkpoint are replayed.
    drop(files);
    drop(vol);
    dev
}

/// What the background scan installs is the allocator a synchronous mount
/// builds, busy ranges and all, on random volumes (journal replay with
/// frees, orphans, extent pages, spilled images).
#[test]
fn the_background_scan_installs_what_a_synchronous_mount_builds() {
    for seed in 0..24 {
        let dev = random_volume(seed);
        let want = synchronous(&dev);
        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        let got = installed(&vol);
        assert_eq!(got.free_extents(), want.free_extents(), "seed {seed}");
        assert_eq!(got.busy_ranges(), want.busy_ranges(), "seed {seed}");
        assert!(
            seed > 0 || !got.busy_ranges().is_empty(),
            "replay frees something"
        );
        assert_eq!(free_or_busy(&got), rebuilt_now(&vol).free_extents());
    }
}

/// Clears the free-space hint a clean unmount left, keeping its mark:
/// mount then has no reserve to allocate from while its scan runs.
fn drop_free_hint(dev: &Arc<MemDevice>) {
    let mut sb = crate::superblock::read_superblock(&**dev).unwrap();
    assert!(
        sb.clean_mark.is_some() && !sb.free_hint.is_empty(),
        "{sb:?}"
    );
    sb.free_hint.clear();
    crate::superblock::write_superblock(&**dev, &sb).unwrap();
}

/// An allocating write of `file` run on another thread, so that a write
/// that waits for a held scan fails the test instead of hanging it.
fn allocate_apart(file: crate::File, off: u64) -> mpsc::Receiver<crate::Result<usize>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || drop(tx.send(file.pwrite(&[7u8; 4096], off))));
    rx
}

/// The extents writeback of delayed allocations may add past one per
/// range are bounded by the blocks reserved, and by the free ranges only
/// once the scan installed its allocator: while it runs, the clean
/// unmount's reserve allocates, but writeback will take from the scanned
/// free space, which the reserve's few ranges do not bound.
#[test]
fn delayed_ranges_during_the_scan_are_bounded_without_the_reserves_ranges() {
    const BLOCKS: u64 = 100;
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    // Free space in more pieces than the hint keeps (16): one-block files,
    // every other one removed.
    for i in 0..80 {
        let f = vol.open_file(&format!("/f{i}"), DIRECT).unwrap();
        f.pwrite(&[1; 4096], 0).unwrap();
    }
    for i in (0..80).step_by(2) {
        vol.unlink(&format!("/f{i}")).unwrap();
    }
    vol.unmount().unwrap();

    let held = Held::new();
    let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
    let buffered = OpenFlags {
        direct: false,
        ..DIRECT
    };
    let file = vol.open_file("/late", buffered).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let wrote = (0..BLOCKS).try_for_each(|k| file.pwrite(&[2; 4096], k * 4096).map(drop));
        drop(tx.send(wrote));
    });
    let wrote = rx.recv_timeout(std::time::Duration::from_secs(60));
    if wrote.is_err() {
        held.release();
    }
    wrote
        .expect("the buffered writes waited for the held scan")
        .unwrap();
    let (during, reserve_ranges) = {
        let meta = vol.inner.meta.read();
        assert_eq!(meta.delalloc_reserved, BLOCKS * 4096);
        let reserve = meta.alloc.allocator().unwrap().free_extent_count() as u64;
        (meta.fragmentation_extents(), reserve)
    };
    assert!(
        reserve_ranges < BLOCKS,
        "the reserve has {reserve_ranges} ranges"
    );
    assert_eq!(during, BLOCKS, "bounded by the reserve's ranges");
    held.release();
    vol.wait_free_space().unwrap();
    let meta = vol.inner.meta.read();
    let ranges = meta.alloc.allocator().unwrap().free_extent_count() as u64;
    assert!(ranges > 16, "free space in {ranges} ranges");
    assert_eq!(meta.fragmentation_extents(), BLOCKS.min(ranges));
}

/// Punch, truncate, unlink and a checkpoint while the scan is held: mount
/// returned, reads and overwrites go on, an allocating write waits and
/// succeeds once the scan is released — or, with the free-space hint of
/// the clean unmount before, succeeds at once from it — and every freed
/// block ends up free (or busy) exactly once, every block the hint handed
/// out used: the installed allocator is consistent and free ∪ busy is
/// what the layout after the frees leaves.
#[test]
fn frees_during_the_scan_land_once_and_allocations_wait_for_it() {
    for (extent_pages, hint) in [(false, false), (true, false), (false, true), (true, true)] {
        let dev = Arc::new(MemDevice::new(16 << 20, 512));
        let opts = FormatOptions {
            extent_pages,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), &opts).unwrap();
        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        for name in ["/a", "/b", "/c"] {
            let f = vol.open_file(name, DIRECT).unwrap();
            for i in 0..64u64 {
                f.pwrite(&[i as u8; 4096], 2 * i * 4096).unwrap();
            }
        }
        vol.unmount().unwrap();
        if !hint {
            drop_free_hint(&dev);
        }

        let held = Held::new();
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let a = vol.open_file("/a", DIRECT).unwrap();
        if hint {
            // From the reserve, the scan still held: before the frees, so
            // that the install claims it before applying them.
            let done = allocate_apart(vol.open_file("/a", DIRECT).unwrap(), 300 * 4096);
            let wrote = done
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("an allocating write waited for the held scan");
            assert_eq!(wrote.unwrap(), 4096);
            assert!(!vol.inner.free_space_gate.is_done());
        }
        // Reads and overwrites of allocated space do not wait.
        let mut buf = [0u8; 4096];
        a.pread(&mut buf, 2 * 4096).unwrap();
        assert_eq!(buf, [1u8; 4096]);
        a.pwrite(&[0xaa; 4096], 2 * 4096).unwrap();
        // The frees: their room checks need free space on a volume with
        // extent pages, so there they come after the release.
        let free_all = |vol: &Volume, a: &crate::File| {
            a.punch_hole(8 * 4096, 16 * 4096).unwrap();
            vol.open_file("/b", DIRECT)
                .unwrap()
                .truncate(10 * 4096)
                .unwrap();
            vol.unlink("/c").unwrap();
            a.fsync().unwrap();
            vol.checkpoint().unwrap();
        };
        if !extent_pages {
            free_all(&vol, &a);
            assert!(
                !vol.inner.free_space_gate.is_done(),
                "the frees did not wait for the scan"
            );
        }
        let installing = held.installing.clone();
        let writer = {
            let a = vol.open_file("/a", DIRECT).unwrap();
            std::thread::spawn(move || {
                // A hole: allocates.
                a.pwrite(&[7u8; 4096], 200 * 4096).unwrap();
                installing.load(Ordering::SeqCst)
            })
        };
        held.release();
        // With the hint it may have taken reserve space before the scan.
        let after_the_scan = writer.join().unwrap();
        assert!(
            hint || after_the_scan,
            "the allocating write completed before the scan"
        );
        if extent_pages {
            free_all(&vol, &a);
        }
        let alloc = installed(&vol);
        assert_eq!(free_or_busy(&alloc), rebuilt_now(&vol).free_extents());
        vol.checkpoint().unwrap();
        let alloc = installed(&vol);
        assert_eq!(alloc.busy_bytes(), 0);
        assert_eq!(alloc.free_extents(), rebuilt_now(&vol).free_extents());
        drop(a);
        vol.unmount().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// Unmount while the scan is held (released only by the cancel): the
/// unmount, which allocates nothing here, completes; dropping the volume
/// cancels the scan and joins its thread, which installs nothing; the
/// volume is clean and mounts again with the free space a synchronous
/// mount builds.
#[test]
fn unmount_during_the_scan_cancels_and_joins_it() {
    let dev = Arc::new(MemDevice::new(8 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    vol.open_file("/f", DIRECT)
        .unwrap()
        .pwrite(&[5u8; 8192], 0)
        .unwrap();
    vol.unmount().unwrap();
    let held = Held::new();
    let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
    let inner = vol.inner.clone();
    vol.unmount().unwrap();
    assert!(
        !inner.free_space_gate.is_done(),
        "the scan was cancelled, not finished"
    );
    drop(inner);
    let report = crate::fsck::check(dev.clone()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let want = synchronous(&dev);
    let vol = Volume::open(dev.clone()).unwrap();
    assert_eq!(installed(&vol).free_extents(), want.free_extents());
}

/// Unmount while the scan is held, released from the test: whatever the
/// unmount's checkpoint needs (with extent pages, its pages may take
/// space) waits for it, and the volume is clean after.
#[test]
fn unmount_during_the_scan_joins_it() {
    for extent_pages in [false, true] {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        let opts = FormatOptions {
            extent_pages,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), &opts).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        vol.open_file("/f", DIRECT)
            .unwrap()
            .pwrite(&[5u8; 8192], 0)
            .unwrap();
        vol.unmount().unwrap();
        let held = Arc::new(Held::new());
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let unmount = std::thread::spawn(move || vol.unmount());
        held.release();
        unmount.join().unwrap().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// A scan stopped before it installs (the last `Volume` handle dropped)
/// is run by the next caller that waits, in its own thread: a handle that
/// outlives its volume still allocates.
#[test]
fn an_abandoned_scan_is_run_by_the_next_waiter() {
    let dev = Arc::new(MemDevice::new(8 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let cache = iomap::FolioCache::new(iomap::CacheConfig::default()).unwrap();
    let inner = mount::mount(dev.clone(), cache).unwrap();
    let Some(Claim::Scan(input)) = inner.free_space_gate.claim(false) else {
        panic!("nobody scans yet");
    };
    inner.scan_free_space(input, &AtomicBool::new(true));
    assert!(
        !inner.free_space_gate.is_done(),
        "a cancelled scan installs nothing"
    );
    assert!(matches!(
        inner.meta.read().alloc.allocator(),
        Err(Error::FreeSpacePending)
    ));
    inner.wait_free_space();
    assert!(inner.free_space_gate.is_done());
    let meta = inner.meta.read();
    let alloc = meta.alloc.allocator().unwrap();
    assert_eq!(alloc.free_extents(), synchronous(&dev).free_extents());
}

/// A power cut while the scan is held, after frees made durable then:
/// the cut device mounts with those frees, its free space is what a
/// synchronous mount builds, and fsck is clean.
#[test]
fn a_power_cut_during_the_scan_loses_nothing() {
    for seed in 0..8u64 {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        let f = vol.open_file("/f", DIRECT).unwrap();
        for i in 0..32u64 {
            f.pwrite(&[i as u8 + 1; 4096], 2 * i * 4096).unwrap();
        }
        vol.open_file("/g", DIRECT)
            .unwrap()
            .pwrite(&[9u8; 4096], 0)
            .unwrap();
        drop(f);
        vol.unmount().unwrap();

        let held = Held::new();
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let f = vol.open_file("/f", DIRECT).unwrap();
        f.punch_hole(0, 8 * 4096).unwrap();
        f.truncate(40 * 4096).unwrap();
        vol.unlink("/g").unwrap();
        f.fsync().unwrap();
        vol.sync().unwrap();
        let cut = Arc::new(dev.power_cut_seeded(seed));
        held.release();
        drop(f);
        drop(vol);

        let want = synchronous(&cut);
        let vol = Volume::open_with(cut.clone(), &quiet()).unwrap();
        let got = installed(&vol);
        assert_eq!(got.free_extents(), want.free_extents(), "seed {seed}");
        assert_eq!(got.busy_ranges(), want.busy_ranges(), "seed {seed}");
        let f = vol.open_file("/f", DIRECT).unwrap();
        assert_eq!(f.stat().unwrap().size, 40 * 4096, "seed {seed}");
        let mut buf = [0u8; 4096];
        f.pread(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 4096], "seed {seed}: the punch is durable");
        f.pread(&mut buf, 10 * 4096).unwrap();
        assert_eq!(buf, [6u8; 4096], "seed {seed}");
        assert!(vol.open_file("/g", OpenFlags::default()).is_err());
        drop(f);
        vol.unmount().unwrap();
        let report = crate::fsck::check(cut.clone()).unwrap();
        assert!(report.is_clean(), "seed {seed}: {report:?}");
    }
}

/// Two files whose extents share blocks (a forged but valid checkpoint):
/// mount succeeds, the scan finds the overlap and names the inode, every
/// allocation fails with that error, nothing is written over the shared
/// blocks (nor anywhere in the data area), reads go on, fsck reports it.
#[test]
fn an_overlapping_extent_is_found_by_the_scan_and_refuses_allocations() {
    let dev = Arc::new(MemDevice::new(8 << 20, 512));
    // A whole-image checkpoint is forged below.
    let opts = FormatOptions {
        extent_pages: false,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    for (name, byte) in [("/a", 1u8), ("/b", 2u8)] {
        vol.open_file(name, DIRECT)
            .unwrap()
            .pwrite(&[byte; 8192], 0)
            .unwrap();
    }
    vol.unmount().unwrap();
    let sb = crate::superblock::read_superblock(&*dev).unwrap();
    let newest = crate::checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let mut ckpt = newest.checkpoint.clone();
    let addr_a = ckpt
        .image
        .inodes
        .iter()
        .find(|i| !i.extents.is_empty())
        .unwrap()
        .extents[0]
        .addr;
    let b = ckpt
        .image
        .inodes
        .iter_mut()
        .filter(|i| !i.extents.is_empty())
        .nth(1)
        .unwrap();
    let ino_b = b.ino;
    b.extents[0].addr = addr_a;
    ckpt.generation += 1;
    let other = crate::checkpoint::other_slot(newest.slot);
    crate::checkpoint::write_checkpoint(&*dev, &sb, other, &ckpt).unwrap();
    dev.flush().unwrap();

    let before = dev.snapshot();
    let vol = Volume::open(dev.clone()).expect("mount leaves the layout to the scan");
    let err = vol
        .wait_free_space()
        .expect_err("the scan finds the overlap");
    assert!(
        matches!(&err, Error::Corrupt { what: "extent map", offset, .. } if *offset == addr_a)
            && err.to_string().contains(&format!("inode {ino_b}")),
        "{err}"
    );
    assert_eq!(vol.mount_warnings().len(), 1, "{:?}", vol.mount_warnings());
    let a = vol.open_file("/a", DIRECT).unwrap();
    let mut buf = [0u8; 4096];
    a.pread(&mut buf, 4096).unwrap();
    assert_eq!(buf, [1u8; 4096], "reads go on");
    for (what, result) in [
        ("direct write", a.pwrite(&[3u8; 4096], 64 * 4096).map(drop)),
        ("fallocate", a.fallocate(64 * 4096, 4096, false)),
        (
            "buffered write",
            vol.open_file("/a", OpenFlags::default())
                .and_then(|f| f.pwrite(&[3u8; 4096], 80 * 4096).map(drop)),
        ),
    ] {
        let err = result.expect_err(what);
        assert!(
            matches!(
                err.root(),
                Error::Corrupt {
                    what: "extent map",
                    ..
                }
            ),
            "{what}: {err}"
        );
    }
    drop(a);
    drop(vol);
    let after = dev.snapshot();
    let data = &sb.layout.data;
    let (start, end) = (data.start as usize, (data.start + data.len) as usize);
    assert!(
        before[start..end] == after[start..end],
        "the data area was written"
    );
    let err = crate::fsck::check(dev.clone()).expect_err("fsck reports the overlap");
    assert!(err.to_string().contains("already used"), "{err}");
}

/// A hint that lies (it names a file's blocks; its crc verifies, as a
/// forged one would): what the reserve handed out meanwhile is claimed
/// at install, the scan finds it used, and free space fails as for an
/// overlap: every later allocation gets that error, naming the range;
/// reads go on. Hints that are not even plausible (misaligned, outside
/// the data area, over a listed extent page, overlapping) give no
/// reserve at all.
#[test]
fn a_hint_that_lies_fails_the_install() {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    let f = vol.open_file("/f", DIRECT).unwrap();
    f.pwrite(&[5u8; 16 * 4096], 0).unwrap();
    let data = f.fiemap().unwrap()[0];
    drop(f);
    // Past the inline bound: its extents go to pages.
    let paged = vol.open_file("/paged", DIRECT).unwrap();
    for k in 0..200u64 {
        paged.pwrite(&[6u8; 4096], 2 * k * 4096).unwrap();
    }
    drop(paged);
    vol.unmount().unwrap();

    let mut sb = crate::superblock::read_superblock(&*dev).unwrap();
    let newest = crate::checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let pages = used_pages(&sb, &newest.pages, &newest.index);
    let data_area = (sb.layout.data.start, sb.layout.data.len);
    let implausible = [
        vec![(data.addr + 512, 4096)],
        vec![(data_area.0 + data_area.1 - 4096, 8192)],
        vec![(data.addr, 8192), (data.addr + 4096, 4096)],
    ];
    for hint in implausible {
        assert!(
            crate::free_space::Reserve::of_hint(&sb, &hint, &pages).is_none(),
            "{hint:?}"
        );
    }
    let &(page, len) = pages.first().expect("/paged has pages");
    assert!(crate::free_space::Reserve::of_hint(&sb, &[(page, len)], &pages).is_none());
    assert!(crate::free_space::Reserve::of_hint(&sb, &[(data.addr, 4096)], &pages).is_some());

    // The lie first, then what the unmount left: room enough for the
    // next base's pages beside the writes (the reserve's counts stand in
    // for free space's), and the lie, the smallest, is the best fit.
    let left = std::mem::take(&mut sb.free_hint);
    assert!(!left.is_empty(), "a clean unmount leaves a hint");
    sb.free_hint = std::iter::once((data.addr, data.length))
        .chain(left.into_iter().take(crate::superblock::FREE_HINT_MAX - 1))
        .collect();
    crate::superblock::write_superblock(&*dev, &sb).unwrap();
    let held = Held::new();
    let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
    let done = allocate_apart(vol.open_file("/g", DIRECT).unwrap(), 0);
    done.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the reserve allocates while the scan is held")
        .unwrap();
    held.release();
    let err = vol
        .wait_free_space()
        .expect_err("the claim meets /f's blocks");
    assert!(
        err.to_string()
            .contains("free-space hint handed out space the scan finds used"),
        "{err}"
    );
    let again = vol
        .open_file("/h", DIRECT)
        .and_then(|h| h.pwrite(&[1u8; 4096], 0));
    assert!(
        matches!(&again, Err(e) if e.to_string().contains("free-space hint")),
        "{again:?}"
    );
    let mut buf = [0u8; 4096];
    vol.open_file("/f", DIRECT)
        .unwrap()
        .pread(&mut buf, 4096)
        .unwrap();
    assert_eq!(
        buf, [5u8; 4096],
        "a block of /f the reserve did not hand out"
    );
}

/// Device ranges of `file`'s extents.
fn extents_of(file: &crate::File) -> Vec<(u64, u64)> {
    file.fiemap()
        .unwrap()
        .into_iter()
        .filter(|e| e.addr != 0)
        .map(|e| (e.addr, e.length))
        .collect()
}

fn overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter()
        .any(|&(x, xl)| b.iter().any(|&(y, yl)| x < y + yl && y < x + xl))
}

/// Whether one range of `ranges` (coalesced) holds all of `(addr, len)`.
fn covered(ranges: &[(u64, u64)], (addr, len): (u64, u64)) -> bool {
    ranges
        .iter()
        .any(|&(a, l)| a <= addr && addr + len <= a + l)
}

/// The free-space hint the checkpoint record mount would load carries.
fn checkpoint_hint(dev: &Arc<MemDevice>) -> Vec<(u64, u64)> {
    let sb = crate::superblock::read_superblock(&**dev).unwrap();
    let newest = crate::checkpoint::read_checkpoints(&**dev, &sb).unwrap();
    crate::checkpoint::read_free_hint(&**dev, &sb, newest.slot, &newest.chain).unwrap()
}

/// What [`crashed_after_checkpoint`] left: the device and the blocks of
/// `/late`, which only the journal after the checkpoint maps.
struct Crashed {
    dev: Arc<MemDevice>,
    late: Vec<(u64, u64)>,
}

const LATE_BLOCKS: u64 = 96;

/// Where the checkpoint [`crashed_after_checkpoint`] takes keeps its
/// extents: in its image (a delta), in extent pages of a base, or in an
/// image spilled to the data area (a base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Image,
    Paged,
    Spilled,
}

/// A volume that went down without unmount: `/early` written, a
/// checkpoint taken with free space installed (so its record carries a
/// hint), then, in the journal only, `/early` punched (a free replay
/// holds busy) and `/late` written into the hint's ranges, all synced.
/// With `cut`, the device is what a power cut after the sync keeps;
/// otherwise the volume is just dropped.
fn crashed_after_checkpoint(layout: Layout, cut: Option<u64>) -> Crashed {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: layout == Layout::Paged,
        // The image of 400 extents does not fit: it spills.
        checkpoint_slot_bytes: (layout == Layout::Spilled).then_some(8 << 10),
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    let early = vol.open_file("/early", DIRECT).unwrap();
    // Past the inline bound with extent pages: a base with pages.
    for i in 0..400u64 {
        early.pwrite(&early_block(i), 2 * i * 4096).unwrap();
    }
    early.fsync().unwrap();
    // With extent pages a base (whose pages are placed after its
    // snapshot, maybe in the hint's ranges); without, a delta.
    vol.inner.checkpoint_for_unmount().unwrap();
    let hint = checkpoint_hint(&dev);
    assert!(!hint.is_empty(), "the checkpoint carries a hint");
    if layout == Layout::Spilled {
        let sb = crate::superblock::read_superblock(&*dev).unwrap();
        let newest = crate::checkpoint::read_checkpoints(&*dev, &sb).unwrap();
        assert!(!newest.spills[newest.slot].is_empty(), "the base spills");
    }
    early.punch_hole(0, 8 * 4096).unwrap();
    let late = vol.open_file("/late", DIRECT).unwrap();
    for i in 0..LATE_BLOCKS {
        late.pwrite(&[0x40 + (i % 64) as u8; 4096], i * 4096)
            .unwrap();
    }
    late.fsync().unwrap();
    early.fsync().unwrap();
    vol.sync().unwrap();
    let late_extents = extents_of(&late);
    assert!(
        overlap(&late_extents, &hint),
        "/late is placed in the hint's ranges: {late_extents:?} {hint:?}"
    );
    let dev = match cut {
        Some(seed) => Arc::new(dev.power_cut_seeded(seed)),
        None => dev,
    };
    drop((early, late));
    drop(vol);
    let sb = crate::superblock::read_superblock(&*dev).unwrap();
    assert!(sb.clean_mark.is_none(), "no clean unmount");
    Crashed {
        dev,
        late: late_extents,
    }
}

/// Creates `path` and writes `blocks` blocks of `byte` at its start, on
/// another thread (creating may wait for free space too), so that a
/// write that waits for a held scan fails the test instead of hanging
/// it; sends the file's device ranges.
fn write_apart(
    vol: &Volume,
    path: &'static str,
    blocks: u64,
) -> mpsc::Receiver<crate::Result<Vec<(u64, u64)>>> {
    let (tx, rx) = mpsc::channel();
    let vol = vol.clone();
    std::thread::spawn(move || {
        let written = vol.open_file(path, DIRECT).and_then(|f| {
            (0..blocks).try_for_each(|i| f.pwrite(&[0xee; 4096], i * 4096).map(drop))?;
            Ok(extents_of(&f))
        });
        drop(tx.send(written));
    });
    rx
}

/// Waits for [`write_apart`]'s result while the scan is held, then
/// releases the scan whatever came (a failure must not leave it held):
/// the ranges written, and whether the scan was still held when they
/// came.
fn written_while_held(
    vol: &Volume,
    held: &Held,
    rx: &mpsc::Receiver<crate::Result<Vec<(u64, u64)>>>,
) -> (Vec<(u64, u64)>, bool) {
    let got = rx.recv_timeout(std::time::Duration::from_secs(60));
    let still_held = !vol.inner.free_space_gate.is_done();
    held.release();
    let placed = got
        .expect("an allocating write waited for the held scan")
        .unwrap();
    (placed, still_held)
}

/// `/late` reads back as written.
fn check_late(vol: &Volume) {
    let late = vol.open_file("/late", DIRECT).unwrap();
    let mut buf = [0u8; 4096];
    for i in 0..LATE_BLOCKS {
        late.pread(&mut buf, i * 4096).unwrap();
        assert_eq!(buf, [0x40 + (i % 64) as u8; 4096], "/late block {i}");
    }
}

/// After a crash (no clean-unmount mark), with the scan held, an
/// allocating write completes at once from the loaded checkpoint's hint;
/// once the scan is released the installed allocator is what a
/// synchronous mount builds (free ∪ busy as the layout leaves it, the
/// busy ranges replay's frees), and fsck is clean. With and without
/// extent pages or a spilled image, dropped or power-cut.
#[test]
fn after_a_crash_allocations_use_the_checkpoint_hint_while_the_scan_is_held() {
    for (layout, cut) in [
        (Layout::Image, None),
        (Layout::Paged, None),
        (Layout::Spilled, None),
        (Layout::Image, Some(3)),
        (Layout::Paged, Some(7)),
    ] {
        let crashed = crashed_after_checkpoint(layout, cut);
        let dev = crashed.dev;
        let want = synchronous(&dev);
        assert!(!want.busy_ranges().is_empty(), "replay frees the punch");
        let held = Held::new();
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let rx = write_apart(&vol, "/new", 1);
        let (placed, still_held) = written_while_held(&vol, &held, &rx);
        assert!(still_held && !placed.is_empty());
        let alloc = installed(&vol);
        assert!(
            vol.mount_warnings().is_empty(),
            "{:?}",
            vol.mount_warnings()
        );
        assert_eq!(alloc.busy_ranges(), want.busy_ranges());
        assert_eq!(free_or_busy(&alloc), rebuilt_now(&vol).free_extents());
        check_late(&vol);
        vol.unmount().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// Journal records after the checkpoint placed `/late` inside the hint's
/// ranges: mount cuts them out, so writes made from the reserve while the
/// scan is held (enough to cover what the hint had) never land on
/// `/late`'s blocks: its data stays, the install's claim check passes.
#[test]
fn space_replay_placed_is_not_handed_out_again() {
    for layout in [Layout::Image, Layout::Paged, Layout::Spilled] {
        let crashed = crashed_after_checkpoint(layout, None);
        let dev = crashed.dev;
        let held = Held::new();
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let rx = write_apart(&vol, "/new", LATE_BLOCKS);
        let (placed, still_held) = written_while_held(&vol, &held, &rx);
        assert!(still_held, "the writes came from the reserve");
        assert!(
            !overlap(&placed, &crashed.late),
            "the reserve handed out /late's blocks: {placed:?} {:?}",
            crashed.late
        );
        check_late(&vol);
        vol.wait_free_space()
            .expect("every claim is free in the scanned layout");
        assert!(
            vol.mount_warnings().is_empty(),
            "{:?}",
            vol.mount_warnings()
        );
        check_late(&vol);
        vol.unmount().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// An allocating write on a volume whose held scan is then released:
/// whether it completed only once the scan was installing. True when it
/// waited for the scan; a write that did not wait may also finish after
/// the release, so false proves nothing and no caller asks for it.
fn write_waits_for_the_scan(dev: &Arc<MemDevice>) -> bool {
    let held = Held::new();
    let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
    let installing = held.installing.clone();
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let f = vol.open_file("/new", DIRECT).unwrap();
            f.pwrite(&[7u8; 4096], 0).unwrap();
            installing.load(Ordering::SeqCst)
        })
    };
    held.release();
    let waited = writer.join().unwrap();
    vol.wait_free_space().unwrap();
    check_late(&vol);
    vol.unmount().unwrap();
    let report = crate::fsck::check(dev.clone()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    waited
}

/// A checkpoint hint with any one byte flipped (header, a range or its
/// crc) is not used: the unclean mount waits for its scan, as a volume
/// without the compat bit does, which writes no hint block at all.
#[test]
fn a_damaged_checkpoint_hint_or_none_makes_mount_wait_for_the_scan() {
    let probe = crashed_after_checkpoint(Layout::Image, None);
    let sb = crate::superblock::read_superblock(&*probe.dev).unwrap();
    let newest = crate::checkpoint::read_checkpoints(&*probe.dev, &sb).unwrap();
    let at = sb.layout.checkpoint_slots[newest.slot].start + newest.chain.next_offset;
    let hint_len = 24 + 16 * checkpoint_hint(&probe.dev).len() as u64 + 4;
    for byte in [0, 9, 17, 21, 24 + 3, 24 + 12, hint_len - 1] {
        let crashed = crashed_after_checkpoint(Layout::Image, None);
        let mut block = vec![0u8; 512];
        crashed.dev.read_at(&mut block, at).unwrap();
        block[byte as usize] ^= 0x20;
        crashed
            .dev
            .write_at(&block, at, blockdev::WriteMode::Normal)
            .unwrap();
        assert!(checkpoint_hint(&crashed.dev).is_empty(), "byte {byte}");
        assert!(write_waits_for_the_scan(&crashed.dev), "byte {byte}");
    }
    // The undamaged control: the write completes with the scan held.
    let held = Held::new();
    let vol = Volume::open_with(probe.dev.clone(), &held.opts).unwrap();
    let rx = write_apart(&vol, "/new", 1);
    let (_, still_held) = written_while_held(&vol, &held, &rx);
    assert!(
        still_held,
        "the undamaged hint allocates while the scan is held"
    );
    vol.unmount().unwrap();

    // Without the bit: format's superblocks lose it before the first
    // mount, and no checkpoint writes a hint.
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let mut sb = crate::superblock::read_superblock(&*dev).unwrap();
    sb.features_compat &= !crate::superblock::COMPAT_CHECKPOINT_FREE_HINT;
    crate::superblock::write_superblock(&*dev, &sb).unwrap();
    crate::superblock::write_backup_superblock(&*dev, &sb).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    let late = vol.open_file("/late", DIRECT).unwrap();
    for i in 0..LATE_BLOCKS {
        late.pwrite(&[0x40 + (i % 64) as u8; 4096], i * 4096)
            .unwrap();
    }
    vol.checkpoint().unwrap();
    late.fsync().unwrap();
    drop(late);
    drop(vol);
    let newest = crate::checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let at = (sb.layout.checkpoint_slots[newest.slot].start + newest.chain.next_offset) as usize;
    let mut block = vec![0u8; 4096];
    dev.read_at(&mut block, at as u64).unwrap();
    assert!(
        !block.starts_with(&crate::checkpoint::FREE_HINT_MAGIC),
        "a hint block without the bit"
    );
    assert!(write_waits_for_the_scan(&dev));
}

/// How the power cut leaves the checkpoint taken after `/late`, the
/// newest one, whose write it cuts short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Torn {
    /// A base in the other slot: its first sector (magic, a generation
    /// newer than the older slot's) on disk, the rest of its record lost.
    /// Mount tries that slot first, finds its crc wrong and falls back to
    /// the older slot's chain end.
    BaseInTheOtherSlot,
    /// A delta after the chain's last record: its first sector lost, the
    /// rest kept. The chain ends at the record before it, and that
    /// record's hint block, which the delta's first sector would have
    /// overwritten, survives.
    DeltaHeaderLost,
    /// A delta, its first sector kept and the rest lost: the chain ends
    /// at the record before it, whose hint block the delta's header now
    /// covers.
    DeltaHeaderKept,
    /// A spilled base in the other slot: its record (header, spill table,
    /// hint block) kept whole, its image in the data area lost. The one
    /// flush comes after both, so the record may land without the image:
    /// the record's crc verifies, the image's does not, and mount falls
    /// back to the older slot's chain end.
    SpilledImageLost,
    /// As [`Torn::SpilledImageLost`], but each spill extent's write loses
    /// only its first sector: an image with new and old blocks mixed.
    SpilledImagePartlyLost,
    /// A spilled base in the other slot: its image kept, its record lost
    /// whole. The slot still holds the base written there before, which
    /// verifies (an older generation): its spill extents stay in use, the
    /// lost base's are listed by nothing.
    SpilledRecordLost,
}

impl Torn {
    fn is_spilled(self) -> bool {
        matches!(
            self,
            Torn::SpilledImageLost | Torn::SpilledImagePartlyLost | Torn::SpilledRecordLost
        )
    }

    fn newer_is_a_base(self) -> bool {
        self == Torn::BaseInTheOtherSlot || self.is_spilled()
    }
}

/// What [`crashed_during_a_checkpoint`] left: the device as the power cut
/// left it; the blocks of `/late`, which only the journal after the older
/// checkpoint maps; that checkpoint's slot, where its chain ends, and its
/// hint. With a spilled base torn: the spill extents a slot still lists
/// (the older checkpoint's; the overwritten base's too if its record
/// survived), which the fallback's state needs, and those no slot lists
/// any more (the torn base's; the overwritten base's if its record did
/// not survive), which are free after the fallback.
struct CrashedDuringCheckpoint {
    dev: Arc<MemDevice>,
    late: Vec<(u64, u64)>,
    older_slot: usize,
    older_chain: crate::checkpoint::ChainEnd,
    older_hint: Vec<(u64, u64)>,
    listed_spill: Vec<(u64, u64)>,
    unlisted_spill: Vec<(u64, u64)>,
}

/// Bytes of `/early`'s block `i` (written at block `2 i`): never zero,
/// which a punched block reads as.
fn early_block(i: u64) -> [u8; 4096] {
    [(i % 255) as u8 + 1; 4096]
}

/// Blocks of `/early` [`crashed_during_a_checkpoint`] punches after the
/// older checkpoint (replay frees them: held busy).
const EARLY_PUNCHED: u64 = 4;
const EARLY_BLOCKS: u64 = 400;

/// Directories whose inodes a delta cannot fit in what an 8 KiB slot has
/// left after a spilled base's record and hint block: the checkpoint
/// after them is a base in the other slot.
const DIRS_PAST_A_SPILLED_SLOT: usize = 64;

/// The spill extents the spilled base record at device byte `at` lists.
/// Only the table's own checks apply: the record's crc may fail (a torn
/// record still names what its base allocated).
fn spill_table_at(
    dev: &dyn BlockDevice,
    sb: &crate::superblock::Superblock,
    at: u64,
) -> Vec<(u64, u64)> {
    use crate::checkpoint::{CHECKPOINT_HEADER_LEN, OFF_IMAGE_LEN, SPILLED_MAGIC};
    let mut record = vec![0u8; sb.block_size() as usize];
    dev.read_at(&mut record, at).unwrap();
    assert_eq!(&record[..8], &SPILLED_MAGIC[..], "a spilled base at {at}");
    let len = u64::from_le_bytes(record[OFF_IMAGE_LEN..OFF_IMAGE_LEN + 8].try_into().unwrap());
    let table = &record[CHECKPOINT_HEADER_LEN..CHECKPOINT_HEADER_LEN + len as usize];
    crate::checkpoint::decode_spill_table(sb, table, at + CHECKPOINT_HEADER_LEN as u64)
        .unwrap()
        .extents
}

/// A volume that lost power while writing a checkpoint: `/early` written
/// and an older checkpoint taken with free space installed (so its record
/// carries a hint); then, in the journal only, `/early` punched and
/// `/late` written into that hint's ranges, all synced; then a newer
/// checkpoint whose record write the power cut tears as `torn` says
/// (every other write not yet durable is kept, but for a spilled base's
/// image, which `torn` says the fate of too). The newer checkpoint is a
/// base with extent pages (the unmount's checkpoint is always one), or
/// without them once the older chain is full; a delta without them. With
/// [`Layout::Spilled`] every checkpoint is a spilled base (slot 1, 0,
/// then the older one in 1): the newer one, in slot 0, replaces a spilled
/// base whose extents are still allocated while it is written.
fn crashed_during_a_checkpoint(layout: Layout, torn: Torn) -> CrashedDuringCheckpoint {
    assert_eq!(
        layout == Layout::Spilled,
        torn.is_spilled(),
        "{layout:?} {torn:?}: a spilled tear needs a spilled layout"
    );
    let mem = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: layout == Layout::Paged,
        // The image of `/early`'s extents does not fit: it spills.
        checkpoint_slot_bytes: (layout == Layout::Spilled).then_some(8 << 10),
        ..FormatOptions::default()
    };
    Volume::format(mem.clone(), &opts).unwrap();
    let vol = Volume::open_with(mem.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    let early = vol.open_file("/early", DIRECT).unwrap();
    for i in 0..EARLY_BLOCKS {
        early.pwrite(&early_block(i), 2 * i * 4096).unwrap();
    }
    early.fsync().unwrap();
    let newer_is_a_base = torn.newer_is_a_base();
    match layout {
        // With extent pages the unmount's checkpoint is a base: so is the
        // newer one below.
        Layout::Paged => {
            assert!(newer_is_a_base, "a delta after a base with pages");
            vol.inner.checkpoint_for_unmount().unwrap();
        }
        // `/early`'s extents, then directories, each too much for a delta.
        Layout::Spilled => {
            for round in 0..3 {
                if round > 0 {
                    for i in 0..DIRS_PAST_A_SPILLED_SLOT {
                        vol.mkdir(&format!("/pad{round}-{i}")).unwrap();
                    }
                }
                let slot = vol.inner.commit.lock().slot;
                vol.checkpoint().unwrap();
                assert_ne!(
                    vol.inner.commit.lock().slot,
                    slot,
                    "round {round}: a base in the other slot"
                );
            }
        }
        // Deltas until the chain holds as many as it may, so that the
        // next checkpoint is a base in the other slot.
        _ if newer_is_a_base => {
            for i in 0.. {
                assert!(
                    i < 4 * crate::limits::MAX_CHAIN_DELTAS,
                    "the chain never filled"
                );
                vol.mkdir(&format!("/pad{i}")).unwrap();
                vol.checkpoint().unwrap();
                if vol.inner.commit.lock().chain.deltas == crate::limits::MAX_CHAIN_DELTAS {
                    break;
                }
            }
        }
        _ => vol.checkpoint().unwrap(),
    }
    let (older_slot, older_chain, spills_before) = {
        let commit = vol.inner.commit.lock();
        (commit.slot, commit.chain, commit.spills.clone())
    };
    let newer_slot = crate::checkpoint::other_slot(older_slot);
    assert_eq!(
        spills_before.iter().all(|s| !s.is_empty()),
        layout == Layout::Spilled,
        "{layout:?}: both slots hold spilled bases, or neither: {spills_before:?}"
    );
    let older_hint = checkpoint_hint(&mem);
    assert!(
        !older_hint.is_empty(),
        "the older checkpoint carries a hint"
    );

    early.punch_hole(0, 2 * EARLY_PUNCHED * 4096).unwrap();
    let late = vol.open_file("/late", DIRECT).unwrap();
    for i in 0..LATE_BLOCKS {
        late.pwrite(&[0x40 + (i % 64) as u8; 4096], i * 4096)
            .unwrap();
    }
    // Inodes for the newer checkpoint's record to hold, so that it
    // spans more than the sector a torn write may keep alone; spilled,
    // so many that it is a base.
    let after = match layout {
        Layout::Spilled => DIRS_PAST_A_SPILLED_SLOT,
        _ => 8,
    };
    for i in 0..after {
        vol.mkdir(&format!("/after{i}")).unwrap();
    }
    late.fsync().unwrap();
    early.fsync().unwrap();
    vol.sync().unwrap();
    let late_extents = extents_of(&late);
    assert!(
        overlap(&late_extents, &older_hint),
        "/late is placed in the older hint's ranges: {late_extents:?} {older_hint:?}"
    );
    drop((early, late));

    // The newer checkpoint's first write to either slot is its record
    // (pages and spill extents go to the data area): held there, done
    // on the device but not flushed, while the power is cut. A spilled
    // image is written before it, and flushed only with it.
    let sb = vol.inner.sb.clone();
    let slots = sb.layout.checkpoint_slots;
    let record_at = if newer_is_a_base {
        slots[newer_slot].start
    } else {
        slots[older_slot].start + older_chain.next_offset
    };
    let held =
        mem.pause_after(FaultRule::new(FaultOp::Write).range(slots[0].start..slots[1].end()));
    let checkpointer = {
        let vol = vol.clone();
        std::thread::spawn(move || match layout {
            Layout::Paged => vol.inner.checkpoint_for_unmount(),
            _ => vol.checkpoint(),
        })
    };
    held.wait_reached();
    // Read before the cut: the device shows writes not yet durable.
    let torn_spill = match torn.is_spilled() {
        true => spill_table_at(&*mem, &sb, record_at),
        false => Vec::new(),
    };
    let data_area = sb.layout.data.start..sb.layout.data.end();
    let sector = 512;
    let mut records_torn = 0;
    let mut image_writes = Vec::new();
    let cut = mem.power_cut(&mut |w: &PendingWrite| {
        if data_area.contains(&w.offset()) && torn.is_spilled() {
            image_writes.push((w.offset(), w.len()));
            return match torn {
                Torn::SpilledImageLost => Survival::Lost,
                Torn::SpilledImagePartlyLost => {
                    Survival::Torn((0..w.blocks()).map(|b| b > 0).collect())
                }
                _ => Survival::Kept,
            };
        }
        if w.offset() < slots[0].start || w.offset() >= slots[1].end() {
            return Survival::Kept;
        }
        records_torn += 1;
        assert_eq!(w.offset(), record_at, "the newer checkpoint's record");
        let off_len = crate::checkpoint::OFF_IMAGE_LEN;
        let payload = u64::from_le_bytes(w.data()[off_len..off_len + 8].try_into().unwrap());
        let record_len = crate::checkpoint::CHECKPOINT_HEADER_LEN as u64 + payload;
        if torn.is_spilled() {
            // Its spill table fits the first sector, so a tear keeps or
            // loses the record whole (the crc would refuse a mix).
            assert!(
                record_len <= sector,
                "a spilled record of {record_len} bytes"
            );
            return match torn {
                Torn::SpilledRecordLost => Survival::Lost,
                _ => Survival::Kept,
            };
        }
        // The record itself, not only its padding and hint block, spans
        // sectors past the first: losing them fails its crc.
        assert!(
            record_len > sector,
            "a record of one sector: payload {payload}"
        );
        let first_sector_kept = torn != Torn::DeltaHeaderLost;
        Survival::Torn(
            (0..w.blocks())
                .map(|b| (b == 0) == first_sector_kept)
                .collect(),
        )
    });
    assert_eq!(records_torn, 1, "one checkpoint record was being written");
    image_writes.sort_unstable();
    let mut want_writes = torn_spill.clone();
    want_writes.sort_unstable();
    assert_eq!(
        image_writes, want_writes,
        "the image went to its spill extents alone"
    );
    held.resume();
    checkpointer.join().unwrap().unwrap();
    drop(vol);

    let newest = crate::checkpoint::read_checkpoints(&cut, &sb).unwrap();
    assert!(newest.lost.is_none(), "a torn write, not a lost checkpoint");
    assert_eq!(
        (newest.slot, newest.checkpoint.generation),
        (older_slot, older_chain.generation),
        "mount falls back to the older checkpoint"
    );
    let overwritten_survives = torn == Torn::SpilledRecordLost;
    let mut want_spills = spills_before.clone();
    if !overwritten_survives {
        want_spills[newer_slot].clear();
    }
    assert_eq!(
        newest.spills, want_spills,
        "the slots list the older base's spill extents, and the overwritten base's if its record survived"
    );
    let mut header = [0u8; 512];
    cut.read_at(&mut header, record_at).unwrap();
    let (magic, generation) = (
        &header[..8],
        u64::from_le_bytes(header[8..16].try_into().unwrap()),
    );
    match torn {
        Torn::BaseInTheOtherSlot => assert_eq!(
            (magic, generation),
            (
                &crate::checkpoint::CHECKPOINT_MAGIC[..],
                older_chain.generation + 1
            ),
            "the other slot's header names the newer generation"
        ),
        Torn::SpilledImageLost | Torn::SpilledImagePartlyLost => assert_eq!(
            (magic, generation),
            (
                &crate::checkpoint::SPILLED_MAGIC[..],
                older_chain.generation + 1
            ),
            "the other slot's header names the newer generation"
        ),
        Torn::SpilledRecordLost => assert_eq!(
            (magic, generation),
            (
                &crate::checkpoint::SPILLED_MAGIC[..],
                older_chain.generation - 1
            ),
            "the other slot still holds the base before the older one"
        ),
        Torn::DeltaHeaderKept => assert_eq!(
            (magic, generation),
            (
                &crate::checkpoint::DELTA_MAGIC[..],
                older_chain.generation + 1
            ),
            "the delta's header is over the older record's hint"
        ),
        Torn::DeltaHeaderLost => assert_eq!(magic, &crate::checkpoint::FREE_HINT_MAGIC[..]),
    }
    let cut = Arc::new(cut);
    let survived = checkpoint_hint(&cut);
    match torn {
        Torn::DeltaHeaderKept => assert!(survived.is_empty(), "{survived:?}"),
        _ => assert_eq!(
            survived, older_hint,
            "the older record's hint is what mount reads"
        ),
    }
    let [older_spill, overwritten_spill] =
        [older_slot, newer_slot].map(|s| spills_before[s].clone());
    let (listed_spill, unlisted_spill) = match overwritten_survives {
        true => ([older_spill, overwritten_spill].concat(), torn_spill),
        false => (older_spill, [overwritten_spill, torn_spill].concat()),
    };
    CrashedDuringCheckpoint {
        dev: cut,
        late: late_extents,
        older_slot,
        older_chain,
        older_hint,
        listed_spill,
        unlisted_spill,
    }
}

/// `/early` reads back as written, but for the punched blocks (zeros).
fn check_early(vol: &Volume) {
    let early = vol.open_file("/early", DIRECT).unwrap();
    let mut buf = [0u8; 4096];
    for i in 0..EARLY_BLOCKS {
        early.pread(&mut buf, 2 * i * 4096).unwrap();
        let want = if i < EARLY_PUNCHED {
            [0u8; 4096]
        } else {
            early_block(i)
        };
        assert_eq!(buf, want, "/early block {}", 2 * i);
    }
}

/// The newest checkpoint's write was torn by a power cut, so mount falls
/// back to the older one (the other slot, or the record before a torn
/// delta) and replays the journal after it, which placed `/late` in that
/// record's hint: the hint mount keeps has `/late`'s blocks cut out; with
/// the scan held, writes as large as `/late` come from it at once and
/// none lands on `/late`; every earlier write reads back, the install's
/// claims are free in the scanned layout (no failure, no warning), free
/// and busy space are what a synchronous mount builds, and all of it
/// holds after a remount, fsck clean. A torn spilled base (its image or
/// its record lost) leaves the spill extents the older state reads out of
/// the hint and of what the reserve hands out, and those no slot lists
/// any more free once the scan is done, but for what the reserve took of
/// them: neither leaked nor kept.
#[test]
fn after_a_torn_checkpoint_the_fallback_records_hint_less_replay_serves_allocations() {
    for (layout, torn) in [
        (Layout::Image, Torn::BaseInTheOtherSlot),
        (Layout::Paged, Torn::BaseInTheOtherSlot),
        (Layout::Image, Torn::DeltaHeaderLost),
        (Layout::Spilled, Torn::SpilledImageLost),
        (Layout::Spilled, Torn::SpilledImagePartlyLost),
        (Layout::Spilled, Torn::SpilledRecordLost),
    ] {
        let ctx = format!("{layout:?} {torn:?}");
        let crashed = crashed_during_a_checkpoint(layout, torn);
        let dev = crashed.dev;
        let loaded =
            mount::load_unscanned(&(dev.clone() as Arc<dyn BlockDevice>), Strictness::Mount)
                .unwrap();
        assert_eq!(
            (loaded.slot, loaded.chain.generation),
            (crashed.older_slot, crashed.older_chain.generation),
            "{ctx}"
        );
        assert!(
            !loaded.checkpoint_free_hint.is_empty(),
            "{ctx}: a hint is left after replay's cut"
        );
        assert!(
            !overlap(&loaded.checkpoint_free_hint, &crashed.late),
            "{ctx}: the hint mount keeps still covers /late: {:?} {:?}",
            loaded.checkpoint_free_hint,
            crashed.late
        );
        assert_eq!(
            loaded.checkpoint_free_hint,
            crate::free_space::hint_without(&crashed.older_hint, &crashed.late),
            "{ctx}: the older record's hint less /late's blocks"
        );
        assert!(
            !overlap(&loaded.checkpoint_free_hint, &crashed.listed_spill),
            "{ctx}: the hint covers spill extents a slot lists: {:?} {:?}",
            loaded.checkpoint_free_hint,
            crashed.listed_spill
        );
        drop(loaded);
        let want = synchronous(&dev);
        assert!(
            !want.busy_ranges().is_empty(),
            "{ctx}: replay frees the punch"
        );

        let held = Held::new();
        let vol = Volume::open_with(dev.clone(), &held.opts).unwrap();
        let rx = write_apart(&vol, "/new", LATE_BLOCKS);
        let (placed, still_held) = written_while_held(&vol, &held, &rx);
        assert!(still_held, "{ctx}: the writes came from the reserve");
        assert!(
            !overlap(&placed, &crashed.late),
            "{ctx}: the reserve handed out /late's blocks: {placed:?} {:?}",
            crashed.late
        );
        assert!(
            !overlap(&placed, &crashed.listed_spill),
            "{ctx}: the reserve handed out a listed spill extent: {placed:?} {:?}",
            crashed.listed_spill
        );
        let alloc = installed(&vol);
        assert!(
            vol.mount_warnings().is_empty(),
            "{ctx}: {:?}",
            vol.mount_warnings()
        );
        assert_eq!(alloc.busy_ranges(), want.busy_ranges(), "{ctx}");
        let mut want_after_new = want.clone();
        for &(addr, len) in &placed {
            want_after_new.mark_used(addr, len).unwrap();
        }
        assert_eq!(
            alloc.free_extents(),
            want_after_new.free_extents(),
            "{ctx}: free space is a synchronous mount's less /new"
        );
        let free = free_or_busy(&alloc);
        assert_eq!(free, rebuilt_now(&vol).free_extents(), "{ctx}");
        assert!(
            !overlap(&free, &crashed.listed_spill),
            "{ctx}: a listed spill extent is free: {:?}",
            crashed.listed_spill
        );
        // What the reserve took of them the install's claims checked
        // free in the scanned layout.
        let unlisted_left = crate::free_space::hint_without(&crashed.unlisted_spill, &placed);
        assert!(
            unlisted_left.iter().all(|&r| covered(&free, r)),
            "{ctx}: spill extents no slot lists are not all free: {unlisted_left:?} {free:?}"
        );
        assert_eq!(
            crashed.unlisted_spill.is_empty(),
            layout != Layout::Spilled,
            "{ctx}: a torn spilled base leaves spill extents no slot lists: {:?}",
            crashed.unlisted_spill
        );
        check_late(&vol);
        check_early(&vol);
        vol.unmount().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{ctx}: {report:?}");

        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        vol.wait_free_space().unwrap();
        check_late(&vol);
        check_early(&vol);
        let new = vol.open_file("/new", DIRECT).unwrap();
        let mut buf = [0u8; 4096];
        for i in 0..LATE_BLOCKS {
            new.pread(&mut buf, i * 4096).unwrap();
            assert_eq!(buf, [0xee; 4096], "{ctx}: /new block {i}");
        }
        drop(new);
        vol.unmount().unwrap();
    }
}

/// Whether a mount of `dev` whose scan is held has no reserve to serve
/// allocations from (they wait for the scan). Asked of the allocator
/// itself, while the scan is surely held: unlike
/// [`write_waits_for_the_scan`], both answers mean something. Mounts a
/// copy, which its unmount leaves clean: `dev` still needs its crash
/// mount.
fn mount_has_no_reserve(dev: &MemDevice) -> bool {
    let copy = Arc::new(dev.power_cut(&mut |_| Survival::Kept));
    let held = Held::new();
    let vol = Volume::open_with(copy, &held.opts).unwrap();
    let pending = matches!(
        vol.inner.meta.read().alloc.allocator(),
        Err(Error::FreeSpacePending)
    );
    held.release();
    vol.wait_free_space().unwrap();
    vol.unmount().unwrap();
    pending
}

/// Writes `ranges` as the hint block of the record mount falls back to
/// in `crashed`, sealed as a checkpoint seals it: only a check against
/// the layout can refuse it.
fn forge_fallback_hint(crashed: &CrashedDuringCheckpoint, ranges: &[(u64, u64)]) {
    let sb = crate::superblock::read_superblock(&*crashed.dev).unwrap();
    let chain = &crashed.older_chain;
    let mut enc = crate::codec::Encoder::with_capacity(512);
    enc.bytes(&crate::checkpoint::FREE_HINT_MAGIC);
    enc.u64(chain.generation);
    enc.u32(chain.crc);
    crate::superblock::encode_hint_ranges(&mut enc, ranges);
    let seal = crc32c::crc32c_append(sb.crc_seed(), enc.as_bytes());
    enc.u32(seal);
    let mut block = enc.into_bytes();
    block.resize(512, 0);
    let at = sb.layout.checkpoint_slots[crashed.older_slot].start + chain.next_offset;
    crashed
        .dev
        .write_at(&block, at, blockdev::WriteMode::Normal)
        .unwrap();
}

/// Falling back past a torn checkpoint (a spilled base's too) with no
/// usable hint on the record mount loads: a delta's torn header over it,
/// the hint block damaged (a range moved by a block, its crc left), or,
/// sealed as a checkpoint seals it, naming the spill extents of the base
/// mount falls back to (whose image a reserve handing them out would
/// overwrite). Mount still succeeds, builds no reserve, and an allocating
/// write waits for the scan.
#[test]
fn after_a_torn_checkpoint_without_the_fallback_records_hint_mount_waits_for_the_scan() {
    let crashed = crashed_during_a_checkpoint(Layout::Image, Torn::DeltaHeaderKept);
    assert!(mount_has_no_reserve(&crashed.dev));
    assert!(write_waits_for_the_scan(&crashed.dev));

    for (layout, torn) in [
        (Layout::Image, Torn::BaseInTheOtherSlot),
        (Layout::Paged, Torn::BaseInTheOtherSlot),
        (Layout::Spilled, Torn::SpilledImageLost),
    ] {
        let crashed = crashed_during_a_checkpoint(layout, torn);
        assert!(
            !mount_has_no_reserve(&crashed.dev),
            "{layout:?}: the undamaged hint gives a reserve"
        );
        let sb = crate::superblock::read_superblock(&*crashed.dev).unwrap();
        let at =
            sb.layout.checkpoint_slots[crashed.older_slot].start + crashed.older_chain.next_offset;
        let mut sector = vec![0u8; 512];
        crashed.dev.read_at(&mut sector, at).unwrap();
        // The first range's device offset, moved by a block: still
        // aligned and in the data area, so only the crc tells.
        sector[24 + 1] ^= 0x10;
        crashed
            .dev
            .write_at(&sector, at, blockdev::WriteMode::Normal)
            .unwrap();
        assert!(checkpoint_hint(&crashed.dev).is_empty(), "{layout:?}");
        assert!(mount_has_no_reserve(&crashed.dev), "{layout:?}");
        assert!(write_waits_for_the_scan(&crashed.dev), "{layout:?}");
    }

    let crashed = crashed_during_a_checkpoint(Layout::Spilled, Torn::SpilledImageLost);
    let lie = [crashed.older_hint.clone(), crashed.listed_spill.clone()].concat();
    forge_fallback_hint(&crashed, &lie);
    assert_eq!(checkpoint_hint(&crashed.dev), lie, "the seal verifies");
    assert!(mount_has_no_reserve(&crashed.dev));
    assert!(write_waits_for_the_scan(&crashed.dev));
}

/// The used page ranges mount and the scan keep off: each extent page and
/// each index page either slot lists, once, in address order, extent
/// pages first; the same as the union of each slot's sets of ranges.
#[test]
fn used_pages_lists_each_page_either_slot_lists_once_in_order() {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    // A clean unmount writes a base: the second rewrites the pages of the
    // first few chunks only, and lists the rest as the first did.
    for (round, blocks) in [(0u64, 300u64), (1, 20)] {
        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        let paged = vol.open_file("/paged", DIRECT).unwrap();
        for k in 0..blocks {
            paged
                .pwrite(&[round as u8; 4096], (2 * k + round) * 4096)
                .unwrap();
        }
        drop(paged);
        vol.unmount().unwrap();
    }

    let sb = crate::superblock::read_superblock(&*dev).unwrap();
    let newest = crate::checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let bs = sb.block_size();
    let mut want = crate::extent_pages::page_ranges(&newest.pages[0], bs);
    want.extend(crate::extent_pages::page_ranges(&newest.pages[1], bs));
    let mut index = crate::extent_pages::index_page_ranges(&newest.index[0], bs);
    let other = crate::extent_pages::index_page_ranges(&newest.index[1], bs);
    // Index pages listed twice too.
    assert!(index.intersection(&other).next().is_some());
    index.extend(other);
    let (pages_only, index_only) = (want.len(), index.len());
    let want: Vec<(u64, u64)> = want.into_iter().chain(index).collect();
    let got = used_pages(&sb, &newest.pages, &newest.index);
    assert_eq!(got, want);
    // Both slots list pages, some alike: the union is shorter than both
    // lists together, so the test sees pages listed twice.
    let listed: usize = newest
        .pages
        .iter()
        .flat_map(|t| t.iter().map(|(_, l)| l.len()))
        .sum();
    assert!(
        pages_only > 2 && index_only > 0,
        "{pages_only} {index_only}"
    );
    assert!(listed > pages_only, "{listed} {pages_only}");
}
