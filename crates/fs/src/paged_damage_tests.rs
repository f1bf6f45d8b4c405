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

/// A 16 MiB device with an extent-pages volume (index pages if
/// `page_index`), mounted, and its new file `/big`.
fn volume_with_big_file(page_index: bool) -> (Arc<MemDevice>, Volume, crate::File) {
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        page_index,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts).unwrap();
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
    (dev, vol, big)
}

/// Mounts `dev`, waits for its free-space scan (which reads second
/// copies of index pages) and checks that nothing was warned of.
fn mounts_without_warnings(dev: &Arc<MemDevice>) {
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    assert!(
        vol.mount_warnings().is_empty(),
        "{:?}",
        vol.mount_warnings()
    );
    vol.release();
}

/// [`volume_with_big_file`] with index pages, `/big` given a block of
/// `fill` at every other block past the inline bound, then unmounted:
/// the device, its superblock, `/big`'s inode and extent count, and the
/// index pages the newest base lists for it.
fn unmounted_indexed_file(
    fill: u8,
) -> (
    Arc<MemDevice>,
    superblock::Superblock,
    crate::types::Ino,
    u64,
    Vec<crate::codec::IndexRef>,
) {
    let (dev, vol, big) = volume_with_big_file(true);
    let extents = crate::codec::inline_extents_max(BLOCK) as u64 + 40;
    for k in 0..extents {
        big.pwrite(&[fill; BLOCK as usize], 2 * k * BLOCK).unwrap();
    }
    big.fsync().unwrap();
    let ino = big.ino();
    drop(big);
    vol.unmount().unwrap();
    let sb = superblock::read_superblock(&*dev).unwrap();
    let newest = checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    let irefs = newest.index[newest.slot]
        .iter()
        .find(|(i, _)| *i == ino)
        .expect("/big is paged")
        .1
        .clone();
    (dev, sb, ino, extents, irefs)
}

