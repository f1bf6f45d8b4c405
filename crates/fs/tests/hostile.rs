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
use iomapfs_fs::{fsck, Error, FormatOptions, NewNode, OpenFlags, SetAttr, Volume, XattrSet};

const SIZE: u64 = 4 * MIB;
/// Bytes read per file from a hostile volume (sizes may be absurd).
const READ_CAP: u64 = 1 << 20;

struct Image {
    bytes: Vec<u8>,
    /// States the image held durably, oldest first; the last is current.
    states: Vec<VolState>,
    /// Every write of the journal-only phase: `(index of the first state
    /// that includes it, path, offset, bytes)`.
    writes: Vec<(usize, &'static str, u64, Vec<u8>)>,
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
fn build_image(opts: &FormatOptions) -> Image {
    let mem = Arc::new(MemDevice::new(SIZE, LBS));
    let dev = dynd(&mem);
    Volume::format(dev.clone(), opts).expect("format");
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
        f.pwrite(&tagged(i, 0, 3000 + 5000 * i as usize), 0)
            .unwrap();
    }
    let g = vol.open_file("/d/g", cf()).unwrap();
    g.pwrite(&tagged(9, 70_000, 10_000), 70_000).unwrap();
    g.fallocate(200_000, 50_000, false).unwrap();
    drop(g);
    if opts.extent_pages {
        // Past the extents a root keeps inline: a file with pages.
        let bs = u64::from(l.block_size);
        let paged = vol.open_file("/paged", cf()).unwrap();
        for k in 0..iomapfs_fs::codec::inline_extents_max(bs) as u64 + 8 {
            paged
                .pwrite(&tagged(30 + k, 2 * k * bs, bs as usize), 2 * k * bs)
                .unwrap();
        }
    }
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
    type Op<'a> = Box<dyn Fn(&Volume) + 'a>;
    /// The write an operation makes: path, offset, bytes.
    type Write = (&'static str, u64, Vec<u8>);
    let j1 = (0, tagged(21, 0, 9000));
    let f4 = (5000, tagged(22, 5000, 20_000));
    let j2 = (4096, tagged(23, 4096, 4096));
    let ops: Vec<(Op<'_>, Option<Write>)> = vec![
        (
            Box::new(|v| {
                let f = v.open_file("/j1", cf()).unwrap();
                f.pwrite(&j1.1, j1.0).unwrap();
            }),
            Some(("/j1", j1.0, j1.1.clone())),
        ),
        (Box::new(|v| v.mkdir("/d/sub").unwrap()), None),
        (Box::new(|v| v.rename("/f3", "/d/sub/f3").unwrap()), None),
        (
            Box::new(|v| {
                let f = v.open_file("/f4", cf()).unwrap();
                f.pwrite(&f4.1, f4.0).unwrap();
                f.truncate(17_000).unwrap();
            }),
            Some(("/f4", f4.0, f4.1.clone())),
        ),
        (Box::new(|v| v.unlink("/d/f1").unwrap()), None),
        (
            Box::new(|v| {
                let f = v.open_file("/j2", cf()).unwrap();
                f.fallocate(0, 40_000, true).unwrap();
                f.pwrite(&j2.1, j2.0).unwrap();
            }),
            Some(("/j2", j2.0, j2.1.clone())),
        ),
    ];
    let mut writes = Vec::new();
    for (op, write) in ops {
        op(&vol);
        vol.sync().unwrap();
        if let Some((path, off, data)) = write {
            writes.push((states.len(), path, off, data));
        }
        states.push(read_volume(&vol, u64::MAX).unwrap());
    }
    drop(vol);
    let bytes = mem.snapshot();
    let mut slot_used = changed_ranges(&formatted, &after_ckpt, &slots[0]);
    slot_used.extend(changed_ranges(&formatted, &after_ckpt, &slots[1]));
    // Images spilled to the data area are checkpoint metadata too.
    let newest = read_checkpoints(&*mem, &sbk).expect("checkpoints");
    let spills = newest.spills;
    slot_used.extend(spills.iter().flatten().map(|&(addr, len)| addr..addr + len));
    // So are extent pages, and the base that lists them.
    let page_bytes =
        |count: u32| iomapfs_fs::codec::page_len(count as usize, u64::from(l.block_size));
    let pages: Vec<Range<u64>> = newest
        .pages
        .iter()
        .flatten()
        .flat_map(|(_, list)| list.iter())
        .map(|p| p.addr..p.addr + page_bytes(p.count))
        .collect();
    assert!(
        !opts.extent_pages || !pages.is_empty(),
        "extent pages, but no base lists any"
    );
    slot_used.extend(pages);
    assert!(
        opts.checkpoint_slot_bytes.is_none() || spills.iter().any(|s| !s.is_empty()),
        "small slots, but no checkpoint spilled"
    );
    let journal_used = changed_ranges(&after_ckpt, &bytes, &journal);
    assert!(
        !slot_used.is_empty(),
        "checkpoints wrote nothing to the slots?"
    );
    assert!(
        !journal_used.is_empty(),
        "synced changes wrote nothing to the journal?"
    );
    Image {
        bytes,
        states,
        writes,
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
        // A damaged version field reads as another version: refused before
        // anything else is read.
        Error::UnsupportedVersion { hint, .. } if !hint.is_empty() => Ok(()),
        _ => Err(format!("not a Corrupt/NotIomapfs error: {e:?} ({msg})")),
    }
}

/// The older state `st` is, if the journal batches after it were lost:
/// the namespace and every size of that state, and each byte either that
/// state's or one written *to the same file at the same offset* by a later
/// operation (a zero, if a later truncate cut the file below it). Pure overwrites go in place with no metadata, so rolling the
/// metadata back cannot take them back (detecting the rollback needs a
/// record of what must exist: issue 14 item 6); bytes of another file
/// never qualify (invariant 1: space freed since the last checkpoint is
/// never reused).
fn rolled_back_to(img: &Image, st: &VolState) -> Option<usize> {
    let newest = img.states.len() - 1;
    (0..newest).rev().find(|&i| {
        let old = &img.states[i];
        old.dirs == st.dirs
            && old.symlinks == st.symlinks
            && old.specials == st.specials
            && old.attrs == st.attrs
            && old.files.len() == st.files.len()
            && old.files.iter().all(|(path, f)| {
                let Some(got) = st.files.get(path) else {
                    return false;
                };
                got.size == f.size
                    && got.data.len() == f.data.len()
                    && got.data.iter().zip(&f.data).enumerate().all(|(x, (g, o))| {
                        g == o
                            || *g == 0
                                && img.states[i + 1..].iter().any(|later| {
                                    later.files.get(path).is_some_and(|v| v.size <= x as u64)
                                })
                            || img.writes.iter().any(|(from, p, off, data)| {
                                *from > i
                                    && p == path
                                    && (x as u64)
                                        .checked_sub(*off)
                                        .and_then(|k| data.get(k as usize))
                                        == Some(g)
                            })
                    })
            })
    })
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
    let which = img
        .states
        .iter()
        .rposition(|s| *s == st)
        .or_else(|| rolled_back_to(img, &st));
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
            let mut r =
                fsck::check(dyn_dev.clone()).map_err(|e| format!("fsck after write: {e}"))?;
            // A damaged primary or backup superblock is the one problem
            // left (mount used the backup, or did not need it): repair
            // rewrites the bad copy from the good one.
            if !r.is_clean() && r.problems.iter().all(|p| p.contains("superblock")) {
                let done = fsck::repair_superblocks(&*dyn_dev)
                    .map_err(|e| format!("fsck --repair after {:?}: {e}", r.problems))?;
                if done.is_empty() {
                    return Err(format!("repair did nothing about {:?}", r.problems));
                }
                r = fsck::check(dyn_dev.clone()).map_err(|e| format!("fsck after repair: {e}"))?;
            }
            if !r.is_clean() {
                return Err(format!("fsck after write + unmount: {:?}", r.problems));
            }
            let vol = Volume::open(dyn_dev.clone()).map_err(|e| format!("remount: {e}"))?;
            let st2 =
                read_volume(&vol, READ_CAP).map_err(|e| format!("read after remount: {e}"))?;
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

/// Cases that failed once: 13233700533005615450 and 2870636268195935472
/// mounted a rolled-back state holding another file's bytes (fixed by
/// keeping freed space busy until a checkpoint); 17873168846150087224 and
/// 7204568260484778094 were reported from long runs (they pass on this
/// code; kept so they stay passing).
const REGRESSION_SEEDS: [u64; 4] = [
    13233700533005615450,
    2870636268195935472,
    17873168846150087224,
    7204568260484778094,
];

#[test]
fn hostile_images() {
    // The whole-image layout; extent pages have their own suite below.
    let opts = FormatOptions {
        extent_pages: false,
        ..FormatOptions::default()
    };
    run_hostile_images("hostile", &opts, 1.0);
}

/// The same, on a volume whose 1 KiB slots make every checkpoint image
/// spill to the data area: damage lands in spill tables and spilled images
/// as well.
#[test]
fn hostile_images_with_spilled_checkpoints() {
    let opts = FormatOptions {
        block_size: 512,
        checkpoint_slot_bytes: Some(1024),
        ..FormatOptions::default()
    };
    run_hostile_images("hostile_spilled", &opts, 0.5);
}

/// The same with extent pages listed in index pages, and
/// slots so small that every checkpoint is a base (a spilled root):
/// damage lands in pages, index pages and roots as well.
#[test]
fn hostile_images_with_extent_pages() {
    let opts = FormatOptions {
        block_size: 512,
        checkpoint_slot_bytes: Some(1024),
        extent_pages: true,
        page_index: true,
        ..FormatOptions::default()
    };
    run_hostile_images("hostile_extent_pages", &opts, 0.5);
}

/// The same with every page listed in the root (no index pages).
#[test]
fn hostile_images_with_extent_pages_listed_in_roots() {
    let opts = FormatOptions {
        block_size: 512,
        checkpoint_slot_bytes: Some(1024),
        extent_pages: true,
        page_index: false,
        ..FormatOptions::default()
    };
    run_hostile_images("hostile_page_roots", &opts, 0.25);
}

fn run_hostile_images(suite: &str, opts: &FormatOptions, share: f64) {
    let t0 = Instant::now();
    let seeds = Seeds::from_env(suite);
    let cases = seeds.count((env_u64("IOMAPFS_HOSTILE_CASES", 800) as f64 * share) as u64);
    let img = build_image(opts);
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
    // Seeds that once failed here (or in a long run), then the run's own.
    let regressions = if seeds.fixed.is_some() {
        &[][..]
    } else {
        &REGRESSION_SEEDS[..]
    };
    let run_seeds = regressions
        .iter()
        .copied()
        .chain((0..cases).map(|i| seeds.case(i)));
    for seed in run_seeds {
        let mut rng = SmallRng::seed_from_u64(seed);
        // From the seed alone, so IOMAPFS_TEST_SEED reruns the same case.
        let kind = kinds[(mix64(seed) % kinds.len() as u64) as usize];
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
    stats.print(suite, t0.elapsed());
    if !failures.is_empty() {
        panic!(
            "{} hostile image(s) mishandled (rerun one with IOMAPFS_TEST_SEED=<seed>):\n  {}",
            failures.len(),
            failures[..failures.len().min(25)].join("\n  ")
        );
    }
}

// ---------------------------------------------------------------------------
// (f) Hostile metadata with valid checksums: checkpoints and journal batches
// written through the library's own encoders, so every CRC verifies and only
// the content is wrong. Checksums cannot save mount here; validation must.

use iomapfs_fs::checkpoint::{
    other_slot, read_checkpoints, read_newest_checkpoint, write_checkpoint, write_delta,
    Checkpoint, DeltaCheckpoint,
};
use iomapfs_fs::journal::JournalWriter;
use iomapfs_fs::types::{
    DirEntryImage, Extent, ExtentState, FileKind, InodeAttrs, InodeDelta, MetaDelta, MetaImage,
    Record, Timestamp, XattrImage, ROOT_INO,
};

/// A delta from `from` to `to` as a writer that trusted `to` would write
/// it: every inode that differs, whole; some regular files' extents cut to
/// one random key span instead (a forged span, which may leave the base's
/// extents outside it overlapping the delta's).
fn hostile_delta(rng: &mut SmallRng, from: &MetaImage, to: &MetaImage) -> MetaDelta {
    let old = |ino| from.inodes.iter().find(|i| i.ino == ino);
    let mut changed = Vec::new();
    for inode in &to.inodes {
        if old(inode.ino) == Some(inode) {
            continue;
        }
        let mut inode = inode.clone();
        let mut spans = vec![(0, u64::MAX)];
        if inode.kind == FileKind::Regular && rng.gen_bool(0.3) {
            let a = rng.gen_range(0..SIZE);
            let b = rng.gen_range(a + 1..=SIZE + 1);
            spans = vec![(a, b)];
            inode.extents.retain(|e| (a..b).contains(&e.file_off));
        }
        changed.push(InodeDelta { spans, inode });
    }
    MetaDelta {
        next_ino: to.next_ino,
        removed: from
            .inodes
            .iter()
            .filter(|i| !to.inodes.iter().any(|t| t.ino == i.ino))
            .map(|i| i.ino)
            .collect(),
        changed,
    }
}

/// A clean (unmounted) volume with a few files and a directory.
fn clean_base() -> (Vec<u8>, VolState) {
    let mem = Arc::new(MemDevice::new(SIZE, LBS));
    let dev = dynd(&mem);
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    vol.mkdir("/d").unwrap();
    for (i, p) in ["/a", "/b", "/d/c"].iter().enumerate() {
        let f = vol.open_file(p, cf()).unwrap();
        f.pwrite(&tagged(i as u64 + 1, 0, 9000 + 7000 * i), 0)
            .unwrap();
    }
    let f = vol.open_file("/b", cf()).unwrap();
    f.fallocate(40_000, 30_000, true).unwrap();
    drop(f);
    // Every kind of inode and attribute the format keeps.
    vol.symlink("d/c", "/s").unwrap();
    vol.link("/a", "/d/a2").unwrap();
    let a = vol.ino_of("/a").unwrap();
    vol.set_xattr(a, "user.k", b"value", XattrSet::Any).unwrap();
    vol.set_attr(
        a,
        &SetAttr {
            mode: Some(0o4750),
            uid: Some(1234),
            ..SetAttr::default()
        },
    )
    .unwrap();
    let node = |kind| NewNode {
        kind,
        mode: 0o600,
        uid: 7,
        gid: 8,
        rdev: if kind == FileKind::CharDevice {
            0x0501
        } else {
            0
        },
    };
    vol.make_node(ROOT_INO, "fifo", node(FileKind::Fifo), &[])
        .unwrap();
    vol.make_node(ROOT_INO, "tty", node(FileKind::CharDevice), &[])
        .unwrap();
    let st = read_volume(&vol, u64::MAX).unwrap();
    vol.unmount().unwrap();
    (mem.snapshot(), st)
}

fn mutate_image(
    rng: &mut SmallRng,
    img: &mut MetaImage,
    data: Range<u64>,
    dev_size: u64,
) -> String {
    let n = img.inodes.len();
    let pick = |rng: &mut SmallRng, img: &MetaImage, kind: FileKind| -> Option<usize> {
        let c: Vec<usize> = (0..img.inodes.len())
            .filter(|&i| img.inodes[i].kind == kind)
            .collect();
        (!c.is_empty()).then(|| c[rng.gen_range(0..c.len())])
    };
    let file = pick(rng, img, FileKind::Regular);
    let dir = pick(rng, img, FileKind::Directory);
    let bs = 4096u64;
    let any_of = |rng: &mut SmallRng, img: &MetaImage, kinds: &[FileKind]| -> Option<usize> {
        let c: Vec<usize> = (0..img.inodes.len())
            .filter(|&i| kinds.contains(&img.inodes[i].kind))
            .collect();
        (!c.is_empty()).then(|| c[rng.gen_range(0..c.len())])
    };
    let case = rng.gen_range(0..32);
    if case >= 22 {
        return mutate_attributes(rng, img, case, &any_of);
    }
    match case {
        0 => {
            // An extent outside the data area (into the journal, superblock,
            // or past the device).
            let Some(f) = file else {
                return "nothing".into();
            };
            let addr = [
                0,
                4096,
                data.start - bs,
                dev_size,
                dev_size - bs,
                u64::MAX - bs + 1,
            ][rng.gen_range(0..6)];
            let e = &mut img.inodes[f].extents;
            if let Some(x) = e.first_mut() {
                x.addr = addr;
            }
            format!(
                "extent of inode #{} moved to device byte {addr}",
                img.inodes[f].ino
            )
        }
        1 => {
            // Two files share space.
            let files: Vec<usize> = (0..n)
                .filter(|&i| {
                    img.inodes[i].kind == FileKind::Regular && !img.inodes[i].extents.is_empty()
                })
                .collect();
            if files.len() < 2 {
                return "nothing".into();
            }
            let src = img.inodes[files[0]].extents[0];
            let dst = &mut img.inodes[files[1]].extents[0];
            dst.addr = src.addr;
            "two files cross-linked".into()
        }
        2 => {
            let Some(f) = file else {
                return "nothing".into();
            };
            let e = &mut img.inodes[f].extents;
            if !e.is_empty() {
                let mut x = e[0];
                x.file_off += bs;
                x.addr += bs * 100;
                e.push(x);
            }
            "overlapping extents in one file".into()
        }
        3 => {
            let Some(f) = file else {
                return "nothing".into();
            };
            if let Some(x) = img.inodes[f].extents.first_mut() {
                match rng.gen_range(0..4) {
                    0 => x.len = 0,
                    1 => x.addr += 1,
                    2 => x.file_off += 100,
                    _ => x.len = u64::MAX - bs + 1,
                }
            }
            "zero-length or unaligned extent".into()
        }
        4 => {
            let Some(f) = file else {
                return "nothing".into();
            };
            let s = [u64::MAX, 1 << 62, 1 << 60, (1 << 60) + 1][rng.gen_range(0..4)];
            img.inodes[f].size = s;
            format!("file size {s}")
        }
        5 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            img.inodes[d].entries.push(DirEntryImage {
                name: "ghost".into(),
                ino: 9999,
            });
            img.inodes[d].entries.sort_by(|a, b| a.name.cmp(&b.name));
            "entry naming a missing inode".into()
        }
        6 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            img.inodes[d].entries.push(DirEntryImage {
                name: "loop".into(),
                ino: ROOT_INO,
            });
            img.inodes[d].entries.sort_by(|a, b| a.name.cmp(&b.name));
            "directory cycle (entry naming the root)".into()
        }
        7 => {
            // Two names for one directory.
            let sub: Vec<u64> = img
                .inodes
                .iter()
                .filter(|i| i.kind == FileKind::Directory && i.ino != ROOT_INO)
                .map(|i| i.ino)
                .collect();
            if let Some(&s) = sub.first() {
                let Some(root) = img.inodes.iter_mut().find(|i| i.ino == ROOT_INO) else {
                    return "nothing".into();
                };
                root.entries.push(DirEntryImage {
                    name: "alias".into(),
                    ino: s,
                });
                root.entries.sort_by(|a, b| a.name.cmp(&b.name));
            }
            "directory with two names".into()
        }
        8 => {
            if n >= 2 {
                let ino = img.inodes[0].ino;
                img.inodes[1].ino = ino;
            }
            "duplicate inode numbers".into()
        }
        9 => {
            img.inodes.retain(|i| i.ino != ROOT_INO);
            "no root directory".into()
        }
        10 => {
            let Some(root) = img.inodes.iter_mut().find(|i| i.ino == ROOT_INO) else {
                return "nothing".into();
            };
            root.kind = FileKind::Regular;
            "root is a regular file".into()
        }
        11 => {
            img.next_ino = rng.gen_range(0..3);
            format!("next_ino {}", img.next_ino)
        }
        12 => {
            let Some(f) = file else {
                return "nothing".into();
            };
            img.inodes[f].entries.push(DirEntryImage {
                name: "x".into(),
                ino: ROOT_INO,
            });
            "regular file with directory entries".into()
        }
        13 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            img.inodes[d].extents.push(Extent {
                file_off: 0,
                len: bs,
                addr: data.start,
                state: ExtentState::Written,
            });
            "directory with an extent".into()
        }
        14 => {
            let i = rng.gen_range(0..n);
            img.inodes[i].nlink = [0, 2, u32::MAX][rng.gen_range(0..3)];
            format!("nlink of #{} = {}", img.inodes[i].ino, img.inodes[i].nlink)
        }
        15 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            let bad = ["", ".", "..", "a/b", "nul\0x"][rng.gen_range(0..5)];
            if let Some(e) = img.inodes[d].entries.first_mut() {
                e.name = bad.into();
            }
            format!("entry name {bad:?}")
        }
        16 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            if let Some(e) = img.inodes[d].entries.first() {
                let dup = e.clone();
                img.inodes[d].entries.push(dup);
            }
            "duplicate directory entry".into()
        }
        17 => {
            let Some(d) = dir else {
                return "nothing".into();
            };
            img.inodes[d].entries.reverse();
            "unsorted directory entries".into()
        }
        18 => {
            img.inodes.reverse();
            "unsorted inodes".into()
        }
        19 => {
            let Some(f) = file else {
                return "nothing".into();
            };
            img.inodes[f].extents.reverse();
            "unsorted extents".into()
        }
        20 => {
            // An extent far past EOF and huge.
            let Some(f) = file else {
                return "nothing".into();
            };
            img.inodes[f].extents.push(Extent {
                file_off: 1 << 59,
                len: data.end - data.start,
                addr: data.start,
                state: ExtentState::Unwritten,
            });
            "extent covering the whole data area".into()
        }
        _ => {
            img.inodes[rng.gen_range(0..n)].ino = [0, u64::MAX][rng.gen_range(0..2)];
            "inode number 0 or u64::MAX".into()
        }
    }
}

