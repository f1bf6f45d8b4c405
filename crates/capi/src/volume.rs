//! Volumes: format, open, close, the namespace (mkdir, readdir, rename,
//! unlink, rmdir, stat), statfs, sync.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use blockdev::Backend;
use iomapfs_fs::{FileKind, FormatOptions, MountOptions, Stat, Volume};

use crate::error::{guard_int, Failure, Outcome};
use crate::handles::{self, HandleKind};

/// Backend choice: io_uring where the device takes NOWAIT submission;
/// where it does not (zram, for one, would punt every io_uring request to
/// a kernel worker), the worker pool on more than one CPU, else
/// synchronous system calls.
pub const IOMAPFS_BACKEND_AUTO: u32 = 0;
/// Synchronous `pread`/`pwrite` system calls.
pub const IOMAPFS_BACKEND_SYNC: u32 = 1;
/// io_uring.
pub const IOMAPFS_BACKEND_URING: u32 = 2;
/// Synchronous system calls; a queue's requests run on a pool of worker
/// threads, one per CPU.
pub const IOMAPFS_BACKEND_POOL: u32 = 3;

/// A regular file (`iomapfs_stat.kind`, readdir callbacks).
pub const IOMAPFS_KIND_REGULAR: u32 = 1;
/// A directory.
pub const IOMAPFS_KIND_DIRECTORY: u32 = 2;
/// A symbolic link (made through the mount; this API reads only its
/// attributes).
pub const IOMAPFS_KIND_SYMLINK: u32 = 3;
/// A FIFO, socket, or character or block device node (made through the
/// mount): a name with attributes.
pub const IOMAPFS_KIND_SPECIAL: u32 = 4;

/// How to open a volume. Zeroed (or NULL) means the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iomapfs_volume_options {
    /// `IOMAPFS_BACKEND_*`.
    pub backend: u32,
    /// Bytes of page cache for non-direct files; 0: the default (an eighth
    /// of memory, 64 MiB to 2 GiB). At least 8 MiB.
    pub cache_bytes: u64,
}

/// How to format a volume. Zeroed (or NULL) means the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iomapfs_format_options {
    /// File-system block size: a power of two from 512 to 65536, at least
    /// the device's logical block size; 0: 4096.
    pub block_size: u32,
    /// Journal size in bytes; 0: chosen from the device size.
    pub journal_bytes: u64,
}

/// What `iomapfs_path_stat`/`iomapfs_file_stat` report.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iomapfs_stat {
    pub ino: u64,
    /// `IOMAPFS_KIND_*`.
    pub kind: u32,
    pub nlink: u32,
    pub size: u64,
    /// Bytes of device space allocated (written or unwritten).
    pub allocated_bytes: u64,
    pub block_size: u32,
    pub extents: u32,
    pub mtime_ns: u64,
}

/// What `iomapfs_volume_statfs` reports.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iomapfs_statfs {
    pub block_size: u32,
    /// Bytes in the data area.
    pub data_bytes: u64,
    /// Bytes free for allocation.
    pub free_bytes: u64,
    pub inodes: u64,
}

/// What `iomapfs_volume_cache_info` reports: the page cache that
/// non-direct files read and write through.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct iomapfs_cache_info {
    /// The cache's size (`iomapfs_volume_options.cache_bytes`, or the
    /// default).
    pub size_bytes: u64,
    /// Bytes of file data cached now.
    pub used_bytes: u64,
    /// Of those, bytes not yet written back.
    pub dirty_bytes: u64,
}

/// A mounted volume.
///
/// Thread-safety: every call taking an `iomapfs_volume *` may run
/// concurrently with any other from any thread, except
/// `iomapfs_volume_close`, which must be the last call on it.
pub struct iomapfs_volume {
    pub(crate) shared: Arc<VolumeShared>,
}

/// What a volume's files and queues keep alive: closing the volume is
/// refused while any of them is open.
pub(crate) struct VolumeShared {
    pub vol: Volume,
}

/// Called by a readdir for each entry: `name` (NUL-terminated, valid only
/// during the call), inode number and `IOMAPFS_KIND_*`. Return 0 to go on;
/// anything else stops the listing, and `iomapfs_readdir` returns it.
pub type iomapfs_readdir_fn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, name: *const c_char, ino: u64, kind: u32) -> c_int,
>;

