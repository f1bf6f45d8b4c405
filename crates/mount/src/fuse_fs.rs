//! The FUSE request handlers: each kernel request becomes one call of the
//! iomapfs [`Volume`] API by inode, and its error becomes the errno the
//! library already names (`Error::errno`).
//!
//! Caching ([`Caching`]): an `O_DIRECT` open reaches an iomapfs direct
//! handle (device I/O at any offset and length); any other open reaches an
//! iomapfs buffered handle (iomapfs's folio cache). What the kernel does in
//! front of them depends on the mode:
//! - `DirectIo`: every open is answered with `FOPEN_DIRECT_IO`, so the
//!   kernel page cache never holds file data (except pages of a shared
//!   mapping, which the kernel writes back before and drops after direct
//!   I/O, `FUSE_DIRECT_IO_ALLOW_MMAP`). The two kinds of handle are kept
//!   coherent by iomapfs itself, as for the library: direct I/O on a file
//!   with cached folios writes them back and drops them first.
//! - `KernelCache`: non-direct opens keep the kernel's cached pages
//!   (`FOPEN_KEEP_CACHE`), so a cached read never reaches the daemon;
//!   writes update the page cache and reach iomapfs before they return.
//!   `O_DIRECT` opens take the kernel's generic direct I/O path, which
//!   writes back the range's dirty pages before and drops its cached pages
//!   after, as for any local file system: every change to the volume
//!   passes through this kernel, so what it caches stays current.
//! - `Writeback`: as `KernelCache`, and buffered writes stay dirty in the
//!   page cache until the kernel writes them back (`FUSE_WRITEBACK_CACHE`);
//!   fsync writes them back and then asks the daemon to sync.
//!
//! In every mode direct I/O from asynchronous callers is asynchronous here
//! too (`FUSE_ASYNC_DIO`): queue depth reaches the daemon.
//!
//! Attributes and names are cached by the kernel for [`ATTR_TTL`]: this
//! daemon is the only writer of the volume, and every change made through
//! the mount passes through the kernel, which updates or drops what it
//! cached.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use blockdev::AlignedBuf;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags as FuseOpenFlags, RenameFlags as FuseRename,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use iomapfs_fs::{
    DirEntry, Error, File, FileKind, Ino, NewNode, OpenFlags, RenameFlags, SeekFor, SetAttr, Stat,
    TimeSet, Timestamp, Volume, XattrSet,
};
use parking_lot::RwLock;

use crate::config::Caching;

/// How long the kernel may trust attributes and names it was given.
pub const ATTR_TTL: Duration = Duration::from_secs(1);

/// Largest read or write the kernel sends in one request.
pub const MAX_IO_BYTES: u32 = 1 << 20;

/// Requests the kernel keeps queued for the daemon on behalf of
/// asynchronous callers (readahead, writeback, asynchronous direct I/O):
/// a queue depth of 32 and then some.
pub const MAX_BACKGROUND: u16 = 64;

/// A directory as `opendir` saw it: `readdir` pages through this snapshot,
/// so entries added or removed meanwhile never shift the offsets.
struct DirSnapshot {
    ino: Ino,
    entries: Vec<DirEntry>,
}

/// The file system a mount serves. Clones share everything (the volume
/// and the open handles): the io_uring transport answers reads and writes
/// with a clone while fuser's threads answer the rest with another.
#[derive(Clone)]
pub struct IomapFuse {
    vol: Volume,
    /// Whether and how the kernel page cache holds file data.
    caching: Caching,
    /// `-o ro`: refuse every change with EROFS (the kernel refuses them
    /// first; this holds should one get through).
    read_only: bool,
    handles: Arc<Handles>,
}

/// The open files and directories, by the handle the kernel was given.
struct Handles {
    files: RwLock<HashMap<u64, Arc<File>>>,
    dirs: RwLock<HashMap<u64, Arc<DirSnapshot>>>,
    next: AtomicU64,
}

impl IomapFuse {
    /// Serves `vol`, with the kernel page cache as `caching` says, and
    /// read-only if `read_only`.
    pub fn new(vol: Volume, caching: Caching, read_only: bool) -> IomapFuse {
        IomapFuse {
            vol,
            caching,
            read_only,
            handles: Arc::new(Handles {
                files: RwLock::new(HashMap::new()),
                dirs: RwLock::new(HashMap::new()),
                next: AtomicU64::new(1),
            }),
        }
    }

