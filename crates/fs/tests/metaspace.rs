//! Metadata space grows with need: a checkpoint image too large for its
//! slot spills to extents of the data area, which stay in use while a slot
//! lists them, count as used in `statfs` and fsck, and come back free once
//! a later checkpoint replaces them. Running out of space for them is
//! ENOSPC, never corruption, and leaves the volume mountable.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use blockdev::memory::MemDevice;
use common::dev::{dynd, fsck_clean, MIB};
use iomapfs_fs::{checkpoint, superblock, Error, FormatOptions, OpenFlags, Volume};

const DIRECT: OpenFlags = OpenFlags {
    create: true,
    exclusive: false,
    truncate: false,
    direct: true,
    dsync: false,
    sync: false,
    read_only: false,
};

fn formatted(size: u64, block_size: u32, slot_bytes: u64) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::with_caps(size, 512, true, false));
    Volume::format(
        dynd(&dev),
        &FormatOptions {
            block_size,
            checkpoint_slot_bytes: Some(slot_bytes),
            // Spilled images: the layout without extent pages.
            extent_pages: false,
            ..FormatOptions::default()
        },
    )
    .unwrap();
    dev
}

/// The bytes block `block` of file `file` holds in round `round`.
fn pattern(file: usize, block: u64, round: u64, bs: usize) -> Vec<u8> {
    let tag = format!("f{file}b{block}r{round};");
    tag.bytes().cycle().take(bs).collect()
}

/// Spill extents the slots on disk list, in bytes, and whether the newest
/// checkpoint's base is spilled.
fn spills_on_disk(dev: &MemDevice) -> (u64, bool) {
    let sb = superblock::read_superblock(dev).unwrap();
    let newest = checkpoint::read_checkpoints(dev, &sb).unwrap();
    let total = newest.spills.iter().flatten().map(|&(_, len)| len).sum();
    (total, !newest.spills[newest.slot].is_empty())
}

type Model = Vec<BTreeMap<u64, u64>>;

fn check_files(vol: &Volume, model: &Model, bs: usize, ctx: &str) {
    for (file, blocks) in model.iter().enumerate() {
        let f = vol
            .open_file(&format!("/f{file}"), OpenFlags::default())
            .unwrap();
        let size = blocks.keys().last().map_or(0, |&b| (b + 1) * bs as u64);
        assert!(f.stat().unwrap().size >= size, "{ctx}: f{file} size");
        let mut buf = vec![0u8; bs];
        for (&block, &round) in blocks {
            f.pread(&mut buf, block * bs as u64).unwrap();
            assert!(
                buf == pattern(file, block, round, bs),
                "{ctx}: f{file} block {block} (round {round}) reads wrong bytes"
            );
        }
    }
}

