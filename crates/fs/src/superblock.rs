//! The superblock: block 0 of the device. It names the volume (uuid), its
//! format version and features, and where everything else lives ([`Layout`]).
//!
//! Format writes the superblock with FUA. Afterwards only the clean-unmount
//! mark ([`CleanMark`]) changes it: set by a clean unmount, cleared before
//! the next session's first journal append. Every field lies in the first
//! 512 bytes, one logical block, which the device writes whole or not at
//! all, and the rest of the block stays zero: such a rewrite leaves the old
//! or the new superblock, never a mix (and a block 0 that fails its crc
//! anyway falls back to the backup, which never holds the mark). Byte
//! layout: see `docs/FORMAT.md`.

use iomap::align::align_down;
use std::time::{SystemTime, UNIX_EPOCH};

use blockdev::{BlockDevice, WriteMode};

use crate::codec::{Decoder, Encoder};
use crate::error::{Error, Result};
use crate::limits::{MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};

/// First 8 bytes of every iomapfs device.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"IOMAPFS1";
/// The one on-disk format version this code reads and writes. Version 2
/// added inode attributes (mode, owner, four timestamps, device numbers),
/// symlinks, special files, hard links and extended attributes to the
/// checkpoint image and the journal records.
pub const FORMAT_VERSION: u32 = 2;

/// Compat feature: a copy of the superblock lives in the last whole block of
/// the device (see [`backup_offset`]); the data area ends before it.
pub const COMPAT_BACKUP_SUPERBLOCK: u64 = 1 << 0;
/// Compat feature: the older checkpoint slot is marked superseded once a
/// newer checkpoint is durable (see `checkpoint::mark_superseded`), so a
/// damaged durable checkpoint is reported instead of silently rolled back.
pub const COMPAT_SUPERSEDE_MARKS: u64 = 1 << 1;
/// Incompat feature: a checkpoint slot may hold, after its whole image,
/// delta checkpoints (magic `IOMAPCP2`) chained to it (see
/// `checkpoint::read_slot`). Code that does not know them would mount the
/// base image alone and silently undo every change the deltas hold, so it
/// must refuse the volume. Written only together with
/// [`COMPAT_SUPERSEDE_MARKS`], which the chain needs to tell a torn delta
/// from a lost one.
pub const INCOMPAT_DELTA_CHECKPOINTS: u64 = 1 << 0;
/// Incompat feature: a checkpoint image too large for its slot is stored in
/// extents of the data area (*spill extents*), which the slot's base record
/// (magic `IOMAPCP3`) lists (see `checkpoint::write_base`). Code that does
/// not know them finds no checkpoint it can read, and would hand the spill
/// extents out as free space, so it must refuse the volume.
pub const INCOMPAT_SPILLED_CHECKPOINTS: u64 = 1 << 1;
/// Incompat feature: a base checkpoint's payload is a *root* (the image
/// without extents, and per regular file the extent pages of the data area
/// holding its extents; see `codec::root`, `docs/EXTENT_PAGES.md`). Code
/// that does not know it reads no extents and would hand the pages out as
/// free space. Set by format only when asked
/// (`FormatOptions::extent_pages`) while the work is in progress.
pub const INCOMPAT_EXTENT_PAGES: u64 = 1 << 2;
/// Incompat feature, only with [`INCOMPAT_EXTENT_PAGES`]: a root lists
/// each paged file's *index pages* instead of its extent pages; an index
/// page (one block of the data area) lists the extent pages of a run of
/// the file's chunks (see `codec::index`, `docs/EXTENT_PAGES.md`). A
/// root then grows with the index pages (one per up to 127 pages at 4
/// KiB), not with every page, and a base writes again only the index
/// pages whose run changed. Code that does not know it cannot read the
/// root, and would hand index pages and the pages they list out as free
/// space.
pub const INCOMPAT_PAGE_INDEX: u64 = 1 << 3;

/// Compat feature: a clean-unmount mark may carry a *free-space hint*
/// ([`Superblock::free_hint`]): the largest free ranges of the data area
/// when the session ended, so that the next mount can allocate from them
/// at once while its background scan rebuilds the rest (see
/// `free_space`). Trusted only with a mark that names the newest
/// checkpoint; code that does not know it ignores it (and its mark, when
/// it writes one, carries none).
pub const COMPAT_FREE_SPACE_HINT: u64 = 1 << 2;

/// Compat feature: each checkpoint record may be followed, in its slot,
/// by a *free-space hint* of its own (`checkpoint::read_free_hint`): the
/// largest free ranges of the data area at that checkpoint's snapshot, so
/// that a mount after a crash, which has no clean-unmount mark, can
/// allocate at once from them (less what journal replay placed) while its
/// background scan rebuilds the rest (see `free_space`). The block sits
/// where the next delta would go, which code that does not know the bit
/// reads as the end of the chain (bad magic), as it reads an unwritten
/// block; it writes none.
pub const COMPAT_CHECKPOINT_FREE_HINT: u64 = 1 << 3;

/// Feature bits this code understands: an unknown incompat bit refuses the
/// mount, an unknown ro_compat bit refuses writes, an unknown compat bit is
/// ignored. Later changes that keep the version (incremental metadata,
/// longer inode attributes, new record kinds) each take a bit: see
/// "Compatibility" in `docs/FORMAT.md`.
pub const FEATURES_COMPAT_SUPPORTED: u64 = COMPAT_BACKUP_SUPERBLOCK
    | COMPAT_SUPERSEDE_MARKS
    | COMPAT_FREE_SPACE_HINT
    | COMPAT_CHECKPOINT_FREE_HINT;
pub const FEATURES_INCOMPAT_SUPPORTED: u64 = INCOMPAT_DELTA_CHECKPOINTS
    | INCOMPAT_SPILLED_CHECKPOINTS
    | INCOMPAT_EXTENT_PAGES
    | INCOMPAT_PAGE_INDEX;
pub const FEATURES_RO_COMPAT_SUPPORTED: u64 = RO_COMPAT_CLEAN_UNMOUNT;
/// Ro_compat feature: the superblock holds a [`CleanMark`] after its crc.
/// Set by a clean unmount, cleared (durably) before the next journal append.
/// A ro_compat bit, not a compat one: code that ignored the mark would
/// append batches without clearing it, and after a crash this code would
/// trust the stale mark and skip the check for damage before later batches.
/// Code that does not know the bit may still read the volume (it scans the
/// journal whole, as it always did).
pub const RO_COMPAT_CLEAN_UNMOUNT: u64 = 1 << 0;

/// Smallest data area, in blocks.
pub const MIN_DATA_BLOCKS: u64 = 16;
/// Smallest journal and checkpoint slot accepted, in blocks (when the sizes
/// are given explicitly, or read from a superblock).
pub const MIN_JOURNAL_BLOCKS: u64 = 8;
pub const MIN_CHECKPOINT_SLOT_BLOCKS: u64 = 2;

