//! Writeback: dirty blocks of the folio cache to the device.
//!
//! Dirty blocks are written straight from the folio's memory, with the
//! folio locked for the I/O (readers and writers of that folio wait; other
//! folios go on). Large folios make large writes: sequential writers get
//! folios of up to 2 MiB.
//!
//! A folio dirty throughout and backed by one extent goes to the device
//! through a device queue (io_uring where chosen), up to
//! [`WRITEBACK_QUEUE_DEPTH`] folios in flight: its memory is lent to the
//! request and handed back at completion. Anything else (partly dirty
//! folios, extent boundaries inside) is written run by run as direct
//! writes. Either way the file system places delayed allocations as
//! unwritten extents when the folio is mapped, and completion
//! ([`crate::ioend`]) converts them and raises the on-disk size to the
//! folio's end, clamped to the in-core EOF — in file order, so the size
//! never covers a folio still in flight. A power cut never exposes zeros or
//! stale bytes through the size, and no data is ordered before metadata.
//!
//! # Fault model
//!
//! A failed write is recorded in the file's mapping for `fsync` to report
//! (see [`crate::folio_cache`]), and the caller gets the first error after
//! every run was tried. Blocks below the on-disk EOF that failed are left
//! clean in the cache, as in Linux: the device keeps the file's older bytes
//! there. A failed write past the on-disk EOF is different: the device may
//! hold anything there (the bytes of a write whose size change a crash
//! lost, say), so the size must never cover those blocks until they are
//! written. They stay dirty, the pass stops there, and the writes of it
//! still in flight complete without raising the size past the failure and
//! stay dirty too; the next pass (it starts at the on-disk EOF) retries
//! them all.

use std::collections::VecDeque;
use std::sync::Arc;

use blockdev::{AlignedBuf, DeviceQueue, DeviceRequest, WriteMode};
use parking_lot::lock_api::ArcMutexGuard;
use parking_lot::RawMutex;

use crate::dio::dio_write_padded;
use crate::folio::{Folio, FolioState};
use crate::ioend::{DioWriteOutcome, SizeUpdate, WriteEnd};
use crate::{
    FileError, IomapError, IomapFile, IomapFlags, IomapIter, IomapKind, IomapOpFlags, IomapOps,
    WriteSync,
};

/// Writes back the dirty blocks of `file` in `[from, to)` (from the
/// on-disk EOF instead, when `from` is past it) and waits for them.
/// Returns what the writes did (for the durability of O_DSYNC writes).
/// Takes the inode's I/O lock shared: the caller must not hold it.
pub fn write_back<F: IomapFile>(
    file: &F,
    from: u64,
    to: u64,
) -> Result<DioWriteOutcome, FileError<F>> {
    let mapping = file.mapping();
    if mapping.is_empty() {
        return Ok(DioWriteOutcome::NOTHING);
    }
    let _one_at_a_time = mapping.writeback_lock();
    let _shared = file.as_ref().lock_shared();
    // Stable while the shared lock is held: extending writes take it
    // exclusively.
    let eof = file.ops().size(file.inode())?;
    // Completion raises the on-disk size to each folio's end, over every
    // byte below it: a range past the on-disk EOF is written back from
    // there, or dirty blocks before it (the zeroed tail of an old EOF
    // block, say) would end up under the size unwritten (invariant 4).
    let from = from.min(file.ops().disk_size(file.inode())?);
    let mut wb = Writeback {
        file,
        eof,
        queue: None,
        in_flight: VecDeque::new(),
        total: DioWriteOutcome::NOTHING,
        first_error: None,
        size_limit: u64::MAX,
    };
    let mut pos = from;
    // One folio at a time: a snapshot of all would keep evicted folios'
    // memory alive while the writeback lasts.
    while let Some(folio) = mapping.next_folio(pos, to) {
        if wb.stopped() {
            break;
        }
        pos = folio.end();
        let mut state = folio.lock_owned();
        if state.evicted || !state.dirty.any() {
            continue;
        }
        let whole = folio.pos() >= from
            && folio.end() <= to
            && state.dirty.all(folio.blocks_of(0, folio.len()));
        if whole {
            match wb.queue_folio(&folio, state) {
                Ok(None) => continue,
                Ok(Some(back)) => state = back,
                Err(e) => {
                    wb.failed(folio.pos(), folio.end(), e);
                    continue;
                }
            }
        }
        // Partly dirty, or not one extent: run by run, in order after what
        // is queued (so sizes rise in file order).
        wb.drain(0);
        for (a, b) in dirty_runs(&folio, &state, from, to) {
            if wb.stopped() {
                break;
            }
            let run_pos = folio.pos() + a as u64;
            let data_end = (folio.pos() + b as u64).min(eof.max(run_pos));
            let result = write_run(file, run_pos, &state.data[a..b], data_end);
            let bb = folio.block_bytes();
            let keep_dirty = match result {
                Ok(outcome) => {
                    wb.total.merge(&outcome);
                    false
                }
                Err(e) => wb.failed(run_pos, folio.pos() + b as u64, e),
            };
            if !keep_dirty {
                folio.clear_dirty(&mut state, a / bb..b / bb);
            }
        }
    }
    wb.drain(0);
    match wb.first_error {
        Some(e) => Err(e),
        None => Ok(wb.total),
    }
}

