//! The first metadata change after a snapshot (issue 13): a checkpoint
//! clones the metadata state and encodes the clone while changes go on, so
//! the first change to a structure the clone shares pays for copying what
//! it touches, under the metadata lock. Measured on a directory of 1M
//! entries (a create in it) and a file of 1M extents (a new extent in a
//! hole). Also the delta a checkpoint writes after 1% of that file's
//! extents changed (`MetaState::delta_since`, the bulk of the bench's
//! "ckpt 1%" column). Run: `cargo bench -p iomapfs-fs --bench snapshot_cow`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use iomapfs_fs::state::MetaState;
use iomapfs_fs::types::{FileKind, InodeAttrs, Record, Timestamp, ROOT_INO};

const ENTRIES: u64 = 1_000_000;
const EXTENTS: u64 = 1_000_000;
const BLOCK: u64 = 4096;
/// More than the last-level caches of the machines this runs on.
const EVICT_BYTES: usize = 256 << 20;

fn attrs() -> InodeAttrs {
    InodeAttrs::new(0o100644, 0, 0, Timestamp::from_ns(1))
}

fn create(state: &MetaState, name: String) -> Record {
    Record::Create {
        ino: state.next_ino,
        parent: ROOT_INO,
        name,
        kind: FileKind::Regular,
        attrs: attrs(),
        target: Vec::new(),
    }
}

fn apply(state: &mut MetaState, record: &Record) {
    let mut freed = Vec::new();
    state.apply(record, &mut freed).expect("a valid record");
}

/// A root directory of `ENTRIES` files; the last one, when `extents` is
/// set, has `EXTENTS` one-block extents, every other block.
fn state_with(extents: bool) -> MetaState {
    let mut state = MetaState::new_empty(BLOCK as u32, Timestamp::from_ns(1), 0, 0);
    let entries = if extents { 1 } else { ENTRIES };
    for i in 0..entries {
        let record = create(&state, format!("f{i:08}"));
        apply(&mut state, &record);
    }
    if extents {
        let ino = state.next_ino - 1;
        for i in 0..EXTENTS {
            let record = map_block(ino, 2 * i);
            apply(&mut state, &record);
        }
    }
    // As a checkpoint does before its snapshot: the live state then starts
    // with nothing changed (with the build's million changes still listed,
    // the first change reallocated that list and measured only that).
    state.take_changed();
    state
}

fn map_block(ino: u64, block: u64) -> Record {
    Record::MapUnwritten {
        ino,
        file_off: block * BLOCK,
        len: BLOCK,
        addr: (1 << 30) + block * BLOCK,
    }
}

fn first_change_after_a_snapshot(c: &mut Criterion) {
    let mut group = c.benchmark_group("first change after a snapshot");
    group.sample_size(20);

    let dir = state_with(false);
    let record = create(&dir, "new".to_string());
    group.bench_function("create in a directory of 1M entries", |b| {
        b.iter_batched(
            || (dir.clone(), dir.clone()),
            |(mut live, snapshot)| {
                apply(&mut live, &record);
                (live, snapshot)
            },
            BatchSize::LargeInput,
        )
    });
    drop(dir);

    let file = state_with(true);
    let ino = file.next_ino - 1;
    let record = map_block(ino, 2 * (EXTENTS / 2) + 1);
    group.bench_function("new extent in a file of 1M extents", |b| {
        b.iter_batched(
            || (file.clone(), file.clone()),
            |(mut live, snapshot)| {
                apply(&mut live, &record);
                (live, snapshot)
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

/// A new extent in the hole after every hundredth extent of the 1M-extent
/// file, as the bench's `metadata-scale` "ckpt 1%" does; times the delta of
/// the changed spans since the state was taken before.
fn delta_after_one_percent_changed(c: &mut Criterion) {
    let mut group = c.benchmark_group("checkpoint delta");
    group.sample_size(20);
    let mut live = state_with(true);
    let ino = live.next_ino - 1;
    for i in (0..EXTENTS).step_by(100) {
        apply(&mut live, &map_block(ino, 2 * i + 1));
    }
    let changed = live.take_changed();
    group.bench_function("1% of a file of 1M extents changed", |b| {
        b.iter(|| live.delta_since(&changed))
    });
    // As in a running volume, where the writes between checkpoints and
    // everything else leave little of the map in the CPU's caches: each
    // sample starts after writing a buffer larger than the caches.
    let mut evict = vec![0u8; EVICT_BYTES];
    group.bench_function("1% of a file of 1M extents changed, cold caches", |b| {
        b.iter_batched(
            || {
                for line in evict.chunks_mut(64) {
                    line[0] = line[0].wrapping_add(1);
                }
            },
            |()| live.delta_since(&changed),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(
    benches,
    first_change_after_a_snapshot,
    delta_after_one_percent_changed
);
criterion_main!(benches);
