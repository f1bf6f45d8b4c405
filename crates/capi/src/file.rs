//! Open files: open/close, pread/pwrite, fsync/fdatasync, fallocate (and
//! punch), truncate, stat.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use iomap::IomapFile;
use iomapfs_fs::{File, OpenFlags};

use crate::error::{guard_i64, guard_int, Failure, Outcome};
use crate::handles::{self, HandleKind};
use crate::volume::{c_str, iomapfs_stat, iomapfs_volume, stat_out, volume, VolumeShared};

/// Create the file if it does not exist.
pub const IOMAPFS_O_CREAT: u32 = 1 << 0;
/// With `IOMAPFS_O_CREAT`: fail with `-EEXIST` if it exists.
pub const IOMAPFS_O_EXCL: u32 = 1 << 1;
/// Truncate to length 0 on open.
pub const IOMAPFS_O_TRUNC: u32 = 1 << 2;
/// Direct I/O: no cache between the caller and the device; any offset,
/// length and buffer address (whole device blocks at aligned offsets, from
/// aligned memory, go straight to the device).
pub const IOMAPFS_O_DIRECT: u32 = 1 << 3;
/// Each write is durable (data and the metadata to reach it) when it
/// returns.
pub const IOMAPFS_O_DSYNC: u32 = 1 << 4;
/// As `IOMAPFS_O_DSYNC`, and all inode metadata too.
pub const IOMAPFS_O_SYNC: u32 = 1 << 5;
/// Read-only: writes fail with `-EINVAL`.
pub const IOMAPFS_O_RDONLY: u32 = 1 << 6;

const ALL_OPEN_FLAGS: u32 = IOMAPFS_O_CREAT
    | IOMAPFS_O_EXCL
    | IOMAPFS_O_TRUNC
    | IOMAPFS_O_DIRECT
    | IOMAPFS_O_DSYNC
    | IOMAPFS_O_SYNC
    | IOMAPFS_O_RDONLY;

/// `iomapfs_fallocate` mode: do not change the file size.
pub const IOMAPFS_FALLOC_KEEP_SIZE: u32 = 1 << 0;
/// `iomapfs_fallocate` mode: deallocate the range (it reads as zeros);
/// needs `IOMAPFS_FALLOC_KEEP_SIZE` too, as Linux does.
pub const IOMAPFS_FALLOC_PUNCH_HOLE: u32 = 1 << 1;

/// An open regular file.
///
/// Thread-safety: like a file descriptor. Any number of threads may call
/// `iomapfs_pread`, `iomapfs_pwrite`, `iomapfs_fsync`, ... on the same
/// file at once, and queue requests on it from their own queues;
/// concurrent direct writes to disjoint byte ranges never damage each
/// other. `iomapfs_file_close` must be the last call on it, with no
/// request on it still in any queue.
pub struct iomapfs_file {
    pub(crate) file: File,
    /// Keeps the volume from closing under the file.
    pub(crate) _vol: Arc<VolumeShared>,
}

/// The file behind `file`.
///
/// # Safety
/// `file` is NULL or a file from `iomapfs_file_open` not yet closed.
pub(crate) unsafe fn file_ref<'a>(file: *const iomapfs_file) -> Outcome<&'a iomapfs_file> {
    // SAFETY: the caller's contract above; `as_ref` handles NULL.
    unsafe { file.as_ref() }.ok_or_else(|| Failure::invalid("file is NULL"))
}

fn open_flags(flags: u32) -> Outcome<OpenFlags> {
    if flags & !ALL_OPEN_FLAGS != 0 {
        return Err(Failure::invalid(format!(
            "unknown open flags {:#x} (known: IOMAPFS_O_*, {ALL_OPEN_FLAGS:#x})",
            flags & !ALL_OPEN_FLAGS
        )));
    }
    let has = |bit| flags & bit != 0;
    Ok(OpenFlags {
        create: has(IOMAPFS_O_CREAT),
        exclusive: has(IOMAPFS_O_EXCL),
        truncate: has(IOMAPFS_O_TRUNC),
        direct: has(IOMAPFS_O_DIRECT),
        dsync: has(IOMAPFS_O_DSYNC),
        sync: has(IOMAPFS_O_SYNC),
        read_only: has(IOMAPFS_O_RDONLY),
    })
}

fn len_of(len: usize) -> Outcome<()> {
    if len > isize::MAX as usize {
        return Err(Failure::invalid(format!("length {len} exceeds SSIZE_MAX")));
    }
    Ok(())
}

/// Opens the regular file `path` with `IOMAPFS_O_*` flags; stores it in
/// `*out` and returns 0, or returns `-errno`.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string; `out` points
/// to writable room for a pointer.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_file_open(
    vol: *mut iomapfs_volume,
    path: *const c_char,
    flags: u32,
    out: *mut *mut iomapfs_file,
) -> c_int {
    guard_int("iomapfs_file_open", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let file = v
            .shared
            .vol
            .open_file(path, open_flags(flags)?)
            .map_err(|e| Failure::fs(&e))?;
        let handle = Box::into_raw(Box::new(iomapfs_file {
            file,
            _vol: v.shared.clone(),
        }));
        handles::register(HandleKind::File, handle as usize);
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write(handle) };
        Ok(0)
    })
}

/// Closes a file. Cached data it wrote stays cached until written back
/// (`iomapfs_fsync` first to know it is durable). `-EBADF`: not an open
/// file.
///
/// # Safety
/// `file` is NULL or a pointer `iomapfs_file_open` returned; no other call
/// on it may run concurrently, and no queue may hold a request on it.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_file_close(file: *mut iomapfs_file) -> c_int {
    guard_int("iomapfs_file_close", || {
        if file.is_null() {
            return Err(Failure::invalid("file is NULL"));
        }
        handles::unregister(HandleKind::File, file as usize)?;
        // SAFETY: made by Box::into_raw in iomapfs_file_open and just
        // unregistered, so freed exactly once.
        drop(unsafe { Box::from_raw(file) });
        Ok(0)
    })
}