/// Device requests of writeback in flight at once, at most (a folio each).
pub const WRITEBACK_QUEUE_DEPTH: usize = 64;

/// A whole folio's write in flight: the folio stays locked, its memory in
/// the request until the completion hands it back.
struct QueuedFolio {
    // Declared first, so the lock is released before the folio reference
    // goes (a folio's drop takes its lock).
    state: ArcMutexGuard<RawMutex, FolioState>,
    folio: Arc<Folio>,
    end: WriteEnd,
    /// The device's answer, once it came.
    done: Option<Result<usize, blockdev::DeviceError>>,
    pure: bool,
    fua: bool,
}

/// One writeback pass: its queue, what is in flight (in file order), and
/// what it did.
struct Writeback<'f, F: IomapFile> {
    file: &'f F,
    /// The in-core size.
    eof: u64,
    queue: Option<Box<dyn DeviceQueue>>,
    in_flight: VecDeque<QueuedFolio>,
    total: DioWriteOutcome,
    first_error: Option<FileError<F>>,
    /// The on-disk size may not rise past this (`u64::MAX`: no limit): set
    /// by a failed write past the on-disk EOF, see the module's fault model.
    size_limit: u64,
}

impl<F: IomapFile> Writeback<'_, F> {
    /// Records a failed write of file bytes `[from, to)`. Returns whether
    /// its blocks must stay dirty: when it reached past the on-disk EOF,
    /// which then may not rise past `from` (nor past where it is now) in
    /// this pass.
    fn failed(&mut self, from: u64, to: u64, e: FileError<F>) -> bool {
        let errno = crate::EngineError::as_iomap(&e).map_or(libc::EIO, |i| i.errno());
        self.file
            .mapping()
            .record_error(errno, format!("writeback of file bytes {from}..{to}: {e}"));
        self.first_error.get_or_insert(e);
        // Unknown: as if past it, the safe side.
        let disk_size = self.file.ops().disk_size(self.file.inode()).unwrap_or(0);
        if to <= disk_size {
            return false;
        }
        self.size_limit = self.size_limit.min(from.max(disk_size));
        true
    }

    /// A write past the on-disk EOF failed: nothing after it may be made
    /// visible by this pass, so it writes nothing more.
    fn stopped(&self) -> bool {
        self.size_limit != u64::MAX
    }

    /// Sends a wholly dirty folio through the queue when one extent backs
    /// it; hands the lock back (`Some`) when it must be written run by run.
    fn queue_folio(
        &mut self,
        folio: &Arc<Folio>,
        mut state: ArcMutexGuard<RawMutex, FolioState>,
    ) -> Result<Option<ArcMutexGuard<RawMutex, FolioState>>, FileError<F>> {
        let (ops, inode, dev) = (self.file.ops(), self.file.inode(), &**self.file.device());
        let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT | IomapOpFlags::WRITEBACK;
        let dsync = self.file.write_sync() == WriteSync::Dsync;
        if dsync {
            flags |= IomapOpFlags::DSYNC;
        }
        let size_before = ops.disk_size(inode)?;
        let lbs = crate::dio::logical_block_size(dev);
        let len = folio.len() as u64;
        // Maps (and for delayed allocations, places) the folio's range.
        let mut iter = IomapIter::new(ops, inode, folio.pos(), len, flags, lbs)?;
        let Some(span) = iter.begin()? else {
            return Ok(Some(state));
        };
        let one_extent = span.len == len
            && matches!(span.iomap.kind, IomapKind::Mapped | IomapKind::Unwritten)
            && !span.iomap.flags.contains(IomapFlags::SHARED);
        let addr = span.device_addr_of(folio.pos());
        // The file system's `end` releases nothing for a direct write: the
        // completion below (`WriteEnd`) is what finishes it.
        iter.end(&span, if one_extent { span.len } else { 0 })?;
        let (true, Some(addr)) = (one_extent, addr) else {
            return Ok(Some(state));
        };
        let pure = span.iomap.is_pure_overwrite();
        let fua = dsync && pure && crate::ioend::dsync_as_durable_write(dev);
        let mode = if fua {
            WriteMode::Fua
        } else {
            WriteMode::Normal
        };
        if self.queue.is_none() {
            // The pass's own thread pushes, waits for and drops every
            // request: completions can wait for it, and a wait for a batch
            // wakes it once.
            let queue =
                blockdev::queue::new_thread_queue(self.file.device(), WRITEBACK_QUEUE_DEPTH)
                    .map_err(|source| IomapError::Queue {
                        what: "writeback queue",
                        source,
                    })?;
            self.queue = Some(queue);
        }
        if self.in_flight.len() >= WRITEBACK_QUEUE_DEPTH {
            self.drain(WRITEBACK_QUEUE_DEPTH - 1);
        }
        let queue = self.queue.as_mut().expect("made above");
        let buf = std::mem::replace(
            &mut state.data,
            AlignedBuf::new(0, 1).expect("a zero-length buffer needs no memory"),
        );
        let data_end = folio.end().min(self.eof.max(folio.pos()));
        let end = WriteEnd {
            pos: folio.pos(),
            completed: data_end - folio.pos(),
            unwritten: crate::dio::needs_zeroing(&span.iomap),
            size: SizeUpdate::Extend { size_before },
            direct: false,
        };
        let token = folio.pos();
        if let Err(full) = queue.push(
            token,
            DeviceRequest::Write {
                offset: addr,
                buf,
                mode,
            },
        ) {
            // Cannot happen after the drain above; put the memory back and
            // write it run by run instead.
            if let DeviceRequest::Write { buf, .. } = full.request {
                state.data = buf;
            }
            return Ok(Some(state));
        }
        self.in_flight.push_back(QueuedFolio {
            folio: folio.clone(),
            state,
            end,
            done: None,
            pure,
            fua,
        });
        Ok(None)
    }

    /// Waits until at most `keep` folios are in flight, completing the
    /// finished ones in file order.
    fn drain(&mut self, keep: usize) {
        if self.queue.is_none() {
            return;
        }
        let mut done = Vec::new();
        while self.in_flight.len() > keep {
            done.clear();
            let want = self.in_flight.len() - keep;
            let queue = self.queue.as_mut().expect("checked above");
            if let Err(source) = queue.submit_and_reap(want, &mut done) {
                // The queue itself failed: everything in flight fails.
                let error: FileError<F> = IomapError::Queue {
                    what: "writeback queue",
                    source,
                }
                .into();
                while let Some(mut q) = self.in_flight.pop_front() {
                    q.done.get_or_insert(Err(blockdev::DeviceError::Flush {
                        source: std::io::Error::from_raw_os_error(libc::EIO),
                    }));
                    self.finish(q);
                }
                self.first_error.get_or_insert(error);
                return;
            }
            for c in done.drain(..) {
                if let Some(q) = self.in_flight.iter_mut().find(|q| q.folio.pos() == c.token) {
                    if let Some(buf) = c.buf {
                        q.state.data = buf;
                    }
                    q.done = Some(c.result);
                }
            }
            while self.in_flight.front().is_some_and(|q| q.done.is_some()) {
                let q = self.in_flight.pop_front().expect("checked");
                self.finish(q);
            }
        }
    }

    /// A folio's write is done: clean it, and complete it through the file
    /// system (conversion, size).
    fn finish(&mut self, mut q: QueuedFolio) {
        let (pos, end) = (q.folio.pos(), q.folio.end());
        let keep_dirty = match q.done.take().expect("finished only once done") {
            Ok(_) => {
                let limited = q.end.pos + q.end.completed > self.size_limit;
                if let (true, SizeUpdate::Extend { size_before }) = (limited, q.end.size) {
                    q.end.size = SizeUpdate::ExtendBelow {
                        size_before,
                        limit: self.size_limit,
                    };
                }
                match q.end.complete(self.file.ops(), self.file.inode()) {
                    Ok(flags) => {
                        self.total.merge(&DioWriteOutcome {
                            written: q.end.completed,
                            end_flags: flags,
                            pure_overwrite: q.pure && flags.is_pure(),
                            fua: q.fua && flags.is_pure(),
                        });
                        // Written, but past what the size may cover now:
                        // the next pass writes it again and raises the size.
                        limited
                    }
                    Err(e) => self.failed(pos, end, e),
                }
            }
            Err(source) => {
                let e = IomapError::Device {
                    file_offset: pos,
                    source,
                }
                .into();
                self.failed(pos, end, e)
            }
        };
        // A queue that failed as a whole kept the folio's memory: nothing is
        // left to write again, and nothing cached to read. The folio gets
        // fresh memory whose blocks are read from the device again (the
        // error reaches fsync); without it, the next cached read would slice
        // an empty buffer. If even that allocation fails, the folio keeps
        // its blocks marked uptodate over empty memory.
        let data_back = q.state.data.len() == q.folio.len();
        if !(keep_dirty && data_back) {
            let all = q.folio.blocks_of(0, q.folio.len());
            q.folio.clear_dirty(&mut q.state, all.clone());
            if !data_back {
                if let Ok(fresh) = crate::folio_cache::new_buffer(q.folio.len(), pos) {
                    q.state.data = fresh;
                    q.folio.forget_clean(&mut q.state, all);
                }
            }
        }
    }
}

