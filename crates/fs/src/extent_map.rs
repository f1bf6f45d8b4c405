//! One file's map from file offsets to device space.
//!
//! Every read and write asks "what is at file offset X?", so the map is
//! sorted by file offset: a lookup is three binary searches and allocates
//! nothing once its chunk is in memory (fast path 1, "simple read",
//! counts heap allocations). The
//! extents are kept in shared copy-on-write chunks ([`chunks`]), so that a
//! checkpoint's snapshot is O(1) and the first change after it copies one
//! chunk, not the file's whole map.
//!
//! Mutations are the metadata changes journal records describe (map
//! unwritten space, convert it at I/O completion, punch, truncate); replay
//! and the live path call the same methods, so they must be deterministic.
//!
//! Fault model: extents come from the checkpoint and the journal, which may be
//! corrupt or hostile. [`ExtentMap::from_extents`] and [`ExtentMap::insert`]
//! validate and return errors (never panic, even in debug builds). The other
//! mutators take ranges the caller has already validated (a block-aligned
//! range is a precondition, checked with `debug_assert!`), because their
//! callers hold a decoded record or a range they computed themselves.

mod chunks;
mod page_slots;
pub mod search;
pub mod span_merge;

use std::sync::Arc;

use crate::codec::PageRef;
use crate::types::{Extent, ExtentState, KeySpan};
pub(crate) use chunks::release_spare_chunks;
#[cfg(test)]
pub(crate) use chunks::CHUNK_BYTES_MAX;
#[cfg(test)]
pub(crate) use chunks::CHUNK_SHELL_BYTES;
pub(crate) use chunks::SEGMENT_MAX;
pub use chunks::{ChunkPage, Evicted, LoadPurpose, PageLoader, PageSource};
use chunks::{Chunks, CHUNK_MAX};
pub(crate) use page_slots::give_back_excess as give_back_excess_slots;
pub(crate) use page_slots::give_back_warm as give_back_warm_slots;
pub(crate) use page_slots::keep_warm_up_to as keep_warm_slots_up_to;
pub(crate) use page_slots::WARM_BYTES_MOST as WARM_SLOT_BYTES_MOST;

/// At most how many chunks `inserts` more extents can add to a map of
/// `chunks` chunks, whatever else changes meanwhile: a chunk splits only
/// past [`CHUNK_MAX`], into halves of at least `CHUNK_MAX / 2`, so after
/// each chunk's first split every further one takes that many inserts
/// (removals and merges free no more than they cost). The room kept for
/// the next base counts pending extents in chunks by it.
pub fn chunks_added_at_most(chunks: u64, inserts: u64) -> u64 {
    let half = (CHUNK_MAX / 2) as u64;
    inserts.min(chunks + inserts.div_ceil(half))
}

/// What is at one file offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The extent containing the offset.
    Extent(Extent),
    /// No space at the offset. `end` is where the next extent starts, so a
    /// caller can answer for the whole hole in one step; `None` means no
    /// extent follows.
    Hole { end: Option<u64> },
}

/// The extents of one file: sorted by file offset, non-overlapping,
/// block-aligned, non-empty.
///
/// Adjacent extents are merged when they are contiguous both in the file and
/// on the device and have the same state, so that fragmentation comes only
/// from the allocator, never from the order of operations. Merging is an
/// optimisation, not an invariant: [`ExtentMap::from_extents`] keeps extents
/// as given and [`ExtentMap::check`] does not require it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentMap {
    block_size: u64,
    /// Shared copy-on-write: cloning the map (a checkpoint's snapshot) is
    /// O(1); the first change after a clone copies the chunk it changes.
    map: Chunks,
    /// Kept as a running sum because `stat` and space accounting ask for it
    /// often and a file may have many extents.
    allocated: u64,
}

impl ExtentMap {
    /// An empty map (the file is one hole).
    ///
    /// # Panics
    /// If `block_size` is 0: every alignment check would divide by it, and the
    /// superblock decoder rejects such volumes long before this.
    pub fn new(block_size: u32) -> Self {
        assert!(block_size > 0, "extent map: block size must not be 0");
        ExtentMap {
            block_size: u64::from(block_size),
            map: Chunks::default(),
            allocated: 0,
        }
    }

    /// A map holding exactly `extents`, as a checkpoint stores them.
    ///
    /// The input comes from disk, so every rule is checked and the error says
    /// which extent broke which rule. Extents are not merged, so that a map
    /// read back from a checkpoint is the map that was written.
    pub fn from_extents(block_size: u32, extents: Vec<Extent>) -> Result<Self, String> {
        if block_size == 0 {
            return Err("extent map: block size is 0".to_string());
        }
        let mut m = ExtentMap::new(block_size);
        let mut prev_end = 0;
        for (i, e) in extents.into_iter().enumerate() {
            m.check_next(i, &e, prev_end)?;
            prev_end = e.file_end();
            m.allocated += e.len;
            m.map.push(e);
        }
        Ok(m)
    }

    /// A map holding the extents of `pages` in order, one chunk per page,
    /// each chunk naming its page, as a checkpoint's extent pages store
    /// them; extents with no page (`None`: changed since it was written)
    /// go into chunks of their own. Checked as [`ExtentMap::from_extents`]
    /// checks, and each page must hold 1..=`CHUNK_MAX` extents (512; a page is
    /// written from one chunk and read back as one).
    pub fn from_pages(
        block_size: u32,
        pages: impl IntoIterator<Item = (Vec<Extent>, Option<PageRef>)>,
    ) -> Result<Self, String> {
        Self::from_runs_lazy(
            block_size,
            pages
                .into_iter()
                .map(|(extents, page)| (extents, page, false)),
            None,
            None,
        )
    }

