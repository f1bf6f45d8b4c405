//! Buffered I/O: reads and writes through the folio cache.
//!
//! A read copies from folios, filling the blocks that are not uptodate from
//! the device first (a fresh folio is filled whole: that is the readahead).
//! A write reserves space for its whole range first (the file system places
//! it later, at writeback: delayed allocation), so ENOSPC comes from the
//! write that causes it and never from writeback; then it makes only its
//! partial edge blocks uptodate — reading them, or zeroing them where the
//! file holds no data (hole, unwritten, delalloc, past EOF) — copies, and
//! marks the blocks dirty. The in-core size rises at once; the on-disk size
//! rises only when writeback completes (invariant 4).
//!
//! Both hold the inode's I/O lock shared, so truncate, punch and other
//! exclusive operations exclude them; readers and writers of different
//! folios of one file run concurrently, each folio under its own lock.
//! Writes that extend the file take the lock exclusively (see [`write()`]).
//!
//! A sequential writer's bytes are written back behind it, a chunk at a
//! time, by the cache's write-behind thread ([`write_behind`]).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::dio::{logical_block_size, read_segments, ReadSegment};
use crate::folio::{Folio, FolioState, MAX_FOLIO_BYTES};
use crate::folio_cache::Mapping;
use crate::writeback::write_back;
use crate::{FileError, IomapError, IomapFile, IomapIter, IomapOpFlags, IomapOps};

/// Smallest readahead: the first folio a sequential reader gets.
pub const READAHEAD_START_BYTES: usize = 16 << 10;

/// How many times a throttled writer waits for background writeback to
/// bring dirty bytes under the limit before it goes on (each wait ends
/// when dirty bytes drop, or after [`THROTTLE_WAIT`]).
const THROTTLE_WAITS: u32 = 50;
const THROTTLE_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

pub(crate) fn block_bytes<O: IomapOps>(ops: &O) -> usize {
    (ops.block_size() as usize).max(512)
}

/// Reads up to `buf.len()` bytes at `pos` through the cache; returns the
/// bytes read (short at EOF).
pub fn read<F: IomapFile>(file: &F, pos: u64, buf: &mut [u8]) -> Result<usize, FileError<F>> {
    file.check_io(pos, buf.len() as u64, false)?;
    let (ops, inode, mapping) = (file.ops(), file.inode(), file.mapping());
    let _shared = file.as_ref().lock_shared();
    let size = ops.size(inode)?;
    if buf.is_empty() || pos >= size {
        return Ok(0);
    }
    let end = pos.saturating_add(buf.len() as u64).min(size);
    let window = readahead_window(mapping, pos, end);
    crate::readahead::schedule(file, end, window, size);
    let len = (end - pos) as usize;
    if mapping.copy_cached(pos, &mut buf[..len]) {
        return Ok(len);
    }
    // Folios past EOF would read nothing: no larger than EOF needs.
    let want = |cur: u64| {
        ((end - cur) as usize)
            .max(window)
            .min((size - cur).next_power_of_two().min(MAX_FOLIO_BYTES as u64) as usize)
    };
    each_folio(file, pos, end, want, |folio, state, from, to| {
        let blocks = if state.uptodate.any() {
            folio.blocks_of(from, to)
        } else {
            // A fresh folio is read whole: the readahead.
            folio.blocks_of(0, folio.len())
        };
        fill(file, folio, state, blocks, size)?;
        let at = (folio.pos() + from as u64 - pos) as usize;
        buf[at..at + (to - from)].copy_from_slice(&state.data[from..to]);
        Ok(())
    })?;
    Ok((end - pos) as usize)
}

/// The folio size a read at `pos` asks for: growing while the reads are
/// sequential, up to the largest folio; nothing extra for a random read.
fn readahead_window(mapping: &Mapping, pos: u64, end: u64) -> usize {
    let seq = &mapping.shared.sequential;
    let window = advance(
        &seq.next_pos,
        &seq.window,
        pos,
        end,
        first_window(end - pos),
    );
    if window == 0 {
        // A new run starts: what was read ahead for the old one says
        // nothing about it.
        mapping.shared.readahead_end.store(0, Ordering::Relaxed);
    }
    window
}

