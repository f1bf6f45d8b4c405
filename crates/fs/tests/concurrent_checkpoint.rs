//! A checkpoint runs while writers go on, and power is cut in the middle of
//! it (issue 13, item 1).
//!
//! The checkpoint's slot write is held on the device (done, not flushed,
//! not returned) while another thread overwrites half of a synced file and
//! appends to it with allocating writes. Those writes must complete while
//! the checkpoint is held: a checkpoint that kept the metadata lock across
//! its write would block them, and the test fails instead of hanging.
//! Power is then cut on copies of the device in several ways, and after
//! the checkpoint and an fsync once more. Every crash state must mount,
//! pass fsck, and read only data the file really held: the synced pattern
//! or the new one in the overwritten half, the synced pattern elsewhere, no
//! stale bytes, and a size the durable metadata vouches for.

mod common;

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use blockdev::memory::{FaultOp, FaultRule, MemDevice, PendingWrite, Survival};
use blockdev::BlockDevice;
use common::dev::{cut, fsck_clean, marked_device, CutPolicy};
use common::history::MARKER;
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const MIB: u64 = 1 << 20;
const BS: usize = 4096;
/// Blocks written and synced before the checkpoint.
const SYNCED_BLOCKS: u64 = 64;
/// Blocks appended (allocating writes) while the checkpoint is held.
const APPENDED_BLOCKS: u64 = 32;
/// How long the writers may take while the checkpoint is held: far more
/// than they need, and a bound instead of a hang when they are blocked.
const WRITERS_PATIENCE: Duration = Duration::from_secs(60);

fn block(tag: u8, index: u64) -> Vec<u8> {
    let mut b = vec![tag; BS];
    b[..8].copy_from_slice(&index.to_le_bytes());
    b
}

fn direct() -> OpenFlags {
    OpenFlags {
        direct: true,
        ..OpenFlags::default()
    }
}

fn create_direct(vol: &Volume, path: &str) -> iomapfs_fs::File {
    vol.open_file(
        path,
        OpenFlags {
            create: true,
            ..direct()
        },
    )
    .unwrap()
}

/// What a crash state may hold. `new_data_durable`: the writes made during
/// the checkpoint were fsync'd before the cut.
fn check_state(dev: MemDevice, ctx: &str, new_data_durable: bool) {
    let dev: Arc<dyn BlockDevice> = Arc::new(dev);
    fsck_clean(dev.clone(), ctx);
    let vol = Volume::open(dev).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
    let file = vol
        .open_file("/f", direct())
        .unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
    let size = file.stat().unwrap().size;
    let synced = SYNCED_BLOCKS * BS as u64;
    let full = (SYNCED_BLOCKS + APPENDED_BLOCKS) * BS as u64;
    if new_data_durable {
        assert_eq!(size, full, "{ctx}: fsync'd appends lost");
    } else {
        // Appends were never synced: the size may cover them only if their
        // metadata reached the disk, which nothing here made durable.
        assert_eq!(
            size, synced,
            "{ctx}: size not vouched for by durable metadata"
        );
    }
    let mut buf = vec![0u8; BS];
    for i in 0..size / BS as u64 {
        file.pread(&mut buf, i * BS as u64).unwrap();
        assert!(
            !buf.windows(MARKER.len()).any(|w| w == MARKER),
            "{ctx}: block {i} holds stale device bytes"
        );
        let old = block(b'A', i);
        let new = block(b'B', i);
        let appended = block(b'C', i);
        let ok = if i >= SYNCED_BLOCKS {
            buf == appended
        } else if i < SYNCED_BLOCKS / 2 {
            if new_data_durable {
                buf == new
            } else {
                // Overwrites in flight at the cut: each sector old or new.
                buf.chunks(512)
                    .zip(old.chunks(512).zip(new.chunks(512)))
                    .all(|(got, (o, n))| got == o || got == n)
            }
        } else {
            buf == old
        };
        assert!(
            ok,
            "{ctx}: block {i} holds neither what was synced nor what was written"
        );
    }
    vol.unmount().unwrap();
}

