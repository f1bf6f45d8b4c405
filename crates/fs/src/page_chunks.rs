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
/// (`None`: a delta changed them since the page was written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageChunk {
    pub extents: Vec<Extent>,
    pub page: Option<PageRef>,
}

impl PageChunk {
    fn first_key(&self) -> u64 {
        self.extents[0].file_off
    }
}

/// Per file a checkpoint's base keeps in pages, sorted by inode number:
/// its chunks in key order, sorted and disjoint across chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedMaps {
    files: Vec<(Ino, Vec<PageChunk>)>,
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

impl PagedMaps {
    /// Adds `ino`'s chunks; `ino` must be above every file added so far
    /// (a page table is sorted).
    pub fn push_file(&mut self, ino: Ino, chunks: Vec<PageChunk>) -> Result<(), String> {
        if self.files.last().is_some_and(|&(last, _)| last >= ino) {
            return Err(format!("inode {ino}'s pages are out of order"));
        }
        self.files.push((ino, chunks));
        Ok(())
    }

    fn position(&self, ino: Ino) -> Option<usize> {
        self.files.binary_search_by_key(&ino, |&(i, _)| i).ok()
    }

    /// `ino`'s chunks, if its extents are kept here.
    pub fn get(&self, ino: Ino) -> Option<&[PageChunk]> {
        self.position(ino).map(|i| &self.files[i].1[..])
    }

    /// Forgets `ino` (a delta removed it).
    pub fn remove(&mut self, ino: Ino) {
        if let Some(i) = self.position(ino) {
            self.files.remove(i);
        }
    }

    /// Applies `merge`, planned by [`plan_merge`] against `ino`'s chunks as
    /// they are.
    pub fn apply(&mut self, ino: Ino, merge: ChunkMerge) {
        let Some(i) = self.position(ino) else {
            debug_assert!(false, "a merge for inode {ino}, which has no chunks");
            return;
        };
        let chunks = &mut self.files[i].1;
        // Back to front: each run's indices stay valid.
        for (run, extents) in merge.runs.into_iter().rev() {
            let chunk = (!extents.is_empty()).then_some(PageChunk {
                extents,
                page: None,
            });
            chunks.splice(run, chunk);
        }
    }

    /// The files and their chunks, by inode number.
    pub fn into_files(self) -> impl Iterator<Item = (Ino, Vec<PageChunk>)> {
        self.files.into_iter()
    }

    /// Puts each file's extents into its inode of `image` (where it has
    /// none): the whole image, for callers that want one.
    pub fn fill_image(self, image: &mut MetaImage) -> Result<(), String> {
        for (ino, chunks) in self.files {
            let Ok(i) = image.inodes.binary_search_by_key(&ino, |i| i.ino) else {
                return Err(format!("inode {ino} has pages and is not in the image"));
            };
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
/// where a changed run meets the kept chunks around it.
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
    let mut runs: Vec<Range<usize>> = Vec::new();
    for &(start, end) in spans.iter().filter(|(s, e)| s < e) {
        // Clamped: a file whose chunks a delta emptied has none, and the
        // run of its (absent) chunk 0 is the empty range 0..0.
        let reached = owner(start)..(owner(end - 1) + 1).min(chunks.len());
        match runs.last_mut() {
            // Runs that meet are one: each run is merged apart from the
            // others, so a kept chunk must lie between any two.
            Some(last) if reached.start <= last.end => last.end = last.end.max(reached.end),
            _ => runs.push(reached),
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
    let mut merged_len: usize = chunks.iter().map(|c| c.extents.len()).sum();
    let mut planned = Vec::with_capacity(runs.len());
    let mut added = 0;
    let mut clipped = Vec::new();
    for run in runs {
        let (low, high) = owned(&run);
        let new_start = first_key_at_or_after(new, added, low);
        if new_start > added {
            return Err(outside_every_span(&new[added]));
        }
        let new_end = first_key_at_or_after(new, added, high);
        clipped.clear();
        clipped.extend(
            spans
                .iter()
                .filter(|&&(s, e)| s < high && low < e)
                .map(|&(s, e)| (s.max(low), e.min(high))),
        );
        let kept = &chunks[run.clone()];
        let mut extents: Vec<Extent> =
            Vec::with_capacity(kept.iter().map(|c| c.extents.len()).sum());
        for c in kept {
            extents.extend_from_slice(&c.extents);
        }
        let old_len = extents.len();
        let merge = SpanMerge::plan(&extents, &clipped, &new[new_start..new_end])?;
        let merged = merge.merged_len;
        merge.apply(&mut extents, &new[new_start..new_end]);
        if let (Some(first), Some(before)) = (
            extents.first(),
            run.start
                .checked_sub(1)
                .and_then(|b| chunks[b].extents.last()),
        ) {
            codec::check_extent(first, Some(before))?;
        }
        if let (Some(last), Some(after)) = (extents.last(), chunks.get(run.end)) {
            codec::check_extent(&after.extents[0], Some(last))?;
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
