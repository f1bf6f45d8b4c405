//! Tests of the eviction of extent chunks to the mount's budget
//! ([`crate::extent_cache`]) through whole volumes. Unit tests: chunks hold
//! at most 8 extents here, so a few hundred extents make many chunks, and
//! the tests wait on the evictor's request.
//!
//! Here rather than in `extent_cache`: they drive whole volumes, and
//! `volume` reaches `extent_cache` through `background_thread`.

use std::sync::{mpsc, Arc, Mutex};

use blockdev::memory::{FaultOp, FaultRule, MemDevice};
use blockdev::{BlockDevice, WriteMode};

use crate::free_space::{ScanHook, ScanPoint};
use crate::page_loader::PageLoads;
use crate::types::Ino;
use crate::volume::{FormatOptions, MountOptions, Volume};
use crate::{Error, OpenFlags};

const BLOCK: u64 = 4096;
/// Extents of /big: one per other block, so none merge (about 100
/// chunks of at most 8).
const EXTENTS: u64 = 800;
/// A few chunks' worth of extents (a chunk of 8 extents is 256 bytes),
/// past the maps' shells (the tests set it with [`budget_with_room`]).
const BUDGET: u64 = 4096;
/// What one read may add past the budget before the evictor runs: its
/// one chunk.
const ONE_CHUNK: u64 = 1024;

fn fill(k: u64) -> u8 {
    (k % 251) as u8 + 1
}

fn direct() -> OpenFlags {
    OpenFlags {
        direct: true,
        ..OpenFlags::default()
    }
}

fn opts(budget: u64) -> MountOptions {
    MountOptions {
        background_checkpoints: false,
        background_commits: false,
        metadata_cache_bytes: budget,
        ..MountOptions::default()
    }
}

/// A volume holding /big (EXTENTS one-block extents, paged), unmounted
/// after a base (a clean unmount writes one).
fn volume() -> Arc<MemDevice> {
    volume_with(&FormatOptions::default())
}

/// [`volume`], formatted with `opts`.
fn volume_with(opts: &FormatOptions) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(64 << 20, 512));
    Volume::format(dev.clone(), opts).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let big = vol
        .open_file(
            "/big",
            OpenFlags {
                create: true,
                ..direct()
            },
        )
        .unwrap();
    for k in 0..EXTENTS {
        big.pwrite(&[fill(k); BLOCK as usize], 2 * k * BLOCK)
            .unwrap();
    }
    big.fsync().unwrap();
    drop(big);
    vol.unmount().unwrap();
    dev
}

/// The error under the file and offset a read names.
fn cause(err: &Error) -> &Error {
    match err {
        Error::At { source, .. } => cause(source),
        other => other,
    }
}

fn stats(vol: &Volume) -> PageLoads {
    vol.extent_page_loads().expect("pages read on demand")
}

/// Waits until the evictor has nothing asked or running.
fn settle(vol: &Volume) {
    vol.inner
        .page_loader
        .as_ref()
        .unwrap()
        .evict_request
        .wait_idle();
}

/// Sets the budget to the shells of the maps (see
/// `PageLoads::shell_bytes`) plus `room` for the chunks' extents, and
/// returns what the chunks get: `room`, or the least share of the budget
/// the loader gives them if that is more.
fn budget_with_room(vol: &Volume, room: u64) -> u64 {
    // As the state has them now (the loader's count is a look's).
    vol.inner.count_shells();
    let shells = stats(vol).shell_bytes;
    vol.inner
        .page_loader
        .as_ref()
        .unwrap()
        .set_budget(shells + room);
    let got = stats(vol).chunk_budget;
    assert!(got >= room, "{got} < {room}");
    got
}

const PAGE_REF: u64 = std::mem::size_of::<crate::codec::PageRef>() as u64;

/// What the paged maps take beside their extents, as the state has them
/// now.
fn map_shells(vol: &Volume) -> u64 {
    let meta = vol.inner.meta.read();
    crate::state::paged_shell_bytes_of(&meta.state.inodes, meta.state.block_size)
}

fn read_block(vol: &Volume, k: u64) -> crate::Result<Vec<u8>> {
    let big = vol.open_file("/big", direct())?;
    let mut block = vec![0u8; BLOCK as usize];
    big.pread(&mut block, 2 * k * BLOCK)?;
    Ok(block)
}

fn ino_of_big(vol: &Volume) -> Ino {
    vol.open_file("/big", OpenFlags::default()).unwrap().ino()
}

/// (chunks without a page, those of them in memory) of `ino`'s map.
fn unpaged(vol: &Volume, ino: Ino) -> (usize, usize) {
    let meta = vol.inner.meta.read();
    let chunks = meta.state.inodes[&ino].extents.chunk_pages();
    chunks
        .filter(|c| c.page().is_none())
        .fold((0, 0), |(n, l), c| (n + 1, l + usize::from(c.is_loaded())))
}

/// Reading every block of a paged file under a budget of a few chunks:
/// the clean bytes never pass the budget by more than the chunk one read
/// loads (the evictor brings them back below before the next), chunks
/// are read again after eviction, and every block reads back as written,
/// twice over. No chunk is loaded outside an entry point.
#[test]
fn reading_a_whole_paged_file_stays_within_the_budget() {
    let dev = volume();
    let vol = Volume::open_with(dev.clone(), &opts(BUDGET)).unwrap();
    let room = budget_with_room(&vol, BUDGET);
    vol.wait_free_space().unwrap();
    let chunks = stats(&vol).chunks;
    assert!(chunks > 50, "{:?}", stats(&vol));
    let mut most = 0;
    for round in 0..2 {
        for k in 0..EXTENTS {
            assert_eq!(
                read_block(&vol, k).unwrap(),
                vec![fill(k); BLOCK as usize],
                "round {round} block {k}"
            );
            most = most.max(stats(&vol).cached_bytes);
            settle(&vol);
            let s = stats(&vol);
            assert!(s.cached_bytes <= room, "after eviction: {s:?}");
        }
    }
    assert!(most <= room + ONE_CHUNK, "{most} bytes at most");
    let s = stats(&vol);
    // Every chunk was read twice (once per round): each was evicted.
    assert!(s.loads >= 2 * chunks, "{s:?}");
    assert!(s.chunks_loaded < s.chunks / 4, "few chunks kept: {s:?}");
    assert_eq!(s.unplanned, 0, "{s:?}");
    // Less than the room given at mount: the segments the reads opened
    // took a share, what the evictor has not made cold again.
    assert!(s.chunk_budget <= room, "{s:?}");
    assert!(s.segments_open < s.segments / 2, "{s:?}");
    vol.unmount().unwrap();
}

