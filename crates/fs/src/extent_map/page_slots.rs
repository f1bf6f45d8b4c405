//! Memory for the extents of chunks read from their pages, kept out of the
//! C allocator's heap: whole memory pages of a pool of their own, in slots
//! of one to a few pages.
//!
//! Under the metadata budget, chunks are read and evicted all the time (a
//! scan of a 10M-extent file reads 39,062 chunks through a 64 MiB budget
//! that holds about 7,000). In glibc's heap, small blocks that live on
//! land in the holes evicted chunks leave, so a hole ends a little short
//! of the next chunk and the heap grows: at most 58 MiB of chunks were
//! live, the heap held 110-128 MiB (`docs/EXTENT_PAGES.md`, "The heap
//! under the budget"). Here a slot holds one chunk's extents and nothing
//! else, so an evicted chunk's slot is exactly the next one's. Freed
//! slots past half the pool's limit are given back to the system
//! (`MADV_DONTNEED`) by the evictor's thread after each pass, or by a
//! thread whose frees pass the limit ([`give_back_excess`]), so the
//! resident set follows the chunks in memory, not their history; the
//! mount's budget counts the warm slots at their limit, a quarter of the
//! budget up to [`WARM_BYTES_MOST`].
//!
//! Only chunks of at least half a slot unit come from here: a small chunk
//! would waste most of its page. The slots' address space is never
//! unmapped (regions of [`REGION_BYTES`]); what is resident is what is in
//! use plus the warm free slots.

use std::ops::Deref;
use std::ptr::NonNull;

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::types::Extent;

/// Bytes of a slot unit: a 4 KiB page, or the system's page if larger
/// (the unit `madvise` works in). With pages of 32 KiB or more no chunk
/// (16 KiB at most) reaches half a unit: the pool is then never used.
fn unit_bytes() -> usize {
    static UNIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *UNIT.get_or_init(|| blockdev::page_size().max(4096))
}

/// Largest slot, in units: a chunk of more extents stays on the heap.
const UNITS_MAX: usize = 4;

/// Address space reserved at a time for the slots of one size.
const REGION_BYTES: usize = 2 << 20;

/// Most free slot bytes the pool keeps resident for the next loads,
/// whatever the mounts' budgets: a thread whose free passes the pool's
/// limit ([`warm_limit`]) gives the excess back.
///
/// Chunks move between slot sizes (read into one, changed into a larger
/// one, evicted after a base), so each size frees while another takes,
/// a base's worth apart: with 4 MiB kept, a 1% change of a 50M-extent
/// file took 15-30% longer than on the heap, its slots' pages faulting in
/// again (`docs/EXTENT_PAGES.md`, "Changed chunks in slots").
pub(crate) const WARM_BYTES_MOST: usize = 16 << 20;

/// The pool's limit of warm bytes until a mount sets one
/// ([`keep_warm_up_to`]).
const WARM_BYTES_BEFORE_A_MOUNT: usize = 1 << 20;

static WARM_LIMIT: AtomicUsize = AtomicUsize::new(WARM_BYTES_BEFORE_A_MOUNT);

/// Raises the pool's limit of warm bytes to `bytes` (at most
/// [`WARM_BYTES_MOST`]): a mount keeps as many warm as its budget counts
/// for them. Never lowered: the pool serves every mount of the process.
pub(crate) fn keep_warm_up_to(bytes: usize) {
    WARM_LIMIT.fetch_max(bytes.min(WARM_BYTES_MOST), Ordering::Relaxed);
}

/// The most free slot bytes kept warm now.
fn warm_limit() -> usize {
    WARM_LIMIT.load(Ordering::Relaxed)
}

/// A chunk's extents in a slot of the pool, changed in place within its
/// capacity (whole units), freed to the pool when dropped.
pub(crate) struct SlotExtents {
    ptr: NonNull<Extent>,
    // u32s: with the pointer, 16 bytes, so that `ExtentStore` is no larger
    // than the `Vec` it replaces (24 bytes, in every loaded chunk).
    len: u32,
    units: u32,
}

// SAFETY: a `SlotExtents` owns its slot alone (the pool hands a slot to
// one owner until it is freed) and writes it only through `&mut self`,
// like a `Vec<Extent>`; `Extent` is `Send + Sync`.
unsafe impl Send for SlotExtents {}
// SAFETY: as above: shared references only read the slot.
unsafe impl Sync for SlotExtents {}

impl SlotExtents {
    /// A copy of `extents` in a slot, or `None` where they belong on the
    /// heap: fewer than half a unit's worth, more than the largest slot
    /// holds, or no address space left.
    #[cfg(test)]
    pub(crate) fn copy_of(extents: &[Extent]) -> Option<SlotExtents> {
        SlotExtents::copy_with_room(extents, extents.len())
    }

