//! The backup superblock in the last block of the device: one bad sector at
//! block 0 no longer makes the volume unreadable. Mount reads the backup and
//! says so, fsck reports it, `fsck --repair` (`fsck::repair_superblocks`)
//! restores the primary; a damaged backup is reported and rewritten.

mod common;

use blockdev::memory::{FaultOp, FaultRule};
use blockdev::{BlockDevice, WriteMode};
use common::dev::{format, fsck_clean, marked_device, MIB};
use common::history::tagged;
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::{fsck, OpenFlags, Volume};

const CREATE: OpenFlags = OpenFlags {
    create: true,
    exclusive: false,
    truncate: false,
    direct: false,
    dsync: false,
    sync: false,
    read_only: false,
};

fn read_all(vol: &Volume, path: &str) -> Vec<u8> {
    let f = vol.open_file(path, OpenFlags::default()).unwrap();
    let mut buf = vec![0u8; f.stat().unwrap().size as usize];
    f.pread(&mut buf, 0).unwrap();
    buf
}

#[test]
fn bad_sector_at_block_0_mount_uses_the_backup_and_repair_restores_it() {
    let mem = marked_device(8 * MIB, false);
    format(mem.clone());
    let backup = read_superblock(&*mem)
        .unwrap()
        .layout
        .backup_superblock()
        .unwrap();
    let vol = Volume::open(mem.clone()).unwrap();
    assert!(vol.mount_warnings().is_empty());
    vol.open_file("/a", CREATE)
        .unwrap()
        .pwrite(&tagged(1, 0, 20_000), 0)
        .unwrap();
    vol.unmount().unwrap();

    // A bad sector: every read of block 0 fails.
    mem.inject(FaultRule::new(FaultOp::Read).range(0..512));
    let vol = Volume::open(mem.clone()).expect("mount through the backup superblock");
    let warnings = vol.mount_warnings().join("\n");
    assert!(
        warnings.contains("block 0")
            && warnings.contains(&format!("backup superblock at byte {backup}")),
        "{warnings}"
    );
    assert_eq!(read_all(&vol, "/a"), tagged(1, 0, 20_000));
    vol.open_file("/b", CREATE)
        .unwrap()
        .pwrite(&tagged(2, 0, 9_000), 0)
        .unwrap();
    vol.unmount().unwrap();
    let report = fsck::check(mem.clone()).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(
        report.problems[0].contains("primary superblock (block 0) unusable"),
        "{:?}",
        report.problems
    );

    // The drive remaps the sector, which now reads as zeros: no magic in
    // block 0, so mount refuses (another file system may have been made
    // there); fsck still finds the backup, and repair restores the primary.
    mem.clear_faults();
    mem.write_at(&[0u8; 512], 0, WriteMode::Normal).unwrap();
    mem.flush().unwrap();
    let err = Volume::open(mem.clone())
        .err()
        .expect("mount without a primary");
    assert!(matches!(err, iomapfs_fs::Error::NotIomapfs { .. }), "{err}");
    assert!(!fsck::check(mem.clone()).unwrap().is_clean());
    let done = fsck::repair_superblocks(&*mem).unwrap();
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(done[0].contains("restored the primary"), "{done:?}");
    fsck_clean(mem.clone(), "after repair");
    assert!(fsck::repair_superblocks(&*mem).unwrap().is_empty());
    let vol = Volume::open(mem.clone()).unwrap();
    assert!(vol.mount_warnings().is_empty());
    assert_eq!(read_all(&vol, "/a"), tagged(1, 0, 20_000));
    assert_eq!(read_all(&vol, "/b"), tagged(2, 0, 9_000));
}

#[test]
fn damaged_backup_is_reported_and_rewritten() {
    let mem = marked_device(8 * MIB, false);
    format(mem.clone());
    let sb = read_superblock(&*mem).unwrap();
    let backup = sb.layout.backup_superblock().unwrap();
    assert_eq!(backup, 8 * MIB - 4096);
    assert!(sb.layout.data.end() <= backup);
    fsck_clean(mem.clone(), "fresh");
    for damage in [100u64, 0] {
        let mut sector = [0u8; 512];
        mem.read_at(&mut sector, backup).unwrap();
        sector[damage as usize] ^= 0x01;
        mem.write_at(&sector, backup, WriteMode::Normal).unwrap();
        let report = fsck::check(mem.clone()).unwrap();
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert!(
            report.problems[0].contains(&format!("backup superblock at byte {backup}")),
            "{:?}",
            report.problems
        );
        // The primary is fine: mount needs no backup and says nothing.
        assert!(Volume::open(mem.clone())
            .unwrap()
            .mount_warnings()
            .is_empty());
        let done = fsck::repair_superblocks(&*mem).unwrap();
        assert!(
            done.len() == 1 && done[0].contains("rewrote the backup"),
            "{done:?}"
        );
        fsck_clean(mem.clone(), "after repair");
    }
}
