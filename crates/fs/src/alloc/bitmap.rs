//! Free blocks as a bitmap (1: free), in groups of [`GROUP_BLOCKS`]
//! blocks, with what allocation asks of them kept per group and over all
//! groups.
//!
//! Memory is one bit per block of *fragmented* groups only: a group all
//! free or all used keeps no bitmap, so an unfragmented device costs a few
//! dozen bytes per group, and the worst case (every other block free) is
//! the device's size / (8 × block size), whatever the number of free runs.
//!
//! Per group, a [`Summary`] (free blocks, runs clipped to the group,
//! largest clipped run, free blocks at its start and end). Over groups:
//! an index by largest clipped run (best fit without looking at every
//! group) and a segment tree of (length, free prefix, free suffix,
//! longest run) whose root is the longest run of the whole device, runs
//! crossing group boundaries included, and which finds the first run of
//! a given length in `O(log groups)`. Runs are never cut at group
//! boundaries: everything outside this module sees coalesced runs.
//!
//! Walks over a group's bits are cut short by what its summary knows:
//! a run that reaches the group's free prefix or suffix ends there, and
//! best fit starts past the head a group fills from when no run in it
//! fits (`Group::head_end`), so a group being filled from the front costs
//! constant time per allocation, whatever its fill.
//!
//! Blocks are indexes from the data area's start; callers check ranges
//! (this module asserts nothing about ownership, it only flips bits that
//! its callers found in the other state).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// Blocks per group: a bitmap of 4 KiB, and at most a few thousand groups
/// per terabyte (4 KiB blocks) for the index and the tree.
pub const GROUP_BLOCKS: u32 = 32768;

/// What a group holds, in blocks. Runs are clipped to the group: a run
/// crossing into the next group counts in both (see
/// [`FreeBitmap::run_count`] for the coalesced count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Summary {
    free: u32,
    runs: u32,
    largest: u32,
    /// Free blocks from the group's first block on.
    prefix: u32,
    /// Free blocks ending at the group's last block.
    suffix: u32,
}

impl Summary {
    fn uniform(len: u32, free: bool) -> Summary {
        if free && len > 0 {
            Summary {
                free: len,
                runs: 1,
                largest: len,
                prefix: len,
                suffix: len,
            }
        } else {
            Summary::default()
        }
    }
}

#[derive(Clone, Debug)]
struct Group {
    /// `None`: all free or all used (`sum.free` says which). Bits past the
    /// group's length (the last group) are 0.
    bits: Option<Box<[u64]>>,
    sum: Summary,
    /// The longest run lying in blocks `[0, head_end)`, whose last block
    /// is used (0: nothing known): what an allocation taking from the
    /// group's longest run need not scan again while the group fills
    /// from the front. Exact: any change before `head_end` clears it.
    head_end: u32,
    head_max: u32,
}

/// A segment tree node over a span of groups, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Node {
    len: u64,
    prefix: u64,
    suffix: u64,
    best: u64,
}

impl Node {
    fn join(l: Node, r: Node) -> Node {
        Node {
            len: l.len + r.len,
            prefix: if l.prefix == l.len {
                l.len + r.prefix
            } else {
                l.prefix
            },
            suffix: if r.suffix == r.len {
                r.len + l.suffix
            } else {
                r.suffix
            },
            best: l.best.max(r.best).max(l.suffix + r.prefix),
        }
    }
}

/// The free blocks of `blocks` blocks.
#[derive(Clone, Debug)]
pub struct FreeBitmap {
    blocks: u64,
    group_blocks: u32,
    groups: Vec<Group>,
    /// `(largest clipped run, group)` of every group with a free block.
    by_largest: BTreeSet<(u32, u32)>,
    /// Heap order (root at 1), leaves from `leaves` on, one per group;
    /// padding leaves are empty.
    tree: Vec<Node>,
    leaves: usize,
    free: u64,
    /// Sum of the groups' clipped runs.
    clipped_runs: u64,
    /// Group boundaries a run crosses (each counted twice in
    /// `clipped_runs`).
    joins: u64,
}

