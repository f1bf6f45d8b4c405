//! The clean-unmount mark: a clean unmount records in the superblock that
//! the journal holds nothing after its final checkpoint, so the next mount
//! skips scanning the journal region for later batches; the next session
//! clears the mark, durably, before its first journal append.
//!
//! What must hold: a mount after a clean unmount reads (almost) none of the
//! journal region; a mount after an unclean stop scans it and still finds
//! damage before later batches; and at no power cut is a mark the next
//! mount would trust on disk together with a batch appended after the
//! checkpoint it names.

mod common;

use std::sync::{Arc, Mutex};

use blockdev::memory::MemDevice;
use blockdev::{BlockDevice, WriteMode};
use common::dev::{cut, fsck_clean, marked_device, CutPolicy, RecDevice, TapDevice, Tapped, MIB};
use common::history::tagged;
use common::volstate::read_volume;
use iomapfs_fs::checkpoint::{read_checkpoints, Checkpoint};
use iomapfs_fs::journal::{self, LaterBatches};
use iomapfs_fs::superblock::{
    read_superblock, read_superblock_or_backup, write_superblock, BackupUse, CleanMark, Superblock,
};
use iomapfs_fs::{Error, FormatOptions, OpenFlags, Volume};

const DEV_BYTES: u64 = 16 * MIB;
const JOURNAL_BYTES: u64 = 2 * MIB;

fn formatted() -> Arc<MemDevice> {
    let mem = marked_device(DEV_BYTES, false);
    let opts = FormatOptions {
        journal_bytes: Some(JOURNAL_BYTES),
        ..FormatOptions::default()
    };
    Volume::format(mem.clone(), &opts).unwrap();
    mem
}

/// Writes `tag`'s bytes to `path` and commits them: one journal batch.
fn write_and_sync(vol: &Volume, path: &str, tag: u64) {
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    vol.open_file(path, create)
        .unwrap()
        .pwrite(&tagged(tag, 0, 3000), 0)
        .unwrap();
    vol.sync().unwrap();
}

/// A volume with a file, cleanly unmounted, and its superblock: marked
/// for the newest checkpoint.
fn cleanly_unmounted() -> (Arc<MemDevice>, Superblock) {
    let mem = formatted();
    let vol = Volume::open(mem.clone()).unwrap();
    write_and_sync(&vol, "/a", 1);
    vol.unmount().unwrap();
    let sb = read_superblock(&*mem).unwrap();
    assert_eq!(sb.clean_mark, Some(mark_for(&newest(&*mem, &sb))));
    (mem, sb)
}

/// The mark that says the journal holds nothing after `ckpt`.
fn mark_for(ckpt: &Checkpoint) -> CleanMark {
    CleanMark {
        generation: ckpt.generation,
        journal_start: ckpt.journal_start,
        journal_seq: ckpt.journal_seq,
        journal_chain: ckpt.journal_chain,
    }
}

fn newest(dev: &dyn BlockDevice, sb: &Superblock) -> Checkpoint {
    read_checkpoints(dev, sb).unwrap().checkpoint
}

/// Flips a bit in the header of the batch at device byte `at`.
fn damage_block(mem: &MemDevice, sb: &Superblock, at: u64) {
    let mut block = vec![0u8; sb.block_size() as usize];
    mem.read_at(&mut block, at).unwrap();
    block[20] ^= 0x40;
    mem.write_at(&block, at, WriteMode::Fua).unwrap();
}

/// Bytes of the journal region a mount of `mem` reads.
fn journal_bytes_read_by_mount(mem: &Arc<MemDevice>) -> u64 {
    let (sb, _) = read_superblock_or_backup(&**mem, BackupUse::IfDamaged).unwrap();
    let journal = sb.layout.journal;
    let rec = RecDevice::new(mem.clone());
    let vol = Volume::open(rec.clone()).unwrap();
    let read = rec
        .since(0)
        .iter()
        .filter(|r| !r.write && !r.flush && journal.contains(r.offset))
        .map(|r| r.len)
        .sum();
    drop(vol);
    read
}