/// The runs of contiguous dirty blocks of a locked folio inside `[from,
/// to)`, as byte ranges of the folio.
fn dirty_runs(folio: &Folio, state: &FolioState, from: u64, to: u64) -> Vec<(usize, usize)> {
    let bb = folio.block_bytes();
    let mut runs = Vec::new();
    let mut start = None;
    for i in 0..folio.len() / bb {
        let block_pos = folio.pos() + (i * bb) as u64;
        let wanted = block_pos < to && block_pos + bb as u64 > from && state.dirty.get(i);
        match (wanted, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                runs.push((s * bb, i * bb));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        runs.push((s * bb, folio.len()));
    }
    runs
}

/// Writes one run as a direct write (allocating what is delayed), with
/// completion clamped to `data_end`.
fn write_run<F: IomapFile>(
    file: &F,
    pos: u64,
    data: &[u8],
    data_end: u64,
) -> Result<DioWriteOutcome, FileError<F>> {
    let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT | IomapOpFlags::WRITEBACK;
    if file.write_sync() == WriteSync::Dsync {
        flags |= IomapOpFlags::DSYNC;
    }
    dio_write_padded(
        file.ops(),
        &**file.device(),
        file.inode(),
        pos,
        data,
        data_end,
        flags,
    )
}

/// Writes back and waits for every dirty block of `file`, then reports a
/// writeback error recorded since this handle last looked, then commits the
/// metadata: `fsync`/`fdatasync` of a file with cached data.
pub fn sync_file<F: IomapFile>(file: &F) -> Result<(), FileError<F>> {
    let written = write_back(file, 0, u64::MAX);
    // The error reaches this handle whether this writeback or an earlier
    // (background) one met it; it is reported once.
    let recorded = crate::buffered_io::take_writeback_error(file);
    written?;
    recorded?;
    file.ops().commit()
}