impl FreeBitmap {
    pub fn free_blocks(&self) -> u64 {
        self.free
    }

    /// The longest run of free blocks (0: none).
    pub fn largest(&self) -> u64 {
        self.tree[1].best
    }

    /// Runs of free blocks, coalesced across group boundaries.
    pub fn run_count(&self) -> u64 {
        self.clipped_runs - self.joins
    }

    fn group_len(&self, g: usize) -> u32 {
        group_len(self.blocks, self.group_blocks, g)
    }

    fn split(&self, b: u64) -> (usize, u32) {
        let gb = u64::from(self.group_blocks);
        ((b / gb) as usize, (b % gb) as u32)
    }

    fn base(&self, g: usize) -> u64 {
        g as u64 * u64::from(self.group_blocks)
    }

    /// The first free block in `[lo, hi)`.
    pub fn next_free(&self, lo: u64, hi: u64) -> Option<u64> {
        let hi = hi.min(self.blocks);
        let mut b = lo;
        while b < hi {
            let (g, off) = self.split(b);
            let group = &self.groups[g];
            let end = self
                .group_len(g)
                .min((hi - self.base(g)).min(u64::from(u32::MAX)) as u32);
            let found = match &group.bits {
                None => (group.sum.free > 0).then_some(off),
                Some(bits) => next_one(bits, off, end),
            };
            if let Some(i) = found {
                return Some(self.base(g) + u64::from(i));
            }
            b = self.base(self.next_group_with_free(g + 1)?);
        }
        None
    }

    /// The first group from `g` on with a free block, through the tree
    /// (`O(log groups)`): a hint deep in a used stretch (an extent page
    /// placed after the block it follows, at 10M extents) would otherwise
    /// step over every full group after it.
    fn next_group_with_free(&self, g: usize) -> Option<usize> {
        if g >= self.groups.len() {
            return None;
        }
        let mut i = self.leaves + g;
        if self.tree[i].best > 0 {
            return Some(g);
        }
        // Up until a right sibling holds a free block, then down to the
        // leftmost leaf below it that does.
        loop {
            if i == 1 {
                return None;
            }
            if i.is_multiple_of(2) && self.tree[i + 1].best > 0 {
                i += 1;
                break;
            }
            i /= 2;
        }
        while i < self.leaves {
            i = if self.tree[2 * i].best > 0 {
                2 * i
            } else {
                2 * i + 1
            };
        }
        Some(i - self.leaves)
    }

    /// The first block in `[lo, hi)` that is not free, or `hi`.
    pub fn next_used(&self, lo: u64, hi: u64) -> u64 {
        let hi = hi.min(self.blocks);
        let mut b = lo;
        while b < hi {
            let (g, off) = self.split(b);
            let group = &self.groups[g];
            let len = self.group_len(g);
            let end = len.min((hi - self.base(g)).min(u64::from(u32::MAX)) as u32);
            let found = match &group.bits {
                None if group.sum.free == len => end,
                None => off,
                Some(bits) => next_zero(bits, off, end),
            };
            if found < end {
                return self.base(g) + u64::from(found);
            }
            b = self.base(g + 1);
        }
        hi.max(lo)
    }

    /// The first block of the free run holding free block `b`.
    pub fn run_start(&self, b: u64) -> u64 {
        let (mut g, mut off) = self.split(b);
        loop {
            let group = &self.groups[g];
            let used = match &group.bits {
                None if group.sum.free > 0 => None,
                None => Some(off.saturating_sub(1)),
                Some(bits) => prev_zero(bits, off),
            };
            if let Some(z) = used {
                return self.base(g) + u64::from(z) + 1;
            }
            if g == 0 {
                return 0;
            }
            g -= 1;
            off = self.group_len(g);
        }
    }

    /// The coalesced free runs `(first block, blocks)` in `[lo, hi)`,
    /// clipped to it, in order.
    pub fn runs(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut b = lo;
        std::iter::from_fn(move || {
            let s = self.next_free(b, hi)?;
            let e = self.next_used(s, hi);
            b = e;
            Some((s, e - s))
        })
    }

