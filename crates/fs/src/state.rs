//! The in-memory metadata of a volume and the one function that changes it.
//!
//! Every metadata change is a [`Record`]. The live path builds a record,
//! applies it here and queues it for the journal; recovery applies the
//! journal's records to the checkpoint's image with the same
//! [`MetaState::apply`]. One implementation means replay cannot drift from
//! what the live path did.

use std::collections::BTreeMap;
use std::sync::Arc;

use imbl::OrdMap;

use crate::codec;
use crate::extent_map::ExtentMap;
use crate::limits::{MAX_FILE_SIZE, MAX_INO, MAX_LINKS, MAX_XATTR_BYTES_PER_INODE};
use crate::page_chunks::PagedMaps;
use crate::types::{
    ChangedInodes, DirEntryImage, Extent, FileKind, Ino, InoMap, InodeAttrs, InodeChanges,
    InodeDelta, InodeImage, InodeTable, KeySpan, MetaDelta, MetaImage, Record, Timestamp,
    XattrImage, ROOT_INO,
};

/// Encoded bytes a checkpoint spends per inode, extent and directory entry
/// (plus the name's bytes), as the codec writes them: used to refuse changes
/// that would not fit a checkpoint slot.
pub const IMAGE_BYTES_PER_INODE: u64 = codec::INODE_FIXED_ENCODED_LEN as u64;
pub const IMAGE_BYTES_PER_EXTENT: u64 = codec::EXTENT_ENCODED_LEN as u64;
/// An entry's encoding without its name bytes (the minimum counts one).
pub const IMAGE_BYTES_PER_ENTRY: u64 = codec::ENTRY_MIN_ENCODED_LEN as u64 - 1;
/// An extended attribute's encoding without its name and value bytes.
pub const IMAGE_BYTES_PER_XATTR: u64 = codec::XATTR_OVERHEAD_ENCODED_LEN as u64;

#[derive(Clone, Debug)]
pub struct InodeState {
    pub ino: Ino,
    pub kind: FileKind,
    /// Directory entries naming this inode (directories: 0 or 1).
    pub nlink: u32,
    pub size: u64,
    pub attrs: InodeAttrs,
    pub extents: ExtentMap,
    /// A persistent ordered map: a snapshot shares it, and the first
    /// change after one copies only the path to the changed entry (a large
    /// directory copied whole held the metadata lock for as long as the
    /// copy took).
    pub entries: OrdMap<String, Ino>,
    pub xattrs: Arc<BTreeMap<String, Vec<u8>>>,
    /// A symlink's target; empty for other kinds.
    pub target: Vec<u8>,
    /// For a directory, the directory holding its one entry (the root is
    /// its own parent; 0 once unlinked). 0 for every other kind: they may
    /// have many names, and nothing needs to walk up from them.
    pub parent: Ino,
    /// For a directory, how many of its entries are directories (its link
    /// count as POSIX reports it is 2 + this). Not stored: rebuilt at load.
    pub subdirs: u32,
}

impl InodeState {
    /// Bytes of names and values in this inode's extended attributes.
    pub fn xattr_bytes(&self) -> usize {
        self.xattrs.iter().map(|(n, v)| n.len() + v.len()).sum()
    }

    /// What this inode itself adds to the checkpoint image: its fixed part,
    /// extents, xattrs and target (its entries are counted with them too;
    /// the entries naming it are counted with their directories).
    fn image_bytes(&self) -> u64 {
        IMAGE_BYTES_PER_INODE
            + self.extents.len() as u64 * IMAGE_BYTES_PER_EXTENT
            + self
                .entries
                .keys()
                .map(|n| IMAGE_BYTES_PER_ENTRY + n.len() as u64)
                .sum::<u64>()
            + self
                .xattrs
                .iter()
                .map(|(n, v)| IMAGE_BYTES_PER_XATTR + (n.len() + v.len()) as u64)
                .sum::<u64>()
            + self.target.len() as u64
    }
}

/// All inodes, directories and extent maps of a volume.
#[derive(Clone, Debug)]
pub struct MetaState {
    pub block_size: u32,
    pub next_ino: Ino,
    pub inodes: InodeTable<InodeState>,
    /// Encoded size of the checkpoint image's inodes, kept incrementally.
    image_bytes: u64,
    /// Extents and chunks of the files a base with extent pages pages
    /// (those past [`codec::inline_extents_max`]), kept incrementally:
    /// what bounds that base's pages.
    paged: PagedSize,
    /// Inodes a record changed (created, changed or deleted) since the
    /// last [`MetaState::take_changed`], with the extent-map key spans the
    /// records touched: what a delta checkpoint must write. Filled by
    /// [`MetaState::apply`], so journal replay fills it too. A checkpoint
    /// takes it before cloning the state, so snapshots carry an empty one
    /// and cloning stays O(1).
    changed: ChangedInodes,
    /// Key spans in `changed`, all inodes together.
    changed_spans: usize,
}

/// The entry of `ino` in `changed`, made with `existed` (whether it
/// existed before the record that changes it) if it had none.
fn note_change(changed: &mut ChangedInodes, (ino, existed): (Ino, bool)) -> &mut InodeChanges {
    changed.entry(ino).or_insert_with(|| InodeChanges {
        existed,
        spans: Vec::new(),
    })
}

/// The inodes whose maps a base pages (regular files with more extents
/// than a root keeps inline): the ones the evictor sweeps and the page
/// loader counts.
pub(crate) fn paged_maps(
    inodes: &InodeTable<InodeState>,
    block_size: u32,
) -> impl Iterator<Item = (&Ino, &InodeState)> {
    let inline = crate::codec::inline_extents_max(u64::from(block_size));
    inodes
        .iter()
        .filter(move |(_, i)| i.kind == FileKind::Regular && i.extents.len() > inline)
}

/// [`MetaState::unpaged_chunk_bytes`] of an inode table: for a caller that
/// clones the table (O(1)) under the metadata lock and walks the clone
/// without it.
pub fn unpaged_chunk_bytes_of(inodes: &InodeTable<InodeState>, block_size: u32) -> u64 {
    let extents: usize = paged_maps(inodes, block_size)
        .map(|(_, i)| i.extents.unpaged_extents())
        .sum();
    (extents * std::mem::size_of::<Extent>()) as u64
}

/// Memory the maps that are paged (more than a root keeps inline) take
/// beside their chunks' extents ([`crate::extent_map::ExtentMap::shell_bytes`]):
/// what the page loader counts against the budget as shells
/// (`PageLoads::shell_bytes`).
pub(crate) fn paged_shell_bytes_of(inodes: &InodeTable<InodeState>, block_size: u32) -> u64 {
    paged_maps(inodes, block_size)
        .map(|(_, i)| i.extents.shell_bytes())
        .sum()
}

