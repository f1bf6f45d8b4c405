//! Extent maps as mount reads them from extent pages: per file, the chunks
//! its pages hold, each still naming its page, with the chain's deltas laid
//! over them chunk by chunk (issue 13, item 4).
//!
//! Mount builds each file's map from these chunks as they are, one chunk
//! per page ([`crate::extent_map::ExtentMap::from_pages`]), without a flat
//! copy of the extents between. A delta replaces a file's extents in key
//! spans; only the chunks whose keys a span reaches change (and lose their
//! page), so the first base after mount writes pages for the chunks the
//! chain changed, not for every file a delta named.
//!
//! Which chunk a key belongs to: chunk `j` owns the keys from its first
//! extent's key up to the next chunk's first key (chunk 0 from key 0, the
//! last up to the end). An extent a delta adds lands in the chunk owning
//! its key, so every key is some chunk's and a span changes exactly the
//! chunks owning a key inside it.

use std::ops::Range;

use crate::codec::{self, PageRef};
use crate::extent_map::search::first_key_at_or_after;
use crate::extent_map::span_merge::SpanMerge;
use crate::types::{Extent, Ino, KeySpan, MetaImage};

/// Extents in key order (non-empty), and the page that holds exactly them
/// (`None`: a delta changed them since the page was written). *Absent*
/// ([`PageChunk::absent`]): no extents yet and a page, which holds them
/// (mount reads pages on demand; only the chunks a delta reaches are
/// read while it applies the chain).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageChunk {
    pub extents: Vec<Extent>,
    pub page: Option<PageRef>,
    /// The first page of an index page's run: mount starts a segment of
    /// the map here, so that a base finds the same run again for a
    /// segment nothing changed (`extent_pages::index_runs`).
    pub starts_run: bool,
}

impl PageChunk {
    /// A chunk whose extents are still in `page` only.
    pub fn absent(page: PageRef) -> Self {
        PageChunk {
            extents: Vec::new(),
            page: Some(page),
            starts_run: false,
        }
    }

    pub fn is_absent(&self) -> bool {
        self.extents.is_empty()
    }

    fn first_key(&self) -> u64 {
        match (self.extents.first(), self.page) {
            (Some(e), _) => e.file_off,
            (None, Some(p)) => p.first_key,
            (None, None) => 0,
        }
    }

    /// Extents it holds, without reading an absent one.
    fn len(&self) -> usize {
        match (self.extents.len(), self.page) {
            (0, Some(p)) => p.count as usize,
            (n, _) => n,
        }
    }
}

/// The chunk indices of `chunks` the spans reach: chunk `j` owns the keys
/// from its first key up to the next chunk's (chunk 0 from key 0).
fn reached(chunks: &[PageChunk], spans: &[KeySpan]) -> Vec<Range<usize>> {
    let owner = |key: u64| {
        chunks
            .partition_point(|c| c.first_key() <= key)
            .saturating_sub(1)
    };
    spans
        .iter()
        .filter(|(s, e)| s < e)
        .map(|&(start, end)| owner(start)..(owner(end - 1) + 1).min(chunks.len()))
        .collect()
}

/// One file's chunks: as its page list names them, every one absent, or
/// in a vector once a delta reaches the file.
///
/// Mount starts every file listed: a vector of chunks is 72 bytes per
/// chunk (18.9 MB at 50M extents, grown by doubling), built and freed in
/// the mount though no delta reached the file. It was most of a fresh
/// process's peak after mount (27 MiB, 21 without it and the sets of
/// `mount::used_pages`) and of the mount's time (100-128 ms at 50M
/// extents, 44-67 without).
#[derive(Clone, Debug)]
enum FileChunks {
    Listed {
        pages: codec::PageList,
        /// Pages of each index page's run, in order: a run's first chunk
        /// starts a segment ([`PageChunk::starts_run`]).
        run_pages: Vec<u32>,
    },
    Chunks(Vec<PageChunk>),
}

impl FileChunks {
    fn is_empty(&self) -> bool {
        match self {
            FileChunks::Listed { pages, .. } => pages.is_empty(),
            FileChunks::Chunks(chunks) => chunks.is_empty(),
        }
    }