/// A volume whose 8 KiB slots hold a few hundred extents at most gets
/// thousands of extents: every checkpoint spills. After each round of
/// changes and a checkpoint: the data reads back after a remount, fsck is
/// clean and counts the spill extents as used (exactly: file blocks plus
/// both slots' spills), and `statfs` sees the same free space before and
/// after the remount (the running volume frees a slot's old spill extents
/// once they are replaced, and leaks none).
#[test]
fn an_image_larger_than_its_slot_spills_and_survives_remounts() {
    const BS: usize = 4096;
    const FILES: usize = 4;
    let dev = formatted(16 * MIB, BS as u32, 2 * BS as u64);
    let mut vol = Volume::open(dynd(&dev)).unwrap();
    let mut model: Model = vec![BTreeMap::new(); FILES];
    let mut spilled_rounds = 0;
    for round in 0..6u64 {
        for (file, blocks) in model.iter_mut().enumerate() {
            let f = vol.open_file(&format!("/f{file}"), DIRECT).unwrap();
            // Every other block: each block is an extent of its own.
            for i in 0..160u64 {
                let block = 2 * (i * 7 + round * 3 + file as u64 % 5);
                if (i + round) % 3 == 0 {
                    f.punch_hole(block * BS as u64, BS as u64).unwrap();
                    blocks.remove(&block);
                } else {
                    f.pwrite(&pattern(file, block, round, BS), block * BS as u64)
                        .unwrap();
                    blocks.insert(block, round);
                }
            }
        }
        vol.checkpoint().unwrap();
        let (spilled, newest_spilled) = spills_on_disk(&dev);
        spilled_rounds += u64::from(newest_spilled);
        let file_bytes: u64 = model.iter().map(|b| b.len() as u64 * BS as u64).sum();
        let before = vol.statfs();
        assert_eq!(
            before.data_bytes - before.free_bytes,
            file_bytes + before.metadata_bytes,
            "round {round}: statfs counts file blocks and metadata as used"
        );
        assert!(
            before.metadata_bytes > spilled,
            "round {round}: the next image's reserve"
        );
        // A crash, not an unmount: what the running volume believed must
        // match what the disk says.
        drop(vol);
        let report = fsck_clean(dynd(&dev), &format!("round {round}"));
        assert_eq!(
            report.used_bytes,
            file_bytes + spilled,
            "round {round}: fsck counts file blocks and spill extents"
        );
        vol = Volume::open(dynd(&dev)).unwrap();
        let after = vol.statfs();
        assert_eq!(
            (after.free_bytes, after.metadata_bytes),
            (before.free_bytes, before.metadata_bytes),
            "round {round}: free space after remount"
        );
        check_files(&vol, &model, BS, &format!("round {round}"));
    }
    assert!(spilled_rounds >= 5, "only {spilled_rounds} rounds spilled");
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after unmount");
    let vol = Volume::open(dynd(&dev)).unwrap();
    check_files(&vol, &model, BS, "after unmount");
}

