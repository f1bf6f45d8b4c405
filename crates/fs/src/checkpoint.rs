//! Checkpoints: the whole metadata image, written to one of two slots in
//! turn.
//!
//! A checkpoint is the state of the volume as of a journal position: mount
//! loads the newest checkpoint that verifies and replays the journal from
//! the position it names. The two slots are used alternately, so writing a
//! new checkpoint never damages the previous one: if the write is torn, the
//! crc fails and mount falls back to the older slot, whose journal tail the
//! writer has not yet released.
//!
//! Fault model: a crash may tear the slot being written (any subset of its
//! blocks reach the disk). The crc covers the header and the whole image and
//! is seeded with the superblock uuid, so neither a torn slot nor a slot left
//! by an earlier format of the same device ever verifies.
//!
//! Once a newer checkpoint is durable, the older slot is *marked
//! superseded* (volumes with [`COMPAT_SUPERSEDE_MARKS`]): four header bytes
//! that the slot crc does not cover are rewritten to a value derived from
//! the uuid and the slot's generation. Mount can then tell a torn checkpoint
//! write (the older slot is not marked: falling back to it is right) from a
//! durable checkpoint damaged later (the older slot is marked: falling back
//! would undo committed changes, so it is reported as damage). A torn mark
//! write can only spoil the older slot, which the durable newer one no longer
//! needs.
//!
//! Delta checkpoints (volumes with [`INCOMPAT_DELTA_CHECKPOINTS`]): a slot
//! holds a whole image (the *base*, magic `IOMAPCP1`) followed, at the next
//! block boundaries, by delta records (magic `IOMAPCP2`), each holding what
//! changed since the record before it ([`MetaDelta`]) and linked to it by
//! generation and crc. The slot's checkpoint is the base with every linked
//! delta applied in order; the chain ends at the first record that does not
//! verify or link (a torn write, or a record left from an earlier chain in
//! the slot). A delta is written after the chain's end in the slot that
//! holds the chain, so the records the chain already has are never
//! touched; it is committed, as a whole checkpoint is, once its write is
//! flushed, and then the record before it is marked superseded: a mark on a
//! chain's last valid record means the next generation was durable (as the
//! next delta, or as a base in the other slot) and is damaged. A new base
//! goes to the other slot as before; see `transaction` for when.
//!
//! Spilled checkpoints (volumes with [`INCOMPAT_SPILLED_CHECKPOINTS`]): an
//! image too large for its slot goes to *spill extents* of the data area,
//! which the caller allocates; the slot holds a base record (magic
//! `IOMAPCP3`) whose payload is the *spill table* (image length, image crc,
//! the extents in image order) instead of the image, and deltas chain after
//! it in the slot as after any base. The record's crc covers the table, the
//! table's crc the image, so a checkpoint verifies only when both were
//! written whole: a torn spilled checkpoint is rejected like a torn slot.
//! The caller keeps the spill extents of both slots' checkpoints in use,
//! and frees a slot's old ones only once the checkpoint that replaced them
//! in the slot is durable (see `transaction`).
//!
//! Free-space hints (volumes with [`COMPAT_CHECKPOINT_FREE_HINT`]): a
//! record may be followed, in the same write, by a block holding the
//! largest free ranges of the data area at its snapshot, tied to the
//! record by generation and crc ([`read_free_hint`]). It sits where the
//! next delta goes, so only the chain's last record keeps its hint, which
//! is the one mount loads; a reader of the chain sees a block with another
//! magic there, the end of the chain, as it sees an unwritten block.
//!
//! Byte layout: see `docs/FORMAT.md`.

use blockdev::{BlockDevice, WriteMode};

use crate::codec::{
    self, Decoder, DeltaLink, Encoder, IndexRef, IndexTable, PageArea, PageRef, PageTable,
};
use crate::error::{Error, Result};
use crate::extent_map::span_merge::SpanMerge;
use crate::page_chunks::{ChunkMerge, PagedMaps};
use crate::superblock::{
    decode_hint_ranges, encode_hint_ranges, is_aligned, Region, Superblock, CHECKPOINT_SLOTS,
    COMPAT_CHECKPOINT_FREE_HINT, COMPAT_SUPERSEDE_MARKS, FREE_HINT_MAX, INCOMPAT_DELTA_CHECKPOINTS,
    INCOMPAT_EXTENT_PAGES, INCOMPAT_PAGE_INDEX, INCOMPAT_SPILLED_CHECKPOINTS,
};
use crate::types::{Extent, Ino, InodeImage, MetaDelta, MetaImage};

/// First 8 bytes of the free-space hint block after a record.
pub const FREE_HINT_MAGIC: [u8; 8] = *b"IOMAPFH1";
/// Bytes of a hint block before its ranges: magic, generation, record
/// crc (the ranges' count follows, see `superblock::encode_hint_ranges`).
const FREE_HINT_HEADER_LEN: usize = 8 + 8 + 4;
// Within one 512-byte logical sector (header, count, ranges of 16 bytes,
// crc): a torn write keeps or loses it whole (the crc would refuse a mix
// anyway).
const _: () = assert!(FREE_HINT_HEADER_LEN + 4 + FREE_HINT_MAX * 16 + 4 <= 512);

/// First 8 bytes of a valid checkpoint slot: a whole image (the base).
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"IOMAPCP1";
/// First 8 bytes of a delta record after a slot's base.
pub const DELTA_MAGIC: [u8; 8] = *b"IOMAPCP2";
/// First 8 bytes of a base whose image is in spill extents of the data
/// area; its payload is the spill table.
pub const SPILLED_MAGIC: [u8; 8] = *b"IOMAPCP3";

/// A range of the data area, `(device byte offset, length)`, holding part
/// of a spilled checkpoint image.
pub type SpillExtent = (u64, u64);

/// Bytes of a spill table before its extents: image length (u64), image
/// crc (u32), extent count (u32).
pub const SPILL_TABLE_HEADER_LEN: usize = 16;
/// Bytes of one spill table entry: device offset (u64), length (u64).
pub const SPILL_EXTENT_ENCODED_LEN: usize = 16;

// Byte offsets inside a slot (all little-endian).
pub const OFF_MAGIC: usize = 0;
pub const OFF_GENERATION: usize = 8;
pub const OFF_JOURNAL_START: usize = 16;
pub const OFF_JOURNAL_SEQ: usize = 24;
pub const OFF_JOURNAL_CHAIN: usize = 32;
/// The supersede mark: zero, or [`supersede_mark`] of the slot's generation
/// (only on volumes with [`COMPAT_SUPERSEDE_MARKS`]). The crc covers these
/// bytes as if they were zero, so marking needs no reading of the image.
pub const OFF_SUPERSEDED: usize = 36;
pub const OFF_IMAGE_LEN: usize = 40;
/// crc32c, seeded with `crc32c(uuid)`, of bytes `[0, OFF_CRC)` (the mark
/// taken as zero) then the image.
pub const OFF_CRC: usize = 48;
/// The encoded image (or delta payload) starts right after the header,
/// which is the same for bases and deltas.
pub const CHECKPOINT_HEADER_LEN: usize = OFF_CRC + 4;

const WHAT: &str = "checkpoint";

/// The metadata image as of a journal position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// Higher is newer.
    pub generation: u64,
    /// Byte offset inside the journal region where replay starts.
    pub journal_start: u64,
    /// Sequence number of the first record to replay.
    pub journal_seq: u64,
    /// Chain value the first journal batch after this checkpoint must carry.
    pub journal_chain: u32,
    pub image: MetaImage,
}

/// A delta checkpoint: what changed since the previous checkpoint of the
/// chain, as of a journal position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaCheckpoint {
    pub generation: u64,
    pub journal_start: u64,
    pub journal_seq: u64,
    pub journal_chain: u32,
    pub delta: MetaDelta,
}

/// The end of the chain of checkpoints in a slot: what the next delta
/// links to, where it goes, and how long the chain is (for the policy that
/// writes a new base instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainEnd {
    /// Generation and crc of the chain's last record.
    pub generation: u64,
    pub crc: u32,
    /// Byte offset inside the slot of the last record (the base: 0).
    pub last_offset: u64,
    /// Byte offset inside the slot where the next delta goes.
    pub next_offset: u64,
    /// Bytes of the base record, header and image (with extent pages:
    /// header, root and every page it lists, what mount reads of it).
    pub base_bytes: u64,
    /// Deltas after the base, and their bytes (headers and payloads).
    pub deltas: u32,
    pub delta_bytes: u64,
}

impl ChainEnd {
    /// The chain of a base alone: its record takes `record_bytes` of the
    /// slot and stands for `base_bytes` of header and image.
    fn of_base(
        sb: &Superblock,
        generation: u64,
        crc: u32,
        record_bytes: u64,
        base_bytes: u64,
    ) -> ChainEnd {
        ChainEnd {
            generation,
            crc,
            last_offset: 0,
            next_offset: record_bytes.next_multiple_of(sb.block_size()),
            base_bytes,
            deltas: 0,
            delta_bytes: 0,
        }
    }
}

/// Bytes a checkpoint of `image` occupies in a slot (header and image,
/// before padding to the block size). It fits if this is at most
/// [`slot_capacity`].
pub fn encoded_len(image: &MetaImage) -> u64 {
    CHECKPOINT_HEADER_LEN as u64 + codec::image_encoded_len(image)
}

/// Bytes of each checkpoint slot.
pub fn slot_capacity(sb: &Superblock) -> u64 {
    sb.layout.checkpoint_slots[0]
        .len
        .min(sb.layout.checkpoint_slots[1].len)
}

/// The slot not in use by `slot`.
pub fn other_slot(slot: usize) -> usize {
    1 - slot.min(1)
}

fn slot_region(sb: &Superblock, slot: usize) -> Result<Region> {
    sb.layout
        .checkpoint_slots
        .get(slot)
        .copied()
        .ok_or_else(|| {
            Error::invalid(
                "checkpoint slot",
                format!("slot {slot} does not exist (there are {CHECKPOINT_SLOTS})"),
            )
        })
}

fn check_journal_start(sb: &Superblock, start: u64) -> std::result::Result<(), String> {
    let journal = sb.layout.journal;
    if start >= journal.len || !is_aligned(start, sb.block_size()) {
        return Err(format!(
            "journal start {start} is not a block-aligned offset inside the {}-byte journal",
            journal.len
        ));
    }
    Ok(())
}

/// Writes `ckpt` to `slot` (0 or 1), padded to the block size, then flushes.
/// Fails with [`Error::NoSpace`], writing nothing, if it does not fit.
pub fn write_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    ckpt: &Checkpoint,
) -> Result<()> {
    write_base(dev, sb, slot, ckpt).map(drop)
}

/// [`write_checkpoint`], returning the chain that starts with it. An image
/// that does not fit goes through [`write_spilled_base`] instead.
pub fn write_base(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    ckpt: &Checkpoint,
) -> Result<ChainEnd> {
    let record = codec::encode_image_after(CHECKPOINT_HEADER_LEN, &ckpt.image)?;
    write_base_record(dev, sb, slot, RecordHeader::of(ckpt), record, &[])
}

/// [`write_base`] of an image already encoded after
/// [`CHECKPOINT_HEADER_LEN`] bytes of room (`record`).
///
/// `free_hint`: the largest free ranges of the data area at the snapshot,
/// written after the record (see [`read_free_hint`]); may be empty.
pub fn write_base_record(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    header: RecordHeader,
    record: Vec<u8>,
    free_hint: &[(u64, u64)],
) -> Result<ChainEnd> {
    let region = slot_region(sb, slot)?;
    check_journal_start(sb, header.journal_start)
        .map_err(|reason| Error::invalid("writing a checkpoint", reason))?;
    check_room("writing a checkpoint", &record)?;
    let needed = record.len() as u64;
    if needed > region.len {
        return Err(Error::NoSpace {
            what: format!("checkpoint slot {slot} (metadata image)"),
            needed,
            available: region.len,
        });
    }
    let crc = write_record_in(
        dev,
        sb,
        slot,
        0,
        &CHECKPOINT_MAGIC,
        &header,
        record,
        free_hint,
    )?;
    Ok(ChainEnd::of_base(
        sb,
        header.generation,
        crc,
        needed,
        needed,
    ))
}

/// `record`, if it has the room for a record header an encoder leaves.
fn check_room<'a>(what: &str, record: &'a [u8]) -> Result<&'a [u8]> {
    if record.len() < CHECKPOINT_HEADER_LEN {
        return Err(Error::invalid(
            what.to_string(),
            format!(
                "a record of {} bytes has no room for its {CHECKPOINT_HEADER_LEN}-byte header",
                record.len()
            ),
        ));
    }
    Ok(record)
}

/// Whether a checkpoint image of `image_len` encoded bytes must spill: the
/// volume spills and the image does not fit its slot.
pub fn must_spill(sb: &Superblock, image_len: u64) -> bool {
    sb.features_incompat & INCOMPAT_SPILLED_CHECKPOINTS != 0
        && CHECKPOINT_HEADER_LEN as u64 + image_len > slot_capacity(sb)
}

/// Data-area bytes a spilled image of `image_len` bytes takes: whole blocks.
pub fn spill_bytes(sb: &Superblock, image_len: u64) -> u64 {
    image_len.next_multiple_of(sb.block_size())
}

/// Most spill extents a slot's table can list.
pub fn max_spill_extents(sb: &Superblock) -> usize {
    let room =
        slot_capacity(sb).saturating_sub((CHECKPOINT_HEADER_LEN + SPILL_TABLE_HEADER_LEN) as u64);
    usize::try_from(room / SPILL_EXTENT_ENCODED_LEN as u64).unwrap_or(usize::MAX)
}

/// Writes `ckpt` as a spilled base to `slot`: its image to `spill` (in
/// order, the last extent zero-padded), then the slot record listing them,
/// then flushes; returns the chain that starts with it. `spill` must be
/// disjoint, block-aligned ranges of the data area that nothing else uses,
/// [`spill_bytes`] of the image in total (the caller allocates them); fails
/// with [`Error::NoSpace`] if the table does not fit the slot, writing
/// nothing.
pub fn write_spilled_base(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    ckpt: &Checkpoint,
    spill: &[SpillExtent],
) -> Result<ChainEnd> {
    let record = codec::encode_image_after(CHECKPOINT_HEADER_LEN, &ckpt.image)?;
    write_spilled_base_record(dev, sb, slot, RecordHeader::of(ckpt), &record, spill, &[])
}

/// [`write_spilled_base`] of an image already encoded after
/// [`CHECKPOINT_HEADER_LEN`] bytes of room (`record`; the room unused),
/// with `free_hint` as [`write_base_record`] writes it (never touching
/// `spill`: the caller leaves the spill extents out).
pub fn write_spilled_base_record(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    header: RecordHeader,
    record: &[u8],
    spill: &[SpillExtent],
    free_hint: &[(u64, u64)],
) -> Result<ChainEnd> {
    let region = slot_region(sb, slot)?;
    check_journal_start(sb, header.journal_start)
        .map_err(|reason| Error::invalid("writing a spilled checkpoint", reason))?;
    if sb.features_incompat & INCOMPAT_SPILLED_CHECKPOINTS == 0 {
        return Err(Error::invalid(
            "writing a spilled checkpoint",
            "the volume does not have the spilled checkpoint feature",
        ));
    }
    let record_len = spilled_record_len(spill.len());
    if record_len > region.len {
        return Err(Error::NoSpace {
            what: format!(
                "checkpoint slot {slot} (a table of {} spill extents)",
                spill.len()
            ),
            needed: record_len,
            available: region.len,
        });
    }
    let image = &check_room("writing a spilled checkpoint", record)?[CHECKPOINT_HEADER_LEN..];
    let total = spill_bytes(sb, image.len() as u64);
    check_spill_extents(sb, spill, total)
        .map_err(|reason| Error::invalid("writing a spilled checkpoint", reason))?;
    let mut rest: &[u8] = image;
    for &(addr, len) in spill {
        let take = rest.len().min(len as usize);
        let write_err = |e| {
            Error::device(
                format!("writing slot {slot}'s spilled image at device byte {addr}"),
                e,
            )
        };
        if take as u64 == len {
            dev.write_at(&rest[..take], addr, WriteMode::Normal)
                .map_err(write_err)?;
        } else {
            let mut padded = rest[..take].to_vec();
            padded.resize(len as usize, 0);
            dev.write_at(&padded, addr, WriteMode::Normal)
                .map_err(write_err)?;
        }
        rest = &rest[take..];
    }
    let table = encode_spill_table(&SpillTable {
        image_len: image.len() as u64,
        image_crc: crc32c::crc32c_append(sb.crc_seed(), image),
        extents: spill.to_vec(),
    });
    // One flush, after the record: the crcs refuse any mix of old and new
    // blocks a power cut before it leaves.
    let crc = write_record(dev, sb, slot, 0, &SPILLED_MAGIC, &header, &table, free_hint)?;
    let base_bytes = CHECKPOINT_HEADER_LEN as u64 + image.len() as u64;
    Ok(ChainEnd::of_base(
        sb,
        header.generation,
        crc,
        record_len,
        base_bytes,
    ))
}

/// Bytes of a spilled base record in its slot: header and table.
fn spilled_record_len(extents: usize) -> u64 {
    (CHECKPOINT_HEADER_LEN + SPILL_TABLE_HEADER_LEN) as u64
        + extents as u64 * SPILL_EXTENT_ENCODED_LEN as u64
}

