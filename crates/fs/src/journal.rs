//! The journal: a circular log of metadata records in the journal region,
//! written in batches (one group commit = one batch) and replayed at mount on
//! top of the newest checkpoint.
//!
//! # Batches and the chain rule
//!
//! A batch is a block-aligned header followed by its encoded records, padded
//! to the block size. The header carries a crc32c of the payload and a crc32c
//! of itself (both seeded with the volume uuid); the header crc covers the
//! payload crc, so it covers the whole batch, and it is the batch's *chain
//! value*. Replay accepts a batch only if
//! - its magic and both crcs verify,
//! - its `first_seq` is the sequence number replay expects next, and
//! - its `prev_chain` is the chain value of the batch before it (for the
//!   first batch after a checkpoint: [`Checkpoint::journal_chain`]).
//!
//! and stops at the first batch that fails any of these. A batch therefore
//! applies entirely or not at all, and a stale batch can never be accepted:
//! if batch N is torn at a crash and a *different* batch N is written at the
//! same place after recovery, an intact old N+1 behind it still names the old
//! N's chain value and is refused.
//!
//! # Wrapping
//!
//! Positions are byte offsets inside the journal region. A batch that does
//! not fit between the head and the region end is written at the region
//! start; the bytes skipped are counted as used. The reader, finding no valid
//! batch at its position, tries the region start with the same expected seq
//! and chain. The writer never lets the live part (tail to head, skipped
//! bytes included) reach the region size, and replay never reads more than
//! that: its cost is bounded by the journal, never the device.
//!
//! # Fault model
//!
//! A crash may lose, keep or tear (any subset of logical blocks) every write
//! issued since the last flush. The caller flushes before an append (so the
//! data the records describe, and every earlier batch, are durable first)
//! and after it (so the batch is): at most one batch is ever in flight.
//! Replay then yields every durable batch, and the one in flight or not.
//!
//! That contract lets replay tell a torn tail from damage. When replay stops
//! at record `E`, the journal is scanned (outside the part just replayed) for
//! any batch header that verifies and starts after `E`. Such a batch was
//! written after a flush that made record `E` durable, so the batch holding
//! `E` has been damaged (or the checkpoint replay started from is older than
//! one that was durable): replay fails with [`Error::Corrupt`] rather than
//! mount an older state whose freed blocks may since have been reused.
//!
//! That scan reads the whole region, whatever it holds. A clean unmount
//! leaves nothing to find: it sets the superblock's clean-unmount mark
//! ([`CleanMark`]) once its final checkpoint is durable and the journal
//! holds nothing after it, and the writer clears the mark, durably, before
//! the session's first append ([`JournalWriter::clear_clean_mark_first`]).
//! Replay told to trust the mark ([`LaterBatches::TrustCleanMark`]) skips
//! the scan when it replayed nothing; a mark on disk therefore always means
//! no batch was appended after the checkpoint it names.
//!
//! Byte layout: see `docs/FORMAT.md`.
//!
//! [`Checkpoint::journal_chain`]: crate::checkpoint::Checkpoint::journal_chain
//! [`CleanMark`]: crate::superblock::CleanMark

use blockdev::{BlockDevice, WriteMode};

use crate::codec::{self, Decoder, Encoder, RECORD_MIN_ENCODED_LEN};
use crate::error::{Error, Result};
use crate::superblock::{self, is_aligned, Region, Superblock};
use crate::types::Record;

/// First 8 bytes of every batch.
pub const BATCH_MAGIC: [u8; 8] = *b"IOMAPJB1";

// Byte offsets inside a batch header (all little-endian).
pub const OFF_MAGIC: usize = 0;
pub const OFF_FIRST_SEQ: usize = 8;
pub const OFF_RECORD_COUNT: usize = 16;
pub const OFF_PREV_CHAIN: usize = 20;
pub const OFF_PAYLOAD_LEN: usize = 24;
/// crc32c, seeded with `crc32c(uuid)`, of the payload.
pub const OFF_PAYLOAD_CRC: usize = 32;
/// crc32c, seeded with `crc32c(uuid)`, of bytes `[0, OFF_HEADER_CRC)`. Also
/// the batch's chain value.
pub const OFF_HEADER_CRC: usize = 36;
/// The payload (encoded records) starts right after the header.
pub const BATCH_HEADER_LEN: usize = OFF_HEADER_CRC + 4;

/// Bytes read at a time when scanning the journal for later batches.
const SCAN_CHUNK_BYTES: u64 = 1 << 20;

const WHAT: &str = "journal batch";

/// Bytes a batch with `payload_len` bytes of records occupies.
fn batch_len(payload_len: u64, block_size: u64) -> u64 {
    (BATCH_HEADER_LEN as u64 + payload_len).next_multiple_of(block_size)
}

