//! Buffered I/O through the folio cache: what it reads from the device, when
//! space is reserved and sizes move, how writeback errors reach `fsync`,
//! coherency with direct handles, the memory budget, and concurrency.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use blockdev::{BlockDevice, FaultOp, FaultRule, MemDevice, RequestCounts, Survival};
use iomap::{CacheConfig, IomapFile};
use iomapfs_fs::{FormatOptions, MountOptions, OpenFlags, SeekFor, Volume};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;

fn volume_on(dev: &Arc<MemDevice>) -> Volume {
    dev.fill(b"STALE!!!");
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    Volume::open(dev.clone()).unwrap()
}

/// Mounts the formatted volume on `dev` with the page cache `cache`.
fn mount_with_cache(dev: &Arc<MemDevice>, cache: CacheConfig) -> Volume {
    let opts = MountOptions {
        cache,
        ..MountOptions::default()
    };
    Volume::open_with(dev.clone(), &opts).unwrap()
}

fn buffered() -> OpenFlags {
    OpenFlags {
        create: true,
        ..OpenFlags::default()
    }
}

fn direct() -> OpenFlags {
    OpenFlags {
        create: true,
        direct: true,
        ..OpenFlags::default()
    }
}

fn counts(dev: &MemDevice) -> RequestCounts {
    dev.counters().snapshot()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn read_all(f: &iomapfs_fs::File) -> Vec<u8> {
    let size = f.stat().unwrap().size as usize;
    let mut out = vec![0u8; size];
    assert_eq!(f.pread(&mut out, 0).unwrap(), size);
    out
}

/// A file of 16 written blocks, durable, opened again buffered.
fn written(vol: &Volume) -> (iomapfs_fs::File, Vec<u8>) {
    let data = pattern(16 * BLOCK as usize, 1);
    let d = vol.open_file("/f", direct()).unwrap();
    d.pwrite(&data, 0).unwrap();
    d.fsync().unwrap();
    (vol.open_file("/f", buffered()).unwrap(), data)
}

#[test]
fn a_partial_write_reads_only_the_edge_blocks_not_cached() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (f, mut model) = written(&vol);
    let before = counts(&dev);
    // 100 bytes inside block 1: that block is read, nothing else.
    f.pwrite(&[7; 100], BLOCK + 50).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!((d.reads, d.bytes_read, d.writes), (1, BLOCK, 0), "{d:?}");
    model[(BLOCK + 50) as usize..][..100].fill(7);
    // Again in the same block: it is uptodate now.
    let before = counts(&dev);
    f.pwrite(&[8; 10], BLOCK + 1000).unwrap();
    model[(BLOCK + 1000) as usize..][..10].fill(8);
    assert_eq!(counts(&dev).since(&before).reads, 0);
    // Spanning blocks 3..=5 with partial edges: the two edges only.
    let before = counts(&dev);
    f.pwrite(&pattern(2 * BLOCK as usize, 9), 3 * BLOCK + 100)
        .unwrap();
    model[(3 * BLOCK + 100) as usize..][..2 * BLOCK as usize]
        .copy_from_slice(&pattern(2 * BLOCK as usize, 9));
    let d = counts(&dev).since(&before);
    assert_eq!((d.reads, d.bytes_read), (2, 2 * BLOCK), "{d:?}");
    // Whole blocks need nothing read.
    let before = counts(&dev);
    f.pwrite(&[1; BLOCK as usize], 10 * BLOCK).unwrap();
    model[(10 * BLOCK) as usize..][..BLOCK as usize].fill(1);
    assert_eq!(counts(&dev).since(&before).reads, 0);
    assert_eq!(read_all(&f), model);
    f.fsync().unwrap();
    drop(f);
    let g = vol.open_file("/f", direct()).unwrap();
    assert_eq!(read_all(&g), model, "after writeback, from the device");
}

#[test]
fn edges_in_holes_unwritten_space_and_past_eof_are_zeroed_not_read() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    // Unwritten space inside EOF (its device bytes hold the stale marker).
    f.fallocate(0, 8 * BLOCK, false).unwrap();
    f.truncate(16 * BLOCK).unwrap(); // blocks 8..16: a hole
    let before = counts(&dev);
    f.pwrite(&[5; 100], 2 * BLOCK + 7).unwrap(); // unwritten
    f.pwrite(&[6; 100], 12 * BLOCK + 7).unwrap(); // hole
    f.pwrite(&[9; 100], 40 * BLOCK + 7).unwrap(); // past EOF
    assert_eq!(counts(&dev).since(&before).reads, 0, "zeroed, not read");
    let all = read_all(&f);
    assert_eq!(all.len() as u64, 40 * BLOCK + 107);
    let mut want = vec![0u8; all.len()];
    want[(2 * BLOCK + 7) as usize..][..100].fill(5);
    want[(12 * BLOCK + 7) as usize..][..100].fill(6);
    want[(40 * BLOCK + 7) as usize..][..100].fill(9);
    assert!(all == want, "only the written bytes are non-zero");
    f.fsync().unwrap();
    drop(f);
    let g = vol.open_file("/f", direct()).unwrap();
    assert!(read_all(&g) == want, "the device agrees after writeback");
}

#[test]
fn large_writes_and_sequential_reads_make_large_folios() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    let data = pattern(4 * MIB as usize, 3);
    f.pwrite(&data, 0).unwrap();
    let spans = f.mapping().folio_spans();
    assert!(
        spans.iter().all(|&(_, len)| len == 2 << 20),
        "a 4 MiB write makes 2 MiB folios: {spans:?}"
    );
    f.fsync().unwrap();
    drop(f);
    // A cold file read 4 KiB at a time, in order: the folios grow.
    vol.checkpoint().unwrap();
    let g = vol.open_file("/f", buffered()).unwrap();
    assert!(g.mapping().is_empty(), "closed and clean: nothing cached");
    let before = counts(&dev);
    let mut buf = vec![0u8; BLOCK as usize];
    for i in 0..(4 * MIB / BLOCK) {
        g.pread(&mut buf, i * BLOCK).unwrap();
        assert_eq!(&buf[..], &data[(i * BLOCK) as usize..][..BLOCK as usize]);
    }
    let largest = g.mapping().folio_spans().iter().map(|s| s.1).max().unwrap();
    assert!(
        largest >= 1 << 20,
        "sequential reads grew folios only to {largest}"
    );
    let d = counts(&dev).since(&before);
    assert!(
        d.reads < 4 * MIB / BLOCK / 16,
        "1024 sequential 4 KiB reads took {} device reads",
        d.reads
    );
}

