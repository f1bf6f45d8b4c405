//! Extent index pages: one more level between a checkpoint root and a
//! file's extent pages ([`super::page`]), so that neither the root nor the
//! memory a mount spends follows the number of pages (`docs/EXTENT_PAGES.md`,
//! "Memory that still grows with the extent count").
//!
//! An index page holds the [`PageRef`]s of a run of consecutive pages of
//! one file; the root lists per paged file its index pages ([`IndexRef`]).
//! A reference carries what the run sums to (extents, allocated bytes,
//! device bytes of its pages), so a file's length, its allocated bytes and
//! the space its pages take are known without reading the index page. As
//! a page is, an index page is written once, to blocks nothing listed, and
//! the reference names its crc, so a reused, torn or stale block at the
//! address does not verify.
//!
//! Every index page is written twice, to two blocks (its *copies*; the
//! bytes do not name their address, so both are the same): most index
//! pages are listed by both slots' bases, so one that does not verify
//! would otherwise leave no checkpoint to mount. A reader takes the first
//! copy that verifies.
//!
//! Layout (little-endian), exactly one block, padded with zeros:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `"IOMAPIX2"` |
//! | 8 | 8 | inode number |
//! | 16 | 8 | first key: the first page's first key |
//! | 24 | 4 | page count, 1..=[`index_max_pages`] |
//! | 28 | 4 | crc: `crc32c_append(seed, bytes [0, 28) then the page references)` |
//! | 32 | 32 each | the [`PageRef`]s, as a root encodes them |
//!
//! A reference ([`IndexRef`], [`INDEX_REF_ENCODED_LEN`] bytes): device
//! address u64, crc u32, page count u32, first key u64 (the first fields
//! of a [`PageRef`] as a root stores it), extents u64, allocated bytes
//! u64, page bytes u64, the copy's device address u64.

use super::page::{
    check_page_refs, decode_page_ref, encode_page_ref, page_len, PageArea, PageRef,
    PAGE_MAX_EXTENTS, PAGE_REF_ENCODED_LEN,
};
use super::primitive::{Decoder, Encoder};
use crate::error::{Error, Result};
use crate::types::Ino;

/// First 8 bytes of an index page.
pub const INDEX_MAGIC: [u8; 8] = *b"IOMAPIX2";
/// Bytes of an index page before its page references.
pub const INDEX_HEADER_LEN: usize = 32;
/// Bytes of one [`IndexRef`] as a root stores it.
pub const INDEX_REF_ENCODED_LEN: usize = 56;
/// Blocks each index page is written to ([`IndexRef::blocks`]).
pub const INDEX_COPIES: usize = 2;

const OFF_CRC: usize = 28;
const WHAT: &str = "extent index page";

/// Most page references one index page holds at `block_size`: what a
/// single block keeps after the header (127 at 4 KiB, 15 at 512 bytes).
pub fn index_max_pages(block_size: u64) -> usize {
    usize::try_from(block_size)
        .unwrap_or(usize::MAX)
        .saturating_sub(INDEX_HEADER_LEN)
        / PAGE_REF_ENCODED_LEN
}

/// Per file with index pages, sorted by inode number: its index pages in
/// key order.
pub type IndexTable = Vec<(Ino, Vec<IndexRef>)>;

/// Where an index page is and what its run of pages sums to: what a root
/// lists per index page, enough to check the index page without trusting
/// it, and to know the run's extents and space without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexRef {
    /// Device byte of the index page (block-aligned, one block, in the
    /// data area).
    pub addr: u64,
    /// Device byte of its copy: the same bytes in another block.
    pub copy: u64,
    pub crc: u32,
    /// Page references in the index page.
    pub pages: u32,
    /// The first page's first key.
    pub first_key: u64,
    /// Extents of its pages, in sum.
    pub extents: u64,
    /// Device bytes its pages' extents map, in sum.
    pub allocated: u64,
    /// Device bytes its pages take ([`page_len`] of each), in sum.
    pub page_bytes: u64,
}

impl IndexRef {
    /// The blocks holding the index page, the first to read first.
    pub fn blocks(&self) -> [u64; INDEX_COPIES] {
        [self.addr, self.copy]
    }
}

/// What `pages` sum to: extents, allocated bytes and page bytes at
/// `block_size`; `None` on overflow (only a hostile list gets there).
fn sums(pages: &[PageRef], block_size: u64) -> Option<(u64, u64, u64)> {
    pages
        .iter()
        .try_fold((0u64, 0u64, 0u64), |(extents, allocated, bytes), p| {
            Some((
                extents.checked_add(u64::from(p.count))?,
                allocated.checked_add(p.allocated)?,
                bytes.checked_add(page_len(p.count as usize, block_size))?,
            ))
        })
}

