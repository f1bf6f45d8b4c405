//! Free space of the data area.
//!
//! Free space is not stored on disk: after mount it is the data area minus
//! every file's extents ([`UsedBuilder`], fed by a background scan: see
//! `free_space`), which also detects two extents claiming the same block.
//! After that, the allocator is pure memory.
//!
//! Free blocks are a bitmap of the data area in groups of 32768 blocks
//! ([`bitmap`]): memory does not grow with fragmentation. A group all
//! free or all used keeps no bitmap, so an unfragmented device costs a few
//! dozen bytes per group; the worst case (every other block free: as many
//! free runs as blocks in use) is one bit per block, 2.5 MiB for 80 GiB of
//! 4 KiB blocks, where a tree of free ranges took hundreds of MiB. Free
//! runs are coalesced across groups everywhere outside [`bitmap`]: a free
//! range, a count of them, the largest, and an allocation may span groups.
//! [`Allocator::memory_bytes`] estimates the heap this takes (busy ranges
//! included); the tree of free ranges it replaced took about 55 bytes per
//! free range by the same estimate ([`bitmap::btree_heap_bytes`]).
//!
//! Cost of an allocation: a write whose file block before is a hole (the
//! metadata-scale layout: every other block) has no hint, so it is a best
//! fit; on a group filling from the front that is constant time (the group
//! remembers the longest run before where it fills from, and its free
//! suffix ends a run without a walk), not a walk of the group's bitmap.
//!
//! Fault model: a power cut may lose every metadata change after the last
//! durable journal record. If space freed by a not-yet-durable record (a
//! punch, a truncate, a delete) were handed to another file and written, a
//! crash would roll the free back and the old owner would read the new
//! owner's data (invariant 1, "no stale data"). So freed space is **busy**,
//! as XFS does with busy extents, and stays busy until a *checkpoint* that
//! contains the freeing record is durable ([`Allocator::release_busy`]),
//! not merely its journal batch: damage that destroys the last journal
//! batches cannot be told from a torn tail, and mount then comes up in the
//! older state. Blocks freed by the lost batches must still hold nothing but
//! their old owner's bytes. Mount keeps the space freed by replayed records
//! busy too ([`Allocator::hold_busy`]), for the same reason. Busy ranges
//! stay a map: they are bounded by what is freed between checkpoints.
//!
//! Every device range handed in is checked against the allocator's own view
//! (in the data area, aligned, entirely used for a free, entirely free for
//! `mark_used`); a violation is an error naming the range, never a silent
//! double ownership.

pub mod bitmap;

use std::collections::{BTreeMap, BTreeSet};

use bitmap::{Builder, FreeBitmap, GROUP_BLOCKS};

/// How many free extents past the hint an allocation looks at for one big
/// enough, before settling for the best fit anywhere. Bounds the cost of a
/// hinted allocation on a fragmented device; a file that cannot continue
/// near its last extent is fragmented anyway.
pub const HINT_SEARCH_LIMIT: usize = 64;

/// The data area, in device bytes, and the checks of ranges handed in.
#[derive(Clone, Copy, Debug)]
struct Area {
    block_size: u64,
    data_start: u64,
    data_end: u64,
}

/// Free, busy and (implicitly) used space of the data area, in device bytes.
///
/// Free blocks are a [`FreeBitmap`]; busy ranges a map. Used space is not
/// stored; it is whatever is neither free nor busy.
#[derive(Clone, Debug)]
pub struct Allocator {
    area: Area,
    /// Block `i` is `data_start + i * block_size`.
    free: FreeBitmap,
    /// addr -> (len, seq of the record that freed it). Not coalesced: ranges
    /// freed by different records leave busy at different times.
    busy: BTreeMap<u64, (u64, u64)>,
    /// (seq, addr), mirrors `busy`, so releasing is a prefix scan.
    busy_by_seq: BTreeSet<(u64, u64)>,
    busy_bytes: u64,
}

/// Builds the allocator of a data area from the ranges in use, given one
/// at a time in any order (mount's scan, fsck): no list of them is kept.
#[derive(Debug)]
pub struct UsedBuilder {
    area: Area,
    free: Builder,
}

impl UsedBuilder {
    /// Claims `[addr, addr + len)` as used. Fails, naming the range, on
    /// what [`Allocator::mark_used`] refuses: outside the data area,
    /// misaligned, or overlapping a range claimed before (the builder is
    /// then only good for dropping).
    pub fn mark_used(&mut self, addr: u64, len: u64) -> Result<(), String> {
        let end = self.area.validate_range("mark used", addr, len)?;
        let (lo, hi) = self.area.blocks(addr, end);
        self.free.claim(lo, hi).map_err(|_| {
            format!(
                "mark used {}: already used (by another extent)",
                range(addr, end)
            )
        })
    }

    pub fn finish(self) -> Allocator {
        Allocator::from_bitmap(self.area, self.free.finish())
    }
}

impl Area {
    fn new(data_start: u64, data_len: u64, block_size: u32) -> Area {
        assert!(block_size > 0, "allocator: block size must not be 0");
        let bs = u64::from(block_size);
        debug_assert!(
            data_start.is_multiple_of(bs) && data_len.is_multiple_of(bs),
            "data area {data_start}+{data_len} not aligned to {bs}"
        );
        let end = data_start.saturating_add(data_len);
        let start = data_start.div_ceil(bs).saturating_mul(bs);
        let end = (end - end % bs).max(start);
        Area {
            block_size: bs,
            data_start: start,
            data_end: end,
        }
    }

    fn block_count(&self) -> u64 {
        (self.data_end - self.data_start) / self.block_size
    }

    /// The block indexes of a validated byte range.
    fn blocks(&self, addr: u64, end: u64) -> (u64, u64) {
        (
            (addr - self.data_start) / self.block_size,
            (end - self.data_start) / self.block_size,
        )
    }

    fn addr(&self, block: u64) -> u64 {
        self.data_start + block * self.block_size
    }