#[test]
fn checkpoint_runs_beside_writers_and_survives_a_power_cut_in_its_middle() {
    let mem = marked_device(16 * MIB, false);
    let dev: Arc<dyn BlockDevice> = mem.clone();
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev).unwrap();
    let file = create_direct(&vol, "/f");
    for i in 0..SYNCED_BLOCKS {
        file.pwrite(&block(b'A', i), i * BS as u64).unwrap();
    }
    file.fsync().unwrap();

    let layout = vol.superblock().layout.clone();
    let slots = layout.checkpoint_slots[0].start
        ..layout.checkpoint_slots[1].start + layout.checkpoint_slots[1].len;
    let held = mem.pause_after(FaultRule::new(FaultOp::Write).range(slots.clone()));
    let checkpointer = {
        let vol = vol.clone();
        std::thread::spawn(move || vol.checkpoint())
    };
    held.wait_reached();

    // The checkpoint's slot write is on the device, unflushed, and has not
    // returned: write beside it.
    let (done_tx, done_rx) = channel();
    let writer = {
        let file = file.try_clone().unwrap();
        std::thread::spawn(move || {
            for i in 0..SYNCED_BLOCKS / 2 {
                file.pwrite(&block(b'B', i), i * BS as u64).unwrap();
            }
            for i in SYNCED_BLOCKS..SYNCED_BLOCKS + APPENDED_BLOCKS {
                file.pwrite(&block(b'C', i), i * BS as u64).unwrap();
            }
            done_tx.send(()).unwrap();
        })
    };
    if done_rx.recv_timeout(WRITERS_PATIENCE).is_err() {
        held.resume();
        panic!(
            "writers made no progress in {WRITERS_PATIENCE:?} while a checkpoint write was in \
             flight: the checkpoint blocks I/O"
        );
    }
    writer.join().unwrap();

    let in_slots = |w: &PendingWrite| w.offset() < slots.end && w.offset() + w.len() > slots.start;
    let mid_checkpoint: Vec<(&str, MemDevice)> = vec![
        (
            "mid-checkpoint, nothing kept",
            cut(&mem, CutPolicy::KeepNothing),
        ),
        (
            "mid-checkpoint, everything kept",
            cut(&mem, CutPolicy::KeepEverything),
        ),
        ("mid-checkpoint, torn", cut(&mem, CutPolicy::TornAll(7))),
        ("mid-checkpoint, seeded", cut(&mem, CutPolicy::Seeded(11))),
        (
            "mid-checkpoint, the slot kept and every data write lost",
            mem.power_cut(&mut |w| {
                if in_slots(w) {
                    Survival::Kept
                } else {
                    Survival::Lost
                }
            }),
        ),
    ];
    held.resume();
    checkpointer.join().unwrap().unwrap();
    let after_checkpoint = cut(&mem, CutPolicy::KeepNothing);
    file.fsync().unwrap();
    let after_fsync = cut(&mem, CutPolicy::KeepNothing);

    for (ctx, state) in mid_checkpoint {
        check_state(state, ctx, false);
    }
    check_state(
        after_checkpoint,
        "after the checkpoint, before fsync",
        false,
    );
    check_state(after_fsync, "after the checkpoint and fsync", true);
    drop(file);
    vol.unmount().unwrap();
}

/// The space a checkpoint gives back after many punches (a busy range per
/// punched extent: one record each, so no two join) goes back in many
/// short holds of the metadata lock, not one long one that every read and
/// write of every file would wait for.
#[test]
fn a_checkpoint_gives_space_back_in_short_holds_of_the_metadata_lock() {
    const EXTENTS: u64 = 20_000;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(512 * MIB, 4096));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev).unwrap();
    let f = create_direct(&vol, "/f");
    for i in 0..EXTENTS {
        f.fallocate(2 * i * BS as u64, BS as u64, false).unwrap();
    }
    vol.checkpoint().unwrap();
    let free_before = vol.statfs().free_bytes;
    for i in 0..EXTENTS {
        f.punch_hole(2 * i * BS as u64, BS as u64).unwrap();
    }
    vol.sync_metadata().unwrap();
    vol.take_longest_lock_holds();
    vol.checkpoint().unwrap();
    let holds = vol.take_longest_lock_holds();
    // 20k ranges take milliseconds; a hold is about 20 µs.
    assert!(
        holds.checkpoint_release_steps >= 10,
        "{EXTENTS} ranges given back in {holds:?}"
    );
    // All of it, not just the first steps' (less what the checkpoint's
    // own pages took).
    let given_back = vol.statfs().free_bytes - free_before;
    assert!(given_back >= EXTENTS * BS as u64 - MIB, "{given_back}");
}
