//! Free space while mount's scan rebuilds it.
//!
//! Free space is not stored on disk (see [`crate::alloc`]): it is the data
//! area minus every extent, spill extent and extent page, which at 10M
//! extents takes about a second to enumerate. Mount does not wait for it:
//! it hands a snapshot of what the scan needs ([`ScanInput`]: the maps are
//! copy-on-write; only their cold segments' page lists are copied, so
//! that the live maps' loads stay out of it) to a background thread and
//! returns. Until the
//! scan installs the allocator, [`FreeSpace`] is `Scanning`:
//!
//! - nothing allocates, and nothing reads a free-byte count: those calls
//!   get [`Error::FreeSpacePending`] under the metadata lock, before they
//!   change anything, and their caller drops the lock, waits on the
//!   [`FreeSpaceGate`] and retries ([`crate::mount_state::VolumeInner`]'s
//!   `wait_free_space`). The install takes the metadata lock, so a waiter
//!   that kept it would deadlock; none does. After a clean unmount that
//!   left a free-space hint, allocations and counts use its [`Reserve`]
//!   instead, and only what that cannot satisfy waits (ENOSPC from it is
//!   taken for "pending"); checkpoints, which allocate pages, still wait.
//!   After a crash, the hint of the checkpoint record mount loaded, less
//!   what journal replay placed, stands in for it (see
//!   `mount::load_unscanned`).
//! - frees (punch, truncate, unlink, space replay freed, a checkpoint's
//!   released busy space, spill extents and pages) are recorded in order
//!   and applied to the scanned allocator at install. Nothing was
//!   allocated since the snapshot, so each freed range was used in it: the
//!   result is the allocator a synchronous mount would have after the same
//!   calls, each free applied exactly once.
//! - reads and overwrites of allocated space need no allocator and never
//!   wait.
//!
//! A scan that fails (an overlap: corruption; with lazy maps, a device
//! error reading a page) leaves `Failed`: every allocation gets the scan's
//! error again, frees are dropped (nothing will allocate on this mount),
//! reads go on, and `Volume::mount_warnings` names it.
//!
//! If the scan thread is stopped before it installs (the last `Volume`
//! handle dropped while a `File` stays open), the next caller that waits
//! runs the scan itself, so a handle that outlives its volume can still
//! allocate.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::alloc::Allocator;
use crate::checkpoint::SpillExtent;
use crate::state::MetaState;
use crate::superblock::{Superblock, CHECKPOINT_SLOTS, FREE_HINT_MAX};
use crate::{Error, Result};

/// The allocator of a mounted volume, or what stands in for it while the
/// scan runs.
#[derive(Debug)]
pub(crate) enum FreeSpace {
    /// Frees since mount, in call order, for the allocator the scan builds;
    /// and the reserve, if the clean unmount left a hint ([`Reserve`]).
    Scanning(Vec<Deferred>, Option<Reserve>),
    Ready(Allocator),
    Failed(ScanFailure),
}

/// What allocates while the scan runs: an allocator whose only free
/// space is a free-space hint. After a clean unmount, the superblock's:
/// the largest free ranges when that session ended; the mark names the
/// newest checkpoint, so no journal record came after it, and those
/// ranges are free in the state mount loaded. Otherwise (a crash), the
/// hint the loaded checkpoint record carries, less every range journal
/// replay placed after it (`mount::load_unscanned` says why the rest is
/// free). Frees made meanwhile are only recorded (as
/// without a reserve), so it hands out nothing but hint space; its counts
/// are a lower bound of the real ones, and a call it cannot satisfy waits
/// for the scan ([`FreeSpace::waits_for_scan`]). At install, what
/// it handed out is claimed in the scanned allocator before the recorded
/// frees: a claim the scan finds used means the hint lied (damage the
/// crc missed, or forgery), and fails the install like a scan that found
/// an overlap.
#[derive(Debug)]
pub(crate) struct Reserve {
    hint: Vec<(u64, u64)>,
    alloc: Allocator,
}