    /// A copy of `extents` in a slot that holds at least `capacity`
    /// extents (whole units), or `None` where `capacity` extents belong on
    /// the heap ([`units_for`]).
    fn copy_with_room(extents: &[Extent], capacity: usize) -> Option<SlotExtents> {
        let units = units_for(capacity.max(extents.len()))?;
        let unit = unit_bytes();
        assert!(units * unit >= std::mem::size_of_val(extents));
        let slot = take(units, unit)?;
        let ptr = slot.cast::<Extent>();
        // SAFETY: the slot is `units * unit` bytes the pool handed to this
        // owner alone, aligned to the unit (a multiple of `Extent`'s
        // alignment), and holds at least `extents.len()` extents
        // (asserted above); `extents` cannot overlap it (it is memory the
        // caller already holds).
        unsafe {
            std::ptr::copy_nonoverlapping(extents.as_ptr(), ptr.as_ptr(), extents.len());
        }
        Some(SlotExtents {
            ptr,
            // At most UNITS_MAX units of extents: far below u32::MAX.
            len: extents.len() as u32,
            units: units as u32,
        })
    }

    /// Extents the slot could hold: what its memory is charged as.
    pub(crate) fn capacity(&self) -> usize {
        extents_in(self.units as usize)
    }

    /// Puts `extents` at `at`, moving the ones from there up. The caller
    /// made room: `len + extents.len() <= capacity`.
    fn insert_slice(&mut self, at: usize, extents: &[Extent]) {
        let len = self.len as usize;
        assert!(
            at <= len && len + extents.len() <= self.capacity(),
            "{} extents at {at} into a slot of {len}/{}",
            extents.len(),
            self.capacity()
        );
        let p = self.ptr.as_ptr();
        // SAFETY: checked above: every extent moved or written lands below
        // `capacity`, inside the slot this value owns alone (`&mut self`);
        // the first copy may overlap itself (`ptr::copy`), the second
        // cannot overlap the slot (the caller's memory, borrowed apart from
        // `self`). `Extent` is `Copy`: nothing to drop or double.
        unsafe {
            std::ptr::copy(p.add(at), p.add(at + extents.len()), len - at);
            std::ptr::copy_nonoverlapping(extents.as_ptr(), p.add(at), extents.len());
        }
        self.len += extents.len() as u32;
    }

    /// Removes the extents at `[from, to)`, moving the rest down.
    fn remove_range(&mut self, from: usize, to: usize) {
        let len = self.len as usize;
        assert!(from <= to && to <= len, "removing {from}..{to} of {len}");
        let p = self.ptr.as_ptr();
        // SAFETY: `to <= len`: the extents moved are the slot's own, moved
        // down inside it (`ptr::copy` allows the overlap); `Extent` is
        // `Copy`.
        unsafe { std::ptr::copy(p.add(to), p.add(from), len - to) };
        self.len -= (to - from) as u32;
    }
}

/// Units of the slot that holds `capacity` extents, or `None` where they
/// belong on the heap: fewer than half a unit's worth (a small chunk would
/// waste most of its page) or more than the largest slot.
fn units_for(capacity: usize) -> Option<usize> {
    let unit = unit_bytes();
    let bytes = capacity.checked_mul(std::mem::size_of::<Extent>())?;
    let units = bytes.div_ceil(unit);
    (bytes >= unit / 2 && units <= UNITS_MAX && units * unit <= REGION_BYTES).then_some(units)
}

/// Extents a slot of `units` units holds.
fn extents_in(units: usize) -> usize {
    units * unit_bytes() / std::mem::size_of::<Extent>()
}

impl Deref for SlotExtents {
    type Target = [Extent];
    #[inline]
    fn deref(&self) -> &[Extent] {
        // SAFETY: `ptr` points at `len` extents (copied in
        // `copy_with_room`, then changed only within the capacity), in a
        // slot this value owns until it drops.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl std::ops::DerefMut for SlotExtents {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Extent] {
        // SAFETY: as for `deref`, through the one mutable reference to
        // this owner of the slot.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl Drop for SlotExtents {
    fn drop(&mut self) {
        give_back(self.ptr.cast(), self.units as usize, unit_bytes());
    }
}

impl std::fmt::Debug for SlotExtents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A chunk's extents: in a slot of the pool when they take from half a
/// unit to the largest slot, whether read from a page or built and changed
/// in memory; else a vector on the heap.
///
/// Changed chunks live in slots too: in glibc's heap, the 9 KiB vectors of
/// the chunks a 1% change of a 50M-extent file passes through left 11-21
/// MiB of holes beside 50-57 MiB in use (`docs/EXTENT_PAGES.md`, "Changed
/// chunks in slots").
#[derive(Debug)]
pub(crate) enum ExtentStore {
    Heap(Vec<Extent>),
    Slot(SlotExtents),
}

impl ExtentStore {
    /// `extents` (read from a page, or built in memory) with room for
    /// `room` more: in a slot where that fits one, so that a change does
    /// not move them (a chunk read into a full slot of one size and moved to the
    /// next at its first insert frees slots of one size and takes slots
    /// of another, and each taken slot's pages fault in again); the room
    /// is cut to what the largest slot holds (a chunk nearly that large
    /// splits at its next inserts anyway); else the vector itself, with
    /// that room.
    pub(crate) fn with_room(mut extents: Vec<Extent>, room: usize) -> ExtentStore {
        let largest = extents_in(UNITS_MAX);
        let capacity = (extents.len() + room).min(largest.max(extents.len()));
        match SlotExtents::copy_with_room(&extents, capacity) {
            Some(slot) => ExtentStore::Slot(slot),
            None => {
                extents.reserve_exact(room);
                ExtentStore::Heap(extents)
            }
        }
    }