    /// The chunks in a vector (built from the list first if listed).
    fn chunks_mut(&mut self) -> &mut Vec<PageChunk> {
        if let FileChunks::Listed { .. } = self {
            let chunks = self.views().map(PageChunk::from).collect();
            *self = FileChunks::Chunks(chunks);
        }
        match self {
            FileChunks::Chunks(chunks) => chunks,
            FileChunks::Listed { .. } => unreachable!("built above"),
        }
    }

    /// Each chunk's extents (none if absent), page and whether it starts
    /// an index page's run.
    fn views(&self) -> impl Iterator<Item = ChunkView<'_>> {
        let (listed, chunks) = match self {
            FileChunks::Listed { pages, run_pages } => (
                Some(listed_pages(pages.clone(), run_pages.clone())),
                &[][..],
            ),
            FileChunks::Chunks(chunks) => (None, &chunks[..]),
        };
        let listed = listed
            .into_iter()
            .flatten()
            .map(|(page, starts_run)| ChunkView {
                extents: &[],
                page: Some(page),
                starts_run,
            });
        listed.chain(chunks.iter().map(|c| ChunkView {
            extents: &c.extents,
            page: c.page,
            starts_run: c.starts_run,
        }))
    }
}

/// The pages of a listed file in order, each with whether it starts one
/// of the runs of `run_pages` pages.
fn listed_pages(
    pages: codec::PageList,
    run_pages: Vec<u32>,
) -> impl Iterator<Item = (PageRef, bool)> {
    let mut starts = run_pages.into_iter().scan(0usize, |at, n| {
        let start = *at;
        *at += n as usize;
        Some(start)
    });
    let mut next_start = starts.next();
    let runs = pages.runs().to_vec();
    runs.into_iter()
        .flat_map(|run| (0..run.len()).map(move |j| run[j]))
        .enumerate()
        .map(move |(i, page)| {
            let starts_run = next_start == Some(i);
            // Runs of no pages start where the next does.
            while next_start.is_some_and(|s| s <= i) {
                next_start = starts.next();
            }
            (page, starts_run)
        })
}

/// A chunk of a [`FileChunks`], either way it is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChunkView<'a> {
    extents: &'a [Extent],
    page: Option<PageRef>,
    starts_run: bool,
}

impl From<ChunkView<'_>> for PageChunk {
    fn from(v: ChunkView<'_>) -> PageChunk {
        PageChunk {
            extents: v.extents.to_vec(),
            page: v.page,
            starts_run: v.starts_run,
        }
    }
}

/// Per file a checkpoint's base keeps in pages, sorted by inode number:
/// its chunks in key order, sorted and disjoint across chunks. Equal when
/// the files' chunks are (whatever table they share runs of, listed or
/// not).
#[derive(Clone, Debug, Default)]
pub struct PagedMaps {
    files: Vec<(Ino, FileChunks)>,
    /// The page table the absent chunks come from, whose runs the maps
    /// built from them share ([`PagedMaps::share_lists`]).
    lists: codec::PageTable,
}

/// How a delta changes one paged file's chunks, planned (and checked)
/// against them without changing them: each run of chunks a span reaches
/// becomes one chunk (or none) without a page.
#[derive(Debug)]
pub struct ChunkMerge {
    /// Chunk index ranges, in order and apart, and what replaces each.
    runs: Vec<(Range<usize>, Vec<Extent>)>,
    /// Extents the file has after the merge.
    pub merged_len: usize,
}

impl PartialEq for PagedMaps {
    fn eq(&self, other: &PagedMaps) -> bool {
        self.files.len() == other.files.len()
            && self
                .files
                .iter()
                .zip(&other.files)
                .all(|((a, ac), (b, bc))| a == b && ac.views().eq(bc.views()))
    }
}

impl Eq for PagedMaps {}

impl PagedMaps {
    /// Adds `ino`'s chunks; `ino` must be above every file added so far
    /// (a page table is sorted).
    pub fn push_file(&mut self, ino: Ino, chunks: Vec<PageChunk>) -> Result<(), String> {
        if self.files.last().is_some_and(|&(last, _)| last >= ino) {
            return Err(format!("inode {ino}'s pages are out of order"));
        }
        self.files.push((ino, FileChunks::Chunks(chunks)));
        Ok(())
    }

