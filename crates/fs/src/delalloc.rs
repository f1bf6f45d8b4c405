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
//!
//! With extent pages, the room for the next base ([`Meta::base_reserve_for`])
//! must also cover the extents that pending work adds to a map later,
//! when it may no longer fail (issue 10: ENOSPC is reported by the write
//! that causes it, never lost at writeback). So the call that creates the
//! work *holds* them ([`Meta::hold_extents`], per file, counted in the
//! room as if already in the map) and gets ENOSPC when they do not fit:
//!
//! - a buffered write, per new delayed range: one for the extent writeback
//!   places it as (the whole range at once; more only where it takes whole
//!   free ranges, which the room counts apart:
//!   `Meta::fragmentation_extents`), released when placed; and, unless a
//!   single block, one for converting it folio by folio in file order
//!   (written, then unwritten, until the last folio);
//! - a write (buffered or direct) whose block range ends inside unwritten
//!   extents, one per such end: converting a range splits only the
//!   unwritten extents its ends fall in (the space a write allocates
//!   itself is exactly its range). Writeback converts a dirty run folio
//!   by folio in file order, each merging with the written one before, so
//!   the splits are those at the ends of the runs, i.e. of the writes.
//!
//! Holds are released only when nothing of the file is pending: no dirty
//! folio, no delayed range, no direct I/O in flight, under the inode's
//! exclusive I/O lock ([`Meta::release_holds`]; at fsync, fallocate,
//! punch, truncate, a checkpoint's writeback, last close). Meanwhile the
//! extents added count twice (in the map and held): the room errs large,
//! never small. One exception: a direct write converts its whole range at
//! its one completion, so the splits it held go back then
//! ([`Meta::release_direct_splits`]); writeback converts folio by folio,
//! and a folio's completion is not the end of the write that held.

use std::collections::BTreeMap;