    /// Rejects empty, misaligned, overflowing or out-of-area ranges; returns
    /// the range's end. No `debug_assert!`: `mark_used` gets these from disk,
    /// and tests feed corrupt images to debug builds expecting an error.
    fn validate_range(&self, what: &str, addr: u64, len: u64) -> Result<u64, String> {
        let bs = self.block_size;
        if len == 0 {
            return Err(format!("{what} {addr}+0: empty range"));
        }
        let Some(end) = addr.checked_add(len) else {
            return Err(format!("{what} {addr}+{len}: end overflows"));
        };
        if !addr.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(format!(
                "{what} {}: not aligned to the block size {bs}",
                range(addr, end)
            ));
        }
        if addr < self.data_start || end > self.data_end {
            return Err(format!(
                "{what} {}: outside the data area {}",
                range(addr, end),
                range(self.data_start, self.data_end)
            ));
        }
        Ok(end)
    }

    fn check_stored(&self, what: &str, a: u64, l: u64) -> Result<(), String> {
        if l == 0 || !a.is_multiple_of(self.block_size) || !l.is_multiple_of(self.block_size) {
            return Err(format!(
                "{what} {a}+{l}: empty or not aligned to {}",
                self.block_size
            ));
        }
        match a.checked_add(l) {
            Some(end) if a >= self.data_start && end <= self.data_end => Ok(()),
            _ => Err(format!("{what} {a}+{l}: outside the data area")),
        }
    }
}

impl Allocator {
    /// A data area `[data_start, data_start + data_len)` that is all free.
    ///
    /// The superblock decoder guarantees alignment; if it ever did not, only
    /// the whole blocks inside the area are used, so nothing outside it can
    /// be handed out.
    ///
    /// # Panics
    /// If `block_size` is 0 (see [`crate::extent_map::ExtentMap::new`]).
    pub fn new(data_start: u64, data_len: u64, block_size: u32) -> Self {
        Allocator::builder(data_start, data_len, block_size).finish()
    }

    /// [`Allocator::new`] with groups of `group_blocks` blocks (a positive
    /// multiple of 64), so that tests cross group boundaries on small
    /// devices.
    #[cfg(test)]
    fn with_group_blocks(
        data_start: u64,
        data_len: u64,
        block_size: u32,
        group_blocks: u32,
    ) -> Self {
        Allocator::builder_in_groups(data_start, data_len, block_size, group_blocks).finish()
    }

    /// A builder of the allocator of this data area: every block free
    /// until [`UsedBuilder::mark_used`] claims it.
    pub fn builder(data_start: u64, data_len: u64, block_size: u32) -> UsedBuilder {
        Allocator::builder_in_groups(data_start, data_len, block_size, GROUP_BLOCKS)
    }

    fn builder_in_groups(
        data_start: u64,
        data_len: u64,
        block_size: u32,
        group_blocks: u32,
    ) -> UsedBuilder {
        let area = Area::new(data_start, data_len, block_size);
        UsedBuilder {
            area,
            free: Builder::new(area.block_count(), group_blocks),
        }
    }

    fn from_bitmap(area: Area, free: FreeBitmap) -> Allocator {
        Allocator {
            area,
            free,
            busy: BTreeMap::new(),
            busy_by_seq: BTreeSet::new(),
            busy_bytes: 0,
        }
    }

    pub fn block_size(&self) -> u32 {
        // Built from a `u32` in `new`.
        self.area.block_size as u32
    }

    pub fn data_start(&self) -> u64 {
        self.area.data_start
    }

    pub fn data_len(&self) -> u64 {
        self.area.data_end - self.area.data_start
    }

    /// The allocator of a data area in which exactly `used` is used, built
    /// with [`Allocator::builder`] in `used`'s order. Fails on the first
    /// range that the ranges before it make [`Allocator::mark_used`]
    /// refuse, with its index in `used`.
    pub fn with_used(
        data_start: u64,
        data_len: u64,
        block_size: u32,
        used: &[(u64, u64)],
    ) -> Result<Allocator, (usize, String)> {
        let mut builder = Allocator::builder(data_start, data_len, block_size);
        for (i, &(addr, len)) in used.iter().enumerate() {
            builder.mark_used(addr, len).map_err(|e| (i, e))?;
        }
        Ok(builder.finish())
    }

    /// Claims `[addr, addr + len)` for an extent found at mount. Fails if any
    /// part is outside the data area, already used or busy: two extents
    /// sharing a block is corruption, and this is where it shows.
    pub fn mark_used(&mut self, addr: u64, len: u64) -> Result<(), String> {
        let end = self.area.validate_range("mark used", addr, len)?;
        let (lo, hi) = self.area.blocks(addr, end);
        if self.free.next_used(lo, hi) == hi {
            self.free.set_used(lo, hi);
            return Ok(());
        }
        Err(match self.busy_overlapping(addr, end) {
            Some((b, bl, seq)) => format!(
                "mark used {}: overlaps busy space {} freed by journal record {seq}",
                range(addr, end),
                range(b, b + bl)
            ),
            None => format!(
                "mark used {}: already used (by another extent)",
                range(addr, end)
            ),
        })
    }

    /// One contiguous chunk for `want` bytes: `(addr, len)`.
    ///
    /// Preference order: at `hint` (the device end of the file's previous
    /// extent, so the file stays contiguous) or in one of the
    /// [`HINT_SEARCH_LIMIT`] free extents after it; else a best fit, so
    /// big extents stay big: approximately the smallest free extent that
    /// fits (see [`FreeBitmap::best_fit`]: the smallest fitting one in the
    /// group whose largest fits most tightly), or, for a chunk no group
    /// holds whole, the first free extent that fits, across groups; else,
    /// when nothing fits, the largest free extent (the first of equals),
    /// shorter than `want`. `None` only when nothing is free. Busy space
    /// is never returned: a caller short of space should commit the
    /// journal, [`Allocator::release_busy`], and retry.
    ///
    /// `want` is a multiple of the block size; were it not, it is rounded
    /// down, so a chunk never exceeds what was asked.
    pub fn alloc(&mut self, want: u64, hint: Option<u64>) -> Option<(u64, u64)> {
        let bs = self.area.block_size;
        debug_assert!(
            want > 0 && want.is_multiple_of(bs),
            "alloc({want}) not a positive multiple of {bs}"
        );
        let want = want / bs;
        if want == 0 || self.free.free_blocks() == 0 {
            return None;
        }
        let near = hint.and_then(|hint| self.find_near(hint, want));
        let (at, got) = match near
            .or_else(|| self.free.best_fit(want))
            .or_else(|| self.free.first_run_of(want))
        {
            Some(at) => (at, want),
            None => {
                let largest = self.free.largest();
                (self.free.first_run_of(largest)?, largest)
            }
        };
        self.free.set_used(at, at + got);
        Some((self.area.addr(at), got * bs))
    }

