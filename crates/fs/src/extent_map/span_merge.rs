//! Replacing the extents a delta's key spans cover: how a delta checkpoint
//! changes one map (a whole file's extents, or a run of its chunks) at
//! mount.

use crate::codec;
use crate::extent_map::search::first_key_at_or_after;
use crate::types::{Extent, KeySpan};

/// How one map changes under a delta: `old` without the extents stored
/// under keys in `spans`, with `new` (each stored under a key in `spans`)
/// in their place, sorted by key. Planned (and checked) without changing
/// anything, then applied in place.
///
/// The result is runs in order: kept\[0\], new\[0\], kept\[1\], new\[1\],
/// ..., kept\[n\], where kept\[j\] is the old extents between span j-1
/// and span j and new\[j\] the delta's extents in span j.
pub struct SpanMerge {
    /// Per span: where its old extents start and end in `old`, and where
    /// its new ones end in `new` (each starts where the previous ended).
    spans: Vec<SpanRuns>,
    /// Extents in the merged map.
    pub merged_len: usize,
}

#[derive(Clone, Copy)]
struct SpanRuns {
    old_start: usize,
    old_end: usize,
    new_end: usize,
}

impl SpanMerge {
    /// Both inputs are sorted and non-overlapping already (the image and
    /// the delta decoders check that), so only where runs of one meet runs
    /// of the other is checked.
    pub fn plan(
        old: &[Extent],
        spans: &[KeySpan],
        new: &[Extent],
    ) -> std::result::Result<SpanMerge, String> {
        // The extent before each run in the result: the last of the
        // nearest non-empty run before it.
        let mut last: Option<&Extent> = None;
        let mut runs = Vec::with_capacity(spans.len());
        let (mut kept, mut added) = (0, 0);
        let mut merged_len = 0;
        for &(start, end) in spans {
            // Galloping from the previous span: a bisection of the rest of a
            // large map per span was most of a delta's cost at mount.
            let old_start = first_key_at_or_after(old, kept, start);
            let old_end = first_key_at_or_after(old, old_start, end);
            let new_end = first_key_at_or_after(new, added, end);
            for run in [&old[kept..old_start], &new[added..new_end]] {
                if let Some(first) = run.first() {
                    codec::check_extent(first, last)?;
                    last = run.last();
                }
                merged_len += run.len();
            }
            runs.push(SpanRuns {
                old_start,
                old_end,
                new_end,
            });
            (kept, added) = (old_end, new_end);
        }
        if let Some(first) = old.get(kept) {
            codec::check_extent(first, last)?;
        }
        merged_len += old.len() - kept;
        if added < new.len() {
            return Err(format!(
                "extent at file offset {} is outside every key span",
                new[added].file_off
            ));
        }
        Ok(SpanMerge {
            spans: runs,
            merged_len,
        })
    }

    /// Turns `extents` (the `old` of [`SpanMerge::plan`]) into the merged
    /// map in place. Each kept run moves by the net count of extents the
    /// spans before it add: runs moving left are moved first, front to
    /// back, then runs moving right, back to front, so that no run lands
    /// on one not yet moved; the new runs go into the gaps last.
    pub fn apply(self, extents: &mut Vec<Extent>, new: &[Extent]) {
        let old_len = extents.len();
        // Per kept run: where it starts in `old`, its length, where it goes.
        let mut kept = Vec::with_capacity(self.spans.len() + 1);
        let (mut from, mut to, mut added) = (0, 0, 0);
        for s in &self.spans {
            kept.push((from, s.old_start - from, to));
            to += s.old_start - from + (s.new_end - added);
            (from, added) = (s.old_end, s.new_end);
        }
        kept.push((from, old_len - from, to));
        if self.merged_len > old_len {
            // Placeholders, all overwritten below: growing means the delta
            // has extents.
            extents.resize(self.merged_len, new[0]);
        }
        for &(from, len, to) in kept.iter().filter(|&&(from, _, to)| to < from) {
            extents.copy_within(from..from + len, to);
        }
        for &(from, len, to) in kept.iter().rev().filter(|&&(from, _, to)| to > from) {
            extents.copy_within(from..from + len, to);
        }
        extents.truncate(self.merged_len);
        let mut added = 0;
        for (s, &(_, len, to)) in self.spans.iter().zip(&kept) {
            let at = to + len;
            extents[at..at + s.new_end - added].copy_from_slice(&new[added..s.new_end]);
            added = s.new_end;
        }
    }
}
