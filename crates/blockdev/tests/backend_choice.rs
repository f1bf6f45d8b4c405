//! `open_device` on real block devices (root only): a loop device, and zram,
//! which refuses NOWAIT and so must get the sync backend from Auto.
//!
//! Skipped with a printed reason when not root; failed instead when
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI).

mod common;

use std::sync::Arc;

use blockdev::{new_queue, open_device, Backend, BlockDevice};
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
/// (which made every other reopen fail with EBUSY).
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

#[test]
fn loop_device_choice_and_queues() {
    if !is_root() {
        return skip_privileged("not root");
    }
    let img = image(16 << 20, initial);
    let lo = match LoopDev::attach(img.path()) {
        Ok(lo) => lo,
        Err(e) => return skip_privileged(&e),
    };
    let (dev, choice) = open_device(&lo.path, false, Backend::Auto).unwrap();
    eprintln!("{}: {choice}", lo.path.display());
    assert_ne!(choice.backend, Backend::Auto);
    assert_eq!(dev.backend_name(), choice.backend.as_str());
    exercise(&dev, 11);
    drop(dev);
    for backend in [Backend::Sync, Backend::Uring] {
        let (dev, choice) = open_device(&lo.path, false, backend).unwrap();
        assert_eq!(choice.backend, backend, "{choice}");
        exercise(&dev, 21);
    }
    reopen_at_once(&lo.path);
}

#[test]
fn zram_gets_the_sync_backend_from_auto() {
    if !is_root() {
        return skip_privileged("not root");
    }
    let zram = match Zram::setup("64M") {
        Ok(z) => z,
        Err(e) => return skip_privileged(&e),
    };
    let (dev, choice) = open_device(&zram.path, false, Backend::Auto).unwrap();
    eprintln!("zram0 auto: {choice}");
    assert_eq!(choice.backend, Backend::Sync, "{choice}");
    assert_eq!(dev.backend_name(), "sync");
    // Whichever way io_uring failed, the reason names it: NOWAIT here, or
    // io_uring itself on a kernel that has it off.
    assert!(
        choice.reason.contains("zram0 does not support NOWAIT")
            || choice.reason.contains("io_uring"),
        "{choice}"
    );
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
