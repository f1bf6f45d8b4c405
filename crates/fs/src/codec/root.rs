//! A checkpoint root: the metadata image with small files' extents inline,
//! and per larger regular file the list of extent pages ([`super::page`])
//! that hold its extents. With extent pages, a base checkpoint's payload
//! is a root instead of an image, so a checkpoint writes only the pages
//! that changed and a root whose size follows the number of pages and of
//! small files' extents, not of every extent.
//!
//! Layout (little-endian):
//!
//! | size | field |
//! | --- | --- |
//! | 8 | image_len |
//! | image_len | the image: a file with pages has no extents in it, any other at most [`inline_extents_max`] |
//! | 8 | number of files with pages |
//! | per file, sorted by inode number | ino u64, page count u32, the [`PageRef`]s in key order |
//!
//! Each file listed is a regular file of the image with no extents in
//! it, with at least one page; its list follows [`check_page_refs`], and
//! each page lies in the page area (block-aligned, whole, in the data
//! area) the reader gives. The writer pages exactly the files with more
//! than [`inline_extents_max`] extents; a reader accepts a paged file of
//! any size.

use super::image::{decode_image_at, encode_image_from, ExtentSource, EXTENT_ENCODED_LEN};
use super::page::{
    check_page_refs, decode_page_ref, encode_page_ref, page_len, PageRef, PAGE_HEADER_LEN,
    PAGE_REF_ENCODED_LEN,
};
use super::primitive::{Decoder, Encoder};
use crate::error::{Error, Result};
use crate::types::{FileKind, Ino, InodeImage, MetaImage};

/// Most extents a file keeps inline in the root, at `block_size`: what one
/// page of a single block holds (162 at 4 KiB, 19 at 512 bytes). Paging
/// such a file would spend a whole block (and a 32-byte reference in the
/// root) on at most a block of extents, so inline is never larger on disk;
/// past it, a page (rewritten only when its chunk changes) beats bytes the
/// root rewrites at every base. A volume of many small files then spends
/// no page blocks, as XFS keeps small extent lists in the inode.
pub fn inline_extents_max(block_size: u64) -> usize {
    (block_size as usize).saturating_sub(PAGE_HEADER_LEN) / EXTENT_ENCODED_LEN
}

/// Bytes of a file's entry in the page table before its pages.
const FILE_HEADER_ENCODED_LEN: usize = 8 + 4;

/// Where pages may be: device bytes `[start, start + len)`, in blocks of
/// `block_size` (the data area).
#[derive(Clone, Copy, Debug)]
pub struct PageArea {
    pub start: u64,
    pub len: u64,
    pub block_size: u64,
}

impl PageArea {
    /// Why `page` is not a whole, block-aligned range of the area.
    fn check(&self, page: &PageRef) -> std::result::Result<(), String> {
        let len = page_len(page.count as usize, self.block_size);
        let inside = page.addr >= self.start
            && page
                .addr
                .checked_add(len)
                .is_some_and(|end| end <= self.start + self.len);
        if !page.addr.is_multiple_of(self.block_size) || !inside {
            return Err(format!(
                "page at device byte {} ({len} bytes) is not a {}-byte aligned range of the data area {}+{}",
                page.addr, self.block_size, self.start, self.len
            ));
        }
        Ok(())
    }
}

/// Per file with extents, sorted by inode number: its pages in key order.
pub type PageTable = Vec<(Ino, Vec<PageRef>)>;

/// A decoded root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Root {
    /// The image: the inline extents of files without pages, none of the
    /// paged files'.
    pub image: MetaImage,
    pub pages: PageTable,
}