    /// [`ExtentMap::from_pages`], where a page given without extents
    /// (`(vec![], Some(page), _)`) becomes an *absent* chunk, read from
    /// `source` when an entry point first needs it ([`ExtentMap::load_keys`],
    /// [`ExtentMap::load_for_change`], [`ExtentMap::load_all`]): what mount
    /// builds a paged file's map with, reading none of its pages. What the
    /// reference alone tells is checked here (count, first keys in order);
    /// the extents when the page is read. An absent chunk given with
    /// `true` starts a new segment: where an index page's run starts, so
    /// that a base finds the run again while nothing in it changes.
    /// With `listed` (the page list of the table the pages come from), a
    /// cold segment of absent chunks refers to the run of that list
    /// holding its pages instead of copying them.
    pub fn from_runs_lazy(
        block_size: u32,
        pages: impl IntoIterator<Item = (Vec<Extent>, Option<PageRef>, bool)>,
        source: Option<Arc<PageSource>>,
        listed: Option<&crate::codec::PageList>,
    ) -> Result<Self, String> {
        let mut listed = listed.map(|l| l.cursor());
        if block_size == 0 {
            return Err("extent map: block size is 0".to_string());
        }
        let mut m = ExtentMap::new(block_size);
        let (mut i, mut prev_end) = (0, 0);
        let mut pages = pages.into_iter().enumerate().peekable();
        while let Some((p, (extents, page, starts_run))) = pages.next() {
            if let (true, Some(page), Some(source)) = (extents.is_empty(), page, &source) {
                let n = page.count as usize;
                if n == 0 || n > CHUNK_MAX {
                    return Err(format!("page #{p} holds {n} extents, not 1..={CHUNK_MAX}"));
                }
                if (i > 0 && page.first_key < prev_end) || !m.aligned(page.first_key) {
                    return Err(format!(
                        "page #{p} from file offset {} overlaps the extents before it or is \
                         not aligned",
                        page.first_key
                    ));
                }
                let limit = match pages.peek() {
                    Some((_, (next, next_page, _))) => next
                        .first()
                        .map(|e| e.file_off)
                        .or(next_page.map(|np| np.first_key))
                        .unwrap_or(u64::MAX),
                    None => u64::MAX,
                };
                // The page's extents start at its first key: the next
                // chunk must start past it.
                (i, prev_end) = (i + n, page.first_key + 1);
                m.allocated += page.allocated;
                let at = listed.as_mut().and_then(|cursor| {
                    while cursor.peek().is_some_and(|p| p.first_key < page.first_key) {
                        cursor.advance();
                    }
                    // Runs of at most a segment only (index pages'): a
                    // file's one run shared by many segments would keep
                    // every page of the file after a base replaced it.
                    cursor
                        .position()
                        .filter(|&(run, i)| run[i] == page && run.len() <= SEGMENT_MAX)
                });
                m.map
                    .push_absent(page, source.clone(), limit, starts_run, at);
                continue;
            }
            if extents.is_empty() || (page.is_some() && extents.len() > CHUNK_MAX) {
                return Err(format!(
                    "page #{p} holds {} extents, not 1..={CHUNK_MAX}",
                    extents.len()
                ));
            }
            for e in &extents {
                m.check_next(i, e, prev_end)?;
                (i, prev_end) = (i + 1, e.file_end());
                m.allocated += e.len;
            }
            if extents.len() <= CHUNK_MAX {
                m.map.push_chunk(extents, page);
            } else {
                for piece in extents.chunks(CHUNK_MAX) {
                    m.map.push_chunk(piece.to_vec(), None);
                }
            }
        }
        Ok(m)
    }

    /// Loads the absent chunks owning a key in `[off, end)`: what a
    /// lookup of any offset in it reads (a hole's end is the next chunk's
    /// first key, known without loading). Returns how many pages it read.
    /// The map's other methods then answer in that range without I/O.
    pub fn load_keys(&self, off: u64, end: u64) -> crate::error::Result<usize> {
        self.map.load_owners(off, end.max(off + 1) - 1, 0, false)
    }

    /// Loads the absent chunks a change of `[off, end)` may read or
    /// change: those owning a key in it, the one holding the extent before
    /// it and the one after it (a change merges with both neighbours).
    /// Every mutator's range must be loaded so first (the journal record's
    /// range: `MetaState::load_for_record`); a change that reaches an
    /// absent chunk anyway loads it outside any fallible path (see
    /// [`PageLoader::note_unplanned`]).
    pub fn load_for_change(&self, off: u64, end: u64) -> crate::error::Result<usize> {
        self.map.load_owners(off.saturating_sub(1), end, 1, true)
    }

    /// Loads every absent chunk (a change or a pass over the whole file).
    pub fn load_all(&self) -> crate::error::Result<usize> {
        self.map.load_all()
    }

    /// Extents of the chunks changed since the last base (loaded, naming
    /// no page): only memory holds them. Kept per segment as they change
    /// (see `Chunks::unpaged_extents`).
    pub fn unpaged_extents(&self) -> usize {
        self.map.unpaged_extents()
    }

    /// Chunks whose extents are in memory (the rest are absent).
    pub fn loaded_chunks(&self) -> usize {
        self.map.loaded_chunks()
    }

    /// Memory the map takes beside its loaded chunks' extents: a shell
    /// per chunk of an open segment, a page reference per chunk of a cold
    /// one that keeps its own list (one sharing a slot's run leaves it to
    /// the slots' count; see `Chunks::shell_bytes`). What the page loader counts
    /// against the budget for a paged map.
    pub fn shell_bytes(&self) -> u64 {
        self.map.shell_bytes()
    }

    /// Segments of chunks that have shells (the rest are cold: known by
    /// their pages alone).
    pub fn open_segments(&self) -> usize {
        self.map.open_segments()
    }

    /// A copy that shares no cold segment with this map (see
    /// `Chunks::detached`): what a long pass over a snapshot reads, so
    /// that the live map's loads stay out of it.
    pub fn detached(&self) -> ExtentMap {
        ExtentMap {
            map: self.map.detached(),
            ..self.clone()
        }
    }

    /// Segments of chunks, open or cold.
    pub fn segment_count(&self) -> usize {
        self.map.segment_count()
    }

    /// One step of the evictor over the chunks from key `from` on (at most
    /// `max`): see `Chunks::evict`. Clean chunks not looked up since the last sweep
    /// become absent, read again from their page (through `source` if
    /// they name none) by the next entry point that needs them; `stop`
    /// is asked with the bytes freed so far, after each eviction, every
    /// few chunks looked at and each cold segment passed over. The
    /// extents stay the same, so nothing else of the map changes.
    pub fn evict(
        &mut self,
        from: u64,
        max: usize,
        source: &Arc<PageSource>,
        keep: impl Fn(u64, u64) -> bool,
        stop: impl FnMut(u64) -> bool,
    ) -> (Option<u64>, usize, Vec<Evicted>) {
        self.map.evict(from, max, source, keep, stop)
    }