/// Where replay stopped: the writer continues from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayEnd {
    /// Offset inside the journal region where the next batch goes.
    pub head: u64,
    /// Sequence number of the next record.
    pub next_seq: u64,
    /// Chain value the next batch must carry.
    pub chain: u32,
    /// Records and batches replayed.
    pub records: u64,
    pub batches: u64,
}

/// Appends batches at the head of the journal.
///
/// The live part of the journal runs from the tail (where replay would start:
/// the newest durable checkpoint's `journal_start`) to the head. The writer
/// never overwrites it; after a checkpoint the caller moves the tail with
/// [`JournalWriter::set_tail`].
#[derive(Clone, Debug)]
pub struct JournalWriter {
    region: Region,
    block_size: u64,
    seed: u32,
    head: u64,
    tail: u64,
    next_seq: u64,
    chain: u32,
    /// The superblock to write over one with a clean-unmount mark before
    /// the next append.
    clear_mark: Option<Superblock>,
}

impl JournalWriter {
    /// A writer whose next batch goes at offset `start` of the journal
    /// region, with records numbered from `next_seq` and chained to `chain`.
    /// The tail starts at `start` (an empty live part); after a replay that
    /// found batches, set the tail to the checkpoint's `journal_start`.
    pub fn new(sb: &Superblock, start: u64, next_seq: u64, chain: u32) -> JournalWriter {
        let mut w = JournalWriter {
            region: sb.layout.journal,
            block_size: sb.block_size(),
            seed: sb.crc_seed(),
            head: 0,
            tail: 0,
            next_seq: 0,
            chain: 0,
            clear_mark: None,
        };
        w.restart_at(start, next_seq, chain);
        w
    }

    /// A block-aligned offset inside the region. Offsets come from a
    /// verified checkpoint or from replay, so this only guards against
    /// misuse.
    fn normalize(&self, offset: u64) -> u64 {
        debug_assert!(
            offset < self.region.len && is_aligned(offset, self.block_size),
            "journal offset {offset} outside the {}-byte region or unaligned",
            self.region.len
        );
        let offset = offset % self.region.len;
        offset - offset % self.block_size
    }

    /// Offset inside the journal region where the next batch goes (unless it
    /// must wrap to the region start).
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Offset inside the journal region where replay would start.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Sequence number the next record gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Chain value of the last batch written (what the next must carry).
    pub fn chain(&self) -> u32 {
        self.chain
    }

    /// Moves the tail to `tail`, releasing the journal before it. Call only
    /// once a checkpoint whose `journal_start` is `tail` is durable.
    pub fn set_tail(&mut self, tail: u64) {
        self.tail = self.normalize(tail);
    }

    /// The superblock on disk holds a clean-unmount mark: the next append
    /// first writes `sb` without it over block 0 (FUA), so that no batch can
    /// be on disk while the mark is. Once per session, not per append.
    pub fn clear_clean_mark_first(&mut self, sb: &Superblock) {
        self.clear_mark = Some(sb.without_clean_mark());
    }

    /// Starts again at `start`, empty, with records numbered from
    /// `next_seq` and chained to `chain` (a checkpoint that did not go
    /// through the journal moved it there). The same writer goes on, so
    /// what it still owes the device (clearing a clean-unmount mark before
    /// its next batch) is kept.
    pub fn restart_at(&mut self, start: u64, next_seq: u64, chain: u32) {
        self.head = self.normalize(start);
        self.tail = self.head;
        self.next_seq = next_seq;
        self.chain = chain;
    }

    /// Whether the next append must first clear a clean-unmount mark.
    pub fn clears_clean_mark_first(&self) -> bool {
        self.clear_mark.is_some()
    }

    /// Bytes of the live part, from tail to head (skipped bytes included).
    pub fn used_bytes(&self) -> u64 {
        (self.head + self.region.len - self.tail) % self.region.len
    }

    /// The live part is at least half of the journal: time for a
    /// background checkpoint (see `crate::background_thread`).
    pub fn is_half_full(&self) -> bool {
        self.used_bytes() * 2 >= self.region.len
    }

    /// Bytes that batches may still consume before the journal is full. One
    /// block always stays free, so that head == tail means empty.
    pub fn free_bytes(&self) -> u64 {
        (self.region.len - self.used_bytes()).saturating_sub(self.block_size)
    }

    /// Where a batch of `len` bytes goes, and how many bytes before the
    /// region end it skips to get there.
    fn placement(&self, len: u64) -> (u64, u64) {
        if self.head.saturating_add(len) <= self.region.len {
            (self.head, 0)
        } else {
            (0, self.region.len - self.head)
        }
    }

    /// Bytes a batch of `records` would consume at the current head: its
    /// padded size, plus the bytes skipped if it must wrap. It can be
    /// appended if this is at most [`JournalWriter::free_bytes`].
    pub fn batch_bytes(&self, records: &[Record]) -> u64 {
        let payload: u64 = records
            .iter()
            .map(|r| codec::record_encoded_len(r) as u64)
            .sum();
        let len = batch_len(payload, self.block_size);
        let (_, skipped) = self.placement(len);
        skipped + len
    }