#[test]
fn the_on_disk_size_rises_at_writeback_completion_not_at_the_write() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    f.pwrite(&pattern(64 * 1024, 4), 0).unwrap();
    vol.sync().unwrap(); // the file exists, with nothing written back yet
    let synced = read_all(&f);
    f.pwrite(&pattern(64 * 1024, 5), 64 * 1024).unwrap();
    assert_eq!(f.stat().unwrap().size, 128 * 1024, "in-core size at once");
    // Commit the journal alone (a direct file's fsync commits the volume):
    // the append is not written back, so its size must not be durable.
    let other = vol.open_file("/other", direct()).unwrap();
    other.fsync().unwrap();
    let cut = Arc::new(dev.power_cut(&mut |_| Survival::Kept));
    let after = Volume::open(cut).unwrap();
    let g = after.open_file("/f", OpenFlags::default()).unwrap();
    assert_eq!(
        read_all(&g),
        synced,
        "the unwritten-back append is invisible"
    );
    drop((g, after));
    // After fsync both are durable.
    f.fsync().unwrap();
    let cut = Arc::new(dev.power_cut(&mut |_| Survival::Lost));
    let after = Volume::open(cut).unwrap();
    let g = after.open_file("/f", OpenFlags::default()).unwrap();
    let mut want = pattern(64 * 1024, 4);
    want.extend(pattern(64 * 1024, 5));
    assert_eq!(read_all(&g), want);
}

/// A cut in the middle of a long writeback: whatever the on-disk size is,
/// every byte inside it is data the file had — never zeros of unconverted
/// space, never the device's stale marker.
#[test]
fn a_cut_during_writeback_never_exposes_zeros_or_stale_bytes() {
    // Six data writes of one 2 MiB folio each (and the journal's after
    // them).
    for pause_at in [1u64, 3, 5] {
        let dev = Arc::new(MemDevice::new(64 * MIB, 512));
        let vol = volume_on(&dev);
        let f = vol.open_file("/f", buffered()).unwrap();
        let data = pattern(12 * MIB as usize, 6);
        f.pwrite(&data, 0).unwrap();
        let paused = dev.pause_after(FaultRule::new(FaultOp::Write).skip(pause_at).count(1));
        let syncer = {
            let f = f.try_clone().unwrap();
            std::thread::spawn(move || f.fsync())
        };
        paused.wait_reached();
        // Every completed write survives, in order: the most the cut keeps.
        let cut = Arc::new(dev.power_cut(&mut |_| Survival::Kept));
        paused.resume();
        syncer.join().unwrap().unwrap();
        let after = Volume::open(cut).unwrap();
        if let Ok(g) = after.open_file("/f", OpenFlags::default()) {
            let got = read_all(&g);
            assert!(
                got[..] == data[..got.len()],
                "pause at write {pause_at}: the {} bytes inside the size differ from the data",
                got.len()
            );
        }
    }
}

#[test]
fn enospc_comes_from_the_write_that_causes_it_never_from_writeback() {
    let dev = Arc::new(MemDevice::new(8 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    let chunk = pattern(256 * 1024, 7);
    let mut written = 0u64;
    let err = loop {
        match f.pwrite(&chunk, written) {
            Ok(_) => written += chunk.len() as u64,
            Err(e) => break e,
        }
        assert!(written < 16 * MIB, "no ENOSPC on an 8 MiB device");
    };
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert_eq!(
        f.stat().unwrap().size,
        written,
        "the failed write changed nothing"
    );
    // Writeback places every reserved byte without running out.
    f.fsync().unwrap();
    drop(f);
    vol.unmount().unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let g = vol.open_file("/f", OpenFlags::default()).unwrap();
    let got = read_all(&g);
    assert_eq!(got.len() as u64, written);
    assert!(got.chunks(chunk.len()).all(|c| c == &chunk[..]));
}

#[test]
fn a_writeback_error_reaches_each_handles_fsync_once() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (h1, _) = written(&vol);
    let h2 = vol.open_file("/f", buffered()).unwrap();
    h1.pwrite(&[1; 100], 5 * BLOCK).unwrap();
    let data_area = {
        let sb = vol.superblock();
        sb.layout.data.start..sb.layout.data.start + sb.layout.data.len
    };
    dev.inject(FaultRule::new(FaultOp::Write).range(data_area));
    let err = h1.fsync().unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains(&(5 * BLOCK).to_string()), "{err}");
    dev.clear_faults();
    h1.fsync().expect("reported once to this handle");
    let err = h2.fsync().expect_err("the other handle sees it too");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    h2.fsync().unwrap();
    let h3 = vol.open_file("/f", buffered()).unwrap();
    h3.fsync().expect("opened after the error");
}

#[test]
fn seek_data_and_hole_see_cached_writes_without_writing_back() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let d = vol.open_file("/f", direct()).unwrap();
    d.pwrite(&pattern(2 * BLOCK as usize, 1), 0).unwrap();
    // Cached, not placed yet: two delayed allocations with holes around.
    let f = vol.open_file("/f", buffered()).unwrap();
    f.pwrite(&[2; 10], 128 * BLOCK + 5).unwrap();
    f.pwrite(&[3; 100], 256 * BLOCK).unwrap();
    let size = 256 * BLOCK + 100;
    let before = counts(&dev);
    let (data, hole) = (SeekFor::Data, SeekFor::Hole);
    for (offset, to, want) in [
        (0, data, Some(0)),
        (0, hole, Some(2 * BLOCK)),
        (2 * BLOCK, data, Some(128 * BLOCK)),
        (128 * BLOCK + 7, hole, Some(129 * BLOCK)),
        (129 * BLOCK, data, Some(256 * BLOCK)),
        (256 * BLOCK, hole, Some(size)),
        (size - 1, data, Some(size - 1)),
        (size, data, None),
        (size, hole, None),
    ] {
        assert_eq!(f.seek(offset, to).unwrap(), want, "{to:?} from {offset}");
    }
    let delta = counts(&dev).since(&before);
    assert_eq!(
        (delta.reads, delta.writes, delta.flushes),
        (0, 0, 0),
        "{delta:?}"
    );
    // A writeback error stays for fsync to report.
    let data_area = {
        let sb = vol.superblock();
        sb.layout.data.start..sb.layout.data.start + sb.layout.data.len
    };
    dev.inject(FaultRule::new(FaultOp::Write).range(data_area));
    assert!(vol.sync().is_err());
    dev.clear_faults();
    assert_eq!(f.seek(0, data).unwrap(), Some(0));
    assert_eq!(f.fsync().unwrap_err().errno(), libc::EIO);
}