#[test]
fn a_mount_after_a_clean_unmount_skips_the_journal_scan() {
    let (mem, sb) = cleanly_unmounted();
    let bs = sb.block_size();
    // Replay reads where the first batch would be (and the region start,
    // where it would be had it wrapped): nothing more.
    let read = journal_bytes_read_by_mount(&mem);
    assert!(read <= 2 * bs, "{read} bytes of the journal read");
    // No mount wrote anything: the mark is still there, and trusted again.
    assert_eq!(journal_bytes_read_by_mount(&mem), read);

    // After an unclean stop, the whole region is read.
    let vol = Volume::open(mem.clone()).unwrap();
    write_and_sync(&vol, "/b", 2);
    drop(vol);
    assert_eq!(read_superblock(&*mem).unwrap().clean_mark, None);
    let read = journal_bytes_read_by_mount(&mem);
    assert!(read >= JOURNAL_BYTES, "{read} bytes of the journal read");
}

#[test]
fn the_first_append_clears_the_mark_once_and_a_crash_after_it_still_finds_damage() {
    let (mem, sb) = cleanly_unmounted();
    let journal = sb.layout.journal;

    let rec = RecDevice::new(mem.clone());
    let vol = Volume::open(rec.clone()).unwrap();
    let mounted = rec.mark();
    assert!(read_superblock(&*mem).unwrap().clean_mark.is_some());
    for tag in 2..6 {
        write_and_sync(&vol, &format!("/f{tag}"), tag);
    }
    let requests = rec.since(mounted);
    let writes: Vec<_> = requests.iter().filter(|r| r.write).collect();
    let superblock_writes: Vec<_> = writes
        .iter()
        .enumerate()
        .filter(|(_, r)| r.offset == 0)
        .collect();
    assert_eq!(
        superblock_writes.len(),
        1,
        "one superblock write per session, whatever the appends"
    );
    let first_journal_write = writes
        .iter()
        .position(|r| journal.contains(r.offset))
        .unwrap();
    assert!(
        superblock_writes[0].0 < first_journal_write,
        "the mark is cleared before the first batch is written"
    );
    assert_eq!(read_superblock(&*mem).unwrap().clean_mark, None);
    drop(vol);

    // The first batch after the checkpoint is damaged: replay stops before
    // it, and only the scan sees the batches written after it.
    let ckpt = newest(&*mem, &sb);
    let first_batch = journal.start + ckpt.journal_start;
    damage_block(&mem, &sb, first_batch);
    match Volume::open(mem.clone()) {
        Err(Error::Corrupt { reason, .. }) => {
            assert!(reason.contains("written later"), "{reason}")
        }
        Err(e) => panic!("not the damage: {e}"),
        Ok(_) => panic!("mounted over damaged committed records"),
    }
}

#[test]
fn only_a_mark_naming_the_newest_checkpoint_skips_the_scan() {
    let mem = formatted();
    let vol = Volume::open(mem.clone()).unwrap();
    for tag in 1..4 {
        write_and_sync(&vol, &format!("/f{tag}"), tag);
    }
    drop(vol);
    let sb = read_superblock(&*mem).unwrap();
    let ckpt = newest(&*mem, &sb);
    let first_batch = sb.layout.journal.start + ckpt.journal_start;
    damage_block(&mem, &sb, first_batch);
    let exact = mark_for(&ckpt);
    let others: [fn(&mut CleanMark); 4] = [
        |m| m.generation += 1,
        |m| m.journal_start += 4096,
        |m| m.journal_seq += 1,
        |m| m.journal_chain ^= 1,
    ];
    for (i, other) in others.iter().enumerate() {
        let mut mark = exact;
        other(&mut mark);
        let marked = Superblock {
            clean_mark: Some(mark),
            ..sb.clone()
        };
        write_superblock(&*mem, &marked).unwrap();
        assert!(
            matches!(Volume::open(mem.clone()), Err(Error::Corrupt { .. })),
            "case {i}: a mark for another checkpoint skipped the scan"
        );
    }
    // The exact mark is trusted: what makes clearing it before any append
    // necessary.
    let marked = Superblock {
        clean_mark: Some(exact),
        ..sb.clone()
    };
    write_superblock(&*mem, &marked).unwrap();
    Volume::open(mem.clone()).unwrap();
}

#[test]
fn fsck_scans_and_keeps_the_mark() {
    let (mem, marked) = cleanly_unmounted();
    let rec = RecDevice::new(mem.clone());
    let report = fsck_clean(rec.clone(), "after a clean unmount");
    let generation = newest(&*mem, &marked).generation;
    assert_eq!(report.checkpoint_generation, generation);
    let note = format!("marked cleanly unmounted after checkpoint generation {generation}");
    assert!(
        report.notes.iter().any(|n| n.contains(&note)),
        "{:?}",
        report.notes
    );
    let requests = rec.since(0);
    assert!(requests.iter().all(|r| !r.write), "fsck wrote");
    let journal_read: u64 = requests
        .iter()
        .filter(|r| marked.layout.journal.contains(r.offset))
        .map(|r| r.len)
        .sum();
    assert!(journal_read >= JOURNAL_BYTES, "fsck skipped the scan");
    assert_eq!(read_superblock(&*mem).unwrap(), marked);
}

