//! Corrupt and hostile images (invariant 6): mount, fsck and reads must never
//! panic or hang; they give a clear error (`Corrupt` / `NotIomapfs`, naming
//! what and where) or a volume that works.
//!
//! Images: a volume with files, directories, two checkpoints and a journal
//! holding synced but un-checkpointed changes. Cases:
//! (a) truncated images (a prefix of the device);
//! (b) byte flips in the superblock block;
//! (c) flips and sector damage in the checkpoint slots;
//! (d) flips and sector damage in the journal region;
//! (e) all-zero, all-random, marker-filled devices, and random devices with a
//!     valid superblock;
//! (f) random damage anywhere in the metadata regions.
//!
//! A volume that does mount must be a state the image really held (the
//! newest, or — counted and printed as a rollback — an older durable one);
//! a mounted state that is none of them is only accepted when fsck reports
//! problems with it. When the newest state mounts exactly, a write + unmount
//! + mount must work.
//!
//! Env: `IOMAPFS_HOSTILE_CASES` (default 800), `IOMAPFS_TEST_SEED`,
//! `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use blockdev::memory::MemDevice;
use blockdev::BlockDevice;
use common::dev::{dynd, LBS, MIB};
use common::history::tagged;
use common::volstate::{read_volume, VolState};
use common::{env_u64, mix64, run_case, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomapfs_fs::superblock::{read_superblock, SUPERBLOCK_ENCODED_LEN};
use iomapfs_fs::{fsck, Error, FormatOptions, OpenFlags, Volume};

const SIZE: u64 = 4 * MIB;
/// Bytes read per file from a hostile volume (sizes may be absurd).
const READ_CAP: u64 = 1 << 20;

struct Image {
    bytes: Vec<u8>,
    /// States the image held durably, oldest first; the last is current.
    states: Vec<VolState>,
    sb: Range<u64>,
    slots: [Range<u64>; 2],
    journal: Range<u64>,
    /// Parts of the slots and journal that differ from the freshly formatted
    /// image: where the metadata of interest lives.
    slot_used: Vec<Range<u64>>,
    journal_used: Vec<Range<u64>>,
}

fn cf() -> OpenFlags {
    OpenFlags {
        create: true,
        ..OpenFlags::default()
    }
}

fn changed_ranges(a: &[u8], b: &[u8], within: &Range<u64>) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    let lbs = LBS as u64;
    let mut s = within.start;
    while s < within.end {
        let e = (s + lbs).min(within.end);
        if a[s as usize..e as usize] != b[s as usize..e as usize] {
            match out.last_mut() {
                Some(r) if r.end == s => r.end = e,
                _ => out.push(s..e),
            }
        }
        s = e;
    }
    out
}