/// The folio size a write at `pos` asks for, growing the same way, from
/// four times the write as for reads. Doubling from
/// [`READAHEAD_START_BYTES`] alone, a 1 MiB writer put its first 8 MiB in
/// 1 MiB folios, whose memory (unlike a 2 MiB folio's huge page) is not
/// physically contiguous: a loop device took each one's writeback as two
/// 512 KiB requests, through an io_uring worker thread.
fn write_window(mapping: &Mapping, pos: u64, end: u64) -> usize {
    let seq = &mapping.shared.sequential;
    advance(
        &seq.next_write_pos,
        &seq.write_window,
        pos,
        end,
        first_window(end - pos),
    )
}

/// The smallest window of a sequential reader or writer of `len` bytes:
/// four times the access, as the kernel's first readahead of a sequential
/// reader (`get_init_ra_size`). Doubling from [`READAHEAD_START_BYTES`]
/// alone, a 1 MiB reader read its first 8 MiB with a window smaller than
/// its reads, so nothing was read ahead of it.
fn first_window(len: u64) -> usize {
    (len as usize)
        .saturating_mul(4)
        .checked_next_power_of_two()
        .unwrap_or(MAX_FOLIO_BYTES)
        .min(MAX_FOLIO_BYTES)
}

/// Records an access of `[pos, end)` in a sequence detector; returns its
/// window (at least `floor` once sequential).
fn advance(next_pos: &AtomicU64, window: &AtomicUsize, pos: u64, end: u64, floor: usize) -> usize {
    let (next, grown) = grow(
        next_pos.load(Ordering::Relaxed),
        window.load(Ordering::Relaxed),
        pos,
        end,
        floor,
    );
    next_pos.store(next, Ordering::Relaxed);
    window.store(grown, Ordering::Relaxed);
    grown
}

/// The next expected offset and window after an access of `[pos, end)`,
/// given the previous ones: doubling while sequential (from `floor` at
/// least), reset otherwise.
fn grow(next_pos: u64, window: usize, pos: u64, end: u64, floor: usize) -> (u64, usize) {
    let window = if pos == next_pos && pos > 0 {
        (window * 2)
            .max(floor)
            .clamp(READAHEAD_START_BYTES, MAX_FOLIO_BYTES)
    } else {
        0
    };
    (end, window)
}

/// Makes `blocks` of a locked folio uptodate: device data where the file
/// has written data, zeros elsewhere (holes, unwritten and delalloc space
/// read as zeros through the mapping; bytes at or past `eof` are zeroed
/// here).
pub(crate) fn fill<F: IomapFile>(
    file: &F,
    folio: &Folio,
    state: &mut FolioState,
    blocks: std::ops::Range<usize>,
    eof: u64,
) -> Result<(), FileError<F>> {
    let bb = folio.block_bytes();
    let mut i = blocks.start;
    while i < blocks.end {
        if state.uptodate.get(i) {
            i += 1;
            continue;
        }
        let run_start = i;
        while i < blocks.end && !state.uptodate.get(i) {
            i += 1;
        }
        let (from, to) = (run_start * bb, i * bb);
        let file_from = folio.pos() + from as u64;
        let data = &mut state.data[from..to];
        if file_from < eof {
            read_from_device(file, file_from, data)?;
            let inside = (eof - file_from).min(data.len() as u64) as usize;
            data[inside..].fill(0);
        } else {
            data.fill(0);
        }
        folio.set_uptodate(state, run_start..i);
    }
    Ok(())
}