/// Checks that `spill` is non-empty, block-aligned ranges inside the data
/// area (so clear of the superblocks, the slots and the journal), disjoint,
/// and `total` bytes together.
fn check_spill_extents(
    sb: &Superblock,
    spill: &[SpillExtent],
    total: u64,
) -> std::result::Result<(), String> {
    let data = sb.layout.data;
    let bs = sb.block_size();
    let mut sum = 0u64;
    for (i, &(addr, len)) in spill.iter().enumerate() {
        let end = addr.checked_add(len);
        let inside = end.is_some_and(|end| addr >= data.start && end <= data.start + data.len);
        if len == 0 || !is_aligned(addr, bs) || !is_aligned(len, bs) || !inside {
            return Err(format!(
                "spill extent {i} ({addr}+{len}) is not a non-empty, {bs}-byte aligned range of the data area {}+{}",
                data.start, data.len
            ));
        }
        sum = sum.saturating_add(len);
    }
    if sum != total {
        return Err(format!(
            "spill extents hold {sum} bytes, not the {total} the image takes"
        ));
    }
    let mut sorted = spill.to_vec();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        if pair[0].0 + pair[0].1 > pair[1].0 {
            return Err(format!(
                "spill extents {}+{} and {}+{} overlap",
                pair[0].0, pair[0].1, pair[1].0, pair[1].1
            ));
        }
    }
    Ok(())
}

/// A spill table as decoded from a spilled base's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillTable {
    pub image_len: u64,
    pub image_crc: u32,
    pub extents: Vec<SpillExtent>,
}

/// The bytes of `table`, as a spilled base's payload.
pub fn encode_spill_table(table: &SpillTable) -> Vec<u8> {
    let mut enc = Encoder::with_capacity(
        SPILL_TABLE_HEADER_LEN + table.extents.len() * SPILL_EXTENT_ENCODED_LEN,
    );
    enc.u64(table.image_len);
    enc.u32(table.image_crc);
    enc.u32(table.extents.len() as u32);
    for &(addr, len) in &table.extents {
        enc.u64(addr);
        enc.u64(len);
    }
    enc.into_bytes()
}

/// Decodes and checks a spill table (the payload of a spilled base found at
/// device byte `at`): exactly its bytes, extents as
/// [`write_spilled_base`] requires them, holding the image's whole blocks.
/// Allocates nothing before the count is checked against the bytes.
pub fn decode_spill_table(sb: &Superblock, payload: &[u8], at: u64) -> Result<SpillTable> {
    let mut dec = Decoder::new(payload, at, "spill table");
    let image_len = dec.u64()?;
    let image_crc = dec.u32()?;
    let count = dec.u32()? as usize;
    let room = payload.len() - SPILL_TABLE_HEADER_LEN.min(payload.len());
    if count.checked_mul(SPILL_EXTENT_ENCODED_LEN) != Some(room) {
        return Err(Error::corrupt(
            "spill table",
            at,
            format!("{count} extents do not fill the table's {room} bytes after its header"),
        ));
    }
    let mut extents = Vec::with_capacity(count);
    for _ in 0..count {
        extents.push((dec.u64()?, dec.u64()?));
    }
    let total = image_len
        .checked_next_multiple_of(sb.block_size())
        .unwrap_or(u64::MAX);
    check_spill_extents(sb, &extents, total)
        .map_err(|reason| Error::corrupt("spill table", at, reason))?;
    Ok(SpillTable {
        image_len,
        image_crc,
        extents,
    })
}

/// Reads the image a spill table lists and checks its crc.
fn read_spilled_image(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    table: &SpillTable,
    at: u64,
) -> Result<Vec<u8>> {
    // The extents lie in the data area and hold the image's whole blocks,
    // so the length is bounded by the device; a forged table may still ask
    // for more memory than there is, which is an error, not an abort.
    let total = spill_bytes(sb, table.image_len);
    let mut image = Vec::new();
    usize::try_from(total)
        .ok()
        .and_then(|n| image.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            Error::corrupt(
                "spill table",
                at,
                format!("slot {slot}: cannot hold a spilled image of {total} bytes in memory"),
            )
        })?;
    image.resize(total as usize, 0);
    let mut pos = 0usize;
    for &(addr, len) in &table.extents {
        dev.read_at(&mut image[pos..pos + len as usize], addr)
            .map_err(|e| {
                Error::device(
                    format!("reading slot {slot}'s spilled image at device byte {addr}"),
                    e,
                )
            })?;
        pos += len as usize;
    }
    image.truncate(table.image_len as usize);
    let crc = crc32c::crc32c_append(sb.crc_seed(), &image);
    if crc != table.image_crc {
        return Err(Error::corrupt(
            WHAT,
            table.extents.first().map_or(at, |e| e.0),
            format!(
                "slot {slot}: spilled image crc32c mismatch (stored {:#010x}, computed {crc:#010x}): torn, or its extents reused since",
                table.image_crc
            ),
        ));
    }
    Ok(image)
}

/// Bytes a delta record of `delta` occupies (header and payload).
pub fn delta_record_len(delta: &MetaDelta) -> u64 {
    CHECKPOINT_HEADER_LEN as u64 + codec::delta_encoded_len(delta)
}

/// Whether a delta of `record_len` bytes fits after `chain` in a slot.
pub fn delta_fits(sb: &Superblock, chain: &ChainEnd, record_len: u64) -> bool {
    chain.next_offset + record_len <= slot_capacity(sb)
}

/// Appends `ckpt` to the chain in `slot` that ends at `chain`, padded to the
/// block size, then flushes; returns the chain's new end. Writes nothing
/// the chain holds. Fails with [`Error::NoSpace`], writing nothing, if it
/// does not fit after the chain. `free_hint` as [`write_base_record`]
/// writes it.
pub fn write_delta(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    chain: &ChainEnd,
    ckpt: &DeltaCheckpoint,
    free_hint: &[(u64, u64)],
) -> Result<ChainEnd> {
    slot_region(sb, slot)?;
    check_journal_start(sb, ckpt.journal_start)
        .map_err(|reason| Error::invalid("writing a delta checkpoint", reason))?;
    if sb.features_incompat & INCOMPAT_DELTA_CHECKPOINTS == 0 {
        return Err(Error::invalid(
            "writing a delta checkpoint",
            "the volume does not have the delta checkpoint feature",
        ));
    }
    let needed = delta_record_len(&ckpt.delta);
    if !delta_fits(sb, chain, needed) {
        return Err(Error::NoSpace {
            what: format!("checkpoint slot {slot} (delta after the chain)"),
            needed,
            available: slot_capacity(sb).saturating_sub(chain.next_offset),
        });
    }
    let link = DeltaLink {
        prev_generation: chain.generation,
        prev_crc: chain.crc,
    };
    let record = codec::encode_delta_after(CHECKPOINT_HEADER_LEN, link, &ckpt.delta)?;
    let header = RecordHeader {
        generation: ckpt.generation,
        journal_start: ckpt.journal_start,
        journal_seq: ckpt.journal_seq,
        journal_chain: ckpt.journal_chain,
    };
    let crc = write_record_in(
        dev,
        sb,
        slot,
        chain.next_offset,
        &DELTA_MAGIC,
        &header,
        record,
        free_hint,
    )?;
    Ok(ChainEnd {
        generation: ckpt.generation,
        crc,
        last_offset: chain.next_offset,
        next_offset: chain.next_offset + needed.next_multiple_of(sb.block_size()),
        base_bytes: chain.base_bytes,
        deltas: chain.deltas + 1,
        delta_bytes: chain.delta_bytes + needed,
    })
}

/// The header fields bases and deltas share: a [`Checkpoint`] without its
/// image.
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader {
    pub generation: u64,
    pub journal_start: u64,
    pub journal_seq: u64,
    pub journal_chain: u32,
}

impl RecordHeader {
    pub fn of(ckpt: &Checkpoint) -> RecordHeader {
        RecordHeader {
            generation: ckpt.generation,
            journal_start: ckpt.journal_start,
            journal_seq: ckpt.journal_seq,
            journal_chain: ckpt.journal_chain,
        }
    }
}

/// Writes a record of `payload` (a small one: a spill table) at `offset`
/// of `slot`; see [`write_record_in`].
#[allow(clippy::too_many_arguments)]
fn write_record(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    offset: u64,
    magic: &[u8; 8],
    header: &RecordHeader,
    payload: &[u8],
    free_hint: &[(u64, u64)],
) -> Result<u32> {
    let mut record = Vec::with_capacity(CHECKPOINT_HEADER_LEN + payload.len());
    record.resize(CHECKPOINT_HEADER_LEN, 0);
    record.extend_from_slice(payload);
    write_record_in(dev, sb, slot, offset, magic, header, record, free_hint)
}

/// Writes `record` at `offset` of `slot`, its first [`CHECKPOINT_HEADER_LEN`]
/// bytes (room left by the encoder) filled with the header and the crc over
/// header and payload, padded to the block size, then flushes. Returns the
/// crc. With [`COMPAT_CHECKPOINT_FREE_HINT`], a non-empty `free_hint` and
/// a block of room in the slot, the hint block follows in the same write
/// (see [`read_free_hint`]); without room the record goes alone: a hint is
/// never needed.
#[allow(clippy::too_many_arguments)]
fn write_record_in(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    offset: u64,
    magic: &[u8; 8],
    header: &RecordHeader,
    mut record: Vec<u8>,
    free_hint: &[(u64, u64)],
) -> Result<u32> {
    let region = slot_region(sb, slot)?;
    let payload_len = record.len() - CHECKPOINT_HEADER_LEN;
    let mut enc = Encoder::with_capacity(OFF_CRC);
    enc.bytes(magic);
    enc.u64(header.generation);
    enc.u64(header.journal_start);
    enc.u64(header.journal_seq);
    enc.u32(header.journal_chain);
    enc.u32(0);
    enc.u64(payload_len as u64);
    debug_assert_eq!(enc.len(), OFF_CRC);
    record[..OFF_CRC].copy_from_slice(enc.as_bytes());
    let crc = slot_crc(sb, &record[..OFF_CRC], &record[CHECKPOINT_HEADER_LEN..]);
    record[OFF_CRC..CHECKPOINT_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    let bs = sb.block_size() as usize;
    record.resize(record.len().next_multiple_of(bs), 0);
    let hint_at = offset + record.len() as u64;
    if sb.features_compat & COMPAT_CHECKPOINT_FREE_HINT != 0
        && !free_hint.is_empty()
        && hint_at + bs as u64 <= region.len
    {
        record.extend_from_slice(&encode_free_hint(sb, header.generation, crc, free_hint));
        record.resize(record.len().next_multiple_of(bs), 0);
    }
    let at = region.start + offset;
    dev.write_at(&record, at, WriteMode::Normal).map_err(|e| {
        Error::device(
            format!("writing checkpoint slot {slot} at slot byte {offset}"),
            e,
        )
    })?;
    dev.flush()
        .map_err(|e| Error::device(format!("flushing checkpoint slot {slot}"), e))?;
    Ok(crc)
}

/// The hint block after the record of `generation` whose crc is
/// `record_crc`: at most [`FREE_HINT_MAX`] of `ranges` (the first ones),
/// under a crc seeded with the volume's, so that neither a block of
/// another volume nor one left by an earlier record reads as this one's.
fn encode_free_hint(
    sb: &Superblock,
    generation: u64,
    record_crc: u32,
    ranges: &[(u64, u64)],
) -> Vec<u8> {
    let mut enc = Encoder::with_capacity(FREE_HINT_HEADER_LEN + 4 + FREE_HINT_MAX * 16 + 4);
    enc.bytes(&FREE_HINT_MAGIC);
    enc.u64(generation);
    enc.u32(record_crc);
    encode_hint_ranges(&mut enc, ranges);
    let crc = crc32c::crc32c_append(sb.crc_seed(), enc.as_bytes());
    enc.u32(crc);
    enc.into_bytes()
}

/// The ranges of a hint block (`bytes`, read where the record of
/// `generation` and `record_crc` ends) when it is that record's and its
/// crc verifies; empty otherwise (none written, no room, torn, damaged,
/// another record's, or the next delta written over it): a hint is never
/// needed, so nothing here is an error. The ranges are not checked
/// against the layout: the caller does (`free_space::Reserve`).
fn decode_free_hint(
    sb: &Superblock,
    bytes: &[u8],
    generation: u64,
    record_crc: u32,
) -> Vec<(u64, u64)> {
    let field = |at: usize, len: usize| bytes.get(at..at + len);
    let le_u64 = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let le_u32 = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    let (Some(magic), Some(gen), Some(crc)) = (field(0, 8), field(8, 8), field(16, 4)) else {
        return Vec::new();
    };
    if magic != FREE_HINT_MAGIC || le_u64(gen) != generation || le_u32(crc) != record_crc {
        return Vec::new();
    }
    let Some((ranges, end)) = decode_hint_ranges(bytes, FREE_HINT_HEADER_LEN) else {
        return Vec::new();
    };
    match field(end, 4).map(le_u32) == Some(crc32c::crc32c_append(sb.crc_seed(), &bytes[..end])) {
        true => ranges,
        false => Vec::new(),
    }
}

/// The free-space hint written with the last record of the chain in
/// `slot` that ends at `chain` (the record mount loads): the largest free
/// ranges of the data area at that record's snapshot, or empty when the
/// volume keeps none ([`COMPAT_CHECKPOINT_FREE_HINT`]), there is none, or
/// it does not verify. Reads one block, where the next delta would go.
pub fn read_free_hint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    chain: &ChainEnd,
) -> Result<Vec<(u64, u64)>> {
    let region = slot_region(sb, slot)?;
    let bs = sb.block_size();
    if sb.features_compat & COMPAT_CHECKPOINT_FREE_HINT == 0 || chain.next_offset + bs > region.len
    {
        return Ok(Vec::new());
    }
    let mut block = vec![0u8; bs as usize];
    dev.read_at(&mut block, region.start + chain.next_offset)
        .map_err(|e| {
            Error::device(
                format!(
                    "reading checkpoint slot {slot}'s free-space hint at slot byte {}",
                    chain.next_offset
                ),
                e,
            )
        })?;
    Ok(decode_free_hint(sb, &block, chain.generation, chain.crc))
}

/// The value of the supersede mark of the checkpoint of `generation`: tied
/// to the volume (uuid) and the generation, so neither a stray bit flip of a
/// zero field nor a mark left by an earlier checkpoint in the slot reads as
/// a valid mark. Never zero.
pub fn supersede_mark(sb: &Superblock, generation: u64) -> u32 {
    let mut bytes = *b"superseded by ..........";
    bytes[16..].copy_from_slice(&(generation.wrapping_add(1)).to_le_bytes());
    crc32c::crc32c_append(sb.crc_seed(), &bytes).max(1)
}

/// The checkpoint slot crc: header (with the mark as zero), then the image.
fn slot_crc(sb: &Superblock, header: &[u8], image: &[u8]) -> u32 {
    let mut head = [0u8; OFF_CRC];
    head.copy_from_slice(&header[..OFF_CRC]);
    head[OFF_SUPERSEDED..OFF_SUPERSEDED + 4].fill(0);
    crc32c::crc32c_append(crc32c::crc32c_append(sb.crc_seed(), &head), image)
}

/// A verified checkpoint slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotContents {
    /// The slot's checkpoint: the base with every delta of its chain
    /// applied; generation and journal position of the chain's last record.
    pub checkpoint: Checkpoint,
    /// The chain's last record carries a valid supersede mark: checkpoint
    /// `generation + 1` was durable (after it, or in the other slot).
    pub superseded: bool,
    pub chain: ChainEnd,
    /// Why the record after the chain's last one is not part of the chain
    /// (none written yet, torn, damaged, or left from an earlier chain);
    /// `None` when the slot has no room for one.
    pub beyond: Option<String>,
    /// The record after the chain's end verifies but does not decode, or
    /// links to the chain but does not apply: it was written whole (the writer may have moved the
    /// journal tail past what the chain's end needs), so it is damage or
    /// forgery, never a torn write.
    pub unapplied: bool,
    /// The spill extents holding the base's image (empty: the image is in
    /// the slot).
    pub spill: Vec<SpillExtent>,
    /// With [`INCOMPAT_EXTENT_PAGES`]: the extent pages the base's root
    /// lists (every one read and verified).
    pub pages: PageTable,
    /// With [`INCOMPAT_PAGE_INDEX`]: the index pages the root lists, which
    /// list `pages` (every one read and verified).
    pub index: IndexTable,
    /// The extents of the files the base keeps in pages, with the chain's
    /// deltas applied chunk by chunk: their inodes in `checkpoint.image`
    /// have none ([`read_slot`] puts them there).
    pub paged: PagedMaps,
    /// With [`PageReading::Survey`], the base's pages that did not verify
    /// (their extents are not in `paged`).
    pub damaged_pages: Vec<DamagedPage>,
    /// Copies of the root's index pages that failed where the other copy
    /// verified.
    pub damaged_index_copies: Vec<DamagedIndexCopy>,
}