    /// Passes every extent to `f` in order, from the chunk that owns key
    /// `from` (the first may end before it), without keeping an absent
    /// chunk's extents: each such page is read, passed and dropped.
    /// Stops (`Ok(false)`) when `f` returns `false`, and at a page that
    /// fails to load (its error).
    pub fn for_each_unkept(
        &self,
        from: u64,
        f: impl FnMut(&Extent) -> bool,
    ) -> crate::error::Result<bool> {
        self.map.for_each_unkept(from, f)
    }

    /// Checks `e`, extent #`i` of a map being read in order, against the
    /// rules and the end of the extent before it (`prev_end`).
    fn check_next(&self, i: usize, e: &Extent, prev_end: u64) -> Result<(), String> {
        let why = match self.validate(e) {
            Err(why) => Some(why),
            Ok(()) if i > 0 && e.file_off < prev_end => Some(format!(
                "not sorted or overlaps the previous extent, which ends at file offset \
                 {prev_end}"
            )),
            Ok(()) => None,
        };
        match why {
            Some(why) => Err(format!("extent #{i} {}: {why}", describe(e))),
            None => Ok(()),
        }
    }

    /// The chunks of the map in order, each with the extent page that
    /// holds it if one was written: what a checkpoint writes pages for.
    pub fn chunk_pages(&self) -> impl Iterator<Item = ChunkPage<'_>> + '_ {
        self.map.pages()
    }

