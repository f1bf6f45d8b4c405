//! Injected device errors (`FaultRule`): errors must be reported, with their
//! cause and where; never swallowed, never a panic or a hang; what was
//! durable before stays durable (invariant 6).
//!
//! - a failing data write: the error names the file offset and the device
//!   error; synced data is intact after power loss; a failed allocating write
//!   does not extend the size over unwritten space;
//! - a failing journal write or flush during fsync/sync/checkpoint/unmount:
//!   the call fails (never Ok), a retry never claims success for what was
//!   lost, and after a power cut the volume mounts, fsck is clean and synced
//!   data is intact;
//! - failing reads: errors, not zeros; mount and fsck on a failing device
//!   give errors, or (mount) a correct volume;
//! - random faults in random workloads, checked with the crash model.
//!
//! Env: `IOMAPFS_FAULT_CASES` (default 300 random-fault workloads),
//! `IOMAPFS_TEST_SEED`, `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use blockdev::memory::{FaultOp, FaultRule, MemDevice};
use blockdev::BlockDevice;
use blockdev::DeviceError;
use common::dev::{
    cut, dynd, format, fsck_clean, marked_device, CutPolicy, Geometry, RecDevice, Req, LBS, MIB,
};
use common::history::{find_marker, tagged};
use common::volstate::read_volume;
use common::workload::{Workload, WorkloadCfg};
use common::{env_u64, run_case, watchdog, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomap::IomapError;
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::{Error, FiemapKind, File, OpenFlags, Volume};

const SIZE: u64 = 8 * MIB;

fn flags(direct: bool) -> OpenFlags {
    OpenFlags {
        create: true,
        direct,
        ..OpenFlags::default()
    }
}

struct Layout {
    journal: std::ops::Range<u64>,
    slots: [std::ops::Range<u64>; 2],
    data: std::ops::Range<u64>,
}

fn layout(dev: &dyn BlockDevice) -> Layout {
    let sb = read_superblock(dev).expect("read_superblock");
    let l = &sb.layout;
    Layout {
        journal: l.journal.start..l.journal.end(),
        slots: [
            l.checkpoint_slots[0].start..l.checkpoint_slots[0].end(),
            l.checkpoint_slots[1].start..l.checkpoint_slots[1].end(),
        ],
        data: l.data.start..l.data.end(),
    }
}

fn new_volume(fua: bool) -> (Arc<MemDevice>, Volume) {
    let mem = marked_device(SIZE, fua);
    format(dynd(&mem));
    let vol = Volume::open(dynd(&mem)).expect("open");
    (mem, vol)
}

fn read_all(vol: &Volume, path: &str) -> Vec<u8> {
    common::volstate::read_file(vol, path, u64::MAX)
        .unwrap_or_else(|e| panic!("{e}"))
        .data
}

/// The device byte address of file offset `off`, from fiemap.
fn addr_of(f: &File, off: u64) -> u64 {
    let map = f.fiemap().expect("fiemap");
    for x in &map {
        if x.offset <= off && off < x.offset + x.length {
            assert_ne!(x.kind, FiemapKind::Hole, "offset {off} is a hole: {map:?}");
            return x.addr + (off - x.offset);
        }
    }
    panic!("offset {off} not in fiemap {map:?}")
}

/// The error must say where in the file (`lo..hi`) and carry the device's
/// error: an `At` wrapper's offset, the engine's `file_offset`, or at least a
/// number in the message; the injected EIO somewhere in the chain.
fn assert_write_error_located(e: &Error, lo: u64, hi: u64, ctx: &str) {
    let mut offsets = Vec::new();
    let mut cur = e;
    while let Error::At { offset, source, .. } = cur {
        offsets.push(*offset);
        cur = source;
    }
    let mut device = false;
    match cur {
        Error::Iomap(IomapError::Device {
            file_offset,
            source,
        }) => {
            offsets.push(*file_offset);
            device = matches!(source, DeviceError::Io { .. });
        }
        Error::Device { source, .. } => device = matches!(source, DeviceError::Io { .. }),
        _ => {}
    }
    let text = e.to_string();
    let located = offsets.iter().any(|o| (lo..hi).contains(o))
        || text
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|t| t.parse::<u64>().ok())
            .any(|n| (lo..hi).contains(&n));
    assert!(
        located,
        "{ctx}: error does not name a file offset in [{lo}, {hi}): {text} ({e:?})"
    );
    let mut src: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(DeviceError::Io { .. }) = s.downcast_ref::<DeviceError>() {
            device = true;
        }
        src = s.source();
    }
    assert!(
        device,
        "{ctx}: error does not carry the device's EIO: {e:?}"
    );
    assert_eq!(e.errno(), libc::EIO, "{ctx}: errno of {e}");
}