    /// Adds `ino` with every chunk absent, one per page of `pages`, those
    /// at the start of each of `run_pages` (an index page's run) starting
    /// a segment; as [`PagedMaps::push_file`] requires, above every file
    /// added so far. Nothing is built per chunk until a delta reaches the
    /// file.
    pub fn push_listed(
        &mut self,
        ino: Ino,
        pages: codec::PageList,
        run_pages: Vec<u32>,
    ) -> Result<(), String> {
        if self.files.last().is_some_and(|&(last, _)| last >= ino) {
            return Err(format!("inode {ino}'s pages are out of order"));
        }
        self.files
            .push((ino, FileChunks::Listed { pages, run_pages }));
        Ok(())
    }

    /// Keeps `table` (the one the absent chunks come from) for the maps
    /// to share its runs ([`PagedMaps::take_lists`]).
    pub fn share_lists(&mut self, table: &codec::PageTable) {
        self.lists = table.clone();
    }

    /// The table [`PagedMaps::share_lists`] kept.
    pub fn take_lists(&mut self) -> codec::PageTable {
        std::mem::take(&mut self.lists)
    }

    fn position(&self, ino: Ino) -> Option<usize> {
        self.files.binary_search_by_key(&ino, |&(i, _)| i).ok()
    }

    /// Whether `ino`'s extents are kept here, and if so whether it has any.
    pub fn has_extents(&self, ino: Ino) -> Option<bool> {
        self.position(ino).map(|i| !self.files[i].1.is_empty())
    }

    /// `ino`'s chunks to plan a change against, if its extents are kept
    /// here (in a vector from here on).
    pub fn chunks_to_change(&mut self, ino: Ino) -> Option<&[PageChunk]> {
        let i = self.position(ino)?;
        Some(&self.files[i].1.chunks_mut()[..])
    }

    /// Reads the absent chunks the spans of `delta` reach (with `read`),
    /// so that [`plan_merge`] can lay the delta over them; the others
    /// stay absent. Returns how many it read.
    pub fn load_reached(
        &mut self,
        delta: &crate::types::MetaDelta,
        mut read: impl FnMut(Ino, &PageRef) -> crate::error::Result<Vec<Extent>>,
    ) -> crate::error::Result<usize> {
        let mut loaded = 0;
        for c in &delta.changed {
            let Some(i) = self.position(c.inode.ino) else {
                continue;
            };
            if c.spans.iter().all(|(s, e)| s >= e) {
                continue;
            }
            let (ino, chunks) = &mut self.files[i];
            let chunks = chunks.chunks_mut();
            for run in reached(chunks, &c.spans) {
                for chunk in &mut chunks[run] {
                    if let (true, Some(page)) = (chunk.is_absent(), chunk.page) {
                        chunk.extents = read(*ino, &page)?;
                        loaded += 1;
                    }
                }
            }
        }
        Ok(loaded)
    }

    /// Forgets the files of `removed` (sorted; a delta removed them), in
    /// one pass: one `Vec::remove` per file would move the files after it
    /// each time, quadratic in a delta removing many paged files.
    pub fn remove_files(&mut self, removed: &[Ino]) {
        if removed.is_empty() {
            return;
        }
        self.files
            .retain(|(ino, _)| removed.binary_search(ino).is_err());
    }

    /// Applies `merge`, planned by [`plan_merge`] against `ino`'s chunks as
    /// they are.
    pub fn apply(&mut self, ino: Ino, merge: ChunkMerge) {
        let Some(i) = self.position(ino) else {
            debug_assert!(false, "a merge for inode {ino}, which has no chunks");
            return;
        };
        // Rebuilt in one pass: splicing each run in place would move the
        // chunks after it once per run whose length changes.
        let old = std::mem::take(self.files[i].1.chunks_mut());
        let mut chunks = Vec::with_capacity(old.len());
        let mut old = old.into_iter().enumerate().peekable();
        for (run, extents) in merge.runs {
            while let Some((_, chunk)) = old.next_if(|&(j, _)| j < run.start) {
                chunks.push(chunk);
            }
            while old.next_if(|&(j, _)| j < run.end).is_some() {}
            // Merged chunks are loaded, with no page: a run starts only at
            // an absent chunk (`ExtentMap::from_runs_lazy`).
            if !extents.is_empty() {
                chunks.push(PageChunk {
                    extents,
                    page: None,
                    starts_run: false,
                });
            }
        }
        chunks.extend(old.map(|(_, chunk)| chunk));
        self.files[i].1 = FileChunks::Chunks(chunks);
    }

