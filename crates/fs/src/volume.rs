//! The public face of a mounted volume. Each method hands over to the module
//! that owns its concept: `mount` (format, mount, recovery), `namespace`
//! (paths and directories), `transaction` (commits and checkpoints) and
//! `handles` (open inodes). What they share is in `mount_state`, where the
//! locking order is written down; the fault model is with the commits, in
//! `transaction`.

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::attributes::SetAttr;
use crate::background_thread::BackgroundThread;
use crate::file::{File, OpenFlags, Stat};
use crate::flusher::{Flusher, Pass};
use crate::mount::{self, FreeSpaceScan};
use crate::mount_state::VolumeInner;
use crate::namespace::{check_openable, NewNode, RenameFlags};
use crate::superblock::Superblock;
use crate::types::{FileKind, Ino};
use crate::xattr::XattrSet;
use crate::{Error, Result};

pub use crate::mount::FormatOptions;
pub use crate::namespace::DirEntry;

/// Space usage of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    /// Bytes in the data area.
    pub data_bytes: u64,
    /// Bytes free for allocation, including space freed by changes that
    /// are not durable yet (an allocation that needs it commits first).
    pub free_bytes: u64,
    /// Bytes of the data area that hold checkpoint metadata (both slots'
    /// spill extents and extent pages) or that are kept free for the
    /// next bases (the room: up to three bases' worth, less what the
    /// slots hold): not in `free_bytes`.
    pub metadata_bytes: u64,
    pub inodes: u64,
}

/// How to mount a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// The page cache of non-direct handles: its size and dirty limits.
    pub cache: iomap::CacheConfig,
    /// Checkpoint in a background thread once a commit leaves the journal
    /// half full or the key spans changed since the last checkpoint pass
    /// [`crate::limits::CHANGED_SPANS_MOST`] (default). Off, checkpoints
    /// run only when a commit finds the journal full, at
    /// [`Volume::checkpoint`] and at unmount, so the changed spans wait in
    /// memory until then: every device request then comes from a caller
    /// (tests that replay a request sequence need that).
    pub background_checkpoints: bool,
    /// Commit in a background thread once uncommitted records reach the
    /// commit threshold (default); the writer that gets another threshold
    /// ahead of it commits itself. Off, the change that reaches the
    /// threshold commits in its caller's thread (see
    /// `background_checkpoints` for why a test turns it off).
    pub background_commits: bool,
    /// Called by the thread that rebuilds free space after mount, at each
    /// [`crate::ScanPoint`]: tests hold the scan there. `None` in
    /// production.
    #[doc(hidden)]
    pub free_space_scan_hook: Option<crate::ScanHook>,
    /// Memory for the extent maps of paged files. Their shells (every
    /// chunk's entry and allocation, loaded or not, and the page
    /// references both checkpoint slots list: about 200 bytes per chunk of
    /// up to 512 extents) take their part; the rest holds extent chunks that are
    /// also on an extent page (read from one on demand, or written to one
    /// by a base): past it, a background thread makes the chunks least
    /// recently looked up absent again, read from their pages when next
    /// needed. Chunks changed since the last base are not on a page and
    /// cannot be dropped: the clean ones make room for them, and a
    /// checkpoint writes a base when they pass a quarter of that rest.
    /// The chunks always get at least an eighth of the budget, so past
    /// about 75 M extents per 64 MiB (chunks half full) the shells and
    /// that eighth go over it.
    /// Default 64 MiB (about 2 M extents in memory). See
    /// `docs/EXTENT_PAGES.md`.
    pub metadata_cache_bytes: u64,
}

/// [`MountOptions::metadata_cache_bytes`] by default.
pub const DEFAULT_METADATA_CACHE_BYTES: u64 = 64 << 20;