use crate::extent_map::Lookup;
use crate::mount_state::{BaseGrowth, DirectSplits, Meta, OpenInode, VolumeInner};
use crate::superblock::Superblock;
use crate::types::{ExtentState, Ino};
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

    /// The delalloc range holding `pos`.
    pub(crate) fn delalloc_around(&self, ino: Ino, pos: u64) -> Option<(u64, u64)> {
        let ranges = self.delalloc.get(&ino)?;
        let (&start, &end) = ranges.range(..=pos).next_back()?;
        (pos < end).then_some((start, end))
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

    /// Holds room for `extents` more extents of `ino`'s map (see the
    /// module's header), or refuses with ENOSPC when the room for the next
    /// base would then pass the free space; no-op without extent pages.
    pub(crate) fn hold_extents(&mut self, sb: &Superblock, ino: Ino, extents: u64) -> Result<()> {
        if extents == 0 || !self.extent_pages {
            return Ok(());
        }
        self.add_hold(ino, extents);
        self.reserve_base(sb, BaseGrowth::default())
            .inspect_err(|_| self.remove_hold(ino, extents))
    }

    fn add_hold(&mut self, ino: Ino, extents: u64) {
        *self.held.entry(ino).or_default() += extents;
        self.held_extents += extents;
    }

    pub(crate) fn remove_hold(&mut self, ino: Ino, extents: u64) {
        if let Some(held) = self.held.get_mut(&ino) {
            let n = extents.min(*held);
            *held -= n;
            self.held_extents -= n;
            if *held == 0 {
                self.held.remove(&ino);
            }
        }
    }

    /// Writeback places the delayed ranges of `ino` inside `[start, end)`:
    /// their extents are in the map from now on, so the hold for placing
    /// each is released (see `delayed_range_extents`).
    pub(crate) fn release_placed_holds(&mut self, ino: Ino, start: u64, end: u64) {
        let placed = self
            .delalloc
            .get(&ino)
            .map_or(0, |r| overlapping(r, start, end).count() as u64);
        self.remove_hold(ino, placed);
    }

    /// A direct write of `[start, end)` (block-aligned) of `ino` holds
    /// room for the splits its completion makes: [`Meta::splits_to_hold`],
    /// or ENOSPC. Released by [`Meta::release_direct_splits`] at its
    /// completion, or with every hold of the file once it is idle.
    pub(crate) fn hold_direct_splits(
        &mut self,
        sb: &Superblock,
        ino: Ino,
        start: u64,
        end: u64,
    ) -> Result<DirectSplits> {
        // What the lookups below and the allocation after read (an evicted
        // chunk is read here, through the fallible entry point).
        if let Some(inode) = self.state.inode(ino) {
            inode.extents.load_for_change(start, end)?;
        }
        let extents = self.splits_to_hold(ino, start, end);
        self.hold_extents(sb, ino, extents)?;
        self.held_splits_for(ino, start, end);
        let held = DirectSplits {
            start,
            end,
            extents,
        };
        if extents > 0 && self.extent_pages {
            self.direct_splits.entry(ino).or_default().push(held);
        }
        Ok(held)
    }

    /// Undoes [`Meta::hold_direct_splits`] for a write refused before it
    /// changed anything.
    pub(crate) fn unhold_direct_splits(&mut self, ino: Ino, held: DirectSplits) {
        if self.take_direct_splits(ino, |h| *h == held).is_some() {
            self.remove_hold(ino, held.extents);
        }
    }

    /// The direct write of `ino` that starts at `start` (block-aligned)
    /// and completed up to `end` at most has converted its range: the
    /// splits it held are in the map now, or merged away, so their hold
    /// goes back. Without this, a file laid out by direct writes through
    /// fallocated space would hold a split per write until it is idle.
    pub(crate) fn release_direct_splits(&mut self, ino: Ino, start: u64, end: u64) {
        if let Some(held) = self.take_direct_splits(ino, |h| h.start == start && h.end >= end) {
            self.remove_hold(ino, held.extents);
            // The write is over: a later one of the same end is no rest
            // of it.
            if matches!(self.split_hold.get(&ino), Some(&(s, e)) if e == held.end && s >= held.start)
            {
                self.split_hold.remove(&ino);
            }
        }
    }

    fn take_direct_splits(
        &mut self,
        ino: Ino,
        matches: impl Fn(&DirectSplits) -> bool,
    ) -> Option<DirectSplits> {
        let writes = self.direct_splits.get_mut(&ino)?;
        let held = writes.swap_remove(writes.iter().position(matches)?);
        if writes.is_empty() {
            self.direct_splits.remove(&ino);
        }
        Some(held)
    }

    /// Drops every hold of `ino`. Only when nothing of it is pending (see
    /// the module's header), or the inode is gone.
    pub(crate) fn release_holds(&mut self, ino: Ino) {
        self.split_hold.remove(&ino);
        self.direct_splits.remove(&ino);
        if let Some(held) = self.held.remove(&ino) {
            self.held_extents -= held;
        }
    }

    /// The splits to hold for a write of `[start, end)` (block-aligned)
    /// of `ino`: [`Meta::unwritten_straddles`], but none when this is the
    /// rest of the write that last held them (the engine asks again for
    /// the rest after each mapping, always up to the write's end; that
    /// write's data may have moved already, so it must not be refused
    /// now). [`Meta::held_splits_for`] records the write.
    pub(crate) fn splits_to_hold(&self, ino: Ino, start: u64, end: u64) -> u64 {
        match self.split_hold.get(&ino) {
            Some(&(s, e)) if e == end && s <= start => 0,
            _ => self.unwritten_straddles(ino, start, end),
        }
    }

    /// The write of `[start, end)` of `ino` holds its splits.
    pub(crate) fn held_splits_for(&mut self, ino: Ino, start: u64, end: u64) {
        self.split_hold.insert(ino, (start, end));
    }

    /// The unwritten extents of `ino` that `[start, end)` (block-aligned)
    /// starts or ends strictly inside: converting the range splits each
    /// once (twice the same one when it holds the whole range).
    pub(crate) fn unwritten_straddles(&self, ino: Ino, start: u64, end: u64) -> u64 {
        let Some(inode) = self.state.inode(ino) else {
            return 0;
        };
        let inside = |pos: u64, at_start: bool| match inode.extents.lookup(pos) {
            Lookup::Extent(e) if e.state == ExtentState::Unwritten => {
                if at_start {
                    e.file_off < start
                } else {
                    e.file_end() > end
                }
            }
            _ => false,
        };
        u64::from(inside(start, true)) + u64::from(end > start && inside(end - 1, false))
    }

    /// Reserves space for the holes of `[start, end)` (block-aligned) that
    /// no extent and no reservation covers yet; all or nothing. With extent
    /// pages, also holds the extents the range's writeback will add.
    pub(crate) fn reserve_delalloc(
        &mut self,
        sb: &Superblock,
        ino: Ino,
        start: u64,
        end: u64,
    ) -> Result<()> {
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
        let what = || format!("inode {ino} buffered write of file range {start}..{end}");
        if self.extent_pages {
            // Held until nothing of the file is pending: what writeback
            // adds for these ranges, and the splits of unwritten extents
            // the range ends in.
            let block = u64::from(self.state.block_size);
            let ranges = self.delalloc.get(&ino);
            let hold = new
                .iter()
                .map(|&(s, e)| delayed_range_extents(ranges, s, e, block))
                .sum::<u64>()
                + self.splits_to_hold(ino, start, end);
            self.held_splits_for(ino, start, end);
            if hold == 0 && needed == 0 {
                return Ok(());
            }
            self.add_hold(ino, hold);
            let refused = self.unreserved_bytes().and_then(|available| {
                if needed > available {
                    Err(Error::NoSpace {
                        what: what(),
                        needed,
                        available,
                    })
                } else {
                    self.reserve_base(sb, BaseGrowth::default())
                }
            });
            if let Err(e) = refused {
                self.remove_hold(ino, hold);
                return Err(e);
            }
        } else {
            if needed == 0 {
                return Ok(());
            }
            // The ranges become extents at writeback: the room the next
            // base needs for them stays free now, so that this write is
            // the one refused rather than its writeback.
            let available = self.unreserved_bytes_after(self.growth_for_holes(ino, new.len()))?;
            if needed > available {
                return Err(Error::NoSpace {
                    what: what(),
                    needed,
                    available,
                });
            }
        }
        if needed == 0 {
            return Ok(());
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

impl VolumeInner {
    /// Drops `inode`'s holds when nothing of it is pending: under its
    /// exclusive I/O lock (no buffered write or writeback pass runs; both
    /// take it shared) with direct I/O drained, no dirty folio and no
    /// delayed range. `locked`: the caller holds that lock and drained
    /// already; else the lock is only tried, and a busy file keeps its
    /// holds until a later call.
    pub(crate) fn release_holds_if_idle(&self, inode: &OpenInode, locked: bool) {
        if !self.meta.read().held.contains_key(&inode.ino) {
            return;
        }
        let _exclusive = if locked {
            None
        } else {
            let Some(lock) = inode.io_lock.try_lock_exclusive() else {
                return;
            };
            inode.io_lock.drain_dio();
            Some(lock)
        };
        if inode.mapping.is_dirty() {
            return;
        }
        let mut meta = self.meta.write();
        if !meta.delalloc.contains_key(&inode.ino) {
            meta.release_holds(inode.ino);
        }
    }
}

/// Extents a new delayed piece `[s, e)` may add while its writeback is
/// pending: the one its range is placed as, and while converted folio by folio
/// in file order one more (written, then unwritten), unless it is a single
/// block, converted whole. The first is released when writeback places it
/// (the extent is then in the map), the second when the file is idle.
///
/// `[s, e)` joins the ranges of `ranges` it touches: a new range holds
/// both; one that extends a range holds only the conversion's, and only
/// when that range was a single block (a longer one holds it already); one
/// that joins two holds nothing more. So a sequential writer holds a
/// couple of extents per range, not one per write.
fn delayed_range_extents(ranges: Option<&Ranges>, s: u64, e: u64, block: u64) -> u64 {
    let before = ranges.and_then(|r| r.range(..s).next_back().filter(|(_, &pe)| pe == s));
    let after = ranges.and_then(|r| r.get(&e).map(|&ne| (e, ne)));
    match (before, after) {
        (None, None) => 1 + u64::from(e - s > block),
        (Some((&ps, &pe)), None) => u64::from(pe - ps == block),
        (None, Some((ns, ne))) => u64::from(ne - ns == block),
        (Some(_), Some(_)) => 0,
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
