//! `open_device` on real block devices (root only): a loop device, and zram,
//! which refuses NOWAIT and so must get the worker pool (the sync backend
//! on one CPU) from Auto.
//!
//! Skipped with a printed reason when not root; failed instead when
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

mod common;

use std::sync::Arc;

use blockdev::{
    new_queue, open_device, AlignedBuf, Backend, BlockDevice, DeviceQueue, DeviceRequest,
    SyncDevice, SyncOpenOptions, UringDevice, UringOptions, WriteMode,
};
use common::{image, initial, is_root, random_mix, skip_privileged, LoopDev, Zram};

/// Runs a short random mix through a queue of each depth on `dev`.
fn exercise(dev: &Arc<dyn BlockDevice>, seed: u64) {
    let lbs = dev.caps().logical_block_size as usize;
    let align = dev.caps().memory_alignment.max(1) as usize;
    let size = dev.caps().size_bytes as usize;
    let mut model = vec![0u8; size];
    dev.read_at(&mut model, 0).unwrap();
    for (i, depth) in [1usize, 8, 64, 256].into_iter().enumerate() {
        let mut q = new_queue(dev, depth).unwrap();
        random_mix(q.as_mut(), &mut model, lbs, align, seed + i as u64, 600);
    }
    let mut back = vec![0u8; size];
    dev.read_at(&mut back, 0).unwrap();
    assert!(back == model, "device content matches the model");
}

/// Opening the device again right after closing a uring handle must work:
/// the ring's reference to the exclusively opened device is released when
/// the queue is dropped, not later by the kernel's asynchronous teardown
/// (which made every other reopen fail with EBUSY); what a reference the
/// kernel still drops late costs, the open's retry of EBUSY waits out.
fn reopen_at_once(path: &std::path::Path) {
    for i in 0..10 {
        let (dev, _) = open_device(path, false, Backend::Uring)
            .unwrap_or_else(|e| panic!("reopen {i} right after close: {e}"));
        let mut q = new_queue(&dev, 4).unwrap();
        let buf = blockdev::AlignedBuf::new(4096, 4096).unwrap();
        q.push(0, blockdev::DeviceRequest::Read { offset: 0, buf })
            .unwrap();
        let mut out = Vec::new();
        q.submit_and_reap(1, &mut out).unwrap();
        out[0].result.as_ref().unwrap();
    }
}

/// A loop device over a 16 MiB image of the initial content, or `None`
/// when the test is skipped (not root, no loop devices).
fn loop_over_image() -> Option<(tempfile::NamedTempFile, LoopDev)> {
    if !is_root() {
        skip_privileged("not root");
        return None;
    }
    let img = image(16 << 20, initial);
    match LoopDev::attach(img.path()) {
        Ok(lo) => Some((img, lo)),
        Err(e) => {
            skip_privileged(&e);
            None
        }
    }
}

#[test]
fn loop_device_choice_and_queues() {
    let Some((_img, lo)) = loop_over_image() else {
        return;
    };
    let (dev, choice) = open_device(&lo.path, false, Backend::Auto).unwrap();
    eprintln!("{}: {choice}", lo.path.display());
    assert_ne!(choice.backend, Backend::Auto);
    // A loop device takes NOWAIT: io_uring where it works, never the pool.
    if choice.backend == Backend::Sync {
        assert!(choice.reason.contains("io_uring"), "{choice}");
    } else {
        assert_eq!(choice.reason, "io_uring: device accepts NOWAIT");
    }
    assert_eq!(dev.backend_name(), choice.backend.as_str());
    exercise(&dev, 11);
    drop(dev);
    for backend in [Backend::Sync, Backend::Uring, Backend::Pool] {
        let (dev, choice) = open_device(&lo.path, false, backend).unwrap();
        assert_eq!(choice.backend, backend, "{choice}");
        exercise(&dev, 21);
    }
    reopen_at_once(&lo.path);
}