/// Picks an inode of one of the given kinds, if the image has one.
type InodePicker = dyn Fn(&mut SmallRng, &MetaImage, &[FileKind]) -> Option<usize>;

/// Damage to what format version 2 added: attributes, symlinks, special
/// files, hard links, xattrs. Some the encoder refuses (the checkpoint is
/// then not written, and the case counts as refused); the decoder's side of
/// those is in the codec's unit tests.
fn mutate_attributes(
    rng: &mut SmallRng,
    img: &mut MetaImage,
    case: u32,
    any_of: &InodePicker,
) -> String {
    let all = [
        FileKind::Regular,
        FileKind::Directory,
        FileKind::Symlink,
        FileKind::Fifo,
        FileKind::CharDevice,
    ];
    let Some(i) = any_of(rng, img, &all) else {
        return "nothing".into();
    };
    let ino = img.inodes[i].ino;
    match case {
        22 => {
            img.inodes[i].attrs.mode = rng.gen_range(0..0o10000);
            img.inodes[i].attrs.uid = rng.gen();
            img.inodes[i].attrs.gid = rng.gen();
            img.inodes[i].attrs.mtime = Timestamp {
                sec: rng.gen(),
                nsec: rng.gen_range(0..1_000_000_000),
            };
            format!("valid but random mode, owner and mtime of #{ino}")
        }
        23 => {
            let Some(s) = any_of(rng, img, &[FileKind::Symlink]) else {
                return "nothing".into();
            };
            let t = [
                b"".to_vec(),
                vec![b'x'; 4096],
                b"a\0b".to_vec(),
                b"/../../etc/passwd".to_vec(),
            ][rng.gen_range(0..4)]
            .clone();
            let d = format!("symlink #{} target of {} bytes", img.inodes[s].ino, t.len());
            img.inodes[s].target = t;
            d
        }
        24 => {
            img.inodes[i].target = b"x".to_vec();
            format!("{:?} #{ino} given a symlink target", img.inodes[i].kind)
        }
        25 => {
            img.inodes[i].attrs.rdev = 0x1234;
            format!("{:?} #{ino} given a device number", img.inodes[i].kind)
        }
        26 => {
            img.inodes[i].attrs.mode |= [0o10000, 0o170000, u32::MAX][rng.gen_range(0..3)];
            format!("mode of #{ino} with type bits")
        }
        27 => {
            img.inodes[i].attrs.flags = 1;
            format!("unknown inode flags on #{ino}")
        }
        28 => {
            img.inodes[i].attrs.atime.nsec = 1_000_000_000;
            format!("atime nanoseconds out of range on #{ino}")
        }
        29 => {
            let name = ["user.", "trusted.x", "security.selinux", "user.\0"][rng.gen_range(0..4)];
            img.inodes[i].xattrs.push(XattrImage {
                name: name.to_string(),
                value: vec![1, 2, 3],
            });
            format!("xattr named {name:?} on #{ino}")
        }
        30 => {
            // A hard link's count off by one: a second name without the
            // count, or the count without the name.
            let Some(f) = any_of(rng, img, &[FileKind::Regular, FileKind::Fifo]) else {
                return "nothing".into();
            };
            let fino = img.inodes[f].ino;
            if rng.gen_bool(0.5) {
                img.inodes[f].nlink += 1;
                format!("#{fino} counts a link it does not have")
            } else {
                let Some(root) = img.inodes.iter_mut().find(|i| i.ino == ROOT_INO) else {
                    return "nothing".into();
                };
                root.entries.push(DirEntryImage {
                    name: "zz-extra-link".into(),
                    ino: fino,
                });
                format!("#{fino} has a name its link count misses")
            }
        }
        _ => {
            let Some(x) = img.inodes[i].xattrs.first_mut() else {
                img.inodes[i].xattrs.push(XattrImage {
                    name: "user.new".into(),
                    value: vec![0; rng.gen_range(0..70_000)],
                });
                return format!("xattr of up to 70000 bytes added to #{ino}");
            };
            x.value = vec![0xEE; [0, 1, 65_536, 65_537][rng.gen_range(0..4)]];
            format!("xattr value of {} bytes on #{ino}", x.value.len())
        }
    }
}