/// Builds the image: two checkpoints, then synced journal-only changes, then
/// a crash (drop without unmount).
fn build_image() -> Image {
    let mem = Arc::new(MemDevice::new(SIZE, LBS));
    let dev = dynd(&mem);
    Volume::format(dev.clone(), &FormatOptions::default()).expect("format");
    let formatted = mem.snapshot();
    let sbk = read_superblock(&*dev).expect("superblock");
    let l = &sbk.layout;
    let slots = [
        l.checkpoint_slots[0].start..l.checkpoint_slots[0].end(),
        l.checkpoint_slots[1].start..l.checkpoint_slots[1].end(),
    ];
    let journal = l.journal.start..l.journal.end();
    let mut states = Vec::new();

    let vol = Volume::open(dev.clone()).unwrap();
    states.push(read_volume(&vol, u64::MAX).unwrap());
    vol.mkdir("/d").unwrap();
    for i in 0..5u64 {
        let f = vol.open_file(&format!("/f{i}"), cf()).unwrap();
        f.pwrite(&tagged(i, 0, 3000 + 5000 * i as usize), 0).unwrap();
    }
    let g = vol.open_file("/d/g", cf()).unwrap();
    g.pwrite(&tagged(9, 70_000, 10_000), 70_000).unwrap();
    g.fallocate(200_000, 50_000, false).unwrap();
    drop(g);
    vol.checkpoint().unwrap();
    states.push(read_volume(&vol, u64::MAX).unwrap());
    vol.unlink("/f0").unwrap();
    vol.rename("/f1", "/d/f1").unwrap();
    let f = vol.open_file("/f2", cf()).unwrap();
    f.truncate(1234).unwrap();
    f.punch_hole(100, 700).unwrap();
    drop(f);
    vol.unmount().unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    states.push(read_volume(&vol, u64::MAX).unwrap());
    let after_ckpt = mem.snapshot();
    // Journal-only changes, each synced.
    let ops: Vec<Box<dyn Fn(&Volume)>> = vec![
        Box::new(|v| {
            let f = v.open_file("/j1", cf()).unwrap();
            f.pwrite(&tagged(21, 0, 9000), 0).unwrap();
        }),
        Box::new(|v| v.mkdir("/d/sub").unwrap()),
        Box::new(|v| v.rename("/f3", "/d/sub/f3").unwrap()),
        Box::new(|v| {
            let f = v.open_file("/f4", cf()).unwrap();
            f.pwrite(&tagged(22, 5000, 20_000), 5000).unwrap();
            f.truncate(17_000).unwrap();
        }),
        Box::new(|v| v.unlink("/d/f1").unwrap()),
        Box::new(|v| {
            let f = v.open_file("/j2", cf()).unwrap();
            f.fallocate(0, 40_000, true).unwrap();
            f.pwrite(&tagged(23, 4096, 4096), 4096).unwrap();
        }),
    ];
    for op in ops {
        op(&vol);
        vol.sync().unwrap();
        states.push(read_volume(&vol, u64::MAX).unwrap());
    }
    drop(vol);
    let bytes = mem.snapshot();
    let mut slot_used = changed_ranges(&formatted, &after_ckpt, &slots[0]);
    slot_used.extend(changed_ranges(&formatted, &after_ckpt, &slots[1]));
    let journal_used = changed_ranges(&after_ckpt, &bytes, &journal);
    assert!(!slot_used.is_empty(), "checkpoints wrote nothing to the slots?");
    assert!(!journal_used.is_empty(), "synced changes wrote nothing to the journal?");
    Image {
        bytes,
        states,
        sb: 0..u64::from(l.block_size),
        slots,
        journal,
        slot_used,
        journal_used,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Truncated,
    Superblock,
    Slots,
    Journal,
    Whole,
    Anywhere,
}

fn pick_range(rng: &mut SmallRng, rs: &[Range<u64>]) -> Range<u64> {
    rs[rng.gen_range(0..rs.len())].clone()
}

/// Damages `b` inside `r`: bit flips, random bytes, a zeroed or randomized
/// logical block, or a block copied from elsewhere in the region.
fn damage(rng: &mut SmallRng, b: &mut [u8], r: Range<u64>) -> String {
    let lbs = LBS as u64;
    let len = r.end - r.start;
    match rng.gen_range(0..6) {
        0 | 1 => {
            let n = rng.gen_range(1..=4);
            let mut at = Vec::new();
            for _ in 0..n {
                let o = r.start + rng.gen_range(0..len);
                b[o as usize] ^= 1 << rng.gen_range(0..8);
                at.push(o);
            }
            format!("bit flips at {at:?}")
        }
        2 => {
            let o = r.start + rng.gen_range(0..len);
            let v = rng.gen();
            b[o as usize] = v;
            format!("byte {o} = {v:#04x}")
        }
        3 => {
            let o = r.start + rng.gen_range(0..len.div_ceil(lbs)) * lbs;
            let e = (o + lbs).min(r.end);
            b[o as usize..e as usize].fill(0);
            format!("zeroed block {o}")
        }
        4 => {
            let o = r.start + rng.gen_range(0..len.div_ceil(lbs)) * lbs;
            let e = (o + lbs).min(r.end);
            rng.fill(&mut b[o as usize..e as usize]);
            format!("random block {o}")
        }
        _ => {
            let o = r.start + rng.gen_range(0..len.div_ceil(lbs)) * lbs;
            let src = r.start + rng.gen_range(0..len.div_ceil(lbs)) * lbs;
            let n = lbs.min(r.end - o).min(r.end - src) as usize;
            let tmp = b[src as usize..src as usize + n].to_vec();
            b[o as usize..o as usize + n].copy_from_slice(&tmp);
            format!("block {src} copied over {o}")
        }
    }
}

fn make_case(img: &Image, kind: Kind, rng: &mut SmallRng) -> (Vec<u8>, String) {
    let mut b = img.bytes.clone();
    let desc = match kind {
        Kind::Truncated => {
            let sb_len = SUPERBLOCK_ENCODED_LEN as u64;
            let len = match rng.gen_range(0..6) {
                0 => 0,
                1 => (sb_len / LBS as u64) * LBS as u64,
                2 => img.journal.end - LBS as u64,
                3 => SIZE - LBS as u64,
                4 => img.slots[1].start + LBS as u64,
                _ => rng.gen_range(0..SIZE / LBS as u64) * LBS as u64,
            };
            b.truncate(len as usize);
            format!("truncated to {len} bytes")
        }
        Kind::Superblock => {
            let r = if rng.gen_bool(0.8) {
                0..SUPERBLOCK_ENCODED_LEN as u64
            } else {
                img.sb.clone()
            };
            format!("superblock: {}", damage(rng, &mut b, r))
        }
        Kind::Slots => {
            let r = if rng.gen_bool(0.85) {
                pick_range(rng, &img.slot_used)
            } else {
                img.slots[rng.gen_range(0..2)].clone()
            };
            let mut d = format!("slot: {}", damage(rng, &mut b, r));
            if rng.gen_bool(0.15) {
                let r = pick_range(rng, &img.slot_used);
                d += &format!("; and {}", damage(rng, &mut b, r));
            }
            d
        }
        Kind::Journal => {
            let r = if rng.gen_bool(0.85) {
                pick_range(rng, &img.journal_used)
            } else {
                img.journal.clone()
            };
            format!("journal: {}", damage(rng, &mut b, r))
        }
        Kind::Whole => match rng.gen_range(0..4) {
            0 => {
                b.fill(0);
                "all zeros".into()
            }
            1 => {
                rng.fill(&mut b[..]);
                "all random".into()
            }
            2 => {
                for (i, x) in b.iter_mut().enumerate() {
                    *x = common::history::MARKER[i % 8];
                }
                "marker-filled".into()
            }
            _ => {
                let keep = img.sb.end as usize;
                rng.fill(&mut b[keep..]);
                "valid superblock, random elsewhere".into()
            }
        },
        Kind::Anywhere => {
            let n = rng.gen_range(1..=6);
            let mut ds = Vec::new();
            for _ in 0..n {
                let r = match rng.gen_range(0..3) {
                    0 => img.sb.clone(),
                    1 => pick_range(rng, &img.slot_used),
                    _ => pick_range(rng, &img.journal_used),
                };
                ds.push(damage(rng, &mut b, r));
            }
            format!("multiple: {}", ds.join("; "))
        }
    };
    (b, desc)
}

fn error_is_clear(e: &Error) -> Result<(), String> {
    let msg = e.to_string();
    match e.root() {
        Error::Corrupt { what, reason, .. } => {
            if what.is_empty() || reason.is_empty() {
                return Err(format!("Corrupt error without what/reason: {e:?}"));
            }
            if !msg.contains("device byte") {
                return Err(format!("Corrupt error does not say where: {msg}"));
            }
            Ok(())
        }
        Error::NotIomapfs { reason } if !reason.is_empty() => Ok(()),
        _ => Err(format!("not a Corrupt/NotIomapfs error: {e:?} ({msg})")),
    }
}

/// What happened to one image.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Refused,
    Newest,
    Rollback(usize),
    UnknownStateFsckDirty,
}

