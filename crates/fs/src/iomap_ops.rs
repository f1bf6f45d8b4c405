//! The file system's answers to the iomap engine: mappings, allocation of
//! unwritten space, and write completion (conversion and size, journaled).

use iomap::align::align_down;
use iomap::sharded_rwlock::ShardedWriteGuard;

use iomap::{EndIo, Iomap, IomapError, IomapFlags, IomapKind, IomapOpFlags, IomapOps};

use crate::extent_map::Lookup;
use crate::mount_state::{Meta, OpenInode, VolumeInner};
use crate::types::{ExtentState, Ino, Record};
use crate::{Error, Result};

impl VolumeInner {
    /// Runs `allocate` under the metadata write lock. Space freed by
    /// changes that no checkpoint holds yet stays busy (reusing it could
    /// expose new data in its old owner after a crash or a lost journal
    /// tail); when an allocation fails while space is busy, or while a
    /// checkpoint runs ([`VolumeInner::space_may_come_back`]), checkpoint
    /// to release it and try once more. Returns
    /// the lock still held, so the caller sees the state it allocated in.
    ///
    /// While mount's scan rebuilds free space, `allocate` gets
    /// [`Error::FreeSpacePending`] before it changes anything if it needs
    /// the allocator (an overwrite does not), or ENOSPC from the clean
    /// unmount's reserve (`free_space::Reserve`): the lock is dropped, the
    /// scan waited for, and `allocate` run again.
    pub(crate) fn with_busy_retry<T>(
        &self,
        mut allocate: impl FnMut(&mut Meta) -> Result<T>,
    ) -> Result<(ShardedWriteGuard<'_, Meta>, T)> {
        let mut meta = self.meta.write();
        let mut attempt = allocate(&mut meta);
        while matches!(&attempt, Err(e) if meta.alloc.waits_for_scan(e)) {
            drop(meta);
            self.wait_free_space();
            meta = self.meta.write();
            attempt = allocate(&mut meta);
        }
        match attempt {
            Err(e)
                if matches!(e.root(), Error::NoSpace { .. }) && self.space_may_come_back(&meta) =>
            {
                drop(meta);
                self.checkpoint()?;
                let mut meta = self.meta.write();
                let value = allocate(&mut meta)?;
                Ok((meta, value))
            }
            Err(e) => Err(e),
            Ok(value) => Ok((meta, value)),
        }
    }
}

impl VolumeInner {
    /// Whether a checkpoint may give back what an allocation or the room
    /// for the next bases found short: space is busy (freed by changes
    /// no checkpoint holds yet), or a checkpoint runs (a base in flight
    /// holds its new pages out of free space, and the space it frees
    /// comes back only after it is durable).
    fn space_may_come_back(&self, meta: &Meta) -> bool {
        meta.alloc.busy_bytes() > 0 || self.checkpointing.is_locked()
    }

    /// Runs a metadata change that refuses, changing nothing, when the
    /// next base's room is short; when it is and space may come back
    /// ([`VolumeInner::space_may_come_back`]), checkpoints and tries once
    /// more, as allocations do ([`VolumeInner::with_busy_retry`]): ENOSPC
    /// only when space is really short.
    pub(crate) fn retry_if_busy<T>(&self, mut change: impl FnMut() -> Result<T>) -> Result<T> {
        let mut attempt = change();
        // Short only of the reserve the scan's allocator replaces.
        while matches!(&attempt, Err(e) if self.meta.read().alloc.waits_for_scan(e)) {
            self.wait_free_space();
            attempt = change();
        }
        match attempt {
            Err(e)
                if matches!(e.root(), Error::NoSpace { .. })
                    && self.space_may_come_back(&self.meta.read()) =>
            {
                self.checkpoint()?;
                change()
            }
            other => other,
        }
    }
}

