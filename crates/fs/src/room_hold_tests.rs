//! Tests of the room held for pending work ([`crate::delalloc`]) through a
//! whole volume: what a direct write holds goes back at its completion.
//!
//! Here rather than in `delalloc`: they drive whole volumes, and `volume`
//! reaches `delalloc` through `mount_state`.

use std::sync::Arc;

use blockdev::memory::MemDevice;

use crate::volume::{FormatOptions, MountOptions, Volume};
use crate::OpenFlags;

fn quiet() -> MountOptions {
    MountOptions::foreground_only()
}

/// A direct write inside fallocated space holds the splits its completion
/// makes; once it returns they are in the map, so nothing stays held even
/// while the file is open and never synced.
#[test]
fn a_direct_write_releases_its_split_holds_at_completion() {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
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
