//! Direct I/O at any byte offset, length and buffer address: concurrent
//! read-modify-writers of the same device blocks never lose each other's
//! bytes, nor those of whole-block writers.

mod common;

use std::sync::{Arc, Barrier};
use std::thread;

use common::dev::ScratchImage;

use blockdev::{BlockDevice, MemDevice, SyncDevice, SyncOpenOptions, UringDevice, UringOptions};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

const MIB: u64 = 1 << 20;
const SECTOR: u64 = 512;
/// Device logical block sizes the tests run on: a disk's and zram's.
const SECTOR_SIZES: [u32; 2] = [512, 4096];

fn direct() -> OpenFlags {
    OpenFlags {
        create: true,
        direct: true,
        ..OpenFlags::default()
    }
}

fn volume_on(dev: Arc<dyn BlockDevice>) -> Volume {
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    Volume::open(dev).unwrap()
}

/// A file of `len` written bytes (so every write below is a pure
/// overwrite and runs under the shared lock).
fn written_file(vol: &Volume, path: &str, len: usize) -> iomapfs_fs::File {
    let f = vol.open_file(path, direct()).unwrap();
    f.pwrite(&vec![0xEE; len], 0).unwrap();
    f.fsync().unwrap();
    f
}

/// Eight threads own interleaved 37-byte slices of the same 512-byte
/// sectors and rewrite all of them every round; after each round every
/// slice must hold its owner's value of that round. A read-modify-write that
/// is not exclusive on its sectors writes back a neighbour's old bytes.
#[test]
fn concurrent_byte_writers_in_shared_sectors_lose_nothing() {
    for sector_size in SECTOR_SIZES {
        concurrent_byte_writers(sector_size);
    }
}

fn concurrent_byte_writers(sector_size: u32) {
    const THREADS: usize = 8;
    const SLICE: usize = 37;
    const FILE: usize = 8 * 1024;
    const ROUNDS: u8 = 40;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 * MIB, sector_size));
    let vol = volume_on(dev);
    let file = Arc::new(written_file(&vol, "/shared", FILE));
    let slices: Vec<(usize, usize)> = (0..FILE.div_ceil(SLICE))
        .map(|i| (i * SLICE, ((i + 1) * SLICE).min(FILE)))
        .collect();
    let value = |t: usize, round: u8| (t as u8 + 1) ^ (round << 4);
    let round_done = Arc::new(Barrier::new(THREADS + 1));
    let checked = Arc::new(Barrier::new(THREADS + 1));
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (file, slices) = (file.clone(), slices.clone());
            let (round_done, checked) = (round_done.clone(), checked.clone());
            thread::spawn(move || {
                for round in 0..ROUNDS {
                    for &(start, end) in slices.iter().skip(t).step_by(THREADS) {
                        let data = vec![value(t, round); end - start];
                        file.pwrite(&data, start as u64).unwrap();
                    }
                    round_done.wait();
                    checked.wait();
                }
            })
        })
        .collect();
    let mut content = vec![0u8; FILE];
    for round in 0..ROUNDS {
        round_done.wait();
        assert_eq!(file.pread(&mut content, 0).unwrap(), FILE);
        for (i, &(start, end)) in slices.iter().enumerate() {
            let want = value(i % THREADS, round);
            if let Some(at) = content[start..end].iter().position(|&b| b != want) {
                panic!(
                    "{sector_size}-byte sectors, round {round}: byte {} of thread {}'s slice \
                     holds {:#x}, want {want:#x}",
                    start + at,
                    i % THREADS,
                    content[start + at]
                );
            }
        }
        checked.wait();
    }
    for w in writers {
        w.join().unwrap();
    }
}

/// One thread rewrites a whole sector, two others rewrite ten bytes each
/// inside it, all at once, many rounds. A whole-sector write that lands
/// between a read-modify-writer's read and its write back would be undone:
/// the bytes outside the two small ranges must always hold the whole-sector
/// writer's value of the round.
#[test]
fn whole_sector_and_byte_writers_of_one_sector_lose_nothing() {
    for sector_size in SECTOR_SIZES {
        whole_sector_and_byte_writers(u64::from(sector_size));
    }
}

fn whole_sector_and_byte_writers(sector_size: u64) {
    const ROUNDS: u32 = 3000;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 * MIB, sector_size as u32));
    let vol = volume_on(dev);
    let file = Arc::new(written_file(&vol, "/mixed", 16384));
    let sector = 4096 + sector_size;
    let small = [(10u64, 20u64), (300, 310)];
    let start = Arc::new(Barrier::new(4));
    let done = Arc::new(Barrier::new(4));
    let whole = |round: u32| (round % 200) as u8 + 1;
    let byte = |k: usize, round: u32| 0xF0 + k as u8 + ((round % 2) as u8) * 4;
    let mut writers = Vec::new();
    {
        let (file, start, done) = (file.clone(), start.clone(), done.clone());
        writers.push(thread::spawn(move || {
            for round in 0..ROUNDS {
                start.wait();
                file.pwrite(&vec![whole(round); sector_size as usize], sector)
                    .unwrap();
                done.wait();
            }
        }));
    }
    for (k, &(from, to)) in small.iter().enumerate() {
        let (file, start, done) = (file.clone(), start.clone(), done.clone());
        writers.push(thread::spawn(move || {
            for round in 0..ROUNDS {
                start.wait();
                let data = vec![byte(k, round); (to - from) as usize];
                file.pwrite(&data, sector + from).unwrap();
                done.wait();
            }
        }));
    }
    let mut got = vec![0u8; sector_size as usize];
    for round in 0..ROUNDS {
        start.wait();
        done.wait();
        file.pread(&mut got, sector).unwrap();
        for (i, &b) in got.iter().enumerate() {
            let i = i as u64;
            let owner = small.iter().position(|&(from, to)| (from..to).contains(&i));
            let ok = match owner {
                None => b == whole(round),
                Some(k) => b == whole(round) || b == byte(k, round),
            };
            assert!(
                ok,
                "{sector_size}-byte sectors, round {round}: sector byte {i} holds {b:#x} \
                 (whole-sector value {:#x})",
                whole(round)
            );
        }
    }
    for w in writers {
        w.join().unwrap();
    }
}