/// The paged maps' shells (each chunk's entry and allocation, loaded or
/// absent, and the page references both slots list) take their part of
/// the budget: the clean chunks' extents get what is left.
#[test]
fn the_shells_of_the_maps_count_against_the_budget() {
    for page_index in [false, true] {
        shells_count_against_the_budget(page_index);
    }
}

fn shells_count_against_the_budget(page_index: bool) {
    // More than an eighth of shells and room together (the least the
    // chunks get).
    const ROOM: u64 = 8 << 10;
    let dev = volume_with(&FormatOptions {
        page_index,
        ..FormatOptions::default()
    });
    let vol = Volume::open_with(dev, &opts(u64::MAX)).unwrap();
    vol.wait_free_space().unwrap();
    let s = stats(&vol);
    let listed = crate::extent_pages::listed_pages(&vol.inner.commit.lock().pages);
    assert!(
        listed >= s.chunks,
        "{listed} pages listed, {} chunks",
        s.chunks
    );
    assert_eq!(
        s.shell_bytes,
        map_shells(&vol) + listed * std::mem::size_of::<crate::codec::PageRef>() as u64,
        "counted at mount: {s:?}"
    );
    // Mount leaves every segment cold: a page reference per chunk, not a
    // shell. (With index pages mount starts a segment at each index
    // page's run, and unit builds' runs are of 2 to 4 chunks
    // (`SEGMENT_MAX`), so there the segments' own bytes outweigh the
    // shells that cold segments save: runs are of 64 to 128 chunks
    // outside tests.)
    assert_eq!(s.segments_open, 0, "{s:?}");
    assert!(
        page_index || map_shells(&vol) < s.chunks * crate::extent_map::CHUNK_SHELL_BYTES,
        "{s:?}"
    );
    // More than the room: the shells alone are more than it.
    assert!(s.shell_bytes > ROOM, "{s:?}");
    budget_with_room(&vol, ROOM);
    let mut most = 0;
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap(), vec![fill(k); BLOCK as usize]);
        settle(&vol);
        most = most.max(stats(&vol).cached_bytes);
    }
    let s = stats(&vol);
    // The segments the reads opened took their share of the room, and
    // the evictor made most of them cold again.
    assert_eq!(s.chunk_budget, s.cache_budget - s.shell_bytes, "{s:?}");
    assert!(s.opened_shell_bytes > 0 && s.chunk_budget < ROOM, "{s:?}");
    assert!(s.segments_open < s.segments / 2, "{s:?}");
    assert!(most <= ROOM, "clean chunks reached {most} bytes: {s:?}");
    assert!(s.evicted_bytes > 0, "{s:?}");
    vol.unmount().unwrap();
}

/// The shells follow the maps: changes that split chunks, then a base
/// that lists new pages, leave the loader counting what the state holds.
#[test]
fn the_shells_are_counted_again_at_a_base() {
    let dev = volume();
    let vol = Volume::open_with(dev, &opts(u64::MAX)).unwrap();
    vol.wait_free_space().unwrap();
    let before = stats(&vol);
    let before_listed = crate::extent_pages::listed_pages(&vol.inner.commit.lock().pages);
    let big = vol.open_file("/big", direct()).unwrap();
    // Into the hole after every other extent: a quarter more extents,
    // and more chunks.
    for k in (0..EXTENTS).step_by(4) {
        big.pwrite(&[0xee; BLOCK as usize], (2 * k + 1) * BLOCK)
            .unwrap();
    }
    big.fsync().unwrap();
    // A base, with room for every chunk: no eviction makes segments cold
    // behind the count (a base made due by a budget of 1 byte raced the
    // evictor, and the count was stale about one run in a hundred).
    vol.inner.checkpoint_for_unmount().unwrap();
    assert_eq!(
        vol.inner.commit.lock().chain.deltas,
        0,
        "a base was written"
    );
    let maps = map_shells(&vol);
    let listed = crate::extent_pages::listed_pages(&vol.inner.commit.lock().pages);
    let after = stats(&vol);
    assert!(after.chunks > before.chunks, "{after:?}, {before:?}");
    // The changed segments are open: more than the cold ones at mount.
    assert!(
        maps + after.opened_shell_bytes > before.shell_bytes - before_listed * PAGE_REF,
        "{after:?}"
    );
    assert_eq!(
        after.shell_bytes,
        maps + after.opened_shell_bytes + listed * PAGE_REF,
        "maps' shells {maps}, {listed} pages listed: {after:?}"
    );
    drop(big);
    vol.unmount().unwrap();
}

/// Free space ready means mount's scan keeps nothing of the maps: its
/// snapshot shares their chunks, and a chunk a snapshot holds stays in
/// memory whatever the evictor does. The scan thread is held after it
/// opened the gate (where a late drop of its snapshot would still hold
/// every chunk) while a budget of a few chunks is read past many times.
#[test]
fn a_finished_free_space_scan_keeps_no_chunk_in_memory() {
    let dev = volume();
    let (release, held) = mpsc::channel::<()>();
    let held = Mutex::new(held);
    let hook = ScanHook(Arc::new(move |point| {
        if point == ScanPoint::Finished {
            // Returns once released, or when the test drops `release`.
            let _ = held.lock().unwrap().recv();
        }
    }));
    let opts = MountOptions {
        free_space_scan_hook: Some(hook),
        ..opts(BUDGET)
    };
    let vol = Volume::open_with(dev.clone(), &opts).unwrap();
    let room = budget_with_room(&vol, BUDGET);
    // Declared after `vol`, so dropped before it when an assertion fails:
    // the scan thread `vol`'s drop joins is let go first.
    let release = release;
    vol.wait_free_space().unwrap();
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap()[0], fill(k), "block {k}");
        settle(&vol);
        let s = stats(&vol);
        assert!(s.cached_bytes <= room, "block {k}: {s:?}");
    }
    release.send(()).unwrap();
    vol.unmount().unwrap();
}