/// Default journal size: the device size divided by this, clamped to
/// [`DEFAULT_JOURNAL_MIN_BLOCKS`] blocks .. [`DEFAULT_JOURNAL_MAX_BYTES`].
pub const DEFAULT_JOURNAL_DIVISOR: u64 = 64;
pub const DEFAULT_JOURNAL_MIN_BLOCKS: u64 = 64;
pub const DEFAULT_JOURNAL_MAX_BYTES: u64 = 128 << 20;
/// Default size of each checkpoint slot: the device size divided by this,
/// clamped to [`DEFAULT_SLOT_MIN_BLOCKS`] blocks .. [`DEFAULT_SLOT_MAX_BYTES`].
pub const DEFAULT_SLOT_DIVISOR: u64 = 32;
pub const DEFAULT_SLOT_MIN_BLOCKS: u64 = 64;
pub const DEFAULT_SLOT_MAX_BYTES: u64 = 256 << 20;

/// Number of checkpoint slots.
pub const CHECKPOINT_SLOTS: usize = 2;

// Byte offsets of the superblock fields (all little-endian).
pub const OFF_MAGIC: usize = 0;
pub const OFF_VERSION: usize = 8;
pub const OFF_BLOCK_SIZE: usize = 12;
pub const OFF_UUID: usize = 16;
pub const OFF_FEATURES_COMPAT: usize = 32;
pub const OFF_FEATURES_INCOMPAT: usize = 40;
pub const OFF_FEATURES_RO_COMPAT: usize = 48;
pub const OFF_DEVICE_BYTES: usize = 56;
/// Four regions follow, each `start: u64, len: u64`: checkpoint slot 0,
/// checkpoint slot 1, journal, data.
pub const OFF_REGIONS: usize = 64;
const REGION_ENCODED_LEN: usize = 16;
const REGION_COUNT: usize = 4;
pub const OFF_CREATED_NS: usize = OFF_REGIONS + REGION_COUNT * REGION_ENCODED_LEN;
/// crc32c of bytes `[0, OFF_CRC)`.
pub const OFF_CRC: usize = OFF_CREATED_NS + 8;
/// Bytes of the superblock without a clean-unmount mark; the rest of
/// block 0 is zero.
pub const SUPERBLOCK_ENCODED_LEN: usize = OFF_CRC + 4;
/// The clean-unmount mark, after the crc (where code that does not know it
/// never looks), present only with [`RO_COMPAT_CLEAN_UNMOUNT`]:
/// `generation: u64, journal_start: u64, journal_seq: u64,
/// journal_chain: u32`, then a crc32c of bytes `[0, OFF_CLEAN_MARK_CRC)`
/// (the superblock with its crc, then the mark).
pub const OFF_CLEAN_MARK: usize = SUPERBLOCK_ENCODED_LEN;
pub const OFF_CLEAN_MARK_CRC: usize = OFF_CLEAN_MARK + 8 + 8 + 8 + 4;
/// Bytes of a superblock with a clean-unmount mark: within the first
/// 512-byte logical block, so a rewrite is never torn.
pub const MARKED_SUPERBLOCK_ENCODED_LEN: usize = OFF_CLEAN_MARK_CRC + 4;
/// With [`COMPAT_FREE_SPACE_HINT`] and a mark: the hint's range count
/// (u32), the ranges (device byte u64, length u64) and a crc32c of the
/// superblock through them (u32), still inside the first 512 bytes.
pub const OFF_FREE_HINT: usize = MARKED_SUPERBLOCK_ENCODED_LEN;
/// Most ranges a free-space hint holds.
pub const FREE_HINT_MAX: usize = 16;
/// Bytes of one range of a hint: device byte (u64), length (u64).
const FREE_HINT_RANGE_LEN: usize = 16;

/// A free-space hint's ranges as both hints store them (the clean
/// unmount's here, each checkpoint record's in `checkpoint`): their count
/// (u32), then each range's device byte and length (u64), at most
/// [`FREE_HINT_MAX`] of them (the first ones). The caller seals them.
pub(crate) fn encode_hint_ranges(enc: &mut Encoder, ranges: &[(u64, u64)]) {
    let ranges = &ranges[..ranges.len().min(FREE_HINT_MAX)];
    enc.u32(ranges.len() as u32);
    for &(addr, len) in ranges {
        enc.u64(addr);
        enc.u64(len);
    }
}

/// The ranges [`encode_hint_ranges`] wrote at `at` of `buf`, and where
/// they end; `None` when the count is 0 or past [`FREE_HINT_MAX`] or the
/// ranges run past `buf`. The caller checks its seal over `buf[..end]`.
pub(crate) fn decode_hint_ranges(buf: &[u8], at: usize) -> Option<(Vec<(u64, u64)>, usize)> {
    let le_u64 = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let count = buf
        .get(at..at + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)?;
    if count == 0 || count > FREE_HINT_MAX {
        return None;
    }
    let end = at + 4 + count * FREE_HINT_RANGE_LEN;
    let ranges = buf
        .get(at + 4..end)?
        .chunks_exact(FREE_HINT_RANGE_LEN)
        .map(|r| (le_u64(&r[..8]), le_u64(&r[8..])))
        .collect();
    Some((ranges, end))
}
const _: () = assert!(OFF_FREE_HINT + 4 + FREE_HINT_MAX * 16 + 4 <= 512);
const _: () = assert!(MARKED_SUPERBLOCK_ENCODED_LEN <= MIN_BLOCK_SIZE as usize);

const UUID_LEN: usize = 16;
const WHAT: &str = "superblock";

/// A byte range of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Region {
    pub start: u64,
    pub len: u64,
}

impl Region {
    /// One past the last byte (saturating; a decoded layout never overflows).
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    pub fn contains(&self, offset: u64) -> bool {
        offset >= self.start && offset < self.end()
    }

    fn overlaps(&self, other: &Region) -> bool {
        self.start < other.end() && other.start < self.end()
    }
}

/// Where everything lives, in bytes. Regions are block-aligned and appear in
/// this order: superblock (block 0), checkpoint slot 0, checkpoint slot 1,
/// journal, data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub block_size: u32,
    /// Size of the device at format time.
    pub device_bytes: u64,
    pub checkpoint_slots: [Region; CHECKPOINT_SLOTS],
    pub journal: Region,
    pub data: Region,
}

fn check_block_size(block_size: u32) -> std::result::Result<(), String> {
    if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(format!(
            "block size {block_size} is not a power of two in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}"
        ));
    }
    Ok(())
}

/// Whether `v` is a multiple of `align` (false for `align` 0).
pub fn is_aligned(v: u64, align: u64) -> bool {
    v.checked_rem(align) == Some(0)
}

