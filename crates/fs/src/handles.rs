//! Open inodes and their handle counts. The first handle on an inode makes
//! its [`OpenInode`] (the I/O lock the engine takes, and its page cache);
//! the last to close removes it and frees the inode if it was unlinked while
//! open. The count is atomic, so cloning a handle per asynchronous request
//! takes no lock; opening and the last close both run under the metadata
//! lock.
//!
//! An inode whose cache still holds dirty data when its last handle closes
//! stays in the table with no handle (its data must reach the device, and a
//! reopen must see it): background writeback, `sync` or unmount write it
//! back and close it then ([`VolumeInner::write_back_all`]). An unlinked
//! inode's dirty data is dropped instead: nothing can read it any more.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use iomap::FolioCache;

use crate::mount_state::{Meta, OpenEntry, OpenInode, VolumeInner};
use crate::types::{Ino, Record};

impl Meta {
    /// A new handle on inode `ino`; the first opens the inode.
    pub(crate) fn open_handle(&mut self, ino: Ino, cache: &FolioCache) -> Arc<OpenInode> {
        let entry = self.open.entry(ino).or_insert_with(|| OpenEntry {
            inode: Arc::new(OpenInode::new(ino, cache)),
        });
        // Under the metadata lock: a concurrent last close re-checks the
        // count under the same lock before it closes the inode.
        entry.inode.handles.fetch_add(1, Ordering::AcqRel);
        entry.inode.clone()
    }

    /// Some handle holds inode `ino` open: unlinking it leaves the freeing
    /// to the last close. An inode kept only for its dirty cache (no
    /// handle) is closed here instead, its cached data dropped: nothing can
    /// reach it once its last name is gone.
    pub(crate) fn is_open(&mut self, ino: Ino) -> bool {
        let Some(entry) = self.open.get(&ino) else {
            return false;
        };
        if entry.inode.handles.load(Ordering::Acquire) != 0 {
            return true;
        }
        self.open.remove(&ino);
        false
    }
}

impl VolumeInner {
    /// Another handle on an inode that is open already (the caller holds
    /// one, so the count cannot be at zero).
    pub(crate) fn add_handle(&self, inode: &OpenInode) {
        inode.handles.fetch_add(1, Ordering::AcqRel);
    }

    /// A handle on `inode` closed; the last one closes the inode, and frees
    /// it if it was unlinked.
    pub(crate) fn release_handle(&self, inode: &Arc<OpenInode>) {
        if inode.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let mut meta = self.meta.write();
        // An open by path may have revived it meanwhile, or a new open inode
        // may already stand in its place.
        let still_ours = meta
            .open
            .get(&inode.ino)
            .is_some_and(|e| Arc::ptr_eq(&e.inode, inode));
        if !still_ours || inode.handles.load(Ordering::Acquire) != 0 {
            return;
        }
        let unlinked = meta.state.inode(inode.ino).is_none_or(|i| i.nlink == 0);
        if !unlinked && self.check_live().is_ok() && inode.mapping.is_dirty() {
            // Kept, with no handle, until its data is written back.
            return;
        }
        if !unlinked && self.check_live().is_ok() {
            // `stat` finds a pending write time through the open inode,
            // which goes now. Failure only loses the time (and shuts down).
            let _ = meta.log_write_time(inode);
        }
        meta.open.remove(&inode.ino);
        // No handle: no I/O in flight (a request holds one), nothing dirty.
        meta.release_holds(inode.ino);
        if unlinked && self.check_live().is_ok() {
            // Failure only leaves an orphan that the next mount frees.
            let _ = meta.log(Record::FreeInode { ino: inode.ino });
        }
    }
}
