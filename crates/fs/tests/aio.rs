//! The asynchronous file API against the synchronous one, its completion
//! classes, and device errors reaching the submitter.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use blockdev::{AlignedBuf, BlockDevice, FaultOp, FaultRule, MemDevice};
use iomapfs_fs::aio::{CompletedBy, Completion};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: u64 = 4096;
const SECTOR: u64 = 512;

/// The same device twice: with the in-order inline queue, and with a queue
/// that completes requests out of submission order (as NVMe and io_uring
/// do), seeded by `IOMAPFS_TEST_SEED` when set.
fn each_queue(make: impl Fn() -> MemDevice) -> Vec<(String, Arc<MemDevice>)> {
    let seed = std::env::var("IOMAPFS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x00_0f_0e_0d);
    vec![
        ("inline".to_string(), Arc::new(make())),
        (
            format!("out-of-order (seed {seed})"),
            Arc::new(make().with_out_of_order_queue(seed)),
        ),
    ]
}

fn volume(dev: &Arc<MemDevice>) -> Volume {
    dev.fill(b"STALE!!!");
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    Volume::open(dev.clone()).unwrap()
}

fn direct(dsync: bool) -> OpenFlags {
    OpenFlags {
        create: true,
        direct: true,
        dsync,
        ..OpenFlags::default()
    }
}

fn buf_of(bytes: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::new(bytes.len(), 4096).unwrap();
    b.copy_from_slice(bytes);
    b
}

fn reap_all(q: &mut iomapfs_fs::aio::IoQueue) -> HashMap<u64, Completion> {
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut out).unwrap();
    }
    out.into_iter().map(|c| (c.token, c)).collect()
}

/// A file of 64 blocks: written, unwritten and hole blocks mixed, several
/// extents, and an EOF that is not block-aligned.
fn fragmented_file(vol: &Volume, rng: &mut SmallRng) -> (iomapfs_fs::File, Vec<u8>) {
    let f = vol.open_file("/frag", direct(false)).unwrap();
    let mut model = vec![0u8; (64 * BLOCK) as usize];
    for b in 0..64u64 {
        match rng.gen_range(0..3) {
            0 => {
                let data: Vec<u8> = (0..BLOCK).map(|_| rng.gen()).collect();
                f.pwrite(&data, b * BLOCK).unwrap();
                model[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize].copy_from_slice(&data);
            }
            1 => f.fallocate(b * BLOCK, BLOCK, true).unwrap(),
            _ => {}
        }
    }
    let size = 64 * BLOCK - 1000;
    f.truncate(size).unwrap();
    model.truncate(size as usize);
    (f, model)
}

#[test]
fn async_reads_and_writes_match_the_sync_path_at_every_depth() {
    let seed = std::env::var("IOMAPFS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x05ee_da10);
    println!("aio seed {seed}");
    for depth in [1usize, 4, 32, 256] {
        let mut rng = SmallRng::seed_from_u64(seed ^ depth as u64);
        for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
            println!("{queue} queue");
            let vol = volume(&dev);
            let (f, mut model) = fragmented_file(&vol, &mut rng);
            let mut q = vol.io_queue(depth).unwrap();
            // Reads across extent boundaries, holes, unwritten space and EOF.
            let mut expected = HashMap::new();
            for token in 0..512u64 {
                let blocks = rng.gen_range(1..=16u64);
                let off = rng.gen_range(0..80u64) * SECTOR * 8;
                let len = blocks * SECTOR * rng.gen_range(1..=8u64);
                q.submit_read(&f, off, AlignedBuf::new(len as usize, 4096).unwrap(), token)
                    .unwrap();
                expected.insert(token, (off, len));
                if q.in_flight() >= depth {
                    q.submit().unwrap();
                }
            }
            q.submit().unwrap();
            for (token, c) in reap_all(&mut q) {
                let (off, len) = expected[&token];
                let n = c.result.unwrap();
                let want_len = (model.len() as u64).saturating_sub(off).min(len) as usize;
                assert_eq!(n, want_len, "depth {depth} token {token}");
                let want = &model[off.min(model.len() as u64) as usize..][..want_len];
                assert_eq!(
                    &c.buf[..n],
                    want,
                    "depth {depth} read {token} at {off}+{len}"
                );
                assert!(c.buf[n..].iter().all(|&b| b == 0), "bytes past EOF");
            }
            // Writes: pure overwrites, writes into holes and unwritten space,
            // some crossing EOF.
            for token in 0..256u64 {
                let off = rng.gen_range(0..72u64) * SECTOR * 8 + rng.gen_range(0..8u64) * SECTOR;
                let len = SECTOR * rng.gen_range(1..=24u64);
                let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                // One request per range at a time keeps the model order-free.
                let end = (off + len) as usize;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
                q.submit_write(&f, off, buf_of(&data), token).unwrap();
                q.submit().unwrap();
                for (_, c) in reap_all(&mut q) {
                    assert_eq!(c.result.unwrap(), len as usize);
                }
            }
            let check = vol.open_file("/frag", OpenFlags::default()).unwrap();
            let mut all = vec![0u8; model.len() + 4096];
            let n = check.pread(&mut all, 0).unwrap();
            assert_eq!(n, model.len(), "depth {depth}: size");
            assert!(
                all[..n] == model[..],
                "depth {depth}: contents differ from the model"
            );
            drop(q);
            drop(f);
            drop(check);
            vol.unmount().unwrap();
            let report = iomapfs_fs::fsck::check(dev.clone()).unwrap();
            assert!(report.is_clean(), "{:?}", report.problems);
        }
    }
}