#[test]
fn unmount_reports_a_background_writeback_error_of_a_closed_file() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let mut cache = CacheConfig::with_size(16 * MIB);
    cache.dirty_expire = std::time::Duration::ZERO;
    cache.writeback_interval = std::time::Duration::from_millis(1);
    let vol = mount_with_cache(&dev, cache);
    let data_write = {
        let sb = vol.superblock();
        FaultRule::new(FaultOp::Write).range(sb.layout.data.start..sb.layout.data.end())
    };
    // The background writeback of /f fails (once), with /f closed.
    dev.inject(data_write.clone().count(1));
    let failed = dev.pause_after(data_write.clone());
    let f = vol.open_file("/f", buffered()).unwrap();
    f.pwrite(&[1; 100], 0).unwrap();
    drop(f);
    failed.wait_reached();
    // The flusher's next pass (writing /g back) comes after it kept the
    // error of that one.
    let next_pass = dev.pause_after(data_write);
    let g = vol.open_file("/g", buffered()).unwrap();
    g.pwrite(&[2; 100], 0).unwrap();
    failed.resume();
    next_pass.wait_reached();
    next_pass.resume();
    drop(g);
    let err = vol.unmount().expect_err("the lost write of /f");
    assert_eq!(err.errno(), libc::EIO, "{err}");
}

#[test]
fn direct_and_buffered_handles_always_agree() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (b, mut model) = written(&vol);
    let d = vol.open_file("/f", direct()).unwrap();
    let mut rng = 0x1234_5678_u64;
    let mut next = |n: u64| {
        rng = blockdev::rng::mix64(rng);
        rng % n
    };
    for round in 0..400u64 {
        let off = next(20 * BLOCK);
        let len = 1 + next(3 * BLOCK);
        let data = pattern(len as usize, round as u8);
        let (w, r) = if next(2) == 0 { (&b, &d) } else { (&d, &b) };
        w.pwrite(&data, off).unwrap();
        let end = (off + len) as usize;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[off as usize..end].copy_from_slice(&data);
        let mut back = vec![0u8; len as usize];
        r.pread(&mut back, off).unwrap();
        assert!(
            back == data,
            "round {round}: a write at {off}+{len} was not seen by the other handle"
        );
        if next(10) == 0 {
            assert!(read_all(r) == model, "round {round}: whole file");
        }
    }
}

/// A buffered read that runs while a direct write of the same blocks is in
/// flight (both hold the file's lock shared) caches what the write is
/// replacing; once the write returns, the buffered handle sees the new
/// bytes, not that cached copy. For an overwrite and for an allocating
/// write into a hole (which also runs under the shared lock).
#[test]
fn a_buffered_read_during_a_direct_write_does_not_keep_the_old_bytes() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (b, data) = written(&vol);
    let d = vol.open_file("/f", direct()).unwrap();
    d.punch_hole(8 * BLOCK, BLOCK).unwrap();
    for (what, block) in [("overwrite", 2u64), ("allocating write", 8)] {
        let new = pattern(BLOCK as usize, 0x40 + block as u8);
        let paused = dev.pause_before(FaultRule::new(FaultOp::Write));
        let writer = {
            let d = d.try_clone().unwrap();
            let new = new.clone();
            std::thread::spawn(move || d.pwrite(&new, block * BLOCK).unwrap())
        };
        paused.wait_reached();
        let mut during = vec![0u8; BLOCK as usize];
        b.pread(&mut during, block * BLOCK).unwrap();
        let old = if block == 8 {
            vec![0u8; BLOCK as usize]
        } else {
            data[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize].to_vec()
        };
        assert!(
            during == old,
            "{what}: the read saw the write before it was done"
        );
        paused.resume();
        writer.join().unwrap();
        let mut after = vec![0u8; BLOCK as usize];
        b.pread(&mut after, block * BLOCK).unwrap();
        assert!(
            after == new,
            "{what}: the buffered handle kept the old bytes"
        );
    }
}

/// As above, but a buffered write dirties another block of the cached
/// folio before the direct write returns: the folio stays (its dirty block
/// must not be lost), and the block the direct write replaced is read
/// again instead of served from the cache. (Review of a53ce31, B2.)
#[test]
fn a_partly_dirty_folio_does_not_keep_the_old_bytes_of_a_direct_write() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (b, data) = written(&vol);
    let d = vol.open_file("/f", direct()).unwrap();
    let new = pattern(BLOCK as usize, 0x77);
    let paused = dev.pause_before(FaultRule::new(FaultOp::Write));
    let writer = {
        let d = d.try_clone().unwrap();
        let new = new.clone();
        std::thread::spawn(move || d.pwrite(&new, 2 * BLOCK).unwrap())
    };
    paused.wait_reached();
    let mut during = vec![0u8; 4 * BLOCK as usize];
    b.pread(&mut during, 0).unwrap();
    assert!(during[..] == data[..4 * BLOCK as usize]);
    b.pwrite(&[9u8; 100], 0).unwrap();
    paused.resume();
    writer.join().unwrap();
    let mut after = vec![0u8; 4 * BLOCK as usize];
    b.pread(&mut after, 0).unwrap();
    assert!(
        after[..100].iter().all(|&x| x == 9),
        "the buffered write was lost"
    );
    assert!(after[100..BLOCK as usize] == data[100..BLOCK as usize]);
    assert!(
        after[2 * BLOCK as usize..3 * BLOCK as usize] == new,
        "the buffered handle kept the old bytes of the directly written block"
    );
    b.fsync().unwrap();
    let mut back = vec![0u8; 4 * BLOCK as usize];
    d.pread(&mut back, 0).unwrap();
    assert!(back == after, "the device after fsync");
}

