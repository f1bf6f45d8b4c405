//! Extent pages read on demand (issue 13, step 2): mount keeps no paged
//! file's extents in memory, a read loads the one chunk it needs, deltas
//! and the journal load the chunks they change, and a damaged page fails
//! only the operations that need it.

mod common;

use std::sync::Arc;

use blockdev::memory::MemDevice;
use blockdev::{BlockDevice, WriteMode};
use common::dev::{checkpoint_through_a_base, dynd, fsck_clean};
use iomapfs_fs::{
    checkpoint, superblock, FiemapExtent, FiemapKind, FormatOptions, MountOptions, OpenFlags,
    Volume,
};

const BLOCK: u64 = 4096;
/// Extents of /big: one per other block, so none merge. 512 extents per
/// chunk: at least four chunks, each a page.
const EXTENTS: u64 = 2000;

fn create() -> OpenFlags {
    OpenFlags {
        create: true,
        ..OpenFlags::default()
    }
}

/// The byte block `k` of /big holds.
fn fill(k: u64) -> u8 {
    (k % 251) as u8 + 1
}

/// A volume with extent pages holding /big (EXTENTS one-block extents,
/// paged) and /small (one extent, inline), unmounted after a base.
fn volume() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(64 << 20, 512));
    let opts = FormatOptions {
        extent_pages: true,
        ..FormatOptions::default()
    };
    Volume::format(dynd(&dev), &opts).unwrap();
    let vol = Volume::open(dynd(&dev)).unwrap();
    let big = vol.open_file("/big", create()).unwrap();
    for k in 0..EXTENTS {
        big.pwrite(&[fill(k); BLOCK as usize], 2 * k * BLOCK)
            .unwrap();
    }
    big.fsync().unwrap();
    let small = vol.open_file("/small", create()).unwrap();
    small.pwrite(&[7u8; BLOCK as usize], 0).unwrap();
    small.fsync().unwrap();
    drop((big, small));
    base(&vol);
    vol.unmount().unwrap();
    dev
}

/// The volume mounted, once the background scan that rebuilds free space
/// (it reads every page, keeping none) is done: page counts after it move
/// only with what the test does.
fn mounted_and_scanned(dev: &Arc<MemDevice>) -> Volume {
    let vol = Volume::open(dynd(dev)).unwrap();
    vol.wait_free_space().unwrap();
    vol
}

/// Checkpoints until one is a base.
fn base(vol: &Volume) {
    checkpoint_through_a_base(vol, "/small", "/llams");
}

fn read_big(vol: &Volume, k: u64) -> iomapfs_fs::Result<Vec<u8>> {
    let big = vol.open_file("/big", OpenFlags::default())?;
    let mut block = vec![0u8; BLOCK as usize];
    big.pread(&mut block, 2 * k * BLOCK)?;
    Ok(block)
}

fn loads(vol: &Volume) -> iomapfs_fs::page_loader::PageLoads {
    vol.extent_page_loads().expect("a volume with extent pages")
}

/// /big's inode number (a mount and a clean unmount).
fn ino_of_big(dev: &Arc<MemDevice>) -> u64 {
    let vol = Volume::open(dynd(dev)).unwrap();
    let ino = vol.open_file("/big", OpenFlags::default()).unwrap().ino();
    vol.unmount().unwrap();
    ino
}

/// The pages the newest base lists for /big, in key order.
fn pages_of_big(dev: &Arc<MemDevice>, ino: u64) -> Vec<iomapfs_fs::codec::PageRef> {
    let sb = superblock::read_superblock(&**dev).unwrap();
    let newest = checkpoint::read_checkpoints(&**dev, &sb).unwrap();
    newest.pages[newest.slot]
        .iter()
        .find(|(i, _)| *i == ino)
        .map(|(_, list)| list.iter().copied().collect())
        .expect("/big is paged")
}

