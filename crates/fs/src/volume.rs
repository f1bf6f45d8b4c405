//! The public face of a mounted volume. Each method hands over to the module
//! that owns its concept: `mount` (format, mount, recovery), `namespace`
//! (paths and directories), `transaction` (commits and checkpoints) and
//! `handles` (open inodes). What they share is in `mount_state`, where the
//! locking order is written down; the fault model is with the commits, in
//! `transaction`.

use std::sync::Arc;

use blockdev::BlockDevice;

use crate::file::{File, OpenFlags, Stat};
use crate::flusher::{Flusher, Pass};
use crate::mount;
use crate::mount_state::VolumeInner;
use crate::superblock::Superblock;
use crate::types::FileKind;
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
    pub inodes: u64,
}

/// How to mount a volume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountOptions {
    /// The page cache of non-direct handles: its size and dirty limits.
    pub cache: iomap::CacheConfig,
}

/// A mounted iomapfs volume. Cheap to clone; all clones share one mount.
/// When the last clone is dropped, background writeback stops; file handles
/// still open keep working (`fsync` writes their data back); drop them too,
/// or call [`Volume::unmount`], to release the mount.
#[derive(Clone)]
pub struct Volume {
    pub(crate) inner: Arc<VolumeInner>,
    _flusher: Arc<Flusher>,
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
        let flusher = Arc::new(Flusher::start(&inner)?);
        Ok(Volume {
            inner,
            _flusher: flusher,
        })
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
        let inode = {
            let mut meta = self.inner.meta.write();
            let ino = self.inner.lookup_or_create(&mut meta, path, flags)?;
            meta.open_handle(ino, &self.inner.cache)
        };
        self.inner.commit_if_due()?;
        let file = File::new(self.inner.clone(), inode, flags, path);
        if flags.truncate {
            file.truncate(0)?;
        }
        Ok(file)
    }

    pub fn mkdir(&self, path: &str) -> Result<()> {
        self.inner.mkdir(path)
    }

    pub fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.inner.readdir(path)
    }

    pub fn unlink(&self, path: &str) -> Result<()> {
        self.inner.remove(path, FileKind::Regular)
    }

    pub fn rmdir(&self, path: &str) -> Result<()> {
        self.inner.remove(path, FileKind::Directory)
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.inner.rename(from, to)
    }

    /// DSYNC writers waiting for a device flush to cover their write
    /// (shared flushes; diagnostics and tests).
    pub fn dsync_flush_waiters(&self) -> usize {
        self.inner.flush_coalescer.waiting()
    }

    pub fn stat(&self, path: &str) -> Result<Stat> {
        self.inner.stat(path)
    }

    pub fn statfs(&self) -> StatFs {
        let meta = self.inner.meta.read();
        StatFs {
            block_size: self.inner.block_size,
            data_bytes: self.inner.sb.layout.data.len,
            free_bytes: meta.unreserved_bytes() + meta.alloc.busy_bytes(),
            inodes: meta.state.inodes.len() as u64,
        }
    }

    /// Makes every change durable: writes back every file's cached data
    /// and commits the journal. Reports the first writeback error met here
    /// or, since the last `sync`, by background writeback of files closed
    /// since.
    pub fn sync(&self) -> Result<()> {
        self.inner.check_live()?;
        let mut errors = self.inner.write_back_all(Pass::All);
        let lost = std::mem::take(&mut *self.inner.lost_writeback.lock());
        let committed = self.inner.commit();
        if !errors.is_empty() {
            return Err(errors.swap_remove(0));
        }
        if let Some(first) = lost.into_iter().next() {
            return Err(Error::Iomap(iomap::IomapError::Writeback {
                errno: libc::EIO,
                what: first,
            }));
        }
        committed
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
        self.inner.check_live()?;
        let written = self.inner.write_back_all(Pass::All);
        let checkpointed = self.inner.checkpoint();
        if let Some(e) = written.into_iter().next() {
            return Err(e);
        }
        checkpointed
    }

    /// Writes back every file's cached data, checkpoints and releases the
    /// volume. Dropping a volume without unmounting loses cached data not
    /// written back and leaves the rest to journal recovery at the next
    /// open.
    pub fn unmount(self) -> Result<()> {
        self.checkpoint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;

    fn fresh(size: u64) -> (Arc<MemDevice>, Volume) {
        let dev = Arc::new(MemDevice::new(size, 512));
        dev.fill(b"STALE!!!");
        Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev.clone()).unwrap();
        (dev, vol)
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
    fn space_freed_by_uncommitted_unlink_is_reused_after_an_internal_commit() {
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
        // Freed but busy until the unlink is durable; statfs counts it.
        assert_eq!(vol.inner.meta.read().alloc.free_bytes(), 0);
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