/// The root of `inodes` (sorted by inode number; their `extents` are the
/// inline ones: none for a file with pages) and `pages` (sorted by inode
/// number), after `room` zero bytes for a record header, on a volume of
/// `block_size` blocks. Refuses what [`decode_root_at`] would refuse, but
/// for where the pages are.
pub fn encode_root_after(
    room: usize,
    next_ino: Ino,
    inodes: &[&InodeImage],
    pages: &[(Ino, Vec<PageRef>)],
    block_size: u64,
) -> Result<Vec<u8>> {
    let invalid = |reason: String| Error::invalid("encoding a checkpoint root", reason);
    if let Some(i) = inodes
        .iter()
        .find(|i| i.extents.len() > inline_extents_max(block_size))
    {
        return Err(invalid(too_many_inline(i.ino, i.extents.len(), block_size)));
    }
    check_page_table(
        inodes.iter().map(|i| (i.ino, i.kind, i.extents.len())),
        pages,
    )
    .map_err(invalid)?;
    let heads: Vec<(&InodeImage, &dyn ExtentSource)> = inodes
        .iter()
        .map(|&i| (i, &i.extents as &dyn ExtentSource))
        .collect();
    let mut bytes = encode_image_from(room + 8, next_ino, &heads)?;
    let image_len = (bytes.len() - room - 8) as u64;
    bytes[room..room + 8].copy_from_slice(&image_len.to_le_bytes());
    let refs: usize = pages.iter().map(|(_, p)| p.len()).sum();
    let mut enc = Encoder::with_capacity(
        8 + pages.len() * FILE_HEADER_ENCODED_LEN + refs * PAGE_REF_ENCODED_LEN,
    );
    enc.u64(pages.len() as u64);
    for (ino, list) in pages {
        enc.u64(*ino);
        enc.u32(list.len() as u32);
        for page in list {
            encode_page_ref(&mut enc, page);
        }
    }
    bytes.extend_from_slice(enc.as_bytes());
    Ok(bytes)
}

fn too_many_inline(ino: Ino, count: usize, block_size: u64) -> String {
    format!(
        "inode {ino} has {count} extents inline in a root, more than the {} a {block_size}-byte block keeps inline",
        inline_extents_max(block_size)
    )
}

/// Why a page table does not fit its image's inodes (`(ino, kind, inline
/// extents)`, sorted): files sorted, each a regular file of the image
/// with no inline extents, each with pages that follow
/// [`check_page_refs`].
fn check_page_table(
    inodes: impl Iterator<Item = (Ino, FileKind, usize)>,
    pages: &[(Ino, Vec<PageRef>)],
) -> std::result::Result<(), String> {
    let mut inodes = inodes.peekable();
    let mut prev = None;
    for (ino, list) in pages {
        if prev.is_some_and(|p| p >= *ino) {
            return Err(format!("the page table's inode {ino} is not sorted"));
        }
        prev = Some(*ino);
        while inodes.next_if(|&(i, _, _)| i < *ino).is_some() {}
        match inodes.peek() {
            Some(&(i, FileKind::Regular, 0)) if i == *ino => {}
            Some(&(i, FileKind::Regular, inline)) if i == *ino => {
                return Err(format!(
                    "inode {ino} has extent pages and {inline} extents inline"
                ));
            }
            Some(&(i, kind, _)) if i == *ino => {
                return Err(format!("{kind:?} {ino} has extent pages"));
            }
            _ => {
                return Err(format!(
                    "the page table names inode {ino}, which is not in the image"
                ))
            }
        }
        if list.is_empty() {
            return Err(format!("inode {ino} is listed with no pages"));
        }
        check_page_refs(list).map_err(|r| format!("inode {ino}: {r}"))?;
    }
    Ok(())
}

/// Decodes a root from `bytes` (exactly one, read from device byte
/// `base`): the image, then the page table, checked (including that every
/// page lies in `area`) before any page is read.
pub fn decode_root_at(bytes: &[u8], base: u64, what: &'static str, area: PageArea) -> Result<Root> {
    let mut dec = Decoder::new(bytes, base, what);
    let image_len = dec.u64()?;
    let image_len = usize::try_from(image_len)
        .ok()
        .filter(|&n| n <= dec.remaining())
        .ok_or_else(|| {
            dec.error(format!(
                "an image of {image_len} bytes does not fit the root"
            ))
        })?;
    let image_at = dec.offset();
    let image = decode_image_at(dec.bytes(image_len)?, image_at, what)?;
    if let Some(i) = image
        .inodes
        .iter()
        .find(|i| i.extents.len() > inline_extents_max(area.block_size))
    {
        return Err(Error::corrupt(
            what,
            image_at,
            too_many_inline(i.ino, i.extents.len(), area.block_size),
        ));
    }
    let table_at = dec.position();
    let files = dec.count_u64(FILE_HEADER_ENCODED_LEN, "file")?;
    let mut pages: PageTable = Vec::with_capacity(files);
    for _ in 0..files {
        let ino = dec.u64()?;
        let count = dec.count_u32(PAGE_REF_ENCODED_LEN, "page")?;
        let mut list = Vec::with_capacity(count);
        for _ in 0..count {
            let at = dec.position();
            let page = decode_page_ref(&mut dec)?;
            area.check(&page)
                .map_err(|r| dec.error_at(at, format!("inode {ino}: {r}")))?;
            list.push(page);
        }
        pages.push((ino, list));
    }
    dec.finish()?;
    check_page_table(
        image
            .inodes
            .iter()
            .map(|i| (i.ino, i.kind, i.extents.len())),
        &pages,
    )
    .map_err(|reason| dec.error_at(table_at, reason))?;
    Ok(Root { image, pages })
}