    /// Releases `[addr, addr + len)`, freed by journal record `seq`. It stays
    /// busy, not allocatable, until [`Allocator::release_busy`] passes `seq`.
    /// Fails, changing nothing, unless the whole range is used.
    pub fn free(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        self.check_used("free", addr, len)?;
        self.insert_busy(addr, len, seq);
        Ok(())
    }

    /// Releases `[addr, addr + len)` for immediate reuse. Only for space
    /// whose freeing is already durable (recovery, replay). Fails, changing
    /// nothing, unless the whole range is used.
    pub fn free_now(&mut self, addr: u64, len: u64) -> Result<(), String> {
        let end = self.check_used("free", addr, len)?;
        let (lo, hi) = self.area.blocks(addr, end);
        self.free.set_free(lo, hi);
        Ok(())
    }

    /// Keeps the free parts of `[addr, addr + len)` busy as if journal
    /// record `seq` had just freed them: for space freed by records that
    /// replay applied, which only the journal (no checkpoint yet) records.
    /// Parts that are not free (reused by a later record) are left alone.
    pub fn hold_busy(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        let end = self.area.validate_range("hold busy", addr, len)?;
        let (mut lo, hi) = self.area.blocks(addr, end);
        while let Some(s) = self.free.next_free(lo, hi) {
            let e = self.free.next_used(s, hi);
            self.free.set_used(s, e);
            let (a, bs) = (self.area.addr(s), self.area.block_size);
            self.insert_busy(a, (e - s) * bs, seq);
            lo = e;
        }
        Ok(())
    }

    /// Joins the range to a neighbour freed by the same record, before or
    /// after it: they leave busy together, and a file whose extents lay
    /// end to end on the device (allocated in order) keeps one busy range
    /// when deleted, not one per extent (a 4M-extent file's took 225 MB).
    fn insert_busy(&mut self, addr: u64, len: u64, seq: u64) {
        self.busy_bytes += len;
        let (mut start, mut end) = (addr, addr + len);
        if let Some((&s, &(l, sq))) = self.busy.range(..addr).next_back() {
            if s + l == addr && sq == seq {
                self.busy.remove(&s);
                self.busy_by_seq.remove(&(seq, s));
                start = s;
            }
        }
        if let Some(&(l, sq)) = self.busy.get(&end) {
            if sq == seq {
                self.busy.remove(&end);
                self.busy_by_seq.remove(&(seq, end));
                end += l;
            }
        }
        self.busy.insert(start, (end - start, seq));
        self.busy_by_seq.insert((seq, start));
    }

    /// A checkpoint holding every record through `up_to_seq` is durable:
    /// space those records freed becomes allocatable.
    pub fn release_busy(&mut self, up_to_seq: u64) {
        while self.release_busy_at_most(up_to_seq, usize::MAX) {}
    }

    /// [`Allocator::release_busy`] of at most `max_ranges` busy ranges, so
    /// that a caller holding a lock others wait for can release a large
    /// backlog (a mass punch) in bounded steps. Returns whether busy space
    /// freed through `up_to_seq` remains.
    pub fn release_busy_at_most(&mut self, up_to_seq: u64, max_ranges: usize) -> bool {
        for _ in 0..max_ranges {
            match self.busy_by_seq.first() {
                Some(&(seq, addr)) if seq <= up_to_seq => {
                    self.busy_by_seq.remove(&(seq, addr));
                    if let Some((len, _)) = self.busy.remove(&addr) {
                        self.busy_bytes -= len;
                        let (lo, hi) = self.area.blocks(addr, addr + len);
                        self.free.set_free(lo, hi);
                    }
                }
                _ => return false,
            }
        }
        self.busy_by_seq
            .first()
            .is_some_and(|&(seq, _)| seq <= up_to_seq)
    }

    /// Bytes allocatable now (excluding busy space).
    pub fn free_bytes(&self) -> u64 {
        self.free.free_blocks() * self.area.block_size
    }

    /// The length of the largest free range (0: none).
    pub fn largest_free_extent(&self) -> u64 {
        self.free.largest() * self.area.block_size
    }

    /// The `k` largest free ranges `(addr, len)`, largest first (the
    /// lowest address among equals, also in choosing which of equals
    /// make the `k`): what a clean unmount leaves the next mount to
    /// allocate from while its scan runs.
    pub fn largest_free(&self, k: usize) -> Vec<(u64, u64)> {
        let bs = self.area.block_size;
        self.free
            .largest_runs(k)
            .into_iter()
            .map(|(s, n)| (self.area.addr(s), n * bs))
            .collect()
    }

    /// How many free ranges there are (busy ones not counted).
    pub fn free_extent_count(&self) -> usize {
        self.free.run_count() as usize
    }

    /// Bytes freed but waiting for their journal record to be durable.
    pub fn busy_bytes(&self) -> u64 {
        self.busy_bytes
    }

    /// Bytes owned by extents.
    pub fn used_bytes(&self) -> u64 {
        self.data_len() - self.free_bytes() - self.busy_bytes
    }

    /// Free extents `(addr, len)` in address order, coalesced.
    pub fn free_extents(&self) -> Vec<(u64, u64)> {
        let bs = self.area.block_size;
        self.free
            .runs(0, self.area.block_count())
            .map(|(s, n)| (self.area.addr(s), n * bs))
            .collect()
    }

    /// Busy ranges `(addr, len, seq of the record that freed them)` in
    /// address order.
    pub fn busy_ranges(&self) -> Vec<(u64, u64, u64)> {
        self.busy
            .iter()
            .map(|(&a, &(l, seq))| (a, l, seq))
            .collect()
    }

