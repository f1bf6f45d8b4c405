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
        Ok(n) => assert!(n < data.len(), "a write needing 32 KiB with {free} bytes free fully succeeded"),
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