/// Reads and verifies the checkpoint in `slot`.
pub fn read_checkpoint(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<Checkpoint> {
    read_slot(dev, sb, slot).map(|c| c.checkpoint)
}

/// One record as read: header fields, and the payload the crc verified.
struct RawRecord {
    magic: [u8; 8],
    header: RecordHeader,
    mark: u32,
    crc: u32,
    payload: Vec<u8>,
}

/// Reads the record at byte `offset` of `slot` and verifies its magic (one
/// of `magics`) and crc; the payload is not decoded.
fn read_record(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    offset: u64,
    magics: &[[u8; 8]],
) -> Result<RawRecord> {
    let region = slot_region(sb, slot)?;
    let bs = sb.block_size();
    let at = region.start + offset;
    let read_err = |e| {
        Error::device(
            format!("reading checkpoint slot {slot} at slot byte {offset}"),
            e,
        )
    };
    let mut buf = vec![0u8; bs as usize];
    dev.read_at(&mut buf, at).map_err(read_err)?;
    let mut dec = Decoder::new(&buf, at, WHAT);
    let found: [u8; 8] = dec.array()?;
    if !magics.contains(&found) {
        let what = if offset == 0 {
            "no checkpoint"
        } else {
            "no delta"
        };
        return Err(Error::corrupt(
            WHAT,
            at,
            format!("slot {slot} holds {what} at slot byte {offset} (bad magic)"),
        ));
    }
    let generation = dec.u64()?;
    let journal_start = dec.u64()?;
    let journal_seq = dec.u64()?;
    let journal_chain = dec.u32()?;
    let mark = dec.u32()?;
    let payload_len = dec.u64()?;
    let stored_crc = dec.u32()?;
    let capacity = region.len - offset - CHECKPOINT_HEADER_LEN as u64;
    if payload_len > capacity {
        return Err(Error::corrupt(
            WHAT,
            at + OFF_IMAGE_LEN as u64,
            format!(
                "slot {slot}: record at slot byte {offset}: length {payload_len} exceeds the slot's {capacity} bytes after it"
            ),
        ));
    }
    // payload_len is bounded by the slot size, which the superblock bounds
    // by the device size.
    let total = (CHECKPOINT_HEADER_LEN as u64 + payload_len).next_multiple_of(bs);
    if total > bs {
        let mut whole = vec![0u8; total as usize];
        whole[..bs as usize].copy_from_slice(&buf);
        dev.read_at(&mut whole[bs as usize..], at + bs)
            .map_err(read_err)?;
        buf = whole;
    }
    let payload_end = CHECKPOINT_HEADER_LEN + payload_len as usize;
    let crc = slot_crc(sb, &buf, &buf[CHECKPOINT_HEADER_LEN..payload_end]);
    if crc != stored_crc {
        return Err(Error::corrupt(
            WHAT,
            at + OFF_CRC as u64,
            format!(
                "slot {slot}: record at slot byte {offset}: crc32c mismatch (stored {stored_crc:#010x}, computed {crc:#010x}): torn, damaged, or from an earlier format"
            ),
        ));
    }
    let marks = sb.features_compat & COMPAT_SUPERSEDE_MARKS != 0;
    if mark != 0 && (!marks || mark != supersede_mark(sb, generation)) {
        return Err(Error::corrupt(
            WHAT,
            at + OFF_SUPERSEDED as u64,
            if marks {
                format!("slot {slot}: supersede mark {mark:#010x} is not generation {generation}'s")
            } else {
                format!("slot {slot}: reserved field is {mark:#x}, not 0 (the volume keeps no supersede marks)")
            },
        ));
    }
    check_journal_start(sb, journal_start).map_err(|reason| {
        Error::corrupt(
            WHAT,
            at + OFF_JOURNAL_START as u64,
            format!("slot {slot}: {reason}"),
        )
    })?;
    buf.truncate(payload_end);
    buf.drain(..CHECKPOINT_HEADER_LEN);
    Ok(RawRecord {
        magic: found,
        header: RecordHeader {
            generation,
            journal_start,
            journal_seq,
            journal_chain,
        },
        mark,
        crc,
        payload: buf,
    })
}

/// What the header of a slot's base says, unverified.
#[derive(Clone, Copy)]
struct BaseHeader {
    generation: u64,
    spilled: bool,
}

/// The header of `slot`'s base (`None`: no base magic), to decide which
/// slot to read first.
fn base_header(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<Option<BaseHeader>> {
    let region = slot_region(sb, slot)?;
    let mut head = vec![0u8; sb.block_size() as usize];
    dev.read_at(&mut head, region.start)
        .map_err(|e| Error::device(format!("reading checkpoint slot {slot}'s header"), e))?;
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&head[OFF_MAGIC..OFF_MAGIC + 8]);
    if magic != CHECKPOINT_MAGIC && magic != SPILLED_MAGIC {
        return Ok(None);
    }
    let mut generation = [0u8; 8];
    generation.copy_from_slice(&head[OFF_GENERATION..OFF_GENERATION + 8]);
    Ok(Some(BaseHeader {
        generation: u64::from_le_bytes(generation),
        spilled: magic == SPILLED_MAGIC,
    }))
}

/// Verifies the base record of `slot` (header and payload crc) and returns
/// its spill extents (none for a whole image), without reading a spilled
/// image or decoding a whole one.
fn read_spill_table(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
) -> Result<Vec<SpillExtent>> {
    let base = read_record(dev, sb, slot, 0, &base_magics(sb))?;
    if base.magic != SPILLED_MAGIC {
        return Ok(Vec::new());
    }
    let at = slot_region(sb, slot)?.start + CHECKPOINT_HEADER_LEN as u64;
    Ok(decode_spill_table(sb, &base.payload, at)?.extents)
}

/// The magics a slot's base may carry on this volume.
fn base_magics(sb: &Superblock) -> Vec<[u8; 8]> {
    if sb.features_incompat & INCOMPAT_SPILLED_CHECKPOINTS != 0 {
        vec![CHECKPOINT_MAGIC, SPILLED_MAGIC]
    } else {
        vec![CHECKPOINT_MAGIC]
    }
}

/// Reads and verifies the checkpoint in `slot` (its base and every delta
/// chained to it), and whether the chain's last record is marked
/// superseded. The image is whole: [`SlotContents::paged`] is empty.
pub fn read_slot(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<SlotContents> {
    let mut contents =
        read_slot_chunks(dev, sb, slot, PageReading::Every, &mut ReadRuns::default())?;
    std::mem::take(&mut contents.paged)
        .fill_image(&mut contents.checkpoint.image)
        .map_err(|reason| Error::invalid("reading extent pages", reason))?;
    Ok(contents)
}

/// [`read_slot`], leaving the extents of files kept in pages as the
/// pages' chunks ([`SlotContents::paged`]): what mount builds maps from.
fn read_slot_chunks(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    reading: PageReading,
    read: &mut ReadRuns,
) -> Result<SlotContents> {
    let region = slot_region(sb, slot)?;
    let bs = sb.block_size();
    let base = read_record(dev, sb, slot, 0, &base_magics(sb))?;
    let payload_at = region.start + CHECKPOINT_HEADER_LEN as u64;
    let (decoded, spill, base_bytes) = if base.magic == SPILLED_MAGIC {
        let table = decode_spill_table(sb, &base.payload, payload_at)?;
        let bytes = read_spilled_image(dev, sb, slot, &table, payload_at)?;
        let at = table.extents.first().map_or(payload_at, |e| e.0);
        let image = decode_base(
            dev,
            sb,
            &bytes,
            at,
            "spilled checkpoint image",
            reading,
            read,
        )?;
        let base_bytes = (CHECKPOINT_HEADER_LEN + bytes.len()) as u64;
        (image, table.extents, base_bytes)
    } else {
        let image = decode_base(
            dev,
            sb,
            &base.payload,
            payload_at,
            "checkpoint image",
            reading,
            read,
        )?;
        (
            image,
            Vec::new(),
            (CHECKPOINT_HEADER_LEN + base.payload.len()) as u64,
        )
    };
    let DecodedBase {
        mut image,
        pages,
        index,
        mut paged,
        damaged_pages,
        damaged_index_copies,
    } = decoded;
    let record_bytes = (CHECKPOINT_HEADER_LEN + base.payload.len()) as u64;
    let base_bytes = base_bytes + listed_page_bytes(sb, &pages, &index);
    let mut chain = ChainEnd::of_base(
        sb,
        base.header.generation,
        base.crc,
        record_bytes,
        base_bytes,
    );
    let mut header = base.header;
    let mut superseded = base.mark != 0;
    let mut beyond = None;
    let mut unapplied = false;
    if sb.features_incompat & INCOMPAT_DELTA_CHECKPOINTS != 0 {
        while chain.next_offset + bs <= region.len {
            match read_linked_delta(
                dev,
                sb,
                slot,
                &chain,
                &mut image,
                &mut paged,
                &mut unapplied,
            ) {
                Ok(delta) => {
                    let bytes = (CHECKPOINT_HEADER_LEN + delta.payload.len()) as u64;
                    chain = ChainEnd {
                        generation: delta.header.generation,
                        crc: delta.crc,
                        last_offset: chain.next_offset,
                        next_offset: chain.next_offset + bytes.next_multiple_of(bs),
                        base_bytes,
                        deltas: chain.deltas + 1,
                        delta_bytes: chain.delta_bytes + bytes,
                    };
                    superseded = delta.mark != 0;
                    header = delta.header;
                }
                Err(e @ Error::Corrupt { .. }) => {
                    beyond = Some(e.to_string());
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(SlotContents {
        checkpoint: Checkpoint {
            generation: header.generation,
            journal_start: header.journal_start,
            journal_seq: header.journal_seq,
            journal_chain: header.journal_chain,
            image,
        },
        superseded,
        chain,
        beyond,
        unapplied,
        spill,
        pages,
        index,
        paged,
        damaged_pages,
        damaged_index_copies,
    })
}

/// Bytes of the pages `pages` lists: with them a base costs mount (and
/// a checkpoint that rewrites it) as much as a whole image, which the
/// delta policy weighs deltas against ([`ChainEnd::base_bytes`]).
///
/// A file's index pages keep the sum of their pages' lengths (checked
/// against the pages when read): taken from them, so a base at 50M
/// extents counts 2k index pages, not 195k pages. A table is its index
/// pages' pages, in order (what a plan writes and a root's reader
/// builds); a file whose index pages list another count of pages than
/// its table, which would be a bug, is counted page by page.
pub fn listed_page_bytes(sb: &Superblock, pages: &PageTable, index: &IndexTable) -> u64 {
    let block_size = sb.block_size();
    let pages: u64 = pages
        .iter()
        .map(|(ino, list)| {
            let refs = index
                .binary_search_by_key(ino, |&(i, _)| i)
                .map_or(&[][..], |at| &index[at].1[..]);
            let indexed: usize = refs.iter().map(|r| r.pages as usize).sum();
            if !refs.is_empty() && indexed == list.len() {
                refs.iter().map(|r| r.page_bytes).sum::<u64>()
            } else {
                list.iter()
                    .map(|p| codec::page_len(p.count as usize, block_size))
                    .sum()
            }
        })
        .sum();
    pages + index_page_count(index) * codec::INDEX_COPIES as u64 * block_size
}

/// How many index pages `index` lists (two blocks each: their copies).
pub fn index_page_count(index: &IndexTable) -> u64 {
    index.iter().map(|(_, list)| list.len() as u64).sum()
}

/// Where extent pages may lie: the data area.
pub fn page_area(sb: &Superblock) -> PageArea {
    PageArea {
        start: sb.layout.data.start,
        len: sb.layout.data.len,
        block_size: sb.block_size(),
    }
}

/// A base as [`decode_base`] reads it.
struct DecodedBase {
    image: MetaImage,
    pages: PageTable,
    index: IndexTable,
    paged: PagedMaps,
    damaged_pages: Vec<DamagedPage>,
    damaged_index_copies: Vec<DamagedIndexCopy>,
}

/// A base's image from its payload `bytes` (read from device byte `at`):
/// the image itself, or with [`INCOMPAT_EXTENT_PAGES`] a root, whose pages
/// are then read and verified (the page table, with
/// [`INCOMPAT_PAGE_INDEX`] the index pages listing it, and the pages'
/// chunks returned beside).
fn decode_base(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    bytes: &[u8],
    at: u64,
    what: &'static str,
    reading: PageReading,
    read: &mut ReadRuns,
) -> Result<DecodedBase> {
    if sb.features_incompat & INCOMPAT_EXTENT_PAGES == 0 {
        let image = codec::decode_image_at(bytes, at, what)?;
        return Ok(DecodedBase {
            image,
            pages: Vec::new(),
            index: Vec::new(),
            paged: PagedMaps::default(),
            damaged_pages: Vec::new(),
            damaged_index_copies: Vec::new(),
        });
    }
    let (codec::Root { image, pages }, index, damaged_index_copies) =
        decode_root_listing(dev, sb, bytes, at, what, reading, read)?;
    let mut damaged_pages = Vec::new();
    let paged = match reading {
        PageReading::Every => read_pages(dev, sb, &image, &pages)?,
        PageReading::OnDemand | PageReading::IndexCopies => absent_pages(&image, &pages, &index)?,
        PageReading::Survey => read_pages_surveying(dev, sb, &image, &pages, &mut damaged_pages)?,
    };
    Ok(DecodedBase {
        image,
        pages,
        index,
        paged,
        damaged_pages,
        damaged_index_copies,
    })
}

/// Decodes a root as the volume stores it, and lists its pages: with
/// [`INCOMPAT_PAGE_INDEX`] its index pages are read and verified (the
/// pages they list make the root's page table) and returned beside, with
/// the copies that did not verify where the other did (fsck's
/// [`PageReading::Survey`] reads every copy, others the second only when
/// the first fails). An index page neither of whose copies verifies is
/// damage to the root, as a root whose crc fails (the keys it covers
/// cannot be known).
fn decode_root_listing(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    bytes: &[u8],
    at: u64,
    what: &'static str,
    reading: PageReading,
    read: &mut ReadRuns,
) -> Result<(codec::Root, IndexTable, Vec<DamagedIndexCopy>)> {
    if sb.features_incompat & INCOMPAT_PAGE_INDEX == 0 {
        let root = codec::decode_root_at(bytes, at, what, page_area(sb))?;
        return Ok((root, Vec::new(), Vec::new()));
    }
    let codec::IndexedRoot { image, index } =
        codec::decode_indexed_root_at(bytes, at, what, page_area(sb))?;
    let (pages, damaged) = read_index_pages_sharing(dev, sb, &index, reading, read)?;
    Ok((codec::Root { image, pages }, index, damaged))
}

/// An index page copy that could not be read or did not verify, where the
/// index page's other copy did: nothing is lost, but one more bad block
/// would lose the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DamagedIndexCopy {
    pub ino: Ino,
    pub index: IndexRef,
    /// The copy that failed (one of `index.blocks()`).
    pub at: u64,
    /// The failure, naming the device byte and why.
    pub reason: String,
}

impl std::fmt::Display for DamagedIndexCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [first, second] = self.index.blocks();
        let other = if self.at == first { second } else { first };
        write!(
            f,
            "inode {}: the copy of an index page ({} pages from file offset {}) at device byte {} could not be read or does not verify, the one at device byte {other} does; nothing is lost, and the next two base checkpoints after a mount (and its free-space scan, which reads second copies) write that index page anew (`iomapfs fsck --repair` rewrites the copy at once): {}",
            self.ino, self.index.pages, self.index.first_key, self.at, self.reason
        )
    }
}

/// Writes the bytes of `damaged`'s other copy, read and verified first,
/// over the copy that failed (fsck's repair). The block is the index
/// page's while a root lists it, so nothing else can be there; the same
/// bytes are what the copy held when written. Written with FUA.
pub fn rewrite_index_copy(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    damaged: &DamagedIndexCopy,
) -> Result<()> {
    let (ino, iref) = (damaged.ino, &damaged.index);
    let good = match iref.blocks() {
        [first, second] if damaged.at == first => second,
        [first, second] if damaged.at == second => first,
        _ => {
            return Err(Error::invalid(
                "rewriting an index page copy",
                format!("device byte {} is not one of its copies", damaged.at),
            ))
        }
    };
    let mut reader = IndexPageReader::new(dev, sb);
    reader.read_copy(ino, iref, good)?;
    dev.write_at(&reader.block, damaged.at, WriteMode::Fua)
        .map_err(|e| {
            Error::device(
                format!(
                    "rewriting inode {ino}'s index page copy at device byte {}",
                    damaged.at
                ),
                e,
            )
        })
}

/// Reads and verifies the index pages `index` lists: the page table they
/// make, each file's pages in key order across its index pages, and the
/// copies that failed where the other copy verified (with
/// [`PageReading::Survey`] and [`PageReading::IndexCopies`] every copy is
/// read; otherwise the second only when the first fails).
pub fn read_index_pages(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    index: &IndexTable,
    reading: PageReading,
) -> Result<(PageTable, Vec<DamagedIndexCopy>)> {
    read_index_pages_sharing(dev, sb, index, reading, &mut ReadRuns::default())
}

/// The runs of index pages read so far, by inode and reference: an index
/// page both slots list is read once and its run shared by both tables
/// (the reference names the block and its crc, so an equal one holds the
/// same bytes).
#[derive(Default)]
struct ReadRuns(std::collections::HashMap<(Ino, IndexRef), codec::PageRun>);

/// [`read_index_pages`], taking the runs of index pages `read` holds
/// instead of reading them again, and adding those it reads. Not with
/// [`PageReading::Survey`] or [`PageReading::IndexCopies`], which check
/// each slot's copies.
fn read_index_pages_sharing(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    index: &IndexTable,
    reading: PageReading,
    read: &mut ReadRuns,
) -> Result<(PageTable, Vec<DamagedIndexCopy>)> {
    let every_copy = matches!(reading, PageReading::Survey | PageReading::IndexCopies);
    let mut reader = IndexPageReader::new(dev, sb);
    let mut table = Vec::with_capacity(index.len());
    for (ino, list) in index {
        // Grown as index pages verify: the counts the root claims are not
        // checked against anything read yet.
        let mut runs: Vec<codec::PageRun> = Vec::new();
        for iref in list {
            let listed = match read.0.get(&(*ino, *iref)).filter(|_| !every_copy) {
                Some(run) => run.clone(),
                None => {
                    let run = codec::PageRun::from(reader.read_page(*ino, iref)?);
                    if every_copy {
                        reader.check_second_copy(*ino, iref);
                    } else {
                        read.0.insert((*ino, *iref), run.clone());
                    }
                    run
                }
            };
            // Each index page's keys are checked on their own: those of
            // the next must follow them. Both copies hold the same bytes,
            // so this is damage to the root, not to a copy.
            let last = runs.last().and_then(|r| r.last());
            if let (Some(last), Some(next)) = (last, listed.first()) {
                if next.first_key <= last.first_key {
                    return Err(codec::index_lost(
                        *ino,
                        iref,
                        iref.addr,
                        format!(
                            "its first page starts at file offset {}, not after the previous index page's last at {}",
                            next.first_key, last.first_key
                        ),
                    ));
                }
            }
            runs.push(listed);
        }
        table.push((*ino, codec::PageList::from_runs(runs)));
    }
    Ok((table, reader.damaged))
}

/// The second copies among the index pages `tables` (both slots') list
/// that cannot be read or do not verify, each index page read once (the
/// first copies are not read: mount read them). For the background scan
/// after mount.
pub fn check_second_index_copies(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    tables: &[IndexTable],
) -> Vec<DamagedIndexCopy> {
    let mut reader = IndexPageReader::new(dev, sb);
    let mut seen = std::collections::HashSet::new();
    for (ino, list) in tables.iter().flatten() {
        for iref in list.iter().filter(|r| seen.insert(r.addr)) {
            reader.check_second_copy(*ino, iref);
        }
    }
    reader.damaged
}

/// Reads index page copies into a buffer of one block, verifying each
/// against its reference, and lists the copies that fail where the
/// other verified.
struct IndexPageReader<'a> {
    dev: &'a dyn BlockDevice,
    seed: u32,
    area: PageArea,
    block: Vec<u8>,
    damaged: Vec<DamagedIndexCopy>,
}

impl<'a> IndexPageReader<'a> {
    fn new(dev: &'a dyn BlockDevice, sb: &Superblock) -> Self {
        IndexPageReader {
            dev,
            seed: sb.crc_seed(),
            area: page_area(sb),
            block: vec![0u8; sb.block_size() as usize],
            damaged: Vec::new(),
        }
    }

    /// The page references of inode `ino`'s index page `iref` from its
    /// copy at device byte `at` (left in `block`), verified.
    fn read_copy(&mut self, ino: Ino, iref: &IndexRef, at: u64) -> Result<Vec<PageRef>> {
        self.dev.read_at(&mut self.block, at).map_err(|e| {
            Error::device(
                format!("reading inode {ino}'s index page at device byte {at}"),
                e,
            )
        })?;
        codec::decode_index_page(self.seed, &self.block, ino, iref, at, self.area)
    }

    /// The page references of inode `ino`'s index page `iref`, from the
    /// first of its copies that can be read and verifies. A copy that
    /// fails before the other verifies is listed; when both fail, the
    /// error names both.
    fn read_page(&mut self, ino: Ino, iref: &IndexRef) -> Result<Vec<PageRef>> {
        let [first_at, copy_at] = iref.blocks();
        let first = match self.read_copy(ino, iref, first_at) {
            Ok(listed) => return Ok(listed),
            Err(e) => e,
        };
        match self.read_copy(ino, iref, copy_at) {
            Ok(listed) => {
                self.damaged.push(DamagedIndexCopy {
                    ino,
                    index: *iref,
                    at: first_at,
                    reason: first.to_string(),
                });
                Ok(listed)
            }
            // Neither copy. A device error stays one (mount must not take
            // an unreadable block for damage and fall back to an older
            // checkpoint); damage to both is one error naming both.
            Err(second) => Err(match (first, second) {
                (
                    Error::Corrupt {
                        what,
                        offset,
                        reason,
                    },
                    Error::Corrupt { reason: copy, .. },
                ) => Error::Corrupt {
                    what,
                    offset,
                    reason: format!("{reason}; and its copy: {copy}"),
                },
                (e @ Error::Device { .. }, _) | (_, e @ Error::Device { .. }) => e,
                (first, _) => first,
            }),
        }
    }

    /// Reads and verifies the second copy of inode `ino`'s index page
    /// `iref`, listing it if it fails. Skipped when the first copy was
    /// just listed by [`IndexPageReader::read_page`] (the second then
    /// verified).
    fn check_second_copy(&mut self, ino: Ino, iref: &IndexRef) {
        if self.damaged.last().is_some_and(|d| d.index == *iref) {
            return;
        }
        let at = iref.copy;
        if let Err(e) = self.read_copy(ino, iref, at) {
            self.damaged.push(DamagedIndexCopy {
                ino,
                index: *iref,
                at,
                reason: e.to_string(),
            });
        }
    }
}

/// Reads every page of `pages` (each file's in `image`, where it has no
/// extents; the root's checks put it there) and returns their extents,
/// one chunk per page naming it. Checks, beyond each page, that the pages
/// of a file follow each other: the whole map is sorted and disjoint, as
/// an image's decoder checks.
pub fn read_pages(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    image: &MetaImage,
    pages: &PageTable,
) -> Result<PagedMaps> {
    read_pages_then(dev, sb, image, pages, |_, _, _, e| Err(e))
}

/// [`read_pages`], going on past a page that does not verify: listed in
/// `damaged`, its extents left out (fsck's survey). Device errors still
/// end it.
fn read_pages_surveying(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    image: &MetaImage,
    pages: &PageTable,
    damaged: &mut Vec<DamagedPage>,
) -> Result<PagedMaps> {
    read_pages_then(dev, sb, image, pages, |ino, page, end, e| match e {
        Error::Corrupt { .. } => {
            damaged.push(DamagedPage {
                ino,
                page: *page,
                end,
                reason: e.to_string(),
            });
            Ok(())
        }
        e => Err(e),
    })
}

/// Reads `pages` as [`read_pages`] says; a page that fails goes to
/// `failed` (the inode, the page, the next page's first key and the
/// error), which ends the read with an error or leaves the page out.
fn read_pages_then(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    image: &MetaImage,
    pages: &PageTable,
    mut failed: impl FnMut(Ino, &PageRef, Option<u64>, Error) -> Result<()>,
) -> Result<PagedMaps> {
    let mut paged = PagedMaps::default();
    let invalid = |reason: String| Error::invalid("reading extent pages", reason);
    for (ino, list) in pages {
        if image.inodes.binary_search_by_key(ino, |i| i.ino).is_err() {
            return Err(invalid(format!("inode {ino} is not in the image")));
        }
        let mut chunks: Vec<crate::page_chunks::PageChunk> = Vec::with_capacity(list.len());
        let mut list = list.iter().peekable();
        while let Some(page) = list.next() {
            let read = read_page(dev, sb, *ino, page).and_then(|got| {
                let before = chunks.last().and_then(|c| c.extents.last());
                codec::check_extent(&got[0], before)
                    .map_err(|reason| codec::page_lost(*ino, page, page.addr, reason))?;
                Ok(got)
            });
            match read {
                Ok(got) => chunks.push(crate::page_chunks::PageChunk {
                    extents: got,
                    page: Some(*page),
                    starts_run: false,
                }),
                Err(e) => {
                    let end = list.peek().map(|next| next.first_key);
                    failed(*ino, page, end, e)?;
                }
            }
        }
        if !chunks.is_empty() {
            paged.push_file(*ino, chunks).map_err(invalid)?;
        }
    }
    Ok(paged)
}

/// [`read_pages`] without reading a page: each file's chunks absent
/// (`PageChunk::absent`), for mount to read on demand. The root's checks
/// (counts, first keys strictly increasing, pages in the data area) are
/// all a reference allows before its page is read. With `index` (the
/// index pages listing `pages`), each index page's first page starts a
/// run (`PageChunk::starts_run`).
fn absent_pages(image: &MetaImage, pages: &PageTable, index: &IndexTable) -> Result<PagedMaps> {
    let mut paged = PagedMaps::default();
    let invalid = |reason: String| Error::invalid("reading extent pages", reason);
    for (ino, list) in pages {
        if image.inodes.binary_search_by_key(ino, |i| i.ino).is_err() {
            return Err(invalid(format!("inode {ino} is not in the image")));
        }
        let run_pages = match index.binary_search_by_key(ino, |&(i, _)| i) {
            Ok(at) => index[at].1.iter().map(|iref| iref.pages).collect(),
            Err(_) => Vec::new(),
        };
        paged
            .push_listed(*ino, list.clone(), run_pages)
            .map_err(invalid)?;
    }
    paged.share_lists(pages);
    Ok(paged)
}

/// Reads and verifies inode `ino`'s extent page `page`: what
/// `codec::decode_page` checks, and each extent aligned to the block size
/// (as a map's extents must be). A damaged page is `Error::Corrupt` naming
/// the inode, the page's keys and its device byte; a failed read is
/// `Error::Device`.
pub fn read_page(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    ino: Ino,
    page: &PageRef,
) -> Result<Vec<Extent>> {
    let bs = sb.block_size();
    let mut buf = vec![0u8; codec::page_len(page.count as usize, bs) as usize];
    dev.read_at(&mut buf, page.addr).map_err(|e| {
        Error::device(
            format!(
                "reading inode {ino}'s extent page at device byte {}",
                page.addr
            ),
            e,
        )
    })?;
    let got = codec::decode_page(sb.crc_seed(), &buf, ino, page)?;
    if let Some(e) = got
        .iter()
        // A power of two (the superblock checks): a mask, not three
        // divisions per extent.
        .find(|e| (e.file_off | e.len | e.addr) & (bs - 1) != 0)
    {
        return Err(codec::page_lost(
            ino,
            page,
            page.addr,
            format!(
                "its extent at file offset {} is not aligned to the block size {bs}",
                e.file_off
            ),
        ));
    }
    Ok(got)
}

/// Writes `pages` (`(device byte, bytes)`, each from `codec::encode_page`,
/// to blocks no checkpoint lists), then flushes: a root written after it
/// that verifies names pages that are durable.
pub fn write_pages(dev: &dyn BlockDevice, pages: &[(u64, Vec<u8>)]) -> Result<()> {
    write_pages_unflushed(dev, pages)?;
    flush_pages(dev)
}

/// Writes `pages` as [`write_pages`] does, without the flush: a base
/// writes its pages in batches, then flushes once ([`flush_pages`]).
///
/// Pages that follow one another on the device go in one request of up
/// to [`PAGE_WRITE_BYTES`]: a base carves its pages from runs of free
/// space, one after another, and at 50M extents wrote 4,000 pages a
/// request each (a copy into a bounce buffer and a system call each).
pub fn write_pages_unflushed(dev: &dyn BlockDevice, pages: &[(u64, Vec<u8>)]) -> Result<()> {
    let mut order: Vec<&(u64, Vec<u8>)> = pages.iter().collect();
    order.sort_unstable_by_key(|&&(addr, _)| addr);
    let align = (dev.caps().memory_alignment as usize).max(1);
    // One buffer for every joined request of the batch: allocated (and
    // zeroed, and faulted in) once, not per request.
    let most = pages.iter().map(|(_, b)| b.len()).sum::<usize>();
    let mut joined: Option<blockdev::AlignedBuf> = None;
    let mut rest = &order[..];
    while let Some(&&(start, ref first)) = rest.first() {
        let mut end = start + first.len() as u64;
        let mut n = 1;
        while let Some(&&(addr, ref bytes)) = rest.get(n) {
            if addr != end || end - start + bytes.len() as u64 > PAGE_WRITE_BYTES as u64 {
                break;
            }
            end += bytes.len() as u64;
            n += 1;
        }
        let (run, after) = rest.split_at(n);
        rest = after;
        if n > 1 && joined.is_none() {
            joined = blockdev::AlignedBuf::new(most.min(PAGE_WRITE_BYTES), align).ok();
        }
        let failed = |(start, end): (u64, u64)| {
            move |e| {
                Error::device(
                    format!("writing checkpoint pages at device bytes {start}..{end}"),
                    e,
                )
            }
        };
        match joined.as_mut().filter(|_| n > 1) {
            Some(buf) => {
                let mut at = 0;
                for (_, bytes) in run {
                    buf[at..at + bytes.len()].copy_from_slice(bytes);
                    at += bytes.len();
                }
                dev.write_at(&buf[..at], start, WriteMode::Normal)
                    .map_err(failed((start, end)))?;
            }
            // One page; or pages the device's alignment made the joined
            // buffer impossible for: page by page.
            None => {
                for (addr, bytes) in run {
                    let range = (*addr, addr + bytes.len() as u64);
                    dev.write_at(bytes, *addr, WriteMode::Normal)
                        .map_err(failed(range))?;
                }
            }
        }
    }
    Ok(())
}

/// Most bytes of pages [`write_pages_unflushed`] joins in one request.
const PAGE_WRITE_BYTES: usize = 1 << 20;

/// The flush between a base's pages and its root.
pub fn flush_pages(dev: &dyn BlockDevice) -> Result<()> {
    dev.flush()
        .map_err(|e| Error::device("flushing extent pages", e))
}

/// Reads the delta after `chain` in `slot`, checks it links to the chain's
/// last record and applies it to `image` and `paged` (which it leaves as
/// they were on any error). Sets `unapplied` when it verifies but does not
/// decode, or links but does not apply.
fn read_linked_delta(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    chain: &ChainEnd,
    image: &mut MetaImage,
    paged: &mut PagedMaps,
    unapplied: &mut bool,
) -> Result<RawRecord> {
    let offset = chain.next_offset;
    let at = sb.layout.checkpoint_slots[slot].start + offset;
    let raw = read_record(dev, sb, slot, offset, &[DELTA_MAGIC])?;
    // A record whose crc verifies was written whole, and the writer's
    // encoder writes nothing the decoder refuses.
    let (link, delta) = codec::decode_delta_at(&raw.payload, at + CHECKPOINT_HEADER_LEN as u64)
        .inspect_err(|_| *unapplied = true)?;
    let linked = link.prev_generation == chain.generation
        && link.prev_crc == chain.crc
        && raw.header.generation == chain.generation + 1;
    if !linked {
        return Err(Error::corrupt(
            WHAT,
            at,
            format!(
                "slot {slot}: the delta of generation {} at slot byte {offset} follows generation {} (crc {:#010x}), not this chain's generation {} (crc {:#010x}): left from an earlier chain",
                raw.header.generation, link.prev_generation, link.prev_crc, chain.generation, chain.crc
            ),
        ));
    }
    // The chunks the delta's spans reach, read now (the rest stay absent):
    // a delta that links but does not apply is found here, at mount.
    paged
        .load_reached(&delta, |ino, page| read_page(dev, sb, ino, page))
        .map_err(|e| match e {
            Error::Corrupt { offset, reason, .. } => {
                *unapplied = true;
                Error::corrupt(
                    WHAT,
                    offset,
                    format!(
                        "slot {slot}: the delta of generation {} reaches a page that does not \
                         load: {reason}",
                        raw.header.generation
                    ),
                )
            }
            other => other,
        })?;
    apply_delta_over_pages(image, paged, &delta).map_err(|reason| {
        *unapplied = true;
        Error::corrupt(
            WHAT,
            at + CHECKPOINT_HEADER_LEN as u64,
            format!(
                "slot {slot}: the delta of generation {} does not apply to generation {}: {reason}",
                raw.header.generation, chain.generation
            ),
        )
    })?;
    Ok(raw)
}

/// Applies `delta` to `image`: removed inodes go, changed ones replace (or
/// join) theirs, their extents in the delta's key spans replaced by the
/// delta's. Checks everything first and changes nothing on error.
///
/// A large map is changed in place ([`SpanMerge`]): mount applies a chain
/// of deltas to one image, and a copy of the map per delta (a million
/// extents: 32 MB of fresh memory faulted in, then copied) cost more than
/// reading the image.
pub fn apply_delta(image: &mut MetaImage, delta: &MetaDelta) -> std::result::Result<(), String> {
    apply_delta_over_pages(image, &mut PagedMaps::default(), delta)
}

/// How one changed inode's extents change under a delta.
enum Merge {
    /// Its whole map, kept in the image.
    Image(SpanMerge),
    /// Its chunks, kept in a [`PagedMaps`].
    Chunks(ChunkMerge),
}

/// [`apply_delta`] to an image whose files kept in pages have their
/// extents in `paged` (as chunks, not in the image): their extents change
/// there, chunk by chunk, and a removed one leaves it. Checks everything
/// first and changes neither on error.
pub fn apply_delta_over_pages(
    image: &mut MetaImage,
    paged: &mut PagedMaps,
    delta: &MetaDelta,
) -> std::result::Result<(), String> {
    let find =
        |inodes: &[InodeImage], ino| inodes.binary_search_by_key(&ino, |i: &InodeImage| i.ino);
    for &ino in &delta.removed {
        if find(&image.inodes, ino).is_err() {
            return Err(format!("it removes inode {ino}, which is not there"));
        }
    }
    // (position in the image, the new inode without its extents, how its
    // extents change; `None`: it keeps the old ones)
    let mut staged: Vec<(std::result::Result<usize, usize>, InodeImage, Option<Merge>)> =
        Vec::with_capacity(delta.changed.len());
    for (i, c) in delta.changed.iter().enumerate() {
        // Each change is planned against the map as it is now: an inode
        // named twice would have its second plan applied to the first's
        // result.
        if i > 0 && delta.changed[i - 1].inode.ino >= c.inode.ino {
            return Err(format!("changed inode {} is not sorted", c.inode.ino));
        }
        let pos = find(&image.inodes, c.inode.ino);
        let old: &[Extent] = match pos {
            Ok(i) => &image.inodes[i].extents,
            Err(_) => &[],
        };
        // Checked without its extents (the merge checks those), so that a
        // delta costs a pass over its spans, not over a large map.
        let inode = InodeImage {
            extents: Vec::new(),
            ..c.inode.clone()
        };
        codec::check_inode(&inode).map_err(|r| format!("inode {}: {r}", inode.ino))?;
        let (spans, new) = (&c.spans, &c.inode.extents);
        let merge = if spans.is_empty() {
            Ok(None)
        } else {
            match paged.chunks_to_change(inode.ino) {
                None => SpanMerge::plan(old, spans, new).map(|m| Some(Merge::Image(m))),
                Some(chunks) => crate::page_chunks::plan_merge(chunks, spans, new)
                    .map(|m| Some(Merge::Chunks(m))),
            }
        }
        .map_err(|r| format!("inode {}: {r}", inode.ino))?;
        let has_extents = match &merge {
            None => !old.is_empty() || paged.has_extents(inode.ino) == Some(true),
            Some(Merge::Image(m)) => m.merged_len > 0,
            Some(Merge::Chunks(m)) => m.merged_len > 0,
        };
        if has_extents && inode.kind != crate::types::FileKind::Regular {
            return Err(format!("{:?} {} has extents", inode.kind, inode.ino));
        }
        if inode.ino >= delta.next_ino {
            return Err(format!(
                "inode {} is not below next_ino {}",
                inode.ino, delta.next_ino
            ));
        }
        staged.push((pos, inode, merge));
    }
    let removed_or_new = !delta.removed.is_empty() || staged.iter().any(|(p, _, _)| p.is_err());
    let last_kept = image
        .inodes
        .iter()
        .rev()
        .find(|i| delta.removed.binary_search(&i.ino).is_err());
    if let Some(i) = last_kept.filter(|i| i.ino >= delta.next_ino) {
        return Err(format!(
            "inode {} is not below next_ino {}",
            i.ino, delta.next_ino
        ));
    }
    // Checked: from here on nothing fails.
    let mut new = Vec::new();
    for ((pos, mut inode, merge), c) in staged.into_iter().zip(&delta.changed) {
        let mut extents = match pos {
            Ok(i) => std::mem::take(&mut image.inodes[i].extents),
            Err(_) => Vec::new(),
        };
        match merge {
            None => {}
            Some(Merge::Image(merge)) => merge.apply(&mut extents, &c.inode.extents),
            Some(Merge::Chunks(merge)) => paged.apply(inode.ino, merge),
        }
        inode.extents = extents;
        match pos {
            Ok(i) => image.inodes[i] = inode,
            Err(_) => new.push(inode),
        }
    }
    if removed_or_new {
        let old = std::mem::take(&mut image.inodes);
        let mut new = new.into_iter().peekable();
        for inode in old {
            while let Some(n) = new.next_if(|n| n.ino < inode.ino) {
                image.inodes.push(n);
            }
            if delta.removed.binary_search(&inode.ino).is_err() {
                image.inodes.push(inode);
            }
        }
        image.inodes.extend(new);
    }
    paged.remove_files(&delta.removed);
    image.next_ino = delta.next_ino;
    Ok(())
}

/// A durable checkpoint that no longer verifies: the other slot is marked
/// superseded by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostCheckpoint {
    /// Generation of the lost checkpoint, and its slot.
    pub generation: u64,
    pub slot: usize,
    /// Why the slot does not verify.
    pub reason: String,
    /// Generation of the checkpoint that is left (the one marked), and
    /// its slot.
    pub left_generation: u64,
    pub left_slot: usize,
}

impl std::fmt::Display for LostCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "checkpoint generation {} in slot {} was durable and is damaged ({}); \
             slot {} holds generation {}, marked superseded by it: falling back \
             would silently undo the metadata changes of generation {} and of the journal after it",
            self.generation,
            self.slot,
            self.reason,
            self.left_slot,
            self.left_generation,
            self.generation,
        )
    }
}

