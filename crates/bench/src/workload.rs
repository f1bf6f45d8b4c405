//! The seed workloads: names (stable, used on the command line and in JSON),
//! I/O patterns, and what each needs from the device.

use crate::BenchError;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// Where successive I/Os land inside the data span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Uniformly random offsets aligned to [`IoPattern::align`].
    Random,
    /// Back to back from offset 0, wrapping at the end of the span; threads
    /// that make one queue depth take turns in the sequence
    /// ([`Stream::interleaved`]).
    Sequential,
}

/// What a workload needs from the device it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceNeed {
    /// Any device; the default bed uses the 4 KiB-sector RAM device (zram).
    Any,
    /// Logical blocks small enough for the I/O size (2 KiB writes need
    /// sectors of at most 2 KiB): the default bed uses the 512-byte loop
    /// device.
    SmallSectors,
    /// A volatile write cache, so that DSYNC has flushes to save: the
    /// default bed uses the loop device.
    VolatileCache,
    /// Speed that does not depend on the bytes written, so targets writing
    /// different data compare: the default bed uses the loop device (on
    /// tmpfs). zram compresses every page, at a cost that varies several
    /// times over with the data (measured: fio's default buffers took 5.7
    /// µs a page to write back, random ones 1.8, a repeated pattern 0.4).
    DataIndependent,
}

/// A direct-I/O workload: the same pattern runs on every target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoPattern {
    pub op: Op,
    pub order: Order,
    /// Smallest I/O size in bytes.
    pub min_size: u64,
    /// Largest I/O size in bytes; sizes are `min_size + k * size_step`.
    pub max_size: u64,
    pub size_step: u64,
    /// Offsets are multiples of this.
    pub align: u64,
    /// I/Os in flight at once. With the synchronous backend: this many
    /// threads, each with one synchronous I/O outstanding (fio's psync
    /// with numjobs = queue_depth).
    pub queue_depth: usize,
    /// Writes are O_DSYNC: durable when they return.
    pub dsync: bool,
    /// Size of the preallocated, fully written file (and of the raw device
    /// range) the I/O lands in; less on a small device.
    pub span: u64,
    pub needs: DeviceNeed,
}

impl IoPattern {
    /// fio's name for the pattern's `rw=`.
    pub fn fio_rw(&self) -> &'static str {
        match (self.op, self.order) {
            (Op::Read, Order::Random) => "randread",
            (Op::Read, Order::Sequential) => "read",
            (Op::Write, Order::Random) => "randwrite",
            (Op::Write, Order::Sequential) => "write",
        }
    }

    /// How many I/O sizes the pattern draws from.
    pub fn size_choices(&self) -> u64 {
        (self.max_size - self.min_size) / self.size_step + 1
    }
}

/// What kind of workload a name stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Direct(IoPattern),
    /// Buffered I/O (non-direct handles, the kernel's page cache): each of
    /// its [`BufferedSpec::variants`] is measured on every target.
    Buffered(BufferedSpec),
    /// One fio job run on every target, iomapfs through the fio engine.
    Fio(FioJob),
    /// One fio job through the FUSE mount of iomapfs and on kernel XFS
    /// (see `mount_rows`).
    Mount(MountJob),
}

impl Kind {
    /// What the workload needs from the device. Buffered workloads compare
    /// iomapfs writing the bench's data with fio writing its own, so they
    /// need a device indifferent to the data.
    pub fn needs(&self) -> DeviceNeed {
        match self {
            Kind::Direct(p) => p.needs,
            Kind::Buffered(_) => DeviceNeed::DataIndependent,
            Kind::Fio(job) => job.pattern.needs,
            // fio writes the same data through the mount and on XFS.
            Kind::Mount(_) => DeviceNeed::Any,
        }
    }
}

/// fio's I/O engine on the raw device, XFS and ext4 (iomapfs always runs
/// the fio engine `iomapfs`, whose queue takes `iodepth` above 1 and whose
/// `iodepth=1` is synchronous calls, as psync).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FioEngine {
    IoUring,
    Psync,
}

impl FioEngine {
    pub fn name(self) -> &'static str {
        match self {
            FioEngine::IoUring => "io_uring",
            FioEngine::Psync => "psync",
        }
    }
}

