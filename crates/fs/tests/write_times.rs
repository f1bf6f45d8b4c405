//! The times a write sets (see `write_times` in the crate): a write, direct
//! or buffered, overwrite or not, sets mtime and ctime when it runs;
//! writeback completing later never does; an explicit time set after the
//! write wins; and the time is durable after `fsync`, `sync`, an O_SYNC
//! write or a close followed by a commit, with a power cut right after.

use std::sync::Arc;

use blockdev::{AlignedBuf, BlockDevice, MemDevice, Survival};
use iomapfs_fs::{FormatOptions, OpenFlags, SetAttr, Stat, TimeSet, Timestamp, Volume};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
/// A time long past, set on the file before each write under test.
const LONG_AGO: Timestamp = Timestamp {
    sec: 1_000_000_000,
    nsec: 123_456_789,
};

fn device() -> Arc<MemDevice> {
    Arc::new(MemDevice::with_caps(32 * MIB, 512, true, false))
}

fn volume_on(dev: &Arc<MemDevice>) -> Volume {
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    Volume::open(dev.clone()).unwrap()
}

fn flags(direct: bool) -> OpenFlags {
    OpenFlags {
        create: true,
        direct,
        ..OpenFlags::default()
    }
}

fn set_mtime(vol: &Volume, st: &Stat, t: Timestamp) -> Stat {
    vol.set_attr(
        st.ino,
        &SetAttr {
            mtime: Some(TimeSet::At(t)),
            ..SetAttr::default()
        },
    )
    .unwrap()
}

/// `/f`: two written blocks, durable, its mtime [`LONG_AGO`].
fn old_file(vol: &Volume) {
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[1u8; 2 * BLOCK as usize], 0).unwrap();
    set_mtime(vol, &f.stat().unwrap(), LONG_AGO);
    vol.sync().unwrap();
}

fn now() -> Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    Timestamp {
        sec: d.as_secs() as i64,
        nsec: d.subsec_nanos(),
    }
}

/// The volume after a power cut that loses every write not yet flushed.
fn after_power_cut(dev: &MemDevice) -> Volume {
    Volume::open(Arc::new(dev.power_cut(&mut |_| Survival::Lost))).unwrap()
}

/// Asserts a write at `[before, after]` set `st`'s mtime and ctime.
fn assert_written_between(st: &Stat, before: Timestamp, after: Timestamp, what: &str) {
    assert!(
        before <= st.mtime && st.mtime <= after,
        "{what}: mtime {:?}, the write ran in {before:?}..={after:?}",
        st.mtime
    );
    assert!(
        st.ctime >= st.mtime,
        "{what}: ctime {:?} before mtime",
        st.ctime
    );
}

#[test]
fn every_write_sets_mtime_when_it_runs_and_writeback_leaves_it() {
    // (direct?, offset): overwrites of written blocks, and appends that a
    // completion must raise the size for.
    for (direct, offset) in [(true, 0), (false, 0), (true, 2 * BLOCK), (false, 2 * BLOCK)] {
        let what = format!("direct {direct}, write at {offset}");
        let dev = device();
        let vol = volume_on(&dev);
        old_file(&vol);
        let f = vol.open_file("/f", flags(direct)).unwrap();
        let before = now();
        f.pwrite(&[2u8; BLOCK as usize], offset).unwrap();
        let after = now();
        let written = f.stat().unwrap();
        assert_written_between(&written, before, after, &what);
        // Writeback (buffered) and the commit keep the write's time.
        vol.sync().unwrap();
        let synced = f.stat().unwrap();
        assert_eq!(
            (synced.mtime, synced.ctime),
            (written.mtime, written.ctime),
            "{what}: sync"
        );
        let back = after_power_cut(&dev).stat("/f").unwrap();
        assert_eq!(back.mtime, written.mtime, "{what}: after sync and a cut");
    }
}

#[test]
fn a_time_set_after_a_buffered_write_survives_its_writeback() {
    // cp -p, tar, rsync -t: write (still cached), then utimens, then the
    // data reaches the device.
    let dev = device();
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", flags(false)).unwrap();
    f.pwrite(&[3u8; 3 * BLOCK as usize + 5], 0).unwrap();
    set_mtime(&vol, &f.stat().unwrap(), LONG_AGO);
    drop(f);
    vol.sync().unwrap();
    assert_eq!(vol.stat("/f").unwrap().mtime, LONG_AGO, "after writeback");
    let back = after_power_cut(&dev).stat("/f").unwrap();
    assert_eq!((back.size, back.mtime), (3 * BLOCK + 5, LONG_AGO));
}

