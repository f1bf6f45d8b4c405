//! 4 KiB random reads at a queue depth, through the raw device queue and
//! through iomapfs's asynchronous file API, on the same device and backend in
//! one run; prints IOPS and the ratio.
//!
//! cargo run --release -p iomapfs-fs --example aio_randread -- DEVICE [auto|sync|uring] [SECONDS]
//!
//! DEVICE is formatted (its contents are destroyed).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use blockdev::{AlignedBuf, Backend, BlockDevice, DeviceCompletion, DeviceRequest};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const IO: usize = 4096;
const FILE_BYTES: u64 = 256 << 20;

/// The same offsets for both targets, from the workspace's seeded PRNG.
struct Offsets(blockdev::rng::SplitMix64);

impl Offsets {
    fn new() -> Offsets {
        Offsets(blockdev::rng::SplitMix64::new(0x9e37_79b9_7f4a_7c15))
    }

    fn next(&mut self, span: u64) -> u64 {
        self.0.below(span / IO as u64) * IO as u64
    }
}

fn raw(dev: &Arc<dyn BlockDevice>, base: u64, depth: usize, secs: f64) -> f64 {
    let mut q = blockdev::new_queue(dev, depth).unwrap();
    let mut offsets = Offsets::new();
    let mut done = Vec::with_capacity(depth);
    let mut free: Vec<AlignedBuf> = (0..depth)
        .map(|_| AlignedBuf::new(IO, 4096).unwrap())
        .collect();
    let start = Instant::now();
    let mut ios = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        while let Some(buf) = free.pop() {
            let offset = base + offsets.next(FILE_BYTES);
            q.push(0, DeviceRequest::Read { offset, buf }).unwrap();
        }
        q.submit_and_reap(1, &mut done).unwrap();
        for c in done.drain(..) {
            let DeviceCompletion { result, buf, .. } = c;
            result.unwrap();
            free.push(buf.unwrap());
            ios += 1;
        }
    }
    let mut rest = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut rest).unwrap();
    }
    ios as f64 / start.elapsed().as_secs_f64()
}

fn fs(vol: &Volume, file: &iomapfs_fs::File, depth: usize, secs: f64) -> f64 {
    let mut q = vol.io_queue(depth).unwrap();
    let mut offsets = Offsets::new();
    let mut done = Vec::with_capacity(depth);
    let mut free: Vec<AlignedBuf> = (0..depth)
        .map(|_| AlignedBuf::new(IO, 4096).unwrap())
        .collect();
    let start = Instant::now();
    let mut ios = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        while let Some(buf) = free.pop() {
            q.submit_read(file, offsets.next(FILE_BYTES), buf, 0)
                .map_err(|r| r.1)
                .unwrap();
        }
        q.reap(1, &mut done).unwrap();
        for c in done.drain(..) {
            c.result.unwrap();
            free.push(c.buf);
            ios += 1;
        }
    }
    let mut rest = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut rest).unwrap();
    }
    ios as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(
        args.next()
            .expect("usage: aio_randread DEVICE [BACKEND] [SECS]"),
    );
    let backend: Backend = args.next().map_or(Backend::Auto, |b| b.parse().unwrap());
    let secs: f64 = args.next().map_or(3.0, |s| s.parse().unwrap());
    let (dev, choice) = blockdev::open_device(&path, false, backend).unwrap();
    println!("device {} backend {}", path.display(), choice);
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let file = vol
        .open_file(
            "/bench",
            OpenFlags {
                create: true,
                direct: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    for i in 0..FILE_BYTES / chunk.len() as u64 {
        file.pwrite(&chunk, i * chunk.len() as u64).unwrap();
    }
    file.fsync().unwrap();
    // Raw reads hit the same device range the file occupies.
    let base = file.fiemap().unwrap()[0].addr;
    for depth in [1usize, 32] {
        let r = raw(&dev, base, depth, secs);
        let f = fs(&vol, &file, depth, secs);
        let r2 = raw(&dev, base, depth, secs);
        let raw_iops = (r + r2) / 2.0;
        println!(
            "randread-4k-qd{depth}: raw {raw_iops:.0} IOPS (runs {r:.0}, {r2:.0}), iomapfs {f:.0} IOPS, ratio {:.3}",
            f / raw_iops
        );
    }
}