    /// The `k` longest free runs `(first block, blocks)`, longest first,
    /// the lowest first block among equals. Visits each group's summary
    /// once and the bits only of a group whose longest run could make the
    /// list, so a device fragmented block by block costs one step per
    /// group once `k` runs are known, not one per run.
    pub fn largest_runs(&self, k: usize) -> Vec<(u64, u64)> {
        // A min-heap of the kept runs, the worst on top: shortest, then
        // the highest start (runs come in address order, so a later run
        // of equal length never displaces one kept).
        let mut kept: BinaryHeap<Reverse<(u64, Reverse<u64>)>> = BinaryHeap::new();
        let offer = |kept: &mut BinaryHeap<_>, start: u64, len: u64| {
            let run = Reverse((len, Reverse(start)));
            if kept.len() < k {
                kept.push(run);
            } else if kept.peek().is_some_and(|worst| run < *worst) {
                kept.pop();
                kept.push(run);
            }
        };
        let shortest_kept = |kept: &BinaryHeap<Reverse<(u64, Reverse<u64>)>>| {
            if kept.len() < k {
                0
            } else {
                kept.peek().map_or(u64::MAX, |Reverse((len, _))| *len)
            }
        };
        if k == 0 {
            return Vec::new();
        }
        // The start of a free run reaching the current group's first block.
        let mut open: Option<u64> = None;
        for (g, group) in self.groups.iter().enumerate() {
            let (base, len, sum) = (self.base(g), self.group_len(g), group.sum);
            if sum.free == len {
                open = open.or(Some(base));
                continue;
            }
            let start = open.take().unwrap_or(base);
            let end = base + u64::from(sum.prefix);
            if end > start {
                offer(&mut kept, start, end - start);
            }
            if let Some(bits) = &group.bits {
                let mut i = sum.prefix;
                let inner_end = len - sum.suffix;
                while u64::from(sum.largest) > shortest_kept(&kept) {
                    // At most `sum.largest`, so within u32.
                    let want = (shortest_kept(&kept) + 1) as u32;
                    let Some((s, e)) = next_run_at_least(bits, i, inner_end, inner_end, want)
                    else {
                        break;
                    };
                    offer(&mut kept, base + u64::from(s), u64::from(e - s));
                    i = e;
                }
            }
            if sum.suffix > 0 {
                open = Some(base + u64::from(len - sum.suffix));
            }
        }
        if let Some(start) = open {
            offer(&mut kept, start, self.blocks - start);
        }
        let mut runs: Vec<(u64, u64)> = kept
            .into_iter()
            .map(|Reverse((len, Reverse(start)))| (start, len))
            .collect();
        runs.sort_by_key(|&(start, len)| (Reverse(len), start));
        runs
    }

    /// Marks `[lo, hi)`, all free, used.
    pub fn set_used(&mut self, lo: u64, hi: u64) {
        self.set(lo, hi, false);
    }

    /// Marks `[lo, hi)`, all used, free.
    pub fn set_free(&mut self, lo: u64, hi: u64) {
        self.set(lo, hi, true);
    }

    fn set(&mut self, lo: u64, hi: u64, free: bool) {
        let mut b = lo;
        while b < hi {
            let (g, off) = self.split(b);
            let end = self
                .group_len(g)
                .min((hi - self.base(g)).min(u64::from(u32::MAX)) as u32);
            self.set_in_group(g, off, end, free);
            b = self.base(g) + u64::from(end);
        }
    }