/// Remounts the device as it would be after losing power (keeping nothing
/// not flushed), checks fsck, and returns the volume.
fn crash_and_mount(
    mem: &MemDevice,
    policy: CutPolicy,
    ctx: &str,
) -> (Arc<dyn BlockDevice>, Volume) {
    let dev: Arc<dyn BlockDevice> = Arc::new(cut(mem, policy));
    fsck_clean(dev.clone(), ctx);
    let vol = Volume::open(dev.clone()).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
    (dev, vol)
}

fn policies(seed: u64) -> Vec<CutPolicy> {
    vec![
        CutPolicy::KeepNothing,
        CutPolicy::KeepEverything,
        CutPolicy::Seeded(seed),
        CutPolicy::Seeded(seed ^ 1),
        CutPolicy::TornAll(seed),
    ]
}

#[test]
fn failed_data_write_reports_offset_and_keeps_synced_data() {
    for &direct in &[true, false] {
        for &fua in &[false, true] {
            let ctx = format!("direct={direct} fua={fua}");
            let (mem, vol) = new_volume(fua);
            let f = vol.open_file("/f", flags(direct)).unwrap();
            let a = tagged(1, 0, 64 * 1024);
            assert_eq!(f.pwrite(&a, 0).unwrap(), a.len());
            f.fsync().unwrap();

            // An overwrite of block 5 whose device write fails.
            let off = 5 * 4096;
            let dev_addr = addr_of(&f, off);
            mem.inject(FaultRule::new(FaultOp::Write).range(dev_addr..dev_addr + 4096));
            let b = tagged(2, off, 4096);
            let (woff, wlen) = if direct {
                (off, 4096)
            } else {
                (off + 100, 3000)
            };
            let r = f.pwrite(&b[(woff - off) as usize..][..wlen], woff);
            // A buffered write lands in the cache; its writeback fails, and
            // the fsync after it says so.
            let r = if direct {
                r
            } else {
                assert_eq!(r.as_ref().ok(), Some(&wlen), "{ctx}: buffered write");
                f.fsync().map(|()| wlen)
            };
            let e = match r {
                Ok(n) => panic!("{ctx}: write to a failing device block returned Ok({n})"),
                Err(e) => e,
            };
            // A buffered write may name the block it read-modify-wrote.
            let (lo, hi) = if direct {
                (woff, woff + wlen as u64)
            } else {
                (off, off + 4096)
            };
            assert_write_error_located(&e, lo, hi, &format!("{ctx}: overwrite"));
            mem.clear_faults();

            // Whatever else happened, the synced data is there after power
            // loss, except that the failed range may hold old or new bytes.
            drop(f);
            drop(vol);
            for p in policies(7) {
                let ctx = format!("{ctx} after cut {p:?}");
                let (_dev, vol2) = crash_and_mount(&mem, p, &ctx);
                let got = read_all(&vol2, "/f");
                assert_eq!(got.len(), a.len(), "{ctx}: size");
                for (i, (&g, &want)) in got.iter().zip(a.iter()).enumerate() {
                    let i = i as u64;
                    let new = if (woff..woff + wlen as u64).contains(&i) {
                        b[(i - off) as usize]
                    } else {
                        want
                    };
                    assert!(
                        g == want || g == new,
                        "{ctx}: byte {i} is {g:02x}, want {want:02x} (or {new:02x} in the failed write)"
                    );
                }
            }
        }
    }
}

