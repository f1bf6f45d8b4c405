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
//! Byte layout: see `docs/FORMAT.md`.

use blockdev::{BlockDevice, WriteMode};

use crate::codec::{self, Decoder, Encoder};
use crate::error::{Error, Result};
use crate::superblock::{is_aligned, Region, Superblock, CHECKPOINT_SLOTS};
use crate::types::MetaImage;

/// First 8 bytes of a valid checkpoint slot.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"IOMAPCP1";

// Byte offsets inside a slot (all little-endian).
pub const OFF_MAGIC: usize = 0;
pub const OFF_GENERATION: usize = 8;
pub const OFF_JOURNAL_START: usize = 16;
pub const OFF_JOURNAL_SEQ: usize = 24;
pub const OFF_JOURNAL_CHAIN: usize = 32;
/// Must be zero in version 1.
pub const OFF_RESERVED: usize = 36;
pub const OFF_IMAGE_LEN: usize = 40;
/// crc32c, seeded with `crc32c(uuid)`, of bytes `[0, OFF_CRC)` then the image.
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
    let crc = crc32c::crc32c_append(crc32c::crc32c_append(sb.crc_seed(), enc.as_bytes()), &image);
    enc.u32(crc);
    enc.bytes(&image);
    let mut buf = enc.into_bytes();
    buf.resize(needed.next_multiple_of(sb.block_size()) as usize, 0);
    dev.write_at(&buf, region.start, WriteMode::Normal)
        .map_err(|e| Error::device(format!("writing checkpoint slot {slot}"), e))?;
    dev.flush()
        .map_err(|e| Error::device(format!("flushing checkpoint slot {slot}"), e))
}

/// Reads and verifies the checkpoint in `slot`.
pub fn read_checkpoint(dev: &dyn BlockDevice, sb: &Superblock, slot: usize) -> Result<Checkpoint> {
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
    let reserved = dec.u32()?;
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
    let crc = crc32c::crc32c_append(
        crc32c::crc32c_append(sb.crc_seed(), &buf[..OFF_CRC]),
        image_bytes,
    );
    if crc != stored_crc {
        return Err(Error::corrupt(
            WHAT,
            region.start + OFF_CRC as u64,
            format!(
                "slot {slot}: crc32c mismatch (stored {stored_crc:#010x}, computed {crc:#010x}): torn, damaged, or from an earlier format"
            ),
        ));
    }
    if reserved != 0 {
        return Err(Error::corrupt(
            WHAT,
            region.start + OFF_RESERVED as u64,
            format!("slot {slot}: reserved field is {reserved:#x}, not 0"),
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
    Ok(Checkpoint {
        generation,
        journal_start,
        journal_seq,
        journal_chain,
        image,
    })
}

/// Reads both slots and returns the valid checkpoint with the highest
/// generation, and its slot. A slot that does not verify is skipped; if
/// neither verifies the error names both reasons. Device errors are returned
/// as they are: a slot that cannot be read might be the newer one.
pub fn read_newest_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
) -> Result<(usize, Checkpoint)> {
    let mut best: Option<(usize, Checkpoint)> = None;
    let mut reasons = Vec::with_capacity(CHECKPOINT_SLOTS);
    for slot in 0..CHECKPOINT_SLOTS {
        match read_checkpoint(dev, sb, slot) {
            Ok(c) => {
                let newer = match &best {
                    Some((_, b)) => c.generation > b.generation,
                    None => true,
                };
                if newer {
                    best = Some((slot, c));
                }
            }
            Err(e @ Error::Corrupt { .. }) => reasons.push(format!("slot {slot}: {e}")),
            Err(e) => return Err(e),
        }
    }
    best.ok_or_else(|| {
        Error::corrupt(
            WHAT,
            sb.layout.checkpoint_slots[0].start,
            format!("no valid checkpoint: {}", reasons.join("; ")),
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