    /// Flips `[l, h)` of group `g` and brings its summary, the index, the
    /// counts and the tree up to date, looking at no more of the group than
    /// the run it changes (and its prefix and suffix), except when it
    /// takes from the group's longest run.
    fn set_in_group(&mut self, g: usize, l: u32, h: u32, free: bool) {
        let len = self.group_len(g);
        let words = self.group_blocks as usize / 64;
        let group = &mut self.groups[g];
        let old = group.sum;
        if l < group.head_end {
            (group.head_end, group.head_max) = (0, 0);
        }
        let bits = group.bits.get_or_insert_with(|| {
            let mut bits = vec![0u64; words].into_boxed_slice();
            if old.free == len {
                fill(&mut bits, 0, len, true);
            }
            bits
        });
        let mut sum = old;
        if free {
            debug_assert_eq!(next_one(bits, l, h), None, "freeing free blocks");
            fill(bits, l, h, true);
            sum.free += h - l;
            let left = l > 0 && get(bits, l - 1);
            let right = h < len && get(bits, h);
            sum.runs = sum.runs + 1 - u32::from(left) - u32::from(right);
            // The free prefix and suffix before the change end the walks
            // over the run the freed blocks join in one step.
            let run_s = if !left {
                l
            } else if l <= old.prefix {
                0
            } else {
                prev_zero(bits, l).map_or(0, |z| z + 1)
            };
            let run_e = if !right {
                h
            } else if h >= len - old.suffix {
                len
            } else {
                next_zero(bits, h, len)
            };
            sum.largest = sum.largest.max(run_e - run_s);
            if run_s == 0 {
                sum.prefix = run_e;
            }
            if run_e == len {
                sum.suffix = len - run_s;
            }
        } else {
            debug_assert_eq!(next_zero(bits, l, h), h, "using used blocks");
            // Taking from the free prefix or suffix (a group filling from
            // the front takes from its suffix): no walk to its far end.
            let run_s = if l <= old.prefix {
                0
            } else {
                prev_zero(bits, l).map_or(0, |z| z + 1)
            };
            let run_e = if h >= len - old.suffix {
                len
            } else {
                next_zero(bits, h, len)
            };
            fill(bits, l, h, false);
            sum.free -= h - l;
            sum.runs = sum.runs - 1 + u32::from(l > run_s) + u32::from(h < run_e);
            if run_e - run_s == old.largest {
                // Its pieces, or a run outside it: the run itself needs
                // no second look.
                let head = group.head_max.max(largest_run(bits, group.head_end, run_s));
                (group.head_end, group.head_max) = (run_s, head);
                sum.largest = (l - run_s)
                    .max(run_e - h)
                    .max(head)
                    .max(largest_run(bits, run_e, len));
            }
            if run_s == 0 {
                sum.prefix = l;
            }
            if run_e == len {
                sum.suffix = len - h;
            }
        }
        if sum.free == 0 || sum.free == len {
            group.bits = None;
            (group.head_end, group.head_max) = (0, 0);
        }
        group.sum = sum;
        self.account(g, old, sum);
    }

    /// Group `g`'s summary went from `old` to `new`: the index, counts and
    /// tree follow.
    fn account(&mut self, g: usize, old: Summary, new: Summary) {
        if old.largest > 0 {
            self.by_largest.remove(&(old.largest, g as u32));
        }
        if new.largest > 0 {
            self.by_largest.insert((new.largest, g as u32));
        }
        self.free = self.free - u64::from(old.free) + u64::from(new.free);
        self.clipped_runs = self.clipped_runs - u64::from(old.runs) + u64::from(new.runs);
        if g > 0 {
            let before = self.groups[g - 1].sum.suffix > 0;
            self.joins -= u64::from(before && old.prefix > 0);
            self.joins += u64::from(before && new.prefix > 0);
        }
        if let Some(next) = self.groups.get(g + 1) {
            let after = next.sum.prefix > 0;
            self.joins -= u64::from(after && old.suffix > 0);
            self.joins += u64::from(after && new.suffix > 0);
        }
        let mut i = self.leaves + g;
        self.tree[i] = leaf(self.group_len(g), &new);
        while i > 1 {
            i /= 2;
            let node = Node::join(self.tree[2 * i], self.tree[2 * i + 1]);
            // Nothing above an unchanged node changes either.
            if self.tree[i] == node {
                break;
            }
            self.tree[i] = node;
        }
    }