/// A mount that read the backup superblock (block 0 damaged) writes the
/// backup's copy over block 0 before its first journal append, as `fsck
/// --repair` would: whatever mark block 0 held is gone before a batch
/// exists. It sets no mark at unmount, so the next mount scans.
#[test]
fn a_mount_from_the_backup_restores_block_0_before_its_first_append() {
    let (mem, sb) = cleanly_unmounted();
    let mut block0 = vec![0u8; sb.block_size() as usize];
    mem.read_at(&mut block0, 0).unwrap();
    block0[70] ^= 0x01;
    mem.write_at(&block0, 0, WriteMode::Fua).unwrap();
    let vol = Volume::open(mem.clone()).unwrap();
    assert_eq!(vol.mount_warnings().len(), 1, "{:?}", vol.mount_warnings());
    let mut unchanged = vec![0u8; block0.len()];
    mem.read_at(&mut unchanged, 0).unwrap();
    assert!(unchanged == block0, "block 0 written before any append");
    write_and_sync(&vol, "/b", 2);
    vol.unmount().unwrap();
    assert_eq!(read_superblock(&*mem).unwrap(), sb.without_clean_mark());
    let read = journal_bytes_read_by_mount(&mem);
    assert!(read >= JOURNAL_BYTES, "{read} bytes of the journal read");
}