impl Reserve {
    /// The reserve of `hint` in `sb`'s data area, or `None` if the hint
    /// is empty or not a set of disjoint, block-aligned ranges inside the
    /// data area that no slot's spill extents or extent pages
    /// (`metadata`) touch: then the mount waits for its scan as without
    /// one.
    pub(crate) fn of_hint(
        sb: &Superblock,
        hint: &[(u64, u64)],
        metadata: &[(u64, u64)],
    ) -> Option<Reserve> {
        if hint.is_empty() {
            return None;
        }
        let data = &sb.layout.data;
        let bs = u64::from(sb.layout.block_size);
        let mut sorted = hint.to_vec();
        sorted.sort_unstable();
        let mut used = Vec::with_capacity(sorted.len() + 1);
        let mut cursor = data.start;
        for &(addr, len) in &sorted {
            let end = addr.checked_add(len)?;
            if len == 0
                || addr % bs != 0
                || len % bs != 0
                || addr < cursor
                || end > data.start + data.len
            {
                return None;
            }
            if metadata.iter().any(|&(m, l)| m < end && addr < m + l) {
                return None;
            }
            if addr > cursor {
                used.push((cursor, addr - cursor));
            }
            cursor = end;
        }
        if cursor < data.start + data.len {
            used.push((cursor, data.start + data.len - cursor));
        }
        let alloc = Allocator::with_used(data.start, data.len, sb.layout.block_size, &used).ok()?;
        Some(Reserve {
            hint: sorted,
            alloc,
        })
    }

    /// The hint ranges it handed out: the hint less what is still free in
    /// it (frees are not applied to it, so nothing came back).
    fn handed_out(&self) -> Vec<(u64, u64)> {
        let free = self.alloc.free_extents();
        let mut out = Vec::new();
        for &(addr, len) in &self.hint {
            let end = addr + len;
            let mut cursor = addr;
            for &(f, fl) in free.iter().filter(|&&(f, fl)| f < end && addr < f + fl) {
                if f > cursor {
                    out.push((cursor, f - cursor));
                }
                cursor = cursor.max(f + fl);
            }
            if cursor < end {
                out.push((cursor, end - cursor));
            }
        }
        out
    }
}

/// `hint` less every byte of `taken` (in any order, overlapping or not),
/// largest first (the lowest address among equals), at most
/// [`FREE_HINT_MAX`] ranges: a hint with what is no longer free in it
/// cut out.
pub(crate) fn hint_without(hint: &[(u64, u64)], taken: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut taken: Vec<(u64, u64)> = taken.iter().copied().filter(|&(_, l)| l > 0).collect();
    taken.sort_unstable();
    // Coalesced, so that their ends are sorted too.
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(taken.len());
    for (addr, len) in taken {
        let end = addr.saturating_add(len);
        match merged.last_mut() {
            Some((_, last_end)) if addr <= *last_end => *last_end = (*last_end).max(end),
            _ => merged.push((addr, end)),
        }
    }
    let mut left = Vec::new();
    for &(addr, len) in hint {
        let end = addr.saturating_add(len);
        let mut cursor = addr;
        let first = merged.partition_point(|&(_, e)| e <= addr);
        for &(t, t_end) in merged[first..].iter().take_while(|&&(t, _)| t < end) {
            if t > cursor {
                left.push((cursor, t - cursor));
            }
            cursor = cursor.max(t_end);
        }
        if cursor < end {
            left.push((cursor, end - cursor));
        }
    }
    left.sort_unstable_by_key(|&(addr, len)| (std::cmp::Reverse(len), addr));
    left.truncate(FREE_HINT_MAX);
    left
}

/// A call on free space made while the scan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deferred {
    Free { addr: u64, len: u64, seq: u64 },
    FreeNow { addr: u64, len: u64 },
    HoldBusy { addr: u64, len: u64, seq: u64 },
    ReleaseBusy { up_to_seq: u64 },
}

/// Why the scan did not install an allocator: enough to give every
/// allocation the same typed error (a [`Error`] is not `Clone`).
#[derive(Clone, Debug)]
pub(crate) enum ScanFailure {
    Corrupt {
        what: &'static str,
        offset: u64,
        reason: String,
    },
    Other(String),
}

impl ScanFailure {
    pub(crate) fn of(err: &Error) -> ScanFailure {
        match err.root() {
            Error::Corrupt {
                what,
                offset,
                reason,
            } => ScanFailure::Corrupt {
                what,
                offset: *offset,
                reason: reason.clone(),
            },
            other => ScanFailure::Other(other.to_string()),
        }
    }

    pub(crate) fn error(&self) -> Error {
        match self {
            ScanFailure::Corrupt {
                what,
                offset,
                reason,
            } => Error::corrupt(what, *offset, reason.clone()),
            ScanFailure::Other(reason) => Error::FreeSpaceUnavailable {
                reason: reason.clone(),
            },
        }
    }
}