    /// `Err(EROFS)` on a read-only mount: for every request that would
    /// change the volume.
    fn writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<File>, Errno> {
        self.handles
            .files
            .read()
            .get(&fh.0)
            .cloned()
            .ok_or(Errno::EBADF)
    }

    fn dir(&self, fh: FileHandle) -> Result<Arc<DirSnapshot>, Errno> {
        self.handles
            .dirs
            .read()
            .get(&fh.0)
            .cloned()
            .ok_or(Errno::EBADF)
    }

    fn add_file(&self, file: File) -> FileHandle {
        let fh = self.handles.next.fetch_add(1, Ordering::Relaxed);
        self.handles.files.write().insert(fh, Arc::new(file));
        FileHandle(fh)
    }

    /// What `FUSE_HANDLE_KILLPRIV_V2` leaves to this daemon on a write by
    /// a caller without `CAP_FSETID`: set-user-ID dropped, and
    /// set-group-ID where group execute is set (otherwise it marks
    /// mandatory locking, not privilege). iomapfs keeps no
    /// `security.capability` to drop.
    fn kill_suidgid(&self, file: &File) -> Result<(), Errno> {
        let mode = file.stat().map_err(errno)?.mode & 0o7777;
        let mut kept = mode & !libc::S_ISUID;
        if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            let change = SetAttr {
                mode: Some(kept),
                ..SetAttr::default()
            };
            self.vol.set_attr(file.ino(), &change).map_err(errno)?;
        }
        Ok(())
    }

    /// Memory alignment the device takes without a bounce buffer: a
    /// buffer aligned so receives a direct read or gives a direct write
    /// with no copy.
    pub fn memory_alignment(&self) -> usize {
        (self.vol.device().caps().memory_alignment as usize).max(1)
    }

    /// READ of `out.len()` bytes at `offset` through handle `fh`, into
    /// `out`; the bytes read (fewer at the end of the file).
    pub(crate) fn read_at(
        &self,
        fh: FileHandle,
        offset: u64,
        out: &mut [u8],
    ) -> Result<usize, Errno> {
        self.file(fh)?.pread(out, offset).map_err(errno)
    }

    /// WRITE of `data` at `offset` through handle `fh`, first dropping
    /// set-user-ID and set-group-ID if the kernel asks (`kill_suidgid`);
    /// the bytes written.
    pub(crate) fn write_at(
        &self,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        kill_suidgid: bool,
    ) -> Result<usize, Errno> {
        self.writable()?;
        let file = self.file(fh)?;
        if kill_suidgid {
            self.kill_suidgid(&file)?;
        }
        let align = self.memory_alignment();
        if !file.flags().direct || (data.as_ptr() as usize).is_multiple_of(align) {
            // Copied into folios (any address will do), or taken by the
            // device where it lies.
            return file.pwrite(data, offset).map_err(errno);
        }
        // A /dev/fuse request's bytes sit just past its headers, an
        // address the device cannot take: one copy here saves the device
        // layer a fresh zeroed bounce buffer and the same copy.
        with_io_buffer(data.len(), align, |buf| {
            let buf = buf?;
            buf.copy_from_slice(data);
            file.pwrite(buf, offset).map_err(errno)
        })
    }

    fn entry(&self, st: &Stat, reply: ReplyEntry) {
        reply.entry(&ATTR_TTL, &file_attr(st), Generation(0));
    }

    /// A handle to change the size of `ino` with: the caller's if it gave
    /// one, else a new one.
    fn handle_for_size(&self, ino: Ino, fh: Option<FileHandle>) -> Result<Arc<File>, Errno> {
        if let Some(file) = fh.and_then(|fh| self.handles.files.read().get(&fh.0).cloned()) {
            return Ok(file);
        }
        self.vol
            .open_ino(ino, OpenFlags::default())
            .map(Arc::new)
            .map_err(errno)
    }
}