fn run_one(img: &Image, bytes: Vec<u8>, desc: &str) -> Result<Outcome, String> {
    let nbytes = bytes.len();
    let dev = match MemDevice::try_from_bytes(bytes, LBS, true, false) {
        Ok(d) => Arc::new(d),
        // Too small to be a device at all (say, 0 bytes): nothing to mount.
        Err(_) if nbytes < LBS as usize => return Ok(Outcome::Refused),
        Err(e) => return Err(format!("MemDevice refused {nbytes} bytes: {e}")),
    };
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    // fsck first: it must not modify the device, nor panic.
    let before = dev.snapshot();
    let report = fsck::check(dyn_dev.clone());
    if dev.snapshot() != before {
        return Err("fsck modified the device".into());
    }
    let fsck_clean = match &report {
        Ok(r) => r.is_clean(),
        Err(e) => {
            if e.to_string().is_empty() {
                return Err("fsck error with an empty message".into());
            }
            false
        }
    };
    let vol = match Volume::open(dyn_dev.clone()) {
        Err(e) => {
            error_is_clear(&e).map_err(|m| format!("mount error: {m}"))?;
            if fsck_clean {
                return Err(format!(
                    "fsck says clean ({:?}) but mount fails: {e}",
                    report.as_ref().ok()
                ));
            }
            return Ok(Outcome::Refused);
        }
        Ok(v) => v,
    };
    let st = match read_volume(&vol, READ_CAP) {
        Ok(st) => st,
        Err(e) => {
            // Reads on a mounted hostile volume may fail, not panic.
            let _ = desc;
            if fsck_clean {
                return Err(format!("fsck clean and mount OK, but reading fails: {e}"));
            }
            return Ok(Outcome::UnknownStateFsckDirty);
        }
    };
    let newest = img.states.len() - 1;
    let which = img.states.iter().rposition(|s| *s == st);
    match which {
        Some(i) if i == newest => {
            // A healthy volume: it must also take writes.
            let f = vol
                .open_file("/after", cf())
                .map_err(|e| format!("create on a mounted image: {e}"))?;
            let data = tagged(77, 0, 10_000);
            f.pwrite(&data, 0).map_err(|e| format!("write: {e}"))?;
            f.fsync().map_err(|e| format!("fsync: {e}"))?;
            drop(f);
            vol.unmount().map_err(|e| format!("unmount: {e}"))?;
            let r = fsck::check(dyn_dev.clone()).map_err(|e| format!("fsck after write: {e}"))?;
            if !r.is_clean() {
                return Err(format!("fsck after write + unmount: {:?}", r.problems));
            }
            let vol = Volume::open(dyn_dev.clone()).map_err(|e| format!("remount: {e}"))?;
            let st2 = read_volume(&vol, READ_CAP).map_err(|e| format!("read after remount: {e}"))?;
            if st2.files.get("/after").map(|f| &f.data) != Some(&data) {
                return Err("file written after mounting the image is wrong".into());
            }
            Ok(Outcome::Newest)
        }
        Some(i) => {
            if !fsck_clean {
                // Mounted an old state that fsck calls broken: still a state
                // that existed; fine either way.
            }
            // Writes may fail on an odd volume; they must not panic.
            if let Ok(f) = vol.open_file("/after", cf()) {
                let _ = f.pwrite(&[1u8; 5000], 0);
                let _ = f.fsync();
            }
            let _ = vol.unmount();
            Ok(Outcome::Rollback(i))
        }
        None => {
            if fsck_clean {
                return Err(format!(
                    "mounted a state the image never held, and fsck calls it clean: dirs {:?} files {:?}",
                    st.dirs,
                    st.files.iter().map(|(p, f)| (p.clone(), f.size)).collect::<Vec<_>>()
                ));
            }
            if let Ok(f) = vol.open_file("/after", cf()) {
                let _ = f.pwrite(&[1u8; 5000], 0);
                let _ = f.fsync();
            }
            let _ = vol.unmount();
            Ok(Outcome::UnknownStateFsckDirty)
        }
    }
}

