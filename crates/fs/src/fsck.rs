//! Offline consistency check.
//!
//! fsck loads the volume exactly as mount does (superblock, newest valid
//! checkpoint, journal replay, free space rebuilt from the extents — which
//! already rejects extents that overlap each other or leave the data area),
//! then checks what loading alone does not: extent maps, sizes, link counts
//! and the shape of the directory tree. It never writes; only
//! [`repair_superblocks`] and [`repair_index_copies`], run on request, do.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use blockdev::BlockDevice;

use crate::codec;
use crate::limits::{MAX_FILE_SIZE, MAX_LINKS, MAX_XATTR_BYTES_PER_INODE, MAX_XATTR_VALUE_LEN};
use crate::mount::{load, Loaded, Strictness};
use crate::state::{InodeState, MetaState};
use crate::superblock;
use crate::types::{ExtentState, FileKind, Ino, ROOT_INO};
use crate::Result;

/// What fsck found. Clean when `problems` is empty.
#[derive(Clone, Debug, Default)]
pub struct FsckReport {
    /// One line per inconsistency, saying what and where.
    pub problems: Vec<String>,
    /// Findings that are not damage (e.g. orphans the next mount frees).
    pub notes: Vec<String>,
    pub inodes: u64,
    pub directories: u64,
    pub extents: u64,
    pub files: u64,
    pub symlinks: u64,
    /// FIFOs, sockets and device nodes.
    pub special_files: u64,
    /// Inodes with more than one name.
    pub hard_linked: u64,
    /// Extended attributes, and the bytes of their names and values.
    pub xattrs: u64,
    pub xattr_bytes: u64,
    /// Bytes of the data area in use: files' extents and `metadata_bytes`.
    pub used_bytes: u64,
    /// Of `used_bytes`, what checkpoints use: both slots' spilled images
    /// and the extent pages their bases list.
    pub metadata_bytes: u64,
    pub data_bytes: u64,
    /// Journal records replayed on top of the checkpoint.
    pub journal_records: u64,
    /// Generation of the checkpoint used.
    pub checkpoint_generation: u64,
    /// Delta checkpoints chained after its base (the chain mount applies).
    pub checkpoint_deltas: u32,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks the volume on `device` without modifying it. Returns `Err` when
/// the volume cannot be loaded at all (no valid superblock or checkpoint,
/// overlapping extents, a journal record that does not apply, device error);
/// every other inconsistency is a line in the report.
pub fn check(device: Arc<dyn BlockDevice>) -> Result<FsckReport> {
    let loaded = load(&device, Strictness::Fsck)?;
    let mut report = FsckReport {
        data_bytes: loaded.sb.layout.data.len,
        journal_records: loaded.replay_end.records,
        checkpoint_generation: loaded.generation,
        checkpoint_deltas: loaded.chain.deltas,
        used_bytes: loaded.alloc.used_bytes(),
        ..FsckReport::default()
    };
    report.problems.extend(loaded.damage.iter().cloned());
    if loaded.chain.deltas > 0 {
        report.notes.push(format!(
            "checkpoint generation {} is a chain in slot {}: a whole image of {} bytes and {} deltas of {} bytes, each verified and linked to the one before",
            loaded.generation,
            loaded.slot,
            loaded.chain.base_bytes,
            loaded.chain.deltas,
            loaded.chain.delta_bytes
        ));
    }
    for (slot, spill) in loaded.spills.iter().enumerate() {
        if !spill.is_empty() {
            let bytes: u64 = spill.iter().map(|&(_, len)| len).sum();
            report.metadata_bytes += bytes;
            report.notes.push(format!(
                "checkpoint slot {slot}'s image is spilled to {} extents ({bytes} bytes) of the data area, counted as used",
                spill.len()
            ));
        }
    }
    let pages = crate::mount::used_pages(&loaded.sb, &loaded.pages, &loaded.index);
    if !pages.is_empty() {
        let bytes: u64 = pages.iter().map(|&(_, len)| len).sum();
        report.metadata_bytes += bytes;
        let bs = loaded.sb.block_size();
        let mut index = crate::extent_pages::index_page_ranges(&loaded.index[0], bs);
        index.extend(crate::extent_pages::index_page_ranges(&loaded.index[1], bs));
        let listed_in = if index.is_empty() {
            String::new()
        } else {
            format!(
                " and {} index pages listing them (two blocks each)",
                index.len() / crate::codec::INDEX_COPIES
            )
        };
        report.notes.push(format!(
            "the two slots' bases list {} extent pages{listed_in} ({bytes} bytes) of the data area, each read and verified for the newest, counted as used",
            pages.len() - index.len()
        ));
    }
    check_superblocks(&*device, &loaded, &mut report);
    if let Some(mark) = &loaded.sb.clean_mark {
        report.notes.push(if loaded.clean_mark_names_newest {
            format!(
                "the superblock is marked cleanly unmounted after checkpoint generation {}: mount skips scanning the journal for damage (fsck scanned it)",
                mark.generation
            )
        } else {
            format!(
                "the superblock's clean-unmount mark names checkpoint generation {}, not the newest: mount does not trust it and scans the journal",
                mark.generation
            )
        });
    }
    if let Err(reason) = loaded.alloc.check() {
        report.problems.push(format!("free space: {reason}"));
    }
    check_state(&loaded.state, &mut report);
    Ok(report)
}

/// The primary superblock was usable, and the backup (if the volume has
/// one) reads and matches it.
fn check_superblocks(device: &dyn BlockDevice, loaded: &Loaded, report: &mut FsckReport) {
    if let Some(from_backup) = &loaded.from_backup {
        report.problems.push(from_backup.to_string());
        return;
    }
    match superblock::read_backup_superblock(device, &loaded.sb) {
        None => {}
        Some((offset, Err(e))) => report.problems.push(format!(
            "backup superblock at byte {offset}: {e} (`iomapfs fsck --repair` rewrites it)"
        )),
        Some((offset, Ok(backup))) if backup != loaded.sb.without_clean_mark() => report.problems.push(format!(
            "backup superblock at byte {offset} differs from the primary (`iomapfs fsck --repair` rewrites it)"
        )),
        Some(_) => {}
    }
}

/// Repairs what can be repaired without judgement: a primary superblock
/// that cannot be used is restored from the backup, a backup that does not
/// match a good primary is rewritten from it. Writes with FUA, then
/// flushes. Returns one line per repair (empty: nothing to do); fails when
/// neither superblock is usable. Run [`check`] afterwards.
pub fn repair_superblocks(device: &dyn BlockDevice) -> Result<Vec<String>> {
    let mut done = Vec::new();
    match superblock::read_superblock(device) {
        Err(primary) => {
            let Some((offset, backup)) = superblock::find_backup_superblock(device) else {
                return Err(primary);
            };
            superblock::write_superblock(device, &backup)?;
            done.push(format!(
                "restored the primary superblock from the backup at byte {offset} (block 0 was: {primary})"
            ));
        }
        Ok(sb) => match superblock::read_backup_superblock(device, &sb) {
            Some((offset, found)) if found.as_ref().ok() != Some(&sb.without_clean_mark()) => {
                superblock::write_backup_superblock(device, &sb)?;
                done.push(format!(
                    "rewrote the backup superblock at byte {offset} from the primary"
                ));
            }
            _ => {}
        },
    }
    if !done.is_empty() {
        device
            .flush()
            .map_err(|e| crate::Error::device("fsck --repair: flush", e))?;
    }
    Ok(done)
}

/// Repairs the copies of index pages that fail where the other copy
/// verifies (in either slot's root): each is rewritten from the other
/// (`checkpoint::rewrite_index_copy`), then the device is flushed.
/// Returns one line per copy rewritten, and one per copy that could not
/// be (a bad sector, say: the others are still tried). Both empty:
/// nothing to do, or no checkpoint whose index pages could be read
/// ([`check`] then says why). Reads the roots and index pages, no extent
/// page. Run after [`repair_superblocks`], and [`check`] afterwards.
pub fn repair_index_copies(device: &dyn BlockDevice) -> Result<(Vec<String>, Vec<String>)> {
    let sb = superblock::read_superblock(device)?;
    if sb.features_incompat & superblock::INCOMPAT_PAGE_INDEX == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let newest = match crate::checkpoint::read_checkpoints_reading(
        device,
        &sb,
        // Every copy read: a first copy that verifies hides nothing.
        crate::checkpoint::PageReading::IndexCopies,
    ) {
        Ok(newest) => newest,
        Err(crate::Error::Corrupt { .. }) => return Ok((Vec::new(), Vec::new())),
        Err(e) => return Err(e),
    };
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    for damaged in &newest.damaged_index_copies {
        match crate::checkpoint::rewrite_index_copy(device, &sb, damaged) {
            Ok(()) => {
                done.push(format!(
                    "rewrote the copy of inode {}'s index page at device byte {} from the other copy (it was: {})",
                    damaged.ino, damaged.at, damaged.reason
                ));
            }
            Err(e) => failed.push(format!(
                "the copy of inode {}'s index page at device byte {}: {e}",
                damaged.ino, damaged.at
            )),
        }
    }
    if !done.is_empty() {
        device
            .flush()
            .map_err(|e| crate::Error::device("fsck --repair: flush", e))?;
    }
    Ok((done, failed))
}

/// Attributes, symlink target and extended attributes of one inode: what
/// the image decoder checks, checked again on the state after replay (a
/// journal record may have changed them).
fn check_attributes(ino: Ino, inode: &InodeState, report: &mut FsckReport) {
    if let Err(reason) = codec::check_attrs(&inode.attrs) {
        report
            .problems
            .push(format!("inode {ino}: attributes: {reason}"));
    }
    let is_device = matches!(inode.kind, FileKind::CharDevice | FileKind::BlockDevice);
    if !is_device && inode.attrs.rdev != 0 {
        report.problems.push(format!(
            "{:?} {ino}: device number {:#x} on an inode that is no device",
            inode.kind, inode.attrs.rdev
        ));
    }
    if inode.kind == FileKind::Symlink {
        if let Err(reason) = codec::check_symlink_target(&inode.target) {
            report.problems.push(format!("symlink {ino}: {reason}"));
        }
    } else if !inode.target.is_empty() {
        report.problems.push(format!(
            "{:?} {ino}: has a symlink target but is no symlink",
            inode.kind
        ));
    }
    let mut bytes = 0usize;
    for (name, value) in inode.xattrs.iter() {
        report.xattrs += 1;
        bytes += name.len() + value.len();
        if let Err(reason) = codec::check_xattr_name(name) {
            report
                .problems
                .push(format!("inode {ino}: xattr {name:?}: {reason}"));
        }
        if value.len() > MAX_XATTR_VALUE_LEN {
            report.problems.push(format!(
                "inode {ino}: xattr {name:?} value of {} bytes exceeds {MAX_XATTR_VALUE_LEN}",
                value.len()
            ));
        }
    }
    report.xattr_bytes += bytes as u64;
    if bytes > MAX_XATTR_BYTES_PER_INODE {
        report.problems.push(format!(
            "inode {ino}: xattrs take {bytes} bytes, more than {MAX_XATTR_BYTES_PER_INODE}"
        ));
    }
}

fn check_state(state: &MetaState, report: &mut FsckReport) {
    let block = u64::from(state.block_size);
    let mut names: HashMap<Ino, u32> = HashMap::new();
    let mut inos: Vec<&Ino> = state.inodes.keys().collect();
    inos.sort_unstable();
    for &ino in &inos {
        let inode = &state.inodes[ino];
        report.inodes += 1;
        if *ino >= state.next_ino {
            report.problems.push(format!(
                "inode {ino}: number not below next inode {}",
                state.next_ino
            ));
        }
        match inode.kind {
            FileKind::Directory => {
                report.directories += 1;
                if !inode.extents.is_empty() {
                    report
                        .problems
                        .push(format!("directory {ino}: has data extents"));
                }
                for (name, child) in inode.entries.iter() {
                    if state.inodes.contains_key(child) {
                        *names.entry(*child).or_default() += 1;
                    } else {
                        report.problems.push(format!(
                            "directory {ino}: entry {name:?} names missing inode {child}"
                        ));
                    }
                }
            }
            FileKind::Regular => {
                report.files += 1;
                if !inode.entries.is_empty() {
                    report
                        .problems
                        .push(format!("file {ino}: has directory entries"));
                }
                if let Err(reason) = inode.extents.check() {
                    report
                        .problems
                        .push(format!("file {ino}: extent map: {reason}"));
                }
                report.extents += inode.extents.len() as u64;
                if inode.size > MAX_FILE_SIZE {
                    report.problems.push(format!(
                        "file {ino}: size {} exceeds the largest file size {MAX_FILE_SIZE}",
                        inode.size
                    ));
                }
                let eof_block_end = inode
                    .size
                    .checked_next_multiple_of(block)
                    .unwrap_or(u64::MAX);
                for ext in inode.extents.iter() {
                    if ext.state == ExtentState::Written && ext.file_end() > eof_block_end {
                        report.problems.push(format!(
                            "file {ino}: written extent at file offset {} length {} (device byte {}) lies past EOF {}",
                            ext.file_off, ext.len, ext.addr, inode.size
                        ));
                    }
                }
            }
            other => {
                match other {
                    FileKind::Symlink => report.symlinks += 1,
                    _ => report.special_files += 1,
                }
                if !inode.extents.is_empty() || inode.size != 0 {
                    report.problems.push(format!(
                        "{other:?} {ino}: has data extents or a size ({})",
                        inode.size
                    ));
                }
                if !inode.entries.is_empty() {
                    report
                        .problems
                        .push(format!("{other:?} {ino}: has directory entries"));
                }
            }
        }
        check_attributes(*ino, inode, report);
    }
    for &ino in &inos {
        let inode = &state.inodes[ino];
        let linked = names.get(ino).copied().unwrap_or(0);
        if *ino == ROOT_INO {
            if linked != 0 {
                report
                    .problems
                    .push("root directory is named by a directory entry".to_string());
            }
            continue;
        }
        if linked > 1 && inode.kind == FileKind::Directory {
            report.problems.push(format!(
                "directory {ino}: named by {linked} directory entries"
            ));
        }
        if inode.nlink > MAX_LINKS {
            report.problems.push(format!(
                "inode {ino}: link count {} exceeds {MAX_LINKS}",
                inode.nlink
            ));
        }
        if linked > 1 {
            report.hard_linked += 1;
        }
        if inode.nlink != linked {
            if inode.nlink == 0 && linked == 0 {
                continue;
            }
            report.problems.push(format!(
                "inode {ino}: link count {} but {linked} directory entries",
                inode.nlink
            ));
        } else if linked == 0 {
            report.notes.push(format!(
                "inode {ino}: unlinked while open; the next mount frees it"
            ));
        }
    }
    // Every directory must be reachable from the root without cycles.
    let mut seen: HashSet<Ino> = HashSet::new();
    let mut stack = vec![ROOT_INO];
    while let Some(dir) = stack.pop() {
        if !seen.insert(dir) {
            report
                .problems
                .push(format!("directory {dir}: reachable twice (cycle)"));
            continue;
        }
        if let Some(inode) = state.inodes.get(&dir) {
            for child in inode.entries.values() {
                if state
                    .inodes
                    .get(child)
                    .is_some_and(|c| c.kind == FileKind::Directory)
                {
                    stack.push(*child);
                }
            }
        }
    }
    for &ino in &inos {
        let inode = &state.inodes[ino];
        if inode.kind == FileKind::Directory && inode.nlink > 0 && !seen.contains(ino) {
            report
                .problems
                .push(format!("directory {ino}: not reachable from the root"));
        }
    }
}
