//! Minimal, deterministic reproductions of bugs the randomized suites found.
//! Each test names the suite and seed that found it.

mod common;

use std::sync::Arc;

use blockdev::memory::MemDevice;
use blockdev::BlockDevice;
use common::dev::{LBS, MIB};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

fn volume(size: u64) -> (Arc<MemDevice>, Volume) {
    let mem = Arc::new(MemDevice::new(size, LBS));
    let dev: Arc<dyn BlockDevice> = mem.clone();
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    (mem, Volume::open(dev).unwrap())
}

fn create(vol: &Volume, path: &str, direct: bool) -> iomapfs_fs::File {
    vol.open_file(
        path,
        OpenFlags {
            create: true,
            direct,
            ..OpenFlags::default()
        },
    )
    .unwrap()
}

/// Fills the volume with `/fill` until fewer than `leave` bytes are free.
fn fill_until(vol: &Volume, leave: u64) {
    let f = create(vol, "/fill", true);
    let mut off = 0u64;
    let chunk = vec![0x11u8; 4096];
    while vol.statfs().free_bytes > leave {
        f.pwrite(&chunk, off).unwrap();
        off += 4096;
    }
}

/// model.rs seed 15416893705820559583: a direct write over [allocated
/// blocks, then holes needing more space than is free] fails with ENOSPC but
/// has already written the allocated part. ENOSPC must change nothing (or
/// the write must return a short count).
#[test]
fn enospc_write_changes_nothing() {
    let (_mem, vol) = volume(8 * MIB);
    let f = create(&vol, "/a", true);
    // Allocated, written blocks [49152, 81920) holding 0xAA.
    f.pwrite(&vec![0xAAu8; 32768], 49152).unwrap();
    fill_until(&vol, 28672);
    let free = vol.statfs().free_bytes;
    // [52224, 114176): 29696 bytes over allocated blocks, then holes
    // [81920, 114688) needing 32 KiB, more than is free.
    let data = vec![0x55u8; 114176 - 52224];
    let r = f.pwrite(&data, 52224);
    let mut back = vec![0u8; 32768];
    f.pread(&mut back, 49152).unwrap();
    match r {
        Ok(n) => assert!(
            n < data.len(),
            "a write needing 32 KiB with {free} bytes free fully succeeded"
        ),
        Err(e) => {
            assert_eq!(e.errno(), libc::ENOSPC, "{e}");
            let changed = back.iter().position(|&b| b != 0xAA);
            assert_eq!(
                changed,
                None,
                "pwrite returned ENOSPC ({e}) but changed the file at offset {:?}",
                changed.map(|c| c + 49152)
            );
            assert_eq!(f.stat().unwrap().size, 81920, "ENOSPC changed the size");
        }
    }
}

