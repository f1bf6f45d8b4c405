//! Names: lookup and path resolution, and the operations that read or
//! change directories (create of every kind, hard links, unlink, rmdir,
//! rename and exchange, readdir, readlink, and the lookup half of open).
//! Each change is one record applied under the metadata lock, so a crash
//! keeps it whole or not at all.
//!
//! Two faces: by inode (`parent` inode and one name, as FUSE asks) and by
//! path (the Rust API's convenience). Paths are resolved without following
//! symlinks: a symlink met on the way is [`Error::IsSymlink`] (`ELOOP`), as
//! `O_NOFOLLOW` does; a mount's kernel follows them itself.

use crate::codec;
use crate::file::{OpenFlags, Stat};
use crate::limits::{MAX_LINKS, MAX_NAME_LEN};
use crate::mount_state::{now, Meta, VolumeInner};
use crate::state::{InodeState, MetaState, IMAGE_BYTES_PER_ENTRY, IMAGE_BYTES_PER_INODE};
use crate::types::{FileKind, Ino, InodeAttrs, Record, ROOT_INO};
use crate::{Error, Result};

/// One name in a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub ino: Ino,
    pub kind: FileKind,
}

/// What a new inode is and who owns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewNode {
    pub kind: FileKind,
    /// Permission bits (`& 0o7777`); the caller applies any umask.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Device number, for character and block devices only.
    pub rdev: u64,
}

impl NewNode {
    /// A node of `kind` owned by this process's effective user and group,
    /// with the usual default mode (0644 files, 0755 directories, 0777
    /// symlinks, 0644 others).
    pub fn owned_by_process(kind: FileKind) -> NewNode {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let mode = match kind {
            FileKind::Directory => 0o755,
            FileKind::Symlink => 0o777,
            _ => 0o644,
        };
        NewNode {
            kind,
            mode,
            uid,
            gid,
            rdev: 0,
        }
    }
}