#[test]
fn hostile_images() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("hostile");
    let cases = seeds.count(env_u64("IOMAPFS_HOSTILE_CASES", 800));
    let img = build_image();
    // The untouched image mounts to its newest state.
    assert_eq!(
        run_one(&img, img.bytes.clone(), "untouched"),
        Ok(Outcome::Newest),
        "the undamaged image"
    );
    let stats = Stats::default();
    let mut failures = Vec::new();
    let kinds = [
        Kind::Truncated,
        Kind::Superblock,
        Kind::Slots,
        Kind::Journal,
        Kind::Whole,
        Kind::Anywhere,
    ];
    for i in 0..cases {
        let seed = seeds.case(i);
        let mut rng = SmallRng::seed_from_u64(seed);
        let kind = if seeds.fixed.is_some() {
            kinds[(mix64(seed) % kinds.len() as u64) as usize]
        } else {
            kinds[i as usize % kinds.len()]
        };
        let (bytes, desc) = make_case(&img, kind, &mut rng);
        let r = run_case("hostile", seed, &format!("{kind:?}"), || {
            catch_unwind(AssertUnwindSafe(|| run_one(&img, bytes, &desc)))
        });
        let outcome = match r {
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Err(format!("PANIC: {msg}"))
            }
            Ok(r) => r,
        };
        match outcome {
            Ok(o) => {
                let name = match o {
                    Outcome::Refused => "refused",
                    Outcome::Newest => "mounted_newest",
                    Outcome::Rollback(_) => "mounted_OLDER_state",
                    Outcome::UnknownStateFsckDirty => "mounted_garbage_fsck_dirty",
                };
                stats.add(&format!("{kind:?}_{name}"), 1);
                if let Outcome::Rollback(s) = o {
                    eprintln!(
                        "hostile: note: seed={seed} {kind:?} ({desc}) mounted older state #{s} of {} (silent rollback)",
                        img.states.len() - 1
                    );
                }
            }
            Err(e) => {
                stats.add("FAILURES", 1);
                failures.push(format!("seed={seed} {kind:?} ({desc}): {e}"));
            }
        }
        stats.add("cases", 1);
        // A refused-mount case is cheap; keep the device count honest.
        let _ = SIZE;
    }
    stats.print("hostile", t0.elapsed());
    if !failures.is_empty() {
        panic!(
            "{} hostile image(s) mishandled (rerun one with IOMAPFS_TEST_SEED=<seed>):\n  {}",
            failures.len(),
            failures[..failures.len().min(25)].join("\n  ")
        );
    }
}
