//! A commit racing another thread's metadata changes, held open with the
//! memory device's pauses (no sleeps), then a power cut:
//!
//! - a commit marks as durable only the records it captured before its
//!   journal write; records another thread logs while that write is in
//!   flight stay dirty, so the next DSYNC write of that file commits them
//!   (invariant 2);
//! - a commit that runs between an allocating write's allocation and its
//!   data reaching the device makes the space durable as *unwritten*: the
//!   conversion (and the size) wait for the write's completion, so a power
//!   cut there shows zeros, never the device's stale bytes (invariants 1
//!   and 4);
//! - an unlink and an allocating write racing a commit: after the cut the
//!   unlinked file is gone or intact, never holding another file's bytes;
//! - an fsync while a checkpoint's slot write is held (before it reaches the
//!   device, or done but unflushed) returns without waiting for the
//!   checkpoint, and a power cut then keeps what it made durable, whichever
//!   checkpoint the mount finds.

mod common;

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use blockdev::memory::{FaultOp, FaultRule, MemDevice};
use blockdev::BlockDevice;
use common::dev::{cut, dynd, format, fsck_clean, marked_device, CutPolicy, MIB};
use common::history::{find_marker, tagged};
use common::volstate::read_volume;
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::{OpenFlags, Volume};

const SIZE: u64 = 8 * MIB;
const BLOCK: usize = 4096;

fn new_volume() -> (Arc<MemDevice>, Arc<Volume>) {
    let mem = marked_device(SIZE, false);
    format(dynd(&mem));
    let vol = Volume::open(dynd(&mem)).expect("open");
    (mem, Arc::new(vol))
}

fn open(vol: &Volume, path: &str, direct: bool, dsync: bool) -> iomapfs_fs::File {
    vol.open_file(
        path,
        OpenFlags {
            create: true,
            direct,
            dsync,
            ..OpenFlags::default()
        },
    )
    .unwrap_or_else(|e| panic!("open {path}: {e}"))
}

fn region(mem: &MemDevice, journal: bool) -> std::ops::Range<u64> {
    let l = read_superblock(mem).expect("superblock").layout;
    let r = if journal { l.journal } else { l.data };
    r.start..r.end()
}

/// Runs `during` while a `sync` from another thread has its journal write
/// done on the device but not returned (records to commit are made first,
/// so there is one), then lets the sync finish.
fn during_a_commit(mem: &MemDevice, vol: &Arc<Volume>, during: impl FnOnce()) {
    open(vol, "/other", false, false)
        .pwrite(b"pending metadata for the commit", 0)
        .unwrap();
    let held = mem.pause_after(FaultRule::new(FaultOp::Write).range(region(mem, true)));
    let committer = {
        let vol = vol.clone();
        thread::spawn(move || vol.sync())
    };
    held.wait_reached();
    during();
    held.resume();
    committer.join().unwrap().expect("sync");
}

/// Mounts what a power cut keeping nothing unflushed leaves; fsck first.
fn after_cut(mem: &MemDevice, ctx: &str) -> Volume {
    let dev: Arc<dyn BlockDevice> = Arc::new(cut(mem, CutPolicy::KeepNothing));
    fsck_clean(dev.clone(), ctx);
    Volume::open(dev).unwrap_or_else(|e| panic!("{ctx}: mount after the cut: {e}"))
}

/// A `sync` whose journal write is held on the device while this thread
/// allocates and writes `/x` (records logged mid-commit). Then a DSYNC
/// overwrite of `/x`: it returns only once `/x`'s allocation is durable.
#[test]
fn records_logged_during_a_commit_stay_dirty() {
    let (mem, vol) = new_volume();
    let x = open(&vol, "/x", true, false);
    // Allocating write, completed (converted and sized in memory) while the
    // commit's journal write is in flight.
    during_a_commit(&mem, &vol, || {
        x.pwrite(&tagged(1, 0, 2 * BLOCK), 0).unwrap();
    });
    // Mapped and within EOF in memory: a pure overwrite, unless the file
    // still has records to commit.
    let data = tagged(2, 0, 2 * BLOCK);
    open(&vol, "/x", true, true).pwrite(&data, 0).unwrap();
    let vol2 = after_cut(&mem, "dsync after a racing commit");
    let got = common::volstate::read_file(&vol2, "/x", u64::MAX).unwrap();
    assert!(
        got.data == data,
        "a DSYNC write returned, but after a power cut /x holds {} bytes{}: the commit that \
         raced /x's allocation marked /x's records durable without writing them",
        got.size,
        common::first_diff(&got.data, &data)
            .map(|d| format!(", differing at {d}"))
            .unwrap_or_default()
    );
}