    /// Heap bytes of this allocator, estimated: the free-space bitmap
    /// with its summaries, index and tree, and the busy ranges' two maps
    /// (see [`bitmap::btree_heap_bytes`]). What metadata-scale reports
    /// beside the resident set.
    pub fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(u64, (u64, u64))>();
        self.free.memory_bytes()
            + bitmap::btree_heap_bytes(self.busy.len(), entry)
            + bitmap::btree_heap_bytes(self.busy_by_seq.len(), std::mem::size_of::<(u64, u64)>())
    }

    /// Checks the invariants: the bitmap's summaries, index and counts
    /// match its bits; busy ranges aligned, inside, and disjoint from each
    /// other and from free space; the busy index mirrors its map; the byte
    /// counts match.
    pub fn check(&self) -> Result<(), String> {
        self.free.check()?;
        let mut prev_end: Option<u64> = None;
        let mut total = 0u64;
        for (&a, &(l, seq)) in &self.busy {
            self.area.check_stored("busy range", a, l)?;
            if prev_end.is_some_and(|p| p > a) {
                return Err(format!(
                    "busy range {} overlaps the previous one",
                    range(a, a + l)
                ));
            }
            let (lo, hi) = self.area.blocks(a, a + l);
            if let Some(f) = self.free.next_free(lo, hi) {
                let (s, e) = self.free_run_around(f);
                return Err(format!(
                    "free extent {} overlaps busy range {}",
                    range(s, e),
                    range(a, a + l)
                ));
            }
            if !self.busy_by_seq.contains(&(seq, a)) {
                return Err(format!(
                    "busy range {} missing from sequence index",
                    range(a, a + l)
                ));
            }
            total += l;
            prev_end = Some(a + l);
        }
        if self.busy_by_seq.len() != self.busy.len() {
            return Err(format!(
                "sequence index has {} entries for {} busy ranges",
                self.busy_by_seq.len(),
                self.busy.len()
            ));
        }
        if total != self.busy_bytes {
            return Err(format!(
                "busy byte count is {} but busy ranges add up to {total}",
                self.busy_bytes
            ));
        }
        if self.free_bytes() + total > self.data_len() {
            return Err(format!(
                "free {} and busy {total} bytes exceed the data area of {}",
                self.free_bytes(),
                self.data_len()
            ));
        }
        Ok(())
    }

    /// Validates a range to free: it must be entirely used (neither free nor
    /// busy), or it would be owned twice.
    fn check_used(&self, what: &str, addr: u64, len: u64) -> Result<u64, String> {
        let end = self.area.validate_range(what, addr, len)?;
        let (lo, hi) = self.area.blocks(addr, end);
        if let Some(f) = self.free.next_free(lo, hi) {
            let (s, e) = self.free_run_around(f);
            return Err(format!(
                "{what} {}: double free, overlaps free space {}",
                range(addr, end),
                range(s, e)
            ));
        }
        if let Some((a, l, seq)) = self.busy_overlapping(addr, end) {
            return Err(format!(
                "{what} {}: double free, overlaps space {} already freed by journal record {seq}",
                range(addr, end),
                range(a, a + l)
            ));
        }
        Ok(end)
    }

    /// The free extent holding free block `block`, in bytes.
    fn free_run_around(&self, block: u64) -> (u64, u64) {
        let s = self.free.run_start(block);
        let e = self.free.next_used(block, self.area.block_count());
        (self.area.addr(s), self.area.addr(e))
    }

    /// Some busy range `(addr, len, seq)` intersecting `[addr, end)`.
    /// Ranges are sorted and disjoint, so the last one starting before
    /// `end` has the greatest end of those that could intersect: one
    /// lookup decides.
    fn busy_overlapping(&self, addr: u64, end: u64) -> Option<(u64, u64, u64)> {
        let (&s, &(l, seq)) = self.busy.range(..end).next_back()?;
        (s + l > addr).then_some((s, l, seq))
    }

    /// A place for `want` blocks at block `hint` or in one of the
    /// [`HINT_SEARCH_LIMIT`] free extents starting after it.
    fn find_near(&self, hint: u64, want: u64) -> Option<u64> {
        let hint = hint.checked_next_multiple_of(self.area.block_size)?;
        let blocks = self.area.block_count();
        let mut from = if hint < self.area.data_start {
            0
        } else {
            let h = (hint - self.area.data_start) / self.area.block_size;
            if h >= blocks {
                return None;
            }
            let e = self.free.next_used(h, h.saturating_add(want));
            if e - h >= want {
                return Some(h);
            }
            // Past the free extent holding the hint (it starts before the
            // hint), or the hint itself, used.
            e
        };
        for _ in 0..HINT_SEARCH_LIMIT {
            let s = self.free.next_free(from, blocks)?;
            let e = self.free.next_used(s, s.saturating_add(want));
            if e - s >= want {
                return Some(s);
            }
            from = e;
        }
        None
    }
}

