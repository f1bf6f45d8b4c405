//! Checkpoints after 1% of a large file's extents changed, as the bench's
//! `metadata-scale` "ckpt 1%" column measures them, in a loop long enough
//! to profile: builds (or reuses) an image with EXTENTS one-block extents
//! at every other block, then runs ROUNDS of {write one block into the hole
//! after every hundredth extent, time a checkpoint, punch them again,
//! checkpoint}; prints each round and the median, and how long the first
//! and second change after each timed checkpoint took.
//!
//! cargo run --release -p iomapfs-fs --example checkpoint_one_percent -- IMAGE [EXTENTS] [ROUNDS]
//!
//! With `PERF_CTL=FIFO` (perf record --control=fifo:FIFO -D -1), profiling
//! is enabled around the timed checkpoints only. With `CRASH` set it ends
//! by aborting instead of unmounting, so that the next run (which prints
//! its mount time and its first allocating write) mounts after a crash.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{AlignedBuf, Backend, BlockDevice};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const BLOCK: u64 = 4096;
const FILE: &str = "/extents";

fn direct() -> OpenFlags {
    OpenFlags {
        direct: true,
        ..OpenFlags::default()
    }
}

fn perf(ctl: &mut Option<std::fs::File>, cmd: &str) {
    if let Some(f) = ctl {
        f.write_all(cmd.as_bytes()).unwrap();
        f.flush().unwrap();
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let image = args.next().expect("IMAGE");
    let extents: u64 = args.next().map_or(1_000_000, |s| s.parse().unwrap());
    let rounds: usize = args.next().map_or(20, |s| s.parse().unwrap());
    let fresh = !std::path::Path::new(&image).exists();
    if fresh {
        let f = std::fs::File::create(&image).unwrap();
        f.set_len((extents * 4 * BLOCK + (2 << 30)).next_multiple_of(1 << 30))
            .unwrap();
    }
    let (dev, _) =
        blockdev::open_device(std::path::Path::new(&image), false, Backend::Auto).unwrap();
    let dev: Arc<dyn BlockDevice> = dev;
    if fresh {
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    }
    let mounting = Instant::now();
    let vol = Volume::open(dev.clone()).unwrap();
    let mounted = mounting.elapsed();
    let buf = AlignedBuf::new(BLOCK as usize, 4096).unwrap();
    if fresh {
        let file = vol
            .open_file(
                FILE,
                OpenFlags {
                    create: true,
                    ..direct()
                },
            )
            .unwrap();
        let started = Instant::now();
        for i in 0..extents {
            file.pwrite(&buf, i * 2 * BLOCK).unwrap();
        }
        file.fsync().unwrap();
        vol.checkpoint().unwrap();
        eprintln!("built {extents} extents in {:?}", started.elapsed());
    }
    let mut ctl = std::env::var("PERF_CTL")
        .ok()
        .map(|p| std::fs::OpenOptions::new().write(true).open(p).unwrap());
    let file = vol.open_file(FILE, direct()).unwrap();
    let holes: Vec<u64> = (0..extents)
        .step_by(100)
        .map(|i| (i * 2 + 1) * BLOCK)
        .collect();
    let mut times = Vec::new();
    for round in 0..rounds {
        for (i, &offset) in holes.iter().enumerate() {
            let started = Instant::now();
            file.pwrite(&buf, offset).unwrap();
            if round == 0 && i == 0 && !fresh {
                println!(
                    "mount {:.2} ms, then the first allocating write {:.2} ms",
                    mounted.as_secs_f64() * 1e3,
                    started.elapsed().as_secs_f64() * 1e3
                );
            }
        }
        perf(&mut ctl, "enable\n");
        let started = Instant::now();
        vol.checkpoint().unwrap();
        let t = started.elapsed();
        perf(&mut ctl, "disable\n");
        println!("round {round}: {:.2} ms", t.as_secs_f64() * 1e3);
        times.push(t);
        // The first change after a checkpoint, and the next one.
        let mut first_changes = [Duration::ZERO; 2];
        for (i, &offset) in holes.iter().enumerate() {
            let started = Instant::now();
            file.punch_hole(offset, BLOCK).unwrap();
            if let Some(t) = first_changes.get_mut(i) {
                *t = started.elapsed();
            }
        }
        println!(
            "  first change after it: {:.1} us, second: {:.1} us",
            first_changes[0].as_secs_f64() * 1e6,
            first_changes[1].as_secs_f64() * 1e6
        );
        vol.checkpoint().unwrap();
    }
    times.sort();
    println!(
        "median {:.2} ms",
        times[times.len() / 2].as_secs_f64() * 1e3
    );
    if std::env::var_os("CRASH").is_some() {
        // No unmount, no clean mark: the next run mounts after a crash.
        std::process::abort();
    }
    drop(file);
    vol.unmount().unwrap();
}