/// A direct write that fails after one of its two device parts reached
/// the device leaves no cached block over its range serving bytes the
/// device no longer has. A buffered handle cached the folio and dirtied
/// another block of it while the write was in flight, so the folio stays;
/// its clean blocks in the range must be read again. Both handles then
/// read the same bytes.
#[test]
fn a_failed_direct_write_leaves_no_stale_block_in_a_partly_dirty_folio() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let (b, _) = written(&vol);
    let d = vol.open_file("/f", direct()).unwrap();
    // Block 2 moves to space of its own, away from block 1, so a write of
    // blocks 1 and 2 goes out as two device requests.
    let other = vol.open_file("/g", direct()).unwrap();
    other.pwrite(&pattern(BLOCK as usize, 3), 0).unwrap();
    d.punch_hole(2 * BLOCK, BLOCK).unwrap();
    d.pwrite(&pattern(BLOCK as usize, 4), 2 * BLOCK).unwrap();
    let addr_of = |pos: u64| {
        let e = d
            .fiemap()
            .unwrap()
            .into_iter()
            .find(|e| e.offset <= pos && pos < e.offset + e.length)
            .unwrap();
        e.addr + (pos - e.offset)
    };
    let (block1, block2) = (addr_of(BLOCK), addr_of(2 * BLOCK));
    assert_ne!(block2, block1 + BLOCK, "block 2 did not move");
    dev.inject(FaultRule::new(FaultOp::Write).range(block2..block2 + BLOCK));
    let paused = dev.pause_before(FaultRule::new(FaultOp::Write).range(block1..block1 + BLOCK));
    let writer = {
        let d = d.try_clone().unwrap();
        std::thread::spawn(move || d.pwrite(&pattern(2 * BLOCK as usize, 0x66), BLOCK))
    };
    paused.wait_reached();
    let mut during = vec![0u8; 4 * BLOCK as usize];
    b.pread(&mut during, 0).unwrap();
    b.pwrite(&[9u8; 100], 0).unwrap();
    paused.resume();
    assert!(
        writer.join().unwrap().is_err(),
        "the injected error was lost"
    );
    dev.clear_faults();
    let mut cached = vec![0u8; 2 * BLOCK as usize];
    b.pread(&mut cached, BLOCK).unwrap();
    let mut on_device = vec![0u8; 2 * BLOCK as usize];
    d.pread(&mut on_device, BLOCK).unwrap();
    assert!(
        cached == on_device,
        "the buffered handle serves bytes the device no longer has"
    );
    let mut first = vec![0u8; 100];
    b.pread(&mut first, 0).unwrap();
    assert!(first.iter().all(|&x| x == 9), "the buffered write was lost");
}

#[test]
fn memory_stays_within_the_cache_budget() {
    let dev = Arc::new(MemDevice::new(256 * MIB, 4096));
    dev.fill(b"STALE!!!");
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let cache = CacheConfig::with_size(16 * MIB);
    let budget = cache.size_bytes;
    let vol = mount_with_cache(&dev, cache);
    let f = vol.open_file("/big", buffered()).unwrap();
    let chunk = pattern(MIB as usize, 8);
    let mut peak = 0;
    // Eight times the cache, written and then read back.
    for i in 0..128u64 {
        f.pwrite(&chunk, i * MIB).unwrap();
        peak = peak.max(vol.cache().used_bytes());
    }
    let mut back = vec![0u8; MIB as usize];
    for i in 0..128u64 {
        f.pread(&mut back, i * MIB).unwrap();
        assert!(back == chunk, "MiB {i}");
        peak = peak.max(vol.cache().used_bytes());
    }
    assert!(
        peak <= budget,
        "cache memory peaked at {peak} bytes over its {budget}-byte budget"
    );
    assert!(vol.cache().dirty_bytes() <= vol.cache().config().dirty_limit_bytes);
}

