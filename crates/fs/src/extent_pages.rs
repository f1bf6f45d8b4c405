//! What a base checkpoint with extent pages writes for a snapshot of the
//! metadata: a page for every extent chunk that names none (changed since
//! its page was written, or never written), references to the pages the
//! other chunks name, and, once the base is durable, the new pages
//! recorded in the snapshot's chunks (which the live maps share while
//! unchanged). See `docs/EXTENT_PAGES.md`.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::codec::{self, IndexRef, IndexTable, PageCursor, PageList, PageRef, PageRun, PageTable};
use crate::error::{Error, Result};
use crate::extent_map::{ChunkPage, PageLoader, PageSource};
use crate::state::MetaState;
use crate::types::{FileKind, Ino};

/// The pages a base writes, and the page table its root lists.
#[derive(Debug)]
pub struct PagePlan {
    /// Every regular file with extents, sorted by inode number, with its
    /// pages in key order: the ones its chunks name and the new ones.
    pub table: PageTable,
    /// With index pages (`Some` given to [`plan_pages`]): per file of
    /// `table`, the index pages listing its pages, in key order (those a
    /// slot's base lists with the same pages, and new ones).
    pub index: IndexTable,
    /// The new pages, handed to the plan's writer: `(device byte,
    /// length)`.
    pub written: Vec<(u64, u64)>,
    /// The new pages to record in their chunks: `(file index in table,
    /// chunk index, page index in the file's list)`, in order. A chunk
    /// written as several one-block pages records none.
    new: Vec<(usize, usize, usize)>,
}

/// Plans the pages of `state`'s extent maps: a page for each chunk of a
/// file with more than [`codec::inline_extents_max`] extents (the others
/// stay inline in the root; their absent chunks are read here, outside
/// the metadata lock, and a file with one that cannot be read stays
/// paged: `stays_paged`) that names no page `listed` holds, placed at
/// the device byte `place` returns for its length (the caller allocates
/// from free space; a failure ends the plan), and encoded with the
/// volume's crc `seed`. `place` also gets the bytes still to place of
/// the same kind ([`Placed`]: pages and first copies of index pages, or
/// second copies), this one included: the most it may take ahead (a
/// caller that takes more holds room the base reserve does not cover;
/// the two kinds' together are all the plan still places).
///
/// `listed` holds the pages either slot's base lists: only those are
/// still on disk. A chunk can name a page neither lists when its file was
/// inline at a base since (its pages were freed) and a chunk that change
/// did not touch is paged again; such a chunk gets a new page that is not
/// recorded in it (it already names one), so it is written again at each
/// base until it changes. With chunks of at least 128 extents unless
/// alone, a file at the inline bound has one chunk, which every change
/// that makes it grow touches, so this does not happen outside tests.
///
/// With `index` (volumes with index pages), the pages of each segment of
/// a file's map are listed in index pages of their own (as many as their
/// count needs, split evenly): one a slot's base lists with exactly those
/// pages is listed again, others are written (a block each, placed and
/// handed to `write` as pages are; each twice, the second copy placed
/// apart, [`Placed::IndexCopy`]).
pub fn plan_pages(
    state: &MetaState,
    seed: u32,
    listed: &ListedPages<'_>,
    index: Option<&ListedIndex<'_>>,
    mut place: impl FnMut(u64, u64, Placed) -> Result<u64>,
    mut write: impl FnMut(&[(u64, Vec<u8>)]) -> Result<()>,
) -> Result<PagePlan> {
    let block_size = u64::from(state.block_size);
    let inline_max = codec::inline_extents_max(block_size);
    let mut inos: Vec<Ino> = state
        .inodes
        .iter()
        .filter(|(_, i)| i.kind == FileKind::Regular && stays_paged(&i.extents, inline_max))
        .map(|(&ino, _)| ino)
        .collect();
    inos.sort_unstable();
    let mut plan = PagePlan {
        table: Vec::with_capacity(inos.len()),
        index: Vec::new(),
        written: Vec::new(),
        new: Vec::new(),
    };
    // Encoded pages go to `write` a batch at a time: a base of every page
    // at once would hold the whole extent list encoded again (~250 MB at
    // 10M extents).
    let mut batch = PageBatch::default();
    // A file's new index pages are known, and added, once its pages are:
    // `ahead` never counts more than the plan places.
    let mut ahead = unlisted_page_bytes(state, &inos, listed);
    let max = run_max_pages(block_size);
    for ino in inos {
        // The file's pages since its last index pages were cut (with
        // index pages; all of them without): at 50M extents in one file,
        // a list of every page was 8 MB more at each base.
        let mut list = Vec::new();
        // Pages of the file before `list`.
        let mut cut = 0;
        let mut runs = FileRuns::new(index.map(|i| i.of_file(ino)));
        let mut file_listed = listed.of_file(ino);
        for (index, chunk) in state.inodes[&ino].extents.chunk_pages().enumerate() {
            if chunk.starts_segment() && runs.indexed() && closes_group(list.len(), max) {
                cut += list.len();
                runs.cut(&list, max);
                list.clear();
            }
            match kept_page(&chunk, &mut file_listed) {
                Some(page) => list.push(page),
                None => {
                    let named = chunk.page();
                    let extents = chunk.extents();
                    let len = codec::page_len(extents.len(), block_size);
                    let placed = place(len, ahead, Placed::Page);
                    ahead = ahead.saturating_sub(len);
                    match placed {
                        Ok(addr) => {
                            let (bytes, page) =
                                codec::encode_page(seed, ino, extents, block_size, addr)?;
                            plan.written.push((addr, bytes.len() as u64));
                            batch.push(addr, bytes, &mut write)?;
                            if named.is_none() {
                                plan.new.push((plan.table.len(), index, cut + list.len()));
                            }
                            list.push(page);
                        }
                        // Free space in pieces smaller than the page: one
                        // page per block, which any free block takes (the
                        // room data writes leave counts them so). The
                        // chunk names none of them and is written again
                        // at the next base.
                        Err(Error::NoSpace { .. }) if len > block_size => {
                            for piece in extents.chunks(inline_max) {
                                let addr = place(block_size, block_size, Placed::Page)?;
                                let (bytes, page) =
                                    codec::encode_page(seed, ino, piece, block_size, addr)?;
                                plan.written.push((addr, bytes.len() as u64));
                                batch.push(addr, bytes, &mut write)?;
                                list.push(page);
                            }
                        }
                        Err(err) => return Err(err),
                    }
                }
            }
        }
        if !runs.indexed() {
            plan.table.push((ino, PageList::from(list)));
            continue;
        }
        runs.cut(&list, max);
        drop(list);
        let (refs, shared) = runs.write(
            &mut ahead,
            &mut RunWriter {
                ino,
                seed,
                block_size,
                place: &mut place,
                written: &mut plan.written,
                batch: &mut batch,
                write: &mut write,
            },
        )?;
        plan.index.push((ino, refs));
        plan.table.push((ino, PageList::from_runs(shared)));
    }
    batch.write_out(&mut write)?;
    Ok(plan)
}