/// Flips a bit inside each page's extents: its crc no longer matches.
fn damage(dev: &Arc<MemDevice>, pages: &[iomapfs_fs::codec::PageRef]) {
    for page in pages {
        let mut bytes = vec![0u8; BLOCK as usize];
        dev.read_at(&mut bytes, page.addr).unwrap();
        bytes[100] ^= 0x40;
        dev.write_at(&bytes, page.addr, WriteMode::Normal).unwrap();
    }
    dev.flush().unwrap();
}

/// Once a chunk read holds its extents in a slot of the pool, the
/// chunks' budget leaves the pool's warm free slots their share (a
/// quarter of the mount's budget): memory the metadata holds beside its
/// chunks. Before that it leaves none.
#[test]
fn chunks_in_slots_leave_the_warm_slots_their_share_of_the_budget() {
    const BUDGET: u64 = 8 << 20;
    let dev = volume();
    let opts = MountOptions {
        metadata_cache_bytes: BUDGET,
        ..MountOptions::default()
    };
    let vol = Volume::open_with(dynd(&dev), &opts).unwrap();
    vol.wait_free_space().unwrap();
    let before = loads(&vol);
    assert_eq!(before.cache_budget, BUDGET, "{before:?}");
    assert_eq!(
        before.chunk_budget,
        BUDGET - before.shell_bytes,
        "no chunk in a slot yet: {before:?}"
    );
    let k = EXTENTS / 2 + 3;
    assert_eq!(read_big(&vol, k).unwrap(), vec![fill(k); BLOCK as usize]);
    let after = loads(&vol);
    assert_eq!(after.loads, 1, "{after:?}");
    assert_eq!(
        after.chunk_budget,
        BUDGET - after.shell_bytes - BUDGET / 4,
        "{after:?}"
    );
    vol.unmount().unwrap();
}

/// fiemap reads a paged map without keeping it: the whole map, and a walk
/// of it in parts of any size from any offset, list the same ranges, and
/// every page they read is dropped after (a map of any size stays within
/// the budget).
#[test]
fn fiemap_walks_a_paged_map_in_parts_and_keeps_no_chunk() {
    let dev = volume();
    let vol = mounted_and_scanned(&dev);
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    let before = loads(&vol);
    let whole = big.fiemap().unwrap();
    let after = loads(&vol);
    assert_eq!(
        (after.loads, after.chunks_loaded),
        (before.loads, before.chunks_loaded),
        "{after:?}"
    );
    assert!(
        after.scans >= before.scans + after.chunks - 1,
        "every page of /big read: {before:?} then {after:?}"
    );
    // One data block at every other block, holes between, none after the
    // last (EOF is its end).
    assert_eq!(whole.len() as u64, 2 * EXTENTS - 1);
    for (i, x) in whole.iter().enumerate() {
        let kind = if i % 2 == 0 {
            FiemapKind::Data
        } else {
            FiemapKind::Hole
        };
        assert_eq!(
            (x.offset, x.length, x.kind),
            (i as u64 * BLOCK, BLOCK, kind)
        );
    }

    for max in [1, 2, 7, 600] {
        let mut walked: Vec<FiemapExtent> = Vec::new();
        loop {
            let from = walked.last().map_or(0, |x| x.offset + x.length);
            let part = big.fiemap_from(from, max).unwrap();
            assert!(part.len() <= max, "{} ranges for {max}", part.len());
            if part.is_empty() {
                break;
            }
            // Each part goes on from where the last ended, never back.
            assert!(part[0].offset <= from && part[0].offset + part[0].length > from);
            walked.extend(part);
        }
        assert!(walked == whole, "parts of {max}");
    }
    // From inside a range: that range first, reading the one or two
    // pages its ranges are in, not those before. Past the end: nothing.
    for k in [0, 1, 3, EXTENTS + 1, 2 * EXTENTS - 2] {
        let at = k * BLOCK + 100;
        let scans = loads(&vol).scans;
        let part = big.fiemap_from(at, 3).unwrap();
        let read = loads(&vol).scans - scans;
        assert!((1..=2).contains(&read), "{read} pages read at {at}");
        assert_eq!(
            part[..],
            whole[k as usize..k as usize + part.len()],
            "at {at}"
        );
        assert_eq!(part.len(), 3.min(whole.len() - k as usize), "at {at}");
    }
    assert!(big
        .fiemap_from((2 * EXTENTS - 1) * BLOCK, 3)
        .unwrap()
        .is_empty());
    let done = loads(&vol);
    assert_eq!(done.chunks_loaded, before.chunks_loaded, "{done:?}");
    // The iterator of parts gives the same ranges.
    let parts: Vec<Vec<FiemapExtent>> = big.fiemap_parts(7).collect::<Result<_, _>>().unwrap();
    assert!(parts.iter().all(|p| !p.is_empty() && p.len() <= 7));
    assert!(parts.concat() == whole);
    // A change between two parts: the first block punched after the
    // first part listed it. The next part's hole now starts at 0, before
    // where the first part ended: it is cut there.
    let mut parts = big.fiemap_parts(1);
    assert_eq!(parts.next().unwrap().unwrap(), [whole[0]]);
    big.punch_hole(0, BLOCK).unwrap();
    assert_eq!(parts.next().unwrap().unwrap(), [whole[1]]);
    assert_eq!(parts.next().unwrap().unwrap(), [whole[2]]);
    drop(big);
    vol.unmount().unwrap();
}