    /// Best fit, approximately: in the group with the smallest largest
    /// (clipped) run of at least `want` blocks (the lowest such group), the
    /// smallest such run (the first among equals). `None` when no group
    /// holds one; a run crossing groups may still (see
    /// [`FreeBitmap::first_run_of`]).
    pub fn best_fit(&self, want: u64) -> Option<u64> {
        let want = u32::try_from(want).ok()?;
        let &(_, g) = self.by_largest.range((want, 0)..).next()?;
        let g = g as usize;
        let (len, group) = (self.group_len(g), &self.groups[g]);
        let Some(bits) = &group.bits else {
            return Some(self.base(g));
        };
        let mut best: Option<(u32, u32)> = None;
        // No run before `head_end` fits (its last block is used, so none
        // reaches past it): a group filling from the front is searched
        // from where it fills, not from its start.
        let mut i = if group.head_max < want {
            group.head_end
        } else {
            0
        };
        let tail = len - group.sum.suffix;
        while let Some((s, e)) = next_run_at_least(bits, i, len, tail, want) {
            if best.is_none_or(|(l, _)| e - s < l) {
                best = Some((e - s, s));
                if e - s == want {
                    break;
                }
            }
            i = e;
        }
        best.map(|(_, s)| self.base(g) + u64::from(s))
    }

    /// The first block of the first free run of at least `want` blocks,
    /// runs crossing groups included.
    pub fn first_run_of(&self, want: u64) -> Option<u64> {
        if want == 0 || self.tree[1].best < want {
            return None;
        }
        let (mut node, mut offset) = (1, 0u64);
        while node < self.leaves {
            let (l, r) = (self.tree[2 * node], self.tree[2 * node + 1]);
            if l.best >= want {
                node *= 2;
            } else if l.suffix + r.prefix >= want {
                return Some(offset + l.len - l.suffix);
            } else {
                offset += l.len;
                node = 2 * node + 1;
            }
        }
        // A run inside this group: one reaching into it from the previous
        // group would have been found at their common ancestor.
        let g = node - self.leaves;
        let Some(bits) = &self.groups[g].bits else {
            return Some(self.base(g));
        };
        let want = u32::try_from(want).ok()?;
        let (len, sum) = (self.group_len(g), self.groups[g].sum);
        next_run_at_least(bits, 0, len, len - sum.suffix, want)
            .map(|(s, _)| self.base(g) + u64::from(s))
    }

    /// Compares everything kept per group and over groups with what the
    /// bits say.
    pub fn check(&self) -> Result<(), String> {
        let mut by_largest = BTreeSet::new();
        let (mut free, mut runs, mut joins) = (0u64, 0u64, 0u64);
        for (g, group) in self.groups.iter().enumerate() {
            let len = self.group_len(g);
            let want = match &group.bits {
                None => {
                    if group.sum.free != 0 && group.sum.free != len {
                        return Err(format!(
                            "group {g} has no bitmap but {} of {len} blocks free",
                            group.sum.free
                        ));
                    }
                    Summary::uniform(len, group.sum.free == len)
                }
                Some(bits) => {
                    if next_one(bits, len, self.group_blocks).is_some() {
                        return Err(format!("group {g} has free bits past its end"));
                    }
                    let sum = summarize(bits, len);
                    if sum.free == 0 || sum.free == len {
                        return Err(format!("group {g} keeps a bitmap for uniform space"));
                    }
                    let end = group.head_end;
                    if end > 0
                        && (get(bits, end - 1) || largest_run(bits, 0, end) != group.head_max)
                    {
                        return Err(format!("group {g}'s longest run before {end} is stale"));
                    }
                    sum
                }
            };
            if want != group.sum {
                return Err(format!(
                    "group {g} summary {:?}, its blocks say {want:?}",
                    group.sum
                ));
            }
            if want.largest > 0 {
                by_largest.insert((want.largest, g as u32));
            }
            free += u64::from(want.free);
            runs += u64::from(want.runs);
            if g > 0 && self.groups[g - 1].sum.suffix > 0 && want.prefix > 0 {
                joins += 1;
            }
            if self.tree[self.leaves + g] != leaf(len, &want) {
                return Err(format!("group {g}'s tree leaf is stale"));
            }
        }
        if by_largest != self.by_largest {
            return Err("index by largest run differs from the groups".into());
        }
        if (free, runs, joins) != (self.free, self.clipped_runs, self.joins) {
            return Err(format!(
                "counts (free, runs, joins) {:?}, groups say {:?}",
                (self.free, self.clipped_runs, self.joins),
                (free, runs, joins)
            ));
        }
        if self.tree[self.leaves + self.groups.len()..]
            .iter()
            .any(|n| *n != Node::default())
        {
            return Err("a padding leaf of the tree is not empty".into());
        }
        for i in (1..self.leaves).rev() {
            if self.tree[i] != Node::join(self.tree[2 * i], self.tree[2 * i + 1]) {
                return Err(format!("tree node {i} is stale"));
            }
        }
        Ok(())
    }