/// What the two slots hold: the newest valid checkpoint, and whether a newer
/// one was durable and is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewestCheckpoint {
    pub slot: usize,
    /// Where the chain in `slot` ends (what the next delta follows).
    pub chain: ChainEnd,
    pub checkpoint: Checkpoint,
    /// Set when the newest valid checkpoint is marked superseded: the
    /// checkpoint that superseded it is damaged.
    pub lost: Option<LostCheckpoint>,
    /// Per slot, the spill extents of the checkpoint it holds, if that
    /// verifies: the older one is the fallback until the newer is durable,
    /// so both stay in use.
    pub spills: [Vec<SpillExtent>; CHECKPOINT_SLOTS],
    /// With [`INCOMPAT_EXTENT_PAGES`], per slot, the extent pages its
    /// base lists, if it verifies: in use for the same reason. The two
    /// lists share every page neither base rewrote.
    pub pages: [PageTable; CHECKPOINT_SLOTS],
    /// With [`INCOMPAT_PAGE_INDEX`], per slot, the index pages its base
    /// lists (which list `pages`), if it verifies.
    pub index: [IndexTable; CHECKPOINT_SLOTS],
    /// [`SlotContents::paged`] of the newest checkpoint: the extents of
    /// its files kept in pages, which `checkpoint.image` does not hold
    /// ([`read_newest_checkpoint`] puts them there).
    pub paged: PagedMaps,
    /// [`SlotContents::damaged_pages`] of the newest checkpoint.
    pub damaged_pages: Vec<DamagedPage>,
    /// Copies of index pages either slot's root lists that failed where
    /// the other copy verified, each once.
    pub damaged_index_copies: Vec<DamagedIndexCopy>,
}