/// The default budget (64 MiB) keeps every chunk a read loads: nothing is
/// evicted, nothing read twice.
#[test]
fn under_the_default_budget_nothing_is_evicted() {
    let dev = volume();
    let vol = Volume::open_with(
        dev.clone(),
        &opts(MountOptions::default().metadata_cache_bytes),
    )
    .unwrap();
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap()[0], fill(k));
    }
    settle(&vol);
    let s = stats(&vol);
    assert_eq!((s.loads, s.chunks_loaded), (s.chunks, s.chunks), "{s:?}");
    assert!(
        s.cached_bytes > 0 && s.cached_bytes < s.cache_budget,
        "{s:?}"
    );
    vol.unmount().unwrap();
}

/// A chunk changed since the last base names no page and only memory
/// holds it: it is never evicted, however far past the budget, and its
/// changes read back and survive a remount. (Its inode is out of the
/// checkpoint's changed set after a delta, so only the chunk's missing
/// page keeps it.)
#[test]
fn a_changed_chunk_is_never_evicted() {
    // Twice the others' budget: the changed chunks stay under a quarter.
    let budget = 2 * BUDGET;
    let dev = volume();
    let vol = Volume::open_with(dev.clone(), &opts(budget)).unwrap();
    vol.wait_free_space().unwrap();
    let ino = ino_of_big(&vol);
    let big = vol.open_file("/big", direct()).unwrap();
    // Into the holes between the extents of a few chunks: new extents.
    let holes = [1u64, 3, 301, 1201];
    for &h in &holes {
        big.pwrite(&[0xee; BLOCK as usize], h * BLOCK).unwrap();
    }
    big.fsync().unwrap();
    // A delta (the changed chunks are far under a quarter of the budget):
    // they keep no page.
    vol.checkpoint().unwrap();
    assert!(vol.inner.commit.lock().chain.deltas > 0, "a delta");
    let (changed, loaded) = unpaged(&vol, ino);
    assert!(changed >= 3 && loaded == changed, "{changed} {loaded}");
    // Load everything else, past the budget many times over.
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap()[0], fill(k), "block {k}");
        settle(&vol);
    }
    let s = stats(&vol);
    assert!(s.cached_bytes <= budget, "{s:?}");
    assert!(s.loads > s.chunks, "evicted and read again: {s:?}");
    assert_eq!(unpaged(&vol, ino), (changed, changed), "never evicted");
    let mut block = vec![0u8; BLOCK as usize];
    for &h in &holes {
        big.pread(&mut block, h * BLOCK).unwrap();
        assert_eq!(block, vec![0xee; BLOCK as usize], "block {h}");
    }
    assert_eq!(stats(&vol).unplanned, 0);
    drop(big);
    // A crash (no unmount): the delta and the journal bring them back.
    drop(vol);
    let vol = Volume::open_with(dev.clone(), &opts(budget)).unwrap();
    let big = vol.open_file("/big", direct()).unwrap();
    for &h in &holes {
        big.pread(&mut block, h * BLOCK).unwrap();
        assert_eq!(block, vec![0xee; BLOCK as usize], "block {h} after remount");
    }
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap()[0], fill(k), "block {k}");
    }
}

/// Chunks changed since the last base past a quarter of the budget, with
/// the chunks in memory past all of it: the next checkpoint is a base
/// (which gives them pages). Past a quarter but within the budget, or
/// under a quarter, it stays a delta.
#[test]
fn changed_chunks_past_a_quarter_of_the_budget_make_a_base() {
    // `None`: after a delta and eviction of every clean chunk, twice the
    // changed chunks.
    for (budget, want_base) in [(Some(BUDGET), true), (Some(64 << 20), false), (None, false)] {
        let dev = volume();
        let vol = Volume::open_with(dev.clone(), &opts(budget.unwrap_or(64 << 20))).unwrap();
        vol.wait_free_space().unwrap();
        let ino = ino_of_big(&vol);
        let big = vol.open_file("/big", direct()).unwrap();
        // The changes ask for no base meanwhile (see
        // `VolumeInner::ask_checkpoint_if_unpaged_may_pass`): the budget
        // this test decides on is set before its checkpoint.
        let loader = vol.inner.page_loader.as_ref().unwrap();
        loader.set_budget(u64::MAX);
        // One new extent in each of many chunks: more than BUDGET / 4
        // bytes of changed chunks.
        for k in (0..EXTENTS).step_by(16) {
            big.pwrite(&[0xee; BLOCK as usize], (2 * k + 1) * BLOCK)
                .unwrap();
        }
        big.fsync().unwrap();
        let unpaged_bytes = vol.inner.meta.read().state.unpaged_chunk_bytes();
        assert!(unpaged_bytes > BUDGET / 4, "{unpaged_bytes}");
        let budget = budget.unwrap_or_else(|| {
            vol.checkpoint().unwrap();
            assert!(vol.inner.commit.lock().chain.deltas > 0);
            loader.set_budget(1);
            settle(&vol);
            // Twice the changed chunks, past the shells.
            let budget = stats(&vol).shell_bytes + 2 * unpaged_bytes;
            loader.set_budget(budget);
            budget
        });
        loader.set_budget(budget);
        settle(&vol);
        // What the chunks' extents may take: the budget less the shells.
        let budget = stats(&vol).chunk_budget;
        let in_memory = unpaged_bytes + stats(&vol).cached_bytes;
        assert!(
            unpaged_bytes > budget / 4 || budget > 32 << 20,
            "{in_memory} {budget}"
        );
        assert_eq!(in_memory > budget, want_base, "{in_memory} {budget}");
        vol.checkpoint().unwrap();
        let deltas = vol.inner.commit.lock().chain.deltas;
        assert_eq!(deltas == 0, want_base, "budget {budget}: {deltas} deltas");
        let (changed, _) = unpaged(&vol, ino);
        assert_eq!(
            changed == 0,
            want_base,
            "budget {budget}: {changed} unpaged"
        );
        vol.unmount().unwrap();
    }
}

