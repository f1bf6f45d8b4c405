//! Extent pages: one file's extents under a range of keys, stored as one
//! unit in the data area, and the references a checkpoint root keeps to
//! them (issue 13, item 4).
//!
//! A page is what one in-memory extent chunk holds (at most
//! [`PAGE_MAX_EXTENTS`]), so a checkpoint writes the chunks changed since
//! the page it last wrote for them and refers to the rest. A page is
//! written once, to blocks nothing listed, and never rewritten; the
//! reference names its crc, so a page whose blocks were reused, torn or
//! left by an earlier page at the same address does not verify.
//!
//! Layout (little-endian), padded with zeros to the block size:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `"IOMAPPG1"` |
//! | 8 | 8 | inode number |
//! | 16 | 8 | first key: file offset of the first extent |
//! | 24 | 4 | extent count, 1..=[`PAGE_MAX_EXTENTS`] |
//! | 28 | 4 | crc: `crc32c_append(seed, bytes [0, 28) then the extents)` |
//! | 32 | 25 each | extents as the image stores them |
//!
//! A reference ([`PageRef`], [`PAGE_REF_ENCODED_LEN`] bytes): device
//! address u64, crc u32, count u32, first key u64, allocated bytes u64.
//! The crc is seeded with the volume uuid as every checkpoint crc is; the
//! codec takes the seed, not the superblock.

use super::image::{
    check_extent, decode_extent, encode_extent, extent_from_record, EXTENT_ENCODED_LEN,
};
use super::primitive::{Decoder, Encoder};
use crate::error::{Error, Result};
use crate::types::{Extent, Ino};

/// First 8 bytes of an extent page.
pub const PAGE_MAGIC: [u8; 8] = *b"IOMAPPG1";
/// Most extents in one page: the largest extent chunk.
pub const PAGE_MAX_EXTENTS: usize = 512;
/// Bytes of a page before its extents.
pub const PAGE_HEADER_LEN: usize = 32;
/// Bytes of one [`PageRef`] as a root stores it.
pub const PAGE_REF_ENCODED_LEN: usize = 32;

const OFF_CRC: usize = 28;
const WHAT: &str = "extent page";

/// Where a page is and what it must hold: what a checkpoint root lists per
/// page, enough to check the page without trusting it and to account for
/// the file's space without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// Device byte of the page (block-aligned, in the data area).
    pub addr: u64,
    pub crc: u32,
    pub count: u32,
    pub first_key: u64,
    /// Device bytes the page's extents map.
    pub allocated: u64,
}

/// Where pages and index pages may be: device bytes `[start, start +
/// len)`, in blocks of `block_size` (the data area).
#[derive(Clone, Copy, Debug)]
pub struct PageArea {
    pub start: u64,
    pub len: u64,
    pub block_size: u64,
}

impl PageArea {
    /// Why `page` is not a whole, block-aligned range of the area.
    pub fn check(&self, page: &PageRef) -> std::result::Result<(), String> {
        let len = page_len(page.count as usize, self.block_size);
        self.check_range("page", page.addr, len)
    }

    pub(super) fn check_range(
        &self,
        what: &str,
        addr: u64,
        len: u64,
    ) -> std::result::Result<(), String> {
        let inside = addr >= self.start
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.start.saturating_add(self.len));
        if !addr.is_multiple_of(self.block_size) || !inside {
            return Err(format!(
                "{what} at device byte {addr} ({len} bytes) is not a {}-byte aligned range of the data area {}+{}",
                self.block_size, self.start, self.len
            ));
        }
        Ok(())
    }
}

/// Device bytes a page of `count` extents takes: whole blocks.
pub fn page_len(count: usize, block_size: u64) -> u64 {
    ((PAGE_HEADER_LEN + count * EXTENT_ENCODED_LEN) as u64).next_multiple_of(block_size)
}

