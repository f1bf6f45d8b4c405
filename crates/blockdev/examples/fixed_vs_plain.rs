//! 4 KiB random-read IOPS on one io_uring queue: plain buffers
//! (`IORING_OP_READ`, pages pinned per request) against the queue's
//! registered buffers (`IORING_OP_READ_FIXED`), same device, same run,
//! alternating rounds.
//!
//! ```text
//! cargo run --release -p blockdev --example fixed_vs_plain -- PATH [--qd N] [--seconds S] [--rounds R]
//! ```
//!
//! PATH is an image file or block device, opened read-only. A figure to
//! quote, not a test: nothing is asserted.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use blockdev::{
    AlignedBuf, BlockDevice, DeviceQueue, DeviceRequest, SyncOpenOptions, UringDevice, UringOptions,
};

const BLOCK: usize = 4096;

fn main() {
    let mut path = None;
    let mut qd = 32usize;
    let mut seconds = 2.0f64;
    let mut rounds = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut num = |what: &str| -> String { args.next().unwrap_or_else(|| panic!("{what} N")) };
        match arg.as_str() {
            "--qd" => qd = num("--qd").parse().expect("--qd N"),
            "--seconds" => seconds = num("--seconds").parse().expect("--seconds S"),
            "--rounds" => rounds = num("--rounds").parse().expect("--rounds R"),
            _ => path = Some(PathBuf::from(arg)),
        }
    }
    let path = path.expect("usage: fixed_vs_plain PATH [--qd N] [--seconds S] [--rounds R]");
    let opts = SyncOpenOptions { read_only: true };
    let dev = UringDevice::open(&path, opts, UringOptions::default())
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(1)
        })
        .with_fixed_buffers(qd, BLOCK);
    println!(
        "device {} ({:?}, direct I/O {}), {} bytes, QD{qd}, 4 KiB random reads",
        path.display(),
        dev.caps().kind,
        dev.caps().direct_io,
        dev.caps().size_bytes
    );
    let blocks = dev.caps().size_bytes / BLOCK as u64;
    let run_for = Duration::from_secs_f64(seconds);
    let (mut plain, mut fixed) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(run(&dev, blocks, qd, false, run_for));
        fixed.push(run(&dev, blocks, qd, true, run_for));
    }
    println!("plain, by round: {plain:.0?}\nfixed, by round: {fixed:.0?}");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, f) = (median(&mut plain), median(&mut fixed));
    println!(
        "median IOPS  plain {p:.0}   fixed {f:.0}   fixed/plain {:.3}",
        f / p
    );
}

/// xorshift64*: cheap, and good enough to scatter offsets.
struct Rng(u64);

impl Rng {
    fn offset(&mut self, blocks: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % blocks) * BLOCK as u64
    }
}

/// One thread keeping `depth` reads in flight on a fresh queue.
fn run(dev: &UringDevice, blocks: u64, depth: usize, fixed: bool, run_for: Duration) -> f64 {
    let mut q = dev.new_queue(depth).unwrap();
    if fixed {
        if let Some(why) = q.fixed_buffer_error() {
            eprintln!("no registered buffers: {why}");
            std::process::exit(1);
        }
    }
    let mut rng = Rng(0x51_7cc1_b727_220a);
    for token in 0..depth as u64 {
        let buf = if fixed {
            q.alloc_buffer(BLOCK).unwrap()
        } else {
            AlignedBuf::new(BLOCK, BLOCK).unwrap()
        };
        q.push(
            token,
            DeviceRequest::Read {
                offset: rng.offset(blocks),
                buf,
            },
        )
        .unwrap();
    }
    q.submit().unwrap();
    let mut out = Vec::with_capacity(depth);
    let mut n = 0u64;
    let start = Instant::now();
    q.reap(1, &mut out).unwrap();
    loop {
        let stopping = start.elapsed() >= run_for;
        for c in out.drain(..) {
            c.result.unwrap();
            n += 1;
            if !stopping {
                let buf = c.buf.unwrap();
                q.push(
                    c.token,
                    DeviceRequest::Read {
                        offset: rng.offset(blocks),
                        buf,
                    },
                )
                .unwrap();
            }
        }
        if stopping {
            break;
        }
        q.submit_and_reap(1, &mut out).unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    while q.in_flight() > 0 {
        q.reap(q.in_flight(), &mut out).unwrap();
        out.clear();
    }
    assert_eq!(
        fixed,
        q.fixed_entries() > 0,
        "fixed entries only when asked"
    );
    n as f64 / elapsed
}