#[test]
fn failed_allocating_write_does_not_extend_size() {
    for &direct in &[true, false] {
        let ctx = format!("direct={direct}");
        let (mem, vol) = new_volume(false);
        let l = layout(&*dynd(&mem));
        let f = vol.open_file("/f", flags(direct)).unwrap();
        let a = tagged(1, 0, 8192);
        f.pwrite(&a, 0).unwrap();
        f.fsync().unwrap();
        // Every data-area write fails: the append cannot land.
        mem.inject(FaultRule::new(FaultOp::Write).range(l.data.clone()));
        let off = 64 * 1024;
        let b = tagged(2, off, 16 * 1024);
        let r = f.pwrite(&b, off);
        // Buffered: the error comes from writeback, at the fsync.
        let r = if direct {
            r
        } else {
            assert_eq!(r.as_ref().ok(), Some(&b.len()), "{ctx}: buffered write");
            f.fsync().map(|()| b.len())
        };
        match r {
            Ok(n) => panic!("{ctx}: allocating write with failing data area returned Ok({n})"),
            Err(e) => assert_write_error_located(&e, off, off + b.len() as u64, &ctx),
        }
        // Size must not cover the write that failed (invariant 4), live
        // (a buffered write's in-core size does cover it: the bytes are in
        // the cache; the on-disk size is what must not)...
        let st = f.stat();
        if let (true, Ok(st)) = (direct, st) {
            assert!(
                st.size <= off,
                "{ctx}: size {} covers the failed write at {off}",
                st.size
            );
        }
        mem.clear_faults();
        // ... nor after a sync and a crash — unless the write landed after
        // all: a buffered write that failed past the on-disk EOF stays
        // dirty, and the sync (the device works again) writes it.
        let synced = vol.sync();
        assert!(
            synced.is_ok(),
            "{ctx}: sync after the faults cleared: {synced:?}"
        );
        drop(f);
        drop(vol);
        for p in policies(11) {
            let ctx = format!("{ctx} after cut {p:?}");
            let (_dev, vol2) = crash_and_mount(&mem, p, &ctx);
            let got = read_all(&vol2, "/f");
            assert_eq!(&got[..a.len()], &a[..], "{ctx}: synced data");
            let end = off as usize + b.len();
            if direct {
                assert!(
                    got.len() as u64 <= off,
                    "{ctx}: size {} covers the failed write",
                    got.len()
                );
            } else {
                assert_eq!(got.len(), end, "{ctx}: the retried write's size");
                assert_eq!(&got[off as usize..], &b[..], "{ctx}: the retried write");
            }
            let gap_end = got.len().min(off as usize);
            assert!(
                got[a.len()..gap_end].iter().all(|&x| x == 0),
                "{ctx}: non-zero past the synced data"
            );
            assert_eq!(find_marker(&got[..gap_end]), None, "{ctx}: stale data");
        }
    }
}

/// The metadata-changing work before an fsync that will fail.
fn dirty_some_metadata(vol: &Volume, f: &File) {
    let g = vol.open_file("/g", flags(true)).unwrap();
    g.pwrite(&tagged(3, 0, 8192), 0).unwrap();
    f.pwrite(&tagged(4, 100 * 1024, 4096), 100 * 1024).unwrap();
    f.truncate(200 * 1024).unwrap();
    vol.mkdir("/dir").unwrap();
}

#[derive(Clone, Copy, Debug)]
enum SyncFault {
    JournalWrite,
    Flush,
    /// Journal writes fail once only: a retried fsync may succeed, but then
    /// everything must really be durable.
    JournalWriteOnce,
    FlushOnce,
}

#[derive(Clone, Copy, Debug)]
enum SyncCall {
    Fsync,
    Fdatasync,
    VolSync,
    Checkpoint,
    Unmount,
    DsyncWrite,
}

