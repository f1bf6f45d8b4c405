//! The in-memory metadata of a volume and the one function that changes it.
//!
//! Every metadata change is a [`Record`]. The live path builds a record,
//! applies it here and queues it for the journal; recovery applies the
//! journal's records to the checkpoint's image with the same
//! [`MetaState::apply`]. One implementation means replay cannot drift from
//! what the live path did.

use std::collections::BTreeMap;

use crate::codec;
use crate::extent_map::ExtentMap;
use crate::limits::{MAX_FILE_SIZE, MAX_INO};
use crate::types::{
    DirEntryImage, Extent, FileKind, Ino, InoMap, InodeImage, MetaImage, Record, ROOT_INO,
};

/// Encoded bytes a checkpoint spends per inode, extent and directory entry
/// (plus the name's bytes), as the codec writes them: used to refuse changes
/// that would not fit a checkpoint slot.
pub const IMAGE_BYTES_PER_INODE: u64 = codec::INODE_FIXED_ENCODED_LEN as u64;
pub const IMAGE_BYTES_PER_EXTENT: u64 = codec::EXTENT_ENCODED_LEN as u64;
/// An entry's encoding without its name bytes (the minimum counts one).
pub const IMAGE_BYTES_PER_ENTRY: u64 = codec::ENTRY_MIN_ENCODED_LEN as u64 - 1;

#[derive(Clone, Debug)]
pub struct InodeState {
    pub ino: Ino,
    pub kind: FileKind,
    pub nlink: u32,
    pub size: u64,
    pub mtime_ns: u64,
    pub extents: ExtentMap,
    pub entries: BTreeMap<String, Ino>,
    /// Directory containing this inode's entry (the root is its own parent;
    /// 0 once unlinked).
    pub parent: Ino,
}

/// All inodes, directories and extent maps of a volume.
#[derive(Clone, Debug)]
pub struct MetaState {
    pub block_size: u32,
    pub next_ino: Ino,
    pub inodes: InoMap<InodeState>,
    /// Encoded size of the checkpoint image's inodes, kept incrementally.
    image_bytes: u64,
}

/// Why a record could not be applied: on replay this means a corrupt journal
/// (records are checksummed, so a bug wrote it); on the live path, a bug.
pub type ApplyError = String;

impl MetaState {
    /// An empty file system: just the root directory.
    pub fn new_empty(block_size: u32, now_ns: u64) -> MetaState {
        let mut inodes = InoMap::default();
        inodes.insert(
            ROOT_INO,
            InodeState {
                ino: ROOT_INO,
                kind: FileKind::Directory,
                nlink: 1,
                size: 0,
                mtime_ns: now_ns,
                extents: ExtentMap::new(block_size),
                entries: BTreeMap::new(),
                parent: ROOT_INO,
            },
        );
        let mut state = MetaState {
            block_size,
            next_ino: ROOT_INO + 1,
            inodes,
            image_bytes: 0,
        };
        state.image_bytes = state.compute_image_bytes();
        state
    }

    /// Loads a checkpoint image, validating what the image alone can tell.
    pub fn from_image(image: &MetaImage, block_size: u32) -> Result<MetaState, ApplyError> {
        let mut inodes = InoMap::with_capacity_and_hasher(image.inodes.len(), Default::default());
        for img in &image.inodes {
            if img.ino == 0 || img.ino >= image.next_ino {
                return Err(format!(
                    "inode {} out of range (next inode {})",
                    img.ino, image.next_ino
                ));
            }
            let extents = ExtentMap::from_extents(block_size, img.extents.clone())
                .map_err(|e| format!("inode {}: {e}", img.ino))?;
            let mut entries = BTreeMap::new();
            for e in &img.entries {
                if entries.insert(e.name.clone(), e.ino).is_some() {
                    return Err(format!(
                        "directory {}: duplicate entry {:?}",
                        img.ino, e.name
                    ));
                }
            }
            let state = InodeState {
                ino: img.ino,
                kind: img.kind,
                nlink: img.nlink,
                size: img.size,
                mtime_ns: img.mtime_ns,
                extents,
                entries,
                parent: 0,
            };
            if inodes.insert(img.ino, state).is_some() {
                return Err(format!("inode {} appears twice", img.ino));
            }
        }
        match inodes.get(&ROOT_INO) {
            Some(root) if root.kind == FileKind::Directory => {}
            _ => return Err("root directory missing".to_string()),
        }
        if image.next_ino > MAX_INO {
            return Err(format!("next inode number {} out of range", image.next_ino));
        }
        let mut state = MetaState {
            block_size,
            next_ino: image.next_ino,
            inodes,
            image_bytes: 0,
        };
        state.rebuild_parents()?;
        state.image_bytes = state.compute_image_bytes();
        Ok(state)
    }

