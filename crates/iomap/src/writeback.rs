//! Writeback: dirty blocks of the folio cache to the device.
//!
//! Contiguous dirty blocks — across folios — are gathered into runs of up
//! to [`WRITEBACK_BATCH_BYTES`], copied under each folio's lock (which
//! clears their dirty bits and counts a writeback in flight, so the folio is
//! neither evicted nor invalidated before its bytes are on the device), and
//! written as one direct write each: the file system places delayed
//! allocations as unwritten extents then, the data goes to the device, and
//! completion ([`crate::ioend`]) converts the extents and raises the on-disk
//! size to the run's end, clamped to the in-core EOF. So a power cut never
//! exposes zeros or stale bytes through the size, and no data is ordered
//! before metadata.
//!
//! The copy costs a memcpy per written byte and at most one batch of memory;
//! it lets writers redirty a folio while its old bytes are being written.
//!
//! # Fault model
//!
//! A failed write is recorded in the file's mapping for `fsync` to report
//! (see [`crate::folio_cache`]); its blocks stay clean in the cache, as in
//! Linux, and the caller gets the first error after every run was tried.

use std::sync::Arc;

use blockdev::AlignedBuf;

use crate::dio::dio_write_padded;
use crate::folio::{Folio, FOLIO_ALIGN};
use crate::ioend::DioWriteOutcome;
use crate::{FileError, IomapFile, IomapOpFlags, IomapOps, WriteSync};

/// Largest run written back as one direct write: also the most memory a
/// writeback adds to the cache's budget.
pub const WRITEBACK_BATCH_BYTES: usize = 4 << 20;

/// Dirty bytes gathered for one write: file range and the folios whose
/// writeback it counts.
struct Run {
    pos: u64,
    len: usize,
    folios: Vec<Arc<Folio>>,
}

/// Writes back the dirty blocks of `file` in `[from, to)` and waits for
/// them. Returns what the writes did (for the durability of O_DSYNC
/// writes). Takes the inode's I/O lock shared: the caller must not hold it.
pub fn write_back<F: IomapFile>(
    file: &F,
    from: u64,
    to: u64,
) -> Result<DioWriteOutcome, FileError<F>> {
    let mapping = file.mapping();
    let mut total = DioWriteOutcome::NOTHING;
    if mapping.is_empty() {
        return Ok(total);
    }
    let _one_at_a_time = mapping.writeback_lock();
    let _shared = file.as_ref().lock_shared();
    let ops = file.ops();
    let eof = ops.size(file.inode())?;
    let mut bounce: Option<AlignedBuf> = None;
    let mut first_error = None;
    let mut next_pos = from;
    let mut folios = std::iter::from_fn(|| {
        let folio = mapping.next_folio(next_pos, to)?;
        next_pos = folio.end();
        Some(folio)
    });
    let mut pending: Option<(Arc<Folio>, usize)> = None; // folio, next block
    loop {
        let buf = match &mut bounce {
            Some(b) => b,
            None => bounce.insert(
                AlignedBuf::new(WRITEBACK_BATCH_BYTES, FOLIO_ALIGN)
                    .map_err(|source| crate::IomapError::Bounce { pos: from, source })?,
            ),
        };
        let Some(run) = gather(&mut folios, &mut pending, from, to, buf) else {
            break;
        };
        let data_end = (run.pos + run.len as u64).min(eof.max(run.pos));
        let result = write_run(file, &run, &buf[..run.len], data_end);
        for folio in &run.folios {
            folio.end_writeback();
        }
        match result {
            Ok(outcome) => total.merge(&outcome),
            Err(e) => {
                mapping.record_error(
                    libc::EIO,
                    format!(
                        "writeback of file bytes {}..{}: {e}",
                        run.pos,
                        run.pos + run.len as u64
                    ),
                );
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(total),
    }
}

/// Writes one run as a direct write (allocating what is delayed), with
/// completion clamped to `data_end`.
fn write_run<F: IomapFile>(
    file: &F,
    run: &Run,
    data: &[u8],
    data_end: u64,
) -> Result<DioWriteOutcome, FileError<F>> {
    let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
    if file.write_sync() == WriteSync::Dsync {
        flags |= IomapOpFlags::DSYNC;
    }
    dio_write_padded(
        file.ops(),
        &**file.device(),
        file.inode(),
        run.pos,
        data,
        data_end,
        flags,
    )
}

/// The next run of contiguous dirty blocks in `[from, to)`, copied into
/// `buf`, its blocks cleaned and their folios marked under writeback.
/// `pending` is where the previous run stopped (a folio and its next
/// block).
fn gather(
    folios: &mut impl Iterator<Item = Arc<Folio>>,
    pending: &mut Option<(Arc<Folio>, usize)>,
    from: u64,
    to: u64,
    buf: &mut [u8],
) -> Option<Run> {
    let mut run: Option<Run> = None;
    loop {
        let (folio, mut i) = match pending.take() {
            Some(p) => p,
            None => match folios.next() {
                Some(f) => (f, 0),
                None => return run,
            },
        };
        let bb = folio.block_bytes();
        let blocks = folio.len() / bb;
        let mut state = folio.lock();
        let mut counted = false;
        while i < blocks {
            let block_pos = folio.pos() + (i * bb) as u64;
            let wanted = block_pos < to && block_pos + bb as u64 > from && state.dirty.get(i);
            if !wanted {
                if run.is_some() {
                    // A clean block ends the run.
                    *pending = Some((folio.clone(), i + 1));
                    return run;
                }
                i += 1;
                continue;
            }
            if let Some(r) = &run {
                if r.pos + r.len as u64 != block_pos || r.len + bb > buf.len() {
                    // Not contiguous, or the batch is full: the next run
                    // starts with this block.
                    *pending = Some((folio.clone(), i));
                    return run;
                }
            }
            let r = run.get_or_insert_with(|| Run {
                pos: block_pos,
                len: 0,
                folios: Vec::new(),
            });
            buf[r.len..r.len + bb].copy_from_slice(&state.data[i * bb..(i + 1) * bb]);
            r.len += bb;
            if !counted {
                state.writeback += 1;
                r.folios.push(folio.clone());
                counted = true;
            }
            folio.clear_dirty(&mut state, i..i + 1);
            i += 1;
        }
    }
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