#[test]
fn failed_journal_write_or_flush_fails_the_sync() {
    let stats = Stats::default();
    let t0 = Instant::now();
    for fault in [
        SyncFault::JournalWrite,
        SyncFault::Flush,
        SyncFault::JournalWriteOnce,
        SyncFault::FlushOnce,
    ] {
        for call in [
            SyncCall::Fsync,
            SyncCall::Fdatasync,
            SyncCall::VolSync,
            SyncCall::Checkpoint,
            SyncCall::Unmount,
            SyncCall::DsyncWrite,
        ] {
            for fua in [false, true] {
                let ctx = format!("{fault:?} during {call:?} (fua={fua})");
                run_case("device_errors", 0, &ctx, || {
                    sync_fault_case(fault, call, fua, &ctx, &stats)
                });
            }
        }
    }
    stats.print("failed_journal_write_or_flush_fails_the_sync", t0.elapsed());
}

fn sync_fault_case(fault: SyncFault, call: SyncCall, fua: bool, ctx: &str, stats: &Stats) {
    let mem = marked_device(SIZE, fua);
    format(dynd(&mem));
    let rec = RecDevice::new(mem.clone());
    let vol = Volume::open(rec.clone() as Arc<dyn BlockDevice>).expect("open");
    let l = layout(&*dynd(&mem));
    let f = vol.open_file("/f", flags(true)).unwrap();
    let d = tagged(1, 0, 32 * 1024);
    f.pwrite(&d, 0).unwrap();
    f.fsync().unwrap();
    dirty_some_metadata(&vol, &f);

    let rule = match fault {
        SyncFault::JournalWrite => FaultRule::new(FaultOp::Write).range(l.journal.clone()),
        SyncFault::JournalWriteOnce => FaultRule::new(FaultOp::Write)
            .range(l.journal.clone())
            .count(1),
        SyncFault::Flush => FaultRule::new(FaultOp::Flush),
        SyncFault::FlushOnce => FaultRule::new(FaultOp::Flush).count(1),
    };
    // A checkpoint writes a slot, not (necessarily) the journal: fail those
    // writes too for the journal-write faults.
    let slot_rules: Vec<FaultRule> = match (fault, call) {
        (SyncFault::JournalWrite, SyncCall::Checkpoint | SyncCall::Unmount) => l
            .slots
            .iter()
            .map(|s| FaultRule::new(FaultOp::Write).range(s.clone()))
            .collect(),
        (SyncFault::JournalWriteOnce, SyncCall::Checkpoint | SyncCall::Unmount) => l
            .slots
            .iter()
            .map(|s| FaultRule::new(FaultOp::Write).range(s.clone()).count(1))
            .collect(),
        _ => vec![],
    };
    mem.inject(rule);
    for r in slot_rules {
        mem.inject(r);
    }
    let mark = rec.mark();
    let r = match call {
        SyncCall::Fsync => f.fsync(),
        SyncCall::Fdatasync => f.fdatasync(),
        SyncCall::VolSync => vol.sync(),
        SyncCall::Checkpoint => vol.checkpoint(),
        SyncCall::Unmount => {
            drop(f);
            vol.clone().unmount()
        }
        SyncCall::DsyncWrite => {
            let h = vol
                .open_file(
                    "/f",
                    OpenFlags {
                        dsync: true,
                        direct: true,
                        ..OpenFlags::default()
                    },
                )
                .unwrap();
            // Extends the file: needs metadata, so it must commit.
            h.pwrite(&tagged(5, 300 * 1024, 4096), 300 * 1024)
                .map(|_| ())
        }
    };
    let reqs = rec.since(mark);
    let failed: Vec<&Req> = reqs.iter().filter(|r| !r.ok).collect();
    let mut durable_claimed = false;
    match &r {
        Ok(()) if !failed.is_empty() => panic!(
            "{ctx}: returned Ok although {} device request(s) failed: {failed:?}; all requests: {reqs:?}",
            failed.len()
        ),
        Ok(()) => {
            // The fault never hit (say, FUA writes and no flush needed):
            // then the call's promise must hold in full.
            stats.add("fault_not_hit", 1);
            durable_claimed = true;
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "{ctx}: empty error message");
            if failed.is_empty() {
                panic!("{ctx}: failed without any failed device request: {e}");
            }
            stats.add("sync_errors_reported", 1);
        }
    }
    mem.clear_faults();
    // For transient faults: a retry may succeed, but then it must really
    // have made everything durable (no fsyncgate).
    if r.is_err()
        && matches!(fault, SyncFault::JournalWriteOnce | SyncFault::FlushOnce)
        && !matches!(call, SyncCall::Unmount)
    {
        let r2 = vol.sync();
        if r2.is_ok() {
            durable_claimed = true;
        }
        stats.add(if r2.is_ok() { "retry_ok" } else { "retry_err" }, 1);
    }
    drop(vol);
    let dsync = matches!(call, SyncCall::DsyncWrite);
    let dsync_ok = dsync && r.is_ok();
    for p in policies(3) {
        let ctx = format!("{ctx} after cut {p:?}");
        let (_dev, vol2) = crash_and_mount(&mem, p, &ctx);
        let got = read_all(&vol2, "/f");
        assert!(
            got.len() >= d.len(),
            "{ctx}: synced size lost: {}",
            got.len()
        );
        assert_eq!(&got[..d.len()], &d[..], "{ctx}: synced data lost");
        if durable_claimed {
            // Everything done before the successful sync is durable.
            let sizes: &[usize] = if dsync_ok {
                &[304 * 1024]
            } else if dsync {
                &[200 * 1024, 304 * 1024]
            } else {
                &[200 * 1024]
            };
            assert!(
                sizes.contains(&got.len()),
                "{ctx}: size {} after a successful sync, want one of {sizes:?}",
                got.len()
            );
            assert!(
                vol2.stat("/g").is_ok(),
                "{ctx}: /g lost after a successful sync"
            );
            assert!(
                vol2.stat("/dir").is_ok(),
                "{ctx}: /dir lost after a successful sync"
            );
        }
        let st = read_volume(&vol2, u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        for (p, fd) in &st.files {
            assert_eq!(find_marker(&fd.data), None, "{ctx}: {p} holds stale data");
        }
        stats.add("states_verified", 1);
    }
}