/// A fio row: one of the kernel threads' fio job lines, scaled to this
/// machine, run as one fio job against every target on the same device.
/// `pattern` gives the I/O (operation, order, sizes, `blockalign`,
/// `sync=dsync`, file size, device) and `pattern.queue_depth` is fio's
/// `iodepth` per job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FioJob {
    /// The seed workload this row is the fio job of.
    pub seed: &'static str,
    pub pattern: IoPattern,
    /// fio jobs (threads, `--thread`) sharing the file.
    pub numjobs: usize,
    pub engine: FioEngine,
}

/// fio jobs of the 2 KiB overwrite line: the threads ran one job per core
/// on large machines; this one has 2 cores.
pub const FIO_SUBBLOCK_JOBS: usize = 2;

/// `pattern` at another queue depth.
const fn at_depth(mut pattern: IoPattern, depth: usize) -> IoPattern {
    pattern.queue_depth = depth;
    pattern
}
/// A mount row: one fio job (`numjobs=1`) run on a file through the FUSE
/// mount of iomapfs and on a file of kernel XFS, on the same device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountJob {
    pub op: Op,
    pub order: Order,
    /// fio's `bs`.
    pub io_size: u64,
    /// O_DIRECT (fio `direct=1`); else through the caches (iomapfs's folio
    /// cache behind the mount, the page cache on XFS).
    pub direct: bool,
    /// fio's `iodepth`: 1 is `ioengine=psync`, more is `ioengine=io_uring`.
    pub iodepth: usize,
    /// The file's size.
    pub span: u64,
}

/// Workload names of the mount rows start with this; the name alone
/// selects them all.
pub const MOUNT_GROUP: &str = "mount";

/// Size of the file buffered workloads read and write, and of each pass
/// of a buffered workload (less on a small device). Small enough that the
/// file, a fresh copy of it and the kernel's page cache of both fit
/// comfortably in the RAM bed (512 MiB zram), and that the iomapfs cache
/// holds it whole with its default size for warm reads to be warm (the
/// device req/IO column shows whether it did: 0 reads per I/O).
pub const BUFFERED_SPAN: u64 = 64 * MIB;

/// A buffered workload: one thread of synchronous, sequential I/O of one
/// size through the cache, in passes over one file (fio `ioengine=psync`,
/// `numjobs=1`, `rw=read` or `rw=write`, `direct=0`, as in the
/// ext4-iomap thread's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferedSpec {
    pub op: Op,
    pub io_size: u64,
    /// The file's size: a pass reads or writes it from offset 0 to here.
    pub span: u64,
}

impl BufferedSpec {
    /// The variants measured, in run order.
    pub fn variants(&self) -> &'static [BufferedVariant] {
        match self.op {
            Op::Read => &BufferedVariant::ALL[..2],
            Op::Write => &BufferedVariant::ALL[2..],
        }
    }

    /// I/Os in one pass over a `span`-byte file (at least one).
    pub fn ios_per_pass(&self, span: u64) -> u64 {
        (span / self.io_size).max(1)
    }
}

/// How a buffered workload's window is arranged. Every variant is passes
/// of sequential I/O over the file from offset 0; they differ in what
/// happens between passes (untimed) and at the end of each (timed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferedVariant {
    /// Reads from the cache: the file is read once before the window, then
    /// read again and again (no work between passes).
    Warm,
    /// Reads from the device: before every pass, untimed, the cache is
    /// emptied (iomapfs: `Volume::drop_caches`, the memory kept for new
    /// folios; kernel:
    /// fio `invalidate=1`, `POSIX_FADV_DONTNEED` of the file at each open,
    /// one per loop). Sequential, so read-ahead is part of the figure.
    Cold,
    /// Writes over an existing, fully written file, pass after pass.
    /// `fsync`: each pass, and a pass cut by the end of the window, ends
    /// with an fsync inside the window, so every byte written in the window
    /// is also written back (and made durable) in it.
    Overwrite { fsync: bool },
    /// Writes appending to a fresh, empty file: before every pass, untimed,
    /// the previous file is unlinked and a new one created (fio
    /// `unlink_each_loop=1`, `fallocate=none`). `fsync` as for `Overwrite`.
    Alloc { fsync: bool },
}