    /// The files and their chunks, by inode number: each chunk's extents
    /// (none if absent), page and whether it starts an index page's run.
    pub fn into_files(
        self,
    ) -> impl Iterator<
        Item = (
            Ino,
            impl Iterator<Item = (Vec<Extent>, Option<PageRef>, bool)>,
        ),
    > {
        self.files.into_iter().map(|(ino, chunks)| {
            let (listed, chunks) = match chunks {
                FileChunks::Listed { pages, run_pages } => {
                    (Some(listed_pages(pages, run_pages)), Vec::new())
                }
                FileChunks::Chunks(chunks) => (None, chunks),
            };
            let listed = listed
                .into_iter()
                .flatten()
                .map(|(page, starts_run)| (Vec::new(), Some(page), starts_run));
            (
                ino,
                listed.chain(
                    chunks
                        .into_iter()
                        .map(|c| (c.extents, c.page, c.starts_run)),
                ),
            )
        })
    }

    /// Puts each file's extents into its inode of `image` (where it has
    /// none): the whole image, for callers that want one.
    pub fn fill_image(self, image: &mut MetaImage) -> Result<(), String> {
        for (ino, chunks) in self.files {
            let Ok(i) = image.inodes.binary_search_by_key(&ino, |i| i.ino) else {
                return Err(format!("inode {ino} has pages and is not in the image"));
            };
            let chunks = match chunks {
                FileChunks::Chunks(chunks) => chunks,
                FileChunks::Listed { pages, .. } if pages.is_empty() => Vec::new(),
                FileChunks::Listed { .. } => {
                    return Err(format!("inode {ino}'s pages were not read"));
                }
            };
            if chunks.iter().any(PageChunk::is_absent) {
                return Err(format!("inode {ino}'s pages were not read"));
            }
            let extents = &mut image.inodes[i].extents;
            extents.reserve(chunks.iter().map(|c| c.extents.len()).sum());
            for c in chunks {
                extents.extend_from_slice(&c.extents);
            }
        }
        Ok(())
    }
}