/// Places unwritten space in every hole of `[start, end)` (block-aligned),
/// all or nothing: the free-space and metadata checks come before any change.
/// Returns whether anything was allocated.
///
/// `writeback`: the holes are a buffered write's delayed ranges, which hold
/// their room already ([`crate::delalloc`]); the whole delayed range around
/// the request is placed at once (its extents then number one per range
/// but where whole free ranges are taken, as the room counts), and nothing
/// is refused that the reservation covers.
pub(crate) fn allocate_holes(
    vol: &VolumeInner,
    meta: &mut Meta,
    ino: Ino,
    mut start: u64,
    mut end: u64,
    writeback: bool,
) -> Result<bool> {
    if writeback {
        if let Some((s, _)) = meta.delalloc_around(ino, start) {
            start = start.min(s);
        }
        if let Some((_, e)) = meta.delalloc_around(ino, end - 1) {
            end = end.max(e);
        }
    }
    let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
    // What the holes' search, the hints and the records read and change.
    inode.extents.load_for_change(start, end)?;
    let holes = inode.extents.holes_in(start, end - start);
    if holes.is_empty() {
        return Ok(false);
    }
    let needed: u64 = holes.iter().map(|&(_, len)| len).sum();
    // Space a buffered write reserved in this range is this allocation's.
    let reserved = meta.delalloc_within(ino, start, end);
    let held = writeback && meta.extent_pages && reserved == needed;
    if !held {
        // The room the next base needs once these extents are in the map
        // stays free: a few per hole, or where no free range holds them
        // all, one more per free range each hole may take whole (a piece
        // shorter than asked is the largest free range, taken whole).
        let fit = needed <= meta.alloc.allocator()?.largest_free_extent();
        let pieces = if fit {
            holes.len() as u64
        } else {
            let blocks = needed / u64::from(vol.block_size);
            holes.len() as u64 + blocks.min(meta.alloc.allocator()?.free_extent_count() as u64)
        };
        let estimate = holes.len() as u64 * crate::limits::EXTENTS_PER_HOLE_ESTIMATE;
        let growth = meta.growth_for_extents(ino, pieces.max(estimate));
        let available = meta.unreserved_bytes_after(growth)? + reserved;
        if needed > available {
            return Err(Error::NoSpace {
                what: format!("inode {ino} file range {start}..{end}"),
                needed,
                available,
            });
        }
        meta.reserve_base(&vol.sb, growth)?;
    }
    let block = u64::from(vol.block_size);
    let mut pieces = Vec::new();
    for (hole_start, hole_len) in holes {
        let hole_end = hole_start + hole_len;
        let mut cur = hole_start;
        while cur < hole_end {
            // Keep the file contiguous on the device when the space allows.
            let hint = if cur == hole_start && cur >= block {
                match meta.state.inode(ino).map(|i| i.extents.lookup(cur - block)) {
                    Some(Lookup::Extent(e)) => Some(e.addr + (cur - e.file_off)),
                    _ => None,
                }
            } else {
                pieces
                    .last()
                    .map(|&(_, addr, len): &(u64, u64, u64)| addr + len)
            };
            let Some((addr, len)) = meta.alloc.allocator_mut()?.alloc(hole_end - cur, hint) else {
                give_back(meta, &pieces);
                return Err(Error::NoSpace {
                    what: format!("inode {ino} file offset {cur}"),
                    needed: hole_end - cur,
                    available: 0,
                });
            };
            pieces.push((cur, addr, len));
            cur += len;
        }
    }
    if held {
        meta.release_placed_holds(ino, start, end);
    }
    meta.release_delalloc(ino, start, end);
    for (file_off, addr, len) in pieces {
        meta.log(Record::MapUnwritten {
            ino,
            file_off,
            len,
            addr,
        })?;
    }
    vol.ask_commit_if_due(meta);
    Ok(true)
}

/// Returns pieces allocated but not logged to free space.
fn give_back(meta: &mut Meta, pieces: &[(u64, u64, u64)]) {
    for &(_, addr, len) in pieces {
        meta.alloc
            .free_now(addr, len)
            .expect("a piece just allocated is used space");
    }
}

/// Every byte of `[pos, pos+len)` is written data before `limit`.
fn is_written_before(inode: &crate::state::InodeState, pos: u64, len: u64, limit: u64) -> bool {
    let end = pos + len;
    if end > limit {
        return false;
    }
    let mut cur = pos;
    while cur < end {
        match inode.extents.lookup(cur) {
            Lookup::Extent(e) if e.state == ExtentState::Written => cur = e.file_end(),
            _ => return false,
        }
    }
    true
}

/// The answer for a hole in the extent map at `pos` (ending by `end`): a
/// delayed allocation where a buffered write reserved it, else a hole up
/// to the next reservation. Both read as zeros; only a hole has no data
/// (`lseek(SEEK_HOLE)` goes by it).
fn hole_or_delalloc(meta: &Meta, ino: Ino, pos: u64, end: u64) -> Iomap {
    let (kind, end) = match meta.delalloc_end(ino, pos) {
        Some(d) => (IomapKind::Delalloc, end.min(d)),
        None => (
            IomapKind::Hole,
            meta.delalloc_start_after(ino, pos)
                .map_or(end, |d| end.min(d)),
        ),
    };
    Iomap {
        offset: pos,
        length: end - pos,
        kind,
        addr: 0,
        flags: IomapFlags::EMPTY,
    }
}

