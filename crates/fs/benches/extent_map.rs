//! `ExtentMap::lookup`, the mapping every read and write asks first (the
//! iomap `begin` of fast path 1): in a file of one extent, as a buffered
//! overwrite of a small file asks it, and at random in a file of 1M
//! one-block extents (every other block), whose chunks span many
//! segments, and at that file's end (what an append asks). And
//! `ExtentMap::insert` into a random hole of that file (an allocating
//! write into a sparse file), with the punch that makes the hole again.
//! Run: `cargo bench -p iomapfs-fs --bench extent_map`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use iomapfs_fs::extent_map::{ExtentMap, Lookup};
use iomapfs_fs::types::{Extent, ExtentState};

const BLOCK: u64 = 4096;
const EXTENTS: u64 = 1_000_000;

fn map_of(extents: u64, step: u64) -> ExtentMap {
    let mut map = ExtentMap::new(BLOCK as u32);
    for i in 0..extents {
        map.insert(Extent {
            file_off: i * step * BLOCK,
            len: BLOCK,
            addr: (1 << 30) + i * step * BLOCK,
            state: ExtentState::Written,
        })
        .expect("a hole");
    }
    map
}

fn lookups(c: &mut Criterion) {
    let small = map_of(1, 1);
    c.bench_function("lookup in a one-extent file", |b| {
        b.iter(|| black_box(small.lookup(black_box(0))))
    });
    let big = map_of(EXTENTS, 2);
    // A fixed sequence of pseudo-random blocks (xorshift), half of them
    // holes.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let keys: Vec<u64> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (2 * EXTENTS)) * BLOCK
        })
        .collect();
    let end = 2 * EXTENTS * BLOCK;
    c.bench_function("lookup at the end of 1M extents", |b| {
        b.iter(|| black_box(big.lookup(black_box(end))))
    });
    c.bench_function("lookup at random in 1M extents", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % keys.len();
            match big.lookup(keys[i]) {
                Lookup::Extent(e) => black_box(e.addr),
                Lookup::Hole { end } => black_box(end.unwrap_or(0)),
            }
        })
    });
}

fn inserts(c: &mut Criterion) {
    let mut big = map_of(EXTENTS, 2);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    c.bench_function(
        "insert into a random hole of 1M extents, and punch it",
        |b| {
            b.iter(|| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let hole = (x % EXTENTS) * 2 + 1;
                big.insert(Extent {
                    file_off: hole * BLOCK,
                    len: BLOCK,
                    addr: (4 << 40) + hole * BLOCK,
                    state: ExtentState::Written,
                })
                .expect("a hole");
                black_box(big.remove_range(hole * BLOCK, BLOCK))
            })
        },
    );
}

criterion_group!(benches, lookups, inserts);
criterion_main!(benches);
