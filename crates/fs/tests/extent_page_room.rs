//! The room data writes leave for the next base's extent pages (room34):
//! counted in bytes, while each page is one contiguous allocation.

mod common;

use std::sync::Arc;

use blockdev::memory::MemDevice;
use common::dev::{checkpoint_through_a_base, dynd, fsck_clean};
use iomapfs_fs::{checkpoint, superblock, File, FormatOptions, OpenFlags, Result, Volume};

fn create() -> OpenFlags {
    OpenFlags {
        create: true,
        ..OpenFlags::default()
    }
}

fn enospc(r: Result<()>) -> bool {
    match r {
        Ok(()) => false,
        Err(err) if err.errno() == libc::ENOSPC => true,
        Err(err) => panic!("{err}"),
    }
}

/// Free space in single blocks: one-block files fill the volume, every
/// other one is deleted, a file of 300 one-block extents (past the inline
/// bound: paged, a page of two blocks) takes singles, and another takes
/// every larger run with 8 KiB writes, then singles down to the room kept.
/// Every write was accepted, so the bases that follow must find their
/// pages.
/// Both with every page listed in the root and with index pages.
#[test]
fn a_base_finds_its_pages_when_free_space_is_in_single_blocks() {
    for page_index in [false, true] {
        a_base_finds_its_pages_in_single_blocks(page_index);
    }
}