    /// Sets every inode's parent from the directory entries; fails when an
    /// entry names a missing inode or an inode has two names.
    fn rebuild_parents(&mut self) -> Result<(), ApplyError> {
        let mut parents: Vec<(Ino, Ino)> = Vec::new();
        for dir in self.inodes.values() {
            for (name, &child) in &dir.entries {
                if !self.inodes.contains_key(&child) {
                    return Err(format!(
                        "directory {} entry {name:?} names missing inode {child}",
                        dir.ino
                    ));
                }
                parents.push((child, dir.ino));
            }
        }
        for inode in self.inodes.values_mut() {
            inode.parent = if inode.ino == ROOT_INO { ROOT_INO } else { 0 };
        }
        for (child, parent) in parents {
            let inode = self.inodes.get_mut(&child).expect("checked above");
            if inode.parent != 0 || child == ROOT_INO {
                return Err(format!("inode {child} has more than one name"));
            }
            inode.parent = parent;
        }
        Ok(())
    }

    /// What a checkpoint image must satisfy beyond its encoding: link
    /// counts match the directory entries (an unlinked-but-open orphan has
    /// none), sizes are in range, and only directories have entries.
    pub fn check_links_and_kinds(&self) -> Result<(), ApplyError> {
        for inode in self.inodes.values() {
            let names = u32::from(inode.parent != 0 && inode.ino != ROOT_INO);
            let consistent = if inode.ino == ROOT_INO {
                inode.nlink == 1
            } else {
                inode.nlink == names
            };
            if !consistent {
                return Err(format!(
                    "inode {}: link count {} but {names} directory entries",
                    inode.ino, inode.nlink
                ));
            }
            if inode.size > MAX_FILE_SIZE {
                return Err(format!(
                    "inode {}: size {} exceeds {MAX_FILE_SIZE}",
                    inode.ino, inode.size
                ));
            }
            match inode.kind {
                FileKind::Directory if !inode.extents.is_empty() => {
                    return Err(format!("directory {} has data extents", inode.ino))
                }
                FileKind::Regular if !inode.entries.is_empty() => {
                    return Err(format!("file {} has directory entries", inode.ino))
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub fn to_image(&self) -> MetaImage {
        let mut inos: Vec<Ino> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        let inodes = inos
            .iter()
            .map(|ino| {
                let i = &self.inodes[ino];
                InodeImage {
                    ino: i.ino,
                    kind: i.kind,
                    nlink: i.nlink,
                    size: i.size,
                    mtime_ns: i.mtime_ns,
                    extents: i.extents.iter().copied().collect(),
                    entries: i
                        .entries
                        .iter()
                        .map(|(name, &ino)| DirEntryImage {
                            name: name.clone(),
                            ino,
                        })
                        .collect(),
                }
            })
            .collect();
        MetaImage {
            next_ino: self.next_ino,
            inodes,
        }
    }

    fn compute_image_bytes(&self) -> u64 {
        self.inodes
            .values()
            .map(|i| {
                IMAGE_BYTES_PER_INODE
                    + i.extents.len() as u64 * IMAGE_BYTES_PER_EXTENT
                    + i.entries
                        .keys()
                        .map(|n| IMAGE_BYTES_PER_ENTRY + n.len() as u64)
                        .sum::<u64>()
            })
            .sum()
    }

    /// Upper bound of the encoded checkpoint image in bytes.
    pub fn image_bytes_estimate(&self) -> u64 {
        self.image_bytes
    }

    pub fn inode(&self, ino: Ino) -> Option<&InodeState> {
        self.inodes.get(&ino)
    }

    /// Applies one record. Device ranges the record releases are appended to
    /// `freed`. On error nothing has changed.
    pub fn apply(
        &mut self,
        record: &Record,
        freed: &mut Vec<(u64, u64)>,
    ) -> Result<(), ApplyError> {
        self.check_record(record)?;
        match record {
            Record::Create {
                ino,
                parent,
                name,
                kind,
                mtime_ns,
            } => self.apply_create(*ino, *parent, name, *kind, *mtime_ns),
            Record::Unlink { parent, name } => self.apply_unlink(*parent, name).map(|_| ()),
            Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            } => self.apply_rename(*src_parent, src_name, *dst_parent, dst_name),
            Record::FreeInode { ino } => self.apply_free_inode(*ino, freed),
            Record::MapUnwritten {
                ino,
                file_off,
                len,
                addr,
            } => {
                let inode = self.regular_mut(*ino)?;
                let before = inode.extents.len();
                inode
                    .extents
                    .insert(Extent {
                        file_off: *file_off,
                        len: *len,
                        addr: *addr,
                        state: crate::types::ExtentState::Unwritten,
                    })
                    .map_err(|e| format!("inode {ino}: map unwritten: {e}"))?;
                let after = inode.extents.len();
                self.adjust_extents(before, after);
                Ok(())
            }
            Record::CompleteWrite {
                ino,
                file_off,
                len,
                min_size,
                mtime_ns,
            } => {
                let inode = self.regular_mut(*ino)?;
                let before = inode.extents.len();
                if *len > 0 {
                    inode.extents.convert_written(*file_off, *len);
                }
                inode.size = inode.size.max(*min_size);
                inode.mtime_ns = *mtime_ns;
                let after = inode.extents.len();
                self.adjust_extents(before, after);
                Ok(())
            }
            Record::SetSize {
                ino,
                size,
                mtime_ns,
            } => {
                let block = u64::from(self.block_size);
                let inode = self.regular_mut(*ino)?;
                let before = inode.extents.len();
                let keep_to = size
                    .checked_next_multiple_of(block)
                    .ok_or_else(|| format!("inode {ino}: size {size} too large"))?;
                if *size < inode.size {
                    freed.extend(inode.extents.truncate_blocks_from(keep_to));
                }
                inode.size = *size;
                inode.mtime_ns = *mtime_ns;
                let after = inode.extents.len();
                self.adjust_extents(before, after);
                Ok(())
            }
            Record::Punch {
                ino,
                file_off,
                len,
                mtime_ns,
            } => {
                let inode = self.regular_mut(*ino)?;
                let before = inode.extents.len();
                freed.extend(inode.extents.remove_range(*file_off, *len));
                inode.mtime_ns = *mtime_ns;
                let after = inode.extents.len();
                self.adjust_extents(before, after);
                Ok(())
            }
        }
    }

    /// Rejects a record no live operation would write: ranges not on block
    /// boundaries, sizes or inode numbers past their limits. Replay meets
    /// such records only in a corrupt (or hostile) journal.
    fn check_record(&self, record: &Record) -> Result<(), ApplyError> {
        let block = u64::from(self.block_size);
        let range = |what: &str, off: u64, len: u64, allow_empty: bool| {
            let end = off.checked_add(len).filter(|&e| e <= MAX_FILE_SIZE);
            if end.is_none()
                || !off.is_multiple_of(block)
                || !len.is_multiple_of(block)
                || (len == 0 && !allow_empty)
            {
                return Err(format!(
                    "{what}: file range {off}+{len} is not whole blocks of {block} bytes below {MAX_FILE_SIZE}"
                ));
            }
            Ok(())
        };
        let size = |what: &str, size: u64| {
            if size > MAX_FILE_SIZE {
                return Err(format!("{what}: size {size} exceeds {MAX_FILE_SIZE}"));
            }
            Ok(())
        };
        match record {
            Record::Create { ino, .. } if *ino == 0 || *ino >= MAX_INO => {
                Err(format!("create: inode number {ino} out of range"))
            }
            Record::MapUnwritten {
                file_off,
                len,
                addr,
                ..
            } => {
                range("map unwritten", *file_off, *len, false)?;
                if !addr.is_multiple_of(block) || addr.checked_add(*len).is_none() {
                    return Err(format!(
                        "map unwritten: device address {addr} is not a block"
                    ));
                }
                Ok(())
            }
            Record::CompleteWrite {
                file_off,
                len,
                min_size,
                ..
            } => {
                range("complete write", *file_off, *len, true)?;
                size("complete write", *min_size)
            }
            Record::SetSize { size: s, .. } => size("set size", *s),
            Record::Punch { file_off, len, .. } => range("punch", *file_off, *len, false),
            _ => Ok(()),
        }
    }

    fn adjust_extents(&mut self, before: usize, after: usize) {
        self.image_bytes = (self.image_bytes + after as u64 * IMAGE_BYTES_PER_EXTENT)
            .saturating_sub(before as u64 * IMAGE_BYTES_PER_EXTENT);
    }

    fn regular_mut(&mut self, ino: Ino) -> Result<&mut InodeState, ApplyError> {
        match self.inodes.get_mut(&ino) {
            Some(i) if i.kind == FileKind::Regular => Ok(i),
            Some(_) => Err(format!("inode {ino} is not a regular file")),
            None => Err(format!("inode {ino} does not exist")),
        }
    }

    fn dir(&self, ino: Ino) -> Result<&InodeState, ApplyError> {
        match self.inodes.get(&ino) {
            Some(i) if i.kind == FileKind::Directory && i.nlink > 0 => Ok(i),
            Some(_) => Err(format!("inode {ino} is not a live directory")),
            None => Err(format!("directory {ino} does not exist")),
        }
    }

    fn apply_create(
        &mut self,
        ino: Ino,
        parent: Ino,
        name: &str,
        kind: FileKind,
        mtime_ns: u64,
    ) -> Result<(), ApplyError> {
        codec::check_name(name).map_err(|why| format!("{why}: {name:?}"))?;
        if ino < self.next_ino && self.inodes.contains_key(&ino) {
            return Err(format!("create: inode {ino} already exists"));
        }
        if ino == 0 {
            return Err("create: inode 0".to_string());
        }
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(format!(
                "create: {name:?} already exists in directory {parent}"
            ));
        }
        self.inodes.insert(
            ino,
            InodeState {
                ino,
                kind,
                nlink: 1,
                size: 0,
                mtime_ns,
                extents: ExtentMap::new(self.block_size),
                entries: BTreeMap::new(),
                parent,
            },
        );
        let dir = self.inodes.get_mut(&parent).expect("checked above");
        dir.entries.insert(name.to_string(), ino);
        dir.mtime_ns = mtime_ns;
        self.next_ino = self.next_ino.max(ino + 1);
        self.image_bytes += IMAGE_BYTES_PER_INODE + IMAGE_BYTES_PER_ENTRY + name.len() as u64;
        Ok(())
    }

    /// Removes `parent/name`; returns the inode it named, now at nlink 0.
    fn apply_unlink(&mut self, parent: Ino, name: &str) -> Result<Ino, ApplyError> {
        let child = *self
            .dir(parent)?
            .entries
            .get(name)
            .ok_or_else(|| format!("unlink: no {name:?} in directory {parent}"))?;
        if child == ROOT_INO {
            return Err("unlink: root".to_string());
        }
        let inode = self.inodes.get(&child).ok_or("unlink: dangling entry")?;
        if inode.kind == FileKind::Directory && !inode.entries.is_empty() {
            return Err(format!("unlink: directory {child} not empty"));
        }
        self.inodes
            .get_mut(&parent)
            .expect("checked above")
            .entries
            .remove(name);
        let inode = self.inodes.get_mut(&child).expect("checked above");
        inode.nlink = 0;
        inode.parent = 0;
        self.image_bytes = self
            .image_bytes
            .saturating_sub(IMAGE_BYTES_PER_ENTRY + name.len() as u64);
        Ok(child)
    }

    fn apply_rename(
        &mut self,
        src_parent: Ino,
        src_name: &str,
        dst_parent: Ino,
        dst_name: &str,
    ) -> Result<(), ApplyError> {
        codec::check_name(dst_name).map_err(|why| format!("{why}: {dst_name:?}"))?;
        let src = *self
            .dir(src_parent)?
            .entries
            .get(src_name)
            .ok_or_else(|| format!("rename: no {src_name:?} in directory {src_parent}"))?;
        let replaced = self.dir(dst_parent)?.entries.get(dst_name).copied();
        if replaced == Some(src) {
            return Ok(());
        }
        let src_kind = self.inodes.get(&src).ok_or("rename: dangling entry")?.kind;
        if src_kind == FileKind::Directory && self.is_ancestor(src, dst_parent) {
            return Err(format!("rename: directory {src} into its own subtree"));
        }
        if let Some(old) = replaced {
            let old_inode = self.inodes.get(&old).ok_or("rename: dangling target")?;
            match (src_kind, old_inode.kind) {
                (FileKind::Directory, FileKind::Directory) if old_inode.entries.is_empty() => {}
                (FileKind::Regular, FileKind::Regular) => {}
                _ => return Err(format!("rename: cannot replace inode {old} with {src}")),
            }
            self.apply_unlink(dst_parent, dst_name)?;
        }
        self.inodes
            .get_mut(&src_parent)
            .expect("checked above")
            .entries
            .remove(src_name);
        self.inodes
            .get_mut(&dst_parent)
            .expect("checked above")
            .entries
            .insert(dst_name.to_string(), src);
        self.inodes.get_mut(&src).expect("checked above").parent = dst_parent;
        self.image_bytes =
            (self.image_bytes + dst_name.len() as u64).saturating_sub(src_name.len() as u64);
        Ok(())
    }

    /// Whether `ancestor` is `ino` or one of its parents.
    pub fn is_ancestor(&self, ancestor: Ino, mut ino: Ino) -> bool {
        // Bounded walk: a corrupt parent cycle must not hang us.
        for _ in 0..=self.inodes.len() {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT_INO || ino == 0 {
                return false;
            }
            ino = match self.inodes.get(&ino) {
                Some(i) => i.parent,
                None => return false,
            };
        }
        false
    }

    fn apply_free_inode(
        &mut self,
        ino: Ino,
        freed: &mut Vec<(u64, u64)>,
    ) -> Result<(), ApplyError> {
        match self.inodes.get(&ino) {
            Some(i) if i.nlink == 0 && i.entries.is_empty() => {}
            Some(_) => return Err(format!("free inode {ino}: still linked or not empty")),
            None => return Err(format!("free inode {ino}: does not exist")),
        }
        let inode = self.inodes.remove(&ino).expect("checked above");
        freed.extend(inode.extents.iter().map(|e| (e.addr, e.len)));
        self.image_bytes = self.image_bytes.saturating_sub(
            IMAGE_BYTES_PER_INODE + inode.extents.len() as u64 * IMAGE_BYTES_PER_EXTENT,
        );
        Ok(())
    }
}