fn hostile_record(rng: &mut SmallRng, data: &Range<u64>) -> Record {
    let ino = [0, 1, 2, 3, 4, 5, 9999, u64::MAX][rng.gen_range(0..8)];
    let name = ["a", "b", "d", "new", "", "..", "x/y", "c"][rng.gen_range(0..8)].to_string();
    let off = [0, 4096, 100, 1 << 59, u64::MAX - 4095, 8192][rng.gen_range(0..6)];
    let len = [4096, 0, 1, 1 << 40, u64::MAX, 12288][rng.gen_range(0..6)];
    let addr = [
        data.start,
        data.start + 4096,
        0,
        4096,
        data.end,
        u64::MAX - 4095,
        data.start + 1,
    ][rng.gen_range(0..7)];
    let time = [
        Timestamp::default(),
        Timestamp { sec: -1, nsec: 5 },
        Timestamp {
            sec: i64::MAX,
            nsec: 999_999_999,
        },
    ][rng.gen_range(0..3)];
    let kinds = [
        FileKind::Regular,
        FileKind::Directory,
        FileKind::Symlink,
        FileKind::Fifo,
        FileKind::CharDevice,
    ];
    let xname = ["user.a", "user.b", "user.zz"][rng.gen_range(0..3)].to_string();
    match rng.gen_range(0..13) {
        0 => {
            let kind = kinds[rng.gen_range(0..kinds.len())];
            let mut attrs = InodeAttrs::new(rng.gen_range(0..0o10000), rng.gen(), rng.gen(), time);
            if kind == FileKind::CharDevice {
                attrs.rdev = rng.gen();
            }
            Record::Create {
                ino,
                parent: [1, 2, 3, 9999][rng.gen_range(0..4)],
                name,
                kind,
                attrs,
                target: if kind == FileKind::Symlink {
                    b"/a/../b".to_vec()
                } else {
                    vec![]
                },
            }
        }
        1 => Record::Unlink {
            parent: [1, 2, 3, 9999][rng.gen_range(0..4)],
            name,
            time,
        },
        2 => Record::Rename {
            src_parent: [1, 2, 3][rng.gen_range(0..3)],
            src_name: name,
            dst_parent: [1, 2, 3, 9999][rng.gen_range(0..4)],
            dst_name: ["z", "a", "", "d"][rng.gen_range(0..4)].to_string(),
            exchange: rng.gen_bool(0.3),
            time,
        },
        3 => Record::FreeInode { ino },
        4 => Record::MapUnwritten {
            ino,
            file_off: off,
            len,
            addr,
        },
        5 => Record::CompleteWrite {
            ino,
            file_off: off,
            len,
            min_size: [0, 5000, u64::MAX, 1 << 61][rng.gen_range(0..4)],
            mtime_ns: 2,
        },
        6 => Record::SetSize {
            ino,
            size: [0, 1, u64::MAX, 1 << 61, 123_456][rng.gen_range(0..5)],
            mtime_ns: 3,
        },
        7 => Record::Link {
            ino,
            parent: [1, 2, 3, 9999][rng.gen_range(0..4)],
            name,
            time,
        },
        8 => Record::SetAttr {
            ino,
            mode: [0, 0o7777, 0o4755, 0o10000, u32::MAX][rng.gen_range(0..5)],
            uid: rng.gen(),
            gid: rng.gen(),
            atime: time,
            mtime: time,
            ctime: time,
        },
        9 => Record::SetXattr {
            ino,
            name: xname,
            value: vec![7; [0, 1, 4000, 65_536][rng.gen_range(0..4)]],
            ctime: time,
        },
        10 => Record::RemoveXattr {
            ino,
            name: xname,
            ctime: time,
        },
        _ => Record::Punch {
            ino,
            file_off: off,
            len,
            mtime_ns: 4,
        },
    }
}

