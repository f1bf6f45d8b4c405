//! Inode attributes: mode, owner and times (chmod, chown, utimens). A
//! change is one `SetAttr` record carrying every new value, so replay needs
//! no clock and no rule. No permission checks here: the library trusts its
//! caller, and a mount lets the kernel check (`default_permissions`).

use crate::codec;
use crate::file::Stat;
use crate::mount_state::{now, VolumeInner};
use crate::types::{Ino, Record, Timestamp};
use crate::{Error, Result};

/// A time to set: the current time, or a given one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    Now,
    At(Timestamp),
}

/// Which attributes to change; `None` leaves one as it is. The ctime
/// always becomes the current time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// Permission bits; bits beyond 0o7777 are refused.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
}

impl VolumeInner {
    pub(crate) fn set_attr(&self, ino: Ino, change: &SetAttr) -> Result<Stat> {
        self.check_live()?;
        if let Some(mode) = change.mode {
            codec::check_mode(mode)
                .map_err(|reason| Error::invalid(format!("chmod of inode {ino}"), reason))?;
        }
        for t in [change.atime, change.mtime].into_iter().flatten() {
            if let TimeSet::At(t) = t {
                if !t.is_valid() {
                    return Err(Error::invalid(
                        format!("utimens of inode {ino}"),
                        format!("nanoseconds {} out of range", t.nsec),
                    ));
                }
            }
        }
        let stat = {
            let mut meta = self.meta.write();
            // A write's pending time is folded in first: an explicit
            // mtime then replaces it, and a chmod keeps it.
            let attrs = meta.take_attrs_in_core(ino).ok_or(Error::Stale { ino })?;
            let now = now();
            let time = |set: Option<TimeSet>, old: Timestamp| match set {
                None => old,
                Some(TimeSet::Now) => now,
                Some(TimeSet::At(t)) => t,
            };
            meta.log(Record::SetAttr {
                ino,
                mode: change.mode.unwrap_or(attrs.mode),
                uid: change.uid.unwrap_or(attrs.uid),
                gid: change.gid.unwrap_or(attrs.gid),
                atime: time(change.atime, attrs.atime),
                mtime: time(change.mtime, attrs.mtime),
                ctime: now,
            })?;
            self.stat_locked(&meta, ino)
        };
        self.commit_if_due()?;
        Ok(stat)
    }

    /// What `stat` reports for inode `ino`.
    pub(crate) fn stat_ino(&self, ino: Ino) -> Result<Stat> {
        self.check_live()?;
        let meta = self.meta.read();
        if meta.state.inode(ino).is_none() {
            return Err(Error::Stale { ino });
        }
        Ok(self.stat_locked(&meta, ino))
    }
}