impl BufferedVariant {
    /// Every variant: the read ones, then the write ones.
    pub const ALL: [BufferedVariant; 6] = [
        BufferedVariant::Warm,
        BufferedVariant::Cold,
        BufferedVariant::Overwrite { fsync: false },
        BufferedVariant::Overwrite { fsync: true },
        BufferedVariant::Alloc { fsync: false },
        BufferedVariant::Alloc { fsync: true },
    ];

    /// Stable name, in results and the table.
    pub fn name(self) -> &'static str {
        match self {
            BufferedVariant::Warm => "warm",
            BufferedVariant::Cold => "cold",
            BufferedVariant::Overwrite { fsync: false } => "overwrite",
            BufferedVariant::Overwrite { fsync: true } => "overwrite+fsync",
            BufferedVariant::Alloc { fsync: false } => "alloc",
            BufferedVariant::Alloc { fsync: true } => "alloc+fsync",
        }
    }

    /// Every pass ends with an fsync inside the window: the window includes
    /// writing back all it wrote.
    pub fn includes_writeback(self) -> bool {
        matches!(
            self,
            BufferedVariant::Overwrite { fsync: true } | BufferedVariant::Alloc { fsync: true }
        )
    }

    /// One line for `--help`.
    pub fn summary(self) -> &'static str {
        match self {
            BufferedVariant::Warm => "from the cache: the file read once before the window",
            BufferedVariant::Cold => {
                "from the device: the cache emptied before every pass (iomapfs drop_caches, \
                 fio invalidate=1)"
            }
            BufferedVariant::Overwrite { fsync: false } => {
                "over the written file, no sync: what the writer waits for"
            }
            BufferedVariant::Overwrite { fsync: true } => {
                "over the written file, fsync ending every pass, timed: writeback included"
            }
            BufferedVariant::Alloc { fsync: false } => {
                "appending to a fresh file (new every pass), no sync"
            }
            BufferedVariant::Alloc { fsync: true } => {
                "appending to a fresh file, fsync ending every pass, timed: writeback and \
                 allocation commit included"
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    pub name: &'static str,
    /// One line for `--help` and the report.
    pub summary: &'static str,
    pub kind: Kind,
}

/// Writer threads of the sub-block overwrite workload ("several writers").
pub const SUBBLOCK_WRITERS: usize = 8;

const RANDREAD_4K_QD1: IoPattern = IoPattern {
    op: Op::Read,
    order: Order::Random,
    min_size: 4 * KIB,
    max_size: 4 * KIB,
    size_step: 4 * KIB,
    align: 4 * KIB,
    queue_depth: 1,
    dsync: false,
    span: 256 * MIB,
    needs: DeviceNeed::Any,
};

const RANDREAD_4K_QD32: IoPattern = IoPattern {
    op: Op::Read,
    order: Order::Random,
    min_size: 4 * KIB,
    max_size: 4 * KIB,
    size_step: 4 * KIB,
    align: 4 * KIB,
    queue_depth: 32,
    dsync: false,
    span: 256 * MIB,
    needs: DeviceNeed::Any,
};

const OVERWRITE_2K: IoPattern = IoPattern {
    op: Op::Write,
    order: Order::Random,
    min_size: 2 * KIB,
    max_size: 2 * KIB,
    size_step: 2 * KIB,
    align: 2 * KIB,
    queue_depth: SUBBLOCK_WRITERS,
    dsync: false,
    span: 128 * MIB,
    needs: DeviceNeed::SmallSectors,
};

const DSYNC_OVERWRITE_4K: IoPattern = IoPattern {
    op: Op::Write,
    order: Order::Sequential,
    min_size: 4 * KIB,
    max_size: 4 * KIB,
    size_step: 4 * KIB,
    align: 4 * KIB,
    queue_depth: 1,
    dsync: true,
    span: 32 * MIB,
    needs: DeviceNeed::VolatileCache,
};

const AIO_OVERWRITE_4K_16K_QD64: IoPattern = IoPattern {
    op: Op::Write,
    order: Order::Random,
    min_size: 4 * KIB,
    max_size: 16 * KIB,
    size_step: 4 * KIB,
    align: 4 * KIB,
    queue_depth: 64,
    dsync: false,
    span: 256 * MIB,
    needs: DeviceNeed::Any,
};

/// Every workload, in run order.
pub const WORKLOADS: &[Workload] = &[
    Workload {
        name: "randread-4k-qd1",
        summary: "4 KiB random direct reads, queue depth 1",
        kind: Kind::Direct(RANDREAD_4K_QD1),
    },
    Workload {
        name: "randread-4k-qd32",
        summary: "4 KiB random direct reads, queue depth 32",
        kind: Kind::Direct(RANDREAD_4K_QD32),
    },
    Workload {
        name: "overwrite-2k-unaligned",
        summary: "2 KiB direct overwrites at 2 KiB offsets inside 4 KiB blocks, 8 writers",
        kind: Kind::Direct(OVERWRITE_2K),
    },
    Workload {
        name: "dsync-overwrite-4k",
        summary: "sequential 4 KiB O_DSYNC overwrites of a 32 MiB file (device requests per write)",
        kind: Kind::Direct(DSYNC_OVERWRITE_4K),
    },
    Workload {
        name: "aio-overwrite-4k..16k-qd64",
        summary: "random 4-16 KiB direct overwrites, queue depth 64 (completion latency)",
        kind: Kind::Direct(AIO_OVERWRITE_4K_16K_QD64),
    },
    Workload {
        name: "buffered-read-4k",
        summary: "4 KiB buffered sequential reads, 1 thread: warm, cold",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Read,
            io_size: 4 * KIB,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "buffered-read-64k",
        summary: "64 KiB buffered sequential reads, 1 thread: warm, cold",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Read,
            io_size: 64 * KIB,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "buffered-read-1m",
        summary: "1 MiB buffered sequential reads, 1 thread: warm, cold",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Read,
            io_size: MIB,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "buffered-write-4k",
        summary: "4 KiB buffered sequential writes, 1 thread: overwrite and alloc, with and without fsync",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Write,
            io_size: 4 * KIB,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "buffered-write-64k",
        summary: "64 KiB buffered sequential writes, 1 thread: overwrite and alloc, with and without fsync",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Write,
            io_size: 64 * KIB,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "buffered-write-1m",
        summary: "1 MiB buffered sequential writes, 1 thread: overwrite and alloc, with and without fsync",
        kind: Kind::Buffered(BufferedSpec {
            op: Op::Write,
            io_size: MIB,
            span: BUFFERED_SPAN,
        }),
    },
];

/// The fio rows, in run order: each direct seed workload as one fio job
/// line of the kernel threads (see [`FioJob`]).
pub const FIO_WORKLOADS: &[Workload] = &[
    Workload {
        name: "fio-randread-4k-qd1",
        summary: "fio: 4 KiB random direct reads, iodepth 1 (io_uring; iomapfs: its engine)",
        kind: Kind::Fio(FioJob {
            seed: "randread-4k-qd1",
            pattern: RANDREAD_4K_QD1,
            numjobs: 1,
            engine: FioEngine::IoUring,
        }),
    },
    Workload {
        name: "fio-randread-4k-qd32",
        summary: "fio: 4 KiB random direct reads, iodepth 32",
        kind: Kind::Fio(FioJob {
            seed: "randread-4k-qd32",
            pattern: RANDREAD_4K_QD32,
            numjobs: 1,
            engine: FioEngine::IoUring,
        }),
    },
    Workload {
        name: "fio-overwrite-2k-2jobs-qd256",
        summary: "fio: 2 KiB random direct overwrites, --overwrite=1 --thread --numjobs=2 \
                  --bs=2k --iodepth=256",
        kind: Kind::Fio(FioJob {
            seed: "overwrite-2k-unaligned",
            pattern: at_depth(OVERWRITE_2K, 256),
            numjobs: FIO_SUBBLOCK_JOBS,
            engine: FioEngine::IoUring,
        }),
    },
    Workload {
        name: "fio-dsync-overwrite-4k-psync",
        summary: "fio: sequential 4 KiB direct overwrites, sync=dsync, psync",
        kind: Kind::Fio(FioJob {
            seed: "dsync-overwrite-4k",
            pattern: DSYNC_OVERWRITE_4K,
            numjobs: 1,
            engine: FioEngine::Psync,
        }),
    },
    Workload {
        name: "fio-aio-overwrite-4k..16k-qd64",
        summary: "fio: random 4-16 KiB direct overwrites, iodepth 64",
        kind: Kind::Fio(FioJob {
            seed: "aio-overwrite-4k..16k-qd64",
            pattern: AIO_OVERWRITE_4K_16K_QD64,
            numjobs: 1,
            engine: FioEngine::IoUring,
        }),
    },
];

/// The mount rows, in run order (see [`MountJob`]).
pub const MOUNT_WORKLOADS: &[Workload] = &[
    Workload {
        name: "mount-randread-4k-qd1",
        summary: "through the FUSE mount vs XFS: 4 KiB random direct reads, fio psync",
        kind: Kind::Mount(MountJob {
            op: Op::Read,
            order: Order::Random,
            io_size: 4 * KIB,
            direct: true,
            iodepth: 1,
            span: 256 * MIB,
        }),
    },
    Workload {
        name: "mount-randread-4k-qd32",
        summary: "through the FUSE mount vs XFS: 4 KiB random direct reads, fio io_uring iodepth 32",
        kind: Kind::Mount(MountJob {
            op: Op::Read,
            order: Order::Random,
            io_size: 4 * KIB,
            direct: true,
            iodepth: 32,
            span: 256 * MIB,
        }),
    },
    Workload {
        name: "mount-read-1m",
        summary: "through the FUSE mount vs XFS: 1 MiB sequential direct reads, fio psync",
        kind: Kind::Mount(MountJob {
            op: Op::Read,
            order: Order::Sequential,
            io_size: MIB,
            direct: true,
            iodepth: 1,
            span: 256 * MIB,
        }),
    },
    Workload {
        name: "mount-write-1m",
        summary: "through the FUSE mount vs XFS: 1 MiB sequential direct overwrites, fio psync",
        kind: Kind::Mount(MountJob {
            op: Op::Write,
            order: Order::Sequential,
            io_size: MIB,
            direct: true,
            iodepth: 1,
            span: 256 * MIB,
        }),
    },
    Workload {
        name: "mount-buffered-randread-4k",
        summary: "through the FUSE mount vs XFS: 4 KiB random buffered reads of a cached 64 MiB file",
        kind: Kind::Mount(MountJob {
            op: Op::Read,
            order: Order::Random,
            io_size: 4 * KIB,
            direct: false,
            iodepth: 1,
            span: BUFFERED_SPAN,
        }),
    },
    Workload {
        name: "mount-buffered-randwrite-4k",
        summary: "through the FUSE mount vs XFS: 4 KiB random buffered overwrites of a 64 MiB file, no fsync",
        kind: Kind::Mount(MountJob {
            op: Op::Write,
            order: Order::Random,
            io_size: 4 * KIB,
            direct: false,
            iodepth: 1,
            span: BUFFERED_SPAN,
        }),
    },
];

/// Every workload: the seed workloads, the mount rows, then the fio rows.
pub fn all() -> impl Iterator<Item = &'static Workload> {
    WORKLOADS.iter().chain(MOUNT_WORKLOADS).chain(FIO_WORKLOADS)
}

