//! Extended attributes in the `user.` namespace (object stores such as MinIO
//! keep metadata there). Each change is one record; values live in the
//! inode, in the checkpoint image. As Linux does for `user.`, only regular
//! files and directories carry them. Other namespaces have kernel meaning
//! (ACLs, capabilities, security labels) and are not stored: setting one is
//! `EOPNOTSUPP`, reading one finds nothing (`ENODATA`).

use crate::codec;
use crate::limits::{MAX_XATTR_BYTES_PER_INODE, MAX_XATTR_NAME_LEN, MAX_XATTR_VALUE_LEN};
use crate::mount_state::{now, VolumeInner};
use crate::state::IMAGE_BYTES_PER_XATTR;
use crate::types::{FileKind, Ino, Record};
use crate::{Error, Result};

/// How `set_xattr` treats an existing (or missing) attribute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XattrSet {
    /// Create or replace.
    #[default]
    Any,
    /// `XATTR_CREATE`: fail with `EEXIST` if it exists.
    Create,
    /// `XATTR_REPLACE`: fail with `ENODATA` if it does not.
    Replace,
}

fn what(ino: Ino) -> String {
    format!("inode {ino}")
}

impl VolumeInner {
    pub(crate) fn get_xattr(&self, ino: Ino, name: &str) -> Result<Vec<u8>> {
        self.check_live()?;
        let meta = self.meta.read();
        let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        if name.len() > MAX_XATTR_NAME_LEN {
            return Err(name_too_long(ino, name));
        }
        inode
            .xattrs
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoXattr {
                path: what(ino),
                name: name.to_string(),
            })
    }

    /// Names of the inode's extended attributes, sorted.
    pub(crate) fn list_xattr(&self, ino: Ino) -> Result<Vec<String>> {
        self.check_live()?;
        let meta = self.meta.read();
        let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        Ok(inode.xattrs.keys().cloned().collect())
    }

    pub(crate) fn set_xattr(
        &self,
        ino: Ino,
        name: &str,
        value: &[u8],
        how: XattrSet,
    ) -> Result<()> {
        self.check_live()?;
        check_settable_name(ino, name)?;
        if value.len() > MAX_XATTR_VALUE_LEN {
            return Err(Error::TooBig {
                what: format!("{}: xattr {name:?} value", what(ino)),
                size: value.len() as u64,
                max: MAX_XATTR_VALUE_LEN as u64,
            });
        }
        self.with_free_space(|meta| {
            let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
            if !matches!(inode.kind, FileKind::Regular | FileKind::Directory) {
                return Err(Error::NotPermitted {
                    path: what(ino),
                    reason: "user.* extended attributes only exist on files and directories".into(),
                });
            }
            let old = inode.xattrs.get(name);
            match (how, old) {
                (XattrSet::Create, Some(_)) => {
                    return Err(Error::Exists {
                        path: format!("{}: xattr {name:?}", what(ino)),
                    })
                }
                (XattrSet::Replace, None) => {
                    return Err(Error::NoXattr {
                        path: what(ino),
                        name: name.to_string(),
                    })
                }
                _ => {}
            }
            let old_len = old.map_or(0, |v| name.len() + v.len());
            let total = inode.xattr_bytes() - old_len + name.len() + value.len();
            if total > MAX_XATTR_BYTES_PER_INODE {
                return Err(Error::NoSpace {
                    what: format!("{}: extended attributes", what(ino)),
                    needed: total as u64,
                    available: MAX_XATTR_BYTES_PER_INODE as u64,
                });
            }
            meta.reserve_image(
                &self.sb,
                IMAGE_BYTES_PER_XATTR + (name.len() + value.len()) as u64,
            )?;
            meta.log(Record::SetXattr {
                ino,
                name: name.to_string(),
                value: value.to_vec(),
                ctime: now(),
            })?;
            Ok(())
        })?;
        self.commit_if_due()
    }

    pub(crate) fn remove_xattr(&self, ino: Ino, name: &str) -> Result<()> {
        self.check_live()?;
        check_settable_name(ino, name)?;
        {
            let mut meta = self.meta.write();
            let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
            if !inode.xattrs.contains_key(name) {
                return Err(Error::NoXattr {
                    path: what(ino),
                    name: name.to_string(),
                });
            }
            meta.log(Record::RemoveXattr {
                ino,
                name: name.to_string(),
                ctime: now(),
            })?;
        }
        self.commit_if_due()
    }
}

/// A name that may be set: `user.`, not empty after it, not too long.
fn check_settable_name(ino: Ino, name: &str) -> Result<()> {
    if name.len() > MAX_XATTR_NAME_LEN {
        return Err(name_too_long(ino, name));
    }
    codec::check_xattr_name(name).map_err(|reason| {
        if name.starts_with(crate::limits::XATTR_USER_PREFIX) {
            Error::invalid(format!("{}: xattr {name:?}", what(ino)), reason)
        } else {
            Error::XattrNotSupported {
                path: what(ino),
                name: name.to_string(),
                reason: reason.to_string(),
            }
        }
    })
}

fn name_too_long(ino: Ino, name: &str) -> Error {
    Error::XattrNameTooLong {
        path: what(ino),
        len: name.len(),
        max: MAX_XATTR_NAME_LEN,
    }
}