/// Plans replacing the extents of `chunks` stored under keys in `spans`
/// with `new` (each under a key in a span), as a delta does: the chunks
/// owning a key in a span are merged by runs, the rest kept with their
/// pages. Checks what `SpanMerge::plan` checks on a whole map, including
/// where a changed run meets the kept chunk after it.
pub fn plan_merge(
    chunks: &[PageChunk],
    spans: &[KeySpan],
    new: &[Extent],
) -> Result<ChunkMerge, String> {
    // The chunk owning `key` (0 for keys below the first chunk's).
    let owner = |key: u64| {
        chunks
            .partition_point(|c| c.first_key() <= key)
            .saturating_sub(1)
    };
    // Per run, the chunks it covers and the spans reaching them (spans are
    // sorted, and each reaches the chunks of one run only).
    let mut runs: Vec<(Range<usize>, Range<usize>)> = Vec::new();
    for (i, &(start, end)) in spans.iter().enumerate().filter(|(_, (s, e))| s < e) {
        // Clamped: a file whose chunks a delta emptied has none, and the
        // run of its (absent) chunk 0 is the empty range 0..0.
        let reached = owner(start)..(owner(end - 1) + 1).min(chunks.len());
        match runs.last_mut() {
            // Runs that meet are one: each run is merged apart from the
            // others, so a kept chunk must lie between any two.
            Some((last, its_spans)) if reached.start <= last.end => {
                last.end = last.end.max(reached.end);
                its_spans.end = i + 1;
            }
            _ => runs.push((reached, i..i + 1)),
        }
    }
    let owned = |run: &Range<usize>| -> (u64, u64) {
        let low = if run.start == 0 {
            0
        } else {
            chunks[run.start].first_key()
        };
        let high = chunks.get(run.end).map_or(u64::MAX, PageChunk::first_key);
        (low, high)
    };
    let mut merged_len: usize = chunks.iter().map(PageChunk::len).sum();
    let mut planned = Vec::with_capacity(runs.len());
    let mut added = 0;
    let mut clipped = Vec::new();
    for (run, its_spans) in runs {
        let (low, high) = owned(&run);
        let new_start = first_key_at_or_after(new, added, low);
        if new_start > added {
            return Err(outside_every_span(&new[added]));
        }
        let new_end = first_key_at_or_after(new, added, high);
        clipped.clear();
        clipped.extend(
            spans[its_spans]
                .iter()
                .filter(|&&(s, e)| s < high && low < e)
                .map(|&(s, e)| (s.max(low), e.min(high))),
        );
        let kept = &chunks[run.clone()];
        if kept.iter().any(PageChunk::is_absent) {
            return Err(format!(
                "a span reaches chunks {run:?}, not read first (PagedMaps::load_reached)"
            ));
        }
        // Room for what the merge adds: growing a run of a large file in
        // place would copy all of it again.
        let room = kept.iter().map(|c| c.extents.len()).sum::<usize>() + (new_end - new_start);
        let mut extents: Vec<Extent> = Vec::with_capacity(room);
        for c in kept {
            extents.extend_from_slice(&c.extents);
        }
        let old_len = extents.len();
        let merge = SpanMerge::plan(&extents, &clipped, &new[new_start..new_end])?;
        let merged = merge.merged_len;
        merge.apply(&mut extents, &new[new_start..new_end]);
        // Only the kept chunk after the run needs a check: every key in the
        // run is at least its first chunk's first key, where the kept
        // chunk before it ends (the map was sorted and disjoint).
        if let (Some(last), Some(after)) = (extents.last(), chunks.get(run.end)) {
            match after.extents.first() {
                Some(first) => codec::check_extent(first, Some(last))?,
                // Its extents start at its first key (checked when read).
                None if after.first_key() < last.file_end() => {
                    return Err(format!(
                        "extent at file offset {} overlaps the page from file offset {}",
                        last.file_off,
                        after.first_key()
                    ))
                }
                None => {}
            }
        }
        merged_len = merged_len - old_len + merged;
        added = new_end;
        planned.push((run, extents));
    }
    if let Some(e) = new.get(added) {
        return Err(outside_every_span(e));
    }
    Ok(ChunkMerge {
        runs: planned,
        merged_len,
    })
}