fn a_base_finds_its_pages_in_single_blocks(page_index: bool) {
    let dev = Arc::new(MemDevice::new(8 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        page_index,
        ..FormatOptions::default()
    };
    Volume::format(dynd(&dev), &opts).unwrap();
    let vol = Volume::open(dynd(&dev)).unwrap();
    let files = fill_with_singles(&vol, 4096);
    assert!(files > 1000, "{files} files");
    for n in (0..files).step_by(2) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    vol.checkpoint().unwrap();
    let big = vol.open_file("/big", create()).unwrap();
    let tail = vol.open_file("/tail", create()).unwrap();
    let mut extents = 0u64;
    while extents < 300
        && !enospc(
            big.pwrite(&[2u8; 4096], 2 * extents * 4096)
                .and_then(|_| big.fsync()),
        )
    {
        extents += 1;
    }
    assert!(extents > 200, "{extents} extents: a page of two blocks");
    let mut size = 0u64;
    while !enospc(tail.pwrite(&[3u8; 8192], size).and_then(|_| tail.fsync())) {
        size += 8192;
    }
    drop((big, tail));
    // Room for the renames below (a full volume may refuse a change that
    // grows the metadata, never a base), still in single blocks: a few of
    // the small files left, far apart.
    for n in (1..files).step_by(8).take(16) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    vol.checkpoint().unwrap();
    // The chain holds at most 16 deltas: one of these is a base.
    checkpoint_through_a_base(&vol, "/tail", "/liat");
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after the bases");
    // The big file's map comes back from its pages whole.
    let vol = Volume::open(dynd(&dev)).unwrap();
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    let mut block = vec![0u8; 4096];
    for k in 0..extents {
        big.pread(&mut block, 2 * k * 4096).unwrap();
        assert!(block.iter().all(|&b| b == 2), "extent {k} of /big");
    }
    vol.unmount().unwrap();
}

/// Fills the volume with one-block files `/s0`, `/s1`, ... of `block`
/// bytes each, synced, until ENOSPC; returns how many it made.
fn fill_with_singles(vol: &Volume, block: usize) -> u64 {
    let mut files = 0u64;
    while !enospc(
        vol.open_file(&format!("/s{files}"), create())
            .and_then(|f| f.pwrite(&vec![1u8; block], 0).and_then(|_| f.fsync())),
    ) {
        files += 1;
    }
    files
}

/// Writes `2`s into `file` from offset `from` until ENOSPC, each write as
/// large as the free space statfs reports (the room not counted), halved
/// until accepted: the last ones take it all, a piece per block. Returns
/// the bytes written.
fn write_until_enospc(vol: &Volume, file: &File, from: u64) -> u64 {
    let mut size = from;
    let mut len = vol.statfs().free_bytes / 512 * 512;
    while len >= 512 {
        if enospc(file.pwrite(&vec![2u8; len as usize], size).map(drop)) {
            len = len / 1024 * 512;
        } else {
            size += len;
            len = vol.statfs().free_bytes / 512 * 512;
        }
    }
    size - from
}

/// Free space in single blocks (every other one-block file deleted), then
/// large writes into a paged file until ENOSPC: each takes a piece per
/// block, far more extents than the few per write the first check
/// assumes. Direct writes are checked again with the pieces they got;
/// buffered ones hold, while delayed, room for as many pieces as free
/// ranges (writeback may take them all). So writeback and every base
/// after succeed.
fn fill_fragmented(direct: bool, page_index: bool) {
    let dev = Arc::new(MemDevice::new(4 << 20, 512));
    let opts = FormatOptions {
        block_size: 512,
        extent_pages: true,
        page_index,
        ..FormatOptions::default()
    };
    Volume::format(dynd(&dev), &opts).unwrap();
    let vol = Volume::open(dynd(&dev)).unwrap();
    let files = fill_with_singles(&vol, 512);
    for n in (0..files).step_by(2) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    vol.checkpoint().unwrap();
    let flags = OpenFlags { direct, ..create() };
    let big = vol.open_file("/big", flags).unwrap();
    let size = write_until_enospc(&vol, &big, 0);
    assert!(size >= 256 << 10, "{size} bytes written");
    big.fsync().unwrap();
    drop(big);
    // A few singles freed for the renames' changes (a full volume may
    // refuse those, never a base); the chain holds at most 16 deltas, so
    // some of these checkpoints are bases.
    for n in (1..files).step_by(2).take(16) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    vol.checkpoint().unwrap();
    checkpoint_through_a_base(&vol, "/big", "/bgi");
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after the bases");
    let vol = Volume::open(dynd(&dev)).unwrap();
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    let mut data = vec![0u8; size as usize];
    big.pread(&mut data, 0).unwrap();
    assert!(data.iter().all(|&b| b == 2));
    vol.unmount().unwrap();
}

#[test]
fn direct_writes_into_single_blocks_leave_the_room() {
    fill_fragmented(true, false);
    fill_fragmented(true, true);
}

#[test]
fn buffered_writes_into_single_blocks_leave_the_room() {
    fill_fragmented(false, false);
    fill_fragmented(false, true);
}

/// How a database or fio lays a file out: fallocate, then write it once
/// front to back with 4 KiB writes, no fsync between. Each write ends
/// inside the unwritten extent (a split held at its start) and its
/// conversion merges it into the written run before: the map stays at
/// two extents. A direct write's split holds go back at its completion;
/// a buffered one's stay until the file is idle, so they must be counted
/// in the chunks they can fill, not a page each. The file takes half the
/// device: every write fits.
fn lay_out_through_fallocated_space(direct: bool, page_index: bool) {
    let dev = Arc::new(MemDevice::new(64 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        page_index,
        ..FormatOptions::default()
    };
    Volume::format(dynd(&dev), &opts).unwrap();
    let vol = Volume::open(dynd(&dev)).unwrap();
    vol.wait_free_space().unwrap();
    let size = 32u64 << 20;
    let file = vol
        .open_file("/laid-out", OpenFlags { direct, ..create() })
        .unwrap();
    file.fallocate(0, size, false).unwrap();
    let block = [7u8; 4096];
    for off in (0..size).step_by(4096) {
        file.pwrite(&block, off)
            .unwrap_or_else(|e| panic!("write at {off} of {size}: {e}"));
    }
    file.fsync().unwrap();
    drop(file);
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after the layout");
}

#[test]
fn direct_writes_through_a_fallocated_file_never_meet_enospc() {
    lay_out_through_fallocated_space(true, false);
    lay_out_through_fallocated_space(true, true);
}

#[test]
fn buffered_writes_through_a_fallocated_file_never_meet_enospc() {
    lay_out_through_fallocated_space(false, false);
    lay_out_through_fallocated_space(false, true);
}

/// A paged file grown past both slots' bases: free space in single
/// blocks, both slots' bases written before the file (no pages), then
/// direct writes until ENOSPC with no base in between. The next base takes
/// a whole set of pages and frees only the slot's root, the one after
/// another set: the room must hold them both (a room of one set left the
/// test above, when no background base fell inside its writes, refusing
/// the renames after the first base). Background checkpoints are off, so
/// that the bases fall here each run.
#[test]
fn a_map_grown_past_both_slots_bases_leaves_room_for_the_bases_after() {
    for page_index in [false, true] {
        grown_past_both_slots_bases(page_index);
    }
}

fn grown_past_both_slots_bases(page_index: bool) {
    let (dev, vol, files) = fragmented_quiet_volume(page_index);
    // A base in each slot, neither listing a page.
    checkpoint_through_a_base(&vol, "/s1", "/t1");
    checkpoint_through_a_base(&vol, "/s1", "/t1");
    assert_eq!(
        slots_on_disk(&dev).1,
        [0, 0],
        "pages listed before the file"
    );
    grow_and_base_twice(&dev, &vol, files);
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after the bases");
}

/// After a map shrank: the newest base lists the pages of a file since
/// deleted, the other base only a root, so the next base frees a root
/// and the one after the deleted file's pages. The room must count what
/// the next base frees (the slot it replaces), not what the newest
/// lists. Sparse writes (a block at every other block) make the maps, so
/// that pages, not the root, are most of each base, and the journal is
/// large enough that no commit checkpoints in between.
#[test]
fn a_map_grown_after_another_was_deleted_leaves_room_for_the_bases_after() {
    for page_index in [false, true] {
        let dev = Arc::new(MemDevice::new(8 << 20, 512));
        let vol = quiet_volume(&dev, page_index, Some(2 << 20));
        let pad = vol.open_file("/pad", create()).unwrap();
        pad.pwrite(&[1u8; 16 << 10], 0).unwrap();
        pad.fsync().unwrap();
        drop(pad);
        let sparse = |path: &str, blocks: u64| {
            let file = vol.open_file(path, direct_create()).unwrap();
            for k in 0..blocks {
                file.pwrite(&[3u8; 512], 2 * k * 512).unwrap();
            }
            file
        };
        // Its pages more than the next file's: the room for that one
        // must not take them for freed by the next base.
        drop(sparse("/gone", 4000));
        // A base lists its pages (the first checkpoint after so large a
        // change is one), the other slot's lists none; then the file is
        // deleted with no base after (a delta: the chain has room).
        vol.checkpoint().unwrap();
        let (_, listed) = slots_on_disk(&dev);
        assert!(listed[0] > 0 && listed[1] == 0, "{listed:?}");
        vol.unlink("/gone").unwrap();
        vol.checkpoint().unwrap();
        assert_eq!(slots_on_disk(&dev), (1, listed), "a delta after the delete");
        let big = sparse("/big", 2000);
        let size = write_until_enospc(&vol, &big, 4 << 20);
        assert!(
            size >= 1 << 20,
            "{size} bytes written after the sparse ones"
        );
        drop(big);
        assert_eq!(slots_on_disk(&dev).1, listed, "no base in the writes");
        vol.unlink("/pad").unwrap();
        checkpoint_through_a_base(&vol, "/big", "/bgi");
        checkpoint_through_a_base(&vol, "/big", "/bgi");
        vol.unmount().unwrap();
        fsck_clean(dynd(&dev), "after the bases");
    }
}

/// A [`quiet_volume`] of 4 MiB filled with one-block files every other
/// one of which is deleted: free space in single blocks. Returns the
/// files made.
fn fragmented_quiet_volume(page_index: bool) -> (Arc<MemDevice>, Volume, u64) {
    let dev = Arc::new(MemDevice::new(4 << 20, 512));
    let vol = quiet_volume(&dev, page_index, None);
    let files = fill_with_singles(&vol, 512);
    for n in (0..files).step_by(2) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    (dev, vol, files)
}

/// `/big` written until ENOSPC with no base in between, a few singles
/// freed for the renames, and two bases through renames: each rename
/// grows the metadata a little, so one is refused if a base left free
/// space under the room.
fn grow_and_base_twice(dev: &MemDevice, vol: &Volume, files: u64) {
    let listed = slots_on_disk(dev).1;
    let big = vol.open_file("/big", direct_create()).unwrap();
    let size = write_until_enospc(vol, &big, 0);
    assert!(size >= 128 << 10, "{size} bytes written");
    drop(big);
    assert_eq!(slots_on_disk(dev).1, listed, "no base in the writes");
    for n in (3..files).step_by(2).take(16) {
        vol.unlink(&format!("/s{n}")).unwrap();
    }
    checkpoint_through_a_base(vol, "/big", "/bgi");
    checkpoint_through_a_base(vol, "/big", "/bgi");
}

/// `dev` formatted with 512-byte blocks, extent pages and the journal
/// given (`None`: the default), mounted with no background checkpoints
/// or commits: bases fall where a test puts them.
fn quiet_volume(dev: &Arc<MemDevice>, page_index: bool, journal_bytes: Option<u64>) -> Volume {
    let opts = FormatOptions {
        block_size: 512,
        extent_pages: true,
        page_index,
        journal_bytes,
        ..FormatOptions::default()
    };
    Volume::format(dynd(dev), &opts).unwrap();
    common::open_replayable(dynd(dev)).unwrap()
}

/// What the checkpoints on `dev` hold: the deltas after the newest base,
/// and the bytes of the pages and index pages each slot's base lists,
/// the newest slot's first.
fn slots_on_disk(dev: &MemDevice) -> (u32, [u64; 2]) {
    let sb = superblock::read_superblock(dev).unwrap();
    let newest = checkpoint::read_checkpoints(dev, &sb).unwrap();
    let listed =
        |slot: usize| checkpoint::listed_page_bytes(&sb, &newest.pages[slot], &newest.index[slot]);
    (
        newest.chain.deltas,
        [
            listed(newest.slot),
            listed(checkpoint::other_slot(newest.slot)),
        ],
    )
}

fn direct_create() -> OpenFlags {
    OpenFlags {
        direct: true,
        ..create()
    }
}