/// `spans` sorted and merged where they overlap or touch.
pub(crate) fn merged_spans(spans: &[KeySpan]) -> Vec<KeySpan> {
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<KeySpan> = Vec::with_capacity(sorted.len());
    for (start, end) in sorted {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// `inode` as an image stores it, with `extents` (all of its extents, or
/// those a delta writes).
fn inode_image(inode: &InodeState, extents: Vec<Extent>) -> InodeImage {
    InodeImage {
        ino: inode.ino,
        kind: inode.kind,
        nlink: inode.nlink,
        size: inode.size,
        attrs: inode.attrs,
        extents,
        entries: inode
            .entries
            .iter()
            .map(|(name, &ino)| DirEntryImage {
                name: name.clone(),
                ino,
            })
            .collect(),
        xattrs: inode
            .xattrs
            .iter()
            .map(|(name, value)| XattrImage {
                name: name.clone(),
                value: value.clone(),
            })
            .collect(),
        target: inode.target.clone(),
    }
}

/// Why a record could not be applied: on replay this means a corrupt journal
/// (records are checksummed, so a bug wrote it); on the live path, a bug.
pub type ApplyError = String;

/// The mode of a new root directory: `rwxr-xr-x`, owned by root.
pub const ROOT_MODE: u32 = 0o755;

impl MetaState {
    /// A snapshot for a long pass without the metadata lock (the
    /// free-space scan after mount): a clone whose extent maps share no
    /// cold segment with this state's (`ExtentMap::detached`), so that
    /// the chunks the live maps load meanwhile, and evict, are not kept
    /// by the snapshot until the pass ends. Costs a copy of the cold
    /// segments' page lists (a page reference per chunk).
    pub(crate) fn detached_snapshot(&self) -> MetaState {
        let mut copy = self.clone();
        let cold: Vec<Ino> = self
            .inodes
            .iter()
            .filter(|(_, i)| i.extents.open_segments() < i.extents.segment_count())
            .map(|(&ino, _)| ino)
            .collect();
        for ino in cold {
            if let Some(inode) = copy.inodes.get_mut(&ino) {
                inode.extents = inode.extents.detached();
            }
        }
        copy
    }

    /// An empty file system: just the root directory, owned by `uid`/`gid`.
    pub fn new_empty(block_size: u32, now: Timestamp, uid: u32, gid: u32) -> MetaState {
        let mut inodes = InodeTable::default();
        inodes.insert(
            ROOT_INO,
            InodeState {
                ino: ROOT_INO,
                kind: FileKind::Directory,
                nlink: 1,
                size: 0,
                attrs: InodeAttrs::new(ROOT_MODE, uid, gid, now),
                extents: ExtentMap::new(block_size),
                entries: OrdMap::new(),
                xattrs: Arc::default(),
                target: Vec::new(),
                parent: ROOT_INO,
                subdirs: 0,
            },
        );
        let mut state = MetaState {
            block_size,
            next_ino: ROOT_INO + 1,
            inodes,
            image_bytes: 0,
            paged: PagedSize::default(),
            changed: ChangedInodes::default(),
            changed_spans: 0,
        };
        state.recount();
        state
    }

    /// Loads a checkpoint image, validating what the image alone can tell.
    pub fn from_image(image: &MetaImage, block_size: u32) -> Result<MetaState, ApplyError> {
        MetaState::from_image_and_pages(image, PagedMaps::default(), block_size, None)
    }

    /// [`MetaState::from_image`] of an image whose files kept in extent
    /// pages have their extents in `paged`: each such map is built from
    /// its chunks as they are, one chunk per page, each naming its page
    /// (so the next base writes only the chunks that change from here on).
    ///
    /// An absent chunk (`PageChunk::absent`) stays absent in its map, read
    /// through `loader` when an entry point first needs it; `loader` must
    /// be given if `paged` has any.
    pub fn from_image_and_pages(
        image: &MetaImage,
        paged: PagedMaps,
        block_size: u32,
        loader: Option<Arc<dyn crate::extent_map::PageLoader>>,
    ) -> Result<MetaState, ApplyError> {
        let mut inodes = InodeTable::default();
        let mut paged = paged;
        let lists = paged.take_lists();
        let mut paged = paged.into_files().peekable();
        for img in &image.inodes {
            if let Some((ino, _)) = paged.next_if(|&(ino, _)| ino < img.ino) {
                return Err(format!(
                    "the page table names inode {ino}, which is not there"
                ));
            }
            let chunks = paged.next_if(|&(ino, _)| ino == img.ino).map(|(_, c)| c);
            if img.ino == 0 || img.ino >= image.next_ino {
                return Err(format!(
                    "inode {} out of range (next inode {})",
                    img.ino, image.next_ino
                ));
            }
            let extents = match chunks {
                None => ExtentMap::from_extents(block_size, img.extents.clone()),
                Some(_) if !img.extents.is_empty() => {
                    Err("it has extents both in the image and in pages".to_string())
                }
                Some(chunks) => ExtentMap::from_runs_lazy(
                    block_size,
                    chunks,
                    loader.clone().map(|loader| {
                        Arc::new(crate::extent_map::PageSource {
                            ino: img.ino,
                            loader,
                        })
                    }),
                    lists
                        .binary_search_by_key(&img.ino, |&(ino, _)| ino)
                        .ok()
                        .map(|at| &lists[at].1),
                ),
            }
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
            let mut xattrs = BTreeMap::new();
            for x in &img.xattrs {
                if xattrs.insert(x.name.clone(), x.value.clone()).is_some() {
                    return Err(format!("inode {}: duplicate xattr {:?}", img.ino, x.name));
                }
            }
            let state = InodeState {
                ino: img.ino,
                kind: img.kind,
                nlink: img.nlink,
                size: img.size,
                attrs: img.attrs,
                extents,
                entries: OrdMap::from(entries),
                xattrs: Arc::new(xattrs),
                target: img.target.clone(),
                parent: 0,
                subdirs: 0,
            };
            if inodes.insert(img.ino, state).is_some() {
                return Err(format!("inode {} appears twice", img.ino));
            }
        }
        if let Some((ino, _)) = paged.next() {
            return Err(format!(
                "the page table names inode {ino}, which is not there"
            ));
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
            paged: PagedSize::default(),
            changed: ChangedInodes::default(),
            changed_spans: 0,
        };
        state.rebuild_parents()?;
        state.recount();
        Ok(state)
    }

    /// Sets every directory's parent from the directory entries; fails when
    /// an entry names a missing inode or a directory has two names.
    fn rebuild_parents(&mut self) -> Result<(), ApplyError> {
        let mut parents: Vec<(Ino, Ino)> = Vec::new();
        for dir in self.inodes.values() {
            for (name, &child) in dir.entries.iter() {
                match self.inodes.get(&child) {
                    None => {
                        return Err(format!(
                            "directory {} entry {name:?} names missing inode {child}",
                            dir.ino
                        ))
                    }
                    Some(c) if c.kind == FileKind::Directory => parents.push((child, dir.ino)),
                    Some(_) => {}
                }
            }
        }
        for (_, inode) in self.inodes.iter_mut() {
            inode.parent = if inode.ino == ROOT_INO { ROOT_INO } else { 0 };
        }
        for (_, inode) in self.inodes.iter_mut() {
            inode.subdirs = 0;
        }
        for (child, parent) in parents {
            let inode = self.inodes.get_mut(&child).expect("checked above");
            if inode.parent != 0 || child == ROOT_INO {
                return Err(format!("directory {child} has more than one name"));
            }
            inode.parent = parent;
            let dir = self.inodes.get_mut(&parent).expect("an entry's directory");
            dir.subdirs += 1;
        }
        Ok(())
    }

    /// Directory entries naming each inode.
    pub fn name_counts(&self) -> InoMap<u32> {
        let mut names: InoMap<u32> = InoMap::default();
        for dir in self.inodes.values() {
            for child in dir.entries.values() {
                *names.entry(*child).or_default() += 1;
            }
        }
        names
    }

    /// What a checkpoint image must satisfy beyond its encoding: link
    /// counts match the directory entries (an unlinked-but-open orphan has
    /// none), sizes are in range, and each kind holds only what it may.
    pub fn check_links_and_kinds(&self) -> Result<(), ApplyError> {
        let names = self.name_counts();
        for inode in self.inodes.values() {
            let named = names.get(&inode.ino).copied().unwrap_or(0);
            let consistent = if inode.ino == ROOT_INO {
                inode.nlink == 1 && named == 0
            } else {
                inode.nlink == named
            };
            if !consistent {
                return Err(format!(
                    "inode {}: link count {} but {named} directory entries",
                    inode.ino, inode.nlink
                ));
            }
            if inode.kind == FileKind::Directory && named > 1 {
                return Err(format!("directory {} has {named} names", inode.ino));
            }
            if inode.nlink > MAX_LINKS {
                return Err(format!(
                    "inode {}: link count {} exceeds {MAX_LINKS}",
                    inode.ino, inode.nlink
                ));
            }
            if inode.size > MAX_FILE_SIZE {
                return Err(format!(
                    "inode {}: size {} exceeds {MAX_FILE_SIZE}",
                    inode.ino, inode.size
                ));
            }
            check_shape(inode)?;
        }
        Ok(())
    }

    /// The image [`MetaState::to_image`] would give, encoded after `room`
    /// zero bytes (see [`codec::encode_image_after`]), without copying
    /// every extent into an image first: a whole checkpoint of ten million
    /// extents held 320 MB of such copies while it encoded them.
    pub fn encode_image_after(&self, room: usize) -> crate::error::Result<Vec<u8>> {
        let mut inos: Vec<Ino> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        let heads: Vec<(InodeImage, &ExtentMap)> = inos
            .iter()
            .map(|ino| {
                let i = &self.inodes[ino];
                (inode_image(i, Vec::new()), &i.extents)
            })
            .collect();
        let inodes: Vec<(&InodeImage, &dyn codec::ExtentSource)> = heads
            .iter()
            .map(|(inode, extents)| (inode, *extents as &dyn codec::ExtentSource))
            .collect();
        codec::encode_image_from(room, self.next_ino, &inodes)
    }

    /// A checkpoint root of this state (see `codec::root`) after `room`
    /// bytes: the image with the extents of the files `pages` does not
    /// list inline, and `pages`, the page table of the other files' extent
    /// maps (see `extent_pages::plan_pages`).
    ///
    /// With `index` (the index pages listing `pages`, per file), the root
    /// lists them instead of the pages (`INCOMPAT_PAGE_INDEX`).
    pub fn encode_root_after(
        &self,
        room: usize,
        pages: &codec::PageTable,
        index: Option<&codec::IndexTable>,
    ) -> crate::error::Result<Vec<u8>> {
        let mut inos: Vec<Ino> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        let mut paged = pages.iter().map(|(ino, _)| *ino).peekable();
        let heads: Vec<InodeImage> = inos
            .iter()
            .map(|ino| {
                let i = &self.inodes[ino];
                while paged.next_if(|p| p < ino).is_some() {}
                let inline = if paged.peek() == Some(ino) {
                    Vec::new()
                } else {
                    i.extents.iter().copied().collect()
                };
                inode_image(i, inline)
            })
            .collect();
        let heads: Vec<&InodeImage> = heads.iter().collect();
        let block_size = u64::from(self.block_size);
        match index {
            Some(index) => {
                codec::encode_indexed_root_after(room, self.next_ino, &heads, index, block_size)
            }
            None => codec::encode_root_after(room, self.next_ino, &heads, pages, block_size),
        }
    }

    pub fn to_image(&self) -> MetaImage {
        let mut inos: Vec<Ino> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        let inodes = inos
            .iter()
            .map(|ino| {
                let i = &self.inodes[ino];
                inode_image(i, i.extents.iter().copied().collect())
            })
            .collect();
        MetaImage {
            next_ino: self.next_ino,
            inodes,
        }
    }

    /// Bytes of the chunks of paged files (those a base writes pages for)
    /// that name no page: changed since the last base, so only memory
    /// holds them and the evictor cannot drop them. Reads no page, and
    /// counts again only the segments changed since they were last
    /// counted (or all, once after each base).
    pub fn unpaged_chunk_bytes(&self) -> u64 {
        unpaged_chunk_bytes_of(&self.inodes, self.block_size)
    }

    /// Whether `ino` changed since the last [`MetaState::take_changed`]:
    /// the next delta reads its changed spans.
    pub fn changed_since_taken(&self, ino: Ino) -> bool {
        self.changed.contains_key(&ino)
    }

    /// The extent-map key spans records changed in `ino` since the last
    /// [`MetaState::take_changed`] (in the order they applied), if it
    /// changed: what the next delta reads.
    pub fn changed_spans(&self, ino: Ino) -> Option<&[KeySpan]> {
        self.changed.get(&ino).map(|c| c.spans.as_slice())
    }

    /// Takes the set of inodes changed since the last call (see
    /// [`MetaState::delta_since`]).
    pub fn take_changed(&mut self) -> ChangedInodes {
        self.changed_spans = 0;
        std::mem::take(&mut self.changed)
    }

    /// Key spans changed since the last [`MetaState::take_changed`], all
    /// inodes together: memory only a checkpoint gives back.
    pub fn changed_span_count(&self) -> usize {
        self.changed_spans
    }

    /// What changed from the state of one [`MetaState::take_changed`] (the
    /// base) to `self`, given `changed`, what the next call returned when
    /// `self` was taken: every inode that differs between the two, with the
    /// key spans its extents may differ in. Costs O(changed inodes, records
    /// and the extents in their spans): nothing walks what did not change,
    /// and nothing of the base is kept for it (a kept base would make the
    /// first change after each checkpoint copy what it touches, and
    /// dropping it would free every chunk changed since).
    pub fn delta_since(&self, changed: &ChangedInodes) -> MetaDelta {
        let mut inos: Vec<Ino> = changed.keys().copied().collect();
        inos.sort_unstable();
        let mut delta = MetaDelta {
            next_ino: self.next_ino,
            ..MetaDelta::default()
        };
        for ino in inos {
            match (self.inodes.get(&ino), changed[&ino].existed) {
                (None, false) => {}
                (None, true) => delta.removed.push(ino),
                (Some(live), false) => delta.changed.push(InodeDelta {
                    spans: vec![(0, u64::MAX)],
                    inode: inode_image(live, live.extents.iter().copied().collect()),
                }),
                (Some(live), true) => {
                    let spans = merged_spans(&changed[&ino].spans);
                    let extents = live.extents.extents_in(&spans);
                    delta.changed.push(InodeDelta {
                        spans,
                        inode: inode_image(live, extents),
                    });
                }
            }
        }
        delta
    }

    /// Computes the sizes kept incrementally ([`MetaState::image_bytes_estimate`],
    /// [`MetaState::paged_size`]) from the inodes: after the maps were
    /// replaced rather than changed by records (a mount building them from
    /// extent pages).
    pub fn recount(&mut self) {
        self.image_bytes = self.inodes.values().map(InodeState::image_bytes).sum();
        let block_size = u64::from(self.block_size);
        self.paged = self
            .inodes
            .values()
            .map(|i| PagedSize::of(&i.extents, block_size))
            .fold(PagedSize::default(), PagedSize::plus);
    }

    /// Extents and chunks of the files a base with extent pages pages.
    pub fn paged_size(&self) -> PagedSize {
        self.paged
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
        let touched = self.touched_by(record);
        let keys = self.extent_keys_touched_by(record);
        // Before the record applies: whether each inode it changes existed.
        let existed = |state: &MetaState, ino: Ino| (ino, state.inodes.contains_key(&ino));
        let touched = touched.map(|ino| existed(self, ino));
        let keys = keys.map(|(ino, span)| (existed(self, ino), span));
        self.apply_checked(record, freed)?;
        for changed in touched.into_iter().filter(|&(ino, _)| ino != 0) {
            note_change(&mut self.changed, changed);
        }
        if let Some((changed, span)) = keys {
            note_change(&mut self.changed, changed).spans.push(span);
            self.changed_spans += 1;
        }
        Ok(())
    }

    /// Loads the absent extent chunks `record` would read or change (see
    /// `ExtentMap::load_for_change`), so that [`MetaState::apply`] runs
    /// without I/O; a page that does not load fails here, before anything
    /// changed. Returns how many pages it loaded. The one exception is a
    /// freed inode: its pages are only checked here, and read again by the
    /// apply, so that freeing a map never holds all of it.
    pub fn load_for_record(&self, record: &Record) -> crate::error::Result<usize> {
        if let Record::FreeInode { ino } = record {
            // Every page of the map read and dropped, none kept: a page
            // that fails fails here, before anything changed, and the
            // apply reads them again one at a time (a 4M-extent file
            // loaded whole took 128 MB).
            if let Some(inode) = self.inodes.get(ino) {
                inode.extents.for_each_unkept(0, |_| true)?;
            }
            return Ok(0);
        }
        let Some((ino, off, end)) = self.extent_range_of(record) else {
            return Ok(0);
        };
        self.inodes
            .get(&ino)
            .map_or(Ok(0), |i| i.extents.load_for_change(off, end))
    }

    /// The extent-map keys (file offsets at which extents start) `record`
    /// may add, remove or change, looked up before it applies: from the
    /// extent before its range (which a split shortens or a merge
    /// lengthens) through its end (where a split or a merge adds or removes
    /// a key).
    fn extent_keys_touched_by(&self, record: &Record) -> Option<(Ino, KeySpan)> {
        let (ino, off, end) = self.extent_range_of(record)?;
        let extents = &self.inodes.get(&ino)?.extents;
        let from = extents.key_before(off).unwrap_or(off);
        Some((ino, (from, end.saturating_add(1))))
    }

    /// The file range `[off, end)` of the map `record` changes, if it
    /// changes one: a truncate's from its new size (in whole blocks) on.
    fn extent_range_of(&self, record: &Record) -> Option<(Ino, u64, u64)> {
        match record {
            Record::MapUnwritten {
                ino, file_off, len, ..
            }
            | Record::CompleteWrite {
                ino, file_off, len, ..
            }
            | Record::Punch {
                ino, file_off, len, ..
            } => Some((*ino, *file_off, file_off.saturating_add(*len))),
            // A size too large to round is refused when the record
            // applies; until then it changes nothing past the map's end.
            Record::SetSize { ino, size, .. } => Some((
                *ino,
                size.checked_next_multiple_of(u64::from(self.block_size.max(1)))
                    .unwrap_or(u64::MAX),
                u64::MAX,
            )),
            _ => None,
        }
    }

    /// The inodes `record` may change (0: none), looked up before it
    /// applies (an unlink or rename removes the entry that names one).
    fn touched_by(&self, record: &Record) -> [Ino; 4] {
        let named = |dir: &Ino, name: &String| {
            self.inodes
                .get(dir)
                .and_then(|d| d.entries.get(name).copied())
                .unwrap_or(0)
        };
        match record {
            Record::Create { ino, parent, .. } | Record::Link { ino, parent, .. } => {
                [*ino, *parent, 0, 0]
            }
            Record::Unlink { parent, name, .. } => [*parent, named(parent, name), 0, 0],
            Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                ..
            } => [
                *src_parent,
                *dst_parent,
                named(src_parent, src_name),
                named(dst_parent, dst_name),
            ],
            Record::SetAttr { ino, .. }
            | Record::SetXattr { ino, .. }
            | Record::RemoveXattr { ino, .. }
            | Record::FreeInode { ino }
            | Record::MapUnwritten { ino, .. }
            | Record::CompleteWrite { ino, .. }
            | Record::SetSize { ino, .. }
            | Record::Punch { ino, .. } => [*ino, 0, 0, 0],
        }
    }

    fn apply_checked(
        &mut self,
        record: &Record,
        freed: &mut Vec<(u64, u64)>,
    ) -> Result<(), ApplyError> {
        match record {
            Record::Create {
                ino,
                parent,
                name,
                kind,
                attrs,
                target,
            } => self.apply_create(*ino, *parent, name, *kind, attrs, target),
            Record::Unlink { parent, name, time } => {
                self.apply_unlink(*parent, name, *time).map(|_| ())
            }
            Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                exchange: false,
                time,
            } => self.apply_rename(*src_parent, src_name, *dst_parent, dst_name, *time),
            Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                exchange: true,
                time,
            } => self.apply_exchange(*src_parent, src_name, *dst_parent, dst_name, *time),
            Record::Link {
                ino,
                parent,
                name,
                time,
            } => self.apply_link(*ino, *parent, name, *time),
            Record::SetAttr {
                ino,
                mode,
                uid,
                gid,
                atime,
                mtime,
                ctime,
            } => {
                let inode = self.inode_mut(*ino)?;
                inode.attrs.mode = *mode;
                inode.attrs.uid = *uid;
                inode.attrs.gid = *gid;
                inode.attrs.atime = *atime;
                inode.attrs.mtime = *mtime;
                inode.attrs.ctime = *ctime;
                Ok(())
            }
            Record::SetXattr {
                ino,
                name,
                value,
                ctime,
            } => {
                let inode = self.inode_mut(*ino)?;
                let old = inode.xattrs.get(name).map(|v| name.len() + v.len());
                let total = inode.xattr_bytes() - old.unwrap_or(0) + name.len() + value.len();
                if total > MAX_XATTR_BYTES_PER_INODE {
                    return Err(format!(
                        "inode {ino}: xattrs would take {total} bytes, more than {MAX_XATTR_BYTES_PER_INODE}"
                    ));
                }
                Arc::make_mut(&mut inode.xattrs).insert(name.clone(), value.clone());
                inode.attrs.ctime = *ctime;
                // Old bytes out before new bytes in: a shorter value must not
                // underflow (it did, with overflow checks on).
                self.image_bytes = match old {
                    Some(old) => self.image_bytes - old as u64,
                    None => self.image_bytes + IMAGE_BYTES_PER_XATTR,
                } + (name.len() + value.len()) as u64;
                Ok(())
            }
            Record::RemoveXattr { ino, name, ctime } => {
                let inode = self.inode_mut(*ino)?;
                let Some(value) = Arc::make_mut(&mut inode.xattrs).remove(name) else {
                    return Err(format!("inode {ino}: no xattr {name:?} to remove"));
                };
                inode.attrs.ctime = *ctime;
                self.image_bytes -= IMAGE_BYTES_PER_XATTR + (name.len() + value.len()) as u64;
                Ok(())
            }
            Record::FreeInode { ino } => self.apply_free_inode(*ino, freed),
            Record::MapUnwritten {
                ino,
                file_off,
                len,
                addr,
            } => {
                let inode = self.regular_mut(*ino)?;
                let before = MapSize::of(&inode.extents);
                inode
                    .extents
                    .insert(Extent {
                        file_off: *file_off,
                        len: *len,
                        addr: *addr,
                        state: crate::types::ExtentState::Unwritten,
                    })
                    .map_err(|e| format!("inode {ino}: map unwritten: {e}"))?;
                let after = MapSize::of(&inode.extents);
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
                let before = MapSize::of(&inode.extents);
                if *len > 0 {
                    inode.extents.convert_written(*file_off, *len);
                }
                inode.size = inode.size.max(*min_size);
                if *mtime_ns != 0 {
                    inode.set_data_changed(*mtime_ns);
                }
                let after = MapSize::of(&inode.extents);
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
                let before = MapSize::of(&inode.extents);
                let keep_to = size
                    .checked_next_multiple_of(block)
                    .ok_or_else(|| format!("inode {ino}: size {size} too large"))?;
                if *size < inode.size {
                    freed.extend(inode.extents.truncate_blocks_from(keep_to));
                }
                inode.size = *size;
                inode.set_data_changed(*mtime_ns);
                let after = MapSize::of(&inode.extents);
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
                let before = MapSize::of(&inode.extents);
                freed.extend(inode.extents.remove_range(*file_off, *len));
                inode.set_data_changed(*mtime_ns);
                let after = MapSize::of(&inode.extents);
                self.adjust_extents(before, after);
                Ok(())
            }
        }
    }

    /// Rejects a record no live operation would write: ranges not on block
    /// boundaries, sizes or inode numbers past their limits, attributes the
    /// format does not allow. Replay meets such records only in a corrupt
    /// (or hostile) journal.
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
        let times = |what: &str, ts: &[Timestamp]| {
            if ts.iter().any(|t| !t.is_valid()) {
                return Err(format!("{what}: timestamp nanoseconds out of range"));
            }
            Ok(())
        };
        match record {
            Record::Create { ino, .. } if *ino == 0 || *ino >= MAX_INO => {
                Err(format!("create: inode number {ino} out of range"))
            }
            Record::Create {
                kind,
                attrs,
                target,
                ..
            } => {
                codec::check_attrs(attrs).map_err(|r| format!("create: {r}"))?;
                if *kind == FileKind::Symlink {
                    codec::check_symlink_target(target).map_err(|r| format!("create: {r}"))?;
                } else if !target.is_empty() {
                    return Err(format!("create: a {kind:?} with a symlink target"));
                }
                if !matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) && attrs.rdev != 0
                {
                    return Err(format!("create: a {kind:?} with a device number"));
                }
                Ok(())
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
            Record::SetAttr {
                mode,
                atime,
                mtime,
                ctime,
                ..
            } => {
                codec::check_mode(*mode).map_err(|r| format!("set attributes: {r}"))?;
                times("set attributes", &[*atime, *mtime, *ctime])
            }
            Record::SetXattr { name, ctime, .. } | Record::RemoveXattr { name, ctime, .. } => {
                codec::check_xattr_name(name).map_err(|r| format!("xattr {name:?}: {r}"))?;
                times("xattr", &[*ctime])
            }
            Record::Unlink { time, .. }
            | Record::Rename { time, .. }
            | Record::Link { time, .. } => times("name change", &[*time]),
            Record::FreeInode { .. } => Ok(()),
        }
    }

    fn adjust_extents(&mut self, before: MapSize, after: MapSize) {
        self.image_bytes = (self.image_bytes + after.extents * IMAGE_BYTES_PER_EXTENT)
            .saturating_sub(before.extents * IMAGE_BYTES_PER_EXTENT);
        let block_size = u64::from(self.block_size);
        self.paged = self
            .paged
            .plus(after.paged(block_size))
            .minus(before.paged(block_size));
    }

    fn inode_mut(&mut self, ino: Ino) -> Result<&mut InodeState, ApplyError> {
        self.inodes
            .get_mut(&ino)
            .ok_or_else(|| format!("inode {ino} does not exist"))
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

    /// The inode `dir/name` names, `dir` a live directory (`op`: which
    /// operation asks, for the message).
    fn entry(&self, dir: Ino, name: &str, op: &str) -> Result<Ino, ApplyError> {
        self.dir(dir)?
            .entries
            .get(name)
            .copied()
            .ok_or_else(|| format!("{op}: no {name:?} in directory {dir}"))
    }

    /// The entries of directory `dir`, which the caller found with
    /// [`MetaState::dir`] or [`MetaState::entry`].
    fn entries_mut(&mut self, dir: Ino) -> &mut OrdMap<String, Ino> {
        self.inodes
            .get_mut(&dir)
            .expect("a directory checked by the caller")
            .entries_mut()
    }

    /// A directory's entries changed at `time`.
    fn touch_dir(&mut self, dir: Ino, time: Timestamp) {
        if let Some(d) = self.inodes.get_mut(&dir) {
            d.attrs.mtime = time;
            d.attrs.ctime = time;
        }
    }

    fn apply_create(
        &mut self,
        ino: Ino,
        parent: Ino,
        name: &str,
        kind: FileKind,
        attrs: &InodeAttrs,
        target: &[u8],
    ) -> Result<(), ApplyError> {
        codec::check_name(name).map_err(|why| format!("{why}: {name:?}"))?;
        if self.inodes.contains_key(&ino) {
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
        let inode = InodeState {
            ino,
            kind,
            nlink: 1,
            size: 0,
            attrs: *attrs,
            extents: ExtentMap::new(self.block_size),
            entries: OrdMap::new(),
            xattrs: Arc::default(),
            target: target.to_vec(),
            parent: if kind == FileKind::Directory {
                parent
            } else {
                0
            },
            subdirs: 0,
        };
        self.image_bytes += inode.image_bytes() + IMAGE_BYTES_PER_ENTRY + name.len() as u64;
        self.inodes.insert(ino, inode);
        let dir = self.inodes.get_mut(&parent).expect("checked above");
        dir.entries.insert(name.to_string(), ino);
        if kind == FileKind::Directory {
            dir.subdirs += 1;
        }
        self.touch_dir(parent, attrs.ctime);
        self.next_ino = self.next_ino.max(ino + 1);
        Ok(())
    }

    /// Removes `parent/name`; returns the inode it named, one link fewer.
    fn apply_unlink(
        &mut self,
        parent: Ino,
        name: &str,
        time: Timestamp,
    ) -> Result<Ino, ApplyError> {
        let child = self.entry(parent, name, "unlink")?;
        if child == ROOT_INO {
            return Err("unlink: root".to_string());
        }
        let inode = self.inodes.get(&child).ok_or("unlink: dangling entry")?;
        if inode.kind == FileKind::Directory && !inode.entries.is_empty() {
            return Err(format!("unlink: directory {child} not empty"));
        }
        if inode.nlink == 0 {
            return Err(format!("unlink: inode {child} has link count 0 but a name"));
        }
        self.entries_mut(parent).remove(name);
        self.touch_dir(parent, time);
        let is_dir = self.inodes[&child].kind == FileKind::Directory;
        if is_dir {
            self.move_subdir(parent, 0);
        }
        let inode = self.inodes.get_mut(&child).expect("checked above");
        if is_dir {
            inode.nlink = 0;
            inode.parent = 0;
        } else {
            inode.nlink -= 1;
        }
        inode.attrs.ctime = time;
        self.image_bytes = self
            .image_bytes
            .saturating_sub(IMAGE_BYTES_PER_ENTRY + name.len() as u64);
        Ok(child)
    }

    fn apply_link(
        &mut self,
        ino: Ino,
        parent: Ino,
        name: &str,
        time: Timestamp,
    ) -> Result<(), ApplyError> {
        codec::check_name(name).map_err(|why| format!("{why}: {name:?}"))?;
        match self.inodes.get(&ino) {
            Some(i) if i.kind == FileKind::Directory => {
                return Err(format!("link: inode {ino} is a directory"))
            }
            Some(i) if i.nlink == 0 => return Err(format!("link: inode {ino} is unlinked")),
            Some(i) if i.nlink >= MAX_LINKS => {
                return Err(format!("link: inode {ino} has {MAX_LINKS} links"))
            }
            Some(_) => {}
            None => return Err(format!("link: inode {ino} does not exist")),
        }
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(format!(
                "link: {name:?} already exists in directory {parent}"
            ));
        }
        self.entries_mut(parent).insert(name.to_string(), ino);
        self.touch_dir(parent, time);
        let inode = self.inodes.get_mut(&ino).expect("checked above");
        inode.nlink += 1;
        inode.attrs.ctime = time;
        self.image_bytes += IMAGE_BYTES_PER_ENTRY + name.len() as u64;
        Ok(())
    }

    fn apply_rename(
        &mut self,
        src_parent: Ino,
        src_name: &str,
        dst_parent: Ino,
        dst_name: &str,
        time: Timestamp,
    ) -> Result<(), ApplyError> {
        codec::check_name(dst_name).map_err(|why| format!("{why}: {dst_name:?}"))?;
        let src = self.entry(src_parent, src_name, "rename")?;
        let replaced = self.dir(dst_parent)?.entries.get(dst_name).copied();
        if replaced == Some(src) {
            // Two names of one inode (or the same name): POSIX says nothing
            // happens.
            return Ok(());
        }
        let src_kind = self.inodes.get(&src).ok_or("rename: dangling entry")?.kind;
        if src_kind == FileKind::Directory && self.is_ancestor(src, dst_parent) {
            return Err(format!("rename: directory {src} into its own subtree"));
        }
        if let Some(old) = replaced {
            let old_inode = self.inodes.get(&old).ok_or("rename: dangling target")?;
            let src_dir = src_kind == FileKind::Directory;
            let old_dir = old_inode.kind == FileKind::Directory;
            if src_dir != old_dir || (old_dir && !old_inode.entries.is_empty()) {
                return Err(format!("rename: cannot replace inode {old} with {src}"));
            }
            self.apply_unlink(dst_parent, dst_name, time)?;
        }
        self.entries_mut(src_parent).remove(src_name);
        self.entries_mut(dst_parent)
            .insert(dst_name.to_string(), src);
        self.touch_dir(src_parent, time);
        self.touch_dir(dst_parent, time);
        if src_kind == FileKind::Directory {
            self.move_subdir(src_parent, dst_parent);
        }
        let inode = self.inodes.get_mut(&src).expect("checked above");
        if src_kind == FileKind::Directory {
            inode.parent = dst_parent;
        }
        inode.attrs.ctime = time;
        self.image_bytes =
            (self.image_bytes + dst_name.len() as u64).saturating_sub(src_name.len() as u64);
        Ok(())
    }

    /// Swaps what `src_parent/src_name` and `dst_parent/dst_name` name
    /// (`RENAME_EXCHANGE`).
    fn apply_exchange(
        &mut self,
        src_parent: Ino,
        src_name: &str,
        dst_parent: Ino,
        dst_name: &str,
        time: Timestamp,
    ) -> Result<(), ApplyError> {
        let src = self.entry(src_parent, src_name, "exchange")?;
        let dst = self.entry(dst_parent, dst_name, "exchange")?;
        if src == dst {
            return Ok(());
        }
        let kind = |s: &Self, ino: Ino| s.inodes.get(&ino).map(|i| i.kind);
        let (src_kind, dst_kind) = match (kind(self, src), kind(self, dst)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err("exchange: dangling entry".to_string()),
        };
        if (src_kind == FileKind::Directory && self.is_ancestor(src, dst_parent))
            || (dst_kind == FileKind::Directory && self.is_ancestor(dst, src_parent))
        {
            return Err("exchange: a directory into its own subtree".to_string());
        }
        self.entries_mut(src_parent)
            .insert(src_name.to_string(), dst);
        self.entries_mut(dst_parent)
            .insert(dst_name.to_string(), src);
        self.touch_dir(src_parent, time);
        self.touch_dir(dst_parent, time);
        for (ino, kind, from, to) in [
            (src, src_kind, src_parent, dst_parent),
            (dst, dst_kind, dst_parent, src_parent),
        ] {
            if kind == FileKind::Directory {
                self.move_subdir(from, to);
            }
            let parent = to;
            let inode = self.inodes.get_mut(&ino).expect("checked above");
            if kind == FileKind::Directory {
                inode.parent = parent;
            }
            inode.attrs.ctime = time;
        }
        Ok(())
    }

    /// A child directory left directory `from` for `to` (0: for none).
    fn move_subdir(&mut self, from: Ino, to: Ino) {
        if let Some(d) = self.inodes.get_mut(&from) {
            d.subdirs = d.subdirs.saturating_sub(1);
        }
        if let Some(d) = self.inodes.get_mut(&to) {
            d.subdirs += 1;
        }
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
        // The map's pages read one at a time and dropped (checked readable
        // by `load_for_record`; a device error now fails the record before
        // anything changed).
        self.inodes
            .get(&ino)
            .expect("checked above")
            .extents
            .for_each_unkept(0, |e| {
                crate::extent_map::push_freed(freed, e.addr, e.len);
                true
            })
            .map_err(|e| format!("free inode {ino}: {e}"))?;
        let inode = self.inodes.remove(&ino).expect("checked above");
        self.image_bytes = self.image_bytes.saturating_sub(inode.image_bytes());
        self.paged = self
            .paged
            .minus(PagedSize::of(&inode.extents, u64::from(self.block_size)));
        Ok(())
    }
}