impl Layout {
    /// Plans a volume on a device of `device_bytes` bytes. `journal_bytes`
    /// and `slot_bytes` (each of the two checkpoint slots), when given, must
    /// be multiples of the block size; when `None` they are picked from the
    /// device size (see the `DEFAULT_*` constants).
    pub fn compute(
        device_bytes: u64,
        logical_block_size: u32,
        block_size: u32,
        journal_bytes: Option<u64>,
        slot_bytes: Option<u64>,
    ) -> Result<Layout> {
        const WHAT: &str = "volume layout";
        check_block_size(block_size).map_err(|r| Error::invalid(WHAT, r))?;
        if logical_block_size == 0 || !logical_block_size.is_power_of_two() {
            return Err(Error::invalid(
                WHAT,
                format!("device logical block size {logical_block_size} is not a power of two"),
            ));
        }
        if block_size < logical_block_size {
            return Err(Error::invalid(
                WHAT,
                format!(
                    "block size {block_size} is smaller than the device's logical block size {logical_block_size}"
                ),
            ));
        }
        let bs = u64::from(block_size);
        let pick = |given: Option<u64>,
                    name: &str,
                    min_blocks: u64,
                    divisor: u64,
                    default_min_blocks: u64,
                    default_max: u64|
         -> Result<u64> {
            match given {
                Some(v) => {
                    if !is_aligned(v, bs) || v < min_blocks * bs {
                        return Err(Error::invalid(
                            WHAT,
                            format!(
                                "{name} size {v} must be a multiple of the block size {bs} and at least {} bytes",
                                min_blocks * bs
                            ),
                        ));
                    }
                    Ok(v)
                }
                None => Ok(align_down(device_bytes / divisor, bs)
                    .clamp(default_min_blocks * bs, default_max)),
            }
        };
        let journal_len = pick(
            journal_bytes,
            "journal",
            MIN_JOURNAL_BLOCKS,
            DEFAULT_JOURNAL_DIVISOR,
            DEFAULT_JOURNAL_MIN_BLOCKS,
            DEFAULT_JOURNAL_MAX_BYTES,
        )?;
        let slot_len = pick(
            slot_bytes,
            "checkpoint slot",
            MIN_CHECKPOINT_SLOT_BLOCKS,
            DEFAULT_SLOT_DIVISOR,
            DEFAULT_SLOT_MIN_BLOCKS,
            DEFAULT_SLOT_MAX_BYTES,
        )?;
        let too_big = || {
            Error::invalid(
                WHAT,
                format!("journal size {journal_len} and checkpoint slot size {slot_len} overflow"),
            )
        };
        let slot0 = Region {
            start: bs,
            len: slot_len,
        };
        let slot1 = Region {
            start: slot0.start.checked_add(slot_len).ok_or_else(too_big)?,
            len: slot_len,
        };
        let journal_start = slot1.start.checked_add(slot_len).ok_or_else(too_big)?;
        let data_start = journal_start.checked_add(journal_len).ok_or_else(too_big)?;
        // The last block holds the backup superblock.
        let min_device = data_start
            .checked_add((MIN_DATA_BLOCKS + 1) * bs)
            .ok_or_else(too_big)?;
        if device_bytes < min_device {
            return Err(Error::invalid(
                WHAT,
                format!(
                    "device of {device_bytes} bytes is too small: with block size {bs}, two checkpoint slots of {slot_len} bytes and a journal of {journal_len} bytes it must hold at least {min_device} bytes ({MIN_DATA_BLOCKS} data blocks and the backup superblock)"
                ),
            ));
        }
        let layout = Layout {
            block_size,
            device_bytes,
            checkpoint_slots: [slot0, slot1],
            journal: Region {
                start: journal_start,
                len: journal_len,
            },
            data: Region {
                start: data_start,
                len: align_down(device_bytes - data_start, bs) - bs,
            },
        };
        debug_assert!(layout.validate().is_ok(), "{:?}", layout.validate());
        Ok(layout)
    }

    /// Byte offset of the backup superblock: the last whole block of the
    /// device as formatted. `None` for a device too small to have one.
    pub fn backup_superblock(&self) -> Option<u64> {
        backup_offset(self.device_bytes, self.block_size)
    }

    /// Whether the last whole block is outside every region, so it can hold
    /// the backup superblock.
    pub fn leaves_room_for_backup(&self) -> bool {
        self.backup_superblock().is_some_and(|backup| {
            backup >= u64::from(self.block_size)
                && self.regions().iter().all(|(_, r, _)| r.end() <= backup)
        })
    }

    /// The regions in on-disk field order, with their names.
    fn regions(&self) -> [(&'static str, Region, u64); REGION_COUNT] {
        [
            (
                "checkpoint slot 0",
                self.checkpoint_slots[0],
                MIN_CHECKPOINT_SLOT_BLOCKS,
            ),
            (
                "checkpoint slot 1",
                self.checkpoint_slots[1],
                MIN_CHECKPOINT_SLOT_BLOCKS,
            ),
            ("journal", self.journal, MIN_JOURNAL_BLOCKS),
            ("data area", self.data, MIN_DATA_BLOCKS),
        ]
    }

    /// Checks that the layout is usable: valid block size, every region
    /// block-aligned, at least its minimum size, after the superblock, inside
    /// the device, not overlapping another, and the data area after all
    /// metadata. On failure returns the superblock byte offset of the field
    /// at fault and why.
    pub fn validate(&self) -> std::result::Result<(), (usize, String)> {
        check_block_size(self.block_size).map_err(|r| (OFF_BLOCK_SIZE, r))?;
        let bs = u64::from(self.block_size);
        let regions = self.regions();
        for (i, (name, r, min_blocks)) in regions.iter().enumerate() {
            let off = OFF_REGIONS + i * REGION_ENCODED_LEN;
            if !is_aligned(r.start, bs) || !is_aligned(r.len, bs) {
                return Err((
                    off,
                    format!(
                        "{name} [{}, +{}) is not aligned to the block size {bs}",
                        r.start, r.len
                    ),
                ));
            }
            if r.len < min_blocks * bs {
                return Err((
                    off,
                    format!(
                        "{name} is {} bytes, less than the minimum {}",
                        r.len,
                        min_blocks * bs
                    ),
                ));
            }
            if r.start < bs {
                return Err((off, format!("{name} overlaps the superblock")));
            }
            match r.start.checked_add(r.len) {
                Some(end) if end <= self.device_bytes => {}
                _ => {
                    return Err((
                        off,
                        format!(
                            "{name} [{}, +{}) runs past the end of the device ({} bytes)",
                            r.start, r.len, self.device_bytes
                        ),
                    ))
                }
            }
            for (other, o, _) in &regions[..i] {
                if r.overlaps(o) {
                    return Err((off, format!("{name} overlaps {other}")));
                }
            }
        }
        for (name, r, _) in &regions[..REGION_COUNT - 1] {
            if r.end() > self.data.start {
                return Err((
                    OFF_REGIONS + (REGION_COUNT - 1) * REGION_ENCODED_LEN,
                    format!("data area starts before the end of the {name}"),
                ));
            }
        }
        Ok(())
    }
}

/// Byte offset of the last whole `block_size` block of a device of
/// `device_bytes` bytes, where the backup superblock lives.
pub fn backup_offset(device_bytes: u64, block_size: u32) -> Option<u64> {
    let bs = u64::from(block_size);
    align_down(device_bytes, bs).checked_sub(bs)
}

/// Set in the superblock by a clean unmount, once its final checkpoint is
/// durable: the journal holds no batch after that checkpoint, so mount need
/// not scan the journal region for later batches (see `journal::replay`).
/// It names the checkpoint it was set after; mount trusts it only with that
/// checkpoint the newest, so a mark that outlived its checkpoint is inert.
/// The next session clears it, durably, before its first journal append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CleanMark {
    pub generation: u64,
    pub journal_start: u64,
    pub journal_seq: u64,
    pub journal_chain: u32,
}