#[test]
fn concurrent_async_overwrites_at_queue_depth_complete_inline() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/db", direct(false)).unwrap();
        f.pwrite(&vec![1u8; (256 * BLOCK) as usize], 0).unwrap();
        f.fsync().unwrap();
        let mut q = vol.io_queue(64).unwrap();
        for token in 0..256u64 {
            q.submit_write(
                &f,
                token * BLOCK,
                buf_of(&[token as u8; BLOCK as usize]),
                token,
            )
            .unwrap();
        }
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done.len(), 256);
        for (token, c) in done {
            assert_eq!(c.result.unwrap(), BLOCK as usize);
            assert_eq!(c.completed_by, CompletedBy::Reaper, "token {token}");
        }
        let mut back = vec![0u8; BLOCK as usize];
        for token in 0..256u64 {
            f.pread(&mut back, token * BLOCK).unwrap();
            assert!(back.iter().all(|&b| b == token as u8));
        }
    }
}

#[test]
fn each_class_of_write_completes_in_its_context() {
    for fua in [false, true] {
        for (queue, dev) in each_queue(|| MemDevice::with_caps(32 << 20, SECTOR as u32, true, fua))
        {
            println!("{queue} queue");
            let vol = volume(&dev);
            let plain = vol.open_file("/f", direct(false)).unwrap();
            plain.pwrite(&vec![1u8; (8 * BLOCK) as usize], 0).unwrap();
            plain.fsync().unwrap();
            let dsync = vol.open_file("/f", direct(true)).unwrap();
            let mut q = vol.io_queue(8).unwrap();
            let one = || buf_of(&[9u8; BLOCK as usize]);
            let before = dev.counters().snapshot();
            q.submit_write(&plain, 0, one(), 1).unwrap(); // pure overwrite
            q.submit_write(&dsync, BLOCK, one(), 3).unwrap(); // pure overwrite, DSYNC
                                                              // Last: its worker may dirty the inode (allocation) before a
                                                              // later submit, which would make that one need a commit.
            q.submit_write(&plain, 16 * BLOCK, one(), 2).unwrap(); // allocates, extends
            q.submit().unwrap();
            let done = reap_all(&mut q);
            let by = |t: u64| done[&t].completed_by;
            assert_eq!(by(1), CompletedBy::Reaper);
            assert_eq!(
                by(2),
                CompletedBy::Worker,
                "conversion and size need the worker"
            );
            // A DSYNC pure overwrite completes in the reaper: with FUA at once,
            // without it when the flush the reaper queued (never waited for)
            // lands.
            assert_eq!(by(3), CompletedBy::Reaper, "fua={fua}: DSYNC overwrite");
            let d = dev.counters().snapshot().since(&before);
            if fua {
                assert_eq!((d.fua_writes, d.flushes), (1, 0), "{d:?}");
            } else {
                assert_eq!((d.fua_writes, d.flushes), (0, 1), "{d:?}");
            }
            for t in 1..=3 {
                assert_eq!(*done[&t].result.as_ref().unwrap(), BLOCK as usize);
            }
            assert_eq!(plain.stat().unwrap().size, 17 * BLOCK);
        }
    }
}

