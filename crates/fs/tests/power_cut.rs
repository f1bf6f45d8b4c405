//! Power cuts at any device request of random workloads.
//!
//! Each workload runs on a small memory device pre-filled with a marker
//! ("STALE!!!"), through a tap that, before a random subset of the writes and
//! flushes the file system issues, cuts power on a copy of the device (the
//! workload goes on undisturbed). So one workload yields dozens of crash
//! states, at every kind of moment: mid-write, mid-commit, mid-checkpoint,
//! mid-recovery, mid-unlink of an open file.
//!
//! Every crash state must mount, pass fsck, and be a state the workload could
//! legally have left (see `common/history.rs`): no stale or foreign bytes,
//! nothing lost that a returned fsync/fdatasync/sync/DSYNC write made
//! durable, metadata operations atomic and in order, sizes covering only
//! written data. Some recovered volumes are then written to, unmounted and
//! checked again.
//!
//! Env: `IOMAPFS_POWER_CUTS` (default 100,000 per run, split over the two
//! tests), `IOMAPFS_TEST_SEED` (one workload), `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use blockdev::memory::MemDevice;
use blockdev::BlockDevice;
use common::dev::{cut, fsck_clean, try_fsck_clean, CutPolicy, Geometry, TapDevice, Tapped, MIB};
use common::history::{tagged, Window};
use common::volstate::read_volume;
use common::workload::{Workload, WorkloadCfg};
use common::{env_u64, run_case, watchdog, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomapfs_fs::{OpenFlags, Volume};

struct CutState {
    dev: MemDevice,
    window: Window,
    policy: CutPolicy,
    /// Index of the request the cut came before, and what it was.
    request: u64,
    what: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mix {
    /// `power_cut_seeded` only.
    Seeded,
    /// Keep-nothing, keep-everything, torn-everything, in-order prefix.
    Policies,
    /// Either, on workloads that checkpoint after about every third op:
    /// chains of delta checkpoints that reach their bound, so whole images
    /// are rewritten too, with cuts in every part of both.
    DeltaChains,
    /// As `DeltaChains`, on volumes whose slots are two small blocks: the
    /// images spill to the data area, with cuts while the spill extents,
    /// the slot's table and the deltas after it are written, and while the
    /// data area is reused.
    Spilled,
    /// As `DeltaChains`, on volumes with extent pages: cuts while a base's
    /// pages, the flush after them and its root are written, and while
    /// the pages the base replaced are reused.
    ExtentPages,
}

fn policy_for(mix: Mix, rng: &mut SmallRng) -> CutPolicy {
    match mix {
        Mix::Seeded => CutPolicy::Seeded(rng.gen()),
        Mix::DeltaChains | Mix::Spilled | Mix::ExtentPages if rng.gen() => {
            CutPolicy::Seeded(rng.gen())
        }
        Mix::Policies | Mix::DeltaChains | Mix::Spilled | Mix::ExtentPages => {
            match rng.gen_range(0..4) {
                0 => CutPolicy::KeepNothing,
                1 => CutPolicy::KeepEverything,
                2 => CutPolicy::TornAll(rng.gen()),
                _ => CutPolicy::Prefix(rng.gen()),
            }
        }
    }
}

/// Runs one workload, cutting power along the way; verifies every cut.
/// Returns the number of cut states verified.
fn run_workload(seed: u64, mix: Mix, stats: &Stats) -> u64 {
    run_workload_on(seed, mix, stats, false).unwrap_or_else(|e| panic!("{e}"))
}

fn run_workload_on(seed: u64, mix: Mix, stats: &Stats, lying_device: bool) -> Result<u64, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let fua = rng.gen_bool(0.5);
    let size = [4 * MIB, 6 * MIB, 8 * MIB][rng.gen_range(0..3)];
    let mut geo = if rng.gen_bool(0.5) {
        Geometry::default_4k()
    } else {
        Geometry::random(&mut rng)
    };
    if mix == Mix::Spilled {
        geo.lbs = 512;
        geo.opts.block_size = 512;
        geo.opts.checkpoint_slot_bytes = Some(2 * u64::from(geo.opts.block_size));
    }
    geo.opts.extent_pages = mix == Mix::ExtentPages;
    // Half of those with index pages, drawn from a copy: later draws (and
    // recorded seeds) stay as they were.
    geo.opts.page_index = geo.opts.extent_pages && rng.clone().gen_bool(0.5);
    if mix == Mix::ExtentPages {
        // Small blocks: some files fragment past the 19 extents a root
        // keeps inline at 512 bytes, so some bases list pages (at 4 KiB,
        // 162, which these workloads' files never reach).
        geo.lbs = 512;
        geo.opts.block_size = 512;
    }
    let chains = matches!(mix, Mix::DeltaChains | Mix::Spilled | Mix::ExtentPages);
    let mem = geo.formatted_device(size, fua, rng.gen());
    let tap = TapDevice::new(mem.clone(), rng.gen());
    tap.lie_about_flush
        .store(lying_device, std::sync::atomic::Ordering::Relaxed);

    let states: Arc<Mutex<Vec<CutState>>> = Arc::default();
    // With extent pages, smaller writes and strided ones: files fragment
    // past the inline bound.
    let cfg = if mix == Mix::ExtentPages {
        WorkloadCfg {
            max_write: 2048,
            strided_writes: 0.3,
            ..WorkloadCfg::default()
        }
    } else {
        WorkloadCfg::default()
    };
    // Mostly short workloads; some long ones, which wrap the journal.
    let ops = if chains {
        rng.gen_range(40..100)
    } else if rng.gen_bool(0.1) {
        rng.gen_range(150..400)
    } else {
        rng.gen_range(15..60)
    };
    let p_cut: f64 = rng.gen_range(0.05..0.5);
    // Reservoir of cut states, spread over the whole workload.
    let max_states = 64usize;

    // The workload's history is created inside; the hook needs its progress,
    // so build the workload first, then install the hook before any op.
    // (Cuts during the first mount are covered by remount ops.)
    let mut wl = Workload::new(
        tap.clone() as Arc<dyn BlockDevice>,
        SmallRng::seed_from_u64(rng.gen()),
        cfg,
    );
    let progress = wl.h.progress.clone();
    {
        let states = states.clone();
        let mut hrng = SmallRng::seed_from_u64(rng.gen());
        let mut request = 0u64;
        let mut seen = 0u64;
        let trace = std::env::var_os("IOMAPFS_TRACE_IO").is_some();
        tap.set_hook(Some(Box::new(move |dev: &MemDevice, what: Tapped| {
            request += 1;
            if trace {
                let w = progress.window();
                eprintln!(
                    "io: request {request} {what:?} during op {} (durable up to {})",
                    w.hi, w.lo
                );
            }
            if !hrng.gen_bool(p_cut) {
                return;
            }
            let mut st = states.lock().unwrap();
            seen += 1;
            let slot = if st.len() < max_states {
                None
            } else {
                let j = hrng.gen_range(0..seen);
                if j >= max_states as u64 {
                    return;
                }
                Some(j as usize)
            };
            let policy = policy_for(mix, &mut hrng);
            let cs = CutState {
                dev: cut(dev, policy),
                window: progress.window(),
                policy,
                request,
                what: format!("{what:?}"),
            };
            match slot {
                None => st.push(cs),
                Some(j) => st[j] = cs,
            }
        })));
    }

    for _ in 0..ops {
        let ok = wl.step();
        assert!(ok, "workload op failed without any fault: {:?}", wl.failed);
        if chains && rng.gen_bool(0.35) {
            wl.op_checkpoint();
            assert!(wl.failed.is_none(), "checkpoint failed: {:?}", wl.failed);
        }
        watchdog().beat();
    }
    if chains {
        // How the chains went: a generation past the format's base and
        // the deltas after the newest base means whole images were
        // rewritten.
        let sb = iomapfs_fs::superblock::read_superblock(&*mem).unwrap();
        let newest = iomapfs_fs::checkpoint::read_checkpoints(&*mem, &sb).unwrap();
        stats.add("checkpoint generations", newest.checkpoint.generation);
        stats.add("deltas in the last chain", u64::from(newest.chain.deltas));
        let rewrote = newest.checkpoint.generation > 1 + u64::from(newest.chain.deltas);
        stats.add("workloads that rewrote a base", u64::from(rewrote));
        let spilled = newest.spills.iter().filter(|s| !s.is_empty()).count();
        stats.add("slots ending spilled", spilled as u64);
        stats.add("workloads ending spilled", u64::from(spilled > 0));
        let paged = newest.pages.iter().any(|p| !p.is_empty());
        stats.add("workloads ending with extent pages", u64::from(paged));
    }
    tap.set_hook(None);
    // Cuts after the last op, with nothing in progress.
    let final_window = wl.h.progress.window();
    {
        let mut st = states.lock().unwrap();
        for _ in 0..2 {
            let policy = policy_for(mix, &mut rng);
            st.push(CutState {
                dev: cut(&mem, policy),
                window: final_window,
                policy,
                request: u64::MAX,
                what: "after the last op".into(),
            });
        }
    }
    // Stop the workload's volume (a crash: nothing more reaches `mem`).
    wl.handles.clear();
    wl.vol.take();
    stats.add("workloads", 1);
    stats.add("ops", ops as u64);

    let states = std::mem::take(&mut *states.lock().unwrap());
    let n = states.len() as u64;
    for (i, cs) in states.into_iter().enumerate() {
        let ctx = format!(
            "seed={seed} cut #{i} before request {} ({}), policy {:?}, window lo={} completed={} hi={}, fua={fua} {}",
            cs.request, cs.what, cs.policy, cs.window.lo, cs.window.completed, cs.window.hi, geo.describe()
        );
        verify_cut(cs, &wl, &ctx, &mut rng, stats)?;
        watchdog().beat();
    }
    Ok(n)
}

/// With `IOMAPFS_FULL_HISTORY=1`, every op of the workload, for a failure
/// message.
fn full_history(wl: &Workload) -> String {
    if std::env::var_os("IOMAPFS_FULL_HISTORY").is_none() {
        return "\n  (IOMAPFS_FULL_HISTORY=1 prints every op)".into();
    }
    let ops: Vec<String> =
        wl.h.op_names
            .iter()
            .enumerate()
            .map(|(i, o)| format!("  {i}: {o}"))
            .collect();
    format!("\n  all ops:\n{}", ops.join("\n"))
}

/// Verifies one crash state. `Err` for a violated invariant; panics only in
/// the optional post-recovery part.
fn verify_cut(
    cs: CutState,
    wl: &Workload,
    ctx: &str,
    rng: &mut SmallRng,
    stats: &Stats,
) -> Result<(), String> {
    let dev: Arc<dyn BlockDevice> = Arc::new(cs.dev);
    let report = try_fsck_clean(dev.clone(), &format!("{ctx}: fsck of the crash state"))?;
    stats.add("journal_records_replayed", report.journal_records);
    let vol = Volume::open(dev.clone())
        .map_err(|e| format!("{ctx}: mount of the crash state failed: {e}"))?;
    let st = read_volume(&vol, u64::MAX)
        .map_err(|e| format!("{ctx}: reading the recovered volume: {e}"))?;
    if let Err(e) = wl.h.check(&st, cs.window) {
        return Err(format!("{ctx}:\n{e}{}", full_history(wl)));
    }
    stats.add("states_verified", 1);
    stats.add("files_verified", st.files.len() as u64);
    if cs.window.hi > cs.window.completed {
        stats.add("cuts_mid_op", 1);
    }
    match cs.policy {
        CutPolicy::Seeded(_) => stats.add("policy_seeded", 1),
        CutPolicy::KeepNothing => stats.add("policy_keep_nothing", 1),
        CutPolicy::KeepEverything => stats.add("policy_keep_everything", 1),
        CutPolicy::TornAll(_) => stats.add("policy_torn", 1),
        CutPolicy::Prefix(_) => stats.add("policy_prefix", 1),
    }

    // Sometimes: use the recovered volume — create and write a file, extend
    // an existing one (the extension must read as zeros, even where a lost
    // write left bytes on the device past the old EOF) — then unmount, fsck,
    // mount and compare.
    if rng.gen_bool(0.15) {
        let path = "/post-recovery";
        let data = tagged(rng.gen(), 0, rng.gen_range(1..20_000));
        let f = vol
            .open_file(
                path,
                OpenFlags {
                    create: true,
                    truncate: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap_or_else(|e| panic!("{ctx}: create after recovery: {e}"));
        let n = f
            .pwrite(&data, 0)
            .unwrap_or_else(|e| panic!("{ctx}: write after recovery: {e}"));
        assert_eq!(n, data.len(), "{ctx}: short write after recovery");
        let mut want = st.clone();
        want.files.remove(path);
        want.attrs.remove(path);
        let names: Vec<String> = want.files.keys().cloned().collect();
        if !names.is_empty() && !common::skip("eof-tail") {
            let p = &names[rng.gen_range(0..names.len())];
            let fd = want.files.get_mut(p).unwrap();
            let grow = rng.gen_range(1..20_000u64);
            let h = vol
                .open_file(p, OpenFlags::default())
                .unwrap_or_else(|e| panic!("{ctx}: open {p} after recovery: {e}"));
            h.truncate(fd.size + grow)
                .unwrap_or_else(|e| panic!("{ctx}: truncate up {p} after recovery: {e}"));
            fd.size += grow;
            fd.data.resize(fd.size as usize, 0);
            let grown = fd.clone();
            // Its other names (hard links) see the same bytes.
            let ino = want.attrs[p].ino;
            for (q, a) in &want.attrs {
                if a.ino == ino {
                    want.files.insert(q.clone(), grown.clone());
                }
            }
        }
        f.fsync()
            .unwrap_or_else(|e| panic!("{ctx}: fsync after recovery: {e}"));
        drop(f);
        vol.unmount()
            .unwrap_or_else(|e| panic!("{ctx}: unmount after recovery: {e}"));
        fsck_clean(
            dev.clone(),
            &format!("{ctx}: fsck after recovery + write + unmount"),
        );
        let vol = Volume::open(dev.clone())
            .unwrap_or_else(|e| panic!("{ctx}: remount after recovery: {e}"));
        let mut st2 = read_volume(&vol, u64::MAX)
            .unwrap_or_else(|e| panic!("{ctx}: reading after remount: {e}"));
        let got_new = st2.files.remove(path).map(|f| f.data);
        st2.attrs.remove(path);
        if st2 != want {
            let mut msg = String::new();
            for (p, w) in &want.files {
                match st2.files.get(p) {
                    Some(g) if g == w => {}
                    Some(g) => {
                        let at = common::first_diff(&g.data, &w.data).unwrap_or(0);
                        msg += &format!(
                            "\n  {p}: size {} want {}; at {at} got {} (from {}) want {}",
                            g.size,
                            w.size,
                            common::excerpt(&g.data, at),
                            common::history::attribute(&g.data, at, wl.h.max_wid),
                            common::excerpt(&w.data, at)
                        );
                    }
                    None => msg += &format!("\n  {p}: missing"),
                }
            }
            panic!("{ctx}: after recovery, a write, an extension, unmount and mount, the volume differs:{msg}\n  dirs {:?} want {:?}\n  symlinks {:?} want {:?}\n  attrs {:?} want {:?}", st2.dirs, want.dirs, st2.symlinks, want.symlinks, st2.attrs, want.attrs);
        }
        assert_eq!(
            got_new.as_deref(),
            Some(&data[..]),
            "{ctx}: file written after recovery"
        );
        drop(vol);
        stats.add("post_recovery_checks", 1);
    } else {
        drop(vol);
    }
    Ok(())
}

fn run(mix: Mix, name: &str, share: f64) {
    let t0 = Instant::now();
    let seeds = Seeds::from_env(name);
    let target = (env_u64("IOMAPFS_POWER_CUTS", 100_000) as f64 * share).ceil() as u64;
    let stats = Stats::default();
    let mut cuts = 0u64;
    let mut i = 0u64;
    loop {
        let seed = seeds.case(i);
        cuts += run_case("power_cut", seed, name, || run_workload(seed, mix, &stats));
        i += 1;
        if seeds.fixed.is_some() || cuts >= target {
            break;
        }
    }
    stats.add("cuts", cuts);
    stats.print(name, t0.elapsed());
    if mix == Mix::ExtentPages {
        // Most workloads must end with a base that lists pages, or the
        // suite would not be testing them. Small files keep their extents
        // inline: strided writes give files past the 19 extents a root
        // keeps inline at 512 bytes.
        let (paged, workloads) = (
            stats.get("workloads ending with extent pages"),
            stats.get("workloads"),
        );
        assert!(
            paged * 2 > workloads,
            "{paged} of {workloads} workloads had pages"
        );
    }
    if mix == Mix::Spilled {
        // Most workloads must end on a spilled checkpoint, or the suite
        // would not be testing spilled ones.
        let (spilled, workloads) = (
            stats.get("workloads ending spilled"),
            stats.get("workloads"),
        );
        assert!(
            2 * spilled >= workloads,
            "{spilled} of {workloads} workloads spilled"
        );
    }
}

#[test]
fn power_cut_seeded_random_subsets() {
    run(Mix::Seeded, "power_cut_seeded_random_subsets", 0.5);
}

#[test]
fn power_cut_policies_nothing_everything_torn_prefix() {
    run(Mix::Policies, "power_cut_policies", 0.35);
}

#[test]
fn power_cut_during_delta_chains() {
    run(Mix::DeltaChains, "power_cut_delta_chains", 0.15);
}

#[test]
fn power_cut_during_spilled_checkpoints() {
    run(Mix::Spilled, "power_cut_spilled_checkpoints", 0.1);
}

#[test]
fn power_cut_during_checkpoints_with_extent_pages() {
    run(Mix::ExtentPages, "power_cut_extent_pages", 0.1);
}

/// The crash model must be able to fail: states that break an invariant are
/// rejected, legal ones accepted. (A checker that accepts everything would
/// make every other test here pass vacuously.)
#[test]
fn crash_model_rejects_bad_states() {
    use common::history::{History, MARKER};
    use common::volstate::{FileAttrs, FileData, VolState};

    let fd = |d: Vec<u8>| FileData {
        size: d.len() as u64,
        data: d,
    };
    let mut h = History::new();
    h.begin("create /a");
    let a = h.new_file("/a");
    h.end(); // 1
    h.begin("write w1 [0, 8192)");
    *h.data_mut(a) = tagged(1, 0, 8192);
    h.end(); // 2
    h.begin("fsync");
    h.mark_durable();
    h.end(); // 3: /a = w1 is durable
    h.begin("write w2 [0, 4096)");
    h.data_mut(a)[..4096].copy_from_slice(&tagged(2, 0, 4096));
    h.end(); // 4
    h.begin("create /b");
    h.new_file("/b");
    h.end(); // 5
    let w = Window {
        lo: 3,
        completed: 5,
        hi: 5,
    };
    let v1 = tagged(1, 0, 8192);
    let mut v2 = v1.clone();
    v2[..4096].copy_from_slice(&tagged(2, 0, 4096));
    let state = |files: Vec<(&str, Vec<u8>)>| VolState {
        dirs: Default::default(),
        attrs: files
            .iter()
            .enumerate()
            .map(|(i, (p, _))| {
                let a = FileAttrs {
                    ino: 10 + i as u64,
                    nlink: 1,
                    mode: 0o644,
                    ..FileAttrs::default()
                };
                (p.to_string(), a)
            })
            .collect(),
        files: files
            .into_iter()
            .map(|(p, d)| (p.to_string(), fd(d)))
            .collect(),
        ..VolState::default()
    };
    // Legal: old or new data, torn per sector, /b created or not.
    let mut torn = v1.clone();
    torn[512..1024].copy_from_slice(&v2[512..1024]);
    for ok in [
        state(vec![("/a", v1.clone())]),
        state(vec![("/a", v2.clone())]),
        state(vec![("/a", torn), ("/b", vec![])]),
    ] {
        h.check(&ok, w).expect("a legal state was rejected");
    }
    // Illegal.
    let mut stale = v1.clone();
    stale[4096..4104].copy_from_slice(MARKER);
    let mut zeroed = v1.clone();
    zeroed[6000..6500].fill(0);
    let mut foreign = v1.clone();
    foreign[5000..5512].copy_from_slice(&tagged(99, 5000, 512));
    let bad = [
        ("synced file lost", state(vec![])),
        (
            "synced file truncated",
            state(vec![("/a", v1[..4096].to_vec())]),
        ),
        ("stale marker", state(vec![("/a", stale)])),
        ("synced data zeroed", state(vec![("/a", zeroed)])),
        ("foreign write's bytes", state(vec![("/a", foreign)])),
        (
            "file never created",
            state(vec![("/a", v1.clone()), ("/c", vec![])]),
        ),
        (
            "size past any write",
            state(vec![("/a", [v1.clone(), vec![0; 10]].concat())]),
        ),
    ];
    for (what, st) in bad {
        assert!(h.check(&st, w).is_err(), "crash model accepted: {what}");
    }
    // A returned DSYNC write is durable on its own, without a sync.
    h.begin("dsync write w3 [4096, 8192)");
    h.data_mut(a)[4096..].copy_from_slice(&tagged(3, 4096, 4096));
    h.mark_dsync(a, 4096, 8192);
    h.end(); // 6
    let w = Window {
        lo: 3,
        completed: 6,
        hi: 6,
    };
    let mut v3 = v1.clone();
    v3[4096..].copy_from_slice(&tagged(3, 4096, 4096));
    h.check(&state(vec![("/a", v3)]), w)
        .expect("dsync state rejected");
    assert!(
        h.check(&state(vec![("/a", v2)]), w).is_err(),
        "crash model accepted the loss of a returned DSYNC write"
    );
    // Metadata is a prefix: /b (op 5) cannot exist without what op 4 did
    // being possible... but a namespace from before the sync can't come back.
    h.begin("unlink /a");
    h.ns_mut().files.remove("/a");
    h.end(); // 7
    h.begin("sync");
    h.mark_durable();
    h.end(); // 8
    let w = Window {
        lo: 8,
        completed: 8,
        hi: 8,
    };
    assert!(
        h.check(&state(vec![("/a", v1), ("/b", vec![])]), w)
            .is_err(),
        "crash model accepted an unlink undone after a sync"
    );
    h.check(&state(vec![("/b", vec![])]), w)
        .expect("the synced state was rejected");

    // Format version 2's metadata: a synced chmod, xattr and hard link
    // must all be there, and the two names must be one inode.
    let mut h = History::new();
    h.begin("create /a");
    let a = h.new_file("/a");
    h.end();
    h.begin("chmod, setxattr, link /a /b");
    let attrs = h.ns_mut().attrs.entry(a).or_default();
    attrs.mode = 0o600;
    attrs.xattrs.insert("user.k".into(), b"v".to_vec());
    h.ns_mut().files.insert("/b".into(), a);
    h.end();
    h.begin("sync");
    h.mark_durable();
    h.end(); // 3
    let w = Window {
        lo: 3,
        completed: 3,
        hi: 3,
    };
    let linked = |mode: u32, xattr: bool, inos: (u64, u64), nlink: u32| {
        let mut st = state(vec![("/a", vec![]), ("/b", vec![])]);
        for (p, ino) in [("/a", inos.0), ("/b", inos.1)] {
            let at = st.attrs.get_mut(p).unwrap();
            at.mode = mode;
            at.ino = ino;
            at.nlink = nlink;
            if xattr {
                at.xattrs.insert("user.k".into(), b"v".to_vec());
            }
        }
        st
    };
    h.check(&linked(0o600, true, (5, 5), 2), w)
        .expect("the synced attributes were rejected");
    for (what, st) in [
        ("chmod lost", linked(0o644, true, (5, 5), 2)),
        ("xattr lost", linked(0o600, false, (5, 5), 2)),
        ("hard link became a copy", linked(0o600, true, (5, 6), 1)),
        ("link count wrong", linked(0o600, true, (5, 5), 1)),
    ] {
        assert!(h.check(&st, w).is_err(), "crash model accepted: {what}");
    }
}

/// The harness must notice a device that acknowledges flushes without making
/// anything durable: synced data then vanishes at a cut, and some workload
/// among a few must fail verification. (Guards against a harness that cuts
/// nothing or checks nothing.)
#[test]
fn harness_catches_a_device_that_ignores_flush() {
    let stats = Stats::default();
    let mut caught = 0;
    for i in 0..20u64 {
        let seed = common::mix64(0xF1A5 + i);
        if run_workload_on(seed, Mix::Policies, &stats, true).is_err() {
            caught += 1;
        }
    }
    assert!(
        caught >= 5,
        "only {caught} of 20 workloads on a device that ignores flushes failed verification"
    );
    eprintln!("harness_catches_a_device_that_ignores_flush: {caught} of 20 workloads caught");
}

/// The journal's chain end to end: a commit's batch N (several blocks) is
/// torn by a power cut — its first blocks land, the rest do not — so
/// recovery stops before it; the recovered volume commits a different,
/// shorter batch N at the same place, over the torn one's first blocks;
/// then a second power cut. The volume must come back with the second
/// batch's changes and none of the torn one's, whatever of the torn
/// batch's tail is still behind the new one.
#[test]
fn torn_batch_then_another_batch_at_its_place_then_a_second_crash() {
    use blockdev::memory::{FaultOp, FaultRule, Survival};
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    for keep_blocks in [1usize, 2, 3] {
        let ctx = format!("torn batch keeping its first {keep_blocks} block(s)");
        let mem = common::dev::marked_device(8 * MIB, false);
        common::dev::format(mem.clone());
        let vol = Volume::open(mem.clone()).unwrap();
        vol.open_file("/a", create)
            .unwrap()
            .pwrite(&tagged(1, 0, 5000), 0)
            .unwrap();
        vol.sync().unwrap();
        // Batch N: enough records for several blocks.
        for i in 0..300 {
            vol.open_file(
                &format!("/torn-{i:03}-with-a-long-name-to-fill-blocks"),
                create,
            )
            .unwrap();
        }
        let journal = {
            let l = iomapfs_fs::superblock::read_superblock(&*mem)
                .unwrap()
                .layout;
            l.journal.start..l.journal.end()
        };
        let held = mem.pause_after(FaultRule::new(FaultOp::Write).range(journal.clone()));
        let committer = {
            let vol = vol.clone();
            std::thread::spawn(move || vol.sync())
        };
        held.wait_reached();
        let mut batch_blocks = 0;
        let crashed = mem.power_cut(&mut |w| {
            if journal.contains(&w.offset()) {
                batch_blocks = w.blocks();
                // Logical blocks of the device: keep the first ones only.
                let per_fs_block = 4096 / (w.len() as usize / w.blocks()).max(1);
                let keep = keep_blocks * per_fs_block;
                Survival::Torn((0..w.blocks()).map(|b| b < keep).collect())
            } else {
                Survival::Kept
            }
        });
        held.resume();
        committer.join().unwrap().unwrap();
        drop(vol);
        assert!(
            batch_blocks > 3 * 8,
            "{ctx}: batch N has only {batch_blocks} device blocks: not torn across blocks"
        );
        let crashed = Arc::new(crashed);
        fsck_clean(crashed.clone(), &format!("{ctx}: first recovery"));
        let vol = Volume::open(crashed.clone()).unwrap();
        let st = read_volume(&vol, u64::MAX).unwrap();
        assert_eq!(
            st.files.keys().collect::<Vec<_>>(),
            ["/a"],
            "{ctx}: a torn batch was (partly) applied"
        );
        // A different batch N, one block, where the torn one started.
        for name in ["/p", "/q"] {
            vol.open_file(name, create)
                .unwrap()
                .pwrite(&tagged(2, 0, 100), 0)
                .unwrap();
        }
        vol.sync().unwrap();
        drop(vol);
        let second: Arc<MemDevice> = Arc::new(crashed.power_cut(&mut |_| Survival::Lost));
        fsck_clean(second.clone(), &format!("{ctx}: second recovery"));
        let vol = Volume::open(second).unwrap();
        let st = read_volume(&vol, u64::MAX).unwrap();
        assert_eq!(
            st.files.keys().collect::<Vec<_>>(),
            ["/a", "/p", "/q"],
            "{ctx}: after the second crash"
        );
        assert_eq!(st.files["/p"].data, tagged(2, 0, 100), "{ctx}");
    }
}

/// Power cuts while a checkpoint marks the older slot superseded (the write
/// that follows the new checkpoint's flush): the mark lost, kept, or torn
/// block by block. Every crash state mounts with the new checkpoint, the
/// whole state, fsck clean. Then the new checkpoint is damaged: where the
/// mark reached the disk, mount refuses and fsck reports generation lost;
/// where it did not, the older slot is used silently — exactly the case a
/// torn checkpoint write also leaves, so that is the right answer.
#[test]
fn power_cut_during_the_supersede_mark() {
    // The new checkpoint a delta after the chain in the same slot, then a
    // whole image in the other slot (the chain is as long as it may be).
    supersede_mark_cut(false);
    supersede_mark_cut(true);
}

fn supersede_mark_cut(whole: bool) {
    use blockdev::memory::{FaultOp, FaultRule, Survival};
    use iomapfs_fs::checkpoint::read_checkpoints;
    use iomapfs_fs::superblock::read_superblock;
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    let mem = common::dev::marked_device(8 * MIB, false);
    common::dev::format(mem.clone());
    let sb = read_superblock(&*mem).unwrap();
    let vol = Volume::open(mem.clone()).unwrap();
    vol.open_file("/a", create)
        .unwrap()
        .pwrite(&tagged(1, 0, 5000), 0)
        .unwrap();
    vol.sync().unwrap();
    vol.checkpoint().unwrap();
    if whole {
        // Fill the chain: the next checkpoint must start a new one.
        while read_checkpoints(&*mem, &sb).unwrap().chain.deltas
            < iomapfs_fs::limits::MAX_CHAIN_DELTAS
        {
            vol.checkpoint().unwrap();
        }
    }
    vol.open_file("/b", create)
        .unwrap()
        .pwrite(&tagged(2, 0, 7000), 0)
        .unwrap();
    let older = read_checkpoints(&*mem, &sb).unwrap();
    // The older checkpoint's record: the chain's last in its slot. Its
    // first block is where the mark goes.
    let older_record = sb.layout.checkpoint_slots[older.slot].start + older.chain.last_offset;
    let older_slot = iomapfs_fs::superblock::Region {
        start: older_record,
        len: u64::from(sb.layout.block_size),
    };
    let held =
        mem.pause_after(FaultRule::new(FaultOp::Write).range(older_slot.start..older_slot.end()));
    // The checkpoint must reach the mark write; if it ends without one,
    // fail instead of waiting for ever.
    let (tx, rx) = std::sync::mpsc::channel();
    let checkpointer = {
        let (vol, tx) = (vol.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = vol.checkpoint();
            let _ = tx.send("checkpoint returned");
            r
        })
    };
    let waiter = std::thread::spawn(move || {
        held.wait_reached();
        let _ = tx.send("mark write held");
        held
    });
    let first = rx.recv().unwrap();
    assert_eq!(
        first, "mark write held",
        "the checkpoint wrote nothing to the older slot: no supersede mark"
    );
    let held = waiter.join().unwrap();
    let mut policies: Vec<Option<Vec<bool>>> = vec![None, Some(vec![])];
    let mut mark_blocks = 0;
    // Probe the request's size with a throwaway cut.
    let _ = mem.power_cut(&mut |w| {
        if older_slot.contains(w.offset()) {
            mark_blocks = w.blocks();
        }
        Survival::Kept
    });
    assert!(mark_blocks >= 1, "no pending write to the older slot");
    for b in 0..mark_blocks {
        policies.push(Some((0..mark_blocks).map(|i| i == b).collect()));
    }
    let mut crashed_states = Vec::new();
    for policy in &policies {
        crashed_states.push(mem.power_cut(&mut |w| {
            if !older_slot.contains(w.offset()) {
                return Survival::Kept;
            }
            match policy {
                None => Survival::Lost,
                Some(v) if v.is_empty() => Survival::Kept,
                Some(v) => Survival::Torn(v.clone()),
            }
        }));
    }
    held.resume();
    checkpointer.join().unwrap().unwrap();
    let expected = read_volume(&vol, u64::MAX).unwrap();
    drop(vol);
    let mut refused = 0;
    for (policy, crashed) in policies.iter().zip(crashed_states) {
        let ctx = format!("mark write {policy:?} (None: lost, []: kept, else torn)");
        let crashed = Arc::new(crashed);
        let newest = read_checkpoints(&*crashed, &sb).unwrap();
        assert_eq!(
            newest.checkpoint.generation,
            older.checkpoint.generation + 1,
            "{ctx}"
        );
        assert!(newest.lost.is_none(), "{ctx}");
        assert_eq!(
            newest.slot != older.slot,
            whole,
            "{ctx}: a whole image or a delta"
        );
        fsck_clean(crashed.clone(), &ctx);
        let vol = Volume::open(crashed.clone()).unwrap();
        assert_eq!(read_volume(&vol, u64::MAX).unwrap(), expected, "{ctx}");
        drop(vol);
        // Now damage the new checkpoint.
        let mut sector = [0u8; 512];
        crashed.read_at(&mut sector, older_record).unwrap();
        let at = iomapfs_fs::checkpoint::OFF_SUPERSEDED;
        let marked = sector[at..at + 4] != [0; 4];
        let new_record = sb.layout.checkpoint_slots[newest.slot].start + newest.chain.last_offset;
        crashed.read_at(&mut sector, new_record).unwrap();
        sector[100] ^= 0x40;
        crashed
            .write_at(&sector, new_record, blockdev::WriteMode::Normal)
            .unwrap();
        let report = iomapfs_fs::fsck::check(crashed.clone());
        match Volume::open(crashed.clone()) {
            Err(e) => {
                assert!(marked, "{ctx}: refused without a mark: {e}");
                let msg = e.to_string();
                assert!(
                    msg.contains(&format!("generation {}", newest.checkpoint.generation)),
                    "{ctx}: {msg}"
                );
                let report = report.unwrap();
                assert!(
                    !report.is_clean(),
                    "{ctx}: fsck calls a lost checkpoint clean"
                );
                refused += 1;
            }
            Ok(_) => assert!(!marked, "{ctx}: a marked slot was used silently"),
        }
    }
    assert!(refused >= 1, "the kept mark never made damage visible");
    assert!(
        refused < policies.len(),
        "a lost mark was reported as damage"
    );
}
