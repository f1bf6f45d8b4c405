//! Free space of the data area.
//!
//! Free space is not stored on disk: after mount it is the data area minus
//! every file's extents ([`Allocator::with_used`], built by a background
//! scan: see `free_space`), which also detects two extents claiming the
//! same block. After that, the allocator is pure memory.
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
//! busy too ([`Allocator::hold_busy`]), for the same reason.
//!
//! Every device range handed in is checked against the allocator's own view
//! (in the data area, aligned, entirely used for a free, entirely free for
//! `mark_used`); a violation is an error naming the range, never a silent
//! double ownership.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

/// How many free extents past the hint an allocation looks at for one big
/// enough, before settling for the best fit anywhere. Bounds the cost of a
/// hinted allocation on a fragmented device; a file that cannot continue
/// near its last extent is fragmented anyway.
pub const HINT_SEARCH_LIMIT: usize = 64;

/// Free, busy and (implicitly) used space of the data area, in device bytes.
///
/// Free extents are kept twice, by address (to coalesce neighbours and place
/// near a hint) and by `(len, addr)` (best fit and largest chunk in
/// `O(log n)`). Free extents are always coalesced: no two touch, so "this
/// range is entirely free" is one lookup. Used space is not stored; it is
/// whatever is neither free nor busy.
#[derive(Clone, Debug)]
pub struct Allocator {
    block_size: u64,
    data_start: u64,
    data_end: u64,
    /// addr -> len.
    free: BTreeMap<u64, u64>,
    /// (len, addr), mirrors `free`.
    by_size: BTreeSet<(u64, u64)>,
    /// addr -> (len, seq of the record that freed it). Not coalesced: ranges
    /// freed by different records leave busy at different times.
    busy: BTreeMap<u64, (u64, u64)>,
    /// (seq, addr), mirrors `busy`, so releasing is a prefix scan.
    busy_by_seq: BTreeSet<(u64, u64)>,
    free_bytes: u64,
    busy_bytes: u64,
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
        assert!(block_size > 0, "allocator: block size must not be 0");
        let bs = u64::from(block_size);
        debug_assert!(
            data_start.is_multiple_of(bs) && data_len.is_multiple_of(bs),
            "data area {data_start}+{data_len} not aligned to {bs}"
        );
        let end = data_start.saturating_add(data_len);
        let start = data_start.div_ceil(bs).saturating_mul(bs);
        let end = (end - end % bs).max(start);
        let mut a = Allocator {
            block_size: bs,
            data_start: start,
            data_end: end,
            free: BTreeMap::new(),
            by_size: BTreeSet::new(),
            busy: BTreeMap::new(),
            busy_by_seq: BTreeSet::new(),
            free_bytes: 0,
            busy_bytes: 0,
        };
        if end > start {
            a.insert_free(start, end - start);
        }
        a
    }

    pub fn block_size(&self) -> u32 {
        // Built from a `u32` in `new`.
        self.block_size as u32
    }

    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    pub fn data_len(&self) -> u64 {
        self.data_end - self.data_start
    }

    /// The allocator of a data area in which exactly `used` is used (the
    /// extents found at mount), built in one pass over them sorted by
    /// address instead of one [`Allocator::mark_used`] each (a tree update
    /// per extent: a quarter of a 1M-extent mount). Fails on the first
    /// range, by address, that [`Allocator::mark_used`] would refuse, with
    /// its index in `used` (unchanged order).
    pub fn with_used(
        data_start: u64,
        data_len: u64,
        block_size: u32,
        used: &[(u64, u64)],
    ) -> Result<Allocator, (usize, String)> {
        let mut a = Allocator::new(data_start, data_len, block_size);
        a.free.clear();
        a.by_size.clear();
        let mut order: Vec<usize> = (0..used.len()).collect();
        order.sort_unstable_by_key(|&i| used[i].0);
        let mut free = Vec::with_capacity(used.len() + 1);
        let mut cursor = a.data_start;
        for &i in &order {
            let (addr, len) = used[i];
            let end = a
                .validate_range("mark used", addr, len)
                .map_err(|e| (i, e))?;
            if addr < cursor {
                return Err((
                    i,
                    format!(
                        "mark used {}: already used (by another extent)",
                        range(addr, end)
                    ),
                ));
            }
            if addr > cursor {
                free.push((cursor, addr - cursor));
            }
            cursor = end;
        }
        if cursor < a.data_end {
            free.push((cursor, a.data_end - cursor));
        }
        a.free_bytes = free.iter().map(|&(_, l)| l).sum();
        // Collected whole: sorted bulk loads, not one tree insert each.
        a.by_size = free.iter().map(|&(s, l)| (l, s)).collect();
        a.free = free.into_iter().collect();
        Ok(a)
    }

    /// Claims `[addr, addr + len)` for an extent found at mount. Fails if any
    /// part is outside the data area, already used or busy: two extents
    /// sharing a block is corruption, and this is where it shows.
    pub fn mark_used(&mut self, addr: u64, len: u64) -> Result<(), String> {
        let end = self.validate_range("mark used", addr, len)?;
        match self.free_containing(addr) {
            Some((s, l)) if s + l >= end => {
                self.take(s, l, addr, len);
                Ok(())
            }
            _ => Err(match self.busy_overlapping(addr, end) {
                Some((b, bl, seq)) => format!(
                    "mark used {}: overlaps busy space {} freed by journal record {seq}",
                    range(addr, end),
                    range(b, b + bl)
                ),
                None => format!(
                    "mark used {}: already used (by another extent)",
                    range(addr, end)
                ),
            }),
        }
    }

    /// One contiguous chunk for `want` bytes: `(addr, len)`.
    ///
    /// Preference order: at `hint` (the device end of the file's previous
    /// extent, so the file stays contiguous) or soon after it; else the
    /// smallest free extent that fits (lowest address among equals), so big
    /// extents stay big; else, when nothing fits, the largest free extent,
    /// shorter than `want`. `None` only when nothing is free. Busy space is
    /// never returned: a caller short of space should commit the journal,
    /// [`Allocator::release_busy`], and retry.
    ///
    /// `want` is a multiple of the block size; were it not, it is rounded
    /// down, so a chunk never exceeds what was asked.
    pub fn alloc(&mut self, want: u64, hint: Option<u64>) -> Option<(u64, u64)> {
        debug_assert!(
            want > 0 && want.is_multiple_of(self.block_size),
            "alloc({want}) not a positive multiple of {}",
            self.block_size
        );
        let want = want - want % self.block_size;
        if want == 0 || self.free_bytes == 0 {
            return None;
        }
        if let Some(hint) = hint {
            if let Some((s, l, at)) = self.find_near(hint, want) {
                self.take(s, l, at, want);
                return Some((at, want));
            }
        }
        let (l, s) = match self.by_size.range((want, 0)..).next() {
            Some(&fit) => fit,
            None => *self.by_size.last()?,
        };
        let got = l.min(want);
        self.take(s, l, s, got);
        Some((s, got))
    }

    /// Releases `[addr, addr + len)`, freed by journal record `seq`. It stays
    /// busy, not allocatable, until [`Allocator::release_busy`] passes `seq`.
    /// Fails, changing nothing, unless the whole range is used.
    pub fn free(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        self.check_used("free", addr, len)?;
        self.busy.insert(addr, (len, seq));
        self.busy_by_seq.insert((seq, addr));
        self.busy_bytes += len;
        Ok(())
    }

    /// Releases `[addr, addr + len)` for immediate reuse. Only for space
    /// whose freeing is already durable (recovery, replay). Fails, changing
    /// nothing, unless the whole range is used.
    pub fn free_now(&mut self, addr: u64, len: u64) -> Result<(), String> {
        self.check_used("free", addr, len)?;
        self.insert_free(addr, len);
        Ok(())
    }

    /// Keeps the free parts of `[addr, addr + len)` busy as if journal
    /// record `seq` had just freed them: for space freed by records that
    /// replay applied, which only the journal (no checkpoint yet) records.
    /// Parts that are not free (reused by a later record) are left alone.
    pub fn hold_busy(&mut self, addr: u64, len: u64, seq: u64) -> Result<(), String> {
        // Free extents from the highest down: each found one ends the part
        // still to look at.
        let mut end = self.validate_range("hold busy", addr, len)?;
        while let Some((s, l)) = self.free_overlapping(addr, end) {
            let part_start = s.max(addr);
            let part_len = (s + l).min(end) - part_start;
            self.take(s, l, part_start, part_len);
            self.busy.insert(part_start, (part_len, seq));
            self.busy_by_seq.insert((seq, part_start));
            self.busy_bytes += part_len;
            end = part_start;
        }
        Ok(())
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
                        self.insert_free(addr, len);
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
        self.free_bytes
    }

    /// The length of the largest free range (0: none).
    pub fn largest_free_extent(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// The `k` largest free ranges `(addr, len)`, largest first (the
    /// lowest address among equals): what a clean unmount leaves the next
    /// mount to allocate from while its scan runs.
    pub fn largest_free(&self, k: usize) -> Vec<(u64, u64)> {
        let mut by_len: Vec<(u64, u64)> = self.by_size.iter().rev().take(k).copied().collect();
        by_len.sort_by_key(|&(len, addr)| (std::cmp::Reverse(len), addr));
        by_len.into_iter().map(|(len, addr)| (addr, len)).collect()
    }

    /// How many free ranges there are (busy ones not counted).
    pub fn free_extent_count(&self) -> usize {
        self.by_size.len()
    }

    /// Bytes freed but waiting for their journal record to be durable.
    pub fn busy_bytes(&self) -> u64 {
        self.busy_bytes
    }

    /// Bytes owned by extents.
    pub fn used_bytes(&self) -> u64 {
        self.data_len() - self.free_bytes - self.busy_bytes
    }

    /// Free extents `(addr, len)` in address order, coalesced.
    pub fn free_extents(&self) -> Vec<(u64, u64)> {
        self.free.iter().map(|(&a, &l)| (a, l)).collect()
    }

    /// Busy ranges `(addr, len, seq of the record that freed them)` in
    /// address order.
    pub fn busy_ranges(&self) -> Vec<(u64, u64, u64)> {
        self.busy
            .iter()
            .map(|(&a, &(l, seq))| (a, l, seq))
            .collect()
    }

    /// Checks the invariants: free extents aligned, inside the data area,
    /// non-empty, sorted and coalesced; busy ranges aligned, inside, and
    /// disjoint from each other and from free space; both indexes mirror
    /// their maps; the byte counts match.
    pub fn check(&self) -> Result<(), String> {
        let mut prev_end: Option<u64> = None;
        let mut total = 0u64;
        for (&a, &l) in &self.free {
            self.check_stored("free extent", a, l)?;
            if let Some(p) = prev_end {
                if p >= a {
                    return Err(format!(
                        "free extent {} touches or overlaps the previous one ending at {p}",
                        range(a, a + l)
                    ));
                }
            }
            if !self.by_size.contains(&(l, a)) {
                return Err(format!(
                    "free extent {} missing from size index",
                    range(a, a + l)
                ));
            }
            if let Some((b, bl, _)) = self.busy_overlapping(a, a + l) {
                return Err(format!(
                    "free extent {} overlaps busy range {}",
                    range(a, a + l),
                    range(b, b + bl)
                ));
            }
            total += l;
            prev_end = Some(a + l);
        }
        if self.by_size.len() != self.free.len() {
            return Err(format!(
                "size index has {} entries for {} free extents",
                self.by_size.len(),
                self.free.len()
            ));
        }
        if total != self.free_bytes {
            return Err(format!(
                "free byte count is {} but free extents add up to {total}",
                self.free_bytes
            ));
        }
        let mut prev_end: Option<u64> = None;
        let mut total = 0u64;
        for (&a, &(l, seq)) in &self.busy {
            self.check_stored("busy range", a, l)?;
            if prev_end.is_some_and(|p| p > a) {
                return Err(format!(
                    "busy range {} overlaps the previous one",
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
        Ok(())
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

    /// Validates a range to free: it must be entirely used (neither free nor
    /// busy), or it would be owned twice.
    fn check_used(&self, what: &str, addr: u64, len: u64) -> Result<u64, String> {
        let end = self.validate_range(what, addr, len)?;
        if let Some((a, l)) = self.free_overlapping(addr, end) {
            return Err(format!(
                "{what} {}: double free, overlaps free space {}",
                range(addr, end),
                range(a, a + l)
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

    /// The free extent containing byte `addr`.
    fn free_containing(&self, addr: u64) -> Option<(u64, u64)> {
        let (&s, &l) = self.free.range(..=addr).next_back()?;
        (addr < s + l).then_some((s, l))
    }

    /// Some free extent intersecting `[addr, end)`. Extents are sorted and
    /// disjoint, so the last one starting before `end` has the greatest end
    /// of those that could intersect: one lookup decides.
    fn free_overlapping(&self, addr: u64, end: u64) -> Option<(u64, u64)> {
        let (&s, &l) = self.free.range(..end).next_back()?;
        (s + l > addr).then_some((s, l))
    }

    /// Like [`Allocator::free_overlapping`], for busy ranges: `(addr, len,
    /// seq)`.
    fn busy_overlapping(&self, addr: u64, end: u64) -> Option<(u64, u64, u64)> {
        let (&s, &(l, seq)) = self.busy.range(..end).next_back()?;
        (s + l > addr).then_some((s, l, seq))
    }

    /// A place for `want` bytes at or after `hint`: `(extent start, extent
    /// len, addr)`.
    fn find_near(&self, hint: u64, want: u64) -> Option<(u64, u64, u64)> {
        let hint = hint.checked_next_multiple_of(self.block_size)?;
        if let Some((s, l)) = self.free_containing(hint) {
            if s + l - hint >= want {
                return Some((s, l, hint));
            }
        }
        self.free
            .range((Bound::Excluded(hint), Bound::Unbounded))
            .take(HINT_SEARCH_LIMIT)
            .find(|(_, &l)| l >= want)
            .map(|(&s, &l)| (s, l, s))
    }

    /// Removes `[at, at + len)` from free extent `(s, l)`, keeping whatever
    /// is left on either side.
    fn take(&mut self, s: u64, l: u64, at: u64, len: u64) {
        debug_assert!(s <= at && at + len <= s + l && len > 0);
        self.remove_free(s, l);
        if at > s {
            self.add_free_entry(s, at - s);
        }
        if at + len < s + l {
            self.add_free_entry(at + len, s + l - (at + len));
        }
        self.free_bytes -= len;
    }

    /// Adds `[addr, addr + len)` to free space, coalescing with neighbours.
    fn insert_free(&mut self, addr: u64, len: u64) {
        self.free_bytes += len;
        let mut start = addr;
        let mut end = addr + len;
        if let Some((&ps, &pl)) = self.free.range(..addr).next_back() {
            debug_assert!(ps + pl <= addr, "free overlaps {}", range(ps, ps + pl));
            if ps + pl == addr {
                self.remove_free(ps, pl);
                start = ps;
            }
        }
        if let Some(&nl) = self.free.get(&end) {
            self.remove_free(end, nl);
            end += nl;
        }
        self.add_free_entry(start, end - start);
    }

    fn add_free_entry(&mut self, s: u64, l: u64) {
        self.free.insert(s, l);
        self.by_size.insert((l, s));
    }

    fn remove_free(&mut self, s: u64, l: u64) {
        self.free.remove(&s);
        self.by_size.remove(&(l, s));
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
        // Freed by records 1..=5, one block each, every other block.
        for seq in 1..=5u64 {
            a.free((8 - 2 * seq).min(7) * BS, BS, seq).unwrap();
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

    // ---- model test -------------------------------------------------------

    const BLOCKS: u64 = 64;
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
        Release {
            back: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (1..20u64, prop::option::of(0..BLOCKS + 2 * START))
                .prop_map(|(nblk, hint)| Op::Alloc { nblk, hint }),
            4 => (any::<usize>(), any::<bool>(), 0..4u64, 1..8u64)
                .prop_map(|(pick, now, skip, nblk)| Op::Free { pick, now, skip, nblk }),
            1 => (0..BLOCKS + 2 * START, 1..6u64).prop_map(|(blk, nblk)| Op::FreeAny { blk, nblk }),
            1 => (0..BLOCKS + 2 * START, 1..6u64).prop_map(|(blk, nblk)| Op::MarkUsed { blk, nblk }),
            2 => (0..4u64).prop_map(|back| Op::Release { back }),
        ]
    }

    fn idx(blk: u64) -> Option<usize> {
        (START..START + BLOCKS)
            .contains(&blk)
            .then(|| (blk - START) as usize)
    }

    fn all(model: &[B], blk: u64, nblk: u64, want: B) -> bool {
        (blk..blk + nblk).all(|b| idx(b).is_some_and(|i| model[i] == want))
    }

    fn free_runs(model: &[B]) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (i, b) in model.iter().enumerate() {
            if *b == B::Free {
                let addr = (START + i as u64) * BS;
                match runs.last_mut() {
                    Some((a, l)) if *a + *l == addr => *l += BS,
                    _ => runs.push((addr, BS)),
                }
            }
        }
        runs
    }

    proptest! {
        #[test]
        fn matches_bitmap_model(ops in prop::collection::vec(op(), 1..80)) {
            let mut a = Allocator::new(START * BS, BLOCKS * BS, BS as u32);
            let mut model = vec![B::Free; BLOCKS as usize];
            // Allocated chunks, in block units, that the test may free.
            let mut chunks: Vec<(u64, u64)> = Vec::new();
            let mut seq = 0u64;
            for op in ops {
                match op {
                    Op::Alloc { nblk, hint } => {
                        let runs = free_runs(&model);
                        let got = a.alloc(nblk * BS, hint.map(|h| h * BS));
                        let Some((addr, len)) = got else {
                            prop_assert!(runs.is_empty(), "None with free space {:?}", runs);
                            continue;
                        };
                        prop_assert!(addr.is_multiple_of(BS) && len.is_multiple_of(BS) && len > 0);
                        let (blk, n) = (addr / BS, len / BS);
                        prop_assert!(all(&model, blk, n, B::Free), "allocated non-free {}+{}", blk, n);
                        let largest = runs.iter().map(|r| r.1 / BS).max().unwrap_or(0);
                        if largest >= nblk {
                            prop_assert_eq!(n, nblk);
                        } else {
                            prop_assert_eq!(n, largest, "fallback must be the largest chunk");
                        }
                        if let Some(h) = hint {
                            if largest >= nblk && all(&model, h, nblk, B::Free) {
                                prop_assert_eq!(blk, h, "free at the hint, but not used");
                            }
                        }
                        for b in blk..blk + n {
                            model[idx(b).unwrap()] = B::Used;
                        }
                        chunks.push((blk, n));
                    }
                    Op::Free { pick, now, skip, nblk } => {
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
                            model[idx(b).unwrap()] = if now { B::Free } else { B::Busy(seq) };
                        }
                    }
                    Op::FreeAny { blk, nblk } => {
                        let ok = all(&model, blk, nblk, B::Used);
                        if ok {
                            // A used range may belong to a tracked chunk;
                            // freeing it here would confuse later frees.
                            continue;
                        }
                        let before = (a.free_extents(), a.busy_bytes());
                        let r = a.free(blk * BS, nblk * BS, seq + 1);
                        prop_assert!(r.is_err());
                        let r = a.free_now(blk * BS, nblk * BS);
                        prop_assert!(r.is_err());
                        prop_assert_eq!((a.free_extents(), a.busy_bytes()), before);
                    }
                    Op::MarkUsed { blk, nblk } => {
                        let ok = all(&model, blk, nblk, B::Free);
                        let r = a.mark_used(blk * BS, nblk * BS);
                        prop_assert_eq!(r.is_ok(), ok, "{:?}", r);
                        if ok {
                            for b in blk..blk + nblk {
                                model[idx(b).unwrap()] = B::Used;
                            }
                            chunks.push((blk, nblk));
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
                prop_assert_eq!(a.free_bytes() + a.busy_bytes() + a.used_bytes(), BLOCKS * BS);
                prop_assert_eq!(a.free_extents(), free_runs(&model));
            }
            // Free everything: one chunk again.
            for (blk, n) in chunks {
                a.free(blk * BS, n * BS, seq + 1).map_err(TestCaseError::fail)?;
            }
            a.release_busy(u64::MAX);
            prop_assert_eq!(a.free_extents(), vec![(START * BS, BLOCKS * BS)]);
            a.check().map_err(TestCaseError::fail)?;
        }

        /// The one-pass build at mount is the same allocator as marking
        /// each extent used in turn, and refuses exactly what that refuses
        /// (ranges given in block units; some misaligned, outside or
        /// overlapping).
        #[test]
        fn with_used_matches_marking_each_range(
            ranges in prop::collection::vec((0u64..80, 1u64..6, 0u8..8), 0..24)
        ) {
            let used: Vec<(u64, u64)> = ranges
                .iter()
                .map(|&(blk, n, skew)| (blk * BS + u64::from(skew == 0) * 512, n * BS))
                .collect();
            let mut marked = Allocator::new(START * BS, BLOCKS * BS, BS as u32);
            let mut refused = None;
            let mut order: Vec<usize> = (0..used.len()).collect();
            order.sort_by_key(|&i| used[i].0);
            for &i in &order {
                if marked.mark_used(used[i].0, used[i].1).is_err() {
                    refused = Some(i);
                    break;
                }
            }
            match (Allocator::with_used(START * BS, BLOCKS * BS, BS as u32, &used), refused) {
                (Ok(built), None) => {
                    built.check().unwrap();
                    prop_assert_eq!(built.free_extents(), marked.free_extents());
                    prop_assert_eq!(built.free_bytes(), marked.free_bytes());
                    prop_assert_eq!(built.used_bytes(), marked.used_bytes());
                }
                (Err((i, _)), Some(j)) => prop_assert_eq!(used[i].0, used[j].0),
                (built, refused) => prop_assert!(
                    false,
                    "with_used {:?} but marking in address order refused {:?}",
                    built.map(|a| a.free_extents()).map_err(|e| e.1),
                    refused
                ),
            }
        }
    }
}
