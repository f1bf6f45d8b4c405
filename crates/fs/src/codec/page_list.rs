//! A file's page references as a base lists them, in runs shared by
//! reference.
//!
//! In the indexed form a run is one index page's references. Both slots'
//! bases list most index pages alike (a base rewrites only the runs a
//! change reached), and mount starts one cold segment of a map at each
//! run: so one allocation per run serves both slots' tables and the map,
//! where each kept its own copy (96 bytes per chunk at 50M extents: 18 MB,
//! against 6 for one copy). A root that lists its pages itself gives one
//! run per file.

use std::sync::Arc;

use super::page::PageRef;

/// Consecutive page references of one file, in key order.
pub type PageRun = Arc<[PageRef]>;

/// One file's page references in key order, as runs. Two lists are equal
/// when they hold the same references, however they are cut into runs.
#[derive(Clone, Debug, Default)]
pub struct PageList {
    runs: Vec<PageRun>,
    len: usize,
}

impl PageList {
    /// The runs as given, empty ones left out.
    pub fn from_runs(runs: impl IntoIterator<Item = PageRun>) -> PageList {
        let runs: Vec<PageRun> = runs.into_iter().filter(|r| !r.is_empty()).collect();
        let len = runs.iter().map(|r| r.len()).sum();
        PageList { runs, len }
    }

    pub fn runs(&self) -> &[PageRun] {
        &self.runs
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> <&PageList as IntoIterator>::IntoIter {
        self.into_iter()
    }

    pub fn first(&self) -> Option<&PageRef> {
        self.runs.first().and_then(|r| r.first())
    }

    pub fn last(&self) -> Option<&PageRef> {
        self.runs.last().and_then(|r| r.last())
    }

    /// A cursor at the first page.
    pub fn cursor(&self) -> PageCursor<'_> {
        PageCursor {
            runs: &self.runs,
            run: 0,
            at: 0,
        }
    }
}

impl PartialEq for PageList {
    fn eq(&self, other: &PageList) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for PageList {}

impl<'a> IntoIterator for &'a PageList {
    type Item = &'a PageRef;
    type IntoIter = std::iter::FlatMap<
        std::slice::Iter<'a, PageRun>,
        std::slice::Iter<'a, PageRef>,
        fn(&'a PageRun) -> std::slice::Iter<'a, PageRef>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.runs.iter().flat_map(|r| r.iter())
    }
}

impl From<Vec<PageRef>> for PageList {
    /// One run.
    fn from(pages: Vec<PageRef>) -> PageList {
        PageList::from_runs([PageRun::from(pages)])
    }
}

impl FromIterator<PageRef> for PageList {
    fn from_iter<I: IntoIterator<Item = PageRef>>(pages: I) -> PageList {
        PageList::from(pages.into_iter().collect::<Vec<_>>())
    }
}

/// A position in a [`PageList`] that moves forward only.
#[derive(Clone, Debug)]
pub struct PageCursor<'a> {
    runs: &'a [PageRun],
    run: usize,
    /// Index in `runs[run]`, always inside it while `run` is.
    at: usize,
}