/// Deleting a paged file reads its pages one at a time and keeps none
/// (checked, then read again as its space is freed): no chunk is loaded,
/// its space comes back whole once a checkpoint holds the delete, and
/// fsck is clean.
#[test]
fn deleting_a_paged_file_keeps_none_of_its_chunks() {
    let dev = volume();
    let vol = mounted_and_scanned(&dev);
    let before = loads(&vol);
    let free_before = vol.statfs().free_bytes;
    vol.unlink("/big").unwrap();
    let after = loads(&vol);
    assert_eq!(
        (after.loads, after.chunks_loaded),
        (before.loads, before.chunks_loaded),
        "{after:?}"
    );
    let big_pages = before.chunks - 1;
    assert!(
        after.scans >= before.scans + 2 * big_pages,
        "/big's pages read twice: {before:?} then {after:?}"
    );
    base(&vol);
    let freed = vol.statfs().free_bytes - free_before;
    assert!(freed >= EXTENTS * BLOCK, "{freed} bytes freed");
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after deleting a paged file");

    // A damaged page: the name goes, but freeing the inode fails, saying
    // which page; the volume goes on.
    let dev = volume();
    let ino = ino_of_big(&dev);
    let pages = pages_of_big(&dev, ino);
    damage(&dev, &pages[2..3]);
    let vol = Volume::open(dynd(&dev)).unwrap();
    let err = vol.unlink("/big").unwrap_err();
    assert_eq!(err.errno(), libc::EUCLEAN, "{err}");
    assert!(
        err.to_string().contains(&pages[2].addr.to_string()),
        "{err}"
    );
    let small = vol.open_file("/small", OpenFlags::default()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    small.pread(&mut block, 0).unwrap();
    assert_eq!(block, vec![7u8; BLOCK as usize]);
    drop(small);
    drop(vol);
}

#[test]
fn mount_keeps_no_page_and_a_read_loads_one_chunk() {
    let dev = volume();
    let vol = mounted_and_scanned(&dev);
    let at_mount = loads(&vol);
    // /small's one chunk is inline (in the root, not a page).
    let inline = 1;
    assert!(at_mount.chunks >= 4, "{at_mount:?}");
    assert_eq!(at_mount.loads, 0, "mount loaded no chunk: {at_mount:?}");
    assert_eq!(at_mount.chunks_loaded, inline, "{at_mount:?}");
    // Free space was rebuilt from every page, none kept.
    assert_eq!(at_mount.scans, at_mount.chunks - inline, "{at_mount:?}");

    // One 4 KiB read in the middle of the file: one page.
    let k = EXTENTS / 2 + 3;
    assert_eq!(read_big(&vol, k).unwrap(), vec![fill(k); BLOCK as usize]);
    let after = loads(&vol);
    assert_eq!(
        (after.loads, after.chunks_loaded),
        (1, inline + 1),
        "{after:?}"
    );
    // Another block of the same chunk: nothing more.
    assert_eq!(
        read_big(&vol, k + 1).unwrap(),
        vec![fill(k + 1); BLOCK as usize]
    );
    assert_eq!(loads(&vol).loads, 1);

    // A write into a hole of the last chunk: its chunk and neighbours.
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    big.pwrite(&[0xee; BLOCK as usize], (2 * (EXTENTS - 5) + 1) * BLOCK)
        .unwrap();
    big.fsync().unwrap();
    let after = loads(&vol);
    assert!(after.loads <= 3, "{after:?}");
    assert!(after.chunks_loaded < after.chunks, "{after:?}");
    assert_eq!(after.unplanned, 0, "{after:?}");
    drop(big);
    // A delta holds the write; the chain after remount applies it,
    // loading the one chunk it reaches. (Dropped, not unmounted: a clean
    // unmount writes a base, below.)
    vol.checkpoint().unwrap();
    drop(vol);

    let vol = Volume::open(dynd(&dev)).unwrap();
    let at_mount = loads(&vol);
    assert_eq!(at_mount.loads, 0, "{at_mount:?}");
    assert_eq!(
        at_mount.chunks_loaded,
        inline + 1,
        "only the chunk the delta reaches: {at_mount:?}"
    );
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    big.pread(&mut block, (2 * (EXTENTS - 5) + 1) * BLOCK)
        .unwrap();
    assert_eq!(block, vec![0xee; BLOCK as usize]);
    drop(big);
    for k in 0..EXTENTS {
        assert_eq!(read_big(&vol, k).unwrap()[0], fill(k), "block {k}");
    }
    let done = loads(&vol);
    assert_eq!(done.chunks_loaded, done.chunks, "{done:?}");
    assert_eq!(
        done.unplanned, 0,
        "every load through an entry point: {done:?}"
    );
    assert!(done.damaged.is_empty());
    // A write, then a clean unmount: its final checkpoint is a base, so
    // the next mount has no chain to apply and loads no chunk.
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    big.pwrite(&[0xdd; BLOCK as usize], 3 * BLOCK).unwrap();
    drop(big);
    vol.unmount().unwrap();
    let vol = Volume::open(dynd(&dev)).unwrap();
    let at_mount = loads(&vol);
    assert_eq!(
        (at_mount.loads, at_mount.chunks_loaded),
        (0, inline),
        "after a clean unmount: {at_mount:?}"
    );
    let big = vol.open_file("/big", OpenFlags::default()).unwrap();
    big.pread(&mut block, 3 * BLOCK).unwrap();
    assert_eq!(block, vec![0xdd; BLOCK as usize]);
    drop(big);
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after lazy mounts");
}

/// A byte flipped in one of /big's pages after unmount: mount succeeds and
/// says so, reads of other chunks and files work, a read in the damaged
/// chunk fails naming the inode, the page's keys and its device byte, and
/// fsck reports the page.
#[test]
fn a_damaged_page_fails_only_its_chunk() {
    let dev = volume();
    let ino = ino_of_big(&dev);
    let pages = pages_of_big(&dev, ino);
    assert!(pages.len() >= 4);
    let damaged = pages[2];
    damage(&dev, &[damaged]);

    let vol = Volume::open(dynd(&dev)).unwrap();
    // Free space cannot be known without the page's extents: the scan
    // fails with the damage, and nothing is allocated this session (the
    // blocks the page maps must not go to another file).
    let scan = vol.wait_free_space().unwrap_err().to_string();
    assert!(
        scan.contains(&format!("inode {ino}")) && scan.contains("crc"),
        "{scan}"
    );
    let warned = vol.mount_warnings().join("\n");
    assert!(
        warned.contains(&format!("inode {ino}"))
            && warned.contains("crc")
            && warned.contains("nothing can be allocated"),
        "{warned}"
    );
    let other = vol
        .open_file(
            "/new",
            OpenFlags {
                create: true,
                ..OpenFlags::default()
            },
        )
        .and_then(|f| f.pwrite(&[1; BLOCK as usize], 0).map(drop));
    assert!(
        matches!(&other, Err(e) if e.to_string().contains("crc")),
        "an allocation on a volume whose free space is unknown: {other:?}"
    );
    // Before and after the damaged chunk, and another file: fine.
    assert_eq!(read_big(&vol, 0).unwrap()[0], fill(0));
    assert_eq!(read_big(&vol, EXTENTS - 1).unwrap()[0], fill(EXTENTS - 1));
    let small = vol.open_file("/small", OpenFlags::default()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    small.pread(&mut block, 0).unwrap();
    assert_eq!(block, vec![7u8; BLOCK as usize]);
    // In it: an error naming where, every time (the chunk stays absent);
    // the page is not read again (the scan found it damaged).
    let k = damaged.first_key / BLOCK / 2 + 1;
    let reads = loads(&vol).loads;
    for _ in 0..2 {
        let err = read_big(&vol, k).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("inode {ino}"))
                && text.contains(&format!("from file offset {}", damaged.first_key))
                && text.contains(&damaged.addr.to_string()),
            "{text}"
        );
        assert_eq!(err.errno(), libc::EUCLEAN, "{text}");
        assert!(text.contains("found damaged earlier"), "{text}");
        let next = pages[3].first_key;
        assert!(
            text.contains(&format!("file offsets {}..{next}", damaged.first_key)),
            "the key range: {text}"
        );
    }
    assert_eq!(loads(&vol).loads, reads, "not read again");
    let stats = loads(&vol);
    assert_eq!(stats.damaged.len(), 1, "{stats:?}");
    assert_eq!(stats.unplanned, 0, "{stats:?}");
    vol.unmount().unwrap();

    let report = iomapfs_fs::fsck::check(dynd(&dev));
    let text = match report {
        Ok(r) => r.problems.join("\n"),
        Err(e) => e.to_string(),
    };
    assert!(
        text.contains(&format!("inode {ino}")) && text.contains(&damaged.first_key.to_string()),
        "fsck: {text}"
    );
}