#[test]
fn device_errors_reach_the_submitter_with_token_and_cause() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/f", direct(false)).unwrap();
        f.pwrite(&vec![1u8; (8 * BLOCK) as usize], 0).unwrap();
        f.fsync().unwrap();
        let mut q = vol.io_queue(8).unwrap();
        dev.inject(FaultRule::new(FaultOp::Write).count(1));
        q.submit_write(&f, 2 * BLOCK, buf_of(&[7u8; BLOCK as usize]), 42)
            .unwrap();
        q.submit_write(&f, 3 * BLOCK, buf_of(&[7u8; BLOCK as usize]), 43)
            .unwrap();
        q.submit().unwrap();
        let done = reap_all(&mut q);
        // The injected fault hits the write the device runs first: in
        // submission order on the inline queue, either on the other.
        let (failed, ok) = if done[&42].result.is_err() {
            (42, 43)
        } else {
            (43, 42)
        };
        if queue == "inline" {
            assert_eq!(failed, 42);
        }
        let err = done[&failed].result.as_ref().unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{err}");
        let text = err.to_string();
        let failed_offset = (failed - 40) * BLOCK;
        assert!(
            text.contains("/f") && text.contains(&failed_offset.to_string()),
            "{text}"
        );
        assert_eq!(*done[&ok].result.as_ref().unwrap(), BLOCK as usize);
        dev.clear_faults();
        dev.inject(FaultRule::new(FaultOp::Read).count(1));
        q.submit_read(&f, 0, AlignedBuf::new(BLOCK as usize, 4096).unwrap(), 7)
            .unwrap();
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done[&7].result.as_ref().unwrap_err().errno(), libc::EIO);
        // Every in-flight count was released: an exclusive operation, which
        // drains in-flight direct I/O, does not hang.
        f.truncate(BLOCK).unwrap();
        assert_eq!(f.stat().unwrap().size, BLOCK);
    }
}

#[test]
fn async_io_through_a_real_io_uring_ring_matches_the_sync_path() {
    let dir = tempfile::tempdir().unwrap();
    let Some(dev) = common::dev::uring_volume_device(dir.path(), 32 << 20) else {
        return;
    };
    let vol = Volume::open(dev.clone()).unwrap();
    let mut rng = SmallRng::seed_from_u64(7);
    let (f, model) = fragmented_file(&vol, &mut rng);
    let lbs = u64::from(dev.caps().logical_block_size);
    let mut q = vol.io_queue(32).unwrap();
    let mut expected = HashMap::new();
    for token in 0..256u64 {
        let off = rng.gen_range(0..60u64) * BLOCK;
        let len = lbs * rng.gen_range(1..=16u64);
        q.submit_read(&f, off, AlignedBuf::new(len as usize, 4096).unwrap(), token)
            .unwrap();
        expected.insert(token, (off, len));
    }
    q.submit().unwrap();
    for (token, c) in reap_all(&mut q) {
        let (off, len) = expected[&token];
        let n = c.result.unwrap();
        let want_len = (model.len() as u64).saturating_sub(off).min(len) as usize;
        assert_eq!(n, want_len);
        assert_eq!(
            &c.buf[..n],
            &model[off as usize..off as usize + n],
            "read {token}"
        );
    }
    // Pure overwrites through the ring, then check with the sync path.
    let mut model = model;
    for token in 0..64u64 {
        let b = rng.gen_range(0..60u64);
        let at = (b * BLOCK) as usize;
        if model[at..at + BLOCK as usize].iter().all(|&x| x == 0) {
            continue; // keep to written blocks: pure overwrites
        }
        let data = vec![token as u8; BLOCK as usize];
        model[at..at + BLOCK as usize].copy_from_slice(&data);
        q.submit_write(&f, b * BLOCK, buf_of(&data), 1000 + token)
            .unwrap();
        q.submit().unwrap();
        for (_, c) in reap_all(&mut q) {
            assert_eq!(c.result.unwrap(), BLOCK as usize);
        }
    }
    let check = vol.open_file("/frag", OpenFlags::default()).unwrap();
    let mut all = vec![0u8; model.len() + 4096];
    assert_eq!(check.pread(&mut all, 0).unwrap(), model.len());
    assert!(all[..model.len()] == model[..]);
}