/// How `rename` treats an existing target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenameFlags {
    /// `RENAME_NOREPLACE`: fail with `EEXIST` if the target exists.
    pub no_replace: bool,
    /// `RENAME_EXCHANGE`: swap source and target atomically (both exist).
    pub exchange: bool,
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
                check_openable(&meta.state.inodes[&ino], path)?;
                Ok(ino)
            }
            None if flags.create => {
                if flags.read_only {
                    return Err(Error::invalid(path, "create on a read-only open"));
                }
                self.make_node_locked(
                    meta,
                    parent,
                    &name,
                    NewNode::owned_by_process(FileKind::Regular),
                    &[],
                )
            }
            None => Err(Error::NotFound {
                path: path.to_string(),
            }),
        }
    }

    /// Creates `parent/name` as `node` (with `target` for a symlink); its
    /// group and set-group-id bit follow a set-group-id parent, as Linux's
    /// `inode_init_owner` does.
    fn make_node_locked(
        &self,
        meta: &mut Meta,
        parent: Ino,
        name: &str,
        node: NewNode,
        target: &[u8],
    ) -> Result<Ino> {
        let what = || format!("inode {parent}/{name}");
        let dir = live_dir(&meta.state, parent, &what())?;
        check_new_name(name, &what())?;
        if dir.entries.contains_key(name) {
            return Err(Error::Exists { path: what() });
        }
        let mut attrs = InodeAttrs::new(node.mode, node.uid, node.gid, now());
        if dir.attrs.mode & libc::S_ISGID != 0 {
            attrs.gid = dir.attrs.gid;
            if node.kind == FileKind::Directory {
                attrs.mode |= libc::S_ISGID;
            }
        }
        match node.kind {
            FileKind::CharDevice | FileKind::BlockDevice => attrs.rdev = node.rdev,
            FileKind::Symlink => codec::check_symlink_target(target).map_err(|reason| {
                if target.len() > crate::limits::MAX_SYMLINK_LEN {
                    Error::NameTooLong {
                        path: what(),
                        max: crate::limits::MAX_SYMLINK_LEN,
                    }
                } else {
                    Error::invalid(what(), reason)
                }
            })?,
            _ => {}
        }
        let target = if node.kind == FileKind::Symlink {
            target.to_vec()
        } else {
            Vec::new()
        };
        meta.reserve_image(
            &self.sb,
            IMAGE_BYTES_PER_INODE + IMAGE_BYTES_PER_ENTRY + (name.len() + target.len()) as u64,
        )?;
        let ino = meta.state.next_ino;
        meta.log(Record::Create {
            ino,
            parent,
            name: name.to_string(),
            kind: node.kind,
            attrs,
            target,
        })?;
        Ok(ino)
    }

    /// Creates `parent/name` (any kind; `target` for a symlink) and returns
    /// what `stat` says of it.
    pub(crate) fn make_node(
        &self,
        parent: Ino,
        name: &str,
        node: NewNode,
        target: &[u8],
    ) -> Result<Stat> {
        self.check_live()?;
        let stat = self.with_free_space(|meta| {
            let ino = self.make_node_locked(meta, parent, name, node, target)?;
            Ok(self.stat_locked(meta, ino))
        })?;
        self.commit_if_due()?;
        Ok(stat)
    }

    pub(crate) fn mkdir(&self, path: &str) -> Result<()> {
        let parent = {
            let meta = self.meta.read();
            resolve_parent(&meta.state, path)?
        };
        self.make_node(
            parent.0,
            &parent.1,
            NewNode::owned_by_process(FileKind::Directory),
            &[],
        )
        .map_err(|e| with_path(e, path))
        .map(drop)
    }

    /// Creates symlink `path` pointing at `target`.
    pub(crate) fn symlink(&self, target: &[u8], path: &str) -> Result<()> {
        let parent = {
            let meta = self.meta.read();
            resolve_parent(&meta.state, path)?
        };
        self.make_node(
            parent.0,
            &parent.1,
            NewNode::owned_by_process(FileKind::Symlink),
            target,
        )
        .map_err(|e| with_path(e, path))
        .map(drop)
    }

    /// The entry `name` in directory `parent`.
    pub(crate) fn lookup(&self, parent: Ino, name: &str) -> Result<Stat> {
        self.check_live()?;
        let meta = self.meta.read();
        let what = || format!("inode {parent}/{name}");
        let dir = live_or_removed_dir(&meta.state, parent, &what())?;
        if name.len() > MAX_NAME_LEN {
            return Err(Error::NameTooLong {
                path: what(),
                max: MAX_NAME_LEN,
            });
        }
        let ino = *dir
            .entries
            .get(name)
            .ok_or_else(|| Error::NotFound { path: what() })?;
        Ok(self.stat_locked(&meta, ino))
    }

    /// A new name `parent/name` for `ino` (a hard link).
    pub(crate) fn link(&self, ino: Ino, parent: Ino, name: &str) -> Result<Stat> {
        self.check_live()?;
        let stat = self.with_free_space(|meta| {
            let what = || format!("inode {parent}/{name}");
            let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
            if inode.kind == FileKind::Directory {
                return Err(Error::NotPermitted {
                    path: what(),
                    reason: "hard links to directories are not allowed".into(),
                });
            }
            if inode.nlink == 0 {
                return Err(Error::NotFound { path: what() });
            }
            if inode.nlink >= MAX_LINKS {
                return Err(Error::TooManyLinks {
                    path: what(),
                    max: MAX_LINKS,
                });
            }
            let dir = live_dir(&meta.state, parent, &what())?;
            check_new_name(name, &what())?;
            if dir.entries.contains_key(name) {
                return Err(Error::Exists { path: what() });
            }
            meta.reserve_image(&self.sb, IMAGE_BYTES_PER_ENTRY + name.len() as u64)?;
            meta.log(Record::Link {
                ino,
                parent,
                name: name.to_string(),
                time: now(),
            })?;
            Ok(self.stat_locked(meta, ino))
        })?;
        self.commit_if_due()?;
        Ok(stat)
    }

    /// Hard link by paths: `new` names what `existing` names.
    pub(crate) fn link_paths(&self, existing: &str, new: &str) -> Result<()> {
        let (ino, (parent, name)) = {
            let meta = self.meta.read();
            (
                resolve(&meta.state, existing)?,
                resolve_parent(&meta.state, new)?,
            )
        };
        self.link(ino, parent, &name)
            .map_err(|e| with_path(e, new))
            .map(drop)
    }

    /// A symlink's target.
    pub(crate) fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        self.check_live()?;
        let meta = self.meta.read();
        let inode = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        if inode.kind != FileKind::Symlink {
            return Err(Error::invalid(format!("inode {ino}"), "not a symlink"));
        }
        Ok(inode.target.clone())
    }

    /// The entries of directory `ino`, sorted by name.
    pub(crate) fn readdir_ino(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        self.check_live()?;
        let meta = self.meta.read();
        let dir = meta.state.inode(ino).ok_or(Error::Stale { ino })?;
        if dir.kind != FileKind::Directory {
            return Err(Error::NotDir {
                path: format!("inode {ino}"),
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

    pub(crate) fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let ino = {
            let meta = self.meta.read();
            resolve(&meta.state, path)?
        };
        self.readdir_ino(ino).map_err(|e| with_path(e, path))
    }

    /// Removes `parent/name`: a directory (empty) if `dir`, anything else
    /// if not. The inode is freed with its last name unless it is open.
    pub(crate) fn remove_at(&self, parent: Ino, name: &str, dir: bool) -> Result<()> {
        self.check_live()?;
        {
            let mut meta = self.meta.write();
            let what = || format!("inode {parent}/{name}");
            let d = live_or_removed_dir(&meta.state, parent, &what())?;
            if name == "." {
                return Err(Error::invalid(what(), "cannot remove '.'"));
            }
            if name == ".." {
                return Err(Error::NotEmpty { path: what() });
            }
            let ino = *d
                .entries
                .get(name)
                .ok_or_else(|| Error::NotFound { path: what() })?;
            let inode = &meta.state.inodes[&ino];
            match (dir, inode.kind == FileKind::Directory) {
                (false, true) => return Err(Error::IsDir { path: what() }),
                (true, false) => return Err(Error::NotDir { path: what() }),
                (true, true) if !inode.entries.is_empty() => {
                    return Err(Error::NotEmpty { path: what() })
                }
                _ => {}
            }
            meta.log(Record::Unlink {
                parent,
                name: name.to_string(),
                time: now(),
            })?;
            if meta.state.inodes[&ino].nlink == 0 && !meta.is_open(ino) {
                meta.log(Record::FreeInode { ino })?;
            }
        }
        self.commit_if_due()
    }

    pub(crate) fn remove(&self, path: &str, dir: bool) -> Result<()> {
        let (parent, name) = {
            let meta = self.meta.read();
            resolve_parent(&meta.state, path)?
        };
        self.remove_at(parent, &name, dir)
            .map_err(|e| with_path(e, path))
    }

    /// Atomically renames `src_parent/src_name` to `dst_parent/dst_name`,
    /// replacing the target if it exists (unless `flags` say otherwise).
    pub(crate) fn rename_at(
        &self,
        src_parent: Ino,
        src_name: &str,
        dst_parent: Ino,
        dst_name: &str,
        flags: RenameFlags,
    ) -> Result<()> {
        self.check_live()?;
        self.with_free_space(|meta| {
            let from = || format!("inode {src_parent}/{src_name}");
            let to = || format!("inode {dst_parent}/{dst_name}");
            if flags.exchange && flags.no_replace {
                return Err(Error::invalid(from(), "exchange and no-replace together"));
            }
            let state = &meta.state;
            let src = *live_dir(state, src_parent, &from())?
                .entries
                .get(src_name)
                .ok_or_else(|| Error::NotFound { path: from() })?;
            let dst_dir = live_dir(state, dst_parent, &to())?;
            check_new_name(dst_name, &to())?;
            let src_kind = state.inodes[&src].kind;
            let replaced = dst_dir.entries.get(dst_name).copied();
            if flags.exchange {
                let Some(dst) = replaced else {
                    return Err(Error::NotFound { path: to() });
                };
                let dst_kind = state.inodes[&dst].kind;
                if (src_kind == FileKind::Directory && state.is_ancestor(src, dst_parent))
                    || (dst_kind == FileKind::Directory && state.is_ancestor(dst, src_parent))
                {
                    return Err(Error::invalid(
                        from(),
                        "cannot move a directory into itself",
                    ));
                }
                meta.log(Record::Rename {
                    src_parent,
                    src_name: src_name.to_string(),
                    dst_parent,
                    dst_name: dst_name.to_string(),
                    exchange: true,
                    time: now(),
                })?;
            } else {
                if replaced.is_some() && flags.no_replace {
                    return Err(Error::Exists { path: to() });
                }
                if replaced == Some(src) {
                    return Ok(());
                }
                if src_kind == FileKind::Directory && state.is_ancestor(src, dst_parent) {
                    return Err(Error::invalid(
                        format!("rename {} to {}", from(), to()),
                        "cannot move a directory into itself",
                    ));
                }
                if let Some(old) = replaced {
                    let old_inode = &state.inodes[&old];
                    match (
                        src_kind == FileKind::Directory,
                        old_inode.kind == FileKind::Directory,
                    ) {
                        (false, true) => return Err(Error::IsDir { path: to() }),
                        (true, false) => return Err(Error::NotDir { path: to() }),
                        (true, true) if !old_inode.entries.is_empty() => {
                            return Err(Error::NotEmpty { path: to() })
                        }
                        _ => {}
                    }
                }
                meta.reserve_image(&self.sb, dst_name.len() as u64)?;
                meta.log(Record::Rename {
                    src_parent,
                    src_name: src_name.to_string(),
                    dst_parent,
                    dst_name: dst_name.to_string(),
                    exchange: false,
                    time: now(),
                })?;
                if let Some(old) = replaced {
                    if meta.state.inodes[&old].nlink == 0 && !meta.is_open(old) {
                        meta.log(Record::FreeInode { ino: old })?;
                    }
                }
            }
            Ok(())
        })?;
        self.commit_if_due()
    }

    /// Atomically renames `from` to `to`, replacing `to` if it exists.
    pub(crate) fn rename(&self, from: &str, to: &str) -> Result<()> {
        let ((src_parent, src_name), (dst_parent, dst_name)) = {
            let meta = self.meta.read();
            (
                resolve_parent(&meta.state, from)?,
                resolve_parent(&meta.state, to)?,
            )
        };
        self.rename_at(
            src_parent,
            &src_name,
            dst_parent,
            &dst_name,
            RenameFlags::default(),
        )
        .map_err(|e| with_path(e, from))
    }

    /// The inode `path` names (not following a final symlink).
    pub(crate) fn ino_of(&self, path: &str) -> Result<Ino> {
        self.check_live()?;
        let meta = self.meta.read();
        resolve(&meta.state, path)
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
        let (size, nlink) = match inode.kind {
            FileKind::Directory if inode.nlink == 0 => (0, 0),
            FileKind::Directory => (0, 2 + inode.subdirs),
            FileKind::Symlink => (inode.target.len() as u64, inode.nlink),
            _ => (meta.size_in_core(ino).unwrap_or(inode.size), inode.nlink),
        };
        let a = meta.attrs_in_core(ino).unwrap_or(inode.attrs);
        Stat {
            ino,
            kind: inode.kind,
            size,
            nlink,
            // Delayed allocations count: the space is taken (as st_blocks
            // counts delalloc blocks in Linux).
            allocated_bytes: inode.extents.allocated_bytes()
                + meta.delalloc_within(ino, 0, u64::MAX),
            block_size: self.block_size,
            extents: inode.extents.len() as u64,
            mode: a.mode,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            atime: a.atime,
            mtime: a.mtime,
            ctime: a.ctime,
            btime: a.btime,
        }
    }
}

/// Puts the caller's path into an error that names an inode instead.
fn with_path(err: Error, path: &str) -> Error {
    let path = path.to_string();
    match err {
        Error::NotFound { .. } => Error::NotFound { path },
        Error::Exists { .. } => Error::Exists { path },
        Error::NotDir { .. } => Error::NotDir { path },
        Error::IsDir { .. } => Error::IsDir { path },
        Error::NotEmpty { .. } => Error::NotEmpty { path },
        Error::NameTooLong { max, .. } => Error::NameTooLong { path, max },
        Error::TooManyLinks { max, .. } => Error::TooManyLinks { path, max },
        Error::NotPermitted { reason, .. } => Error::NotPermitted { path, reason },
        Error::InvalidArgument { reason, .. } => Error::InvalidArgument { what: path, reason },
        other => other,
    }
}

/// A regular file can be opened for I/O; a directory is `EISDIR`, a
/// symlink `ELOOP` (as `O_NOFOLLOW`), anything else invalid.
pub(crate) fn check_openable(inode: &InodeState, path: &str) -> Result<()> {
    match inode.kind {
        FileKind::Regular => Ok(()),
        FileKind::Directory => Err(Error::IsDir {
            path: path.to_string(),
        }),
        FileKind::Symlink => Err(Error::IsSymlink {
            path: path.to_string(),
        }),
        other => Err(Error::invalid(
            path,
            format!("a {other:?} has no data to open"),
        )),
    }
}

/// A directory that still has a name, for adding entries to.
fn live_dir<'a>(state: &'a MetaState, ino: Ino, what: &str) -> Result<&'a InodeState> {
    let dir = live_or_removed_dir(state, ino, what)?;
    if dir.nlink == 0 {
        // POSIX: creating in a removed directory is ENOENT.
        return Err(Error::NotFound {
            path: what.to_string(),
        });
    }
    Ok(dir)
}

