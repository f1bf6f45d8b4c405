//! 4 KiB random-read IOPS at queue depth 1 and 32: the sync backend (one
//! thread per request in flight) against one io_uring queue, on one device.
//!
//! ```text
//! cargo run --release -p blockdev --example randread_qd -- PATH [--fill] [--seconds S]
//! ```
//!
//! PATH is an image file or block device; `--fill` first writes the whole
//! device with a pattern (DESTROYS ITS CONTENTS; use it on zram, whose
//! unwritten pages read back without touching the compressor). A figure for
//! the lead to quote, not a test: nothing is asserted.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{new_queue, open_device, AlignedBuf, Backend, BlockDevice, DeviceQueue, WriteMode};

mod common;

use common::{keep_reads_in_flight, Rng, BLOCK};

fn main() {
    let mut path = None;
    let mut fill = false;
    let mut seconds = 3.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--fill" => fill = true,
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--seconds S")
            }
            _ => path = Some(PathBuf::from(arg)),
        }
    }
    let path = path.expect("usage: randread_qd PATH [--fill] [--seconds S]");
    let run_for = Duration::from_secs_f64(seconds);

    // One open (block devices are opened exclusively): the io_uring device
    // answers synchronous calls through its sync descriptor.
    let (dev, choice) = open_device(&path, !fill, Backend::Uring).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    println!(
        "device {} ({:?}), {} bytes",
        path.display(),
        dev.caps().kind,
        dev.caps().size_bytes
    );
    println!("opened with: {choice}");
    if fill {
        fill_device(&dev);
    }
    let blocks = dev.caps().size_bytes / BLOCK as u64;

    for qd in [1usize, 32] {
        let sync = sync_threads(&dev, blocks, qd, run_for);
        let uring = uring_queue(&dev, blocks, qd, run_for);
        println!(
            "QD{qd:<3} sync ({qd} thread{}): {:>9.0} IOPS   uring (1 thread, 1 ring): {:>9.0} IOPS   uring/sync {:.2}",
            if qd == 1 { "" } else { "s" },
            sync,
            uring,
            uring / sync
        );
    }
}

fn fill_device(dev: &Arc<dyn BlockDevice>) {
    let chunk = 1 << 20;
    let mut buf = AlignedBuf::new(chunk, BLOCK).unwrap();
    let size = dev.caps().size_bytes;
    let mut off = 0u64;
    while off < size {
        let len = chunk.min((size - off) as usize);
        for (i, b) in buf[..len].iter_mut().enumerate() {
            *b = (off as usize + i).wrapping_mul(2654435761) as u8 ^ (i >> 9) as u8;
        }
        dev.write_at(&buf[..len], off, WriteMode::Normal).unwrap();
        off += len as u64;
    }
    dev.flush().unwrap();
}

/// `threads` threads, each doing one synchronous read at a time.
fn sync_threads(dev: &Arc<dyn BlockDevice>, blocks: u64, threads: usize, run_for: Duration) -> f64 {
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (dev, stop, done) = (Arc::clone(dev), &stop, &done);
            s.spawn(move || {
                let mut rng = Rng::new(t as u64 + 1);
                let mut buf = AlignedBuf::new(BLOCK, BLOCK).unwrap();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    dev.read_at(&mut buf, rng.offset(blocks)).unwrap();
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
            });
        }
        std::thread::sleep(run_for);
        stop.store(true, Ordering::Relaxed);
    });
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// One thread keeping `depth` reads in flight on one queue.
fn uring_queue(dev: &Arc<dyn BlockDevice>, blocks: u64, depth: usize, run_for: Duration) -> f64 {
    let mut q: Box<dyn DeviceQueue> = new_queue(dev, depth).unwrap();
    keep_reads_in_flight(&mut *q, blocks, depth, run_for, |_| {
        AlignedBuf::new(BLOCK, BLOCK).unwrap()
    })
}