#[cfg(test)]
mod tests {
    use super::super::image::tests::random_image;
    use super::super::page::encode_page;
    use super::*;
    use crate::types::Extent;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const AREA: PageArea = PageArea {
        start: 1 << 20,
        len: 1 << 30,
        block_size: 4096,
    };

    /// An image with extents, and the root of it: every other regular file
    /// with extents keeps them inline, the others' are in pages of up to
    /// three, placed one after another in `AREA`. Returns the image the
    /// root holds (no extents for paged files).
    fn image_and_root() -> (MetaImage, Vec<u8>, PageTable) {
        let mut rng = SmallRng::seed_from_u64(31);
        let mut image = random_image(&mut rng, 40);
        let mut addr = AREA.start;
        let mut pages = Vec::new();
        let mut inline = 0;
        for inode in image.inodes.iter_mut().filter(|i| !i.extents.is_empty()) {
            inline += 1;
            if inline % 2 == 0 {
                continue;
            }
            let mut list = Vec::new();
            for chunk in inode.extents.chunks(rng.gen_range(1..4)) {
                let (bytes, page) =
                    encode_page(0, inode.ino, chunk, AREA.block_size, addr).unwrap();
                addr += bytes.len() as u64;
                list.push(page);
            }
            inode.extents.clear();
            pages.push((inode.ino, list));
        }
        assert!(pages.len() >= 2 && inline >= 4, "both forms");
        let heads: Vec<&InodeImage> = image.inodes.iter().collect();
        let root = encode_root_after(52, image.next_ino, &heads, &pages, AREA.block_size).unwrap();
        (image, root, pages)
    }

    #[test]
    fn a_root_decodes_to_its_image_with_the_inline_extents_and_its_pages() {
        let (image, root, pages) = image_and_root();
        assert!(root[..52].iter().all(|&b| b == 0), "room left for a header");
        let got = decode_root_at(&root[52..], 0, "root", AREA).unwrap();
        assert!(got.image.inodes.iter().any(|i| !i.extents.is_empty()));
        assert_eq!(got.image, image);
        assert_eq!(got.pages, pages);
    }

    /// A file keeps at most a block's worth of extents inline, and a file
    /// with pages none: refused both ways.
    #[test]
    fn inline_extents_past_a_block_or_beside_pages_are_refused() {
        assert_eq!(inline_extents_max(4096), 162);
        assert_eq!(inline_extents_max(512), 19);
        let (image, _, pages) = image_and_root();
        let max = inline_extents_max(AREA.block_size);
        let small = image
            .inodes
            .iter()
            .position(|i| !i.extents.is_empty())
            .unwrap();
        let grow = |n: usize| {
            let mut image = image.clone();
            let inode = &mut image.inodes[small];
            let first = inode.extents[0];
            inode.extents = (0..n as u64)
                .map(|k| Extent {
                    file_off: k * 2 * AREA.block_size,
                    len: AREA.block_size,
                    addr: first.addr,
                    ..first
                })
                .collect();
            inode.size = inode.size.max(n as u64 * 2 * AREA.block_size);
            image
        };
        let encode = |image: &MetaImage, pages: &PageTable| {
            let heads: Vec<&InodeImage> = image.inodes.iter().collect();
            encode_root_after(0, image.next_ino, &heads, pages, AREA.block_size)
        };
        let at_max = encode(&grow(max), &pages).unwrap();
        assert_eq!(
            decode_root_at(&at_max, 0, "root", AREA).unwrap().image,
            grow(max)
        );
        let err = encode(&grow(max + 1), &pages).unwrap_err().to_string();
        assert!(err.contains("inline"), "{err}");
        // The same bytes the encoder refuses, built by hand: a block of 8192
        // bytes keeps more inline, so encode there and decode at 4096.
        let wide = grow(max + 1);
        let heads: Vec<&InodeImage> = wide.inodes.iter().collect();
        let bytes = encode_root_after(0, wide.next_ino, &heads, &pages, 8192).unwrap();
        let err = decode_root_at(&bytes, 0, "root", AREA)
            .unwrap_err()
            .to_string();
        assert!(err.contains("inline"), "{err}");
        // A paged file with extents inline as well.
        let mut both = image.clone();
        let paged = both
            .inodes
            .iter()
            .position(|i| i.ino == pages[0].0)
            .unwrap();
        both.inodes[paged].extents = image.inodes[small].extents.clone();
        both.inodes[paged].size = both.inodes[paged].size.max(image.inodes[small].size);
        let err = encode(&both, &pages).unwrap_err().to_string();
        assert!(err.contains("extent pages and"), "{err}");
        let heads: Vec<&InodeImage> = both.inodes.iter().collect();
        let mut bytes = encode_root_after(0, both.next_ino, &heads, &Vec::new(), 4096).unwrap();
        // The same image with the right page table after it.
        let good = encode(&image, &pages).unwrap();
        bytes.truncate(bytes.len() - 8);
        bytes.extend_from_slice(&good[8 + image_len(&good)..]);
        let err = decode_root_at(&bytes, 0, "root", AREA)
            .unwrap_err()
            .to_string();
        assert!(err.contains("extent pages and"), "{err}");
    }