#[cfg(test)]
impl MountOptions {
    /// No background checkpoints or commits: crate tests that drive a
    /// volume call both themselves.
    pub(crate) fn foreground_only() -> MountOptions {
        MountOptions {
            background_checkpoints: false,
            background_commits: false,
            ..MountOptions::default()
        }
    }
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        MountOptions {
            cache: iomap::CacheConfig::default(),
            background_checkpoints: true,
            background_commits: true,
            free_space_scan_hook: None,
            metadata_cache_bytes: DEFAULT_METADATA_CACHE_BYTES,
        }
    }
}

/// A mounted iomapfs volume. Cheap to clone; all clones share one mount.
/// When the last clone is dropped, background writeback stops; file handles
/// still open keep working (`fsync` writes their data back); drop them too,
/// or call [`Volume::unmount`], to release the mount.
#[derive(Clone)]
pub struct Volume {
    pub(crate) inner: Arc<VolumeInner>,
    _flusher: Arc<Flusher>,
    _checkpointer: Option<Arc<BackgroundThread>>,
    _committer: Option<Arc<BackgroundThread>>,
    _evictor: Option<Arc<BackgroundThread>>,
    _free_space_scan: Arc<FreeSpaceScan>,
}

impl Volume {
    /// Writes a new, empty file system to `device`.
    pub fn format(device: Arc<dyn BlockDevice>, opts: &FormatOptions) -> Result<()> {
        mount::format(device, opts)
    }

    /// Mounts the volume on `device`: reads the newest valid checkpoint and
    /// replays the journal after it. Cost is proportional to the metadata and
    /// the journal, never to the device.
    pub fn open(device: Arc<dyn BlockDevice>) -> Result<Volume> {
        Volume::open_with(device, &MountOptions::default())
    }

    /// [`Volume::open`] with options (the cache size, for one).
    pub fn open_with(device: Arc<dyn BlockDevice>, opts: &MountOptions) -> Result<Volume> {
        let cache = iomap::FolioCache::new(opts.cache.clone())
            .map_err(|reason| Error::invalid("cache configuration", reason))?;
        let inner = mount::mount(device, cache)?;
        *inner.free_space_gate.hook.lock() = opts.free_space_scan_hook.clone();
        let free_space_scan = Arc::new(FreeSpaceScan::start(&inner));
        let flusher = Arc::new(Flusher::start(&inner)?);
        let checkpointer = if opts.background_checkpoints {
            Some(Arc::new(BackgroundThread::checkpoints(&inner)?))
        } else {
            None
        };
        let committer = if opts.background_commits {
            Some(Arc::new(BackgroundThread::commits(&inner)?))
        } else {
            None
        };
        // Only bases with extent pages make chunks clean.
        let paged = inner.sb.features_incompat & crate::superblock::INCOMPAT_EXTENT_PAGES != 0;
        let evictor = match &inner.page_loader {
            Some(loader) if paged => {
                let thread = BackgroundThread::evictor(&inner)?;
                inner.count_shells();
                loader.set_budget(opts.metadata_cache_bytes);
                Some(Arc::new(thread))
            }
            _ => None,
        };
        Ok(Volume {
            inner,
            _flusher: flusher,
            _checkpointer: checkpointer,
            _committer: committer,
            _evictor: evictor,
            _free_space_scan: free_space_scan,
        })
    }

    /// Damage the mount worked around and the user should hear of: the
    /// primary superblock was unusable and the backup was read; the scan
    /// that rebuilds free space after mount failed (corruption: extents
    /// that overlap, an extent page that does not verify), so nothing can
    /// be allocated; damaged extent pages found since mount; a copy of an
    /// index page that failed where the other verified (first copies at
    /// mount, second copies by the scan). Empty on a
    /// healthy volume. (A scan still running has found nothing yet.)
    pub fn mount_warnings(&self) -> Vec<String> {
        let mut warnings = self.inner.mount_warnings.clone();
        warnings.extend(self.inner.scan_warnings.lock().iter().cloned());
        // Damaged extent pages found since mount (by the free-space scan
        // or a read): their chunks answer with the damage.
        if let Some(loader) = &self.inner.page_loader {
            warnings.extend(loader.stats().damaged);
        }
        if let Some(failure) = self.inner.free_space_gate.failure() {
            warnings.push(format!(
                "free space was not rebuilt, nothing can be allocated: {}",
                failure.error()
            ));
        }
        warnings
    }