impl FreeSpace {
    /// The allocator, for a count of free or busy bytes.
    pub(crate) fn allocator(&self) -> Result<&Allocator> {
        match self {
            FreeSpace::Ready(a) => Ok(a),
            FreeSpace::Scanning(_, Some(reserve)) => Ok(&reserve.alloc),
            FreeSpace::Scanning(_, None) => Err(Error::FreeSpacePending),
            FreeSpace::Failed(f) => Err(f.error()),
        }
    }

    /// The scan's allocator once installed, never the reserve: for bounds
    /// on what allocations made later (writeback of delayed ranges) may
    /// take, which the reserve's few ranges do not bound.
    pub(crate) fn installed(&self) -> Option<&Allocator> {
        match self {
            FreeSpace::Ready(a) => Some(a),
            _ => None,
        }
    }

    /// Whether the caller that got `err` should drop the metadata lock,
    /// wait for the scan and try again: [`Error::FreeSpacePending`], or
    /// ENOSPC from the reserve while the scan runs (the real free space
    /// is larger).
    pub(crate) fn waits_for_scan(&self, err: &Error) -> bool {
        match err.root() {
            Error::FreeSpacePending => true,
            Error::NoSpace { .. } => matches!(self, FreeSpace::Scanning(_, Some(_))),
            _ => false,
        }
    }

    /// The allocator, to allocate from.
    pub(crate) fn allocator_mut(&mut self) -> Result<&mut Allocator> {
        match self {
            FreeSpace::Ready(a) => Ok(a),
            FreeSpace::Scanning(_, Some(reserve)) => Ok(&mut reserve.alloc),
            FreeSpace::Scanning(_, None) => Err(Error::FreeSpacePending),
            FreeSpace::Failed(f) => Err(f.error()),
        }
    }

    /// [`Allocator::free`], or recorded for the scan's allocator.
    pub(crate) fn free(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        self.call(Deferred::Free { addr, len, seq })
    }

    /// [`Allocator::free_now`], or recorded for the scan's allocator.
    pub(crate) fn free_now(&mut self, addr: u64, len: u64) -> Result<(), String> {
        self.call(Deferred::FreeNow { addr, len })
    }

    /// [`Allocator::hold_busy`], or recorded for the scan's allocator.
    pub(crate) fn hold_busy(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        self.call(Deferred::HoldBusy { addr, len, seq })
    }

    /// [`Allocator::release_busy_at_most`]; while the scan runs, the whole
    /// release is recorded at once (nothing can allocate what it releases
    /// before the install anyway).
    pub(crate) fn release_busy_at_most(&mut self, up_to_seq: u64, max_ranges: usize) -> bool {
        match self {
            FreeSpace::Ready(a) => a.release_busy_at_most(up_to_seq, max_ranges),
            FreeSpace::Scanning(calls, _) => {
                calls.push(Deferred::ReleaseBusy { up_to_seq });
                false
            }
            FreeSpace::Failed(_) => false,
        }
    }

    /// Busy bytes (0 while there is no allocator: nothing to release).
    pub(crate) fn busy_bytes(&self) -> u64 {
        self.allocator().map_or(0, Allocator::busy_bytes)
    }

    fn call(&mut self, call: Deferred) -> Result<(), String> {
        match self {
            FreeSpace::Ready(a) => apply(a, call),
            FreeSpace::Scanning(calls, _) => {
                calls.push(call);
                Ok(())
            }
            // Nothing allocates on this mount any more.
            FreeSpace::Failed(_) => Ok(()),
        }
    }

    /// Installs what the scan built, with the frees recorded since mount
    /// applied in order. A free that does not apply (a range not used in
    /// the scanned layout: corruption the scan could not see) fails the
    /// install like a failed scan. Returns the failure, if any. Does
    /// nothing unless scanning.
    pub(crate) fn install(&mut self, built: Result<Allocator>) -> Option<ScanFailure> {
        let FreeSpace::Scanning(calls, reserve) = self else {
            return None;
        };
        let calls = std::mem::take(calls);
        let handed_out = reserve.take().map_or(Vec::new(), |r| r.handed_out());
        let installed = built.and_then(|mut alloc| {
            for (addr, len) in handed_out {
                alloc.mark_used(addr, len).map_err(|reason| {
                    Error::corrupt(
                        "free space",
                        addr,
                        format!(
                            "the free-space hint handed out space the scan finds used: {reason}"
                        ),
                    )
                })?;
            }
            for call in calls {
                apply(&mut alloc, call).map_err(|reason| {
                    let addr = match call {
                        Deferred::Free { addr, .. }
                        | Deferred::FreeNow { addr, .. }
                        | Deferred::HoldBusy { addr, .. } => addr,
                        Deferred::ReleaseBusy { .. } => 0,
                    };
                    Error::corrupt(
                        "free space",
                        addr,
                        format!("a free made while the mount's scan ran: {reason}"),
                    )
                })?;
            }
            Ok(alloc)
        });
        match installed {
            Ok(alloc) => {
                *self = FreeSpace::Ready(alloc);
                None
            }
            Err(err) => {
                let failure = ScanFailure::of(&err);
                *self = FreeSpace::Failed(failure.clone());
                Some(failure)
            }
        }
    }
}