impl<'a> PageCursor<'a> {
    /// The page at the cursor.
    pub fn peek(&self) -> Option<&'a PageRef> {
        self.runs.get(self.run).map(|r| &r[self.at])
    }

    /// Moves forward to the first page whose first key is at least `key`
    /// (past the end if none; never back). The next page is tried first,
    /// as a walk in key order most often wants it; then whole runs are
    /// passed over by their last key, and the page found in its run by
    /// halves.
    pub fn seek(&mut self, key: u64) {
        if self.peek().is_none_or(|p| p.first_key >= key) {
            return;
        }
        self.advance();
        if self.peek().is_none_or(|p| p.first_key >= key) {
            return;
        }
        while let Some(run) = self.runs.get(self.run) {
            if run[run.len() - 1].first_key < key {
                (self.run, self.at) = (self.run + 1, 0);
                continue;
            }
            self.at += run[self.at..].partition_point(|p| p.first_key < key);
            return;
        }
    }

    /// Moves to the next page.
    pub fn advance(&mut self) {
        if let Some(run) = self.runs.get(self.run) {
            self.at += 1;
            if self.at == run.len() {
                (self.run, self.at) = (self.run + 1, 0);
            }
        }
    }

    /// The run holding the page at the cursor, and its index there.
    pub fn position(&self) -> Option<(&'a PageRun, usize)> {
        self.runs.get(self.run).map(|r| (r, self.at))
    }

    /// The whole run starting at the cursor, if one does.
    pub fn run_here(&self) -> Option<&'a PageRun> {
        self.runs.get(self.run).filter(|_| self.at == 0)
    }

    /// Moves past `n` pages.
    pub fn skip(&mut self, mut n: usize) {
        while n > 0 {
            let Some(run) = self.runs.get(self.run) else {
                return;
            };
            let step = n.min(run.len() - self.at);
            self.at += step;
            n -= step;
            if self.at == run.len() {
                (self.run, self.at) = (self.run + 1, 0);
            }
        }
    }

    /// Whether the next `pages.len()` pages are `pages`, the cursor left
    /// where it was.
    pub fn starts_with(&self, pages: &[PageRef]) -> bool {
        let mut cursor = self.clone();
        pages.iter().all(|p| {
            let same = cursor.peek() == Some(p);
            cursor.advance();
            same
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(k: u64) -> PageRef {
        PageRef {
            addr: 4096 * k,
            crc: k as u32,
            count: 1,
            first_key: k,
            allocated: 4096,
        }
    }

    fn list(runs: &[std::ops::Range<u64>]) -> PageList {
        PageList::from_runs(
            runs.iter()
                .map(|r| r.clone().map(page).collect::<Vec<_>>().into()),
        )
    }

    #[test]
    fn a_list_is_its_runs_in_order_without_empty_ones() {
        let l = list(&[0..3, 3..3, 3..7, 7..8]);
        assert_eq!(l.runs().len(), 3);
        assert_eq!(l.len(), 8);
        assert!(l.iter().map(|p| p.first_key).eq(0..8));
        assert!(l.iter().rev().map(|p| p.first_key).eq((0..8).rev()));
        assert_eq!((l.first(), l.last()), (Some(&page(0)), Some(&page(7))));
        assert_eq!(PageList::from(vec![page(1), page(2)]), list(&[1..2, 2..3]));
        assert_ne!(list(&[1..2, 2..3]), list(&[1..2, 2..4]));
        assert!(list(&[0..0, 5..5]).is_empty() && list(&[0..0, 5..5]).first().is_none());
    }

    #[test]
    fn a_cursor_walks_every_page_across_runs() {
        let l = list(&[0..3, 3..4, 4..7]);
        let mut c = l.cursor();
        for k in 0..7 {
            assert_eq!(c.peek(), Some(&page(k)), "{k}");
            assert_eq!(c.run_here().is_some(), [0, 3, 4].contains(&k), "{k}");
            assert!(c.starts_with(&[page(k)]) && !c.starts_with(&[page(k + 1)]));
            c.advance();
        }
        assert_eq!(c.peek(), None);
        c.advance();
        assert_eq!(c.peek(), None);
        let mut c = l.cursor();
        c.skip(2);
        assert!(c.starts_with(&[page(2), page(3), page(4)]));
        c.skip(3);
        assert_eq!(c.peek(), Some(&page(5)));
        c.skip(10);
        assert_eq!(c.peek(), None);
        assert!(!c.starts_with(&[page(7)]) && c.starts_with(&[]));
    }

    /// A seek lands where a step-by-step walk from the same place would:
    /// on the first page at or past the key, across runs, never back.
    #[test]
    fn a_seek_lands_where_stepping_would() {
        // Keys 0, 2, 4, ... in runs of uneven length.
        let runs: Vec<PageRun> = [0..3u64, 3..4, 4..9, 9..10, 10..16]
            .into_iter()
            .map(|r| r.map(|k| page(2 * k)).collect::<Vec<_>>().into())
            .collect();
        let l = PageList::from_runs(runs);
        for start in 0..=l.len() {
            for key in 0..36 {
                let mut seek = l.cursor();
                seek.skip(start);
                let mut step = seek.clone();
                seek.seek(key);
                while step.peek().is_some_and(|p| p.first_key < key) {
                    step.advance();
                }
                assert_eq!(seek.peek(), step.peek(), "from {start} to {key}");
                assert_eq!(
                    seek.position().map(|(r, at)| (Arc::as_ptr(r), at)),
                    step.position().map(|(r, at)| (Arc::as_ptr(r), at)),
                    "from {start} to {key}"
                );
            }
        }
    }
}
