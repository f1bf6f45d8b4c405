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
//! Byte layout: see `docs/FORMAT.md`.

use blockdev::{BlockDevice, WriteMode};

use crate::codec::{self, Decoder, Encoder};
use crate::error::{Error, Result};
use crate::superblock::{is_aligned, Region, Superblock, CHECKPOINT_SLOTS, COMPAT_SUPERSEDE_MARKS};
use crate::types::MetaImage;

/// First 8 bytes of a valid checkpoint slot.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"IOMAPCP1";

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
/// The encoded image starts right after the header.
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
    let region = slot_region(sb, slot)?;
    check_journal_start(sb, ckpt.journal_start)
        .map_err(|reason| Error::invalid("writing a checkpoint", reason))?;
    let needed = encoded_len(&ckpt.image);
    if needed > region.len {
        return Err(Error::NoSpace {
            what: format!("checkpoint slot {slot} (metadata image)"),
            needed,
            available: region.len,
        });
    }
    let image = codec::encode_image(&ckpt.image)?;
    let mut enc = Encoder::with_capacity(needed.next_multiple_of(sb.block_size()) as usize);
    enc.bytes(&CHECKPOINT_MAGIC);
    enc.u64(ckpt.generation);
    enc.u64(ckpt.journal_start);
    enc.u64(ckpt.journal_seq);
    enc.u32(ckpt.journal_chain);
    enc.u32(0);
    enc.u64(image.len() as u64);
    debug_assert_eq!(enc.len(), OFF_CRC);
    let crc = slot_crc(sb, enc.as_bytes(), &image);
    enc.u32(crc);
    enc.bytes(&image);
    let mut buf = enc.into_bytes();
    buf.resize(needed.next_multiple_of(sb.block_size()) as usize, 0);
    dev.write_at(&buf, region.start, WriteMode::Normal)
        .map_err(|e| Error::device(format!("writing checkpoint slot {slot}"), e))?;
    dev.flush()
        .map_err(|e| Error::device(format!("flushing checkpoint slot {slot}"), e))
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
    pub checkpoint: Checkpoint,
    /// The slot carries a valid supersede mark: checkpoint
    /// `generation + 1` was durable in the other slot.
    pub superseded: bool,
}