fn apply(alloc: &mut Allocator, call: Deferred) -> Result<(), String> {
    match call {
        Deferred::Free { addr, len, seq } => alloc.free(addr, len, seq),
        Deferred::FreeNow { addr, len } => alloc.free_now(addr, len),
        Deferred::HoldBusy { addr, len, seq } => alloc.hold_busy(addr, len, seq),
        Deferred::ReleaseBusy { up_to_seq } => {
            alloc.release_busy(up_to_seq);
            Ok(())
        }
    }
}

/// What the scan reads: the state after journal replay and both slots'
/// spill extents and extent pages, as mount found them.
pub(crate) struct ScanInput {
    pub(crate) sb: Superblock,
    pub(crate) state: MetaState,
    pub(crate) spills: [Vec<SpillExtent>; CHECKPOINT_SLOTS],
    pub(crate) pages: [crate::codec::PageTable; CHECKPOINT_SLOTS],
    pub(crate) index: [crate::codec::IndexTable; CHECKPOINT_SLOTS],
}

/// Where the scan is, for a test that holds it there (see
/// [`ScanHook`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanPoint {
    /// Before the scan reads anything.
    Start,
    /// Built, before the install takes the metadata lock.
    BeforeInstall,
    /// Installed and the gate open, before the scanning thread returns:
    /// a test holds it here to check that it keeps nothing of the volume.
    Finished,
    /// Called by the thread that stops the scan (the last `Volume` handle
    /// dropped), after it asked the scan to stop and before it joins it:
    /// a test holding the scan lets it go here.
    Cancelled,
}

/// Called by the scan at each [`ScanPoint`]: tests block it there to
/// make frees, unmounts and power cuts happen while it runs. Not for
/// production use.
#[derive(Clone)]
pub struct ScanHook(pub Arc<dyn Fn(ScanPoint) + Send + Sync>);

impl std::fmt::Debug for ScanHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScanHook")
    }
}

impl PartialEq for ScanHook {
    fn eq(&self, other: &ScanHook) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ScanHook {}

/// Whether the scan is done, for callers waiting on it without the
/// metadata lock.
pub(crate) struct FreeSpaceGate {
    phase: Mutex<Phase>,
    changed: Condvar,
    /// Set with `Phase::Done`: the fast path of every allocating call.
    done: AtomicBool,
    /// Why the scan failed, once it has (for `mount_warnings`).
    failure: Mutex<Option<ScanFailure>>,
    pub(crate) hook: Mutex<Option<ScanHook>>,
}

enum Phase {
    /// `running`: a thread is scanning `input`.
    Scanning {
        input: Arc<ScanInput>,
        running: bool,
    },
    Done,
}

/// What a caller of [`FreeSpaceGate::claim`] is to do.
pub(crate) enum Claim {
    /// The allocator is installed (or the scan failed).
    Done,
    /// Scan `input` and install it: nobody else is.
    Scan(Arc<ScanInput>),
}

impl FreeSpaceGate {
    /// A gate that is open: the allocator was built synchronously.
    pub(crate) fn done() -> FreeSpaceGate {
        FreeSpaceGate {
            phase: Mutex::new(Phase::Done),
            changed: Condvar::new(),
            done: AtomicBool::new(true),
            failure: Mutex::new(None),
            hook: Mutex::new(None),
        }
    }