/// Reads file bytes `[pos, pos + buf.len())` (block-aligned, inside EOF)
/// into folio memory: holes, unwritten and delalloc space as zeros, as
/// [`crate::dio_read`] does, except that device-contiguous pieces go as
/// one request — a mapping longer than the direct-I/O request cap
/// ([`crate::dio::DIO_MAX_REQUEST_BYTES`]), or neighbouring mappings placed
/// back to back. A folio is at most [`MAX_FOLIO_BYTES`] of aligned memory,
/// so such a request is bounded and needs no bounce buffer; a cold 2 MiB
/// folio took two 1 MiB requests, and single 2 MiB reads of a loop device
/// over tmpfs run ~13% faster than 1 MiB ones.
fn read_from_device<F: IomapFile>(file: &F, pos: u64, buf: &mut [u8]) -> Result<(), FileError<F>> {
    let dev = &**file.device();
    let lbs = logical_block_size(dev);
    let flags = IomapOpFlags::READ | IomapOpFlags::DIRECT;
    let mut iter = IomapIter::new(file.ops(), file.inode(), pos, buf.len() as u64, flags, lbs)?;
    let mut run = DeviceRun::default();
    while let Some(span) = iter.begin()? {
        // A span's reads may still be pending when it ends: every caller
        // holds the inode's I/O lock (shared), which keeps the blocks of a
        // mapping where it says until the read below is done, and `end`
        // of a read releases nothing.
        let planned = read_segments(&span, lbs).and_then(|mut segments| {
            segments.try_for_each(|segment| run.add(segment, pos, buf, dev))
        });
        iter.end(&span, if planned.is_ok() { span.len } else { 0 })?;
        planned?;
    }
    run.issue(pos, buf, dev)?;
    Ok(())
}

/// Device-contiguous bytes of a [`read_from_device`] not read yet: `len`
/// bytes at `dev_addr` for `buf[at..]`.
#[derive(Default)]
struct DeviceRun {
    at: usize,
    dev_addr: u64,
    len: usize,
}

impl DeviceRun {
    /// Adds one planned segment of a read into `buf` (file bytes from
    /// `pos`): zeros at once; device bytes that continue the run join it,
    /// others issue it and start a new one.
    fn add(
        &mut self,
        segment: ReadSegment,
        pos: u64,
        buf: &mut [u8],
        dev: &dyn blockdev::BlockDevice,
    ) -> Result<(), IomapError> {
        let Some((file_offset, dev_addr, len)) = segment.zero_fill(buf, pos) else {
            return Ok(());
        };
        let at = (file_offset - pos) as usize;
        let continues =
            self.len > 0 && self.at + self.len == at && self.dev_addr + self.len as u64 == dev_addr;
        if continues {
            self.len += len as usize;
        } else {
            self.issue(pos, buf, dev)?;
            *self = DeviceRun {
                at,
                dev_addr,
                len: len as usize,
            };
        }
        Ok(())
    }

    /// Reads the run (if any) and empties it.
    fn issue(
        &mut self,
        pos: u64,
        buf: &mut [u8],
        dev: &dyn blockdev::BlockDevice,
    ) -> Result<(), IomapError> {
        let run = std::mem::take(self);
        if run.len == 0 {
            return Ok(());
        }
        dev.read_at(&mut buf[run.at..run.at + run.len], run.dev_addr)
            .map_err(|source| IomapError::Device {
                file_offset: pos + run.at as u64,
                source,
            })
    }
}

/// What a buffered write copies into the cache.
#[derive(Clone, Copy)]
enum Source<'a> {
    Bytes(&'a [u8]),
    /// Zeros: the gap between the old EOF and an extending write, inside
    /// the old EOF's block.
    Zeros,
}

/// Writes `buf` at `pos` into the cache (see the module docs). With
/// O_DSYNC/O_SYNC the range is written back and made durable before it
/// returns; otherwise writeback comes later, and a writer past the dirty
/// limit first writes back its file.
pub fn write<F: IomapFile>(file: &F, pos: u64, buf: &[u8]) -> Result<usize, FileError<F>> {
    let len = buf.len() as u64;
    file.check_io(pos, len, true)?;
    if buf.is_empty() {
        return Ok(0);
    }
    let end = pos + len;
    let (ops, inode, mapping) = (file.ops(), file.inode(), file.mapping());
    let window = write_window(mapping, pos, end);
    let lock = file.as_ref();
    let shared = lock.lock_shared();
    let size = ops.size(inode)?;
    if end <= size {
        reserve(file, pos, len)?;
        copy_into_cache(file, pos, len, Source::Bytes(buf), size, window)?;
        drop(shared);
    } else {
        // An extending write runs alone: it zeroes the gap past the old EOF
        // and moves the size, and every holder of the shared lock relies on
        // a size that does not change under it — `fill` zeroes what lies
        // past it, and a writeback pass must not raise the on-disk size
        // over an EOF block that becomes dirty behind it. (No drain: a
        // buffered write sends nothing to the device.)
        drop(shared);
        let _exclusive = lock.lock_exclusive();
        let size = ops.size(inode)?;
        let bs = block_bytes(ops) as u64;
        // Bytes between EOF and the write must read as zeros, also on the
        // device: the old EOF block's tail may hold bytes of a write whose
        // size change a crash lost. It is rewritten as zeros — where the
        // block has space (written, unwritten or delayed), so rewriting it
        // needs no reservation; a hole has no bytes to hide. Past that block
        // the gap is a hole: nothing to reserve or write. Only the write's
        // own range is reserved, in one call: a write that fails with ENOSPC
        // changes nothing.
        let gap_end = pos.min(size.next_multiple_of(bs));
        reserve(file, pos, len)?;
        if gap_end > size && !is_hole(file, size, gap_end - size)? {
            copy_into_cache(file, size, gap_end - size, Source::Zeros, size, 0)?;
        }
        copy_into_cache(file, pos, len, Source::Bytes(buf), size, window)?;
        ops.extend_size_in_core(inode, end)?;
    }
    let sync = file.write_sync();
    if sync != crate::WriteSync::None {
        let outcome = write_back(file, pos, end)?;
        crate::Durability::after_write(sync, &outcome).wait(
            ops,
            &**file.device(),
            file.flushes(),
        )?;
    } else {
        write_behind(file, pos, end, window);
        throttle(file)?;
    }
    Ok(buf.len())
}