/// The superblock, as decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    /// Random at format time. Seeds the crc of every checkpoint and journal
    /// batch, so that structures left by an earlier format never verify.
    pub uuid: [u8; UUID_LEN],
    pub features_compat: u64,
    pub features_incompat: u64,
    /// Without [`RO_COMPAT_CLEAN_UNMOUNT`]: `clean_mark` stands for it
    /// (decoding moves the bit there, encoding sets it from there).
    pub features_ro_compat: u64,
    pub layout: Layout,
    /// Format time, nanoseconds since the Unix epoch.
    pub created_ns: u64,
    pub clean_mark: Option<CleanMark>,
    /// With [`COMPAT_FREE_SPACE_HINT`] and `clean_mark`: free ranges
    /// `(device byte, length)` of the data area at the clean unmount, at
    /// most [`FREE_HINT_MAX`], largest first (empty when none, or when
    /// its crc does not verify: a hint is an optimisation, never needed).
    pub free_hint: Vec<(u64, u64)>,
}

impl Superblock {
    /// A new superblock for `layout`: current version, fresh random uuid,
    /// supersede marks, both free-space hints, delta and spilled
    /// checkpoints, a backup superblock if the layout leaves the device's
    /// last block free, created now.
    pub fn new(layout: Layout) -> Superblock {
        let backup = if layout.leaves_room_for_backup() {
            COMPAT_BACKUP_SUPERBLOCK
        } else {
            0
        };
        Superblock {
            version: FORMAT_VERSION,
            uuid: new_uuid(),
            features_compat: COMPAT_SUPERSEDE_MARKS
                | COMPAT_FREE_SPACE_HINT
                | COMPAT_CHECKPOINT_FREE_HINT
                | backup,
            features_incompat: INCOMPAT_DELTA_CHECKPOINTS | INCOMPAT_SPILLED_CHECKPOINTS,
            features_ro_compat: 0,
            layout,
            created_ns: now_ns(),
            clean_mark: None,
            free_hint: Vec::new(),
        }
    }

    /// The same superblock without a clean-unmount mark (nor its hint):
    /// what the backup holds, and what clearing the mark writes.
    pub fn without_clean_mark(&self) -> Superblock {
        Superblock {
            clean_mark: None,
            free_hint: Vec::new(),
            ..self.clone()
        }
    }

    /// The crc32c seed of checkpoints and journal batches of this volume.
    pub fn crc_seed(&self) -> u32 {
        crc32c::crc32c(&self.uuid)
    }

    pub fn block_size(&self) -> u64 {
        u64::from(self.layout.block_size)
    }

    /// Exactly one file-system block: the fields, then zeros.
    pub fn encode(&self) -> Vec<u8> {
        let mut enc = Encoder::with_capacity(MARKED_SUPERBLOCK_ENCODED_LEN);
        let mark_bit = if self.clean_mark.is_some() {
            RO_COMPAT_CLEAN_UNMOUNT
        } else {
            0
        };
        enc.bytes(&SUPERBLOCK_MAGIC);
        enc.u32(self.version);
        enc.u32(self.layout.block_size);
        enc.bytes(&self.uuid);
        enc.u64(self.features_compat);
        enc.u64(self.features_incompat);
        enc.u64(self.features_ro_compat | mark_bit);
        enc.u64(self.layout.device_bytes);
        for (_, r, _) in self.layout.regions() {
            enc.u64(r.start);
            enc.u64(r.len);
        }
        enc.u64(self.created_ns);
        debug_assert_eq!(enc.len(), OFF_CRC);
        let crc = crc32c::crc32c(enc.as_bytes());
        enc.u32(crc);
        if let Some(mark) = &self.clean_mark {
            enc.u64(mark.generation);
            enc.u64(mark.journal_start);
            enc.u64(mark.journal_seq);
            enc.u32(mark.journal_chain);
            debug_assert_eq!(enc.len(), OFF_CLEAN_MARK_CRC);
            let crc = crc32c::crc32c(enc.as_bytes());
            enc.u32(crc);
            if self.features_compat & COMPAT_FREE_SPACE_HINT != 0 && !self.free_hint.is_empty() {
                encode_hint_ranges(&mut enc, &self.free_hint);
                let crc = crc32c::crc32c(enc.as_bytes());
                enc.u32(crc);
            }
        }
        let mut out = enc.into_bytes();
        let block = (self.layout.block_size as usize).max(SUPERBLOCK_ENCODED_LEN);
        out.resize(block, 0);
        out
    }

    /// Decodes and checks a superblock from the start of `buf` (which holds
    /// at least [`SUPERBLOCK_ENCODED_LEN`] bytes read from device byte 0,
    /// [`MARKED_SUPERBLOCK_ENCODED_LEN`] with a clean-unmount mark).
    /// Checks, in order: magic ([`Error::NotIomapfs`]), version
    /// ([`Error::NotIomapfs`]), crc, features (unknown incompat:
    /// [`Error::NotIomapfs`]), layout sanity and the mark's crc.
    pub fn decode(buf: &[u8]) -> Result<Superblock> {
        let whole = buf;
        if buf.len() < SUPERBLOCK_ENCODED_LEN {
            if buf.len() >= SUPERBLOCK_MAGIC.len()
                && buf[..SUPERBLOCK_MAGIC.len()] != SUPERBLOCK_MAGIC
            {
                return Err(not_iomapfs());
            }
            return Err(Error::corrupt(
                WHAT,
                buf.len() as u64,
                format!("truncated: {} of {SUPERBLOCK_ENCODED_LEN} bytes", buf.len()),
            ));
        }
        let buf = &buf[..SUPERBLOCK_ENCODED_LEN];
        let mut dec = Decoder::new(buf, 0, WHAT);
        let magic: [u8; 8] = dec.array()?;
        if magic != SUPERBLOCK_MAGIC {
            return Err(not_iomapfs());
        }
        let version = dec.u32()?;
        if version != FORMAT_VERSION {
            return Err(Error::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
                hint: version_hint(version),
            });
        }
        let stored_crc = u32::from_le_bytes(
            buf[OFF_CRC..SUPERBLOCK_ENCODED_LEN]
                .try_into()
                .map_err(|_| Error::corrupt(WHAT, OFF_CRC as u64, "truncated crc"))?,
        );
        let crc = crc32c::crc32c(&buf[..OFF_CRC]);
        if crc != stored_crc {
            return Err(Error::corrupt(
                WHAT,
                OFF_CRC as u64,
                format!("crc32c mismatch: stored {stored_crc:#010x}, computed {crc:#010x}"),
            ));
        }
        let block_size = dec.u32()?;
        let uuid: [u8; UUID_LEN] = dec.array()?;
        let features_compat = dec.u64()?;
        let features_incompat = dec.u64()?;
        let features_ro_compat = dec.u64()?;
        let marked = features_ro_compat & RO_COMPAT_CLEAN_UNMOUNT != 0;
        let features_ro_compat = features_ro_compat & !RO_COMPAT_CLEAN_UNMOUNT;
        let unknown = features_incompat & !FEATURES_INCOMPAT_SUPPORTED;
        if unknown != 0 {
            return Err(Error::NotIomapfs {
                reason: format!("unsupported incompatible features {unknown:#x}"),
            });
        }
        if features_incompat & INCOMPAT_PAGE_INDEX != 0
            && features_incompat & INCOMPAT_EXTENT_PAGES == 0
        {
            return Err(Error::corrupt(
                WHAT,
                OFF_FEATURES_INCOMPAT as u64,
                "index pages (incompat bit 3) are set without extent pages (bit 2)",
            ));
        }
        let device_bytes = dec.u64()?;
        let mut regions = [Region::default(); REGION_COUNT];
        for r in regions.iter_mut() {
            r.start = dec.u64()?;
            r.len = dec.u64()?;
        }
        let created_ns = dec.u64()?;
        let [slot0, slot1, journal, data] = regions;
        let layout = Layout {
            block_size,
            device_bytes,
            checkpoint_slots: [slot0, slot1],
            journal,
            data,
        };
        layout
            .validate()
            .map_err(|(off, reason)| Error::corrupt(WHAT, off as u64, reason))?;
        if features_compat & COMPAT_BACKUP_SUPERBLOCK != 0 && !layout.leaves_room_for_backup() {
            return Err(Error::corrupt(
                WHAT,
                OFF_FEATURES_COMPAT as u64,
                "the backup superblock feature is set but the last block of the device belongs to a region",
            ));
        }
        let clean_mark = if marked {
            Some(decode_clean_mark(whole)?)
        } else {
            None
        };
        let free_hint = if marked && features_compat & COMPAT_FREE_SPACE_HINT != 0 {
            decode_free_hint(whole)
        } else {
            Vec::new()
        };
        Ok(Superblock {
            version,
            uuid,
            features_compat,
            features_incompat,
            features_ro_compat,
            layout,
            created_ns,
            clean_mark,
            free_hint,
        })
    }

    /// Fails if the volume has read-only-compatible features this build does
    /// not know: it may be read but not written.
    pub fn check_writable(&self) -> Result<()> {
        let unknown = self.features_ro_compat & !FEATURES_RO_COMPAT_SUPPORTED;
        if unknown != 0 {
            return Err(Error::NotIomapfs {
                reason: format!(
                    "unsupported read-only-compatible features {unknown:#x}: the volume cannot be written"
                ),
            });
        }
        Ok(())
    }
}