    /// Waits until free space, which mount rebuilds in the background, is
    /// ready (allocating calls wait for it themselves; reads and
    /// overwrites never do). Returns the error of a rebuild that failed
    /// (the volume's extents overlap: corruption), which every allocation
    /// then returns too.
    pub fn wait_free_space(&self) -> Result<()> {
        self.inner.wait_free_space();
        match self.inner.free_space_gate.failure() {
            Some(failure) => Err(failure.error()),
            None => Ok(()),
        }
    }

    /// The allocator allocating now: its heap bytes (estimated,
    /// [`crate::alloc::Allocator::memory_bytes`]) and its free ranges;
    /// the scanned one once free space is ready, the clean unmount's
    /// reserve while the scan runs, `None` while there is neither or the
    /// scan failed. For the metadata-scale bench.
    #[doc(hidden)]
    pub fn allocator_memory(&self) -> Option<(u64, u64)> {
        let meta = self.inner.meta.read();
        let alloc = meta.alloc.allocator().ok()?;
        Some((
            alloc.memory_bytes() as u64,
            alloc.free_extent_count() as u64,
        ))
    }

    /// What reading extent pages on demand did since mount: pages read,
    /// chunks loaded outside a fallible path (a bug if not 0), and the
    /// damaged pages found (each also an EIO to the operation that needed
    /// it). `None` when mount left no chunk absent to read.
    pub fn extent_page_loads(&self) -> Option<crate::page_loader::PageLoads> {
        let mut stats = self.inner.page_loader.as_ref()?.stats();
        let meta = self.inner.meta.read();
        for inode in meta.state.inodes.values() {
            stats.chunks_loaded += inode.extents.loaded_chunks() as u64;
            stats.chunks += inode.extents.chunk_count() as u64;
            stats.segments_open += inode.extents.open_segments() as u64;
            stats.segments += inode.extents.segment_count() as u64;
        }
        Some(stats)
    }

    /// Waits until the evictor of extent chunks (a background thread,
    /// asked when the chunks in memory pass
    /// [`MountOptions::metadata_cache_bytes`]) has nothing asked or
    /// running: for benches and tests that look at
    /// [`Volume::extent_page_loads`] after reading.
    #[doc(hidden)]
    pub fn wait_extent_eviction(&self) {
        if let Some(loader) = &self.inner.page_loader {
            loader.evict_request.wait_idle();
        }
    }

    /// The longest times checkpoints and the evictor of extent chunks held
    /// the metadata lock exclusive since mount or the last call (every read
    /// and write of every file waits while it is held), by place; starts
    /// over. Benches set them beside read latencies, which on a loaded
    /// machine mix that wait with preemption.
    pub fn take_longest_lock_holds(&self) -> crate::LongestLockHolds {
        self.inner.lock_holds.take()
    }

    /// The volume's page cache (its size, use and dirty bytes).
    pub fn cache(&self) -> &iomap::FolioCache {
        &self.inner.cache
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.inner.dev
    }

    pub fn superblock(&self) -> &Superblock {
        &self.inner.sb
    }

    /// Opens (and with `flags.create`, creates) the regular file at `path`.
    pub fn open_file(&self, path: &str, flags: OpenFlags) -> Result<File> {
        self.inner.check_live()?;
        if flags.read_only && flags.truncate {
            return Err(Error::invalid(path, "truncate on a read-only open"));
        }
        // A create's room check may wait for free space (and retries once
        // after a checkpoint when the space is only busy); an open of an
        // existing file never waits.
        let inode = self.inner.retry_if_busy(|| {
            self.inner.with_free_space(|meta| {
                let ino = self.inner.lookup_or_create(meta, path, flags)?;
                Ok(meta.open_handle(ino, &self.inner.cache))
            })
        })?;
        self.inner.commit_if_due()?;
        let file = File::new(self.inner.clone(), inode, flags, path);
        if flags.truncate {
            file.truncate(0)?;
        }
        Ok(file)
    }