/// The workloads named in `names` (all of them when empty), in run order,
/// each once. [`MOUNT_GROUP`] names every mount row.
pub fn select(names: &[String]) -> Result<Vec<&'static Workload>, BenchError> {
    if names.is_empty() {
        return Ok(all().collect());
    }
    let named = |w: &Workload, name: &str| {
        w.name == name || (name == MOUNT_GROUP && matches!(w.kind, Kind::Mount(_)))
    };
    for name in names {
        if !all().any(|w| named(w, name)) {
            return Err(BenchError::UnknownWorkload {
                name: name.clone(),
                known: all()
                    .map(|w| w.name.to_string())
                    .chain([MOUNT_GROUP.to_string()])
                    .collect(),
            });
        }
    }
    Ok(all()
        .filter(|w| names.iter().any(|n| named(w, n)))
        .collect())
}

/// The seeded generator of offsets, sizes and data (the workspace's one
/// SplitMix64): the same seed gives the same offsets on every target, so raw
/// and iomapfs see one I/O sequence.
pub use blockdev::rng::SplitMix64 as Rng;

/// The I/O stream of one thread: sizes and offsets inside `[0, span)`.
#[derive(Clone, Debug)]
pub struct Stream {
    pattern: IoPattern,
    span: u64,
    rng: Rng,
    next_seq: u64,
    /// Where a sequential stream starts (and starts again at the end of
    /// the span), and how many I/Os of the largest size it steps over:
    /// its lane among `stride` threads sharing one sequential pattern.
    lane_start: u64,
    stride: u64,
}