#[test]
fn failed_reads_are_errors_not_zeros() {
    for &direct in &[true, false] {
        let ctx = format!("direct={direct}");
        let (mem, vol) = new_volume(false);
        let f = vol.open_file("/f", flags(true)).unwrap();
        let a = tagged(1, 0, 64 * 1024);
        f.pwrite(&a, 0).unwrap();
        drop(f);
        vol.unmount().unwrap();
        let vol = Volume::open(dynd(&mem)).unwrap();
        let f = vol
            .open_file(
                "/f",
                OpenFlags {
                    direct,
                    read_only: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        let off = 3 * 4096;
        let addr = addr_of(&f, off);
        mem.inject(FaultRule::new(FaultOp::Read).range(addr..addr + 4096));
        let mut buf = vec![0u8; 8192];
        match f.pread(&mut buf, off - 4096) {
            Ok(n) => panic!(
                "{ctx}: read over a failing block returned Ok({n}), zeros: {}",
                buf[4096..].iter().all(|&b| b == 0)
            ),
            Err(e) => {
                assert_eq!(e.errno(), libc::EIO, "{ctx}: errno of {e}");
                assert_write_error_located(&e, off - 4096, off + 4096, &format!("{ctx}: read"));
            }
        }
        // Other blocks still read fine.
        let mut buf = vec![0u8; 4096];
        assert_eq!(f.pread(&mut buf, 0).unwrap(), 4096, "{ctx}");
        assert_eq!(&buf[..], &a[..4096], "{ctx}");
        mem.clear_faults();
        let mut buf = vec![0u8; 4096];
        f.pread(&mut buf, off).unwrap();
        assert_eq!(
            &buf[..],
            &a[off as usize..off as usize + 4096],
            "{ctx}: after the fault cleared"
        );
    }
}

/// Mount and fsck with each read of the metadata failing in turn: an error,
/// or (mount only) exactly the right volume.
#[test]
fn failed_reads_during_mount_and_fsck() {
    let t0 = Instant::now();
    let stats = Stats::default();
    // A volume with a checkpoint and un-checkpointed journal records.
    let mem = marked_device(SIZE, false);
    format(dynd(&mem));
    let vol = Volume::open(dynd(&mem)).unwrap();
    for i in 0..6u64 {
        let f = vol.open_file(&format!("/f{i}"), flags(i % 2 == 0)).unwrap();
        f.pwrite(&tagged(i, 0, 8192), 0).unwrap();
    }
    vol.checkpoint().unwrap();
    for i in 6..10u64 {
        let f = vol.open_file(&format!("/f{i}"), flags(true)).unwrap();
        f.pwrite(&tagged(i, 0, 4096 * (i as usize - 4)), 0).unwrap();
    }
    vol.unlink("/f1").unwrap();
    vol.sync().unwrap();
    drop(vol);
    let want = {
        let v =
            Volume::open(Arc::new(cut(&mem, CutPolicy::KeepEverything)) as Arc<dyn BlockDevice>)
                .unwrap();
        read_volume(&v, u64::MAX).unwrap()
    };
    // How many reads does a mount make?
    let probe = Arc::new(cut(&mem, CutPolicy::KeepEverything));
    let r0 = probe.counters().snapshot().reads;
    let v = Volume::open(probe.clone() as Arc<dyn BlockDevice>).unwrap();
    let mount_reads = probe.counters().snapshot().reads - r0;
    drop(v);
    let r1 = probe.counters().snapshot().reads;
    let _ = iomapfs_fs::fsck::check(probe.clone() as Arc<dyn BlockDevice>).unwrap();
    let fsck_reads = probe.counters().snapshot().reads - r1;
    assert!(mount_reads > 0 && fsck_reads > 0);

    for k in 0..mount_reads.max(fsck_reads) + 2 {
        let ctx = format!("read #{k} fails");
        run_case("device_errors", k, &ctx, || {
            // Mount.
            let dev = Arc::new(cut(&mem, CutPolicy::KeepEverything));
            dev.inject(FaultRule::new(FaultOp::Read).skip(k).count(1));
            match Volume::open(dev.clone() as Arc<dyn BlockDevice>) {
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    stats.add("mount_errors", 1);
                }
                Ok(v) => {
                    dev.clear_faults();
                    let st = read_volume(&v, u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_eq!(st, want, "{ctx}: mount succeeded but the volume differs (a read error treated as the end of the journal?)");
                    stats.add("mount_ok_exact", 1);
                }
            }
            // Fsck.
            let dev = Arc::new(cut(&mem, CutPolicy::KeepEverything));
            dev.inject(FaultRule::new(FaultOp::Read).skip(k).count(1));
            match iomapfs_fs::fsck::check(dev.clone() as Arc<dyn BlockDevice>) {
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    stats.add("fsck_errors", 1);
                }
                Ok(r) if !r.is_clean() => stats.add("fsck_reported_problems", 1),
                Ok(_) if k >= fsck_reads => stats.add("fsck_clean_after_last_read", 1),
                Ok(r) => panic!(
                    "{ctx}: fsck says clean although read #{k} of {fsck_reads} failed: {r:?}"
                ),
            }
        });
    }
    stats.add("mount_reads", mount_reads);
    stats.add("fsck_reads", fsck_reads);
    stats.print("failed_reads_during_mount_and_fsck", t0.elapsed());
}

/// Random workloads with a random fault injected at a random moment: run
/// until the first error, then cut power several ways and check the crash
/// model (synced state intact, nothing stale, fsck clean).
#[test]
fn random_faults_in_random_workloads() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("device_errors");
    let cases = seeds.count(env_u64("IOMAPFS_FAULT_CASES", 300));
    let stats = Stats::default();
    for i in 0..cases {
        let seed = seeds.case(i);
        run_case("device_errors", seed, "random fault workload", || {
            random_fault_case(seed, &stats)
        });
    }
    stats.print("random_faults_in_random_workloads", t0.elapsed());
}