    /// A copy of `extents` with room for `capacity`: in a slot where that
    /// fits one (whole units: the room may be more), else a vector of
    /// exactly that capacity.
    fn placed(extents: &[Extent], capacity: usize) -> ExtentStore {
        let capacity = capacity.max(extents.len());
        match SlotExtents::copy_with_room(extents, capacity) {
            Some(slot) => ExtentStore::Slot(slot),
            None => {
                let mut v = Vec::with_capacity(capacity);
                v.extend_from_slice(extents);
                ExtentStore::Heap(v)
            }
        }
    }

    /// Extents the memory holding them could hold: what it is charged as.
    pub(crate) fn capacity(&self) -> usize {
        match self {
            ExtentStore::Heap(v) => v.capacity(),
            ExtentStore::Slot(s) => s.capacity(),
        }
    }

    /// The capacity [`ExtentStore::reserve_exact`] of `additional` would
    /// leave, without moving anything.
    pub(crate) fn capacity_with_room(&self, additional: usize) -> usize {
        let needed = self.len() + additional;
        if needed <= self.capacity() {
            return self.capacity();
        }
        match units_for(needed) {
            Some(units) => extents_in(units),
            None => needed,
        }
    }

    /// Makes room for at least `additional` more extents: in place if the
    /// memory has it, else by moving them (into a slot of enough units,
    /// or a vector where no slot fits).
    pub(crate) fn reserve_exact(&mut self, additional: usize) {
        let needed = self.len() + additional;
        if needed <= self.capacity() {
            return;
        }
        match self {
            ExtentStore::Heap(v) if units_for(needed).is_none() => v.reserve_exact(additional),
            _ => *self = ExtentStore::placed(self, needed),
        }
    }

    /// Gives back the room past `capacity` extents (never below the
    /// length, and never growing, as `Vec::shrink_to`): a slot moves to
    /// fewer units, or to a vector once its extents no longer fill half a
    /// unit; a vector shrinks, or moves to a slot where the extents fit
    /// one.
    pub(crate) fn shrink_to(&mut self, capacity: usize) {
        let wanted = capacity.max(self.len());
        if wanted >= self.capacity() {
            return;
        }
        match (&mut *self, units_for(wanted)) {
            (ExtentStore::Heap(v), None) => v.shrink_to(wanted),
            (ExtentStore::Slot(s), Some(units)) if units >= s.units as usize => {}
            _ => *self = ExtentStore::placed(self, wanted),
        }
    }

    /// Puts `extents` at `at`, moving the ones from there up. Short of
    /// room, the extents move to the smallest slot that holds them (whole
    /// units are room already), or a vector twice as long (a change makes
    /// its own room first, see `chunks::grow_for_one_more`).
    pub(crate) fn insert_slice(&mut self, at: usize, extents: &[Extent]) {
        let needed = self.len() + extents.len();
        if needed > self.capacity() {
            let wanted = match units_for(needed) {
                Some(_) => needed,
                None => needed.max(2 * self.len()),
            };
            self.reserve_exact(wanted - self.len());
        }
        match self {
            ExtentStore::Heap(v) => {
                v.splice(at..at, extents.iter().copied());
            }
            ExtentStore::Slot(s) => s.insert_slice(at, extents),
        }
    }

    pub(crate) fn insert(&mut self, at: usize, extent: Extent) {
        self.insert_slice(at, std::slice::from_ref(&extent));
    }

    pub(crate) fn push(&mut self, extent: Extent) {
        self.insert(self.len(), extent);
    }

    pub(crate) fn extend_from_slice(&mut self, extents: &[Extent]) {
        self.insert_slice(self.len(), extents);
    }

    /// Removes the extents at `[from, to)`.
    pub(crate) fn remove_range(&mut self, from: usize, to: usize) {
        match self {
            ExtentStore::Heap(v) => {
                v.drain(from..to);
            }
            ExtentStore::Slot(s) => s.remove_range(from, to),
        }
    }

    /// Removes the extent at `at` and returns it.
    pub(crate) fn remove(&mut self, at: usize) -> Extent {
        let extent = self[at];
        self.remove_range(at, at + 1);
        extent
    }

    /// The extents from `at` on, taken out into a store of their own
    /// (placed as [`ExtentStore::from`] places a vector; this memory
    /// keeps its room).
    pub(crate) fn split_off(&mut self, at: usize) -> ExtentStore {
        let tail = ExtentStore::placed(&self[at..], self.len() - at);
        self.remove_range(at, self.len());
        tail
    }
}

impl Deref for ExtentStore {
    type Target = [Extent];
    #[inline]
    fn deref(&self) -> &[Extent] {
        match self {
            ExtentStore::Heap(v) => v,
            ExtentStore::Slot(s) => s,
        }
    }
}

impl std::ops::DerefMut for ExtentStore {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Extent] {
        match self {
            ExtentStore::Heap(v) => v,
            ExtentStore::Slot(s) => s,
        }
    }
}

impl Clone for ExtentStore {
    /// A copy is made to be changed (`Arc::make_mut`): no room past the
    /// extents but a slot's rounding (a removal must not add any).
    fn clone(&self) -> Self {
        ExtentStore::placed(self, self.len())
    }
}