impl Stream {
    /// `thread` picks the seed. A sequential stream runs alone over the
    /// span (see [`Stream::interleaved`]).
    pub fn new(pattern: &IoPattern, span: u64, workload_seed: u64, thread: usize) -> Stream {
        Stream {
            pattern: *pattern,
            span,
            rng: Rng::new(workload_seed ^ (thread as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)),
            next_seq: 0,
            lane_start: 0,
            stride: 1,
        }
    }

    /// Thread `thread` of `threads` that run one sequential pattern
    /// together (queue depth made of threads): each takes every
    /// `threads`-th I/O of the sequence one thread would make, so
    /// together they read or write each block once per pass, not each
    /// once per thread. Random streams are left as they are.
    pub fn interleaved(mut self, thread: usize, threads: usize) -> Stream {
        let lanes_fit = (threads as u64).saturating_mul(self.pattern.max_size) <= self.span;
        if self.pattern.order == Order::Sequential && threads > 1 && lanes_fit {
            self.lane_start = thread as u64 * self.pattern.max_size;
            self.next_seq = self.lane_start;
            self.stride = threads as u64;
        }
        self
    }

    /// The next I/O: `(offset, len)`, always inside the span.
    pub fn next_io(&mut self) -> (u64, u64) {
        let p = &self.pattern;
        let len = if p.min_size == p.max_size {
            p.min_size
        } else {
            p.min_size + self.rng.below(p.size_choices()) * p.size_step
        };
        let offset = match p.order {
            Order::Random => {
                let slots = (self.span - len) / p.align + 1;
                self.rng.below(slots) * p.align
            }
            Order::Sequential => {
                if self.next_seq + len > self.span {
                    self.next_seq = self.lane_start;
                }
                let at = self.next_seq;
                self.next_seq += if self.stride > 1 {
                    p.max_size * self.stride
                } else {
                    len
                };
                at
            }
        };
        (offset, len)
    }
}