/// An extent map's size: extents and chunks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapSize {
    pub extents: u64,
    pub chunks: u64,
}

impl MapSize {
    pub fn of(map: &ExtentMap) -> MapSize {
        MapSize {
            extents: map.len() as u64,
            chunks: map.chunk_count() as u64,
        }
    }

    /// What a base with extent pages pages of a map this size: all of it
    /// past [`codec::inline_extents_max`], nothing below.
    pub fn paged(self, block_size: u64) -> PagedSize {
        if self.extents > codec::inline_extents_max(block_size) as u64 {
            PagedSize {
                files: 1,
                extents: self.extents,
                chunks: self.chunks,
            }
        } else {
            PagedSize::default()
        }
    }
}

/// Files, extents and chunks a base with extent pages pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagedSize {
    pub files: u64,
    pub extents: u64,
    pub chunks: u64,
}

impl PagedSize {
    fn of(map: &ExtentMap, block_size: u64) -> PagedSize {
        MapSize::of(map).paged(block_size)
    }

    pub fn plus(self, other: PagedSize) -> PagedSize {
        PagedSize {
            files: self.files + other.files,
            extents: self.extents + other.extents,
            chunks: self.chunks + other.chunks,
        }
    }

    pub fn minus(self, other: PagedSize) -> PagedSize {
        PagedSize {
            files: self.files.saturating_sub(other.files),
            extents: self.extents.saturating_sub(other.extents),
            chunks: self.chunks.saturating_sub(other.chunks),
        }
    }
}