#[test]
fn a_file_shrunk_below_the_inline_bound_keeps_its_damaged_page() {
    // Roots that list pages: the change here rewrites no page, so the
    // base allocates nothing while the scan has failed; with index pages,
    // the file's run changed and needs an index page, which no allocation
    // can place until free space is known.
    let (dev, vol, big) = volume_with_big_file(false);
    let inline = crate::codec::inline_extents_max(BLOCK) as u64;
    let extents = inline + 40;
    let ino = {
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
        .map(|(_, list)| list.iter().copied().collect::<Vec<_>>())
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

/// One damaged copy of an index page loses nothing: mount reads the
/// other and warns, every extent reads back, and fsck names the damaged
/// block (and checks the whole state). The next two bases write that
/// index page again (an unchanged run is otherwise listed again as it
/// is; and the delta policy gives way), so then no slot depends on one
/// copy and fsck is clean.
///
/// An index page whose two copies are both damaged is damage to the
/// roots that list it, as a root whose crc fails: the keys it covers
/// cannot be known, so no state of the volume is whole. With both slots'
/// bases listing it (nothing changed between them), mount refuses the
/// volume, naming the index page (its device byte) and the inode; so
/// does fsck. The index page only the newest base lists (rewritten after
/// a change) makes that checkpoint the lost one: mount refuses, fsck
/// reports the loss and checks the older state.
#[test]
fn a_damaged_index_page_is_damage_to_the_roots_that_list_it() {
    for (shared, both_copies) in [(true, false), (true, true), (false, false), (false, true)] {
        let case = format!("shared {shared}, both copies {both_copies}");
        let (dev, vol, big) = volume_with_big_file(true);
        let extents = crate::codec::inline_extents_max(BLOCK) as u64 + 40;
        let ino = {
            for k in 0..extents {
                big.pwrite(&[7; BLOCK as usize], 2 * k * BLOCK).unwrap();
            }
            big.fsync().unwrap();
            drop(big);
            vol.inner.checkpoint_for_unmount().unwrap();
            if !shared {
                // The last extent moves: the newest base rewrites the
                // last run's index page.
                let big = vol.open_file("/big", OpenFlags::default()).unwrap();
                big.punch_hole(2 * (extents - 1) * BLOCK, BLOCK).unwrap();
                big.fsync().unwrap();
            }
            let ino = vol.stat("/big").unwrap().ino;
            vol.unmount().unwrap();
            ino
        };
        let sb = superblock::read_superblock(&*dev).unwrap();
        let newest = checkpoint::read_checkpoints(&*dev, &sb).unwrap();
        let refs = &newest.index[newest.slot]
            .iter()
            .find(|(i, _)| *i == ino)
            .expect("/big is paged")
            .1;
        let older = &newest.index[checkpoint::other_slot(newest.slot)];
        let listed_by_older = |r: &crate::codec::IndexRef| {
            older.iter().any(|(i, list)| *i == ino && list.contains(r))
        };
        let damaged = *refs
            .iter()
            .rev()
            .find(|r| listed_by_older(r) == shared)
            .expect("an index page listed as the case needs");
        let copies = if both_copies { 2 } else { 1 };
        for at in &damaged.blocks()[..copies] {
            let mut bytes = vec![0u8; BLOCK as usize];
            dev.read_at(&mut bytes, *at).unwrap();
            bytes[40] ^= 0x10;
            dev.write_at(&bytes, *at, WriteMode::Normal).unwrap();
        }
        dev.flush().unwrap();

        if !both_copies {
            let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
            let last = if shared { extents } else { extents - 1 };
            for k in (0..last).step_by(7).chain([last - 1]) {
                assert_eq!(read_block(&vol, k).unwrap(), 7, "{case}: block {k}");
            }
            let named = |found: &[String]| {
                found.len() == 1
                    && found[0].contains(&format!(
                        "at device byte {} could not be read",
                        damaged.addr
                    ))
                    && found[0].contains(&format!("inode {ino}"))
            };
            let warnings = vol.mount_warnings();
            assert!(named(&warnings), "{case}: {warnings:?}");
            vol.release();
            let report = crate::fsck::check(dev.clone()).unwrap();
            assert!(named(&report.problems), "{case}: {:?}", report.problems);

            let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
            vol.wait_free_space().unwrap();
            for n in 0..2 {
                let touch = vol
                    .open_file(
                        &format!("/touch{n}"),
                        OpenFlags {
                            create: true,
                            ..OpenFlags::default()
                        },
                    )
                    .unwrap();
                touch.pwrite(&[1; BLOCK as usize], 0).unwrap();
                touch.fsync().unwrap();
                // As the journal's checkpoints are asked: the delta policy
                // decides, and with a damaged copy it must write a base.
                vol.checkpoint().unwrap();
                // After the first base the slot it did not replace still
                // lists the index page: kept in the set until the second
                // base, which would otherwise find it there again.
                assert_eq!(
                    vol.inner
                        .commit
                        .lock()
                        .index_to_rewrite
                        .contains(&damaged.addr),
                    n == 0,
                    "{case}: after base {n}"
                );
            }
            // Exactly two bases: nothing more written.
            vol.release();
            let report = crate::fsck::check(dev.clone()).unwrap();
            assert!(report.problems.is_empty(), "{case}: {:?}", report.problems);
            let newest = checkpoint::read_checkpoints(&*dev, &sb).unwrap();
            assert!(
                newest
                    .index
                    .iter()
                    .flatten()
                    .flat_map(|(_, refs)| refs)
                    .all(|r| r.addr != damaged.addr),
                "{case}: neither slot lists the damaged index page"
            );
            continue;
        }
        let err = Volume::open_with(dev.clone(), &quiet())
            .err()
            .expect("mount refuses");
        let text = err.to_string();
        assert!(
            text.contains(&damaged.addr.to_string())
                && text.contains(&damaged.copy.to_string())
                && text.contains(&format!("inode {ino}")),
            "{case}: {text}"
        );
        match crate::fsck::check(dev.clone()) {
            Ok(report) => {
                assert!(!shared, "no whole state is left to check");
                assert!(
                    report
                        .problems
                        .iter()
                        .any(|p| p.contains(&damaged.addr.to_string())),
                    "{:?}",
                    report.problems
                );
            }
            Err(e) => {
                assert!(shared, "the older state is whole: {e}");
                assert!(e.to_string().contains(&damaged.addr.to_string()), "{e}");
            }
        }
    }
}

/// A copy of an index page that cannot be read (a device error, not
/// damage) is read from the other copy: mount goes on and warns, naming
/// the block. Both copies unreadable: mount fails with the device error
/// (EIO), rather than taking the checkpoint for damaged and falling back
/// to an older one.
#[test]
fn an_unreadable_index_page_copy_is_read_from_the_other() {
    use blockdev::memory::{FaultOp, FaultRule};
    let (dev, sb, ino, extents, irefs) = unmounted_indexed_file(9);
    let iref = irefs[0];
    let unreadable = |at: u64| FaultRule {
        op: FaultOp::Read,
        skip: 0,
        count: None,
        range: Some(at..at + BLOCK),
    };

    dev.inject(unreadable(iref.addr));
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    for k in [0, extents / 2, extents - 1] {
        assert_eq!(read_block(&vol, k).unwrap(), 9, "block {k}");
    }
    let warnings = vol.mount_warnings();
    assert!(
        warnings.len() == 1
            && warnings[0].contains(&format!("at device byte {} could not be read", iref.addr))
            && warnings[0].contains(&format!("inode {ino}")),
        "{warnings:?}"
    );
    vol.release();

    // Half the data area apart: no sector, flash page or single write
    // holds both.
    let data = sb.layout.data.len;
    assert!(
        iref.copy.abs_diff(iref.addr) >= data / 4,
        "copies at {} and {} of a data area of {data} bytes",
        iref.addr,
        iref.copy
    );

    dev.inject(unreadable(iref.copy));
    let refused = |what: &str| {
        let err = Volume::open_with(dev.clone(), &quiet())
            .err()
            .unwrap_or_else(|| panic!("{what}: mounted"));
        assert!(
            matches!(err.root(), crate::Error::Device { .. }) && err.errno() == libc::EIO,
            "{what}: {err:?}"
        );
    };
    refused("neither copy readable");
    // One copy damaged, the other unreadable, either way round: still
    // the device error.
    let good = {
        let mut bytes = vec![0u8; BLOCK as usize];
        dev.clear_faults();
        dev.read_at(&mut bytes, iref.addr).unwrap();
        bytes
    };
    for (damaged, unread) in [(iref.addr, iref.copy), (iref.copy, iref.addr)] {
        dev.clear_faults();
        let mut bad = good.clone();
        bad[40] ^= 4;
        dev.write_at(&bad, damaged, WriteMode::Normal).unwrap();
        dev.inject(unreadable(unread));
        refused(&format!("damaged at {damaged}, unreadable at {unread}"));
        dev.clear_faults();
        dev.write_at(&good, damaged, WriteMode::Normal).unwrap();
    }
    dev.clear_faults();
    mounts_without_warnings(&dev);
}

/// A damaged second copy of an index page: mount reads the first, and
/// its free-space scan the second (warned of, left for the next bases to
/// write anew); fsck names it; the repair rewrites it from the first: the
/// block then holds the first's bytes, fsck is clean. A second repair has
/// nothing to do.
#[test]
fn fsck_repair_rewrites_a_damaged_index_page_copy() {
    let (dev, _, _, _, irefs) = unmounted_indexed_file(5);
    let iref = *irefs.last().unwrap();
    let block = |at: u64| {
        let mut bytes = vec![0u8; BLOCK as usize];
        dev.read_at(&mut bytes, at).unwrap();
        bytes
    };
    let mut bad = block(iref.copy);
    bad[36] ^= 0x20;
    dev.write_at(&bad, iref.copy, WriteMode::Normal).unwrap();
    let named = |found: &[String]| {
        found.len() == 1
            && found[0].contains(&format!("at device byte {} could not be read", iref.copy))
    };
    let problems = crate::fsck::check(dev.clone()).unwrap().problems;
    assert!(named(&problems), "{problems:?}");
    // Mount reads first copies; its free-space scan reads the second
    // ones, warns, and leaves the index page for the next bases.
    let vol = Volume::open_with(dev.clone(), &quiet()).unwrap();
    vol.wait_free_space().unwrap();
    assert!(named(&vol.mount_warnings()), "{:?}", vol.mount_warnings());
    assert!(vol
        .inner
        .commit
        .lock()
        .index_to_rewrite
        .contains(&iref.addr));
    vol.release();

    let (done, failed) = crate::fsck::repair_index_copies(&*dev).unwrap();
    assert!(
        done.len() == 1 && done[0].contains(&format!("device byte {}", iref.copy)),
        "{done:?}"
    );
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(block(iref.copy), block(iref.addr));
    let report = crate::fsck::check(dev.clone()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(
        crate::fsck::repair_index_copies(&*dev).unwrap(),
        (Vec::new(), Vec::new())
    );
    mounts_without_warnings(&dev);
}