/// A number in the sysfs queue directory of block device `dev`.
fn queue_attr(dev: &std::path::Path, attr: &str) -> u64 {
    let name = dev.file_name().unwrap().to_str().unwrap();
    let path = format!("/sys/block/{name}/queue/{attr}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.trim().parse().unwrap()
}

/// On a partition, chunk boundaries are counted from its disk's start, so
/// the probe gives the partition's start on the disk; a whole disk's is 0.
#[test]
fn a_partitions_limits_give_its_start_on_the_disk() {
    if !is_root() {
        return skip_privileged("not root");
    }
    const START_SECTOR: u32 = 2048;
    const SECTORS: u32 = 8192;
    // One MBR entry: a Linux partition of 4 MiB starting 1 MiB in.
    let img = image(16 << 20, |_| 0);
    let mut mbr = [0u8; 512];
    let entry = &mut mbr[446..462];
    entry[4] = 0x83;
    entry[8..12].copy_from_slice(&START_SECTOR.to_le_bytes());
    entry[12..16].copy_from_slice(&SECTORS.to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xaa;
    std::os::unix::fs::FileExt::write_all_at(img.as_file(), &mbr, 0).unwrap();
    let lo = match LoopDev::attach_partitioned(img.path()) {
        Ok(lo) => lo,
        Err(e) => return skip_privileged(&format!("no loop device: {e}")),
    };
    let partition = std::path::PathBuf::from(format!("{}p1", lo.path.display()));
    assert!(
        partition.exists(),
        "{} after --partscan",
        partition.display()
    );
    let disk = SyncDevice::open(&lo.path, SyncOpenOptions::default()).unwrap();
    assert_eq!(disk.request_limits().boundary_offset, 0);
    // Opened exclusively: the partition is busy while the disk is open.
    drop(disk);
    let part = SyncDevice::open(&partition, SyncOpenOptions::default()).unwrap();
    assert_eq!(
        part.request_limits().boundary_offset,
        u64::from(START_SECTOR) * 512
    );
}

/// The limits probed on a loop device are its queue's, and a 2 MiB write
/// and read through io_uring go in pieces that fit them (no piece larger
/// than `max_sectors_kb`, nor touching more pages than `max_segments`).
#[test]
fn loop_device_requests_are_cut_to_its_queue_limits() {
    let Some((_img, lo)) = loop_over_image() else {
        return;
    };
    let sync = Arc::new(SyncDevice::open(&lo.path, SyncOpenOptions::default()).unwrap());
    let limits = sync.request_limits();
    eprintln!("{}: {limits:?}", lo.path.display());
    let max_bytes = queue_attr(&lo.path, "max_sectors_kb") as usize * 1024;
    let segments = queue_attr(&lo.path, "max_segments") as usize;
    assert_eq!(limits.max_bytes, Some(max_bytes));
    let page = 4096;
    assert_eq!(limits.max_pages, Some(segments.min(256)));
    let dev = match UringDevice::from_sync(sync, UringOptions::default()) {
        Ok(dev) => dev,
        Err(e) => return eprintln!("skipping the io_uring part: {e}"),
    };
    let len: usize = 2 << 20;
    let piece = max_bytes.min(segments.min(256) * page);
    let pieces = len.div_ceil(piece) as u64;
    let mut q = dev.new_queue(4).unwrap();
    let mut data = AlignedBuf::new(len, page).unwrap();
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let expect = data.to_vec();
    q.push(
        1,
        DeviceRequest::Write {
            offset: 1 << 20,
            buf: data,
            mode: WriteMode::Normal,
        },
    )
    .unwrap();
    let read = AlignedBuf::new(len, page).unwrap();
    let mut out = Vec::new();
    q.submit_and_reap(1, &mut out).unwrap();
    assert_eq!(*out[0].result.as_ref().unwrap(), len);
    assert_eq!(q.submission_entries(), pieces);
    q.push(
        2,
        DeviceRequest::Read {
            offset: 1 << 20,
            buf: read,
        },
    )
    .unwrap();
    q.submit_and_reap(1, &mut out).unwrap();
    assert_eq!(*out[1].result.as_ref().unwrap(), len);
    assert!(out[1].buf.as_ref().unwrap()[..] == expect[..]);
    assert_eq!(q.submission_entries(), 2 * pieces);

    // Huge pages merge into 64 KiB segments, so their pieces are larger.
    if let Some(contiguous) = limits.max_contiguous_bytes {
        let huge = AlignedBuf::new_huge_pages(len).unwrap();
        assert!(huge.is_huge_page_mapping());
        let pieces = len.div_ceil(max_bytes.min(contiguous)) as u64;
        let before = q.submission_entries();
        q.push(
            3,
            DeviceRequest::Read {
                offset: 1 << 20,
                buf: huge,
            },
        )
        .unwrap();
        out.clear();
        q.submit_and_reap(1, &mut out).unwrap();
        assert!(out[0].buf.as_ref().unwrap()[..] == expect[..]);
        assert_eq!(q.submission_entries() - before, pieces);
    }

    // Dropped with split writes in flight: the drop returns only after
    // every piece of every write is done (a loop device completes them
    // later, from its worker), so all of them are there to read.
    let writes = 6;
    let mut q = dev.new_queue(writes).unwrap();
    for i in 0..writes {
        let mut data = AlignedBuf::new(len, page).unwrap();
        data.fill(0x40 + i as u8);
        let offset = (i * len) as u64;
        let mode = WriteMode::Normal;
        q.push(
            i as u64,
            DeviceRequest::Write {
                offset,
                buf: data,
                mode,
            },
        )
        .unwrap();
    }
    q.submit().unwrap();
    drop(q);
    let mut back = vec![0u8; writes * len];
    dev.read_at(&mut back, 0).unwrap();
    for (i, chunk) in back.chunks(len).enumerate() {
        let at = chunk.iter().position(|&b| b != 0x40 + i as u8);
        assert_eq!(at, None, "write {i} incomplete after the drop");
    }
}

#[test]
fn zram_gets_the_worker_pool_from_auto() {
    if !is_root() {
        return skip_privileged("not root");
    }
    let zram = match Zram::setup("64M") {
        Ok(z) => z,
        Err(e) => return skip_privileged(&e),
    };
    let (dev, choice) = open_device(&zram.path, false, Backend::Auto).unwrap();
    eprintln!("zram0 auto: {choice}");
    assert!(
        choice.reason.contains("zram0 does not support NOWAIT"),
        "{choice}"
    );
    let cpus = blockdev::pool_backend::default_workers().get();
    if cpus > 1 {
        assert_eq!(choice.backend, Backend::Pool, "{choice}");
        let workers = format!("queued requests run on {cpus} worker threads");
        assert!(choice.reason.ends_with(&workers), "{choice}");
    } else {
        assert_eq!(choice.backend, Backend::Sync, "{choice}");
    }
    assert_eq!(dev.backend_name(), choice.backend.as_str());
    exercise(&dev, 31);
    drop(dev);

    // Asked for explicitly, io_uring is honoured (slowly) where it works.
    match open_device(&zram.path, false, Backend::Uring) {
        Ok((dev, choice)) => {
            eprintln!("zram0 uring: {choice}");
            assert_eq!(choice.backend, Backend::Uring);
            assert!(
                choice.reason.contains("does not support NOWAIT"),
                "{choice}"
            );
            exercise(&dev, 41);
            drop(dev);
            reopen_at_once(&zram.path);
        }
        Err(e) => eprintln!("zram0 uring refused: {e}"),
    }
}
