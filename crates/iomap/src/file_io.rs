//! The synchronous file entry points: what a file system's `pread` and
//! `pwrite` are, and what the asynchronous queue's completion worker runs
//! for requests it cannot complete inline.
//!
//! Handles that are not O_DIRECT go through the folio cache
//! ([`crate::buffered_io`]). A direct read takes the inode's I/O lock shared
//! and either the simple-read fast path or the generic path at any byte
//! offset. A direct write runs the one [write
//! protocol](crate::write_protocol) and then reaches the durability its
//! handle promises through the one completion policy ([`Durability`]).
//! Direct I/O on a file with cached folios writes them back and drops them
//! first, so direct and buffered handles of one file agree.

use std::cell::Cell;

use crate::byte_dio::{dio_read_bytes, dio_write_bytes, write_range};
use crate::dio::dio_read_simple;
use crate::ioend::{DioWriteOutcome, Durability, WriteSync};
use crate::{
    buffered_io, write_protocol, writeback, zero_eof_gap, EngineError, FileError, IomapFile,
    IomapOpFlags, IomapOps,
};

thread_local! {
    /// Reads this thread sent down the simple-read fast path.
    static SIMPLE_READS: Cell<u64> = const { Cell::new(0) };
}

/// Reads this thread has sent down the simple-read fast path: how tests
/// (and curious users) see that a read qualified. A thread-local counter,
/// so counting costs no shared cache line.
pub fn simple_reads_on_this_thread() -> u64 {
    SIMPLE_READS.with(Cell::get)
}

/// Reads up to `buf.len()` bytes at `pos`; returns the bytes read (short at
/// EOF).
pub fn read<F: IomapFile>(file: &F, pos: u64, buf: &mut [u8]) -> Result<usize, FileError<F>> {
    if !file.is_direct() {
        return buffered_io::read(file, pos, buf);
    }
    file.check_io(pos, buf.len() as u64, false)?;
    buffered_io::flush_and_invalidate(file, 0, u64::MAX)?;
    let (ops, dev, inode) = (file.ops(), &**file.device(), file.inode());
    let _shared = file.as_ref().lock_shared();
    if file.is_direct() {
        if let Some(result) = dio_read_simple(ops, dev, inode, pos, buf) {
            SIMPLE_READS.with(|n| n.set(n.get() + 1));
            return result;
        }
    }
    dio_read_bytes(ops, dev, inode, pos, buf, IomapOpFlags::DIRECT)
}

/// Writes `buf` at `pos` and makes it as durable as the handle promises
/// ([`IomapFile::write_sync`]).
///
/// A write that needs the file's exclusive lock (it extends, zeroes, or
/// allocates or converts other than whole file-system blocks inside the
/// on-disk EOF, or is the file's first that is not whole device blocks) first
/// waits for the file's direct I/O in flight, asynchronous requests
/// included: never call it from the thread that owns such requests
/// unreaped.
pub fn write<F: IomapFile>(
    file: &F,
    pos: u64,
    buf: &[u8],
) -> Result<DioWriteOutcome, FileError<F>> {
    if !file.is_direct() {
        let written = buffered_io::write(file, pos, buf)?;
        return Ok(DioWriteOutcome {
            written: written as u64,
            pure_overwrite: false,
            fua: false,
            ..DioWriteOutcome::NOTHING
        });
    }
    let len = buf.len() as u64;
    file.check_io(pos, len, true)?;
    if buf.is_empty() {
        return Ok(DioWriteOutcome {
            fua: false,
            ..DioWriteOutcome::NOTHING
        });
    }
    buffered_io::flush_and_invalidate(file, 0, u64::MAX)?;
    let (ops, dev, inode) = (file.ops(), &**file.device(), file.inode());
    let sync = file.write_sync();
    let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
    if sync == WriteSync::Dsync {
        // O_SYNC never takes the durable-write shortcut: it commits inode
        // metadata too.
        flags |= IomapOpFlags::DSYNC;
    }
    let lock = file.as_ref();
    let outcome = write_protocol::write_waiting(
        lock,
        write_range(dev, pos, len)?,
        |_holds| {
            // As a pure overwrite first: that mapping needs only the
            // metadata read lock, allocating ones its write lock.
            match dio_write_bytes(
                ops,
                dev,
                inode,
                pos,
                buf,
                flags | IomapOpFlags::OVERWRITE_ONLY,
            ) {
                Err(e)
                    if e.is_would_block() && allocates_under_shared_lock(ops, inode, pos, len)? =>
                {
                    dio_write_bytes(ops, dev, inode, pos, buf, flags)
                }
                done => done,
            }
        },
        |_exclusive| {
            zero_eof_gap(ops, dev, inode, pos)?;
            let _inflight = lock.dio_begin();
            dio_write_bytes(ops, dev, inode, pos, buf, flags)
        },
    );
    let written = outcome.as_ref().map_or(0, |o| o.written as usize);
    update_cache_after_direct_write(file, pos, buf, written);
    let outcome = outcome?;
    Durability::after_write(sync, &outcome).wait(ops, dev, file.flushes())?;
    Ok(outcome)
}