/// An allocating write (direct, or buffered and written back by fsync) held
/// before its data reaches the device; another thread commits meanwhile;
/// power cut while the write is held.
#[test]
fn commit_between_allocation_and_completion_exposes_no_stale_bytes() {
    for (direct, len) in [(true, 3 * BLOCK), (true, 5000), (false, 3 * BLOCK)] {
        let ctx = format!("direct={direct} len={len}");
        let (mem, vol) = new_volume();
        let held = mem.pause_before(FaultRule::new(FaultOp::Write).range(region(&mem, false)));
        let writer = {
            let vol = vol.clone();
            thread::spawn(move || {
                let f = open(&vol, "/x", direct, false);
                f.pwrite(&tagged(3, 0, len), 0)?;
                // Buffered: writeback allocates and writes the data.
                f.fsync()
            })
        };
        held.wait_reached();
        // Another file's fsync commits the journal (one commit covers every
        // file) without waiting for `/x`'s writeback, as `sync` would.
        let other = open(&vol, "/other", false, false);
        other.pwrite(b"another file", 0).unwrap();
        other
            .fsync()
            .unwrap_or_else(|e| panic!("{ctx}: fsync of /other: {e}"));
        let vol2 = after_cut(&mem, &ctx);
        let st = read_volume(&vol2, u64::MAX).unwrap();
        if let Some(x) = st.files.get("/x") {
            assert!(
                find_marker(&x.data).is_none(),
                "{ctx}: /x reads the device's stale bytes at {:?} after a commit between its \
                 allocation and its data write (size {}): converted before the data landed",
                find_marker(&x.data),
                x.size
            );
            assert_eq!(
                x.size, 0,
                "{ctx}: /x's on-disk size covers a write that never reached the device \
                 (invariant 4: the size is raised at completion)"
            );
        }
        held.resume();
        writer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{ctx}: write: {e}"));
    }
}

/// `/victim` unlinked while a commit's journal write is held; once that
/// commit returns, `/new` allocates and writes (best fit would reuse the
/// victim's blocks); power cut before anything else commits, keeping
/// every unflushed write or none.
#[test]
fn unlink_racing_a_commit_never_shows_another_files_bytes() {
    for keep_everything in [false, true] {
        let ctx = format!("keep_everything={keep_everything}");
        let (mem, vol) = new_volume();
        let victim = tagged(4, 0, 3 * BLOCK);
        open(&vol, "/victim", true, false)
            .pwrite(&victim, 0)
            .unwrap();
        vol.sync().unwrap();
        during_a_commit(&mem, &vol, || vol.unlink("/victim").unwrap());
        open(&vol, "/new", true, false)
            .pwrite(&tagged(5, 0, 3 * BLOCK), 0)
            .unwrap();
        let policy = if keep_everything {
            CutPolicy::KeepEverything
        } else {
            CutPolicy::KeepNothing
        };
        let dev: Arc<dyn BlockDevice> = Arc::new(cut(&mem, policy));
        fsck_clean(dev.clone(), &ctx);
        let vol2 = Volume::open(dev).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
        let st = read_volume(&vol2, u64::MAX).unwrap();
        let v = st.files.get("/victim").unwrap_or_else(|| {
            panic!("{ctx}: the unlink was never committed, yet /victim is gone")
        });
        assert!(
            v.data == victim,
            "{ctx}: /victim, whose unlink never became durable, holds bytes it never had \
             (first difference at {:?}): its space was reused before the unlink was durable",
            common::first_diff(&v.data, &victim)
        );
    }
}