/// Free space cut into single blocks, more of them than the 1 KiB slot's
/// spill table can list for the image: data writes or their fsyncs (whose
/// commit needs a checkpoint once the journal is full) fail with ENOSPC,
/// and so does the checkpoint, which cannot place its image,
/// without shutting the volume down or writing anything; the volume reads
/// on, mounts from the older checkpoint and its journal, and fsck is clean.
#[test]
fn spill_space_exhaustion_is_enospc_never_corruption() {
    const BS: usize = 512;
    let dev = formatted(4 * MIB, BS as u32, 2 * BS as u64);
    let vol = Volume::open(dynd(&dev)).unwrap();
    let a = vol.open_file("/f0", DIRECT).unwrap();
    let b = vol.open_file("/b", DIRECT).unwrap();
    let mut model: Model = vec![BTreeMap::new()];
    // Interleaved on the device: a's blocks end up one block apart.
    for block in 0..1500u64 {
        a.pwrite(&pattern(0, block, 0, BS), block * BS as u64)
            .unwrap();
        model[0].insert(block, 0);
        b.pwrite(&pattern(1, block, 0, BS), block * BS as u64)
            .unwrap();
    }
    drop(b);
    vol.unlink("/b").unwrap();
    vol.checkpoint().unwrap();
    assert!(spills_on_disk(&dev).1, "the image spills");
    // Fill what is left: the tail, then the one-block holes b left, until
    // only the reserve for the next image is free.
    let c = vol.open_file("/c", DIRECT).unwrap();
    let chunk = vec![7u8; 8 * BS];
    // `written`: what the writes reached; `durable`: what the last fsync
    // that returned made durable.
    let (mut written, mut durable) = (0u64, 0u64);
    let full = loop {
        match c.pwrite(&chunk, written) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        match c.fsync() {
            Ok(()) => durable = written,
            Err(e) => break e,
        }
    };
    assert!(durable > 0);
    assert!(matches!(full.root(), Error::NoSpace { .. }), "{full}");
    assert_eq!(full.errno(), libc::ENOSPC);
    let st = vol.statfs();
    assert!(st.metadata_bytes > 0, "{full}");
    // The image needs more one-block holes than the table can list.
    let err = vol.checkpoint().unwrap_err();
    assert!(matches!(err.root(), Error::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("spilled"), "{err}");
    // Not shut down: reads, overwrites and commits go on.
    let mut buf = vec![0u8; BS];
    a.pread(&mut buf, 10 * BS as u64).unwrap();
    assert!(buf == pattern(0, 10, 0, BS));
    a.pwrite(&pattern(0, 10, 1, BS), 10 * BS as u64).unwrap();
    model[0].insert(10, 1);
    // The journal may be full: its commit needs the checkpoint, which
    // cannot be written: ENOSPC again, still no shutdown.
    if let Err(e) = a.fsync() {
        assert!(matches!(e.root(), Error::NoSpace { .. }), "{e}");
    }
    a.pread(&mut buf, 10 * BS as u64).unwrap();
    assert!(buf == pattern(0, 10, 1, BS));
    // A sync that returns has made every write durable (the records the
    // failed checkpoint took went back to the queue).
    if vol.sync().is_ok() {
        durable = written;
    }
    let err = vol.unmount().unwrap_err();
    assert!(matches!(err.root(), Error::NoSpace { .. }), "{err}");
    drop((a, c));
    let report = fsck_clean(dynd(&dev), "after the failed checkpoint");
    let vol = Volume::open(dynd(&dev)).unwrap();
    check_files(&vol, &model, BS, "after the failed checkpoint");
    let mut buf = vec![0u8; chunk.len()];
    let c = vol.open_file("/c", OpenFlags::default()).unwrap();
    assert!(c.stat().unwrap().size >= durable);
    c.pread(&mut buf, durable - chunk.len() as u64).unwrap();
    assert_eq!(buf, chunk);
    assert!(
        report.journal_records > 0,
        "the journal holds what the checkpoint could not"
    );
}

/// A spill table that lists a file's extent (crc and all valid, as a
/// forger would write it) is found by the scan that rebuilds free space
/// after mount, naming the slot's spill extent: mount itself succeeds,
/// reads go on, every allocation fails with that corruption error and
/// writes nothing over the overlapped blocks, `mount_warnings` says it;
/// fsck says the same as ever.
#[test]
fn a_spill_extent_over_a_file_extent_is_refused() {
    const BS: usize = 4096;
    let dev = formatted(8 * MIB, BS as u32, 2 * BS as u64);
    let vol = Volume::open(dynd(&dev)).unwrap();
    let f = vol.open_file("/f0", DIRECT).unwrap();
    // Extents of two blocks, one after the other on the device.
    for i in 0..400u64 {
        let mut two = pattern(0, 4 * i, 0, BS);
        two.extend(pattern(0, 4 * i + 1, 0, BS));
        f.pwrite(&two, 4 * i * BS as u64).unwrap();
    }
    drop(f);
    vol.unmount().unwrap();
    let sb = superblock::read_superblock(&*dev).unwrap();
    let newest = checkpoint::read_checkpoints(&*dev, &sb).unwrap();
    assert!(!newest.spills[newest.slot].is_empty());
    let image_len = iomapfs_fs::codec::image_encoded_len(&newest.checkpoint.image);
    let want = checkpoint::spill_bytes(&sb, image_len);
    // From the middle of the file's first extent on.
    let first = newest
        .checkpoint
        .image
        .inodes
        .iter()
        .flat_map(|i| &i.extents)
        .map(|e| e.addr)
        .min()
        .unwrap()
        + BS as u64;
    let forged = checkpoint::Checkpoint {
        generation: newest.checkpoint.generation + 1,
        ..newest.checkpoint.clone()
    };
    let other = checkpoint::other_slot(newest.slot);
    checkpoint::write_spilled_base(&*dev, &sb, other, &forged, &[(first, want)]).unwrap();
    let before = dev.snapshot();
    let vol = Volume::open(dynd(&dev)).expect("mount leaves the layout to the scan");
    let err = vol
        .wait_free_space()
        .expect_err("the scan finds the overlap");
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("spill extent") && msg.contains("already used"),
        "{msg}"
    );
    let warnings = vol.mount_warnings();
    assert!(
        warnings.len() == 1 && warnings[0].contains("spill extent"),
        "{warnings:?}"
    );
    // Reads go on (block 0: the forged spill holds block 1 on).
    let f = vol.open_file("/f0", DIRECT).unwrap();
    let mut block = vec![0u8; BS];
    f.pread(&mut block, 0).unwrap();
    assert!(block == pattern(0, 0, 0, BS), "block 0 reads back");
    // Every allocation (a direct write into a hole, a buffered write, a
    // fallocate) fails with the scan's error; nothing reaches the device
    // but the journal.
    let hole = 4 * 400 * BS as u64;
    for (what, result) in [
        ("direct write", f.pwrite(&[9u8; BS], hole).map(drop)),
        ("fallocate", f.fallocate(hole, BS as u64, true)),
        (
            "buffered write",
            vol.open_file(
                "/g",
                OpenFlags {
                    direct: false,
                    ..DIRECT
                },
            )
            .and_then(|g| g.pwrite(&[9u8; BS], 0).and_then(|_| g.fsync())),
        ),
    ] {
        let err = result.expect_err(what);
        assert!(
            matches!(err.root(), Error::Corrupt { .. }) && err.to_string().contains("spill extent"),
            "{what}: {err}"
        );
    }
    assert_eq!(vol.statfs().free_bytes, 0, "nothing is free to allocate");
    drop((f, vol));
    let data = &sb.layout.data;
    let after = dev.snapshot();
    let (start, end) = (data.start as usize, (data.start + data.len) as usize);
    assert!(
        before[start..end] == after[start..end],
        "the data area was written after a failed scan"
    );
    let err = iomapfs_fs::fsck::check(dynd(&dev)).expect_err("fsck refuses");
    assert!(err.to_string().contains("spill extent"), "{err}");
}