/// An index page a slot's base lists, and that slot's run of its page
/// references (to share, not copy).
type ListedRun<'a> = (IndexRef, &'a PageRun);

/// Where [`plan_pages`] places and writes one file's new index pages.
struct RunWriter<'w, P, W> {
    ino: Ino,
    seed: u32,
    block_size: u64,
    place: &'w mut P,
    written: &'w mut Vec<(u64, u64)>,
    batch: &'w mut PageBatch,
    write: &'w mut W,
}

/// One file's index pages as [`plan_pages`] cuts them (with index pages):
/// per run its references (the slot's run when a slot's base lists an
/// index page of exactly those pages, to share; else a new one) and that
/// index page, if listed.
struct FileRuns<'a> {
    listed: Option<FileIndex<'a>>,
    runs: Vec<(PageRun, Option<IndexRef>)>,
}

impl<'a> FileRuns<'a> {
    /// `listed`: the index pages both slots list for the file, `None`
    /// without index pages.
    fn new(listed: Option<FileIndex<'a>>) -> Self {
        FileRuns {
            listed,
            runs: Vec::new(),
        }
    }

    fn indexed(&self) -> bool {
        self.listed.is_some()
    }

    /// Cuts `group` (pages that close a group of `index_runs`, or the
    /// file's last) into runs of at most `max`.
    fn cut(&mut self, group: &[PageRef], max: usize) {
        let Some(listed) = &mut self.listed else {
            return;
        };
        for run in even_runs(group, max) {
            self.runs.push(match listed.find(run) {
                Some((kept, listed)) => (listed.clone(), Some(kept)),
                None => (PageRun::from(run), None),
            });
        }
    }

    /// Writes the runs no slot lists to new index pages, once the file's
    /// pages are placed (so its first copies follow them, and its second
    /// copies come from one run apart): each placed and handed to the
    /// writer as pages are, twice. Returns the file's index pages and
    /// runs.
    fn write<P, W>(
        self,
        ahead: &mut u64,
        to: &mut RunWriter<'_, P, W>,
    ) -> Result<(Vec<IndexRef>, Vec<PageRun>)>
    where
        P: FnMut(u64, u64, Placed) -> Result<u64>,
        W: FnMut(&[(u64, Vec<u8>)]) -> Result<()>,
    {
        let bs = to.block_size;
        let new_runs = self.runs.iter().filter(|(_, kept)| kept.is_none()).count() as u64;
        // Each new index page's first copy is placed beside the pages,
        // its second apart (and counted apart).
        *ahead += new_runs * bs;
        let mut copies_ahead = new_runs * bs;
        let mut refs = Vec::with_capacity(self.runs.len());
        let mut runs = Vec::with_capacity(self.runs.len());
        for (run, kept) in self.runs {
            let iref = match kept {
                Some(kept) => kept,
                None => {
                    let first = (to.place)(bs, *ahead, Placed::Page);
                    *ahead = ahead.saturating_sub(bs);
                    let first = first?;
                    let copy = (to.place)(bs, copies_ahead, Placed::IndexCopy { of: first });
                    copies_ahead = copies_ahead.saturating_sub(bs);
                    let copy = copy?;
                    let (bytes, iref) =
                        codec::encode_index_page(to.seed, to.ino, &run, bs, [first, copy])?;
                    for addr in [first, copy] {
                        to.written.push((addr, bytes.len() as u64));
                    }
                    to.batch.push(first, bytes.clone(), &mut *to.write)?;
                    to.batch.push(copy, bytes, &mut *to.write)?;
                    iref
                }
            };
            refs.push(iref);
            runs.push(run);
        }
        Ok((refs, runs))
    }
}

/// What [`plan_pages`] places bytes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// An extent page, or an index page's first copy: beside the others.
    Page,
    /// The second copy of the index page whose first is at device byte
    /// `of`: somewhere one failure of the device there would not also
    /// reach (not the same sector or flash page, not the same write).
    IndexCopy { of: u64 },
}

/// The runs of `pages` that index pages list, cut where segments start
/// (`segments`: where each segment's pages start in `pages`). A segment
/// of at least half of `max` pages, with the pages of the small segments
/// just before it, is split evenly into as few runs of at most `max` as
/// hold them; a smaller one joins the next. So every run but a file's
/// last holds at least half of `max` (a file's index pages are at most
/// [`index_pages_at_most`]), and a segment's runs depend on its pages and
/// those of the small segments just before it only: a base rewrites the
/// index pages of the segments a change reached, up to the next segment
/// of at least half of `max` pages.
///
/// [`plan_pages`] cuts as it goes ([`closes_group`] at each segment's
/// start, [`even_runs`]), holding only the pages since the last cut; this
/// is the same rule over a whole file, which its test checks.
#[cfg(test)]
fn index_runs<'p>(pages: &'p [PageRef], segments: &[usize], max: usize) -> Vec<&'p [PageRef]> {
    let mut runs = Vec::new();
    let mut from = 0;
    let ends = segments.iter().skip(1).copied().chain([pages.len()]);
    for end in ends {
        if end == from || (!closes_group(end - from, max) && end < pages.len()) {
            continue;
        }
        runs.extend(even_runs(&pages[from..end], max));
        from = end;
    }
    runs
}

/// Whether `pending` pages since the last cut, at a segment's end, are
/// cut into runs (`index_runs`): at least half of `max`.
fn closes_group(pending: usize, max: usize) -> bool {
    2 * pending >= max.max(1)
}

/// `group` split evenly into as few runs of at most `max` pages as hold
/// them (`index_runs`).
fn even_runs(group: &[PageRef], max: usize) -> impl Iterator<Item = &[PageRef]> {
    let n = group.len();
    let parts = n.div_ceil(max.max(1));
    (0..parts).map(move |k| &group[k * n / parts..(k + 1) * n / parts])
}

/// Most index pages `files` files of `pages` pages in all take
/// (`index_runs`: a file's last run may be short, the others hold at
/// least half of [`run_max_pages`]).
pub fn index_pages_at_most(pages: u64, files: u64, block_size: u64) -> u64 {
    (2 * pages).div_ceil(run_max_pages(block_size) as u64) + files
}

/// Most pages in a run: what an index page holds, and no more than a
/// segment's chunks. So mount, which starts a segment at each index
/// page's first page (`PageChunk::starts_run`), builds one segment per
/// run, of at least half this unless it is a file's last: the runs of
/// those segments, while nothing in them changes, are the runs read.
fn run_max_pages(block_size: u64) -> usize {
    codec::index_max_pages(block_size).min(crate::extent_map::SEGMENT_MAX)
}

/// The page a base refers to for `chunk` instead of writing it: the one
/// it names, if a slot's base lists it (only those are still on disk).
fn kept_page(chunk: &ChunkPage<'_>, file_listed: &mut FileListed<'_>) -> Option<PageRef> {
    chunk.page().filter(|page| file_listed.contains(page))
}