fn live_or_removed_dir<'a>(state: &'a MetaState, ino: Ino, what: &str) -> Result<&'a InodeState> {
    let dir = state.inode(ino).ok_or(Error::Stale { ino })?;
    if dir.kind != FileKind::Directory {
        return Err(Error::NotDir {
            path: what.to_string(),
        });
    }
    Ok(dir)
}

fn check_new_name(name: &str, what: &str) -> Result<()> {
    if name.len() > MAX_NAME_LEN {
        return Err(Error::NameTooLong {
            path: what.to_string(),
            max: MAX_NAME_LEN,
        });
    }
    if name == "." || name == ".." {
        return Err(Error::Exists {
            path: what.to_string(),
        });
    }
    codec::check_name(name).map_err(|reason| Error::invalid(what, reason))
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

/// Inode `ino`, met on the way along `path`, is a directory: a symlink is
/// not followed (`IsSymlink`), anything else is `NotDir`.
fn require_dir<'a>(state: &'a MetaState, ino: Ino, path: &str) -> Result<&'a InodeState> {
    let dir = &state.inodes[&ino];
    match dir.kind {
        FileKind::Directory => Ok(dir),
        FileKind::Symlink => Err(Error::IsSymlink {
            path: path.to_string(),
        }),
        _ => Err(Error::NotDir {
            path: path.to_string(),
        }),
    }
}

fn walk(state: &MetaState, path: &str, parts: &[&str]) -> Result<Ino> {
    let mut ino = ROOT_INO;
    for part in parts {
        let dir = require_dir(state, ino, path)?;
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
    require_dir(state, parent, path)?;
    codec::check_name(name).map_err(|reason| Error::invalid(path, reason))?;
    Ok((parent, name.to_string()))
}