/// Seeds that once failed, run every time: a writeback pass stopped by a
/// failed write past the on-disk EOF converted the blocks of writes still
/// in flight behind it, leaving written extents past the EOF it did not
/// raise (fsck: "written extent ... lies past EOF").
#[test]
fn random_fault_regression_seeds() {
    let stats = Stats::default();
    for seed in [
        272050056189264650,
        9323095112769864077,
        9690982593764621591,
        18040251313977014635,
    ] {
        run_case("device_errors", seed, "random fault workload", || {
            random_fault_case(seed, &stats)
        });
    }
}

fn random_fault_case(seed: u64, stats: &Stats) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let fua = rng.gen_bool(0.5);
    let geo = if rng.gen_bool(0.5) {
        Geometry::default_4k()
    } else {
        Geometry::random(&mut rng)
    };
    let mem = geo.formatted_device(SIZE, fua, rng.gen());
    let l = layout(&*dynd(&mem));
    let cfg = WorkloadCfg {
        live_check: 0.0,
        ..WorkloadCfg::default()
    };
    let mut wl = Workload::new(dynd(&mem), SmallRng::seed_from_u64(rng.gen()), cfg);
    let before = rng.gen_range(0..40);
    for _ in 0..before {
        assert!(
            wl.step(),
            "seed={seed}: op failed before any fault: {:?}",
            wl.failed
        );
    }
    let op = [FaultOp::Write, FaultOp::Flush, FaultOp::Read, FaultOp::Any][rng.gen_range(0..4)];
    let mut rule = FaultRule::new(op).skip(rng.gen_range(0..30));
    if rng.gen_bool(0.6) {
        rule = rule.count(rng.gen_range(1..4));
    }
    if op != FaultOp::Flush && rng.gen_bool(0.6) {
        let r = match rng.gen_range(0..3) {
            0 => l.journal.clone(),
            1 => l.slots[rng.gen_range(0..2)].clone(),
            _ => l.data.clone(),
        };
        rule = rule.range(r);
    }
    let desc = format!("{rule:?}");
    mem.inject(rule);
    let mut after = 0;
    while after < 60 && wl.step() {
        after += 1;
        watchdog().beat();
    }
    mem.clear_faults();
    stats.add("cases", 1);
    if let Some(f) = &wl.failed {
        stats.add("errors_reported", 1);
        assert!(!f.is_empty());
    } else {
        stats.add("fault_never_surfaced", 1);
    }
    let w = wl.h.progress.window();
    // Crash states first; then poke the failed volume (must not panic).
    let states: Vec<(CutPolicy, MemDevice)> = policies(rng.gen())
        .into_iter()
        .map(|p| (p, cut(&mem, p)))
        .collect();
    if let Some(vol) = wl.vol.as_ref() {
        let _ = vol.sync();
        let _ = vol.readdir("/");
        let _ = vol.statfs();
        for h in &wl.handles {
            let mut b = [0u8; 512];
            let _ = h.file.pread(&mut b, 0);
            let _ = h.file.pwrite(&b, 0);
            let _ = h.file.fsync();
        }
    }
    wl.handles.clear();
    wl.vol.take();
    for (p, dev) in states {
        let ctx = format!(
            "seed={seed} ({}) fault {desc}, failure {:?}, cut {p:?}, window lo={} completed={} hi={}",
            geo.describe(), wl.failed, w.lo, w.completed, w.hi
        );
        let dev: Arc<dyn BlockDevice> = Arc::new(dev);
        fsck_clean(dev.clone(), &ctx);
        let vol = Volume::open(dev).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
        let st = read_volume(&vol, u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        if let Err(e) = wl.h.check(&st, w) {
            panic!("{ctx}:\n{e}");
        }
        stats.add("states_verified", 1);
    }
    let _ = LBS;
}