/// Bytes of the pages [`plan_pages`] writes for `inos`: one per chunk
/// whose page `listed` does not hold (asked in the same order).
fn unlisted_page_bytes(state: &MetaState, inos: &[Ino], listed: &ListedPages<'_>) -> u64 {
    let block_size = u64::from(state.block_size);
    let mut bytes = 0;
    for &ino in inos {
        let mut file_listed = listed.of_file(ino);
        for chunk in state.inodes[&ino].extents.chunk_pages() {
            if kept_page(&chunk, &mut file_listed).is_none() {
                bytes += codec::page_len(chunk.extents().len(), block_size);
            }
        }
    }
    bytes
}

/// Whether a base pages `map`: past the inline bound; or below it (a
/// change shrank a paged file) with a chunk that cannot be read now, a
/// damaged page or a device error: the root could not hold its extents
/// inline, and its page, listed again, keeps them (a reader accepts a
/// paged file of any size). Such a file's changed chunks get pages the
/// room for the next base did not count (it counts pages past the bound
/// only): a page of at most the inline bound each, for damage only.
fn stays_paged(map: &crate::extent_map::ExtentMap, inline_max: usize) -> bool {
    map.len() > inline_max || (map.loaded_chunks() < map.chunk_count() && map.load_all().is_err())
}

/// Bytes of encoded pages [`plan_pages`] holds before handing them over.
const PAGE_BATCH_BYTES: usize = 4 << 20;

#[derive(Default)]
struct PageBatch {
    pages: Vec<(u64, Vec<u8>)>,
    bytes: usize,
}

impl PageBatch {
    fn push(
        &mut self,
        addr: u64,
        bytes: Vec<u8>,
        write: &mut impl FnMut(&[(u64, Vec<u8>)]) -> Result<()>,
    ) -> Result<()> {
        self.bytes += bytes.len();
        self.pages.push((addr, bytes));
        if self.bytes >= PAGE_BATCH_BYTES {
            self.write_out(write)?;
        }
        Ok(())
    }

    fn write_out(&mut self, write: &mut impl FnMut(&[(u64, Vec<u8>)]) -> Result<()>) -> Result<()> {
        if !self.pages.is_empty() {
            write(&self.pages)?;
            self.pages.clear();
            self.bytes = 0;
        }
        Ok(())
    }
}

/// The pages `tables` (both slots' bases) list: what [`plan_pages`] may
/// refer to without writing it again, and what [`after_base`] weighs.
///
/// Looked up per file, in key order, instead of through a set of every
/// page: a base at 10M extents lists 40k pages per slot, and hashing them
/// all again at each base cost a third of its CPU time. A table lists
/// files by inode number and each file's pages in key order (first keys
/// strictly rising), and a file's chunks are asked about in key order
/// too, so each lookup moves a cursor forward.
pub struct ListedPages<'a> {
    tables: Vec<&'a PageTable>,
}

impl<'a> ListedPages<'a> {
    pub fn of(tables: impl IntoIterator<Item = &'a PageTable>) -> ListedPages<'a> {
        let tables: Vec<&PageTable> = tables.into_iter().collect();
        // `after_base` frees what a lookup misses: the order it relies on
        // is what a root's decoder and encoder check.
        debug_assert!(tables.iter().all(|t| {
            t.windows(2).all(|w| w[0].0 < w[1].0)
                && t.iter().all(|(_, l)| {
                    l.iter()
                        .zip(l.iter().skip(1))
                        .all(|(a, b)| a.first_key < b.first_key)
                })
        }));
        ListedPages { tables }
    }

    /// Nothing listed: every chunk is written.
    pub fn none() -> ListedPages<'a> {
        ListedPages { tables: Vec::new() }
    }

    /// The lists of `ino`'s pages, to be asked in key order.
    pub fn of_file(&self, ino: Ino) -> FileListed<'a> {
        FileListed {
            lists: self
                .tables
                .iter()
                .filter_map(|table| {
                    let at = table.binary_search_by_key(&ino, |&(i, _)| i).ok()?;
                    Some(table[at].1.cursor())
                })
                .collect(),
        }
    }
}

/// The index pages both slots' bases list, each slot's with the page
/// table they list: what [`plan_pages`] may list again without writing
/// it. Looked up per file in key order, as [`ListedPages`].
pub struct ListedIndex<'a> {
    slots: Vec<(&'a PageTable, &'a IndexTable)>,
    /// Index pages (by address) never listed again: one of their copies
    /// failed.
    rewrite: Option<&'a BTreeSet<u64>>,
}

impl<'a> ListedIndex<'a> {
    /// `slots`: per slot, its page table and the index pages listing it
    /// (each file's pages, in order, are its index pages' pages, in
    /// order: what a root's reader builds and a plan writes).
    pub fn of(slots: impl IntoIterator<Item = (&'a PageTable, &'a IndexTable)>) -> ListedIndex<'a> {
        let slots: Vec<_> = slots.into_iter().collect();
        debug_assert!(slots.iter().all(|(pages, index)| {
            index.iter().all(|(ino, refs)| {
                let listed: usize = refs.iter().map(|r| r.pages as usize).sum();
                pages
                    .binary_search_by_key(ino, |&(i, _)| i)
                    .is_ok_and(|at| pages[at].1.len() == listed)
            })
        }));
        ListedIndex {
            slots,
            rewrite: None,
        }
    }

    /// The same, but for the index pages at the addresses `rewrite` holds,
    /// which a plan writes again whatever they list.
    pub fn rewriting(self, rewrite: &'a BTreeSet<u64>) -> ListedIndex<'a> {
        ListedIndex {
            rewrite: Some(rewrite),
            ..self
        }
    }

    /// Nothing listed: every index page is written.
    pub fn none() -> ListedIndex<'a> {
        ListedIndex {
            slots: Vec::new(),
            rewrite: None,
        }
    }

    fn of_file(&self, ino: Ino) -> FileIndex<'a> {
        FileIndex {
            rewrite: self.rewrite,
            lists: self
                .slots
                .iter()
                .filter_map(|(pages, index)| {
                    let at = index.binary_search_by_key(&ino, |&(i, _)| i).ok()?;
                    let p = pages.binary_search_by_key(&ino, |&(i, _)| i).ok()?;
                    Some(IndexCursor {
                        pages: pages[p].1.cursor(),
                        index: &index[at].1,
                        at: 0,
                    })
                })
                .collect(),
        }
    }
}

/// One file's index pages in [`ListedIndex`], per slot, with a cursor.
struct FileIndex<'a> {
    lists: Vec<IndexCursor<'a>>,
    rewrite: Option<&'a BTreeSet<u64>>,
}

struct IndexCursor<'a> {
    /// At the first page of index page `at`.
    pages: PageCursor<'a>,
    index: &'a [IndexRef],
    /// The next index page.
    at: usize,
}