    /// Heap bytes the bitmaps, summaries, index and tree take (the index
    /// estimated by [`btree_heap_bytes`]).
    pub fn memory_bytes(&self) -> usize {
        let bitmaps: usize = self
            .groups
            .iter()
            .filter_map(|g| g.bits.as_ref())
            .map(|bits| std::mem::size_of_val(&**bits))
            .sum();
        bitmaps
            + self.groups.capacity() * std::mem::size_of::<Group>()
            + btree_heap_bytes(self.by_largest.len(), std::mem::size_of::<(u32, u32)>())
            + self.tree.capacity() * std::mem::size_of::<Node>()
    }
}

/// Builds a [`FreeBitmap`] from used ranges given in any order, without
/// keeping the summaries up to date until [`Builder::finish`].
#[derive(Debug)]
pub struct Builder {
    blocks: u64,
    group_blocks: u32,
    /// Per group: its bits, `None` while all free or all used (`free`
    /// says which), so that a device of large extents needs no bitmap
    /// while it is built either.
    bits: Vec<Option<Box<[u64]>>>,
    free: Vec<u32>,
}

impl Builder {
    /// `blocks` blocks, all free.
    ///
    /// # Panics
    /// If `group_blocks` is not a positive multiple of 64.
    pub fn new(blocks: u64, group_blocks: u32) -> Builder {
        assert!(
            group_blocks > 0 && group_blocks.is_multiple_of(64),
            "group of {group_blocks} blocks"
        );
        let groups = blocks.div_ceil(u64::from(group_blocks)) as usize;
        Builder {
            blocks,
            group_blocks,
            bits: vec![None; groups],
            free: (0..groups)
                .map(|g| group_len(blocks, group_blocks, g))
                .collect(),
        }
    }

    /// Marks `[lo, hi)` used. Fails, returning the first block of it
    /// already used, if any is; blocks before that one are then used.
    pub fn claim(&mut self, lo: u64, hi: u64) -> Result<(), u64> {
        let gb = u64::from(self.group_blocks);
        let words = self.group_blocks as usize / 64;
        let mut b = lo;
        while b < hi {
            let g = (b / gb) as usize;
            let base = g as u64 * gb;
            let len = group_len(self.blocks, self.group_blocks, g);
            let l = (b % gb) as u32;
            let h = (hi - base).min(u64::from(len)) as u32;
            let free = &mut self.free[g];
            let used = match &mut self.bits[g] {
                None if *free == 0 => l,
                None if h - l == len => h,
                bits => {
                    let all_free = *free == len;
                    let bits = bits.get_or_insert_with(|| {
                        let mut bits = vec![0u64; words].into_boxed_slice();
                        fill(&mut bits, 0, len, all_free);
                        bits
                    });
                    let used = next_zero(bits, l, h);
                    fill(bits, l, used, false);
                    used
                }
            };
            *free -= used - l;
            if *free == 0 {
                self.bits[g] = None;
            }
            if used < h {
                return Err(base + u64::from(used));
            }
            b = base + u64::from(h);
        }
        Ok(())
    }