impl VolumeInner {
    /// A buffered write's mapping: space for every hole of the range is
    /// reserved first (delayed allocation, all or nothing), then the mapping
    /// at `pos` is answered as it is — written, unwritten or delalloc. The
    /// data reaches the device at writeback, which allocates.
    fn begin_buffered_write(&self, inode: &OpenInode, pos: u64, len: u64) -> Result<Iomap> {
        let block = u64::from(self.block_size);
        let ino = inode.ino;
        let start = align_down(pos, block);
        let end = (pos + len).next_multiple_of(block);
        self.load_before_change(ino, start, end)?;
        let (meta, ()) =
            self.with_busy_retry(|meta| meta.reserve_delalloc(&self.sb, ino, start, end))?;
        let state = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        Ok(match state.extents.lookup(pos) {
            Lookup::Extent(e) => Iomap {
                offset: pos,
                length: e.file_end().min(pos + len) - pos,
                kind: match e.state {
                    ExtentState::Written => IomapKind::Mapped,
                    ExtentState::Unwritten => IomapKind::Unwritten,
                },
                addr: e.addr + (pos - e.file_off),
                flags: IomapFlags::EMPTY,
            },
            Lookup::Hole { end: hole_end } => {
                hole_or_delalloc(&meta, ino, pos, hole_end.unwrap_or(u64::MAX).min(pos + len))
            }
        })
    }
}

impl IomapOps for VolumeInner {
    type Inode = OpenInode;
    type Error = Error;

    fn begin(&self, inode: &OpenInode, pos: u64, len: u64, flags: IomapOpFlags) -> Result<Iomap> {
        let block = u64::from(self.block_size);
        let ino = inode.ino;
        let writing = flags.contains(IomapOpFlags::WRITE);
        let overwrite_only =
            flags.contains(IomapOpFlags::OVERWRITE_ONLY) || flags.contains(IomapOpFlags::NOWAIT);
        if writing && !flags.contains(IomapOpFlags::DIRECT) && !overwrite_only {
            return self.begin_buffered_write(inode, pos, len);
        }
        // Only allocation changes metadata: every other answer is a lookup
        // under the shared side of the metadata lock.
        let mut new = false;
        let meta = if writing && !overwrite_only {
            let start = align_down(pos, block);
            let end = (pos + len).next_multiple_of(block);
            let writeback = flags.contains(IomapOpFlags::WRITEBACK);
            self.load_before_change(ino, start, end)?;
            let (meta, allocated) = self.with_busy_retry(|meta| {
                if !writeback {
                    // This write's completion splits the unwritten extents
                    // its ends fall in: held now, so that this write is
                    // refused rather than the completion left unchecked
                    // (writeback's were held by the buffered write).
                    let held = meta.hold_direct_splits(&self.sb, ino, start, end)?;
                    // A write refused changes nothing, its hold included.
                    return allocate_holes(self, meta, ino, start, end, false)
                        .inspect_err(|_| meta.unhold_direct_splits(ino, held));
                }
                allocate_holes(self, meta, ino, start, end, writeback)
            })?;
            new = allocated;
            meta.downgrade()
        } else {
            self.meta.read()
        };
        let dirty_inode = meta.is_dirty(ino);
        let state = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        // The lookup at `pos` reads the one chunk owning it (a hole's end
        // is the next chunk's first key, known without reading); an
        // overwrite's check reads the whole range. Loaded under the shared
        // lock, through the chunk's shared cell.
        let keys_end = if writing && overwrite_only { len } else { 1 };
        state.extents.load_keys(pos, pos.saturating_add(keys_end))?;
        let size = state.size;
        // How far an overwrite may map: EOF, or the end of EOF's device
        // block for a read-modify-write's padding (which is not data: the
        // size does not change).
        let overwrite_limit = if overwrite_only && flags.contains(IomapOpFlags::PADDED_TAIL) {
            size.next_multiple_of(u64::from(self.dev.caps().logical_block_size))
        } else {
            size
        };
        if writing && overwrite_only && !is_written_before(state, pos, len, overwrite_limit) {
            // Decided for the whole request before any data moves: a write
            // that started under the shared lock and then needed allocation
            // would already have changed bytes when its retry hit ENOSPC.
            return Err(IomapError::WouldBlock.into());
        }
        let lookup = state.extents.lookup(pos);
        let mut iomap = match lookup {
            Lookup::Extent(e) => {
                let end = e.file_end().min(pos + len);
                Iomap {
                    offset: pos,
                    length: end - pos,
                    kind: match e.state {
                        ExtentState::Written => IomapKind::Mapped,
                        ExtentState::Unwritten => IomapKind::Unwritten,
                    },
                    addr: e.addr + (pos - e.file_off),
                    flags: IomapFlags::EMPTY,
                }
            }
            Lookup::Hole { end } => {
                if writing {
                    if overwrite_only {
                        return Err(IomapError::WouldBlock.into());
                    }
                    return Err(IomapError::BadMapping {
                        pos,
                        reason: "hole left after allocation".to_string(),
                    }
                    .into());
                }
                hole_or_delalloc(&meta, ino, pos, end.unwrap_or(u64::MAX).min(pos + len))
            }
        };
        if writing {
            let crosses_eof = iomap.end() > overwrite_limit;
            if overwrite_only && (iomap.kind != IomapKind::Mapped || crosses_eof) {
                return Err(IomapError::WouldBlock.into());
            }
            if new && iomap.kind == IomapKind::Unwritten {
                iomap.flags |= IomapFlags::NEW;
            }
            if iomap.kind == IomapKind::Unwritten || crosses_eof || dirty_inode {
                iomap.flags |= IomapFlags::DIRTY;
            }
        }
        Ok(iomap)
    }