impl<'a> FileIndex<'a> {
    /// A listed index page that lists exactly `run`, with the slot's run
    /// of the same references (its table's allocation, to share). Asked
    /// in rising key order; out of order it may miss one (which is then
    /// written again: a cost, never a loss).
    fn find(&mut self, run: &[PageRef]) -> Option<ListedRun<'a>> {
        let first = run.first()?.first_key;
        for list in &mut self.lists {
            while let Some(r) = list.index.get(list.at).filter(|r| r.first_key < first) {
                list.pages.skip(r.pages as usize);
                list.at += 1;
            }
            let Some(r) = list.index.get(list.at) else {
                continue;
            };
            // A table read from index pages, or planned, has one run per
            // index page.
            let listed = list.pages.run_here().filter(|l| l[..] == *run);
            let same = r.first_key == first
                && r.pages as usize == run.len()
                && listed.is_some()
                && !self
                    .rewrite
                    .is_some_and(|rewrite| rewrite.contains(&r.addr));
            if let (true, Some(listed)) = (same, listed) {
                return Some((*r, listed));
            }
        }
        None
    }
}

/// The device ranges `(addr, len)` of the index pages `index` lists (a
/// block for each copy).
pub fn index_page_ranges(index: &IndexTable, block_size: u64) -> BTreeSet<(u64, u64)> {
    index_page_ranges_listed(index, block_size).collect()
}

/// [`index_page_ranges`] as listed, repeats and all.
pub(crate) fn index_page_ranges_listed(
    index: &IndexTable,
    block_size: u64,
) -> impl Iterator<Item = (u64, u64)> + '_ {
    index
        .iter()
        .flat_map(|(_, refs)| refs.iter())
        .flat_map(IndexRef::blocks)
        .map(move |addr| (addr, block_size))
}

/// The addresses (first copies) of the index pages `tables` list: how an
/// index page is known, as [`ListedIndex::rewriting`] takes them.
pub(crate) fn listed_index_addrs(tables: &[Arc<IndexTable>]) -> BTreeSet<u64> {
    tables
        .iter()
        .flat_map(|table| table.iter().flat_map(|(_, refs)| refs.iter()))
        .map(|r| r.addr)
        .collect()
}

/// One file's page lists in [`ListedPages`], each with a cursor.
pub struct FileListed<'a> {
    lists: Vec<PageCursor<'a>>,
}

impl FileListed<'_> {
    /// Whether a list holds `page`. Asked in rising `first_key` order, as
    /// the file's chunks come; asked out of order, it may answer no for a
    /// listed page (which is then written again: a cost, never a loss),
    /// never yes for one not listed.
    pub fn contains(&mut self, page: &PageRef) -> bool {
        let mut found = false;
        for list in &mut self.lists {
            list.seek(page.first_key);
            found |= list.peek() == Some(page);
        }
        found
    }
}

impl PagePlan {
    /// Records the new pages in the chunks of `state` (the state the plan
    /// was made from) once the base listing them is durable: until they
    /// change, those chunks are not written again.
    ///
    /// With `loader` (the volume's), the chunks also learn where to read
    /// their page again: they are then clean and may be evicted.
    pub fn record_written(
        &self,
        state: &MetaState,
        loader: Option<&Arc<dyn PageLoader>>,
    ) -> Result<()> {
        let mut new = self.new.iter().peekable();
        while let Some(&&(file, _, _)) = new.peek() {
            let (ino, list) = &self.table[file];
            // The file's new pages come in list order.
            let (mut pages, mut at) = (list.cursor(), 0);
            let inode = state.inodes.get(ino).ok_or_else(|| {
                Error::invalid("recording extent pages", format!("inode {ino} is gone"))
            })?;
            let source = loader.map(|loader| {
                Arc::new(PageSource {
                    ino: *ino,
                    loader: loader.clone(),
                })
            });
            // In chunk order: found by segment counts, not by a walk
            // over every chunk.
            let (mut chunks, mut indexes) = (Vec::new(), Vec::new());
            while let Some(&(_, chunk, index)) = new.next_if(|&&(f, _, _)| f == file) {
                chunks.push(chunk);
                indexes.push(index);
            }
            let mut recorded = 0;
            for ((i, chunk), &index) in inode.extents.chunk_pages_at(&chunks).zip(&indexes) {
                pages.skip(index - at);
                at = index;
                let page = *pages.peek().ok_or_else(|| {
                    Error::invalid(
                        "recording extent pages",
                        format!("inode {ino}'s page {index} is not in its plan"),
                    )
                })?;
                chunk
                    .record_written(page, source.as_ref())
                    .map_err(|other| {
                        Error::invalid(
                            "recording extent pages",
                            format!("inode {ino}'s chunk {i} already names page {other:?}"),
                        )
                    })?;
                recorded += 1;
            }
            if recorded < chunks.len() {
                return Err(Error::invalid(
                    "recording extent pages",
                    format!("inode {ino} has fewer chunks than its plan"),
                ));
            }
        }
        Ok(())
    }

    /// Device bytes of the new pages.
    pub fn written_bytes(&self) -> u64 {
        self.written.iter().map(|&(_, len)| len).sum()
    }
}

/// The device ranges `(addr, len)` of the pages `table` lists, without
/// repeats.
pub fn page_ranges(table: &PageTable, block_size: u64) -> BTreeSet<(u64, u64)> {
    page_ranges_listed(table, block_size).collect()
}

/// [`page_ranges`] as listed, repeats and all.
pub(crate) fn page_ranges_listed(
    table: &PageTable,
    block_size: u64,
) -> impl Iterator<Item = (u64, u64)> + '_ {
    table
        .iter()
        .flat_map(|(_, list)| list.iter())
        .map(move |p| (p.addr, codec::page_len(p.count as usize, block_size)))
}

/// Bytes of the pages and index pages both slots list (`pages` and
/// `index`, per slot: the two bases share every page neither rewrote).
pub fn shared_page_bytes(
    [a, b]: [&PageTable; 2],
    [index_a, index_b]: [&IndexTable; 2],
    block_size: u64,
) -> u64 {
    shared_extent_page_bytes(a, b, block_size)
        + shared_index_page_bytes(
            &index_page_ranges(index_a, block_size),
            &index_page_ranges(index_b, block_size),
            block_size,
        )
}

fn shared_index_page_bytes(
    a: &BTreeSet<(u64, u64)>,
    b: &BTreeSet<(u64, u64)>,
    block_size: u64,
) -> u64 {
    a.intersection(b).count() as u64 * block_size
}

fn shared_extent_page_bytes(a: &PageTable, b: &PageTable, block_size: u64) -> u64 {
    let in_b = ListedPages::of([b]);
    let mut shared = 0;
    for (ino, list) in a {
        let mut listed = in_b.of_file(*ino);
        for page in list {
            if listed.contains(page) {
                shared += codec::page_len(page.count as usize, block_size);
            }
        }
    }
    shared
}

/// What a base listing `new`, durable in the slot where a base listing
/// `replaced` was while the other slot's base lists `other`, leaves to
/// account: the pages to free (those `replaced` lists that neither
/// lists: pages are in use while either slot's base lists them, and the
/// two share every page neither rewrote), and the bytes of the pages
/// both slots now list ([`shared_page_bytes`]).
///
/// A page is known by its reference: the three tables are in use at once
/// (until this returns), so no device byte holds two of their pages.
pub struct AfterBase {
    pub freed: Vec<(u64, u64)>,
    pub shared_bytes: u64,
}