    /// Writes `records` as one batch at the head and returns the sequence
    /// number of the last record. A normal write: the caller flushes before
    /// (every earlier batch must be durable when this one is written: replay
    /// relies on it to tell a torn tail from damage) and after. Fails without writing if `records` is empty or holds an
    /// invalid name, or with [`Error::NoSpace`] if the batch would overwrite
    /// the live part of the journal (a checkpoint frees it).
    pub fn append(&mut self, dev: &dyn BlockDevice, records: &[Record]) -> Result<u64> {
        let count = u32::try_from(records.len())
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::invalid(
                    "journal append",
                    format!("{} records: a batch holds 1..=u32::MAX", records.len()),
                )
            })?;
        let last_seq = self
            .next_seq
            .checked_add(u64::from(count) - 1)
            .filter(|l| *l < u64::MAX)
            .ok_or_else(|| Error::invalid("journal append", "record sequence numbers exhausted"))?;
        let mut payload = Encoder::new();
        for r in records {
            codec::encode_record(r, &mut payload)?;
        }
        let len = batch_len(payload.len() as u64, self.block_size);
        let (pos, skipped) = self.placement(len);
        let needed = skipped + len;
        let available = self.free_bytes();
        if needed > available {
            return Err(Error::NoSpace {
                what: "journal (full: a checkpoint frees it)".to_string(),
                needed,
                available,
            });
        }
        let (buf, crc) = encode_batch(
            self.seed,
            self.next_seq,
            count,
            self.chain,
            payload.as_bytes(),
            self.block_size,
        );
        debug_assert_eq!(buf.len() as u64, len);
        if let Some(sb) = &self.clear_mark {
            superblock::write_superblock(dev, sb)?;
            self.clear_mark = None;
        }
        let at = self.region.start + pos;
        dev.write_at(&buf, at, WriteMode::Normal)
            .map_err(|e| Error::device(format!("writing journal batch at device byte {at}"), e))?;
        self.head = (pos + len) % self.region.len;
        self.next_seq = last_seq + 1;
        self.chain = crc;
        Ok(last_seq)
    }
}

/// A batch as written: the header for `count` records from `first_seq`,
/// chained to `prev_chain`, then `payload` (the encoded records), padded to
/// `block_size`; with the batch's chain value. `seed` is the volume's crc
/// seed ([`Superblock::crc_seed`]). The payload is not checked: fuzzing
/// uses this to reach the record decoder past the checksums.
pub fn encode_batch(
    seed: u32,
    first_seq: u64,
    count: u32,
    prev_chain: u32,
    payload: &[u8],
    block_size: u64,
) -> (Vec<u8>, u32) {
    let len = batch_len(payload.len() as u64, block_size);
    let mut enc = Encoder::with_capacity(len as usize);
    enc.bytes(&BATCH_MAGIC);
    enc.u64(first_seq);
    enc.u32(count);
    enc.u32(prev_chain);
    enc.u64(payload.len() as u64);
    enc.u32(crc32c::crc32c_append(seed, payload));
    debug_assert_eq!(enc.len(), OFF_HEADER_CRC);
    let crc = crc32c::crc32c_append(seed, enc.as_bytes());
    enc.u32(crc);
    debug_assert_eq!(enc.len(), BATCH_HEADER_LEN);
    enc.bytes(payload);
    let mut buf = enc.into_bytes();
    buf.resize(len as usize, 0);
    (buf, crc)
}

/// A verified batch.
struct Batch {
    records: Vec<Record>,
    len: u64,
    chain: u32,
}

/// What replay expects next.
struct Expect {
    seq: u64,
    chain: u32,
}

/// A batch header whose magic and header crc verify.
struct Header {
    first_seq: u64,
    count: u32,
    prev_chain: u32,
    payload_len: u64,
    payload_crc: u32,
    /// The header crc: the batch's chain value.
    chain: u32,
}

/// Parses the header at the start of `block` (at least
/// [`BATCH_HEADER_LEN`] bytes); `None` unless magic and header crc verify.
fn parse_header(block: &[u8], seed: u32) -> Option<Header> {
    let header = block.get(..BATCH_HEADER_LEN)?;
    let mut dec = Decoder::new(header, 0, WHAT);
    let magic: [u8; 8] = dec.array().ok()?;
    if magic != BATCH_MAGIC {
        return None;
    }
    let h = Header {
        first_seq: dec.u64().ok()?,
        count: dec.u32().ok()?,
        prev_chain: dec.u32().ok()?,
        payload_len: dec.u64().ok()?,
        payload_crc: dec.u32().ok()?,
        chain: dec.u32().ok()?,
    };
    (crc32c::crc32c_append(seed, &header[..OFF_HEADER_CRC]) == h.chain).then_some(h)
}