    pub fn mkdir(&self, path: &str) -> Result<()> {
        self.inner.retry_if_busy(|| self.inner.mkdir(path))
    }

    pub fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.readdir(path)
    }

    /// Removes the name `path` (anything but a directory). The inode goes
    /// with its last name, or with its last open handle after that.
    pub fn unlink(&self, path: &str) -> Result<()> {
        self.inner.remove(path, false)
    }

    pub fn rmdir(&self, path: &str) -> Result<()> {
        self.inner.remove(path, true)
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.inner.retry_if_busy(|| self.inner.rename(from, to))
    }

    /// Creates a symlink at `path` whose target is `target`.
    pub fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.inner
            .retry_if_busy(|| self.inner.symlink(target.as_bytes(), path))
    }

    /// Creates the hard link `new` to what `existing` names (not a
    /// directory).
    pub fn link(&self, existing: &str, new: &str) -> Result<()> {
        self.inner
            .retry_if_busy(|| self.inner.link_paths(existing, new))
    }

    /// The target of the symlink at `path`.
    pub fn readlink(&self, path: &str) -> Result<Vec<u8>> {
        let ino = self.inner.ino_of(path)?;
        self.inner.readlink(ino)
    }

    /// The inode `path` names (a final symlink is not followed; one met
    /// before is `ELOOP`: the path API never follows symlinks).
    pub fn ino_of(&self, path: &str) -> Result<Ino> {
        self.inner.ino_of(path)
    }

    // --- The same by inode: what a FUSE mount asks ----------------------

    /// The entry `name` of directory `parent`.
    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Stat> {
        self.inner.lookup(parent, name)
    }

    pub fn stat_ino(&self, ino: Ino) -> Result<Stat> {
        self.inner.stat_ino(ino)
    }

    /// Creates `parent/name` as `node`; `target` is a symlink's target
    /// (ignored for other kinds).
    pub fn make_node(&self, parent: Ino, name: &str, node: NewNode, target: &[u8]) -> Result<Stat> {
        self.inner
            .retry_if_busy(|| self.inner.make_node(parent, name, node, target))
    }

    /// A new name `parent/name` for inode `ino` (a hard link).
    pub fn link_ino(&self, ino: Ino, parent: Ino, name: &str) -> Result<Stat> {
        self.inner
            .retry_if_busy(|| self.inner.link(ino, parent, name))
    }

    /// Removes `parent/name`: an empty directory when `dir`, anything else
    /// when not.
    pub fn remove_at(&self, parent: Ino, name: &str, dir: bool) -> Result<()> {
        self.inner.remove_at(parent, name, dir)
    }

    /// Renames `parent/name` to `new_parent/new_name`, atomically; `flags`
    /// ask for `RENAME_NOREPLACE` or `RENAME_EXCHANGE`.
    pub fn rename_at(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        flags: RenameFlags,
    ) -> Result<()> {
        self.inner.retry_if_busy(|| {
            self.inner
                .rename_at(parent, name, new_parent, new_name, flags)
        })
    }

    pub fn readlink_ino(&self, ino: Ino) -> Result<Vec<u8>> {
        self.inner.readlink(ino)
    }

    /// Entries of directory `ino`, sorted by name (without `.` and `..`).
    pub fn readdir_ino(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        self.inner.readdir_ino(ino)
    }

    /// The directory holding directory `ino`, what its `..` names: the
    /// root's is the root, a removed directory's is itself.
    pub fn parent_ino(&self, ino: Ino) -> Result<Ino> {
        self.inner.check_live()?;
        let meta = self.inner.meta.read();
        match meta.state.inode(ino) {
            Some(dir) if dir.kind == FileKind::Directory => {
                Ok(if dir.parent == 0 { ino } else { dir.parent })
            }
            Some(_) => Err(Error::NotDir {
                path: format!("inode {ino}"),
            }),
            None => Err(Error::Stale { ino }),
        }
    }

    /// Opens regular file `ino` (`flags.create` and `exclusive` do not
    /// apply). An inode with no names left but still open elsewhere can be
    /// opened too, as `/proc/self/fd` allows.
    pub fn open_ino(&self, ino: Ino, flags: OpenFlags) -> Result<File> {
        self.inner.check_live()?;
        let path = format!("inode {ino}");
        if flags.read_only && flags.truncate {
            return Err(Error::invalid(path, "truncate on a read-only open"));
        }
        let inode = {
            let mut meta = self.inner.meta.write();
            let state = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
            check_openable(state, &path)?;
            meta.open_handle(ino, &self.inner.cache)
        };
        let file = File::new(self.inner.clone(), inode, flags, &path);
        if flags.truncate {
            file.truncate(0)?;
        }
        Ok(file)
    }

    /// Changes mode, owner or times of `ino` (ctime becomes now); size
    /// changes go through [`File::truncate`].
    pub fn set_attr(&self, ino: Ino, change: &SetAttr) -> Result<Stat> {
        self.inner.set_attr(ino, change)
    }

    /// The value of extended attribute `name` (`user.*`) of `ino`.
    pub fn get_xattr(&self, ino: Ino, name: &str) -> Result<Vec<u8>> {
        self.inner.get_xattr(ino, name)
    }

    /// Names of `ino`'s extended attributes, sorted.
    pub fn list_xattr(&self, ino: Ino) -> Result<Vec<String>> {
        self.inner.list_xattr(ino)
    }

    /// Sets extended attribute `name` (`user.*` only; at most 255 bytes of
    /// name, 64 KiB of value, 1 MiB per inode) of a file or directory.
    pub fn set_xattr(&self, ino: Ino, name: &str, value: &[u8], how: XattrSet) -> Result<()> {
        self.inner
            .retry_if_busy(|| self.inner.set_xattr(ino, name, value, how))
    }

    pub fn remove_xattr(&self, ino: Ino, name: &str) -> Result<()> {
        self.inner.remove_xattr(ino, name)
    }

    /// DSYNC writers waiting for a device flush to cover their write
    /// (shared flushes; diagnostics and tests).
    pub fn dsync_flush_waiters(&self) -> usize {
        self.inner.flush_coalescer.waiting()
    }

    pub fn stat(&self, path: &str) -> Result<Stat> {
        self.inner.stat(path)
    }

    /// Waits for free space to be rebuilt after mount; if that failed,
    /// reports nothing free.
    pub fn statfs(&self) -> StatFs {
        self.inner.wait_free_space();
        let meta = self.inner.meta.read();
        let (unreserved, free) = match meta.alloc.allocator() {
            Ok(alloc) => (
                meta.unreserved_bytes().unwrap_or(0) + alloc.busy_bytes(),
                alloc.free_bytes(),
            ),
            Err(_) => (0, 0),
        };
        StatFs {
            block_size: self.inner.block_size,
            data_bytes: self.inner.sb.layout.data.len,
            free_bytes: unreserved,
            metadata_bytes: meta.spilled_bytes
                + meta
                    .base_reserve_for(Default::default())
                    .min(free.saturating_sub(meta.delalloc_reserved)),
            inodes: meta.state.inodes.len() as u64,
        }
    }

    /// Makes every change durable: writes back every file's cached data
    /// and commits the journal, every file's times included. Reports the
    /// first writeback error met here or, since the last `sync`, by
    /// background writeback of files closed since.
    pub fn sync(&self) -> Result<()> {
        self.inner.check_live()?;
        let mut errors = self.inner.write_back_all(Pass::All);
        let lost = self.take_lost_writeback();
        let logged = self.inner.meta.write().log_write_times();
        let committed = logged.and_then(|()| self.inner.commit());
        if !errors.is_empty() {
            return Err(errors.swap_remove(0));
        }
        lost.map_or(committed, Err)
    }

    /// The first writeback error background writeback met since the last
    /// `sync` or unmount took them (each is reported there once, also when
    /// its file is closed).
    fn take_lost_writeback(&self) -> Option<Error> {
        let lost = std::mem::take(&mut *self.inner.lost_writeback.lock());
        lost.into_iter().next().map(|first| {
            Error::Iomap(iomap::IomapError::Writeback {
                errno: libc::EIO,
                what: first,
            })
        })
    }

    /// Makes every name and attribute change durable (`fsync` of a
    /// directory): one journal commit. Writes back no file's cached data,
    /// and leaves the writeback errors of closed files for [`Volume::sync`].
    pub fn sync_metadata(&self) -> Result<()> {
        self.inner.commit()
    }

    /// Writes back every file's cached data and drops every clean cached
    /// folio (as `echo 3 > /proc/sys/vm/drop_caches` does for the kernel's
    /// page cache): later reads go to the device. The memory stays with
    /// the cache, for new folios. Returns the first writeback error.
    pub fn drop_caches(&self) -> Result<()> {
        self.inner.check_live()?;
        let written = self.inner.write_back_all(Pass::All);
        let inodes: Vec<_> = {
            let meta = self.inner.meta.read();
            meta.open.values().map(|e| e.inode.clone()).collect()
        };
        for inode in inodes {
            inode.mapping.drop_clean();
        }
        match written.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes back every file's cached data, writes a checkpoint and trims
    /// the journal: afterwards everything is durable.
    pub fn checkpoint(&self) -> Result<()> {
        self.write_back_and_checkpoint(|inner| inner.checkpoint())
    }

    fn write_back_and_checkpoint(
        &self,
        checkpoint: impl FnOnce(&VolumeInner) -> Result<()>,
    ) -> Result<()> {
        self.inner.check_live()?;
        let written = self.inner.write_back_all(Pass::All);
        let checkpointed = checkpoint(&self.inner);
        if let Some(e) = written.into_iter().next() {
            return Err(e);
        }
        checkpointed
    }

    /// Writes back every file's cached data, checkpoints and releases the
    /// volume. Reports, as `sync` does, a writeback error met here or by
    /// background writeback since the last `sync` (a FUSE mount gets no
    /// `sync`: the kernel does not pass `syncfs` on to it). Dropping a
    /// volume without unmounting loses cached data not written back and
    /// leaves the rest to journal recovery at the next open. With extent
    /// pages the final checkpoint is a base, so the next mount loads no
    /// extent chunk. Once the final checkpoint is durable, sets the superblock's clean-unmount mark: the
    /// next open then skips scanning the journal for later batches.
    /// After a volume whose metadata was large (its checkpoint image 8 MiB
    /// or more, about 300k extents), gives the heap it freed back to the
    /// system with glibc's `malloc_trim`, which walks the whole process's
    /// free heap (a few ms per 100 MiB).
    pub fn unmount(self) -> Result<()> {
        self.write_back_and_checkpoint(|inner| inner.checkpoint_for_unmount())?;
        self.inner.mark_clean_unmount()?;
        let lost = self.take_lost_writeback();
        self.release();
        lost.map_or(Ok(()), Err)
    }

    /// Lets the volume go without writing anything, for a volume that
    /// must not be written (its device opened read-only, where
    /// [`Volume::unmount`]'s checkpoint would fail): as dropping it (data
    /// cached and not written back is lost, the journal recovers the rest
    /// at the next open), and after large metadata the freed heap given
    /// back to the system as `unmount` gives it.
    pub fn release(self) {
        let metadata_bytes = self.inner.meta.read().state.image_bytes_estimate();
        drop(self);
        if metadata_bytes >= TRIM_AFTER_METADATA_BYTES {
            give_back_freed_heap();
        }
    }
}