/// Page references both slots' tables hold in memory: each run once, as
/// the tables share the runs of the index pages both list (a page both
/// list in runs of their own counts twice).
pub(crate) fn listed_pages(tables: &[Arc<PageTable>]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    tables
        .iter()
        .flat_map(|t| t.iter())
        .flat_map(|(_, pages)| pages.runs())
        .filter(|run| seen.insert(Arc::as_ptr(run) as *const PageRef))
        .map(|run| run.len() as u64)
        .sum()
}
pub fn after_base(
    [replaced, new, other]: [&PageTable; 3],
    [replaced_index, new_index, other_index]: [&IndexTable; 3],
    block_size: u64,
) -> AfterBase {
    let kept = ListedPages::of([new, other]);
    let mut freed = Vec::new();
    for (ino, list) in replaced {
        let mut listed = kept.of_file(*ino);
        // A run the kept tables share is kept whole: at 50M extents a
        // base rewrites a few of 2k runs, and looking up each of the
        // other runs' pages was most of this walk.
        let shared: std::collections::HashSet<*const [PageRef]> = [new, other]
            .into_iter()
            .filter_map(|table| {
                let at = table.binary_search_by_key(ino, |&(i, _)| i).ok()?;
                Some(table[at].1.runs())
            })
            .flatten()
            .map(Arc::as_ptr)
            .collect();
        for run in list.runs() {
            if shared.contains(&Arc::as_ptr(run)) {
                continue;
            }
            for page in run.iter() {
                if !listed.contains(page) {
                    freed.push((page.addr, codec::page_len(page.count as usize, block_size)));
                }
            }
        }
    }
    let new_index = index_page_ranges(new_index, block_size);
    let other_index = index_page_ranges(other_index, block_size);
    freed.extend(
        index_page_ranges(replaced_index, block_size)
            .into_iter()
            .filter(|r| !new_index.contains(r) && !other_index.contains(r)),
    );
    freed.sort_unstable();
    freed.dedup();
    AfterBase {
        freed,
        shared_bytes: shared_extent_page_bytes(new, other, block_size)
            + shared_index_page_bytes(&new_index, &other_index, block_size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::read_pages;
    use crate::codec::{random_image, PageArea};
    use crate::superblock::test_device::VecDevice;
    use crate::superblock::{Layout, Superblock};
    use crate::types::{Extent, ExtentState};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const BS: u64 = 4096;

    /// Extents of the big file: past the inline bound (162 at 4 KiB), in
    /// many chunks.
    const BIG: u64 = 200;

    /// A state of random inodes (their few extents inline), one regular
    /// file with [`BIG`] extents (paged, many chunks), and that file's
    /// inode number.
    fn state() -> (MetaState, Ino) {
        state_with(BIG)
    }

    /// [`state`] with a big file of `extents` extents.
    fn state_with(extents: u64) -> (MetaState, Ino) {
        let mut image = random_image(&mut SmallRng::seed_from_u64(13), 30);
        let root = MetaState::new_empty(BS as u32, Default::default(), 0, 0).to_image();
        image.inodes.retain(|i| i.ino != crate::types::ROOT_INO);
        // Random entries name inodes that are not there.
        for inode in &mut image.inodes {
            inode.entries.clear();
        }
        image.inodes.extend(root.inodes);
        image.inodes.sort_by_key(|i| i.ino);
        image.next_ino = image.next_ino.max(root.next_ino);
        let big = image
            .inodes
            .iter_mut()
            .find(|i| i.kind == FileKind::Regular)
            .unwrap();
        big.extents = (0..extents)
            .map(|i| Extent {
                file_off: 2 * i * BS,
                len: BS,
                addr: (1000 + 3 * i) * BS,
                state: ExtentState::Written,
            })
            .collect();
        big.size = 2 * extents * BS;
        let ino = big.ino;
        (MetaState::from_image(&image, BS as u32).unwrap(), ino)
    }

    /// Writes `plan`'s pages and a root of `state` to `dev`, reads them
    /// back as mount does, and checks the image is `state`'s.
    fn round_trip(dev: &VecDevice, sb: &Superblock, state: &MetaState, planned: &Planned) {
        let (plan, pages) = planned;
        crate::checkpoint::write_pages(dev, pages).unwrap();
        let root = state.encode_root_after(0, &plan.table, None).unwrap();
        let area = PageArea {
            start: sb.layout.data.start,
            len: sb.layout.data.len,
            block_size: BS,
        };
        let mut decoded = codec::decode_root_at(&root, 0, "root", area).unwrap();
        assert_eq!(decoded.pages, plan.table);
        read_pages(dev, sb, &decoded.image, &decoded.pages)
            .unwrap()
            .fill_image(&mut decoded.image)
            .unwrap();
        assert_eq!(decoded.image, state.to_image());
    }

    /// A plan and the pages it wrote.
    type Planned = (PagePlan, Vec<(u64, Vec<u8>)>);

    /// [`plan_pages`], keeping the pages it writes.
    fn plan_kept(
        state: &MetaState,
        seed: u32,
        listed: &ListedPages<'_>,
        mut place: impl FnMut(u64) -> Result<u64>,
    ) -> Result<Planned> {
        let mut pages = Vec::new();
        let plan = plan_pages(
            state,
            seed,
            listed,
            None,
            |len, _, _| place(len),
            |batch| {
                pages.extend_from_slice(batch);
                Ok(())
            },
        )?;
        Ok((plan, pages))
    }

    /// A 16 MiB device and the superblock of a volume on it.
    fn bed() -> (VecDevice, Superblock) {
        const DEV: u64 = 16 << 20;
        let sb = Superblock::new(Layout::compute(DEV, 512, BS as u32, None, None).unwrap());
        (VecDevice::new(DEV, 512), sb)
    }

    /// Places pages one after another from the start of `sb`'s data area.
    fn placer(sb: &Superblock) -> impl FnMut(u64) -> Result<u64> {
        let mut next = sb.layout.data.start;
        move |len| {
            next += len;
            Ok(next - len)
        }
    }

    /// Three page tables as three bases in use at once list them: per
    /// file, pages at distinct device bytes with rising first keys, each
    /// table listing some of them (a rewritten chunk: the same first key
    /// at another byte), and files some tables do not have.
    fn random_tables(rng: &mut SmallRng) -> [PageTable; 3] {
        use rand::Rng;
        let mut tables: [PageTable; 3] = Default::default();
        let mut next_addr = 1u64 << 20;
        let mut page = |rng: &mut SmallRng, key: u64| {
            let count = rng.gen_range(1..600);
            let page = PageRef {
                addr: next_addr,
                crc: rng.gen(),
                count,
                first_key: key * 1000,
                allocated: u64::from(count) * BS,
            };
            next_addr += codec::page_len(count as usize, BS);
            page
        };
        for ino in (10..40).step_by(rng.gen_range(1..4)) {
            let mut runs: [Vec<PageRun>; 3] = Default::default();
            let keys = rng.gen_range(0..30u64);
            let mut key = 0;
            // Blocks of keys, each a run in every table: one allocation
            // the tables share (as bases share the runs neither
            // rewrote), or each table's own pages.
            while key < keys {
                let block = key..keys.min(key + rng.gen_range(1..6));
                key = block.end;
                let shared: Option<PageRun> = rng.gen_bool(0.3).then(|| {
                    block
                        .clone()
                        .map(|k| page(rng, k))
                        .collect::<Vec<_>>()
                        .into()
                });
                let mut lists: [Vec<PageRef>; 3] = Default::default();
                for k in block {
                    for _ in 0..rng.gen_range(1..3) {
                        let page = page(rng, k);
                        for list in &mut lists {
                            let same_key =
                                list.last().is_some_and(|p| p.first_key == page.first_key);
                            if !same_key && rng.gen_bool(0.6) {
                                list.push(page);
                            }
                        }
                    }
                }
                for (table_runs, list) in runs.iter_mut().zip(lists) {
                    match &shared {
                        Some(run) if rng.gen_bool(0.7) => table_runs.push(run.clone()),
                        _ => table_runs.push(list.into()),
                    }
                }
            }
            for (table, runs) in tables.iter_mut().zip(runs) {
                let list = PageList::from_runs(runs);
                if !list.is_empty() || rng.gen_bool(0.2) {
                    table.push((ino, list));
                }
            }
        }
        tables
    }

    /// Per-file cursors answer as a set of every listed page would, and
    /// what a base leaves to free and to count as shared is what the
    /// device ranges of the three tables give.
    #[test]
    fn listed_pages_and_after_base_match_sets_of_every_page() {
        for seed in 0..300 {
            let rng = &mut SmallRng::seed_from_u64(seed);
            let [replaced, new, other] = random_tables(rng);
            let every: std::collections::HashSet<PageRef> = [&new, &other]
                .into_iter()
                .flat_map(|t| t.iter().flat_map(|(_, l)| l.iter().copied()))
                .collect();
            let listed = ListedPages::of([&new, &other]);
            for (ino, list) in replaced.iter().chain(&new) {
                let mut file = listed.of_file(*ino);
                for page in list {
                    assert_eq!(file.contains(page), every.contains(page), "seed {seed}");
                }
            }
            let (n, o) = (page_ranges(&new, BS), page_ranges(&other, BS));
            let freed: Vec<(u64, u64)> = page_ranges(&replaced, BS)
                .into_iter()
                .filter(|r| !n.contains(r) && !o.contains(r))
                .collect();
            let none = Vec::new();
            let after = after_base([&replaced, &new, &other], [&none, &none, &none], BS);
            assert_eq!(after.freed, freed, "seed {seed}");
            let shared: u64 = n.intersection(&o).map(|&(_, len)| len).sum();
            assert_eq!(after.shared_bytes, shared, "seed {seed}");
            assert_eq!(
                shared_page_bytes([&other, &new], [&none, &none], BS),
                shared,
                "seed {seed}"
            );
        }
    }

    /// The first base writes every chunk; after one change, the next
    /// writes only the chunks that change touched, lists the same pages
    /// for the rest, and frees only the pages it replaced.
    #[test]
    fn a_base_after_a_change_writes_only_the_changed_chunks() {
        let (dev, sb) = bed();
        let mut place = placer(&sb);
        let (mut live, big) = state();
        let chunks = live.inodes[&big].extents.chunk_pages().count();
        assert!(chunks >= 5);

        let first = live.clone();
        let planned_plan1 =
            plan_kept(&first, sb.crc_seed(), &ListedPages::none(), &mut place).unwrap();
        let plan1 = &planned_plan1.0;
        assert_eq!(plan1.written.len(), chunks, "nothing was written before");
        round_trip(&dev, &sb, &first, &planned_plan1);
        plan1.record_written(&first, None).unwrap();
        drop(first);
        assert!(
            live.inodes[&big]
                .extents
                .chunk_pages()
                .all(|c| c.page().is_some()),
            "the live map sees the pages in the chunks it shares"
        );
        let listed = |table| ListedPages::of([table]);

        // One extent of the big file, in its third chunk, punched.
        let inode = live.inodes.get_mut(&big).unwrap();
        inode.extents.remove_range(2 * 20 * BS, BS);
        let second = live.clone();
        let planned_plan2 =
            plan_kept(&second, sb.crc_seed(), &listed(&plan1.table), &mut place).unwrap();
        let plan2 = &planned_plan2.0;
        assert_eq!(plan2.written.len(), 1, "one chunk changed");
        round_trip(&dev, &sb, &second, &planned_plan2);
        let old = page_ranges(&plan1.table, BS);
        let kept = page_ranges(&plan2.table, BS);
        assert_eq!(kept.difference(&old).count(), 1);
        let none = Vec::new();
        let freed = after_base(
            [&plan1.table, &plan2.table, &Vec::new()],
            [&none, &none, &none],
            BS,
        )
        .freed;
        assert_eq!(freed.len(), 1, "the page of the changed chunk");
        assert!(!kept.contains(&freed[0]));
        // The other slot's base still lists it: nothing is freed.
        assert!(after_base(
            [&plan1.table, &plan2.table, &plan1.table],
            [&none, &none, &none],
            BS
        )
        .freed
        .is_empty());
        plan2.record_written(&second, None).unwrap();
        assert!(
            plan_kept(&second, sb.crc_seed(), &listed(&plan2.table), &mut place)
                .unwrap()
                .0
                .written
                .is_empty()
        );
    }

    /// Files of at most a block's worth of extents stay inline in the root
    /// (no page); a file that grows past it is paged at the next base, one
    /// that shrinks back goes inline again, and its chunks' pages, freed
    /// meanwhile, are written again rather than referred to.
    #[test]
    fn small_files_stay_inline_and_a_file_crossing_the_bound_changes_form() {
        let (dev, sb) = bed();
        let mut place = placer(&sb);
        let max = codec::inline_extents_max(BS) as u64;
        let (mut live, big) = state();
        let small = live
            .inodes
            .values()
            .filter(|i| i.kind == FileKind::Regular && !i.extents.is_empty())
            .count();
        assert!(small >= 3, "random files with a few extents");
        let first = live.clone();
        let planned_plan =
            plan_kept(&first, sb.crc_seed(), &ListedPages::none(), &mut place).unwrap();
        let plan = &planned_plan.0;
        assert_eq!(
            plan.table.iter().map(|(ino, _)| *ino).collect::<Vec<_>>(),
            [big],
            "only the big file has pages"
        );
        round_trip(&dev, &sb, &first, &planned_plan);
        plan.record_written(&first, None).unwrap();
        drop(first);

        // Shrink the big file to the bound by truncating: inline, no page.
        let inode = live.inodes.get_mut(&big).unwrap();
        inode.extents.truncate_blocks_from(2 * max * BS);
        assert_eq!(inode.extents.len() as u64, max);
        let old_pages: Vec<_> = inode
            .extents
            .chunk_pages()
            .filter_map(|c| c.page())
            .collect();
        let at_bound = live.clone();
        let planned_inline =
            plan_kept(&at_bound, sb.crc_seed(), &ListedPages::none(), &mut place).unwrap();
        let inline = &planned_inline.0;
        assert!(inline.table.is_empty() && inline.written.is_empty());
        round_trip(&dev, &sb, &at_bound, &planned_inline);

        // One more extent: paged again at the next base. The chunks the
        // truncation left name pages neither base lists any more (the
        // table of `inline` is empty): each is written again, and stays
        // unrecorded since its chunk names the old one.
        assert!(!old_pages.is_empty(), "untouched chunks keep their pages");
        let inode = live.inodes.get_mut(&big).unwrap();
        inode
            .extents
            .insert(Extent {
                file_off: 2 * max * BS,
                len: BS,
                addr: 1 << 20,
                state: ExtentState::Written,
            })
            .unwrap();
        let grown = live.clone();
        let listed_now = ListedPages::of([&inline.table]);
        let planned_paged = plan_kept(&grown, sb.crc_seed(), &listed_now, &mut place).unwrap();
        let paged = &planned_paged.0;
        assert_eq!(paged.table.len(), 1);
        assert_eq!(
            paged.written.len(),
            grown.inodes[&big].extents.chunk_pages().count(),
            "every chunk written, the stale pages too"
        );
        assert!(paged.table[0].1.iter().all(|p| !old_pages.contains(p)));
        round_trip(&dev, &sb, &grown, &planned_paged);
        paged.record_written(&grown, None).unwrap();
    }

    /// A base hands its pages to the writer in batches of about
    /// [`PAGE_BATCH_BYTES`], never holding them all encoded at once.
    #[test]
    fn pages_are_written_in_bounded_batches() {
        let (state, _) = state_with(20_000);
        let mut next = 1 << 30;
        let mut batches = Vec::new();
        let mut asked = Vec::new();
        let plan = plan_pages(
            &state,
            0,
            &ListedPages::none(),
            None,
            |len, ahead, _| {
                asked.push((len, ahead));
                next += len;
                Ok(next - len)
            },
            |batch| {
                batches.push(batch.iter().map(|(_, b)| b.len()).sum::<usize>());
                Ok(())
            },
        )
        .unwrap();
        let page = plan.written.iter().map(|&(_, len)| len).max().unwrap() as usize;
        assert!(batches.len() >= 2, "{batches:?}");
        let (last, full) = batches.split_last().unwrap();
        assert!(
            full.iter()
                .all(|&b| (PAGE_BATCH_BYTES..PAGE_BATCH_BYTES + page).contains(&b)),
            "{batches:?}"
        );
        assert!(*last > 0 && *last < PAGE_BATCH_BYTES + page);
        assert_eq!(
            batches.iter().sum::<usize>() as u64,
            plan.written_bytes(),
            "every page once"
        );
        // Each placement is told exactly what is left to place: a caller
        // taking room ahead never takes more than the base writes.
        let mut left = plan.written_bytes();
        for &(len, ahead) in &asked {
            assert_eq!(ahead, left, "{asked:?}");
            left -= len;
        }
        assert_eq!(left, 0);
    }

    /// A placement that fails ends the plan with its error, and nothing
    /// is recorded in the chunks.
    #[test]
    fn a_page_that_cannot_be_placed_fails_the_plan() {
        let (state, _) = state();
        let mut left = 2;
        let err = plan_kept(&state, 0, &ListedPages::none(), |_| {
            if left == 0 {
                return Err(Error::NoSpace {
                    what: "extent pages".into(),
                    needed: BS,
                    available: 0,
                });
            }
            left -= 1;
            Ok(1 << 30)
        })
        .unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert!(state
            .inodes
            .values()
            .all(|i| i.extents.chunk_pages().all(|c| c.page().is_none())));
    }

    /// [`plan_pages`] with index pages, keeping what it writes.
    fn plan_indexed(
        state: &MetaState,
        seed: u32,
        listed: &ListedPages<'_>,
        index: &ListedIndex<'_>,
        mut place: impl FnMut(u64) -> Result<u64>,
    ) -> Planned {
        let mut pages = Vec::new();
        let plan = plan_pages(
            state,
            seed,
            listed,
            Some(index),
            |len, _, _| place(len),
            |batch| {
                pages.extend_from_slice(batch);
                Ok(())
            },
        )
        .unwrap();
        (plan, pages)
    }

    /// Writes a planned indexed base to `dev`, reads its root and index
    /// pages back as mount does, and checks they list the plan's pages and
    /// hold `state`'s image.
    fn round_trip_indexed(dev: &VecDevice, sb: &Superblock, state: &MetaState, planned: &Planned) {
        let (plan, pages) = planned;
        crate::checkpoint::write_pages(dev, pages).unwrap();
        let root = state
            .encode_root_after(0, &plan.table, Some(&plan.index))
            .unwrap();
        let area = crate::checkpoint::page_area(sb);
        let decoded = codec::decode_indexed_root_at(&root, 0, "root", area).unwrap();
        assert_eq!(decoded.index, plan.index);
        let (table, damaged) = crate::checkpoint::read_index_pages(
            dev,
            sb,
            &decoded.index,
            crate::checkpoint::PageReading::Survey,
        )
        .unwrap();
        assert_eq!((&table, damaged.len()), (&plan.table, 0));
        let mut image = decoded.image;
        read_pages(dev, sb, &image, &table)
            .unwrap()
            .fill_image(&mut image)
            .unwrap();
        assert_eq!(image, state.to_image());
    }

    /// Index pages among what a plan wrote: `(addr, len)` of one block at
    /// each copy of an index reference.
    fn written_index(plan: &PagePlan) -> BTreeSet<(u64, u64)> {
        index_page_ranges(&plan.index, BS)
            .into_iter()
            .filter(|r| plan.written.contains(r))
            .collect()
    }

    /// With index pages, the first base writes every page and an index
    /// page per run (each to two blocks); after one extent changes, the
    /// next writes that chunk's page and the one index page listing it,
    /// lists the other index pages again, and frees the page and both
    /// copies of the index page it replaced.
    #[test]
    fn an_indexed_base_after_a_change_writes_the_changed_run_only() {
        let (dev, sb) = bed();
        let mut place = placer(&sb);
        let (mut live, big) = state_with(2000);
        let chunks = live.inodes[&big].extents.chunk_count();
        let none = ListedIndex::none();

        let first = live.clone();
        let planned1 = plan_indexed(
            &first,
            sb.crc_seed(),
            &ListedPages::none(),
            &none,
            &mut place,
        );
        let plan1 = &planned1.0;
        let runs = plan1.index[0].1.len();
        assert!(runs >= 3, "{runs} index pages for {chunks} chunks");
        assert!(runs as u64 <= index_pages_at_most(chunks as u64, 1, BS));
        assert_eq!(
            plan1.written.len(),
            chunks + 2 * runs,
            "every page and both copies of each index page"
        );
        assert!(plan1.index[0]
            .1
            .iter()
            .all(|r| r.addr != r.copy && written_index(plan1).contains(&(r.copy, BS))));
        round_trip_indexed(&dev, &sb, &first, &planned1);
        // The bytes listed, from the index pages' sums; from the pages
        // for a file whose index pages do not list them all (one lost).
        let by_pages: u64 = plan1.table[0]
            .1
            .iter()
            .map(|p| codec::page_len(p.count as usize, BS))
            .sum();
        let listed_bytes = crate::checkpoint::listed_page_bytes(&sb, &plan1.table, &plan1.index);
        assert_eq!(listed_bytes, by_pages + 2 * runs as u64 * BS);
        let mut one_lost = plan1.index.clone();
        one_lost[0].1.pop();
        assert_eq!(
            crate::checkpoint::listed_page_bytes(&sb, &plan1.table, &one_lost),
            by_pages + 2 * (runs as u64 - 1) * BS
        );
        plan1.record_written(&first, None).unwrap();
        drop(first);

        // One extent punched in the middle of the file.
        let inode = live.inodes.get_mut(&big).unwrap();
        inode.extents.remove_range(2 * 1000 * BS, BS);
        let second = live.clone();
        let listed = ListedPages::of([&plan1.table]);
        let listed_index = ListedIndex::of([(&plan1.table, &plan1.index)]);
        let planned2 = plan_indexed(&second, sb.crc_seed(), &listed, &listed_index, &mut place);
        let plan2 = &planned2.0;
        assert_eq!(
            written_index(plan2).len(),
            2,
            "the changed run's index page, twice"
        );
        assert_eq!(
            plan2.written.len(),
            3,
            "one page and both copies of its index page"
        );
        round_trip_indexed(&dev, &sb, &second, &planned2);
        let (old, new) = (&plan1.index[0].1, &plan2.index[0].1);
        assert_eq!(old.len(), new.len());
        assert_eq!(
            old.iter().zip(new).filter(|(a, b)| a != b).count(),
            1,
            "the other index pages are listed again"
        );

        let none_index = Vec::new();
        let after = after_base(
            [&plan1.table, &plan2.table, &Vec::new()],
            [&plan1.index, &plan2.index, &none_index],
            BS,
        );
        let replaced_index: Vec<(u64, u64)> = index_page_ranges(&plan1.index, BS)
            .difference(&index_page_ranges(&plan2.index, BS))
            .copied()
            .collect();
        assert_eq!(replaced_index.len(), 2);
        assert_eq!(
            after.freed.len(),
            3,
            "the old page and both copies of the old index page"
        );
        assert!(replaced_index.iter().all(|r| after.freed.contains(r)));
        // Both still listed by the other slot: nothing freed, and the index
        // pages both list are shared bytes.
        let kept = after_base(
            [&plan1.table, &plan2.table, &plan1.table],
            [&plan1.index, &plan2.index, &plan1.index],
            BS,
        );
        assert!(kept.freed.is_empty());
        let shared_pages =
            shared_page_bytes([&plan1.table, &plan2.table], [&none_index, &none_index], BS);
        assert_eq!(
            kept.shared_bytes,
            shared_pages + 2 * (runs as u64 - 1) * BS,
            "the index pages both list count too"
        );

        // Nothing changed since: nothing written.
        plan2.record_written(&second, None).unwrap();
        let listed = ListedPages::of([&plan2.table]);
        let listed_index = ListedIndex::of([(&plan2.table, &plan2.index)]);
        let planned3 = plan_indexed(&second, sb.crc_seed(), &listed, &listed_index, &mut place);
        assert!(planned3.0.written.is_empty());
        assert_eq!(planned3.0.index, plan2.index);
    }

    /// `index_runs` over random segment sizes: every page once and in
    /// order; runs of at most `max`, every one but the last at least half
    /// of it; no more than [`index_pages_at_most`]; and growing one
    /// segment changes only the runs holding its pages or the pages of
    /// the segment after it.
    #[test]
    fn index_runs_cover_pages_in_bounded_runs_and_a_change_stays_local() {
        let mut rng = SmallRng::seed_from_u64(7);
        for case in 0..500 {
            let max = rng.gen_range(2..40);
            let sizes: Vec<usize> = (0..rng.gen_range(1..30))
                .map(|_| rng.gen_range(1..3 * max))
                .collect();
            let (pages, starts) = segment_pages(&sizes, &[]);
            let runs = index_runs(&pages, &starts, max);
            let flat: Vec<PageRef> = runs.iter().flat_map(|r| r.iter().copied()).collect();
            assert_eq!(flat, pages, "case {case}");
            for (i, run) in runs.iter().enumerate() {
                assert!(run.len() <= max, "case {case}");
                assert!(i + 1 == runs.len() || 2 * run.len() >= max, "case {case}");
            }
            let bound = (2 * pages.len()).div_ceil(max) + 1;
            assert!(runs.len() <= bound, "case {case}: {} > {bound}", runs.len());

            // One page more in segment `s`: runs wholly before it, and
            // those after the next segment of at least half of `max`
            // pages, are unchanged.
            let s = rng.gen_range(0..sizes.len());
            let mut grown = sizes.clone();
            grown[s] += 1;
            let (pages2, starts2) = segment_pages(&grown, &[s]);
            let runs2 = index_runs(&pages2, &starts2, max);
            let before_key = starts.get(s).map_or(u64::MAX, |&i| pages[i].first_key);
            let big = (s + 1..sizes.len()).find(|&j| 2 * sizes[j] >= max);
            let after_key = big
                .and_then(|j| starts.get(j + 1))
                .map_or(u64::MAX, |&i| pages[i].first_key);
            let outside = |r: &&&[PageRef]| {
                r.last().unwrap().first_key < before_key || r[0].first_key >= after_key
            };
            let old: std::collections::HashSet<Vec<PageRef>> =
                runs.iter().filter(outside).map(|r| r.to_vec()).collect();
            let new: std::collections::HashSet<Vec<PageRef>> =
                runs2.iter().filter(outside).map(|r| r.to_vec()).collect();
            assert_eq!(old, new, "case {case}: segment {s} of {sizes:?}, max {max}");
        }
    }

    /// Pages for segments of `sizes` pages, first keys 10 apart, and where
    /// each segment starts; a segment in `grown` has its extra page at a
    /// key between two others (so no other page's key moves).
    fn segment_pages(sizes: &[usize], grown: &[usize]) -> (Vec<PageRef>, Vec<usize>) {
        let mut pages = Vec::new();
        let mut starts = Vec::new();
        let mut key = 0;
        for (s, &n) in sizes.iter().enumerate() {
            starts.push(pages.len());
            let extra = grown.contains(&s);
            for k in 0..n {
                let at = if extra && k == n - 1 { key - 5 } else { key };
                if !(extra && k == n - 1) {
                    key += 10;
                }
                pages.push(PageRef {
                    addr: at * BS,
                    crc: 0,
                    count: 1,
                    first_key: at,
                    allocated: BS,
                });
            }
        }
        pages.sort_by_key(|p| p.first_key);
        (pages, starts)
    }
}