impl From<Vec<Extent>> for ExtentStore {
    /// In a slot where the extents fit one, else the vector itself.
    fn from(v: Vec<Extent>) -> Self {
        ExtentStore::with_room(v, 0)
    }
}

/// Slots of every size, taken and freed under one lock (a take or a free
/// is a few pointer moves; `madvise` and `mmap` run outside it).
struct Pool {
    sizes: [Size; UNITS_MAX],
    warm_bytes: usize,
}

/// The slots of one size (index `units - 1`).
struct Size {
    /// Freed slots still resident: taken first.
    warm: Vec<NonNull<u8>>,
    /// Freed slots given back to the system: their pages fault in, zeroed,
    /// when the next owner writes them.
    cold: Vec<NonNull<u8>>,
    /// The newest region (null before the first) and how much of it was
    /// handed out.
    region: *mut u8,
    used: usize,
}

// SAFETY: the pointers are addresses of the pool's own mappings, handed
// out to one owner at a time; the pool itself is only reached under its
// mutex.
unsafe impl Send for Pool {}

#[cfg(not(test))]
static POOL: Mutex<Pool> = Mutex::new(Pool::EMPTY);

// One pool per test thread: a test that counts free slots sees only its
// own, whatever the tests running beside it take and free (the same pool
// code, one instance each).
#[cfg(test)]
thread_local! {
    static POOL: Mutex<Pool> = const { Mutex::new(Pool::EMPTY) };
}

/// `f` on the pool, under its lock.
fn with_pool<R>(f: impl FnOnce(&mut Pool) -> R) -> R {
    #[cfg(not(test))]
    let got = f(&mut POOL.lock());
    #[cfg(test)]
    let got = POOL.with(|pool| f(&mut pool.lock()));
    got
}

impl Pool {
    const EMPTY: Pool = Pool {
        sizes: [const {
            Size {
                warm: Vec::new(),
                cold: Vec::new(),
                region: std::ptr::null_mut(),
                used: REGION_BYTES,
            }
        }; UNITS_MAX],
        warm_bytes: 0,
    };

    /// A free slot of `units` units, or the next one of the newest
    /// region; `None` if that region is used up.
    fn take(&mut self, units: usize, unit: usize) -> Option<NonNull<u8>> {
        let bytes = units * unit;
        let size = &mut self.sizes[units - 1];
        if let Some(slot) = size.warm.pop() {
            self.warm_bytes -= bytes;
            return Some(slot);
        }
        if let Some(slot) = size.cold.pop() {
            return Some(slot);
        }
        if REGION_BYTES - size.used < bytes {
            return None;
        }
        // SAFETY: `used + bytes <= REGION_BYTES`: inside the region's
        // mapping (not null: `used` starts at the region's end).
        let slot = unsafe { size.region.add(size.used) };
        size.used += bytes;
        NonNull::new(slot)
    }
}

/// A slot of `units` units: free or new; a new region is mapped without
/// the lock held, so loads in other threads do not wait on `mmap`.
fn take(units: usize, unit: usize) -> Option<NonNull<u8>> {
    if let Some(slot) = with_pool(|pool| pool.take(units, unit)) {
        return Some(slot);
    }
    let region = map_region()?;
    with_pool(|pool| {
        // Another thread may have mapped one meanwhile: the rest of the
        // region replaced is only address space.
        let size = &mut pool.sizes[units - 1];
        size.region = region.as_ptr();
        size.used = 0;
        pool.take(units, unit)
    })
}

/// Frees a slot: kept warm, so that a thread dropping many chunks at
/// once (an eviction pass before a base, in the checkpoint's time) makes
/// a system call only once the pool's [`warm_limit`] is warm, and then one per
/// run of neighbouring slots ([`give_back_excess`]; the evictor's thread
/// calls it after its passes too).
fn give_back(slot: NonNull<u8>, units: usize, unit: usize) {
    let over = with_pool(|pool| {
        pool.warm_bytes += units * unit;
        pool.sizes[units - 1].warm.push(slot);
        pool.warm_bytes > warm_limit()
    });
    if over {
        give_back_excess();
    }
}

/// Gives the pages of the warm slots past half the pool's [`warm_limit`]
/// (so that a thread dropping many chunks at once, an eviction pass
/// before a base in the checkpoint's time, makes a system call once per
/// that much) back to the
/// system (`MADV_DONTNEED`; the slots stay the pool's, cold), neighbours
/// joined into runs and the runs in one system call where the kernel
/// takes it ([`drop_pages`]); the bytes given back. Called by the evictor's thread
/// after its passes and by unmount.
pub(crate) fn give_back_excess() -> usize {
    give_back_past(warm_limit() / 2)
}

/// Gives back every warm slot's pages (as [`give_back_excess`]): at
/// unmount, the volume's slots are not the next loads' (the pool kept up
/// to 8 MiB after a volume of the default budget otherwise).
pub(crate) fn give_back_warm() -> usize {
    give_back_past(0)
}

