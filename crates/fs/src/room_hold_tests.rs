//! Tests of the room held for pending work ([`crate::delalloc`]) through a
//! whole volume: what a direct write holds goes back at its completion.
//!
//! Here rather than in `delalloc`: they drive whole volumes, and `volume`
//! reaches `delalloc` through `mount_state`.

use std::sync::Arc;

use blockdev::memory::{FaultOp, FaultRule, MemDevice};

use crate::mount_state::BaseGrowth;
use crate::volume::{FormatOptions, MountOptions, Volume};
use crate::OpenFlags;

fn quiet() -> MountOptions {
    MountOptions::foreground_only()
}

/// A 16 MiB volume with extent pages, mounted without background threads,
/// free space ready.
fn paged_volume() -> (Arc<MemDevice>, Volume) {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    (dev, vol)
}

/// A direct write inside fallocated space holds the splits its completion
/// makes; once it returns they are in the map, so nothing stays held even
/// while the file is open and never synced.
#[test]
fn a_direct_write_releases_its_split_holds_at_completion() {
    let (_dev, vol) = paged_volume();
    let file = vol
        .open_file(
            "/f",
            OpenFlags {
                create: true,
                direct: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    file.fallocate(0, 1 << 20, false).unwrap();
    let held = || {
        let meta = vol.inner.meta.read();
        (
            meta.held_extents,
            meta.direct_splits.len(),
            meta.split_hold.len(),
        )
    };
    let extents = || {
        vol.inner
            .meta
            .read()
            .state
            .inode(file.ino())
            .unwrap()
            .extents
            .len()
    };
    assert_eq!(extents(), 1);
    // Both ends inside the unwritten extent: two splits.
    file.pwrite(&[1u8; 4096], 8192).unwrap();
    assert_eq!(extents(), 3);
    assert_eq!(held(), (0, 0, 0), "held after the write completed");
    // Its start inside the unwritten extent before: one split, and its
    // end merges with the written one after.
    file.pwrite(&[2u8; 2048], 4096 + 2048).unwrap();
    assert_eq!(extents(), 3);
    assert_eq!(held(), (0, 0, 0));
    let mut back = vec![0u8; 12288];
    file.pread(&mut back, 0).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0));
    assert!(back[4096..6144].iter().all(|&b| b == 0));
    assert!(back[6144..8192].iter().all(|&b| b == 2));
    assert!(back[8192..].iter().all(|&b| b == 1));
    drop(file);
    vol.unmount().unwrap();
}

/// A base takes no room reserved for delayed allocation: with a buffered
/// write reserving all it can of the unreserved space (within a block:
/// what it holds grows the room for pages), a base (its
/// pages placed, held before it writes them) leaves free space at least
/// what is reserved, and the write's writeback, which allocates without
/// checking, succeeds meanwhile. The base's pages come from runs of free
/// space; a run larger than the pages still to place took room the base
/// reserve does not cover.
#[test]
fn a_base_takes_no_room_reserved_for_delayed_allocation() {
    let (dev, vol) = paged_volume();
    let create = |direct| OpenFlags {
        create: true,
        direct,
        ..OpenFlags::default()
    };
    // Paged, and every chunk changed since no base: the base writes a
    // page for each (a few hundred KiB with unit-test chunks).
    let big = vol.open_file("/big", create(true)).unwrap();
    for k in 0..400u64 {
        big.fallocate(2 * k * 4096, 4096, false).unwrap();
    }
    let unreserved = vol.inner.meta.read().unreserved_bytes().unwrap();
    let buffered = vol.open_file("/data", create(false)).unwrap();
    // The largest write accepted, to a block.
    let (mut accepted, mut refused) = (0, unreserved + 4096);
    while refused - accepted > 4096 {
        let len = ((accepted + refused) / 2 / 4096 * 4096).max(accepted + 4096);
        match buffered.pwrite(&vec![7u8; len as usize], 0) {
            Ok(_) => accepted = len,
            Err(err) if err.errno() == libc::ENOSPC => refused = len,
            Err(err) => panic!("{err}"),
        }
        buffered.truncate(0).unwrap();
    }
    let data = vec![7u8; accepted as usize];
    buffered.pwrite(&data, 0).unwrap();
    let (free_before, set) = {
        let meta = vol.inner.meta.read();
        let free = meta.alloc.allocator().unwrap().free_bytes();
        (free, meta.next_base_bytes(BaseGrowth::default()))
    };
    let data_area = vol.inner.sb.layout.data.start;
    let held = dev.pause_before(FaultRule::new(FaultOp::Write).range(data_area..u64::MAX));
    let base = std::thread::spawn({
        let vol = vol.clone();
        move || vol.inner.checkpoint_for_unmount()
    });
    held.wait_reached();
    let (free, reserved) = {
        let meta = vol.inner.meta.read();
        let free = meta.alloc.allocator().unwrap().free_bytes();
        (free, meta.delalloc_reserved)
    };
    assert!(
        free >= reserved,
        "free {free} < reserved {reserved} while the base holds its pages"
    );
    assert!(
        free_before - free <= set,
        "the base holds {} bytes, more than the {set} a base may take",
        free_before - free
    );
    buffered
        .fsync()
        .expect("writeback of reserved data while the base holds its room");
    held.resume();
    base.join().unwrap().unwrap();
    let mut back = vec![0u8; data.len()];
    buffered.pread(&mut back, 0).unwrap();
    assert!(back == data, "the buffered bytes read back");
    drop((big, buffered));
    vol.unmount().unwrap();
}