/// Reads a C string argument.
///
/// # Safety
/// `s` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn c_str<'a>(s: *const c_char, what: &str) -> Outcome<&'a str> {
    if s.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string
    // that outlives this call.
    let bytes = unsafe { CStr::from_ptr(s) };
    bytes
        .to_str()
        .map_err(|_| Failure::invalid(format!("{what} is not UTF-8: {bytes:?}")))
}

/// The volume behind `vol`.
///
/// # Safety
/// `vol` is NULL or a volume from `iomapfs_volume_open` not yet closed.
pub(crate) unsafe fn volume<'a>(vol: *const iomapfs_volume) -> Outcome<&'a iomapfs_volume> {
    // SAFETY: the caller's contract above; `as_ref` handles NULL.
    unsafe { vol.as_ref() }.ok_or_else(|| Failure::new(libc::EINVAL, "volume is NULL"))
}

fn backend_of(code: u32) -> Outcome<Backend> {
    match code {
        IOMAPFS_BACKEND_AUTO => Ok(Backend::Auto),
        IOMAPFS_BACKEND_SYNC => Ok(Backend::Sync),
        IOMAPFS_BACKEND_URING => Ok(Backend::Uring),
        IOMAPFS_BACKEND_POOL => Ok(Backend::Pool),
        other => Err(Failure::invalid(format!(
            "backend {other} is not one of IOMAPFS_BACKEND_AUTO/SYNC/URING/POOL (0/1/2/3)"
        ))),
    }
}

pub(crate) fn kind_code(kind: FileKind) -> u32 {
    match kind {
        FileKind::Regular => IOMAPFS_KIND_REGULAR,
        FileKind::Directory => IOMAPFS_KIND_DIRECTORY,
        FileKind::Symlink => IOMAPFS_KIND_SYMLINK,
        FileKind::Fifo | FileKind::Socket | FileKind::CharDevice | FileKind::BlockDevice => {
            IOMAPFS_KIND_SPECIAL
        }
    }
}

pub(crate) fn stat_out(st: &Stat, out: *mut iomapfs_stat) -> Outcome<()> {
    if out.is_null() {
        return Err(Failure::invalid("stat output is NULL"));
    }
    let c = iomapfs_stat {
        ino: st.ino,
        kind: kind_code(st.kind),
        nlink: st.nlink,
        size: st.size,
        allocated_bytes: st.allocated_bytes,
        block_size: st.block_size,
        extents: u32::try_from(st.extents).unwrap_or(u32::MAX),
        mtime_ns: st.mtime.as_ns(),
    };
    // SAFETY: non-NULL; the caller promises room for one iomapfs_stat.
    unsafe { out.write(c) };
    Ok(())
}