fn range(start: u64, end: u64) -> String {
    format!("[{start}, {end})")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BS: u64 = 4096;

    #[test]
    fn new_is_one_free_chunk() {
        let a = Allocator::new(10 * BS, 100 * BS, BS as u32);
        assert_eq!(a.free_extents(), vec![(10 * BS, 100 * BS)]);
        assert_eq!(a.free_bytes(), 100 * BS);
        assert_eq!(a.used_bytes(), 0);
        a.check().unwrap();
    }

    #[test]
    fn mark_used_detects_overlap_and_bounds() {
        let mut a = Allocator::new(10 * BS, 100 * BS, BS as u32);
        a.mark_used(20 * BS, 5 * BS).unwrap();
        let err = a.mark_used(24 * BS, 2 * BS).unwrap_err();
        assert!(
            err.contains("already used") && err.contains(&format!("{}", 24 * BS)),
            "{err}"
        );
        let err = a.mark_used(5 * BS, 2 * BS).unwrap_err();
        assert!(err.contains("outside the data area"), "{err}");
        let err = a.mark_used(109 * BS, 2 * BS).unwrap_err();
        assert!(err.contains("outside the data area"), "{err}");
        assert!(a
            .mark_used(30 * BS + 1, BS)
            .unwrap_err()
            .contains("aligned"));
        assert!(a.mark_used(30 * BS, 0).unwrap_err().contains("empty"));
        assert!(a
            .mark_used(u64::MAX - BS + 1, 2 * BS)
            .unwrap_err()
            .contains("overflow"));
        assert_eq!(a.used_bytes(), 5 * BS);
        a.check().unwrap();
    }

    #[test]
    fn busy_space_is_not_reused_until_released() {
        let mut a = Allocator::new(0, 4 * BS, BS as u32);
        assert_eq!(a.alloc(4 * BS, None), Some((0, 4 * BS)));
        assert_eq!(a.alloc(BS, None), None);
        a.free(BS, 2 * BS, 7).unwrap();
        assert_eq!(a.busy_bytes(), 2 * BS);
        assert_eq!(a.alloc(BS, None), None, "busy space must not be handed out");
        assert!(a.free(2 * BS, BS, 8).unwrap_err().contains("double free"));
        a.release_busy(6);
        assert_eq!(a.free_bytes(), 0);
        a.release_busy(7);
        assert_eq!(a.free_extents(), vec![(BS, 2 * BS)]);
        assert!(a.free_now(BS, BS).unwrap_err().contains("double free"));
        a.free_now(0, BS).unwrap();
        a.free_now(3 * BS, BS).unwrap();
        assert_eq!(a.free_extents(), vec![(0, 4 * BS)], "coalesced");
        a.check().unwrap();
    }

    #[test]
    fn busy_space_is_released_in_bounded_steps_oldest_first() {
        let mut a = Allocator::new(0, 8 * BS, BS as u32);
        assert_eq!(a.alloc(8 * BS, None), Some((0, 8 * BS)));
        // Freed by records 1..=5, one block each (the blocks the test
        // always used: it computed the last by a wrapping subtraction,
        // which a debug build refuses).
        for (seq, block) in (1..=5u64).zip([6, 4, 2, 0, 7]) {
            a.free(block * BS, BS, seq).unwrap();
        }
        assert_eq!(a.busy_bytes(), 5 * BS);
        assert!(a.release_busy_at_most(4, 2), "records 3 and 4 still busy");
        assert_eq!(a.free_bytes(), 2 * BS);
        assert!(!a.release_busy_at_most(4, 2), "nothing through 4 left");
        assert_eq!(a.free_bytes(), 4 * BS);
        assert_eq!(
            a.busy_bytes(),
            BS,
            "record 5's block waits for its checkpoint"
        );
        assert!(!a.release_busy_at_most(4, 2));
        assert_eq!(a.busy_bytes(), BS);
        a.check().unwrap();
    }

    /// Ranges one record frees end to end are one busy range, joined on
    /// either side and across a gap filled later; ranges of different
    /// records stay apart and leave busy each with its record.
    #[test]
    fn ranges_one_record_frees_end_to_end_are_one_busy_range() {
        let mut a = Allocator::new(0, 10 * BS, BS as u32);
        assert_eq!(a.alloc(10 * BS, None), Some((0, 10 * BS)));
        a.free(2 * BS, BS, 5).unwrap();
        a.free(3 * BS, BS, 5).unwrap();
        a.free(BS, BS, 5).unwrap();
        assert_eq!(a.busy_ranges(), vec![(BS, 3 * BS, 5)]);
        // Record 6 beside record 5's range: its own.
        a.free(4 * BS, BS, 6).unwrap();
        // A gap between two of record 7's ranges, filled by record 7.
        a.free(6 * BS, BS, 7).unwrap();
        a.free(8 * BS, 2 * BS, 7).unwrap();
        a.free(7 * BS, BS, 7).unwrap();
        assert_eq!(
            a.busy_ranges(),
            vec![(BS, 3 * BS, 5), (4 * BS, BS, 6), (6 * BS, 4 * BS, 7)]
        );
        assert_eq!(a.busy_bytes(), 8 * BS);
        a.check().unwrap();
        a.release_busy(6);
        assert_eq!(a.free_extents(), vec![(BS, 4 * BS)]);
        assert_eq!(a.busy_ranges(), vec![(6 * BS, 4 * BS, 7)]);
        a.check().unwrap();
        a.release_busy(7);
        assert_eq!(a.free_extents(), vec![(BS, 4 * BS), (6 * BS, 4 * BS)]);
        a.check().unwrap();
    }

    #[test]
    fn hold_busy_takes_only_the_free_parts() {
        let mut a = Allocator::new(0, 8 * BS, BS as u32);
        assert_eq!(a.alloc(8 * BS, None), Some((0, 8 * BS)));
        a.free_now(0, 2 * BS).unwrap();
        a.free_now(3 * BS, 2 * BS).unwrap();
        a.free_now(6 * BS, BS).unwrap();
        // [BS, 7 BS): free at 1, 3..5, 6; used at 2 and 5.
        a.hold_busy(BS, 6 * BS, 9).unwrap();
        assert_eq!(a.free_extents(), vec![(0, BS)]);
        assert_eq!(a.busy_bytes(), 4 * BS);
        assert_eq!(a.alloc(BS, None), Some((0, BS)));
        assert_eq!(a.alloc(BS, None), None, "held space must not be handed out");
        a.check().unwrap();
        a.release_busy(9);
        assert_eq!(
            a.free_extents(),
            vec![(BS, BS), (3 * BS, 2 * BS), (6 * BS, BS)]
        );
        a.check().unwrap();
    }

    #[test]
    fn alloc_prefers_hint_then_best_fit_then_largest() {
        let mut a = Allocator::new(0, 100 * BS, BS as u32);
        // Free: [0,10) [20,23) [30,100) after marking the rest used.
        a.mark_used(10 * BS, 10 * BS).unwrap();
        a.mark_used(23 * BS, 7 * BS).unwrap();
        assert_eq!(a.alloc(2 * BS, Some(40 * BS)), Some((40 * BS, 2 * BS)));
        // Hint in a too-short extent: the next one after it that fits.
        assert_eq!(a.alloc(5 * BS, Some(21 * BS)), Some((30 * BS, 5 * BS)));
        // No hint: best fit is the 3-block extent.
        assert_eq!(a.alloc(3 * BS, None), Some((20 * BS, 3 * BS)));
        // Too big for anything: the largest chunk.
        let largest = a.free_extents().into_iter().max_by_key(|e| e.1).unwrap();
        assert_eq!(a.alloc(1000 * BS, None), Some(largest));
        a.check().unwrap();
    }

    /// A large allocation on an empty device is one extent, across groups,
    /// and the next one continues it through the hint.
    #[test]
    fn large_allocations_cross_groups_as_one_extent() {
        let g = u64::from(GROUP_BLOCKS);
        let blocks = 3 * g + 100;
        let mut a = Allocator::new(16 * BS, blocks * BS, BS as u32);
        let first = (2 * g + 5) * BS;
        assert_eq!(a.alloc(first, None), Some((16 * BS, first)));
        let end = 16 * BS + first;
        assert_eq!(a.alloc(g * BS, Some(end)), Some((end, g * BS)));
        assert_eq!(a.free_extent_count(), 1);
        assert_eq!(a.largest_free_extent(), (blocks - 3 * g - 5) * BS);
        a.check().unwrap();
        // Freed whole again, coalesced across every group boundary.
        a.free_now(16 * BS, first + g * BS).unwrap();
        assert_eq!(a.free_extents(), vec![(16 * BS, blocks * BS)]);
        assert_eq!(a.largest_free_extent(), blocks * BS);
        a.check().unwrap();
    }

    /// Every other block used (as many free ranges as extents): memory is
    /// one bit per block and a few words per group, however many free
    /// ranges (a tree of free ranges, as before the bitmap, holds two
    /// 16-byte entries per range plus its nodes' overhead); none when
    /// unfragmented. Busy ranges are counted too.
    #[test]
    fn memory_is_the_bitmap_and_summaries_not_per_range() {
        // Per group: its summary, two tree nodes and an index entry, with
        // room to spare (about 140 bytes on x86-64).
        const PER_GROUP: usize = 256;
        let blocks = 1u64 << 20;
        let groups = blocks.div_ceil(u64::from(GROUP_BLOCKS)) as usize;
        let summaries = groups * PER_GROUP;
        let empty = Allocator::new(0, blocks * BS, BS as u32);
        assert!(empty.memory_bytes() < summaries, "{}", empty.memory_bytes());
        // Large extents, whole groups used: no bitmap kept either.
        let g = u64::from(GROUP_BLOCKS);
        let mut b = Allocator::builder(0, blocks * BS, BS as u32);
        b.mark_used(g * BS, 3 * g * BS).unwrap();
        b.mark_used(0, g * BS).unwrap();
        let a = b.finish();
        a.check().unwrap();
        assert_eq!(a.free_extents(), vec![(4 * g * BS, (blocks - 4 * g) * BS)]);
        assert!(a.memory_bytes() < summaries, "{}", a.memory_bytes());
        let mut b = Allocator::builder(0, blocks * BS, BS as u32);
        for blk in (0..blocks / 2).rev().map(|i| 2 * i) {
            b.mark_used(blk * BS, BS).unwrap();
        }
        let mut a = b.finish();
        a.check().unwrap();
        let ranges = a.free_extent_count();
        assert_eq!(ranges as u64, blocks / 2);
        assert_eq!(a.largest_free_extent(), BS);
        let bitmap = (blocks / 8) as usize;
        let mem = a.memory_bytes();
        assert!(
            (bitmap..=bitmap + summaries).contains(&mem),
            "{mem} bytes for {blocks} blocks: not the bitmap ({bitmap}) plus summaries"
        );
        assert!(
            mem * 100 < ranges * 32,
            "{mem} bytes: not far below a tree's 32 bytes per free range ({ranges})"
        );
        // Nothing fits two blocks: the largest, shorter.
        assert_eq!(a.alloc(2 * BS, None), Some((BS, BS)));
        a.check().unwrap();
        // Busy ranges: an entry in each of two maps, per range.
        let before = a.memory_bytes();
        for blk in (2..1026u64).step_by(2) {
            a.free(blk * BS, BS, 1).unwrap();
        }
        let busy = a.memory_bytes() - before;
        assert!(
            (512 * 40..=512 * 120).contains(&busy),
            "512 busy ranges counted as {busy} bytes"
        );
    }

    // ---- model test -------------------------------------------------------

    const START: u64 = 8;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum B {
        Free,
        Busy(u64),
        Used,
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc {
            nblk: u64,
            hint: Option<u64>,
        },
        /// Free (part of) the `pick`-th allocated chunk.
        Free {
            pick: usize,
            now: bool,
            skip: u64,
            nblk: u64,
        },
        /// Free an arbitrary range: must fail unless entirely used.
        FreeAny {
            blk: u64,
            nblk: u64,
        },
        MarkUsed {
            blk: u64,
            nblk: u64,
        },
        HoldBusy {
            blk: u64,
            nblk: u64,
        },
        Release {
            back: u64,
        },
    }

    /// Ops on a device of `blocks` blocks (block numbers from 0, the
    /// data area from `START`): ranges reach past both ends of it.
    fn op(blocks: u64) -> impl Strategy<Value = Op> {
        let any_blk = 0..blocks + 2 * START;
        let big = (blocks / 2).max(2);
        prop_oneof![
            4 => (1..20u64, prop::option::of(any_blk.clone()))
                .prop_map(|(nblk, hint)| Op::Alloc { nblk, hint }),
            1 => (1..big, prop::option::of(any_blk.clone()))
                .prop_map(|(nblk, hint)| Op::Alloc { nblk, hint }),
            4 => (any::<usize>(), any::<bool>(), 0..4u64, 1..8u64)
                .prop_map(|(pick, now, skip, nblk)| Op::Free { pick, now, skip, nblk }),
            1 => (any_blk.clone(), 1..6u64).prop_map(|(blk, nblk)| Op::FreeAny { blk, nblk }),
            1 => (any_blk.clone(), 1..6u64).prop_map(|(blk, nblk)| Op::MarkUsed { blk, nblk }),
            1 => (any_blk, 1..80u64).prop_map(|(blk, nblk)| Op::HoldBusy { blk, nblk }),
            2 => (0..4u64).prop_map(|back| Op::Release { back }),
        ]
    }

    /// A device geometry, `(blocks, group_blocks)`: groups of 64 or 128
    /// blocks so that ranges cross them, the last one often partial; or a
    /// device within one real group.
    fn geometry() -> impl Strategy<Value = (u64, u32)> {
        prop_oneof![
            (1..400u64, prop_oneof![Just(64u32), Just(128)]),
            (1..100u64).prop_map(|b| (b, GROUP_BLOCKS)),
        ]
    }

    fn ops() -> impl Strategy<Value = ((u64, u32), Vec<Op>)> {
        geometry().prop_flat_map(|g| (Just(g), prop::collection::vec(op(g.0), 1..100)))
    }

    /// Free runs of the model, `(index, blocks)`.
    fn free_runs(model: &[B]) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (i, b) in model.iter().enumerate() {
            if *b == B::Free {
                let i = i as u64;
                match runs.last_mut() {
                    Some((a, l)) if *a + *l == i => *l += 1,
                    _ => runs.push((i, 1)),
                }
            }
        }
        runs
    }

    /// Where the allocator is to place `nblk` blocks (indexes), by its
    /// documented policy, computed from the blocks alone.
    fn expected_alloc(model: &[B], group: u64, nblk: u64, hint: Option<u64>) -> Option<(u64, u64)> {
        let runs = free_runs(model);
        let n = model.len() as u64;
        let fits = |i: u64| i + nblk <= n && (i..i + nblk).all(|b| model[b as usize] == B::Free);
        if let Some(h) = hint {
            let after = match h.checked_sub(START) {
                None => Some(None),
                Some(h) if h < n && fits(h) => return Some((h, nblk)),
                Some(h) if h < n => Some(Some(h)),
                Some(_) => None,
            };
            if let Some(after) = after {
                let near = runs
                    .iter()
                    .filter(|r| after.is_none_or(|h| r.0 > h))
                    .take(HINT_SEARCH_LIMIT)
                    .find(|r| r.1 >= nblk);
                if let Some(&(s, _)) = near {
                    return Some((s, nblk));
                }
            }
        }
        // Runs clipped to groups; the group with the smallest largest one
        // that fits, its smallest that fits.
        let mut clipped: Vec<(u64, u64, u64)> = Vec::new(); // (group, start, len)
        for &(s, l) in &runs {
            let mut b = s;
            while b < s + l {
                let g = b / group;
                let e = (s + l).min((g + 1) * group);
                clipped.push((g, b, e - b));
                b = e;
            }
        }
        let best_group = (0..n.div_ceil(group))
            .filter_map(|g| {
                let largest = clipped.iter().filter(|c| c.0 == g).map(|c| c.2).max()?;
                (largest >= nblk).then_some((largest, g))
            })
            .min();
        if let Some((_, g)) = best_group {
            let (_, s, _) = clipped
                .iter()
                .filter(|c| c.0 == g && c.2 >= nblk)
                .min_by_key(|c| (c.2, c.1))
                .unwrap();
            return Some((*s, nblk));
        }
        if let Some(&(s, _)) = runs.iter().find(|r| r.1 >= nblk) {
            return Some((s, nblk));
        }
        let largest = runs.iter().map(|r| r.1).max()?;
        runs.iter().find(|r| r.1 == largest).copied()
    }

    /// Runs `ops` on an allocator and on a block model, checking after each
    /// op every count, the placement, the errors and `check()`.
    fn run_model((blocks, group): (u64, u32), ops: Vec<Op>) -> Result<(), TestCaseError> {
        let mut a = Allocator::with_group_blocks(START * BS, blocks * BS, BS as u32, group);
        let mut model = vec![B::Free; blocks as usize];
        let in_area = |blk: u64, nblk: u64| blk >= START && blk + nblk <= START + blocks;
        let all = |model: &[B], blk: u64, nblk: u64, want: B| {
            in_area(blk, nblk) && (blk..blk + nblk).all(|b| model[(b - START) as usize] == want)
        };
        // Allocated chunks, in block numbers, that the test may free.
        let mut chunks: Vec<(u64, u64)> = Vec::new();
        let mut seq = 0u64;
        for op in ops {
            match op {
                Op::Alloc { nblk, hint } => {
                    let want = expected_alloc(&model, u64::from(group), nblk, hint)
                        .map(|(i, n)| ((START + i) * BS, n * BS));
                    let got = a.alloc(nblk * BS, hint.map(|h| h * BS));
                    prop_assert_eq!(got, want, "alloc {} hint {:?}", nblk, hint);
                    if let Some((addr, len)) = got {
                        let (blk, n) = (addr / BS, len / BS);
                        for b in blk..blk + n {
                            model[(b - START) as usize] = B::Used;
                        }
                        chunks.push((blk, n));
                    }
                }
                Op::Free {
                    pick,
                    now,
                    skip,
                    nblk,
                } => {
                    if chunks.is_empty() {
                        continue;
                    }
                    let i = pick % chunks.len();
                    let (cb, cn) = chunks[i];
                    let skip = skip.min(cn - 1);
                    let nblk = nblk.min(cn - skip);
                    let (blk, end) = (cb + skip, cb + skip + nblk);
                    // Keep what remains of the chunk freeable.
                    chunks.swap_remove(i);
                    if skip > 0 {
                        chunks.push((cb, skip));
                    }
                    if end < cb + cn {
                        chunks.push((end, cb + cn - end));
                    }
                    seq += 1;
                    let r = if now {
                        a.free_now(blk * BS, nblk * BS)
                    } else {
                        a.free(blk * BS, nblk * BS, seq)
                    };
                    prop_assert!(r.is_ok(), "{:?}", r);
                    for b in blk..end {
                        model[(b - START) as usize] = if now { B::Free } else { B::Busy(seq) };
                    }
                }
                Op::FreeAny { blk, nblk } => {
                    if all(&model, blk, nblk, B::Used) {
                        // A used range may belong to a tracked chunk;
                        // freeing it here would confuse later frees.
                        continue;
                    }
                    let before = (a.free_extents(), a.busy_ranges());
                    let want = if in_area(blk, nblk) {
                        "double free"
                    } else {
                        "outside the data area"
                    };
                    let r = a.free(blk * BS, nblk * BS, seq + 1);
                    prop_assert!(r.as_ref().is_err_and(|e| e.contains(want)), "{:?}", r);
                    let r = a.free_now(blk * BS, nblk * BS);
                    prop_assert!(r.as_ref().is_err_and(|e| e.contains(want)), "{:?}", r);
                    prop_assert_eq!((a.free_extents(), a.busy_ranges()), before);
                }
                Op::MarkUsed { blk, nblk } => {
                    let r = a.mark_used(blk * BS, nblk * BS);
                    if all(&model, blk, nblk, B::Free) {
                        prop_assert!(r.is_ok(), "{:?}", r);
                        for b in blk..blk + nblk {
                            model[(b - START) as usize] = B::Used;
                        }
                        chunks.push((blk, nblk));
                    } else {
                        let busy = in_area(blk, nblk)
                            && (blk..blk + nblk)
                                .any(|b| matches!(model[(b - START) as usize], B::Busy(_)));
                        let want = if !in_area(blk, nblk) {
                            "outside the data area"
                        } else if busy {
                            "overlaps busy space"
                        } else {
                            "already used"
                        };
                        prop_assert!(r.as_ref().is_err_and(|e| e.contains(want)), "{:?}", r);
                    }
                }
                Op::HoldBusy { blk, nblk } => {
                    seq += 1;
                    let r = a.hold_busy(blk * BS, nblk * BS, seq);
                    prop_assert_eq!(r.is_ok(), in_area(blk, nblk), "{:?}", r);
                    if r.is_ok() {
                        for b in blk..blk + nblk {
                            let m = &mut model[(b - START) as usize];
                            if *m == B::Free {
                                *m = B::Busy(seq);
                            }
                        }
                    }
                }
                Op::Release { back } => {
                    let up_to = seq.saturating_sub(back);
                    a.release_busy(up_to);
                    for b in model.iter_mut() {
                        if matches!(*b, B::Busy(s) if s <= up_to) {
                            *b = B::Free;
                        }
                    }
                }
            }
            a.check().map_err(TestCaseError::fail)?;
            let count = |k: fn(&B) -> bool| model.iter().filter(|b| k(b)).count() as u64 * BS;
            prop_assert_eq!(a.free_bytes(), count(|b| *b == B::Free));
            prop_assert_eq!(a.busy_bytes(), count(|b| matches!(b, B::Busy(_))));
            prop_assert_eq!(a.used_bytes(), count(|b| *b == B::Used));
            let runs = free_runs(&model);
            let bytes: Vec<(u64, u64)> = runs
                .iter()
                .map(|&(i, n)| ((START + i) * BS, n * BS))
                .collect();
            prop_assert_eq!(a.free_extents(), bytes.clone());
            prop_assert_eq!(a.free_extent_count(), runs.len());
            let mut longest = bytes;
            longest.sort_by_key(|&(addr, len)| (std::cmp::Reverse(len), addr));
            for k in [1, 3] {
                let want: Vec<(u64, u64)> = longest.iter().take(k).copied().collect();
                prop_assert_eq!(a.largest_free(k), want, "largest_free({})", k);
            }
            prop_assert_eq!(
                a.largest_free_extent(),
                runs.iter().map(|r| r.1).max().unwrap_or(0) * BS
            );
            let mut busy = vec![None; blocks as usize];
            for (addr, len, s) in a.busy_ranges() {
                for b in addr / BS..(addr + len) / BS {
                    busy[(b - START) as usize] = Some(s);
                }
            }
            let want: Vec<Option<u64>> = model
                .iter()
                .map(|b| match b {
                    B::Busy(s) => Some(*s),
                    _ => None,
                })
                .collect();
            prop_assert_eq!(busy, want);
        }
        // Free everything: one chunk again.
        for (blk, n) in chunks {
            a.free(blk * BS, n * BS, seq + 1)
                .map_err(TestCaseError::fail)?;
        }
        a.release_busy(u64::MAX);
        prop_assert_eq!(a.free_extents(), vec![(START * BS, blocks * BS)]);
        prop_assert_eq!(a.free_extent_count(), 1);
        a.check().map_err(TestCaseError::fail)?;
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn matches_block_model((geometry, ops) in ops()) {
            run_model(geometry, ops)?;
        }

        /// The build at mount is the same allocator as marking each extent
        /// used in turn, and refuses exactly what that refuses, at the same
        /// range (ranges given in block units; some misaligned, outside or
        /// overlapping), with real groups and with groups of 64 blocks.
        #[test]
        fn with_used_matches_marking_each_range(
            ranges in prop::collection::vec((0u64..220, 1u64..80, 0u8..8), 0..24)
        ) {
            const BLOCKS: u64 = 200;
            let used: Vec<(u64, u64)> = ranges
                .iter()
                .map(|&(blk, n, skew)| (blk * BS + u64::from(skew == 0) * 512, n * BS))
                .collect();
            let mut marked = Allocator::new(START * BS, BLOCKS * BS, BS as u32);
            let mut refused = None;
            for (i, &(addr, len)) in used.iter().enumerate() {
                if marked.mark_used(addr, len).is_err() {
                    refused = Some(i);
                    break;
                }
            }
            let mut small = Allocator::builder_in_groups(START * BS, BLOCKS * BS, BS as u32, 64);
            let small_refused = used.iter().position(|&(addr, len)| small.mark_used(addr, len).is_err());
            prop_assert_eq!(small_refused, refused);
            match (Allocator::with_used(START * BS, BLOCKS * BS, BS as u32, &used), refused) {
                (Ok(built), None) => {
                    let small = small.finish();
                    for built in [&built, &small] {
                        built.check().map_err(TestCaseError::fail)?;
                        prop_assert_eq!(built.free_extents(), marked.free_extents());
                        prop_assert_eq!(built.free_extent_count(), marked.free_extent_count());
                        prop_assert_eq!(built.largest_free_extent(), marked.largest_free_extent());
                        prop_assert_eq!(built.free_bytes(), marked.free_bytes());
                        prop_assert_eq!(built.used_bytes(), marked.used_bytes());
                    }
                }
                (Err((i, _)), Some(j)) => prop_assert_eq!(i, j),
                (built, refused) => prop_assert!(
                    false,
                    "with_used {:?} but marking in turn refused {:?}",
                    built.map(|a| a.free_extents()).map_err(|e| e.1),
                    refused
                ),
            }
        }
    }
}