    /// The chunks numbered `indices` (rising, as [`ExtentMap::chunk_pages`]
    /// numbers them) with their pages, each with its number, found by
    /// segment counts; ends at the first number past the last chunk.
    pub fn chunk_pages_at<'a>(
        &'a self,
        indices: &'a [usize],
    ) -> impl Iterator<Item = (usize, ChunkPage<'a>)> + 'a {
        self.map.pages_at(indices)
    }

    /// How many chunks hold the extents: each is one page when written
    /// (what the space kept for the next base is counted in).
    pub fn chunk_count(&self) -> usize {
        self.map.chunk_count()
    }

    /// Whether a clone of this map (a snapshot) still shares its chunks:
    /// the next change then copies the list of chunks and the chunk it
    /// changes.
    pub fn is_shared(&self) -> bool {
        self.map.is_shared()
    }

    pub fn block_size(&self) -> u32 {
        // Built from a `u32` in `new`.
        self.block_size as u32
    }

    /// The extents in file-offset order.
    pub fn iter(&self) -> impl Iterator<Item = &Extent> + '_ {
        self.map.iter()
    }

    /// The key of the last extent that starts before `off`.
    pub fn key_before(&self, off: u64) -> Option<u64> {
        self.map.last_before(off).map(|p| self.map.get(p).file_off)
    }

    /// The extents stored under keys in `spans` (sorted, disjoint).
    pub fn extents_in(&self, spans: &[KeySpan]) -> Vec<Extent> {
        let mut out = Vec::new();
        self.map.extents_in_spans(spans, &mut out);
        out
    }

    /// Number of extents.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Device bytes mapped, written or unwritten.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    /// What is at byte `pos`.
    ///
    /// `pos` may be any byte offset, not only a block boundary: the I/O engine
    /// asks about the exact byte a sub-block direct write starts at.
    /// Allocates nothing once the entry points loaded its chunk (see
    /// [`ExtentMap::load_keys`]), since it runs once per I/O on the fast
    /// path.
    pub fn lookup(&self, pos: u64) -> Lookup {
        // Marks the chunk in use (the evictor's clock bit).
        let at = self.map.touch_last_at_or_before(pos);
        if let Some((_, e)) = at {
            if pos < e.file_end() {
                return Lookup::Extent(*e);
            }
        }
        // No extent contains `pos`, so none starts at it either.
        let next = match at {
            Some((p, _)) => self.map.next(p),
            None => self.map.first_after(pos),
        };
        Lookup::Hole {
            end: next.map(|p| self.map.key(p)),
        }
    }

    /// The unmapped parts of `[off, off + len)`, as `(file_off, len)` pairs in
    /// order: what allocation must fill, and what an ENOSPC pre-check must
    /// count before the first block is placed.
    pub fn holes_in(&self, off: u64, len: u64) -> Vec<(u64, u64)> {
        let mut holes = Vec::new();
        self.for_each_hole(off, len, |o, l| holes.push((o, l)));
        holes
    }

    /// Total bytes of [`ExtentMap::holes_in`], without building the list.
    pub fn hole_bytes_in(&self, off: u64, len: u64) -> u64 {
        let mut total = 0;
        self.for_each_hole(off, len, |_, l| total += l);
        total
    }

    /// Maps `ext`, whose file range must be a hole.
    ///
    /// Errors leave the map unchanged; they come from bad records (misaligned,
    /// empty, overflowing, or placing space over space already mapped, which
    /// would leak or double-own device blocks).
    pub fn insert(&mut self, ext: Extent) -> Result<(), String> {
        self.validate(&ext)
            .map_err(|why| format!("insert {}: {why}", describe(&ext)))?;
        if let Some(e) = self.overlapping(ext.file_off, ext.file_end()).next() {
            return Err(format!(
                "insert {}: file range is not a hole, it overlaps {}",
                describe(&ext),
                describe(e)
            ));
        }
        self.map.insert(ext);
        self.allocated += ext.len;
        let mut at = ext.file_off;
        if let Some(prev) = self.map.last_before(ext.file_off) {
            let prev = self.map.get(prev).file_off;
            if self.merge_with_next(prev) {
                at = prev;
            }
        }
        self.merge_with_next(at);
        Ok(())
    }

    /// Unmaps `[off, off + len)`, splitting extents that straddle its ends.
    /// Returns the device ranges `(addr, len)` that were mapped there, in file
    /// order (one range where they lay end to end on the device), for the
    /// caller to free.
    pub fn remove_range(&mut self, off: u64, len: u64) -> Vec<(u64, u64)> {
        debug_assert!(
            self.aligned(off) && self.aligned(len),
            "remove_range({off}, {len}) not aligned to {}",
            self.block_size
        );
        self.remove_span(off, off.saturating_add(len))
    }

    /// Turns the unwritten parts of `[off, off + len)` into written space,
    /// as a write completion does. Returns the bytes converted; 0 means the
    /// completion needs no journal record for conversion.
    pub fn convert_written(&mut self, off: u64, len: u64) -> u64 {
        debug_assert!(
            self.aligned(off) && self.aligned(len),
            "convert_written({off}, {len}) not aligned to {}",
            self.block_size
        );
        let end = off.saturating_add(len);
        if off >= end {
            return 0;
        }
        // Split only unwritten extents: splitting a written one would be
        // undone by the merge pass below, at the cost of two tree updates.
        for pos in [off, end] {
            if let Lookup::Extent(e) = self.lookup(pos) {
                if e.state == ExtentState::Unwritten {
                    self.split_at(pos);
                }
            }
        }
        let mut converted = 0;
        let mut at = self.map.first_at_or_after(off);
        while let Some(p) = at {
            let e = *self.map.get(p);
            if e.file_off >= end {
                break;
            }
            if e.state == ExtentState::Unwritten {
                self.map.get_mut(p).state = ExtentState::Written;
                converted += e.len;
            }
            at = self.map.next(p);
        }
        if converted > 0 {
            self.merge_range(off, end);
        }
        converted
    }

    /// Unmaps everything at or past `off`, as truncation does. Returns the
    /// freed device ranges like [`ExtentMap::remove_range`].
    pub fn truncate_blocks_from(&mut self, off: u64) -> Vec<(u64, u64)> {
        debug_assert!(
            self.aligned(off),
            "truncate_blocks_from({off}) not aligned to {}",
            self.block_size
        );
        self.remove_span(off, u64::MAX)
    }

    fn remove_span(&mut self, off: u64, end: u64) -> Vec<(u64, u64)> {
        let mut freed = Vec::new();
        if off >= end {
            return freed;
        }
        self.split_at(off);
        self.split_at(end);
        let mut allocated = self.allocated;
        self.map.remove_span(off, end, |e| {
            allocated -= e.len;
            push_freed(&mut freed, e.addr, e.len);
        });
        self.allocated = allocated;
        freed
    }

    /// Checks the map's invariants: keys match extents, extents are
    /// non-empty, aligned, sorted and non-overlapping, nothing overflows, and
    /// the running byte count is right. Merging is not required.
    pub fn check(&self) -> Result<(), String> {
        self.map.check()?;
        let mut prev: Option<&Extent> = None;
        let mut total = 0u64;
        for (i, e) in self.map.iter().enumerate() {
            self.validate(e)
                .map_err(|why| format!("extent #{i} {}: {why}", describe(e)))?;
            if let Some(p) = prev {
                if p.file_end() > e.file_off {
                    return Err(format!(
                        "extent #{i} {}: overlaps the previous extent {}",
                        describe(e),
                        describe(p)
                    ));
                }
            }
            total += e.len;
            prev = Some(e);
        }
        if total != self.allocated {
            return Err(format!(
                "allocated byte count is {} but the extents add up to {total}",
                self.allocated
            ));
        }
        Ok(())
    }

    fn aligned(&self, x: u64) -> bool {
        x.is_multiple_of(self.block_size)
    }

    /// Why `e` cannot be an extent of this map on its own, if it cannot.
    ///
    /// No `debug_assert!` here: extents reach this from disk, and tests feed
    /// corrupt images to debug builds expecting an error, not a panic.
    fn validate(&self, e: &Extent) -> Result<(), String> {
        if e.len == 0 {
            return Err("empty".to_string());
        }
        if !(self.aligned(e.file_off) && self.aligned(e.len) && self.aligned(e.addr)) {
            return Err(format!("not aligned to the block size {}", self.block_size));
        }
        if e.file_off.checked_add(e.len).is_none() || e.addr.checked_add(e.len).is_none() {
            return Err("end overflows a 64-bit offset".to_string());
        }
        Ok(())
    }

    /// The extents that intersect `[off, end)`, in order.
    fn overlapping(&self, off: u64, end: u64) -> impl Iterator<Item = &Extent> + '_ {
        let end = end.max(off);
        let start = match self.map.last_before(off) {
            Some(p) if self.map.get(p).file_end() > off => Some(p),
            Some(p) => self.map.next(p),
            None => self.map.first_at_or_after(off),
        };
        start
            .into_iter()
            .flat_map(|p| self.map.iter_from(p))
            .take_while(move |e| e.file_off < end)
    }

    fn for_each_hole(&self, off: u64, len: u64, mut f: impl FnMut(u64, u64)) {
        let end = off.saturating_add(len);
        let mut cursor = off;
        for e in self.overlapping(off, end) {
            if e.file_off > cursor {
                f(cursor, e.file_off - cursor);
            }
            cursor = cursor.max(e.file_end());
        }
        if cursor < end {
            f(cursor, end - cursor);
        }
    }

    /// Makes `pos` an extent boundary, if an extent straddles it.
    fn split_at(&mut self, pos: u64) {
        let Some(p) = self.map.last_before(pos) else {
            return;
        };
        let e = *self.map.get(p);
        if e.file_end() <= pos {
            return;
        }
        let head = pos - e.file_off;
        let tail = Extent {
            file_off: pos,
            len: e.len - head,
            addr: e.addr + head,
            state: e.state,
        };
        self.map.get_mut(p).len = head;
        self.map.insert(tail);
    }

    /// Merges the extent at `key` with the next one if they continue each
    /// other in the file and on the device and share a state. Returns
    /// whether it merged.
    fn merge_with_next(&mut self, key: u64) -> bool {
        let Some(at) = self.map.find(key) else {
            return false;
        };
        let Some(next_at) = self.map.next(at) else {
            return false;
        };
        let (cur, next) = (*self.map.get(at), *self.map.get(next_at));
        if cur.file_end() != next.file_off || cur.addr_end() != next.addr || cur.state != next.state
        {
            return false;
        }
        // Grow first: removing may move extents between chunks.
        self.map.get_mut(at).len += next.len;
        self.map.remove(next_at);
        true
    }

    /// Merges every mergeable neighbour pair whose second extent starts in
    /// `[off, end]`, including the pairs across both boundaries.
    fn merge_range(&mut self, off: u64, end: u64) {
        let start = self
            .map
            .last_before(off)
            .or_else(|| self.map.first_at_or_after(off));
        let Some(start) = start else {
            return;
        };
        let mut cur = self.map.get(start).file_off;
        while cur < end {
            if self.merge_with_next(cur) {
                continue;
            }
            match self.map.first_after(cur) {
                Some(p) => cur = self.map.get(p).file_off,
                None => return,
            }
        }
    }
}

fn describe(e: &Extent) -> String {
    format!(
        "[file {}+{} at device {}, {:?}]",
        e.file_off, e.len, e.addr, e.state
    )
}