fn outside_every_span(e: &Extent) -> String {
    format!(
        "extent at file offset {} is outside every key span",
        e.file_off
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ExtentState;
    use proptest::prelude::*;

    const BS: u64 = 4096;

    /// One-block extent at block `key`, mapped to block `addr`.
    fn ext(key: u64, blocks: u64, addr: u64) -> Extent {
        Extent {
            file_off: key * BS,
            len: blocks * BS,
            addr: addr * BS,
            state: ExtentState::Written,
        }
    }

    /// A made-up page reference, told apart by `n`.
    fn page(n: u64) -> PageRef {
        PageRef {
            addr: n * BS,
            crc: n as u32,
            count: 1,
            first_key: 0,
            allocated: BS,
        }
    }

    fn chunk(keys: &[u64], n: u64) -> PageChunk {
        PageChunk {
            extents: keys.iter().map(|&k| ext(k, 1, 1000 + k)).collect(),
            page: Some(page(n)),
            starts_run: false,
        }
    }

    fn flat(chunks: &[PageChunk]) -> Vec<Extent> {
        chunks.iter().flat_map(|c| c.extents.clone()).collect()
    }

    fn merged(chunks: &[PageChunk], spans: &[KeySpan], new: &[Extent]) -> Vec<PageChunk> {
        let mut maps = PagedMaps::default();
        maps.push_file(9, chunks.to_vec()).unwrap();
        let merge = plan_merge(chunks, spans, new).unwrap();
        maps.apply(9, merge);
        maps.chunks_to_change(9).unwrap().to_vec()
    }

    /// A span inside the middle chunk changes only it; the chunks before
    /// and after keep their pages. A span over the gap between two chunks
    /// reaches only the chunk that owns the gap (the one before it).
    #[test]
    fn a_span_changes_only_the_chunks_owning_its_keys() {
        let chunks = [chunk(&[0, 2], 1), chunk(&[4, 6], 2), chunk(&[10, 12], 3)];
        let got = merged(&chunks, &[(5 * BS, 7 * BS)], &[ext(5, 1, 50)]);
        assert_eq!(got[0], chunks[0]);
        assert_eq!(got[2], chunks[2]);
        assert_eq!(got[1].page, None);
        assert_eq!(got[1].extents, [ext(4, 1, 1004), ext(5, 1, 50)]);

        let got = merged(&chunks, &[(7 * BS, 9 * BS)], &[ext(8, 1, 60)]);
        assert_eq!(
            (got[0].page, got[1].page, got[2].page),
            (Some(page(1)), None, Some(page(3)))
        );
        assert_eq!(
            got[1].extents,
            [ext(4, 1, 1004), ext(6, 1, 1006), ext(8, 1, 60)]
        );

        // Spans reaching two chunks that meet merge them into one.
        let got = merged(&chunks, &[(2 * BS, 5 * BS)], &[]);
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].page, got[1].page), (None, Some(page(3))));
        assert_eq!(got[0].extents, [ext(0, 1, 1000), ext(6, 1, 1006)]);

        // A span emptying a chunk drops it; one below the first key
        // belongs to the first chunk.
        let got = merged(&chunks, &[(4 * BS, 8 * BS)], &[]);
        assert_eq!(got, [chunks[0].clone(), chunks[2].clone()]);
    }

    /// Where a changed run meets a kept chunk is checked: an extent a
    /// delta adds may not overlap the next chunk's first extent, nor the
    /// previous chunk's last.
    #[test]
    fn a_merge_overlapping_a_kept_chunk_is_refused() {
        let chunks = [chunk(&[0, 2], 1), chunk(&[4, 6], 2), chunk(&[10, 12], 3)];
        let err = plan_merge(&chunks, &[(8 * BS, 9 * BS)], &[ext(8, 3, 70)]).unwrap_err();
        assert!(err.contains("overlaps"), "{err}");
        let err = plan_merge(&chunks, &[(4 * BS, 5 * BS)], &[ext(4, 1, 70)])
            .map(|_| ())
            .and_then(|()| plan_merge(&chunks, &[(13 * BS, 14 * BS)], &[ext(13, 1, 70)]).map(drop))
            .and_then(|()| {
                plan_merge(&chunks, &[(6 * BS, 8 * BS)], &[ext(6, 1, 1), ext(7, 4, 70)]).map(drop)
            })
            .unwrap_err();
        assert!(err.contains("overlaps"), "{err}");
        let err = plan_merge(&chunks, &[(8 * BS, 9 * BS)], &[ext(20, 1, 70)]).unwrap_err();
        assert!(err.contains("outside every key span"), "{err}");
    }

    /// A delta's removed files leave, the others stay with their pages.
    #[test]
    fn removed_files_leave_the_others_stay() {
        let mut maps = PagedMaps::default();
        for ino in 2..8 {
            maps.push_file(ino, vec![chunk(&[ino], ino)]).unwrap();
        }
        maps.remove_files(&[2, 5, 7, 9]);
        assert_eq!(files(maps), files(three_four_six()));
    }

    fn three_four_six() -> PagedMaps {
        let mut maps = PagedMaps::default();
        for ino in [3, 4, 6] {
            maps.push_file(ino, vec![chunk(&[ino], ino)]).unwrap();
        }
        maps
    }

    type FileRuns = Vec<(Ino, Vec<(Vec<Extent>, Option<PageRef>, bool)>)>;

    fn files(maps: PagedMaps) -> FileRuns {
        maps.into_files()
            .map(|(ino, chunks)| (ino, chunks.collect()))
            .collect()
    }

    /// A file listed by its pages is the same as its absent chunks in a
    /// vector, each index page's run (empty runs too) starting where the
    /// pages before it end; a delta reaching it reads and changes only the
    /// chunks its span reaches, the rest stay absent with their pages.
    #[test]
    fn a_listed_file_is_its_absent_chunks_until_a_delta_reaches_it() {
        let pages: Vec<PageRef> = (0..7)
            .map(|n| PageRef {
                count: 2,
                first_key: n * 4 * BS,
                ..page(n)
            })
            .collect();
        let list = codec::PageList::from_runs([
            codec::PageRun::from(&pages[..3]),
            codec::PageRun::from(&pages[3..]),
        ]);
        let run_pages = vec![2, 0, 4, 1];
        let mut listed = PagedMaps::default();
        listed.push_listed(5, list, run_pages).unwrap();
        let mut absent: Vec<PageChunk> = pages.iter().map(|&p| PageChunk::absent(p)).collect();
        for at in [0, 2, 6] {
            absent[at].starts_run = true;
        }
        let mut vector = PagedMaps::default();
        vector.push_file(5, absent.clone()).unwrap();
        assert_eq!(listed, vector);
        assert_eq!(files(listed.clone()), files(vector));
        assert_eq!(listed.has_extents(5), Some(true));
        assert_eq!(listed.has_extents(6), None);
        let new = ext(9, 1, 90);
        let inode = crate::types::InodeImage {
            ino: 5,
            kind: crate::types::FileKind::Regular,
            nlink: 1,
            size: 0,
            attrs: Default::default(),
            extents: vec![new],
            entries: Vec::new(),
            xattrs: Vec::new(),
            target: Vec::new(),
        };
        let mut image = MetaImage {
            next_ino: 6,
            inodes: vec![crate::types::InodeImage {
                extents: Vec::new(),
                ..inode.clone()
            }],
        };
        let err = listed.clone().fill_image(&mut image).unwrap_err();
        assert!(err.contains("not read"), "{err}");
        let delta = crate::types::MetaDelta {
            next_ino: 6,
            removed: Vec::new(),
            changed: vec![crate::types::InodeDelta {
                inode,
                spans: vec![(9 * BS, 10 * BS)],
            }],
        };
        let mut read = Vec::new();
        let loaded = listed
            .load_reached(&delta, |ino, page| {
                read.push((ino, page.first_key));
                let n = page.first_key / BS;
                Ok(vec![ext(n, 1, 100 + n), ext(n + 2, 1, 200 + n)])
            })
            .unwrap();
        assert_eq!((loaded, read), (1, vec![(5, 8 * BS)]));
        let merge = plan_merge(
            listed.chunks_to_change(5).unwrap(),
            &delta.changed[0].spans,
            &[new],
        )
        .unwrap();
        listed.apply(5, merge);
        let after = listed.chunks_to_change(5).unwrap();
        assert_eq!(after.len(), 7);
        for (j, (got, was)) in after.iter().zip(&absent).enumerate() {
            if j == 2 {
                assert_eq!(got.page, None);
                assert_eq!(got.extents, vec![ext(8, 1, 108), new, ext(10, 1, 208)]);
            } else {
                assert_eq!(got, was, "chunk {j}");
            }
        }
    }

    /// The absent chunks of `pages` as mount made them before files were
    /// listed: each index run's first chunk starts a segment (a run of no
    /// pages marks the next one's, a start past the last page none).
    fn absent_chunks(pages: &[PageRef], run_pages: &[u32]) -> Vec<PageChunk> {
        let mut chunks: Vec<PageChunk> = pages.iter().map(|&p| PageChunk::absent(p)).collect();
        let mut start = 0;
        for &n in run_pages {
            if let Some(chunk) = chunks.get_mut(start) {
                chunk.starts_run = true;
            }
            start += n as usize;
        }
        chunks
    }

    proptest! {
        /// A listed file is the same as its absent chunks in a vector,
        /// whatever runs its list is cut into and whatever index runs it
        /// has, the runs' pages summing to its pages or not.
        #[test]
        fn a_listed_file_matches_its_absent_chunks(
            n in 0usize..20,
            cuts in prop::collection::vec(0usize..20, 0..4),
            run_pages in prop::collection::vec(0u32..8, 0..6),
        ) {
            let pages: Vec<PageRef> = (0..n as u64)
                .map(|k| PageRef { first_key: k * 4 * BS, ..page(k) })
                .collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(n)).collect();
            cuts.sort_unstable();
            let mut runs = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([n]) {
                runs.push(codec::PageRun::from(&pages[from..cut]));
                from = cut;
            }
            let mut listed = PagedMaps::default();
            listed.push_listed(3, codec::PageList::from_runs(runs), run_pages.clone()).unwrap();
            let mut vector = PagedMaps::default();
            vector.push_file(3, absent_chunks(&pages, &run_pages)).unwrap();
            prop_assert_eq!(&listed, &vector);
            prop_assert_eq!(listed.has_extents(3), Some(n > 0));
            prop_assert_eq!(files(listed.clone()), files(vector.clone()));
            prop_assert_eq!(listed.chunks_to_change(3), vector.chunks_to_change(3));
        }
    }

    fn case() -> impl Strategy<Value = (Vec<PageChunk>, Vec<KeySpan>, Vec<Extent>)> {
        (
            prop::collection::btree_set(0u64..60, 0..24),
            prop::collection::vec(1usize..5, 24),
            prop::collection::btree_set(0u64..64, 0..8),
            prop::collection::vec((0u64..64, 1u64..3), 0..8),
        )
            .prop_map(|(keys, sizes, cuts, adds)| {
                let keys: Vec<u64> = keys.into_iter().map(|k| 2 * k).collect();
                let mut chunks = Vec::new();
                let mut rest = &keys[..];
                for (n, size) in sizes.into_iter().enumerate() {
                    if rest.is_empty() {
                        break;
                    }
                    let take = size.min(rest.len());
                    chunks.push(chunk(&rest[..take], n as u64));
                    rest = &rest[take..];
                }
                // Spans between consecutive cut points, every other pair;
                // an odd count leaves the last open to the end.
                let cuts: Vec<u64> = cuts.into_iter().map(|c| 2 * c * BS).collect();
                let spans: Vec<KeySpan> = cuts
                    .chunks(2)
                    .map(|p| (p[0], p.get(1).copied().unwrap_or(u64::MAX)))
                    .collect();
                let mut adds: Vec<(u64, u64)> = adds;
                adds.sort_unstable();
                adds.dedup_by_key(|a| a.0);
                // Each inside a span, as the delta decoder requires.
                let new = adds
                    .into_iter()
                    .map(|(k, len)| ext(2 * k + 1, len, 500 + k))
                    .filter(|n| spans.iter().any(|&(s, e)| (s..e).contains(&n.file_off)))
                    .collect();
                (chunks, spans, new)
            })
    }

    proptest! {
        /// Laid over chunks, a delta gives the map it gives laid over the
        /// whole map (and fails where that fails); every chunk owning no
        /// key in a span is kept as it was, page and all, and every chunk
        /// that changed names no page.
        #[test]
        fn chunk_merges_match_a_whole_map_merge((chunks, spans, new) in case()) {
            let whole = flat(&chunks);
            let want = SpanMerge::plan(&whole, &spans, &new).map(|m| {
                let mut w = whole.clone();
                m.apply(&mut w, &new);
                w
            });
            let got = plan_merge(&chunks, &spans, &new);
            prop_assert_eq!(got.is_ok(), want.is_ok(), "{:?} / {:?}", got.as_ref().err(), want.as_ref().err());
            let (Ok(merge), Ok(want)) = (got, want) else { return Ok(()) };
            prop_assert_eq!(merge.merged_len, want.len());
            let mut maps = PagedMaps::default();
            maps.push_file(3, chunks.clone()).unwrap();
            maps.apply(3, merge);
            let after = maps.chunks_to_change(3).unwrap();
            prop_assert_eq!(flat(after), want);
            prop_assert!(after.iter().all(|c| !c.extents.is_empty()));
            let reached = |j: usize| {
                let low = if j == 0 { 0 } else { chunks[j].first_key() };
                let high = chunks.get(j + 1).map_or(u64::MAX, PageChunk::first_key);
                spans.iter().any(|&(s, e)| s < high && low < e)
            };
            let kept: Vec<&PageChunk> = (0..chunks.len()).filter(|&j| !reached(j)).map(|j| &chunks[j]).collect();
            let paged: Vec<&PageChunk> = after.iter().filter(|c| c.page.is_some()).collect();
            prop_assert_eq!(paged, kept);
        }
    }
}