/// Readers of folios while writeback copies them, writers racing eviction
/// in a cache far smaller than the data, and direct writers on other
/// blocks of the same file: every byte ends as its one writer left it.
#[test]
fn readers_writers_writeback_eviction_and_direct_io_race_safely() {
    const THREADS: u64 = 4;
    const SLICE: u64 = 2 * MIB; // per thread
    let dev = Arc::new(MemDevice::new(128 * MIB, 512));
    dev.fill(b"STALE!!!");
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let cache = CacheConfig::with_size(8 * MIB);
    let vol = mount_with_cache(&dev, cache);
    let setup = vol.open_file("/f", buffered()).unwrap();
    setup.truncate(THREADS * SLICE).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let syncer = {
        let f = vol.open_file("/f", buffered()).unwrap();
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                f.fsync().unwrap();
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let direct_writer = t == THREADS - 1;
            let f = vol
                .open_file("/f", if direct_writer { direct() } else { buffered() })
                .unwrap();
            std::thread::spawn(move || {
                let base = t * SLICE;
                let mut model = vec![0u8; SLICE as usize];
                let mut rng = t + 1;
                for round in 0..300u64 {
                    rng = blockdev::rng::mix64(rng);
                    let off = rng % (SLICE - 64 * 1024);
                    let len = 1 + (rng >> 20) % (48 * 1024);
                    let data = pattern(len as usize, (round + t) as u8);
                    f.pwrite(&data, base + off).unwrap();
                    model[off as usize..(off + len) as usize].copy_from_slice(&data);
                    let mut back = vec![0u8; len as usize];
                    f.pread(&mut back, base + off).unwrap();
                    assert!(back == data, "thread {t} round {round}: read-your-writes");
                }
                let mut all = vec![0u8; SLICE as usize];
                f.pread(&mut all, base).unwrap();
                assert!(all == model, "thread {t}: its slice");
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    syncer.join().unwrap();
    drop(setup);
    vol.unmount().unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let got = read_all(&f);
    for (t, model) in models.iter().enumerate() {
        let base = t * SLICE as usize;
        assert!(
            got[base..base + SLICE as usize] == model[..],
            "thread {t}'s slice after remount"
        );
    }
}

#[test]
fn truncate_and_punch_drop_what_the_cache_holds() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    f.pwrite(&pattern(64 * 1024, 2), 0).unwrap();
    f.truncate(10_000).unwrap();
    f.truncate(64 * 1024).unwrap();
    let all = read_all(&f);
    assert_eq!(&all[..10_000], &pattern(64 * 1024, 2)[..10_000]);
    assert!(
        all[10_000..].iter().all(|&b| b == 0),
        "bytes past a truncate came back"
    );
    f.pwrite(&[3; 20_000], 20_000).unwrap();
    f.punch_hole(25_000, 10_000).unwrap();
    let all = read_all(&f);
    assert!(
        all[25_000..35_000].iter().all(|&b| b == 0),
        "punched bytes came back"
    );
    assert!(all[20_000..25_000].iter().all(|&b| b == 3));
    assert!(all[35_000..40_000].iter().all(|&b| b == 3));
    f.fsync().unwrap();
    drop(f);
    let g = vol.open_file("/f", direct()).unwrap();
    assert_eq!(read_all(&g), all, "the device agrees");
}

#[test]
fn a_dsync_buffered_overwrite_takes_the_durable_write_path() {
    let dev = Arc::new(MemDevice::with_caps(32 * MIB, 512, true, true));
    let vol = volume_on(&dev);
    let (_, _) = written(&vol);
    let f = vol
        .open_file(
            "/f",
            OpenFlags {
                dsync: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    let before = counts(&dev);
    f.pwrite(&[4; BLOCK as usize], 2 * BLOCK).unwrap();
    let d = counts(&dev).since(&before);
    assert_eq!((d.writes, d.fua_writes, d.flushes), (1, 1, 0), "{d:?}");
    // And it is durable.
    let cut = Arc::new(dev.power_cut(&mut |_| Survival::Lost));
    let after = Volume::open(cut).unwrap();
    let g = after.open_file("/f", OpenFlags::default()).unwrap();
    let mut back = vec![0u8; BLOCK as usize];
    g.pread(&mut back, 2 * BLOCK).unwrap();
    assert!(back.iter().all(|&b| b == 4));
}

#[test]
fn sync_metadata_commits_names_and_writes_back_nothing() {
    // A directory's fsync: its names become durable; files' cached data
    // waits for their own fsync (or sync).
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    vol.mkdir("/d").unwrap();
    let f = vol.open_file("/d/x", buffered()).unwrap();
    f.pwrite(&pattern(3 * BLOCK as usize, 7), 0).unwrap();
    vol.sync_metadata().unwrap();
    assert!(vol.cache().dirty_bytes() > 0, "nothing written back");
    let after = Volume::open(Arc::new(dev.power_cut(&mut |_| Survival::Lost))).unwrap();
    assert_eq!(
        after.stat("/d/x").unwrap().size,
        0,
        "the name, not the data"
    );
}

#[test]
fn data_of_a_closed_file_is_kept_until_written_back() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    let data = pattern(100_000, 9);
    f.pwrite(&data, 0).unwrap();
    drop(f);
    // Reopened before any writeback: the cached data is there.
    let g = vol.open_file("/f", OpenFlags::default()).unwrap();
    assert!(read_all(&g) == data);
    drop(g);
    // And `sync` writes it back although no handle is open.
    vol.sync().unwrap();
    let cut = Arc::new(dev.power_cut(&mut |_| Survival::Lost));
    let after = Volume::open(cut).unwrap();
    let h = after.open_file("/f", OpenFlags::default()).unwrap();
    assert!(read_all(&h) == data);
}

/// A sequential reader's next window is read in the background: after a
/// few sequential 64 KiB reads of a cold file and the readahead queue
/// drained, the next window is cached although nothing read it, and the
/// reads that follow go to no device at all for a while. A random reader
/// gets no readahead.
#[test]
fn sequential_reads_are_read_ahead_in_the_background() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let data = pattern(8 * MIB as usize, 11);
    {
        let d = vol.open_file("/f", direct()).unwrap();
        d.pwrite(&data, 0).unwrap();
        d.fsync().unwrap();
    }
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut pos = 0u64;
    for _ in 0..8 {
        f.pread(&mut buf, pos).unwrap();
        assert!(buf[..] == data[pos as usize..][..buf.len()]);
        pos += buf.len() as u64;
    }
    vol.cache().wait_readahead();
    let cached_past = f
        .mapping()
        .folio_spans()
        .iter()
        .map(|&(p, l)| p + l as u64)
        .max()
        .unwrap();
    assert!(
        cached_past >= pos + 128 * 1024,
        "cached only to {cached_past} after reading to {pos}"
    );
    let before = counts(&dev);
    f.pread(&mut buf, pos).unwrap();
    assert!(buf[..] == data[pos as usize..][..buf.len()]);
    assert_eq!(
        counts(&dev).since(&before).reads,
        0,
        "the read ahead window was read again"
    );
    // Random reads: no readahead.
    let g = vol.open_file("/f", OpenFlags::default()).unwrap();
    vol.drop_caches().unwrap();
    for &at in &[5 * MIB, MIB, 3 * MIB, 7 * MIB] {
        g.pread(&mut buf[..4096], at).unwrap();
    }
    vol.cache().wait_readahead();
    let cached: u64 = g.mapping().folio_spans().iter().map(|s| s.1 as u64).sum();
    assert!(
        cached <= 4 * 16 * 1024,
        "random reads cached {cached} bytes"
    );
}

/// Where a file's cached folios end (0 when none is cached).
fn cached_end(f: &iomapfs_fs::File) -> u64 {
    f.mapping()
        .folio_spans()
        .iter()
        .map(|&(p, l)| p + l as u64)
        .max()
        .unwrap_or(0)
}

/// Once a sequential 64 KiB reader's window has grown to the largest
/// folio (its fifth read), every read leaves a whole window cached or
/// queued past its end, as the kernel's readahead mark does: the device
/// then reads the next window while the reader copies this one. Read ahead
/// only half a window, the device idled while the reader copied the first
/// half of each window.
#[test]
fn a_sequential_reader_keeps_a_whole_window_read_ahead() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let data = pattern(16 * MIB as usize, 12);
    {
        let d = vol.open_file("/f", direct()).unwrap();
        d.pwrite(&data, 0).unwrap();
        d.fsync().unwrap();
    }
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let window = iomap::folio::MAX_FOLIO_BYTES as u64;
    let mut pos = 0u64;
    for read in 1..=160 {
        f.pread(&mut buf, pos).unwrap();
        assert!(buf[..] == data[pos as usize..][..buf.len()], "read {read}");
        pos += buf.len() as u64;
        vol.cache().wait_readahead();
        if read >= 5 {
            let ahead = cached_end(&f);
            assert!(
                ahead >= pos + window,
                "read {read} ended at {pos}: cached only to {ahead}"
            );
        }
    }
}

/// A sequential 1 MiB reader is read ahead from its second read (the
/// window starts at four times the read, as the kernel's first readahead),
/// not after the window has doubled past its read size from 16 KiB.
#[test]
fn a_large_sequential_read_is_read_ahead_from_the_second_read() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let data = pattern(16 * MIB as usize, 13);
    {
        let d = vol.open_file("/f", direct()).unwrap();
        d.pwrite(&data, 0).unwrap();
        d.fsync().unwrap();
    }
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    for pos in [0, MIB] {
        f.pread(&mut buf, pos).unwrap();
        assert!(buf[..] == data[pos as usize..][..buf.len()]);
    }
    vol.cache().wait_readahead();
    let ahead = cached_end(&f);
    assert!(
        ahead >= 2 * MIB + iomap::folio::MAX_FOLIO_BYTES as u64,
        "after two 1 MiB reads, cached only to {ahead}"
    );
    f.pread(&mut buf, 2 * MIB).unwrap();
    assert!(buf[..] == data[2 * MIB as usize..][..buf.len()]);
}