/// Reads both slots and returns the valid checkpoint with the highest
/// generation, its slot, and (if that slot is marked superseded) the newer
/// checkpoint that was lost. A slot that does not verify is skipped; if
/// neither verifies the error names both reasons. Device errors are returned
/// as they are: a slot that cannot be read might be the newer one. The
/// extents of files kept in extent pages are in [`NewestCheckpoint::paged`],
/// not in the image.
pub fn read_checkpoints(dev: &dyn BlockDevice, sb: &Superblock) -> Result<NewestCheckpoint> {
    read_checkpoints_reading(dev, sb, PageReading::Every)
}

/// How a paged base's pages are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageReading {
    /// Every page read and verified (fsck, and callers wanting an image).
    Every,
    /// None read: each paged file's chunks left absent
    /// ([`crate::page_chunks::PageChunk::absent`]) except those the
    /// chain's deltas reach. The root verified, so its pages were durable
    /// (the flush between them); a page that does not verify later is
    /// damage, found by whoever needs it (mount).
    OnDemand,
    /// Every page read (fsck): one that does not verify is damage to
    /// report, not a reason to give up the slot (mount, reading on
    /// demand, would use it): listed in [`NewestCheckpoint::damaged_pages`]
    /// and its extents left out, the rest checked. Both copies of every
    /// index page are read too.
    Survey,
    /// As [`PageReading::OnDemand`] (no extent page read), but both
    /// copies of every index page read: what fsck's repair of index page
    /// copies needs.
    IndexCopies,
}

/// An extent page that did not verify ([`PageReading::Survey`]): the
/// extents of `ino` from `page.first_key` up to `end` (the next page's
/// first key; `None`: the file's last) are lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DamagedPage {
    pub ino: Ino,
    pub page: PageRef,
    pub end: Option<u64>,
    /// The failure, naming the device byte and why.
    pub reason: String,
}

impl std::fmt::Display for DamagedPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let end = self.end.map_or("its end".to_string(), |e| e.to_string());
        write!(
            f,
            "inode {}: the extent page at device byte {} ({} extents mapping {} bytes, file offsets {}..{end}) does not verify; those extents are lost, and the device space they map is counted free here: {}",
            self.ino,
            self.page.addr,
            self.page.count,
            self.page.allocated,
            self.page.first_key,
            self.reason
        )
    }
}

/// [`read_checkpoints`], reading the newest base's pages as `reading` says.
pub fn read_checkpoints_reading(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    reading: PageReading,
) -> Result<NewestCheckpoint> {
    let mut best: Option<(usize, SlotContents)> = None;
    let mut reasons: Vec<Option<String>> = vec![None; CHECKPOINT_SLOTS];
    let mut spills: [Vec<SpillExtent>; CHECKPOINT_SLOTS] = Default::default();
    let mut pages: [PageTable; CHECKPOINT_SLOTS] = Default::default();
    let mut index: [IndexTable; CHECKPOINT_SLOTS] = Default::default();
    let mut damaged_index_copies: Vec<DamagedIndexCopy> = Vec::new();
    // Both slots' bases list most index pages alike: each is read once,
    // and both tables share its run.
    let mut read = ReadRuns::default();
    let paged = sb.features_incompat & INCOMPAT_EXTENT_PAGES != 0;
    // The slot whose base is newer holds the newer checkpoint whenever it
    // verifies (a base is written one generation past the newest chain's
    // end, and deltas go to the newest chain), so only it is read whole;
    // the other is read whole only if it does not verify. Otherwise only
    // the other's spill table is read (a spilled base is that table), and
    // its whole image is verified only to explain a lost checkpoint: mount
    // never reads two whole images (at a million extents the second one
    // was 28 of mount's 200 ms).
    let mut order: Vec<(Option<BaseHeader>, usize)> = Vec::with_capacity(CHECKPOINT_SLOTS);
    for slot in 0..CHECKPOINT_SLOTS {
        order.push((base_header(dev, sb, slot)?, slot));
    }
    order.sort_by_key(|&(header, slot)| (std::cmp::Reverse(header.map(|h| h.generation)), slot));
    let mut unverified = Vec::new();
    for (header, slot) in order {
        if best.is_some() {
            if paged {
                // Its root, for the pages it lists; not the pages.
                match read_root(dev, sb, slot, reading, &mut read) {
                    Ok((spill, root, listing, damaged)) => {
                        (spills[slot], pages[slot], index[slot]) = (spill, root.pages, listing);
                        damaged_index_copies.extend(damaged);
                    }
                    Err(e @ Error::Corrupt { .. }) => reasons[slot] = Some(e.to_string()),
                    Err(e) => return Err(e),
                }
                continue;
            }
            if header.is_some_and(|h| !h.spilled) {
                unverified.push(slot);
                continue;
            }
            match read_spill_table(dev, sb, slot) {
                Ok(spill) => spills[slot] = spill,
                Err(e @ Error::Corrupt { .. }) => reasons[slot] = Some(e.to_string()),
                Err(e) => return Err(e),
            }
            continue;
        }
        match read_slot_chunks(dev, sb, slot, reading, &mut read) {
            Ok(mut c) => {
                spills[slot].clone_from(&c.spill);
                pages[slot] = std::mem::take(&mut c.pages);
                index[slot] = std::mem::take(&mut c.index);
                damaged_index_copies.append(&mut c.damaged_index_copies);
                best = Some((slot, c));
            }
            Err(e @ Error::Corrupt { .. }) => reasons[slot] = Some(e.to_string()),
            Err(e) => return Err(e),
        }
    }
    let Some((slot, contents)) = best else {
        let both: Vec<String> = reasons
            .iter()
            .enumerate()
            .filter_map(|(slot, r)| r.as_ref().map(|r| format!("slot {slot}: {r}")))
            .collect();
        return Err(Error::corrupt(
            WHAT,
            sb.layout.checkpoint_slots[0].start,
            format!("no valid checkpoint: {}", both.join("; ")),
        ));
    };
    if contents.superseded || contents.unapplied {
        for other in unverified {
            match read_record(dev, sb, other, 0, &base_magics(sb)) {
                Ok(_) => {}
                Err(e @ Error::Corrupt { .. }) => reasons[other] = Some(e.to_string()),
                Err(e) => return Err(e),
            }
        }
    }
    let lost = (contents.superseded || contents.unapplied).then(|| {
        // The next generation was either the next delta in this slot or a
        // base in the other one: blame the other slot if it does not verify.
        let other = other_slot(slot);
        // A next delta whose header is there but does not verify is the
        // likelier loss; either way the reason names both places.
        let delta_there = contents
            .beyond
            .as_ref()
            .is_some_and(|r| contents.unapplied || !r.contains("bad magic"));
        let (lost_slot, reason) = match (&reasons[other], &contents.beyond) {
            (Some(o), Some(b)) => (
                if delta_there { slot } else { other },
                format!("the next delta in slot {slot}: {b}; slot {other}: {o}"),
            ),
            (None, Some(b)) => (slot, b.clone()),
            (Some(o), None) => (other, o.clone()),
            (None, None) => (
                other,
                "it verifies but holds an older generation".to_string(),
            ),
        };
        LostCheckpoint {
            generation: contents.checkpoint.generation + 1,
            slot: lost_slot,
            reason,
            left_generation: contents.checkpoint.generation,
            left_slot: slot,
        }
    });
    Ok(NewestCheckpoint {
        slot,
        chain: contents.chain,
        checkpoint: contents.checkpoint,
        lost,
        spills,
        pages,
        index,
        paged: contents.paged,
        damaged_pages: contents.damaged_pages,
        damaged_index_copies: {
            // Both slots' roots list most index pages: each copy once.
            damaged_index_copies.sort_by_key(|d| d.at);
            damaged_index_copies.dedup_by_key(|d| d.at);
            damaged_index_copies
        },
    })
}

/// Verifies the base record of `slot` on a volume with
/// [`INCOMPAT_EXTENT_PAGES`] and decodes its root (its spilled image read
/// if it is spilled), without reading the extent pages it lists (its
/// index pages are read). Returns the spill extents, the root, its
/// index pages and their copies that failed where the other verified.
fn read_root(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    reading: PageReading,
    read: &mut ReadRuns,
) -> Result<(
    Vec<SpillExtent>,
    codec::Root,
    IndexTable,
    Vec<DamagedIndexCopy>,
)> {
    let base = read_record(dev, sb, slot, 0, &base_magics(sb))?;
    let payload_at = slot_region(sb, slot)?.start + CHECKPOINT_HEADER_LEN as u64;
    if base.magic != SPILLED_MAGIC {
        let (root, index, damaged) = decode_root_listing(
            dev,
            sb,
            &base.payload,
            payload_at,
            "checkpoint root",
            reading,
            read,
        )?;
        return Ok((Vec::new(), root, index, damaged));
    }
    let table = decode_spill_table(sb, &base.payload, payload_at)?;
    let bytes = read_spilled_image(dev, sb, slot, &table, payload_at)?;
    let at = table.extents.first().map_or(payload_at, |e| e.0);
    let (root, index, damaged) = decode_root_listing(
        dev,
        sb,
        &bytes,
        at,
        "spilled checkpoint root",
        reading,
        read,
    )?;
    Ok((table.extents, root, index, damaged))
}

/// [`read_checkpoints`], refusing (as [`Error::Corrupt`]) a volume whose
/// newest durable checkpoint is lost; the image is whole.
pub fn read_newest_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
) -> Result<(usize, Checkpoint)> {
    let mut newest = read_checkpoints(dev, sb)?;
    if let Some(lost) = newest.lost {
        return Err(lost_error(sb, &lost));
    }
    newest
        .paged
        .fill_image(&mut newest.checkpoint.image)
        .map_err(|reason| Error::invalid("reading extent pages", reason))?;
    Ok((newest.slot, newest.checkpoint))
}

/// The error mount gives for a lost checkpoint.
pub fn lost_error(sb: &Superblock, lost: &LostCheckpoint) -> Error {
    Error::corrupt(
        WHAT,
        sb.layout.checkpoint_slots[lost.slot.min(CHECKPOINT_SLOTS - 1)].start,
        format!("{lost}; refusing to mount (`iomapfs fsck` shows what is left)"),
    )
}

/// Marks the checkpoint of `generation`, the record at byte `offset` of
/// `slot`, superseded, once the checkpoint of `generation + 1` is durable
/// (after it in the slot, or in the other slot): rewrites the record's first
/// logical sector with the mark set, then flushes. Only that sector is
/// written, and its other bytes are unchanged, so a torn mark write cannot
/// damage the record (a delta after it still needs it). Does nothing if the
/// record is not that generation's (e.g. it was invalid at mount) or the
/// volume keeps no marks.
pub fn mark_superseded(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    offset: u64,
    generation: u64,
) -> Result<()> {
    if sb.features_compat & COMPAT_SUPERSEDE_MARKS == 0 {
        return Ok(());
    }
    let region = slot_region(sb, slot)?;
    let sector = (dev.caps().logical_block_size as usize).clamp(OFF_CRC, sb.block_size() as usize);
    let mut head = vec![0u8; sector];
    let at = region.start + offset;
    dev.read_at(&mut head, at).map_err(|e| {
        Error::device(
            format!("reading checkpoint slot {slot} at slot byte {offset} to mark it superseded"),
            e,
        )
    })?;
    let held = u64::from_le_bytes(
        head[OFF_GENERATION..OFF_GENERATION + 8]
            .try_into()
            .unwrap_or_default(),
    );
    let magic = &head[OFF_MAGIC..OFF_MAGIC + 8];
    let expected: &[[u8; 8]] = if offset == 0 {
        &[CHECKPOINT_MAGIC, SPILLED_MAGIC]
    } else {
        &[DELTA_MAGIC]
    };
    if !expected.iter().any(|m| m == magic) || held != generation {
        return Ok(());
    }
    let mark = supersede_mark(sb, generation);
    head[OFF_SUPERSEDED..OFF_SUPERSEDED + 4].copy_from_slice(&mark.to_le_bytes());
    dev.write_at(&head, at, WriteMode::Normal)
        .map_err(|e| Error::device(format!("marking checkpoint slot {slot} superseded"), e))?;
    dev.flush().map_err(|e| {
        Error::device(
            format!("flushing checkpoint slot {slot}'s supersede mark"),
            e,
        )
    })
}