    fn simple_read_addr(&self, inode: &OpenInode, pos: u64, len: u64) -> Option<u64> {
        let meta = self.meta.read();
        let state = meta.state.inode(inode.ino)?;
        if pos.checked_add(len)? > state.size {
            return None;
        }
        // A chunk that does not load: the generic path reports it.
        state.extents.load_keys(pos, pos + len).ok()?;
        match state.extents.lookup(pos) {
            Lookup::Extent(e) if e.state == ExtentState::Written && pos + len <= e.file_end() => {
                Some(e.addr + (pos - e.file_off))
            }
            _ => None,
        }
    }

    fn size(&self, inode: &OpenInode) -> Result<u64> {
        let meta = self.meta.read();
        meta.size_in_core(inode.ino)
            .ok_or(Error::Stale { ino: inode.ino })
    }

    fn disk_size(&self, inode: &OpenInode) -> Result<u64> {
        let meta = self.meta.read();
        meta.state
            .inode(inode.ino)
            .map(|i| i.size)
            .ok_or(Error::Stale { ino: inode.ino })
    }

    fn extend_size_in_core(&self, inode: &OpenInode, size: u64) -> Result<()> {
        let mut meta = self.meta.write();
        let current = meta
            .size_in_core(inode.ino)
            .ok_or(Error::Stale { ino: inode.ino })?;
        if size > current {
            meta.size_in_core.insert(inode.ino, size);
        }
        Ok(())
    }

    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn end_io(&self, inode: &OpenInode, end_io: &EndIo) -> Result<()> {
        let EndIo {
            pos,
            len,
            convert,
            new_size,
            direct,
        } = *end_io;
        if (!convert && new_size.is_none()) || len == 0 {
            return Ok(());
        }
        let block = u64::from(self.block_size);
        let end = pos + len;
        let min_size = new_size.unwrap_or(0);
        let (file_off, conv_len) = if convert {
            let start = align_down(pos, block);
            (start, end.next_multiple_of(block) - start)
        } else {
            (align_down(pos, block), 0)
        };
        let mut meta = self.meta.write();
        // The record carries the write's own time, if not logged yet;
        // completing never sets a time of its own (see `write_times`).
        let write_time = inode.take_write_time();
        meta.log(Record::CompleteWrite {
            ino: inode.ino,
            file_off,
            len: conv_len,
            min_size,
            mtime_ns: write_time.map_or(0, |t| t.as_ns()),
        })?;
        if direct && convert {
            meta.release_direct_splits(inode.ino, file_off, file_off + conv_len);
        }
        self.ask_commit_if_due(&meta);
        Ok(())
    }

    fn commit(&self) -> Result<()> {
        VolumeInner::commit(self)
    }
}