/// Gives back the warm slots' pages past `kept` bytes.
fn give_back_past(kept: usize) -> usize {
    let unit = unit_bytes();
    let mut excess: Vec<(NonNull<u8>, usize)> = Vec::new();
    with_pool(|pool| {
        let Pool { sizes, warm_bytes } = pool;
        for (i, size) in sizes.iter_mut().enumerate() {
            let bytes = (i + 1) * unit;
            while *warm_bytes > kept {
                let Some(slot) = size.warm.pop() else { break };
                *warm_bytes -= bytes;
                excess.push((slot, bytes));
            }
        }
    });
    if excess.is_empty() {
        return 0;
    }
    excess.sort_unstable_by_key(|&(slot, _)| slot.as_ptr() as usize);
    let mut runs: Vec<(NonNull<u8>, usize)> = Vec::new();
    for &(slot, bytes) in &excess {
        match runs.last_mut() {
            Some((start, len)) if start.as_ptr() as usize + *len == slot.as_ptr() as usize => {
                *len += bytes;
            }
            _ => runs.push((slot, bytes)),
        }
    }
    let given = drop_pages(&runs);
    with_pool(|pool| {
        for (slot, bytes) in excess {
            pool.sizes[bytes / unit - 1].cold.push(slot);
        }
    });
    given
}

/// Set once the kernel refuses `process_madvise` (older kernels refuse
/// `PIDFD_SELF` or `MADV_DONTNEED` there): [`drop_pages`] then calls
/// `madvise` per run.
static VECTORED_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The calling thread's own pidfd, as `process_madvise` takes it
/// (`PIDFD_SELF_THREAD`, Linux 6.14; older kernels refuse it). A
/// thread's memory is its process's.
const PIDFD_SELF: libc::c_int = -10000;

/// Gives the pages of `runs` (whole free slots of the pool, unit-aligned,
/// apart) back to the system; the bytes given back. A run the kernel
/// refuses stays resident: memory only.
///
/// [`RUNS_PER_CALL`] runs go in one `process_madvise` call: `madvise`
/// flushes the TLB once per run, and each flush interrupts every other
/// CPU running the process (the writer beside an eviction pass, which
/// gives back thousands of runs); kernels that batch the flushes of a
/// `process_madvise` call (6.18 here) flush once per call. Measured here,
/// 1,024 runs of 8 KiB with a second thread running: 0.9-1.1 ms against
/// 2.2-6.4 ms.
fn drop_pages(runs: &[(NonNull<u8>, usize)]) -> usize {
    let mut given = 0;
    let mut rest = runs;
    while !rest.is_empty() {
        if VECTORED_REFUSED.load(std::sync::atomic::Ordering::Relaxed) {
            return given + drop_each(rest);
        }
        let batch = &rest[..rest.len().min(RUNS_PER_CALL)];
        rest = &rest[batch.len()..];
        given += match drop_pages_at_once(batch) {
            Ok(bytes) => bytes,
            Err(VectoredDrop::Refused) => {
                VECTORED_REFUSED.store(true, std::sync::atomic::Ordering::Relaxed);
                drop_each(batch)
            }
            Err(VectoredDrop::Failed) => drop_each(batch),
            Err(VectoredDrop::Partial(done)) => done + drop_each(&runs_after(batch, done)),
        };
    }
    given
}

/// [`drop_pages`] one `madvise` per run.
fn drop_each(runs: &[(NonNull<u8>, usize)]) -> usize {
    let mut given = 0;
    for &(start, len) in runs {
        // SAFETY: `[start, start + len)` is whole slots of the pool's
        // private anonymous mappings (contiguous, so every byte of it is
        // the pool's), unit-aligned, owned by no one: dropping their
        // contents is allowed and the mappings stay (the next owner's
        // writes fault in zeroed pages).
        let rc = unsafe { libc::madvise(start.as_ptr().cast(), len, libc::MADV_DONTNEED) };
        if rc == 0 {
            given += len;
        }
    }
    given
}

/// What of `runs` is left past their first `done` bytes (a multiple of
/// the page size: the kernel stops at page boundaries).
fn runs_after(runs: &[(NonNull<u8>, usize)], mut done: usize) -> Vec<(NonNull<u8>, usize)> {
    let mut left = Vec::new();
    for &(start, len) in runs {
        if done >= len {
            done -= len;
            continue;
        }
        // `done < len`: inside the run.
        let at = start.as_ptr().wrapping_add(done);
        left.push((NonNull::new(at).unwrap_or(start), len - done));
        done = 0;
    }
    left
}

/// Most runs in one `process_madvise` call (the kernel takes up to 1,024).
/// The call holds the process's memory map lock throughout: with 1,024
/// runs a call (about 1 ms), the bench's writer at 50M extents managed
/// 7.1k-9.1k writes in its quiet window, worst 162-316 ms, against
/// 12.7k-14.2k (worst 20-127 ms) with `madvise` per run; with 64 a call,
/// 11.1k-14.6k (worst 29-53 ms), two runs each.
const RUNS_PER_CALL: usize = 64;

/// Why [`drop_pages_at_once`] did not give back every run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VectoredDrop {
    /// The kernel does not take the call (`EBADF`: no `PIDFD_SELF`;
    /// `EINVAL`: an advice `process_madvise` does not take; `ENOSYS`;
    /// `EPERM`: a filter forbids it): never asked again.
    Refused,
    /// Another error (`ENOMEM`, `EAGAIN`, `EINTR`): this call only.
    Failed,
    /// It stopped partway, after this many bytes.
    Partial(usize),
}

