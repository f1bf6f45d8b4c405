//! Byte encoding of journal records and metadata images.
//!
//! Everything is little-endian. [`Encoder`] appends to a `Vec<u8>` (or, with
//! [`Measure`], only counts); [`Decoder`] reads from a borrowed slice and
//! never panics: every read is bounds-checked, every count is checked
//! against the bytes that remain before anything is allocated for it, and
//! every failure is an [`Error::Corrupt`] that names the device byte where
//! decoding failed.
//!
//! The encoder refuses (with [`Error::InvalidArgument`]) to write anything the
//! decoder would reject, so a value that encodes always decodes back.
//!
//! The exact byte layouts are documented in `docs/FORMAT.md`.
//!
//! `primitive` holds the values every layout is built of (integers,
//! strings, names, counts, enum codes), `record` the journal records and
//! `image` the checkpoint's metadata image, `delta` a delta
//! checkpoint's changes to it, `page` the extent pages a checkpoint
//! root refers to, `page_list` a file's references to them in shared runs, `index` the index pages that list those pages in a
//! root's indexed form, and `root` that root (either form). This module
//! only gathers them.
//!
//! [`Error::Corrupt`]: crate::Error::Corrupt
//! [`Error::InvalidArgument`]: crate::Error::InvalidArgument

mod delta;
mod image;
mod index;
mod page;
mod page_list;
/// Extents for tests of code that stores them (as the page tests build them).
#[cfg(test)]
pub(crate) use page::tests::extents as test_extents;
mod primitive;
mod record;
mod root;

pub use delta::{
    decode_delta_at, delta_encoded_len, encode_delta, encode_delta_after, DeltaLink,
    DELTA_LINK_ENCODED_LEN, SPAN_ENCODED_LEN,
};
pub use image::{
    check_extent, check_inode, decode_image, decode_image_at, encode_image, encode_image_after,
    encode_image_from, image_encoded_len, inode_encoded_len, ExtentSource, ENTRY_MIN_ENCODED_LEN,
    EXTENT_ENCODED_LEN, IMAGE_HEADER_ENCODED_LEN, INODE_FIXED_ENCODED_LEN, XATTR_MIN_ENCODED_LEN,
    XATTR_OVERHEAD_ENCODED_LEN,
};
pub use index::{
    check_index_refs, decode_index_page, decode_index_ref, encode_index_page, encode_index_ref,
    index_lost, index_max_pages, IndexRef, IndexTable, INDEX_COPIES, INDEX_HEADER_LEN, INDEX_MAGIC,
    INDEX_REF_ENCODED_LEN,
};
pub use page::{
    check_page_refs, decode_page, decode_page_ref, encode_page, encode_page_ref, page_len,
    page_lost, PageArea, PageRef, PAGE_HEADER_LEN, PAGE_MAGIC, PAGE_MAX_EXTENTS,
    PAGE_REF_ENCODED_LEN,
};
pub use page_list::{PageCursor, PageList, PageRun};
pub use primitive::{
    check_attrs, check_mode, check_name, check_symlink_target, check_xattr_name, Decoder, Encoder,
    Measure, Sink, ATTRS_ENCODED_LEN,
};
pub use record::{decode_record, encode_record, record_encoded_len, RECORD_MIN_ENCODED_LEN};
pub use root::{
    decode_indexed_root_at, decode_root_at, encode_indexed_root_after, encode_root_after,
    inline_extents_max, IndexedRoot, PageTable, Root,
};

#[cfg(test)]
pub(crate) use image::tests::random_image;