impl crate::codec::ExtentSource for ExtentMap {
    fn extent_count(&self) -> usize {
        self.len()
    }

    fn try_each(
        &self,
        f: &mut dyn FnMut(&Extent) -> crate::error::Result<()>,
    ) -> crate::error::Result<()> {
        self.iter().try_for_each(f)
    }
}

/// Adds the device range `[addr, addr + len)` to `freed`, joined to the
/// last range where it goes on from it: a file allocated in order frees
/// one range, not one per extent (a 4M-extent file: 64 MB of ranges).
pub(crate) fn push_freed(freed: &mut Vec<(u64, u64)>, addr: u64, len: u64) {
    match freed.last_mut() {
        Some((a, l)) if *a + *l == addr => *l += len,
        _ => freed.push((addr, len)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BS: u64 = 4096;

    fn ext(blk: u64, nblk: u64, addr_blk: u64, state: ExtentState) -> Extent {
        Extent {
            file_off: blk * BS,
            len: nblk * BS,
            addr: addr_blk * BS,
            state,
        }
    }

    use ExtentState::{Unwritten as U, Written as W};

    #[test]
    fn lookup_holes_and_extents() {
        let mut m = ExtentMap::new(BS as u32);
        assert_eq!(m.lookup(0), Lookup::Hole { end: None });
        m.insert(ext(2, 2, 10, W)).unwrap();
        assert_eq!(m.lookup(0), Lookup::Hole { end: Some(2 * BS) });
        assert_eq!(m.lookup(2 * BS + 17), Lookup::Extent(ext(2, 2, 10, W)));
        assert_eq!(m.lookup(4 * BS), Lookup::Hole { end: None });
        assert_eq!(m.holes_in(0, 6 * BS), vec![(0, 2 * BS), (4 * BS, 2 * BS)]);
        assert_eq!(m.hole_bytes_in(3 * BS, 3 * BS), 2 * BS);
        assert_eq!(m.holes_in(2 * BS, 2 * BS), vec![]);
    }

    #[test]
    fn insert_merges_both_sides_and_rejects_overlap() {
        let mut m = ExtentMap::new(BS as u32);
        m.insert(ext(0, 1, 10, U)).unwrap();
        m.insert(ext(2, 1, 12, U)).unwrap();
        m.insert(ext(1, 1, 11, U)).unwrap();
        assert_eq!(
            m.iter().copied().collect::<Vec<_>>(),
            vec![ext(0, 3, 10, U)]
        );
        let err = m.insert(ext(2, 2, 50, U)).unwrap_err();
        assert!(err.contains("not a hole"), "{err}");
        // Different state or device discontinuity: no merge.
        m.insert(ext(3, 1, 13, W)).unwrap();
        m.insert(ext(4, 1, 99, W)).unwrap();
        assert_eq!(m.len(), 3);
        m.check().unwrap();
    }

    #[test]
    fn insert_rejects_bad_extents() {
        let mut m = ExtentMap::new(BS as u32);
        assert!(m.insert(ext(0, 0, 1, W)).unwrap_err().contains("empty"));
        let huge = Extent {
            file_off: u64::MAX - BS + 1 - (u64::MAX - BS + 1) % BS,
            len: 2 * BS,
            addr: 0,
            state: W,
        };
        assert!(m.insert(huge).unwrap_err().contains("overflow"));
        assert!(m.is_empty());
    }

    #[test]
    fn remove_splits_and_returns_device_ranges() {
        let mut m = ExtentMap::new(BS as u32);
        m.insert(ext(0, 4, 100, W)).unwrap();
        m.insert(ext(6, 4, 200, U)).unwrap();
        let freed = m.remove_range(2 * BS, 6 * BS);
        assert_eq!(freed, vec![(102 * BS, 2 * BS), (200 * BS, 2 * BS)]);
        assert_eq!(
            m.iter().copied().collect::<Vec<_>>(),
            vec![ext(0, 2, 100, W), ext(8, 2, 202, U)]
        );
        assert_eq!(m.allocated_bytes(), 4 * BS);
        assert_eq!(
            m.truncate_blocks_from(BS),
            vec![(101 * BS, BS), (202 * BS, 2 * BS)]
        );
        assert_eq!(m.allocated_bytes(), BS);
        m.check().unwrap();
        // Extents apart in the file but end to end on the device: one range.
        let mut m = ExtentMap::new(BS as u32);
        for k in 0..4 {
            m.insert(ext(2 * k, 1, 300 + k, W)).unwrap();
        }
        m.insert(ext(8, 1, 400, W)).unwrap();
        assert_eq!(
            m.truncate_blocks_from(BS),
            vec![(301 * BS, 3 * BS), (400 * BS, BS)]
        );
    }

    #[test]
    fn convert_splits_then_merges() {
        let mut m = ExtentMap::new(BS as u32);
        m.insert(ext(0, 8, 100, U)).unwrap();
        assert_eq!(m.convert_written(2 * BS, 2 * BS), 2 * BS);
        assert_eq!(m.len(), 3);
        assert_eq!(m.convert_written(0, 8 * BS), 6 * BS);
        assert_eq!(
            m.iter().copied().collect::<Vec<_>>(),
            vec![ext(0, 8, 100, W)]
        );
        assert_eq!(m.convert_written(0, 8 * BS), 0);
        m.check().unwrap();
    }

    #[test]
    fn from_extents_validates() {
        let ok =
            ExtentMap::from_extents(BS as u32, vec![ext(0, 1, 5, W), ext(1, 1, 6, W)]).unwrap();
        assert_eq!(ok.len(), 2, "extents are kept as given");
        let err =
            ExtentMap::from_extents(BS as u32, vec![ext(0, 2, 5, W), ext(1, 1, 9, W)]).unwrap_err();
        assert!(err.starts_with("extent #1"), "{err}");
        let err =
            ExtentMap::from_extents(BS as u32, vec![ext(3, 1, 5, W), ext(1, 1, 9, W)]).unwrap_err();
        assert!(err.contains("not sorted"), "{err}");
        let unaligned = Extent {
            file_off: 0,
            len: BS,
            addr: 7,
            state: W,
        };
        let err = ExtentMap::from_extents(BS as u32, vec![unaligned]).unwrap_err();
        assert!(err.contains("aligned"), "{err}");
        let mut m = ExtentMap::new(BS as u32);
        assert!(m.insert(unaligned).unwrap_err().contains("aligned"));
    }

    /// A map read from pages keeps one chunk per page, each naming its
    /// page, and is checked across page boundaries as a map read whole is.
    #[test]
    fn from_pages_keeps_the_pages_and_validates() {
        let page = |first_key, count| PageRef {
            addr: 0,
            crc: 0,
            count,
            first_key,
            allocated: u64::from(count) * BS,
        };
        let pages = vec![
            (vec![ext(0, 1, 5, W), ext(2, 1, 6, U)], Some(page(0, 2))),
            (vec![ext(4, 2, 9, W)], None),
            (vec![ext(7, 1, 20, W)], Some(page(7 * BS, 1))),
        ];
        let m = ExtentMap::from_pages(BS as u32, pages.clone()).unwrap();
        m.check().unwrap();
        assert_eq!(m.allocated_bytes(), 5 * BS);
        let read: Vec<(Vec<Extent>, Option<PageRef>)> = m
            .chunk_pages()
            .map(|c| (c.extents().to_vec(), c.page()))
            .collect();
        assert_eq!(read, pages);
        assert_eq!(m.lookup(5 * BS), Lookup::Extent(ext(4, 2, 9, W)));

        let overlap = vec![(vec![ext(0, 3, 5, W)], None), (vec![ext(2, 1, 9, W)], None)];
        let err = ExtentMap::from_pages(BS as u32, overlap).unwrap_err();
        assert!(
            err.starts_with("extent #1") && err.contains("overlaps"),
            "{err}"
        );
        let within = vec![(
            vec![ext(0, 1, 5, W), ext(4, 2, 9, W), ext(5, 1, 20, W)],
            None,
        )];
        let err = ExtentMap::from_pages(BS as u32, within).unwrap_err();
        assert!(
            err.starts_with("extent #2") && err.contains("overlaps"),
            "{err}"
        );
        let err = ExtentMap::from_pages(BS as u32, vec![(vec![], None)]).unwrap_err();
        assert!(err.contains("page #0 holds 0 extents"), "{err}");
        let too_many: Vec<Extent> = (0..=CHUNK_MAX as u64)
            .map(|i| ext(2 * i, 1, i, W))
            .collect();
        let named = vec![(too_many.clone(), Some(page(0, too_many.len() as u32)))];
        let err = ExtentMap::from_pages(BS as u32, named).unwrap_err();
        assert!(err.contains("page #0 holds 9 extents"), "{err}");
        // Extents no page holds (a delta changed them at mount) go into
        // chunks of their own, after the paged chunk before them.
        let before = (vec![ext(100, 1, 50, W)], Some(page(100 * BS, 1)));
        let later: Vec<Extent> = too_many
            .iter()
            .map(|e| ext(e.file_off / BS + 200, 1, 60 + e.addr / BS, W))
            .collect();
        let m = ExtentMap::from_pages(
            BS as u32,
            vec![
                (too_many.clone(), None),
                before.clone(),
                (later.clone(), None),
            ],
        )
        .unwrap();
        m.check().unwrap();
        let read: Vec<(usize, Option<PageRef>)> = m
            .chunk_pages()
            .map(|c| (c.extents().len(), c.page()))
            .collect();
        assert_eq!(
            read,
            [
                (CHUNK_MAX, None),
                (1, None),
                (1, before.1),
                (CHUNK_MAX, None),
                (1, None)
            ]
        );
        assert_eq!(m.len(), 2 * too_many.len() + 1);
    }

    // ---- absent chunks ----------------------------------------------------

    use chunks::testing::PageStore;
    use std::sync::atomic::Ordering;

    #[derive(Clone, Debug)]
    enum LazyOp {
        Change(Op),
        Lookup(u64),
        Unload,
    }

    /// Many short extents over a file of 160 blocks: chunks of 8 (in
    /// tests) with many neighbours, so that changes meet chunk ends.
    fn lazy_op() -> impl Strategy<Value = LazyOp> {
        const BLOCKS: u64 = 160;
        let change = prop_oneof![
            8 => (0..BLOCKS, 1..3u64, prop::option::of(0..400u64), any::<bool>()).prop_map(
                |(blk, nblk, addr_blk, written)| Op::Insert { blk, nblk, addr_blk, written }
            ),
            3 => (0..BLOCKS, 0..6u64).prop_map(|(blk, nblk)| Op::Remove { blk, nblk }),
            3 => (0..BLOCKS, 0..12u64).prop_map(|(blk, nblk)| Op::Convert { blk, nblk }),
            1 => (BLOCKS / 2..BLOCKS + 2).prop_map(|blk| Op::Truncate { blk }),
        ];
        prop_oneof![
            8 => change.prop_map(LazyOp::Change),
            4 => (0..(BLOCKS + 8) * BS).prop_map(LazyOp::Lookup),
            1 => Just(LazyOp::Unload),
        ]
    }

    /// The same change on a map whose chunks are all loaded and on one
    /// whose chunks are absent until an entry point loads them: the entry
    /// points load exactly what the map operations then read (no chunk is
    /// loaded outside them), and the two maps answer alike.
    fn apply_both(
        full: &mut ExtentMap,
        lazy: &mut ExtentMap,
        op: &Op,
    ) -> Result<(), TestCaseError> {
        match *op {
            Op::Insert {
                blk,
                nblk,
                addr_blk,
                written,
            } => {
                let e = ext(
                    blk,
                    nblk,
                    addr_blk.unwrap_or(1000 + blk),
                    if written { W } else { U },
                );
                lazy.load_for_change(e.file_off, e.file_end()).unwrap();
                prop_assert_eq!(full.insert(e).is_ok(), lazy.insert(e).is_ok());
            }
            Op::Remove { blk, nblk } => {
                lazy.load_for_change(blk * BS, (blk + nblk) * BS).unwrap();
                prop_assert_eq!(
                    full.remove_range(blk * BS, nblk * BS),
                    lazy.remove_range(blk * BS, nblk * BS)
                );
            }
            Op::Convert { blk, nblk } => {
                lazy.load_for_change(blk * BS, (blk + nblk) * BS).unwrap();
                prop_assert_eq!(
                    full.convert_written(blk * BS, nblk * BS),
                    lazy.convert_written(blk * BS, nblk * BS)
                );
            }
            Op::Truncate { blk } => {
                lazy.load_for_change(blk * BS, u64::MAX).unwrap();
                prop_assert_eq!(
                    full.truncate_blocks_from(blk * BS),
                    lazy.truncate_blocks_from(blk * BS)
                );
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn absent_chunks_answer_as_a_loaded_map(
            ops in prop::collection::vec(lazy_op(), 1..200),
            from in 0..170 * BS,
        ) {
            let store = std::sync::Arc::new(PageStore::default());
            let mut full = ExtentMap::new(BS as u32);
            let mut lazy = ExtentMap::new(BS as u32);
            for op in &ops {
                match op {
                    LazyOp::Change(op) => apply_both(&mut full, &mut lazy, op)?,
                    LazyOp::Lookup(pos) => {
                        let before = store.loads.load(Ordering::Relaxed);
                        let read = lazy.load_keys(*pos, pos + 1).unwrap();
                        prop_assert!(read <= 1, "a lookup read {} pages", read);
                        prop_assert_eq!(store.loads.load(Ordering::Relaxed) - before, read);
                        prop_assert_eq!(lazy.lookup(*pos), full.lookup(*pos));
                    }
                    LazyOp::Unload => {
                        lazy.map.write_and_unload(&store);
                        prop_assert_eq!(lazy.loaded_chunks(), 0);
                    }
                }
                prop_assert_eq!(store.unplanned.load(Ordering::Relaxed), 0, "after {:?}", op);
                lazy.map.check().map_err(TestCaseError::fail)?;
                prop_assert_eq!(lazy.len(), full.len());
                prop_assert_eq!(lazy.allocated_bytes(), full.allocated_bytes());
            }
            // Whole: every chunk loads to what was written.
            let mut seen = Vec::new();
            let complete = lazy
                .for_each_unkept(0, |e| {
                    seen.push(*e);
                    true
                })
                .unwrap();
            prop_assert!(complete);
            prop_assert!(seen.iter().eq(full.iter()));
            // From a key: a tail of the extents, every one that ends past
            // the key in it, from the chunk that owns the key (so at most
            // a chunk's worth before it).
            let mut tail = Vec::new();
            lazy.for_each_unkept(from, |e| {
                tail.push(*e);
                true
            })
            .unwrap();
            let skipped = seen.len() - tail.len();
            prop_assert_eq!(&seen[skipped..], &tail[..]);
            prop_assert!(seen[..skipped].iter().all(|e| e.file_end() <= from));
            let before = tail.iter().take_while(|e| e.file_end() <= from).count();
            prop_assert!(before <= CHUNK_MAX, "{} extents before {}", before, from);
            lazy.load_all().unwrap();
            prop_assert_eq!(store.unplanned.load(Ordering::Relaxed), 0);
            lazy.check().map_err(TestCaseError::fail)?;
            prop_assert!(lazy.iter().eq(full.iter()));
        }
    }

    /// A chunk whose page fails to load: the entry point fails with the
    /// loader's error, the chunk stays absent (a later access tries
    /// again), and the other chunks answer.
    #[test]
    fn a_page_that_fails_to_load_fails_the_entry_point_only() {
        let store = std::sync::Arc::new(PageStore::default());
        let mut m = ExtentMap::new(BS as u32);
        for b in 0..40 {
            m.insert(ext(2 * b, 1, 7 * b + 3, W)).unwrap();
        }
        let want = m.clone();
        m.map.write_and_unload(&store);
        let chunks = m.chunk_count();
        assert!(chunks > 3);
        let second = m.chunk_pages().nth(1).unwrap().page().unwrap();
        store.damaged.lock().unwrap().push(second.addr);
        let err = m
            .load_keys(second.first_key, second.first_key + 1)
            .unwrap_err();
        assert!(matches!(err, crate::Error::Corrupt { .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("from file offset {}", second.first_key)),
            "{err}"
        );
        assert_eq!(m.loaded_chunks(), 0, "the damaged chunk stays absent");
        assert_eq!(m.load_keys(0, 1).unwrap(), 1);
        assert_eq!(m.lookup(0), want.lookup(0));
        store.damaged.lock().unwrap().clear();
        assert_eq!(
            m.load_keys(second.first_key, second.first_key + 1).unwrap(),
            1,
            "retried"
        );
        assert_eq!(m.lookup(second.first_key), want.lookup(second.first_key));
        assert_eq!(store.unplanned.load(Ordering::Relaxed), 0);
    }

    // ---- model test -------------------------------------------------------

    const FILE_BLOCKS: u64 = 48;

    #[derive(Clone, Debug)]
    enum Op {
        Insert {
            blk: u64,
            nblk: u64,
            addr_blk: Option<u64>,
            written: bool,
        },
        Remove {
            blk: u64,
            nblk: u64,
        },
        Convert {
            blk: u64,
            nblk: u64,
        },
        Truncate {
            blk: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..FILE_BLOCKS, 1..8u64, prop::option::of(0..64u64), any::<bool>()).prop_map(
                |(blk, nblk, addr_blk, written)| Op::Insert { blk, nblk, addr_blk, written }
            ),
            2 => (0..FILE_BLOCKS, 0..16u64).prop_map(|(blk, nblk)| Op::Remove { blk, nblk }),
            2 => (0..FILE_BLOCKS, 0..16u64).prop_map(|(blk, nblk)| Op::Convert { blk, nblk }),
            1 => (0..FILE_BLOCKS + 2).prop_map(|blk| Op::Truncate { blk }),
        ]
    }

    type Model = Vec<Option<(u64, ExtentState)>>;

    fn blocks_of(ranges: &[(u64, u64)]) -> Vec<u64> {
        let mut v: Vec<u64> = ranges
            .iter()
            .flat_map(|&(a, l)| (a / BS..(a + l) / BS).collect::<Vec<_>>())
            .collect();
        v.sort_unstable();
        v
    }

    fn model_remove(model: &mut Model, blk: u64, end: u64) -> Vec<u64> {
        let mut freed = Vec::new();
        for b in blk..end.min(model.len() as u64) {
            if let Some((a, _)) = model[b as usize].take() {
                freed.push(a);
            }
        }
        freed.sort_unstable();
        freed
    }

    fn check_against(m: &ExtentMap, model: &Model) -> Result<(), TestCaseError> {
        m.check().map_err(TestCaseError::fail)?;
        // Built from an empty map, merging must be complete.
        let exts: Vec<Extent> = m.iter().copied().collect();
        prop_assert_eq!(exts.len(), m.len());
        for w in exts.windows(2) {
            prop_assert!(
                !(w[0].file_end() == w[1].file_off
                    && w[0].addr_end() == w[1].addr
                    && w[0].state == w[1].state),
                "not merged: {:?}",
                w
            );
        }
        let mapped = model.iter().filter(|b| b.is_some()).count() as u64;
        prop_assert_eq!(m.allocated_bytes(), mapped * BS);
        for b in 0..model.len() as u64 {
            for pos in [b * BS, b * BS + BS / 2, b * BS + BS - 1] {
                match (m.lookup(pos), model[b as usize]) {
                    (Lookup::Extent(e), Some((addr, state))) => {
                        prop_assert!(e.file_off <= pos && pos < e.file_end());
                        prop_assert_eq!((e.addr + (b * BS - e.file_off)) / BS, addr);
                        prop_assert_eq!(e.state, state);
                    }
                    (Lookup::Hole { end }, None) => {
                        let next = (b..model.len() as u64)
                            .find(|&n| model[n as usize].is_some())
                            .map(|n| n * BS);
                        prop_assert_eq!(end, next, "hole end at block {}", b);
                    }
                    (got, want) => {
                        prop_assert!(false, "block {}: map {:?}, model {:?}", b, got, want)
                    }
                }
            }
        }
        Ok(())
    }

    fn model_holes(model: &Model, blk: u64, end: u64) -> Vec<(u64, u64)> {
        let mut holes: Vec<(u64, u64)> = Vec::new();
        for b in blk..end {
            if model.get(b as usize).copied().flatten().is_none() {
                match holes.last_mut() {
                    Some((o, l)) if *o + *l == b * BS => *l += BS,
                    _ => holes.push((b * BS, BS)),
                }
            }
        }
        holes
    }

    proptest! {
        #[test]
        fn matches_block_model(ops in prop::collection::vec(op(), 1..60)) {
            // Room past FILE_BLOCKS so inserts near the end fit.
            let mut model: Model = vec![None; (FILE_BLOCKS + 8) as usize];
            let mut m = ExtentMap::new(BS as u32);
            for op in ops {
                match op {
                    Op::Insert { blk, nblk, addr_blk, written } => {
                        // `None`: the identity placement, so neighbours merge.
                        let addr_blk = addr_blk.unwrap_or(1000 + blk);
                        let state = if written { W } else { U };
                        let is_hole = (blk..blk + nblk).all(|b| model[b as usize].is_none());
                        let r = m.insert(ext(blk, nblk, addr_blk, state));
                        prop_assert_eq!(r.is_ok(), is_hole, "{:?}", r);
                        if is_hole {
                            for i in 0..nblk {
                                model[(blk + i) as usize] = Some(((addr_blk + i), state));
                            }
                        }
                    }
                    Op::Remove { blk, nblk } => {
                        let freed = m.remove_range(blk * BS, nblk * BS);
                        let want = model_remove(&mut model, blk, blk + nblk);
                        prop_assert_eq!(blocks_of(&freed), want);
                    }
                    Op::Convert { blk, nblk } => {
                        let n = m.convert_written(blk * BS, nblk * BS);
                        let mut want = 0;
                        for b in blk..(blk + nblk).min(model.len() as u64) {
                            if let Some((_, s)) = &mut model[b as usize] {
                                if *s == U {
                                    *s = W;
                                    want += BS;
                                }
                            }
                        }
                        prop_assert_eq!(n, want);
                    }
                    Op::Truncate { blk } => {
                        let freed = m.truncate_blocks_from(blk * BS);
                        let want = model_remove(&mut model, blk, u64::MAX);
                        prop_assert_eq!(blocks_of(&freed), want);
                    }
                }
                check_against(&m, &model)?;
                for (blk, nblk) in [(0, FILE_BLOCKS + 8), (3, 9), (FILE_BLOCKS / 2, 5)] {
                    let want = model_holes(&model, blk, blk + nblk);
                    prop_assert_eq!(m.holes_in(blk * BS, nblk * BS), want.clone());
                    let bytes: u64 = want.iter().map(|h| h.1).sum();
                    prop_assert_eq!(m.hole_bytes_in(blk * BS, nblk * BS), bytes);
                }
                let rebuilt = ExtentMap::from_extents(BS as u32, m.iter().copied().collect())
                    .map_err(TestCaseError::fail)?;
                prop_assert_eq!(&rebuilt, &m);
            }
        }

        /// The room for held extents counts their chunks by
        /// `chunks_added_at_most`: from full chunks (every one a split
        /// away), whatever the changes, the chunks added never pass it for
        /// the extents added.
        #[test]
        fn chunks_added_stay_within_the_bound(
            initial in 1..FILE_BLOCKS / 2,
            unwritten in 0..FILE_BLOCKS / 2,
            appends in 0..120u64,
            ops in prop::collection::vec(op(), 1..200),
        ) {
            // Every other block: full chunks of one-block extents, the
            // first `unwritten` of them unwritten.
            let extents = (0..initial)
                .map(|b| ext(2 * b, 1, 5000 + 7 * b, if b < unwritten { U } else { W }))
                .collect();
            let mut m = ExtentMap::from_extents(BS as u32, extents).unwrap();
            let start = m.chunk_count() as u64;
            let mut added = 0u64;
            let check = |m: &ExtentMap, added: u64| {
                let now = m.chunk_count() as u64;
                prop_assert!(
                    now <= start + chunks_added_at_most(start, added),
                    "{} chunks from {} after {} extents added",
                    now,
                    start,
                    added
                );
                Ok(())
            };
            // Appends split the last chunk every half chunk: the bound's
            // worst case after the first split.
            for i in 0..appends {
                m.insert(ext(2 * (initial + i), 1, 9000 + 3 * i, W)).unwrap();
                added += 1;
                check(&m, added)?;
            }
            for op in ops {
                let before = m.len() as u64;
                match op {
                    Op::Insert { blk, nblk, addr_blk, written } => {
                        let addr_blk = addr_blk.unwrap_or(1000 + blk);
                        let _ = m.insert(ext(blk, nblk, addr_blk, if written { W } else { U }));
                    }
                    Op::Remove { blk, nblk } => drop(m.remove_range(blk * BS, nblk * BS)),
                    Op::Convert { blk, nblk } => drop(m.convert_written(blk * BS, nblk * BS)),
                    Op::Truncate { blk } => drop(m.truncate_blocks_from(blk * BS)),
                }
                added += (m.len() as u64).saturating_sub(before);
                check(&m, added)?;
            }
        }
    }
}