    /// A gate that opens when `input`'s scan is installed.
    pub(crate) fn scanning(input: ScanInput) -> FreeSpaceGate {
        FreeSpaceGate {
            phase: Mutex::new(Phase::Scanning {
                input: Arc::new(input),
                running: false,
            }),
            done: AtomicBool::new(false),
            ..FreeSpaceGate::done()
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits while another thread scans; returns the input to scan when
    /// nobody does (the caller then must [`FreeSpaceGate::finish`] or
    /// [`FreeSpaceGate::abandon`]). `wait: false` never waits: a thread
    /// starting the scan.
    pub(crate) fn claim(&self, wait: bool) -> Option<Claim> {
        let mut phase = self.phase.lock();
        loop {
            match &mut *phase {
                Phase::Done => return Some(Claim::Done),
                Phase::Scanning { input, running } if !*running => {
                    *running = true;
                    return Some(Claim::Scan(input.clone()));
                }
                Phase::Scanning { .. } if !wait => return None,
                Phase::Scanning { .. } => self.changed.wait(&mut phase),
            }
        }
    }

    /// The scan was installed (or failed): wake every waiter.
    pub(crate) fn finish(&self, failure: Option<ScanFailure>) {
        *self.failure.lock() = failure;
        *self.phase.lock() = Phase::Done;
        self.done.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// The scanning thread stopped before installing: the next waiter
    /// scans.
    pub(crate) fn abandon(&self) {
        if let Phase::Scanning { running, .. } = &mut *self.phase.lock() {
            *running = false;
        }
        self.changed.notify_all();
    }

    pub(crate) fn failure(&self) -> Option<ScanFailure> {
        self.failure.lock().clone()
    }

    pub(crate) fn hook(&self, point: ScanPoint) {
        let hook = self.hook.lock().clone();
        if let Some(hook) = hook {
            (hook.0)(point);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = 4096;

    /// Frees recorded while scanning land on the scanned allocator exactly
    /// as if they had been made on it, in order.
    #[test]
    fn recorded_calls_equal_direct_calls() {
        let mut direct = Allocator::new(0, 16 * BS, BS as u32);
        direct.mark_used(0, 8 * BS).unwrap();
        let scanned = direct.clone();
        let mut free_space = FreeSpace::Scanning(Vec::new(), None);
        let calls = [
            Deferred::HoldBusy {
                addr: 8 * BS,
                len: 2 * BS,
                seq: 3,
            },
            Deferred::Free {
                addr: 0,
                len: BS,
                seq: 4,
            },
            Deferred::FreeNow {
                addr: 2 * BS,
                len: BS,
            },
            Deferred::ReleaseBusy { up_to_seq: 3 },
            Deferred::Free {
                addr: 4 * BS,
                len: 2 * BS,
                seq: 5,
            },
        ];
        for call in calls {
            apply(&mut direct, call).unwrap();
            free_space.call(call).unwrap();
        }
        assert!(matches!(
            free_space.allocator(),
            Err(Error::FreeSpacePending)
        ));
        assert!(free_space.install(Ok(scanned)).is_none());
        let installed = free_space.allocator().unwrap();
        installed.check().unwrap();
        assert_eq!(installed.free_extents(), direct.free_extents());
        assert_eq!(installed.busy_bytes(), direct.busy_bytes());
        assert_eq!(installed.busy_bytes(), 3 * BS);
    }

    /// A hint less what was taken keeps every byte of the hint outside
    /// what was taken and none inside, whatever order and overlaps
    /// `taken` comes in; largest first, at most FREE_HINT_MAX ranges.
    #[test]
    fn a_hint_without_what_was_taken() {
        let hint = [(100 * BS, 50 * BS), (10 * BS, 20 * BS), (400 * BS, BS)];
        let taken = [
            (120 * BS, 5 * BS),
            (5 * BS, 10 * BS),
            (122 * BS, 10 * BS),
            (140 * BS, 20 * BS),
            (400 * BS, BS),
            (0, 0),
        ];
        assert_eq!(
            hint_without(&hint, &taken),
            vec![(100 * BS, 20 * BS), (15 * BS, 15 * BS), (132 * BS, 8 * BS),]
        );
        assert_eq!(hint_without(&hint, &[]).len(), 3);
        let many: Vec<(u64, u64)> = (0..40u64).map(|i| (2 * i * BS, BS)).collect();
        assert_eq!(hint_without(&many, &[]).len(), FREE_HINT_MAX);
    }

    /// A free the scanned layout does not have as used fails the install
    /// with a corruption error naming it, and allocations get that error.
    #[test]
    fn a_free_that_does_not_apply_fails_the_install() {
        let mut free_space = FreeSpace::Scanning(Vec::new(), None);
        free_space.free(3 * BS, BS, 9).unwrap();
        let failure = free_space
            .install(Ok(Allocator::new(0, 16 * BS, BS as u32)))
            .expect("double free");
        let err = failure.error();
        assert!(
            matches!(err, Error::Corrupt { offset, .. } if offset == 3 * BS),
            "{err}"
        );
        let err = free_space.allocator_mut().unwrap_err();
        assert!(err.to_string().contains("double free"), "{err}");
    }
}