    fn image_len(root: &[u8]) -> usize {
        u64::from_le_bytes(root[..8].try_into().unwrap()) as usize
    }

    /// The page table must fit the image: every file named is a regular
    /// file of the image with pages in order, inside the data area.
    #[test]
    fn a_page_table_that_does_not_fit_its_image_is_refused() {
        let (image, root, pages) = image_and_root();
        let bytes = &root[52..];
        let image_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let table = 8 + image_len;
        let first_ino_at = table + 8;
        let dir = image
            .inodes
            .iter()
            .find(|i| i.kind == FileKind::Directory)
            .unwrap()
            .ino;
        for (ino, why) in [(dir, "Directory"), (image.next_ino, "not in the image")] {
            let mut bad = bytes.to_vec();
            bad[first_ino_at..first_ino_at + 8].copy_from_slice(&ino.to_le_bytes());
            let err = decode_root_at(&bad, 0, "root", AREA)
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{err}");
        }
        // The first page's address, moved out of the data area.
        let addr_at = first_ino_at + 12;
        let mut bad = bytes.to_vec();
        bad[addr_at..addr_at + 8].copy_from_slice(&(AREA.start - 4096).to_le_bytes());
        let err = decode_root_at(&bad, 0, "root", AREA)
            .unwrap_err()
            .to_string();
        assert!(err.contains("data area"), "{err}");
        // Misaligned.
        bad[addr_at..addr_at + 8].copy_from_slice(&(AREA.start + 512).to_le_bytes());
        assert!(decode_root_at(&bad, 0, "root", AREA).is_err());
        // What the decoder refuses, the encoder refuses.
        let heads: Vec<&InodeImage> = image.inodes.iter().collect();
        let encode = |pages: &PageTable| {
            encode_root_after(0, image.next_ino, &heads, pages, AREA.block_size)
        };
        let mut swapped = pages.clone();
        swapped[0].0 = dir;
        assert!(encode(&swapped).is_err());
        let mut empty = pages.clone();
        empty[0].1.clear();
        assert!(encode(&empty).is_err());
        swapped = pages.clone();
        swapped.swap(0, 1);
        assert!(encode(&swapped).is_err());
    }

    /// Any truncation or flipped byte: an error or a root, never a panic.
    #[test]
    fn hostile_roots_never_panic() {
        let (_, root, _) = image_and_root();
        let bytes = &root[52..];
        for n in 0..bytes.len() {
            assert!(decode_root_at(&bytes[..n], 0, "root", AREA).is_err(), "{n}");
        }
        let mut rng = SmallRng::seed_from_u64(7);
        for _ in 0..2000 {
            let mut bad = bytes.to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..bad.len());
                bad[i] = rng.gen();
            }
            let _ = decode_root_at(&bad, 0, "root", AREA);
        }
    }
}
