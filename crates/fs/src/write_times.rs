//! The times a write sets (mtime, and ctime with it), as POSIX has them:
//! set by the write itself, direct or buffered, overwrite or not; never by
//! writeback completing later; and an explicit time set after the write
//! (utimens: `cp -p`, `tar`, `rsync -t`) wins.
//!
//! A write stores its time in its open inode
//! ([`OpenInode::write_time_ns`]): one atomic operation, no metadata lock
//! and no journal record, so overwrites stay metadata-free. `stat` shows it
//! at once. It reaches the journal lazily, as XFS logs timestamps, with the
//! metadata it goes with:
//! - a write completion that logs a record anyway (size, conversion)
//!   carries it in that record (`CompleteWrite`);
//! - a journal commit that writes records logs every open inode's pending
//!   time in the same batch (a `SetAttr` each);
//! - `fsync` of the file, `sync`, a checkpoint (so unmount) and the file's
//!   last close log it, so it is durable once the first three return;
//!   `fdatasync` and O_DSYNC writes do not wait for it (POSIX does not ask
//!   them to), while an O_SYNC write logs it before its own commit.
//!
//! A change that sets the times itself supersedes a pending write time:
//! `set_attr` takes it into the attributes it logs (so an explicit mtime
//! replaces it), truncate, punch and fallocate drop it (their own time is
//! later). A crash before any of the above loses a pending time, never
//! data: the file keeps its older times.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::mount_state::{now_ns, Meta, OpenInode, VolumeInner};
use crate::types::{Ino, InodeAttrs, Record, Timestamp};
use crate::Result;

impl OpenInode {
    /// A write to this inode is under way: its time is now (the newest of
    /// concurrent writers wins).
    pub(crate) fn stamp_write(&self) {
        self.write_time_ns.fetch_max(now_ns(), Ordering::AcqRel);
    }

    /// The pending write time, cleared: the caller logs it, or drops it
    /// for a later time of its own.
    pub(crate) fn take_write_time(&self) -> Option<Timestamp> {
        match self.write_time_ns.swap(0, Ordering::AcqRel) {
            0 => None,
            ns => Some(Timestamp::from_ns(ns)),
        }
    }

    fn pending_write_time(&self) -> Option<Timestamp> {
        match self.write_time_ns.load(Ordering::Acquire) {
            0 => None,
            ns => Some(Timestamp::from_ns(ns)),
        }
    }
}

impl Meta {
    fn open_inode(&self, ino: Ino) -> Option<&Arc<OpenInode>> {
        self.open.get(&ino).map(|e| &e.inode)
    }

    /// Inode `ino`'s attributes as `stat` reports them: the logged ones
    /// with a pending write time applied.
    pub(crate) fn attrs_in_core(&self, ino: Ino) -> Option<InodeAttrs> {
        let mut attrs = self.state.inode(ino)?.attrs;
        if let Some(t) = self.open_inode(ino).and_then(|i| i.pending_write_time()) {
            attrs.data_changed_at(t);
        }
        Some(attrs)
    }

    /// As [`Meta::attrs_in_core`], taking the pending write time: for a
    /// caller that logs the whole attributes next (`set_attr`).
    pub(crate) fn take_attrs_in_core(&self, ino: Ino) -> Option<InodeAttrs> {
        let mut attrs = self.state.inode(ino)?.attrs;
        if let Some(t) = self.open_inode(ino).and_then(|i| i.take_write_time()) {
            attrs.data_changed_at(t);
        }
        Some(attrs)
    }

    /// A change with its own, later, data-change time (truncate, punch,
    /// fallocate): a pending write time would set the mtime back.
    pub(crate) fn drop_write_time(&self, ino: Ino) {
        if let Some(inode) = self.open_inode(ino) {
            inode.take_write_time();
        }
    }

    /// Logs `inode`'s pending write time, if any (as a `SetAttr` carrying
    /// the rest of its attributes unchanged). Nothing to log for an inode
    /// freed meanwhile.
    pub(crate) fn log_write_time(&mut self, inode: &OpenInode) -> Result<()> {
        let Some(t) = inode.take_write_time() else {
            return Ok(());
        };
        let Some(state) = self.state.inode(inode.ino) else {
            return Ok(());
        };
        let mut a = state.attrs;
        a.data_changed_at(t);
        self.log(Record::SetAttr {
            ino: inode.ino,
            mode: a.mode,
            uid: a.uid,
            gid: a.gid,
            atime: a.atime,
            mtime: a.mtime,
            ctime: a.ctime,
        })?;
        Ok(())
    }

    /// Logs the pending write time of every open inode.
    pub(crate) fn log_write_times(&mut self) -> Result<()> {
        let timed: Vec<Arc<OpenInode>> = self
            .open
            .values()
            .filter(|e| e.inode.pending_write_time().is_some())
            .map(|e| e.inode.clone())
            .collect();
        for inode in timed {
            self.log_write_time(&inode)?;
        }
        Ok(())
    }
}

impl VolumeInner {
    /// Logs `inode`'s pending write time; no lock when there is none.
    pub(crate) fn log_write_time(&self, inode: &OpenInode) -> Result<()> {
        if inode.pending_write_time().is_none() {
            return Ok(());
        }
        self.meta.write().log_write_time(inode)
    }
}