/// Reads the batch at offset `pos` of the journal region if it is the one
/// replay expects and occupies fewer than `budget` bytes. `Ok(None)` if not
/// (torn, stale, foreign or absent); `Err` for device errors, or a batch
/// whose crcs verify but whose records do not decode.
fn read_batch(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    pos: u64,
    expect: &Expect,
    budget: u64,
) -> Result<Option<Batch>> {
    let region = sb.layout.journal;
    let bs = sb.block_size();
    let at = region.start + pos;
    let read_err = |e| Error::device(format!("reading journal at device byte {at}"), e);
    let mut buf = vec![0u8; bs as usize];
    dev.read_at(&mut buf, at).map_err(read_err)?;

    let Some(h) = parse_header(&buf, sb.crc_seed()) else {
        return Ok(None);
    };
    if h.first_seq != expect.seq
        || h.prev_chain != expect.chain
        || h.count == 0
        || h.first_seq.checked_add(u64::from(h.count)).is_none()
    {
        return Ok(None);
    }
    // Bound the length by the region and the budget before reading it.
    let room = region.len - pos;
    if h.payload_len > room {
        return Ok(None);
    }
    let len = batch_len(h.payload_len, bs);
    if len > room || len >= budget {
        return Ok(None);
    }
    if len > bs {
        let mut whole = vec![0u8; len as usize];
        whole[..bs as usize].copy_from_slice(&buf);
        dev.read_at(&mut whole[bs as usize..], at + bs)
            .map_err(read_err)?;
        buf = whole;
    }
    let payload = &buf[BATCH_HEADER_LEN..BATCH_HEADER_LEN + h.payload_len as usize];
    if crc32c::crc32c_append(sb.crc_seed(), payload) != h.payload_crc {
        return Ok(None);
    }
    // Verified: from here on, anything wrong is corruption, not a torn write.
    let mut dec = Decoder::new(payload, at + BATCH_HEADER_LEN as u64, WHAT);
    if u64::from(h.count) > h.payload_len / RECORD_MIN_ENCODED_LEN as u64 {
        return Err(Error::corrupt(
            WHAT,
            at + OFF_RECORD_COUNT as u64,
            format!(
                "{} records cannot fit in a {}-byte payload",
                h.count, h.payload_len
            ),
        ));
    }
    let mut records = Vec::with_capacity(h.count as usize);
    for _ in 0..h.count {
        records.push(codec::decode_record(&mut dec)?);
    }
    dec.finish()?;
    Ok(Some(Batch {
        records,
        len,
        chain: h.chain,
    }))
}

/// After replay from `start` stopped at `end` having read `scanned` bytes:
/// fails with [`Error::Corrupt`] if any block of the journal outside the part
/// replayed holds a verified batch header starting after `end.next_seq` (see
/// the module docs). Reads the journal once, in large chunks.
fn check_nothing_later(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    start: u64,
    scanned: u64,
    end: &ReplayEnd,
) -> Result<()> {
    let region = sb.layout.journal;
    let bs = sb.block_size();
    let seed = sb.crc_seed();
    let chunk_len = SCAN_CHUNK_BYTES.max(bs) / bs * bs;
    let mut buf = vec![0u8; chunk_len.min(region.len) as usize];
    let mut off = 0;
    while off < region.len {
        let n = chunk_len.min(region.len - off);
        let chunk = &mut buf[..n as usize];
        dev.read_at(chunk, region.start + off).map_err(|e| {
            Error::device(
                format!("scanning journal at device byte {}", region.start + off),
                e,
            )
        })?;
        for (i, block) in chunk.chunks_exact(bs as usize).enumerate() {
            let pos = off + i as u64 * bs;
            let replayed = (pos + region.len - start) % region.len < scanned;
            if replayed {
                continue;
            }
            if let Some(h) = parse_header(block, seed) {
                if h.first_seq > end.next_seq {
                    return Err(Error::corrupt(
                        "journal",
                        region.start + pos,
                        format!(
                            "replay stopped at record {} (journal offset {}), but a batch of records from {} was written later, at journal offset {pos}: records it follows were durable and are now damaged or missing, or the newest checkpoint was lost",
                            end.next_seq, end.head, h.first_seq
                        ),
                    ));
                }
            }
        }
        off += n;
    }
    Ok(())
}

/// Whether replay checks the journal for batches after the point where it
/// stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaterBatches {
    /// Scan the whole region (see the module docs).
    Scan,
    /// The superblock's clean-unmount mark names the checkpoint replay
    /// starts from: nothing was appended after it, so when replay finds no
    /// batch there is nothing to scan for. A batch found after all means the
    /// mark does not hold, and the region is scanned as usual.
    TrustCleanMark,
}