/// The crc of an index page's header and references, its crc field left
/// out (as a page's is).
fn index_crc(seed: u32, body: &[u8]) -> u32 {
    let crc = crc32c::crc32c_append(seed, &body[..OFF_CRC]);
    crc32c::crc32c_append(crc, &body[INDEX_HEADER_LEN..])
}

/// The bytes of the index page (one block of `block_size`) listing
/// `pages` of inode `ino`, and its reference once written at both of
/// `blocks` (the same bytes in each).
/// Refuses what [`decode_index_page`] would, but for where the pages are:
/// no pages, more than [`index_max_pages`], or a list
/// [`check_page_refs`] refuses.
pub fn encode_index_page(
    seed: u32,
    ino: Ino,
    pages: &[PageRef],
    block_size: u64,
    [addr, copy]: [u64; INDEX_COPIES],
) -> Result<(Vec<u8>, IndexRef)> {
    let invalid =
        |reason: String| Error::invalid(format!("encoding inode {ino}'s index page"), reason);
    let max = index_max_pages(block_size);
    if pages.is_empty() || pages.len() > max {
        return Err(invalid(format!(
            "{} pages, not 1..={max} at a block of {block_size} bytes",
            pages.len()
        )));
    }
    check_page_refs(pages).map_err(invalid)?;
    let (extents, allocated, page_bytes) =
        sums(pages, block_size).ok_or_else(|| invalid("the pages' sums overflow".to_string()))?;
    // max >= 1 above, so the block holds the header and every reference.
    let len = block_size as usize;
    let mut enc = Encoder::with_capacity(len);
    enc.bytes(&INDEX_MAGIC);
    enc.u64(ino);
    enc.u64(pages[0].first_key);
    enc.u32(pages.len() as u32);
    enc.u32(0);
    for p in pages {
        encode_page_ref(&mut enc, p);
    }
    let mut bytes = enc.into_bytes();
    let crc = index_crc(seed, &bytes);
    bytes[OFF_CRC..INDEX_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    bytes.resize(len, 0);
    let index = IndexRef {
        addr,
        copy,
        crc,
        pages: pages.len() as u32,
        first_key: pages[0].first_key,
        extents,
        allocated,
        page_bytes,
    };
    Ok((bytes, index))
}

/// The page references of the index page `index` names, from `bytes`
/// read at device byte `at` (one of its [`IndexRef::blocks`]). Checks everything the reference
/// promises (inode, first key, page count, crc, and what the pages sum
/// to), that the list follows [`check_page_refs`] and that every page
/// lies in `area`, allocating nothing before the count is known to fit.
/// Every error is at `at` and names the inode and the keys its run held:
/// what its damage loses.
pub fn decode_index_page(
    seed: u32,
    bytes: &[u8],
    ino: Ino,
    index: &IndexRef,
    at: u64,
    area: PageArea,
) -> Result<Vec<PageRef>> {
    let lost = |reason: String| index_lost(ino, index, at, reason);
    let fail = |e: Error| match e {
        Error::Corrupt { reason, .. } => lost(reason),
        other => other,
    };
    let mut dec = Decoder::new(bytes, at, WHAT);
    let magic: [u8; 8] = dec.array().map_err(fail)?;
    if magic != INDEX_MAGIC {
        return Err(lost(format!("bad magic {magic:02x?}")));
    }
    let (page_ino, first_key, count) = (
        dec.u64().map_err(fail)?,
        dec.u64().map_err(fail)?,
        dec.u32().map_err(fail)?,
    );
    let stored_crc = dec.u32().map_err(fail)?;
    if page_ino != ino || first_key != index.first_key || count != index.pages {
        return Err(lost(format!(
            "it holds inode {page_ino}, {count} pages from file offset {first_key}: \
             not the index page the root names (a stale or reused block)"
        )));
    }
    let n = count as usize;
    let max = index_max_pages(area.block_size);
    if n == 0 || n > max || n * PAGE_REF_ENCODED_LEN > dec.remaining() {
        return Err(lost(format!(
            "{count} pages do not fit 1..={max} and the {} bytes read",
            dec.remaining()
        )));
    }
    let body = &bytes[..INDEX_HEADER_LEN + n * PAGE_REF_ENCODED_LEN];
    let crc = index_crc(seed, body);
    if crc != stored_crc || crc != index.crc {
        return Err(lost(format!(
            "crc32c mismatch (stored {stored_crc:#010x}, listed {:#010x}, computed {crc:#010x})",
            index.crc
        )));
    }
    let mut pages = Vec::with_capacity(n);
    for _ in 0..n {
        pages.push(decode_page_ref(&mut dec).map_err(fail)?);
    }
    // The list's rules first: they bound each page's count, which its
    // place in the area is computed from.
    check_page_refs(&pages).map_err(lost)?;
    for (i, page) in pages.iter().enumerate() {
        area.check(page)
            .map_err(|reason| lost(format!("page #{i}: {reason}")))?;
    }
    if pages[0].first_key != first_key {
        return Err(lost(format!(
            "its first page is at file offset {}, not its first key",
            pages[0].first_key
        )));
    }
    let listed = (index.extents, index.allocated, index.page_bytes);
    match sums(&pages, area.block_size) {
        Some(got) if got == listed => Ok(pages),
        got => Err(lost(format!(
            "its pages hold (extents, allocated bytes, page bytes) {got:?}, the root lists {listed:?}"
        ))),
    }
}

/// The error for inode `ino`'s index page `index`, damaged at device byte
/// `at` (one of its copies): it names the inode and the run of keys whose
/// pages that copy does not give.
pub fn index_lost(ino: Ino, index: &IndexRef, at: u64, reason: String) -> Error {
    Error::corrupt(
        WHAT,
        at,
        format!(
            "inode {ino}: the index page at device byte {at} does not verify, so it does not \
             give its {} pages ({} extents from file offset {}): {reason}",
            index.pages, index.extents, index.first_key
        ),
    )
}

/// Appends `index` as a root lists it.
pub fn encode_index_ref(enc: &mut Encoder, r: &IndexRef) {
    enc.u64(r.addr);
    enc.u32(r.crc);
    enc.u32(r.pages);
    enc.u64(r.first_key);
    enc.u64(r.extents);
    enc.u64(r.allocated);
    enc.u64(r.page_bytes);
    enc.u64(r.copy);
}

/// One reference as [`encode_index_ref`] writes it, unchecked (see
/// [`check_index_refs`]).
pub fn decode_index_ref(dec: &mut Decoder<'_>) -> Result<IndexRef> {
    let (addr, crc, pages, first_key) = (dec.u64()?, dec.u32()?, dec.u32()?, dec.u64()?);
    let (extents, allocated, page_bytes) = (dec.u64()?, dec.u64()?, dec.u64()?);
    Ok(IndexRef {
        addr,
        copy: dec.u64()?,
        crc,
        pages,
        first_key,
        extents,
        allocated,
        page_bytes,
    })
}

/// The rules one file's index page list follows at `block_size`, checked
/// before any index page is read: page counts in 1..=[`index_max_pages`];
/// extents at least one and at most [`PAGE_MAX_EXTENTS`] per page;
/// allocated bytes at least the extents (no extent is empty); page bytes
/// whole blocks, at least a block and at most a full page per page; first
/// keys strictly increasing; allocated and page bytes not overflowing in
/// sum. Whatever a reference claims past these is checked against its
/// index page when it is read. Where the index pages sit is the caller's
/// to check ([`PageArea::check_index`]).
pub fn check_index_refs(list: &[IndexRef], block_size: u64) -> std::result::Result<(), String> {
    let max = index_max_pages(block_size);
    // Bounds in u128: a hostile reference must not overflow them.
    let full_page = u128::from(page_len(PAGE_MAX_EXTENTS, block_size.max(1)));
    let (mut allocated, mut page_bytes) = (0u64, 0u64);
    for (i, r) in list.iter().enumerate() {
        if r.pages == 0 || r.pages as usize > max {
            return Err(format!(
                "index page #{i} lists {} pages, not 1..={max}",
                r.pages
            ));
        }
        let pages = u128::from(r.pages);
        let most = pages * PAGE_MAX_EXTENTS as u128;
        if u128::from(r.extents) < pages || u128::from(r.extents) > most {
            return Err(format!(
                "index page #{i} lists {} extents in {} pages, not {pages}..={most}",
                r.extents, r.pages
            ));
        }
        if r.allocated < r.extents {
            return Err(format!(
                "index page #{i} lists {} extents mapping only {} bytes",
                r.extents, r.allocated
            ));
        }
        let bytes = u128::from(r.page_bytes);
        if !r.page_bytes.is_multiple_of(block_size)
            || bytes < pages * u128::from(block_size)
            || bytes > pages * full_page
        {
            return Err(format!(
                "index page #{i} lists {} pages taking {} bytes, not whole blocks of {block_size} \
                 from one to a full page each",
                r.pages, r.page_bytes
            ));
        }
        if i > 0 && list[i - 1].first_key >= r.first_key {
            return Err(format!(
                "index page #{i} starts at file offset {}, not after index page #{} at {}",
                r.first_key,
                i - 1,
                list[i - 1].first_key
            ));
        }
        allocated = allocated
            .checked_add(r.allocated)
            .ok_or_else(|| format!("index page #{i}: allocated bytes overflow"))?;
        page_bytes = page_bytes
            .checked_add(r.page_bytes)
            .ok_or_else(|| format!("index page #{i}: page bytes overflow"))?;
    }
    Ok(())
}

impl PageArea {
    /// Why the blocks `index` names are not two blocks of the area.
    pub fn check_index(&self, index: &IndexRef) -> std::result::Result<(), String> {
        self.check_range("index page", index.addr, self.block_size)?;
        self.check_range("index page copy", index.copy, self.block_size)?;
        if index.addr == index.copy {
            return Err(format!(
                "index page at device byte {} names itself as its copy",
                index.addr
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const SEED: u32 = 0x9abc_def0;
    const BS: u64 = 4096;
    const AREA: PageArea = PageArea {
        start: 1 << 20,
        len: 1 << 34,
        block_size: BS,
    };

    /// `n` page references as a file's consecutive chunks would have them
    /// in `area`, from file offset `first`: random counts, keys and
    /// addresses, each page inside the area.
    fn refs(rng: &mut SmallRng, area: PageArea, first: u64, n: usize) -> Vec<PageRef> {
        let mut key = first;
        let mut addr = area.start;
        (0..n)
            .map(|_| {
                let count = rng.gen_range(1..=PAGE_MAX_EXTENTS as u32);
                let page = PageRef {
                    addr,
                    crc: rng.gen(),
                    count,
                    first_key: key,
                    allocated: u64::from(count) * area.block_size * rng.gen_range(1..4),
                };
                key += page.allocated + rng.gen_range(0..4) * area.block_size;
                addr += page_len(count as usize, area.block_size)
                    + rng.gen_range(0..3) * area.block_size;
                page
            })
            .collect()
    }

    /// A valid index page of 5 pages of inode 7, at the area's fourth
    /// block, its copy at the sixth.
    fn sample() -> (Vec<PageRef>, Vec<u8>, IndexRef) {
        let mut rng = SmallRng::seed_from_u64(3);
        let pages = refs(&mut rng, AREA, 9 * BS, 5);
        let (bytes, index) = encode_index_page(
            SEED,
            7,
            &pages,
            BS,
            [AREA.start + 3 * BS, AREA.start + 5 * BS],
        )
        .unwrap();
        (pages, bytes, index)
    }

    /// The reason of a decoder error, checked to be at the index page's
    /// address and to name the inode (7) and the keys lost.
    fn lost_reason(err: Error, index: &IndexRef) -> String {
        lost_reason_of(7, err, index)
    }

    fn lost_reason_of(ino: Ino, err: Error, index: &IndexRef) -> String {
        let Error::Corrupt {
            offset,
            reason,
            what,
            ..
        } = &err
        else {
            panic!("{err:?}");
        };
        assert_eq!(*what, WHAT);
        assert_eq!(*offset, index.addr, "{reason}");
        assert!(
            reason.starts_with(&format!("inode {ino}: "))
                && reason.contains(&format!(
                    "{} pages ({} extents from file offset {})",
                    index.pages, index.extents, index.first_key
                )),
            "{reason}"
        );
        reason.clone()
    }

    #[test]
    fn an_index_page_decodes_to_the_pages_it_was_encoded_from() {
        assert_eq!(index_max_pages(4096), 127);
        assert_eq!(index_max_pages(512), 15);
        assert_eq!(index_max_pages(16), 0);
        let mut rng = SmallRng::seed_from_u64(11);
        for bs in [512u64, 4096, 65536] {
            let area = PageArea {
                block_size: bs,
                ..AREA
            };
            let max = index_max_pages(bs);
            let sizes: Vec<usize> = [1, 2, max - 1, max]
                .into_iter()
                .chain((0..20).map(|_| rng.gen_range(1..=max)))
                .collect();
            for n in sizes {
                let first = rng.gen_range(0..1u64 << 40);
                let pages = refs(&mut rng, area, first, n);
                let addr = area.start + rng.gen_range(0..1000) * bs;
                let copy = area.start + rng.gen_range(1000..2000) * bs;
                let (bytes, index) = encode_index_page(SEED, 42, &pages, bs, [addr, copy]).unwrap();
                assert_eq!(bytes.len() as u64, bs);
                assert!(bytes[INDEX_HEADER_LEN + n * PAGE_REF_ENCODED_LEN..]
                    .iter()
                    .all(|&b| b == 0));
                assert_eq!(
                    index,
                    IndexRef {
                        addr,
                        copy,
                        crc: index.crc,
                        pages: n as u32,
                        first_key: first,
                        extents: pages.iter().map(|p| u64::from(p.count)).sum(),
                        allocated: pages.iter().map(|p| p.allocated).sum(),
                        page_bytes: pages.iter().map(|p| page_len(p.count as usize, bs)).sum(),
                    }
                );
                for at in index.blocks() {
                    assert_eq!(
                        decode_index_page(SEED, &bytes, 42, &index, at, area).unwrap(),
                        pages
                    );
                }
                assert_eq!(check_index_refs(&[index], bs), Ok(()));
                area.check_index(&index).unwrap();
                let mut enc = Encoder::new();
                encode_index_ref(&mut enc, &index);
                assert_eq!(enc.len(), INDEX_REF_ENCODED_LEN);
                let mut dec = Decoder::new(enc.as_bytes(), 0, "test");
                assert_eq!(decode_index_ref(&mut dec).unwrap(), index);
                assert!(dec.is_empty());
            }
        }
    }

    /// Every byte the crc covers, flipped alone (header fields, the crc
    /// itself, every reference byte), makes the index page fail with an
    /// error naming the inode and the keys lost; the padding is not
    /// covered and does not matter.
    #[test]
    fn any_damaged_byte_of_an_index_page_is_reported_with_the_keys_it_loses() {
        let (pages, bytes, index) = sample();
        let body = INDEX_HEADER_LEN + pages.len() * PAGE_REF_ENCODED_LEN;
        for i in 0..body {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            let err = decode_index_page(SEED, &bad, 7, &index, index.addr, AREA).unwrap_err();
            let reason = lost_reason(err, &index);
            let expect = match i {
                0..8 => "bad magic",
                8..28 => "not the index page the root names",
                _ => "crc32c mismatch",
            };
            assert!(reason.contains(expect), "byte {i}: {reason}");
        }
        let mut padded = bytes.clone();
        padded[body] = 0xff;
        *padded.last_mut().unwrap() = 0xff;
        assert_eq!(
            decode_index_page(SEED, &padded, 7, &index, index.addr, AREA).unwrap(),
            pages
        );
    }

    /// An index page that verifies on its own but is not the one the
    /// reference names (another inode's, another volume's, an older one
    /// at the same address), or a reference whose sums are not its pages',
    /// is refused; so are bytes too short for its pages.
    #[test]
    fn an_index_page_other_than_the_one_listed_is_refused() {
        let (pages, bytes, index) = sample();
        let err = decode_index_page(SEED, &bytes, 8, &index, index.addr, AREA).unwrap_err();
        let reason = lost_reason_of(8, err, &index);
        assert!(reason.contains("it holds inode 7"), "{reason}");
        let err = decode_index_page(SEED ^ 1, &bytes, 7, &index, index.addr, AREA).unwrap_err();
        assert!(lost_reason(err, &index).contains("crc32c mismatch"));
        // Same inode, keys and count, another page in the run.
        let mut older = pages.clone();
        older[2].addr += BS;
        let (stale, _) = encode_index_page(SEED, 7, &older, BS, index.blocks()).unwrap();
        let err = decode_index_page(SEED, &stale, 7, &index, index.addr, AREA).unwrap_err();
        assert!(lost_reason(err, &index).contains("crc32c mismatch"));
        for (wrong, why) in [
            (
                IndexRef {
                    crc: index.crc ^ 1,
                    ..index
                },
                "crc32c mismatch",
            ),
            (IndexRef { pages: 4, ..index }, "not the index page"),
            (
                IndexRef {
                    first_key: 0,
                    ..index
                },
                "not the index page",
            ),
            (
                IndexRef {
                    extents: index.extents + 1,
                    ..index
                },
                "the root lists",
            ),
            (
                IndexRef {
                    allocated: index.allocated - 1,
                    ..index
                },
                "the root lists",
            ),
            (
                IndexRef {
                    page_bytes: index.page_bytes + BS,
                    ..index
                },
                "the root lists",
            ),
        ] {
            let err = decode_index_page(SEED, &bytes, 7, &wrong, wrong.addr, AREA).unwrap_err();
            let reason = lost_reason(err, &wrong);
            assert!(reason.contains(why), "{wrong:?}: {reason}");
        }
        for n in [
            0,
            7,
            INDEX_HEADER_LEN,
            INDEX_HEADER_LEN + 4 * PAGE_REF_ENCODED_LEN,
        ] {
            let err =
                decode_index_page(SEED, &bytes[..n], 7, &index, index.addr, AREA).unwrap_err();
            lost_reason(err, &index);
        }
    }

    /// A forged index page whose crc verifies, with its reference made to
    /// match, is still checked: its page count against a block, every page
    /// against the data area, the list against [`check_page_refs`], the
    /// first page against the first key.
    #[test]
    fn a_forged_index_page_with_a_valid_crc_is_refused() {
        let (pages, bytes, index) = sample();
        let at = |i: usize| INDEX_HEADER_LEN + i * PAGE_REF_ENCODED_LEN;
        // Rewrites the page references and header fields, seals the crc,
        // lists the result and decodes it (with its sums right, so the
        // check under test is the one that fails).
        let forge = |edit: &dyn Fn(&mut Vec<PageRef>, &mut u64, &mut u32), area: PageArea| {
            let mut list = pages.clone();
            let (mut first_key, mut count) = (index.first_key, index.pages);
            edit(&mut list, &mut first_key, &mut count);
            let mut bad = bytes.clone();
            bad.resize(bad.len().max(at(list.len())), 0);
            let mut enc = Encoder::new();
            for p in &list {
                encode_page_ref(&mut enc, p);
            }
            bad[at(0)..at(list.len())].copy_from_slice(enc.as_bytes());
            bad[16..24].copy_from_slice(&first_key.to_le_bytes());
            bad[24..28].copy_from_slice(&count.to_le_bytes());
            let crc = index_crc(SEED, &bad[..at(count as usize).min(bad.len())]);
            bad[OFF_CRC..INDEX_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
            let (extents, allocated, page_bytes) = sums(&list, area.block_size).unwrap_or_default();
            let listed = IndexRef {
                crc,
                pages: count,
                first_key,
                extents,
                allocated,
                page_bytes,
                ..index
            };
            let err = decode_index_page(SEED, &bad, 7, &listed, listed.addr, area).unwrap_err();
            lost_reason(err, &listed)
        };
        let reason = forge(&|l, _, _| l[3].addr = AREA.start - BS, AREA);
        assert!(
            reason.contains("page #3") && reason.contains("data area"),
            "{reason}"
        );
        let reason = forge(&|l, _, _| l[1].addr += 512, AREA);
        assert!(
            reason.contains("page #1") && reason.contains("aligned"),
            "{reason}"
        );
        // A page of more than a block, in the area's last block.
        let reason = forge(
            &|l, _, _| {
                l[4].count = PAGE_MAX_EXTENTS as u32;
                l[4].addr = AREA.start + AREA.len - BS;
            },
            AREA,
        );
        assert!(
            reason.contains("page #4") && reason.contains("data area"),
            "{reason}"
        );
        let reason = forge(&|l, _, _| l[2].count = 0, AREA);
        assert!(reason.contains("page #2 lists 0 extents"), "{reason}");
        let reason = forge(&|l, _, _| l[3].first_key = l[2].first_key, AREA);
        assert!(reason.contains("page #3 starts at"), "{reason}");
        let reason = forge(&|l, k, _| *k = l[0].first_key + 1, AREA);
        assert!(reason.contains("its first page is at"), "{reason}");
        // More pages than a block holds (the bytes read are longer than a
        // block, so only the bound stops them).
        let reason = forge(
            &|l, _, n| {
                let mut rng = SmallRng::seed_from_u64(5);
                *l = refs(&mut rng, AREA, 0, 128);
                *n = 128;
            },
            AREA,
        );
        assert!(reason.contains("128 pages do not fit 1..=127"), "{reason}");
        // No pages at all.
        let reason = forge(&|_, _, n| *n = 0, AREA);
        assert!(reason.contains("0 pages do not fit"), "{reason}");
        // The same index page at a smaller block size holds too many.
        let small = PageArea {
            block_size: 512,
            ..AREA
        };
        let reason = forge(
            &|l, _, n| {
                let mut rng = SmallRng::seed_from_u64(6);
                *l = refs(&mut rng, small, 0, 16);
                *n = 16;
            },
            small,
        );
        assert!(reason.contains("16 pages do not fit 1..=15"), "{reason}");
    }

    #[test]
    fn what_would_not_decode_is_not_encoded() {
        let mut rng = SmallRng::seed_from_u64(8);
        let err = encode_index_page(SEED, 1, &[], BS, [0, BS]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        let err =
            encode_index_page(SEED, 1, &refs(&mut rng, AREA, 0, 128), BS, [0, BS]).unwrap_err();
        assert!(err.to_string().contains("128 pages"), "{err}");
        let err =
            encode_index_page(SEED, 1, &refs(&mut rng, AREA, 0, 16), 512, [0, BS]).unwrap_err();
        assert!(err.to_string().contains("16 pages"), "{err}");
        assert!(encode_index_page(SEED, 1, &refs(&mut rng, AREA, 0, 1), 16, [0, BS]).is_err());
        let mut bad = refs(&mut rng, AREA, 0, 3);
        bad.swap(0, 1);
        assert!(
            encode_index_page(SEED, 1, &bad, BS, [0, BS]).is_err(),
            "unsorted"
        );
        let mut bad = refs(&mut rng, AREA, 0, 3);
        bad[1].count = 0;
        assert!(
            encode_index_page(SEED, 1, &bad, BS, [0, BS]).is_err(),
            "empty page"
        );
        bad[1].count = PAGE_MAX_EXTENTS as u32 + 1;
        assert!(
            encode_index_page(SEED, 1, &bad, BS, [0, BS]).is_err(),
            "page too large"
        );
        let mut bad = refs(&mut rng, AREA, 0, 3);
        bad[2].allocated = u64::MAX;
        assert!(
            encode_index_page(SEED, 1, &bad, BS, [0, BS]).is_err(),
            "overflow"
        );
    }

    #[test]
    fn an_index_list_is_checked_before_any_index_page_is_read() {
        let r = |first_key, pages: u32, extents: u64, allocated, page_bytes| IndexRef {
            addr: 0,
            copy: 0,
            crc: 0,
            pages,
            first_key,
            extents,
            allocated,
            page_bytes,
        };
        let full = page_len(PAGE_MAX_EXTENTS, BS);
        assert_eq!(
            check_index_refs(
                &[
                    r(0, 1, 1, 1, BS),
                    r(BS, 127, 127 * 512, u64::MAX / 2, 127 * full),
                    r(2 * BS, 2, 3, 3 * BS, 2 * BS),
                ],
                BS
            ),
            Ok(())
        );
        assert_eq!(check_index_refs(&[], BS), Ok(()));
        let at_512 = check_index_refs(&[r(0, 16, 16, BS, 16 * 512)], 512).unwrap_err();
        assert!(at_512.contains("lists 16 pages, not 1..=15"), "{at_512}");
        for (bad, why) in [
            (vec![r(0, 0, 1, BS, BS)], "lists 0 pages"),
            (vec![r(0, 128, 128, BS, 128 * BS)], "lists 128 pages"),
            (vec![r(0, 2, 1, BS, 2 * BS)], "extents in 2 pages"),
            (vec![r(0, 1, 513, 513 * BS, full)], "extents in 1 pages"),
            (
                vec![r(0, 1, u64::MAX, u64::MAX, full)],
                "extents in 1 pages",
            ),
            (vec![r(0, 1, 4, 3, BS)], "mapping only 3 bytes"),
            (vec![r(0, 2, 2, BS, BS)], "taking"),
            (vec![r(0, 1, 2, BS, BS + 512)], "taking"),
            (vec![r(0, 1, 2, BS, full + BS)], "taking"),
            (vec![r(0, 1, 2, BS, u64::MAX - 4095)], "taking"),
            (vec![r(BS, 1, 1, BS, BS), r(BS, 1, 1, BS, BS)], "not after"),
            (
                vec![r(2 * BS, 1, 1, BS, BS), r(BS, 1, 1, BS, BS)],
                "not after",
            ),
            (
                vec![r(0, 1, 1, u64::MAX, BS), r(BS, 1, 1, 1, BS)],
                "allocated bytes overflow",
            ),
        ] {
            let err = check_index_refs(&bad, BS).unwrap_err();
            assert!(err.contains(why), "{why}: {err}");
        }
        // Page bytes overflow in sum only with a block size whose full
        // page is huge; the bound per reference keeps it within u64.
        let huge = 1u64 << 62;
        let big = r(0, 1, 1, 1, huge);
        assert_eq!(check_index_refs(&[big], huge), Ok(()));
        let err = check_index_refs(
            &[
                big,
                r(1, 1, 1, 1, huge),
                r(2, 1, 1, 1, huge),
                r(3, 1, 1, 1, huge),
            ],
            huge,
        )
        .unwrap_err();
        assert!(err.contains("page bytes overflow"), "{err}");
        assert!(check_index_refs(&[r(0, 1, 1, 1, 0)], 0).is_err());
    }

    /// An index page and its copy are two blocks, aligned, inside the
    /// data area.
    #[test]
    fn an_index_page_lies_in_the_data_area() {
        let (_, _, index) = sample();
        let at = |addr| AREA.check_index(&IndexRef { addr, ..index });
        let copy_at = |copy| AREA.check_index(&IndexRef { copy, ..index });
        assert_eq!(at(AREA.start), Ok(()));
        assert_eq!(at(AREA.start + AREA.len - BS), Ok(()));
        assert_eq!(copy_at(AREA.start + AREA.len - BS), Ok(()));
        for addr in [
            AREA.start - BS,
            AREA.start + 512,
            AREA.start + AREA.len - BS + 512,
            AREA.start + AREA.len,
            u64::MAX - BS + 1,
            0,
        ] {
            for err in [at(addr).unwrap_err(), copy_at(addr).unwrap_err()] {
                assert!(
                    err.contains("data area") && err.contains(&addr.to_string()),
                    "{err}"
                );
            }
        }
        let err = copy_at(index.addr).unwrap_err();
        assert!(err.contains("names itself as its copy"), "{err}");
    }

    #[test]
    fn the_format_document_states_the_index_layout() {
        let doc = include_str!("../../../../docs/FORMAT.md");
        let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        let magic = std::str::from_utf8(&INDEX_MAGIC).unwrap();
        for stated in [
            format!("| 0 | 8 | magic `\"{magic}\"` |"),
            format!("An index page reference ({INDEX_REF_ENCODED_LEN} bytes)"),
            format!(
                "1..=`(block_size - {INDEX_HEADER_LEN}) / {PAGE_REF_ENCODED_LEN}` pages ({} at 4 KiB, {} at 512 bytes)",
                index_max_pages(4096),
                index_max_pages(512)
            ),
            format!("| {INDEX_HEADER_LEN} | {PAGE_REF_ENCODED_LEN} each | the page references"),
            format!("| 28 | 4 | crc: `crc32c_append(seed, bytes [0, {OFF_CRC}) then the page references)` |"),
        ] {
            assert!(doc.contains(&stated), "FORMAT.md does not say {stated:?}");
        }
    }

    proptest! {
        /// Hostile bytes under any reference: an error or pages that match
        /// the reference, never a panic or an allocation the bytes cannot
        /// back.
        #[test]
        fn hostile_index_bytes_never_panic(
            mut bytes in proptest::collection::vec(any::<u8>(), 0..700),
            pages in 0u32..200,
            first_key in any::<u64>(),
            keep_header in any::<bool>(),
            reseal in any::<bool>(),
        ) {
            let area = PageArea { block_size: 512, ..AREA };
            let (_, good, index) = sample();
            if keep_header {
                let n = bytes.len().min(INDEX_HEADER_LEN);
                bytes[..n].copy_from_slice(&good[..n]);
            }
            let mut listed = [index, IndexRef { pages, first_key, ..index }];
            if reseal && bytes.len() >= INDEX_HEADER_LEN {
                let n = (bytes.len() - INDEX_HEADER_LEN) / PAGE_REF_ENCODED_LEN;
                let crc = index_crc(SEED, &bytes[..INDEX_HEADER_LEN + n * PAGE_REF_ENCODED_LEN]);
                bytes[OFF_CRC..INDEX_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
                listed[1].crc = crc;
            }
            for listed in listed {
                for area in [area, AREA] {
                    if let Ok(got) = decode_index_page(SEED, &bytes, 7, &listed, listed.addr, area) {
                        prop_assert_eq!(got.len(), listed.pages as usize);
                        prop_assert_eq!(got[0].first_key, listed.first_key);
                    }
                }
            }
        }

        /// Any sorted run of pages of any block size round-trips.
        #[test]
        fn index_pages_round_trip(seed in any::<u64>(), shift in 9u32..17, ino in any::<u64>()) {
            let mut rng = SmallRng::seed_from_u64(seed);
            let bs = 1u64 << shift;
            let area = PageArea { block_size: bs, ..AREA };
            let n = rng.gen_range(1..=index_max_pages(bs));
            let first = rng.gen_range(0..1 << 50);
            let pages = refs(&mut rng, area, first, n);
            let (bytes, index) = encode_index_page(SEED, ino, &pages, bs, [area.start, area.start + bs]).unwrap();
            prop_assert_eq!(decode_index_page(SEED, &bytes, ino, &index, index.addr, area).unwrap(), pages);
        }
    }
}
