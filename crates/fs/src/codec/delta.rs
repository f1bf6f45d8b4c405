//! A delta checkpoint's payload: the changes since the previous checkpoint
//! of its chain, as a [`MetaDelta`], preceded by the link to that
//! checkpoint (its generation and crc).
//!
//! Layout (little-endian): prev_generation u64, prev_crc u32, next_ino u64,
//! removed count u64 and that many inode numbers, changed count u64 and per
//! changed inode: span count u32, spans (start u64, end u64), then the inode
//! exactly as the image encodes it (its extents: those inside the spans).

use super::image::{
    check_extent, check_inode, decode_inode, encode_inode, inode_encoded_len,
    INODE_FIXED_ENCODED_LEN,
};
use super::primitive::{Decoder, Encoder, U32_BYTES, U64_BYTES};

use crate::error::{Error, Result};
use crate::types::{InodeDelta, KeySpan, MetaDelta};

/// Bytes of the link to the previous checkpoint: generation, crc.
pub const DELTA_LINK_ENCODED_LEN: usize = U64_BYTES + U32_BYTES;
/// Encoded size of one key span.
pub const SPAN_ENCODED_LEN: usize = 2 * U64_BYTES;
/// Encoded size of the payload's fixed part: link, next_ino, both counts.
const DELTA_FIXED_ENCODED_LEN: usize = DELTA_LINK_ENCODED_LEN + 3 * U64_BYTES;

/// The checkpoint a delta applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaLink {
    pub prev_generation: u64,
    pub prev_crc: u32,
}

/// Bytes [`encode_delta`] produces for `delta`.
pub fn delta_encoded_len(delta: &MetaDelta) -> u64 {
    let mut len = DELTA_FIXED_ENCODED_LEN as u64 + (delta.removed.len() * U64_BYTES) as u64;
    for c in &delta.changed {
        len += (U32_BYTES + c.spans.len() * SPAN_ENCODED_LEN) as u64 + inode_encoded_len(&c.inode);
    }
    len
}

/// Encodes a delta; fails (as the decoder would) on one that breaks the
/// rules [`decode_delta_at`] checks.
pub fn encode_delta(link: DeltaLink, delta: &MetaDelta) -> Result<Vec<u8>> {
    encode_delta_after(0, link, delta)
}

/// [`encode_delta`] after `room` zero bytes, which a caller fills with a
/// header (see [`super::encode_image_after`]).
pub fn encode_delta_after(room: usize, link: DeltaLink, delta: &MetaDelta) -> Result<Vec<u8>> {
    check_delta(delta).map_err(|reason| Error::invalid("encoding a delta checkpoint", reason))?;
    let mut enc = Encoder::with_capacity(room + delta_encoded_len(delta) as usize);
    enc.bytes(&vec![0; room]);
    enc.u64(link.prev_generation);
    enc.u32(link.prev_crc);
    enc.u64(delta.next_ino);
    enc.u64(delta.removed.len() as u64);
    for &ino in &delta.removed {
        enc.u64(ino);
    }
    enc.u64(delta.changed.len() as u64);
    for c in &delta.changed {
        enc.count_u32(c.spans.len(), "key spans")?;
        for &(start, end) in &c.spans {
            enc.u64(start);
            enc.u64(end);
        }
        encode_inode(&mut enc, &c.inode)?;
    }
    debug_assert_eq!((enc.len() - room) as u64, delta_encoded_len(delta));
    Ok(enc.into_bytes())
}

/// Decodes a delta payload read from device byte `base`.
pub fn decode_delta_at(bytes: &[u8], base: u64) -> Result<(DeltaLink, MetaDelta)> {
    let mut dec = Decoder::new(bytes, base, "delta checkpoint");
    let link = DeltaLink {
        prev_generation: dec.u64()?,
        prev_crc: dec.u32()?,
    };
    let next_ino = dec.u64()?;
    let removed_count = dec.count_u64(U64_BYTES, "removed inode")?;
    let mut removed = Vec::with_capacity(removed_count);
    for _ in 0..removed_count {
        let at = dec.position();
        let ino = dec.u64()?;
        if ino == 0 || removed.last().is_some_and(|&p| ino <= p) || ino >= next_ino {
            return Err(dec.error_at(
                at,
                format!("removed inode {ino}: zero, not sorted, or not below next_ino {next_ino}"),
            ));
        }
        removed.push(ino);
    }
    let changed_count = dec.count_u64(U32_BYTES + INODE_FIXED_ENCODED_LEN, "changed inode")?;
    let mut changed: Vec<InodeDelta> = Vec::with_capacity(changed_count);
    for _ in 0..changed_count {
        let at = dec.position();
        let span_count = dec.count_u32(SPAN_ENCODED_LEN, "key span")?;
        let mut spans: Vec<KeySpan> = Vec::with_capacity(span_count);
        for _ in 0..span_count {
            spans.push((dec.u64()?, dec.u64()?));
        }
        let inode = decode_inode(&mut dec)?;
        let ino = inode.ino;
        if ino >= next_ino
            || changed.last().is_some_and(|p| ino <= p.inode.ino)
            || removed.binary_search(&ino).is_ok()
        {
            return Err(dec.error_at(
                at,
                format!("changed inode {ino}: not sorted, also removed, or not below next_ino {next_ino}"),
            ));
        }
        let c = InodeDelta { spans, inode };
        check_spans(&c).map_err(|reason| dec.error_at(at, format!("inode {ino}: {reason}")))?;
        changed.push(c);
    }
    dec.finish()?;
    Ok((
        link,
        MetaDelta {
            next_ino,
            removed,
            changed,
        },
    ))
}

