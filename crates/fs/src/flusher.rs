//! Background writeback of the volume's page cache.
//!
//! One thread per mounted volume wakes every
//! [`CacheConfig::writeback_interval`](iomap::CacheConfig), or as soon as
//! dirty bytes pass the background threshold or a throttled writer asks,
//! and writes back every file whose dirty data is older than
//! `dirty_expire` — every dirty file while dirty bytes are over the
//! threshold. It holds the volume only while it works (a weak reference in
//! between), and stops, joined, when the last [`crate::Volume`] handle is
//! dropped: after that nothing of this mount writes to the device in the
//! background (a crash test's dropped volume stays dropped), neither the
//! flusher nor write-behind or readahead (stopped with it).
//!
//! The same pass, with every file and waiting, is `sync` and unmount
//! ([`VolumeInner::write_back_all`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::file::{File, OpenFlags};
use crate::mount_state::{OpenInode, VolumeInner};
use crate::{Error, Result};

/// Which dirty files a writeback pass takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Every dirty file (sync, unmount, over the background threshold).
    All,
    /// Files whose oldest dirty data became dirty before this instant.
    DirtySince(Instant),
}

impl VolumeInner {
    /// Writes back the dirty files `pass` selects, open or kept after their
    /// last close (see [`crate::handles`]), and closes the latter once
    /// clean. Returns the errors met, each naming its file.
    pub(crate) fn write_back_all(self: &Arc<Self>, pass: Pass) -> Vec<Error> {
        if pass == Pass::All {
            // Queued write-behind runs first, so none of it comes after
            // (a checkpoint or unmount must be the last word).
            self.cache.wait_write_behind();
        }
        let candidates: Vec<Arc<OpenInode>> = {
            let meta = self.meta.read();
            meta.open.values().map(|e| e.inode.clone()).collect()
        };
        let mut errors = Vec::new();
        for inode in candidates {
            let wanted = match pass {
                Pass::All => inode.mapping.is_dirty(),
                Pass::DirtySince(limit) => inode.mapping.dirty_since().is_some_and(|t| t <= limit),
            };
            if !wanted {
                continue;
            }
            let handle = {
                let mut meta = self.meta.write();
                // Still the inode in the table (a last close may have
                // removed it since, dropping nothing dirty).
                if !meta
                    .open
                    .get(&inode.ino)
                    .is_some_and(|e| Arc::ptr_eq(&e.inode, &inode))
                {
                    continue;
                }
                meta.open_handle(inode.ino, &self.cache)
            };
            let file = File::new(
                self.clone(),
                handle,
                OpenFlags::default(),
                &format!("<inode {}>", inode.ino),
            );
            if let Err(e) = iomap::writeback::write_back(&file, 0, u64::MAX) {
                errors.push(e);
            }
            self.release_holds_if_idle(&inode, false);
            // Dropping the handle closes a file kept only for its dirty data.
        }
        errors
    }
}

/// The background writeback thread of one mount; stopping it (on drop)
/// joins it.
pub(crate) struct Flusher {
    stop: Arc<AtomicBool>,
    cache: iomap::FolioCache,
    thread: Option<JoinHandle<()>>,
}

impl Flusher {
    pub(crate) fn start(vol: &Arc<VolumeInner>) -> Result<Flusher> {
        let stop = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(vol);
        let cache = vol.cache.clone();
        let thread = {
            let stop = stop.clone();
            let cache = cache.clone();
            std::thread::Builder::new()
                .name("iomapfs-flusher".to_string())
                .spawn(move || run(weak, cache, stop))
                .map_err(|e| Error::invalid("background writeback", e.to_string()))?
        };
        Ok(Flusher {
            stop,
            cache,
            thread: Some(thread),
        })
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.cache.notify_dirty_change();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Write-behind jobs hold files (hence the volume): they must not
        // write after the last handle is gone either.
        self.cache.stop_background();
    }
}

fn run(vol: Weak<VolumeInner>, cache: iomap::FolioCache, stop: Arc<AtomicBool>) {
    let config = cache.config().clone();
    // Whether the last pass over the threshold cleaned anything: if not
    // (writes keep failing), wait like any other pass instead of spinning.
    let mut progressed = false;
    loop {
        if !(cache.over_background() && progressed) {
            cache.wait_dirty_change_unless(config.writeback_interval, &stop);
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Some(vol) = vol.upgrade() else {
            return;
        };
        if vol.check_live().is_err() {
            return;
        }
        let before = cache.dirty_bytes();
        let pass = if cache.over_background() {
            Pass::All
        } else {
            match Instant::now().checked_sub(config.dirty_expire) {
                Some(limit) => Pass::DirtySince(limit),
                None => continue,
            }
        };
        let errors = vol.write_back_all(pass);
        if !errors.is_empty() {
            // Each is recorded in its file's mapping for that file's fsync;
            // these are kept for `sync` too, in case the file is closed.
            vol.lost_writeback
                .lock()
                .extend(errors.iter().map(|e| e.to_string()));
        }
        progressed = cache.dirty_bytes() < before;
    }
}
