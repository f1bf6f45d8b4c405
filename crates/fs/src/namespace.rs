//! Names: path resolution and the operations that read or change
//! directories (create, mkdir, readdir, unlink, rmdir, rename, stat by path,
//! and the lookup half of open). Each change is one record applied under
//! the metadata lock, so a crash keeps it whole or not at all.

use crate::codec;
use crate::file::{OpenFlags, Stat};
use crate::limits::MAX_NAME_LEN;
use crate::mount_state::{now_ns, Meta, VolumeInner};
use crate::state::{MetaState, IMAGE_BYTES_PER_ENTRY, IMAGE_BYTES_PER_INODE};
use crate::types::{FileKind, Ino, Record, ROOT_INO};
use crate::{Error, Result};

/// One name in a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub ino: Ino,
    pub kind: FileKind,
}

impl VolumeInner {
    /// The inode `open` of `path` names under `flags`, created if they ask
    /// for it and it does not exist.
    pub(crate) fn lookup_or_create(
        &self,
        meta: &mut Meta,
        path: &str,
        flags: OpenFlags,
    ) -> Result<Ino> {
        let (parent, name) = resolve_parent(&meta.state, path)?;
        let existing = meta
            .state
            .inode(parent)
            .and_then(|d| d.entries.get(&name))
            .copied();
        match existing {
            Some(ino) => {
                if flags.create && flags.exclusive {
                    return Err(Error::Exists {
                        path: path.to_string(),
                    });
                }
                if meta.state.inodes[&ino].kind == FileKind::Directory {
                    return Err(Error::IsDir {
                        path: path.to_string(),
                    });
                }
                Ok(ino)
            }
            None if flags.create => {
                if flags.read_only {
                    return Err(Error::invalid(path, "create on a read-only open"));
                }
                self.create_locked(meta, parent, &name, FileKind::Regular)
            }
            None => Err(Error::NotFound {
                path: path.to_string(),
            }),
        }
    }

    fn create_locked(
        &self,
        meta: &mut Meta,
        parent: Ino,
        name: &str,
        kind: FileKind,
    ) -> Result<Ino> {
        meta.reserve_image(
            &self.sb,
            IMAGE_BYTES_PER_INODE + IMAGE_BYTES_PER_ENTRY + name.len() as u64,
        )?;
        let ino = meta.state.next_ino;
        meta.log(Record::Create {
            ino,
            parent,
            name: name.to_string(),
            kind,
            mtime_ns: now_ns(),
        })?;
        Ok(ino)
    }

    pub(crate) fn mkdir(&self, path: &str) -> Result<()> {
        self.check_live()?;
        {
            let mut meta = self.meta.write();
            let (parent, name) = resolve_parent(&meta.state, path)?;
            if meta.state.inodes[&parent].entries.contains_key(&name) {
                return Err(Error::Exists {
                    path: path.to_string(),
                });
            }
            self.create_locked(&mut meta, parent, &name, FileKind::Directory)?;
        }
        self.commit_if_due()
    }