#[test]
fn fsync_makes_an_overwrites_time_durable_and_fdatasync_skips_it() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[4u8; BLOCK as usize], 0).unwrap();
    let written = f.stat().unwrap();
    assert!(written.mtime > LONG_AGO);
    // fdatasync: the data is durable already; a flush, no journal write.
    let before = dev.counters().snapshot();
    f.fdatasync().unwrap();
    let d = dev.counters().snapshot().since(&before);
    assert_eq!((d.writes, d.flushes), (0, 1), "fdatasync: {d:?}");
    assert_eq!(after_power_cut(&dev).stat("/f").unwrap().mtime, LONG_AGO);
    f.fsync().unwrap();
    assert_eq!(
        after_power_cut(&dev).stat("/f").unwrap().mtime,
        written.mtime,
        "after fsync and a cut"
    );
}

#[test]
fn an_o_sync_overwrite_is_durable_with_its_time() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    for direct in [true, false] {
        let f = vol
            .open_file(
                "/f",
                OpenFlags {
                    sync: true,
                    direct,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        f.pwrite(&[5u8; 100], 10).unwrap();
        let written = f.stat().unwrap().mtime;
        assert!(written > LONG_AGO, "direct {direct}: {written:?}");
        assert_eq!(
            after_power_cut(&dev).stat("/f").unwrap().mtime,
            written,
            "direct {direct}"
        );
        set_mtime(&vol, &f.stat().unwrap(), LONG_AGO);
    }
}

#[test]
fn the_last_close_and_a_chmod_keep_a_pending_time() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[6u8; BLOCK as usize], BLOCK).unwrap();
    let written = f.stat().unwrap();
    assert!(written.mtime > LONG_AGO);
    drop(f);
    assert_eq!(vol.stat("/f").unwrap().mtime, written.mtime, "after close");
    let chmod = vol
        .set_attr(
            written.ino,
            &SetAttr {
                mode: Some(0o600),
                ..SetAttr::default()
            },
        )
        .unwrap();
    assert_eq!(chmod.mtime, written.mtime, "chmod");
    assert!(chmod.ctime >= written.ctime, "chmod moves ctime on");
    vol.sync().unwrap();
    let back = after_power_cut(&dev).stat("/f").unwrap();
    assert_eq!((back.mode, back.mtime), (0o600, written.mtime));
}

#[test]
fn a_truncate_after_a_write_keeps_its_own_later_time() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[7u8; BLOCK as usize], 0).unwrap();
    let written = f.stat().unwrap().mtime;
    assert!(written > LONG_AGO);
    f.truncate(BLOCK).unwrap();
    let truncated = f.stat().unwrap().mtime;
    assert!(truncated > written, "{truncated:?} after {written:?}");
    f.fsync().unwrap();
    assert_eq!(f.stat().unwrap().mtime, truncated, "fsync");
    assert_eq!(after_power_cut(&dev).stat("/f").unwrap().mtime, truncated);
}

#[test]
fn a_commit_carries_every_pending_time() {
    // Any commit with records to write logs the pending times with them:
    // here a create's fsync makes an overwrite of another file durable
    // with its time.
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[8u8; BLOCK as usize], 0).unwrap();
    let written = f.stat().unwrap().mtime;
    assert!(written > LONG_AGO);
    vol.open_file("/g", flags(false)).unwrap().fsync().unwrap();
    assert_eq!(after_power_cut(&dev).stat("/f").unwrap().mtime, written);
}

#[test]
fn a_checkpoint_holds_the_pending_times() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    f.pwrite(&[8u8; BLOCK as usize], 0).unwrap();
    let written = f.stat().unwrap().mtime;
    assert!(written > LONG_AGO);
    vol.checkpoint().unwrap();
    assert_eq!(after_power_cut(&dev).stat("/f").unwrap().mtime, written);
}

#[test]
fn an_asynchronous_write_sets_mtime_when_submitted() {
    let dev = device();
    let vol = volume_on(&dev);
    old_file(&vol);
    let f = vol.open_file("/f", flags(true)).unwrap();
    let mut q = vol.io_queue(4).unwrap();
    let mut buf = AlignedBuf::new(BLOCK as usize, 4096).unwrap();
    buf.fill(9);
    let before = now();
    q.submit_write(&f, 0, buf, 1).unwrap();
    let after = now();
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut out).unwrap();
    }
    assert!(out.iter().all(|c| c.result.is_ok()));
    assert_written_between(&f.stat().unwrap(), before, after, "aio");
}
