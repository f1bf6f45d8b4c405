//! Delayed allocation: space a buffered write reserves and writeback places.
//!
//! A buffered write reserves the free space its holes will need — the
//! whole write or nothing, so ENOSPC comes from the write that causes it —
//! and records the holes as *delalloc* ranges, which read as zeros until
//! writeback places them as unwritten extents ([`crate::iomap_ops`]'s
//! `allocate_holes`, which consumes the reservation of the range it
//! allocates). Nothing of it is journaled: after a crash the reservation is
//! simply gone with the cached data it was for.
//!
//! Ranges are file-system-block aligned, kept per inode in memory; every
//! reserved byte is counted once in [`Meta::delalloc_reserved`], which the
//! allocator's free space is reduced by for every other allocation.

use std::collections::BTreeMap;

use crate::mount_state::{BaseGrowth, Meta};
use crate::types::Ino;
use crate::{Error, Result};

/// One inode's delalloc ranges: start → end, disjoint, not adjacent.
pub(crate) type Ranges = BTreeMap<u64, u64>;

impl Meta {
    /// Free bytes neither a delayed allocation nor the next checkpoint
    /// base (its spilled image, or its extent pages and spilled root: see
    /// [`Meta::base_reserve_for`]) has reserved.
    pub(crate) fn unreserved_bytes(&self) -> Result<u64> {
        self.unreserved_bytes_after(BaseGrowth::default())
    }

    /// [`Meta::unreserved_bytes`] once the next base has grown by
    /// `growth`: what a change that grows it that much may take.
    /// [`Error::FreeSpacePending`] while mount's scan runs.
    pub(crate) fn unreserved_bytes_after(&self, growth: BaseGrowth) -> Result<u64> {
        Ok(self
            .alloc
            .allocator()?
            .free_bytes()
            .saturating_sub(self.delalloc_reserved)
            .saturating_sub(self.base_reserve_for(growth)))
    }

    /// The delalloc range holding `pos`, as its end.
    pub(crate) fn delalloc_end(&self, ino: Ino, pos: u64) -> Option<u64> {
        let ranges = self.delalloc.get(&ino)?;
        let (_, &end) = ranges.range(..=pos).next_back()?;
        (pos < end).then_some(end)
    }

    /// Where the first delalloc range starting after `pos` starts.
    pub(crate) fn delalloc_start_after(&self, ino: Ino, pos: u64) -> Option<u64> {
        let ranges = self.delalloc.get(&ino)?;
        let (&start, _) = ranges.range(pos + 1..).next()?;
        Some(start)
    }

    /// Reserved bytes of `ino` inside `[start, end)`.
    pub(crate) fn delalloc_within(&self, ino: Ino, start: u64, end: u64) -> u64 {
        let Some(ranges) = self.delalloc.get(&ino) else {
            return 0;
        };
        overlapping(ranges, start, end)
            .map(|(s, e)| e.min(end) - s.max(start))
            .sum()
    }

    /// Reserves space for the holes of `[start, end)` (block-aligned) that
    /// no extent and no reservation covers yet; all or nothing.
    pub(crate) fn reserve_delalloc(&mut self, ino: Ino, start: u64, end: u64) -> Result<()> {
        let inode = self.state.inode(ino).ok_or(Error::Stale { ino })?;
        inode.extents.load_for_change(start, end)?;
        let mut new = Vec::new();
        for (hole, len) in inode.extents.holes_in(start, end - start) {
            let mut cur = hole;
            let hole_end = hole + len;
            // Subtract what is reserved already.
            let reserved: Vec<(u64, u64)> = self
                .delalloc
                .get(&ino)
                .map(|r| overlapping(r, hole, hole_end).collect())
                .unwrap_or_default();
            for (s, e) in reserved {
                if s > cur {
                    new.push((cur, s));
                }
                cur = cur.max(e);
            }
            if cur < hole_end {
                new.push((cur, hole_end));
            }
        }
        let needed: u64 = new.iter().map(|(s, e)| e - s).sum();
        if needed == 0 {
            return Ok(());
        }
        // The ranges become extents at writeback: the room the next base
        // needs for them stays free now, so that this write is the one
        // refused rather than its writeback.
        let available = self.unreserved_bytes_after(self.growth_for_holes(ino, new.len()))?;
        if needed > available {
            return Err(Error::NoSpace {
                what: format!("inode {ino} buffered write of file range {start}..{end}"),
                needed,
                available,
            });
        }
        let ranges = self.delalloc.entry(ino).or_default();
        for (s, e) in new {
            insert(ranges, s, e);
        }
        self.delalloc_reserved += needed;
        Ok(())
    }

    /// Drops the reservations of `ino` inside `[start, end)`: writeback
    /// placed them, or truncate, punch or freeing the inode made them moot.
    /// Returns the bytes released.
    pub(crate) fn release_delalloc(&mut self, ino: Ino, start: u64, end: u64) -> u64 {
        let Some(ranges) = self.delalloc.get_mut(&ino) else {
            return 0;
        };
        let hit: Vec<(u64, u64)> = overlapping(ranges, start, end).collect();
        let mut released = 0;
        for (s, e) in hit {
            ranges.remove(&s);
            if s < start {
                ranges.insert(s, start);
            }
            if e > end {
                ranges.insert(end, e);
            }
            released += e.min(end) - s.max(start);
        }
        if ranges.is_empty() {
            self.delalloc.remove(&ino);
        }
        self.delalloc_reserved -= released;
        released
    }
}

/// The ranges overlapping `[start, end)`.
fn overlapping(ranges: &Ranges, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    let first = ranges
        .range(..=start)
        .next_back()
        .filter(|(_, &e)| e > start)
        .map(|(&s, _)| s)
        .unwrap_or(start);
    ranges
        .range(first..end)
        .map(|(&s, &e)| (s, e))
        .filter(move |&(s, e)| s < end && e > start)
}

/// Adds `[s, e)` (disjoint from the others), merging with neighbours.
fn insert(ranges: &mut Ranges, mut s: u64, mut e: u64) {
    if let Some((&ps, &pe)) = ranges.range(..s).next_back() {
        if pe == s {
            ranges.remove(&ps);
            s = ps;
        }
    }
    if let Some(&ne) = ranges.get(&e) {
        ranges.remove(&e);
        e = ne;
    }
    ranges.insert(s, e);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_split_and_sum() {
        let mut r = Ranges::new();
        insert(&mut r, 4096, 8192);
        insert(&mut r, 0, 4096);
        insert(&mut r, 12288, 16384);
        insert(&mut r, 8192, 12288);
        assert_eq!(r.into_iter().collect::<Vec<_>>(), vec![(0, 16384)]);
        let mut r = Ranges::new();
        insert(&mut r, 0, 8192);
        insert(&mut r, 16384, 20480);
        let hit: Vec<_> = overlapping(&r, 4096, 17000).collect();
        assert_eq!(hit, vec![(0, 8192), (16384, 20480)]);
        assert!(overlapping(&r, 8192, 16384).next().is_none());
    }
}