#[test]
fn dsync_writes_completed_before_a_queued_flush_share_it() {
    for (queue, dev) in each_queue(|| MemDevice::with_caps(32 << 20, SECTOR as u32, true, false)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let plain = vol.open_file("/f", direct(false)).unwrap();
        plain.pwrite(&vec![1u8; (64 * BLOCK) as usize], 0).unwrap();
        plain.fsync().unwrap();
        let f = vol.open_file("/f", direct(true)).unwrap();
        let mut q = vol.io_queue(64).unwrap();
        let before = dev.counters().snapshot();
        for token in 0..64u64 {
            q.submit_write(&f, token * BLOCK, buf_of(&[3u8; BLOCK as usize]), token)
                .unwrap();
        }
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done.len(), 64);
        assert!(done.values().all(|c| c.result.is_ok()));
        let d = dev.counters().snapshot().since(&before);
        assert_eq!(d.writes, 64, "{d:?}");
        if queue == "inline" {
            // The inline queue completes all 64 writes in the submit that
            // carries them: the reaper then needs one flush for all of them,
            // and at most one more for writes that completed after it was
            // issued.
            assert!(d.flushes <= 2, "64 DSYNC writes took {} flushes", d.flushes);
        } else {
            // Out of order, writes complete over several reaps; each flush
            // still covers every write completed before it was issued.
            assert!(d.flushes < 64, "64 DSYNC writes took {} flushes", d.flushes);
        }
        // And every acknowledged write survives a power cut.
        let cut = Arc::new(dev.power_cut(&mut |_| blockdev::Survival::Lost));
        let after = Volume::open(cut).unwrap();
        let g = after.open_file("/f", OpenFlags::default()).unwrap();
        let mut back = vec![0u8; (64 * BLOCK) as usize];
        g.pread(&mut back, 0).unwrap();
        assert!(back.iter().all(|&b| b == 3));
    }
}

#[test]
fn a_failed_shared_flush_fails_every_dsync_write_it_covered() {
    for (queue, dev) in each_queue(|| MemDevice::with_caps(32 << 20, SECTOR as u32, true, false)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let plain = vol.open_file("/f", direct(false)).unwrap();
        plain.pwrite(&vec![1u8; (8 * BLOCK) as usize], 0).unwrap();
        plain.fsync().unwrap();
        let f = vol.open_file("/f", direct(true)).unwrap();
        let mut q = vol.io_queue(8).unwrap();
        dev.inject(FaultRule::new(FaultOp::Flush).count(1));
        for token in 0..4u64 {
            q.submit_write(&f, token * BLOCK, buf_of(&[3u8; BLOCK as usize]), token)
                .unwrap();
        }
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done.len(), 4);
        // The reaper issues a flush as soon as the first write's data
        // completes: that flush covers exactly that write, and fails: so does
        // that write. The others completed after that flush was issued and
        // wait for the next one, which succeeds. The inline queue completes
        // the writes in submission order, so the failed one is the first.
        let failed: Vec<u64> = done
            .iter()
            .filter(|(_, c)| c.result.is_err())
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(
            failed.len(),
            1,
            "exactly the covered write fails: {failed:?}"
        );
        if queue == "inline" {
            assert_eq!(failed, vec![0], "exactly the covered write fails");
        }
        let err = done[&failed[0]].result.as_ref().unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{err}");
        let cut = Arc::new(dev.power_cut(&mut |_| blockdev::Survival::Lost));
        let after = Volume::open(cut).unwrap();
        let g = after.open_file("/f", OpenFlags::default()).unwrap();
        let mut back = vec![0u8; BLOCK as usize];
        for token in (0..4u64).filter(|t| *t != failed[0]) {
            g.pread(&mut back, token * BLOCK).unwrap();
            assert!(
                back.iter().all(|&b| b == 3),
                "acknowledged write {token} lost"
            );
        }
    }
}