/// Power cuts at every write and flush from a clean unmount through the
/// next session's first appends (the final checkpoint, the mark, the
/// session's clearing write, its batches), each with the pending writes
/// lost, kept, torn, or kept up to a point. In every crash state the
/// volume mounts with fsck clean, and where the superblock holds a mark
/// naming the newest checkpoint (one mount trusts), a full scan finds no
/// batch after that checkpoint.
#[test]
fn power_cut_around_setting_and_clearing_the_mark() {
    let mem = formatted();
    let tap = TapDevice::new(mem.clone(), 7);
    let vol = Volume::open(tap.clone()).unwrap();
    write_and_sync(&vol, "/a", 1);
    // Records for the unmount's checkpoint to journal.
    vol.open_file(
        "/b",
        OpenFlags {
            create: true,
            ..OpenFlags::default()
        },
    )
    .unwrap();
    let states: Arc<Mutex<Vec<(String, MemDevice)>>> = Arc::default();
    let mut request = 0u64;
    let collected = states.clone();
    tap.set_hook(Some(Box::new(move |dev: &MemDevice, what: Tapped| {
        request += 1;
        let mut states = collected.lock().unwrap();
        for policy in [
            CutPolicy::KeepNothing,
            CutPolicy::KeepEverything,
            CutPolicy::TornAll(request),
            CutPolicy::Prefix(request),
        ] {
            states.push((
                format!("before request {request} ({what:?}), {policy:?}"),
                cut(dev, policy),
            ));
        }
    })));
    vol.unmount().unwrap();
    let vol = Volume::open(tap.clone()).unwrap();
    for tag in 2..5 {
        write_and_sync(&vol, &format!("/f{tag}"), tag);
    }
    tap.set_hook(None);
    drop(vol);
    let mut states = std::mem::take(&mut *states.lock().unwrap());
    states.push((
        "after the session".to_string(),
        cut(&mem, CutPolicy::KeepNothing),
    ));
    let (mut trusted, mut appended) = (0, 0);
    for (ctx, state) in states {
        let state = Arc::new(state);
        let sb = read_superblock(&*state).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let ckpt = newest(&*state, &sb);
        let end = journal::replay(
            &*state,
            &sb,
            ckpt.journal_start,
            ckpt.journal_seq,
            ckpt.journal_chain,
            LaterBatches::Scan,
            &mut |_, _| Ok(()),
        )
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        if end.batches > 0 {
            appended += 1;
        }
        if sb.clean_mark == Some(mark_for(&ckpt)) {
            trusted += 1;
            assert_eq!(
                end.batches, 0,
                "{ctx}: a trusted mark with batches after its checkpoint"
            );
        }
        fsck_clean(state.clone(), &ctx);
        let vol = Volume::open(state.clone()).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        read_volume(&vol, u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    }
    eprintln!("states: trusted {trusted}, appended {appended}");
    assert!(trusted > 0, "no crash state held a trusted mark");
    assert!(
        appended > 0,
        "no crash state held a batch after the checkpoint"
    );
}

/// There is no read-only mount: a volume with a read-only-compatible feature
/// this build does not know is refused whole, and nothing is written to it
/// (a build that wrote it anyway could leave a mark like the clean-unmount
/// one standing over its own journal appends).
#[test]
fn an_unknown_read_only_compatible_feature_refuses_the_mount_unwritten() {
    let (mem, marked) = cleanly_unmounted();
    let unknown = Superblock {
        features_ro_compat: marked.features_ro_compat | 1 << 40,
        ..marked
    };
    write_superblock(&*mem, &unknown).unwrap();
    let rec = RecDevice::new(mem.clone());
    let err = Volume::open(rec.clone()).err().expect("mounted");
    assert!(
        matches!(&err, Error::NotIomapfs { reason } if reason.contains("read-only-compatible")),
        "{err}"
    );
    assert!(
        rec.since(0).iter().all(|r| !r.write),
        "the refused mount wrote"
    );
    assert_eq!(read_superblock(&*mem).unwrap(), unknown);
}

/// Found in review: a commit whose batch does not fit the (empty) journal
/// goes through a checkpoint that replaces the journal writer
/// (`write_checkpoint`, `!journaled`), and the new writer no longer knows
/// that block 0 still holds the mark. The session's later appends then lie
/// behind a mark still on disk: the invariant this file checks is broken
/// (inert only while the newer checkpoint stays readable).
#[test]
fn a_checkpoint_that_replaces_the_journal_writer_still_clears_the_mark() {
    let (mem, _) = cleanly_unmounted();
    let vol = Volume::open(mem.clone()).unwrap();
    // ~3 MiB of xattr records against a 2 MiB journal: the queue's size
    // estimate (48 bytes a record) stays far below the commit threshold,
    // so nothing commits until the sync below, whose batch cannot fit.
    let value = vec![0x5a; 60 * 1024];
    for f in 0..3 {
        let path = format!("/x{f}");
        let ino = vol
            .open_file(
                &path,
                OpenFlags {
                    create: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap()
            .ino();
        for i in 0..16 {
            vol.set_xattr(ino, &format!("user.v{i}"), &value, Default::default())
                .unwrap();
        }
    }
    let before = newest(&*mem, &read_superblock(&*mem).unwrap()).generation;
    vol.sync_metadata().unwrap();
    let sb = read_superblock(&*mem).unwrap();
    assert!(
        newest(&*mem, &sb).generation > before,
        "the oversized commit went through a checkpoint"
    );
    // The first append of the session.
    write_and_sync(&vol, "/after", 9);
    let sb = read_superblock(&*mem).unwrap();
    drop(vol);
    assert_eq!(
        sb.clean_mark, None,
        "a journal batch was appended while block 0 still holds the clean-unmount mark"
    );
}

/// Found in review: a mount that reads the backup because block 0 could
/// not be *read* (a transient device error, not damage) leaves block 0's
/// mark standing while it appends. Once block 0 reads again, the next mount
/// trusts that mark (it names the newest checkpoint: the session wrote
/// none), and damage to the session's first batch then silently drops every
/// later committed batch instead of failing the mount.
#[test]
fn a_mount_from_the_backup_after_a_read_error_leaves_no_trusted_mark() {
    use blockdev::memory::{FaultOp, FaultRule};
    let (mem, sb) = cleanly_unmounted();
    let journal = sb.layout.journal;
    mem.inject(
        FaultRule::new(FaultOp::Read)
            .range(0..sb.block_size())
            .count(1),
    );
    let vol = Volume::open(mem.clone()).unwrap();
    assert_eq!(vol.mount_warnings().len(), 1, "{:?}", vol.mount_warnings());
    for tag in 2..6 {
        write_and_sync(&vol, &format!("/f{tag}"), tag);
    }
    drop(vol); // power cut: no checkpoint since the mount
    let ckpt = newest(&*mem, &sb);
    damage_block(&mem, &sb, journal.start + ckpt.journal_start);
    match Volume::open(mem.clone()) {
        Err(Error::Corrupt { .. }) => {}
        Err(e) => panic!("not the damage: {e}"),
        Ok(_) => panic!(
            "mounted over damaged committed records: block 0's mark ({:?}) was trusted",
            read_superblock(&*mem).unwrap().clean_mark
        ),
    }
}
