//! A checkpoint root: the metadata image with small files' extents inline,
//! and per larger regular file the list of extent pages ([`super::page`])
//! that hold its extents, or, in the indexed form, the list of index pages
//! ([`super::index`]) that list those pages. With extent pages, a base
//! checkpoint's payload is a root instead of an image, so a checkpoint
//! writes only the pages that changed and a root whose size follows the
//! number of pages (of index pages, in the indexed form) and of small
//! files' extents, not of every extent.
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
//! The indexed form (the superblock says which form a volume's roots
//! take; nothing in the bytes does) is the same but for each file's entry:
//! ino u64, index page count u32, the [`IndexRef`]s in key order.
//!
//! Each file listed is a regular file of the image with no extents in
//! it, with at least one page (index page); its list follows
//! [`check_page_refs`] ([`check_index_refs`]), and each page lies in the
//! page area (block-aligned, whole, in the data area) the reader gives, as
//! each index page does (one block). The writer pages exactly the files
//! with more than [`inline_extents_max`] extents; a reader accepts a paged
//! file of any size. Both forms share one encoder and one decoder, generic
//! over the reference a file lists (`TableRef`), so the checks cannot
//! drift apart.

use super::image::{decode_image_at, encode_image_from, ExtentSource, EXTENT_ENCODED_LEN};
use super::index::{
    check_index_refs, decode_index_ref, encode_index_ref, IndexRef, IndexTable,
    INDEX_REF_ENCODED_LEN,
};
use super::page::{
    check_page_refs, decode_page_ref, encode_page_ref, PageArea, PageRef, PAGE_HEADER_LEN,
    PAGE_REF_ENCODED_LEN,
};
use super::page_list::PageList;
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

/// What a root lists per paged file, one type per form: the form's
/// reference layout and checks, so that the rest of the root (image,
/// inline bound, file order, kinds) is one code for both.
trait TableRef: Sized {
    /// Bytes of one reference in the root.
    const ENCODED_LEN: usize;
    /// What errors call one reference.
    const NOUN: &'static str;
    fn encode(&self, enc: &mut Encoder);
    fn decode(dec: &mut Decoder<'_>) -> Result<Self>;
    /// Why one file's list breaks the form's rules (see
    /// [`check_page_refs`], [`check_index_refs`]).
    fn check_list(list: &[Self], block_size: u64) -> std::result::Result<(), String>;
    /// Why the reference is not where the area allows.
    fn check_area(&self, area: &PageArea) -> std::result::Result<(), String>;
}

impl TableRef for PageRef {
    const ENCODED_LEN: usize = PAGE_REF_ENCODED_LEN;
    const NOUN: &'static str = "page";
    fn encode(&self, enc: &mut Encoder) {
        encode_page_ref(enc, self)
    }
    fn decode(dec: &mut Decoder<'_>) -> Result<Self> {
        decode_page_ref(dec)
    }
    fn check_list(list: &[Self], _: u64) -> std::result::Result<(), String> {
        check_page_refs(list)
    }
    fn check_area(&self, area: &PageArea) -> std::result::Result<(), String> {
        area.check(self)
    }
}

impl TableRef for IndexRef {
    const ENCODED_LEN: usize = INDEX_REF_ENCODED_LEN;
    const NOUN: &'static str = "index page";
    fn encode(&self, enc: &mut Encoder) {
        encode_index_ref(enc, self)
    }
    fn decode(dec: &mut Decoder<'_>) -> Result<Self> {
        decode_index_ref(dec)
    }
    fn check_list(list: &[Self], block_size: u64) -> std::result::Result<(), String> {
        check_index_refs(list, block_size)
    }
    fn check_area(&self, area: &PageArea) -> std::result::Result<(), String> {
        area.check_index(self)
    }
}

/// Per file with extents, sorted by inode number: its pages in key order.
pub type PageTable = Vec<(Ino, PageList)>;

/// A decoded root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Root {
    /// The image: the inline extents of files without pages, none of the
    /// paged files'.
    pub image: MetaImage,
    pub pages: PageTable,
}