/// Mounts a volume built from hostile-but-checksummed metadata: a clear
/// error, or a volume that fsck accepts and that keeps files apart.
fn run_semantic(bytes: Vec<u8>) -> Result<&'static str, String> {
    let dev = Arc::new(MemDevice::from_bytes(bytes, LBS, true, false));
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    let report = fsck::check(dyn_dev.clone());
    let fsck_clean = matches!(&report, Ok(r) if r.is_clean());
    let vol = match Volume::open(dyn_dev.clone()) {
        Err(e) => {
            error_is_clear(&e).map_err(|m| format!("mount error: {m}"))?;
            return Ok("refused");
        }
        Ok(v) => v,
    };
    let st = match read_volume(&vol, READ_CAP) {
        Ok(st) => st,
        Err(e) if !fsck_clean => {
            let _ = e;
            return Ok("mounted_fsck_dirty_unreadable");
        }
        Err(e) => return Err(format!("fsck clean, mounted, but reads fail: {e}")),
    };
    // Write a distinct pattern to every file, then check each file holds
    // only its own pattern: cross-linked or misplaced extents show here.
    let mut expect = Vec::new();
    let mut inos = std::collections::HashSet::new();
    for (i, (p, fd)) in st.files.iter().enumerate() {
        // Hard links name one file: write it through one of its names.
        match vol.stat(p) {
            Ok(s) if inos.insert(s.ino) => {}
            _ => continue,
        }
        let f = match vol.open_file(p, OpenFlags::default()) {
            Ok(f) => f,
            Err(_) => continue,
        };
        let n = fd.size.clamp(1, 20_000) as usize;
        let data = tagged(1000 + i as u64, 0, n);
        if f.pwrite(&data, 0).is_ok() {
            expect.push((p.clone(), data));
        }
    }
    for (p, data) in &expect {
        match vol.open_file(p, ro()) {
            Ok(f) => {
                let mut buf = vec![0u8; data.len()];
                if let Ok(n) = f.pread(&mut buf, 0) {
                    if n == data.len() && &buf != data {
                        return Err(format!(
                            "{p}: holds another file's bytes after writing each file (cross-linked extents accepted; fsck clean: {fsck_clean})"
                        ));
                    }
                }
            }
            Err(e) => return Err(format!("{p}: cannot reopen: {e}")),
        }
    }
    let _ = vol.unmount();
    // Whatever was mounted must still mount (no self-inflicted damage).
    let r2 = fsck::check(dyn_dev.clone());
    if fsck_clean && !matches!(&r2, Ok(r) if r.is_clean()) {
        return Err(format!(
            "fsck was clean before mounting and writing, not after: {:?}",
            r2.map(|r| r.problems)
        ));
    }
    Ok(if fsck_clean {
        "mounted_fsck_clean"
    } else {
        "mounted_fsck_dirty"
    })
}