/// Makes `slot` hold no checkpoint (zeroes its first block), then flushes.
pub fn invalidate_slot(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<()> {
    let region = slot_region(sb, slot)?;
    let zeros = vec![0u8; sb.block_size() as usize];
    dev.write_at(&zeros, region.start, WriteMode::Normal)
        .map_err(|e| Error::device(format!("invalidating checkpoint slot {slot}"), e))?;
    dev.flush()
        .map_err(|e| Error::device(format!("flushing checkpoint slot {slot}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::random_image;
    use crate::superblock::test_device::VecDevice;
    use crate::superblock::Layout;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    const DEV_BYTES: u64 = 4 << 20;

    fn setup() -> (VecDevice, Superblock) {
        let dev = VecDevice::new(DEV_BYTES, 512);
        let sb = Superblock::new(Layout::compute(DEV_BYTES, 512, 4096, None, None).unwrap());
        (dev, sb)
    }

    fn ckpt(generation: u64, inodes: usize) -> Checkpoint {
        let mut rng = SmallRng::seed_from_u64(generation);
        Checkpoint {
            generation,
            journal_start: 4096 * generation,
            journal_seq: 100 + generation,
            journal_chain: 7 * generation as u32,
            image: random_image(&mut rng, inodes),
        }
    }

    fn slot_start(sb: &Superblock, slot: usize) -> u64 {
        sb.layout.checkpoint_slots[slot].start
    }

    /// Pages that follow one another on the device go in one request (up
    /// to `PAGE_WRITE_BYTES`), in any order given; others apart; every
    /// byte lands where its page says.
    #[test]
    fn pages_that_follow_one_another_go_in_one_request() {
        let dev = VecDevice::new(DEV_BYTES, 512);
        let page = |addr: u64, blocks: usize| (addr, vec![(addr / 4096) as u8; blocks * 4096]);
        // 0x10000.. three pages (one of two blocks), given out of order;
        // then one apart; then enough to pass the request limit.
        let limit_pages = PAGE_WRITE_BYTES / 4096;
        let mut pages = vec![page(0x12000, 1), page(0x10000, 1), page(0x11000, 1)];
        pages[0].1.resize(2 * 4096, 0x12);
        pages.push(page(0x20000, 1));
        pages.extend((0..limit_pages + 1).map(|i| page(0x100000 + 4096 * i as u64, 1)));
        let before = dev.counters().snapshot().writes;
        write_pages_unflushed(&dev, &pages).unwrap();
        assert_eq!(
            dev.counters().snapshot().writes - before,
            4,
            "the three following pages, the one apart, and the long run in two"
        );
        for (addr, bytes) in &pages {
            let mut got = vec![0; bytes.len()];
            dev.read_at(&mut got, *addr).unwrap();
            assert_eq!(&got, bytes, "page at {addr:#x}");
        }
    }

    #[test]
    fn alternate_writes_pick_the_newest() {
        let (dev, sb) = setup();
        assert!(read_newest_checkpoint(&dev, &sb).is_err());
        let c1 = ckpt(1, 3);
        write_checkpoint(&dev, &sb, 0, &c1).unwrap();
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (0, c1.clone()));
        let c2 = ckpt(2, 300);
        assert!(encoded_len(&c2.image) > 4096, "spans several blocks");
        write_checkpoint(&dev, &sb, 1, &c2).unwrap();
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (1, c2.clone()));
        let c3 = ckpt(3, 10);
        write_checkpoint(&dev, &sb, 0, &c3).unwrap();
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (0, c3));
        assert_eq!(read_checkpoint(&dev, &sb, 1).unwrap(), c2);
        assert!(read_checkpoint(&dev, &sb, 2).is_err());
    }

    /// Mount reads the newer slot's image and only the header of the
    /// older slot's whole image: reading both cost 28 of 200 ms at a
    /// million extents.
    #[test]
    fn the_older_whole_image_is_not_read() {
        let (dev, sb) = setup();
        let (c1, c2) = (ckpt(1, 300), ckpt(2, 300));
        write_checkpoint(&dev, &sb, 0, &c1).unwrap();
        write_checkpoint(&dev, &sb, 1, &c2).unwrap();
        let before = dev.counters().snapshot();
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, &newest.checkpoint), (1, &c2));
        let read = dev.counters().snapshot().since(&before).bytes_read;
        let image = encoded_len(&c2.image);
        assert!(
            read < image + encoded_len(&c1.image) / 2,
            "read {read} bytes for an image of {image}"
        );
    }

    /// The older slot's image is verified when the newest checkpoint is
    /// marked superseded, so that the loss names why the older slot does
    /// not hold the next one.
    #[test]
    fn a_superseded_newest_reports_why_the_older_slot_is_unusable() {
        let (dev, sb) = setup();
        let (c1, c2) = (ckpt(1, 300), ckpt(2, 300));
        write_checkpoint(&dev, &sb, 0, &c1).unwrap();
        write_checkpoint(&dev, &sb, 1, &c2).unwrap();
        mark_superseded(&dev, &sb, 1, 0, 2).unwrap();
        // The older slot's header still names generation 1: only its image
        // is damaged.
        dev.flip(slot_start(&sb, 0) + encoded_len(&c1.image) / 2);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, &newest.checkpoint), (1, &c2));
        let lost = newest.lost.expect("generation 3 was durable");
        assert_eq!((lost.generation, lost.slot), (3, 0));
        assert!(lost.reason.contains("crc32c"), "{}", lost.reason);
    }

    /// The merge a delta applies, in place, against the obvious one on a
    /// sorted map: old extents (one block each, at even blocks) minus the
    /// keys in the spans, plus new ones in the spans (as the delta decoder
    /// guarantees; one or two blocks long, so that some overlap a kept
    /// extent, which must be refused).
    #[test]
    fn span_merge_in_place_matches_a_sorted_map() {
        use proptest::prelude::*;
        use std::collections::BTreeMap;
        let extent = |b: u64, blocks: u64, addr: u64| Extent {
            file_off: b * 4096,
            len: blocks * 4096,
            addr: addr * 4096,
            state: crate::types::ExtentState::Written,
        };
        let strategy = (
            prop::collection::btree_set(0..120u64, 0..60),
            prop::collection::btree_set(0..130u64, 0..24),
            prop::collection::btree_set(0..130u64, 0..40),
        );
        proptest!(|((old_blocks, cuts, new_blocks) in strategy)| {
            let old: Vec<Extent> = old_blocks.iter().map(|&b| extent(b * 2, 1, b)).collect();
            let cuts: Vec<u64> = cuts.into_iter().collect();
            let spans: Vec<crate::types::KeySpan> = cuts
                .chunks_exact(2)
                .map(|p| (p[0] * 4096, p[1] * 4096))
                .collect();
            let in_spans = |e: &Extent| spans.iter().any(|&(a, b)| (a..b).contains(&e.file_off));
            let mut new: Vec<Extent> = Vec::new();
            for &b in &new_blocks {
                let e = extent(b, 1 + b % 2, 1000 + b);
                if in_spans(&e) && new.last().is_none_or(|p: &Extent| p.file_end() <= e.file_off) {
                    new.push(e);
                }
            }
            let kept: BTreeMap<u64, Extent> = old
                .iter()
                .filter(|e| !in_spans(e))
                .map(|e| (e.file_off, *e))
                .collect();
            let mut model = kept.clone();
            model.extend(new.iter().map(|e| (e.file_off, *e)));
            let merged: Vec<Extent> = model.into_values().collect();
            let valid = merged.windows(2).all(|w| w[0].file_end() <= w[1].file_off);
            match SpanMerge::plan(&old, &spans, &new) {
                Ok(merge) => {
                    prop_assert!(valid, "an overlapping delta was planned");
                    let mut extents = old.clone();
                    merge.apply(&mut extents, &new);
                    prop_assert_eq!(extents, merged);
                }
                Err(_) => prop_assert!(!valid, "a valid delta was refused"),
            }
        });
    }

    /// A record without room for its header is an argument error, not a
    /// panic, and writes nothing.
    #[test]
    fn a_record_without_header_room_is_refused() {
        let (dev, sb) = setup();
        let header = RecordHeader::of(&ckpt(1, 1));
        let before = dev.counters().snapshot();
        let short = vec![0u8; CHECKPOINT_HEADER_LEN - 1];
        let err = write_base_record(&dev, &sb, 0, header, short.clone(), &[]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let mut spilled = sb.clone();
        spilled.features_incompat |= INCOMPAT_SPILLED_CHECKPOINTS;
        let err =
            write_spilled_base_record(&dev, &spilled, 0, header, &short, &[], &[]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert_eq!(dev.counters().snapshot().since(&before).writes, 0);
    }

    #[test]
    fn damaged_newest_falls_back_to_older() {
        let (dev, sb) = setup();
        let c1 = ckpt(1, 5);
        let c2 = ckpt(2, 300);
        write_checkpoint(&dev, &sb, 0, &c1).unwrap();
        write_checkpoint(&dev, &sb, 1, &c2).unwrap();
        let len = encoded_len(&c2.image);
        // A garbled byte anywhere in header or image.
        for off in [
            0,
            OFF_GENERATION as u64,
            OFF_IMAGE_LEN as u64,
            60,
            len / 2,
            len - 1,
        ] {
            let snapshot = dev.with_bytes(|b| b.clone());
            dev.flip(slot_start(&sb, 1) + off);
            assert_eq!(
                read_newest_checkpoint(&dev, &sb).unwrap(),
                (0, c1.clone()),
                "offset {off}"
            );
            dev.with_bytes(|b| *b = snapshot);
        }
        // A torn write: the first block of the new image reached the disk,
        // the rest still holds the previous contents of the slot.
        let c3 = ckpt(3, 300);
        let snapshot = dev.with_bytes(|b| b.clone());
        write_checkpoint(&dev, &sb, 0, &c3).unwrap();
        let start = slot_start(&sb, 0) as usize;
        dev.with_bytes(|b| {
            b[start + 4096..start + len as usize + 4096]
                .copy_from_slice(&snapshot[start + 4096..start + len as usize + 4096])
        });
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (1, c2));
    }

    /// Once generation 2 is durable and slot 0 (generation 1) is marked,
    /// damage to generation 2 is reported as a lost checkpoint instead of
    /// a fallback; a torn write of a checkpoint (no mark yet) still falls
    /// back silently.
    #[test]
    fn supersede_mark_tells_damage_from_a_torn_write() {
        let (dev, sb) = setup();
        assert_ne!(sb.features_compat & COMPAT_SUPERSEDE_MARKS, 0);
        let (c1, c2) = (ckpt(1, 5), ckpt(2, 300));
        write_checkpoint(&dev, &sb, 0, &c1).unwrap();
        write_checkpoint(&dev, &sb, 1, &c2).unwrap();
        // Torn: generation 2 does not verify, slot 0 is not marked yet.
        let snapshot = dev.with_bytes(|b| b.clone());
        dev.flip(slot_start(&sb, 1) + 200);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, newest.lost), (0, None));
        dev.with_bytes(|b| *b = snapshot);

        mark_superseded(&dev, &sb, 0, 0, 1).unwrap();
        let marked = read_slot(&dev, &sb, 0).unwrap();
        assert!(marked.superseded);
        assert_eq!(marked.checkpoint, c1, "the mark leaves the slot verifying");
        assert!(!read_slot(&dev, &sb, 1).unwrap().superseded);
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (1, c2.clone()));
        // Marking a slot that does not hold the generation does nothing.
        let before = dev.with_bytes(|b| b.clone());
        mark_superseded(&dev, &sb, 1, 0, 7).unwrap();
        assert!(dev.with_bytes(|b| *b == before));

        let snapshot = dev.with_bytes(|b| b.clone());
        dev.flip(slot_start(&sb, 1) + 200);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, &newest.checkpoint), (0, &c1));
        let lost = newest.lost.unwrap();
        assert_eq!(
            (lost.generation, lost.slot, lost.left_generation),
            (2, 1, 1)
        );
        assert!(lost.reason.contains("crc32c"), "{}", lost.reason);
        let err = read_newest_checkpoint(&dev, &sb).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("generation 2"), "{err}");
        dev.with_bytes(|b| *b = snapshot);

        // Writing generation 3 over the marked slot clears the mark; a
        // torn generation 3 leaves generation 2, unmarked: no damage.
        write_checkpoint(&dev, &sb, 0, &ckpt(3, 5)).unwrap();
        assert!(!read_slot(&dev, &sb, 0).unwrap().superseded);
        dev.flip(slot_start(&sb, 0) + 100);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, newest.lost), (1, None));

        // A mark that is not the slot's generation's is damage to the slot.
        dev.with_bytes(|b| {
            let at = slot_start(&sb, 1) as usize + OFF_SUPERSEDED;
            b[at..at + 4].copy_from_slice(&supersede_mark(&sb, 1).to_le_bytes());
        });
        let err = read_checkpoint(&dev, &sb, 1).unwrap_err();
        assert!(err.to_string().contains("supersede mark"), "{err}");
    }

    /// A volume without the feature keeps the field zero and refuses
    /// anything else, as version 2 did.
    #[test]
    fn no_marks_without_the_feature() {
        let (dev, mut sb) = setup();
        sb.features_compat &= !COMPAT_SUPERSEDE_MARKS;
        write_checkpoint(&dev, &sb, 0, &ckpt(1, 5)).unwrap();
        write_checkpoint(&dev, &sb, 1, &ckpt(2, 5)).unwrap();
        let before = dev.counters().snapshot();
        mark_superseded(&dev, &sb, 0, 0, 1).unwrap();
        assert_eq!(dev.counters().snapshot(), before);
        dev.with_bytes(|b| {
            let at = slot_start(&sb, 0) as usize + OFF_SUPERSEDED;
            b[at..at + 4].copy_from_slice(&supersede_mark(&sb, 1).to_le_bytes());
        });
        let err = read_checkpoint(&dev, &sb, 0).unwrap_err();
        assert!(err.to_string().contains("reserved field"), "{err}");
    }

    #[test]
    fn both_bad_is_an_error_naming_both() {
        let (dev, sb) = setup();
        write_checkpoint(&dev, &sb, 0, &ckpt(1, 5)).unwrap();
        write_checkpoint(&dev, &sb, 1, &ckpt(2, 5)).unwrap();
        dev.flip(slot_start(&sb, 0) + 100);
        invalidate_slot(&dev, &sb, 1).unwrap();
        let err = read_newest_checkpoint(&dev, &sb).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Corrupt { .. }));
        assert!(msg.contains("slot 0") && msg.contains("crc32c"), "{msg}");
        assert!(msg.contains("slot 1") && msg.contains("bad magic"), "{msg}");
    }

    #[test]
    fn slots_of_an_earlier_format_never_verify() {
        let (dev, sb) = setup();
        write_checkpoint(&dev, &sb, 0, &ckpt(1, 5)).unwrap();
        let again = Superblock::new(sb.layout.clone());
        let err = read_checkpoint(&dev, &again, 0).unwrap_err();
        assert!(err.to_string().contains("crc32c mismatch"), "{err}");
    }

    #[test]
    fn too_big_is_refused_without_writing() {
        let dev = VecDevice::new(DEV_BYTES, 512);
        let layout = Layout::compute(DEV_BYTES, 512, 512, None, Some(2 * 512)).unwrap();
        let sb = Superblock::new(layout);
        let c = Checkpoint {
            journal_start: 0,
            ..ckpt(1, 200)
        };
        assert!(encoded_len(&c.image) > slot_capacity(&sb));
        let before = dev.counters().snapshot();
        let err = write_checkpoint(&dev, &sb, 0, &c).unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert_eq!(dev.counters().snapshot(), before);
        // A bad journal start is refused too.
        let c = Checkpoint {
            journal_start: sb.layout.journal.len,
            ..ckpt(1, 0)
        };
        assert!(write_checkpoint(&dev, &sb, 0, &c).is_err());
    }

    #[test]
    fn hostile_header_fields() {
        let (dev, sb) = setup();
        write_checkpoint(&dev, &sb, 0, &ckpt(1, 5)).unwrap();
        let start = slot_start(&sb, 0) as usize;
        // Huge image length: refused before any allocation.
        dev.with_bytes(|b| {
            b[start + OFF_IMAGE_LEN..start + OFF_IMAGE_LEN + 8]
                .copy_from_slice(&u64::MAX.to_le_bytes())
        });
        let err = read_checkpoint(&dev, &sb, 0).unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
        // Random garbage slots never panic.
        let mut rng = SmallRng::seed_from_u64(9);
        for _ in 0..200 {
            dev.with_bytes(|b| {
                use rand::Rng;
                for x in &mut b[start..start + 8192] {
                    *x = rng.gen();
                }
                b[start..start + 8].copy_from_slice(&CHECKPOINT_MAGIC);
            });
            assert!(read_checkpoint(&dev, &sb, 0).is_err());
        }
    }

    /// A device whose slots are 2 blocks (8 KiB), so a few hundred inodes
    /// spill.
    fn small_slots() -> (VecDevice, Superblock) {
        let dev = VecDevice::new(DEV_BYTES, 512);
        let layout = Layout::compute(DEV_BYTES, 512, 4096, None, Some(2 * 4096)).unwrap();
        (dev, Superblock::new(layout))
    }

    /// Spill extents for `image_len` bytes: three pieces, not in address
    /// order, from the middle of the data area.
    fn spill_for(sb: &Superblock, image_len: u64) -> Vec<SpillExtent> {
        let total = spill_bytes(sb, image_len);
        let bs = sb.block_size();
        let first = (total / bs / 3).max(1) * bs;
        let second = (total - first) / bs / 2 * bs;
        let third = total - first - second;
        let base = sb.layout.data.start + 64 * bs;
        vec![
            (base + 4 * total, first),
            (base, second),
            (base + 2 * total, third),
        ]
        .into_iter()
        .filter(|e| e.1 > 0)
        .collect()
    }

    /// [`spill_for`], placed clear of the extents it gives for an image of
    /// up to 8 times the size (the other slot's image).
    fn spill_clear_of_the_first(sb: &Superblock, image_len: u64) -> Vec<SpillExtent> {
        let shift = 8 * spill_bytes(sb, image_len);
        spill_for(sb, image_len)
            .into_iter()
            .map(|(a, l)| (a + shift, l))
            .collect()
    }

    /// An image too large for its slot round-trips through spill extents,
    /// deltas chain after its table in the slot, and both slots' spill
    /// extents are reported.
    #[test]
    fn a_spilled_base_round_trips_and_chains_deltas() {
        let (dev, sb) = small_slots();
        let c1 = Checkpoint {
            image: image(1, 200),
            ..ckpt(1, 0)
        };
        let len = codec::image_encoded_len(&c1.image);
        assert!(must_spill(&sb, len), "{len} bytes fit the slot");
        assert!(
            write_base(&dev, &sb, 0, &c1).is_err(),
            "too big for the slot"
        );
        let spill = spill_for(&sb, len);
        assert!(spill.len() >= 2);
        let chain = write_spilled_base(&dev, &sb, 0, &c1, &spill).unwrap();
        assert_eq!(chain.base_bytes, CHECKPOINT_HEADER_LEN as u64 + len);
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!(
            (&got.checkpoint, &got.spill, got.chain),
            (&c1, &spill, chain)
        );
        // The mark goes on a spilled base too, and leaves it verifying.
        mark_superseded(&dev, &sb, 0, 0, 1).unwrap();
        let marked = read_slot(&dev, &sb, 0).unwrap();
        assert!(marked.superseded);
        assert_eq!(marked.checkpoint, c1);
        // A small delta goes after the table, inside the slot.
        let mut i2 = c1.image.clone();
        i2.inodes.pop();
        let chain2 =
            write_delta(&dev, &sb, 0, &chain, &delta_ckpt(2, &c1.image, &i2), &[]).unwrap();
        assert!(chain2.next_offset <= slot_capacity(&sb));
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!((&got.checkpoint.image, got.chain), (&i2, chain2));
        assert_eq!(got.spill, spill);
        let c3 = Checkpoint {
            image: image(3, 300),
            ..ckpt(3, 0)
        };
        let len3 = codec::image_encoded_len(&c3.image);
        let spill3 = spill_clear_of_the_first(&sb, len3);
        write_spilled_base(&dev, &sb, 1, &c3, &spill3).unwrap();
        let before = dev.counters().snapshot();
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, &newest.checkpoint), (1, &c3));
        // The older slot's spill extents are known from its table alone:
        // its image is not read.
        let read = dev.counters().snapshot().bytes_read - before.bytes_read;
        assert!(
            read < spill_bytes(&sb, len3) + 8 * sb.block_size(),
            "read {read} bytes for a {len3}-byte image and an older one of {len}"
        );
        assert_eq!(newest.spills, [spill.clone(), spill3]);
    }

    /// A spilled image damaged or torn anywhere (its extents, or the slot
    /// record listing them) does not verify, and mount falls back to the
    /// other slot: never a mix of old and new.
    #[test]
    fn a_torn_spilled_image_falls_back() {
        let (dev, sb) = small_slots();
        let c1 = Checkpoint {
            image: image(1, 200),
            ..ckpt(1, 0)
        };
        let spill1 = spill_for(&sb, codec::image_encoded_len(&c1.image));
        write_spilled_base(&dev, &sb, 0, &c1, &spill1).unwrap();
        let c2 = Checkpoint {
            image: image(2, 250),
            ..ckpt(2, 0)
        };
        let len2 = codec::image_encoded_len(&c2.image);
        let spill2 = spill_clear_of_the_first(&sb, len2);
        let before = dev.with_bytes(|b| b.clone());
        write_spilled_base(&dev, &sb, 1, &c2, &spill2).unwrap();
        let after = dev.with_bytes(|b| b.clone());
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (1, c2.clone()));
        // Each piece of the new checkpoint alone, and all but each piece.
        let slot1 = slot_start(&sb, 1);
        let mut pieces: Vec<(u64, u64)> = spill2.clone();
        pieces.push((slot1, 4096));
        for (i, &(addr, len)) in pieces.iter().enumerate() {
            for only in [true, false] {
                dev.with_bytes(|b| {
                    *b = if only { before.clone() } else { after.clone() };
                    let src = if only { &after } else { &before };
                    let r = addr as usize..(addr + len) as usize;
                    b[r.clone()].copy_from_slice(&src[r]);
                });
                let (slot, got) = read_newest_checkpoint(&dev, &sb).unwrap();
                assert_eq!((slot, &got), (0, &c1), "piece {i}, only={only}");
            }
        }
        dev.with_bytes(|b| *b = after.clone());
        dev.flip(spill2[1].0 + 17);
        let err = read_slot(&dev, &sb, 1).unwrap_err();
        assert!(err.to_string().contains("spilled image crc32c"), "{err}");
    }

    /// Forged spill tables (crc recomputed, so only the table's own checks
    /// stand): each is refused with a reason naming the problem, and no
    /// count makes the reader allocate before checking it.
    #[test]
    fn forged_spill_tables_are_refused() {
        let (dev, sb) = small_slots();
        let bs = sb.block_size();
        let data = sb.layout.data;
        let header = RecordHeader {
            generation: 1,
            journal_start: 0,
            journal_seq: 1,
            journal_chain: 0,
        };
        let table = |image_len: u64, count: u32, extents: &[SpillExtent]| {
            let mut enc = Encoder::with_capacity(64);
            enc.u64(image_len);
            enc.u32(0);
            enc.u32(count);
            for &(a, l) in extents {
                enc.u64(a);
                enc.u64(l);
            }
            enc.into_bytes()
        };
        let ok = data.start + 8 * bs;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (table(bs, 1, &[(0, bs)]), "data area"),
            (table(bs, 1, &[(sb.layout.journal.start, bs)]), "data area"),
            (table(bs, 1, &[(slot_start(&sb, 1), bs)]), "data area"),
            (table(bs, 1, &[(data.start + data.len, bs)]), "data area"),
            (table(bs, 1, &[(u64::MAX - bs + 1, bs)]), "data area"),
            (table(bs, 1, &[(ok + 1, bs)]), "aligned"),
            (table(bs, 1, &[(ok, 0)]), "non-empty"),
            (table(2 * bs, 2, &[(ok, 2 * bs), (ok + bs, bs)]), "not the"),
            (table(3 * bs, 2, &[(ok, 2 * bs), (ok + bs, bs)]), "overlap"),
            (table(bs, u32::MAX, &[(ok, bs)]), "do not fill"),
            (table(bs, 2, &[(ok, bs)]), "do not fill"),
            (table(u64::MAX, 1, &[(ok, bs)]), "not the"),
            (table(data.len * 2, 1, &[(data.start, data.len)]), "not the"),
        ];
        for (i, (payload, why)) in cases.into_iter().enumerate() {
            write_record(&dev, &sb, 0, 0, &SPILLED_MAGIC, &header, &payload, &[]).unwrap();
            let err = read_slot(&dev, &sb, 0).unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "case {i}: {err}");
            assert!(err.to_string().contains(why), "case {i}: {err}");
        }
        // A table that checks out but whose image crc does not match.
        let payload = table(bs, 1, &[(ok, bs)]);
        write_record(&dev, &sb, 0, 0, &SPILLED_MAGIC, &header, &payload, &[]).unwrap();
        let err = read_slot(&dev, &sb, 0).unwrap_err();
        assert!(err.to_string().contains("spilled image crc32c"), "{err}");
        // Without the feature, a spilled base is no checkpoint at all.
        let mut old = sb.clone();
        old.features_incompat &= !INCOMPAT_SPILLED_CHECKPOINTS;
        let err = read_slot(&dev, &old, 0).unwrap_err();
        assert!(err.to_string().contains("bad magic"), "{err}");
    }

    /// The delta from `a` to `b`, every changed inode written whole.
    fn whole_delta(a: &MetaImage, b: &MetaImage) -> MetaDelta {
        let find = |img: &MetaImage, ino| img.inodes.iter().find(|i| i.ino == ino).cloned();
        MetaDelta {
            next_ino: b.next_ino,
            removed: a
                .inodes
                .iter()
                .filter(|i| find(b, i.ino).is_none())
                .map(|i| i.ino)
                .collect(),
            changed: b
                .inodes
                .iter()
                .filter(|i| find(a, i.ino).as_ref() != Some(*i))
                .map(|i| crate::types::InodeDelta {
                    spans: vec![(0, u64::MAX)],
                    inode: i.clone(),
                })
                .collect(),
        }
    }

    /// `ckpt(generation, inodes)`'s image, with a next inode number every
    /// image of these tests shares (it never goes down on a volume).
    fn image(generation: u64, inodes: usize) -> MetaImage {
        MetaImage {
            next_ino: 10_000,
            ..ckpt(generation, inodes).image
        }
    }

    /// The base of generation 1 the chain tests start from.
    fn base1() -> Checkpoint {
        Checkpoint {
            image: image(1, 20),
            ..ckpt(1, 0)
        }
    }

    fn delta_ckpt(generation: u64, from: &MetaImage, to: &MetaImage) -> DeltaCheckpoint {
        let c = ckpt(generation, 0);
        DeltaCheckpoint {
            generation,
            journal_start: c.journal_start,
            journal_seq: c.journal_seq,
            journal_chain: c.journal_chain,
            delta: whole_delta(from, to),
        }
    }

    /// The free-space hint after a record: it round-trips for the chain's
    /// last record (base, then delta, whose write replaces the base's),
    /// a reader of the chain takes its block for the chain's end (as code
    /// that does not know it would), any flipped byte of it drops it
    /// (never a changed range), and a volume without the compat bit
    /// writes and reads none.
    #[test]
    fn free_space_hint_round_trip_and_damage() {
        let (dev, sb) = setup();
        assert_ne!(sb.features_compat & COMPAT_CHECKPOINT_FREE_HINT, 0);
        let hint = vec![(1 << 20, 64 << 10), (3 << 20, 4096)];
        let c1 = ckpt(1, 3);
        let record = codec::encode_image_after(CHECKPOINT_HEADER_LEN, &c1.image).unwrap();
        let chain = write_base_record(&dev, &sb, 0, RecordHeader::of(&c1), record, &hint).unwrap();
        assert_eq!(read_free_hint(&dev, &sb, 0, &chain).unwrap(), hint);
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!((&got.checkpoint, got.chain), (&c1, chain));
        assert!(
            got.beyond.as_ref().is_some_and(|b| b.contains("bad magic")),
            "{:?}",
            got.beyond
        );

        let mut i2 = c1.image.clone();
        i2.inodes.pop();
        let delta_hint = vec![(2 << 20, 8192)];
        let chain2 = write_delta(
            &dev,
            &sb,
            0,
            &chain,
            &delta_ckpt(2, &c1.image, &i2),
            &delta_hint,
        )
        .unwrap();
        assert_eq!(read_free_hint(&dev, &sb, 0, &chain2).unwrap(), delta_hint);
        // Where the base's hint was, the delta: the base's hint is gone.
        assert!(read_free_hint(&dev, &sb, 0, &chain).unwrap().is_empty());
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!((&got.checkpoint.image, got.chain), (&i2, chain2));
        // Tied to its record: another generation or crc reads none.
        for other in [
            ChainEnd {
                generation: 3,
                ..chain2
            },
            ChainEnd {
                crc: chain2.crc ^ 1,
                ..chain2
            },
        ] {
            assert!(read_free_hint(&dev, &sb, 0, &other).unwrap().is_empty());
        }

        let at = slot_start(&sb, 0) + chain2.next_offset;
        // Header, count, ranges, crc.
        let hint_len = (FREE_HINT_HEADER_LEN + 4 + delta_hint.len() * 16 + 4) as u64;
        for i in 0..hint_len {
            dev.flip(at + i);
            let got = read_free_hint(&dev, &sb, 0, &chain2).unwrap();
            assert!(got.is_empty(), "byte {i}: {got:?}");
            dev.flip(at + i);
        }
        assert_eq!(read_free_hint(&dev, &sb, 0, &chain2).unwrap(), delta_hint);

        let (dev, mut sb) = setup();
        sb.features_compat &= !COMPAT_CHECKPOINT_FREE_HINT;
        let record = codec::encode_image_after(CHECKPOINT_HEADER_LEN, &c1.image).unwrap();
        let chain = write_base_record(&dev, &sb, 0, RecordHeader::of(&c1), record, &hint).unwrap();
        let at = (slot_start(&sb, 0) + chain.next_offset) as usize;
        assert!(
            dev.with_bytes(|b| b[at..at + 4096].iter().all(|&x| x == 0)),
            "no hint block without the bit"
        );
        assert!(read_free_hint(&dev, &sb, 0, &chain).unwrap().is_empty());
    }

    /// A base and two deltas: the slot's checkpoint is the last delta's
    /// state and journal position; a damaged last delta ends the chain
    /// before it.
    #[test]
    fn deltas_chain_after_the_base() {
        let (dev, sb) = setup();
        let c1 = base1();
        let (i2, i3) = (image(2, 25), image(3, 10));
        let chain1 = write_base(&dev, &sb, 0, &c1).unwrap();
        let chain2 =
            write_delta(&dev, &sb, 0, &chain1, &delta_ckpt(2, &c1.image, &i2), &[]).unwrap();
        let chain3 = write_delta(&dev, &sb, 0, &chain2, &delta_ckpt(3, &i2, &i3), &[]).unwrap();
        assert_eq!((chain3.deltas, chain3.last_offset), (2, chain2.next_offset));
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!(
            got.checkpoint,
            Checkpoint {
                image: i3,
                ..ckpt(3, 0)
            }
        );
        assert_eq!(got.chain, chain3);
        assert!(!got.superseded);
        assert!(got.beyond.unwrap().contains("bad magic"));
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap().1.generation, 3);
        dev.flip(slot_start(&sb, 0) + chain2.next_offset + 60);
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!(
            got.checkpoint,
            Checkpoint {
                image: i2,
                ..ckpt(2, 0)
            }
        );
        assert_eq!(got.chain, chain2);
        assert!(got.beyond.unwrap().contains("crc32c"));
    }

    /// A new base over a slot whose old chain is longer: the old deltas
    /// after it verify but do not link, and are not applied.
    #[test]
    fn a_delta_left_from_an_earlier_chain_is_not_applied() {
        let (dev, sb) = setup();
        let c1 = base1();
        let chain = write_base(&dev, &sb, 0, &c1).unwrap();
        write_delta(
            &dev,
            &sb,
            0,
            &chain,
            &delta_ckpt(2, &c1.image, &image(2, 5)),
            &[],
        )
        .unwrap();
        let c5 = Checkpoint {
            generation: 5,
            ..c1.clone()
        };
        let chain5 = write_base(&dev, &sb, 0, &c5).unwrap();
        assert_eq!(
            chain5.next_offset, chain.next_offset,
            "the old delta follows it"
        );
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!(got.checkpoint, c5);
        assert_eq!(got.chain.deltas, 0);
        assert!(got.beyond.unwrap().contains("earlier chain"));
    }

    /// A delta whose crc verifies but that does not apply to the chain
    /// (it removes an inode that is not there) ends the chain, with the
    /// reason; nothing of it is applied, and mount refuses the volume.
    #[test]
    fn a_delta_that_does_not_apply_ends_the_chain() {
        let (dev, sb) = setup();
        let c1 = base1();
        let chain = write_base(&dev, &sb, 0, &c1).unwrap();
        let mut bad = delta_ckpt(2, &c1.image, &image(2, 25));
        bad.delta.removed = vec![9_999];
        write_delta(&dev, &sb, 0, &chain, &bad, &[]).unwrap();
        let got = read_slot(&dev, &sb, 0).unwrap();
        assert_eq!(got.checkpoint, c1);
        assert!(got.unapplied);
        let why = got.beyond.unwrap();
        assert!(
            why.contains("does not apply") && why.contains("not there"),
            "{why}"
        );
        // Written whole, so not a torn write: reported, never rolled back.
        let lost = read_checkpoints(&dev, &sb).unwrap().lost.unwrap();
        assert_eq!((lost.generation, lost.slot), (2, 0));
        assert!(read_newest_checkpoint(&dev, &sb).is_err());
    }

    /// A newest chain ending in a delta that verifies but does not apply
    /// is a lost checkpoint too: the older slot's image, otherwise not read
    /// at mount, is verified then, so that the loss names its damage
    /// beside the delta's.
    #[test]
    fn an_unapplied_delta_reports_why_the_older_slot_is_unusable() {
        let (dev, sb) = setup();
        let c0 = Checkpoint {
            image: image(0, 20),
            ..ckpt(0, 0)
        };
        write_base(&dev, &sb, 1, &c0).unwrap();
        let c1 = base1();
        let chain = write_base(&dev, &sb, 0, &c1).unwrap();
        let mut bad = delta_ckpt(2, &c1.image, &image(2, 25));
        bad.delta.removed = vec![9_999];
        write_delta(&dev, &sb, 0, &chain, &bad, &[]).unwrap();
        // The older slot's header still names generation 0: only its image
        // is damaged.
        dev.flip(slot_start(&sb, 1) + encoded_len(&c0.image) / 2);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, &newest.checkpoint), (0, &c1));
        let lost = newest.lost.expect("generation 2 was written whole");
        assert_eq!((lost.generation, lost.slot), (2, 0));
        assert!(
            lost.reason.contains("does not apply")
                && lost.reason.contains("slot 1: ")
                && lost.reason.contains("crc32c"),
            "{}",
            lost.reason
        );
    }

    /// Once delta 2 is durable and the base is marked, damage to delta 2
    /// is a lost checkpoint (in the same slot); before the mark it is a
    /// torn write and the base is used. The mark writes one sector and
    /// changes only the mark's bytes.
    #[test]
    fn a_damaged_durable_delta_is_reported_not_rolled_back() {
        let (dev, sb) = setup();
        let c1 = base1();
        let chain = write_base(&dev, &sb, 0, &c1).unwrap();
        let chain2 = write_delta(
            &dev,
            &sb,
            0,
            &chain,
            &delta_ckpt(2, &c1.image, &image(2, 25)),
            &[],
        )
        .unwrap();
        let damage = slot_start(&sb, 0) + chain2.last_offset + 70;
        let clean = dev.with_bytes(|b| b.clone());
        dev.flip(damage);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.checkpoint.generation, newest.lost), (1, None));
        dev.with_bytes(|b| *b = clean.clone());

        mark_superseded(&dev, &sb, 0, 0, 1).unwrap();
        let mark_at = slot_start(&sb, 0) as usize + OFF_SUPERSEDED;
        dev.with_bytes(|b| {
            let changed: Vec<usize> = (0..b.len()).filter(|&i| b[i] != clean[i]).collect();
            assert!(
                changed.iter().all(|i| (mark_at..mark_at + 4).contains(i)),
                "{changed:?}"
            );
            assert!(!changed.is_empty());
        });
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap().1.generation, 2);
        dev.flip(damage);
        let newest = read_checkpoints(&dev, &sb).unwrap();
        let lost = newest.lost.unwrap();
        assert_eq!(
            (
                lost.generation,
                lost.slot,
                lost.left_generation,
                lost.left_slot
            ),
            (2, 0, 1, 0)
        );
        assert!(lost.reason.contains("crc32c"), "{}", lost.reason);
        let err = read_newest_checkpoint(&dev, &sb).unwrap_err();
        assert!(err.to_string().contains("generation 2"), "{err}");
    }

    /// The first regular file of `image`.
    fn regular_file(image: &mut MetaImage) -> &mut InodeImage {
        image
            .inodes
            .iter_mut()
            .find(|i| i.kind == crate::types::FileKind::Regular)
            .expect("random images have regular files")
    }

    fn written(file_off: u64, len: u64, addr: u64) -> Extent {
        Extent {
            file_off,
            len,
            addr,
            state: crate::types::ExtentState::Written,
        }
    }

    /// A delta whose extents overlap an extent of the base kept outside
    /// its spans does not apply, and changes nothing.
    #[test]
    fn a_delta_overlapping_kept_extents_does_not_apply() {
        use crate::types::InodeDelta;
        let mut base = image(1, 30);
        let file = regular_file(&mut base);
        let ext = |off: u64, len: u64| written(off, len, 1 << 30);
        file.extents = vec![ext(0, 8192)];
        let mut changed = file.clone();
        changed.extents = vec![ext(4096, 4096)];
        let before = base.clone();
        let delta = MetaDelta {
            next_ino: base.next_ino,
            removed: Vec::new(),
            changed: vec![InodeDelta {
                spans: vec![(4096, u64::MAX)],
                inode: changed.clone(),
            }],
        };
        let err = apply_delta(&mut base, &delta).unwrap_err();
        assert!(err.contains("overlaps"), "{err}");
        assert_eq!(base, before);
        // The same extent with the span covering the old one applies.
        let delta = MetaDelta {
            changed: vec![InodeDelta {
                spans: vec![(0, u64::MAX)],
                inode: changed,
            }],
            ..delta
        };
        apply_delta(&mut base, &delta).unwrap();
    }

    /// A delta that names one inode twice breaks `MetaDelta`'s rule
    /// (`changed` sorted by inode number) and is refused, changing
    /// nothing: each change is planned against the map as it was, so
    /// applying the second to the map the first produced would read runs
    /// that are not there (a slice index panic). The decoder refuses such
    /// a delta, but `apply_delta` is public and says it checks everything.
    #[test]
    fn a_delta_naming_an_inode_twice_is_refused_not_a_panic() {
        use crate::types::InodeDelta;
        let mut base = image(1, 30);
        let file = regular_file(&mut base);
        let ext = |off: u64| written(off, 4096, (1 << 30) + off);
        file.extents = vec![ext(0), ext(8192)];
        let (mut first, mut second) = (file.clone(), file.clone());
        // The first removes the extent at 0; the second adds one at 16 KiB.
        first.extents = Vec::new();
        second.extents = vec![ext(16384)];
        let before = base.clone();
        let delta = MetaDelta {
            next_ino: base.next_ino,
            removed: Vec::new(),
            changed: vec![
                InodeDelta {
                    spans: vec![(0, 4096)],
                    inode: first,
                },
                InodeDelta {
                    spans: vec![(16384, 20480)],
                    inode: second,
                },
            ],
        };
        let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            apply_delta(&mut base, &delta)
        }));
        match applied {
            Ok(Err(reason)) => assert!(reason.contains("not sorted"), "{reason}"),
            other => panic!("a delta naming an inode twice: {other:?}"),
        }
        assert_eq!(base, before);
    }

    // ---- extent pages -------------------------------------------------------

    fn paged_setup() -> (VecDevice, Superblock) {
        let (dev, mut sb) = setup();
        sb.features_incompat |= INCOMPAT_EXTENT_PAGES;
        (dev, sb)
    }

    /// Writes `ckpt` to `slot` as a base with extent pages: each file's
    /// extents in pages of up to three, the page at index `i` of the
    /// whole list placed at `addr_of(i)`, then the root. Pages whose
    /// address is already in `reuse` are not written again (an unchanged
    /// chunk keeps its page). Returns the page table.
    fn write_paged_base(
        dev: &VecDevice,
        sb: &Superblock,
        slot: usize,
        ckpt: &Checkpoint,
        addr_of: impl Fn(usize) -> u64,
    ) -> PageTable {
        let mut table = Vec::new();
        let mut written = Vec::new();
        let mut i = 0;
        for inode in ckpt.image.inodes.iter().filter(|i| !i.extents.is_empty()) {
            let mut list = Vec::new();
            for chunk in inode.extents.chunks(3) {
                let (bytes, page) = codec::encode_page(
                    sb.crc_seed(),
                    inode.ino,
                    chunk,
                    sb.block_size(),
                    addr_of(i),
                )
                .unwrap();
                written.push((page.addr, bytes));
                list.push(page);
                i += 1;
            }
            table.push((inode.ino, list.into()));
        }
        write_pages(dev, &written).unwrap();
        write_base_record(
            dev,
            sb,
            slot,
            RecordHeader::of(ckpt),
            paged_root(sb, ckpt, &table),
            &[],
        )
        .unwrap();
        table
    }

    /// The root of `ckpt` with `table`: the files it lists without their
    /// extents, the others' inline.
    fn paged_root(sb: &Superblock, ckpt: &Checkpoint, table: &PageTable) -> Vec<u8> {
        let mut image = ckpt.image.clone();
        for inode in &mut image.inodes {
            if table.iter().any(|(ino, _)| *ino == inode.ino) {
                inode.extents.clear();
            }
        }
        let heads: Vec<&InodeImage> = image.inodes.iter().collect();
        codec::encode_root_after(
            CHECKPOINT_HEADER_LEN,
            image.next_ino,
            &heads,
            table,
            sb.block_size(),
        )
        .unwrap()
    }

    fn page_addr(sb: &Superblock, i: usize) -> u64 {
        sb.layout.data.start + i as u64 * sb.block_size()
    }

    /// `read_index_pages` reads a file's index pages in order into its
    /// page list, and refuses index pages that each verify but whose keys
    /// do not follow one another (the second's first page at or before
    /// the first's last): the list would not be sorted. The error names
    /// the inode and the second index page's device byte.
    #[test]
    fn index_pages_are_read_in_order_and_their_keys_must_follow() {
        let (dev, mut sb) = paged_setup();
        sb.features_incompat |= INCOMPAT_PAGE_INDEX;
        let bs = sb.block_size();
        let page = |first_key: u64, i: usize| PageRef {
            addr: page_addr(&sb, 100 + i),
            crc: 0,
            count: 1,
            first_key,
            allocated: bs,
        };
        let index_page = |pages: &[PageRef], at: usize| {
            let blocks = [page_addr(&sb, at), page_addr(&sb, at + 50)];
            let (bytes, iref) =
                codec::encode_index_page(sb.crc_seed(), 7, pages, bs, blocks).unwrap();
            write_pages(&dev, &[(blocks[0], bytes.clone()), (blocks[1], bytes)]).unwrap();
            iref
        };
        let first = [page(0, 0), page(10 * bs, 1)];
        let a = index_page(&first, 0);
        let b = index_page(&[page(20 * bs, 2), page(30 * bs, 3)], 1);
        let listed: PageTable = vec![(
            7,
            [first.to_vec(), vec![page(20 * bs, 2), page(30 * bs, 3)]]
                .concat()
                .into(),
        )];
        let (table, damaged) =
            read_index_pages(&dev, &sb, &vec![(7, vec![a, b])], PageReading::OnDemand).unwrap();
        assert_eq!((&table, damaged.len()), (&listed, 0));

        // A damaged first copy: the second gives the same pages, and the
        // damaged one is named. Both damaged: the index page is lost, the
        // error naming both blocks.
        let mut block = vec![0u8; bs as usize];
        dev.read_at(&mut block, b.addr).unwrap();
        block[40] ^= 1;
        write_pages(&dev, &[(b.addr, block.clone())]).unwrap();
        let (table, damaged) =
            read_index_pages(&dev, &sb, &vec![(7, vec![a, b])], PageReading::OnDemand).unwrap();
        assert_eq!(table, listed);
        assert_eq!(damaged.len(), 1, "{damaged:?}");
        assert_eq!(
            (damaged[0].ino, damaged[0].at, damaged[0].index),
            (7, b.addr, b)
        );
        let text = damaged[0].to_string();
        assert!(
            text.contains(&format!("at device byte {} could not be read", b.addr))
                && text.contains(&format!("the one at device byte {} does", b.copy)),
            "{text}"
        );
        write_pages(&dev, &[(b.copy, block)]).unwrap();
        let err =
            read_index_pages(&dev, &sb, &vec![(7, vec![a, b])], PageReading::OnDemand).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Corrupt { offset, .. } if offset == b.addr)
                && text.contains(&format!("device byte {}", b.copy))
                && text.contains("and its copy"),
            "{text}"
        );

        // The second index page starts where the first ends.
        let overlapping = index_page(&[page(10 * bs, 4), page(30 * bs, 5)], 2);
        let err = read_index_pages(
            &dev,
            &sb,
            &vec![(7, vec![a, overlapping])],
            PageReading::OnDemand,
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Corrupt { offset, .. } if offset == overlapping.addr),
            "{text}"
        );
        assert!(
            text.contains("inode 7") && text.contains("not after"),
            "{text}"
        );
    }

    #[test]
    fn a_base_with_extent_pages_reads_back_whole_with_both_slots_pages() {
        let (dev, sb) = paged_setup();
        let first = ckpt(1, 30);
        let table0 = write_paged_base(&dev, &sb, 0, &first, |i| page_addr(&sb, i));
        let second = ckpt(2, 30);
        let table1 = write_paged_base(&dev, &sb, 1, &second, |i| page_addr(&sb, 400 + i));
        assert!(!table0.is_empty() && !table1.is_empty());
        let mut newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!(newest.slot, 1);
        assert!(newest
            .checkpoint
            .image
            .inodes
            .iter()
            .all(|i| i.extents.is_empty()));
        std::mem::take(&mut newest.paged)
            .fill_image(&mut newest.checkpoint.image)
            .unwrap();
        assert_eq!(
            newest.checkpoint, second,
            "every extent came back from its page"
        );
        assert_eq!(
            read_newest_checkpoint(&dev, &sb).unwrap(),
            (1, second.clone())
        );
        assert_eq!(
            newest.pages,
            [table0, table1],
            "the older base's pages are in use too"
        );
        assert!(newest.lost.is_none());
    }

    /// A page under a root that verifies, damaged: the slot does not
    /// verify, as a damaged spilled image does; the error names the inode
    /// and the keys lost. Unmarked, the older slot is the fallback (a
    /// torn write); marked superseded, the checkpoint is lost.
    #[test]
    fn a_damaged_extent_page_is_reported_with_the_inode_and_keys_it_loses() {
        let (dev, sb) = paged_setup();
        let first = ckpt(1, 30);
        write_paged_base(&dev, &sb, 0, &first, |i| page_addr(&sb, i));
        let second = ckpt(2, 30);
        let table = write_paged_base(&dev, &sb, 1, &second, |i| page_addr(&sb, 400 + i));
        let (ino, list) = &table[table.len() / 2];
        let page = *list.last().unwrap();
        let mut block = vec![0u8; 512];
        dev.read_at(&mut block, page.addr).unwrap();
        block[codec::PAGE_HEADER_LEN + 3] ^= 1;
        dev.write_at(&block, page.addr, WriteMode::Normal).unwrap();
        let lost = format!(
            "inode {ino}: the page of {} extents from file offset {} is lost",
            page.count, page.first_key
        );
        let err = read_slot(&dev, &sb, 1).unwrap_err().to_string();
        assert!(err.contains(&lost), "{err}");
        let newest = read_checkpoints(&dev, &sb).unwrap();
        assert_eq!((newest.slot, newest.checkpoint.generation), (0, 1));
        assert!(newest.lost.is_none());
        mark_superseded(&dev, &sb, 0, 0, 1).unwrap();
        let newest = read_checkpoints(&dev, &sb).unwrap();
        let lost_ckpt = newest.lost.expect("generation 2 was durable");
        assert_eq!((lost_ckpt.generation, lost_ckpt.slot), (2, 1));
        assert!(lost_ckpt.reason.contains(&lost), "{}", lost_ckpt.reason);
    }

    /// Pages left by an earlier base at the addresses a root lists, or a
    /// root that lists pages its writer never wrote (a torn page write
    /// before the flush): the slot does not verify.
    #[test]
    fn a_root_over_pages_it_did_not_write_does_not_verify() {
        let (dev, sb) = paged_setup();
        let first = ckpt(1, 30);
        write_paged_base(&dev, &sb, 0, &first, |i| page_addr(&sb, i));
        // Generation 2's pages at generation 1's addresses, then generation
        // 1's pages written back over them (an old page at the address).
        let second = ckpt(2, 30);
        write_paged_base(&dev, &sb, 1, &second, |i| page_addr(&sb, i));
        write_paged_base(&dev, &sb, 0, &first, |i| page_addr(&sb, i));
        let err = read_slot(&dev, &sb, 1).unwrap_err().to_string();
        assert!(err.contains("is lost"), "{err}");
        // Unwritten pages (zeros).
        let (dev, sb) = paged_setup();
        let table = write_paged_base(&dev, &sb, 0, &second, |i| page_addr(&sb, i));
        let zeros = vec![0u8; sb.block_size() as usize];
        dev.write_at(&zeros, table[0].1.first().unwrap().addr, WriteMode::Normal)
            .unwrap();
        let err = read_slot(&dev, &sb, 0).unwrap_err().to_string();
        assert!(err.contains("bad magic"), "{err}");
    }

    /// Each page verifies, but the second starts inside the first: the
    /// file's map would overlap itself.
    #[test]
    fn pages_of_a_file_that_overlap_each_other_do_not_verify() {
        let (dev, sb) = paged_setup();
        let mut ckpt = ckpt(1, 10);
        let file = regular_file(&mut ckpt.image);
        file.extents = vec![written(0, 8192, 1 << 20), written(4096, 4096, 2 << 20)];
        let ino = file.ino;
        let seed = sb.crc_seed();
        let mut list = Vec::new();
        let mut bytes = Vec::new();
        for (i, e) in file.extents.iter().enumerate() {
            let (b, page) =
                codec::encode_page(seed, ino, &[*e], sb.block_size(), page_addr(&sb, i)).unwrap();
            bytes.push((page.addr, b));
            list.push(page);
        }
        write_pages(&dev, &bytes).unwrap();
        let table: PageTable = vec![(ino, list.into())];
        let root = paged_root(&sb, &ckpt, &table);
        write_base_record(&dev, &sb, 0, RecordHeader::of(&ckpt), root, &[]).unwrap();
        let err = read_slot(&dev, &sb, 0).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "inode {ino}: the page of 1 extents from file offset 4096 is lost"
            )) && err.contains("overlaps"),
            "{err}"
        );
    }
}