/// Reads up to `len` bytes at `offset` into `buf`; returns the bytes read
/// (short only at end of file) or `-errno`.
///
/// # Safety
/// `file` is an open file; `buf` is valid for writes of `len` bytes (may
/// be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn iomapfs_pread(
    file: *mut iomapfs_file,
    buf: *mut c_void,
    len: usize,
    offset: u64,
) -> i64 {
    guard_i64("iomapfs_pread", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        len_of(len)?;
        if len == 0 {
            return Ok(0);
        }
        if buf.is_null() {
            return Err(Failure::invalid("buf is NULL"));
        }
        // SAFETY: non-NULL, valid for `len` bytes of writes per the
        // contract, and `len` fits isize; no other Rust reference to that
        // memory exists during the call.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
        let n = f.file.pread(dst, offset).map_err(|e| Failure::fs(&e))?;
        Ok(n as i64)
    })
}

/// Writes `len` bytes from `buf` at `offset`; returns `len` or `-errno`
/// (nothing is written on `-ENOSPC`). With `IOMAPFS_O_DSYNC`/`_SYNC` the
/// data is durable when it returns.
///
/// # Safety
/// `file` is an open file; `buf` is valid for reads of `len` bytes (may be
/// NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn iomapfs_pwrite(
    file: *mut iomapfs_file,
    buf: *const c_void,
    len: usize,
    offset: u64,
) -> i64 {
    guard_i64("iomapfs_pwrite", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        len_of(len)?;
        if len == 0 {
            return Ok(0);
        }
        if buf.is_null() {
            return Err(Failure::invalid("buf is NULL"));
        }
        // SAFETY: non-NULL and valid for `len` bytes of reads per the
        // contract; `len` fits isize.
        let src = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
        let n = f.file.pwrite(src, offset).map_err(|e| Failure::fs(&e))?;
        Ok(n as i64)
    })
}

/// Makes the file's data and metadata durable (writes back its cached data
/// and commits). Reports, once per file handle, a writeback error met since
/// the last `iomapfs_fsync`.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_fsync(file: *mut iomapfs_file) -> c_int {
    guard_int("iomapfs_fsync", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        f.file.fsync().map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Makes the file's data and the metadata needed to read it durable.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_fdatasync(file: *mut iomapfs_file) -> c_int {
    guard_int("iomapfs_fdatasync", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        f.file.fdatasync().map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// `mode` 0: allocates `[offset, offset+len)` (unwritten: reads zeros) and
/// raises the size to cover it; `IOMAPFS_FALLOC_KEEP_SIZE`: allocates
/// without changing the size; `IOMAPFS_FALLOC_PUNCH_HOLE |
/// IOMAPFS_FALLOC_KEEP_SIZE`: deallocates the range. `-ENOSPC` changes
/// nothing.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_fallocate(
    file: *mut iomapfs_file,
    mode: u32,
    offset: u64,
    len: u64,
) -> c_int {
    guard_int("iomapfs_fallocate", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        let keep = mode & IOMAPFS_FALLOC_KEEP_SIZE != 0;
        let punch = mode & IOMAPFS_FALLOC_PUNCH_HOLE != 0;
        if mode & !(IOMAPFS_FALLOC_KEEP_SIZE | IOMAPFS_FALLOC_PUNCH_HOLE) != 0 {
            return Err(Failure::new(
                libc::EOPNOTSUPP,
                format!("mode {mode:#x}: only KEEP_SIZE and PUNCH_HOLE are supported"),
            ));
        }
        let result = if punch {
            if !keep {
                return Err(Failure::new(
                    libc::EOPNOTSUPP,
                    "PUNCH_HOLE needs KEEP_SIZE too (as on Linux)",
                ));
            }
            f.file.punch_hole(offset, len)
        } else {
            f.file.fallocate(offset, len, keep)
        };
        result.map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Sets the file's size: shrinking frees the space past it, growing leaves
/// a hole.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_truncate(file: *mut iomapfs_file, size: u64) -> c_int {
    guard_int("iomapfs_truncate", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        f.file.truncate(size).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Stats an open file into `*out`.
///
/// # Safety
/// `file` is an open file; `out` points to writable room for an
/// `iomapfs_stat`.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_file_stat(
    file: *mut iomapfs_file,
    out: *mut iomapfs_stat,
) -> c_int {
    guard_int("iomapfs_file_stat", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        let st = f.file.stat().map_err(|e| Failure::fs(&e))?;
        stat_out(&st, out)?;
        Ok(0)
    })
}

/// Drops the file's clean cached data, as `posix_fadvise(POSIX_FADV_DONTNEED)`
/// does on Linux (fio's `invalidate=1`): later reads of it go to the
/// device. Dirty data stays cached until written back. Nothing to do for
/// a direct file with nothing cached.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_file_drop_cache(file: *mut iomapfs_file) -> c_int {
    guard_int("iomapfs_file_drop_cache", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        f.file.mapping().drop_clean();
        Ok(0)
    })
}

/// Bytes of the file's data in the page cache now (clean or dirty), or
/// `-errno`.
///
/// # Safety
/// `file` is an open file.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_file_cached_bytes(file: *mut iomapfs_file) -> i64 {
    guard_i64("iomapfs_file_cached_bytes", || {
        // SAFETY: the caller's contract above.
        let f = unsafe { file_ref(file) }?;
        let spans = f.file.mapping().folio_spans();
        Ok(spans.iter().map(|&(_, len)| len as i64).sum())
    })
}