/// A base due for changed chunks first evicts clean ones to a fraction of
/// the budget below the evictor's line (`extent_cache::BASE_ROOM_DIVISOR`),
/// making room for what the base's snapshot holds while it runs. The
/// evictor's own thread cannot: it waits for the base.
#[test]
fn a_base_for_changed_chunks_first_makes_room_below_the_line() {
    const CHUNKS_ROOM: u64 = 16 << 10;
    let dev = volume();
    let vol = Volume::open_with(dev, &opts(u64::MAX)).unwrap();
    vol.wait_free_space().unwrap();
    let ino = ino_of_big(&vol);
    let loader = vol.inner.page_loader.as_ref().unwrap().clone();
    // The shells take their part of the budget, also those of the
    // segments the reads and writes open; the chunks' extents get the
    // rest.
    let opened = stats(&vol).chunks * crate::extent_map::CHUNK_SHELL_BYTES;
    budget_with_room(&vol, CHUNKS_ROOM + opened);
    for k in 0..EXTENTS {
        read_block(&vol, k).unwrap();
    }
    settle(&vol);
    // The changes ask for no base meanwhile: this test asks for it.
    loader.set_budget(u64::MAX);
    let big = vol.open_file("/big", direct()).unwrap();
    for k in (0..EXTENTS).step_by(24) {
        big.pwrite(&[0xee; BLOCK as usize], (2 * k + 1) * BLOCK)
            .unwrap();
    }
    big.fsync().unwrap();
    // The room again, past the shells as they are now.
    budget_with_room(&vol, CHUNKS_ROOM);
    settle(&vol);
    let unpaged_bytes = vol.inner.meta.read().state.unpaged_chunk_bytes();
    let before = stats(&vol);
    // What the chunks' extents may take: the budget less the shells.
    let chunk_budget = before.chunk_budget;
    assert!(unpaged_bytes > chunk_budget / 4, "{unpaged_bytes}");
    let room_line = crate::extent_cache::eviction_line(chunk_budget)
        .checked_sub(chunk_budget / 4 + unpaged_bytes)
        .expect("changed chunks leave room for clean ones");
    // Else the base would have nothing to evict.
    assert!(
        before.cached_bytes > room_line + 2 * ONE_CHUNK,
        "{} clean, {unpaged_bytes} changed, room line {room_line}",
        before.cached_bytes
    );
    vol.inner.checkpoint_if_due().unwrap();
    assert_eq!(
        vol.inner.commit.lock().chain.deltas,
        0,
        "a base was written"
    );
    assert_eq!(
        unpaged(&vol, ino).0,
        0,
        "the base paged every changed chunk"
    );
    // Read before the evictor's thread, asked by the base's newly clean
    // chunks, could run: whatever it evicts only adds.
    let evicted = stats(&vol).evicted_bytes - before.evicted_bytes;
    assert!(
        evicted + ONE_CHUNK >= before.cached_bytes - room_line,
        "the base evicted {evicted} bytes first: {} clean, room line {room_line}",
        before.cached_bytes
    );
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap(), vec![fill(k); BLOCK as usize]);
    }
    drop(big);
    vol.unmount().unwrap();
}

/// A page damaged after its chunk was evicted fails the read that needs
/// it with the same `Corrupt` a never-loaded chunk gives (no panic), and
/// only that chunk; a device error on the reload is a device error, and
/// the next read, with the device healthy again, loads it.
#[test]
fn an_evicted_chunk_reloads_with_the_errors_of_a_first_load() {
    let dev = volume();
    let vol = Volume::open_with(dev.clone(), &opts(BUDGET)).unwrap();
    budget_with_room(&vol, BUDGET);
    vol.wait_free_space().unwrap();
    let ino = ino_of_big(&vol);
    // Chunks 10 and 40 and their pages, loaded then evicted by reading
    // everything after them.
    let pages: Vec<_> = {
        let meta = vol.inner.meta.read();
        let map = &meta.state.inodes[&ino].extents;
        map.chunk_pages().map(|c| c.page().unwrap()).collect()
    };
    let (damaged, failing) = (pages[10], pages[40]);
    let first_block = |p: crate::codec::PageRef| p.first_key / BLOCK / 2;
    for k in 0..EXTENTS {
        read_block(&vol, k).unwrap();
        settle(&vol);
    }
    let loaded = |p: crate::codec::PageRef| {
        let meta = vol.inner.meta.read();
        let map = &meta.state.inodes[&ino].extents;
        let c = map.chunk_pages().find(|c| c.page() == Some(p)).unwrap();
        c.is_loaded()
    };
    assert!(!loaded(damaged) && !loaded(failing), "both evicted");

    let mut bytes = vec![0u8; BLOCK as usize];
    dev.read_at(&mut bytes, damaged.addr).unwrap();
    bytes[100] ^= 0x40;
    dev.write_at(&bytes, damaged.addr, WriteMode::Normal)
        .unwrap();
    let k = first_block(damaged) + 1;
    for _ in 0..2 {
        let err = read_block(&vol, k).map(|b| b[0]).unwrap_err();
        assert!(matches!(cause(&err), Error::Corrupt { .. }), "{err:?}");
        assert_eq!(err.errno(), libc::EUCLEAN, "{err}");
        let text = err.to_string();
        assert!(
            text.contains(&format!("inode {ino}")) && text.contains(&damaged.addr.to_string()),
            "{text}"
        );
    }
    assert!(!loaded(damaged));

    // (The simple-read path retries once on the generic path: every read
    // of the page fails until the device heals.)
    dev.inject(FaultRule::new(FaultOp::Read).range(failing.addr..failing.addr + 1));
    let k = first_block(failing);
    let err = read_block(&vol, k).map(|b| b[0]).unwrap_err();
    assert!(matches!(cause(&err), Error::Device { .. }), "{err:?}");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(!loaded(failing));
    dev.clear_faults();
    assert_eq!(read_block(&vol, k).unwrap()[0], fill(k), "read again");
    // The chunks around the damaged one still read.
    assert_eq!(
        read_block(&vol, first_block(pages[9])).unwrap()[0],
        fill(first_block(pages[9]))
    );
    assert_eq!(
        read_block(&vol, first_block(pages[11])).unwrap()[0],
        fill(first_block(pages[11]))
    );
    assert_eq!(stats(&vol).unplanned, 0);
}