/// The bytes of a page holding `extents` of inode `ino` (padded to
/// `block_size`), and its reference once written at `addr`. Refuses what
/// [`decode_page`] would: no extents, more than [`PAGE_MAX_EXTENTS`], or
/// extents that are empty, overflow, or are not sorted and disjoint.
pub fn encode_page(
    seed: u32,
    ino: Ino,
    extents: &[Extent],
    block_size: u64,
    addr: u64,
) -> Result<(Vec<u8>, PageRef)> {
    let invalid = |reason: String| Error::invalid(format!("encoding inode {ino}'s page"), reason);
    if extents.is_empty() || extents.len() > PAGE_MAX_EXTENTS {
        return Err(invalid(format!(
            "{} extents, not 1..={PAGE_MAX_EXTENTS}",
            extents.len()
        )));
    }
    let len = page_len(extents.len(), block_size);
    let mut enc = Encoder::with_capacity(len as usize);
    enc.bytes(&PAGE_MAGIC);
    enc.u64(ino);
    enc.u64(extents[0].file_off);
    enc.u32(extents.len() as u32);
    enc.u32(0);
    let mut allocated = 0u64;
    let mut prev = None;
    for e in extents {
        check_extent(e, prev).map_err(invalid)?;
        prev = Some(e);
        // Disjoint extents on a u64 device cannot sum past u64::MAX.
        allocated += e.len;
        encode_extent(&mut enc, e);
    }
    let mut bytes = enc.into_bytes();
    let crc = page_crc(seed, &bytes);
    bytes[OFF_CRC..PAGE_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    bytes.resize(len as usize, 0);
    let page = PageRef {
        addr,
        crc,
        count: extents.len() as u32,
        first_key: extents[0].file_off,
        allocated,
    };
    Ok((bytes, page))
}

/// The crc of a page's bytes (header and extents), its crc field as zero.
fn page_crc(seed: u32, bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c_append(seed, &bytes[..OFF_CRC]);
    crc32c::crc32c_append(crc, &bytes[PAGE_HEADER_LEN..])
}

/// The extents of the page `page` names, from `bytes` read at its address
/// (at least [`page_len`] of its count). Checks everything the reference
/// promises (inode, first key, count, crc, allocated bytes) and every
/// extent, allocating nothing before the count is known to fit. An error
/// names the inode and the keys the page held: what its damage loses.
pub fn decode_page(seed: u32, bytes: &[u8], ino: Ino, page: &PageRef) -> Result<Vec<Extent>> {
    let lost = |at: u64, reason: String| page_lost(ino, page, at, reason);
    let mut dec = Decoder::new(bytes, page.addr, WHAT);
    let fail = |e: Error| match e {
        Error::Corrupt { offset, reason, .. } => lost(offset, reason),
        other => other,
    };
    let magic: [u8; 8] = dec.array().map_err(fail)?;
    if magic != PAGE_MAGIC {
        return Err(lost(page.addr, format!("bad magic {magic:02x?}")));
    }
    let (page_ino, first_key, count) = (
        dec.u64().map_err(fail)?,
        dec.u64().map_err(fail)?,
        dec.u32().map_err(fail)?,
    );
    let stored_crc = dec.u32().map_err(fail)?;
    if page_ino != ino || first_key != page.first_key || count != page.count {
        return Err(lost(
            page.addr,
            format!(
                "it holds inode {page_ino}, {count} extents from file offset {first_key}: \
                 not the page the root names (a stale or reused page)"
            ),
        ));
    }
    let n = count as usize;
    if n == 0 || n > PAGE_MAX_EXTENTS || n * EXTENT_ENCODED_LEN > dec.remaining() {
        return Err(lost(
            page.addr,
            format!(
                "{count} extents do not fit 1..={PAGE_MAX_EXTENTS} and the {} bytes read",
                dec.remaining()
            ),
        ));
    }
    let body = &bytes[..PAGE_HEADER_LEN + n * EXTENT_ENCODED_LEN];
    let crc = page_crc(seed, body);
    if crc != stored_crc || crc != page.crc {
        return Err(lost(
            page.addr,
            format!(
                "crc32c mismatch (stored {stored_crc:#010x}, listed {:#010x}, computed {crc:#010x})",
                page.crc
            ),
        ));
    }
    let mut extents: Vec<Extent> = Vec::with_capacity(n);
    let mut allocated = 0u64;
    let records = body[PAGE_HEADER_LEN..].chunks_exact(EXTENT_ENCODED_LEN);
    for (i, record) in records.enumerate() {
        let at = page.addr + (PAGE_HEADER_LEN + i * EXTENT_ENCODED_LEN) as u64;
        let record: &[u8; EXTENT_ENCODED_LEN] = record.try_into().expect("exact chunks");
        let e = match extent_from_record(record) {
            Some(e) => e,
            None => decode_extent(&mut Decoder::new(record, at, WHAT)).map_err(fail)?,
        };
        check_extent(&e, extents.last()).map_err(|reason| lost(at, reason))?;
        allocated += e.len;
        extents.push(e);
    }
    if extents[0].file_off != first_key {
        return Err(lost(
            page.addr,
            format!(
                "its first extent is at file offset {}, not its first key",
                extents[0].file_off
            ),
        ));
    }
    if allocated != page.allocated {
        return Err(lost(
            page.addr,
            format!(
                "its extents map {allocated} bytes, the root lists {}",
                page.allocated
            ),
        ));
    }
    Ok(extents)
}

/// The error for inode `ino`'s page `page`, damaged at device byte `at`:
/// it names what is lost, the inode and the keys the page held.
pub fn page_lost(ino: Ino, page: &PageRef, at: u64, reason: impl std::fmt::Display) -> Error {
    Error::corrupt(
        WHAT,
        at,
        format!(
            "inode {ino}: the page of {} extents from file offset {} is lost: {reason}",
            page.count, page.first_key
        ),
    )
}

/// Appends `page` as a root lists it.
pub fn encode_page_ref(enc: &mut Encoder, page: &PageRef) {
    enc.u64(page.addr);
    enc.u32(page.crc);
    enc.u32(page.count);
    enc.u64(page.first_key);
    enc.u64(page.allocated);
}

/// One reference as [`encode_page_ref`] writes it, unchecked (see
/// [`check_page_refs`]).
pub fn decode_page_ref(dec: &mut Decoder<'_>) -> Result<PageRef> {
    Ok(PageRef {
        addr: dec.u64()?,
        crc: dec.u32()?,
        count: dec.u32()?,
        first_key: dec.u64()?,
        allocated: dec.u64()?,
    })
}

/// The rules one file's page list follows, checked before any page is
/// read: counts in 1..=[`PAGE_MAX_EXTENTS`], first keys strictly
/// increasing, allocated bytes at least the count (no extent is empty)
/// and not overflowing in sum. Where the pages sit is the caller's to
/// check (it knows the data area).
pub fn check_page_refs(pages: &[PageRef]) -> std::result::Result<(), String> {
    let mut total = 0u64;
    for (i, p) in pages.iter().enumerate() {
        if p.count == 0 || p.count as usize > PAGE_MAX_EXTENTS {
            return Err(format!(
                "page #{i} lists {} extents, not 1..={PAGE_MAX_EXTENTS}",
                p.count
            ));
        }
        if p.allocated < u64::from(p.count) {
            return Err(format!(
                "page #{i} lists {} extents mapping only {} bytes",
                p.count, p.allocated
            ));
        }
        if i > 0 && pages[i - 1].first_key >= p.first_key {
            return Err(format!(
                "page #{i} starts at file offset {}, not after page #{} at {}",
                p.first_key,
                i - 1,
                pages[i - 1].first_key
            ));
        }
        total = total
            .checked_add(p.allocated)
            .ok_or_else(|| format!("page #{i}: allocated bytes overflow"))?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::types::ExtentState;
    use proptest::prelude::*;

    const SEED: u32 = 0x1234_5678;
    const BS: u64 = 4096;

    /// `n` sorted, disjoint extents from file offset `first`, with gaps.
    /// `n` sorted extents from file offset `first`, written and unwritten.
    pub(crate) fn extents(first: u64, n: usize) -> Vec<Extent> {
        (0..n as u64)
            .map(|i| Extent {
                file_off: first + i * 3 * BS,
                len: BS * (1 + i % 2),
                addr: (1 << 30) + i * 7 * BS,
                state: if i % 3 == 0 {
                    ExtentState::Unwritten
                } else {
                    ExtentState::Written
                },
            })
            .collect()
    }

    #[test]
    fn a_page_decodes_to_the_extents_it_was_encoded_from() {
        for n in [1, 7, PAGE_MAX_EXTENTS] {
            let ext = extents(5 * BS, n);
            let (bytes, page) = encode_page(SEED, 42, &ext, BS, 8 * BS).unwrap();
            assert_eq!(bytes.len() as u64, page_len(n, BS));
            assert_eq!(bytes.len() as u64 % BS, 0);
            assert_eq!(page.addr, 8 * BS);
            assert_eq!(page.count as usize, n);
            assert_eq!(page.first_key, 5 * BS);
            assert_eq!(page.allocated, ext.iter().map(|e| e.len).sum::<u64>());
            assert_eq!(decode_page(SEED, &bytes, 42, &page).unwrap(), ext);
        }
    }

    /// Every byte a page's crc covers, flipped alone, makes the page fail
    /// with an error naming the inode and the keys lost; the padding is
    /// not covered and does not matter.
    #[test]
    fn any_damaged_byte_of_a_page_is_reported_with_the_keys_it_loses() {
        let ext = extents(9 * BS, 5);
        let (bytes, page) = encode_page(SEED, 7, &ext, BS, 0).unwrap();
        let body = PAGE_HEADER_LEN + ext.len() * EXTENT_ENCODED_LEN;
        for i in 0..body {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            let err = decode_page(SEED, &bad, 7, &page).unwrap_err().to_string();
            assert!(
                err.contains("inode 7") && err.contains(&format!("from file offset {}", 9 * BS)),
                "byte {i}: {err}"
            );
        }
        let mut padded = bytes.clone();
        padded[body] = 0xff;
        assert_eq!(decode_page(SEED, &padded, 7, &page).unwrap(), ext);
    }

    /// A forged page whose crc verifies is still checked record by
    /// record: an unknown extent state, an empty, overflowing or
    /// unsorted extent, each reported at the device byte of the record
    /// that holds it, with the keys lost.
    #[test]
    fn a_forged_page_with_a_valid_crc_is_refused_at_its_bad_record() {
        let ext = extents(9 * BS, 6);
        let (bytes, page) = encode_page(SEED, 7, &ext, BS, 64 * BS).unwrap();
        let record = |i: usize| PAGE_HEADER_LEN + i * EXTENT_ENCODED_LEN;
        let body = record(ext.len());
        let forge = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut bad = bytes.clone();
            edit(&mut bad);
            let crc = page_crc(SEED, &bad[..body]);
            bad[OFF_CRC..PAGE_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
            let err = decode_page(SEED, &bad, 7, &PageRef { crc, ..page }).unwrap_err();
            let Error::Corrupt { offset, reason, .. } = &err else {
                panic!("{err:?}");
            };
            assert!(
                reason.contains(&format!("from file offset {}", 9 * BS)),
                "{reason}"
            );
            (*offset, reason.clone())
        };
        let (at, reason) = forge(&|b| b[record(3) + 24] = 9);
        assert_eq!(at, 64 * BS + record(3) as u64 + 24, "{reason}");
        assert!(reason.contains("unknown extent state 9"), "{reason}");
        let (at, reason) = forge(&|b| b[record(2) + 8..record(2) + 16].fill(0));
        assert_eq!(at, 64 * BS + record(2) as u64, "{reason}");
        assert!(reason.contains("empty extent"), "{reason}");
        let (at, reason) = forge(&|b| b[record(4) + 16..record(4) + 24].fill(0xff));
        assert_eq!(at, 64 * BS + record(4) as u64, "{reason}");
        assert!(reason.contains("overflows"), "{reason}");
        let (at, reason) = forge(&|b| b[record(5)..record(5) + 8].fill(0));
        assert_eq!(at, 64 * BS + record(5) as u64, "{reason}");
        assert!(reason.contains("overlaps or precedes"), "{reason}");
    }

    /// A page that verifies on its own but is not the one the reference
    /// names (another inode's, a stale page at the same address, another
    /// volume's) is refused.
    #[test]
    fn a_page_other_than_the_one_listed_is_refused() {
        let ext = extents(0, 4);
        let (bytes, page) = encode_page(SEED, 3, &ext, BS, 0).unwrap();
        assert!(decode_page(SEED, &bytes, 4, &page).is_err(), "other inode");
        assert!(
            decode_page(SEED ^ 1, &bytes, 3, &page).is_err(),
            "other volume"
        );
        // Same inode, keys and count, other extents: an older page there.
        let mut older = ext.clone();
        older[2].addr += BS;
        let (stale, _) = encode_page(SEED, 3, &older, BS, 0).unwrap();
        let err = decode_page(SEED, &stale, 3, &page).unwrap_err().to_string();
        assert!(err.contains("crc32c mismatch"), "{err}");
        for wrong in [
            PageRef { count: 3, ..page },
            PageRef {
                first_key: BS,
                ..page
            },
            PageRef {
                allocated: page.allocated + BS,
                ..page
            },
        ] {
            assert!(decode_page(SEED, &bytes, 3, &wrong).is_err(), "{wrong:?}");
        }
        assert!(decode_page(SEED, &bytes[..PAGE_HEADER_LEN + 10], 3, &page).is_err());
    }

    #[test]
    fn what_would_not_decode_is_not_encoded() {
        assert!(encode_page(SEED, 1, &[], BS, 0).is_err());
        assert!(encode_page(SEED, 1, &extents(0, PAGE_MAX_EXTENTS + 1), BS, 0).is_err());
        let mut unsorted = extents(0, 3);
        unsorted.swap(0, 1);
        assert!(encode_page(SEED, 1, &unsorted, BS, 0).is_err());
    }

    #[test]
    fn a_page_list_is_checked_before_any_page_is_read() {
        let page = |first_key, count, allocated| PageRef {
            addr: 0,
            crc: 0,
            count,
            first_key,
            allocated,
        };
        assert!(check_page_refs(&[page(0, 1, BS), page(BS, 512, 512 * BS)]).is_ok());
        for (bad, why) in [
            (vec![page(0, 0, BS)], "no extents"),
            (vec![page(0, 513, 513 * BS)], "too many"),
            (vec![page(0, 4, 3)], "fewer bytes than extents"),
            (vec![page(BS, 1, BS), page(BS, 1, BS)], "same first key"),
            (vec![page(2 * BS, 1, BS), page(BS, 1, BS)], "not sorted"),
            (vec![page(0, 1, u64::MAX), page(BS, 1, 1)], "overflow"),
        ] {
            assert!(check_page_refs(&bad).is_err(), "{why}");
        }
        let mut enc = Encoder::new();
        let listed = page(3 * BS, 9, 40 * BS);
        encode_page_ref(&mut enc, &listed);
        assert_eq!(enc.len(), PAGE_REF_ENCODED_LEN);
        let mut dec = Decoder::new(enc.as_bytes(), 0, "test");
        assert_eq!(decode_page_ref(&mut dec).unwrap(), listed);
    }

    proptest! {
        /// Hostile bytes under any reference: an error or extents that
        /// match the reference, never a panic or an allocation the bytes
        /// cannot back.
        #[test]
        fn hostile_page_bytes_never_panic(
            mut bytes in proptest::collection::vec(any::<u8>(), 0..600),
            count in 0u32..1000,
            first_key in any::<u64>(),
            keep_header in any::<bool>(),
        ) {
            let ext = extents(first_key % (1 << 40), 3);
            let (good, page) = encode_page(SEED, 5, &ext, 512, 0).unwrap();
            if keep_header {
                let n = bytes.len().min(PAGE_HEADER_LEN);
                bytes[..n].copy_from_slice(&good[..n]);
            }
            for listed in [page, PageRef { count, first_key, ..page }] {
                if let Ok(got) = decode_page(SEED, &bytes, 5, &listed) {
                    prop_assert_eq!(got.len(), listed.count as usize);
                    prop_assert_eq!(got[0].file_off, listed.first_key);
                }
            }
        }
    }
}
