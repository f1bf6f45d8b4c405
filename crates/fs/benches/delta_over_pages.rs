//! A delta laid over the chunks of extent pages at mount
//! (`checkpoint::apply_delta_over_pages`): its cost should follow the
//! delta, not the number of paged files times the files it removes, nor
//! the chunks of a file times the runs of chunks its spans reach.
//! Run: `cargo bench -p iomapfs-fs --bench delta_over_pages`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use iomapfs_fs::checkpoint::apply_delta_over_pages;
use iomapfs_fs::codec::PageRef;
use iomapfs_fs::page_chunks::{PageChunk, PagedMaps};
use iomapfs_fs::types::{
    Extent, ExtentState, FileKind, InodeAttrs, InodeDelta, InodeImage, MetaDelta, MetaImage,
    Timestamp,
};

const BLOCK: u64 = 4096;
/// Paged files a delta removes, all of them.
const FILES: u64 = 20_000;
/// Chunks of the one large file, and extents in each.
const CHUNKS: u64 = 20_000;
const PER_CHUNK: u64 = 4;

fn inode(ino: u64) -> InodeImage {
    InodeImage {
        ino,
        kind: FileKind::Regular,
        nlink: 1,
        size: 0,
        attrs: InodeAttrs::new(0o100644, 0, 0, Timestamp::from_ns(1)),
        extents: Vec::new(),
        entries: Vec::new(),
        xattrs: Vec::new(),
        target: Vec::new(),
    }
}

/// One-block extent at block `key`.
fn ext(key: u64) -> Extent {
    Extent {
        file_off: key * BLOCK,
        len: BLOCK,
        addr: (1 << 30) + key * BLOCK,
        state: ExtentState::Written,
    }
}

fn chunk(first: u64, n: u64) -> PageChunk {
    let extents: Vec<Extent> = (0..n).map(|i| ext(2 * (first + i))).collect();
    let page = PageRef {
        addr: first * BLOCK,
        crc: 0,
        count: n as u32,
        first_key: extents[0].file_off,
        allocated: n * BLOCK,
    };
    PageChunk {
        extents,
        page: Some(page),
        starts_run: false,
    }
}

fn image(inos: impl Iterator<Item = u64>, next_ino: u64) -> MetaImage {
    MetaImage {
        next_ino,
        inodes: inos.map(inode).collect(),
    }
}

fn delta_over_pages(c: &mut Criterion) {
    let mut group = c.benchmark_group("delta over pages");
    group.sample_size(10);

    // Every paged file removed (rm -r of a tree of small files).
    let img = image(2..2 + FILES, 2 + FILES);
    let mut paged = PagedMaps::default();
    for ino in 2..2 + FILES {
        paged.push_file(ino, vec![chunk(ino, 1)]).unwrap();
    }
    let removing = MetaDelta {
        next_ino: 2 + FILES,
        removed: (2..2 + FILES).collect(),
        changed: Vec::new(),
    };
    group.bench_function("remove 20k paged files", |b| {
        b.iter_batched(
            || (img.clone(), paged.clone()),
            |(mut img, mut paged)| {
                apply_delta_over_pages(&mut img, &mut paged, &removing).unwrap();
                (img, paged)
            },
            BatchSize::LargeInput,
        )
    });

    // One file of 20k chunks; a span empties every other chunk.
    let ino = 2;
    let img = image(std::iter::once(ino), ino + 1);
    let mut paged = PagedMaps::default();
    let chunks = (0..CHUNKS)
        .map(|j| chunk(j * PER_CHUNK, PER_CHUNK))
        .collect();
    paged.push_file(ino, chunks).unwrap();
    let spans = (0..CHUNKS)
        .step_by(2)
        .map(|j| {
            let first = 2 * j * PER_CHUNK * BLOCK;
            (first, first + 2 * PER_CHUNK * BLOCK)
        })
        .collect();
    let emptying = MetaDelta {
        next_ino: ino + 1,
        removed: Vec::new(),
        changed: vec![InodeDelta {
            spans,
            inode: inode(ino),
        }],
    };
    group.bench_function("empty every other of 20k chunks", |b| {
        b.iter_batched(
            || (img.clone(), paged.clone()),
            |(mut img, mut paged)| {
                apply_delta_over_pages(&mut img, &mut paged, &emptying).unwrap();
                (img, paged)
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, delta_over_pages);
criterion_main!(benches);