/// A seed per workload name, so each workload has its own fixed sequence.
pub fn seed_of(name: &str) -> u64 {
    // FNV-1a.
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_selection_keeps_run_order() {
        let every: Vec<&Workload> = all().collect();
        for (i, a) in every.iter().enumerate() {
            for b in &every[i + 1..] {
                assert_ne!(a.name, b.name);
            }
        }
        let picked = select(&["dsync-overwrite-4k".into(), "randread-4k-qd1".into()]).unwrap();
        let names: Vec<_> = picked.iter().map(|w| w.name).collect();
        assert_eq!(names, ["randread-4k-qd1", "dsync-overwrite-4k"]);
        let err = select(&["nope".into()]).unwrap_err().to_string();
        assert!(
            err.contains("nope") && err.contains("randread-4k-qd32"),
            "{err}"
        );
    }

    #[test]
    fn each_direct_seed_workload_has_one_fio_row_of_its_io() {
        let mut seeds = Vec::new();
        for w in FIO_WORKLOADS {
            let Kind::Fio(job) = w.kind else {
                panic!("{} in FIO_WORKLOADS is not a fio row", w.name)
            };
            assert!(w.name.starts_with("fio-"), "{}", w.name);
            let seed = select(&[job.seed.into()]).unwrap()[0];
            let Kind::Direct(p) = seed.kind else {
                panic!("{}: seed {} is not direct", w.name, job.seed)
            };
            // The same I/O; only fio's queue depth may differ.
            let mut same = job.pattern;
            same.queue_depth = p.queue_depth;
            assert_eq!(same, p, "{} vs {}", w.name, job.seed);
            seeds.push(job.seed);
        }
        let direct: Vec<&str> = WORKLOADS
            .iter()
            .filter(|w| matches!(w.kind, Kind::Direct(_)))
            .map(|w| w.name)
            .collect();
        assert_eq!(seeds, direct);
        // The 2 KiB line: several jobs at deep queue depth.
        let Kind::Fio(sub) = select(&["fio-overwrite-2k-2jobs-qd256".into()]).unwrap()[0].kind
        else {
            panic!()
        };
        assert_eq!((sub.numjobs, sub.pattern.queue_depth), (2, 256));
        // Selecting every workload includes the fio rows, after the rest.
        let names: Vec<&str> = select(&[]).unwrap().iter().map(|w| w.name).collect();
        assert_eq!(names.last(), FIO_WORKLOADS.last().map(|w| w.name).as_ref());
    }

    #[test]
    fn buffered_workloads_cover_every_size_and_variant_once() {
        let mut seen = Vec::new();
        for w in WORKLOADS {
            let Kind::Buffered(spec) = w.kind else {
                continue;
            };
            assert_eq!(w.kind.needs(), DeviceNeed::DataIndependent);
            let op = match spec.op {
                Op::Read => "read",
                Op::Write => "write",
            };
            let size = match spec.io_size {
                4096 => "4k",
                65536 => "64k",
                1048576 => "1m",
                other => panic!("{}: size {other}", w.name),
            };
            assert_eq!(w.name, format!("buffered-{op}-{size}"));
            assert_eq!(spec.span, BUFFERED_SPAN);
            assert_eq!(spec.ios_per_pass(spec.span) * spec.io_size, spec.span);
            for v in spec.variants() {
                assert_eq!(v.includes_writeback(), v.name().ends_with("+fsync"));
                // Reads have the read variants, writes the write ones.
                let is_read = matches!(v, BufferedVariant::Warm | BufferedVariant::Cold);
                assert_eq!(is_read, spec.op == Op::Read, "{} {}", w.name, v.name());
                seen.push(format!("{} {}", w.name, v.name()));
            }
        }
        // 3 sizes × (2 read + 4 write variants), no name twice.
        assert_eq!(seen.len(), 18);
        let mut names: Vec<&str> = BufferedVariant::ALL.iter().map(|v| v.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), BufferedVariant::ALL.len());
    }

    /// Threads that share one sequential pattern take turns: over a pass
    /// each block of the span comes once, whatever the thread count, and
    /// a span too small for a lane each leaves every thread alone.
    #[test]
    fn interleaved_sequential_streams_cover_the_span_once_a_pass() {
        let p = IoPattern {
            op: Op::Read,
            order: Order::Sequential,
            min_size: MIB,
            max_size: MIB,
            size_step: MIB,
            align: MIB,
            queue_depth: 3,
            dsync: false,
            span: 12 * MIB,
            needs: DeviceNeed::Any,
        };
        for threads in [1, 2, 3, 4] {
            let mut offsets: Vec<u64> = (0..threads)
                .flat_map(|t| {
                    let mut s = Stream::new(&p, 12 * MIB, 1, t).interleaved(t, threads);
                    (0..12 / threads).map(move |_| s.next_io().0)
                })
                .collect();
            offsets.sort_unstable();
            let pass: Vec<u64> = (0..12).map(|k| k * MIB).collect();
            assert_eq!(offsets, pass, "{threads} threads");
        }
        // Thread 1 of 2 in its second pass starts on its own lane again.
        let mut s = Stream::new(&p, 12 * MIB, 1, 1).interleaved(1, 2);
        let firsts: Vec<u64> = (0..7).map(|_| s.next_io().0 / MIB).collect();
        assert_eq!(firsts, [1, 3, 5, 7, 9, 11, 1]);
        // No room for a lane each: alone, from 0.
        let mut s = Stream::new(&p, 2 * MIB, 1, 2).interleaved(2, 3);
        assert_eq!((s.next_io().0, s.next_io().0, s.next_io().0), (0, MIB, 0));
    }

    #[test]
    fn streams_stay_inside_the_span_and_aligned() {
        for w in WORKLOADS {
            let Kind::Direct(p) = w.kind else { continue };
            let span = 8 * MIB;
            let mut s = Stream::new(&p, span, seed_of(w.name), 3);
            for _ in 0..10_000 {
                let (off, len) = s.next_io();
                assert!(off + len <= span, "{}: {off}+{len}", w.name);
                assert_eq!(off % p.align, 0);
                assert!(len >= p.min_size && len <= p.max_size && len % p.size_step == 0);
            }
        }
    }

    #[test]
    fn unaligned_workload_hits_both_halves_of_blocks() {
        let Kind::Direct(p) = select(&["overwrite-2k-unaligned".into()]).unwrap()[0].kind else {
            panic!()
        };
        let mut s = Stream::new(&p, MIB, 1, 0);
        let mut halves = [0u32; 2];
        for _ in 0..1000 {
            let (off, _) = s.next_io();
            halves[((off % 4096) / 2048) as usize] += 1;
        }
        assert!(halves[0] > 300 && halves[1] > 300, "{halves:?}");
    }
}
