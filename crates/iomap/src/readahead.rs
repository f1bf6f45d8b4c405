//! Asynchronous readahead: while a sequential reader copies one window out
//! of the cache, background threads read the next ones in, so the device
//! and the copy overlap (as the kernel's async readahead does).
//!
//! The window is the reader's folio size ([`crate::buffered_io`] doubles it
//! while the reads stay sequential, up to 2 MiB); once it reaches
//! [`ASYNC_READAHEAD_MIN_BYTES`], each read makes sure the whole window
//! after it is cached, being read or queued. The threads belong to the
//! volume's cache ([`crate::folio_cache::READAHEAD_THREADS`]: neighbouring
//! windows go to different threads, so two device reads are in flight),
//! start on first use, and each takes its jobs in order; a job holds a
//! handle on its file (so the file stays open) and the inode's I/O lock
//! shared while it reads (so truncate and punch wait for it). A reader
//! that reaches a folio being filled waits on that folio's lock.
//!
//! # Fault model
//!
//! Readahead is a hint. A job that fails (device error, no memory) leaves
//! its blocks not uptodate and reports nothing: the reader then reads them
//! itself and gets the error.

use std::sync::atomic::Ordering;

use crate::buffered_io::{block_bytes, fill};
use crate::{IomapFile, IomapOps};

/// Smallest window read ahead asynchronously: below it, a reader's own
/// folio reads are readahead enough.
pub const ASYNC_READAHEAD_MIN_BYTES: usize = 64 << 10;

/// After a sequential read of `[.., end)` with folio window `window`:
/// makes sure `[end, end + window)` is cached or being read ahead, inside
/// EOF `eof`.
pub(crate) fn schedule<F: IomapFile>(file: &F, end: u64, window: usize, eof: u64) {
    if window < ASYNC_READAHEAD_MIN_BYTES || end >= eof {
        return;
    }
    let mapping = file.mapping();
    let ahead = &mapping.shared.readahead_end;
    let mut from = ahead.load(Ordering::Relaxed).max(end);
    // A whole window ahead, read a whole window at a time (the kernel's
    // readahead mark sits on the first folio of the window it read ahead):
    // the first read inside a window queues the next one, so the device
    // goes from one window to the next while the reader copies. With half
    // a window, the device sat idle while the reader copied the first half
    // of each window (cold 64 KiB reads: the readahead thread idle for a
    // third of each pass).
    if from >= end + window as u64 {
        return;
    }
    // Cached already (a warm file): move the mark past it, nothing to read.
    while let Some(folio) = mapping.find(from) {
        from = folio.end();
        if from >= end + window as u64 {
            ahead.fetch_max(from, Ordering::Relaxed);
            return;
        }
    }
    let target = (from + window as u64).min(eof);
    if from >= target || ahead.fetch_max(target, Ordering::AcqRel) >= target {
        return;
    }
    let Ok(held) = file.hold() else {
        return;
    };
    let queued = mapping
        .cache()
        .readahead(from)
        .submit(Box::new(move || read_ahead(&held, from, target, window)));
    if !queued {
        // No thread: the reader's own reads fill the window.
        ahead.fetch_min(from, Ordering::Relaxed);
    }
}

/// Reads `[from, to)` into the cache in folios of `window` bytes.
fn read_ahead<F: IomapFile>(file: &F, from: u64, to: u64, window: usize) {
    let _shared = file.as_ref().lock_shared();
    let Ok(eof) = file.ops().size(file.inode()) else {
        return;
    };
    let (mapping, bs) = (file.mapping(), block_bytes(file.ops()));
    let mut cur = from;
    while cur < to.min(eof) {
        let Ok(folio) = mapping.find_or_create(cur, window, bs) else {
            return;
        };
        {
            let mut state = folio.lock();
            if !state.evicted {
                let all = folio.blocks_of(0, folio.len());
                if !state.uptodate.all(all.clone())
                    && fill(file, &folio, &mut state, all, eof).is_err()
                {
                    return;
                }
            }
        }
        cur = folio.end();
    }
}