/// Readers and a writer run while the evictor works through a budget
/// of a few chunks: every read returns what was written there (the
/// writer's blocks included), nothing is loaded outside an entry point,
/// and the clean bytes come back under the budget once all is done.
/// Seeded, several seeds.
#[test]
fn concurrent_readers_and_a_writer_during_eviction() {
    use rand::{Rng, SeedableRng};
    let dev = volume();
    let opts = MountOptions {
        background_checkpoints: true,
        background_commits: true,
        ..opts(BUDGET)
    };
    let vol = Volume::open_with(dev.clone(), &opts).unwrap();
    let room = budget_with_room(&vol, BUDGET);
    vol.wait_free_space().unwrap();
    // Blocks the writer fills (holes of the layout), decided up front so
    // that readers know what each reads: old data or, once written, the
    // new (a hole reads zeros before).
    let written = Arc::new(
        (0..EXTENTS)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect::<Vec<_>>(),
    );
    std::thread::scope(|s| {
        for seed in 0..3u64 {
            let vol = vol.clone();
            let written = written.clone();
            s.spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                let big = vol.open_file("/big", direct()).unwrap();
                let mut block = vec![0u8; BLOCK as usize];
                for _ in 0..1500 {
                    // Holes inside EOF only: before the last extent.
                    let k = rng.gen_range(0..EXTENTS - 1);
                    if rng.gen_bool(0.5) {
                        big.pread(&mut block, 2 * k * BLOCK).unwrap();
                        assert_eq!(
                            block,
                            vec![fill(k); BLOCK as usize],
                            "seed {seed} block {k}"
                        );
                    } else {
                        // A hole block: zeros until the writer's data,
                        // which it marks only after its write returned.
                        let was = written[k as usize].load(std::sync::atomic::Ordering::Acquire);
                        big.pread(&mut block, (2 * k + 1) * BLOCK).unwrap();
                        let ok = block == vec![0u8; BLOCK as usize]
                            || block == vec![!fill(k); BLOCK as usize];
                        assert!(ok, "seed {seed} hole {k}");
                        if was {
                            assert_eq!(block[0], !fill(k), "seed {seed} hole {k}");
                        }
                    }
                }
            });
        }
        let vol = vol.clone();
        let written = written.clone();
        s.spawn(move || {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(99);
            let big = vol.open_file("/big", direct()).unwrap();
            for i in 0..150 {
                let k = rng.gen_range(0..EXTENTS - 1);
                big.pwrite(&[!fill(k); BLOCK as usize], (2 * k + 1) * BLOCK)
                    .unwrap();
                written[k as usize].store(true, std::sync::atomic::Ordering::Release);
                if i % 30 == 29 {
                    big.fsync().unwrap();
                    vol.checkpoint().unwrap();
                }
            }
        });
    });
    assert_eq!(stats(&vol).unplanned, 0, "{:?}", stats(&vol));
    // A checkpoint ends with the changed chunks paged or under a quarter
    // of the budget; then everything clean can go.
    vol.checkpoint().unwrap();
    for k in 0..EXTENTS {
        assert_eq!(read_block(&vol, k).unwrap()[0], fill(k), "block {k}");
        settle(&vol);
    }
    let s = stats(&vol);
    assert!(s.cached_bytes <= room, "{s:?}");
    assert!(s.loads > s.chunks, "evicted and read again: {s:?}");
    assert_eq!(s.unplanned, 0, "{s:?}");
    vol.unmount().unwrap();
    // Whatever was written reads back after remount.
    let vol = Volume::open_with(dev.clone(), &opts).unwrap();
    let big = vol.open_file("/big", direct()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    for k in 0..EXTENTS - 1 {
        big.pread(&mut block, (2 * k + 1) * BLOCK).unwrap();
        let want = if written[k as usize].load(std::sync::atomic::Ordering::Relaxed) {
            !fill(k)
        } else {
            0
        };
        assert_eq!(block[0], want, "hole {k} after remount");
    }
}