/// Forwards to a [`MemDevice`]; once armed, every read waits at the gate
/// until it is opened (or a 20 s guard passes), and the most reads waiting
/// at once is recorded.
struct GateDevice {
    inner: Arc<MemDevice>,
    gate: parking_lot::Mutex<Gate>,
    changed: parking_lot::Condvar,
}

#[derive(Default)]
struct Gate {
    armed: bool,
    waiting: usize,
    most_waiting: usize,
}

impl GateDevice {
    fn set_armed(&self, armed: bool) {
        self.gate.lock().armed = armed;
        self.changed.notify_all();
    }

    /// Waits until `n` reads wait at the gate at once, or `guard` passes;
    /// returns the most that did.
    fn wait_for_waiting(&self, n: usize, guard: std::time::Duration) -> usize {
        let deadline = std::time::Instant::now() + guard;
        let mut gate = self.gate.lock();
        while gate.most_waiting < n && !self.changed.wait_until(&mut gate, deadline).timed_out() {}
        gate.most_waiting
    }
}

impl BlockDevice for GateDevice {
    fn caps(&self) -> &blockdev::DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), blockdev::DeviceError> {
        {
            let mut gate = self.gate.lock();
            if gate.armed {
                gate.waiting += 1;
                gate.most_waiting = gate.most_waiting.max(gate.waiting);
                self.changed.notify_all();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while gate.armed && !self.changed.wait_until(&mut gate, deadline).timed_out() {}
                gate.waiting -= 1;
            }
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(
        &self,
        buf: &[u8],
        offset: u64,
        mode: blockdev::WriteMode,
    ) -> Result<(), blockdev::DeviceError> {
        self.inner.write_at(buf, offset, mode)
    }
    fn flush(&self) -> Result<(), blockdev::DeviceError> {
        self.inner.flush()
    }
    fn counters(&self) -> &blockdev::DeviceCounters {
        self.inner.counters()
    }
}

/// A sequential reader has two windows read ahead at once, each by its own
/// readahead thread: the device gets the next window's request while the
/// current one is read, instead of waiting for one thread between windows.
/// (With one thread, only one readahead read is ever at the gate: the
/// reader waits on the folio being filled.)
#[test]
fn two_windows_are_read_ahead_at_once() {
    let mem = Arc::new(MemDevice::new(64 * MIB, 512));
    Volume::format(mem.clone(), &FormatOptions::default()).unwrap();
    let dev = Arc::new(GateDevice {
        inner: mem,
        gate: Default::default(),
        changed: Default::default(),
    });
    let vol = Volume::open(dev.clone()).unwrap();
    let data = Arc::new(pattern(24 * MIB as usize, 15));
    {
        let d = vol.open_file("/f", direct()).unwrap();
        d.pwrite(&data, 0).unwrap();
        d.fsync().unwrap();
    }
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    // Until the window is the largest folio (see
    // a_sequential_reader_keeps_a_whole_window_read_ahead).
    let mut pos = 0u64;
    for _ in 0..8 {
        f.pread(&mut buf, pos).unwrap();
        pos += buf.len() as u64;
    }
    vol.cache().wait_readahead();
    dev.set_armed(true);
    let reader = {
        let data = data.clone();
        std::thread::spawn(move || {
            while pos < data.len() as u64 {
                f.pread(&mut buf, pos).unwrap();
                assert!(buf[..] == data[pos as usize..][..buf.len()], "at {pos}");
                pos += buf.len() as u64;
            }
        })
    };
    let most = dev.wait_for_waiting(2, std::time::Duration::from_secs(20));
    dev.set_armed(false);
    reader.join().unwrap();
    assert!(most >= 2, "at most {most} device read(s) in flight at once");
}

/// A cold folio is filled with one device request per device-contiguous
/// run, not one per direct-I/O request cap (1 MiB): a 2 MiB read of a
/// 4 MiB extent is one request. A hole between two pieces still splits
/// them and reads as zeros, even where the allocator put the second piece
/// right after the first on the device.
#[test]
fn a_cold_folio_is_read_with_one_request_per_contiguous_run() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let data = pattern(4 * MIB as usize, 14);
    {
        let d = vol.open_file("/whole", direct()).unwrap();
        d.pwrite(&data, 0).unwrap();
        d.fsync().unwrap();
        let d = vol.open_file("/holed", direct()).unwrap();
        d.pwrite(&data[..MIB as usize], 0).unwrap();
        d.pwrite(&data[..MIB as usize / 2], 3 * MIB / 2).unwrap();
        d.fsync().unwrap();
    }
    let mut buf = vec![0u8; 2 * MIB as usize];
    let f = vol.open_file("/whole", OpenFlags::default()).unwrap();
    let before = counts(&dev);
    f.pread(&mut buf, 0).unwrap();
    assert_eq!(counts(&dev).since(&before).reads, 1, "one 2 MiB folio");
    assert!(buf[..] == data[..buf.len()]);
    let g = vol.open_file("/holed", OpenFlags::default()).unwrap();
    let before = counts(&dev);
    g.pread(&mut buf, 0).unwrap();
    assert_eq!(
        counts(&dev).since(&before).reads,
        2,
        "two runs around a hole"
    );
    let (first, rest) = buf.split_at(MIB as usize);
    let (hole, last) = rest.split_at(MIB as usize / 2);
    assert!(first == &data[..MIB as usize]);
    assert!(hole.iter().all(|&b| b == 0), "the hole reads as zeros");
    assert!(last == &data[..MIB as usize / 2]);
}