/// power_cut.rs seed 2868883630031805849 (live check after a crash-like
/// remount): an overwrite past EOF inside the EOF block lands on the device,
/// its size change is lost in a crash, and a later extension exposes those
/// bytes — they were past EOF, so they must read as zeros (invariant 1).
#[test]
fn extension_after_crash_zeroes_stale_tail_of_eof_block() {
    let mut bad = Vec::new();
    for extend in ["truncate", "write_past", "fallocate"] {
        let (mem, vol) = volume(8 * MIB);
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let f = create(&vol, "/f", false);
        f.pwrite(&[0xAAu8; 1000], 0).unwrap();
        f.fsync().unwrap();
        // Inside the allocated block 0, past EOF: data lands, size is a
        // journal record that is never committed.
        f.pwrite(&[0xBBu8; 3000], 1000).unwrap();
        drop(f);
        drop(vol); // crash: no unmount, no sync
        let vol = Volume::open(dev).unwrap();
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        let size = f.stat().unwrap().size;
        if size != 1000 {
            // The size change survived: nothing to test on this build.
            assert_eq!(size, 4000, "{extend}");
            continue;
        }
        match extend {
            "truncate" => f.truncate(8192).unwrap(),
            "write_past" => {
                f.pwrite(&[0xCCu8; 10], 8192).unwrap();
            }
            _ => f.fallocate(0, 8192, false).unwrap(),
        }
        let mut buf = vec![0u8; 4096];
        f.pread(&mut buf, 0).unwrap();
        assert!(buf[..1000].iter().all(|&b| b == 0xAA), "{extend}");
        if let Some(i) = buf[1000..].iter().position(|&b| b != 0) {
            bad.push(format!(
                "{extend}: byte {} = {:#04x}",
                i + 1000,
                buf[i + 1000]
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "bytes past the recovered EOF (1000) reappear after extending the file: {bad:?}"
    );
}

/// A device after a crash: `/f` holds 1024 durable bytes of 0xAA, and
/// 0xBB at 1024..4096 of its written block 0 from a direct write past EOF
/// whose size change the crash lost (the bytes landed in place; the size
/// stayed an uncommitted journal record). Those bytes are stale: no size
/// may come to cover them unzeroed.
fn lost_size_change_in_the_eof_block() -> Arc<MemDevice> {
    use common::dev::{cut, dynd, format, marked_device, CutPolicy};
    let mem = marked_device(8 * MIB, false);
    format(dynd(&mem));
    let vol = Volume::open(dynd(&mem)).unwrap();
    let f = create(&vol, "/f", true);
    f.pwrite(&[0xAAu8; 1024], 0).unwrap();
    f.fsync().unwrap();
    f.pwrite(&[0xBBu8; 3072], 1024).unwrap();
    let crashed = Arc::new(cut(&mem, CutPolicy::KeepEverything));
    drop((f, vol));
    crashed
}

/// power_cut.rs seed 1755934452553282436 (policies suite): a buffered DSYNC
/// write past EOF zeroes, in the cache, the old EOF block's tail (where a
/// write whose size change a crash lost left its bytes), but wrote back only
/// its own range — whose completion raised the on-disk size over that
/// still-dirty tail. A power cut after the DSYNC write returned then showed
/// the lost write's bytes inside the file (invariants 1 and 4).
#[test]
fn dsync_buffered_extension_writes_back_the_zeroed_eof_gap() {
    use common::dev::{cut, dynd, CutPolicy};
    let crashed = lost_size_change_in_the_eof_block();

    let vol = Volume::open(dynd(&crashed)).unwrap();
    let dsync = OpenFlags {
        dsync: true,
        ..OpenFlags::default()
    };
    let f = vol.open_file("/f", dsync).unwrap();
    assert_eq!(
        f.stat().unwrap().size,
        1024,
        "the crash kept the size change"
    );
    f.pwrite(&[0xCCu8; 10], 8192).unwrap();
    // Only what was flushed survives: the DSYNC write made size 8202 durable.
    let after_cut = Arc::new(cut(&crashed, CutPolicy::KeepNothing));
    drop((f, vol));

    let vol = Volume::open(dynd(&after_cut)).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    assert_eq!(f.stat().unwrap().size, 8202, "DSYNC write lost");
    let mut got = vec![0u8; 8202];
    assert_eq!(f.pread(&mut got, 0).unwrap(), 8202);
    let mut want = vec![0u8; 8202];
    want[..1024].fill(0xAA);
    want[8192..].fill(0xCC);
    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!(
            "after the cut, byte {i} is {:#04x}, want {:#04x} (0xbb: the lost write's stale bytes in the EOF gap)",
            got[i], want[i]
        );
    }
}

// ---- hostile metadata with valid checksums (hostile.rs, semantic cases) ----

use iomapfs_fs::checkpoint::{other_slot, read_newest_checkpoint, write_checkpoint, Checkpoint};
use iomapfs_fs::journal::JournalWriter;
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::types::Record;
use iomapfs_fs::{fsck, Error};

/// A clean volume holding `/a` (inode 2, 8 KiB written).
fn clean_volume_with_a() -> Arc<MemDevice> {
    let (mem, vol) = volume(4 * MIB);
    let f = create(&vol, "/a", false);
    f.pwrite(&[7u8; 8192], 0).unwrap();
    drop(f);
    vol.unmount().unwrap();
    mem
}

/// Appends `records` as one valid batch after the newest checkpoint.
fn append_records(mem: &MemDevice, records: &[Record]) {
    let sb = read_superblock(mem).unwrap();
    let (_, ckpt) = read_newest_checkpoint(mem, &sb).unwrap();
    let mut w = JournalWriter::new(
        &sb,
        ckpt.journal_start,
        ckpt.journal_seq,
        ckpt.journal_chain,
    );
    w.append(mem, records).unwrap();
    mem.flush().unwrap();
}

/// Mount and fsck of `mem`, each under catch_unwind: `Err` if either panics
/// or mount fails with something other than a Corrupt error.
fn mount_and_fsck(mem: Arc<MemDevice>) -> Result<(), String> {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let dev: Arc<dyn BlockDevice> = mem;
    let d = dev.clone();
    let f = catch_unwind(AssertUnwindSafe(move || fsck::check(d).map(|r| r.problems)));
    let d = dev.clone();
    let m = catch_unwind(AssertUnwindSafe(move || match Volume::open(d) {
        Ok(v) => common::volstate::read_volume(&v, 1 << 20).map(|_| "mounted"),
        Err(e @ Error::Corrupt { .. }) => Ok(Box::leak(e.to_string().into_boxed_str()) as &str),
        Err(e) => Err(format!("mount failed with a non-Corrupt error: {e:?}")),
    }));
    match (f, m) {
        (Err(_), _) => Err("fsck panicked".into()),
        (_, Err(_)) => Err("mount or readdir panicked".into()),
        (_, Ok(Err(e))) => Err(e),
        // Mounting what fsck calls broken: the record was applied, not refused.
        (Ok(Ok(problems)), Ok(Ok("mounted"))) if !problems.is_empty() => Err(format!(
            "mounted although fsck reports problems: {problems:?}"
        )),
        (Ok(Err(e)), Ok(Ok("mounted"))) => {
            Err(format!("mounted although fsck cannot load the volume: {e}"))
        }
        _ => Ok(()),
    }
}

/// A journal record with a file range not aligned to the block size must be
/// refused as corruption at replay; it reaches `ExtentMap` asserts instead
/// (a panic in debug builds, unchecked extent surgery in release builds).
#[test]
fn replay_rejects_unaligned_record_ranges() {
    let mut bad = Vec::new();
    for rec in [
        Record::CompleteWrite {
            ino: 2,
            file_off: 100,
            len: 1,
            min_size: 8192,
            mtime_ns: 1,
        },
        Record::Punch {
            ino: 2,
            file_off: 100,
            len: 1,
            mtime_ns: 1,
        },
        Record::Punch {
            ino: 2,
            file_off: 0,
            len: 0,
            mtime_ns: 1,
        },
    ] {
        let mem = clean_volume_with_a();
        append_records(&mem, std::slice::from_ref(&rec));
        if let Err(e) = mount_and_fsck(mem) {
            bad.push(format!("{rec:?}: {e}"));
        }
    }
    assert!(
        bad.is_empty(),
        "hostile journal records mishandled:\n  {}",
        bad.join("\n  ")
    );
}

/// Huge values in a valid record: `min_size` near u64::MAX makes fsck
/// overflow (`size.div_ceil(block) * block`), an inode number of u64::MAX
/// overflows `next_ino` (`ino + 1`).
#[test]
fn replay_and_fsck_survive_huge_values() {
    let mut bad = Vec::new();
    for rec in [
        Record::CompleteWrite {
            ino: 2,
            file_off: 0,
            len: 4096,
            min_size: u64::MAX,
            mtime_ns: 1,
        },
        Record::SetSize {
            ino: 2,
            size: u64::MAX,
            mtime_ns: 1,
        },
        Record::Create {
            ino: u64::MAX,
            parent: 1,
            name: "big".into(),
            kind: iomapfs_fs::FileKind::Regular,
            attrs: iomapfs_fs::types::InodeAttrs::default(),
            target: vec![],
        },
    ] {
        let mem = clean_volume_with_a();
        append_records(&mem, std::slice::from_ref(&rec));
        if let Err(e) = mount_and_fsck(mem) {
            bad.push(format!("{rec:?}: {e}"));
        }
    }
    assert!(
        bad.is_empty(),
        "hostile journal records mishandled:\n  {}",
        bad.join("\n  ")
    );
}

/// A checkpoint whose linked inode has nlink 0: mount frees it as an orphan
/// but leaves the directory entry, and readdir then indexes a missing inode
/// (`volume.rs` readdir: `inodes[&ino]` panics). For the root (nlink 0) the
/// mount error is `InvalidArgument("metadata update")`, not `Corrupt`.
#[test]
fn checkpoint_with_nlink_zero_on_linked_inode() {
    let mut bad = Vec::new();
    for ino in [2u64, 1] {
        let mem = clean_volume_with_a();
        let sb = read_superblock(&*mem).unwrap();
        let (slot, ckpt) = read_newest_checkpoint(&*mem, &sb).unwrap();
        let mut image = ckpt.image.clone();
        image
            .inodes
            .iter_mut()
            .find(|i| i.ino == ino)
            .unwrap()
            .nlink = 0;
        let c = Checkpoint {
            generation: ckpt.generation + 1,
            image,
            ..ckpt.clone()
        };
        write_checkpoint(&*mem, &sb, other_slot(slot), &c).unwrap();
        if let Err(e) = mount_and_fsck(mem) {
            bad.push(format!("nlink 0 on inode {ino}: {e}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n  "));
}

/// Replacing an xattr with a shorter value: the metadata image shrinks by
/// the difference (it underflowed, and panicked where overflow checks are
/// on, as in debug builds and a debug mount's FUSE handler), and the value
/// survives a remount.
#[test]
fn replacing_an_xattr_with_a_shorter_value() {
    let (mem, vol) = volume(16 << 20);
    let f = create(&vol, "/x", false);
    let ino = f.ino();
    vol.set_xattr(ino, "user.a", &[1u8; 4000], iomapfs_fs::XattrSet::Any)
        .unwrap();
    vol.set_xattr(ino, "user.a", b"x", iomapfs_fs::XattrSet::Replace)
        .unwrap();
    assert_eq!(vol.get_xattr(ino, "user.a").unwrap(), b"x");
    drop(f);
    vol.unmount().unwrap();
    let dev: Arc<dyn BlockDevice> = mem;
    let again = Volume::open(dev).unwrap();
    assert_eq!(again.get_xattr(ino, "user.a").unwrap(), b"x");
}

/// A failed writeback of the zeroed EOF gap left the block clean in the
/// cache (as Linux does) while a later block's completion raised the
/// on-disk size over it, so the stale bytes of a write a crash lost became
/// file data — with no power cut, only one failed device write (invariants
/// 1 and 6). A failed write past the on-disk EOF now stays dirty and caps
/// the size; the next writeback retries it.
#[test]
fn failed_writeback_of_the_eof_gap_never_exposes_stale_bytes() {
    use blockdev::{FaultOp, FaultRule};
    use common::dev::{cut, dynd, CutPolicy};
    let crashed = lost_size_change_in_the_eof_block();

    let vol = Volume::open(dynd(&crashed)).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    assert_eq!(
        f.stat().unwrap().size,
        1024,
        "the crash kept the size change"
    );
    let block0 = f.fiemap().unwrap()[0].addr;
    f.pwrite(&[0xCCu8; 10], 8192).unwrap();
    crashed.inject(
        FaultRule::new(FaultOp::Write)
            .range(block0..block0 + 4096)
            .count(1),
    );
    assert!(f.fsync().is_err(), "the failed writeback was not reported");
    // A commit now (another file's fsync, a checkpoint) makes what the
    // pass did to the size durable: it must not cover block 0.
    vol.sync_metadata().unwrap();
    let cut_now = Arc::new(cut(&crashed, CutPolicy::KeepNothing));
    crashed.clear_faults();
    // The device works again: the next fsync makes everything durable.
    f.fsync().unwrap();
    drop(f);
    vol.unmount().unwrap();

    for (dev, after) in [
        (&cut_now, "a power cut after the failed fsync"),
        (&crashed, "unmount"),
    ] {
        let vol = Volume::open(dynd(dev)).unwrap();
        let f = vol.open_file("/f", OpenFlags::default()).unwrap();
        let size = f.stat().unwrap().size as usize;
        let mut got = vec![0u8; size];
        assert_eq!(f.pread(&mut got, 0).unwrap(), size);
        assert!(
            got[..1024].iter().all(|&b| b == 0xAA),
            "{after}: fsync'd bytes lost"
        );
        if let Some(i) = got
            .get(1024..size.min(8192))
            .and_then(|gap| gap.iter().position(|&b| b != 0))
        {
            panic!(
                "{after}: size {size}: byte {} is {:#04x} (0xbb: a lost write's stale bytes)",
                i + 1024,
                got[i + 1024]
            );
        }
        if after == "unmount" {
            assert_eq!(size, 8202, "{after}: the retried writeback's size was lost");
            assert!(got[8192..].iter().all(|&b| b == 0xCC), "{after}: data lost");
        }
    }
}

/// A block whose writeback failed past the on-disk EOF stays dirty: a
/// direct read over it writes back first and fails with the error while
/// the device keeps failing, and never returns the device's bytes there
/// (the stale bytes of a write a crash lost); once the device works, the
/// direct read sees the cached zeros, written.
#[test]
fn direct_read_after_a_failed_eof_gap_writeback_never_shows_stale_bytes() {
    use blockdev::{FaultOp, FaultRule};
    use common::dev::dynd;
    let crashed = lost_size_change_in_the_eof_block();

    let vol = Volume::open(dynd(&crashed)).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let block0 = f.fiemap().unwrap()[0].addr;
    f.pwrite(&[0xCCu8; 10], 8192).unwrap();
    // Every write of block 0 fails until the faults are cleared.
    crashed.inject(FaultRule::new(FaultOp::Write).range(block0..block0 + 4096));
    assert!(f.fsync().is_err(), "the failed writeback was not reported");
    let direct = vol
        .open_file(
            "/f",
            OpenFlags {
                direct: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    let mut got = vec![0u8; 4096];
    for attempt in 0..2 {
        match direct.pread(&mut got, 0) {
            Err(_) => {}
            Ok(n) => assert!(
                got[1024..n].iter().all(|&b| b == 0),
                "attempt {attempt}: a direct read returned the device's stale bytes"
            ),
        }
    }
    crashed.clear_faults();
    assert_eq!(direct.pread(&mut got, 0).unwrap(), 4096);
    assert!(got[..1024].iter().all(|&b| b == 0xAA));
    assert!(got[1024..].iter().all(|&b| b == 0), "the gap is not zeros");
}

// ---- a lost journal tail (hostile.rs, "Anywhere" cases) ----

/// Zeroes every journal block that differs from `before`: the batches
/// written since, destroyed by damage that leaves nothing later to betray
/// them (replay cannot tell this from a torn tail; mount rolls back).
fn destroy_journal_since(mem: &MemDevice, before: &[u8]) {
    let sb = read_superblock(mem).unwrap();
    let j = sb.layout.journal;
    let now = mem.snapshot();
    let bs = u64::from(sb.layout.block_size);
    let mut destroyed = 0;
    for at in (j.start..j.end()).step_by(bs as usize) {
        let r = at as usize..(at + bs) as usize;
        if now[r.clone()] != before[r] {
            mem.write_at(&vec![0u8; bs as usize], at, blockdev::WriteMode::Normal)
                .unwrap();
            destroyed += 1;
        }
    }
    assert!(destroyed > 0, "no journal batch was written");
    mem.flush().unwrap();
}

/// hostile.rs seeds 13233700533005615450 and 2870636268195935472: damage
/// that destroyed the last journal batches (an unlink, then a write that
/// allocated) mounted the older state, in which the unlinked file held the
/// bytes the later write had put in its freed blocks. Space freed since the
/// last checkpoint must not be reused, so a rolled-back file holds only its
/// own bytes. Also after a mount that replayed the unlink: the replayed free
/// is only in the journal as well.
#[test]
fn lost_journal_tail_never_shows_another_files_bytes() {
    for replay_first in [false, true] {
        let (mem, vol) = volume(4 * MIB);
        let dev: Arc<dyn BlockDevice> = mem.clone();
        let victim_bytes = vec![0x5Au8; 3 * 4096];
        create(&vol, "/victim", true)
            .pwrite(&victim_bytes, 0)
            .unwrap();
        vol.unmount().unwrap();
        let checkpointed = mem.snapshot();
        let mut vol = Volume::open(dev.clone()).unwrap();
        vol.unlink("/victim").unwrap();
        vol.sync().unwrap();
        if replay_first {
            drop(vol); // crash; the unlink is replayed from the journal
            vol = Volume::open(dev.clone()).unwrap();
            assert!(vol.open_file("/victim", OpenFlags::default()).is_err());
        }
        // Best fit would place these three blocks exactly where the victim's were.
        let f = create(&vol, "/new", true);
        f.pwrite(&vec![0xC3u8; 3 * 4096], 0).unwrap();
        f.fsync().unwrap();
        drop(f);
        drop(vol);
        destroy_journal_since(&mem, &checkpointed);
        let vol = Volume::open(dev.clone()).unwrap();
        let st = common::volstate::read_volume(&vol, 1 << 20).unwrap();
        let victim = st
            .files
            .get("/victim")
            .expect("the unlink was in the destroyed journal: /victim is back");
        assert!(
            victim.data == victim_bytes,
            "replay_first={replay_first}: the rolled-back /victim holds bytes it never had \
             (first difference at {:?}: another file's data in its freed blocks)",
            common::first_diff(&victim.data, &victim_bytes)
        );
    }
}

/// Review of a53ce31, B1: a buffered write of part of a block, made while
/// a direct write of that block is in flight, fills the rest of the block
/// from the device (the old bytes) and dirties the whole block; its
/// writeback used to put those old bytes over the direct write's, although
/// the direct write had returned success. (The same could happen when the
/// buffered write landed between the direct write's flush of the cache and
/// its lock.) Now the direct write, once its data is on the device, copies
/// its bytes into the cached blocks it overlaps (`Mapping::write_through`):
/// the outcome is the buffered write, then the direct one.
#[test]
fn a_buffered_partial_write_racing_a_direct_write_never_undoes_it() {
    let (mem, vol) = volume(32 * MIB);
    let d = create(&vol, "/f", true);
    d.pwrite(&[0x11; 16 * 4096], 0).unwrap();
    d.punch_hole(10 * 4096, 4096).unwrap();
    d.fsync().unwrap();
    let b = create(&vol, "/f", false);
    for (what, block) in [("overwrite", 8u64), ("allocating write", 10)] {
        let new = vec![0x70 + block as u8; 4096];
        let paused = mem.pause_before(blockdev::FaultRule::new(blockdev::FaultOp::Write));
        let writer = {
            let d = d.try_clone().unwrap();
            let new = new.clone();
            std::thread::spawn(move || d.pwrite(&new, block * 4096).unwrap())
        };
        paused.wait_reached();
        b.pwrite(&[9u8; 100], block * 4096 + 10).unwrap();
        paused.resume();
        writer.join().unwrap();
        b.fsync().unwrap();
        let mut got = vec![0u8; 4096];
        d.pread(&mut got, block * 4096).unwrap();
        let mut direct_then_buffered = new.clone();
        direct_then_buffered[10..110].fill(9);
        assert!(
            got == new || got == direct_then_buffered,
            "{what}: neither order: the block starts {:x?}",
            &got[..12]
        );
    }
}