/// Replays the journal from offset `start` of the journal region, expecting
/// the first batch to start with record `seq` and carry chain value `chain`
/// (a checkpoint's `journal_start`, `journal_seq` and `journal_chain`).
/// Calls `apply` for each record of each valid batch, in order; a batch's
/// records are all decoded before the first is applied. Stops, without
/// error, at the first batch that does not verify (a torn or stale tail).
/// Errors for a device error, an `apply` error, or damage: a verified batch
/// that does not decode, or a batch written after the point where replay
/// stopped (see the module docs). Reads the live part of the journal, then
/// the whole region once for that check (unless `later` lets it skip):
/// never more than twice the region.
pub fn replay(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    start: u64,
    seq: u64,
    chain: u32,
    later: LaterBatches,
    apply: &mut dyn FnMut(u64, Record) -> Result<()>,
) -> Result<ReplayEnd> {
    let region_len = sb.layout.journal.len;
    let bs = sb.block_size();
    if start >= region_len || !is_aligned(start, bs) {
        return Err(Error::corrupt(
            "journal start",
            sb.layout.journal.start,
            format!(
                "replay start {start} is not a block-aligned offset inside the {region_len}-byte journal"
            ),
        ));
    }
    let mut end = ReplayEnd {
        head: start,
        next_seq: seq,
        chain,
        records: 0,
        batches: 0,
    };
    // Bytes of the live part read so far, skipped bytes included. The
    // writer keeps it below the region size, so replay does too.
    let mut scanned: u64 = 0;
    loop {
        let expect = Expect {
            seq: end.next_seq,
            chain: end.chain,
        };
        let mut found = None;
        for pos in [end.head, 0] {
            let skipped = if pos == end.head {
                0
            } else {
                region_len - end.head
            };
            let budget = region_len - scanned;
            if skipped >= budget {
                break;
            }
            if let Some(batch) = read_batch(dev, sb, pos, &expect, budget - skipped)? {
                found = Some((pos, skipped, batch));
                break;
            }
            if end.head == 0 {
                break;
            }
        }
        let Some((pos, skipped, batch)) = found else {
            break;
        };
        let count = batch.records.len() as u64;
        for (i, record) in batch.records.into_iter().enumerate() {
            apply(end.next_seq + i as u64, record)?;
        }
        scanned += skipped + batch.len;
        end.head = (pos + batch.len) % region_len;
        end.next_seq += count;
        end.chain = batch.chain;
        end.records += count;
        end.batches += 1;
    }
    if later == LaterBatches::Scan || end.batches > 0 {
        check_nothing_later(dev, sb, start, scanned, &end)?;
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::superblock::test_device::VecDevice;
    use crate::superblock::Layout;
    use crate::types::FileKind;
    use blockdev::memory::MemDevice;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const DEV_BYTES: u64 = 1 << 20;
    const BS: u64 = 512;
    const JOURNAL_BLOCKS: u64 = 16;

    fn sb() -> Superblock {
        let layout = Layout::compute(
            DEV_BYTES,
            512,
            BS as u32,
            Some(JOURNAL_BLOCKS * BS),
            Some(4 * BS),
        )
        .unwrap();
        Superblock::new(layout)
    }

    fn rec(i: u64) -> Record {
        match i % 3 {
            0 => Record::SetSize {
                ino: i,
                size: i * 10,
                mtime_ns: i,
            },
            1 => Record::Create {
                ino: i,
                parent: 1,
                name: format!("file-{i}"),
                kind: FileKind::Regular,
                attrs: crate::types::InodeAttrs::default(),
                target: vec![],
            },
            _ => Record::Punch {
                ino: i,
                file_off: 0,
                len: 4096,
                mtime_ns: i,
            },
        }
    }

    fn big_rec(i: u64, name_len: usize) -> Record {
        Record::Unlink {
            parent: i,
            name: "n".repeat(name_len),
            time: crate::types::Timestamp::default(),
        }
    }

    fn collect(
        dev: &dyn BlockDevice,
        sb: &Superblock,
        start: u64,
        seq: u64,
        chain: u32,
    ) -> (ReplayEnd, Vec<(u64, Record)>) {
        let mut out = Vec::new();
        let end = replay(
            dev,
            sb,
            start,
            seq,
            chain,
            LaterBatches::Scan,
            &mut |s, r| {
                out.push((s, r));
                Ok(())
            },
        )
        .unwrap();
        (end, out)
    }

    fn seqd(first: u64, records: &[Record]) -> Vec<(u64, Record)> {
        records
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, r)| (first + i as u64, r))
            .collect()
    }

    #[test]
    fn append_replay_round_trip() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        let batches: Vec<Vec<Record>> = vec![
            vec![rec(1)],
            vec![rec(2), rec(3), rec(4)],
            vec![big_rec(5, 255), big_rec(6, 255), big_rec(7, 200)],
        ];
        let mut all = Vec::new();
        for b in &batches {
            let expected_bytes = w.batch_bytes(b);
            let before = w.free_bytes();
            let last = w.append(&dev, b).unwrap();
            assert_eq!(last, w.next_seq() - 1);
            assert_eq!(w.free_bytes(), before - expected_bytes);
            all.extend(b.iter().cloned());
        }
        assert!(
            batches[2]
                .iter()
                .map(codec::record_encoded_len)
                .sum::<usize>()
                > 512
        );
        let (end, got) = collect(&dev, &sb, 0, 1, 0);
        assert_eq!(got, seqd(1, &all));
        assert_eq!(
            end,
            ReplayEnd {
                head: w.head(),
                next_seq: w.next_seq(),
                chain: w.chain(),
                records: all.len() as u64,
                batches: 3,
            }
        );
        // Wrong expectations accept nothing, and the later batches they
        // cannot reach are reported.
        for (seq, chain) in [(2, 0), (1, 1)] {
            let mut applied = 0;
            let err = replay(&dev, &sb, 0, seq, chain, LaterBatches::Scan, &mut |_, _| {
                applied += 1;
                Ok(())
            })
            .unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "{err}");
            assert_eq!(applied, 0);
        }
        // Another format's uuid finds nothing.
        let other = Superblock::new(sb.layout.clone());
        assert_eq!(collect(&dev, &other, 0, 1, 0).1.len(), 0);
        // Empty batches and bad names are refused.
        assert!(w.append(&dev, &[]).is_err());
        assert!(w.append(&dev, &[big_rec(1, 0)]).is_err());
        // An apply error stops replay with that error.
        let err = replay(&dev, &sb, 0, 1, 0, LaterBatches::Scan, &mut |_, _| {
            Err(Error::invalid("x", "y"))
        });
        assert!(matches!(err, Err(Error::InvalidArgument { .. })));
    }

    #[test]
    fn wrap_around() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        // Checkpoint position: where replay starts.
        let mut ck = (0u64, 1u64, 0u32);
        let mut w = JournalWriter::new(&sb, ck.0, ck.1, ck.2);
        let mut since_ck: Vec<Record> = Vec::new();
        let mut wrapped = 0;
        let mut i = 0;
        for round in 0..200u64 {
            // Batches of 1..3 blocks, so wrapping skips bytes now and then.
            let batch: Vec<Record> = (0..1 + round % 3)
                .map(|k| big_rec(i + k, 200 + (round as usize * 7) % 50))
                .collect();
            if w.batch_bytes(&batch) > w.free_bytes() {
                // "Checkpoint": replay from the old position must give
                // exactly the records since it.
                let (end, got) = collect(&dev, &sb, ck.0, ck.1, ck.2);
                assert_eq!(got, seqd(ck.1, &since_ck), "round {round}");
                assert_eq!(end.head, w.head());
                ck = (w.head(), w.next_seq(), w.chain());
                w.set_tail(w.head());
                since_ck.clear();
            }
            let head_before = w.head();
            w.append(&dev, &batch).unwrap();
            if w.head() < head_before || w.head() == 0 {
                wrapped += 1;
            }
            i += batch.len() as u64;
            since_ck.extend(batch);
        }
        assert!(wrapped > 10, "wrapped {wrapped} times");
        let (_, got) = collect(&dev, &sb, ck.0, ck.1, ck.2);
        assert_eq!(got, seqd(ck.1, &since_ck));
    }

    #[test]
    fn torn_last_batch_stops_replay() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        w.append(&dev, &[rec(1), rec(2)]).unwrap();
        let first_end = (w.head(), w.next_seq(), w.chain());
        let last = vec![big_rec(3, 255), big_rec(4, 255)];
        w.append(&dev, &last).unwrap();
        let batch_start = sb.layout.journal.start + first_end.0;
        for off in [
            0,
            OFF_FIRST_SEQ as u64,
            OFF_PAYLOAD_CRC as u64,
            OFF_HEADER_CRC as u64,
            44,
            560,
        ] {
            dev.flip(batch_start + off);
            let (end, got) = collect(&dev, &sb, 0, 1, 0);
            assert_eq!(got, seqd(1, &[rec(1), rec(2)]), "offset {off}");
            assert_eq!((end.head, end.next_seq, end.chain), first_end);
            dev.flip(batch_start + off);
        }
        assert_eq!(collect(&dev, &sb, 0, 1, 0).1.len(), 4);
    }

    #[test]
    fn stale_batch_after_a_torn_one_is_never_accepted() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        w.append(&dev, &[rec(1)]).unwrap();
        let after_first = (w.head(), w.next_seq(), w.chain());
        let n_at = sb.layout.journal.start + w.head();
        w.append(&dev, &[rec(2)]).unwrap(); // batch N
        w.append(&dev, &[rec(3)]).unwrap(); // batch N+1
        dev.flip(n_at + 44); // N is torn, N+1 intact.
                             // Under the flush contract N+1 proves N was durable: damage.
        let err = replay(&dev, &sb, 0, 1, 0, LaterBatches::Scan, &mut |_, _| Ok(())).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        // Had recovery gone on from before N, it writes a different batch N,
        // same size and seq, at the same place.
        let mut w = JournalWriter::new(&sb, after_first.0, after_first.1, after_first.2);
        let other = Record::Punch {
            ino: 2,
            file_off: 8192,
            len: 4096,
            mtime_ns: 99,
        };
        assert_eq!(
            codec::record_encoded_len(&other),
            codec::record_encoded_len(&rec(2))
        );
        w.append(&dev, std::slice::from_ref(&other)).unwrap();
        // The old N+1 follows it on disk, with the right seq, but chained to
        // the old N: refused, and replay ends cleanly before it.
        let (end, got) = collect(&dev, &sb, 0, 1, 0);
        assert_eq!(got, seqd(1, &[rec(1), other]));
        assert_eq!(end.batches, 2);
        assert_eq!(end.head, w.head());
    }

    #[test]
    fn damage_before_later_batches_is_an_error() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        let mut starts = Vec::new();
        for i in 0..5 {
            starts.push(sb.layout.journal.start + w.head());
            w.append(&dev, &[rec(i), big_rec(i, 100)]).unwrap();
        }
        for (k, &at) in starts.iter().enumerate() {
            let snapshot = dev.with_bytes(|b| b.clone());
            dev.flip(at + 50);
            let result = replay(&dev, &sb, 0, 1, 0, LaterBatches::Scan, &mut |_, _| Ok(()));
            if k + 1 < starts.len() {
                let err = result.unwrap_err();
                assert!(
                    matches!(err, Error::Corrupt { offset, .. } if offset == starts[k + 1]),
                    "batch {k}: {err}"
                );
            } else {
                // The last batch: indistinguishable from a torn tail.
                assert_eq!(result.unwrap().batches, 4);
            }
            dev.with_bytes(|b| *b = snapshot);
        }
        // Replaying from a checkpoint older than the journal's history (its
        // batches were overwritten): the later batches give it away.
        let err = replay(&dev, &sb, 0, 1, 12345, LaterBatches::Scan, &mut |_, _| {
            Ok(())
        })
        .unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    }

    /// Trusting a clean-unmount mark skips the scan only when replay found
    /// nothing: a batch after the checkpoint means the mark does not hold,
    /// and damage after that batch is still found.
    #[test]
    fn a_trusted_clean_mark_skips_the_scan_only_when_replay_finds_nothing() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let region = sb.layout.journal;
        let bytes_read = |later| {
            let before = dev.counters().snapshot().bytes_read;
            let result = replay(&dev, &sb, 0, 1, 0, later, &mut |_, _| Ok(()));
            (result, dev.counters().snapshot().bytes_read - before)
        };
        let (end, read) = bytes_read(LaterBatches::TrustCleanMark);
        assert_eq!(end.unwrap().batches, 0);
        assert_eq!(read, BS, "only the block where the first batch would be");
        let (_, read) = bytes_read(LaterBatches::Scan);
        assert!(read >= region.len, "{read}");

        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        let mut starts = Vec::new();
        for i in 0..3 {
            starts.push(region.start + w.head());
            w.append(&dev, &[rec(i)]).unwrap();
        }
        dev.flip(starts[1] + 50);
        let (result, _) = bytes_read(LaterBatches::TrustCleanMark);
        let err = result.unwrap_err();
        assert!(
            matches!(err, Error::Corrupt { offset, .. } if offset == starts[2]),
            "{err}"
        );
    }

    /// The writer told that the superblock holds a clean-unmount mark
    /// writes it cleared (FUA) before its first batch, and only then.
    #[test]
    fn the_first_append_clears_the_clean_mark_once() {
        let mut sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        sb.clean_mark = Some(crate::superblock::CleanMark {
            generation: 1,
            journal_start: 0,
            journal_seq: 1,
            journal_chain: 0,
        });
        crate::superblock::write_superblock(&dev, &sb).unwrap();
        let mut w = JournalWriter::new(&sb, 0, 1, 0);
        w.clear_clean_mark_first(&sb);
        // A refused append writes nothing, the superblock included.
        assert!(w.append(&dev, &[]).is_err());
        assert!(crate::superblock::read_superblock(&dev)
            .unwrap()
            .clean_mark
            .is_some());
        let before = dev.counters().snapshot();
        w.append(&dev, &[rec(1)]).unwrap();
        w.append(&dev, &[rec(2)]).unwrap();
        let after = dev.counters().snapshot();
        assert_eq!(after.fua_writes - before.fua_writes, 1);
        assert_eq!(after.writes - before.writes, 3);
        assert!(!w.clears_clean_mark_first());
        assert_eq!(
            crate::superblock::read_superblock(&dev).unwrap(),
            sb.without_clean_mark()
        );
    }

    #[test]
    fn full_journal_refuses_without_writing() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut w = JournalWriter::new(&sb, 3 * BS, 1, 0);
        let mut n = 0;
        let err = loop {
            match w.append(&dev, &[big_rec(n, 255), big_rec(n, 255)]) {
                Ok(_) => n += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert!(err.to_string().contains("journal"), "{err}");
        assert!(n > 3);
        let before = dev.counters().snapshot();
        let bytes = dev.with_bytes(|b| b.clone());
        let state = (w.head(), w.next_seq(), w.chain(), w.free_bytes());
        assert!(w.append(&dev, &[big_rec(0, 255), big_rec(0, 255)]).is_err());
        assert_eq!(dev.counters().snapshot(), before);
        assert!(dev.with_bytes(|b| *b == bytes));
        assert_eq!(state, (w.head(), w.next_seq(), w.chain(), w.free_bytes()));
        // Everything written replays.
        let (end, _) = collect(&dev, &sb, 3 * BS, 1, 0);
        assert_eq!(end.batches, n);
        // Moving the tail frees space.
        w.set_tail(w.head());
        assert_eq!(w.free_bytes(), sb.layout.journal.len - BS);
        w.append(&dev, &[rec(1)]).unwrap();
    }

    #[test]
    fn garbage_never_panics_or_replays() {
        let sb = sb();
        let dev = VecDevice::new(DEV_BYTES, 512);
        let mut rng = SmallRng::seed_from_u64(5);
        let j = sb.layout.journal;
        for _ in 0..200 {
            dev.with_bytes(|b| {
                for x in &mut b[j.start as usize..j.end() as usize] {
                    *x = rng.gen();
                }
                // Plausible headers everywhere.
                for blk in 0..JOURNAL_BLOCKS as usize {
                    let at = j.start as usize + blk * BS as usize;
                    b[at..at + 8].copy_from_slice(&BATCH_MAGIC);
                    b[at + 8..at + 16].copy_from_slice(&1u64.to_le_bytes());
                    b[at + 20..at + 24].copy_from_slice(&0u32.to_le_bytes());
                }
            });
            let (end, got) = collect(&dev, &sb, 0, 1, 0);
            assert!(got.is_empty());
            assert_eq!(end.head, 0);
        }
        assert!(
            replay(&dev, &sb, j.len, 1, 0, LaterBatches::Scan, &mut |_, _| Ok(
                ()
            ))
            .is_err()
        );
        assert!(replay(&dev, &sb, 100, 1, 0, LaterBatches::Scan, &mut |_, _| Ok(())).is_err());
    }

    /// Mount, append (flushing before each batch, and after the last or
    /// not), lose power, remount: replay always yields every flushed batch
    /// and the last one or not, across many wraps, torn batches and
    /// checkpoints, and never reports damage.
    #[test]
    fn power_cuts_yield_a_prefix() {
        let sb = sb();
        let mut dev = MemDevice::new(DEV_BYTES, 512);
        let mut rng = SmallRng::seed_from_u64(11);
        let mut ck = (0u64, 1u64, 0u32);
        // Records since the checkpoint; the first `durable` are flushed.
        let mut log: Vec<Record> = Vec::new();
        let mut durable = 0usize;
        let mut next_id = 0u64;
        let mut total_batches = 0;
        for cut in 0..400u64 {
            let (end, got) = collect(&dev, &sb, ck.0, ck.1, ck.2);
            assert!(got.len() >= durable && got.len() <= log.len(), "cut {cut}");
            assert_eq!(got, seqd(ck.1, &log[..got.len()]), "cut {cut}");
            log.truncate(got.len());
            durable = log.len();
            total_batches += end.batches;

            let mut w = JournalWriter::new(&sb, end.head, end.next_seq, end.chain);
            w.set_tail(ck.0);
            for _ in 0..rng.gen_range(1..6) {
                let batch: Vec<Record> = (0..rng.gen_range(1..4))
                    .map(|_| {
                        next_id += 1;
                        if rng.gen_bool(0.5) {
                            rec(next_id)
                        } else {
                            big_rec(next_id, rng.gen_range(1..=255))
                        }
                    })
                    .collect();
                // The contract: everything written before is durable.
                dev.flush().unwrap();
                durable = log.len();
                if w.batch_bytes(&batch) > w.free_bytes() {
                    ck = (w.head(), w.next_seq(), w.chain());
                    w.set_tail(w.head());
                    log.clear();
                    durable = 0;
                }
                w.append(&dev, &batch).unwrap();
                log.extend(batch);
            }
            if rng.gen_bool(0.3) {
                dev.flush().unwrap();
                durable = log.len();
            }
            dev = dev.power_cut_seeded(cut);
        }
        assert!(total_batches > 100, "{total_batches}");
    }
}