/// Requests that are not whole device blocks are accepted and completed by
/// the worker through the byte-granular path. Once a file has seen such a
/// write, its aligned overwrites hold their blocks in the range lock and
/// still complete inline.
#[test]
fn byte_granular_requests_complete_in_the_worker_with_the_right_bytes() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/bytes", direct(false)).unwrap();
        f.pwrite(&[0x11; 4 * BLOCK as usize], 0).unwrap();
        let g = vol.open_file("/aligned", direct(false)).unwrap();
        g.pwrite(&[0x22; BLOCK as usize], 0).unwrap();
        let mut q = vol.io_queue(8).unwrap();

        // Before any byte-granular write: aligned overwrites complete inline.
        q.submit_write(&f, 0, buf_of(&[0x33; SECTOR as usize]), 1)
            .unwrap();
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done[&1].completed_by, CompletedBy::Reaper);

        q.submit_write(&f, 1000, buf_of(&[0x44; 100]), 2).unwrap();
        q.submit_read(&f, 990, AlignedBuf::new(120, 4096).unwrap(), 3)
            .unwrap();
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done[&2].result.as_ref().unwrap(), &100);
        assert_eq!(done[&2].completed_by, CompletedBy::Worker);
        // The worker runs its jobs in submission order: the read sees the write.
        let read = &done[&3];
        assert_eq!(read.result.as_ref().unwrap(), &120);
        assert_eq!(read.completed_by, CompletedBy::Worker);
        assert!(read.buf[..10].iter().all(|&b| b == 0x11));
        assert!(read.buf[10..110].iter().all(|&b| b == 0x44));
        assert!(read.buf[110..].iter().all(|&b| b == 0x11));

        let mut back = vec![0u8; 120];
        f.pread(&mut back, 990).unwrap();
        assert!(back[10..110].iter().all(|&b| b == 0x44), "{back:?}");

        q.submit_write(&f, BLOCK, buf_of(&[0x55; SECTOR as usize]), 4)
            .unwrap();
        q.submit_write(&g, 0, buf_of(&[0x66; SECTOR as usize]), 5)
            .unwrap();
        q.submit().unwrap();
        let done = reap_all(&mut q);
        assert_eq!(done[&4].completed_by, CompletedBy::Reaper);
        assert_eq!(done[&5].completed_by, CompletedBy::Reaper);
        f.pread(&mut back[..8], BLOCK).unwrap();
        assert_eq!(&back[..8], &[0x55; 8]);
    }
}

/// After a file's first byte-granular write, the next ones run under the
/// shared lock (holding their blocks in the range lock): they do not wait
/// for in-flight direct I/O to drain. An unreaped async read holds the
/// file's in-flight count here, so a byte-granular write that went
/// exclusive would wait forever.
#[test]
fn later_byte_granular_overwrites_do_not_drain_in_flight_io() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/f", direct(false)).unwrap();
        f.pwrite(&[0x11; 2 * BLOCK as usize], 0).unwrap();
        f.pwrite(&[0x22; 10], 5).unwrap(); // the first: exclusive, enables ranges
        let mut q = vol.io_queue(4).unwrap();
        q.submit_read(&f, BLOCK, AlignedBuf::new(BLOCK as usize, 4096).unwrap(), 1)
            .unwrap();
        q.submit().unwrap();
        let writer = {
            let f = f.try_clone().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                f.pwrite(&[0x33; 700], 1000).unwrap();
                tx.send(()).unwrap();
            });
            rx
        };
        // Rewriting bytes of the last, partial sector is an overwrite too: the
        // rest of that sector past EOF is padding.
        let tail = {
            let g = vol.open_file("/tail", direct(false)).unwrap();
            g.pwrite(&[0x44; 5000], 0).unwrap();
            g.pwrite(&[0x45; 3], 1).unwrap(); // ranges on
            let (tx, rx) = std::sync::mpsc::channel();
            let mut q2 = vol.io_queue(2).unwrap();
            q2.submit_read(&g, 0, AlignedBuf::new(SECTOR as usize, 4096).unwrap(), 9)
                .unwrap();
            q2.submit().unwrap();
            let h = g.try_clone().unwrap();
            std::thread::spawn(move || {
                h.pwrite(&[0x46; 50], 4900).unwrap();
                tx.send(()).unwrap();
            });
            let finished = rx.recv_timeout(std::time::Duration::from_secs(20));
            drop(q2); // reaps the read
            assert!(
                finished.is_ok(),
                "rewriting the last partial sector waited for the unreaped read"
            );
            g
        };
        assert_eq!(tail.stat().unwrap().size, 5000);
        let mut end = vec![0u8; 200];
        assert_eq!(tail.pread(&mut end, 4850).unwrap(), 150);
        assert!(end[..50].iter().all(|&b| b == 0x44));
        assert!(end[50..100].iter().all(|&b| b == 0x46));
        assert!(end[100..150].iter().all(|&b| b == 0x44));
        let finished = writer.recv_timeout(std::time::Duration::from_secs(20));
        let done = reap_all(&mut q);
        assert!(
            finished.is_ok(),
            "a byte-granular overwrite waited for the unreaped read"
        );
        assert_eq!(done[&1].result.as_ref().unwrap(), &(BLOCK as usize));
        let mut back = vec![0u8; 1800];
        f.pread(&mut back, 0).unwrap();
        assert_eq!(&back[5..15], &[0x22; 10]);
        assert!(back[1000..1700].iter().all(|&b| b == 0x33));
        assert!(back[1700..].iter().all(|&b| b == 0x11));
    }
}