/// A sequential writer's bytes are written back behind it while it writes
/// (write-behind), completed through the journal like any writeback: a
/// cut without `fsync` keeps a prefix of the data, never zeros or stale
/// bytes; turned off, nothing reaches the device before `fsync`.
#[test]
fn a_sequential_writer_is_written_back_behind_it() {
    assert_eq!(
        CacheConfig::default().write_behind_bytes,
        0,
        "off by default"
    );
    for chunk in [0, iomap::folio_cache::WRITE_BEHIND_CHUNK_BYTES] {
        let dev = Arc::new(MemDevice::new(128 * MIB, 512));
        dev.fill(b"STALE!!!");
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let mut cache = CacheConfig::with_size(256 * MIB);
        cache.write_behind_bytes = chunk;
        let vol = mount_with_cache(&dev, cache);
        let f = vol.open_file("/f", buffered()).unwrap();
        let data = pattern(16 * MIB as usize, 9);
        let before = counts(&dev);
        for piece in data.chunks(MIB as usize) {
            f.pwrite(piece, f.stat().unwrap().size).unwrap();
        }
        vol.cache().wait_write_behind();
        let written = counts(&dev).since(&before).bytes_written;
        if chunk == 0 {
            assert!(
                written < MIB,
                "{written} bytes written with write-behind off"
            );
            assert_eq!(vol.cache().dirty_bytes(), 16 * MIB);
        } else {
            assert!(
                written >= 16 * MIB,
                "only {written} bytes written behind a 16 MiB sequential writer"
            );
            assert_eq!(vol.cache().dirty_bytes(), 0);
            // Their completions are journaled: commit them (a direct file's
            // fsync commits the volume), then cut.
            vol.open_file("/other", direct()).unwrap().fsync().unwrap();
            let cut = Arc::new(dev.power_cut(&mut |_| Survival::Lost));
            let after = Volume::open(cut).unwrap();
            let got = read_all(&after.open_file("/f", OpenFlags::default()).unwrap());
            assert_eq!(
                got.len(),
                data.len(),
                "the committed size covers every chunk"
            );
            assert!(got == data, "the written-behind bytes differ");
        }
        f.fsync().unwrap();
        assert_eq!(read_all(&f), data);
    }
}

/// Extending buffered writes run alone (the inode's lock, exclusively):
/// each zeroes the gap between the old EOF and its offset, which must never
/// clobber bytes another extending write just put there, and moves the
/// size that concurrent readers, writers and writeback rely on.
#[test]
fn concurrent_extending_writes_never_zero_each_others_bytes() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    const SLOT: u64 = 96;
    const ROUNDS: u64 = 20_000;
    let start = Arc::new(std::sync::Barrier::new(2));
    let writer = |lane: u64| {
        let f = f.try_clone().unwrap();
        let start = start.clone();
        std::thread::spawn(move || {
            start.wait();
            for i in 0..ROUNDS {
                let slot = 2 * i + lane;
                // Beyond the other lane's slot too, most of the time: both
                // extend, and each one's gap covers the other's bytes.
                f.pwrite(&[lane as u8 + 1; 64], slot * SLOT).unwrap();
            }
        })
    };
    let (a, b) = (writer(0), writer(1));
    let flusher = {
        let f = f.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..50 {
                f.fsync().unwrap();
            }
        })
    };
    a.join().unwrap();
    b.join().unwrap();
    flusher.join().unwrap();
    let check = |got: &[u8]| {
        for slot in 0..2 * ROUNDS {
            let at = (slot * SLOT) as usize;
            let lane = (slot % 2) as u8 + 1;
            assert!(
                got[at..at + 64].iter().all(|&b| b == lane),
                "slot {slot} lost its bytes"
            );
            let gap_end = (at + SLOT as usize).min(got.len());
            assert!(
                got[at + 64..gap_end].iter().all(|&b| b == 0),
                "slot {slot}'s gap is not zeros"
            );
        }
    };
    check(&read_all(&f));
    f.fsync().unwrap();
    drop(f);
    vol.unmount().unwrap();
    let again = Volume::open(dev.clone()).unwrap();
    check(&read_all(
        &again.open_file("/f", OpenFlags::default()).unwrap(),
    ));
}

/// Volume-wide writeback (`sync`, `drop_caches`, the flusher) asks each
/// file whether it is dirty while writers add folios and writeback holds
/// folios locked as it walks the file: none may wait for a folio while
/// holding the file's folio tree (writeback takes them in the other order,
/// and a queued tree writer blocks new tree readers). Found by fio: three
/// buffered jobs with `invalidate=1` hung in their first minute.
#[test]
fn volume_wide_writeback_and_writers_never_deadlock() {
    const WRITERS: u64 = 3;
    const FILE: u64 = 4 * MIB;
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let cache = CacheConfig::with_size(16 * MIB);
    let vol = mount_with_cache(&dev, cache);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let syncer = {
        let (vol, stop) = (vol.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if round.is_multiple_of(2) {
                    vol.sync().unwrap();
                } else {
                    vol.drop_caches().unwrap();
                }
                round += 1;
            }
        })
    };
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let f = vol.open_file(&format!("/w{t}"), buffered()).unwrap();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                let mut rng = t + 1;
                for round in 0..4000u64 {
                    rng = blockdev::rng::mix64(rng);
                    let off = (rng % (FILE / BLOCK)) * BLOCK;
                    f.pwrite(&pattern(BLOCK as usize, round as u8), off)
                        .unwrap();
                }
                done.send(t).unwrap();
            })
        })
        .collect();
    for _ in 0..WRITERS {
        // A deadline, not synchronisation: a hung test fails with a reason.
        done_rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("writers and volume-wide writeback deadlocked");
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    syncer.join().unwrap();
    vol.unmount().unwrap();
}