/// A backlog of chunks past the budget (the evictor held back while a
/// couple of thousand were loaded) is evicted in many short holds of the metadata
/// lock, not one long one that every read and write would wait for, and
/// brings the chunks in memory back under the budget.
#[test]
fn a_large_eviction_goes_in_short_holds_of_the_metadata_lock() {
    const MANY: u64 = 8000;
    let dev = many_one_block_extents(MANY);
    let vol = Volume::open_with(dev, &opts(BUDGET)).unwrap();
    let room = budget_with_room(&vol, BUDGET);
    vol.wait_free_space().unwrap();
    let f = vol.open_file("/many", direct()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    {
        // The evictor takes this first: it waits while the chunks load.
        let _evictor_held = vol.inner.checkpointing.lock();
        for k in 0..MANY {
            f.pread(&mut block, 2 * k * BLOCK).unwrap();
        }
        assert!(stats(&vol).cached_bytes > 4 * room, "{:?}", stats(&vol));
        vol.take_longest_lock_holds();
    }
    settle(&vol);
    let holds = vol.take_longest_lock_holds();
    let s = stats(&vol);
    assert!(s.cached_bytes <= room, "after eviction: {s:?}");
    // Two thousand chunks take hundreds of microseconds (about 0.1 µs
    // each); a hold is about 20. In one hold per run of the evictor
    // (asked twice here), it was 2.
    assert!(holds.eviction_steps >= 5, "{s:?} evicted in {holds:?}");
}

/// Changes all over a paged map with no checkpoint asked for (a journal
/// far from half full): the checkpoint thread, asked by the changes, writes
/// bases as the changed chunks pass a quarter of the budget, so they stay
/// near it instead of growing with every chunk touched, and the evictor
/// keeps the clean chunks of the file being changed within the budget;
/// every change reads back after a remount.
#[test]
fn changes_all_over_a_paged_map_stay_near_the_budget_without_a_checkpoint_asked_for() {
    const MANY: u64 = 4000;
    // What the chunks' extents get, past their shells.
    const CHUNKS_BUDGET: u64 = 32 << 10;
    let dev = many_one_block_extents(MANY);
    let vol = Volume::open_with(dev.clone(), &MountOptions::default()).unwrap();
    vol.wait_free_space().unwrap();
    budget_with_room(&vol, CHUNKS_BUDGET);
    let many = vol.open_file("/many", direct()).unwrap();
    let ino = many.ino();
    let mut block = vec![0u8; BLOCK as usize];
    for k in 0..MANY {
        many.pread(&mut block, 2 * k * BLOCK).unwrap();
    }
    settle(&vol);
    let quarter = CHUNKS_BUDGET / 4;
    // What the changes between two looks of the thread may add on top:
    // the least it waits between looks, and the chunk that crossed it.
    let between_looks = CHUNKS_BUDGET / crate::transaction::LOOK_BUDGET_DIVISOR
        + crate::extent_map::CHUNK_BYTES_MAX;
    let (mut most, mut most_cached, mut changes, mut rereads) = (0, 0, 0, 0);
    let (mut last_reread, mut most_in_memory) = (0, 0);
    let mut reread_due = false;
    // Into the hole after every third extent: about three changed chunks
    // per chunk's worth of changes, spread over the whole map.
    for k in (0..MANY).step_by(3) {
        many.fallocate((2 * k + 1) * BLOCK, BLOCK, false).unwrap();
        changes += 1;
        vol.inner.checkpoint_request.wait_idle();
        let unpaged = vol.inner.meta.read().state.unpaged_chunk_bytes();
        // The rule a base follows: both past their lines, or it is not
        // due yet. Loads alone can make it due (the rereads below): then
        // the next look comes within `between_looks` of changes, a few.
        let cached = stats(&vol).cached_bytes;
        let just_reread = changes - last_reread <= 4;
        assert!(
            unpaged <= quarter + between_looks
                || unpaged + cached
                    <= crate::extent_cache::eviction_line(CHUNKS_BUDGET) + between_looks
                || just_reread,
            "after {changes} changes: {unpaged} bytes of changed chunks, {cached} clean, \
             budget {CHUNKS_BUDGET}"
        );
        most = most.max(unpaged);
        // The file changes all the time, and its other chunks are
        // evicted all the same (those a change's span meets are kept
        // for the next delta): reads between changes load them again.
        // (Not right after a base: it took the changes. Due every 64
        // changes, it waits for changes pending: bases come as the
        // checkpoint thread's timing has them, and one just before each
        // 64th change left too few rereads about one run in fifty.)
        reread_due |= changes % 64 == 0;
        let pending = vol.inner.meta.read().state.changed_spans(ino).is_some();
        if reread_due && pending {
            reread_due = false;
            for k in (0..MANY).step_by(5) {
                many.pread(&mut block, 2 * k * BLOCK).unwrap();
            }
            settle(&vol);
            let s = stats(&vol);
            // The chunks' room: what `budget_with_room` left them, or
            // more while the evictor has made segments the reads opened
            // cold again, their shells given back (such a moment failed
            // a check against the first room about one run in a hundred).
            let room = CHUNKS_BUDGET.max(s.chunk_budget);
            most_cached = most_cached.max(s.cached_bytes.saturating_sub(room));
            // The clean chunks make room for the changed ones.
            let unpaged = vol.inner.meta.read().state.unpaged_chunk_bytes();
            most_in_memory = most_in_memory.max((s.cached_bytes + unpaged).saturating_sub(room));
            rereads += 1;
            last_reread = changes;
        }
    }
    assert!(rereads >= 10, "{rereads} rereads with changes pending");
    assert_eq!(
        most_cached, 0,
        "clean chunks passed their room by {most_cached} bytes, budget {CHUNKS_BUDGET}"
    );
    // One look interval of changes may come before the look that counts
    // them, and one more while a base runs (counted from its snapshot).
    assert!(
        most_in_memory <= 2 * between_looks,
        "chunks in memory passed their room by {most_in_memory} bytes, budget {CHUNKS_BUDGET}"
    );
    assert!(
        !vol.inner.commit.lock().journal.is_half_full(),
        "the journal alone would have asked for checkpoints"
    );
    assert!(
        most <= 2 * quarter,
        "changed chunks reached {most} bytes in {changes} changes, budget {CHUNKS_BUDGET}"
    );
    drop(many);
    vol.unmount().unwrap();
    let vol = Volume::open(dev).unwrap();
    let f = vol.open_file("/many", OpenFlags::default()).unwrap();
    let mapped: u64 = f
        .fiemap()
        .unwrap()
        .iter()
        .filter(|e| e.addr != 0)
        .map(|e| e.length)
        .sum();
    assert_eq!(mapped, (MANY + changes) * BLOCK);
}

/// A volume holding /many: `extents` one-block unwritten extents at every
/// other block (none merge), unmounted after a base.
fn many_one_block_extents(extents: u64) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(128 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let many = vol
        .open_file(
            "/many",
            OpenFlags {
                create: true,
                ..direct()
            },
        )
        .unwrap();
    for k in 0..extents {
        many.fallocate(2 * k * BLOCK, BLOCK, false).unwrap();
    }
    drop(many);
    vol.unmount().unwrap();
    dev
}

/// With nobody answering the checkpoint thread's asks (as when the thread
/// is busy with a long base), a writer that gets another quarter of the
/// budget of changed chunks past its ask writes the base itself: changed
/// chunks stay within about twice a quarter of the budget.
#[test]
fn a_writer_far_ahead_of_the_checkpoint_thread_writes_the_base_itself() {
    const MANY: u64 = 4000;
    // What the chunks' extents get, past their shells.
    const CHUNKS_BUDGET: u64 = 32 << 10;
    let dev = many_one_block_extents(MANY);
    let vol = Volume::open_with(dev, &opts(u64::MAX)).unwrap();
    vol.wait_free_space().unwrap();
    budget_with_room(&vol, CHUNKS_BUDGET);
    let many = vol.open_file("/many", direct()).unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    for k in 0..MANY {
        many.pread(&mut block, 2 * k * BLOCK).unwrap();
    }
    settle(&vol);
    let generation = vol.inner.commit.lock().generation;
    let mut most = 0;
    for k in (0..MANY).step_by(3) {
        many.fallocate((2 * k + 1) * BLOCK, BLOCK, false).unwrap();
        most = most.max(vol.inner.meta.read().state.unpaged_chunk_bytes());
    }
    let quarter = CHUNKS_BUDGET / 4;
    // Past the quarter, asked within a look interval, written at another
    // (counted as the chunks were when they first changed, a little less
    // than they grow to), plus the chunk that crossed it.
    let interval = CHUNKS_BUDGET / crate::transaction::LOOK_BUDGET_DIVISOR;
    let bound = quarter + 2 * interval + 2 * crate::extent_map::CHUNK_BYTES_MAX;
    assert!(
        most <= bound,
        "changed chunks reached {most} bytes (bound {bound}, budget {CHUNKS_BUDGET})"
    );
    let written = vol.inner.commit.lock().generation - generation;
    assert!(written >= 3, "{written} checkpoints written by the writer");
}

/// A change whose chunks the mount left on their pages reads them before
/// it takes the metadata lock exclusive: while each of its page reads is
/// held on the device, a lookup in another file goes on. Each change is
/// at a chunk's first extent, so it also reads the chunk before (a
/// change merges with both neighbours), which no lookup of its own range
/// reads first: an allocating direct write into the hole before it, a
/// buffered one (its reservation, then its writeback at fsync), a
/// fallocate of that hole, and a punch of the extent.
#[test]
fn changes_read_absent_chunks_before_taking_the_metadata_lock_exclusive() {
    use std::time::Duration;
    for what in ["write", "buffered", "fallocate", "punch"] {
        let dev = volume();
        let vol = Volume::open_with(dev.clone(), &opts(u64::MAX)).unwrap();
        vol.wait_free_space().unwrap();
        let create = OpenFlags {
            create: true,
            ..direct()
        };
        let other = Arc::new(vol.open_file("/other", create).unwrap());
        let ino = ino_of_big(&vol);
        let first_key = {
            let meta = vol.inner.meta.read();
            let chunks = meta.state.inodes[&ino].extents.chunk_pages();
            let key = chunks.map(|c| c.page().unwrap().first_key).nth(12);
            key.unwrap()
        };
        let flags = if what == "buffered" {
            OpenFlags::default()
        } else {
            direct()
        };
        let big = vol.open_file("/big", flags).unwrap();
        // Armed before the change starts, and each next one before the
        // last is let go: no page read of the change slips by.
        let mut pause = dev.pause_after(FaultRule::new(FaultOp::Read));
        let (done_tx, done) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            let hole = first_key - BLOCK;
            let result = match what {
                "write" => big.pwrite(&[7u8; BLOCK as usize], hole).map(drop),
                "buffered" => big
                    .pwrite(&[7u8; BLOCK as usize], hole)
                    .and_then(|_| big.fsync()),
                "fallocate" => big.fallocate(hole, BLOCK, false),
                _ => big.punch_hole(first_key, BLOCK),
            };
            let _ = done_tx.send(());
            result
        });
        let mut reads_held = 0;
        loop {
            if pause.reached_within(Duration::from_millis(1)) {
                reads_held += 1;
                // Under the exclusive lock this stat would wait for the
                // held read: the bound only turns a hang into a failure.
                let (stat_tx, stat) = mpsc::channel();
                let other = other.clone();
                std::thread::spawn(move || stat_tx.send(other.stat().map(drop)));
                let looked_up = stat.recv_timeout(Duration::from_secs(10));
                let next = dev.pause_after(FaultRule::new(FaultOp::Read));
                pause.resume();
                pause = next;
                assert!(
                    matches!(looked_up, Ok(Ok(()))),
                    "{what}: a lookup waited for page read {reads_held} of the change"
                );
            } else if done.try_recv().is_ok() {
                break;
            }
        }
        worker.join().unwrap().unwrap();
        assert!(reads_held >= 2, "{what}: {reads_held} page reads");
    }
}