fn ro() -> OpenFlags {
    common::volstate::ro()
}

#[test]
fn hostile_metadata_with_valid_checksums() {
    let t0 = Instant::now();
    let seeds = Seeds::from_env("hostile");
    let cases = seeds.count(env_u64("IOMAPFS_HOSTILE_CASES", 800) / 2);
    let (base, _st) = clean_base();
    let stats = Stats::default();
    let mut failures = Vec::new();
    // Seeds that once failed here (or in a long run), then the run's own.
    let regressions = if seeds.fixed.is_some() {
        &[][..]
    } else {
        &REGRESSION_SEEDS[..]
    };
    let run_seeds = regressions
        .iter()
        .copied()
        .chain((0..cases).map(|i| seeds.case(i)));
    for seed in run_seeds {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mem = MemDevice::from_bytes(base.clone(), LBS, true, false);
        let sb = read_superblock(&mem).unwrap();
        let data = sb.layout.data.start..sb.layout.data.end();
        let (slot, ckpt) = read_newest_checkpoint(&mem, &sb).unwrap();
        let journal_case = rng.gen_bool(0.4);
        let delta_case = !journal_case && rng.gen_bool(0.5);
        let desc = if journal_case {
            let n = rng.gen_range(1..=4);
            let recs: Vec<Record> = (0..n).map(|_| hostile_record(&mut rng, &data)).collect();
            let mut w = JournalWriter::new(
                &sb,
                ckpt.journal_start,
                ckpt.journal_seq,
                ckpt.journal_chain,
            );
            match w.append(&mem, &recs) {
                Ok(_) => {}
                Err(e) => {
                    stats.add("journal_append_refused", 1);
                    let _ = e;
                    continue;
                }
            }
            mem.flush().unwrap();
            format!("journal records {recs:?}")
        } else {
            let mut image = ckpt.image.clone();
            let k = rng.gen_range(1..=2);
            let mut d = Vec::new();
            for _ in 0..k {
                d.push(mutate_image(&mut rng, &mut image, data.clone(), SIZE));
            }
            let written = if delta_case {
                // The same damage, as a delta after the chain.
                let chain = read_checkpoints(&mem, &sb).unwrap().chain;
                let delta = DeltaCheckpoint {
                    generation: ckpt.generation + 1,
                    journal_start: ckpt.journal_start,
                    journal_seq: ckpt.journal_seq,
                    journal_chain: ckpt.journal_chain,
                    delta: hostile_delta(&mut rng, &ckpt.image, &image),
                };
                write_delta(&mem, &sb, slot, &chain, &delta, &[]).map(drop)
            } else {
                let c = Checkpoint {
                    generation: ckpt.generation + 1,
                    image,
                    ..ckpt.clone()
                };
                write_checkpoint(&mem, &sb, other_slot(slot), &c)
            };
            if let Err(e) = written {
                stats.add("checkpoint_write_refused", 1);
                let _ = e;
                continue;
            }
            format!("checkpoint: {}", d.join("; "))
        };
        let bytes = mem.snapshot();
        let r = run_case("hostile", seed, "semantic", || {
            catch_unwind(AssertUnwindSafe(|| run_semantic(bytes)))
        });
        let outcome = match r {
            Err(p) => Err(format!(
                "PANIC: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
            Ok(r) => r,
        };
        let kind = if journal_case {
            "journal"
        } else if delta_case {
            "delta"
        } else {
            "checkpoint"
        };
        match outcome {
            Ok(o) => {
                stats.add(&format!("{kind}_{o}"), 1);
                if o == "mounted_fsck_dirty" || o == "mounted_fsck_dirty_unreadable" {
                    eprintln!(
                        "hostile: note: seed={seed} {desc}: mounted although fsck reports problems"
                    );
                }
            }
            Err(e) => {
                stats.add("FAILURES", 1);
                failures.push(format!("seed={seed} {desc}: {e}"));
            }
        }
    }
    stats.print("hostile_metadata_with_valid_checksums", t0.elapsed());
    if !failures.is_empty() {
        panic!(
            "{} hostile metadata case(s) mishandled:\n  {}",
            failures.len(),
            failures[..failures.len().min(25)].join("\n  ")
        );
    }
}