/// After a sequential write of `[pos, end)` with folio window `window`
/// (an appending writer's next extending write waits for a pass in
/// progress, which holds the inode's lock shared):
/// once the writer is a whole chunk past the last one handed to
/// write-behind, the background thread writes back what lies behind it, so
/// the device writes while the writer copies and an `fsync` at the end
/// finds little left (the kernel leaves this to the dirty thresholds; a
/// log or a bulk load then pays copy plus writeback, one after the other).
fn write_behind<F: IomapFile>(file: &F, pos: u64, end: u64, window: usize) {
    let mapping = file.mapping();
    let chunk = mapping.cache().config().write_behind_bytes;
    if chunk == 0 || window < MAX_FOLIO_BYTES {
        return;
    }
    let mark = &mapping.shared.write_behind_end;
    let behind = end - end % chunk;
    let mut from = mark.load(Ordering::Relaxed);
    if pos < from {
        // A new pass over the file (or a writer further back): behind it
        // starts again.
        from = pos - pos % chunk;
        mark.store(from, Ordering::Relaxed);
    }
    if behind < from + chunk
        || mark
            .compare_exchange(from, behind, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    let Ok(held) = file.hold() else {
        return;
    };
    let shared = mapping.shared.clone();
    mapping.cache().write_behind().submit(Box::new(move || {
        // Up to where the writer is now: jobs that queued up behind a slow
        // device become one pass with more writes in flight.
        let to = shared.write_behind_end.load(Ordering::Relaxed).max(behind);
        // Errors are recorded in the mapping for `fsync` to report.
        let _ = write_back(&held, from, to);
    }));
}

/// Reserves space for `[pos, pos + len)`: asks the file system for every
/// mapping of the range as a buffered write (it answers holes with
/// delayed allocations, or ENOSPC before anything changed).
fn reserve<F: IomapFile>(file: &F, pos: u64, len: u64) -> Result<(), FileError<F>> {
    let lbs = crate::dio::logical_block_size(&**file.device());
    let (ops, inode) = (file.ops(), file.inode());
    let mut iter = IomapIter::new(ops, inode, pos, len, IomapOpFlags::WRITE, lbs)?;
    while let Some(span) = iter.begin()? {
        iter.end(&span, span.len)?;
    }
    Ok(())
}

/// Whether the file has no space at all in `[pos, pos + len)`.
fn is_hole<F: IomapFile>(file: &F, pos: u64, len: u64) -> Result<bool, FileError<F>> {
    let lbs = crate::dio::logical_block_size(&**file.device());
    let (ops, inode) = (file.ops(), file.inode());
    let mut iter = IomapIter::new(ops, inode, pos, len, IomapOpFlags::READ, lbs)?;
    let mut hole = true;
    while let Some(span) = iter.begin()? {
        hole &= span.iomap.kind == crate::IomapKind::Hole;
        iter.end(&span, span.len)?;
    }
    Ok(hole)
}

/// Copies `len` bytes of `src` to the cache at `pos`, making partial edge
/// blocks uptodate first, and marks them dirty. `eof` is the in-core size
/// before the write; folios are made of up to `window` bytes.
fn copy_into_cache<F: IomapFile>(
    file: &F,
    pos: u64,
    len: u64,
    src: Source<'_>,
    eof: u64,
    window: usize,
) -> Result<(), FileError<F>> {
    let bs = block_bytes(file.ops());
    let end = pos + len;
    let want = |cur: u64| ((end - cur) as usize).max(window).min(MAX_FOLIO_BYTES);
    each_folio(file, pos, end, want, |folio, state, from, to| {
        let blocks = folio.blocks_of(from, to);
        // Only the blocks the write covers partly need their old bytes.
        if !from.is_multiple_of(bs) {
            let first = blocks.start;
            fill(file, folio, state, first..first + 1, eof)?;
        }
        if !to.is_multiple_of(bs) {
            let last = blocks.end - 1;
            fill(file, folio, state, last..last + 1, eof)?;
        }
        match src {
            Source::Bytes(bytes) => {
                let at = (folio.pos() + from as u64 - pos) as usize;
                state.data[from..to].copy_from_slice(&bytes[at..at + (to - from)]);
            }
            Source::Zeros => state.data[from..to].fill(0),
        }
        folio.set_dirty(state, blocks);
        Ok(())
    })
}

/// Runs `each` on every folio of file bytes `[pos, end)` in order, locked,
/// with the part of it inside the range (`from..to`, offsets in the
/// folio). A missing folio is created of `want(offset)` bytes at most; one
/// evicted between its lookup and its lock is looked up again.
fn each_folio<F: IomapFile>(
    file: &F,
    pos: u64,
    end: u64,
    want: impl Fn(u64) -> usize,
    mut each: impl FnMut(&Folio, &mut FolioState, usize, usize) -> Result<(), FileError<F>>,
) -> Result<(), FileError<F>> {
    let (mapping, bs) = (file.mapping(), block_bytes(file.ops()));
    let mut cur = pos;
    while cur < end {
        let folio = mapping.find_or_create(cur, want(cur), bs)?;
        let from = (cur - folio.pos()) as usize;
        let to = (end.min(folio.end()) - folio.pos()) as usize;
        {
            let mut state = folio.lock();
            if state.evicted {
                continue; // gone from the tree since it was found
            }
            each(&folio, &mut state, from, to)?;
        }
        folio.touch();
        cur = folio.pos() + to as u64;
    }
    Ok(())
}

/// Holds a writer back while dirty bytes are past the limit: it writes its
/// own file back, then waits (boundedly) for background writeback of the
/// others.
fn throttle<F: IomapFile>(file: &F) -> Result<(), FileError<F>> {
    let cache = file.mapping().cache();
    if !cache.over_dirty_limit() {
        return Ok(());
    }
    write_back(file, 0, u64::MAX)?;
    for _ in 0..THROTTLE_WAITS {
        if !cache.over_dirty_limit() {
            break;
        }
        cache.notify_dirty_change();
        cache.wait_dirty_change(THROTTLE_WAIT);
    }
    Ok(())
}

/// Writes back and drops the cached folios of `[from, to)`: before direct
/// I/O over the range (so it sees and is seen by buffered data), and before
/// truncate, punch and fallocate change what the range holds. The caller
/// must not hold the inode's I/O lock.
pub fn flush_and_invalidate<F: IomapFile>(
    file: &F,
    from: u64,
    to: u64,
) -> Result<(), FileError<F>> {
    if file.mapping().is_empty() {
        return Ok(());
    }
    let written = write_back(file, from, to);
    // Dropped even when writeback failed: the error is recorded for fsync,
    // and folios that stay would not match the device either way.
    file.mapping().invalidate(from, to);
    written.map(|_| ())
}

/// The writeback error recorded on `file`'s mapping since its handle last
/// looked, as an error (for `fsync`).
pub fn take_writeback_error<F: IomapFile>(file: &F) -> Result<(), FileError<F>> {
    match file.mapping().take_error(file.error_cursor()) {
        None => Ok(()),
        Some((errno, what)) => Err(IomapError::Writeback { errno, what }.into()),
    }
}