thread_local! {
    /// The data buffer of this request thread (see [`with_io_buffer`]).
    static IO_BUFFER: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` with `len` bytes of this thread's data buffer, aligned to
/// `align`: every read and direct write a request thread serves reuses
/// one buffer (at least [`MAX_IO_BYTES`]) instead of a fresh zeroed one,
/// and the device takes its address without bouncing. `Err(ENOMEM)` if
/// it cannot be had.
fn with_io_buffer<R>(len: usize, align: usize, f: impl FnOnce(Result<&mut [u8], Errno>) -> R) -> R {
    IO_BUFFER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let fits = slot
            .as_ref()
            .is_some_and(|b| b.len() >= len && (b.as_ptr() as usize).is_multiple_of(align));
        if !fits {
            *slot = AlignedBuf::new(len.max(MAX_IO_BYTES as usize), align).ok();
        }
        match slot.as_mut() {
            Some(buf) => f(Ok(&mut buf[..len])),
            None => f(Err(Errno::ENOMEM)),
        }
    })
}

/// The errno for an iomapfs error (the library names it already).
fn errno(e: Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// A name to create: iomapfs keeps UTF-8 names only, and refuses any
/// other with EILSEQ ("invalid or incomplete multibyte character", as
/// file systems that insist on UTF-8 names do) rather than store other
/// bytes than it was given.
fn new_name(name: &OsStr) -> Result<&str, Errno> {
    name.to_str().ok_or(Errno::EILSEQ)
}

/// A name to find: one that is not UTF-8 cannot be on the volume.
fn existing_name(name: &OsStr) -> Result<&str, Errno> {
    name.to_str().ok_or(Errno::ENOENT)
}

fn system_time(t: Timestamp) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs()) + Duration::from_nanos(t.nsec.into())
    }
}

fn timestamp(t: SystemTime) -> Timestamp {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(before) => {
            let d = before.duration();
            // -1.25 s is sec -2, nsec 750_000_000.
            let (sec, nsec) = if d.subsec_nanos() == 0 {
                (-(d.as_secs() as i64), 0)
            } else {
                (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
            };
            Timestamp { sec, nsec }
        }
    }
}

fn time_set(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => TimeSet::At(timestamp(t)),
    }
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Regular => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

/// What `stat` says, as the kernel wants it.
pub fn file_attr(st: &Stat) -> FileAttr {
    FileAttr {
        ino: INodeNo(st.ino),
        size: st.size,
        blocks: st.allocated_bytes.div_ceil(512),
        atime: system_time(st.atime),
        mtime: system_time(st.mtime),
        ctime: system_time(st.ctime),
        crtime: system_time(st.btime),
        kind: file_type(st.kind),
        perm: st.mode as u16,
        nlink: st.nlink,
        uid: st.uid,
        gid: st.gid,
        rdev: st.rdev as u32,
        blksize: st.block_size,
        flags: 0,
    }
}

/// What an `open` or `create` asks of iomapfs.
fn open_flags(flags: i32) -> OpenFlags {
    OpenFlags {
        direct: flags & libc::O_DIRECT != 0,
        // O_SYNC includes the O_DSYNC bit.
        sync: flags & libc::O_SYNC == libc::O_SYNC,
        dsync: flags & libc::O_DSYNC != 0,
        read_only: FuseOpenFlags(flags).acc_mode() == OpenAccMode::O_RDONLY,
        ..OpenFlags::default()
    }
}

/// How the kernel is to treat an open (see the module header): without
/// the kernel cache every open bypasses the page cache, and writes to one
/// file may run in parallel (iomapfs locks ranges itself); with it, a
/// non-direct open keeps the file's cached pages (every change passes
/// through this kernel, which keeps them current), and an `O_DIRECT` open
/// takes the kernel's own direct I/O path, which writes cached pages back
/// before and drops them after.
fn fopen_flags(flags: i32, caching: Caching) -> FopenFlags {
    match (caching, flags & libc::O_DIRECT != 0) {
        (Caching::DirectIo, _) => {
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
        }
        (Caching::KernelCache | Caching::Writeback, false) => FopenFlags::FOPEN_KEEP_CACHE,
        (Caching::KernelCache | Caching::Writeback, true) => FopenFlags::empty(),
    }
}

/// The kind and permission bits of a `mknod`/`create` mode, umask applied.
fn new_node(req: &Request, mode: u32, umask: u32, kind: FileKind) -> NewNode {
    NewNode {
        kind,
        mode: mode & !umask & 0o7777,
        uid: req.uid(),
        gid: req.gid(),
        rdev: 0,
    }
}

macro_rules! tri {
    ($reply:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => return $reply.error(err),
        }
    };
}

impl Filesystem for IomapFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_IO_BYTES);
        // Direct I/O from an asynchronous caller (io_uring, AIO) is queued
        // and completed without a kernel thread blocked per request, and a
        // large synchronous one goes out as all its requests at once; up to
        // MAX_BACKGROUND of them wait for the daemon.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        // This daemon drops set-user-ID and set-group-ID on writes the
        // kernel marks (`kill_suidgid`), so the kernel need not ask for
        // `security.capability` (a GETXATTR round trip) before every
        // write to see whether to drop it.
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        if self.caching == Caching::Writeback {
            // Writes land in the page cache; the kernel writes them back.
            let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        }
        // Shared mmap of files opened with FOPEN_DIRECT_IO, and directory
        // operations in parallel (iomapfs serialises them itself).
        let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = tri!(reply, existing_name(name));
        let st = tri!(reply, self.vol.lookup(parent.0, name).map_err(errno));
        self.entry(&st, reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = match fh.and_then(|fh| self.handles.files.read().get(&fh.0).cloned()) {
            Some(file) => file.stat(),
            None => self.vol.stat_ino(ino.0),
        };
        let st = tri!(reply, st.map_err(errno));
        reply.attr(&ATTR_TTL, &file_attr(&st));
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        tri!(reply, self.writable());
        if let Some(size) = size {
            let file = tri!(reply, self.handle_for_size(ino.0, fh));
            tri!(reply, file.truncate(size).map_err(errno));
        }
        let change = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            atime: atime.map(time_set),
            mtime: mtime.map(time_set),
        };
        let st = if change == SetAttr::default() {
            self.vol.stat_ino(ino.0)
        } else {
            self.vol.set_attr(ino.0, &change)
        };
        let st = tri!(reply, st.map_err(errno));
        reply.attr(&ATTR_TTL, &file_attr(&st));
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let target = tri!(reply, self.vol.readlink_ino(ino.0).map_err(errno));
        reply.data(&target);
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(name));
        let kind = tri!(reply, FileKind::from_mode(mode).ok_or(Errno::EINVAL));
        if kind == FileKind::Directory || kind == FileKind::Symlink {
            return reply.error(Errno::EINVAL);
        }
        let mut node = new_node(req, mode, umask, kind);
        if matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) {
            node.rdev = rdev.into();
        }
        let st = tri!(
            reply,
            self.vol.make_node(parent.0, name, node, &[]).map_err(errno)
        );
        self.entry(&st, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(name));
        let node = new_node(req, mode, umask, FileKind::Directory);
        let st = tri!(
            reply,
            self.vol.make_node(parent.0, name, node, &[]).map_err(errno)
        );
        self.entry(&st, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tri!(reply, self.writable());
        let name = tri!(reply, existing_name(name));
        tri!(
            reply,
            self.vol.remove_at(parent.0, name, false).map_err(errno)
        );
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tri!(reply, self.writable());
        let name = tri!(reply, existing_name(name));
        tri!(
            reply,
            self.vol.remove_at(parent.0, name, true).map_err(errno)
        );
        reply.ok();
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        use std::os::unix::ffi::OsStrExt;
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(link_name));
        let node = new_node(req, 0o777, 0, FileKind::Symlink);
        let target = target.as_os_str().as_bytes();
        let st = tri!(
            reply,
            self.vol
                .make_node(parent.0, name, node, target)
                .map_err(errno)
        );
        self.entry(&st, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRename,
        reply: ReplyEmpty,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, existing_name(name));
        let newname = tri!(reply, new_name(newname));
        if flags.contains(FuseRename::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let flags = RenameFlags {
            no_replace: flags.contains(FuseRename::RENAME_NOREPLACE),
            exchange: flags.contains(FuseRename::RENAME_EXCHANGE),
        };
        tri!(
            reply,
            self.vol
                .rename_at(parent.0, name, newparent.0, newname, flags)
                .map_err(errno)
        );
        reply.ok();
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(newname));
        let st = tri!(
            reply,
            self.vol.link_ino(ino.0, newparent.0, name).map_err(errno)
        );
        self.entry(&st, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: FuseOpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            tri!(reply, self.writable());
        }
        let file = tri!(
            reply,
            self.vol.open_ino(ino.0, open_flags(flags.0)).map_err(errno)
        );
        reply.opened(self.add_file(file), fopen_flags(flags.0, self.caching));
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let file = tri!(reply, self.file(fh));
        let align = self.memory_alignment();
        with_io_buffer(size as usize, align, |buf| {
            let buf = tri!(reply, buf);
            let n = tri!(reply, file.pread(buf, offset).map_err(errno));
            reply.data(&buf[..n]);
        })
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let kill_suidgid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        match self.write_at(fh, offset, data, kill_suidgid) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close() promises nothing about durability; fsync does.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.files.write().remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        if self.read_only {
            // Nothing to make durable, and a commit (of the records that
            // free orphans a crash left, say) would be a write.
            return reply.ok();
        }
        let file = tri!(reply, self.file(fh));
        let r = if datasync {
            file.fdatasync()
        } else {
            file.fsync()
        };
        tri!(reply, r.map_err(errno));
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: FuseOpenFlags, reply: ReplyOpen) {
        let entries = tri!(reply, self.vol.readdir_ino(ino.0).map_err(errno));
        let fh = self.handles.next.fetch_add(1, Ordering::Relaxed);
        self.handles.dirs.write().insert(
            fh,
            Arc::new(DirSnapshot {
                ino: ino.0,
                entries,
            }),
        );
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dir = tri!(reply, self.dir(fh));
        let parent = tri!(reply, self.vol.parent_ino(dir.ino).map_err(errno));
        // Offsets: 1 is ".", 2 is "..", 3 + i is entry i; each names the
        // position after its entry, as the kernel asks for the next.
        let dots = [
            (dir.ino, ".", FileType::Directory),
            (parent, "..", FileType::Directory),
        ];
        let all = dots.into_iter().chain(
            dir.entries
                .iter()
                .map(|e| (e.ino, e.name.as_str(), file_type(e.kind))),
        );
        for (i, (ino, name, kind)) in all.enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let dir = tri!(reply, self.dir(fh));
        let me = tri!(reply, self.vol.stat_ino(dir.ino).map_err(errno));
        let parent = tri!(
            reply,
            self.vol
                .parent_ino(dir.ino)
                .and_then(|p| self.vol.stat_ino(p))
                .map_err(errno)
        );
        for pos in offset as usize..dir.entries.len() + 2 {
            let (name, st) = match pos {
                0 => (".", me.clone()),
                1 => ("..", parent.clone()),
                n => {
                    let e = &dir.entries[n - 2];
                    // Removed since opendir: skip it, as if listed later.
                    match self.vol.stat_ino(e.ino) {
                        Ok(st) => (e.name.as_str(), st),
                        Err(_) => continue,
                    }
                }
            };
            if reply.add(
                INodeNo(st.ino),
                pos as u64 + 1,
                name,
                &ATTR_TTL,
                &file_attr(&st),
                Generation(0),
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: FuseOpenFlags,
        reply: ReplyEmpty,
    ) {
        self.handles.dirs.write().remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if self.read_only {
            return reply.ok();
        }
        // A directory is names and attributes, all journaled: a commit makes
        // them durable. No writeback of files (a sync would write back the
        // whole volume, and take the errors a later syncfs must report).
        tri!(reply, self.vol.sync_metadata().map_err(errno));
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.vol.statfs();
        let bs = u64::from(s.block_size);
        let blocks = s.data_bytes / bs;
        let free = s.free_bytes / bs;
        // Inodes are not preallocated: as many more as the metadata room
        // allows, which free blocks bound well enough.
        reply.statfs(
            blocks,
            free,
            free,
            s.inodes + free,
            free,
            s.block_size,
            iomapfs_fs::limits::MAX_NAME_LEN as u32,
            s.block_size,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(name));
        let how = match flags {
            0 => XattrSet::Any,
            libc::XATTR_CREATE => XattrSet::Create,
            libc::XATTR_REPLACE => XattrSet::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        tri!(
            reply,
            self.vol.set_xattr(ino.0, name, value, how).map_err(errno)
        );
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let name = tri!(reply, name.to_str().ok_or(Errno::ENODATA));
        let value = tri!(reply, self.vol.get_xattr(ino.0, name).map_err(errno));
        xattr_reply(&value, size, reply);
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let names = tri!(reply, self.vol.list_xattr(ino.0).map_err(errno));
        let mut list = Vec::new();
        for n in names {
            list.extend_from_slice(n.as_bytes());
            list.push(0);
        }
        xattr_reply(&list, size, reply);
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tri!(reply, self.writable());
        let name = tri!(reply, name.to_str().ok_or(Errno::ENODATA));
        tri!(reply, self.vol.remove_xattr(ino.0, name).map_err(errno));
        reply.ok();
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // `default_permissions`: the kernel checks modes itself.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        tri!(reply, self.writable());
        let name = tri!(reply, new_name(name));
        let node = new_node(req, mode, umask, FileKind::Regular);
        let st = tri!(
            reply,
            self.vol.make_node(parent.0, name, node, &[]).map_err(errno)
        );
        let file = tri!(
            reply,
            self.vol.open_ino(st.ino, open_flags(flags)).map_err(errno)
        );
        let fh = self.add_file(file);
        reply.created(
            &ATTR_TTL,
            &file_attr(&st),
            Generation(0),
            fh,
            fopen_flags(flags, self.caching),
        );
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        tri!(reply, self.writable());
        let file = tri!(reply, self.file(fh));
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let r = match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 => file.fallocate(offset, length, keep_size),
            // PUNCH_HOLE requires KEEP_SIZE (the kernel checks).
            libc::FALLOC_FL_PUNCH_HOLE => file.punch_hole(offset, length),
            // ZERO_RANGE: free what is there, then allocate unwritten space
            // (reads zero). Two journaled steps; a crash between them
            // leaves a hole, which reads zero too.
            libc::FALLOC_FL_ZERO_RANGE => file
                .punch_hole(offset, length)
                .and_then(|()| file.fallocate(offset, length, keep_size)),
            _ => return reply.error(Errno::EOPNOTSUPP),
        };
        tri!(reply, r.map_err(errno));
        reply.ok();
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let file = tri!(reply, self.file(fh));
        let to = match whence {
            libc::SEEK_DATA => SeekFor::Data,
            libc::SEEK_HOLE => SeekFor::Hole,
            _ => return reply.error(Errno::EINVAL),
        };
        // No sync: cached data not written back yet is data already (it
        // holds a delayed allocation), and an fdatasync here would take
        // the handle's writeback error from its next fsync.
        let offset = tri!(reply, u64::try_from(offset).map_err(|_| Errno::ENXIO));
        match tri!(reply, file.seek(offset, to).map_err(errno)) {
            Some(found) => reply.offset(found as i64),
            None => reply.error(Errno::ENXIO),
        }
    }
}

/// Replies to getxattr/listxattr: the size when asked for it (`size` 0),
/// ERANGE when the caller's buffer is too small, else the bytes.
fn xattr_reply(bytes: &[u8], size: u32, reply: ReplyXattr) {
    if size == 0 {
        reply.size(bytes.len() as u32);
    } else if (size as usize) < bytes.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_through_system_time() {
        for (sec, nsec) in [
            (0, 0),
            (1, 5),
            (-1, 0),
            (-2, 750_000_000),
            (1 << 40, 999_999_999),
        ] {
            let t = Timestamp { sec, nsec };
            assert_eq!(timestamp(system_time(t)), t, "{t:?}");
        }
    }

    #[test]
    fn each_caching_mode_answers_opens_as_documented() {
        let direct = libc::O_RDWR | libc::O_DIRECT;
        let buffered = libc::O_RDWR;
        let bypass = FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        assert_eq!(fopen_flags(direct, Caching::DirectIo), bypass);
        assert_eq!(fopen_flags(buffered, Caching::DirectIo), bypass);
        for cached in [Caching::KernelCache, Caching::Writeback] {
            // O_DIRECT takes the kernel's direct path: no FOPEN_DIRECT_IO.
            assert_eq!(fopen_flags(direct, cached), FopenFlags::empty());
            assert_eq!(fopen_flags(buffered, cached), FopenFlags::FOPEN_KEEP_CACHE);
        }
    }

    #[test]
    fn open_flags_map_direct_sync_and_access_mode() {
        let f = open_flags(libc::O_RDONLY | libc::O_DIRECT);
        assert!(f.direct && f.read_only && !f.dsync && !f.sync);
        let f = open_flags(libc::O_RDWR | libc::O_DSYNC);
        assert!(!f.direct && !f.read_only && f.dsync && !f.sync);
        let f = open_flags(libc::O_WRONLY | libc::O_SYNC);
        assert!(f.sync && f.dsync && !f.read_only);
    }
}