/// The free-space hint after a verified mark at the start of `buf`: empty
/// when there is none, it is cut short, or its crc does not verify (the
/// next mount then waits for its scan, as without a hint). Its ranges are
/// checked against the layout where they are used (`free_space`).
fn decode_free_hint(buf: &[u8]) -> Vec<(u64, u64)> {
    let Some((ranges, end)) = decode_hint_ranges(buf, OFF_FREE_HINT) else {
        return Vec::new();
    };
    let stored = buf
        .get(end..end + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    match stored == Some(crc32c::crc32c(&buf[..end])) {
        true => ranges,
        false => Vec::new(),
    }
}

/// The clean-unmount mark after a verified superblock at the start of
/// `buf`.
fn decode_clean_mark(buf: &[u8]) -> Result<CleanMark> {
    let buf = buf.get(..MARKED_SUPERBLOCK_ENCODED_LEN).ok_or_else(|| {
        Error::corrupt(
            WHAT,
            buf.len() as u64,
            format!(
                "truncated: {} of the {MARKED_SUPERBLOCK_ENCODED_LEN} bytes of a superblock with a clean-unmount mark",
                buf.len()
            ),
        )
    })?;
    let mut dec = Decoder::new(&buf[OFF_CLEAN_MARK..], OFF_CLEAN_MARK as u64, WHAT);
    let mark = CleanMark {
        generation: dec.u64()?,
        journal_start: dec.u64()?,
        journal_seq: dec.u64()?,
        journal_chain: dec.u32()?,
    };
    let stored = dec.u32()?;
    let crc = crc32c::crc32c(&buf[..OFF_CLEAN_MARK_CRC]);
    if crc != stored {
        return Err(Error::corrupt(
            WHAT,
            OFF_CLEAN_MARK_CRC as u64,
            format!(
                "clean-unmount mark crc32c mismatch: stored {stored:#010x}, computed {crc:#010x}"
            ),
        ));
    }
    Ok(mark)
}

/// What a user with a volume of another format version can do.
fn version_hint(found: u32) -> String {
    if found < FORMAT_VERSION {
        format!(
            "version {found} keeps no file modes, owners, symlinks, hard links or extended \
             attributes; this build never reads it (its records would be misread): copy the \
             files off with the build that wrote it, then `iomapfs mkfs` and copy them back"
        )
    } else {
        "the volume was written by a newer iomapfs; use that build".to_string()
    }
}

fn not_iomapfs() -> Error {
    Error::NotIomapfs {
        reason: "no iomapfs magic in block 0".to_string(),
    }
}

/// Reads and checks the superblock, and that the device can hold the volume
/// it describes.
pub fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    read_superblock_at(dev, 0)
}

/// A superblock read from the backup because the primary could not be used.
#[derive(Debug)]
pub struct FromBackup {
    /// Byte offset of the backup used.
    pub offset: u64,
    /// Why block 0 could not be used.
    pub primary: Error,
}

impl std::fmt::Display for FromBackup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "primary superblock (block 0) unusable ({}); using the backup superblock at byte {} \
             (`iomapfs fsck --repair` restores the primary)",
            self.primary, self.offset
        )
    }
}

/// Whether a primary superblock that failed with `err` may be replaced by
/// the backup: when block 0 cannot be read, or holds the iomapfs magic but
/// does not verify. Block 0 without the magic may hold another file system
/// made over an old iomapfs volume (whose backup would still be at the
/// end), so then only fsck says a backup exists, and `fsck --repair` is the
/// user's explicit choice.
fn backup_may_replace(err: &Error) -> bool {
    // Unsupported version or features: the backup would say the same.
    matches!(err, Error::Device { .. } | Error::Corrupt { .. })
}

/// When the backup superblock may stand in for the primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackupUse {
    /// Block 0 cannot be read or is damaged (see [`backup_may_replace`]):
    /// what mount does.
    IfDamaged,
    /// Also when block 0 holds no iomapfs magic at all: what fsck does,
    /// which only reads and reports.
    Always,
}

/// [`read_superblock`], falling back to the backup superblock as `when`
/// allows. Returns the superblock and, when the backup was used, where and
/// why.
pub fn read_superblock_or_backup(
    dev: &dyn BlockDevice,
    when: BackupUse,
) -> Result<(Superblock, Option<FromBackup>)> {
    match read_superblock(dev) {
        Ok(sb) => Ok((sb, None)),
        Err(primary) => {
            let usable = match when {
                BackupUse::IfDamaged => backup_may_replace(&primary),
                BackupUse::Always => !matches!(primary, Error::UnsupportedVersion { .. }),
            };
            if !usable {
                return Err(primary);
            }
            match find_backup_superblock(dev) {
                Some((offset, sb)) => Ok((sb, Some(FromBackup { offset, primary }))),
                None => Err(primary),
            }
        }
    }
}

/// Looks for a backup superblock in the last whole block of the device, for
/// each block size a volume may have (the primary that would say which is
/// unusable). Finds it when the device has its format-time size. Returns its
/// offset and contents.
pub fn find_backup_superblock(dev: &dyn BlockDevice) -> Option<(u64, Superblock)> {
    let caps = dev.caps();
    let mut block_size = MIN_BLOCK_SIZE.max(caps.logical_block_size);
    while block_size <= MAX_BLOCK_SIZE {
        if let Some(offset) = backup_offset(caps.size_bytes, block_size) {
            if let Ok(sb) = read_superblock_at(dev, offset) {
                if sb.layout.block_size == block_size
                    && sb.features_compat & COMPAT_BACKUP_SUPERBLOCK != 0
                    && sb.layout.backup_superblock() == Some(offset)
                {
                    return Some((offset, sb));
                }
            }
        }
        block_size = block_size.checked_mul(2)?;
    }
    None
}