/// How long an fsync may take while a checkpoint is held: far more than it
/// needs, and a bound instead of a hang when it waits for the checkpoint.
const FSYNC_PATIENCE: Duration = Duration::from_secs(30);

/// A checkpoint whose slot write is held, with records queued when it
/// snapshots (`/queued`, written but never synced); meanwhile an allocating
/// write and fsync of `/synced`. The fsync must return while the
/// checkpoint is held. Held before the slot write reaches the device, a
/// power cut leaves the old checkpoint, so the fsync's records must replay
/// from the old checkpoint's journal, behind the new one's start; held
/// after, the fsync's flush makes the new slot durable too, and they
/// replay from the new checkpoint's start. Then the checkpoint finishes and
/// the state is checked once more.
#[test]
fn fsync_during_a_checkpoint_returns_and_survives_on_either_checkpoint() {
    for slot_write_done in [false, true] {
        let ctx = format!("slot write done={slot_write_done}");
        let (mem, vol) = new_volume();
        let before = tagged(6, 0, 3 * BLOCK);
        open(&vol, "/before", true, false)
            .pwrite(&before, 0)
            .unwrap();
        vol.sync().unwrap();
        let queued = tagged(7, 0, 2 * BLOCK);
        open(&vol, "/queued", true, false)
            .pwrite(&queued, 0)
            .unwrap();

        let layout = read_superblock(&*mem).expect("superblock").layout;
        let slots = layout.checkpoint_slots[0].start
            ..layout.checkpoint_slots[1].start + layout.checkpoint_slots[1].len;
        let rule = FaultRule::new(FaultOp::Write).range(slots);
        let held = if slot_write_done {
            mem.pause_after(rule)
        } else {
            mem.pause_before(rule)
        };
        let checkpointer = {
            let vol = vol.clone();
            thread::spawn(move || vol.checkpoint())
        };
        held.wait_reached();

        let synced = tagged(8, 0, 5 * BLOCK);
        let (done_tx, done_rx) = channel();
        let syncer = {
            let vol = vol.clone();
            let synced = synced.clone();
            thread::spawn(move || {
                let f = open(&vol, "/synced", true, false);
                let r = f.pwrite(&synced, 0).and_then(|_| f.fsync());
                done_tx.send(()).unwrap();
                r
            })
        };
        if done_rx.recv_timeout(FSYNC_PATIENCE).is_err() {
            held.resume();
            panic!(
                "{ctx}: an fsync did not return in {FSYNC_PATIENCE:?} while a checkpoint's slot \
                 write was held: commits wait for the checkpoint"
            );
        }
        syncer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{ctx}: write + fsync: {e}"));

        let check = |state: MemDevice, when: &str| {
            let ctx = format!("{ctx}, {when}");
            let dev: Arc<dyn BlockDevice> = Arc::new(state);
            fsck_clean(dev.clone(), &ctx);
            let vol = Volume::open(dev).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
            let read = |path: &str| {
                common::volstate::read_file(&vol, path, u64::MAX)
                    .unwrap_or_else(|e| panic!("{ctx}: {e}"))
                    .data
            };
            assert!(read("/before") == before, "{ctx}: /before changed");
            assert!(
                read("/synced") == synced,
                "{ctx}: /synced, written and fsync'd while the checkpoint was held, lost \
                 (first difference at {:?})",
                common::first_diff(&read("/synced"), &synced)
            );
            // Queued before the snapshot and never synced: the fsync's
            // commit made it durable with everything before it, or nothing
            // did; either way no stale bytes.
            let got = read("/queued");
            assert!(
                got.is_empty() || got == queued,
                "{ctx}: /queued holds {} bytes that are not what was written",
                got.len()
            );
            vol.unmount().unwrap();
        };
        for policy in [
            CutPolicy::KeepNothing,
            CutPolicy::KeepEverything,
            CutPolicy::TornAll(5),
            CutPolicy::Seeded(9),
        ] {
            check(cut(&mem, policy), &format!("mid-checkpoint cut {policy:?}"));
        }
        held.resume();
        checkpointer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{ctx}: checkpoint: {e}"));
        check(cut(&mem, CutPolicy::KeepNothing), "after the checkpoint");
    }
}
