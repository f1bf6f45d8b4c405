//! Request counters, kept by every backend.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of requests issued to a device.
///
/// Every request of every thread increments them, so they sit alone on
/// their cache lines (128 bytes: a line and its adjacent-line prefetch
/// partner). Without that, a device's capabilities, read on every I/O, shared
/// a line with them, and each increment on one core cost the next I/O on
/// another a cache miss (measured: the largest single cost of iomapfs's
/// 4 KiB reads at queue depth 32 on zram).
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct DeviceCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    fua_writes: AtomicU64,
    flushes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// A snapshot of [`DeviceCounters`]. `writes` counts every write, FUA or not;
/// `fua_writes` counts the subset sent with FUA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub reads: u64,
    pub writes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl DeviceCounters {
    pub fn record_read(&self, bytes: usize) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn record_write(&self, bytes: usize, fua: bool) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        if fua {
            self.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
        self.bytes_written
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn record_flush(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> RequestCounts {
        RequestCounts {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            fua_writes: self.fua_writes.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
        }
    }
}

impl RequestCounts {
    /// Counts issued between `earlier` and `self`.
    pub fn since(&self, earlier: &RequestCounts) -> RequestCounts {
        RequestCounts {
            reads: self.reads - earlier.reads,
            writes: self.writes - earlier.writes,
            fua_writes: self.fua_writes - earlier.fua_writes,
            flushes: self.flushes - earlier.flushes,
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
        }
    }
}