/// Reads and verifies the checkpoint in `slot`.
pub fn read_checkpoint(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<Checkpoint> {
    read_slot(dev, sb, slot).map(|c| c.checkpoint)
}

/// Reads and verifies the checkpoint in `slot`, and whether it is marked
/// superseded.
pub fn read_slot(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<SlotContents> {
    let region = slot_region(sb, slot)?;
    let bs = sb.block_size();
    let read_err = |e| Error::device(format!("reading checkpoint slot {slot}"), e);
    let mut buf = vec![0u8; bs as usize];
    dev.read_at(&mut buf, region.start).map_err(read_err)?;

    let mut dec = Decoder::new(&buf, region.start, WHAT);
    let magic: [u8; 8] = dec.array()?;
    if magic != CHECKPOINT_MAGIC {
        return Err(Error::corrupt(
            WHAT,
            region.start,
            format!("slot {slot} holds no checkpoint (bad magic)"),
        ));
    }
    let generation = dec.u64()?;
    let journal_start = dec.u64()?;
    let journal_seq = dec.u64()?;
    let journal_chain = dec.u32()?;
    let mark = dec.u32()?;
    let image_len = dec.u64()?;
    let stored_crc = dec.u32()?;
    let capacity = region.len - CHECKPOINT_HEADER_LEN as u64;
    if image_len > capacity {
        return Err(Error::corrupt(
            WHAT,
            region.start + OFF_IMAGE_LEN as u64,
            format!("slot {slot}: image length {image_len} exceeds the slot's {capacity} bytes"),
        ));
    }
    // image_len is bounded by the slot size, which the superblock bounds by
    // the device size.
    let total = (CHECKPOINT_HEADER_LEN as u64 + image_len).next_multiple_of(bs);
    if total > bs {
        let mut whole = vec![0u8; total as usize];
        whole[..bs as usize].copy_from_slice(&buf);
        dev.read_at(&mut whole[bs as usize..], region.start + bs)
            .map_err(read_err)?;
        buf = whole;
    }
    let image_end = CHECKPOINT_HEADER_LEN + image_len as usize;
    let image_bytes = &buf[CHECKPOINT_HEADER_LEN..image_end];
    let crc = slot_crc(sb, &buf, image_bytes);
    if crc != stored_crc {
        return Err(Error::corrupt(
            WHAT,
            region.start + OFF_CRC as u64,
            format!(
                "slot {slot}: crc32c mismatch (stored {stored_crc:#010x}, computed {crc:#010x}): torn, damaged, or from an earlier format"
            ),
        ));
    }
    let marks = sb.features_compat & COMPAT_SUPERSEDE_MARKS != 0;
    let superseded = mark != 0;
    if superseded && (!marks || mark != supersede_mark(sb, generation)) {
        return Err(Error::corrupt(
            WHAT,
            region.start + OFF_SUPERSEDED as u64,
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
            region.start + OFF_JOURNAL_START as u64,
            format!("slot {slot}: {reason}"),
        )
    })?;
    let image = codec::decode_image_at(
        image_bytes,
        region.start + CHECKPOINT_HEADER_LEN as u64,
        "checkpoint image",
    )?;
    Ok(SlotContents {
        checkpoint: Checkpoint {
            generation,
            journal_start,
            journal_seq,
            journal_chain,
            image,
        },
        superseded,
    })
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
    /// Generation of the checkpoint that is left (the one marked).
    pub left_generation: u64,
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
            other_slot(self.slot),
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
    pub checkpoint: Checkpoint,
    /// Set when the newest valid checkpoint is marked superseded: the
    /// checkpoint that superseded it is damaged.
    pub lost: Option<LostCheckpoint>,
}

/// Reads both slots and returns the valid checkpoint with the highest
/// generation, its slot, and (if that slot is marked superseded) the newer
/// checkpoint that was lost. A slot that does not verify is skipped; if
/// neither verifies the error names both reasons. Device errors are returned
/// as they are: a slot that cannot be read might be the newer one.
pub fn read_checkpoints(dev: &dyn BlockDevice, sb: &Superblock) -> Result<NewestCheckpoint> {
    let mut best: Option<(usize, SlotContents)> = None;
    let mut reasons: Vec<Option<String>> = vec![None; CHECKPOINT_SLOTS];
    for (slot, reason) in reasons.iter_mut().enumerate() {
        match read_slot(dev, sb, slot) {
            Ok(c) => {
                let newer = match &best {
                    Some((_, b)) => c.checkpoint.generation > b.checkpoint.generation,
                    None => true,
                };
                if newer {
                    best = Some((slot, c));
                }
            }
            Err(e @ Error::Corrupt { .. }) => *reason = Some(e.to_string()),
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
    let lost = contents.superseded.then(|| {
        let lost_slot = other_slot(slot);
        LostCheckpoint {
            generation: contents.checkpoint.generation + 1,
            slot: lost_slot,
            reason: reasons[lost_slot]
                .clone()
                .unwrap_or_else(|| "it verifies but holds an older generation".to_string()),
            left_generation: contents.checkpoint.generation,
        }
    });
    Ok(NewestCheckpoint {
        slot,
        checkpoint: contents.checkpoint,
        lost,
    })
}

/// [`read_checkpoints`], refusing (as [`Error::Corrupt`]) a volume whose
/// newest durable checkpoint is lost.
pub fn read_newest_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
) -> Result<(usize, Checkpoint)> {
    let newest = read_checkpoints(dev, sb)?;
    if let Some(lost) = newest.lost {
        return Err(lost_error(sb, &lost));
    }
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

/// Marks the checkpoint of `generation` in `slot` superseded, once the
/// checkpoint of `generation + 1` is durable in the other slot: rewrites the
/// slot's first block with the mark set, then flushes. Does nothing if the
/// slot does not hold that generation (e.g. it was invalid at mount) or the
/// volume keeps no marks.
pub fn mark_superseded(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    slot: usize,
    generation: u64,
) -> Result<()> {
    if sb.features_compat & COMPAT_SUPERSEDE_MARKS == 0 {
        return Ok(());
    }
    let region = slot_region(sb, slot)?;
    let mut block = vec![0u8; sb.block_size() as usize];
    dev.read_at(&mut block, region.start).map_err(|e| {
        Error::device(
            format!("reading checkpoint slot {slot} to mark it superseded"),
            e,
        )
    })?;
    let held = u64::from_le_bytes(
        block[OFF_GENERATION..OFF_GENERATION + 8]
            .try_into()
            .unwrap_or_default(),
    );
    if block[OFF_MAGIC..OFF_MAGIC + 8] != CHECKPOINT_MAGIC || held != generation {
        return Ok(());
    }
    let mark = supersede_mark(sb, generation);
    block[OFF_SUPERSEDED..OFF_SUPERSEDED + 4].copy_from_slice(&mark.to_le_bytes());
    dev.write_at(&block, region.start, WriteMode::Normal)
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

        mark_superseded(&dev, &sb, 0, 1).unwrap();
        let marked = read_slot(&dev, &sb, 0).unwrap();
        assert!(marked.superseded);
        assert_eq!(marked.checkpoint, c1, "the mark leaves the slot verifying");
        assert!(!read_slot(&dev, &sb, 1).unwrap().superseded);
        assert_eq!(read_newest_checkpoint(&dev, &sb).unwrap(), (1, c2.clone()));
        // Marking a slot that does not hold the generation does nothing.
        let before = dev.with_bytes(|b| b.clone());
        mark_superseded(&dev, &sb, 1, 7).unwrap();
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
        mark_superseded(&dev, &sb, 0, 1).unwrap();
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
}