/// A buffered write far past EOF reserves space for what it writes and
/// for the old EOF block it zeroes, not for the hole between: a 1-byte
/// write at 1 GiB on a 32 MiB volume succeeds and leaves free space as it
/// was, less a block or two and the room for the pages of the extents it
/// holds (statfs counts the room; a page up to three times over until
/// bases have written it: see `room_for_bases`).
#[test]
fn a_write_far_past_eof_reserves_only_what_it_writes() {
    let dev = Arc::new(MemDevice::new(32 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    f.pwrite(&[7u8; 100], 0).unwrap();
    let free = vol.statfs().free_bytes;
    f.pwrite(&[9u8], 1 << 30).unwrap();
    let after = vol.statfs().free_bytes;
    assert!(
        free - after <= 8 * BLOCK,
        "the write reserved {} bytes",
        free - after
    );
    f.fsync().unwrap();
    let mut tail = [0u8; 2];
    assert_eq!(f.pread(&mut tail, (1 << 30) - 1).unwrap(), 2);
    assert_eq!(tail, [0, 9]);
    let mut head = vec![0u8; 200];
    assert_eq!(f.pread(&mut head, 0).unwrap(), 200);
    assert!(head[..100].iter().all(|&b| b == 7) && head[100..].iter().all(|&b| b == 0));
}

/// A sequential writer of 1 MiB pieces gets the largest folios (2 MiB, a
/// huge page each) from its second write on, as a reader does: a window
/// doubling from 16 KiB left its first 8 MiB in 1 MiB folios, written back
/// as smaller device requests.
#[test]
fn a_sequential_1_mib_writer_gets_the_largest_folios_from_its_second_write() {
    let dev = Arc::new(MemDevice::new(64 * MIB, 512));
    let vol = volume_on(&dev);
    let f = vol.open_file("/f", buffered()).unwrap();
    let data = pattern(16 * MIB as usize, 4);
    for (i, piece) in data.chunks(MIB as usize).enumerate() {
        f.pwrite(piece, i as u64 * MIB).unwrap();
    }
    let spans = f.mapping().folio_spans();
    let small: Vec<_> = spans.iter().filter(|s| s.1 < 2 << 20).collect();
    assert!(
        small.iter().all(|s| s.0 < 2 * MIB),
        "folios under 2 MiB past the first 2 MiB: {small:?}"
    );
    let before = counts(&dev);
    f.fsync().unwrap();
    let d = counts(&dev).since(&before);
    assert!(d.bytes_written >= 16 * MIB, "{d:?}");
    // The first two folios of 1 MiB, seven of 2 MiB, and the journal.
    assert!(
        d.writes <= 9 + 4,
        "{} device writes for 16 MiB: {d:?}",
        d.writes
    );
    assert_eq!(read_all(&f), data);
}

/// Writeback through a real io_uring ring, whose completions wait for the
/// pass's own thread (`blockdev::new_thread_queue`): a file written in
/// 1 MiB pieces, then fsynced, reaches the device whole, whether the
/// writer's fsync writes it back or the write-behind thread does (each
/// pass makes its queue in the thread it runs on).
#[test]
fn writeback_through_a_real_io_uring_ring_reaches_the_device_whole() {
    let dir = tempfile::tempdir().unwrap();
    let Some(dev) = common::dev::uring_volume_device(dir.path(), 128 * MIB) else {
        return;
    };
    for chunk in [0, iomap::folio_cache::WRITE_BEHIND_CHUNK_BYTES] {
        let mut cache = CacheConfig::with_size(256 * MIB);
        cache.write_behind_bytes = chunk;
        let opts = MountOptions {
            cache,
            ..MountOptions::default()
        };
        let vol = Volume::open_with(dev.clone(), &opts).unwrap();
        let name = format!("/f{chunk}");
        let f = vol.open_file(&name, buffered()).unwrap();
        let data = pattern(24 * MIB as usize, chunk as u8 ^ 5);
        let before = dev.counters().snapshot();
        // Twice: a pass that places the delayed allocations, then one that
        // overwrites them.
        for _ in 0..2 {
            for (i, piece) in data.chunks(MIB as usize).enumerate() {
                f.pwrite(piece, i as u64 * MIB).unwrap();
            }
            f.fsync().unwrap();
        }
        let d = dev.counters().snapshot().since(&before);
        assert!(d.bytes_written >= 2 * data.len() as u64, "{d:?}");
        assert_eq!(vol.cache().dirty_bytes(), 0);
        drop(f);
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let got = read_all(&vol.open_file(&name, OpenFlags::default()).unwrap());
        assert!(
            got == data,
            "write-behind {chunk}: the device holds other bytes"
        );
        vol.unmount().unwrap();
    }
}

/// A device whose per-thread queues (writeback's) fail as a whole: every
/// request pushed stays with the queue, as a ring that `io_uring_enter`
/// refuses keeps its requests' memory.
struct BrokenQueueDevice {
    inner: Arc<MemDevice>,
}

struct BrokenQueue {
    held: Vec<blockdev::DeviceRequest>,
}

impl blockdev::DeviceQueue for BrokenQueue {
    fn depth(&self) -> usize {
        64
    }
    fn push(
        &mut self,
        _token: blockdev::Token,
        request: blockdev::DeviceRequest,
    ) -> Result<(), blockdev::QueueFull> {
        self.held.push(request);
        Ok(())
    }
    fn submit(&mut self) -> Result<usize, blockdev::DeviceError> {
        Err(blockdev::DeviceError::Flush {
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })
    }
    fn reap(
        &mut self,
        _min: usize,
        _out: &mut Vec<blockdev::DeviceCompletion>,
    ) -> Result<usize, blockdev::DeviceError> {
        self.submit()
    }
    fn in_flight(&self) -> usize {
        self.held.len()
    }
}

impl BlockDevice for BrokenQueueDevice {
    fn caps(&self) -> &blockdev::DeviceCaps {
        self.inner.caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), blockdev::DeviceError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(
        &self,
        buf: &[u8],
        offset: u64,
        mode: blockdev::WriteMode,
    ) -> Result<(), blockdev::DeviceError> {
        self.inner.write_at(buf, offset, mode)
    }
    fn flush(&self) -> Result<(), blockdev::DeviceError> {
        self.inner.flush()
    }
    fn counters(&self) -> &blockdev::DeviceCounters {
        self.inner.counters()
    }
    fn native_thread_queue(
        &self,
        _depth: usize,
    ) -> Result<Option<Box<dyn blockdev::DeviceQueue>>, blockdev::DeviceError> {
        Ok(Some(Box::new(BrokenQueue { held: Vec::new() })))
    }
}

/// When the writeback queue fails as a whole it keeps the folios' memory:
/// fsync reports the error, and the folios read their blocks from the
/// device again instead of serving (and slicing) memory they no longer
/// have.
#[test]
fn a_failed_writeback_queue_leaves_folios_that_read_from_the_device() {
    let mem = Arc::new(MemDevice::new(64 * MIB, 512));
    Volume::format(mem.clone(), &FormatOptions::default()).unwrap();
    let before = pattern(256 * 1024, 3);
    {
        let vol = Volume::open(mem.clone()).unwrap();
        let d = vol.open_file("/f", direct()).unwrap();
        d.pwrite(&before, 0).unwrap();
        d.fsync().unwrap();
        vol.unmount().unwrap();
    }
    let dev = Arc::new(BrokenQueueDevice { inner: mem });
    let vol = Volume::open(dev).unwrap();
    let f = vol.open_file("/f", OpenFlags::default()).unwrap();
    f.pwrite(&pattern(256 * 1024, 9), 0).unwrap();
    assert!(f.fsync().is_err(), "the queue failed: fsync must say so");
    let mut back = vec![0u8; 256 * 1024];
    f.pread(&mut back, 0).unwrap();
    assert!(back == before, "the blocks were read from the device again");
}