/// The room for the next bases on a volume without extent pages: both
/// slots' images fit their slots (no spill), then a sparse file's map
/// grows the image until ENOSPC with no checkpoint in between. The next
/// image spills and frees nothing, the one after spills again: the room
/// must hold both (one image's worth left 4096 bytes free after the
/// first checkpoint where the next image needed 150016). Every rename
/// after is accepted and every checkpoint written.
#[test]
fn an_image_grown_past_both_slots_spills_keeps_its_bases_going() {
    const BS: u64 = 512;
    let dev = Arc::new(MemDevice::new(4 * MIB, 512));
    Volume::format(
        dynd(&dev),
        &FormatOptions {
            block_size: BS as u32,
            extent_pages: false,
            checkpoint_slot_bytes: Some(8 << 10),
            // No commit finds the journal full: no checkpoint falls
            // inside the writes.
            journal_bytes: Some(MIB),
            ..FormatOptions::default()
        },
    )
    .unwrap();
    let vol = common::open_replayable(dynd(&dev)).unwrap();
    let created = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    let pad = vol.open_file("/pad", created).unwrap();
    pad.pwrite(&[1u8; 8192], 0).unwrap();
    pad.fsync().unwrap();
    drop(pad);
    // Both slots' images small, neither spilled.
    for _ in 0..40 {
        vol.rename("/pad", "/dap").unwrap();
        vol.checkpoint().unwrap();
        vol.rename("/dap", "/pad").unwrap();
    }
    assert!(!spills_on_disk(&dev).1, "no image spills yet");
    let sparse = vol.open_file("/sparse", DIRECT).unwrap();
    let mut blocks = 0u64;
    loop {
        match sparse.pwrite(&[2u8; BS as usize], 2 * blocks * BS) {
            Ok(_) => blocks += 1,
            Err(e) if e.errno() == libc::ENOSPC => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(blocks > 1000, "{blocks} extents");
    drop(sparse);
    for i in 0..40 {
        let (from, to) = if i % 2 == 0 {
            ("/pad", "/dap")
        } else {
            ("/dap", "/pad")
        };
        vol.rename(from, to)
            .unwrap_or_else(|e| panic!("rename {i}: {e}"));
        vol.checkpoint()
            .unwrap_or_else(|e| panic!("checkpoint {i}: {e}"));
    }
    assert!(spills_on_disk(&dev).1, "the image spills");
    vol.unmount().unwrap();
    fsck_clean(dynd(&dev), "after the checkpoints");
}