    pub fn finish(self) -> FreeBitmap {
        let Builder {
            blocks,
            group_blocks,
            bits,
            free,
        } = self;
        let leaves = bits.len().next_power_of_two().max(2);
        let mut map = FreeBitmap {
            blocks,
            group_blocks,
            groups: Vec::with_capacity(bits.len()),
            by_largest: BTreeSet::new(),
            tree: vec![Node::default(); 2 * leaves],
            leaves,
            free: 0,
            clipped_runs: 0,
            joins: 0,
        };
        for (g, (bits, free)) in bits.into_iter().zip(free).enumerate() {
            let len = group_len(blocks, group_blocks, g);
            let (sum, bits) = match bits {
                None => (Summary::uniform(len, free == len), None),
                Some(bits) => {
                    let sum = summarize(&bits, len);
                    let mixed = sum.free != 0 && sum.free != len;
                    (sum, mixed.then_some(bits))
                }
            };
            if sum.largest > 0 {
                map.by_largest.insert((sum.largest, g as u32));
            }
            map.free += u64::from(sum.free);
            map.clipped_runs += u64::from(sum.runs);
            if map.groups.last().is_some_and(|p: &Group| p.sum.suffix > 0) && sum.prefix > 0 {
                map.joins += 1;
            }
            map.tree[leaves + g] = leaf(len, &sum);
            map.groups.push(Group {
                bits,
                sum,
                head_end: 0,
                head_max: 0,
            });
        }
        for i in (1..leaves).rev() {
            map.tree[i] = Node::join(map.tree[2 * i], map.tree[2 * i + 1]);
        }
        map
    }
}

/// Heap bytes of a std `BTreeMap`/`BTreeSet` of `entries` entries of
/// `entry_bytes` (key and value), estimated: nodes of 11 entries, two
/// thirds full (in-order inserts leave them about half full, random ones
/// about three quarters), each with its parent link and counts, and one
/// internal node (12 child links more) per six leaves. For the free-space
/// allocators' own figure (`Allocator::memory_bytes`), and the same
/// formula gives what the tree of free ranges it replaced took: two trees
/// of 16-byte entries, about 55 bytes per free range.
pub fn btree_heap_bytes(entries: usize, entry_bytes: usize) -> usize {
    const CAPACITY: usize = 11;
    let leaf = 16 + CAPACITY * entry_bytes;
    let leaves = (entries * 3).div_ceil(2 * CAPACITY);
    leaves * leaf + leaves.div_ceil(6) * (leaf + (CAPACITY + 1) * 8)
}

fn group_len(blocks: u64, group_blocks: u32, g: usize) -> u32 {
    let start = g as u64 * u64::from(group_blocks);
    blocks.saturating_sub(start).min(u64::from(group_blocks)) as u32
}

fn leaf(len: u32, sum: &Summary) -> Node {
    Node {
        len: u64::from(len),
        prefix: u64::from(sum.prefix),
        suffix: u64::from(sum.suffix),
        best: u64::from(sum.largest),
    }
}

/// A group's summary from its bits, in one pass over its words plus one
/// step per run.
fn summarize(bits: &[u64], len: u32) -> Summary {
    let mut runs = 0;
    let mut carry = 0u64;
    for &x in bits {
        runs += (x & !((x << 1) | carry)).count_ones();
        carry = x >> 63;
    }
    Summary {
        free: bits.iter().map(|x| x.count_ones()).sum(),
        runs,
        largest: largest_run(bits, 0, len),
        prefix: next_zero(bits, 0, len),
        suffix: len - prev_zero(bits, len).map_or(0, |z| z + 1),
    }
}

/// The longest run of set bits in `[lo, hi)`, a word at a time: a word
/// all set or all clear is one step, any other as many as its own longest
/// run, so a group fragmented block by block costs about one step per
/// word, not per run (this runs whenever an allocation takes from a
/// group's longest run).
fn largest_run(bits: &[u64], lo: u32, hi: u32) -> u32 {
    let (mut best, mut cur) = (0u32, 0u32);
    let mut w = lo / 64;
    while w * 64 < hi {
        let mut x = bits[w as usize];
        if w == lo / 64 {
            x &= !0u64 << (lo % 64);
        }
        if hi - w * 64 < 64 {
            x &= (1u64 << (hi - w * 64)) - 1;
        }
        w += 1;
        if x == !0 {
            cur += 64;
            continue;
        }
        best = best.max(cur + x.trailing_ones());
        let (mut y, mut inside) = (x, 0);
        while y != 0 {
            y &= y >> 1;
            inside += 1;
        }
        best = best.max(inside);
        cur = x.leading_ones();
    }
    best.max(cur)
}