/// After a direct write of `data` at `pos` returned, `written` bytes of
/// it on the device: the cache of the file agrees with the device again
/// (see `Mapping::write_through`); what it cached over bytes the write may
/// have left half done (a failure, a short write) is dropped or read
/// again. A file nobody caches pays one check.
pub(crate) fn update_cache_after_direct_write<F: IomapFile>(
    file: &F,
    pos: u64,
    data: &[u8],
    written: usize,
) {
    let mapping = file.mapping();
    if mapping.is_empty() {
        return;
    }
    let written = written.min(data.len());
    mapping.write_through(pos, &data[..written]);
    if written < data.len() {
        let block = u64::from(file.ops().block_size());
        let from = pos + written as u64;
        let end = pos + data.len() as u64;
        mapping.invalidate(from - from % block, end.next_multiple_of(block));
    }
}

/// [`update_cache_after_direct_write`] for a thread that must not wait
/// (an asynchronous queue's reaper): false when it would have to wait for
/// a folio's lock, or has to drop what a short write left behind (that
/// waits for writebacks); the caller then hands the whole update to a
/// thread that may wait, before completing the write.
pub(crate) fn try_update_cache_after_direct_write<F: IomapFile>(
    file: &F,
    pos: u64,
    data: &[u8],
    written: usize,
) -> bool {
    let mapping = file.mapping();
    if mapping.is_empty() {
        return true;
    }
    written >= data.len() && mapping.try_write_through(pos, data)
}

/// Whether a direct write may allocate and convert under the shared lock,
/// as XFS's aligned direct writes do: whole file-system blocks inside the
/// on-disk EOF. Such a write zeroes nothing (it covers every block it
/// allocates) and changes no size, and the metadata lock serialises its
/// allocation and conversion with everyone else's; what stays exclusive is
/// zeroing and the EOF. Asked under the shared lock, so the size cannot
/// shrink before the write is done (truncate is exclusive). Without this,
/// every allocating write drained the file's I/O and made its readers
/// queue behind it, and behind whatever the writer waited for (a
/// checkpoint holding the metadata lock).
fn allocates_under_shared_lock<O: IomapOps>(
    ops: &O,
    inode: &O::Inode,
    pos: u64,
    len: u64,
) -> Result<bool, O::Error> {
    let block = u64::from(ops.block_size());
    Ok(pos.is_multiple_of(block)
        && len.is_multiple_of(block)
        && pos + len <= ops.disk_size(inode)?)
}

/// `fsync`/`fdatasync`: writes back the file's cached data and waits, reports
/// a writeback error this handle has not seen yet (once), and commits the
/// metadata (one journal commit covers every file).
pub fn fsync<F: IomapFile>(file: &F) -> Result<(), FileError<F>> {
    writeback::sync_file(file)
}