/// [`drop_pages`] of at most [`RUNS_PER_CALL`] runs in one `process_madvise`.
fn drop_pages_at_once(runs: &[(NonNull<u8>, usize)]) -> Result<usize, VectoredDrop> {
    let iov: Vec<libc::iovec> = runs
        .iter()
        .map(|&(start, len)| libc::iovec {
            iov_base: start.as_ptr().cast(),
            iov_len: len,
        })
        .collect();
    let want: usize = runs.iter().map(|&(_, len)| len).sum();
    // SAFETY: as for `madvise` in `drop_each`, for every run of `iov`,
    // which lives through the call; `PIDFD_SELF` names this thread's own
    // memory (its process's), the only memory advised.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            PIDFD_SELF,
            iov.as_ptr(),
            iov.len(),
            libc::MADV_DONTNEED,
            0,
        )
    };
    match usize::try_from(rc) {
        Ok(done) if done == want => Ok(done),
        Ok(done) => Err(VectoredDrop::Partial(done)),
        Err(_) => match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EBADF | libc::EINVAL | libc::ENOSYS | libc::EPERM) => {
                Err(VectoredDrop::Refused)
            }
            _ => Err(VectoredDrop::Failed),
        },
    }
}

/// A new region of address space for slots; `None` if the system has
/// none to give.
fn map_region() -> Option<NonNull<u8>> {
    // SAFETY: a fresh private anonymous mapping at an address of the
    // kernel's choosing: it aliases nothing. MAP_NORESERVE: untouched
    // pages are only address space.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            REGION_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(at.cast())
}