/// A direct write of whole blocks into a hole inside the on-disk EOF
/// allocates and converts under the shared lock, as XFS's aligned direct
/// writes do: it does not wait for the file's in-flight I/O to drain (an
/// unreaped async read holds it here, so a write that went exclusive would
/// wait forever). Its data and the read's are both right after.
#[test]
fn aligned_allocating_writes_inside_eof_do_not_drain_in_flight_io() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/holes", direct(false)).unwrap();
        f.pwrite(&[0x11; BLOCK as usize], 0).unwrap();
        f.pwrite(&[0x12; BLOCK as usize], 15 * BLOCK).unwrap(); // EOF 64 KiB
        let mut q = vol.io_queue(4).unwrap();
        q.submit_read(&f, 0, AlignedBuf::new(BLOCK as usize, 4096).unwrap(), 1)
            .unwrap();
        q.submit().unwrap();
        let writer = {
            let f = f.try_clone().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let written = f.pwrite(&[0x33; 2 * BLOCK as usize], 4 * BLOCK);
                tx.send(written.map_err(|e| e.to_string())).unwrap();
            });
            rx
        };
        let finished = writer.recv_timeout(std::time::Duration::from_secs(20));
        let done = reap_all(&mut q);
        let written = finished.expect("an aligned allocating write waited for the unreaped read");
        assert_eq!(written.unwrap(), 2 * BLOCK as usize);
        assert_eq!(done[&1].result.as_ref().unwrap(), &(BLOCK as usize));
        let mut back = vec![0u8; 16 * BLOCK as usize];
        f.pread(&mut back, 0).unwrap();
        let block = |b: u64| &back[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize];
        assert!(block(0).iter().all(|&x| x == 0x11));
        assert!(block(3).iter().all(|&x| x == 0), "a hole beside the write");
        assert!(block(4).iter().all(|&x| x == 0x33));
        assert!(block(5).iter().all(|&x| x == 0x33));
        assert!(block(6).iter().all(|&x| x == 0), "a hole beside the write");
        assert!(block(15).iter().all(|&x| x == 0x12));
        drop(f);
        vol.unmount().unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        let f = vol.open_file("/holes", direct(false)).unwrap();
        let mut again = vec![0u8; 2 * BLOCK as usize];
        f.pread(&mut again, 4 * BLOCK).unwrap();
        assert!(again.iter().all(|&x| x == 0x33), "converted for good");
    }
}