/// Unaligned offsets and lengths on a direct handle, first on a fresh
/// file (allocating, exclusive path) and then as overwrites (shared path),
/// read back at other unaligned offsets.
#[test]
fn direct_handles_take_any_offset_and_length() {
    for sector_size in SECTOR_SIZES {
        any_offset_and_length(sector_size);
    }
}

fn any_offset_and_length(sector_size: u32) {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 * MIB, sector_size));
    let vol = volume_on(dev);
    let f = vol.open_file("/any", direct()).unwrap();
    let mut model = Vec::new();
    let writes: [(u64, usize, u8); 6] = [
        (3, 5, 1),
        (1000, 3000, 2),
        (4095, 2, 3),
        (20_000, 1, 4), // extends past a hole
        (511, 513, 5),
        (17, 19_990, 6),
    ];
    for (off, len, v) in writes {
        assert_eq!(f.pwrite(&vec![v; len], off).unwrap(), len);
        let end = off as usize + len;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[off as usize..end].fill(v);
    }
    assert_eq!(f.stat().unwrap().size, model.len() as u64);
    for (off, len) in [(0, model.len()), (1, 7), (4094, 5), (19_999, 100), (511, 1)] {
        let mut buf = vec![0xCC; len];
        let n = f.pread(&mut buf, off).unwrap();
        let want_n = model.len().saturating_sub(off as usize).min(len);
        assert_eq!(n, want_n, "{sector_size}-byte sectors: read {off}+{len}");
        assert!(
            buf[..n] == model[off as usize..off as usize + n],
            "{sector_size}-byte sectors: read {off}+{len}"
        );
    }
}

/// O_DIRECT needs aligned memory: buffers at odd addresses are bounced by
/// the device layer, and reads and writes still land where asked, on the
/// sync backend and on io_uring.
#[test]
fn odd_buffer_addresses_on_an_o_direct_image() {
    let image = ScratchImage::new("byte-granular", 64 * MIB);
    let sync_dev = Arc::new(SyncDevice::open(&image.path, SyncOpenOptions::default()).unwrap());
    let mut devices: Vec<(&str, Arc<dyn BlockDevice>)> = vec![("sync", sync_dev.clone())];
    match UringDevice::from_sync(sync_dev.clone(), UringOptions::default()) {
        Ok(uring) => devices.push(("io_uring", Arc::new(uring))),
        Err(e) => eprintln!("note: io_uring variant skipped: {e}"),
    }
    for (backend, dev) in devices {
        let bounced_before = sync_dev.bounced_requests();
        let vol = volume_on(dev);
        let f = written_file(&vol, "/odd", 16 * 1024);
        let backing: Vec<u8> = (0..9000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Aligned offset and length, odd address; then all three odd.
        f.pwrite(&backing[1..4097], 4096).unwrap();
        f.pwrite(&backing[3..1003], 9001).unwrap();
        let mut storage = vec![0u8; 8200];
        let out = &mut storage[1..4097];
        f.pread(out, 4096).unwrap();
        assert!(out == &backing[1..4097], "{backend}");
        let out = &mut storage[5..1005];
        f.pread(out, 9001).unwrap();
        assert!(out == &backing[3..1003], "{backend}");
        if sync_dev.caps().memory_alignment > 1 {
            assert!(
                sync_dev.bounced_requests() > bounced_before,
                "{backend}: odd buffers were not bounced"
            );
        } else {
            eprintln!(
                "note: {} needs no memory alignment: nothing to bounce",
                image.path.display()
            );
        }
        drop(f);
        vol.unmount().unwrap();
    }
}

/// A failing edge read stops the read-modify-write before anything is
/// written: the caller gets EIO naming the file and offset, and the block
/// keeps its old bytes. A failing write back reports EIO too.
#[test]
fn device_errors_in_a_read_modify_write_reach_the_caller() {
    use blockdev::{FaultOp, FaultRule};
    let mem = Arc::new(MemDevice::new(32 * MIB, SECTOR as u32));
    let vol = volume_on(mem.clone());
    let f = written_file(&vol, "/faulty", 8192);
    for op in [FaultOp::Read, FaultOp::Write] {
        mem.inject(FaultRule::new(op).count(1));
        let err = f.pwrite(&[0x42; 10], 1000).unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{op:?}: {err}");
        let msg = err.to_string();
        assert!(msg.contains("/faulty") && msg.contains("1000"), "{msg}");
        mem.clear_faults();
        let mut back = vec![0u8; 8192];
        f.pread(&mut back, 0).unwrap();
        if op == FaultOp::Read {
            assert!(back.iter().all(|&b| b == 0xEE), "{op:?}: data changed");
        }
    }
    // The volume is still usable.
    f.pwrite(&[0x42; 10], 1000).unwrap();
    let mut back = [0u8; 12];
    f.pread(&mut back, 999).unwrap();
    assert_eq!(
        back,
        [0xEE, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0xEE]
    );
}