/// Reads the backup superblock of the volume `sb` describes, if it has
/// one: `None` without the feature, else what reading it gave.
pub fn read_backup_superblock(
    dev: &dyn BlockDevice,
    sb: &Superblock,
) -> Option<(u64, Result<Superblock>)> {
    if sb.features_compat & COMPAT_BACKUP_SUPERBLOCK == 0 {
        return None;
    }
    let offset = sb.layout.backup_superblock()?;
    Some((offset, read_superblock_at(dev, offset)))
}

/// Reads and checks a superblock (primary or backup) at `offset`.
fn read_superblock_at(dev: &dyn BlockDevice, offset: u64) -> Result<Superblock> {
    let caps = dev.caps();
    let lbs = u64::from(caps.logical_block_size.max(1));
    let read_len = (MARKED_SUPERBLOCK_ENCODED_LEN as u64).div_ceil(lbs) * lbs;
    if caps.size_bytes < read_len {
        return Err(Error::NotIomapfs {
            reason: format!(
                "device of {} bytes is too small to hold a superblock",
                caps.size_bytes
            ),
        });
    }
    let mut buf = vec![0u8; read_len as usize];
    dev.read_at(&mut buf, offset).map_err(|e| {
        Error::device(
            if offset == 0 {
                "reading the superblock".to_string()
            } else {
                format!("reading the backup superblock at byte {offset}")
            },
            e,
        )
    })?;
    let sb = Superblock::decode(&buf)?;
    let block_size = sb.layout.block_size;
    if block_size < caps.logical_block_size {
        return Err(Error::NotIomapfs {
            reason: format!(
                "volume block size {block_size} is smaller than the device's logical block size {}",
                caps.logical_block_size
            ),
        });
    }
    if sb.layout.device_bytes > caps.size_bytes {
        return Err(Error::corrupt(
            WHAT,
            OFF_DEVICE_BYTES as u64,
            format!(
                "volume was formatted for {} bytes but the device holds only {}",
                sb.layout.device_bytes, caps.size_bytes
            ),
        ));
    }
    Ok(sb)
}

/// Writes the superblock to block 0 with FUA.
pub fn write_superblock(dev: &dyn BlockDevice, sb: &Superblock) -> Result<()> {
    dev.write_at(&sb.encode(), 0, WriteMode::Fua)
        .map_err(|e| Error::device("writing the superblock", e))
}

