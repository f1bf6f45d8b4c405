//! What reading a large paged map through a small metadata budget costs
//! the process in resident memory. Alone in its test binary: it reads the
//! process's resident set, which other tests' allocations would move.

mod common;

use std::sync::Arc;

use blockdev::sync_backend::{SyncDevice, SyncOpenOptions};
use blockdev::{AlignedBuf, BlockDevice};
use common::dev::{ScratchImage, MIB};
use iomapfs_fs::{FormatOptions, MountOptions, OpenFlags, Volume};

const BLOCK: u64 = 4096;

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Chunks read from their pages and evicted again, many times over the
/// budget, among small allocations that live on, keep the process's peak
/// within the budget, the pool's warm slots and a little more: an evicted
/// chunk's slot serves the next chunk. (At this scale glibc's heap stays
/// near the bound too, so the test does not tell the pool from the heap:
/// `docs/EXTENT_PAGES.md` has the 10M-extent measurements where it does.
/// It fails if slots are not given back: 62 MiB over.)
#[cfg(target_os = "linux")]
#[test]
fn reading_every_chunk_through_a_small_budget_stays_near_it() {
    // 1M one-block extents: 3,907 chunks of 256, about 31 MiB of them.
    const EXTENTS: u64 = 1_000_000;
    const BUDGET: u64 = 8 * MIB;
    let image = ScratchImage::new("chunk-memory", 4 * EXTENTS * BLOCK);
    let dev: Arc<dyn BlockDevice> =
        Arc::new(SyncDevice::open(&image.path, SyncOpenOptions::default()).unwrap());
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    let file = vol.open_file("/f", create).unwrap();
    for i in 0..EXTENTS {
        file.fallocate(2 * i * BLOCK, BLOCK, false).unwrap();
    }
    drop(file);
    // Data in the first block of every 61st chunk's stride, so that the
    // reads check the maps read back, not only that they read.
    let stride = 2 * 256 * BLOCK;
    let per_round = EXTENTS * 2 * BLOCK / stride;
    let written = |k: u64| k.is_multiple_of(61);
    let pattern = |k: u64| (k % 251) as u8 + 1;
    let direct = OpenFlags {
        direct: true,
        ..OpenFlags::default()
    };
    let file = vol.open_file("/f", direct).unwrap();
    let mut buf = AlignedBuf::new(BLOCK as usize, 4096).unwrap();
    for k in (0..per_round).filter(|&k| written(k)) {
        buf.fill(pattern(k));
        file.pwrite(&buf, k * stride).unwrap();
    }
    drop(file);
    vol.unmount().unwrap();

    let opts = MountOptions {
        metadata_cache_bytes: BUDGET,
        ..MountOptions::default()
    };
    let vol = Volume::open_with(dev.clone(), &opts).unwrap();
    let file = vol.open_file("/f", direct).unwrap();
    // Free space ready and one chunk read: what the process holds before
    // the reads that churn the budget.
    vol.statfs();
    file.pread(&mut buf, BLOCK * 2).unwrap();
    // Reset the peak (VmHWM) to what is resident now.
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        eprintln!("skipped: the peak resident set cannot be reset (/proc/self/clear_refs: {e})");
        return;
    }
    let before = status_kib("VmRSS:") * 1024;
    // Small allocations that live on, made among the reads (as any
    // program's are): in a heap they land in the holes evicted chunks
    // leave.
    let mut kept = Vec::new();
    for round in 0..2 {
        for k in 0..per_round {
            file.pread(&mut buf, k * stride + round * 2 * BLOCK)
                .unwrap();
            let want = if round == 0 && written(k) {
                pattern(k)
            } else {
                0
            };
            assert!(
                buf.iter().all(|&b| b == want),
                "round {round}, stride {k}: read {:#x}, want {want:#x}",
                buf[0]
            );
            kept.push(vec![k as u8; 200]);
        }
    }
    let peak = status_kib("VmHWM:") * 1024;
    let loads = vol.extent_page_loads().expect("a paged map");
    eprintln!(
        "resident {} MiB before the reads, peak {} MiB; {loads:?}",
        before / MIB,
        peak / MIB,
    );
    assert!(
        loads.evicted_bytes > 0 && loads.loads > loads.chunks,
        "{loads:?}: the budget evicted nothing, nothing measured"
    );
    // The budget (which counts the pool's warm slots) and what the read
    // path and the evictor hold in flight.
    let allowed = BUDGET + 4 * MIB + 4 * MIB;
    assert!(
        peak <= before + allowed,
        "the reads raised the peak by {} MiB, over {} MiB",
        (peak - before) / MIB,
        allowed / MIB
    );
    assert_eq!(kept.len() as u64, 2 * per_round);
    drop(file);
    vol.unmount().unwrap();
}