/// A decoded root of the indexed form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexedRoot {
    /// The image: the inline extents of files without index pages, none
    /// of the paged files'.
    pub image: MetaImage,
    pub index: IndexTable,
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
    pages: &PageTable,
    block_size: u64,
) -> Result<Vec<u8>> {
    // This form lists every page in the root anyway: a flat copy of the
    // references costs no more than the root's own bytes.
    let flat: Table<PageRef> = pages
        .iter()
        .map(|(ino, list)| (*ino, list.iter().copied().collect()))
        .collect();
    encode_table_root_after(room, next_ino, inodes, &flat, block_size)
}

/// As [`encode_root_after`], in the indexed form: per paged file its
/// index pages (`index`, sorted by inode number). Refuses what
/// [`decode_indexed_root_at`] would refuse, but for where the index pages
/// are.
pub fn encode_indexed_root_after(
    room: usize,
    next_ino: Ino,
    inodes: &[&InodeImage],
    index: &[(Ino, Vec<IndexRef>)],
    block_size: u64,
) -> Result<Vec<u8>> {
    encode_table_root_after(room, next_ino, inodes, index, block_size)
}

fn encode_table_root_after<R: TableRef>(
    room: usize,
    next_ino: Ino,
    inodes: &[&InodeImage],
    table: &[(Ino, Vec<R>)],
    block_size: u64,
) -> Result<Vec<u8>> {
    let invalid = |reason: String| Error::invalid("encoding a checkpoint root", reason);
    if let Some(i) = inodes
        .iter()
        .find(|i| i.extents.len() > inline_extents_max(block_size))
    {
        return Err(invalid(too_many_inline(i.ino, i.extents.len(), block_size)));
    }
    check_table(
        inodes.iter().map(|i| (i.ino, i.kind, i.extents.len())),
        table,
        block_size,
    )
    .map_err(invalid)?;
    let heads: Vec<(&InodeImage, &dyn ExtentSource)> = inodes
        .iter()
        .map(|&i| (i, &i.extents as &dyn ExtentSource))
        .collect();
    let mut bytes = encode_image_from(room + 8, next_ino, &heads)?;
    let image_len = (bytes.len() - room - 8) as u64;
    bytes[room..room + 8].copy_from_slice(&image_len.to_le_bytes());
    let refs: usize = table.iter().map(|(_, list)| list.len()).sum();
    let mut enc =
        Encoder::with_capacity(8 + table.len() * FILE_HEADER_ENCODED_LEN + refs * R::ENCODED_LEN);
    enc.u64(table.len() as u64);
    for (ino, list) in table {
        enc.u64(*ino);
        enc.u32(list.len() as u32);
        for r in list {
            r.encode(&mut enc);
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

/// Why a table does not fit its image's inodes (`(ino, kind, inline
/// extents)`, sorted): files sorted, each a regular file of the image
/// with no inline extents, each with references that follow the form's
/// rules at `block_size`.
fn check_table<R: TableRef>(
    inodes: impl Iterator<Item = (Ino, FileKind, usize)>,
    table: &[(Ino, Vec<R>)],
    block_size: u64,
) -> std::result::Result<(), String> {
    let noun = R::NOUN;
    let mut inodes = inodes.peekable();
    let mut prev = None;
    for (ino, list) in table {
        if prev.is_some_and(|p| p >= *ino) {
            return Err(format!("the {noun} table's inode {ino} is not sorted"));
        }
        prev = Some(*ino);
        while inodes.next_if(|&(i, _, _)| i < *ino).is_some() {}
        match inodes.peek() {
            Some(&(i, FileKind::Regular, 0)) if i == *ino => {}
            Some(&(i, FileKind::Regular, inline)) if i == *ino => {
                return Err(format!(
                    "inode {ino} has extent {noun}s and {inline} extents inline"
                ));
            }
            Some(&(i, kind, _)) if i == *ino => {
                return Err(format!("{kind:?} {ino} has extent {noun}s"));
            }
            _ => {
                return Err(format!(
                    "the {noun} table names inode {ino}, which is not in the image"
                ))
            }
        }
        if list.is_empty() {
            return Err(format!("inode {ino} is listed with no {noun}s"));
        }
        R::check_list(list, block_size).map_err(|r| format!("inode {ino}: {r}"))?;
    }
    Ok(())
}

/// Decodes a root from `bytes` (exactly one, read from device byte
/// `base`): the image, then the page table, checked (including that every
/// page lies in `area`) before any page is read.
pub fn decode_root_at(bytes: &[u8], base: u64, what: &'static str, area: PageArea) -> Result<Root> {
    let (image, pages) = decode_table_root_at::<PageRef>(bytes, base, what, area)?;
    let pages = pages
        .into_iter()
        .map(|(ino, list)| (ino, PageList::from(list)))
        .collect();
    Ok(Root { image, pages })
}

/// As [`decode_root_at`], in the indexed form: the image, then the index
/// table, checked (including that every index page lies in `area`) before
/// any index page is read.
pub fn decode_indexed_root_at(
    bytes: &[u8],
    base: u64,
    what: &'static str,
    area: PageArea,
) -> Result<IndexedRoot> {
    let (image, index) = decode_table_root_at(bytes, base, what, area)?;
    Ok(IndexedRoot { image, index })
}

/// The table of a root decoded from `bytes`.
type Table<R> = Vec<(Ino, Vec<R>)>;

fn decode_table_root_at<R: TableRef>(
    bytes: &[u8],
    base: u64,
    what: &'static str,
    area: PageArea,
) -> Result<(MetaImage, Table<R>)> {
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
    let mut table: Table<R> = Vec::with_capacity(files);
    for _ in 0..files {
        let ino = dec.u64()?;
        let count = dec.count_u32(R::ENCODED_LEN, R::NOUN)?;
        let mut list = Vec::with_capacity(count);
        for _ in 0..count {
            let at = dec.position();
            let r = R::decode(&mut dec)?;
            r.check_area(&area)
                .map_err(|reason| dec.error_at(at, format!("inode {ino}: {reason}")))?;
            list.push(r);
        }
        table.push((ino, list));
    }
    dec.finish()?;
    check_table(
        image
            .inodes
            .iter()
            .map(|i| (i.ino, i.kind, i.extents.len())),
        &table,
        area.block_size,
    )
    .map_err(|reason| dec.error_at(table_at, reason))?;
    Ok((image, table))
}

#[cfg(test)]
mod tests {
    use super::super::image::tests::random_image;
    use super::super::index::encode_index_page;
    use super::super::page::encode_page;
    use super::*;
    use crate::types::Extent;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::fmt::Debug;

    const AREA: PageArea = PageArea {
        start: 1 << 20,
        len: 1 << 30,
        block_size: 4096,
    };

    /// An image with extents, and the root of it: every other regular file
    /// with extents keeps them inline, the others' are in pages of up to
    /// three, placed one after another in `AREA`. Returns the image the
    /// root holds (no extents for paged files).
    fn image_and_root() -> (MetaImage, Vec<u8>, Table<PageRef>) {
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
        let root = encode_root_after(52, image.next_ino, &heads, &listed(&pages), AREA.block_size)
            .unwrap();
        (image, root, pages)
    }

    /// `table` as a root's encoder takes it.
    fn listed(table: &Table<PageRef>) -> PageTable {
        table
            .iter()
            .map(|(ino, list)| (*ino, PageList::from(list.clone())))
            .collect()
    }

    /// The root of [`image_and_root`]'s image in the indexed form: each
    /// paged file's pages listed by index pages of up to two, placed in
    /// `AREA` after the pages.
    fn image_and_indexed_root() -> (MetaImage, Vec<u8>, IndexTable) {
        let (image, _, pages) = image_and_root();
        let mut addr = AREA.start + AREA.len / 2;
        let index: IndexTable = pages
            .iter()
            .map(|(ino, list)| {
                let runs = list.chunks(2).map(|run| {
                    let (bytes, index) = encode_index_page(
                        0,
                        *ino,
                        run,
                        AREA.block_size,
                        [addr, addr + AREA.block_size],
                    )
                    .unwrap();
                    addr += 2 * bytes.len() as u64;
                    index
                });
                (*ino, runs.collect())
            })
            .collect();
        assert!(index.iter().any(|(_, l)| l.len() >= 2), "a file of runs");
        let heads: Vec<&InodeImage> = image.inodes.iter().collect();
        let root =
            encode_indexed_root_after(52, image.next_ino, &heads, &index, AREA.block_size).unwrap();
        (image, root, index)
    }

    /// One form of the root, through its public encoder and decoder, so
    /// each test below runs for both.
    trait Form: TableRef + Clone + PartialEq + Debug {
        fn fixture() -> (MetaImage, Vec<u8>, Table<Self>);
        fn encode_root(image: &MetaImage, table: &Table<Self>, block_size: u64) -> Result<Vec<u8>> {
            let heads: Vec<&InodeImage> = image.inodes.iter().collect();
            Self::encode_heads(&heads, image.next_ino, table, block_size)
        }
        fn encode_heads(
            heads: &[&InodeImage],
            next_ino: Ino,
            table: &Table<Self>,
            block_size: u64,
        ) -> Result<Vec<u8>>;
        fn decode_root(bytes: &[u8]) -> Result<(MetaImage, Table<Self>)>;
    }

    impl Form for PageRef {
        fn fixture() -> (MetaImage, Vec<u8>, Table<Self>) {
            image_and_root()
        }
        fn encode_heads(
            heads: &[&InodeImage],
            next_ino: Ino,
            table: &Table<Self>,
            block_size: u64,
        ) -> Result<Vec<u8>> {
            encode_root_after(0, next_ino, heads, &listed(table), block_size)
        }
        fn decode_root(bytes: &[u8]) -> Result<(MetaImage, Table<Self>)> {
            decode_root_at(bytes, 0, "root", AREA).map(|r| {
                let pages = r.pages.iter();
                let pages = pages.map(|(ino, l)| (*ino, l.iter().copied().collect()));
                (r.image, pages.collect())
            })
        }
    }

    impl Form for IndexRef {
        fn fixture() -> (MetaImage, Vec<u8>, Table<Self>) {
            image_and_indexed_root()
        }
        fn encode_heads(
            heads: &[&InodeImage],
            next_ino: Ino,
            table: &Table<Self>,
            block_size: u64,
        ) -> Result<Vec<u8>> {
            encode_indexed_root_after(0, next_ino, heads, table, block_size)
        }
        fn decode_root(bytes: &[u8]) -> Result<(MetaImage, Table<Self>)> {
            decode_indexed_root_at(bytes, 0, "root", AREA).map(|r| (r.image, r.index))
        }
    }

    fn round_trip<R: Form>() {
        let (image, root, table) = R::fixture();
        assert!(root[..52].iter().all(|&b| b == 0), "room left for a header");
        let (got_image, got_table) = R::decode_root(&root[52..]).unwrap();
        assert!(got_image.inodes.iter().any(|i| !i.extents.is_empty()));
        assert_eq!(got_image, image);
        assert_eq!(got_table, table);
        assert_eq!(
            R::encode_root(&image, &table, AREA.block_size).unwrap(),
            root[52..]
        );
    }

    #[test]
    fn a_root_decodes_to_its_image_with_the_inline_extents_and_its_pages() {
        round_trip::<PageRef>();
        let (image, root, pages) = image_and_root();
        let got = decode_root_at(&root[52..], 0, "root", AREA).unwrap();
        assert_eq!(
            got,
            Root {
                image,
                pages: listed(&pages)
            }
        );
    }

    #[test]
    fn an_indexed_root_decodes_to_its_image_with_the_inline_extents_and_its_index() {
        round_trip::<IndexRef>();
        let (image, root, index) = image_and_indexed_root();
        let got = decode_indexed_root_at(&root[52..], 0, "root", AREA).unwrap();
        assert_eq!(got, IndexedRoot { image, index });
        // Each paged file's entry: 12 bytes and 56 per index page.
        let (_, plain, pages) = image_and_root();
        let refs = |n: usize| pages.iter().map(|(_, l)| n * l.len()).sum::<usize>();
        let index_refs: usize = got.index.iter().map(|(_, l)| l.len()).sum();
        assert_eq!(
            root.len() + refs(PAGE_REF_ENCODED_LEN),
            plain.len() + index_refs * INDEX_REF_ENCODED_LEN
        );
    }

    /// A file keeps at most a block's worth of extents inline, and a file
    /// with pages (index pages) none: refused both ways.
    fn inline_refusals<R: Form>() {
        let (image, _, table) = R::fixture();
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
        let at_max = R::encode_root(&grow(max), &table, AREA.block_size).unwrap();
        assert_eq!(R::decode_root(&at_max).unwrap().0, grow(max));
        let err = R::encode_root(&grow(max + 1), &table, AREA.block_size)
            .unwrap_err()
            .to_string();
        assert!(err.contains("inline"), "{err}");
        // The same bytes the encoder refuses, built by hand: a block of 8192
        // bytes keeps more inline, so encode there and decode at 4096 (with
        // no table: the index form's page bytes follow the block size).
        let bytes = R::encode_root(&grow(max + 1), &Vec::new(), 8192).unwrap();
        let err = R::decode_root(&bytes).unwrap_err().to_string();
        assert!(err.contains("inline"), "{err}");
        // A paged file with extents inline as well.
        let mut both = image.clone();
        let paged = both
            .inodes
            .iter()
            .position(|i| i.ino == table[0].0)
            .unwrap();
        both.inodes[paged].extents = image.inodes[small].extents.clone();
        both.inodes[paged].size = both.inodes[paged].size.max(image.inodes[small].size);
        let beside = format!("extent {}s and", R::NOUN);
        let err = R::encode_root(&both, &table, AREA.block_size)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&beside), "{err}");
        let mut bytes = R::encode_root(&both, &Vec::new(), AREA.block_size).unwrap();
        // The same image with the right table after it.
        let good = R::encode_root(&image, &table, AREA.block_size).unwrap();
        bytes.truncate(bytes.len() - 8);
        bytes.extend_from_slice(&good[8 + image_len(&good)..]);
        let err = R::decode_root(&bytes).unwrap_err().to_string();
        assert!(err.contains(&beside), "{err}");
    }

    #[test]
    fn inline_extents_past_a_block_or_beside_pages_are_refused() {
        assert_eq!(inline_extents_max(4096), 162);
        assert_eq!(inline_extents_max(512), 19);
        inline_refusals::<PageRef>();
    }

    #[test]
    fn inline_extents_past_a_block_or_beside_index_pages_are_refused() {
        inline_refusals::<IndexRef>();
    }

    fn image_len(root: &[u8]) -> usize {
        u64::from_le_bytes(root[..8].try_into().unwrap()) as usize
    }

    /// The table must fit the image: every file named is a regular file
    /// of the image with references in order, that pass the form's checks,
    /// inside the data area.
    fn table_refusals<R: Form>() -> Vec<u8> {
        let (image, root, table) = R::fixture();
        let bytes = &root[52..];
        let first_ino_at = 8 + image_len(bytes) + 8;
        let dir = image
            .inodes
            .iter()
            .find(|i| i.kind == FileKind::Directory)
            .unwrap()
            .ino;
        // The root with `v` written at byte `at`: refused, saying `why`.
        let refused = |at: usize, v: &[u8], why: &str| {
            let mut bad = bytes.to_vec();
            bad[at..at + v.len()].copy_from_slice(v);
            let err = R::decode_root(&bad).unwrap_err();
            assert!(err.to_string().contains(why), "{why}: {err}");
        };
        for (ino, why) in [(dir, "Directory"), (image.next_ino, "not in the image")] {
            refused(first_ino_at, &ino.to_le_bytes(), why);
        }
        // The first reference's address (the first field of both forms),
        // out of the data area, then misaligned.
        let addr_at = first_ino_at + 12;
        refused(addr_at, &(AREA.start - 4096).to_le_bytes(), "data area");
        refused(addr_at, &(AREA.start + 512).to_le_bytes(), "aligned");
        let end = AREA.start + AREA.len;
        refused(addr_at, &end.to_le_bytes(), "data area");
        // Its count (of extents, of pages: bytes 12..16 of both) zero.
        refused(addr_at + 12, &0u32.to_le_bytes(), "#0 lists 0");
        // A file's second reference at its first's key (bytes 16..24 of
        // both forms).
        let (two, _) = table
            .iter()
            .enumerate()
            .find(|(_, (_, l))| l.len() >= 2)
            .unwrap();
        let list_at = first_ino_at
            + table[..two]
                .iter()
                .map(|(_, l)| 12 + l.len() * R::ENCODED_LEN)
                .sum::<usize>()
            + 12;
        let key_at = |i: usize| list_at + i * R::ENCODED_LEN + 16;
        let first_key = bytes[key_at(0)..key_at(0) + 8].to_vec();
        refused(key_at(1), &first_key, "#1 starts at");
        // A file count past the bytes.
        refused(first_ino_at - 8, &u64::MAX.to_le_bytes(), "file count");
        // What the decoder refuses, the encoder refuses.
        let encode = |table: &Table<R>| R::encode_root(&image, table, AREA.block_size);
        let mut swapped = table.clone();
        swapped[0].0 = dir;
        assert!(encode(&swapped).is_err());
        let mut empty = table.clone();
        empty[0].1.clear();
        let err = encode(&empty).unwrap_err().to_string();
        assert!(err.contains(&format!("no {}s", R::NOUN)), "{err}");
        swapped = table.clone();
        swapped.swap(0, 1);
        assert!(encode(&swapped).is_err());
        let mut unsorted = table.clone();
        unsorted[two].1.swap(0, 1);
        assert!(encode(&unsorted).is_err());
        bytes.to_vec()
    }

    #[test]
    fn a_page_table_that_does_not_fit_its_image_is_refused() {
        table_refusals::<PageRef>();
    }

    /// As for pages, and the index form's own rules: page counts within a
    /// block, sums consistent with them, index pages one block each.
    #[test]
    fn an_index_table_that_does_not_fit_its_image_is_refused() {
        let bytes = table_refusals::<IndexRef>();
        let (image, _, index) = image_and_indexed_root();
        let first = 8 + image_len(&bytes) + 8 + 12;
        for (field, value, why) in [
            (12, 128u64.to_le_bytes()[..4].to_vec(), "lists 128 pages"),
            (24, 0u64.to_le_bytes().to_vec(), "extents in"),
            (32, 0u64.to_le_bytes().to_vec(), "mapping only 0 bytes"),
            (40, 4095u64.to_le_bytes().to_vec(), "taking 4095 bytes"),
        ] {
            let mut bad = bytes.clone();
            bad[first + field..first + field + value.len()].copy_from_slice(&value);
            let err = IndexRef::decode_root(&bad).unwrap_err().to_string();
            assert!(err.contains(why), "{why}: {err}");
            let mut dec = Decoder::new(&bad[first..], 0, "test");
            let wrong = decode_index_ref(&mut dec).unwrap();
            let mut table = index.clone();
            table[0].1[0] = wrong;
            let err = IndexRef::encode_root(&image, &table, AREA.block_size).unwrap_err();
            assert!(err.to_string().contains(why), "{why}: {err}");
        }
        // The last block of the area holds an index page; a page there of
        // more than a block does not fit, where an index page does.
        let last = AREA.start + AREA.len - AREA.block_size;
        let mut at_end = bytes.clone();
        at_end[first..first + 8].copy_from_slice(&last.to_le_bytes());
        assert_eq!(IndexRef::decode_root(&at_end).unwrap().1[0].1[0].addr, last);
    }

    /// Any truncation or flipped byte: an error or a root, never a panic.
    fn hostile<R: Form>() {
        let (_, root, _) = R::fixture();
        let bytes = &root[52..];
        for n in 0..bytes.len() {
            assert!(R::decode_root(&bytes[..n]).is_err(), "{n}");
        }
        let mut rng = SmallRng::seed_from_u64(7);
        for _ in 0..2000 {
            let mut bad = bytes.to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..bad.len());
                bad[i] = rng.gen();
            }
            let _ = R::decode_root(&bad);
        }
    }

    #[test]
    fn hostile_roots_never_panic() {
        hostile::<PageRef>();
    }

    #[test]
    fn hostile_indexed_roots_never_panic() {
        hostile::<IndexRef>();
        // A root of one form read as the other: an error or a root, the
        // reader trusts only the superblock's bit to tell them apart.
        let (_, pages, _) = image_and_root();
        let (_, index, _) = image_and_indexed_root();
        let _ = IndexRef::decode_root(&pages[52..]);
        let _ = PageRef::decode_root(&index[52..]);
    }
}