/// Writes the backup superblock (the primary's bytes without a clean-unmount
/// mark) to the last block with FUA, if the volume has one. The backup never
/// holds the mark: it is not cleared with the primary's, and a mount that
/// falls back to it scans the journal.
pub fn write_backup_superblock(dev: &dyn BlockDevice, sb: &Superblock) -> Result<()> {
    if sb.features_compat & COMPAT_BACKUP_SUPERBLOCK == 0 {
        return Ok(());
    }
    let Some(offset) = sb.layout.backup_superblock() else {
        return Ok(());
    };
    dev.write_at(&sb.without_clean_mark().encode(), offset, WriteMode::Fua)
        .map_err(|e| Error::device(format!("writing the backup superblock at byte {offset}"), e))
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A random (version 4) uuid: from /dev/urandom, or failing that from the
/// standard library's randomly keyed hasher mixed with time and pid.
fn new_uuid() -> [u8; UUID_LEN] {
    use std::io::Read;
    let mut uuid = [0u8; UUID_LEN];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut uuid))
        .is_ok();
    if !from_os || uuid == [0u8; UUID_LEN] {
        use std::collections::hash_map::RandomState;
        use std::hash::{BuildHasher, Hasher};
        for (i, chunk) in uuid.chunks_mut(8).enumerate() {
            let mut h = RandomState::new().build_hasher();
            h.write_u64(now_ns());
            h.write_u32(std::process::id());
            h.write_usize(i);
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    // RFC 4122 version 4, variant 1.
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    uuid
}

/// A RAM block device for the tests of the on-disk structures.
#[cfg(test)]
pub(crate) mod test_device {
    use blockdev::memory::MemDevice;
    use blockdev::{
        check_request, BlockDevice, DeviceCaps, DeviceCounters, DeviceError, WriteMode,
    };
    use parking_lot::Mutex;

    pub struct VecDevice {
        caps: DeviceCaps,
        data: Mutex<Vec<u8>>,
        counters: DeviceCounters,
    }

    impl VecDevice {
        pub fn new(size: u64, logical_block_size: u32) -> VecDevice {
            // Capabilities as the memory backend reports them, without a
            // volatile cache: writes here are durable at once.
            let caps = MemDevice::with_caps(size, logical_block_size, false, true)
                .caps()
                .clone();
            VecDevice {
                caps,
                data: Mutex::new(vec![0; size as usize]),
                counters: DeviceCounters::default(),
            }
        }

        /// Direct access to the bytes, bypassing alignment rules.
        pub fn with_bytes<R>(&self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
            f(&mut self.data.lock())
        }

        pub fn flip(&self, offset: u64) {
            self.with_bytes(|b| b[offset as usize] ^= 0x5a);
        }
    }

    impl BlockDevice for VecDevice {
        fn caps(&self) -> &DeviceCaps {
            &self.caps
        }

        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
            check_request(&self.caps, offset, buf.len())?;
            let o = offset as usize;
            buf.copy_from_slice(&self.data.lock()[o..o + buf.len()]);
            self.counters.record_read(buf.len());
            Ok(())
        }

        fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
            check_request(&self.caps, offset, buf.len())?;
            let o = offset as usize;
            self.data.lock()[o..o + buf.len()].copy_from_slice(buf);
            self.counters
                .record_write(buf.len(), mode == WriteMode::Fua);
            Ok(())
        }

        fn flush(&self) -> Result<(), DeviceError> {
            self.counters.record_flush();
            Ok(())
        }

        fn counters(&self) -> &DeviceCounters {
            &self.counters
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_device::VecDevice;
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn four_mib_device_with_4k_blocks() {
        let l = Layout::compute(4 * MIB, 512, 4096, None, None).unwrap();
        assert_eq!(l.checkpoint_slots[0].start, 4096);
        assert_eq!(l.journal.len, 64 * 4096);
        assert_eq!(l.checkpoint_slots[0].len, 64 * 4096);
        assert!(l.data.len >= MIN_DATA_BLOCKS * 4096);
        // The last block is the backup superblock's.
        assert_eq!(l.data.end(), 4 * MIB - 4096);
        assert_eq!(l.backup_superblock(), Some(4 * MIB - 4096));
        assert!(l.leaves_room_for_backup());
        l.validate().unwrap();
    }

    #[test]
    fn defaults_clamp() {
        let l = Layout::compute(1 << 40, 4096, 4096, None, None).unwrap();
        assert_eq!(l.journal.len, DEFAULT_JOURNAL_MAX_BYTES);
        assert_eq!(l.checkpoint_slots[1].len, DEFAULT_SLOT_MAX_BYTES);
        let l = Layout::compute(640 * MIB + 12345, 512, 512, None, None).unwrap();
        assert_eq!(l.journal.len, 10 * MIB);
        assert_eq!(l.checkpoint_slots[0].len, 20 * MIB);
        assert_eq!(l.data.len % 512, 0);
        assert!(l.data.end() <= 640 * MIB + 12345);
    }

    #[test]
    fn bad_parameters() {
        for bs in [0, 256, 1000, 131072] {
            assert!(
                Layout::compute(64 * MIB, 512, bs, None, None).is_err(),
                "{bs}"
            );
        }
        assert!(Layout::compute(64 * MIB, 4096, 512, None, None).is_err());
        assert!(Layout::compute(64 * MIB, 512, 4096, Some(4097), None).is_err());
        assert!(Layout::compute(64 * MIB, 512, 4096, Some(4096), None).is_err());
        assert!(Layout::compute(64 * MIB, 512, 4096, None, Some(u64::MAX - 4095)).is_err());
        let err = Layout::compute(MIB / 2, 512, 4096, None, None).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("too small") && msg.contains("at least"),
            "{msg}"
        );
        // Small explicit sizes let small devices work.
        Layout::compute(MIB / 2, 512, 4096, Some(8 * 4096), Some(2 * 4096)).unwrap();
    }

    fn sample() -> Superblock {
        Superblock::new(Layout::compute(4 * MIB, 512, 4096, None, None).unwrap())
    }

    #[test]
    fn encode_decode_round_trip() {
        let sb = sample();
        assert_ne!(sb.uuid, sample().uuid);
        let bytes = sb.encode();
        assert_eq!(bytes.len(), 4096);
        assert_eq!(&bytes[OFF_MAGIC..OFF_VERSION], b"IOMAPFS1");
        assert_eq!(bytes[OFF_VERSION], 2);
        assert_eq!(&bytes[OFF_UUID..OFF_UUID + 16], &sb.uuid);
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
    }

    #[test]
    fn rejects_foreign_and_damaged() {
        let sb = sample();
        let good = sb.encode();
        assert!(matches!(
            Superblock::decode(&vec![0u8; 4096]),
            Err(Error::NotIomapfs { .. })
        ));
        // Another version is refused before anything else is read, with what
        // to do: a version 1 volume is never misread as version 2.
        for (version, hint) in [(1u8, "iomapfs mkfs"), (3, "newer iomapfs")] {
            let mut b = good.clone();
            b[OFF_VERSION] = version;
            let err = Superblock::decode(&b).unwrap_err();
            assert!(
                matches!(err, Error::UnsupportedVersion { found, supported: 2, .. } if found == u32::from(version)),
                "{err}"
            );
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("version {version}")) && msg.contains(hint),
                "{msg}"
            );
            assert_eq!(err.errno(), libc::EPROTONOSUPPORT);
        }
        // Every single-byte change past the magic and version is caught.
        for i in OFF_BLOCK_SIZE..SUPERBLOCK_ENCODED_LEN {
            let mut b = good.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(Superblock::decode(&b), Err(Error::Corrupt { .. })),
                "byte {i}"
            );
        }
        for cut in 0..SUPERBLOCK_ENCODED_LEN {
            assert!(Superblock::decode(&good[..cut]).is_err());
        }
        // Unknown incompat feature with a valid crc.
        let mut s = sb.clone();
        s.features_incompat = 1 << 63;
        assert!(matches!(
            Superblock::decode(&s.encode()),
            Err(Error::NotIomapfs { .. })
        ));
        // Index pages without extent pages: no root lists them.
        let mut s = sb.clone();
        s.features_incompat |= INCOMPAT_PAGE_INDEX;
        let err = Superblock::decode(&s.encode()).unwrap_err();
        assert!(
            matches!(&err, Error::Corrupt { offset, .. } if *offset == OFF_FEATURES_INCOMPAT as u64),
            "{err}"
        );
        s.features_incompat |= INCOMPAT_EXTENT_PAGES;
        assert_eq!(
            Superblock::decode(&s.encode()).unwrap().features_incompat,
            s.features_incompat
        );
        // Unknown ro_compat: readable, not writable.
        let mut s = sb.clone();
        s.features_ro_compat = 4;
        let d = Superblock::decode(&s.encode()).unwrap();
        assert!(d.check_writable().is_err());
        sb.check_writable().unwrap();
    }

    /// The clean-unmount mark: after the crc, under ro_compat bit 0, with
    /// a crc of its own over the whole superblock; within one 512-byte
    /// logical block; never in the backup.
    /// The free-space hint follows the mark under a crc of its own: it
    /// round-trips, any damage to it leaves the mark and drops the hint
    /// (it is never needed), at most FREE_HINT_MAX ranges are kept, and
    /// without the compat bit none is written or read.
    #[test]
    fn free_space_hint_round_trip_and_damage() {
        let mark = CleanMark {
            generation: 7,
            journal_start: 8192,
            journal_seq: 1234,
            journal_chain: 9,
        };
        let hinted = Superblock {
            features_compat: sample().features_compat | COMPAT_FREE_SPACE_HINT,
            clean_mark: Some(mark),
            free_hint: vec![(1 << 20, 1 << 16), (4 << 20, 4096)],
            ..sample()
        };
        let bytes = hinted.encode();
        assert_eq!(Superblock::decode(&bytes).unwrap(), hinted);
        let end = OFF_FREE_HINT + 4 + 2 * 16 + 4;
        assert!(end <= 512 && bytes[end..].iter().all(|&b| b == 0));
        for i in OFF_FREE_HINT..end {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            let got = Superblock::decode(&b).unwrap();
            assert_eq!(got.clean_mark, Some(mark), "byte {i}");
            assert!(got.free_hint.is_empty(), "byte {i}");
        }
        let many = Superblock {
            free_hint: (0..40u64).map(|i| (i << 20, 4096)).collect(),
            ..hinted.clone()
        };
        assert_eq!(
            Superblock::decode(&many.encode()).unwrap().free_hint,
            many.free_hint[..FREE_HINT_MAX]
        );
        let old = Superblock {
            features_compat: hinted.features_compat & !COMPAT_FREE_SPACE_HINT,
            ..hinted.clone()
        };
        let bytes = old.encode();
        assert!(bytes[OFF_FREE_HINT..].iter().all(|&b| b == 0));
        let mut with_bit = bytes.clone();
        // A hint left by a writer that knew the bit, read by one told it
        // is not there: ignored.
        with_bit[OFF_FREE_HINT..end].copy_from_slice(&hinted.encode()[OFF_FREE_HINT..end]);
        assert!(Superblock::decode(&with_bit).unwrap().free_hint.is_empty());
    }

    #[test]
    fn clean_unmount_mark_round_trip_and_damage() {
        let plain = sample();
        let mark = CleanMark {
            generation: 7,
            journal_start: 8192,
            journal_seq: 1234,
            journal_chain: 0xdead_beef,
        };
        let marked = Superblock {
            clean_mark: Some(mark),
            ..plain.clone()
        };
        let bytes = marked.encode();
        assert_eq!(bytes.len(), 4096);
        assert!(bytes[MARKED_SUPERBLOCK_ENCODED_LEN..]
            .iter()
            .all(|&b| b == 0));
        assert_eq!(Superblock::decode(&bytes).unwrap(), marked);
        assert_eq!(
            Superblock::decode(&plain.encode()).unwrap().clean_mark,
            None
        );
        marked.check_writable().unwrap();
        // What a reader that does not know the mark checks still verifies,
        // and shows the ro_compat bit; the fields before the crc are the
        // unmarked superblock's but for that bit.
        let stored = u32::from_le_bytes(bytes[OFF_CRC..OFF_CRC + 4].try_into().unwrap());
        assert_eq!(crc32c::crc32c(&bytes[..OFF_CRC]), stored);
        let ro_compat = u64::from_le_bytes(
            bytes[OFF_FEATURES_RO_COMPAT..OFF_FEATURES_RO_COMPAT + 8]
                .try_into()
                .unwrap(),
        );
        assert_eq!(ro_compat, RO_COMPAT_CLEAN_UNMOUNT);
        let mut unmarked = bytes.clone();
        unmarked[OFF_FEATURES_RO_COMPAT] = 0;
        assert_eq!(
            unmarked[..OFF_CRC],
            plain.encode()[..OFF_CRC],
            "the mark changes nothing else"
        );
        // Every byte of the mark is covered, and the bit without a mark.
        for i in OFF_CLEAN_MARK..MARKED_SUPERBLOCK_ENCODED_LEN {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(Superblock::decode(&b), Err(Error::Corrupt { .. })),
                "byte {i}"
            );
        }
        let mut bare = plain.clone();
        bare.features_ro_compat = RO_COMPAT_CLEAN_UNMOUNT;
        assert!(matches!(
            Superblock::decode(&bare.encode()),
            Err(Error::Corrupt { .. })
        ));
        assert!(Superblock::decode(&bytes[..MARKED_SUPERBLOCK_ENCODED_LEN - 1]).is_err());
        // The backup never holds it.
        let dev = VecDevice::new(4 * MIB, 512);
        write_superblock(&dev, &marked).unwrap();
        write_backup_superblock(&dev, &marked).unwrap();
        assert_eq!(read_superblock(&dev).unwrap(), marked);
        assert_eq!(find_backup_superblock(&dev).unwrap().1, plain);
    }

    #[test]
    fn rejects_bad_layouts_with_valid_crc() {
        let sb = sample();
        let bad: Vec<fn(&mut Layout)> = vec![
            |l| l.journal.start += 512,
            |l| l.journal.start = l.checkpoint_slots[1].start,
            |l| l.data.len += 4096,
            |l| l.data.len = 4096,
            |l| l.checkpoint_slots[0].start = 0,
            |l| l.block_size = 3000,
            |l| l.data.start = u64::MAX - 4095,
            |l| std::mem::swap(&mut l.data, &mut l.checkpoint_slots[0]),
        ];
        for (i, f) in bad.iter().enumerate() {
            let mut s = sb.clone();
            f(&mut s.layout);
            let err = Superblock::decode(&s.encode()).unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "case {i}: {err}");
        }
    }

    #[test]
    fn backup_superblock_stands_in_for_a_damaged_primary() {
        for block_size in [512, 4096] {
            let dev = VecDevice::new(4 * MIB + 1024, 512);
            let sb = Superblock::new(
                Layout::compute(4 * MIB + 1024, 512, block_size, None, None).unwrap(),
            );
            assert_ne!(sb.features_compat & COMPAT_BACKUP_SUPERBLOCK, 0);
            let backup = sb.layout.backup_superblock().unwrap();
            assert_eq!(
                backup,
                align_down(4 * MIB + 1024, u64::from(block_size)) - u64::from(block_size)
            );
            write_backup_superblock(&dev, &sb).unwrap();
            write_superblock(&dev, &sb).unwrap();
            let read = |when| read_superblock_or_backup(&dev, when);
            assert!(read(BackupUse::IfDamaged).unwrap().1.is_none());
            assert_eq!(find_backup_superblock(&dev).unwrap(), (backup, sb.clone()));

            // A damaged primary (magic intact): the backup stands in, saying why.
            dev.flip(OFF_DEVICE_BYTES as u64);
            let (found, from) = read(BackupUse::IfDamaged).unwrap();
            assert_eq!(found, sb);
            let from = from.unwrap();
            assert_eq!(from.offset, backup);
            assert!(from.to_string().contains("crc32c mismatch"), "{from}");
            // No magic in block 0 (another file system?): only fsck uses it.
            dev.with_bytes(|b| b[..8].fill(0));
            assert!(matches!(
                read(BackupUse::IfDamaged),
                Err(Error::NotIomapfs { .. })
            ));
            assert_eq!(read(BackupUse::Always).unwrap().0, sb);
            // Another version in block 0 is no damage: never replaced.
            dev.with_bytes(|b| {
                b[..4096.min(block_size as usize)]
                    .copy_from_slice(&sb.encode()[..4096.min(block_size as usize)])
            });
            dev.with_bytes(|b| b[OFF_VERSION] = 3);
            assert!(matches!(
                read(BackupUse::Always),
                Err(Error::UnsupportedVersion { .. })
            ));
            // A damaged backup too: the primary's error.
            dev.with_bytes(|b| b[OFF_VERSION] = 2);
            dev.flip(OFF_CRC as u64);
            dev.flip(backup + OFF_CRC as u64);
            assert!(find_backup_superblock(&dev).is_none());
            let err = read(BackupUse::Always).unwrap_err();
            assert!(err.to_string().contains("crc32c"), "{err}");
        }
        // A volume without the feature has no backup, whatever the last
        // block holds.
        let dev = VecDevice::new(4 * MIB, 512);
        let mut sb = sample();
        sb.features_compat = 0;
        write_superblock(&dev, &sb).unwrap();
        let offset = sb.layout.backup_superblock().unwrap();
        dev.with_bytes(|b| {
            b[offset as usize..offset as usize + 4096].copy_from_slice(&sb.encode())
        });
        assert!(read_backup_superblock(&dev, &sb).is_none());
        assert!(find_backup_superblock(&dev).is_none());
        // The feature on a layout that covers the last block is refused.
        let mut s = sample();
        s.layout.data.len += 4096;
        let err = Superblock::decode(&s.encode()).unwrap_err();
        assert!(err.to_string().contains("backup superblock"), "{err}");
    }

    #[test]
    fn device_round_trip() {
        let dev = VecDevice::new(4 * MIB, 512);
        assert!(matches!(
            read_superblock(&dev),
            Err(Error::NotIomapfs { .. })
        ));
        let sb = sample();
        write_superblock(&dev, &sb).unwrap();
        assert_eq!(dev.counters().snapshot().fua_writes, 1);
        assert_eq!(read_superblock(&dev).unwrap(), sb);

        // A device smaller than the volume.
        let small = VecDevice::new(2 * MIB, 512);
        small.with_bytes(|b| b[..4096].copy_from_slice(&sb.encode()));
        let err = read_superblock(&small).unwrap_err();
        assert!(err.to_string().contains("formatted for"), "{err}");

        // A device whose logical blocks are larger than the volume's blocks.
        let sb512 = Superblock::new(Layout::compute(4 * MIB, 512, 512, None, None).unwrap());
        let big_lbs = VecDevice::new(4 * MIB, 4096);
        big_lbs.with_bytes(|b| b[..512].copy_from_slice(&sb512.encode()));
        assert!(matches!(
            read_superblock(&big_lbs),
            Err(Error::NotIomapfs { .. })
        ));
    }
}