/// A buffered read between an async direct write's submission and its
/// completion caches what the write replaces; once the write is reaped,
/// the buffered handle sees the new bytes (the completion drops that
/// folio), for an overwrite and for an allocating write into a hole.
#[test]
fn a_buffered_read_before_an_async_write_completes_does_not_keep_the_old_bytes() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/mixed", direct(false)).unwrap();
        f.pwrite(&[0x11; 8 * BLOCK as usize], 0).unwrap();
        f.punch_hole(5 * BLOCK, BLOCK).unwrap();
        let b = vol
            .open_file(
                "/mixed",
                OpenFlags {
                    create: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        let mut q = vol.io_queue(4).unwrap();
        for (what, block, old) in [("overwrite", 2u64, 0x11u8), ("allocating write", 5, 0)] {
            let new = 0x40 + block as u8;
            q.submit_write(&f, block * BLOCK, buf_of(&[new; BLOCK as usize]), block)
                .unwrap();
            q.submit().unwrap();
            let mut seen = vec![0u8; BLOCK as usize];
            b.pread(&mut seen, block * BLOCK).unwrap();
            assert!(
                seen.iter().all(|&x| x == old) || seen.iter().all(|&x| x == new),
                "{what}: a mix of old and new bytes"
            );
            let done = reap_all(&mut q);
            done[&block].result.as_ref().unwrap();
            b.pread(&mut seen, block * BLOCK).unwrap();
            assert!(
                seen.iter().all(|&x| x == new),
                "{what}: the buffered handle kept the old bytes"
            );
        }
    }
}

/// A synchronous 10-byte write read-modify-writes a sector; between its
/// read and its write back, an async whole-sector overwrite of that sector
/// is submitted. It must not go to the device in between (it would be
/// undone): it finds the sector held and completes after, through the
/// worker, so the sector ends up all the async write's bytes. Once nothing
/// holds the sector, the same write completes inline again.
#[test]
fn async_overwrite_never_lands_inside_a_read_modify_write() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/mixed", direct(false)).unwrap();
        f.pwrite(&[0xEE; 2 * BLOCK as usize], 0).unwrap();
        f.pwrite(&[0xEE; 10], 3).unwrap(); // first byte-granular write: ranges on
        let sector = BLOCK + SECTOR;
        let extent = f.fiemap().unwrap()[0];
        let sector_addr = extent.addr + (sector - extent.offset);
        let mut q = vol.io_queue(4).unwrap();
        for round in 0..20u8 {
            // The byte writer's edge read of the sector.
            let edge_read = dev.pause_after(
                FaultRule::new(FaultOp::Read).range(sector_addr..sector_addr + SECTOR),
            );
            let byte_writer = {
                let f = f.try_clone().unwrap();
                std::thread::spawn(move || f.pwrite(&[0xF0 ^ round; 10], sector + 100).unwrap())
            };
            edge_read.wait_reached();
            let whole = round + 1;
            q.submit_write(&f, sector, buf_of(&[whole; SECTOR as usize]), 1)
                .unwrap();
            q.submit().unwrap();
            edge_read.resume();
            let c = reap_all(&mut q).remove(&1).unwrap();
            c.result.unwrap();
            assert_eq!(c.completed_by, CompletedBy::Worker, "round {round}");
            byte_writer.join().unwrap();
            let mut got = vec![0u8; SECTOR as usize];
            f.pread(&mut got, sector).unwrap();
            assert!(
                got.iter().all(|&b| b == whole),
                "round {round}: the async write was undone: {:x?}",
                &got[..16]
            );
        }
        q.submit_write(&f, sector, buf_of(&[0x77; SECTOR as usize]), 2)
            .unwrap();
        let c = reap_all(&mut q).remove(&2).unwrap();
        assert_eq!(c.completed_by, CompletedBy::Reaper);
    }
}

/// On a device whose kernel queue holds 3 requests, two queues with 64
/// writes in flight each keep at most 3 of them in the device, plus one of
/// a queue that held none (so neither ever waits for the other's); every
/// write completes inline with its bytes, and the slots all come back.
#[test]
fn queues_keep_within_the_devices_request_slots() {
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32).with_request_slots(3))
    {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/db", direct(false)).unwrap();
        f.pwrite(&vec![1u8; (128 * BLOCK) as usize], 0).unwrap();
        f.fsync().unwrap();
        let (mut a, mut b) = (vol.io_queue(64).unwrap(), vol.io_queue(64).unwrap());
        let mut peak = 0;
        for token in 0..128u64 {
            let q = if token % 2 == 0 { &mut a } else { &mut b };
            let buf = buf_of(&[token as u8; BLOCK as usize]);
            q.submit_write(&f, token * BLOCK, buf, token).unwrap();
            peak = peak.max(vol.device_slots_in_use());
            assert!(vol.device_slots_in_use() <= 4, "token {token}");
        }
        assert!(peak >= 3, "the slots were used: peak {peak}");
        a.submit().unwrap();
        b.submit().unwrap();
        let mut done = reap_all(&mut a);
        done.extend(reap_all(&mut b));
        assert_eq!(done.len(), 128);
        for (token, c) in done {
            assert_eq!(c.result.unwrap(), BLOCK as usize);
            assert_eq!(c.completed_by, CompletedBy::Reaper, "token {token}");
        }
        assert_eq!(vol.device_slots_in_use(), 0);
        let mut back = vec![0u8; BLOCK as usize];
        for token in 0..128u64 {
            f.pread(&mut back, token * BLOCK).unwrap();
            assert!(back.iter().all(|&x| x == token as u8), "token {token}");
        }
    }
}