    pub(crate) fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.check_live()?;
        let meta = self.meta.read();
        let ino = resolve(&meta.state, path)?;
        let dir = &meta.state.inodes[&ino];
        if dir.kind != FileKind::Directory {
            return Err(Error::NotDir {
                path: path.to_string(),
            });
        }
        Ok(dir
            .entries
            .iter()
            .map(|(name, &ino)| DirEntry {
                name: name.clone(),
                ino,
                kind: meta.state.inodes[&ino].kind,
            })
            .collect())
    }

    pub(crate) fn remove(&self, path: &str, want: FileKind) -> Result<()> {
        self.check_live()?;
        {
            let mut meta = self.meta.write();
            let (parent, name) = resolve_parent(&meta.state, path)?;
            let ino = *meta.state.inodes[&parent]
                .entries
                .get(&name)
                .ok_or_else(|| Error::NotFound {
                    path: path.to_string(),
                })?;
            let inode = &meta.state.inodes[&ino];
            match (want, inode.kind) {
                (FileKind::Regular, FileKind::Directory) => {
                    return Err(Error::IsDir {
                        path: path.to_string(),
                    })
                }
                (FileKind::Directory, FileKind::Regular) => {
                    return Err(Error::NotDir {
                        path: path.to_string(),
                    })
                }
                (FileKind::Directory, FileKind::Directory) if !inode.entries.is_empty() => {
                    return Err(Error::NotEmpty {
                        path: path.to_string(),
                    })
                }
                _ => {}
            }
            meta.log(Record::Unlink { parent, name })?;
            if !meta.is_open(ino) {
                meta.log(Record::FreeInode { ino })?;
            }
        }
        self.commit_if_due()
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub(crate) fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.check_live()?;
        {
            let mut meta = self.meta.write();
            let (src_parent, src_name) = resolve_parent(&meta.state, from)?;
            let (dst_parent, dst_name) = resolve_parent(&meta.state, to)?;
            let state = &meta.state;
            let src = *state.inodes[&src_parent]
                .entries
                .get(&src_name)
                .ok_or_else(|| Error::NotFound {
                    path: from.to_string(),
                })?;
            let src_kind = state.inodes[&src].kind;
            let replaced = state.inodes[&dst_parent].entries.get(&dst_name).copied();
            if replaced == Some(src) {
                return Ok(());
            }
            if src_kind == FileKind::Directory && state.is_ancestor(src, dst_parent) {
                return Err(Error::invalid(
                    format!("rename {from} to {to}"),
                    "cannot move a directory into itself",
                ));
            }
            if let Some(old) = replaced {
                let old_inode = &state.inodes[&old];
                match (src_kind, old_inode.kind) {
                    (FileKind::Regular, FileKind::Directory) => {
                        return Err(Error::IsDir {
                            path: to.to_string(),
                        })
                    }
                    (FileKind::Directory, FileKind::Regular) => {
                        return Err(Error::NotDir {
                            path: to.to_string(),
                        })
                    }
                    (FileKind::Directory, FileKind::Directory) if !old_inode.entries.is_empty() => {
                        return Err(Error::NotEmpty {
                            path: to.to_string(),
                        })
                    }
                    _ => {}
                }
            }
            meta.reserve_image(&self.sb, dst_name.len() as u64)?;
            meta.log(Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            })?;
            if let Some(old) = replaced {
                if !meta.is_open(old) {
                    meta.log(Record::FreeInode { ino: old })?;
                }
            }
        }
        self.commit_if_due()
    }

    pub(crate) fn stat(&self, path: &str) -> Result<Stat> {
        self.check_live()?;
        let meta = self.meta.read();
        let ino = resolve(&meta.state, path)?;
        Ok(self.stat_locked(&meta, ino))
    }

    /// What `stat` reports for inode `ino`; `meta` is the metadata lock,
    /// held. `File::stat` calls it too: it lives here, above `file`,
    /// because [`Stat`] is defined there.
    pub(crate) fn stat_locked(&self, meta: &Meta, ino: Ino) -> Stat {
        let inode = &meta.state.inodes[&ino];
        Stat {
            ino,
            kind: inode.kind,
            size: meta.size_in_core(ino).unwrap_or(inode.size),
            nlink: inode.nlink,
            // Delayed allocations count: the space is taken (as st_blocks
            // counts delalloc blocks in Linux).
            allocated_bytes: inode.extents.allocated_bytes()
                + meta.delalloc_within(ino, 0, u64::MAX),
            block_size: self.block_size,
            mtime_ns: inode.mtime_ns,
            extents: inode.extents.len() as u64,
        }
    }
}

/// Splits a path into components, resolving "." and "..".
fn components(path: &str) -> Result<Vec<&str>> {
    let mut out: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            name => {
                if name.len() > MAX_NAME_LEN {
                    return Err(Error::NameTooLong {
                        path: path.to_string(),
                        max: MAX_NAME_LEN,
                    });
                }
                if name.contains('\0') {
                    return Err(Error::invalid(path, "NUL in path"));
                }
                out.push(name);
            }
        }
    }
    Ok(out)
}

fn walk(state: &MetaState, path: &str, parts: &[&str]) -> Result<Ino> {
    let mut ino = ROOT_INO;
    for part in parts {
        let dir = &state.inodes[&ino];
        if dir.kind != FileKind::Directory {
            return Err(Error::NotDir {
                path: path.to_string(),
            });
        }
        ino = *dir.entries.get(*part).ok_or_else(|| Error::NotFound {
            path: path.to_string(),
        })?;
    }
    Ok(ino)
}

/// The inode at `path`.
pub(crate) fn resolve(state: &MetaState, path: &str) -> Result<Ino> {
    let parts = components(path)?;
    walk(state, path, &parts)
}

/// The directory that would hold `path`, and the last component.
pub(crate) fn resolve_parent(state: &MetaState, path: &str) -> Result<(Ino, String)> {
    let parts = components(path)?;
    let Some((name, dirs)) = parts.split_last() else {
        return Err(Error::invalid(path, "path names the root directory"));
    };
    let parent = walk(state, path, dirs)?;
    if state.inodes[&parent].kind != FileKind::Directory {
        return Err(Error::NotDir {
            path: path.to_string(),
        });
    }
    codec::check_name(name).map_err(|reason| Error::invalid(path, reason))?;
    Ok((parent, name.to_string()))
}
