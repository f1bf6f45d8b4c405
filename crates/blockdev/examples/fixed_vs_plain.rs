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
use std::time::Duration;

use blockdev::{AlignedBuf, BlockDevice, SyncOpenOptions, UringDevice, UringOptions};

mod common;

use common::{keep_reads_in_flight, BLOCK};

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

/// One thread keeping `depth` reads in flight on a fresh queue.
fn run(dev: &UringDevice, blocks: u64, depth: usize, fixed: bool, run_for: Duration) -> f64 {
    let mut q = dev.new_queue(depth).unwrap();
    if fixed {
        if let Some(why) = q.fixed_buffer_error() {
            eprintln!("no registered buffers: {why}");
            std::process::exit(1);
        }
    }
    let rate = keep_reads_in_flight(&mut q, blocks, depth, run_for, |q| {
        if fixed {
            q.alloc_buffer(BLOCK).unwrap()
        } else {
            AlignedBuf::new(BLOCK, BLOCK).unwrap()
        }
    });
    assert_eq!(
        fixed,
        q.fixed_entries() > 0,
        "fixed entries only when asked"
    );
    rate
}