/// Random changes and reads of a paged file under budgets of a few chunks,
/// with the background threads on (the evictor, checkpoints asked by the
/// journal and by changed chunks, bases that make room first), clean
/// remounts, and crashes after an fsync and power cuts in a checkpoint
/// after one: every read agrees with a model of the file's bytes, no chunk
/// is loaded outside an entry point, and fsck finds the volume clean at
/// the end.
#[test]
fn random_changes_under_a_budget_of_a_few_chunks_agree_with_a_model() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    const SEEDS: u64 = 12;
    const OPS: usize = 600;
    let span = 2 * EXTENTS * BLOCK;
    let mut cuts_mid_checkpoint = 0;
    for seed in 0..SEEDS {
        let mut rng = SmallRng::seed_from_u64(seed);
        let budget = rng.gen_range(1024..4 * BUDGET);
        let mount = MountOptions {
            metadata_cache_bytes: budget,
            ..MountOptions::default()
        };
        let mut dev = volume();
        // The last extent /big was written with is its last block.
        let mut model: Vec<u8> = (0..2 * EXTENTS - 1)
            .flat_map(|b| {
                let byte = if b % 2 == 0 { fill(b / 2) } else { 0 };
                std::iter::repeat_n(byte, BLOCK as usize)
            })
            .collect();
        let mut vol = Volume::open_with(dev.clone(), &mount).unwrap();
        let buffered = OpenFlags::default();
        let mut log = Vec::new();
        for op in 0..OPS {
            let ctx = |log: &[String]| format!("seed {seed}, budget {budget}, op {op}: {log:?}");
            let big_direct = vol.open_file("/big", direct()).unwrap();
            let big_buffered = vol.open_file("/big", buffered).unwrap();
            let block = rng.gen_range(0..2 * EXTENTS);
            let blocks = rng.gen_range(1..4u64).min(2 * EXTENTS - block);
            let (off, len) = (block * BLOCK, blocks * BLOCK);
            let size = model.len() as u64;
            match rng.gen_range(0..100) {
                0..=24 => {
                    let byte = rng.gen_range(1..=255u8);
                    let data = vec![byte; len as usize];
                    let file = if rng.gen_bool(0.5) {
                        &big_direct
                    } else {
                        &big_buffered
                    };
                    file.pwrite(&data, off).unwrap();
                    let end = (off + len) as usize;
                    if end > model.len() {
                        model.resize(end, 0);
                    }
                    model[off as usize..end].fill(byte);
                    log.push(format!("write {off}+{len} = {byte:#x}"));
                }
                25..=39 => {
                    big_direct.punch_hole(off, len).unwrap();
                    let end = ((off + len) as usize).min(model.len());
                    if (off as usize) < end {
                        model[off as usize..end].fill(0);
                    }
                    log.push(format!("punch {off}+{len}"));
                }
                40..=49 => {
                    big_direct.fallocate(off, len, true).unwrap();
                    log.push(format!("fallocate {off}+{len}"));
                }
                50..=54 => {
                    let to = rng.gen_range(span / 2..=span) / BLOCK * BLOCK;
                    big_direct.truncate(to).unwrap();
                    model.resize(to as usize, 0);
                    log.push(format!("truncate {to}"));
                }
                55..=59 => {
                    vol.checkpoint().unwrap();
                    log.push("checkpoint".into());
                }
                60..=62 => {
                    assert_eq!(stats(&vol).unplanned, 0, "{}", ctx(&log));
                    drop((big_direct, big_buffered));
                    vol.unmount().unwrap();
                    vol = Volume::open_with(dev.clone(), &mount).unwrap();
                    log.push("remount".into());
                    continue;
                }
                63..=65 => {
                    assert_eq!(stats(&vol).unplanned, 0, "{}", ctx(&log));
                    big_buffered.fsync().unwrap();
                    drop((big_direct, big_buffered));
                    // A crash after the fsync: nothing of the model is lost.
                    drop(vol);
                    vol = Volume::open_with(dev.clone(), &mount).unwrap();
                    log.push("fsync, crash".into());
                    continue;
                }
                66..=68 => {
                    assert_eq!(stats(&vol).unplanned, 0, "{}", ctx(&log));
                    big_buffered.fsync().unwrap();
                    // Power lost in a checkpoint, once its write `nth` is
                    // done (or any thread's that comes first): the writes
                    // not yet flushed are kept, lost or torn.
                    let nth = rng.gen_range(0..6);
                    let held = dev.pause_after(FaultRule::new(FaultOp::Write).skip(nth));
                    let cut = std::thread::scope(|s| {
                        let checkpoint = s.spawn(|| vol.checkpoint());
                        // A checkpoint of fewer writes ends unheld.
                        let slice = std::time::Duration::from_millis(5);
                        let reached = loop {
                            if held.reached_within(slice) {
                                break true;
                            }
                            if checkpoint.is_finished() {
                                break held.reached_within(std::time::Duration::ZERO);
                            }
                        };
                        let cut = dev.power_cut_seeded(rng.gen());
                        if reached {
                            cuts_mid_checkpoint += usize::from(dev.pending_writes() > 0);
                        }
                        held.resume();
                        checkpoint.join().unwrap().unwrap();
                        cut
                    });
                    drop((big_direct, big_buffered));
                    drop(vol);
                    dev = Arc::new(cut);
                    vol = Volume::open_with(dev.clone(), &mount).unwrap();
                    log.push(format!(
                        "fsync, power cut after write {nth} of a checkpoint"
                    ));
                    continue;
                }
                _ => {
                    let mut got = vec![0u8; len as usize];
                    let file = if rng.gen_bool(0.5) {
                        &big_direct
                    } else {
                        &big_buffered
                    };
                    let n = file.pread(&mut got, off).unwrap();
                    let want = &model[(off.min(size)) as usize..((off + len).min(size)) as usize];
                    assert!(
                        n == want.len() && got[..n] == *want,
                        "read {off}+{len}: {}",
                        ctx(&log)
                    );
                }
            }
            if log.len() > 12 {
                log.remove(0);
            }
        }
        let big = vol.open_file("/big", direct()).unwrap();
        let mut got = vec![0u8; model.len()];
        assert_eq!(big.pread(&mut got, 0).unwrap(), model.len());
        assert!(
            got == model,
            "seed {seed}, budget {budget}: the whole file differs"
        );
        assert_eq!(stats(&vol).unplanned, 0, "seed {seed}");
        drop(big);
        vol.unmount().unwrap();
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "seed {seed}: {report:?}");
    }
    // The cuts must have met checkpoints with writes in the cache.
    assert!(
        cuts_mid_checkpoint >= SEEDS as usize,
        "{cuts_mid_checkpoint} cuts mid-checkpoint"
    );
}
