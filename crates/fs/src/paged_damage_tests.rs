//! A damaged extent page met by a checkpoint: a file shrunk below the
//! inline bound while its damaged chunk is absent stays paged (its page
//! listed again), never read into the root inline.
//!
//! Here, not in `tests/`: unit builds keep chunks of a few extents
//! (`extent_map`'s `CHUNK_MAX`), so a file just past the inline bound has
//! many chunks, and one can shrink below it without touching the damaged
//! one. Not in `extent_pages`: it drives whole volumes, and `volume`
//! reaches `extent_pages` through `transaction`.

use std::sync::Arc;

use blockdev::memory::MemDevice;
use blockdev::{BlockDevice, WriteMode};

use crate::volume::{FormatOptions, MountOptions, Volume};
use crate::{checkpoint, superblock, OpenFlags};

const BLOCK: u64 = 4096;

fn quiet() -> MountOptions {
    MountOptions::foreground_only()
}

fn read_block(vol: &Volume, k: u64) -> crate::Result<u8> {
    let f = vol.open_file("/big", OpenFlags::default())?;
    let mut b = vec![0u8; BLOCK as usize];
    f.pread(&mut b, 2 * k * BLOCK)?;
    Ok(b[0])
}

#[test]
fn a_file_shrunk_below_the_inline_bound_keeps_its_damaged_page() {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
    let inline = crate::codec::inline_extents_max(BLOCK) as u64;
    let extents = inline + 40;
    let ino = {
        let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
        let big = vol
            .open_file(
                "/big",
                OpenFlags {
                    create: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        for k in 0..extents {
            big.pwrite(&[(k % 250) as u8 + 1; BLOCK as usize], 2 * k * BLOCK)
                .unwrap();
        }
        big.fsync().unwrap();
        let ino = big.ino();
        drop(big);
        // A clean unmount writes a base: the file's chunks in pages.
        vol.unmount().unwrap();
        ino
    };
    let sb = superblock::read_superblock(&*dev).unwrap();
    let newest = checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let pages = newest.pages[newest.slot]
        .iter()
        .find(|(i, _)| *i == ino)
        .map(|(_, list)| list.clone())
        .expect("/big is paged");
    assert!(pages.len() >= 4, "{} pages", pages.len());
    let damaged = pages[0];
    let mut bytes = vec![0u8; BLOCK as usize];
    dev.read_at(&mut bytes, damaged.addr).unwrap();
    bytes[100] ^= 0x40;
    dev.write_at(&bytes, damaged.addr, WriteMode::Normal)
        .unwrap();
    dev.flush().unwrap();

    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    assert!(vol.wait_free_space().is_err(), "the scan meets the damage");
    // Truncated at the third page's first key: the change reads the
    // second chunk (the extent before) and those after, not the first.
    let cut = pages[2].first_key;
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    big.truncate(cut).unwrap();
    let left = u64::from(pages[0].count) + u64::from(pages[1].count);
    assert!(
        left <= inline,
        "{left} extents left: below the inline bound"
    );
    drop(big);
    // Unmount's base lists the damaged page again rather than read it.
    vol.unmount().unwrap();

    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    let first_of_second = pages[1].first_key / BLOCK / 2;
    assert_eq!(
        read_block(&vol, first_of_second).unwrap(),
        (first_of_second % 250) as u8 + 1
    );
    let err = read_block(&vol, 0).unwrap_err();
    assert_eq!(err.errno(), libc::EUCLEAN, "{err}");
    assert!(err.to_string().contains(&format!("inode {ino}")), "{err}");
    let stat = vol
        .open_file("/big", OpenFlags::default())
        .unwrap()
        .stat()
        .unwrap();
    assert_eq!(stat.size, cut, "the size the truncate left");
    vol.unmount().unwrap();
}