/// Slots in use and free, per size, for tests: (in use is not tracked;
/// warm, cold).
#[cfg(test)]
pub(crate) fn free_slots(units: usize) -> (usize, usize) {
    with_pool(|pool| {
        let size = &pool.sizes[units - 1];
        (size.warm.len(), size.cold.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` extents, different for each `seed`.
    fn extents(n: usize, seed: u64) -> Vec<Extent> {
        crate::codec::test_extents(seed << 32, n)
    }

    #[test]
    fn a_slot_holds_a_copy_and_small_or_large_chunks_stay_on_the_heap() {
        let per_unit = unit_bytes() / std::mem::size_of::<Extent>();
        assert!(SlotExtents::copy_of(&extents(per_unit / 2 - 1, 1)).is_none());
        assert!(SlotExtents::copy_of(&extents(UNITS_MAX * per_unit + 1, 1)).is_none());
        for n in [per_unit / 2, per_unit, per_unit + 1, UNITS_MAX * per_unit] {
            let want = extents(n, n as u64);
            let slot = SlotExtents::copy_of(&want).expect("a slot");
            assert_eq!(&*slot, &want[..]);
            assert_eq!(slot.capacity(), n.div_ceil(per_unit) * per_unit);
        }
    }

    /// A chunk read into a slot changes there: a removal or an insert with
    /// room keeps the slot; growing past it moves the extents to a larger
    /// slot, and giving back room to a smaller one. A copy (before a
    /// change to a shared chunk) is a slot too, and so is a vector built
    /// in memory; chunks too small or too large for a slot stay vectors.
    /// The store is no larger than the vector it replaced, in every
    /// loaded chunk.
    #[test]
    fn a_chunk_changes_in_its_slot_and_moves_only_to_grow_or_shrink() {
        assert!(std::mem::size_of::<ExtentStore>() <= std::mem::size_of::<Vec<Extent>>());
        let per_unit = unit_bytes() / std::mem::size_of::<Extent>();
        let slot_of = |store: &ExtentStore| match store {
            ExtentStore::Slot(s) => Some((s.ptr.as_ptr() as usize, s.units)),
            ExtentStore::Heap(_) => None,
        };
        let mut want = extents(2 * per_unit, 7);
        let mut store = ExtentStore::from(want.clone());
        let (at, units) = slot_of(&store).expect("read into a slot");
        assert_eq!((units, store.capacity()), (2, 2 * per_unit));
        let copy = store.clone();
        assert_eq!(slot_of(&copy).map(|(_, u)| u), Some(2));
        assert_eq!(&*copy, &want[..]);
        assert_eq!(store.remove(3), want.remove(3));
        store.insert(5, want[0]);
        want.insert(5, want[0]);
        assert_eq!(slot_of(&store), Some((at, 2)), "changed in place");
        store.push(want[1]);
        want.push(want[1]);
        assert_eq!(slot_of(&store).map(|(_, u)| u), Some(3), "grew a unit");
        assert_eq!(&*store, &want[..]);
        store.remove_range(10, per_unit + 20);
        want.drain(10..per_unit + 20);
        store.shrink_to(store.len());
        assert_eq!(slot_of(&store).map(|(_, u)| u), Some(1), "gave back two");
        assert_eq!(&*store, &want[..]);
        let tail = store.split_off(per_unit / 4);
        assert_eq!(&*tail, &want.split_off(per_unit / 4)[..]);
        store.shrink_to(0);
        assert!(slot_of(&store).is_none(), "too few for a slot");
        assert_eq!(&*store, &want[..]);
        let built = ExtentStore::from(extents(per_unit, 3));
        assert_eq!(slot_of(&built).map(|(_, u)| u), Some(1));
        assert_eq!(&*built, &extents(per_unit, 3)[..]);
        for n in [per_unit / 2 - 1, UNITS_MAX * per_unit + 1] {
            assert!(slot_of(&ExtentStore::from(extents(n, 1))).is_none());
        }
        // Read to be changed: the room in the slot, cut to the largest
        // slot; never growing a store when asked to shrink.
        let full = 2 * per_unit;
        let read = ExtentStore::with_room(extents(full, 5), full / 8 + 1);
        assert_eq!(slot_of(&read).map(|(_, u)| u), Some(3));
        assert_eq!(&*read, &extents(full, 5)[..]);
        let nearly = UNITS_MAX * per_unit - 8;
        let mut read = ExtentStore::with_room(extents(nearly, 5), nearly / 8 + 1);
        assert_eq!(slot_of(&read).map(|(_, u)| u), Some(UNITS_MAX as u32));
        read.shrink_to(2 * UNITS_MAX * per_unit);
        assert_eq!(slot_of(&read).map(|(_, u)| u), Some(UNITS_MAX as u32));
        assert_eq!(&*read, &extents(nearly, 5)[..]);
    }

    /// One change to a store and to the vector it is checked against.
    #[derive(Clone, Debug)]
    enum Change {
        Insert { at: usize, n: usize },
        RemoveRange { from: usize, n: usize },
        Remove { at: usize },
        SplitOff { at: usize },
        Reserve { n: usize },
        ShrinkTo { capacity: usize },
        Clone,
    }

    fn change() -> impl Strategy<Value = Change> {
        let per_unit = unit_bytes() / std::mem::size_of::<Extent>();
        let n = 0..=2 * UNITS_MAX * per_unit;
        prop_oneof![
            (any::<usize>(), 1..=2 * per_unit).prop_map(|(at, n)| Change::Insert { at, n }),
            (any::<usize>(), 0..=2 * per_unit)
                .prop_map(|(from, n)| Change::RemoveRange { from, n }),
            any::<usize>().prop_map(|at| Change::Remove { at }),
            any::<usize>().prop_map(|at| Change::SplitOff { at }),
            n.clone().prop_map(|n| Change::Reserve { n }),
            n.prop_map(|capacity| Change::ShrinkTo { capacity }),
            Just(Change::Clone),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever changes a store goes through, across the heap and
        /// every slot size, it holds what a vector given the same changes
        /// holds, in memory that holds that many; in a slot, whole units
        /// of no more than the largest size.
        #[test]
        fn a_store_holds_what_a_vector_holds_under_any_changes(
            start in 0..=UNITS_MAX * unit_bytes() / std::mem::size_of::<Extent>() + 20,
            room in 0..=64usize,
            changes in prop::collection::vec(change(), 1..40),
        ) {
            let mut want = extents(start, 1);
            let mut store = ExtentStore::with_room(want.clone(), room);
            for (i, change) in changes.into_iter().enumerate() {
                let len = want.len();
                match change {
                    Change::Insert { at, n } => {
                        let at = at % (len + 1);
                        let new = extents(n, 100 + i as u64);
                        store.insert_slice(at, &new);
                        want.splice(at..at, new);
                    }
                    Change::RemoveRange { from, n } => {
                        let from = from % (len + 1);
                        let to = (from + n).min(len);
                        store.remove_range(from, to);
                        want.drain(from..to);
                    }
                    Change::Remove { at } if len > 0 => {
                        prop_assert_eq!(store.remove(at % len), want.remove(at % len));
                    }
                    Change::Remove { .. } => {}
                    Change::SplitOff { at } => {
                        let at = at % (len + 1);
                        let tail = store.split_off(at);
                        prop_assert_eq!(&*tail, &want.split_off(at)[..]);
                    }
                    Change::Reserve { n } => {
                        let foreseen = store.capacity_with_room(n);
                        store.reserve_exact(n);
                        prop_assert!(store.capacity() >= len + n);
                        prop_assert_eq!(store.capacity(), foreseen);
                    }
                    Change::ShrinkTo { capacity } => {
                        let before = store.capacity();
                        store.shrink_to(capacity);
                        prop_assert!(store.capacity() <= before, "shrink_to({}) grew {} to {}", capacity, before, store.capacity());
                    }
                    Change::Clone => store = store.clone(),
                }
                prop_assert_eq!(&*store, &want[..]);
                prop_assert!(store.capacity() >= store.len());
                if let ExtentStore::Slot(s) = &store {
                    prop_assert!((1..=UNITS_MAX as u32).contains(&s.units));
                    prop_assert_eq!(s.capacity() * std::mem::size_of::<Extent>(), s.units as usize * unit_bytes());
                }
            }
        }
    }

    /// Slots are reused: many chunks loaded and dropped in turn stay in
    /// the same slots, each holding its own extents; past the warm bytes,
    /// freed slots are given back (cold) and still serve.
    #[test]
    fn freed_slots_serve_the_next_chunks() {
        let per_unit = unit_bytes() / std::mem::size_of::<Extent>();
        // Three units (the pool is this thread's own).
        let n = 2 * per_unit + 1;
        // Past the most the pool keeps warm: other tests' mounts raise its
        // limit meanwhile.
        let many = WARM_BYTES_MOST / (3 * unit_bytes()) + 8;
        let mut held: Vec<SlotExtents> = (0..many)
            .map(|i| SlotExtents::copy_of(&extents(n, i as u64)).unwrap())
            .collect();
        let addresses: std::collections::HashSet<usize> =
            held.iter().map(|s| s.ptr.as_ptr() as usize).collect();
        assert_eq!(addresses.len(), many, "each chunk its own slot");
        held.clear();
        give_back_excess();
        let (warm, cold) = free_slots(3);
        assert!(warm >= 1 && cold >= 1, "warm {warm}, cold {cold}");
        assert!(warm * 3 * unit_bytes() <= WARM_BYTES_MOST / 2);
        // At unmount: none kept.
        give_back_warm();
        assert_eq!(free_slots(3), (0, warm + cold));
        let again: Vec<SlotExtents> = (0..many)
            .map(|i| SlotExtents::copy_of(&extents(n, 1000 + i as u64)).unwrap())
            .collect();
        for (i, slot) in again.iter().enumerate() {
            assert!(addresses.contains(&(slot.ptr.as_ptr() as usize)));
            assert_eq!(&**slot, &extents(n, 1000 + i as u64)[..]);
        }
    }

    /// Which units of `len` bytes from `start` have every page resident.
    fn resident_units(start: NonNull<u8>, units: usize) -> Vec<bool> {
        let (unit, page) = (unit_bytes(), blockdev::page_size());
        let mut pages = vec![0u8; units * unit / page];
        // SAFETY: `start` is a mapping of at least `units * unit` bytes
        // (the caller's), page-aligned; `pages` has a byte per page.
        let rc = unsafe { libc::mincore(start.as_ptr().cast(), units * unit, pages.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        pages
            .chunks(unit / page)
            .map(|unit| unit.iter().all(|p| p & 1 == 1))
            .collect()
    }

    /// Runs given back leave the resident set, the units between them
    /// stay, either way of giving back (in one call where the kernel
    /// takes it).
    #[test]
    fn given_back_runs_leave_the_resident_set_and_the_rest_stays() {
        let unit = unit_bytes();
        for vectored in [true, false] {
            let region = map_region().expect("address space");
            let at = |units: usize| {
                // SAFETY: inside the region (8 units of a 2 MiB region).
                NonNull::new(unsafe { region.as_ptr().add(units * unit) }).unwrap()
            };
            // SAFETY: the region is this test's own fresh mapping, at
            // least 8 units long.
            unsafe { std::ptr::write_bytes(region.as_ptr(), 7, 8 * unit) };
            assert_eq!(resident_units(region, 8), vec![true; 8]);
            let runs = [(at(0), unit), (at(2), 2 * unit), (at(5), unit)];
            if vectored {
                // Called apart from its fallback, which would hide a
                // wrong call.
                match drop_pages_at_once(&runs) {
                    Ok(bytes) => assert_eq!(bytes, 4 * unit),
                    // Where it was measured the kernel takes it: a wrong
                    // call refused there is a bug, not an old kernel.
                    Err(VectoredDrop::Refused) if !kernel_at_least(6, 18) => {
                        eprintln!("this kernel refuses process_madvise(PIDFD_SELF, MADV_DONTNEED): checking the fallback only");
                        assert_eq!(drop_pages(&runs), 4 * unit);
                    }
                    Err(why) => panic!("{why:?}: {}", std::io::Error::last_os_error()),
                }
            } else {
                assert_eq!(drop_each(&runs), 4 * unit);
            }
            assert_eq!(
                resident_units(region, 8),
                [false, true, false, false, true, false, true, true],
                "vectored: {vectored}"
            );
            // SAFETY: the region is this test's own, and nothing refers
            // to it any more.
            unsafe { libc::munmap(region.as_ptr().cast(), REGION_BYTES) };
        }
    }

    /// Whether the running kernel's release is at least `major.minor`.
    fn kernel_at_least(major: u32, minor: u32) -> bool {
        // SAFETY: `utsname` is arrays of `c_char`, for which zero bytes
        // are a valid value.
        let mut name: libc::utsname = unsafe { std::mem::zeroed() };
        // SAFETY: `uname` fills the struct it is given, which lives
        // through the call.
        assert_eq!(unsafe { libc::uname(&mut name) }, 0);
        let release: String = name
            .release
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        let mut parts = release.split(|c: char| !c.is_ascii_digit());
        let mut next = || {
            parts
                .next()
                .and_then(|p| p.parse::<u32>().ok())
                .unwrap_or(0)
        };
        (next(), next()) >= (major, minor)
    }

    /// A call that stopped partway leaves the rest of its runs, from
    /// inside the run it stopped in.
    #[test]
    fn the_runs_after_a_partial_drop_start_where_it_stopped() {
        let unit = unit_bytes();
        let region = map_region().expect("address space");
        let at = |units: usize| NonNull::new(region.as_ptr().wrapping_add(units * unit)).unwrap();
        let runs = [(at(0), 2 * unit), (at(3), unit), (at(6), 3 * unit)];
        assert_eq!(runs_after(&runs, 0), runs.to_vec());
        assert_eq!(
            runs_after(&runs, unit),
            vec![(at(1), unit), (at(3), unit), (at(6), 3 * unit)]
        );
        assert_eq!(runs_after(&runs, 3 * unit), vec![(at(6), 3 * unit)]);
        assert_eq!(runs_after(&runs, 6 * unit), vec![]);
    }
}
