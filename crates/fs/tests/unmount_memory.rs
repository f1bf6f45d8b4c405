//! What a process keeps after unmounting a volume whose metadata was
//! large. Alone in its test binary: it reads the process's resident set,
//! which other tests' allocations would move.

mod common;

use std::sync::Arc;

use blockdev::sync_backend::{SyncDevice, SyncOpenOptions};
use blockdev::BlockDevice;
use common::dev::{ScratchImage, MIB};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const BLOCK: u64 = 4096;

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).unwrap()
}

/// A file of many one-block extents (every other block fallocated) takes
/// tens of MiB of heap; after unmount the process is back near where it
/// started, whatever else it allocated meanwhile. (glibc's heap: what
/// `Volume::unmount` gives back is its `malloc_trim`.)
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn unmount_gives_the_heap_of_its_metadata_back() {
    // About 17 MB of checkpoint image: past the size at which unmount
    // trims.
    const EXTENTS: u64 = 600_000;
    // An image file: what the device holds is not the process's memory.
    let image = ScratchImage::new("unmount-memory", 4 * EXTENTS * BLOCK);
    let dynd: Arc<dyn BlockDevice> =
        Arc::new(SyncDevice::open(&image.path, SyncOpenOptions::default()).unwrap());
    Volume::format(dynd.clone(), &FormatOptions::default()).unwrap();
    let before = resident_bytes();
    let vol = Volume::open(dynd.clone()).unwrap();
    let file = vol
        .open_file(
            "/f",
            OpenFlags {
                create: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    // Allocations that outlive the volume, made while it grows: some sit
    // above its metadata in the heap.
    let mut kept = Vec::new();
    for i in 0..EXTENTS {
        file.fallocate(2 * i * BLOCK, BLOCK, false).unwrap();
        if i % 1024 == 0 {
            kept.push(vec![i as u8; 48]);
        }
    }
    let built = resident_bytes();
    drop(file);
    vol.unmount().unwrap();
    let after = resident_bytes();
    eprintln!(
        "resident: {} MiB before, {} MiB built, {} MiB after unmount",
        before / MIB,
        built / MIB,
        after / MIB
    );
    assert!(
        built > before + 40 * MIB,
        "the build took {} MiB: too little to tell",
        (built - before) / MIB
    );
    // The trim leaves some pages of the free heap resident (19-43 MiB of
    // 130-180 here, glibc's small free chunks among them); without it,
    // three quarters of the build stay.
    assert!(
        after < before + (built - before) / 2,
        "unmount kept {} of the build's {} MiB",
        (after.saturating_sub(before)) / MIB,
        (built - before) / MIB
    );

    // Mounted again, every chunk read, then let go without writing (as a
    // read-only mount does): the heap of what it read is given back too.
    let vol = Volume::open(dynd.clone()).unwrap();
    let file = vol.open_file("/f", OpenFlags::default()).unwrap();
    // A block in every chunk (512 extents): fiemap would read each page
    // without keeping it.
    let mut block = vec![1u8; BLOCK as usize];
    for k in (0..EXTENTS).step_by(256) {
        file.pread(&mut block, 2 * k * BLOCK).unwrap();
        assert!(block.iter().all(|&b| b == 0), "extent {k}");
    }
    let read = resident_bytes();
    drop(file);
    vol.release();
    let released = resident_bytes();
    eprintln!(
        "resident: {} MiB after reading every chunk, {} MiB after release",
        read / MIB,
        released / MIB
    );
    assert!(
        read > after + 20 * MIB,
        "reading took {} MiB: too little to tell",
        read.saturating_sub(after) / MIB
    );
    assert!(
        released < after + (read - after) / 2,
        "release kept {} of the read's {} MiB",
        released.saturating_sub(after) / MIB,
        (read - after) / MIB
    );
    assert_eq!(kept.len() as u64, EXTENTS.div_ceil(1024));
}