/// Metadata (its checkpoint image's size, about 30 bytes an extent: what
/// a session holding all of it in memory took, several times over) past
/// which an unmount trims the process's heap: below it there is little
/// to give back, and the trim walks all of the process's free heap, a C
/// library host's too.
const TRIM_AFTER_METADATA_BYTES: u64 = 8 << 20;

/// Returns to the system the heap that an unmounted volume's metadata
/// leaves free. A map of millions of extents takes hundreds of MiB, freed
/// at unmount; glibc gives its heap back only from the top, and one
/// allocation the process still holds above it (anything made late, by
/// any thread) keeps all of it resident: a process that built 10M extents
/// and mounted again stayed at 330 MiB instead of 20. The trim walks
/// the free heap: 4.7 ms for the 100 MiB `unmount_memory` frees.
fn give_back_freed_heap() {
    // Their allocations would pin the pages they sit in.
    crate::extent_map::release_spare_chunks();
    crate::extent_map::give_back_warm_slots();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and has no precondition; it
    // takes each arena's lock, so it may run beside other threads'
    // allocations.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;
    use iomap::{IomapError, IomapKind, IomapOpFlags, IomapOps};

    fn fresh(size: u64) -> (Arc<MemDevice>, Volume) {
        let dev = Arc::new(MemDevice::new(size, 512));
        dev.fill(b"STALE!!!");
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        (dev, vol)
    }

    /// `begin` alone, as the write protocol calls it under the shared lock:
    /// with OVERWRITE_ONLY or NOWAIT it answers a pure overwrite of written
    /// space inside EOF, and `WouldBlock` for a hole, unwritten space, or a
    /// range crossing EOF — before allocating or changing anything.
    #[test]
    fn overwrite_only_and_nowait_begin_would_block_unless_pure_overwrite() {
        let (_dev, vol) = fresh(8 << 20);
        let f = vol
            .open_file(
                "/f",
                OpenFlags {
                    create: true,
                    direct: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        // [0, 8192) written, a hole, [16384, 20480) unwritten; EOF 30000.
        f.pwrite(&[1u8; 8192], 0).unwrap();
        f.fallocate(16_384, 4096, true).unwrap();
        f.truncate(30_000).unwrap();
        let inner = &vol.inner;
        let inode = &inner.meta.read().open[&f.ino()].inode.clone();
        vol.wait_free_space().unwrap();
        let free_before = inner.meta.read().alloc.allocator().unwrap().free_bytes();
        let write = IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
        for guard in [IomapOpFlags::OVERWRITE_ONLY, IomapOpFlags::NOWAIT] {
            let flags = write | guard;
            let pure = inner.begin(inode, 4096, 4096, flags).unwrap();
            assert_eq!(pure.kind, IomapKind::Mapped, "{guard:?}");
            assert!(!pure.flags.contains(iomap::IomapFlags::NEW), "{guard:?}");
            for (what, pos, len) in [
                ("a hole inside EOF", 8192, 1000),
                ("unwritten space inside EOF", 16_384, 4096),
                ("written space, then a hole", 4096, 8192),
                ("a range crossing EOF", 29_000, 2000),
                ("a hole past EOF", 40_960, 4096),
            ] {
                match inner.begin(inode, pos, len, flags) {
                    Err(Error::Iomap(IomapError::WouldBlock)) => {}
                    other => panic!("{guard:?} over {what}: {other:?}, want WouldBlock"),
                }
            }
        }
        assert_eq!(
            inner.meta.read().alloc.allocator().unwrap().free_bytes(),
            free_before,
            "a WouldBlock answer allocated space"
        );
        // Without the guard, the same hole is allocated.
        let m = inner.begin(inode, 8192, 1000, write).unwrap();
        assert_eq!(m.kind, IomapKind::Unwritten);
        assert!(m.flags.contains(iomap::IomapFlags::NEW));
    }

    #[test]
    fn write_read_reopen_round_trip() {
        let (dev, vol) = fresh(8 << 20);
        vol.mkdir("/d").unwrap();
        let direct = OpenFlags {
            create: true,
            direct: true,
            ..OpenFlags::default()
        };
        let f = vol.open_file("/d/a", direct).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(f.pwrite(&data, 4096).unwrap(), 8192);
        let mut back = vec![0u8; 16384];
        assert_eq!(f.pread(&mut back, 0).unwrap(), 12288);
        assert!(back[..4096].iter().all(|&b| b == 0));
        assert_eq!(&back[4096..12288], &data[..]);
        // Sub-block overwrite through a buffered handle.
        let g = vol.open_file("/d/a", OpenFlags::default()).unwrap();
        g.pwrite(b"hello", 5000).unwrap();
        f.fsync().unwrap();
        drop(f);
        drop(g);
        drop(vol);
        let vol = Volume::open(dev.clone()).unwrap();
        let f = vol.open_file("/d/a", OpenFlags::default()).unwrap();
        let mut back = vec![0u8; 12288];
        assert_eq!(f.pread(&mut back, 0).unwrap(), 12288);
        assert_eq!(&back[5000..5005], b"hello");
        assert_eq!(&back[4096..5000], &data[..904]);
        assert_eq!(&back[5005..12288], &data[909..]);
        let report = crate::fsck::check(dev.clone()).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    }

    #[test]
    fn enospc_changes_nothing() {
        let (_dev, vol) = fresh(4 << 20);
        let f = vol
            .open_file(
                "big",
                OpenFlags {
                    create: true,
                    ..OpenFlags::default()
                },
            )
            .unwrap();
        let free = vol.statfs().free_bytes;
        let err = f.fallocate(0, free + 4096, false).unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC, "{err}");
        assert_eq!(f.stat().unwrap().size, 0);
        assert_eq!(vol.statfs().free_bytes, free);
        f.fallocate(0, free, false).unwrap();
        assert_eq!(vol.statfs().free_bytes, 0);
    }

    #[test]
    fn space_freed_by_unlink_is_reused_after_an_internal_checkpoint() {
        let (_dev, vol) = fresh(4 << 20);
        let create = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        let a = vol.open_file("a", create).unwrap();
        let free = vol.statfs().free_bytes;
        a.fallocate(0, free, false).unwrap();
        drop(a);
        vol.unlink("a").unwrap();
        // Freed but busy until a checkpoint holds the unlink; statfs counts it.
        assert_eq!(
            vol.inner
                .meta
                .read()
                .alloc
                .allocator()
                .unwrap()
                .free_bytes(),
            0
        );
        assert_eq!(vol.statfs().free_bytes, free);
        let b = vol.open_file("b", create).unwrap();
        b.fallocate(0, free, false).unwrap();
        assert_eq!(b.stat().unwrap().allocated_bytes, free);
    }

    #[test]
    fn direct_reads_of_one_written_block_take_the_simple_path() {
        use iomap::file_io::simple_reads_on_this_thread;
        let (_dev, vol) = fresh(8 << 20);
        let direct = OpenFlags {
            create: true,
            direct: true,
            ..OpenFlags::default()
        };
        let f = vol.open_file("/f", direct).unwrap();
        f.pwrite(&[5u8; 3 * 4096], 0).unwrap();
        f.fallocate(3 * 4096, 4096, false).unwrap();
        let taken = simple_reads_on_this_thread;
        let mut block = vec![0u8; 4096];
        let mut two = vec![0u8; 8192];
        let before = taken();
        f.pread(&mut block, 4096).unwrap();
        f.pread(&mut block[..512], 1024).unwrap();
        assert_eq!(
            taken() - before,
            2,
            "one-block reads inside a written extent"
        );
        f.pread(&mut two, 0).unwrap(); // longer than a block
        f.pread(&mut block, 3 * 4096).unwrap(); // unwritten
        let buffered = vol.open_file("/f", OpenFlags::default()).unwrap();
        buffered.pread(&mut block, 0).unwrap(); // not a direct handle
        assert_eq!(
            taken() - before,
            2,
            "only qualifying reads take the fast path"
        );
        assert!(block.iter().all(|&b| b == 5));
    }
}