/// A reaper never waits for a folio's lock (review R1): an async direct
/// write completes on the device while a writeback holds the lock of the
/// folio over its range (a buffered handle cached and dirtied the block
/// after the write was submitted). The reap returns another request's
/// completion without waiting for that writeback; the write completes once
/// the writeback is done, and the cache and the device then hold its bytes.
#[test]
fn a_reaper_does_not_wait_for_a_writeback_holding_a_folio_of_its_write() {
    use std::sync::mpsc;
    use std::time::Duration;
    for (queue, dev) in each_queue(|| MemDevice::new(32 << 20, SECTOR as u32)) {
        println!("{queue} queue");
        let vol = volume(&dev);
        let f = vol.open_file("/mixed", direct(false)).unwrap();
        f.pwrite(&[0x11; 8 * BLOCK as usize], 0).unwrap();
        let g = vol.open_file("/other", direct(false)).unwrap();
        g.pwrite(&[0x33; BLOCK as usize], 0).unwrap();
        let extent = f.fiemap().unwrap()[0];
        let block_addr = extent.addr + (2 * BLOCK - extent.offset);
        let buffered = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        let b = vol.open_file("/mixed", buffered).unwrap();
        let mut q = vol.io_queue(4).unwrap();
        q.submit_write(&f, 2 * BLOCK, buf_of(&[0x42; BLOCK as usize]), 7)
            .unwrap();
        b.pwrite(&[0x22; BLOCK as usize], 2 * BLOCK).unwrap();
        let writeback =
            dev.pause_after(FaultRule::new(FaultOp::Write).range(block_addr..block_addr + BLOCK));
        let syncer = {
            let b = b.try_clone().unwrap();
            std::thread::spawn(move || b.fsync())
        };
        writeback.wait_reached();
        q.submit_read(&g, 0, buf_of(&[0; BLOCK as usize]), 8)
            .unwrap();
        q.submit().unwrap();
        // Lets the writeback go if the reap below waits for it, so that a
        // failing run ends instead of hanging.
        let (reaped, reaped_rx) = mpsc::channel::<()>();
        let releaser = std::thread::spawn(move || {
            let in_time = reaped_rx.recv_timeout(Duration::from_secs(20)).is_ok();
            writeback.resume();
            in_time
        });
        let mut out = Vec::new();
        q.reap(1, &mut out).unwrap();
        reaped.send(()).unwrap();
        assert!(
            releaser.join().unwrap(),
            "{queue}: the reap waited for the writeback holding the folio"
        );
        let tokens: Vec<u64> = out.iter().map(|c| c.token).collect();
        assert!(tokens.contains(&8), "{queue}: the read did not complete");
        assert!(
            !tokens.contains(&7),
            "{queue}: the write completed before the cache held its bytes"
        );
        syncer.join().unwrap().unwrap();
        let done = reap_all(&mut q);
        done[&7].result.as_ref().unwrap();
        let mut seen = vec![0u8; BLOCK as usize];
        b.pread(&mut seen, 2 * BLOCK).unwrap();
        assert!(
            seen.iter().all(|&x| x == 0x42),
            "{queue}: the cache kept the buffered write's bytes over the direct write's"
        );
        b.fsync().unwrap();
        f.pread(&mut seen, 2 * BLOCK).unwrap();
        assert!(
            seen.iter().all(|&x| x == 0x42),
            "{queue}: the device lost the direct write"
        );
    }
}