impl InodeState {
    /// The directory entries, to change (a snapshot keeps its version).
    fn entries_mut(&mut self) -> &mut OrdMap<String, Ino> {
        &mut self.entries
    }

    /// A data change at `ns` (a write, size change, punch).
    fn set_data_changed(&mut self, ns: u64) {
        self.attrs.data_changed_at(Timestamp::from_ns(ns));
    }
}

/// What each kind may hold (as the codec checks it on the way in): extents
/// only in regular files, entries only in directories, a target exactly in
/// symlinks, a device number only in device nodes.
fn check_shape(inode: &InodeState) -> Result<(), ApplyError> {
    let ino = inode.ino;
    let kind = inode.kind;
    if kind != FileKind::Regular && (!inode.extents.is_empty() || inode.size != 0) {
        return Err(format!("{kind:?} {ino} has data extents or a size"));
    }
    if kind != FileKind::Directory && !inode.entries.is_empty() {
        return Err(format!("{kind:?} {ino} has directory entries"));
    }
    if (kind == FileKind::Symlink) == inode.target.is_empty() {
        return Err(format!(
            "{kind:?} {ino}: symlink target present iff a symlink"
        ));
    }
    if !matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) && inode.attrs.rdev != 0 {
        return Err(format!("{kind:?} {ino} has a device number"));
    }
    if inode.xattr_bytes() > MAX_XATTR_BYTES_PER_INODE {
        return Err(format!(
            "inode {ino}: xattrs exceed {MAX_XATTR_BYTES_PER_INODE} bytes"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::apply_delta;
    use crate::types::ExtentState;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const BLOCK: u64 = 4096;

    fn now(t: u64) -> Timestamp {
        Timestamp::from_ns(t)
    }

    /// Random records on a few files and directories: creates, unlinks,
    /// frees, extents mapped, converted and punched (several hundred
    /// extents, so the maps span many chunks).
    fn random_record(state: &MetaState, rng: &mut SmallRng, t: u64) -> Option<Record> {
        let files: Vec<Ino> = state
            .inodes
            .values()
            .filter(|i| i.kind == FileKind::Regular && i.nlink > 0)
            .map(|i| i.ino)
            .collect();
        let roll = rng.gen_range(0..100);
        if roll < 2 || files.is_empty() {
            let ino = state.next_ino;
            let kind = if rng.gen_bool(0.3) {
                FileKind::Directory
            } else {
                FileKind::Regular
            };
            return Some(Record::Create {
                ino,
                parent: ROOT_INO,
                name: format!("n{ino}"),
                kind,
                attrs: InodeAttrs::new(0o644, 1, 2, now(t)),
                target: Vec::new(),
            });
        }
        if roll < 3 {
            let name = state.inodes[&ROOT_INO].entries.keys().next()?.clone();
            return Some(Record::Unlink {
                parent: ROOT_INO,
                name,
                time: now(t),
            });
        }
        if roll < 4 {
            let orphan = state.inodes.values().find(|i| i.nlink == 0)?.ino;
            return Some(Record::FreeInode { ino: orphan });
        }
        let ino = files[rng.gen_range(0..files.len())];
        let file_off = rng.gen_range(0..600u64) * BLOCK;
        let len = rng.gen_range(1..4u64) * BLOCK;
        let extents = &state.inodes[&ino].extents;
        match roll {
            4..=59 => {
                if extents.hole_bytes_in(file_off, len) != len {
                    return None;
                }
                Some(Record::MapUnwritten {
                    ino,
                    file_off,
                    len,
                    addr: (1 << 32) + t * 4 * BLOCK,
                })
            }
            60..=79 => Some(Record::CompleteWrite {
                ino,
                file_off,
                len,
                min_size: file_off + len,
                mtime_ns: t,
            }),
            80..=94 => Some(Record::Punch {
                ino,
                file_off,
                len: len * 8,
                mtime_ns: t,
            }),
            _ => Some(Record::SetAttr {
                ino,
                mode: 0o600,
                uid: 3,
                gid: 4,
                atime: now(t),
                mtime: now(t),
                ctime: now(t),
            }),
        }
    }

    /// The sizes kept incrementally, which the room kept for the next base
    /// is counted from, are what a recount from the inodes gives, after
    /// any run of records: the paged files' extents and chunks exactly,
    /// the image bytes never below (an estimate may only err high).
    #[test]
    fn sizes_kept_incrementally_match_a_recount() {
        for seed in 0..30 {
            let mut rng = SmallRng::seed_from_u64(seed);
            // 512-byte blocks: files past 19 extents are paged.
            let mut state = MetaState::new_empty(512, now(1), 0, 0);
            let mut freed = Vec::new();
            let mut paged_files = 0;
            for t in 2..1500 {
                if let Some(r) = random_record(&state, &mut rng, t) {
                    let _ = state.apply(&r, &mut freed);
                }
                if t % 25 == 0 {
                    let mut recounted = state.clone();
                    recounted.recount();
                    assert_eq!(
                        state.paged_size(),
                        recounted.paged_size(),
                        "seed {seed} after record {t}"
                    );
                    assert!(
                        state.image_bytes_estimate() >= recounted.image_bytes_estimate(),
                        "seed {seed} after record {t}"
                    );
                    paged_files = paged_files.max(state.paged_size().files);
                }
            }
            assert!(paged_files > 0, "seed {seed}: no file was ever paged");
        }
    }

    /// A whole checkpoint encodes the live state straight from its extent
    /// maps: the same bytes as encoding the image `to_image` copies out,
    /// after the room asked for.
    #[test]
    fn the_state_encodes_as_its_image_does() {
        for seed in 0..20 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut state = MetaState::new_empty(BLOCK as u32, now(1), 0, 0);
            let mut freed = Vec::new();
            for t in 2..800 {
                if let Some(r) = random_record(&state, &mut rng, t) {
                    let _ = state.apply(&r, &mut freed);
                }
            }
            let room = 52;
            let streamed = state.encode_image_after(room).unwrap();
            assert!(streamed[..room].iter().all(|&b| b == 0), "seed {seed}");
            let image = state.to_image();
            assert!(
                image.inodes.iter().any(|i| i.extents.len() > 40),
                "maps span chunks"
            );
            assert_eq!(
                &streamed[room..],
                &codec::encode_image(&image).unwrap()[..],
                "seed {seed}"
            );
        }
    }

    /// A delta from a snapshot to the live state, applied to the
    /// snapshot's image, gives the live state's image; and it holds only
    /// the extents in spans the changes touched.
    #[test]
    fn delta_since_a_snapshot_applies_to_the_live_state() {
        for seed in 0..60 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut state = MetaState::new_empty(BLOCK as u32, now(1), 0, 0);
            let mut freed = Vec::new();
            let mut t = 1;
            let mut base = state.clone();
            state.take_changed();
            for round in 0..8 {
                let n = if round == 0 {
                    600
                } else {
                    rng.gen_range(0..40)
                };
                for _ in 0..n {
                    t += 1;
                    if let Some(r) = random_record(&state, &mut rng, t) {
                        let _ = state.apply(&r, &mut freed);
                    }
                }
                let changed = state.take_changed();
                let delta = state.delta_since(&changed);
                let mut image = base.to_image();
                apply_delta(&mut image, &delta)
                    .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
                assert_eq!(image, state.to_image(), "seed {seed} round {round}");
                if round > 0 {
                    let written: usize = delta.changed.iter().map(|c| c.inode.extents.len()).sum();
                    let all: usize = state.inodes.values().map(|i| i.extents.len()).sum();
                    assert!(
                        written <= 4 * n + 8 || written * 4 < all,
                        "seed {seed} round {round}: {n} records wrote {written} of {all} extents"
                    );
                }
                base = state.clone();
            }
            assert!(
                state.inodes.values().any(|i| i.extents.len() > 40),
                "maps span chunks"
            );
            assert!(state
                .inodes
                .values()
                .flat_map(|i| i.extents.iter())
                .any(|e| e.state == ExtentState::Written));
        }
    }
}
