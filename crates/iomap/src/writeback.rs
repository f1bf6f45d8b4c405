//! Writeback: dirty blocks of the folio cache to the device.
//!
//! Each run of contiguous dirty blocks in a folio is written straight from
//! the folio's memory, with the folio locked for the I/O (readers and
//! writers of that folio wait; other folios go on). Large folios make large
//! runs: sequential writers get folios of up to 2 MiB, so a run is up to
//! that, cut into device requests of at most
//! [`DIO_MAX_REQUEST_BYTES`](crate::dio::DIO_MAX_REQUEST_BYTES). A run is
//! one direct write: the file system places delayed allocations as
//! unwritten extents then, the data goes to the device, and completion
//! ([`crate::ioend`]) converts the extents and raises the on-disk size to
//! the run's end, clamped to the in-core EOF. So a power cut never exposes
//! zeros or stale bytes through the size, and no data is ordered before
//! metadata.
//!
//! # Fault model
//!
//! A failed write is recorded in the file's mapping for `fsync` to report
//! (see [`crate::folio_cache`]); its blocks stay clean in the cache, as in
//! Linux, and the caller gets the first error after every run was tried.

use crate::dio::dio_write_padded;
use crate::folio::{Folio, FolioState};
use crate::ioend::DioWriteOutcome;
use crate::{FileError, IomapFile, IomapOpFlags, IomapOps, WriteSync};

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
    let eof = file.ops().size(file.inode())?;
    let mut first_error = None;
    let mut pos = from;
    // One folio at a time: a snapshot of all would keep evicted folios'
    // memory alive while the writeback lasts.
    while let Some(folio) = mapping.next_folio(pos, to) {
        pos = folio.end();
        let mut state = folio.lock();
        if state.evicted || !state.dirty.any() {
            continue;
        }
        for (a, b) in dirty_runs(&folio, &state, from, to) {
            let run_pos = folio.pos() + a as u64;
            let data_end = (folio.pos() + b as u64).min(eof.max(run_pos));
            let result = write_run(file, run_pos, &state.data[a..b], data_end);
            folio.clear_dirty(&mut state, a / folio.block_bytes()..b / folio.block_bytes());
            match result {
                Ok(outcome) => total.merge(&outcome),
                Err(e) => {
                    mapping.record_error(
                        crate::EngineError::as_iomap(&e).map_or(libc::EIO, |i| i.errno()),
                        format!(
                            "writeback of file bytes {run_pos}..{}: {e}",
                            folio.pos() + b as u64
                        ),
                    );
                    first_error.get_or_insert(e);
                }
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(total),
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
    let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
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