/// Spans sorted, disjoint and each non-empty; every extent starts in one.
fn check_spans(c: &InodeDelta) -> std::result::Result<(), String> {
    let mut prev_end = 0u64;
    for (i, &(start, end)) in c.spans.iter().enumerate() {
        if start >= end || (i > 0 && start < prev_end) {
            return Err(format!(
                "key span [{start}, {end}) is empty, unsorted or overlaps the previous one"
            ));
        }
        prev_end = end;
    }
    let mut span = 0;
    for e in &c.inode.extents {
        while span < c.spans.len() && c.spans[span].1 <= e.file_off {
            span += 1;
        }
        if span == c.spans.len() || e.file_off < c.spans[span].0 {
            return Err(format!(
                "extent at file offset {} is outside every key span",
                e.file_off
            ));
        }
    }
    Ok(())
}

fn check_delta(delta: &MetaDelta) -> std::result::Result<(), String> {
    let mut prev = 0;
    for &ino in &delta.removed {
        if ino == 0 || ino <= prev || ino >= delta.next_ino {
            return Err(format!("removed inode {ino}: zero, unsorted or too big"));
        }
        prev = ino;
    }
    let mut prev = 0;
    for c in &delta.changed {
        let ino = c.inode.ino;
        if ino == 0
            || ino <= prev
            || ino >= delta.next_ino
            || delta.removed.binary_search(&ino).is_ok()
        {
            return Err(format!(
                "changed inode {ino}: zero, unsorted, removed or too big"
            ));
        }
        prev = ino;
        check_inode(&c.inode)?;
        let mut last = None;
        for e in &c.inode.extents {
            check_extent(e, last).map_err(|r| format!("inode {ino}: {r}"))?;
            last = Some(e);
        }
        check_spans(c).map_err(|r| format!("inode {ino}: {r}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::image::tests::random_image;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// A delta of some of `random_image`'s inodes, extents cut into spans.
    pub(crate) fn random_delta(rng: &mut SmallRng, inodes: usize) -> MetaDelta {
        let image = random_image(rng, inodes);
        let mut delta = MetaDelta {
            next_ino: image.next_ino,
            ..MetaDelta::default()
        };
        for inode in image.inodes {
            if rng.gen_bool(0.2) {
                delta.removed.push(inode.ino);
                continue;
            }
            let spans = match inode.extents.first() {
                Some(first) if rng.gen() => vec![(first.file_off, u64::MAX)],
                _ => vec![(0, u64::MAX)],
            };
            delta.changed.push(InodeDelta { spans, inode });
        }
        delta
    }

    #[test]
    fn delta_round_trip_and_damage() {
        let mut rng = SmallRng::seed_from_u64(5);
        let link = DeltaLink {
            prev_generation: 9,
            prev_crc: 0xdead_beef,
        };
        for n in [0, 1, 10, 60] {
            let delta = random_delta(&mut rng, n);
            let bytes = encode_delta(link, &delta).unwrap();
            assert_eq!(bytes.len() as u64, delta_encoded_len(&delta));
            assert_eq!(decode_delta_at(&bytes, 0).unwrap(), (link, delta));
            for cut in 0..bytes.len() {
                assert!(decode_delta_at(&bytes[..cut], 0).is_err(), "cut {cut}");
            }
            for _ in 0..2000 {
                let mut b = bytes.clone();
                let i = rng.gen_range(0..b.len());
                b[i] = rng.gen();
                let _ = decode_delta_at(&b, 0);
            }
        }
    }

    /// An extent outside every span, unsorted spans and an inode both
    /// removed and changed are refused by the encoder and the decoder.
    #[test]
    fn forged_spans_are_refused() {
        let mut rng = SmallRng::seed_from_u64(6);
        let link = DeltaLink {
            prev_generation: 1,
            prev_crc: 1,
        };
        let mut delta = random_delta(&mut rng, 40);
        let with_extents = delta
            .changed
            .iter()
            .position(|c| c.inode.extents.first().is_some_and(|e| e.file_off > 0))
            .unwrap();
        let first = delta.changed[with_extents].inode.extents[0].file_off;
        delta.changed[with_extents].spans = vec![(first, u64::MAX)];
        let good = encode_delta(link, &delta).unwrap();
        delta.changed[with_extents].spans = vec![(first + 1, u64::MAX)];
        assert!(encode_delta(link, &delta).is_err());
        // The same forgery written by hand: the decoder refuses it.
        let mut forged = good.clone();
        let at = find_span(&good, first).unwrap();
        forged[at..at + 8].copy_from_slice(&(first + 1).to_le_bytes());
        let err = decode_delta_at(&forged, 0).unwrap_err();
        assert!(err.to_string().contains("outside every key span"), "{err}");
        // An empty span.
        let mut forged = good.clone();
        forged[at + 8..at + 16].copy_from_slice(&first.to_le_bytes());
        let err = decode_delta_at(&forged, 0).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
    }

    /// Where the span `(start, u64::MAX)` is encoded.
    fn find_span(bytes: &[u8], start: u64) -> Option<usize> {
        let mut want = start.to_le_bytes().to_vec();
        want.extend_from_slice(&u64::MAX.to_le_bytes());
        bytes.windows(16).position(|w| w == want.as_slice())
    }
}