/// The first run of at least `want` set bits starting in `[from, len)`,
/// `(start, end)`, where `[tail, len)` is known to be set (the group's
/// free suffix: its end is not looked for, so the run an emptying group
/// fills from costs no walk over it). A word whose runs from the start
/// point on are all shorter than `want` and end inside it is passed over
/// in a few steps, so a fragmented stretch costs about a step per word,
/// not per run.
fn next_run_at_least(
    bits: &[u64],
    from: u32,
    len: u32,
    tail: u32,
    want: u32,
) -> Option<(u32, u32)> {
    let mut i = from;
    loop {
        let s = next_one(bits, i, len)?;
        if s >= tail {
            return (len - s >= want).then_some((s, len));
        }
        let w = s / 64;
        let x = bits[w as usize] & (!0u64 << (s % 64));
        if x >> 63 == 0 && !has_run(x, want) {
            i = (w + 1) * 64;
            continue;
        }
        let e = next_zero(bits, s, len);
        if e - s >= want {
            return Some((s, e));
        }
        i = e;
    }
}

/// Whether `x` has `want` consecutive set bits.
fn has_run(x: u64, want: u32) -> bool {
    if want > 64 {
        return false;
    }
    // After each step, bit i of `m` says bits i..i + k are all set.
    let (mut m, mut k) = (x, 1);
    while k < want && m != 0 {
        let step = k.min(want - k);
        m &= m >> step;
        k += step;
    }
    m != 0
}

fn get(bits: &[u64], i: u32) -> bool {
    bits[(i / 64) as usize] >> (i % 64) & 1 == 1
}

/// Sets bits `[lo, hi)` to `value`.
fn fill(bits: &mut [u64], lo: u32, hi: u32, value: bool) {
    let mut i = lo;
    while i < hi {
        let w = (i / 64) as usize;
        let n = (hi - i).min(64 - i % 64);
        let mask = if n == 64 {
            !0
        } else {
            ((1u64 << n) - 1) << (i % 64)
        };
        if value {
            bits[w] |= mask;
        } else {
            bits[w] &= !mask;
        }
        i += n;
    }
}

/// The first set bit in `[from, to)`.
fn next_one(bits: &[u64], from: u32, to: u32) -> Option<u32> {
    next_where(bits, from, to, false)
}

/// The first clear bit in `[from, to)`, or `to`.
fn next_zero(bits: &[u64], from: u32, to: u32) -> u32 {
    next_where(bits, from, to, true).unwrap_or(to)
}

fn next_where(bits: &[u64], from: u32, to: u32, invert: bool) -> Option<u32> {
    if from >= to {
        return None;
    }
    let flip = if invert { !0 } else { 0 };
    let mut w = (from / 64) as usize;
    let mut x = (bits[w] ^ flip) & (!0u64 << (from % 64));
    loop {
        if x != 0 {
            let i = w as u32 * 64 + x.trailing_zeros();
            return (i < to).then_some(i);
        }
        w += 1;
        if w as u32 * 64 >= to {
            return None;
        }
        x = bits[w] ^ flip;
    }
}

/// The last clear bit before `before`.
fn prev_zero(bits: &[u64], before: u32) -> Option<u32> {
    let last = before.checked_sub(1)?;
    let mut w = (last / 64) as usize;
    let mut x = !bits[w] & (!0u64 >> (63 - last % 64));
    loop {
        if x != 0 {
            return Some(w as u32 * 64 + 63 - x.leading_zeros());
        }
        w = w.checked_sub(1)?;
        x = !bits[w];
    }
}