/// fsck reads every page: each that does not verify is a problem line
/// naming the inode, the file offsets lost and the device byte, and the
/// check goes on with the same checkpoint mount uses (not the older
/// slot), the rest of the file and the other files checked.
#[test]
fn fsck_lists_every_damaged_page_and_checks_the_rest() {
    let dev = volume();
    let ino = ino_of_big(&dev);
    let clean = fsck_clean(dynd(&dev), "before the damage");
    let pages = pages_of_big(&dev, ino);
    assert!(pages.len() >= 4);
    let last = pages.len() - 1;
    damage(&dev, &[pages[1], pages[last]]);
    let report = iomapfs_fs::fsck::check(dynd(&dev)).expect("a report, not a refusal");
    assert_eq!(
        report.checkpoint_generation, clean.checkpoint_generation,
        "the checkpoint mount uses"
    );
    let damaged: Vec<&String> = report
        .problems
        .iter()
        .filter(|p| p.contains("does not verify"))
        .collect();
    assert_eq!(damaged.len(), 2, "{:?}", report.problems);
    let second = format!(
        "file offsets {}..{}",
        pages[1].first_key, pages[2].first_key
    );
    let final_ = format!("file offsets {}..its end", pages[last].first_key);
    for (line, range, page) in [
        (damaged[0], &second, &pages[1]),
        (damaged[1], &final_, &pages[last]),
    ] {
        assert!(
            line.contains(&format!("inode {ino}"))
                && line.contains(range)
                && line.contains(&format!("device byte {}", page.addr))
                && line.contains("crc"),
            "{line}"
        );
    }
    // The rest checked: the pages the others list are in the used bytes,
    // the lost ones' data space is not.
    let lost: u64 = pages[1].allocated + pages[last].allocated;
    assert_eq!(report.used_bytes, clean.used_bytes - lost, "{report:?}");
}