/// Formats the device or image file at `path` (everything on it is lost).
/// `opts` may be NULL. Returns 0 or `-errno`.
///
/// # Safety
/// `path` is a NUL-terminated string; `opts` is NULL or points to an
/// `iomapfs_format_options`.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_format(
    path: *const c_char,
    opts: *const iomapfs_format_options,
) -> c_int {
    guard_int("iomapfs_format", || {
        // SAFETY: the caller's contract above.
        let path = unsafe { c_str(path, "path") }?;
        // SAFETY: NULL or a valid options struct, per the contract.
        let o = unsafe { opts.as_ref() }.copied().unwrap_or_default();
        let mut format = FormatOptions::default();
        if o.block_size != 0 {
            format.block_size = o.block_size;
        }
        if o.journal_bytes != 0 {
            format.journal_bytes = Some(o.journal_bytes);
        }
        let (dev, _) = blockdev::open_device(path.as_ref(), false, Backend::Sync)
            .map_err(|e| Failure::new(e.errno(), e.to_string()))?;
        Volume::format(dev, &format).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Opens (mounts) the volume on the device or image file at `path`,
/// recovering its journal if it was not closed cleanly. `opts` may be
/// NULL. On success stores the volume in `*out` and returns 0; else
/// returns `-errno` (`-EUCLEAN`: not iomapfs, or damaged).
///
/// # Safety
/// `path` is a NUL-terminated string; `opts` is NULL or points to an
/// `iomapfs_volume_options`; `out` points to writable room for a pointer.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_volume_open(
    path: *const c_char,
    opts: *const iomapfs_volume_options,
    out: *mut *mut iomapfs_volume,
) -> c_int {
    guard_int("iomapfs_volume_open", || {
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        // SAFETY: the caller's contract above.
        let path = unsafe { c_str(path, "path") }?;
        // SAFETY: NULL or a valid options struct, per the contract.
        let o = unsafe { opts.as_ref() }.copied().unwrap_or_default();
        let backend = backend_of(o.backend)?;
        let mut mount = MountOptions::default();
        if o.cache_bytes != 0 {
            let cache = iomap::CacheConfig::with_size(o.cache_bytes);
            if cache.size_bytes != o.cache_bytes {
                return Err(Failure::invalid(format!(
                    "cache_bytes {}: the cache must hold at least {} bytes",
                    o.cache_bytes, cache.size_bytes
                )));
            }
            mount.cache = cache;
        }
        let (dev, _) = blockdev::open_device(path.as_ref(), false, backend)
            .map_err(|e| Failure::new(e.errno(), e.to_string()))?;
        let vol = Volume::open_with(dev, &mount)
            .map_err(|e| Failure::new(e.errno(), format!("cannot mount {path}: {e}")))?;
        let handle = Box::into_raw(Box::new(iomapfs_volume {
            shared: Arc::new(VolumeShared { vol }),
        }));
        handles::register(HandleKind::Volume, handle as usize);
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(handle) };
        Ok(0)
    })
}

/// Closes (unmounts) a volume: writes back cached data and checkpoints.
/// Refused with `-EBUSY` while files or queues of it are open (close them
/// first; the volume stays usable). Otherwise the handle is gone whatever
/// the result; an error means the final checkpoint failed (what was made
/// durable before is kept; the next open recovers the journal).
/// `-EBADF`: not an open volume (closed twice?). After a volume with
/// large metadata (about 300k extents or more), also returns the heap it
/// freed to the system (glibc's `malloc_trim`, which walks the whole
/// process's free heap: a few ms per 100 MiB).
///
/// # Safety
/// `vol` is NULL or a pointer `iomapfs_volume_open` returned; no other
/// call on it may run concurrently.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_volume_close(vol: *mut iomapfs_volume) -> c_int {
    guard_int("iomapfs_volume_close", || {
        if vol.is_null() {
            return Err(Failure::invalid("volume is NULL"));
        }
        handles::check(HandleKind::Volume, vol as usize)?;
        // SAFETY: registered, so a live volume from iomapfs_volume_open.
        let children = Arc::strong_count(&unsafe { &*vol }.shared) - 1;
        if children > 0 {
            return Err(Failure::new(
                libc::EBUSY,
                format!("{children} files or queues of this volume are still open"),
            ));
        }
        handles::unregister(HandleKind::Volume, vol as usize)?;
        // SAFETY: made by Box::into_raw in iomapfs_volume_open, and just
        // unregistered, so freed exactly once.
        let handle = unsafe { Box::from_raw(vol) };
        let shared = Arc::try_unwrap(handle.shared)
            .map_err(|_| Failure::new(libc::EBUSY, "a file or queue was opened during close"))?;
        shared.vol.unmount().map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Creates the directory `path`.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_mkdir(vol: *mut iomapfs_volume, path: *const c_char) -> c_int {
    guard_int("iomapfs_mkdir", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        v.shared.vol.mkdir(path).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Removes the empty directory `path`.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_rmdir(vol: *mut iomapfs_volume, path: *const c_char) -> c_int {
    guard_int("iomapfs_rmdir", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        v.shared.vol.rmdir(path).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Removes the regular file `path`. Open handles keep its data until they
/// are closed.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_unlink(vol: *mut iomapfs_volume, path: *const c_char) -> c_int {
    guard_int("iomapfs_unlink", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        v.shared.vol.unlink(path).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Atomically renames `from` to `to`, replacing `to` if it exists.
///
/// # Safety
/// `vol` is an open volume; `from` and `to` NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_rename(
    vol: *mut iomapfs_volume,
    from: *const c_char,
    to: *const c_char,
) -> c_int {
    guard_int("iomapfs_rename", || {
        // SAFETY: the caller's contract above.
        let (v, from, to) = unsafe { (volume(vol)?, c_str(from, "from")?, c_str(to, "to")?) };
        v.shared.vol.rename(from, to).map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Calls `cb(ctx, name, ino, kind)` for each entry of the directory
/// `path`, in name order ("." and ".." are not listed). Returns 0 when all
/// were listed, the callback's non-zero value if it stopped the listing,
/// or `-errno`.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string; `cb` a valid
/// function that does not unwind (C functions never do).
#[no_mangle]
pub unsafe extern "C" fn iomapfs_readdir(
    vol: *mut iomapfs_volume,
    path: *const c_char,
    cb: iomapfs_readdir_fn,
    ctx: *mut c_void,
) -> c_int {
    guard_int("iomapfs_readdir", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        let cb = cb.ok_or_else(|| Failure::invalid("callback is NULL"))?;
        let mut entries = v.shared.vol.readdir(path).map_err(|e| Failure::fs(&e))?;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        for entry in entries {
            // Names never hold NUL: the namespace refuses them.
            let name = CString::new(entry.name).unwrap_or_default();
            // SAFETY: `cb` is a valid function per the contract; `name`
            // lives until after the call.
            let stop = unsafe { cb(ctx, name.as_ptr(), entry.ino, kind_code(entry.kind)) };
            if stop != 0 {
                return Ok(stop);
            }
        }
        Ok(0)
    })
}

/// Stats the file or directory `path` into `*out`.
///
/// # Safety
/// `vol` is an open volume; `path` a NUL-terminated string; `out` points
/// to writable room for an `iomapfs_stat`.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_path_stat(
    vol: *mut iomapfs_volume,
    path: *const c_char,
    out: *mut iomapfs_stat,
) -> c_int {
    guard_int("iomapfs_path_stat", || {
        // SAFETY: the caller's contract above.
        let (v, path) = unsafe { (volume(vol)?, c_str(path, "path")?) };
        let st = v.shared.vol.stat(path).map_err(|e| Failure::fs(&e))?;
        stat_out(&st, out)?;
        Ok(0)
    })
}

/// Space usage of the volume into `*out`.
///
/// # Safety
/// `vol` is an open volume; `out` points to writable room for an
/// `iomapfs_statfs`.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_volume_statfs(
    vol: *mut iomapfs_volume,
    out: *mut iomapfs_statfs,
) -> c_int {
    guard_int("iomapfs_volume_statfs", || {
        // SAFETY: the caller's contract above.
        let v = unsafe { volume(vol) }?;
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let s = v.shared.vol.statfs();
        // SAFETY: non-NULL; room for one iomapfs_statfs per the contract.
        unsafe {
            out.write(iomapfs_statfs {
                block_size: s.block_size,
                data_bytes: s.data_bytes,
                free_bytes: s.free_bytes,
                inodes: s.inodes,
            })
        };
        Ok(0)
    })
}

/// The page cache's size and use into `*out`.
///
/// # Safety
/// `vol` is an open volume; `out` points to writable room for an
/// `iomapfs_cache_info`.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_volume_cache_info(
    vol: *mut iomapfs_volume,
    out: *mut iomapfs_cache_info,
) -> c_int {
    guard_int("iomapfs_volume_cache_info", || {
        // SAFETY: the caller's contract above.
        let v = unsafe { volume(vol) }?;
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        let cache = v.shared.vol.cache();
        let info = iomapfs_cache_info {
            size_bytes: cache.config().size_bytes,
            used_bytes: cache.used_bytes(),
            dirty_bytes: cache.dirty_bytes(),
        };
        // SAFETY: non-NULL; room for one iomapfs_cache_info per the
        // contract.
        unsafe { out.write(info) };
        Ok(0)
    })
}

/// Writes back every file's cached data and commits: everything done
/// before is durable when it returns 0.
///
/// # Safety
/// `vol` is an open volume.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_sync(vol: *mut iomapfs_volume) -> c_int {
    guard_int("iomapfs_sync", || {
        // SAFETY: the caller's contract above.
        let v = unsafe { volume(vol) }?;
        v.shared.vol.sync().map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}

/// Writes back and drops the page cache's clean data (benchmarks: cold
/// reads).
///
/// # Safety
/// `vol` is an open volume.
#[no_mangle]
pub unsafe extern "C" fn iomapfs_drop_caches(vol: *mut iomapfs_volume) -> c_int {
    guard_int("iomapfs_drop_caches", || {
        // SAFETY: the caller's contract above.
        let v = unsafe { volume(vol) }?;
        v.shared.vol.drop_caches().map_err(|e| Failure::fs(&e))?;
        Ok(0)
    })
}
