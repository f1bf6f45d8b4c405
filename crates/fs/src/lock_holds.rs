//! The longest times background work held the metadata lock exclusive,
//! per place: how long a read or write of any file can have waited behind
//! a checkpoint or the evictor of extent chunks (issue 13: "no I/O waits
//! for a checkpoint"). Measured where the lock is held, because a read's
//! latency on a loaded machine mixes that wait with preemption, which on
//! two shared CPUs reaches milliseconds by itself.
//!
//! Only background work's holds are timed (a few per checkpoint or
//! eviction step): the hot paths take the lock without a clock read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long background work holds the metadata lock exclusive at a time
/// when it has much to do (a checkpoint giving space back, the evictor of
/// extent chunks): about a 4 KiB read's p99 in the metadata-scale bench,
/// so a read waits at most that for it. Timed, not counted: a range given
/// back costs from a tenth of a microsecond to 15 (the free-space maps of
/// a million ranges, out of cache), and 2048 ranges per hold held readers
/// up to 2.7 ms.
pub(crate) const LOCK_HOLD_STEP: Duration = Duration::from_micros(20);

/// Where background work holds the metadata lock exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HoldSite {
    /// A checkpoint takes its snapshot (and logs write times still in core).
    CheckpointSnapshot,
    /// A durable checkpoint marks what it covers committed.
    CheckpointInstall,
    /// One bounded step of giving back the space a checkpoint freed.
    CheckpointReleaseStep,
    /// One bounded step of the evictor of extent chunks.
    EvictionStep,
}

const SITES: usize = 4;

impl HoldSite {
    fn index(self) -> usize {
        match self {
            HoldSite::CheckpointSnapshot => 0,
            HoldSite::CheckpointInstall => 1,
            HoldSite::CheckpointReleaseStep => 2,
            HoldSite::EvictionStep => 3,
        }
    }
}

/// The longest hold seen at each [`HoldSite`] since mount or the last
/// [`LockHolds::take`].
#[derive(Default)]
pub(crate) struct LockHolds {
    longest_ns: [AtomicU64; SITES],
    holds: [AtomicU64; SITES],
}

impl LockHolds {
    /// Records a hold at `site` that began at `since` and ends now (call it
    /// just before the lock is released).
    pub(crate) fn record(&self, site: HoldSite, since: Instant) {
        let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.longest_ns[site.index()].fetch_max(ns, Ordering::Relaxed);
        self.holds[site.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The longest holds so far, and starts over.
    pub(crate) fn take(&self) -> LongestLockHolds {
        let take = |site: HoldSite| self.longest_ns[site.index()].swap(0, Ordering::Relaxed);
        LongestLockHolds {
            checkpoint_release_steps: self.holds[HoldSite::CheckpointReleaseStep.index()]
                .swap(0, Ordering::Relaxed),
            eviction_steps: self.holds[HoldSite::EvictionStep.index()].swap(0, Ordering::Relaxed),
            checkpoint_snapshot_ns: take(HoldSite::CheckpointSnapshot),
            checkpoint_install_ns: take(HoldSite::CheckpointInstall),
            checkpoint_release_step_ns: take(HoldSite::CheckpointReleaseStep),
            eviction_step_ns: take(HoldSite::EvictionStep),
        }
    }
}

/// The longest times background work held the metadata lock exclusive
/// (every read and write of every file waits while it is held), by place,
/// in nanoseconds; 0 where it was not held. See [`crate::Volume::take_longest_lock_holds`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongestLockHolds {
    /// A checkpoint's snapshot (O(1) in the metadata's size).
    pub checkpoint_snapshot_ns: u64,
    /// A durable checkpoint marking what it covers committed.
    pub checkpoint_install_ns: u64,
    /// One bounded step of giving back the space a checkpoint freed (the
    /// replaced base's pages and spill extents, the ranges its records
    /// freed).
    pub checkpoint_release_step_ns: u64,
    /// How many such steps there were.
    pub checkpoint_release_steps: u64,
    /// One bounded step of the evictor of extent chunks.
    pub eviction_step_ns: u64,
    /// How many such steps there were.
    pub eviction_steps: u64,
}

impl LongestLockHolds {
    /// The longest of a checkpoint's holds.
    pub fn checkpoint_ns(&self) -> u64 {
        self.checkpoint_snapshot_ns
            .max(self.checkpoint_install_ns)
            .max(self.checkpoint_release_step_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_longest_hold_per_site_until_taken() {
        let holds = LockHolds::default();
        let long_ago = Instant::now() - std::time::Duration::from_millis(5);
        holds.record(HoldSite::CheckpointInstall, long_ago);
        holds.record(HoldSite::CheckpointInstall, Instant::now());
        holds.record(HoldSite::CheckpointReleaseStep, Instant::now());
        let taken = holds.take();
        assert_eq!(taken.checkpoint_release_steps, 1);
        assert!(taken.checkpoint_install_ns >= 5_000_000, "{taken:?}");
        assert_eq!(taken.checkpoint_snapshot_ns, 0);
        assert_eq!(taken.checkpoint_ns(), taken.checkpoint_install_ns);
        assert_eq!(holds.take(), LongestLockHolds::default());
    }
}
